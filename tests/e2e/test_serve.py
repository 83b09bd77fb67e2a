"""`quantmesh serve` at tp=2 on CPU ranks, driven by the real `openai` client.

One server (two ranks) is shared by the module; the last test stops it with SIGTERM. The model is
the tiny random Llama of test_cli_common, the adapters real PEFT folders with random A and B:
"a" (r=4, q/v) and "b" (r=8, every projection) are served from the start, "c" (r=2, o/down) and
a copy of "b" are added at run time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from .test_cli_common import CLI, REPO, cli, make_adapter, make_tiny_llama

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

pytestmark = pytest.mark.slow

PROMPTS = [
    "whether 'tis nobler",
    "To be, or not to be",
    "the slings and arrows",
    "Now is the winter of our discontent",
    "All the world's a stage",
    "a sea of troubles",
    "made glorious summer by this sun",
    "and all the men and women",
]


class Server:
    """A `quantmesh serve` subprocess and its URL."""

    def __init__(self, args: list[str], timeout: float = 150) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
            env.pop(k, None)
        self.proc = subprocess.Popen(
            [*CLI, "serve", *args, "--port", "0"], cwd=REPO, env=env, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
        )  # fmt: skip
        line = self._first_line(timeout)
        self.url = line.split(" on ", 1)[1].split()[0]
        deadline = time.time() + 60
        while True:
            try:
                if self.get("/health")["status"] == "ok":
                    break
            except OSError:
                if time.time() > deadline:
                    raise
                time.sleep(0.2)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0,
                                    timeout=120)  # fmt: skip

    def _first_line(self, timeout: float) -> str:
        box: list[str] = []
        t = threading.Thread(target=lambda: box.append(self.proc.stdout.readline()), daemon=True)
        t.start()
        t.join(timeout)
        if not box or not box[0].startswith("quantmesh serve:"):
            self.proc.kill()
            raise RuntimeError(f"server did not start: {box} {self.proc.stderr.read()[-3000:]}")
        return box[0]

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            return json.loads(r.read())

    def post(self, path: str, body: bytes | dict, method: str = "POST") -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def stop(self) -> None:
        """SIGTERM (the ranks stop with the launcher), then SIGKILL to the whole session."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # anything of this server still alive
        except ProcessLookupError:
            pass
        self.proc.wait(30)


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("serve")
    model = make_tiny_llama(root / "tiny")
    qv, every = ["q_proj", "v_proj"], ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                       "up_proj", "down_proj"]  # fmt: skip
    return {
        "model": model,
        "a": make_adapter(model, root / "a", r=4, targets=qv, seed=1),
        "b": make_adapter(model, root / "b", r=8, targets=every, seed=2),
        "c": make_adapter(model, root / "c", r=2, targets=["o_proj", "down_proj"], seed=3),
    }


@pytest.fixture(scope="module")
def server(assets):
    s = Server([str(assets["model"]), "--tp", "2", "--adapter", f"a={assets['a']}",
                "--adapter", f"b={assets['b']}", "--max-adapters", "4", "--grace", "20"])  # fmt: skip
    yield s
    s.stop()


def chat(client, model: str, prompt: str, **kw) -> str:
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], temperature=0, **kw
    )
    return r.choices[0].message.content


def test_models_and_health(server) -> None:
    ids = [m.id for m in server.client.models.list().data]
    assert ids == ["tiny", "a", "b"]
    health = server.get("/health")
    assert health["status"] == "ok" and health["running"] == health["waiting"] == 0


def test_chat_with_an_adapter_equals_generate(server, assets) -> None:
    prompt = PROMPTS[0]
    want = cli("generate", str(assets["model"]), "--tp", "2", "--adapter", str(assets["b"]),
               "--prompt", prompt, "--max-new-tokens", "12")  # fmt: skip
    assert want.returncode == 0, want.stderr[-3000:]
    r = server.client.chat.completions.create(
        model="b", messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=12
    )
    assert r.choices[0].message.content == want.stdout.strip()
    assert r.usage.completion_tokens == 12 and r.choices[0].finish_reason == "length"
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12
    # the adapters change the reply (else the test above could not fail on a wrong adapter)
    replies = {m: chat(server.client, m, prompt, max_tokens=12) for m in ("tiny", "a", "b")}
    assert len(set(replies.values())) == 3


