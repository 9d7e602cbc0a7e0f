"""Instruction data (issue 44, item 5): fsdp2lite.finetune.data and examples/train.py --data FILE.jsonl.

- formats: text, prompt/completion (strings, or messages), messages; bad lines refused by file and line;
- masks: which tokens are trained, per format, with the bundled chat tokenizer (ChatML, byte-level) and bytes;
  the assistant mask against the one Hugging Face derives from the template's {% generation %} markers;
- packing: windows, labels, position ids restarting per example, best-fit decreasing, long text split;
- a packed window's logits equal each example run alone (tiny Llama, sdpa and eager; fsdp2lite's GPT);
- 2 gloo ranks x 2 microbatches with fsdp2lite equal one process holding the whole global batch: the loss,
  every gradient and the losses of 3 AdamW steps (spawned once);
- examples/train.py --data chat.jsonl under torchrun (2 ranks, 2 microbatches) logs the one-process run's
  losses; bad data through train.py names its file and line.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from _dist import cpu_mesh, spawn_checks
from _models import example_train

import fsdp2lite as fl
from fsdp2lite.finetune import data
from fsdp2lite.models import GPT, GPTConfig

REPO = Path(__file__).resolve().parents[1]
CHAT_DATA = REPO / "examples" / "data" / "chat.jsonl"
CHAT_TOKENIZER = REPO / "examples" / "data" / "chat-tokenizer"
EOS, IM_END = "<|endoftext|>", "<|im_end|>"


def chat_tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(CHAT_TOKENIZER, local_files_only=True)


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def trained_text(tokenizer: Any, example: data.TokenizedExample) -> str:
    return tokenizer.decode([i for i, t in zip(example.input_ids, example.trained) if t])


USER = {"role": "user", "content": "What is 2 plus 3?"}
ANSWER = {"role": "assistant", "content": "5."}
FOLLOW_UP = {"role": "user", "content": "And times?"}
SECOND_ANSWER = {"role": "assistant", "content": "6."}


# ---- formats ---------------------------------------------------------------------------------------------
def test_every_format_is_read(tmp_path: Path) -> None:
    rows = [
        {"text": "The cat sat.", "id": 7},
        "",
        {"prompt": "2 + 3 =", "completion": " 5"},
        {"prompt": [USER], "completion": [ANSWER]},
        {"messages": [{"role": "system", "content": "Be brief."}, USER, ANSWER], "tools": [], "source": "x"},
    ]
    examples = data.read_jsonl(write_jsonl(tmp_path / "d.jsonl", rows))
    assert [type(e).__name__ for e in examples] == [
        "TextExample",
        "PromptCompletion",
        "PromptCompletion",
        "Conversation",
    ]
    assert [e.where for e in examples] == [f"{tmp_path / 'd.jsonl'} line {n}" for n in (1, 3, 4, 5)], "blank skipped"
    text, strings, chat_pc, chat = examples
    assert isinstance(text, data.TextExample) and text.text == "The cat sat."
    assert isinstance(strings, data.PromptCompletion) and not strings.conversational and strings.completion == " 5"
    assert isinstance(chat_pc, data.PromptCompletion) and chat_pc.conversational and chat_pc.completion == [ANSWER]
    assert (
        isinstance(chat, data.Conversation)
        and chat.tools == []
        and [m["role"] for m in chat.messages]
        == [
            "system",
            "user",
            "assistant",
        ]
    )


def test_the_bundled_chat_sample_is_what_its_script_writes(tmp_path: Path) -> None:
    """examples/data/chat.jsonl and chat-tokenizer/ are make_chat_sample.py's output, and every conversation fits
    train.py's default --seq 128 whole."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_chat_sample", CHAT_DATA.parent / "make_chat_sample.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.write(tmp_path)
    assert (tmp_path / "chat.jsonl").read_text() == CHAT_DATA.read_text()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / "chat-tokenizer" / name).read_text() == (CHAT_TOKENIZER / name).read_text(), name
    tokenizer = chat_tokenizer()
    assert len(tokenizer) == 256 and (tokenizer.eos_token_id, tokenizer.pad_token_id) == (0, 0)
    examples = data.tokenize_examples(data.read_jsonl(CHAT_DATA), tokenizer, "chat-tokenizer")
    assert max(len(e.input_ids) for e in examples) <= 129


