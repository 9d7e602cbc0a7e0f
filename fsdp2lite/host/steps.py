"""What runs once a group's reduced gradients are in ``.grad``: the post-accumulate-grad hooks, in backward's
thread or, for ``fsdp2lite.step_in_backward``'s host steps, on a thread of their own.

[Note: host steps off backward's thread]
``step_in_backward`` steps each group from a post-accumulate-grad hook. Run in backward's own thread, the
step of an offloaded group stops everything: on CUDA the hook first waits for the group's gradients to reach
the host (the copy lands after all device work queued before it), and the next group's backward is queued only
after the step returns, so the device idles for the whole host step. ``HostSteps`` runs those steps on one
worker thread instead, in the order their groups were reduced:

    backward's thread   ... group k reduced -> submit step k -> queue group k-1's backward -> reduce k-1 ...
    worker thread                              wait copy k -> step k (host) -> free k's gradients
    device (CUDA)       ... RS k, copy k -> group k-1's backward kernels ... (no longer waits for step k)

Who waits for it, and why:
- a reduction that needs a host gradient buffer and finds none free (``HostGradPool.take``, [Note: host
  gradient buffers] in grad_pool.py) waits for the steps first: they free their groups' buffers, so one buffer,
  the largest group's, still serves every group, and step k overlaps the backward queued before group k-1's
  reduction (on CUDA, what the device has in its queue; on CPU, the backward's own compute);
- the end of every backward (``RootContext._end_backward_pass``, microbatches included) waits for all of them:
  ``loss.backward()`` returns with every group stepped, as before, so the next forward, ``state_dict`` and
  user code read stepped shards;
- a group used again while its step is in flight (used twice in one backward: all-gathered again for its
  first use's backward, and reduced twice) waits before its all-gather reads the shards the step writes and
  before its reduction adds into the gradients the step reads and frees (``HostSteps.wait_for``);
- an exception mid-step (``RootContext.reset``) waits too, so no step outlives the recovery.
Only hooks that say so (``runs_off_thread``: True, or None for "off a CPU mesh": on a CPU mesh the worker would
step on the cores the backward runs on, measured in docs/offload.md), of groups whose sharded parameters are on
the host, go to the worker, and only when every hook of the group does: a hook of the user's might read the
gradients the step frees. Everything else runs in
backward's thread as autograd would, after the copy to the host landed.

A step that raises stops the steps queued after it (as an exception in backward's thread would) and is
raised by the next wait in backward's thread: from the reduction that waited, or from ``loss.backward()``.
The worker runs outside backward's thread-local state: a ``TorchDispatchMode`` or ``no_grad`` entered around
``backward()`` does not apply to it (the optimizers set their own grad mode). With tracing on, each step is a
``host_step`` span in a lane of its own and each wait for the worker a ``host_step_wait`` span (trace.py).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from functools import partial

import torch

from fsdp2lite._runtime.trace import HOST_LANE, TraceRecorder


class HostSteps:
    """One worker thread (started on first use) running host steps in submission order, and the steps in flight."""

    recorder: Callable[[], TraceRecorder | None]  # the root's trace recorder, when tracing ([Note: host steps ...])
    executor: ThreadPoolExecutor | None
    pending: list[tuple[Future[None], str]]  # submitted, not yet waited on, oldest first, with their group's name
    stepping: set[int]  # ids of the sharded parameters the pending steps were submitted for
    failed: bool  # a step raised: the ones queued after it are skipped until it is waited on

    def __init__(self, recorder: Callable[[], TraceRecorder | None] = lambda: None) -> None:
        self.recorder = recorder
        self.executor = None
        self.pending = []
        self.stepping = set()
        self.failed = False

    def submit(
        self,
        step: Callable[[], None],
        copy_event: torch.cuda.Event | None,
        params: list[torch.Tensor],
        group: str,
        device: torch.device,
    ) -> None:
        """Run ``step`` (group ``group``'s hooks on its sharded ``params``) on the worker after the steps already
        submitted, once ``copy_event`` (the gradients' copy to the host, recorded on ``device``) has completed."""
        if self.executor is None:
            self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fsdp2lite-host-step")
        future = self.executor.submit(self._run, step, copy_event, device=device, recorder=self.recorder(), group=group)
        self.pending.append((future, group))
        self.stepping.update(id(param) for param in params)

    def wait_for(self, params: Iterable[torch.Tensor]) -> None:
        """Wait for the steps in flight if one was submitted for one of ``params``, whose shards or gradients the
        caller is about to read or write."""
        if self.stepping and any(id(param) in self.stepping for param in params):
            self.wait()

    def _run(
        self,
        step: Callable[[], None],
        copy_event: torch.cuda.Event | None,
        *,
        device: torch.device,
        recorder: TraceRecorder | None,
        group: str,
    ) -> None:
        if self.failed:
            return  # an earlier step raised: backward's thread will raise it, as if it had stopped there
        try:
            if copy_event is not None:
                with torch.cuda.device(device):  # this thread's current device is cuda:0 until told otherwise
                    copy_event.synchronize()  # the step reads the host gradients: their copy must have landed
            with _span(recorder, "host_step", group, HOST_LANE):
                step()
        except BaseException:
            self.failed = True
            raise

    def wait(self) -> bool:
        """Wait for every submitted step; raise the first error one raised. True when any was in flight."""
        pending, self.pending = self.pending, []
        self.stepping.clear()
        if not pending:
            return False
        with _span(self.recorder(), "host_step_wait", pending[-1][1]):
            errors = [error for future, _ in pending if (error := future.exception()) is not None]
        self.failed = False
        if errors:
            raise errors[0]
        return True

    def wait_quietly(self) -> None:
        """Wait for every submitted step, after an exception elsewhere: a step's own error becomes a warning,
        so the exception being handled is the one raised."""
        try:
            self.wait()
        except Exception as error:  # noqa: BLE001 - reported, not swallowed: the caller is already raising
            warnings.warn(f"fsdp2lite: a host step in backward also raised: {error!r}", RuntimeWarning, stacklevel=2)


def _span(recorder: TraceRecorder | None, name: str, group: str, lane: str = "") -> AbstractContextManager[None]:
    """A trace span of a host step or of a wait for one (the step belongs to the group's post-backward)."""
    return nullcontext() if recorder is None else recorder.span(name, group, "POST_BACKWARD", lane)


def run_post_accumulate_grad_hooks(
    params: list[torch.Tensor],
    copy_event: torch.cuda.Event | None,
    host_steps: HostSteps,
    group: str,
    device: torch.device,
) -> None:
    """``param.register_post_accumulate_grad_hook`` on group ``group``'s sharded parameters (e.g. an optimizer
    stepping in backward): called once their reduced gradients are in ``.grad``, as autograd would for a leaf; on
    the host-step worker when every hook allows it and the shards are on the host ([Note: host steps off
    backward's thread]). ``device``: the mesh's."""
    calls = [
        partial(hook, param)
        for param in params
        for hook in tuple((getattr(param, "_post_accumulate_grad_hooks", None) or {}).values())
    ]
    if not calls:
        return
    off_thread = all(_off_thread(getattr(call.func, "runs_off_thread", False), device) for call in calls) and all(
        param.device.type == "cpu" for param in params
    )
    run_all = partial(_run_all, calls)
    if off_thread:
        host_steps.submit(run_all, copy_event, params, group, device)
        return
    if copy_event is not None:
        copy_event.synchronize()  # the hooks read the host gradients: their copy must be done
    with _span(host_steps.recorder(), "host_step", group):
        run_all()


def _off_thread(runs_off_thread: bool | None, device: torch.device) -> bool:
    """A hook's ``runs_off_thread``: True, False, or None for "where the mesh's device is not the host" (on a CPU
    mesh the step would only share backward's cores)."""
    return runs_off_thread is True or (runs_off_thread is None and device.type != "cpu")


def _run_all(calls: list[partial[None]]) -> None:
    for call in calls:
        call()
