"""bitsandbytes 4-bit weights sharded by fsdp2lite, through torch's all-gather extension hooks.

    from fsdp2lite.integrations import bitsandbytes as fl_bnb
    model = AutoModelForCausalLM.from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True))
    fl_bnb.make_4bit_shardable(model)       # every frozen Params4bit of a Linear4bit: a Bnb4bitWeight
    fl.fully_shard(...)                      # each rank now holds its rows of the 4-bit bytes

Accelerate's FSDP2 preparation (``fsdp2lite.integrations.accelerate.install()``, which ``python -m
fsdp2lite.run`` calls) does this itself before it shards, so the HF Trainer and TRL shard 4-bit bases in
either storage.

[Note: bitsandbytes 4-bit shards]
A bitsandbytes 4-bit weight is a ``Params4bit`` of shape ``(out * in / 2 / itemsize, 1)``: the packed
4-bit codes in the ``bnb_4bit_quant_storage`` dtype (uint8 by default), and a ``QuantState`` (absmax per
block of 64 values, the code table, the shape, the compute dtype) that dequantizes them. torch's
``fully_shard`` cannot shard the uint8 form, so Accelerate leaves it out of sharding (``ignored_params``)
and every rank holds the whole base: about 35 GB for a 70B. ``make_4bit_shardable`` puts each such
weight in a ``Bnb4bitWeight``, a tensor subclass holding the codes and the whole ``QuantState``. fsdp2lite
shards it by rows like any parameter (each rank keeps its rows of the codes, bytes as they are: half of
them on 2 ranks), and its all-gather hooks rebuild the weight bitsandbytes expects:

    fsdp_pre_all_gather   -> this rank's (padded) rows of codes, as they are: no cast, whatever param_dtype
    all-gather            -> the whole weight's codes, (world * padded_rows, 1)
    fsdp_post_all_gather  -> a ``Gathered4bit`` on those codes, carrying a copy of the whole QuantState

The quantization state is small (one absmax per 64 values: 1/8 of the codes' bytes in fp32, 1/32 with
double quantization) and stays whole on every rank: a rank's rows need not hold whole blocks, so any world
size shards any weight. The codes are never cast: the hooks ignore ``param_dtype``, so a bf16 or fp32
mixed-precision policy cannot reinterpret them (a 4-bit weight in bf16 storage sharded as a plain bf16
parameter would be cast under ``param_dtype=float32``).

[Note: bitsandbytes' CPU repacking]
On a CPU with AVX512-BF16, ``Linear4bit.forward`` in eval mode without grad rewrites its weight in place
into a layout only its CPU kernel reads: the codes reordered into a new ``.data`` and the ``QuantState``
itself changed (absmax transposed to bf16, ``packing_format_for_cpu`` set). On a sharded weight the next
all-gather brings back the original codes while a shared state stays rewritten, and every later forward is
wrong (torch's path included, with bf16 storage). So the whole state never leaves the ``Bnb4bitWeight``:
each gather gives the unsharded weight a fresh copy of it and its gathered codes back, and the
repacking is turned off for the layers made shardable (``support_avx512bf16_for_cpu = False``): it would
repack at every eval forward, and its repacked copy would outlive the reshard. Eval forwards dequantize as
training forwards do; GPUs never repack.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

aten = torch.ops.aten
# ops that make another piece of the same weight (sharding, padding, views, moves): results stay Bnb4bitWeights
_SAME_WEIGHT = {
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.new_zeros.default,
    aten.slice.Tensor,
    aten.view.default,
    aten.detach.default,
    aten.alias.default,
    aten._to_copy.default,
    aten.clone.default,
    aten.as_strided.default,
    aten.empty_like.default,
    aten._pin_memory.default,
}


@dataclass(frozen=True)
class Quantization:
    """What every piece of one 4-bit weight shares: the whole ``QuantState`` and the weight's shape."""

    quant_state: Any  # bitsandbytes' QuantState of the whole weight: never handed out, only copies of it
    shape: torch.Size  # the whole Params4bit's shape, (codes, 1)


