"""`quantmesh serve` at tp=2 on CPU ranks, driven by the real `openai` client and lm-eval.

One server (two ranks) is shared by the module, with an API key and an adapter directory; the last
test stops it with Ctrl-C twice (SIGINT to the launcher, as a terminal sends it): the first drains,
the second stops. The model is the tiny random Llama of test_cli_common, the adapters real PEFT
folders with random A and B: "a" (r=4, q/v) and "b" (r=8, every projection) are served from the
start, "c" (r=2, o/down) and a copy of "b" are added at run time from the adapter directory.
Logprobs are checked against the same model's log-softmax computed here, in this process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from .test_cli_common import CLI, REPO, make_adapter, make_tiny_llama, peft_chat_reply

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

    def __init__(self, args: list[str], timeout: float = 150, api_key: str | None = None) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env.pop("QUANTMESH_API_KEY", None)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        if api_key:
            args = [*args, "--api-key", api_key]
        for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
            env.pop(k, None)
        self.proc = subprocess.Popen(
            [*CLI, "serve", *args, "--port", "0"], cwd=REPO, env=env, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
        )  # fmt: skip
        # both pipes read all along: a server that wrote more than a pipe holds while a test
        # waited for it to exit would block on the write (a hang that looks like the server's)
        self._out: list[str] = []
        self._err: list[str] = []
        self._first = threading.Event()
        self._drains = [
            threading.Thread(target=self._drain, args=(stream, into), daemon=True)
            for stream, into in ((self.proc.stdout, self._out), (self.proc.stderr, self._err))
        ]
        for t in self._drains:
            t.start()
        self.line = line = self._first_line(timeout)
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
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=api_key or "none",
                                    max_retries=0, timeout=120)  # fmt: skip

    def _drain(self, stream, into: list[str]) -> None:
        for line in stream:  # until every writer (the launcher, the ranks) has closed it
            into.append(line)
            if into is self._out:
                self._first.set()
        self._first.set()  # closed: no first line will come

    def _first_line(self, timeout: float) -> str:
        self._first.wait(timeout)
        box = self._out[:1]
        if not box or not box[0].startswith("quantmesh serve:"):
            self.proc.kill()
            raise RuntimeError(f"server did not start: {box} {self.err()[-3000:]}")
        return box[0]

    def out(self, wait_s: float = 10.0) -> str:
        """What the server wrote to stdout so far; once it has exited, all of it (up to `wait_s`
        for the pipe to close)."""
        if self.proc.poll() is not None:
            self._drains[0].join(wait_s)
        return "".join(self._out)

    def err(self, wait_s: float = 10.0) -> str:
        """What the server wrote to stderr so far (as `out`)."""
        if self.proc.poll() is not None:
            self._drains[1].join(wait_s)
        return "".join(self._err)

    def get(self, path: str) -> dict:
        req = urllib.request.Request(self.url + path, headers=self.headers)
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())

    def post(self, path: str, body: bytes | dict, method: str = "POST") -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json", **self.headers})  # fmt: skip
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


KEY = "test-key-1234"


@pytest.fixture(scope="module")
def server(assets):
    s = Server([str(assets["model"]), "--tp", "2", "--adapter", f"a={assets['a']}",
                "--adapter", f"b={assets['b']}", "--max-adapters", "4", "--grace", "60",
                "--adapter-dir", str(assets["model"].parent), "--max-request-bytes", "65536"],
               api_key=KEY)  # fmt: skip
    yield s
    s.stop()


def chat(client, model: str, prompt: str, **kw) -> str:
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], temperature=0, **kw
    )
    return r.choices[0].message.content


def test_models_and_health(server) -> None:
    # --engine auto on CPU ranks: the dynamic engine (the slot engine's gain is CUDA graphs)
    assert server.line.rstrip().endswith("(tp 2, engine dynamic)"), server.line
    ids = [m.id for m in server.client.models.list().data]
    assert ids == ["tiny", "a", "b"]
    health = server.get("/health")
    assert health["status"] == "ok" and health["running"] == health["waiting"] == 0


def test_chat_with_an_adapter_equals_peft(server, assets) -> None:
    prompt = PROMPTS[0]
    want = peft_chat_reply(assets["model"], assets["b"], prompt, max_new_tokens=12)
    r = server.client.chat.completions.create(
        model="b", messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=12
    )
    assert r.choices[0].message.content == want
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
    code, body = server.post("/v1/adapters", {"name": "b2", "path": "b"})
    assert code == 201 and body["id"] == "b2", body
    code, _ = server.post("/v1/load_lora_adapter", {"lora_name": "c", "lora_path": "c"})  # vLLM's
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
    code, body = server.post("/v1/adapters", {"name": "d", "path": "a"})
    assert code == 409 and "--max-adapters" in body["error"]["message"]
    code, body = server.post("/v1/adapters", {"name": "c", "path": "c"})
    assert code == 409
    code, body = server.post("/v1/unload_lora_adapter", {"lora_name": "c"})
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
        ({"model": "tiny", "prompt": "hi", "n": 2, "best_of": 3}, 400, "best_of=3"),
        ({"model": "tiny", "prompt": "hi", "logprobs": 30}, 400, "logprobs"),
        ({"model": "tiny", "prompt": "hi", "ignore_eos": True}, 400, "ignore_eos is not a field"),
        (
            {"model": "tiny", "prompt": "hi", "response_format": {"type": "json_schema"}},
            400,
            "constrained decoding",
        ),
        ({"model": "tiny", "prompt": [[1, 2], [3, 99999]]}, 400, "outside the vocabulary"),
        ({"model": "tiny", "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "at most 4"),
        ({"model": "tiny", "prompt": ""}, 400, "empty"),
        ({"model": "tiny"}, 400, "prompt"),
        ({"model": "tiny", "prompt": "hi", "top_k": -2}, 400, "top_k"),
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
    code, out = server.post("/v1/adapters", {"name": "x", "path": "a/nope"})
    assert code == 400 and "no adapter folder" in out["error"]["message"]
    code, out = server.post("/v1/adapters", {"name": "x", "path": "tiny"})
    assert code == 400 and "adapter_config.json" in out["error"]["message"]
    code, out = server.post("/v1/adapters", {"name": "x", "path": str(assets["a"])})
    assert code == 400 and "absolute" in out["error"]["message"]
    code, out = server.post(
        "/v1/adapters", {"name": "x", "path": "../" + assets["model"].parent.name}
    )
    assert code == 400 and "'..'" in out["error"]["message"]
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
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json", **server.headers})  # fmt: skip
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


@pytest.fixture(scope="module")
def reference(assets):
    """The served model in this process (one rank, float32): logits to check logprobs against."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(assets["model"], dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(assets["model"])

    def log_softmax(ids: list[int]) -> torch.Tensor:  # (len(ids), vocab): position i -> i + 1
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)

    return model, tok, log_softmax


