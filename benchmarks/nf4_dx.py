"""An experiment for `nf4_prologue_bench.py`: the input gradient of an nf4 linear, dx = g @ W, on
tensor cores with the codes dequantized in the GEMM's prologue (a Triton kernel, not in the
library until it wins).

Training's backward multiplies the output gradient g (rows, out) by the weight W (out, in): the
reduction runs over W's rows, so a program reads the codes of BLOCK_R rows of W at a time, for
its BLOCK_K inputs (whole blocks of 64: one absmax a row and block). Byte j of a row holds inputs
2j (high nibble) and 2j + 1 (low): the high nibbles give the even inputs' sums, the low the odd,
in two MMAs, and the two are interleaved as they are stored. Each value is scaled by its block's
absmax in fp32 and rounded to g's dtype first: the weight bitsandbytes' `dequantize_4bit` writes.

Import this module after TRITON_INTERPRET is set where the interpreter should run it (the
kernel is wrapped on import).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantmesh.quant._triton4 import _code_value, _lane_id, _lane_table, absmax_of


@triton.jit
def qm_mma_4bit_dx(g_ptr, q_ptr, am_ptr, am2_ptr, code2_ptr, off_ptr, lut_ptr, dx_ptr,
                   M, N, K, NBLK, zero,
                   BS2: tl.constexpr, NESTED: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, LUT: tl.constexpr):  # fmt: skip
    # dx (M, K) = g (M, N) @ W (N, K): a program owns BLOCK_M rows and BLOCK_K inputs (a multiple
    # of 64) and walks W's N rows BLOCK_R at a time; `zero` (0 at run time): the lane table's seed
    pid_k = tl.program_id(0)
    pid_m = tl.program_id(1)
    HK: tl.constexpr = BLOCK_K // 2  # bytes of a row of codes for this program's inputs
    NBK: tl.constexpr = BLOCK_K // 64  # blocks of 64 along K
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = rm < M
    rj = pid_k * HK + tl.arange(0, HK)
    j_ok = rj < K // 2
    rb = pid_k * NBK + tl.arange(0, NBK)
    off = 0.0
    if NESTED:
        off = tl.load(off_ptr)
    tab = zero
    if LUT == 1:
        tab = _lane_table(lut_ptr, _lane_id(zero) & 15)
    dt: tl.constexpr = dx_ptr.dtype.element_ty
    acc_e = tl.zeros((BLOCK_M, HK), dtype=tl.float32)
    acc_o = tl.zeros((BLOCK_M, HK), dtype=tl.float32)
    for n0 in range(0, N, BLOCK_R):
        rr = n0 + tl.arange(0, BLOCK_R)
        r_ok = rr < N
        q = tl.load(q_ptr + rr[:, None] * (K // 2) + rj[None, :],
                    mask=r_ok[:, None] & j_ok[None, :], other=0).to(tl.int32)  # fmt: skip
        b_ok = r_ok[:, None] & (rb < NBLK)[None, :]
        a = absmax_of(am_ptr, am2_ptr, code2_ptr, off, rr[:, None] * NBLK + rb[None, :], b_ok,
                      NESTED, BS2)  # fmt: skip
        a = a[:, :, None]  # (BLOCK_R, NBK, 1): one absmax a row and block
        hi = tl.reshape(_code_value(tab, lut_ptr, q, 4, LUT), (BLOCK_R, NBK, 32))
        lo = tl.reshape(_code_value(tab, lut_ptr, q, 0, LUT), (BLOCK_R, NBK, 32))
        w_hi = tl.reshape(hi * a, (BLOCK_R, HK)).to(dt)
        w_lo = tl.reshape(lo * a, (BLOCK_R, HK)).to(dt)
        gt = tl.load(g_ptr + rm[:, None] * N + rr[None, :], mask=m_ok[:, None] & r_ok[None, :],
                     other=0.0)  # fmt: skip
        acc_e = tl.dot(gt, w_hi, acc_e)
        acc_o = tl.dot(gt, w_lo, acc_o)
    dx = tl.reshape(tl.join(acc_e, acc_o), (BLOCK_M, BLOCK_K))  # inputs 2j, 2j + 1 side by side
    rk = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    tl.store(dx_ptr + rm[:, None] * K + rk[None, :], dx.to(dt),
             mask=m_ok[:, None] & (rk < K)[None, :])  # fmt: skip


def launch_dx(g: torch.Tensor, flat: torch.Tensor, absmax: torch.Tensor,
              nested_absmax: torch.Tensor | None, nested_code: torch.Tensor | None,
              offset: torch.Tensor | None, in_f: int, cfg: dict) -> torch.Tensor:  # fmt: skip
    """g (rows, out) @ W -> (rows, in) in g's dtype, W the nf4 codes `flat` (blocksize 64) with
    their statistics; `cfg`: BLOCK_M, BLOCK_K (a multiple of 64), BLOCK_R, LUT (1: shuffles, a
    GPU; 0: loads, the interpreter), num_warps, num_stages.

    Example:
        >>> dx = launch_dx(g, flat, *stats, 4096, TILES_DX[0])  # doctest: +SKIP
    """
    from quantmesh.quant import kernel4 as k4

    rows, out_f = g.shape
    if in_f % 64 or cfg["BLOCK_K"] % 64:
        raise ValueError(f"`in` ({in_f}) and BLOCK_K ({cfg['BLOCK_K']}) multiples of 64")
    g = g.contiguous()
    dx = torch.empty((rows, in_f), dtype=g.dtype, device=g.device)
    stats = k4._kernel_statistics(absmax, nested_absmax, nested_code, offset)
    grid = (triton.cdiv(in_f, cfg["BLOCK_K"]), triton.cdiv(rows, cfg["BLOCK_M"]))
    qm_mma_4bit_dx[grid](
        g, flat, *stats, k4._code_values("nf4", g.device), dx, rows, out_f, in_f, in_f // 64, 0,
        BS2=256, NESTED=nested_absmax is not None, BLOCK_M=cfg["BLOCK_M"],
        BLOCK_K=cfg["BLOCK_K"], BLOCK_R=cfg["BLOCK_R"], LUT=cfg.get("LUT", 1),
        num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 3),
    )  # fmt: skip
    return dx
