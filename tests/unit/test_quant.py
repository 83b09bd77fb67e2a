"""The quantized formats (bitsandbytes nf4 / fp4 / int8, torchao nf4 / int8) on CPU.

Each format is checked against its own dequantized weight and against the reference module built the
way its library documents; shards are checked against quantize-full-then-slice.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

from quantmesh.quant.base import QuantConfig, QuantError, get_format
from quantmesh.quant.kinds import check_quantizable, compute_dtype_for, quantizable

CONFIGS = {
    "bnb-nf4": dict(format="nf4"),
    "bnb-nf4-nodq": dict(format="nf4", double_quant=False),
    "bnb-fp4": dict(format="fp4"),
    "bnb-int8": dict(format="int8"),
    "ao-nf4": dict(format="nf4", backend="torchao"),
    "ao-int8": dict(format="int8", backend="torchao"),
}
OUT, IN = 64, 128  # 8192 elements: 128 blocks of 64


def _fmt(key: str, **kw):
    return get_format(QuantConfig(**CONFIGS[key], **kw))


def _quantized(key: str, device: str = "cpu", bias: bool = True, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    fmt = _fmt(key)
    w = torch.randn(OUT, IN, generator=g) * 0.05
    m = fmt.new_linear(IN, OUT, bias=bias, device=device, dtype=torch.float32)
    fmt.quantize_into(m, w)
    if bias:
        m.bias = nn.Parameter(torch.randn(OUT, generator=g) * 0.1)
    return fmt, m, w


def _x(seed: int = 1, n: int = 5) -> torch.Tensor:
    return torch.randn(n, IN, generator=torch.Generator().manual_seed(seed))


# ---- forward and gradients against the dequantized weight ---------------------------------------
@pytest.mark.parametrize("key", list(CONFIGS))
@pytest.mark.parametrize("training", [True, False])
def test_inputs_of_any_rank_give_their_rows_outputs(key, training):
    """A quantized linear maps the last dim of a 4-D input as it maps the rows of a 2-D one
    (bitsandbytes' int8 matmul flattened 3-D inputs only: DeepSeek-V3's decode failed)."""
    _, m, _ = _quantized(key)
    m.train(training)
    x = _x(n=12)
    with torch.no_grad():
        flat = m(x)
        deep = m(x.view(2, 1, 6, IN))
    assert deep.shape == (2, 1, 6, OUT)
    torch.testing.assert_close(deep.reshape(12, OUT), flat, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("key", ["bnb-nf4", "bnb-nf4-nodq", "bnb-fp4", "ao-nf4", "ao-int8"])
def test_forward_matches_dequantized(key):
    fmt, m, _ = _quantized(key)
    x = _x()
    w = fmt.dequantize(m).float()
    assert w.shape == (OUT, IN)
    # same dequantized fp32 weight: only the summation order (addmm vs matmul + add) may differ
    torch.testing.assert_close(m(x), x @ w.T + m.bias, rtol=1e-5, atol=1e-6)
    y16 = m(x.to(torch.bfloat16))  # computed in fp32 (the CPU default), returned in bf16
    assert y16.dtype == torch.bfloat16


# relative Frobenius error of the dequantized weight on Gaussian weights; measured on 4096 x 4096:
# nf4 0.092, fp4 0.122, int8 0.0087; the bounds leave ~25% headroom for a small 64 x 128 sample
REL_ERR = {"nf4": 0.12, "fp4": 0.15, "int8": 0.012}


@pytest.mark.parametrize("key", list(CONFIGS))
def test_dequantize_is_close_to_the_weight(key):
    fmt, m, w = _quantized(key)
    rel = (fmt.dequantize(m).float() - w).norm() / w.norm()
    assert rel < REL_ERR[fmt.config.format], float(rel)


def test_blocksize_is_used():
    fmt = get_format(QuantConfig(format="nf4", blocksize=128, double_quant=False))
    m = fmt.new_linear(IN, OUT, bias=False, device="cpu", dtype=torch.float32)
    fmt.quantize_into(m, torch.randn(OUT, IN))
    qs = m.weight.quant_state
    assert qs.blocksize == 128 and qs.absmax.numel() == OUT * IN // 128 and fmt.block_elems() == 128


def test_int8_forward_train_and_eval():
    fmt, m, _ = _quantized("bnb-int8")
    x = _x()
    w = fmt.dequantize(m)
    ref = x @ w.T + m.bias
    m.train()  # CPU train mode: dequantize + fp matmul (bitsandbytes ignores the threshold here)
    torch.testing.assert_close(m(x), ref, rtol=1e-5, atol=1e-5)
    m.eval()  # LLM.int8: activations quantized per row to int8 (step absmax/127), fp16 cast
    err = (m(x) - ref).abs()
    bound = (x.abs().amax(-1, keepdim=True) / 254 + x.abs() * 1e-3) @ w.abs().T + 1e-4
    assert (err <= bound).all(), float((err - bound).max())


@pytest.mark.parametrize("key", list(CONFIGS))
def test_input_grads_after_eval_no_grad_forward(key):
    fmt, m, _ = _quantized(key)
    m.eval()
    with torch.no_grad():  # bitsandbytes' avx512-bf16 repack would trigger here and drop grads
        m(_x())
    w = fmt.dequantize(m).float()
    g = torch.randn(5, OUT, generator=torch.Generator().manual_seed(3))
    for train in (False, True):
        m.train(train)
        x = _x().requires_grad_(True)
        m(x).backward(g)
        assert x.grad is not None, f"no input gradient (train={train})"
        # grad_x = g @ W with the same dequantized weight; fp32 summation order only
        torch.testing.assert_close(x.grad, g @ w, rtol=1e-4, atol=1e-5)
    assert not m.weight.requires_grad


# ---- against the reference modules built the libraries' usual way --------------------------------
@pytest.mark.parametrize("key", ["bnb-nf4", "bnb-nf4-nodq", "bnb-fp4"])
def test_4bit_matches_stock_linear4bit(key):
    import bitsandbytes as bnb

    fmt, m, w = _quantized(key)
    cfg = fmt.config
    lin = nn.Linear(IN, OUT)
    lin.weight.data, lin.bias.data = w.clone(), m.bias.detach().clone()
    ref = bnb.nn.Linear4bit(IN, OUT, compute_dtype=torch.float32, quant_type=cfg.format,
                            compress_statistics=cfg.double_quant)  # fmt: skip
    ref.load_state_dict(lin.state_dict())
    ref = ref.to("cpu")  # bitsandbytes quantizes on this .to()
    ref.support_avx512bf16_for_cpu = False  # same kernel path as ours; see the grads test
    assert torch.equal(ref.weight.data, m.weight.data)  # packed codes, bit for bit
    assert torch.equal(ref.weight.quant_state.absmax, m.weight.quant_state.absmax)
    x = _x()
    assert torch.equal(ref(x), m(x))


def test_int8_matches_stock_linear8bitlt():
    import bitsandbytes as bnb

    fmt, m, w = _quantized("bnb-int8")
    lin = nn.Linear(IN, OUT)
    lin.weight.data, lin.bias.data = w.clone(), m.bias.detach().clone()
    ref = bnb.nn.Linear8bitLt(IN, OUT, has_fp16_weights=False, threshold=6.0)
    ref.load_state_dict(lin.state_dict())
    ref = ref.to("cpu")
    assert torch.equal(ref.weight.data, m.weight.data) and torch.equal(ref.weight.SCB, m.weight.SCB)
    x = _x()
    x[:, 7] = 20.0  # an outlier column above the threshold: the mixed fp16 path runs
    for train in (False, True):
        ref.train(train), m.train(train)
        assert torch.equal(ref(x), m(x)), f"train={train}"


def test_torchao_matches_torchao_reference():
    from quantmesh.quant.torchao import _ao

    fmt, m, w = _quantized("ao-nf4", bias=False)
    # 128 blocks of 64 -> scaler block 128 (largest power of two <= 256 dividing the block count)
    ref = _ao()["to_nf4"](w, 64, 128)
    x = _x()
    assert torch.equal(nn.functional.linear(x, ref), m(x))
    assert torch.equal(ref.get_original_weight(), fmt.dequantize(m))

    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    fmt, m, w = _quantized("ao-int8", bias=False)
    lin = nn.Linear(IN, OUT, bias=False)
    lin.weight.data = w.clone()
    quantize_(lin, Int8WeightOnlyConfig(set_inductor_config=False))
    assert torch.equal(lin.weight.dequantize(), fmt.dequantize(m))
    torch.testing.assert_close(lin(x), m(x), rtol=1e-5, atol=1e-6)  # same int8 weight and scales


# ---- shards against quantize-full-then-slice -----------------------------------------------------
def _q4(w: torch.Tensor, dq: bool):
    import bitsandbytes.functional as F

    return F.quantize_4bit(w.contiguous(), blocksize=64, compress_statistics=dq, quant_type="nf4")


def test_nf4_shard_equals_full_then_slice():
    """Without double quant a block-aligned shard is bit-identical (codes and absmax) to the same
    slice of the fully quantized weight, for row (colwise) and column (rowwise) splits. With double
    quant the codes are still identical, but the absmax statistics are re-quantized around the
    shard's own mean, so dequantized values agree only within the 8-bit absmax error."""
    import bitsandbytes.functional as F

    w = torch.randn(256, 512, generator=torch.Generator().manual_seed(0))
    p, qs = _q4(w, dq=False)
    rows = p.view(256, 256)  # (out, in/2) bytes
    amax = qs.absmax.view(256, 8)  # (out, in/64) blocks
    for r0, r1 in [(0, 128), (128, 256), (40, 90)]:  # rows x 512 elements: always block aligned
        ps, qss = _q4(w[r0:r1], dq=False)
        assert torch.equal(ps.view(-1), rows[r0:r1].reshape(-1))
        assert torch.equal(qss.absmax, amax[r0:r1].reshape(-1))
    for c0, c1 in [(0, 256), (256, 512), (64, 192)]:  # column shards of whole blocks
        ps, qss = _q4(w[:, c0:c1], dq=False)
        assert torch.equal(ps.view(-1), rows[:, c0 // 2 : c1 // 2].reshape(-1))
        assert torch.equal(qss.absmax, amax[:, c0 // 64 : c1 // 64].reshape(-1))

    pn, qn = _q4(w, dq=True)
    exact = F.dequantize_4bit(p, qs)  # fp32 absmax: the reference both are compared with
    full = F.dequantize_4bit(pn, qn)
    for sl in [(slice(0, 128), slice(None)), (slice(None), slice(256, 512))]:
        ps, qss = _q4(w[sl], dq=True)
        assert torch.equal(ps.view(-1), _q4(w, dq=False)[0].view(256, 256)[sl[0], _half(sl[1])]
                           .reshape(-1))  # fmt: skip
        # the 8-bit dynamic absmax code is within ~0.75% of the true absmax (measured); each
        # element is code * absmax, so two such quantizations differ by at most ~1.5% relatively
        diff = (F.dequantize_4bit(ps, qss) - full[sl]).abs()
        assert (diff <= 0.02 * exact[sl].abs() + 1e-7).all()


def _half(s: slice) -> slice:
    return slice(None if s.start is None else s.start // 2, None if s.stop is None else s.stop // 2)


def test_int8_row_shard_is_exact():
    # one scale per output row: a row (colwise) shard is exact; a column shard is not (new scales)
    fmt, m, w = _quantized("bnb-int8", bias=False)
    part = fmt.new_linear(IN, 24, bias=False, device="cpu", dtype=torch.float32)
    fmt.quantize_into(part, w[8:32])
    assert torch.equal(part.weight.data, m.weight.data[8:32])
    assert torch.equal(fmt.dequantize(part), fmt.dequantize(m)[8:32])


# ---- memory, meta, errors ------------------------------------------------------------------------
def _stat_bytes(key: str, m: nn.Module) -> int:
    """Bytes of the weight and its per-block / per-row statistics (not per-tensor constants)."""
    nb = lambda t: t.numel() * t.element_size()  # noqa: E731
    if key.startswith("bnb") and key != "bnb-int8":
        qs = m.weight.quant_state
        return nb(m.weight.data) + nb(qs.absmax) + (nb(qs.state2.absmax) if qs.nested else 0)
    if key == "bnb-int8":
        return nb(m.weight.data) + nb(m.weight.SCB)
    if key == "ao-nf4":
        t = m.weight
        return nb(t.quantized_data) + nb(t.quantized_scalers) + nb(t.quantization_factor)
    return nb(m.weight) + nb(m.weight_scale)


@pytest.mark.parametrize("key", list(CONFIGS))
def test_bytes_per_param_matches_tensors(key):
    fmt = _fmt(key)
    out, inp = 256, 512  # 2048 blocks of 64 = 8 whole nested blocks of 256
    m = fmt.new_linear(inp, out, bias=False, device="cpu", dtype=torch.float32)
    fmt.quantize_into(m, torch.randn(out, inp))
    assert _stat_bytes(key, m) == pytest.approx(fmt.bytes_per_param(in_features=inp) * out * inp)
    assert 0.5 < fmt.bytes_per_param() < 1.01


@pytest.mark.parametrize("key", list(CONFIGS))
def test_meta_then_quantize_into(key):
    fmt = _fmt(key)
    m = fmt.new_linear(IN, OUT, bias=True, device="meta", dtype=torch.float32)
    assert m.bias.is_meta
    with pytest.raises(RuntimeError, match="no quantized weight yet"):
        m(torch.randn(2, IN, device="meta"))
    w = torch.randn(OUT, IN) * 0.05
    fmt.quantize_into(m, w)
    assert m.weight.device.type == "cpu" and m.bias.device.type == "cpu"
    b = torch.randn(OUT)
    m.bias.data = b  # both ways of loading the bias work once the module is real
    x = _x()
    y1 = m(x)
    m.bias = nn.Parameter(b.clone())
    torch.testing.assert_close(m(x), y1, rtol=0, atol=0)
    torch.testing.assert_close(y1 - b, m(x) - m.bias, rtol=0, atol=0)
    c = copy.deepcopy(m)  # deepcopy keeps the quantized weight exactly
    assert torch.equal(c(x), y1) and torch.equal(fmt.dequantize(c), fmt.dequantize(m))


def test_quantize_into_checks_the_shard():
    fmt = _fmt("bnb-nf4")
    m = fmt.new_linear(IN, OUT, bias=False, device="cpu", dtype=torch.float32)
    with pytest.raises(ValueError, match=r"shape \(128, 64\), expected \(out, in\) = \(64, 128\)"):
        fmt.quantize_into(m, torch.randn(IN, OUT))
    with pytest.raises(QuantError, match=r"holds 8200 elements, not a multiple of blocksize 64"):
        _fmt("ao-nf4").new_linear(100, 82, bias=False, device="meta", dtype=torch.float32)


def test_check_quantizable_messages():
    with pytest.raises(QuantError) as e:
        check_quantizable("model.conv1", nn.Conv2d(3, 8, 3))
    assert str(e.value) == (
        "model.conv1 is a Conv2d; bitsandbytes quantizes only linear layers (nn.Linear, "
        'transformers\' Conv1D); add it to QuantConfig(skip=["model.conv1"])'
    )
    with pytest.raises(QuantError, match=r"^emb is an Embedding; torchao quantizes only"):
        check_quantizable("emb", nn.Embedding(10, 4), backend="torchao")
    mha = nn.MultiheadAttention(8, 2)
    with pytest.raises(QuantError, match="output projection of an nn.MultiheadAttention"):
        check_quantizable("attn.out_proj", mha.out_proj)
    _, q, _ = _quantized("bnb-nf4", device="meta")
    assert not quantizable(q)
    assert quantizable(nn.Linear(4, 4)) and not quantizable(nn.LayerNorm(4))
    conv1d = pytest.importorskip("transformers.pytorch_utils").Conv1D
    assert quantizable(conv1d(8, 4))
    check_quantizable("h.0.attn.c_attn", conv1d(8, 4))
    assert compute_dtype_for(QuantConfig(), "cuda") == torch.bfloat16
    assert compute_dtype_for(QuantConfig(compute_dtype=torch.float16), "cpu") == torch.float16


def test_config_validation_messages():
    cases = [
        (dict(format="int4"), "quant format 'int4' is unknown; use one of nf4, fp4, int8"),
        (dict(backend="hqq"), "quant backend 'hqq' is unknown; use one of bitsandbytes, torchao"),
        (dict(format="fp4", backend="torchao"), "torchao has no fp4 format here"),
        (dict(blocksize=48), "blocksize=48; use a power of two from 32 to 4096"),
    ]
    for kw, msg in cases:
        with pytest.raises(QuantError, match=msg):
            QuantConfig(**kw)
    with pytest.raises(QuantError, match="always quantizes its block scales"):
        get_format(QuantConfig(backend="torchao", double_quant=False))
    assert QuantConfig(skip=["*.mlp.down_proj"]).skips("model.layers.3.mlp.down_proj")
    assert QuantConfig().skips("lm_head") and not QuantConfig().skips("model.lm_head_norm")


# ---- CUDA: the same code path on the GPU machine (skipped elsewhere) -----------------------------
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("key", list(CONFIGS))
def test_cuda_meta_quantize_forward_grads_and_moves(key):
    fmt = _fmt(key)
    w = torch.randn(OUT, IN, generator=torch.Generator().manual_seed(0)) * 0.05
    m = fmt.new_linear(IN, OUT, bias=True, device="meta", dtype=torch.bfloat16)
    fmt.quantize_into(m, w.to("cuda", torch.bfloat16))  # the loader's bf16 shard, on the GPU
    m.bias = nn.Parameter(torch.randn(OUT, device="cuda", dtype=torch.bfloat16))
    assert m.weight.device.type == "cuda"
    x = _x().to("cuda", torch.bfloat16)
    m.eval()
    with torch.no_grad():
        m(x)
    m.train()
    xg = x.clone().requires_grad_(True)
    y = m(xg)
    y.float().sum().backward()
    wd = fmt.dequantize(m).float()
    assert y.dtype == torch.bfloat16 and xg.grad is not None
    # bf16 compute (the CUDA default): 8 mantissa bits, |y| ~ 1 -> ~1e-2 absolute; int8 (LLM.int8
    # on CUDA also in train mode) adds activation quantization, step absmax/127 per row
    tol = 0.1 if key == "bnb-int8" else 3e-2
    torch.testing.assert_close(y.float(), x.float() @ wd.T + m.bias.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(xg.grad.float(), wd.sum(0).expand(5, IN), rtol=3e-2, atol=3e-2)
    # module moves keep the quantized state usable (bitsandbytes keeps stats beside the weight)
    c = fmt.new_linear(IN, OUT, bias=False, device="cpu", dtype=torch.float32)
    fmt.quantize_into(c, w)
    y_cpu = c(_x())
    c.to("cuda")
    y_gpu = c(_x().to("cuda")).float().cpu()
    tol = 0.1 if key == "bnb-int8" else 3e-2  # CPU fp32 vs CUDA bf16 compute (int8: LLM.int8)
    torch.testing.assert_close(y_gpu, y_cpu, rtol=tol, atol=tol)
    c.to("cpu")
    torch.testing.assert_close(c(_x()), y_cpu, rtol=0, atol=0)


def _nf4_cpu_linear(in_f: int, out_f: int) -> nn.Module:
    """An nf4 linear with a bias on CPU, its weight quantized from seeded random values."""
    fmt = get_format(QuantConfig(format="nf4"))
    m = fmt.new_linear(in_f, out_f, bias=True, device="cpu", dtype=torch.float32)
    fmt.quantize_into(m, torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(0)))
    return m


def _stays_off_on_cpu(flag: str, applies, m, x: torch.Tensor) -> None:
    """With kernel4's switch `flag` on, `applies` refuses `x` (a CPU tensor) and the nf4 linear
    `m` gives the same output as with it off; the switch is restored after."""
    from quantmesh.quant import kernel4 as k4

    with torch.no_grad():
        ref = m(x)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(k4, flag, True)
            assert not applies(x, m.weight.quant_state, torch.bfloat16)  # a CPU tensor
            assert torch.equal(m(x), ref)


def test_few_row_kernel_is_opt_in_and_cuda_only():
    """quant/kernel4.py: off by default, and never on CPU, in training or past 64 rows, where the
    QuantLinear4bit keeps bitsandbytes' path (its output unchanged by turning the kernel on)."""
    from quantmesh.quant import kernel4 as k4

    m = _nf4_cpu_linear(64, 32)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    assert k4.ENABLED is False
    assert not k4.rows_kernel_applies(x, m.weight.quant_state, torch.bfloat16)
    _stays_off_on_cpu("ENABLED", k4.rows_kernel_applies, m, x)
    assert k4.choose_config(1)["DOT"] == 0 and k4.choose_config(64)["DOT"] == 1


def test_gemv_is_opt_in_cuda_only_and_refuses_what_it_cannot_compute():
    """kernel4's gemv (1 to GEMV_MAX_ROWS rows): on unless QUANTMESH_GEMV=0, never on CPU
    (QuantLinear4bit's output unchanged by turning it on there); its tiles cut K so that a grid
    holds about GEMV_WARPS warps (the 7B shapes: the shares the GPU sweep found fastest); and a
    call it cannot compute is refused with the reason before any launch."""
    from quantmesh.quant import kernel4 as k4

    assert k4.GEMV_ENABLED is (os.environ.get("QUANTMESH_GEMV") != "0")
    m = _nf4_cpu_linear(64, 32)
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(1))
    _stays_off_on_cpu("GEMV_ENABLED", k4.gemv_applies, m, x)
    old = dict(BLOCK_N=32, LUT=1, num_warps=1, num_stages=1)  # one feature a thread
    assert k4.gemv_config(1, 4096, 4096, 64, old)["BLK"] == 6  # 128 groups x 11 shares
    assert k4.gemv_config(1, 11008, 4096, 64, old)["BLK"] == 16  # 344 groups x 4 shares
    assert k4.gemv_config(1, 4096, 11008, 64, old)["BLK"] == 15  # 128 groups x 12 shares
    assert k4.gemv_config(1, 64, 128, 64, old)["BLK"] == 1  # a small weight: a share a block
    lines = dict(KERNEL="lines", BLOCK_N=8, LUT=1, num_warps=1)  # shares: strides of 32 blocks
    assert k4.gemv_config(1, 4096, 4096, 64, lines)["BLK"] == 32  # 512 groups x 2 shares
    assert k4.gemv_config(1, 11008, 4096, 64, lines)["BLK"] == 64  # 1,376 groups x 1 share
    assert k4.gemv_config(1, 4096, 11008, 64, lines)["BLK"] == 64  # 512 groups x 3 shares
    assert k4.gemv_config(1, 4096, 11008, 64, dict(lines, SB=16))["BLK"] == 64  # 11 strides
    assert k4.gemv_config(1, 64, 128, 64, lines)["BLK"] == 32  # one stride
    flat = torch.zeros(64 * 32, dtype=torch.uint8)
    stats = (torch.ones(32), None, None, None)
    tile = k4.gemv_config(1, 64, 128, 64)
    bf = torch.bfloat16
    # more rows: the tile of the power of two at or above them; past the limit, refused
    assert k4.gemv_config(3, 64, 128, 64)["SB"] == k4.GEMV_ROW_TILES[4]["SB"]
    assert k4.gemv_config(13, 64, 128, 64)["BLOCK_N"] == k4.GEMV_ROW_TILES[16]["BLOCK_N"]
    assert sorted(k4.GEMV_ROW_TILES) == [1, 2, 4, 8, 16] == [2**i for i in range(5)]
    assert k4.GEMV_ROWS_LIMIT == 16 and k4.GEMV_MAX_ROWS <= k4.GEMV_ROWS_LIMIT
    with pytest.raises(ValueError, match="1 to 16 rows"):
        k4.gemv_config(17, 64, 128, 64)
    cases = [
        (torch.zeros(17, 128, dtype=bf), 64, tile, "1 to 16 row"),
        (torch.zeros(2, 128, dtype=bf), 64, dict(old, BLOCK_N=32), "takes one row"),
        (torch.zeros(1, 128, dtype=bf), 128, tile, "blocksize 64"),
        (torch.zeros(1, 96, dtype=bf), 64, tile, "a multiple of 64"),
        (torch.zeros(1, 128), 64, tile, "bf16 or fp16"),
        (torch.zeros(1, 128, dtype=bf), 64, dict(old, BLOCK_N=64), "one feature a thread"),
        (torch.zeros(1, 128, dtype=bf), 64, dict(tile, SB=12), "strides"),
        (torch.zeros(1, 128, dtype=bf), 64, dict(tile, WK=2), "must be its num_warps"),
        (torch.zeros(1, 128, dtype=bf), 64, dict(tile, SB=4, WK=2, num_warps=2), "SB a multiple"),
    ]
    for xx, bs, cfg, why in cases:
        with pytest.raises(ValueError, match=why):
            k4.launch_gemv(xx, flat, *stats, bs, "nf4", 64, cfg)


def test_mma_kernel_is_on_cuda_only_and_refuses_what_it_cannot_compute():
    """kernel4's tensor-core kernel (MMA_MIN_ROWS to MMA_MAX_ROWS rows): on unless
    QUANTMESH_MMA=0, never on CPU (QuantLinear4bit's output unchanged by turning it on there),
    tried after the gemv; its tiles take the rows' power of two (at least 16) and cut K so that
    a grid holds about MMA_PROGRAMS programs; a call it cannot compute is refused with the
    reason before any launch."""
    from quantmesh.quant import bnb as qb
    from quantmesh.quant import kernel4 as k4

    assert k4.MMA_ENABLED is (os.environ.get("QUANTMESH_MMA") != "0")
    m = _nf4_cpu_linear(64, 32)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    _stays_off_on_cpu("MMA_ENABLED", k4.mma_applies, m, x)
    order = [applies for applies, _ in qb._KERNELS]
    assert order.index(k4.gemv_applies) < order.index(k4.mma_applies)
    assert k4.MMA_MIN_ROWS == k4.GEMV_MAX_ROWS + 1 and k4.MMA_MAX_ROWS == 64
    for rows, bm in ((1, 16), (9, 16), (16, 16), (17, 32), (33, 64), (64, 64)):
        assert k4.mma_config(rows, 4096, 4096)["BLOCK_M"] == bm
    for shape, blk in (((4096, 4096), 8), ((11008, 4096), 22), ((4096, 11008), 22),
                       ((64, 128), 2)):  # fmt: skip
        cfg = k4.mma_config(32, *shape)
        shares = -(-(shape[1] // 64) // cfg["BLK"])
        assert cfg["BLK"] == blk and cfg["BLK"] % cfg["NB"] == 0, (shape, cfg)
        groups = -(-shape[0] // cfg["BLOCK_N"])
        assert shares == 1 or groups * shares <= 2 * k4.MMA_PROGRAMS, (shape, cfg)
    assert k4.mma_config(32, 4096, 4096, dict(k4.MMA_TILE, BLK=4))["BLK"] == 4  # the tile's own
    assert k4.mma_config(32, 4096, 4096, dict(k4.MMA_TILE, BLK=0))["BLK"] == 0  # one share
    with pytest.raises(ValueError, match="1 to 64 rows"):
        k4.mma_config(65, 64, 128)
    flat = torch.zeros(64 * 32, dtype=torch.uint8)
    stats = (torch.ones(32), None, None, None)
    tile = k4.mma_config(16, 64, 128)
    bf = torch.bfloat16
    cases = [
        (torch.zeros(17, 128, dtype=bf), 64, dict(tile, NB=1, BLK=1), "K in one share"),
        (torch.zeros(0, 128, dtype=bf), 64, tile, "at least 1 row"),
        (torch.zeros(16, 128, dtype=bf), 128, tile, "blocksize 64"),
        (torch.zeros(16, 96, dtype=bf), 64, tile, "a multiple of 64"),
        (torch.zeros(16, 128), 64, tile, "bf16 or fp16"),
        (torch.zeros(16, 128, dtype=bf), 64, dict(tile, BLOCK_N=48), "powers of two"),
        (torch.zeros(16, 128, dtype=bf), 64, dict(tile, BLOCK_N=8), "at least 16"),
        (torch.zeros(16, 128, dtype=bf), 64, dict(tile, NB=4, BLK=2), "a multiple of NB"),
    ]
    for xx, bs, cfg, why in cases:
        with pytest.raises(ValueError, match=why):
            k4.launch_mma(xx, flat, *stats, bs, "nf4", 64, cfg)


def test_dequant_kernel_is_opt_in_and_cuda_only_and_inputs_are_flattened():
    """kernel4's dequantize (many rows; training; weights dequantized whole): off by default,
    never on CPU, with autograd or without (QuantLinear4bit's output and input gradient, and a
    whole weight, unchanged by turning it on there);
    and a 3-D input whose strides do not fold into (rows, in) (one position per row, as an
    attention output reaches o_proj) gives what its contiguous copy gives, row for row."""
    from quantmesh.quant import kernel4 as k4

    m = _nf4_cpu_linear(128, 32)
    qs = m.weight.quant_state
    heads = torch.randn(16, 4, 1, 32, generator=torch.Generator().manual_seed(1))
    x = heads.transpose(1, 2).reshape(16, 1, 128)  # strides (128, 32, 1): not a plain view
    # off unless QUANTMESH_TRITON_DEQUANT=1 was set when kernel4 was imported
    assert k4.DEQUANT_ENABLED is (os.environ.get("QUANTMESH_TRITON_DEQUANT") == "1")
    assert k4.DEQUANT_TRAINING is (os.environ.get("QUANTMESH_TRITON_DEQUANT_TRAINING") == "1")
    _stays_off_on_cpu("DEQUANT_ENABLED", k4.dequant_kernel_applies, m, x)
    _stays_off_on_cpu("DEQUANT_TRAINING", k4.dequant_kernel_applies, m, x)
    xg = x.detach().clone().requires_grad_()
    r = torch.randn(16, 1, 32, generator=torch.Generator().manual_seed(2))
    grads = []
    for on in (False, True):  # autograd recording (training): the CPU keeps bitsandbytes' path
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(k4, "DEQUANT_ENABLED", on)
            mp.setattr(k4, "DEQUANT_TRAINING", on)
            assert not k4.dequant_kernel_applies(xg, qs, torch.bfloat16)
            xg.grad = None
            (m(xg) * r).sum().backward()
            grads.append(xg.grad)
    assert torch.equal(grads[0], grads[1])
    fmt = get_format(QuantConfig(format="nf4"))  # a weight dequantized whole (the experts')
    whole = fmt.compute_weight(m)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(k4, "DEQUANT_ENABLED", True)
        mp.setattr(k4, "DEQUANT_TRAINING", True)
        assert not k4.dequantize_weight_applies(m.weight, "nf4", whole.numel(), whole.dtype)
        assert torch.equal(fmt.compute_weight(m), whole)
    with torch.no_grad():
        y = m(x)
        assert y.shape == (16, 1, 32)
        torch.testing.assert_close(y, m(x.contiguous()), rtol=0, atol=0)
        torch.testing.assert_close(y[:, 0], m(x[:, 0].contiguous()), rtol=0, atol=0)


def test_env_switches_refuse_a_value_they_do_not_know():
    """An on/off environment variable (QUANTMESH_TRITON_DEQUANT, QUANTMESH_FORK_WORKERS) takes 1 or
    0, or nothing for its default: another value is refused, by name, instead of being read as
    either."""
    from quantmesh.config import ConfigError, env_switch

    for value, default, want in (("1", False, True), ("0", True, False), ("", False, False),
                                 ("", True, True)):  # fmt: skip
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("QUANTMESH_TRITON_DEQUANT", value)
            assert env_switch("QUANTMESH_TRITON_DEQUANT", default) is want
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QUANTMESH_FORK_WORKERS", "yes")
        with pytest.raises(ConfigError, match=r"QUANTMESH_FORK_WORKERS='yes'; expected 1 \(on\)"):
            env_switch("QUANTMESH_FORK_WORKERS", True)


@pytest.mark.parametrize("key", list(CONFIGS))
def test_compute_units_equals_the_whole_weights_rows(key):
    # 4 experts of 16 rows (an (E*a, b) expert store): some of them, in the order asked
    fmt, m, _ = _quantized(key, bias=False)
    whole = fmt.compute_weight(m).view(4, 16, IN)
    for idx in ([2], [0, 3], [1, 2, 3], [0, 1, 2, 3]):
        got = fmt.compute_units(m, 4, torch.tensor(idx))
        assert got.shape == (16 * len(idx), IN)
        assert torch.equal(got.view(len(idx), 16, IN), whole[idx]), (key, idx)


@pytest.mark.parametrize("key", ["bnb-nf4", "bnb-fp4"])
def test_kept_dequantized_weight_multiplies_many_rows_and_every_row_under_autograd(key):
    """keep_dequantized: 2+ rows without autograd, and any rows under autograd, multiply the held
    weight (bitsandbytes' own dequantize), giving what the codes' path gives; one row without
    autograd keeps the codes' path."""
    from quantmesh.parallel.held import dequantized_bytes, keep_dequantized

    fmt, m, _ = _quantized(key)
    x = _x()
    with torch.no_grad():
        ref_many, ref_one = m(x), m(x[:1])
    model = [nn.Linear(2, 2), m]  # the 4-bit ones among any layers
    assert dequantized_bytes(model, torch.float32) == OUT * IN * 4
    assert keep_dequantized(model, torch.float32) == OUT * IN * 4
    assert torch.equal(m.dense, fmt.dequantize(m).float())
    with torch.no_grad():
        torch.testing.assert_close(m(x), ref_many, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(m(x[:1]), ref_one, rtol=0, atol=0)  # the codes' path itself
        m.dense.zero_()  # which path ran: the held weight is zeros now, the bias alone is left
        assert torch.equal(m(x), m.bias.expand(5, OUT))
        assert not torch.equal(m(x[:1]), m.bias[None])
    xg = x[:1].clone().requires_grad_(True)
    y = m(xg)  # autograd, even one row: the held weight (zeros), forward and backward
    assert torch.equal(y, m.bias[None])
    y.sum().backward()
    assert xg.grad is not None and torch.equal(xg.grad, torch.zeros_like(xg))
    assert keep_dequantized(model, None) == 0 and m.dense is None
    xg.grad = None
    m(xg).sum().backward()  # no longer held: the codes
    assert xg.grad.abs().sum() > 0


@pytest.mark.parametrize("key", ["bnb-nf4", "bnb-fp4"])
def test_training_on_the_held_weight_gives_the_codes_values(key):
    """Under autograd the held weight (in the compute dtype) gives the output and the input
    gradient that bitsandbytes' 4-bit matmul gives from the codes, bit for bit (CPU, fp32)."""
    from quantmesh.parallel.held import keep_dequantized

    _, m, _ = _quantized(key)
    x = _x().requires_grad_(True)
    g = torch.randn(5, OUT, generator=torch.Generator().manual_seed(3))
    y = m(x)
    (y * g).sum().backward()
    want, want_grad = y.detach(), x.grad.clone()
    assert keep_dequantized(m, torch.float32) == OUT * IN * 4  # a module: its 4-bit layers
    x.grad = None
    y = m(x)
    (y * g).sum().backward()
    assert torch.equal(y.detach(), want) and torch.equal(x.grad, want_grad)


def test_serve_keep_dequantized_refuses_a_model_without_4bit_layers():
    from quantmesh.cli.serve import _keep_dequantized
    from quantmesh.serve.engine import ServeError

    with pytest.raises(ServeError, match="no 4-bit linear layers .* --quant nf4"):
        _keep_dequantized(nn.Sequential(nn.Linear(4, 4)), torch.device("cpu"), torch.float32)
    _, m, _ = _quantized("bnb-nf4")
    _keep_dequantized(nn.Sequential(m), torch.device("cpu"), torch.float32)
    assert m.dense is not None and m.dense.shape == (OUT, IN)


def test_codes_ops_launch_directly_in_eager_mode_and_trace_as_one_op() -> None:
    """The matmul ops on codes (`kernel4._codes_op`): eagerly, on plain tensors, the launcher is
    called without the custom op's dispatch (which cost the host about as much as the launch);
    compiled, the op is traced whole; under fake tensors the op's fake gives the shape, and the
    launcher never runs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from quantmesh.quant import kernel4 as k4

    seen: list[tuple] = []

    def launch(x, packed, absmax, nested_absmax, nested_code, offset, bs, qt, out_f, cfg):
        seen.append((tuple(x.shape), cfg))
        return x.new_ones((x.shape[0], out_f))

    call = k4._codes_op("codes_op_under_test", launch, lambda rows, out_f, in_f, bs: {"rows": rows})
    x, packed, absmax = torch.randn(3, 8), torch.zeros(16, dtype=torch.uint8), torch.ones(1)
    args = (x, packed, absmax, None, None, None, 64, "nf4", 5)
    with torch.profiler.profile() as prof:
        y = call(*args)
    assert y.shape == (3, 5) and seen == [((3, 8), {"rows": 3})]
    ops = {ev.name for ev in prof.events()}
    assert "quantmesh::codes_op_under_test" not in ops, ops  # no dispatch
    with torch.profiler.profile() as prof:
        call.op(*args)  # the op itself, for comparison: the profiler sees it
    assert "quantmesh::codes_op_under_test" in {ev.name for ev in prof.events()}
    traced: list[list] = []

    def backend(gm: torch.fx.GraphModule, example: list) -> object:
        traced.append([n.target for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(lambda x: call(x, packed, absmax, None, None, None, 64, "nf4", 5) * 2,
                        backend=backend, fullgraph=True)(x)  # fmt: skip
    assert torch.equal(out, torch.full((3, 5), 2.0))
    assert torch.ops.quantmesh.codes_op_under_test.default in traced[0]
    seen.clear()
    with FakeTensorMode() as mode:
        fake = call(mode.from_tensor(x), *(mode.from_tensor(t) for t in (packed, absmax)),
                    None, None, None, 64, "nf4", 5)  # fmt: skip
    assert fake.shape == (3, 5) and not seen
