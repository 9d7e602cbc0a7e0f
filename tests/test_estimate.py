"""``fl.estimate_memory`` and ``fsdp2lite estimate``: estimates against what real ranks measure.

``simulate`` against torch's MemTracker on real gloo ranks (every rank: uneven shards differ), within
5%; ``analytic`` against ``simulate`` at world sizes 1, 8, 64 and 1024, within 15%; the CLI's table,
JSON, budget search and written config; the bad inputs. benchmarks/bench_estimate.py runs the whole
matrix (world 2 and 4, both configs of bench_step) and saves the numbers.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _dist import spawn
from torch.distributed._tools.mem_tracker import MemTracker

import fsdp2lite as fl
from fsdp2lite.cli import main
from fsdp2lite.estimate import BREAKDOWN_KEYS, make_optimizer
from fsdp2lite.models import GPT, GPTConfig

GPT_SHAPE = GPTConfig(vocab_size=1024, seq_len=64, d_model=128, n_heads=4, n_layers=3, tie_embeddings=True)
PARAMS_SHAPE = GPTConfig(vocab_size=256, seq_len=16, d_model=384, n_heads=4, n_layers=3, tie_embeddings=True)
BATCH = {"gpt": 4, "params": 1}
BF16 = {"param_dtype": "bf16", "reduce_dtype": "fp32"}


def shape_of(name: str) -> GPTConfig:
    return GPT_SHAPE if name == "gpt" else PARAMS_SHAPE


def config_for(bf16: bool, reshard: bool, checkpointing: bool = False) -> fl.FSDPConfig:
    return fl.FSDPConfig.model_validate(
        {
            "wrap": [{"match": {"class": "Block"}, "activation_checkpointing": checkpointing}],
            "reshard_after_forward": reshard,
            "mixed_precision": BF16 if bf16 else {},
        }
    )


def measured_peak(rank: int, name: str, bf16: bool, reshard: bool, checkpointing: bool = False) -> int:
    """Real gloo ranks: the model sharded by the config, two steps, MemTracker on the second."""
    torch.manual_seed(0)
    cfg = shape_of(name)
    model = fl.apply_config(GPT(cfg), config_for(bf16, reshard, checkpointing))
    opt = make_optimizer("adamw", model, "cpu")
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH[name], cfg.seq_len + 1), generator=g)

    def step() -> None:
        model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
        opt.step()
        opt.zero_grad()

    step()
    gc.collect()
    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        step()
    return sum(snap["Total"] for snap in tracker.get_tracker_snapshot("peak").values())


CASES = [  # shape, bf16, reshard_after_forward, activation checkpointing
    ("gpt", False, True, False),
    ("gpt", True, True, False),
    ("gpt", False, True, True),
    ("params", False, False, False),
    ("params", True, True, True),
]


def run_measurements(rank: int, ws: int, out: str) -> None:
    peaks = {f"{case}": measured_peak(rank, *case) for case in CASES}
    Path(out, f"rank{rank}.json").write_text(json.dumps(peaks))


@pytest.mark.parametrize("world_size", [3])
def test_simulate_within_5_percent_of_real_ranks(world_size: int, tmp_path: Path) -> None:
    """Every case on every rank (world 3: uneven shards, so ranks differ; bench_estimate.py runs world
    2 and 4 on bench_step's larger shapes)."""
    spawn(run_measurements, world_size, str(tmp_path))
    for rank in range(world_size):
        measured = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for case in CASES:
            name, bf16, reshard, checkpointing = case
            estimate = fl.estimate_memory(
                functools.partial(GPT, shape_of(name)),
                config_for(bf16, reshard, checkpointing),
                world_size=world_size,
                rank=rank,
                batch=BATCH[name],
                device="cpu",
            )
            real = measured[f"{case}"]
            assert abs(estimate.peak_bytes - real) <= 0.05 * real, (case, rank, estimate.peak_bytes, real)
            assert sum(estimate.breakdown.values()) == estimate.peak_bytes
            assert set(estimate.breakdown) == set(BREAKDOWN_KEYS)


BENCH_SHAPES = {  # benchmarks/bench_step.py's two configs
    "gpt": (GPTConfig(vocab_size=8192, seq_len=256, d_model=512, n_heads=8, n_layers=4, tie_embeddings=True), 4),
    "params": (GPTConfig(vocab_size=1024, seq_len=64, d_model=1024, n_heads=8, n_layers=4, tie_embeddings=True), 1),
}


@pytest.mark.parametrize("name", ["gpt", "params"])
def test_analytic_within_15_percent_of_simulate(name: str) -> None:
    """bench_step's two shapes, fp32 at world sizes 1, 8, 64, 1024 and bf16 at 8 and 1024, last rank."""
    shape, batch = BENCH_SHAPES[name]
    for bf16, sizes in ((False, (1, 8, 64, 1024)), (True, (8, 1024))):
        config = config_for(bf16, True)
        for world_size in sizes:
            kwargs = {"world_size": world_size, "rank": world_size - 1, "batch": batch}
            simulated = fl.estimate_memory(functools.partial(GPT, shape), config, **kwargs)
            analytic = fl.estimate_memory(functools.partial(GPT, shape), config, method="analytic", **kwargs)
            ratio = analytic.peak_bytes / simulated.peak_bytes
            assert 0.85 <= ratio <= 1.15, (name, bf16, world_size, ratio)
            assert sum(analytic.breakdown.values()) == analytic.peak_bytes
            assert analytic.notes and analytic.notes[0].startswith("peak = ")


def test_estimate_follows_the_settings() -> None:
    """What the estimate says moves the way the runtime does: more ranks, less per rank; bf16 less;
    the default config is one group per Block (the same peak as that config written out)."""
    build = functools.partial(GPT, GPT_SHAPE)
    small = fl.estimate_memory(build, config_for(False, True), world_size=64, batch=4)
    large = fl.estimate_memory(build, config_for(False, True), world_size=2, batch=4)
    half = fl.estimate_memory(build, config_for(True, True), world_size=64, batch=4)
    assert small.peak_bytes < large.peak_bytes and half.peak_bytes < small.peak_bytes
    assert small.breakdown["params"] < large.breakdown["params"]
    checkpointed = fl.estimate_memory(build, config_for(False, True, True), world_size=64, batch=4)
    assert checkpointed.breakdown["activations"] < small.breakdown["activations"]
    analytic = fl.estimate_memory(build, config_for(False, True, True), world_size=64, batch=4, method="analytic")
    assert 0.85 <= analytic.peak_bytes / checkpointed.peak_bytes <= 1.15
    default = fl.estimate_memory(build, world_size=64, batch=4)
    written = fl.estimate_memory(
        build, fl.FSDPConfig.model_validate({"wrap": [{"match": {"class": "Block"}}]}), world_size=64, batch=4
    )
    assert default.peak_bytes == written.peak_bytes
    assert default.phase in ("forward", "backward", "optimizer")
    assert json.loads(json.dumps(default.to_json()))["peak_bytes"] == default.peak_bytes


class Regressor(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))
        return x


