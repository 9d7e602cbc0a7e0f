"""Every figure README.md and docs/*.md quote from a command that runs here in seconds is what that command
prints now (issue 44, item 8): each test runs the command once (in-process through ``fsdp2lite.cli.main`` where it
is a CLI command; tiny, preset or meta models) and finds the quoted figure in the doc and in the output, so the
docs cannot drift. Where a figure stands in a block another test compares with its command word for word, the
doc's other quotes of it are checked against that block.

Checked elsewhere, not repeated here: docs/estimate.md's 70B ``--budget`` answer and policy file
(tests/test_estimate_job.py), its 70B explain block (tests/test_explain_finetune.py), docs/config-reference.md
(generated; tests/test_cli_config.py), README's ``fsdp2lite.run`` exit report (tests/test_run_launcher.py).
Figures from benchmarks/results files and GPU evidence are the files' own, and wall times are not asserted."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from _models import example_train

pytest.importorskip("transformers", reason="Hugging Face presets need transformers (fsdp2lite[dev])")

from fsdp2lite.cli import build_parser, main  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def doc(name: str) -> str:
    """README.md or docs/NAME.md, whitespace collapsed: wrapped prose and a bash comment continued on the next
    line (``# ...``) read as one line."""
    text = (REPO / name).read_text(encoding="utf-8")
    return " ".join(re.sub(r"\n[ \t]*#[ \t]+", " ", text).split())


def flat(text: str) -> str:
    return " ".join(text.split())


def block_after(name: str, marker: str, fence: str = "```text\n") -> str:
    """The fenced block that follows ``marker`` in ``name``, as written."""
    text = (REPO / name).read_text(encoding="utf-8")
    start = text.index(fence, text.index(marker)) + len(fence)
    return text[start : text.index("```", start)]


def run(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str]:
    """``fsdp2lite ARGV`` in this process: its exit code and everything it printed (stdout, then stderr)."""
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.3g} GiB"


# ---- fsdp2lite estimate --------------------------------------------------------------------------------------
def test_readmes_70b_figures_are_the_answer_docs_estimate_shows() -> None:
    """README's sentence on the founding job and estimate's comment, docs/estimate.md's prose and its published
    table: the figures of the 70B answer block (tests/test_estimate_job.py holds that block to the command)."""
    block = flat(block_after("docs/estimate.md", "The founding question"))

    def field(pattern: str) -> str:
        match = re.search(pattern, block)
        assert match, pattern
        return match.group(1)

    alloc, reserved = field(r"device peak (\S+ GiB) allocated"), field(r"(\S+ GiB) reserved per rank")
    headroom, step = field(r"headroom: (\S+ GiB) of the"), field(r"about (\d+ s) an optimizer step")
    samples, seq = field(r"global batch of (\d+) samples"), field(r"seq (\d+) tokens per rank")
    tokens_per_s, tried = field(r"([\d,]+) tokens/s for the job"), field(r"\((\d+) tried; --all\)")
    assert "recommended: qlora, activation checkpointing, no offload" in block and "measured on a GPU: no" in block
    readme, estimate = doc("README.md"), doc("docs/estimate.md")
    assert (
        f"recommends qlora with activation checkpointing ({alloc} allocated, {reserved} reserved per rank, "
        f"{headroom} of headroom; about {step} an optimizer step of {samples} sequences x {seq} tokens, "
        f"{tokens_per_s} tokens/s; not run on a GPU)"
    ) in readme
    assert f'"qlora, activation checkpointing, no offload: {reserved} reserved, {tokens_per_s} tokens/s"' in readme
    assert f"(`--all`: all {tried} settings tried)" in estimate
    assert f"| {alloc} allocated, {reserved} reserved |" in estimate  # the published points' table
    explain_block = (REPO / "docs" / "estimate.md").read_text(encoding="utf-8").split("$ COLUMNS=80 fsdp2lite explain")
    explain = flat(explain_block[1].split("```", 1)[0])  # tests/test_explain_finetune.py: the command's output
    layers = "80 x LlamaDecoderLayer (model.layers.0 .. model.layers.79)"
    assert layers in explain and f"(`{layers}`)" in readme


