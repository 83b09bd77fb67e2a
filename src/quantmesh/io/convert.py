"""Converted checkpoint keys: one model tensor assembled from several stored ones, read by slices.

transformers (5.x) stores mixture-of-experts weights one tensor per expert
(`mlp.experts.3.gate_proj.weight`) and fuses them when it loads, through the WeightConverter rules
of the model (`transformers.conversion_mapping`): stack the experts on a new dim, concatenate gate
and up, split a fused q|k|v, transpose, interleave. Those rules are rearrangements of elements, so
any slice of the fused tensor is a set of boxes of the stored ones. This module builds, for one
model key, a tree of such rearrangements over the stored tensors (a `Node`), whose `fill` writes a
requested slice by reading only the parts of the stored tensors that land in it: a rank that keeps
rows [a, b) of every expert's gate and up halves reads rows [a, b) of each expert's gate and up
tensors and nothing else; a rank that keeps experts [e0, e1) reads only their tensors. Nothing the
size of the whole fused tensor is ever allocated.

How a model key gets here: a key_map (see `quantmesh.io.reader.open_checkpoint`) returns a `Piece`
for each stored key that is part of a converted tensor (`quantmesh.io.hf.hf_key_map` does so for
transformers' rules); the reader groups the pieces of each target and calls `assemble`. An
operation that is not a rearrangement (dequantization, custom ops) is refused with its name, the key
and the fix, before anything is read.

Example:
    >>> stored = {"a": torch.arange(6.0).view(2, 3), "b": torch.arange(6.0, 12.0).view(2, 3)}
    >>> node = Stack([Leaf(k, (2, 3), torch.float32) for k in stored], 0)  # shape (2, 2, 3)
    >>> def leaf(key, sel, out):  # one stored box: a single range per dim here
    ...     out.copy_(stored[key][tuple(slice(*r[0]) for r in sel)])
    >>> out = torch.empty(2, 1, 3)
    >>> node.fill(out, (((0, 2),), ((1, 2),), ((0, 3),)), leaf)  # row 1 of both: reads 2 rows
    >>> out.flatten().tolist()
    [3.0, 4.0, 5.0, 9.0, 10.0, 11.0]
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import QuantmeshError

__all__ = [
    "Cat",
    "ConversionError",
    "Leaf",
    "Narrow",
    "Node",
    "Permute",
    "Piece",
    "Stack",
    "Transpose",
    "assemble",
    "full_selection",
]

Ranges = tuple[tuple[int, int], ...]
Selection = tuple[Ranges, ...]  # one tuple of (start, stop) ranges per dim, concatenated in order
LeafFill = Callable[[str, Selection, torch.Tensor], None]  # (stored key, selection, out view)


class ConversionError(QuantmeshError, ValueError):
    """Stored pieces that do not assemble into the model tensor (an expert missing, shapes that
    do not line up); the message names the keys."""


def full_selection(shape: tuple[int, ...]) -> Selection:
    """The selection of a whole tensor.

    Example:
        >>> full_selection((2, 3))
        (((0, 2),), ((0, 3),))
    """
    return tuple(((0, n),) for n in shape)


def _size(ranges: Ranges) -> int:
    return sum(b - a for a, b in ranges)


def _runs(indices: list[int]) -> Ranges:
    """Maximal runs of consecutive indices, in order: [4, 5, 6, 0, 1] -> ((4, 7), (0, 2))."""
    out: list[tuple[int, int]] = []
    for i in indices:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return tuple(out)


class Node:
    """A model tensor (or part of one) as a rearrangement of stored tensors.

    `shape` is its full shape, `dtype` the stored dtype (promoted over its leaves). `fill(out, sel,
    leaf)` writes the selection `sel` (one tuple of ranges per dim, concatenated in order) into
    `out`, whose shape is the selection's size, calling `leaf(key, selection, out_view)` for every
    stored box it needs and for nothing else.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype

    def fill(self, out: torch.Tensor, sel: Selection, leaf: LeafFill) -> None:
        raise NotImplementedError

    def leaves(self) -> Iterator[Leaf]:
        raise NotImplementedError

    def nbytes(self) -> int:
        """Stored bytes of every leaf (the whole tensor)."""
        return sum(math.prod(x.shape) * x.dtype.itemsize for x in self.leaves())

    def describe(self) -> str:
        """The stored keys it is made of, for messages."""
        raise NotImplementedError


