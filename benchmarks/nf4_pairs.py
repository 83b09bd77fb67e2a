"""An experiment for the one-row nf4 gemv: code *pairs* looked up in shared memory (a CUDA kernel,
compiled at run time by NVRTC through torch), against the library's Triton gemv, which finds each
code's value by a warp shuffle (docs/benchmarks.md, "The gemv's bound, estimated").

Each byte of codes (two 4-bit codes) indexes a 256-entry table of value pairs (fp16 x 2 in one
32-bit word), replicated once per shared-memory bank (table[byte][lane], 32 KB): a lane reads only
its own bank, so a warp's 32 lookups never conflict, and one 32-bit load gives two values: 0.5
loads a code where the shuffle design issues 1.125 shuffles a code. The pair's values are the
code values rounded to fp16 (2^-11 relative; bitsandbytes rounds each dequantized weight to bf16,
2^-9); the products and sums are fp32, scaled by each block's absmax (bitsandbytes' double-quant
statistics, one offset or one per nested block), the output rounded to bf16.

Layout: a block of 8 warps; a warp owns F = 4 output features and walks all of K, each lane
holding 16 bytes of codes of each feature a step (32 codes: half a block of 64) and the 32 x
values they multiply (read once for the warp's 4 features), the next step's codes loaded before
the current step's are used. The grid is at most `BLOCKS_PER_SM` blocks an SM, each looping over
groups of 32 features, so that each block fills its table once for several groups.

Not in the library: `nf4_gemv_bench.py` times it as the tile KERNEL "pairs" (one row, bf16, nested
statistics) against the Triton gemv and bitsandbytes, in one process; "pairs_k", a second layout
(see `FK_PER_BLOCK`), and "pairs32", a third (fp32 pairs, see `SOURCE_32`), too; a tile's "BPS"
sets the blocks an SM (default `BLOCKS_PER_SM`). On an H100 all three were slower than the Triton
gemv on every 7B shape (docs/benchmarks.md, twenty-eighth sitting). CUDA only.

Example:
    >>> y = launch_pairs(x, flat, *stats, 64, "nf4", out_f, {"KERNEL": "pairs"})  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import torch

F_PER_WARP = 4
WARPS = 8
BLOCKS_PER_SM = 2

SOURCE = r"""
#define F 4
#define W 8

__device__ __forceinline__ unsigned short f2h(float f) {
  unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;
}
__device__ __forceinline__ float h2f(unsigned short h) {
  float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f;
}
__device__ __forceinline__ unsigned short f2bf(float f) {
  unsigned short h; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;
}
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

// block `blk`'s absmax: its 8-bit code's value (c2) times its nested block's absmax, plus the
// offset (one per nested block with offs, else off0)
__device__ __forceinline__ float block_scale(const float* c2, const unsigned char* am,
                                             const float* am2, const float* off, int offs,
                                             float off0, unsigned long long blk) {
  return c2[am[blk]] * am2[blk >> 8] + (offs ? off[blk >> 8] : off0);
}

// 32 codes (q: a 16-byte word of one feature) against their 32 x values (4 words of x), in order,
// by the dot8 of the table's kind
#define DOT32(tab, q, xa, xb, xc, xd) \
  dot8(tab, (q).w, xd, dot8(tab, (q).z, xc, dot8(tab, (q).y, xb, dot8(tab, (q).x, xa, 0.0f))))

// one code word (8 codes: bytes 0..3, each high nibble first) against its 8 x values (xv: 4 words
// of two bf16, the even input in the low half)
__device__ __forceinline__ float dot8(const unsigned int* tab, unsigned int q, uint4 xv, float s) {
  unsigned int xs[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    unsigned int p = tab[((q >> (8 * j)) & 255u) << 5];
    s = fmaf(h2f((unsigned short)(p & 0xffffu)), __uint_as_float(xs[j] << 16), s);
    s = fmaf(h2f((unsigned short)(p >> 16)), __uint_as_float(xs[j] & 0xffff0000u), s);
  }
  return s;
}

// the pair table (byte -> the two codes' fp16 values, the high nibble's (even input) in the low
// half; one copy a bank: tab[byte * 32 + lane]) and the nested code, by a block of 256 threads
__device__ __forceinline__ void fill_tables(unsigned int* tab, float* c2, const float* lut,
                                            const float* code2, int tid) {
  for (int i = tid; i < 256 * 32; i += 256) {
    const int b = i >> 5;
    tab[i] = (unsigned int)f2h(lut[b >> 4]) | ((unsigned int)f2h(lut[b & 15]) << 16);
  }
  c2[tid] = code2[tid];
  __syncthreads();
}

