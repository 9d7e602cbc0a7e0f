"""``fsdp2lite consolidate``: a torch.distributed.checkpoint (DCP) directory into one file, no process group.

    fsdp2lite consolidate CKPT_DIR OUT [--format pt|safetensors] [--dtype bf16|fp16|fp32] [--prefix PREFIX]

A DCP checkpoint saved from any number of ranks (sharded DTensors, replicated tensors, non-tensor
values) becomes one ``torch.load``-able ``.pt`` file or one ``.safetensors`` file of full tensors:

1. read ``.metadata`` once, without running code from it (a checkpoint someone shared is safe:
   [Note: safe metadata]);
2. plan: the tensor keys in metadata order (non-tensor entries skipped and counted), the output names
   (prefix stripped), shapes and output dtypes: everything a file header needs, before any data;
3. check that every data file the plan reads exists and is long enough, so a damaged checkpoint
   fails before anything is written;
4. stream: per tensor, allocate the full tensor, fill it from its shards with ``dcp.load`` on that key
   alone, cast, write its bytes, drop it (see [Note: one tensor at a time]).

The output is written to ``OUT.partial`` and renamed to ``OUT`` when complete.

[Note: one tensor at a time]
Peak memory over the interpreter's baseline is one full tensor, plus the shard DCP reads whole before
copying it in, plus the cast copy with ``--dtype``: never the model. Measured with 2 ranks' shards
(benchmarks/consolidate_memory.py): +1.6x the largest tensor, with or without a cast. The
writers pass ``load(entry)`` straight into the call that writes it and keep no name for it, so the
tensor is freed before the next one is loaded. A ``for tensor in tensors`` loop, a ``zip`` or an
``enumerate`` over a generator would each still hold the previous tensor while the next one loads.
"""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import resource
import struct
import sys
import time
import warnings
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from .errors import CheckpointError
from .safe import SafeFileSystemReader, SafeLoadPlanner, load_metadata

FORMATS = ("pt", "safetensors")
CAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DEFAULT_PREFIX = "model."  # stripped when every tensor key has it: {"model": model.state_dict()}


class _DtypeNames(NamedTuple):
    safetensors: str  # the header's "dtype"
    storage: str | None  # torch's typed storage class in a .pt pickle; None: UntypedStorage + dtype


_DTYPES: dict[torch.dtype, _DtypeNames] = {
    torch.float64: _DtypeNames("F64", "DoubleStorage"),
    torch.float32: _DtypeNames("F32", "FloatStorage"),
    torch.float16: _DtypeNames("F16", "HalfStorage"),
    torch.bfloat16: _DtypeNames("BF16", "BFloat16Storage"),
    torch.float8_e4m3fn: _DtypeNames("F8_E4M3", None),
    torch.float8_e5m2: _DtypeNames("F8_E5M2", None),
    torch.int64: _DtypeNames("I64", "LongStorage"),
    torch.int32: _DtypeNames("I32", "IntStorage"),
    torch.int16: _DtypeNames("I16", "ShortStorage"),
    torch.int8: _DtypeNames("I8", "CharStorage"),
    torch.uint8: _DtypeNames("U8", "ByteStorage"),
    torch.uint16: _DtypeNames("U16", None),
    torch.uint32: _DtypeNames("U32", None),
    torch.uint64: _DtypeNames("U64", None),
    torch.bool: _DtypeNames("BOOL", "BoolStorage"),
    torch.complex64: _DtypeNames("C64", "ComplexFloatStorage"),
}


# ---- phase 2: the plan --------------------------------------------------------------------------
class TensorEntry(NamedTuple):
    """One tensor to write: where it is in the checkpoint and what it becomes in the output."""

    key: str  # key in the checkpoint: "model.layers.0.weight"
    name: str  # key in the output: ``key`` without the prefix
    shape: tuple[int, ...]  # the full (unsharded) shape
    stored_dtype: torch.dtype  # dtype in the checkpoint
    dtype: torch.dtype  # dtype in the output: ``stored_dtype`` unless --dtype casts it

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class Plan(NamedTuple):
    """The tensors to write, in order, and what was left out."""

    entries: list[TensorEntry]
    prefix: str  # stripped from every kept key; "" when none
    skipped: int  # non-tensor entries: ints, strings, pickled objects (BytesStorageMetadata)
    dropped: int  # tensor entries without the prefix


