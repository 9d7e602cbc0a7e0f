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
    ratio is the median of per-step ratios, and the files carry the numbers. ``--bound``'s all-gathers are a
    step's, in its order, and dispatch exactly the ops the tests pin per unshard; its reduce-scatters are the
    step's, bare."""
    import json

    bench_host.main([
        "--world-size", "4", "--layers", "2", "--d-model", "32", "--heads", "2", "--seq-len", "16",
        "--vocab", "64", "--steps", "3", "--warmup", "1", "--out-dir", str(tmp_path), "--op-times", "--bound",
    ])  # fmt: skip
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    path = result["bound"]  # the root first and kept for backward; the blocks forward, then backward
    assert path["all_gathers"] == ["<root>", "blocks.0", "blocks.1", "blocks.1", "blocks.0"], path["all_gathers"]
    n, r = len(path["all_gathers"]), len(path["reduce_scatter_bytes"])
    pinned = ("aten::empty", "aten::slice", "aten::cat", "c10d::_allgather_base_", "aten::view")
    pinned += ("aten::split_with_sizes_copy",)  # every group here has several parameters: one copy-out each
    assert {op: path["ops_per_step"].get(op) for op in pinned} == dict.fromkeys(pinned, n), path
    assert path["ops_per_step"]["c10d::_reduce_scatter_base_"] == r == 3  # each group's, bare
    assert set(path["ops_per_step"]) == {*pinned, "c10d::_reduce_scatter_base_", "prim::device"}, path
    summed = [(f + c) / t for f, c, t in zip(path["unsharded_ms"], path["collectives_ms"], path["torch_ms"])]
    assert path["ratio_floor_plus_collectives_vs_torch"] == pytest.approx(sorted(summed)[1])
    by_op = {row[0]: row for row in result["op_ms_over_floor"]}  # the runtime's own collectives lead the list
    assert by_op["c10d::_allgather_base_"][4] > 0 == by_op["c10d::_allgather_base_"][5], by_op
    assert all(row[3] == pytest.approx(row[1] - row[2], abs=0.011) for row in by_op.values())
    assert set(result["host_ms"]) == {"fsdp2lite", "torch"} and all(len(v) == 3 for v in result["host_ms"].values())
    ratios = [a / b for a, b in zip(result["host_ms"]["fsdp2lite"], result["host_ms"]["torch"])]
    assert result["ratio_fsdp2lite_vs_torch"] == pytest.approx(sorted(ratios)[1])
    assert result["target"]["ok"] == (result["ratio_fsdp2lite_vs_torch"] <= bench_host.TARGET)
    floor = [a / b for a, b in zip(result["unsharded_ms"], result["host_ms"]["torch"])]  # the unsharded model
    assert len(floor) == 3 and result["ratio_unsharded_vs_torch"] == pytest.approx(sorted(floor)[1])
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


def assert_traced_host_steps(row: dict[str, object]) -> None:
    """step_in_backward's metered step, traced: host steps took time; stepped in backward's thread, all of it is
    backward's (overlapped: what backward's thread waited for them, which may include a copy's wait)."""
    host, exposed = row["traced_host_step_ms"], row["traced_host_exposed_ms"]
    assert isinstance(host, float) and isinstance(exposed, float) and host > 0 and exposed >= 0, row["step"]
    if row["step"] == "in_backward_serial":
        assert exposed == pytest.approx(host, abs=1e-9)


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
        if row["step"].startswith("in_backward"):
            assert row["host_step_ms"] is None and row["rank0_ops_per_host_step"] is None, name
            assert row["grads_mib_after_backward"] == 0 and len(row["param_groups"]) == 2, name  # root, one block
            assert_traced_host_steps(row)
            continue
        assert row["traced_host_step_ms"] is None and row["traced_host_exposed_ms"] is None, name
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


# ---- bench_offload_memory.py --------------------------------------------------------------------------------------

TINY_GPT = ["--layers", "1", "--d-model", "32", "--heads", "2", "--vocab", "64", "--seq-len", "16"]  # every dim even