# tp=2 sums each projection in two halves and all-reduces them: the same logits up to float32
# rounding (~1e-6 relative); 1e-4 on a logprob is far below any real difference (a wrong position
# or token moves it by > 0.1 on this model)
TOL = 1e-4


def test_logprobs_are_the_models_log_softmax(server, reference) -> None:
    _, tok, log_softmax = reference
    ids = tok(PROMPTS[1] + " that is the question")["input_ids"]
    r = server.client.completions.create(model="tiny", prompt=ids, max_tokens=0, echo=True,
                                         logprobs=3, temperature=0)  # fmt: skip
    lp, want = r.choices[0].logprobs, log_softmax(ids)
    assert r.choices[0].text == tok.decode(ids) and r.usage.completion_tokens == 0
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts it
    own = [float(want[i, t]) for i, t in enumerate(ids[1:])]
    assert lp.token_logprobs[1:] == pytest.approx(own, abs=TOL)
    for i, top in enumerate(lp.top_logprobs[1:]):
        vals, idx = want[i].topk(3)
        alts = {tok.decode([int(t)]): float(v) for t, v in zip(idx, vals, strict=True)}
        assert {k: top[k] for k in alts} == pytest.approx(alts, abs=TOL)
    # generated tokens (chat): each token's logprob given the prompt and the tokens before it
    msgs = [{"role": "user", "content": PROMPTS[2]}]
    r = server.client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6,
                                              temperature=0, logprobs=True, top_logprobs=2)  # fmt: skip
    prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    content = r.choices[0].logprobs.content
    gen = [tok.convert_tokens_to_ids(c.token) for c in content]
    want = log_softmax(p_ids + gen)[len(p_ids) - 1 :]
    assert [c.logprob for c in content] == pytest.approx(
        [float(want[i, t]) for i, t in enumerate(gen)], abs=TOL
    )
    assert gen == [int(want[i].argmax()) for i in range(len(gen))]  # greedy: the top token
    assert [len(c.top_logprobs) for c in content] == [2] * len(gen)
    assert content[0].top_logprobs[1].logprob == pytest.approx(
        float(want[0].topk(2).values[1]), abs=TOL
    )


