"""Checkpoint reader: stream one tensor-parallel slice at a time, with host memory near one slice.

A tensor-parallel rank needs, for each local parameter, a *slice request*: (checkpoint key, dim,
ranges), where `ranges` are (start, stop) intervals of the FULL tensor along `dim`, concatenated in
order (several for fused projections such as q|k|v, each segment split per rank). `read` allocates
the output once, at the target dtype and on the target device, then fills it in row chunks of at most
`chunk_bytes`, casting per chunk, so the host never holds more than the output plus one chunk.

Sources: a `.safetensors` file, an HF folder (`model.safetensors.index.json`, a single
`model.safetensors`, other `*.safetensors` files, or `pytorch_model.bin[.index.json]`), a torch
`.bin`/`.pt` file (opened with `mmap=True, weights_only=True`: nothing is unpickled beyond tensors),
or an in-memory dict of tensors. Shards are opened lazily, on the first read of one of their keys.

Example:
    >>> with open_checkpoint("model_dir") as ckpt:  # doctest: +SKIP
    ...     w = ckpt.read("mlp.up.weight", 0, ((0, 2048),), dtype=torch.bfloat16)
"""

from __future__ import annotations

import difflib
import itertools
import json
import math
import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from ..errors import QuantmeshError
from .convert import ConversionError, Leaf, Node, Piece, assemble
from .encoded import decode_stored

__all__ = ["CheckpointKeyError", "CheckpointReader", "open_checkpoint"]

DEFAULT_CHUNK_BYTES = 64 << 20  # one read step; bounds host memory beyond the output slice

Ranges = tuple[tuple[int, int], ...]
Selection = tuple[Ranges, ...]
KeyMap = Mapping[str, str | Piece | None] | Callable[[str], str | Piece | None]

_MISSING = (
    "no checkpoint at {}: expected a .safetensors/.bin/.pt file or a folder with "
    "model.safetensors[.index.json]"
)
_TORCH_SUFFIXES = (".bin", ".pt", ".pth")


class CheckpointKeyError(QuantmeshError, KeyError):
    """A key that the checkpoint does not hold; the message lists close matches and the fix."""

    def __str__(self) -> str:  # KeyError would repr() the message, quoting it and its newlines
        return str(self.args[0])


