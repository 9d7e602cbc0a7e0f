"""``fsdp2lite migrate``: bring an Accelerate, HF Trainer, DeepSpeed, torchtitan or Megatron-FSDP setup over.

    fsdp2lite migrate --from deepspeed ds_config.json -o fsdp2lite.yaml --model path/to/hf_model_dir
    fsdp2lite migrate --from hf-trainer fsdp_config.json --fsdp "full_shard auto_wrap" --json
    fsdp2lite migrate --from hf-trainer training_args.json     # TrainingArguments: fsdp, fsdp_config, deepspeed
    fsdp2lite migrate --from accelerate accelerate_deepspeed.yaml   # distributed_type: DEEPSPEED (the plugin)
    fsdp2lite migrate --from megatron-fsdp megatron_fsdp.yaml

Every input key gets a row: mapped (to what), dropped (no equivalent in FSDP2-style sharding, and
why), unsupported (what is missing), or unknown (a typo? the closest key the tool has). The policy
file goes to ``-o`` (stdout without it), a comment on each key naming its source. An input that names no
layer class still gets one group per repeated block: ``--model``'s, else the known Hugging Face decoder
layers; a note under the table says which. Exit 1 when a key is unknown or the input cannot be migrated.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ..migrate import SOURCES, Migration, MigrationError, migrate
from ._args import positive_int

DESCRIPTION = (
    "Turn an Accelerate FSDP or DeepSpeed-plugin config, HF Trainer fsdp_config or TrainingArguments (fsdp, "
    "fsdp_config, deepspeed), DeepSpeed ZeRO config, torchtitan TOML or Megatron-FSDP config (YAML/JSON) into an "
    "fsdp2lite policy file, with a report of what maps, what is dropped and why, and what is not supported."
)
STYLES = {"mapped": "green", "dropped": "dim", "unsupported": "yellow", "unknown": "bold red"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--from", dest="source", choices=SOURCES, required=True, help="the tool the input is for")
    parser.add_argument("input", metavar="IN", help="the tool's config file (YAML, JSON or TOML)")
    parser.add_argument("-o", "--output", metavar="OUT.yaml", help="write the policy file here (default: stdout)")
    parser.add_argument(
        "--fsdp",
        metavar="OPTIONS",
        help='hf-trainer: the --fsdp string, e.g. "full_shard auto_wrap offload" (a TrainingArguments file may '
        "hold it as fsdp instead)",
    )
    parser.add_argument("--world-size", type=positive_int, help="deepspeed MiCS: the job's world size")
    parser.add_argument(
        "--model",
        metavar="MODEL",
        help="the model (as explain's --model): its repeated block is wrapped when the input names no layer class "
        "(default: the known Hugging Face decoder layers), and size-based wrapping names its modules",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object last")


def run(args: argparse.Namespace) -> int:
    console = Console(stderr=args.output is None and not args.json)
    model = None
    if args.model:
        from .explain import build_on_meta, load_factory

        model = build_on_meta(load_factory(args.model), args.model)
    try:
        migration = migrate(args.source, args.input, fsdp_option=args.fsdp, world_size=args.world_size, model=model)
    except MigrationError as exc:
        console.print(f"[red]cannot migrate:[/red] {exc}")
        return 1
    console.print(report_table(migration))
    for note in migration.notes:
        console.print(f"[yellow]note:[/yellow] {note}", soft_wrap=True)
    text = migration.yaml()
    if args.output:
        Path(args.output).write_text(text)
        console.print(f"wrote {args.output}")
    elif not args.json:
        sys.stdout.write(text)
    if args.json:
        record = {
            "source": migration.source,
            "input": migration.path,
            "config": migration.config.model_dump(mode="json", by_alias=True),
            "keys": [vars(k) for k in migration.keys],
            "notes": migration.notes,
        }
        print(json.dumps(record))
    return 1 if migration.unknown else 0


def report_table(migration: Migration) -> Table:
    table = Table(title=f"{migration.path} (--from {migration.source})")
    for column in ("key", "value", "status", "detail"):
        table.add_column(column)
    for key in migration.keys:
        style = STYLES[key.status]
        table.add_row(key.key, key.value[:40], f"[{style}]{key.status}[/{style}]", key.detail)
    counts = {status: sum(k.status == status for k in migration.keys) for status in STYLES}
    table.caption = ", ".join(f"{n} {status}" for status, n in counts.items())
    return table