def test_batched_prompts_and_n_equal_one_at_a_time(server, reference) -> None:
    _, tok, _ = reference
    prompts = [tok(p)["input_ids"] for p in (PROMPTS[0], PROMPTS[5], PROMPTS[4], PROMPTS[7])]
    kw = {"model": "a", "max_tokens": 6, "temperature": 0, "logprobs": 2}
    batched = server.client.completions.create(prompt=prompts, n=2, **kw)
    assert [c.index for c in batched.choices] == list(range(8))
    for i, ids in enumerate(prompts):
        alone = server.client.completions.create(prompt=ids, **kw).choices[0]
        for c in batched.choices[2 * i : 2 * i + 2]:
            assert c.text == alone.text and c.logprobs.tokens == alone.logprobs.tokens
            assert c.logprobs.token_logprobs == pytest.approx(
                alone.logprobs.token_logprobs, abs=TOL
            )
    # a list of strings is the same as their token ids
    texts = server.client.completions.create(prompt=[PROMPTS[0], PROMPTS[5]], **kw)
    assert [c.text for c in texts.choices] == [batched.choices[0].text, batched.choices[2].text]
    # n seeded samples: different from each other, the same again with the same seed
    kw = {"model": "b", "prompt": PROMPTS[3], "max_tokens": 10, "temperature": 1.0, "n": 3}
    one = [c.text for c in server.client.completions.create(**kw, seed=5).choices]
    assert [c.text for c in server.client.completions.create(**kw, seed=5).choices] == one
    assert len(set(one)) == 3


def test_sampling_settings_change_the_draw_as_defined(server, reference) -> None:
    import torch

    from quantmesh.infer.sampling import penalize

    model, tok, _ = reference
    greedy = server.client.completions.create(model="tiny", prompt=PROMPTS[6], max_tokens=8,
                                              temperature=0).choices[0].text  # fmt: skip
    for seed in (1, 2):  # top_k=1 (vLLM's extra field) leaves one token to draw
        r = server.client.completions.create(model="tiny", prompt=PROMPTS[6], max_tokens=8,
                                             temperature=1.0, seed=seed, extra_body={"top_k": 1})  # fmt: skip
        assert r.choices[0].text == greedy
    # penalties: the greedy reply equals this process's greedy loop over the penalized logits
    pen = {"repetition_penalty": 1.5, "presence_penalty": 0.5, "frequency_penalty": 0.7}
    ids = tok(PROMPTS[6])["input_ids"]
    out: list[int] = []
    counts = torch.zeros(model.config.vocab_size)
    seen = torch.zeros(model.config.vocab_size, dtype=torch.bool)
    seen[ids] = True
    for _ in range(12):
        with torch.no_grad():
            logits = model(torch.tensor([ids + out])).logits[0, -1:]
        z = penalize(logits, seen[None], counts[None], pen["repetition_penalty"],
                     pen["presence_penalty"], pen["frequency_penalty"])  # fmt: skip
        out.append(int(z.argmax()))
        counts[out[-1]] += 1
        if out[-1] == tok.eos_token_id:
            break
    r = server.client.completions.create(model="tiny", prompt=PROMPTS[6], max_tokens=12,
                                         temperature=0, extra_body={"repetition_penalty": 1.5},
                                         presence_penalty=0.5, frequency_penalty=0.7)  # fmt: skip
    assert r.choices[0].text == tok.decode(out, skip_special_tokens=True)
    plain = server.client.completions.create(model="tiny", prompt=PROMPTS[6], max_tokens=12,
                                             temperature=0).choices[0].text  # fmt: skip
    assert r.choices[0].text != plain  # the penalties changed this reply