@dataclass
class Leaf(Node):
    """One stored tensor, by its checkpoint key.

    Example:
        >>> Leaf("w", (2, 3), torch.float16).describe()
        'w'
    """

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def fill(self, out: torch.Tensor, sel: Selection, leaf: LeafFill) -> None:
        leaf(self.key, sel, out)

    def leaves(self) -> Iterator[Leaf]:
        yield self

    def describe(self) -> str:
        return self.key


def _check_same(what: str, children: list[Node], skip: int | None) -> None:
    def rest(s: tuple[int, ...]) -> tuple[int, ...]:
        return s if skip is None else s[:skip] + s[skip + 1 :]

    shapes = {rest(c.shape) for c in children}
    if len(shapes) > 1 or not children:
        listing = ", ".join(f"{c.describe()} {tuple(c.shape)}" for c in children[:8])
        raise ConversionError(
            f"{what} of tensors whose shapes do not line up: {listing or 'no tensors'}"
        )


class Stack(Node):
    """`torch.stack(children, dim)`: a new dim indexed by child (transformers' MergeModulelist).

    Example:
        >>> Stack([Leaf("a", (2, 3), torch.float32)] * 4, 0).shape
        (4, 2, 3)
    """

    def __init__(self, children: list[Node], dim: int):
        _check_same("stacking", children, None)
        self.children, self.dim = children, dim
        s = children[0].shape
        if not 0 <= dim <= len(s):
            raise ConversionError(f"stacking on dim {dim} of tensors of {len(s)} dims")
        self.shape = s[:dim] + (len(children),) + s[dim:]
        self.dtype = _promote(children)

    def fill(self, out: torch.Tensor, sel: Selection, leaf: LeafFill) -> None:
        rest = sel[: self.dim] + sel[self.dim + 1 :]
        pos = 0
        for a, b in sel[self.dim]:
            for i in range(a, b):
                self.children[i].fill(out.select(self.dim, pos), rest, leaf)
                pos += 1

    def leaves(self) -> Iterator[Leaf]:
        for c in self.children:
            yield from c.leaves()

    def describe(self) -> str:
        return f"stack({self.children[0].describe()}, ... {len(self.children)} tensors)"


class Cat(Node):
    """`torch.cat(children, dim)` (transformers' Concatenate).

    Example:
        >>> Cat([Leaf("g", (2, 3), torch.float32), Leaf("u", (2, 3), torch.float32)], 0).shape
        (4, 3)
    """

    def __init__(self, children: list[Node], dim: int):
        _check_same(f"concatenation on dim {dim}", children, dim)
        self.children, self.dim = children, dim
        s = list(children[0].shape)
        s[dim] = sum(c.shape[dim] for c in children)
        self.shape = tuple(s)
        self.dtype = _promote(children)

    def fill(self, out: torch.Tensor, sel: Selection, leaf: LeafFill) -> None:
        d, pos = self.dim, 0
        for a, b in sel[d]:
            off = 0
            for c in self.children:
                n = c.shape[d]
                lo, hi = max(a, off), min(b, off + n)
                if lo < hi:
                    part = sel[:d] + (((lo - off, hi - off),),) + sel[d + 1 :]
                    c.fill(out.narrow(d, pos, hi - lo), part, leaf)
                    pos += hi - lo
                off += n

    def leaves(self) -> Iterator[Leaf]:
        for c in self.children:
            yield from c.leaves()

    def describe(self) -> str:
        return f"cat({', '.join(c.describe() for c in self.children)})"


class Narrow(Node):
    """`child.narrow(dim, start, length)`: one part of a stored tensor (transformers' Chunk, Split).

    Example:
        >>> Narrow(Leaf("qkv", (12, 4), torch.float32), 0, 4, 4).shape
        (4, 4)
    """

    def __init__(self, child: Node, dim: int, start: int, length: int):
        if not 0 <= start <= start + length <= child.shape[dim]:
            raise ConversionError(
                f"part [{start}, {start + length}) of dim {dim} of {child.describe()} "
                f"{tuple(child.shape)} is out of bounds"
            )
        self.child, self.dim, self.start = child, dim, start
        s = list(child.shape)
        s[dim] = length
        self.shape, self.dtype = tuple(s), child.dtype

    def fill(self, out: torch.Tensor, sel: Selection, leaf: LeafFill) -> None:
        moved = tuple((a + self.start, b + self.start) for a, b in sel[self.dim])
        self.child.fill(out, sel[: self.dim] + (moved,) + sel[self.dim + 1 :], leaf)

    def leaves(self) -> Iterator[Leaf]:
        yield from self.child.leaves()

    def describe(self) -> str:
        n = self.shape[self.dim]
        return f"{self.child.describe()}[dim {self.dim}: {self.start}:{self.start + n}]"


