"""benchmarks/_link.py, the emulated network: each collective's charge exact for its kind, an isolated
all-gather and reduce-scatter never done before their charge (a lower bound: the upper one, within 5%, is
bench_link's ``emulator_err``, a timing), the link carrying one collective at a time, and both torch's
fully_shard and fsdp2lite training through it with the losses they have on plain gloo (real data).
One spawn of 2 gloo ranks for everything distributed."""

from __future__ import annotations

import datetime
import os
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import fsdp2lite as fl
from fsdp2lite._spawn import exit_rank_process
from fsdp2lite.estimate.timing import LINKS, Link
from fsdp2lite.models import GPT, GPTConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import _link  # noqa: E402
from _ranks import start_ranks  # noqa: E402

MB = 10**6
# the names both libraries call (torch 2.13 renamed them; 2.11 has only the old ones)
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@pytest.mark.parametrize(
    ("kind", "sent"),  # 4 ranks, a 16 MB buffer: each rank sends 3 of its 4 chunks, twice for an all-reduce
    [("all_gather", 12 * MB), ("reduce_scatter", 12 * MB), ("all_reduce", 24 * MB), ("all_to_all", 12 * MB)],
)
def test_charge_is_latency_plus_ring_bytes_over_bandwidth(kind: str, sent: int) -> None:
    assert _link.ring_bytes(kind, 16 * MB, 4) == sent
    pcie4 = LINKS["pcie4"]  # 25 GB/s, 15 us: the planner's table
    assert _link.charge_s(pcie4, kind, 16 * MB, 4) == pytest.approx(15e-6 + sent / 25e9, rel=1e-12)
    assert _link.charge_s(pcie4, kind, 16 * MB, 4, time_scale=1000) == pytest.approx(1000 * (15e-6 + sent / 25e9))
    assert _link.ring_bytes(kind, 16 * MB, 1) == 0 and _link.charge_s(pcie4, kind, 16 * MB, 1) == 0.0


def test_links_and_kinds_are_named() -> None:
    assert _link.find_link("nvlink4") == Link(370.0, 10.0)
    assert _link.find_link(Link(1.0, 2.0)) == Link(1.0, 2.0)
    with pytest.raises(ValueError, match="unknown link 'pcie9'.*pcie4"):
        _link.find_link("pcie9")
    with pytest.raises(ValueError, match="unknown collective kind 'gather'"):
        _link.ring_bytes("gather", 8, 2)


def test_the_link_carries_one_collective_at_a_time() -> None:
    clock = _link.LinkClock(Link(1.0, 0.0), time_scale=1.0, world_size=2)
    first = clock.take("all_gather", 2 * MB)  # 1 MB sent at 1 GB/s: 1 ms
    second = clock.take("reduce_scatter", 2 * MB)  # issued at once: starts when the first ends
    assert first is not None and second is not None
    assert first.seconds == pytest.approx(1e-3) and second.start == first.end
    assert [c.kind for c in clock.charges] == ["all_gather", "reduce_scatter"]
    assert _link.LinkClock(None, 1.0, 2).take("all_gather", MB) is None  # no link: free of charge


# ---- 2 gloo ranks ---------------------------------------------------------------------------------------------
CONFIG = GPTConfig(vocab_size=256, seq_len=32, d_model=64, n_heads=4, n_layers=2, tie_embeddings=True)


