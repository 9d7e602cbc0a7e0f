"""Mesh helpers: the default 1D mesh, and the view of a mesh that the runtime needs.

The runtime never assumes a mesh shape: it asks ``MeshInfo`` for the group to all-gather and
reduce-scatter over (the ``shard`` axis) and the placements a sharded parameter carries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Placement, Shard


def default_mesh(device_type: str) -> DeviceMesh:
    """A 1D mesh over the default process group, named ``("shard",)``."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "fully_shard(mesh=None) needs an initialized default process group: call "
            "torch.distributed.init_process_group(...) first, or pass mesh=DeviceMesh(...)"
        )
    return init_device_mesh(device_type, (dist.get_world_size(),), mesh_dim_names=("shard",))


@dataclass(frozen=True)
class MeshInfo:
    """What the runtime needs from a mesh: the shard group, its size and this rank's place in it."""

    mesh: DeviceMesh
    shard_axis: int  # mesh axis that parameters are sharded over
    shard_group: dist.ProcessGroup
    shard_size: int
    shard_rank: int

    @property
    def placements(self) -> tuple[Placement, ...]:
        return (Shard(0),)

    @property
    def device(self) -> torch.device:
        """The device this rank computes on: cuda:<current> for a CUDA mesh, else the mesh's type."""
        if self.mesh.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(self.mesh.device_type)


def mesh_info_for(mesh: DeviceMesh) -> MeshInfo:
    """Describe ``mesh`` for the runtime; raises naming the shape when it is not supported."""
    if mesh.ndim != 1:
        names = mesh.mesh_dim_names or ()
        raise ValueError(
            f"fully_shard supports 1D meshes; got a {mesh.ndim}D mesh of shape "
            f"{tuple(mesh.shape)} (axes {names}). HSDP (2D meshes) is not supported yet."
        )
    return MeshInfo(
        mesh=mesh,
        shard_axis=0,
        shard_group=mesh.get_group(0),
        shard_size=mesh.size(0),
        shard_rank=mesh.get_local_rank(0),
    )
