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
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import _StridedShard


def require_default_group(caller: str) -> None:
    """Raise the clear error for a mesh asked of a process group that does not exist yet."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{caller} needs an initialized default process group: call "
            "torch.distributed.init_process_group(...) first, or pass mesh=DeviceMesh(...)"
        )


def default_mesh(device_type: str) -> DeviceMesh:
    """A 1D mesh over the default process group, unnamed: equal to torch's default and to
    ``init_device_mesh(device_type, (world_size,))``, so ``param.device_mesh == mesh`` holds."""
    require_default_group("fully_shard(mesh=None)")
    return init_device_mesh(device_type, (dist.get_world_size(),))


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
    """(replicate, shard) with a -1 (either one, not both) resolved to the remaining ranks; raises with
    the numbers."""
    if (replicate < 1 and replicate != -1) or (shard < 1 and shard != -1):
        raise ValueError(
            f"mesh degrees must be >= 1 (or -1: the remaining ranks), got replicate({replicate}), shard({shard})"
        )
    if replicate == -1 and shard == -1:
        raise ValueError(
            "mesh replicate(-1) and shard(-1): only one degree can take the remaining ranks; set the other"
        )
    if -1 in (replicate, shard):
        given, degree, auto = ("shard", shard, "replicate") if replicate == -1 else ("replicate", replicate, "shard")
        if world_size % degree:
            raise ValueError(
                f"mesh {given}({degree}) does not divide world_size({world_size}), "
                f"so {auto}=-1 cannot take the remaining ranks"
            )
        if replicate == -1:
            replicate = world_size // shard
        else:
            shard = world_size // replicate
    if replicate * shard != world_size:
        raise ValueError(f"mesh replicate({replicate}) * shard({shard}) != world_size({world_size})")
    return replicate, shard


def init_mesh(*, replicate: int = 1, shard: int = -1, device_type: str | None = None) -> DeviceMesh:
    """A mesh over the default process group: 1D ``("shard",)`` when ``replicate == 1``, else 2D
    ``("replicate", "shard")`` for HSDP. ``shard=-1`` (or ``replicate=-1``, with ``shard`` given) takes
    the remaining ranks. ``device_type=None``:
    the process group's backend decides ([Note: device rule])."""
    for name, value in (("replicate", replicate), ("shard", shard)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"init_mesh({name}=...) must be an int, got {value!r} ({type(value).__name__})")
    if device_type is not None and not isinstance(device_type, str):
        raise TypeError(f"init_mesh(device_type=...) must be a str like 'cuda' or 'cpu', or None; got {device_type!r}")
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
    def data_parallel_size(self) -> int:
        """Ranks whose gradients are averaged: shard size times replicas."""
        return self.shard_size * self.replicate_size

    @property
    def device(self) -> torch.device:
        """The device this rank computes on: cuda:<current> for a CUDA mesh, else the mesh's type."""
        if self.mesh.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(self.mesh.device_type)

    @property
    def shard_mesh(self) -> DeviceMesh:
        """The 1D mesh of this rank's shard group (what torch hands an all-gather extension hook)."""
        if self.mesh.ndim == 1:
            return self.mesh
        names = self.mesh.mesh_dim_names
        if names is None:
            raise ValueError(
                "a parameter with torch's all-gather extension hooks on a 2D mesh needs named axes (its hook gets "
                "the shard axis as a 1D mesh): init_device_mesh(..., mesh_dim_names=('replicate', 'shard'))"
            )
        return self.mesh[names[1]]

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
    """Describe ``mesh`` for the runtime: 1D = FSDP; 2D = HSDP, dim 0 replicating and dim 1 sharding
    whatever the axes are named (as torch's: torchtitan names them ``dp_replicate``, ``dp_shard``)."""
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"fully_shard takes a 1D mesh (shard) or a 2D mesh (replicate, shard); got a {mesh.ndim}D mesh "
            f"of shape {tuple(mesh.shape)}{f' with axes {tuple(mesh.mesh_dim_names)}' if mesh.mesh_dim_names else ''}"
            ": pass the data-parallel sub-mesh, e.g. mesh['dp'] or mesh['dp_replicate', 'dp_shard']"
        )
    shard_axis = mesh.ndim - 1  # (shard,) or (replicate, shard), by position
    return MeshInfo(
        mesh=mesh,
        shard_group=mesh.get_group(shard_axis),
        shard_size=mesh.size(shard_axis),
        shard_rank=mesh.get_local_rank(shard_axis),
        replicate_group=mesh.get_group(0) if mesh.ndim == 2 else None,
        replicate_size=mesh.size(0) if mesh.ndim == 2 else 1,
    )


