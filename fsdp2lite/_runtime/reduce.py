"""A group's reduce-scatter: copy-in, the collective and its forms (the step across replicas after it: replica_step.py).

(The all-gather, its forms and its notes are in ``gather.py``.)
Reduce-scatter (one per group per backward), the all-gather's layout in reverse, averaged:

    rank0 grads a=[1,2,3] b=[4,5] -> reduce_scatter_input [1 2 4 | 3 0 5]
    rank1 grads a=[3,4,5] b=[6,7] -> reduce_scatter_input [3 4 6 | 5 0 7]
    reduce-scatter(sum) / 2       -> rank0 [2 3 5] (a0 a1 b0), rank1 [4 0 6] (a2 pad b1)

[Note: buffer lifetime]
Each flat buffer is owned by its result record (``AllGatherResult``/``ReduceScatterResult``), and the
record is dropped only after its work has been waited on and its output consumed; dropping the record
is what frees the buffers. Nothing relies on the allocator seeing a later use (no ``record_stream``):
see [Note: CUDA buffer lifetime] for why that is safe with side streams.
The all-gather runs in place: its input is this rank's slot of its output, so an unshard allocates the
group's bytes once for the collective and once for the unsharded parameters (copy-out), 2x the group's
bytes at most. A separate input buffer would add 1/shard_size of that, and its release would depend on
when the backend's worker thread lets go of the finished work.
The reduce-scatter's copy-in runs on the compute stream, where autograd wrote the gradients, so each
unsharded gradient is freed the moment the one copy-in op has read it (on every device); the flat
input is then held until the reduce-scatter is waited on, and that wait comes before the next group
allocates its own (``RootContext.finish_pending_reduce_scatter``): one reduce-scatter input in flight.

On the hot path ([Note: hot path] in gather.py) the reduce-scatter copy-in is one ``_chunk_cat`` (it pads each
gradient to whole chunks, exactly the padded-shard layout), and the sharded gradients are ``as_strided`` views
of the reduced output wrapped in DTensors with a spec built at ``fully_shard`` time (``sharded_spec``).

[Note: reduce forms]
Like the all-gather ([Note: gather forms] in gather.py) a group's reduction is decided once: a ``ReduceForm``
for the shard group, chosen by ``choose_reduce`` at construction and again by ``set_comm_policy``,
``set_custom_reduce_scatter`` and ``set_separate_reduce_scatter_group``, then a ``ReplicaStep`` for a 2-D mesh,
chosen by ``set_requires_all_reduce`` and HFSDP:

    NativeReduceScatter  the backend's reduce-scatter (NCCL, the fake process group), or the user's
    InPlaceReduce        a gloo collective, and one rank: an all-reduce in place ([Note: gloo reduce-scatter])
    AllToAllReduce       CommPolicy(reduce_scatter="all_to_all"|"int8"): rows exchanged, summed on arrival
    NoReplicas | ReplicaAllReduce (HSDP) | ReplicaReduceScatter (HFSDP) | DeferredReplicas (all-reduce off):
                         the replica steps, in replica_step.py

Every form shares the copy-in (``ReduceForm.issue``); the result carries the form that finishes it, so the
group's post-backward and its finish call them without asking which they are. Each form sends through the
``Collective`` it was made with (the shard group's, or the user's around it: [Note: one collective seam] in
collective.py); which one, native or gloo's in-place, was decided once for the process group.

[Note: gloo reduce-scatter]
gloo has no reduce-scatter algorithm: torch's gloo backend runs ``reduce_scatter_tensor`` as a clone of
the whole input, an all-reduce of the clone, and a copy of this rank's chunk out of it when waited on;
the clone lives as long as the Work. On a gloo group fsdp2lite issues that all-reduce itself (its collective
is ``GlooInPlace``), in place on ``reduce_scatter_input``, and takes this rank's slot of it as the output
(cloned once waited, so the flat buffer can go). The same example as above:

    rank0 reduce_scatter_input [1 2 4 | 3 0 5], rank1 [3 4 6 | 5 0 7]
    all-reduce(sum), in place -> both [4 6 10 | 8 0 12]
    rank0 keeps slot 0 [4 6 10], rank1 slot 1 [8 0 12]; / 2 -> [2 3 5], [4 0 6]

The bytes on the wire are the same; the clone is gone: a group's reduction holds 1x its unsharded
bytes instead of 2x, plus its sharded output (benchmarks/gloo_memory.py measures both collectives).
One rank (any backend) reduces in place too, sending nothing, and there the slot is the whole input:
it is kept as the sharded gradients' storage, not cloned, so the reduction holds the group's gradient
bytes once (a clone held them twice for a moment, 2.6 MB above torch's fully_shard at a 4-block fp32
GPT's backward peak; now below it).
On every other backend (NCCL, the fake process group) the reduce-scatter is a native one.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from ..policies import CommPolicy
from .collective import Collective, CustomReduceScatter, ReduceScatterComm
from .comm import Comm, Ranks
from .grads import to_one_dtype
from .param import FSDPParam
from .quantize import exchange_rows, sum_received
from .trace import Meters


@torch.library.custom_op("fsdp2lite::chunk_cat", mutates_args=("out",))
def chunk_cat(tensors: list[torch.Tensor], num_chunks: int, out: torch.Tensor) -> None:
    """``torch._chunk_cat`` along dim 0 into ``out``, as an op of our own so that it has a fake kernel:
    under ``FakeTensorMode`` (simulated ranks, memory planning) aten's ``_chunk_cat`` has none and is
    decomposed into a few ops per gradient; this one checks nothing and writes nothing, like any fake
    kernel of an out= op. On real tensors it is the one aten kernel."""
    torch._chunk_cat(tensors, dim=0, num_chunks=num_chunks, out=out)


@chunk_cat.register_fake
def _chunk_cat_fake(tensors: list[torch.Tensor], num_chunks: int, out: torch.Tensor) -> None:
    return None


class ReduceScatterResult(NamedTuple):
    """A reduce-scatter in flight, with the parameters its output slots belong to and the form that finishes it."""

    reduce_scatter_output: torch.Tensor  # (group_numel,): a buffer, this rank's slot of the input, or received rows
    reduce_scatter_input: torch.Tensor  # (shard_size * group_numel,), or what an all-to-all sent
    params: tuple[FSDPParam, ...]
    work: dist.Work | None
    event: torch.cuda.Event | None
    form: ReduceForm
    parts: tuple[ReduceScatterResult, ...] = ()  # SplitReduce: one result per reduce dtype


class ReduceForm:
    """How a group reduce-scatters ([Note: reduce forms]): the copy-in is every form's, the collective and
    what finishing it takes are each form's own."""

    def __init__(self, ranks: Ranks, collective: Collective) -> None:
        self.ranks = ranks
        self.collective = collective  # what it calls: [Note: one collective seam] in collective.py

    def issue(
        self, params: tuple[FSDPParam, ...], grads: list[torch.Tensor], comm: Comm, meters: Meters
    ) -> ReduceScatterResult:
        """Lay the unsharded grads out rank-major in one flat buffer, in the parameters' one reduce dtype, and
        start the collective.

        Takes the caller's list and empties it once the copy-in has read the grads, so they are freed
        then, not when the reduce-scatter is waited on ([Note: buffer lifetime]).
        """
        dtype = one_reduce_dtype(params)
        to_one_dtype(grads, dtype)  # fresh beside accumulated: [Note: one reduce dtype]
        group_numel = sum(p.padded_numel for p in params)
        size = self.ranks.size
        # On the compute stream, where the grads were written: reading them needs no event, and the
        # buffer is only released after the compute stream has waited on the reduce-scatter.
        # the collective's buffer: set_custom_reduce_scatter's allocator
        reduce_scatter_input = self.collective.reduce_buffer((size * group_numel,), dtype, comm.device)
        rank_major = reduce_scatter_input.view(size, group_numel)
        # copy-in: chunk each grad into shard_size padded row blocks, rank-major, cast in one pass
        chunk_cat(grads, size, rank_major)
        grads.clear()  # the last references: the grads are freed now
        with comm.on("reduce_scatter"):  # after the copy-in on the compute stream
            output, sent, work = self.start(reduce_scatter_input, rank_major, comm, meters)
        event = comm.record("reduce_scatter")
        return ReduceScatterResult(output, sent, params, work, event=event, form=self)

    def start(
        self, flat: torch.Tensor, rank_major: torch.Tensor, comm: Comm, meters: Meters
    ) -> tuple[torch.Tensor, torch.Tensor, dist.Work | None]:
        """The collective over the copied-in ``flat`` (shard_size * group_numel,), viewed ``rank_major``
        (shard_size, group_numel); returns (output, what it sends, held until the finish, work)."""
        raise NotImplementedError

    def finish(self, result: ReduceScatterResult, comm: Comm) -> torch.Tensor:
        """Wait; this rank's summed ``(group_numel,)`` slot, the flat input released."""
        comm.wait(result.work, result.event)  # CPU: the output is written; CUDA: compute orders after it
        comm.release(result.reduce_scatter_input)  # waited on: nothing reads it after this
        return result.reduce_scatter_output


