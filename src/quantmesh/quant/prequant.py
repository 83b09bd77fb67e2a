"""Slices of weights stored already quantized by bitsandbytes, read piece by piece.

A pre-quantized 4-bit weight (transformers' layout: packed codes as a (ceil(out*in/2), 1) uint8
tensor, one absmax per `blocksize` elements of the flattened (out, in) weight, optionally itself
8-bit quantized in blocks of 256) can be cut for a rank without going through full precision when
every cut falls on a block boundary (`aligned_4bit`); then `slice_4bit` returns the rank's codes and
statistics, bit for bit the stored ones. Otherwise `dequantize_4bit_slice` returns the rank's part
as the exact float values the stored weight dequantizes to (the caller requantizes them, which is
not exact: new blocks span old ones). An int8 (LLM.int8) weight has one scale per output row, so
any row or column slice is exact (`slice_int8`).

The codes are read through a callback `read(first_byte, stop_byte) -> uint8 tensor`, so only the
bytes a rank needs (rows) or one bounded chunk of rows at a time (columns) are ever on the host.

Example:
    >>> qs = stored_4bit_state(tensors)                                  # doctest: +SKIP
    >>> if aligned_4bit(qs.shape, qs.blocksize, 0, ((0, 128),)):         # doctest: +SKIP
    ...     packed, part = slice_4bit(qs, 0, ((0, 128),), read)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from .base import QuantError
from .bnb import NESTED_BLOCK, _bnb, _float_absmax, int8_scales

__all__ = [
    "ByteReader",
    "aligned_4bit",
    "cut_module",
    "dequantize_4bit_slice",
    "slice_4bit",
    "slice_int8",
    "stored_4bit_state",
]

ByteReader = Callable[[int, int], torch.Tensor]  # (first byte, stop byte) -> (n,) uint8
Ranges = tuple[tuple[int, int], ...]
CHUNK_BYTES = 4 << 20  # packed bytes per step when a column slice walks the rows


def stored_4bit_state(tensors: Mapping[str, torch.Tensor]) -> Any:
    """The bitsandbytes QuantState of one stored 4-bit weight from its statistics, without codes.

    `tensors` holds the keys after "<module>.weight." ("absmax", "quant_map", "nested_absmax",
    "nested_quant_map", "quant_state.bitsandbytes__nf4" / "__fp4"); all small.

    Example:
        >>> stored_4bit_state({"absmax": a, "quant_map": m, "quant_state.bitsandbytes__nf4": s}).shape  # doctest: +SKIP
        torch.Size([256, 256])
    """
    QuantState = _bnb().functional.QuantState
    if not any(k.startswith("quant_state.") for k in tensors):
        raise QuantError(
            f"the statistics {sorted(tensors)} hold no 'quant_state.bitsandbytes__nf4' (or fp4) "
            "entry; this is not a bitsandbytes 4-bit weight"
        )
    return QuantState.from_dict(dict(tensors), device=torch.device("cpu"))


def aligned_4bit(shape: tuple[int, int], blocksize: int, dim: int | None, ranges: Ranges) -> bool:
    """True when every range of rows (dim 0) or columns (dim 1) of an (out, in) weight holds whole
    quantization blocks of its flattened elements (a final partial block at the end counts).

    Rows [a, b) are aligned when a*in and b*in are multiples of `blocksize` (or b is the last row);
    columns when in, a and b are.

    Example:
        >>> aligned_4bit((256, 96), 64, 0, ((0, 128),)), aligned_4bit((256, 96), 64, 0, ((0, 3),))
        (True, False)
    """
    out_f, in_f = shape
    if dim is None:
        return True
    for a, b in ranges:
        if dim == 0 and ((a * in_f) % blocksize or ((b * in_f) % blocksize and b != out_f)):
            return False
        if dim == 1 and (in_f % blocksize or a % blocksize or b % blocksize):
            return False
    return True


def _check(qs: Any, dim: int | None, ranges: Ranges) -> tuple[int, int]:
    out_f, in_f = (int(s) for s in qs.shape)
    if getattr(qs, "packing_format_for_cpu", False):
        raise QuantError("this 4-bit weight uses the CPU repacked layout; checkpoints never do")
    if dim is not None:
        for a, b in ranges:
            if dim not in (0, 1) or not 0 <= a < b <= (out_f, in_f)[dim]:
                raise ValueError(f"[{a}, {b}) along dim {dim} is not a slice of {(out_f, in_f)}")
    return out_f, in_f


def _row_chunk(in_f: int, out_f: int) -> int:
    return max(1, min(out_f, CHUNK_BYTES * 2 // max(in_f, 1)))


@torch.no_grad()
def slice_4bit(
    qs: Any, dim: int | None, ranges: Ranges | None, read: ByteReader
) -> tuple[torch.Tensor, Any]:
    """(packed codes (n, 1) uint8, QuantState) of the rows/columns `ranges` along `dim`, concatenated.

    Exact: the codes and statistics are the stored ones. Needs `aligned_4bit`. The statistics stay
    8-bit (double quant) for the whole weight and for one row range starting on a 256-block boundary
    of the absmax; otherwise they become the fp32 absmax bitsandbytes would compute from them.

    Example:
        >>> packed, part = slice_4bit(qs, 0, ((128, 256),), read)  # doctest: +SKIP
    """
    F = _bnb().functional
    QuantState = F.QuantState
    out_f, in_f = _check(qs, dim, ranges or ())
    bs, n = qs.blocksize, out_f * in_f
    if dim is None or ranges is None or ranges == ((0, (out_f, in_f)[dim]),):
        return read(0, (n + 1) // 2).reshape(-1, 1), qs  # the whole weight, as stored
    if not aligned_4bit((out_f, in_f), bs, dim, ranges):
        raise QuantError(
            f"{ranges} along dim {dim} of a {qs.quant_type} {(out_f, in_f)} weight cut "
            f"quantization blocks of {bs}; use dequantize_4bit_slice and requantize"
        )
    if (
        dim == 0
        and len(ranges) == 1
        and qs.nested
        and (ranges[0][0] * in_f // bs) % NESTED_BLOCK == 0
    ):
        (a, b) = ranges[0]
        e0, e1 = a * in_f, b * in_f
        b0, b1 = e0 // bs, -(-e1 // bs)
        n0, n1 = b0 // NESTED_BLOCK, -(-b1 // NESTED_BLOCK)
        s2 = qs.state2
        state2 = QuantState(absmax=s2.absmax[n0:n1].clone(), code=s2.code, blocksize=s2.blocksize,
                            dtype=s2.dtype)  # fmt: skip
        part = QuantState(absmax=qs.absmax[b0:b1].clone(), shape=torch.Size((b - a, in_f)),
                          code=qs.code, blocksize=bs, quant_type=qs.quant_type, dtype=qs.dtype,
                          offset=qs.offset, state2=state2)  # fmt: skip
        return read(e0 // 2, (e1 + 1) // 2).reshape(-1, 1), part
    amax = _float_absmax(F, qs)  # (n_blocks,) fp32: exactly what dequantize_4bit computes
    if dim == 0:
        codes, stats = [], []
        for a, b in ranges:
            e0, e1 = a * in_f, b * in_f
            codes.append(read(e0 // 2, (e1 + 1) // 2))
            stats.append(amax[e0 // bs : -(-e1 // bs)])
        data, absmax = torch.cat(codes), torch.cat(stats)
        shape = (sum(b - a for a, b in ranges), in_f)
    else:
        per_row = in_f // bs
        rows_of = amax.view(out_f, per_row)
        codes, stats, step = [], [], _row_chunk(in_f, out_f)
        for r0 in range(0, out_f, step):
            r1 = min(out_f, r0 + step)
            rows = read(r0 * in_f // 2, r1 * in_f // 2).view(r1 - r0, in_f // 2)
            codes.append(torch.cat([rows[:, a // 2 : b // 2] for a, b in ranges], dim=1))
        data = torch.cat(codes).reshape(-1)
        stats = [rows_of[:, a // bs : b // bs] for a, b in ranges]
        absmax = torch.cat(stats, dim=1).reshape(-1)
        shape = (out_f, sum(b - a for a, b in ranges))
    part = QuantState(absmax=absmax.contiguous(), shape=torch.Size(shape), code=qs.code,
                      blocksize=bs, quant_type=qs.quant_type, dtype=qs.dtype)  # fmt: skip
    return data.contiguous().reshape(-1, 1), part


@torch.no_grad()
def _dequantize_rows(
    qs: Any, amax: torch.Tensor, r0: int, r1: int, read: ByteReader
) -> torch.Tensor:
    """Rows [r0, r1) of the stored weight as the floats it dequantizes to: (r1 - r0, in)."""
    F = _bnb().functional
    QuantState = F.QuantState
    out_f, in_f = (int(s) for s in qs.shape)
    bs, n = qs.blocksize, out_f * in_f
    e0, e1 = r0 * in_f, r1 * in_f
    b0, b1 = e0 // bs, -(-e1 // bs)
    E0, E1 = b0 * bs, min(b1 * bs, n)  # the whole blocks covering the rows
    data = read(E0 // 2, (E1 + 1) // 2).reshape(-1, 1)
    part = QuantState(absmax=amax[b0:b1].contiguous(), shape=torch.Size((1, E1 - E0)),
                      code=qs.code, blocksize=bs, quant_type=qs.quant_type, dtype=qs.dtype)  # fmt: skip
    # (E1 - E0,) in the dtype the weight was quantized from
    flat = F.dequantize_4bit(data, part).reshape(-1)
    return flat[e0 - E0 : e1 - E0].view(r1 - r0, in_f)


@torch.no_grad()
def dequantize_4bit_slice(
    qs: Any, dim: int | None, ranges: Ranges | None, read: ByteReader
) -> torch.Tensor:
    """The rows/columns `ranges` along `dim` of a stored 4-bit weight, dequantized: (rows, cols).

    Exact: equal to the same slice of bitsandbytes' `dequantize_4bit` of the whole weight. Reads
    only the blocks covering the rows (dim 0), or walks all rows a bounded chunk at a time (dim 1).

    Example:
        >>> w = dequantize_4bit_slice(qs, 1, ((0, 48),), read)  # doctest: +SKIP
    """
    F = _bnb().functional
    out_f, in_f = _check(qs, dim, ranges or ())
    amax = _float_absmax(F, qs)
    if dim is None or ranges is None:
        ranges, dim = ((0, out_f),), 0
    if dim == 0:
        return torch.cat([_dequantize_rows(qs, amax, a, b, read) for a, b in ranges])
    step, parts = _row_chunk(in_f, out_f), []
    for r0 in range(0, out_f, step):
        rows = _dequantize_rows(qs, amax, r0, min(out_f, r0 + step), read)
        parts.append(torch.cat([rows[:, a:b] for a, b in ranges], dim=1))
    return torch.cat(parts)


def slice_int8(
    cb: torch.Tensor, scb: torch.Tensor, dim: int | None, ranges: Ranges | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (CB, SCB) of rows (dim 0) or columns (dim 1) of an LLM.int8 weight; always exact.

    `cb` is the already-sliced int8 weight as the reader returned it; `scb` the full (out,) row
    scales. A row slice keeps its rows' scales; a column slice keeps all of them.

    Example:
        >>> slice_int8(torch.ones(2, 4, dtype=torch.int8), torch.tensor([1.0, 2.0]), 0, ((1, 2),))[1]
        tensor([2.])
    """
    if dim == 0 and ranges is not None:
        scb = torch.cat([scb[a:b] for a, b in ranges])
    if scb.shape[0] != cb.shape[0]:
        raise ValueError(f"int8 weight has {cb.shape[0]} rows but {scb.shape[0]} row scales")
    return cb.contiguous(), scb.to(torch.float32).contiguous()