# ---- masks -------------------------------------------------------------------------------------------------
def test_masks_per_format() -> None:
    tokenizer = chat_tokenizer()
    examples = [
        data.TextExample("t", "The cat sat."),
        data.PromptCompletion("p", "2 + 3 =", " 5"),
        data.PromptCompletion("c", [USER], [ANSWER]),
        data.Conversation(
            "m", [{"role": "system", "content": "Be brief."}, USER, ANSWER, FOLLOW_UP, SECOND_ANSWER], None
        ),
    ]
    text, strings, chat_pc, chat = data.tokenize_examples(examples, tokenizer, "chat-tokenizer")
    assert all(text.trained) and tokenizer.decode(text.input_ids) == "The cat sat." + EOS, "text: all, then EOS"
    assert tokenizer.decode(strings.input_ids) == "2 + 3 = 5" + EOS and trained_text(tokenizer, strings) == " 5" + EOS
    assert trained_text(tokenizer, chat_pc) == f"5.{IM_END}\n", "the completion and its end of turn, no header"
    assert tokenizer.decode(chat_pc.input_ids).startswith("<|im_start|>user\nWhat is 2 plus 3?")
    assert trained_text(tokenizer, chat) == f"5.{IM_END}\n6.{IM_END}\n", "both assistant turns, nothing else"
    assert [e.kind for e in (text, strings, chat_pc, chat)] == [
        "text",
        "prompt/completion",
        "prompt/completion",
        "messages",
    ]


def test_assistant_mask_is_the_templates_generation_span_and_its_newline() -> None:
    """On every conversation of the bundled sample: the trained tokens are exactly those Hugging Face marks from
    the template's {% generation %} markers (content and <|im_end|>), plus the newline ChatML writes after each
    turn (the prefix rule cannot tell it from the turn's end)."""
    tokenizer = chat_tokenizer()
    examples = data.read_jsonl(CHAT_DATA)
    newline = tokenizer("\n")["input_ids"]
    for example, tokenized in zip(examples, data.tokenize_examples(examples, tokenizer, "chat-tokenizer")):
        assert isinstance(example, data.Conversation)
        marked = tokenizer.apply_chat_template(
            example.messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        assert marked["input_ids"] == tokenized.input_ids
        expected = [
            bool(m) or (i > 0 and marked["assistant_masks"][i - 1] == 1 and [tokenized.input_ids[i]] == newline)
            for i, m in enumerate(marked["assistant_masks"])
        ]
        assert tokenized.trained == expected, example.where


def test_bytes_tokenizer_reads_text_and_prompt_completion() -> None:
    text, strings = data.tokenize_examples(
        [data.TextExample("t", "hé"), data.PromptCompletion("p", "ab", "c")], None, "bytes"
    )
    assert text.input_ids == list("hé".encode()) and all(text.trained), "UTF-8 bytes, no EOS"
    assert strings.input_ids == [97, 98, 99] and strings.trained == [False, False, True]


# ---- packing ------------------------------------------------------------------------------------------------
def tokenized(where: str, ids: list[int], trained: list[bool] | None = None, kind: str = "text") -> Any:
    return data.TokenizedExample(where, ids, trained if trained is not None else [True] * len(ids), kind)


def test_packing_windows_labels_and_position_ids() -> None:
    pc = tokenized("a", [10, 11, 12, 13, 14, 15], [False] * 3 + [True] * 3, "prompt/completion")
    text = tokenized("b", [20, 21, 22, 23])
    short = tokenized("c", [30, 31])
    windows = data.pack([pc, text, short], max_length=8, pad_id=0)
    assert windows.windows.shape == (2, 3, 8) and len(windows) == 2 and windows.seq == 8
    first, second = windows[0].tolist(), windows[1].tolist()
    assert first == [  # the longest (5 positions) first, then the 3 that fill the window best
        [10, 11, 12, 13, 14, 20, 21, 22],
        [-100, -100, 13, 14, 15, 21, 22, 23],
        [0, 1, 2, 3, 4, 0, 1, 2],
    ]
    assert second == [[30, 0, 0, 0, 0, 0, 0, 0], [31] + [-100] * 7, [0, 0, 1, 2, 3, 4, 5, 6]], "padding: its own"
    assert windows.targets == 3 + 3 + 1 and windows.examples == 3 and windows.num_tokens == 12


def test_long_text_is_split_into_sequences_of_their_own() -> None:
    windows = data.pack([tokenized("t", list(range(1, 12)))], max_length=4, pad_id=0)  # 10 positions: 4 + 4 + 2
    rows = sorted((w[0].tolist(), w[1].tolist(), w[2].tolist()) for w in windows.windows)
    assert rows == [
        ([1, 2, 3, 4], [2, 3, 4, 5], [0, 1, 2, 3]),
        ([5, 6, 7, 8], [6, 7, 8, 9], [0, 1, 2, 3]),
        ([9, 10, 0, 0], [10, 11, -100, -100], [0, 1, 0, 1]),
    ]


def test_best_fit_decreasing() -> None:
    # 7 opens bin 0 (space 3); 5 opens bin 1 (space 5); 4 fits bin 1 best (space 1); 3 fills bin 0; 2 opens bin 2
    assert data.best_fit_decreasing([3, 5, 7, 2, 4], 10) == [[2, 0], [1, 4], [3]]


# ---- packed windows isolate their examples ------------------------------------------------------------------
@pytest.mark.parametrize("model_kind", ["llama-sdpa", "llama-eager", "gpt2", "gpt"])
def test_packed_window_equals_its_examples_run_alone(model_kind: str) -> None:
    """transformers' masks (position ids, no attention mask; Llama, GPT-2) and fsdp2lite's GPT keep packed
    examples apart: each example's logits in the window equal its own forward; the window's loss is its examples'
    token mean."""
    from _models import tiny_llama

    torch.manual_seed(0)
    if model_kind == "gpt":
        model: nn.Module = GPT(GPTConfig(vocab_size=96, seq_len=16, d_model=32, n_heads=2, n_layers=2))
    elif model_kind == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        model = GPT2LMHeadModel(GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=2, n_positions=16)).eval()
    else:
        model = tiny_llama(vocab=96)
        model.config._attn_implementation = model_kind.removeprefix("llama-")
    examples = [tokenized("a", [5, 6, 7, 8, 9, 10], [False, False, True, True, True, True], "messages")]
    examples += [tokenized("b", [40, 41, 42, 43]), tokenized("c", [70, 71, 72])]
    [window] = data.pack(examples, max_length=12, pad_id=0).windows  # 5 + 3 + 2 positions, 2 of padding
    with torch.no_grad():
        packed = data.forward_logits(model, window[None, 0], window[None, 2])[0]
        start, sums = 0, torch.zeros(())
        for example in examples:
            inputs = torch.tensor([example.input_ids[:-1]])
            alone = data.forward_logits(model, inputs, torch.arange(inputs.shape[1])[None])[0]
            torch.testing.assert_close(packed[start : start + len(alone)], alone, rtol=0, atol=1e-5)
            labels = window[1, start : start + len(alone)]
            sums += F.cross_entropy(alone, labels, ignore_index=-100, reduction="sum")
            start += len(alone)
        loss = data.packed_loss(model, window[None], data.num_items_in_batch([window[None]]))
    assert int(data.num_items_in_batch([window[None]])) == 4 + 3 + 2
    torch.testing.assert_close(loss, sums / 9, rtol=1e-6, atol=0)