def test_the_api_key_guards_every_route(server) -> None:
    bare = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bare.models.list()
    with pytest.raises(openai.AuthenticationError):
        bare.completions.create(model="tiny", prompt="hi", max_tokens=1)
    for path in ("/health", "/v1/models"):
        try:
            urllib.request.urlopen(server.url + path, timeout=30)
            raise AssertionError(f"{path} answered without a key")
        except urllib.error.HTTPError as e:
            assert e.code == 401
    code, out = server.post("/v1/completions", {"model": "tiny", "prompt": "to " * 30_000})
    assert code == 413 and "--max-request-bytes" in out["error"]["message"]


# ---- lm-evaluation-harness ------------------------------------------------------------------------
MC_CHOICES = ["sea", "summer", "mind", "women"]  # whole tokens of the word-level vocabulary


def _greedy(model, ids: list[int], eos: int, n: int) -> list[int]:
    import torch

    out: list[int] = []
    while len(out) < n and (not out or out[-1] != eos):
        with torch.no_grad():
            out.append(int(model(torch.tensor([ids + out])).logits[0, -1].argmax()))
    return out


def _task(root: Path, name: str, docs: list[dict], spec: str) -> None:
    data = root / f"{name}.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (root / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        f"test_split: test\n{spec}"
    )


_LM_EVAL = """
import json, os, sys
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager
spec = json.load(open(sys.argv[1]))
tasks = TaskManager(include_path=spec["include"], include_defaults=False)  # ours alone: no index
out = []
for run in spec["runs"]:
    r = simple_evaluate(task_manager=tasks, log_samples=True, bootstrap_iters=0, **run)
    out.append({"results": r["results"], "samples": r["samples"]})
json.dump(out, open(spec["out"], "w"), default=str)
sys.stdout.flush()
os._exit(0)  # no interpreter teardown: seconds
"""


def _lm_eval(tmp: Path, runs: list[dict]) -> list[tuple[dict, dict]]:
    """Run lm-eval's `simple_evaluate` as a user's script would (offline: local json data), every
    run in one process; [(results, samples by task)] per run."""
    spec = tmp / "lm_eval.json"
    out = tmp / "lm_eval_out.json"
    spec.write_text(json.dumps({"include": str(tmp), "out": str(out), "runs": runs}))
    env = dict(os.environ, OPENAI_API_KEY=KEY, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
               HF_HOME=str(tmp / "hf"), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", _LM_EVAL, str(spec)], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = []
    for r in json.loads(out.read_text()):
        samples = {t: sorted(docs, key=lambda d: d["doc_id"]) for t, docs in r["samples"].items()}
        got.append((r["results"], samples))
    return got


def test_lm_eval_scores_through_the_server(server, reference, assets, tmp_path) -> None:
    """lm-eval's local-completions scores a multiple-choice task (loglikelihoods: echo + logprobs,
    token-id prompts, batched) and a generation task; local-chat-completions a generation task.
    The data is made here so that the right score is known: half the golds are the reference
    model's own choice, half not."""
    model, tok, log_softmax = reference
    mc, expect_ll = [], []
    for i, q in enumerate(PROMPTS):
        ctx = tok(q)["input_ids"]
        lls = []
        for c in MC_CHOICES:
            whole = tok(q + " " + c)["input_ids"]
            lp = log_softmax(whole)
            lls.append(sum(float(lp[j - 1, whole[j]]) for j in range(len(ctx), len(whole))))
        assert len(set(lls)) == 4  # distinct scores: a wrong one changes the pick
        best = max(range(4), key=lls.__getitem__)
        mc.append(
            {"question": q, "choices": MC_CHOICES, "gold": best if i % 2 == 0 else (best + 1) % 4}
        )
        expect_ll.append(lls)
    _task(
        tmp_path,
        "qm_mc",
        mc,
        "output_type: multiple_choice\ndoc_to_text: question\n"
        "doc_to_choice: choices\ndoc_to_target: gold\nmetric_list:\n  - metric: acc\n",
    )
    gen_spec = ("output_type: generate_until\ndoc_to_text: prompt\ndoc_to_target: target\n"
                "generation_kwargs:\n  until: ['<|im_end|>']\n  max_gen_toks: 6\n"
                "  do_sample: false\n  temperature: 0\nmetric_list:\n  - metric: exact_match\n")  # fmt: skip
    eos = tok.eos_token_id
    gen, chat_gen = [], []
    for i, q in enumerate(PROMPTS[:6]):
        text = tok.decode(_greedy(model, tok(q)["input_ids"], eos, 6), skip_special_tokens=True)
        gen.append({"prompt": q, "target": text if i % 2 == 0 else "sun"})
        chat = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                       add_generation_prompt=True)  # fmt: skip
        ids = tok(chat, add_special_tokens=False)["input_ids"]
        text = tok.decode(_greedy(model, ids, eos, 6), skip_special_tokens=True)
        chat_gen.append({"prompt": q, "target": text if i % 2 == 0 else "sun"})
    _task(tmp_path, "qm_gen", gen, gen_spec)
    _task(tmp_path, "qm_chat_gen", chat_gen, gen_spec)

    base = f"model=tiny,tokenizer={assets['model']},tokenizer_backend=huggingface,max_retries=1"
    (results, samples), (chat_results, chat_samples) = _lm_eval(
        tmp_path,
        [
            {"model": "local-completions", "tasks": ["qm_mc", "qm_gen"], "batch_size": 4,
             "model_args": f"base_url={server.url}/v1/completions,{base},tokenized_requests=True"},
            {"model": "local-chat-completions", "tasks": ["qm_chat_gen"],
             "apply_chat_template": True,
             "model_args": f"base_url={server.url}/v1/chat/completions,model=tiny,max_retries=1"},
        ],
    )  # fmt: skip
    assert results["qm_mc"]["acc,none"] == 0.5
    assert results["qm_gen"]["exact_match,none"] == 0.5
    for doc, lls in zip(samples["qm_mc"], expect_ll, strict=True):  # the scores themselves
        got = [float(r[0][0]) for r in doc["resps"]]  # [[(loglikelihood, is_greedy)]] a choice
        assert got == pytest.approx(lls, abs=TOL)
    assert chat_results["qm_chat_gen"]["exact_match,none"] == 0.5, chat_samples