// the arguments after x and the codes: the statistics, the code values, y, the sizes
#define REST_ARGS const unsigned char* __restrict__ am, const float* __restrict__ am2, \
  const float* __restrict__ code2, const float* __restrict__ off, const float* __restrict__ lut, \
  unsigned short* __restrict__ y, int N, int K, int offs

extern "C" __global__ void __launch_bounds__(256)
qm_gemv_pairs(const uint4* __restrict__ x4, const uint4* __restrict__ q4, REST_ARGS) {
  __shared__ unsigned int tab[256 * 32];
  __shared__ float c2[256];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  fill_tables(tab, c2, lut, code2, threadIdx.x);
  const unsigned int* mytab = tab + lane;
  const int KQ = K >> 5;               // 16-byte words of codes a feature (32 codes each)
  const int steps = (KQ + 31) >> 5;     // a warp's steps along K
  const int nblk = K >> 6;              // blocks of 64 a feature
  const float off0 = offs ? 0.0f : off[0];
  const int groups = (N + W * F - 1) / (W * F);
  for (int g = blockIdx.x; g < groups; g += gridDim.x) {
    const int n0 = (g * W + warp) * F;
    float acc[F];
    uint4 cur[F], nxt[F];
#pragma unroll
    for (int f = 0; f < F; ++f) {
      acc[f] = 0.0f;
      const int n = min(n0 + f, N - 1);
      cur[f] = lane < KQ ? ld_stream(q4 + (unsigned long long)n * KQ + lane) : make_uint4(0, 0, 0, 0);
    }
    for (int s = 0; s < steps; ++s) {
      const int kq = s * 32 + lane;
      const int kn = kq + 32;
#pragma unroll
      for (int f = 0; f < F; ++f) {
        const int n = min(n0 + f, N - 1);
        nxt[f] = kn < KQ ? ld_stream(q4 + (unsigned long long)n * KQ + kn) : make_uint4(0, 0, 0, 0);
      }
      if (kq < KQ) {
        const uint4 xa = x4[kq * 4], xb = x4[kq * 4 + 1], xc = x4[kq * 4 + 2],
                    xd = x4[kq * 4 + 3];
#pragma unroll
        for (int f = 0; f < F; ++f) {
          const int n = min(n0 + f, N - 1);
          const float t = DOT32(mytab, cur[f], xa, xb, xc, xd);
          const unsigned long long blk = (unsigned long long)n * nblk + (kq >> 1);
          acc[f] = fmaf(block_scale(c2, am, am2, off, offs, off0, blk), t, acc[f]);
        }
      }
#pragma unroll
      for (int f = 0; f < F; ++f) cur[f] = nxt[f];
    }
#pragma unroll
    for (int f = 0; f < F; ++f) {
      float v = acc[f];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      if (lane == 0 && n0 + f < N) y[n0 + f] = f2bf(v);
    }
  }
}
"""

# The second layout ("pairs_k"): the first one's time (8.9 us cold on
# 4096 x 4096 against the Triton gemv's 6.9, an H100) fits its shape: one feature group a block
# (its table filled for one group), 8 warps an SM, a 128-FMA chain a feature and step. Here a
# block's 256 threads stride over K in units of 16 codes (8 bytes a feature), each for all
# FK = 8 features of a group, and the group's sums meet in shared memory; a block serves a
# group after another (the grid at most BLOCKS_PER_SM an SM), so its table serves several.
FK_PER_BLOCK = 8

# The second and third layouts' end of a group: FK sums a thread, added across the warp by shuffles
# and across the block's warps in shared memory (red: 8 warps x FK; a narrower block leaves its
# rows at 0), stored as bf16 by the first FK threads.
GROUP_STORE = r"""
#define FK 8

__device__ __forceinline__ void group_store(const float* acc, float (*red)[FK],
                                            unsigned short* y, int n0, int N, int tid) {
#pragma unroll
  for (int f = 0; f < FK; ++f) {
    float v = acc[f];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if ((tid & 31) == 0) red[tid >> 5][f] = v;
  }
  __syncthreads();
  if (tid < FK && n0 + tid < N) {
    float v = 0.0f;
#pragma unroll
    for (int w = 0; w < 8; ++w) v += red[w][tid];
    y[n0 + tid] = f2bf(v);
  }
  __syncthreads();
}
"""

SOURCE_K = (
    SOURCE.split('extern "C"')[0]
    + GROUP_STORE
    + r"""

