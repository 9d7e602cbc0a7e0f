"""The plan's bytes on one rank: each group's shards, gathered bytes and gradients (``GroupBytes``), and the terms
every estimate shares (sharded parameters, optimizer state, what CPU offload moves to the host). The analytic
estimate (``analytic``) and the fine-tuning walk (``finetune_walk``) are both made of these; ``simulate`` and
``explain`` read them too.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..config import Plan
from ..policies import cast_dtype, reduce_cast_dtype
from .common import GroupBytes, element_size, sharded_nbytes
from .finetune import Finetune, PlannedLora, nf4_bytes, pinned_nbytes
from .host import FILE_ALIGN, PACK_ALIGN, SLOT_ALIGN, HostBytes, host_bytes


def memory_terms(
    plan: Plan, degrees: tuple[int, int], nf4: set[str], optimizer: str, device: str
) -> tuple[dict[str, int], HostBytes]:
    """(the terms but activations, host memory and NVMe bytes with CPU offload: [Note: host bytes]).
    ``degrees``: (replicate, shard); an HFSDP group's S_t (its gradients' and optimizer state's shards) is
    split across the replicas too: 1/replicate of its shards' (exact for rows divisible by the world size)."""
    replicate, shard = degrees
    groups = group_bytes(plan, shard, nf4, pinned=device == "cuda")
    trained = trained_bytes(plan, groups, replicate)
    ignored = sum(p.numel() * p.element_size() for p in plan.ignored.values())
    ignored_trainable = sum(p.numel() * p.element_size() for p in plan.ignored.values() if p.requires_grad)
    terms = {"S": sum(g.sharded for g in groups) + ignored}
    trainable = sum(trained) + ignored_trainable  # S_t: what has gradients and optimizer state
    tensors = sum(1 for params in plan.params for p in params.values() if p.requires_grad)
    terms["O"] = {"adamw": 2 * trainable + 4 * tensors, "sgd": trainable, "none": 0}[optimizer]
    terms["S_t"] = trainable
    terms["R"], terms["R_g"] = groups[-1].unsharded, groups[-1].unsharded_grads
    block = max(groups[:-1], key=lambda g: g.unsharded, default=None)
    resident = [g.policy.sharding.resident for g in plan.groups]
    terms["Z"] = sum(g.unsharded for g, kept in zip(groups[:-1], resident) if kept)  # ZeRO-1/2: always there
    terms["Z_r"] = groups[-1].unsharded if resident[-1] else 0  # a resident root's, in the optimizer step too
    gathered = [g.unsharded for g, kept in zip(groups[:-1], resident) if not kept]
    terms["B"] = max(gathered, default=0)  # the largest group gathered per use (ZeRO-3)
    terms["B_g"] = block.unsharded_grads if block else 0
    terms["B_r"] = max((g.reduced for g in groups[:-1]), default=0)
    largest = max(
        (sharded_nbytes(p, shard, 0) for params in plan.params for p in params.values() if p.requires_grad), default=0
    )
    terms["T"] = trainable if device == "cuda" else 2 * largest  # foreach on CUDA, per tensor on CPU
    on_host = [group.policy.offload.device == "cpu" for group in plan.groups]
    moved = [g for g, p, host in zip(groups, plan.groups, on_host) if host and not p.policy.offload.optimizer_only]
    share = sum(g.sharded for g in moved) / terms["S"] if terms["S"] else 0.0  # optimizer_only keeps its shards
    share_t = sum(t for t, host in zip(trained, on_host) if host) / trainable if trainable else 0.0
    terms["G_h"] = int(trainable * share_t)  # CPU offload: those shards' sharded gradients, on the host
    host = host_bytes(plan, groups, trained, int(terms["O"] * share_t), optimizer)
    terms["S"] = int(terms["S"] * (1 - share))  # what stays on the device
    for key in ("O", "T", "S_t"):
        terms[key] = int(terms[key] * (1 - share_t))
    return terms, host


