"""``--model``: the model a command plans, named by a factory (``pkg.module:callable``) or a Hugging Face
model's config (a directory, ``config.json``, ``hf:ID`` or a preset: ``_hf_models``), built under
``torch.device("meta")``: parameters get shapes and dtypes, no storage, however large the model."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from ._args import UsageError
from ._hf_models import FORMS, hf_factory, is_hf_spec

_PROG = "fsdp2lite explain"


def load_factory(spec: str, prog: str = _PROG, flag: str = "--model") -> Callable[[], Any]:
    """The callable named by ``pkg.module:factory`` (the attribute may be dotted), or a Hugging Face
    model's builder (a directory, config.json, ``hf:ID`` or a preset: ``_hf_models``); ``UsageError`` if
    neither, naming ``flag`` (the argument ``spec`` came from)."""
    if flag == "--model" and is_hf_spec(spec):
        return hf_factory(spec, prog)
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        expected = FORMS if flag == "--model" else "'pkg.module:function'"
        raise UsageError(f"argument {flag}: expected {expected}; got {spec!r}", prog)
    if os.getcwd() not in sys.path:  # like `python -m`: modules next to the user's working directory import
        sys.path.insert(0, os.getcwd())
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or the module's own code failing: one line either way
        raise UsageError(
            f"argument {flag}: cannot import {module_name!r} from {spec!r}: {_one_line(exc)}", prog
        ) from None
    for part in attr.split("."):
        if not hasattr(target, part):
            raise UsageError(f"argument {flag}: {module_name!r} has no attribute {attr!r} (from {spec!r})", prog)
        target = getattr(target, part)
    if not callable(target):
        raise UsageError(
            f"argument {flag}: {spec!r} is not callable (type {type(target).__name__}); "
            "expected a function returning an nn.Module",
            prog,
        )
    return target


def build_on_meta(factory: Callable[[], Any], spec: str, prog: str = _PROG) -> nn.Module:
    """Call the factory under ``torch.device("meta")``: parameters get shapes and dtypes, no storage."""
    try:
        with torch.device("meta"):
            model = factory()
    except Exception as exc:
        raise UsageError(f"argument --model: {spec}() raised {_one_line(exc)}", prog) from None
    if not isinstance(model, nn.Module):
        raise UsageError(f"argument --model: {spec}() returned a {type(model).__name__}, not an nn.Module", prog)
    return model


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"
