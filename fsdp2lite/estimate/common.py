"""What both estimate methods share: the result record, the default config, building the model and one
step's inputs, the optimizer, and byte arithmetic of shards."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn as nn

from .._runtime.layout import ShardLayout
from ..config import FSDPConfig, Match, Plan, WrapRule, plan_config

BREAKDOWN_KEYS = ("params", "unsharded_params", "grads", "optimizer", "activations", "comm_buffers")
OPTIMIZERS = ("adamw", "sgd", "none")
METHODS = ("simulate", "analytic")
DEVICES = ("cuda", "cpu")


@dataclass(frozen=True)
class MemoryEstimate:
    """The peak of one steady-state training step on one rank, and what it is made of."""

    world_size: int
    rank: int
    peak_bytes: int
    phase: str  # "forward", "backward" or "optimizer"
    group: str | None  # the group live at the peak ("" is the root), when in forward or backward
    breakdown: dict[str, int]  # BREAKDOWN_KEYS -> bytes; sums to peak_bytes
    method: str
    device: str
    notes: tuple[str, ...] = field(default=())  # analytic: the formula and which term dominates
    host_bytes: int = 0  # with CPU offload: shards, their gradients and optimizer state on the host
    finetune: str = "full"  # what is trained: full, lora or qlora (estimate.finetune)
    reserved_bytes: int = 0  # target cuda: what the caching allocator reserves at the peak (estimate.reserved)
    reserved_expandable_bytes: int = 0  # the same with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    host_exact_bytes: int = 0  # host_bytes at the sizes asked for, before the pinned allocator rounds them
    nvme_bytes: int = 0  # with optimizer: nvme, the optimizer state in files; read and written once per step
    host_bytes_step_in_backward: int = 0  # host_bytes when each group steps in backward (fsdp2lite.step_in_backward)

    def to_json(self) -> dict[str, Any]:
        """The documented JSON record (``fsdp2lite estimate --json``)."""
        record = asdict(self)
        record["notes"] = list(self.notes)
        return record


def cached_plan(cache: dict[Any, Any] | None, model: nn.Module, config: FSDPConfig) -> Plan:
    """``plan_config(model, config)``, made once per config in ``cache`` (a dict kept with ``model`` across the
    settings of a budget search, which plans each setting's config up to four times); read-only."""
    if cache is None:
        return plan_config(model, config)
    key = ("plan", id(model), config.model_dump_json())
    if key not in cache:
        cache[key] = plan_config(model, config)
    plan: Plan = cache[key]
    return plan


# ---- inputs and the step ------------------------------------------------------------------------
HF_DEFAULT_SEQ = 2048  # a Hugging Face model's tokens per sequence when --seq is not given (capped by its limit)


def token_spec(model: nn.Module) -> tuple[int, int] | None:
    """(vocab size, longest sequence) of a token model: fsdp2lite's GPT (``cfg.vocab_size``,
    ``cfg.seq_len``) or a Hugging Face causal LM (``config.vocab_size``, ``config.max_position_embeddings``);
    None for other models."""
    cfg = getattr(model, "cfg", None)
    vocab, max_seq = getattr(cfg, "vocab_size", None), getattr(cfg, "seq_len", None)
    if isinstance(vocab, int) and isinstance(max_seq, int):
        return vocab, max_seq
    if is_hf_model(model):
        config = model.config  # type: ignore[union-attr]
        vocab, max_seq = getattr(config, "vocab_size", None), getattr(config, "max_position_embeddings", None)
        if isinstance(vocab, int) and isinstance(max_seq, int):
            return vocab, max_seq
    return None


def is_hf_model(model: nn.Module) -> bool:
    """A Hugging Face model: a ``config`` with ``model_type``, trained through its own ``output.loss``."""
    return isinstance(getattr(getattr(model, "config", None), "model_type", None), str)


def default_seq(model: nn.Module, seq: int | None) -> int:
    """``seq``, or a token model's default: its ``seq_len``, or a Hugging Face model's
    ``min(max_position_embeddings, HF_DEFAULT_SEQ)``; 1 for other models without ``seq``."""
    spec = token_spec(model)
    if seq is not None or spec is None:
        return seq or 1
    return min(spec[1], HF_DEFAULT_SEQ) if is_hf_model(model) else spec[1]


def token_inputs(model: nn.Module, batch: int, seq: int | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(tokens, targets) of shape (batch, seq) for a token model (``token_spec``); None for others. A
    Hugging Face model gets ``input_ids`` and ``labels`` (its loss shifts them itself)."""
    spec = token_spec(model)
    if spec is None:
        return None
    vocab, max_seq = spec
    hf = is_hf_model(model)
    seq = default_seq(model, seq)
    if seq > max_seq:
        limit = "max_position_embeddings" if hf else "seq_len"
        raise ValueError(f"seq={seq} is longer than the model's {limit} ({max_seq})")
    if hf:
        tokens = torch.randint(0, vocab, (batch, seq))
        return tokens, tokens
    tokens = torch.randint(0, vocab, (batch, seq + 1))
    return tokens[:, :-1], tokens[:, 1:]


def step_loss(model: nn.Module, inputs: tuple[Any, ...], token_model: bool) -> torch.Tensor:
    """The scalar a step backpropagates: a Hugging Face model's loss as ``examples/train.py`` computes it (its
    head and loss run by run where the head is frozen, ``finetune.head_loss``; else its ``output.loss``),
    ``model.loss(...)`` if the model has one, else the output's mean."""
    if token_model and is_hf_model(model):
        from ..finetune.head_loss import IGNORE_INDEX, causal_lm_loss

        tokens, labels = inputs[0], inputs[1]
        shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)  # as Hugging Face's loss shifts
        chunked = causal_lm_loss(model, tokens, shifted, reduction="mean")
        return chunked if chunked is not None else model(input_ids=tokens, labels=labels).loss
    loss_fn = getattr(model, "loss", None)
    if callable(loss_fn) and (token_model or len(inputs) > 1):
        return loss_fn(*inputs)
    output = model(*(inputs[:1] if token_model else inputs))
    return first_floating(output).float().mean()


