"""An emulated network for benchmarks (issue 34): every collective costs what a named link would charge.

What: a process group, registered as the backend ``"link"``, that fronts a real one (gloo on CPU: real
data; torch's fake process group on a GPU: no data, shapes only) and charges each collective

    seconds = time_scale * (latency + ring_bytes / bandwidth)
    ring_bytes per rank:  all-gather     (n - 1) / n * output bytes
                          reduce-scatter (n - 1) / n * input bytes
                          all-reduce     2 (n - 1) / n * bytes
                          all-to-all     (n - 1) / n * bytes
    e.g. 4 ranks, a 64 MB bf16 all-gather output on pcie4 (25 GB/s, 15 us): 48 MB -> 15 us + 1.92 ms

on the link's own clock: one collective at a time per process (one issued while the link is busy starts
when it frees), as one NIC or one set of NVLinks serves one ring at a time.
    CPU   the Work completes at max(gloo's real completion, the charged end): ``wait()`` blocks until
          both, and the time the caller spends blocked there (or inside a synchronous collective) is
          recorded as exposed communication, per library, since the training thread did nothing else.
    CUDA  a timed spin kernel (``torch.cuda._sleep``, cycles from the clock rate measured once) on the
          stream the collective is issued on, after the previous collective's spin (the link is busy):
          stream semantics are NCCL's, so compute on other streams overlaps it for real; ``wait()``
          makes the current stream wait for the spin, as NCCL's Work does.
Link numbers are the planner's (``fsdp2lite.estimate.timing.LINKS``: pcie4 and ib200 25 GB/s, eth100
12 GB/s, nvlink4 370 GB/s bus bandwidth; latencies 10-50 us), so ``estimate`` and this emulator describe
the same link; a ``Link(gb_per_s, latency_us)`` of your own works too.

Why a process group and not patched functions: fsdp2lite binds its collectives at import time
(``_runtime/collective.py``'s ``all_gather_flat`` and ``reduce_scatter_flat``), so
patching ``torch.distributed`` afterwards would miss fsdp2lite and catch torch's ``fully_shard``: an
unfair race. Both libraries end in ``group.<method>(...)`` on the process group object, so a Python
``dist.ProcessGroup`` subclass (as torch's own multi-threaded test group is) serves both alike, on torch
2.11 and 2.13 (each method exists under both versions' names). fsdp2lite sees a backend that is not gloo
and so reduces with the native reduce-scatter, as it does on NCCL: the emulated link is a network, not
gloo's shared memory, and both libraries then issue the same collective kinds.

Why ``time_scale``: gloo on this 2-core box moves 0.1-0.5 GB/s between 4 ranks, 50-2000x slower than
the links emulated, and a CPU computes ~10^4 times slower than an H100. A CPU run therefore slows the
link's clock by ``time_scale`` (bench_link's ``--time-scale``): every charge, latency included, is
multiplied by it, so the charged time, not gloo, is what a step waits for, and communication weighs
against this CPU's compute about as it does against a GPU's. On CUDA the scale is 1.

Use (one process group per process; the link can change between measurements):

    emulator = init_link_group("gloo", "pcie4", time_scale=2000, rank=rank, world_size=4, init_method=...)
    ... train with either library on the default group ...
    emulator.set_link("nvlink4"); emulator.exposed_s; emulator.charges
"""

# torch's stubs type ProcessGroup's C++ virtuals (and the fake group's constructor) otherwise than the Python
# overrides its trampoline calls, which tests/test_link_emulator.py runs on torch 2.11 and 2.13:
# mypy: disable-error-code="override,assignment,call-arg"
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from fsdp2lite.estimate.timing import Link, find_link  # the planner's links and its lookup of them

BACKEND = "link"
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


def ring_bytes(kind: str, nbytes: int, world_size: int) -> int:
    """Bytes one rank sends for a ``kind`` collective over a buffer of ``nbytes`` (the all-gather's output,
    the reduce-scatter's input, the all-reduce's or all-to-all's tensor), ring algorithm, exact: 4 ranks,
    16 MB all-gather output -> 12 MB; all-reduce of 16 MB -> 24 MB (a reduce-scatter, then an all-gather)."""
    if kind not in KINDS:
        raise ValueError(f"unknown collective kind {kind!r}; valid: {', '.join(KINDS)}")
    if world_size < 2:
        return 0
    factor = 2 if kind == "all_reduce" else 1
    return factor * nbytes * (world_size - 1) // world_size


def charge_s(link: Link, kind: str, nbytes: int, world_size: int, time_scale: float = 1.0) -> float:
    """Seconds the link charges one collective: ``time_scale * (latency + ring bytes / bandwidth)``; 0 on one
    rank (nothing crosses a wire)."""
    if world_size < 2:
        return 0.0
    sent = ring_bytes(kind, nbytes, world_size)
    return time_scale * (link.latency_us * 1e-6 + sent / (link.gb_per_s * 1e9))