class ConsolidateResult(NamedTuple):
    path: Path
    plan: Plan
    nbytes: int  # tensor bytes written; the file adds its headers
    seconds: float
    peak_rss: int  # bytes: this process's peak resident memory (ru_maxrss)


def choose_prefix(keys: Sequence[str], prefix: str | None) -> str:
    """The prefix to keep and strip: ``prefix`` if given, else "model." when every key has it, else ""."""
    if prefix is not None:
        return prefix
    return DEFAULT_PREFIX if all(key.startswith(DEFAULT_PREFIX) for key in keys) else ""


def plan_tensors(ckpt_dir: Path, metadata: Metadata, prefix: str | None, cast_to: torch.dtype | None) -> Plan:
    """Every tensor key with ``prefix`` in metadata order, its output name, shape and dtype."""
    items = [(key, md) for key, md in metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)]
    if not items:
        raise CheckpointError(f"{ckpt_dir}: the checkpoint holds no tensors")
    chosen = choose_prefix([key for key, _ in items], prefix)
    kept = [(key, md) for key, md in items if key.startswith(chosen) and len(key) > len(chosen)]
    if not kept:
        examples = ", ".join(repr(key) for key, _ in items[:3])
        raise CheckpointError(f"{ckpt_dir}: no tensor key starts with {chosen!r} (keys look like {examples})")
    entries = [_plan_entry(ckpt_dir, key, key[len(chosen) :], md, cast_to) for key, md in kept]
    skipped = len(metadata.state_dict_metadata) - len(items)
    return Plan(entries=entries, prefix=chosen, skipped=skipped, dropped=len(items) - len(kept))


def _plan_entry(
    ckpt_dir: Path, key: str, name: str, md: TensorStorageMetadata, cast_to: torch.dtype | None
) -> TensorEntry:
    stored_dtype = md.properties.dtype
    dtype = cast_to if cast_to is not None and stored_dtype.is_floating_point else stored_dtype
    if dtype not in _DTYPES:
        supported = ", ".join(str(d).removeprefix("torch.") for d in _DTYPES)
        raise CheckpointError(f"{ckpt_dir}: tensor {key!r} has dtype {dtype}; supported: {supported}")
    shape = tuple(md.size)
    # identical chunks counted once: replicated tensors saved without de-duplication repeat them
    covered = sum(math.prod(sizes) for _, sizes in {(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks})
    if covered < math.prod(shape):  # torch.empty would keep uninitialised elements
        raise CheckpointError(
            f"{ckpt_dir}: tensor {key!r} of shape {list(shape)} has {math.prod(shape):,} elements "
            f"but its saved chunks hold {covered:,}"
        )
    return TensorEntry(key=key, name=name, shape=shape, stored_dtype=stored_dtype, dtype=dtype)


# ---- phases 1 and 3: metadata and data files ----------------------------------------------------
def read_metadata(ckpt_dir: Path) -> Metadata:
    if not ckpt_dir.exists():
        raise CheckpointError(f"{ckpt_dir}: no such checkpoint directory")
    if not ckpt_dir.is_dir():
        raise CheckpointError(f"{ckpt_dir}: not a directory (a DCP checkpoint is a directory with a .metadata file)")
    if not (ckpt_dir / ".metadata").is_file():
        raise CheckpointError(f"{ckpt_dir}: no .metadata file, not a torch.distributed.checkpoint directory")
    return load_metadata(ckpt_dir)  # refuses foreign pickle and damaged files: [Note: safe metadata]


def check_data_files(ckpt_dir: Path, metadata: Metadata, plan: Plan) -> None:
    """Every data file the plan reads exists and is as long as ``.metadata`` says."""
    keys = {entry.key for entry in plan.entries}
    needed: dict[str, int] = {}  # relative path -> end of the last byte range read from it
    for index, info in metadata.storage_data.items():
        if index.fqn in keys:
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for relative_path, end in sorted(needed.items()):
        path = ckpt_dir / relative_path
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"{path}: data file missing (named in {ckpt_dir / '.metadata'})") from None
        if size < end:
            raise CheckpointError(f"{path}: truncated, {size:,} bytes but .metadata needs {end:,}")


