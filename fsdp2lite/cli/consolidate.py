"""``fsdp2lite consolidate CKPT_DIR OUT``: the command line of ``fsdp2lite.consolidate``, with a progress bar."""

from __future__ import annotations

import argparse
import sys

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..checkpoint.consolidate import CAST_DTYPES, FORMATS, CheckpointError, Plan, TensorEntry, consolidate

DESCRIPTION = (
    "Turn a torch.distributed.checkpoint directory (saved from any number of ranks) into one .pt or "
    ".safetensors file of full tensors, one tensor at a time: peak memory is about the largest tensor, "
    "not the model. No process group needed. Exit 0 on success, 1 on a bad checkpoint or output path."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("ckpt_dir", metavar="CKPT_DIR", help="directory written by torch.distributed.checkpoint.save")
    parser.add_argument("out", metavar="OUT", help="output file (written as OUT.partial, renamed when complete)")
    parser.add_argument(
        "--format",
        dest="fmt",
        choices=FORMATS,
        default=None,
        help="output format (default: safetensors when OUT ends in .safetensors, else pt: torch.load-able)",
    )
    parser.add_argument("--dtype", choices=tuple(CAST_DTYPES), default=None, help="cast floating tensors to this dtype")
    parser.add_argument(
        "--prefix",
        default=None,
        help='keep only tensor keys starting with PREFIX and strip it (default: "model." when every tensor '
        'key starts with it, else keep all keys; "" keeps all)',
    )
    parser.add_argument("--force", action="store_true", help="overwrite OUT if it exists")


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:,.1f} MiB"


def _describe_plan(console: Console, plan: Plan) -> None:
    nbytes = sum(entry.nbytes for entry in plan.entries)
    kept = f"{len(plan.entries)} tensors ({_mib(nbytes)})"
    prefix = f", prefix {plan.prefix!r} stripped" if plan.prefix else ""
    dropped = f", {plan.dropped} tensors without it left out" if plan.dropped else ""
    console.print(escape(f"{kept}{prefix}{dropped}; skipped {plan.skipped} non-tensor entries"), soft_wrap=True)


def _stop(progress: Progress) -> None:
    if progress.live.is_started:  # stop() prints a newline even when never started
        progress.stop()


def run(args: argparse.Namespace) -> int:
    fmt = args.fmt or ("safetensors" if args.out.endswith(".safetensors") else "pt")
    console = Console()
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    progress = Progress(*columns, console=console)

    def on_plan(plan: Plan) -> None:  # the bar starts once the checkpoint is known to be readable
        _describe_plan(console, plan)
        progress.add_task("tensors", total=len(plan.entries))
        progress.start()

    def on_tensor(entry: TensorEntry) -> None:
        progress.update(progress.task_ids[0], advance=1, description=escape(entry.name))

    try:
        result = consolidate(
            args.ckpt_dir,
            args.out,
            fmt=fmt,
            dtype=CAST_DTYPES[args.dtype] if args.dtype else None,
            prefix=args.prefix,
            force=args.force,
            on_plan=on_plan,
            on_tensor=on_tensor,
        )
        progress.update(progress.task_ids[0], description="tensors")
    except CheckpointError as exc:
        _stop(progress)  # the bar's last state first, then the error under it
        print(f"fsdp2lite consolidate: error: {exc}", file=sys.stderr)
        return 1
    finally:
        _stop(progress)
    console.print(
        escape(
            f"wrote {len(result.plan.entries)} tensors, {result.nbytes:,} bytes ({_mib(result.nbytes)}) to "
            f"{result.path} ({fmt}) in {result.seconds:.2f} s; peak RSS {_mib(result.peak_rss)}"
        ),
        soft_wrap=True,
    )
    return 0
