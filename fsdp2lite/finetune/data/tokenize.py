"""Examples to token ids, with the tokens the loss is taken on: TRL's ``completion_mask`` and
``assistant_masks``, found without help from the chat template.

- text: the tokenizer's ids (its special tokens, as TRL's ``processing_class(text=...)``), then EOS; all trained.
- prompt/completion: ``prompt + completion`` tokenized whole, then EOS; trained from where its ids leave the
  prompt's own ids (TRL's ``common_prefix_length``: a merge across the boundary moves the start).
- conversational prompt/completion: the same with the chat template, the prompt rendered with its generation
  prompt (``add_generation_prompt=True``).
- messages: the whole conversation rendered once; assistant message ``i`` is trained from where the render of
  ``messages[:i]`` with the generation prompt leaves the whole one, to where the render of ``messages[:i + 1]``
  does (the last one to the end): its content and the template's end-of-turn token, not its header. This needs
  no ``{% generation %}`` markers in the template (TRL's ``assistant_only_loss`` does).

With no tokenizer (``None``: bytes) text is its UTF-8 bytes and there is no EOS and no chat template.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from .formats import Conversation, DataError, Example, Message, PromptCompletion, TextExample


class Tokenizer(Protocol):
    """What is used of a Hugging Face tokenizer."""

    chat_template: Any
    eos_token_id: int | None

    def __call__(self, text: Any, **kwargs: Any) -> Mapping[str, Any]: ...

    def apply_chat_template(self, conversation: list[Message], **kwargs: Any) -> Any: ...


@dataclass(frozen=True)
class TokenizedExample:
    """One example's token ids ``(length,)`` and, per token, whether the loss is taken on it as a target."""

    where: str
    input_ids: list[int]
    trained: list[bool]
    kind: str  # "text", "prompt/completion" or "messages": what it was written as

    @property
    def masked(self) -> bool:
        """Whether some tokens are left out of the loss (all but text): such an example is never split."""
        return self.kind != "text"

    @property
    def targets(self) -> int:
        """Tokens in the loss: every trained token but the first, which nothing predicts."""
        return sum(self.trained[1:])


def tokenize_examples(examples: list[Example], tokenizer: Tokenizer | None, name: str) -> list[TokenizedExample]:
    """Every example tokenized; a DataError naming every example that cannot be (``name``: the tokenizer's, for
    the messages)."""
    _require_chat_template(examples, tokenizer, name)
    tokenized: list[TokenizedExample] = []
    problems: list[str] = []
    for example in examples:
        try:
            one = tokenize_example(example, tokenizer)
        except _TemplateFailed as exc:
            problems.append(f"{example.where}: the chat template of {name} fails on it: {exc}")
            continue
        if one.targets == 0:
            problems.append(f"{example.where}: {len(one.input_ids)} token(s) and none to train on after tokenizing")
        tokenized.append(one)
    if problems:
        raise DataError(problems)
    return tokenized


def tokenize_example(example: Example, tokenizer: Tokenizer | None) -> TokenizedExample:
    if isinstance(example, TextExample):
        ids = _with_eos(_encode(tokenizer, example.text), tokenizer)
        return TokenizedExample(example.where, ids, [True] * len(ids), "text")
    if isinstance(example, PromptCompletion):
        return _prompt_completion(example, tokenizer)
    return _conversation(example, _chat(tokenizer))


def _prompt_completion(example: PromptCompletion, tokenizer: Tokenizer | None) -> TokenizedExample:
    prompt, completion = example.prompt, example.completion
    if isinstance(prompt, list) and isinstance(completion, list):
        chat = _chat(tokenizer)
        prompt_ids = _render(chat, prompt, None, add_generation_prompt=True)
        ids = _render(chat, prompt + completion, None)
    elif isinstance(prompt, str) and isinstance(completion, str):
        prompt_ids = _encode(tokenizer, prompt)
        ids = _with_eos(_encode(tokenizer, prompt + completion), tokenizer)
    else:  # formats.py makes only these two
        raise TypeError(f"{example.where}: prompt and completion of two types ({type(prompt)}, {type(completion)})")
    start = common_prefix_length(prompt_ids, ids)
    return TokenizedExample(example.where, ids, [i >= start for i in range(len(ids))], "prompt/completion")


def _conversation(example: Conversation, chat: Tokenizer) -> TokenizedExample:
    messages, tools = example.messages, example.tools
    ids = _render(chat, messages, tools)
    trained = [False] * len(ids)
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = common_prefix_length(_render(chat, messages[:index], tools, add_generation_prompt=True), ids)
        last = index == len(messages) - 1
        end = len(ids) if last else common_prefix_length(_render(chat, messages[: index + 1], tools), ids)
        trained[start:end] = [True] * (end - start)
    return TokenizedExample(example.where, ids, trained, "messages")


def common_prefix_length(ids: list[int], other: list[int]) -> int:
    """How many leading ids the two lists share."""
    length = 0
    for a, b in zip(ids, other):
        if a != b:
            break
        length += 1
    return length


class _TemplateFailed(Exception):
    """The tokenizer's chat template raised on an example (a template is code: it may refuse roles)."""


def _render(chat: Tokenizer, messages: list[Message], tools: list[Any] | None, **kwargs: Any) -> list[int]:
    if not messages:  # the prefix before a first assistant message; templates may refuse an empty conversation
        return []
    try:
        out = chat.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True, **kwargs)
    except Exception as exc:  # jinja2's TemplateError, or what a template raises through raise_exception
        raise _TemplateFailed(f"{type(exc).__name__}: {exc}") from None
    return list(out["input_ids"])


def _encode(tokenizer: Tokenizer | None, text: str) -> list[int]:
    if tokenizer is None:
        return list(text.encode("utf-8"))
    return list(tokenizer(text)["input_ids"])


def _with_eos(ids: list[int], tokenizer: Tokenizer | None) -> list[int]:
    eos = None if tokenizer is None else tokenizer.eos_token_id
    return ids + [eos] if eos is not None and (not ids or ids[-1] != eos) else ids


def _chat(tokenizer: Tokenizer | None) -> Tokenizer:
    if tokenizer is None or tokenizer.chat_template is None:  # tokenize_examples checks it for the whole file first
        raise DataError(["messages are rendered with the tokenizer's chat template, and this tokenizer has none"])
    return tokenizer


def _require_chat_template(examples: list[Example], tokenizer: Tokenizer | None, name: str) -> None:
    """One error for the whole file when messages meet a tokenizer without a chat template."""
    if tokenizer is not None and tokenizer.chat_template is not None:
        return
    chats = [
        e for e in examples if isinstance(e, Conversation) or (isinstance(e, PromptCompletion) and e.conversational)
    ]
    if not chats:
        return
    more = f" (and {len(chats) - 1} more like it)" if len(chats) > 1 else ""
    raise DataError(
        [
            f"{chats[0].where}{more}: messages are rendered with the tokenizer's chat template, and {name} has "
            "none: use a tokenizer whose tokenizer_config.json (or chat_template.jinja) holds one, or write the "
            'data as {"text": ...} or {"prompt": "...", "completion": "..."} strings'
        ]
    )
