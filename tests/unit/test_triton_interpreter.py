"""quantmesh's Triton kernels (quant/_triton4.py, through quant/kernel4.py's launchers) run by
Triton's interpreter on CPU, against bitsandbytes' own `dequantize_4bit` (CPU) and a matmul: the
kernels' arithmetic in `make test`, on any machine, where the CUDA tests need a GPU.

Each family of kernels runs in a process of its own with TRITON_INTERPRET=1 (read when
`triton.jit` wraps a kernel, so before quant/_triton4.py is imported):
- the gemvs (1 to 8 rows) and the tensor-core kernel (9 to 64 rows);
- the dequantize, bit for bit, also as the op the experts' weights take;
- the older row and block kernels;
- tp shards cut from a quantized weight, the ops also traced and run compiled;
- sibling weights joined into one (`quant.bnb.CodesRun`: each member's own offset under double
  quant, one per nested block): the gemv and the tensor-core kernel on the joined codes give
  each member's own product, and the members' views dequantize to their weights as before;
- `fast_decode` of a small fp16 Llama (nf4 + LoRA) whose 4-bit linears take the gemv: with the
  sibling codes joined, compiled (aot_eager, the block region), the tokens of the eager loop
  without the join, in fewer launches a step;
- the dequantize + matmul under autograd (training): forward and backward bit for bit as the
  same `linear` and `matmul` on bitsandbytes' weight, keeping only the codes for backward, eager
  and compiled.

A product is right when its error against the fp32 product of x and the dequantized weight is at
most twice a plain matmul's on the same weight (the CUDA tests' rule). The interpreter rounds
fp32 to bf16 by truncation, not to nearest as a GPU does: a bf16 case's plain product is the fp32
one truncated the same way, the dequantize's bf16 weight must be bitsandbytes' fp32 weight
truncated, and the kernels that round each weight to x's dtype before multiplying (the row and
block kernels, the tensor-core one) run in fp16 here. What the interpreter cannot run is left to
the CUDA tests (tests/distributed/test_cuda_kernel4.py): warp shuffles (LUT 1: here every code
value is loaded, LUT 0) and bf16 `tl.dot` (its numpy bf16 products are wrong).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
FAMILIES = ("gemv", "mma", "dequant", "rows", "tp_shards", "joined", "decode", "train")


@pytest.mark.parametrize("family", FAMILIES)
def test_triton_kernels_in_the_interpreter(family: str) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT / "src"))
    code = f"import tests.unit.test_triton_interpreter as t; t.main({family!r})"
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                       text=True, timeout=400)  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    cases = json.loads(r.stdout.strip().splitlines()[-1])
    bad = [c for c in cases if not c["ok"]]
    assert cases and not bad, bad


# ---- run inside the interpreter's process -----------------------------------------------------
def _weight(out_f: int, in_f: int, nested: bool, blocksize: int = 64, quant_type: str = "nf4",
            seed: int = 0, scale: float = 0.02):  # fmt: skip
    import bitsandbytes.functional as F

    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g) * scale
    packed, qs = F.quantize_4bit(w, blocksize=blocksize, compress_statistics=nested,
                                 quant_type=quant_type)  # fmt: skip
    return packed, qs


def _truncated(t: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 as Triton's interpreter converts: the low 16 bits dropped."""
    return (t.float().view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)


def _dequantized(packed, qs) -> torch.Tensor:
    """bitsandbytes' fp32 weight (its CPU kernel, blocks over the flattened weight)."""
    from quantmesh.quant.bnb import dequantize_4bit_flat

    return dequantize_4bit_flat(packed, qs).float()


def _product(y: torch.Tensor, x: torch.Tensor, packed, qs, what) -> dict:
    """A case's record: its error and a plain matmul's, against x @ dequantize_4bit(W)^T in fp32
    (bf16: the interpreter's plain product is the exact one truncated)."""
    w = _dequantized(packed, qs).to(x.dtype)
    ref = x.float() @ w.float().t()
    mm = _truncated(ref).float() if x.dtype == torch.bfloat16 else (x @ w.t()).float()
    err = float((y.float() - ref).norm() / ref.norm())
    mm_err = float((mm - ref).norm() / ref.norm())
    ok = (y.shape == (x.shape[0], w.shape[0]) and y.dtype == x.dtype
          and err <= max(2 * mm_err, 2e-3))  # fmt: skip
    return {"case": repr(what), "err": err, "mm_err": mm_err, "ok": bool(ok)}


