"""Joining the process group so that ``torchrun --max-restarts`` brings a job back.

    fl.init_process_group("gloo")                      # instead of dist.init_process_group("gloo")
    fl.init_process_group("nccl", device_id=device)    # timeout: 10 minutes unless given

[Note: restart attempts]
torchrun's c10d rendezvous shares one TCPStore, owned by the agent, with the workers (unless
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``), and that store outlives the workers: after a rank is lost,
torchrun restarts every worker against the same store, which still holds the previous attempt's keys.
``init_process_group`` writes and reads fixed keys (gloo's peer addresses, NCCL's unique id), so a
restarted worker may read a dead worker's address before the new one overwrites it: "Gloo
connectFullMesh failed ... Connection refused", or a hang until the timeout. torch isolates attempts
with ``TORCHELASTIC_RESTART_COUNT``, but that count is per node (a node restarted because another
node failed keeps its own), so it cannot name an attempt across nodes.

``init_process_group`` here gives each attempt keys of its own. Every worker draws a random token; rank 0
acknowledges each token it sees under that token's own key, with its own token as the attempt's name;
a worker waits for the acknowledgement of *its* token (a key no earlier attempt can have written), and
confirms under the attempt's name. Rank 0 acknowledges stale tokens too (harmless: nobody waits for
them) and keeps going until every rank of this attempt confirmed. The process group then uses a
``PrefixStore`` under the attempt's name: nothing it reads can come from another attempt. It works for
every backend, with or without torchrun's shared store, and on a fresh store costs a few round trips.
"""

from __future__ import annotations

import time
import uuid
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT = timedelta(minutes=10)  # NCCL's default; gloo's is 30 minutes
_ROOT = "fsdp2lite/attempts"


def init_process_group(
    backend: str | None = None,
    *,
    timeout: timedelta | float | None = None,
    device_id: torch.device | int | None = None,
    **kwargs: Any,
) -> None:
    """``dist.init_process_group`` from torchrun's environment (``env://``) with keys private to this
    restart attempt ([Note: restart attempts]); ``timeout`` (a timedelta or seconds) bounds every
    collective and the rendezvous, so a lost peer becomes an error torchrun can restart."""
    if dist.is_initialized():
        raise RuntimeError("fl.init_process_group: the default process group is already initialized")
    if "init_method" in kwargs or "store" in kwargs:
        raise ValueError(
            "fl.init_process_group joins through torchrun's environment (env://); for your own init_method "
            "or store, call torch.distributed.init_process_group"
        )
    limit = _timeout(timeout)
    store, rank, world_size = next(dist.rendezvous("env://", timeout=limit))
    private = attempt_store(store, rank, world_size, limit)
    if device_id is not None:
        kwargs["device_id"] = device_id
    dist.init_process_group(backend, store=private, rank=rank, world_size=world_size, timeout=limit, **kwargs)


def _timeout(timeout: timedelta | float | None) -> timedelta:
    if timeout is None:
        return DEFAULT_TIMEOUT
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, int | float) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(f"timeout must be a timedelta or a number of seconds, got {type(timeout).__name__}")
    if not seconds > 0:
        raise ValueError(f"timeout must be positive, got {seconds:g} seconds")
    return timedelta(seconds=seconds)


def attempt_store(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> dist.PrefixStore:
    """``store`` under a prefix every rank of this attempt agrees on and no other attempt uses."""
    token = uuid.uuid4().hex
    if rank == 0:
        attempt = token
        _acknowledge_every_rank(store, attempt, world_size, timeout)
    else:
        store.set(f"{_ROOT}/join/{rank}", token)
        attempt = store.get(f"{_ROOT}/ack/{token}").decode()  # waits (store timeout) for rank 0
        store.set(f"{_ROOT}/{attempt}/ready/{rank}", "1")
    return dist.PrefixStore(f"{_ROOT}/{attempt}/", store)


def _acknowledge_every_rank(store: dist.Store, attempt: str, world_size: int, timeout: timedelta) -> None:
    """Rank 0: answer each token under its own key until every other rank has confirmed this attempt."""
    pending = set(range(1, world_size))
    answered: set[str] = set()
    deadline = time.monotonic() + timeout.total_seconds()
    while pending:
        for rank in sorted(pending):
            join = f"{_ROOT}/join/{rank}"
            if not store.check([join]):
                continue
            token = store.get(join).decode()
            if token not in answered:  # this attempt's, or a stale one nobody waits for
                store.set(f"{_ROOT}/ack/{token}", attempt)
                answered.add(token)
            if store.check([f"{_ROOT}/{attempt}/ready/{rank}"]):
                pending.discard(rank)
        if pending:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"fl.init_process_group: ranks {sorted(pending)} did not join within "
                    f"{timeout.total_seconds():g} s (raise timeout= if they start slowly)"
                )
            time.sleep(0.005)  # polling the store; a join takes a few round trips