def group_bytes(
    plan: Plan,
    shard: int,
    nf4: set[str] = frozenset(),  # type: ignore[assignment]
    pinned: bool = True,
) -> list[GroupBytes]:
    """Per group, its ``GroupBytes``; ``nf4``: parameter paths stored in NF4 (qlora's adapted base weights);
    ``pinned``: a CUDA target, where ``pin_memory`` pins (a CPU target's host memory is pageable)."""
    out = []
    for group, spec in zip(plan.groups, plan.specs):  # the spec fully_shard builds ([Note: one plan])
        sharded = trainable = unsharded = grads = reduced = grad_shards = file_bytes = slot_bytes = 0
        pin = pinned_nbytes if pinned and group.policy.offload.pin_memory else int  # pageable: exact
        requests = []  # host buffers of their own (NF4, HFSDP shards): rounded if pinned
        packed = 0  # the group's one host buffer, pinned at its exact size ([Note: one host buffer per group])
        own_buffers = group.policy.sharding.replica_sharded
        for param in spec.params:
            name, p, dim = param.fqn, param.param, param.dim
            padded = padded_numel(p, shard, dim)  # all-gather layout
            policy = param.mixed_precision  # the group's or its own: [Note: per-parameter mixed precision]
            compute = padded * element_size(cast_dtype(p, policy.param_dtype))
            stored = stored_nbytes(p, shard, dim, name in nf4)
            gathered = nf4_bytes(padded) if name in nf4 else compute
            sharded += stored
            unsharded += gathered
            if p.requires_grad or not group.policy.offload.optimizer_only:  # optimizer_only: masters of trainables
                if name in nf4 or own_buffers:
                    requests.append(stored)
                else:
                    packed += _align(stored, PACK_ALIGN)
            if p.requires_grad:
                trainable += stored
                grad_shards += stored
                file_bytes += _align(stored, FILE_ALIGN)  # optimizer: nvme: a state tensor's region in the file
                slot_bytes += _align(stored, SLOT_ALIGN)  # and in a staging slot
                grads += compute
                reduced += padded * element_size(reduce_cast_dtype(p, policy.param_dtype, policy.reduce_dtype))
        packed += grad_shards  # the group's host gradient buffer: exact too, reused every step
        pinned_sum, exact = packed + sum(pin(n) for n in requests), packed + sum(requests)
        out.append(
            GroupBytes(
                sharded,
                trainable,
                unsharded,
                grads,
                reduced,
                pinned_sum,
                exact,
                file_bytes,
                slot_bytes,
                grad_shards,
            )  # fmt: skip
        )
    return out


def _align(nbytes: int, to: int) -> int:
    return -(-nbytes // to) * to


def trained_bytes(plan: Plan, groups: list[GroupBytes], replicate: int) -> list[int]:
    """Per group, its trainable shards' bytes on a rank: an HFSDP group's split across the replicas."""
    split = [replicate if group.policy.sharding.replica_sharded else 1 for group in plan.groups]
    return [g.trainable // ways for g, ways in zip(groups, split)]


def stored_nbytes(param: torch.Tensor, shard: int, dim: int, nf4: bool = False) -> int:
    """One rank's bytes of ``param`` as stored: its padded shard on ``dim`` (``sharded_nbytes``), or, for a
    weight qlora keeps in NF4 (``nf4``), that many weights at NF4's size. The S term sums it; explain too."""
    if nf4:
        return nf4_bytes(padded_numel(param, shard, dim) // shard)
    return sharded_nbytes(param, shard, dim)


def padded_numel(param: torch.Tensor, shard: int, dim: int) -> int:
    """Elements of a parameter's unsharded storage and of its slot in the flat collective buffers:
    ``shard`` padded chunks (at large world sizes most of a small parameter is padding)."""
    return shard * sharded_nbytes(param, shard, dim) // param.element_size()


def nf4_paths(model: nn.Module) -> set[str]:
    """The parameter paths qlora stores in NF4: every planned adapter's base weight."""
    return {f"{path}.base_layer.weight" for path, m in model.named_modules() if isinstance(m, PlannedLora)}


def finetune_note(finetune: Finetune, plan: Plan, nf4: set[str]) -> str:
    """What is trained, in the words every fine-tuning estimate's notes use."""
    params = [p for params in plan.params for p in params.values()] + list(plan.ignored.values())
    trained = sum(p.numel() for p in params if p.requires_grad)
    total = sum(p.numel() for p in params)
    quantized = f", {sum(p.numel() for n, p in named_params(plan) if n in nf4):,} base weights in NF4" if nf4 else ""
    return (
        f"{finetune.label()}: {trained:,} of {total:,} parameters trained (fp32 masters, gradients, optimizer "
        f"state); the frozen base in bf16{quantized}"
    )


def named_params(plan: Plan) -> list[tuple[str, torch.Tensor]]:
    return [item for params in plan.params for item in params.items()]
