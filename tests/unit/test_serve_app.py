"""serve's routes and scheduler in one process, over a stand-in batch (no model, no ranks).

The stand-in "model" always predicts the token after the last one (id + 1), so every reply is
known in advance: the routes' shapes, usage counts, stop strings, streaming, adapters at run time
and the error answers are checked exactly and fast. The real batch, ranks and client are covered
by tests/e2e/test_serve.py and tests/distributed/test_serve_bank.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")

from starlette.testclient import TestClient  # noqa: E402

from quantmesh.serve.app import ServeInfo, build_app  # noqa: E402
from quantmesh.serve.engine import Plan  # noqa: E402
from quantmesh.serve.ranks import Lockstep  # noqa: E402
from quantmesh.serve.scheduler import Scheduler  # noqa: E402
from tests.e2e.test_cli_common import make_tokenizer  # noqa: E402


class _Bank:
    slots = 3

    def inspect(self, path: str) -> None:
        if not Path(path).is_dir():
            raise FileNotFoundError(f"adapter folder {path!r} does not exist")


class _NextTokenBatch:
    """Plays Batch: each row's next token is its last token + 1; records the plans. With `chunk`,
    prompts come in chunks as to SlotBatch: a row mid-prefill holds a slot and returns nothing
    until its last chunk (an echo row then gets its whole prompt's logits)."""

    def __init__(self, vocab: int, chunk: int | None = None) -> None:
        self.vocab, self.bank, self.device = vocab, _Bank(), torch.device("cpu")
        self.chunk = chunk
        self.rows: list[int] = []
        self.filling: list[int] = []
        self.seen: dict[int, list[int]] = {}  # prompt tokens received per row mid-prefill
        self.plans: list[Plan] = []
        self.tokens = torch.zeros(0, dtype=torch.long)

    def token_buffer(self, n: int) -> torch.Tensor:
        if self.tokens.numel() < n:
            self.tokens = torch.zeros(n, dtype=torch.long)
        return self.tokens

    def _onehot(self, tok: int) -> torch.Tensor:
        out = torch.zeros(self.vocab)
        out[(tok + 1) % self.vocab] = 1.0
        return out

    def execute(self, plan: Plan):
        if plan.order or plan.admit or plan.drop:
            self.plans.append(plan)
            time.sleep(0.02)  # a step takes time: requests sent together overlap
        self.rows = [r for r in self.rows if r not in plan.drop]
        self.filling = [r for r in self.filling if r not in plan.drop]
        assert self.rows == plan.order and self.filling == plan.filling
        fed = self.tokens[plan.feed].tolist()
        step = torch.stack([self._onehot(t) for t in fed]) if plan.order else None
        pre = []
        for a in plan.admit:
            assert self.chunk is None or len(a.prompt) <= self.chunk
            got = self.seen.setdefault(a.rid, [])
            assert len(got) == a.start  # chunks in order, none lost
            got += a.prompt
            if not a.start and not a.last:
                self.filling.append(a.rid)
            if not a.last:
                continue
            assert not self.filling or self.filling[0] == a.rid  # first come, first decoding
            self.filling = self.filling[1:] if self.filling[:1] == [a.rid] else self.filling
            self.rows.append(a.rid)
            whole = self.seen.pop(a.rid)  # an echo row: every prompt position's logits
            pre.append(torch.stack([self._onehot(t) for t in whole]) if a.echo
                       else self._onehot(whole[-1]))  # fmt: skip
        return step, pre, ["" for _ in plan.loads]


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@contextlib.contextmanager
def _serving(tok, chunk: int | None = None, **info):
    batch = _NextTokenBatch(len(tok), chunk)
    sched = Scheduler(batch, Lockstep(None, torch.device("cpu")), tok,  # type: ignore[arg-type]
                      eos_ids=[tok.eos_token_id], max_batch=4, heartbeat_s=0.05)  # fmt: skip
    loop = threading.Thread(target=sched.run, daemon=True)
    loop.start()
    info = {"base": "tiny", "max_model_len": 24, "vocab_size": len(tok), **info}
    app = build_app(sched, tok, ServeInfo(**info))
    with TestClient(app) as client:
        yield client, sched, batch
    sched.stop()
    loop.join(10)
    assert not loop.is_alive() and sched.error is None


@pytest.fixture
def served(tok, tmp_path):
    with _serving(tok, adapter_dir=str(tmp_path)) as s:
        yield s


def _following(tok, prompt: str, n: int) -> str:
    last = tok(prompt)["input_ids"][-1]
    return tok.decode([(last + 1 + i) % len(tok) for i in range(n)], skip_special_tokens=True)


def test_completion_and_chat_replies(served, tok) -> None:
    client, _, _ = served
    r = client.post(
        "/v1/completions",
        json={"model": "tiny", "prompt": "To be, or", "max_tokens": 3, "temperature": 0},
    )
    body = r.json()
    assert r.status_code == 200 and body["object"] == "text_completion"
    assert body["choices"][0]["text"] == _following(tok, "To be, or", 3)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    r = client.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 2,
                                                  "messages": [{"role": "user", "content": "sea"}]})  # fmt: skip
    body = r.json()
    assert body["choices"][0]["message"]["role"] == "assistant"
    ids = tok.apply_chat_template([{"role": "user", "content": "sea"}], add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert body["usage"]["prompt_tokens"] == len(ids)


def test_streaming_and_stop_strings(served, tok) -> None:
    client, _, _ = served
    want = _following(tok, "the", 4)
    body = {"model": "tiny", "prompt": "the", "max_tokens": 4, "stream": True, "temperature": 0}
    with client.stream("POST", "/v1/completions", json=body) as r:
        events = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == want
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    stop = " " + want.split()[2]
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "the", "max_tokens": 4,
                                             "stop": stop, "temperature": 0})  # fmt: skip
    assert r.json()["choices"][0]["text"] == want[: want.index(stop)]
    assert r.json()["choices"][0]["finish_reason"] == "stop"