def _analytic_70b(capsys: pytest.CaptureFixture[str], kind: str) -> tuple[int, dict[str, int]]:
    argv = ["estimate", "--model", "llama-3-70b", "--world-size", "4", "--method", "analytic", "--finetune", kind]
    assert main([*argv, "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    terms = re.search(r"terms: (.*)", "\n".join(record["notes"]))
    assert terms, record["notes"]
    values = {name: int(value.replace(",", "")) for name, value in re.findall(r"(\w+) ([\d,]+)", terms.group(1))}
    return record["peak_bytes"], values


def test_the_70b_per_method_figures_of_docs_estimate_are_analytic_estimates(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/estimate.md's "Fine-tuning": full, lora and qlora at world 4, batch 1 x 2048, analytic: each peak, the
    optimizer state (full) and the base's shards (lora's bf16, qlora's NF4), checkpointing off for full only."""
    (full, full_terms), (lora, lora_terms), (qlora, qlora_terms) = (
        _analytic_70b(capsys, kind) for kind in ("full", "lora", "qlora")
    )
    assert full_terms["A_r"] == 0 and lora_terms["A_r"] > 0 and qlora_terms["A_r"] > 0  # checkpointing per kind
    text = doc("docs/estimate.md")
    assert (
        f"Llama-3-70B at world 4, batch 1 x 2048, analytic: full {gib(full)} allocated (fp32 masters and AdamW "
        f"state: {full_terms['O'] / 1e9:.3g} GB of optimizer state alone), lora {gib(lora)} (the bf16 base's shards, "
        f"{lora_terms['S'] / 1e9:.3g} GB), qlora {gib(qlora)} (the NF4 base, {qlora_terms['S'] / 1e9:.3g} GB), each "
        "with activation checkpointing off for full and on for lora/qlora"
    ) in text


def test_the_search_without_finetune_tries_the_settings_docs_estimate_counts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--budget without --finetune: full, lora and qlora x checkpointing x offload, as many settings as
    docs/estimate.md counts, on a tiny Llama whose NF4 projections split over 2 ranks and a budget every setting
    fits (so no finer-grain offload is tried)."""
    from _models import tiny_llama

    with torch.device("meta"):
        model = tiny_llama(layers=2, hidden=512, intermediate=1024)
    model.config.save_pretrained(tmp_path)  # type: ignore[union-attr, operator]  # the config is all it reads
    argv = ["estimate", "--model", str(tmp_path), "--world-size", "2", "--budget", "80GiB", "--all", "--json"]
    assert main(argv) == 0
    tried = json.loads(capsys.readouterr().out)["budget"]["tried"]
    assert {row["finetune"] for row in tried} == {"full", "lora", "qlora"}
    assert all(row["offload_groups"] in (None, "all") and row["optimizer_state"] == "host" for row in tried)
    assert f"in bf16 with fp32 reduction ({len(tried)} settings)" in doc("docs/estimate.md")


def test_estimate_defaults_the_docs_name() -> None:
    """estimate's --steps, --global-batch, --host-ram and --nvme-path defaults, as README and docs/estimate.md
    give them."""
    args = build_parser().parse_args(["estimate", "--model", "m", "--world-size", "4"])
    readme, estimate = doc("README.md"), doc("docs/estimate.md")
    assert f"`--steps` ({args.steps} by default)" in estimate
    assert f"`--global-batch` sequences ({args.global_batch} by default)" in estimate
    assert (
        f"`--host-ram` (default {gib(args.host_ram)}" in estimate
        and f"`--host-ram` (default {gib(args.host_ram)}" in readme
    )
    assert f"`--nvme-path` (default `{args.nvme_path}`" in estimate


def test_the_toy_walk_prints_the_command_and_adapter_path_readme_shows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """README's walk from "will it fit?" to an adapter: its estimate command prints the command step 2 quotes,
    whose checkpoint directory and steps make the adapter path step 3 names."""
    walk = block_after("README.md", "The whole walk at toy scale", "```bash\n")
    command = re.search(r"^(fsdp2lite estimate .*?)(?<!\\)\n", walk, re.M | re.S)
    assert command, walk
    argv = shlex.split(command.group(1).replace("\\\n", " "))[1:]
    step2 = re.search(r"as it is: (.*?) \.\.\.", re.sub(r"\n#\s+", " ", walk), re.S)
    adapter = re.search(r"# 3\. the adapter, in peft's format: (\S+)", walk)
    assert step2 and adapter, walk
    (tmp_path / "examples").symlink_to(REPO / "examples")
    monkeypatch.chdir(tmp_path)
    code, printed = run(capsys, argv)
    assert code == 0, printed
    words = []
    for line in printed.split("run it with:\n", 1)[1].splitlines():  # the command, continued with backslashes
        words.append(line.strip().removesuffix("\\").strip())
        if not line.rstrip().endswith("\\"):
            break
    printed_command = " ".join(words)
    assert printed_command.startswith(step2.group(1)), (printed_command, step2.group(1))
    options = shlex.split(printed_command)
    checkpoint_dir, steps = options[options.index("--checkpoint-dir") + 1], int(options[options.index("--steps") + 1])
    assert adapter.group(1) == f"{checkpoint_dir}/step-{steps:07d}/adapter"
    assert (tmp_path / "toy.yaml").is_file()


# ---- explain, validate, migrate ------------------------------------------------------------------------------
def test_explain_shows_alike_groups_once_as_readme_quotes(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("COLUMNS", "200")
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    command = re.search(r"fsdp2lite (explain configs/bf16\.yaml .*?)\s+#", readme)
    assert command, "README's explain example"
    code, printed = run(capsys, command.group(1).split())
    quote = re.search(r'\(alike groups once: "(.*?)"', readme)
    assert code == 0 and quote and quote.group(1) in printed, printed


def test_validate_says_the_wrong_values_readme_quotes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """README's "Config files": each quoted refusal is validate's row (location: problem (suggestion))."""
    files = {
        "stage.yaml": "zero_stage: 4\n",
        "sharding.yaml": "sharding: {shard: everything}\n",
        "group.yaml": "wrap:\n  - match: {class: Block}\n    group: maybe\n",
        "reshard.yaml": "reshard_after_forward: maybe\n",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    monkeypatch.setenv("COLUMNS", "200")
    code, printed = run(capsys, ["validate", *(str(tmp_path / name) for name in files)])
    assert code == 1, printed
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in printed.splitlines() if line.count("│") == 4]
    said = [f"{location}: {problem} ({suggestion})" for location, problem, suggestion in rows if location != "location"]
    quoted = re.findall(r"`([\w.]+: \S+ is not valid here \(use [^)]*\))`", doc("README.md"))
    assert len(said) == len(files) and sorted(quoted) == sorted(said), (quoted, said)


def _subset(small: Any, big: Any) -> bool:
    if isinstance(small, dict):
        return isinstance(big, dict) and all(key in big and _subset(value, big[key]) for key, value in small.items())
    return small == big


def test_migrate_examples_become_what_docs_migrate_says(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """docs/migrate.md's two DeepSpeed configs: every setting its sentence after each names (in backticks) is in
    the policy file migrate writes; the NVMe one's note says the parameters are in host RAM."""
    text = (REPO / "docs" / "migrate.md").read_text(encoding="utf-8")
    examples = re.findall(r"```json\n(.*?)```\n(becomes .*?)(?:\n\n|\n```)", text, re.S)
    assert len(examples) == 2, examples
    for index, (source, sentence) in enumerate(examples):
        (tmp_path / f"ds{index}.json").write_text(source)
        out = tmp_path / f"ds{index}.yaml"
        code, printed = run(
            capsys, ["migrate", "--from", "deepspeed", str(tmp_path / f"ds{index}.json"), "-o", str(out)]
        )
        assert code == 0, printed
        written = yaml.safe_load(out.read_text())
        settings = re.findall(r"`([a-z_]+: [^`]+)`", sentence)
        assert settings, sentence
        for setting in settings:
            assert _subset(yaml.safe_load(setting), written), (setting, written)
        if "parameters are in host RAM" in flat(sentence):
            assert "the parameters go to host RAM" in flat(printed), printed


# ---- the fine-tuning docs ------------------------------------------------------------------------------------
def test_bad_data_messages_docs_finetune_quotes(tmp_path: Path) -> None:
    """Each message "Bad data stops every rank" quotes (up to its "..."), from examples/train.py's own reading of
    --data: a file with lines 3 to 6 bad, one whose line 9 does not fit --seq 128, the chat sample read with
    bytes, and a .json file."""
    from fsdp2lite.finetune.data import DataError

    train = example_train()
    bad = ['{"text": "fine"}', '{"text": "fine"}', '{"text":"a" 1}', "[1, 2]", '{"prompt": "2 + 3 ="}']
    bad.append('{"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "hello"}]}')
    long = ['{"text": "fine"}'] * 8 + [json.dumps({"prompt": "p" * 180, "completion": "c" * 120})]
    (tmp_path / "chat.jsonl").write_text("\n".join(bad) + "\n")
    (tmp_path / "long.jsonl").write_text("\n".join(long) + "\n")
    said = []
    for path in (tmp_path / "chat.jsonl", tmp_path / "long.jsonl", REPO / "examples" / "data" / "chat.jsonl"):
        args = train.parse_args(["--data", str(path), "--seq", "128"])
        with pytest.raises(DataError) as refused:
            train.read_data(args, [path], None, "bytes")
        said.append(str(refused.value))
    with pytest.raises(train.UsageError) as refused_json:
        train.text_files(Path("chat.json"))
    said.append(str(refused_json.value))
    section = doc("docs/finetune.md").split("Bad data stops every rank", 1)[1].split("## Rules and errors", 1)[0]
    quotes = [
        quote.removesuffix("...").strip()
        for quote in re.findall(r"`((?:chat\.jsonl )?line \d[^`]*|--data [^`]*)`", section)
    ]
    assert len(quotes) == 7, quotes
    for quote in quotes:
        assert any(quote in flat(message) for message in said), (quote, said)


def test_the_bundled_chat_sample_is_what_docs_finetune_says() -> None:
    from transformers import AutoTokenizer

    from fsdp2lite.finetune.data import Conversation, read_jsonl

    examples = read_jsonl(REPO / "examples" / "data" / "chat.jsonl")
    tokenizer = AutoTokenizer.from_pretrained(REPO / "examples" / "data" / "chat-tokenizer")
    train = example_train()
    vocab = train.resolve_model(train.parse_args(["--model-config", "llama-tiny"])).vocab_size
    assert all(isinstance(example, Conversation) for example in examples) and len(tokenizer) <= vocab
    assert "<|im_start|>" in tokenizer.chat_template  # ChatML
    assert f"({len(examples)} short conversations)" in doc("docs/finetune.md")
    assert f"(byte-level, ChatML template, {len(tokenizer)} ids: it fits the `llama-tiny` preset)" in doc(
        "docs/finetune.md"
    )


def test_train_py_defaults_the_docs_give() -> None:
    train = example_train()
    args = train.parse_args([])
    assert (
        f"`--lora-rank` ({args.lora_rank}), `--lora-alpha` ({args.lora_alpha:g}), `--lora-dropout` "
        f"({args.lora_dropout}), `--lora-targets` (default `{args.lora_targets}`) and `--activation-checkpointing` / "
        "`--no-activation-checkpointing` (on by default for lora/qlora)"
    ) in doc("docs/finetune.md")
    assert [train.parse_args(["--finetune", kind]).activation_checkpointing for kind in ("full", "lora", "qlora")] == [
        False,
        True,
        True,
    ]
    readme = doc("README.md")
    assert f"`--pg-timeout` (default {args.pg_timeout:g} s)" in readme
    assert f"after `--pg-timeout` seconds (default {args.pg_timeout:g})" in readme


def test_the_nf4_refusal_of_llama_tiny_reads_as_readme_says() -> None:
    """README: llama-tiny's weights that cannot be NF4 in 2 shards, in how many lines (the one rule train.py
    calls: fsdp2lite.finetune.check_finetune)."""
    from fsdp2lite.finetune.feasible import check_finetune

    train = example_train()
    args = train.parse_args(["--finetune", "qlora"])
    with torch.device("meta"):
        model = train.new_model(train.resolve_model(args))
    with pytest.raises(ValueError) as refused:
        check_finetune(model, "qlora", tuple(args.lora_targets.split(",")), 2)
    message = str(refused.value)
    weights = re.search(r"cannot run sharded over 2 ranks \((\d+) weights\)", message)
    lines = [line for line in message.splitlines() if "more like it" in line]
    assert weights and len(lines) == 7, message
    readme = doc("README.md")
    assert f"llama-tiny's {weights.group(1)} weights too small for NF4 read as {len(lines)} lines" in readme
    assert f"its {weights.group(1)} problems in {len(lines)} lines" in readme


def test_finetune_refusals_and_doctor_verdicts_the_docs_quote(monkeypatch: pytest.MonkeyPatch) -> None:
    """README's two doctor verdicts (the ready one with this environment's versions) and docs/finetune.md's
    refusals of a bad rank and of a missing torchao."""
    from fsdp2lite.cli.doctor import verdicts
    from fsdp2lite.finetune import LoraSettings, deps

    readme, finetune_md = doc("README.md"), doc("docs/finetune.md")
    with pytest.raises(ValueError) as bad_rank:
        LoraSettings(rank=0)
    assert f"`{bad_rank.value}`" in finetune_md
    ready = re.search(r"`(qlora: ready \([^`]*\))`", readme)
    not_ready = re.search(r"`(qlora: not ready: [^`]*)`", readme)
    assert ready and not_ready
    pytest.importorskip("peft", reason="peft is not installed: pip install -e '.[finetune]'")
    if importlib.util.find_spec("torchao") is not None:  # the ready verdict, this environment's versions for V
        version = re.compile(r"\d+(?:\.\d+)+\S*?(?=[,)])")
        assert version.sub("V", verdicts()[2]) == version.sub("V", ready.group(1))
    monkeypatch.setitem(sys.modules, "torchao", None)  # import raises ModuleNotFoundError, as when not installed
    assert verdicts()[2] == not_ready.group(1)
    with pytest.raises(deps.MissingExtraError) as missing:
        deps.require_libraries("qlora")
    assert f"`{missing.value}`" in finetune_md


# ---- README's fully_shard refusal and the offload closed form ------------------------------------------------
def test_the_plan_error_readme_shows_is_what_fully_shard_raises(four_ranks: Any) -> None:
    from test_plan import Scaled
    from torch.distributed.tensor import Shard

    import fsdp2lite as fl

    with pytest.raises(ValueError) as refused:
        fl.fully_shard(
            Scaled(),
            four_ranks,
            shard_placement_fn=lambda p: Shard(3) if p.dim() == 2 else None,
            sharding=fl.ShardingPolicy(shard="optimizer"),
            reshard_after_forward=True,
        )
    assert block_after("README.md", "lists every problem of\nthe call", "```\n") == f"{refused.value}\n"


def test_the_pinned_closed_form_the_docs_quote() -> None:
    """``benchmarks/bench_offload_memory.py --device cuda --dry-run``'s closed form (its functions, on the meta
    GPT it builds): fsdp2lite's pinned bytes against torch's, kept and stepping in backward."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import bench_offload_memory as bench
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    from fsdp2lite.models import GPT, GPTConfig

    args = bench.parse_args(["--device", "cuda", "--dry-run"])
    with torch.device("meta"):
        model = GPT(GPTConfig(args.vocab, args.seq_len, args.d_model, args.heads, args.layers, tie_embeddings=True))
    plan = bench.shard_plan(model, args.world_size)
    pinned = bench.closed_form(plan)
    kept, in_backward = (pinned[name] / pinned[bench.RIVAL] for name in (bench.REFERENCE, bench.IN_BACKWARD))
    size = f"{plan['n_params'] / 1e9:.2g}B"
    assert (
        f"({size}, {args.world_size} ranks, `bench_offload_memory.py --device cuda --dry-run`): {kept:.3f}x torch's "
        f"pinned bytes kept, **{in_backward:.3f}x** stepping in backward"
    ) in doc("docs/offload.md")
    assert (
        f"closed form at {size} on {args.world_size} ranks: {in_backward:.2f}x torch's pinned bytes, {kept:.2f}x kept"
    ) in doc("README.md")
