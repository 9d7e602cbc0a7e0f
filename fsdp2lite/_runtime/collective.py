"""The runtime's one collective seam: all-gather, reduce-scatter (sum), all-reduce (sum) and all-to-all over ``Ranks``.

[Note: one collective seam]
Every collective the runtime issues goes through a ``Collective``: the forms of the shard group's all-gather
and reduction ([Note: gather forms] in gather.py, [Note: reduce forms] in reduce.py), the post-forward regather,
HSDP's all-reduce and HFSDP's replica all-gather and reduce-scatter ([Note: replica-sharded groups]). Which one
is decided once per process group (``collective_for``, from the backend that group reduces CPU tensors with) or
by a setter, never per call:

    Native               the backend's flat collectives (NCCL, the fake process group)
    GlooInPlace          gloo: the same, but a reduce-scatter is one all-reduce of its input in place, the output
                         this rank's slot of it ([Note: gloo reduce-scatter] in reduce.py)
    CustomAllGather      the user's all-gather (``set_custom_all_gather``: torch's AllGather protocol, typed by
                         ``AllGatherComm``) and its buffers, the rest from the collective it wraps
    CustomReduceScatter  the user's reduce-scatter (``set_custom_reduce_scatter``: ``ReduceScatterComm``) likewise

A collective only says what runs. Where it runs is ``Comm``'s: the caller issues it inside ``comm.on`` /
``comm.after`` (a side stream on CUDA) with ``async_op=comm.async_work`` (a Work handle on CPU), records the
side stream's event and makes its consumer wait (``comm.wait``) just before reading the output, as
[Note: CUDA buffer lifetime] in comm.py says. Each method returns the Work to wait on, or None (CUDA, or
nothing sent). One rank sends nothing: ``Native`` skips a one-rank all-gather (the copy-in wrote the whole
output already), as torch's ``fully_shard`` does.

    reduce-scatter, 2 ranks: input rank0 [1 2 | 3 4], rank1 [5 6 | 7 8] -> output rank0 [6 8], rank1 [10 12]
    GlooInPlace: both inputs all-reduced in place to [6 8 | 10 12]; rank0's output is the view [6 8]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.distributed as dist

from .comm import Ranks

# torch 2.13 renamed the flat collectives (the old names warn); torch 2.6-2.12 only have the old ones.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class AllGatherComm(Protocol):
    """torch's ``AllGather`` protocol (``set_custom_all_gather``): allocates the output, gathers into it."""

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor: ...

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
    ) -> dist.Work | None: ...


class ReduceScatterComm(Protocol):
    """torch's ``ReduceScatter`` protocol (``set_custom_reduce_scatter``): allocates the input and the output,
    reduces (``op`` is always SUM here)."""

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor: ...

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp.RedOpType,
        async_op: bool = False,
    ) -> dist.Work | None: ...


class Collective(Protocol):
    """The collectives of one process group as the runtime calls them ([Note: one collective seam])."""

    # reduce_scatter's output is this rank's slot of its input, written by an in-place all-reduce (gloo)
    in_place: bool
    # its buffers are the user's: an all-gather's output and a reduction's buffers come from gather_buffer /
    # reduce_buffer, never from another tensor (a parameter's storage)
    user_buffers: bool

    def gather_buffer(self, size: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An all-gather's output buffer."""
        ...

    def reduce_buffer(self, size: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A reduce-scatter's input or output buffer."""
        ...

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, ranks: Ranks, *, async_op: bool
    ) -> dist.Work | None:
        """``input`` (n,) of every rank into ``output`` (ranks.size * n,), rank-major."""
        ...

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, ranks: Ranks, *, async_op: bool
    ) -> dist.Work | None:
        """The sum over ranks of ``input`` (ranks.size * n,), this rank's (n,) slot into ``output``."""
        ...

    def all_reduce(self, tensor: torch.Tensor, ranks: Ranks, *, async_op: bool) -> dist.Work | None:
        """``tensor`` summed over ranks, in place."""
        ...

    def all_to_all(
        self, output: torch.Tensor, input: torch.Tensor, ranks: Ranks, *, async_op: bool
    ) -> dist.Work | None:
        """Row j of ``input`` (ranks.size, n) to rank j, row i of ``output`` from rank i."""
        ...

    def plain(self) -> Collective:
        """This collective without the user's parts (a post-forward regather runs the runtime's own)."""
        ...


