"""``fsdp2lite estimate --budget --write-config`` as a user lives it (issue 44): the policy file holds only
what differs from the defaults, commented, and reads back as the setting chosen; the printed command is a
whole job (data, method's learning rate, grad-accum for the global batch, checkpoints, resume) that
examples/train.py parses; the answer states its assumptions; the table reads at 80 columns; and the 70B
answer docs/estimate.md quotes is what the command prints. Single process, meta models."""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

import pytest
import yaml
from _models import example_train

pytest.importorskip("transformers", reason="Hugging Face presets need transformers (fsdp2lite[dev])")

import fsdp2lite as fl  # noqa: E402
from fsdp2lite.cli import main  # noqa: E402
from fsdp2lite.cli.estimate_job import model_words  # noqa: E402
from fsdp2lite.config.minimal import minimal_data, minimal_yaml  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def test_a_minimal_policy_file_keeps_only_what_differs_and_reads_back_equal() -> None:
    config = fl.FSDPConfig.model_validate(
        {
            "mixed_precision": {"param_dtype": "bf16", "reduce_dtype": "fp32"},
            "wrap": [{"match": {"class": "Block"}, "activation_checkpointing": True}, {"match": {"path": "head"}}],
            "schedule": {"forward_prefetch_depth": 1},
        }
    )
    assert minimal_data(config) == {
        "mixed_precision": {"param_dtype": "bf16", "reduce_dtype": "fp32"},
        "wrap": [{"match": {"class": "Block"}, "activation_checkpointing": True}, {"match": {"path": "head"}}],
        "schedule": {"forward_prefetch_depth": 1},
    }
    text = minimal_yaml(config, ["written by a test"])
    assert fl.FSDPConfig.model_validate(yaml.safe_load(text)) == config
    lines = text.splitlines()
    assert lines[0] == "# written by a test"
    key = lines.index("  activation_checkpointing: true")  # each key has the schema's description above it
    assert lines[key - 1].startswith("  # true: recompute these modules' forward in backward")
    assert minimal_yaml(fl.FSDPConfig()) == "{}\n"  # nothing differs: an empty mapping, read back as the defaults


