"""Record formats of fine-tuning data: one JSON object (or table row) -> one `Document`.

The format of a record is named by its keys (or forced with `data_format=`):

| format              | keys                                                    | trained (train_on="assistant") |
|---------------------|---------------------------------------------------------|--------------------------------|
| `messages`          | `messages`: [{"role", "content"}, ...] (OpenAI / TRL)   | every assistant turn           |
| `sharegpt`          | `conversations`: [{"from", "value"}, ...]               | every "gpt" turn               |
| `alpaca`            | `instruction`, `input` (optional), `output`             | the output                     |
| `prompt-completion` | `prompt`, `completion`: strings, or lists of messages   | the completion                 |
| `prompt-response`   | `prompt`, `response`                                    | the response                   |
| `text`              | `text`                                                  | every token                    |

Conversations (messages, sharegpt, alpaca, conversational prompt-completion, and prompt-response
when the tokenizer has a chat template) go through the tokenizer's chat template. A plain
prompt-completion is TRL's "standard" format: prompt and completion are joined as they are.

Example:
    >>> doc = to_document({"instruction": "Add 2 and 2.", "output": "4"}, "alpaca", "x")
    >>> doc.messages[1], doc.trainable
    ({'role': 'assistant', 'content': '4'}, (False, True))
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from ..errors import QuantmeshError

__all__ = [
    "ACCEPTED",
    "FORMATS",
    "DataError",
    "Document",
    "detect",
    "needs",
    "no_format_error",
    "non_text_part",
    "to_document",
    "used_keys",
]


class DataError(QuantmeshError, ValueError):
    """A data file that cannot be read as one of the supported formats; the message names the file,
    the line or row, the keys found and the formats accepted."""


# format -> the keys that name it, in the order formats are tried (alpaca before text: Alpaca
# files often carry a pre-rendered "text" column too)
_KEYS: dict[str, tuple[str, ...]] = {
    "messages": ("messages",),
    "sharegpt": ("conversations",),
    "alpaca": ("instruction", "output"),
    "prompt-completion": ("prompt", "completion"),
    "prompt-response": ("prompt", "response"),
    "text": ("text",),
}
_OPTIONAL: dict[str, tuple[str, ...]] = {"alpaca": ("input",)}
FORMATS = tuple(_KEYS)
"""The record formats, by the name `--data-format` takes."""

ACCEPTED = (
    "accepted formats: messages {'messages': [{'role', 'content'}, ...]}, "
    "prompt-completion {'prompt', 'completion'} (two strings, or two lists of messages), "
    "alpaca {'instruction', 'input' (optional), 'output'}, "
    "sharegpt {'conversations': [{'from', 'value'}, ...]}, "
    "prompt-response {'prompt', 'response'}, text {'text'}"
)
# ShareGPT speakers -> chat roles
_SPEAKERS = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
             "system": "system"}  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class Document:
    """One unit of training data: a text, a prompt with its response or completion, or a
    conversation.

    Example:
        >>> Document(text="To be, or not to be").is_instruction
        False
        >>> Document(prompt="Name a colour.", response="Blue.").kind
        'response'
    """

    text: str | None = None
    """Plain text, trained on every token."""
    prompt: str | None = None
    """The prompt of a prompt/response or prompt/completion pair: part of the input only."""
    response: str | None = None
    """The response to `prompt`: a user and an assistant turn when the tokenizer has a chat
    template, else joined to the prompt as it is."""
    completion: str | None = None
    """The completion of `prompt` (TRL's plain prompt-completion): always joined as it is."""
    messages: tuple[dict[str, Any], ...] | None = None
    """A conversation: {"role", "content"} dicts, rendered with the chat template."""
    trainable: tuple[bool, ...] | None = None
    """Per message of `messages`: trained under train_on="assistant" (default: assistant turns)."""

    def __post_init__(self) -> None:
        kinds = [self.text is not None, self.response is not None, self.completion is not None,
                 self.messages is not None]  # fmt: skip
        pair = self.response is not None or self.completion is not None
        if sum(kinds) != 1 or (self.prompt is not None) != pair:
            raise ValueError(
                "a Document holds either text=..., prompt=... with response=... or "
                "completion=..., or messages=...; got "
                f"text={self.text!r:.30}, prompt={self.prompt!r:.30}, "
                f"response={self.response!r:.30}, completion={self.completion!r:.30}, "
                f"messages={self.messages!r:.30}"
            )
        if self.messages is not None:
            if self.trainable is None:
                trainable = tuple(m.get("role") == "assistant" for m in self.messages)
                object.__setattr__(self, "trainable", trainable)
            elif len(self.trainable) != len(self.messages):
                raise ValueError(
                    f"trainable has {len(self.trainable)} flags for {len(self.messages)} messages"
                )

    @property
    def kind(self) -> str:
        """ "text", "response", "completion" or "chat"."""
        if self.text is not None:
            return "text"
        if self.messages is not None:
            return "chat"
        return "response" if self.response is not None else "completion"

    @property
    def is_instruction(self) -> bool:
        """True for everything but plain text (only some tokens are trained)."""
        return self.text is None


def detect(keys: Collection[str]) -> str | None:
    """The format named by a record's keys (those with a value), or None.

    Example:
        >>> detect({"prompt", "completion", "id"}), detect({"foo"})
        ('prompt-completion', None)
    """
    for fmt, need in _KEYS.items():
        if all(k in keys for k in need):
            return fmt
    return None


def needs(fmt: str) -> tuple[str, ...]:
    """The keys a record of format `fmt` must have.

    Example:
        >>> needs("alpaca")
        ('instruction', 'output')
    """
    return _KEYS[fmt]


def used_keys(fmt: str) -> tuple[str, ...]:
    """The keys format `fmt` reads (the rest of a record is not used).

    Example:
        >>> used_keys("alpaca")
        ('instruction', 'output', 'input')
    """
    return _KEYS[fmt] + _OPTIONAL.get(fmt, ())


def no_format_error(where: str, keys: Collection[str], fmt: str | None = None) -> DataError:
    """The error for a record that is not in format `fmt` (or in none, when fmt is None)."""
    found = sorted(keys)
    if fmt is not None:
        need = [k for k in _KEYS[fmt] if k not in keys]
        return DataError(
            f"{where}: --data-format {fmt} needs the keys {list(_KEYS[fmt])}, missing "
            f"{need}; got keys {found}; {ACCEPTED}"
        )
    hint = ""
    if "prompt" in keys:
        hint = " (a 'prompt' needs a 'completion' or a 'response')"
    elif "instruction" in keys:
        hint = " (an 'instruction' needs an 'output')"
    elif keys and {"completion", "response", "output"} & set(keys):
        hint = " (a 'completion' or 'response' needs a 'prompt', an 'output' an 'instruction')"
    return DataError(f"{where}: no known format in the keys {found}{hint}; {ACCEPTED}")


def to_document(obj: dict[str, Any], fmt: str, where: str) -> Document:
    """The Document of record `obj` read as format `fmt`; `where` ("file line 3") names it in
    errors.

    Example:
        >>> to_document({"prompt": "Hi", "completion": " there"}, "prompt-completion", "x").kind
        'completion'
    """
    if fmt == "text":
        return Document(text=_str(obj, "text", where))
    if fmt == "prompt-response":
        return Document(prompt=_str(obj, "prompt", where), response=_str(obj, "response", where))
    if fmt == "prompt-completion":
        p, c = obj["prompt"], obj["completion"]
        if isinstance(p, str) and isinstance(c, str):
            return Document(prompt=p, completion=c)
        if isinstance(p, list) and isinstance(c, list):
            pm, pw = _messages(p, where, "prompt")
            cm, cw = _messages(c, where, "completion")
            # the completion's turns are trained (unless weight 0), the prompt's never
            return Document(messages=pm + cm, trainable=(False,) * len(pm) + cw)
        raise DataError(
            f"{where}: 'prompt' and 'completion' must be two strings or two lists of messages; "
            f"got {type(p).__name__} and {type(c).__name__}"
        )
    if fmt == "messages":
        msgs, weights = _messages(obj["messages"], where, "messages")
        flags = tuple(m["role"] == "assistant" and w for m, w in zip(msgs, weights, strict=True))
        return Document(messages=msgs, trainable=flags)
    if fmt == "alpaca":
        instruction, output = _str(obj, "instruction", where), _str(obj, "output", where)
        extra = obj.get("input")
        if extra is not None and not isinstance(extra, str):
            raise DataError(f"{where}: field 'input' must be a string, got {type(extra).__name__}")
        user = f"{instruction}\n\n{extra}" if extra else instruction
        msgs = ({"role": "user", "content": user}, {"role": "assistant", "content": output})
        return Document(messages=msgs, trainable=(False, True))
    if fmt == "sharegpt":
        turns = obj["conversations"]
        if not isinstance(turns, list) or not turns:
            raise DataError(f"{where}: 'conversations' must be a non-empty list of turns")
        out = []
        for i, t in enumerate(turns):
            if not isinstance(t, dict) or not isinstance(t.get("from"), str):
                raise DataError(
                    f"{where}: conversations[{i}] must be an object with 'from' and 'value'; "
                    f"got {t!r:.60}"
                )
            role = _SPEAKERS.get(t["from"])
            if role is None:
                raise DataError(
                    f"{where}: conversations[{i}] is from {t['from']!r}; expected one of "
                    f"{', '.join(_SPEAKERS)}"
                )
            value = t.get("value")
            if not isinstance(value, str):
                raise DataError(f"{where}: conversations[{i}]['value'] must be a string")
            out.append({"role": role, "content": value})
        return Document(messages=tuple(out))
    raise ValueError(f"unknown data format {fmt!r}; use one of {', '.join(FORMATS)}")


def _str(obj: dict[str, Any], key: str, where: str) -> str:
    value = obj[key]
    if not isinstance(value, str):
        raise DataError(
            f"{where}: field {key!r} must be a string, got {type(value).__name__} {value!r:.40}"
        )
    return value


def non_text_part(parts: list[Any]) -> tuple[int, Any] | None:
    """(index, type) of the first of OpenAI's content parts that is not a text part
    ({"type": "text", "text": str}), None when all are: the rule training data and the server
    both read message content by (the texts joined).

    Example:
        >>> non_text_part([{"type": "text", "text": "hi"}, {"type": "image_url"}])
        (1, 'image_url')
    """
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            return j, kind
    return None


def _text_parts(parts: list[Any], where: str) -> str:
    """A message's content given as OpenAI's content parts: the texts joined; any other part (an
    image, audio) is refused."""
    bad = non_text_part(parts)
    if bad is not None:
        raise DataError(
            f"{where}['content'][{bad[0]}]: a content part of type {bad[1]!r}; only text parts "
            "({'type': 'text', 'text': ...}) are trained on"
        )
    return "".join(part["text"] for part in parts)


def _messages(
    value: Any, where: str, key: str
) -> tuple[tuple[dict[str, Any], ...], tuple[bool, ...]]:
    """A list of {"role", "content"} messages, and per message whether it may be trained (an
    OpenAI-style "weight": 0 says never)."""
    if not isinstance(value, list) or not value:
        raise DataError(
            f"{where}: {key!r} must be a non-empty list of {{'role', 'content'}} messages; "
            f"got {value!r:.60}"
        )
    msgs, weights = [], []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise DataError(f"{where}: {key}[{i}] must be an object with 'role' and 'content'")
        # Arrow tables give every row every field of the column's struct: None means absent
        m = {k: v for k, v in m.items() if v is not None}
        role, content = m.get("role"), m.get("content")
        if isinstance(content, list):  # OpenAI's content parts: text parts joined, as serve does
            m["content"] = content = _text_parts(content, f"{where}: {key}[{i}]")
        if not isinstance(role, str) or not isinstance(content, str):
            raise DataError(
                f"{where}: {key}[{i}] needs a string 'role' and a string 'content' (or a list of "
                f"text parts; tool-call messages are not supported); got keys {sorted(m)}"
            )
        weight = m.pop("weight", 1)
        if weight not in (0, 1) or isinstance(weight, bool):
            raise DataError(f"{where}: {key}[{i}]['weight'] must be 0 or 1, got {weight!r}")
        msgs.append(m)
        weights.append(weight == 1)
    return tuple(msgs), tuple(weights)
