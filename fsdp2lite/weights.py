"""Load a safetensors checkpoint into an already-sharded model, each rank reading only its own rows.

    model = build_on_meta(); fl.fully_shard(...); model.to_empty(device=...)
    report = fl.load_sharded_weights(model, "path/to/hf-checkpoint")

The directory holds ``model.safetensors.index.json`` (a ``weight_map`` from tensor name to shard file,
as ``save_pretrained`` writes for large models) or one ``model.safetensors``. Every rank memory-maps
the files and, for each tensor of the model's state dict, reads only the region its local tensor
covers ([Note: local region]): no rank reads the whole model, rank 0 included, and no collective runs.

[Note: all or nothing]
Two phases:
  1. check: the index, every shard file's header (read as JSON; nothing in a file ever runs as code),
     every tensor the model needs (present, same shape, a dtype that loads and casts); every problem
     found is listed in one ``CheckpointError`` naming the file and the tensor, and the model is untouched
  2. copy: tensor by tensor, read this rank's region, pass it through ``transform``, copy it into the
     local tensor, let it go; the most held at once beyond the model is one tensor's region
Only what phase 1 cannot see fails in phase 2, with the model part-filled: a read error of the disk, a
file changed in between, or a ``transform`` that raises or returns the wrong shape.

[Note: local region]
A DTensor's local tensor is the region the placements give, ``torch.chunk`` style along each sharded dim
(the layout fully_shard uses, padding aside: fsdp2lite's padding rows are outside the local view):

    dim of n=5 rows, Shard(0) over 4 ranks -> chunk ceil(5/4)=2: rank0 rows [0,2), rank1 [2,4),
    rank2 [4,5), rank3 [5,5) (no rows: nothing is read)

Mesh axes apply in order (HSDP's (Replicate(), Shard(0)): the replicate axis reads the same rows on every
replica). A plain tensor (an ignored parameter, a buffer) is its whole self on every rank.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from ._runtime.layout import ShardLayout
from ._summary import summarized
from .checkpoint.errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit on a header

# safetensors' dtype names -> torch's; a name torch lacks in this version cannot be loaded
_DTYPES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "U16": "uint16",
    "I32": "int32",
    "U32": "uint32",
    "I64": "int64",
    "U64": "uint64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",
    "C64": "complex64",
}

Transform = Callable[[str, torch.Tensor], "torch.Tensor | None"]
Rename = Callable[[str], "str | None"]


@dataclass(frozen=True)
class StoredTensor:
    """One tensor as a shard file's header describes it."""

    file: Path
    key: str
    dtype: str  # safetensors' name: F32, BF16, ...
    shape: tuple[int, ...]


@dataclass(frozen=True)
class TensorLoad:
    """One model tensor to fill: where it comes from and which region of it this rank holds."""

    name: str  # the model's state-dict name
    source: StoredTensor
    target: torch.Tensor  # the local tensor written in place (a DTensor's local, or the plain tensor)
    region: tuple[slice, ...]  # this rank's part of the global tensor: [Note: local region]


@dataclass(frozen=True)
class WeightsReport:
    """What ``load_sharded_weights`` did on this rank."""

    loaded: tuple[str, ...]  # model names filled from the checkpoint
    tied: tuple[str, ...]  # model names filled through another name of the same tensor
    skipped: tuple[str, ...]  # model names ``rename`` mapped to None (e.g. LoRA adapters)
    unused: tuple[str, ...]  # checkpoint names no model tensor took
    bytes_read: int  # bytes of tensor data this rank read (in the file's dtypes)
    largest_read: int  # the most bytes read for one tensor: the loader's transient peak


def load_sharded_weights(
    model: nn.Module,
    directory: str | Path,
    *,
    transform: Transform | None = None,
    rename: Rename | None = None,
) -> WeightsReport:
    """Fill ``model`` (sharded, its storage allocated) from the safetensors checkpoint in ``directory``,
    each rank reading only the rows of its own shards. Runs no collective; every rank calls it.

    ``transform(name, local_rows) -> tensor | None`` sees each tensor's local region as read (the file's
    dtype, on the host) under the model's state-dict name, before it is stored: return the tensor to copy
    into the local tensor (same shape; ``copy_`` casts, and a tensor-subclass local such as an NF4 weight
    defines what copying means), or None when the hook stored it itself. With a transform the file's
    dtype need only load, not cast. QLoRA quantizes each rank's own rows this way. Every rank calls it for
    every loaded tensor in the same order (shard files as the state dict first reaches them, state-dict
    order within a file), a rank with no rows of a tensor too (with an empty tensor), so it may run
    collectives (e.g. an all-gather of NF4 block scales).

    ``rename(name) -> checkpoint name | None`` maps the model's state-dict names to the checkpoint's;
    None leaves that tensor as it is. Without it: the name itself; with peft's ``base_model.model.``
    prefix and ``.base_layer`` removed (adapter tensors, ``lora_*``, are left alone); with or without the
    model's ``base_model_prefix``; and a tied tensor (``lm_head.weight`` with ``tie_word_embeddings``)
    from the name it is tied to. Non-persistent buffers are in no checkpoint and are not touched.

    Raises ``CheckpointError`` naming every file and tensor that does not fit before anything is
    copied ([Note: all or nothing]).
    """
    directory = Path(directory)
    stored = read_checkpoint(directory)
    loads, report = plan_loads(model, directory, stored, rename, transform is not None)
    bytes_read, largest = 0, 0
    with torch.no_grad():
        for path, file_loads in by_file(loads):
            with safe_open(path) as file:  # memory-mapped: reads touch only their pages
                for load in file_loads:
                    size = copy_region(file, load, transform)
                    bytes_read, largest = bytes_read + size, max(largest, size)
    return WeightsReport(report.loaded, report.tied, report.skipped, report.unused, bytes_read, largest)


