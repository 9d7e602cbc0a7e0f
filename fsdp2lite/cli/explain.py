"""``fsdp2lite explain``: what a config would do to a model, before any process is started.

    fsdp2lite explain configs/bf16.yaml --model fsdp2lite.models:gpt_small --world-size 8
    fsdp2lite explain qlora70b.yaml --model llama-3-70b --world-size 4 --finetune qlora

The model comes from ``--model`` (``model_spec``), built under ``torch.device("meta")``: no parameter memory
is allocated, however large the model. ``plan_config`` matches the rules (no process group is needed), and
the output is a tree with one node per planned group, in the order ``apply_config`` shards them (bottom-up,
the root last), identical groups shown once with their count (``--all``: each): its module paths, the rule
that matched, its parameter count, the bytes each rank holds sharded and the unsharded bytes, and its
effective policies. Then the warnings: rules that match nothing (exit 1), parameters tied across groups or
0-dim (they cannot be sharded as planned, exit 1), and large modules left in the root group.

``--finetune full|lora|qlora`` explains the training job ``fsdp2lite estimate`` plans: the model as
``estimate.finetune.plan_model`` makes it (lora/qlora: a frozen bf16 base, fp32 adapters, qlora's adapted
weights in NF4) under the config ``finetune_config`` makes of it (what ``examples/train.py --finetune``
applies), counted per group by kind, and the peak ``estimate --method analytic`` gives the same job at
``--batch`` x ``--seq``. The numbers are ``explain_plan``'s, the words ``explain_view``'s.
"""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console

from .._units import human_bytes
from ..config import ConfigError, FSDPConfig
from ..estimate import MemoryEstimate, default_config, estimate_memory, sharded_nbytes
from ..estimate.common import default_seq, token_spec
from ..estimate.finetune import Finetune, plan_model, planned_factory
from ..finetune.sharding import finetune_config
from ._args import UsageError, positive_int
from .explain_plan import Explanation, GroupRow, GroupRun, collapse_rows, explain_config, rule_label, rule_words
from .explain_view import placement_text, show_explanation
from .finetune_args import add_finetune_arguments, check_feasible, finetune_from_args
from .model_spec import build_on_meta, load_factory
from .validate import problems_table

__all__ = [
    "DESCRIPTION",
    "Explanation",
    "GroupRow",
    "GroupRun",
    "add_arguments",
    "build_on_meta",
    "collapse_rows",
    "explain_config",
    "human_bytes",
    "load_factory",
    "placement_text",
    "rule_label",
    "run",
    "sharded_nbytes",
]

DESCRIPTION = (
    "Show how a config would shard a model, without starting any process: one node per group (identical "
    "groups once, with their count), its modules, matching rule, parameters, bytes per rank sharded vs "
    "unsharded and policies, then the warnings. With --finetune, the training job fsdp2lite estimate plans "
    "(lora/qlora: frozen base, adapters, NF4) and its peak. The model is built on the meta device."
)
_PROG = "fsdp2lite explain"
_OPTIMIZER, _DEVICE = "adamw", "cuda"  # estimate's defaults: the peak shown is the one it prints


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "config",
        metavar="CONFIG",
        nargs="?",
        help="YAML policy file (default: a Hugging Face model's _no_split_modules, else one group per repeated block)",
    )
    parser.add_argument(
        "--model",
        required=True,
        metavar="MODEL",
        help="pkg.module:factory (e.g. fsdp2lite.models:gpt_small), a Hugging Face model directory or config.json, "
        "hf:ORG/NAME (local cache only) or a preset (llama-3-70b, ...); built on the meta device",
    )
    parser.add_argument(
        "--world-size", type=positive_int, default=8, help="ranks the model would be sharded over (default 8)"
    )
    parser.add_argument("--all", action="store_true", help="every group on its own node, identical ones too")
    add_finetune_arguments(
        parser,
        "explain the training job as fsdp2lite estimate plans it: full, lora (adapters on a frozen bf16 base) or "
        "qlora (the base in NF4), with its peak; default: the parameters as the model builds them, no peak",
    )
    step = parser.add_argument_group("the step the peak and an offload budget are counted at (as estimate's)")
    step.add_argument("--batch", type=positive_int, default=1, help="sequences per rank (default 1)")
    step.add_argument(
        "--seq", type=positive_int, default=None, help="tokens per sequence (default: the model's, at most 2048)"
    )
    step.add_argument(
        "--inputs", metavar="MODULE:FN", help="a function returning one rank's example inputs (other models)"
    )


