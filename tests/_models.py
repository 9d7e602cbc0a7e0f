"""Tiny models with the shapes that break sharding code: uneven rows, fewer rows than ranks, ties."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from fsdp2lite.models import GPT, GPTConfig


class UnevenBlock(nn.Module):
    """Rows 37, 61 and 16: uneven for every world size in 2..4."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.up = nn.Linear(d, 37)
        self.mid = nn.Linear(37, 61)
        self.down = nn.Linear(61, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.mid(torch.relu(self.up(x)))))


class UnevenMLP(nn.Module):
    """Blocks, then a root with a 2-row head and a 1-row scale (fewer rows than ranks)."""

    def __init__(self, n_blocks: int = 2, d: int = 16, checkpoint_blocks: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(UnevenBlock(d) for _ in range(n_blocks))
        self.scale = nn.Parameter(torch.ones(1, d))
        self.head = nn.Linear(d, 2)
        self.checkpoint_blocks = checkpoint_blocks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=False) if self.checkpoint_blocks else block(h)
        return self.head(h * self.scale)

    def reset_all(self) -> None:
        for module in self.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
        with torch.no_grad():
            self.scale.fill_(1.0)


def mlp_batch(step: int, rank: int, d: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, d, generator=g), torch.randn(4, 2, generator=g)


def mlp_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return (model(x) - y).pow(2).mean()


TINY_GPT = GPTConfig(vocab_size=61, seq_len=8, d_model=16, n_heads=2, n_layers=2, tie_embeddings=True)


def tiny_gpt() -> GPT:
    return GPT(TINY_GPT)


def gpt_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, TINY_GPT.vocab_size, (2, TINY_GPT.seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def gpt_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    tokens, targets = batch
    logits = model(tokens)
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def tiny_llama(
    *, layers: int = 2, tied: bool = False, hidden: int = 32, intermediate: int = 64, vocab: int = 96
) -> nn.Module:
    """A Hugging Face Llama small enough for gloo tests (built where torch's default device says)."""
    import transformers  # in fsdp2lite[dev]; imported here so the other models do not need it

    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    return transformers.AutoModelForCausalLM.from_config(config)


def example_train() -> Any:
    """examples/train.py as a module (a script, not part of the package), for tests of its functions."""
    examples = str(Path(__file__).resolve().parents[1] / "examples")
    sys.path.insert(0, examples)
    try:
        import train
    finally:
        sys.path.remove(examples)
    return train
