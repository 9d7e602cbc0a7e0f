"""What follows a group's reduce-scatter on a 2-D mesh: its step across the replicas ([Note: reduce forms] in
reduce.py), chosen by ``choose_replica_step`` (choices.py) at construction and again by
``set_requires_all_reduce`` and ``set_separate_reduce_scatter_group``.

    NoReplicas            a 1-D mesh: the shard group's sums are the whole sums
    ReplicaAllReduce      HSDP: one all-reduce (sum) of the group's reduced slots across the replicas
    ReplicaReduceScatter  HFSDP: a reduce-scatter across the replicas into each rank's pieces
    DeferredReplicas      all-reduce off (``set_requires_all_reduce(False)``): the replica-local sums kept
"""

from __future__ import annotations

from typing import Protocol

import torch

from .collective import Collective
from .comm import Comm, Ranks
from .param import FSDPParam
from .trace import Meters


class ReplicaStep(Protocol):
    """What follows the shard group's reduction across the replicas of a 2-D mesh ([Note: reduce forms])."""

    def reduce(
        self, output: torch.Tensor, params: tuple[FSDPParam, ...], comm: Comm, meters: Meters
    ) -> torch.Tensor | None:
        """``output`` reduced across the replicas (None: kept on the parameters for a later step)."""
        ...


class ReplicaReduction(Protocol):
    """HFSDP's reduce-scatter across the replicas, as the replica step calls it (``replicas.ReplicaSync``)."""

    def reduce_scatter(self, output: torch.Tensor, params: tuple[FSDPParam, ...]) -> torch.Tensor:
        """The shard-axis ``output`` reduce-scattered across the replicas into each parameter's piece slot."""
        ...


class NoReplicas:
    """A 1-D mesh: the shard group's sums are the whole sums."""

    def reduce(
        self, output: torch.Tensor, params: tuple[FSDPParam, ...], comm: Comm, meters: Meters
    ) -> torch.Tensor | None:
        return output


class ReplicaAllReduce:
    """HSDP: kept replica-local sums folded in, then one all-reduce (sum) across the replicas.

    Example, 2 replicas x 2 shards: rank (r0,s0) holds after the reduce-scatter the sum of s0-slots over its
    replica; the all-reduce adds replica r1's sum for the same slot; dividing by 4 gives DDP's mean."""

    def __init__(self, replicas: Ranks, collective: Collective) -> None:
        self.replicas = replicas  # the replicate group
        self.collective = collective  # its collectives, chosen once: [Note: one collective seam]

    def reduce(
        self, output: torch.Tensor, params: tuple[FSDPParam, ...], comm: Comm, meters: Meters
    ) -> torch.Tensor | None:
        with comm.after("all_reduce", comm.record_current()):  # the all-reduce reads the reduced output
            folded = [param.grads.add_partial_reduced(slot) for param, slot in _slots(output, params)]
            work = self.collective.all_reduce(output, self.replicas, async_op=comm.async_work)
            size = self.replicas.size
            meters.count("replica_all_reduce", 2 * output.nbytes * (size - 1) // size)
        comm.wait(work, comm.record("all_reduce"))  # compute reads the all-reduced output from here on
        del folded  # compute-stream tensors the all-reduce stream read: released once compute waited
        return output


class ReplicaReduceScatter:
    """HFSDP: kept replica-local sums folded in, then a reduce-scatter across the replicas into each rank's
    pieces ([Note: replica-sharded groups])."""

    def __init__(self, replicas: ReplicaReduction) -> None:
        self.replicas = replicas  # the group's ReplicaSync

    def reduce(
        self, output: torch.Tensor, params: tuple[FSDPParam, ...], comm: Comm, meters: Meters
    ) -> torch.Tensor | None:
        for param, slot in _slots(output, params):
            param.grads.add_partial_reduced(slot)
        return self.replicas.reduce_scatter(output, params)


class DeferredReplicas:
    """HSDP or HFSDP with ``set_requires_all_reduce(False)``: the replica-local sums are kept on the
    parameters (``param.grads.partial_reduced_grad``) and added in by the next step across replicas; nothing is lost."""

    def reduce(
        self, output: torch.Tensor, params: tuple[FSDPParam, ...], comm: Comm, meters: Meters
    ) -> torch.Tensor | None:
        for param, slot in _slots(output, params):
            param.grads.keep_partial_reduced(slot)
        return None


def _slots(output: torch.Tensor, params: tuple[FSDPParam, ...]) -> list[tuple[FSDPParam, torch.Tensor]]:
    return list(zip(params, torch.split(output, [p.padded_numel for p in params])))
