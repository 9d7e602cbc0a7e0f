"""The settings of a group that decide how it communicates, and the choosing of its forms.

What a group's hot path does depends on facts fixed between setter calls: its parameters' dtypes and hooks,
its mesh, its collective, its CommPolicy, a custom all-gather or reduce-scatter, a reduce-scatter group of its
own, whether replicas all-reduce, HFSDP. Each setter here records its value and re-chooses the one form it
affects ([Note: gather forms] in gather.py, [Note: reduce forms] in reduce.py, [Note: one collective seam] in
collective.py); ``unshard`` and the reduction then call the forms without asking about features (STYLE.md
rule 17).
"""

from __future__ import annotations

import torch.distributed as dist

from ..mesh import MeshInfo
from ..policies import CommPolicy
from .collective import AllGatherComm, Collective, ReduceScatterComm, collective_for
from .comm import Ranks
from .gather import GatherForm, choose_gather, quantized_gather_problem
from .param import FSDPParam
from .reduce import ReduceForm, choose_reduce
from .replica_step import DeferredReplicas, NoReplicas, ReplicaAllReduce, ReplicaReduceScatter, ReplicaStep
from .replicas import ReplicaSync
from .split_reduce import split_if_mixed


class GroupForms:
    """A group's communication settings and the forms they choose (the group holds it as ``forms``; made at the
    group's construction, then changed only by its setters)."""

    requires_all_reduce: bool  # HSDP: all-reduce across replicas after the reduce-scatter
    replicas: ReplicaSync | None  # HFSDP: [Note: replica-sharded groups]
    gather: GatherForm  # how the group all-gathers: [Note: gather forms]
    reduce: ReduceForm  # how the group reduce-scatters: [Note: reduce forms]
    replica_step: ReplicaStep  # and then across replicas (2-D meshes)
    reduce_scatter_group: dist.ProcessGroup | None  # a group of its own for reduce-scatters; None: the shard group
    collective: Collective  # the shard group's collectives, the forms' seam: [Note: one collective seam]
    custom_all_gather: AllGatherComm | None  # torch's AllGather protocol (allocate + __call__), or None
    custom_reduce_scatter: ReduceScatterComm | None  # torch's ReduceScatter protocol, or None
    comm_policy: CommPolicy  # quantized all-gather, all-to-all reduce-scatter: [Note: quantized collectives]

    def __init__(
        self, params: tuple[FSDPParam, ...], mesh_info: MeshInfo, replicas: ReplicaSync | None, policy: CommPolicy
    ) -> None:
        """The forms of a new group over ``params`` (their storages made) under its plan's ``policy``, checked by
        the plan ([Note: one plan])."""
        self.params, self.mesh_info, self.replicas = params, mesh_info, replicas
        self.requires_all_reduce = True
        self.reduce_scatter_group = None
        self.collective = collective_for(mesh_info.shard_group, mesh_info.device)  # once per group
        self.custom_all_gather = self.custom_reduce_scatter = None
        self.set_comm_policy(policy)
        self.choose_replica_step()

    def set_comm_policy(self, policy: CommPolicy) -> None:
        """Quantize the group's all-gather and pick its reduce-scatter's form ([Note: quantized collectives]);
        a quantized all-gather needs one slot of plain floating-point parameters of one dtype."""
        packed = [(p.fqn, p.unit.gather_dtype, p.orig_dtype.is_floating_point) for p in self.params]
        reason = None if policy.all_gather is None else quantized_gather_problem(packed)
        if reason is not None:
            raise ValueError(
                f"CommPolicy(all_gather={policy.all_gather!r}) quantizes a group's parameters together, but {reason}; "
                "give them a group of their own (or keep all_gather=None for this group)"
            )
        self.comm_policy = policy
        self.choose_gather()
        self.choose_reduce()

    def set_collective(self, collective: Collective) -> None:
        """Run the shard group's collectives through ``collective`` (the estimator's simulated ranks, on the fake
        process group, take the target device's: ``GlooInPlace`` for a CPU target)."""
        self.collective = collective
        self.choose_gather()
        self.choose_reduce()

    def set_custom_all_gather(self, comm: AllGatherComm | None) -> None:
        """torch's AllGather protocol (``allocate`` + ``__call__``) instead of the group's own collective."""
        self.custom_all_gather = comm
        self.choose_gather()

    def set_custom_reduce_scatter(self, comm: ReduceScatterComm | None) -> None:
        """torch's ReduceScatter protocol (``allocate`` + ``__call__``) instead of the group's own collective."""
        self.custom_reduce_scatter = comm
        self.choose_reduce()

    def set_requires_all_reduce(self, requires_all_reduce: bool) -> None:
        """HSDP: skip (False) the step across replicas; the replica-local sums are kept and added later."""
        self.requires_all_reduce = requires_all_reduce
        self.choose_replica_step()

    def choose_reduce(self) -> None:
        """The group's reduce form ([Note: reduce forms]), over its reduce-scatter group (the same ranks and
        backend as the shard group, so the same collective) or the shard group."""
        info = self.mesh_info
        group = self.reduce_scatter_group or info.shard_group
        ranks = Ranks(group, info.shard_size, info.shard_rank)
        form = choose_reduce(ranks, self.comm_policy, self.collective, self.custom_reduce_scatter)
        self.reduce = split_if_mixed(self.params, form)  # [Note: per-parameter mixed precision]

    def choose_replica_step(self) -> None:
        """What follows the reduce-scatter on a 2-D mesh ([Note: reduce forms])."""
        replicate_group = self.mesh_info.replicate_group
        if replicate_group is None:
            self.replica_step = NoReplicas()
        elif not self.requires_all_reduce:
            self.replica_step = DeferredReplicas()
        elif self.replicas is not None:
            self.replica_step = ReplicaReduceScatter(self.replicas)
        else:
            replicas = Ranks(replicate_group, self.mesh_info.replicate_size, dist.get_rank(replicate_group))
            self.replica_step = ReplicaAllReduce(replicas, collective_for(replicate_group, self.mesh_info.device))

    def choose_gather(self) -> None:
        """The group's gather form, from what it depends on now ([Note: gather forms])."""
        info = self.mesh_info
        ranks = Ranks(info.shard_group, info.shard_size, info.shard_rank)
        self.gather = choose_gather(self.params, ranks, self.comm_policy, self.collective, self.custom_all_gather)

    def set_separate_reduce_scatter_group(
        self, enable: bool, created: dict[tuple[int, ...], dist.ProcessGroup]
    ) -> None:
        """A process group of its own over the shard ranks for reduce-scatters (``created`` shares one per
        rank set between groups), or None to use the shard group."""
        if not enable:
            self.reduce_scatter_group = None
        else:
            ranks = tuple(dist.get_process_group_ranks(self.mesh_info.shard_group))
            if ranks not in created:
                created[ranks] = dist.new_group(list(ranks), use_local_synchronization=True)
            self.reduce_scatter_group = created[ranks]
        self.choose_reduce()  # decided again for the new group
