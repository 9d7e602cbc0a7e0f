"""Rank processes: a rank that passed leaves without interpreter finalization ([Note: rank exit] in
fsdp2lite/_spawn.py), a rank that failed still reports its traceback."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _cpu_env import cpu_env
from _dist import spawn


def test_exit_rank_process_flushes_and_skips_finalization() -> None:
    code = (
        "import atexit, sys\n"
        "from fsdp2lite._spawn import exit_rank_process\n"
        "atexit.register(lambda: print('FINALIZED'))\n"
        "print('out', end='')\n"
        "sys.stderr.write('err')\n"
        "exit_rank_process()\n"
        "print('not reached')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], env=cpu_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    assert done.stdout == "out"  # flushed, and the atexit handler (finalization) never ran
    assert done.stderr == "err"


def _fail(rank: int, world_size: int) -> None:
    raise ValueError(f"rank {rank} of {world_size} failed on purpose")


def test_a_failing_rank_reports_its_traceback() -> None:
    # every rank fails (which one torch reports first is a race); its own traceback comes back
    traceback = r"(?s)in _fail\n.*ValueError: rank [01] of 2 failed on purpose"
    with pytest.raises(mp.ProcessRaisedException, match=traceback):
        spawn(_fail, 2)


def _one_rank_waits_for_nothing(rank: int, world_size: int) -> None:
    if rank == 0:
        dist.recv(torch.zeros(1), src=1)  # rank 1 never sends: a hang, bounded by the group's timeout


def test_a_hang_fails_after_the_process_group_timeout() -> None:
    start = time.monotonic()
    # rank 0 times out; rank 1, waiting for it in the final barrier, may report the closed connection first
    with pytest.raises(mp.ProcessRaisedException, match=r"(?i)timed out|timeout|connection closed by peer"):
        spawn(_one_rank_waits_for_nothing, 2, timeout_s=3)
    assert time.monotonic() - start < 120, "the hang was not bounded by the timeout"
