"""A policy file as a person would write it: only the keys that differ from the defaults, each commented.

    text = minimal_yaml(config, header=["written by fsdp2lite estimate"])
    assert FSDPConfig.model_validate(yaml.safe_load(text)) == config

``config.to_yaml()`` writes every key (60 lines for a one-rule config); ``minimal_yaml`` keeps a key only
where its value differs from what the file would get without it (the top level from ``FSDPConfig()``'s
defaults, a wrap rule's keys from a rule with the same ``match``), and puts the schema's own description
of each kept key above it (the ``description`` of its pydantic field, the text ``fsdp2lite schema`` shows).
The result reads back equal (``check_minimal``), which the writers assert before they keep the file.
"""

from __future__ import annotations

import textwrap
import types
import typing
from typing import Any

import yaml
from pydantic import BaseModel

from .schema import FSDPConfig, WrapRule

WIDTH = 100  # comment lines wrap here


def minimal_data(config: FSDPConfig) -> dict[str, Any]:
    """``config`` as YAML-ready data holding only the keys whose values are not the defaults."""
    data = config.model_dump(mode="json", by_alias=True)
    default = FSDPConfig().model_dump(mode="json", by_alias=True)
    kept = _differing(data, default)
    if config.wrap:
        kept["wrap"] = [_minimal_rule(rule, original) for rule, original in zip(data["wrap"], config.wrap)]
    return kept


def _minimal_rule(rule: dict[str, Any], original: WrapRule) -> dict[str, Any]:
    """A wrap rule's ``match`` (its given keys) and the keys that differ from a rule with only that match."""
    default = WrapRule(match=original.match).model_dump(mode="json", by_alias=True)
    return {"match": _differing(rule["match"], {}), **_differing(rule, default, skip=("match",))}


def _differing(data: dict[str, Any], default: dict[str, Any], skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """The keys of ``data`` not in ``skip`` whose values differ from ``default``'s (nested dicts by key)."""
    kept: dict[str, Any] = {}
    for key, value in data.items():
        if key in skip or value is None and key not in default:
            continue
        base = default.get(key, object())
        if isinstance(value, dict) and isinstance(base, dict):
            inner = _differing(value, base)
            if inner:
                kept[key] = inner
        elif value != base:
            kept[key] = value
    return kept


def minimal_yaml(config: FSDPConfig, header: list[str] | None = None) -> str:
    """``minimal_data`` as YAML with a ``# description`` above each key and ``header`` lines on top."""
    body = yaml.safe_dump(minimal_data(config), sort_keys=False) if minimal_data(config) else "{}\n"
    lines = [
        wrapped
        for line in header or []
        for wrapped in textwrap.wrap(line, WIDTH, initial_indent="# ", subsequent_indent="# ") or ["#"]
    ]
    path: list[tuple[int, str]] = []  # (indent, key) of the keys enclosing the current line
    for line in body.splitlines():
        indent, key = _key_of(line)
        if key is None:
            lines.append(line)
            continue
        while path and path[-1][0] >= indent:
            path.pop()
        path.append((indent, key))
        note = describe([name for _, name in path])
        margin = " " * (len(line) - len(line.lstrip(" ")))
        lines += textwrap.wrap(note, WIDTH, initial_indent=f"{margin}# ", subsequent_indent=f"{margin}# ")
        lines.append(line)
    return "\n".join(lines) + "\n"


def _key_of(line: str) -> tuple[int, str | None]:
    """(indent, key) of a ``key:`` line of safe_dump's block style; a list item's first key counts as
    indented past its dash; (indent, None) for a line that is not a key (a list's scalar item)."""
    stripped = line.lstrip(" ")
    indent = len(line) - len(stripped)
    if stripped.startswith("- "):
        stripped, indent = stripped[2:], indent + 2
    key, colon, _ = stripped.partition(":")
    if not colon or not key or key.startswith(("-", "'", '"')) or " " in key:
        return indent, None
    return indent, key


def describe(path: list[str]) -> str:
    """The schema's description of the field at ``path`` (keys from the top level; a wrap rule's keys
    follow ``wrap``), or "" where there is none."""
    model: Any = FSDPConfig
    note = ""
    for key in path:
        fields = getattr(model, "model_fields", None) if isinstance(model, type) else None
        field = _field(fields, key) if fields else None
        if field is None:
            return ""
        note = field.description or ""
        model = _model_in(field.annotation)
    return note


def _field(fields: dict[str, Any], key: str) -> Any:
    """The pydantic field named ``key`` or aliased so (``class`` is ``class_``'s alias)."""
    if key in fields:
        return fields[key]
    return next((f for f in fields.values() if f.alias == key), None)


def _model_in(annotation: Any) -> Any:
    """The pydantic model inside an annotation (``X``, ``X | None``, ``list[X]``), or None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) in (typing.Union, list):
        for arg in typing.get_args(annotation):
            found = _model_in(arg)
            if found is not None:
                return found
    return None


def check_minimal(text: str, config: FSDPConfig) -> None:
    """RuntimeError if ``text`` (``minimal_yaml``'s) does not read back as ``config``."""
    read = FSDPConfig.model_validate(yaml.safe_load(text) or {})
    if read != config:
        raise RuntimeError(f"minimal_yaml lost a setting: {read!r} != {config!r}")