def test_requests_share_steps_and_leave(served, tok) -> None:
    client, _, batch = served
    results = []
    start = threading.Barrier(6)

    def ask(n: int) -> None:
        start.wait()
        results.append(client.post("/v1/completions", json={
            "model": "tiny", "prompt": "the", "max_tokens": n, "temperature": 0}).json())  # fmt: skip

    threads = [threading.Thread(target=ask, args=(n,)) for n in (2, 5, 8, 3, 6, 4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(r["usage"]["completion_tokens"] for r in results) == [2, 3, 4, 5, 6, 8]
    for r in results:
        assert r["choices"][0]["text"] == _following(tok, "the", r["usage"]["completion_tokens"])
    assert max(len(p.order) for p in batch.plans) > 1  # some steps decoded several rows
    assert max(len(p.order) + len(p.admit) for p in batch.plans) <= 4  # --max-batch


def test_long_prompts_are_prefilled_in_chunks_between_decode_steps(tok) -> None:
    with _serving(tok, chunk=3) as (client, _, batch):
        results: dict[str, dict] = {}
        start = threading.Barrier(4)
        prompts = {"short": "the", "long": "To be, or not to be, that is", "mid": "To be, or not",
                   "echo": "To be, or not to be"}  # fmt: skip

        def ask(name: str) -> None:
            extra = {"echo": True, "logprobs": 0} if name == "echo" else {}
            start.wait()
            results[name] = client.post("/v1/completions", json={
                "model": "tiny", "prompt": prompts[name], "max_tokens": 6, "temperature": 0,
                **extra}).json()  # fmt: skip

        threads = [threading.Thread(target=ask, args=(n,)) for n in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    for name, prompt in prompts.items():
        body = results[name]
        assert body["usage"]["prompt_tokens"] == len(tok(prompt)["input_ids"]), body
        text = body["choices"][0]["text"]
        want = _following(tok, prompt, 6)
        assert text == (prompt + want if name == "echo" else want), body
    echo = results["echo"]["choices"][0]["logprobs"]
    assert len(echo["tokens"]) == len(tok(prompts["echo"])["input_ids"]) + 6
    assert echo["token_logprobs"][0] is None
    assert all(len(a.prompt) <= 3 for p in batch.plans for a in p.admit)
    # a prompt cut in chunks: some step decoded rows while another row was mid-prefill
    assert any(p.order and p.filling for p in batch.plans)
    assert any(not a.last for p in batch.plans for a in p.admit)


def test_a_prompt_that_fits_a_chunk_is_never_split(tok) -> None:
    """A prompt no longer than a chunk that does not fit what is left of a step waits for the
    next step whole (the compiled prefill takes whole prompts only); the old rule cut it at the
    budget's edge and sent its whole group to the eager prefill."""
    prompts = ["To be, or", "that is the", "the question", "To be"]
    lens = [len(tok(p)["input_ids"]) for p in prompts]
    assert max(lens) <= 3 < sum(lens), lens  # each fits a chunk, not all in one step
    with _serving(tok, chunk=3) as (client, _, batch):
        results: dict[str, str] = {}
        start = threading.Barrier(len(prompts))

        def ask(prompt: str) -> None:
            start.wait()
            body = client.post("/v1/completions", json={
                "model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}).json()  # fmt: skip
            results[prompt] = body["choices"][0]["text"]

        threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert results == {p: _following(tok, p, 4) for p in prompts}, results
    admits = [a for p in batch.plans for a in p.admit]
    assert len(admits) == len(prompts) and all(a.start == 0 and a.last for a in admits), admits


def test_a_slow_step_is_said(served) -> None:
    """A step over `slow_s` is told to `on_slow` (the server's log), with what it ran."""
    client, sched, _ = served
    said: list[str] = []
    sched.on_slow, sched.slow_s = said.append, -1.0  # every step is "slow"
    body = client.post("/v1/completions", json={"model": "tiny", "prompt": "the", "max_tokens": 2,
                                                "temperature": 0})  # fmt: skip
    assert body.status_code == 200, body.text
    assert any(m.startswith("a step took") and "admitted 1 (" in m for m in said), said


def test_health_counts_the_steps_and_the_host_time_between_them(served) -> None:
    """`/health` gives the loop's time per step and the part of it its host was busy (not
    waiting for a step's tokens); bench_serve divides both by the decode steps of a phase."""
    client, _, _ = served
    before = client.get("/health").json()
    body = client.post("/v1/completions", json={"model": "tiny", "prompt": "the", "max_tokens": 4,
                                                "temperature": 0})  # fmt: skip
    assert body.status_code == 200, body.text
    after = client.get("/health").json()
    steps = after["decode_steps"] - before["decode_steps"]
    step_s, host_s = (after[k] - before[k] for k in ("step_s", "host_s"))
    # the first token comes from the prefill, the other three from decode steps (the last one
    # chosen, the row leaves: no step after it)
    assert steps == 3 and step_s >= host_s > 0, (steps, step_s, host_s)


def test_errors_in_openai_shape(served) -> None:
    client, _, _ = served
    cases = [
        (b'{"model": ', 400, "not valid JSON"),
        ({"model": "nope", "prompt": "the"}, 404, "does not exist"),
        ({"model": "tiny", "prompt": "the " * 30}, 400, "maximum context length"),
        ({"model": "tiny", "prompt": "the", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": "tiny", "prompt": "the", "n": 300}, 400, "--max-choices"),
        ({"model": "tiny", "prompt": "the", "bogus": 1}, 400, "bogus is not a field"),
        ({"model": "tiny", "prompt": "the", "logit_bias": {"5": 3}}, 400, "logit_bias="),
        (
            {"model": "tiny", "prompt": "the", "response_format": {"type": "json_object"}},
            400,
            "constrained decoding",
        ),
        ({"model": "tiny", "prompt": "the", "best_of": 2}, 400, "best_of=2"),
        ({"model": "tiny", "prompt": [3, 10**6]}, 400, "outside the vocabulary"),
        ({"model": "tiny", "prompt": []}, 400, "empty"),
        ({"model": "tiny", "prompt": "the", "max_tokens": 0, "echo": False}, 400, "echo=true"),
        (
            {"model": "tiny", "prompt": "the", "stream_options": {"include_usage": True}},
            400,
            "stream=true",
        ),
        ({"model": "tiny", "prompt": "the", "top_p": 1.5}, 400, "top_p"),
    ]
    for body, status, needle in cases:
        kw = {"content": body} if isinstance(body, bytes) else {"json": body}
        r = client.post("/v1/completions", headers={"Content-Type": "application/json"}, **kw)
        assert "error" in r.json(), (body, r.json())
        err = r.json()["error"]
        assert r.status_code == status and needle in err["message"], (body, r.json())
        assert set(err) == {"message", "type", "param", "code"}
    assert client.get("/nowhere").json()["error"]["type"] == "not_found_error"
    assert client.get("/health").json()["status"] == "ok"


def test_adapters_at_run_time(served, tmp_path: Path) -> None:
    client, sched, _ = served
    (tmp_path / "ad").mkdir()
    r = client.post("/v1/adapters", json={"name": "x", "path": "missing"})
    assert r.status_code == 400 and "no adapter folder" in r.json()["error"]["message"]
    for name in ("x", "y"):
        r = client.post("/v1/adapters", json={"name": name, "path": "ad"})
        assert r.status_code == 201, r.json()
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["tiny", "x", "y"]
    assert sched.names == {"x": 1, "y": 2}
    r = client.post("/v1/adapters", json={"name": "z", "path": "ad"})
    assert r.status_code == 409 and "--max-adapters" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json={"model": "y", "prompt": "the", "max_tokens": 1})
    assert r.status_code == 200
    assert client.delete("/v1/adapters/x").json()["deleted"] is True
    assert client.post("/v1/completions", json={"model": "x", "prompt": "the"}).status_code == 404
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "z", "lora_path": "ad"})
    assert r.status_code == 201 and sched.names["z"] == 1  # x's slot, free again (vLLM's route)
    r = client.post("/v1/unload_lora_adapter", json={"lora_name": "z"})
    assert r.status_code == 200 and "z" not in sched.names


class _BrokenBatch(_NextTokenBatch):
    def execute(self, plan: Plan):
        if plan.admit:
            raise RuntimeError("a rank went away")
        return super().execute(plan)


def test_a_failing_loop_answers_everyone_and_says_so(tok) -> None:
    sched = Scheduler(_BrokenBatch(len(tok)), Lockstep(None, torch.device("cpu")), tok,  # type: ignore[arg-type]
                      eos_ids=[tok.eos_token_id], max_batch=4, heartbeat_s=0.05)  # fmt: skip
    fatal = []
    sched.on_fatal = fatal.append
    loop = threading.Thread(target=sched.run, daemon=True)
    loop.start()
    with TestClient(build_app(sched, tok, ServeInfo(base="tiny", max_model_len=24))) as client:
        r = client.post(
            "/v1/completions", json={"model": "tiny", "prompt": "the", "temperature": 0}
        )
        msg = r.json()["error"]["message"]
        assert r.status_code == 503 and "the server failed" in msg
        assert "a rank went away" not in msg  # the raw error stays in the server's log
        loop.join(10)
        assert not loop.is_alive() and len(fatal) == 1
        assert client.get("/health").status_code == 503
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": "the"})
        assert r.status_code == 503  # refused at once, not queued forever


def _one_request(tok, prompt: str | list[int], sampling) -> tuple[list[tuple], dict]:
    """One request straight through a Scheduler over the stand-in batch: the log of its steps
    ("step", rows decoding, rows admitted, the request's (tokens chosen, tokens read back) at
    the launch) and events ("event", event) in the order they happened, and the done event."""
    from quantmesh.serve.scheduler import Sampling

    log: list[tuple] = []
    batch = _NextTokenBatch(len(tok))
    execute = batch.execute

    def logged(plan: Plan):
        if plan.order or plan.admit:
            counts = [(j.chosen, j.generated) for j in sched.jobs.values()]
            log.append(("step", list(plan.order), [a.rid for a in plan.admit], counts))
        return execute(plan)

    batch.execute = logged  # type: ignore[method-assign]
    sched = Scheduler(batch, Lockstep(None, torch.device("cpu")), tok,  # type: ignore[arg-type]
                      eos_ids=[tok.eos_token_id], max_batch=4, heartbeat_s=0.05)  # fmt: skip
    loop = threading.Thread(target=sched.run, daemon=True)
    loop.start()
    finished = threading.Event()

    def emit(ev: dict) -> None:
        log.append(("event", ev))
        if ev["type"] in ("done", "error"):
            finished.set()

    ids = tok(prompt)["input_ids"] if isinstance(prompt, str) else prompt
    sched.submit(None, ids, Sampling(**sampling), emit)
    assert finished.wait(10), log
    sched.stop()
    loop.join(10)
    assert not loop.is_alive() and sched.error is None
    return log, log[-1][1]


def test_a_steps_text_is_sent_while_the_next_step_runs(tok) -> None:
    """The loop launches step k+1 before it decodes and sends step k's tokens, so that the host's
    per-token work overlaps the device's step; the last token goes out with no step after it."""
    log, done = _one_request(tok, "the", {"max_tokens": 4, "logprobs": 0})
    assert done["finish_reason"] == "length" and done["completion_tokens"] == 4
    steps_before = []  # steps launched before each token's event
    for i, (kind, ev) in enumerate(x[:2] for x in log):
        if kind == "event" and ev["type"] == "delta":
            steps_before.append(sum(1 for k in log[:i] if k[0] == "step"))
    # the prefill gives token 0, decode steps 1-3 tokens 1-3; token j is sent once step j + 1
    # runs, the last one (max_tokens met) at once
    assert steps_before == [2, 3, 4, 4], log
    assert sum(1 for k in log if k[0] == "step") == 4, log


def test_a_step_is_launched_before_the_last_ones_tokens_are_read_back(tok) -> None:
    """The tokens a step chose stay on the device: the next step is fed them there and launched
    before they are read back, so that the device does not wait for the host between steps."""
    log, done = _one_request(tok, "the", {"max_tokens": 4})
    assert done["finish_reason"] == "length" and done["completion_tokens"] == 4
    at_launch = [x[3] for x in log if x[0] == "step" and x[1]]  # (chosen, read back)
    assert at_launch == [[(1, 0)], [(2, 1)], [(3, 2)]], log


def test_a_row_that_meets_eos_computes_one_unsent_token(tok) -> None:
    """EOS is seen when a step's tokens are read back, after the next step was launched: the row
    computes one more token there, which no client hears of, and leaves at the step after."""
    eos = tok.eos_token_id
    log, done = _one_request(tok, [(eos - 3) % len(tok)], {"max_tokens": 8})
    assert done["finish_reason"] == "stop" and done["completion_tokens"] == 3, log
    decoding = [x for x in log if x[0] == "step" and x[1]]
    assert len(decoding) == 3, log  # tokens 2 and 3 (EOS), then one unsent


def test_a_stop_string_found_late_costs_one_unsent_token(tok) -> None:
    """A stop string is found in the text, sent while the next step runs: the row computes one
    more token there, which no client hears of, and leaves at the step after."""
    want = _following(tok, "the", 6)
    stop = " " + want.split()[2]
    log, done = _one_request(tok, "the", {"max_tokens": 6, "stop": [stop]})
    text = "".join(ev["text"] for kind, ev in (x[:2] for x in log)
                   if kind == "event" and ev["type"] == "delta")  # fmt: skip
    assert text == want[: want.index(stop)] and done["finish_reason"] == "stop", log
    sent = done["completion_tokens"]
    assert 0 < sent < 6
    decoding = [x for x in log if x[0] == "step" and x[1]]  # steps with the row decoding
    assert len(decoding) == sent, log  # sent - 1 steps gave tokens 1..sent-1, one more unsent


def _lp_of_next(vocab: int) -> tuple[float, float]:
    """The stand-in's logprobs: its logits are one-hot (1.0 on the next token, 0 elsewhere)."""
    lp = torch.log_softmax(torch.eye(vocab)[0], dim=-1)
    return float(lp[0]), float(lp[1])


def test_batched_token_prompts_n_and_logprobs(served, tok) -> None:
    client, _, _ = served
    a, b = tok("To be, or")["input_ids"], tok("the")["input_ids"]
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": [a, b], "n": 2,
                                             "max_tokens": 3, "temperature": 0, "logprobs": 2})  # fmt: skip
    body = r.json()
    assert r.status_code == 200, body
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    want = [_following(tok, "To be, or", 3)] * 2 + [_following(tok, "the", 3)] * 2
    assert [c["text"] for c in body["choices"]] == want
    assert body["usage"] == {"prompt_tokens": len(a) + len(b), "completion_tokens": 12,
                             "total_tokens": len(a) + len(b) + 12}  # fmt: skip
    top, rest = _lp_of_next(len(tok))
    lp = body["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == pytest.approx([top] * 3, abs=1e-6)
    nxt = tok.decode([a[-1] + 1])
    assert lp["tokens"][0] == nxt and lp["top_logprobs"][0][nxt] == pytest.approx(top, abs=1e-6)
    assert len(lp["top_logprobs"][0]) == 2  # the 2 alternatives (the chosen one among them)
    assert lp["text_offset"][0] == 0
    # the same prompts one per request give the same rows
    alone = client.post("/v1/completions", json={"model": "tiny", "prompt": b, "max_tokens": 3,
                                                 "temperature": 0, "logprobs": 2}).json()  # fmt: skip
    assert alone["choices"][0]["logprobs"] == body["choices"][2]["logprobs"]
    # a list of strings: two prompts
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": ["To be, or", "the"],
                                             "max_tokens": 2, "temperature": 0})  # fmt: skip
    assert [c["text"] for c in r.json()["choices"]] == [
        _following(tok, "To be, or", 2), _following(tok, "the", 2)]  # fmt: skip


def test_echo_scores_the_prompt(served, tok) -> None:
    client, _, _ = served
    ids = tok("To be, or not")["input_ids"]
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": ids, "max_tokens": 0,
                                             "echo": True, "logprobs": 1, "temperature": 0})  # fmt: skip
    choice = r.json()["choices"][0]
    assert r.status_code == 200 and choice["text"] == tok.decode(ids)
    lp = choice["logprobs"]
    assert lp["tokens"] == [tok.decode([t]) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    top, rest = _lp_of_next(len(tok))
    # the stand-in predicts id + 1: a prompt token that is its predecessor + 1 gets `top`
    want = [top if t == p + 1 else rest for p, t in zip(ids, ids[1:], strict=False)]
    assert lp["token_logprobs"][1:] == pytest.approx(want, abs=1e-6)
    assert r.json()["usage"]["completion_tokens"] == 0
    # echo with one generated token (lm-eval's request): prompt entries, then the new token's
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": [ids], "max_tokens": 1,
                                             "echo": True, "logprobs": 1, "temperature": 0})  # fmt: skip
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) + 1 and lp["token_logprobs"][-1] == pytest.approx(
        top
    )
    # streamed: the echoed prompt first, with its logprobs
    with client.stream("POST", "/v1/completions", json={"model": "tiny", "prompt": "the", "max_tokens": 2,
                       "echo": True, "stream": True, "temperature": 0}) as s:  # fmt: skip
        events = [json.loads(ln[6:]) for ln in s.iter_lines() if ln.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events) == "the" + _following(tok, "the", 2)


