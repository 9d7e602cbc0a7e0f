"""``fsdp2lite demo``: train a small byte-level GPT sharded over CPU processes, end to end.

What it shows: ``apply_config`` with the policy in ``configs/demo.yaml`` (one ``fully_shard`` group per
Block, then the root; ``--config`` picks another file) training with AdamW on gloo, the loss going
down, and each rank holding about ``1 / world_size`` of the parameter bytes. The config is validated
and planned against the model (on the meta device) before any rank is spawned.

How it runs: ``torch.multiprocessing.spawn`` starts ``--world-size`` ranks (no torchrun, no port:
rendezvous is a temporary file). Every rank builds the same model from ``--seed`` and samples its own
batches from a generated English corpus (nothing is downloaded). Rank 0 prints a progress bar, a line
per step (loss averaged over ranks, tokens/s over all ranks), a per-rank parameter-bytes table and a
one-line summary.

    fsdp2lite demo                        # 2 ranks, 30 steps: well under a minute on 2 CPU cores
    fsdp2lite demo --config configs/fp32.yaml
    python -m fsdp2lite demo --world-size 4 --steps 50 --d-model 64
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table
from torch.distributed.tensor import DTensor

from .._spawn import exit_rank_process
from ..config import ConfigError, FSDPConfig, Match, WrapRule, apply_config, plan_config
from ..models import GPT, GPTConfig
from ._args import USAGE_EXIT_CODE, UsageError, non_negative_int, positive_float, positive_int
from .validate import problems_table

DESCRIPTION = (
    "Train a small byte-level GPT, sharded with fully_shard over --world-size CPU processes (gloo), "
    "on generated English text; print the loss per step and the parameter bytes each rank holds."
)
MAX_WORLD_SIZE = 64  # one process per rank on this machine; more is a typo, not a demo
_PROG = "fsdp2lite demo"
# configs/demo.yaml of the repository this package lives in; absent from a non-editable install
DEFAULT_CONFIG_PATH = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"
_POLICY = ("policy", "policy_source")  # DemoConfig fields that come from --config, not from one flag each


# ---- the corpus: simple English sentences from word lists, the same on every rank ----------------
_NAMES = ("Anna", "Ben", "Clara", "David", "Emma", "Felix", "Grace", "Hugo")
_ADJECTIVES = ("small", "big", "old", "young", "red", "brown", "quiet", "happy", "tired", "clever")
_NOUNS = ("cat", "dog", "bird", "fox", "horse", "child", "farmer", "baker", "sailor", "teacher")
_OBJECTS = ("ball", "book", "apple", "river", "house", "garden", "boat", "letter", "tree", "hill")
_VERBS = ("saw", "found", "followed", "watched", "helped", "carried", "painted", "liked")
_MOTIONS = ("walked", "ran", "sang", "slept", "waited", "danced", "rested", "laughed")
_ADVERBS = ("slowly", "quickly", "quietly", "happily", "again", "all day", "at night")
_PLACES = ("by the river", "in the garden", "near the hill", "on the boat", "under the tree")
_TEXT_SEED = 20240501  # the corpus is fixed; --seed changes the model init and the batches
_TEXT_SENTENCES = 3000


def _sentence(rng: random.Random) -> str:
    adjective, noun, obj = rng.choice(_ADJECTIVES), rng.choice(_NOUNS), rng.choice(_OBJECTS)
    kind = rng.randrange(4)
    if kind == 0:
        return f"The {adjective} {noun} {rng.choice(_VERBS)} the {obj} {rng.choice(_PLACES)}."
    if kind == 1:
        return f"{rng.choice(_NAMES)} {rng.choice(_VERBS)} a {adjective} {obj}."
    if kind == 2:
        return f"A {noun} {rng.choice(_MOTIONS)} {rng.choice(_ADVERBS)}."
    return f"{rng.choice(_NAMES)} and the {noun} {rng.choice(_MOTIONS)} {rng.choice(_PLACES)}."


def make_text(num_sentences: int = _TEXT_SENTENCES, seed: int = _TEXT_SEED) -> str:
    """A deterministic ASCII corpus of simple sentences, a few per line (about 35 bytes each)."""
    rng = random.Random(seed)
    lines: list[str] = []
    remaining = num_sentences
    while remaining > 0:
        count = min(remaining, rng.randint(3, 6))
        lines.append(" ".join(_sentence(rng) for _ in range(count)))
        remaining -= count
    return "\n".join(lines) + "\n"


def encode_text(text: str) -> torch.Tensor:
    """Bytes as token ids: ``(len(text.encode()),)`` int64 in [0, 256)."""
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def sample_batch(
    data: torch.Tensor, batch: int, seq_len: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` random windows of ``data``: tokens and next-byte targets, each ``(batch, seq_len)``."""
    starts = torch.randint(0, data.numel() - seq_len, (batch,), generator=generator)  # (batch,)
    windows = torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()])  # (batch, seq_len + 1)
    return windows[:, :-1], windows[:, 1:]


