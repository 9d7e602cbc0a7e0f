"""``offload: {budget: ...}``: the planner offloads the largest groups first, the fewest that fit; estimate,
explain and --write-config show and write the placement; apply_config refuses an unresolved budget."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.nn as nn

import fsdp2lite as fl
from fsdp2lite.cli import main
from fsdp2lite.estimate import resolve_offload_budget
from fsdp2lite.estimate.offload_budget import _with
from fsdp2lite.models import GPT, GPTConfig

SMALL = GPTConfig(vocab_size=256, seq_len=32, d_model=64, n_heads=4, n_layers=6)
RULES = {"wrap": [{"match": {"class": "Block"}}]}
FACTORY = "fsdp2lite.models:gpt_small"


def build() -> nn.Module:
    return GPT(SMALL)


def _peak(config: fl.FSDPConfig) -> int:
    return fl.estimate_memory(build, config, world_size=4, method="analytic").peak_bytes


def test_the_fewest_largest_groups_that_fit() -> None:
    plain = _peak(fl.FSDPConfig.model_validate(RULES))
    counts = []
    for share in (1.5, 0.9, 0.8, 0.7):
        budget = int(plain * share)
        config = fl.FSDPConfig.model_validate({**RULES, "offload": {"budget": str(budget), "optimizer_only": True}})
        placement = resolve_offload_budget(build, config, 4)
        assert placement.fits and placement.estimate.peak_bytes <= budget and placement.candidates == 6
        assert placement.config.offload.budget is None and placement.config.offload.device == "none"
        rules = placement.config.wrap[: len(placement.offloaded)]
        assert [rule.match.path for rule in rules] == list(placement.offloaded)
        assert all(rule.offload.optimizer_only and rule.offload.device == "cpu" for rule in rules)
        if placement.offloaded:  # the fewest: one group fewer does not fit
            base = fl.FSDPConfig.model_validate(RULES)
            planned = fl.plan_config(build(), base).groups
            by_path = {g.paths[0]: g for g in planned}
            fewer = [by_path[path] for path in placement.offloaded[:-1]]
            assert _peak(_with(base, fewer, True, planned)) > budget
        counts.append(len(placement.offloaded))
    assert counts[0] == 0 and counts == sorted(counts) and counts[-1] > counts[1], counts
    applied = fl.plan_config(build(), placement.config)
    offloaded = [g.paths for g in applied.groups if g.policy.offload.device == "cpu"]
    assert [paths[0] for paths in offloaded] == sorted(placement.offloaded)  # plan order: the blocks, in order


def test_a_budget_below_the_activations_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "budget.yaml"
    path.write_text("wrap:\n  - match: {class: Block}\noffload: {budget: 1MiB}\n")
    out_path = tmp_path / "resolved.yaml"
    argv = ["estimate", "--config", str(path), "--model", FACTORY, "--world-size", "4", "--method", "analytic"]
    assert main([*argv, "--write-config", str(out_path)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "offload budget 1.0 MiB: 4 of 4 groups offloaded (full, largest first)" in out
    assert "is not reached even with every group offloaded" in out and "of which activations alone are" in out
    resolved = fl.FSDPConfig.from_yaml(out_path)  # a valid policy file, every block offloaded
    assert resolved.offload.budget is None and [r.offload.device for r in resolved.wrap[:4]] == ["cpu"] * 4
    assert main(["explain", str(path), "--model", FACTORY, "--world-size", "4"]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert "offload budget 1.0 MiB at batch 1" in shown and "over the budget even with every group" in shown
    assert main([*argv, "--device", "cpu"]) == 2
    assert "argument --config: offload: {budget: 1MiB} moves groups from a device to its host" in " ".join(
        capsys.readouterr().err.split()
    )


def test_refusals() -> None:
    with pytest.raises(ValueError, match="budget: 20GiB chooses which groups go to the host, but device: cpu"):
        fl.FSDPConfig.model_validate({"offload": {"device": "cpu", "budget": "20GiB"}})
    with pytest.raises(ValueError, match=r"wrap\[0\].offload.budget: 2GiB: a budget is for the whole model"):
        fl.FSDPConfig.model_validate({"wrap": [{"match": {"class": "Block"}, "offload": {"budget": "2GiB"}}]})
    with pytest.raises(ValueError, match="expected a size: .* got '20 apples'"):
        fl.FSDPConfig.model_validate({"offload": {"budget": "20 apples"}})
    config = fl.FSDPConfig.model_validate({**RULES, "offload": {"budget": "20GiB"}})
    for device in ("cpu", "meta"):  # no host to offload to
        with pytest.raises(ValueError, match=f"the target device is '{device}', which has no host to offload to"):
            resolve_offload_budget(build, config, 4, device=device)
    model = build()
    with pytest.raises(ValueError, match="apply_config: offload.budget: 20GiB is resolved by the planner"):
        fl.apply_config(model, config)
    assert not isinstance(model, fl.FSDPModule)
