"""The activation side of a fine-tuning step, traced once on fake tensors: what is live at each group's peaks.

[Note: traced moments]
``estimate_memory(method="analytic")`` plans a LoRA or QLoRA step group by group (``finetune_walk``): the
parameter side (shards, gathered groups, gradients, optimizer state) comes from the plan's exact bytes, and the
activation side from one step of the plain model (no sharding) on fake tensors under torch's ``MemTracker``,
with each group's modules checkpointed as the config says and the loss ``examples/train.py`` computes
(``finetune.head_loss``). For each group it reads the activation bytes live (activations, their gradients and
temporaries: everything but parameters, gradients and buffers) at the peak of its forward and of its backward,
and before and after its forward. The model is traced with its repeated blocks cut to ``TRACED_BLOCKS``; a block
of the whole model is alike, and what each block leaves saved for backward (``Trace.saved_per_block``) is
added once per block left out at every moment that holds it (``Trace.extra_blocks``).

A head that the loss runs by run (``finetune.head_loss``) is not called as a module, so it has no traced
moments of its own: at its forward the decoder's output state plus one run's temporaries, at its backward the
same plus the hidden states' gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from ..config import FSDPConfig, Plan, checkpoint_forward
from .common import materialized, step_inputs, step_loss
from .finetune import planned_nf4

TRACED_BLOCKS = 2  # blocks the step is traced with ([Note: traced moments])
_PARAMETER_SIDE = ("Parameter", "Gradient", "Buffer", "Optstate")


@dataclass(frozen=True)
class Moments:
    """Activation-side bytes live at one group's moments in the traced step ([Note: traced moments])."""

    before_forward: int  # at its pre-forward (its all-gather's copy-out)
    forward: int  # at the peak of its forward
    after_forward: int  # at its post-forward
    backward: int | None  # at the peak of its backward; None: its backward never runs (nothing flows back)
    before_backward: int | None  # at its pre-backward


@dataclass
class Trace:
    """One traced step: each group's moments, in forward order (group indices into the plan)."""

    order: list[int]  # plan group indices, in the order their forwards start (the root first)
    moments: dict[int, Moments]
    blocks: list[int]  # the plan groups that are repeated blocks (traced: TRACED_BLOCKS of them)
    saved_per_block: int  # what a block's forward leaves saved for backward
    extra_blocks: int  # blocks of the whole model not traced
    cut: list[int] = field(default_factory=list)  # their plan groups (alike to the traced blocks)
    head: int | None = None  # the plan group of a head the loss runs by run (no moments of its own)
    head_output: tuple[int, int] = (0, 0)  # (tokens, hidden bytes per token) of the hidden states it reads
    head_run: int = 0  # one run's temporaries (``finetune.head_loss.run_bytes``)
    decoder_output: int = 0  # the activation side after the decoder's forward, when that loss starts
    notes: list[str] = field(default_factory=list)

    def after_block(self, index: int) -> bool:
        """Whether group ``index``'s forward starts at or after the last traced block's (so its moments hold
        every block's saved activations)."""
        if not self.blocks:
            return False
        last = max(self.order.index(b) for b in self.blocks)
        return self.order.index(index) >= last