# ---- bad input ----------------------------------------------------------------------------------------------
BAD_LINES = [
    (
        "not-json",
        '{"text": "a"',
        "line 1: not valid JSON (Expecting ',' delimiter at column 13); each line is one object: ",
    ),
    (
        "not-an-object",
        '["text", "a"]',
        'line 1: is an array, not an object; each line is one object: {"text": ...}, {"prompt": ',
    ),
    (
        "no-format-key",
        {"input": "a"},
        "line 1: no 'text', 'prompt'/'completion' or 'messages' key (its keys: 'input'); valid: ",
    ),
    (
        "prompt-only",
        {"prompt": "a"},
        "line 1: 'prompt' without 'completion': the prompt/completion format needs both; valid: ",
    ),
    (
        "completion-only",
        {"completion": "a"},
        "line 1: 'completion' without 'prompt': the prompt/completion format needs both",
    ),
    (
        "two-formats",
        {"text": "a", "messages": []},
        "line 1: keys of more than one format ('text', 'messages'): one format per line",
    ),
    (
        "unknown-role",
        {"messages": [USER, {"role": "bot", "content": "hi"}]},
        "messages[1].role is 'bot', expected one of system, ",
    ),
    (
        "no-assistant",
        {"messages": [USER]},
        "line 1: 'messages' has no assistant message (roles: user): nothing to train on",
    ),
    (
        "no-content",
        {"messages": [{"role": "user"}]},
        "line 1: messages[0] has no 'content'; a message needs role and content",
    ),
    (
        "content-not-string",
        {"messages": [{"role": "user", "content": [1]}]},
        "line 1: messages[0].content is an array, expected a string",
    ),
    ("messages-not-array", {"messages": "hi"}, "line 1: 'messages' is a string, expected an array of messages"),
    (
        "mixed-prompt-completion",
        {"prompt": "a", "completion": [ANSWER]},
        "line 1: 'prompt' is a string and 'completion' an array: both strings",
    ),
    ("text-not-string", {"text": 3}, "line 1: 'text' is a number, expected a string"),
    ("empty-completion", {"prompt": "a", "completion": ""}, "line 1: 'completion' is empty: nothing to train on"),
]