class NativeReduceScatter(ReduceForm):
    """The backend's reduce-scatter (NCCL, the fake process group), or the user's (``CustomReduceScatter``,
    whose bytes are not counted: what it sends is its own)."""

    def __init__(self, ranks: Ranks, collective: Collective, counted: bool = True) -> None:
        super().__init__(ranks, collective)
        self.counted = counted

    def start(
        self, flat: torch.Tensor, rank_major: torch.Tensor, comm: Comm, meters: Meters
    ) -> tuple[torch.Tensor, torch.Tensor, dist.Work | None]:
        output = self.collective.reduce_buffer((rank_major.shape[1],), rank_major.dtype, comm.device)
        work = self.collective.reduce_scatter(output, flat, self.ranks, async_op=comm.async_work)
        if self.counted:
            meters.count("reduce_scatter", flat.nbytes * (self.ranks.size - 1) // self.ranks.size)
        return output, flat, work


class InPlaceReduce(ReduceForm):
    """gloo, and one rank (any backend): an all-reduce in place, this rank's slot kept ([Note: gloo
    reduce-scatter]); one rank sends nothing and keeps the whole input as the gradients' storage."""

    def start(
        self, flat: torch.Tensor, rank_major: torch.Tensor, comm: Comm, meters: Meters
    ) -> tuple[torch.Tensor, torch.Tensor, dist.Work | None]:
        output = rank_major[self.ranks.rank]  # (group_numel,) view
        if self.ranks.size == 1:
            return output, flat, None  # one rank sends nothing, as torch's
        # a gloo collective: the flat input all-reduced in place, output its slot
        work = self.collective.reduce_scatter(output, flat, self.ranks, async_op=comm.async_work)
        meters.count("all_reduce", 2 * flat.nbytes * (self.ranks.size - 1) // self.ranks.size)
        return output, flat, work

    def finish(self, result: ReduceScatterResult, comm: Comm) -> torch.Tensor:
        comm.wait(result.work, result.event)
        if self.ranks.size == 1:
            return result.reduce_scatter_output  # the whole input, kept as the gradients' storage
        output = result.reduce_scatter_output.clone()  # (group_numel,), off the flat input
        comm.release(result.reduce_scatter_input)  # waited on: nothing reads it after this
        return output


class AllToAllReduce(ReduceForm):
    """``CommPolicy(reduce_scatter="all_to_all"|"int8")``: row j of the input sent to rank j (int8: encoded),
    the rows received summed at the finish ([Note: quantized collectives])."""

    def __init__(self, ranks: Ranks, collective: Collective, mode: str, block: int) -> None:
        super().__init__(ranks, collective)
        self.mode, self.block = mode, block

    def start(
        self, flat: torch.Tensor, rank_major: torch.Tensor, comm: Comm, meters: Meters
    ) -> tuple[torch.Tensor, torch.Tensor, dist.Work | None]:
        send, received = exchange_rows(rank_major, self.mode, self.block)
        work = self.collective.all_to_all(received, send, self.ranks, async_op=comm.async_work)
        meters.count("all_to_all", send.nbytes * (self.ranks.size - 1) // self.ranks.size)  # every row but its own
        return received, send, work

    def finish(self, result: ReduceScatterResult, comm: Comm) -> torch.Tensor:
        comm.wait(result.work, result.event)
        group_numel = sum(p.padded_numel for p in result.params)
        reduce_dtype = result.params[0].reduce_dtype
        output = sum_received(result.reduce_scatter_output, self.mode, group_numel, self.block, reduce_dtype)
        comm.release(result.reduce_scatter_input)  # waited on: nothing reads it after this
        return output


def one_reduce_dtype(params: tuple[FSDPParam, ...]) -> torch.dtype:
    """The one dtype ``params``' gradients reduce in (a reduce-scatter sums one dtype); several: an error
    naming them (parameters unfrozen since lazy init checked; [Note: per-parameter mixed precision] splits)."""
    dtype = params[0].reduce_dtype
    if any(param.reduce_dtype != dtype for param in params):
        listing = ", ".join(f"{p.fqn}: {p.reduce_dtype}" for p in params)
        raise RuntimeError(
            f"gradients to reduce in several dtypes ({listing}); a group's gradients are one reduce-scatter in one "
            "dtype: keep parameters of another dtype frozen, or set a reduce_dtype"
        )
    return dtype


def choose_reduce(
    ranks: Ranks, policy: CommPolicy, collective: Collective, custom: ReduceScatterComm | None
) -> ReduceForm:
    """The reduce form of a group over ``ranks`` with ``collective`` (the shard group's): the user's
    reduce-scatter (``custom``), CommPolicy ``policy``'s all-to-all, in place (a gloo collective, one rank), or
    the backend's reduce-scatter ([Note: reduce forms], [Note: one collective seam] in collective.py)."""
    if custom is not None:
        return NativeReduceScatter(ranks, CustomReduceScatter(collective, custom), counted=False)
    if policy.reduce_scatter is not None and ranks.size > 1:
        return AllToAllReduce(ranks, collective, policy.reduce_scatter, policy.block_size)
    if collective.in_place or ranks.size == 1:
        return InPlaceReduce(ranks, collective)
    return NativeReduceScatter(ranks, collective)