@torch.no_grad()
def cut_module(
    fmt: Any,
    module: torch.nn.Module,
    source: torch.nn.Module,
    dim: int | None,
    ranges: Ranges | None,
    device: torch.device,
) -> str:
    """Fill the local quantized `module` of format `fmt` with the rows (dim 0) / columns (dim 1)
    `ranges` of `source`, a bitsandbytes Linear4bit / Linear8bitLt holding quantized weights.

    Codes and statistics are cut as stored where the cut falls on blocks (int8: always); otherwise
    the exact float values of the part are quantized again in `fmt` (not exact). Returns how.

    Example:
        >>> cut_module(fmt, shard.local, user_layer, 0, ((0, 128),), torch.device("cpu"))  # doctest: +SKIP
        'codes cut on block boundaries'
    """
    w: Any = source.weight
    if fmt.name == "int8":
        cb, scb = w.data, int8_scales(source)
        assert scb is not None  # format_of checked it
        cb = (
            cb
            if dim is None or ranges is None
            else torch.cat([cb.narrow(dim, a, b - a) for a, b in ranges], dim=dim)
        )
        cb, scb = slice_int8(cb, scb, dim, ranges)
        fmt.load_state(module, cb, scb, device=device,
                       dtype=getattr(source, "orig_dtype", None) or torch.float32)  # fmt: skip
        return "int8 rows and scales as stored"
    qs = w.quant_state
    flat = w.data.reshape(-1).view(torch.uint8)
    read: ByteReader = lambda a, b: flat[a:b]  # noqa: E731
    if aligned_4bit(tuple(qs.shape), qs.blocksize, dim, ranges or ()):
        packed, part = slice_4bit(qs, dim, ranges, read)
        if part is qs:  # the whole weight: the module gets its own copy of the statistics
            packed, part = packed.clone(), _copy_state(qs)
        fmt.load_state(module, packed, part, device=device)
        return "codes as stored" if dim is None else "codes cut on block boundaries"
    part_w = dequantize_4bit_slice(qs, dim, ranges, read)
    fmt.quantize_into(
        module,
        part_w.to(device=device, dtype=torch.float32 if device.type == "cpu" else part_w.dtype),
    )
    return f"requantized: {list(ranges or ())} along dim {dim} cut {qs.blocksize}-element blocks"


def _copy_state(qs: Any) -> Any:
    QuantState = _bnb().functional.QuantState
    s2 = qs.state2
    state2 = None if s2 is None else QuantState(absmax=s2.absmax.clone(), code=s2.code.clone(),
                                                blocksize=s2.blocksize, dtype=s2.dtype)  # fmt: skip
    return QuantState(absmax=qs.absmax.clone(), shape=qs.shape, code=qs.code.clone(),
                      blocksize=qs.blocksize, quant_type=qs.quant_type, dtype=qs.dtype,
                      offset=None if qs.offset is None else qs.offset.clone(), state2=state2)  # fmt: skip