class Transpose(Node):
    """`child.transpose(dim0, dim1)` (transformers' Transpose).

    Example:
        >>> Transpose(Leaf("w", (2, 3, 5), torch.float32), 1, 2).shape
        (2, 5, 3)
    """

    def __init__(self, child: Node, dim0: int, dim1: int):
        nd = len(child.shape)
        self.child, self.dim0, self.dim1 = child, dim0 % nd, dim1 % nd
        s = list(child.shape)
        s[self.dim0], s[self.dim1] = s[self.dim1], s[self.dim0]
        self.shape, self.dtype = tuple(s), child.dtype

    def fill(self, out: torch.Tensor, sel: Selection, leaf: LeafFill) -> None:
        s = list(sel)
        s[self.dim0], s[self.dim1] = s[self.dim1], s[self.dim0]
        self.child.fill(out.transpose(self.dim0, self.dim1), tuple(s), leaf)

    def leaves(self) -> Iterator[Leaf]:
        yield from self.child.leaves()

    def describe(self) -> str:
        return f"{self.child.describe()}.transpose({self.dim0}, {self.dim1})"


class Permute(Node):
    """Indices reordered along one dim: out[i] = child[index[i]] (transformers' Interleave).

    A slice reads the stored indices it maps to, grouped into runs of consecutive ones.

    Example:
        >>> Permute(Leaf("w", (4, 2), torch.float32), 0, [0, 2, 1, 3]).shape
        (4, 2)
    """

    def __init__(self, child: Node, dim: int, index: list[int]):
        if sorted(index) != list(range(child.shape[dim])):
            raise ConversionError(f"a reordering of dim {dim} of {child.describe()} is not one")
        self.child, self.dim, self.index = child, dim, index
        self.shape, self.dtype = child.shape, child.dtype

    def fill(self, out: torch.Tensor, sel: Selection, leaf: LeafFill) -> None:
        idx = [self.index[i] for a, b in sel[self.dim] for i in range(a, b)]
        self.child.fill(out, sel[: self.dim] + (_runs(idx),) + sel[self.dim + 1 :], leaf)

    def leaves(self) -> Iterator[Leaf]:
        yield from self.child.leaves()

    def describe(self) -> str:
        return f"{self.child.describe()} reordered on dim {self.dim}"


def _promote(children: list[Node]) -> torch.dtype:
    dt = children[0].dtype
    for c in children[1:]:
        dt = torch.promote_types(dt, c.dtype)
    return dt


# ---- transformers' WeightConverter rules --------------------------------------------------------
@dataclass(frozen=True)
class Piece:
    """A stored key that is one part of a converted model tensor: what a key_map returns for it.

    `target` is the model key the conversion produces (the first one, for a conversion that
    splits a tensor into several); `pattern` is the source pattern of `converter` the key matched;
    `shapes` maps model keys to their full shapes (checkpoint layout), for conversions that need
    them (Split, Transpose(check_dims=True)) and for naming what is missing.

    Example:
        >>> key_map = qm.hf_key_map(model)                     # doctest: +SKIP
        >>> key_map("model.layers.0.mlp.experts.3.up_proj.weight").target  # doctest: +SKIP
        'model.layers.0.mlp.experts.gate_up_proj'
    """

    target: str
    pattern: str
    source_key: str  # the stored key after transformers' renamings (where `pattern` matched)
    converter: Any = field(compare=False)  # a transformers WeightConverter (untyped library)
    config: Any = field(default=None, compare=False)  # the model's config (Chunk by attribute)
    shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict, compare=False)


# transformers ops that are rearrangements, by class name -> what they become here
_SUPPORTED = ("MergeModulelist", "Concatenate", "Chunk", "Split", "Transpose", "Interleave")


