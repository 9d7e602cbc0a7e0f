"""The planner against published runs, and the founding question answered on the clock.

What:
  1. Step time (``fsdp2lite.estimate.published``): the model's tokens/s for torchtitan's Llama-3.1-8B on
     8 x H100 and Answer.AI's Llama-2-70B QLoRA on 2 x RTX 4090 over PCIe 4, as a ratio to the published
     figure (target: within 25%), and the TFLOP/s Answer.AI's Llama-2-7B run implies (the 4090's MFU).
  2. Memory: the analytic estimate (allocated and reserved) of Answer.AI's 70B QLoRA job with CPU offload
     (batch 2 x 2048, 2 GPUs, LoRA rank 64), beside its published peak of 14.92 GiB per GPU.
  3. The founding question: ``fsdp2lite estimate --model llama-3-70b --world-size 4 --budget 24GiB --link
     pcie4 --gpu rtx4090``, its answer and its wall time (target: within 30 s), in a fresh process.

How to run (about a minute on 2 CPU cores; no GPU):
    CUDA_VISIBLE_DEVICES= .venv/bin/python benchmarks/bench_published.py [--no-save]
Writes ``results/published-cpu-<YYYYmmdd-HHMMSS>.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from _results import HERE, environment, environment_markdown, markdown_table, save_run

import fsdp2lite as fl
from fsdp2lite.estimate.published import CALIBRATION, PUBLISHED, SHAPES, check, implied_tflops
from fsdp2lite.estimate.timing import GPUS

ANSWERAI_PEAK_GIB = 14.92  # benchmarks_03_2024.md, Dual 4090, Llama-2 70B QLoRA with CPU offload, batch 2
FOUNDING = ["--model", "llama-3-70b", "--world-size", "4", "--budget", "24GiB", "--link", "pcie4", "--gpu", "rtx4090"]


def step_time_rows() -> list[dict[str, object]]:
    rows = []
    for name, point in PUBLISHED.items():
        result = check(point)
        rows.append(
            {
                "point": name,
                "model_tokens_per_s": round(result.time.tokens_per_s, 1),
                "published_tokens_per_s": round(point.tokens_per_s, 1),
                "ratio": round(result.ratio, 3),
                "compute_s": round(result.time.compute_s, 3),
                "comm_s": round(result.time.comm_s, 3),
                "h2d_s": round(result.time.h2d_s, 3),
                "exposed_comm_s": round(result.time.exposed_comm_s, 3),
                "flops_per_token": result.flops_per_token,
                "params": result.params,
                "trainable": result.trainable,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def answerai_memory() -> dict[str, object]:
    import transformers

    config = transformers.LlamaConfig(**SHAPES["llama-2-70b"])
    point = PUBLISHED["answerai-llama2-70b-qlora-2x4090"]
    policy = fl.FSDPConfig.model_validate(
        {
            "mixed_precision": {"param_dtype": "bf16", "reduce_dtype": "fp32"},
            "wrap": [{"match": {"class": "LlamaDecoderLayer"}, "activation_checkpointing": True}],
            "offload": {"device": "cpu"},
        }
    )
    estimate = fl.estimate_memory(
        lambda: transformers.AutoModelForCausalLM.from_config(config), policy, world_size=2, batch=2, seq=2048,
        method="analytic", finetune=point.finetune,
    )  # fmt: skip
    return {
        "allocated_gib": round(estimate.peak_bytes / 2**30, 2),
        "reserved_gib": round(estimate.reserved_bytes / 2**30, 2),
        "host_gib_per_machine": round(2 * estimate.host_bytes / 2**30, 1),
        "published_peak_gib": ANSWERAI_PEAK_GIB,
        "reserved_ratio": round(estimate.reserved_bytes / 2**30 / ANSWERAI_PEAK_GIB, 3),
    }


def founding_question() -> dict[str, object]:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    begin = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "fsdp2lite", "estimate", *FOUNDING, "--json"], capture_output=True, text=True, env=env
    )
    seconds = time.perf_counter() - begin
    record = json.loads(done.stdout.strip().splitlines()[-1])
    keys = ("finetune", "peak_bytes", "reserved_bytes", "host_bytes_per_machine", "tokens_per_s", "step_s")
    choice = {key: record[key] for key in keys}
    return {"command": "fsdp2lite estimate " + " ".join(FOUNDING), "seconds": round(seconds, 1), **choice,
            "activation_checkpointing": record["budget"]["choice"]["activation_checkpointing"],
            "offload": record["budget"]["choice"]["offload"]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=HERE / "results")
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    started = datetime.datetime.now()
    rows = step_time_rows()
    tflops = implied_tflops(CALIBRATION)
    calibration = {"implied_tflops": round(tflops, 1), "implied_mfu": round(tflops / GPUS["rtx4090"].tflops, 3),
                   "mfu_used": GPUS["rtx4090"].mfu}  # fmt: skip
    memory = answerai_memory()
    founding = founding_question()
    print(json.dumps({"calibration": calibration, "answerai_memory": memory, "founding": founding}), flush=True)
    record = {"environment": environment(started), "step_time": rows, "calibration": calibration,
              "answerai_memory": memory, "founding": founding}  # fmt: skip
    table = markdown_table(
        ("published run", "model tokens/s", "published tokens/s", "ratio", "compute s", "comm s", "host s"),
        [[str(r["point"]), f"{r['model_tokens_per_s']:,}", f"{r['published_tokens_per_s']:,}", f"{r['ratio']:.3f}",
          str(r["compute_s"]), str(r["comm_s"]), str(r["h2d_s"])] for r in rows],
    )  # fmt: skip
    md = (
        f"# The planner against published runs\n\n{environment_markdown(record['environment'])}\n{table}\n"
        f"RTX 4090 calibration (Answer.AI Llama-2-7B QLoRA): {calibration}\n\n"
        f"Answer.AI Llama-2-70B QLoRA memory per GPU: {memory}\n\n"
        f"Founding question: `{founding['command']}`: {founding}\n"
    )
    if not args.no_save:
        stamp = started.strftime("%Y%m%d-%H%M%S")
        print("saved", *save_run(args.out_dir, f"published-cpu-{stamp}", record, md))


if __name__ == "__main__":
    main()
