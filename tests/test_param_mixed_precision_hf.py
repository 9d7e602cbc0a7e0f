"""Per-parameter mixed precision on the models people use ([Note: override casts] in _runtime/module_casts.py).

The README's own example, ``mp_overrides={"*norm*": MixedPrecisionPolicy(param_dtype=torch.float32)}``, on tiny
Hugging Face Llama and Qwen2 (RMSNorm: ``weight * hidden.to(input_dtype)`` hands fp32 to the next bf16 Linear
unless the norm's output is cast) and GPT-2 (``nn.LayerNorm``, named ``ln_*``), bottom-up with one mapping for
every call. Oracle: torch's ``fully_shard`` with every norm a nested group of its own under
``MixedPrecisionPolicy(param_dtype=fp32, output_dtype=bf16)``, the way torch keeps norms in fp32; 3 AdamW steps on
2 gloo ranks, losses, gradients and parameters equal bit for bit.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
import transformers  # in fsdp2lite[dev] (and [hf]): a missing one fails here, it is never skipped
from _dist import cpu_mesh, spawn_checks

import fsdp2lite as fl
from fsdp2lite._runtime.states import Role

BF16 = fl.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
FP32 = fl.MixedPrecisionPolicy(param_dtype=torch.float32)
VOCAB = 96


# the decoder shape Llama and Qwen2 share: 2 layers, grouped-query attention
DECODER = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def llama() -> nn.Module:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**DECODER))


def qwen2() -> nn.Module:
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**DECODER))


def gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0
    )
    config.attn_pdrop = 0.0
    return transformers.GPT2LMHeadModel(config)


def layers_of(model: nn.Module) -> list[nn.Module]:
    return list(model.model.layers) if hasattr(model, "model") else list(model.transformer.h)


def norms_of(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith(("RMSNorm", "LayerNorm"))]


def shard_ours(model: nn.Module, overrides: dict[str, Any]) -> nn.Module:
    """Bottom-up, the same mapping for every call."""
    for layer in layers_of(model):
        fl.fully_shard(layer, mp_policy=BF16, mp_overrides=overrides)
    return fl.fully_shard(model, mp_policy=BF16, mp_overrides=overrides)


def shard_torch(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = cpu_mesh()
    norm_policy = TorchMP(param_dtype=torch.float32, output_dtype=torch.bfloat16)
    for norm in norms_of(model):
        torch_fully_shard(norm, mesh=mesh, mp_policy=norm_policy)
    for layer in layers_of(model):
        torch_fully_shard(layer, mesh=mesh, mp_policy=TorchMP(param_dtype=torch.bfloat16))
    return torch_fully_shard(model, mesh=mesh, mp_policy=TorchMP(param_dtype=torch.bfloat16))


def loss_of(model: nn.Module, step: int, rank: int) -> torch.Tensor:
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(100 * step + rank))
    return model(input_ids=ids, labels=ids).loss


def check_parity(make: Callable[[], nn.Module], overrides: dict[str, Any], rank: int) -> None:
    torch.manual_seed(0)
    reference = make()
    ours, theirs = shard_ours(copy.deepcopy(reference), overrides), shard_torch(copy.deepcopy(reference))
    overridden = {name for name, _ in ours.named_parameters() if "norm" in name or ".ln_" in name}
    assert overridden and len(norms_of(ours)) == len(norms_of(theirs)) > 2  # every norm, the final one too
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs)]
    for step in range(3):
        losses = [loss_of(model, step, rank) for model in (ours, theirs)]
        for loss in losses:
            loss.backward()
        assert torch.equal(losses[0].detach(), losses[1].detach()), (make.__name__, step, losses)
        for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
            assert torch.equal(a.grad.full_tensor(), b.grad.full_tensor()), (make.__name__, step, name)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        assert torch.equal(a.full_tensor(), b.full_tensor()), (make.__name__, name)


def check_llama(rank: int, ws: int) -> None:
    """The README's mapping as written."""
    check_parity(llama, {"*norm*": FP32}, rank)


def check_qwen2_one_mapping_for_every_call(rank: int, ws: int) -> None:
    """Each call matches only some patterns: the layers' norms in the layer calls, the final norm at the root."""
    check_parity(qwen2, {"*layernorm*": FP32, "model.norm.weight": FP32}, rank)


