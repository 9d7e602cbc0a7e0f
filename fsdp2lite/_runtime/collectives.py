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

[Note: hot path]
Everything here runs once per group per use, so it is written as a few ops over the whole group, never
a loop of ops per parameter: copy-in is one ``cat`` into this rank's slot (one ``_foreach_copy_`` from
pinned host shards under CPU offload, non-blocking); copy-out
is one ``split_with_sizes_copy`` into each parameter's padded unsharded storage ([Note: unsharded
storage]); the reduce-scatter copy-in is one ``_chunk_cat`` (it pads each gradient to whole chunks,
exactly the padded-shard layout); the sharded gradients are ``as_strided`` views of the reduced output
wrapped in DTensors with a spec built at ``fully_shard`` time. The views and specs that do not change
between steps are made once (``FSDPParam.flat_shard``, ``all_gather_view``, ``sharded_spec``).

[Note: copy-out by views]
A group of one parameter sharded on dim 0 needs no copy-out: its padded unsharded storage is laid out like the
all-gather's output (rank r's padded rows at row block r, the parameter its first numel elements), so the
all-gather writes that storage directly: allocated at the issue (``direct_output``), the copy-in writing this
rank's slot of it, no output buffer and no ``split_with_sizes_copy``. One copy of the parameter's bytes and one
transient buffer of them fewer per unshard (an embedding or a head sharded alone, as torchtitan does). Groups
of several parameters interleave them rank by rank, so their copy-out stays one ``split_with_sizes_copy``.

[Note: byte all-gather]
A group whose parameters all-gather in several dtypes (a frozen bf16 or int8 weight beside fp32 ones,
as torch's fully_shard allows) is still one collective: its buffer is uint8, each parameter's slot
holds its padded shard's bytes in its own all-gather dtype, and the copy-out writes each column block
into the parameter's storage viewed as bytes. Rank-major as above, with bytes for elements:

    a: 2 fp32 rows of 1 (8 bytes per rank), c: 2 int8 rows of 1 (2 bytes per rank), 2 ranks
    rank0 input [a0 (4 bytes) a1 (4) | c0 c1], rank1 [a2 (4) a3 (4) | c2 c3]
    all-gather (uint8) -> [rank0's 10 bytes | rank1's 10 bytes]; copy-out: a's 8-byte columns -> a, c's 2 -> c

Nothing is ever viewed across dtypes in the shared buffer, so no alignment is needed. Only the
trainable parameters are reduced, and they must reduce in one dtype (checked at ``fully_shard`` and at
lazy init: ``policies.reduce_dtype_problem``). A group of one dtype gathers as before, in that dtype.

[Note: gloo reduce-scatter]
gloo has no reduce-scatter algorithm: torch's gloo backend runs ``reduce_scatter_tensor`` as a clone of
the whole input, an all-reduce of the clone, and a copy of this rank's chunk out of it when waited on;
the clone lives as long as the Work. On a gloo group fsdp2lite issues that all-reduce itself, in place
on ``reduce_scatter_input``, and takes this rank's slot of it as the output (cloned once waited, so the
flat buffer can go). The same example as above:

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

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from .comm import AllGatherResult, Comm, all_gather_flat
from .host_steps import run_post_accumulate_grad_hooks
from .param import FSDPParam, make_dtensor
from .quantize import exchange_rows, sum_received

# torch 2.13 renamed the flat collectives (the old names warn); torch 2.6-2.12 only have the old ones.
_native_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


_all_reduce = dist.all_reduce


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


def reduces_in_place(group: dist.ProcessGroup, device: torch.device) -> bool:
    """True when ``group`` reduces CPU tensors with gloo: [Note: gloo reduce-scatter]."""
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


