"""What ``fsdp2lite estimate --budget`` prints: the settings table (readable at 80 columns) and the answer.

The table shows the choice and its nearest alternatives with only the columns whose values differ
between the rows shown; the offload's kind, its groups and where the optimizer state lives share one
column, and every cell fits its column without being cut (rich would otherwise shorten ``finetune`` to
``fin…`` on an 80-column terminal). The answer under it says what the figures assume and leave out:
the batch and sequence per rank, the optimizer step's time at the gradient accumulation a global batch
needs, the headroom left in the budget and what it must still hold, and whether the setting has run on
a GPU ([Note: what the answer states]).

[Note: what the answer states]
A planner's number is only as useful as its assumptions are visible. ``answer_lines`` therefore names:
the per-rank batch x sequence the peak was computed for (``--batch``, ``--seq``); the microbatches per
rank a global batch of ``--global-batch`` sequences takes at that batch and world size, and the optimizer
step's time at that many (each microbatch all-gathers and reduce-scatters again, so the step time is the
microbatch's times the count; the optimizer's own step is left out, small for adapters); the budget less
the CUDA context (``estimate.cuda_context``: measured on an H200, assumed for other kinds and said so), and
the headroom left over the reserved peak, which NCCL's buffers and cuBLAS workspaces (not tensors, not
counted; the search keeps 512 MiB free for them) take from; and whether this kind of job was measured on a
GPU: the memory model was checked against one H100 for full training only (docs/estimate.md), so every
other kind says no, lora and qlora naming the CPU measurement of real allocations they were checked
against instead.
"""

from __future__ import annotations

import math
import textwrap
from typing import Any

from rich import box
from rich.table import Table

from .._units import human_bytes
from .offload_text import offload_words

UNCOUNTED = "NCCL's buffers and cuBLAS workspaces"  # not tensors: no estimate counts them (the search leaves room)
TIGHT = 2**29  # headroom under this is called tight: a CUDA context alone takes several hundred MiB
GPU_CHECKED = ("full",)  # the kinds whose memory model was checked on a GPU (docs/estimate.md, one H100)
CPU_CHECKED = ("lora", "qlora")  # checked against a real step's allocations on CPU (benchmarks/bench_founding.py)
HEADERS = {
    "finetune": "train",
    "activation_checkpointing": "ckpt",
    "mixed_precision": "precision",
    "reshard_after_forward": "reshard",
    "forward_prefetch_depth": "prefetch",
}
CHOICE_KEYS = (
    "finetune",
    "mixed_precision",
    "reshard_after_forward",
    "forward_prefetch_depth",
    "activation_checkpointing",
    "offload",
)


def offload_cell(row: dict[str, Any]) -> str:
    """A row's offload in a few words: ``none``, ``optimizer``, ``full``, ``full, 57 groups``, ``full, nvme``."""
    kind = {False: "none", "optimizer": "optimizer", True: "full"}[row["offload"]]
    if row["offload"] and isinstance(row.get("offload_groups"), int):
        kind += f", {row['offload_groups']} groups"
    if row.get("optimizer_state") == "nvme":
        kind += ", nvme"
    return kind


def _cell(key: str, row: dict[str, Any]) -> str:
    if key == "offload":
        return offload_cell(row)
    value = row.get(key)
    return {True: "yes", False: "no"}.get(value, str(value)) if isinstance(value, bool) else str(value)


