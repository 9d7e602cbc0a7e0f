"""Mesh helpers: the default 1D mesh, and the view of a mesh that the runtime needs.

The runtime never assumes a mesh shape: it asks ``MeshInfo`` for the group to all-gather and
reduce-scatter over (the ``shard`` axis) and the placements a sharded parameter carries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Placement, Replicate, Shard


def require_default_group(caller: str) -> None:
    """Raise the clear error for a mesh asked of a process group that does not exist yet."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{caller} needs an initialized default process group: call "
            "torch.distributed.init_process_group(...) first, or pass mesh=DeviceMesh(...)"
        )


def default_mesh(device_type: str) -> DeviceMesh:
    """A 1D mesh over the default process group, named ``("shard",)``."""
    require_default_group("fully_shard(mesh=None)")
    return init_device_mesh(device_type, (dist.get_world_size(),), mesh_dim_names=("shard",))


def backend_device_type(preferred: str | None = None) -> str:
    """The device type a mesh built over the default process group computes on ([Note: device rule])."""
    require_default_group("fully_shard(mesh=None)")
    return device_type_for_backend(str(dist.get_backend()), preferred, torch.cuda.is_available())


def device_type_for_backend(backend: str, preferred: str | None, cuda_available: bool) -> str:
    """The backend decides: one that talks CUDA (``nccl``, ``cpu:gloo,cuda:nccl``) gives ``"cuda"``, a
    CPU-only one (``gloo``, ``cpu:gloo``, ``mpi``) gives ``"cpu"``. A backend that takes any device (the
    fake process group, custom ones) gives ``preferred`` (the parameters' device type, when they are on
    a real device) or, without one, ``"cuda"`` when CUDA is available."""
    parts = [part.strip().lower() for part in backend.split(",")]
    names = {part.rpartition(":")[2] for part in parts}
    devices = {part.rpartition(":")[0] for part in parts if ":" in part}
    if "cuda" in devices or "nccl" in names:
        return "cuda"
    if names <= {"gloo", "mpi"}:
        return "cpu"
    if preferred is not None:
        return preferred
    return "cuda" if cuda_available else "cpu"


# [Note: device rule]
# Which device a job computes on is a property of the job, not of the machine: a gloo job on a machine
# that has GPUs is a CPU job. So a mesh fsdp2lite builds itself (``fully_shard(mesh=None)``,
# ``init_mesh()`` without ``device_type``) takes its device type from the default process group's
# backend (``backend_device_type``), and only a backend that serves every device (the fake process
# group) falls back to the parameters' device, then to CUDA when present. A mesh passed in always
# wins: its ``device_type`` is the compute device. Parameters not offloaded must already be on that
# device type (or on meta); with CPU offload they stay on the host and the mesh's device computes.


def resolve_mesh_degrees(replicate: int, shard: int, world_size: int) -> tuple[int, int]:
    """(replicate, shard) with ``shard=-1`` resolved to the remaining ranks; raises with the numbers."""
    if replicate < 1 or (shard < 1 and shard != -1):
        raise ValueError(f"mesh degrees must be >= 1 (shard may be -1), got replicate({replicate}), shard({shard})")
    if shard == -1:
        if world_size % replicate:
            raise ValueError(
                f"mesh replicate({replicate}) does not divide world_size({world_size}), "
                "so shard=-1 cannot take the remaining ranks"
            )
        shard = world_size // replicate
    if replicate * shard != world_size:
        raise ValueError(f"mesh replicate({replicate}) * shard({shard}) != world_size({world_size})")
    return replicate, shard


def init_mesh(*, replicate: int = 1, shard: int = -1, device_type: str | None = None) -> DeviceMesh:
    """A mesh over the default process group: 1D ``("shard",)`` when ``replicate == 1``, else 2D
    ``("replicate", "shard")`` for HSDP. ``shard=-1`` takes the remaining ranks. ``device_type=None``:
    the process group's backend decides ([Note: device rule])."""
    require_default_group("init_mesh")
    replicate, shard = resolve_mesh_degrees(replicate, shard, dist.get_world_size())
    device_type = device_type or backend_device_type()  # [Note: device rule]
    if replicate == 1:
        return init_device_mesh(device_type, (shard,), mesh_dim_names=("shard",))
    return init_device_mesh(device_type, (replicate, shard), mesh_dim_names=("replicate", "shard"))


@dataclass(frozen=True)
class MeshInfo:
    """What the runtime needs from a mesh: the shard group (and, for HSDP, the replicate group)."""

    mesh: DeviceMesh
    shard_group: dist.ProcessGroup
    shard_size: int
    shard_rank: int
    replicate_group: dist.ProcessGroup | None  # None on a 1D mesh
    replicate_size: int

    @property
    def placements(self) -> tuple[Placement, ...]:
        """``(Shard(0),)`` on a 1D mesh; ``(Replicate(), Shard(0))`` on a (replicate, shard) mesh."""
        return (Shard(0),) if self.replicate_group is None else (Replicate(), Shard(0))

    @property
    def data_parallel_size(self) -> int:
        """Ranks whose gradients are averaged: shard size times replicas."""
        return self.shard_size * self.replicate_size

    @property
    def device(self) -> torch.device:
        """The device this rank computes on: cuda:<current> for a CUDA mesh, else the mesh's type."""
        if self.mesh.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(self.mesh.device_type)

    def post_forward_group(self, ranks: int) -> tuple[dist.ProcessGroup, int]:
        """(group, rank in it) of this rank's ``ranks`` consecutive shard-group neighbours.

        Creates the subgroups collectively: every rank of the mesh must call this with the same value.
        """
        shard_ranks = self.mesh.mesh  # (shard,) or (replicate, shard) global ranks
        split = shard_ranks.reshape(*shard_ranks.shape[:-1], self.shard_size // ranks, ranks)
        names = (*(("replicate",) if split.dim() == 3 else ()), "shard_outer", "shard_inner")
        sub_mesh = DeviceMesh(self.mesh.device_type, split, mesh_dim_names=names)
        return sub_mesh.get_group("shard_inner"), sub_mesh.get_local_rank("shard_inner")


def mesh_info_for(mesh: DeviceMesh) -> MeshInfo:
    """Describe ``mesh`` for the runtime: 1D = FSDP; 2D ordered (replicate, shard) = HSDP."""
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"fully_shard takes a 1D mesh (shard) or a 2D mesh (replicate, shard); got a {mesh.ndim}D mesh "
            f"of shape {tuple(mesh.shape)}"
        )
    names = mesh.mesh_dim_names
    if mesh.ndim == 2 and names is not None and tuple(names) != ("replicate", "shard"):
        raise ValueError(
            f"a 2D mesh must be ordered (replicate, shard); got axes {tuple(names)}. Build it with "
            "fsdp2lite.init_mesh(replicate=R, shard=S) or name its axes ('replicate', 'shard')"
        )
    shard_axis = mesh.ndim - 1  # the axis order is checked above: (replicate, shard) or (shard,)
    return MeshInfo(
        mesh=mesh,
        shard_group=mesh.get_group(shard_axis),
        shard_size=mesh.size(shard_axis),
        shard_rank=mesh.get_local_rank(shard_axis),
        replicate_group=mesh.get_group(0) if mesh.ndim == 2 else None,
        replicate_size=mesh.size(0) if mesh.ndim == 2 else 1,
    )
