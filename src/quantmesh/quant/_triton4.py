"""The Triton kernels of `quant/kernel4.py` (imported only where Triton is installed): see there.

x (M, K) @ W^T for W's 4-bit codes packed two per byte (high nibble first, blocks of `BS` over the
flattened (N, K) weight, one absmax each: fp32, or 8-bit + nested fp32 absmax per `BS2` blocks +
an offset under double quant). `lut_ptr` holds the 16 code values (fp32). `rows_4bit`: one program
owns BLOCK_N output features, a 1/SPLIT_K share of K, all M rows (BLOCK_M >= M); with SPLIT_K > 1
it writes fp32 partial sums (y: SPLIT_K, M, N). The gemvs (`qm_gemv_lines`, 1 to 16 rows;
`qm_gemv_4bit`), the tensor-core kernel (`qm_mma_4bit`, up to 64 rows) and the dequantize
(`dequant_4bit`) say their own layouts.
"""

import triton
import triton.language as tl

__all__ = [
    "blocks_4bit", "dequant_4bit", "qm_gemv_4bit", "qm_gemv_lines", "qm_mma_4bit", "rows_4bit"
]  # fmt: skip


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


@triton.jit
def _lane_id(like):
    # each element's lane in its warp (like: an int32 tensor of the wanted shape and layout)
    return tl.inline_asm_elementwise("mov.u32 $0, %laneid;", "=r,r", [like], dtype=tl.int32,
                                     is_pure=True, pack=1)  # fmt: skip


@triton.jit
def _shfl(tab, src):
    # tab from lane (src & 31) of the warp: shfl.sync.idx reads only the low 5 bits of src,
    # so a nibble needs no mask when lanes j and j + 16 hold the same table entry
    return tl.inline_asm_elementwise("shfl.sync.idx.b32 $0, $1, $2, 31, 0xffffffff;", "=r,r,r",
                                     [tab, src], dtype=tl.int32, is_pure=True, pack=1)  # fmt: skip


@triton.jit
def _code_value(tab, lut_ptr, qw, SHIFT: tl.constexpr, LUT: tl.constexpr):
    # the fp32 value of the nibble at bit SHIFT of the int32 words qw: LUT 0 loads it (16 fp32:
    # one L1 line); LUT 1 takes it from the lane of the warp that holds it (tab: code value
    # (lane & 15) in every lane, as int32 bits)
    if LUT == 1:
        return _shfl(tab, qw >> SHIFT).to(tl.float32, bitcast=True)
    return tl.load(lut_ptr + ((qw >> SHIFT) & 15))


