"""The ``fsdp2lite`` command line: one subcommand per module, argparse underneath.

    fsdp2lite --version
    fsdp2lite demo --world-size 2 --steps 30 [--config configs/demo.yaml]
    fsdp2lite validate configs/*.yaml
    fsdp2lite explain configs/bf16.yaml --model fsdp2lite.models:gpt_small --world-size 8
    fsdp2lite schema [--markdown]
    fsdp2lite doctor

Adding a subcommand: write its module in this package (``fsdp2lite/cli/``) with ``DESCRIPTION``,
``add_arguments(parser)`` and ``run(args) -> int``, then add one row to ``SUBCOMMANDS``; what the
commands share (``UsageError``, the argument types) is in ``_args.py``. Bad user input raises ``UsageError``
(argparse's own errors are turned into one too); ``main`` prints it on one line and returns 2,
never a traceback.

A command prints its own output and nothing else: ``main`` runs it inside ``quiet_other_packages()``
([Note: quiet commands] in fsdp2lite/quiet.py).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from .. import __version__
from ..quiet import quiet_other_packages
from ._args import USAGE_EXIT_CODE, Parser, UsageError, non_negative_int, positive_float, positive_int

__all__ = [
    "USAGE_EXIT_CODE",
    "UsageError",
    "build_parser",
    "main",
    "non_negative_int",
    "positive_float",
    "positive_int",
]


# ---- the parser ---------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    """The top-level parser; each subcommand sets ``run`` (a ``Namespace -> int`` function)."""
    parser = Parser(
        prog="fsdp2lite",
        description="fsdp2lite: FSDP2-style per-parameter sharding on torch.distributed.",
    )
    parser.add_argument("--version", action="version", version=f"fsdp2lite {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module_name, help_text in SUBCOMMANDS:
        module = importlib.import_module(f".{module_name}", __package__)  # imported when the parser is built
        command = commands.add_parser(name, help=help_text, description=module.DESCRIPTION)
        module.add_arguments(command)
        command.set_defaults(run=module.run)
    return parser


# (command, module in this package with DESCRIPTION, add_arguments(parser) and run(args) -> int, help)
SUBCOMMANDS = (
    ("demo", "demo", "train a small GPT sharded over CPU processes and show per-rank parameter bytes"),
    ("validate", "validate", "check YAML policy files against the schema"),
    ("explain", "explain", "show the groups, bytes per rank and policies a config gives a model"),
    (
        "migrate",
        "migrate",
        "turn an Accelerate, HF Trainer, DeepSpeed or torchtitan config into an fsdp2lite policy file",
    ),
    ("estimate", "estimate", "estimate one rank's peak memory per step at any world size; search settings that fit"),
    ("schema", "schema", "print the YAML policy schema (JSON Schema or Markdown)"),
    ("trace", "trace", "read traces saved by fsdp2lite.record_trace"),
    ("consolidate", "consolidate", "turn a torch.distributed.checkpoint directory into one .pt/.safetensors file"),
    ("doctor", "doctor", "versions, devices, importable integrations, and what fsdp2lite.patch() would rebind"),
)


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the subcommand, return its exit code."""
    try:
        with quiet_other_packages():
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
