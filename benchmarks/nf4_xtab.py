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
features; its table (256 x 128 fp32, 128 KB of shared memory) is made first. A warp takes 32
features at a time: lane j reads the 32-bit word j of each feature's slice (4 bytes, 8 codes),
so a warp's load is 128 contiguous bytes, and the table's columns are permuted so that lane j's
byte i is column 32 i + j: a warp's 32 lookups fall in 32 banks whatever the bytes. The 32
features' sums are reduced across the warp by halves, each lane keeping a part: after the three
steps inside a group of 8 lanes (one block of 64 codes) each lane holds 4 features' sums and
scales them by their block's absmax (bitsandbytes' double-quant statistics); two more steps give
each lane one feature. The slices' sums meet in an fp32 buffer by atomic additions (their order
varies: the last bits may differ from call to call), and the chunk's last block (a counter) rounds
them to bf16 and zeroes the buffer and counter for the next call (a CUDA graph replays it).

Not in the library: `nf4_gemv_bench.py` times it as the tile KERNEL "xtab" (one row, bf16, nested
statistics, `in` a multiple of 256) against the Triton gemv and bitsandbytes, in one process.
CUDA only.

Example:
    >>> y = launch_xtab(x, flat, *stats, 64, "nf4", out_f, {"KERNEL": "xtab"})  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import torch

THREADS = 512  # a block: 16 warps (the table's 128 KB leaves one block an SM)
SLICE = 256  # inputs a block's table covers (128 bytes of codes a feature)
TABLE_BYTES = 256 * 128 * 4 + 256 * 4 + 16  # the table, the nested code values, a flag

SOURCE = r"""
__device__ __forceinline__ float bf2f(unsigned short h) {
  return __uint_as_float(((unsigned int)h) << 16);
}
__device__ __forceinline__ unsigned short f2bf(float f) {
  unsigned short h; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;
}
__device__ __forceinline__ unsigned int ld_stream(const unsigned int* p) {
  unsigned int r;
  asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(r) : "l"(p));
  return r;
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

// smem: T[256][128] fp32 (byte b, column c: T[b * 128 + c]; column 32 i + j holds position
// 4 j + i of the slice), then the nested code's 256 values, then the last-block flag
extern "C" __global__ void __launch_bounds__(512)
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
  // the table: item (column c, high nibble h) writes T[(h << 4 | l) * 128 + c] for the 16 l
  for (int it = tid; it < 128 * 16; it += blockDim.x) {
    const int c = it & 127, h = it >> 7;
    const int p = ((c & 31) << 2) | (c >> 5);   // the slice position of column c
    const int k = s * 256 + 2 * p;
    const float x0 = bf2f(x[k]), x1 = bf2f(x[k + 1]);
    const float a = lut[h] * x0;
#pragma unroll
    for (int l = 0; l < 16; ++l) T[((h << 4) | l) * 128 + c] = fmaf(lut[l], x1, a);
  }
  for (int i = tid; i < 256; i += blockDim.x) c2[i] = code2[i];
  __syncthreads();
  const int KW = K >> 3;       // 32-bit words of codes a feature
  const int nblk = K >> 6;     // blocks of 64 a feature
  const float off0 = offs ? 0.0f : off[0];
  const int row0 = chunk * chunk_rows;
  const int row_end = min(N, row0 + chunk_rows);
  const float* Tj = T + lane;
  const int l0 = lane & 1, l1 = (lane >> 1) & 1, l2 = (lane >> 2) & 1, g = lane >> 3;
  for (int t0 = row0 + warp * 32; t0 < row_end; t0 += nw * 32) {
    unsigned int w[32];
#pragma unroll
    for (int r = 0; r < 32; ++r) {
      const int n = min(t0 + r, N - 1);
      w[r] = ld_stream(q + (size_t)n * KW + s * 32 + lane);
    }
    float a[32];
#pragma unroll
    for (int r = 0; r < 32; ++r) {
      const unsigned int v = w[r];
      a[r] = (Tj[(v & 255u) << 7] + Tj[((v >> 8) & 255u) * 128 + 32])
           + (Tj[((v >> 16) & 255u) * 128 + 64] + Tj[(v >> 24) * 128 + 96]);
    }
    RS_STEP(a, 32, 0, lane)
    RS_STEP(a, 16, 1, lane)
    RS_STEP(a, 8, 2, lane)
    // a[k]: feature t0 + 16 l0 + 8 l1 + 4 l2 + k, this lane group's block g of the slice
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int n = min(t0 + 16 * l0 + 8 * l1 + 4 * l2 + k, N - 1);
      const size_t blk = (size_t)n * nblk + s * 4 + g;
      a[k] *= fmaf(c2[am[blk]], am2[blk >> 8], offs ? off[blk >> 8] : off0);
    }
    RS_STEP(a, 4, 3, lane)
    RS_STEP(a, 2, 4, lane)
    const int n = t0 + 16 * l0 + 8 * l1 + 4 * l2 + 2 * ((lane >> 3) & 1) + (lane >> 4);
    if (n < row_end) atomicAdd(y32 + n, a[0]);
  }
  // the chunk's last block rounds the sums and zeroes them (and the counter) for the next call
  __threadfence();
  __syncthreads();
  if (tid == 0) *flag = (atomicAdd(count + chunk, 1u) == (unsigned int)(S - 1));
  __syncthreads();
  if (*flag) {
    __threadfence();
    for (int n = row0 + tid; n < row_end; n += blockDim.x) {
      y[n] = f2bf(__ldcg(y32 + n));
      y32[n] = 0.0f;
    }
    if (tid == 0) count[chunk] = 0u;
  }
}
"""

