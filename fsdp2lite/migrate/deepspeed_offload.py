"""DeepSpeed's ``offload_optimizer`` and ``offload_param`` (and their deprecated flags) as fsdp2lite's ``offload``.

DeepSpeed has two offload sections; fsdp2lite has one ``offload`` section that holds every shape:

    offload_optimizer  offload_param (stage 3)  fsdp2lite offload                     on the host
    cpu                none                     device: cpu, optimizer_only: true     masters, gradients, optimizer
                                                                                      state (ZeRO-Offload)
    nvme               none                     ... optimizer_only: true,             masters, gradients; the
                                                optimizer: nvme, nvme_path            optimizer state in files
    none               cpu or nvme              device: cpu, optimizer_only: false    parameters, gradients, optimizer
                                                                                      state (parameter offload)
    cpu                cpu or nvme              device: cpu, optimizer_only: false    the same (full offload)
    nvme               cpu or nvme              ... optimizer_only: false,            parameters, gradients; the
                                                optimizer: nvme, nvme_path            optimizer state in files

ZeRO-Offload keeps the shards and the gradients' reduction on the device; parameter offload moves the shards
too, and the optimizer goes with them. ``offload_optimizer: {device: nvme}`` is ZeRO-Infinity's optimizer
offload: fsdp2lite keeps the state in one file per rank under ``nvme_path`` (``optimizer: nvme``). There is no
parameter offload to NVMe in fsdp2lite: ``offload_param: {device: nvme}`` keeps the parameters in host RAM,
and the report and a note say so. DeepSpeed's swap-buffer and async-I/O settings are reported by name, dropped:
fsdp2lite's own NVMe path has none of those knobs ([Note: optimizer state on NVMe] in ``host/nvme.py``).

Which key the walk meets first must not change the result, so ``read_offload`` reads both sections (and the
deprecated ``cpu_offload``, ``cpu_offload_param``, ``cpu_offload_use_pin_memory``) from the whole input
before the walk; every offload key's handler writes the same whole ``offload`` section from that record.
Accelerate's DeepSpeed plugin (``deepspeed_config.offload_*_device``, ``accelerate_deepspeed``) names the same
settings with other keys: ``OffloadKeys`` says where a source keeps them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from .common import Handler, Migration, MigrationError, Rule, set_key

Section = Literal["optimizer", "param"]
SECTIONS: tuple[Section, ...] = ("optimizer", "param")
_DEVICES = ("none", "cpu", "nvme")
_ZERO = "zero_optimization"
_RECORD = "_ds_offload"  # the Migration.data key the record lives under during the walk (private: popped after)
NO_PARAM_NVME = "fsdp2lite has no parameter offload to NVMe: the parameters go to host RAM, not NVMe"


class OffloadKeys(NamedTuple):
    """Where a source keeps DeepSpeed's offload settings: dotted keys of its flattened input."""

    device: dict[Section, str]
    pin: dict[Section, str | None]  # None: the source has no such key (DeepSpeed's default, false)
    nvme_path: dict[Section, str]
    stage: str
    default_stage: int | None  # the stage when ``stage`` is not given
    deprecated: dict[Section, str]  # DeepSpeed's old boolean flags for the sections ({} where none)
    deprecated_pin: str | None


def deepspeed_keys(prefix: str = "") -> OffloadKeys:
    """A DeepSpeed config's keys, under ``prefix`` where it sits inside another tool's file."""
    zero = f"{prefix}{_ZERO}"
    return OffloadKeys(
        device={s: f"{zero}.offload_{s}.device" for s in SECTIONS},
        pin={s: f"{zero}.offload_{s}.pin_memory" for s in SECTIONS},
        nvme_path={s: f"{zero}.offload_{s}.nvme_path" for s in SECTIONS},
        stage=f"{zero}.stage",
        default_stage=None,
        deprecated={"optimizer": f"{zero}.cpu_offload", "param": f"{zero}.cpu_offload_param"},
        deprecated_pin=f"{zero}.cpu_offload_use_pin_memory",
    )


