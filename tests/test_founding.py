"""The planner's fine-tuning figures against what a real step allocates (issue 51, item 2), at CPU size.

A Llama of the founding job's structure (GQA attention, SwiGLU MLP, untied embedding and head, LoRA r 16 on the
seven projections, NF4 base held by fsdp2lite's ``NF4Rows``), narrow, as rank 0 of torch's fake process group of
4, stepped with real tensors and counted through the CPU allocator (benchmarks/_founding.py: every op's
temporaries included). Each row of ``fsdp2lite estimate``'s search for qlora, and lora, must be within 5% of
the measured peak, by the search's method (analytic) and by ``estimate``'s default (simulate); the per-layer
extrapolation the benchmark makes to 80 layers must hold too (measured at 2
and 3 layers, extrapolated to 5, against 5 measured). ``benchmarks/bench_founding.py`` runs the same at
Llama-3-70B's width.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import fsdp2lite as fl

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import _founding as founding  # noqa: E402

pytest.importorskip("transformers", reason="the founding job is a Hugging Face Llama: pip install transformers")
pytest.importorskip("peft", reason="LoRA adapters are peft's: pip install peft")
pytest.importorskip("torchao", reason="the NF4 base is torchao's: pip install torchao")

SHAPE = {"hidden": 512, "intermediate": 1792, "heads": 8, "kv_heads": 2, "vocab": 4096}
SEQ, WORLD = 256, 4
TOLERANCE = 0.05


Row = tuple[
    bool, int, bool, bool
]  # reshard_after_forward, forward prefetch depth, checkpointing, every group offloaded
CHOSEN: Row = (True, 1, True, False)  # the founding job's choice


def row_config(hf_config: Any, row: Row) -> Any:
    """The config ``estimate --budget --write-config`` writes for the row."""
    import transformers

    from fsdp2lite.cli.estimate_search import config_for_setting
    from fsdp2lite.estimate import default_config

    reshard, prefetch, checkpointing, offload = row
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    settings = {
        "finetune": "qlora", "mixed_precision": "bf16", "reshard_after_forward": reshard,
        "forward_prefetch_depth": prefetch, "activation_checkpointing": checkpointing, "offload": offload,
        "offload_groups": "all" if offload else None, "optimizer_state": "host", "nvme_path": None,
    }  # fmt: skip
    return config_for_setting(default_config(model), settings)


@functools.cache
def measured(layers: int, kind: str, row: Row) -> int:
    """The peak a real step allocates (each measurement made once, for every test that reads it)."""
    hf_config = founding.llama_config(layers=layers, **SHAPE)
    config = row_config(hf_config, row)
    with founding.fake_group(WORLD):
        step, _ = founding.measure_job(
            lambda: founding.build(hf_config, kind, config, WORLD, torch.device("cpu"), target="cpu"),
            SEQ, 1, SHAPE["vocab"], torch.device("cpu"), host_resident=row[3],
        )  # fmt: skip
    return step.peak


def planned(layers: int, kind: str, row: Row, method: str = "analytic") -> int:
    import transformers

    hf_config = founding.llama_config(layers=layers, **SHAPE)
    estimate = fl.estimate_memory(
        lambda: transformers.AutoModelForCausalLM.from_config(hf_config), row_config(hf_config, row),
        world_size=WORLD, batch=1, seq=SEQ, finetune=kind, method=method, device="cpu",
    )  # fmt: skip
    return estimate.peak_bytes


@pytest.mark.parametrize(
    "kind, row",
    [
        ("qlora", CHOSEN),
        ("qlora", (False, 1, True, False)),  # every layer's gathered weights kept to its backward
        ("qlora", (True, 0, False, False)),  # every activation saved
        ("lora", CHOSEN),  # a bf16 base
        ("qlora", (True, 1, True, True)),  # every group's shards on the host: the device's share
    ],
)
def test_the_planner_is_within_5_percent_of_what_a_step_allocates(kind: str, row: Row) -> None:
    ratio = planned(3, kind, row) / measured(3, kind, row)
    assert abs(ratio - 1) <= TOLERANCE, (kind, row, ratio)


def test_simulate_is_within_5_percent_too() -> None:
    """``estimate``'s default method runs the real runtime on fake tensors, NF4 weights as ``NF4Rows``."""
    for row in (CHOSEN, (False, 1, True, False)):
        ratio = planned(3, "qlora", row, method="simulate") / measured(3, "qlora", row)
        assert abs(ratio - 1) <= TOLERANCE, (row, ratio)


def test_per_layer_extrapolation_and_the_whole_depth() -> None:
    """What bench_founding.py does at 70B width: two depths measured, the line through them at 5 layers equals
    5 layers measured (within 2%), and the planner's figure for 5 layers is within 5% of it."""
    extrapolated = founding.per_layer({layers: measured(layers, "qlora", CHOSEN) for layers in (2, 3)}, 5)
    whole = measured(5, "qlora", CHOSEN)
    assert abs(extrapolated / whole - 1) <= 0.02, (extrapolated, whole)
    assert abs(planned(5, "qlora", CHOSEN) / whole - 1) <= TOLERANCE, whole


def test_the_walk_counts_what_is_gathered_kept_and_in_flight() -> None:
    """The walk's bookkeeping on a hand-made trace (embedding, two blocks, a run-by-run head; every moment's
    activation side 0): a group kept from its forward (reshard_after_forward false) still has its all-gather in
    flight while the group before it computes (the prefetch), is counted beside every later moment, and its
    backward prefetches nothing of it; a frozen embedding's (no backward) stays gathered to the end."""
    from fsdp2lite.estimate.finetune_trace import Moments, Trace
    from fsdp2lite.estimate.finetune_walk import GroupPlanBytes, Schedule, walk

    still = Moments(0, 0, 0, None, None)
    moving = Moments(0, 0, 0, 0, 0)
    trace = Trace([0, 1, 2, 3], {0: still, 1: moving, 2: moving}, [1, 2], 0, 0, head=3)

    def group(unsharded: int, kept: bool) -> GroupPlanBytes:
        return GroupPlanBytes(unsharded, 0, True, unsharded if kept else 0, 0, 0, 0)

    groups = [group(1000, True), group(100, False), group(10, False), group(1, True)]
    moments = walk(trace, groups, (0, 0), Schedule(1, False, True), 0)
    at = {(m.name, m.group): m.breakdown for m in moments}
    assert at[("forward", 2)]["unsharded_params"] == 1000 + 10 and at[("forward", 2)]["comm_buffers"] == 1  # head ahead
    assert at[("backward", 3)]["unsharded_params"] == 1000 + 1 and at[("backward", 3)]["comm_buffers"] == 10
    assert at[("backward", 1)]["unsharded_params"] == 1000 + 100  # the embedding: gathered to the end
    assert ("backward", 0) not in at  # nothing flows back to it
