"""One communication group: the parameters of one ``fully_shard`` call.

A group is all-gathered as one collective before it is used and reduce-scattered as one collective
after its backward (plus, for HSDP, one all-reduce across replicas). It owns the phase logic;
``hooks.py`` and ``root.py`` decide *when* each phase runs ([Note: post-forward reshard] is in ``post_forward.py``).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
import torch.nn as nn

from ..mesh import MeshInfo
from ..policies import CommPolicy, reduce_dtype_problem_by_policy
from .choices import GroupForms
from .comm import Comm
from .controls import GroupControls
from .gather import GatherForm, PendingUnshard
from .gradients import accumulate_sharded_grads, run_all_reduce_hook, take_unsharded_grads
from .host_arena import HostArena
from .host_masters import HostSync
from .host_storage import HostShards
from .identity import register_group
from .param import FSDPParam
from .post_forward import PostForwardReshard
from .reduce import ReduceScatterResult
from .replicas import ReplicaSync
from .seams import GroupContext, GroupStorage, HostSide, PlannedGroup
from .states import ShardedState, ShardedStates, TrainingState
from .storages import group_storages
from .trace import Meters


class FSDPParamGroup:
    """The parameters of one fully_shard call and their collectives (the settings that choose its forms: ``forms``,
    a ``GroupForms``, choices.py; its sharded-state machine: ``states``, a ``ShardedStates``, states.py)."""

    name: str  # module path from the root ("" for the root), set at lazy init
    modules: tuple[nn.Module, ...]
    params: tuple[FSDPParam, ...]  # in the order of the all-gather and the reduce-scatter
    mesh_info: MeshInfo
    controls: GroupControls  # the public setters' per-step switches (controls.py); replaced by set_controls
    post_forward_reshard: PostForwardReshard  # reshard_after_forward decoded: [Note: post-forward reshard]
    reshard_after_forward: bool  # effective: free (or shrink to its k ranks) the unsharded parameters after forward
    states: ShardedStates  # where its parameters live, the only writer of it: states.py
    training_state: TrainingState
    needs_post_backward: bool  # pre-backward ran and post-backward has not yet, this step
    backward_follows: bool  # its last forward's output needs a gradient: backward will use it (a prefetch target)
    pending_unshard: PendingUnshard | None  # an all-gather issued and not yet copied out
    reduce_scatter_result: ReduceScatterResult | None  # a reduce-scatter issued and not yet applied
    _comm: Comm | None  # streams, events, work handles; the root's, shared, after lazy init
    meters: Meters  # trace recorder and wire counts; the root's, shared, after lazy init
    host: HostSide  # the host engine ([Note: the host engine] in seams.py); the root's, shared, after lazy init
    forward_prefetch: tuple[FSDPParamGroup, ...] | None  # explicit targets; None: the recorded order
    backward_prefetch: tuple[FSDPParamGroup, ...] | None
    forms: GroupForms  # how it gathers and reduces, and the settings that chose that: choices.py
    storages: tuple[GroupStorage, ...]  # where shards live beyond ZeRO-3's: [Note: group storage]
    replicas: ReplicaSync | None  # HFSDP's storage, also its replica step's collectives: [Note: replica-sharded groups]
    keeps_unsharded: bool  # one of them keeps the unsharded storage across reshards (ZeRO-1/2)

    def reduce_dtype_problem(self) -> str | None:
        """Why this group's trainable parameters cannot be reduced together (checked at lazy init, when
        ``requires_grad`` is final), or None: those under one policy reduce in one dtype (parameters of
        another policy reduce apart: [Note: per-parameter mixed precision])."""
        named = {param.fqn: param.sharded_param for param in self.params}
        return reduce_dtype_problem_by_policy(named, {param.fqn: param.policy for param in self.params})

    def __init__(self, spec: PlannedGroup, params: tuple[FSDPParam, ...], context: GroupContext) -> None:
        """The group of a planned, checked ``spec`` ([Note: one plan]) over its built ``params``: its forms,
        storages and replica step are chosen here, from the spec, once; lazy init adds only the root's shared
        context (``join_root``), and every later change goes through a named setter."""
        settings = spec.settings
        self.name = type(spec.modules[0]).__name__
        self.params = params
        self._copied_out = tuple(p.unsharded for p in params if not p.layout.gathered_is_contiguous)
        self._rebuilding_units = tuple(p.unit for p in params if p.unit.rebuilds)  # [Note: gather units]
        self.modules = spec.modules
        self.mesh_info = context.mesh_info
        self.host = context.host
        self.meters = Meters()
        self._comm = None
        self.controls = GroupControls()
        self.forward_prefetch = self.backward_prefetch = None
        self._start_idle()
        self.set_reshard_after_forward(settings.reshard_as_built)  # checked by the plan: [Note: one plan]
        # the host storage first: its packing writes the shards, and the other storages' watches start from it
        self.storages, self.replicas = group_storages(self, settings.sharding)  # [Note: group storage]
        self.keeps_unsharded = any(s.keeps_unsharded for s in self.storages)
        self.forms = GroupForms(params, self.mesh_info, self.replicas, settings.comm or CommPolicy())
        if params[0].policy.nvme_path is not None:  # the host engine keeps its optimizer state in files
            self.host.keep_state_in_files(self)
        register_group(self)  # its sharded parameters are fsdp2lite's: identity.py

    def _start_idle(self) -> None:
        """The per-step state of a group before its first use: sharded, idle, nothing in flight."""
        self.states = ShardedStates(self)
        self.training_state = TrainingState.IDLE
        self.needs_post_backward = False
        self.backward_follows = True
        self.pending_unshard = None
        self.reduce_scatter_result = None

    @property
    def sharded_state(self) -> ShardedState:
        """Where the parameters live now (``states.current``)."""
        return self.states.current

    @property
    def comm(self) -> Comm:
        """The root's Comm once lazy init has run; before it (an explicit ``unshard()``), one of its own."""
        if self._comm is None:
            self._comm = Comm(self.mesh_info.device)
        return self._comm

    def join_root(self, name: str, comm: Comm, host: HostSide, meters: Meters, is_root: bool) -> None:
        """Lazy init: the group's path from the root, the root's shared Comm, host engine and Meters (the only
        writer of these after construction), and whether it is the root (``reshard_after_forward=None``: the root
        keeps its parameters after forward, every other group frees them)."""
        self.name, self._comm, self.host, self.meters = name, comm, host, meters
        self.reshard_after_forward = self.post_forward_reshard.frees(is_root)

    def set_reshard_after_forward(self, value: bool | int | None) -> None:
        """Take a value checked by the caller (the plan, or ``post_forward.check_post_forward``); None waits for
        lazy init (``join_root``). An int k makes the k-rank process groups."""
        self.post_forward_reshard = PostForwardReshard.of(value, self.mesh_info)
        self.reshard_after_forward = self.post_forward_reshard.frees(is_root=False)  # None: lazy init decides

    def set_controls(self, controls: GroupControls) -> None:
        """The public setters' per-step switches (``FSDPModule.set_requires_gradient_sync`` and the like), checked
        by them, replaced whole."""
        self.controls = controls

    def set_prefetch(
        self, forward: tuple[FSDPParamGroup, ...] | None, backward: tuple[FSDPParamGroup, ...] | None
    ) -> None:
        """The groups to all-gather as soon as this one is unsharded in forward and in backward
        (``set_modules_to_forward_prefetch`` / ``_backward_prefetch``); None: the recorded order."""
        self.forward_prefetch, self.backward_prefetch = forward, backward

    @property
    def host_arena(self) -> HostArena | None:
        """The group's one host buffer under CPU offload, its host storage's ([Note: host storage]), or None."""
        for storage in self.storages:
            host = storage.host if isinstance(storage, HostSync) else storage
            if isinstance(host, HostShards):
                return host.arena
        return None

    def __repr__(self) -> str:
        return f"FSDPParamGroup({self.name or '<root>'}, {len(self.params)} params)"

    # ---- unshard / reshard ----------------------------------------------------------------
    def reset_sharded_params(self) -> None:
        renewed = any([param.reset_sharded_param() for param in self.params])  # a list: every parameter looks
        for storage in self.storages:
            storage.on_reset(renewed)
        if renewed:  # ``to_empty``, ``module.to(dtype)``, an assigning load: new shards, maybe new dtypes
            self.forms.choose_gather()  # the form's views of the old shards are stale

    def unshard(self) -> None:
        """Issue the all-gather unless the group is unsharded or one is already in flight."""
        if self.states.current is ShardedState.UNSHARDED or self.pending_unshard is not None:
            return
        self.host.wait_for(p.sharded_param for p in self.params)  # a host step in flight writes the shards
        form: GatherForm | None = self.states.regather  # set exactly while resharded to the post-forward group
        if form is None:
            # each brings what the optimizer stepped back into the shards the all-gather reads: a list, all run
            if any([storage.before_gather() for storage in self.storages]):
                self.states.to_unsharded()  # the kept storage holds the current shards: [Note: resident groups]
                self.trace("all_gather_skipped")
                return
            self.sync_extensions()
            form = self.forms.gather
        self.pending_unshard = PendingUnshard(form.issue(self.comm, self.meters), form)
        self.trace("all_gather_issue")

    def sync_extensions(self) -> None:
        """Hooks set or removed on a local tensor since the last all-gather change how the group gathers
        ([Note: hooks looked up per all-gather])."""
        quantized = self.forms.comm_policy.all_gather is not None
        if any([param.sync_extension(quantized) for param in self.params]):  # a list: every parameter looks
            self._rebuilding_units = tuple(p.unit for p in self.params if p.unit.rebuilds)
            self.forms.choose_gather()

    def wait_for_unshard(self) -> None:
        """Finish an issued all-gather: copy out and register the unsharded parameters."""
        pending = self.pending_unshard
        if pending is None:
            return
        self.pending_unshard = None
        with self.trace_span("all_gather_wait"):
            self.comm.wait(pending.result.work, pending.result.event)  # CPU: written; CUDA: compute orders after
        output = pending.result.all_gather_output
        direct = pending.form.copy_out(output)  # the output is the parameter itself: [Note: copy-out by views]
        for unsharded in self._copied_out:
            unsharded.finish_copy_out()  # not a view of the gathered rows (another dim, aligned): [Note: padded shard]
        for unit in self._rebuilding_units:
            unit.finish()  # the subclass rebuilds its unsharded tensor: [Note: gather units]
        kept = None
        sub = self.post_forward_reshard.ranks
        if sub is not None and self._reshards_after_this_forward():
            kept = pending.form.kept_slots(output, sub)  # a byte group's slots
        if not direct:
            self.comm.release(output)  # copy-out queued: [Note: CUDA buffer lifetime]
        self.states.to_unsharded(kept)

    def reshard(self, free: bool = False) -> None:
        """Free the unsharded parameters (waiting first for an all-gather still in flight); a resident group
        keeps their storage unless ``free`` ([Note: resident groups])."""
        self.wait_for_unshard()
        for storage in self.storages if free else ():
            storage.invalidate()  # an explicit reshard: rebuild the shards anew too
        if self.states.current is ShardedState.SHARDED and not (free and self.keeps_unsharded):
            return  # a resident group's kept storage is freed only when asked (free)
        self.states.to_sharded(keep=self.keeps_unsharded and not free)
        self.trace("reshard")

    def reshard_post_forward(self) -> None:
        """Keep only this rank's chunk over the post-forward group, then free the unsharded parameters."""
        sub = self.post_forward_reshard.ranks
        if sub is None or self.states.current is not ShardedState.UNSHARDED:
            self.reshard()
            return
        regather = self.states.post_forward_kept or self.forms.gather.chunks(sub)  # [Note: post-forward reshard]
        if regather is None:
            self.reshard()
            return
        self.states.to_sharded_post_forward(regather)
        self.trace("reshard")

    def _reshards_after_this_forward(self) -> bool:
        """A forward with autograd on will shrink this group to its post-forward group afterwards."""
        return self.reshard_after_forward and self.training_state is TrainingState.FORWARD and torch.is_grad_enabled()

    # ---- phases ---------------------------------------------------------------------------
    def pre_forward(self) -> None:
        self.training_state = TrainingState.FORWARD
        self.unshard()
        self.wait_for_unshard()

    def post_forward(self, grad_enabled: bool, backward_follows: bool = True) -> None:
        """``backward_follows``: the forward's output needs a gradient, so this group's backward will run (a
        frozen embedding's does not: backward never prefetches it)."""
        self.backward_follows = grad_enabled and backward_follows
        if not grad_enabled:
            self.reshard()  # no backward can follow: nothing is worth keeping
        elif self.reshard_after_forward:
            self.reshard_post_forward()
        self.training_state = TrainingState.IDLE

    def pre_backward(self) -> None:
        self.training_state = TrainingState.PRE_BACKWARD
        self.needs_post_backward = True
        if self.controls.unshard_in_backward:  # set_unshard_in_backward(False): the backward needs no values
            self.unshard()
            self.wait_for_unshard()

    def post_backward(self) -> None:
        """Reshard, then reduce-scatter the unsharded grads (unless gradient sync is off)."""
        self.training_state = TrainingState.POST_BACKWARD
        self.needs_post_backward = False
        if self.controls.reshard_after_backward:
            self.reshard()
        if not self.controls.requires_gradient_sync:
            for param in self.params:
                param.grads.stash()  # kept unsharded until a backward with sync on
            return
        self.finish_reduce_scatter()  # a second use of the group in one step: apply the first
        unused = self.controls.reduce_scatter_unused_params
        params, grads = take_unsharded_grads(self.params, unused)  # the only references
        if not params:
            return
        self.reduce_scatter_result = self.forms.reduce.issue(tuple(params), grads, self.comm, self.meters)
        self.trace("reduce_scatter_issue")

    def finish_reduce_scatter(self) -> None:
        """Wait for the reduce-scatter in flight, if any, reduce across replicas, accumulate into grads."""
        result = self.reduce_scatter_result
        if result is None:
            return
        self.reduce_scatter_result = None  # frees the flat buffers once applied: [Note: buffer lifetime]
        with self.trace_span("reduce_scatter_wait"):
            finished = result.form.finish(result, self.comm)
            output = self.forms.replica_step.reduce(finished, result.params, self.comm, self.meters)
            if output is None:
                return  # kept for a later step across replicas
            controls = self.controls
            factor = controls.gradient_divide_factor or float(self.mesh_info.data_parallel_size)
            if factor != 1.0:
                output.div_(factor)
            if controls.all_reduce_hook is not None:  # sees the gradient as it will be stored (averaged), as torch's
                run_all_reduce_hook(controls.all_reduce_hook, controls.all_reduce_hook_stream, output)
            accumulate_sharded_grads(output, result.params, self.comm, self.host, self.storages, self.name or "<root>")

    def finish_backward_pass(self) -> None:
        """End of every backward: reduce what autograd never handed us, reshard, go idle; reductions
        may still be in flight."""
        if self.needs_post_backward:
            self.post_backward()
        if self.controls.reshard_after_backward:
            self.reshard()
        self.training_state = TrainingState.IDLE

    def finalize_backward(self) -> None:
        """End of the last backward: as ``finish_backward_pass``, and every reduction applied."""
        self.finish_backward_pass()
        self.finish_reduce_scatter()

    def reset(self, drop_unsharded_grads: bool) -> None:
        """Drop per-step state after an exception: finish in-flight work, reshard, go idle.

        ``drop_unsharded_grads`` when the exception hit during backward: the unsharded gradients
        then hold a partial, unusable sum. After a forward exception they are kept (they hold the
        microbatches accumulated with gradient sync off).
        """
        self.finish_reduce_scatter()
        self.reshard()
        if drop_unsharded_grads:
            for param in self.params:
                param.grads.drop()  # a partial sum from the failed backward; no collective
        self.needs_post_backward = False
        self.training_state = TrainingState.IDLE

    # ---- tracing (free when off) ----------------------------------------------------------
    def trace(self, event: str) -> None:
        recorder = self.meters.recorder
        if recorder is not None:
            recorder.instant(event, self.name or "<root>", self.training_state.name)

    def trace_span(self, event: str) -> AbstractContextManager[None]:
        recorder = self.meters.recorder
        if recorder is None:
            return nullcontext()
        return recorder.span(event, self.name or "<root>", self.training_state.name)
