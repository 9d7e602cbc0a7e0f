"""fl.patch()/unpatch() and what tools see of fsdp2lite modules (issue 22): torch's FSDPModule, torch's
policy objects, torch's own register_fsdp_forward_method, the Accelerate installer's inputs."""

from __future__ import annotations

import importlib
import sys
import threading
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn
from torch.distributed.fsdp._fully_shard import _fully_shard as torch_home

import fsdp2lite as fl

patch_module = importlib.import_module("fsdp2lite.integrations.patch")  # the package's ``patch`` is the function
NAMES = ("fully_shard", "FSDPModule", "MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy")
TORCHS = {name: getattr(torch_home if hasattr(torch_home, name) else torch_fsdp, name) for name in NAMES}


@pytest.fixture
def unpatched() -> Iterator[None]:
    """Every test leaves torch as it found it (patching is process-wide)."""
    fl.unpatch()
    try:
        yield
    finally:
        fl.unpatch()
    assert torch_fsdp.fully_shard is TORCHS["fully_shard"]


@pytest.mark.usefixtures("unpatched")
def test_patch_rebinds_every_home_and_unpatch_restores() -> None:
    composable = importlib.import_module("torch.distributed._composable.fsdp")
    submodule = sys.modules["torch.distributed._composable.fsdp.fully_shard"]
    report = fl.patch()
    for module in (torch_fsdp, composable, submodule):
        assert module.fully_shard is fl.fully_shard, module.__name__
        assert module.FSDPModule is fl.FSDPModule, module.__name__
    assert torch_fsdp.MixedPrecisionPolicy is fl.MixedPrecisionPolicy
    assert "torch.distributed.fsdp.fully_shard" in report.rebound and report.total == len(report.rebound)
    assert "torch.distributed.fsdp.fully_shard" in str(report)
    again = fl.patch()  # idempotent: nothing left to rebind
    assert again.rebound == [] and again.total == report.total
    restored = fl.unpatch()
    assert sorted(restored) == sorted(report.rebound)
    for module in (torch_fsdp, composable, submodule):
        assert module.fully_shard is TORCHS["fully_shard"]
    assert fl.unpatch() == []


@pytest.mark.usefixtures("unpatched")
def test_patch_reaches_tools_that_bound_the_names_and_later_imports() -> None:
    """A tool module that did ``from torch.distributed.fsdp import fully_shard`` before patch() holds a
    copy: patch() finds it by identity; one imported after patch() reads the rebound home."""
    before = ModuleType("torchtitan.fake_parallelize")
    before.fully_shard = torch_fsdp.fully_shard  # type: ignore[attr-defined]
    before.unrelated = TORCHS["fully_shard"]  # type: ignore[attr-defined]  # another name: left alone
    sys.modules[before.__name__] = before
    outside = ModuleType("my_training_script")
    outside.fully_shard = torch_fsdp.fully_shard  # type: ignore[attr-defined]
    sys.modules[outside.__name__] = outside
    try:
        with fl.patch() as report:
            assert before.fully_shard is fl.fully_shard  # type: ignore[attr-defined]
            assert before.unrelated is TORCHS["fully_shard"]  # type: ignore[attr-defined]
            assert outside.fully_shard is TORCHS["fully_shard"]  # type: ignore[attr-defined]  # not a known tool
            assert "torchtitan.fake_parallelize.fully_shard" in report.rebound
            from torch.distributed.fsdp import fully_shard as imported_now

            assert imported_now is fl.fully_shard
        assert before.fully_shard is TORCHS["fully_shard"]  # type: ignore[attr-defined]  # the context unpatched
    finally:
        del sys.modules[before.__name__], sys.modules[outside.__name__]


