"""QLoRA's frozen base: the Linear weights under LoRA adapters become NF4 (4-bit NormalFloat codes in blocks
of 64 values, the blocks' absmax scales themselves quantized to int8 in blocks of 256 around their mean:
torchao's ``to_nf4``, at its defaults), held by rows as ``NF4Rows``.

[Note: NF4 from a rank's own rows]
fsdp2lite shards an NF4 weight by rows (``NF4Rows``: [Note: NF4 padded by rows]) and gathers the shards
through its all-gather hooks into an ``NF4Weight``, which its matmuls dequantize piece by piece
([Note: NF4 dequantized in pieces]).
Everything in a rank's rows is computed from those rows, except the mean of all the tensor's block scales,
which ``to_nf4`` subtracts before the second quantization, and the factors of the blocks of 256 scales,
which may straddle two ranks. ``row_parts`` therefore all-gathers the block scales (one value per 64
weights, 1/64 of the rows' size; each rank's share padded to ``ceil(rows / world)`` rows so the collective
is equal-sized), takes their mean and the factors exactly as ``to_nf4`` does, and quantizes only its own
rows: the bytes equal ``to_nf4`` of the whole tensor's rows of this rank, at any world size, provided a
row holds whole blocks of 64 values (``shard_problem`` checks).

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
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from .._runtime.collective import all_gather_flat
from .._runtime.layout import ShardLayout
from .._summary import summarized
from .deps import require_libraries
from .nf4_rows import BLOCK_SIZE, SCALER_BLOCK_SIZE, NF4Rows, WholeNF4, nf4_tensor, rows_of

UNIT = BLOCK_SIZE * SCALER_BLOCK_SIZE  # values per scale factor: to_nf4 quantizes whole units only


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
    checked first (all or nothing, ``shard_problem``). A weight whose rows hold whole blocks of 64 values becomes
    an ``NF4Rows`` of ``to_nf4``'s bytes, which shards at any degree ([Note: NF4 padded by rows]) and gathers
    into an ``NF4Weight`` that fsdp2lite dequantizes without weight-sized temporaries ([Note: NF4 dequantized
    in pieces]); any other stays torchao's ``NF4Tensor`` (sharded only where its own chunks hold whole units).
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
        if layer.weight.shape[1] % BLOCK_SIZE == 0:  # rows of whole blocks: held by rows (else torchao shards it)
            quantized = rows_of(quantized)
        if quantized.is_meta:
            quantized = materialized_constants(quantized, torch.device(device or "cpu"))
        layer.weight = nn.Parameter(quantized, requires_grad=False)
    return [path for path, _ in layers]


def materialized_constants(quantized: Any, device: torch.device) -> Any:
    """A meta NF4 weight (``NF4Tensor`` or ``NF4Rows``) whose scale mean (and for ``NF4Rows`` its whole
    factors) and code table are real tensors on ``device`` ([Note: NF4 on meta]): zeros until
    ``load_nf4_rows`` writes them, the table torchao's own."""
    table = _code_table(quantized.dtype, device)
    if isinstance(quantized, NF4Rows):
        whole = quantized.whole
        factor = torch.zeros(whole.quantization_factor.shape, dtype=whole.quantization_factor.dtype, device=device)
        mean = torch.zeros((), dtype=whole.scaler_mean.dtype, device=device)
        return NF4Rows(quantized.codes, quantized.scalers, WholeNF4(whole.shape, whole.dtype, factor, mean, table))
    nf4 = _nf4_module()
    mean = torch.zeros(quantized.scaler_mean.shape, dtype=quantized.scaler_mean.dtype, device=device)
    return nf4.NF4Tensor(*nf4.construct_nf4_args(quantized, {"scaler_mean": mean, "nf4": table}))


def _code_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torchao's 16 NF4 code values in ``dtype`` on ``device``."""
    return _nf4_module().to_nf4(torch.zeros(UNIT, dtype=dtype)).nf4.to(device)