def regressor_inputs() -> tuple[torch.Tensor]:
    return (torch.randn(32, 64),)


def test_other_models_take_inputs() -> None:
    estimate = fl.estimate_memory(Regressor, world_size=4, inputs=regressor_inputs)
    assert estimate.breakdown["activations"] > 0 and estimate.peak_bytes > 0
    with pytest.raises(ValueError, match=r"Regressor is not a token model.*inputs=\.\.\."):
        fl.estimate_memory(Regressor, world_size=4)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"world_size": 0}, ValueError, r"world_size must be an int >= 1, got 0"),
        ({"world_size": 4, "rank": 4}, ValueError, r"rank must be in 0 .. 3 for world_size 4, got 4"),
        ({"world_size": 4, "method": "guess"}, ValueError, r"method must be one of simulate, analytic; got 'guess'"),
        ({"world_size": 4, "optimizer": "adam"}, ValueError, r"optimizer must be one of adamw, sgd, none; got 'adam'"),
        ({"world_size": 4, "device": "tpu"}, ValueError, r"device must be one of cuda, cpu; got 'tpu'"),
        ({"world_size": 4, "seq": 10_000}, ValueError, r"seq=10000 is longer than the model's seq_len \(64\)"),
        ({"world_size": 4, "config": "x.yaml"}, TypeError, r"config must be an FSDPConfig or None, got str"),
    ],
)
def test_bad_arguments(kwargs: dict, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        fl.estimate_memory(functools.partial(GPT, GPT_SHAPE), **kwargs)


def test_not_inside_a_process_group() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match=r"runs its own simulated process group.*method='analytic'"):
            fl.estimate_memory(functools.partial(GPT, GPT_SHAPE), world_size=4)
        assert fl.estimate_memory(functools.partial(GPT, GPT_SHAPE), world_size=4, method="analytic").peak_bytes > 0
    finally:
        dist.destroy_process_group()


