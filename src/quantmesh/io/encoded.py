"""Stored weights read as their values: formats quantmesh does not compute in, or layouts no
model tensor has, decoded as the reader reads them.

- Pieces of a converted key that bitsandbytes stored quantized. A model saved quantized while its
  experts were separate linears (transformers 4; e.g. the `-bnb-4bit` uploads of mixture-of-
  experts models) stores each expert's weight as codes (`...experts.3.gate_proj.weight` packed
  uint8 with `.absmax`, `.quant_map`, `.quant_state.bitsandbytes__nf4`, ... beside it) or int8
  rows with `.SCB` scales. transformers 5 fuses the experts into one 3-D tensor per projection,
  which no stored code layout is. Each piece reads as bitsandbytes' dequantized values (4-bit in
  the dtype it was quantized from, int8 in float32), the conversion stacks them like float
  pieces, and the model quantizes the fused tensor again in its own blocks. One piece is held
  at a time.
- fp8 with block scales (quant_method "fp8": DeepSeek-V3's, Qwen3's `-FP8` checkpoints; `<m>.weight`
  float8_e4m3fn, `<m>.weight_scale_inv` one float32 per 128 x 128 block), plain keys and pieces
  alike, a chunk of rows at a time.
- gpt-oss' experts in MXFP4 (quant_method "mxfp4": `<t>_blocks` and `<t>_scales`, read as the
  model's tensor `<t>`), a chunk of experts at a time.

The model holds the values in float or quantizes them as `quant=` says. Statistics and scales
are consumed: they are no keys of the reader.

Example:
    >>> decoded, used = decode_stored(shards, is_piece)  # doctest: +SKIP
    >>> decoded["model.layers.0.mlp.experts.3.gate_proj.weight"].info(...)  # doctest: +SKIP
    ((768, 2048), torch.bfloat16)
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch

from ..config import QuantError

__all__ = ["DecodedPiece", "Fp8Weight", "Mxfp4Weight", "decode_stored"]

TAG_4BIT = ".quant_state.bitsandbytes__"  # <m>.weight.quant_state.bitsandbytes__nf4
STATS_4BIT = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")


def _whole(shard: Any, key: str) -> torch.Tensor:
    shape, _ = shard.info(key)
    return shard.block(key, tuple(slice(None) for _ in shape))


class _OneKey:
    """A shard of one key, `key`, whose values have `shape` and `dtype` (the reader's shard API:
    keys, info, block, close)."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32

    def keys(self) -> list[str]:
        return [self.key]

    def info(self, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        return self.shape, self.dtype


class DecodedPiece(_OneKey):
    """One stored quantized weight as a shard of one key holding its dequantized values.

    `format` is "nf4", "fp4" or "int8"; `parts` maps each stored key the value needs (the codes
    and statistics) to its shard. `held` is a one-entry cache shared by a reader's pieces.
    """

    def __init__(
        self,
        key: str,
        format: str,
        parts: dict[str, Any],
        shape: tuple[int, ...],
        dtype: torch.dtype,
        held: dict[str, torch.Tensor],
    ):
        self.key, self.format, self.parts = key, format, parts
        self.shape, self.dtype, self._held = shape, dtype, held

    def _value(self) -> torch.Tensor:
        if self.key not in self._held:
            self._held.clear()  # one piece at a time: the reader reads pieces in turn
            self._held[self.key] = self._decode()
        return self._held[self.key]

    def _decode(self) -> torch.Tensor:
        import bitsandbytes.functional as F  # a bitsandbytes folder: bitsandbytes is there

        codes = _whole(self.parts[self.key], self.key)
        if self.format == "int8":
            scb_key = self.key[: -len("weight")] + "SCB"
            scb = _whole(self.parts[scb_key], scb_key).float()
            return F.int8_vectorwise_dequant(codes, scb)  # CB * SCB / 127, float32
        prefix = self.key + "."
        stats = {k[len(prefix) :]: _whole(s, k) for k, s in self.parts.items() if k != self.key}
        qs = F.QuantState.from_dict(stats, device=torch.device("cpu"))
        return F.dequantize_4bit(codes, qs)  # (out, in) in the dtype it was quantized from

    def block(self, key: str, index: tuple[slice, ...]) -> torch.Tensor:
        return self._value()[index]

    def close(self) -> None:
        self._held.pop(self.key, None)
        for shard in self.parts.values():
            shard.close()


FP8_BLOCK = 128  # the block of every fp8 checkpoint with block scales (weight_block_size)


class Fp8Weight(_OneKey):
    """One fp8 weight with block scales (`weight_scale_inv`) as a shard of one key holding its
    float32 values (fp8 value x its block's scale, as transformers' fp8 dequantize computes them),
    decoded for the rows and columns read only: no whole float copy is made, and a rank that
    reads its columns (a row-parallel split) decodes those alone."""

    format = "fp8"

    def __init__(self, key: str, shard: Any, scale_key: str, scale_shard: Any, block: tuple):
        self.key, self.shard, self.scale_key, self.scale_shard = key, shard, scale_key, scale_shard
        self.shape: tuple[int, ...] = tuple(shard.info(key)[0])
        self.rows, self.cols = block

    def block(self, key: str, index: tuple[slice, ...]) -> torch.Tensor:
        (r0, r1), (c0, c1) = _span(index, 0, self.shape[0]), _span(index, 1, self.shape[1])
        w = self.shard.block(self.key, (slice(r0, r1), slice(c0, c1))).to(torch.float32)
        (b0, b1), (d0, d1) = _blocks(r0, r1, self.rows), _blocks(c0, c1, self.cols)
        scale = self.scale_shard.block(self.scale_key, (slice(b0, b1), slice(d0, d1)))
        scale = scale.to(torch.float32).repeat_interleave(self.rows, 0)
        scale = scale[r0 - b0 * self.rows :][: r1 - r0].repeat_interleave(self.cols, 1)
        return (w * scale[:, c0 - d0 * self.cols :][:, : c1 - c0])[_rest(index, 2)]

    def close(self) -> None:
        self.shard.close()
        self.scale_shard.close()


def _span(index: tuple[slice, ...], dim: int, size: int) -> tuple[int, int]:
    """The (start, stop) that `index` reads along `dim` of `size` (all of it where `index` stops
    short); a slice with a step is refused (the reader reads contiguous blocks)."""
    cut = index[dim] if dim < len(index) else slice(None)
    start, stop, step = cut.indices(size)
    if step != 1:
        raise ValueError(f"a stored weight is read in contiguous blocks, not with step {step}")
    return start, max(start, stop)


def _blocks(start: int, stop: int, block: int) -> tuple[int, int]:
    """The blocks of `block` elements that elements start:stop lie in."""
    return start // block, max(start // block, -(-stop // block))


def _rest(index: tuple[slice, ...], dims: int) -> tuple[slice, ...]:
    """What `index` reads past its first `dims` dims (already cut)."""
    return (slice(None),) * dims + tuple(index[dims:])


# e2m1: the 16 values of a 4-bit code (sign, 2 exponent bits, 1 mantissa bit)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # fmt: skip


MX_GROUP = 32  # MXFP4: codes per scale


class Mxfp4Weight(_OneKey):
    """gpt-oss' experts in MXFP4 as a shard of one key, the model's tensor: `<t>_blocks` (E, out,
    in/32, 16) uint8, two e2m1 codes a byte (the low nibble first), and `<t>_scales` (E, out,
    in/32) uint8, a power of two per 32 codes biased by 127, read as the (E, in, out) float32
    tensor gpt-oss holds (code value x 2^(scale - 127): exact, as transformers' dequantize
    computes it), a chunk of experts at a time, and only the input and output features read (a
    rank's share of a split)."""

    format = "mxfp4"

    def __init__(self, key: str, blocks: tuple[str, Any], scales: tuple[str, Any]):
        self.key, (self.bkey, self.bshard), (self.skey, self.sshard) = key, blocks, scales
        e, out, groups, width = self.bshard.info(self.bkey)[0]
        self.shape: tuple[int, ...] = (e, groups * width * 2, out)

    def block(self, key: str, index: tuple[slice, ...]) -> torch.Tensor:
        e, k, n = self.shape
        (e0, e1), (k0, k1), (n0, n1) = _span(index, 0, e), _span(index, 1, k), _span(index, 2, n)
        g0, g1 = _blocks(k0, k1, MX_GROUP)  # the 32-code groups the rows k0:k1 lie in
        cut = (slice(e0, e1), slice(n0, n1), slice(g0, g1))
        codes = self.bshard.block(self.bkey, cut).to(torch.uint8)
        exps = self.sshard.block(self.skey, cut).to(torch.int32) - 127
        lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
        vals = torch.stack((lut[(codes & 0x0F).long()], lut[(codes >> 4).long()]), dim=-1)
        vals = torch.ldexp(vals.flatten(-2), exps.unsqueeze(-1))  # (e, n, groups, 32)
        w = vals.flatten(-2).transpose(1, 2)  # (e, k, n) from group g0's first row
        return w[:, k0 - g0 * MX_GROUP :][:, : k1 - k0][_rest(index, 3)]

    def close(self) -> None:
        self.bshard.close()
        self.sshard.close()


def _fp8_block(key: str, shape: tuple[int, ...], scales: tuple[int, ...]) -> tuple[int, int]:
    """The (rows, cols) block of an fp8 weight from its scale grid: 128 x 128 where the grid fits
    it, else the one block size the grid divides evenly; refused when neither fits."""
    if len(shape) != 2 or len(scales) != 2:
        raise QuantError(
            f"{key}: an fp8 weight of shape {shape} with scales {scales}; only 2-D weights with a "
            "2-D grid of block scales are read"
        )
    block = []
    for n, k in zip(shape, scales, strict=True):
        if -(-n // FP8_BLOCK) == k:
            block.append(FP8_BLOCK)
        elif k and n % k == 0:
            block.append(n // k)
        else:
            raise QuantError(
                f"{key}: fp8 weight {shape} with a scale grid {scales}, which no block size "
                f"fits ({FP8_BLOCK} would give {-(-n // FP8_BLOCK)}); load the float model instead"
            )
    return block[0], block[1]


def decode_stored(
    shards: dict[str, Any], is_piece: Callable[[str], bool]
) -> tuple[dict[str, DecodedPiece | Fp8Weight | Mxfp4Weight], dict[str, str]]:
    """({key: its decoded shard}, {consumed key: the key it decodes with}) for the keys of
    `shards` ({checkpoint key: shard}) read as values: pieces (`is_piece`) that bitsandbytes
    stored quantized, every fp8 weight with block scales, and MXFP4 tensors (whose key, `<t>`,
    the checkpoint does not hold: `<t>_blocks` and `<t>_scales` are consumed).

    Example:
        >>> decode_stored({"w": shard}, lambda k: True)  # doctest: +SKIP
        ({}, {})
    """
    held: dict[str, torch.Tensor] = {}
    decoded: dict[str, DecodedPiece | Fp8Weight | Mxfp4Weight] = {}
    used: dict[str, str] = {}
    for k in shards:  # MXFP4: <t>_blocks + <t>_scales -> <t>, a key the checkpoint does not hold
        if not k.endswith("_blocks") or k[: -len("_blocks")] in shards:
            continue
        key, skey = k[: -len("_blocks")], k[: -len("_blocks")] + "_scales"
        shape, dtype = shards[k].info(k)
        if skey not in shards or dtype != torch.uint8 or len(shape) != 4:
            continue
        if tuple(shards[skey].info(skey)[0]) != tuple(shape[:3]):
            raise QuantError(
                f"{k} {tuple(shape)} and {skey} {tuple(shards[skey].info(skey)[0])}: MXFP4 blocks "
                "need one scale per 32 codes; the checkpoint is damaged, download it again"
            )
        decoded[key] = Mxfp4Weight(key, (k, shards[k]), (skey, shards[skey]))
        used[k] = used[skey] = key
    for k in shards:
        if not k.endswith(".weight_scale_inv"):
            continue
        wkey = k[: -len("_scale_inv")]
        fp8 = getattr(torch, "float8_e4m3fn", None)
        if wkey not in shards or shards[wkey].info(wkey)[1] != fp8:
            continue
        block = _fp8_block(wkey, tuple(shards[wkey].info(wkey)[0]), tuple(shards[k].info(k)[0]))
        decoded[wkey] = Fp8Weight(wkey, shards[wkey], k, shards[k], block)
        used[k] = wkey
    for k in shards:
        if TAG_4BIT not in k:
            continue
        wkey, _, fmt = k.rpartition(TAG_4BIT)
        if wkey not in shards or not is_piece(wkey):
            continue
        blob = _whole(shards[k], k).reshape(-1).to(torch.uint8)
        info = json.loads(bytes(blob.tolist()).decode("utf-8"))
        stats = [f"{wkey}.{s}" for s in STATS_4BIT if f"{wkey}.{s}" in shards] + [k]
        dtype = getattr(torch, str(info.get("dtype", "float32")).replace("torch.", ""))
        parts = {key: shards[key] for key in [wkey, *stats]}
        shape = tuple(int(s) for s in info["shape"])
        decoded[wkey] = DecodedPiece(wkey, info.get("quant_type", fmt), parts, shape, dtype, held)
        used.update((s, wkey) for s in stats)
    for k in shards:
        if not k.endswith(".SCB"):
            continue
        wkey = k[: -len("SCB")] + "weight"
        if wkey not in shards or not is_piece(wkey) or shards[wkey].info(wkey)[1] != torch.int8:
            continue
        shape = shards[wkey].info(wkey)[0]
        parts = {wkey: shards[wkey], k: shards[k]}
        decoded[wkey] = DecodedPiece(wkey, "int8", parts, shape, torch.float32, held)
        used[k] = wkey
        fmt_key = k[: -len("SCB")] + "weight_format"
        if fmt_key in shards:
            if int(_whole(shards[fmt_key], fmt_key).reshape(-1)[0]) != 0:
                raise QuantError(
                    f"{fmt_key} says the int8 weight is not in bitsandbytes' row-major layout "
                    "(0); save the model again with bitsandbytes >= 0.45"
                )
            used[fmt_key] = wkey
    return decoded, used
