"""Each parameter's part of its group's all-gather: a unit chosen where the parameter's all-gather hooks are
found, at ``fully_shard`` and whenever they change ([Note: hooks looked up per all-gather] in extension.py).

[Note: gather units]
A group's forms ([Note: gather forms] in gather.py) never ask what kind of parameter they move: each
parameter holds one ``GatherUnit`` that knows its shard, its all-gather inputs, where the gathered bytes go and
what follows the copy-out:

    PlainUnit   its flat padded shard in its all-gather dtype, one slot; the copy-out writes its unsharded
                storage; block-aligned shards when asked ([Note: padded shard] in layout.py)
    HookedUnit  torch's all-gather extension hooks (a tensor subclass such as NF4): the pre-all-gather hook's
                inputs, one slot each, the copy-out into the hook's output buffers, ``finish`` (the
                post-all-gather hook rebuilds the unsharded tensor), ``free`` and ``reallocate`` of those
                buffers; its shard is the subclass's own (``AllGatherExtension.shard``), unaligned, on the host
                under CPU offload ([Note: offloaded hooked parameters] in extension.py)

``gather_dtype`` tells the group's choice of form what the unit puts on the wire: one dtype (a plain unit:
the group may gather in that dtype) or None (the hook's bytes: the group gathers bytes). ``rebuilds``: the
unit has work after the copy-out (its group keeps such units in a tuple made once). A new kind of parameter
(a block-quantized weight with its own wire format, say) is a new unit and a line in ``gather_unit``.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn as nn
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from ..mesh import MeshInfo
from .extension import AllGatherExtension, contiguous_stride, find_hooks, has_extension
from .layout import ShardLayout
from .param_policy import ParamPlace, ParamPolicy
from .shard_home import DeviceHome


class UnitParam(Protocol):
    """What a unit reads and writes of its ``param.FSDPParam`` (which imports this module: no import back)."""

    fqn: str
    places: tuple[ParamPlace, ...]
    orig_shape: torch.Size
    mesh_info: MeshInfo
    shard_dim: int
    tp_spec: DTensorSpec | None
    policy: ParamPolicy
    mp_policy: Any
    param_dtype: torch.dtype
    home: DeviceHome  # where the padded shard lives: [Note: shard home] in shard_home.py
    layout: ShardLayout
    padded_shard: torch.Tensor
    flat_shard: torch.Tensor
    local_view: torch.Tensor
    sharded_param: Any  # an nn.Parameter holding a DTensor
    unit: GatherUnit

    @property
    def unsharded(self) -> UnitUnsharded: ...

    def new_padded_shard(self, local: torch.Tensor) -> torch.Tensor: ...


class UnitUnsharded(Protocol):
    """What a unit reads and writes of its parameter's ``unsharded.UnshardedStorage`` (which imports this module)."""

    unsharded_param: nn.Parameter | None

    def copy_out_view(self, group_size: int, numel: int) -> torch.Tensor: ...

    def discard(self) -> None: ...


class GatherUnit(Protocol):
    """One parameter's part of its group's all-gather ([Note: gather units])."""

    @property
    def rebuilds(self) -> bool:
        """finish and reallocate do work after the copy-out."""
        ...

    @property
    def extension(self) -> AllGatherExtension | None:
        """The hooks it gathers through (HookedUnit), else None."""
        ...

    @property
    def gather_dtype(self) -> torch.dtype | None: ...

    def make_shard(self, data: torch.Tensor) -> None: ...

    def adopt(self, padded: torch.Tensor) -> None: ...

    def flat(self, padded: torch.Tensor) -> torch.Tensor: ...

    def renew(self, local: torch.Tensor) -> None: ...

    def packs_on_host(self) -> bool: ...

    def grad_stride(self, shape: tuple[int, ...]) -> tuple[int, ...]: ...

    def inputs(self) -> list[torch.Tensor]: ...

    def output_views(self, group_size: int, nbytes: int) -> list[torch.Tensor]: ...

    def finish(self) -> None: ...

    def reallocate(self) -> None: ...

    def free(self) -> None: ...


