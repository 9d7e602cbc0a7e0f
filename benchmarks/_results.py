"""Where a benchmark run came from, and its files: machine, versions, command line, timestamp.

``environment(started)`` is the record every result file starts with; ``save_run`` writes
``<out_dir>/<name>-<device>-<YYYYmmdd-HHMMSS>.json`` and a ``.md`` beside it; ``finish_run`` is a run's end:
those files (unless not saving), then the one JSON line a benchmark prints last.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

import fsdp2lite

HERE = Path(__file__).resolve().parent  # git runs here: the repository the benchmark lives in


def cpu_model() -> str:
    """The "model name" line of /proc/cpuinfo, else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def git_state() -> dict[str, Any]:
    """HEAD and the uncommitted files: fsdp2lite's version number alone does not say which code ran."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], capture_output=True, text=True, check=True, timeout=10, cwd=HERE
        ).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"), "uncommitted": git("status", "--porcelain").splitlines()}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "uncommitted": []}


def environment(started: datetime.datetime) -> dict[str, Any]:
    return {
        "timestamp": started.isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]),
        "cwd": os.getcwd(),
        "machine": {
            "cpu_model": cpu_model(),
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "hostname": platform.node(),
        },
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "fsdp2lite": fsdp2lite.__version__,
        },
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "git": git_state(),
    }


def environment_markdown(env: dict[str, Any]) -> str:
    machine, versions, git = env["machine"], env["versions"], env["git"]
    return (
        f"- machine: {machine['cpu_model']}, {machine['cpu_count']} cores, {machine['platform']}"
        f"{', GPU ' + env['gpu'] if env.get('gpu') else ''}\n"
        f"- versions: python {versions['python']}, torch {versions['torch']}, fsdp2lite {versions['fsdp2lite']}\n"
        f"- git: {git['commit']}, {len(git['uncommitted'])} uncommitted files\n"
        f"- command: `{env['command']}`\n- timestamp: {env['timestamp']}\n"
    )


def markdown_table(columns: tuple[str, ...], rows: list[list[str]]) -> str:
    head = "| " + " | ".join(columns) + " |\n|" + " --- |" * len(columns) + "\n"
    return head + "".join("| " + " | ".join(row) + " |\n" for row in rows)


def save_run(out_dir: Path, stem: str, record: dict[str, Any], md: str) -> list[str]:
    """Write ``<out_dir>/<stem>.json`` (``record``, indented) and ``<stem>.md``; their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    json_path.write_text(json.dumps(record, indent=2) + "\n")
    md_path.write_text(md)
    return [str(json_path), str(md_path)]


def finish_run(
    console: Any, out_dir: Path, stem: str | None, env: dict[str, Any], summary: dict[str, Any], md: str, start: float
) -> dict[str, Any]:
    """A run's end: ``save_run`` (``{**env, **summary}`` and ``md``) unless ``stem`` is None, each path said on
    ``console``; then the record (``env``, ``wall_s`` since ``start`` by ``time.perf_counter``, the files,
    ``summary``) printed as one JSON line, and returned."""
    files = [] if stem is None else save_run(out_dir, stem, {**env, **summary}, md)
    for path in files:
        console.print(f"wrote {path}", highlight=False)
    record = {**env, "wall_s": round(time.perf_counter() - start, 1), "files": files, **summary}
    print(json.dumps(record))
    return record


def gpt_title(summary: dict[str, Any]) -> str:
    """A summary's GPT and batch in a title: ``GPT d512 x 4 layers, vocab 8192, seq 64 (16.8M params), batch 1
    per rank`` (``summary["model"]``: a ``GPTConfig`` as a dict; ``n_params``; ``batch_per_rank``)."""
    model = summary["model"]
    return (
        f"GPT d{model['d_model']} x {model['n_layers']} layers, vocab {model['vocab_size']}, seq {model['seq_len']} "
        f"({summary['n_params'] / 1e6:.1f}M params), batch {summary['batch_per_rank']} per rank"
    )
