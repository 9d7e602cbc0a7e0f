"""``fsdp2lite trace summarize FILE``: exposed communication per group from a saved Chrome trace."""

from __future__ import annotations

import argparse
import sys

from rich.console import Console
from rich.table import Table

from ..trace import load_events, load_schedule, summarize

DESCRIPTION = (
    "Summarize a trace saved with fsdp2lite.record_trace(...).save_chrome_trace(PATH): per group, the time the "
    "compute side waited on all-gathers and reduce-scatters (exposed communication) and how many were issued; with "
    "fsdp2lite.step_in_backward, its host steps and the part of them backward's thread spent."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    summarize_parser = actions.add_parser("summarize", help="exposed communication per group", description=DESCRIPTION)
    summarize_parser.add_argument("file", help="a Chrome trace JSON written by save_chrome_trace")


def run(args: argparse.Namespace) -> int:
    try:
        events = load_events(args.file)
        schedule = load_schedule(args.file)
    except ValueError as exc:
        print(f"fsdp2lite trace: error: {exc}", file=sys.stderr)
        return 1
    rows = summarize(events)
    host = any(row.host_step_ms for row in rows)  # step_in_backward's steps: two more columns
    table = Table(title=f"exposed communication: {args.file}")
    columns = ["group", "all-gather wait ms", "reduce-scatter wait ms", "exposed ms", "all-gathers", "reduce-scatters"]
    for column in columns + (["host step ms", "host step exposed ms"] if host else []):
        table.add_column(column, justify="left" if column == "group" else "right")
    for row in rows:
        cells = [f"{row.all_gather_wait_ms:.3f}", f"{row.reduce_scatter_wait_ms:.3f}", f"{row.exposed_ms:.3f}"]
        cells += [str(row.all_gathers), str(row.reduce_scatters)]
        cells += [f"{row.host_step_ms:.3f}", f"{row.host_step_exposed_ms:.3f}"] if host else []
        table.add_row(row.group, *cells)
    console = Console()
    if schedule:
        settings = ", ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in schedule.items())
        console.print(f"schedule: {settings}", highlight=False)
    console.print(table)
    total = sum(row.exposed_ms for row in rows)
    console.print(f"{len(events)} events, {len(rows)} groups, {total:.3f} ms exposed communication in total")
    if host:
        steps, exposed = sum(row.host_step_ms for row in rows), sum(row.host_step_exposed_ms for row in rows)
        console.print(f"host steps inside backward: {steps:.3f} ms, of which backward's thread spent {exposed:.3f} ms")
    return 0
