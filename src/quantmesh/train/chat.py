"""Conversations through the tokenizer's chat template: the tokens of the assistant turns (each
with the template's end-of-turn text), and the text the template adds besides its markup.

Example:
    >>> ids, labels, added = encode_chats([("chat.jsonl line 1", doc)], tokenizer, "assistant")[0]
    ...                                                                       # doctest: +SKIP
    >>> added  # SmolLM2's template, for a conversation without a system message  # doctest: +SKIP
    ['You are a helpful AI assistant named SmolLM, trained by Hugging Face']
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from .formats import DataError, Document

__all__ = ["IGNORE_INDEX", "check_chat_tokenizer", "encode_chats", "render"]

IGNORE_INDEX = -100  # the label transformers' (and torch's) cross-entropy skips
_ROLES = {"system", "user", "assistant", "tool", "human", "gpt", "model"}


def render(tokenizer: Any, msgs: Sequence[dict[str, Any]], gen: bool, where: str) -> str:
    """The conversation as the chat template writes it (with the assistant's header after it when
    `gen`); a template that refuses it is a DataError naming `where`.

    Example:
        >>> render(tok, [{"role": "user", "content": "Hi"}], True, "x")  # doctest: +SKIP
        '<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n'
    """
    try:
        text = tokenizer.apply_chat_template(list(msgs), tokenize=False, add_generation_prompt=gen)
    except Exception as e:  # the template's own raise_exception(...) or a jinja error
        raise DataError(
            f"{where}: the tokenizer's chat template refused the conversation: {e}"
        ) from None
    return str(text)


def check_chat_tokenizer(tokenizer: Any, where: str) -> None:
    """A conversation (at `where`) needs a fast tokenizer with a chat template.

    Example:
        >>> check_chat_tokenizer(AutoTokenizer.from_pretrained("gpt2"), "x")  # doctest: +SKIP
        DataError: x: conversations are rendered with the tokenizer's chat template, and ...
    """
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"{where}: conversations are rendered with the tokenizer's chat template, and "
            f"{type(tokenizer).__name__} has none; use a model whose tokenizer has one (an "
            "instruct model), set tokenizer.chat_template, or write the data as prompt/"
            "completion strings (joined as they are, the completion trained)"
        )
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(
            f"{where}: conversations need a fast tokenizer (its offsets map the assistant "
            "turns to tokens); load it with AutoTokenizer.from_pretrained(..., use_fast=True)"
        )


def encode_chats(
    items: list[tuple[str, Document]], tokenizer: Any, train_on: str
) -> list[tuple[list[int], list[int], list[str]]]:
    """(input ids, labels, text the template added) of each conversation (`where` names it in
    errors): rendered with the chat template; the trained turns found as character spans of the
    rendered text (rendered up to the turn's header, and up to its end), mapped to tokens by the
    tokenizer's offsets.

    Example:
        >>> ids, labels, added = encode_chats([("x", doc)], tokenizer, "assistant")[0]  # doctest: +SKIP
    """
    check_chat_tokenizer(tokenizer, items[0][0])
    fulls = [render(tokenizer, d.messages or (), False, w) for w, d in items]
    enc = tokenizer(fulls, add_special_tokens=False, return_offsets_mapping=True)
    markup = _markup(tokenizer)
    out = []
    for (where, d), full, ids, offs in zip(
        items, fulls, enc["input_ids"], enc["offset_mapping"], strict=True
    ):
        msgs, flags = d.messages or (), d.trainable or ()
        added = _added_text(tokenizer, msgs, markup, where)
        ids = list(ids)
        if train_on == "all":
            out.append((ids, list(ids), added))
            continue
        turns = [i for i, f in enumerate(flags) if f]
        if train_on == "last":
            turns = turns[-1:]
        spans = [_turn_span(tokenizer, msgs, i, full, where) for i in turns]
        labels = [
            t if any((s < b and e > a) or (s == e and a <= s < b) for a, b in spans)
            else IGNORE_INDEX
            for t, (s, e) in zip(ids, offs, strict=True)
        ]  # fmt: skip
        out.append((ids, labels, added))
    return out


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # the longest equal prefix, by bisection
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _turn_span(
    tokenizer: Any, msgs: Sequence[dict[str, Any]], i: int, full: str, where: str
) -> tuple[int, int]:
    """Characters [start, end) of turn i in the rendered conversation: from the end of the
    template's header for it (rendered with add_generation_prompt) to the end of the turn (the
    conversation rendered up to it: the template's end-of-turn text included)."""
    start = _common_prefix(render(tokenizer, msgs[:i], True, where), full) if i else 0
    end = len(full) if i == len(msgs) - 1 else _common_prefix(
        render(tokenizer, msgs[: i + 1], False, where), full
    )  # fmt: skip
    content = str(msgs[i]["content"]).strip()
    if content not in full[start:end]:
        raise DataError(
            f"{where}: message {i} ({msgs[i]['role']}) is not where the chat template renders "
            "the conversation up to it (the template renders earlier turns differently when "
            "later ones follow); train with --train-on last or all, or fix the template"
        )
    return start, end


def _markup(tokenizer: Any) -> re.Pattern[str]:
    """A pattern of the tokenizer's special and added tokens (the template's markup)."""
    toks = set(getattr(tokenizer, "all_special_tokens", []))
    toks |= {str(t) for t in getattr(tokenizer, "get_added_vocab", dict)()}
    toks = {t for t in toks if t}
    if not toks:
        return re.compile(r"(?!x)x")  # matches nothing
    return re.compile("|".join(re.escape(t) for t in sorted(toks, key=len, reverse=True)))


def _added_text(
    tokenizer: Any, msgs: Sequence[dict[str, Any]], markup: re.Pattern[str], where: str
) -> list[str]:
    """What the template adds to a conversation besides its special tokens and role names (a
    default system prompt, a date): the conversation rendered with each content replaced by a
    marker, less the markers, the special tokens and the role names, line by line."""
    probe = [dict(m, content=f"\x02{i}\x03") for i, m in enumerate(msgs)]
    out = []
    for gap in _MARKER.split(render(tokenizer, probe, False, where)):
        for line in markup.sub("\n", gap).split("\n"):
            line = line.strip()
            if line and line.rstrip(":").lower() not in _ROLES:
                out.append(line)
    return out


_MARKER = re.compile("\x02\\d+\x03")