# ---- the CLI ---------------------------------------------------------------------------------------

MODEL = "test_estimate:small_gpt"


def small_gpt() -> GPT:
    return GPT(GPT_SHAPE)


def test_cli_table_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--model", MODEL, "--world-size", "8", "--batch", "4", "--json"]) == 0
    captured = capsys.readouterr()
    record, out = json.loads(captured.out), captured.err  # --json: the JSON alone on stdout, the text on stderr
    assert set(record) >= {"world_size", "rank", "peak_bytes", "phase", "breakdown", "method"}
    assert record["world_size"] == 8 and record["method"] == "simulate"
    assert sum(record["breakdown"].values()) == record["peak_bytes"]
    assert "activations" in out and "peak" in out


def test_cli_budget_writes_a_config_that_applies(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    full = fl.estimate_memory(small_gpt, config_for(False, True), world_size=8, batch=4, method="analytic").peak_bytes
    out_path = tmp_path / "fits.yaml"
    budget = str(int(full * 0.8))  # fp32 does not fit, bf16 does
    argv = ["estimate", "--model", MODEL, "--world-size", "8", "--batch", "4", "--method", "analytic"]
    argv += ["--cuda-context", "0"]  # a budget of a few MiB: the model's own figures, no context taken off
    assert main([*argv, "--budget", budget, "--write-config", str(out_path), "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    choice = record["budget"]["choice"]
    assert choice["mixed_precision"] == "bf16" and choice["peak_bytes"] <= int(budget)
    tried = record["budget"]["tried"]
    assert all(row["comm_bytes"] >= choice["comm_bytes"] for row in tried if row["fits"])
    assert {row["reshard_after_forward"] for row in tried} == {False, True, 2}  # k = 2 for 8 ranks
    assert {row["offload"] for row in tried} == {False, "optimizer", True}  # none, ZeRO-Offload, full
    same = [r for r in tried if r["mixed_precision"] == "fp32" and r["reshard_after_forward"] is True]
    rows = {r["offload"]: r for r in same if r["forward_prefetch_depth"] == 1 and not r["activation_checkpointing"]}
    assert rows[True]["peak_bytes"] < rows["optimizer"]["peak_bytes"] < rows[False]["peak_bytes"]
    assert rows["optimizer"]["host_bytes"] == rows[True]["host_bytes"] > 0 == rows[False]["host_bytes"]
    assert {row["activation_checkpointing"] for row in tried} == {False, True}
    by_reshard = {row["reshard_after_forward"]: row["comm_bytes"] for row in tried if row["mixed_precision"] == "fp32"}
    assert by_reshard[False] < by_reshard[2] < by_reshard[True]  # backward all-gather over 0, 2 or 8 ranks
    assert main(["validate", str(out_path)]) == 0
    written = fl.FSDPConfig.from_yaml(out_path)
    assert written.mixed_precision.param_dtype == torch.bfloat16
    assert fl.estimate_memory(small_gpt, written, world_size=8, batch=4, method="analytic").peak_bytes <= int(budget)
    assert main([*argv, "--budget", "1KiB"]) == 1  # nothing fits
    assert "nothing tried fits" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--budget", "lots"], r"expected a size: .*e\.g\. 256GiB"),
        (["--host-ram", "a lot", "--budget", "1GiB"], r"argument --host-ram: expected a size"),
        (["--link", "pcie9"], r"unknown link 'pcie9'; valid links: pcie4, pcie5, nvlink4, ib200, eth100"),
        (["--gpu", "tpu"], r"unknown gpu 'tpu'; valid gpus: rtx4090, a100, h100, h200"),
        (
            ["--finetune", "lora"],
            r"lora targets q_proj, .* match no Linear layer of GPT; its Linear layers are named: ",
        ),
        (["--write-config", "x.yaml"], r"--write-config needs --budget"),
        (["--rank", "9"], r"--rank: must be < --world-size \(8\)"),
        (["--method", "guess"], r"invalid choice: 'guess'"),
    ],
)
def test_cli_bad_flags_exit_2(extra: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    import re

    assert main(["estimate", "--model", MODEL, "--world-size", "8", *extra]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_cli_bad_model_spec_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--model", "nope:nothing", "--world-size", "2"]) == 2
    assert "nope" in capsys.readouterr().err


def test_parse_bytes() -> None:
    from fsdp2lite.cli.estimate import parse_bytes

    assert parse_bytes("80GiB") == 80 * 2**30 and parse_bytes("1.5GB") == 1_500_000_000 and parse_bytes("512") == 512
    assert parse_bytes("2MiB") == 2 * 2**20 and parse_bytes("0.5 KiB") == 512


def test_cpu_offload_moves_shards_grads_and_optimizer_to_the_host() -> None:
    """With offload, the device peak leaves out the shards and their optimizer state (reported as
    host_bytes): device + host is what the same step holds without offload; analytic agrees within 15%."""
    import warnings

    build = functools.partial(GPT, BENCH_SHAPES["params"][0])
    plain = config_for(False, True)
    offload = fl.FSDPConfig.model_validate(
        {**plain.model_dump(mode="json", by_alias=True), "offload": {"device": "cpu"}}
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pin_memory on a CPU simulation
        on_device = fl.estimate_memory(build, plain, world_size=8)
        offloaded = fl.estimate_memory(build, offload, world_size=8)
        analytic = fl.estimate_memory(build, offload, world_size=8, method="analytic")
    assert offloaded.host_bytes > 0 and offloaded.peak_bytes < on_device.peak_bytes
    pageable = fl.FSDPConfig.model_validate(
        {**plain.model_dump(mode="json", by_alias=True), "offload": {"device": "cpu", "pin_memory": False}}
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        unpinned = fl.estimate_memory(build, pageable, world_size=8)
    assert unpinned.peak_bytes == offloaded.peak_bytes
    # pageable: the shards, their sharded gradients (the same bytes: all trained) and the optimizer state
    shards, state = on_device.breakdown["params"], on_device.breakdown["optimizer"]
    assert unpinned.host_bytes == 2 * shards + state, (unpinned.host_bytes, shards, state)
    # pinned: each group's shards and its gradient buffer registered at their exact size, not the pinned
    # allocator's power of two ([Note: one host buffer per group])
    assert offloaded.host_bytes == unpinned.host_bytes
    assert offloaded.breakdown["params"] == 0
    assert 0.85 <= analytic.peak_bytes / offloaded.peak_bytes <= 1.15, (analytic.peak_bytes, offloaded.peak_bytes)
    assert analytic.host_bytes > 0 and any("CPU offload" in note for note in analytic.notes)


def test_the_planners_tracker_keeps_torchs_per_module_peaks() -> None:
    """The tracker the planner traces with updates only the running modules' peaks at each op (torch's walks
    every module it has seen): each module's peak in forward and in backward, the snapshot at it, and the
    step's peak are torch's own, module for module, on a nested model whose blocks peak at different ops."""
    from torch.distributed._tools.mem_tracker import _ModState

    from fsdp2lite.estimate.tracker import local_shard_tracker

    def run(tracker_cm):  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        inner = [
            torch.nn.Sequential(torch.nn.Linear(16, 16 * (i + 1)), torch.nn.Linear(16 * (i + 1), 16)) for i in range(3)
        ]
        model = torch.nn.Sequential(*inner, torch.nn.Linear(16, 4))
        with tracker_cm() as tracker:
            tracker.track_external(model)
            model(torch.randn(8, 16)).square().sum().backward()
            peaks = {
                name: {
                    state: [dict(s) for s in stats.snapshots.get(state, [])]
                    for state in (_ModState.PEAK_FW, _ModState.PEAK_BW)
                }
                for name, module in model.named_modules()
                for m, stats in tracker.memory_tracking.items()
                if m is module
            }
            return peaks, tracker.get_tracker_snapshot("peak")

    def torchs():  # type: ignore[no-untyped-def]
        tracker = MemTracker()
        tracker.__enter__()
        try:
            yield tracker
        finally:
            tracker.__exit__(None, None, None)

    ours, ours_peak = run(local_shard_tracker)
    theirs, theirs_peak = run(contextlib.contextmanager(torchs))
    assert set(ours) == set(theirs) and len(ours) == 11  # the root, 3 blocks of 2 linears, the head
    assert ours == theirs and ours_peak == theirs_peak
    peaks = {max(s[d]["Total"] for s in v[_ModState.PEAK_FW] for d in s) for v in ours.values()}
    assert len(peaks) > 2  # the blocks peak apart: a tracker updating the wrong modules would differ
