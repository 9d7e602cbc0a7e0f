"""Hidden memory and time of gloo's flat collectives: why fsdp2lite reduces gradients in place on gloo.

What: for each collective below, 2 gloo ranks are spawned fresh (so each process's peak resident
memory, ``ru_maxrss``, belongs to that collective alone). Each rank first allocates and writes every
tensor the call reads or writes (so they are resident), records its peak RSS, runs the collective
once (async, then ``wait()``) and reports the peak's growth: memory the backend allocated on its
own, which no tensor-level meter (MemTracker) sees. Then ``--repeats - 1`` more calls for the time
(median of all). Every result is checked.
    reduce_scatter_tensor   out (N/2,) <- in (N,)       what torch's fully_shard issues on gloo
    all_reduce in place     in (N,), then this rank's half copied into out (N/2,)
                            what fsdp2lite issues on gloo ([Note: gloo reduce-scatter])
    all_gather_into_tensor  out (N,) <- in (N/2,)       both libraries' all-gather

Why: torch's gloo backend has no reduce-scatter algorithm; ``reduce_scatter_tensor`` clones the whole
input, all-reduces the clone and copies one chunk out. Issuing the all-reduce in place on the flat
gradient buffer moves the same bytes without the clone (``fsdp2lite/_runtime/reduce.py``).

How to run (about 30 seconds on 2 CPU cores, 4 x N x 4 bytes of memory per rank at most):
    .venv/bin/python benchmarks/gloo_memory.py [--mib 200] [--repeats 3] [--out-dir benchmarks/results] [--no-save]
Prints a rich table and, last, one JSON line; unless --no-save writes
``<out-dir>/gloo_memory-cpu-<YYYYmmdd-HHMMSS>.json`` and ``.md`` (numbers, machine, versions, command).
"""

from __future__ import annotations

import argparse
import datetime
import json
import resource
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _results import environment, environment_markdown, markdown_table, save_run  # benchmarks/ is sys.path[0]
from rich.console import Console
from rich.table import Table

WORLD_SIZE = 2
MIB = 2**20
CASES = ("reduce_scatter_tensor", "all_reduce in place", "all_gather_into_tensor")
COLUMNS = ("collective", "buffer MiB", "hidden MiB", "hidden / buffer", "ms (median)", "check")
REPO = Path(__file__).resolve().parent.parent


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def make_tensors(case: str, numel: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, output) of one call, both written so they are resident before anything is measured."""
    half = numel // WORLD_SIZE
    if case == "all_gather_into_tensor":
        return torch.full((half,), float(rank + 1)), torch.full((numel,), -1.0)
    return torch.full((numel,), float(rank + 1)), torch.full((half,), -1.0)


def run_case(case: str, inp: torch.Tensor, out: torch.Tensor, rank: int) -> tuple[float, bool]:
    """One call of ``case``; (seconds, result correct). Inputs are refilled first (in place)."""
    inp.fill_(float(rank + 1))
    start = time.perf_counter()
    if case == "reduce_scatter_tensor":
        dist.reduce_scatter_tensor(out, inp, async_op=True).wait()
    elif case == "all_reduce in place":
        dist.all_reduce(inp, async_op=True).wait()
        half = out.numel()
        out.copy_(inp[rank * half : (rank + 1) * half])  # this rank's slot, as fsdp2lite copies it out
    else:
        dist.all_gather_into_tensor(out, inp, async_op=True).wait()
    seconds = time.perf_counter() - start
    if case == "all_gather_into_tensor":
        half = inp.numel()
        return seconds, bool((out[:half] == 1.0).all() and (out[half:] == 2.0).all())
    return seconds, bool((out == 3.0).all())


def entry(rank: int, init_file: str, out_file: str, case: str, numel: int, repeats: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE)
    try:
        inp, out = make_tensors(case, numel, rank)
        dist.barrier()
        before = peak_rss()  # ru_maxrss only grows: the first call alone shows the backend's own memory
        results = [run_case(case, inp, out, rank)]
        hidden = torch.tensor([peak_rss() - before], dtype=torch.float64)
        results += [run_case(case, inp, out, rank) for _ in range(repeats - 1)]
        dist.all_reduce(hidden, op=dist.ReduceOp.MAX)
        if rank == 0:
            seconds = [s for s, _ in results]
            record = {"hidden_bytes": int(hidden.item()), "seconds": seconds, "ok": all(ok for _, ok in results)}
            Path(out_file).write_text(json.dumps(record))
    finally:
        dist.destroy_process_group()


def measure(case: str, numel: int, repeats: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="fsdp2lite_gloo_memory_") as tmp:
        init_file, out_file = str(Path(tmp) / "pg"), str(Path(tmp) / "out.json")
        mp.spawn(entry, args=(init_file, out_file, case, numel, repeats), nprocs=WORLD_SIZE, join=True)
        return json.loads(Path(out_file).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=200, help="size of the full (world-sized) buffer, MiB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--no-save", action="store_true", help="print only")
    args = parser.parse_args()
    started = datetime.datetime.now()
    numel = args.mib * MIB // 4 // WORLD_SIZE * WORLD_SIZE  # fp32, divisible by the world size
    results = {case: measure(case, numel, args.repeats) for case in CASES}
    rows = []
    table = Table(title=f"gloo collectives, {WORLD_SIZE} ranks, full buffer {args.mib} MiB fp32")
    for column in COLUMNS:
        table.add_column(column, justify="left" if column in ("collective", "check") else "right")
    for case, result in results.items():
        buffer = numel * 4
        rows.append(
            [
                case,
                f"{buffer / MIB:.0f}",
                f"{result['hidden_bytes'] / MIB:.1f}",
                f"{result['hidden_bytes'] / buffer:.2f}",
                f"{1e3 * statistics.median(result['seconds']):.1f}",
                "ok" if result["ok"] else "WRONG",
            ]
        )
        table.add_row(*rows[-1])
    console = Console(width=max(Console().width, 100))
    console.print(table)
    rs, ar = (statistics.median(results[c]["seconds"]) for c in CASES[:2])
    line = f"in-place all_reduce / reduce_scatter_tensor time: {ar / rs:.3f}"
    console.print(line)
    record: dict[str, Any] = {**environment(started), "numel": numel, "results": results, "time_ratio": ar / rs}
    if not args.no_save:
        md = (
            f"# gloo collectives: hidden memory and time\n\n{WORLD_SIZE} ranks, full buffer {numel * 4:,} bytes "
            f"fp32, {args.repeats} repeats; hidden = peak RSS growth over the resident tensors\n\n"
            + markdown_table(COLUMNS, rows)
            + f"\n- {line}\n\n"
            + environment_markdown(record)
        )
        record["files"] = save_run(args.out_dir, f"gloo_memory-cpu-{started:%Y%m%d-%H%M%S}", record, md)
    print(json.dumps(record))


if __name__ == "__main__":
    main()