def test_bench_offload_memory_counts_host_disk_and_nvme_bytes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A tiny CPU run end to end (one spawn of 2 gloo ranks): NVMe reads and writes the whole state every step and
    keeps only the step counters in memory, the same losses bit for bit, shard bytes by the closed form, the disk
    named, the files."""
    import json
    import os

    import bench_offload_memory as bench

    from fsdp2lite.models import GPT, GPTConfig

    nvme_dir = tmp_path / "nvme"
    nvme_dir.mkdir()
    argv = ["--steps", "2", "--warmup", "1", *TINY_GPT, "--nvme-path", str(nvme_dir), "--out-dir", str(tmp_path)]
    record = bench.main(argv)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["runs"] == record["runs"]
    runs = record["runs"]
    assert list(runs) == [setup.name for setup in bench.SETUPS]
    rival, memory, nvme = runs[bench.RIVAL], runs[bench.REFERENCE], runs[bench.NVME]
    state = nvme["nvme_state"]
    assert state > 0 and nvme["nvme_read_per_step"] == nvme["nvme_written_per_step"] == state
    assert nvme["nvme_read_total"] == 2 * state and nvme["nvme_written_total"] == 3 * state  # the first step reads 0
    assert nvme["disk_reserved"] >= state and nvme["staging"] > 0
    assert memory["optimizer_state_in_memory"] == rival["optimizer_state_in_memory"]
    assert nvme["optimizer_state_in_memory"] == memory["optimizer_state_in_memory"] - state  # the step counters
    assert nvme["host_optimizer_bytes"] == nvme["optimizer_state_in_memory"] + nvme["staging"]
    assert all(row["disk_reserved"] == row["staging"] == row["nvme_read_total"] == 0 for row in (rival, memory))
    config = GPTConfig(64, 16, 32, 2, 1, tie_embeddings=True)
    plan = bench.shard_plan(GPT(config), world_size=2)  # global shapes: the same as the sharded model's
    assert memory["shard_host"] == nvme["shard_host"] == plan["fsdp2lite_shards"]  # packed, each 64-byte aligned
    assert rival["shard_host"] == plan["shard_bytes"]  # no padding rows: every dim 0 is even
    assert nvme["max_loss_diff_vs_fsdp2lite"] == 0.0 and record["nvme_bit_for_bit"]
    assert rival["max_loss_diff_vs_fsdp2lite"] < 1e-5 and len(rival["losses"]) == 3
    assert rival["step_vs_torch"] == 1.0 and len(memory["step_ms"]) == 2
    assert record["nvme_disk"]["path"] == os.path.realpath(nvme_dir) and record["nvme_disk"]["fs_type"]
    assert sorted(Path(f).suffix for f in record["files"]) == [".json", ".md"]
    assert "offload-memory-cpu-" in record["files"][0] and "command" in Path(record["files"][1]).read_text()


def test_bench_offload_memory_gpu_half_without_cuda(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--dry-run builds both libraries' plan on meta (one process each); without CUDA the real run refuses with a
    message; the pinned-bytes key is read from either layout of host_memory_stats(); bad flags exit 2."""
    import torch
    from bench_offload_memory import _pow2, allocator_pinned_bytes, main, parse_args

    record = main(["--device", "cuda", "--dry-run", *TINY_GPT])
    assert record["dry_run"] and record["files"] == [] and record["world_size"] == 8
    plans = [record["libraries"][name]["plan"] for name in ("fsdp2lite", "fsdp2lite + step_in_backward", "torch")]
    assert plans[0] == plans[1] == plans[2] and plans[0]["n_params"] == record["n_params"]
    plan = plans[0]
    assert plan["shard_bytes"] <= plan["fsdp2lite_shards"] < plan["shard_bytes"] + 64 * 16  # 16 parameters
    assert plan["torch_shards"] >= plan["shard_bytes"] and plan["torch_grads"] == plan["torch_shards"]
    assert plan["largest_group_grads"] < plan["fsdp2lite_grads"]  # the root's, of 3 groups
    closed = record["closed_form_pinned"]
    assert closed["fsdp2lite + step_in_backward"] == plan["fsdp2lite_shards"] + plan["largest_group_grads"]
    assert record["closed_form_ratios"]["fsdp2lite"] == closed["fsdp2lite"] / closed["torch"]
    assert record["pinned_ratios"] == {"fsdp2lite": None, "fsdp2lite + step_in_backward": None}
    assert record["target"]["ok"] is None
    assert record["libraries"]["torch"]["stepped"]["allocator_bytes"] is None
    assert (_pow2(0), _pow2(1), _pow2(3 * 2**20), _pow2(2**20)) == (0, 1, 4 * 2**20, 2**20)
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA device"):
            main(["--device", "cuda", *TINY_GPT])
    newer = {"allocated_bytes.current": 5, "active_bytes.current": 3}  # torch 2.13: allocated = active + cached
    older = {"allocated_bytes.current": 3, "reserved_bytes.current": 8, "segment.current": 1}
    for stats, expected in ((newer, (5, "allocated_bytes.current")), (older, (8, "reserved_bytes.current"))):
        monkeypatch.setattr(torch.cuda.memory, "host_memory_stats", lambda stats=stats: stats)
        assert allocator_pinned_bytes() == expected
    defaults = parse_args(["--device", "cuda"])
    assert (defaults.world_size, defaults.layers, defaults.d_model, defaults.vocab) == (8, 24, 2048, 50257)
    for argv, needle in ((["--dry-run"], "--dry-run"), (["--world-size", "1"], "--world-size"),
                         (["--nvme-path", "/nonexistent/dir"], "--nvme-path")):  # fmt: skip
        with pytest.raises(SystemExit) as info:
            parse_args(argv)
        assert info.value.code == 2 and needle in capsys.readouterr().err


