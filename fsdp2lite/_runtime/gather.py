"""A group's all-gather: copy-in, the collective, copy-out, and the form it takes.

One all-gather per group per use, two ranks, params a (3 rows) and b (2 rows), padded_rows 2 and 1:

    rank0 shards: a[0:2], b[0]         -> all_gather_input rank0 = [a0 a1 | b0]
    rank1 shards: a[2] + pad, b[1]     -> all_gather_input rank1 = [a2 0  | b1]
    all-gather -> all_gather_output = [a0 a1 b0 | a2 0 b1]      # (shard_size * group_numel,)
    copy-out: view (shard_size, group_numel); column block of a -> rows a0 a1 a2, pad dropped

[Note: gather forms]
How a group gathers depends only on facts fixed until a setter changes them: its parameters' dtypes and
all-gather hooks, its CommPolicy, a custom all-gather. So the group holds one ``GatherForm``, chosen by
``choose_gather`` when it is made and again only by what changes those facts (``set_comm_policy``,
``set_custom_all_gather``, hooks appearing or disappearing, ``module.to(dtype)``):

    PlainGather      one dtype: the flat shards, cast in the copy-in, gathered in that dtype
    ByteGather       several dtypes, or all-gather hooks: every slot as bytes ([Note: byte all-gather])
    QuantizedGather  CommPolicy(all_gather="int8"|"fp8"): codes and scales ([Note: quantized collectives])
    Regather         after a k-rank post-forward reshard: the kept chunks over the k ranks, for backward

A form issues the collective (``issue``) and copies its output into the parameters (``copy_out``); the
pending all-gather carries the form that issued it, so ``wait_for_unshard`` never asks which it was.
``Regather`` is made at the post-forward reshard from what the group's form kept (``kept_slots`` at the
copy-out of a byte group) or can cut from the unsharded parameters (``chunks``), and used once.

[Note: hot path]
Everything here runs once per group per use, so it is written as a few ops over the whole group, never
a loop of ops per parameter: copy-in is one ``cat`` into this rank's slot (one ``_foreach_copy_`` from
pinned host shards under CPU offload, non-blocking); copy-out is one ``split_with_sizes_copy`` into each
parameter's padded unsharded storage ([Note: unsharded storage]). The views that do not change between
steps are made once (``FSDPParam.flat_shard``, its unsharded storage's ``all_gather_view``) and so are the forms' lists.

[Note: copy-out by views]
A group of one parameter whose gathered rows are it followed by padding (sharded on dim 0, unaligned:
``layout.gathered_is_contiguous``, [Note: padded shard] in layout.py) needs no copy-out: its padded unsharded
storage is laid out like the all-gather's output (rank r's padded rows at row block r, the parameter its first
numel elements), so the all-gather writes that storage directly: allocated at the issue, the copy-in writing
this rank's slot of it, no output buffer and no ``split_with_sizes_copy``. One copy of the parameter's bytes
and one transient buffer of them fewer per unshard (an embedding or a head sharded alone, as torchtitan does).
Groups of several parameters interleave them rank by rank, so their copy-out stays one ``split_with_sizes_copy``.

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
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import NamedTuple, Protocol

import torch

from ..policies import CommPolicy
from .collective import AllGatherComm, Collective, CustomAllGather
from .comm import AllGatherResult, Comm, Ranks
from .layout import ShardLayout
from .param import FSDPParam
from .quantize import block_segments, copy_out_quantized, encode_group
from .trace import Meters


class GatherForm(Protocol):
    """How a group all-gathers ([Note: gather forms])."""

    def issue(self, comm: Comm, meters: Meters) -> AllGatherResult:
        """Copy this rank's shards in and start the collective (its bytes counted in ``meters``)."""
        ...

    def copy_out(self, output: torch.Tensor) -> bool:
        """Fill the parameters from the waited-on ``output``; True when it is their storage already."""
        ...

    def kept_slots(self, output: torch.Tensor, sub: Ranks) -> Regather | None:
        """At copy-out, before a post-forward reshard to ``sub``: what to keep for the regather, if the
        unsharded parameters cannot give it later."""
        ...

    def chunks(self, sub: Ranks) -> Regather | None:
        """At the post-forward reshard: this rank's chunks over ``sub``, cut from the unsharded parameters."""
        ...


class PendingUnshard(NamedTuple):
    """An all-gather in flight and the form that copies it out."""

    result: AllGatherResult
    form: GatherForm