@dataclass(frozen=True)
class SectionAsked:
    """What one DeepSpeed offload section asks."""

    device: str  # none | cpu | nvme
    key: str  # the input key that said it, for the policy file's comments
    pin: bool  # pin_memory (else the deprecated flag; DeepSpeed's default false)
    nvme_path: str | None  # with device nvme: the directory (DeepSpeed requires it)


@dataclass(frozen=True)
class OffloadAsked:
    """What a DeepSpeed config asks to offload, read from the whole input before the key walk."""

    optimizer: SectionAsked
    param: SectionAsked
    stage: Any  # DeepSpeed offloads parameters at stage 3 only

    @property
    def params_on_host(self) -> bool:
        """Parameter offload in effect: cpu, or nvme kept in host RAM (fsdp2lite has no parameter NVMe)."""
        return self.param.device != "none" and self.stage == 3

    @property
    def offloaded(self) -> bool:
        return self.params_on_host or self.optimizer.device != "none"

    @property
    def pin_memory(self) -> bool:
        """fsdp2lite pins its host copy when an offloaded section asks for pinning."""
        return any(self.in_effect(s) and self.section(s).pin for s in SECTIONS)

    def section(self, section: Section) -> SectionAsked:
        return self.optimizer if section == "optimizer" else self.param

    def in_effect(self, section: Section) -> bool:
        return self.params_on_host if section == "param" else self.optimizer.device != "none"


def read_offload(path: str, flat: dict[str, Any], keys: OffloadKeys) -> OffloadAsked:
    """Both offload sections of a flattened config, checked: devices none | cpu | nvme, booleans for the flags,
    a deprecated flag not given beside the section that replaced it (DeepSpeed refuses that), and an
    ``nvme_path`` for each section in effect that offloads to NVMe (DeepSpeed requires one)."""
    old_pin = _bool(path, flat, keys.deprecated_pin) if keys.deprecated_pin else None
    stage = flat.get(keys.stage, keys.default_stage)
    asked = OffloadAsked(
        optimizer=_read_section(path, flat, keys, "optimizer", old_pin),
        param=_read_section(path, flat, keys, "param", old_pin),
        stage=int(stage) if isinstance(stage, str) and stage.strip().isdigit() else stage,
    )
    for section in SECTIONS:
        asked_section = asked.section(section)
        if asked.in_effect(section) and asked_section.device == "nvme" and not asked_section.nvme_path:
            raise MigrationError(
                f"{path}: {asked_section.key} is nvme but {keys.nvme_path[section]} is not given: DeepSpeed "
                "requires the directory for device nvme; add it (a directory on a fast local disk)"
            )
    return asked


def _read_section(
    path: str, flat: dict[str, Any], keys: OffloadKeys, section: Section, old_pin: bool | None
) -> SectionAsked:
    device, key = _device(path, flat, keys, section)
    pin_key = keys.pin[section]
    pin = _bool(path, flat, pin_key) if pin_key else None
    return SectionAsked(device, key, bool(pin if pin is not None else old_pin), _nvme_path(path, flat, keys, section))


def _device(path: str, flat: dict[str, Any], keys: OffloadKeys, section: Section) -> tuple[str, str]:
    """The section's device and the key that says it (the deprecated flag where that is given)."""
    key, old_key = keys.device[section], keys.deprecated.get(section)
    old = _bool(path, flat, old_key) if old_key else None
    section_prefix = key.rsplit(".", 1)[0] + "."
    if old is not None and any(k.startswith(section_prefix) for k in flat):
        raise MigrationError(
            f"{path}: {old_key} (deprecated) and {section_prefix[:-1]} are both given; "
            f"DeepSpeed refuses the pair: keep offload_{section}"
        )
    if old is not None and old_key:
        return ("cpu" if old else "none"), old_key
    value = flat.get(key)
    device = "none" if value is None else str(value).lower()
    if device not in _DEVICES:
        raise MigrationError(f"{path}: {key} {value!r}: expected one of {', '.join(_DEVICES)}")
    return device, key