# ---- 1. check ------------------------------------------------------------------------------------------
def read_checkpoint(directory: Path) -> dict[str, StoredTensor]:
    """Every tensor the checkpoint holds, from the index and the shard files' headers."""
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a directory; pass one written by save_pretrained (safetensors)")
    index = directory / INDEX_FILE
    if index.is_file():
        files = read_index(index)
    elif (directory / SINGLE_FILE).is_file():
        files = {SINGLE_FILE: []}
    else:
        others = sorted(p.name for p in directory.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".safetensors"))
        found = f" (found: {', '.join(others)}; pickle files are never read)" if others else ""
        raise CheckpointError(f"{directory}: neither {INDEX_FILE} nor {SINGLE_FILE}{found}; save with safetensors")
    stored: dict[str, StoredTensor] = {}
    problems: list[str] = []
    for name, claimed in files.items():
        path = directory / name
        if not path.is_file():
            keys = claimed
            named = ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
            problems.append(f"{path}: shard file missing; the index places tensors {named} in it")
            continue
        try:
            header = read_header(path)
        except CheckpointError as exc:
            problems.append(str(exc))
            continue
        stored.update(header)
        missing = sorted(set(claimed) - set(header))
        problems += [
            f"{path}: tensor {key}: the index places it in this file, which does not hold it" for key in missing
        ]
    if problems:
        raise CheckpointError(listed(f"{directory}: cannot load", problems))
    return stored


def listed(what: str, problems: list[str]) -> str:
    """One problem on the line; several, one a line below (alike ones once: ``summarized``)."""
    return f"{what}: {problems[0]}" if len(problems) == 1 else f"{what}:\n  " + "\n  ".join(summarized(problems))


def read_index(index: Path) -> dict[str, list[str]]:
    """shard file name -> the tensor names the index places in it."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f"{index}: not a readable index ({type(exc).__name__}: {exc}); expected JSON "
            'with a "weight_map" of tensor name -> shard file'
        ) from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f'{index}: "weight_map" must map tensor names to shard file names')
    files: dict[str, list[str]] = {}
    for key, name in weight_map.items():
        if Path(name).name != name or name in ("", ".", ".."):
            raise CheckpointError(
                f"{index}: tensor {key}: shard file {name!r} is not a plain file name in "
                f"{index.parent} (no directories, nothing outside it)"
            )
        files.setdefault(name, []).append(key)
    return files


def read_header(path: Path) -> dict[str, StoredTensor]:
    """A safetensors file's tensors, from its JSON header (8-byte length, then JSON), checked against
    the file's size; then opened by safetensors once, which checks the rest."""
    try:
        with path.open("rb") as file:
            (length,) = struct.unpack("<Q", file.read(8))
            if length > min(MAX_HEADER_BYTES, path.stat().st_size - 8):
                raise ValueError(f"header length {length} does not fit the file")
            header = json.loads(file.read(length))
        header.pop("__metadata__", None)
        tensors = {key: stored_tensor(path, key, entry, 8 + length) for key, entry in header.items()}
        open_checked(path, tensors)
    except CheckpointError:
        raise
    except Exception as exc:  # struct, JSON, safetensors: the file is damaged or not safetensors at all
        raise CheckpointError(f"{path}: not a readable safetensors file ({type(exc).__name__}: {exc})") from None
    return tensors


def safe_open(path: Path) -> Any:
    """safetensors' reader, memory-mapping ``path`` (imported here: a core install need not have it)."""
    try:
        import safetensors
    except ImportError:
        raise ImportError(
            "load_sharded_weights reads safetensors files: pip install safetensors (the [hf] extra brings it)"
        ) from None
    return safetensors.safe_open(str(path), framework="pt")


