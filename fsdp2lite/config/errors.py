"""How config problems are reported: ``Problem`` (where, what, what would be valid) and ``ConfigError``
(every problem of one config or one apply, raised together)."""

from __future__ import annotations

from pathlib import Path

from .._plan import Problem  # one record for fully_shard's problems and a config's
from .._summary import summarized


class ConfigError(ValueError):
    """Every problem found in one config (or in applying it), reported together."""

    def __init__(self, source: str | Path, problems: list[Problem]) -> None:
        self.source = str(source)
        self.problems = problems
        lines = [
            f"{p.location or '<top>'}: {p.message}{f' ({p.suggestion})' if p.suggestion else ''}" for p in problems
        ]
        header = f"{self.source}: {len(problems)} problem(s)"
        super().__init__("\n  ".join([header, *summarized(lines)]))  # alike problems once