def _nvme_path(path: str, flat: dict[str, Any], keys: OffloadKeys, section: Section) -> str | None:
    key = keys.nvme_path[section]
    value = flat.get(key)
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none")):
        return None  # Accelerate writes the string "none" for no path
    if not isinstance(value, str):
        raise MigrationError(f"{path}: {key} {value!r}: expected a directory path")
    return value


def _bool(path: str, flat: dict[str, Any], key: str) -> bool | None:
    value = flat.get(key)
    if value is not None and not isinstance(value, bool):
        raise MigrationError(f"{path}: {key} {value!r}: expected true or false")
    return value


def _asked(m: Migration) -> OffloadAsked:
    asked = m.data.get(_RECORD)
    if not isinstance(asked, OffloadAsked):
        raise RuntimeError(f"expected the offload record under Migration.data[{_RECORD!r}], found {asked!r}")
    return asked


def record_offload(m: Migration, flat: dict[str, Any], keys: OffloadKeys | None = None) -> None:
    """Read the offload sections before the walk (see the module docstring); a note when parameters asked for
    NVMe stay in host RAM."""
    asked = read_offload(m.path, flat, keys or deepspeed_keys())
    m.data[_RECORD] = asked
    if asked.params_on_host and asked.param.device == "nvme":
        m.notes.append(
            f"{asked.param.key} is nvme, but {NO_PARAM_NVME} (offload: {{device: cpu, optimizer_only: false}}): "
            "each rank's host memory holds its parameter shards and their gradients"
            + ("" if asked.optimizer.device == "nvme" else ", and the optimizer state")
            + ", so size the host memory for them"
        )


def _write_offload(m: Migration) -> str:
    """The whole ``offload`` section from the record (the same whatever key writes it), and what it means."""
    asked = _asked(m)
    origin = " + ".join(_origins(asked))
    set_key(m, "offload.device", "cpu", origin)
    set_key(m, "offload.optimizer_only", not asked.params_on_host, origin)
    set_key(m, "offload.pin_memory", asked.pin_memory, origin)
    fields = f"device: cpu, optimizer_only: {str(not asked.params_on_host).lower()}"
    nvme_dir = asked.optimizer.nvme_path if asked.optimizer.device == "nvme" else None
    if nvme_dir is not None:
        set_key(m, "offload.optimizer", "nvme", origin)
        set_key(m, "offload.nvme_path", nvme_dir, origin)
        fields += f", optimizer: nvme, nvme_path: {nvme_dir}"
    fields += f", pin_memory: {str(asked.pin_memory).lower()}"
    return f"offload: {{{fields}}} ({_meaning(asked, nvme_dir)})"


def _meaning(asked: OffloadAsked, nvme_dir: str | None) -> str:
    """What the written ``offload`` section does, in the report's words."""
    state = "optimizer state" if nvme_dir is None else f"the optimizer state in one file per rank under {nvme_dir}"
    if not asked.params_on_host:
        if nvme_dir is None:
            return (
                "ZeRO-Offload: the shards and the gradients' reduction stay on the device; fp32 masters, gradients "
                "and optimizer state live and step on the host"
            )
        return (
            "ZeRO-Infinity's optimizer offload: the shards and the gradients' reduction stay on the device; fp32 "
            f"masters and gradients on the host, {state}, streamed through the host at each step"
        )
    if nvme_dir is None:
        full = asked.optimizer.device == "cpu"
        shape = "parameters, gradients and optimizer state on the host; "
        shape += "full offload" if full else "stage 3 parameter offload: the optimizer goes with them"
    else:
        shape = f"parameters and gradients on the host, {state}"
    return shape + (f"; {NO_PARAM_NVME}" if asked.param.device == "nvme" else "")


