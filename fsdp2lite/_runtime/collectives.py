"""A group's two collectives, each with its copy-in and copy-out.

All-gather (one per group per use), two ranks, params a (3 rows) and b (2 rows), padded_rows 2 and 1:

    rank0 shards: a[0:2], b[0]         -> all_gather_input rank0 = [a0 a1 | b0]
    rank1 shards: a[2] + pad, b[1]     -> all_gather_input rank1 = [a2 0  | b1]
    all-gather -> all_gather_output = [a0 a1 b0 | a2 0 b1]      # (shard_size * group_numel,)
    copy-out: view (shard_size, group_numel); column block of a -> rows a0 a1 a2, pad dropped

Reduce-scatter (one per group per backward), the same layout in reverse, averaged:

    rank0 grads a=[1,2,3] b=[4,5] -> reduce_scatter_input [1 2 4 | 3 0 5]
    rank1 grads a=[3,4,5] b=[6,7] -> reduce_scatter_input [3 4 6 | 5 0 7]
    reduce-scatter(sum) / 2       -> rank0 [2 3 5] (a0 a1 b0), rank1 [4 0 6] (a2 pad b1)

[Note: buffer lifetime]
Each flat buffer is owned by its result record (``AllGatherResult``/``ReduceScatterResult``), and the
record is dropped only after its work has been waited on and its output consumed; dropping the record
is what frees the buffers. Nothing relies on the allocator seeing a later use (no ``record_stream``).
The all-gather runs in place: its input is this rank's slot of its output, so an unshard allocates the
group's bytes once for the collective and once for the unsharded parameters (copy-out), 2x the group's
bytes at most. A separate input buffer would add 1/shard_size of that, and its release would depend on
when the backend's worker thread lets go of the finished work.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from .param import FSDPParam, padding_views, rank_major_pairs

# torch 2.13 renamed the flat collectives (the old names warn); torch 2.6-2.12 only have the old ones.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class AllGatherResult(NamedTuple):
    """An all-gather in flight, holding its buffer until the work is waited on."""

    all_gather_output: torch.Tensor  # (shard_size * group_numel,)
    all_gather_input: torch.Tensor  # (group_numel,): this rank's slot of all_gather_output
    work: dist.Work | None


class ReduceScatterResult(NamedTuple):
    """A reduce-scatter in flight, with the parameters its output slots belong to."""

    reduce_scatter_output: torch.Tensor  # (group_numel,)
    reduce_scatter_input: torch.Tensor  # (shard_size * group_numel,)
    params: tuple[FSDPParam, ...]
    work: dist.Work | None


def _offsets(params: tuple[FSDPParam, ...]) -> list[int]:
    offsets = [0]
    for param in params:
        offsets.append(offsets[-1] + param.padded_numel)
    return offsets


def issue_all_gather(
    params: tuple[FSDPParam, ...], group: dist.ProcessGroup, shard_size: int, shard_rank: int, dtype: torch.dtype
) -> AllGatherResult:
    """Copy every padded shard into this rank's slot of one flat buffer and start one in-place all-gather.

    The input is a view of the output (``output[rank * group_numel : (rank + 1) * group_numel]``), so the
    all-gather allocates the group's bytes once: [Note: buffer lifetime].
    """
    offsets = _offsets(params)
    all_gather_output = torch.empty(shard_size * offsets[-1], dtype=dtype, device=params[0].device)
    all_gather_input = all_gather_output.narrow(0, shard_rank * offsets[-1], offsets[-1])  # (group_numel,)
    for param, start, end in zip(params, offsets, offsets[1:]):
        # copy-in and cast in one pass (host-to-device too when offloaded: pinned, so non-blocking)
        all_gather_input[start:end].copy_(param.padded_shard.view(-1), non_blocking=True)
    work = _all_gather_flat(all_gather_output, all_gather_input, group=group, async_op=True)
    return AllGatherResult(all_gather_output, all_gather_input, work)


def wait_all_gather(result: AllGatherResult) -> torch.Tensor:
    """Wait for the all-gather and hand back its output."""
    if result.work is not None:
        result.work.wait()  # the output is complete only after this
    return result.all_gather_output


def copy_out_all_gather(all_gather_output: torch.Tensor, params: tuple[FSDPParam, ...], shard_size: int) -> None:
    """Copy each parameter's rows out of the rank-major all-gather output into unsharded storage."""
    offsets = _offsets(params)
    rank_major = all_gather_output.view(shard_size, offsets[-1])
    for param, start, end in zip(params, offsets, offsets[1:]):
        unsharded = param.alloc_unsharded()
        pairs = rank_major_pairs(unsharded, rank_major[:, start:end], param.padded_rows)
        for full_part, gathered_part in pairs:
            full_part.copy_(gathered_part)


def issue_reduce_scatter(
    params: tuple[FSDPParam, ...],
    grads: tuple[torch.Tensor, ...],
    group: dist.ProcessGroup,
    shard_size: int,
    dtype: torch.dtype,
) -> ReduceScatterResult:
    """Lay the unsharded grads out rank-major in one flat buffer and start one reduce-scatter(sum)."""
    offsets = _offsets(params)
    device = grads[0].device
    reduce_scatter_input = torch.empty(shard_size * offsets[-1], dtype=dtype, device=device)
    rank_major = reduce_scatter_input.view(shard_size, offsets[-1])
    for param, grad, start, end in zip(params, grads, offsets, offsets[1:]):
        block = rank_major[:, start:end]
        for full_part, scattered_part in rank_major_pairs(grad, block, param.padded_rows):
            scattered_part.copy_(full_part)  # copy-in, cast in one pass
        for pad in padding_views(block, grad.shape[0], param.padded_rows):
            pad.zero_()
    reduce_scatter_output = torch.empty(offsets[-1], dtype=dtype, device=device)
    work = _reduce_scatter_flat(
        reduce_scatter_output,
        reduce_scatter_input,
        op=dist.ReduceOp.SUM,
        group=group,
        async_op=True,
    )
    return ReduceScatterResult(reduce_scatter_output, reduce_scatter_input, params, work)


def finish_reduce_scatter(result: ReduceScatterResult, divide_factor: float) -> None:
    """Wait for the reduce-scatter, average, and accumulate each slot into its sharded ``.grad``."""
    if result.work is not None:
        result.work.wait()  # the output is complete only after this
    output = result.reduce_scatter_output
    if divide_factor != 1.0:
        output.div_(divide_factor)
    offsets = _offsets(result.params)
    for param, start, end in zip(result.params, offsets, offsets[1:]):
        param.accumulate_sharded_grad(output[start:end])
