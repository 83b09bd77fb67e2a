"""The decode attention's dispatch (infer/attention.py), without its kernel: what goes to
transformers' sdpa unchanged, and the implementation `decode_attention(model)` switches.

Wherever the kernel must not run, its launcher is replaced by one that fails the test; where it
must, by one that returns a marker. The kernel's arithmetic is checked under Triton's interpreter
(tests/unit/test_triton_interpreter.py, family "attention") and on a GPU
(tests/distributed/test_cuda_attention.py).
"""

from __future__ import annotations

import inspect

import pytest
import torch

from quantmesh.infer import attention as A

B, HQ, HKV, D, L = 2, 4, 2, 32, 40


@pytest.fixture
def no_kernel(monkeypatch):
    """The kernel's launcher fails the test if called."""

    def refuse(*args, **kw):
        raise AssertionError("the decode attention kernel ran")

    monkeypatch.setattr(A, "launch_decode_attention", refuse)


@pytest.fixture
def kernel_on_cpu(monkeypatch):
    """The switch on, CPU among the kernel's devices, any batch (these inputs have two rows; the
    rows rule has its own test), its launches still refused by no_kernel."""
    monkeypatch.setattr(A, "ENABLED", True)
    monkeypatch.setattr(A, "KERNEL_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(A, "_HAS_TRITON", True)
    monkeypatch.setattr(A, "MAX_ROWS", None)


@pytest.mark.usefixtures("kernel_on_cpu")
def test_the_kernel_takes_one_row_by_default(monkeypatch):
    """At 32 rows the kernel was measured slower than sdpa (MAX_ROWS): by default a batch of
    more than one row goes to sdpa, one row to the kernel."""
    monkeypatch.setattr(A, "MAX_ROWS", 1)
    q, k, v, mask = _inputs()
    assert A.decode_attention_applies(q[:1], k[:1], v[:1], mask[:1])
    assert not A.decode_attention_applies(q, k, v, mask)
    monkeypatch.setattr(A, "MAX_ROWS", None)
    assert A.decode_attention_applies(q, k, v, mask)


class _Attn(torch.nn.Module):
    """What sdpa_attention_forward reads of a module: its kv groups, causality, training."""

    num_key_value_groups = HQ // HKV
    is_causal = True


def _inputs(q_len=1, dtype=torch.float16, head_dim=D, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, q_len, head_dim, generator=g).to(dtype)
    k = torch.randn(B, HKV, L, head_dim, generator=g).to(dtype)
    v = torch.randn(B, HKV, L, head_dim, generator=g).to(dtype)
    filled = torch.tensor([30, 17])
    keys = torch.arange(L)
    mask = (keys[None, :] < filled[:, None])[:, None, None, :]  # (B, 1, 1, L), static-cache style
    if q_len > 1:
        mask = mask.expand(B, 1, q_len, L)
    return q, k, v, mask


def _sdpa(*args, **kw):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(*args, **kw)


def _same(got, want) -> bool:
    return got[1] is None and want[1] is None and torch.equal(got[0], want[0])


def test_registered_in_transformers():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: F401
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    fn = ALL_ATTENTION_FUNCTIONS.get_interface(A.IMPLEMENTATION, None)
    assert fn is A.decode_attention_forward
    assert ALL_MASK_ATTENTION_FUNCTIONS[A.IMPLEMENTATION] is sdpa_mask
    assert A.IMPLEMENTATION in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping  # what masks check


def test_on_by_default_where_the_kernel_runs(monkeypatch) -> None:
    """The switch is on by default (QUANTMESH_DECODE_ATTENTION unset), and `fast_decode` switches
    a model only where the kernel can run: Triton, the weights on a kernel device."""
    assert A.ENABLED is True
    model = _llama()
    assert not A.decode_attention_wanted(model)  # CPU: not among KERNEL_DEVICES
    monkeypatch.setattr(A, "KERNEL_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(A, "_HAS_TRITON", True)
    assert A.decode_attention_wanted(model)
    monkeypatch.setattr(A, "_HAS_TRITON", False)
    assert not A.decode_attention_wanted(model)
    monkeypatch.setattr(A, "_HAS_TRITON", True)
    monkeypatch.setattr(A, "ENABLED", False)  # QUANTMESH_DECODE_ATTENTION=0
    assert not A.decode_attention_wanted(model)


@pytest.mark.usefixtures("no_kernel")
def test_switch_off_is_sdpa(monkeypatch):
    monkeypatch.setattr(A, "ENABLED", False)  # QUANTMESH_DECODE_ATTENTION=0
    q, k, v, mask = _inputs()
    float_mask = torch.where(mask, 0.0, float("-inf")).half()
    for m in (mask, float_mask, None):
        for scaling in (None, 0.3):
            got = A.decode_attention_forward(_Attn(), q, k, v, m, scaling=scaling)
            assert _same(got, _sdpa(_Attn(), q, k, v, m, scaling=scaling))
            assert got[0].shape == (B, 1, HQ, D) and got[0].is_contiguous()


@pytest.mark.usefixtures("no_kernel", "kernel_on_cpu")
def test_what_the_kernel_does_not_take_goes_to_sdpa():
    q, k, v, mask = _inputs()
    aux = torch.randn(HQ)
    bias = torch.randn(B, HQ, 1, L)
    calls = [  # (args, keywords): each one sdpa's alone
        ((q, k, v, mask), {"s_aux": aux}),  # sinks
        ((q, k, v, mask), {"position_bias": bias}),
        ((q, k, v, mask), {"output_attentions": True}),
        ((q, k, v, mask), {"some_new_keyword": torch.ones(1)}),  # unknown: may change the math
        ((q, k, v, mask), {"dropout": 0.5}),
        (_inputs(q_len=3)[:4], {}),  # a prefill
        (_inputs(dtype=torch.float32)[:4], {}),
        (_inputs(head_dim=320)[:4], {}),  # past the kernel's head dim
        ((q, k[:1], v[:1], mask), {}),  # keys of one row for every row: sdpa broadcasts them
    ]
    for args, kw in calls:
        args = (_Attn(), *args)
        torch.manual_seed(1)  # dropout's draws alike
        got = A.decode_attention_forward(*args, **kw)
        torch.manual_seed(1)
        want = _sdpa(*args, **kw)
        assert _same(got, want), kw
    A.KERNEL_DEVICES = ("cuda",)  # the device not among the kernel's (monkeypatch restores it)
    assert _same(A.decode_attention_forward(_Attn(), q, k, v, mask), _sdpa(_Attn(), q, k, v, mask))


@pytest.mark.usefixtures("no_kernel", "kernel_on_cpu")
def test_softcap_raises_as_sdpa_does():
    q, k, v, mask = _inputs()
    with pytest.raises(ValueError, match="softcap"):
        _sdpa(_Attn(), q, k, v, mask, softcap=30.0)
    with pytest.raises(ValueError, match="softcap"):
        A.decode_attention_forward(_Attn(), q, k, v, mask, softcap=30.0)


@pytest.mark.usefixtures("kernel_on_cpu")
def test_the_kernel_takes_one_token_with_neutral_keywords(monkeypatch):
    seen = []

    def marker(q, k, v, mask, scaling, *rest):
        seen.append((mask, scaling))
        return torch.full((q.shape[0], 1, q.shape[1], q.shape[3]), 7.0, dtype=q.dtype)

    monkeypatch.setattr(A, "launch_decode_attention", marker)
    q, k, v, mask = _inputs()
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # transformers' strides
    float_mask = torch.where(mask, 0.0, torch.finfo(torch.float16).min)
    heads = mask.expand(B, HQ, 1, L).clone()
    for m in (mask, float_mask, heads, mask[:1], None):
        out, weights = A.decode_attention_forward(
            _Attn(), qt, k, v, m, dropout=0.0, scaling=0.25, is_causal=True,
            position_ids=torch.zeros(B, 1, dtype=torch.long), use_cache=True,
            sliding_window=None, softcap=None, s_aux=None, output_attentions=False,
        )  # fmt: skip
        assert weights is None and out.shape == (B, 1, HQ, D) and bool((out == 7).all())
    assert len(seen) == 5 and all(s == 0.25 for _, s in seen)
    A.decode_attention_forward(_Attn(), q, k, v, None)  # scaling None: 1 / sqrt(head dim)
    assert seen[-1][1] == D**-0.5
    A.ENABLED = False  # read at call time
    assert A.decode_attention_forward(_Attn(), q, k, v, mask)[0].abs().max() != 7


def _llama(attn: str = "sdpa"):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=128, attn_implementation=attn)  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def _implementations(model) -> set[str]:
    """The implementations the model's attention layers read at call time."""
    return {m.config._attn_implementation for m in model.modules() if hasattr(m, "o_proj")}


def test_context_switches_and_restores():
    model = _llama()
    assert _implementations(model) == {"sdpa"}
    with A.decode_attention(model) as on:
        assert on and model.config._attn_implementation == A.IMPLEMENTATION
        assert _implementations(model) == {A.IMPLEMENTATION}
        with A.decode_attention(model) as again:  # entered again: changes nothing
            assert not again and _implementations(model) == {A.IMPLEMENTATION}
        assert _implementations(model) == {A.IMPLEMENTATION}  # the outer one still holds
    assert model.config._attn_implementation == "sdpa" and _implementations(model) == {"sdpa"}
    with pytest.raises(RuntimeError, match="inside"):
        with A.decode_attention(model):
            raise RuntimeError("inside")
    assert _implementations(model) == {"sdpa"}


def test_other_implementations_left_alone():
    model = _llama("eager")
    with A.decode_attention(model) as on:
        assert not on and _implementations(model) == {"eager"}
    assert _implementations(model) == {"eager"}
    from transformers import LlavaConfig

    holder = torch.nn.Module()  # a composite config: each sub-config on its own
    holder.config = LlavaConfig()
    cfg = holder.config
    cfg._attn_implementation_internal = "sdpa"
    cfg.text_config._attn_implementation_internal = "sdpa"
    cfg.vision_config._attn_implementation_internal = "eager"
    with A.decode_attention(holder):
        assert cfg._attn_implementation == cfg.text_config._attn_implementation == A.IMPLEMENTATION
        assert cfg.vision_config._attn_implementation == "eager"
    assert cfg._attn_implementation == cfg.text_config._attn_implementation == "sdpa"
    assert cfg.vision_config._attn_implementation == "eager"


@torch.no_grad()
def test_model_inside_the_context_runs_sdpa_with_its_masks():
    """A static-cache decode step (the mask over every slot, most of them unwritten) gives sdpa's
    logits bit for bit inside the context with the switch off: the masks come from sdpa's mask
    function under the new name (without one, transformers would pass no mask at all, and the
    unwritten slots would be attended)."""
    from transformers import StaticCache

    model = _llama()
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(2))
    pad = torch.ones(2, 64, dtype=torch.long)
    pad[1, :3] = 0

    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def run():
        kw = {name: StaticCache(config=model.config, max_cache_len=64)}
        model(input_ids=ids[:, :6], attention_mask=pad[:, :6], **kw)
        return model(input_ids=ids[:, 6:], attention_mask=pad, **kw).logits

    want = run()
    with A.decode_attention(model):
        got = run()
    assert torch.equal(got, want)
    kw = {name: StaticCache(config=model.config, max_cache_len=64)}
    with A.decode_attention(model):  # the mask reaches the attention function
        seen = []
        real = A.decode_attention_forward

        def spy(module, q, k, v, mask, **kw):
            seen.append(None if mask is None else tuple(mask.shape))
            return real(module, q, k, v, mask, **kw)

        from transformers.modeling_utils import AttentionInterface

        AttentionInterface.register(A.IMPLEMENTATION, spy)
        try:
            model(input_ids=ids[:, :6], **kw)
            model(input_ids=ids[:, 6:], **kw)
        finally:
            AttentionInterface.register(A.IMPLEMENTATION, real)
    assert seen[-1] == (2, 1, 1, 64)


