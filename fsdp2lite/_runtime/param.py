"""One sharded parameter: its padded local shard, its DTensor, its unsharded storage.

Layout: each rank's rows along the shard dim d (0 unless ``shard_placement_fn`` says otherwise), torch.chunk's,
padded to the same ``padded_rows`` on every rank; the arithmetic is one record, ``self.layout`` (a ``ShardLayout``,
[Note: padded shard] in layout.py), that every copy-in, copy-out, storage and gradient view reads. The DTensor's
local tensor is the unpadded view ``padded_shard.narrow(d, 0, local_rows)``, and ``DTensor.full_tensor()`` gives
back the original.

The unsharded parameter is one ``nn.Parameter`` that lives across steps (autograd saves it during
forward and accumulates its gradient); only its storage comes and goes ([Note: unsharded storage]).

[Note: tensor parallel]
A parameter that is already a DTensor when ``fully_shard`` sees it was placed by tensor parallelism
on a tp mesh, a sibling of the data-parallel mesh under one parent (``mesh["dp"]``, ``mesh["tp"]``).
FSDP then shards its *local* tensor (this rank's tp piece) over the dp ranks exactly as it would a
plain parameter: the all-gather and the reduce-scatter run over dp only and rebuild the tp-local
tensor. The sharded parameter is a DTensor on the parent mesh whose placements carry both: the dp
placement (``_StridedShard(d, split_factor=tp)`` when tp already shards dim d, so the dp pieces are
pieces of tp pieces, else ``Shard(d)``) and the tp placements. The unsharded parameter is a DTensor
on the tp mesh again, with the tp placements, so the tensor-parallel forward runs on what it expects;
its gradient, a DTensor on the tp mesh, is brought to those placements and reduced as a local tensor.
"""

from __future__ import annotations

import weakref
from typing import Any, cast

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from ..mesh import MeshInfo, sharded_placements
from ..policies import cast_dtype
from .extension import carry_instance_hooks, contiguous_stride
from .gather_units import GatherUnit, gather_unit, sync_unit
from .grads import ParamGrads
from .identity import original_uid
from .layout import ShardLayout
from .param_policy import ParamPlace, ParamPolicy
from .shard_home import DEVICE, DeviceHome
from .unsharded import UnshardedStorage, make_dtensor

# [Note: frozen]
# Whether a parameter trains is the sharded parameter's ``requires_grad``, read when it is needed: the
# unsharded parameter (what autograd sees) takes the value at every unshard, and the reduce-scatter
# takes gradients of trainable parameters only. So ``requires_grad_(False)`` on a sharded parameter,
# before the first forward or between steps, freezes it: no gradient, nothing for the optimizer.


class ShardStorage:
    """Where a parameter's padded shard lives and what the modules hold of it ([Note: shard storage]).

    This base is ZeRO-3's, CPU offload's host shards included: the registered DTensor's local tensor is this
    rank's rows of the padded shard, the one the all-gather reads. Strategies (not parameter classes) change
    that: HFSDP's replica pieces (``replicas.ReplicaPieces``), host masters (``host_masters.HostMasters``).
    One object per parameter, chosen at ``fully_shard`` (``storages.param_storage``) with the shard's home: on
    its device, or on the host under CPU offload ([Note: shard home] in shard_home.py)."""

    grads_on_host = False  # reduced gradients go to the host without CPU offload (host masters)
    pinned_alone = False  # a host shard pinned by itself, not in its group's host buffer (HFSDP chunks)
    home: DeviceHome  # where the padded shard lives: [Note: shard home]

    def __init__(self, home: DeviceHome = DEVICE) -> None:
        self.home = home

    def register(self, param: FSDPParam) -> tuple[torch.Tensor, DTensorSpec]:
        """The local tensor and spec the sharded parameter is made of, once the padded shard exists."""
        return param.local_view, param.sharded_spec

    def host_tensor(self, param: FSDPParam) -> torch.Tensor | None:
        """What the group's one host buffer holds of this parameter ([Note: one host buffer per group]), or None."""
        packed = self.home.on_host and param.unit.packs_on_host() and not self.pinned_alone
        return param.padded_shard if packed else None

    def adopt_host(self, param: FSDPParam, view: torch.Tensor) -> None:
        """``view`` (of the group's host buffer, a copy of ``host_tensor``) becomes that tensor's home."""
        param.adopt_shard(view)

    def local_shape(self, param: FSDPParam) -> tuple[int, ...]:
        """Shape of the registered local tensor (and of its sharded gradient)."""
        return param.layout.local_shape

    def grad_stride(self, param: FSDPParam) -> tuple[int, ...]:
        """Strides of this rank's sharded gradient, a view of the reduced output."""
        return param.unit.grad_stride(self.local_shape(param))  # [Note: gather units]

    def reduced_numel(self, param: FSDPParam) -> int:
        """Elements of this parameter's slot in its group's reduced gradient."""
        return param.padded_numel

    def local_of_full(self, param: FSDPParam, full: torch.Tensor) -> torch.Tensor:
        """This rank's local tensor cut from a full value, where the registered one lives (no communication)."""
        return param.layout.local_of(full.detach()).to(param.padded_shard.device, param.orig_dtype)

    def renew(self, param: FSDPParam, local: torch.Tensor) -> bool:
        """A new local tensor (``to_empty``, ``module.to``, an assigning load) copied into a new padded shard
        that ``param.local_view`` views; True when the unsharded parameter must be made anew regardless."""
        param.unit.renew(local)  # [Note: gather units]
        return False


