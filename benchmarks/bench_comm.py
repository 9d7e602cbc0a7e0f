"""Fewer bytes on the wire (issue 23): CommPolicy's quantized all-gather and all-to-all reduce-scatter
against fsdp2lite's default collectives and torch's fully_shard, side by side in the same processes.

What, per shape (bench_step's ``gpt`` and ``params`` GPTs) and world size (2 and 4 gloo ranks on CPU),
for each mode (bf16 compute with fp32 reduction unless the mode says fp32):
    bytes    sent per rank per step, per collective kind, counted where fsdp2lite issues each collective
             (``fl.count_wire_bytes``: exact, from buffer sizes);
    time     step time, the modes and torch's fully_shard interleaved step by step (a barrier before each,
             the max over ranks), reported as the median of per-step ratios against the default mode of
             the same precision and against torch;
    error    the relative L2 error of a gathered weight (what the forward computed with) against the
             fp32 master, and the cosine of the reduced gradients against the default mode's.
``--part convergence`` trains ``examples/train.py`` under torchrun (2 ranks, bundled text, same seeds) on
llama-tiny and fsdp2lite's GPT for ``--steps`` steps per mode: final loss and the largest per-step loss
gap to the bf16 baseline; the bf16 baseline from seeds 1 and 2 says how far final losses land apart
with no quantization at all (``--modes`` picks a subset).

Why: the numbers behind README's "Communication" section and the choice of defaults.

How to run (2 CPU cores; an idle machine):
    .venv/bin/python benchmarks/bench_comm.py [--steps 6] [--worlds 2 4] [--no-save]        # ~4 minutes
    .venv/bin/python benchmarks/bench_comm.py --part convergence --steps 300 [--no-save]    # ~15 minutes
Prints rich tables and a final JSON line; unless --no-save, writes benchmarks/results/comm-... .json/.md
with machine, versions and the command line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from _results import environment, environment_markdown, markdown_table, save_run
from bench_step import CONFIGS
from rich.console import Console
from rich.table import Table
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecision
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import fsdp2lite as fl
from fsdp2lite.models import GPT

REPO = Path(__file__).resolve().parents[1]
BF16 = fl.MixedPrecisionPolicy(param_dtype="bf16", reduce_dtype="fp32")
MODES: dict[str, tuple[fl.MixedPrecisionPolicy, fl.CommPolicy | None]] = {
    "bf16": (BF16, None),
    "bf16 + int8 all-gather": (BF16, fl.CommPolicy(all_gather="int8")),
    "bf16 + all-to-all fp32": (BF16, fl.CommPolicy(reduce_scatter="all_to_all")),
    "bf16 + int8 all-to-all": (BF16, fl.CommPolicy(reduce_scatter="int8")),
    "bf16 + int8 both": (BF16, fl.CommPolicy(all_gather="int8", reduce_scatter="int8")),
    "fp32": (fl.MixedPrecisionPolicy(), None),
    "fp32 + all-to-all": (fl.MixedPrecisionPolicy(), fl.CommPolicy(reduce_scatter="all_to_all")),
}
BASELINE = {name: ("fp32" if name.startswith("fp32") else "bf16") for name in MODES}


def build(mode: str, config: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = GPT(config)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if mode == "torch bf16":
        mp_policy = TorchMixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            torch_fully_shard(block, mesh=mesh, mp_policy=mp_policy)
        torch_fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    else:
        mp_policy, comm = MODES[mode]
        for block in model.blocks:
            fl.fully_shard(block, mesh=mesh, mp_policy=mp_policy, comm_policy=comm)
        fl.fully_shard(model, mesh=mesh, mp_policy=mp_policy, comm_policy=comm)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def step(model: nn.Module, opt: torch.optim.Optimizer, tokens: torch.Tensor) -> tuple[float, float]:
    dist.barrier()
    start = time.perf_counter()
    loss = model.loss(tokens[:, :-1], tokens[:, 1:])  # type: ignore[operator]
    loss.backward()
    opt.step()
    opt.zero_grad()
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed), loss.item()


def _gathered_and_grads(model: nn.Module, tokens: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """What the forward computed the first block's attention with, and the reduced (full) gradients."""
    seen: dict[str, torch.Tensor] = {}
    layer = model.blocks[0].attn.qkv  # type: ignore[index,union-attr]

    def capture(module: nn.Module, args: Any) -> None:
        seen["w"] = module.weight.detach().float().clone()

    handle = layer.register_forward_pre_hook(capture)
    model.loss(tokens[:, :-1], tokens[:, 1:]).backward()  # type: ignore[operator]
    handle.remove()
    grads = [p.grad.full_tensor().float() for p in model.parameters()]
    model.zero_grad()
    return seen["w"], grads


