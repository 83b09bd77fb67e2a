"""The HTTP side of `quantmesh serve`: OpenAI-compatible routes on FastAPI, server-sent events.

Routes: POST /v1/completions, POST /v1/chat/completions (both streamed with SSE when
`stream: true`), GET /v1/models (the base and every adapter), POST /v1/adapters {name, path},
DELETE /v1/adapters/NAME, GET /health. The request's `model` is the base's name or an adapter's.

Every request is checked before it reaches the scheduler; what does not fit gets a 4xx in
OpenAI's error shape, `{"error": {"message", "type", "param", "code"}}`: malformed JSON, unknown
fields' bad values, unknown models, prompts plus max_tokens beyond the context, parameters this
server does not implement (n > 1, logprobs, penalties, tools...). A streaming client that leaves
frees its row at the next step; a waiting non-streaming one is checked every second.

Example:
    >>> app = build_app(scheduler, tokenizer, ServeInfo(base="SmolLM2", max_model_len=8192))  # doctest: +SKIP
    >>> uvicorn.run(app, port=8000)                                                          # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .scheduler import AdapterSlotsFull, Sampling, Scheduler, UnknownModel

__all__ = ["ApiError", "ServeInfo", "build_app"]


@dataclass(frozen=True)
class ServeInfo:
    """What the routes need to know about the served model."""

    base: str
    """The base model's name in `model` fields and /v1/models."""
    max_model_len: int
    """Prompt plus generated tokens, at most."""
    created: int = 0
    """Unix time the server started (the models' `created`)."""
    grace_s: float = 10.0
    """How long a running stream may go on once shutdown begins."""


class ApiError(Exception):
    """An error returned to the client in OpenAI's shape."""

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

    def response(self) -> JSONResponse:
        body = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return JSONResponse({"error": body}, status_code=self.status)


# ---- request bodies ----------------------------------------------------------------------------
# Parameters of OpenAI's API this server does not implement, with the value that means "off".
UNSUPPORTED: dict[str, Any] = {
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "n": (None, 1),
}


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None

    @model_validator(mode="after")
    def _supported(self) -> _Common:
        extra = self.model_extra or {}
        for name, off in UNSUPPORTED.items():
            if name in extra and extra[name] not in off:
                raise ValueError(
                    f"{name}={extra[name]!r} is not supported by this server; leave it out"
                )
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
    prompt: str | list[str]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(
                    400, f"message content part of type {part.get('type')!r} is not supported; "
                    "send text parts only", param="messages")  # fmt: skip
            parts.append(part["text"])
        return "".join(parts)


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


class AdapterRequest(BaseModel):
    name: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$")
    path: str = Field(min_length=1)