def test_chat_logprobs_and_sampling_fields(served, tok) -> None:
    client, _, _ = served
    msgs = [{"role": "user", "content": "sea"}]
    r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": msgs, "max_tokens": 2,
                    "logprobs": True, "top_logprobs": 3, "n": 2, "top_k": 1,
                    "min_p": 0.1, "repetition_penalty": 1.0, "presence_penalty": 0.0,
                    "frequency_penalty": 0.0, "user": "u1", "temperature": 0})  # fmt: skip
    body = r.json()
    assert r.status_code == 200, body
    content = body["choices"][1]["logprobs"]["content"]
    top, _ = _lp_of_next(len(tok))
    assert [c["logprob"] for c in content] == pytest.approx([top, top], abs=1e-6)
    assert len(content[0]["top_logprobs"]) == 3 and content[0]["top_logprobs"][0][
        "logprob"
    ] == pytest.approx(top)
    assert content[0]["bytes"] == list(content[0]["token"].encode())
    # top_k=1 at temperature 1 is the greedy reply whatever the seed
    greedy = client.post("/v1/completions", json={"model": "tiny", "prompt": "the", "max_tokens": 4,
                                                  "temperature": 0}).json()["choices"][0]["text"]  # fmt: skip
    for seed in (1, 2, 3):
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": "the", "max_tokens": 4,
                        "temperature": 1.0, "top_k": 1, "seed": seed})  # fmt: skip
        assert r.json()["choices"][0]["text"] == greedy
    bad = [{"role": "user", "content": "sea"}, {"role": "user", "name": "x", "content": "hi"}]
    r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": bad})
    assert r.status_code == 400 and "name" in r.json()["error"]["message"]
    r = client.post(
        "/v1/chat/completions", json={"model": "tiny", "messages": msgs, "top_logprobs": 2}
    )
    assert r.status_code == 400 and "logprobs=true" in r.json()["error"]["message"]


