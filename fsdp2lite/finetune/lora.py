"""peft's LoRA adapters on a model: the settings (checked by name), the targets (checked against the
model's Linear layers before anything changes), the base frozen."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..weights import local_region, local_tensor
from .deps import require_libraries

# the attention and MLP projections of Llama-style decoders (Llama, Mistral, Qwen2/3, Gemma, Phi-3 split)
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MAX_RANK = 4096  # beyond any model's hidden size: a typo, not a choice
ADAPTER_LR = 2e-4  # the learning rate LoRA and QLoRA recipes train adapters at (examples/train.py's default)


@dataclass(frozen=True)
class LoraSettings:
    """LoRA's knobs, as peft's LoraConfig takes them; refused by name when out of range."""

    rank: int = 16  # r: the adapters' inner dimension
    alpha: float = 32.0  # lora_alpha: the update is scaled by alpha / rank
    dropout: float = 0.0  # lora_dropout on the adapter's input
    targets: tuple[str, ...] = DEFAULT_TARGETS  # module names (the last part of a path) that get adapters

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 1 <= self.rank <= MAX_RANK:
            raise ValueError(f"lora rank {self.rank!r}: expected an integer from 1 to {MAX_RANK}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
            raise ValueError(f"lora alpha {self.alpha!r}: expected a number greater than 0")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ValueError(f"lora dropout {self.dropout!r}: expected a number in [0, 1)")
        if not self.targets or not all(isinstance(t, str) and t for t in self.targets):
            raise ValueError(f"lora targets {self.targets!r}: expected one or more module names, e.g. q_proj,v_proj")


def linear_names(model: nn.Module) -> list[str]:
    """The distinct last path parts of the model's Linear layers (what ``targets`` may name)."""
    return sorted({path.rsplit(".", 1)[-1] for path, m in model.named_modules() if isinstance(m, nn.Linear) and path})


def targets_problem(model: nn.Module, targets: tuple[str, ...]) -> str | None:
    """Why ``targets`` cannot all get adapters on ``model`` (a target naming no Linear layer), or None."""
    existing = linear_names(model)
    unmatched = [t for t in targets if t not in existing]
    if not unmatched:
        return None
    return (
        f"lora targets {', '.join(unmatched)} match no Linear layer of {type(model).__name__}; "
        f"its Linear layers are named: {', '.join(existing) or '(none: nothing to adapt)'}"
    )


def apply_lora(model: nn.Module, settings: LoraSettings) -> nn.Module:
    """Wrap ``model`` in peft's ``PeftModel`` with LoRA adapters on ``settings.targets``; every base
    parameter frozen, the adapters trainable (fp32 when the base is bf16: peft's adapter autocast).
    Every target must name at least one Linear layer; otherwise ValueError listing the ones the model
    has, raised before the model is touched."""
    peft = require_libraries("lora")["peft"]
    problem = targets_problem(model, settings.targets)
    if problem is not None:
        raise ValueError(problem)
    config = peft.LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=list(settings.targets),
        bias="none",
    )
    return peft.get_peft_model(model, config)


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters the optimizer gets (the adapters, after ``apply_lora``)."""
    return [p for p in model.parameters() if p.requires_grad]


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int) -> list[str]:
    """Initialize every LoRA adapter of ``model`` as peft does (``lora_A`` Kaiming-uniform with
    a=sqrt(5), ``lora_B`` zeros: the update starts at zero), from a generator seeded with ``seed``, in
    parameter order; returns their names. Sharded or not, on meta-built models too: each rank draws the
    whole tensor on the host and keeps its own region, so every rank holds the same adapters and a
    sharded model gets the values the unsharded one would."""
    generator = torch.Generator().manual_seed(seed)
    names = []
    for name, param in model.named_parameters():
        if ".lora_A." not in name and ".lora_B." not in name:
            continue
        full = torch.zeros(param.shape, dtype=param.dtype)  # lora_B: zeros
        if ".lora_A." in name:
            nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=generator)
        local_tensor(param).copy_(full[local_region(name, param)])
        names.append(name)
    return names
