"""``fsdp2lite consolidate``: a real 2-rank sharded DCP checkpoint into one .pt / .safetensors file,
compared bitwise with the tensors that were saved; casts, prefixes, and bad input (exit 1, one line)."""

from __future__ import annotations

import json
import shutil
import struct
import warnings
import weakref
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _dist import spawn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from fsdp2lite.checkpoint.consolidate import TensorEntry, write_output
from fsdp2lite.cli import main

_ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I64": torch.int64}


def original_model_state() -> dict[str, torch.Tensor]:
    """A small model's state: uneven first dims (37 rows over 2 ranks: 19 + 18), bf16, an int64 buffer."""
    gen = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(37, 16, generator=gen),
        "layers.0.weight": torch.randn(24, 37, generator=gen),
        "layers.0.bias": torch.randn(24, generator=gen),
        "layers.1.weight": torch.randn(5, 24, generator=gen).to(torch.bfloat16),
        "layers.1.bias": torch.randn(1, generator=gen),  # fewer rows than ranks: rank 1's shard is empty
        "head.scale": torch.randn((), generator=gen),  # 0-dim
        "positions": torch.arange(11, dtype=torch.int64) * 3,  # a buffer
        "sharded_ids": torch.randint(0, 1000, (9, 2), generator=gen),  # an int64 DTensor
    }


def _placements(name: str, tensor: torch.Tensor) -> list[Shard | Replicate]:
    return [Replicate()] if tensor.dim() == 0 or name == "positions" else [Shard(0)]


def save_checkpoints(rank: int, world_size: int, root: str) -> None:
    """Two checkpoints: ``model`` ({"model": ..., "step": 7}) and ``mixed`` (also an "extra" tensor)."""
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("shard",))
    model = {
        name: distribute_tensor(tensor, mesh, _placements(name, tensor))
        for name, tensor in original_model_state().items()
    }
    dcp.save({"model": model, "step": 7}, checkpoint_id=f"{root}/model")
    extra = {"t": distribute_tensor(torch.arange(6.0).reshape(3, 2), mesh, [Shard(0)])}
    dcp.save({"model": model, "extra": extra}, checkpoint_id=f"{root}/mixed")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dcp")
    spawn(save_checkpoints, 2, str(root))
    return root


def read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """A minimal reader that also checks the layout: contiguous data_offsets and a padded header."""
    raw = path.read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    assert header_len % 8 == 0
    header = json.loads(raw[8 : 8 + header_len])
    metadata = header.pop("__metadata__")
    data = raw[8 + header_len :]
    tensors, end = {}, 0
    for name, info in header.items():  # written in data order
        begin, stop = info["data_offsets"]
        assert begin == end, f"{name}: gap or overlap at {begin}, expected {end}"
        dtype = _ST_DTYPES[info["dtype"]]
        assert begin % dtype.itemsize == 0, f"{name}: unaligned at {begin}"
        flat = torch.frombuffer(bytearray(data[begin:stop]), dtype=torch.uint8).view(dtype)
        tensors[name], end = flat.reshape(info["shape"]), stop
    assert end == len(data)
    return tensors, metadata


