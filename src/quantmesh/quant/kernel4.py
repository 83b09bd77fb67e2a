"""4-bit matmuls on bitsandbytes' packed codes, read once and never written out in float: the
gemv for 1 to 8 rows (decoding up to 8 sequences, the server's small steps; on by default), and,
opt-in, a tensor-core kernel for 9 to 64 rows, a kernel for a few rows and a dequantize for many.

1 to `GEMV_MAX_ROWS` (8) rows: the gemv (`matmul_4bit_gemv`, `_triton4.qm_gemv_lines`), on by
default (`GEMV_ENABLED`; QUANTMESH_GEMV=0 turns it off). Each code's value is found once and
multiplied with every row (fp32 fused multiply-adds); its tiles by row count are
`GEMV_ROW_TILES`. The lanes of a warp run along K: in a step each lane holds one
int32 word (8 codes) of each of the program's features, so a warp's load reads whole 128-byte
lines, and x's 16 bytes for that word are read once for all its features. A stride's absmax are
loaded one block a lane and taken by each step from the lane that holds them, and each code's
value from the lane that holds it (warp shuffles). One warp a program, `GEMV_TILE`'s features
(2) a warp, K in strides of 32 blocks; `gemv_config` cuts K into shares only where a grid would
otherwise hold too few warps, and the shares' fp32 partials are added in a fixed order (the same
bits every call). It is faster than bitsandbytes' 1-row kernel on the 7B shapes, alone and
inside a compiled decode step, and than bitsandbytes' path and Triton's dequantize + matmul at 2
to 8 rows (the figures: docs/benchmarks.md, "A gemv with the lanes along K", "The gemv at 2 to 8
rows" and "Figures the code relies on"). Its weights are bitsandbytes' own (the
fp32 product of the code value and the fp32 absmax, as `dequantize_4bit` computes it); the sums
are fp32, in another order than dequantize + matmul. `qm_gemv_4bit` (one thread per output
feature, the earlier form) is kept for the benchmarks (a tile without `KERNEL`).

The LoRA adapters' B products inside the gemv's launch (on by default where the gemv runs,
`gemv_lora_on`; QUANTMESH_GEMV_LORA=0 turns it off):
`matmul_4bit_gemv(low_rank=(t, e, col, scale, bias))`, the op `quantmesh::gemv_4bit_lora`.
Each program loads its features' B rows (`e`, fp32), their scales and their A products (`t`,
from `col` on) before its loop and adds each output's delta as it stores it, the product and
the delta each rounded to x's dtype first (what adding the delta after the product's store
gives; the delta's few products summed in another order than a matmul's).
A layer's bias (or None) is added to the rounded product and rounded before the delta, as the
layer adds it before its adapter's delta.
A decode step then launches no kernel for B and no addition after the gemv. `check_low_rank`
refuses bad tensors before any launch; the layers reach it through `quant.bnb.QuantLinear4bit`'s
`takes_low_rank` and `lora.adapter.LowRank`.

9 to 64 rows (by default, `MMA_ENABLED`; QUANTMESH_MMA=0 turns it off): the tensor-core kernel
(`matmul_4bit_mma`, `_triton4.qm_mma_4bit`). A program owns 64 or 128 features and all the rows,
and walks K two 64-blocks a step: it loads the features' codes (16 bytes a thread), turns each nibble
into its value by a warp shuffle, scales it by its block's absmax and rounds it to x's dtype (the
weight bitsandbytes' `dequantize_4bit` writes, made in registers only), and multiplies it with
x's rows on tensor cores (the features along the instruction's M, the rows along its N, so 16
rows fill one; Hopper's wgmma takes the weight from registers). Its sums are fp32, as a matmul's
on the dequantized weight. K is cut into shares so that a grid holds about `MMA_PROGRAMS`
programs, their partials added in a fixed order. Timed on a GPU against bitsandbytes, Triton's
dequantize + matmul and torchao's int4 (docs/benchmarks.md); its correctness is checked on CPU by
Triton's interpreter and on the GPU by the CUDA tests.

A few rows (opt-in, `ENABLED`): `matmul_4bit_rows`, a Triton kernel that streams the packed codes
and the block statistics once per call: each program owns `BLOCK_N` output features and walks K,
turning each byte into its two 4-bit values (high nibble first) through the 16 code values (fp32,
one cache line), scaling them by the block's absmax (8-bit with a nested fp32 absmax and an offset
under double quant, dequantized in the kernel) and multiplying them with all M rows at once
(`tl.dot`, or a plain reduction along K at 1 row). It is not yet faster than bitsandbytes' own
kernels (docs/benchmarks.md, "Figures the code relies on"). Blocks run over the flattened
(out, in) weight, as bitsandbytes quantizes it, so any even `in` works (a block may span two rows
when `in` is not a multiple of the blocksize); when it is, the kernel loads one absmax per block
instead of one per byte. The block kernel (`_triton4.blocks_4bit`: whole 64-blocks, one absmax
per block) is timed beside it by the benchmarks (`_launch` with `KERNEL="blocks"`), not used by
the library.

`QuantLinear4bit.forward` (quant/bnb.py) takes a kernel on CUDA when the compute dtype is bf16
or fp16 and the input's rows are in its range (`gemv_applies`, `mma_applies`,
`rows_kernel_applies`, `dequant_kernel_applies`): without autograd recording, but the dequantize,
which also runs under autograd (training); everything else (CPU, other inputs) keeps
bitsandbytes' path. Each is a torch custom op (`quantmesh::gemv_4bit`, `quantmesh::mma_4bit`,
`quantmesh::matmul_4bit_rows`, `quantmesh::dequant_matmul_4bit`, forward and backward), so
`torch.compile` (fullgraph, CUDA graphs) traces it without a graph break.

Many rows, and training: `dequantize_4bit` writes the weight out as bitsandbytes'
`dequantize_4bit` does (bf16 bit for bit, the nested statistics dequantized in the same kernel),
about twice as fast; with `DEQUANT_ENABLED` (opt-in, `QUANTMESH_TRITON_DEQUANT=1`), inputs of
`DEQUANT_MIN_ROWS` rows or more without autograd on CUDA, and every input under autograd, are
multiplied by it (`matmul_4bit_dequant`: the weight, then the `linear` bitsandbytes' path makes;
the backward dequantizes again and multiplies the gradient, keeping only the codes, as
bitsandbytes' `MatMul4Bit` does); so are weights dequantized whole outside a linear, the
experts' fused tensors (`dequantize_weight`, the op `quantmesh::dequantize_weight_4bit`).
"""

from __future__ import annotations

import importlib.util
import threading
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from ..config import env_switch

__all__ = [
    "DEQUANT_ENABLED",
    "DEQUANT_TRAINING",
    "DEQUANT_MIN_ROWS",
    "ENABLED",
    "GEMV_ENABLED",
    "GEMV_MAX_ROWS",
    "GEMV_WARPS",
    "JOIN_ENABLED",
    "MAX_ROWS",
    "MMA_ENABLED",
    "MMA_MAX_ROWS",
    "MMA_MIN_ROWS",
    "choose_config",
    "dequant_kernel_applies",
    "dequantize_4bit",
    "dequantize_weight",
    "dequantize_weight_applies",
    "GEMV_LORA_ENABLED",
    "gemv_lora_on",
    "LowRankTensors",
    "check_low_rank",
    "gemv_applies",
    "gemv_config",
    "joined_codes_on",
    "launch_gemv",
    "launch_mma",
    "matmul_4bit_dequant",
    "matmul_4bit_gemv",
    "matmul_4bit_mma",
    "matmul_4bit_rows",
    "mma_applies",
    "mma_config",
    "plain_tensor",
    "rows_kernel_applies",
]

