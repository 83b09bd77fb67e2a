"""An experimental one-row 4-bit kernel (decoding, batch 1), kept beside its benchmark
(`nf4_gemv_bench.py`) rather than in the library: on one H200 it matched bitsandbytes' own 1-row
kernel (docs/benchmarks.md, "A one-row kernel of many small programs") and did not beat it, so the
library keeps bitsandbytes' kernel. The layout and the statistics are `quantmesh.quant.kernel4`'s.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from quantmesh.quant import kernel4 as k4
from quantmesh.quant._triton4 import absmax_of

__all__ = ["gemv_4bit", "launch_gemv"]


@triton.jit(do_not_specialize=["N", "NBLK", "blk_per"])
def gemv_4bit(x_ptr, q_ptr, am_ptr, am2_ptr, code2_ptr, off_ptr, lut_ptr, y_ptr, part_ptr,
              cnt_ptr, N, NBLK, KH, blk_per,
              BS: tl.constexpr, BS2: tl.constexpr, NESTED: tl.constexpr, BLOCK_N: tl.constexpr,
              NB: tl.constexpr, SPLIT_K: tl.constexpr, LUT: tl.constexpr):  # fmt: skip
    # y (1, N) = x (1, K) @ W^T at one row, K = NBLK blocks of BS. Memory-bound: the whole weight
    # is only tens of KB per SM, so the grid is many small programs (BLOCK_N features each, a few
    # warps, few registers), each streaming its rows' codes as (BLOCK_N, NB, BS / 2) byte tiles
    # whose last axis is contiguous and unmasked (16-byte loads): rows past N and blocks past the
    # program's share are clamped to valid addresses instead of masked, and x, zero there, drops
    # them. Each block's code values times x are summed in fp32 first, then scaled by its
    # absmax once. The 16 code values: LUT 0 loads them per code (one L1-resident line), LUT 1
    # gathers them from a copy in registers (tl.gather). With SPLIT_K shares of K per feature,
    # each program writes an fp32 partial (part: SPLIT_K, N) and counts itself in cnt[pid_n];
    # the last of a tile adds the partials in a fixed order (deterministic), writes y and resets
    # the count to 0 for the next call: one kernel, no zeroing or summing launch after it.
    # `blk_per`: blocks per program, a multiple of NB; do_not_specialize keeps one compiled
    # kernel per tile across shapes (their divisibility does not matter; KH's does).
    HB: tl.constexpr = BS // 2  # bytes per block
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    rn_c = tl.minimum(rn, N - 1)  # rows past N read row N - 1: never stored
    rb = tl.arange(0, NB)
    rj = tl.arange(0, HB)
    rk = tl.arange(0, BS)
    b_first = pid_k * blk_per
    b_end = tl.minimum(b_first + blk_per, NBLK)
    off = 0.0
    if NESTED:
        off = tl.load(off_ptr)
    if LUT == 1:
        tab = tl.broadcast_to(tl.load(lut_ptr + tl.arange(0, 16))[None, None, :], (BLOCK_N, NB, 16))
    row_q = (rn_c * KH)[:, None, None]  # a multiple of 16 where KH is: 16-byte loads
    row_a = (rn_c * NBLK)[:, None]
    acc = tl.zeros((BLOCK_N, NB), dtype=tl.float32)  # per block: reduced across threads once
    for b0 in range(b_first, b_end, NB):
        blk = b0 + rb
        b_mask = blk < b_end
        blk_c = tl.minimum(blk, b_end - 1)  # past the share: a valid block, times x = 0
        q = tl.load(q_ptr + row_q + (blk_c * HB)[None, :, None] + rj[None, None, :])
        q = q.to(tl.int32)
        xk = tl.load(x_ptr + blk_c[:, None] * BS + rk[None, :], mask=b_mask[:, None], other=0.0)
        xe, xo = tl.split(tl.reshape(xk, (NB, HB, 2)))  # even inputs: high nibbles; odd: low
        xe = xe.to(tl.float32)[None, :, :]
        xo = xo.to(tl.float32)[None, :, :]
        if LUT == 1:
            hi = tl.gather(tab, q >> 4, 2)
            lo = tl.gather(tab, q & 15, 2)
        else:
            hi = tl.load(lut_ptr + (q >> 4))
            lo = tl.load(lut_ptr + (q & 15))
        part = tl.sum(hi * xe + lo * xo, axis=2)  # (BLOCK_N, NB): per block, unscaled
        a = absmax_of(am_ptr, am2_ptr, code2_ptr, off, row_a + blk_c[None, :], b_mask[None, :],
                      NESTED, BS2)  # fmt: skip
        acc += part * a
    y = tl.sum(acc, axis=1)
    if SPLIT_K == 1:
        tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=n_mask)
    else:
        tl.store(part_ptr + pid_k * N + rn, y, mask=n_mask)
        tl.debug_barrier()  # every thread's partial stored before the count says so
        done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if done == SPLIT_K - 1:  # the tile's last program: the others' partials are in
            tot = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):  # .cg: from L2, never a stale L1 line
                at = part_ptr + s * N + rn
                tot += tl.load(at, mask=n_mask, other=0.0, cache_modifier=".cg")
            tl.store(y_ptr + rn, tot.to(y_ptr.dtype.element_ty), mask=n_mask)
            tl.store(cnt_ptr + pid_n, 0)  # ready for the next call (or graph replay)


def launch_gemv(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor,
                 nested_absmax: torch.Tensor | None, nested_code: torch.Tensor | None,
                 offset: torch.Tensor | None, blocksize: int, quant_type: str, out_f: int,
                 cfg: dict[str, Any]) -> torch.Tensor:  # fmt: skip
    """x (1, in) @ W^T -> (1, out_f) in x's dtype by the one-row kernel (`gemv_4bit`):
    many small programs, BLOCK_N features each, whole blocks read as 16-byte loads. Where it does not
    apply (more than one row, `in` not a multiple of `blocksize`, a blocksize not a power of two
    from 32 on, or a weight past int32 indexing), the row kernel with `choose_config`'s tiles.

    cfg: BLOCK_N features per program, NB blocks a step, SPLIT_K shares of K per feature (fp32
    partials, added by the last program of each tile: one kernel), LUT (0: code values loaded
    per code, 1: gathered from registers), num_warps, num_stages. With SPLIT_K > 1 the
    programs count themselves in a per-device int32 buffer kept zero between calls, so two
    such calls must not run at once on different streams.

    Example:
        >>> y = launch_gemv(x, flat, *stats, 64, "nf4", 4096,
        ...                 dict(BLOCK_N=4, NB=8, SPLIT_K=1, LUT=0, num_warps=1))  # doctest: +SKIP
    """
    rows, in_f = x.shape
    if (rows != 1 or in_f % blocksize or blocksize < 32 or blocksize & (blocksize - 1)
            or out_f * in_f >= k4._INT32_LIMIT):  # fmt: skip
        return k4._launch(x, packed, absmax, nested_absmax, nested_code, offset, blocksize,
                          quant_type, out_f, k4.choose_config(rows))  # fmt: skip
    kernel = gemv_4bit
    x = x.contiguous()
    nested = nested_absmax is not None
    nblk = in_f // blocksize
    nb = cfg["NB"]
    blk_per = triton.cdiv(triton.cdiv(nblk, max(1, cfg.get("SPLIT_K", 1))), nb) * nb
    split = triton.cdiv(nblk, blk_per)  # no program without blocks
    grid = (triton.cdiv(out_f, cfg["BLOCK_N"]), split)
    y = torch.empty((1, out_f), dtype=x.dtype, device=x.device)
    part = torch.empty((split, out_f), dtype=torch.float32, device=x.device) if split > 1 else y
    cnt = counters(grid[0], x.device) if split > 1 else y
    dummy = absmax  # pointers the kernel never reads (no nested statistics)
    kernel[grid](
        x, packed, absmax,
        nested_absmax if nested else dummy, nested_code if nested else dummy,
        offset if nested else dummy, k4._code_values(quant_type, x.device), y, part, cnt,
        out_f, nblk, in_f // 2, blk_per,
        BS=blocksize, BS2=256, NESTED=nested, BLOCK_N=cfg["BLOCK_N"], NB=nb, SPLIT_K=split,
        LUT=cfg.get("LUT", 0), num_warps=cfg.get("num_warps", 1),
        num_stages=cfg.get("num_stages", 1),
    )  # fmt: skip
    return y


def counters(n: int, device: torch.device) -> torch.Tensor:
    """`n` int32 zeros on `device`: the split-K kernel's per-tile counts, which the last program
    of each tile sets back to 0. Kept per (device, n) once made outside a CUDA graph capture, and
    never freed (a captured graph keeps their address); one made during a capture (in the
    graph's pool, zeroed by the graph itself) is not kept."""
    key = (str(device), n)
    if key in COUNTERS:
        return COUNTERS[key]
    made = torch.zeros(n, dtype=torch.int32, device=device)
    if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        COUNTERS[key] = made
    return made


COUNTERS: dict[tuple[str, int], torch.Tensor] = {}  # (device, tiles) -> split-K counts, zeros
