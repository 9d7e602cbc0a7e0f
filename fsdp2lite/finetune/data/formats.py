"""Instruction data as JSON Lines: one example per line, in the formats TRL's ``SFTTrainer`` takes.

- language modeling: ``{"text": "..."}``, every token trained;
- prompt/completion: ``{"prompt": "...", "completion": "..."}``, or both as lists of messages (TRL's
  conversational prompt/completion); only the completion is trained;
- conversational: ``{"messages": [{"role": "user", "content": "..."}, ...]}``, rendered with the tokenizer's
  chat template; only the assistant turns are trained. An optional ``"tools"`` list is handed to the template.

Other keys on a line (an id, a source) are ignored. Each line is checked here, before any tokenizer runs;
every bad line is reported with its file and line number, all of them in one ``DataError``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROLES = ("system", "user", "assistant", "tool")
FORMATS = '{"text": ...}, {"prompt": ..., "completion": ...} or {"messages": [{"role": ..., "content": ...}, ...]}'
SHOWN_PROBLEMS = 5  # a DataError lists this many problems, then "and N more like them"

Message = dict[str, Any]  # {"role": ..., "content": ..., and whatever else the chat template reads}


class DataError(ValueError):
    """Bad training data: each problem names its file and line and says what would be valid."""

    def __init__(self, problems: list[str]) -> None:
        shown = problems[:SHOWN_PROBLEMS]
        if len(problems) > SHOWN_PROBLEMS:
            shown.append(f"and {len(problems) - SHOWN_PROBLEMS} more like them")
        super().__init__("\n".join(shown))
        self.problems = problems


@dataclass(frozen=True)
class TextExample:
    """``{"text": ...}``: every token is trained."""

    where: str  # "FILE line N", for messages
    text: str


@dataclass(frozen=True)
class PromptCompletion:
    """``{"prompt": ..., "completion": ...}``: both strings, or both lists of messages (rendered with the chat
    template: the prompt with its generation prompt); only the completion is trained."""

    where: str
    prompt: str | list[Message]
    completion: str | list[Message]

    @property
    def conversational(self) -> bool:
        return isinstance(self.prompt, list)


@dataclass(frozen=True)
class Conversation:
    """``{"messages": [...]}``: rendered with the chat template; only the assistant turns are trained."""

    where: str
    messages: list[Message]
    tools: list[Any] | None


Example = TextExample | PromptCompletion | Conversation


class _LineProblem(Exception):
    """One bad line; read_jsonl collects them."""


def read_jsonl(path: Path) -> list[Example]:
    """Every example of the JSON Lines file ``path`` (blank lines skipped); a DataError naming every bad line."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError([f"{path}: cannot read it as UTF-8 text ({exc})"]) from None
    examples: list[Example] = []
    problems: list[str] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path} line {number}"
        try:
            examples.append(parse_example(_decode(line), where))
        except _LineProblem as exc:
            problems.append(f"{where}: {exc}")
    if problems:
        raise DataError(problems)
    if not examples:
        raise DataError([f"{path}: no examples in it; one JSON object per line: {FORMATS}"])
    return examples


def _decode(line: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise _LineProblem(
            f"not valid JSON ({exc.msg} at column {exc.colno}); each line is one object: {FORMATS}"
        ) from None


def parse_example(value: Any, where: str) -> Example:
    """One line's decoded JSON value as an example; raises _LineProblem saying what is wrong."""
    if not isinstance(value, dict):
        raise _LineProblem(f"is {_json_type(value)}, not an object; each line is one object: {FORMATS}")
    formats = [name for name, keys in _FORMAT_KEYS.items() if any(key in value for key in keys)]
    if not formats:
        keys = ", ".join(map(repr, value)) or "none"
        raise _LineProblem(f"no 'text', 'prompt'/'completion' or 'messages' key (its keys: {keys}); valid: {FORMATS}")
    if len(formats) > 1:
        found = ", ".join(repr(key) for name in formats for key in _FORMAT_KEYS[name] if key in value)
        raise _LineProblem(f"keys of more than one format ({found}): one format per line, {FORMATS}")
    if formats == ["text"]:
        return TextExample(where, _string(value, "text"))
    if formats == ["prompt_completion"]:
        return _prompt_completion(value, where)
    return Conversation(where, _messages(value["messages"], "messages", need_assistant=True), _tools(value))


_FORMAT_KEYS = {"text": ("text",), "prompt_completion": ("prompt", "completion"), "messages": ("messages",)}


def _prompt_completion(value: dict[str, Any], where: str) -> PromptCompletion:
    for key, other in (("prompt", "completion"), ("completion", "prompt")):
        if key not in value:
            raise _LineProblem(f"{other!r} without {key!r}: the prompt/completion format needs both; valid: {FORMATS}")
    prompt, completion = value["prompt"], value["completion"]
    if isinstance(prompt, str) and isinstance(completion, str):
        if not completion:
            raise _LineProblem("'completion' is empty: nothing to train on")
        return PromptCompletion(where, prompt, completion)
    if isinstance(prompt, list) and isinstance(completion, list):
        completion_messages = _messages(completion, "completion", need_assistant=True)
        return PromptCompletion(where, _messages(prompt, "prompt", need_assistant=False), completion_messages)
    raise _LineProblem(
        f"'prompt' is {_json_type(prompt)} and 'completion' {_json_type(completion)}: both strings, "
        "or both arrays of messages"
    )


def _string(value: dict[str, Any], key: str) -> str:
    text = value[key]
    if not isinstance(text, str):
        raise _LineProblem(f"{key!r} is {_json_type(text)}, expected a string")
    if not text:
        raise _LineProblem(f"{key!r} is empty: nothing to train on")
    return text


def _messages(value: Any, key: str, need_assistant: bool) -> list[Message]:
    if not isinstance(value, list) or not value:
        got = "an empty array" if isinstance(value, list) else _json_type(value)
        raise _LineProblem(f'{key!r} is {got}, expected an array of messages {{"role": ..., "content": ...}}')
    for index, message in enumerate(value):
        name = f"{key}[{index}]"
        if not isinstance(message, dict):
            raise _LineProblem(f'{name} is {_json_type(message)}, expected {{"role": ..., "content": ...}}')
        missing = [field for field in ("role", "content") if field not in message]
        if missing:
            raise _LineProblem(f"{name} has no {' or '.join(map(repr, missing))}; a message needs role and content")
        if message["role"] not in ROLES:
            raise _LineProblem(f"{name}.role is {message['role']!r}, expected one of {', '.join(ROLES)}")
        if not isinstance(message["content"], str):
            raise _LineProblem(f"{name}.content is {_json_type(message['content'])}, expected a string")
    if need_assistant and not any(message["role"] == "assistant" for message in value):
        roles = ", ".join(message["role"] for message in value)
        raise _LineProblem(f"{key!r} has no assistant message (roles: {roles}): nothing to train on")
    return value


def _tools(value: dict[str, Any]) -> list[Any] | None:
    tools = value.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise _LineProblem(f"'tools' is {_json_type(tools)}, expected an array of tool schemas")
    return tools


def _json_type(value: Any) -> str:
    """What JSON calls ``value``'s type, with its article: "an array", "a string", "null"."""
    names = {
        dict: "an object",
        list: "an array",
        str: "a string",
        bool: "a boolean",
        int: "a number",
        float: "a number",
    }
    return "null" if value is None else names.get(type(value), type(value).__name__)
