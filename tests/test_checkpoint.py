"""Checkpoints: DCP save/load across world sizes and meshes, both ways with torch's fully_shard, the
state_dict helpers (full, CPU-offloaded, broadcast from rank 0), bitwise resume, and bad checkpoints."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _dist import spawn
from _models import TINY_GPT, gpt_batch, gpt_loss
from _parity import torch_shard
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import fsdp2lite as fl
from fsdp2lite.models import GPT


def ours(seed: int, mesh: object = None) -> GPT:
    torch.manual_seed(seed)
    model = GPT(TINY_GPT)
    for block in model.blocks:
        fl.fully_shard(block, mesh)  # type: ignore[arg-type]
    fl.fully_shard(model, mesh)  # type: ignore[arg-type]
    return model


def theirs(seed: int) -> GPT:
    torch.manual_seed(seed)
    return torch_shard(GPT(TINY_GPT))  # type: ignore[return-value]


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}


def full_tensor(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


def assert_same(model: torch.nn.Module, reference: dict[str, torch.Tensor], what: str) -> None:
    got = full_params(model)
    assert list(got) == list(reference), what
    for key, value in reference.items():
        assert torch.equal(got[key], value), f"{what}: {key}: max diff {(got[key].float() - value.float()).abs().max()}"


# ---- world size 2: write checkpoints, state_dict helpers, resume, bad input ----------------------
def write_checkpoints(rank: int, ws: int, root: str) -> None:
    model = ours(seed=0)
    fl.save_checkpoint(Path(root) / "ours", model)
    dcp.save({"model": get_model_state_dict(theirs(seed=1))}, checkpoint_id=str(Path(root) / "theirs"))
    reference = {"ours": full_params(model), "theirs": full_params(theirs(seed=1))}
    if rank == 0:
        torch.save(reference, Path(root) / "reference.pt")


def check_state_dict_helpers(rank: int, ws: int) -> None:
    model = ours(seed=0)
    reference = full_params(model)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        assert list(full) == list(reference)
        assert all(type(v) is torch.Tensor and v.device.type == "cpu" for v in full.values())
        assert all(torch.equal(full[k], reference[k]) for k in reference)
    else:
        assert full == {}, "cpu_offload full state dicts live on rank 0 only"
    fresh = ours(seed=5)
    set_model_state_dict(fresh, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    assert_same(fresh, reference, "broadcast_from_rank0")
    # optimizer state, full and back
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gpt_loss(model, gpt_batch(0, rank)).backward()
    opt.step()
    opt.zero_grad()
    osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    set_model_state_dict(fresh, get_model_state_dict(model))
    set_optimizer_state_dict(fresh, fresh_opt, osd, options=StateDictOptions(full_state_dict=True))
    # compare the loaded state itself: stepping after a full-state load diverges in torch's helper for
    # torch's own fully_shard models too (the resume test below covers stepping, through DCP)
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        for key, value in opt.state[p].items():
            loaded = fresh_opt.state[q][key]
            assert torch.equal(full_tensor(loaded), full_tensor(value)), f"{name} {key}"


def check_resume_bitwise(rank: int, ws: int, root: str) -> None:
    def make(seed: int) -> tuple[GPT, torch.optim.Optimizer]:
        model = ours(seed)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)

    def train(model: GPT, opt: torch.optim.Optimizer, steps: range) -> None:
        for step in steps:
            gpt_loss(model, gpt_batch(step, rank)).backward()
            opt.step()
            opt.zero_grad()

    straight, straight_opt = make(0)
    train(straight, straight_opt, range(4))
    first, first_opt = make(0)
    train(first, first_opt, range(2))
    fl.save_checkpoint(Path(root) / "resume", first, first_opt)
    resumed, resumed_opt = make(7)  # fresh objects, other values
    fl.load_checkpoint(Path(root) / "resume", resumed, resumed_opt)
    train(resumed, resumed_opt, range(2, 4))
    for (name, a), b in zip(straight.named_parameters(), resumed.parameters()):
        assert torch.equal(a.to_local(), b.to_local()), f"resume differs at {name}"


def check_bad_checkpoints(rank: int, ws: int, root: str) -> None:
    path = Path(root) / "ours"
    wider = GPT(TINY_GPT.__class__(**{**TINY_GPT.__dict__, "d_model": 32}))
    fl.fully_shard(wider)
    with pytest.raises(fl.CheckpointError, match=r"tok_emb.weight: shape \(61, 16\) in the checkpoint, \(61, 32\)"):
        fl.load_checkpoint(path, wider)
    deeper = GPT(TINY_GPT.__class__(**{**TINY_GPT.__dict__, "n_layers": 3}))
    fl.fully_shard(deeper)
    with pytest.raises(fl.CheckpointError, match=r"missing in the checkpoint: model.blocks.2.attn.proj.bias"):
        fl.load_checkpoint(path, deeper)
    shallower = GPT(TINY_GPT.__class__(**{**TINY_GPT.__dict__, "n_layers": 1}))
    fl.fully_shard(shallower)
    with pytest.raises(fl.CheckpointError, match=r"not in the model: model.blocks.1.attn.proj.bias"):
        fl.load_checkpoint(path, shallower)
    with pytest.raises(fl.CheckpointError, match="no .metadata file"):
        fl.load_checkpoint(Path(root), ours(0))
    dist.barrier()
    if rank == 0:  # damage a copy: every rank must get the error, none may hang
        damaged = Path(root) / "damaged"
        damaged.mkdir()
        for file in path.iterdir():
            data = file.read_bytes()
            (damaged / file.name).write_bytes(data[: len(data) // 2] if file.suffix == ".distcp" else data)
    dist.barrier()
    with pytest.raises(fl.CheckpointError, match=r"data file __0_0.distcp is truncated"):
        fl.load_checkpoint(Path(root) / "damaged", ours(0))


def run_two(rank: int, ws: int, root: str) -> None:
    write_checkpoints(rank, ws, root)
    for check in (check_state_dict_helpers,):
        check(rank, ws)
    dist.barrier()
    check_resume_bitwise(rank, ws, root)
    dist.barrier()
    check_bad_checkpoints(rank, ws, root)


# ---- world sizes 3 and 4: load what 2 ranks wrote -----------------------------------------------
def run_reshard(rank: int, ws: int, root: str) -> None:
    reference = torch.load(Path(root) / "reference.pt")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) if ws == 4 else None
    model = ours(seed=3, mesh=mesh)
    fl.load_checkpoint(Path(root) / "ours", model)
    assert_same(model, reference["ours"], f"fsdp2lite 2 ranks -> fsdp2lite {ws} ranks")
    from_torch = ours(seed=4, mesh=mesh)
    fl.load_checkpoint(Path(root) / "theirs", from_torch)
    assert_same(from_torch, reference["theirs"], f"torch fully_shard 2 ranks -> fsdp2lite {ws} ranks")
    if ws == 3:
        torch_model = theirs(seed=5)
        state = {"model": get_model_state_dict(torch_model)}
        dcp.load(state, checkpoint_id=str(Path(root) / "ours"))
        set_model_state_dict(torch_model, state["model"])
        assert_same(torch_model, reference["ours"], "fsdp2lite 2 ranks -> torch fully_shard 3 ranks")
        gpt_loss(model, gpt_batch(0, rank)).backward()  # the loaded model trains


def test_checkpoints(tmp_path: Path) -> None:
    spawn(run_two, 2, str(tmp_path))
    assert (tmp_path / "ours" / ".metadata").exists()
    spawn(run_reshard, 3, str(tmp_path))
    spawn(run_reshard, 4, str(tmp_path))


def test_not_a_directory(tmp_path: Path) -> None:
    with pytest.raises(fl.CheckpointError, match="not a directory"):
        fl.checkpoint.read_metadata(tmp_path / "nowhere")
    os.makedirs(tmp_path / "empty")
    with pytest.raises(fl.CheckpointError, match="no .metadata file"):
        fl.checkpoint.read_metadata(tmp_path / "empty")
