"""The Triton kernel of `quant/kernel4.py` (imported only where Triton is installed): see there.

x (M, K) @ W^T for W's 4-bit codes packed two per byte (high nibble first, blocks of `BS` over the
flattened (N, K) weight, one absmax each: fp32, or 8-bit + nested fp32 absmax per `BS2` blocks +
an offset under double quant). `lut_ptr` holds the 16 code values (fp32). One program: BLOCK_N output features, a 1/SPLIT_K share
of K, all M rows (BLOCK_M >= M); with SPLIT_K > 1 it writes fp32 partial sums (y: SPLIT_K, M, N).
"""

import triton
import triton.language as tl

__all__ = ["rows_4bit"]


@triton.jit
def absmax_of(am_ptr, am2_ptr, code2_ptr, off, blk, mask, NESTED: tl.constexpr,
              BS2: tl.constexpr):  # fmt: skip
    # the fp32 absmax of blocks `blk` (0 where masked): bitsandbytes' dequantize_blockwise
    # of the 8-bit statistics plus the offset, under double quant
    if NESTED:
        c = tl.load(am_ptr + blk, mask=mask, other=0).to(tl.int32)
        a = tl.load(code2_ptr + c) * tl.load(am2_ptr + blk // BS2, mask=mask, other=0.0)
        a = a + off
    else:
        a = tl.load(am_ptr + blk, mask=mask, other=0.0)
    return tl.where(mask, a, 0.0)


@triton.jit
def rows_4bit(x_ptr, q_ptr, am_ptr, am2_ptr, code2_ptr, off_ptr, lut_ptr, y_ptr,
              M, N, K, stride_xm, k_per,
              BS: tl.constexpr, BS2: tl.constexpr, NESTED: tl.constexpr,
              ALIGNED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, DOT: tl.constexpr):  # fmt: skip
    HALF: tl.constexpr = BLOCK_K // 2
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rb = tl.arange(0, HALF)
    n_mask = rn < N
    half_k = K // 2
    k_lo = pid_k * k_per
    k_hi = tl.minimum(k_lo + k_per, K)
    off = 0.0
    if NESTED:
        off = tl.load(off_ptr)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(0, k_per, BLOCK_K):
        k0 = k_lo + step
        kb = k0 // 2 + rb  # this step's bytes of each row
        b_mask = n_mask[:, None] & (kb[None, :] < k_hi // 2)
        q = tl.load(q_ptr + rn[:, None] * half_k + kb[None, :], mask=b_mask, other=0)
        q = q.to(tl.int32)
        hi = tl.load(lut_ptr + (q >> 4))  # even k: the high nibble's value (16 fp32: one line)
        lo = tl.load(lut_ptr + (q & 15))  # odd k: the low nibble's
        if ALIGNED:  # one absmax per (row, block) of this step, broadcast over its bytes
            NB: tl.constexpr = BLOCK_K // BS
            rk = tl.arange(0, NB)
            blk = rn[:, None] * (K // BS) + k0 // BS + rk[None, :]
            a_mask = n_mask[:, None] & ((k0 + rk * BS)[None, :] < k_hi)
            a = absmax_of(am_ptr, am2_ptr, code2_ptr, off, blk, a_mask, NESTED, BS2)
            a3 = a[:, :, None]
            hi = tl.reshape(tl.reshape(hi, (BLOCK_N, NB, BS // 2)) * a3, (BLOCK_N, HALF))
            lo = tl.reshape(tl.reshape(lo, (BLOCK_N, NB, BS // 2)) * a3, (BLOCK_N, HALF))
        else:  # blocks of the flat weight, per byte (both nibbles share a block: BS even)
            blk = (rn[:, None] * K + 2 * kb[None, :]) // BS
            a = absmax_of(am_ptr, am2_ptr, code2_ptr, off, blk, b_mask, NESTED, BS2)
            hi = hi * a
            lo = lo * a
        x_mask = (rm[:, None] < M) & (kb[None, :] < k_hi // 2)
        x_at = x_ptr + rm[:, None] * stride_xm + 2 * kb[None, :]
        xe = tl.load(x_at, mask=x_mask, other=0.0)
        xo = tl.load(x_at + 1, mask=x_mask, other=0.0)
        w_hi = hi.to(xe.dtype)  # the weight as dequantize_4bit writes it
        w_lo = lo.to(xe.dtype)
        if DOT:
            acc = tl.dot(xe, tl.trans(w_hi), acc)
            acc = tl.dot(xo, tl.trans(w_lo), acc)
        elif BLOCK_M == 1:  # one row: a reduction along K
            part = w_hi.to(tl.float32) * xe.to(tl.float32) + w_lo.to(tl.float32) * xo.to(tl.float32)
            acc += tl.sum(part, axis=1)[None, :]
        else:  # a few rows: (BLOCK_M, 1, HALF) * (1, BLOCK_N, HALF), reduced along K
            part = xe.to(tl.float32)[:, None, :] * w_hi.to(tl.float32)[None, :, :]
            part += xo.to(tl.float32)[:, None, :] * w_lo.to(tl.float32)[None, :, :]
            acc += tl.sum(part, axis=2)
    y_at = y_ptr + pid_k * M * N + rm[:, None] * N + rn[None, :]
    y_mask = (rm[:, None] < M) & n_mask[None, :]
    tl.store(y_at, acc.to(y_ptr.dtype.element_ty), mask=y_mask)
