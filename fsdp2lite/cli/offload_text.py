"""What CPU offload takes outside the device, in words: host memory per rank and per machine, NVMe files,
and where each group's optimizer state lives (``fsdp2lite estimate`` and ``explain`` print these).

Host memory is counted at the sizes pinning really takes, with the sizes asked for beside them
([Note: host bytes] in ``estimate/host.py``); a machine's is a rank's times the ranks on it.
"""

from __future__ import annotations

from typing import Any

from rich.table import Table

from .._units import human_bytes
from ..config import GroupPolicy
from ..estimate import MemoryEstimate


def host_rows(table: Table, estimate: MemoryEstimate) -> None:
    """The estimate table's rows for what offload puts on the host and on NVMe, per rank."""
    if estimate.host_bytes:
        exact = estimate.host_exact_bytes
        asked = f", {human_bytes(exact)} asked for" if exact and exact != estimate.host_bytes else ""
        table.add_row("host (CPU offload)", human_bytes(estimate.host_bytes), f"not in the peak (pinned sizes{asked})")
    if estimate.nvme_bytes:
        table.add_row("NVMe (optimizer state)", human_bytes(estimate.nvme_bytes), "read and written once per step")


def machine_line(estimate: MemoryEstimate, per_node: int, assumed: bool, host_ram: int) -> str | None:
    """Host memory (and NVMe) per machine, with how many ranks share one and whether that was assumed, and
    whether it fits ``host_ram``; None without offload."""
    if not estimate.host_bytes and not estimate.nvme_bytes:
        return None
    ranks = f"{per_node} rank{'' if per_node == 1 else 's'} per machine" + (
        " (assumed: min(world size, 8); --ranks-per-node)" if assumed else ""
    )
    host = estimate.host_bytes * per_node
    text = f"host memory per machine: {human_bytes(host)} ({ranks}"
    if estimate.host_exact_bytes and estimate.host_exact_bytes != estimate.host_bytes:
        text += f"; {human_bytes(estimate.host_exact_bytes * per_node)} before the pinned allocator's rounding"
    text += ")"
    if estimate.nvme_bytes:
        text += f"; NVMe per machine: {human_bytes(estimate.nvme_bytes * per_node)}"
    if host > host_ram:
        text += f"\n[red]over --host-ram: {human_bytes(host)} needed, {human_bytes(host_ram)} per machine[/red]"
    return text


def machine_record(estimate: MemoryEstimate, per_node: int, host_ram: int) -> dict[str, Any]:
    """The ``--json`` fields of host memory and NVMe per machine."""
    return {
        "ranks_per_node": per_node,
        "host_bytes_per_machine": estimate.host_bytes * per_node,
        "host_exact_bytes_per_machine": estimate.host_exact_bytes * per_node,
        "nvme_bytes_per_machine": estimate.nvme_bytes * per_node,
        "host_ram": host_ram,
        "host_fits": estimate.host_bytes * per_node <= host_ram,
    }


def offload_words(row: dict[str, Any]) -> str:
    """A search row's offload: ``ZeRO-Offload (optimizer on the host), optimizer state on NVMe, 3 groups``."""
    words = {False: "no offload", "optimizer": "ZeRO-Offload (optimizer on the host)", True: "CPU offload"}
    text = words[row["offload"]]
    if row["offload"] and isinstance(row.get("offload_groups"), int):
        count = row["offload_groups"]
        text += f" of the {count} largest group{'' if count == 1 else 's'}"
    if row.get("optimizer_state") == "nvme":
        text += f", optimizer state on NVMe ({row.get('nvme_path')})"
    return text


def nothing_fits(tried: list[dict[str, Any]], budget: int, host_ram: int, per_node: int, room: int = 0) -> str:
    """Why no row fits, with the numbers: the device budget (the nearest setting and what it lacks, ``room``
    kept free beside it included), or ``--host-ram`` (the least host memory per machine of the rows that fit
    the device)."""
    on_device = [row for row in tried if row.get("device_fits")]
    text = (
        f"nothing tried fits {human_bytes(budget)} of device memory and {human_bytes(host_ram)} of host memory "
        "per machine"
    )
    if not on_device:
        if not tried:
            return text
        nearest = min(tried, key=lambda row: row["reserved_bytes"])
        least = nearest["reserved_bytes"]
        what = nearest["finetune"] + (", activation checkpointing" if nearest.get("activation_checkpointing") else "")
        return (
            text + f": the smallest reserved peak is {human_bytes(least)}, over the {human_bytes(budget)} budget; "
            f"the nearest setting ({what}, {offload_words(nearest)}) lacks {human_bytes(least + room - budget)}"
            + (f" ({human_bytes(room)} kept free beside it for NCCL's buffers and cuBLAS workspaces)" if room else "")
        )
    least = min(on_device, key=lambda row: row["host_bytes_per_machine"])
    return (
        text + f": {len(on_device)} fit the device, and the least host memory per machine among them is "
        f"{human_bytes(least['host_bytes_per_machine'])} ({offload_words(least)}; {per_node} ranks per machine), "
        f"over --host-ram {human_bytes(host_ram)}"
    )


def optimizer_placement(policy: GroupPolicy) -> str | None:
    """Where an offloaded group's optimizer state lives between steps (explain); None on the device."""
    offload = policy.offload
    if offload.device != "cpu":
        return None
    if offload.optimizer == "nvme":
        return (
            f"optimizer state: nvme ({offload.nvme_path}: one file per rank, read and written once per step "
            "through two host staging buffers)"
        )
    return "optimizer state: host memory"
