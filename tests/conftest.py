from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))  # spawned ranks import the helpers by module name


# The fast part run on the oldest supported torch (pyproject's floor) as well: scripts/test.sh runs
# `pytest -m oldest_torch` in .venv-oldest beside the whole suite in .venv. Node ids under tests/, a whole
# file or one test (a prefix: every parametrization); about 3 minutes on its own on a 2-core machine: API,
# runtime parity (an even and an uneven shard), checkpoint safety, estimate and the CLI.
OLDEST_TORCH = (
    "test_api.py",
    "test_parity.py::test_parity_with_ddp[2]",
    "test_parity.py::test_parity_with_ddp[3]",
    "test_checkpoint_safety.py",
    "test_cli.py",
    "test_estimate.py",
    "test_estimate_finetune.py",
    "test_allocator.py",
    "test_timing.py",
    "test_zero.py",
    "test_hfsdp.py",
    "test_host_masters.py",
    "test_host_step.py",
    "test_nvme.py",
    "test_host_arena.py",
    "test_copy_out_views.py",
    "test_param_mixed_precision.py",
    "test_plan.py",
)
# ... less these, the slowest that check nothing a torch version changes (the run on the newest torch keeps
# them): simulate against 3 real ranks (about a minute) and analytic against simulate on either model; the
# planner's budget search, qlora search at 3 ranks and step-time model on a Hugging Face config (arithmetic on
# the planner's own figures: 36 s on torch 2.13). simulate itself stays (estimate_follows_the_settings, lora's
# adapters), as it runs the runtime under this torch's fake tensors; so do the fine-tuning refusals.
OLDEST_TORCH_TOO_SLOW = (
    "test_estimate.py::test_simulate_within_5_percent_of_real_ranks",
    "test_estimate.py::test_analytic_within_15_percent_of_simulate",
    "test_estimate_finetune.py::test_cli_budget_writes_the_fastest_fitting_setting_and_its_command",
    "test_estimate_finetune.py::test_the_planner_searches_qlora_at_a_degree_rows_do_not_divide",
    "test_estimate_finetune.py::test_cli_finetune_time_and_reserved",
)


def _listed(nodeid: str, entries: tuple[str, ...]) -> bool:
    return any(nodeid == f"tests/{e}" or nodeid.startswith((f"tests/{e}::", f"tests/{e}[")) for e in entries)


def _mark_oldest_torch(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the OLDEST_TORCH selection. On a run of the whole suite (no paths given), an entry that names
    no collected test (a renamed one) is an error: the run on the oldest torch never shrinks unnoticed."""
    whole_suite = config.args_source == pytest.Config.ArgsSource.TESTPATHS
    for entry in OLDEST_TORCH + OLDEST_TORCH_TOO_SLOW:
        if whole_suite and not any(_listed(item.nodeid, (entry,)) for item in items):
            raise pytest.UsageError(f"tests/conftest.py: the oldest-torch entry {entry!r} names no collected test")
    for item in items:
        if _listed(item.nodeid, OLDEST_TORCH) and not _listed(item.nodeid, OLDEST_TORCH_TOO_SLOW):
            item.add_marker(pytest.mark.oldest_torch)


# The files that take longest (serial seconds on 2 cores, torch 2.13, 2026-11-29), longest first: the suite runs
# them before the rest, so that under pytest-xdist (scripts/test.sh: --dist loadfile --no-loadscope-reorder, a
# file to a worker in this order) no long file starts last while the other worker has nothing left to run.
# xdist's own order (most tests first) started most of these last. A file missing from the list runs after them.
LONGEST_FIRST = (
    "test_example_train.py",  # 116 s
    "test_finetune_weights.py",  # 68
    "test_estimate.py",  # 66
    "test_estimate_job.py",  # 58
    "test_estimate_finetune.py",  # 52
    "test_run_launcher.py",  # 39
    "test_founding.py",  # 38
    "test_integrations.py",  # 36
    "test_parity.py",  # 35
    "test_finetune.py",  # 34
    "test_cli.py",  # 32
    "test_trl_sft.py",  # 28
    "test_hfsdp.py",  # 27
)


def _longest_first(items: list[pytest.Item]) -> None:
    """Reorder ``items`` (in place) by LONGEST_FIRST, each file's tests kept together and in their order."""
    rank = {f"tests/{name}": place for place, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _mark_oldest_torch(config, items)
    _longest_first(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def single_rank_pg():
    """A real one-rank gloo process group in this process, for single-process API tests."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def four_ranks():
    """This process as rank 0 of a fake 4-rank process group (torch's FakeStore: collectives return at once),
    with its 1-D "shard" mesh, for tests of what fully_shard checks and plans."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        yield init_device_mesh("cpu", (4,), mesh_dim_names=("shard",))
    finally:
        dist.destroy_process_group()