def check_output(out: Path, force: bool) -> None:
    if out.is_dir():
        raise CheckpointError(f"{out}: is a directory; OUT is the output file")
    if out.exists() and not force:
        raise CheckpointError(f"{out}: exists; pass --force to overwrite it")
    if not out.parent.is_dir():
        raise CheckpointError(f"{out.parent}: no such directory for OUT")


# ---- phase 4: stream ----------------------------------------------------------------------------
Load = Callable[[TensorEntry], torch.Tensor]


def tensor_loader(ckpt_dir: Path, metadata: Metadata) -> Load:
    """``load(entry)``: the full tensor ``entry.key`` read from every shard, cast to ``entry.dtype``."""
    # the metadata read once: dcp.load reads it on every call, and .metadata of many ranks' shards can be
    # megabytes, read once per tensor
    reader = SafeFileSystemReader(ckpt_dir, metadata)

    def load(entry: TensorEntry) -> torch.Tensor:
        full_tensor = torch.empty(entry.shape, dtype=entry.stored_dtype)  # every saved chunk is copied in
        # flatten_state_dict=False: the key is already the flat metadata key; strict (the default):
        # a key that does not match fails instead of leaving the tensor uninitialised
        planner = SafeLoadPlanner(ckpt_dir, flatten_state_dict=False)
        try:
            with warnings.catch_warnings():
                # no process group is the point: dcp.load warns that it assumes a single process
                warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled", category=UserWarning)
                dcp.load({entry.key: full_tensor}, storage_reader=reader, planner=planner, no_dist=True)
        except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
            files = sorted(
                {info.relative_path for index, info in metadata.storage_data.items() if index.fqn == entry.key}
            )
            raise CheckpointError(
                f"{ckpt_dir}: cannot read tensor {entry.key!r} from {', '.join(files)}: {_one_line(exc)}"
            ) from None
        return full_tensor if entry.dtype == entry.stored_dtype else full_tensor.to(entry.dtype)

    return load


def _one_line(exc: BaseException) -> str:
    """``Type: first sentence``: torch's messages go on with advice that does not fit a damaged file."""
    if isinstance(exc, CheckpointException) and exc.failures:
        exc = next(iter(exc.failures.values()))[0]  # {rank: (exception, traceback)}
    first_line = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first_line.split('. ', 1)[0]}"


_WRITE_CHUNK = 64 * 2**20  # bytes per write() call: bounded calls, no copies


def _tensor_bytes(tensor: torch.Tensor, entry: TensorEntry) -> memoryview:
    """The tensor's bytes (native order), no copy when it is contiguous; numpy has no bfloat16, uint8 works."""
    flat = tensor.contiguous().reshape(-1)  # reshape: view() to a narrower dtype refuses 0-dim tensors
    data = flat.view(torch.uint8).numpy().data  # a memoryview of the tensor's memory
    if len(data) != entry.nbytes:
        raise RuntimeError(f"tensor {entry.key!r}: {len(data)} bytes, expected {entry.nbytes}")
    return data


def _write_chunks(out: Any, data: memoryview) -> None:
    for start in range(0, len(data), _WRITE_CHUNK):
        out.write(data[start : start + _WRITE_CHUNK])


# ---- safetensors --------------------------------------------------------------------------------
def safetensors_order(entries: Sequence[TensorEntry]) -> list[TensorEntry]:
    """Wider dtypes first (stable): after the 8-aligned header every tensor starts at a multiple of its
    element size, as the safetensors library lays files out."""
    return sorted(entries, key=lambda entry: -entry.dtype.itemsize)


