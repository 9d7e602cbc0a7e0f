"""Device primitives of the schedule: where copy-ins and collectives run, and how their consumers wait.

One ``Comm`` per root, shared by its groups. The schedule (what to issue when) is the same on every
device; only these primitives differ:

    CPU (gloo)  collectives are issued with async_op=True; a consumer waits on the Work handle
                just before it reads the output.
    CUDA        copy-in, all-gather, reduce-scatter and all-reduce run on their own streams; each
                producer records an event and a consumer's stream waits on that event only.

[Note: CUDA buffer lifetime]
A buffer allocated on a side stream is handed back to that stream's pool when its last reference
goes; a later allocation on the same stream may then reuse it while another stream still reads it.
So a consumed result is parked in ``retired`` until the producer stream's next use has been ordered
after the compute stream (``wait_stream``), and only then released. No ``record_stream``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist

from .trace import TraceRecorder

STREAM_NAMES = ("all_gather_copy_in", "all_gather", "reduce_scatter", "all_reduce")


class Comm:
    """Streams (CUDA) or nothing (CPU), the parked buffers, and the trace recorder."""

    device: torch.device
    streams: dict[str, torch.cuda.Stream] | None  # None on CPU
    retired: dict[str, list[Any]]  # per producer stream: consumed results awaiting a safe release
    recorder: TraceRecorder | None  # None: tracing off, and free

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.streams = None
        if device.type == "cuda":
            # high priority so communication kernels are not starved by compute kernels
            self.streams = {name: torch.cuda.Stream(device, priority=-1) for name in STREAM_NAMES}
        self.retired = {name: [] for name in STREAM_NAMES}
        self.recorder = None

    @property
    def async_work(self) -> bool:
        """CPU: collectives return Work handles to wait on; CUDA: streams and events order them."""
        return self.streams is None

    @contextmanager
    def on(self, name: str) -> Iterator[None]:
        """Run the block on side stream ``name`` after everything already queued on the compute stream
        (the shards or grads it reads were written there); release buffers parked for that stream."""
        if self.streams is None:
            yield
            return
        stream = self.streams[name]
        stream.wait_stream(torch.cuda.current_stream(self.device))  # inputs written on the compute stream
        self.retired[name].clear()  # now ordered after their consumers: [Note: CUDA buffer lifetime]
        with torch.cuda.stream(stream):
            yield

    def after(self, name: str, event: torch.cuda.Event | None) -> Any:
        """Context for side stream ``name`` that first waits for ``event`` (another stream's output)."""
        if self.streams is None:
            return nullcontext()
        if event is not None:
            self.streams[name].wait_event(event)  # e.g. the all-reduce reads the reduce-scatter output
        return torch.cuda.stream(self.streams[name])

    def record(self, name: str) -> torch.cuda.Event | None:
        """An event at the current end of side stream ``name`` (None on CPU)."""
        if self.streams is None:
            return None
        return self.streams[name].record_event()

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

    def retire(self, name: str, result: Any) -> None:
        """Keep a consumed CUDA result alive until stream ``name`` is next ordered after compute."""
        if self.streams is not None:
            self.retired[name].append(result)

    def synchronize_side_streams(self) -> None:
        """End of backward (CUDA): the compute stream waits for every side stream; parked buffers go."""
        if self.streams is None:
            return
        current = torch.cuda.current_stream(self.device)
        for name, stream in self.streams.items():
            current.wait_stream(stream)  # grads written on side streams are complete for the optimizer
            stream.wait_stream(current)
            self.retired[name].clear()