class PlainUnit:
    """A plain tensor's shard: gathered as its flat padded shard ([Note: gather units])."""

    rebuilds = False
    extension = None

    def __init__(self, param: UnitParam) -> None:
        self.param = param

    @property
    def gather_dtype(self) -> torch.dtype | None:
        return self.param.param_dtype

    def make_shard(self, data: torch.Tensor) -> None:
        """This rank's rows of ``data`` in a zeroed padded shard, aligned as the policy asks."""
        p = self.param
        info = p.mesh_info
        p.layout = ShardLayout(tuple(data.shape), p.shard_dim, info.shard_size, info.shard_rank, p.policy.shard_align)
        self.adopt(p.new_padded_shard(p.layout.local_of(data)))

    def adopt(self, padded: torch.Tensor) -> None:
        """Make ``padded`` the shard, with the views the hot path reads made once here."""
        p = self.param
        p.padded_shard, p.flat_shard = padded, self.flat(padded)
        p.local_view = padded.narrow(p.shard_dim, 0, p.layout.local_rows)

    def flat(self, padded: torch.Tensor) -> torch.Tensor:
        """What the copy-in reads: the padded shard as ``(padded_numel,)``."""
        return padded.view(-1)

    def renew(self, local: torch.Tensor) -> None:
        self.adopt(self.param.new_padded_shard(local.detach()))

    def packs_on_host(self) -> bool:
        """On the host, its shard joins its group's one host buffer ([Note: one host buffer per group])."""
        return True

    def grad_stride(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return self.param.local_view.stride()

    def inputs(self) -> list[torch.Tensor]:
        """Its flat padded shard in its all-gather dtype, as bytes ([Note: byte all-gather])."""
        flat = self.param.flat_shard
        if flat.dtype != self.param.param_dtype:
            flat = flat.to(self.param.param_dtype)  # mixed precision: cast first, the buffer holds bytes
        return [flat.view(torch.uint8)]

    def output_views(self, group_size: int, nbytes: int) -> list[torch.Tensor]:
        numel = nbytes // self.param.param_dtype.itemsize
        return [self.param.unsharded.copy_out_view(group_size, numel).view(torch.uint8)]

    def finish(self) -> None:
        pass

    def reallocate(self) -> None:
        pass

    def free(self) -> None:
        pass


class HookedUnit:
    """A tensor subclass gathered through torch's all-gather extension hooks ([Note: all-gather extension])."""

    rebuilds = True

    def __init__(self, param: UnitParam, extension: AllGatherExtension) -> None:
        self.param, self.extension = param, extension

    @property
    def gather_dtype(self) -> torch.dtype | None:
        return None  # bytes of the hook's choosing

    def make_shard(self, data: torch.Tensor) -> None:
        """The subclass's own ops cut the shard, so it stays one subclass tensor; never aligned."""
        p = self.param
        p.layout = ShardLayout(tuple(data.shape), p.shard_dim, p.mesh_info.shard_size, p.mesh_info.shard_rank)
        self._adopt_hooked(self.extension.shard(data, p.mesh_info, p.layout))

    def adopt(self, padded: torch.Tensor) -> None:
        p = self.param
        p.padded_shard, p.flat_shard = padded, self.flat(padded)
        p.local_view = padded[: p.layout.local_rows]

    def flat(self, padded: torch.Tensor) -> torch.Tensor:
        return padded  # gathered through its hooks, never as a flat shard

    def renew(self, local: torch.Tensor) -> None:
        self._adopt_hooked(self.extension.pad(local.detach(), self.param.layout))

    def _adopt_hooked(self, padded: torch.Tensor) -> None:
        """On the host under CPU offload ([Note: offloaded hooked parameters], [Note: shard home])."""
        self.adopt(self.param.home.hooked(padded))

    def packs_on_host(self) -> bool:
        return False  # its host shard is the subclass's own

    def grad_stride(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return contiguous_stride(shape)

    def inputs(self) -> list[torch.Tensor]:
        """This rank's all-gather inputs from the subclass's pre-all-gather hook (flat, plain tensors), as bytes."""
        p = self.param
        local = p.sharded_param._local_tensor  # type: ignore[attr-defined]  # where the hooks are looked up
        shard = p.home.gather_source(p.padded_shard, p.mesh_info.device)  # offloaded: its copy on the device
        mesh, module = p.mesh_info.shard_mesh, p.places[0].module
        made = self.extension.inputs(shard, local, mesh, p.orig_shape, module=module, mp_policy=p.mp_policy)
        return [t.view(torch.uint8) for t in made]

    def output_views(self, group_size: int, nbytes: int) -> list[torch.Tensor]:
        return self.extension.output_views(group_size)

    def finish(self) -> None:
        """After the copy-out into the hook's output buffers: build or refill the unsharded tensor."""
        p = self.param
        local = p.sharded_param._local_tensor  # type: ignore[attr-defined]
        made = self.extension.unsharded(local, p.param_dtype, p.orig_shape, p.unsharded.unsharded_param)
        if made is not None:
            p.unsharded.unsharded_param = nn.Parameter(made, requires_grad=p.sharded_param.requires_grad)

    def reallocate(self) -> None:
        self.extension.reallocate()  # a regather: its hook is not called again

    def free(self) -> None:
        self.extension.free()


def gather_unit(param: UnitParam, data: torch.Tensor, tensor_parallel: bool) -> GatherUnit:
    """The unit of a parameter whose local tensor is ``data``, chosen where its hooks are found (``fully_shard``)."""
    if not has_extension(data):
        return PlainUnit(param)
    extension = AllGatherExtension(data, param.fqn)
    extension.check_supported(param.shard_dim, tensor_parallel)
    return HookedUnit(param, extension)


def sync_unit(param: UnitParam, quantized: bool) -> bool:
    """Look the all-gather hooks up on the local tensor, as torch does at every all-gather, so hooks set or
    removed after ``fully_shard`` take effect; True when they changed, and then the parameter gathers through
    a new unit, its unsharded tensor made anew ([Note: hooks looked up per all-gather])."""
    local: Any = param.sharded_param._local_tensor  # type: ignore[attr-defined]
    pre, post = find_hooks(local)
    current = param.unit.extension
    if current.same_hooks(pre, post) if current is not None else pre is None and post is None:
        return False
    unit: GatherUnit = PlainUnit(param)
    if pre is not None or post is not None:
        extension = AllGatherExtension(local, param.fqn)  # raises before anything changes
        extension.check_supported(param.shard_dim, param.tp_spec is not None, quantized, param.layout.align > 1)
        unit = HookedUnit(param, extension)
    param.unit = unit
    param.flat_shard = unit.flat(param.padded_shard)  # the local view stays: the DTensor holds it
    param.unsharded.discard()
    return True
