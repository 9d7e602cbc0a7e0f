"""Fine-tuning in the planner: a frozen base with LoRA adapters (``lora``), the same with the adapted
Linear weights in NF4 (``qlora``), or every parameter trained (``full``).

The estimate methods plan the model ``examples/train.py --finetune`` trains (fsdp2lite.finetune): the base
in bf16 and frozen (no gradients, no optimizer state), peft's adapters on the ``targets`` Linear layers
(``lora_A`` of shape (rank, in) and ``lora_B`` of shape (out, rank), fp32 masters with AdamW state and
gradients), and for qlora each adapted base weight in torchao's NF4.

[Note: planned adapters]
The planner does not import peft or torchao (a plan is made on a laptop before anything is installed):
``plan_model`` puts a small module of peft's shapes and forward (``base(x) + lora_B(lora_A(x)) * scale``)
in place of each targeted Linear. ``tests/test_estimate_finetune.py`` checks its parameter count against
peft's ``get_peft_model``. An NF4 weight is planned as its bf16 tensor (the shapes the runtime computes
with: torchao dequantizes it for every matmul) whose stored bytes are ``NF4_BITS`` per weight:
``nf4_bytes`` converts, and the methods count the rest of each term by the plan.

NF4's size per weight (torchao ``to_nf4`` defaults, what fsdp2lite.finetune.quantize_base uses): a 4-bit
code, an int8 scale per block of 64 weights and an fp32 factor per 256 scales:
``4 + 8 / 64 + 32 / (64 * 256) = 4.127`` bits.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from ..finetune.lora import DEFAULT_TARGETS, MAX_RANK, targets_problem

FINETUNES = ("full", "lora", "qlora")
NF4_BITS = 4 + 8 / 64 + 32 / (64 * 256)  # 4.127: codes, int8 block scales, fp32 factors of the scales


@dataclass(frozen=True)
class Finetune:
    """What is trained: ``kind`` full, lora or qlora; LoRA's ``rank`` and ``targets`` (module names)."""

    kind: str = "full"
    rank: int = 16
    targets: tuple[str, ...] = DEFAULT_TARGETS

    def __post_init__(self) -> None:
        if self.kind not in FINETUNES:
            raise ValueError(f"finetune {self.kind!r}: expected one of {', '.join(FINETUNES)}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 1 <= self.rank <= MAX_RANK:
            raise ValueError(f"lora rank {self.rank!r}: expected an integer from 1 to {MAX_RANK}")
        if not self.targets or not all(isinstance(t, str) and t for t in self.targets):
            raise ValueError(f"lora targets {self.targets!r}: expected one or more module names, e.g. q_proj,v_proj")

    @property
    def adapters(self) -> bool:
        return self.kind != "full"

    def label(self) -> str:
        return self.kind if self.kind == "full" else f"{self.kind} (rank {self.rank})"


def as_finetune(value: Finetune | str | None) -> Finetune:
    """``None`` (full), a kind's name or a ``Finetune``."""
    if value is None:
        return Finetune()
    if isinstance(value, str):
        return Finetune(value)
    if not isinstance(value, Finetune):
        raise TypeError(f"finetune must be 'full', 'lora', 'qlora' or a Finetune, got {type(value).__name__}")
    return value


class PlannedLora(nn.Module):
    """A targeted Linear as peft runs it ([Note: planned adapters]): the frozen base plus
    ``lora_B(lora_A(x)) * scale`` (the scale is a Python number: autograd saves nothing for it)."""

    def __init__(self, base: nn.Linear, rank: int) -> None:
        super().__init__()
        self.base_layer = base
        device = base.weight.device
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, device=device, dtype=torch.float32)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, device=device, dtype=torch.float32)
        self.scale = 2.0  # peft's alpha / rank at the defaults; any number plans the same

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B(self.lora_A(x)) * self.scale


def plan_model(model: nn.Module, finetune: Finetune) -> list[str]:
    """Make ``model`` the one ``finetune`` trains, in place: for lora/qlora the base cast to bf16 and
    frozen and a ``PlannedLora`` on every Linear whose name is in ``targets``; returns the paths of the
    adapted base weights (qlora stores those in NF4). Every target must name a Linear layer: otherwise
    ValueError listing the model's Linear layer names, raised before the model changes."""
    if not finetune.adapters:
        return []
    problem = targets_problem(model, finetune.targets)
    if problem is not None:
        raise ValueError(f"--finetune {finetune.kind}: {problem}")
    for module in model.modules():  # the base in bf16, frozen (by hand: fake tensors refuse Module.to's swap)
        for name, param in module._parameters.items():
            if param is not None:
                data = param.detach().to(torch.bfloat16) if param.is_floating_point() else param.detach()
                module._parameters[name] = nn.Parameter(data, requires_grad=False)
    adapted = []
    for path, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and path and path.rsplit(".", 1)[-1] in finetune.targets:
            parent_path, _, name = path.rpartition(".")
            parent = model.get_submodule(parent_path) if parent_path else model
            setattr(parent, name, PlannedLora(module, finetune.rank))
            adapted.append(f"{path}.base_layer.weight")
    return adapted


def planned_factory(model_fn: Callable[[], nn.Module], finetune: Finetune) -> Callable[[], nn.Module]:
    """``model_fn`` followed by ``plan_model``: what the estimate methods build."""
    if not finetune.adapters:
        return model_fn

    def build() -> nn.Module:
        model = model_fn()
        plan_model(model, finetune)
        return model

    build.__name__ = f"{getattr(model_fn, '__name__', 'model')}+{finetune.kind}"
    return build


def nf4_bytes(numel: int) -> int:
    """Bytes of ``numel`` weights in NF4 (``NF4_BITS`` each)."""
    return math.ceil(numel * NF4_BITS / 8)


def pinned_nbytes(nbytes: int) -> int:
    """What torch's pinned (caching host) allocator takes for a ``nbytes`` request: the next power of two
    (pytorch#150517; every offloaded shard and each group's host gradient buffer is one request)."""
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()


def planned_nf4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """(codes, int8 block scales, the shared constants) of an NF4 weight of ``weight``'s shape and compute dtype,
    made where the caller's mode makes tensors (fake, for the planner): what ``NF4Rows`` and ``NF4Weight`` hold.
    A shape ``to_nf4`` would refuse gets its last unit of scales padded (the planner still counts it)."""
    from ..finetune.nf4_whole import BLOCK_SIZE, SCALER_BLOCK_SIZE, WholeNF4

    rows, columns = weight.shape
    codes = torch.zeros((rows, columns // 2), dtype=torch.uint8)
    scalers = torch.zeros((rows, columns // BLOCK_SIZE), dtype=torch.int8)
    factors = torch.ones(-(-rows * columns // (BLOCK_SIZE * SCALER_BLOCK_SIZE)), dtype=weight.dtype)
    mean = torch.zeros((), dtype=weight.dtype)
    return codes, scalers, WholeNF4(weight.shape, weight.dtype, factors, mean, torch.ones(16, dtype=weight.dtype))
