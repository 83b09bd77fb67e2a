"""quantmesh's Triton kernels (quant/_triton4.py, through quant/kernel4.py's launchers) run by
Triton's interpreter on CPU, against bitsandbytes' own `dequantize_4bit` (CPU) and a matmul: the
kernels' arithmetic in `make test`, on any machine, where the CUDA tests need a GPU.

Each family of kernels runs in a process of its own with TRITON_INTERPRET=1 (read when
`triton.jit` wraps a kernel, so before quant/_triton4.py is imported), forked from a server that
imported the libraries once (`serve_families`):
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
  and compiled;
- the decode attention (infer/attention.py, `_triton_attention.py`): one query token against a
  float64 softmax attention, MHA and grouped-query, head dims 64, 128 and 80 (padded), batch 1
  and 3, keys not a multiple of a block, q, k and v strided as transformers hands them; masks
  none, bool (a static cache's unwritten tail, left padding, a sliding window, per head, one
  row for the batch) and float (0 / -inf, and finite biases with fp16's lowest as hidden); the
  library's tiles, small blocks in several splits, one split. The keys no head of a group sees
  hold NaN (a read of one shows) and the blocks each program read must be those holding a seen
  key (the skip); the op compiled gives the eager bits. Then `fast_decode` of a small fp16 Llama
  (nf4 + LoRA, grouped-query) with the switch on: sdpa's tokens, eager (left-padded rows too)
  and compiled, one launch a layer a step; by default (`MAX_ROWS`) two rows with sdpa and one
  with the kernel; and at tp=2 (two gloo ranks, each a shard's heads).

A product is right when its error against the fp32 product of x and the dequantized weight is at
most twice a plain matmul's on the same weight (the CUDA tests' rule). The interpreter rounds
fp32 to bf16 by truncation, not to nearest as a GPU does: a bf16 case's plain product is the fp32
one truncated the same way, the dequantize's bf16 weight must be bitsandbytes' fp32 weight
truncated, and the kernels that round each weight to x's dtype before multiplying (the row and
block kernels, the tensor-core one) run in fp16 here; the decode attention's bf16 output is
checked within an ulp (truncated), its fp16 output within half of one. What the interpreter cannot run is left to
the CUDA tests (tests/distributed/test_cuda_kernel4.py): warp shuffles (LUT 1: here every code
value is loaded, LUT 0) and bf16 `tl.dot` (its numpy bf16 products are wrong).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
FAMILIES = ("gemv", "mma", "dequant", "rows", "tp_shards", "joined", "decode", "train", "attention")
SLOW_FAMILIES = ("decode", "attention")  # 15-40 s each on 2 cores: `make test-fast` leaves them


@pytest.mark.parametrize(
    "family",
    [pytest.param(f, marks=pytest.mark.slow) if f in SLOW_FAMILIES else f for f in FAMILIES],
)
def test_triton_kernels_in_the_interpreter(family: str) -> None:
    run_family(family)


def run_family(family: str) -> None:
    """Run one family of cases in a process of its own with TRITON_INTERPRET=1; every case must
    hold (test_triton_low_rank.py runs one from its own module: another worker). The process is
    forked from this worker's family server (`_family_server`), which imported the libraries
    once, instead of a fresh interpreter importing torch, Triton and transformers again (~6 s of
    CPU a family on 2 cores)."""
    server = _family_server()
    with tempfile.TemporaryDirectory(prefix="qm-family-") as tmp:
        out = Path(tmp) / "out"
        assert server.stdin is not None and server.stdout is not None
        with contextlib.suppress(BrokenPipeError):  # (a server that died: said below)
            server.stdin.write(f"{family} {out}\n")
            server.stdin.flush()
        ready, _, _ = select.select([server.stdout], [], [], FAMILY_TIMEOUT_S)
        if not ready:  # stop the server and the family's process with it (their own session)
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(10)
            _family_server.cache_clear()
            pytest.fail(f"the {family} family did not finish in {FAMILY_TIMEOUT_S} s")
        status = server.stdout.readline().strip()
        if not status:  # the server itself ended (an import failed, say): the next starts anew
            server.wait(10)
            _family_server.cache_clear()
            said = Path(server.err_path).read_text(errors="replace")  # type: ignore[attr-defined]
            pytest.fail(f"the family server ended (status {server.returncode}) before running "
                        f"the {family} family:\n{said[-4000:]}")  # fmt: skip
        stdout = out.with_suffix(".stdout").read_text(errors="replace")
        stderr = out.with_suffix(".stderr").read_text(errors="replace")
    assert status == "0", f"the {family} family ended with status {status!r}:\n{stderr[-4000:]}"
    cases = json.loads(stdout.strip().splitlines()[-1])
    bad = [c for c in cases if not c["ok"]]
    assert cases and not bad, bad


FAMILY_TIMEOUT_S = 400


@functools.cache
def _family_server() -> subprocess.Popen:
    """This pytest process's family server (`serve_families`): TRITON_INTERPRET=1, in a session
    of its own; it ends when this process closes its stdin (at exit)."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT / "src"))
    code = "import tests.unit.test_triton_interpreter as t; t.serve_families()"
    err = tempfile.NamedTemporaryFile(prefix="qm-family-server-", suffix=".stderr", delete=False)
    server = subprocess.Popen([sys.executable, "-c", code], env=env, cwd=ROOT, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                              start_new_session=True)  # fmt: skip
    err.close()
    atexit.register(Path(err.name).unlink, missing_ok=True)
    server.err_path = err.name  # type: ignore[attr-defined]  # what it said (read if it ends)
    return server


