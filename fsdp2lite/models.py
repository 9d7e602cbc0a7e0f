"""A small GPT-like model: the demo's, the benchmarks' and the tests' workhorse.

Blocks are the natural fully_shard groups; the root keeps the embeddings, final norm and head
(the head is tied to the token embedding when ``tie_embeddings``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256  # byte-level by default
    seq_len: int = 64
    d_model: int = 128
    n_heads: int = 4
    n_layers: int = 4
    tie_embeddings: bool = True


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """x (batch, seq, d_model); mask (batch, 1, seq, seq) bool, True where a query may attend (None: causal)."""
        batch, seq, d_model = x.shape
        q, k, v = self.qkv(x).split(d_model, dim=-1)  # each (batch, seq, d_model)
        q, k, v = (t.view(batch, seq, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (batch, heads, seq, head_dim)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, d_model))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.norm2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model),
            nn.GELU(),
            nn.Linear(4 * cfg.d_model, cfg.d_model),
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), mask)
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        self.init_weights()

    def init_weights(self) -> None:
        """GPT-2 style: N(0, 0.02) linear and embedding weights, zero biases, unit LayerNorms.

        torch's default N(0, 1) embedding, tied to the head, makes the first logits huge (a byte-level
        loss near 80 instead of ln(256) = 5.5).
        """
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, nn.LayerNorm):
                module.reset_parameters()

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (batch, seq) int64 -> logits (batch, seq, vocab). ``position_ids`` (batch, seq), as Hugging Face
        models take them: packed sequences, each restarting at 0, attend only within themselves
        (``packed_sequence_mask``); None: one sequence, positions 0 .. seq - 1."""
        if position_ids is None:
            positions, mask = torch.arange(tokens.shape[1], device=tokens.device), None
        else:
            positions, mask = position_ids, packed_sequence_mask(position_ids)
        h = self.tok_emb(tokens) + self.pos_emb(positions)
        for block in self.blocks:
            h = block(h) if mask is None else block(h, mask)
        return self.head(self.norm(h))

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(tokens)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def packed_sequence_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """position_ids (batch, seq) -> (batch, 1, seq, seq) bool: causal, and only within a sequence. A position
    that does not follow the one before (not previous + 1) starts a sequence, as transformers'
    ``find_packed_sequence_indices`` reads them: [0 1 2 0 1] is two sequences, of 3 and 2 tokens."""
    starts = torch.diff(position_ids, dim=-1, prepend=position_ids[:, :1] - 1) != 1
    sequence = starts.cumsum(-1)  # (batch, seq): which packed sequence each token is in
    seq = position_ids.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=position_ids.device).tril()
    return ((sequence[:, :, None] == sequence[:, None, :]) & causal)[:, None]


def shard_gpt(model: GPT, mesh: object | None = None, **kwargs: object) -> GPT:
    """Shard the blocks one group each, then the root (embeddings, norm, head)."""
    from .api import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh, **kwargs)  # type: ignore[arg-type]
    fully_shard(model, mesh, **kwargs)  # type: ignore[arg-type]
    return model


def gpt_small() -> GPT:
    """The default ``GPTConfig`` model, as a no-argument factory: ``--model fsdp2lite.models:gpt_small``."""
    return GPT(GPTConfig())