MAX_ROWS = 64  # inputs with more rows keep bitsandbytes' path (dequantize + matmul)
# True: QuantLinear4bit takes the kernel where it applies. Off by default: slower than
# bitsandbytes' kernels (docs/benchmarks.md, "Figures the code relies on"; benchmarks turn it on
# to compare the two).
ENABLED = False
# With DEQUANT_ENABLED, from this many rows on, inputs without autograd on CUDA take
# `matmul_4bit_dequant`: Triton's dequantize (bf16 weights bit-equal to bitsandbytes', about
# twice as fast) + one matmul; but those the gemv takes (up to GEMV_MAX_ROWS, tried first).
# Below it, bitsandbytes' own kernels win (its 1-row kernel; 2 and 4 rows: docs/benchmarks.md,
# "Figures the code relies on"). With autograd (training) every row count takes it.
DEQUANT_MIN_ROWS = 8
# Opt-in (QUANTMESH_TRITON_DEQUANT=1 in the environment, or set this True): Triton's dequantize
# wherever bitsandbytes' path would dequantize the whole weight: inference from DEQUANT_MIN_ROWS
# rows, training, forward and backward (bitsandbytes dequantizes there too, past its own
# kernels' rows), and weights dequantized whole outside a linear (the experts' fused tensors:
# `dequantize_weight`). 1.5x faster on the GPU per inference call, but Triton's launcher costs more
# host time per call than bitsandbytes' op, and a step that is not replayed from a CUDA graph
# pays it on every linear; the server with it on is not yet measured (training is: see
# DEQUANT_TRAINING; docs/benchmarks.md, "Figures the code relies on"). Off: bitsandbytes' path at
# every row count.
DEQUANT_ENABLED = env_switch("QUANTMESH_TRITON_DEQUANT", default=False)
# The training half alone (QUANTMESH_TRITON_DEQUANT_TRAINING=1): Triton's dequantize under autograd
# only (forward and backward of training, the experts' weights dequantized whole in a training
# forward), inference keeping bitsandbytes' path. Its gain in a compiled training step was not
# steady across GPUs and calls (docs/benchmarks.md, "Figures the code relies on"): opt-in.
DEQUANT_TRAINING = env_switch("QUANTMESH_TRITON_DEQUANT_TRAINING", default=False)


def _dequant_on() -> bool:
    return DEQUANT_ENABLED or (DEQUANT_TRAINING and torch.is_grad_enabled())


_INT32_LIMIT = 2**31  # the kernel indexes the flat weight in int32
# The gemv (`matmul_4bit_gemv`, 1 to GEMV_MAX_ROWS rows): on by default, decoding faster than
# with bitsandbytes' kernels (docs/benchmarks.md, "Figures the code relies on"); QUANTMESH_GEMV=0
# turns it off (bitsandbytes' kernels, as before).
GEMV_ENABLED = env_switch("QUANTMESH_GEMV", default=True)
# Up to this many rows QuantLinear4bit takes the gemv (decoding 1-8 sequences, the server's
# small steps): faster than bitsandbytes' path and Triton's dequantize + matmul at 1 to 8 rows
# on the 7B shapes; at 16 it is slower than the latter (docs/benchmarks.md, "Figures the code
# relies on")
GEMV_MAX_ROWS = 8
GEMV_ROWS_LIMIT = 16  # the most rows `launch_gemv` takes (the lines kernel; registers grow with it)
# gemv_config's tiles: the lanes along K (`_triton4.qm_gemv_lines`), 2 features a warp, strides
# of 32 blocks: the fastest timed on the 7B shapes (docs/benchmarks.md, "Figures the code relies
# on")
GEMV_TILE: dict[str, Any] = dict(KERNEL="lines", BLOCK_N=2, SB=32, LUT=1, num_warps=1,
                                 num_stages=1)  # fmt: skip
# gemv_config's tile by rows, the power of two at or above them (1: GEMV_TILE itself): from 8
# rows on, 4 features a program (a row's inputs, turned to fp32 once a step, serve more
# features) and strides of 16 blocks (fewer registers); the fastest swept on the 7B shapes
# (docs/benchmarks.md, "Figures the code relies on"). 16 rows is past GEMV_MAX_ROWS: for
# benchmarks and direct calls.
GEMV_ROW_TILES: dict[int, dict[str, Any]] = {
    1: GEMV_TILE,
    2: dict(GEMV_TILE),
    4: dict(GEMV_TILE),
    8: dict(GEMV_TILE, BLOCK_N=4, SB=16),
    16: dict(GEMV_TILE, BLOCK_N=4, SB=16),
}
# The LoRA adapters' B products inside the gemv's launch (`quant.bnb.QuantLinear4bit`'s
# `low_rank`; the layer's adapter gives its A products, `lora.adapter.LowRank`): each output
# gets its delta as it is stored, so a decode step has no kernel of its own for B and no addition
# after the gemv. On by default where the gemv runs (`gemv_lora_on`): a decode step's GPU time
# 4.5% less, decoding 1.11x, the trained model's CUDA decode test passing with it on in every
# path (docs/benchmarks.md, "Figures the code relies on"); QUANTMESH_GEMV_LORA=0 turns it off.
GEMV_LORA_ENABLED = env_switch("QUANTMESH_GEMV_LORA", default=True)
GEMV_WARPS = 1536  # gemv_config cuts K so that a grid holds about this many warps
# The tensor-core kernel (`matmul_4bit_mma`, `_triton4.qm_mma_4bit`) for MMA_MIN_ROWS to
# MMA_MAX_ROWS rows (decoding 9 to 64 sequences, the server's larger steps): the codes read once,
# dequantized in registers into the weight dequantize_4bit writes, multiplied on tensor cores.
# On by default: on the 7B shapes it is faster than bitsandbytes' path at 16-64 rows, and than
# Triton's dequantize + matmul and torchao's int4 but at one shape, and decoding 32 sequences with
# it is faster (docs/benchmarks.md, "Figures the code relies on"). QUANTMESH_MMA=0 turns it off
# (those rows keep the other paths). It is tried after the gemv, which takes up to GEMV_MAX_ROWS.
MMA_ENABLED = env_switch("QUANTMESH_MMA", default=True)
MMA_MIN_ROWS = 9  # fewer rows would leave most of a 16-row instruction empty (the gemv's range)
# the most rows the library sends the kernel (mma_config: all in one program, BLOCK_M <= 64);
# `launch_mma` takes more, a program per BLOCK_M rows, which lost to dequantize + cuBLAS at a
# training batch's rows (docs/benchmarks.md, "The dequantization in a training GEMM's prologue")
MMA_MAX_ROWS = 64
# mma_config's tile by rows (the power of two at or above them, at least 16): BLOCK_N features
# and all rows a program, NB blocks of 64 codes a step (two MMAs of K = 32 NB), LUT 1 (code values
# shuffled from the lane that holds them), 4 warps (one warpgroup: the MMA's 64 features), 3
# stages of software pipelining: the fastest swept at 32 rows. At 16 and 64 rows 128 features a
# program and shares of 16 blocks were (docs/benchmarks.md, "Figures the code relies on")
MMA_TILE: dict[str, Any] = dict(BLOCK_N=64, NB=2, LUT=1, num_warps=4, num_stages=3)
MMA_ROW_TILES: dict[int, dict[str, Any]] = {
    16: dict(MMA_TILE, BLOCK_N=128, BLK=16),
    32: dict(MMA_TILE),
    64: dict(MMA_TILE, BLOCK_N=128, BLK=16),
}
MMA_PROGRAMS = 512  # mma_config cuts K so that a grid holds about this many programs
# Sibling 4-bit layers that read one tensor (q, k, v; gate, up) read as one weight by the gemv
# and the tensor-core kernel (`quant.bnb.join_sibling_codes`: their codes joined in place, no
# memory added; fast_decode's first prefill and the server's slot engine find the runs): one
# launch a run, and more programs in flight than each narrow weight gives. On by default where
# the kernels run (`joins_pay_on`: decoding 1.07x, the slot engine's CUDA test passes with it;
# docs/benchmarks.md, "Figures the code relies on"); QUANTMESH_JOIN_CODES=0 turns it off.
JOIN_ENABLED = env_switch("QUANTMESH_JOIN_CODES", default=True)


# Triton runs where it is installed (the GPU images); found without importing it, so that the
# check below costs nothing inside a compiled step
_HAS_TRITON = importlib.util.find_spec("triton") is not None
# the devices whose inputs the kernels take (Triton's interpreter runs them on CPU: the tests
# that check the layers' wiring there add "cpu")
KERNEL_DEVICES: tuple[str, ...] = ("cuda",)