def check_converter(converter: Any, key: str, model_name: str) -> None:
    """Raise NotImplementedError when `converter` holds an operation that cannot be read by slices.

    Example:
        >>> check_converter(converter, "model.layers.0.mlp.experts.0.up_proj.weight", "M")  # doctest: +SKIP
    """
    for op in getattr(converter, "operations", []):
        if type(op).__name__ not in _SUPPORTED or not type(op).__module__.startswith(
            "transformers."
        ):
            raise NotImplementedError(
                f"checkpoint key {key!r} needs transformers' conversion {type(op).__name__} "
                f"({converter.source_patterns} -> {converter.target_patterns}) for {model_name}; "
                f"quantmesh streams only the conversions that rearrange elements "
                f"({', '.join(_SUPPORTED)}), since each rank reads its slice of the stored "
                "tensors. Fix: convert the checkpoint once to the model's own layout (load it with "
                "transformers' from_pretrained and write model.state_dict() with "
                "safetensors.torch.save_file; save_pretrained would write the original layout "
                "back), or pass key_map= yourself"
            )


def _natural(key: str) -> tuple:
    """Sort key of a dotted name with numbers compared as numbers (experts.10 after experts.9)."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in key.split("."))


def _star_rx(pattern: str) -> re.Pattern[str]:
    return re.compile(re.escape(pattern.lstrip("^")).replace(r"\*", r"(\d+)"))


def _star_indices(pattern: str, keys: list[str]) -> list[int] | None:
    """The integers the pattern's `*` matched in each key, or None when they are not integers."""
    rx, out = _star_rx(pattern), []
    for k in keys:
        m = rx.search(k)
        if m is None or m.lastindex != 1:
            return None
        out.append(int(m.group(1)))
    return out


def _with_index(pattern: str, key: str, i: int) -> str:
    """`key` with the number the pattern's `*` matched replaced by `i`."""
    m = _star_rx(pattern).search(key)
    assert m is not None  # _star_indices matched it
    return f"{key[: m.start(1)]}{i}{key[m.end(1) :]}"


