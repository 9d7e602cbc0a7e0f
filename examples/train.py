"""Train a causal language model with fsdp2lite, launched the way FSDP jobs are run: one process per
GPU (or per CPU slot), started by torchrun.

One machine, N processes (N GPUs with NCCL; without CUDA, N CPU processes with gloo):

    torchrun --standalone --nproc-per-node N examples/train.py --config configs/hf_causal_lm.yaml \\
        --model-config llama-tiny --data examples/data/sample.txt --steps 200

Many machines (the same command on every node; HOST:PORT is one node every node can reach):

    torchrun --nnodes M --nproc-per-node G --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        --rdzv-id my-job examples/train.py --config ... --checkpoint-dir /shared/ckpt --resume latest

Slurm, in a batch script (one torchrun per node; the allocation's first node is the rendezvous host):

    head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
    srun torchrun --nnodes "$SLURM_NNODES" --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint "$head:29500" --rdzv-id "$SLURM_JOB_ID" examples/train.py ... --resume latest

``python examples/train.py ...`` without torchrun runs one process (world size 1). Nothing is
downloaded: models come from a preset or a local directory, data from a local file or directory.

The steps, as the code below reads:
  1. join the process group (NCCL bound to this process's GPU, or gloo on CPU)
  2. build the model on the meta device and shard it as the YAML config says (no memory yet)
  3. fill it: from a local checkpoint (--weights), each rank reading only its own rows of each tensor
     (--finetune qlora: quantizing them to NF4); or from rank 0's seeded random init, with one broadcast
     per tensor (--finetune lora|qlora without --weights: every rank builds the seeded base whole)
  4. tokenize the data and give each data-parallel rank its own part (DistributedSampler); a .jsonl file of
     instruction data is loss-masked and packed (fsdp2lite.finetune.data; docs/finetune.md)
  5. train: gradient accumulation, clipping, AdamW (on torch's fused CPU kernel for the parameters a
     config offloads to the host: fsdp2lite.fast_host_step; with --step-in-backward one AdamW per group,
     stepped inside backward: fsdp2lite.step_in_backward), checkpoints every --save-every steps
  6. report: progress on rank 0 (loss, tokens/s, peak memory), a final JSON line
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor
from torch.utils.data import DistributedSampler

import fsdp2lite as fl
from fsdp2lite import finetune
from fsdp2lite._units import short_float
from fsdp2lite.finetune import data
from fsdp2lite.models import GPT, GPTConfig
from fsdp2lite.quiet import quiet_known_noise, refuse

REPO = Path(__file__).resolve().parents[1]
SAMPLE_DATA = REPO / "examples" / "data" / "sample.txt"
HF_CONFIG = REPO / "configs" / "hf_causal_lm.yaml"
GPT_CONFIG = REPO / "configs" / "bf16.yaml"
T = TypeVar("T")

# Model presets: small shapes for trying things, one real shape for GPUs. Dropout is off in all of
# them; a model directory with dropout still resumes exactly (the RNG is seeded per step and rank).
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-tiny": (
        "LlamaConfig",
        dict(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=176,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1024,
        ),
    ),
    "llama-1b": (  # Llama 3.2 1B's shape (random init)
        "LlamaConfig",
        dict(
            vocab_size=128256,
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            max_position_embeddings=8192,
            tie_word_embeddings=True,
        ),
    ),
    "gpt2-tiny": (
        "GPT2Config",
        dict(
            vocab_size=256,
            n_embd=64,
            n_layer=4,
            n_head=4,
            n_positions=1024,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        ),
    ),
    "gpt": ("fsdp2lite", dict(vocab_size=256, d_model=128, n_heads=4, n_layers=4)),  # fsdp2lite.models.GPT
}


class UsageError(Exception):
    """A bad argument or input file; the message names it and says what would work."""


# ---- 0. arguments ---------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # every rank exits 2; the job says it once (fsdp2lite.quiet.refuse)
        sys.exit(refuse(f"{self.format_usage()}{self.prog}: error: {message}", launcher_rank()))


class _Defaults(argparse.HelpFormatter):
    """--help names every option's default (unless its help already says it, or it has none)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if "default" in text or default is None or default is False or default == argparse.SUPPRESS:
            return text
        return f"{text} (default: %(default)s)".lstrip()