def root_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh ``mesh`` was sliced from (itself when it was not): ``mesh["dp"]`` -> the (dp, tp) mesh."""
    getter = getattr(mesh, "_get_root_mesh", None)  # torch >= 2.8
    if getter is not None:
        return getter()
    from torch.distributed.device_mesh import _mesh_resources  # torch 2.6, 2.7

    return _mesh_resources.get_root_mesh(mesh)


def check_tp_mesh(info: MeshInfo, tp_spec: DTensorSpec) -> str | None:
    """Why a DTensor parameter on ``tp_spec``'s mesh cannot be sharded over ``info``'s mesh, or None.

    Tensor parallel + FSDP needs both meshes sliced from one parent by dim name, with no dim in
    common: ``fully_shard(block, mesh=mesh["dp"])`` for parameters placed on ``mesh["tp"]``."""
    dp_names, tp_names = info.mesh.mesh_dim_names, tp_spec.mesh.mesh_dim_names
    if any(not placement.is_shard() and not placement.is_replicate() for placement in tp_spec.placements):
        placements = tuple(tp_spec.placements)
        return f"its placements {placements} hold a partial value; only Shard and Replicate can be sharded"
    if dp_names is None or tp_names is None:
        return "its mesh or the fully_shard mesh has unnamed dims; slice both from one mesh with named dims"
    if set(dp_names) & set(tp_names):
        common = sorted(set(dp_names) & set(tp_names))
        return f"its mesh {tp_names} shares dims {common} with the fully_shard mesh {dp_names}"
    try:
        dp_tp_mesh(info.mesh, tp_spec.mesh)
    except ValueError as error:
        return str(error)
    return None


_combined: dict[tuple[DeviceMesh, DeviceMesh], DeviceMesh] = {}


def dp_tp_mesh(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> DeviceMesh:
    """The mesh whose dims are ``dp_mesh``'s then ``tp_mesh``'s, both sliced from one parent: what a
    parameter sharded by both lives on. Raises ValueError when they do not come from one parent."""
    key = (dp_mesh, tp_mesh)
    if key in _combined:
        return _combined[key]
    names = (*(dp_mesh.mesh_dim_names or ()), *(tp_mesh.mesh_dim_names or ()))
    hint = (
        "build one mesh (init_device_mesh(..., mesh_dim_names=('dp', 'tp'))) and pass mesh['dp'] to "
        "fully_shard and mesh['tp'] to parallelize_module"
    )
    concatenate = getattr(DeviceMesh, "_concatenate", None)  # torch >= 2.9: by layout, as torch's FSDP does
    if concatenate is not None:
        try:
            combined = concatenate([dp_mesh, tp_mesh])
        except RuntimeError as error:
            raise ValueError(
                f"its mesh {tp_mesh.mesh_dim_names} and the fully_shard mesh do not combine ({error}); {hint}"
            ) from None
    else:
        root = root_mesh(dp_mesh)
        if root_mesh(tp_mesh) != root or root.mesh_dim_names is None:
            raise ValueError(
                f"its mesh {tp_mesh.mesh_dim_names} is not a sub-mesh of the fully_shard mesh's parent; {hint}"
            )
        combined = root if tuple(root.mesh_dim_names) == names else root[names]
    _combined[key] = combined
    return combined


def sharded_placements(
    info: MeshInfo, shard_dim: int, tp_spec: DTensorSpec | None = None
) -> tuple[DeviceMesh, tuple[Placement, ...]]:
    """The mesh and placements of a parameter sharded on ``shard_dim`` over ``info``'s mesh.

    ``(Shard(d),)``, or ``(Replicate(), Shard(d))`` for HSDP. Under tensor parallelism
    ([Note: tensor parallel]) the mesh is the dp dims then the tp dims, each with its placement; the
    shard placement becomes ``_StridedShard(d, split_factor=k)`` when tp dims already split dim d k
    ways (FSDP shards the tp pieces, not the whole tensor)."""
    dp: tuple[Placement, ...] = (Shard(shard_dim),) if info.replicate_group is None else (Replicate(), Shard(shard_dim))
    if tp_spec is None:
        return info.mesh, dp
    split = 1
    for index, placement in enumerate(tp_spec.placements):
        if placement.is_shard(shard_dim):
            split *= tp_spec.mesh.size(index)
    if split > 1:
        dp = (*dp[:-1], _StridedShard(shard_dim, split_factor=split))
    return dp_tp_mesh(info.mesh, tp_spec.mesh), (*dp, *tp_spec.placements)