def test_ctrl_c_drains_and_a_second_ctrl_c_stops(server) -> None:
    """Ctrl-C (SIGINT to the server's process group, as a terminal sends it: the launcher and
    the ranks each get one, and the launcher forwards its own, so rank 0 gets two at once): the
    running requests finish, as on SIGTERM; a second Ctrl-C stops at once. No client ever sees a
    transport error's text, and nothing is printed as a traceback. Before, the two copies of the
    first Ctrl-C counted as two presses: no drain, and uvicorn's lifespan traceback."""
    kw = {"model": "b", "prompt": PROMPTS[6], "max_tokens": 20, "temperature": 0}
    want = server.client.completions.create(**kw).choices[0].text
    long = server.client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=220,
                                            temperature=0, stream=True)  # fmt: skip
    chunks = iter(long)
    first = next(chunks)
    assert first.choices[0].finish_reason is None
    box: dict = {}

    def short() -> None:
        try:
            box["r"] = server.client.completions.create(**kw)
        except openai.APIError as e:
            box["e"] = e

    t = threading.Thread(target=short)
    t.start()
    deadline = time.time() + 30
    while server.get("/health")["running"] < 2 and time.time() < deadline:
        time.sleep(0.05)
    os.killpg(server.proc.pid, signal.SIGINT)
    first = time.monotonic()
    t.join(120)
    assert "e" not in box, box.get("e")
    assert box["r"].choices[0].text == want  # drained: it finished within the grace period
    more = next(chunks)  # the long reply is still being generated
    assert more.choices[0].finish_reason is None
    time.sleep(max(0.0, first + 1.5 - time.monotonic()))  # a person's second press, not a copy
    os.killpg(server.proc.pid, signal.SIGINT)
    rest, error = [], ""
    try:
        rest = list(chunks)
    except Exception as e:  # the stream is cut (the connection closes): not a transport's text
        error = f"{type(e).__name__}: {e}"
    assert not any(c.choices and c.choices[0].finish_reason for c in rest)  # it did not finish
    assert server.proc.wait(60) == 0
    out, err = server.out(), server.err()
    assert "stopped (SIGINT)" in out, (out, err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    for text in (error, *(c.model_dump_json() for c in rest)):
        assert "gloo" not in text.lower() and "Connection closed" not in text
