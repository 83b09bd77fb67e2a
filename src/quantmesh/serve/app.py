"""The HTTP side of `quantmesh serve`: OpenAI-compatible routes on FastAPI, server-sent events.

Routes: POST /v1/completions, POST /v1/chat/completions (both streamed with SSE when
`stream: true`), GET /v1/models (the base and every adapter), POST /v1/adapters {name, path} and
DELETE /v1/adapters/NAME (with vLLM's POST /v1/load_lora_adapter {lora_name, lora_path} and
POST /v1/unload_lora_adapter {lora_name} as aliases), GET /health. The request's `model` is the
base's name or an adapter's.

A completion request may carry several prompts (strings or token-id lists) and `n` choices per
prompt: every (prompt, choice) is its own row of the batch, answered as choice `i * n + j`
(prompt i, sample j; sample j of a seeded request uses seed + j). Logprobs, the prompt's own under
`echo` (and `max_tokens=0` to score the prompt alone), top-k alternatives, top_k, min_p and the
repetition / presence / frequency penalties are implemented (serve/scheduler.py); the request
bodies and what is refused are in serve/protocol.py.

Every request is checked before it reaches the scheduler; what does not fit gets a 4xx in
OpenAI's error shape, `{"error": {"message", "type", "param", "code"}}`: malformed JSON, bad
values, unknown models, prompts plus max_tokens beyond the context or the server's --max-tokens,
fields this server does not implement. Adapters are loaded at run time only when the server was
started with an adapter directory, and only from inside it (serve/guard.py, which also checks the
API key and the body size). An internal error answers a plain message; its details go to the
server's log. A streaming client that leaves frees its rows at the next step; a waiting
non-streaming one is checked every second.

Example:
    >>> app = build_app(scheduler, tokenizer, ServeInfo(base="SmolLM2", max_model_len=8192))  # doctest: +SKIP
    >>> uvicorn.run(app, port=8000)                                                          # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .guard import Guard, adapter_folder
from .protocol import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    _Common,
    chat_logprobs,
    completion_logprobs,
)
from .scheduler import AdapterSlotsFull, Sampling, Scheduler, UnknownModel

__all__ = ["ApiError", "ServeInfo", "build_app"]

log = logging.getLogger("quantmesh.serve")


@dataclass(frozen=True)
class ServeInfo:
    """What the routes need to know about the served model and the server's limits."""

    base: str
    """The base model's name in `model` fields and /v1/models."""
    max_model_len: int
    """Prompt plus generated tokens, at most."""
    created: int = 0
    """Unix time the server started (the models' `created`)."""
    grace_s: float = 10.0
    """How long a running stream may go on once shutdown begins."""
    vocab_size: int | None = None
    """Token ids of a prompt must be below it (None: not checked)."""
    max_tokens: int | None = None
    """The most tokens one choice may ask to generate (None: up to the context length)."""
    max_choices: int = 256
    """Prompts times `n` in one request, at most."""
    api_key: str | None = field(default=None, repr=False)
    """When set, every route needs `Authorization: Bearer <api_key>`."""
    adapter_dir: str | None = None
    """Adapters may be loaded (and unloaded) at run time only from inside this directory; None:
    not at all."""
    max_body: int = 8 << 20
    """Request bodies larger than this many bytes are refused (413)."""


class AdapterRequest(BaseModel):
    name: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$")
    path: str = Field(min_length=1)


class VllmLoadRequest(BaseModel):
    lora_name: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$")
    lora_path: str = Field(min_length=1)


class VllmUnloadRequest(BaseModel):
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


@dataclass
class _Choice:
    """What one (prompt, sample) row has produced so far."""

    text: list[str] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    prompt_logprobs: list[Any] | None = None
    done: dict[str, Any] | None = None