# --lr's default per --finetune: the toy models train from scratch at 3e-3; adapters at LoRA's usual rate
LEARNING_RATES = {"full": 3e-3, "lora": finetune.ADAPTER_LR, "qlora": finetune.ADAPTER_LR}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = _Parser(prog="examples/train.py", description=__doc__.split("\n\n")[0], formatter_class=_Defaults)
    p.add_argument(
        "--config",
        type=Path,
        help=f"fsdp2lite policy YAML (default: {HF_CONFIG.relative_to(REPO)}, "
        f"or {GPT_CONFIG.relative_to(REPO)} for --model-config gpt)",
    )
    p.add_argument(
        "--model-config",
        help=f"a preset ({', '.join(PRESETS)}) or a local directory with a "
        "Hugging Face config.json (random init); default llama-tiny, or --weights' config",
    )
    p.add_argument("--weights", type=Path, help="a local Hugging Face checkpoint directory to start from")
    p.add_argument(
        "--tokenizer",
        default="auto",
        help="auto (the model directory's tokenizer if it has one, else bytes), bytes, or a local tokenizer directory",
    )
    p.add_argument(
        "--data",
        type=Path,
        default=SAMPLE_DATA,
        help="a text file, a directory of .txt files, or a .jsonl file of instruction data: text, prompt/completion "
        "or chat messages, the loss on the completions and assistant turns only (docs/finetune.md; default: "
        f"{SAMPLE_DATA.relative_to(REPO)})",
    )
    p.add_argument("--seq", type=int, default=128, help="tokens per sample")
    p.add_argument("--batch", type=int, default=4, help="samples per microbatch per data-parallel rank")
    p.add_argument("--grad-accum", type=int, default=1, help="microbatches per optimizer step")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps to reach (counting resumed ones)")
    p.add_argument(
        "--lr",
        type=float,
        default=None,
        help=f"peak learning rate (default: {short_float(LEARNING_RATES['full'])} for --finetune full, "
        f"{short_float(LEARNING_RATES['lora'])} for lora and qlora); linear warmup, then cosine decay to a tenth",
    )
    p.add_argument("--warmup-steps", type=int, default=10, help="steps of linear warmup")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW's decoupled weight decay")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="clip gradients to this total norm (0: off)")
    p.add_argument(
        "--step-in-backward",
        action="store_true",
        help="one AdamW per fsdp2lite group, stepped inside backward as its gradients land (fsdp2lite."
        "step_in_backward): no gradients kept for a step; offloaded from a GPU, the host steps overlap the "
        "backward. Needs --max-grad-norm 0 (no global norm exists) and --finetune full",
    )
    p.add_argument("--seed", type=int, default=0, help="model init, data order and dropout")
    p.add_argument("--checkpoint-dir", type=Path, help="save here every --save-every steps and at the end")
    p.add_argument("--save-every", type=int, default=0, help="steps between checkpoints (0: only at the end)")
    p.add_argument(
        "--resume",
        help="a checkpoint directory (step-NNNNNNN), or 'latest' in --checkpoint-dir "
        "(starts fresh when there is none, so a requeued job can always pass it)",
    )
    p.add_argument("--log-every", type=int, default=10, help="steps between progress lines")
    p.add_argument("--metrics", type=Path, help="rank 0 appends one JSON line per logged step here")
    p.add_argument(
        "--device",
        choices=("auto", "cuda", "cpu"),
        default="auto",
        help="auto: CUDA (NCCL) when a GPU is visible, else CPU (gloo)",
    )
    p.add_argument(
        "--pg-timeout",
        type=float,
        default=600.0,
        help="seconds a collective or the rendezvous may wait for a peer before failing (so torchrun can "
        "restart a job that lost a rank); default 600",
    )
    add_finetune_arguments(p)
    args = p.parse_args(argv)
    if not args.pg_timeout > 0:
        p.error(f"--pg-timeout must be a positive number of seconds, got {args.pg_timeout:g}")
    try:
        args.fault = parse_fault(os.environ.get(FAULT_VARIABLE, ""))
    except UsageError as exc:
        p.error(str(exc))
    for name in ("seq", "batch", "grad_accum", "log_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    for name in ("steps", "save_every", "warmup_steps"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be 0 or more, got {getattr(args, name)}")
    if args.step_in_backward and args.max_grad_norm:
        p.error(
            "--step-in-backward steps each group inside backward, before the other groups' gradients exist, so "
            f"nothing can clip by their global norm: pass --max-grad-norm 0 with it (got {args.max_grad_norm:g})"
        )
    if args.step_in_backward and args.finetune != "full":
        p.error(f"--step-in-backward trains --finetune full only, got --finetune {args.finetune}")
    if args.resume and args.resume == "latest" and args.checkpoint_dir is None:
        p.error("--resume latest needs --checkpoint-dir (where to look for checkpoints)")
    try:
        args.lora = finetune.LoraSettings(
            args.lora_rank, args.lora_alpha, args.lora_dropout, tuple(t.strip() for t in args.lora_targets.split(","))
        )
    except ValueError as exc:
        p.error(str(exc).replace("lora ", "--lora-", 1))
    if args.lr is None:
        args.lr = LEARNING_RATES[args.finetune]
    if not args.lr > 0:
        p.error(f"--lr must be a positive number, got {args.lr:g}")
    if args.activation_checkpointing is None:  # on by default for lora/qlora
        args.activation_checkpointing = args.finetune != "full"
    return args


def add_finetune_arguments(p: argparse.ArgumentParser) -> None:
    """--finetune and LoRA's knobs (fsdp2lite.finetune; docs/finetune.md)."""
    p.add_argument(
        "--finetune",
        choices=("full", "lora", "qlora"),
        default="full",
        help="full: train every parameter; lora: peft LoRA adapters on a frozen bf16 base; qlora: the same on a "
        f"frozen torchao NF4 base (both need {finetune.INSTALL_HINT}, from a clone)",
    )
    p.add_argument("--lora-rank", type=int, default=16, help="LoRA rank r (default 16)")
    p.add_argument("--lora-alpha", type=float, default=32.0, help="LoRA alpha; the update is scaled by alpha / rank")
    p.add_argument("--lora-dropout", type=float, default=0.0, help="dropout on the adapters' input, in [0, 1)")
    p.add_argument(
        "--lora-targets",
        default=",".join(finetune.DEFAULT_TARGETS),
        help="comma list of module names that get adapters (default: Llama's attention and MLP projections)",
    )
    # a testing aid: --finetune with --weights the old way, every rank loading the whole base (the oracle
    # of the per-rank load in tests/test_finetune_weights.py)
    p.add_argument("--load-whole-base", action="store_true", help=argparse.SUPPRESS)
    p.add_argument(
        "--activation-checkpointing",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="recompute each decoder layer's forward in backward (default: on for lora/qlora, off for full)",
    )