def _triton() -> Any:
    """(triton, triton.language)."""
    import triton
    import triton.language as tl

    return triton, tl


def joined_codes_on() -> bool:
    """Whether sibling layers' joined codes (`quant.bnb.CodesRun`) are read as one weight:
    `JOIN_ENABLED`, read at call time (a compiled step is guarded on it).

    Example:
        >>> joined_codes_on() in (True, False)
        True
    """
    return JOIN_ENABLED


def joins_pay_on(device: torch.device) -> bool:
    """Whether `quant.bnb.join_sibling_codes` joins codes held on `device`: `JOIN_ENABLED`,
    Triton, and a device in `KERNEL_DEVICES`, where the gemv and the tensor-core kernel read the
    joined weight in one launch. Elsewhere (CPU) nothing would read it so, and the layers keep
    their own codes. A seam the CPU tests of the join replace.

    Example:
        >>> joins_pay_on(torch.device("cpu"))
        False
    """
    return JOIN_ENABLED and _kernels_run_on(device)


def gemv_lora_on(device: torch.device) -> bool:
    """Whether the adapters' B products go inside the gemv's launch for layers on `device`:
    `GEMV_LORA_ENABLED`, Triton, and a device in `KERNEL_DEVICES`. Elsewhere (CPU) no launch
    would read them, and nothing is made for it (`lora.adapter.LoraAdapter.low_rank`, the
    adapter stacks of `fast_decode`). Read at call time.

    Example:
        >>> gemv_lora_on(torch.device("cpu"))
        False
    """
    return GEMV_LORA_ENABLED and _kernels_run_on(device)


def _kernels_run_on(device: torch.device) -> bool:
    """Whether quantmesh's Triton kernels run on `device`: Triton, and a device in
    `KERNEL_DEVICES` (read at call time: the CPU tests add "cpu")."""
    return _HAS_TRITON and device.type in KERNEL_DEVICES


def rows_kernel_applies(x: torch.Tensor, qs: Any, compute_dtype: torch.dtype) -> bool:
    """Whether `matmul_4bit_rows` computes x @ W^T for the QuantState `qs`: on CUDA with Triton,
    no autograd recording, bf16/fp16 compute, at most `MAX_ROWS` rows, an even `in`, and
    statistics bitsandbytes' kernels read the same way (nested blocks of 256).

    Example:
        >>> rows_kernel_applies(torch.ones(1, 64), qs, torch.bfloat16)  # CPU: no  # doctest: +SKIP
        False
    """
    rows = _rows_kernels_take(x, qs, compute_dtype) if ENABLED else 0
    return 1 <= rows <= MAX_ROWS and int(qs.shape[1]) % 2 == 0


def _rows_kernels_take(x: torch.Tensor, qs: Any, compute_dtype: torch.dtype,
                       autograd: bool = False) -> int:  # fmt: skip
    """The rows of `x` when quantmesh's Triton kernels can compute x @ W^T for `qs` (CUDA with
    Triton, no autograd recording unless `autograd`, bf16/fp16 compute, nf4/fp4 codes indexed in
    int32, nested statistics in blocks of 256), else 0. The row kernel and the dequantize each
    add their own bounds."""
    if not _kernels_run_on(x.device) or (torch.is_grad_enabled() and not autograd):
        return 0
    if compute_dtype not in (torch.bfloat16, torch.float16) or qs.quant_type not in ("nf4", "fp4"):
        return 0
    out_f, in_f = int(qs.shape[0]), int(qs.shape[1])
    if x.shape[-1] != in_f or out_f * in_f >= _INT32_LIMIT:
        return 0
    if qs.nested and int(qs.state2.blocksize) != 256:
        return 0
    return x.numel() // max(in_f, 1)


def quant_state_tensors(qs: Any) -> tuple[Any, ...]:
    """Every tensor a QuantState `qs` holds beside the codes (absmax, code table, offset, and
    under double quant the nested absmax and code table; None where it has none), as attributes:
    not parameters or buffers, so walks of a model's tensors miss them.

    Example:
        >>> class S: absmax, code, offset, state2 = torch.ones(2), torch.ones(16), None, None
        >>> [t is None for t in quant_state_tensors(S)]
        [False, False, True, True, True]
    """
    s2 = getattr(qs, "state2", None)
    return (qs.absmax, qs.code, qs.offset, getattr(s2, "absmax", None), getattr(s2, "code", None))


def _statistics(qs: Any, device: torch.device) -> tuple[Any, ...]:
    """(absmax, nested absmax, nested code, offset) of the QuantState `qs` as the kernels take
    them: the last three None without double quant; the offset an fp32 tensor on `device`."""
    if not qs.nested:
        return qs.absmax, None, None, None
    s2 = qs.state2
    offset = qs.offset if isinstance(qs.offset, torch.Tensor) else torch.tensor(qs.offset)
    return qs.absmax, s2.absmax, s2.code, offset.to(device, torch.float32)


def matmul_4bit_rows(x: torch.Tensor, packed: torch.Tensor, qs: Any) -> torch.Tensor:
    """x (..., in) @ W^T -> (..., out) in x's dtype, W the 4-bit weight `packed` + QuantState
    `qs` (bitsandbytes' layout), through the Triton kernel; check `rows_kernel_applies` first.

    Example:
        >>> y = matmul_4bit_rows(x.bfloat16(), layer.weight.data, layer.weight.quant_state)  # doctest: +SKIP
    """
    return _on_codes(_rows_op, x, packed, qs)


def _on_codes(op: Any, x: torch.Tensor, packed: torch.Tensor, qs: Any,
              stats: tuple[Any, ...] | None = None, extra: tuple[Any, ...] = ()) -> torch.Tensor:  # fmt: skip
    """op(x as (rows, in), the flat codes, the statistics, blocksize, quant type, out, *extra)
    reshaped back to x's leading dimensions: how the matmul ops take a QuantState's weight.
    `stats`: the four statistics (`_statistics`' order) in place of `qs`'s tensors, which then
    gives only the shape, blocksize and quant type (a joined run's member:
    `quant.bnb.CodesRun`)."""
    out_f, in_f = int(qs.shape[0]), int(qs.shape[1])
    flat = packed.reshape(-1).view(torch.uint8)
    y = op(x.reshape(-1, in_f), flat, *(stats or _statistics(qs, x.device)), int(qs.blocksize),
           str(qs.quant_type), out_f, *extra)  # fmt: skip
    return y.reshape(*x.shape[:-1], out_f)