# ---- the app --------------------------------------------------------------------------------------
def build_app(sched: Scheduler, tokenizer: Any, info: ServeInfo) -> FastAPI:
    """The FastAPI app of `quantmesh serve` over a running Scheduler (rank 0).

    Example:
        >>> app = build_app(sched, tok, ServeInfo(base="tiny", max_model_len=256))  # doctest: +SKIP
    """
    app = FastAPI(title="quantmesh serve", docs_url=None, redoc_url=None, openapi_url=None)
    mails: dict[asyncio.AbstractEventLoop, _Mail] = {}  # (one loop, in practice)

    def threadsafe(
        loop: asyncio.AbstractEventLoop, fn: Callable[[Any], Any]
    ) -> Callable[[Any], None]:
        """`fn(x)` run on `loop`'s thread, callable from any thread (the scheduler's)."""
        mail = mails.get(loop) or mails.setdefault(loop, _Mail(loop))
        return functools.partial(mail.post, fn)

    app.add_middleware(Guard, api_key=info.api_key, max_body=info.max_body)

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
            text = str(first.get("msg", "invalid")).removeprefix("Value error, ")
            msg = f"{'.'.join(loc) or 'body'}: {text}"
        more = f" (and {len(errs) - 1} more problems)" if len(errs) > 1 else ""
        return ApiError(400, msg + more, param=".".join(loc) or None).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return ApiError(exc.status_code, str(exc.detail), type=kind).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.error("internal error on %s %s", request.method, request.url.path, exc_info=exc)
        return ApiError(500, "internal server error; the server's log has the details",
                        type="server_error").response()  # fmt: skip

    def model_card(name: str, parent: str | None) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": info.created, "owned_by": "quantmesh",
                "root": name, "parent": parent}  # fmt: skip

    @app.get("/health")
    async def health() -> JSONResponse:
        if sched.error is not None:
            return ApiError(503, "the decoding loop failed; the server's log says why",
                            type="server_error").response()  # fmt: skip
        return JSONResponse({"status": "ok", **sched.load()})

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        data = [model_card(info.base, None)]
        data += [model_card(n, info.base) for n in sched.adapter_names()]
        return {"object": "list", "data": data}

    # ---- adapters at run time ----------------------------------------------------------------
    def runtime_adapters() -> str:
        if info.adapter_dir is None:
            raise ApiError(403, "loading and unloading adapters at run time is off on this "
                           "server; restart it with --adapter-dir DIR to allow adapters from "
                           "inside DIR", type="permission_error")  # fmt: skip
        return info.adapter_dir

    async def load_adapter(name: str, path: str) -> JSONResponse:
        root = runtime_adapters()
        if name == info.base:
            raise ApiError(409, f"{name!r} is the base model's name; pick another", param="name")
        folder = adapter_folder(root, path)
        try:
            await asyncio.to_thread(sched.batch.bank.inspect, folder)  # before any collective
        except (OSError, ValueError) as e:
            msg = str(e).replace(str(folder), path)  # the client's own path, not the server's
            raise ApiError(400, msg, param="path", code="adapter_invalid") from None
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[str] = loop.create_future()
        try:
            sched.add_adapter(name, str(folder), threadsafe(loop, fut.set_result))
        except KeyError:
            raise ApiError(409, f"an adapter named {name!r} exists; DELETE "
                           f"/v1/adapters/{name} first or pick another name",
                           param="name") from None  # fmt: skip
        except AdapterSlotsFull as e:
            raise ApiError(409, str(e), code="adapter_slots_full") from None
        err = await fut
        if err:
            raise ApiError(400, f"loading the adapter failed: {err.replace(str(folder), path)}",
                           param="path")  # fmt: skip
        return JSONResponse(model_card(name, info.base), status_code=201)

    def unload_adapter(name: str) -> dict[str, Any]:
        runtime_adapters()
        if name == info.base:
            raise ApiError(400, f"{name!r} is the base model; it cannot be removed")
        try:
            sched.remove_adapter(name)
        except KeyError:
            raise ApiError(404, f"no adapter named {name!r}; GET /v1/models lists them",
                           type="not_found_error", code="model_not_found") from None  # fmt: skip
        return {"id": name, "object": "model", "deleted": True}

    @app.post("/v1/adapters")
    async def add_adapter(req: AdapterRequest) -> JSONResponse:
        return await load_adapter(req.name, req.path)

    @app.delete("/v1/adapters/{name:path}")
    async def remove_adapter(name: str) -> dict[str, Any]:
        return unload_adapter(name)

    @app.post("/v1/load_lora_adapter")  # vLLM's name for POST /v1/adapters
    async def vllm_load(req: VllmLoadRequest) -> JSONResponse:
        return await load_adapter(req.lora_name, req.lora_path)

    @app.post("/v1/unload_lora_adapter")  # vLLM's name for DELETE /v1/adapters/NAME
    async def vllm_unload(req: VllmUnloadRequest) -> dict[str, Any]:
        return unload_adapter(req.lora_name)

    # ---- completions ---------------------------------------------------------------------------
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
        cap = info.max_tokens
        if max_tokens is not None and cap is not None and max_tokens > cap:
            raise ApiError(400, f"max_tokens={max_tokens} is more than this server allows "
                           f"({cap}, --max-tokens); ask for fewer", param="max_tokens")  # fmt: skip
        room = info.max_model_len - prompt_len
        want = max_tokens if max_tokens is not None else min(default, room, cap or room)
        if room < 0 or want > room or (want == 0 and max_tokens is None):
            raise ApiError(
                400, f"this model's maximum context length is {info.max_model_len} tokens; "
                f"you requested {prompt_len + max(want, 1)} ({prompt_len} in the prompt, "
                f"{max(want, 1)} to generate); shorten the prompt or lower max_tokens",
                param="max_tokens" if max_tokens is not None and room >= 1 else "prompt",
                code="context_length_exceeded")  # fmt: skip
        top_k = req.top_k or 0
        return Sampling(
            max_tokens=want,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            seed=req.seed,
            stop=req.stops(),
            top_k=0 if top_k < 0 else top_k,  # vLLM's -1 (and 0): all tokens
            min_p=req.min_p or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
        )  # fmt: skip

    def choices_of(req: _Common, prompts: int) -> int:
        n = req.n or 1
        if n * prompts > info.max_choices:
            raise ApiError(400, f"{prompts} prompt(s) x n={n} = {n * prompts} choices; this "
                           f"server answers at most {info.max_choices} in one request "
                           "(--max-choices); split the request", param="n")  # fmt: skip
        return n

    def check_ids(ids: list[int]) -> list[int]:
        bad = [t for t in ids if t < 0 or (info.vocab_size is not None and t >= info.vocab_size)]
        if bad:
            raise ApiError(400, f"prompt token ids {bad[:5]} are outside the vocabulary "
                           f"(0..{(info.vocab_size or 0) - 1})", param="prompt")  # fmt: skip
        return ids

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Any:
        adapter = adapter_of(req.model)
        prompts = req.prompts()
        if not prompts:
            raise ApiError(400, "the prompt list is empty", param="prompt")
        n = choices_of(req, len(prompts))
        rows: list[tuple[list[int], str, Sampling]] = []
        for p in prompts:
            if isinstance(p, str):
                ids, text = tokenizer(p)["input_ids"], p
            else:
                ids = check_ids(p)
                text = str(tokenizer.decode(ids)) if req.echo else ""
            samp = sampling(req, len(ids), req.max_tokens, 16)
            samp.logprobs, samp.echo = req.logprobs, bool(req.echo and req.logprobs is not None)
            rows.append((ids, text if req.echo else "", samp))
        return await _answer(request, req, adapter, rows, n, chat=False)

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
        if req.logprobs:
            samp.logprobs = req.top_logprobs or 0
        n = choices_of(req, 1)
        return await _answer(request, req, adapter, [(ids, "", samp)], n, chat=True)

    def submit_all(
        adapter: str | None,
        rows: list[tuple[list[int], str, Sampling]],
        n: int,
        put: Callable[[tuple[int, dict[str, Any]]], None],
    ) -> list[int]:
        loop = asyncio.get_running_loop()
        rids: list[int] = []
        try:
            for i, (ids, _, samp) in enumerate(rows):
                for j in range(n):
                    s = samp
                    if j and samp.seed is not None:  # each sample of a seeded request its own
                        s = dataclasses.replace(samp, seed=samp.seed + j)
                    emit = threadsafe(loop, functools.partial(_tagged, put, i * n + j))
                    rids.append(sched.submit(adapter, ids, s, emit))
        except BaseException:
            for r in rids:
                sched.cancel(r)
            raise
        return rids

    async def _answer(
        request: Request,
        req: _Common,
        adapter: str | None,
        rows: list[tuple[list[int], str, Sampling]],
        n: int,
        *,
        chat: bool,
    ) -> Any:
        queue: asyncio.Queue[tuple[int, dict[str, Any]]] = asyncio.Queue()
        try:
            rids = submit_all(adapter, rows, n, queue.put_nowait)
        except UnknownModel:
            adapter_of(req.model)  # raises the 404
            raise
        except RuntimeError as e:
            raise ApiError(503, str(e), type="server_error") from None
        cid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        echoes = [text for _, text, _ in rows for _ in range(n)]
        want_lp = rows[0][2].logprobs is not None
        prompt_tokens = sum(len(ids) for ids, _, _ in rows)
        if req.stream:
            usage = bool((req.stream_options or {}).get("include_usage"))
            return EventSourceResponse(
                _stream(queue, rids, cid, created, req.model, chat, usage, echoes, want_lp,
                        prompt_tokens),
                ping=15, shutdown_grace_period=info.grace_s,
            )  # fmt: skip
        got = [_Choice() for _ in rids]
        try:
            while any(c.done is None for c in got):
                try:
                    idx, ev = await asyncio.wait_for(queue.get(), timeout=1.0)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return JSONResponse({}, status_code=499)
                    continue
                c = got[idx]
                if ev["type"] == "delta":
                    c.text.append(ev["text"])
                    c.logprobs += ev.get("logprobs", [])
                elif ev["type"] == "prompt_logprobs":
                    c.prompt_logprobs = ev["entries"]
                elif ev["type"] == "error":
                    raise ApiError(503, ev["message"], type="server_error")
                else:
                    c.done = ev
        finally:
            for r in rids:  # no-op once finished; frees the rows when the handler is cancelled
                sched.cancel(r)
        choices = []
        for idx, c in enumerate(got):
            assert c.done is not None  # the loop above waits for every choice
            body = echoes[idx] + "".join(c.text)
            choice: dict[str, Any] = {"index": idx, "logprobs": None,
                                      "finish_reason": c.done["finish_reason"]}  # fmt: skip
            if chat:
                choice["message"] = {"role": "assistant", "content": body}
                if want_lp:
                    choice["logprobs"] = chat_logprobs(tokenizer, c.logprobs)
            else:
                choice["text"] = body
                if want_lp:
                    entries = (c.prompt_logprobs or []) + c.logprobs
                    choice["logprobs"] = completion_logprobs(tokenizer, entries)
            choices.append(choice)
        completion = sum(int(c.done["completion_tokens"]) for c in got if c.done is not None)
        return {"id": cid, "object": "chat.completion" if chat else "text_completion",
                "created": created, "model": req.model, "choices": choices,
                "usage": _usage(prompt_tokens, completion)}  # fmt: skip

    async def _stream(
        queue: asyncio.Queue[tuple[int, dict[str, Any]]], rids: list[int], cid: str,
        created: int, model: str, chat: bool, usage: bool, echoes: list[str], want_lp: bool,
        prompt_tokens: int,
    ) -> AsyncIterator[str]:  # fmt: skip
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(idx: int, delta: str | None, finish: str | None, role: bool = False,
                  lps: list[Any] | None = None) -> str:  # fmt: skip
            choice: dict[str, Any] = {"index": idx, "logprobs": None, "finish_reason": finish}
            if chat:
                d: dict[str, Any] = {"role": "assistant"} if role else {}
                if delta is not None:
                    d["content"] = delta
                choice["delta"] = d
                if lps:
                    choice["logprobs"] = chat_logprobs(tokenizer, lps)
            else:
                choice["text"] = delta or ""
                if lps:
                    choice["logprobs"] = completion_logprobs(tokenizer, lps)
            return json.dumps({"id": cid, "object": obj, "created": created, "model": model,
                               "choices": [choice]})  # fmt: skip

        left, completion = len(rids), 0
        try:
            for idx in range(len(rids)):
                if chat:
                    yield chunk(idx, "", None, role=True)
                elif echoes[idx] and not want_lp:  # echoed with its logprobs when they come
                    yield chunk(idx, echoes[idx], None)
            while left:
                idx, ev = await queue.get()
                if ev["type"] == "delta":
                    yield chunk(idx, ev["text"], None, lps=ev.get("logprobs"))
                elif ev["type"] == "prompt_logprobs":
                    yield chunk(idx, echoes[idx], None, lps=ev["entries"])
                elif ev["type"] == "error":
                    yield json.dumps({"error": {"message": ev["message"], "type": "server_error",
                                                "param": None, "code": None}})  # fmt: skip
                    return
                else:
                    left -= 1
                    completion += int(ev["completion_tokens"])
                    yield chunk(idx, None, ev["finish_reason"])
            if usage:
                yield json.dumps({"id": cid, "object": obj, "created": created, "model": model,
                                  "choices": [], "usage": _usage(prompt_tokens, completion)})  # fmt: skip
            yield "[DONE]"
        finally:
            for r in rids:  # the client left (or we are done): its rows leave the batch
                sched.cancel(r)

    return app


def _tagged(put: Callable[[tuple[int, Any]], None], idx: int, ev: Any) -> None:
    put((idx, ev))


class _Mail:
    """Calls run on an event loop's thread, posted from other threads (the scheduler's): one
    wake-up of the loop for all the calls posted before it runs, in order, not one per call
    (a 64-row step posts 64 tokens)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.lock = threading.Lock()
        self.calls: list[tuple[Callable[[Any], Any], Any]] = []

    def post(self, fn: Callable[[Any], Any], x: Any) -> None:
        with self.lock:
            self.calls.append((fn, x))
            first = len(self.calls) == 1
        if first:  # later posts ride on this wake-up until it runs
            if self.loop.is_closed():  # the server stopped at once (a second Ctrl-C): the
                return  # requests' handlers are gone with their loop, nobody reads these
            try:
                self.loop.call_soon_threadsafe(self._run)
            except RuntimeError:  # closed between the check and the call
                if not self.loop.is_closed():
                    raise

    def _run(self) -> None:
        with self.lock:
            calls, self.calls = self.calls, []
        for fn, x in calls:
            fn(x)


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}  # fmt: skip