# ---- 1. the process group ---------------------------------------------------------------------------
@dataclass
class Job:
    """This process's place in the job."""

    rank: int  # this process among all of them; also its data-parallel rank (every rank is data parallel)
    world_size: int
    device: torch.device
    backend: str


def join_process_group(args: argparse.Namespace) -> Job:
    """torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; without it, one process."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    local_rank = int(os.environ["LOCAL_RANK"])
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is visible to this process; use --device cpu (gloo)")
    if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()):
        if local_rank >= torch.cuda.device_count():
            raise UsageError(
                f"LOCAL_RANK {local_rank} but this node shows {torch.cuda.device_count()} GPUs: "
                "start at most one process per GPU (--nproc-per-node)"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)  # this process's GPU, before any CUDA work
        # device_id: NCCL bound to that GPU at once; keys private to this restart attempt
        fl.init_process_group("nccl", device_id=device, timeout=args.pg_timeout)
    else:
        device = torch.device("cpu")
        fl.init_process_group("gloo", timeout=args.pg_timeout)  # survives torchrun's restarts
    return Job(dist.get_rank(), dist.get_world_size(), device, dist.get_backend())


# A testing aid: FSDP2LITE_FAULT="RANK:step:N" makes rank RANK kill itself (SIGKILL) after optimizer step N,
# "RANK:save:N" while the step-N checkpoint is being written (its shards on disk, the directory not yet
# marked finished); only in torchrun's first attempt (TORCHELASTIC_RESTART_COUNT 0), so a restart can finish.
FAULT_VARIABLE = "FSDP2LITE_FAULT"


@dataclass(frozen=True)
class Fault:
    rank: int
    point: str  # "step" or "save"
    step: int

    def strike(self, job: Job, point: str, step: int) -> None:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first_attempt and (job.rank, point, step) == (self.rank, self.point, self.step):
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)


def parse_fault(value: str) -> Fault | None:
    if not value:
        return None
    parts = value.split(":")
    if len(parts) != 3 or parts[1] not in ("step", "save") or not (parts[0].isdigit() and parts[2].isdigit()):
        raise UsageError(f"{FAULT_VARIABLE}={value!r}: expected RANK:step:N or RANK:save:N, e.g. 1:step:3")
    return Fault(int(parts[0]), parts[1], int(parts[2]))


def on_every_rank(job: Job, what: str, fn: Callable[[], T]) -> T:
    """Run ``fn`` on every rank; if it fails on any of them, every rank learns it and raises ``SetupFailed``,
    so no rank is left waiting in a collective the others never reach."""
    result, error = None, None
    try:
        result = fn()
    except (UsageError, ValueError, TypeError, OSError) as exc:  # incl. fl.ConfigError, fl.CheckpointError
        error = str(exc)  # fsdp2lite's errors for bad input name the culprit and what would work
    except Exception:  # anything else may be a bug: keep the whole traceback
        error = traceback.format_exc()
    errors: list[str | None] = [None] * job.world_size
    dist.all_gather_object(errors, error)
    failed = {e: [r for r, x in enumerate(errors) if x == e] for e in errors if e is not None}
    if failed:
        raise SetupFailed(what, failed, job.world_size)
    return result  # type: ignore[return-value]


class SetupFailed(Exception):
    """Every rank's distinct failure of one step, each once; a message that starts by naming what ``what``
    names ("loading w" and "w: cannot load into the model: ...") says it once."""

    def __init__(self, what: str, failed: dict[str, list[int]], world_size: int) -> None:
        lines = []
        subject = what.partition(" ")[2]  # "loading w" -> "w"
        for message, ranks in failed.items():
            where = "" if len(ranks) == world_size else f" (rank {', '.join(map(str, ranks))})"
            lines.append(f"error while {what}{where}: {message.removeprefix(f'{subject}: ')}")
        super().__init__("\n".join(lines))


# ---- 2 and 3. the model -----------------------------------------------------------------------------
@dataclass
class ModelSpec:
    label: str  # what the user asked for: a preset name or a directory
    hf_config: Any  # a transformers PretrainedConfig, or None for fsdp2lite's GPT
    gpt_config: Any  # fsdp2lite.models.GPTConfig, or None
    directory: Path | None  # where config (and maybe tokenizer) came from

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size if self.hf_config is not None else self.gpt_config.vocab_size)

    @property
    def max_positions(self) -> tuple[str, int] | None:
        """(the config key, its value): the longest sequence the model's config allows."""
        for key in ("max_position_embeddings", "n_positions"):
            if self.hf_config is not None and isinstance(getattr(self.hf_config, key, None), int):
                return key, getattr(self.hf_config, key)
        return None  # fsdp2lite's GPT is built for --seq