def first_floating(output: Any) -> torch.Tensor:
    """The model output a loss is taken of: the output itself, or its first floating-point tensor."""
    from torch.utils._pytree import tree_flatten

    if isinstance(output, torch.Tensor):
        return output
    return next(t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.is_floating_point())


def materialized(model: Any) -> nn.Module:
    """A factory's model, with parameters made on the meta device given (fake) storage."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"the model factory must return an nn.Module, got {type(model).__name__}")
    if any(p.device.type == "meta" for p in model.parameters()):
        model.to_empty(device="cpu")  # fake tensors: shapes only
    return model


def step_inputs(
    model: nn.Module, inputs_fn: Callable[[], Any] | None, batch: int, seq: int | None
) -> tuple[tuple[Any, ...], bool]:
    """(one rank's inputs, whether they are token model inputs (tokens, targets))."""
    if inputs_fn is not None:
        value = inputs_fn()
        return (value if isinstance(value, tuple) else (value,)), False
    tokens = token_inputs(model, batch, seq)
    if tokens is None:
        raise ValueError(
            f"{type(model).__name__} is not a token model (neither fsdp2lite's cfg.vocab_size/seq_len nor a Hugging "
            "Face config.vocab_size/max_position_embeddings): pass inputs=..., "
            "a function returning one rank's example inputs (CLI: --inputs MODULE:FN)"
        )
    return tokens, True


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


def fsdp_params(model: nn.Module) -> list[Any]:
    """Every FSDPParam of a sharded model, once (tied parameters and list groups included)."""
    found: dict[int, Any] = {}
    for module in model.modules():
        state = getattr(module, "_fsdp_state", None)
        if state is not None and state.group is not None:
            found.update((id(param), param) for param in state.group.params)
    return list(found.values())


def make_optimizer(name: str, model: nn.Module, device: str) -> torch.optim.Optimizer | None:
    """The optimizer as the target device would run it: CUDA defaults to the foreach implementation
    (one temporary per parameter at once), CPU to the per-tensor loop."""
    foreach = device == "cuda"
    params = [p for p in model.parameters() if p.requires_grad]  # a frozen base gets no optimizer state
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-4, foreach=foreach)
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-4, momentum=0.9, foreach=foreach)
    return None