def trace_finetune_step(
    model_fn: Callable[[], nn.Module],
    config: FSDPConfig,
    plan: Plan,
    inputs_fn: Callable[[], Any] | None,
    batch: int,
    seq: int | None,
    nf4: set[str] = frozenset(),  # type: ignore[assignment]
) -> Trace:
    """The plain model's step on fake tensors, cut to ``TRACED_BLOCKS`` blocks ([Note: traced moments]); the
    weights at the ``nf4`` paths as fsdp2lite's gathered ``NF4Weight``, so each matmul's dequantization is traced
    where it happens (eager: a CUDA target's compiled kernel makes no index, at most 32 MiB less)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ..finetune.head_loss import plain_head
    from .tracker import local_shard_tracker

    with torch.device("meta"):  # cut to TRACED_BLOCKS before any tensor is made: an 80-layer model costs 2
        model = model_fn()
    blocks, cut = _cut_blocks(model, plan)
    with FakeTensorMode(allow_non_fake_inputs=True):  # the meta parameters become fake ones
        model = materialized(model)
        _compute_dtype(model, config.mixed_precision.param_dtype)
        _nf4_weights(model, {path for path in nf4 if _present(model, path.rpartition(".")[0])})
        modules = _group_modules(model, plan)
        for group, paths in zip(plan.groups, (g.paths for g in plan.groups)):
            if group.policy.activation_checkpointing:
                for path in paths:
                    if path and _present(model, path):
                        checkpoint_forward(model.get_submodule(path))
        inputs, token_model = step_inputs(model, inputs_fn, batch, seq)
        parts = plain_head(model)
        saved = SavedByBlock(model, [m for i in blocks for m in modules.get(i, [])])
        with local_shard_tracker() as tracker, saved:
            tracker.track_external(model)
            step_loss(model, inputs, token_model).backward()
        moments, order = _read_moments(tracker, modules)
        decoder_output = _after_forward(tracker, parts[0]) if parts is not None else 0
    trace = Trace(order, moments, [i for i in blocks if i in moments], saved.last_block(), len(cut), cut)
    if parts is not None:
        _add_head(trace, modules, parts, tokens=inputs[0].numel(), dtype=config.mixed_precision.param_dtype)
        trace.decoder_output = decoder_output
    return trace


def _add_head(
    trace: Trace, modules: dict[int, list[nn.Module]], parts: tuple[nn.Module, Any], tokens: int, dtype: Any
) -> None:
    """A head the loss runs by run: its group joins the order last, with the loss's figures."""
    from ..finetune.head_loss import run_bytes

    head = parts[1]
    index = next((i for i, mods in modules.items() if any(m is head for m in mods)), None)
    if index is None or index in trace.moments:
        return
    trace.head = index
    trace.order.append(index)
    trace.head_output = (tokens, head.in_features * _element(dtype))
    trace.head_run = run_bytes(head.out_features, tokens)


def _element(dtype: torch.dtype | None) -> int:
    return torch.empty((), dtype=dtype or torch.float32).element_size()


def _compute_dtype(model: nn.Module, dtype: torch.dtype | None) -> None:
    """Every floating parameter in the compute dtype: what the gathered parameters and activations are in."""
    if dtype is None:
        return
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and param.is_floating_point():
                module._parameters[name] = nn.Parameter(param.detach().to(dtype), param.requires_grad)


def _nf4_weights(model: nn.Module, paths: set[str]) -> None:
    """Each weight at ``paths`` as an ``NF4Weight`` of its shape: what the gathered QLoRA base is while a group
    computes ([Note: NF4 matmul])."""
    from ..finetune.nf4_linear import NF4Weight

    for path in paths:
        owner, _, name = path.rpartition(".")
        module = model.get_submodule(owner)
        parts = planned_nf4(module._parameters[name])  # type: ignore[arg-type]
        module._parameters[name] = nn.Parameter(NF4Weight(*parts), requires_grad=False)


def _present(model: nn.Module, path: str) -> bool:
    try:
        model.get_submodule(path)
    except AttributeError:
        return False
    return True


def block_list(model: nn.Module) -> tuple[nn.Module, str, nn.ModuleList] | None:
    """The largest ``ModuleList`` of three or more modules of one class: the repeated blocks."""
    found = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.ModuleList) and len(child) >= 3 and len({type(m) for m in child}) == 1
    ]
    if not found:
        return None
    return max(found, key=lambda item: sum(p.numel() for p in item[2].parameters()))


def _cut_blocks(model: nn.Module, plan: Plan) -> tuple[list[int], list[int]]:
    """Cut the repeated blocks to ``TRACED_BLOCKS`` in place; (the plan groups of the blocks kept, of those cut)."""
    found = block_list(model)
    if found is None:
        return [], []
    parent, name, blocks = found
    list_path = next(path for path, module in model.named_modules() if module is blocks)
    groups = {path: i for i, group in enumerate(plan.groups) for path in group.paths}
    block_groups = [groups.get(f"{list_path}.{i}" if list_path else str(i)) for i in range(len(blocks))]
    setattr(parent, name, nn.ModuleList(blocks[:TRACED_BLOCKS]))
    traced, cut = block_groups[:TRACED_BLOCKS], block_groups[TRACED_BLOCKS:]
    return [g for g in traced if g is not None], [g for g in cut if g is not None]


