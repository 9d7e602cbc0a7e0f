"""The ``fsdp2lite`` command line: one subcommand per module, argparse underneath.

    fsdp2lite --version
    fsdp2lite demo --world-size 2 --steps 30 [--config configs/demo.yaml]
    fsdp2lite validate configs/*.yaml
    fsdp2lite explain configs/bf16.yaml --model fsdp2lite.models:gpt_small --world-size 8
    fsdp2lite schema [--markdown]

Adding a subcommand (``validate``, ``explain``, ``schema``): write its module with
``add_arguments(parser)`` and ``run(args) -> int``, then one ``_add_<name>`` function here that
registers it in ``build_parser``. Bad user input raises ``UsageError`` (argparse's own errors are
turned into one too); ``main`` prints it on one line and returns 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from . import __version__

USAGE_EXIT_CODE = 2  # argparse's convention for bad command-line input


class UsageError(Exception):
    """Bad command-line input; ``main`` prints ``<prog>: error: <message>`` and returns 2."""

    prog: str

    def __init__(self, message: str, prog: str = "fsdp2lite") -> None:
        super().__init__(message)
        self.prog = prog


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser that raises ``UsageError`` instead of printing usage and exiting."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message, prog=self.prog)


# ---- argument types: argparse prefixes their message with the argument's name --------------------
def positive_int(text: str) -> int:
    """``type=`` for integer flags that must be >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (>= 1), got {value}")
    return value


def non_negative_int(text: str) -> int:
    """``type=`` for integer flags that must be >= 0 (seeds)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    """``type=`` for float flags that must be > 0 (learning rates)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


# ---- the parser ---------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    """The top-level parser; each subcommand sets ``run`` (a ``Namespace -> int`` function)."""
    parser = _Parser(
        prog="fsdp2lite",
        description="fsdp2lite: FSDP2-style per-parameter sharding on torch.distributed.",
    )
    parser.add_argument("--version", action="version", version=f"fsdp2lite {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_demo(commands)
    _add_validate(commands)
    _add_explain(commands)
    _add_schema(commands)
    _add_trace(commands)
    _add_consolidate(commands)
    return parser


def _add_demo(commands: argparse._SubParsersAction) -> None:
    from . import demo  # imported here: demo imports UsageError and the types from this module

    parser = commands.add_parser(
        "demo",
        help="train a small GPT sharded over CPU processes and show per-rank parameter bytes",
        description=demo.DESCRIPTION,
    )
    demo.add_arguments(parser)
    parser.set_defaults(run=demo.run_demo)


def _add_validate(commands: argparse._SubParsersAction) -> None:
    from . import validate

    parser = commands.add_parser(
        "validate", help="check YAML policy files against the schema", description=validate.DESCRIPTION
    )
    validate.add_arguments(parser)
    parser.set_defaults(run=validate.run)


def _add_explain(commands: argparse._SubParsersAction) -> None:
    from . import explain  # imported here: explain imports UsageError and the types from this module

    parser = commands.add_parser(
        "explain",
        help="show the groups, bytes per rank and policies a config gives a model",
        description=explain.DESCRIPTION,
    )
    explain.add_arguments(parser)
    parser.set_defaults(run=explain.run)


def _add_schema(commands: argparse._SubParsersAction) -> None:
    from . import schema_doc

    parser = commands.add_parser(
        "schema", help="print the YAML policy schema (JSON Schema or Markdown)", description=schema_doc.DESCRIPTION
    )
    schema_doc.add_arguments(parser)
    parser.set_defaults(run=schema_doc.run)


def _add_trace(commands: argparse._SubParsersAction) -> None:
    from . import trace_cli

    parser = commands.add_parser(
        "trace", help="read traces saved by fsdp2lite.record_trace", description=trace_cli.DESCRIPTION
    )
    trace_cli.add_arguments(parser)
    parser.set_defaults(run=trace_cli.run)


def _add_consolidate(commands: argparse._SubParsersAction) -> None:
    from . import consolidate

    parser = commands.add_parser(
        "consolidate",
        help="turn a torch.distributed.checkpoint directory into one .pt or .safetensors file",
        description=consolidate.DESCRIPTION,
    )
    consolidate.add_arguments(parser)
    parser.set_defaults(run=consolidate.run)


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the subcommand, return its exit code."""
    try:
        args = build_parser().parse_args(argv)
        return int(args.run(args))
    except UsageError as exc:
        print(f"{exc.prog}: error: {exc}", file=sys.stderr)
        return USAGE_EXIT_CODE
    except SystemExit as exc:  # --help and --version print, then exit through argparse
        return exc.code if isinstance(exc.code, int) else 0
    except KeyboardInterrupt:
        print("fsdp2lite: interrupted", file=sys.stderr)
        return 130
