"""The runtime's collective seam, wrapped for tests ([Note: one collective seam] in _runtime/collective.py).

``wrapped_collectives(wrap)`` replaces, for the duration, each method of the runtime's collectives that sends
something (the native ones and gloo's in-place reduce-scatter; the user's objects are the user's) by
``wrap(kind, method)``, kind one of all_gather, reduce_scatter, all_reduce, all_to_all. A method is called as
``method(collective, output_or_tensor, [input,] ranks, async_op=...)``: ``ranks_of`` and ``first_tensor`` read it.
``recorded_collectives`` records each call; ``delayed_collectives`` runs each late on a worker thread.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from fsdp2lite._runtime.collective import GlooInPlace, Native
from fsdp2lite._runtime.comm import Ranks

Method = Callable[..., Any]
SITES: tuple[tuple[type, str], ...] = (
    (Native, "all_gather"),
    (Native, "reduce_scatter"),
    (Native, "all_reduce"),
    (Native, "all_to_all"),
    (GlooInPlace, "reduce_scatter"),  # its own: one all-reduce in place
)


@contextmanager
def wrapped_collectives(wrap: Callable[[str, Method], Method]) -> Iterator[None]:
    originals = [(cls, name, vars(cls)[name]) for cls, name in SITES]
    for cls, name, method in originals:
        setattr(cls, name, wrap(name, method))
    try:
        yield
    finally:
        for cls, name, method in originals:
            setattr(cls, name, method)


def ranks_of(args: tuple[Any, ...]) -> Ranks:
    """The ``Ranks`` argument of a wrapped call's positional ``args`` (the collective first)."""
    return next(arg for arg in args if isinstance(arg, Ranks))


def first_tensor(args: tuple[Any, ...]) -> torch.Tensor:
    """The output (or the all-reduced tensor) of a wrapped call."""
    return next(arg for arg in args if isinstance(arg, torch.Tensor))


@contextmanager
def recorded_collectives() -> Iterator[list[tuple[str, Ranks, int, bool]]]:
    """Record (kind, ranks, output numel, async_op) for every collective the runtime issues."""
    calls: list[tuple[str, Ranks, int, bool]] = []

    def wrap(kind: str, method: Method) -> Method:
        def recorder(*args: Any, **kwargs: Any) -> Any:
            calls.append((kind, ranks_of(args), first_tensor(args).numel(), kwargs["async_op"]))
            return method(*args, **kwargs)

        return recorder

    with wrapped_collectives(wrap):
        yield calls


class DelayedCollectives:
    """Runs every collective on one worker thread (issue order kept), each after a delay; the Work handed
    back completes only then. Reading a collective's output before waiting on it reads garbage."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.jobs: queue.Queue[tuple[Method, tuple, dict, threading.Event] | None] = queue.Queue()
        self.worker = threading.Thread(target=self._work, daemon=True)
        self.worker.start()

    def _work(self) -> None:
        while (job := self.jobs.get()) is not None:
            fn, args, kwargs, done = job
            time.sleep(self.delay_s)
            fn(*args, **{**kwargs, "async_op": False})
            done.set()

    def wrap(self, fn: Method) -> Method:
        def delayed(*args: Any, async_op: bool = False, **kwargs: Any) -> Any:
            done = threading.Event()
            self.jobs.put((fn, args, kwargs, done))
            work = _EventWork(done)
            if not async_op:
                work.wait()
                return None
            return work

        return delayed

    def close(self) -> None:
        self.jobs.put(None)
        self.worker.join()


class _EventWork:
    def __init__(self, done: threading.Event) -> None:
        self.done = done

    def wait(self) -> bool:
        self.done.wait()
        return True


@contextmanager
def delayed_collectives(delay_s: float) -> Iterator[None]:
    """Every collective of the runtime issued late, on one worker thread ([Note: one collective seam])."""
    delayer = DelayedCollectives(delay_s)
    try:
        with wrapped_collectives(lambda kind, method: delayer.wrap(method)):
            yield
    finally:
        delayer.close()