def choose_gather(
    params: tuple[FSDPParam, ...],
    ranks: Ranks,
    policy: CommPolicy,
    collective: Collective,
    custom: AllGatherComm | None,
) -> GatherForm:
    """The form a group of ``params`` gathers in over ``ranks`` with ``collective`` (the shard group's), under
    CommPolicy ``policy`` and a custom all-gather ``custom`` (torch's AllGather protocol, or None; a quantized
    all-gather runs the group's own): [Note: gather forms], [Note: one collective seam] in collective.py."""
    if policy.all_gather is not None:
        return QuantizedGather(params, ranks, collective, policy.all_gather, policy.block_size)
    gathering = collective if custom is None else CustomAllGather(collective, custom)
    dtype = one_dtype(params)
    if dtype is None:
        return ByteGather(params, ranks, gathering)
    return PlainGather(params, ranks, dtype, gathering)


def one_dtype(params: tuple[FSDPParam, ...]) -> torch.dtype | None:
    """The dtype every parameter all-gathers in, or None when they differ ([Note: byte all-gather])."""
    dtypes = {param.unit.gather_dtype for param in params}  # None: a hook's bytes ([Note: gather units])
    return dtypes.pop() if len(dtypes) == 1 else None


def quantized_gather_problem(params: list[tuple[str, torch.dtype | None, bool]]) -> str | None:
    """Why a quantized all-gather cannot pack these parameters ((name, all-gather dtype or None for a hook's
    bytes, floating point)) into its one slot of plain floating-point values of one dtype, or None when it can.
    The plan (``_plan.py``) and ``set_comm_policy`` both ask this ([Note: quantized collectives])."""
    odd = [name for name, dtype, floating in params if dtype is None or not floating]
    if odd:
        return f"these are not plain floating-point parameters: {', '.join(odd)}"
    dtypes = sorted({str(dtype).removeprefix("torch.") for _, dtype, _ in params})
    return f"of several dtypes ({', '.join(dtypes)})" if len(dtypes) > 1 else None


class PlainGather:
    """Parameters of one all-gather dtype: their flat shards, cast in the copy-in."""

    def __init__(self, params: tuple[FSDPParam, ...], ranks: Ranks, dtype: torch.dtype, collective: Collective) -> None:
        self.params, self.ranks, self.dtype, self.collective = params, ranks, dtype, collective
        self.sources = [p.flat_shard for p in params]  # views made once: [Note: hot path]
        self.numels = [p.padded_numel for p in params]
        contiguous = params[0].layout.gathered_is_contiguous  # the parameter is a view of its gathered rows
        # [Note: copy-out by views]; a user's all-gather allocates its own output
        self.direct = len(params) == 1 and contiguous and not collective.user_buffers

    def issue(self, comm: Comm, meters: Meters) -> AllGatherResult:
        into = self.params[0].unsharded.alloc() if self.direct else None
        return issue_all_gather(
            self.sources, self.numels, self.ranks, self.dtype, comm, self.collective, into=into, meters=meters
        )

    def copy_out(self, output: torch.Tensor) -> bool:
        if self.direct:
            return True  # the all-gather wrote the parameter's storage
        copy_out_all_gather(output, self.params, self.ranks.size, self.numels)
        return False

    def kept_slots(self, output: torch.Tensor, sub: Ranks) -> Regather | None:
        return None  # cut from the unsharded parameters at the reshard (chunks)

    def chunks(self, sub: Ranks) -> Regather | None:
        buffer, numels = post_forward_shards(self.params, sub.size, sub.rank)
        return Regather(self.params, sub, buffer, numels, sub.size, self.collective.plain())