extern "C" __global__ void __launch_bounds__(256)
qm_gemv_pairs_k(const uint4* __restrict__ x4, const uint2* __restrict__ q2, REST_ARGS) {
  __shared__ unsigned int tab[256 * 32];
  __shared__ float c2[256];
  __shared__ float red[8][FK];
  const int tid = threadIdx.x, lane = tid & 31;
  fill_tables(tab, c2, lut, code2, tid);
  const unsigned int* mytab = tab + lane;
  const int KU = K >> 4;                // units of 16 codes a feature (8 bytes)
  const int nblk = K >> 6;
  const float off0 = offs ? 0.0f : off[0];
  const int groups = (N + FK - 1) / FK;
  for (int g = blockIdx.x; g < groups; g += gridDim.x) {
    const int n0 = g * FK;
    float acc[FK];
#pragma unroll
    for (int f = 0; f < FK; ++f) acc[f] = 0.0f;
    for (int u = tid; u < KU; u += 256) {
      uint2 q[FK];
#pragma unroll
      for (int f = 0; f < FK; ++f) {  // every load of the step first
        const int n = min(n0 + f, N - 1);
        q[f] = __ldg(q2 + (unsigned long long)n * KU + u);
      }
      const uint4 x0 = x4[u * 2], x1 = x4[u * 2 + 1];  // the unit's 16 inputs
#pragma unroll
      for (int f = 0; f < FK; ++f) {
        const int n = min(n0 + f, N - 1);
        const float t = dot8(mytab, q[f].y, x1, dot8(mytab, q[f].x, x0, 0.0f));
        const unsigned long long blk = (unsigned long long)n * nblk + (u >> 2);
        acc[f] = fmaf(block_scale(c2, am, am2, off, offs, off0, blk), t, acc[f]);
      }
    }
    group_store(acc, red, y, n0, N, tid);
  }
}
"""
)

# The third layout ("pairs32"): the pair table holds fp32 values (two a
# 64-bit word; 16 copies, one per lane of a half-warp, since a warp's 64-bit loads are served a
# half-warp at a time: 32 KB), so a byte's two values need no conversion: one shared load and two
# FMAs a byte, where the fp16 table adds two conversions. A thread's unit is 32 codes of each of
# FK features (16-byte loads, one block of 64 codes per two units), the block as wide as K needs
# (at most 256 threads). Compiled offline for sm_90 by nvcc 13.0: 128 registers, no spills.
# Timed on an H100 in the twenty-eighth sitting: slower than the library's gemv on every shape,
# as were the other two layouts (docs/benchmarks.md).
SOURCE_32 = (
    SOURCE.split("// one code word")[0]
    + GROUP_STORE
    + r"""

// one code word (8 codes, bytes 0..3, each high nibble first) against its 8 x values (the fp32
// table's dot8)
__device__ __forceinline__ float dot8(const float2* tab, unsigned int q, uint4 xv, float s) {
  unsigned int xs[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 p = tab[((q >> (8 * j)) & 255u) << 4];
    s = fmaf(p.x, __uint_as_float(xs[j] << 16), s);
    s = fmaf(p.y, __uint_as_float(xs[j] & 0xffff0000u), s);
  }
  return s;
}