def serve_families() -> None:
    """The family server: imports what the families use (with TRITON_INTERPRET=1, so that the
    kernels are wrapped for the interpreter), then for each line `FAMILY PATH` of stdin forks a
    process that runs `main(FAMILY)` with its stdout and stderr in PATH.stdout and PATH.stderr,
    and answers its exit status on a line of stdout. Each family starts from the server's state,
    as a fresh process would (nothing a family sets reaches the next); the server itself runs
    nothing, so that no thread or thread pool exists when it forks."""
    import bitsandbytes  # noqa: F401
    import peft  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401

    import quantmesh  # noqa: F401
    from quantmesh.infer import _triton_attention, attention  # noqa: F401
    from quantmesh.quant import _triton4, kernel4  # noqa: F401

    for line in sys.stdin:
        family, path = line.split()
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:  # the family's process
            code = 1
            try:
                with open(path + ".stdout", "w") as out, open(path + ".stderr", "w") as err:
                    os.dup2(out.fileno(), 1)
                    os.dup2(err.fileno(), 2)
                    try:
                        main(family)
                        code = 0
                    except BaseException:
                        traceback.print_exc()
                    finally:
                        sys.stdout.flush()
                        sys.stderr.flush()
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), flush=True)


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


def _within_ulp(y: torch.Tensor, want: torch.Tensor) -> bool:
    """Every element of `y` within one ulp of `want` (their dtype): two fp32 sums of a few
    products, added in different orders, may round to neighbours."""
    ulp = 2.0 ** (torch.frexp(want.float())[1].float() - 1) * torch.finfo(want.dtype).eps
    return bool(((y.float() - want.float()).abs() <= ulp).all())


def _low_rank_cases() -> list[dict]:
    """The gemv with a low-rank delta added as it stores (`launch_gemv(low_rank=...)`): each
    output the plain gemv's, plus `scale[n] * (e[n] @ t[:, col[n]:col[n] + r])` rounded to x's
    dtype on its own (within an ulp of that sum: its products are added in another order), at
    one share of K and several, the rank a power of two and not, a feature's columns running to
    t's end (a shorter member of a stack: masked), with a bias (added to the rounded product
    and rounded before the delta) and without; and bad tensors refused."""
    from quantmesh.quant import kernel4 as k4

    out = []
    g = torch.Generator().manual_seed(11)
    for (out_f, in_f), nested, r in (((64, 512), True, 4), ((33, 192), False, 3)):
        packed, qs = _weight(out_f, in_f, nested)
        flat = packed.reshape(-1).view(torch.uint8)
        R = 3 * r + 1  # three members' columns and one more
        col = (torch.arange(out_f) % 4 * r).clamp(max=R - 2).to(torch.int32)  # the last: R - 2
        sc = (torch.rand(out_f, generator=g) + 0.5).float()
        e = torch.randn(out_f, r, generator=g).float()
        e[col == R - 2, 2:] = 0.0  # a shorter member: its columns stop at R (never read past)
        for rows, dtype in ((1, torch.bfloat16), (3, torch.float16), (8, torch.float16)):
            x = torch.randn(rows, in_f, generator=g).to(dtype)
            t = torch.randn(rows, R, generator=g).float()
            lib = dict(k4.gemv_config(rows, out_f, in_f, 64), LUT=0)
            bias = (torch.randn(out_f, generator=g) * 4).to(dtype)
            for cfg, b in ((dict(lib, BLOCK_N=16, BLK=0), None), (dict(lib, BLOCK_N=16, BLK=0), bias),
                           (dict(lib, BLOCK_N=8, SB=4, BLK=4), None),
                           (dict(lib, BLOCK_N=8, SB=4, BLK=4), bias)):  # fmt: skip
                plain = k4.launch_gemv(x, flat, *_stats(qs), 64, "nf4", out_f, cfg)
                y = k4.launch_gemv(x, flat, *_stats(qs), 64, "nf4", out_f, cfg,
                                   low_rank=(t, e, col, sc, b))  # fmt: skip
                cols = (col[:, None] + torch.arange(r)).clamp(max=R - 1)  # (out, r)
                d = (t[:, cols] * e).sum(-1) * sc  # (rows, out): the delta, fp32
                # the interpreter rounds fp32 to bf16 by truncation (fp16: to nearest)
                rnd = _truncated if dtype == torch.bfloat16 else (lambda v, dt=dtype: v.to(dt))
                base = plain if b is None else rnd(plain.float() + b.float())  # (y + bias) first
                want = rnd(base.float() + rnd(d).float())
                ok = y.dtype == dtype and _within_ulp(y, want) and _counts_back_at_zero()
                ok &= bool((y != base).any())  # the delta is there
                case = ("low_rank", out_f, in_f, rows, r, cfg, b is not None)
                out.append({"case": repr(case), "ok": ok})
    x = torch.randn(1, 192, dtype=torch.bfloat16)
    packed, qs = _weight(33, 192, False)
    flat = packed.reshape(-1).view(torch.uint8)
    lib = dict(k4.gemv_config(1, 33, 192, 64), LUT=0)
    z = torch.zeros
    i32 = torch.int32
    for bad in (
        (z(1, 4), z(33, 4), z(33), z(33), None),  # col not int32
        (z(1, 4), z(33, 4, dtype=torch.float16), z(33, dtype=i32), z(33), None),
        (z(1, 4), z(33, 4), z(33, dtype=i32), z(33), z(33)),  # a bias not in x's dtype
        (z(1, 4), z(33, 4), z(33, dtype=i32), z(33), z(32, dtype=torch.bfloat16)),
        (z(1, 2), z(33, 4), z(33, dtype=i32), z(33), None),
    ):  # rank past t's width
        try:
            k4.launch_gemv(x, flat, *_stats(qs), 64, "nf4", 33, lib, low_rank=bad)
            refused = False
        except ValueError as err:
            refused = "low-rank" in str(err) or "rank" in str(err)
        said = [None if b is None else (tuple(b.shape), b.dtype) for b in bad]
        out.append({"case": repr(("refused", said)), "ok": refused})
    return out


