"""What every subcommand shares: the usage error, the parser that raises it, the argument types."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import NoReturn

USAGE_EXIT_CODE = 2  # argparse's convention for bad command-line input


class UsageError(Exception):
    """Bad command-line input; ``main`` prints ``<prog>: error: <message>`` and returns 2."""

    prog: str

    def __init__(self, message: str, prog: str = "fsdp2lite") -> None:
        super().__init__(message)
        self.prog = prog


class Parser(argparse.ArgumentParser):
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
