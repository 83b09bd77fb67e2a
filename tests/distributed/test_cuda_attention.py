"""quantmesh's decode attention kernel (infer/attention.py) against torch's SDPA, on a GPU.

The reference is SDPA's math backend in fp32 on the same bf16/fp16 inputs (the kv heads repeated
for grouped-query attention); the kernel sums in fp32 and rounds once to the inputs' dtype, so it
must land within twice that rounding of every value (plus a hundredth of the largest, for values
near 0). Shapes: the 7B decode step (32 query heads of 128, a static cache of 512 slots with 288
written; batch 1, 4, 32), multi-head and grouped-query (8 kv heads), bool masks as transformers'
sdpa path makes them (and left-padded rows), a float one, none; the slots no head sees hold NaN
(a read of one shows), and the blocks each program read are those holding a seen key. Then the
op inside torch.compile(fullgraph=True, mode="reduce-overhead") (CUDA graphs; the same bits as
eager, the mask changing between replays), and a small Llama's compiled decode step inside
`decode_attention(model)` with the switch on against its eager sdpa step, teacher-forced.
Marked cuda: runs on the GPU machine.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.cuda

HQ, D, L, FILLED = 32, 128, 512, 288


def _need_cuda():
    if not torch.cuda.is_available():  # the marker deselects it in CI; run where a GPU is
        pytest.fail("marked cuda but no CUDA device")


def _reference(q, k, v, mask, scaling):
    """SDPA's math backend in fp32, (B, 1, Hq, D)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    groups = q.shape[1] // k.shape[1]
    kk = k.float().repeat_interleave(groups, 1)
    vv = v.float().repeat_interleave(groups, 1)
    m = mask if mask is None or mask.dtype == torch.bool else mask.float()
    with sdpa_kernel(SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(q.float(), kk, vv, attn_mask=m,
                                                               scale=scaling)  # fmt: skip
    return out.transpose(1, 2)


def _check(out, ref, dtype, what):
    assert out.dtype == dtype and out.shape == ref.shape and out.is_contiguous(), what
    assert torch.isfinite(out).all(), what
    u = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-10  # twice the rounding to the dtype
    err = (out.float() - ref).abs()
    tol = u * (ref.abs() + 0.01 * ref.abs().max())
    assert (err <= tol).all(), (what, float((err / tol).max()))


def _cache(batch, kv_heads, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, 1, HQ, D, device="cuda", generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(batch, kv_heads, L, D, device="cuda", generator=g).to(dtype)
    v = torch.randn(batch, kv_heads, L, D, device="cuda", generator=g).to(dtype)
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv_heads", [32, 8])
@pytest.mark.parametrize("batch", [1, 4, 32])
def test_decode_attention_kernel_matches_sdpa(batch, kv_heads, dtype):
    _need_cuda()
    from quantmesh.infer import attention as A

    q, k, v = _cache(batch, kv_heads, dtype)
    keys = torch.arange(L, device="cuda")
    filled = torch.full((batch,), FILLED, device="cuda")
    filled[1::2] -= 37  # rows of other lengths
    start = torch.zeros(batch, dtype=torch.long, device="cuda")
    start[2::3] = 50  # left-padded rows
    tail = keys[None, :] < filled[:, None]
    masks = {
        "static": tail[:, None, None, :],
        "padded": (tail & (keys[None, :] >= start[:, None]))[:, None, None, :],
        "float": torch.where(tail, 0.0, float("-inf"))[:, None, None, :].to(dtype),
    }
    scaling = D**-0.5
    for name, mask in masks.items():
        sees = mask if mask.dtype == torch.bool else mask > A.HIDDEN
        sees = sees[:, 0, 0, :, None].expand(batch, L, kv_heads).transpose(1, 2)  # (B, Hkv, L)
        kp, vp = k.clone(), v.clone()
        kp[~sees] = float("nan")  # the slots no head sees: never read
        vp[~sees] = float("nan")
        cfg = A.decode_config(batch, kv_heads, HQ // kv_heads, D, L)
        block, per = cfg["BLOCK_L"], cfg["SPLIT"]
        splits = -(-L // per)
        counts = torch.zeros(batch * kv_heads, splits, dtype=torch.int32, device="cuda")
        out = A.launch_decode_attention(q, kp, vp, mask, scaling, counts=counts)
        what = (batch, kv_heads, dtype, name, cfg)
        _check(out, _reference(q, k, v, mask, scaling), dtype, what)
        want = sees.reshape(batch * kv_heads, L // block, block).any(dim=2).int()
        want = torch.nn.functional.pad(want, (0, splits * (per // block) - L // block))
        assert torch.equal(counts, want.reshape(batch * kv_heads, splits, -1).sum(2)), what
        # the op (what the compiled step runs): the same bits
        assert torch.equal(A.decode_attention_op(q, kp, vp, mask, scaling), out), what
    # every slot visible, no mask
    n = FILLED
    out = A.decode_attention_op(q, k[:, :, :n], v[:, :, :n], None, scaling)
    _check(out, _reference(q, k[:, :, :n], v[:, :, :n], None, scaling), dtype, "no mask")


def test_decode_attention_under_cuda_graphs():
    """The op and the attention function compiled (fullgraph, mode "reduce-overhead"): each
    replay gives the eager bits, as the mask and the query change between replays."""
    _need_cuda()
    from quantmesh.infer import attention as A

    q0, k, v = _cache(4, 8, torch.bfloat16, seed=1)
    module = torch.nn.Module()
    module.num_key_value_groups = 4

    def fn(q, mask):
        return A.decode_attention_forward(module, q, k, v, mask, scaling=D**-0.5)[0]

    before = A.ENABLED, A.MAX_ROWS
    A.ENABLED, A.MAX_ROWS = True, None  # four rows: the kernel at any batch (its wiring)
    try:
        step = torch.compile(fn, fullgraph=True, mode="reduce-overhead")
        for i in range(5):
            q = torch.randn_like(q0)
            mask = (torch.arange(L, device="cuda") < FILLED + i)[None, None, None, :]
            got = step(q, mask).clone()
            assert torch.equal(got, A.decode_attention_op(q, k, v, mask, D**-0.5)), i
            _check(got, _reference(q, k, v, mask, D**-0.5), torch.bfloat16, i)
    finally:
        A.ENABLED, A.MAX_ROWS = before


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_step_with_the_kernel_is_the_sdpa_step(dtype):
    """A small Llama (grouped-query attention, two rows, one left-padded): the decode step as
    fast_decode compiles it (reduce-overhead) inside `decode_attention(model)` with the switch on,
    fed the tokens of the eager sdpa steps, gives their logits as closely as the same step
    compiled with sdpa does (the control: a compiled step's bf16 sums run in another order than
    the eager ones, 2-7% of the logits' norm on this random model in bf16), and the kernel ran,
    one launch a layer in the warm-up call."""
    _need_cuda()
    from quantmesh.infer import attention as A
    from quantmesh.infer.decode import _Decoder
    from tests.models import llama

    model = llama(heads=8, kv_heads=2, head_dim=64, vocab=1024, layers=4, tie=False, seed=3)
    model.config.max_position_embeddings = 1024
    model.config._attn_implementation = "sdpa"
    model = model.to(device="cuda", dtype=dtype)
    g = torch.Generator().manual_seed(5)
    prompt = 40
    ids = torch.randint(0, 1024, (2, prompt), generator=g).cuda()
    mask = torch.ones(2, prompt, dtype=torch.long, device="cuda")
    mask[1, :9] = 0
    full = torch.ones(2, L, dtype=torch.long, device="cuda")
    full[:, :prompt] = mask
    pos = (mask.cumsum(1) - 1).clamp(min=0)[:, -1:] + 1
    launches = [0]
    real = A.launch_decode_attention

    def counted(*args, **kw):
        launches[0] += 1
        return real(*args, **kw)

    ref = _Decoder(model, 2, L, compile=False, mode=None, padded=True)
    dec = _Decoder(model, 2, L, compile=False, mode=None, padded=True)
    step = torch.compile(dec.logits, fullgraph=True, mode="reduce-overhead")
    ctl = _Decoder(model, 2, L, compile=False, mode=None, padded=True)  # compiled, sdpa
    ctl_step = torch.compile(ctl.logits, fullgraph=True, mode="reduce-overhead")
    before = A.ENABLED, A.MAX_ROWS
    A.ENABLED, A.MAX_ROWS = True, None  # two rows: the kernel at any batch (its wiring)
    A.launch_decode_attention = counted
    rel, ctl_rel = [], []
    try:
        with torch.no_grad():
            tok = ref.prefill(ids, (full, (mask.cumsum(1) - 1).clamp(min=0))).argmax(-1)[:, None]
            dec.prefill(ids, (full, (mask.cumsum(1) - 1).clamp(min=0)))
            ctl.prefill(ids, (full, (mask.cumsum(1) - 1).clamp(min=0)))
            for i in range(24):
                want = ref.logits(tok, attention_mask=full, position_ids=pos).float()
                with A.decode_attention(model):
                    got = step(tok, attention_mask=full, position_ids=pos).float().clone()
                if i == 0:
                    assert launches[0] == 4  # the first (warm-up) call: one a layer
                A.ENABLED = False  # the control: sdpa, outside the context
                base = ctl_step(tok, attention_mask=full, position_ids=pos).float().clone()
                A.ENABLED = True
                rel.append(float((got - want).norm() / want.norm()))
                ctl_rel.append(float((base - want).norm() / want.norm()))
                tok, pos = want.argmax(-1)[:, None], pos + 1
    finally:
        A.ENABLED, A.MAX_ROWS = before
        A.launch_decode_attention = real
    assert model.config._attn_implementation == "sdpa"
    bound = 2 * max(ctl_rel) + (2e-3 if dtype == torch.bfloat16 else 4e-4)
    assert max(rel) <= bound, (rel, ctl_rel)
