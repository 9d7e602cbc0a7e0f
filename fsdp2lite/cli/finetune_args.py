"""``--finetune``, ``--lora-rank`` and ``--lora-targets``: what a job trains, as the commands that plan one
take it (``explain``; ``estimate`` spells them the same way). One parser group, one reading of it and one
check of the targets against the model, so the defaults and the refusals are the same everywhere."""

from __future__ import annotations

import argparse

import torch.nn as nn

from ..estimate.finetune import FINETUNES, Finetune
from ..finetune.feasible import check_finetune
from ..finetune.lora import DEFAULT_TARGETS
from ._args import UsageError, positive_int

DEFAULT_RANK = Finetune().rank


def add_finetune_arguments(parser: argparse.ArgumentParser, finetune_help: str) -> None:
    """The fine-tuning group; ``--lora-rank`` and ``--lora-targets`` default to None (not given), read by
    ``finetune_from_args`` as rank 16 and the Llama projections."""
    group = parser.add_argument_group("fine-tuning")
    group.add_argument("--finetune", choices=FINETUNES, default=None, help=finetune_help)
    group.add_argument("--lora-rank", type=positive_int, default=None, help=f"LoRA rank r (default {DEFAULT_RANK})")
    group.add_argument(
        "--lora-targets",
        default=None,
        help=f"Linear layer names that get adapters, a comma list (default {', '.join(DEFAULT_TARGETS)})",
    )


def finetune_from_args(args: argparse.Namespace, prog: str) -> Finetune:
    """The ``Finetune`` the flags name (``--finetune`` absent: full); a rank or target list ``Finetune``
    refuses is a ``UsageError`` naming the flags."""
    rank = DEFAULT_RANK if args.lora_rank is None else args.lora_rank
    text = ",".join(DEFAULT_TARGETS) if args.lora_targets is None else args.lora_targets
    try:
        targets = tuple(t.strip() for t in text.split(",") if t.strip())
        return Finetune(args.finetune or "full", rank, targets)
    except ValueError as exc:
        raise UsageError(f"argument --lora-targets/--lora-rank: {exc}", prog=prog) from None


def check_feasible(model: nn.Module, finetune: Finetune, spec: str, prog: str, shard: int) -> None:
    """``finetune`` on the base ``model`` sharded over ``shard`` ranks passes the one feasibility rule
    ([Note: one feasibility rule]: NF4 row shards of whole scale blocks for qlora); otherwise the
    ``UsageError`` estimate gives, word for word."""
    try:
        check_finetune(model, finetune.kind, finetune.targets, shard)
    except ValueError as exc:
        raise UsageError(f"cannot plan {spec}: {exc}", prog=prog) from None