def resolve_model(args: argparse.Namespace) -> ModelSpec:
    """The model's config: a preset, ``--model-config DIR``, or ``--weights DIR``'s own config.json
    (read on every rank, so DIR must be readable on every node; each rank reads its own rows of the weights)."""
    if args.weights is not None and args.model_config is not None:
        raise UsageError(
            f"--weights {args.weights} and --model-config {args.model_config}: pass one; a checkpoint "
            "directory brings its own config.json"
        )
    if args.weights is not None:
        flag, name = "--weights", str(args.weights)
    else:
        flag, name = "--model-config", args.model_config or "llama-tiny"
    if flag == "--model-config" and name in PRESETS:
        kind, fields = PRESETS[name]
        if kind == "fsdp2lite":
            return ModelSpec(name, None, GPTConfig(seq_len=args.seq, **fields), None)
        return ModelSpec(name, getattr(_transformers(), kind)(**fields), None, None)
    directory = Path(name)
    if not (directory / "config.json").is_file():
        what = "has no config.json" if directory.is_dir() else "does not exist"
        presets = f"not a preset ({', '.join(PRESETS)}) and " if flag == "--model-config" else ""
        raise UsageError(
            f"{flag} {name}: {presets}{what}; pass {'a preset or ' * bool(presets)}a local directory written by "
            "save_pretrained (nothing is downloaded)"
        )
    config = _transformers().AutoConfig.from_pretrained(directory, local_files_only=True)
    return ModelSpec(str(directory), config, None, directory)


def _transformers() -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the network
    try:
        import transformers
    except ImportError:
        raise UsageError(
            "Hugging Face models need transformers: pip install transformers (fsdp2lite's [hf] extra), "
            "or use --model-config gpt"
        ) from None
    transformers.logging.set_verbosity_error()
    return transformers


def new_model(spec: ModelSpec) -> nn.Module:
    """The model, unsharded and randomly initialized (on the meta device when called under it)."""
    if spec.gpt_config is not None:
        return GPT(spec.gpt_config)
    return _transformers().AutoModelForCausalLM.from_config(spec.hf_config)


def shard_on_meta(spec: ModelSpec, config: fl.FSDPConfig, job: Job) -> nn.Module:
    """Shard the model while it is still on the meta device, then allocate only this rank's shards
    (uninitialized): no rank ever holds the whole model on its device."""
    with torch.device("meta"):
        model = new_model(spec)
    mesh = fl.init_mesh(replicate=config.mesh.replicate, shard=config.mesh.shard, device_type=job.device.type)
    fl.apply_config(model, config, mesh)
    return model.to_empty(device=job.device)


def fill_from_rank0(model: nn.Module, source: nn.Module | None) -> None:
    """Rank 0 sends each full tensor of ``source``; every rank keeps its own shard of it. Collective."""
    full = source.state_dict() if source is not None else {}
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    source_buffers = dict(source.named_buffers()) if source is not None else {}
    for name, buffer in model.named_buffers():  # incl. ones the state dict leaves out (rotary inv_freq)
        if source is not None:
            buffer.copy_(source_buffers[name])
        dist.broadcast(buffer, src=0)


def load_weights(model: nn.Module, directory: Path, spec: ModelSpec, transform: Any = None) -> fl.WeightsReport:
    """Fill the sharded ``model`` from ``directory``'s safetensors files, each rank reading only its own
    rows of each tensor (``fl.load_sharded_weights``); the buffers no checkpoint holds (rotary inv_freq)
    come from the model's constructor, run with every parameter on the meta device."""
    buffers = dict(host_buffers(spec).named_buffers())
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(buffers[name.removeprefix("base_model.model.")])  # peft's wrapping
    return fl.load_sharded_weights(model, directory, transform=transform)


def host_buffers(spec: ModelSpec) -> nn.Module:
    """The model built with its buffers on the host and every parameter on the meta device (each is
    moved there as it is registered, before any initializer writes it): the buffers' values, no weights."""

    def to_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> nn.Parameter | None:
        return None if param is None else nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    handle = torch.nn.modules.module.register_module_parameter_registration_hook(to_meta)
    try:
        return new_model(spec)
    finally:
        handle.remove()  # the hook is global: only this construction may see it


def source_model(args: argparse.Namespace, spec: ModelSpec) -> nn.Module:
    """Rank 0's full copy, on the host: a local checkpoint, or a random init from ``--seed``."""
    if args.weights is not None:
        try:
            model = _transformers().AutoModelForCausalLM.from_pretrained(args.weights, local_files_only=True)
        except Exception as exc:  # a damaged or partial checkpoint: say which, without transformers' internals
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise UsageError(
                f"--weights {args.weights}: transformers cannot load it: {type(exc).__name__}: {first}"
            ) from None
        return model.float()  # fp32 master weights; the config's mixed precision casts for compute
    torch.manual_seed(args.seed)
    return new_model(spec)


def finetune_model(args: argparse.Namespace, spec: ModelSpec, config: fl.FSDPConfig, job: Job) -> nn.Module:
    """--finetune lora|qlora: the base in bf16 with peft's adapters (``finetune.init_adapters`` from --seed),
    for qlora its targeted Linear weights in NF4, sharded per decoder layer with activation checkpointing.
    With --weights the model is built on the meta device and sharded there; ``load_finetune_weights`` then
    fills each rank's shards from its own rows. The seeded random init builds the whole base on every rank
    (same bytes everywhere) and keeps only its shards: a rank's own random rows are not the rows of the
    whole model's init, whose generator runs through the tensors in order."""
    mesh = fl.init_mesh(replicate=config.mesh.replicate, shard=config.mesh.shard, device_type=job.device.type)
    shard_size = mesh["shard"].size() if mesh.ndim > 1 else mesh.size()
    with torch.device("meta"):  # the planner's rule, before anything is built ([Note: one feasibility rule])
        finetune.check_finetune(new_model(spec), args.finetune, args.lora.targets, shard_size)
    per_rank = args.weights is not None and not args.load_whole_base
    if per_rank:
        with torch.device("meta"):
            model = finetune.apply_lora(new_model(spec).to(torch.bfloat16), args.lora)
    else:
        model = finetune.apply_lora(source_model(args, spec).to(torch.bfloat16), args.lora)
        finetune.init_adapters(model, args.seed)
    if args.finetune == "qlora":
        finetune.quantize_base(model, shard_size=shard_size, device=job.device)
    if not per_rank:
        model.to(job.device)
    fl.apply_config(model, finetune.finetune_config(config, args.activation_checkpointing), mesh)
    return model.to_empty(device=job.device) if per_rank else model


