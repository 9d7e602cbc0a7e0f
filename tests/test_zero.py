"""ZeRO-1/2 (``ShardingPolicy(shard="optimizer")``): parity with DDP, one all-gather per group per step, never
stale weights, the kept storage, checkpoints across strategies, and the refusals. One spawn of 4 gloo ranks."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _dist import spawn_checks
from _models import gpt_batch, gpt_loss, tiny_gpt
from _parity import full, train_and_compare

import fsdp2lite as fl
from fsdp2lite._runtime.zero import Resident

ZERO12 = fl.ShardingPolicy(shard="optimizer")


def shard(sharding: fl.ShardingPolicy | None):
    def apply(model: nn.Module) -> None:
        for block in model.blocks:
            fl.fully_shard(block, sharding=sharding)
        fl.fully_shard(model, sharding=sharding)

    return apply


def _groups(model: nn.Module) -> list:
    return [m._fsdp_state.group for m in model.modules() if isinstance(m, fl.FSDPModule)]


def scenario_parity_with_ddp(rank: int, ws: int) -> None:
    """fp32, 5 steps: losses, grads and params equal DDP's at every step; with accumulation and clipping too."""
    for label, sharding in (("zero-1/2", ZERO12), ("zero-3", fl.ShardingPolicy(shard="params"))):
        torch.manual_seed(0)
        train_and_compare(tiny_gpt(), shard(sharding), gpt_batch, gpt_loss, rank, steps=5, label=label)
    torch.manual_seed(1)
    train_and_compare(
        tiny_gpt(), shard(ZERO12), gpt_batch, gpt_loss, rank, steps=3, microbatches=2, clip_norm=0.05,
        label="zero-1/2 accumulating, clipped",
    )  # fmt: skip


def scenario_one_all_gather_per_group_per_step(rank: int, ws: int) -> None:
    torch.manual_seed(0)
    zero3, resident = tiny_gpt(), tiny_gpt()
    resident.load_state_dict(zero3.state_dict())
    shard(None)(zero3)
    shard(ZERO12)(resident)
    batch = gpt_batch(0, rank)
    with fl.count_wire_bytes(zero3) as forward_only:
        gpt_loss(zero3, batch)
    with fl.count_wire_bytes(zero3) as zero3_step:
        gpt_loss(zero3, batch).backward()
    opt = torch.optim.SGD(resident.parameters(), lr=0.1)
    for step in range(3):
        with fl.count_wire_bytes(resident) as sent:
            gpt_loss(resident, batch).backward()
        # every group gathered once, in forward (ZeRO-3 gathers the blocks again in backward)
        assert sent["all_gather"] == forward_only["all_gather"] < zero3_step["all_gather"], (step, sent)
        assert sent["all_reduce"] == zero3_step["all_reduce"]  # gloo's reduce-scatter: the same gradients
        opt.step()
        opt.zero_grad()
    # gradient accumulation: two microbatches, sync off then on: ZeRO-1/2 gathers once, ZeRO-3 per microbatch
    torch.manual_seed(3)
    kept = tiny_gpt()
    for block in kept.blocks:
        fl.fully_shard(block, reshard_after_forward=False)
    fl.fully_shard(kept, reshard_after_forward=False)
    for model in (resident, kept):
        with fl.count_wire_bytes(model) as accumulated:
            for micro, sync in enumerate((False, True)):
                model.set_requires_gradient_sync(sync)
                gpt_loss(model, gpt_batch(10 + micro, rank)).backward()
        times = 1 if model is resident else 2
        assert accumulated["all_gather"] == times * forward_only["all_gather"], (times, accumulated)
        model.zero_grad()
    with torch.no_grad(), fl.count_wire_bytes(resident) as again:
        gpt_loss(resident, batch)
        gpt_loss(resident, batch)
    assert again.get("all_gather", 0) == 0  # no step since the accumulation's gather: nothing to gather
    skipped = sum(s.skipped for group in _groups(resident) for s in group.storages if isinstance(s, Resident))
    assert skipped >= len(_groups(resident)), skipped
    for group in _groups(resident):  # between steps: DTensors registered, the unsharded storage kept
        assert all(isinstance(p, torch.distributed.tensor.DTensor) for p in group.modules[0].parameters())
        assert all(param.unsharded.unsharded_flat.untyped_storage().nbytes() > 0 for param in group.params)
    for group in _groups(zero3):
        assert all(param.unsharded.unsharded_flat.untyped_storage().nbytes() == 0 for param in group.params)


