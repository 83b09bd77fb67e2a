"""Attention head geometry, and head-aware splits of feature dimensions.

A feature dimension is split by a pure function of its size and the head geometry in scope, so the
colwise layer that writes a dimension and the rowwise layer that reads it always agree: q (H*hd) and
o's input split on KV-group boundaries, k/v (K*hd) likewise, anything else in even blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .styles import FeatureSplit, balanced_counts, unit_split

__all__ = ["HeadInfo", "find_heads", "split_features"]

Q_ATTRS = ("num_heads", "num_attention_heads", "n_head", "n_heads", "head_count")
KV_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_kv_head")
HD_ATTRS = ("head_dim", "attention_head_size", "dim_per_head", "d_k", "head_size")
WIDTH_ATTRS = ("embed_dim", "hidden_size", "model_dim", "d_model", "n_embd")
SIZE_ATTRS = ("split_size", "all_head_size", "inner_dim")  # equal to H*hd; become local


@dataclass(frozen=True)
class HeadInfo:
    """Heads H, KV heads K and head size hd in scope of a module; `owner` holds the attributes."""

    heads: int
    kv_heads: int
    head_dim: int
    owner: str  # FQN of the module whose attributes describe the heads ("" = the model)
    from_config: bool  # True: read from a transformers config (attributes are not per-module)

    @property
    def q_size(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.kv_heads * self.head_dim


def _int_attr(obj, names) -> int | None:
    for n in names:
        v = getattr(obj, n, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def _heads_of(module: nn.Module, fqn: str) -> HeadInfo | None:
    h = _int_attr(module, Q_ATTRS)
    if h is not None:
        kv = _int_attr(module, KV_ATTRS) or h
        hd = _int_attr(module, HD_ATTRS)
        if hd is None:
            width = _int_attr(module, WIDTH_ATTRS)
            if width is None or width % h:
                return None
            hd = width // h
        return HeadInfo(h, kv, hd, fqn, False)
    cfg = getattr(module, "config", None)
    h = _int_attr(cfg, ("num_attention_heads",)) if cfg is not None else None
    if h is not None:
        kv = _int_attr(cfg, ("num_key_value_heads",)) or h
        hd = _int_attr(cfg, ("head_dim",))
        if hd is None:
            width = _int_attr(cfg, ("hidden_size",))
            if width is None or width % h:
                return None
            hd = width // h
        return HeadInfo(h, kv, hd, fqn, True)
    return None


def find_heads(model: nn.Module, fqn: str) -> HeadInfo | None:
    """The head geometry in scope of module `fqn`: its nearest ancestor describing heads."""
    parts = fqn.split(".") if fqn else []
    for i in range(len(parts) - 1, -1, -1):
        owner = ".".join(parts[:i])
        info = _heads_of(model.get_submodule(owner), owner)
        if info is not None:
            return info
    return None


def _even_unit(n: int, tp: int) -> int:
    """The largest block (<= 64) giving every rank the same share, else at least one block each."""
    for u in (64, 32, 16, 8, 4, 2, 1):
        if n % (u * tp) == 0:
            return u
    for u in (64, 32, 16, 8, 4, 2, 1):
        if n % u == 0 and n // u >= tp:
            return u
    return 1


def split_features(n: int, tp: int, heads: HeadInfo | None) -> tuple[FeatureSplit | None, str]:
    """How to split n features over tp ranks, and a note; (None, why) when it cannot be split.

    Example:
        >>> info = HeadInfo(9, 3, 64, "", True)
        >>> split_features(576, 2, info)[0].sizes()   # 9 heads, 3 KV groups: 2 + 1 groups
        [384, 192]
    """
    if (
        heads is not None
        and n in (heads.q_size, heads.kv_size)
        and heads.heads % heads.kv_heads == 0
    ):
        group_q = heads.heads // heads.kv_heads
        k = heads.kv_heads
        if k < tp:
            what = "KV heads" if k != heads.heads else "heads"
            return None, f"{k} {what} cannot be split over {tp} ranks"
        counts = balanced_counts(k, tp)
        unit = heads.head_dim * (group_q if n == heads.q_size else 1)
        if heads.q_size == heads.kv_size:
            unit = heads.head_dim
        note = "head-aligned" if k == heads.heads else "KV-group-aligned"
        if len(set(counts)) > 1:
            note += f" (uneven: {'+'.join(str(c) for c in counts)} groups)"
        return unit_split(n, unit, counts), note
    if n < tp:
        return None, f"{n} features cannot be split over {tp} ranks"
    u = _even_unit(n, tp)
    counts = balanced_counts(n // u, tp)
    return unit_split(n, u, counts), "even" if len(set(counts)) == 1 else "uneven"