# ---- the default config ---------------------------------------------------------------------------
def default_config(model: nn.Module) -> FSDPConfig:
    """A Hugging Face model: one group per module of its ``_no_split_modules`` classes (its decoder layers,
    what Accelerate and transformers shard), the rest in the root. Others: one group per repeated block
    (of the module classes that appear more than once with parameters, the one with the most parameters
    per instance), the rest in the root: what ``configs/demo.yaml`` does for the GPT."""
    present = {type(module).__name__ for module in model.modules()}
    no_split = [name for name in getattr(model, "_no_split_modules", None) or () if name in present]
    if no_split:
        rules = [WrapRule(match=Match(class_=sorted(no_split)))]
        ends = _embedding_and_head(model)
        if ends:  # a group each, gathered only where used (a tied pair: one): configs/hf_causal_lm.yaml's rule
            rules.append(WrapRule(match=Match(path=ends), group="tied"))
        return FSDPConfig(wrap=rules)
    counts: Counter[str] = Counter()
    sizes: Counter[str] = Counter()
    for _, module in model.named_modules():
        name = type(module).__name__
        numel = sum(p.numel() for p in module.parameters())
        if numel and type(module).forward is not nn.Module.forward and module is not model:
            counts[name] += 1
            sizes[name] += numel
    repeated = [name for name, n in counts.items() if n > 1]
    if not repeated:
        return FSDPConfig()
    block = max(repeated, key=lambda name: (sizes[name] / counts[name], counts[name]))  # the largest unit
    return FSDPConfig(wrap=[WrapRule(match=Match(class_=block))])


def _embedding_and_head(model: nn.Module) -> list[str]:
    """Globs of the paths of a Hugging Face model's token embedding and output head (``get_input_embeddings``
    and ``get_output_embeddings``), those it has: each path as it is and under any prefix (peft's
    ``base_model.model.``, which the model ``examples/train.py`` shards has)."""
    ends = []
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        find = getattr(model, getter, None)
        module = find() if callable(find) else None
        path = next((p for p, m in model.named_modules() if m is module and p), None) if module is not None else None
        if path is not None:
            ends += [path, f"*.{path}"]
    return ends


def sharded_nbytes(param: torch.Tensor, shard: int, dim: int = 0) -> int:
    """Bytes of one rank's padded shard of ``param`` sharded on ``dim`` over ``shard`` ranks:
    ``ceil(size(dim) / shard)`` rows of the other dims' elements (what ``fully_shard`` allocates: its
    ``ShardLayout``, [Note: padded shard] in _runtime/layout.py)."""
    if param.dim() == 0:
        return param.element_size()  # cannot be sharded: plan_config reports it
    return ShardLayout(tuple(param.shape), dim % param.dim(), shard, 0).padded_numel * param.element_size()


def offloaded_share(model: nn.Module) -> tuple[int, float]:
    """(bytes of the shards on the host, the share of all shard bytes whose gradients and optimizer state are
    on the host) of a sharded model: ``CPUOffloadPolicy`` moves both, ``optimizer_only`` keeps its shards on
    the device and moves its gradients and optimizer state."""
    sizes = [
        (param.padded_shard.untyped_storage().nbytes(), param.home.on_host, param.grads_on_host)
        for param in fsdp_params(model)
    ]
    total = sum(nbytes for nbytes, _, _ in sizes)
    offloaded = sum(nbytes for nbytes, offload, _ in sizes if offload)
    state = sum(nbytes for nbytes, _, on_host in sizes if on_host)
    return offloaded, (state / total if total else 0.0)


@dataclass(frozen=True)
class GroupBytes:
    """One group's bytes on a rank (all padded as the all-gather lays them out)."""

    sharded: int  # its shards as stored (NF4 weights at NF4_BITS)
    trainable: int  # the shards of its trainable parameters (= their sharded gradients)
    unsharded: int  # the all-gather's output: every parameter in param_dtype (NF4 weights still NF4)
    unsharded_grads: int  # the unsharded gradients of its trainable parameters, in param_dtype
    reduced: int  # the reduce-scatter input: trainable parameters' gradients in reduce_dtype
    pinned: int  # with CPU offload: its host shards and gradient buffer as the (pinned) allocator sizes them
    host_exact: int = 0  # the same at the sizes asked for ([Note: host bytes])
    state_file: int = 0  # optimizer: nvme: one state tensor per trainable shard, as its file lays them out
    state_slot: int = 0  # the same as a staging slot lays them out
    grad_buffer: int = 0  # with CPU offload: its host gradient buffer (in ``pinned`` and ``host_exact``)
