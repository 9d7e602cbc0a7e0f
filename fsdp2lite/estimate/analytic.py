"""``estimate_memory(method="analytic")``: a closed form from the plan, plus one traced forward for activations.

Terms, per rank (bytes):
    S   the sharded parameters: each group's padded shards in the parameters' dtype (whole for ignored ones)
    O   optimizer state: AdamW 2 S (+ a step counter per tensor), SGD with momentum S, none 0
    R   the root group's unsharded parameters (kept between forward and backward), in param_dtype, padded
        as the all-gather lays them out (shard degree x padded chunk: at large world sizes, mostly padding)
    B   the largest other group's unsharded parameters, in param_dtype, padded the same way
    A   activations autograd saves in one forward of the plain model (traced on fake tensors, each storage
        counted once), incl. the loss's; with activation checkpointing, traced with it (block inputs)
    A_r with activation checkpointing: one checkpointed module's activations, recomputed in its backward
    L   the model output (logits), at the size the loss saves it (an fp32 upcast for Hugging Face models):
        backward starts with two temporaries of its size
Candidates for the peak:
    backward, at its start:   S + O + R + A + 2 L
    backward, in a block:     S + O + R + R + 4 B + A - L (root grads, a block's params, grads, reduce
                                                           buffer, prefetched all-gather; activations bound)
    optimizer step:           S + O + S + S               (sharded grads, the foreach temporaries)
The largest is the estimate; the notes name it and its largest term.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from ..config import FSDPConfig, Plan, checkpoint_forward, plan_config
from ..policies import cast_dtype
from .common import (
    MemoryEstimate,
    default_config,
    element_size,
    first_floating,
    materialized,
    sharded_nbytes,
    step_inputs,
    step_loss,
    token_spec,
)


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
) -> MemoryEstimate:
    """The closed form (module docstring). ``cache``: a dict kept across calls on the same model, batch and
    sequence (the budget search): the meta model and each activation trace are made once."""
    cache = {} if cache is None else cache
    if "model" not in cache:
        with torch.device("meta"):
            cache["model"] = model_fn()
    model = cache["model"]
    config = config or default_config(model)
    _, shard = config.mesh.resolve(world_size)
    plan = plan_config(model, config)
    sharded, unsharded, reduced = _group_bytes(plan, shard)
    ignored = sum(p.numel() * p.element_size() for p in plan.ignored.values())
    terms = {"S": sum(sharded) + ignored}
    tensors = sum(len(params) for params in plan.params)
    terms["O"] = {"adamw": 2 * terms["S"] + 4 * tensors, "sgd": terms["S"], "none": 0}[optimizer]
    terms["R"] = unsharded[-1]
    terms["B"] = max(unsharded[:-1], default=0)
    terms["B_r"] = max(reduced[:-1], default=0)
    largest = max((sharded_nbytes(p, shard, 0) for params in plan.params for p in params.values()), default=0)
    terms["T"] = terms["S"] if device == "cuda" else 2 * largest  # foreach on CUDA, per tensor on CPU
    offloaded = [cost for cost, group in zip(sharded, plan.groups) if group.policy.offload.device == "cpu"]
    share = sum(offloaded) / sum(sharded) if sum(sharded) else 0.0
    terms["G_h"] = int(terms["S"] * share)  # CPU offload: those shards' sharded gradients, on the host
    host = int((terms["S"] + terms["O"]) * share) + terms["G_h"]  # shards, optimizer state and gradients
    for key in ("S", "O", "T"):
        terms[key] = int(terms[key] * (1 - share))  # what stays on the device
    terms["A"], terms["L"] = _trace_activations(cache, model_fn, config, inputs_fn, batch, seq, ())
    checkpointed = [path for group in plan.groups if group.policy.activation_checkpointing for path in group.paths]
    terms["A_r"] = 0  # a checkpointed module's activations, recomputed in its backward
    if checkpointed:
        full = terms["A"]
        terms["A"], _ = _trace_activations(cache, model_fn, config, inputs_fn, batch, seq, tuple(checkpointed))
        terms["A_r"] = max(0, full - terms["A"]) // len(checkpointed)
    name, peak = max(_candidates(terms).items(), key=lambda item: item[1])
    notes: tuple[str, ...] = (
        f"peak = {name}: {FORMULAS[name]}",
        "terms: " + ", ".join(f"{key} {value:,}" for key, value in terms.items()),
        f"largest term: {max(terms, key=lambda k: terms[k])} ({TERMS[max(terms, key=lambda k: terms[k])]})",
    )
    if share:
        notes = (
            *notes,
            f"CPU offload: {share:.0%} of the shards, their gradients and optimizer state on the host ({host:,} bytes)",
        )
    breakdown = _breakdown(name, terms)
    phase = name.split(" ")[0]
    return MemoryEstimate(world_size, rank, peak, phase, None, breakdown, "analytic", device, notes, host_bytes=host)


FORMULAS = {
    "backward": "S + O + R + A + 2L",
    "backward (in a block)": "S + O + 2R + 3B + B_r + A - L + A_r (- G_h with CPU offload)",
    "optimizer": "2S + O + T",
}
TERMS = {
    "S": "sharded parameters",
    "O": "optimizer state",
    "R": "root group unsharded",
    "B": "largest block unsharded",
    "B_r": "largest block in the reduce dtype",
    "T": "optimizer temporaries",
    "A": "activations",
    "A_r": "one checkpointed module's recomputed activations",
    "G_h": "offloaded groups' sharded gradients (on the host)",
    "L": "model output",
}


def _candidates(t: dict[str, int]) -> dict[str, int]:
    return {
        "backward": t["S"] + t["O"] + t["R"] + t["A"] + 2 * t["L"],
        "backward (in a block)": -t.get("G_h", 0)
        + t["S"]
        + t["O"]
        + 2 * t["R"]
        + 3 * t["B"]
        + t["B_r"]
        + max(0, t["A"] - t["L"])
        + t["A_r"],
        "optimizer": 2 * t["S"] + t["O"] + t["T"],
    }


def _group_bytes(plan: Plan, shard: int) -> tuple[list[int], list[int], list[int]]:
    """Per group: its sharded bytes, its unsharded bytes in param_dtype and its reduce-scatter input bytes
    in reduce_dtype (both as the all-gather lays them out: padded to equal shards)."""
    sharded: list[int] = []
    unsharded: list[int] = []
    reduced: list[int] = []
    for group, params in zip(plan.groups, plan.params):
        policy = group.policy.mixed_precision
        sharded.append(sum(sharded_nbytes(p, shard, plan.shard_dims.get(n, 0)) for n, p in params.items()))
        dims = [plan.shard_dims.get(n, 0) for n in params]
        padded = [_padded_numel(p, shard, d) for p, d in zip(params.values(), dims)]  # all-gather layout
        unsharded.append(
            sum(n * element_size(cast_dtype(p, policy.param_dtype)) for p, n in zip(params.values(), padded))
        )
        reduce_dtype = policy.reduce_dtype or policy.param_dtype
        reduced.append(sum(n * element_size(cast_dtype(p, reduce_dtype)) for p, n in zip(params.values(), padded)))
    return sharded, unsharded, reduced


def _padded_numel(param: torch.Tensor, shard: int, dim: int) -> int:
    """Elements of a parameter's unsharded storage and of its slot in the flat collective buffers:
    ``shard`` padded chunks (at large world sizes most of a small parameter is padding)."""
    return shard * sharded_nbytes(param, shard, dim) // param.element_size()


def _breakdown(name: str, terms: dict[str, int]) -> dict[str, int]:
    """The candidate's terms under the breakdown's names; they sum to the estimate."""
    s, o, r, b, a, out = (terms[k] for k in ("S", "O", "R", "B", "A", "L"))
    if name == "backward":
        return {
            "params": s,
            "unsharded_params": r,
            "grads": 0,
            "optimizer": o,
            "activations": a,
            "comm_buffers": 2 * out,
        }
    if name == "optimizer":
        return {
            "params": s,
            "unsharded_params": 0,
            "grads": s,
            "optimizer": o,
            "activations": 0,
            "comm_buffers": terms["T"],
        }
    activations = max(0, a - out)
    grads = r + b - terms.get("G_h", 0)  # unsharded grads; offloaded sharded grads are on the host
    return {
        "params": s,
        "unsharded_params": r + 2 * b + min(0, grads),
        "grads": max(0, grads),
        "optimizer": o,
        "activations": activations,
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
    from torch.multiprocessing.reductions import StorageWeakRef

    dtype = config.mixed_precision.param_dtype
    memo = ("trace", dtype, checkpointed)
    if memo in cache:
        return cache[memo]
    seen: set[Any] = set()
    saved = 0
    output_bytes = 0
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

    with FakeTensorMode():
        model = materialized(model_fn())
        if dtype is not None:  # the compute dtype: what the unsharded parameters and activations are in
            for module in model.modules():
                for name, param in module._parameters.items():
                    if param is not None and param.is_floating_point():
                        module._parameters[name] = nn.Parameter(param.detach().to(dtype), param.requires_grad)
        seen.update(StorageWeakRef(p.untyped_storage()) for p in model.parameters())  # not activations
        for path in checkpointed:
            checkpoint_forward(model.get_submodule(path))
        inputs, token_model = step_inputs(model, inputs_fn, batch, seq)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            if token_model:  # the loss runs the forward: the output is (batch, seq, vocab) logits
                step_loss(model, inputs, token_model)
                element = element_size(dtype) if dtype is not None else 4
                vocab = token_spec(model)[0]  # type: ignore[index]
                logits = inputs[0].numel() * vocab
                # a loss that upcasts the logits (Hugging Face's: fp32) saves them at that size, and the
                # backward's first temporaries (the gradients of loss and logits) are of that size too
                output_bytes = max(logits * element, by_numel.get(logits, 0))
            else:
                output = model(*inputs)
                first = first_floating(output)
                output_bytes = first.numel() * first.element_size()
    cache[memo] = (saved, output_bytes)
    return saved, output_bytes