def load_finetune_weights(model: nn.Module, args: argparse.Namespace, spec: ModelSpec) -> fl.WeightsReport:
    """The meta-built fine-tuning model's shards from --weights, each rank reading its own rows (qlora: and
    quantizing them, ``finetune.load_nf4_rows``); then the adapters, which no base checkpoint holds."""
    transform = finetune.load_nf4_rows(model) if args.finetune == "qlora" else None
    report = load_weights(model, args.weights, spec, transform)
    finetune.init_adapters(model, args.seed)
    return report


# ---- 4. data ------------------------------------------------------------------------------------------
def text_files(path: Path) -> list[Path]:
    """--data's files: itself (a text or .jsonl file), or a directory's .txt files."""
    if path.suffix == ".json":  # would otherwise be trained on as raw text
        raise UsageError(
            f"--data {path}: instruction data is read from JSON Lines, one example object per line, in a .jsonl "
            "file (the formats: docs/finetune.md); rename it if it is one"
        )
    if path.is_file():
        return [path]
    if not path.is_dir():
        sample = SAMPLE_DATA.relative_to(REPO)
        raise UsageError(f"--data {path}: no such file or directory (the bundled sample is {sample})")
    files = sorted(p for p in path.rglob("*.txt") if p.is_file())
    if not files:
        raise UsageError(f"--data {path}: a directory with no .txt files in it; pass a text file or such a directory")
    return files


def load_tokenizer(args: argparse.Namespace, spec: ModelSpec) -> tuple[Any, str]:
    """(tokenizer, or None for bytes; its label for the report)."""
    if args.tokenizer == "bytes":
        return None, "bytes"
    if args.tokenizer == "auto":
        found = [d for d in (args.weights, spec.directory) if d is not None and has_tokenizer(d)]
        if not found:
            return None, "bytes"
        directory = found[0]
    else:
        directory = Path(args.tokenizer)
        if not has_tokenizer(directory):
            raise UsageError(
                f"--tokenizer {directory}: no {' or '.join(TOKENIZER_FILES)} there; pass auto, bytes or a "
                "directory written by a tokenizer's save_pretrained"
            )
    return _transformers().AutoTokenizer.from_pretrained(directory, local_files_only=True), str(directory)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def has_tokenizer(directory: Path) -> bool:
    return any((directory / name).is_file() for name in TOKENIZER_FILES)


def rank_batches(dataset: data.Windows, job: Job, batch: int, seed: int, start: int) -> Iterator[torch.Tensor]:
    """This rank's batches, epoch after epoch, from ``start`` samples in. Every rank shuffles the windows
    the same way (``seed + epoch``) and takes every world_size-th one: DistributedSampler's split."""
    sampler: DistributedSampler[int] = DistributedSampler(
        dataset, num_replicas=job.world_size, rank=job.rank, shuffle=True, seed=seed, drop_last=True
    )
    if len(sampler) < batch:
        raise UsageError(
            f"--data holds {len(dataset)} samples (windows of --seq {dataset.seq}), {len(sampler)} per rank at world "
            f"size {job.world_size}, fewer than --batch {batch}: use more data, a smaller --seq or a smaller --batch"
        )
    return _batches(dataset, sampler, batch, start)


def _batches(dataset: data.Windows, sampler: DistributedSampler[int], batch: int, start: int) -> Iterator[torch.Tensor]:
    epoch, skip = divmod(start, len(sampler))
    pending: list[int] = []
    while True:
        sampler.set_epoch(epoch)
        for index in list(sampler)[skip:]:
            pending.append(index)
            if len(pending) == batch:
                yield torch.stack([dataset[i] for i in pending])  # text (batch, seq + 1); .jsonl (batch, 3, seq)
                pending = []
        epoch, skip = epoch + 1, 0


# ---- 5. setting up, resuming, saving -----------------------------------------------------------------------
STATE_FILE = "train_state.json"  # written last: a directory without it is an unfinished save


@dataclass
class Run:
    """What the loop works on, built the same way on every rank."""

    config_path: Path
    spec: ModelSpec
    tokenizer: str
    dataset: data.Windows
    loss: data.WindowLoss | data.TokenMeanLoss  # the data's loss (data.step_loss)
    model: nn.Module
    optimizers: list[torch.optim.Optimizer]  # one; --step-in-backward: one per group, stepped inside backward
    in_backward: bool  # --step-in-backward
    resumed_from: Path | None
    start_step: int
    tokens_seen: int
    weights_bytes_read: list[int | None]  # per rank: --weights' tensor bytes it read (None: no --weights)


def offloads(config: fl.FSDPConfig) -> bool:
    """Whether ``config`` puts any group's shards (or masters) on the host: their optimizer step runs there."""
    rules = [config.offload, *(rule.offload for rule in config.wrap if rule.offload is not None)]
    return any(offload.device == "cpu" for offload in rules)