class Bnb4bitWeight(torch.Tensor):
    """A bitsandbytes 4-bit weight (or a shard of its rows) that fsdp2lite shards through its all-gather
    hooks: ``codes`` (its rows of the packed 4-bit codes, in the quant storage dtype) and the whole
    weight's ``Quantization`` ([Note: bitsandbytes 4-bit shards])."""

    codes: torch.Tensor
    quantization: Quantization

    @staticmethod
    def __new__(cls, codes: torch.Tensor, quantization: Quantization) -> Bnb4bitWeight:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined,no-any-return]
            cls, codes.shape, strides=codes.stride(), dtype=codes.dtype, device=codes.device, requires_grad=False
        )

    def __init__(self, codes: torch.Tensor, quantization: Quantization) -> None:
        self.codes = codes
        self.quantization = quantization

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    def __repr__(self) -> str:  # type: ignore[override]
        return f"Bnb4bitWeight(shape={tuple(self.shape)}, dtype={self.dtype}, of {tuple(self.quantization.shape)})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        """Ops run on the codes; those that make another piece of the same weight give Bnb4bitWeights (of
        the first one's quantization), every other result is a plain tensor (a state dict's gather)."""
        weights = [a for a in args if isinstance(a, Bnb4bitWeight)]
        out = func(*tree_map(_codes_of, args), **tree_map(_codes_of, kwargs or {}))
        if func is aten.copy_.default:
            return args[0]
        if func in _SAME_WEIGHT:
            quantization = weights[0].quantization
            return tree_map(lambda t: cls(t, quantization) if isinstance(t, torch.Tensor) else t, out)
        return out

    def fsdp_pre_all_gather(
        self, mesh: Any, outer_size: Any, outer_stride: Any, module: Any, mp_policy: Any
    ) -> tuple[tuple[torch.Tensor, ...], None]:
        """This rank's (padded) rows of codes, as they are: never cast to ``param_dtype``."""
        return (self.codes,), None

    def fsdp_post_all_gather(
        self, outputs: tuple[torch.Tensor, ...], metadata: Any, param_dtype: torch.dtype, *, out: Any = None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        """The unsharded weight on the gathered codes ``(world * padded_rows, 1)``, with a fresh copy of the
        whole QuantState; refilled (``out``): its codes and state put back ([Note: bitsandbytes' CPU repacking])."""
        (codes,) = outputs
        state = copy.copy(
            self.quantization.quant_state
        )  # a forward may rewrite it: [Note: bitsandbytes' CPU repacking]
        if out is None:
            return Gathered4bit.of(codes, state), (codes,)
        if out.untyped_storage().data_ptr() != codes.untyped_storage().data_ptr():  # a forward replaced .data
            out.data = codes[: self.quantization.shape[0]]
        out.quant_state = state
        return None


def _codes_of(value: Any) -> Any:
    return value.codes if isinstance(value, Bnb4bitWeight) else value


# what makes the same weight again: the views fsdp2lite takes of the unsharded tensor, nn.Parameter's detach
_SAME_GATHERED = {torch.Tensor.detach, torch.as_strided, torch.Tensor.as_strided, torch.Tensor.view}


class Gathered4bit(torch.Tensor):
    """The unsharded 4-bit weight a ``Linear4bit`` computes with: the gathered codes, and the ``quant_state``
    its forward reads (``Params4bit``'s attribute). Its views and ``detach`` keep the state (``nn.Parameter``
    wraps it by ``detach``); every other op gives plain tensors, as ``Params4bit``'s do."""

    quant_state: Any

    @classmethod
    def of(cls, codes: torch.Tensor, quant_state: Any) -> Gathered4bit:
        gathered = codes.as_subclass(cls)
        gathered.quant_state = quant_state
        return gathered

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        if func in _SAME_GATHERED and isinstance(out, torch.Tensor) and out is not args[0]:
            return cls.of(out, args[0].quant_state)
        return out


def make_4bit_shardable(model: nn.Module) -> list[str]:
    """Put every frozen bitsandbytes 4-bit weight of ``model`` (a ``Params4bit`` held by a ``Linear4bit``,
    any quant storage) in a ``Bnb4bitWeight`` that fsdp2lite shards by rows, and turn off bitsandbytes'
    CPU repacking on those layers ([Note: bitsandbytes 4-bit shards], [Note: bitsandbytes' CPU repacking]);
    returns their paths. Every weight is checked first (all or nothing). Call it before ``fully_shard``."""
    from bitsandbytes.nn import Linear4bit, Params4bit

    layers = [(path, m) for path, m in model.named_modules() if isinstance(m, Linear4bit)]
    layers = [(path, m) for path, m in layers if isinstance(m.weight, Params4bit)]  # Bnb4bitWeights: done
    problems = [problem for path, m in layers if (problem := _weight_problem(f"{path}.weight", m.weight))]
    if problems:
        raise ValueError("cannot shard these bitsandbytes 4-bit weights:\n  " + "\n  ".join(problems))
    for _, layer in layers:
        weight: Any = layer.weight
        quantization = Quantization(weight.quant_state, weight.shape)
        layer.weight = nn.Parameter(Bnb4bitWeight(weight.data, quantization), requires_grad=False)
        layer.support_avx512bf16_for_cpu = False  # [Note: bitsandbytes' CPU repacking]
    return [f"{path}.weight" for path, _ in layers]


def _weight_problem(path: str, weight: Any) -> str | None:
    """Why a Params4bit cannot be made shardable, or None."""
    if weight.requires_grad:
        return f"{path} requires grad: 4-bit weights are a frozen base (train adapters on it, e.g. peft's LoRA)"
    if not weight.bnb_quantized or weight.quant_state is None:
        return f"{path} is not quantized yet: bitsandbytes quantizes when the layer is moved to its device"
    if getattr(weight.quant_state, "packing_format_for_cpu", False):
        return f"{path} is in bitsandbytes' CPU-only packed layout (an eval forward repacked it): load it again"
    if weight.dim() != 2 or weight.shape[1] != 1:
        return f"{path} has shape {tuple(weight.shape)}: expected bitsandbytes' packed (codes, 1)"
    return None
