"""An experiment for the one-row nf4 gemv: the input's products looked up, not the codes' values
(a CUDA kernel compiled at run time by NVRTC through torch), against the library's Triton gemv.

The library's gemv turns each 4-bit code into its value (a warp shuffle), multiplies it by its
input and adds: about 5 instructions a code inside the SM, which bound it at 59% of an H100's
memory rate on the widest 7B shape (docs/benchmarks.md, "The one-row gemv's limit"). With one row
of x, every output feature multiplies the same inputs, so each byte of codes (two codes, inputs
2p and 2p + 1) can be looked up in a table made once per launch slice:

    T[p][b] = value(b >> 4) * x[2p] + value(b & 15) * x[2p + 1]      (b: the byte, 0..255)

A byte then costs one shared-memory load and one addition, and a block of 64 codes one scale.

Layout: a block owns a slice of 256 inputs (128 bytes of each feature's codes) and a chunk of the
features; its table (256 x 128 fp32, 128 KB of shared memory) is made first, while the first
tile's loads are in flight. A warp takes TR features at a time (a tile; the next tile's loads
issued while this one is summed): lane j reads the 32-bit word j of each feature's slice (4
bytes, 8 codes), so a warp's load is 128 contiguous bytes, and the table's columns are permuted
so that lane j's byte i is column 32 i + j: a warp's 32 lookups fall in 32 banks whatever the
bytes. The tile's sums are reduced across the warp by halves, each lane keeping a part: after
the three steps inside a group of 8 lanes (one block of 64 codes) each lane holds TR / 8
features' sums and scales them by their block's absmax (bitsandbytes' double-quant
statistics); the remaining steps give each lane one feature. The slices' sums meet in an fp32
buffer by atomic additions (their order varies: the last bits may differ from call to call;
DET below does not), and the chunk's last block (a counter) rounds them to bf16 and zeroes the
buffer and counter for the next call (a CUDA graph replays it).

Not in the library: `nf4_gemv_bench.py` times it as the tile KERNEL "xtab" (one row, bf16, nested
statistics, `in` a multiple of 256, `out` of 32) against the Triton gemv and bitsandbytes, in one
process. A tile's keys: TR features a warp's tile (8, 16 or 32; default 32), THREADS a block
(512 or 1024; default 512), PF tiles ahead whose codes are prefetched into L2 (0: none), DET 1
for sums of the same bits every call (each slice's sums stored apart and added in slice order by
the last block), SL the inputs a table covers (256, or 128: a 64 KB table, so that two or three
blocks share an SM; a warp load then reads two features, 16 lanes each, and the second half-warp
takes each word's bytes in another order so that the halves' lookups fall in different banks; TR
16 or 32), BPS the blocks an SM the grid is cut for (and, above 1, asked of the register
allocation). Each (K, TR, THREADS, PF, DET, SL, BPS) compiles its own kernel. Measured in
docs/benchmarks.md (thirty-second sitting): the fastest, TR 8 at 1024 threads, was 2-13% under
the library's gemv on four 7B shapes and 25% over on 4096 x 4096; every deterministic SL 128
form was 11-129% slower than SL 256 (forty-fourth sitting). CUDA only.

Example:
    >>> y = launch_xtab(x, flat, *stats, 64, "nf4", out_f, {"KERNEL": "xtab"})  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import torch

THREADS = 512  # a block's threads by default (the table's 128 KB leaves one block an SM)
SLICE = 256  # inputs a block's table covers by default (128 bytes of codes a feature)


def table_bytes(sl: int = SLICE) -> int:
    """Shared memory a block takes: the table (256 x sl / 2 fp32), the nested code values, a flag.

    Example:
        >>> table_bytes(256), table_bytes(128)
        (132112, 66576)
    """
    return 256 * (sl // 2) * 4 + 256 * 4 + 16


SOURCE = r"""
// KC: the codes' `in` (K), fixed at compile time (one kernel per K): a row's words are then at
// immediate offsets of one address; TR: features a warp's tile (8, 16 or 32); NT: threads a block
#ifndef SL
#define SL 256            // inputs a block's table covers (256 or 128)
#endif
#ifndef MINB
#define MINB 1            // blocks an SM asked of the compiler (__launch_bounds__)
#endif
#define KW (KC / 8)       // 32-bit words of codes a feature
#define NBLK (KC / 64)    // blocks of 64 a feature
#define WS (SL / 8)       // a feature's words in a slice: the lanes one load of a feature spans
#define HALVES (256 / SL) // features one warp load reads (SL 128: lanes 16-31 the next feature)
#define NC (SL / 2)       // the table's columns (bytes of a feature's slice)
#define RSH (SL == 256 ? 9 : 8)  // log2 of a table row's bytes (NC x 4)
#define TRL (TR / HALVES) // words a lane loads a tile
#define NK (TRL / 8)      // the scales a lane applies a tile (TRL 8, 16 or 32)
#ifndef PF
#define PF 0              // tiles ahead whose codes are prefetched into L2 (0: none)
#endif
#ifndef DET
#define DET 0             // 1: each slice's sums stored apart, added in slice order (same bits)
#endif
// a feature's sum over this slice: added into y32 (atomically), or (DET) stored at y32[s][n]
#if DET
#define PUT(n, v) (y32[(size_t)blockIdx.x * N + (n)] = (v))
#else
#define PUT(n, v) atomicAdd(y32 + (n), (v))
#endif

