"""Per-parameter mixed precision ([Note: per-parameter mixed precision] in _runtime/split_reduce.py).

A block's norm computes in fp32 while its linears compute in bf16, in one group: one all-gather (bytes) and
one reduce-scatter per reduce dtype. Oracle: torch's fully_shard with each norm sharded as a nested group of
its own under an fp32 policy (``cast_forward_inputs=False``; this norm casts its input itself, so casting it
first, as the override's module does, is the same math), on 2 gloo ranks. Wire bytes are counted and checked
exactly. The models people use (Hugging Face Llama, Qwen2, GPT-2): test_param_mixed_precision_hf.py.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _dist import spawn_checks
from _models import mlp_batch
from test_mixed_precision import CollectiveDtypes
from torch.distributed.tensor import DTensor

import fsdp2lite as fl
from fsdp2lite._runtime.split_reduce import SplitReduce
from fsdp2lite._runtime.states import Role

D = 16
BF16 = fl.MixedPrecisionPolicy(param_dtype="bf16")  # reduce_dtype None: the linears reduce in bf16
FP32 = fl.MixedPrecisionPolicy(param_dtype="fp32", reduce_dtype="fp32")
OVERRIDES = {"norm.*": FP32}


class Fp32Norm(nn.Module):
    """A LayerNorm that computes in its weight's dtype and hands back the input's: kept in fp32 under bf16
    compute, the way models keep norms in fp32."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.layer_norm(x.to(self.weight.dtype), x.shape[-1:], self.weight, self.bias)
        return y.to(x.dtype)


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, 2 * d)
        self.norm = Fp32Norm(2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.norm(self.up(x))))


class NormNet(nn.Module):
    def __init__(self, n_blocks: int = 2, d: int = D) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n_blocks))
        self.head = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def shard_ours(model: NormNet) -> NormNet:
    for block in model.blocks:
        fl.fully_shard(block, mp_policy=BF16, mp_overrides=OVERRIDES)
    fl.fully_shard(model, mp_policy=BF16)
    return model


def shard_torch(model: NormNet) -> NormNet:
    from _dist import cpu_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = cpu_mesh()
    norm_policy = TorchMP(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False)
    for block in model.blocks:
        torch_fully_shard(block.norm, mesh=mesh, mp_policy=norm_policy)
        torch_fully_shard(block, mesh=mesh, mp_policy=TorchMP(param_dtype=torch.bfloat16))
    torch_fully_shard(model, mesh=mesh, mp_policy=TorchMP(param_dtype=torch.bfloat16))
    return model


def loss_of(model: nn.Module, step: int, rank: int) -> torch.Tensor:
    x, _ = mlp_batch(step, rank)
    return model(x).float().pow(2).mean()


def check_parity_with_torch_nested_groups(rank: int, ws: int) -> None:
    """5 AdamW steps: losses, gradients and parameters equal to torch's nested-group oracle (bit for bit on 2
    ranks: the sums, the division by 2 and the casts are the same ops in the same dtypes)."""
    torch.manual_seed(0)
    reference = NormNet()
    ours, theirs = shard_ours(copy.deepcopy(reference)), shard_torch(copy.deepcopy(reference))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs)]
    for step in range(5):
        losses = []
        for model in (ours, theirs):
            loss = loss_of(model, step, rank)
            loss.backward()
            losses.append(loss.detach())
        assert torch.equal(losses[0], losses[1]), (step, losses)
        for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
            assert a.grad.dtype == torch.float32, name  # stored in the parameter's own dtype
            assert torch.equal(a.grad.full_tensor(), b.grad.full_tensor()), (step, name)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        assert torch.equal(a.full_tensor(), b.full_tensor()), name