def run_rank(rank: int, world: int, init_file: str, shape: str, steps: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    bench = CONFIGS[shape]
    names = [*MODES, "torch bf16"]
    runs = {name: build(name, bench.model) for name in names}
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, bench.model.vocab_size, (bench.batch, bench.model.seq_len + 1), generator=g)
               for _ in range(steps + 1)]  # fmt: skip
    record: dict[str, Any] = {"bytes": {}, "times": {n: [] for n in names}}
    for name in MODES:  # one counted step each (the warm-up too: lazy init, allocator)
        with fl.count_wire_bytes(runs[name][0]) as sent:
            step(*runs[name], batches[0])
        record["bytes"][name] = dict(sent)
    step(*runs["torch bf16"], batches[0])
    for tokens in batches[1:]:
        for name in names:
            record["times"][name].append(step(*runs[name], tokens)[0])
    reference = {name: _gathered_and_grads(runs[name][0], batches[0]) for name in MODES}
    exact = runs["fp32"][0].blocks[0].attn.qkv.weight.full_tensor().float()  # type: ignore[index,union-attr]
    record["weight_error"] = {n: float((w - exact).norm() / exact.norm()) for n, (w, _) in reference.items()}
    record["grad_cosine"] = {}
    for name, (_, grads) in reference.items():
        base = reference[BASELINE[name]][1]
        flat = torch.cat([g.flatten() for g in grads]).double()  # float64: millions of terms
        flat_base = torch.cat([g.flatten() for g in base]).double()
        record["grad_cosine"][name] = float(flat @ flat_base / (flat.norm() * flat_base.norm()))
    if rank == 0:
        Path(out).write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


