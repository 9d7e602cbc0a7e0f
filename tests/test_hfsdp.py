"""HFSDP (``ShardingPolicy(replicate="optimizer")`` on a (replicate, shard) mesh): parity with DDP, bit for bit
HSDP's arithmetic, a quarter of the optimizer state per rank on (2, 2) where HSDP holds half, exact wire bytes,
never stale, checkpoints across strategies and world sizes, and the refusals. One spawn of 4 gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _collectives import delayed_collectives, recorded_collectives
from _dist import spawn, spawn_checks
from _models import UnevenMLP, gpt_batch, gpt_loss, mlp_batch, mlp_loss, tiny_gpt
from _parity import full, torch_shard, train_and_compare
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

import fsdp2lite as fl

HFSDP = fl.ShardingPolicy(replicate="optimizer")


def mesh22():
    return fl.init_mesh(replicate=2, shard=2, device_type="cpu")


def shard(sharding: fl.ShardingPolicy | None, mesh=None, **kwargs):
    def apply(model: nn.Module) -> None:
        for block in model.blocks:
            fl.fully_shard(block, mesh or mesh22(), sharding=sharding, **kwargs)
        fl.fully_shard(model, mesh or mesh22(), sharding=sharding, **kwargs)

    return apply


class EvenMLP(nn.Module):
    """Every row count divisible by 4: pieces are exact quarters, so byte counts are exact fractions."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16)) for _ in range(2))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def even_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 16, generator=g), torch.randn(4, 4, generator=g)


def _groups(model: nn.Module) -> list:
    return [m._fsdp_state.group for m in model.modules() if isinstance(m, fl.FSDPModule)]


def _local_bytes(tensors) -> int:
    return sum(t.to_local().nbytes if isinstance(t, DTensor) else t.nbytes for t in tensors)


def scenario_parity_with_ddp(rank: int, ws: int) -> None:
    """fp32, 5 steps on (2, 2): losses, grads and params equal DDP's every step; uneven rows (fewer rows than
    ranks included), accumulation with clipping, and HFSDP with resident parameters (ZeRO-1/2 on both axes)."""
    torch.manual_seed(0)
    train_and_compare(tiny_gpt(), shard(HFSDP), gpt_batch, gpt_loss, rank, steps=5, label="hfsdp gpt")
    torch.manual_seed(1)
    train_and_compare(UnevenMLP(), shard(HFSDP), mlp_batch, mlp_loss, rank, steps=5, label="hfsdp uneven")
    torch.manual_seed(2)
    train_and_compare(
        tiny_gpt(), shard(HFSDP), gpt_batch, gpt_loss, rank, steps=3, microbatches=2, clip_norm=0.05,
        label="hfsdp accumulating, clipped",
    )  # fmt: skip
    both = fl.ShardingPolicy(shard="optimizer", replicate="optimizer")
    torch.manual_seed(3)
    train_and_compare(UnevenMLP(), shard(both), mlp_batch, mlp_loss, rank, steps=4, label="hfsdp + zero-1/2")


def _adamw_pair(extra: dict, build, batch_fn, loss_fn, rank: int, steps: int = 3):
    """HSDP and HFSDP from the same start under AdamW: equal losses every step, bit for bit."""
    torch.manual_seed(0)
    hsdp, hfsdp = build(), build()
    hfsdp.load_state_dict(hsdp.state_dict())
    shard(None, **extra)(hsdp)
    shard(HFSDP, **extra)(hfsdp)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (hsdp, hfsdp)]
    for step in range(steps):
        losses = []
        for model, opt in zip((hsdp, hfsdp), opts):
            loss = loss_fn(model, batch_fn(step, rank))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        assert torch.equal(losses[0], losses[1]), (extra, step, losses)
    for a, b in zip(hsdp.parameters(), hfsdp.parameters()):
        assert torch.equal(full(a), full(b)), extra
    return (hsdp, hfsdp), opts


