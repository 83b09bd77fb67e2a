"""The Triton kernels of `infer/attention.py` (imported only where Triton is installed): see there.

One query token against a key/value cache, split along the keys ("split-KV"):
`qm_decode_attn_split` runs one program per (batch row, kv head, split of the keys) over all the
query heads that read that kv head (grouped-query attention: `G` of them), and writes each
split's softmax statistics (running max, sum) and its unnormalized fp32 output;
`qm_decode_attn_combine` merges a row's splits into the output (one program per query head).
With one split the first kernel writes the output itself (ONE).
"""

import triton
import triton.language as tl

__all__ = ["qm_decode_attn_combine", "qm_decode_attn_split"]


@triton.jit(do_not_specialize=["L", "per_split", "n_splits"])
def qm_decode_attn_split(q_ptr, k_ptr, v_ptr, mask_ptr, m_ptr, l_ptr, acc_ptr, out_ptr, cnt_ptr,
                         Hkv, G, L, scale_log2, hidden,
                         sqb, sqh, sqd, skb, skh, skl, skd, svb, svh, svl, svd, smb, smh, sml,
                         per_split, n_splits,
                         D: tl.constexpr, MASK: tl.constexpr, BLOCK_L: tl.constexpr,
                         GP: tl.constexpr, DP: tl.constexpr, ONE: tl.constexpr,
                         COUNT: tl.constexpr):  # fmt: skip
    # q (B, Hq, 1, D), k and v (B, Hkv, L, D), each with its own strides (elements), D padded to
    # DP (a power of two: where D == DP, the loads along D are unmasked and vectorized); query head
    # h * G + g reads kv head h. The mask's strides (batch, head, key) are 0 along a broadcast
    # dimension. MASK 0: every key visible; 1: uint8, nonzero = attend; 2: float, added to the
    # scores, a key at or below `hidden` counts as hidden (its weight is 0 in fp32 anyway).
    # This program: batch row b, kv head h, keys [s * per_split, (s + 1) * per_split) in blocks
    # of BLOCK_L (per_split a multiple of it). A block none of whose keys any of the G heads
    # sees is skipped before K or V is read (a static cache's unwritten tail costs its mask's
    # bytes only); within a block, only the keys some head sees are loaded. Softmax online, in
    # base 2 (q pre-scaled by scaling x log2(e)), fp32. Partials (ONE 0): m and l (B * Hq,
    # n_splits), acc (B * Hq, n_splits, D) unnormalized; ONE 1: out (B, 1, Hq, D) directly.
    # A head that sees no key gets 0. COUNT: the blocks read, per program, into cnt (B * Hkv,
    # n_splits) (the tests' check of the skip).
    pid = tl.program_id(0)
    s = tl.program_id(1)
    b = (pid // Hkv).to(tl.int64)
    h = (pid % Hkv).to(tl.int64)
    rg = tl.arange(0, GP)
    rd = tl.arange(0, DP)
    rl = tl.arange(0, BLOCK_L)
    g_ok = rg < G
    d_ok = rd < D
    hq = h * G + rg  # (GP,) the query heads of this kv head
    q = tl.load(q_ptr + b * sqb + hq[:, None] * sqh + rd[None, :] * sqd,
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
    q = q.to(tl.float32) * scale_log2
    k_at = k_ptr + b * skb + h * skh
    v_at = v_ptr + b * svb + h * svh
    mask_at = mask_ptr + b * smb + hq * smh  # (GP,)
    m_i = tl.full((GP,), float("-inf"), tl.float32)
    l_i = tl.zeros((GP,), tl.float32)
    acc = tl.zeros((GP, DP), tl.float32)
    seen = 0
    lo = s * per_split
    hi = tl.minimum(lo + per_split, L)
    for start in range(lo, hi, BLOCK_L):
        keys = start + rl
        k_ok = keys < hi
        gk = g_ok[:, None] & k_ok[None, :]  # (GP, BLOCK_L)
        if MASK == 0:
            sees = gk
        else:
            mv = tl.load(mask_at[:, None] + keys[None, :].to(tl.int64) * sml, mask=gk, other=0)
            if MASK == 1:
                sees = gk & (mv != 0)
            else:
                bias = mv.to(tl.float32)
                sees = gk & (bias > hidden)
        key_seen = tl.max(sees.to(tl.int32), axis=0) > 0  # (BLOCK_L,) seen by some head
        if tl.max(key_seen.to(tl.int32), axis=0) > 0:  # else: the block is skipped, unread
            seen += 1
            kv_ok = key_seen[:, None] & d_ok[None, :]
            kv_rows = keys[:, None].to(tl.int64)
            k = tl.load(k_at + kv_rows * skl + rd[None, :] * skd, mask=kv_ok, other=0.0)
            sc = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)  # (GP, BLOCK_L)
            if MASK == 2:
                sc += bias * 1.4426950408889634  # log2(e): the scores are in base 2
            sc = tl.where(sees, sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no -inf - -inf
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(sc - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_at + kv_rows * svl + rd[None, :] * svd, mask=kv_ok, other=0.0)
            pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)  # (GP, DP)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
    rows = b * (Hkv * G) + hq  # (GP,) the query heads' rows of (B * Hq)
    if ONE:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + rows[:, None] * D + rd[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=g_ok[:, None] & d_ok[None, :])  # fmt: skip
    else:
        at = rows * n_splits + s
        tl.store(m_ptr + at, m_i, mask=g_ok)
        tl.store(l_ptr + at, l_i, mask=g_ok)
        tl.store(acc_ptr + at[:, None] * D + rd[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])
    if COUNT:
        tl.store(cnt_ptr + pid * n_splits + s, seen)


@triton.jit(do_not_specialize=["n_splits"])
def qm_decode_attn_combine(m_ptr, l_ptr, acc_ptr, out_ptr, n_splits, D: tl.constexpr,
                           SP: tl.constexpr, DP: tl.constexpr):  # fmt: skip
    # One query head's output (row `pid` of (B * Hq)) from its n_splits partials: each split's
    # sum and output scaled by 2^(its max - the largest max) (0 for a split that saw no key),
    # the outputs' sum divided by the sums' (0 where no key was seen). SP, DP: powers of two at
    # or above n_splits and D.
    row = tl.program_id(0).to(tl.int64)
    rs = tl.arange(0, SP)
    rd = tl.arange(0, DP)
    s_ok = rs < n_splits
    d_ok = rd < D
    m = tl.load(m_ptr + row * n_splits + rs, mask=s_ok, other=float("-inf"))
    lsum = tl.load(l_ptr + row * n_splits + rs, mask=s_ok, other=0.0)
    top = tl.max(m, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp2(m - top)  # (SP,)
    acc = tl.load(acc_ptr + (row * n_splits + rs[:, None]) * D + rd[None, :],
                  mask=s_ok[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
    num = tl.sum(acc * w[:, None], axis=0)
    den = tl.sum(lsum * w, axis=0)
    o = num / tl.where(den > 0, den, 1.0)
    tl.store(out_ptr + row * D + rd, o.to(out_ptr.dtype.element_ty), mask=d_ok)
