"""Sizes people write (``24GiB``, ``512GB``, ``2e11``) as bytes, for command-line flags and policy files alike;
and bytes as people read them (``human_bytes``)."""

from __future__ import annotations

import re

UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(text: str) -> int:
    """``80GiB``, ``1.5 TB``, ``2e9``, ``123456`` -> bytes; ValueError naming the text and the valid forms."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if match is None or match.group(2).lower() not in UNITS:
        raise ValueError(
            f"expected a size: a number with an optional unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), "
            f"e.g. 256GiB, 512GB or 2e11; got {text!r}"
        )
    value = float(match.group(1)) * UNITS[match.group(2).lower()]
    if value <= 0:
        raise ValueError(f"must be > 0, got {text!r}")
    return int(value)


def human_bytes(nbytes: float) -> str:
    """``1536`` -> ``1.5 KiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024:
            return f"{nbytes:,.0f} {unit}" if unit == "B" else f"{nbytes:,.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:,.1f} TiB"


def short_float(value: float) -> str:
    """A learning rate as people write it: ``2e-4``, not ``0.0002`` or ``2e-04``."""
    return f"{value:.0e}".replace("e-0", "e-")
