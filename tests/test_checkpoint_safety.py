"""Checkpoints cannot run code (issue 24, part 1; [Note: safe metadata]).

A ``.metadata`` that reduces to a shell call, names a global outside DCP's own classes, is truncated, or
points a data file outside the checkpoint; and a data file whose non-tensor value reduces to a shell
call: every fsdp2lite entry point (``load_checkpoint``, ``read_metadata``, ``consolidate``, ``dcp.load``
with our reader and planner) refuses with a ``CheckpointError`` naming the checkpoint and what was
refused, the sentinel file the payload would create never appears, and the model and optimizer are
unchanged. Real checkpoints still load: fsdp2lite's and torch's ``fully_shard``'s (also in
test_checkpoint.py, 2-4 ranks), every pickle protocol, a ``Path`` checkpoint id, several dtypes and a
channels_last tensor."""

from __future__ import annotations

import collections
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import fsdp2lite as fl
from fsdp2lite.checkpoint import SafeFileSystemReader, SafeLoadPlanner, load_metadata
from fsdp2lite.cli import main

pytestmark = pytest.mark.usefixtures("single_rank_pg")


class Shell:
    """Pickles as ``os.system("touch <sentinel>")``: what a hostile checkpoint would carry."""

    def __init__(self, sentinel: Path) -> None:
        self.sentinel = sentinel

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.sentinel}",))


