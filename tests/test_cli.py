"""The ``fsdp2lite`` command line: --version, the demo end to end, and bad input (exit 2, no traceback)."""

from __future__ import annotations

import importlib.metadata
import json
import logging
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from _cpu_env import cpu_env

import fsdp2lite
from fsdp2lite.cli import main
from fsdp2lite.cli.demo import make_text, param_bytes, sample_batch
from fsdp2lite.finetune import deps
from fsdp2lite.finetune.deps import EXTRAS, NEEDED
from fsdp2lite.models import GPT, GPTConfig, shard_gpt

# A table row: "│    0 │     10,624 │     21,248 │     0.500 │" (any box characters)
_ROW = re.compile(r"^\W*(\d+)\W+([\d,]+)\W+([\d,]+)\W+(\d+\.\d+)\W*$")


def _run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "fsdp2lite", *args]
    return subprocess.run(command, env=cpu_env(), capture_output=True, text=True, timeout=120)


def _bytes_rows(stdout: str) -> dict[int, tuple[int, int, float]]:
    rows: dict[int, tuple[int, int, float]] = {}
    for line in stdout.splitlines():
        match = _ROW.match(line)
        if match:
            rank, sharded, unsharded, ratio = match.groups()
            rows[int(rank)] = (
                int(sharded.replace(",", "")),
                int(unsharded.replace(",", "")),
                float(ratio),
            )
    return rows


