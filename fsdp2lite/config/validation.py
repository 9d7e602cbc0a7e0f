"""pydantic's validation errors as ``Problem``s that name the value given and what would be valid.

pydantic words a wrong value by what it expected (``Input should be 'params' or 'optimizer'``) and keeps the
value apart, so a config's messages would never show what the user wrote. Here every error pydantic raises
itself reads ``<value> is not valid here`` with ``use <what is valid>`` as its suggestion, the same for every
key of every model (a fixed choice, a type, a model where a scalar stood), top level and in rules:

    zero_stage: 4                   ->  zero_stage: 4 is not valid here (use 1, 2 or 3)
    sharding: {shard: everything}   ->  sharding.shard: 'everything' is not valid here (use params or optimizer)
    wrap: [{..., group: maybe}]     ->  wrap.0.group: 'maybe' is not valid here (use true or false, tied)

A value no member of a union accepts is one problem listing every member (not one per member); an unknown
key gets the closest valid key; the schema's own validators already name the value in their messages.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ValidationError

from .errors import Problem

# what pydantic's own error types (https://docs.pydantic.dev/latest/errors/validation_errors/) ask for, as a
# suggestion reads it; a type not listed keeps pydantic's wording, with the value added
_EXPECTED = {
    "bool_parsing": "true or false",
    "bool_type": "true or false",
    "int_parsing": "an integer",
    "int_type": "an integer",
    "int_from_float": "an integer",
    "float_parsing": "a number",
    "float_type": "a number",
    "string_type": "a string",
    "list_type": "a list",
    "dict_type": "a mapping of keys",
    "model_type": "a mapping of keys",
    "model_attributes_type": "a mapping of keys",
}
# how a union member's tag (the location part pydantic adds per member) reads in a suggestion
_MEMBERS = {"bool": "true or false", "int": "an integer", "str": "a string", "list[str]": "a list of strings"}
_SHOWN = 60  # characters of a value's repr shown in a message
_KEYS = 6  # a model's keys listed where a scalar stood (fsdp2lite schema lists them all)


def problems_from_errors(exc: ValidationError, root: type[BaseModel]) -> list[Problem]:
    """``exc``'s errors (validating ``root``) as Problems, in pydantic's order, each naming its value once."""
    problems: list[Problem] = []
    unions: dict[tuple[Any, ...], tuple[int, list[tuple[str, Any]]]] = {}  # union's location -> (index, members)
    for error in exc.errors():
        loc = tuple(error["loc"])
        split = _union_split(loc, root)
        if split is not None and error["type"] != "extra_forbidden":
            parent, tag = loc[:split], str(loc[split])
            if parent not in unions:
                unions[parent] = (len(problems), [])
                problems.append(Problem("", "", ""))  # a placeholder, keeping the order: filled in below
            unions[parent][1].append((tag, error["input"]))
        else:
            problems.append(_problem(error, loc, root))
    for parent, (index, members) in unions.items():
        accepted = ", ".join(dict.fromkeys(_member_phrase(tag) for tag, _ in members))
        value = members[0][1]  # the first member saw the value as given; a list member may see one item
        problems[index] = Problem(_dotted(parent), f"{_shown(value)} is not valid here", f"use {accepted}")
    return problems


def _problem(error: Any, loc: tuple[Any, ...], root: type[BaseModel]) -> Problem:
    """One error that is no union member's."""
    location, kind = _dotted(loc), error["type"]
    if kind == "extra_forbidden":
        valid = valid_keys(root, loc[:-1])
        close = difflib.get_close_matches(str(loc[-1]), valid, n=1)
        suggestion = f"did you mean '{close[0]}'?" if close else f"valid keys: {', '.join(valid)}"
        return Problem(location, f"unknown key '{loc[-1]}'", suggestion)
    if kind == "literal_error":  # ctx: {'expected': "'params' or 'optimizer'"}, written as YAML takes it
        choices = str(error.get("ctx", {}).get("expected", "")).replace("'", "")
        return Problem(location, f"{_shown(error['input'])} is not valid here", f"use {choices}")
    if kind in _EXPECTED:
        expected = _EXPECTED[kind]
        keys = valid_keys(root, loc) if kind.startswith(("model", "dict")) else []
        if keys:
            expected += f" ({', '.join(keys[:_KEYS])}{', ...' if len(keys) > _KEYS else ''})"
        return Problem(location, f"{_shown(error['input'])} is not valid here", f"use {expected}")
    if kind == "missing":
        return Problem(location, "this key is required and missing", "")
    if kind in ("value_error", "assertion_error"):  # the schema's own messages name their values
        return Problem(location, error["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, "), "")
    return Problem(location, f"{error['msg']}, got {_shown(error['input'])}", "")


def _union_split(loc: tuple[Any, ...], root: type[BaseModel]) -> int | None:
    """Where in ``loc`` pydantic put a union member's tag ('bool', 'int', "literal['auto']", 'list[str]'): the
    first part that is no key where it stands, right after a part that is one; None for no union."""
    for index in range(1, len(loc)):
        part = loc[index]
        if not isinstance(part, str) or part in valid_keys(root, loc[:index]):
            continue
        before = loc[index - 1]
        if isinstance(before, str) and before in valid_keys(root, loc[: index - 1]):
            return index
        return None
    return None


def _member_phrase(tag: str) -> str:
    """How a union member's tag reads in a suggestion: ``literal['auto']`` -> ``auto``."""
    if tag.startswith("literal["):
        return tag.removeprefix("literal[").removesuffix("]").replace("'", "")
    return _MEMBERS.get(tag, tag)


def _shown(value: Any) -> str:
    """A value as a message shows it: its repr, cut at ``_SHOWN`` characters."""
    text = repr(value)
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."


def _dotted(loc: Sequence[Any]) -> str:
    return ".".join(str(part) for part in loc)


def valid_keys(root: type[BaseModel], loc: Sequence[Any]) -> list[str]:
    """Keys allowed at ``loc`` under ``root`` (aliases as written in YAML); [] where no model stands."""
    model: Any = root
    for part in loc:
        if isinstance(part, int):
            continue
        info = model.model_fields.get(part) or next((f for f in model.model_fields.values() if f.alias == part), None)
        if info is None:
            return []
        model = _model_in(info.annotation)
        if model is None:
            return []
    return [info.alias or name for name, info in model.model_fields.items()]


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside an annotation like ``list[Match]`` or ``Match | None``."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_in(arg)
        if found is not None:
            return found
    return None
