"""The request bodies `quantmesh serve` accepts and the logprobs it answers with (OpenAI's shapes).

Every field of OpenAI's completions and chat APIs (and vLLM's extra sampling fields) is either
implemented or refused with a 400 that names it; a known field we do not implement is accepted only
at the value that means "off" (`tools: []`, `logit_bias: {}`, ...), and a field nobody defines is
refused as unknown. Nothing a client sends is silently ignored.

Logprobs are the model's own: `log_softmax` of the raw logits (before penalties, temperature and
filters), as OpenAI and vLLM report by default. A token's `bytes` are its own bytes (a byte-level
BPE token's, a byte-fallback token's, a SentencePiece piece's with its space), so the bytes of
consecutive tokens join into the text even where a character spans tokens; its string is those
bytes as text, or `bytes:\\xNN...` where they are not whole UTF-8 (as OpenAI writes such tokens).

Example:
    >>> CompletionRequest(model="m", prompt=[1, 2, 3]).prompts()
    [[1, 2, 3]]
    >>> unsupported({"tools": [{"type": "function"}]})
    "tools=[{'type': 'function'}] is not supported by this server; leave it out"
"""

from __future__ import annotations

import codecs
import re
import weakref
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "ApiError",
    "ChatMessage",
    "ChatRequest",
    "CompletionRequest",
    "chat_logprobs",
    "completion_logprobs",
    "token_bytes",
    "unsupported",
]

# (token, logprob (None: the first prompt token under echo), top alternatives, most likely first)
Logprob = tuple[int, float | None, list[tuple[int, float]]]


class ApiError(Exception):
    """An error returned to the client in OpenAI's shape.

    Example:
        >>> ApiError(400, "bad", param="n").response().status_code
        400
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type,
            param,
            code,
        )

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        body = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return JSONResponse({"error": body}, status_code=self.status, headers=headers)


# Fields of OpenAI's (and vLLM's) APIs this server does not implement, with the values that mean
# "off". Any other field that no request model declares is refused as unknown.
OFF: dict[str, tuple[Any, ...]] = {
    "logit_bias": (None, {}),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None,),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
    "service_tier": (None, "auto", "default"),
    "store": (None, False),
    "metadata": (None, {}),
}


def unsupported(extra: dict[str, Any]) -> str | None:
    """The refusal for the first field of `extra` (fields no request model declares), or None.

    Example:
        >>> unsupported({"logit_bias": {}}) is None
        True
    """
    for name, value in extra.items():
        if name not in OFF:
            return f"{name} is not a field this server knows; leave it out"
        if value not in OFF[name]:
            why = ""
            if name == "response_format":
                why = " (no constrained decoding: JSON mode and JSON schemas are not enforced)"
            return f"{name}={value!r} is not supported by this server{why}; leave it out"
    return None


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    n: int | None = Field(None, ge=1)
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None  # an end-user id for the caller's own records; changes nothing

    @model_validator(mode="after")
    def _supported(self) -> _Common:
        refused = unsupported(self.model_extra or {})
        if refused:
            raise ValueError(refused)
        extra_opts = set(self.stream_options or {}) - {"include_usage"}
        if extra_opts:
            raise ValueError(
                f"stream_options {sorted(extra_opts)} are not supported; only include_usage is"
            )
        if self.stream_options and not self.stream:
            raise ValueError("stream_options needs stream=true")
        if isinstance(self.stop, list):
            if len(self.stop) > 4:
                raise ValueError(f"stop has {len(self.stop)} strings; at most 4 are allowed")
            if not all(isinstance(s, str) and s for s in self.stop):
                raise ValueError("stop strings must be non-empty")
        elif self.stop == "":
            raise ValueError("stop must be a non-empty string")
        return self

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_Common):
    """POST /v1/completions: one prompt (text or token ids) or a list of them."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool | None = False

    @model_validator(mode="after")
    def _echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError(
                "max_tokens=0 generates nothing; it needs echo=true (the prompt's logprobs)"
            )
        return self

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request, text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]  # a list of token ids
        return list(p)  # type: ignore[arg-type]  # several prompts (or none)