def safetensors_header(entries: Sequence[TensorEntry]) -> bytes:
    """8-byte little-endian length, then the JSON header padded with spaces to a multiple of 8."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    begin = 0
    for entry in entries:
        if entry.name in header:
            raise CheckpointError(f"tensor {entry.key!r}: the name {entry.name!r} is reserved in safetensors")
        header[entry.name] = {
            "dtype": _DTYPES[entry.dtype].safetensors,
            "shape": list(entry.shape),
            "data_offsets": [begin, begin + entry.nbytes],
        }
        begin += entry.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_safetensors(out: BinaryIO, entries: Sequence[TensorEntry], load: Load) -> None:
    if sys.byteorder != "little":
        raise CheckpointError("safetensors is little-endian; writing it on a big-endian host is not supported")
    out.write(safetensors_header(entries))
    for entry in entries:
        _write_chunks(out, _tensor_bytes(load(entry), entry))  # [Note: one tensor at a time]


# ---- torch's zip format -------------------------------------------------------------------------
# [Note: torch zip layout]
# What torch.load(weights_only=True) reads, as torch.save writes it, record by record (ZIP_STORED):
#   archive/data.pkl   pickle (protocol 2) of {name: tensor}, each tensor
#                      _rebuild_tensor_v2(pid, 0, shape, stride, False, OrderedDict()) with the
#                      persistent id pid = ("storage", torch.FloatStorage, "<i>", "cpu", numel);
#                      dtypes without a typed storage class (float8, uint16..64) are
#                      _rebuild_tensor_v3(pid, ..., dtype) with torch.UntypedStorage and numel in bytes
#   archive/byteorder  sys.byteorder: "little" (the bytes are written in native order)
#   archive/data/<i>   tensor i's bytes, starting at a multiple of 64 in the file (padding in the local
#                      header's extra field, as torch's writer pads) so torch.load(mmap=True) maps
#                      aligned storages
#   archive/version    "3\n"
# data.pkl goes first: torch's reader takes the archive name from the first record. Not written:
# .format_version (it makes torch.load(mmap=True) compute record offsets for torch's own writer's
# layout; without it each offset is read from the record's local header, right for any writer),
# .storage_alignment (read only with .format_version), .data/serialization_id (only logged).
_ARCHIVE = "archive"
_ZIP_DATE = (1980, 1, 1, 0, 0, 0)  # fixed: the same checkpoint gives the same bytes
_ALIGNMENT = 64
_PADDING_ID = 0x4246  # "FB", torch's padding extra field; zip readers skip unknown fields
_LOCAL_HEADER = 30  # bytes of a zip local file header before the file name
_ZIP64_EXTRA = 20  # the zip64 extra field zipfile adds to the local header under force_zip64


@dataclass(frozen=True)
class _StorageRef:
    """Pickled as a persistent id: torch.load reads the storage from ``archive/data/<key>``."""

    storage_type: type
    key: str
    numel: int  # elements of the typed storage; bytes of an UntypedStorage


class _TensorStub:
    """Pickles as torch.save pickles a contiguous CPU tensor of ``entry``'s shape and dtype; holds no data."""

    def __init__(self, entry: TensorEntry, key: str) -> None:
        self.entry = entry
        self.key = key

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        shape, dtype = self.entry.shape, self.entry.dtype
        stride = tuple(math.prod(shape[dim + 1 :]) for dim in range(len(shape)))  # contiguous
        storage_name = _DTYPES[dtype].storage
        if storage_name is not None:
            storage = _StorageRef(getattr(torch, storage_name), self.key, math.prod(shape))
            return torch._utils._rebuild_tensor_v2, (storage, 0, shape, stride, False, OrderedDict())
        storage = _StorageRef(torch.UntypedStorage, self.key, self.entry.nbytes)
        return torch._utils._rebuild_tensor_v3, (storage, 0, shape, stride, False, OrderedDict(), dtype)


class _IndexPickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageRef):
            return ("storage", obj.storage_type, obj.key, "cpu", obj.numel)
        return None


