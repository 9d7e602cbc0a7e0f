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

[Note: NF4 on meta]
A 70B base never exists whole on any rank: the model is built on the meta device, its targets become
NF4 there (``quantize_base``), fsdp2lite shards it, ``to_empty`` allocates each rank's shards, and
``load_sharded_weights`` with ``load_nf4_rows`` fills them from each rank's own rows of the checkpoint.
torchao's ``to_empty`` (``empty_like``) allocates only the chunked inner tensors (codes, int8 scales,
their factors) and keeps the scale mean and the 16-value code table by reference, so those two are made
real tensors on the target device while still on meta: each weight its own mean, shared by its shards.
The loader then writes ``quantize_rows``' inner tensors into the shard's own, in place: ``copy_`` from
one NF4 tensor into another is not used (torchao's copy needs every piece of metadata to match).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from .._runtime.comm import all_gather_flat
from .._summary import summarized
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


def quantize_base(
    model: nn.Module,
    shard_size: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
) -> list[str]:
    """Replace the base weight of every LoRA layer of ``model`` (after ``apply_lora``) by its NF4
    quantization (of the weight cast to ``dtype``, the compute dtype); returns their paths. Every weight is
    checked first (all or nothing): it must split into ``shard_size`` row shards of whole scale blocks.
    A model on the meta device gets NF4 weights on meta, ready for ``to_empty(device=device)`` and
    ``load_nf4_rows`` ([Note: NF4 on meta])."""
    nf4 = _nf4_module()
    layers = _lora_base_layers(model)
    if not layers:
        raise ValueError("quantize_base: the model has no LoRA layers; call apply_lora first")
    problems = [problem for path, layer in layers if (problem := shard_problem(path, layer.weight.shape, shard_size))]
    if problems:
        raise ValueError(f"cannot quantize to NF4 ({len(problems)} weights):\n  " + "\n  ".join(summarized(problems)))
    for _, layer in layers:
        quantized = nf4.to_nf4(layer.weight.detach().to(dtype), BLOCK_SIZE, SCALER_BLOCK_SIZE)
        if quantized.is_meta:
            quantized = materialized_constants(quantized, torch.device(device or "cpu"))
        layer.weight = nn.Parameter(quantized, requires_grad=False)
    return [path for path, _ in layers]


def materialized_constants(quantized: Any, device: torch.device) -> Any:
    """A meta NF4 weight whose scale mean and code table are real tensors on ``device``
    ([Note: NF4 on meta]): the mean zero until ``load_nf4_rows`` writes it, the table torchao's own."""
    nf4 = _nf4_module()
    table = nf4.to_nf4(torch.zeros(BLOCK_SIZE * SCALER_BLOCK_SIZE, dtype=quantized.dtype)).nf4.to(device)
    mean = torch.zeros(quantized.scaler_mean.shape, dtype=quantized.scaler_mean.dtype, device=device)
    return nf4.NF4Tensor(*nf4.construct_nf4_args(quantized, {"scaler_mean": mean, "nf4": table}))


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
    all_gather_flat(all_scales, local_scales, group=group)  # (blocks,) rank-major = row order
    mean = all_scales.mean()  # what to_nf4 of the whole tensor subtracts
    centered = (local_scales - mean).view(-1, SCALER_BLOCK_SIZE)  # (local_scaler_blocks, 256)
    factor = 256 / (2 * centered.abs().amax(dim=1))  # (local_scaler_blocks,)
    codes = (centered * factor.unsqueeze(1)).round().clamp(-128, 127).flatten().to(torch.int8)
    updates = {"quantized_scalers": codes, "quantization_factor": factor.contiguous(), "scaler_mean": mean}
    return nf4.NF4Tensor(*nf4.construct_nf4_args(local, updates))


_QUANTIZED_PARTS = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean")


def load_nf4_rows(model: nn.Module) -> Callable[[str, torch.Tensor], torch.Tensor | None]:
    """A ``transform`` for ``fl.load_sharded_weights`` that quantizes each rank's own rows of every NF4
    weight of ``model`` (sharded, after ``to_empty``) with ``quantize_rows`` over the weight's shard group
    and writes them into its local NF4 shard ([Note: NF4 on meta]); every other tensor is returned as read
    (copied and cast by the loader). Collective per NF4 weight, like the loader calls it."""
    nf4 = _nf4_module()
    targets: dict[str, tuple[Any, dist.ProcessGroup | None]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if isinstance(local, nf4.NF4Tensor):
            targets[name] = (local, row_group(name, tensor))

    @torch.no_grad()
    def transform(name: str, rows: torch.Tensor) -> torch.Tensor | None:
        if name not in targets:
            return rows
        local, group = targets[name]
        rows = rows.to(device=local.device, dtype=local.dtype)
        quantized = nf4.to_nf4(rows, BLOCK_SIZE, SCALER_BLOCK_SIZE) if group is None else quantize_rows(rows, group)
        for part in _QUANTIZED_PARTS:
            getattr(local, part).copy_(getattr(quantized, part))
        return None

    return transform


def row_group(name: str, tensor: torch.Tensor) -> dist.ProcessGroup | None:
    """The process group over which ``tensor``'s rows are split: its Shard(0) mesh axis (HSDP's replicas
    each quantize their own copy); None for an unsharded weight. Any other placement is refused."""
    if not isinstance(tensor, DTensor):
        return None
    axes = [axis for axis, p in enumerate(tensor.placements) if not p.is_replicate()]
    rows = [a for a in axes if type(tensor.placements[a]) is Shard and tensor.placements[a] == Shard(0)]
    if len(axes) != 1 or rows != axes:
        raise ValueError(f"{name}: NF4 weights load sharded by rows (Shard(0)), not {tensor.placements}")
    return tensor.device_mesh.get_group(axes[0])