@dataclass(frozen=True)
class Charge:
    """One charged collective, on the link's clock (``time.perf_counter`` seconds; CUDA: issue order only)."""

    kind: str
    nbytes: int  # the buffer the collective covers (see ring_bytes)
    ring_bytes: int  # what this rank sends
    seconds: float  # the charge
    start: float  # when the link took it: max(issue, the previous charge's end)
    end: float  # start + seconds


@dataclass
class LinkClock:
    """The link's state in this process: what it is, when it frees, what it charged and what was exposed."""

    link: Link | None  # None: free (no charge: gloo's or the fake group's own speed)
    time_scale: float
    world_size: int
    free_at: float = 0.0
    charges: list[Charge] = field(default_factory=list)
    exposed_s: float = 0.0  # CPU: seconds callers spent blocked in wait() (or in synchronous collectives)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, kind: str, nbytes: int) -> Charge | None:
        """Book the link for one collective issued now; None when the link is free of charge."""
        if self.link is None:
            return None
        seconds = charge_s(self.link, kind, nbytes, self.world_size, self.time_scale)
        with self.lock:
            start = max(time.perf_counter(), self.free_at)
            self.free_at = start + seconds
            charge = Charge(kind, nbytes, ring_bytes(kind, nbytes, self.world_size), seconds, start, self.free_at)
            self.charges.append(charge)
        return charge


class CpuLinkWork(dist.Work):
    """gloo's Work, completing no earlier than the charged end."""

    def __init__(self, inner: dist.Work, deadline: float, clock: LinkClock) -> None:
        super().__init__()
        self.inner = inner
        self.deadline = deadline
        self.clock = clock
        self.waited = False

    def wait(self, timeout: timedelta | None = None) -> bool:
        started = time.perf_counter()
        self.inner.wait() if timeout is None else self.inner.wait(timeout)  # gloo has written the output
        remaining = self.deadline - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)  # the link is still carrying it
        if not self.waited:  # a second wait() blocks on nothing
            self.clock.exposed_s += time.perf_counter() - started
            self.waited = True
        return True

    def is_completed(self) -> bool:
        return self.inner.is_completed() and time.perf_counter() >= self.deadline

    def is_success(self) -> bool:
        return self.inner.is_success()

    def exception(self) -> Any:
        return self.inner.exception()

    def result(self) -> Any:
        return self.inner.result()


class CudaLinkWork(dist.Work):
    """The fake group's Work (done at once), with the spin that stands for the transfer: ``wait()`` orders
    the current stream after it, as NCCL's Work does; the host never blocks."""

    def __init__(self, inner: dist.Work, done: torch.cuda.Event | None) -> None:
        super().__init__()
        self.inner = inner
        self.done = done

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.inner.wait()
        if self.done is not None:
            torch.cuda.current_stream().wait_event(self.done)  # the consumer reads after the transfer
        return True

    def is_completed(self) -> bool:
        return self.done is None or self.done.query()

    def is_success(self) -> bool:
        return True

    def exception(self) -> Any:
        return None

    def result(self) -> Any:
        return self.inner.result()


class Spinner:
    """CUDA: a spin kernel per charge on the issuing stream, chained so the link carries one at a time."""

    cycles_per_s: float  # the spin kernel's clock, measured once
    last: torch.cuda.Event | None  # the end of the latest spin: the link is busy until then

    def __init__(self) -> None:
        self.cycles_per_s = measure_spin_clock()
        self.last = None

    def spin(self, seconds: float) -> torch.cuda.Event:
        stream = torch.cuda.current_stream()
        if self.last is not None:
            stream.wait_event(self.last)  # the link frees when the previous transfer ends
        torch.cuda._sleep(max(1, int(seconds * self.cycles_per_s)))
        self.last = stream.record_event()
        return self.last


