"""The benchmark scripts' own logic (not their numbers): flags, schedule variants, ratios, file names."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import fsdp2lite as fl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))  # the scripts import siblings

import bench_step  # noqa: E402


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