_KERNELS: dict[Any, Any] = {}
_BUFFERS: dict[Any, tuple[torch.Tensor, torch.Tensor]] = {}


def _kernel(device: torch.device) -> Any:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _KERNELS:
        k = torch.cuda._compile_kernel(SOURCE, "qm_gemv_xtab")
        if hasattr(k, "set_shared_memory_config"):
            k.set_shared_memory_config(TABLE_BYTES)
        else:  # (an older torch: the driver's attribute set directly)
            from torch.cuda import _utils

            lib = _utils._get_cuda_library()
            _utils._check_cuda(lib.cuFuncSetAttribute(k.func, 8, TABLE_BYTES))  # max dynamic
        _KERNELS[idx] = k
    return _KERNELS[idx]


def grid_for(out_f: int, in_f: int, sms: int) -> tuple[int, int, int]:
    """(slices, chunks, rows a chunk): about one block an SM, chunks whole warps' 32 rows.

    Example:
        >>> grid_for(4096, 4096, 132)
        (16, 9, 480)
    """
    slices = in_f // SLICE
    chunks = max(1, -(-sms // slices))
    rows = -(-out_f // chunks)
    rows = -(-rows // 32) * 32
    return slices, -(-out_f // rows), rows


def launch_xtab(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor,
                nested_absmax: torch.Tensor | None, nested_code: torch.Tensor | None,
                offset: torch.Tensor | None, blocksize: int, quant_type: str, out_f: int,
                cfg: dict[str, Any] | None = None, keep: list | None = None) -> torch.Tensor:  # fmt: skip
    """x (1, in) bf16 @ W^T -> (1, out) bf16 by the product-table kernel (`launch_gemv`'s
    arguments); one row, blocksize 64, nested statistics, `in` a multiple of 256 only.

    Example:
        >>> y = launch_xtab(x, flat, *stats, 64, "nf4", 4096)  # doctest: +SKIP
    """
    from quantmesh.quant.kernel4 import _code_values

    rows, in_f = x.shape
    if rows != 1 or blocksize != 64 or in_f % SLICE or x.dtype != torch.bfloat16:
        raise ValueError(f"the xtab kernel takes one bf16 row, blocksize 64, in % 256 == 0, not "
                         f"{tuple(x.shape)}")  # fmt: skip
    if nested_absmax is None or nested_code is None or offset is None:
        raise ValueError("the xtab kernel takes nested (double-quant) statistics only")
    x = x.contiguous()
    if packed.data_ptr() % 4:
        raise ValueError("the xtab kernel reads the codes 4 bytes at a time (aligned)")
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    slices, chunks, chunk_rows = grid_for(out_f, in_f, int((cfg or {}).get("SMS", sms)))
    key = (x.device, out_f, chunks)
    if key not in _BUFFERS:  # zeroed once; each call leaves them zero
        _BUFFERS[key] = (torch.zeros(out_f, dtype=torch.float32, device=x.device),
                         torch.zeros(chunks, dtype=torch.int32, device=x.device))  # fmt: skip
    y32, count = _BUFFERS[key]
    y = torch.empty((1, out_f), dtype=torch.bfloat16, device=x.device)
    offset = offset.float().contiguous()
    _kernel(x.device)(
        grid=(slices, chunks, 1), block=(THREADS, 1, 1), shared_mem=TABLE_BYTES,
        args=[x, packed, absmax, nested_absmax, nested_code.float().contiguous(), offset,
              _code_values(quant_type, x.device), y, y32, count, out_f, in_f,
              int(offset.numel() > 1), chunk_rows],
    )  # fmt: skip
    return y
