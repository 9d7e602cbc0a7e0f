"""Communication-only quantization: block-scaled int8 / fp8 encodings of what a collective sends.

[Note: quantized collectives]
``CommPolicy(all_gather="int8")``: before the all-gather each rank encodes its padded flat shard (the
parameter's own precision, e.g. the fp32 master) in blocks of ``block_size`` elements, one fp32 absmax scale
per block: ``q = round(x / s)``, ``s = absmax / 127`` (fp8: ``x / s`` in e4m3, ``s = absmax / 448``). The
group's one collective carries the codes and the scales as bytes ([Note: byte all-gather]); each rank
decodes every rank's slot into the unsharded parameter in param_dtype. Worked example, block 4, one rank's
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

import torch
import torch.distributed as dist

_MAX = {"int8": 127.0, "fp8": 448.0}


def _code_dtype(kind: str) -> torch.dtype:
    return torch.int8 if kind == "int8" else torch.float8_e4m3fn


def encoded_sizes(numel: int, block: int) -> tuple[int, int]:
    """(code elements, scale elements) of ``numel`` values: padded to whole blocks, one scale each."""
    blocks = math.ceil(numel / block) if numel else 0
    return blocks * block, blocks


def encode(values: torch.Tensor, block: int, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``values`` as (codes, fp32 scales), block by block along the last dim (a 1-D tensor: the whole of
    it): codes (..., blocks * block), scales (..., blocks)."""
    lead = tuple(values.shape[:-1])
    flat = values.float().reshape(*lead, -1)
    padded, blocks = encoded_sizes(flat.shape[-1], block)
    rows = torch.nn.functional.pad(flat, (0, padded - flat.shape[-1])).view(*lead, blocks, block)
    scales = rows.abs().amax(dim=-1).clamp_min(torch.finfo(torch.float32).tiny) / _MAX[kind]
    scaled = rows / scales[..., None]
    codes = scaled.round().clamp(-127, 127).to(torch.int8) if kind == "int8" else scaled.to(torch.float8_e4m3fn)
    return codes.view(*lead, padded), scales


def decode(codes: torch.Tensor, scales: torch.Tensor, block: int, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of ``encode`` for ``codes`` (..., blocks * block) and ``scales`` (..., blocks): values in
    ``dtype``, padding included."""
    blocks = scales.shape[-1]
    rows = codes.reshape(*codes.shape[:-1], blocks, block).float() * scales[..., None]
    return rows.reshape(*codes.shape[:-1], blocks * block).to(dtype)


class QuantizedGather:
    """One parameter's all-gather, quantized ([Note: quantized collectives]): its encoded inputs, the
    output buffers they are gathered into (kept across steps, freed at reshard), and the decode into the
    parameter's unsharded storage."""

    kind: str
    block: int
    numel: int  # elements of the padded shard
    outputs: list[torch.Tensor]  # (shard_size * code elements,) codes, (shard_size * blocks,) fp32 scales

    def __init__(self, kind: str, block: int, numel: int) -> None:
        self.kind, self.block, self.numel = kind, block, numel
        self.outputs = []

    def inputs(self, padded_flat_shard: torch.Tensor, group_size: int) -> list[torch.Tensor]:
        codes, scales = encode(padded_flat_shard, self.block, self.kind)
        code_numel, blocks = encoded_sizes(self.numel, self.block)
        if not self.outputs:
            device = padded_flat_shard.device if padded_flat_shard.device.type != "cpu" else codes.device
            self.outputs = [
                torch.empty(group_size * code_numel, dtype=codes.dtype, device=device),
                torch.empty(group_size * blocks, dtype=torch.float32, device=device),
            ]
        for output in self.outputs:
            if output.untyped_storage().size() < output.numel() * output.element_size():
                output.untyped_storage().resize_(output.numel() * output.element_size())
        return [codes, scales]

    def output_views(self, group_size: int) -> list[torch.Tensor]:
        return [output.view(torch.uint8).view(group_size, -1) for output in self.outputs]

    def decode_into(self, target: torch.Tensor, group_size: int) -> None:
        """Every rank's slot decoded into ``target`` (group_size, padded numel) in its dtype."""
        codes = self.outputs[0].view(group_size, -1)
        scales = self.outputs[1].view(group_size, -1)
        target.copy_(decode(codes, scales, self.block, target.dtype)[:, : self.numel])

    def free(self) -> None:
        for output in self.outputs:
            output.untyped_storage().resize_(0)


def exchange_rows(
    rank_major: torch.Tensor, mode: str, block: int, group: dist.ProcessGroup, async_op: bool
) -> tuple[torch.Tensor, torch.Tensor, dist.Work | None]:
    """The all-to-all reduce-scatter's send: row j of ``rank_major`` (shard_size, group_numel) to rank j,
    as is (``all_to_all``) or encoded (``int8``: its codes then its scales, one byte row). Returns (what
    was sent, the (shard_size, row) buffer being received into, the work)."""
    send = rank_major
    if mode == "int8":
        codes, scales = encode(rank_major, block, "int8")  # per destination row: its own blocks
        send = torch.cat([codes.view(torch.uint8), scales.view(torch.uint8)], dim=1)
    received = torch.empty_like(send)
    work = dist.all_to_all_single(received, send, group=group, async_op=async_op)
    return send, received, work


def sum_received(received: torch.Tensor, mode: str, group_numel: int, block: int, dtype: torch.dtype) -> torch.Tensor:
    """This rank's reduced slot (group_numel,) in ``dtype``: the rows it received, decoded and summed
    (``all_to_all``: in ``dtype``; ``int8``: in fp32, then cast)."""
    if mode == "all_to_all":
        return received.sum(dim=0)
    code_bytes, blocks = encoded_sizes(group_numel, block)
    codes = received[:, :code_bytes].contiguous().view(torch.int8)
    scales = received[:, code_bytes:].contiguous().view(torch.float32)
    return decode(codes, scales.view(-1, blocks), block, torch.float32)[:, :group_numel].sum(dim=0).to(dtype)
