"""HFSDP: masters and optimizer state sharded across the replicas too (``ShardingPolicy(replicate="optimizer")``).

[Note: replica-sharded groups]
On a (replicate R, shard S) mesh an HSDP group keeps on each rank its padded chunk of each parameter along
the shard axis (the all-gather input, 1/S of the parameter) and registers that chunk, replicated R times,
as the sharded parameter the optimizer steps: R copies of every master weight and of the optimizer state.
An HFSDP group keeps the same chunk as its all-gather input but registers only a *piece* of it: the chunk's
rows split R ways as ``torch.chunk`` splits them, replica r holding piece r. The piece is a view of the
chunk (the optimizer writes the chunk in place) wrapped in a DTensor placed
``(_StridedShard(0, split_factor=S), Shard(0))``: pieces of shard-axis chunks, one 1/(R*S) piece per rank,
which DTensor, ``full_tensor``, ``clip_grad_norm_`` and DCP checkpoints understand.

    P = 5 rows, R = 2, S = 2: chunk s0 = rows 0-2, chunk s1 = rows 3-4 (padded to 3 rows)
    pieces: (r0, s0) rows 0-1, (r1, s0) row 2, (r0, s1) row 3, (r1, s1) row 4

A step:
- backward: the shard-axis reduce-scatter, as HSDP; then, where HSDP all-reduces the chunk's gradient across
  the replicas, a reduce-scatter across them: each chunk's rows laid out rank-major in R equal slots of
  ``ceil(rows / R)`` rows (zero-padded), so each replica receives the summed gradient of its piece only;
- the optimizer steps the pieces: its state is 1/(R*S) of the total per rank where HSDP's is 1/S;
- the next unshard first all-gathers the pieces across the replicas back into the chunk (one collective per
  group), then runs the shard-axis all-gather as HSDP does.
Both replica collectives go through the replicate group's ``Collective`` (chosen once, at construction: gloo's
in-place reduce-scatter or the native one) and are placed by ``Comm`` as the shard-axis ones are: on CUDA on the
side streams, the compute stream waiting on their events; on CPU issued ``async_op=True``, the Work waited just
before the output is read ([Note: one collective seam] in collective.py).

When the replica all-gather runs: after a backward reduced gradients into the pieces (the same on every
replica, so all of them take part; an optimizer step is expected to follow), and for any parameter whose
piece's version counters (the DTensor's and its local tensor's, as [Note: resident groups]) moved since the
last gather: ``optimizer.step()``, ``copy_``, ``load_state_dict``, a DCP load. Writes through ``.data`` are
not seen; ``model.reshard()`` marks every chunk stale, so the next forward gathers anew. Chunks are never
used stale: a forward always sees what the optimizer wrote.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import _StridedShard

from .collective import collective_for
from .comm import Ranks
from .extension import contiguous_stride
from .layout import ShardLayout
from .param import FSDPParam, ShardStorage
from .seams import GroupView
from .zero import ShardRefresher, ShardWatch


class ReplicaPieces(ShardStorage):
    """HFSDP's storage: the chunk as HSDP's, a piece of it registered ([Note: replica-sharded groups],
    [Note: shard storage])."""

    pinned_alone = True  # the chunk is pinned by itself under CPU offload, outside the group's host buffer
    # the chunk's real rows split over the replicas as torch.chunk splits them ([Note: padded shard] in layout.py):
    # this replica's piece at ``start``, ``local_rows`` rows (0 past the chunk's end); every replica's slot in
    # the replica collectives ``padded_rows`` rows
    piece: ShardLayout

    def register(self, param: FSDPParam) -> tuple[torch.Tensor, DTensorSpec]:
        info = param.mesh_info
        chunk = (param.layout.local_rows, *param.gather_shape[1:])
        self.piece = ShardLayout(chunk, 0, info.replicate_size, info.mesh.get_local_rank(0))
        meta = TensorMeta(param.orig_shape, contiguous_stride(param.orig_shape), param.orig_dtype)
        placements = (_StridedShard(0, split_factor=info.shard_size), Shard(0))
        spec = DTensorSpec(info.mesh, placements, tensor_meta=meta)
        return self.piece.local_of(param.padded_shard), spec

    def local_shape(self, param: FSDPParam) -> tuple[int, ...]:
        return self.piece.local_shape

    def grad_stride(self, param: FSDPParam) -> tuple[int, ...]:
        return contiguous_stride(self.local_shape(param))

    def reduced_numel(self, param: FSDPParam) -> int:
        """Elements of this parameter's slot in the replica reduce-scatter's output."""
        return self.piece.padded_numel

    def local_of_full(self, param: FSDPParam, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of a full value (``load_state_dict`` of a full state dict), no communication."""
        local = self.piece.local_of(param.layout.local_of(full.detach()))
        return local.to(param.padded_shard.device, param.orig_dtype)

    def renew(self, param: FSDPParam, local: torch.Tensor) -> bool:
        """A new local tensor (``to_empty``, ``module.to``, an assigning load) is written into its rows of a chunk
        of its dtype, and the DTensor points back at that view. The chunk's other rows then hold old (or no)
        values: the group gathers them at its next unshard."""
        chunk = self.home.padded(param.padded_shape, local.dtype, local.device, alone=True)  # [Note: shard home]
        if chunk.device.type != "meta":
            if param.padded_shard.device.type != "meta":
                chunk.copy_(param.padded_shard)
            self.piece.local_of(chunk).copy_(local.detach())
        param.adopt_shard(chunk)
        param.register_view(self.piece.local_of(chunk))
        return True


