"""TextStream: generated token ids -> the text a client may be sent so far, with stop strings.

Text is decoded incrementally: each new token's text is what decoding the last few tokens gives
beyond what decoding them without it gave (a token may be part of a character, or change how its
neighbour decodes: both decodes start at the same token, so a leading space is treated alike), so
a step costs the same however long the reply already is. A token that ends in half a character
(a replacement character) waits for the next. Only the part that can no longer change is
released: never a tail that could still grow into a stop string. When a stop string appears, the
text ends just before it (the stop string is not part of the reply, as in OpenAI's API).

Example:
    >>> s = TextStream(tok, stop=["\\n\\n"])   # doctest: +SKIP
    >>> s.add(tok_id)                          # doctest: +SKIP
    ('Hello', False)
"""

from __future__ import annotations

from typing import Any

__all__ = ["TextStream"]


class TextStream:
    """The text of one reply, released as it becomes final."""

    def __init__(self, tokenizer: Any, stop: list[str] | None = None) -> None:
        self.tokenizer = tokenizer
        self._backend = _plain_backend(tokenizer)
        self.stop = [s for s in (stop or []) if s]
        self.ids: list[int] = []
        self.sent = 0  # characters released
        self.text = ""  # the reply's text so far
        self.prefix = 0  # ids[prefix:read] were decoded into the end of `text`
        self.read = 0

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:  # what `decode` returns, without its wrapper's cost
            return str(self._backend.decode(ids, skip_special_tokens=True))
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def _advance(self, final: bool = False) -> None:
        new = self._decode(self.ids[self.prefix :])
        old = self._decode(self.ids[self.prefix : self.read])
        if len(new) > len(old) and (final or not new.endswith("\ufffd")):
            self.text += new[len(old) :]
            self.prefix, self.read = self.read, len(self.ids)

    def add(self, token: int) -> tuple[str, bool]:
        """Add one generated token; returns (newly released text, whether a stop string ended it)."""
        self.ids.append(token)
        self._advance()
        if self.stop:
            window = max(len(s) for s in self.stop)
            start = max(0, self.sent - window + 1)
            hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                cut = max(min(hits), self.sent)
                out = self.text[self.sent : cut]
                self.sent = cut
                self.text = self.text[:cut]
                return out, True
        safe = len(self.text)
        for s in self.stop:  # a tail that may still become a stop string is held back
            for k in range(min(len(s) - 1, safe - self.sent), 0, -1):
                if self.text[safe - k : safe] == s[:k]:
                    safe -= k
                    break
        out = self.text[self.sent : safe] if safe > self.sent else ""
        self.sent = max(self.sent, safe)
        return out, False

    def flush(self) -> str:
        """The rest of the text, at the end of the reply (length or EOS)."""
        self._advance(final=True)
        out = self.text[self.sent :]
        self.sent = len(self.text)
        return out


def _plain_backend(tokenizer: Any) -> Any:
    """The `tokenizers` object a transformers fast tokenizer decodes with, where its `decode`
    returns exactly that object's text (its own decode methods, no clean-up of spaces); else None.
    Two decodes a token per reply went through transformers' wrapper: about 90% of their time
    (a 64-row step: about 1 ms of the serving loop's host time, measured on CPU)."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: its decode, as it is
        return None
    cls = type(tokenizer)
    plain = (
        isinstance(tokenizer, TokenizersBackend)
        and cls._decode is TokenizersBackend._decode
        and cls.decode is PreTrainedTokenizerBase.decode
        and not getattr(tokenizer, "clean_up_tokenization_spaces", False)
    )
    return getattr(tokenizer, "backend_tokenizer", None) if plain else None
