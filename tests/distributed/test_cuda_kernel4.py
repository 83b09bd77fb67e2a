"""quantmesh's 4-bit matmul for a few rows (quant/kernel4.py) against dequantize + matmul, on a GPU.

The reference is bitsandbytes' own `dequantize_4bit` (the bf16/fp16 weight it writes) times x,
summed in fp32; the kernel reads the same codes and statistics and must land within the rounding of
its output dtype (its error no larger than twice a plain matmul's on the same weight). Shapes: the
7B ones, odd ones (`in` not a multiple of the block, so blocks span rows; `out` not a multiple of
a tile), double-quant statistics and fp32 ones, blocksize 64 and 128, 1..64 rows, every tile
variant; shards cut from a quantized weight as tp cuts them (rows keep the 8-bit statistics,
columns get fp32 ones); and QuantLinear4bit taking the kernel only without autograd, inside a
torch.compile(fullgraph=True, mode="reduce-overhead") call (no graph break, CUDA graphs), once
turned on (it is opt-in: `kernel4.ENABLED`).
Marked cuda: runs on the GPU machine.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.cuda

ROWS = (1, 3, 17, 64)


def _need_cuda():
    if not torch.cuda.is_available():  # the marker deselects it in CI; run where a GPU is
        pytest.fail("marked cuda but no CUDA device")


def _quantized(out_f, in_f, nested, blocksize=64, quant_type="nf4", seed=0):
    import bitsandbytes.functional as F

    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(out_f, in_f, device="cuda", generator=g) * 0.02
    packed, qs = F.quantize_4bit(
        w, blocksize=blocksize, compress_statistics=nested, quant_type=quant_type
    )
    return packed, qs


def _errors(y, x, packed, qs, dtype):
    """(kernel error, plain matmul error), relative to the fp32 product of x and the weight as
    bitsandbytes dequantizes it."""
    import bitsandbytes.functional as F

    w = F.dequantize_4bit(packed, qs).to(dtype)  # (out, in) as bitsandbytes writes it
    ref = x.float() @ w.float().t()
    mm = x @ w.t()
    scale = ref.norm()
    return float((y.float() - ref).norm() / scale), float((mm.float() - ref).norm() / scale)


def _check(y, x, packed, qs, dtype, what):
    assert y.shape == (*x.shape[:-1], int(qs.shape[0])) and y.dtype == dtype, what
    assert torch.isfinite(y).all(), what
    err, mm_err = _errors(y, x, packed, qs, dtype)
    assert err <= max(2 * mm_err, 2e-3), (what, err, mm_err)


@pytest.mark.parametrize("nested", [True, False])
@pytest.mark.parametrize(
    "shape",
    [
        (4096, 4096),
        (11008, 4096),
        (4096, 11008),
        (100, 48),
        (33, 96),
        (257, 320),
        (64, 200),
        (130, 1000),
    ],  # fmt: skip
)
def test_rows_kernel_is_dequantize_then_matmul(shape, nested):
    _need_cuda()
    from quantmesh.quant.kernel4 import matmul_4bit_rows

    packed, qs = _quantized(*shape, nested)
    for rows in ROWS:
        for dtype in (torch.bfloat16,) if shape[0] > 1000 else (torch.bfloat16, torch.float16):
            x = torch.randn(rows, shape[1], device="cuda", dtype=dtype)
            with torch.no_grad():
                y = matmul_4bit_rows(x, packed, qs)
            _check(y, x, packed, qs, dtype, (shape, nested, rows, dtype))


def test_every_tile_variant_and_blocksize():
    """Each kernel variant (reduction along K at 1 and at 5 rows, tl.dot; split K; per-byte or
    per-block absmax) on aligned and row-spanning shapes, blocksizes 64 and 128, nf4 and fp4.
    (A 64 x 512 tl.dot tile at 64 rows needs 260 KiB of shared memory, more than an H200 has.)"""
    _need_cuda()
    from quantmesh.quant.kernel4 import _launch

    cfgs = [
        dict(BLOCK_N=n, BLOCK_K=k, DOT=d, SPLIT_K=s, ALIGNED=al, num_warps=4, num_stages=2)
        for n, k, d, s, al in ((16, 256, 0, 1, 1), (16, 256, 0, 3, 0), (32, 128, 1, 1, 1),
                               (32, 128, 1, 3, 0), (64, 128, 1, 2, 1), (8, 512, 0, 1, 0))
    ]  # fmt: skip
    for shape, bs, qt in (((96, 1024), 64, "nf4"), ((72, 200), 64, "fp4"), ((40, 768), 128, "nf4")):
        for nested in (True, False):
            packed, qs = _quantized(*shape, nested, blocksize=bs, quant_type=qt)
            flat = packed.reshape(-1).view(torch.uint8)
            stats = (
                (qs.absmax, qs.state2.absmax, qs.state2.code, qs.offset.float())
                if nested
                else (qs.absmax, None, None, None)
            )
            for cfg in cfgs:
                for rows in (1,) if cfg["DOT"] == 0 else (1, 5, 64):
                    x = torch.randn(rows, shape[1], device="cuda", dtype=torch.bfloat16)
                    y = _launch(x, flat, *stats, bs, qt, shape[0], cfg)
                    _check(y, x, packed, qs, torch.bfloat16, (shape, bs, qt, nested, cfg, rows))


@pytest.mark.parametrize("nested", [True, False])
def test_tp_shards_cut_from_a_quantized_weight(nested):
    """The codes a tp rank holds: rows (colwise) keep the 8-bit statistics when the cut starts on
    a nested block, columns (rowwise) get fp32 ones (quant/prequant.py slice_4bit); through the
    row kernel, the gemv (1 and 4 rows) and the tensor-core kernel (16 and 64 rows)."""
    _need_cuda()
    from quantmesh.quant.kernel4 import matmul_4bit_gemv, matmul_4bit_mma, matmul_4bit_rows
    from quantmesh.quant.prequant import slice_4bit

    out_f, in_f = 1024, 2048
    packed, qs = _quantized(out_f, in_f, nested)
    flat = packed.reshape(-1).view(torch.uint8)
    for dim, ranges in ((0, ((0, 512),)), (0, ((512, 1024),)), (0, ((64, 192),)),
                        (1, ((0, 1024),)), (1, ((1024, 2048),)), (1, ((128, 320),))):  # fmt: skip
        part_codes, part = slice_4bit(qs, dim, ranges, lambda a, b: flat[a:b])
        for rows in (1, 4, 64):
            x = torch.randn(rows, int(part.shape[1]), device="cuda", dtype=torch.bfloat16)
            with torch.no_grad():
                y = matmul_4bit_rows(x, part_codes, part)
            _check(y, x, part_codes, part, torch.bfloat16, (dim, ranges, rows, part.nested))
        for matmul, rows in ((matmul_4bit_gemv, 1), (matmul_4bit_gemv, 4), (matmul_4bit_mma, 16),
                             (matmul_4bit_mma, 64)):  # fmt: skip
            x = torch.randn(rows, int(part.shape[1]), device="cuda", dtype=torch.bfloat16)
            with torch.no_grad():
                y = matmul(x, part_codes, part)
            _check(y, x, part_codes, part, torch.bfloat16, (matmul, dim, ranges, rows))


def _nf4_linear():
    """A QuantLinear4bit (4096 -> 1000, nf4, bf16) with a random weight and bias, on the GPU."""
    from quantmesh.quant.base import QuantConfig
    from quantmesh.quant.bnb import bnb_format

    fmt = bnb_format(QuantConfig(format="nf4"))
    m = fmt.new_linear(4096, 1000, bias=True, device="cuda", dtype=torch.bfloat16)
    fmt.quantize_into(m, torch.randn(1000, 4096, device="cuda", dtype=torch.bfloat16) * 0.02)
    with torch.no_grad():
        m.bias.normal_()
    return m


def test_quant_linear_takes_the_kernel_when_enabled_without_autograd_and_compiles():
    _need_cuda()
    import quantmesh.quant.kernel4 as k4

    m = _nf4_linear()
    qs = m.weight.quant_state
    x = torch.randn(2, 3, 4096, device="cuda", dtype=torch.bfloat16)  # 6 rows
    with torch.no_grad():
        assert not k4.ENABLED and not k4.rows_kernel_applies(x, qs, torch.bfloat16)  # opt-in
        y_bnb = m(x)  # bitsandbytes' path on the same weight
    k4.ENABLED = True
    try:
        assert not k4.rows_kernel_applies(x, qs, torch.bfloat16)  # autograd on: bitsandbytes'
        with torch.no_grad():
            assert k4.rows_kernel_applies(x, qs, torch.bfloat16)
            many = torch.randn(65, 4096, device="cuda")
            assert not k4.rows_kernel_applies(many, qs, torch.bfloat16)
            assert not k4.rows_kernel_applies(x.cpu(), qs, torch.bfloat16)
            y = m(x)
            step = torch.compile(m.forward, fullgraph=True, mode="reduce-overhead")
            ys = [step(x).clone() for _ in range(4)]  # warm-up, recording, replays
        y_grad = m(x)  # with autograd: bitsandbytes' path, as before
    finally:
        k4.ENABLED = False
    assert y.shape == (2, 3, 1000) and y.dtype == torch.bfloat16
    scale = y_bnb.float().norm()
    assert float((y.float() - y_bnb.float()).norm() / scale) < 4e-3
    assert float((y_grad.float() - y_bnb.float()).norm() / scale) < 4e-3
    for yc in ys:  # the same kernel and tiles: the same bits, compiled and graphed
        assert torch.equal(yc, y)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("nested", [True, False])
@pytest.mark.parametrize("blocksize", [64, 128])
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("shape", [(4096, 4096), (11008, 4096), (33, 96), (257, 320), (130, 1000)])
def test_triton_dequantize_writes_bitsandbytes_weights(shape, quant_type, blocksize, nested, dtype):
    """kernel4.dequantize_4bit (the many-row path's weight) is bitsandbytes' own: bit for bit in
    bf16 (the product of fp32 code value and fp32 absmax, rounded once); within one rounding in
    fp16, which bitsandbytes' kernel computes differently (seen on an H200)."""
    _need_cuda()
    import bitsandbytes.functional as F

    from quantmesh.quant import kernel4 as k4

    g = torch.Generator(device="cuda").manual_seed(1)
    w = (torch.randn(*shape, device="cuda", generator=g) * 0.02).to(dtype)
    packed, qs = F.quantize_4bit(
        w, blocksize=blocksize, compress_statistics=nested, quant_type=quant_type
    )
    want = F.dequantize_4bit(packed, qs)
    assert want.dtype == dtype
    flat = packed.reshape(-1).view(torch.uint8)
    stats = (
        (qs.absmax, qs.state2.absmax, qs.state2.code, qs.offset.float())
        if nested
        else (qs.absmax, None, None, None)
    )
    for nbk in (1, 32, 128):
        got = k4.dequantize_4bit(flat, *stats, blocksize, quant_type, shape, dtype, nbk)
        what = (shape, quant_type, blocksize, nested, dtype, nbk)
        if dtype == torch.bfloat16:
            assert torch.equal(got, want), what
        else:  # one fp16 rounding apart at most
            ulp = want.float().abs().clamp_min(2.0**-14) * 2.0**-10
            assert ((got.float() - want.float()).abs() <= ulp).all(), what


def test_quant_linear_many_rows_take_the_dequant_kernel_without_autograd_and_compile():
    """From DEQUANT_MIN_ROWS rows on, without autograd, QuantLinear4bit multiplies by the Triton
    dequantize's weight once turned on; eager, compiled and CUDA-graphed alike, equal to
    bitsandbytes' path (taken with autograd on) within bf16 rounding; a 3-D input with strides
    that do not fold (one position per row) gives the same result."""
    _need_cuda()
    import quantmesh.quant.kernel4 as k4

    m = _nf4_linear()
    qs = m.weight.quant_state
    heads = torch.randn(64, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    x = heads.transpose(1, 2).reshape(64, 1, 4096)  # as an attention output reaches o_proj
    saved = k4.DEQUANT_ENABLED  # off by default (QUANTMESH_TRITON_DEQUANT=1 turns it on)
    try:
        k4.DEQUANT_ENABLED = False
        y_bnb = m(x).detach()  # autograd on: bitsandbytes' path
        with torch.no_grad():
            assert not k4.dequant_kernel_applies(x, qs, torch.bfloat16)
            y_off = m(x)  # bitsandbytes' path, the input flattened first
        k4.DEQUANT_ENABLED = True
        _many_rows(m, x, qs, y_bnb, y_off)
    finally:
        k4.DEQUANT_ENABLED = saved


def _many_rows(m, x, qs, y_bnb, y_off):
    import quantmesh.quant.kernel4 as k4

    assert k4.dequant_kernel_applies(x[:4], qs, torch.bfloat16)  # autograd on: any rows
    with torch.no_grad():
        assert k4.dequant_kernel_applies(x, qs, torch.bfloat16)
        assert not k4.dequant_kernel_applies(x[:4], qs, torch.bfloat16)  # bitsandbytes' below 8
        assert not k4.dequant_kernel_applies(x.cpu(), qs, torch.bfloat16)
        y = m(x)
        step = torch.compile(m.forward, fullgraph=True, mode="reduce-overhead")
        ys = [step(x).clone() for _ in range(4)]  # warm-up, recording, replays
    assert y.shape == (64, 1, 1000) and y.dtype == torch.bfloat16
    scale = y_bnb.float().norm()
    assert float((y.float() - y_bnb.float()).norm() / scale) < 4e-3
    assert float((y_off.float() - y_bnb.float()).norm() / scale) < 4e-3
    for yc in ys:
        assert float((yc.float() - y.float()).norm() / scale) < 4e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("nested", [True, False])
@pytest.mark.parametrize("lut", [0, 1])
@pytest.mark.parametrize(
    "shape", [(4096, 4096), (11008, 4096), (4096, 11008), (33, 192), (257, 640), (100, 1088)]
)
def test_gemv_is_dequantize_then_matmul(shape, lut, nested, dtype):
    """The gemv (one row) lands within its output's rounding of x @ dequantize_4bit(W)^T for the
    7B shapes and odd ones (`out` not a multiple of a program's features, `in` not of a share),
    at the library's tiles, with K in one share (no partials) and in shares of 3 blocks, each
    code's value loaded (LUT 0) and shuffled from its lane (LUT 1), and
    gives the same bits again (the per-group counts are back at zero after every call)."""
    _need_cuda()
    from quantmesh.quant import kernel4 as k4

    old = dict(BLOCK_N=32, LUT=lut, num_warps=1, num_stages=1)
    _gemv_tiles_check(shape, nested, dtype, lambda out_f, in_f: [
        k4.gemv_config(1, out_f, in_f, 64, old),
        dict(BLOCK_N=64, BLK=0, LUT=lut, num_warps=2),  # one share: y written directly
        dict(BLOCK_N=64, BLK=5, LUT=0, num_warps=1),  # 2 features a thread
        dict(BLOCK_N=128, BLK=3, LUT=lut, num_warps=4),  # shares of 3 blocks
    ])  # fmt: skip


def _gemv_tiles_check(shape, nested, dtype, tiles_for, rows=1, launch=None):
    """Each tile of `tiles_for(out, in)` lands within its output's rounding of
    x @ dequantize_4bit(W)^T (`rows` rows; a random nf4 weight of `shape`, blocksize 64) and gives
    the same bits again, through `launch` (default the gemv's, `kernel4.launch_gemv`)."""
    from quantmesh.quant import kernel4 as k4

    launch = launch or k4.launch_gemv

    out_f, in_f = shape
    packed, qs = _quantized(out_f, in_f, nested, 64)
    flat = packed.reshape(-1).view(torch.uint8)
    stats = k4._statistics(qs, torch.device("cuda"))
    x = torch.randn(rows, in_f, device="cuda", dtype=dtype)
    for cfg in tiles_for(out_f, in_f):
        y = launch(x, flat, *stats, 64, "nf4", out_f, cfg)
        _check(y, x, packed, qs, dtype, (shape, rows, cfg))
        assert torch.equal(launch(x, flat, *stats, 64, "nf4", out_f, cfg), y)


@pytest.mark.parametrize("rows", [1, 4, 8])
@pytest.mark.parametrize("shape", [(12288, 4096), (4096, 11008), (33, 192)])
def test_gemv_adds_a_low_rank_delta_as_it_stores(shape, rows):
    """The gemv with the adapters' B products in its launch (`launch_gemv(low_rank=...)`, the
    library's tile and K in shares): each output is the plain gemv's plus `scale[n] * (e[n] @
    t[:, col[n]:col[n] + r])` rounded to x's dtype on its own (within an ulp: its products are
    summed in another order), members of ranks 16 and 8 beside each other in t; in bf16 with a
    bias too, added to the rounded product and rounded before the delta, as `(y + bias)` is."""
    _need_cuda()
    from quantmesh.quant import kernel4 as k4

    out_f, in_f = shape
    packed, qs = _quantized(out_f, in_f, nested=True)
    flat = packed.reshape(-1).view(torch.uint8)
    stats = k4._statistics(qs, flat.device)
    g = torch.Generator(device="cuda").manual_seed(3)
    r, R = 16, 16 + 16 + 8  # three members: the last of rank 8 (its B rows padded with zeros)
    member = torch.arange(out_f, device="cuda") * 3 // out_f
    col = (member * 16).to(torch.int32)
    e = torch.randn(out_f, r, device="cuda", generator=g) * 0.05
    e[member == 2, 8:] = 0.0
    sc = (member.float() + 1) * 0.5
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(rows, in_f, device="cuda", generator=g).to(dtype)
        t = torch.randn(rows, R, device="cuda", generator=g)
        lib = k4.gemv_config(rows, out_f, in_f, 64)
        bias = torch.randn(out_f, device="cuda", generator=g).to(dtype)
        for cfg in (lib, dict(lib, BLK=lib["SB"])):  # one share (7B shapes), shares
            for b in (None, bias) if dtype == torch.bfloat16 else (None,):  # (fewer compiles)
                lr = (t, e, col, sc, b)
                plain = k4.launch_gemv(x, flat, *stats, 64, "nf4", out_f, cfg)
                if b is not None:
                    plain = plain + b  # (rounded once, as the layer adds its bias)
                y = k4.launch_gemv(x, flat, *stats, 64, "nf4", out_f, cfg, low_rank=lr)
                cols = (col[:, None] + torch.arange(r, device="cuda")).clamp(max=R - 1)
                d = ((t[:, cols] * e).sum(-1) * sc).to(dtype)
                want = (plain.float() + d.float()).to(dtype)
                ulp = 2.0 ** (torch.frexp(want.float())[1].float() - 1) * torch.finfo(dtype).eps
                case = (shape, rows, dtype, cfg, b is not None)
                assert ((y.float() - want.float()).abs() <= ulp).all(), case
                assert (y != plain).any()
                again = k4.launch_gemv(x, flat, *stats, 64, "nf4", out_f, cfg, low_rank=lr)
                assert torch.equal(again, y)  # the same bits again (a fixed order of sums)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("nested", [True, False])
@pytest.mark.parametrize(
    "shape", [(4096, 4096), (11008, 4096), (4096, 11008), (33, 192), (257, 640), (100, 1088)]
)
def test_gemv_lines_is_dequantize_then_matmul(shape, nested, dtype):
    """The gemv with the lanes along K (`KERNEL="lines"`, the library's tile) lands within its
    output's rounding of x @ dequantize_4bit(W)^T for the 7B shapes and odd ones (`out` not a
    multiple of a program's features, `in` not of a stride), with K in one share and in shares
    of one stride, strides of 32, 16, 8 and 4 blocks, a program's warps splitting K (WK 2, 4),
    each code's value and absmax shuffled from the lane that holds it (LUT 1) and loaded (LUT 0),
    and gives the same bits again."""
    _need_cuda()
    from quantmesh.quant import kernel4 as k4

    assert k4.GEMV_TILE["KERNEL"] == "lines"
    lines = dict(KERNEL="lines", LUT=1, num_warps=1, num_stages=1)
    _gemv_tiles_check(shape, nested, dtype, lambda out_f, in_f: [
        k4.gemv_config(1, out_f, in_f, 64),  # the library's
        dict(lines, BLOCK_N=8, SB=16, BLK=16),  # shares of one stride
        dict(lines, BLOCK_N=2, SB=8, BLK=0),  # one share
        dict(lines, BLOCK_N=4, SB=4, BLK=12),  # shares of three strides
        dict(lines, BLOCK_N=4, SB=32, BLK=32, LUT=0),
        dict(lines, BLOCK_N=2, SB=32, BLK=0, WK=4, num_warps=4),  # warps splitting K
        dict(lines, BLOCK_N=4, SB=16, BLK=16, WK=2, num_warps=2),
    ])  # fmt: skip


@pytest.mark.parametrize("rows", [2, 3, 4, 8, 13, 16])
@pytest.mark.parametrize("nested", [True, False])
@pytest.mark.parametrize(
    "shape", [(4096, 4096), (11008, 4096), (4096, 11008), (33, 192), (257, 640)]
)
def test_gemv_lines_rows_is_dequantize_then_matmul(shape, nested, rows):
    """The lines gemv at a few rows (each code's value found once, multiplied with every row)
    lands within its output's rounding of x @ dequantize_4bit(W)^T, rows past the last masked
    off (3, 13: not a power of two), with the library's tile for that many rows, K in one share
    and in shares, strides of 32, 16 and 8 blocks, fp16 too, and gives the same bits again."""
    _need_cuda()
    from quantmesh.quant import kernel4 as k4

    lines = dict(KERNEL="lines", LUT=1, num_warps=1, num_stages=1)
    for dtype in (torch.bfloat16, torch.float16):
        _gemv_tiles_check(shape, nested, dtype, lambda out_f, in_f: [
            k4.gemv_config(rows, out_f, in_f, 64),  # the library's
            dict(lines, BLOCK_N=1, SB=8, BLK=0),  # one share
            dict(lines, BLOCK_N=2, SB=16, BLK=16),  # shares of one stride
            dict(lines, BLOCK_N=4, SB=8, BLK=24),  # shares of three strides
        ], rows=rows)  # fmt: skip


@pytest.mark.parametrize("nested", [True, False])
@pytest.mark.parametrize(
    "shape", [(4096, 4096), (11008, 4096), (4096, 11008), (33, 192), (257, 640), (100, 1088)]
)
def test_mma_is_dequantize_then_matmul(shape, nested):
    """The tensor-core kernel at 9 to 64 rows lands within its output's rounding of
    x @ dequantize_4bit(W)^T for the 7B shapes and odd ones (`out` not a multiple of a program's
    features, `in` an odd number of blocks: a step's last block masked off), rows past the last
    masked off (9, 17, 33) and none (64), with the library's tile for that many rows, K in one share and in
    shares, steps of 1, 2 and 4 blocks, 128 and 32 features a program, each code's value loaded
    (LUT 0), bf16 and fp16, and gives the same bits again."""
    _need_cuda()
    from quantmesh.quant import kernel4 as k4

    for rows in (9, 17, 33, 64):  # each BLOCK_M, rows past the last masked, and all 64
        bm = max(16, 1 << (rows - 1).bit_length())
        tile = dict(BLOCK_M=bm, LUT=1, num_warps=4, num_stages=3)
        for dtype in (torch.bfloat16, torch.float16):
            _gemv_tiles_check(shape, nested, dtype, lambda out_f, in_f, rows=rows, tile=tile: [
                k4.mma_config(rows, out_f, in_f),  # the library's
                dict(tile, BLOCK_N=64, NB=2, BLK=0),  # one share
                dict(tile, BLOCK_N=128, NB=1, BLK=3),  # shares of three steps
                dict(tile, BLOCK_N=32, NB=4, BLK=8, num_warps=2),
                dict(tile, BLOCK_N=64, NB=2, BLK=6, LUT=0),
            ], rows=rows, launch=k4.launch_mma)  # fmt: skip


@pytest.mark.parametrize("shape", [(4096, 4096), (11008, 4096), (100, 1088)])
def test_mma_takes_a_training_batch_of_rows(shape):
    """More rows than a program's BLOCK_M (a training batch's: the dequantization as the GEMM's
    prologue, `benchmarks/nf4_prologue_bench.py`): a program per BLOCK_M rows, K in one share,
    within its output's rounding of x @ dequantize_4bit(W)^T, the last program's rows partly
    masked (1000) or none (2048), bf16 and fp16, the same bits again."""
    _need_cuda()
    from quantmesh.quant import kernel4 as k4

    for rows in (1000, 2048):
        for dtype in (torch.bfloat16, torch.float16):
            _gemv_tiles_check(shape, True, dtype, lambda out_f, in_f: [
                dict(BLOCK_M=64, BLOCK_N=128, NB=1, BLK=0, LUT=1, num_warps=4, num_stages=3),
                dict(BLOCK_M=128, BLOCK_N=128, NB=1, BLK=0, LUT=1, num_warps=8, num_stages=3),
            ], rows=rows, launch=k4.launch_mma)  # fmt: skip


def test_quant_linear_takes_the_mma_when_enabled_and_compiles():
    """QuantLinear4bit with `MMA_ENABLED`: 16 and 33 rows without autograd take the tensor-core
    kernel, in eager and inside torch.compile(fullgraph=True, mode="reduce-overhead") alike (the
    same bits), within bf16 rounding of bitsandbytes' path; a few rows keep the gemv, more than
    `MMA_MAX_ROWS` and autograd the other paths."""
    _need_cuda()
    import quantmesh.quant.kernel4 as k4

    m = _nf4_linear()
    qs = m.weight.quant_state
    before = k4.MMA_ENABLED
    k4.MMA_ENABLED = True
    try:
        for rows in (16, 33):
            x = torch.randn(rows, 1, 4096, device="cuda", dtype=torch.bfloat16)
            assert not k4.mma_applies(x, qs, torch.bfloat16)  # autograd on
            with torch.no_grad():
                assert k4.mma_applies(x, qs, torch.bfloat16)
                k4.MMA_ENABLED = False
                y_bnb = m(x)
                k4.MMA_ENABLED = True
                assert not k4.mma_applies(x[: k4.GEMV_MAX_ROWS], qs, torch.bfloat16)
                more = torch.randn(k4.MMA_MAX_ROWS + 1, 4096, device="cuda")
                assert not k4.mma_applies(more, qs, torch.bfloat16)
                step = torch.compile(m.forward, fullgraph=True, mode="reduce-overhead")
                ys = [step(x).clone() for _ in range(3)]
                y = m(x)
            scale = y_bnb.float().norm()
            assert float((y.float() - y_bnb.float()).norm() / scale) < 4e-3, rows
            for yc in ys:
                assert torch.equal(yc, y), rows
    finally:
        k4.MMA_ENABLED = before


def test_the_training_switch_takes_the_dequantize_under_autograd_only():
    """`DEQUANT_TRAINING` alone: Triton's dequantize where autograd records (training), and
    bitsandbytes' path for the same rows without it (inference keeps its default)."""
    _need_cuda()
    import quantmesh.quant.kernel4 as k4
    from quantmesh.quant.base import QuantConfig
    from quantmesh.quant.bnb import bnb_format

    fmt = bnb_format(QuantConfig(format="nf4"))
    m = fmt.new_linear(4096, 1000, bias=False, device="cuda", dtype=torch.bfloat16)
    fmt.quantize_into(m, torch.randn(1000, 4096, device="cuda", dtype=torch.bfloat16) * 0.02)
    qs = m.weight.quant_state
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    before = (k4.DEQUANT_ENABLED, k4.DEQUANT_TRAINING)
    try:
        k4.DEQUANT_ENABLED, k4.DEQUANT_TRAINING = False, True
        assert k4.dequant_kernel_applies(x.clone().requires_grad_(), qs, torch.bfloat16)
        with torch.no_grad():
            assert not k4.dequant_kernel_applies(x, qs, torch.bfloat16)
        k4.DEQUANT_TRAINING = False
        assert not k4.dequant_kernel_applies(x.clone().requires_grad_(), qs, torch.bfloat16)
    finally:
        k4.DEQUANT_ENABLED, k4.DEQUANT_TRAINING = before


def test_training_takes_the_triton_dequantize_with_bitsandbytes_values():
    """With `DEQUANT_ENABLED`, QuantLinear4bit under autograd multiplies Triton's dequantized
    weight, forward and backward: at 2048 rows, where bitsandbytes' own path dequantizes too, the
    output and the input's gradient are bitsandbytes' to the bit; at 64 rows (its own kernel)
    within bf16 rounding; compiled (torch.compile, default mode) the same bits as eager; and
    autograd keeps no float weight for backward (only the codes)."""
    _need_cuda()
    import quantmesh.quant.kernel4 as k4
    from quantmesh.quant.base import QuantConfig
    from quantmesh.quant.bnb import bnb_format

    fmt = bnb_format(QuantConfig(format="nf4"))
    m = fmt.new_linear(4096, 1000, bias=False, device="cuda", dtype=torch.bfloat16)
    fmt.quantize_into(m, torch.randn(1000, 4096, device="cuda", dtype=torch.bfloat16) * 0.02)
    g = torch.Generator(device="cuda").manual_seed(3)
    before = (k4.DEQUANT_ENABLED, k4.DEQUANT_TRAINING)
    k4.DEQUANT_TRAINING = False  # (the training switch alone would take it for the reference)
    try:
        for rows in (2048, 64):
            x0 = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
            r = torch.randn(rows, 1000, device="cuda", dtype=torch.bfloat16, generator=g)
            runs = {}
            for name, on, fn in (("bnb", False, m.forward), ("ours", True, m.forward),
                                 ("compiled", True, torch.compile(m.forward))):  # fmt: skip
                k4.DEQUANT_ENABLED = on
                x = x0.clone().requires_grad_()
                assert k4.dequant_kernel_applies(x, m.weight.quant_state, torch.bfloat16) is on
                saved: list = []
                with torch.autograd.graph.saved_tensors_hooks(
                    lambda t, saved=saved: saved.append(tuple(t.shape)) or t, lambda t: t
                ):
                    y = fn(x)
                y.backward(r)
                runs[name] = (y.detach(), x.grad)
                if on:
                    assert (1000, 4096) not in saved and (4096, 1000) not in saved, saved
            for name in ("ours", "compiled"):
                for got, want in zip(runs[name], runs["bnb"], strict=True):
                    if rows > 1536:  # bitsandbytes' dequantize + the same linear / matmul
                        assert torch.equal(got, want), (name, rows)
                    else:
                        err = float((got.float() - want.float()).norm() / want.float().norm())
                        assert err < 4e-3, (name, rows, err)
            for got, want in zip(runs["compiled"], runs["ours"], strict=True):
                assert torch.equal(got, want), rows
    finally:
        k4.DEQUANT_ENABLED, k4.DEQUANT_TRAINING = before


def test_whole_weights_take_the_triton_dequantize_with_bitsandbytes_values():
    """With `DEQUANT_ENABLED`, a 4-bit weight dequantized whole (`compute_weight`; some experts'
    rows, `compute_units`: how the experts' fused tensors are multiplied) comes from Triton's
    dequantize: the same bits as bitsandbytes', eager and compiled, double quant or not, bf16
    and fp32."""
    _need_cuda()
    import quantmesh.quant.kernel4 as k4
    from quantmesh.quant.base import QuantConfig
    from quantmesh.quant.bnb import bnb_format

    before = (k4.DEQUANT_ENABLED, k4.DEQUANT_TRAINING)
    k4.DEQUANT_TRAINING = False  # (the training switch alone: only under autograd, not here)
    try:
        for double_quant, dtype in ((True, torch.bfloat16), (False, torch.float32)):
            fmt = bnb_format(QuantConfig(format="nf4", double_quant=double_quant))
            m = fmt.new_linear(1024, 8 * 96, bias=False, device="cuda", dtype=dtype)
            fmt.quantize_into(m, torch.randn(8 * 96, 1024, device="cuda", dtype=dtype) * 0.02)
            qs = m.weight.quant_state
            index = torch.tensor([1, 5, 6], device="cuda")
            got = {}
            for on in (False, True):
                k4.DEQUANT_ENABLED = on
                assert k4.dequantize_weight_applies(m.weight, "nf4", 8 * 96 * 1024, dtype) is on
                whole = torch.compile(lambda m=m, fmt=fmt: fmt.compute_weight(m), fullgraph=True)
                got[on] = (fmt.compute_weight(m), fmt.compute_units(m, 8, index), whole())
            for a, b in zip(got[False], got[True], strict=True):
                assert a.dtype == qs.dtype and torch.equal(a, b), (double_quant, dtype)
            assert torch.equal(got[True][2], got[True][0])
    finally:
        k4.DEQUANT_ENABLED, k4.DEQUANT_TRAINING = before


def test_quant_linear_takes_the_gemv_when_enabled_and_compiles():
    """QuantLinear4bit with `GEMV_ENABLED`: one row without autograd takes the gemv, in eager and
    inside torch.compile(fullgraph=True, mode="reduce-overhead") alike (the same bits), also when
    its first call is the compiled step's (its kept buffers must not come from the CUDA graphs'
    pool: "tensors in the cudagraph pool not tracked as outputs" in fast_decode otherwise); more
    rows than `GEMV_MAX_ROWS` and autograd keep the other paths."""
    _need_cuda()
    import quantmesh.quant.kernel4 as k4

    m = _nf4_linear()
    qs = m.weight.quant_state
    x = torch.randn(1, 1, 4096, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        y_bnb = m(x)
    before = k4.GEMV_ENABLED
    kept = (dict(k4._CODE_VALUES), dict(k4._COUNTERS))  # (earlier graphs may hold them)
    k4._CODE_VALUES.clear()  # the kept buffers first asked for inside the compiled step's
    k4._COUNTERS.clear()  # warm-up, as in fast_decode: they must not come from its graph pool
    k4.GEMV_ENABLED = True
    try:
        assert not k4.gemv_applies(x, qs, torch.bfloat16)  # autograd on
        with torch.no_grad():
            assert k4.gemv_applies(x, qs, torch.bfloat16)
            more = torch.randn(k4.GEMV_MAX_ROWS + 1, 4096, device="cuda")
            assert not k4.gemv_applies(more, qs, torch.bfloat16)
            step = torch.compile(m.forward, fullgraph=True, mode="reduce-overhead")
            ys = [step(x).clone() for _ in range(4)]
            y = m(x)
    finally:
        k4.GEMV_ENABLED = before
        _KEEP_ALIVE.append((dict(k4._CODE_VALUES), dict(k4._COUNTERS)))
        k4._CODE_VALUES.update(kept[0])
        k4._COUNTERS.update(kept[1])
    scale = y_bnb.float().norm()
    assert float((y.float() - y_bnb.float()).norm() / scale) < 4e-3
    for yc in ys:
        assert torch.equal(yc, y)


_KEEP_ALIVE: list = []  # buffers a test's compiled graphs may point at, never freed