def pieces(param: FSDPParam) -> ReplicaPieces:
    """The replica pieces of a parameter of an HFSDP group (its storage, chosen by ``storages.param_storage``)."""
    storage = param.storage
    if not isinstance(storage, ReplicaPieces):
        raise RuntimeError(f"{param.fqn}: in a replica-sharded group without replica pieces")
    return storage


class ReplicaSync(ShardRefresher):
    """An HFSDP group's replica collectives and the freshness of its chunks ([Note: replica-sharded groups])."""

    def __init__(self, group: GroupView) -> None:
        info = group.mesh_info
        if info.replicate_group is None:
            raise RuntimeError(f"{group.name}: replica-sharded on a 1-D mesh (fully_shard checks the mesh first)")
        self.group = group
        self.ranks = Ranks(info.replicate_group, info.replicate_size, info.mesh.get_local_rank(0))  # the replicas
        self.collective = collective_for(info.replicate_group, info.device)  # once: [Note: one collective seam]
        self.watch = ShardWatch(list(group.params))  # stale: gradients were reduced, or the chunks were reset
        self.gathers = 0  # replica all-gathers run (tests and trace read it)

    def refresh(self) -> None:
        """All-gather across the replicas the pieces of every chunk that may be stale (none: no collective)."""
        due = self.watch.due()
        if due and self.group.mesh_info.replicate_size > 1:
            self._all_gather(due)
            self.gathers += 1
            self.group.trace("replica_all_gather")
        self.watch.record()

    def _all_gather(self, params: list[FSDPParam]) -> None:
        """One all-gather (as bytes: the parameters may differ in dtype) of the pieces into the chunks, placed by
        ``Comm`` as the shard-axis one is (``gather.issue_all_gather``): copy-in and collective on side streams
        (CUDA), a Work waited just before the copy back reads it (CPU)."""
        comm, replicas = self.group.comm, self.ranks.size
        sizes = [p.reduced_numel * p.padded_shard.element_size() for p in params]
        with comm.on("all_gather_copy_in"):  # after the compute stream: the optimizer wrote the pieces there
            send = torch.zeros(sum(sizes), dtype=torch.uint8, device=comm.device)
            for param, piece in zip(params, send.split(sizes)):
                rows = pieces(param).piece.local_of(param.padded_shard)
                piece[: rows.numel() * rows.element_size()].copy_(rows.reshape(-1).view(torch.uint8))
            received = self.collective.gather_buffer((replicas * send.numel(),), torch.uint8, comm.device)
        with comm.after("all_gather", comm.record("all_gather_copy_in")):  # the collective reads the copy-in
            work = self.collective.all_gather(received, send, self.ranks, async_op=comm.async_work)
        self.group.meters.count("replica_all_gather", send.nbytes * (replicas - 1))
        comm.wait(work, comm.record("all_gather"))  # the copy back below reads the gathered pieces
        received = received.view(replicas, send.numel())
        for param, columns in zip(params, received.split(sizes, dim=1)):
            chunks = columns.contiguous().view(param.padded_shard.dtype)
            rows = chunks.view(replicas * pieces(param).piece.padded_rows, *param.gather_shape[1:])
            local_rows = param.layout.local_rows
            param.padded_shard.narrow(0, 0, local_rows).copy_(rows[:local_rows])
        comm.release(send)  # waited on and copied back: freed now, not when gloo lets go of its Work
        comm.release(received)

    def reduce_scatter(self, output: torch.Tensor, params: tuple[FSDPParam, ...]) -> torch.Tensor:
        """The shard-axis reduce-scatter's ``output`` (each parameter's chunk gradient, summed over its replica)
        reduce-scattered across the replicas: each parameter's piece gradient, summed over every rank, in
        slots of ``reduced_numel``. Replaces HSDP's all-reduce; placed by ``Comm`` as HSDP's all-reduce is."""
        comm, replicas = self.group.comm, self.ranks.size
        blocks = []
        for param, slot in zip(params, output.split([p.padded_numel for p in params])):
            rows = slot.view(param.layout.padded_rows, -1)
            want = replicas * pieces(param).piece.padded_rows
            short = want - rows.shape[0]
            rows = torch.nn.functional.pad(rows, (0, 0, 0, short)) if short > 0 else rows[:want]
            blocks.append(rows.reshape(replicas, -1))
        send = torch.cat(blocks, dim=1)  # (replicas, total): rank-major, one slot per replica
        self.watch.stale = True  # the pieces get new gradients: an optimizer step follows
        if replicas == 1:
            return send[0]
        in_place = self.collective.in_place  # gloo: this rank's slot of send, all-reduced in place
        received = send[self.ranks.rank] if in_place else torch.empty_like(send[0])
        # send and received are compute-stream tensors, dropped after compute waited: [Note: CUDA buffer lifetime]
        with comm.after("all_reduce", comm.record_current()):  # the collective reads send, written on compute
            work = self.collective.reduce_scatter(received, send, self.ranks, async_op=comm.async_work)
        comm.wait(work, comm.record("all_reduce"))  # compute reads the reduced pieces from here on
        ring = send.nbytes * (replicas - 1) // replicas
        kind = "replica_all_reduce" if in_place else "replica_reduce_scatter"
        self.group.meters.count(kind, 2 * ring if in_place else ring)
        reduced = received.clone() if in_place else received  # in place: off send, which goes now
        comm.release(send)  # waited on: freed now, not when gloo lets go of its Work
        return reduced
