"""Communication-only quantization: block-scaled int8 / fp8 encodings of what a collective sends.

[Note: quantized collectives]
``CommPolicy(all_gather="int8")``: before the all-gather each rank encodes its slot of the group (its
parameters' padded flat shards side by side, in their own precision, e.g. the fp32 masters) in one pass, in
blocks of ``block_size`` elements (each parameter's segment padded to whole blocks, so a block never spans
two parameters), one fp32 absmax scale per block:
``q = round(x / s)``, ``s = absmax / 127`` (fp8: ``x / s`` in e4m3, ``s = absmax / 448``). The group's one
uint8 collective carries each rank's codes then its scales; each rank decodes all slots in one pass into a
(shard_size, group_numel) buffer in param_dtype, which the usual copy-out splits into the parameters (one
group-sized buffer more while it lives). Groups with all-gather hooks, integer parameters or several dtypes
are refused: they have no single slot to encode. Worked example, block 4, one rank's
shard [0.5, -1.0, 0.25, 0.0]: absmax 1.0, s = 1/127, q = [64, -127, 32, 0], decoded [0.504, -1.0, 0.252,
0.0]: the error is at most s / 2 per element (int8), and it never reaches the weights, which stay exact.

``reduce_scatter="all_to_all"``: the rank-major gradient buffer (shard_size, group_numel) goes out by
all-to-all, row j to rank j, and each rank sums the rows it receives, in reduce_dtype:

    rank0 rows [1 2 | 3 4], rank1 rows [5 6 | 7 8] -> all-to-all -> rank0 holds [1 2], [5 6] -> sum [6 8]
                                                                   rank1 holds [3 4], [7 8] -> sum [10 12]

(N-1)/N of the buffer leaves each rank, where gloo's all-reduce sends 2(N-1)/N. ``"int8"`` encodes each row
as above (its codes, then its scales, as one byte row) before the all-to-all and sums the decoded rows in
fp32: a further ~4x fewer bytes than fp32.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from .comm import Comm
from .fused_quantize import run_fused

if TYPE_CHECKING:
    from .param import FSDPParam

_MAX = {"int8": 127.0, "fp8": 448.0}


def _code_dtype(kind: str) -> torch.dtype:
    return torch.int8 if kind == "int8" else torch.float8_e4m3fn


def encoded_sizes(numel: int, block: int) -> tuple[int, int]:
    """(code elements, scale elements) of ``numel`` values: padded to whole blocks, one scale each."""
    blocks = math.ceil(numel / block) if numel else 0
    return blocks * block, blocks


def encode(values: torch.Tensor, block: int, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``values`` as (codes, fp32 scales), block by block along the last dim (a 1-D tensor: the whole of
    it): codes (..., blocks * block), scales (..., blocks). Few passes over the data: the absmax from one
    ``aminmax``, the division into a new tensor, then rounding and clamping in place."""
    lead = tuple(values.shape[:-1])
    flat = values.float().reshape(*lead, -1)
    padded, blocks = encoded_sizes(flat.shape[-1], block)
    if padded != flat.shape[-1]:  # a block-aligned staging buffer needs no padding copy
        flat = torch.nn.functional.pad(flat, (0, padded - flat.shape[-1]))
    rows = flat.view(*lead, blocks, block)
    low, high = torch.aminmax(rows, dim=-1)
    scales = torch.maximum(high, low.neg_()).clamp_min_(torch.finfo(torch.float32).tiny).div_(_MAX[kind])
    scaled = torch.div(rows, scales[..., None])
    codes = scaled.round_().clamp_(-127, 127).to(torch.int8) if kind == "int8" else scaled.to(torch.float8_e4m3fn)
    return codes.view(*lead, padded), scales


