"""Spawn real gloo process groups on CPU for multi-process tests.

``spawn(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)`` on every rank; an exception on
any rank fails the calling test with that rank's traceback. Rendezvous is through a temporary file,
so no port is ever guessed.

A rank whose checks all passed leaves with ``os._exit(0)`` once its process group is destroyed and
its output flushed, so an abort during interpreter finalization (seen in about 2-4% of short gloo runs
on torch 2.13, with torch's own fully_shard too) can never fail a test whose checks passed; a rank that
raised still reports its traceback. See [Note: rank exit] in ``fsdp2lite/_spawn.py``.

Every process group has a timeout (``TIMEOUT_S``, or ``spawn(..., timeout_s=...)``): ranks that
disagree on which collective comes next (a fault on one rank only) fail with gloo's timeout error
instead of blocking the suite.

The ranks see whatever GPUs the machine has, on purpose: they check that a gloo job is a CPU job there
too. Subprocesses that mean CPU start with CUDA hidden instead (``tests/_cpu_env.py``).

Ranks are forked from a fork server (``multiprocessing``'s "forkserver" start method) that imported torch
and fsdp2lite once: a spawn then costs about 0.05 s instead of 2-4 s of fresh interpreters importing torch,
paid by every spawn of the suite. The server imports transformers and peft too (when installed): ranks that
build a Hugging Face model or a LoRA otherwise each paid 2-4 s of CPU importing them (four such test files
took 88 s alone, 66 s with them preloaded, on 2 cores). The server itself never runs torch code (no threads,
no CUDA), so a fork of it is as clean as a fresh process; it is started once per pytest process, with that moment's
environment: a test that changes ``os.environ`` for its ranks passes it in ``args`` instead.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdp2lite._spawn import exit_rank_process

TIMEOUT_S = 300  # a collective no rank answers fails after this long instead of hanging the suite
START_METHOD = "forkserver"  # ranks forked from a server that imported these once (see the docstring)
multiprocessing.set_forkserver_preload(
    ["torch", "torch.distributed.tensor", "torch.distributed.fsdp", "fsdp2lite", "_dist", "transformers", "peft"]
)


def _entry(
    rank: int, fn: Callable[..., None], world_size: int, init_file: str, args: tuple[Any, ...], timeout_s: float
) -> None:
    torch.set_num_threads(1)  # ranks share 2 cores; oversubscription only slows the suite down
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_rank_process()  # every check passed: no interpreter finalization ([Note: rank exit])


def cpu_mesh() -> DeviceMesh:
    """A 1D CPU mesh over the default group, axis ``shard``. Tests run gloo, so they mean CPU: torch's own
    ``fully_shard`` without a mesh would pick CUDA wherever it is present, so its calls get this."""
    return init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("shard",))


def spawn(fn: Callable[..., None], world_size: int, *args: Any, timeout_s: float = TIMEOUT_S) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; a collective that waits longer
    than ``timeout_s`` (a hang: ranks that disagree on what to call) raises on its rank."""
    fd, init_file = tempfile.mkstemp(prefix="fsdp2lite_pg_")
    os.close(fd)
    os.unlink(init_file)  # FileStore wants a path it can create
    try:
        mp.start_processes(
            _entry, args=(fn, world_size, init_file, args, timeout_s), nprocs=world_size, start_method=START_METHOD
        )
    finally:
        if os.path.exists(init_file):
            os.unlink(init_file)


def spawn_checks(world_size: int, *checks: Callable[[int, int], None]) -> None:
    """Run several ``check(rank, world_size)`` in one spawn (start-up is paid once), a barrier after each."""
    spawn(_run_checks, world_size, checks)


def _run_checks(rank: int, world_size: int, checks: tuple[Callable[[int, int], None], ...]) -> None:
    for check in checks:
        check(rank, world_size)
        dist.barrier()
