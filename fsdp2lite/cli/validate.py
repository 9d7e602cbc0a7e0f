"""``fsdp2lite validate``: check YAML policy files against the ``FSDPConfig`` schema, without a model.

    fsdp2lite validate configs/*.yaml

Each valid file gets a green check line (saying what a file with ``offload.budget`` still needs); each
invalid one a table of every problem found (location, problem, suggestion), so one run fixes them all:
the schema's, then the settings that contradict each other in the top level's policy or a rule's
(``config.policy_problems``: the checks ``fully_shard`` makes of a group's settings). Exit code 0 when
every file is valid, 1 otherwise. A user's mistake (a missing file, text that is not YAML, a list instead
of a mapping, an unknown key, a bad dtype name, a value outside a fixed choice) is always a table naming the
value given, never a traceback.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..config import ConfigError, FSDPConfig, Problem, policy_problems

DESCRIPTION = (
    "Check fsdp2lite YAML policy files against the schema and for settings that contradict each other: a check "
    "line per valid file, a table of every problem (location, problem, suggestion) per invalid one. Exit 0 if all "
    "are valid, 1 if not."
)


def problems_table(title: str, problems: Sequence[Problem]) -> Table:
    """Problems as a table with columns location / problem / suggestion."""
    # min_width: the title (a file path) stays on one line when the console is wide enough
    table = Table(title=escape(title), title_style="bold red", title_justify="left", min_width=len(title))
    table.add_column("location", style="cyan", no_wrap=True)
    table.add_column("problem", overflow="fold")
    table.add_column("suggestion", style="green", overflow="fold")  # fold, never cut: keys must stay whole
    for problem in problems:
        table.add_row(escape(problem.location or "<top>"), escape(problem.message), escape(problem.suggestion))
    return table


def validate_files(console: Console, paths: Sequence[str]) -> int:
    """Validate each file and print the result; the number of invalid files."""
    invalid = 0
    for path in paths:
        try:
            config = FSDPConfig.from_yaml(path)
        except ConfigError as exc:
            invalid += 1
            console.print(problems_table(path, exc.problems))
            continue
        problems = policy_problems(config)
        if problems:
            invalid += 1
            console.print(problems_table(path, problems))
            continue
        console.print(f"[green]✓[/green] {escape(path)}: valid{escape(_budget_note(path, config))}", soft_wrap=True)
    if invalid:
        console.print(f"[red]✗[/red] {invalid} of {len(paths)} file(s) invalid")
    return invalid


def _budget_note(path: str, config: FSDPConfig) -> str:
    """What a valid file with ``offload.budget`` still needs before training ([Note: offload budget])."""
    if config.offload.budget is None:
        return ""
    return (
        f" (offload.budget {config.offload.budget} is resolved into groups to offload for one model, world size, "
        f"batch and sequence: `fsdp2lite estimate --config {path} --model M --world-size N --batch B --seq S "
        "--write-config OUT.yaml`; train with OUT.yaml)"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("configs", nargs="+", metavar="CONFIG", help="YAML policy file(s) to check")


def run(args: argparse.Namespace) -> int:
    return 1 if validate_files(Console(), args.configs) else 0