extern "C" __global__ void __launch_bounds__(256)
qm_gemv_pairs32(const uint4* __restrict__ x4, const uint4* __restrict__ q4,
                const unsigned char* __restrict__ am, const float* __restrict__ am2,
                const float* __restrict__ code2, const float* __restrict__ off,
                const float* __restrict__ lut, unsigned short* __restrict__ y, int N, int K,
                int offs) {
  __shared__ float2 tab[256 * 16];
  __shared__ float c2[256];
  __shared__ float red[8][FK];
  const int tid = threadIdx.x, lane = tid & 31, nt = blockDim.x;
  for (int i = tid; i < 256 * 16; i += nt) {
    const int b = i >> 4;
    tab[i] = make_float2(lut[b >> 4], lut[b & 15]);
  }
  for (int i = tid; i < 256; i += nt) c2[i] = code2[i];
  if (tid < 8 * FK) (&red[0][0])[tid] = 0.0f;
  __syncthreads();
  const float2* mytab = tab + (lane & 15);
  const int KU = K >> 5;                // units of 32 codes a feature (16 bytes)
  const int nblk = K >> 6;
  const float off0 = offs ? 0.0f : off[0];
  const int groups = (N + FK - 1) / FK;
  for (int g = blockIdx.x; g < groups; g += gridDim.x) {
    const int n0 = g * FK;
    float acc[FK];
#pragma unroll
    for (int f = 0; f < FK; ++f) acc[f] = 0.0f;
    for (int u = tid; u < KU; u += nt) {
      uint4 q[FK];
#pragma unroll
      for (int f = 0; f < FK; ++f) {  // every load of the step first
        const int n = min(n0 + f, N - 1);
        q[f] = ld_stream(q4 + (unsigned long long)n * KU + u);
      }
      const uint4 xa = x4[u * 4], xb = x4[u * 4 + 1], xc = x4[u * 4 + 2], xd = x4[u * 4 + 3];
#pragma unroll
      for (int f = 0; f < FK; ++f) {
        const int n = min(n0 + f, N - 1);
        const float t = DOT32(mytab, q[f], xa, xb, xc, xd);
        const unsigned long long blk = (unsigned long long)n * nblk + (u >> 1);
        acc[f] = fmaf(block_scale(c2, am, am2, off, offs, off0, blk), t, acc[f]);
      }
    }
    group_store(acc, red, y, n0, N, tid);
  }
}
"""
)

_KERNELS: dict[Any, Any] = {}


def _kernel(device: torch.device, name: str = "qm_gemv_pairs") -> Any:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if (idx, name) not in _KERNELS:
        source = {"qm_gemv_pairs_k": SOURCE_K, "qm_gemv_pairs32": SOURCE_32}.get(name, SOURCE)
        _KERNELS[idx, name] = torch.cuda._compile_kernel(source, name)
    return _KERNELS[idx, name]


def launch_pairs(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor,
                 nested_absmax: torch.Tensor | None, nested_code: torch.Tensor | None,
                 offset: torch.Tensor | None, blocksize: int, quant_type: str, out_f: int,
                 cfg: dict[str, Any] | None = None, keep: list | None = None) -> torch.Tensor:  # fmt: skip
    """x (1, in) bf16 @ W^T -> (1, out) bf16 by the pair-table kernel (`launch_gemv`'s
    arguments); one row, blocksize 64, nested statistics, `in` a multiple of 64 only.

    Example:
        >>> y = launch_pairs(x, flat, *stats, 64, "nf4", 4096)  # doctest: +SKIP
    """
    from quantmesh.quant.kernel4 import _code_values

    rows, in_f = x.shape
    if rows != 1 or blocksize != 64 or in_f % 64 or x.dtype != torch.bfloat16:
        raise ValueError(f"the pairs kernel takes one bf16 row, blocksize 64, not {tuple(x.shape)}")
    if nested_absmax is None or nested_code is None or offset is None:
        raise ValueError("the pairs kernel takes nested (double-quant) statistics only")
    x = x.contiguous()
    if x.data_ptr() % 16 or packed.data_ptr() % 16:
        raise ValueError("the pairs kernel reads x and the codes 16 bytes at a time (aligned)")
    y = torch.empty((1, out_f), dtype=torch.bfloat16, device=x.device)
    offset = offset.float().contiguous()
    kind = (cfg or {}).get("KERNEL", "pairs")
    by_k = kind in ("pairs_k", "pairs32")  # the second and third layouts (see FK_PER_BLOCK)
    groups = -(-out_f // (FK_PER_BLOCK if by_k else F_PER_WARP * WARPS))
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    grid = min(groups, int((cfg or {}).get("BPS", BLOCKS_PER_SM)) * sms)  # blocks an SM
    threads = 32 * WARPS
    if kind == "pairs32":  # a thread a unit of 32 codes: no wider than K needs (whole warps)
        threads = min(threads, -(-(in_f // 32) // 32) * 32)
    _kernel(x.device, f"qm_gemv_{kind}")(
        grid=(grid, 1, 1), block=(threads, 1, 1),
        args=[x, packed, absmax, nested_absmax, nested_code.float().contiguous(), offset,
              _code_values(quant_type, x.device), y, out_f, in_f, int(offset.numel() > 1)],
    )  # fmt: skip
    return y