def _codes_op(name: str, launch: Any, config: Any, low_rank: bool = False) -> Any:
    """The custom op `quantmesh::<name>`(x (rows, in), the flat codes, the four statistics,
    blocksize, quant type, out) -> (rows, out): `launch` (`launch_gemv`'s arguments) at the tile
    `config(rows, out, in, blocksize)`; one op, so that `torch.compile` traces it whole. The
    matmul ops on codes (the gemv, the tensor-core kernel, the row kernel) are made by it.
    `low_rank`: the op takes five more, (t, e, col, scale, bias or None), the delta (and the
    bias) `launch` adds (`check_low_rank`).

    Returns a function that calls the op while compiling, under a dispatch mode or with tensor
    subclasses (fake tensors), and `launch` itself otherwise: in eager mode the op's dispatch
    cost the host about as much as the launch (docs/benchmarks.md, "Figures the code relies
    on"), and an eager prefill launches these once per layer and projection. The op itself is
    its attribute `op`."""

    def op(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor,
           nested_absmax: torch.Tensor | None, nested_code: torch.Tensor | None,
           offset: torch.Tensor | None, blocksize: int, quant_type: str,
           out_f: int) -> torch.Tensor:  # fmt: skip
        cfg = config(x.shape[0], out_f, x.shape[1], blocksize)
        return launch(x, packed, absmax, nested_absmax, nested_code, offset, blocksize,
                      quant_type, out_f, cfg)  # fmt: skip

    def fake(x, packed, absmax, nested_absmax, nested_code, offset, blocksize, quant_type,
             out_f):  # fmt: skip
        return x.new_empty((x.shape[0], out_f))  # for tracing

    def op_lr(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor,
              nested_absmax: torch.Tensor | None, nested_code: torch.Tensor | None,
              offset: torch.Tensor | None, blocksize: int, quant_type: str, out_f: int,
              t: torch.Tensor, e: torch.Tensor, col: torch.Tensor, sc: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
        cfg = config(x.shape[0], out_f, x.shape[1], blocksize)
        return launch(x, packed, absmax, nested_absmax, nested_code, offset, blocksize,
                      quant_type, out_f, cfg, low_rank=(t, e, col, sc, bias))  # fmt: skip

    def fake_lr(x, packed, absmax, nested_absmax, nested_code, offset, blocksize, quant_type,
                out_f, t, e, col, sc, bias):  # fmt: skip
        return x.new_empty((x.shape[0], out_f))

    if low_rank:
        op, fake = op_lr, fake_lr  # type: ignore[assignment]
    made = torch.library.custom_op(f"quantmesh::{name}", op, mutates_args=())
    made.register_fake(fake)

    def call(*args: Any) -> torch.Tensor:
        if torch.compiler.is_compiling() or not _plain_eager(args):
            out: torch.Tensor = made(*args)
            return out
        return op(*args)

    call.op = made  # type: ignore[attr-defined]
    return call


def _plain_eager(args: tuple[Any, ...]) -> bool:
    """Whether a call with `args` runs eagerly on plain tensors: no dispatch mode (fake tensors,
    a tracer, a counter) active and no tensor of a subclass, so that calling a custom op's
    function directly skips only its dispatch."""
    if _get_current_dispatch_mode() is not None:
        return False
    return all(plain_tensor(a) for a in args if isinstance(a, torch.Tensor))


def plain_tensor(t: Any) -> bool:
    """Whether `t` is a plain tensor or parameter (an adapter's B rows, a layer's bias): no
    subclass (a DTensor, a fake tensor), so the kernels may read its memory as it is.

    Example:
        >>> plain_tensor(torch.nn.Parameter(torch.zeros(2))), plain_tensor(None)
        (True, False)
    """
    return type(t) in (torch.Tensor, torch.nn.Parameter)


def dequant_kernel_applies(x: torch.Tensor, qs: Any, compute_dtype: torch.dtype) -> bool:
    """Whether `matmul_4bit_dequant` computes x @ W^T for the QuantState `qs`: once turned on
    (`DEQUANT_ENABLED`, or `DEQUANT_TRAINING` under autograd), on CUDA with Triton, bf16/fp16
    compute, statistics of the kinds the kernel reads (nested blocks of 256), and either autograd
    recording (training: any rows) or at least `DEQUANT_MIN_ROWS` rows.

    Example:
        >>> dequant_kernel_applies(torch.ones(64, 4096), qs, torch.bfloat16)  # CPU  # doctest: +SKIP
        False
    """
    if not _dequant_on():
        return False
    rows = _rows_kernels_take(x, qs, compute_dtype, autograd=True)
    return rows >= (1 if torch.is_grad_enabled() else DEQUANT_MIN_ROWS)


def matmul_4bit_dequant(x: torch.Tensor, packed: torch.Tensor, qs: Any) -> torch.Tensor:
    """x (..., in) @ W^T -> (..., out) in x's dtype: W written out by Triton's dequantize (the
    same values as bitsandbytes' dequantize_4bit), then the matmul bitsandbytes' path makes
    (`linear`); differentiable in x: the backward dequantizes W again and computes g @ W, as
    bitsandbytes' does, so that only the codes are kept for it (never the float weight). One
    custom op for both, so `torch.compile` traces them without a graph break; check
    `dequant_kernel_applies` first.

    Example:
        >>> y = matmul_4bit_dequant(x.bfloat16(), layer.weight.data, layer.weight.quant_state)  # doctest: +SKIP
    """
    return _on_codes(_dequant_mm_op, x, packed, qs)


# x @ W^T with W dequantized by Triton, and in backward g @ W, by one opaque op: like
# bitsandbytes' MatMul4Bit only the codes and statistics are kept for backward (an op rather than
# an autograd.Function: see quant/bnb.py's flat_matmul_4bit)
@torch.library.custom_op("quantmesh::dequant_matmul_4bit", mutates_args=())
def _dequant_mm_op(t: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor,
                   nested_absmax: torch.Tensor | None, nested_code: torch.Tensor | None,
                   offset: torch.Tensor | None, blocksize: int, quant_type: str, n: int,
                   grad: bool = False) -> torch.Tensor:  # fmt: skip
    # forward (grad False): t = x (rows, in), W (n = out, in), x @ W^T with bitsandbytes' linear;
    # backward: t = g (rows, out), W (out, n = in), g @ W as bitsandbytes' backward computes it
    shape = (t.shape[1], n) if grad else (n, t.shape[1])
    w = dequantize_4bit(packed, absmax, nested_absmax, nested_code, offset, blocksize, quant_type,
                        shape, t.dtype)  # fmt: skip
    return torch.matmul(t, w) if grad else torch.nn.functional.linear(t, w)


@_dequant_mm_op.register_fake
def _(t, packed, absmax, nested_absmax, nested_code, offset, blocksize, quant_type, n, grad=False):
    return t.new_empty((t.shape[0], n))


def _dequant_mm_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    x, packed, absmax, nested_absmax, nested_code, offset, blocksize, quant_type = inputs[:8]
    ctx.save_for_backward(packed, absmax, nested_absmax, nested_code, offset)  # codes only
    ctx.meta = (blocksize, quant_type, x.shape[1])


def _dequant_mm_backward(ctx: Any, g: torch.Tensor) -> tuple:
    gx = None
    if ctx.needs_input_grad[0]:
        gx = _dequant_mm_op(g.contiguous(), *ctx.saved_tensors, *ctx.meta, grad=True)
    return (gx,) + (None,) * 9


# ---- the gemv: 1 to 8 rows ---------------------------------------------------------------------
def gemv_applies(x: torch.Tensor, qs: Any, compute_dtype: torch.dtype) -> bool:
    """Whether `matmul_4bit_gemv` computes x @ W^T for the QuantState `qs`: `GEMV_ENABLED`, CUDA
    with Triton, no autograd recording, bf16/fp16 compute, 1 to `GEMV_MAX_ROWS` rows, blocksize 64
    (bitsandbytes' default) and `in` a multiple of it, nested statistics in blocks of 256.

    Example:
        >>> gemv_applies(torch.ones(1, 64), qs, torch.bfloat16)  # CPU: no  # doctest: +SKIP
        False
    """
    rows = _rows_kernels_take(x, qs, compute_dtype) if GEMV_ENABLED else 0
    return 1 <= rows <= GEMV_MAX_ROWS and _whole_64_blocks(qs)


def matmul_4bit_gemv(
    x: torch.Tensor,
    packed: torch.Tensor,
    qs: Any,
    stats: tuple[Any, ...] | None = None,
    low_rank: LowRankTensors | None = None,
) -> torch.Tensor:
    """x (..., in) @ W^T -> (..., out) in x's dtype for 1 to `GEMV_MAX_ROWS` rows, by the gemv
    (`launch_gemv` at `gemv_config`'s tile: `_triton4.qm_gemv_lines`, the lanes along K); check
    `gemv_applies` first. `low_rank`: (t (..., R), e, col, scale, bias or None), a LoRA delta
    (after the layer's bias, if any) added to each output in the same launch (`check_low_rank`;
    the op `quantmesh::gemv_4bit_lora`).

    Example:
        >>> y = matmul_4bit_gemv(x.bfloat16(), layer.weight.data, layer.weight.quant_state)  # doctest: +SKIP
    """
    if low_rank is None:
        return _on_codes(_gemv_op, x, packed, qs, stats)
    t, e, col, sc, bias = low_rank
    return _on_codes(_gemv_lora_op, x, packed, qs, stats,
                     (t.reshape(-1, t.shape[-1]), e, col, sc, bias))  # fmt: skip


LowRankTensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]
"""(t, e, col, scale, bias or None): a low-rank delta (and the layer's bias, added before it)
the gemv adds in its own launch (`check_low_rank`)."""