# ---- configuration ------------------------------------------------------------------------------
@dataclass(frozen=True)
class DemoConfig:
    """The validated demo settings; what each spawned rank receives."""

    world_size: int  # ranks (processes) to spawn
    steps: int  # optimizer steps
    d_model: int  # model width
    layers: int  # transformer blocks, one fully_shard group each
    heads: int  # attention heads; must divide d_model
    seq_len: int  # tokens (bytes) per sample
    batch: int  # samples per rank per step
    lr: float  # AdamW learning rate
    seed: int  # model init (same on every rank) and batch sampling (different per rank)
    policy: FSDPConfig  # how the model is sharded (validated, planned against the model)
    policy_source: str  # where the policy came from, for the header line

    def model_config(self) -> GPTConfig:
        return GPTConfig(
            vocab_size=256,  # byte-level
            seq_len=self.seq_len,
            d_model=self.d_model,
            n_heads=self.heads,
            n_layers=self.layers,
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's flags; ranges are checked by the types, combinations by ``config_from_args``."""
    parser.add_argument("--world-size", type=positive_int, default=2, help="ranks to spawn (default 2)")
    parser.add_argument("--steps", type=positive_int, default=30, help="training steps (default 30)")
    parser.add_argument("--d-model", type=positive_int, default=128, help="model width (default 128)")
    parser.add_argument("--layers", type=positive_int, default=4, help="transformer blocks (default 4)")
    parser.add_argument("--heads", type=positive_int, default=4, help="attention heads (default 4)")
    parser.add_argument("--seq-len", type=positive_int, default=64, help="bytes per sample (default 64)")
    parser.add_argument("--batch", type=positive_int, default=8, help="samples per rank per step (default 8)")
    parser.add_argument("--lr", type=positive_float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="random seed (default 0)")
    parser.add_argument(
        "--config",
        metavar="PATH",
        default=None,
        help="YAML policy file (default: the repository's configs/demo.yaml, or the same policy built in)",
    )


def builtin_policy() -> FSDPConfig:
    """What configs/demo.yaml says, for installs without the repository: one group per Block."""
    return FSDPConfig(wrap=[WrapRule(match=Match.model_validate({"class": "Block"}))])


def load_policy(path: str | None) -> tuple[FSDPConfig, str]:
    """The policy and where it came from: ``path``, else configs/demo.yaml, else the built-in one."""
    if path is not None:
        return FSDPConfig.from_yaml(path), path
    if not DEFAULT_CONFIG_PATH.is_file():
        return builtin_policy(), f"built-in (one group per Block; {DEFAULT_CONFIG_PATH} not found)"
    return FSDPConfig.from_yaml(DEFAULT_CONFIG_PATH), _display_path(DEFAULT_CONFIG_PATH)


def _display_path(path: Path) -> str:
    """``path`` relative to the working directory when it is below it, else absolute."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def config_from_args(args: argparse.Namespace) -> DemoConfig:
    """Build the config, raising ``UsageError`` naming the flag for combinations that cannot run and
    ``ConfigError`` for a policy that is invalid or does not fit the model."""
    if args.world_size > MAX_WORLD_SIZE:
        raise UsageError(
            f"argument --world-size: at most {MAX_WORLD_SIZE} ranks on one machine, got {args.world_size}",
            _PROG,
        )
    if args.d_model % args.heads:
        raise UsageError(f"argument --d-model: must be divisible by --heads ({args.heads}), got {args.d_model}", _PROG)
    corpus_bytes = len(make_text().encode("utf-8"))
    if args.seq_len >= corpus_bytes:
        raise UsageError(
            f"argument --seq-len: must be below the corpus size ({corpus_bytes} bytes), got {args.seq_len}",
            _PROG,
        )
    policy, policy_source = load_policy(args.config)
    flags = {field.name: getattr(args, field.name) for field in fields(DemoConfig) if field.name not in _POLICY}
    cfg = DemoConfig(**flags, policy=policy, policy_source=policy_source)
    _check_policy(cfg)
    return cfg


def _check_policy(cfg: DemoConfig) -> None:
    """The policy's mesh fits ``--world-size`` and each of its rules matches the demo model."""
    try:
        cfg.policy.mesh.resolve(cfg.world_size)
    except ValueError as exc:
        raise UsageError(f"argument --world-size: {exc} (mesh of {cfg.policy_source})", _PROG) from None
    with torch.device("meta"):  # shapes only: planning needs no parameter memory
        model = GPT(cfg.model_config())
    plan = plan_config(model, cfg.policy)
    if plan.problems:
        raise ConfigError(f"{cfg.policy_source} applied to the demo GPT", plan.problems)


# ---- launching the ranks ------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    """Validate, spawn the ranks and wait; 0 on success, 1 (with the failing rank's error) if not."""
    try:
        cfg = config_from_args(args)
    except ConfigError as exc:
        Console(stderr=True).print(problems_table(f"{_PROG}: {exc.source}", exc.problems))
        return USAGE_EXIT_CODE
    fd, init_file = tempfile.mkstemp(prefix="fsdp2lite_demo_pg_")
    os.close(fd)
    os.unlink(init_file)  # FileStore wants a path it can create itself
    try:
        mp.spawn(_run_rank, args=(cfg, init_file), nprocs=cfg.world_size, join=True)
    except mp.ProcessRaisedException as exc:
        return _report_failure(f"rank {exc.error_index} failed", str(exc))
    except mp.ProcessExitedException as exc:
        return _report_failure(f"rank {exc.error_index} died (exit code {exc.exit_code})", str(exc))
    finally:
        if os.path.exists(init_file):
            os.unlink(init_file)
    return 0


def _report_failure(what: str, details: str) -> int:
    """Print the rank's traceback, then one line naming the rank and the error."""
    lines = [line for line in details.strip().splitlines() if line.strip()]
    print(details.rstrip(), file=sys.stderr)
    print(f"{_PROG}: error: {what}: {lines[-1].strip() if lines else 'no details'}", file=sys.stderr)
    return 1


def _run_rank(rank: int, cfg: DemoConfig, init_file: str) -> None:
    """Entry point of each spawned process: join the process group, train, leave."""
    torch.set_num_threads(1)  # ranks share the machine's cores; oversubscription only slows them
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=cfg.world_size)
    try:
        _train(rank, cfg)
        dist.barrier()  # no rank tears the group down while rank 0 still gathers
    finally:
        dist.destroy_process_group()
    exit_rank_process()  # succeeded: skip interpreter finalization ([Note: rank exit])


