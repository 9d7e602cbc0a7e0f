"""QLoRA's frozen base: the Linear weights under LoRA adapters become torchao ``NF4Tensor``s (4-bit
NormalFloat codes in blocks of 64 values, the blocks' absmax scales themselves quantized to int8 in
blocks of 256 around their mean: torchao's ``to_nf4`` defaults).

[Note: NF4 from a rank's own rows]
torchao's NF4 shards by rows (``torch.chunk`` on its inner tensors), and fsdp2lite gathers the shards
through its all-gather hooks. Everything in a shard is computed from its own rows, except one number:
the mean of all the tensor's block scales, which ``to_nf4`` subtracts before the second quantization
and which every shard carries. ``quantize_rows`` therefore all-gathers the block scales (one value per
64 weights, 1/64 of the rows' size), takes their mean exactly as ``to_nf4`` does, and quantizes only
its own rows: the bytes equal ``to_nf4`` of the whole tensor chunked by rows, provided each rank's rows
hold whole scale blocks (rows * columns a multiple of 64 * 256 values), which is checked.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .deps import require_libraries

BLOCK_SIZE = 64  # values per NF4 block (one absmax scale each)
SCALER_BLOCK_SIZE = 256  # scales per block of the second (int8) quantization


def _nf4_module() -> Any:
    require_libraries("qlora")
    from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor

    return nf4_tensor


def _lora_base_layers(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """(path, base Linear) of every layer peft put adapters on."""
    return [
        (f"{path}.base_layer", m.base_layer)
        for path, m in model.named_modules()
        if isinstance(getattr(m, "base_layer", None), nn.Linear) and hasattr(m, "lora_A")
    ]


def quantize_base(model: nn.Module, shard_size: int = 1, dtype: torch.dtype = torch.bfloat16) -> list[str]:
    """Replace the base weight of every LoRA layer of ``model`` (after ``apply_lora``) by its NF4
    quantization (of the weight cast to ``dtype``, the compute dtype); returns their paths. Every weight is
    checked first (all or nothing): it must split into ``shard_size`` row shards of whole scale blocks."""
    nf4 = _nf4_module()
    layers = _lora_base_layers(model)
    if not layers:
        raise ValueError("quantize_base: the model has no LoRA layers; call apply_lora first")
    problems = [problem for path, layer in layers if (problem := shard_problem(path, layer.weight.shape, shard_size))]
    if problems:
        raise ValueError("cannot quantize to NF4:\n  " + "\n  ".join(problems))
    for _, layer in layers:
        quantized = nf4.to_nf4(layer.weight.detach().to(dtype), BLOCK_SIZE, SCALER_BLOCK_SIZE)
        layer.weight = nn.Parameter(quantized, requires_grad=False)
    return [path for path, _ in layers]


def shard_problem(path: str, shape: torch.Size | tuple[int, ...], shard_size: int) -> str | None:
    """Why a weight of ``shape`` cannot be NF4 in ``shard_size`` row shards, or None."""
    rows, numel = shape[0], int(torch.Size(shape).numel())
    unit = BLOCK_SIZE * SCALER_BLOCK_SIZE
    if len(shape) != 2 or rows % shard_size or (numel // shard_size) % unit:
        return (
            f"{path} {tuple(shape)}: each of {shard_size} row shards must hold a multiple of "
            f"{BLOCK_SIZE} * {SCALER_BLOCK_SIZE} = {unit} values (rows divisible by {shard_size})"
        )
    return None


@torch.no_grad()
def quantize_rows(rows: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """This rank's NF4 shard of a 2D weight split evenly by rows over ``group``, from ``rows`` (its own
    rows, in the compute dtype) only: byte for byte ``to_nf4(full).chunk(world)[rank]``
    ([Note: NF4 from a rank's own rows]). Collective: one all-gather of the block scales."""
    nf4 = _nf4_module()
    world = dist.get_world_size(group)
    problem = shard_problem("rows", (rows.shape[0] * world, *rows.shape[1:]), world)
    if problem is not None:
        raise ValueError(f"quantize_rows: {problem}")
    local = nf4.to_nf4(rows.contiguous(), BLOCK_SIZE, SCALER_BLOCK_SIZE)  # codes: per block, so already right
    local_scales = rows.flatten().view(-1, BLOCK_SIZE).abs().amax(dim=1)  # (local_blocks,)
    all_scales = torch.empty(world * local_scales.numel(), dtype=local_scales.dtype, device=local_scales.device)
    dist.all_gather_into_tensor(all_scales, local_scales, group=group)  # (blocks,) rank-major = row order
    mean = all_scales.mean()  # what to_nf4 of the whole tensor subtracts
    centered = (local_scales - mean).view(-1, SCALER_BLOCK_SIZE)  # (local_scaler_blocks, 256)
    factor = 256 / (2 * centered.abs().amax(dim=1))  # (local_scaler_blocks,)
    codes = (centered * factor.unsqueeze(1)).round().clamp(-128, 127).flatten().to(torch.int8)
    updates = {"quantized_scalers": codes, "quantization_factor": factor.contiguous(), "scaler_mean": mean}
    return nf4.NF4Tensor(*nf4.construct_nf4_args(local, updates))