@pytest.mark.gpu
def test_bench_offload_memory_gpu_half_measures_pinned_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    """On a CUDA machine, a tiny GPT: every library pins; fsdp2lite's registered buffers are exactly the closed form's
    (packed shards plus a gradient buffer per group, or one of the largest group's when stepping in backward)."""
    from bench_offload_memory import main

    record = main(["--device", "cuda", *TINY_GPT, "--no-save"])
    for name in ("fsdp2lite", "fsdp2lite + step_in_backward"):
        mine = record["libraries"][name]["stepped"]
        assert mine["arena_bytes"]["registered"] == mine["registered_bytes"] == record["closed_form_pinned"][name]
    for row in record["libraries"].values():
        assert (
            row["stepped"]["pinned_bytes"] > 0 and row["stepped"]["allocator_bytes"] >= row["built"]["allocator_bytes"]
        )
    best = min(record["pinned_ratios"].values())
    assert best > 0 and record["target"]["ok"] == (best <= 0.6) and record["target"]["value"] == best


# ---- bench_offload.py's fake-world half (the code --device cuda runs on a GPU) --------------------------------------


def test_bench_offload_fake_world_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    """One process, rank 0 of a fake group of 8 on CPU, bf16 parameters, fp32 reduction: every run timed; the fused
    runs call the kernel once per step, the rival steps foreach; gradient shards are exactly an eighth of the fp32
    gradients (every dim 0 divides by 8); no losses (fake collectives move no data); denormals flushed only for the
    run; --device cuda's defaults are the H100 evidence run's 340M GPT, and without CUDA it refuses."""
    import json
    import statistics

    import bench_offload
    import torch
    from _offload_fake import _n_params

    from fsdp2lite.models import GPTConfig

    argv = ["--fake-world", "--steps", "2", "--warmup", "1", *TINY_GPT, "--no-save"]
    record = bench_offload.main(argv)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["runs"] == record["runs"]
    assert (record["backend"], record["device"], record["world_size"], record["files"]) == ("fake", "cpu", 8, [])
    assert record["pin_memory"] is False and record["losses_reported"] is False and record["gpu"] is None
    assert record["n_params"] == _n_params(GPTConfig(64, 16, 32, 2, 1, tie_embeddings=True))
    runs = record["runs"]
    assert list(runs) == [setup.name for setup in bench_offload.SETUPS]
    for name, row in runs.items():
        assert len(row["step_ms"]) == 2 and row["losses"] is None and row["max_loss_diff_vs_torch"] is None, name
        if row["step"].startswith("in_backward"):
            assert row["grads_mib_after_backward"] == 0 and len(row["param_groups"]) == 2, name  # root, one block
            assert_traced_host_steps(row)
            continue
        fused = row["step"] == "fused"
        assert row["param_groups"] == [{"params": 16, "fused": True if fused else None, "foreach": not fused}], name
        assert row["rank0_fused_adamw_calls"] == int(fused), name
        assert row["grads_mib_after_backward"] * 2**20 == record["n_params"] * 4 / 8, name
    fast, torch_row = runs[bench_offload.MAIN], runs[bench_offload.RIVAL]
    ratios = [a / b for a, b in zip(fast["host_step_ms"], torch_row["host_step_ms"], strict=True)]
    assert record["host_step_ratio"] == pytest.approx(statistics.median(ratios))
    assert record["target"]["ok"] == (record["host_step_ratio"] <= bench_offload.TARGET)
    assert torch.tensor([1e-39]).mul(1.0).item() != 0  # subnormals kept again after the run
    cuda = bench_offload.parse_args(["--device", "cuda"])
    assert (cuda.fake_world, cuda.world_size, cuda.d_model, cuda.layers, cuda.seq_len, cuda.batch) == (
        True, 8, 2048, 4, 2048, 4,
    )  # fmt: skip
    config = GPTConfig(cuda.vocab, cuda.seq_len, cuda.d_model, cuda.heads, cuda.layers, tie_embeddings=cuda.tie)
    assert round(_n_params(config) / 1e6, 1) == 339.8  # gpu-2026-11-24's "340M (4 layers)"
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA device"):
            bench_offload.main(["--device", "cuda", *TINY_GPT, "--no-save"])
