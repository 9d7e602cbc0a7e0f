"""``fl.load_sharded_weights``: a tiny Hugging Face Llama saved with save_pretrained (sharded into several
safetensors files with an index) loads into a model sharded on the meta device, each of 2 gloo ranks
reading only its own rows; compared bit for bit with the full load sharded the usual way, the bytes each
rank reads counted by a wrapper around the files it opens, and bad checkpoints refused before any copy."""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _dist import cpu_mesh, spawn
from _models import tiny_llama
from torch.distributed.tensor import DTensor, Shard

import fsdp2lite as fl
import fsdp2lite.weights as weights

SHARD_SIZE = "20KB"  # the tiny Llama (about 90 KB in fp32) splits into several files


def save_checkpoints(root: Path) -> None:
    """``fp32`` and ``bf16``: one seeded tiny Llama, sharded files + index; ``tied``: tied embeddings,
    one file (save_pretrained leaves lm_head.weight out)."""
    torch.manual_seed(0)
    model = tiny_llama()
    model.save_pretrained(root / "fp32", max_shard_size=SHARD_SIZE)
    model.to(torch.bfloat16).save_pretrained(root / "bf16", max_shard_size=SHARD_SIZE)
    torch.manual_seed(1)
    tiny_llama(tied=True).save_pretrained(root / "tied")


def mlp_dim1(param: nn.Parameter) -> Shard | None:
    """The MLP's down projection (32 x 64) sharded on dim 1: a region that is columns, not rows."""
    return Shard(1) if param.shape == (32, 64) else None


def shard(model: nn.Module, placement_fn: Any = None, hsdp: bool = False) -> nn.Module:
    """Per decoder layer and the root; the final norm ignored (a plain tensor, whole on every rank).
    ``hsdp``: 2 replicas of 1 shard, placements (Replicate(), Shard(0)) on a 2D mesh."""
    mesh = fl.init_mesh(replicate=2, shard=1, device_type="cpu") if hsdp else cpu_mesh()
    for layer in model.model.layers:
        fl.fully_shard(layer, mesh, shard_placement_fn=placement_fn)
    fl.fully_shard(model, mesh, shard_placement_fn=placement_fn, ignored_params={model.model.norm.weight})
    return model


def sharded_on_meta(tied: bool = False, placement_fn: Any = None, hsdp: bool = False) -> nn.Module:
    with torch.device("meta"):
        model = tiny_llama(tied=tied)
    return shard(model, placement_fn, hsdp).to_empty(device="cpu")


def full_load_sharded(directory: Path, placement_fn: Any = None, hsdp: bool = False) -> nn.Module:
    """The usual way: every rank loads the whole model with transformers, then shards it."""
    from transformers import AutoModelForCausalLM

    return shard(AutoModelForCausalLM.from_pretrained(directory).float(), placement_fn, hsdp)


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: local(t).detach().clone() for name, t in model.state_dict().items()}