class ByteGather:
    """Parameters of several all-gather dtypes, or with all-gather hooks: one uint8 collective
    ([Note: byte all-gather], [Note: all-gather extension])."""

    def __init__(self, params: tuple[FSDPParam, ...], ranks: Ranks, collective: Collective) -> None:
        self.params, self.ranks, self.collective = params, ranks, collective
        self.offloaded = params[0].home.on_host  # [Note: offloaded hooked parameters]
        self.numels: list[int] = []

    def issue(self, comm: Comm, meters: Meters) -> AllGatherResult:
        # offloaded: device copy + pre hook on the copy-in stream, [Note: offloaded hooked parameters]
        with comm.on("all_gather_copy_in") if self.offloaded else nullcontext():
            sources, self.numels = byte_sources(self.params)
        return issue_all_gather(sources, self.numels, self.ranks, torch.uint8, comm, self.collective, meters=meters)

    def copy_out(self, output: torch.Tensor) -> bool:
        copy_out_all_gather(output, self.params, self.ranks.size, self.numels, as_bytes=True)
        return False

    def kept_slots(self, output: torch.Tensor, sub: Ranks) -> Regather | None:
        """This rank's share of the rank-major slots for ``sub``: slots ``[s * m, (s + 1) * m)`` with s its
        rank there and m = shard size / k, so the k-rank regather rebuilds the whole output, hooks' bytes and
        all ([Note: post-forward reshard])."""
        size = self.ranks.size
        per = size // sub.size
        kept = output.view(size, -1)[sub.rank * per : (sub.rank + 1) * per].reshape(-1).clone()
        return Regather(self.params, sub, kept, list(self.numels), size, self.collective.plain())

    def chunks(self, sub: Ranks) -> Regather | None:
        return None  # no one-dtype rows to cut: only what kept_slots kept


class QuantizedGather(PlainGather):
    """``CommPolicy(all_gather="int8"|"fp8")``: block-quantized codes and scales of one-dtype floating-point
    shards, decoded at the copy-out ([Note: quantized collectives]); regathers in full precision."""

    def __init__(
        self, params: tuple[FSDPParam, ...], ranks: Ranks, collective: Collective, kind: str, block: int
    ) -> None:
        super().__init__(params, ranks, params[0].param_dtype, collective)
        self.direct = False
        self.kind, self.block = kind, block
        self.staging: torch.Tensor | None = None  # the block-aligned segments, made at the first use
        self.code_bytes = 0

    def issue(self, comm: Comm, meters: Meters) -> AllGatherResult:
        if self.staging is None:  # zeroed once: the block padding between segments stays zero
            staging_numel = sum(block_segments(self.params, self.block))
            self.staging = torch.zeros(staging_numel, dtype=self.params[0].orig_dtype, device=comm.device)
        codes, scales = encode_group(self.params, self.staging, comm, self.kind, self.block)
        self.code_bytes = codes.numel()
        sizes = [codes.numel(), scales.numel()]
        return issue_all_gather([codes, scales], sizes, self.ranks, torch.uint8, comm, self.collective, meters=meters)

    def copy_out(self, output: torch.Tensor) -> bool:
        copy_out_quantized(output, self.params, self.ranks.size, self.code_bytes, kind=self.kind, block=self.block)
        return False


class Regather:
    """The all-gather after a post-forward reshard: ``buffer`` (this rank's kept chunks or slots) over the
    k ranks of ``sub`` rebuilds every parameter ([Note: post-forward reshard])."""

    def __init__(
        self,
        params: tuple[FSDPParam, ...],
        sub: Ranks,
        buffer: torch.Tensor,
        numels: list[int],
        slots: int,
        collective: Collective,
    ) -> None:
        self.params, self.sub, self.buffer, self.numels = params, sub, buffer, numels
        self.collective = collective  # the runtime's own, over the k ranks of sub
        self.slots = slots  # rows of the regathered output: k chunks, or the shard group's byte slots
        self.as_bytes = buffer.dtype == torch.uint8
        self.rebuilding = tuple(p.unit for p in params if p.unit.rebuilds)

    def issue(self, comm: Comm, meters: Meters) -> AllGatherResult:
        for unit in self.rebuilding:
            unit.reallocate()  # its hook is not called again
        sizes = [self.buffer.numel()]
        return issue_all_gather([self.buffer], sizes, self.sub, self.buffer.dtype, comm, self.collective, meters=meters)

    def copy_out(self, output: torch.Tensor) -> bool:
        copy_out_all_gather(output, self.params, self.slots, self.numels, as_bytes=self.as_bytes)
        return False

    def kept_slots(self, output: torch.Tensor, sub: Ranks) -> Regather | None:
        return None

    def chunks(self, sub: Ranks) -> Regather | None:
        return None


