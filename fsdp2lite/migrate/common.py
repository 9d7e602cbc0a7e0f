"""What every source tool's key table is made of: the ``Migration`` being built, its key reports, and the
helpers handlers write fsdp2lite keys with."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from ..config import FSDPConfig, problems_from

Status = Literal["mapped", "dropped", "unsupported", "unknown"]
SOURCES = ("accelerate", "hf-trainer", "deepspeed", "torchtitan", "megatron-fsdp")


class MigrationError(ValueError):
    """An input that is not a config of the named tool, or one fsdp2lite cannot represent at all."""


@dataclass(frozen=True)
class KeyReport:
    key: str  # dotted path in the input
    value: str
    status: Status
    detail: str  # mapped: to what; dropped: why; unsupported: what is missing; unknown: did you mean


@dataclass
class Migration:
    source: str
    path: str
    data: dict[str, Any] = field(default_factory=dict)  # FSDPConfig fields
    origins: dict[str, str] = field(default_factory=dict)  # fsdp2lite key -> input key(s)
    keys: list[KeyReport] = field(default_factory=list)
    model: Any = None  # --model, built on meta: names its repeated block and, for size-based wrapping, its modules
    root_only: bool = False  # the input asks for no wrapping (NO_WRAP): no block rule is added
    notes: list[str] = field(default_factory=list)  # what the user should know beyond the key rows

    @property
    def config(self) -> FSDPConfig:
        from pydantic import ValidationError

        try:
            return FSDPConfig.model_validate(self.data)
        except ValidationError as exc:
            problems = "; ".join(f"{p.location}: {p.message}" for p in problems_from(exc))
            raise MigrationError(f"{self.path}: the values do not make a valid fsdp2lite config: {problems}") from None

    @property
    def unknown(self) -> list[KeyReport]:
        return [k for k in self.keys if k.status == "unknown"]

    def yaml(self) -> str:
        """The policy file: ``config.to_yaml()`` with a comment on each key that came from the input
        (top-level keys and the mapping keys under them, e.g. ``mixed_precision.param_dtype``)."""
        lines = [f"# migrated by fsdp2lite migrate --from {self.source} {self.path}"]
        lines += [f"# note: {note}" for note in self.notes]
        parent = ""
        for line in self.config.to_yaml().splitlines():
            key = line.strip().split(":", 1)[0]
            if line and not line[0].isspace() and not line.startswith("-"):
                parent, path = key, key
            elif line.startswith("  ") and not line.startswith("   ") and not line.lstrip().startswith("-"):
                path = f"{parent}.{key}"
            else:
                path = ""
            origin = self.origins.get(path) if path else None
            lines.append(f"{line}  # from {origin}" if origin else line)
        return "\n".join(lines) + "\n"


Handler = Callable[[Migration, Any], str]  # writes into migration.data; returns what it mapped to
Rule = Handler | tuple[Literal["dropped", "unsupported"], str]


def set_key(m: Migration, path: str, value: Any, origin: str) -> None:
    node = m.data
    parts = path.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    m.origins.setdefault(path, origin)
    top = parts[0]
    m.origins[top] = f"{m.origins[top]}, {origin}" if top in m.origins and origin not in m.origins[top] else origin


def add_block_rule(m: Migration, classes: list[str], origin: str) -> None:
    wrap = m.data.setdefault("wrap", [])
    if wrap:
        wrap[0]["match"]["class"] = sorted(set(wrap[0]["match"]["class"]) | set(classes))
    else:
        wrap.append({"match": {"class": classes}})
    m.origins["wrap"] = origin


def checkpoint_blocks(m: Migration, origin: str) -> str:
    if not m.data.get("wrap"):
        return "unsupported"
    for rule in m.data["wrap"]:
        rule["activation_checkpointing"] = True
    m.origins["wrap"] = f"{m.origins.get('wrap', '')}, {origin}".strip(", ")
    return "wrap[*].activation_checkpointing: true"


DTYPES = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "fp32": "fp32", "float32": "fp32"}


LOOP_SETTING = "a training-loop setting, not sharding"


def as_int(m: Migration, key: str, value: Any, *, auto: bool = False) -> int:
    """``value`` as a rank count (an int >= 1; with ``auto``, -1 too: the remaining ranks), or a
    ``MigrationError`` naming ``key``; booleans and fractions are refused, not rounded."""
    number = value
    if isinstance(value, str) and re.fullmatch(r"\s*-?\d+\s*", value):
        number = int(value)  # a TOML/YAML string such as "4"
    if isinstance(number, int) and not isinstance(number, bool) and (number >= 1 or (auto and number == -1)):
        return number
    allowed = "an int >= 1 or -1 (the remaining ranks)" if auto else "an int >= 1"
    raise MigrationError(f"{m.path}: {key} {value!r}: expected {allowed}")


def set_return(m: Migration, path: str, value: Any, origin: str) -> str:
    """``set_key``, returning the report's "mapped to" text."""
    set_key(m, path, value, origin)
    return f"{path}: {value}"
