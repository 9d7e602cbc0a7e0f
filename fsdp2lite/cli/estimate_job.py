"""``fsdp2lite estimate --budget --write-config``: the chosen setting written as a job.

Two things come out ([Note: a written job]): a policy file holding only the settings that differ from
the defaults, each with the schema's description above it (``config.minimal``), and the complete
``examples/train.py`` command that runs it.

[Note: a written job]
The command names everything a run needs, so that pasting it is the next step: the data (``--data``,
a placeholder unless given), the weights, the fine-tuning kind and LoRA's settings, activation
checkpointing, the per-rank batch and sequence the estimate assumed, the gradient accumulation that
makes ``--global-batch`` sequences per optimizer step, a learning rate for the method (``ADAPTER_LR``,
2e-4, for LoRA and QLoRA, the rate peft's and QLoRA's recipes use; ``FULL_LR``, 2e-5, for full
fine-tuning from weights), and restartability: ``--checkpoint-dir`` next to the policy file's name,
``--save-every`` about every half hour at the estimated step time, and ``--resume latest`` (a first run
starts fresh; a requeued one continues).
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from .._units import short_float
from ..config import FSDPConfig
from ..config.minimal import check_minimal, minimal_yaml
from ..finetune.lora import ADAPTER_LR
from ._hf_models import TRAIN_PRESETS
from .estimate_search import SearchJob, config_for_setting
from .estimate_text import grad_accum

FULL_LR = 2e-5  # full fine-tuning of pretrained weights (examples/train.py's own default trains from scratch)
CHECKPOINT_EVERY_S = 1800  # --save-every aims at a checkpoint about this often
DATA_PLACEHOLDER = "PATH/TO/train.jsonl"
THREADS = "OMP_NUM_THREADS=1"  # torchrun's own default, said: torchrun warns once per job when it sets it itself


def write_config(path: str, base: FSDPConfig, choice: dict[str, Any], model: Any, header: list[str]) -> None:
    """The chosen setting as a minimal, commented policy file (read back equal before it is kept);
    ``model``: the meta model the choice was planned on (a per-group offload finds its groups in it)."""
    config = config_for_setting(base, choice, model)
    lines = [*header]
    if choice.get("optimizer_state") == "nvme":
        lines.append(f"nvme_path {choice['nvme_path']} (--nvme-path): a directory on a local NVMe drive")
    text = minimal_yaml(config, [*lines, "only the settings that differ from the defaults: fsdp2lite schema lists all"])
    check_minimal(text, config)
    Path(path).write_text(text, encoding="utf-8")


def train_arguments(
    path: str, choice: dict[str, Any], job: SearchJob, model_spec: str, run: dict[str, Any]
) -> list[str]:
    """The ``examples/train.py`` command's words for the chosen setting ([Note: a written job]); ``run``:
    data, tokenizer (or None), global_batch, steps."""
    world, batch, seq = job.common["world_size"], job.common["batch"], job.common["seq"]
    nodes = -(-world // job.ranks_per_node)
    launch = [THREADS, "torchrun", "--standalone", "--nproc-per-node", str(world)]
    if nodes > 1:
        launch = [THREADS, "torchrun", "--nnodes", str(nodes), "--nproc-per-node", str(job.ranks_per_node)]
        launch += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "HOST:29500"]
    words = [*launch, "examples/train.py", "--config", path, *model_words(model_spec), "--data", run["data"]]
    if run.get("tokenizer"):
        words += ["--tokenizer", run["tokenizer"]]
    kind = choice["finetune"]
    words += ["--finetune", kind]
    if kind != "full":
        words += ["--lora-rank", str(job.finetune.rank), "--lora-targets", ",".join(job.finetune.targets)]
    words.append(
        "--activation-checkpointing" if choice["activation_checkpointing"] else "--no-activation-checkpointing"
    )
    accum = grad_accum(run["global_batch"], batch, world)
    words += ["--batch", str(batch), *(["--seq", str(seq)] if seq else []), "--grad-accum", str(accum)]
    words += ["--lr", short_float(FULL_LR if kind == "full" else ADAPTER_LR), "--steps", str(run["steps"])]
    every = max(1, round(CHECKPOINT_EVERY_S / max(choice["step_s"] * accum, 1e-9)))
    words += ["--checkpoint-dir", f"checkpoints/{Path(path).stem}", "--save-every", str(min(every, run["steps"]))]
    words += ["--resume", "latest"]
    if job.common["device"] == "cpu":
        words += ["--device", "cpu"]
    return words


def model_words(model_spec: str) -> list[str]:
    """How train.py gets the model ``estimate --model`` named: a directory with safetensors files as
    ``--weights``; one with only a config, or a preset train.py builds, as ``--model-config`` (a random
    init: a rehearsal); any other preset as ``--weights PATH/TO/NAME`` (its checkpoint, to be downloaded)."""
    path = Path(model_spec)
    if path.is_dir():
        return ["--weights" if any(path.glob("*.safetensors")) else "--model-config", model_spec]
    if path.name == "config.json" and path.is_file():
        return ["--model-config", str(path.parent)]
    if model_spec in TRAIN_PRESETS:
        return ["--model-config", model_spec]
    return ["--weights", f"PATH/TO/{model_spec.removeprefix('hf:')}"]


def one_line(words: list[str]) -> str:
    return " ".join(word if word == THREADS else shlex.quote(word) for word in words)


def shown_command(words: list[str]) -> str:
    """The command as a person would paste it: the launcher and script on the first line, then one option
    (with its value) per line, continued with backslashes."""
    at = words.index("examples/train.py") + 1
    lines = [one_line(words[:at])]
    for word in words[at:]:
        if word.startswith("--"):
            lines.append(shlex.quote(word))
        else:
            lines[-1] += " " + shlex.quote(word)
    return " \\\n    ".join(lines)
