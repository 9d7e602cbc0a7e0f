"""The planner's host memory and NVMe bytes: optimizer state on NVMe (exact bytes, both methods), host memory
at the sizes pinning takes and as asked for, per machine, the budget search's per-group and NVMe offloads,
``--host-ram``, and explain's optimizer state placement ([Note: host bytes] in estimate/host.py)."""

from __future__ import annotations

import json
import re
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

import fsdp2lite as fl
from fsdp2lite.cli import main
from fsdp2lite.estimate.timing import NVME_GB_PER_S, comm_bytes, step_time


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.proj(x))


class Toy(nn.Module):
    """Three blocks of Linear(64, 64) and a Linear(64, 16) head: at world 4 a block's shards are a 4,096-byte
    weight and a 64-byte bias, the head's 1,024 and 16."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def toy() -> Toy:
    return Toy()


def toy_inputs() -> tuple[torch.Tensor]:
    return (torch.randn(256, 64),)


BLOCK = 4096 + 64  # one block's trainable shards per rank (= its sharded gradient buffer)
HEAD = 1024 + 16


def _config(**offload: Any) -> fl.FSDPConfig:
    return fl.FSDPConfig.model_validate({"wrap": [{"match": {"class": "Block"}, "offload": offload}]})


def _estimate(config: fl.FSDPConfig, method: str = "analytic", device: str = "cuda") -> fl.MemoryEstimate:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pin_memory in a CPU simulation
        return fl.estimate_memory(toy, config, world_size=4, inputs=toy_inputs, method=method, device=device)


def test_nvme_moves_the_optimizer_state_to_files_exact_bytes() -> None:
    """Analytic, blocks offloaded: AdamW's two state tensors per block (2 x 4,160 bytes in memory) go to the
    file, each tensor on a 4 KiB page (2 x 2 x 4,096); the host gains two staging slots of the largest block's
    state (64-byte aligned: 8,320); the masters, the gradient buffers and the slots are pinned at their exact
    sizes ([Note: one host buffer per group])."""
    host = _estimate(_config(device="cpu"))
    nvme = _estimate(_config(device="cpu", optimizer="nvme", nvme_path="/mnt/nvme0"))
    assert nvme.peak_bytes == host.peak_bytes and nvme.breakdown == host.breakdown  # the device is the same
    assert host.nvme_bytes == 0 and nvme.nvme_bytes == 3 * 2 * 2 * 4096
    optimizer = 2 * (3 * BLOCK + HEAD) + 4 * 8  # AdamW: two moments and a step counter per tensor
    in_memory = optimizer * 3 * BLOCK // (3 * BLOCK + HEAD)  # the offloaded share of it
    assert host.host_exact_bytes == 3 * BLOCK + 3 * BLOCK + in_memory  # masters, gradient buffers, state
    assert host.host_bytes == host.host_exact_bytes  # every pinned buffer registered at its size
    # stepping in backward one gradient buffer, a block's, serves the three blocks: [Note: host gradient buffers]
    assert host.host_bytes_step_in_backward == host.host_bytes - 3 * BLOCK + BLOCK
    one_buffer = f"one gradient buffer serves every group: {host.host_bytes - 2 * BLOCK:,} bytes"
    assert any(one_buffer in note for note in host.notes)
    steps = in_memory - 3 * 2 * BLOCK  # the step counters' share stays in host memory
    assert nvme.host_exact_bytes == 3 * BLOCK + 3 * BLOCK + steps + 2 * 2 * BLOCK
    assert nvme.host_bytes == nvme.host_exact_bytes
    assert any("optimizer state on NVMe: 49,152 bytes per rank" in note for note in nvme.notes)


def test_pinned_sizes_only_where_pinned() -> None:
    """A CPU target, or pin_memory: false, allocates pageable host memory, and a pinned one registers each buffer
    at its exact size ([Note: one host buffer per group]): host_bytes is the exact size in all three."""
    nvme = {"device": "cpu", "optimizer": "nvme", "nvme_path": "/x"}
    pinned = _estimate(_config(**nvme))
    for estimate in (_estimate(_config(**nvme), device="cpu"), _estimate(_config(**nvme, pin_memory=False))):
        assert estimate.host_bytes == estimate.host_exact_bytes == pinned.host_exact_bytes == pinned.host_bytes
        assert estimate.nvme_bytes == pinned.nvme_bytes


def test_simulate_counts_nvme_as_analytic_does() -> None:
    """simulate runs the step with the state in host memory (no files on the planning machine) and moves the
    NVMe groups' state to NVMe from the plan: the same files and staging slots as analytic."""
    host = _estimate(_config(device="cpu"), method="simulate")
    nvme = _estimate(_config(device="cpu", optimizer="nvme", nvme_path="/x"), method="simulate")
    assert nvme.peak_bytes == host.peak_bytes and nvme.nvme_bytes == 3 * 2 * 2 * 4096
    assert host.host_exact_bytes - nvme.host_exact_bytes == 3 * 2 * BLOCK - 2 * 2 * BLOCK
    assert nvme.host_bytes - host.host_bytes == 2 * 2 * BLOCK - 3 * 2 * BLOCK  # slots pinned at their size
    assert host.host_bytes_step_in_backward == host.host_bytes - 2 * BLOCK  # as analytic: one gradient buffer