def _origins(asked: OffloadAsked) -> list[str]:
    return [asked.section(s).key for s in SECTIONS if asked.in_effect(s)]


def _section(section: Section) -> Handler:
    """``offload_*`` given as ``{}`` or null (no keys to walk): nothing offloaded; anything else is refused."""

    def handle(m: Migration, value: Any) -> str:
        if value not in (None, {}):
            raise MigrationError(
                f"{m.path}: {_ZERO}.offload_{section} {value!r}: expected a mapping such as {{device: cpu}}"
            )
        return f"nothing (offload_{section} {value!r}: device none)"

    return handle


def device_key(section: Section) -> Handler:
    """``offload_*.device`` (or the deprecated flag): the whole offload section, as the record says."""

    def handle(m: Migration, value: Any) -> str:
        asked = _asked(m)
        device = asked.section(section).device
        if device == "none":
            return f"nothing (offload_{section} off: device none)"
        if not asked.in_effect(section):
            return (
                f"dropped: DeepSpeed offloads parameters at stage 3 only (stage is {asked.stage!r}): "
                "they stay on the device"
            )
        return _write_offload(m)

    return handle


def _deprecated(section: Section) -> Handler:
    """``cpu_offload`` / ``cpu_offload_param``: DeepSpeed reads them as ``offload_*: {device: cpu}``."""
    handle_device = device_key(section)

    def handle(m: Migration, value: Any) -> str:
        return f"{handle_device(m, value)} (deprecated; DeepSpeed reads it as offload_{section}.device)"

    return handle


def _pin_key(section: Section | None) -> Handler:
    """``offload_*.pin_memory`` (None: the deprecated ``cpu_offload_use_pin_memory``, for both sections)."""

    def handle(m: Migration, value: Any) -> str:
        asked = _asked(m)
        in_effect = asked.offloaded if section is None else asked.in_effect(section)
        if not in_effect:
            what = "nothing is offloaded" if section is None else f"offload_{section} does not offload"
            return f"dropped: {what}: nothing to pin"
        _write_offload(m)
        return f"offload.pin_memory: {str(asked.pin_memory).lower()} (the host copy is pinned when an offload asks)"

    return handle


def nvme_path_key(section: Section) -> Handler:
    """``offload_*.nvme_path``: the optimizer's is fsdp2lite's ``offload.nvme_path``; the parameters' has no
    equivalent (they stay in host RAM)."""

    def handle(m: Migration, value: Any) -> str:
        asked = _asked(m)
        device = asked.section(section).device
        if device != "nvme":
            return f"dropped: read by DeepSpeed only with device nvme (offload_{section} device is {device})"
        if not asked.in_effect(section):
            return f"dropped: DeepSpeed offloads parameters at stage 3 only (stage is {asked.stage!r})"
        if section == "optimizer":
            _write_offload(m)
            return f"offload.nvme_path: {value} (optimizer: nvme: the optimizer state in one file per rank there)"
        return f"unsupported: parameter offload to NVMe; {NO_PARAM_NVME} (nothing is written under {value})"

    return handle


def _swap_setting(section: Section, why: str) -> Handler:
    """A DeepSpeed NVMe swap setting: read only when the section offloads to NVMe; fsdp2lite has no such knob."""

    def handle(m: Migration, value: Any) -> str:
        device = _asked(m).section(section).device
        if device != "nvme":
            return f"dropped: read by DeepSpeed only with device nvme (offload_{section} device is {device})"
        return f"dropped: {why}"

    return handle


