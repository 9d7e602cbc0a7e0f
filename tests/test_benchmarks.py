"""The benchmark scripts' own logic (not their numbers): flags, schedule variants, ratios, file names."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import fsdp2lite as fl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))  # the scripts import siblings

import bench_gpu  # noqa: E402
import bench_host  # noqa: E402
import bench_step  # noqa: E402
import bench_zero  # noqa: E402


def test_schedule_flags_become_fsdp2lite_root_settings() -> None:
    assert bench_step.schedule_from(bench_step.parse_args([])) == ()
    args = bench_step.parse_args(["--overlap-reduce-scatter", "true", "--late-backward-prefetch", "false"])
    assert bench_step.schedule_from(args) == (("overlap_reduce_scatter", True), ("late_backward_prefetch", False))
    for key in bench_step.SCHEDULE_KEYS:  # build() calls set_<key> on the root
        assert callable(getattr(fl.FSDPModule, f"set_{key}", None)), key


def test_bad_flags_exit_2_naming_them(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        bench_step.parse_args(["--overlap-reduce-scatter", "maybe"])
    assert info.value.code == 2 and "--overlap-reduce-scatter" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_step.parse_args(["--steps", "0"])


def test_median_ratio_is_per_step() -> None:
    # per-step ratios 2, 0.5, 1 -> median 1; a ratio of medians (2/1) would say 2
    assert bench_step.median_ratio([2.0, 1.0, 3.0], [1.0, 2.0, 3.0]) == 1.0


def test_variant_runs_are_named_by_their_schedule(tmp_path: Path) -> None:
    import datetime

    summary = {
        "config": "params",
        "device": "cpu",
        "about": "x",
        "n_params": 1,
        "batch_per_rank": 1,
        "world_size": 2,
        "steps": 1,
        "warmup": 1,
        "models": {},
        "ratios": {
            key: None
            for key in (
                "step_fsdp2lite_vs_torch",
                "step_fsdp2lite_vs_ddp",
                "peak_total_fsdp2lite_vs_torch",
                "peak_runtime_fsdp2lite_vs_torch",
                "collectives_fsdp2lite_vs_torch",
                "mb_fsdp2lite_vs_torch",
                "fake_pg_step_fsdp2lite_vs_torch",
            )
        },
        "targets": [],
        "fsdp2lite_schedule": {"overlap_reduce_scatter": True},
    }
    env = {
        "machine": {"cpu_model": "cpu", "cpu_count": 2, "platform": "linux"},
        "versions": {"python": "3", "torch": "2", "fsdp2lite": "0"},
        "git": {"commit": "abc", "uncommitted": []},
        "command": "bench",
        "timestamp": "t",
    }
    started = datetime.datetime(2026, 1, 2, 3, 4, 5)
    files = bench_step.save(tmp_path, summary, env, started)
    assert [Path(f).name for f in files] == [
        "params-overlap_reduce_scatter=true-cpu-20260102-030405.json",
        "params-overlap_reduce_scatter=true-cpu-20260102-030405.md",
    ]
    assert "fsdp2lite schedule: {'overlap_reduce_scatter': True}" in Path(files[1]).read_text()


# ---- bench_host.py and bench_gpu.py -------------------------------------------------------------


def test_bench_host_runs_both_libraries_on_fake_tensors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A tiny run end to end: both libraries step under FakeTensorMode on the fake process group, the
    ratio is the median of per-step ratios, and the files carry the numbers."""
    import json

    bench_host.main([
        "--world-size", "4", "--layers", "2", "--d-model", "32", "--heads", "2", "--seq-len", "16",
        "--vocab", "64", "--steps", "3", "--warmup", "1", "--out-dir", str(tmp_path),
    ])  # fmt: skip
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(result["host_ms"]) == {"fsdp2lite", "torch"} and all(len(v) == 3 for v in result["host_ms"].values())
    ratios = [a / b for a, b in zip(result["host_ms"]["fsdp2lite"], result["host_ms"]["torch"])]
    assert result["ratio_fsdp2lite_vs_torch"] == pytest.approx(sorted(ratios)[1])
    assert result["target"]["ok"] == (result["ratio_fsdp2lite_vs_torch"] <= bench_host.TARGET)
    assert sorted(Path(f).suffix for f in result["files"]) == [".json", ".md"]
    assert json.loads(Path(result["files"][0]).read_text())["world_size"] == 4