def scenario_bitwise_hsdp(rank: int, ws: int) -> None:
    """Two replicas sum in one order whichever way the sum is formed: HFSDP steps bit for bit HSDP's, in fp32,
    with bf16 mixed precision, with CPU offload of pieces and optimizer state (ZeRO-Offload's shape), and with
    the all-reduce across replicas skipped for a microbatch (``set_requires_all_reduce(False)``)."""
    bf16 = fl.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for extra in ({}, {"mp_policy": bf16}, {"offload_policy": fl.CPUOffloadPolicy(pin_memory=False)}):
        _adamw_pair(extra, tiny_gpt, gpt_batch, gpt_loss, rank)
    torch.manual_seed(0)
    hsdp, hfsdp = UnevenMLP(), UnevenMLP()
    hfsdp.load_state_dict(hsdp.state_dict())
    shard(None)(hsdp)
    shard(HFSDP)(hfsdp)
    for model in (hsdp, hfsdp):
        model.set_requires_all_reduce(False)
        mlp_loss(model, mlp_batch(0, rank)).backward()
        model.set_requires_all_reduce(True)
        mlp_loss(model, mlp_batch(1, rank)).backward()
    for a, b in zip(hsdp.parameters(), hfsdp.parameters()):
        assert torch.equal(full(a.grad), full(b.grad))


