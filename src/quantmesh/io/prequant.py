"""Checkpoints whose linear weights are stored already quantized by bitsandbytes.

transformers saves a model loaded with `BitsAndBytesConfig` under the float model's key names,
with each quantized linear's weight replaced by:

- 4-bit (nf4 / fp4): `<m>.weight` packed codes, (ceil(out*in/2), 1) uint8, and its statistics
  `<m>.weight.absmax`, `.quant_map`, [`.nested_absmax`, `.nested_quant_map`] and
  `.quant_state.bitsandbytes__nf4` (a JSON blob: shape, blocksize, dtype, ...);
- int8 (LLM.int8): `<m>.weight` int8 (out, in), `<m>.SCB` (out,) row scales, `<m>.weight_format`.

`stored_weights` finds them in an open reader (headers and the tiny JSON blobs only);
`fill_stored` gives one rank its part: the stored codes and statistics cut on block boundaries
when the rank's rows/columns hold whole blocks (exact, no float copy), otherwise the exact float
values of the part requantized on the rank (the blocks change, so the values move by up to the
format's rounding error); a module that is not quantized in the model gets the exact float
values. int8 always cuts exactly (one scale per output row). `folder_quant` reads a folder's
`quantization_config` into a QuantConfig, and refuses the quantization methods quantmesh cannot
read, naming what to do instead.

Example:
    >>> with open_checkpoint("llama-nf4") as ckpt:                   # doctest: +SKIP
    ...     sorted(stored_weights(ckpt))[:1]
    ['model.layers.0.mlp.down_proj.weight']
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..quant.base import QuantConfig, QuantError
from ..tp.layers import ShardedModule
from .encoded import STATS_4BIT, TAG_4BIT
from .reader import CheckpointReader, Ranges

__all__ = [
    "StoredWeight",
    "folder_quant",
    "refuse_packed_keys",
    "stored_weights",
    "fill_stored",
    "stored_method",
]

# what to say for quantization methods quantmesh does not read (transformers' quant_method names)
_PACKED_FOR_KERNELS = (
    "packs integer codes with group-wise scales (and zero points) for its own GPU kernels, "
    "which quantmesh cannot cut per rank or run on its ranks"
)
_OTHER_METHODS = {
    "gptq": _PACKED_FOR_KERNELS,
    "awq": _PACKED_FOR_KERNELS,
    "torchao": (
        "stores torchao tensor subclasses, which are quantized whole and cannot be read as "
        "per-rank slices"
    ),
}
_FLOAT_FIX = (
    "load the float model it was made from instead (its model card names it) and let quantmesh "
    "quantize after slicing (quant='nf4' or 'int8'), or load a folder saved quantized by "
    "bitsandbytes (transformers BitsAndBytesConfig + save_pretrained)"
)


@dataclass
class StoredWeight:
    """One linear weight stored quantized: its format, logical (out, in) shape and keys."""

    key: str  # the model key of the weight ("<m>.weight")
    format: str  # "nf4", "fp4" or "int8"
    shape: tuple[int, int]  # logical (out, in)
    blocksize: int  # elements per absmax block (4-bit); 0 for int8 (one scale per row)
    extra: list[str] = field(default_factory=list)  # the other keys of this weight

    @property
    def module(self) -> str:
        return self.key.rsplit(".", 1)[0] if "." in self.key else ""


def _blob(reader: CheckpointReader, key: str) -> dict[str, Any]:
    raw = reader.read(key).reshape(-1).to(torch.uint8)
    return json.loads(bytes(raw.tolist()).decode("utf-8"))


def refuse_packed_keys(reader: CheckpointReader) -> None:
    """Raise QuantError when the checkpoint holds GPTQ/AWQ-packed weights (`.qweight` keys).

    Example:
        >>> refuse_packed_keys(open_checkpoint({"w.weight": torch.zeros(1)}))
    """
    packed = [k for k in reader.keys() if k.endswith((".qweight", ".qzeros"))]
    if packed:
        raise QuantError(
            f"{reader.source} holds GPTQ/AWQ-packed weights (e.g. {packed[0]!r}); this format "
            f"{_PACKED_FOR_KERNELS}; {_FLOAT_FIX}"
        )


def stored_weights(reader: CheckpointReader) -> dict[str, StoredWeight]:
    """{weight key: StoredWeight} of every bitsandbytes-quantized linear in `reader`.

    Reads only headers and the tiny per-weight JSON blobs. Raises QuantError on GPTQ/AWQ keys.

    Example:
        >>> stored_weights(open_checkpoint({"w.weight": torch.zeros(2, 2)}))
        {}
    """
    refuse_packed_keys(reader)
    keys = reader.keys()
    have = set(keys)
    out: dict[str, StoredWeight] = {}
    for k in keys:
        if TAG_4BIT in k:
            wkey, _, fmt = k.rpartition(TAG_4BIT)
            info = _blob(reader, k)
            extra = [f"{wkey}.{s}" for s in STATS_4BIT if f"{wkey}.{s}" in have] + [k]
            shape = tuple(int(s) for s in info["shape"])
            if len(shape) != 2 or wkey not in have:
                raise QuantError(
                    f"{k}: a 4-bit weight of shape {shape} (or without its {wkey!r}); only 2-D "
                    "linear weights with their codes are supported"
                )
            out[wkey] = StoredWeight(wkey, info.get("quant_type", fmt), (shape[0], shape[1]),
                                     int(info["blocksize"]), extra)  # fmt: skip
        elif k.endswith(".SCB"):
            mod = k[: -len(".SCB")]
            wkey = f"{mod}.weight"
            if wkey in have and reader.dtype(wkey) == torch.int8 and len(reader.shape(wkey)) == 2:
                fmt_key = f"{mod}.weight_format"
                extra = [k] + ([fmt_key] if fmt_key in have else [])
                if fmt_key in have and int(reader.read(fmt_key).reshape(-1)[0]) != 0:
                    raise QuantError(
                        f"{fmt_key} says the int8 weight is not in bitsandbytes' row-major "
                        "layout (0); save the model again with bitsandbytes >= 0.45"
                    )
                out_f, in_f = reader.shape(wkey)
                out[wkey] = StoredWeight(wkey, "int8", (out_f, in_f), 0, extra)
    return out


def _swap(dim: int | None, conv1d: bool) -> int | None:
    # a Conv1D keeps its float weight (in, out); the stored quantized weight is (out, in)
    return None if dim is None else (1 - dim if conv1d else dim)


def check_target(sw: StoredWeight, owner: nn.Module, full_shape: tuple[int, ...]) -> str | None:
    """None when the stored weight can fill `owner`'s weight (full shape `full_shape`, float
    layout), else the problem (one line). Called before anything is read.

    Example:
        >>> check_target(StoredWeight("q.weight", "nf4", (8, 64), 64), nn.Linear(64, 8), (8, 64))
    """
    conv1d = isinstance(owner, ShardedModule) and owner.kind.name == "Conv1D"
    want = tuple(reversed(full_shape)) if conv1d else tuple(full_shape)
    if want != sw.shape:
        return f"{sw.key}: stored {sw.format} weight of logical shape {sw.shape}, model {want}"
    fmt = owner.fmt if isinstance(owner, ShardedModule) else None
    if fmt is None:
        return None  # dequantized exactly into the float weight
    backend = fmt.config.backend
    if backend != "bitsandbytes" or fmt.name != sw.format:
        q = f"QuantConfig(format={sw.format!r})"
        return (
            f"{sw.key}: stored as bitsandbytes {sw.format}, the model quantizes it as "
            f"{backend} {fmt.name}; parallelize with quant={q} (or no quant, to hold it in float)"
        )
    return None


def _byte_reader(reader: CheckpointReader, key: str, counter: list[int]) -> Any:
    def read(a: int, b: int) -> torch.Tensor:
        counter[0] += b - a
        return reader.read(key, 0, ((a, b),)).reshape(-1).view(torch.uint8)

    return read


def _stats(reader: CheckpointReader, sw: StoredWeight, counter: list[int]) -> Any:
    from ..quant.prequant import stored_4bit_state

    prefix = sw.key + "."
    tensors = {k[len(prefix) :]: reader.read(k) for k in sw.extra}
    counter[0] += sum(t.numel() * t.element_size() for t in tensors.values())
    return stored_4bit_state(tensors)


@torch.no_grad()
def fill_stored(
    sw: StoredWeight,
    reader: CheckpointReader,
    owner: nn.Module,
    dim: int | None,
    ranges: Ranges | None,
    put: Any,
) -> tuple[int, str]:
    """Give `owner` (a ShardedModule, or a float module's weight through `put(value)`) its part of
    the stored weight `sw`: `dim`/`ranges` as in the float checkpoint layout. Returns (bytes read,
    how: "codes as stored" / "codes cut on block boundaries" / "requantized: ..." / "dequantized").

    Example:
        >>> fill_stored(sw, reader, model.get_submodule("q_proj"), 0, ((0, 64),), put)  # doctest: +SKIP
        (4224, 'codes cut on block boundaries')
    """
    from ..quant.prequant import (
        aligned_4bit,
        dequantize_4bit_slice,
        slice_4bit,
        slice_int8,
    )

    sharded = owner if isinstance(owner, ShardedModule) else None
    conv1d = sharded is not None and sharded.kind.name == "Conv1D"
    sdim = _swap(dim, conv1d)
    fmt = sharded.fmt if sharded is not None else None
    counter = [0]
    if sw.format == "int8":
        mod = sw.module
        cb = reader.read(sw.key, sdim, ranges)
        scb = reader.read(f"{mod}.SCB" if mod else "SCB", dtype=torch.float32)
        counter[0] += cb.numel() + scb.numel() * 4
        cb, scb = slice_int8(cb, scb, sdim, ranges)
        if fmt is not None and sharded is not None:
            dev, dt = sharded.device_hint, sharded.float_dtype
            sharded.write_local(lambda local: fmt.load_state(local, cb, scb, device=dev, dtype=dt))
            return counter[0], "int8 rows and scales as stored"
        from ..quant.bnb import _bnb

        w = _bnb().functional.int8_vectorwise_dequant(cb, scb)  # (rows, cols) fp32: CB*SCB/127
        put(w.t() if conv1d else w)
        return counter[0], "dequantized (int8 -> float, exact)"
    qs = _stats(reader, sw, counter)
    read = _byte_reader(reader, sw.key, counter)
    if fmt is not None and sharded is not None:
        if aligned_4bit(sw.shape, sw.blocksize, sdim, ranges or ()):
            packed, part = slice_4bit(qs, sdim, ranges, read)
            dev = sharded.device_hint
            sharded.write_local(lambda local: fmt.load_state(local, packed, part, device=dev))
            whole = sdim is None or part is qs
            return counter[0], "codes as stored" if whole else "codes cut on block boundaries"
        w = dequantize_4bit_slice(qs, sdim, ranges, read)  # exact stored values of this part
        sharded.load_param("weight", w.t() if conv1d else w)  # quantized again on the rank
        cut = "rows" if sdim == 0 else "columns"
        return counter[0], (
            f"requantized: this rank's {cut} {list(ranges or ())} cut {sw.blocksize}-element "
            "blocks, so its exact values were quantized again in new blocks (not exact)"
        )
    w = dequantize_4bit_slice(qs, sdim, ranges, read)
    put(w.t() if conv1d else w)
    return counter[0], f"dequantized ({sw.format} -> float, exact)"


def _quantization_config(path: str | Path) -> dict[str, Any] | None:
    cfg_file = Path(path) / "config.json"
    qc = json.loads(cfg_file.read_text()).get("quantization_config") if cfg_file.is_file() else None
    return qc or None


def stored_method(path: str | Path) -> str | None:
    """The `quant_method` of the folder's `quantization_config` (lower case), None without one.

    Example:
        >>> stored_method("gpt-oss-20b")  # doctest: +SKIP
        'mxfp4'
    """
    qc = _quantization_config(path)
    return None if qc is None else str(qc.get("quant_method", "?")).lower()


def held_as_float(path: str | Path) -> str | None:
    """Why the folder's weights grow when loaded without quant= (a format quantmesh does not
    compute in: fp8, MXFP4), None when they do not.

    Example:
        >>> held_as_float("gpt-oss-20b")  # doctest: +SKIP
        'gpt-oss-20b is stored in mxfp4, which quantmesh does not compute in: without quantization its weights load as float, about four times the stored bytes in bf16'
    """  # noqa: E501
    method = stored_method(path)
    if method not in ("fp8", "mxfp4"):
        return None
    grows = "about twice" if method == "fp8" else "about four times"
    return (
        f"{path} is stored in {method}, which quantmesh does not compute in: without "
        f"quantization its weights load as float, {grows} the stored bytes in bf16"
    )


def folder_quant(path: str | Path, quant: str | QuantConfig | None) -> QuantConfig | None:
    """The QuantConfig that loads the folder `path` as it is stored, given the user's `quant=`.

    A folder without `quantization_config` in config.json returns `quant` unchanged, and so do an
    fp8 folder with block scales and an MXFP4 one (their weights are read as float values,
    quantized as `quant` says). A bitsandbytes folder gives its format (nf4/fp4/int8), double
    quant and int8 threshold (from_pretrained then targets exactly the layers stored quantized).
    A `quant=` that names another format is an error. Other methods are refused.

    Example:
        >>> folder_quant("llama-nf4", None).format  # doctest: +SKIP
        'nf4'
    """
    from ..quant.base import resolve_quant

    qc = _quantization_config(path)
    user = resolve_quant(quant)
    if not qc:
        return user
    method = str(qc.get("quant_method", "?")).lower()
    if method == "mxfp4":  # gpt-oss' experts, read as float values (io/encoded.py)
        return user
    if method == "fp8":  # block-scaled fp8, read as float values (io/encoded.py)
        fmt = str(qc.get("fmt", "e4m3")).lower()
        if fmt != "e4m3" or qc.get("weight_block_size") is None:
            raise QuantError(
                f"{path} holds fp8 weights ({fmt}, weight_block_size="
                f"{qc.get('weight_block_size')}); quantmesh reads e4m3 weights with block scales "
                f"(weight_scale_inv) only; {_FLOAT_FIX}"
            )
        return user
    if method != "bitsandbytes":
        what = _OTHER_METHODS.get(method, "is a quantization method quantmesh does not read")
        raise QuantError(
            f"{path} holds a checkpoint quantized by {method} (quantization_config in "
            f"config.json); {method} {what}; {_FLOAT_FIX}"
        )
    if qc.get("load_in_4bit"):
        stored = QuantConfig(
            format=str(qc.get("bnb_4bit_quant_type", "fp4")),
            double_quant=bool(qc.get("bnb_4bit_use_double_quant", False)),
        )
    elif qc.get("load_in_8bit"):
        if qc.get("llm_int8_has_fp16_weight"):
            raise QuantError(
                f"{path} was saved with llm_int8_has_fp16_weight=True (float weights kept for "
                "training); load it as a float folder: remove quantization_config from "
                "config.json and pass quant='int8'"
            )
        stored = QuantConfig(format="int8", int8_threshold=float(qc.get("llm_int8_threshold", 6.0)))
    else:
        raise QuantError(
            f"{path}: a bitsandbytes quantization_config with neither load_in_4bit nor "
            "load_in_8bit; fix config.json"
        )
    if user is None:
        return stored
    if user.backend != "bitsandbytes" or user.format != stored.format:
        raise QuantError(
            f"{path} is stored as bitsandbytes {stored.format}, but quant= asks for "
            f"{user.backend} {user.format}; pass quant=None (or {stored.format!r}) to use it as "
            "stored, or point at the float checkpoint to quantize differently"
        )
    return user