def assemble(target: str, pieces: list[tuple[str, Piece, Leaf]]) -> dict[str, Node]:
    """{model key: Node} built from the stored pieces of one converted `target`.

    `pieces` are (stored key, Piece, Leaf) of every stored key whose Piece names `target`.
    Raises ConversionError naming the keys when the pieces do not assemble (an expert missing,
    shapes that do not line up), NotImplementedError for an operation that is not a rearrangement.

    Example:
        >>> assemble("m.experts.down_proj", pieces)  # doctest: +SKIP
        {'m.experts.down_proj': <Stack>}
    """
    first = pieces[0][1]
    conv = first.converter
    sources: list[str] = list(conv.source_patterns)
    targets: list[str] = list(conv.target_patterns)
    by_pattern: dict[str, list[tuple[str, str, Leaf]]] = {}  # (renamed key, stored key, leaf)
    for ckey, piece, leaf in sorted(pieces, key=lambda p: _natural(p[1].source_key)):
        by_pattern.setdefault(piece.pattern, []).append((piece.source_key, ckey, leaf))
    numbers = {  # the expert numbers the `*` of each pattern matched, where they are numbers
        p: idx
        for p, items in by_pattern.items()
        if "*" in p and (idx := _star_indices(p, [k for k, _, _ in items])) is not None
    }
    every = set().union(*numbers.values()) if numbers else set()
    every |= set(range(max(every) + 1)) if every else set()
    absent: list[str] = []
    for p, idx in numbers.items():
        _, ckey, _ = by_pattern[p][0]
        named = ckey if _star_rx(p).search(ckey) else by_pattern[p][0][0]  # stored name if it can
        absent += [_with_index(p, named, i) for i in sorted(every - set(idx))]
    if absent:
        raise ConversionError(
            f"stacked from one stored tensor per expert (numbered 0 to {max(every)}), of which "
            f"{len(absent)} are absent: {', '.join(absent[:6])}{' ...' if len(absent) > 6 else ''}"
        )
    state: dict[str, Node | list[Node]] = {
        p: [leaf for _, _, leaf in by_pattern[p]] for p in sources if p in by_pattern
    }
    missing = [p for p in sources if p not in by_pattern]
    if missing:
        have = ", ".join(f"{p!r}" for p in by_pattern)
        raise ConversionError(
            f"{target} is built from stored keys matching {sources}; none match {missing} "
            f"(found keys for {have})"
        )

    def full(t: str) -> str:  # the model key of target pattern t
        return target.replace(targets[0], t, 1) if targets[0] in target else target

    def one(op: Any) -> tuple[str, Node]:
        if len(state) != 1:
            raise ConversionError(
                f"{target}: {type(op).__name__} takes one tensor, got {len(state)} ({list(state)})"
            )
        name, v = next(iter(state.items()))
        if isinstance(v, list):
            if len(v) != 1:
                raise ConversionError(
                    f"{target}: {type(op).__name__} takes one tensor, got {len(v)} stored keys "
                    f"matching {name!r}"
                )
            v = v[0]
        return name, v

    finals = set(targets)
    for op in conv.operations:
        kind = type(op).__name__
        if kind == "MergeModulelist":
            n_in = len(state)
            new: dict[str, Node | list[Node]] = {}
            for name, v in state.items():
                out_name = targets[0] if n_in == 1 and len(targets) == 1 else name
                new[out_name] = Stack(v, op.dim) if isinstance(v, list) else v
            state = new
        elif kind == "Concatenate":
            parts: list[Node] = []
            for p in [*sources, *[k for k in state if k not in sources]]:
                if p in state:
                    v = state.pop(p)
                    parts.extend(v if isinstance(v, list) else [v])
            state = {targets[0]: parts[0] if len(parts) == 1 else Cat(parts, op.dim)}
        elif kind in ("Chunk", "Split"):
            _, v = one(op)
            d = op.dim % len(v.shape)
            outs = targets
            attr = getattr(op, "num_shards_attribute", None)
            if kind == "Chunk" and attr is not None:
                cfg = first.config.get_text_config() if first.config is not None else None
                if cfg is None or not hasattr(cfg, attr):
                    raise ConversionError(f"{target}: Chunk needs config.{attr}, which is absent")
                outs = [targets[0].replace("*", str(i)) for i in range(getattr(cfg, attr))]
                finals.update(outs)
            if kind == "Chunk":
                size = -(-v.shape[d] // len(outs))  # torch.chunk's chunk size
                sizes = [max(0, min(size, v.shape[d] - i * size)) for i in range(len(outs))]
            else:
                shapes = first.shapes
                unknown = [full(t) for t in outs if full(t) not in shapes]
                if unknown:
                    raise ConversionError(
                        f"{target}: Split sizes its parts like the model's {unknown}, which the "
                        "model does not have"
                    )
                sizes = [shapes[full(t)][d] for t in outs]
            if sum(sizes) != v.shape[d]:
                raise ConversionError(
                    f"{target}: {kind} of {v.describe()} {tuple(v.shape)} on dim {d} into parts "
                    f"of {sizes}, which do not add up"
                )
            state, start = {}, 0
            for t, n in zip(outs, sizes, strict=True):
                if n:
                    state[t] = Narrow(v, d, start, n)
                start += n
        elif kind == "Transpose":
            name, v = one(op)
            want = first.shapes.get(full(targets[0])) if len(targets) == 1 else None
            if op.check_dims and want is not None and tuple(v.shape) == tuple(want):
                state = {name: v}  # transformers transposes only a tensor not already shaped
            else:
                state = {name: Transpose(v, op.dim0, op.dim1)}
        elif kind == "Interleave":
            name, v = one(op)
            d = op.dim % len(v.shape)
            n = v.shape[d]
            h = n // 2
            if n % 2:
                raise ConversionError(f"{target}: Interleave of an odd size {n} on dim {d}")
            if op.inverse:  # (2, h) -> (h, 2): out[2i + j] = in[j*h + i]
                index = [j * h + i for i in range(h) for j in range(2)]
            else:  # (h, 2) -> (2, h): out[j*h + i] = in[2i + j]
                index = [2 * i + j for j in range(2) for i in range(h)]
            state = {name: Permute(v, d, index)}
        else:  # check_converter refused it already; a guard for a converter built by hand
            raise NotImplementedError(f"{target}: transformers' {kind} is not a rearrangement")

    out: dict[str, Node] = {}
    for name, v in state.items():
        if isinstance(v, list):
            if len(v) != 1:
                raise ConversionError(
                    f"{target}: the conversion leaves {len(v)} tensors under {name!r}; expected one"
                )
            v = v[0]
        final = name if name in finals else None
        if final is None and len(state) == 1 and len(targets) == 1:
            final = targets[0]
        if final is None:
            raise ConversionError(
                f"{target}: the conversion ends on {name!r}, not one of its targets {targets}"
            )
        out[full(final)] = v
    return out
