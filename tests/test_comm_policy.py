"""CommPolicy (issue 23): quantized all-gather (int8/fp8, block scales) and all-to-all reduce-scatter
(fp32/bf16, int8), against the default collectives on the same ranks: exact byte counts at the c10d call,
the error bound of what is gathered, the reduced gradients, and bad input ([Note: quantized collectives])."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn as nn
from _dist import cpu_mesh, spawn_checks
from _models import UnevenMLP, mlp_batch, mlp_loss
from _parity import full
from torch.distributed.device_mesh import init_device_mesh

import fsdp2lite as fl
from fsdp2lite._runtime.quantize import encoded_sizes


def _model(policy: fl.CommPolicy | None, mesh: Any = None, **kwargs: Any) -> nn.Module:
    torch.manual_seed(0)
    model = UnevenMLP()
    mesh = mesh or cpu_mesh()
    for block in model.blocks:
        fl.fully_shard(block, mesh=mesh, comm_policy=policy, **kwargs)
    fl.fully_shard(model, mesh=mesh, comm_policy=policy, **kwargs)
    return model


def _step(model: nn.Module, step: int, rank: int) -> tuple[float, dict[str, int], list[torch.Tensor]]:
    with fl.count_wire_bytes(model) as sent:
        loss = mlp_loss(model, mlp_batch(step, rank))
        loss.backward()
    grads = [full(p.grad) for p in model.parameters()]
    model.zero_grad()
    return loss.item(), dict(sent), grads


def _slots(model: nn.Module) -> list[list[int]]:
    """Per group (blocks, then the root), the padded numel of each parameter: one rank's slot layout."""
    groups = [block._fsdp_state.group for block in model.blocks] + [model._fsdp_state.group]
    return [[p.padded_numel for p in group.params] for group in groups]