@pytest.mark.parametrize(("row", "message"), [case[1:] for case in BAD_LINES], ids=[case[0] for case in BAD_LINES])
def test_bad_lines_are_named_with_file_and_line(tmp_path: Path, row: Any, message: str) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [row])
    with pytest.raises(data.DataError) as info:
        data.read_jsonl(path)
    assert str(info.value).startswith(f"{path} line 1: ") and message in str(info.value), str(info.value)
    assert str(info.value).count("\n") == 0, "one problem, said once"


def test_every_bad_line_is_listed_then_summarized(tmp_path: Path) -> None:
    rows = [{"text": "fine"}] + [{"prompt": "a"}] * 7
    with pytest.raises(data.DataError) as info:
        data.read_jsonl(write_jsonl(tmp_path / "bad.jsonl", rows))
    lines = str(info.value).splitlines()
    assert [line.split(":")[0] for line in lines[:5]] == [f"{tmp_path / 'bad.jsonl'} line {n}" for n in range(2, 7)]
    assert lines[5] == "and 2 more like them" and len(lines) == 6 and len(info.value.problems) == 7


def test_messages_need_a_chat_template(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "chat.jsonl", [{"text": "a"}, {"messages": [USER, ANSWER]}] * 2)
    examples = data.read_jsonl(path)
    without = chat_tokenizer()
    without.chat_template = None
    for tokenizer, name in ((None, "the bytes tokenizer"), (without, "the tokenizer chat-tokenizer")):
        with pytest.raises(data.DataError) as info:
            data.tokenize_examples(examples, tokenizer, name)
        assert str(info.value).startswith(
            f"{path} line 2 (and 1 more like it): messages are rendered with the tokenizer's chat template, and "
            f"{name} has none: use a tokenizer whose tokenizer_config.json (or chat_template.jinja) holds one"
        ), str(info.value)


def test_a_completion_longer_than_a_window_is_refused(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "ab", "completion": "c" * 20}, {"text": "d" * 40}])
    examples = data.tokenize_examples(data.read_jsonl(path), None, "bytes")
    with pytest.raises(data.DataError) as info:
        data.pack(examples, max_length=16, pad_id=0, length_name="--seq")
    assert str(info.value) == (
        f"{path} line 1: 22 tokens (20 of them in its completion); a window of --seq 16 holds 17 (16 inputs, each "
        "with the next token as its target) and a prompt/completion example must fit whole in one: pass --seq 21 "
        "or more, or shorten it"
    ), "the long text (line 2) is split, not refused"


# ---- 2 ranks x 2 microbatches = one process ----------------------------------------------------------------
WORLD, MICRO, BATCH, STEPS = 2, 2, 2, 3


def chat_windows() -> torch.Tensor:
    """The first 40 conversations of the bundled sample, packed at --seq 128: (windows, 3, 128)."""
    examples = data.read_jsonl(CHAT_DATA)[:40]
    tokenized = data.tokenize_examples(examples, chat_tokenizer(), "chat-tokenizer")
    return data.pack(tokenized, max_length=128, pad_id=0).windows


def global_batch(windows: torch.Tensor, step: int) -> torch.Tensor:
    """Step ``step``'s WORLD * MICRO * BATCH windows, rank-major: rank r's microbatch m is [r, m]."""
    count = WORLD * MICRO * BATCH
    return windows[step * count : (step + 1) * count].view(WORLD, MICRO, BATCH, 3, -1)