def scenario_bytes(rank: int, ws: int) -> None:
    """Per rank on (2, 2), exactly: HFSDP's optimizer state and registered parameters are 1/4 of the total
    where HSDP's are 1/2, its gradients too (as ZeRO-3's and ZeRO-1/2's on 4 ranks, ZeRO-1/2 keeping the whole
    parameters besides); one replica all-gather per group per step, of the pieces."""
    (hsdp, hfsdp), (hsdp_opt, hfsdp_opt) = _adamw_pair({}, EvenMLP, even_batch, mlp_loss, rank, steps=2)
    total = sum(p.numel() * 4 for p in EvenMLP().parameters())
    for model, opt, replicas in ((hsdp, hsdp_opt, 2), (hfsdp, hfsdp_opt, 1)):
        mlp_loss(model, even_batch(5, rank)).backward()
        state = [t for s in opt.state.values() for t in s.values() if t.dim() > 0]  # exp_avg, exp_avg_sq
        assert _local_bytes(state) == 2 * total * replicas // 4, (replicas, _local_bytes(state))
        assert _local_bytes(model.parameters()) == total * replicas // 4
        assert _local_bytes(p.grad for p in model.parameters()) == total * replicas // 4
        model.zero_grad()
    for sharding, resident in ((None, 0), (fl.ShardingPolicy(shard="optimizer"), total)):  # the 1-D stages
        torch.manual_seed(0)
        model = EvenMLP()
        shard(sharding, fl.init_mesh(device_type="cpu"))(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        mlp_loss(model, even_batch(0, rank)).backward()
        opt.step()
        state = [t for s in opt.state.values() for t in s.values() if t.dim() > 0]
        assert _local_bytes(state) == 2 * total // 4  # ZeRO-1/2 and ZeRO-3: a quarter, as HFSDP on (2, 2)
        kept = sum(p.unsharded.unsharded_flat.untyped_storage().nbytes() for g in _groups(model) for p in g.params)
        assert kept == resident, (sharding, kept)  # ZeRO-1/2 keeps every parameter whole between steps
    groups = _groups(hfsdp)
    batch = even_batch(6, rank)
    with torch.no_grad():
        mlp_loss(hfsdp, batch)  # gathers what the last backward made stale: from here, one step
    before = [group.replicas.gathers for group in groups]
    with torch.no_grad(), fl.count_wire_bytes(hsdp) as forward_only:
        mlp_loss(hsdp, batch)
    with fl.count_wire_bytes(hsdp) as hsdp_sent:
        mlp_loss(hsdp, batch).backward()
    with fl.count_wire_bytes(hfsdp) as sent:
        mlp_loss(hfsdp, batch).backward()  # gradients reduced into the pieces: the next forward gathers
        hfsdp_opt.step()
        with torch.no_grad():
            mlp_loss(hfsdp, batch)
    assert [group.replicas.gathers for group in groups] == [b + 1 for b in before]
    assert sent["replica_all_gather"] == total // 4  # each rank's quarter, sent to its one other replica
    assert sent["all_gather"] == hsdp_sent["all_gather"] + forward_only["all_gather"]  # the shard axis: as HSDP
    assert sent["replica_all_reduce"] == hsdp_sent["replica_all_reduce"]  # gloo's reduce-scatter is an all-reduce
    with torch.no_grad(), fl.count_wire_bytes(hfsdp) as idle:
        mlp_loss(hfsdp, batch)  # nothing changed since the last gather
    assert "replica_all_gather" not in idle


def scenario_never_stale(rank: int, ws: int) -> None:
    """Every change to the pieces reaches the next forward: a step, copy_, a sharded and a full
    load_state_dict, a write through .data after model.reshard(); and a model built on meta, loaded whole."""
    torch.manual_seed(0)
    model, ref = UnevenMLP(), UnevenMLP()
    ref.load_state_dict(model.state_dict())
    shard(HFSDP)(model)
    batch = mlp_batch(0, rank)

    def same() -> None:
        with torch.no_grad():
            torch.testing.assert_close(mlp_loss(model, batch), mlp_loss(ref, batch), rtol=1e-5, atol=1e-6)

    same()
    with torch.no_grad():
        for param, ref_param in zip(model.parameters(), ref.parameters()):
            ref_param.mul_(0.5)
            param.copy_(_like(param, ref_param))
    same()
    state = {k: v * 2 for k, v in ref.state_dict().items()}
    ref.load_state_dict(state)
    model.load_state_dict({k: _like(model.get_parameter(k), v) for k, v in state.items()})
    same()
    ref.load_state_dict({k: v + 1 for k, v in state.items()})
    model.load_state_dict({k: v + 1 for k, v in state.items()})  # full tensors: each rank takes its piece
    same()
    with torch.no_grad():
        for param, ref_param in zip(model.parameters(), ref.parameters()):
            ref_param.add_(1.0)
            param.data.to_local().add_(1.0)  # bypasses the version counters ...
    model.reshard()  # ... so the chunks are gathered anew
    same()
    with torch.device("meta"):
        model = UnevenMLP()
    shard(HFSDP)(model)
    model.to_empty(device="cpu")
    model.load_state_dict(ref.state_dict())
    same()


def _like(param: DTensor, value: torch.Tensor) -> DTensor:
    """``value`` placed as ``param`` is (``distribute_tensor`` does not take every _StridedShard layout)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(value.shape, param.device_mesh, param.placements)
    local = value[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
    return DTensor.from_local(local, param.device_mesh, param.placements, shape=value.shape, stride=value.stride())


def scenario_bf16_close_to_torch_hsdp(rank: int, ws: int) -> None:
    """bf16 mixed precision: HFSDP's losses stay within bf16 rounding of torch's own fully_shard HSDP."""
    torch.manual_seed(0)
    ours, theirs = tiny_gpt(), tiny_gpt()
    theirs.load_state_dict(ours.state_dict())
    policy = fl.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    shard(HFSDP, mp_policy=policy)(ours)
    from torch.distributed.fsdp import MixedPrecisionPolicy

    torch_shard(theirs, mesh22(), mp_policy=MixedPrecisionPolicy(torch.bfloat16, torch.float32))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs)]
    for step in range(4):
        losses = []
        for model, opt in zip((ours, theirs), opts):
            loss = gpt_loss(model, gpt_batch(step, rank))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[0], losses[1], rtol=2e-2, atol=1e-2)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(full(a), full(b), rtol=2e-2, atol=2e-2)


def scenario_refusals(rank: int, ws: int) -> None:
    """Refused by name before anything is sharded: a 1-D mesh, and parameters HFSDP cannot split."""
    from torch.distributed.tensor import Shard

    model = UnevenMLP()
    before = {name: param for name, param in model.named_parameters()}
    with pytest.raises(ValueError, match=r"replicate='optimizer'\) \(HFSDP\).*this mesh is 1-D \(shard 4\)"):
        fl.fully_shard(model.blocks[0], fl.init_mesh(device_type="cpu"), sharding=HFSDP)
    with pytest.raises(ValueError, match=r"these are not: up.weight \(Shard\(1\)\), mid.weight"):
        fl.fully_shard(model.blocks[0], mesh22(), sharding=HFSDP, shard_placement_fn=lambda p: Shard(p.dim() - 1))
    assert not isinstance(model.blocks[0], fl.FSDPModule)
    assert all(model.get_parameter(name) is param for name, param in before.items())


def scenario_policy_file(rank: int, ws: int) -> None:
    """``sharding: {replicate: optimizer}`` in a policy file, with a rule keeping the blocks HSDP: the root
    group replica-sharded, the blocks not, and AdamW steps bit for bit all-HSDP's."""
    torch.manual_seed(0)
    hsdp, mixed = tiny_gpt(), tiny_gpt()
    mixed.load_state_dict(hsdp.state_dict())
    mesh = {"mesh": {"replicate": 2, "shard": 2}}
    rules = [{"match": {"class": "Block"}, "sharding": {"replicate": "none"}}]
    fl.apply_config(hsdp, fl.FSDPConfig.model_validate({**mesh, "wrap": rules}))
    config = fl.FSDPConfig.model_validate({**mesh, "sharding": {"replicate": "optimizer"}, "wrap": rules})
    fl.apply_config(mixed, config)
    assert [group.replicas is not None for group in _groups(mixed)] == [True, False, False]  # the root, the blocks
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (hsdp, mixed)]
    for step in range(2):
        losses = []
        for model, opt in zip((hsdp, mixed), opts):
            losses.append(gpt_loss(model, gpt_batch(step, rank)))
            losses[-1].backward()
            opt.step()
            opt.zero_grad()
        assert torch.equal(losses[0], losses[1]), step