def _counts_back_at_zero() -> bool:
    from quantmesh.quant import kernel4 as k4

    return all(int(c.abs().sum()) == 0 for c in k4._COUNTERS.values())


def _stats(qs):
    from quantmesh.quant import kernel4 as k4

    return k4._statistics(qs, torch.device("cpu"))


def _gemv() -> list[dict]:
    from quantmesh.quant import kernel4 as k4

    out = []
    g = torch.Generator().manual_seed(1)
    for (out_f, in_f), nested in (((64, 512), True), ((33, 192), False)):
        packed, qs = _weight(out_f, in_f, nested)
        flat = packed.reshape(-1).view(torch.uint8)
        for rows, dtype in ((1, torch.bfloat16), (3, torch.float16), (8, torch.bfloat16)):
            x = torch.randn(rows, in_f, generator=g).to(dtype)
            lib = dict(k4.gemv_config(rows, out_f, in_f, 64), LUT=0)
            tiles = [dict(lib, BLOCK_N=16, BLK=0), dict(lib, BLOCK_N=8, SB=4, BLK=4)]
            if out_f == 33:  # the library's own tile (few features a program: slow here)
                tiles.append(lib)
            for cfg in tiles:  # one share, shares of one stride
                y = k4.launch_gemv(x, flat, *_stats(qs), 64, "nf4", out_f, cfg)
                out.append(_product(y, x, packed, qs, ("lines", out_f, in_f, rows, cfg)))
                out[-1]["ok"] &= _counts_back_at_zero()
        x = torch.randn(1, in_f, generator=g).to(torch.bfloat16)  # the one-thread-a-feature gemv
        for cfg in (dict(BLOCK_N=32, BLK=0, LUT=0), dict(BLOCK_N=32, BLK=3, LUT=0)):
            y = k4.launch_gemv(x, flat, *_stats(qs), 64, "nf4", out_f, cfg)
            out.append(_product(y, x, packed, qs, ("4bit", out_f, in_f, cfg)))
            out[-1]["ok"] &= _counts_back_at_zero()
    return out


def _mma() -> list[dict]:
    from quantmesh.quant import kernel4 as k4

    out = []
    g = torch.Generator().manual_seed(2)
    for (out_f, in_f), nested in (((100, 448), True), ((33, 192), False)):  # 7, 3 blocks
        packed, qs = _weight(out_f, in_f, nested)
        flat = packed.reshape(-1).view(torch.uint8)
        for rows in (9, 33, 64):
            x = torch.randn(rows, in_f, generator=g).to(torch.float16)
            lib = dict(k4.mma_config(rows, out_f, in_f, programs=4), LUT=0)  # K in shares
            tiles = (lib, dict(lib, BLK=0), dict(lib, BLOCK_N=32, NB=4, BLK=4),
                     dict(lib, BLOCK_N=16, NB=1, BLK=3))  # fmt: skip
            for cfg in tiles:
                y = k4.launch_mma(x, flat, *_stats(qs), 64, "nf4", out_f, cfg)
                out.append(_product(y, x, packed, qs, ("mma", out_f, in_f, rows, cfg)))
                out[-1]["ok"] &= _counts_back_at_zero()
    return out


def _dequant() -> list[dict]:
    from quantmesh.quant import kernel4 as k4

    out = []
    from quantmesh.quant.bnb import _flat_args

    shapes = (((64, 512), 64, "nf4"), ((33, 96), 64, "fp4"), ((20, 640), 128, "nf4"),
              ((8, 1024), 256, "nf4"))  # fmt: skip
    for shape, bs, qt in shapes:
        for nested in (True, False):
            packed, qs = _weight(*shape, nested, blocksize=bs, quant_type=qt)
            flat = packed.reshape(-1).view(torch.uint8)
            absmax = _flat_args(qs)[0]  # fp32, as compute_weight passes it
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                want = _dequantized(packed, qs)
                want = _truncated(want) if dtype == torch.bfloat16 else want.to(dtype)
                w = k4.dequantize_4bit(flat, *_stats(qs), bs, qt, shape, dtype)
                w2 = k4.dequantize_weight(packed, absmax, bs, qt, *shape, dtype)  # the op
                out.append({"case": repr((shape, bs, qt, nested, dtype)),
                            "ok": bool(torch.equal(w, want) and torch.equal(w2, want))})  # fmt: skip
    return out