def test_completion_stream_equals_non_stream(server) -> None:
    kw = {"model": "a", "prompt": PROMPTS[1], "max_tokens": 10, "temperature": 0}
    whole = server.client.completions.create(**kw)
    parts, finish, usage = [], None, None
    for chunk in server.client.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}
    ):
        if chunk.choices:
            parts.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    assert "".join(parts) == whole.choices[0].text and whole.choices[0].text
    assert finish == whole.choices[0].finish_reason == "length"
    assert usage.completion_tokens == whole.usage.completion_tokens == 10
    # chat streams too: deltas after a role chunk
    chunks = list(server.client.chat.completions.create(
        model="b", messages=[{"role": "user", "content": PROMPTS[2]}], temperature=0,
        max_tokens=8, stream=True))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == chat(server.client, "b", PROMPTS[2], max_tokens=8)


def test_stop_strings_and_seeded_sampling(server) -> None:
    full = server.client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=12,
                                            temperature=0).choices[0].text  # fmt: skip
    words = full.split()
    stop = " " + words[3]
    cut = server.client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=12,
                                           temperature=0, stop=[stop])  # fmt: skip
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == full[: full.index(stop)]
    kw = {"model": "a", "prompt": PROMPTS[4], "max_tokens": 12, "temperature": 1.0, "top_p": 0.9}
    one = server.client.completions.create(**kw, seed=7).choices[0].text
    assert server.client.completions.create(**kw, seed=7).choices[0].text == one


def test_adapters_at_run_time(server, assets) -> None:
    code, body = server.post("/v1/adapters", {"name": "b2", "path": str(assets["b"])})
    assert code == 201 and body["id"] == "b2", body
    code, _ = server.post("/v1/adapters", {"name": "c", "path": str(assets["c"])})
    assert code == 201
    assert [m.id for m in server.client.models.list().data] == ["tiny", "a", "b", "b2", "c"]
    for p in PROMPTS[:2]:  # the same adapter loaded at run time answers as the one from start
        assert chat(server.client, "b2", p, max_tokens=10) == chat(
            server.client, "b", p, max_tokens=10
        )
    base, c = (
        chat(server.client, "tiny", PROMPTS[0], max_tokens=10),
        chat(server.client, "c", PROMPTS[0], max_tokens=10),
    )
    assert c != base
    # every slot is taken (4): a fifth is refused with the fix
    code, body = server.post("/v1/adapters", {"name": "d", "path": str(assets["a"])})
    assert code == 409 and "--max-adapters" in body["error"]["message"]
    code, body = server.post("/v1/adapters", {"name": "c", "path": str(assets["c"])})
    assert code == 409
    code, body = server.post("/v1/adapters/c", b"", method="DELETE")
    assert code == 200 and body["deleted"] is True
    with pytest.raises(openai.NotFoundError):
        chat(server.client, "c", PROMPTS[0], max_tokens=4)
    code, _ = server.post("/v1/adapters/b2", b"", method="DELETE")
    assert code == 200
    assert [m.id for m in server.client.models.list().data] == ["tiny", "a", "b"]


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        (b'{"model": "tiny", "prompt": ', 400, "not valid JSON"),
        ({"model": "nope", "prompt": "hi"}, 404, "does not exist"),
        ({"model": "tiny", "prompt": "to " * 300}, 400, "maximum context length"),
        ({"model": "tiny", "prompt": "hi", "max_tokens": 1000}, 400, "maximum context length"),
        ({"model": "tiny", "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": "tiny", "prompt": "hi", "temperature": -1}, 400, "temperature"),
        ({"model": "tiny", "prompt": "hi", "top_p": 0}, 400, "top_p"),
        ({"model": "tiny", "prompt": "hi", "n": 2}, 400, "n=2"),
        ({"model": "tiny", "prompt": "hi", "logprobs": 3}, 400, "logprobs"),
        ({"model": "tiny", "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "at most 4"),
        ({"model": "tiny", "prompt": ""}, 400, "empty"),
        ({"model": "tiny"}, 400, "prompt"),
        ({"model": "tiny", "prompt": ["one", "two"]}, 400, "one per request"),
    ],
)
def test_bad_requests_get_openai_errors(server, body, status, needle) -> None:
    code, out = server.post("/v1/completions", body)
    assert code == status, out
    err = out["error"]
    assert needle in err["message"] and err["type"]
    assert server.get("/health")["status"] == "ok"