def _reduce_scatter_flat(
    reduce_scatter_output: torch.Tensor,
    reduce_scatter_input: torch.Tensor,
    *,
    group: dist.ProcessGroup,
    in_place: bool,
    async_op: bool,
) -> dist.Work | None:
    """One reduce-scatter(sum): ``reduce_scatter_input`` (shard_size * n,) into ``reduce_scatter_output`` (n,).

    ``in_place`` (gloo): the output is this rank's slot of the input and the input is all-reduced in
    place ([Note: gloo reduce-scatter])."""
    if in_place:
        return dist.all_reduce(reduce_scatter_input, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    return _native_reduce_scatter(
        reduce_scatter_output, reduce_scatter_input, op=dist.ReduceOp.SUM, group=group, async_op=async_op
    )


class ReduceScatterResult(NamedTuple):
    """A reduce-scatter in flight, with the parameters its output slots belong to."""

    reduce_scatter_output: torch.Tensor  # (group_numel,): a buffer, or (in place) this rank's slot of the input
    reduce_scatter_input: torch.Tensor  # (shard_size * group_numel,)
    in_place: bool  # gloo: [Note: gloo reduce-scatter]
    params: tuple[FSDPParam, ...]
    work: dist.Work | None
    event: torch.cuda.Event | None
    mode: str | None = None  # CommPolicy.reduce_scatter: the output is received rows to sum
    block: int = 0  # int8 mode: elements per scale block


def issue_all_gather(
    sources: list[torch.Tensor],
    numels: list[int],
    group: dist.ProcessGroup,
    group_size: int,
    group_rank: int,
    dtype: torch.dtype,
    comm: Comm,
    custom: Any = None,
    into: torch.Tensor | None = None,
) -> AllGatherResult:
    """Copy ``sources`` (this rank's flat padded shards, ``numels`` elements each) into this rank's slot
    of one flat buffer and start one in-place all-gather over ``group``.

    The input is a view of the output (``output[rank * group_numel : (rank + 1) * group_numel]``), so the
    all-gather allocates the group's bytes once: [Note: buffer lifetime]. ``into``: the output is that
    buffer, allocated already (a one-parameter group's unsharded storage: [Note: copy-out by views]).
    """
    group_numel = sum(numels)
    with comm.on("all_gather_copy_in"):
        size = group_size * group_numel
        if into is not None:
            all_gather_output = into
        elif custom is not None:  # set_custom_all_gather: the user's allocator
            all_gather_output = custom.allocate((size,), dtype=dtype, device=comm.device)
        else:
            all_gather_output = torch.empty(size, dtype=dtype, device=comm.device)
        all_gather_input = all_gather_output.narrow(0, group_rank * group_numel, group_numel)  # (group_numel,)
        if sources[0].device == all_gather_input.device:  # copy-in, cast to the all-gather dtype: one op
            torch.cat(sources, out=all_gather_input)
        else:  # CPU offload: host shards (one group, one policy), non-blocking from pinned memory
            torch._foreach_copy_(torch.split(all_gather_input, numels), sources, non_blocking=True)
    copied_in = comm.record("all_gather_copy_in")
    with comm.after("all_gather", copied_in):  # the collective reads what the copy-in wrote
        work = None
        if custom is not None:
            work = custom(
                output_tensor=all_gather_output, input_tensor=all_gather_input, group=group, async_op=comm.async_work
            )
        elif group_size > 1:  # one rank: the copy-in already wrote the whole output, as torch sends nothing
            work = all_gather_flat(all_gather_output, all_gather_input, group=group, async_op=comm.async_work)
    comm.count("all_gather", (group_size - 1) * all_gather_input.nbytes)  # a ring: every other rank's slot
    return AllGatherResult(all_gather_output, all_gather_input, work, comm.record("all_gather"))


def byte_sources(params: tuple[FSDPParam, ...]) -> tuple[list[torch.Tensor], list[int]]:
    """Each parameter's flat padded shard in its all-gather dtype, as bytes, and the byte counts:
    the all-gather input of a group whose parameters gather in several dtypes ([Note: byte all-gather]);
    a parameter with all-gather hooks contributes its hook's inputs ([Note: all-gather extension])."""
    sources: list[torch.Tensor] = []
    for param in params:
        if param.extension is not None:
            sources.extend(t.view(torch.uint8) for t in param.extension_inputs())
            continue
        flat = param.flat_shard
        if flat.dtype != param.param_dtype:
            flat = flat.to(param.param_dtype)  # mixed precision: cast first, the buffer holds bytes
        sources.append(flat.view(torch.uint8))
    return sources, [source.numel() for source in sources]


def wait_all_gather(result: AllGatherResult, comm: Comm) -> torch.Tensor:
    """Make the compute side wait for the all-gather and hand back its output."""
    comm.wait(result.work, result.event)  # the output is complete (CPU) or ordered (CUDA) after this
    return result.all_gather_output


def direct_output(params: tuple[FSDPParam, ...], custom: Any) -> torch.Tensor | None:
    """The unsharded storage of a group's one parameter, when the all-gather can write it directly: sharded
    on dim 0, gathered in its own dtype without hooks or a custom all-gather ([Note: copy-out by views]).
    CUDA: allocated on the compute stream; the copy-in stream waits for everything queued there before it
    writes (``Comm.on``), and the compute stream waits for the all-gather before it reads ([Note: CUDA buffer
    lifetime])."""
    if len(params) != 1 or custom is not None:
        return None
    param = params[0]
    if param.shard_dim != 0 or param.extension is not None:
        return None
    return param.alloc_unsharded()


def copy_out_all_gather(
    all_gather_output: torch.Tensor,
    params: tuple[FSDPParam, ...],
    group_size: int,
    numels: list[int],
    as_bytes: bool = False,
) -> bool:
    """Copy each parameter's column block of the rank-major output into its padded unsharded storage;
    True when the output is that storage already (nothing copied: [Note: copy-out by views]).

    ``all_gather_output`` viewed ``(group_size, group_numel)``: row r is rank r's slot, parameter i
    its columns ``[offset_i, offset_i + numels[i])``; one op writes every parameter's
    ``(group_size, numels[i])`` view, whose first ``numel`` elements are the parameter ([Note: hot path]).
    ``as_bytes``: the output is uint8 and ``numels`` are bytes; each target is viewed as bytes too.
    """
    flat = params[0].unsharded_flat
    if len(params) == 1 and flat is not None and all_gather_output.data_ptr() == flat.data_ptr():
        return True
    if as_bytes:
        outputs = []
        for param in params:  # in byte_sources' order: a hook's inputs, or one flat shard
            if param.extension is not None:
                outputs.extend(param.extension.output_views(group_size))
            else:
                numel = numels[len(outputs)] // param.param_dtype.itemsize
                outputs.append(param.copy_out_view(group_size, numel).view(torch.uint8))
    else:
        outputs = [param.copy_out_view(group_size, numel) for param, numel in zip(params, numels)]
    torch.split_with_sizes_copy(all_gather_output.view(group_size, -1), numels, dim=1, out=outputs)
    return False


def post_forward_shards(params: tuple[FSDPParam, ...], size: int, rank: int) -> tuple[torch.Tensor, list[int]]:
    """This rank's chunk of every unsharded parameter when sharded over ``size`` ranks, in one flat buffer.

    Returns (buffer (group_numel,), padded numel per parameter). Chunking follows torch.chunk, padded
    like the main shards, so ``copy_out_all_gather`` restores the parameters from a ``size``-rank gather.
    """
    padded_rows = [math.ceil(p.gather_shape[0] / size) for p in params]
    numels = [rows * _row_numel(p) for p, rows in zip(params, padded_rows)]
    buffer = torch.zeros(sum(numels), dtype=params[0].param_dtype, device=params[0].device)
    offset = 0
    for param, rows, numel in zip(params, padded_rows, numels):
        unsharded = param.unsharded_local
        if unsharded is None:
            raise RuntimeError(f"{param.fqn}: resharding to a post-forward group before it was unsharded")
        local = unsharded.detach().view(param.gather_shape[0], -1)[rank * rows : (rank + 1) * rows]  # may be short
        buffer[offset : offset + local.numel()].copy_(local.reshape(-1))
        offset += numel
    return buffer, numels


def _row_numel(param: FSDPParam) -> int:
    return param.gather_shape.numel() // param.gather_shape[0]


def issue_reduce_scatter(
    params: tuple[FSDPParam, ...],
    grads: list[torch.Tensor],
    group: dist.ProcessGroup,
    shard_rank: int,
    shard_size: int,
    dtype: torch.dtype,
    in_place: bool,
    comm: Comm,
    custom: Any = None,
    mode: str | None = None,
    block: int = 0,
) -> ReduceScatterResult:
    """Lay the unsharded grads out rank-major in one flat buffer and start one reduce-scatter(sum);
    ``mode`` (CommPolicy.reduce_scatter): as an all-to-all of the rows ([Note: quantized collectives]).

    Takes the caller's list and empties it once the copy-in has read the grads, so they are freed
    then, not when the reduce-scatter is waited on ([Note: buffer lifetime]).
    """
    group_numel = sum(p.padded_numel for p in params)
    # On the compute stream, where the grads were written: reading them needs no event, and the
    # buffer is only released after the compute stream has waited on the reduce-scatter.
    allocate = custom.allocate if custom is not None else torch.empty  # set_custom_reduce_scatter
    reduce_scatter_input = allocate((shard_size * group_numel,), dtype=dtype, device=comm.device)
    rank_major = reduce_scatter_input.view(shard_size, group_numel)
    # copy-in: chunk each grad into shard_size padded row blocks, rank-major, cast in one pass
    chunk_cat(grads, shard_size, rank_major)
    grads.clear()  # the last references: the grads are freed now
    if mode is not None and shard_size > 1 and custom is None:
        with comm.on("reduce_scatter"):  # after the copy-in on the compute stream
            send, received, work = exchange_rows(rank_major, mode, block, group, comm.async_work)
        comm.count("all_to_all", send.nbytes * (shard_size - 1) // shard_size)  # every row but its own
        event = comm.record("reduce_scatter")
        return ReduceScatterResult(received, send, False, params, work, event, mode, block)
    in_place = in_place or (shard_size == 1 and custom is None)  # one rank: the input is the output
    if in_place:
        reduce_scatter_output = rank_major[shard_rank]  # (group_numel,) view: [Note: gloo reduce-scatter]
    else:
        reduce_scatter_output = allocate((group_numel,), dtype=dtype, device=comm.device)
    with comm.on("reduce_scatter"):  # after the copy-in on the compute stream
        work = None
        if custom is not None:
            work = custom(
                output_tensor=reduce_scatter_output, input_tensor=reduce_scatter_input, group=group,
                op=dist.ReduceOp.SUM, async_op=comm.async_work,
            )  # fmt: skip
        elif shard_size > 1:  # one rank sends nothing, as torch's
            work = _reduce_scatter_flat(
                reduce_scatter_output, reduce_scatter_input, group=group, in_place=in_place, async_op=comm.async_work
            )
            ring = reduce_scatter_input.nbytes * (shard_size - 1) // shard_size
            comm.count("all_reduce" if in_place else "reduce_scatter", 2 * ring if in_place else ring)
    event = comm.record("reduce_scatter")
    return ReduceScatterResult(reduce_scatter_output, reduce_scatter_input, in_place, params, work, event)


def finish_reduce_scatter(
    result: ReduceScatterResult,
    divide_factor: float,
    replicate_group: dist.ProcessGroup | None,
    all_reduce: bool,
    comm: Comm,
    hook: Callable[[torch.Tensor], None] | None = None,
    hook_stream: torch.cuda.Stream | None = None,
    replicas: Any = None,
    group: str = "<root>",
) -> torch.cuda.Event | None:
    """Wait for the reduce-scatter; for HSDP, all-reduce (sum) across replicas (HFSDP, ``replicas``: a
    reduce-scatter across them, [Note: replica-sharded groups]); average; accumulate into
    each sharded ``.grad`` (``group``: the group's name in traces). Returns an event after the device-to-host
    gradient copy of CPU offload (None when there is none), for the end of backward to wait on.

    HSDP with ``all_reduce=False`` keeps the replica-local sums on the parameters instead
    (``partial_reduced_grad``); the next all-reduce adds them in, so nothing is lost.
    Example, 2 replicas x 2 shards: rank (r0,s0) holds after the reduce-scatter the sum of s0-slots over
    its replica; the all-reduce adds replica r1's sum for the same slot; dividing by 4 gives DDP's mean.
    """
    comm.wait(result.work, result.event)  # CPU: the output is written; CUDA: compute orders after it
    output = result.reduce_scatter_output
    # one rank: the slot is the whole input, kept as the gradients' storage ([Note: gloo reduce-scatter])
    whole_input = result.in_place and output.numel() == result.reduce_scatter_input.numel()
    if result.mode is not None:  # the rows every rank sent this one, summed: [Note: quantized collectives]
        group_numel = sum(p.padded_numel for p in result.params)
        output = sum_received(output, result.mode, group_numel, result.block, result.params[0].reduce_dtype)
    elif result.in_place and not whole_input:
        output = output.clone()  # (group_numel,), off the flat input: [Note: gloo reduce-scatter]
    if not whole_input:
        comm.release(result.reduce_scatter_input)  # waited on: nothing reads it after this
    if replicate_group is not None:
        slots = _slots(output, result.params)
        if not all_reduce:
            for param, slot in slots:
                param.keep_partial_reduced_grad(slot)
            return None
        if replicas is not None:  # HFSDP
            for param, slot in slots:
                param.add_partial_reduced_grad(slot)
            output = replicas.reduce_scatter(output, result.params)
        else:
            _all_reduce_replicas(output, slots, replicate_group, comm)
    if divide_factor != 1.0:
        output.div_(divide_factor)
    if hook is not None:  # sees the gradient as it will be stored (averaged), as torch's hook does
        _run_all_reduce_hook(hook, hook_stream, output)
    return accumulate_sharded_grads(output, result.params, comm, group)


def _all_reduce_replicas(
    output: torch.Tensor, slots: list[tuple[FSDPParam, torch.Tensor]], group: dist.ProcessGroup, comm: Comm
) -> None:
    """HSDP: fold kept replica-local sums into the slots, then all-reduce (sum) ``output`` across replicas."""
    with comm.after("all_reduce", comm.record_current()):  # the all-reduce reads the reduced output
        folded = [param.add_partial_reduced_grad(slot) for param, slot in slots]
        work = _all_reduce(output, op=dist.ReduceOp.SUM, group=group, async_op=comm.async_work)
        replicas = dist.get_world_size(group)
        comm.count("replica_all_reduce", 2 * output.nbytes * (replicas - 1) // replicas)
    comm.wait(work, comm.record("all_reduce"))  # compute reads the all-reduced output from here on
    del folded  # compute-stream tensors the all-reduce stream read: released once compute waited


def _run_all_reduce_hook(
    hook: Callable[[torch.Tensor], None], stream: torch.cuda.Stream | None, output: torch.Tensor
) -> None:
    """The user's hook on the group's reduced flat gradient (averaged over the data-parallel ranks, or
    divided by the set factor), on ``stream`` if one was given (CUDA), ordered both ways with the compute
    stream."""
    if stream is None:
        hook(output)
        return
    current = torch.cuda.current_stream(output.device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        hook(output)
    current.wait_stream(stream)


def accumulate_sharded_grads(
    output: torch.Tensor, params: tuple[FSDPParam, ...], comm: Comm, group: str = "<root>"
) -> torch.cuda.Event | None:
    """Add this rank's reduced ``(group_numel,)`` gradients into each parameter's DTensor ``.grad`` (of group
    ``group``: its name in traces), then run their post-accumulate-grad hooks.

    Gradients are stored in the parameters' own dtype (one cast of the whole output), next to the shards
    (on the host when offloaded: one non-blocking copy of the whole output into a pinned buffer of
    ``comm``'s pool, [Note: host gradient buffers] in pinned.py; the returned event marks its end). A new
    gradient is an ``as_strided`` view of the output that skips the slot's padding rows; an existing one (no
    ``zero_grad`` in between) gets the new one added.
    """
    comm.host_steps.wait_for(p.sharded_param for p in params)  # [Note: host steps off backward's thread]
    first = params[0]
    uniform = all(p.orig_dtype == first.orig_dtype for p in params)
    flat = output.to(first.orig_dtype) if uniform else output  # no-op when reduced in the params' dtype
    offload_event = None
    if first.grads_on_host and flat.device.type != "cpu":
        host = comm.host_grads.take(flat.numel(), flat.dtype, first.pin_memory)  # [Note: host gradient buffers]
        # async only when nothing below reads the host copy at once: adding into kept gradients and casting
        # mixed dtypes run on the host right away, so they need the copy landed (torch's blocks there too)
        reads_now = not uniform or any(param.sharded_param.grad is not None for param in params)
        flat = host.copy_(flat, non_blocking=host.is_pinned() and not reads_now)
        if host.is_pinned() and not reads_now:
            offload_event = torch.cuda.Event()
            offload_event.record()  # after the copy on the compute stream: waited at the end of backward
    existing: list[torch.Tensor] = []
    new: list[torch.Tensor] = []
    offset = flat.storage_offset()
    for param in params:
        local = flat.as_strided(param.local_shape, param.grad_stride, offset)  # (local_rows, *rest)
        offset += param.reduced_numel
        if not uniform:
            local = local.to(param.orig_dtype)
        current = param.sharded_param.grad
        if current is None:
            param.sharded_param.grad = make_dtensor(local, param.sharded_spec)
        else:
            existing.append(current._local_tensor)  # type: ignore[attr-defined]
            new.append(local)
    if existing:
        torch._foreach_add_(existing, new)
    # [Note: host steps off backward's thread]
    run_post_accumulate_grad_hooks(params, offload_event, comm.host_steps, group, comm.device)
    return offload_event


def _slots(output: torch.Tensor, params: tuple[FSDPParam, ...]) -> list[tuple[FSDPParam, torch.Tensor]]:
    return list(zip(params, torch.split(output, [p.padded_numel for p in params])))