def wire_part(shape: str, world: int, steps: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        init_file, out = os.path.join(tmp, "pg"), os.path.join(tmp, "out.json")
        mp.spawn(run_rank, args=(world, init_file, shape, steps, out), nprocs=world, join=True)
        record = json.loads(Path(out).read_text())
    times = record["times"]
    record["ratios"] = {}
    for name in MODES:
        base, rival = times[BASELINE[name]], times["torch bf16"] if BASELINE[name] == "bf16" else None
        ratio = statistics.median(a / b for a, b in zip(times[name], base))
        versus = statistics.median(a / b for a, b in zip(times[name], rival)) if rival else None
        record["ratios"][name] = {"vs_default": ratio, "vs_torch_bf16": versus,
                                  "median_ms": 1000 * statistics.median(times[name])}  # fmt: skip
    return record


CONVERGENCE_MODES: dict[str, tuple[dict[str, str], list[str]]] = {  # name: (communication, train.py args)
    "bf16": ({}, []),
    "int8 all-gather": ({"all_gather": "int8"}, []),
    "all-to-all fp32": ({"reduce_scatter": "all_to_all"}, []),
    "int8 all-to-all": ({"reduce_scatter": "int8"}, []),
    # the same baseline from other seeds: how far apart final losses land with no quantization at all
    "bf16 seed 1": ({}, ["--seed", "1"]),
    "bf16 seed 2": ({}, ["--seed", "2"]),
}


def convergence_part(steps: int, modes: list[str]) -> dict[str, Any]:
    """examples/train.py under torchrun per model and mode; the losses of every step."""
    results: dict[str, Any] = {}
    policies = {name: CONVERGENCE_MODES[name] for name in ["bf16", *[m for m in modes if m != "bf16"]]}
    base_configs = {"llama-tiny": REPO / "configs" / "hf_causal_lm.yaml", "gpt": REPO / "configs" / "bf16.yaml"}
    with tempfile.TemporaryDirectory() as tmp:
        for model, base in base_configs.items():
            for mode, (comm, extra) in policies.items():
                config = Path(tmp) / f"{model}-{mode.replace(' ', '_')}.yaml"
                text = base.read_text() + (f"\ncommunication: {json.dumps(comm)}\n" if comm else "")
                config.write_text(text)
                metrics = Path(tmp) / f"{config.stem}.jsonl"
                command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(REPO / "examples" / "train.py"), "--model-config", model, "--config", str(config),
                           "--steps", str(steps), "--metrics", str(metrics), "--log-every", "1", *extra]  # fmt: skip
                done = subprocess.run(
                    command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
                )
                if done.returncode != 0:
                    raise RuntimeError(f"{model} {mode}: train.py failed\n{done.stderr[-3000:]}")
                losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines() if '"loss"' in line]
                results.setdefault(model, {})[mode] = losses
    summary = {}
    for model, modes in results.items():
        base = modes["bf16"]
        summary[model] = {mode: {"final_loss": losses[-1], "final_vs_bf16": losses[-1] / base[-1] - 1,
                                 "max_step_gap": max(abs(a - b) for a, b in zip(losses, base)), "steps": len(losses)}
                          for mode, losses in modes.items()}  # fmt: skip
    return {"losses": results, "summary": summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("wire", "convergence"), default="wire")
    parser.add_argument("--steps", type=int, default=None, help="wire: measured steps (6); convergence: 300")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--shapes", nargs="+", default=["gpt", "params"], choices=sorted(CONFIGS))
    parser.add_argument(
        "--modes", nargs="+", default=list(CONVERGENCE_MODES), choices=list(CONVERGENCE_MODES),
        help="convergence: the modes to train (bf16 always runs: the baseline)",
    )  # fmt: skip
    parser.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    started = datetime.datetime.now(datetime.timezone.utc)
    env = environment(started)  # the code that runs: read before the runs, not after
    console = Console()
    if args.part == "convergence":
        record: dict[str, Any] = {"convergence": convergence_part(args.steps or 300, args.modes)}
        table = Table(title=f"convergence: examples/train.py, {args.steps or 300} steps, 2 gloo ranks")
        rows = [[model, mode, f"{v['final_loss']:.4f}", f"{100 * v['final_vs_bf16']:+.2f}%", f"{v['max_step_gap']:.4f}"]
                for model, modes in record["convergence"]["summary"].items() for mode, v in modes.items()]  # fmt: skip
        columns = ("model", "mode", "final loss", "vs bf16", "max step gap")
    else:
        record = {"wire": {f"{shape}-w{world}": wire_part(shape, world, args.steps or 6)
                           for shape in args.shapes for world in args.worlds}}  # fmt: skip
        table = Table(title="bytes sent per rank per step, step time, error (2 and 4 gloo ranks)")
        rows = []
        for key, rec in record["wire"].items():
            for name in MODES:
                sent, ratio = rec["bytes"][name], rec["ratios"][name]
                base_total = sum(rec["bytes"][BASELINE[name]].values())
                versus = f"{ratio['vs_torch_bf16']:.3f}" if ratio["vs_torch_bf16"] is not None else "-"
                rows.append([key, name, " ".join(f"{k} {v / 1e6:.2f}" for k, v in sorted(sent.items())),
                             f"{sum(sent.values()) / base_total:.3f}", f"{ratio['vs_default']:.3f}", versus,
                             f"{rec['weight_error'][name]:.2e}", f"{rec['grad_cosine'][name]:.5f}"])  # fmt: skip
        columns = ("shape", "mode", "MB sent by kind", "bytes vs default", "time vs default", "time vs torch",
                   "weight rel. L2", "grad cosine")  # fmt: skip
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*row)
    console.print(table)
    record["command"] = shlex.join(sys.argv)
    record["environment"] = env
    if not args.no_save:
        stem = f"comm-{args.part}-cpu-{started.strftime('%Y%m%d-%H%M%S')}"
        md = f"# bench_comm ({args.part})\n\n`{record['command']}`\n\n{markdown_table(columns, rows)}\n\n"
        md += environment_markdown(record["environment"])
        for path in save_run(args.out_dir, stem, record, md):
            console.print(f"wrote {path}")
    print(json.dumps(record, default=str))


if __name__ == "__main__":
    main()
