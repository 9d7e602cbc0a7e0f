"""DeepSpeed's ``offload_optimizer`` and ``offload_param`` (and their deprecated flags) as fsdp2lite's ``offload``.

DeepSpeed has two offload sections; fsdp2lite has one ``offload`` section that holds either shape:

    offload_optimizer  offload_param (stage 3)  fsdp2lite offload                   on the host
    cpu                none                     device: cpu, optimizer_only: true   masters, gradients, optimizer
                                                                                    state (ZeRO-Offload)
    none               cpu                      device: cpu, optimizer_only: false  parameters, gradients, optimizer
                                                                                    state (parameter offload)
    cpu                cpu                      device: cpu, optimizer_only: false  the same (full offload)

ZeRO-Offload keeps the shards and the gradients' reduction on the device; parameter offload moves the shards
too, and the optimizer goes with them. NVMe offload (``device: nvme``, ZeRO-Infinity) is not built yet in
fsdp2lite: reported unsupported, as are its settings when the section offloads to NVMe.

Which key the walk meets first must not change the result, so ``read_offload`` reads both sections (and the
deprecated ``cpu_offload``, ``cpu_offload_param``, ``cpu_offload_use_pin_memory``) from the whole input
before the walk; every offload key's handler writes the same whole ``offload`` section from that record.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from .common import Handler, Migration, MigrationError, Rule, set_key

Section = Literal["optimizer", "param"]
NVME = "NVMe offload (ZeRO-Infinity) is not built yet in fsdp2lite"
_DEVICES = ("none", "cpu", "nvme")
_ZERO = "zero_optimization"
_DEPRECATED = {"optimizer": "cpu_offload", "param": "cpu_offload_param"}  # DeepSpeed's old flags for the sections
_RECORD = "_ds_offload"  # the Migration.data key the record lives under during the walk (private: popped after)


@dataclass(frozen=True)
class OffloadAsked:
    """What a DeepSpeed config asks to offload, read from the whole input before the key walk."""

    optimizer: str  # offload_optimizer.device (or cpu_offload: true): none | cpu | nvme
    param: str  # offload_param.device (or cpu_offload_param: true): none | cpu | nvme
    optimizer_key: str  # the input key that said it, for the policy file's comments
    param_key: str
    stage: Any  # zero_optimization.stage: DeepSpeed offloads parameters at stage 3 only
    optimizer_pin: bool  # offload_optimizer.pin_memory (else cpu_offload_use_pin_memory; DeepSpeed's default false)
    param_pin: bool

    @property
    def params_on_host(self) -> bool:
        return self.param == "cpu" and self.stage == 3

    @property
    def offloaded(self) -> bool:
        return self.params_on_host or self.optimizer == "cpu"

    @property
    def pin_memory(self) -> bool:
        """fsdp2lite pins its one host copy when a section offloaded to cpu asks for pinning."""
        return (self.optimizer == "cpu" and self.optimizer_pin) or (self.params_on_host and self.param_pin)

    def device(self, section: Section) -> str:
        return self.optimizer if section == "optimizer" else self.param


def read_offload(path: str, flat: dict[str, Any]) -> OffloadAsked:
    """Both offload sections of a flattened DeepSpeed config, checked: devices none | cpu | nvme, booleans
    for the flags, and a deprecated flag not given beside the section that replaced it (DeepSpeed refuses that)."""
    old_pin = _bool(path, flat, f"{_ZERO}.cpu_offload_use_pin_memory")
    (optimizer, optimizer_key), (param, param_key) = _device(path, flat, "optimizer"), _device(path, flat, "param")
    return OffloadAsked(
        optimizer=optimizer,
        param=param,
        optimizer_key=optimizer_key,
        param_key=param_key,
        stage=flat.get(f"{_ZERO}.stage"),
        optimizer_pin=_pin(path, flat, "optimizer", old_pin),
        param_pin=_pin(path, flat, "param", old_pin),
    )


def _device(path: str, flat: dict[str, Any], section: Section) -> tuple[str, str]:
    """The section's device and the key that says it (the deprecated flag where that is given)."""
    key = f"{_ZERO}.offload_{section}.device"
    old_key = f"{_ZERO}.{_DEPRECATED[section]}"
    old = _bool(path, flat, old_key)
    if old is not None and any(k.startswith(f"{_ZERO}.offload_{section}.") for k in flat):
        raise MigrationError(
            f"{path}: {_ZERO}.{_DEPRECATED[section]} (deprecated) and {_ZERO}.offload_{section} are both given; "
            f"DeepSpeed refuses the pair: keep offload_{section}"
        )
    if old is not None:
        return ("cpu" if old else "none"), old_key
    value = flat.get(key)
    device = "none" if value is None else str(value).lower()
    if device not in _DEVICES:
        raise MigrationError(f"{path}: {key} {value!r}: expected one of {', '.join(_DEVICES)}")
    return device, key