def shard_problem(path: str, shape: torch.Size | tuple[int, ...], shard_size: int) -> str | None:
    """Why a weight of ``shape`` cannot be NF4 sharded by rows over ``shard_size`` ranks, or None. ``to_nf4``
    needs a 2D weight of whole 64 * 256-value units; sharded, either torchao's own chunks hold whole units
    (``torchao_shards``) or each row holds whole blocks of 64 values (``NF4Rows``, any degree)."""
    numel = int(torch.Size(shape).numel())
    if len(shape) != 2 or numel == 0 or numel % UNIT:
        return (
            f"{path} {tuple(shape)}: NF4 quantizes a 2D weight of a multiple of {BLOCK_SIZE} * {SCALER_BLOCK_SIZE} "
            f"= {UNIT} values ({numel} here), at any shard degree"
        )
    if shard_size > 1 and shape[1] % BLOCK_SIZE and not torchao_shards(shape, shard_size):
        return (
            f"{path} {tuple(shape)}: sharded over {shard_size} ranks by rows, each row must hold whole blocks of "
            f"{BLOCK_SIZE} values ({shape[1]} columns) or the rows split evenly into multiples of {UNIT} values"
        )
    return None


def torchao_shards(shape: torch.Size | tuple[int, ...], shard_size: int) -> bool:
    """Whether torchao's ``NF4Tensor`` shards itself over ``shard_size`` ranks: its rows divide evenly
    and each chunk holds whole 64 * 256-value units ([Note: NF4 padded by rows])."""
    numel = int(torch.Size(shape).numel())
    return len(shape) == 2 and shape[0] % shard_size == 0 and (numel // shard_size) % UNIT == 0


class RowParts(NamedTuple):
    """One rank's rows of a weight's NF4 bytes, and what the whole weight shares."""

    codes: torch.Tensor  # (local_rows, columns // 2) uint8
    scalers: torch.Tensor  # (local_rows, columns // 64) int8
    quantization_factor: torch.Tensor  # (numel // (64 * 256),) the whole weight's
    scaler_mean: torch.Tensor  # () the whole weight's


@torch.no_grad()
def row_parts(rows: torch.Tensor, total_rows: int, group: dist.ProcessGroup | None = None) -> RowParts:
    """This rank's NF4 bytes of a 2D weight of ``total_rows`` rows split ``torch.chunk`` style over
    ``group``, from ``rows`` (its own rows, in the compute dtype) only: byte for byte ``to_nf4`` of the whole
    weight's ([Note: NF4 from a rank's own rows]). Collective: one all-gather of the padded block scales."""
    nf4 = _nf4_module()
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    rows = rows.contiguous()
    per_row = rows.shape[1] // BLOCK_SIZE  # block scales in a row
    layout = ShardLayout((total_rows, per_row), 0, world, rank)  # the scales' rows: [Note: padded shard]
    local_scales = rows.view(-1, BLOCK_SIZE).abs().amax(dim=1)  # (local_rows * per_row,)
    padded_scales = local_scales.new_zeros(layout.padded_numel)  # every rank's share the same size
    padded_scales[: local_scales.numel()] = local_scales
    gathered = padded_scales.new_empty(world * padded_scales.numel())
    all_gather_flat(gathered, padded_scales, group=group)  # (world * padded_numel,) rank-major
    all_scales = gathered[: total_rows * per_row].clone()  # (blocks,) in row order: to_nf4's block scales
    mean = all_scales.mean()  # what to_nf4 of the whole tensor subtracts
    centered = (all_scales - mean).view(-1, SCALER_BLOCK_SIZE)  # (scaler_blocks, 256)
    factor = 256 / (2 * centered.abs().amax(dim=1))  # (scaler_blocks,)
    quantized = (centered * factor.unsqueeze(1)).round().clamp(-128, 127).flatten().to(torch.int8)
    start = layout.start * per_row
    scalers = quantized[start : start + local_scales.numel()].view(rows.shape[0], per_row)
    codes = rows.new_empty((0, rows.shape[1] // 2), dtype=torch.uint8)
    if rows.numel():  # each block scaled by its own absmax: a rank's rows alone give their codes
        table = _code_table(rows.dtype, rows.device)
        flat = nf4.NF4Tensor.convert_to_norm_float_weight(rows, local_scales.numel(), BLOCK_SIZE, table)
        codes = flat.view(rows.shape[0], -1)
    return RowParts(codes, scalers.clone(), factor.contiguous(), mean)


@torch.no_grad()
def quantize_rows(rows: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """This rank's NF4 shard of a 2D weight split evenly by rows over ``group``, from ``rows`` (its own
    rows, in the compute dtype) only: byte for byte ``to_nf4(full).chunk(world)[rank]``, torchao's own
    shard, where ``torchao_shards`` holds (checked). Collective: one all-gather of the block scales."""
    world = dist.get_world_size(group)
    shape = (rows.shape[0] * world, *rows.shape[1:])
    if not torchao_shards(shape, world):
        raise ValueError(
            f"quantize_rows: rows {tuple(shape)}: each of {world} row shards must hold a multiple of {UNIT} values "
            "(torchao's own shards); row_parts quantizes any rows of a weight"
        )
    parts = row_parts(rows, shape[0], group)
    units = rows.numel() // UNIT
    factor = parts.quantization_factor[dist.get_rank(group) * units :][:units]  # this chunk's factors
    whole = WholeNF4(rows.shape, rows.dtype, factor.clone(), parts.scaler_mean, _code_table(rows.dtype, rows.device))
    return nf4_tensor(parts.codes.reshape(-1), parts.scalers.reshape(-1), whole)


_QUANTIZED_PARTS = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean")


def load_nf4_rows(model: nn.Module) -> Callable[[str, torch.Tensor], torch.Tensor | None]:
    """A ``transform`` for ``fl.load_sharded_weights`` that quantizes each rank's own rows of every NF4
    weight of ``model`` (sharded, after ``to_empty``) over the weight's shard group and writes them into its
    local NF4 shard (``NF4Tensor`` or ``NF4Rows``: [Note: NF4 on meta]); every other tensor is returned as
    read (copied and cast by the loader). Collective per NF4 weight, like the loader calls it."""
    nf4 = _nf4_module()
    targets: dict[str, tuple[Any, dist.ProcessGroup | None, int]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if isinstance(local, nf4.NF4Tensor | NF4Rows):
            targets[name] = (local, row_group(name, tensor), tensor.shape[0])

    @torch.no_grad()
    def transform(name: str, rows: torch.Tensor) -> torch.Tensor | None:
        if name not in targets:
            return rows
        local, group, total_rows = targets[name]
        rows = rows.to(device=local.device, dtype=local.dtype)
        if isinstance(local, NF4Rows):
            _write_rows(local, rows, total_rows, group)
            return None
        quantized = nf4.to_nf4(rows, BLOCK_SIZE, SCALER_BLOCK_SIZE) if group is None else quantize_rows(rows, group)
        for part in _QUANTIZED_PARTS:
            getattr(local, part).copy_(getattr(quantized, part))
        return None

    return transform


def _write_rows(local: NF4Rows, rows: torch.Tensor, total_rows: int, group: dist.ProcessGroup | None) -> None:
    """``rows`` quantized into ``local``'s codes and scales, and the whole weight's factors and mean into
    the constants every piece of it shares ([Note: NF4 padded by rows])."""
    if group is None:
        quantized = rows_of(_nf4_module().to_nf4(rows, BLOCK_SIZE, SCALER_BLOCK_SIZE))
        whole = quantized.whole
        parts = RowParts(quantized.codes, quantized.scalers, whole.quantization_factor, whole.scaler_mean)
    else:
        parts = row_parts(rows, total_rows, group)
    local.codes.copy_(parts.codes)
    local.scalers.copy_(parts.scalers)
    local.whole.quantization_factor.copy_(parts.quantization_factor)
    local.whole.scaler_mean.copy_(parts.scaler_mean)


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