def decode(codes: torch.Tensor, scales: torch.Tensor, block: int, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of ``encode`` for ``codes`` (..., blocks * block) and ``scales`` (..., blocks): values in
    ``dtype``, padding included (int8 codes multiply their scales directly, without a float copy)."""
    lead, blocks = codes.shape[:-1], scales.shape[-1]
    grid = codes.reshape(*lead, blocks, block)
    rows = torch.mul(grid if grid.dtype == torch.int8 else grid.float(), scales[..., None])
    return rows.reshape(*lead, blocks * block).to(dtype)


def exchange_rows(rank_major: torch.Tensor, mode: str, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The all-to-all reduce-scatter's send: row j of ``rank_major`` (shard_size, group_numel) for rank j,
    as is (``all_to_all``) or encoded (``int8``: its codes then its scales, one byte row). Returns (what
    to send, the (shard_size, row) buffer to receive into); the form runs the all-to-all."""
    send = rank_major
    if mode == "int8":
        codes, scales = run_fused("encode", encode, rank_major, block, "int8")  # per destination row: its blocks
        send = torch.cat([codes.view(torch.uint8), scales.view(torch.uint8)], dim=1)
    return send, torch.empty_like(send)


def sum_received(received: torch.Tensor, mode: str, group_numel: int, block: int, dtype: torch.dtype) -> torch.Tensor:
    """This rank's reduced slot (group_numel,) in ``dtype``: the rows it received, decoded and summed
    (``all_to_all``: in ``dtype``; ``int8``: in fp32, then cast)."""
    if mode == "all_to_all":
        return received.sum(dim=0)
    code_bytes, blocks = encoded_sizes(group_numel, block)
    codes = received[:, :code_bytes].contiguous().view(torch.int8)
    scales = received[:, code_bytes:].contiguous().view(torch.float32)
    rows = run_fused("decode", decode, codes, scales.view(-1, blocks), block=block, dtype=torch.float32)
    return rows[:, :group_numel].sum(dim=0).to(dtype)


# ---- the quantized all-gather of a group -----------------------------------------------------
def block_segments(params: tuple[FSDPParam, ...], block: int) -> list[int]:
    """Per parameter, its padded shard's elements rounded up to whole blocks: blocks never span two
    parameters (whose magnitudes may differ by orders), and the staging buffer is one run of them."""
    return [-(-p.padded_numel // block) * block for p in params]


def encode_group(
    params: tuple[FSDPParam, ...], staging: torch.Tensor, comm: Comm, kind: str, block: int
) -> list[torch.Tensor]:
    """This rank's slot of the group's quantized all-gather ([Note: quantized collectives]), as bytes: the
    flat shards copied into their block-aligned segments of ``staging`` (one foreach copy; the padding
    stays zero) and encoded in one pass, on the copy-in stream. Returns [codes, scales]; the caller
    all-gathers them as one uint8 slot (``gather.issue_all_gather``)."""
    with comm.on("all_gather_copy_in"):
        segments = torch.split(staging, block_segments(params, block))
        targets = [segment[: p.padded_numel] for segment, p in zip(segments, params)]
        torch._foreach_copy_(targets, [p.flat_shard for p in params], non_blocking=True)
        codes, scales = run_fused("encode", encode, staging, block, kind)  # [Note: fused quantize kernels]
    return [codes.view(torch.uint8), scales.view(torch.uint8)]


def copy_out_quantized(
    output: torch.Tensor, params: tuple[FSDPParam, ...], group_size: int, code_bytes: int, *, kind: str, block: int
) -> None:
    """Every rank's slot decoded in one pass into (group_size, staging numel) in param_dtype, then one
    ``split_with_sizes_copy`` into the parameters (each segment's block padding into a scratch buffer)."""
    slots = output.view(group_size, -1)
    codes = slots[:, :code_bytes].view(torch.int8 if kind == "int8" else torch.float8_e4m3fn)
    scales = slots[:, code_bytes:].view(torch.float32)
    decoded = run_fused("decode", decode, codes, scales, block=block, dtype=params[0].param_dtype)  # (ranks, segments)
    pads = [segment - p.padded_numel for segment, p in zip(block_segments(params, block), params)]
    scratch = torch.empty(group_size, sum(pads), dtype=decoded.dtype, device=decoded.device)
    scratch_views = torch.split(scratch, pads, dim=1)
    outputs, sizes = [], []
    for param, pad, waste in zip(params, pads, scratch_views):
        outputs.append(param.unsharded.copy_out_view(group_size, param.padded_numel))
        sizes.append(param.padded_numel)
        if pad:
            outputs.append(waste)
            sizes.append(pad)
    torch.split_with_sizes_copy(decoded, sizes, dim=1, out=outputs)