def test_version_subprocess() -> None:
    result = _run_cli("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"fsdp2lite {fsdp2lite.__version__}"


def test_demo_trains_and_reports_half_the_bytes_per_rank() -> None:
    result = _run_cli(
        "demo",
        "--steps",
        "3",
        "--layers",
        "1",
        "--d-model",
        "32",
        "--seq-len",
        "16",
        "--batch",
        "2",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    for step in (1, 2, 3):
        assert re.search(rf"step\s+{step}/3\s+loss \d+\.\d+\s+[\d,]+ tok/s", result.stdout), result.stdout
    rows = _bytes_rows(result.stdout)
    assert sorted(rows) == [0, 1], result.stdout
    unsharded = rows[0][1]
    model = GPT(GPTConfig(vocab_size=256, seq_len=16, d_model=32, n_heads=4, n_layers=1))
    assert unsharded == sum(p.numel() * p.element_size() for p in model.parameters())
    for sharded, rank_unsharded, ratio in rows.values():
        assert rank_unsharded == unsharded
        assert 0.45 <= sharded / unsharded <= 0.55 and ratio == pytest.approx(sharded / unsharded, abs=1e-3)
    assert rows[0][0] + rows[1][0] == unsharded  # the shards partition the model exactly
    assert re.search(r"done: 3 steps, loss \d+\.\d+ -> \d+\.\d+, [\d,]+ tokens/s across 2 ranks", result.stdout)


def test_bad_world_size_exits_2_naming_the_argument() -> None:
    result = _run_cli("demo", "--world-size", "0")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--world-size" in lines[0] and "0" in lines[0], result.stderr


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["demo", "--steps", "-1"], "--steps"),
        (["demo", "--lr", "0"], "--lr"),
        (["demo", "--lr", "fast"], "--lr"),
        (["demo", "--batch", "2.5"], "--batch"),
        (["demo", "--d-model", "30"], "--d-model"),  # not divisible by the 4 heads
        (["demo", "--world-size", "1000"], "--world-size"),
        (["demo", "--seq-len", "100000000"], "--seq-len"),
        (["demo", "--no-such-flag"], "--no-such-flag"),
        (["frobnicate"], "frobnicate"),
        ([], "COMMAND"),
    ],
)
def test_bad_input_returns_2_with_one_line(argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and flag in err[0] and ": error: " in err[0], err


def test_version_in_process(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"fsdp2lite {fsdp2lite.__version__}"


def test_param_bytes_unsharded_and_single_rank(single_rank_pg: None) -> None:
    model = GPT(GPTConfig(vocab_size=256, seq_len=8, d_model=16, n_heads=2, n_layers=2))
    expected = sum(p.numel() * 4 for p in model.parameters())  # float32; tied head counted once
    assert param_bytes(model) == (expected, expected)
    shard_gpt(model)
    assert param_bytes(model) == (expected, expected)  # one rank holds everything


def test_corpus_and_batches_are_deterministic() -> None:
    text = make_text()
    assert text == make_text() and text.isascii() and len(text) > 10_000
    data = torch.arange(100)
    first = sample_batch(data, 4, 8, torch.Generator().manual_seed(3))
    again = sample_batch(data, 4, 8, torch.Generator().manual_seed(3))
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    tokens, targets = first
    assert tokens.shape == targets.shape == (4, 8)
    assert torch.equal(tokens[:, 1:], targets[:, :-1])  # targets are the next bytes


# ---- only their own output (issue 29) ------------------------------------------------------------
def test_import_prints_nothing() -> None:
    done = subprocess.run(
        [sys.executable, "-c", "import fsdp2lite"], env=cpu_env(), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout + done.stderr == "", done.stdout + done.stderr


def test_a_command_prints_only_its_own_output(tmp_path: Path) -> None:
    """An estimate of a Hugging Face model imports transformers, which imports torchao when installed: its
    "Failed to load ..." log lines and torch's pytree warnings must not reach the command's output
    ([Note: quiet commands] in fsdp2lite/quiet.py); the table and the JSON line are all there is."""
    pytest.importorskip("transformers", reason="transformers is not installed: pip install -e '.[dev]'")
    from _models import tiny_llama

    tiny_llama(layers=2).config.save_pretrained(tmp_path / "llama")
    args = ["estimate", "--model", "llama", "--world-size", "2", "--seq", "16", "--method", "analytic", "--json"]
    done = subprocess.run(
        [sys.executable, "-m", "fsdp2lite", *args],
        cwd=tmp_path,
        env=cpu_env(COLUMNS="200"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["world_size"] == 2  # --json: stdout is the JSON object alone
    lines = done.stderr.splitlines()  # and the text answer goes to stderr, with nothing else in it
    assert lines[0].strip() == "llama, world size 2, rank 0", lines[:3]  # the table's title comes first
    assert lines[-1].startswith("step time on h100 (assumed: --gpu)"), lines[-3:]


def test_main_restores_logging_and_warnings(capsys: pytest.CaptureFixture[str]) -> None:
    """The quiet settings last as long as the command: a program calling ``main`` gets its own back."""
    before = (logging.root.manager.disable, list(warnings.filters))
    assert main(["schema"]) == 0
    assert (logging.root.manager.disable, list(warnings.filters)) == before
    capsys.readouterr()


# ---- doctor: the extras and a verdict per job kind ----------------------------------------------------
def _installed(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def test_doctor_lists_the_extras_and_ends_with_a_verdict_per_job_kind() -> None:
    """In a fresh process, as a user runs it: every extra's library with its version (or "not installed"),
    then one line per job kind, from the check the jobs make (require_libraries); importing peft and torchao
    for it prints nothing of theirs ([Note: quiet commands]): no "Failed to load", no pytree warning."""
    done = _run_cli("doctor")
    assert done.returncode == 0 and done.stderr == "", done.stderr
    cells = [[cell.strip() for cell in line.split("│")[1:-1]] for line in done.stdout.splitlines()]
    versions = {row[1]: row[2] for row in cells if len(row) == 4 and row[0] in EXTRAS}  # the extras table's
    assert versions == {package: _installed(package) for packages in EXTRAS.values() for package in packages}
    lines = done.stdout.splitlines()[-len(NEEDED) :]
    assert [line.split(":")[0] for line in lines] == ["train", "lora", "qlora", "offload"], lines
    for line, (kind, needed) in zip(lines, NEEDED.items()):
        if all(_installed(name) != "not installed" for name in needed):
            used = ", ".join(f"{name} {_installed(name)}" for name in needed) or f"torch {torch.__version__}"
            assert line.startswith(f"{kind}: ready ({used}"), line
        else:
            assert line.startswith(f"{kind}: not ready: ") and line.endswith('pip install -e ".[finetune]"'), line
    assert "Failed to load" not in done.stdout and "Enum subclass" not in done.stdout


def test_doctor_verdicts_name_what_is_missing_or_broken(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A library not installed, and one installed whose import fails (a dependency of its own missing): each
    kind's line names it and the install command; the kinds that do not use it stay ready."""
    (tmp_path / "fsdp2lite_broken_lib.py").write_text("import fsdp2lite_absent_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(sys.modules, "torchao", None)  # import raises ModuleNotFoundError, as when not installed
    monkeypatch.setitem(deps.NEEDED, "lora", ("fsdp2lite_broken_lib",))
    monkeypatch.setenv("COLUMNS", "400")
    assert main(["doctor"]) == 0
    lines = capsys.readouterr().out.splitlines()[-len(NEEDED) :]
    assert lines[0] == f"train: ready (torch {torch.__version__})"
    assert lines[1] == (
        "lora: not ready: fsdp2lite_broken_lib installed but failing to import (ModuleNotFoundError: No module "
        "named 'fsdp2lite_absent_dependency'); pip install -e \".[finetune]\""
    )
    assert lines[2] == 'qlora: not ready: torchao not installed; pip install -e ".[finetune]"', lines[2]
    assert lines[3].startswith("offload: ready (")
    with pytest.raises(deps.MissingExtraError, match=r"--finetune qlora needs torchao, not installed: pip"):
        deps.require_libraries("qlora")


def test_the_extras_doctor_lists_are_pyprojects() -> None:
    """deps.EXTRAS names the libraries of pyproject.toml's extras (doctor's table); [dev] holds them all, so the
    tests run with every one."""
    tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")
    extras = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    names = {extra: [re.split(r"[<>=!~; ]", spec)[0] for spec in specs] for extra, specs in extras.items()}
    for extra, packages in EXTRAS.items():
        assert names[extra] == list(packages), (extra, names[extra])
        assert set(packages) <= set(names["dev"]), names["dev"]
    assert set(NEEDED) == {"train", "lora", "qlora", "offload"}
    assert {name for needed in NEEDED.values() for name in needed} <= set(EXTRAS["finetune"])
