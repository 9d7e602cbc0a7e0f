"""fl.init_process_group (issue 24, [Note: restart attempts]): every rank of an attempt agrees on keys no
other attempt uses, also when the store still holds a dead attempt's keys; bad arguments are refused.
The restarts themselves, under torchrun with SIGKILLed ranks, are in test_example_train.py."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

import fsdp2lite as fl
from fsdp2lite.launch import _ROOT, attempt_store

TIMEOUT = timedelta(seconds=30)


def _attempt(store: dist.Store, world_size: int, start_late: frozenset[int] = frozenset()) -> list[dist.Store]:
    """Every rank of one attempt in its own thread; ranks in ``start_late`` start only after rank 0 has
    answered the token the store held for them from before (a dead attempt's)."""
    results: list[dist.Store | None] = [None] * world_size
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            results[rank] = attempt_store(store, rank, world_size, TIMEOUT)
        except BaseException as exc:  # reported below, on the main thread
            errors.append(exc)

    threads = {rank: threading.Thread(target=rank_main, args=(rank,)) for rank in range(world_size)}
    for rank in range(world_size):
        if rank not in start_late:
            threads[rank].start()
    for rank in sorted(start_late):
        stale = store.get(f"{_ROOT}/join/{rank}").decode()
        store.wait([f"{_ROOT}/ack/{stale}"])  # rank 0 answered the dead process first
        threads[rank].start()
    for thread in threads.values():
        thread.join(timeout=60)
    assert not errors, errors
    return [r for r in results if r is not None]


def test_each_attempt_gets_keys_of_its_own() -> None:
    store = dist.HashStore()
    store.set_timeout(TIMEOUT)
    first = _attempt(store, 3)
    first[0].set("gloo/peer/1", b"address of a process that is now dead")
    # the next attempt: the store still holds the first one's join tokens; ranks 1 and 2 start late, so
    # rank 0 first reads (and answers) their dead predecessors' tokens
    second = _attempt(store, 3, start_late=frozenset({1, 2}))
    second[2].set("written/by/rank2", b"x")
    assert all(s.get("written/by/rank2") == b"x" for s in second), "one attempt, one key space"
    for s in second:
        assert not s.check(["gloo/peer/1"]), "the dead attempt's keys are not visible"
    third = _attempt(store, 3)
    assert not third[1].check(["written/by/rank2"])


def test_one_rank_needs_no_one() -> None:
    store = dist.HashStore()
    only = attempt_store(store, 0, 1, TIMEOUT)
    only.set("k", b"v")
    assert only.get("k") == b"v"


def test_a_rank_that_never_joins_is_named() -> None:
    store = dist.HashStore()
    with pytest.raises(TimeoutError, match=r"ranks \[1, 2\] did not join within 0.2 s"):
        attempt_store(store, 0, 3, timedelta(seconds=0.2))


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"timeout": "10"}, TypeError, "timeout must be a timedelta or a number of seconds, got str"),
        ({"timeout": -1}, ValueError, "timeout must be positive, got -1 seconds"),
        ({"timeout": timedelta(0)}, ValueError, "timeout must be positive, got 0 seconds"),
        ({"init_method": "tcp://x:1"}, ValueError, "joins through torchrun's environment"),
    ],
)
def test_bad_arguments(kwargs: dict[str, object], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        fl.init_process_group("gloo", **kwargs)  # type: ignore[arg-type]
    assert not dist.is_initialized()


@pytest.mark.usefixtures("single_rank_pg")
def test_twice_is_refused() -> None:
    with pytest.raises(RuntimeError, match="already initialized"):
        fl.init_process_group("gloo")