def test_bad_chat_and_adapter_requests(server, assets) -> None:
    code, out = server.post("/v1/chat/completions", {"model": "a", "messages": []})
    assert code == 400 and "messages" in out["error"]["message"]
    code, out = server.post("/v1/chat/completions", {"model": "a", "messages": [
        {"role": "robot", "content": "hi"}]})  # fmt: skip
    assert code == 400
    code, out = server.post("/v1/adapters", {"name": "x", "path": str(assets["a"] / "nope")})
    assert code == 400 and "does not exist" in out["error"]["message"]
    code, out = server.post("/v1/adapters", {"name": "x", "path": str(assets["model"])})
    assert code == 400 and "adapter_config.json" in out["error"]["message"]
    code, out = server.post("/v1/adapters/zzz", b"", method="DELETE")
    assert code == 404
    with pytest.raises(openai.BadRequestError):
        server.client.completions.create(model="tiny", prompt="hi", temperature=5)
    assert server.get("/health")["status"] == "ok"


def test_a_client_that_leaves_frees_its_row(server) -> None:
    import http.client

    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    body = {"model": "a", "prompt": PROMPTS[5], "max_tokens": 200, "temperature": 0,
            "stream": True}  # fmt: skip
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    resp.fp.readline()  # the first event has come: the row is decoding
    assert server.get("/health")["running"] == 1
    conn.sock.close()  # the client goes away mid-stream
    conn.close()
    deadline = time.time() + 30
    while server.get("/health")["running"] and time.time() < deadline:
        time.sleep(0.2)
    assert server.get("/health")["running"] == 0


def test_32_concurrent_clients_equal_one_at_a_time(server) -> None:
    models = ["tiny", "a", "b", "a"]
    cases = [(models[i % 4], PROMPTS[i % 8], 6 + i % 7, i % 5 == 4) for i in range(32)]

    def ask(case):
        model, prompt, n, sampled = case
        kw = {"temperature": 0.8, "seed": 1000 + n} if sampled else {"temperature": 0}
        r = server.client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=n, **kw
        )
        return r.choices[0].message.content, r.usage.completion_tokens, r.choices[0].finish_reason

    alone = [ask(c) for c in cases]
    assert server.get("/health")["peak_batch"] <= 2  # one at a time (a row may wait to be dropped)
    with ThreadPoolExecutor(32) as pool:
        together = list(pool.map(ask, cases))
    assert together == alone
    assert server.get("/health")["peak_batch"] >= 8  # they were decoded together
    assert all(text or finish == "stop" for text, _, finish in alone)
    assert len({text for text, _, _ in alone}) >= 16


def test_sigterm_finishes_the_running_request_and_exits(server) -> None:
    box = {}
    kw = {"model": "b", "prompt": PROMPTS[6], "max_tokens": 60, "temperature": 0}
    want = server.client.completions.create(**kw).choices[0].text

    def long_request():
        box["r"] = server.client.completions.create(**kw)

    t = threading.Thread(target=long_request)
    t.start()
    deadline = time.time() + 30
    while server.get("/health")["running"] == 0 and time.time() < deadline:
        time.sleep(0.05)
    server.proc.send_signal(signal.SIGTERM)
    t.join(60)
    assert box["r"].choices[0].text == want  # finished within the grace period
    assert server.proc.wait(60) == 0
    assert "stopped" in server.proc.stdout.read()