def scenario_never_stale(rank: int, ws: int) -> None:
    """Every in-place change to the shards is seen by the next forward: a step, load_state_dict, copy_; a
    write through .data after model.reshard()."""
    torch.manual_seed(0)
    model, ref = tiny_gpt(), tiny_gpt()
    ref.load_state_dict(model.state_dict())
    shard(ZERO12)(model)
    batch = gpt_batch(0, rank)

    def same() -> None:
        with torch.no_grad():  # forward only: the groups register their shards again after it
            torch.testing.assert_close(gpt_loss(model, batch), gpt_loss(ref, batch), rtol=1e-5, atol=1e-6)

    gpt_loss(model, batch).backward()  # gathered and kept
    model.zero_grad()
    same()
    with torch.no_grad():
        for ref_param in ref.parameters():
            ref_param.mul_(0.5)
        for name, value in _sharded(model, ref.state_dict()).items():
            model.get_parameter(name).copy_(value)
    same()
    state = {k: v * 2 for k, v in ref.state_dict().items()}
    ref.load_state_dict(state)
    model.load_state_dict(_sharded(model, state), strict=False)
    same()
    with torch.no_grad():
        for param, ref_param in zip(model.parameters(), ref.parameters()):
            ref_param.add_(1.0)
            param.data.to_local().add_(1.0)  # bypasses the version counters ...
    model.reshard()  # ... so the kept storage is freed: the next forward gathers
    same()


def _sharded(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import distribute_tensor

    out = {}
    for name, value in state.items():
        try:
            param = model.get_parameter(name)  # tied names too
        except AttributeError:
            continue  # a buffer
        out[name] = distribute_tensor(value, param.device_mesh, param.placements)
    return out


def scenario_checkpoint_across_strategies(rank: int, ws: int) -> None:
    """Saved under ZeRO-1/2 after two steps, loaded under ZeRO-3: the same parameters, the same next losses."""
    import tempfile

    torch.manual_seed(0)
    source = tiny_gpt()
    target = copy.deepcopy(source)
    shard(ZERO12)(source)
    shard(None)(target)
    opt = torch.optim.SGD(source.parameters(), lr=0.1)
    for step in range(2):
        gpt_loss(source, gpt_batch(step, rank)).backward()
        opt.step()
        opt.zero_grad()
    directory = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(directory)
    fl.save_checkpoint(directory[0], source)
    fl.load_checkpoint(directory[0], target)
    for (name, mine), theirs in zip(target.named_parameters(), source.parameters()):
        assert torch.equal(full(mine), full(theirs)), name
    for step in range(2, 4):
        batch = gpt_batch(step, rank)
        torch.testing.assert_close(gpt_loss(target, batch), gpt_loss(source, batch), rtol=0, atol=0)


VARIANTS = {  # on top of one group per Block: each with and without zero_stage 2
    "fp32": {},
    "bf16 mixed precision": {"mixed_precision": {"param_dtype": "bf16", "reduce_dtype": "fp32"}},
    "CPU offload (ZeRO-Offload's shape)": {"offload": {"device": "cpu", "pin_memory": False}},
    "HSDP (2, 2)": {"mesh": {"replicate": 2, "shard": 2}},
}


def scenario_policy_file_bitwise_zero3(rank: int, ws: int) -> None:
    """``zero_stage: 2`` through apply_config: resident groups, and AdamW steps bit for bit ZeRO-3's (the same
    collectives and arithmetic, only fewer all-gathers), in fp32, bf16 mixed precision, with CPU offload of
    the shards and optimizer state, and on an HSDP mesh."""
    for label, extra in VARIANTS.items():
        torch.manual_seed(0)
        zero3, zero2 = tiny_gpt(), tiny_gpt()
        zero2.load_state_dict(zero3.state_dict())
        rules = {"wrap": [{"match": {"class": "Block"}}], **extra}
        fl.apply_config(zero3, fl.FSDPConfig.model_validate(rules))
        fl.apply_config(zero2, fl.FSDPConfig.model_validate({"zero_stage": 2, **rules}))
        assert all(group.keeps_unsharded for group in _groups(zero2)), label
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (zero3, zero2)]
        for step in range(3):
            losses = []
            for model, opt in zip((zero3, zero2), opts):
                loss = gpt_loss(model, gpt_batch(step, rank))
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.detach())
            assert torch.equal(losses[0], losses[1]), (label, step, losses)
        for a, b in zip(zero3.parameters(), zero2.parameters()):
            assert torch.equal(full(a), full(b)), label