# ---- one rank's training ------------------------------------------------------------------------
class StepResult(NamedTuple):
    """One training step as rank 0 reports it."""

    step: int  # 1-based
    loss: float  # averaged over ranks
    seconds: float  # wall time of the step on rank 0 (ranks meet in every collective)


class ParamBytes(NamedTuple):
    """One rank's parameter memory, sharded vs. what the unsharded model would take."""

    sharded: int  # bytes of this rank's local shards
    unsharded: int  # bytes of the full (global-shape) parameters


def param_bytes(model: nn.Module) -> ParamBytes:
    """Parameter bytes this rank holds (DTensor local shards) and the unsharded model's bytes."""
    sharded = unsharded = 0
    for param in model.parameters():  # tied parameters are yielded once
        local = param.to_local() if isinstance(param, DTensor) else param
        sharded += local.numel() * local.element_size()
        unsharded += param.numel() * param.element_size()  # DTensor.numel() is the global count
    return ParamBytes(sharded, unsharded)


def _train(rank: int, cfg: DemoConfig) -> None:
    """Build and shard the model, train ``cfg.steps`` steps, then report (rank 0 prints)."""
    torch.manual_seed(cfg.seed)  # every rank builds the same initial model
    model = GPT(cfg.model_config())
    apply_config(model, cfg.policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    data = encode_text(make_text())  # (corpus_bytes,)
    tokens_per_step = cfg.world_size * cfg.batch * cfg.seq_len
    results: list[StepResult] = []
    display: AbstractContextManager[_Display | None] = _Display(cfg) if rank == 0 else nullcontext()
    with display as shown:
        for step in range(cfg.steps):
            start = time.perf_counter()
            # (seed, step, rank) -> its own stream: each rank samples different windows every step
            generator = torch.Generator().manual_seed(cfg.seed + step * cfg.world_size + rank)
            tokens, targets = sample_batch(data, cfg.batch, cfg.seq_len, generator)
            loss = model.loss(tokens, targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            result = StepResult(step + 1, _mean_over_ranks(loss), time.perf_counter() - start)
            results.append(result)
            if shown is not None:
                shown.show_step(result, tokens_per_step)
    rows = _gather_param_bytes(model, rank, cfg.world_size)
    if rank == 0:
        _show_report(Console(), rows, results, tokens_per_step, cfg.world_size)


def _mean_over_ranks(loss: torch.Tensor) -> float:
    total = loss.detach().clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)  # gloo has no AVG: sum, then divide
    return total.item() / dist.get_world_size()


def _gather_param_bytes(model: nn.Module, rank: int, world_size: int) -> list[ParamBytes]:
    """Every rank's ``param_bytes`` on rank 0 (other ranks get an empty list)."""
    mine = torch.tensor(param_bytes(model), dtype=torch.int64)  # (2,): sharded, unsharded
    gathered = [torch.empty_like(mine) for _ in range(world_size)] if rank == 0 else None
    dist.gather(mine, gathered, dst=0)
    return [ParamBytes(*(int(v) for v in row.tolist())) for row in gathered or []]


# ---- rank 0's output ----------------------------------------------------------------------------
class _Display:
    """Rank 0's live output: a progress bar with the loss, and one printed line per step."""

    cfg: DemoConfig
    progress: Progress
    task: TaskID

    def __init__(self, cfg: DemoConfig) -> None:
        self.cfg = cfg
        self.progress = Progress(
            TextColumn("[bold]training"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TimeElapsedColumn(),
        )
        self.task = self.progress.add_task("training", total=cfg.steps, loss="-")

    def __enter__(self) -> _Display:
        cfg = self.cfg
        self.progress.console.print(
            f"fsdp2lite demo: {cfg.world_size} ranks (gloo, CPU); config {escape(cfg.policy_source)}; "
            f"GPT d_model={cfg.d_model} layers={cfg.layers} heads={cfg.heads}; "
            f"seq_len={cfg.seq_len} batch={cfg.batch}/rank; AdamW lr={cfg.lr:g}; seed={cfg.seed}",
            soft_wrap=True,  # one line even when piped (80 columns)
        )
        self.progress.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.progress.stop()

    def show_step(self, result: StepResult, tokens_per_step: int) -> None:
        self.progress.update(self.task, advance=1, loss=f"{result.loss:.4f}")
        self.progress.console.print(
            f"step {result.step:>4}/{self.cfg.steps}  loss {result.loss:.4f}  "
            f"{tokens_per_step / result.seconds:>9,.0f} tok/s"
        )


def _show_report(
    console: Console,
    rows: list[ParamBytes],
    results: list[StepResult],
    tokens_per_step: int,
    world_size: int,
) -> None:
    """The per-rank parameter-bytes table and the one-line summary."""
    table = Table(title="Parameter bytes per rank (after training)")
    table.add_column("rank", justify="right")
    table.add_column("sharded bytes", justify="right")
    table.add_column("unsharded bytes", justify="right")
    table.add_column("sharded / unsharded", justify="right")
    for rank, row in enumerate(rows):
        table.add_row(str(rank), f"{row.sharded:,}", f"{row.unsharded:,}", f"{row.sharded / row.unsharded:.3f}")
    total, unsharded = sum(r.sharded for r in rows), rows[0].unsharded
    relation = "=" if total == unsharded else "!="
    table.caption = f"sum of shards {total:,} bytes {relation} unsharded {unsharded:,} bytes"
    console.print(table)
    seconds = sum(r.seconds for r in results)
    console.print(
        f"done: {len(results)} steps, loss {results[0].loss:.4f} -> {results[-1].loss:.4f}, "
        f"{tokens_per_step * len(results) / seconds:,.0f} tokens/s across {world_size} ranks "
        f"({seconds:.1f} s training)",
        soft_wrap=True,
    )