def check_gpt2(rank: int, ws: int) -> None:
    check_parity(gpt2, {"*.ln_*": FP32, "ln_*": FP32}, rank)


def check_norm_casts(rank: int, ws: int) -> None:
    """Inside the bf16 layer the norm sees fp32 inputs and weight, and hands bf16 to the next Linear."""
    torch.manual_seed(0)
    model = shard_ours(llama(), {"*norm*": FP32})
    seen: dict[str, torch.dtype] = {}
    layer = model.model.layers[0]
    layer.input_layernorm.register_forward_hook(
        lambda m, args, out: seen.update(input=args[0].dtype, weight=m.weight.dtype)
    )
    layer.self_attn.q_proj.register_forward_pre_hook(lambda m, args: seen.update(q_in=args[0].dtype))
    loss_of(model, 0, rank).backward()
    assert seen == {"input": torch.float32, "weight": torch.float32, "q_in": torch.bfloat16}, seen


def test_hf_models_keep_norms_in_fp32_like_torchs_nested_groups() -> None:
    spawn_checks(2, check_norm_casts, check_llama, check_qwen2_one_mapping_for_every_call, check_gpt2)


# ---- one process: what is refused, and when -----------------------------------------------------------------
def _params(model: nn.Module) -> dict[str, Any]:
    return {name: (type(p), p.dtype, p.data_ptr()) for name, p in model.named_parameters()}


def test_a_pattern_matching_nothing_anywhere_is_refused_at_the_first_forward(single_rank_pg: None) -> None:
    """A pattern may match nothing in one call; one that matched nothing in any call under the root is a typo,
    refused by the root's lazy init (the first forward) before anything runs, naming the pattern."""
    torch.manual_seed(0)
    model = shard_ours(llama(), {"*norm*": FP32, "*layernrom*": FP32})
    before = _params(model)
    with pytest.raises(ValueError, match=r"pattern '\*layernrom\*' matches no parameter in any fully_shard call"):
        loss_of(model, 0, 0)
    assert _params(model) == before and model._fsdp_state.role is Role.UNDECIDED  # lazy init did not run


def test_one_module_given_two_casts_is_refused_before_anything_changes(single_rank_pg: None) -> None:
    """Two overrides asking one module for different casts name both parameters; nothing is sharded."""
    torch.manual_seed(0)
    model = gpt2()
    layer = model.transformer.h[0]
    before = _params(layer)
    fp16 = fl.MixedPrecisionPolicy(param_dtype=torch.float16)
    with pytest.raises(ValueError, match=r"one module \(LayerNorm\).*ln_1\.weight \(inputs float32.*ln_1\.bias"):
        fl.fully_shard(layer, mp_policy=BF16, mp_overrides={"ln_1.weight": FP32, "ln_1.bias": fp16})
    assert not isinstance(layer, fl.FSDPModule) and _params(layer) == before


@pytest.mark.parametrize(
    ("override", "inside", "out"),
    [
        (FP32, torch.float32, torch.bfloat16),  # the default: back to the group's compute dtype
        (fl.MixedPrecisionPolicy(param_dtype=torch.float32, output_dtype=torch.float32), torch.float32, torch.float32),
        (fl.MixedPrecisionPolicy(param_dtype=torch.float32, cast_forward_inputs=False), torch.bfloat16, torch.bfloat16),
    ],
)
def test_an_overrides_casts_follow_its_policy(
    single_rank_pg: None, override: fl.MixedPrecisionPolicy, inside: torch.dtype, out: torch.dtype
) -> None:
    """The norm's inputs cast to the override's param_dtype unless ``cast_forward_inputs=False``; its outputs
    to the override's ``output_dtype``, else to the group's compute dtype."""
    torch.manual_seed(0)
    layer = layers_of(llama())[0]
    fl.fully_shard(layer, mp_policy=BF16, mp_overrides={"*norm*": override})
    layer.unshard()
    norm, seen = layer.input_layernorm, {}
    norm.register_forward_pre_hook(lambda m, args: seen.update(inside=args[0].dtype, weight=m.weight.dtype))
    output = norm(torch.randn(2, 3, 32, dtype=torch.bfloat16))
    assert seen == {"inside": inside, "weight": torch.float32} and output.dtype == out, (seen, output.dtype)
