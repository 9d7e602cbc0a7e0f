"""Device primitives of the schedule: where copy-ins and collectives run, and how their consumers wait.

One ``Comm`` per root, shared by its groups. The schedule (what to issue when) is the same on every
device; only these primitives differ:

    CPU (gloo)  collectives are issued with async_op=True; a consumer waits on the Work handle
                just before it reads the output.
    CUDA        copy-in, all-gather, reduce-scatter and all-reduce run on their own streams; each
                producer records an event and a consumer's stream waits on that event only.

[Note: CUDA buffer lifetime]
The caching allocator hands a freed block back to the stream it was allocated on, and reuses it for
that stream's next allocation at once, trusting stream order. Two rules make that safe without
``record_stream`` and without parking buffers:
  - a buffer allocated on a side stream (the all-gather output, on ``all_gather_copy_in``) may be
    dropped as soon as the compute stream has queued its last read: every allocation on that side
    stream happens inside ``Comm.on``, which first makes the side stream wait for the compute stream,
    so whatever reuses the block is ordered after that read;
  - a buffer allocated on the compute stream and read or written by a side stream (the reduce-scatter
    input and output, the HSDP all-reduce operands) is dropped only after the compute stream has
    waited on that side stream's event, so a compute-stream reuse is ordered after the side stream.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

_NO_STREAM = nullcontext()  # reusable: what ``Comm.on``/``after`` give on CPU, where there are no side streams

STREAM_NAMES = ("all_gather_copy_in", "all_gather", "reduce_scatter", "all_reduce")


class Comm:
    """Streams and events (CUDA) or work handles (CPU): where collectives run and how their consumers wait. What is
    measured of them is the root's ``Meters`` (trace.py); the host side of offload is ``fsdp2lite.host``
    ([Note: the host engine] in seams.py)."""

    device: torch.device
    streams: dict[str, torch.cuda.Stream] | None  # None on CPU
    wait_instead: torch.Event | None  # while set, side streams wait on it, not the compute stream

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.streams = None
        if device.type == "cuda":
            # high priority so communication kernels are not starved by compute kernels
            self.streams = {name: torch.cuda.Stream(device, priority=-1) for name in STREAM_NAMES}
        self.wait_instead = None

    @property
    def async_work(self) -> bool:
        """CPU: collectives return Work handles to wait on; CUDA: streams and events order them."""
        return self.streams is None

    def on(self, name: str) -> AbstractContextManager[None]:
        """Run the block on side stream ``name`` after everything already queued on the compute stream:
        the shards or grads it reads were written there, and the blocks it may reuse were last read
        there ([Note: CUDA buffer lifetime]). On CPU: the block runs where it is (one shared no-op context)."""
        if self.streams is None:
            return _NO_STREAM
        return self._on_stream(self.streams[name])

    @contextmanager
    def _on_stream(self, stream: torch.cuda.Stream) -> Iterator[None]:
        if self.wait_instead is not None:  # the user's post-optimizer event: set_post_optim_event
            stream.wait_event(self.wait_instead)
        else:
            stream.wait_stream(torch.cuda.current_stream(self.device))  # inputs written, reused blocks read
        with torch.cuda.stream(stream):
            yield

    def after(self, name: str, event: torch.cuda.Event | None) -> Any:
        """Context for side stream ``name`` that first waits for ``event`` (another stream's output)."""
        if self.streams is None:
            return _NO_STREAM
        if event is not None:
            self.streams[name].wait_event(event)  # e.g. the all-reduce reads the reduce-scatter output
        return torch.cuda.stream(self.streams[name])

    def record(self, name: str) -> torch.cuda.Event | None:
        """An event at the current end of side stream ``name`` (None on CPU)."""
        if self.streams is None:
            return None
        return self.streams[name].record_event()

    def record_current(self) -> torch.cuda.Event | None:
        """An event at the current end of the compute stream (None on CPU)."""
        if self.streams is None:
            return None
        return torch.cuda.current_stream(self.device).record_event()

    def wait(self, work: dist.Work | None, event: torch.cuda.Event | None) -> None:
        """Make the compute side wait for one collective's output, and for nothing else."""
        if work is not None:
            work.wait()  # CPU: block until gloo has written the output
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)  # CUDA: order, don't block the host

    def release(self, buffer: torch.Tensor) -> None:
        """CPU: free a waited-on collective's buffer now. gloo's Work object still references it until
        its worker thread lets go, which would make the moment it is freed (and the peak) depend on
        thread timing; once waited on, gloo no longer reads it."""
        if self.streams is None:
            buffer.untyped_storage().resize_(0)

    def synchronize_side_streams(self) -> None:
        """End of backward (CUDA): the compute stream waits for every side stream (on the GPU, the host
        does not block), so the optimizer and the next step see everything the side streams wrote."""
        if self.streams is None:
            return
        current = torch.cuda.current_stream(self.device)
        for stream in self.streams.values():
            current.wait_stream(stream)


class Ranks(NamedTuple):
    """The ranks a collective runs over: the shard group, a post-forward group, the replicas."""

    group: dist.ProcessGroup
    size: int
    rank: int  # this rank's index in ``group``


class AllGatherResult(NamedTuple):
    """An all-gather in flight, holding its buffer until the consumer has waited on it."""

    all_gather_output: torch.Tensor  # (group_size * group_numel,)
    all_gather_input: torch.Tensor  # (group_numel,): this rank's slot of all_gather_output
    work: dist.Work | None  # CPU: wait on it
    event: torch.cuda.Event | None  # CUDA: the compute stream waits on it