def _rows() -> list[dict]:
    from quantmesh.quant import kernel4 as k4

    out = []
    g = torch.Generator().manual_seed(3)
    for (out_f, in_f), nested in (((64, 512), True), ((33, 96), False), ((40, 320), True)):
        packed, qs = _weight(out_f, in_f, nested)
        flat = packed.reshape(-1).view(torch.uint8)
        for rows in (1, 5, 17):  # fp16: these kernels round each weight to x's dtype first
            x = torch.randn(rows, in_f, generator=g).to(torch.float16)
            cfgs = [k4.choose_config(rows)]
            if in_f % 64 == 0:  # the block kernel: whole blocks
                cfgs.append(dict(KERNEL="blocks", BLOCK_N=32, NB=4, SPLIT_K=2, DOT=int(rows > 1),
                                 num_warps=4))  # fmt: skip
            for cfg in cfgs:
                y = k4._launch(x, flat, *_stats(qs), 64, "nf4", out_f, cfg)
                out.append(_product(y, x, packed, qs, ("rows", out_f, in_f, rows, cfg)))
    return out


def _interpreter_tiles() -> None:
    """The library's tiles as the interpreter runs them: code values loaded (no shuffles), and
    the gemv's with fewer programs (the interpreter runs each in turn)."""
    from quantmesh.quant import kernel4 as k4

    for tile in (*k4.GEMV_ROW_TILES.values(), *k4.MMA_ROW_TILES.values()):
        tile["LUT"] = 0
    for tile in k4.GEMV_ROW_TILES.values():
        tile["BLOCK_N"] = 16


def _count_gemv_launches() -> list[int]:
    """A one-item list counting the gemv's launches from here on (its op wrapped in this
    process: matmul_4bit_gemv looks it up at call time)."""
    from quantmesh.quant import kernel4 as k4

    launches = [0]
    real = k4._gemv_op

    def counted(*args, **kw):
        launches[0] += 1
        return real(*args, **kw)

    k4._gemv_op = counted
    return launches


def _tp_shards() -> list[dict]:
    from quantmesh.quant import kernel4 as k4
    from quantmesh.quant.prequant import slice_4bit

    _interpreter_tiles()
    out = []
    g = torch.Generator().manual_seed(4)
    for nested in (True, False):
        packed, qs = _weight(96, 256, nested)
        flat = packed.reshape(-1).view(torch.uint8)
        for dim, ranges in ((0, ((32, 64),)), (1, ((64, 192),))):
            codes, part = slice_4bit(qs, dim, ranges, lambda a, b, flat=flat: flat[a:b])
            for matmul, rows in ((k4.matmul_4bit_gemv, 1), (k4.matmul_4bit_gemv, 4),
                                 (k4.matmul_4bit_mma, 16)):  # fmt: skip
                x = torch.randn(rows, int(part.shape[1]), generator=g).to(torch.float16)
                y = matmul(x, codes, part)
                out.append(_product(y, x, codes, part, (matmul.__name__, dim, ranges, rows)))
                if nested and dim == 0:  # the op traced (its fake) and run compiled: same bits
                    step = torch.compile(lambda x, m=matmul, c=codes, q=part: m(x, c, q),
                                         backend="aot_eager", fullgraph=True)  # fmt: skip
                    out[-1]["ok"] &= bool(torch.equal(step(x), y))
    return out