def search_table(
    budget: int,
    tried: list[dict[str, Any]],
    rows: list[dict[str, Any]],
    choice: dict[str, Any] | None,
    every: bool,
    width: int = 80,
    device: str = "cuda",
) -> Table:
    """``rows`` (the nearest few, or ``every`` row tried) with the columns that vary among them; columns
    are dropped, least needed first (``DROPPED``), until the table fits ``width`` without cutting a cell.
    A CPU target shows no tokens/s: the step-time model is a GPU's."""
    shown = "every setting tried" if every else f"the choice and its nearest alternatives ({len(tried)} tried; --all)"
    columns = every_column = [c for c in _columns(rows, choice) if device == "cuda" or c[0] != "tokens/s"]
    for header in DROPPED:
        if _width(columns) <= width:
            break
        columns = [column for column in columns if column[0] != header]
    title = f"settings for a budget of {human_bytes(budget)}: {shown}"
    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, collapse_padding=True)
    for header, justify, _ in columns:
        table.add_column(header, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for index, row in enumerate(rows):
        style = "bold green" if row is choice else ("" if row["fits"] else "dim")
        table.add_row(*(cells[index] for _, _, cells in columns), style=style)
    kept = {header for header, _, _ in columns}
    notes = [note for header, note in CAPTION if header in kept]
    if "nvme" in kept:
        notes = [note.replace("host:", "host, nvme:") for note in notes]
    dropped = [header for header, _, _ in every_column if header not in kept]
    if dropped:
        notes.append(f"{', '.join(dropped)}: left out to fit {width} columns (a wider terminal shows them)")
    table.caption = "; ".join(notes)
    return table


DROPPED = ("alloc", "nvme", "host")  # the order columns go in when the table is too wide (the answer says them)
CAPTION = (
    ("alloc", "alloc: the device peak per rank as allocated"),
    ("reserved", "reserved: what the caching allocator holds for it"),
    ("host", "host: per machine"),
    ("fits", "fits: reserved within the budget and host within --host-ram"),
    ("ckpt", "ckpt: activation checkpointing"),
)


def _columns(rows: list[dict[str, Any]], choice: dict[str, Any] | None) -> list[tuple[str, str, list[str]]]:
    """(header, justify, one cell per row) of every column the rows could show."""
    varied = [key for key in CHOICE_KEYS if len({_cell(key, row) for row in rows}) > 1] or ["finetune"]
    columns = [(HEADERS.get(key, key), "left", [_cell(key, row) for row in rows]) for key in varied]
    columns += [("alloc", "right", [_size(row["peak_bytes"]) for row in rows])]
    columns += [("reserved", "right", [_size(row["reserved_bytes"]) for row in rows])]
    if any(row["host_bytes_per_machine"] for row in rows):
        columns += [("host", "right", [_size(row["host_bytes_per_machine"]) for row in rows])]
    if any(row.get("nvme_bytes_per_machine") for row in rows):
        columns += [("nvme", "right", [_size(row.get("nvme_bytes_per_machine", 0)) for row in rows])]
    columns += [("tokens/s", "right", [f"{row['tokens_per_s']:,.0f}" for row in rows])]
    fits = [("chosen" if row is choice else "yes") if row["fits"] else _miss(row) for row in rows]
    return [*columns, ("fits", "left", fits)]


def _width(columns: list[tuple[str, str, list[str]]]) -> int:
    """The table's width: each column's widest cell or header, two spaces between columns."""
    return sum(max(len(header), *(len(cell) for cell in cells)) for header, _, cells in columns) + 2 * (
        len(columns) - 1
    )


def _size(nbytes: int) -> str:
    """``72.3GiB``: human_bytes without its space (the table's columns stay narrow); ``-`` for nothing."""
    return human_bytes(nbytes).replace(" ", "") if nbytes else "-"


def _miss(row: dict[str, Any]) -> str:
    """Why a row does not fit: ``no`` (the device budget), ``no (host)`` (only ``--host-ram``)."""
    return "no (host)" if row.get("device_fits") and not row.get("host_fits") else "no"


def grad_accum(global_batch: int, batch: int, world_size: int) -> int:
    """Microbatches per rank per optimizer step for at least ``global_batch`` sequences (every rank is
    data parallel under FSDP and HSDP)."""
    return max(1, math.ceil(global_batch / (batch * world_size)))


def answer_lines(choice: dict[str, Any], budget: int, job: dict[str, Any]) -> list[str]:
    """What the recommendation assumes and leaves out ([Note: what the answer states]). ``job``: world_size,
    batch, seq, global_batch and hardware (the GPU and link in words)."""
    world, batch, seq = job["world_size"], job["batch"], job["seq"]
    accum = grad_accum(job["global_batch"], batch, world)
    sequences = accum * batch * world
    per_rank = f"batch {batch} x seq {seq} tokens per rank (--batch, --seq)" if seq else "--inputs' batch per rank"
    tokens = f" ({sequences * seq:,} tokens)" if seq else ""
    headroom = budget - choice["reserved_bytes"]
    kind = f"{choice['finetune']}{'' if not choice['offload'] else ' with offload'}"
    measured = (
        "the memory model matched one H100 for full training (docs/estimate.md); this model and GPU have not run"
        if choice["finetune"] in GPU_CHECKED and not choice["offload"]
        else f"no ({kind} has not run on a GPU since its memory was reworked; its figures match a real step's "
        "allocations on CPU within 5% at Llama-3-70B's width: benchmarks/bench_founding.py, docs/finetune.md)"
        if choice["finetune"] in CPU_CHECKED
        else f"no ({kind} has not run on a GPU: these figures are the planner's model)"
    )
    uncounted = UNCOUNTED if job["device"] == "cuda" else "the processes' own memory (Python, torch's libraries)"
    time = (
        f"  time: {choice['step_s']:.2f} s a microbatch, about {choice['step_s'] * accum:,.0f} s an optimizer step "
        f"at --grad-accum {accum}; {choice['tokens_per_s']:,.0f} tokens/s for the job ({world} GPUs, "
        f"{job['hardware']})"
    )
    if job["device"] != "cuda":
        measured = "no (a CPU target: these figures are the planner's model)"
        time = "  time: not estimated for a CPU target (the step-time model is a GPU's: --gpu, --link)"
    return [
        f"  assumed: {per_rank}; a global batch of {sequences} "
        f"samples{tokens} is {accum} microbatch{'es' if accum > 1 else ''} per rank "
        f"(--grad-accum {accum}, from --global-batch {job['global_batch']})",
        time,
        f"  headroom: {human_bytes(headroom)} of the {human_bytes(budget)} left to PyTorch is over the reserved peak"
        f"{' (tight)' if headroom < TIGHT else ''}; not counted: {uncounted}, which take from it",
        f"  measured on a GPU: {measured}",
    ]


def context_line(budget: int, context: Any) -> str:
    """The budget the settings are compared with: the card's, less the CUDA context ([Note: what the answer
    states])."""
    return (
        f"budget: {human_bytes(budget)} less the CUDA context, {human_bytes(context.nbytes)} ({context.source}): "
        f"{human_bytes(budget - context.nbytes)} for PyTorch's allocator, what every setting is compared with"
    )


def wrapped(line: str, width: int) -> str:
    """``line`` wrapped at ``width`` between words, its continuation lines indented past its own indent."""
    indent = " " * (len(line) - len(line.lstrip(" ")) + 2)
    return textwrap.fill(line, max(width, 40), subsequent_indent=indent, break_on_hyphens=False)


def recommendation(choice: dict[str, Any]) -> list[str]:
    """The chosen setting, then its memory."""
    what = choice["finetune"] + (", activation checkpointing" if choice["activation_checkpointing"] else "")
    what += ", " + offload_words(choice)
    host, nvme = choice["host_bytes_per_machine"], choice.get("nvme_bytes_per_machine", 0)
    on_nvme = f", NVMe {human_bytes(nvme)}" if nvme else ""
    return [
        f"recommended: {what}",
        f"  device peak {human_bytes(choice['peak_bytes'])} allocated, {human_bytes(choice['reserved_bytes'])} "
        f"reserved per rank; host {human_bytes(host) if host else 'nothing'}{on_nvme} per machine",
    ]
