"""Whether a fine-tuning job can launch at a shard degree: one rule for the planner and the runtime.

[Note: one feasibility rule]
``finetune_problems`` is the only place that decides whether ``lora`` or ``qlora`` can run on a model
at a shard degree (the ranks each parameter is split over). ``fsdp2lite estimate`` calls it for every
setting it searches and for a ``--finetune`` given, ``fsdp2lite explain --finetune`` and ``--write-config``
plan only what it passed, and ``examples/train.py`` calls it on the meta model before anything is built,
so a recommendation always launches and a refusal reads the same everywhere. It needs neither peft nor
torchao: it reads the base model's Linear shapes (on the meta device, a 70B costs nothing).

What it checks: every LoRA target names a Linear layer (``targets_problem``); for qlora, every targeted
weight can be NF4 sharded by rows over ``shard`` ranks (``qlora.shard_problem``): a 2D weight of whole
64 * 256-value units (what ``to_nf4`` quantizes) whose rows hold whole blocks of 64 values, so a rank's
share of rows is padded like any parameter's ([Note: NF4 padded by rows]); every Llama projection passes at
every degree. And none is tied to another parameter (``tied_problems``: a tied ``lm_head`` made NF4 would
leave the embedding its own bf16 copy, which neither the plan nor the runtime counts). Memory is the
planner's part (the budget search); the mesh and policy checks are the plan's (``plan_config``), which every
path already shares. When qlora cannot run, ``qlora_shard_degrees`` names
the degrees where it can, so the refusal says what works instead.
"""

from __future__ import annotations

import torch.nn as nn

from .._summary import summarized
from .lora import targets_problem
from .qlora import shard_problem


def targeted_weights(model: nn.Module, targets: tuple[str, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """(path, shape) of the weight of every Linear layer of the base ``model`` whose name is a target."""
    return [
        (f"{path}.weight", tuple(module.weight.shape))
        for path, module in model.named_modules()
        if isinstance(module, nn.Linear) and path and path.rsplit(".", 1)[-1] in targets
    ]


def finetune_problems(model: nn.Module, kind: str, targets: tuple[str, ...], shard: int) -> list[str]:
    """Why ``kind`` (full, lora, qlora) with LoRA ``targets`` cannot run on the base ``model`` (before
    adapters) sharded over ``shard`` ranks: one line per problem; empty when it can."""
    if kind == "full":
        return []
    problem = targets_problem(model, targets)
    if problem is not None:
        return [problem]
    if kind != "qlora":
        return []
    weights = targeted_weights(model, targets)
    found = [problem for path, shape in weights if (problem := shard_problem(path, shape, shard)) is not None]
    return found + tied_problems(model, [path for path, _ in weights])


def tied_problems(model: nn.Module, paths: list[str]) -> list[str]:
    """qlora stores each targeted weight as NF4 codes: a weight tied to another parameter (a tied
    ``lm_head`` and ``embed_tokens``) would be untied, the other keeping the bf16 tensor."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    weights = dict(model.named_parameters(remove_duplicate=False))
    problems = []
    for path in paths:
        others = [name for name in names[id(weights[path])] if name != path]
        if others:
            layer = path.rsplit(".", 2)[-2]
            problems.append(
                f"{path} is tied to {', '.join(others)}: NF4 would untie them (the other keeps the bf16 weight); "
                f"leave {layer} out of --lora-targets, or use --finetune lora"
            )
    return problems


def qlora_shard_degrees(model: nn.Module, targets: tuple[str, ...], up_to: int) -> list[int]:
    """The shard degrees from 1 to ``up_to`` at which every targeted weight can be NF4 (by rows)."""
    weights = targeted_weights(model, targets)
    return [n for n in range(1, up_to + 1) if all(shard_problem(p, s, n) is None for p, s in weights)]


def refusal(kind: str, shard: int, problems: list[str], model: nn.Module, targets: tuple[str, ...]) -> str:
    """The one message for a job ``finetune_problems`` refused: its problems, those alike but for a layer
    index said once (``_summary.summarized``), and for qlora what would work instead."""
    if targets_problem(model, targets) is not None:  # nothing to adapt: one line, whatever the kind
        return f"--finetune {kind}: {problems[0]}"
    count = f"{len(problems)} weight{'s' if len(problems) > 1 else ''}"
    where = f"sharded over {shard} rank{'s' if shard > 1 else ''} ({count})"
    lines = [f"--finetune {kind} cannot run {where}:", *(f"  {line}" for line in summarized(problems))]
    if kind == "qlora" and any(" is tied to " not in problem for problem in problems):  # a shard problem
        degrees = qlora_shard_degrees(model, targets, max(2 * shard, 8))
        where = ", ".join(str(n) for n in degrees) if degrees else "none up to " + str(max(2 * shard, 8))
        ranks = "rank" if degrees == [1] else "ranks"
        lines.append(f"  qlora works sharded over: {where} {ranks}; --finetune lora (a bf16 base) works over {shard}")
    return "\n".join(lines)


def check_finetune(model: nn.Module, kind: str, targets: tuple[str, ...], shard: int) -> None:
    """``finetune_problems`` as a ValueError carrying ``refusal``'s message (nothing has changed yet)."""
    problems = finetune_problems(model, kind, targets, shard)
    if problems:
        raise ValueError(refusal(kind, shard, problems, model, targets))
