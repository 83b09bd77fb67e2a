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
the last block). Each (K, TR, THREADS, PF, DET) compiles its own kernel. Measured in
docs/benchmarks.md (thirty-second sitting): the fastest, TR 8 at 1024 threads, was 2-13% under
the library's gemv on four 7B shapes and 25% over on 4096 x 4096. CUDA only.

Example:
    >>> y = launch_xtab(x, flat, *stats, 64, "nf4", out_f, {"KERNEL": "xtab"})  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import torch

THREADS = 512  # a block's threads by default (the table's 128 KB leaves one block an SM)
SLICE = 256  # inputs a block's table covers (128 bytes of codes a feature)
TABLE_BYTES = 256 * 128 * 4 + 256 * 4 + 16  # the table, the nested code values, a flag

SOURCE = r"""
// KC: the codes' `in` (K), fixed at compile time (one kernel per K): a row's words are then at
// immediate offsets of one address; TR: features a warp's tile (8, 16 or 32); NT: threads a block
#define KW (KC / 8)       // 32-bit words of codes a feature
#define NBLK (KC / 64)    // blocks of 64 a feature
#define NK (TR / 8)       // the scales a lane applies a tile (TR 8, 16 or 32)
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
// the 4 bytes of v looked up (byte i: column 32 i + lane, `base` the lane's column 0 in the
// shared window) and summed
__device__ __forceinline__ float lookup4(unsigned int base, unsigned int v) {
  float t0, t1, t2, t3;
  const unsigned int a0 = base + (__byte_perm(v, 0, 0x4440) << 9);
  const unsigned int a1 = base + (__byte_perm(v, 0, 0x4441) << 9);
  const unsigned int a2 = base + (__byte_perm(v, 0, 0x4442) << 9);
  const unsigned int a3 = base + ((v >> 24) << 9);
  asm("ld.shared.f32 %0, [%1];" : "=f"(t0) : "r"(a0));
  asm("ld.shared.f32 %0, [%1+128];" : "=f"(t1) : "r"(a1));
  asm("ld.shared.f32 %0, [%1+256];" : "=f"(t2) : "r"(a2));
  asm("ld.shared.f32 %0, [%1+384];" : "=f"(t3) : "r"(a3));
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
  unsigned int w[TR];   // the TR features' words (lane j: word j of the slice)
  unsigned int am[NK];  // this lane's scales' 8-bit codes, nested absmax and offset
  float am2[NK], off[NK];
};

// the loads of the tile at feature t0 (N a multiple of 32: no feature past N)
__device__ __forceinline__ void load_tile(Tile& t, const unsigned int* __restrict__ q,
                                          const unsigned char* __restrict__ am,
                                          const float* __restrict__ am2,
                                          const float* __restrict__ off, int offs, float off0,
                                          int t0, int s, int lane, int rowk) {
  const unsigned int* p = q + (size_t)t0 * KW + s * 32 + lane;
#pragma unroll
  for (int r = 0; r < TR; ++r) t.w[r] = ld_stream(p + r * KW);
#pragma unroll
  for (int k = 0; k < NK; ++k) {
    const size_t blk = (size_t)(t0 + rowk + k) * NBLK + s * 4 + (lane >> 3);
    t.am[k] = am[blk];
    t.am2[k] = am2[blk >> 8];
    t.off[k] = offs ? off[blk >> 8] : off0;
  }
}

// the tile's TR sums into y32 (each lane one feature's; at TR 16, lanes j and j + 16 the same)
__device__ __forceinline__ void sum_tile(const Tile& t, unsigned int base, const float* c2,
                                         float* __restrict__ y32, int t0, int lane, int row_end,
                                         int N) {
  float a[TR];
#pragma unroll
  for (int r = 0; r < TR; ++r) a[r] = lookup4(base, t.w[r]);
  RS_STEP(a, TR, 0, lane)
  RS_STEP(a, TR / 2, 1, lane)
  RS_STEP(a, TR / 4, 2, lane)
  // a[k]: feature t0 + rowk + k (rowk: TR/2 l0 + TR/4 l1 + TR/8 l2), this lane group's block
#pragma unroll
  for (int k = 0; k < NK; ++k) a[k] *= fmaf(c2[t.am[k]], t.am2[k], t.off[k]);
#if TR == 32
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

// smem: T[256][128] fp32 (byte b, column c: T[b * 128 + c]; column 32 i + j holds position
// 4 j + i of the slice), then the nested code's 256 values, then the last-block flag
extern "C" __global__ void __launch_bounds__(NT)
qm_gemv_xtab(const unsigned short* __restrict__ x, const unsigned int* __restrict__ q,
             const unsigned char* __restrict__ am, const float* __restrict__ am2,
             const float* __restrict__ code2, const float* __restrict__ off,
             const float* __restrict__ lut, unsigned short* __restrict__ y,
             float* __restrict__ y32, unsigned int* __restrict__ count,
             int N, int K, int offs, int chunk_rows) {
  extern __shared__ float smem[];
  float* T = smem;
  float* c2 = smem + 256 * 128;
  unsigned int* flag = (unsigned int*)(c2 + 256);
  const int s = blockIdx.x, chunk = blockIdx.y, S = gridDim.x;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = blockDim.x >> 5;
  const float off0 = offs ? 0.0f : off[0];
  const int row0 = chunk * chunk_rows;
  const int row_end = min(N, row0 + chunk_rows);
  const int rowk = (TR / 2) * (lane & 1) + (TR / 4) * ((lane >> 1) & 1)
                 + (TR / 8) * ((lane >> 2) & 1);
  const int step = nw * TR;
  Tile ta, tb;  // a tile's loads issued while the one before is summed (two in turn)
  int t0 = row0 + warp * TR;
  // the first tile's loads go out before the table is made (they do not read it)
  if (t0 < row_end) load_tile(ta, q, am, am2, off, offs, off0, t0, s, lane, rowk);
  // the table: item (column c, high nibble h) writes T[(h << 4 | l) * 128 + c] for the 16 l
  float lv[16];
#pragma unroll
  for (int l = 0; l < 16; ++l) lv[l] = lut[l];
  for (int it = tid; it < 128 * 16; it += blockDim.x) {
    const int c = it & 127, h = it >> 7;
    const int p = ((c & 31) << 2) | (c >> 5);   // the slice position of column c
    const int k = s * 256 + 2 * p;
    const float x0 = bf2f(x[k]), x1 = bf2f(x[k + 1]);
    const float a = lut[h] * x0;
    float* col = T + (h << 4) * 128 + c;
#pragma unroll
    for (int l = 0; l < 16; ++l) col[l * 128] = fmaf(lv[l], x1, a);
  }
  for (int i = tid; i < 256; i += blockDim.x) c2[i] = code2[i];
  __syncthreads();
  const unsigned int base = (unsigned int)__cvta_generic_to_shared(T) + 4 * lane;
#if PF
  // the codes of the tiles up to PF ahead, into L2: lane r < TR one feature's 128 bytes a tile
  for (int d = 1; d <= PF; ++d) {
    const int n = t0 + d * step + lane;
    if (lane < TR && n < row_end) prefetch_l2(q + (size_t)n * KW + s * 32);
  }
#define PREFETCH_AHEAD(t0_)                                                    \
  if (lane < TR && (t0_) + PF * step + lane < row_end)                       \
    prefetch_l2(q + (size_t)((t0_) + PF * step + lane) * KW + s * 32);
#else
#define PREFETCH_AHEAD(t0_)
#endif
  while (t0 < row_end) {
    if (t0 + step < row_end) load_tile(tb, q, am, am2, off, offs, off0, t0 + step, s, lane, rowk);
    PREFETCH_AHEAD(t0 + step)
    sum_tile(ta, base, c2, y32, t0, lane, row_end, N);
    t0 += step;
    if (t0 >= row_end) break;
    if (t0 + step < row_end) load_tile(ta, q, am, am2, off, offs, off0, t0 + step, s, lane, rowk);
    PREFETCH_AHEAD(t0 + step)
    sum_tile(tb, base, c2, y32, t0, lane, row_end, N);
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


def _kernel(device: torch.device, in_f: int, tr: int, threads: int, pf: int, det: int) -> Any:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    key = (idx, in_f, tr, threads, pf, det)
    if key not in _KERNELS:  # one kernel per K (KC), tile (TR), block (NT), PF and DET
        head = (f"#define KC {in_f}\n#define TR {tr}\n#define NT {threads}\n#define PF {pf}\n"
                f"#define DET {det}\n")  # fmt: skip
        k = torch.cuda._compile_kernel(head + SOURCE, "qm_gemv_xtab")
        if hasattr(k, "set_shared_memory_config"):
            k.set_shared_memory_config(TABLE_BYTES)
        else:  # (an older torch: the driver's attribute set directly)
            from torch.cuda import _utils

            lib = _utils._get_cuda_library()
            _utils._check_cuda(lib.cuFuncSetAttribute(k.func, 8, TABLE_BYTES))  # max dynamic
        _KERNELS[key] = k
    return _KERNELS[key]


def grid_for(out_f: int, in_f: int, sms: int) -> tuple[int, int, int]:
    """(slices, chunks, rows a chunk): about one block an SM, chunks whole warps' 32 rows.

    Example:
        >>> grid_for(4096, 4096, 132)
        (16, 8, 512)
    """
    slices = in_f // SLICE
    chunks = max(1, sms // slices)  # (one wave: a block an SM)
    rows = -(-out_f // chunks)
    rows = -(-rows // 32) * 32
    return slices, -(-out_f // rows), rows


def launch_xtab(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor,
                nested_absmax: torch.Tensor | None, nested_code: torch.Tensor | None,
                offset: torch.Tensor | None, blocksize: int, quant_type: str, out_f: int,
                cfg: dict[str, Any] | None = None, keep: list | None = None) -> torch.Tensor:  # fmt: skip
    """x (1, in) bf16 @ W^T -> (1, out) bf16 by the product-table kernel (`launch_gemv`'s
    arguments); one row, blocksize 64, nested statistics, `in` a multiple of 256 and `out` of 32
    only.

    Example:
        >>> y = launch_xtab(x, flat, *stats, 64, "nf4", 4096)  # doctest: +SKIP
    """
    from quantmesh.quant.kernel4 import _code_values

    rows, in_f = x.shape
    if rows != 1 or blocksize != 64 or in_f % SLICE or out_f % 32 or x.dtype != torch.bfloat16:
        raise ValueError(f"the xtab kernel takes one bf16 row, blocksize 64, in % 256 == 0 and "
                         f"out % 32 == 0, not {tuple(x.shape)} -> {out_f}")  # fmt: skip
    if nested_absmax is None or nested_code is None or offset is None:
        raise ValueError("the xtab kernel takes nested (double-quant) statistics only")
    x = x.contiguous()
    if packed.data_ptr() % 4:
        raise ValueError("the xtab kernel reads the codes 4 bytes at a time (aligned)")
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    slices, chunks, chunk_rows = grid_for(out_f, in_f, int((cfg or {}).get("SMS", sms)))
    det = int((cfg or {}).get("DET", 0))
    sums = out_f * (slices if det else 1)  # (DET: each slice's sums apart)
    key = (x.device, sums, chunks)
    if key not in _BUFFERS:  # zeroed once; each call leaves them zero (or, DET, overwrites them)
        _BUFFERS[key] = (torch.zeros(sums, dtype=torch.float32, device=x.device),
                         torch.zeros(chunks, dtype=torch.int32, device=x.device))  # fmt: skip
    y32, count = _BUFFERS[key]
    y = torch.empty((1, out_f), dtype=torch.bfloat16, device=x.device)
    offset = offset.float().contiguous()
    tr, threads = int((cfg or {}).get("TR", 32)), int((cfg or {}).get("THREADS", THREADS))
    pf = int((cfg or {}).get("PF", 0))
    _kernel(x.device, in_f, tr, threads, pf, det)(
        grid=(slices, chunks, 1), block=(threads, 1, 1), shared_mem=TABLE_BYTES,
        args=[x, packed, absmax, nested_absmax, nested_code.float().contiguous(), offset,
              _code_values(quant_type, x.device), y, y32, count, out_f, in_f,
              int(offset.numel() > 1), chunk_rows],
    )  # fmt: skip
    return y
