"""A long list of problems, said once: lines that differ only in a layer's index collapse into one.

    summarized(["layers.0.q_proj: too small", "layers.1.q_proj: too small", "norm: missing"])
    -> ["layers.0.q_proj: too small; and 1 more like it", "norm: missing"]

Every error that lists problems (``PlanError``, ``ConfigError``, ``CheckpointError``, the NF4 refusal) shows
them through ``summarized``: a 70B's 80 decoder layers with the same problem read as one line with "and 79
more like it", not 80 lines; past ``keep`` kinds of problem the rest are counted. The exception keeps the whole
list where it has one (``.problems``).
"""

from __future__ import annotations

import re

# A path component that is a number: the "3" of "layers.3.mlp", "model.layers.3" or a Sequential's "3.weight";
# not a number's digits ("0.5")
_INDEX = re.compile(r"(?<=[A-Za-z_]\.)\d+(?=\.|\b)|(?<![\w.])\d+(?=\.[A-Za-z_])")
KEEP = 8  # kinds of problem shown before the rest are only counted


def summarized(lines: list[str], keep: int = KEEP) -> list[str]:
    """``lines`` with every run of lines alike but for their layer indices shown once (the first, with "and N
    more like it"), in the order they first appear; after ``keep`` such kinds, one line counts the rest."""
    kinds: dict[str, list[str]] = {}
    for line in lines:
        kinds.setdefault(_INDEX.sub("#", line), []).append(line)
    shown = [
        alike[0] if len(alike) == 1 else f"{alike[0]}; and {len(alike) - 1} more like it"
        for alike in list(kinds.values())[:keep]
    ]
    rest = sum(len(alike) for alike in list(kinds.values())[keep:])
    if rest:
        shown.append(f"and {rest} more problem{'s' * (rest != 1)}")
    return shown