__device__ __forceinline__ float bf2f(unsigned short h) {
  return __uint_as_float(((unsigned int)h) << 16);
}
__device__ __forceinline__ unsigned short f2bf(float f) {
  unsigned short h; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;
}
__device__ __forceinline__ unsigned int ld_stream(const unsigned int* p) {
  unsigned int r;
  asm("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(r) : "l"(p));
  return r;
}
__device__ __forceinline__ void prefetch_l2(const unsigned int* p) {
  asm volatile("prefetch.global.L2::evict_normal [%0];" :: "l"(p));
}
// the 4 bytes of v looked up (byte i: column WS i + word; bE / bO the columns of bytes 0 and 1,
// bytes 2 and 3 two column groups on, plus a byte's row) and summed. SL 128: the second
// half-warp's words come with bytes 0 and 1, 2 and 3 swapped (`swz`; bE and bO swapped too),
// so that the two halves' lookups fall in different banks
__device__ __forceinline__ float lookup4(unsigned int bE, unsigned int bO, unsigned int swz,
                                         unsigned int v) {
  float t0, t1, t2, t3;
#if SL == 128
  v = __byte_perm(v, 0, swz);
  const unsigned int a0 = bE + (__byte_perm(v, 0, 0x4440) << RSH);
  const unsigned int a1 = bO + (__byte_perm(v, 0, 0x4441) << RSH);
  const unsigned int a2 = bE + (__byte_perm(v, 0, 0x4442) << RSH);
  const unsigned int a3 = bO + ((v >> 24) << RSH);
  asm("ld.shared.f32 %0, [%1];" : "=f"(t0) : "r"(a0));
  asm("ld.shared.f32 %0, [%1];" : "=f"(t1) : "r"(a1));
  asm("ld.shared.f32 %0, [%1+%2];" : "=f"(t2) : "r"(a2), "n"(WS * 8));
  asm("ld.shared.f32 %0, [%1+%2];" : "=f"(t3) : "r"(a3), "n"(WS * 8));
#else  // (bE: the lane's column 0; the bytes at immediate offsets of it)
  const unsigned int a0 = bE + (__byte_perm(v, 0, 0x4440) << 9);
  const unsigned int a1 = bE + (__byte_perm(v, 0, 0x4441) << 9);
  const unsigned int a2 = bE + (__byte_perm(v, 0, 0x4442) << 9);
  const unsigned int a3 = bE + ((v >> 24) << 9);
  asm("ld.shared.f32 %0, [%1];" : "=f"(t0) : "r"(a0));
  asm("ld.shared.f32 %0, [%1+128];" : "=f"(t1) : "r"(a1));
  asm("ld.shared.f32 %0, [%1+256];" : "=f"(t2) : "r"(a2));
  asm("ld.shared.f32 %0, [%1+384];" : "=f"(t3) : "r"(a3));
#endif
  return (t0 + t1) + (t2 + t3);
}

// one reduce-scatter step across lane bit `bit` (m values a lane, m/2 kept): the lanes with the
// bit set keep the upper half, each value the sum of the pair of lanes
#define RS_STEP(a, m, bit, lane)                                              \
  _Pragma("unroll") for (int r = 0; r < (m) / 2; ++r) {                     \
    const bool up = (lane >> (bit)) & 1;                                     \
    const float send = up ? a[r] : a[r + (m) / 2];                           \
    const float keep = up ? a[r + (m) / 2] : a[r];                           \
    a[r] = keep + __shfl_xor_sync(0xffffffffu, send, 1 << (bit));           \
  }

struct Tile {
  unsigned int w[TRL];  // the tile's words (lane j: word j % WS of feature HALVES r + j / WS)
  unsigned int am[NK];  // this lane's scales' 8-bit codes, nested absmax and offset
  float am2[NK], off[NK];
};

// the loads of the tile at feature t0 (N a multiple of 32: no feature past N)
__device__ __forceinline__ void load_tile(Tile& t, const unsigned int* __restrict__ q,
                                          const unsigned char* __restrict__ am,
                                          const float* __restrict__ am2,
                                          const float* __restrict__ off, int offs, float off0,
                                          int t0, int s, int lane, int rowk) {
  const int h = lane / WS, wl = lane % WS;
  const unsigned int* p = q + (size_t)(t0 + h) * KW + s * WS + wl;
#pragma unroll
  for (int r = 0; r < TRL; ++r) t.w[r] = ld_stream(p + r * HALVES * KW);
#pragma unroll
  for (int k = 0; k < NK; ++k) {
    const size_t blk = (size_t)(t0 + HALVES * (rowk + k) + h) * NBLK + s * (SL / 64) + (wl >> 3);
    t.am[k] = am[blk];
    t.am2[k] = am2[blk >> 8];
    t.off[k] = offs ? off[blk >> 8] : off0;
  }
}

// the tile's TR sums into y32 (each lane one feature's, or lanes 16 apart the same one)
__device__ __forceinline__ void sum_tile(const Tile& t, unsigned int bE, unsigned int bO,
                                         unsigned int swz, const float* c2,
                                         float* __restrict__ y32, int t0, int lane, int row_end,
                                         int N) {
  float a[TRL];
#pragma unroll
  for (int r = 0; r < TRL; ++r) a[r] = lookup4(bE, bO, swz, t.w[r]);
  RS_STEP(a, TRL, 0, lane)
  RS_STEP(a, TRL / 2, 1, lane)
  RS_STEP(a, TRL / 4, 2, lane)
  // a[k]: feature t0 + HALVES (rowk + k) + h (rowk: TRL/2 l0 + TRL/4 l1 + TRL/8 l2), this lane
  // group's block
#pragma unroll
  for (int k = 0; k < NK; ++k) a[k] *= fmaf(c2[t.am[k]], t.am2[k], t.off[k]);
#if SL == 128
  // the slice's two blocks (lane bit 3) summed; lane bit 4 is the feature's half
  const int rk = (TRL / 2) * (lane & 1) + (TRL / 4) * ((lane >> 1) & 1)
               + (TRL / 8) * ((lane >> 2) & 1);
#if TRL == 16
  RS_STEP(a, 2, 3, lane)
  const int n = t0 + 2 * (rk + ((lane >> 3) & 1)) + (lane >> 4);
  if (n < row_end) PUT(n, a[0]);
#else
  a[0] += __shfl_xor_sync(0xffffffffu, a[0], 8);
  const int n = t0 + 2 * rk + (lane >> 4);
  if (((lane >> 3) & 1) == 0 && n < row_end) PUT(n, a[0]);
#endif
#elif TR == 32
  RS_STEP(a, 4, 3, lane)
  RS_STEP(a, 2, 4, lane)
  const int n = t0 + 16 * (lane & 1) + 8 * ((lane >> 1) & 1) + 4 * ((lane >> 2) & 1)
              + 2 * ((lane >> 3) & 1) + (lane >> 4);
  if (n < row_end) PUT(n, a[0]);
#elif TR == 16
  RS_STEP(a, 2, 3, lane)
  a[0] += __shfl_xor_sync(0xffffffffu, a[0], 16);
  const int n = t0 + 8 * (lane & 1) + 4 * ((lane >> 1) & 1) + 2 * ((lane >> 2) & 1)
              + ((lane >> 3) & 1);
  if (lane < 16 && n < row_end) PUT(n, a[0]);
#else
  a[0] += __shfl_xor_sync(0xffffffffu, a[0], 8);
  a[0] += __shfl_xor_sync(0xffffffffu, a[0], 16);
  const int n = t0 + 4 * (lane & 1) + 2 * ((lane >> 1) & 1) + ((lane >> 2) & 1);
  if (lane < 8 && n < row_end) PUT(n, a[0]);
#endif
}

// smem: T[256][NC] fp32 (byte b, column c: T[b * NC + c]; column WS i + j holds position
// 4 j + i of the slice), then the nested code's 256 values, then the last-block flag
#if MINB > 1
#define BOUNDS __launch_bounds__(NT, MINB)
#else
#define BOUNDS __launch_bounds__(NT)  // (a min-blocks of 1 made ptxas take more registers)
#endif
extern "C" __global__ void BOUNDS
qm_gemv_xtab(const unsigned short* __restrict__ x, const unsigned int* __restrict__ q,
             const unsigned char* __restrict__ am, const float* __restrict__ am2,
             const float* __restrict__ code2, const float* __restrict__ off,
             const float* __restrict__ lut, unsigned short* __restrict__ y,
             float* __restrict__ y32, unsigned int* __restrict__ count,
             int N, int K, int offs, int chunk_rows) {
  extern __shared__ float smem[];
  float* T = smem;
  float* c2 = smem + 256 * NC;
  unsigned int* flag = (unsigned int*)(c2 + 256);
  const int s = blockIdx.x, chunk = blockIdx.y, S = gridDim.x;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = blockDim.x >> 5;
  const float off0 = offs ? 0.0f : off[0];
  const int row0 = chunk * chunk_rows;
  const int row_end = min(N, row0 + chunk_rows);
  const int rowk = (TRL / 2) * (lane & 1) + (TRL / 4) * ((lane >> 1) & 1)
                 + (TRL / 8) * ((lane >> 2) & 1);
  const int step = nw * TR;
  Tile ta, tb;  // a tile's loads issued while the one before is summed (two in turn)
  int t0 = row0 + warp * TR;
  // the first tile's loads go out before the table is made (they do not read it)
  if (t0 < row_end) load_tile(ta, q, am, am2, off, offs, off0, t0, s, lane, rowk);
  // the table: item (column c, high nibble h) writes T[(h << 4 | l) * NC + c] for the 16 l
  float lv[16];
#pragma unroll
  for (int l = 0; l < 16; ++l) lv[l] = lut[l];
  for (int it = tid; it < NC * 16; it += blockDim.x) {
    const int c = it % NC, h = it / NC;
    const int p = ((c % WS) << 2) | (c / WS);   // the slice position of column c
    const int k = s * SL + 2 * p;
    const float x0 = bf2f(x[k]), x1 = bf2f(x[k + 1]);
    const float a = lut[h] * x0;
    float* col = T + (h << 4) * NC + c;
#pragma unroll
    for (int l = 0; l < 16; ++l) col[l * NC] = fmaf(lv[l], x1, a);
  }
  for (int i = tid; i < 256; i += blockDim.x) c2[i] = code2[i];
  __syncthreads();
  // the lane's columns of its words' bytes 0 and 1 (SL 128, second half-warp: swapped)
  const unsigned int base = (unsigned int)__cvta_generic_to_shared(T) + 4 * (lane % WS);
  const unsigned int hs = (SL == 128) ? (unsigned int)(lane >> 4) : 0u;
  const unsigned int bE = base + hs * WS * 4, bO = base + (1u - hs) * WS * 4;
  const unsigned int swz = hs ? 0x2301u : 0x3210u;
#if PF
  // the codes of the tiles up to PF ahead, into L2: lane r < TR one feature's slice a tile
  for (int d = 1; d <= PF; ++d) {
    const int n = t0 + d * step + lane;
    if (lane < TR && n < row_end) prefetch_l2(q + (size_t)n * KW + s * WS);
  }
#define PREFETCH_AHEAD(t0_)                                                    \
  if (lane < TR && (t0_) + PF * step + lane < row_end)                       \
    prefetch_l2(q + (size_t)((t0_) + PF * step + lane) * KW + s * WS);
#else
#define PREFETCH_AHEAD(t0_)
#endif
  while (t0 < row_end) {
    if (t0 + step < row_end) load_tile(tb, q, am, am2, off, offs, off0, t0 + step, s, lane, rowk);
    PREFETCH_AHEAD(t0 + step)
    sum_tile(ta, bE, bO, swz, c2, y32, t0, lane, row_end, N);
    t0 += step;
    if (t0 >= row_end) break;
    if (t0 + step < row_end) load_tile(ta, q, am, am2, off, offs, off0, t0 + step, s, lane, rowk);
    PREFETCH_AHEAD(t0 + step)
    sum_tile(tb, bE, bO, swz, c2, y32, t0, lane, row_end, N);
    t0 += step;
  }
  // the chunk's last block rounds the sums and zeroes them (and the counter) for the next call
  __threadfence();
  __syncthreads();
  if (tid == 0) *flag = (atomicAdd(count + chunk, 1u) == (unsigned int)(S - 1));
  __syncthreads();
  if (*flag) {
    __threadfence();
    for (int n = row0 + tid; n < row_end; n += blockDim.x) {
#if DET
      float v = 0.0f;  // the slices in order: the same bits every call
#pragma unroll 8
      for (int j = 0; j < S; ++j) v += __ldcg(y32 + (size_t)j * N + n);
      y[n] = f2bf(v);
#else
      y[n] = f2bf(__ldcg(y32 + n));
      y32[n] = 0.0f;
#endif
    }
    if (tid == 0) count[chunk] = 0u;
  }
}
"""

_KERNELS: dict[Any, Any] = {}
_BUFFERS: dict[Any, tuple[torch.Tensor, torch.Tensor]] = {}


def _kernel(device: torch.device, in_f: int, tr: int, threads: int, pf: int, det: int,
            sl: int = SLICE, minb: int = 1) -> Any:  # fmt: skip
    idx = device.index if device.index is not None else torch.cuda.current_device()
    key = (idx, in_f, tr, threads, pf, det, sl, minb)
    if key not in _KERNELS:  # one kernel per K (KC), tile (TR), block (NT), PF, DET, SL, MINB
        head = (f"#define KC {in_f}\n#define TR {tr}\n#define NT {threads}\n#define PF {pf}\n"
                f"#define DET {det}\n#define SL {sl}\n#define MINB {minb}\n")  # fmt: skip
        k = torch.cuda._compile_kernel(head + SOURCE, "qm_gemv_xtab")
        if hasattr(k, "set_shared_memory_config"):
            k.set_shared_memory_config(table_bytes(sl))
        else:  # (an older torch: the driver's attribute set directly)
            from torch.cuda import _utils

            lib = _utils._get_cuda_library()
            _utils._check_cuda(lib.cuFuncSetAttribute(k.func, 8, table_bytes(sl)))  # max dynamic
        _KERNELS[key] = k
    return _KERNELS[key]


def grid_for(
    out_f: int, in_f: int, sms: int, sl: int = SLICE, per_sm: int = 1
) -> tuple[int, int, int]:
    """(slices, chunks, rows a chunk): about `per_sm` blocks an SM, chunks whole warps' 32 rows.

    Example:
        >>> grid_for(4096, 4096, 132)
        (16, 8, 512)
        >>> grid_for(4096, 4096, 132, sl=128, per_sm=2)
        (32, 8, 512)
    """
    slices = in_f // sl
    chunks = max(1, sms * per_sm // slices)  # (one wave: per_sm blocks an SM)
    rows = -(-out_f // chunks)
    rows = -(-rows // 32) * 32
    return slices, -(-out_f // rows), rows


def launch_xtab(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor,
                nested_absmax: torch.Tensor | None, nested_code: torch.Tensor | None,
                offset: torch.Tensor | None, blocksize: int, quant_type: str, out_f: int,
                cfg: dict[str, Any] | None = None, keep: list | None = None) -> torch.Tensor:  # fmt: skip
    """x (1, in) bf16 @ W^T -> (1, out) bf16 by the product-table kernel (`launch_gemv`'s
    arguments); one row, blocksize 64, nested statistics, `in` a multiple of the slice (cfg "SL":
    256 or 128 inputs a table) and `out` of 32 only. cfg "BPS": blocks an SM the grid is cut for
    (and asked of the compiler's register allocation); SL 128 takes TR 16 or 32.

    Example:
        >>> y = launch_xtab(x, flat, *stats, 64, "nf4", 4096)  # doctest: +SKIP
    """
    from quantmesh.quant.kernel4 import _code_values

    rows, in_f = x.shape
    c = cfg or {}
    sl, bps, tr = int(c.get("SL", SLICE)), int(c.get("BPS", 1)), int(c.get("TR", 32))
    if sl not in (256, 128) or (sl == 128 and tr not in (16, 32)):
        raise ValueError(f"the xtab kernel takes SL 256 (TR 8, 16, 32) or 128 (TR 16, 32), not "
                         f"SL {sl} TR {tr}")  # fmt: skip
    if rows != 1 or blocksize != 64 or in_f % sl or out_f % 32 or x.dtype != torch.bfloat16:
        raise ValueError(f"the xtab kernel takes one bf16 row, blocksize 64, in % {sl} == 0 and "
                         f"out % 32 == 0, not {tuple(x.shape)} -> {out_f}")  # fmt: skip
    if nested_absmax is None or nested_code is None or offset is None:
        raise ValueError("the xtab kernel takes nested (double-quant) statistics only")
    x = x.contiguous()
    if packed.data_ptr() % 4:
        raise ValueError("the xtab kernel reads the codes 4 bytes at a time (aligned)")
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    slices, chunks, chunk_rows = grid_for(out_f, in_f, int(c.get("SMS", sms)), sl, bps)
    det = int(c.get("DET", 0))
    sums = out_f * (slices if det else 1)  # (DET: each slice's sums apart)
    key = (x.device, sums, chunks)
    if key not in _BUFFERS:  # zeroed once; each call leaves them zero (or, DET, overwrites them)
        _BUFFERS[key] = (torch.zeros(sums, dtype=torch.float32, device=x.device),
                         torch.zeros(chunks, dtype=torch.int32, device=x.device))  # fmt: skip
    y32, count = _BUFFERS[key]
    y = torch.empty((1, out_f), dtype=torch.bfloat16, device=x.device)
    offset = offset.float().contiguous()
    threads, pf = int(c.get("THREADS", THREADS)), int(c.get("PF", 0))
    _kernel(x.device, in_f, tr, threads, pf, det, sl, bps)(
        grid=(slices, chunks, 1), block=(threads, 1, 1), shared_mem=table_bytes(sl),
        args=[x, packed, absmax, nested_absmax, nested_code.float().contiguous(), offset,
              _code_values(quant_type, x.device), y, y32, count, out_f, in_f,
              int(offset.numel() > 1), chunk_rows],
    )  # fmt: skip
    return y
