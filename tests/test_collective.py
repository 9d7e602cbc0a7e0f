"""The collective seam's parts without ranks ([Note: one collective seam] in _runtime/collective.py): the user's
all-gather and reduce-scatter wrapped over the runtime's collective, and the reduce form each collective gets.
Every collective of a real step going through the seam is checked on 4 gloo ranks in test_hfsdp.py, placement
and waits in test_schedule.py (delayed collectives) and test_hsdp.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fsdp2lite._runtime.collective import CustomAllGather, CustomReduceScatter, GlooInPlace, Native
from fsdp2lite._runtime.comm import Ranks
from fsdp2lite._runtime.reduce import InPlaceReduce, NativeReduceScatter, choose_reduce
from fsdp2lite.policies import CommPolicy

GROUP: Any = object()  # stands for a process group: nothing here sends
RANKS = Ranks(GROUP, 2, 1)


class Recording(Native):
    """The runtime's collective, recording (method, async_op) instead of sending."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bool]] = []

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, ranks: Ranks, *, async_op: bool) -> None:
        self.calls.append(("all_gather", async_op))

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, ranks: Ranks, *, async_op: bool) -> None:
        self.calls.append(("reduce_scatter", async_op))

    def all_reduce(self, tensor: torch.Tensor, ranks: Ranks, *, async_op: bool) -> None:
        self.calls.append(("all_reduce", async_op))

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, ranks: Ranks, *, async_op: bool) -> None:
        self.calls.append(("all_to_all", async_op))


class UserComm:
    """torch's AllGather / ReduceScatter protocol, recording its calls' keyword arguments and allocations."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.allocated: list[tuple[tuple[int, ...], torch.dtype]] = []

    def allocate(self, size: tuple[int, ...], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        self.allocated.append((tuple(size), dtype))
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, **kwargs: Any) -> None:
        self.calls.append(kwargs)


def test_custom_all_gather_is_the_users_and_the_rest_the_runtimes() -> None:
    base, user = Recording(), UserComm()
    custom = CustomAllGather(base, user)
    out, inp = custom.gather_buffer((4,), torch.bfloat16, torch.device("cpu")), torch.zeros(2)
    assert user.allocated == [((4,), torch.bfloat16)] and out.dtype == torch.bfloat16
    custom.all_gather(out, inp, RANKS, async_op=True)
    assert [sorted(c) for c in user.calls] == [["async_op", "group", "input_tensor", "output_tensor"]]
    assert user.calls[0]["group"] is GROUP and user.calls[0]["output_tensor"] is out and user.calls[0]["async_op"]
    custom.reduce_scatter(inp, out, RANKS, async_op=True)
    custom.all_reduce(out, RANKS, async_op=False)
    custom.all_to_all(out, out, RANKS, async_op=True)
    assert base.calls == [("reduce_scatter", True), ("all_reduce", False), ("all_to_all", True)]
    assert len(user.calls) == 1 and custom.user_buffers and custom.plain() is base
    assert not custom.in_place and CustomAllGather(GlooInPlace(), user).in_place  # the reduction stays the base's


def test_custom_reduce_scatter_sums_with_the_users_buffers_never_in_place() -> None:
    base, user = Recording(), UserComm()
    custom = CustomReduceScatter(GlooInPlace(), user)
    assert not custom.in_place and custom.user_buffers  # the user's output is a buffer of its own
    buffer = custom.reduce_buffer((6,), torch.float32, torch.device("cpu"))
    assert user.allocated == [((6,), torch.float32)] and buffer.shape == (6,)
    custom.reduce_scatter(buffer[:3], buffer, RANKS, async_op=True)
    (call,) = user.calls
    assert call["op"] == torch.distributed.ReduceOp.SUM and call["group"] is GROUP and call["async_op"]
    wrapped = CustomReduceScatter(base, user)
    wrapped.all_gather(buffer, buffer[:3], RANKS, async_op=True)
    assert base.calls == [("all_gather", True)] and wrapped.plain() is base


def test_one_rank_all_gather_sends_nothing() -> None:
    output = torch.arange(3.0)
    assert Native().all_gather(output, output, Ranks(GROUP, 1, 0), async_op=True) is None  # GROUP is no group


@pytest.mark.parametrize(
    ("collective", "custom", "size", "form", "counted"),
    [
        (Native(), None, 2, NativeReduceScatter, True),
        (GlooInPlace(), None, 2, InPlaceReduce, None),
        (Native(), None, 1, InPlaceReduce, None),  # one rank keeps its input, any backend
        (GlooInPlace(), UserComm(), 2, NativeReduceScatter, False),  # the user's: never in place, not counted
    ],
)
def test_reduce_form_follows_the_collective(
    collective: Native, custom: UserComm | None, size: int, form: type, counted: bool | None
) -> None:
    chosen = choose_reduce(Ranks(GROUP, size, 0), CommPolicy(), collective, custom)
    assert type(chosen) is form
    if counted is not None:
        assert isinstance(chosen, NativeReduceScatter) and chosen.counted is counted
    if custom is not None:
        assert isinstance(chosen.collective, CustomReduceScatter) and chosen.collective.base is collective
    else:
        assert chosen.collective is collective