def check_low_rank(low_rank: LowRankTensors, rows: int, out_f: int, device: torch.device,
                   dtype: torch.dtype | None = None) -> None:  # fmt: skip
    """Refuse, before any launch, a low-rank delta the gemv cannot add to (rows, out_f) outputs:
    t (rows, R) fp32, the adapters' A products; e (out_f, r) fp32, each feature's B row (r at
    most 64); col (out_f,) int32, where each feature's r products begin in t; scale (out_f,)
    fp32; all contiguous on `device`. Output feature n gets `scale[n] * (e[n] @ t[:, col[n]:
    col[n] + r])`, rounded to the output's dtype and added to its rounded product (the values of
    `y + (B(A x) * scale).to(y.dtype)`). bias: None, or (out_f,) in the output's `dtype`, added
    to the rounded product and rounded before the delta (the values of `(y + bias)` first).

    Example:
        >>> z = torch.zeros
        >>> check_low_rank((z(1, 8), z(4, 8), z(4, dtype=torch.int32), z(4), None), 1, 4, torch.device("cpu"))
        >>> check_low_rank((z(1, 8), z(4, 8), z(4), z(4), None), 1, 4, torch.device("cpu"))
        Traceback (most recent call last):
        ...
        ValueError: the gemv's low-rank col must be a contiguous torch.int32 tensor of shape (4,) on cpu, not torch.float32 (4,) on cpu
    """
    t, e, col, sc, bias = low_rank
    r = int(e.shape[1]) if e.dim() == 2 else 0
    want = {"t": ((rows, int(t.shape[-1])), torch.float32), "e": ((out_f, r), torch.float32),
            "col": ((out_f,), torch.int32), "scale": ((out_f,), torch.float32)}  # fmt: skip
    given: list[torch.Tensor] = [t, e, col, sc]
    if bias is not None:
        want["bias"] = ((out_f,), bias.dtype if dtype is None else dtype)
        given.append(bias)
    for (name, (shape, want_dtype)), v in zip(want.items(), given, strict=True):
        if (
            tuple(v.shape) != shape
            or v.dtype != want_dtype
            or v.device != device
            or not v.is_contiguous()
        ):
            raise ValueError(
                f"the gemv's low-rank {name} must be a contiguous {want_dtype} tensor of shape "
                f"{shape} on {device}, not {v.dtype} {tuple(v.shape)} on {v.device}"
            )
    if not 1 <= r <= 64 or r > t.shape[-1]:
        raise ValueError(f"the gemv adds deltas of rank 1 to 64 within t's {t.shape[-1]}, not {r}")


