"""Sharding styles and how each one slices a tensor.

A style says which feature dimension of a module is split over the tp ranks:
  colwise         split output features; input replicated, output sharded
  colwise_gather  colwise, then the output is all-gathered (an LM head's logits)
  rowwise         split input features; input sharded, partial outputs summed over tp
  vocab           split an embedding's rows (token ids); lookups summed over tp
  replicate       every rank holds the whole module

A split is described in *feature space*: for each rank, a tuple of (start, stop) ranges of the full
feature dimension, concatenated in order. One range per rank for plain layers; several for packed
projections (GPT-2's c_attn = q|k|v: each segment split on head boundaries).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

__all__ = [
    "Style",
    "STYLES",
    "Ranges",
    "FeatureSplit",
    "balanced_counts",
    "unit_split",
    "segmented_split",
    "slice_dim",
]


class Style(str, enum.Enum):
    """A sharding style. A str, so that plans written as plain strings compare and hash equal.

    Example:
        >>> Style("rowwise") is Style.ROWWISE, Style.COLWISE_GATHER.is_colwise
        (True, True)
    """

    COLWISE = "colwise"
    COLWISE_GATHER = "colwise_gather"
    ROWWISE = "rowwise"
    VOCAB = "vocab"
    REPLICATE = "replicate"

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:  # messages quote styles as the user writes them: 'rowwise'
        return repr(self.value)

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @property
    def is_colwise(self) -> bool:
        """Output features split (the input is whole on every rank)."""
        return self in (Style.COLWISE, Style.COLWISE_GATHER)

    @property
    def splits_input(self) -> bool:
        """Input features split (rowwise: features; vocab: token ids)."""
        return self in (Style.ROWWISE, Style.VOCAB)


STYLES = tuple(s.value for s in Style)

# transformers' tp plan vocabulary -> ours (their names vary across versions)
HF_STYLE_ALIASES = {
    "colwise": "colwise",
    "local_colwise": "colwise",
    "colwise_rep": "colwise_gather",
    "colwise_gather_output": "colwise_gather",
    "packed_colwise": "colwise",
    "local_packed_colwise": "colwise",
    "rowwise": "rowwise",
    "local_rowwise": "rowwise",
    "rowwise_rep": "rowwise",
    "rowwise_split_input": "rowwise",
    "embedding_rowwise": "vocab",
    "vocab": "vocab",
    "replicate": "replicate",
    "replicated_with_grad_allreduce": "replicate",
    "sequence_parallel": "replicate",
    "gather": "replicate",
    "local": "replicate",
    "ep_router": "replicate",
    "moe_tp_experts": "replicate",
}

Ranges = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class FeatureSplit:
    """How one feature dimension of size `full` is divided: `per_rank[r]` are rank r's ranges."""

    full: int
    per_rank: tuple[Ranges, ...]

    def ranges(self, rank: int) -> Ranges:
        return self.per_rank[rank]

    def size(self, rank: int) -> int:
        return sum(b - a for a, b in self.per_rank[rank])

    def sizes(self) -> list[int]:
        return [self.size(r) for r in range(len(self.per_rank))]

    def contiguous(self) -> bool:
        """True when every rank holds one range and ranks follow each other in order."""
        pos = 0
        for rs in self.per_rank:
            if len(rs) != 1 or rs[0][0] != pos:
                return False
            pos = rs[0][1]
        return pos == self.full


def balanced_counts(n: int, parts: int) -> list[int]:
    """Split n units into `parts` counts differing by at most one, larger ones first.

    Example:
        >>> balanced_counts(3, 2)
        [2, 1]
    """
    base, extra = divmod(n, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def unit_split(full: int, unit: int, counts: list[int]) -> FeatureSplit:
    """Contiguous split of `full` features in blocks of `unit`; rank r gets counts[r] units.

    Example:
        >>> unit_split(576, 64, [5, 4]).per_rank
        (((0, 320),), ((320, 576),))
    """
    assert sum(counts) * unit == full, (full, unit, counts)
    out, pos = [], 0
    for c in counts:
        out.append(((pos, pos + c * unit),))
        pos += c * unit
    return FeatureSplit(full, tuple(out))


def segmented_split(segments: list[FeatureSplit]) -> FeatureSplit:
    """A packed dimension made of consecutive segments (q|k|v), each split on its own.

    Example:
        >>> s = unit_split(4, 2, [1, 1])
        >>> segmented_split([s, s]).per_rank
        (((0, 2), (4, 6)), ((2, 4), (6, 8)))
    """
    nranks = len(segments[0].per_rank)
    per_rank: list[list[tuple[int, int]]] = [[] for _ in range(nranks)]
    offset = 0
    for seg in segments:
        for r in range(nranks):
            per_rank[r].extend((a + offset, b + offset) for a, b in seg.per_rank[r])
        offset += seg.full
    return FeatureSplit(offset, tuple(tuple(x) for x in per_rank))


def slice_dim(t: torch.Tensor, dim: int, ranges: Ranges) -> torch.Tensor:
    """The concatenation of `t`'s ranges along `dim` (a view when there is one range).

    Example:
        >>> slice_dim(torch.arange(6), 0, ((0, 2), (4, 6))).tolist()
        [0, 1, 4, 5]
    """
    parts = [t.narrow(dim, a, b - a) for a, b in ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)