def test_nvme_step_time() -> None:
    """Each step reads and writes the NVMe groups' state once, not overlapped with compute."""
    plan = fl.plan_config(toy(), _config(device="cpu", optimizer="nvme", nvme_path="/x"))
    sent = comm_bytes(plan, 4)
    assert sent.nvme_bytes == 3 * 2 * 2 * BLOCK and comm_bytes(plan, 4, optimizer="sgd").nvme_bytes == 3 * 2 * BLOCK
    assert comm_bytes(fl.plan_config(toy(), _config(device="cpu")), 4).nvme_bytes == 0
    common = {"params": 1e6, "tokens_per_gpu": 256, "world_size": 4, "link": "nvlink4", "gpu": "h100", "comm": sent}
    timed = step_time(**common)
    assert timed.nvme_s == pytest.approx(sent.nvme_bytes / (NVME_GB_PER_S * 1e9))
    assert timed.step_s == pytest.approx(timed.compute_s + timed.exposed_comm_s + timed.nvme_s)
    assert step_time(**common, nvme_gb_per_s=NVME_GB_PER_S / 4).nvme_s == pytest.approx(4 * timed.nvme_s)


def test_explain_shows_the_optimizer_state_placement(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "nvme.yaml"
    path.write_text(
        "wrap:\n  - match: {class: Block}\n    offload: {device: cpu, optimizer: nvme, nvme_path: /mnt/nvme0}\n"
        "offload: {device: cpu}\n"
    )
    argv = ["explain", str(path), "--model", "fsdp2lite.models:gpt_small", "--world-size", "4", "--all"]
    assert main(argv) == 0
    out = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert out.count("optimizer state: nvme (/mnt/nvme0: one file per rank") == 4  # gpt_small's four blocks
    assert out.count("optimizer state: host memory") == 1  # the root


ESTIMATE = ["estimate", "--model", "test_estimate_nvme:toy", "--inputs", "test_estimate_nvme:toy_inputs"]
NO_CONTEXT = ["--cuda-context", "0"]  # budgets of a few hundred KiB: the toy's own bytes, no CUDA context taken off


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any], str]:
    sys.modules.setdefault("test_estimate_nvme", sys.modules[__name__])
    code = main([*ESTIMATE, "--world-size", "4", "--method", "analytic", "--json", *argv])
    captured = capsys.readouterr()
    return code, json.loads(captured.out), " ".join(captured.err.replace("│", " ").split())


