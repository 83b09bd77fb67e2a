"""serve's routes and scheduler in one process, over a stand-in batch (no model, no ranks).

The stand-in "model" always predicts the token after the last one (id + 1), so every reply is
known in advance: the routes' shapes, usage counts, stop strings, streaming, adapters at run time
and the error answers are checked exactly and fast. The real batch, ranks and client are covered
by tests/e2e/test_serve.py and tests/distributed/test_serve_bank.py.
"""

from __future__ import annotations

import json
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
    """Plays Batch: each row's next token is its last token + 1; records the plans."""

    def __init__(self, vocab: int) -> None:
        self.vocab, self.bank, self.device = vocab, _Bank(), torch.device("cpu")
        self.rows: list[int] = []
        self.plans: list[Plan] = []

    def _onehot(self, tok: int) -> torch.Tensor:
        out = torch.zeros(self.vocab)
        out[(tok + 1) % self.vocab] = 1.0
        return out

    def execute(self, plan: Plan):
        if plan.order or plan.admit or plan.drop:
            self.plans.append(plan)
            time.sleep(0.02)  # a step takes time: requests sent together overlap
        self.rows = [r for r in self.rows if r not in plan.drop]
        assert self.rows == plan.order
        step = torch.stack([self._onehot(t) for t in plan.feed]) if plan.order else None
        pre = [self._onehot(a.prompt[-1]) for a in plan.admit]
        self.rows += [a.rid for a in plan.admit]
        return step, pre, ["" for _ in plan.loads]


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture
def served(tok):
    batch = _NextTokenBatch(len(tok))
    sched = Scheduler(batch, Lockstep(None, torch.device("cpu")), tok,  # type: ignore[arg-type]
                      eos_ids=[tok.eos_token_id], max_batch=4, heartbeat_s=0.05)  # fmt: skip
    loop = threading.Thread(target=sched.run, daemon=True)
    loop.start()
    app = build_app(sched, tok, ServeInfo(base="tiny", max_model_len=24))
    with TestClient(app) as client:
        yield client, sched, batch
    sched.stop()
    loop.join(10)
    assert not loop.is_alive() and sched.error is None


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


def test_errors_in_openai_shape(served) -> None:
    client, _, _ = served
    cases = [
        (b'{"model": ', 400, "not valid JSON"),
        ({"model": "nope", "prompt": "the"}, 404, "does not exist"),
        ({"model": "tiny", "prompt": "the " * 30}, 400, "maximum context length"),
        ({"model": "tiny", "prompt": "the", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": "tiny", "prompt": "the", "n": 3}, 400, "n=3"),
        ({"model": "tiny", "prompt": "the", "top_p": 1.5}, 400, "top_p"),
    ]
    for body, status, needle in cases:
        kw = {"content": body} if isinstance(body, bytes) else {"json": body}
        r = client.post("/v1/completions", headers={"Content-Type": "application/json"}, **kw)
        err = r.json()["error"]
        assert r.status_code == status and needle in err["message"], (body, r.json())
        assert set(err) == {"message", "type", "param", "code"}
    assert client.get("/nowhere").json()["error"]["type"] == "not_found_error"
    assert client.get("/health").json()["status"] == "ok"


def test_adapters_at_run_time(served, tmp_path: Path) -> None:
    client, sched, _ = served
    r = client.post("/v1/adapters", json={"name": "x", "path": str(tmp_path / "missing")})
    assert r.status_code == 400 and "does not exist" in r.json()["error"]["message"]
    for name in ("x", "y"):
        r = client.post("/v1/adapters", json={"name": name, "path": str(tmp_path)})
        assert r.status_code == 201, r.json()
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["tiny", "x", "y"]
    assert sched.names == {"x": 1, "y": 2}
    r = client.post("/v1/adapters", json={"name": "z", "path": str(tmp_path)})
    assert r.status_code == 409 and "--max-adapters" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json={"model": "y", "prompt": "the", "max_tokens": 1})
    assert r.status_code == 200
    assert client.delete("/v1/adapters/x").json()["deleted"] is True
    assert client.post("/v1/completions", json={"model": "x", "prompt": "the"}).status_code == 404
    r = client.post("/v1/adapters", json={"name": "z", "path": str(tmp_path)})
    assert r.status_code == 201 and sched.names["z"] == 1  # x's slot, free again


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
        assert r.status_code == 503 and "a rank went away" in r.json()["error"]["message"]
        loop.join(10)
        assert not loop.is_alive() and len(fatal) == 1
        assert client.get("/health").status_code == 503
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": "the"})
        assert r.status_code == 503  # refused at once, not queued forever