def fused_host_params(optimizers: list[torch.optim.Optimizer]) -> int:
    """Parameters ``optimizers`` step with torch's fused CPU kernel (``fl.fast_host_step``'s groups)."""
    return sum(len(group["params"]) for opt in optimizers for group in opt.param_groups if group.get("fused"))


def adamw(params: list[nn.Parameter], args: argparse.Namespace, host: bool) -> torch.optim.Optimizer:
    """AdamW over ``params``: weight decay on matrices, none on norms and biases (two groups, either may be
    empty); on torch's fused CPU kernel for the host parameters when ``host`` (the config offloads)."""
    decay = [p for p in params if p.ndim >= 2]
    rest = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))
    if host and any(p.device.type == "cpu" for p in params):
        fl.fast_host_step(optimizer)
    return optimizer


def make_optimizers(args: argparse.Namespace, model: nn.Module, config: fl.FSDPConfig) -> list[torch.optim.Optimizer]:
    """One AdamW over the trainable parameters, or with --step-in-backward one per group, stepped from backward.
    Made before a resume loads their state: the saved run's were made the same way."""
    host = offloads(config)
    if args.step_in_backward:
        return fl.step_in_backward(model, lambda params: adamw(params, args, host)).optimizers
    return [adamw([p for p in model.parameters() if p.requires_grad], args, host)]


def checkpointed(run: Run) -> torch.optim.Optimizer | list[torch.optim.Optimizer]:
    """What a checkpoint holds the optimizer state of: the one optimizer, or every group's (saved as one)."""
    return run.optimizers if run.in_backward else run.optimizers[0]


def prepare(args: argparse.Namespace, job: Job) -> Run:
    config_path = args.config or shown(GPT_CONFIG if args.model_config == "gpt" else HF_CONFIG)
    config, spec, resume, tokenizer, dataset = on_every_rank(
        job, "reading the arguments", lambda: read_inputs(args, config_path)
    )
    weights: fl.WeightsReport | None = None
    if args.finetune != "full":
        what = f"preparing --finetune {args.finetune} of {spec.label} with {config_path}"
        model = on_every_rank(job, what, lambda: finetune_model(args, spec, config, job))
        if args.weights is not None and not args.load_whole_base:
            what = f"loading {spec.label}"
            weights = on_every_rank(job, what, lambda: load_finetune_weights(model, args, spec))
    else:
        model = on_every_rank(
            job, f"sharding {spec.label} with {config_path}", lambda: shard_on_meta(spec, config, job)
        )
        if args.weights is not None:  # every rank reads only its own rows: no rank holds the whole model
            weights = on_every_rank(job, f"loading {spec.label}", lambda: load_weights(model, args.weights, spec))
        else:
            # rank 0 initializes the full model first, so a failure stops every rank here, before any of
            # them waits in the broadcast
            source = on_every_rank(
                job, f"initializing {spec.label}", lambda: source_model(args, spec) if job.rank == 0 else None
            )
            fill_from_rank0(model, source)
            del source  # rank 0's full host copy is no longer needed
    optimizers = make_optimizers(args, model, config)  # all the parameters, or the adapters
    bytes_read: list[int | None] = [None] * job.world_size  # each rank's bytes of --weights read
    dist.all_gather_object(bytes_read, weights.bytes_read if weights is not None else None)
    loss = data.step_loss(dataset, job.world_size)
    run = Run(
        config_path, spec, tokenizer, dataset, loss, model, optimizers, args.step_in_backward, resume, 0, 0, bytes_read
    )
    if resume is not None:
        if args.finetune != "full":  # adapters + their optimizer; --step-in-backward: --finetune full only
            on_every_rank(job, f"loading {resume}", lambda: finetune.load_trainable(resume, model, optimizers[0]))
        else:
            on_every_rank(job, f"loading {resume}", lambda: fl.load_checkpoint(resume, model, checkpointed(run)))
        state = json.loads((resume / STATE_FILE).read_text())
        run.start_step, run.tokens_seen = int(state["step"]), int(state["tokens"])
        if state["global_batch"] != global_batch(args, job) and job.rank == 0:
            print(
                f"note: {resume} was saved at a global batch of {state['global_batch']} samples, this run takes "
                f"{global_batch(args, job)}: the data order differs from an uninterrupted run",
                file=sys.stderr,
            )
    return run


def shown(path: Path) -> Path:
    """``path`` relative to the working directory when it lies below it (for messages and the report)."""
    return path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path


def read_inputs(args: argparse.Namespace, config_path: Path) -> tuple[Any, ...]:
    """Check every path and read the config, the model's config and the data; no process group needed."""
    if not config_path.is_file():
        shipped = ", ".join(str(p.relative_to(REPO)) for p in sorted((REPO / "configs").glob("*.yaml")))
        raise UsageError(f"--config {config_path}: no such file; the configs that come with fsdp2lite: {shipped}")
    files = text_files(args.data)
    config = fl.FSDPConfig.from_yaml(config_path)
    if args.finetune != "full":
        try:
            finetune.require_libraries(args.finetune)
        except finetune.MissingExtraError as exc:
            raise UsageError(str(exc)) from None
    elif args.activation_checkpointing:
        config = finetune.finetune_config(config, activation_checkpointing=True, compute_dtype=None)
    spec = resolve_model(args)
    if spec.max_positions is not None and args.seq > spec.max_positions[1]:
        key, limit = spec.max_positions
        raise UsageError(
            f"--seq {args.seq}: {spec.label} takes at most {limit} positions ({key}); pass --seq {limit} or less"
        )
    resume = find_resume(args)
    tokenizer, label = load_tokenizer(args, spec)
    dataset = read_data(args, files, tokenizer, label)
    if dataset.max_token_id >= spec.vocab_size:
        raise UsageError(
            f"the {label} tokenizer makes token ids up to {dataset.max_token_id} but the model's vocab_size is "
            f"{spec.vocab_size}: pick a tokenizer and a model that agree"
        )
    return config, spec, resume, label, dataset