def test_the_written_job_runs_the_choice(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The toy rehearsal: llama-tiny (examples/train.py's own preset) on 2 CPU ranks. The command names the
    data, 2e-4 for lora, a grad-accum that makes the global batch, checkpoints and --resume latest, and
    train.py parses it into exactly those settings; the policy file is the choice, minimal."""
    out = tmp_path / "toy.yaml"
    argv = ["estimate", "--model", "llama-tiny", "--world-size", "2", "--device", "cpu", "--seq", "64"]
    argv += ["--batch", "2", "--budget", "1GiB", "--finetune", "lora", "--global-batch", "16"]
    argv += ["--data", "chat.jsonl", "--steps", "30", "--write-config", str(out), "--json"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    record = json.loads(captured.out)
    words = shlex.split(record["train_command"])
    assert words[:6] == ["OMP_NUM_THREADS=1", "torchrun", "--standalone", "--nproc-per-node", "2", "examples/train.py"]
    args = example_train().parse_args(words[6:])
    assert (args.config, args.model_config, args.weights, args.data) == (out, "llama-tiny", None, Path("chat.jsonl"))
    assert (args.finetune, args.lr, args.batch, args.seq, args.grad_accum) == ("lora", 2e-4, 2, 64, 4)  # 16 / (2 x 2)
    assert (args.steps, args.checkpoint_dir, args.resume, args.device) == (30, Path("checkpoints/toy"), "latest", "cpu")
    assert (
        1 <= args.save_every <= 30
        and args.activation_checkpointing == record["budget"]["choice"]["activation_checkpointing"]
    )
    written = fl.FSDPConfig.from_yaml(out)
    assert written.wrap and len(out.read_text().splitlines()) < 40
    text = " ".join(captured.err.split())
    assert "assumed: batch 2 x seq 64 tokens per rank (--batch, --seq); a global batch of 16 samples" in text
    assert "is 4 microbatches per rank (--grad-accum 4, from --global-batch 16)" in text
    assert re.search(r"headroom: [\d.,]+ [KMG]iB of the 1.0 GiB left to PyTorch is over the reserved peak;", text)
    assert "not counted: the processes' own memory" in text and "measured on a GPU: no (a CPU target" in text
    assert "time: not estimated for a CPU target (the step-time model is a GPU's: --gpu, --link)" in text
    assert "tokens/s" not in text.split("recommended:")[0]  # the table neither: no GPU's figure for a CPU job


def test_model_words_say_where_train_py_gets_the_model(tmp_path: Path) -> None:
    (tmp_path / "config_only").mkdir()
    (tmp_path / "config_only" / "config.json").write_text("{}")
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "model.safetensors").write_bytes(b"")
    assert model_words(str(tmp_path / "weights")) == ["--weights", str(tmp_path / "weights")]
    assert model_words(str(tmp_path / "config_only")) == ["--model-config", str(tmp_path / "config_only")]
    assert model_words("llama-tiny") == ["--model-config", "llama-tiny"]
    assert model_words("llama-3-70b") == ["--weights", "PATH/TO/llama-3-70b"]


def test_the_llama_tiny_preset_is_train_pys() -> None:
    import transformers

    from fsdp2lite.cli._hf_models import _config

    train = example_train()
    ours = _config(transformers, "llama-tiny", "test").to_dict()
    theirs = train.resolve_model(train.parse_args(["--model-config", "llama-tiny"])).hf_config.to_dict()
    for key in ("transformers_version", "architectures", "dtype", "torch_dtype", "_name_or_path"):
        ours.pop(key, None), theirs.pop(key, None)
    assert ours == theirs


def test_train_py_help_names_every_default_and_lr_follows_finetune(capsys: pytest.CaptureFixture[str]) -> None:
    train = example_train()
    with pytest.raises(SystemExit):
        train.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag, default in (("--seq SEQ", "128"), ("--batch BATCH", "4"), ("--seed SEED", "0"), ("--save-every", "0")):
        assert re.search(re.escape(flag) + r" (?:(?! --).)*\(default: " + default + r"\)", text), flag
    assert "(default: 3e-3 for --finetune full, 2e-4 for lora and qlora)" in text
    assert [train.parse_args(["--finetune", kind]).lr for kind in ("full", "lora", "qlora")] == [3e-3, 2e-4, 2e-4]
    assert train.parse_args(["--finetune", "lora", "--lr", "1e-5"]).lr == 1e-5


def _docs_block(heading: str) -> str:
    """The ```text block after ``heading`` in docs/estimate.md."""
    text = (REPO / "docs" / "estimate.md").read_text()
    start = text.index("```text\n", text.index(heading)) + len("```text\n")
    return text[start : text.index("```", start)]


def test_the_70b_answer_in_the_docs_is_what_the_command_prints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/estimate.md's founding answer is the command's output at 80 columns, word for word; every line
    fits 80 columns and no cell is cut short."""
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.chdir(tmp_path)
    block = _docs_block("The founding question")
    command = block.splitlines()[0].removeprefix("$ ")
    assert main(shlex.split(command)[1:]) == 0
    captured = capsys.readouterr()
    printed = captured.out + captured.err
    assert all(len(line) <= 80 for line in printed.splitlines()) and "…" not in printed
    assert [line.rstrip() for line in printed.splitlines()] == block.splitlines()[1:]
    assert (tmp_path / "qlora70b.yaml").read_text() == _docs_block("The policy file it writes")


def test_the_70b_at_3_ranks_in_the_docs_searches_qlora(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/estimate.md's world-size-3 answer (one feasibility rule: qlora with a rank's rows padded) is the
    command's output at 80 columns, word for word."""
    monkeypatch.setenv("COLUMNS", "80")
    block = _docs_block("So at `--world-size 3` the search")
    command = block.splitlines()[0].removeprefix("$ ")
    assert main(shlex.split(command)[1:]) == 0
    captured = capsys.readouterr()
    printed = [line.rstrip() for line in (captured.out + captured.err).splitlines()]
    assert printed == block.splitlines()[1:]
    assert any(line.startswith("recommended: qlora,") for line in printed)


def test_from_the_planner_to_a_trained_adapter_with_the_printed_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """issue 44's walk, at toy scale on 2 CPU ranks: estimate writes the job for the bundled chat data, the
    printed command (as it is, from a directory holding examples/) trains and saves an adapter peft loads, and
    the run prints no other package's warning."""
    peft = pytest.importorskip("peft", reason="peft is not installed: pip install -e '.[finetune]'")
    import subprocess

    from _cpu_env import cpu_env
    from test_example_train import foreign_lines

    (tmp_path / "examples").symlink_to(REPO / "examples")
    argv = ["estimate", "--model", "llama-tiny", "--world-size", "2", "--device", "cpu", "--budget", "1GiB"]
    argv += ["--finetune", "lora", "--seq", "128", "--batch", "4", "--global-batch", "16", "--steps", "6"]
    argv += ["--data", "examples/data/chat.jsonl", "--tokenizer", "examples/data/chat-tokenizer"]
    argv += ["--write-config", str(tmp_path / "toy.yaml"), "--json"]
    assert main(argv) == 0
    words = shlex.split(json.loads(capsys.readouterr().out)["train_command"])
    assert words[0] == "OMP_NUM_THREADS=1" and words[1] == "torchrun"
    command = [sys.executable, "-m", "torch.distributed.run", *words[2:]]
    env = cpu_env(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert foreign_lines(done.stderr) == [] and "Warning" not in done.stderr, done.stderr
    record = json.loads(done.stdout.strip().splitlines()[-1])
    assert record["formats"] == {"messages": 400} and record["steps"] == 6
    adapter = tmp_path / "checkpoints" / "toy" / "step-0000006" / "adapter"
    train = example_train()
    base = train.new_model(train.resolve_model(train.parse_args(["--model-config", "llama-tiny"])))
    loaded = peft.PeftModel.from_pretrained(base, str(adapter))
    assert any("lora_A" in name for name, _ in loaded.named_parameters())