def check_bytes_and_math(rank: int, world_size: int) -> None:
    """Byte counts equal the ring formulas exactly; all-to-all fp32 reduces what the default reduces (up to
    summation order); int8 reductions and all-gathers stay within their error bounds."""
    n = world_size
    plain = _model(None)
    loss, sent, grads = _step(plain, 0, rank)
    slots = _slots(plain)
    # forward gathers every group; backward the blocks again (the root keeps its parameters)
    fp32_gather = sum((n - 1) * 4 * sum(group) for group in slots) + sum((n - 1) * 4 * sum(g) for g in slots[:-1])
    reduce_bytes = sum(4 * n * sum(group) for group in slots)  # the rank-major buffer of every group
    assert sent == {"all_gather": fp32_gather, "all_reduce": 2 * reduce_bytes * (n - 1) // n}, sent

    a2a = _model(fl.CommPolicy(reduce_scatter="all_to_all"))
    loss_a2a, sent_a2a, grads_a2a = _step(a2a, 0, rank)
    assert sent_a2a == {"all_gather": fp32_gather, "all_to_all": reduce_bytes * (n - 1) // n}, sent_a2a
    assert loss_a2a == loss
    for mine, ref in zip(grads_a2a, grads):
        torch.testing.assert_close(mine, ref, rtol=1e-6, atol=1e-7)  # the same sums, in another order

    block = 64
    int8 = _model(fl.CommPolicy(all_gather="int8", reduce_scatter="int8", block_size=block))
    loss_int8, sent_int8, grads_int8 = _step(int8, 0, rank)

    def encoded(numel: int) -> int:
        codes, scales = encoded_sizes(numel, block)
        return codes + 4 * scales  # int8 codes and fp32 scales

    def gathered(group: list[int]) -> int:  # each parameter's segment padded to whole blocks
        return sum(encoded(numel) for numel in group)

    int8_gather = sum((n - 1) * gathered(g) for g in slots) + sum((n - 1) * gathered(g) for g in slots[:-1])
    int8_reduce = sum(n * encoded(sum(g)) * (n - 1) // n for g in slots)
    assert sent_int8 == {"all_gather": int8_gather, "all_to_all": int8_reduce}, sent_int8
    # this tiny model's 2-row head and 37-element biases pad to whole blocks: well under half of fp32's bytes
    ratios = (int8_gather / fp32_gather, int8_reduce / (reduce_bytes * (n - 1) // n))
    assert max(ratios) < 0.45, ratios
    assert abs(loss_int8 - loss) <= 0.01 * abs(loss)
    for mine, ref in zip(grads_int8, grads):
        cosine = torch.nn.functional.cosine_similarity(mine.flatten(), ref.flatten(), dim=0)
        assert cosine > 0.99, cosine  # each rank quantizes its rows before the sum


def check_gathered_weights_within_the_bound(rank: int, world_size: int) -> None:
    """What the forward sees is the weight to within half a quantization step of its block (int8: absmax
    / 254; fp8 e4m3: a relative 2^-4 of the element), decoded into param_dtype."""
    for kind, dtype in (("int8", None), ("fp8", None), ("int8", torch.bfloat16)):
        mp = fl.MixedPrecisionPolicy(param_dtype=dtype)
        model = _model(fl.CommPolicy(all_gather=kind, block_size=16), mp_policy=mp)
        seen: dict[str, torch.Tensor] = {}
        layer = model.blocks[0].mid

        def capture(module: nn.Module, args: Any, seen: dict[str, torch.Tensor] = seen) -> None:
            seen["w"] = module.weight.detach().clone()  # the unsharded weight the forward computes with

        layer.register_forward_pre_hook(capture)
        exact = full(layer.weight.detach()).float()
        model(mlp_batch(0, rank)[0].to(dtype or torch.float32))
        gathered = seen["w"].float()
        assert gathered.dtype == torch.float32 and seen["w"].dtype == (dtype or torch.float32)
        absmax = _block_absmax(model.blocks[0]._fsdp_state.group, "mid.weight", world_size, 16)
        if kind == "int8":
            bound = absmax / 254 + (exact.abs() * 2**-8 if dtype is torch.bfloat16 else 0)
        else:
            bound = exact.abs() * 2**-4 + absmax * 2**-9
        assert ((gathered - exact).abs() <= bound + 1e-7).all(), (kind, dtype, (gathered - exact).abs().max())
        relative = ((gathered - exact).norm() / exact.norm()).item()
        assert relative < (0.01 if kind == "int8" else 0.05), (kind, relative)


def _block_absmax(group: Any, fqn: str, shards: int, block: int) -> torch.Tensor:
    """Each element of parameter ``fqn``'s block absmax, blocks laid out as the encoder lays them: each rank
    encodes its slot of the group, every parameter's padded torch.chunk shard in a segment of whole blocks."""
    per_rank: list[torch.Tensor] = []
    for rank in range(shards):
        pieces: list[torch.Tensor] = []
        start = count = 0
        for param in group.params:
            whole = full(param.sharded_param.detach()).float()
            chunks = torch.chunk(whole, shards, dim=0)
            rows = chunks[rank] if rank < len(chunks) else whole[:0]
            padded = torch.zeros(-(-param.padded_numel // block) * block)  # its segment: whole blocks
            padded[: rows.numel()] = rows.flatten()
            if param.fqn == fqn:
                start, count = sum(p.numel() for p in pieces), rows.numel()
            pieces.append(padded)
        slot = torch.cat(pieces)
        blocks = torch.nn.functional.pad(slot, (0, (-slot.numel()) % block)).view(-1, block)
        absmax = blocks.abs().amax(dim=1, keepdim=True).expand(-1, block).flatten()
        per_rank.append(absmax[start : start + count])
    target = next(p for p in group.params if p.fqn == fqn)
    return torch.cat(per_rank).view(target.orig_shape)


def check_hsdp_keeps_its_replica_all_reduce(rank: int, world_size: int) -> None:
    """2 replicas x 2 shards: the all-to-all replaces the shard group's reduction only; the result equals
    the default's (up to summation order)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    _, sent, grads = _step(_model(None, mesh), 0, rank)
    _, sent_a2a, grads_a2a = _step(_model(fl.CommPolicy(reduce_scatter="all_to_all"), mesh), 0, rank)
    assert sent_a2a["replica_all_reduce"] == sent["replica_all_reduce"] > 0
    assert sent_a2a["all_to_all"] * 2 == sent["all_reduce"]
    for mine, ref in zip(grads_a2a, grads):
        torch.testing.assert_close(mine, ref, rtol=1e-6, atol=1e-7)


def test_comm_policy_world2() -> None:
    spawn_checks(2, check_bytes_and_math, check_gathered_weights_within_the_bound)


def test_comm_policy_world4() -> None:
    spawn_checks(4, check_bytes_and_math, check_hsdp_keeps_its_replica_all_reduce)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_size": 0}, "block_size must be an integer from 16 to 65536, got 0"),
        ({"block_size": 100_000}, "got 100000"),
        ({"block_size": 64.5}, "block_size"),
        ({"all_gather": "int4"}, "all_gather"),
        ({"reduce_scatter": "fp8"}, "reduce_scatter"),
        ({"all_gather": "int8", "bogus": 1}, "bogus"),
    ],
)
def test_bad_comm_policies(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        fl.CommPolicy(**kwargs)


class WithCodes(nn.Module):
    """A frozen int8 parameter beside a Linear: no single floating-point slot to quantize."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.codes = nn.Parameter(torch.zeros(4, dtype=torch.int8), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


@pytest.mark.usefixtures("single_rank_pg")
def test_comm_policy_type_and_off_is_the_default() -> None:
    with pytest.raises(TypeError, match="comm_policy must be a fsdp2lite.CommPolicy or None, got dict"):
        fl.fully_shard(nn.Linear(2, 2), comm_policy={"all_gather": "int8"})  # type: ignore[arg-type]
    assert not fl.CommPolicy().active and fl.CommPolicy(all_gather="int8").active
    layer = fl.fully_shard(nn.Linear(4, 4), comm_policy=fl.CommPolicy())
    assert not layer._fsdp_state.group.forms.comm_policy.active  # off: today's path, untouched
    block = WithCodes()
    with pytest.raises(ValueError, match=r"quantizes a group's parameters together, but these are not plain .*: codes"):
        fl.fully_shard(block, comm_policy=fl.CommPolicy(all_gather="int8"))
    assert not isinstance(block, fl.FSDPModule)  # nothing changed
    assert math.isclose(encoded_sizes(100, 16)[0], 112)


@pytest.mark.usefixtures("single_rank_pg")
def test_yaml_communication_per_rule(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``communication:`` at the top and per rule; a rule's fields override, the others are inherited."""
    path = tmp_path / "comm.yaml"
    path.write_text(
        "communication: {reduce_scatter: all_to_all}\n"
        "wrap:\n  - match: {class: UnevenBlock}\n    communication: {all_gather: int8, block_size: 32}\n"
    )
    model = fl.apply_config(UnevenMLP(), fl.FSDPConfig.from_yaml(path))
    block = model.blocks[0]._fsdp_state.group.forms.comm_policy
    assert (block.all_gather, block.reduce_scatter, block.block_size) == ("int8", "all_to_all", 32)
    root = model._fsdp_state.group.forms.comm_policy
    assert (root.all_gather, root.reduce_scatter) == (None, "all_to_all")


def test_deepspeed_zero_plus_plus_quantization_migrates(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from fsdp2lite.migrate import migrate

    path = tmp_path / "ds.json"
    path.write_text(
        '{"zero_optimization": {"stage": 3, "zero_quantized_weights": true, "zero_quantized_gradients": true}}'
    )
    result = migrate("deepspeed", path)
    assert result.config.communication == fl.CommPolicy(all_gather="int8", reduce_scatter="int8")
    statuses = {k.key: k.status for k in result.keys}
    assert statuses["zero_optimization.zero_quantized_weights"] == "mapped"
    assert "all_gather: int8  # from zero_optimization.zero_quantized_weights" in result.yaml()


def test_estimate_counts_the_policy_bytes() -> None:
    """The estimate's bytes per step follow the policy: int8 codes and one fp32 scale per block."""
    from fsdp2lite.cli.estimate import communication_bytes
    from fsdp2lite.models import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=256, seq_len=16, d_model=64, n_heads=4, n_layers=2))
    rule = [{"match": {"class": "Block"}}]
    plain = communication_bytes(model, fl.FSDPConfig.model_validate({"wrap": rule}), 8)
    int8 = fl.FSDPConfig.model_validate({"wrap": rule, "communication": {"all_gather": "int8", "block_size": 64}})
    both = fl.FSDPConfig.model_validate(
        {"wrap": rule, "communication": {"all_gather": "int8", "reduce_scatter": "int8", "block_size": 64}}
    )
    assert communication_bytes(model, int8, 8) < 0.8 * plain  # the gathers at 1 + 4/64 bytes per element
    assert communication_bytes(model, both, 8) < 0.3 * plain
