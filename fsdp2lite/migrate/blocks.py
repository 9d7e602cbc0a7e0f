"""Which modules become groups when a migrated input names no layer class: the model's repeated block.

With a model: its ``_no_split_modules`` (a Hugging Face model's decoder layers, what Accelerate and the
Trainer wrap when no class is named), else the class of its largest repeated block list (a class of
modules built of parameterised submodules, held two or more times in one ``nn.ModuleList`` or
``nn.Sequential``; the list with the most parameters wins). Without one:
the decoder-layer classes ``configs/hf_causal_lm.yaml`` lists, read from that file (the one list).
``explain`` asks the same question of a large module left in the root group, to suggest a class rule.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

import torch.nn as nn

from ..config.schema import FSDPConfig, as_list
from .common import Migration, add_block_rule

# the repository's policy for Hugging Face causal LMs; absent from an install without the repository
HF_POLICY_PATH = Path(__file__).resolve().parents[2] / "configs" / "hf_causal_lm.yaml"


class RepeatedBlocks(NamedTuple):
    """The largest list of same-class modules under a module: its class, how many, their parameters."""

    class_name: str
    copies: int
    numel: int


class BlockChoice(NamedTuple):
    """The block classes a module's wrap rule should name, and how they were found (for the report)."""

    classes: list[str]
    found_by: str  # "_no_split_modules" or "repeated LlamaDecoderLayer x 32 in layers"


def repeated_blocks(module: nn.Module) -> RepeatedBlocks | None:
    """The block class (:func:`_is_block`) held >= 2 times in one ``nn.ModuleList``/``nn.Sequential`` under
    ``module`` (itself included), with the most parameters over those modules; None when there is none."""
    best: RepeatedBlocks | None = None
    for container in module.modules():
        if not isinstance(container, nn.ModuleList | nn.Sequential):
            continue
        members: dict[str, dict[int, nn.Module]] = defaultdict(dict)  # class -> distinct modules
        for child in container.children():
            if _is_block(child):
                members[type(child).__name__][id(child)] = child
        for name, found in members.items():
            numel = sum(p.numel() for child in found.values() for p in child.parameters())
            if len(found) >= 2 and (best is None or numel > best.numel):
                best = RepeatedBlocks(name, len(found), numel)
    return best


def _is_block(module: nn.Module) -> bool:
    """A module with a forward built of parameterised submodules: a transformer layer, not one Linear of an
    MLP's ``nn.Sequential`` (nor a container)."""
    has_forward = type(module).forward is not nn.Module.forward
    return has_forward and any(True for child in module.children() for _ in child.parameters())


def block_classes(module: nn.Module, min_share: float = 0.0) -> BlockChoice | None:
    """The repeated block classes under ``module`` (not ``module`` itself): the classes of its
    ``_no_split_modules`` that it holds, else the class of :func:`repeated_blocks` when those blocks hold at
    least ``min_share`` of its parameters. None when it has neither."""
    inside = {type(sub).__name__ for sub in module.modules() if sub is not module}
    named = sorted(name for name in getattr(module, "_no_split_modules", None) or () if name in inside)
    if named:
        return BlockChoice(named, "_no_split_modules")
    found = repeated_blocks(module)
    total = sum(p.numel() for p in module.parameters())
    if found is None or found.class_name == type(module).__name__ or found.numel < min_share * total:
        return None
    return BlockChoice([found.class_name], f"{found.copies} repeated {found.class_name} modules")


def known_decoder_layers() -> list[str] | None:
    """The decoder-layer classes of ``configs/hf_causal_lm.yaml``'s first wrap rule; None without the file."""
    if not HF_POLICY_PATH.is_file():
        return None
    rules = FSDPConfig.from_yaml(HF_POLICY_PATH).wrap
    return list(as_list(rules[0].match.class_)) if rules and rules[0].match.class_ else None


def add_default_blocks(m: Migration, extra: tuple[str, ...] = (), extra_why: str = "") -> None:
    """The wrap rule for an input that names no layer class: ``--model``'s block classes, else the known
    Hugging Face decoder layers (after ``extra``, the source tool's own default unit, ``extra_why`` saying
    so); a note says which, so the report shows it."""
    if m.model is not None:
        choice = block_classes(m.model)
        if choice is None:
            m.notes.append(
                f"the input names no layer class and --model ({type(m.model).__name__}) has no _no_split_modules "
                "and no repeated block list: the whole model is one group; add a wrap rule by hand"
            )
            return
        add_block_rule(m, choice.classes, f"--model: {choice.found_by}")
        m.notes.append(
            f"the input names no layer class: wrapped --model's {', '.join(choice.classes)} ({choice.found_by})"
        )
        return
    known = known_decoder_layers()
    if known is None:
        m.notes.append(
            f"the input names no layer class, and without --model or configs/{HF_POLICY_PATH.name} (not in this "
            "install) the whole model is one group: pass --model to wrap your model's repeated block"
        )
        return
    origin = f"no --model: {', '.join(extra) + ' and ' if extra else ''}configs/{HF_POLICY_PATH.name}'s decoder layers"
    add_block_rule(m, [*extra, *known], origin)
    also = f"{', '.join(extra)} ({extra_why}) and " if extra else ""
    m.notes.append(
        f"no --model: wrapped {also}the known Hugging Face decoder-layer classes ({', '.join(known)}; "
        f"configs/{HF_POLICY_PATH.name}); pass --model to use your model's own"
    )
