"""The ``fsdp2lite`` command line: one subcommand per module, argparse underneath.

    fsdp2lite --version
    fsdp2lite demo --world-size 2 --steps 30 [--config configs/demo.yaml]
    fsdp2lite validate configs/*.yaml
    fsdp2lite explain configs/bf16.yaml --model fsdp2lite.models:gpt_small --world-size 8
    fsdp2lite schema [--markdown]

Adding a subcommand: write its module with ``DESCRIPTION``, ``add_arguments(parser)`` and
``run(args) -> int``, then add one row to ``SUBCOMMANDS``. Bad user input raises ``UsageError``
(argparse's own errors are turned into one too); ``main`` prints it on one line and returns 2,
never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
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
def _int_at_least(minimum: int, what: str) -> Callable[[str], int]:
    """A ``type=`` for integer flags that must be >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be {what} (>= {minimum}), got {value}")
        return value

    return parse


positive_int = _int_at_least(1, "a positive integer")
non_negative_int = _int_at_least(0, "a non-negative integer")  # seeds


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
    for name, module_name, help_text in SUBCOMMANDS:
        # imported here, not at the top: the command modules import UsageError and the types from here
        module = importlib.import_module(f".{module_name}", __package__)
        command = commands.add_parser(name, help=help_text, description=module.DESCRIPTION)
        module.add_arguments(command)
        command.set_defaults(run=module.run)
    return parser


# (command, module in this package with DESCRIPTION, add_arguments(parser) and run(args) -> int, help)
SUBCOMMANDS = (
    ("demo", "demo", "train a small GPT sharded over CPU processes and show per-rank parameter bytes"),
    ("validate", "validate", "check YAML policy files against the schema"),
    ("explain", "explain", "show the groups, bytes per rank and policies a config gives a model"),
    ("schema", "schema_doc", "print the YAML policy schema (JSON Schema or Markdown)"),
    ("trace", "trace_cli", "read traces saved by fsdp2lite.record_trace"),
    ("consolidate", "consolidate_cli", "turn a torch.distributed.checkpoint directory into one .pt/.safetensors file"),
)


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