@pytest.mark.usefixtures("unpatched")
def test_patch_from_many_threads_rebinds_each_name_once() -> None:
    reports: list[fl.PatchReport] = []
    threads = [threading.Thread(target=lambda: reports.append(fl.patch())) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    rebound = [entry for report in reports for entry in report.rebound]
    assert len(rebound) == len(set(rebound)) == max(report.total for report in reports)
    assert patch_module.planned() == []  # nothing of torch's is left to rebind


@pytest.mark.usefixtures("single_rank_pg")
def test_torch_sees_an_fsdp2_module_and_its_policies_are_accepted() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    mp = TORCHS["MixedPrecisionPolicy"](param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fl.fully_shard(model, mp_policy=mp, offload_policy=TORCHS["CPUOffloadPolicy"](pin_memory=False))
    assert isinstance(model, TORCHS["FSDPModule"]) and isinstance(model, fl.FSDPModule)
    group = model._fsdp_state.group
    assert group.params[0].param_dtype == torch.bfloat16 and group.params[0].reduce_dtype == torch.float32
    assert group.params[0].home.on_host
    assert model._is_fsdp_managed_module and model[0]._is_fsdp_managed_module  # transformers' generate reads it
    config = fl.FSDPConfig(mixed_precision=mp, offload=TORCHS["OffloadPolicy"]())
    assert config.mixed_precision.param_dtype == torch.bfloat16 and config.offload.device == "none"


@pytest.mark.usefixtures("single_rank_pg")
def test_torchs_register_fsdp_forward_method_runs_ours() -> None:
    """torch's own register_fsdp_forward_method (what Accelerate and transformers call) wraps a method with
    ``_get_fsdp_state()._pre_forward/_post_forward``: on an fsdp2lite module the method runs in one pass,
    its forwards inside it, the parameters resharded after it."""

    class Generator(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x)

        def generate(self, x: torch.Tensor, steps: int) -> torch.Tensor:
            for _ in range(steps):
                x = self(x)
            return x

    model = Generator()
    expected = model.generate(torch.ones(1, 4), 3)
    block = nn.Sequential(model)
    fl.fully_shard(model)
    fl.fully_shard(block)
    torch_home.register_fsdp_forward_method(model, "generate")
    group = model._fsdp_state.group
    unshards: list[int] = []
    original = group.unshard
    group.unshard = lambda: (unshards.append(1), original())[1]  # type: ignore[method-assign]
    with torch.no_grad():
        torch.testing.assert_close(model.generate(torch.ones(1, 4), 3), expected)
    assert len(unshards) == 1, "the three forwards inside generate ran in one pass"
    assert group.sharded_state.name == "SHARDED"


def test_accelerate_install_bad_config(tmp_path) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("accelerate", reason="accelerate is not installed: pip install -e '.[dev]'")
    from fsdp2lite.integrations import accelerate as fl_accelerate

    with pytest.raises(TypeError, match="install\\(config=...\\) takes None, an FSDPConfig or the path"):
        fl_accelerate.install(config={"wrap": []})  # type: ignore[arg-type]
    bad = tmp_path / "bad.yaml"
    bad.write_text("wrap:\n  - match: {clas: Block}\n")
    with pytest.raises(fl.ConfigError, match="did you mean 'class'"):
        fl_accelerate.install(bad)
    assert not patch_module.is_patched()  # nothing was patched by a refused install


@pytest.mark.usefixtures("unpatched")
def test_doctor_reports_versions_integrations_and_the_patch_plan(capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from fsdp2lite.cli import main

    monkeypatch.setenv("COLUMNS", "400")
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "│ torch" in out and torch.__version__ in out and "backend gloo" in out
    assert "torch.distributed.fsdp.fully_shard" in out and "would rebind" in out
    assert "Accelerate FSDP2" in out and "Lightning" in out
    assert torch_fsdp.fully_shard is TORCHS["fully_shard"]  # the plan rebinds nothing
    assert "host RAM" in out and "locked-memory limit (ulimit -l)" in out and "nvme_path" not in out


def test_doctor_checks_an_nvme_path(capsys, monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """--nvme-path: a writable directory is reported with its free space and filesystem (exit 0); a missing one
    or a file is named with what is wrong (exit 1)."""
    from fsdp2lite.cli import main

    monkeypatch.setenv("COLUMNS", "400")
    assert main(["doctor", "--nvme-path", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"{tmp_path}: a writable directory" in out and "free there" in out and "filesystem" in out
    afile = tmp_path / "state.bin"
    afile.write_text("")
    for path, why in ((tmp_path / "missing", "does not exist"), (afile, "is not a directory")):
        assert main(["doctor", "--nvme-path", str(path)]) == 1
        assert f"--nvme-path: nvme_path '{path}' {why}" in capsys.readouterr().out