def _joined() -> list[dict]:
    from quantmesh.quant import kernel4 as k4
    from quantmesh.quant.bnb import CodesRun, _joinable

    _interpreter_tiles()
    out = []
    g = torch.Generator().manual_seed(6)
    # nested: each member a whole number of nested blocks (256 blocks of 64); not: any rows
    for nested, outs, in_f in ((True, (64, 32, 96), 512), (False, (40, 24), 192)):
        members = []
        for i, o in enumerate(outs):
            # scales apart: each member's offset (the mean of its absmax) far from the others'
            packed, qs = _weight(o, in_f, nested, seed=10 + i, scale=0.02 * 4**i)
            m = torch.nn.Module()
            m.weight = torch.nn.Parameter(packed, requires_grad=False)
            m.weight.quant_state = qs
            members.append(m)
        before = [_dequantized(m.weight.data, m.weight.quant_state) for m in members]
        offsets = {float(m.weight.quant_state.offset) for m in members} if nested else set()
        ok = _joinable(members) and (not nested or len(offsets) == len(outs))  # offsets differ
        run = CodesRun(members)
        after = [_dequantized(m.weight.data, m.weight.quant_state) for m in members]
        views = all(m.weight.data.untyped_storage().data_ptr()
                    == run.codes.untyped_storage().data_ptr() for m in members)  # fmt: skip
        ok &= views and all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        out.append({"case": repr(("views", nested, outs)), "ok": bool(ok)})
        w = torch.cat(before)  # the joined weight, fp32
        for matmul, rows in ((k4.matmul_4bit_gemv, 1), (k4.matmul_4bit_gemv, 3),
                             (k4.matmul_4bit_mma, 16)):  # fmt: skip
            x = torch.randn(rows, in_f, generator=g).to(torch.float16)
            y = matmul(x, run.codes, run.qs)
            own = torch.cat([matmul(x, m.weight.data, m.weight.quant_state) for m in members], 1)
            ref = x.float() @ w.t()
            mm = (x @ w.to(x.dtype).t()).float()
            err = float((y.float() - ref).norm() / ref.norm())
            mm_err = float((mm - ref).norm() / ref.norm())
            ok = (y.shape == (rows, sum(outs)) and err <= max(2 * mm_err, 2e-3)
                  and torch.equal(y, own))  # fmt: skip
            out.append({"case": repr((matmul.__name__, nested, outs, rows)), "err": err,
                        "mm_err": mm_err, "ok": bool(ok)})  # fmt: skip
    return out + _joined_layers()


def _joined_layers() -> list[dict]:
    """Three 4-bit layers of quantmesh's reading one input, their codes joined
    (`join_sibling_codes`, with the switch on): the first one's forward launches the gemv once
    for all three and the others take their columns, eager and compiled (aot_eager), with the
    bits each gave alone; a layer given another tensor takes its own launch."""
    from quantmesh.quant import kernel4 as k4
    from quantmesh.quant.base import QuantConfig
    from quantmesh.quant.bnb import bnb_format, join_sibling_codes

    k4.KERNEL_DEVICES = ("cuda", "cpu")  # the interpreter runs the kernels on CPU
    fmt = bnb_format(QuantConfig(format="nf4"))
    g = torch.Generator().manual_seed(7)
    layers = []
    for i, o in enumerate((64, 32, 96)):
        m = fmt.new_linear(512, o, bias=False, device="meta", dtype=torch.float16)
        fmt.quantize_into(m, torch.randn(o, 512, generator=g) * 0.02 * 4**i)
        m.compute_dtype = torch.float16
        layers.append(m)
    launches = _count_gemv_launches()
    x, other = (torch.randn(1, 512, generator=g).to(torch.float16) for _ in range(2))

    def forward(x, y):
        return [m(x) for m in layers] + [layers[1](y)]  # the last: another tensor

    with torch.no_grad():
        alone = forward(x, other)
        n_alone = launches[0]
        k4.JOIN_ENABLED = False
        off = join_sibling_codes([layers])  # the switch off: nothing joined
        k4.JOIN_ENABLED = True
        on = join_sibling_codes([layers])
        launches[0] = 0
        joined = forward(x, other)
        n_joined = launches[0]
        compiled = torch.compile(forward, backend="aot_eager", fullgraph=True)(x, other)
    same = all(torch.equal(a, b) for a, b in zip(alone, joined, strict=True))
    same_c = all(torch.equal(a, b) for a, b in zip(alone, compiled, strict=True))
    ok = off == 0 and on == 1 and n_alone == 4 and n_joined == 2 and same and same_c
    case = ("layers", off, on, n_alone, n_joined, same, same_c)
    return [{"case": repr(case), "ok": bool(ok)}]