def assert_same(loaded: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(loaded) == sorted(expected)
    for name, tensor in expected.items():
        assert loaded[name].dtype == tensor.dtype, name
        assert loaded[name].shape == tensor.shape, name
        assert torch.equal(loaded[name], tensor), name


def test_pt_equals_saved_tensors(checkpoints: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "model.pt"
    assert main(["consolidate", str(checkpoints / "model"), str(out)]) == 0
    stdout = capsys.readouterr().out
    assert "skipped 1 non-tensor entries" in stdout and "prefix 'model.' stripped" in stdout
    assert "wrote 8 tensors" in stdout and "peak RSS" in stdout
    loaded = torch.load(out, weights_only=True)
    assert type(loaded) is dict
    metadata = FileSystemReader(checkpoints / "model").read_metadata()
    tensor_keys = [key for key, md in metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)]
    assert [f"model.{name}" for name in loaded] == tensor_keys  # metadata order, not necessarily the saved one
    assert_same(loaded, original_model_state())
    assert_same(torch.load(out, weights_only=True, mmap=True), original_model_state())
    assert not out.with_name("model.pt.partial").exists()


def test_pt_records_are_64_byte_aligned(checkpoints: Path, tmp_path: Path) -> None:
    out = tmp_path / "model.pt"
    assert main(["consolidate", str(checkpoints / "model"), str(out)]) == 0
    raw = out.read_bytes()
    with zipfile.ZipFile(out) as zf:
        infos = zf.infolist()
        assert infos[0].filename == "archive/data.pkl"  # torch takes the archive name from the first record
        for info in infos:
            if info.filename.startswith("archive/data/"):
                name_len, extra_len = struct.unpack("<HH", raw[info.header_offset + 26 : info.header_offset + 30])
                assert (info.header_offset + 30 + name_len + extra_len) % 64 == 0, info.filename


def test_pt_is_deterministic(checkpoints: Path, tmp_path: Path) -> None:
    first, second = tmp_path / "a.pt", tmp_path / "b.pt"
    assert main(["consolidate", str(checkpoints / "model"), str(first)]) == 0
    assert main(["consolidate", str(checkpoints / "model"), str(second)]) == 0
    assert first.read_bytes() == second.read_bytes()


def test_safetensors_equals_saved_tensors(checkpoints: Path, tmp_path: Path) -> None:
    out = tmp_path / "model.safetensors"  # format from the suffix
    assert main(["consolidate", str(checkpoints / "model"), str(out)]) == 0
    loaded, metadata = read_safetensors(out)
    assert metadata == {"format": "pt"}
    assert_same(loaded, original_model_state())


def test_safetensors_library_reads_it(checkpoints: Path, tmp_path: Path) -> None:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    out = tmp_path / "model.bin"
    assert main(["consolidate", str(checkpoints / "model"), str(out), "--format", "safetensors"]) == 0
    assert_same(safetensors_torch.load_file(str(out)), original_model_state())


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_dtype_casts_floating_tensors_only(checkpoints: Path, tmp_path: Path, fmt: str) -> None:
    out = tmp_path / f"model.{fmt}"
    assert main(["consolidate", str(checkpoints / "model"), str(out), "--dtype", "bf16"]) == 0
    loaded = torch.load(out, weights_only=True) if fmt == "pt" else read_safetensors(out)[0]
    expected = {
        name: tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
        for name, tensor in original_model_state().items()
    }
    assert_same(loaded, expected)
    assert loaded["positions"].dtype == torch.int64


def test_prefix_default_keeps_all_when_keys_differ(checkpoints: Path, tmp_path: Path) -> None:
    out = tmp_path / "all.pt"
    assert main(["consolidate", str(checkpoints / "mixed"), str(out)]) == 0
    loaded = torch.load(out, weights_only=True)
    expected = {f"model.{name}": tensor for name, tensor in original_model_state().items()}
    expected["extra.t"] = torch.arange(6.0).reshape(3, 2)
    assert_same(loaded, expected)

    out = tmp_path / "extra.pt"
    assert main(["consolidate", str(checkpoints / "mixed"), str(out), "--prefix", "extra."]) == 0
    assert_same(torch.load(out, weights_only=True), {"t": torch.arange(6.0).reshape(3, 2)})


def _fails(argv: list[str], capsys: pytest.CaptureFixture[str], *needles: str) -> str:
    assert main(["consolidate", *argv]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("fsdp2lite consolidate: error: "), err
    for needle in needles:
        assert needle in err, err
    return err


def test_errors_exit_1_with_one_line(checkpoints: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out.pt"
    missing = tmp_path / "nope"
    _fails([str(missing), str(out)], capsys, str(missing), "no such checkpoint directory")
    empty = tmp_path / "empty"
    empty.mkdir()
    _fails([str(empty), str(out)], capsys, str(empty), "no .metadata")
    _fails([str(checkpoints / "model"), str(out), "--prefix", "optim."], capsys, "no tensor key starts with 'optim.'")

    out.write_bytes(b"keep me")
    _fails([str(checkpoints / "model"), str(out)], capsys, str(out), "--force")
    assert out.read_bytes() == b"keep me"
    assert main(["consolidate", str(checkpoints / "model"), str(out), "--force"]) == 0
    assert_same(torch.load(out, weights_only=True), original_model_state())


def test_damaged_checkpoints_exit_1(checkpoints: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out.pt"
    truncated = tmp_path / "truncated"
    shutil.copytree(checkpoints / "model", truncated)
    data_file = sorted(truncated.glob("*.distcp"))[-1]
    data_file.write_bytes(data_file.read_bytes()[:100])
    _fails([str(truncated), str(out)], capsys, str(data_file), "truncated")

    corrupt = tmp_path / "corrupt"
    shutil.copytree(checkpoints / "model", corrupt)
    data_file = sorted(corrupt.glob("*.distcp"))[0]
    raw = bytearray(data_file.read_bytes())
    raw[: len(raw) // 2] = bytes(len(raw) // 2)  # same length: only reading the data finds it
    data_file.write_bytes(bytes(raw))
    _fails([str(corrupt), str(out)], capsys, str(corrupt), "cannot read tensor")
    assert not out.exists() and not out.with_name("out.pt.partial").exists()

    (corrupt / ".metadata").write_bytes(b"not a pickle")
    _fails([str(corrupt), str(out)], capsys, ".metadata", "damaged")


def every_dtype_state() -> dict[str, torch.Tensor]:
    """One tensor per supported dtype, including those torch pickles without a typed storage class."""
    values = torch.linspace(-3, 3, 12).reshape(3, 4)
    state = {str(dtype).removeprefix("torch."): values.to(dtype) for dtype in (torch.float64, torch.float16)}
    state |= {str(dtype).removeprefix("torch."): values.to(dtype) for dtype in (torch.float8_e4m3fn, torch.float8_e5m2)}
    for dtype in (torch.int32, torch.int16, torch.int8, torch.uint8, torch.uint16, torch.uint32, torch.uint64):
        state[str(dtype).removeprefix("torch.")] = (torch.arange(12) * 7 % 100).reshape(3, 4).to(dtype)
    state["bool"] = values > 0
    state["complex64"] = torch.complex(values, -values)
    state["empty"] = torch.empty(0, 5)
    return state


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_every_dtype_round_trips(tmp_path: Path, fmt: str) -> None:
    """Saved from this process alone (DCP needs no process group to save either)."""
    state = every_dtype_state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to save in a single process"
        dcp.save({"model": state}, checkpoint_id=tmp_path / "ckpt")
    out = tmp_path / f"out.{fmt}"
    assert main(["consolidate", str(tmp_path / "ckpt"), str(out), "--format", fmt]) == 0
    if fmt == "pt":
        assert_same(torch.load(out, weights_only=True), state)
        assert_same(torch.load(out, weights_only=True, mmap=True), state)
    else:
        safetensors_torch = pytest.importorskip("safetensors.torch")
        assert_same(safetensors_torch.load_file(str(out)), state)


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_writers_hold_one_tensor_at_a_time(tmp_path: Path, fmt: str) -> None:
    """[Note: one tensor at a time]: when the next tensor is loaded, no earlier one is referenced."""
    entries = [TensorEntry(f"k{i}", f"t{i}", (64, 3), torch.float32, torch.float32) for i in range(4)]
    handed_out: list[weakref.ref[torch.Tensor]] = []

    def load(entry: TensorEntry) -> torch.Tensor:
        assert all(ref() is None for ref in handed_out), f"an earlier tensor is alive when loading {entry.key}"
        tensor = torch.full(entry.shape, float(len(handed_out)))
        handed_out.append(weakref.ref(tensor))
        return tensor

    out = tmp_path / f"out.{fmt}"
    write_output(out, fmt, entries, load)
    loaded = torch.load(out, weights_only=True) if fmt == "pt" else read_safetensors(out)[0]
    assert_same(loaded, {f"t{i}": torch.full((64, 3), float(i)) for i in range(4)})