def gemv_config(rows: int, out_f: int, in_f: int, blocksize: int,
                tile: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """The gemv's tiles for `rows` rows of an (out_f, in_f) weight: `tile` (default
    `GEMV_ROW_TILES`' for the power of two at or above `rows`; `GEMV_TILE` at one row;
    KERNEL, "lines" for `_triton4.qm_gemv_lines`, else `qm_gemv_4bit`; BLOCK_N features a
    program; SB blocks a stride; LUT, how a code's value is found; num_warps, num_stages), with K
    cut into shares of BLK blocks (the lines kernel: a multiple of its strides of SB blocks) so
    that the grid holds about `GEMV_WARPS` warps, unless the tile sets BLK. The one-thread-a-feature kernel was fastest at
    1,400 to 2,000 warps; the lines tile takes one share on every 7B shape (2,048 to 5,504
    warps), faster than with more (docs/benchmarks.md, "Figures the code relies on").

    Example:
        >>> old = dict(BLOCK_N=32, LUT=1, num_warps=1, num_stages=1)
        >>> gemv_config(1, 4096, 4096, 64, old)["BLK"], gemv_config(1, 11008, 4096, 64, old)["BLK"]
        (6, 16)
    """
    if tile is None:
        if not 1 <= rows <= GEMV_ROWS_LIMIT:
            raise ValueError(f"the gemv takes 1 to {GEMV_ROWS_LIMIT} rows, not {rows}")
        tile = GEMV_ROW_TILES[_pow2(rows)]
    cfg = dict(tile)
    if not cfg.get("BLK"):
        stride = cfg.get("SB", 32) if cfg.get("KERNEL") == "lines" else 1  # its strides
        units = -(-max(1, in_f // blocksize) // stride)
        groups = -(-out_f // cfg["BLOCK_N"])
        warps = groups * cfg.get("num_warps", 1)
        shares = min(units, max(1, round(GEMV_WARPS / warps)))
        cfg["BLK"] = stride * -(-units // shares)
    return cfg


def _pow2(n: int) -> int:
    """The power of two at or above n (n >= 1)."""
    return 1 << (n - 1).bit_length()


_dequant_mm_op.register_autograd(_dequant_mm_backward, setup_context=_dequant_mm_setup)


def launch_gemv(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor,
                nested_absmax: torch.Tensor | None, nested_code: torch.Tensor | None,
                offset: torch.Tensor | None, blocksize: int, quant_type: str, out_f: int,
                cfg: dict[str, Any], keep: list | None = None,
                low_rank: LowRankTensors | None = None) -> torch.Tensor:  # fmt: skip
    """x (rows, in) @ W^T -> (rows, out) in x's dtype with tiles `cfg` (`gemv_config`'s keys; the
    benchmark passes each candidate). KERNEL "lines": `_triton4.qm_gemv_lines` (the lanes along
    K, 1 to `GEMV_ROWS_LIMIT` rows, each code's value found once for all of them; BLOCK_N
    features a program, SB blocks a stride: 4, 8, 16 or 32; WK warps splitting K, num_warps =
    WK: one is the fastest measured); else `_triton4.qm_gemv_4bit` (one row, one feature a
    thread). BLK: blocks a share of K (0: one share); LUT: 1 takes each code's value (and, lines, each absmax) from the warp's lane that
    holds it by a shuffle (`qm_gemv_4bit`: one feature a thread, BLOCK_N = 32 x num_warps), 0
    loads them (Triton's interpreter runs only this); num_warps, num_stages. The blocksize must
    be 64 and `in` a multiple of it; anything else is refused before any launch. With more than
    one share, the programs of a group count themselves in a per-device int32 buffer kept zero
    between calls (`_counters`), so two such calls must not run at once on different streams.
    `keep`: a list the compiled kernel is appended to (the benchmark reads its PTX).
    `maxnreg` (optional): the most registers a thread (Triton's launch option on CUDA: fewer
    registers, more warps an SM; the benchmark's tiles).
    `low_rank`: (t, e, col, scale, bias or None), a low-rank delta the lines kernel adds to each
    output as it stores it, after the bias (`check_low_rank`: the LoRA adapters' B products
    inside the gemv's launch).

    Example:
        >>> y = launch_gemv(x, flat, *stats, 64, "nf4", 4096, gemv_config(1, 4096, 4096, 64))  # doctest: +SKIP
    """
    rows, in_f = x.shape
    lines = cfg.get("KERNEL") == "lines"
    if low_rank is not None:
        if not lines:
            raise ValueError(f"a low-rank delta is added by the lines kernel only, not {cfg}")
        check_low_rank(low_rank, rows, out_f, x.device, x.dtype)
    most = GEMV_ROWS_LIMIT if lines else 1
    if not 1 <= rows <= most or blocksize != 64 or in_f % 64:
        takes = f"1 to {most} rows" if lines else "one row (the lines kernel: more)"
        raise ValueError(
            f"the gemv takes {takes}, blocksize 64 and `in` a multiple of 64, not {rows} rows, "
            f"blocksize {blocksize}, in={in_f}: use matmul_4bit_rows or bitsandbytes' matmul_4bit"
        )
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"the gemv computes in bf16 or fp16, not {x.dtype}")
    if lines and cfg.get("SB", 32) not in (4, 8, 16, 32):
        raise ValueError(f"the gemv's strides (SB) are 4, 8, 16 or 32 blocks, not {cfg}")
    wk = cfg.get("WK", 1)
    if lines and (cfg.get("SB", 32) % (4 * wk) or cfg.get("num_warps", 1) != wk):
        raise ValueError(
            f"the gemv's warps splitting K (WK) must be its num_warps and divide a stride into "
            f"steps of 4 blocks a warp (SB a multiple of 4 x WK), not {cfg}"
        )
    if not lines and cfg.get("LUT", 0) == 1 and cfg["BLOCK_N"] != 32 * cfg.get("num_warps", 4):
        raise ValueError(
            f"the gemv's LUT 1 takes one feature a thread (BLOCK_N = 32 x num_warps), not {cfg}"
        )
    from .bnb import _bnb

    _bnb()  # registers torch.ops.bitsandbytes (the code values)
    triton, _ = _triton()
    from ._triton4 import qm_gemv_4bit, qm_gemv_lines

    kernel = qm_gemv_lines if lines else qm_gemv_4bit

    x = _as_words(x)
    if packed.storage_offset() % 4:
        packed = packed.clone()  # and the codes as int32 words of 8 codes
    nblk = in_f // blocksize
    per = cfg.get("BLK") or nblk
    slices = triton.cdiv(nblk, per)
    grid = (triton.cdiv(out_f, cfg["BLOCK_N"]), slices)
    y, part, cnt = _outputs(x, rows, out_f, grid)
    # lines: the rows (M, and ROWS, its power of two), and `zero`, which hides the words'
    # alignment from the compiler (see there)
    m = (rows,) if lines else ()
    zero = (0,) if lines else ()
    extra = {}
    lr: tuple[Any, ...] = ()
    if lines:
        extra = dict(SB=cfg.get("SB", 32), WK=wk, ROWS=triton.next_power_of_2(rows))
        lr = (y, y, y, y, y, 0, 0)  # (never read without LORA)
        if low_rank is not None:
            t, e, col, sc, bias = low_rank
            lr = (t, e, col, sc, y if bias is None else bias, t.shape[1], e.shape[1])
            extra.update(LORA=True, RL=triton.next_power_of_2(e.shape[1]), BIAS=bias is not None)
    compiled = kernel[grid](
        x.view(torch.int32), packed.view(torch.int32),
        *_kernel_statistics(absmax, nested_absmax, nested_code, offset),
        _code_values(quant_type, x.device), y, part, cnt,
        *m, out_f, nblk, in_f // 8, per, slices, *zero, *lr,
        BS2=256, NESTED=nested_absmax is not None, BLOCK_N=cfg["BLOCK_N"], NS=triton.next_power_of_2(slices),
        LUT=cfg.get("LUT", 0), BF16=x.dtype == torch.bfloat16, **extra, **_offsets(offset),
        num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 1),
        **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}),
    )  # fmt: skip
    if keep is not None:
        keep.append(compiled)
    return y


# ---- tensor cores: 9 to 64 rows -----------------------------------------------------------------
def mma_applies(x: torch.Tensor, qs: Any, compute_dtype: torch.dtype) -> bool:
    """Whether `matmul_4bit_mma` computes x @ W^T for the QuantState `qs`: `MMA_ENABLED`, CUDA with
    Triton, no autograd recording, bf16/fp16 compute, `MMA_MIN_ROWS` to `MMA_MAX_ROWS` rows,
    blocksize 64 and `in` a multiple of it, nested statistics in blocks of 256.

    Example:
        >>> mma_applies(torch.ones(16, 64), qs, torch.bfloat16)  # CPU: no  # doctest: +SKIP
        False
    """
    rows = _rows_kernels_take(x, qs, compute_dtype) if MMA_ENABLED else 0
    return MMA_MIN_ROWS <= rows <= MMA_MAX_ROWS and _whole_64_blocks(qs)


def matmul_4bit_mma(
    x: torch.Tensor, packed: torch.Tensor, qs: Any, stats: tuple[Any, ...] | None = None
) -> torch.Tensor:
    """x (..., in) @ W^T -> (..., out) in x's dtype for up to `MMA_MAX_ROWS` rows on tensor cores
    (`launch_mma` at `mma_config`'s tile: `_triton4.qm_mma_4bit`), the codes read once and the
    weight, as dequantize_4bit writes it, made in registers only; check `mma_applies` first.

    Example:
        >>> y = matmul_4bit_mma(x.bfloat16(), layer.weight.data, layer.weight.quant_state)  # doctest: +SKIP
    """
    return _on_codes(_mma_op, x, packed, qs, stats)


def mma_config(rows: int, out_f: int, in_f: int, tile: dict[str, Any] | None = None,
               programs: int = MMA_PROGRAMS) -> dict[str, Any]:  # fmt: skip
    """The tensor-core kernel's tiles for `rows` rows of an (out_f, in_f) weight (blocksize 64):
    `tile` (default `MMA_ROW_TILES`' for the power of two at or above `rows`, at least 16: BLOCK_N
    features a program, NB blocks a step, LUT, num_warps, num_stages), BLOCK_M (that power of
    two) and K cut into shares of BLK blocks (a multiple of NB) so that the grid holds about
    `programs` programs, unless the tile sets BLK (0: one share).

    Example:
        >>> cfg = mma_config(32, 4096, 4096)
        >>> cfg["BLOCK_M"], cfg["BLK"], 64 // cfg["BLK"] * 4096 // cfg["BLOCK_N"]
        (32, 8, 512)
    """
    if not 1 <= rows <= MMA_MAX_ROWS:
        raise ValueError(f"the tensor-core kernel takes 1 to {MMA_MAX_ROWS} rows, not {rows}")
    bm = max(16, _pow2(rows))
    cfg = dict(MMA_ROW_TILES[bm] if tile is None else tile, BLOCK_M=bm)
    if cfg.get("BLK") is None:
        steps = -(-max(1, in_f // 64) // cfg["NB"])
        groups = -(-out_f // cfg["BLOCK_N"])
        shares = min(steps, max(1, round(programs / groups)))
        cfg["BLK"] = cfg["NB"] * -(-steps // shares)
    return cfg


def launch_mma(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor,
               nested_absmax: torch.Tensor | None, nested_code: torch.Tensor | None,
               offset: torch.Tensor | None, blocksize: int, quant_type: str, out_f: int,
               cfg: dict[str, Any], keep: list | None = None) -> torch.Tensor:  # fmt: skip
    """x (rows, in) @ W^T -> (rows, out) in x's dtype on tensor cores, with tiles `cfg`
    (`mma_config`'s keys; the benchmark passes each candidate): `_triton4.qm_mma_4bit`, BLOCK_N
    features and BLOCK_M rows a program (powers of two; BLOCK_N and BLOCK_M at least 16, the
    instruction's least), NB blocks of 64 codes a step, K in shares of BLK blocks (a multiple of
    NB; 0: one share; the shares' fp32 partials are added as the gemv's are: see `launch_gemv`),
    LUT 1 shuffles each code's value from the lane that holds it (0 loads it: Triton's
    interpreter runs only this). More rows than BLOCK_M take a program per BLOCK_M rows and K in
    one share: a GEMM whose prologue dequantizes the codes (the library routes only up to
    `MMA_MAX_ROWS` rows here; `benchmarks/nf4_prologue_bench.py` times it at a training batch's
    rows). Anything else is refused before any launch. `keep`: a list the compiled kernel is
    appended to (the benchmark reads its PTX).

    Example:
        >>> y = launch_mma(x, flat, *stats, 64, "nf4", 4096, mma_config(32, 4096, 4096))  # doctest: +SKIP
    """
    rows, in_f = x.shape
    bm, bn, nb = cfg.get("BLOCK_M", 0), cfg.get("BLOCK_N", 0), cfg.get("NB", 0)
    pow2 = all(v >= 1 and v & (v - 1) == 0 for v in (bm, bn, nb))
    nblk = in_f // blocksize
    per = cfg.get("BLK") or nblk
    if rows < 1 or blocksize != 64 or in_f % 64:
        raise ValueError(
            f"the tensor-core kernel takes at least 1 row, blocksize 64 and `in` a multiple of 64, "
            f"not {rows} rows, blocksize {blocksize}, in={in_f}: use matmul_4bit_rows or "
            f"bitsandbytes' matmul_4bit"
        )
    if rows > bm and per < nblk:
        raise ValueError(
            f"{rows} rows are more than the tile's BLOCK_M {bm}: a program per BLOCK_M rows, "
            f"which takes K in one share (BLK 0), not shares of {per} blocks of {nblk}"
        )
    if not pow2 or bm < 16 or bn < 16 or (cfg.get("BLK") or 0) % nb:
        raise ValueError(
            f"the tensor-core kernel's BLOCK_M, BLOCK_N and NB are powers of two (BLOCK_M and "
            f"BLOCK_N at least 16) and BLK a multiple of NB, not {cfg}"
        )
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"the tensor-core kernel computes in bf16 or fp16, not {x.dtype}")
    from .bnb import _bnb

    _bnb()  # registers torch.ops.bitsandbytes (the code values)
    triton, _ = _triton()
    from ._triton4 import qm_mma_4bit

    x = _as_words(x)
    grid = (triton.cdiv(out_f, bn), triton.cdiv(nblk, per), triton.cdiv(rows, bm))
    y, part, cnt = _outputs(x, rows, out_f, grid[:2])
    stats = _kernel_statistics(absmax, nested_absmax, nested_code, offset)
    compiled = qm_mma_4bit[grid](
        x.view(torch.int32), packed, *stats, _code_values(quant_type, x.device), y, part, cnt,
        rows, out_f, nblk, in_f // 2, per, grid[1], 0,
        BS2=256, NESTED=nested_absmax is not None, BLOCK_N=bn, BLOCK_M=bm, NB=nb,
        NS=triton.next_power_of_2(grid[1]), LUT=cfg.get("LUT", 0),
        BF16=x.dtype == torch.bfloat16, num_warps=cfg.get("num_warps", 4),
        num_stages=cfg.get("num_stages", 3), **_offsets(offset),
    )  # fmt: skip
    if keep is not None:
        keep.append(compiled)
    return y


def _whole_64_blocks(qs: Any) -> bool:
    """Whether the QuantState `qs` has blocks of 64 that rows of `in` fill whole: what the gemv
    and the tensor-core kernel read (each row of codes a run of whole blocks)."""
    return int(qs.blocksize) == 64 and int(qs.shape[1]) % 64 == 0


def _as_words(x: torch.Tensor) -> torch.Tensor:
    """x contiguous, starting on a 4-byte boundary: the gemv and the tensor-core kernel read it as
    int32 words of two bf16/fp16 inputs."""
    x = x.contiguous()
    return x.clone() if x.storage_offset() % 2 else x


def _outputs(x: torch.Tensor, rows: int, out_f: int,
             grid: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(y, the fp32 partials of each share of K, the groups' counts) for a kernel of `grid`
    (groups of features, shares of K) that adds its shares as `_triton4._finish` does; with one
    share the last two are y itself (never read)."""
    y = torch.empty((rows, out_f), dtype=x.dtype, device=x.device)
    if grid[1] == 1:
        return y, y, y
    part = torch.empty((grid[1], rows, out_f), dtype=torch.float32, device=x.device)
    return y, part, _counters(grid[0], x.device)


def _offsets(offset: torch.Tensor | None) -> dict[str, bool]:
    """The gemv's and the tensor-core kernel's OFFS: an offset per nested block (sibling weights
    joined, `quant.bnb.CodesRun`) rather than one value; the default keeps their compiled form."""
    return {"OFFS": True} if offset is not None and offset.numel() > 1 else {}


def _kernel_statistics(absmax: torch.Tensor, nested_absmax: torch.Tensor | None,
                       nested_code: torch.Tensor | None,
                       offset: torch.Tensor | None) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """The four statistics pointers the kernels take: absmax itself in place of those a weight
    without double quant lacks (never read)."""
    if nested_absmax is None:
        return absmax, absmax, absmax, absmax
    assert nested_code is not None and offset is not None
    return absmax, nested_absmax, nested_code, offset


_gemv_op = _codes_op("gemv_4bit", launch_gemv, gemv_config)
_gemv_lora_op = _codes_op("gemv_4bit_lora", launch_gemv, gemv_config, low_rank=True)
_mma_op = _codes_op(
    "mma_4bit", launch_mma, lambda rows, out_f, in_f, bs: mma_config(rows, out_f, in_f)
)


def _counters(n: int, device: torch.device) -> torch.Tensor:
    """`n` int32 zeros on `device`: the gemv's per-group counts, which the last program of each
    group sets back to 0. Kept per (device, n) and never freed (`_kept`)."""
    return _kept(_COUNTERS, (str(device), n), device,
                 lambda: torch.zeros(n, dtype=torch.int32, device=device))  # fmt: skip


def _kept(cache: dict, key: Any, device: torch.device, make: Any) -> torch.Tensor:
    """cache[key], made by `make()` on first use and kept for good (a captured CUDA graph keeps
    its address). On CUDA it is made by a helper thread, on that thread's stream, and waited
    for: a compiled step's first (warm-up) run allocates everything its thread asks for from the
    CUDA graphs' private pool, which must hold nothing the step does not return ("tensors in the
    cudagraph pool not tracked as outputs"), and a side stream of the same thread did not escape
    it (docs/benchmarks.md, "A one-row gemv of our own"). One asked for during a capture is made
    inside the graph (zeroed or filled by the graph itself on every replay) and not kept."""
    if key in cache:
        return cache[key]
    if device.type != "cuda":
        cache[key] = made = make()
        return made
    if torch.cuda.is_current_stream_capturing():
        return make()
    box: list = []

    def run() -> None:
        try:
            with torch.cuda.device(device):
                box.append(make())
                torch.cuda.current_stream(device).synchronize()  # ready for any stream
        except BaseException as e:  # raised again in the caller's thread
            box.append(e)

    helper = threading.Thread(target=run, name="quantmesh-kept-buffer")
    helper.start()
    helper.join()
    if isinstance(box[0], BaseException):
        raise box[0]
    cache[key] = box[0]
    return box[0]


_COUNTERS: dict[tuple[str, int], torch.Tensor] = {}  # (device, groups) -> the gemv's counts, zeros


# ---- tiles ------------------------------------------------------------------------------------
def choose_config(rows: int) -> dict[str, int]:
    """The kernel's tiles at `rows` rows: BLOCK_N output features per program, BLOCK_K inputs
    per step, SPLIT_K programs along K (their fp32 partial sums added after), DOT 1: `tl.dot`,
    0: a reduction along K; the fastest of those timed for the 7B shapes (docs/benchmarks.md,
    "Figures the code relies on").

    Example:
        >>> choose_config(1)["DOT"]
        0
    """
    if rows == 1:
        return dict(BLOCK_N=16, BLOCK_K=1024, DOT=0, SPLIT_K=1, num_warps=4, num_stages=2)
    return dict(BLOCK_N=64, BLOCK_K=128, DOT=1, SPLIT_K=2, num_warps=4, num_stages=3)


def _launch(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor,
            nested_absmax: torch.Tensor | None, nested_code: torch.Tensor | None,
            offset: torch.Tensor | None, blocksize: int, quant_type: str, out_f: int,
            cfg: dict[str, Any]) -> torch.Tensor:  # fmt: skip
    """Run the kernel with tiles `cfg` (the benchmark calls it with each candidate): the block
    kernel (`cfg["KERNEL"] == "blocks"`) where `in` is a multiple of the blocksize, else the row
    kernel."""
    if cfg.get("KERNEL") == "blocks" and x.shape[1] % blocksize == 0:
        return _launch_blocks(x, packed, absmax, nested_absmax, nested_code, offset, blocksize,
                              quant_type, out_f, cfg)  # fmt: skip
    from .bnb import _bnb

    _bnb()  # registers torch.ops.bitsandbytes
    triton, _ = _triton()
    from ._triton4 import rows_4bit as kernel

    x = x.contiguous()
    rows, in_f = x.shape
    nested = nested_absmax is not None
    bm = triton.next_power_of_2(rows) if not cfg["DOT"] else max(16, triton.next_power_of_2(rows))
    split = cfg["SPLIT_K"]
    aligned = (
        in_f % blocksize == 0 and cfg["BLOCK_K"] % blocksize == 0 and cfg.get("ALIGNED", 1) == 1
    )
    y = torch.empty(
        (split, rows, out_f), dtype=torch.float32 if split > 1 else x.dtype, device=x.device
    )
    dummy = absmax  # pointers the kernel never reads (no nested statistics)
    grid = (triton.cdiv(out_f, cfg["BLOCK_N"]), split)
    k_per = triton.cdiv(triton.cdiv(in_f, split), cfg["BLOCK_K"]) * cfg["BLOCK_K"]  # per program
    kernel[grid](
        x, packed, absmax,
        nested_absmax if nested else dummy, nested_code if nested else dummy,
        offset if nested else dummy, _code_values(quant_type, x.device), y,
        rows, out_f, in_f, x.stride(0), k_per,
        BS=blocksize, BS2=256, NESTED=nested, ALIGNED=aligned, BLOCK_M=bm,
        BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], DOT=cfg["DOT"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return y[0] if split == 1 else y.sum(0).to(x.dtype)


_rows_op = _codes_op("matmul_4bit_rows", _launch, lambda rows, *_: choose_config(rows))


def _launch_blocks(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor,
                   nested_absmax: torch.Tensor | None, nested_code: torch.Tensor | None,
                   offset: torch.Tensor | None, blocksize: int, quant_type: str, out_f: int,
                   cfg: dict[str, Any]) -> torch.Tensor:  # fmt: skip
    """The block kernel (`_triton4.blocks_4bit`): `in` a multiple of `blocksize`. cfg: BLOCK_N
    features and NB blocks a step per program, SPLIT_K shares of K (fp32 partial sums added
    after), DOT (tl.dot over the rows; else one row), ROUND (one row: round each weight as
    dequantize_4bit does), num_warps, num_stages (software pipelining of the loop)."""
    from .bnb import _bnb

    _bnb()  # registers torch.ops.bitsandbytes
    triton, _ = _triton()
    from ._triton4 import blocks_4bit as kernel

    x = x.contiguous()
    rows, in_f = x.shape
    if not cfg["DOT"] and rows != 1:
        raise ValueError(f"the block kernel's reduction path takes one row, not {rows}")
    nested = nested_absmax is not None
    nblk = in_f // blocksize
    per_step = cfg["NB"]
    split = max(1, min(cfg["SPLIT_K"], triton.cdiv(nblk, per_step)))
    steps = triton.cdiv(triton.cdiv(nblk, per_step), split)  # steps of NB blocks per program
    bm = max(16, triton.next_power_of_2(rows)) if cfg["DOT"] else 1
    y = torch.empty(
        (split, rows, out_f), dtype=torch.float32 if split > 1 else x.dtype, device=x.device
    )
    dummy = absmax
    grid = (triton.cdiv(out_f, cfg["BLOCK_N"]), split)
    kernel[grid](
        x, packed, absmax,
        nested_absmax if nested else dummy, nested_code if nested else dummy,
        offset if nested else dummy, _code_values(quant_type, x.device), y,
        rows, out_f, nblk, in_f // 2, x.stride(0), steps,
        BS=blocksize, NESTED=nested, BS2=256, BLOCK_M=bm, BLOCK_N=cfg["BLOCK_N"], NB=per_step,
        DOT=cfg["DOT"], ROUND=cfg.get("ROUND", 1), num_stages=cfg.get("num_stages", 2),
        num_warps=cfg["num_warps"],
    )  # fmt: skip
    return y[0] if split == 1 else y.sum(0).to(x.dtype)


def dequantize_4bit(packed: torch.Tensor, absmax: torch.Tensor,
                    nested_absmax: torch.Tensor | None, nested_code: torch.Tensor | None,
                    offset: torch.Tensor | None, blocksize: int, quant_type: str,
                    shape: tuple[int, int], dtype: torch.dtype, nbk: int | None = None,
                    num_warps: int = 4) -> torch.Tensor:  # fmt: skip
    """The 4-bit weight (`shape`) in `dtype`, as bitsandbytes' `dequantize_4bit` writes it, by the
    Triton kernel `_triton4.dequant_4bit` (`nbk` blocks per program, default about 4,096 codes
    and at most 128 blocks; `num_warps` warps each); for many rows, dequantize + matmul. CUDA
    with Triton only (or Triton's interpreter).

    Example:
        >>> w = dequantize_4bit(flat, qs.absmax, None, None, None, 64, "nf4", (4096, 4096),
        ...                     torch.bfloat16)  # doctest: +SKIP
    """
    from .bnb import _bnb

    _bnb()
    triton, _ = _triton()
    from ._triton4 import dequant_4bit as kernel

    n_bytes = packed.numel()
    nbk = nbk or max(1, min(128, 8192 // blocksize))  # a (nbk, blocksize / 2) tile of bytes
    w = torch.empty(shape, dtype=dtype, device=packed.device)
    nested = nested_absmax is not None
    dummy = absmax
    n_blocks = triton.cdiv(2 * n_bytes, blocksize)
    kernel[(triton.cdiv(n_blocks, nbk),)](
        packed, absmax, nested_absmax if nested else dummy, nested_code if nested else dummy,
        offset if nested else dummy, _code_values(quant_type, packed.device), w, n_bytes,
        BS=blocksize, NESTED=nested, BS2=256, NBK=nbk, num_warps=num_warps,
        enable_fp_fusion=False,  # the nested absmax as bitsandbytes makes it: x * y, then + offset
    )  # fmt: skip
    return w


def dequantize_weight_applies(packed: torch.Tensor, quant_type: str, numel: int,
                              dtype: torch.dtype) -> bool:  # fmt: skip
    """Whether `dequantize_weight` writes out this 4-bit weight (`numel` values, fp32 absmax per
    block of the flattened weight) in `dtype`: `DEQUANT_ENABLED` (or `DEQUANT_TRAINING` under
    autograd), CUDA with Triton, nf4/fp4 codes indexed in int32, a float dtype. The 4-bit layers
    whose whole weight is dequantized outside QuantLinear4bit's matmul take it there
    (`Bnb4bitFormat.compute_weight`, `compute_units`: the experts' fused tensors).

    Example:
        >>> dequantize_weight_applies(packed, "nf4", 4096 * 4096, torch.bfloat16)  # CPU  # doctest: +SKIP
        False
    """
    return (_dequant_on() and packed.device.type == "cuda" and _HAS_TRITON
            and quant_type in ("nf4", "fp4") and numel < _INT32_LIMIT
            and dtype in (torch.bfloat16, torch.float16, torch.float32))  # fmt: skip


@torch.library.custom_op("quantmesh::dequantize_weight_4bit", mutates_args=())
def dequantize_weight(packed: torch.Tensor, absmax: torch.Tensor, blocksize: int,
                      quant_type: str, out_f: int, in_f: int,
                      dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """The (out_f, in_f) weight of the 4-bit codes `packed` (blocks over the flattened weight, one
    fp32 absmax each) in `dtype`: the values of bitsandbytes' `dequantize_4bit`, by Triton's
    (`dequantize_4bit`); a custom op, traced by `torch.compile`. Check
    `dequantize_weight_applies` first.

    Example:
        >>> w = dequantize_weight(packed, absmax, 64, "nf4", 4096, 4096, torch.bfloat16)  # doctest: +SKIP
    """
    flat = packed.reshape(-1).view(torch.uint8)
    return dequantize_4bit(flat, absmax, None, None, None, blocksize, quant_type, (out_f, in_f),
                           dtype)  # fmt: skip


@dequantize_weight.register_fake
def _(packed, absmax, blocksize, quant_type, out_f, in_f, dtype):
    return absmax.new_empty((out_f, in_f), dtype=dtype)


def _code_values(quant_type: str, device: torch.device) -> torch.Tensor:
    """(16,) fp32: the value of each 4-bit code, from bitsandbytes' own dequantization (absmax 1),
    so that the kernel's weights are the ones `dequantize_4bit` writes. Kept per device
    (`_kept`: made outside a compiled step's CUDA graph pool)."""

    def make() -> torch.Tensor:
        codes = torch.arange(16, dtype=torch.uint8, device=device)
        packed = ((codes[0::2] << 4) | codes[1::2]).reshape(-1, 1)  # 0x01, 0x23, ..., 0xef
        ones = torch.ones(1, dtype=torch.float32, device=device)
        return torch.ops.bitsandbytes.dequantize_4bit(
            packed, ones, 64, quant_type, [1, 16], torch.float32
        ).reshape(16)

    return _kept(_CODE_VALUES, (quant_type, str(device)), device, make)


_CODE_VALUES: dict[tuple[str, str], torch.Tensor] = {}  # (quant type, device) -> code values