def test_bench_host_rejects_bad_flags(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, needle in ((["--layers", "0"], "--layers"), (["--d-model", "30", "--heads", "4"], "multiple of")):
        with pytest.raises(SystemExit) as info:
            bench_host.parse_args(argv)
        assert info.value.code == 2 and needle in capsys.readouterr().err


def test_bench_gpu_presets_and_flags(capsys: pytest.CaptureFixture[str]) -> None:
    args = bench_gpu.parse_args(["--runs", "w8, w64", "--dtypes", "bf16,fp32"])
    assert args.runs == ["w8", "w64"] and args.dtypes == ["bf16", "fp32"]
    assert bench_gpu.parse_args([]).runs == ["w1", "w8", "w64"]  # the three shapes of issue 10

    def shape(name: str) -> tuple[object, ...]:
        run = bench_gpu.RUNS[name]
        return (run.mode, run.world_size, run.model.d_model, run.model.n_layers, run.model.seq_len, run.batch)

    assert shape("w8") == ("fake", 8, 2048, 16, 2048, 4)
    assert shape("w64") == ("fake", 64, 4096, 8, 4096, 1)
    assert bench_gpu.RUNS["w1"].mode == "real" and bench_gpu.RUNS["w1"].world_size == 1
    for argv, needle in ((["--runs", "w9"], "w9"), (["--dtypes", "fp8"], "fp8"), (["--steps", "1"], "--steps")):
        with pytest.raises(SystemExit) as info:
            bench_gpu.parse_args(argv)
        assert info.value.code == 2 and needle in capsys.readouterr().err
    assert bench_gpu.median_ratio([2.0, 1.0, 3.0], [1.0, 2.0, 3.0]) == 1.0


@pytest.mark.gpu
def test_bench_gpu_tiny_run(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    bench_gpu.main(["--runs", "tiny", "--dtypes", "bf16,fp32", "--steps", "2", "--warmup", "1", "--no-save"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [(r["run"], r["dtype"]) for r in result["runs"]] == [("tiny", "bf16"), ("tiny", "fp32")]
    for run in result["runs"]:
        assert run["time_ratio"] > 0 and run["mem_ratio"] > 0


# ---- bench_zero.py ------------------------------------------------------------------------------


def test_bench_zero_reports_what_fsdp2lite_has_not_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ValueError saying "not built" (HFSDP until it exists) makes a row unavailable and the rest go on;
    any other ValueError is a bug, raised."""
    import torch

    def build(strategy: bench_zero.Strategy, shape: bench_zero.Shape, meshes: dict) -> bench_zero.Run:
        if strategy.name == "HFSDP":
            raise ValueError("replicate: optimizer (HFSDP) is not built yet")
        model = bench_zero.MLPStack(shape)  # unsharded: no process group needed
        return bench_zero.Run(model, torch.optim.AdamW(model.parameters()), [])

    monkeypatch.setattr(bench_zero, "build", build)
    shape = bench_zero.Shape(hidden=8, layers=1, batch=2)
    runs, unavailable = bench_zero.prepare_all(shape, {}, bench_zero.make_batch(shape, rank=0))
    assert list(unavailable) == ["HFSDP"] and "not built" in unavailable["HFSDP"]
    assert len(runs) == len(bench_zero.STRATEGIES) - 1 and all(len(run.losses) == 1 for run in runs.values())

    def broken(*args: object) -> bench_zero.Run:
        raise ValueError("mesh replicate(3) * shard(2) != world_size(4)")

    monkeypatch.setattr(bench_zero, "build", broken)
    with pytest.raises(ValueError, match="world_size"):
        bench_zero.prepare_all(shape, {}, bench_zero.make_batch(shape, rank=0))


def test_bench_zero_runs_every_strategy_on_4_ranks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A tiny run end to end (one spawn of 4 gloo ranks): every row measured or missing for "not built",
    the same losses, the byte counter agreeing with fsdp2lite's own, ZeRO-1/2's trade-off, the files."""
    import json

    record = bench_zero.main([
        "--steps", "2", "--warmup", "1", "--hidden", "16", "--layers", "2", "--batch", "4", "--out-dir", str(tmp_path),
    ])  # fmt: skip
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["strategies"] == record["strategies"]
    rows = record["strategies"]
    assert list(rows) == [s.name for s in bench_zero.STRATEGIES]
    assert all(row["available"] or "not built" in row["reason"] for row in rows.values())
    zero3, zero12 = rows["ZeRO-3"], rows["ZeRO-1/2"]
    assert zero12["losses"] == zero3["losses"] and len(zero3["losses"]) == 1 + 2 + 2  # warm-up, steps, 2 meters
    for name, row in rows.items():
        if row["available"]:
            assert row["max_loss_diff_vs_zero3"] < 1e-5, name
        if row["available"] and row["library"] == "fsdp2lite":
            assert sum(row["rank0_sent_mb_by_kind"].values()) == pytest.approx(row["rank0_own_count_mb"]), name
    # ZeRO-1/2: fewer bytes sent (one all-gather per step), the unsharded parameters resident between steps
    assert zero12["sent_mb"] < zero3["sent_mb"] and zero12["params_mib"] > zero3["params_mib"]
    assert zero12["optim_mib"] == zero3["optim_mib"] == rows["torch ZeRO-3"]["optim_mib"]
    missing = {**rows, "HFSDP": {**rows["HFSDP"], "available": False, "reason": "ValueError: not built"}}
    table = bench_zero.table_rows({**record, "strategies": missing})
    assert table[3][:3] == ["HFSDP", "2x2", bench_zero.UNAVAILABLE]
    assert sorted(Path(f).suffix for f in record["files"]) == [".json", ".md"]
    assert "zero-cpu-" in record["files"][0] and "command" in Path(record["files"][1]).read_text()


# ---- bench_offload.py ---------------------------------------------------------------------------


def test_bench_offload_runs_both_libraries_with_offload(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A tiny run end to end (one spawn of 2 gloo ranks): every run timed; fast_host_step's runs call the fused
    kernel once per step and dispatch fewer ops than the for-loop; step_in_backward leaves no gradient after
    backward; the losses agree; the ratios are medians of per-step ratios; the files carry the numbers."""
    import json
    import statistics

    import bench_offload

    record = bench_offload.main([
        "--steps", "3", "--warmup", "1", "--layers", "1", "--d-model", "32", "--heads", "2", "--vocab", "64",
        "--seq-len", "16", "--out-dir", str(tmp_path),
    ])  # fmt: skip
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["runs"] == record["runs"]
    runs = record["runs"]
    assert list(runs) == [setup.name for setup in bench_offload.SETUPS]
    for name, row in runs.items():
        assert all(group["fused"] is (None if row["step"] == "loop" else True) for group in row["param_groups"]), name
        assert len(row["step_ms"]) == 3 and row["max_loss_diff_vs_torch"] < 1e-5, name
        if row["step"] == "in_backward":
            assert row["host_step_ms"] is None and row["rank0_ops_per_host_step"] is None, name
            assert row["grads_mib_after_backward"] == 0 and len(row["param_groups"]) == 2, name  # root, one block
            continue
        assert row["rank0_fused_adamw_calls"] == int(row["step"] == "fused") and row["grads_mib_after_backward"] > 0
        assert all(h < w for h, w in zip(row["host_step_ms"], row["step_ms"], strict=True)), name
    fast, torch_row = runs[bench_offload.MAIN], runs[bench_offload.RIVAL]
    assert fast["rank0_ops_per_host_step"] < torch_row["rank0_ops_per_host_step"]
    ratios = [a / b for a, b in zip(fast["host_step_ms"], torch_row["host_step_ms"], strict=True)]
    assert record["host_step_ratio"] == pytest.approx(statistics.median(ratios))
    assert record["target"]["ok"] == (record["host_step_ratio"] <= bench_offload.TARGET)
    assert sorted(Path(f).suffix for f in record["files"]) == [".json", ".md"]
    assert "offload-cpu-" in record["files"][0] and "command" in Path(record["files"][1]).read_text()
    for argv, needle in ((["--world-size", "1"], "--world-size"), (["--d-model", "30", "--heads", "4"], "multiple")):
        with pytest.raises(SystemExit) as info:
            bench_offload.parse_args(argv)
        assert info.value.code == 2 and needle in capsys.readouterr().err