def measure_spin_clock(cycles: int = 20_000_000, repeats: int = 3) -> float:
    """Cycles per second of ``torch.cuda._sleep`` on this GPU: the median of ``repeats`` timed spins."""
    torch.cuda._sleep(1000)  # load the kernel before timing it
    rates = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        rates.append(cycles / (start.elapsed_time(end) / 1e3))
    return sorted(rates)[len(rates) // 2]


def _nbytes(tensors: Any) -> int:
    """Bytes of a tensor, a list of tensors or a list of lists of them."""
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(_nbytes(t) for t in tensors)


class LinkGroup(dist.ProcessGroup):
    """The process group both libraries call: each collective is charged on the clock, then run by ``inner``
    (gloo or the fake group). Methods carry both torch 2.13's names and torch 2.11's."""

    def __init__(self, inner: Any, rank: int, world_size: int, clock: LinkClock, device: str) -> None:
        super().__init__(rank, world_size)
        self.inner = inner
        self.clock = clock
        self.spinner = Spinner() if device == "cuda" else None
        self._name = self._desc = ""

    # ---- the emulator's controls -------------------------------------------------------------------
    def set_link(self, link: str | Link | None, time_scale: float | None = None) -> None:
        """Charge the next collectives at ``link`` (None: free of charge); the clock and records restart."""
        self.clock.link = None if link is None else find_link(link)
        if time_scale is not None:
            self.clock.time_scale = time_scale
        self.clock.free_at = 0.0
        self.clock.charges.clear()

    @property
    def exposed_s(self) -> float:
        return self.clock.exposed_s

    # ---- what torch asks of a Python process group (its C++ names) -----------------------------------
    def getBackendName(self) -> str:  # noqa: N802
        return BACKEND

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._name = name

    def getGroupName(self) -> str:  # noqa: N802
        return self._name

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._desc = desc

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._desc

    # ---- one charged collective ----------------------------------------------------------------------
    def _charged(self, kind: str, nbytes: int, method: str, *args: Any) -> dist.Work:
        """Book the link for one collective, then issue it on ``inner`` (``inner.<method>(*args)``)."""
        charge = self.clock.take(kind, nbytes)
        if self.spinner is not None:  # CUDA: the spin goes on the stream first, the fake group returns at once
            done = self.spinner.spin(charge.seconds) if charge is not None else None
            return CudaLinkWork(getattr(self.inner, method)(*args), done)
        deadline = charge.end if charge is not None else 0.0
        return CpuLinkWork(getattr(self.inner, method)(*args), deadline, self.clock)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> dist.Work:
        return self._charged("all_gather", _nbytes(output), "_allgather_base", output, input, opts)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> dist.Work:
        return self._charged("reduce_scatter", _nbytes(input), "_reduce_scatter_base", output, input, opts)

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        opts = dist.AllreduceOptions() if opts is None else opts
        return self._charged("all_reduce", _nbytes(tensors), "allreduce", tensors, opts)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        return self._charged("all_reduce", _nbytes(tensors), "allreduce_coalesced", tensors, opts)

    def all_to_all_single(
        self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int], input_splits: list[int], opts: Any
    ) -> dist.Work:
        args = (output, input, output_splits, input_splits, opts)
        return self._charged("all_to_all", _nbytes(input), "alltoall_base", *args)

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any) -> dist.Work:
        return self._charged("all_gather", _nbytes(outputs), "allgather", outputs, inputs, opts)

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any) -> dist.Work:
        return self._charged("reduce_scatter", _nbytes(inputs), "reduce_scatter", outputs, inputs, opts)

    # torch 2.11's names for the flat forms
    _allgather_base = all_gather_single
    _reduce_scatter_base = reduce_scatter_single
    alltoall_base = all_to_all_single

    # ---- not part of a training step's traffic: passed through uncharged ------------------------------
    def barrier(self, opts: Any = None) -> dist.Work:
        return self.inner.barrier(dist.BarrierOptions() if opts is None else opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        return self.inner.broadcast(tensors, opts)


@dataclass(frozen=True)
class LinkOptions:
    """What ``init_link_group`` asks of the backend: the group fronted and the link charged."""

    inner: str  # "gloo" (CPU, real data) or "fake" (GPU, torch's fake process group)
    link: Link | None
    time_scale: float
    device: str  # "cpu" or "cuda": where the charges are served


def _create_link_group(common: Any, options: LinkOptions) -> LinkGroup:
    """The backend's creator (torch's extended API): ``common`` carries the store, rank and size."""
    rank, size = common.group_rank, common.group_size
    if options.inner == "gloo":
        inner = dist.ProcessGroupGloo(common.store, rank, size, common.timeout)
    elif options.inner == "fake":
        from torch._C._distributed_c10d import FakeProcessGroup

        inner = FakeProcessGroup._create_internal(rank, size, FakeProcessGroup.Options())
    else:
        raise ValueError(f"the link emulator fronts 'gloo' or 'fake', got {options.inner!r}")
    return LinkGroup(inner, rank, size, LinkClock(options.link, options.time_scale, size), options.device)


def register() -> None:
    """Make ``"link"`` a torch.distributed backend (once per process)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create_link_group, extended_api=True, devices=["cpu", "cuda"])


def init_link_group(
    inner: str, link: str | Link | None, *, time_scale: float = 1.0, rank: int, world_size: int, **init: Any
) -> LinkGroup:
    """``dist.init_process_group`` on the emulated link (``init``: its store or init_method); the default
    group, which both libraries then use. ``inner="fake"`` serves the charges on the current CUDA device."""
    register()
    device = "cuda" if inner == "fake" else "cpu"
    options = LinkOptions(inner, None if link is None else find_link(link), time_scale, device)
    dist.init_process_group(BACKEND, rank=rank, world_size=world_size, pg_options=options, **init)
    group = dist.distributed_c10d._get_default_group()
    if not isinstance(group, LinkGroup):
        raise RuntimeError(f"expected the default group to be the link emulator, got {type(group).__name__}")
    return group
