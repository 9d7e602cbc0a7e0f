"""bitsandbytes 4-bit weights sharded through the all-gather extension hooks (issue 44 item 6 (c);
fsdp2lite/integrations/bitsandbytes.py). A QLoRA-shaped model (frozen Linear4bit bases, trainable low-rank
adapters) in uint8 and bf16 storage, made shardable, on 2 gloo ranks (and 3, rows not dividing): each rank
holds exactly its rows of the 4-bit codes (half on 2 ranks), and the losses, adapter grads and values equal
the replicated run's (the 4-bit weights in ``ignored_params``, as Accelerate leaves them) bit for bit; the
full state dict gives the codes back. Across train/eval switches and a forward that rewrites the gathered
weight in place (bitsandbytes' CPU repacking), every forward stays right. Accelerate's preparation keeps its
rules for 4-bit models. Bad input: a trainable 4-bit weight is refused, naming it, with nothing changed.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
from _dist import cpu_mesh, spawn_checks
from torch.distributed.tensor import DTensor

import fsdp2lite as fl

D, RANK = 64, 4  # bitsandbytes quantizes in blocks of 64 values; its CPU repacking wants rows % 32 == 0


class Block(nn.Module):
    """A frozen 4-bit projection with a trainable low-rank adapter beside it (QLoRA's shape)."""

    def __init__(self, storage: torch.dtype) -> None:
        super().__init__()
        from bitsandbytes.nn import Linear4bit

        self.base = Linear4bit(D, D, bias=False, compute_dtype=torch.float32, quant_type="nf4", quant_storage=storage)
        self.lora_a = nn.Linear(D, RANK, bias=False)
        self.lora_b = nn.Linear(RANK, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.base(x) + self.lora_b(self.lora_a(x)))


def _model(storage: torch.dtype = torch.uint8) -> nn.Sequential:
    """Two blocks; the 4-bit codes in ``storage`` (bitsandbytes' default uint8, or bf16 as torch's path wants)."""
    torch.manual_seed(0)
    model = nn.Sequential(Block(storage), Block(storage))
    model.to("cpu")  # bitsandbytes quantizes a Linear4bit's weight when it is moved to its device
    for block in model:
        block.base.weight.requires_grad_(False)
    return model


def _shard(model: nn.Sequential, replicated: bool) -> None:
    mesh = cpu_mesh()
    ignored = {block.base.weight for block in model} if replicated else None  # Accelerate's exclusion
    if not replicated:
        from fsdp2lite.integrations.bitsandbytes import make_4bit_shardable

        assert make_4bit_shardable(model) == ["0.base.weight", "1.base.weight"]
    for block in model:
        fl.fully_shard(block, mesh=mesh, ignored_params=ignored)
    fl.fully_shard(model, mesh=mesh, ignored_params=ignored)


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(3, D, generator=torch.Generator().manual_seed(100 * step + rank))


def _train(model: nn.Module, steps: range, rank: int) -> list[float]:
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    losses = []
    for step in steps:
        loss = model(_batch(step, rank)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _codes_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of 4-bit codes this rank holds, bytes of the whole weights)."""
    weights = [block.base.weight for block in model]
    held = sum((w.to_local() if isinstance(w, DTensor) else w).nbytes for w in weights)
    return held, sum(w.numel() * w.element_size() for w in weights)


def check_sharded_equals_replicated(rank: int, world_size: int) -> None:
    from bitsandbytes.nn import Params4bit
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from fsdp2lite.integrations.bitsandbytes import Bnb4bitWeight

    for storage in (torch.uint8, torch.bfloat16):
        sharded, replicated = _model(storage), _model(storage)
        codes = {name: p.detach().clone() for name, p in sharded.named_parameters() if isinstance(p, Params4bit)}
        _shard(sharded, replicated=False)
        _shard(replicated, replicated=True)
        whole = sum(c.nbytes for c in codes.values())  # 2 blocks * 64 * 64 / 2 = 4,096 bytes
        assert whole == 4096 and _codes_bytes(replicated) == (whole, whole)
        # this rank's rows of each weight, as torch.chunk splits them: half on 2 ranks; 683, 683, 682 of 2,048 on 3
        mine = sum(c[:, 0].chunk(world_size)[rank].nbytes for c in codes.values())
        assert _codes_bytes(sharded) == (mine, whole) and (world_size != 2 or mine == whole // 2), _codes_bytes(sharded)
        assert type(sharded[0].base.weight.to_local()) is Bnb4bitWeight
        assert not sharded[0].base.support_avx512bf16_for_cpu  # [Note: bitsandbytes' CPU repacking]
        losses = _train(sharded, range(3), rank)
        assert losses == _train(replicated, range(3), rank), (storage, losses)  # the same codes, the same kernels
        for (name, mine), (_, theirs) in zip(sharded.named_parameters(), replicated.named_parameters()):
            if mine.requires_grad:
                assert torch.equal(mine.full_tensor(), theirs.full_tensor()), name
        full = get_model_state_dict(sharded, options=StateDictOptions(full_state_dict=True))
        for name, value in codes.items():  # compared as bytes: codes in bf16 storage hold NaN patterns
            assert type(full[name]) is torch.Tensor and torch.equal(
                full[name].view(torch.uint8), value.view(torch.uint8)
            )


def check_train_eval_switches(rank: int, world_size: int) -> None:
    """Eval forwards (no grad) between training steps change nothing: the following training losses equal a
    run without them, and an eval loss equals the train-mode loss of the same weights."""
    switched, straight = _model(), _model()
    _shard(switched, replicated=False)
    _shard(straight, replicated=False)
    losses = _train(switched, range(2), rank)
    for _ in range(2):
        with torch.no_grad():
            train_mode = switched(_batch(9, rank)).pow(2).mean()
            switched.eval()
            assert torch.equal(switched(_batch(9, rank)).pow(2).mean(), train_mode)
        switched.train()
        losses += _train(switched, range(len(losses), len(losses) + 2), rank)
    assert losses == _train(straight, range(6), rank), losses


def check_a_rewritten_gather_is_put_back(rank: int, world_size: int) -> None:
    """bitsandbytes' CPU repacking, done by hand on the unsharded weight (new .data, its QuantState rewritten):
    the whole state kept by the shard is untouched, and the next gather hands out the original again."""
    from bitsandbytes.functional import _convert_weight_packed_for_cpu

    model = _model()
    _shard(model, replicated=False)
    x = _batch(0, rank)
    kept = model[0].base.weight.to_local().quantization.quant_state  # the whole state, kept by the shard
    snapshot = dict(vars(kept))
    with torch.no_grad():
        before = model(x)
        model[0].unshard()
        weight = model[0].base.weight  # the unsharded Gathered4bit
        weight.data, _ = _convert_weight_packed_for_cpu(weight.data, weight.quant_state)
        assert weight.quant_state.packing_format_for_cpu and weight.shape == (D, D // 2)
        model[0].reshard()
        assert vars(kept).keys() == snapshot.keys() and all(vars(kept)[k] is v for k, v in snapshot.items())
        assert torch.equal(model(x), before)


def test_bitsandbytes_4bit_sharded_world2() -> None:
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed: pip install bitsandbytes")
    spawn_checks(2, check_sharded_equals_replicated, check_train_eval_switches, check_a_rewritten_gather_is_put_back)


def test_bitsandbytes_4bit_sharded_unevenly_world3() -> None:
    """3 ranks: rows that do not divide (no block alignment is needed: the quantization state is whole)."""
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed: pip install bitsandbytes")
    spawn_checks(3, check_sharded_equals_replicated)


def test_trainable_4bit_weight_refused_with_nothing_changed() -> None:
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed: pip install bitsandbytes")
    from fsdp2lite.integrations.bitsandbytes import make_4bit_shardable

    model = _model(torch.bfloat16)  # a float storage can require grad
    model[1].base.weight.requires_grad_(True)
    before: dict[str, Any] = {name: p for name, p in model.named_parameters()}
    repacking = model[0].base.support_avx512bf16_for_cpu
    with pytest.raises(ValueError, match=r"1\.base\.weight requires grad: 4-bit weights are a frozen base") as info:
        make_4bit_shardable(model)
    assert "0.base.weight" not in str(info.value)  # the good one is not named
    assert all(p is before[name] for name, p in model.named_parameters())  # all or nothing
    assert model[0].base.support_avx512bf16_for_cpu == repacking


class _Plugin:
    cpu_ram_efficient_loading = True


class _Accelerator:
    mixed_precision = "bf16"

    def __init__(self) -> None:
        self.state = type("State", (), {"fsdp_plugin": _Plugin()})()


def test_accelerate_preparation_keeps_its_4bit_rules() -> None:
    """install()'s preparation: 4-bit weights made shardable before Accelerate's own, which still reads the
    model as a 4-bit one (mixed precision "no" for its fp32-upcast check, cpu_ram_efficient_loading off), the
    plugin's setting put back after; a model without 4-bit weights gets the accelerator as it is."""
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed: pip install bitsandbytes")
    pytest.importorskip("accelerate", reason="accelerate is not installed: pip install -e '.[dev]'")
    from fsdp2lite.integrations.accelerate import prepare_4bit_too
    from fsdp2lite.integrations.bitsandbytes import Bnb4bitWeight

    seen: list[tuple[Any, ...]] = []

    def prepare(accelerator: Any, model: nn.Module) -> nn.Module:
        weight = model[0].base.weight if isinstance(model, nn.Sequential) else None
        seen.append((accelerator.mixed_precision, accelerator.state.fsdp_plugin.cpu_ram_efficient_loading, weight))
        return model

    accelerator = _Accelerator()
    prepare_4bit_too(prepare, accelerator, _model())
    assert seen[0][:2] == ("no", False) and type(seen[0][2]) is Bnb4bitWeight
    assert accelerator.state.fsdp_plugin.cpu_ram_efficient_loading  # put back
    prepare_4bit_too(prepare, accelerator, nn.Linear(2, 2))
    assert seen[1] == ("bf16", True, None)


def test_enable_fsdp_on_cpu_refuses_what_is_not_a_plugin() -> None:
    pytest.importorskip("accelerate", reason="accelerate is not installed: pip install -e '.[dev]'")
    from fsdp2lite.integrations.accelerate import enable_fsdp_on_cpu

    accelerator = _Accelerator()
    with pytest.raises(TypeError, match="a FullyShardedDataParallelPlugin or a dict of its arguments, got str"):
        enable_fsdp_on_cpu(accelerator, "full_shard")
    assert not hasattr(accelerator.state, "distributed_type")  # nothing set
