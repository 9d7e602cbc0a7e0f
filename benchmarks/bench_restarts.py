"""How often ``torchrun --max-restarts`` brings a job back after a rank is SIGKILLed (issue 24).

    .venv/bin/python benchmarks/bench_restarts.py [--trials 10]

Every trial is one ``torchrun --standalone --nproc-per-node 2 --max-restarts 2`` (the c10d rendezvous,
torchrun's shared TCPStore) on CPU/gloo, side by side in one run:

- ``torch``: a minimal worker joining with ``dist.init_process_group("gloo")``; rank 1 kills itself
  after the first all-reduce of the first attempt. Passes when torchrun exits 0 with both ranks done;
- ``fsdp2lite``: the same worker joining with ``fl.init_process_group("gloo")``
  ([Note: restart attempts]);
- ``train step``: ``examples/train.py`` (llama-tiny, 6 steps, a checkpoint every 2) with rank 1
  killed after step 3 (``FSDP2LITE_FAULT=1:step:3``) and ``--resume latest``;
- ``train save``: the same with rank 0 killed while the step-4 checkpoint is written
  (``FSDP2LITE_FAULT=0:save:4``).

The train cases pass when torchrun exits 0, resumed from step 2, and every step's loss equals the
uninterrupted run's, bit for bit. The counts go to ``benchmarks/results/restarts-cpu-*.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _results import environment, environment_markdown, markdown_table, save_run

REPO = Path(__file__).resolve().parents[1]
TRAIN = [
    "--seq", "32", "--batch", "2", "--grad-accum", "2", "--steps", "6", "--warmup-steps", "2",
    "--log-every", "1", "--save-every", "2", "--resume", "latest",
]  # fmt: skip
WORKER = """
import os, signal, sys
import torch, torch.distributed as dist
if sys.argv[1] == "fsdp2lite":
    import fsdp2lite as fl
    fl.init_process_group("gloo", timeout=20)
else:
    import datetime
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
t = torch.ones(1)
dist.all_reduce(t)
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and dist.get_rank() == 1:
    os.kill(os.getpid(), signal.SIGKILL)
dist.all_reduce(t)
print("done", os.environ["TORCHELASTIC_RESTART_COUNT"], flush=True)
dist.destroy_process_group()
os._exit(0)
"""


def torchrun(args: list[str], cwd: Path, extra_env: dict[str, str], timeout: float) -> tuple[int, str, str, float]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO), **extra_env}
    started = time.perf_counter()
    try:
        run = subprocess.run(command + args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        return 124, out, "timed out", time.perf_counter() - started
    return run.returncode, run.stdout, run.stderr, time.perf_counter() - started


def losses(path: Path) -> dict[int, float]:
    """The last logged loss of each step (a step logged twice: the restarted attempt's)."""
    if not path.exists():
        return {}
    return {line["step"]: line["loss"] for line in map(json.loads, path.read_text().splitlines())}


def worker_trial(kind: str, work: Path) -> tuple[bool, str]:
    script = work / "worker.py"
    script.write_text(WORKER)
    code, out, err, _ = torchrun(["--max-restarts", "2", str(script), kind], work, {}, timeout=150)
    ok = code == 0 and out.count("done") == 2
    reason = "" if ok else _why(code, err)
    return ok, reason


def train_trial(fault: str, work: Path, reference: dict[int, float], trial: int) -> tuple[bool, str]:
    name = f"{fault.replace(':', '-')}-{trial}"
    args = ["--max-restarts", "2", str(REPO / "examples" / "train.py"), *TRAIN]
    args += ["--checkpoint-dir", f"ck-{name}", "--metrics", f"{name}.jsonl"]
    code, out, err, _ = torchrun(args, work, {"FSDP2LITE_FAULT": fault}, timeout=300)
    if code != 0:
        return False, _why(code, err)
    final = json.loads(out.strip().splitlines()[-1])
    if final["resumed_from"] != f"ck-{name}/step-0000002":
        return False, f"resumed from {final['resumed_from']}"
    got = losses(work / f"{name}.jsonl")
    return (True, "") if got == reference else (False, f"losses differ: {got} vs {reference}")


def _why(code: int, err: str) -> str:
    for needle in ("connectFullMesh", "Connection refused", "timed out", "Timeout"):
        if needle in err:
            return f"exit {code}: {needle}"
    return f"exit {code}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    started = datetime.datetime.now(datetime.timezone.utc)
    env = environment(started)  # the code that runs: read before the trials, not after
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        reference_args = [str(REPO / "examples" / "train.py"), *TRAIN, "--checkpoint-dir", "ck-ref"]
        code, _, err, _ = torchrun([*reference_args, "--metrics", "ref.jsonl"], work, {}, 300)
        if code != 0:
            raise SystemExit(f"the uninterrupted reference run failed:\n{err[-2000:]}")
        reference = losses(work / "ref.jsonl")
        cases = {
            "torch: dist.init_process_group": lambda t: worker_trial("torch", work),
            "fsdp2lite: fl.init_process_group": lambda t: worker_trial("fsdp2lite", work),
            "train.py, rank 1 killed after step 3": lambda t: train_trial("1:step:3", work, reference, t),
            "train.py, rank 0 killed writing step 4": lambda t: train_trial("0:save:4", work, reference, t),
        }
        for case, trial_fn in cases.items():
            outcomes = []
            for trial in range(args.trials):
                ok, reason = trial_fn(trial)
                outcomes.append(reason or "ok")
                print(f"{case}: trial {trial + 1}: {'ok' if ok else 'FAILED ' + reason}", flush=True)
            results[case] = {"passed": outcomes.count("ok"), "trials": args.trials, "outcomes": outcomes}
    columns = ("case", "passed", "failures")
    rows = [[case, f"{r['passed']}/{r['trials']}", ", ".join(sorted({o for o in r["outcomes"] if o != "ok"})) or "-"]
            for case, r in results.items()]  # fmt: skip
    record: dict[str, Any] = {"results": results, "command": " ".join(sys.argv), "environment": env}
    md = "# bench_restarts\n\n`" + record["command"] + "`\n\n"
    md += "torchrun --standalone --nproc-per-node 2 --max-restarts 2 (c10d rendezvous, shared store), CPU/gloo; "
    md += "one rank SIGKILLed in the first attempt.\n\n" + markdown_table(columns, rows) + "\n\n"
    md += environment_markdown(record["environment"])
    print(md)
    if not args.no_save:
        for path in save_run(args.out_dir, f"restarts-cpu-{started.strftime('%Y%m%d-%H%M%S')}", record, md):
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