def open_checked(path: Path, tensors: dict[str, StoredTensor]) -> None:
    """safetensors' own checks (offsets, sizes); a dtype it does not know is named with its tensor."""
    try:
        with safe_open(path):
            pass
    except Exception:
        unknown = [f"tensor {t.key}: dtype {t.dtype}" for t in tensors.values() if t.dtype not in _DTYPES]
        if unknown:
            raise CheckpointError(
                f"{path}: {'; '.join(unknown)}: not a dtype that loads ({', '.join(_DTYPES)})"
            ) from None
        raise


def stored_tensor(path: Path, key: str, entry: object, data_start: int) -> StoredTensor:
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
        raise CheckpointError(f"{path}: tensor {key}: header entry needs dtype, shape and data_offsets")
    dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
    if not all(isinstance(n, int) and n >= 0 for n in shape) or not 0 <= begin <= end:
        raise CheckpointError(f"{path}: tensor {key}: bad shape {list(shape)} or offsets {[begin, end]}")
    if data_start + end > path.stat().st_size:
        raise CheckpointError(
            f"{path}: tensor {key}: data ends at byte {data_start + end}, past the file's end "
            f"({path.stat().st_size}); the file is truncated"
        )
    return StoredTensor(path, key, str(dtype), shape)


def torch_dtype(stored: StoredTensor) -> torch.dtype | None:
    name = _DTYPES.get(stored.dtype)
    dtype = getattr(torch, name, None) if name is not None else None
    return dtype if isinstance(dtype, torch.dtype) else None


def dtype_kind(dtype: torch.dtype) -> str:
    if dtype.is_complex:
        return "complex"
    if dtype.is_floating_point:
        return "float"
    return "bool" if dtype == torch.bool else "int"


@dataclass(frozen=True)
class NameReport:
    loaded: tuple[str, ...]
    tied: tuple[str, ...]
    skipped: tuple[str, ...]
    unused: tuple[str, ...]


@dataclass(frozen=True)
class Lookup:
    """Where one model name's values are in the checkpoint."""

    key: str | None  # the checkpoint name found; None: not found, or left alone (skip)
    tried: tuple[str, ...]  # the checkpoint names looked for
    skip: bool  # rename (or the adapter rule) says: leave this tensor as it is


def plan_loads(
    model: nn.Module,
    directory: Path,
    stored: dict[str, StoredTensor],
    rename: Rename | None,
    transform_given: bool,
) -> tuple[list[TensorLoad], NameReport]:
    """Match each model tensor (once per tensor: tied names share it) to a stored one and check it."""
    loads: list[TensorLoad] = []
    loaded: list[str] = []
    tied: list[str] = []
    skipped: list[str] = []
    problems: list[str] = []
    for names, tensor in model_tensors(model):
        lookups = {name: find_key(model, name, stored, rename) for name in names}
        found = [name for name, lookup in lookups.items() if lookup.key is not None]
        if not found:
            if all(lookup.skip for lookup in lookups.values()):
                skipped += names
                continue
            tried = ", ".join(dict.fromkeys(k for lookup in lookups.values() for k in lookup.tried))
            problems.append(f"tensor {names[0]}: not in the checkpoint (looked for {tried})")
            continue
        name = found[0]
        source = stored[lookups[name].key]  # type: ignore[index]
        problem = check_tensor(name, tensor, source, transform_given)
        if problem is not None:
            problems.append(problem)
            continue
        loads.append(TensorLoad(name, source, local_tensor(tensor), local_region(name, tensor)))
        loaded.append(name)
        tied += [n for n in names if n != name]
    if problems:
        raise CheckpointError(listed(f"{directory}: cannot load into the model", problems))
    unused = tuple(sorted(set(stored) - {load.source.key for load in loads}))
    return loads, NameReport(tuple(loaded), tuple(tied), tuple(skipped), unused)


def model_tensors(model: nn.Module) -> Iterator[tuple[list[str], torch.Tensor]]:
    """(every state-dict name of one tensor, the tensor), in state-dict order; tied names come together."""
    by_id: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        by_id.setdefault(id(tensor), ([], tensor))[0].append(name)
    yield from by_id.values()


def find_key(model: nn.Module, name: str, stored: dict[str, StoredTensor], rename: Rename | None) -> Lookup:
    if rename is not None:
        key = rename(name)
        if key is None:
            return Lookup(None, (), skip=True)
        return Lookup(key if key in stored else None, (key,), skip=False)
    plain = name.removeprefix("base_model.model.").replace(".base_layer.", ".")  # peft's wrapping
    if ".lora_" in plain:  # peft's adapters (lora_A, lora_B, lora_embedding_*, lora_magnitude_vector)
        return Lookup(None, (), skip=True)
    tried = [plain]
    prefix = getattr(model, "base_model_prefix", "") or ""
    if prefix:
        tried.append(plain.removeprefix(prefix + ".") if plain.startswith(prefix + ".") else f"{prefix}.{plain}")
    ties = getattr(model, "_tied_weights_keys", None)
    if isinstance(ties, dict) and isinstance(ties.get(plain), str):  # transformers 5: tied name -> source
        tried.append(ties[plain])
    key = next((k for k in tried if k in stored), None)
    return Lookup(key, tuple(dict.fromkeys(tried)), skip=False)


