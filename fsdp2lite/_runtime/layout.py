"""A tensor's shard layout: which rows each rank holds and how its shard is padded ([Note: padded shard]).

[Note: padded shard]
A tensor of ``rows`` rows along its shard dim d (``row_numel`` elements each) over ``shard_size`` ranks, rows
split as ``torch.chunk`` splits them, each rank's shard padded to the same ``padded_rows``:

    chunk_rows   = ceil(rows / shard_size)                    torch.chunk's rows per rank
    start_of(r)  = min(r * chunk_rows, rows)                  rank r's first row in the full tensor
    rows_of(r)   = max(0, min(chunk_rows, rows - start_of(r)))    its real rows (the last ones short or none)
    padded_rows  = chunk_rows rounded up to a multiple of align   every rank's shard along d, real rows first

    rows=5, shard_size=4, align=1 -> chunk_rows = padded_rows = 2: rank0 rows 0-1, rank1 2-3, rank2 4 (+1 pad
    row), rank3 none (2 pad rows). Gathered rank-major, [0 1 | 2 3 | 4 p | p p]: the tensor, then padding.
    rows=5, shard_size=2, align=4 -> chunk_rows=3, padded_rows=4: rank0 rows 0-2 (+1 pad row), rank1 rows
    3-4 (+2). Gathered [0 1 2 p | 3 4 p p]: padding between ranks' rows.

Every rank contributes ``padded_numel`` elements to the all-gather (one equal-sized collective) and receives as
many from the reduce-scatter. The real rows are torch.chunk's whatever the alignment, so a DTensor placed
``Shard(d)`` around ``rows_of(rank)`` rows is right and ``full_tensor()`` gives back the original. Where the
gathered rows are the tensor followed by padding (``gathered_is_contiguous``: dim 0, no alignment padding
inside) the unsharded tensor is a view of them; elsewhere (another dim, or aligned) it is copied out of them
(``from_rank_major``) and the gradient is laid out rank-major first (``rank_major``). ``align``: rows, a
construction-time setting (``ShardingPolicy(align=N)``, resolved into ``ParamPolicy.shard_align``) for
block-aligned shards; a parameter with torch's
all-gather hooks stays unaligned (its hook cuts only trailing padding).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class ShardLayout:
    """One tensor's padded shard layout over ``shard_size`` ranks, seen from ``shard_rank`` ([Note: padded shard])."""

    shape: tuple[int, ...]  # the full tensor's (what the all-gather rebuilds)
    dim: int  # d, the sharded dim
    shard_size: int
    shard_rank: int
    align: int = 1  # each rank's padded rows are a multiple of this
    rows: int = field(init=False)  # the full tensor's rows along d
    row_numel: int = field(init=False)  # elements of one row (the other dims')
    chunk_rows: int = field(init=False)  # torch.chunk's rows per rank
    padded_rows: int = field(init=False)  # every rank's shard's rows along d
    start: int = field(init=False)  # this rank's first row in the full tensor
    local_rows: int = field(init=False)  # this rank's real rows

    def __post_init__(self) -> None:
        if self.shard_size < 1 or not 0 <= self.shard_rank < self.shard_size or self.align < 1:
            raise ValueError(f"ShardLayout: rank {self.shard_rank} of {self.shard_size}, align {self.align}")
        rows = self.shape[self.dim]
        chunk = math.ceil(rows / self.shard_size)
        derived = {
            "rows": rows,
            "row_numel": math.prod(size for d, size in enumerate(self.shape) if d != self.dim),
            "chunk_rows": chunk,
            "padded_rows": -(-chunk // self.align) * self.align,
            "start": min(self.shard_rank * chunk, rows),
        }
        derived["local_rows"] = max(0, min(chunk, rows - derived["start"]))
        for name, value in derived.items():
            object.__setattr__(self, name, value)  # frozen: set once, here

    def start_of(self, rank: int) -> int:
        """Rank ``rank``'s first row in the full tensor."""
        return min(rank * self.chunk_rows, self.rows)

    def rows_of(self, rank: int) -> int:
        """Rank ``rank``'s real rows (torch.chunk's)."""
        return max(0, min(self.chunk_rows, self.rows - self.start_of(rank)))

    @property
    def padded_numel(self) -> int:
        """Elements of one rank's padded shard: each rank's slot in the flat collective buffers."""
        return self.padded_rows * self.row_numel

    @property
    def padded_shape(self) -> tuple[int, ...]:
        """The padded shard's shape: ``shape`` with ``padded_rows`` along d."""
        return self._with_rows(self.padded_rows)

    @property
    def local_shape(self) -> tuple[int, ...]:
        """This rank's real rows' shape (the DTensor's local tensor)."""
        return self._with_rows(self.local_rows)

    @property
    def gathered_is_contiguous(self) -> bool:
        """The rank-major gathered shards are the full tensor followed by padding: it is a view of them, and
        ``torch._chunk_cat`` of its gradient is the reduce-scatter's input (else ``rank_major`` and
        ``from_rank_major``)."""
        return self.dim == 0 and self.padded_rows == self.chunk_rows

    def local_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's real rows of ``full`` (a view)."""
        return full.narrow(self.dim, self.start, self.local_rows)

    def rank_major(self, full: torch.Tensor) -> torch.Tensor:
        """``full`` as ``(shard_size, padded_numel)``: row r is rank r's padded shard, flat (a copy unless the
        layout already is one). The reduce-scatter's layout of a gradient."""
        d, ws, chunk = self.dim, self.shard_size, self.chunk_rows
        after = [0, 0] * (len(self.shape) - 1 - d)  # F.pad counts dims from the last
        if ws * chunk != self.rows:
            full = torch.nn.functional.pad(full, [*after, 0, ws * chunk - self.rows])
        chunks = full.reshape(*self.shape[:d], ws, chunk, *self.shape[d + 1 :])  # (..., ws, chunk, ...)
        if self.padded_rows != chunk:
            chunks = torch.nn.functional.pad(chunks, [*after, 0, self.padded_rows - chunk])
        return chunks.movedim(d, 0).reshape(ws, -1)

    def from_rank_major(self, gathered: torch.Tensor, out: torch.Tensor) -> None:
        """Copy the rank-major ``gathered`` (``shard_size * padded_numel`` elements) into ``out`` (``shape``):
        the chunks side by side along d, padding left out (one strided copy, two when the last chunk is short)."""
        d, chunk = self.dim, self.chunk_rows
        chunks = gathered.view(self.shard_size, *self.padded_shape).movedim(0, d)  # (..., ws, padded_rows, ...)
        if self.padded_rows != chunk:
            chunks = chunks.narrow(d + 1, 0, chunk)
        whole, rest = divmod(self.rows, chunk) if chunk else (0, 0)
        if whole:
            split = (*self.shape[:d], whole, chunk, *self.shape[d + 1 :])
            out.narrow(d, 0, whole * chunk).view(split).copy_(chunks.narrow(d, 0, whole))
        if rest:
            out.narrow(d, whole * chunk, rest).copy_(chunks.select(d, whole).narrow(d, 0, rest))

    def _with_rows(self, rows: int) -> tuple[int, ...]:
        shape = list(self.shape)
        shape[self.dim] = rows
        return tuple(shape)