def _low_rank() -> list[dict]:
    return _low_rank_cases() + _low_rank_layers() + _low_rank_decode() + _low_rank_tp()


def _low_rank_layers() -> list[dict]:
    """Three 4-bit layers reading one input, their codes joined, given a stack's deltas
    (`LowRank`, `whole` for all three): eager and compiled, the first one's launch adds every
    sibling's delta, and each layer's output is its own product plus its delta (within an ulp);
    a sibling called without its delta (as one whose base refuses it would be) gets its product
    alone, not columns holding a delta it would add again, and the next sibling still gets its
    delta. The first and third have biases, which the joined launch adds (zeros for the second)
    once the run holds them joined (`CodesRun.refresh_bias`); before that, no sibling takes its
    delta (the launch would drop the biases)."""
    from quantmesh.lora.adapter import LowRank
    from quantmesh.quant import kernel4 as k4
    from quantmesh.quant.base import QuantConfig
    from quantmesh.quant.bnb import bnb_format, join_sibling_codes

    k4.KERNEL_DEVICES = ("cuda", "cpu")  # the interpreter runs the kernels on CPU
    _interpreter_tiles()
    fmt = bnb_format(QuantConfig(format="nf4"))
    g = torch.Generator().manual_seed(12)
    outs, r = (64, 32, 96), 4
    layers = []
    for i, o in enumerate(outs):
        m = fmt.new_linear(512, o, bias=False, device="meta", dtype=torch.float16)
        fmt.quantize_into(m, torch.randn(o, 512, generator=g) * 0.02 * 4**i)
        m.compute_dtype = torch.float16
        if i != 1:
            m.bias = torch.nn.Parameter(torch.randn(o, generator=g).to(torch.float16))
        layers.append(m)
    x = torch.randn(1, 512, generator=g).to(torch.float16)
    a = torch.randn(3 * r, 512, generator=g) * 0.05  # the stack's A rows (fp32)
    e = torch.randn(sum(outs), r, generator=g)
    member = torch.repeat_interleave(torch.arange(3), torch.tensor(outs))
    col = (member * r).to(torch.int32)
    sc = (member.float() + 1) * 0.5

    def down(v):
        return v.float() @ a.t()

    with torch.no_grad():
        plain = [m(x) for m in layers]
        k4.JOIN_ENABLED = True
        assert join_sibling_codes([layers]) == 1
        run = layers[0].codes_run
        whole = LowRank(e, col, sc, down, None, run.member_ids)
        at = [0, outs[0], outs[0] + outs[1], sum(outs)]
        lrs = [LowRank(e[at[i] : at[i + 1]], col[at[i] : at[i + 1]], sc[at[i] : at[i + 1]], down,
                       whole, run.member_ids) for i in range(3)]  # fmt: skip
        k4.GEMV_LORA_ENABLED = True
        before = [m.takes_low_rank(x, lr) for m, lr in zip(layers, lrs, strict=True)]
        run.refresh_bias(torch.float16, layers)
        takes = [m.takes_low_rank(x, lr) for m, lr in zip(layers, lrs, strict=True)]
        fused = _count_calls(k4, "_gemv_lora_op")

        def forward(x, skip=None):
            return [m(x) if i == skip else m(x, low_rank=lrs[i]) for i, m in enumerate(layers)]

        eager = forward(x)
        n_eager = fused[0]
        compiled = torch.compile(forward, backend="aot_eager", fullgraph=True)(x)
        fused[0] = 0
        skipped = forward(x, skip=1)  # the second without its delta: its own product
        n_skipped = fused[0]
        k4.GEMV_LORA_ENABLED = False
    out = []
    for i in range(3):
        d = (down(x)[:, col[at[i] : at[i + 1], None] + torch.arange(r)] * lrs[i].e).sum(-1)
        want = (plain[i].float() + (d * lrs[i].scale).to(torch.float16).float()).to(torch.float16)
        ok = _within_ulp(eager[i], want) and torch.equal(compiled[i], eager[i])
        ok &= torch.equal(skipped[i], plain[i]) if i == 1 else torch.equal(skipped[i], eager[i])
        out.append({"case": repr(("layers", i, before, takes, n_eager, n_skipped)),
                    "ok": bool(ok)})  # fmt: skip
    # one launch for all three; skipping the second: the first's launch (the third takes its
    # columns), the second's plain launch
    out[0]["ok"] &= before == [False] * 3 and takes == [True] * 3
    out[0]["ok"] &= n_eager == 1 and n_skipped == 1
    return out


