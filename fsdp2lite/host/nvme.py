"""Optimizer state on NVMe (``CPUOffloadPolicy(optimizer="nvme", nvme_path=...)``, ZeRO-Infinity's shape).

[Note: optimizer state on NVMe]
A CPU-offloaded group steps its masters on the host, and its optimizer state (AdamW: two fp32 tensors the
size of the masters) is the largest thing it keeps there. With ``optimizer="nvme"`` that state lives in one
file per rank (and optimizer) under ``nvme_path`` between steps, and the host holds only two staging buffers,
each the size of the largest group's state. At every ``optimizer.step()`` a global step pre-hook
(``register_optimizer_step_pre_hook``) steps the NVMe groups' parameters itself, group by group, before the
optimizer's own step:

    read group 0's state ─┐ (I/O thread, into staging slot 0)
                          step group 0 (slot 0) ── write group 0 ─┐
    read group 1's state ─────────┐ (slot 1, while group 0 steps)  │
                                  step group 1 (slot 1) ── write group 1
    read group 2's state (slot 0: queued after group 0's write) ...

- one I/O thread runs every read and write in the order they are queued, so a slot is read into only after
  its last write left it (no other synchronisation); reads and writes are plain ``os.preadv``/``os.pwrite``
  calls, which release the GIL: the next group's read overlaps this group's step;
- each group steps through the user's own optimizer: its param groups are narrowed, for that call, to the
  group's parameters (hyperparameters, per-optimizer hooks, ``fast_host_step``'s fused kernel all apply), with
  the state's tensors installed as views of the staging slot; after the step the state's tensors (every
  entry with a dimension: ``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``...) are queued for writing and
  dropped from ``optimizer.state``; scalar entries (Adam's ``step``) stay in memory;
- then the stepped parameters' gradients are hidden from the optimizer's own step (set to None, so it skips
  them) and given back by a global step post-hook: the optimizer steps everything else as usual.
State the optimizer holds in memory (the first step creates it; ``load_state_dict`` puts it there) is what the
step uses, and is written out after it. So losses, parameters and state equal in-memory offload bit for bit.
``optimizer.state_dict()`` reads the state back for the call (a state_dict pre-hook) and drops it again
after (a post-hook), so checkpoints (DCP included) hold the real values; ``load_state_dict`` writes loaded
state out at once (a post-hook). Between steps ``optimizer.state[p]`` holds only the scalar entries.

Before the first step writes anything, the file is made and reserved (``posix_fallocate``) at the size the
optimizer's state needs (Adam/AdamW: two copies of the parameters; the factor per optimizer class is in
``STATE_COPIES``): a disk too small fails there, naming the path and the bytes, before any parameter moves.
The file is unlinked as soon as it is open, so a crash can never leave it behind (``df`` still counts it).
"""

from __future__ import annotations

import itertools
import os
import shutil
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from fsdp2lite._runtime.param import make_dtensor
from fsdp2lite._runtime.pinned import exact_host_bytes
from fsdp2lite._runtime.seams import GroupView

ALIGN = 4096  # file regions start on a page: direct, unsplit reads and writes
SLOT_ALIGN = 64  # tensors inside a staging slot: any dtype's alignment, and a cache line
STATE_COPIES: dict[str, int] = {"SGD": 1, "Adagrad": 1, "RMSprop": 1, "Adam": 2, "AdamW": 2, "Adamax": 2}
UNKNOWN_COPIES = 2  # another optimizer: assume Adam's two copies (the file grows if it needs more)

_nvme_groups: weakref.WeakSet[GroupView] = weakref.WeakSet()  # the groups whose state lives in files; read at each step
_engines: weakref.WeakKeyDictionary[torch.optim.Optimizer, NVMeOptimizerState] = weakref.WeakKeyDictionary()
_hooks: list[Any] = []  # the two global step hooks, registered once per process
_file_numbers = itertools.count()


def nvme_path_problem(path: str, state_bytes: int | None = None) -> tuple[str, str] | None:
    """Why ``path`` cannot hold the NVMe state files (and what would do), or None: it must be an existing,
    writable directory. ``state_bytes``: this rank's AdamW state of the group, about, for the message. Asked by
    ``fully_shard``'s plan (``_plan.py``) and ``fsdp2lite doctor --nvme-path``."""
    need = "" if state_bytes is None else f" (it is to hold about {state_bytes:,} bytes of optimizer state per rank)"
    if not os.path.exists(path):
        return f"nvme_path {path!r} does not exist{need}", "create the directory on a fast disk"
    if not os.path.isdir(path):
        return f"nvme_path {path!r} is not a directory{need}", "give the directory for the files"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"nvme_path {path!r} is not writable by this process{need}", "give a writable one"
    return None