def test_api_key_body_limit_and_max_tokens(tok) -> None:
    with _serving(tok, api_key="s3cret", max_body=2000, max_tokens=5) as (client, _, _):
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "s3cret"}):
            for method, path in (("GET", "/health"), ("GET", "/v1/models"),
                                 ("POST", "/v1/completions"), ("POST", "/v1/adapters")):  # fmt: skip
                r = client.request(method, path, headers=headers, json={})
                assert r.status_code == 401, (headers, path)
                assert r.json()["error"]["code"] == "invalid_api_key"
        ok = {"Authorization": "Bearer s3cret"}
        assert client.get("/health", headers=ok).status_code == 200
        r = client.post("/v1/completions", headers=ok,
                        json={"model": "tiny", "prompt": "the", "max_tokens": 6})  # fmt: skip
        assert r.status_code == 400 and "--max-tokens" in r.json()["error"]["message"]
        r = client.post("/v1/completions", headers=ok,
                        json={"model": "tiny", "prompt": "the " * 600, "max_tokens": 1})  # fmt: skip
        assert r.status_code == 413 and "--max-request-bytes" in r.json()["error"]["message"]

        def chunks():  # no Content-Length: the limit holds for a chunked body too
            yield b'{"model": "tiny", "prompt": "'
            for _ in range(300):
                yield b"the the "
            yield b'"}'

        r = client.post("/v1/completions", headers={**ok, "Content-Type": "application/json"},
                        content=chunks())  # fmt: skip
        assert r.status_code == 413
        # runtime adapter loading is off without an adapter directory
        r = client.post("/v1/adapters", headers=ok, json={"name": "x", "path": "a"})
        assert r.status_code == 403 and "--adapter-dir" in r.json()["error"]["message"]
        r = client.post(
            "/v1/load_lora_adapter", headers=ok, json={"lora_name": "x", "lora_path": "a"}
        )
        assert r.status_code == 403