def _decode() -> list[dict]:
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    import quantmesh as qm
    from quantmesh.quant import kernel4 as k4
    from tests.models import nonzero_lora_b_

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000),
                      RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      QUANTMESH_COMPILE_BACKEND="aot_eager")  # fmt: skip
    k4.KERNEL_DEVICES = ("cuda", "cpu")  # the interpreter runs the kernels on CPU
    _interpreter_tiles()
    mesh = qm.init_mesh()
    # every projection a whole number of nested blocks (256 blocks of 64): q/k/v and gate/up join
    cfg = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=4, head_dim=32,
                      max_position_embeddings=64, attn_implementation="sdpa")  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.float16)
    quant = qm.QuantConfig(format="nf4", compute_dtype=torch.float16)
    qm.parallelize(model, mesh, quant=quant, lora=qm.LoraConfig(r=8), dtype=torch.float16)
    nonzero_lora_b_(model, std=0.2).eval()
    launches = _count_gemv_launches()
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(3))
    new = 3
    runs = {}
    try:
        for name, join, kw in (("plain", False, {"compile": False}),
                               ("joined_compiled", True, {"mode": None})):  # fmt: skip
            k4.JOIN_ENABLED = join
            launches[0] = 0
            runs[name] = (qm.fast_decode(model, ids, new, **kw)[0].tolist(), launches[0])
    finally:
        dist.destroy_process_group()
    (plain, n_plain), (comp, n_comp) = runs["plain"], runs["joined_compiled"]
    # every forward (the prefill's 6 rows too) launches 7 gemvs a layer alone, 4 joined; the
    # compiled decoder's first call finds the runs in an eager forward of the prompt's first
    # token (7, alone), then its compiled prefill and steps read them joined
    ok = comp == plain and n_plain == 7 * new and n_comp == 7 + 4 * new
    return [{"case": repr(("decode", runs)), "ok": bool(ok)}]


def _train() -> list[dict]:
    from quantmesh.quant import kernel4 as k4

    out = []
    g = torch.Generator().manual_seed(5)
    for (out_f, in_f), nested, rows in (((64, 512), True, 40), ((33, 192), False, 3)):
        packed, qs = _weight(out_f, in_f, nested)
        w = _dequantized(packed, qs).to(torch.float16)
        x0 = torch.randn(2, rows, in_f, generator=g).to(torch.float16)
        r = torch.randn(2, rows, out_f, generator=g).to(torch.float16)
        ref_x = x0.clone().requires_grad_()
        ref_y = torch.nn.functional.linear(ref_x, w)
        ref_y.backward(r)
        assert ref_x.grad is not None
        ref_g = torch.matmul(r.reshape(-1, out_f), w).reshape(ref_x.shape)

        def step(x, packed=packed, qs=qs):
            return k4.matmul_4bit_dequant(x, packed, qs)

        for how, fn in (("eager", step), ("compiled", torch.compile(step, backend="aot_eager",
                                                                     fullgraph=True))):  # fmt: skip
            x = x0.clone().requires_grad_()
            saved: list[tuple] = []

            def pack(t, saved=saved):
                saved.append((tuple(t.shape), t.dtype))
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                y = fn(x)
            y.backward(r)
            float_w = [s for s in saved if s[0] == (out_f, in_f) or s[0] == (in_f, out_f)]
            ok = (torch.equal(y, ref_y) and x.grad is not None and torch.equal(x.grad, ref_g)
                  and not float_w)  # fmt: skip
            out.append({"case": repr((how, out_f, in_f, nested, rows, saved)), "ok": bool(ok)})
    return out


def main(family: str) -> None:
    """Run one family's cases (TRITON_INTERPRET=1 must be set) and print them as one JSON line."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run with TRITON_INTERPRET=1 (the kernels are wrapped at import)")
    cases = {"gemv": _gemv, "mma": _mma, "dequant": _dequant, "rows": _rows,
             "tp_shards": _tp_shards, "joined": _joined, "decode": _decode,
             "train": _train}[family]()  # fmt: skip
    print(json.dumps(cases))