@triton.jit
def _x_halves(xw, BF16: tl.constexpr):
    # int32 words of x, two inputs each -> (the low half: input 2m, the high half: input 2m + 1)
    # as fp32 (bf16: the word shifted or masked is already the fp32 value)
    if BF16:
        return (xw << 16).to(tl.float32, bitcast=True), (xw & -65536).to(tl.float32, bitcast=True)
    lo = (xw & 65535).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, (xw >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _word_dot(qw, xw_ptr, tab, lut_ptr, LUT: tl.constexpr, BF16: tl.constexpr):
    # sum over the 8 codes of the int32 words qw (one per thread: byte t of each holds inputs
    # 2t (high nibble) and 2t + 1) of code value x input, in fp32; xw_ptr: x's 4 words for them
    part = tl.zeros(qw.shape, dtype=tl.float32)
    for t in tl.static_range(4):
        xe, xo = _x_halves(tl.load(xw_ptr + t), BF16)  # a scalar: the same for every thread
        part += _code_value(tab, lut_ptr, qw, 8 * t + 4, LUT) * xe
        part += _code_value(tab, lut_ptr, qw, 8 * t, LUT) * xo
    return part


@triton.jit
def _chunk_dot(q4, xw_ptr, tab, lut_ptr, LUT: tl.constexpr, BF16: tl.constexpr):
    # (BLOCK_N, 4) int32 words, 16 bytes of codes a row (a thread), against x's 16 words there
    qa, qb = tl.split(tl.reshape(q4, (q4.shape[0], 2, 2)))  # words (0, 2) and (1, 3)
    q0, q2 = tl.split(qa)
    q1, q3 = tl.split(qb)
    part = _word_dot(q0, xw_ptr, tab, lut_ptr, LUT, BF16)
    part += _word_dot(q1, xw_ptr + 4, tab, lut_ptr, LUT, BF16)
    part += _word_dot(q2, xw_ptr + 8, tab, lut_ptr, LUT, BF16)
    part += _word_dot(q3, xw_ptr + 12, tab, lut_ptr, LUT, BF16)
    return part


@triton.jit(do_not_specialize=["N", "NBLK", "blk_per", "n_slices"])
def qm_gemv_4bit(x_ptr, q_ptr, am_ptr, am2_ptr, code2_ptr, off_ptr, lut_ptr, y_ptr, part_ptr,
                 cnt_ptr, N, NBLK, KW, blk_per, n_slices,
                 BS2: tl.constexpr, NESTED: tl.constexpr, BLOCK_N: tl.constexpr,
                 NS: tl.constexpr, LUT: tl.constexpr, BF16: tl.constexpr):  # fmt: skip
    # y (1, N) = x (1, K) @ W^T, K = NBLK blocks of 64 codes (32 bytes, 8 int32 words), one
    # thread per output feature: each reads its feature's codes 16 bytes at a time (a
    # (BLOCK_N, 4) tile of int32 words, one row a thread, split into four words in registers),
    # so the products of a feature are summed inside one thread, with no shuffle of partial
    # sums, no shared memory and no layout conversion in the loop. The next block's codes and
    # absmax are loaded before this block's are used (two blocks in flight a thread). x's words
    # (x[2j], x[2j+1]: byte j's high and low nibble) are scalars, the same for every thread,
    # split into fp32 by bit operations (bf16: the word shifted or masked is already the fp32
    # value). Per code: a shift, its value (LUT: see _code_value), one fused multiply-add; per
    # block: one absmax. K is cut into n_slices shares of blk_per blocks (grid axis 1): each
    # share writes fp32 partials (part: n_slices, N) and counts itself in cnt[pid_n]; the last
    # loads them all at once (NS: n_slices to the next power of two), adds them in a fixed tree
    # (deterministic), writes y and resets the count: one kernel, nothing to zero or sum after
    # it. With one share (NS 1), y directly. KW: int32 words per row of codes.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    rn_c = tl.minimum(rn, N - 1)  # rows past N read row N - 1: never stored
    r4 = tl.arange(0, 4)
    row_w = q_ptr + (rn_c * KW)[:, None] + r4[None, :]
    row_a = rn_c * NBLK
    b_first = pid_k * blk_per
    b_end = tl.minimum(b_first + blk_per, NBLK)
    off = 0.0
    if NESTED:
        off = tl.load(off_ptr)
    tab = rn  # LUT 1: code value (lane & 15) in every lane, as int32 bits (one feature a
    # thread: the layout of rn is the codes' own, so no conversion moves an entry to another lane)
    if LUT == 1:
        tab = tl.load(lut_ptr + (_lane_id(rn) & 15)).to(tl.int32, bitcast=True)
    ok = n_mask | True
    qn0 = tl.load(row_w + b_first * 8)
    qn1 = tl.load(row_w + b_first * 8 + 4)
    an = absmax_of(am_ptr, am2_ptr, code2_ptr, off, row_a + b_first, ok, NESTED, BS2)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for b in range(b_first, b_end):  # block b + 1 in flight while b is summed
        q0 = qn0
        q1 = qn1
        a = an
        b_next = tl.minimum(b + 1, b_end - 1)  # the last block loads itself again: unused
        qn0 = tl.load(row_w + b_next * 8)
        qn1 = tl.load(row_w + b_next * 8 + 4)
        an = absmax_of(am_ptr, am2_ptr, code2_ptr, off, row_a + b_next, ok, NESTED, BS2)
        part = _chunk_dot(q0, x_ptr + b * 32, tab, lut_ptr, LUT, BF16)
        part += _chunk_dot(q1, x_ptr + b * 32 + 16, tab, lut_ptr, LUT, BF16)
        acc += part * a
    _finish(acc[None, :], tl.arange(0, 1), 1, rn, n_mask, pid_n, pid_k, N, n_slices, y_ptr,
            part_ptr, cnt_ptr, NS, acc[None, :], acc, False, False)  # fmt: skip


@triton.jit(do_not_specialize=["M", "N", "NBLK", "blk_per", "n_slices", "zero", "R", "RANK"])
def qm_gemv_lines(x_ptr, q_ptr, am_ptr, am2_ptr, code2_ptr, off_ptr, lut_ptr, y_ptr, part_ptr,
                  cnt_ptr, M, N, NBLK, KW, blk_per, n_slices, zero,
                  t_ptr, e_ptr, col_ptr, sc_ptr, b_ptr, R, RANK,
                  BS2: tl.constexpr, NESTED: tl.constexpr, BLOCK_N: tl.constexpr,
                  SB: tl.constexpr, NS: tl.constexpr, LUT: tl.constexpr,
                  BF16: tl.constexpr, WK: tl.constexpr = 1,
                  ROWS: tl.constexpr = 1, OFFS: tl.constexpr = False,
                  RL: tl.constexpr = 1, LORA: tl.constexpr = False,
                  BIAS: tl.constexpr = False):  # fmt: skip
    # y (M, N) = x (M, K) @ W^T for a few rows (M <= ROWS, a power of two), with the lanes along
    # K; each code's value is found once and multiplied with all M rows (fused multiply-adds,
    # no tensor cores: the codes are read once, the products cost M times one row's). A program
    # (one warp) owns BLOCK_N features and walks its share of K in strides of SB blocks (64 codes
    # each; SB 4 to 32), each in SB / 4 steps of 32 int32 words (8 codes each). In a step a
    # thread holds one word of each of its features, so one load of a warp reads a whole
    # 128-byte line of a feature, and x's 4 int32 words for that word (16 bytes; word m: inputs
    # 2m and 2m + 1, byte m's high and low nibble) are read once for all BLOCK_N features (and
    # for each of the M rows). `zero` (0 at run time) hides the
    # words' alignment from the compiler, which would otherwise give a thread 16 bytes of codes
    # and need x's 64 bytes for them in another layout (a conversion through shared memory every
    # step); their contiguity puts the lanes along K. A stride's SB absmax of a feature are
    # loaded once, block l % SB in lane l (a 1-D tensor: element i in lane i % 32 whatever
    # layout the compiler picks for 2-D gathers), and each step takes its word's from the lane
    # that holds it (a shuffle): the 8-bit statistics cost one request a feature and stride.
    # Per code: a shift, its value shuffled from the lane that holds it (LUT 1) or loaded
    # (LUT 0: the interpreter's path, not fast), one fused multiply-add; per word and feature
    # one more (the absmax). The fp32 sums of a feature are added across the lanes at the end;
    # K cut into shares as in qm_gemv_4bit (`_finish`). KW: int32 words a row of codes (x's
    # rows are KW x 4 int32 words apart: x is contiguous).
    # WK > 1 (num_warps = WK): the program's warps split K. A step reads WK x 32 consecutive
    # words of each feature, warp w words [32w, 32w + 32); a stride's SB blocks are spread over
    # the warps, each warp's lanes holding the absmax of the blocks its own steps read (lane
    # 4t + u: block 4 (t WK + w) + u, read by step t); the warps' sums are added at the end.
    # OFFS: the nested statistics' offset is one per nested block (`off_ptr`: sibling weights
    # joined into one, each with its own offset), else one value.
    # LORA: a low-rank delta added at the store (`_low_rank`: the LoRA adapters' B products, t_ptr
    # their A products, R wide; e_ptr, col_ptr, sc_ptr per feature: B's RANK values, where its
    # A products begin in t, its scale; RL: RANK's power of two), computed before the loop (a
    # few registers a thread); else those are never read. BIAS (with LORA): b_ptr holds each
    # feature's bias in y's dtype, added to the stored product before the delta (`_stored`).
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    rn_c = tl.minimum(rn, N - 1)  # features past N read feature N - 1: never stored
    c = tl.arange(0, 32 * WK)  # a step's words (warp c // 32)
    rm = tl.arange(0, ROWS)
    m_ok = rm < M
    b_first = pid_k * blk_per
    b_end = tl.minimum(b_first + blk_per, NBLK)
    off = 0.0
    if NESTED and not OFFS:
        off = tl.load(off_ptr)
    row_q = q_ptr + rn_c[:, None] * KW  # int32 words of codes
    # a stride's absmax, flat: feature fi // (32 WK), warp (fi // 32) % WK, lane fi % 32
    fi = tl.arange(0, BLOCK_N * 32 * WK)
    row_a = tl.minimum(pid_n * BLOCK_N + fi // (32 * WK), N - 1) * NBLK
    lane = zero
    tab = zero
    if LUT == 1:  # the thread's lane, a scalar (each thread its own: no layout moves it)
        lane = _lane_id(zero)
        tab = _lane_table(lut_ptr, lane & 15)  # code value (lane & 15), from 16 scalar loads
    delta = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    bias = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if LORA:  # loaded before the loop: no load after it, before the store
        delta = _low_rank(rm, M, rn, n_mask, t_ptr, e_ptr, col_ptr, sc_ptr, R, RANK, RL)
        if BIAS:
            bias = tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    acc = tl.zeros((ROWS, BLOCK_N, 32 * WK), dtype=tl.float32)
    for b0 in range(b_first, b_end, SB):
        if WK == 1:
            bl = b0 + (fi % 32) % SB
        else:
            bl = b0 + 4 * (((fi % 32) // 4 % (SB // (4 * WK))) * WK + (fi // 32) % WK) + fi % 4
        b_off = off
        if NESTED and OFFS:  # each nested block's own offset
            b_off = tl.load(off_ptr + (row_a + bl) // BS2, mask=bl < b_end, other=0.0)
        am = absmax_of(am_ptr, am2_ptr, code2_ptr, b_off, row_a + bl, bl < b_end, NESTED,
                       BS2).to(tl.int32, bitcast=True)  # fmt: skip
        for s in tl.static_range(SB // (4 * WK)):
            wi = b0 * 8 + s * 32 * WK + zero + c  # zero: 4-byte alignment, one word a thread
            ok = wi < b_end * 8
            q = tl.load(row_q + wi[None, :], mask=ok[None, :], other=0)
            # x's words (word, row, 4): words before rows, so that the lanes run along the words
            # as the codes' do (rows first, the compiler spread rows over lanes too)
            x_at = x_ptr + wi[:, None, None] * 4 + rm[None, :, None] * (KW * 4)
            x_ok = ok[:, None, None]
            if ROWS > 1:  # (one row: always there; no row mask in the loop)
                x_ok = x_ok & m_ok[None, :, None]
            xw = tl.load(x_at + tl.arange(0, 4)[None, None, :], mask=x_ok, other=0)
            xe, xo = _x_halves(xw, BF16)
            e0, e1, e2, e3 = _split4(xe)  # (ROWS, 1, 32 WK) each
            o0, o1, o2, o3 = _split4(xo)
            q = q[None, :, :]  # (1, BLOCK_N, 32 WK): each value found once for all rows
            part = _code_value(tab, lut_ptr, q, 4, LUT) * e0  # byte j: bits 8j + 4, 8j
            part += _code_value(tab, lut_ptr, q, 0, LUT) * o0
            part += _code_value(tab, lut_ptr, q, 12, LUT) * e1
            part += _code_value(tab, lut_ptr, q, 8, LUT) * o1
            part += _code_value(tab, lut_ptr, q, 20, LUT) * e2
            part += _code_value(tab, lut_ptr, q, 16, LUT) * o2
            part += _code_value(tab, lut_ptr, q, 28, LUT) * e3
            part += _code_value(tab, lut_ptr, q, 24, LUT) * o3
            if LUT == 1:  # the word's absmax from the lane that loaded it
                a = _shfl(am, s * 4 + (lane >> 3)).to(tl.float32, bitcast=True)
            else:  # the same values without a shuffle (Triton's interpreter has none)
                a = tl.reshape(am, (BLOCK_N * WK, 8, 4)).to(tl.float32, bitcast=True)  # 4t + u
                a = tl.sum(tl.where(tl.arange(0, 8)[None, :, None] == s, a, 0.0), axis=1)
                a = tl.broadcast_to(a[:, :, None], (BLOCK_N * WK, 4, 8))  # word 8u + v: 4s + u
            acc += part * tl.reshape(a, (1, BLOCK_N, 32 * WK))
    _finish(tl.sum(acc, axis=2), rm, M, rn, n_mask, pid_n, pid_k, N, n_slices, y_ptr, part_ptr,
            cnt_ptr, NS, delta, bias, LORA, BIAS)  # fmt: skip


@triton.jit(do_not_specialize=["M", "N", "NBLK", "blk_per", "n_slices", "zero"])
def qm_mma_4bit(x_ptr, q_ptr, am_ptr, am2_ptr, code2_ptr, off_ptr, lut_ptr, y_ptr, part_ptr,
                cnt_ptr, M, N, NBLK, KH, blk_per, n_slices, zero,
                BS2: tl.constexpr, NESTED: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_M: tl.constexpr, NB: tl.constexpr, NS: tl.constexpr, LUT: tl.constexpr,
                BF16: tl.constexpr, OFFS: tl.constexpr = False):  # fmt: skip
    # y (M, N) = x (M, K) @ W^T for 9 to 64 rows on tensor cores, the codes read once: a program
    # owns BLOCK_N features and all M rows (M <= BLOCK_M, a power of two >= 16; more: below) and
    # walks its share of K in steps of NB blocks of 64 codes. A step loads the features' bytes of
    # codes (BLOCK_N, 32 NB: byte j holds inputs 2j, high nibble, and 2j + 1, low), turns each
    # nibble into its value (shuffled from the lane that holds it, LUT 1, or loaded, LUT 0), scales
    # it by its block's absmax (fp32, as dequantize_4bit computes it) and rounds it to x's dtype:
    # the weight bitsandbytes writes, in registers only. x's rows are read as int32 words, each the
    # pair (input 2j, input 2j + 1), split into the even and the odd inputs; the high nibbles meet
    # the even inputs and the low ones the odd in two MMAs of K = 32 NB, so neither side is
    # interleaved. The features run along the MMA's M and the rows along its N (acc: BLOCK_N,
    # BLOCK_M), so that 16 rows fill an instruction. K is cut into shares as in the gemvs
    # (`_finish`, fp32 partials added in a fixed order). KH: bytes of codes a feature (x's rows are
    # KH int32 words apart: x is contiguous). `zero` (0 at run time): the lane table's seed. OFFS:
    # one offset per nested block (siblings joined), as in qm_gemv_lines. More than BLOCK_M rows (a
    # training batch's, say: the dequantization as the GEMM's prologue) take a third grid axis, a
    # program per BLOCK_M rows, with K in one share (the shares' counts are per group of features).
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    HB: tl.constexpr = 32  # bytes of a 64-block
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    rn_c = tl.minimum(rn, N - 1)  # features past N read feature N - 1: never stored
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = rm < M
    rj = tl.arange(0, NB * HB)  # a step's bytes (and x's words) from its first
    rb = tl.arange(0, NB)
    b_first = pid_k * blk_per
    b_end = tl.minimum(b_first + blk_per, NBLK)
    off = 0.0
    if NESTED and not OFFS:
        off = tl.load(off_ptr)
    tab = zero
    if LUT == 1:  # code value (lane & 15) in each thread (fp32 bits), for the shuffles
        tab = _lane_table(lut_ptr, _lane_id(zero) & 15)
    dt = tl.bfloat16 if BF16 else tl.float16
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for b0 in range(b_first, b_end, NB):
        j_ok = b0 + rj // HB < b_end  # by whole blocks (a mask constant over 16 bytes)
        q = tl.load(q_ptr + rn_c[:, None] * KH + b0 * HB + rj[None, :], mask=j_ok[None, :],
                    other=0).to(tl.int32)  # fmt: skip
        blk = rn_c[:, None] * NBLK + b0 + rb[None, :]
        b_ok = (b0 + rb < b_end)[None, :]
        b_off = off
        if NESTED and OFFS:  # each nested block's own offset
            b_off = tl.load(off_ptr + blk // BS2, mask=b_ok, other=0.0)
        a = absmax_of(am_ptr, am2_ptr, code2_ptr, b_off, blk, b_ok, NESTED, BS2)
        a = a[:, :, None]  # (BLOCK_N, NB, 1): one absmax a block
        hi = tl.reshape(_code_value(tab, lut_ptr, q, 4, LUT), (BLOCK_N, NB, HB))
        lo = tl.reshape(_code_value(tab, lut_ptr, q, 0, LUT), (BLOCK_N, NB, HB))
        w_hi = tl.reshape(hi * a, (BLOCK_N, NB * HB)).to(dt)
        w_lo = tl.reshape(lo * a, (BLOCK_N, NB * HB)).to(dt)
        x_at = x_ptr + rm[None, :] * KH + b0 * HB + rj[:, None]  # (32 NB, BLOCK_M): x^T
        xw = tl.load(x_at, mask=j_ok[:, None] & m_ok[None, :], other=0)
        xe, xo = _x_halves(xw, BF16)
        acc = tl.dot(w_hi, xe.to(dt), acc)
        acc = tl.dot(w_lo, xo.to(dt), acc)
    _finish(tl.trans(acc), rm, M, rn, n_mask, pid_n, pid_k, N, n_slices, y_ptr, part_ptr,
            cnt_ptr, NS, acc, acc, False, False)  # fmt: skip


@triton.jit
def _split4(t):
    # (n, m, 4) -> its four slices along the last axis, in order, each (m, 1, n)
    a, b = tl.split(tl.reshape(t, (t.shape[0], t.shape[1], 2, 2)))  # j = 2p + q: q 0 (j 0, 2), 1
    t0, t2 = tl.split(a)
    t1, t3 = tl.split(b)
    return (tl.trans(t0)[:, None, :], tl.trans(t1)[:, None, :], tl.trans(t2)[:, None, :],
            tl.trans(t3)[:, None, :])  # fmt: skip


@triton.jit
def _lane_table(lut_ptr, lane):
    # the code value (fp32 bits) picked by `lane` (0..15) from 16 scalar loads
    t = 0
    for i in tl.static_range(16):
        t = tl.where(lane == i, tl.load(lut_ptr + i).to(tl.int32, bitcast=True), t)
    return t


@triton.jit
def _low_rank(rm, M, rn, n_mask, t_ptr, e_ptr, col_ptr, sc_ptr, R, RANK, RL: tl.constexpr):
    # each feature's low-rank delta, fp32 (rows rm, features rn): sc[n] * sum_j e[n, j] t[m,
    # col[n] + j] (j < RANK; t: M rows of R fp32; no column past R is read)
    rr = tl.arange(0, RL)
    r_ok = rr < RANK
    e = tl.load(e_ptr + rn[:, None] * RANK + rr[None, :], mask=n_mask[:, None] & r_ok[None, :],
                other=0.0)  # fmt: skip
    col = tl.load(col_ptr + rn, mask=n_mask, other=0)
    sc = tl.load(sc_ptr + rn, mask=n_mask, other=0.0)
    tc = col[:, None] + rr[None, :]  # (BLOCK_N, RL): columns of t, none past its R
    t_ok = (rm < M)[:, None, None] & (n_mask[:, None] & r_ok[None, :] & (tc < R))[None, :, :]
    t = tl.load(t_ptr + rm[:, None, None] * R + tc[None, :, :], mask=t_ok, other=0.0)
    return tl.sum(t * e[None, :, :], axis=2) * sc[None, :]


@triton.jit
def _stored(tot, delta, bias, dt: tl.constexpr, LORA: tl.constexpr, BIAS: tl.constexpr):
    # the fp32 sums `tot` as y stores them (dt); LORA: plus `delta`, the two rounded to dt each,
    # then added (fp32, rounded once): what `y + (B(A x) * scale).to(y.dtype)` gives after the
    # product's own store; BIAS: the bias (per feature, dt's values) added to the rounded
    # product and rounded first, as `(y + bias)` is before the delta
    if LORA:
        tot = tot.to(dt).to(tl.float32)
        if BIAS:
            tot = (tot + bias[None, :]).to(dt).to(tl.float32)
        tot = tot + delta.to(dt).to(tl.float32)
    return tot.to(dt)


@triton.jit
def _finish(acc, rm, M, rn, n_mask, pid_n, pid_k, N, n_slices, y_ptr, part_ptr, cnt_ptr,
            NS: tl.constexpr, delta, bias, LORA: tl.constexpr, BIAS: tl.constexpr):  # fmt: skip
    # y[rm, rn] = the fp32 sums `acc` (rows rm < M, features rn) of this share of K: directly
    # with one share (NS 1); else each share writes its partials (part: n_slices, M, N) and
    # counts itself in cnt[pid_n], and the last adds them all in a fixed order (deterministic:
    # a tree over all of them at once, or, past 4,096 sums, one share after another), writes y
    # and sets the count back to 0. LORA: `delta` (fp32, acc's shape: `_low_rank`) added as y is
    # stored (`_stored`; BIAS: `bias`, (features,) fp32, added first).
    mask = (rm < M)[:, None] & n_mask[None, :]
    at = rm[:, None] * N + rn[None, :]
    dt: tl.constexpr = y_ptr.dtype.element_ty
    if NS == 1:
        tl.store(y_ptr + at, _stored(acc, delta, bias, dt, LORA, BIAS), mask=mask)
    else:
        tl.store(part_ptr + pid_k * M * N + at, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial stored before the count says so
        done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if done == n_slices - 1:  # the last share: the others' partials are in
            if NS * acc.shape[0] * acc.shape[1] <= 4096:  # (the gemvs' few rows and features)
                rs = tl.arange(0, NS)  # every share's partials loaded at once, summed as a tree
                s_ok = (rs < n_slices)[:, None, None] & mask[None, :, :]
                parts = tl.load(part_ptr + rs[:, None, None] * M * N + at[None, :, :],
                                mask=s_ok, other=0.0, cache_modifier=".cg")  # fmt: skip
                tot = tl.sum(parts, axis=0)
            else:  # too many to hold at once (they spilled): one share after another, in order
                tot = tl.zeros(acc.shape, dtype=tl.float32)
                for i in range(0, n_slices):
                    tot += tl.load(part_ptr + i * M * N + at, mask=mask, other=0.0,
                                   cache_modifier=".cg")  # fmt: skip
            tl.store(y_ptr + at, _stored(tot, delta, bias, dt, LORA, BIAS), mask=mask)
            tl.store(cnt_ptr + pid_n, 0)  # ready for the next call (or graph replay)