def check_tensor(name: str, tensor: torch.Tensor, source: StoredTensor, transform_given: bool) -> str | None:
    """What keeps ``source`` from filling ``tensor``, or None."""
    where = f"{source.file}: tensor {source.key}"
    if tuple(tensor.shape) != source.shape:
        return f"{where}: shape {list(source.shape)}, the model's {name} is {list(tensor.shape)}"
    dtype = torch_dtype(source)
    if dtype is None:
        known = ", ".join(k for k in _DTYPES if torch_dtype(StoredTensor(source.file, "", k, ())) is not None)
        return f"{where}: dtype {source.dtype} cannot be loaded by torch {torch.__version__} (loadable: {known})"
    kinds = dtype_kind(dtype), dtype_kind(tensor.dtype)
    if not transform_given and kinds[0] != kinds[1] and kinds != ("bool", "int"):
        return (
            f"{where}: dtype {source.dtype} ({dtype}) does not cast to the model's {name} ({tensor.dtype}); "
            f"a {kinds[1]} tensor loads from {kinds[1]} data"
        )
    return None


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The storage this rank writes: a DTensor's local tensor, or the tensor itself (both aliases)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor.detach()


def local_region(name: str, tensor: torch.Tensor) -> tuple[slice, ...]:
    """The part of the global tensor this rank holds ([Note: local region])."""
    bounds = [(0, n) for n in tensor.shape]  # (start, length) per dim
    if isinstance(tensor, DTensor):
        mesh, coordinate = tensor.device_mesh, tensor.device_mesh.get_coordinate()
        if coordinate is None:  # this rank is outside the mesh: it holds nothing
            return tuple(slice(0, 0) for _ in tensor.shape)
        for axis, placement in enumerate(tensor.placements):
            if placement.is_replicate():
                continue
            if type(placement) is not Shard:  # _StridedShard (tensor parallel under FSDP), Partial
                raise CheckpointError(
                    f"tensor {name}: placement {placement} on mesh axis {axis} is not loaded "
                    "from files; Shard(dim) and Replicate() are"
                )
            dim = placement.dim % tensor.ndim
            start, length = bounds[dim]
            layout = ShardLayout((length,), 0, mesh.size(axis), coordinate[axis])  # [Note: padded shard]
            bounds[dim] = (start + layout.start, layout.local_rows)
    region = tuple(slice(start, start + length) for start, length in bounds)
    local_shape = tuple(s.stop - s.start for s in region)
    if tuple(local_tensor(tensor).shape) != local_shape:
        raise CheckpointError(
            f"tensor {name}: local tensor {list(local_tensor(tensor).shape)} is not the region "
            f"{list(local_shape)} its placements {getattr(tensor, 'placements', '(none)')} give"
        )
    return region


# ---- 2. copy -------------------------------------------------------------------------------------------
def by_file(loads: list[TensorLoad]) -> list[tuple[Path, list[TensorLoad]]]:
    """The loads grouped by shard file (each file opened once), in the order files first appear."""
    groups: dict[Path, list[TensorLoad]] = {}
    for load in loads:
        groups.setdefault(load.source.file, []).append(load)
    return list(groups.items())


def copy_region(file: Any, load: TensorLoad, transform: Transform | None) -> int:
    """Read this rank's region of one tensor, transform it, store it; returns the bytes read."""
    rows = read_region(file, load.source, load.region)
    size = rows.numel() * rows.element_size()
    value = transform(load.name, rows) if transform is not None else rows
    if value is not None:
        if tuple(value.shape) != tuple(load.target.shape):
            raise CheckpointError(
                f"{load.source.file}: tensor {load.source.key}: transform gave shape "
                f"{list(value.shape)} for {load.name}, whose local tensor is "
                f"{list(load.target.shape)} (tensors before it are already loaded)"
            )
        load.target.copy_(value)
    return size


def read_region(file: Any, source: StoredTensor, region: tuple[slice, ...]) -> torch.Tensor:
    """Only ``region``'s bytes of the memory-mapped ``file`` become a tensor (on the host, the file's dtype)."""
    shape = tuple(s.stop - s.start for s in region)
    if math.prod(shape) == 0:  # a rank past the last rows (fewer rows than ranks)
        return torch.empty(shape, dtype=torch_dtype(source))
    if shape == source.shape:  # replicated, ignored, a buffer: the whole tensor is this rank's
        return file.get_tensor(source.key)
    return file.get_slice(source.key)[region]