class ChatMessage(BaseModel):
    """One message; fields other than role and content are refused unless empty."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _plain(self) -> ChatMessage:
        for name, value in (self.model_extra or {}).items():
            if value not in (None, [], "", {}):
                raise ValueError(
                    f"the message field {name} is not supported by this server (the chat "
                    "template sees role and content only); leave it out"
                )
        return self

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        from ..train.formats import non_text_part

        bad = non_text_part(self.content)
        if bad is not None:
            raise ApiError(
                400, f"message content part of type {bad[1]!r} is not supported; "
                "send text parts only", param="messages")  # fmt: skip
        return "".join(part["text"] for part in self.content)


class ChatRequest(_Common):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @model_validator(mode="after")
    def _chat(self) -> ChatRequest:
        if self.max_tokens == 0:
            raise ValueError("max_tokens=0: a chat reply needs at least one token")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return self


# ---- logprobs in OpenAI's shapes -------------------------------------------------------------
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_PIECE_KINDS: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character that stands for each byte in a piece."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]  # fmt: skip
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_OF = _byte_level_table()


def _piece_kind(tokenizer: Any) -> str:
    """How the tokenizer's pieces hold bytes: "byte-level" (GPT-2's alphabet), "metaspace"
    (SentencePiece's ▁ for a space) or "text" (decode the token alone)."""
    try:
        return _PIECE_KINDS[tokenizer]
    except (KeyError, TypeError):
        pass
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    name, text = type(decoder).__name__, repr(decoder)
    kind = "text"
    if name == "ByteLevel":
        kind = "byte-level"
    elif name == "Metaspace" or 'Replace(pattern=String("▁"), content=" ")' in text:
        kind = "metaspace"
    try:
        _PIECE_KINDS[tokenizer] = kind
    except TypeError:  # not weakly referable: found again next time
        pass
    return kind


def token_bytes(tokenizer: Any, tok: int) -> bytes:
    """The bytes token `tok` stands for: its piece read as bytes (byte-level BPE, `<0xNN>` byte
    fallback, SentencePiece's ▁ as a space), else the token decoded alone, as UTF-8.

    Example:
        >>> token_bytes(smollm2_tokenizer, 23274)  # the first of the two tokens of '日' # doctest: +SKIP
        b'\\xe6\\x97'
    """
    kind = _piece_kind(tokenizer)
    piece = tokenizer.convert_ids_to_tokens(tok) if kind != "text" else None
    if isinstance(piece, str):
        if m := _BYTE_FALLBACK.fullmatch(piece):
            return bytes([int(m.group(1), 16)])
        if kind == "byte-level" and all(c in _BYTE_OF for c in piece):
            return bytes(_BYTE_OF[c] for c in piece)
        if kind == "metaspace":
            return piece.replace("▁", " ").encode("utf-8")
    return str(tokenizer.decode([tok])).encode("utf-8")


def _token_entry(tokenizer: Any, tok: int) -> tuple[str, bytes]:
    """(string, bytes) of a token as logprobs show it: `bytes:\\xNN...` where the bytes are not
    whole UTF-8."""
    b = token_bytes(tokenizer, tok)
    try:
        return b.decode("utf-8"), b
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{c:02x}" for c in b), b


def completion_logprobs(tokenizer: Any, entries: list[Logprob]) -> dict[str, Any]:
    """The legacy completions `logprobs` object: tokens, token_logprobs, top_logprobs (each a
    {token: logprob} of the top alternatives and the chosen token), text_offset. The first prompt
    token under echo has a null logprob and null alternatives.

    Example:
        >>> completion_logprobs(tok, [(3, None, []), (5, -0.1, [])])["token_logprobs"]  # doctest: +SKIP
        [None, -0.1]
    """
    tokens: list[str] = []
    lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    at = 0
    chars = codecs.getincrementaldecoder("utf-8")("ignore")  # a split character counts once whole
    for tok, lp, alts in entries:
        text, raw = _token_entry(tokenizer, tok)
        tokens.append(text)
        offsets.append(at)
        at += len(chars.decode(raw))
        lps.append(lp)
        if lp is None:  # echo's first token: nothing predicts it
            tops.append(None)
            continue
        top = {_token_entry(tokenizer, t)[0]: alp for t, alp in alts}
        top.setdefault(text, lp)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tokenizer: Any, entries: list[Logprob]) -> dict[str, Any]:
    """The chat `logprobs` object: {"content": [{token, logprob, bytes, top_logprobs}, ...]}.

    Example:
        >>> chat_logprobs(tok, [(5, -0.1, [])])["content"][0]["logprob"]  # doctest: +SKIP
        -0.1
    """

    def one(tok: int, lp: float | None) -> dict[str, Any]:  # None never comes in a chat
        text, raw = _token_entry(tokenizer, tok)
        return {"token": text, "logprob": lp, "bytes": list(raw)}

    return {"content": [{**one(t, lp), "top_logprobs": [one(a, alp) for a, alp in alts]}
                        for t, lp, alts in entries]}  # fmt: skip