def _ratio(m: Migration, value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise MigrationError(f"{m.path}: {_ZERO}.offload_optimizer.ratio {value!r}: expected a number in [0, 1]")
    if value == 1 or _asked(m).optimizer.device == "none":
        return f"nothing ({value}: all of the optimizer state goes where offload_optimizer.device says)"
    return f"unsupported: partial optimizer offload (ratio {value}): fsdp2lite offloads all of it or none"


def _super_offload(m: Migration, value: Any) -> str:
    if value is True:
        return "unsupported: SuperOffload (Superchips' CPU-GPU optimizer offload)"
    return "nothing (off)"


_STAGING = "fsdp2lite stages the optimizer state through two host buffers, each the largest group's state"
_PARAM_SWAP = f"DeepSpeed's NVMe parameter swapping; {NO_PARAM_NVME}: nothing is swapped"
_AIO = "fsdp2lite reads and writes its optimizer state files with plain os.preadv/os.pwrite on one I/O thread"
# DeepSpeed's swap settings, each with why fsdp2lite has no equivalent ([Note: optimizer state on NVMe])
SWAP_SETTINGS: dict[Section, dict[str, str]] = {
    "optimizer": {
        "buffer_count": f"DeepSpeed's pool of swap buffers for the optimizer state: {_STAGING}, no pool to size",
        "pipeline_read": "overlaps DeepSpeed's next swap-in with the step: fsdp2lite always reads the next group's "
        "state while this group steps",
        "pipeline_write": "overlaps DeepSpeed's swap-out with the step: fsdp2lite always writes a group's state on "
        "its I/O thread while the next group steps",
        "fast_init": "DeepSpeed's faster first write of the state to NVMe: fsdp2lite reserves each rank's file "
        "before the first step and writes the state the first step creates",
    },
    "param": {
        "buffer_count": f"the number of parameter swap buffers: {_PARAM_SWAP}",
        "buffer_size": f"the size of each parameter swap buffer: {_PARAM_SWAP}",
        "max_in_cpu": f"the parameters DeepSpeed keeps in host memory: {_PARAM_SWAP} (all of them stay there)",
    },
}
AIO_SETTINGS = {
    "block_size": f"the async I/O request size: {_AIO}",
    "queue_depth": f"the async I/O queue depth: {_AIO}",
    "thread_count": f"the async I/O threads: {_AIO}",
    "intra_op_parallelism": f"the async I/O threads: {_AIO}",
    "single_submit": f"how libaio submits requests: {_AIO}",
    "overlap_events": f"how libaio overlaps submission and completion: {_AIO}",
    "use_gds": f"GPUDirect Storage: {_AIO} (through host memory)",
}


def offload_rules(prefix: str = "") -> dict[str, Rule]:
    """The offload keys of a DeepSpeed config under ``prefix`` (where it sits inside another tool's file)."""
    zero = f"{prefix}{_ZERO}"
    rules: dict[str, Rule] = {
        f"{zero}.cpu_offload": _deprecated("optimizer"),
        f"{zero}.cpu_offload_param": _deprecated("param"),
        f"{zero}.cpu_offload_use_pin_memory": _pin_key(None),
        f"{zero}.offload_optimizer.ratio": _ratio,
        f"{zero}.offload_optimizer.super_offload": _super_offload,
        f"{zero}.offload_optimizer.convert_grad_on_cpu": (
            "dropped",
            "gradients are reduced on the device in reduce_dtype and copied to the host as they are",
        ),
        f"{zero}.offload_optimizer.cpuadam_cores_perc": (
            "dropped",
            "the host step is the user's torch optimizer (set its threads with torch.set_num_threads)",
        ),
        **{f"{prefix}aio.{key}": ("dropped", why) for key, why in AIO_SETTINGS.items()},
        f"{prefix}aio.*": ("dropped", f"a DeepSpeed async I/O setting: {_AIO}"),
    }
    for section in SECTIONS:
        key = f"{zero}.offload_{section}"
        rules[key] = _section(section)
        rules[f"{key}.device"] = device_key(section)
        rules[f"{key}.pin_memory"] = _pin_key(section)
        rules[f"{key}.nvme_path"] = nvme_path_key(section)
        for name, why in SWAP_SETTINGS[section].items():
            rules[f"{key}.{name}"] = _swap_setting(section, why)
    return rules


OFFLOAD_RULES = offload_rules()