def _losses(library: str, mesh: DeviceMesh, comm: fl.CommPolicy | None = None, steps: int = 3) -> list[float]:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    shard = torch_fully_shard if library == "torch" else fl.fully_shard
    kwargs = {} if library == "torch" else {"comm_policy": comm}
    for module in [*model.blocks, model]:
        shard(module, mesh=mesh, **kwargs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(dist.get_rank())
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.seq_len + 1), generator=gen)
        loss = model.loss(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _check_isolated_collectives(group: _link.LinkGroup, side: dist.ProcessGroup) -> None:
    """Each completes no earlier than its charge (50 ms at this scale); two issued together take both."""
    group.set_link(Link(1.0, 100.0), time_scale=50.0)  # 1 GB/s, 100 us; 4 KB on 2 ranks sends 2 KB
    out, inp = torch.empty(1024), torch.ones(512)  # 4096-byte all-gather output, 4096-byte reduce input
    for kind, issue in (
        ("all_gather", lambda: ALL_GATHER(out, inp, group=group, async_op=True)),
        ("reduce_scatter", lambda: REDUCE_SCATTER(inp, out.fill_(1.0), group=group, async_op=True)),
    ):
        dist.barrier(group=side)
        started = time.perf_counter()
        issue().wait()
        elapsed = time.perf_counter() - started
        charge = group.clock.charges[-1]
        assert (charge.kind, charge.nbytes, charge.ring_bytes) == (kind, 4096, 2048)
        assert charge.seconds == pytest.approx(50 * (100e-6 + 2048 / 1e9))
        assert elapsed >= charge.seconds, (kind, elapsed, charge.seconds)
    assert torch.equal(inp, torch.full((512,), 2.0))  # gloo really reduced: 1 + 1
    dist.barrier(group=side)
    started = time.perf_counter()
    works = [ALL_GATHER(out, inp, group=group, async_op=True) for _ in range(2)]
    for work in works:
        work.wait()
    assert time.perf_counter() - started >= 2 * group.clock.charges[-1].seconds


def _check_both_libraries_train_as_on_gloo(group: _link.LinkGroup, side: dist.ProcessGroup) -> None:
    link_mesh = init_device_mesh("cpu", (dist.get_world_size(),))  # the default group: the emulator
    gloo_mesh = DeviceMesh.from_group(side, "cpu")
    group.set_link("pcie4", time_scale=1.0)
    int8 = fl.CommPolicy(all_gather="int8", reduce_scatter="int8")
    for library, comm in (("torch", None), ("fsdp2lite", None), ("fsdp2lite", int8)):
        before, exposed = len(group.clock.charges), group.exposed_s
        on_link = _losses(library, link_mesh, comm)
        kinds = {charge.kind for charge in group.clock.charges[before:]}
        wanted = {"all_gather", "all_to_all" if comm else "reduce_scatter"}
        assert kinds == wanted, (library, comm, kinds)  # every collective of the step went through the link
        assert group.exposed_s > exposed
        assert on_link == _losses(library, gloo_mesh, comm), (library, comm)


def _rank(rank: int, world_size: int, init_file: str) -> None:
    torch.set_num_threads(1)
    group = _link.init_link_group(
        "gloo", None, rank=rank, world_size=world_size, init_method=f"file://{init_file}",
        timeout=datetime.timedelta(seconds=120),
    )  # fmt: skip
    side = dist.new_group(backend="gloo")  # plain gloo: the reference, and barriers the link never charges
    try:
        assert dist.get_backend() == "link" and group.size() == world_size
        _check_isolated_collectives(group, side)
        _check_both_libraries_train_as_on_gloo(group, side)
        dist.barrier(group=side)
    finally:
        dist.destroy_process_group()
    exit_rank_process()


def test_emulated_gloo_group_charges_and_serves_both_libraries() -> None:
    init_file = os.path.join(tempfile.mkdtemp(prefix="fsdp2lite_link_"), "pg")
    start_ranks(_rank, 2, (2, init_file))  # forked from the suite's fork server (benchmarks/_ranks.py)


# ---- bench_link's own logic (no processes) ---------------------------------------------------------------------
def test_bench_link_flags_name_what_is_wrong(capsys: pytest.CaptureFixture[str]) -> None:
    import bench_link

    args = bench_link.parse_args(["--links", "pcie4, nvlink4", "--steps", "3"])
    assert args.links == ["pcie4", "nvlink4"] and bench_link.setup_from(args).steps == 3
    assert bench_link.setup_from(args).time_scale == bench_link.SETUPS["cpu"].time_scale
    for bad, said in ((["--links", "pcie9"], "unknown link 'pcie9'"), (["--links", "none"], "always runs first"),
                      (["--device", "cuda", "--planner"], "CPU half only")):  # fmt: skip
        with pytest.raises(SystemExit) as info:
            bench_link.parse_args(bad)
        assert info.value.code == 2 and said in capsys.readouterr().err


def test_bench_link_ratios_are_per_step_and_exposed_is_a_share() -> None:
    import bench_link

    def run(steps: list[float], exposed: list[float]) -> dict[str, list[float]]:
        return {"step_s": steps, "exposed_s": exposed, "loss": [0.0] * len(steps)}

    record = {"links": {"none": {"torch": run([1.0, 2.0, 3.0], [0.1, 0.1, 0.1]),
                                 "default": run([2.0, 1.0, 3.0], [1.0, 0.5, 0.3])}}}  # fmt: skip
    cpu = bench_link.summarize(record, "cpu")["none"]["default"]
    assert cpu["ratio"] == 1.0  # per-step ratios 2, 0.5, 1: a ratio of medians would say 1 too, of means 1
    assert cpu["exposed_share"] == 0.5 and cpu["exposed_ms"] == 500.0  # shares 0.5, 0.5, 0.1
    record["links"]["pcie4"] = {"torch": run([2.0, 2.0, 2.0], [0, 0, 0]), "default": run([4.0, 4.0, 4.0], [0, 0, 0])}
    gpu = bench_link.summarize(record, "cuda")["pcie4"]["default"]  # CUDA: the step beyond the same at "none"
    assert gpu["exposed_ms"] == 2000.0 and gpu["exposed_share"] == 0.5 and gpu["ratio"] == 2.0
    record["links"]["pcie4"]["int8 all-gather"] = run([1.0, 1.0, 1.5], [0, 0, 0])  # 0.5, 0.5, 0.75 of torch's
    record["links"]["none"]["int8 all-gather"] = run([1.0, 1.0, 1.0], [0, 0, 0])
    checks = bench_link.targets(bench_link.summarize(record, "cuda"), "cuda")
    assert checks == [{"link": "pcie4", "policy": "int8 all-gather", "ratio": 0.5, "limit": 0.75, "ok": True,
                       "binding": True}]  # fmt: skip