def issue_all_gather(
    sources: list[torch.Tensor],
    numels: list[int],
    ranks: Ranks,
    dtype: torch.dtype,
    comm: Comm,
    collective: Collective,
    *,
    into: torch.Tensor | None = None,
    meters: Meters,
) -> AllGatherResult:
    """Copy ``sources`` (this rank's flat padded shards, ``numels`` elements each) into this rank's slot
    of one flat buffer and start one in-place all-gather over ``ranks`` with ``collective``, placed by ``comm``.

    The input is a view of the output (``output[rank * group_numel : (rank + 1) * group_numel]``), so the
    all-gather allocates the group's bytes once: [Note: buffer lifetime]. ``into``: the output is that
    buffer, allocated already (a one-parameter group's unsharded storage: [Note: copy-out by views]).
    """
    group_numel = sum(numels)
    with comm.on("all_gather_copy_in"):
        size = ranks.size * group_numel
        # the collective's buffer (set_custom_all_gather: the user's allocator), or the one given
        all_gather_output = into if into is not None else collective.gather_buffer((size,), dtype, comm.device)
        all_gather_input = all_gather_output.narrow(0, ranks.rank * group_numel, group_numel)  # (group_numel,)
        if sources[0].device == all_gather_input.device:  # copy-in, cast to the all-gather dtype: one op
            torch.cat(sources, out=all_gather_input)
        else:  # CPU offload: host shards (one group, one policy), non-blocking from pinned memory
            torch._foreach_copy_(torch.split(all_gather_input, numels), sources, non_blocking=True)
    copied_in = comm.record("all_gather_copy_in")
    with comm.after("all_gather", copied_in):  # the collective reads what the copy-in wrote
        work = collective.all_gather(all_gather_output, all_gather_input, ranks, async_op=comm.async_work)
    meters.count("all_gather", (ranks.size - 1) * all_gather_input.nbytes)  # a ring: every other rank's slot
    return AllGatherResult(all_gather_output, all_gather_input, work, comm.record("all_gather"))


def byte_sources(params: tuple[FSDPParam, ...]) -> tuple[list[torch.Tensor], list[int]]:
    """Each parameter's flat padded shard in its all-gather dtype, as bytes, and the byte counts:
    the all-gather input of a group whose parameters gather in several dtypes ([Note: byte all-gather]);
    a parameter with all-gather hooks contributes its hook's inputs ([Note: all-gather extension])."""
    sources = [source for param in params for source in param.unit.inputs()]  # [Note: gather units]
    return sources, [source.numel() for source in sources]


def copy_out_all_gather(
    all_gather_output: torch.Tensor,
    params: tuple[FSDPParam, ...],
    group_size: int,
    numels: list[int],
    as_bytes: bool = False,
) -> None:
    """Copy each parameter's column block of the rank-major output into its padded unsharded storage.

    ``all_gather_output`` viewed ``(group_size, group_numel)``: row r is rank r's slot, parameter i
    its columns ``[offset_i, offset_i + numels[i])``; one op writes every parameter's
    ``(group_size, numels[i])`` view, whose first ``numel`` elements are the parameter ([Note: hot path]).
    ``as_bytes``: the output is uint8 and ``numels`` are bytes; each target is viewed as bytes too.
    """
    if as_bytes:
        outputs: list[torch.Tensor] = []
        for param in params:  # in byte_sources' order: a hook's inputs, or one flat shard
            outputs.extend(param.unit.output_views(group_size, numels[len(outputs)]))
    else:
        outputs = [param.unsharded.copy_out_view(group_size, numel) for param, numel in zip(params, numels)]
    torch.split_with_sizes_copy(all_gather_output.view(group_size, -1), numels, dim=1, out=outputs)


def post_forward_shards(params: tuple[FSDPParam, ...], size: int, rank: int) -> tuple[torch.Tensor, list[int]]:
    """This rank's chunk of every unsharded parameter when sharded over ``size`` ranks, in one flat buffer.

    Returns (buffer (group_numel,), padded numel per parameter). Chunking follows torch.chunk, padded
    like the main shards, so ``copy_out_all_gather`` restores the parameters from a ``size``-rank gather.
    """
    layouts = [ShardLayout(tuple(p.gather_shape), 0, size, rank) for p in params]  # the k-rank chunks
    numels = [layout.padded_numel for layout in layouts]
    buffer = torch.zeros(sum(numels), dtype=params[0].param_dtype, device=params[0].device)
    offset = 0
    for param, layout, numel in zip(params, layouts, numels):
        unsharded = param.unsharded.unsharded_local
        if unsharded is None:
            raise RuntimeError(f"{param.fqn}: resharding to a post-forward group before it was unsharded")
        local = layout.local_of(unsharded.detach())  # this rank's rows, may be short
        buffer[offset : offset + local.numel()].view(local.shape).copy_(local)
        offset += numel
    return buffer, numels