def run(args: argparse.Namespace) -> int:
    """0 when the plan is clean; 1 for an invalid config, a rule matching nothing or a refused parameter."""
    finetune = finetune_from_args(args, _PROG)
    if not finetune.adapters and (args.lora_rank is not None or args.lora_targets is not None):
        raise UsageError(
            f"--lora-rank/--lora-targets apply to --finetune lora or qlora; got --finetune {args.finetune or '(none)'}",
            _PROG,
        )
    factory = load_factory(args.model)
    inputs = load_factory(args.inputs, _PROG, "--inputs") if args.inputs else None
    console = Console()
    model = build_on_meta(factory, args.model)
    try:
        config = FSDPConfig.from_yaml(args.config) if args.config else default_config(model)
    except ConfigError as exc:
        console.print(problems_table(args.config, exc.problems))
        return 1
    try:
        shard = config.mesh.resolve(args.world_size)[1]
    except ValueError as exc:
        raise UsageError(f"argument --world-size: {exc}", _PROG) from None
    check_feasible(model, finetune, args.model, _PROG, shard)  # [Note: one feasibility rule]: estimate's refusal
    step = {"batch": args.batch, "seq": _seq(model, args.seq, inputs), "inputs": inputs}
    plan_model(model, finetune)  # the model the job trains (full: unchanged)
    if config.offload.budget is not None:
        config = _resolved_budget(console, planned_factory(factory, finetune), config, args.world_size, step)
    source = args.config or f"the default plan ({rule_words(config)})"
    if finetune.adapters:
        config = finetune_config(config)  # as examples/train.py applies it
    peak = _peak(factory, config, args, finetune, step) if args.finetune is not None else None
    explanation = explain_config(model, config, args.world_size, finetune)
    title = f"{type(model).__name__} ({args.model}) under {source}, world size {args.world_size}"
    if args.finetune is not None:
        title += f", {finetune.label()}"
    show_explanation(console, title, explanation, (peak, _step_words(step)), show_all=args.all)
    return 1 if explanation.unmatched or explanation.refused else 0


def _seq(model: Any, seq: int | None, inputs: Any) -> int | None:
    """The sequence estimate counts at: ``--seq``, or a token model's default."""
    return default_seq(model, seq) if inputs is None and token_spec(model) is not None else seq


def _step_words(step: dict[str, Any]) -> str:
    shape = "--inputs" if step["inputs"] is not None else f"batch {step['batch']} x {step['seq']}"
    return f"{shape}, {_OPTIMIZER}, {_DEVICE}"


def _peak(
    factory: Any, config: FSDPConfig, args: argparse.Namespace, finetune: Finetune, step: dict[str, Any]
) -> MemoryEstimate:
    """The peak of one step of the job, as ``fsdp2lite estimate --method analytic`` computes it."""
    try:
        return estimate_memory(
            factory,
            config,
            world_size=args.world_size,
            method="analytic",
            optimizer=_OPTIMIZER,
            device=_DEVICE,
            finetune=finetune,
            **step,
        )
    except (ValueError, TypeError, ConfigError) as exc:
        raise UsageError(f"cannot estimate {args.model}'s peak: {exc}", _PROG) from None


def _resolved_budget(
    console: Console, factory: Any, config: FSDPConfig, world_size: int, step: dict[str, Any]
) -> FSDPConfig:
    """``offload.budget`` resolved at ``--batch`` x ``--seq`` ([Note: offload budget]), as ``fsdp2lite estimate
    --config`` resolves it; ``factory`` builds the model the job trains."""
    from ..estimate.offload_budget import resolve_offload_budget

    try:
        placement = resolve_offload_budget(factory, config, world_size, **step)
    except (ValueError, TypeError) as exc:
        raise UsageError(f"cannot resolve offload.budget: {exc}", _PROG) from None
    console.print(
        f"offload budget {human_bytes(placement.budget)} at {_step_words(step)}: "
        + placement_text(placement, config)
        + ("" if placement.fits else " [red](over the budget even with every group offloaded)[/red]"),
    )
    return placement.config