# ---- the app --------------------------------------------------------------------------------------
def build_app(sched: Scheduler, tokenizer: Any, info: ServeInfo) -> FastAPI:
    """The FastAPI app of `quantmesh serve` over a running Scheduler (rank 0).

    Example:
        >>> app = build_app(sched, tok, ServeInfo(base="tiny", max_model_len=256))  # doctest: +SKIP
    """
    app = FastAPI(title="quantmesh serve", docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            msg = (
                f"the body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}"
            )
            loc = []
        else:
            msg = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid')}"
        more = f" (and {len(errs) - 1} more problems)" if len(errs) > 1 else ""
        return ApiError(400, msg + more, param=".".join(loc) or None).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return ApiError(exc.status_code, str(exc.detail), type=kind).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        return ApiError(500, f"{type(exc).__name__}: {exc}", type="server_error").response()

    def model_card(name: str, parent: str | None) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": info.created, "owned_by": "quantmesh",
                "root": name, "parent": parent}  # fmt: skip

    @app.get("/health")
    async def health() -> JSONResponse:
        if sched.error is not None:
            return ApiError(
                503, f"the decoding loop failed: {sched.error}", type="server_error"
            ).response()
        return JSONResponse({"status": "ok", **sched.load()})

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        data = [model_card(info.base, None)]
        data += [model_card(n, info.base) for n in sched.adapter_names()]
        return {"object": "list", "data": data}

    @app.post("/v1/adapters")
    async def add_adapter(req: AdapterRequest) -> JSONResponse:
        if req.name == info.base:
            raise ApiError(
                409, f"{req.name!r} is the base model's name; pick another", param="name"
            )
        try:
            await asyncio.to_thread(sched.batch.bank.inspect, req.path)  # before any collective
        except (OSError, ValueError) as e:
            raise ApiError(400, str(e), param="path", code="adapter_invalid") from None
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[str] = loop.create_future()
        try:
            sched.add_adapter(req.name, req.path, _threadsafe(loop, fut.set_result))
        except KeyError:
            raise ApiError(409, f"an adapter named {req.name!r} exists; DELETE "
                           f"/v1/adapters/{req.name} first or pick another name",
                           param="name") from None  # fmt: skip
        except AdapterSlotsFull as e:
            raise ApiError(409, str(e), code="adapter_slots_full") from None
        err = await fut
        if err:
            raise ApiError(400, f"loading the adapter failed: {err}", param="path")
        return JSONResponse(model_card(req.name, info.base), status_code=201)

    @app.delete("/v1/adapters/{name:path}")
    async def remove_adapter(name: str) -> dict[str, Any]:
        if name == info.base:
            raise ApiError(400, f"{name!r} is the base model; it cannot be removed")
        try:
            sched.remove_adapter(name)
        except KeyError:
            raise ApiError(404, f"no adapter named {name!r}; GET /v1/models lists them",
                           type="not_found_error", code="model_not_found") from None  # fmt: skip
        return {"id": name, "object": "model", "deleted": True}

    def adapter_of(model: str) -> str | None:
        if model == info.base:
            return None
        if model in sched.adapter_names():
            return model
        raise ApiError(404, f"the model {model!r} does not exist; GET /v1/models lists the base "
                       f"({info.base!r}) and the adapters", type="not_found_error",
                       param="model", code="model_not_found")  # fmt: skip

    def sampling(req: _Common, prompt_len: int, max_tokens: int | None, default: int) -> Sampling:
        if prompt_len == 0:
            raise ApiError(400, "the prompt is empty", param="prompt")
        room = info.max_model_len - prompt_len
        want = max_tokens if max_tokens is not None else min(default, room)
        if want > room or room < 1:
            raise ApiError(
                400, f"this model's maximum context length is {info.max_model_len} tokens; "
                f"you requested {prompt_len + max(want, 1)} ({prompt_len} in the prompt, "
                f"{max(want, 1)} to generate); shorten the prompt or lower max_tokens",
                param="max_tokens" if max_tokens is not None and room >= 1 else "prompt",
                code="context_length_exceeded")  # fmt: skip
        return Sampling(max_tokens=want, temperature=req.temperature, top_p=req.top_p,
                        seed=req.seed, stop=req.stops())  # fmt: skip

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Any:
        adapter = adapter_of(req.model)
        prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
        if len(prompts) != 1:
            raise ApiError(400, f"{len(prompts)} prompts in one request; send one per request",
                           param="prompt")  # fmt: skip
        ids = tokenizer(prompts[0])["input_ids"]
        samp = sampling(req, len(ids), req.max_tokens, 16)
        return await _answer(request, req, adapter, ids, samp, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request) -> Any:
        adapter = adapter_of(req.model)
        if not getattr(tokenizer, "chat_template", None):
            raise ApiError(400, "this model's tokenizer has no chat template; use /v1/completions",
                           param="messages")  # fmt: skip
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            text = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        except Exception as e:  # the template's own checks (e.g. roles out of order)
            raise ApiError(400, f"the chat template refused the messages: {e}",
                           param="messages") from None  # fmt: skip
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        limit = (
            req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        )
        samp = sampling(req, len(ids), limit, info.max_model_len)
        return await _answer(request, req, adapter, ids, samp, chat=True)

    async def _answer(
        request: Request,
        req: _Common,
        adapter: str | None,
        ids: list[int],
        samp: Sampling,
        *,
        chat: bool,
    ) -> Any:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        try:
            rid = sched.submit(adapter, ids, samp, _threadsafe(loop, queue.put_nowait))
        except UnknownModel:
            adapter_of(req.model)  # raises the 404
            raise
        except RuntimeError as e:
            raise ApiError(503, str(e), type="server_error") from None
        cid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        if req.stream:
            usage = bool((req.stream_options or {}).get("include_usage"))
            return EventSourceResponse(
                _stream(queue, rid, cid, created, req.model, chat, usage),
                ping=15, shutdown_grace_period=info.grace_s,
            )  # fmt: skip
        text, done = [], None
        try:
            while done is None:
                try:
                    ev = await asyncio.wait_for(queue.get(), timeout=1.0)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        sched.cancel(rid)
                        return JSONResponse({}, status_code=499)
                    continue
                if ev["type"] == "delta":
                    text.append(ev["text"])
                elif ev["type"] == "error":
                    raise ApiError(503, ev["message"], type="server_error")
                else:
                    done = ev
        finally:
            sched.cancel(rid)  # no-op once finished; frees the row when the handler is cancelled
        body = "".join(text)
        choice: dict[str, Any] = {
            "index": 0,
            "logprobs": None,
            "finish_reason": done["finish_reason"],
        }
        if chat:
            choice["message"] = {"role": "assistant", "content": body}
        else:
            choice["text"] = body
        return {"id": cid, "object": "chat.completion" if chat else "text_completion",
                "created": created, "model": req.model, "choices": [choice],
                "usage": _usage(done)}  # fmt: skip

    async def _stream(
        queue: asyncio.Queue[dict[str, Any]], rid: int, cid: str, created: int, model: str,
        chat: bool, usage: bool,
    ) -> AsyncIterator[str]:  # fmt: skip
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: str | None, finish: str | None, role: bool = False) -> str:
            choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
            if chat:
                d: dict[str, Any] = {"role": "assistant"} if role else {}
                if delta is not None:
                    d["content"] = delta
                choice["delta"] = d
            else:
                choice["text"] = delta or ""
            return json.dumps({"id": cid, "object": obj, "created": created, "model": model,
                               "choices": [choice]})  # fmt: skip

        try:
            if chat:
                yield chunk("", None, role=True)
            while True:
                ev = await queue.get()
                if ev["type"] == "delta":
                    yield chunk(ev["text"], None)
                elif ev["type"] == "error":
                    yield json.dumps({"error": {"message": ev["message"], "type": "server_error",
                                                "param": None, "code": None}})  # fmt: skip
                    return
                else:
                    yield chunk(None, ev["finish_reason"])
                    if usage:
                        yield json.dumps({"id": cid, "object": obj, "created": created,
                                          "model": model, "choices": [], "usage": _usage(ev)})  # fmt: skip
                    yield "[DONE]"
                    return
        finally:
            sched.cancel(rid)  # the client left (or we are done): its row leaves the batch

    return app


def _threadsafe(loop: asyncio.AbstractEventLoop, fn: Callable[[Any], Any]) -> Callable[[Any], None]:
    """`fn(x)` run on `loop`'s thread, callable from any thread (the scheduler's)."""

    def call(x: Any) -> None:
        loop.call_soon_threadsafe(fn, x)

    return call


def _usage(done: dict[str, Any]) -> dict[str, int]:
    p, c = int(done["prompt_tokens"]), int(done["completion_tokens"])
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
