"""Captured prefills (infer/prefill_graph.py) on CPU: a recorder stands in for CUDA graphs (the
"graph" is the padded forward itself, counted), so what the mechanism does around the graph is
checked here: the bucket's right-padding, the logits of the prompt's last token, every layer's
length set back to the prompt's (else the decode steps would write and read at the bucket's end),
the model's state taken before each replay, and the refusals. The replay of a real graph is checked
on a GPU (tests/distributed/test_cuda_decode.py)."""

from __future__ import annotations

import warnings

import pytest
import torch

import quantmesh as qm
from quantmesh.infer import prefill_graph as PG


def _llama(attn: str = "sdpa", **extra):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=512, attn_implementation=attn, **extra)  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


class _Recorder:
    """Stands in for `cuda_graph`: runs the recorded function once (its warm-up), and the 'graph'
    runs it again, counted."""

    def __init__(self, fail: Exception | None = None, scale: float = 1.0) -> None:
        self.records = self.replays = 0
        self.fail, self.scale = fail, scale

    def __call__(self, fn):
        if self.fail is not None:
            raise self.fail
        fn()  # (cuda_graph's warm-up, before its capture)
        self.records += 1

        def replay():
            self.replays += 1
            return fn() * self.scale

        return replay


@pytest.fixture
def recorder(monkeypatch):
    """CPU among the devices that record, the recorder above in place of CUDA graphs, and a
    compile that only traces (the step's compile is not what is tested here)."""
    rec = _Recorder()
    monkeypatch.setattr(PG, "ENABLED", True)  # (whatever the environment says)
    monkeypatch.setattr(PG, "DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(PG, "cuda_graph", rec)
    monkeypatch.setattr(PG.PrefillGraphs.__init__, "__defaults__", (rec,))
    monkeypatch.setenv("QUANTMESH_COMPILE_BACKEND", "eager")
    return rec


def _prompt(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 64, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_replayed_prefills_give_the_eager_loops_tokens(recorder, attn):
    """Prompts of 5, 9 and 20 tokens (buckets 16, 16, 32): each compiled call's tokens are the
    eager loop's, with sdpa's mask and eager attention's; a bucket is recorded once and replayed
    by every later prompt it holds."""
    model, ref = _llama(attn), _llama(attn)  # (the eager loop on a twin: a decoder a model)
    for n, records, replays in ((5, 1, 1), (9, 1, 2), (20, 2, 3), (5, 2, 4)):
        ids = _prompt(n, seed=n)
        want = qm.fast_decode(ref, ids, 12, compile=False)
        got = qm.fast_decode(model, ids, 12, mode=None)
        assert torch.equal(got, want), (n, got, want)
        assert (recorder.records, recorder.replays) == (records, replays), n


def test_a_bucket_that_just_fits_the_cache_is_recorded(recorder):
    """A cache that holds the bucket but not the prompt and the bucket after it (130 + 8 tokens:
    256 slots, bucket 256): recorded on an empty cache (the recorder's warm-up too), replayed,
    the eager loop's tokens."""
    model, ref = _llama(), _llama()
    ids = _prompt(130)
    want = qm.fast_decode(ref, ids, 8, compile=False)
    for _ in range(2):
        assert torch.equal(qm.fast_decode(model, ids, 8, mode=None), want)
    graphs = model.__dict__["_quantmesh_decoder"].graphs
    assert graphs.refused is None, graphs.refused
    assert (recorder.records, recorder.replays) == (1, 2)


def test_the_layers_length_is_the_prompts(recorder):
    """After a replayed prefill every layer's length is the prompt's, not the bucket's, and the
    slots the pads wrote lie past it."""
    model = _llama()
    qm.fast_decode(model, _prompt(5), 1, mode=None)  # the first call records (after an eager one)
    qm.fast_decode(model, _prompt(6), 1, mode=None)  # replayed
    cache = model.__dict__["_quantmesh_decoder"].cache
    assert recorder.replays == 2
    assert [int(layer.cumulative_length) for layer in cache.layers] == [6, 6]
    assert bool(cache.layers[0].keys[:, :, 6:16].ne(0).any())  # the pads' slots, never read


def test_a_changed_model_is_recorded_again(recorder):
    """A replaced parameter or a changed scalar attribute drops the recordings: the next call
    records again, and its tokens are the changed model's eager ones."""
    model, ref = _llama(), _llama()
    ids = _prompt(7)
    qm.fast_decode(model, ids, 4, mode=None)
    qm.fast_decode(model, ids, 4, mode=None)
    assert (recorder.records, recorder.replays) == (1, 2)
    for m in (model, ref):
        m.lm_head.weight = torch.nn.Parameter(m.lm_head.weight.detach().flip(0).clone())
    want = qm.fast_decode(ref, ids, 8, compile=False)
    assert torch.equal(qm.fast_decode(model, ids, 8, mode=None), want)
    assert recorder.records == 2
    for m in (model, ref):
        m.model.rotary_emb.attention_scaling = 0.5
    want = qm.fast_decode(ref, ids, 8, compile=False)
    assert torch.equal(qm.fast_decode(model, ids, 8, mode=None), want)
    assert recorder.records == 3


@pytest.mark.parametrize("how", ["refused", "differs"])
def test_a_refused_or_different_recording_keeps_the_eager_prefill(recorder, how):
    """A recording the runtime refuses, or whose logits differ from the eager prefill's: said once,
    the eager prefill's tokens, and no recording tried again."""
    if how == "refused":
        recorder.fail = RuntimeError("operation not permitted when stream is capturing")
    else:
        recorder.scale = 2.0
    model = _llama()
    ids = _prompt(5)
    want = qm.fast_decode(_llama(), ids, 8, compile=False)
    with pytest.warns(UserWarning, match="recording it failed" if how == "refused" else "differ"):
        assert torch.equal(qm.fast_decode(model, ids, 8, mode=None), want)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(qm.fast_decode(model, ids, 8, mode=None), want)
    assert recorder.replays == (0 if how == "refused" else 1)


def test_where_it_does_not_apply(recorder, monkeypatch):
    """Left-padded rows, a cache with sliding windows or its own query offset, a prompt past the
    last bucket, a CPU model by default, and the switch off: the eager prefill, nothing
    recorded."""
    model = _llama()
    ids = _prompt(5).repeat(2, 1)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    qm.fast_decode(model, ids, 3, mode=None, attention_mask=mask)
    qm.fast_decode(_llama(), _prompt(PG.BUCKETS[-1] + 1), 2, mode=None)
    assert recorder.records == 0
    graphs = model.__dict__["_quantmesh_decoder"].graphs
    from transformers import StaticCache

    sliding = _llama(sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    cache = StaticCache(config=sliding.config, max_cache_len=256)
    sliding(input_ids=_prompt(3), past_key_values=cache, use_cache=True)  # (its layers, built)
    why = PG.PrefillGraphs(sliding, cache).why_not(_prompt(5), None)
    assert why == "a cache with other layers than full-attention StaticLayers"

    class Ahead(StaticCache):  # queries ahead of the cache (as transformers' MTP caches are)
        def get_query_offset(self, layer_idx: int = 0):
            return super().get_query_offset(layer_idx) + 1

    why = PG.PrefillGraphs(model, Ahead(config=model.config, max_cache_len=256)).why_not(
        _prompt(5), None
    )
    assert why == "a cache (Ahead) whose queries' offset is its own"
    assert graphs.why_not(ids, (mask, None)) == "left-padded rows"
    assert graphs.why_not(ids.to("meta"), None) == "a meta model"
    monkeypatch.setattr(PG, "DEVICES", ("cuda",))
    assert graphs.why_not(_prompt(5), None) == "a cpu model"
    monkeypatch.setattr(PG, "ENABLED", False)
    assert graphs.why_not(_prompt(5), None) == "off (QUANTMESH_CAPTURED_PREFILL=0)"


def test_model_state_sees_what_a_graph_would_miss():
    """model_state changes with a replaced parameter, a scalar attribute, a hook, a replaced
    forward and a kernel switch; not with a parameter updated in place (the graph reads it)."""
    from quantmesh.quant import kernel4

    model = _llama()
    base = PG.model_state(model)
    assert PG.model_state(model) == base
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    assert PG.model_state(model) == base
    changes = [
        lambda: setattr(model.lm_head, "weight", torch.nn.Parameter(torch.zeros(64, 64))),
        lambda: setattr(model.model.layers[0].self_attn, "scaling", 1.0),
        lambda: model.model.norm.register_forward_hook(lambda *a: None),
        lambda: setattr(model.model.norm, "forward", lambda x: x),
        lambda: setattr(kernel4, "GEMV_ENABLED", not kernel4.GEMV_ENABLED),
    ]
    saved = kernel4.GEMV_ENABLED
    try:
        for i, change in enumerate(changes):
            before = PG.model_state(model)
            change()
            assert PG.model_state(model) != before, i
    finally:
        kernel4.GEMV_ENABLED = saved


def test_on_by_default():
    """On since its GPU check (QUANTMESH_CAPTURED_PREFILL unset: on; 0: off)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "QUANTMESH_CAPTURED_PREFILL"}
    code = "from quantmesh.infer import prefill_graph as PG; print(PG.ENABLED)"
    for setting, want in ((None, "True"), ("0", "False")):  # unset, then "0"
        if setting is not None:
            env["QUANTMESH_CAPTURED_PREFILL"] = setting
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, timeout=120, check=True)  # fmt: skip
        assert out.stdout.strip() == want, (setting, out)


def test_the_recordings_warm_up_runs_on_the_current_stream(monkeypatch):
    """`cuda_graph` warms up on the stream every eager prefill runs on: a forward of the model on
    a side stream, once, left every later replay of a 7B decode step 0.2 ms slower on an H100
    (docs/benchmarks.md, forty-second sitting). torch.cuda's graph stood in (CPU): no stream is
    made or entered, the function runs once eagerly, then once under the capture, whose replay
    gives the captured output."""
    import contextlib

    events: list[str] = []

    def no_stream(*args, **kw):
        raise AssertionError("cuda_graph made or entered a side stream")

    class Graph:
        def replay(self) -> None:
            events.append("replay")

    @contextlib.contextmanager
    def capture(graph, *args, **kw):
        events.append("capture begins")
        yield
        events.append("capture ends")

    monkeypatch.setattr(torch.cuda, "Stream", no_stream)
    monkeypatch.setattr(torch.cuda, "stream", no_stream)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", capture)
    out = torch.zeros(2)

    def fn() -> torch.Tensor:
        events.append("fn")
        return out

    replay = PG.cuda_graph(fn)
    assert events == ["fn", "capture begins", "fn", "capture ends"]
    assert replay() is out and events[-1] == "replay"