class RecordingComm:
    """torch's AllGather / ReduceScatter protocol over plain c10d, recording the group of each call."""

    def __init__(self, kind: str) -> None:
        self.kind, self.groups, self.allocations = kind, [], 0

    def allocate(self, size, *, dtype, device):  # noqa: ANN001, ANN201
        self.allocations += 1
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op=None, async_op=False):  # noqa: ANN001, ANN204
        self.groups.append(group)
        if self.kind == "all_gather":
            return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def scenario_collectives_through_the_seam(rank: int, ws: int) -> None:
    """Every collective of an HFSDP step goes through the runtime's one seam ([Note: one collective seam]): as many
    calls of its Collectives and of the user's objects as c10d collectives CommDebugMode sees; each issued async
    (on CPU a Work its consumer waits on), the replica all-gather and reduce-scatter once per group on the
    replicate group. With every collective the runtime issues run late on a worker thread (its output written
    only when waited on), HFSDP still matches DDP exactly: each replica collective is waited before it is read."""
    mesh = mesh22()
    replicate_group, shard_group = mesh.get_group(0), mesh.get_group(1)
    torch.manual_seed(0)
    model = EvenMLP()
    shard(HFSDP, mesh)(model)
    gather, reduce = RecordingComm("all_gather"), RecordingComm("reduce_scatter")
    model.blocks[0].set_custom_all_gather(gather)
    model.blocks[0].set_custom_reduce_scatter(reduce)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mlp_loss(model, even_batch(0, rank)).backward()
    opt.step()  # the pieces moved: the next unshard of each group all-gathers them across the replicas
    opt.zero_grad()
    gather.groups.clear()
    reduce.groups.clear()
    with CommDebugMode() as mode, recorded_collectives() as calls:
        mlp_loss(model, even_batch(1, rank)).backward()
    users = len(gather.groups) + len(reduce.groups)
    assert users == 2 + 1 and set(gather.groups + reduce.groups) == {shard_group}, (gather.groups, reduce.groups)
    assert sum(mode.get_comm_counts().values()) == len(calls) + users, (mode.get_comm_counts(), calls)
    assert all(async_op for *_, async_op in calls), calls
    across = sorted(kind for kind, ranks, _, _ in calls if ranks.group is replicate_group)
    groups = len(_groups(model))
    assert across == ["all_gather"] * groups + ["reduce_scatter"] * groups, across
    with delayed_collectives(0.002 * (rank + 1)):
        torch.manual_seed(1)
        train_and_compare(UnevenMLP(), shard(HFSDP), mlp_batch, mlp_loss, rank, steps=3, label="hfsdp delayed")