def assert_same(model: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    got = snapshot(model)
    assert got.keys() == expected.keys()
    for name in got:
        assert torch.equal(got[name], expected[name]), name


class ReadCounter:
    """Wraps the loader's safetensors handles: counts the bytes of every tensor they hand out (the only
    way file data becomes memory) and the largest one."""

    def __init__(self) -> None:
        self.total, self.largest, self.reads = 0, 0, 0

    def count(self, tensor: torch.Tensor) -> torch.Tensor:
        size = tensor.numel() * tensor.element_size()
        self.total, self.largest, self.reads = self.total + size, max(self.largest, size), self.reads + 1
        return tensor

    def wrap(self, opener: Callable[[Path], Any]) -> Callable[[Path], Any]:
        counter = self

        class Slice:
            def __init__(self, inner: Any) -> None:
                self.inner = inner

            def __getitem__(self, index: Any) -> torch.Tensor:
                return counter.count(self.inner[index])

        class Handle:
            def __init__(self, path: Path) -> None:
                self.inner = opener(path)

            def __enter__(self) -> Handle:
                self.file = self.inner.__enter__()
                return self

            def __exit__(self, *exc: Any) -> None:
                self.inner.__exit__(*exc)

            def get_tensor(self, key: str) -> torch.Tensor:
                return counter.count(self.file.get_tensor(key))

            def get_slice(self, key: str) -> Slice:
                return Slice(self.file.get_slice(key))

        return Handle


def file_bytes(directory: Path) -> tuple[int, int]:
    """(all tensor bytes in the checkpoint, the largest tensor's), from the headers."""
    sizes = []
    for path in directory.glob("*.safetensors"):
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        sizes += [e["data_offsets"][1] - e["data_offsets"][0] for k, e in header.items() if k != "__metadata__"]
    return sum(sizes), max(sizes)


# ---- the checks, one spawn -----------------------------------------------------------------------------
def check_equal_to_full_load(rank: int, ws: int, root: Path) -> None:
    for name, placement_fn, hsdp in [
        ("fp32", None, False),
        ("bf16", None, False),
        ("fp32", mlp_dim1, False),
        ("fp32", None, True),
    ]:
        model = sharded_on_meta(placement_fn=placement_fn, hsdp=hsdp)
        report = fl.load_sharded_weights(model, root / name)
        expected = full_load_sharded(root / name, placement_fn, hsdp)
        assert_same(model, snapshot(expected))
        assert report.unused == () and report.skipped == () and report.tied == ()
        assert set(report.loaded) == set(model.state_dict())
        for (_, buffer), (_, source) in zip(model.named_buffers(), expected.named_buffers()):
            buffer.copy_(source)  # rotary inv_freq: in no checkpoint (non-persistent)
        tokens = torch.arange(12).reshape(2, 6) % 96
        assert torch.equal(model(input_ids=tokens).logits, expected(input_ids=tokens).logits)
    assert len(list((root / "fp32").glob("*.safetensors"))) >= 3, "an index over several files"


def check_each_rank_reads_its_share(rank: int, ws: int, root: Path, monkeypatch: Any) -> None:
    for name in ("fp32", "bf16"):
        counter = ReadCounter()
        monkeypatch.setattr(weights, "safe_open", counter.wrap(weights.safe_open))
        model = sharded_on_meta()
        report = fl.load_sharded_weights(model, root / name)
        monkeypatch.undo()
        total, largest = file_bytes(root / name)
        element = 4 if name == "fp32" else 2
        share = sum(local(t).numel() * element for t in model.state_dict().values())
        assert counter.total == report.bytes_read == share, (counter.total, report.bytes_read, share)
        assert counter.largest == report.largest_read <= largest
        assert counter.total <= 1.1 * (total / ws + largest), (counter.total, total, largest)
        assert counter.total < total, "no rank reads the whole model"
        print(
            f"rank {rank} {name}: read {counter.total} of {total} bytes in {counter.reads} reads (share "
            f"{share}, bound {1.1 * (total / ws + largest):.0f}, largest tensor {largest})"
        )


def check_tied_and_renamed(rank: int, ws: int, root: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = sharded_on_meta(tied=True)
    report = fl.load_sharded_weights(model, root / "tied")
    assert report.tied == ("lm_head.weight",) and "model.embed_tokens.weight" in report.loaded
    assert_same(model, snapshot(shard(AutoModelForCausalLM.from_pretrained(root / "tied").float())))
    # a base LlamaModel from the CausalLM checkpoint: names without the "model." prefix; lm_head unused
    with torch.device("meta"):
        base = tiny_llama().model
    fl.fully_shard(base, cpu_mesh(), ignored_params={base.norm.weight})  # as full_load_sharded's
    base.to_empty(device="cpu")
    report = fl.load_sharded_weights(base, root / "fp32")
    assert report.unused == ("lm_head.weight",)
    expected = full_load_sharded(root / "fp32")
    assert_same(base, {k.removeprefix("model."): v for k, v in snapshot(expected).items() if k != "lm_head.weight"})


def check_transform_and_rename_hooks(rank: int, ws: int, root: Path) -> None:
    seen: dict[str, torch.Size] = {}

    def negate(name: str, rows: torch.Tensor) -> torch.Tensor | None:
        seen[name] = rows.shape
        return None if name == "model.norm.weight" else -rows  # None: the hook stored it (here: left as is)

    model = sharded_on_meta()
    with torch.no_grad():
        model.model.norm.weight.fill_(7.0)
    fl.load_sharded_weights(model, root / "fp32", transform=negate)
    expected = snapshot(full_load_sharded(root / "fp32"))
    got = snapshot(model)
    assert seen == {name: t.shape for name, t in got.items()}, "each local region once, under the model's name"
    orders: list[Any] = [None] * ws
    dist.all_gather_object(orders, list(seen))
    assert all(order == orders[0] for order in orders), "the same order on every rank: a transform may be collective"
    assert torch.equal(got["model.norm.weight"], torch.full((32,), 7.0))
    assert all(torch.equal(got[n], -expected[n]) for n in got if n != "model.norm.weight")
    # rename: None leaves a tensor alone; a name the checkpoint lacks is an error naming it
    fresh = sharded_on_meta()
    for tensor in fresh.state_dict().values():
        local(tensor).fill_(7.0)  # to_empty's memory may hold NaNs, which equal nothing
    before = snapshot(fresh)
    report = fl.load_sharded_weights(fresh, root / "fp32", rename=lambda n: None if "mlp" in n else n)
    assert len(report.skipped) == 6 and all(torch.equal(snapshot(fresh)[n], before[n]) for n in report.skipped)
    with pytest.raises(fl.CheckpointError, match=r"tensor lm_head.weight: not in the checkpoint \(looked for head\)"):
        fl.load_sharded_weights(fresh, root / "fp32", rename=lambda n: "head" if n == "lm_head.weight" else n)


def check_bad_checkpoints(rank: int, ws: int, root: Path) -> None:
    model = sharded_on_meta()
    fl.load_sharded_weights(model, root / "fp32")
    before = snapshot(model)
    for case, pattern in BAD_CASES.items():
        with pytest.raises(fl.CheckpointError) as info:
            fl.load_sharded_weights(model, root / "bad" / case)
        message = str(info.value)
        for part in pattern:
            assert part.format(dir=root / "bad" / case) in message, (case, message)
        assert_same(model, before)  # nothing half-loaded


BAD_CASES = {
    "missing-file": ["{dir}/model-00002-of-", ".safetensors: shard file missing; the index places tensors model."],
    "wrong-shape": [
        "{dir}/model.safetensors: tensor model.layers.0.mlp.up_proj.weight: shape [32, 64], ",
        "the model's model.layers.0.mlp.up_proj.weight is [64, 32]",
    ],
    "int-dtype": ["{dir}/model.safetensors: tensor model.norm.weight: dtype I64 (torch.int64) does not cast"],
    "f4-dtype": ["{dir}/model.safetensors: tensor model.norm.weight: dtype F4 cannot be loaded"],
    "unknown-dtype": ["{dir}/model.safetensors: tensor model.norm.weight: dtype Q7: not a dtype that loads"],
    "no-safetensors": ["{dir}: neither model.safetensors.index.json nor model.safetensors (found: pytorch_model.bin;"],
    "damaged": ["{dir}/model.safetensors: not a readable safetensors file"],
    "outside": ["model.safetensors.index.json: tensor lm_head.weight: shard file '../x.safetensors' is not"],
    "missing-tensor": [  # the directory named once (issue 44)
        "{dir}: cannot load into the model: tensor model.layers.1.self_attn.o_proj.weight: not in the checkpoint",
        "(looked for ",
    ],
}


def write_safetensors(path: Path, entries: dict[str, tuple[str, list[int], bytes]]) -> None:
    """A safetensors file written by hand, so a header can say what safetensors' writer never would."""
    header: dict[str, Any] = {}
    offset = 0
    for key, (dtype, shape, data) in entries.items():
        header[key] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + b"".join(e[2] for e in entries.values()))


def make_bad_checkpoints(root: Path) -> None:
    from safetensors.torch import load_file, save_file

    full = {k: v for p in sorted((root / "fp32").glob("*.safetensors")) for k, v in load_file(p).items()}
    bad = root / "bad"

    def single(case: str, state: dict[str, torch.Tensor]) -> Path:
        (bad / case).mkdir(parents=True)
        save_file(state, bad / case / "model.safetensors", metadata={"format": "pt"})
        return bad / case / "model.safetensors"

    shutil.copytree(root / "fp32", bad / "missing-file")
    next((bad / "missing-file").glob("model-00002-of-*.safetensors")).unlink()
    single("wrong-shape", {**full, "model.layers.0.mlp.up_proj.weight": torch.zeros(32, 64)})
    single("int-dtype", {**full, "model.norm.weight": torch.zeros(32, dtype=torch.int64)})
    for case, dtype, data in [("f4-dtype", "F4", bytes(16)), ("unknown-dtype", "Q7", bytes(128))]:
        entries = {k: ("F32", list(v.shape), v.numpy().tobytes()) for k, v in full.items()}
        entries["model.norm.weight"] = (dtype, [32], data)
        (bad / case).mkdir(parents=True)
        write_safetensors(bad / case / "model.safetensors", entries)
    (bad / "no-safetensors").mkdir()
    (bad / "no-safetensors" / "pytorch_model.bin").write_bytes(b"a pickle: never opened")
    (bad / "damaged").mkdir()
    (bad / "damaged" / "model.safetensors").write_bytes(b"not a safetensors file")
    shutil.copytree(root / "fp32", bad / "outside")
    index = json.loads((bad / "outside" / "model.safetensors.index.json").read_text())
    index["weight_map"]["lm_head.weight"] = "../x.safetensors"
    (bad / "outside" / "model.safetensors.index.json").write_text(json.dumps(index))
    single("missing-tensor", {k: v for k, v in full.items() if k != "model.layers.1.self_attn.o_proj.weight"})


def run_checks(rank: int, ws: int, root: str) -> None:
    torch.manual_seed(0)
    monkeypatch = pytest.MonkeyPatch()
    with torch.no_grad():
        check_equal_to_full_load(rank, ws, Path(root))
        check_each_rank_reads_its_share(rank, ws, Path(root), monkeypatch)
        check_tied_and_renamed(rank, ws, Path(root))
        check_transform_and_rename_hooks(rank, ws, Path(root))
        check_bad_checkpoints(rank, ws, Path(root))


def test_load_sharded_weights(tmp_path: Path) -> None:
    save_checkpoints(tmp_path)
    make_bad_checkpoints(tmp_path)
    spawn(run_checks, 2, str(tmp_path))


def test_peft_wrapped_model_takes_the_base_checkpoint(tmp_path: Path) -> None:
    """peft's names (``base_model.model.`` prefix, ``.base_layer.``) find the base checkpoint's tensors; the
    adapters are left alone. Naming only, so one process and an unsharded model (every tensor whole)."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    full = tiny_llama()
    full.save_pretrained(tmp_path, max_shard_size=SHARD_SIZE)
    with torch.device("meta"):
        model = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    model.to_empty(device="cpu")
    report = fl.load_sharded_weights(model, tmp_path)
    assert sorted(report.skipped) == sorted(n for n in model.state_dict() if ".lora_" in n) and len(report.skipped) == 8
    assert report.unused == () and len(report.loaded) == len(full.state_dict())
    state = model.state_dict()
    for name in report.loaded:
        base = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        assert torch.equal(state[name], full.state_dict()[base]), name
