"""examples/train.py --finetune lora|qlora --weights DIR loads per rank (issue 30): the model is built on
the meta device, sharded, and each rank reads only its own rows of the base from the safetensors files
(qlora: quantizing them to NF4 with finetune.quantize_rows). Checked on 2 CPU ranks (train.py's main() in
ranks forked from the test fork server, test_example_train.train_in_forks: torchrun's own part is
test_example_train's) with a
saved tiny Llama (hidden 256: every rank's rows of each projection hold whole NF4 scale blocks) against
the same job with every rank loading the whole base first (--load-whole-base): the logged losses equal
bit for bit, and no rank read more than its share of the checkpoint's tensor bytes; a qlora run resumed
from its step-2 checkpoint (adapters and optimizer; the base read again per rank from --weights) has the
uninterrupted losses."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest
from test_example_train import losses, train_in_forks
from test_finetune import needs_peft, needs_torchao

STEPS = 4


def save_llama(directory: Path) -> None:
    """A random fp32 Llama in several safetensors shards (with model.safetensors.index.json)."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory, max_shard_size="600KB")
    assert (directory / "model.safetensors.index.json").is_file()


def shares(directory: Path, world_size: int) -> list[int]:
    """Each rank's bytes of every tensor's rows split torch.chunk style by dim 0, from the files' headers."""
    per_rank = [0] * world_size
    for path in directory.glob("*.safetensors"):
        with path.open("rb") as file:
            (length,) = struct.unpack("<Q", file.read(8))
            header = json.loads(file.read(length))
        header.pop("__metadata__", None)
        for entry in header.values():
            begin, end = entry["data_offsets"]
            rows = entry["shape"][0]
            chunk = math.ceil(rows / world_size)
            for rank in range(world_size):
                mine = max(0, min(chunk, rows - rank * chunk))
                per_rank[rank] += (end - begin) // rows * mine
    return per_rank


@pytest.mark.parametrize("mode", [pytest.param("qlora", marks=needs_torchao), pytest.param("lora", marks=needs_peft)])
def test_per_rank_load_trains_like_the_whole_base(tmp_path: Path, mode: str) -> None:
    save_llama(tmp_path / "model")
    common = ["--weights", "model", "--finetune", mode, "--lora-rank", "4", "--seq", "32", "--batch", "2"]
    common += ["--steps", str(STEPS), "--warmup-steps", "1", "--log-every", "1"]
    saving = ["--checkpoint-dir", "ckpt", "--save-every", "2"] if mode == "qlora" else []
    runs = [
        ("a", [*common, *saving, "--metrics", "a.jsonl"]),
        ("b", [*common, "--load-whole-base", "--metrics", "b.jsonl"]),
    ]
    if mode == "qlora":  # the base comes back from --weights, adapters and optimizer from a's step-2 checkpoint
        runs.append(("c", [*common, "--resume", str(tmp_path / "ckpt" / "step-0000002"), "--metrics", "c.jsonl"]))
    records = train_in_forks(runs, tmp_path, 2)
    per_rank, whole = records["a"], records["b"]
    a, b = losses(tmp_path / "a.jsonl"), losses(tmp_path / "b.jsonl")
    assert len(a) == STEPS and a == b, (a, b)
    assert whole["weights_bytes_read"] == [None, None]
    share = shares(tmp_path / "model", 2)
    assert per_rank["weights_bytes_read"] == share, (per_rank["weights_bytes_read"], share)
    assert max(share) <= sum(share) / 2  # each rank its half: no rank read the whole model
    if mode == "qlora":
        resumed = records["c"]
        assert resumed["start_step"] == 2 and resumed["weights_bytes_read"] == share
        c = losses(tmp_path / "c.jsonl")
        assert [c[3], c[4]] == [a[3], a[4]], (a, c)


@needs_torchao
def test_qlora_loads_per_rank_at_3_ranks(tmp_path: Path) -> None:
    """3 ranks: no projection's rows (256 or 512) split into 3 shards of whole NF4 scale blocks, so each
    rank quantizes its padded share of rows (NF4Rows); the losses equal the whole base's bit for bit, and
    each rank read its third of the tensor bytes."""
    save_llama(tmp_path / "model")
    common = ["--weights", "model", "--finetune", "qlora", "--lora-rank", "4", "--seq", "32", "--batch", "2"]
    common += ["--steps", "2", "--warmup-steps", "1", "--log-every", "1"]
    runs = [("a", [*common, "--metrics", "a.jsonl"]), ("b", [*common, "--load-whole-base", "--metrics", "b.jsonl"])]
    per_rank = train_in_forks(runs, tmp_path, 3)["a"]
    a, b = losses(tmp_path / "a.jsonl"), losses(tmp_path / "b.jsonl")
    assert len(a) == 2 and a == b, (a, b)
    assert per_rank["weights_bytes_read"] == shares(tmp_path / "model", 3)