def _check_two_ranks_match_one_process(rank: int, world_size: int) -> None:
    from _models import tiny_llama

    windows = chat_windows()
    torch.manual_seed(0)
    reference = tiny_llama(vocab=256)
    model = copy.deepcopy(reference)
    for layer in model.model.layers:
        fl.fully_shard(layer, cpu_mesh())
    fl.fully_shard(model, cpu_mesh())
    loss_fn = data.TokenMeanLoss(world_size)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, reference)]
    for step in range(STEPS):
        batches = global_batch(windows, step)
        counts = (batches[:, :, :, 1] != -100).sum(dim=(2, 3))  # (WORLD, MICRO) trained tokens
        assert len(set(counts.flatten().tolist())) > 1, "microbatches of unequal token counts: means would differ"
        micro_batches = list(batches[rank])
        num_items = loss_fn.count(micro_batches)
        assert int(num_items) == int(counts.sum())
        loss_sum = torch.zeros(())
        for micro, batch in enumerate(micro_batches):
            model.set_requires_gradient_sync(micro == MICRO - 1)
            loss = loss_fn(model, batch, num_items)
            loss.backward()
            loss_sum += loss.detach()
        dist.all_reduce(loss_sum)
        whole = batches.flatten(0, 2)  # every rank's every microbatch: (WORLD * MICRO * BATCH, 3, seq)
        reference_loss = data.packed_loss(reference, whole, (whole[:, 1] != -100).sum())
        reference_loss.backward()
        torch.testing.assert_close(loss_sum / world_size, reference_loss.detach(), rtol=1e-5, atol=0)
        for (name, param), expected in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(param.grad.full_tensor(), expected.grad, rtol=1e-4, atol=1e-6, msg=name)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()


def test_two_ranks_and_microbatches_equal_one_process() -> None:
    spawn_checks(WORLD, _check_two_ranks_match_one_process)


# ---- examples/train.py --data FILE.jsonl ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def chat_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The bundled chat sample, fp32, global batch 8 windows a step: 2 ranks x 2 microbatches of 2 under torchrun,
    and one process with microbatches of 4."""
    from test_example_train import LAYERS_FP32, python, record, torchrun

    tmp = tmp_path_factory.mktemp("chat")
    (tmp / "fp32.yaml").write_text(LAYERS_FP32)
    common = ["--data", str(CHAT_DATA), "--tokenizer", str(CHAT_TOKENIZER), "--config", "fp32.yaml", "--seq", "128"]
    common += ["--grad-accum", "2", "--steps", "3", "--warmup-steps", "2", "--log-every", "1"]
    two = record(torchrun(*common, "--batch", "2", "--metrics", "two.jsonl", cwd=tmp))
    one = record(python(*common, "--batch", "4", "--metrics", "one.jsonl", cwd=tmp))
    return {"tmp": tmp, "two": two, "one": one}


def test_train_on_a_chat_jsonl_two_ranks_equal_one_process(chat_runs: dict[str, Any]) -> None:
    from test_example_train import losses

    two, one = chat_runs["two"], chat_runs["one"]
    assert (two["world_size"], one["world_size"]) == (2, 1)
    windows = data.load_jsonl(CHAT_DATA, chat_tokenizer(), 128)
    for run in (two, one):
        assert run["examples"] == 400 and run["formats"] == {"messages": 400}
        assert (run["samples"], run["trained_tokens"]) == (len(windows), windows.targets)
        assert run["tokenizer"] == str(CHAT_TOKENIZER)
    two_losses, one_losses = losses(chat_runs["tmp"] / "two.jsonl"), losses(chat_runs["tmp"] / "one.jsonl")
    assert sorted(two_losses) == sorted(one_losses) == [1, 2, 3]
    for step in two_losses:
        assert two_losses[step] == pytest.approx(one_losses[step], rel=1e-5), (step, two_losses, one_losses)
    assert two_losses[3] < two_losses[1], two_losses


def test_train_refuses_a_json_file(tmp_path: Path) -> None:
    train = example_train()
    path = write_jsonl(tmp_path / "chat.json", [{"text": "a"}])
    args = train.parse_args(["--data", str(path)])
    with pytest.raises(train.UsageError, match=re.escape(f"--data {path}: instruction data is read from JSON Lines")):
        train.read_inputs(args, train.HF_CONFIG)


@pytest.mark.parametrize(
    ("rows", "flags", "message"),
    [
        (['{"messages": [}'], [], "line 1: not valid JSON (Expecting value at column 15)"),
        (
            [{"messages": [USER, ANSWER]}],
            [],
            "line 1: messages are rendered with the tokenizer's chat template, and the bytes tokenizer has none",
        ),
        (
            [{"prompt": "a", "completion": "b" * 40}],
            ["--seq", "16"],
            "line 1: 41 tokens (40 of them in its completion); a window of --seq 16 holds 17",
        ),
    ],
    ids=["not-json", "no-chat-template", "completion-too-long"],
)
def test_train_names_the_bad_line(tmp_path: Path, rows: list[Any], flags: list[str], message: str) -> None:
    train = example_train()
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    args = train.parse_args(["--data", str(path), *flags])
    with pytest.raises(data.DataError, match="^" + re.escape(f"{path} {message}")):
        train.read_inputs(args, train.HF_CONFIG)