def check_one_all_gather_and_a_reduction_per_dtype(rank: int, ws: int) -> None:
    """In forward the linears see bf16 weights and the norm fp32 ones and fp32 inputs (the override's cast:
    [Note: override casts]); each block is one all-gather per use (uint8: [Note: byte all-gather]) and two
    reductions per backward, bf16 then fp32."""
    torch.manual_seed(0)
    model = shard_ours(NormNet())
    seen: dict[str, torch.dtype] = {}
    block = model.blocks[0]
    block.up.register_forward_pre_hook(lambda m, args: seen.update(up=m.weight.dtype))
    block.norm.register_forward_pre_hook(lambda m, args: seen.update(norm=m.weight.dtype, input=args[0].dtype))
    assert isinstance(block._fsdp_state.group.forms.reduce, SplitReduce)
    assert not isinstance(model._fsdp_state.group.forms.reduce, SplitReduce)  # no overrides: one reduction
    with CollectiveDtypes() as mode:
        loss_of(model, 0, rank).backward()
    assert seen == {"up": torch.bfloat16, "norm": torch.float32, "input": torch.float32}, seen
    gathers = [dtype for kind, dtype in mode.seen if kind == "all_gather"]
    reduces = [dtype for kind, dtype in mode.seen if kind == "reduce"]
    # the root (bf16) and two blocks (bytes), each gathered in forward and again in backward but the root
    assert gathers.count(torch.uint8) == 2 * 2 and gathers.count(torch.bfloat16) == 1, gathers
    # per block: bf16 (up, down) then fp32 (norm); the root: bf16
    assert reduces == [torch.bfloat16, torch.float32] * 2 + [torch.bfloat16], reduces


def _padded_numel(param: DTensor, ws: int) -> int:
    rows = math.ceil(param.shape[0] / ws)
    return rows * (param.numel() // param.shape[0])


def check_wire_bytes_exact(rank: int, ws: int) -> None:
    """Bytes sent per step, from the shapes: each block's one all-gather carries its linears' bf16 shards and
    its norm's fp32 ones (ring: ws - 1 slots), twice; its gloo reductions (in-place all-reduces, 2 (ws - 1)/ws
    of each buffer) carry the linears' gradients in bf16 and the norm's in fp32."""
    torch.manual_seed(0)
    model = shard_ours(NormNet())
    loss_of(model, 0, rank).backward()  # lazy init; the counts below are one whole step
    for param in model.parameters():
        param.grad = None
    with fl.count_wire_bytes(model) as sent:
        loss_of(model, 1, rank).backward()
    gathered = reduced = 0
    for block in model.blocks:
        bf16 = sum(_padded_numel(p, ws) * 2 for n, p in block.named_parameters() if not n.startswith("norm"))
        fp32 = sum(_padded_numel(p, ws) * 4 for n, p in block.named_parameters() if n.startswith("norm"))
        gathered += 2 * (ws - 1) * (bf16 + fp32)  # forward and backward
        reduced += 2 * (ws - 1) * (bf16 + fp32)  # ws slots of (bf16 + fp32) bytes, 2 (ws - 1) / ws of them
    head = sum(_padded_numel(p, ws) * 2 for p in model.head.parameters())
    gathered += (ws - 1) * head  # the root: kept unsharded after forward
    reduced += 2 * (ws - 1) * head
    assert sent == {"all_gather": gathered, "all_reduce": reduced}, (sent, gathered, reduced)


POLICY_FILE = {
    "mixed_precision": {"param_dtype": "bf16"},
    "wrap": [{"match": {"class": "Block"}}],
    "precision_overrides": [{"path": "blocks.*.norm.*", "param_dtype": "fp32", "reduce_dtype": "fp32"}],
}


def check_policy_file_matches_the_argument(rank: int, ws: int) -> None:
    """``precision_overrides`` in a policy file shards exactly as ``mp_overrides``: the same forms, and the same
    losses and gradients bit for bit over 3 steps."""
    torch.manual_seed(0)
    reference = NormNet()
    by_file = copy.deepcopy(reference)
    fl.apply_config(by_file, fl.FSDPConfig.model_validate(POLICY_FILE))
    by_argument = shard_ours(copy.deepcopy(reference))
    assert all(isinstance(block._fsdp_state.group.forms.reduce, SplitReduce) for block in by_file.blocks)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (by_file, by_argument)]
    for step in range(3):
        losses = [loss_of(model, step, rank) for model in (by_file, by_argument)]
        for loss in losses:
            loss.backward()
        assert torch.equal(losses[0].detach(), losses[1].detach()), (step, losses)
        for (name, a), b in zip(by_file.named_parameters(), by_argument.parameters()):
            assert torch.equal(a.grad.full_tensor(), b.grad.full_tensor()), (step, name)
        for opt in opts:
            opt.step()
            opt.zero_grad()


