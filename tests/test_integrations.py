"""fsdp2lite inside the tools people train with (issue 22): the HF Trainer on a model transformers
sharded itself, Accelerate's FSDP2 preparation, Lightning's ModelParallelStrategy. Each runs on 2 gloo
ranks under torchrun (tests/integrations/tool_runs.py), once with torch's fully_shard and once with
fsdp2lite's in the same processes: the losses must be equal at every step (fp32: bit for bit; bf16 within
the mixed-precision tolerance), a run resumed from a checkpoint saved mid-run must reproduce the
uninterrupted losses, and the tool must have taken the model for an FSDP2 one.

A tool that is not installed is skipped, saying so; ``pip install -e '.[dev]'`` installs all three.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _cpu_env import cpu_env

HERE = Path(__file__).resolve().parent
RESUME_AT = 2
# transformers 5.19 made the Trainer leave a model sharded by from_pretrained(distributed_config=...) alone;
# before, Accelerate wraps it in DDP on CPU, which fails on its DTensor parameters with torch's fully_shard too
TRAINER_KEEPS_SHARDED_MODELS = "5.19"


def _model_dir(tmp_path: Path) -> Path:
    from _models import tiny_llama

    torch.manual_seed(0)
    path = tmp_path / "model"
    tiny_llama().save_pretrained(path)
    (tmp_path / "llama_blocks.yaml").write_text("wrap:\n  - match: {class: LlamaDecoderLayer}\n")
    return path


def _run(tool: str, tmp_path: Path) -> list[dict[str, Any]]:
    out = tmp_path / tool
    out.mkdir()
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(HERE / "integrations" / "tool_runs.py"), tool, str(out), str(_model_dir(tmp_path))]  # fmt: skip
    # CUDA hidden: with a GPU visible, transformers' distributed_config and torch's fully_shard (in Accelerate)
    # bind rank 1 to cuda:1, which a one-GPU machine has not got (tests/_cpu_env.py)
    env = cpu_env(TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{tool} run failed:\n{done.stdout[-4000:]}\n{done.stderr[-6000:]}"
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


def _check_runs(
    results: list[dict[str, Any]], oracle: str, impl: str, rtol: float, atol: float, exact_resume: bool = True
) -> None:
    for rank, result in enumerate(results):
        ref, mine = result[oracle], result[impl]
        assert mine["seen"]["impl"] == "fsdp2lite" and ref["seen"]["impl"] == "torch", (rank, mine["seen"])
        assert mine["seen"]["fsdp_module"], "the tool must see a torch FSDPModule"
        torch.testing.assert_close(mine["losses"], ref["losses"], rtol=rtol, atol=atol, msg=f"{impl} rank {rank}")
        torch.testing.assert_close(mine["resumed"], ref["resumed"], rtol=rtol, atol=atol, msg=f"{impl} resumed")
        if exact_resume:  # a run resumed from the mid-run checkpoint reproduces the uninterrupted one, bit for bit
            assert mine["resumed"] == mine["losses"][RESUME_AT:], (impl, rank, mine["resumed"], mine["losses"])
    assert results[0][impl]["losses"] == results[1][impl]["losses"], "ranks disagree on the mean loss"


def test_transformers_native_fsdp2_and_the_trainer(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers", reason="transformers is not installed: pip install -e '.[dev]'")
    from packaging.version import Version  # a dependency of transformers

    if Version(transformers.__version__) < Version(TRAINER_KEEPS_SHARDED_MODELS):
        pytest.skip(
            f"transformers {transformers.__version__}: its Trainer wraps a model sharded at load time in DDP on "
            f"CPU (torch's fully_shard fails there too); needs transformers >= {TRAINER_KEEPS_SHARDED_MODELS}"
        )
    results = _run("transformers", tmp_path)
    _check_runs(results, "torch", "fsdp2lite", rtol=0, atol=0)
    for result in results:
        mine = result["fsdp2lite"]
        assert mine["seen"]["type"] == "FSDPLlamaForCausalLM"
        assert mine["generated"] == mine["unsharded"] == result["torch"]["generated"]


def test_accelerate_fsdp2_preparation(tmp_path: Path) -> None:
    pytest.importorskip("accelerate", reason="accelerate is not installed: pip install -e '.[dev]'")
    pytest.importorskip("transformers", reason="transformers is not installed: pip install -e '.[dev]'")
    results = _run("accelerate", tmp_path)
    _check_runs(results, "torch", "fsdp2lite", rtol=0, atol=0)
    _check_runs(results, "torch", "fsdp2lite-config", rtol=0, atol=0)
    # bf16 through Accelerate: a resumed run differs from the uninterrupted one by ~1e-4 with torch's
    # fully_shard too (equal to fsdp2lite's bit for bit here), so it is compared with torch's resumed run
    _check_runs(results, "torch-bf16", "fsdp2lite-bf16", rtol=2e-3, atol=2e-3, exact_resume=False)
    seen = results[0]
    assert seen["fsdp2lite"]["seen"]["groups"] == seen["torch"]["seen"]["groups"]  # Accelerate's own plan
    assert seen["fsdp2lite-config"]["seen"]["groups"] == 3  # the policy file's: two decoder layers + the root
    assert seen["fsdp2lite-bf16"]["losses"] != seen["fsdp2lite"]["losses"]  # bf16 really ran


def test_lightning_model_parallel_strategy(tmp_path: Path) -> None:
    pytest.importorskip("pytorch_lightning", reason="pytorch-lightning is not installed: pip install -e '.[dev]'")
    pytest.importorskip("transformers", reason="transformers is not installed: pip install -e '.[dev]'")
    _check_runs(_run("lightning", tmp_path), "torch", "fsdp2lite", rtol=0, atol=0)