def test_hfsdp_on_four_ranks() -> None:
    spawn_checks(
        4,
        scenario_policy_file,
        scenario_parity_with_ddp,
        scenario_bitwise_hsdp,
        scenario_bytes,
        scenario_never_stale,
        scenario_bf16_close_to_torch_hsdp,
        scenario_refusals,
        scenario_collectives_through_the_seam,
    )


def _two_parts(step: int, rank: int, ws: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The 4-rank global batch of ``step``, split over ``ws`` ranks: the same data at every world size."""
    parts = [gpt_batch(step, r) for r in range(4)]
    mine = parts[rank * 4 // ws : (rank + 1) * 4 // ws]
    return torch.cat([p[0] for p in mine]), torch.cat([p[1] for p in mine])


def run_save_four(rank: int, ws: int, root: str) -> None:
    """4 ranks, HFSDP: two AdamW steps, a checkpoint (model and optimizer), two more steps; rank 0 keeps the
    whole parameters after them."""
    torch.manual_seed(0)
    model = tiny_gpt()
    shard(HFSDP)(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(4):
        if step == 2:
            fl.save_checkpoint(f"{root}/ckpt", model, opt)
        gpt_loss(model, _two_parts(step, rank, ws)).backward()
        opt.step()
        opt.zero_grad()
    whole = {name: full(param).detach().clone() for name, param in model.named_parameters()}
    if rank == 0:
        torch.save(whole, f"{root}/after.pt")


def run_load_two(rank: int, ws: int, root: str) -> None:
    """2 ranks: the 4-rank HFSDP checkpoint (model and AdamW state) loads under ZeRO-3 (1-D mesh) and under
    HFSDP on (2, 1), and both train on to the 4-rank run's parameters (the same global batches; sums over 2
    ranks instead of 4 round differently, and AdamW magnifies that on gradients near zero: 5e-5, where a lost
    optimizer state would be off by the learning rate, 1e-2)."""
    after = torch.load(f"{root}/after.pt")
    for label, mesh, sharding in (
        ("zero-3", fl.init_mesh(device_type="cpu"), None),
        ("hfsdp (2, 1)", fl.init_mesh(replicate=2, shard=1, device_type="cpu"), HFSDP),
    ):
        torch.manual_seed(7)  # other initial values: the load must replace them all
        model = tiny_gpt()
        shard(sharding, mesh)(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        fl.load_checkpoint(f"{root}/ckpt", model, opt)
        for step in (2, 3):
            gpt_loss(model, _two_parts(step, rank, ws)).backward()
            opt.step()
            opt.zero_grad()
        for name, param in model.named_parameters():
            where = f"{label} {name}"
            torch.testing.assert_close(
                full(param), after[name], rtol=1e-4, atol=5e-5, msg=lambda m, where=where: f"{where}: {m}"
            )


def test_hfsdp_checkpoint_loads_under_zero3_at_another_world_size(tmp_path) -> None:  # type: ignore[no-untyped-def]
    spawn(run_save_four, 4, str(tmp_path))
    spawn(run_load_two, 2, str(tmp_path))


def test_policy_refusals_without_ranks() -> None:
    """The policy and the policy file: values checked by name; zero_stage sets the shard axis only."""
    assert HFSDP.replica_sharded and not HFSDP.resident and not fl.ShardingPolicy().replica_sharded
    with pytest.raises(ValueError, match="replicate"):
        fl.ShardingPolicy(replicate="params")
    mesh = {"mesh": {"replicate": 2, "shard": 2}}
    both = fl.FSDPConfig.model_validate({**mesh, "zero_stage": 2, "sharding": {"replicate": "optimizer"}})
    assert both.sharding == fl.ShardingPolicy(shard="optimizer", replicate="optimizer")
    with pytest.raises(ValueError, match="zero_stage: 3 means sharding.shard: params, but sharding says shard: optim"):
        fl.FSDPConfig.model_validate({**mesh, "zero_stage": 3, "sharding": {"shard": "optimizer"}})
    with pytest.raises(ValueError, match=r"(?s)^.*sharding.replicate: optimizer \(HFSDP\).*mesh.replicate is 1"):
        fl.FSDPConfig.model_validate({"sharding": {"replicate": "optimizer"}})
    rule = {"match": {"class": "Block"}, "sharding": {"replicate": "optimizer"}}
    with pytest.raises(ValueError, match=r"wrap\[0\].sharding.replicate: optimizer"):
        fl.FSDPConfig.model_validate({"wrap": [rule]})
    with pytest.raises(ValueError, match="dp_replicate"):
        fl.FSDPConfig.model_validate({**mesh, "sharding": {"dp_replicate": "optimizer"}})
    assert fl.ShardingPolicy.model_validate({"replicate": "optimizer", "shard": "optimizer"}).resident


def test_estimate_splits_the_optimizer_state_across_replicas() -> None:
    """16 ranks as (4, 4), simulated (the runtime on the fake process group) and analytic: HFSDP's optimizer
    state per rank is HSDP's over 4, exactly (rows divisible by 16; AdamW's step counters are whole)."""
    from fsdp2lite.models import GPT, GPTConfig

    config = GPTConfig(vocab_size=256, seq_len=16, d_model=64, n_heads=4, n_layers=2)
    tensors = sum(1 for _ in GPT(config).parameters())
    for method in ("simulate", "analytic"):
        state = []
        for sharding in ({}, {"sharding": {"replicate": "optimizer"}}):
            rules = {"mesh": {"replicate": 4, "shard": 4}, "wrap": [{"match": {"class": "Block"}}], **sharding}
            estimate = fl.estimate_memory(
                lambda: GPT(config), fl.FSDPConfig.model_validate(rules), world_size=16, device="cpu", method=method
            )
            state.append(dict(estimate.breakdown)["optimizer"] - 4 * tensors)
        assert state[0] == 4 * state[1] > 0, (method, state)


def test_explain_shows_each_groups_stages(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """explain names HFSDP and ZeRO-1/2 on the groups that have them (blocks HSDP here, the root HFSDP)."""
    from fsdp2lite.cli import main

    path = tmp_path / "hfsdp.yaml"
    path.write_text(
        "mesh: {replicate: 2, shard: 2}\nsharding: {replicate: optimizer, shard: optimizer}\n"
        "wrap:\n  - match: {class: Block}\n    sharding: {replicate: none}\n"
    )
    assert main(["explain", str(path), "--model", "fsdp2lite.models:gpt_small", "--world-size", "4"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert out.count("sharding: replicate=optimizer (HFSDP") == 1  # the root only
    assert out.count("sharding: shard=optimizer (ZeRO-1/2") == 1  # a rule's sharding replaces the top level's