# [Note: shard storage]
# Every parameter is one ``FSDPParam`` whatever its ZeRO stage: what differs between ZeRO-3, HFSDP's replica
# pieces and host masters is which tensor the modules hold (a view of the padded shard, a piece of it, a host
# copy of it), its spec, its gradient's layout and how a renewed local tensor is taken in. That is the
# parameter's ``storage`` (``ShardStorage`` and its strategies), asked at those points; the sharded Parameter
# is made once, from what the storage registers; a storage changes the parameter only through its named
# methods (``adopt_shard``, ``register_view``), never by writing its fields. Where the padded shard itself
# lives (on its device, or on the host under CPU offload) is the storage's home, given to it where it is chosen
# ([Note: shard home] in shard_home.py): the parameter, its unit and its unsharded storage ask the home, never
# the offload policy. Where the group keeps its shards fresh (HFSDP's replica all-gather, host masters' copy to
# the device, ZeRO-1/2's kept storage) and packs its host tensors (CPU offload's host buffer) stays with the
# group ([Note: group storage] in seams.py).


class FSDPParam:
    """A parameter managed by fully_shard: sharded on dim 0, unsharded on demand."""

    fqn: str  # name relative to the module fully_shard was called on (for messages)
    places: tuple[ParamPlace, ...]
    orig_shape: torch.Size  # the parameter's global shape
    orig_dtype: torch.dtype
    mesh_info: MeshInfo
    shard_dim: int  # d: the dim sharded over the shard group (0 unless shard_placement_fn says otherwise)
    tp_spec: DTensorSpec | None  # tensor parallel: the parameter's own DTensor spec ([Note: tensor parallel])
    gather_shape: torch.Size  # what the all-gather rebuilds: orig_shape, or the tp-local shape under TP
    layout: ShardLayout  # gather_shape's rows per rank, padded: [Note: padded shard] in layout.py
    padded_shard: torch.Tensor  # gather_shape with padded_rows along d: all-gather input, padding is zero
    flat_shard: torch.Tensor  # padded_shard viewed (padded_numel,): what the all-gather copy-in reads
    local_view: torch.Tensor  # padded_shard.narrow(d, 0, local_rows): the DTensor's local tensor, as made here
    sharded_spec: DTensorSpec  # placements, global shape and stride, orig dtype: for the param and its grad
    sharded_param: DTensor  # an nn.Parameter holding a DTensor; local tensor local_view
    unsharded: UnshardedStorage  # its unsharded storage and Parameter, registered in each state: unsharded.py
    orig_param_ref: weakref.ref  # the user's original Parameter, to detect ties across groups
    orig_uid: int  # the original's number, which outlives it ([Note: original identity])
    param_dtype: torch.dtype  # dtype of the all-gather and the unsharded parameter
    reduce_dtype: torch.dtype  # dtype of the reduce-scatter (and of accumulation with sync off)
    home: DeviceHome  # where the padded shard lives, its storage's, decided once: [Note: shard home]
    policy: ParamPolicy  # kept to re-derive the dtypes when the parameter's own dtype changes (``module.to``)
    unit: GatherUnit  # its part of the group's all-gather, plain or through hooks: [Note: gather units]
    mp_policy: Any  # the MixedPrecisionPolicy, handed to a 5-argument fsdp_pre_all_gather
    storage: ShardStorage  # where the shard lives and what is registered: [Note: shard storage]
    grads: ParamGrads  # its unsharded gradient between autograd and the reduction, and the kept sums: grads.py
    # its shard and all-gather part: its GatherUnit (gather_units.py)

    def __init__(
        self,
        param: nn.Parameter,
        fqn: str,
        places: tuple[ParamPlace, ...],
        mesh_info: MeshInfo,
        policy: ParamPolicy,
        shard_dim: int = 0,
        mp_policy: Any = None,
        *,
        storage: ShardStorage | None = None,
    ) -> None:
        self.fqn = fqn
        self.storage = storage or ShardStorage()
        self.home = self.storage.home
        self.places = places
        self.orig_shape = param.shape
        self.orig_dtype = param.dtype
        self.mesh_info = mesh_info
        self.shard_dim = shard_dim
        self.policy = policy
        self._set_dtypes(param.dtype)
        self.grads = ParamGrads(self)
        self.orig_param_ref = weakref.ref(param)
        self.orig_uid = original_uid(param)
        data: torch.Tensor = param.detach()
        self.tp_spec = None
        if isinstance(param, DTensor):  # [Note: tensor parallel]
            self.tp_spec = param._spec  # type: ignore[attr-defined]
            data = param._local_tensor.detach()  # type: ignore[attr-defined]
        self.mp_policy = mp_policy
        self.unit = gather_unit(self, data, isinstance(param, DTensor))  # where its hooks are found
        self._make_padded_shard(data)
        local, self.sharded_spec = self.storage.register(self)  # [Note: shard storage]
        sharded = nn.Parameter(make_dtensor(local, self.sharded_spec), requires_grad=param.requires_grad)
        self.local_view = sharded._local_tensor  # type: ignore[attr-defined]  # nn.Parameter detached it: the same view
        self.sharded_param = cast(DTensor, sharded)
        self.unsharded = UnshardedStorage(self)
        self.set_on_modules(self.sharded_param)

    def _make_padded_shard(self, data: torch.Tensor) -> None:
        """This rank's padded shard of ``data`` (the parameter, or its tp-local tensor) and the layout around it
        ([Note: padded shard] in layout.py): its layout, the DTensor spec of ZeRO-3's registered shard."""
        self.gather_shape = data.shape
        mesh, placements = sharded_placements(self.mesh_info, self.shard_dim, self.tp_spec)
        meta = TensorMeta(self.orig_shape, contiguous_stride(self.orig_shape), self.orig_dtype)
        self.sharded_spec = DTensorSpec(mesh, placements, tensor_meta=meta)
        self.unit.make_shard(data)  # its layout and padded shard: [Note: gather units]

    def _set_dtypes(self, dtype: torch.dtype) -> None:
        """The all-gather and reduce dtypes of a parameter of ``dtype`` under this parameter's policy."""
        probe = torch.empty(0, dtype=dtype)  # cast_dtype asks whether the parameter is floating point
        self.param_dtype = cast_dtype(probe, self.policy.param_dtype)
        reduce = self.policy.reduce_dtype
        self.reduce_dtype = cast_dtype(probe, reduce) if reduce is not None else self.param_dtype

    # ---- construction helpers -------------------------------------------------------------
    def new_padded_shard(self, local: torch.Tensor) -> torch.Tensor:
        """A zeroed ``(padded_rows, *rest)`` buffer with ``local`` copied into its first rows, where its home
        keeps it ([Note: shard home]): under CPU offload on the host, pinned when asked, but by its group's
        buffer for plain parameters (host_arena.py)."""
        padded = self.home.padded(self.padded_shape, local.dtype, local.device, self.storage.pinned_alone)
        if padded.device.type != "meta" and self.layout.local_rows:
            padded.narrow(self.shard_dim, 0, self.layout.local_rows).copy_(local.detach())
        return padded

    # ---- what its storage changes (storages call these, never write its fields: [Note: shard storage]) ----
    def adopt_shard(self, padded: torch.Tensor) -> None:
        """``padded`` becomes the padded shard the all-gather reads; its unit makes the views the hot path reads
        ([Note: gather units])."""
        self.unit.adopt(padded)

    def register_view(self, local: torch.Tensor) -> None:
        """``local`` becomes the registered DTensor's local tensor (a replica piece, a host master), in place of
        the padded shard's first rows."""
        self.local_view = local
        self.sharded_param._local_tensor = local  # type: ignore[attr-defined]

    def adopt_host(self, view: torch.Tensor) -> None:
        """``view``, of its group's host buffer, becomes the home of its host tensor (its storage says which:
        the shard or the master), and the registered DTensor points at it ([Note: one host buffer per group])."""
        self.storage.adopt_host(self, view)
        self.sharded_param._local_tensor = self.local_view  # type: ignore[attr-defined]

    def sync_extension(self, quantized: bool) -> bool:
        """Its all-gather hooks looked up again; True when its unit changed ([Note: gather units])."""
        return sync_unit(self, quantized)

    def shard_full_tensor(self, full: torch.Tensor) -> DTensor:
        """This rank's piece of a full (unsharded) value, as a DTensor like the parameter: no communication,
        every rank slices the full tensor it was given (``load_state_dict`` of full state dicts)."""
        return make_dtensor(self.storage.local_of_full(self, full), self.sharded_spec)

    @property
    def requires_grad(self) -> bool:
        """Read from the sharded parameter, the one users see: freezing it after ``fully_shard``
        (``p.requires_grad_(False)``, e.g. LoRA) takes effect at the next unshard ([Note: frozen])."""
        return self.sharded_param.requires_grad

    @property
    def padded_numel(self) -> int:
        """Elements of one rank's padded shard: each rank's slot in the flat buffers (``layout``'s)."""
        return self.layout.padded_numel

    @property
    def padded_shape(self) -> tuple[int, ...]:
        """Shape of this rank's padded shard (``layout``'s): ``gather_shape`` with ``padded_rows`` along d."""
        return self.layout.padded_shape

    @property
    def device(self) -> torch.device:
        """Where this parameter is computed on: the mesh's device when its shard is on the host, else its shard's."""
        return self.home.compute_device(self.mesh_info.device, self.padded_shard)

    @property
    def unsharded_param(self) -> nn.Parameter | None:
        """The unsharded Parameter autograd sees (its ``unsharded`` storage's), None before the first unshard."""
        return self.unsharded.unsharded_param

    def set_on_modules(self, tensor: torch.Tensor) -> None:
        """``tensor`` (the sharded or the unsharded parameter) registered at each of its places."""
        for place in self.places:
            place.module._parameters[place.name] = cast(nn.Parameter, tensor)

    @property
    def grads_on_host(self) -> bool:
        """Reduced gradients are copied to the host (CPU offload; host masters too)."""
        return self.home.grads_on_host or self.storage.grads_on_host

    @property
    def reduced_numel(self) -> int:
        """Elements of this parameter's slot in its group's reduced gradient: its padded shard's (HFSDP: its
        piece's slot)."""
        return self.storage.reduced_numel(self)

    @property
    def grad_stride(self) -> tuple[int, ...]:
        """Strides of this rank's sharded gradient, a view of the reduced output."""
        return self.storage.grad_stride(self)

    @property
    def local_shape(self) -> tuple[int, ...]:
        """Shape of this rank's registered local tensor (and of its sharded gradient)."""
        return self.storage.local_shape(self)

    def reset_sharded_param(self) -> bool:
        """Re-adopt the sharded parameter after ``to_empty``/``to``/``load_state_dict(assign=True)``.

        Those replace the DTensor's local tensor (or the Parameter itself); the runtime all-gathers
        from ``padded_shard``, so the new local data is copied into a padded buffer and the DTensor
        is pointed back at a view of it. True when the local tensor was a new one.
        """
        local = self._new_local()
        if local is None:
            return False  # still the view made here: in-place writes (optimizer, load_state_dict) land in the shard
        remake = self.storage.renew(self, local)  # [Note: shard storage]
        self.sharded_param._local_tensor = self.local_view  # type: ignore[attr-defined]
        carry_instance_hooks(local, self.local_view)  # [Note: hooks looked up per all-gather]
        if local.dtype != self.orig_dtype:
            self._retype(local.dtype)
        if remake or (
            self.unsharded_param is not None
            and (self.unsharded_param.device != self.device or self.unsharded_param.dtype != self.param_dtype)
        ):
            self.unsharded.discard()
        return True

    def _new_local(self) -> torch.Tensor | None:
        """The registered DTensor's local tensor when it is no longer the view made here (``to_empty``,
        ``module.to``, an assigning load replaced it), after adopting a replaced DTensor; None when unchanged."""
        registered = self.places[0].module._parameters[self.places[0].name]
        if isinstance(registered, DTensor) and registered is not self.sharded_param:
            self.sharded_param = registered  # type: ignore[assignment]
            self.set_on_modules(self.sharded_param)
        # DTensor has no public getter or setter for its local tensor without autograd in between.
        local = self.sharded_param._local_tensor  # type: ignore[attr-defined]
        return None if local is self.local_view else local

    def _retype(self, dtype: torch.dtype) -> None:
        """``module.to(dtype)`` after ``fully_shard`` changed the shard's dtype: the spec, the all-gather
        and reduce dtypes and any kept gradient state follow (the unsharded parameter is made anew)."""
        self.orig_dtype = dtype
        self._set_dtypes(dtype)
        meta = TensorMeta(self.orig_shape, contiguous_stride(self.orig_shape), dtype)
        self.sharded_spec = DTensorSpec(self.sharded_spec.mesh, self.sharded_spec.placements, tensor_meta=meta)
        self.sharded_param._spec = self.sharded_spec  # type: ignore[attr-defined]
        self.grads.clear()
