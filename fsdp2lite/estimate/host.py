"""Host memory and NVMe bytes of CPU offload, per rank: what the planner counts for every offload choice.

[Note: host bytes]
An offloaded group (``offload: {device: cpu}``) keeps on the host, per rank: its shards (``optimizer_only``: a
master copy of its trainable shards; the shards stay on the device), a host gradient buffer, and its optimizer
state. fsdp2lite packs a group's host shards (or masters) into one buffer, each at ``PACK_ALIGN``, pinned by
registering exactly its bytes with the driver ([Note: one host buffer per group] in ``_runtime/host_arena.py``);
NF4 shards and HFSDP's replica-sharded ones keep a buffer each (``_runtime/pinned.host_buffer``); the group's
reduced gradients land in a buffer of the same exact kind from the root's pool ([Note: host gradient buffers]
in ``_runtime/pinned.py``): with gradients kept until ``optimizer.step()`` one per group, reused every step, as
counted in ``host_bytes`` (``fsdp2lite.step_in_backward`` needs only the largest group's:
``host_bytes_step_in_backward``; a reduction that finds gradients still held, e.g. kept with
``zero_grad(set_to_none=False)``, takes one more buffer: not counted); the optimizer state is made by the
optimizer, pageable.

Pinned sizes. With ``pin_memory: true`` on a CUDA target, the buffers other than the packed one come from
torch's pinned (caching host) allocator, which rounds every request up to the next power of two before
``cudaHostAlloc`` and caches the block at that size (``ATen/core/CachingHostAllocator.h``, ``allocate``:
``c10::llvm::PowerOf2Ceil(size)``; on torch 2.13 only when the request is at most
``pinned_max_round_threshold_mb`` and ``pinned_max_cached_size_mb`` of ``PYTORCH_ALLOC_CONF``, both unset by
default: every request is rounded). A 2.1 GiB shard takes 4 GiB. The planner counts each buffer at that size
(``host_bytes``) and at the size asked for (``host_exact_bytes``); the packed buffer is exact in both. A CPU
target, or ``pin_memory: false``, allocates pageable memory: exact.

NVMe. With ``optimizer: nvme`` a group's optimizer state (AdamW: ``exp_avg`` and ``exp_avg_sq``, two tensors of
its trainable shards' size; SGD: the momentum, one) lives in one preallocated file per rank under ``nvme_path``
instead of host memory ([Note: optimizer state on NVMe] in ``host/nvme.py``), each tensor at a page
boundary (``FILE_ALIGN``): ``nvme_bytes``. The host holds instead two staging buffers (pinned where the group
pins, at their exact size), each the largest NVMe group's state with every tensor at ``SLOT_ALIGN``. Each step reads
and writes the NVMe groups' state once. AdamW's step counters (4 bytes a tensor) stay in host memory. An HFSDP
group's file is counted at its whole shards (the runtime splits them across the replicas: an upper bound).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import FSDPConfig, Plan
from ..config.schema import OffloadConfig
from .common import GroupBytes

STATE_TENSORS = {"adamw": 2, "sgd": 1, "none": 0}  # optimizer state tensors the size of a trainable shard
PACK_ALIGN = 64  # each host shard's offset in its group's one buffer (_runtime/host_arena.py ALIGN)
FILE_ALIGN = 4096  # each state tensor's region in the file starts on a page (host/nvme.py ALIGN)
SLOT_ALIGN = 64  # each state tensor in a staging slot starts on a cache line (host/nvme.py SLOT_ALIGN)


@dataclass(frozen=True)
class HostBytes:
    """One rank's host memory and NVMe files under CPU offload."""

    pinned: int  # host memory at the sizes pinning takes (exact group buffers, power-of-two NF4/HFSDP ones)
    exact: int  # host memory at the sizes asked for
    nvme: int  # optimizer state in files (read and written once per step)
    staging: int  # of ``pinned``: the two NVMe staging buffers
    gradients: int = 0  # of ``pinned``: the offloaded groups' gradient buffers, one per group
    largest_gradients: int = 0  # the largest of them: all step_in_backward needs

    @property
    def pinned_in_backward(self) -> int:
        """``pinned`` when each group steps inside backward: one gradient buffer serves every group."""
        return self.pinned - self.gradients + self.largest_gradients if self.pinned else 0


def offloaded_groups(plan: Plan) -> list[int]:
    """Indices of the planned groups offloaded to the host."""
    return [index for index, group in enumerate(plan.groups) if group.policy.offload.device == "cpu"]


def nvme_groups(plan: Plan) -> list[int]:
    """Indices of the offloaded groups whose optimizer state lives on NVMe."""
    return [index for index in offloaded_groups(plan) if plan.groups[index].policy.offload.optimizer == "nvme"]


def host_bytes(plan: Plan, groups: list[GroupBytes], trained: list[int], moved_state: int, optimizer: str) -> HostBytes:
    """[Note: host bytes]. Per group: ``groups`` its bytes (host shards and gradient buffer at the allocator's and
    at the asked-for sizes, its state's file and slot layouts), ``trained`` its trainable shards' bytes on this
    rank; ``moved_state``: the offloaded groups' optimizer state in host memory (NVMe groups' included). Whether
    a buffer is rounded (a CUDA target, pinned) is already in ``groups``; the staging slots are exact."""
    offloaded, on_nvme = offloaded_groups(plan), nvme_groups(plan)
    tensors = STATE_TENSORS[optimizer]
    slot = max((tensors * groups[index].state_slot for index in on_nvme), default=0)
    staging = 2 * slot  # registered at their exact size, as the group's buffers ([Note: one host buffer per group])
    state = max(0, moved_state - sum(tensors * trained[index] for index in on_nvme))  # what stays in host memory
    return HostBytes(
        pinned=sum(groups[index].pinned for index in offloaded) + state + staging,
        exact=sum(groups[index].host_exact for index in offloaded) + state + staging,
        nvme=sum(tensors * groups[index].state_file for index in on_nvme),
        staging=staging,
        gradients=sum(groups[index].grad_buffer for index in offloaded),
        largest_gradients=max((groups[index].grad_buffer for index in offloaded), default=0),
    )


def on_host_optimizer(config: FSDPConfig) -> FSDPConfig:
    """``config`` with every ``optimizer: nvme`` made ``optimizer: cpu``: what ``simulate`` runs (the device holds
    the same either way, and a planning machine writes no state files); the plan keeps the NVMe placement."""

    def host(offload: OffloadConfig | None) -> OffloadConfig | None:
        if offload is None or offload.optimizer != "nvme":
            return offload
        return offload.model_copy(update={"optimizer": "cpu", "nvme_path": None})

    wrap = [rule.model_copy(update={"offload": host(rule.offload)}) for rule in config.wrap]
    return config.model_copy(update={"offload": host(config.offload), "wrap": wrap})


def host_note(host: HostBytes) -> str:
    """The estimate's note on what offload puts on the host (and on NVMe)."""
    text = (
        f"CPU offload: {host.pinned:,} bytes of host memory per rank as pinned (each group's buffers at their "
        f"exact size, NF4 and HFSDP shards at the pinned allocator's power-of-two sizes; {host.exact:,} as asked for)"
    )
    if host.nvme:
        text += (
            f"; optimizer state on NVMe: {host.nvme:,} bytes per rank, read and written once per step, through two "
            f"staging buffers ({host.staging:,} bytes of the host's)"
        )
    if host.gradients > host.largest_gradients:
        text += (
            f"; stepping each group in backward (fsdp2lite.step_in_backward) one gradient buffer serves every group: "
            f"{host.pinned_in_backward:,} bytes"
        )
    return text