@pytest.mark.usefixtures("no_kernel")
def test_fast_decode_says_when_the_switch_meets_a_model_that_is_not_sdpa(monkeypatch) -> None:
    """The switch on, the model on a kernel device, eager attention: `fast_decode` decodes with
    eager attention and says so (never silently ignored); an sdpa model decodes through the
    implementation without a word (fp32 here: sdpa's path, the kernel never launched), and both
    are given back their own afterwards. Where the kernel cannot run (CPU by default), neither
    is switched, and nothing is said."""
    import warnings

    import quantmesh as qm

    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        qm.fast_decode(_llama("eager"), ids, 3, compile=False)  # CPU: the kernel cannot run
    assert not [w for w in seen if "QUANTMESH_DECODE_ATTENTION" in str(w.message)]
    monkeypatch.setattr(A, "KERNEL_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(A, "_HAS_TRITON", True)
    for attn, says in (("eager", True), ("sdpa", False)):
        model = _llama(attn)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            qm.fast_decode(model, ids, 3, compile=False)
        said = [
            str(w.message) for w in seen if "QUANTMESH_DECODE_ATTENTION is on" in str(w.message)
        ]
        assert bool(said) == says, (attn, said)
        assert not says or "'eager'" in said[0] and "attn_implementation='sdpa'" in said[0]
        assert _implementations(model) == {attn}