def _low_rank_tp_rank(rank: int) -> dict:
    """One rank of `_low_rank_tp`: its tokens and gemv launches (plain, fused), switch off, on."""
    import quantmesh as qm
    from quantmesh.quant import kernel4 as k4

    k4.KERNEL_DEVICES = ("cuda", "cpu")  # the interpreter runs the kernels on CPU
    _interpreter_tiles()
    model = _fp16_qlora_llama(qm.init_mesh(tp=2), layers=2, kv_heads=2, positions=64, bias=True)
    plain, fused = _count_gemv_launches(), _count_calls(k4, "_gemv_lora_op")
    ids = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(3))
    out = {}
    for name, on in (("off", False), ("on", True)):
        k4.GEMV_LORA_ENABLED = on
        plain[0] = fused[0] = 0
        out[name] = (qm.fast_decode(model, ids, 3, compile=False).tolist(), plain[0], fused[0])
    k4.GEMV_LORA_ENABLED = False
    return out


def _low_rank_tp() -> list[dict]:
    """fast_decode at tp=2 (the colwise shards' B rows in their own gemvs, with their biases'
    shards; o and down rowwise, their deltas added as before) with the switch on: the switch-off
    tokens on both ranks, every colwise launch of a step fused."""
    from quantmesh.testing import run_ranks

    r0, r1 = run_ranks(_low_rank_tp_rank, 2, timeout=300,
                       env={"QUANTMESH_COMPILE_BACKEND": "aot_eager"})  # fmt: skip
    # (plain, fused) gemv launches: the prefill's 12 rows take the tensor-core kernel; a step's
    # 2 rows the gemv, 6 launches a layer (gate and up joined); the first call (off) finds the
    # runs in a forward of the first token (7 a layer, unjoined); on, the 4 colwise launches a
    # layer carry their deltas (the joined one too), o and down (rowwise) stay plain
    ok = all(r["on"][0] == r["off"][0] == r0["off"][0] and r["off"][1:] == (14 + 2 * 12, 0)
             and r["on"][1:] == (2 * 4, 2 * 8) for r in (r0, r1))  # fmt: skip
    return [{"case": repr(("tp=2", r0, r1)), "ok": bool(ok)}]