def scenario_hsdp_parity_with_ddp(rank: int, ws: int) -> None:
    """ZeRO-1/2 on a (replicate 2, shard 2) mesh against DDP: losses, grads and params every step."""
    mesh = fl.init_mesh(replicate=2, shard=2, device_type="cpu")

    def apply(model: nn.Module) -> None:
        for block in model.blocks:
            fl.fully_shard(block, mesh, sharding=ZERO12)
        fl.fully_shard(model, mesh, sharding=ZERO12)

    torch.manual_seed(2)
    train_and_compare(tiny_gpt(), apply, gpt_batch, gpt_loss, rank, steps=4, label="zero-1/2 hsdp")


def test_zero_stages_on_four_ranks() -> None:
    spawn_checks(
        4,
        scenario_parity_with_ddp,
        scenario_one_all_gather_per_group_per_step,
        scenario_never_stale,
        scenario_checkpoint_across_strategies,
        scenario_policy_file_bitwise_zero3,
        scenario_hsdp_parity_with_ddp,
    )


def run_save_four(rank: int, ws: int, root: str) -> None:
    """4 ranks, ZeRO-1/2: two AdamW steps, then a checkpoint and (rank 0) the whole parameters beside it."""
    torch.manual_seed(0)
    model = tiny_gpt()
    shard(ZERO12)(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        gpt_loss(model, gpt_batch(step, rank)).backward()
        opt.step()
        opt.zero_grad()
    fl.save_checkpoint(f"{root}/ckpt", model)
    whole = {name: full(param).detach().clone() for name, param in model.named_parameters()}
    if rank == 0:
        torch.save(whole, f"{root}/reference.pt")


def run_load_two(rank: int, ws: int, root: str) -> None:
    """2 ranks, ZeRO-3 and ZeRO-1/2: the 4-rank ZeRO-1/2 checkpoint loads into both, equal parameters, and
    both then step alike."""
    reference = torch.load(f"{root}/reference.pt")
    models = []
    for sharding in (None, ZERO12):
        torch.manual_seed(7)  # other initial values: the load must replace them all
        model = tiny_gpt()
        shard(sharding)(model)
        fl.load_checkpoint(f"{root}/ckpt", model)
        for name, param in model.named_parameters():
            assert torch.equal(full(param), reference[name]), name
        models.append(model)
    losses = [gpt_loss(model, gpt_batch(5, rank)) for model in models]
    assert torch.equal(losses[0], losses[1]), losses


def test_zero12_checkpoint_loads_at_another_world_size(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from _dist import spawn

    spawn(run_save_four, 4, str(tmp_path))
    spawn(run_load_two, 2, str(tmp_path))


def test_sharding_policy_and_its_refusals() -> None:
    assert fl.ShardingPolicy.zero_stage(1) == fl.ShardingPolicy.zero_stage(2) == ZERO12
    assert fl.ShardingPolicy.zero_stage(3) == fl.ShardingPolicy() and not fl.ShardingPolicy().resident
    with pytest.raises(ValueError, match="zero_stage must be 1, 2 or 3, got 4"):
        fl.ShardingPolicy.zero_stage(4)
    with pytest.raises(ValueError, match="shard"):
        fl.ShardingPolicy(shard="everything")


def test_policy_files_declare_zero_stages() -> None:
    """``zero_stage`` and ``sharding`` at the top and per rule; contradictions refused by name."""
    from _models import tiny_gpt as build

    config = fl.FSDPConfig.model_validate({"zero_stage": 1, "wrap": [{"match": {"class": "Block"}}]})
    assert config.sharding == ZERO12
    plan = fl.plan_config(build(), config)
    assert all(group.policy.sharding == ZERO12 for group in plan.groups) and not plan.refused
    assert plan.groups[0].policy.fully_shard_kwargs()["sharding"] == ZERO12
    mixed = fl.FSDPConfig.model_validate({"wrap": [{"match": {"class": "Block"}, "sharding": {"shard": "optimizer"}}]})
    kinds = [group.policy.sharding.shard for group in fl.plan_config(build(), mixed).groups]
    assert kinds[-1] == "params" and set(kinds[:-1]) == {"optimizer"}  # the root keeps the top level's
    assert fl.plan_config(build(), mixed).groups[-1].policy.fully_shard_kwargs()["sharding"] is None
    with pytest.raises(ValueError, match="zero_stage: 2 means sharding.shard: optimizer, but sharding says shard"):
        fl.FSDPConfig.model_validate({"zero_stage": 2, "sharding": {"shard": "params"}})
    freeing = fl.FSDPConfig.model_validate({"zero_stage": 2, "reshard_after_forward": True})
    (problem,) = fl.plan_config(build(), freeing).refused
    assert "reshard_after_forward=True would free them" in problem.message  # fully_shard's words ([Note: one plan])


def test_estimate_simulates_the_resident_copy() -> None:
    """simulate runs the runtime, so ZeRO-1/2's resident unsharded parameters are in its peak."""
    from _models import tiny_gpt as build

    rules = [{"match": {"class": "Block"}}]
    zero3 = fl.estimate_memory(build, fl.FSDPConfig.model_validate({"wrap": rules}), world_size=4, device="cpu")
    zero2 = fl.estimate_memory(
        build, fl.FSDPConfig.model_validate({"zero_stage": 2, "wrap": rules}), world_size=4, device="cpu"
    )
    whole = sum(p.numel() * p.element_size() for p in build().parameters())
    assert zero2.breakdown["unsharded_params"] >= whole > zero3.breakdown["unsharded_params"]


def test_analytic_and_step_time_know_zero_12() -> None:
    """analytic counts the resident copy (within 15% of simulate, as for ZeRO-3); the step-time model and the
    budget search count no backward re-gather for it."""
    import functools

    from fsdp2lite.cli.estimate_search import communication_bytes
    from fsdp2lite.estimate.timing import comm_bytes
    from fsdp2lite.models import GPT, GPTConfig

    build = functools.partial(GPT, GPTConfig(vocab_size=512, seq_len=128, d_model=256, n_heads=4, n_layers=6))
    rules = {"wrap": [{"match": {"class": "Block"}}]}
    zero2 = fl.FSDPConfig.model_validate({"zero_stage": 2, **rules})
    simulated = fl.estimate_memory(build, zero2, world_size=8, batch=4)
    analytic = fl.estimate_memory(build, zero2, world_size=8, batch=4, method="analytic")
    assert 0.85 <= analytic.peak_bytes / simulated.peak_bytes <= 1.15, (analytic.peak_bytes, simulated.peak_bytes)
    assert any(note.startswith("terms:") and " Z " in note for note in analytic.notes)
    zero3 = fl.FSDPConfig.model_validate(rules)
    plans = {name: fl.plan_config(build(), config) for name, config in (("zero2", zero2), ("zero3", zero3))}
    sent = {name: comm_bytes(plan, shard=8) for name, plan in plans.items()}
    assert sent["zero2"].all_gather_backward == 0 < sent["zero3"].all_gather_backward
    assert sent["zero2"].all_gather_forward == sent["zero3"].all_gather_forward
    assert communication_bytes(build(), zero2, 8) < communication_bytes(build(), zero3, 8)


def test_fully_shard_refuses_what_contradicts_zero_12() -> None:
    """Checked before anything changes (no process group needed for the refusals)."""
    model = nn.Linear(4, 4)
    before = [id(p) for p in model.parameters()]
    with pytest.raises(
        ValueError,
        match=r"reshard_after_forward=True would free them; leave reshard_after_forward at None / auto \(or False\)",
    ):
        fl.fully_shard(model, sharding=ZERO12, reshard_after_forward=True)
    with pytest.raises(TypeError, match="sharding must be a fsdp2lite.ShardingPolicy or None, got str"):
        fl.fully_shard(model, sharding="zero2")  # type: ignore[arg-type]
    assert [id(p) for p in model.parameters()] == before and not isinstance(model, fl.FSDPModule)