def torch_index_pickle(entries: Sequence[TensorEntry]) -> bytes:
    """``archive/data.pkl``: the dict of tensors, every storage a reference to ``archive/data/<i>``."""
    buffer = io.BytesIO()
    _IndexPickler(buffer, protocol=2).dump({entry.name: _TensorStub(entry, str(i)) for i, entry in enumerate(entries)})
    return buffer.getvalue()


def _zip_info(name: str) -> zipfile.ZipInfo:
    return zipfile.ZipInfo(f"{_ARCHIVE}/{name}", date_time=_ZIP_DATE)  # ZIP_STORED by default


def _write_aligned_record(zf: zipfile.ZipFile, out: BinaryIO, name: str, data: memoryview) -> None:
    info = _zip_info(name)
    header_offset = out.tell()  # zipfile writes the next local header where the last record ended
    data_offset = header_offset + _LOCAL_HEADER + len(info.filename.encode()) + _ZIP64_EXTRA + 4  # + pad id, size
    pad = -data_offset % _ALIGNMENT
    info.extra = struct.pack("<HH", _PADDING_ID, pad) + bytes(pad)
    # force_zip64: the header, and so the padding, must not depend on the record's size
    with zf.open(info, "w", force_zip64=True) as record:
        _write_chunks(record, data)
    if info.header_offset != header_offset:
        raise RuntimeError(f"zip record {name}: header at {info.header_offset}, expected {header_offset}")


def write_torch_zip(out: BinaryIO, entries: Sequence[TensorEntry], load: Load) -> None:
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as zf:
        zf.writestr(_zip_info("data.pkl"), torch_index_pickle(entries))
        zf.writestr(_zip_info("byteorder"), sys.byteorder)
        for i, entry in enumerate(entries):  # [Note: one tensor at a time]
            _write_aligned_record(zf, out, f"data/{i}", _tensor_bytes(load(entry), entry))
        zf.writestr(_zip_info("version"), "3\n")


# ---- the whole run ------------------------------------------------------------------------------
def peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux KiB


def write_output(out: Path, fmt: str, entries: Sequence[TensorEntry], load: Load) -> None:
    """Write to ``OUT.partial``, then rename: ``OUT`` is complete or absent."""
    partial = out.with_name(out.name + ".partial")
    try:
        with open(partial, "wb") as file:
            if fmt == "pt":
                write_torch_zip(file, entries, load)
            else:
                write_safetensors(file, entries, load)
        os.replace(partial, out)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def consolidate(
    ckpt_dir: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    fmt: str = "pt",
    dtype: torch.dtype | None = None,
    prefix: str | None = None,
    force: bool = False,
    on_plan: Callable[[Plan], None] | None = None,
    on_tensor: Callable[[TensorEntry], None] | None = None,
) -> ConsolidateResult:
    """Write the checkpoint's tensors to ``out`` (``fmt`` "pt" or "safetensors"), one at a time.

    ``dtype`` casts floating tensors; ``prefix`` keeps the keys with it and strips it (default: "model."
    when every tensor key has it, else keep all). ``on_plan`` sees the plan before any data is read,
    ``on_tensor`` each entry once it is loaded. Raises ``CheckpointError`` with one line for the user.
    """
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    started = time.perf_counter()
    ckpt_dir, out = Path(ckpt_dir), Path(out)
    check_output(out, force)
    metadata = read_metadata(ckpt_dir)
    plan = plan_tensors(ckpt_dir, metadata, prefix, dtype)
    check_data_files(ckpt_dir, metadata, plan)
    if on_plan is not None:
        on_plan(plan)
    entries = safetensors_order(plan.entries) if fmt == "safetensors" else plan.entries
    load_tensor = tensor_loader(ckpt_dir, metadata)

    def load(entry: TensorEntry) -> torch.Tensor:
        tensor = load_tensor(entry)
        if on_tensor is not None:
            on_tensor(entry)
        return tensor

    write_output(out, fmt, entries, load)
    nbytes = sum(entry.nbytes for entry in entries)
    return ConsolidateResult(out, plan, nbytes, time.perf_counter() - started, peak_rss_bytes())