def make_nvme_state(group: GroupView) -> None:
    """Keep the optimizer state of ``group``'s parameters in files ([Note: optimizer state on NVMe]); the host
    engine calls it for the group's constructor (``HostSide.keep_state_in_files``). The step hooks are torch's
    global ones: fsdp2lite never sees the user's optimizer, only its ``step()`` through them."""
    _nvme_groups.add(group)
    if not _hooks:
        _hooks.append(register_optimizer_step_pre_hook(_before_step))
        _hooks.append(register_optimizer_step_post_hook(_after_step))


def nvme_state(optimizer: torch.optim.Optimizer) -> NVMeOptimizerState | None:
    """The engine keeping ``optimizer``'s state in files, once it stepped (None before, or without NVMe)."""
    return _engines.get(optimizer)


@dataclass(frozen=True)
class Region:
    """Where one state tensor lives in the file, and what it is."""

    offset: int
    shape: torch.Size
    dtype: torch.dtype
    spec: Any  # the DTensor's spec (the state of a sharded parameter is a DTensor like it), or None

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * self.dtype.itemsize


@dataclass(frozen=True)
class Unit:
    """One fsdp2lite group's parameters in one optimizer, with a gradient: streamed and stepped together."""

    params: tuple[torch.Tensor, ...]
    pin: bool
    group: Any  # the fsdp2lite group: its trace records the unit's read wait, step and write


def _shaped(value: Any) -> bool:
    """A state entry that goes to the file: a tensor with a dimension (shaped like its parameter)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0


def _bytes_of(tensor: torch.Tensor) -> Any:
    """A writable buffer over a contiguous host tensor's bytes (for the I/O thread: no torch call there)."""
    return tensor.reshape(-1).view(torch.uint8).numpy().data


