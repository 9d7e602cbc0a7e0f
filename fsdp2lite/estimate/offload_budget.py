"""``offload: {budget: 20GiB}``: offload the largest groups first, until the estimated device peak fits.

[Note: offload budget]
A budget is a device-memory target for one rank, not a placement: which groups go to the host depends on
the model, the world size, the batch and the sequence length, so it is resolved by the planner, where those
are known (``fsdp2lite estimate --config``, ``explain``, ``resolve_offload_budget``), into an ordinary
policy file: one wrap rule per offloaded group, matched by its module paths and placed before the rules the
file already had (first match wins), each a copy of the rule that made the group with its ``offload`` set to
the top level's kind (``optimizer_only`` or full; ``optimizer: nvme`` and ``nvme_path`` with it). The root
group stays on the device: its rule is the top level itself, and it is the one group kept unsharded through
forward and backward. Groups are taken in order of their parameter bytes, largest first; the analytic
estimate (``analytic.py``) is monotone in the number of groups taken, so the fewest that fit are found by
bisection (log2(groups) + 2 estimates). ``fsdp2lite estimate --budget`` searches the same placement, per
setting, against the reserved peak (``cli/estimate_search.py``).
``apply_config`` refuses a file whose budget is unresolved, naming the command that resolves it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from ..config.plan import GroupPlan, plan_config
from ..config.schema import FSDPConfig, Match, OffloadConfig
from .analytic import analytic_estimate
from .common import MemoryEstimate
from .finetune import Finetune


@dataclass(frozen=True)
class BudgetPlacement:
    """What a budget resolved to."""

    budget: int  # bytes of device memory per rank
    config: FSDPConfig  # the resolved policy file: one rule per offloaded group first, no budget left
    offloaded: tuple[str, ...]  # the offloaded groups (module paths joined by " + "), largest first
    candidates: int  # groups that could go (every group but the root and those already offloaded)
    estimate: MemoryEstimate  # of ``config``
    fits: bool  # the estimate's peak is within the budget (False: even every candidate offloaded is not)


def resolve_offload_budget(
    model_fn: Callable[[], nn.Module],
    config: FSDPConfig,
    world_size: int,
    *,
    batch: int = 1,
    seq: int | None = None,
    optimizer: str = "adamw",
    device: str = "cuda",
    inputs: Callable[[], Any] | None = None,
    fits: Callable[[MemoryEstimate], bool] | None = None,
    cache: dict[Any, Any] | None = None,
    finetune: Finetune | None = None,
) -> BudgetPlacement:
    """Resolve ``config.offload.budget`` ([Note: offload budget]); a config without one is returned as it is.
    The top level's ``optimizer_only``, ``optimizer`` (``nvme``) and ``nvme_path`` are the offloaded groups'.
    ``fits``: whether an estimate is within the budget (default: its allocated peak; the budget search asks
    for the reserved one); ``cache`` and ``finetune`` as ``analytic_estimate`` takes them."""
    budget = config.offload.budget
    cache = {} if cache is None else cache

    def estimate(candidate: FSDPConfig) -> MemoryEstimate:
        return analytic_estimate(
            model_fn, candidate, world_size, 0, inputs, batch, seq, optimizer, device, cache, finetune=finetune
        )

    if budget is None:
        return BudgetPlacement(0, config, (), 0, estimate(config), True)
    if device != "cuda":
        raise ValueError(
            f"offload: {{budget: {budget}}} moves groups from a device to its host, but the target device is "
            f"{device!r}, which has no host to offload to (on 'cpu' the parameters are on the host already; 'meta' "
            "holds nothing): plan it for device 'cuda' (fsdp2lite estimate --device cuda)"
        )
    limit = config.offload.budget_bytes or 0
    within = fits or (lambda found: found.peak_bytes <= limit)
    if "model" not in cache:
        with torch.device("meta"):
            cache["model"] = model_fn()
    chosen, planned = largest_groups(cache["model"], config)
    low, high = 0, len(chosen)  # the fewest groups that fit lie in [low, high]
    if not within(estimate(offload_largest(config, chosen, high, planned))):
        low = high  # even all of them do not fit
    while low < high:
        middle = (low + high) // 2
        if within(estimate(offload_largest(config, chosen, middle, planned))):
            high = middle
        else:
            low = middle + 1
    resolved = offload_largest(config, chosen, low, planned)
    final = estimate(resolved)
    labels = tuple(" + ".join(g.paths) for g in chosen[:low])
    return BudgetPlacement(limit, resolved, labels, len(chosen), final, within(final))


def largest_groups(model: nn.Module, config: FSDPConfig) -> tuple[list[GroupPlan], list[GroupPlan]]:
    """(the groups a budget may offload, largest parameter bytes first; every group) of ``config`` planned on
    ``model`` with its top-level offload on the device."""
    plan = plan_config(model, _on_device(config))
    groups = [(group, params) for group, params in zip(plan.groups, plan.params) if _movable(group)]
    groups.sort(key=lambda item: -sum(p.numel() * p.element_size() for p in item[1].values()))
    return [group for group, _ in groups], plan.groups


def offload_largest(config: FSDPConfig, chosen: list[GroupPlan], count: int, planned: list[GroupPlan]) -> FSDPConfig:
    """``config`` (its top-level offload a budget's: the kind the groups get) with the first ``count`` of
    ``chosen`` offloaded, a rule each, and its top level on the device with no budget left."""
    placed = _with(config, chosen[:count], config.offload.optimizer_only, planned)
    return placed.model_copy(update={"offload": _on_device(config).offload})


def _on_device(config: FSDPConfig) -> FSDPConfig:
    return config.model_copy(update={"offload": OffloadConfig(pin_memory=config.offload.pin_memory)})


def _movable(group: GroupPlan) -> bool:
    """A group the budget may offload: not the root, not offloaded already."""
    return group.rule_index is not None and group.policy.offload.device == "none"


def _with(config: FSDPConfig, groups: list[GroupPlan], kind: bool, planned: list[GroupPlan]) -> FSDPConfig:
    """``config`` with ``groups`` offloaded (``kind``: optimizer_only): a rule per group, first, copying the
    rule that made it; a rule of ``config`` whose every group (of ``planned``, its plan) went is dropped, as
    it would match nothing."""
    top = config.offload
    offload = OffloadConfig(
        device="cpu", pin_memory=top.pin_memory, optimizer_only=kind, optimizer=top.optimizer, nvme_path=top.nvme_path
    )
    rules = []
    for group in groups:
        source = config.wrap[group.rule_index]  # type: ignore[index]  # _movable: never the root
        match = Match(path=list(group.paths) if len(group.paths) > 1 else group.paths[0])
        rules.append(source.model_copy(update={"match": match, "offload": offload}))
    taken = {id(group) for group in groups}
    left = {group.rule_index for group in planned if id(group) not in taken}
    made = {group.rule_index for group in planned}
    kept = [rule for index, rule in enumerate(config.wrap) if index in left or index not in made]
    return config.model_copy(update={"wrap": [*rules, *kept]})