def _group_modules(model: nn.Module, plan: Plan) -> dict[int, list[nn.Module]]:
    """Each plan group's modules present in the (cut) traced model; the root is the model itself."""
    out: dict[int, list[nn.Module]] = {}
    for index, group in enumerate(plan.groups):
        found = [model.get_submodule(path) for path in group.paths if _present(model, path)]
        if found:
            out[index] = found
    return out


def _read_moments(tracker: Any, modules: dict[int, list[nn.Module]]) -> tuple[dict[int, Moments], list[int]]:
    """Each group's moments from the tracker's per-module snapshots; the order their forwards started."""
    from torch.distributed._tools.mem_tracker import _ModState

    by_module = {id(module): stats for module, stats in tracker.memory_tracking.items()}
    moments: dict[int, Moments] = {}
    starts: dict[int, int] = {}
    for index, group_modules in modules.items():
        stats = [by_module[id(m)] for m in group_modules if id(m) in by_module]
        if not stats:
            continue

        forward = _read(stats, _ModState.PEAK_FW)
        if forward is None:
            continue
        moments[index] = Moments(
            _read(stats, _ModState.PRE_FW, min) or 0,
            forward,
            _read(stats, _ModState.POST_FW) or 0,
            _read(stats, _ModState.PEAK_BW),
            _read(stats, _ModState.PRE_BW),
        )
        starts[index] = min(list(tracker.memory_tracking).index(m) for m in group_modules if id(m) in by_module)
    return moments, sorted(moments, key=lambda i: starts[i])


def _read(stats: list[Any], state: Any, pick: Callable[[list[int]], int] = max) -> int | None:
    """The activation side of the modules' snapshots at ``state`` (their largest, or ``pick``'s), or None."""
    values = [_activation_side(snap) for s in stats for snap in s.snapshots.get(state, [])]
    return pick(values) if values else None


def _after_forward(tracker: Any, module: nn.Module) -> int:
    """The activation side at ``module``'s post-forward."""
    from torch.distributed._tools.mem_tracker import _ModState

    stats = next((s for m, s in tracker.memory_tracking.items() if m is module), None)
    snaps = stats.snapshots.get(_ModState.POST_FW, []) if stats is not None else []
    return max((_activation_side(snap) for snap in snaps), default=0)


def _activation_side(snapshot: dict[Any, dict[Any, int]]) -> int:
    """Bytes of a tracker snapshot that are not parameters, gradients, buffers or optimizer state."""
    total = 0
    for device, categories in snapshot.items():
        if torch.device(device).type == "meta":
            continue
        named = {str(getattr(k, "value", k)): v for k, v in categories.items()}
        total += named.get("Total", 0) - sum(named.get(k, 0) for k in _PARAMETER_SIDE)
    return total


class SavedByBlock:
    """What each block's forward leaves saved for backward: the storages autograd saves while it runs (its
    input among them), each counted once and never a parameter's. Read from the saved tensors themselves, not
    from the tracker's live bytes, which on fake tensors hold a block's last temporaries a while longer
    ([Note: traced moments])."""

    def __init__(self, model: nn.Module, blocks: list[nn.Module]) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        self._key = StorageWeakRef
        self._seen = {StorageWeakRef(p.untyped_storage()) for p in model.parameters() if _has_storage(p)}
        self._blocks = blocks
        self._current: int | None = None
        self.bytes: list[int] = [0] * len(blocks)
        self._handles: list[Any] = []
        self._hooks: Any = None

    def __enter__(self) -> SavedByBlock:
        for index, block in enumerate(self._blocks):
            self._handles.append(block.register_forward_pre_hook(lambda *_, i=index: self._enter(i)))
            self._handles.append(block.register_forward_hook(lambda *_: self._enter(None)))
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
        for handle in self._handles:
            handle.remove()

    def _enter(self, index: int | None) -> None:
        if torch.is_grad_enabled():  # a forward, not a recompute in backward
            self._current = index

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._current is not None and _has_storage(tensor):
            key = self._key(tensor.untyped_storage())
            if key not in self._seen:
                self._seen.add(key)
                self.bytes[self._current] += tensor.untyped_storage().nbytes()
        return tensor

    def last_block(self) -> int:
        return self.bytes[-1] if self.bytes else 0


def _has_storage(tensor: torch.Tensor) -> bool:
    """A tensor with a storage of its own (a wrapper subclass such as ``NF4Weight`` has none)."""
    try:
        tensor.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True