def _low_rank_decode() -> list[dict]:
    """`fast_decode` of a small fp16 Llama (nf4 + LoRA on all seven projections) with the
    adapters' B products inside the gemv's launch (`GEMV_LORA_ENABLED`): the tokens of the
    switch off, eager and compiled (aot_eager), the siblings' codes joined or not; every 4-bit
    launch of a step carries its delta (the plain gemv only where a joined prefill's adapters
    are not stacked), and one forward of a row gives the logits of the switch off. The attention's
    projections have biases: the launch adds them (q/k/v joined: their run's, made after each
    prefill by `prepare_low_rank`)."""
    import torch.distributed as dist

    import quantmesh as qm
    from quantmesh.quant import kernel4 as k4

    model = _one_rank_llama(bias=True)
    plain, fused = _count_gemv_launches(), _count_calls(k4, "_gemv_lora_op")
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(3))
    new = 3
    runs = {}
    try:
        with torch.no_grad():  # one row, adapters unstacked: o and down fused, the rest joined
            k4.GEMV_LORA_ENABLED = False
            ref = model(input_ids=ids[:, :1]).logits
            k4.GEMV_LORA_ENABLED = True
            plain[0] = fused[0] = 0
            one = model(input_ids=ids[:, :1]).logits
            one_counts = (plain[0], fused[0])
        for name, join, on, kw in (("off", True, False, {"compile": False}),
                                   ("on", True, True, {"compile": False}),
                                   ("on_compiled", True, True, {"mode": None}),
                                   ("on_unjoined", False, True, {"compile": False})):  # fmt: skip
            k4.JOIN_ENABLED, k4.GEMV_LORA_ENABLED = join, on
            plain[0] = fused[0] = 0
            runs[name] = (qm.fast_decode(model, ids, new, **kw)[0].tolist(), plain[0], fused[0])
        # a prompt of 12 tokens: its prefill (the tensor-core kernel's rows) makes no adapter's
        # launch tensors, and they are dropped first; fast_decode makes them after the prefill
        # (prepare_low_rank), before the step is traced, so that o and down fuse there too
        from quantmesh.tp.layers import sharded_modules

        for m in sharded_modules(model).values():
            if m.lora is not None:
                m.lora.__dict__.pop("_low_rank_vectors", None)
        long_ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(4))
        k4.JOIN_ENABLED, k4.GEMV_LORA_ENABLED = False, True
        plain[0] = fused[0] = 0
        out_long = qm.fast_decode(model, long_ids, new, mode=None)[0].tolist()
        long_counts = (plain[0], fused[0])
        k4.GEMV_LORA_ENABLED = False
        ref_long = qm.fast_decode(model, long_ids, new, mode=None)[0].tolist()
    finally:
        dist.destroy_process_group()
    err = float((one.float() - ref.float()).norm() / ref.float().norm())
    # (plain gemv launches, fused ones): the first call (switch off) finds the runs in a forward
    # of the first token (7 plain launches), joins them, prefills (4) and steps (4 each, new - 1
    # steps); with the switch on, an unstacked joined run stays plain (q/k/v, gate/up: the
    # prefill's 2) and every step's 4 launches are fused; the compiled decoder finds the runs
    # again (2 plain, 2 fused); unjoined, all 7 a forward are fused
    steps = new - 1
    want = {"off": (7 + 4 + 4 * steps, 0), "on": (2, 2 + 4 * steps),
            "on_compiled": (2 + 2, 2 + 2 + 4 * steps), "on_unjoined": (0, 7 + 7 * steps)}  # fmt: skip
    out = [{"case": repr(("one row", one_counts, err)), "ok": err < 2e-3 and one_counts == (0, 7)},
           {"case": repr(("long prompt", out_long, ref_long, long_counts)),
            "ok": out_long == ref_long and long_counts == (0, 7 * steps)}]  # fmt: skip
    for name, run in runs.items():
        ok = run[0] == runs["off"][0] and run[1:] == want[name]
        out.append({"case": repr((name, run, want[name])), "ok": ok})
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
        # more rows than a program's BLOCK_M (the dequantization as a GEMM's prologue): a program
        # per BLOCK_M rows, K in one share; the last program's rows partly masked off
        x = torch.randn(81, in_f, generator=g).to(torch.float16)
        for cfg in (dict(LUT=0, BLOCK_M=16, BLOCK_N=32, NB=2, BLK=0),
                    dict(LUT=0, BLOCK_M=32, BLOCK_N=16, NB=1, BLK=0)):  # fmt: skip
            y = k4.launch_mma(x, flat, *_stats(qs), 64, "nf4", out_f, cfg)
            out.append(_product(y, x, packed, qs, ("mma rows", out_f, in_f, 81, cfg)))
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
    the gemv's with fewer programs, 64 features each (the interpreter runs each in turn, and a
    program's arrays cost it little more than a narrow one's: the low-rank family took 119 s at
    16 features a program, 46 s at 64), in strides of 4 blocks (one step of 32 words: the small
    models' rows are 2 to 4 blocks long, and a stride of 32 blocks ran 7 fully masked steps in
    8; the low-rank decode's cases took 40 s so, 20 s at 4). The kernels' own cases set their
    tiles themselves (the library's strides of 32 among them)."""
    from quantmesh.quant import kernel4 as k4

    for tile in (*k4.GEMV_ROW_TILES.values(), *k4.MMA_ROW_TILES.values()):
        tile["LUT"] = 0
    for tile in k4.GEMV_ROW_TILES.values():
        tile["BLOCK_N"] = 64
        tile["SB"] = 4


def _fp16_qlora_llama(mesh, layers: int, kv_heads: int, positions: int, bias: bool = False):
    """A small fp16 sdpa Llama (hidden 128 = 4 heads of 32: every projection a whole number of
    nested blocks, so q/k/v and gate/up can join), nf4 + LoRA r8 with nonzero B, in eval mode;
    `bias`: the attention's projections with biases (random: transformers zeroes them)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import quantmesh as qm
    from tests.models import nonzero_lora_b_

    cfg = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=kv_heads, head_dim=32,
                      max_position_embeddings=positions, attn_implementation="sdpa",
                      attention_bias=bias)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.float16)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(".bias"):
                p.normal_(0.0, 0.5)
    quant = qm.QuantConfig(format="nf4", compute_dtype=torch.float16)
    qm.parallelize(model, mesh, quant=quant, lora=qm.LoraConfig(r=8), dtype=torch.float16)
    return nonzero_lora_b_(model, std=0.2).eval()


def _one_rank_llama(bias: bool = False):
    """`_fp16_qlora_llama` of one layer on a one-rank mesh (gloo, this process; aot_eager
    compiles), the kernels run by the interpreter at its tiles. Every projection is a whole number
    of nested blocks (256 blocks of 64): q/k/v and gate/up join."""
    import quantmesh as qm
    from quantmesh.quant import kernel4 as k4

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000),
                      RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      QUANTMESH_COMPILE_BACKEND="aot_eager")  # fmt: skip
    k4.KERNEL_DEVICES = ("cuda", "cpu")  # the interpreter runs the kernels on CPU
    _interpreter_tiles()
    return _fp16_qlora_llama(qm.init_mesh(), layers=1, kv_heads=4, positions=64, bias=bias)


def _count_calls(module, name: str) -> list[int]:
    """A one-item list counting the calls of `module.name` from here on (wrapped in this process:
    its callers look it up at call time)."""
    launches = [0]
    real = getattr(module, name)

    def counted(*args, **kw):
        launches[0] += 1
        return real(*args, **kw)

    setattr(module, name, counted)
    return launches


def _count_gemv_launches() -> list[int]:
    """A one-item list counting the gemv's launches from here on (matmul_4bit_gemv's op)."""
    from quantmesh.quant import kernel4 as k4

    return _count_calls(k4, "_gemv_op")


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
            # the gemv's bits are its own; the interpreter runs the tensor-core kernel's
            # tl.dot as numpy's matmul, whose BLAS may round a column by its place in the tile
            # (one ulp seen on an AMD host): there, within one ulp of x's dtype
            ulp = 0.0 if matmul is k4.matmul_4bit_gemv else 2.0**-10
            same = bool(((y.float() - own.float()).abs() <= ulp * own.float().abs()).all())
            ok = y.shape == (rows, sum(outs)) and err <= max(2 * mm_err, 2e-3) and same
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

    import quantmesh as qm
    from quantmesh.quant import kernel4 as k4

    model = _one_rank_llama()
    launches = _count_gemv_launches()
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(3))
    new = 3
    runs = {}
    # the join's launches alone: the adapters' deltas stay outside them (the low-rank family
    # decodes with them inside, the default where the gemv runs)
    k4.GEMV_LORA_ENABLED = False
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
    # first call finds the runs in a forward of the prompt's first token (7), joins them, then
    # prefills the prompt on the joined codes (4) and steps (4 each)
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


# ---- decode attention (infer/attention.py) ------------------------------------------------------
def _attention_reference(q, k, v, mask, scaling) -> torch.Tensor:
    """softmax(q k^T * scaling + mask) v in float64, (B, 1, Hq, D): each query head reads kv head
    head // (Hq / Hkv); a bool mask hides where False, a float one is added."""
    groups = q.shape[1] // k.shape[1]
    kk = k.double().repeat_interleave(groups, 1)
    vv = v.double().repeat_interleave(groups, 1)
    s = (q.double() @ kk.transpose(-1, -2)) * scaling
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.double()
    return (torch.softmax(s, dim=-1) @ vv).transpose(1, 2)


def _attention_masks(B: int, Hq: int, L: int, dtype, g) -> dict:
    """The masks transformers' sdpa path hands a decode step, and a few beyond: name -> mask
    (None, bool where True attends, or float added), broadcastable to (B, Hq, 1, L)."""
    keys = torch.arange(L)
    filled = torch.randint(L // 3, L, (B,), generator=g)
    filled[0] = L - 1  # a row whose last block is partly filled
    pos = filled - 1  # the query's own position (a static cache's last written slot)
    tail = keys[None, :] <= pos[:, None]  # (B, L): the written slots
    start = torch.randint(0, L // 4, (B,), generator=g)
    start[0] = 0
    left = tail & (keys[None, :] >= start[:, None])  # left padding: the row starts later
    window = tail & (keys[None, :] > pos[:, None] - 40)  # a sliding window of 40 keys
    heads = tail[:, None, :] & (torch.rand(B, Hq, L, generator=g) < 0.7)  # per head, random
    heads[..., 0] = True  # every head sees a key
    low = torch.finfo(torch.float16).min
    bias = -2 * torch.rand(B, 1, 1, L, generator=g)  # finite biases: added, never hidden
    return {
        "none": None,
        "static_tail": tail[:, None, None, :],
        "left_padded": left[:, None, None, :],
        "sliding_window": window[:, None, None, :],
        "per_head": heads[:, :, None, :],
        "one_row": tail[:1, None, None, :],  # broadcast over the batch
        "float_inf": torch.where(left, 0.0, float("-inf"))[:, None, None, :].to(dtype),
        "float_low": torch.where(window[:, None, None, :], bias, low).float(),
    }


def _sees(mask, B: int, Hq: int, L: int) -> torch.Tensor:
    """(B, Hq, L) bool: the keys each query head sees under `mask`."""
    from quantmesh.infer.attention import HIDDEN

    if mask is None:
        return torch.ones(B, Hq, L, dtype=torch.bool)
    seen = mask if mask.dtype == torch.bool else mask.float() > HIDDEN
    return seen.expand(B, Hq, 1, L)[:, :, 0]


def _attention_case(q, k, v, mask, cfg, what) -> dict:
    """The kernel at `cfg` against the float64 reference, with every key no head of a group
    sees poisoned (NaN in K and V: a read of one shows), and the blocks each program read
    (`counts`) equal to the blocks holding a key its heads see."""
    from quantmesh.infer import attention as A

    B, Hq, _, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    G = Hq // Hkv
    scaling = D**-0.5
    full = dict(A.decode_config(B, Hkv, G, D, L), **(cfg or {}))
    block, per = full["BLOCK_L"], full["SPLIT"]
    splits = -(-L // per)
    sees = _sees(mask, B, Hq, L).reshape(B, Hkv, G, L).any(dim=2)  # (B, Hkv, L): the group's
    kp, vp = (t.new_empty(B, Hkv, L + 5, D)[:, :, :L].copy_(t) for t in (k, v))  # strided
    kp[~sees] = float("nan")
    vp[~sees] = float("nan")
    pad = -(-L // block) * block
    blocks = torch.nn.functional.pad(sees, (0, pad - L)).reshape(B * Hkv, pad // block, block)
    want = blocks.any(dim=2).int()  # (B * Hkv, blocks): a block read iff a key in it is seen
    want = torch.nn.functional.pad(want, (0, splits * (per // block) - want.shape[1]))
    want = want.reshape(B * Hkv, splits, per // block).sum(dim=2)
    counts = torch.full((B * Hkv, splits), -1, dtype=torch.int32)
    out = A.launch_decode_attention(q, kp, vp, mask, scaling, cfg, counts=counts)
    ref = _attention_reference(q, k, v, mask, scaling)
    # the output's rounding: fp16 to nearest (half an ulp, 2^-11), the interpreter's bf16 by
    # truncation (an ulp, 2^-7); twice that, relative to each value (plus a hundredth of the
    # largest, for values near 0)
    u = 2.0**-10 if q.dtype == torch.float16 else 2.0**-6
    err = (out.double() - ref).abs()
    tol = u * (ref.abs() + 0.01 * ref.abs().max())
    ok = (out.shape == (B, 1, Hq, D) and out.dtype == q.dtype and out.is_contiguous()
          and bool(torch.isfinite(out).all()) and bool((err <= tol).all())
          and torch.equal(counts, want))  # fmt: skip
    return {"case": repr(what + (full, splits)), "err": float((err / tol).max()),
            "read": int(counts.sum()), "blocks": int(-(-L // block) * B * Hkv), "ok": bool(ok)}  # fmt: skip


def _attention_kernel() -> list[dict]:
    out = []
    g = torch.Generator().manual_seed(11)
    # (batch, query heads, kv heads, head dim, keys, dtype): MHA and GQA (3 query heads a kv head:
    # padded to 4), head dims 64 and 128 (and 80: padded), keys not a multiple of a block
    shapes = ((3, 4, 4, 64, 200, torch.float16), (3, 8, 2, 128, 150, torch.float16),
              (1, 6, 2, 80, 131, torch.float16), (3, 4, 2, 64, 200, torch.bfloat16))  # fmt: skip
    for B, Hq, Hkv, D, L, dtype in shapes:
        # q as transformers makes it (a transposed view), k and v a view of a longer cache
        q = torch.randn(B, 1, Hq, D, generator=g).to(dtype).transpose(1, 2)
        k = torch.randn(B, Hkv, L + 9, D, generator=g).to(dtype)[:, :, :L]
        v = torch.randn(B, Hkv, L + 9, D, generator=g).to(dtype)[:, :, :L]
        masks = _attention_masks(B, Hq, L, dtype, g)
        if dtype == torch.bfloat16:
            masks = {n: masks[n] for n in ("static_tail", "float_low")}
        for name, mask in masks.items():
            # the library's tiles, small blocks in splits of 2, a split of 3 blocks, one split
            tiles = [None, dict(BLOCK_L=16, SPLIT=32)]
            if name in ("static_tail", "float_low"):
                tiles += [dict(BLOCK_L=16, SPLIT=48), dict(BLOCK_L=32, SPLIT=32 * -(-L // 32))]
            for cfg in tiles:
                out.append(_attention_case(q, k, v, mask, cfg, (B, Hq, Hkv, D, L, str(dtype),
                                                                name)))  # fmt: skip
    # the op traced (its fake) and run compiled: the same bits
    from quantmesh.infer.attention import decode_attention_op

    q, k, v = (torch.randn(2, h, n, 64, generator=g).half() for h, n in ((4, 1), (2, 90), (2, 90)))
    mask = _attention_masks(2, 4, 90, torch.float16, g)["left_padded"]
    eager = decode_attention_op(q, k, v, mask, 0.125)
    step = torch.compile(decode_attention_op, backend="aot_eager", fullgraph=True)
    out.append({"case": "compiled op", "ok": bool(torch.equal(step(q, k, v, mask, 0.125), eager))})
    return out


def _count_attention_launches() -> list[int]:
    """A one-item list counting the decode attention kernel's launches from here on (its
    launcher: the op looks it up at call time)."""
    from quantmesh.infer import attention as A

    return _count_calls(A, "launch_decode_attention")


def _attention_decode() -> list[dict]:
    """fast_decode of a small fp16 Llama (nf4 + LoRA, grouped-query attention) with the switch
    on (it enters `decode_attention(model)` itself): the tokens of sdpa's run, eager and
    compiled (aot_eager), left-padded rows too, with one kernel launch a layer a step (none in
    the prefill), the model's implementation given back after; with the switch off, none (also
    inside the context)."""
    import torch.distributed as dist

    import quantmesh as qm
    from quantmesh.infer import attention as A

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000),
                      RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      QUANTMESH_COMPILE_BACKEND="aot_eager")  # fmt: skip
    A.KERNEL_DEVICES = ("cuda", "cpu")  # the interpreter runs the kernel on CPU
    mesh = qm.init_mesh()
    layers = 2
    default_rows = A.MAX_ROWS
    model = _fp16_qlora_llama(mesh, layers=layers, kv_heads=2, positions=300)
    launches = _count_attention_launches()
    ids = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(3))
    pad = torch.ones(2, 6, dtype=torch.long)
    pad[1, :2] = 0  # the second row left-padded
    new = 4
    out = []
    # (compiled, padded): eager with and without padding, compiled as fast_decode runs by default
    # (each compile of the step costs seconds here)
    try:
        for compile, mask in ((False, None), (False, pad), (True, None)):
            kw = dict(compile=compile, mode=None, attention_mask=mask)
            runs = {}
            # sdpa's run; the switch off inside the context (sdpa through it); the switch on
            # (fast_decode enters the context itself)
            for name, on, inside in (("sdpa", False, False), ("off", False, True),
                                     ("kernel", True, False)):  # fmt: skip
                if compile and name == "off":
                    continue  # eager shows it
                A.ENABLED, A.MAX_ROWS = on, None  # two rows: the kernel at any batch
                launches[0] = 0
                with A.decode_attention(model) if inside else contextlib.nullcontext():
                    runs[name] = (qm.fast_decode(model, ids, new, **kw).tolist(), launches[0])
                runs[name] += (model.config._attn_implementation,)
            ok = (runs["kernel"][0] == runs["sdpa"][0] == runs.get("off", runs["sdpa"])[0]
                  and runs["kernel"][1] == layers * (new - 1)
                  and runs["sdpa"][1] == runs.get("off", runs["sdpa"])[1] == 0
                  and all(r[2] == "sdpa" for r in runs.values()))  # fmt: skip
            out.append({"case": repr(("decode", compile, mask is not None, runs)), "ok": bool(ok)})
        # the default rows (MAX_ROWS, one): two rows decode with sdpa, one row with the kernel
        A.ENABLED, A.MAX_ROWS = True, default_rows
        counts = []
        for rows in (ids, ids[:1]):
            launches[0] = 0
            got = qm.fast_decode(model, rows, new, compile=False, mode=None).tolist()
            counts.append(launches[0])
            A.ENABLED = False
            want = qm.fast_decode(model, rows, new, compile=False, mode=None).tolist()
            A.ENABLED = True
            counts.append(got == want)
        ok = default_rows == 1 and counts == [0, True, layers * (new - 1), True]
        out.append({"case": repr(("default rows", default_rows, counts)), "ok": bool(ok)})
    finally:
        A.ENABLED, A.MAX_ROWS = False, default_rows
        dist.destroy_process_group()
    return out


def _attention_tp_rank(rank: int) -> dict:
    """One rank of `_attention_tp`: its tokens and kernel launches, sdpa's and the kernel's."""
    import quantmesh as qm
    from quantmesh.infer import attention as A

    A.KERNEL_DEVICES = ("cuda", "cpu")  # the interpreter runs the kernel on CPU
    A.MAX_ROWS = None  # two rows: the kernel at any batch (its wiring)
    model = _fp16_qlora_llama(qm.init_mesh(tp=2), layers=2, kv_heads=2, positions=300)
    launches = _count_attention_launches()
    ids = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(3))
    out = {}
    for name, on in (("sdpa", False), ("kernel", True)):
        A.ENABLED = on
        launches[0] = 0
        out[name] = (qm.fast_decode(model, ids, 4, compile=False).tolist(), launches[0])
    A.ENABLED = False
    return out


def _attention_tp() -> list[dict]:
    """fast_decode at tp=2 (each rank two query heads and one kv head of the small Llama) with
    the switch on: sdpa's tokens on both ranks, one launch a layer a step on each."""
    from quantmesh.testing import run_ranks

    r0, r1 = run_ranks(_attention_tp_rank, 2, timeout=300,
                       env={"QUANTMESH_COMPILE_BACKEND": "aot_eager"})  # fmt: skip
    ok = all(r["kernel"][0] == r["sdpa"][0] == r0["sdpa"][0] and r["kernel"][1] == 2 * 3
             and r["sdpa"][1] == 0 for r in (r0, r1))  # fmt: skip
    return [{"case": repr(("tp=2", r0, r1)), "ok": bool(ok)}]


def _attention() -> list[dict]:
    return _attention_kernel() + _attention_decode() + _attention_tp()


def nested_patches_skipped() -> list[int] | None:
    """Make Triton's interpreter patch `triton.language` once a launch, not again at every call
    of a nested `@triton.jit` function; return the count of patches skipped (a one-item list, kept
    up to date), or None where this Triton's interpreter has no such step.

    The interpreter patches the language's builtins (`inspect.getmembers` over its modules) when a
    kernel launches, restoring them when it ends, and again, without restoring, at every call of a
    device function inside it (`tl.zeros`, `tl.max` and the kernels' own helpers are such
    functions). A patch sets the same attributes to equivalent wrappers each time, so within a
    launch only the first call whose module sees a given set of language modules (`tl`,
    `tl.core`) needs it: later ones skip it. What the interpreter computes is unchanged: the
    families check every case as before."""
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if patch is None or scope_type is None:
        return None
    if hasattr(patch, "skipped"):  # installed already (this module imported again)
        return patch.skipped
    held: list[set[int]] = []  # the language modules patched since the running launch began
    skipped = [0]
    seen: dict[object, set[int]] = {}

    def _langs(fn) -> set[int]:
        if fn not in seen:
            seen[fn] = {id(v) for v in fn.__globals__.values()
                        if inspect.ismodule(v) and v in (tl, tl.core)}  # fmt: skip
        return seen[fn]

    def patch_once(fn):
        if held:  # a device function called inside a launch
            langs = _langs(fn)
            if langs <= held[-1]:
                skipped[0] += 1
                return scope_type()
            held[-1] |= langs  # patched from here to the launch's end (never restored)
            return patch(fn)
        scope = patch(fn)
        held.append(set(_langs(fn)))
        restore = scope.restore

        def restore_and_release() -> None:
            held.pop()
            restore()

        scope.restore = restore_and_release
        return scope

    patch_once.skipped = skipped  # type: ignore[attr-defined]
    interpreter._patch_lang = patch_once
    return skipped


if os.environ.get("TRITON_INTERPRET") == "1":  # this family's process, and the ranks it starts
    nested_patches_skipped()


def main(family: str) -> None:
    """Run one family's cases (TRITON_INTERPRET=1 must be set) and print them as one JSON line."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run with TRITON_INTERPRET=1 (the kernels are wrapped at import)")
    cases = {"gemv": _gemv, "low_rank": _low_rank, "mma": _mma, "dequant": _dequant, "rows": _rows,
             "tp_shards": _tp_shards, "joined": _joined, "decode": _decode,
             "train": _train, "attention": _attention}[family]()  # fmt: skip
    # the shortcut still applies (a Triton without `_patch_lang` would run these families ~1.5x
    # slower, silently): every family's kernels call device functions (`tl.zeros` at least)
    skipped = nested_patches_skipped()
    cases.append({"case": "nested_patches_skipped", "skipped": skipped and skipped[0],
                  "ok": bool(skipped and skipped[0] > 0)})  # fmt: skip
    print(json.dumps(cases))