def _st_dtype(name: str) -> torch.dtype:
    """torch dtype of a safetensors dtype tag ("F32", "BF16", "F8_E4M3", ...)."""
    table = {
        "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
        "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
        "U16": "uint16", "U32": "uint32", "U64": "uint64", "BOOL": "bool",
        "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
        "C64": "complex64",
    }  # fmt: skip
    dtype = getattr(torch, table.get(name, ""), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(
            f"safetensors dtype {name!r} has no torch dtype in torch {torch.__version__}"
        )
    return dtype


class _SafetensorsShard:
    """One .safetensors file, opened on first use (safe_open maps the file; nothing is read yet)."""

    def __init__(self, path: Path):
        self.path = path
        self._f: Any = None

    def _open(self) -> Any:
        if self._f is None:
            from safetensors import safe_open

            self._f = safe_open(str(self.path), framework="pt", device="cpu")
        return self._f

    def keys(self) -> list[str]:
        return list(self._open().keys())

    def info(self, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        sl = self._open().get_slice(key)
        return tuple(sl.get_shape()), _st_dtype(sl.get_dtype())

    def block(self, key: str, index: tuple[slice, ...]) -> torch.Tensor:
        # get_slice reads only the bytes of `index` (safetensors >= 0.8 even returns a zero-copy
        # view of the mapped file); the caller copies it into its own output at once.
        if not index:
            return self._open().get_tensor(key)
        return self._open().get_slice(key)[index]

    def close(self) -> None:
        self._f = None


class _TensorShard:
    """A torch .bin/.pt file (mmap'd, weights_only) or an in-memory dict: tensors indexed directly."""

    def __init__(self, path: Path | None = None, tensors: Mapping[str, torch.Tensor] | None = None):
        self.path = path
        self._t = tensors

    def _open(self) -> Mapping[str, torch.Tensor]:
        if self._t is None:
            assert self.path is not None  # a file shard (a dict shard has _t)
            self._t = _load_torch_file(self.path)
        return self._t

    def keys(self) -> list[str]:
        return list(self._open().keys())

    def tensor(self, key: str) -> torch.Tensor:
        return self._open()[key]

    def info(self, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        t = self._open()[key]
        return tuple(t.shape), t.dtype

    def block(self, key: str, index: tuple[slice, ...]) -> torch.Tensor:
        return self._open()[key][index]

    def close(self) -> None:
        if self.path is not None:  # a dict source belongs to the caller; keep it
            self._t = None


def _load_torch_file(path: Path) -> dict[str, torch.Tensor]:
    """Tensors of a torch.save file, memory-mapped so that only the bytes read are paged in."""
    try:
        obj = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except RuntimeError as e:
        if "mmap" not in str(e):
            raise
        # Legacy (pre-zipfile) torch.save format cannot be mapped; still weights_only, but whole.
        warnings.warn(
            f"{path} uses torch's legacy serialization, which cannot be memory-mapped: it is read "
            "whole into host memory; re-save it with torch.save (or as .safetensors) to stream it",
            stacklevel=3,
        )
        obj = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(obj, Mapping):
        for wrapper in ("state_dict", "model"):  # training checkpoints often nest the weights
            inner = obj.get(wrapper)
            if isinstance(inner, Mapping) and not any(
                isinstance(v, torch.Tensor) for v in obj.values()
            ):
                obj = inner
                break
        tensors = {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}
        if tensors:
            return tensors
    found = list(obj)[:8] if isinstance(obj, Mapping) else type(obj).__name__
    raise ValueError(
        f"{path} holds no tensors by name (found {found}); expected a state dict "
        "{name: tensor}, as written by torch.save(model.state_dict(), path)"
    )


def _shards_of_index(index: Path) -> dict[str, Any]:
    """{checkpoint key: shard} from an HF index json; each shard file is opened lazily."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (KeyError, json.JSONDecodeError) as e:
        raise ValueError(
            f"{index} is not an HF checkpoint index: expected JSON with a 'weight_map' "
            f"{{key: shard file}} ({type(e).__name__}: {e})"
        ) from e
    shards: dict[str, Any] = {}
    for name in sorted(set(weight_map.values())):
        path = index.parent / name
        if not path.is_file():
            raise FileNotFoundError(
                f"shard {name} listed in {index} is missing from {index.parent}; "
                "download the complete checkpoint (every file named in the index)"
            )
        is_st = name.endswith(".safetensors")
        shards[name] = _SafetensorsShard(path) if is_st else _TensorShard(path)
    return {key: shards[name] for key, name in weight_map.items()}


def _shards_of_files(files: list[Path]) -> dict[str, Any]:
    """{checkpoint key: shard} over several files; the same key in two files is an error."""
    out: dict[str, Any] = {}
    for path in files:
        shard = _SafetensorsShard(path) if path.suffix == ".safetensors" else _TensorShard(path)
        for key in shard.keys():
            if key in out:
                raise ValueError(
                    f"key {key!r} is in both {out[key].path.name} and {path.name} in {path.parent}; "
                    "expected each key in one file: add a model.safetensors.index.json, or "
                    "open the file you mean directly"
                )
            out[key] = shard
    return out


def _resolve(source: str | os.PathLike) -> dict[str, Any]:
    """{checkpoint key: shard} for a file or an HF-style folder."""
    path = Path(source)
    if path.is_file():
        if path.name.endswith(".index.json"):
            return _shards_of_index(path)
        if path.suffix == ".safetensors" or path.suffix in _TORCH_SUFFIXES:
            return _shards_of_files([path])
        raise ValueError(
            f"unsupported checkpoint file {path}: expected .safetensors, .bin, .pt/.pth or an "
            f"HF *.index.json (got suffix {path.suffix!r})"
        )
    if not path.is_dir():
        raise FileNotFoundError(_MISSING.format(path))
    for name in ("model.safetensors.index.json", "model.safetensors"):
        if (path / name).is_file():
            return _resolve(path / name)
    st_files = sorted(path.glob("*.safetensors"))
    st_index = sorted(path.glob("*.safetensors.index.json"))
    if len(st_index) == 1:
        return _shards_of_index(st_index[0])
    if st_files:
        return _shards_of_files(st_files)
    for name in ("pytorch_model.bin.index.json", "pytorch_model.bin"):
        if (path / name).is_file():
            return _resolve(path / name)
    found = sorted(p.name for p in path.iterdir())[:10]
    raise FileNotFoundError(_MISSING.format(path) + f" (the folder holds {found})")


def _as_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"dtype={dtype!r} is not a torch dtype; use e.g. torch.bfloat16")
    return value


def _check_request(
    key: str, shape: tuple[int, ...], dim: int | None, ranges: Any
) -> tuple[int | None, Ranges | None]:
    """Validate a slice request; returns (dim >= 0 or None, ranges as int pairs or None)."""
    if dim is None:
        if ranges is not None:
            raise ValueError(
                f"ranges={ranges} given with dim=None for {key!r}: pass the dim they cut "
                "(0 for output features, 1 for input features), or ranges=None for the whole tensor"
            )
        return None, None
    nd = len(shape)
    if not -nd <= dim < nd:
        raise ValueError(
            f"dim={dim} is out of range for {key!r} of shape {shape}: expected 0 <= dim < {nd}, "
            "or dim=None for the whole tensor"
        )
    dim %= nd
    if ranges is None:
        return dim, ((0, shape[dim]),)
    if len(ranges) == 2 and all(isinstance(r, int) for r in ranges):
        ranges = (tuple(ranges),)  # one bare (start, stop) pair
    try:
        pairs = tuple((int(a), int(b)) for a, b in ranges)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"ranges={ranges!r} for {key!r} is not a tuple of (start, stop) pairs; "
            "expected e.g. ((0, 512),) or ((0, 256), (1024, 1280))"
        ) from e
    size = shape[dim]
    for a, b in pairs:
        if not 0 <= a <= b <= size:
            raise ValueError(
                f"range ({a}, {b}) of ranges {pairs} along dim {dim} is out of bounds for {key!r} "
                f"of shape {shape}: expected 0 <= start <= stop <= {size}; check the plan's split "
                "of this parameter against the checkpoint's shape"
            )
    return dim, pairs


def _fill(
    block: Callable[[tuple[slice, ...]], torch.Tensor],
    shape: tuple[int, ...],
    src_dtype: torch.dtype,
    sel: Selection,
    out: torch.Tensor,
    chunk_bytes: int,
) -> None:
    """Copy the box `sel` (ranges per dim, concatenated in order) of a stored tensor into `out`.

    Reads whole-row chunks (dim 0) of at most `chunk_bytes` at the wider of the two dtypes, and in
    each only the wanted ranges of the other dims; casts per chunk in the copy. `out` may be a view.
    """
    if not shape:  # a 0-d tensor has no rows
        out.copy_(block(()))
        return
    if out.numel() == 0:
        return
    rest: list[list[tuple[slice, slice]]] = []  # per dim >= 1: (stored index, out index) pairs
    for n, ranges in zip(shape[1:], sel[1:], strict=True):
        if ranges == ((0, n),):
            rest.append([(slice(None), slice(None))])
            continue
        pairs, off = [], 0
        for a, b in ranges:
            pairs.append((slice(a, b), slice(off, off + b - a)))
            off += b - a
        rest.append(pairs)
    while len(rest) > 0 and rest[-1] == [(slice(None), slice(None))]:
        rest.pop()  # trailing whole dims: rows are read as stored
    row_bytes = math.prod(shape[1:]) * max(src_dtype.itemsize, out.dtype.itemsize)
    step = max(1, chunk_bytes // max(1, row_bytes))
    off = 0
    for a, b in sel[0]:
        for r0 in range(a, b, step):
            r1 = min(b, r0 + step)
            rows, dst_rows = slice(r0, r1), slice(off + r0 - a, off + r1 - a)
            for combo in itertools.product(*rest):
                src = (rows, *(c[0] for c in combo))
                dst = (dst_rows, *(c[1] for c in combo))
                out[dst].copy_(block(src))
        off += b - a


def _selection(shape: tuple[int, ...], dim: int | None, ranges: Ranges | None) -> Selection:
    """(dim, ranges) as a selection of every dim: the ranges on `dim`, whole elsewhere."""
    sel: list[Ranges] = [((0, n),) for n in shape]
    if dim is not None:
        assert ranges is not None  # a slice dim comes with its ranges (_check_request)
        sel[dim] = ranges
    return tuple(sel)


class CheckpointReader:
    """Read whole tensors or tensor-parallel slices of a checkpoint, under MODEL key names.

    Build one with `open_checkpoint`. `read` returns an owned, contiguous tensor for file sources;
    for a dict source, a view when no copy is needed (one range, same dtype and device).

    A model key may be *converted*: assembled from several stored tensors (transformers' per-expert
    MoE keys stacked and concatenated into one fused tensor; see `quantmesh.io.convert`), when the
    key_map returns a `Piece` for its stored keys. It reads like any other key, and a slice of it
    reads only the parts of the stored tensors that land in the slice. Pieces that do not assemble
    (an expert missing) are left out of `keys()`; `conversion_errors` says why, by model key.

    Example:
        >>> with open_checkpoint({"w": torch.arange(12.0).view(3, 4)}) as ckpt:
        ...     ckpt.shape("w"), ckpt.read("w", 1, ((0, 1), (3, 4))).tolist()
        ((3, 4), [[0.0, 3.0], [4.0, 7.0], [8.0, 11.0]])
    """

    def __init__(
        self,
        shards: dict[str, Any],
        source: str,
        key_map: KeyMap | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ):
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes={chunk_bytes} must be > 0; the default is 64 MiB")
        self.source = source
        self.chunk_bytes = chunk_bytes
        self._entries: dict[str, tuple[Any, str]] = {}  # model key -> (shard, checkpoint key)
        self._converted: dict[str, Node] = {}  # model key -> how its stored pieces assemble
        self._origin: dict[str, str] = {}  # model key -> a checkpoint key it comes from
        self._leaf_shards: dict[str, Any] = {}  # checkpoint key of a piece -> its shard
        self._renamed: dict[str, str | None] = {}  # checkpoint key -> model key, where they differ
        self.conversion_errors: dict[str, str] = {}
        """{model key: why its stored pieces do not assemble} (an expert missing, shapes)."""
        rename = (
            key_map if callable(key_map) else (lambda k: key_map.get(k, k)) if key_map else None
        )
        self.decoded: dict[str, str] = {}
        """{model key: stored format} of the keys read as their dequantized values
        (`quantmesh.io.encoded`): converted keys whose pieces bitsandbytes stored quantized, fp8
        weights with block scales, MXFP4 tensors."""
        order: list[str] = []  # model keys and converted targets, in checkpoint order
        pieces: dict[str, list[tuple[str, Piece, Leaf]]] = {}
        decoded, used = decode_stored(
            shards, lambda k: rename is not None and isinstance(rename(k), Piece)
        )
        listed: list[tuple[str, Any]] = []  # checkpoint keys (or decoded ones) and their shards
        made: set[str] = set()
        for ckey, shard in shards.items():
            if ckey in used:  # the statistics or scales of a weight read as values
                self._renamed[ckey] = None
                into = used[ckey]
                if into not in shards and into not in made:  # MXFP4's <t>, a key of its own
                    made.add(into)
                    listed.append((into, decoded[into]))
                continue
            listed.append((ckey, decoded.get(ckey, shard)))
        for ckey, shard in listed:
            mkey = rename(ckey) if rename else ckey
            if ckey in decoded and isinstance(mkey, str):
                self.decoded[mkey] = decoded[ckey].format
            if isinstance(mkey, Piece):
                self._renamed[ckey] = mkey.target
                shape, dtype = shard.info(ckey)
                self._leaf_shards[ckey] = shard
                if mkey.target not in pieces:
                    order.append(mkey.target)
                pieces.setdefault(mkey.target, []).append((ckey, mkey, Leaf(ckey, shape, dtype)))
                continue
            if mkey != ckey:
                self._renamed[ckey] = mkey
            if mkey is None:
                continue
            if mkey in self._entries:
                raise ValueError(
                    f"key_map maps both {self._entries[mkey][1]!r} and {ckey!r} to {mkey!r}; "
                    "expected one checkpoint key per model key: map one of them elsewhere or to None"
                )
            self._entries[mkey] = (shard, ckey)
            order.append(mkey)
        self._order: list[str] = []
        for name in order:
            if name not in pieces:
                self._order.append(name)
                continue
            try:
                nodes = assemble(name, pieces[name])
            except ConversionError as e:
                self.conversion_errors[name] = str(e)
                continue
            for mkey, node in nodes.items():
                if mkey in self._entries or mkey in self._converted:
                    first = self._entries[mkey][1] if mkey in self._entries else self._origin[mkey]
                    raise ValueError(
                        f"key_map maps both {first!r} and the converted {node.describe()} to "
                        f"{mkey!r}; expected one source per model key: map one of them to None"
                    )
                self._converted[mkey] = node
                self._origin[mkey] = pieces[name][0][0]
                formats = {
                    decoded[leaf.key].format for leaf in node.leaves() if leaf.key in decoded
                }
                if formats:
                    self.decoded[mkey] = "/".join(sorted(formats))
                self._order.append(mkey)
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"the checkpoint reader of {self.source} is closed; open it again")

    def _lookup(self, key: str) -> tuple[Any, str] | Node:
        self._check_open()
        found = self._entries.get(key) or self._converted.get(key)
        if found is not None:
            return found
        keys = list(self._order)
        close = difflib.get_close_matches(key, keys, n=5, cutoff=0.6)
        hint = f"close matches: {close}" if close else f"it has e.g. {keys[:3]}"
        if key in self.conversion_errors:
            hint = f"its stored pieces do not assemble: {self.conversion_errors[key]}"
        elif key in self._renamed:
            to = self._renamed[key]
            if key in self._leaf_shards:
                done = f"makes this checkpoint key a part of {to!r}"
            elif to is None:
                done = "drops this checkpoint key"
            else:
                done = f"renames this checkpoint key to {to!r}"
            hint = f"key_map {done}; {hint}"
        raise CheckpointKeyError(
            f"{key!r} is not a key of the checkpoint {self.source} ({len(keys)} keys); {hint}. "
            "Check the parameter name, or pass key_map= to open_checkpoint to rename checkpoint keys"
        )

    def keys(self) -> list[str]:
        """Model keys, in checkpoint order (a converted key where its first piece is).

        Example:
            >>> open_checkpoint({"a": torch.zeros(1)}).keys()
            ['a']
        """
        return list(self._order)

    def _info(self, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        found = self._lookup(key)
        if isinstance(found, Node):
            return tuple(found.shape), found.dtype
        shard, ckey = found
        return shard.info(ckey)

    def shape(self, key: str) -> tuple[int, ...]:
        """Full shape of the stored tensor `key`.

        Example:
            >>> open_checkpoint({"a": torch.zeros(2, 3)}).shape("a")
            (2, 3)
        """
        return self._info(key)[0]

    def dtype(self, key: str) -> torch.dtype:
        """Stored dtype of `key`.

        Example:
            >>> open_checkpoint({"a": torch.zeros(2, dtype=torch.float16)}).dtype("a")
            torch.float16
        """
        return self._info(key)[1]

    def nbytes(self, key: str) -> int:
        """Stored size of `key` in bytes (the whole tensor, not a slice).

        Example:
            >>> open_checkpoint({"a": torch.zeros(2, 3)}).nbytes("a")
            24
        """
        found = self._lookup(key)
        if isinstance(found, Node):
            return found.nbytes()
        shape, dtype = found[0].info(found[1])
        return math.prod(shape) * dtype.itemsize

    def sources(self, key: str) -> list[str]:
        """The checkpoint keys `key` is read from: one, or every piece of a converted key.

        Example:
            >>> open_checkpoint({"a": torch.zeros(1)}, key_map={"a": "b"}).sources("b")
            ['a']
        """
        found = self._lookup(key)
        if isinstance(found, Node):
            return [leaf.key for leaf in found.leaves()]
        return [found[1]]

    def _fill_piece(self, ckey: str, sel: Selection, out: torch.Tensor) -> None:
        shard = self._leaf_shards[ckey]
        shape, src_dtype = shard.info(ckey)
        _fill(lambda index: shard.block(ckey, index), shape, src_dtype, sel, out, self.chunk_bytes)

    def read(
        self,
        key: str,
        dim: int | None = None,
        ranges: Ranges | None = None,
        *,
        dtype: torch.dtype | str | None = None,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """Read `key`, or the concatenation of `ranges` of it along `dim`, as `dtype` on `device`.

        `ranges` are (start, stop) intervals of the full tensor; `ranges=None` with a dim means the
        whole extent. Defaults: the stored dtype; CPU for files, the tensor's device for dicts. A
        converted key is filled from the parts of its stored pieces that the slice holds.

        Example:
            >>> ckpt = open_checkpoint({"qkv": torch.arange(6.0)})
            >>> ckpt.read("qkv", 0, ((0, 1), (2, 3), (4, 5)), dtype=torch.float16)
            tensor([0., 2., 4.], dtype=torch.float16)
        """
        found = self._lookup(key)
        if isinstance(found, Node):
            dim, ranges = _check_request(key, found.shape, dim, ranges)
            sel = _selection(found.shape, dim, ranges)
            dev = torch.device(device) if device is not None else torch.device("cpu")
            out = torch.empty([_width(r) for r in sel], dtype=_as_dtype(dtype) or found.dtype,
                              device=dev)  # fmt: skip
            if out.numel():
                found.fill(out, sel, self._fill_piece)
            return out
        shard, ckey = found
        shape, src_dtype = shard.info(ckey)
        dim, ranges = _check_request(key, shape, dim, ranges)
        dtype = _as_dtype(dtype) or src_dtype
        if isinstance(shard, _TensorShard) and shard.path is None:  # in-memory dict
            t = shard.tensor(ckey)
            dev = torch.device(device) if device is not None else t.device
            same_dev = dev.type == t.device.type and dev.index in (None, t.device.index)
            if dtype == t.dtype and same_dev and (ranges is None or len(ranges) == 1):
                if ranges is None:
                    return t
                assert dim is not None  # ranges come with their dim (_check_request)
                return t.narrow(dim, ranges[0][0], ranges[0][1] - ranges[0][0])
        else:
            dev = torch.device(device) if device is not None else torch.device("cpu")
        sel = _selection(shape, dim, ranges)
        out = torch.empty([_width(r) for r in sel], dtype=dtype, device=dev)  # allocated once
        _fill(lambda index: shard.block(ckey, index), shape, src_dtype, sel, out, self.chunk_bytes)
        return out

    def close(self) -> None:
        """Release every opened shard (file mappings); later calls raise ValueError.

        Example:
            >>> ckpt = open_checkpoint({"a": torch.zeros(1)}); ckpt.close()
        """
        for shard, _ in self._entries.values():
            shard.close()
        for shard in self._leaf_shards.values():
            shard.close()
        self._closed = True

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __contains__(self, key: object) -> bool:
        return key in self._entries or key in self._converted

    def __iter__(self) -> Iterator[str]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def __repr__(self) -> str:
        return f"CheckpointReader({self.source}, {len(self._order)} keys)"


def _width(ranges: Ranges) -> int:
    return sum(b - a for a, b in ranges)


def open_checkpoint(
    source: str | os.PathLike | Mapping[str, torch.Tensor],
    *,
    key_map: KeyMap | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> CheckpointReader:
    """Open a checkpoint file, HF folder or dict of tensors for slice reads.

    `key_map` renames checkpoint keys to model keys: a dict {checkpoint key: model key} (keys not
    in it keep their name; a value of None drops the key) or a callable(checkpoint key) returning
    the model key or None to drop it, or a `quantmesh.io.convert.Piece` to make the stored tensor a
    part of a converted model key (`quantmesh.io.hf.hf_key_map` does so for transformers' per-expert
    MoE keys). `chunk_bytes` bounds one read step (default 64 MiB).

    Example:
        >>> ckpt = open_checkpoint("model_dir", key_map=lambda k: k.removeprefix("model."))  # doctest: +SKIP
        >>> ckpt.read("layers.0.mlp.down_proj.weight", 1, ((0, 5632),), device="cuda:0")  # doctest: +SKIP
    """
    if isinstance(source, Mapping):
        bad = [k for k, v in source.items() if not isinstance(v, torch.Tensor)][:5]
        if bad:
            raise TypeError(f"dict checkpoint values must be tensors; not so for keys {bad}")
        shard = _TensorShard(tensors=source)
        shards = dict.fromkeys(source, shard)
        name = f"<dict of {len(source)} tensors>"
    else:
        shards, name = _resolve(source), str(source)
    return CheckpointReader(shards, name, key_map, chunk_bytes)