class StateFile:
    """One rank's state file in one directory: regions appended at page boundaries, read and written whole."""

    def __init__(self, directory: str, needed: int) -> None:
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.name = os.path.join(directory, f"fsdp2lite-optimizer-rank{rank}-{os.getpid()}-{next(_file_numbers)}.bin")
        self.fd = os.open(self.name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        weakref.finalize(self, os.close, self.fd)
        os.unlink(self.name)  # the open descriptor keeps it: nothing is left behind, whatever ends the process
        self.size = 0  # bytes handed out to regions
        self.reserved = 0
        self.reserve(needed)

    def reserve(self, nbytes: int) -> None:
        """Make the file ``nbytes`` long on disk now (OSError when the disk is too small)."""
        if nbytes > self.reserved and hasattr(os, "posix_fallocate"):
            os.posix_fallocate(self.fd, 0, nbytes)
        self.reserved = max(self.reserved, nbytes)

    def allocate(self, nbytes: int) -> int:
        offset = self.size
        self.size += -(-nbytes // ALIGN) * ALIGN
        return offset

    def read(self, offset: int, out: Any) -> None:
        """Fill the buffer ``out`` from ``offset`` (runs on the I/O thread)."""
        view, done = memoryview(out), 0
        while done < len(view):
            got = os.preadv(self.fd, [view[done:]], offset + done)
            if got <= 0:
                raise OSError(f"{self.name}: short read at byte {offset + done}")
            done += got

    def write(self, offset: int, data: Any) -> None:
        """Write the buffer ``data`` at ``offset`` (runs on the I/O thread)."""
        view, done = memoryview(data), 0
        while done < len(view):
            done += os.pwrite(self.fd, view[done:], offset + done)


@dataclass(frozen=True)
class NVMeStats:
    """What ``fsdp2lite.offload.nvme_stats(optimizer)`` reports: bytes on disk, in host memory, and moved."""

    files: tuple[str, ...]  # the state files' names (unlinked once open: [Note: optimizer state on NVMe])
    reserved_bytes: int  # on disk, reserved before the first step
    state_bytes: int  # the state tensors the files hold
    staging_bytes: int  # host memory of the two staging slots
    bytes_read: int  # since the first step: steps and state_dict calls
    bytes_written: int  # since the first step: steps and load_state_dict calls
    step_bytes_read: int  # by the last step
    step_bytes_written: int  # by the last step


@dataclass(frozen=True)
class _Read:
    """A queued read of a group's state into a staging slot, and where each tensor lands."""

    done: Future[None]
    landing: list[tuple[torch.Tensor, str, Region, torch.Tensor]]  # (param, key, region, slot bytes)
    nbytes: int  # what it reads


class NVMeOptimizerState:
    """One optimizer's state files, staging slots and I/O thread ([Note: optimizer state on NVMe])."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.files: dict[str, StateFile] = {}  # by directory
        self.home: dict[int, StateFile] = {}  # each NVMe parameter's file, by id
        self.params: dict[int, torch.Tensor] = {}  # the NVMe parameters, by id (the optimizer holds them too)
        self.regions: dict[int, dict[str, Region]] = {}  # each parameter's state tensors in its file
        self.staging: list[torch.Tensor] = []  # two uint8 slots, each the largest group's state
        self.io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fsdp2lite-nvme")  # FIFO: no other sync
        weakref.finalize(self, self.io.shutdown, wait=True)
        self.writes: deque[Future[None]] = deque()
        self.stepping = False  # inside step(): the inner optimizer.step() calls pass through the hooks
        self.hidden: list[tuple[torch.Tensor, torch.Tensor | None]] = []  # gradients kept from the outer step
        self.materialized: list[torch.Tensor] = []  # read back for one state_dict() call
        self.bytes_read = self.bytes_written = self.step_bytes_read = self.step_bytes_written = 0
        optimizer.register_state_dict_pre_hook(self._materialize)
        optimizer.register_state_dict_post_hook(self._release)
        optimizer.register_load_state_dict_post_hook(self._spill)

    def stats(self) -> NVMeStats:
        return NVMeStats(
            files=tuple(file.name for file in self.files.values()),
            reserved_bytes=sum(file.reserved for file in self.files.values()),
            state_bytes=sum(region.nbytes for regions in self.regions.values() for region in regions.values()),
            staging_bytes=sum(slot.nbytes for slot in self.staging),
            bytes_read=self.bytes_read,
            bytes_written=self.bytes_written,
            step_bytes_read=self.step_bytes_read,
            step_bytes_written=self.step_bytes_written,
        )

    def step(
        self, optimizer: torch.optim.Optimizer, units: list[Unit], trainable: dict[str, list[torch.Tensor]]
    ) -> None:
        """Step ``units`` group by group, streaming their state; hide their gradients from the outer step."""
        self._open_files(optimizer, trainable)  # raises before anything changes
        self._size_staging(units)
        saved = [group["params"] for group in optimizer.param_groups]
        self.step_bytes_read = self.step_bytes_written = 0  # this step's own: not state_dict's, not a load's
        self.stepping = True
        try:
            reading = self._read(optimizer, units[0], 0)
            for index, unit in enumerate(units):
                with unit.group.trace_span("nvme_read_wait"):  # the I/O the previous group's step did not hide
                    self._install(optimizer, reading)
                self.step_bytes_read += reading.nbytes
                if index + 1 < len(units):  # overlaps this group's step ([Note: optimizer state on NVMe])
                    reading = self._read(optimizer, units[index + 1], (index + 1) % 2)
                with unit.group.trace_span("optimizer_step"):
                    self._step_only(optimizer, unit, saved)
                self.step_bytes_written += self._write(optimizer, unit.params)
                unit.group.trace("nvme_write_issue")
        finally:
            for group, params in zip(optimizer.param_groups, saved):
                group["params"] = params
            self.stepping = False
            self._drain()
        for unit in units:
            for param in unit.params:
                self.hidden.append((param, param.grad))
                param.grad = None  # the optimizer's own step skips it: stepped already

    def give_back_grads(self) -> None:
        for param, grad in self.hidden:
            param.grad = grad
        self.hidden.clear()

    def _open_files(self, optimizer: torch.optim.Optimizer, trainable: dict[str, list[torch.Tensor]]) -> None:
        """Each directory's file, made and reserved at the size the state needs, before the first write."""
        for directory, params in trainable.items():
            if directory not in self.files:
                self.files[directory] = _make_file(directory, params, optimizer)
            for param in params:
                self.home.setdefault(id(param), self.files[directory])
                self.params.setdefault(id(param), param)

    def _size_staging(self, units: list[Unit]) -> None:
        """Two slots, each the largest group's known state (a group's first step writes from its own tensors)."""
        need = max(
            sum(_slot_bytes(r.nbytes) for p in unit.params for r in self.regions.get(id(p), {}).values())
            for unit in units
        )
        if self.staging and self.staging[0].numel() >= need:
            return
        self._drain()  # no read or write may still use the old slots
        pin = any(unit.pin for unit in units)
        self.staging = [exact_host_bytes(need, pin)[0] for _ in range(2)]  # [Note: one host buffer per group]

    def _read(self, optimizer: torch.optim.Optimizer, unit: Unit, slot: int) -> _Read:
        """Queue the reads of ``unit``'s state that the optimizer does not hold in memory, into ``slot``."""
        landing, jobs, offset = [], [], 0
        for param in unit.params:
            held = optimizer.state.get(param, {})
            for key, region in self.regions.get(id(param), {}).items():
                if key in held:
                    continue  # in memory (first step, or just loaded): that is the state to step
                view = self.staging[slot].narrow(0, offset, region.nbytes)
                offset += _slot_bytes(region.nbytes)
                landing.append((param, key, region, view))
                jobs.append((self.home[id(param)], region.offset, view.numpy()))
        nbytes = sum(region.nbytes for _, _, region, _ in landing)
        self.bytes_read += nbytes
        return _Read(self.io.submit(_read_all, jobs), landing, nbytes)

    def _install(self, optimizer: torch.optim.Optimizer, reading: _Read) -> None:
        reading.done.result()  # the state is in the slot
        for param, key, region, view in reading.landing:
            optimizer.state[param][key] = _as_state(view, region)

    def _step_only(self, optimizer: torch.optim.Optimizer, unit: Unit, saved: list[list[torch.Tensor]]) -> None:
        """The optimizer's own step, its param groups narrowed to ``unit``'s parameters for the call."""
        chosen = {id(param) for param in unit.params}
        for group, params in zip(optimizer.param_groups, saved):
            group["params"] = [param for param in params if id(param) in chosen]
        optimizer.step()

    def _write(self, optimizer: torch.optim.Optimizer, params: tuple[torch.Tensor, ...] | list[torch.Tensor]) -> int:
        """Queue the writes of ``params``' shaped state and drop it from ``optimizer.state``; the bytes queued."""
        jobs = []
        for param in params:
            state = optimizer.state.get(param)
            if not state:
                continue
            for key, value in state.items():
                if _shaped(value):
                    region, data = self._region(param, key, value)
                    jobs.append((self.home[id(param)], region.offset, _bytes_of(data), data))
            optimizer.state[param] = {key: value for key, value in state.items() if not _shaped(value)}
        nbytes = sum(job[3].nbytes for job in jobs)
        self.bytes_written += nbytes
        self.writes.append(self.io.submit(_write_all, jobs))
        while len(self.writes) > 2:  # at most two groups' fresh state in flight (a first step's own tensors)
            self.writes.popleft().result()
        return nbytes

    def _region(self, param: torch.Tensor, key: str, value: torch.Tensor) -> tuple[Region, torch.Tensor]:
        """Where ``param``'s ``key`` goes (its region, or a new one if it has none of this shape and dtype)."""
        local = value._local_tensor if isinstance(value, DTensor) else value
        if local.device.type != "cpu":
            raise RuntimeError(f"optimizer state on NVMe: the {key!r} state is on {local.device}, expected the host")
        regions = self.regions.setdefault(id(param), {})
        region = regions.get(key)
        if region is None or region.shape != local.shape or region.dtype != local.dtype:
            file = self.home[id(param)]
            offset = file.allocate(local.numel() * local.element_size())
            try:
                file.reserve(file.size)
            except OSError as exc:
                raise ValueError(
                    f"optimizer state on NVMe: cannot grow {file.name!r} to {file.size:,} bytes ({exc}): free space "
                    "there, or point nvme_path at a larger disk"
                ) from exc
            region = regions[key] = Region(offset, local.shape, local.dtype, getattr(value, "_spec", None))
        return region, local if local.is_contiguous() else local.contiguous()

    def _drain(self) -> None:
        """Wait for every queued write (raising the first error)."""
        while self.writes:
            self.writes.popleft().result()

    def _materialize(self, optimizer: torch.optim.Optimizer) -> None:
        """state_dict pre-hook: read every state tensor back into memory for the call."""
        self._drain()
        for pid, regions in self.regions.items():
            param, held = self.params[pid], optimizer.state.get(self.params[pid], {})
            missing = {key: region for key, region in regions.items() if key not in held}
            for key, region in missing.items():
                out = torch.empty(region.nbytes, dtype=torch.uint8)
                self.home[pid].read(region.offset, out.numpy())
                optimizer.state[param][key] = _as_state(out, region)
                self.bytes_read += region.nbytes
            if missing:
                self.materialized.append(param)

    def _release(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        """state_dict post-hook: drop what ``_materialize`` read; the returned dict keeps it (a new dict per
        parameter in ``optimizer.state``: ``state_dict()`` packs the old ones)."""
        for param in self.materialized:
            state = optimizer.state[param]
            optimizer.state[param] = {key: value for key, value in state.items() if not _shaped(value)}
        self.materialized.clear()

    def _spill(self, optimizer: torch.optim.Optimizer) -> None:
        """load_state_dict post-hook: write the loaded state of the NVMe parameters out now."""
        self._write(optimizer, [param for param in self.params.values() if param in optimizer.state])
        self._drain()


def _slot_bytes(nbytes: int) -> int:
    return -(-nbytes // SLOT_ALIGN) * SLOT_ALIGN


def _as_state(raw: torch.Tensor, region: Region) -> torch.Tensor:
    """A state tensor over ``raw``'s bytes (a staging view or its own buffer), a DTensor when it was one."""
    tensor = raw.view(region.dtype).view(region.shape)
    return make_dtensor(tensor, region.spec) if region.spec is not None else tensor


def _read_all(jobs: list[tuple[StateFile, int, Any]]) -> None:
    for file, offset, out in jobs:
        file.read(offset, out)


def _write_all(jobs: list[tuple[StateFile, int, Any, torch.Tensor]]) -> None:
    for file, offset, data, _ in jobs:  # the tensor rides along: alive until written
        file.write(offset, data)


def _copies(optimizer: torch.optim.Optimizer) -> int:
    """How many parameter-sized state tensors ``optimizer`` keeps (what the file reserves)."""
    name, groups = type(optimizer).__name__, optimizer.param_groups
    if name in ("Adam", "AdamW"):
        return 2 + any(group.get("amsgrad") for group in groups)
    if name == "SGD":
        return int(any(group.get("momentum") for group in groups))
    if name == "RMSprop":
        return 1 + any(group.get("momentum") for group in groups) + any(group.get("centered") for group in groups)
    return STATE_COPIES.get(name, UNKNOWN_COPIES)


def _make_file(directory: str, params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> StateFile:
    """The state file of ``params`` in ``directory``, reserved; ValueError with the bytes when it cannot be."""
    copies = _copies(optimizer)
    size = sum(_local_bytes(param) for param in params)
    needed = size * copies
    free = shutil.disk_usage(directory).free
    if needed > free:
        problem = f"has {free:,} bytes free"
    else:
        try:
            return StateFile(directory, needed)
        except OSError as exc:
            problem = f"could not hold them ({exc.strerror or exc})"
    raise ValueError(
        f"optimizer state on NVMe: nvme_path {directory!r} {problem}, but the {type(optimizer).__name__} state of "
        f"this rank's {len(params)} parameters there needs {needed:,} bytes ({copies} x their {size:,}). Free space "
        "there or point nvme_path at a larger disk; nothing was stepped."
    )


def _local_bytes(param: torch.Tensor) -> int:
    local = param._local_tensor if isinstance(param, DTensor) else param
    return local.numel() * local.element_size()


def _units(optimizer: torch.optim.Optimizer) -> tuple[list[Unit], dict[str, list[torch.Tensor]]]:
    """``optimizer``'s NVMe parameters with a gradient, by fsdp2lite group in the order the optimizer holds
    them; and its trainable NVMe parameters by directory (what the files reserve for)."""
    owner = {id(p.sharded_param): (group, p.policy) for group in list(_nvme_groups) for p in group.params}
    by_group: dict[int, tuple[Any, Any, list[torch.Tensor]]] = {}  # id(group) -> (group, its policy, params)
    trainable: dict[str, list[torch.Tensor]] = {}
    for param_group in optimizer.param_groups:
        for param in param_group["params"]:
            found = owner.get(id(param))
            if found is None or not param.requires_grad:
                continue
            group, policy = found
            if policy.nvme_path is None:  # never: a group is registered here because its policy names a path
                continue
            trainable.setdefault(policy.nvme_path, []).append(param)
            if param.grad is not None:
                by_group.setdefault(id(group), (group, policy, []))[2].append(param)
    units = [Unit(tuple(params), policy.pin_memory, group) for group, policy, params in by_group.values()]
    return units, trainable


def _before_step(optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Global step pre-hook: step the NVMe groups first ([Note: optimizer state on NVMe])."""
    engine = _engines.get(optimizer)
    if engine is not None and engine.stepping:
        return  # one of the engine's own group steps
    units, trainable = _units(optimizer)
    if not units:
        return
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
    if closure is not None:
        raise ValueError(
            f"{type(optimizer).__name__}.step(closure): optimizer state on NVMe steps group by group before the "
            "optimizer's own step, so it cannot re-evaluate a closure; call step() without one"
        )
    if engine is None:
        engine = _engines[optimizer] = NVMeOptimizerState(optimizer)
    engine.step(optimizer, units, trainable)


def _after_step(optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Global step post-hook: the stepped parameters get their gradients back."""
    engine = _engines.get(optimizer)
    if engine is not None and not engine.stepping:
        engine.give_back_grads()