def _model(torch_fully_shard: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    mesh = init_device_mesh("cpu", (1,))
    if torch_fully_shard:
        from torch.distributed.fsdp import fully_shard as torch_shard

        torch_shard(model, mesh=mesh)
    else:
        fl.fully_shard(model, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def _snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    local = lambda t: (t.to_local() if isinstance(t, DTensor) else t).detach().clone()  # noqa: E731
    tensors = [local(p) for p in model.parameters()]
    for state in optimizer.state.values():
        tensors += [local(v) for v in state.values()]
    return tensors


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    model, optimizer = _model()
    fl.save_checkpoint(tmp_path / "good", model, optimizer)
    return tmp_path / "good"


def _rewrite_metadata(ckpt: Path, obj: Any) -> None:
    (ckpt / ".metadata").write_bytes(pickle.dumps(obj))


def _hostile_metadata(ckpt: Path, original: bytes, sentinel: Path) -> None:
    """The real metadata with a shell call in a field: allowed globals first, then the payload."""
    metadata = pickle.loads(original)
    metadata.planner_data = {"hook": Shell(sentinel)}
    _rewrite_metadata(ckpt, metadata)


def _every_entry_point(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> list[str]:
    """The CheckpointError message of each way fsdp2lite reads ``ckpt``, model and optimizer untouched."""
    model, optimizer = _model()
    before = _snapshot(model, optimizer)
    messages = []
    for read in (
        lambda: fl.load_checkpoint(ckpt, model, optimizer),
        lambda: fl.checkpoint.read_metadata(ckpt),
        lambda: dcp.load(
            {"model": get_model_state_dict(model)},
            storage_reader=SafeFileSystemReader(str(ckpt)),
            planner=SafeLoadPlanner(ckpt),
        ),
    ):
        with pytest.raises((fl.CheckpointError, dcp.api.CheckpointException)) as caught:
            read()
        messages.append(str(caught.value))
    assert main(["consolidate", str(ckpt), str(ckpt.parent / "out.safetensors")]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("fsdp2lite consolidate: error: "), err
    messages.append(err)
    assert not (ckpt.parent / "out.safetensors").exists()
    after = _snapshot(model, optimizer)
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "the model or optimizer changed"
    return messages


def test_a_shell_call_in_metadata_never_runs(saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sentinel = tmp_path / "PWNED"
    original = (saved / ".metadata").read_bytes()
    for write in (
        lambda: _rewrite_metadata(saved, Shell(sentinel)),
        lambda: _hostile_metadata(saved, original, sentinel),
    ):
        write()
        for message in _every_entry_point(saved, capsys):
            assert "refused to unpickle 'posix.system'" in message and str(saved) in message, message
        assert not sentinel.exists(), "the checkpoint ran code"
    # the same payload through torch's own reader does run: the hole is real, and this test would see it
    pickle.loads((saved / ".metadata").read_bytes())
    assert sentinel.exists()


def test_any_global_outside_the_list_is_refused(saved: Path, capsys: pytest.CaptureFixture[str]) -> None:
    metadata = load_metadata(saved)
    for foreign, name in (
        (collections.Counter(a=1), "collections.Counter"),  # harmless itself, still not DCP's
        (nn.Linear(2, 2), "torch.nn.modules.linear.Linear"),
        (torch.load, "torch.serialization.load"),
    ):
        metadata.planner_data = foreign
        _rewrite_metadata(saved, metadata)
        for message in _every_entry_point(saved, capsys):
            assert f"refused to unpickle {name!r}" in message, message
    # dotted names and torch attributes that are not dtypes/layouts/formats are refused by name too
    for module, attribute in (("torch", "load"), ("torch.distributed.checkpoint.metadata", "Metadata.__init__")):
        with pytest.raises(pickle.UnpicklingError, match=f"{module}.{attribute}"):
            fl.checkpoint.SafeUnpickler(__import__("io").BytesIO(b"")).find_class(module, attribute)


def test_truncated_and_misshapen_metadata(saved: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = (saved / ".metadata").read_bytes()
    (saved / ".metadata").write_bytes(data[: len(data) // 2])
    for message in _every_entry_point(saved, capsys):
        assert "the .metadata file is damaged" in message, message
    metadata = pickle.loads(data)
    index = next(iter(metadata.storage_data))
    for bad, needle in (
        ("../../etc/passwd", "is not a file name inside the checkpoint directory"),
        ("/etc/passwd", "is not a file name inside the checkpoint directory"),
    ):
        metadata.storage_data[index].relative_path = bad
        _rewrite_metadata(saved, metadata)
        for message in _every_entry_point(saved, capsys):
            assert needle in message and index.fqn in message, message
    _rewrite_metadata(saved, {"not": "metadata"})
    with pytest.raises(fl.CheckpointError, match="holds a dict, not a Metadata"):
        fl.checkpoint.read_metadata(saved)


def test_a_shell_call_in_a_non_tensor_value_never_runs(tmp_path: Path) -> None:
    """DCP reads non-tensor values (here the optimizer's lr) with torch.load(weights_only=False); ours
    first proves them plain data."""
    model, optimizer = _model()
    state: dict[str, Any] = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    sentinel = tmp_path / "PWNED"
    state["optim"]["param_groups"][0]["lr"] = Shell(sentinel)
    dcp.save(state, checkpoint_id=str(tmp_path / "ckpt"))
    fresh, fresh_optimizer = _model()
    before = _snapshot(fresh, fresh_optimizer)
    with pytest.raises(fl.CheckpointError, match=r"optim\.param_groups\.0\.lr' is not plain data"):
        fl.load_checkpoint(tmp_path / "ckpt", fresh, fresh_optimizer)
    assert not sentinel.exists()
    assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(fresh, fresh_optimizer)))
    assert fresh_optimizer.param_groups[0]["lr"] == 0.01


def test_real_checkpoints_still_load(saved: Path, tmp_path: Path) -> None:
    """fsdp2lite's and torch fully_shard's checkpoints (with optimizer), every pickle protocol, a Path
    checkpoint id, bf16/int8/channels_last tensors and plain values: loaded equal."""
    reference, reference_optimizer = _model()
    for _ in range(2):  # another state than the fresh models below
        reference(torch.randn(2, 8)).sum().backward()
        reference_optimizer.step()
    fl.save_checkpoint(tmp_path / "ours", reference, reference_optimizer)
    theirs, theirs_optimizer = _model(torch_fully_shard=True)
    theirs(torch.randn(2, 8)).sum().backward()
    theirs_optimizer.step()
    dcp.save(
        {"model": get_model_state_dict(theirs), "optim": get_optimizer_state_dict(theirs, theirs_optimizer)},
        checkpoint_id=tmp_path / "theirs",  # a Path: pathlib.PosixPath in the metadata
    )
    for ckpt, source in (("ours", reference), ("theirs", theirs)):
        model, optimizer = _model()
        fl.load_checkpoint(tmp_path / ckpt, model, optimizer)
        for mine, expected in zip(model.parameters(), source.parameters()):
            assert torch.equal(mine.full_tensor(), expected.full_tensor()), ckpt
    original = (saved / ".metadata").read_bytes()
    for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
        (saved / ".metadata").write_bytes(pickle.dumps(pickle.loads(original), protocol=protocol))
        assert load_metadata(saved).state_dict_metadata.keys() == pickle.loads(original).state_dict_metadata.keys()
    values = {
        "bf16": torch.randn(3, 5).bfloat16(),
        "int8": torch.arange(-4, 4, dtype=torch.int8),
        "nhwc": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
        "step": 7,
        "name": "run-1",
        "betas": (0.9, 0.95),
    }
    dcp.save({"extra": values}, checkpoint_id=tmp_path / "values")
    loaded = {"extra": {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in values.items()}}
    dcp.load(loaded, storage_reader=SafeFileSystemReader(str(tmp_path / "values")), planner=SafeLoadPlanner("values"))
    for key, value in values.items():
        got = loaded["extra"][key]
        assert torch.equal(got, value) if isinstance(value, torch.Tensor) else got == value, key
