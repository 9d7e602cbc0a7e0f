"""``estimate_memory(method="analytic")``: a closed form from the plan, plus one traced forward for activations.

Terms, per rank (bytes):
    S   the sharded parameters: each group's padded shards as stored (whole for ignored ones); qlora's
        adapted base weights at NF4's 4.127 bits (``finetune.NF4_BITS``)
    S_t the shards of the trainable parameters (full: S; lora/qlora: the adapters), = their sharded gradients
    O   optimizer state of the trainable parameters: AdamW 2 S_t (+ a step counter per tensor), SGD with
        momentum S_t, none 0. HFSDP groups (``sharding.replicate: optimizer``) count 1/replicate of their
        trainable shards in S_t (hence O): masters, gradients and state are split across the replicas
    R   the root group's unsharded parameters (kept between forward and backward), in param_dtype (NF4
        weights gathered as NF4), padded as the all-gather lays them out (shard degree x padded chunk: at
        large world sizes, mostly padding); R_g its trainable parameters' unsharded gradients
    B   the largest other group's unsharded parameters, padded the same way; B_g its unsharded gradients,
        B_r the same in reduce_dtype (the reduce-scatter input)
    Z   ZeRO-1/2 (``sharding.shard: optimizer``): the resident groups' unsharded parameters, there in every
        phase (B is then the largest group still gathered per use); Z_r a resident root's R, kept through
        the optimizer step too
    A   activations autograd saves in one forward of the plain model (traced on fake tensors, each storage
        counted once), incl. the loss's; with activation checkpointing, traced with it (block inputs)
    A_r with activation checkpointing: one checkpointed module's activations, recomputed in its backward
    L   the model output (logits), at the size the loss saves it (an fp32 upcast for Hugging Face models):
        backward starts with two temporaries of its size
Candidates for the peak:
    backward, at its start:   S + O + R + Z + A + 2 L
    backward, in a block:     S + O + R + R_g + 2 B + B_g + B_r + Z + A - L + A_r (root params and grads,
                              a block's params, grads, reduce buffer, prefetched all-gather; activations bound)
    optimizer step:           S + S_t + O + T + Z + Z_r (sharded grads, the foreach temporaries)
Full training has R_g = R and B_g = B. The largest is the estimate; the notes name it and its largest term.
With CPU offload, the offloaded groups' shards, sharded gradients and optimizer state leave the device
and are counted as ``host_bytes`` (``optimizer_only``: the shards stay, a master copy of them goes):
each group's shards and gradient buffer in buffers of their exact size (NF4 and HFSDP shards at the pinned
allocator's power-of-two sizes, ``finetune.pinned_nbytes``, on a CUDA target), the optimizer state at its size;
``optimizer: nvme`` groups' state in files instead, through two staging buffers ([Note: host bytes]).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from ..config import FSDPConfig, checkpoint_forward
from .common import (
    MemoryEstimate,
    cached_plan,
    default_config,
    element_size,
    first_floating,
    materialized,
    step_inputs,
    step_loss,
    token_spec,
)
from .finetune import Finetune
from .finetune_trace import block_list
from .finetune_walk import walk_estimate
from .host import host_note
from .plan_bytes import finetune_note, memory_terms, nf4_paths
from .reserved import from_ratio


def analytic_estimate(
    model_fn: Callable[[], nn.Module],
    config: FSDPConfig | None,
    world_size: int,
    rank: int,
    inputs_fn: Callable[[], Any] | None,
    batch: int,
    seq: int | None,
    optimizer: str,
    device: str,
    cache: dict[Any, Any] | None = None,
    finetune: Finetune | None = None,
) -> MemoryEstimate:
    """The closed form (module docstring). ``cache``: a dict kept across calls on the same model, batch,
    sequence and fine-tuning kind (the budget search): the meta model and each activation trace are made
    once. ``model_fn`` builds the model ``finetune`` trains (``finetune.planned_factory``)."""
    finetune = finetune or Finetune()
    cache = {} if cache is None else cache
    if "model" not in cache:
        with torch.device("meta"):
            cache["model"] = model_fn()
    model = cache["model"]
    config = config or default_config(model)
    if finetune.adapters:  # planned as the step runs: [Note: the fine-tuning walk]
        return walk_estimate(
            model_fn, config, world_size, rank, inputs_fn, batch, seq, optimizer, device, cache, finetune
        )
    replicate, shard = config.mesh.resolve(world_size)
    plan = cached_plan(cache, model, config)
    nf4 = nf4_paths(model) if finetune.kind == "qlora" else set()
    terms, host = memory_terms(plan, (replicate, shard), nf4, optimizer, device)
    terms["A"], terms["L"] = _trace_activations(cache, model_fn, config, inputs_fn, batch, seq, ())
    checkpointed = [path for group in plan.groups if group.policy.activation_checkpointing for path in group.paths]
    terms["A_r"] = 0  # a checkpointed module's activations, recomputed in its backward
    if checkpointed:
        full = terms["A"]
        terms["A"], _ = _trace_activations(cache, model_fn, config, inputs_fn, batch, seq, tuple(checkpointed))
        terms["A_r"] = max(0, full - terms["A"]) // len(checkpointed)
    name, peak = max(_candidates(terms).items(), key=lambda item: item[1])
    largest = max(terms, key=lambda k: terms[k])
    notes: tuple[str, ...] = (
        f"peak = {name}: {FORMULAS[name]}",
        "terms: " + ", ".join(f"{key} {value:,}" for key, value in terms.items()),
        f"largest term: {largest} ({TERMS[largest]})",
    )
    if finetune.adapters:
        notes = (*notes, finetune_note(finetune, plan, nf4))
    if host.pinned:
        notes = (*notes, host_note(host))
    phase = name.split(" ")[0]
    reserved = from_ratio(peak, phase) if device == "cuda" else None
    if reserved is not None:
        notes = (*notes, f"reserved: {reserved.ratio:.2f} x the peak (a rough ratio; simulate replays the step)")
    return MemoryEstimate(
        world_size, rank, peak, phase, None, _breakdown(name, terms), "analytic", device, notes,
        host_bytes=host.pinned, host_exact_bytes=host.exact, nvme_bytes=host.nvme,
        host_bytes_step_in_backward=host.pinned_in_backward,
        finetune=finetune.kind, reserved_bytes=reserved.reserved_bytes if reserved else 0,
        reserved_expandable_bytes=reserved.expandable_bytes if reserved else 0,
    )  # fmt: skip


FORMULAS = {
    "backward": "S + O + R + Z + A + 2L",
    "backward (in a block)": "S + O + R + R_g + 2B + B_g + B_r + Z + A - L + A_r (- G_h with CPU offload)",
    "optimizer": "S + S_t + O + T + Z + Z_r",
}
TERMS = {
    "S": "sharded parameters",
    "S_t": "sharded trainable parameters (their gradients)",
    "O": "optimizer state",
    "R": "root group unsharded",
    "R_g": "root group's unsharded gradients",
    "B": "largest block unsharded",
    "B_g": "largest block's unsharded gradients",
    "B_r": "largest block's gradients in the reduce dtype",
    "Z": "ZeRO-1/2 groups' resident unsharded parameters (the root's in R)",
    "Z_r": "a ZeRO-1/2 root's unsharded parameters, kept through the optimizer step",
    "T": "optimizer temporaries",
    "A": "activations",
    "A_r": "one checkpointed module's recomputed activations",
    "G_h": "offloaded groups' sharded gradients (on the host)",
    "L": "model output",
}


def _candidates(t: dict[str, int]) -> dict[str, int]:
    return {
        "backward": t["S"] + t["O"] + t["R"] + t["Z"] + t["A"] + 2 * t["L"],
        "backward (in a block)": -t.get("G_h", 0)
        + t["S"]
        + t["O"]
        + t["R"]
        + t["R_g"]
        + 2 * t["B"]
        + t["B_g"]
        + t["B_r"]
        + t["Z"]
        + max(0, t["A"] - t["L"])
        + t["A_r"],
        "optimizer": t["S"] + t["S_t"] + t["O"] + t["T"] + t["Z"] + t["Z_r"],
    }


def _breakdown(name: str, terms: dict[str, int]) -> dict[str, int]:
    """The candidate's terms under the breakdown's names; they sum to the estimate."""
    s, o, r, b, a, out = (terms[k] for k in ("S", "O", "R", "B", "A", "L"))
    if name == "backward":
        return {
            "params": s,
            "unsharded_params": r + terms["Z"],
            "grads": 0,
            "optimizer": o,
            "activations": a,
            "comm_buffers": 2 * out,
        }
    if name == "optimizer":
        return {
            "params": s,
            "unsharded_params": terms["Z"] + terms["Z_r"],
            "grads": terms["S_t"],
            "optimizer": o,
            "activations": 0,
            "comm_buffers": terms["T"],
        }
    activations = max(0, a - out)
    grads = terms["R_g"] + terms["B_g"] - terms.get("G_h", 0)  # unsharded grads; offloaded sharded grads on the host
    return {
        "params": s,
        "unsharded_params": r + 2 * b + terms["Z"] + min(0, grads),
        "grads": max(0, grads),
        "optimizer": o,
        "activations": activations + terms["A_r"],
        "comm_buffers": terms["B_r"],
    }


def _trace_activations(
    cache: dict[Any, Any],
    model_fn: Callable[[], nn.Module],
    config: FSDPConfig,
    inputs_fn: Callable[[], Any] | None,
    batch: int,
    seq: int | None,
    checkpointed: tuple[str, ...],
) -> tuple[int, int]:
    """(bytes autograd saves in one forward and loss of the plain model, bytes of its output), on fake
    tensors in the compute dtype (the config's top-level param_dtype, if any); traced once per compute
    dtype and checkpointed set in ``cache``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    dtype = config.mixed_precision.param_dtype
    memo = ("trace", dtype, checkpointed)
    if memo in cache:
        return cache[memo]
    with FakeTensorMode():
        model = materialized(model_fn())
        if dtype is not None:  # the compute dtype: what the unsharded parameters and activations are in
            for module in model.modules():
                for name, param in module._parameters.items():
                    if param is not None and param.is_floating_point():
                        module._parameters[name] = nn.Parameter(param.detach().to(dtype), param.requires_grad)
        for path in checkpointed:
            checkpoint_forward(model.get_submodule(path))
        inputs, token_model = step_inputs(model, inputs_fn, batch, seq)
        saved, output_bytes = _layerwise(model, lambda: _saved_bytes(model, inputs, token_model, dtype))
    cache[memo] = (saved, output_bytes)
    return saved, output_bytes


def _saved_bytes(
    model: nn.Module, inputs: tuple[Any, ...], token_model: bool, dtype: torch.dtype | None
) -> tuple[int, int]:
    """(bytes autograd saves in one forward and loss of ``model``, bytes of its output), each storage once."""
    from torch.multiprocessing.reductions import StorageWeakRef

    seen = {StorageWeakRef(p.untyped_storage()) for p in model.parameters()}  # not activations
    saved = 0
    by_numel: dict[int, int] = {}  # numel -> the largest saved storage of that many elements

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        key = StorageWeakRef(tensor.untyped_storage())  # views of one storage count once
        if key not in seen:
            seen.add(key)
            nbytes = tensor.untyped_storage().nbytes()
            saved += nbytes
            by_numel[tensor.numel()] = max(by_numel.get(tensor.numel(), 0), nbytes)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if token_model:  # the loss runs the forward: the output is (batch, seq, vocab) logits
            step_loss(model, inputs, token_model)
            element = element_size(dtype) if dtype is not None else 4
            vocab = token_spec(model)[0]  # type: ignore[index]
            logits = inputs[0].numel() * vocab
            # a loss that upcasts the logits (Hugging Face's: fp32) saves them at that size, and the
            # backward's first temporaries (the gradients of loss and logits) are of that size too
            return saved, max(logits * element, by_numel.get(logits, 0))
        output = model(*inputs)
        first = first_floating(output)
        return saved, first.numel() * first.element_size()


def _layerwise(model: nn.Module, trace: Callable[[], tuple[int, int]]) -> tuple[int, int]:
    """``trace()`` of ``model``, from its first one and two repeated blocks: a model whose largest
    ``ModuleList`` holds n >= 3 blocks of one class is traced with that list cut to 1 and to 2 blocks,
    and saves ``A(1) + (n - 1) (A(2) - A(1))`` (the blocks are alike: exact, and an 80-layer model traces
    in the time of 2). A model whose forward needs all its blocks is traced whole."""
    found = block_list(model)
    if found is None:
        return trace()
    parent, name, blocks = found
    try:
        setattr(parent, name, nn.ModuleList(blocks[:1]))
        one, output = trace()
        setattr(parent, name, nn.ModuleList(blocks[:2]))
        two, _ = trace()
    except Exception:  # noqa: BLE001 - any model code may refuse fewer blocks: then the whole model
        setattr(parent, name, blocks)
        return trace()
    finally:
        setattr(parent, name, blocks)
    return one + (len(blocks) - 1) * (two - one), output