class Native:
    """The backend's flat collectives: NCCL, the fake process group ([Note: one collective seam])."""

    in_place = False
    user_buffers = False

    def gather_buffer(self, size: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def reduce_buffer(self, size: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, ranks: Ranks, *, async_op: bool
    ) -> dist.Work | None:
        if ranks.size == 1:
            return None  # the copy-in already wrote the whole output: one rank sends nothing, as torch's
        return all_gather_flat(output, input, group=ranks.group, async_op=async_op)

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, ranks: Ranks, *, async_op: bool
    ) -> dist.Work | None:
        return reduce_scatter_flat(output, input, op=dist.ReduceOp.SUM, group=ranks.group, async_op=async_op)

    def all_reduce(self, tensor: torch.Tensor, ranks: Ranks, *, async_op: bool) -> dist.Work | None:
        return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=ranks.group, async_op=async_op)

    def all_to_all(
        self, output: torch.Tensor, input: torch.Tensor, ranks: Ranks, *, async_op: bool
    ) -> dist.Work | None:
        return dist.all_to_all_single(output, input, group=ranks.group, async_op=async_op)

    def plain(self) -> Collective:
        return self


class GlooInPlace(Native):
    """gloo: a reduce-scatter is one all-reduce of its input in place, ``output`` being this rank's slot of
    that input ([Note: gloo reduce-scatter] in reduce.py); the other collectives are the native ones."""

    in_place = True

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, ranks: Ranks, *, async_op: bool
    ) -> dist.Work | None:
        return dist.all_reduce(input, op=dist.ReduceOp.SUM, group=ranks.group, async_op=async_op)


class _OverBase:
    """A collective that runs ``base``'s collectives and buffers except where a subclass puts the user's in."""

    user_buffers = True

    def __init__(self, base: Collective) -> None:
        self.base = base
        self.in_place = base.in_place

    def gather_buffer(self, size: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.base.gather_buffer(size, dtype, device)

    def reduce_buffer(self, size: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.base.reduce_buffer(size, dtype, device)

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, ranks: Ranks, *, async_op: bool
    ) -> dist.Work | None:
        return self.base.all_gather(output, input, ranks, async_op=async_op)

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, ranks: Ranks, *, async_op: bool
    ) -> dist.Work | None:
        return self.base.reduce_scatter(output, input, ranks, async_op=async_op)

    def all_reduce(self, tensor: torch.Tensor, ranks: Ranks, *, async_op: bool) -> dist.Work | None:
        return self.base.all_reduce(tensor, ranks, async_op=async_op)

    def all_to_all(
        self, output: torch.Tensor, input: torch.Tensor, ranks: Ranks, *, async_op: bool
    ) -> dist.Work | None:
        return self.base.all_to_all(output, input, ranks, async_op=async_op)

    def plain(self) -> Collective:
        return self.base.plain()


class CustomAllGather(_OverBase):
    """The user's all-gather and its output buffers (``set_custom_all_gather``); the rest is ``base``'s."""

    def __init__(self, base: Collective, comm: AllGatherComm) -> None:
        super().__init__(base)
        self.comm = comm

    def gather_buffer(self, size: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.comm.allocate(size, dtype=dtype, device=device)

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, ranks: Ranks, *, async_op: bool
    ) -> dist.Work | None:
        return self.comm(output_tensor=output, input_tensor=input, group=ranks.group, async_op=async_op)


class CustomReduceScatter(_OverBase):
    """The user's reduce-scatter and its buffers (``set_custom_reduce_scatter``), never in place; the rest is
    ``base``'s."""

    def __init__(self, base: Collective, comm: ReduceScatterComm) -> None:
        super().__init__(base)
        self.comm = comm
        self.in_place = False

    def reduce_buffer(self, size: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.comm.allocate(size, dtype=dtype, device=device)

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, ranks: Ranks, *, async_op: bool
    ) -> dist.Work | None:
        return self.comm(
            output_tensor=output, input_tensor=input, group=ranks.group, op=dist.ReduceOp.SUM, async_op=async_op
        )


def collective_for(group: dist.ProcessGroup, device: torch.device) -> Collective:
    """The collective of ``group`` on ``device``: in place when gloo reduces its CPU tensors, else native
    (decided once per process group: [Note: one collective seam])."""
    return GlooInPlace() if reduces_in_place(group, device) else Native()


def reduces_in_place(group: dist.ProcessGroup, device: torch.device) -> bool:
    """True when ``group`` reduces CPU tensors with gloo: [Note: gloo reduce-scatter] in reduce.py."""
    if device.type != "cpu":
        return False  # CUDA tensors go through NCCL's native reduce-scatter and the stream schedule
    return cpu_backend(str(dist.get_backend(group))) == "gloo"


def cpu_backend(backend: str) -> str:
    """The backend a process group's backend string uses for CPU tensors: "gloo" -> "gloo",
    "cpu:gloo,cuda:nccl" -> "gloo", "nccl" -> "nccl" (it has no CPU backend of its own)."""
    for part in backend.split(","):
        device, _, name = part.rpartition(":")
        if device in ("", "cpu"):
            return name
    return backend
