"""Hugging Face transformers models sharded with fsdp2lite: what the README's "Hugging Face models"
section promises, on 2 gloo ranks against DDP and against the unsharded model.

- a decoder-layer rule (``configs/hf_causal_lm.yaml``'s, here in fp32) on Llama (untied head) and GPT-2
  (head tied to the token embedding): losses, gradients and parameters equal DDP's every step;
- HF's own gradient checkpointing (``use_reentrant=False``) on top of the sharded layers;
- ``generate`` after ``fl.register_fsdp_forward_method(model, "generate")`` equals the unsharded model's,
  also with different prompts per rank that stop at different lengths (``synced_gpus=True``);
- a full (unsharded) state dict loaded into the sharded model, each rank keeping its rows;
- the shipped ``configs/hf_causal_lm.yaml`` (bf16) against torch's ``fully_shard`` under the same policy.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers  # in fsdp2lite[dev] (and [hf]): a missing one fails here, it is never skipped
from _dist import cpu_mesh, spawn_checks
from _models import tiny_llama
from _parity import full, train_and_compare

import fsdp2lite as fl

REPO = Path(__file__).resolve().parents[1]
FP32_LAYERS = fl.FSDPConfig.model_validate(
    {"wrap": [{"match": {"class": ["LlamaDecoderLayer", "GPT2Block"]}}]}
)  # configs/hf_causal_lm.yaml's rule, without its bf16


def llama() -> nn.Module:
    torch.manual_seed(0)
    return tiny_llama()


def gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        vocab_size=96,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, 96, (2, 13), generator=torch.Generator().manual_seed(100 * step + rank))


def loss_fn(model: nn.Module, window: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=window[:, :-1], use_cache=False).logits
    return F.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten())


def shard(model: nn.Module) -> None:
    fl.apply_config(model, FP32_LAYERS, fl.init_mesh(device_type="cpu"))


def groups(model: nn.Module) -> int:
    return len({id(m._fsdp_state) for m in model.modules() if isinstance(m, fl.FSDPModule)})


def check_parity_llama_and_gpt2(rank: int, ws: int) -> None:
    for name, make in (("llama", llama), ("gpt2", gpt2)):
        model = make()
        train_and_compare(model, shard, batch, loss_fn, rank, steps=3, microbatches=2, label=name)
        assert groups(model) == 3, f"{name}: one group per decoder layer plus the root"
    tied = gpt2()
    shard(tied)
    assert tied.lm_head.weight is tied.transformer.wte.weight, "GPT-2's tied head stays tied after sharding"


def check_hf_gradient_checkpointing(rank: int, ws: int) -> None:
    model = llama()
    recomputed: list[int] = []
    model.model.layers[0].mlp.register_forward_pre_hook(lambda *_: recomputed.append(1))
    enable_hf_checkpointing(model)
    ref = llama()
    train_and_compare(model, shard, batch, loss_fn, rank, steps=2, ref=ref, label="hf checkpointing")
    assert len(recomputed) == 2 * 2, "each step runs layer 0's MLP twice: forward and its recompute"


def enable_hf_checkpointing(model: nn.Module) -> None:
    """HF's gradient checkpointing, by its name in transformers 5 or in 4."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def greedy(model: nn.Module, prompt: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    with torch.no_grad():
        mask = torch.ones_like(prompt)
        return model.generate(prompt, attention_mask=mask, max_new_tokens=6, do_sample=False, **kwargs)


def check_generate(rank: int, ws: int) -> None:
    for make in (llama, gpt2):
        ref = make()
        model = copy.deepcopy(ref)
        shard(model)
        fl.register_fsdp_forward_method(model, "generate")
        prompt = batch(0, 0)[:, :5]  # the same prompt on every rank
        assert torch.equal(greedy(model, prompt), greedy(ref, prompt))
    # different prompts per rank, and an EOS that stops rank 0 after one token while rank 1 goes on:
    # synced_gpus=True keeps rank 0 running forwards (and so all-gathers) until every rank is done
    prompts = [batch(1, r)[:1, :5] for r in range(ws)]
    eos = int(greedy(ref, prompts[0])[0, 5])
    expected = [greedy(ref, p, eos_token_id=eos, pad_token_id=eos) for p in prompts]
    assert expected[0].shape[1] == 6 and expected[1].shape[1] > 6, "rank 0 must stop first for this check"
    got = greedy(model, prompts[rank], eos_token_id=eos, pad_token_id=eos, synced_gpus=True)
    assert torch.equal(got, expected[rank]), (got, expected[rank])


def check_full_state_dict_into_sharded(rank: int, ws: int) -> None:
    source = llama()
    with torch.no_grad():
        for p in source.parameters():
            p.add_(1.0)  # differs from a fresh model's init
    target = llama()
    shard(target)
    target.load_state_dict(source.state_dict())  # plain full tensors: each rank keeps its own rows
    expected: dict[str, Any] = dict(source.named_parameters())
    for name, param in target.named_parameters():
        assert torch.equal(full(param), expected[name]), name
    window = batch(1, 0)
    torch.testing.assert_close(loss_fn(target, window), loss_fn(source, window), rtol=1e-5, atol=1e-6)


def check_shipped_bf16_config_against_torch(rank: int, ws: int) -> None:
    """configs/hf_causal_lm.yaml (bf16 compute, fp32 reduction) against torch's fully_shard under the
    same policy: the losses of 3 AdamW steps, the gradients' dtype and their placements."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    ours = llama()
    theirs = copy.deepcopy(ours)
    fl.apply_config(
        ours, fl.FSDPConfig.from_yaml(REPO / "configs" / "hf_causal_lm.yaml"), fl.init_mesh(device_type="cpu")
    )
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in theirs.model.layers:
        torch_fully_shard(layer, mesh=cpu_mesh(), mp_policy=policy)
    torch_fully_shard(theirs, mesh=cpu_mesh(), mp_policy=policy)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs)]
    for step in range(3):
        window = batch(step, rank)
        losses = [loss_fn(model, window) for model in (ours, theirs)]
        for loss in losses:
            loss.backward()
        torch.testing.assert_close(
            losses[0], losses[1], rtol=2e-3, atol=2e-3, msg=lambda m, step=step: f"step {step}: {m}"
        )
        for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
            assert p.grad.dtype == q.grad.dtype == torch.float32 and p.grad.placements == q.grad.placements, name
        for opt in optimizers:
            opt.step()
            opt.zero_grad()


def test_hf_models_on_two_ranks() -> None:
    spawn_checks(
        2,
        check_parity_llama_and_gpt2,
        check_hf_gradient_checkpointing,
        check_generate,
        check_full_state_dict_into_sharded,
    )