def test_adapter_paths_stay_inside_the_directory(served, tmp_path: Path) -> None:
    client, _, _ = served
    outside = tmp_path.parent / (tmp_path.name + "-outside")
    outside.mkdir()
    (outside / "adapter_config.json").write_text("{}")
    (tmp_path / "inside").mkdir()
    os.symlink(outside, tmp_path / "link")
    os.symlink(outside / "adapter_config.json", tmp_path / "inside" / "adapter_config.json")
    for path, needle in ((str(outside), "absolute"), ("../" + outside.name, "'..'"),
                         ("link", "outside"), ("inside", "outside"),
                         ("inside/../../x", "'..'")):  # fmt: skip
        r = client.post("/v1/adapters", json={"name": "x", "path": path})
        assert r.status_code == 400 and needle in r.json()["error"]["message"], (path, r.json())


def test_tokens_posted_to_the_event_loop_share_one_wake_up() -> None:
    """The scheduler's thread posts each token's event to the HTTP loop (`_Mail`): the calls
    posted before the loop runs them ride on one wake-up, and run in the order posted."""
    import asyncio

    from quantmesh.serve.app import _Mail

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        hold, wakes, got = threading.Event(), [0], []
        loop.call_soon_threadsafe(hold.wait, 10)  # the loop busy (a step's text being sent)
        mail = _Mail(loop)
        schedule = loop.call_soon_threadsafe

        def counted(*args):
            wakes[0] += 1
            return schedule(*args)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        for i in range(64):
            mail.post(got.append, i)
        hold.set()
        done = threading.Event()
        mail.post(lambda _: done.set(), None)
        assert done.wait(10)
        assert got == list(range(64)) and wakes[0] <= 2, (got, wakes)
    finally:
        loop.call_soon_threadsafe = schedule  # type: ignore[method-assign]
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_message_content_parts_are_read_as_training_data_reads_them() -> None:
    """A chat message's content parts: the text parts joined, any other part refused naming its
    type; the same rule (`train.formats.non_text_part`) as a training record's."""
    from quantmesh.serve.protocol import ApiError, ChatMessage

    parts = [{"type": "text", "text": "how "}, {"type": "text", "text": "are you"}]
    assert ChatMessage(role="user", content=parts).text() == "how are you"
    image = ChatMessage(role="user", content=[*parts, {"type": "image_url", "image_url": {}}])
    with pytest.raises(ApiError, match="content part of type 'image_url' is not supported"):
        image.text()