def test_param_mixed_precision_on_two_ranks() -> None:
    spawn_checks(
        2,
        check_parity_with_torch_nested_groups,
        check_one_all_gather_and_a_reduction_per_dtype,
        check_wire_bytes_exact,
        check_policy_file_matches_the_argument,
    )


# ---- the planner and explain count it ----------------------------------------------------------------------
def test_planner_counts_overridden_parameters_in_their_dtypes() -> None:
    """The analytic estimate's per-group bytes: the norm's parameters all-gathered and reduced in fp32, the
    linears' in bf16, exactly (3 ranks, padded rows)."""
    from fsdp2lite.config import plan_config
    from fsdp2lite.estimate.plan_bytes import group_bytes

    model = NormNet()
    config = fl.FSDPConfig.model_validate(POLICY_FILE)
    plan = plan_config(model, config)
    assert sorted(plan.precision) == [f"blocks.{i}.norm.{n}" for i in range(2) for n in ("bias", "weight")]
    plain = fl.FSDPConfig.model_validate({k: v for k, v in POLICY_FILE.items() if k != "precision_overrides"})
    with_overrides, without = group_bytes(plan, 3), group_bytes(plan_config(model, plain), 3)
    block = model.blocks[0]
    norm_numel = sum(math.ceil(p.shape[0] / 3) * (p.numel() // p.shape[0]) for p in block.norm.parameters())
    for ours, theirs in zip(with_overrides[:2], without[:2]):
        assert ours.unsharded - theirs.unsharded == 3 * norm_numel * (4 - 2)  # fp32 instead of bf16, all ranks
        assert ours.reduced - theirs.reduced == 3 * norm_numel * (4 - 2)
    assert with_overrides[2] == without[2]  # the root has none


def test_explain_shows_overrides_and_a_rule_matching_nothing(tmp_path: Any, capsys: Any) -> None:
    import yaml

    from fsdp2lite.cli import main

    config = {**POLICY_FILE, "precision_overrides": [{"path": "blocks.*.norm*.*", "param_dtype": "fp32"}]}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({**config, "wrap": [{"match": {"class": "Block"}}]}))
    assert main(["explain", str(path), "--model", "fsdp2lite.models:gpt_small", "--world-size", "2"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "precision_overrides: float32/own x4" in out, out  # norm1 and norm2, weight and bias, per block
    config["precision_overrides"] = [{"path": "blocks.*.nrom.*", "param_dtype": "fp32"}]
    path.write_text(yaml.safe_dump(config))
    assert main(["explain", str(path), "--model", "fsdp2lite.models:gpt_small", "--world-size", "2"]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert all(part in out for part in ("precision_overrides.0", "'blocks.*.nrom.*'", "matches no parameter")), out


def test_policy_file_refuses_an_unknown_key(tmp_path: Any) -> None:
    import yaml

    from fsdp2lite.config import ConfigError

    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({**POLICY_FILE, "precision_overrides": [{"path": "*", "param_dtyp": "fp32"}]}))
    with pytest.raises(ConfigError) as caught:
        fl.FSDPConfig.from_yaml(path)
    (problem,) = caught.value.problems
    assert problem.location == "precision_overrides.0.param_dtyp" and "param_dtype" in problem.suggestion, problem


# ---- bad input: refused before anything changes ---------------------------------------------------------
def _params(model: nn.Module) -> dict[str, Any]:
    return {name: (type(p), p.dtype) for name, p in model.named_parameters()}


@pytest.mark.parametrize(
    ("overrides", "error", "pattern"),
    [
        ({"norm.*": "fp32"}, TypeError, r"mp_overrides\['norm\.\*'\] must be a MixedPrecisionPolicy.*got str"),
        (
            {"norm.weight": FP32, "norm.bias": fl.MixedPrecisionPolicy(param_dtype="fp32", output_dtype="fp32")},
            ValueError,
            r"one module \(Fp32Norm\) cast its inputs and outputs differently: norm\.weight \(inputs float32, "
            r"outputs bfloat16\) and norm\.bias \(inputs float32, outputs float32\)",
        ),
        ([("norm.*", FP32)], TypeError, r"mp_overrides must be a mapping of parameter-name patterns"),
        (
            lambda p: "fp32",
            TypeError,
            r"mp_overrides\('up\.weight'\) must be a MixedPrecisionPolicy .*or None, got str",
        ),
    ],
)
def test_bad_overrides_change_nothing(single_rank_pg: None, overrides: Any, error: type, pattern: str) -> None:
    block = Block(D)
    before = _params(block)
    with pytest.raises(error, match=pattern):
        fl.fully_shard(block, mp_policy=BF16, mp_overrides=overrides)
    assert not isinstance(block, fl.FSDPModule) and _params(block) == before


def test_a_pattern_matching_nothing_in_one_call_waits_for_the_root(single_rank_pg: None) -> None:
    """One mapping serves every call: a pattern matching nothing in one call is not an error there; one that
    matches nothing in any call under the root is refused at its first forward, naming the names it saw."""
    torch.manual_seed(0)
    model = NormNet()
    mapping = {"norm.*": FP32, "head.*": FP32}  # the blocks have no head, the root no norm
    for block in model.blocks:
        fl.fully_shard(block, mp_policy=BF16, mp_overrides=mapping)
    fl.fully_shard(model, mp_policy=BF16, mp_overrides=mapping)
    assert {p.param_dtype for p in model._fsdp_state.group.params} == {torch.float32}  # the head's override
    loss_of(model, 0, 0).backward()  # the root's lazy init: every pattern matched somewhere
    block = Block(D)
    fl.fully_shard(block, mp_policy=BF16, mp_overrides={"nrom.*": FP32})
    before = _params(block)
    with pytest.raises(
        ValueError,
        match=r"pattern 'nrom\.\*' matches no parameter in any fully_shard call under "
        r"Block; the calls' parameter names: up\.weight, up\.bias, norm\.weight",
    ):
        block(torch.randn(2, D))
    assert _params(block) == before and block._fsdp_state.role is Role.UNDECIDED


def test_quantized_all_gather_with_overrides_is_the_plans_problem() -> None:
    """``communication.all_gather: int8`` packs a group in one dtype: overrides giving it two are refused by the
    plan (``plan_config``, so ``validate``/``explain`` see it), naming both settings, before anything is built."""
    from fsdp2lite.config import plan_config

    config = fl.FSDPConfig.model_validate({**POLICY_FILE, "communication": {"all_gather": "int8"}})
    plan = plan_config(NormNet(), config)
    problems = [p for p in plan.problems + plan.refused if "quantizes" in p.message]
    assert len(problems) == 2, problems  # the two blocks (the root has no override)
    assert all(
        "all_gather='int8'" in p.message
        and "several dtypes (bfloat16, float32)" in p.message
        and "precision overrides" in p.message
        and "blocks." in p.message
        and "norm.weight" in p.message
        for p in problems
    ), problems


def test_hsdp_refuses_several_reduce_dtypes_and_takes_one() -> None:
    """On a 2-D mesh (one process as rank 1 of 4, fake process group) the step across replicas runs in one
    dtype: overrides giving the gradients two reduce dtypes are refused by name, nothing changed; overrides
    that keep one reduce dtype (fp32 everywhere) shard."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        block = Block(D)
        before = _params(block)
        with pytest.raises(ValueError, match=r"several reduce dtypes \(bfloat16: up\.weight.*float32: norm\.weight"):
            fl.fully_shard(block, mesh, mp_policy=BF16, mp_overrides=OVERRIDES)
        assert not isinstance(block, fl.FSDPModule) and _params(block) == before
        one_dtype = fl.MixedPrecisionPolicy(param_dtype="bf16", reduce_dtype="fp32")
        fl.fully_shard(block, mesh, mp_policy=one_dtype, mp_overrides=OVERRIDES)
        assert isinstance(block._fsdp_state.group.forms.reduce, SplitReduce)  # split, one part: issued as one
    finally:
        dist.destroy_process_group()