def _pin(path: str, flat: dict[str, Any], section: Section, old_pin: bool | None) -> bool:
    pin = _bool(path, flat, f"{_ZERO}.offload_{section}.pin_memory")
    return bool(pin if pin is not None else old_pin)


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


def record_offload(m: Migration, flat: dict[str, Any]) -> None:
    """Read the offload sections before the walk (see the module docstring)."""
    m.data[_RECORD] = read_offload(m.path, flat)


def _write_offload(m: Migration) -> str:
    """The whole ``offload`` section from the record (the same whatever key writes it), and what it means."""
    asked = _asked(m)
    origin = " + ".join(_origins(asked))
    set_key(m, "offload.device", "cpu", origin)
    set_key(m, "offload.optimizer_only", not asked.params_on_host, origin)
    set_key(m, "offload.pin_memory", asked.pin_memory, origin)
    pin = f"pin_memory: {str(asked.pin_memory).lower()}"
    if not asked.params_on_host:
        return (
            f"offload: {{device: cpu, optimizer_only: true, {pin}}} (ZeRO-Offload: the shards and the gradients' "
            "reduction stay on the device; fp32 masters, gradients and optimizer state live and step on the host)"
        )
    shape = "full offload" if asked.optimizer == "cpu" else "stage 3 parameter offload: the optimizer goes with them"
    return (
        f"offload: {{device: cpu, optimizer_only: false, {pin}}} (parameters, gradients and optimizer state on "
        f"the host; {shape})"
    )


def _origins(asked: OffloadAsked) -> list[str]:
    keys = [asked.optimizer_key] if asked.optimizer == "cpu" else []
    return keys + ([asked.param_key] if asked.params_on_host else [])


def _section(section: Section) -> Handler:
    """``offload_*`` given as ``{}`` or null (no keys to walk): nothing offloaded; anything else is refused."""

    def handle(m: Migration, value: Any) -> str:
        if value not in (None, {}):
            raise MigrationError(
                f"{m.path}: {_ZERO}.offload_{section} {value!r}: expected a mapping such as {{device: cpu}}"
            )
        return f"nothing (offload_{section} {value!r}: device none)"

    return handle


def _device_key(section: Section) -> Handler:
    """``offload_*.device`` (or the deprecated flag): the whole offload section, as the record says."""

    def handle(m: Migration, value: Any) -> str:
        asked = _asked(m)
        device = asked.device(section)
        if device == "nvme":
            return f"unsupported: {NVME}"
        if device == "none":
            return f"nothing (offload_{section} off: device none)"
        if section == "param" and not asked.params_on_host:
            return (
                f"dropped: DeepSpeed offloads parameters at stage 3 only (stage is {asked.stage!r}): "
                "they stay on the device"
            )
        return _write_offload(m)

    return handle