def test_cli_host_and_nvme_per_machine(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "nvme.yaml"
    path.write_text("wrap:\n  - match: {class: Block}\n    offload: {device: cpu, optimizer: nvme, nvme_path: /x}\n")
    code, record, out = _cli(["--config", str(path)], capsys)
    expected = _estimate(fl.FSDPConfig.from_yaml(path))
    assert code == 0 and record["nvme_bytes"] == expected.nvme_bytes and record["ranks_per_node"] == 4
    assert record["host_bytes_per_machine"] == 4 * expected.host_bytes
    assert record["host_exact_bytes_per_machine"] == 4 * expected.host_exact_bytes
    assert record["nvme_bytes_per_machine"] == 4 * 49152 and record["host_fits"] is True
    assert "NVMe (optimizer state) 48.0 KiB" in out and "NVMe per machine: 192.0 KiB" in out
    assert "4 ranks per machine (assumed: min(world size, 8); --ranks-per-node)" in out
    code, record, out = _cli(["--config", str(path), "--ranks-per-node", "2", "--host-ram", "1KiB"], capsys)
    assert code == 0 and record["host_fits"] is False and "(assumed: min" not in out
    needed = f"{2 * expected.host_bytes / 1024:,.1f} KiB"
    assert f"over --host-ram: {needed} needed, 1.0 KiB per machine" in out


def test_budget_searches_per_group_and_nvme(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Between the reserved peak with every block offloaded and without offload, the search adds the fewest
    largest groups that fit; under a --host-ram that every-group offload exceeds, their NVMe variants; the
    written per-group config offloads exactly those groups."""
    out_path = tmp_path / "chosen.yaml"
    # 430,000 bytes for the settings once a twentieth is kept free beside them (estimate_search.room)
    argv = ["--budget", "452632", "--host-ram", "200000", "--ranks-per-node", "4", "--write-config", str(out_path)]
    argv += NO_CONTEXT
    code, record, out = _cli(argv, capsys)
    assert code == 0
    tried = record["budget"]["tried"]
    grouped = [row for row in tried if isinstance(row["offload_groups"], int)]
    on_nvme = [row for row in tried if row["optimizer_state"] == "nvme"]
    assert grouped and all(1 <= row["offload_groups"] <= 3 and row["offload"] for row in grouped)
    every = max(row["host_bytes_per_machine"] for row in tried if row["offload_groups"] == "all")
    assert all(row["host_bytes_per_machine"] < every for row in grouped)  # fewer groups, less host memory
    assert on_nvme and all(row["nvme_bytes"] > 0 and row["nvme_path"] == "/local/nvme" for row in on_nvme)
    assert all(row["nvme_bytes_per_machine"] == 4 * row["nvme_bytes"] for row in tried)
    assert not [row for row in tried if row["optimizer_state"] == "host" and row["offload"] and row["nvme_bytes"]]
    choice = record["budget"]["choice"]
    assert choice["offload_groups"] == 2 and "of the 2 largest groups" in out, out
    assert [row for row in tried if row["device_fits"] and not row["host_fits"] and not row["fits"]]
    written = fl.FSDPConfig.from_yaml(out_path)
    offloaded = [g.paths for g in fl.plan_config(toy(), written).groups if g.policy.offload.device == "cpu"]
    assert len(offloaded) == 2 and written.offload.device == "none" and written.offload.budget is None


def test_nvme_written_with_its_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A row with its optimizer state on NVMe becomes a config with that state on NVMe at the row's nvme_path
    (``--nvme-path``), which the estimate counts."""
    from fsdp2lite.cli.estimate_search import config_for_setting

    code, record, _ = _cli(["--budget", "1GiB", "--ranks-per-node", "4"], capsys)
    row = next(r for r in record["budget"]["tried"] if r["offload"] is True and r["activation_checkpointing"])
    nvme = config_for_setting(fl.FSDPConfig(), {**row, "optimizer_state": "nvme", "nvme_path": "/scratch"})
    assert nvme.offload.optimizer == "nvme" and nvme.offload.nvme_path == "/scratch"
    assert _estimate(nvme).nvme_bytes > 0


def test_host_ram_nothing_fits_says_both_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    code, record, out = _cli(["--budget", "430000", "--host-ram", "1KiB", "--ranks-per-node", "4", *NO_CONTEXT], capsys)
    assert code == 1 and record["budget"]["fits"] is False
    fitting = [row for row in record["budget"]["tried"] if row["device_fits"]]
    least = min(row["host_bytes_per_machine"] for row in fitting)
    assert re.search(
        rf"nothing tried fits 419\.9 KiB of device memory and 1\.0 KiB of host memory per machine: {len(fitting)} "
        rf"fit the device, and the least host memory per machine among them is {least / 1024:,.1f} KiB .*over "
        r"--host-ram 1\.0 KiB",
        out,
    ), out


def test_host_ram_must_be_a_size(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*ESTIMATE, "--world-size", "4", "--host-ram", "lots"]) == 2
    assert "argument --host-ram: expected a size" in capsys.readouterr().err
