"""Starting a benchmark's ranks: ``start_ranks(entry, nprocs, args)``, ``mp.spawn``'s contract, faster."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def start_ranks(entry: Callable[..., None], nprocs: int, args: tuple[Any, ...]) -> None:
    """Run ``entry(rank, *args)`` in ``nprocs`` new processes and wait for them, raising a rank's error as
    ``mp.spawn`` does: forked from multiprocessing's fork server where the platform has one, else spawned. Each is
    a fresh process either way (the server runs no torch code: no threads, no CUDA); under pytest it is the server
    the test suite started, which imported torch once (tests/_dist.py), saving each rank 2-4 s of importing it."""
    method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    mp.start_processes(entry, args=args, nprocs=nprocs, join=True, start_method=method)