def _deprecated(section: Section) -> Handler:
    """``cpu_offload`` / ``cpu_offload_param``: DeepSpeed reads them as ``offload_*: {device: cpu}``."""
    device_key = _device_key(section)

    def handle(m: Migration, value: Any) -> str:
        return f"{device_key(m, value)} (deprecated; DeepSpeed reads it as offload_{section}.device)"

    return handle


def _pin_key(section: Section | None) -> Handler:
    """``offload_*.pin_memory`` (None: the deprecated ``cpu_offload_use_pin_memory``, for both sections)."""

    def handle(m: Migration, value: Any) -> str:
        asked = _asked(m)
        if section is not None and asked.device(section) == "nvme":
            return f"unsupported: {NVME}"
        in_effect = asked.offloaded if section is None else _on_host(asked, section)
        if not in_effect:
            what = "nothing is offloaded" if section is None else f"offload_{section} does not offload"
            return f"dropped: {what} to cpu: nothing to pin"
        _write_offload(m)
        return f"offload.pin_memory: {str(asked.pin_memory).lower()} (the host copy is pinned when a cpu offload asks)"

    return handle


def _on_host(asked: OffloadAsked, section: Section) -> bool:
    return asked.params_on_host if section == "param" else asked.optimizer == "cpu"


def _nvme_setting(section: Section, what: str) -> Handler:
    """A setting DeepSpeed reads only when the section offloads to NVMe: unsupported then, dropped otherwise."""

    def handle(m: Migration, value: Any) -> str:
        device = _asked(m).device(section)
        if device == "nvme":
            return f"unsupported: {NVME} ({what})"
        return f"dropped: {what}, read by DeepSpeed only with device nvme (offload_{section}.device is {device})"

    return handle


def _ratio(m: Migration, value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise MigrationError(f"{m.path}: {_ZERO}.offload_optimizer.ratio {value!r}: expected a number in [0, 1]")
    if value == 1 or _asked(m).optimizer != "cpu":
        return f"nothing ({value}: all of the optimizer state goes where offload_optimizer.device says)"
    return f"unsupported: partial optimizer offload (ratio {value}): fsdp2lite offloads all of it or none"


def _super_offload(m: Migration, value: Any) -> str:
    if value is True:
        return "unsupported: SuperOffload (Superchips' CPU-GPU optimizer offload)"
    return "nothing (off)"


def _rules() -> dict[str, Rule]:
    rules: dict[str, Rule] = {
        f"{_ZERO}.cpu_offload": _deprecated("optimizer"),
        f"{_ZERO}.cpu_offload_param": _deprecated("param"),
        f"{_ZERO}.cpu_offload_use_pin_memory": _pin_key(None),
        f"{_ZERO}.offload_optimizer.ratio": _ratio,
        f"{_ZERO}.offload_optimizer.super_offload": _super_offload,
        f"{_ZERO}.offload_optimizer.convert_grad_on_cpu": (
            "dropped",
            "gradients are reduced on the device in reduce_dtype and copied to the host as they are",
        ),
        f"{_ZERO}.offload_optimizer.cpuadam_cores_perc": (
            "dropped",
            "the host step is the user's torch optimizer (set its threads with torch.set_num_threads)",
        ),
    }
    nvme = {
        "optimizer": ("nvme_path", "buffer_count", "pipeline_read", "pipeline_write", "fast_init"),
        "param": ("nvme_path", "buffer_count", "buffer_size", "max_in_cpu"),
    }
    sections: tuple[Section, ...] = ("optimizer", "param")
    for section in sections:
        prefix = f"{_ZERO}.offload_{section}"
        rules[prefix] = _section(section)
        rules[f"{prefix}.device"] = _device_key(section)
        rules[f"{prefix}.pin_memory"] = _pin_key(section)
        for key in nvme[section]:
            rules[f"{prefix}.{key}"] = _nvme_setting(section, key)
    return rules


OFFLOAD_RULES = _rules()