def read_data(args: argparse.Namespace, files: list[Path], tokenizer: Any, label: str) -> data.Windows:
    """--data as training windows: a .jsonl file's examples loss-masked and packed (fsdp2lite.finetune.data;
    a DataError names every bad line), text as one token stream cut into windows."""
    if args.data.suffix == ".jsonl" and args.data.is_file():
        name = "the bytes tokenizer" if label == "bytes" else f"the tokenizer {label}"
        return data.load_jsonl(args.data, tokenizer, args.seq, tokenizer_name=name, length_name="--seq")
    return data.TokenWindows(data.tokenize_text(files, tokenizer), args.seq)


def find_resume(args: argparse.Namespace) -> Path | None:
    if not args.resume:
        return None
    if args.resume != "latest":
        path = Path(args.resume)
        if not (path / STATE_FILE).is_file():
            raise UsageError(f"--resume {path}: not a finished checkpoint of this script (no {STATE_FILE} in it)")
        return path
    finished = sorted(p.parent for p in args.checkpoint_dir.glob(f"step-*/{STATE_FILE}"))
    return finished[-1] if finished else None


def save(path: Path, run: Run, job: Job, step: int, args: argparse.Namespace) -> None:
    if args.finetune != "full":  # adapters + optimizer; the frozen base is rebuilt, not saved
        finetune.save_trainable(path, run.model, run.optimizers[0])  # --step-in-backward: --finetune full only
        finetune.save_adapter(run.model, path / "adapter")  # peft's format, for PeftModel.from_pretrained
    else:
        fl.save_checkpoint(path, run.model, checkpointed(run))  # every rank writes its shards
    if args.fault:
        args.fault.strike(job, "save", step)
    dist.barrier()  # every shard is on disk before the directory is marked finished
    if job.rank == 0:
        state = {
            "step": step,
            "tokens": run.tokens_seen,
            "global_batch": global_batch(args, job),
            "model": run.spec.label,
            "config": str(run.config_path),
            "world_size": job.world_size,
        }
        (path / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")


# ---- 6. training --------------------------------------------------------------------------------------------
def global_batch(args: argparse.Namespace, job: Job) -> int:
    return job.world_size * args.batch * args.grad_accum  # samples per optimizer step


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warmup, then cosine down to a tenth; a function of the step, so resuming needs no state."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


def train_step(
    run: Run, batches: Iterator[torch.Tensor], step: int, args: argparse.Namespace, job: Job
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One optimizer step over --grad-accum microbatches; returns (this rank's loss, the gradient norm: None with
    --step-in-backward, whose groups stepped inside the last microbatch's backward). The loss is the data's
    (``data.step_loss``): text windows' per-microbatch means averaged, or packed instruction data's mean over the
    global batch's trained tokens."""
    for optimizer in run.optimizers:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
    torch.manual_seed(args.seed + 1 + step * job.world_size + job.rank)  # dropout draws: the same after a resume
    loss_sum = torch.zeros((), device=job.device)
    micro_batches = [next(batches).to(job.device, non_blocking=True) for _ in range(args.grad_accum)]
    num_items = run.loss.count(micro_batches)  # what the step's loss is divided by
    for micro, batch in enumerate(micro_batches):
        run.model.set_requires_gradient_sync(micro == args.grad_accum - 1)  # type: ignore[operator]  # reduce once
        loss = run.loss(run.model, batch, num_items)
        loss.backward()
        loss_sum += loss.detach()
    run.tokens_seen += global_batch(args, job) * args.seq
    if run.in_backward:
        return loss_sum, None
    grad_norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), args.max_grad_norm or math.inf)
    run.optimizers[0].step()
    run.optimizers[0].zero_grad(set_to_none=True)
    return loss_sum, grad_norm


def train(args: argparse.Namespace, job: Job) -> dict[str, Any]:
    run = prepare(args, job)
    start = run.start_step * args.batch * args.grad_accum  # samples this rank has already used
    batches = on_every_rank(
        job, "splitting the data", lambda: rank_batches(run.dataset, job, args.batch, args.seed, start)
    )
    report = Report(args, job, run)
    run.model.train()
    last_saved = None
    for step in range(run.start_step, args.steps):
        loss_sum, grad_norm = train_step(run, batches, step, args, job)
        done = step + 1
        if args.fault:
            args.fault.strike(job, "step", done)
        if done % args.log_every == 0 or done == args.steps:  # the only host syncs of a step
            dist.all_reduce(loss_sum)  # summed over ranks, on the device: one host sync for the loss
            loss = loss_sum.item() / job.world_size
            norm = grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm
            peak = int(all_ranks(job, peak_memory(job), dist.ReduceOp.MAX))
            report.step(done, loss, lr_at(step, args), None if norm is None else float(norm), run.tokens_seen, peak)
        if args.checkpoint_dir and (done == args.steps or (args.save_every and done % args.save_every == 0)):
            last_saved = args.checkpoint_dir / f"step-{done:07d}"
            save(last_saved, run, job, done, args)
            report.saved(last_saved)
    return report.finish(run.tokens_seen, last_saved)


def all_ranks(job: Job, value: float, op: Any) -> float:
    tensor = torch.tensor([value], dtype=torch.float64, device=job.device)
    dist.all_reduce(tensor, op=op)
    return float(tensor.item())


def peak_memory(job: Job) -> int:
    """This rank's peak: CUDA memory allocated by tensors, or on CPU the process's peak resident size."""
    if job.device.type == "cuda":
        return torch.cuda.max_memory_allocated(job.device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class Report:
    """Rank 0's progress bar, log lines and metrics file, and the run's final record (other ranks print nothing)."""

    def __init__(self, args: argparse.Namespace, job: Job, run: Run) -> None:
        self.args, self.job, self.last_tokens = args, job, run.tokens_seen
        self.losses: list[float] = []
        self.rates: list[float] = []
        self.peak = 0
        self.timer = self.started = time.perf_counter()
        params = sum(p.numel() for p in run.model.parameters())
        self.record: dict[str, Any] = {
            "model": run.spec.label,
            "params": params,
            "config": str(run.config_path),
            "tokenizer": run.tokenizer,
            **run.dataset.record(),
            "world_size": job.world_size,
            "backend": job.backend,
            "device": job.device.type,
            "start_step": run.start_step,
            "steps": args.steps,
            "resumed_from": str(run.resumed_from) if run.resumed_from else None,
            "weights_bytes_read": run.weights_bytes_read,
            "fused_host_params": fused_host_params(run.optimizers),
            "step_in_backward": run.in_backward,
        }
        self.progress: Any = None
        if job.rank != 0:
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.console = Console(stderr=True)
        ranks = f"{job.world_size} rank{'s' * (job.world_size != 1)} ({job.backend} on {job.device.type})"
        resumed = f", resumed from {run.resumed_from}" if run.resumed_from else ""
        self.console.print(
            f"[bold]{run.spec.label}[/]: {params / 1e6:.2f}M parameters, {ranks}, config {run.config_path}, "
            f"tokenizer {run.tokenizer}{resumed}",
            soft_wrap=True,
        )
        columns = (TextColumn("step"), MofNCompleteColumn(), BarColumn(), TextColumn("{task.fields[info]}"))
        self.progress = Progress(*columns, TimeRemainingColumn(), console=self.console)
        self.task = self.progress.add_task("train", total=args.steps, completed=run.start_step, info="")
        self.progress.start()

    def step(self, step: int, loss: float, lr: float, grad_norm: float | None, tokens: int, peak: int) -> None:
        now = time.perf_counter()
        rate = (tokens - self.last_tokens) / max(now - self.timer, 1e-9)  # since the last log line
        self.timer, self.last_tokens = now, tokens
        self.losses.append(loss)
        self.rates.append(rate)
        self.peak = max(self.peak, peak)
        if self.job.rank != 0:
            return
        memory = "peak CUDA alloc" if self.job.device.type == "cuda" else "peak RSS"
        info = f"loss {loss:.4f}  {rate:,.0f} tok/s  {memory} {peak / 2**30:.2f} GiB"
        self.progress.update(self.task, completed=step, info=info)
        norm = "-" if grad_norm is None else f"{grad_norm:.3f}"  # --step-in-backward: no global norm
        self.console.print(f"step {step:>6}  {info}  lr {lr:.2e}  grad norm {norm}", soft_wrap=True)
        if self.args.metrics:
            row = {
                "step": step,
                "loss": loss,
                "lr": lr,
                "grad_norm": grad_norm,
                "tokens": tokens,
                "tokens_per_s": rate,
                "peak_memory_bytes": peak,
            }
            with self.args.metrics.open("a") as f:
                f.write(json.dumps(row) + "\n")

    def saved(self, path: Path) -> None:
        if self.job.rank == 0:
            self.console.print(f"saved {path}", soft_wrap=True)

    def finish(self, tokens: int, checkpoint: Path | None) -> dict[str, Any]:
        if self.progress is not None:
            self.progress.stop()
        self.record.update(
            final_loss=self.losses[-1] if self.losses else None,
            tokens=tokens,
            tokens_per_s=sorted(self.rates)[len(self.rates) // 2] if self.rates else None,  # median over log lines
            peak_memory_bytes=self.peak,
            peak_memory_kind="cuda_max_allocated" if self.job.device.type == "cuda" else "host_max_rss",
            checkpoint=str(checkpoint) if checkpoint else None,
            seconds=round(time.perf_counter() - self.started, 3),
        )
        return self.record


# ---- main ------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    quiet_known_noise()  # other packages' import-time lines (torchao, torch's pytree, bitsandbytes, transformers)
    args = parse_args(argv)
    try:
        job = join_process_group(args)
    except UsageError as exc:  # found the same way on every rank, before any collective
        return refuse(f"error: {exc}", launcher_rank())
    try:
        record = train(args, job)
    except SetupFailed as exc:  # every rank is here: none waits in a collective
        dist.destroy_process_group()
        return refuse(str(exc), job.rank)
    if job.rank == 0:
        print(json.dumps(record), flush=True)  # the last line: one JSON record of the run
    dist.destroy_process_group()
    return 0


def launcher_rank() -> int:
    """This process's rank before the process group exists: torchrun's RANK, or 0 alone."""
    return int(os.environ.get("RANK", "0"))


def leave(code: int) -> None:
    """Exit without interpreter finalization: gloo on recent torch sometimes aborts there (SIGABRT after
    the job is done), which torchrun would report as a failed rank."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    leave(main())
