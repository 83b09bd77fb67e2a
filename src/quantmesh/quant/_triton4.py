"""The Triton kernel of `quant/kernel4.py` (imported only where Triton is installed): see there.

x (M, K) @ W^T for W's 4-bit codes packed two per byte (high nibble first, blocks of `BS` over the
flattened (N, K) weight, one absmax each: fp32, or 8-bit + nested fp32 absmax per `BS2` blocks +
an offset under double quant). `lut_ptr` holds the 16 code values (fp32). One program: BLOCK_N output features, a 1/SPLIT_K share
of K, all M rows (BLOCK_M >= M); with SPLIT_K > 1 it writes fp32 partial sums (y: SPLIT_K, M, N).
"""

import triton
import triton.language as tl

__all__ = ["blocks_4bit", "dequant_4bit", "qm_gemv_4bit", "rows_4bit"]


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


@triton.jit
def blocks_4bit(x_ptr, q_ptr, am_ptr, am2_ptr, code2_ptr, off_ptr, lut_ptr, y_ptr,
                M, N, NBLK, KH, stride_xm, steps,
                BS: tl.constexpr, NESTED: tl.constexpr, BS2: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, NB: tl.constexpr, DOT: tl.constexpr,
                ROUND: tl.constexpr):  # fmt: skip
    # x (M, K) @ W^T for K a multiple of the blocksize BS: the weight read as a 3-D tile of
    # (BLOCK_N features, NB blocks of BS inputs, BS / 2 bytes), each block's absmax a (BLOCK_N, NB)
    # tile broadcast over its bytes (no per-byte statistics loads, no reshape before the
    # scale). One program: BLOCK_N features, `steps` steps of NB blocks from block
    # pid_k * steps * NB on; fp32 partial sums per pid_k (y: SPLIT, M, N) or, with one share of
    # K, the result in y's dtype. DOT: tl.dot over all M rows (BLOCK_M >= 16); else M == 1, a
    # reduction along K, where ROUND = 0 scales each block's sum by its absmax once (the code
    # values times x summed in fp32; the weight is not rounded to the compute dtype first) and
    # ROUND = 1 rounds each weight as dequantize_4bit writes it.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    rb = tl.arange(0, NB)
    HB: tl.constexpr = BS // 2  # bytes per block
    rj = tl.arange(0, HB)
    off = 0.0
    if NESTED:
        off = tl.load(off_ptr)
    if DOT:
        rm = tl.arange(0, BLOCK_M)
        m_mask = rm < M
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc1 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    b_first = pid_k * steps * NB
    for step in range(0, steps):
        b0 = b_first + step * NB
        blk_in_row = b0 + rb  # (NB,) this step's blocks of a row
        b_mask = blk_in_row < NBLK
        nb_mask = n_mask[:, None] & b_mask[None, :]  # (BLOCK_N, NB)
        q_at = q_ptr + rn[:, None, None] * KH + (blk_in_row * HB)[None, :, None] + rj[None, None, :]
        q = tl.load(q_at, mask=nb_mask[:, :, None], other=0).to(tl.int32)
        a = absmax_of(am_ptr, am2_ptr, code2_ptr, off, rn[:, None] * NBLK + blk_in_row[None, :],
                      nb_mask, NESTED, BS2)  # fmt: skip
        hi = tl.load(lut_ptr + (q >> 4))  # even inputs
        lo = tl.load(lut_ptr + (q & 15))  # odd inputs
        ke = blk_in_row[:, None] * BS + 2 * rj[None, :]  # (NB, HB): the even inputs' indices
        if DOT:
            a3 = a[:, :, None]
            w_hi = tl.reshape((hi * a3).to(x_ptr.dtype.element_ty), (BLOCK_N, NB * HB))
            w_lo = tl.reshape((lo * a3).to(x_ptr.dtype.element_ty), (BLOCK_N, NB * HB))
            x_mask = m_mask[:, None, None] & b_mask[None, :, None]
            x_at = x_ptr + rm[:, None, None] * stride_xm + ke[None, :, :]
            xe = tl.reshape(tl.load(x_at, mask=x_mask, other=0.0), (BLOCK_M, NB * HB))
            xo = tl.reshape(tl.load(x_at + 1, mask=x_mask, other=0.0), (BLOCK_M, NB * HB))
            acc = tl.dot(xe, tl.trans(w_hi), acc)
            acc = tl.dot(xo, tl.trans(w_lo), acc)
        else:
            xe = tl.load(x_ptr + ke, mask=b_mask[:, None], other=0.0).to(tl.float32)[None, :, :]
            xo = tl.load(x_ptr + ke + 1, mask=b_mask[:, None], other=0.0).to(tl.float32)[None, :, :]
            if ROUND:
                a3 = a[:, :, None]
                w_hi = (hi * a3).to(x_ptr.dtype.element_ty).to(tl.float32)
                w_lo = (lo * a3).to(x_ptr.dtype.element_ty).to(tl.float32)
                acc1 += tl.sum(tl.sum(w_hi * xe + w_lo * xo, axis=2), axis=1)
            else:
                part = tl.sum(hi * xe + lo * xo, axis=2)  # (BLOCK_N, NB): per block, unscaled
                acc1 += tl.sum(part * a, axis=1)
    if DOT:
        y_at = y_ptr + pid_k * M * N + rm[:, None] * N + rn[None, :]
        tl.store(y_at, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])
    else:
        tl.store(y_ptr + pid_k * N + rn, acc1.to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def dequant_4bit(q_ptr, am_ptr, am2_ptr, code2_ptr, off_ptr, lut_ptr, w_ptr, n_bytes,
                 BS: tl.constexpr, NESTED: tl.constexpr, BS2: tl.constexpr,
                 NBK: tl.constexpr):  # fmt: skip
    # The whole 4-bit weight written out in w's dtype, as dequantize_4bit writes it (fp32 code
    # value x fp32 absmax, rounded once): one program, NBK blocks of BS values, each read as a
    # (NBK, BS / 2) tile of bytes with one absmax per block; the two nibbles of each byte joined
    # (high first) into BS contiguous values per block.
    HB: tl.constexpr = BS // 2
    blk = tl.program_id(0) * NBK + tl.arange(0, NBK)
    rj = tl.arange(0, HB)
    at = blk[:, None] * HB + rj[None, :]  # (NBK, HB) byte offsets
    mask = at < n_bytes
    q = tl.load(q_ptr + at, mask=mask, other=0).to(tl.int32)
    off = 0.0
    if NESTED:
        off = tl.load(off_ptr)
    a = absmax_of(am_ptr, am2_ptr, code2_ptr, off, blk, blk * HB < n_bytes, NESTED, BS2)
    hi = tl.load(lut_ptr + (q >> 4)) * a[:, None]
    lo = tl.load(lut_ptr + (q & 15)) * a[:, None]
    w = tl.reshape(tl.join(hi, lo), (NBK, BS)).to(w_ptr.dtype.element_ty)
    ro = blk[:, None] * BS + tl.arange(0, BS)[None, :]
    tl.store(w_ptr + ro, w, mask=ro < 2 * n_bytes)


@triton.jit(do_not_specialize=["N", "NBLK", "KH", "rows_per", "n_slices"])
def qm_gemv_4bit(x_ptr, q_ptr, am_ptr, am2_ptr, code2_ptr, off_ptr, lut_ptr, y_ptr, part_ptr,
              cnt_ptr, N, NBLK, KH, rows_per, n_slices,
              BS: tl.constexpr, BS2: tl.constexpr, NESTED: tl.constexpr, M: tl.constexpr,
              MP: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr,
              BF16: tl.constexpr):  # fmt: skip
    # y (M, N) = x (M, K) @ W^T for a few rows (M <= MP, a power of two), K = NBLK blocks of BS.
    # A program owns one slice of K (NB blocks) and `rows_per` output features: it loads its
    # slice of x once, as int32 words of two inputs each (x[2j], x[2j+1]: byte j's high and low
    # nibble), splits them into fp32 by bit operations (bf16: the word shifted or masked is
    # already the fp32 value) and keeps them in registers while it streams its features' codes
    # as (BLOCK_N, NB, BS / 2) byte tiles (16-byte loads). Per code: a nibble, one load of its
    # value (16 fp32: one L1 line), one fused multiply-add; per block: one absmax. Each slice
    # writes fp32 partials (part: n_slices, M, N) and counts itself in cnt[pid_n]; the group's
    # last program adds the partials in slice order (deterministic), writes y and resets the
    # count: one kernel, nothing to zero or sum after it. With one slice, y directly.
    HB: tl.constexpr = BS // 2  # bytes per block = x words per block
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, MP)
    m_ok = rm < M
    rb = tl.arange(0, NB)
    rj = tl.arange(0, HB)
    blk = pid_k * NB + rb
    b_mask = blk < NBLK
    blk_c = tl.minimum(blk, NBLK - 1)  # past K: a valid block, times x = 0
    off = 0.0
    if NESTED:
        off = tl.load(off_ptr)
    xw = tl.load(x_ptr + rm[:, None, None] * KH + (blk_c * HB)[None, :, None] + rj[None, None, :],
                 mask=m_ok[:, None, None] & b_mask[None, :, None], other=0)  # fmt: skip
    if BF16:  # (MP, NB, HB) fp32: the even inputs (low half) and the odd ones (high half)
        xe = (xw << 16).to(tl.float32, bitcast=True)
        xo = (xw & -65536).to(tl.float32, bitcast=True)
    else:
        xe = (xw & 65535).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        xo = (xw >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    xe = xe[:, None, :, :]
    xo = xo[:, None, :, :]
    r_first = pid_n * rows_per
    r_end = tl.minimum(r_first + rows_per, N)
    for r0 in range(r_first, r_end, BLOCK_N):
        rn = r0 + tl.arange(0, BLOCK_N)
        n_mask = rn < r_end
        rn_c = tl.minimum(rn, r_end - 1)  # rows past the share read a valid row: never stored
        q = tl.load(q_ptr + (rn_c * KH)[:, None, None] + (blk_c * HB)[None, :, None]
                    + rj[None, None, :]).to(tl.int32)  # fmt: skip
        hi = tl.load(lut_ptr + (q >> 4))[None]  # (1, BLOCK_N, NB, HB): input 2j
        lo = tl.load(lut_ptr + (q & 15))[None]  # input 2j + 1
        part = tl.sum(hi * xe + lo * xo, axis=3)  # (MP, BLOCK_N, NB): per block, unscaled
        a = absmax_of(am_ptr, am2_ptr, code2_ptr, off, (rn_c * NBLK)[:, None] + blk_c[None, :],
                      b_mask[None, :], NESTED, BS2)  # fmt: skip
        y = tl.sum(part * a[None], axis=2)  # (MP, BLOCK_N)
        at = rm[:, None] * N + rn[None, :]
        mask = m_ok[:, None] & n_mask[None, :]
        if n_slices == 1:
            tl.store(y_ptr + at, y.to(y_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(part_ptr + pid_k * M * N + at, y, mask=mask)
    if n_slices > 1:
        tl.debug_barrier()  # every thread's partials stored before the count says so
        done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if done == n_slices - 1:  # the group's last slice: the others' partials are in
            for r0 in range(r_first, r_end, BLOCK_N):
                rn = r0 + tl.arange(0, BLOCK_N)
                at = rm[:, None] * N + rn[None, :]
                mask = m_ok[:, None] & (rn < r_end)[None, :]
                tot = tl.zeros((MP, BLOCK_N), dtype=tl.float32)
                for s in range(0, n_slices):  # .cg: from L2, never a stale L1 line
                    tot += tl.load(part_ptr + s * M * N + at, mask=mask, other=0.0,
                                   cache_modifier=".cg")  # fmt: skip
                tl.store(y_ptr + at, tot.to(y_ptr.dtype.element_ty), mask=mask)
            tl.store(cnt_ptr + pid_n, 0)  # ready for the next call (or graph replay)
