"""A plan is data: {module FQN or glob: style}. Resolving it against a model gives one entry per module.

Resolution validates everything before any allocation or collective: unknown names, styles that do not
fit a module, dimensions that cannot be split, tied weights split differently. Every replicated module
of interest carries the reason, and `str(plan)` prints the table.
"""

from __future__ import annotations

import fnmatch
import inspect
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..errors import QuantmeshError
from ..tp.kinds import Kind, kind_of
from .heads import KV_ATTRS, Q_ATTRS, SIZE_ATTRS, HeadInfo, find_heads, split_features
from .styles import (
    HF_STYLE_ALIASES,
    STYLES,
    FeatureSplit,
    Ranges,
    Style,
    balanced_counts,
    unit_split,
)

__all__ = ["Plan", "PlanError", "Entry", "Resolved", "size_candidates"]


class PlanError(QuantmeshError, ValueError):
    """A plan that does not fit the model; the message names the module, the shapes and the fix."""


@dataclass
class Entry:
    """The resolved decision for one module."""

    fqn: str
    type_name: str
    style: Style
    split: FeatureSplit | None
    reason: str
    kind: Kind | None = None
    heads: HeadInfo | None = None
    requested: Style | None = None  # the plan's style, before any downgrade to replicate
    contiguous: bool = False  # a fused output the model's own plan splits in plain blocks

    def local_shape(self, module: nn.Module, rank: int) -> tuple[int, ...]:
        """Shape of rank's local weight (in the module's own layout)."""
        w = getattr(module, "weight", None)
        if w is None:
            return ()
        shape = list(w.shape)
        if self.split is not None and self.kind is not None:
            dim = self.kind.w_out_dim if self.style.is_colwise else self.kind.w_in_dim
            shape[dim] = self.split.size(rank)
        return tuple(shape)


@dataclass
class Resolved:
    """A plan resolved against one model and tp size."""

    tp: int
    entries: dict[str, Entry]  # sharded or otherwise notable modules, in model order
    attr_updates: dict[str, dict[str, list[int]]] = field(
        default_factory=dict
    )  # owner -> attr -> per rank
    head_views: dict[str, dict[str, list[tuple[int, int]]]] = field(default_factory=dict)
    """owner -> parameter -> per rank (first head, end): a per-head parameter of an attention whose
    heads the plan splits (gpt-oss's sinks), kept whole and read through this rank's heads."""
    split_norms: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    """norm -> per rank (first feature, end): an RMS norm over the features a split layer writes
    (OLMoE's q_norm over all heads), its weight read at this rank's features and its statistic
    summed over tp."""

    def sharded(self) -> list[Entry]:
        return [e for e in self.entries.values() if e.split is not None]


def _canon(style: str, where: str) -> Style:
    s = HF_STYLE_ALIASES.get(style, style)
    if s not in STYLES:
        raise PlanError(f"unknown style {style!r} for {where}; use one of {', '.join(STYLES)}")
    return Style(s)


class Plan:
    """Module FQNs or globs mapped to styles; later rules (overrides) win over earlier ones.

    Example:
        >>> plan = qm.auto_plan(model, tp=2)                                  # doctest: +SKIP
        >>> plan = plan.override({"blocks.*.attn.proj": "rowwise", "head": "replicate"})  # doctest: +SKIP
        >>> print(plan)                                                       # doctest: +SKIP
    """

    def __init__(
        self,
        rules: Mapping[str, str] | None = None,
        *,
        notes: dict[str, str] | None = None,
        model: nn.Module | None = None,
        tp: int | None = None,
        user_rules: tuple[str, ...] = (),
        contiguous: tuple[str, ...] = (),
        probed: bool = False,
        attrs: Mapping[str, Mapping[str, int]] | None = None,
    ):
        self.rules = {k: _canon(v, k) for k, v in (rules or {}).items()}
        # rules whose fused outputs are laid out per head (the model's own plan says plain
        # "colwise", not "packed_colwise"): split in contiguous blocks, never as q|k|v segments
        self.contiguous = tuple(contiguous)
        # verify_plan runs this plan on a probe: a weight that a parent's forward source mentions
        # (read in some branch, or not at all at run time) need not be replicated on suspicion
        self.probed = probed
        # integer attributes found by value that hold a global size ({owner glob: {name: value}}):
        # set per rank in proportion to the owner's split layers (verify_plan confirms each)
        self.attrs = {g: dict(a) for g, a in (attrs or {}).items()}
        self.notes = dict(notes or {})  # fqn/glob -> why the planner chose it
        self.user_rules = (
            tuple(user_rules) if user_rules else tuple(self.rules) if model is None else ()
        )
        self._model, self._tp = model, tp

    def override(self, rules: dict[str, str], *, notes: dict[str, str] | None = None) -> Plan:
        """A new plan where `rules` take precedence (user overrides must match some module);
        `notes` say why (shown in the table; default "override").

        An override glob also replaces the earlier exact names it matches (the auto planner's
        rules are exact names), so `{"blocks.*.mlp.fc": "replicate"}` wins over "blocks.0.mlp.fc".
        """

        def replaced(k: str) -> bool:
            return k in rules or any(
                any(c in pat for c in "*?[") and fnmatch.fnmatchcase(k, pat) for pat in rules
            )

        merged: dict[str, str] = {k: v for k, v in self.rules.items() if not replaced(k)}
        merged.update(rules)
        why = notes
        notes = {k: v for k, v in self.notes.items() if not replaced(k)}
        notes.update({k: (why or {}).get(k, "override") for k in rules})
        return self._with(rules=merged, notes=notes, user_rules=self.user_rules + tuple(rules))

    def with_contiguous(self, globs: list[str] | tuple[str, ...]) -> Plan:
        """The same plan, with the fused outputs of modules matching `globs` split in contiguous
        blocks (laid out per head or per KV group) instead of as q|k|v segments."""
        return self._with(contiguous=self.contiguous + tuple(globs))

    def with_attrs(self, attrs: Mapping[str, Mapping[str, int]]) -> Plan:
        """The same plan, with integer attributes that hold a global size set per rank:
        `{owner glob: {attribute: global value}}`; each owner whose attribute holds that value gets
        it scaled like the owner's split layers (a head count 4 -> 2 + 2, a width 64 -> 32 + 32).

        Example:
            >>> plan = plan.with_attrs({"blocks.*.attn": {"n_head": 4}})   # doctest: +SKIP
        """
        merged = {g: dict(a) for g, a in self.attrs.items()}
        for g, a in attrs.items():
            merged.setdefault(g, {}).update(a)
        return self._with(attrs=merged)

    def to_probe(self) -> Plan:
        """The same plan, resolved for verify_plan's probe: direct weight reads found in source
        are left to the probe instead of replicated on suspicion."""
        return self._with(probed=True)

    def _with(self, **changes: Any) -> Plan:
        """A copy of this plan with `changes` (the constructor's keywords) applied."""
        kw: dict[str, Any] = dict(
            rules=self.rules,
            notes=self.notes,
            model=self._model,
            tp=self._tp,
            user_rules=self.user_rules,
            contiguous=self.contiguous,
            probed=self.probed,
            attrs=self.attrs,
        )
        kw.update(changes)
        return Plan(kw.pop("rules"), **kw)

    def __iter__(self) -> Iterator[tuple[str, Style]]:
        return iter(self.rules.items())

    def __len__(self) -> int:
        return len(self.rules)

    def style_for(self, fqn: str) -> tuple[Style, str] | None:
        """(style, rule) of the last rule that matches `fqn`; an exact name beats a glob."""
        if fqn in self.rules:
            return self.rules[fqn], fqn
        hit = None
        for pat, style in self.rules.items():
            if any(c in pat for c in "*?[") and fnmatch.fnmatchcase(fqn, pat):
                hit = (style, pat)
        return hit

    # ------------------------------------------------------------------------------------------
    def resolve(self, model: nn.Module, tp: int) -> Resolved:
        """Validate against `model` and decide every module's split for `tp` ranks."""
        modules = dict(model.named_modules())
        for pat in self.user_rules:
            if pat in modules or (
                any(c in pat for c in "*?[") and any(fnmatch.fnmatchcase(n, pat) for n in modules)
            ):
                continue
            close = [n for n in modules if n.endswith(pat.rsplit(".", 1)[-1])][:5]
            hint = f"; modules with that last name: {', '.join(close)}" if close else ""
            raise PlanError(f"plan rule {pat!r} matches no module of {type(model).__name__}{hint}")
        entries: dict[str, Entry] = {}
        for fqn, mod in modules.items():
            hit = self.style_for(fqn) if fqn else None
            if hit is None:
                continue
            style, rule = hit
            entries[fqn] = self._resolve_one(model, fqn, mod, style, rule, tp)
            if any(g == rule or fnmatch.fnmatchcase(fqn, g) for g in self.contiguous):
                _per_group(entries[fqn], mod, tp)
        _segment_packed(model, entries, tp)
        if not self.probed:
            _check_direct_use(model, entries)
        _check_partners(model, entries)
        _split_head_tables(model, entries, tp)
        _check_ties(model, entries)
        updates = _attr_updates(model, entries, tp)
        for glob, attrs in self.attrs.items():
            for owner, per_rank in _value_updates(model, entries, tp, glob, attrs).items():
                updates.setdefault(owner, {}).update(per_rank)
        views = _head_views(model, entries, tp)
        return Resolved(tp, entries, updates, views, _split_norms(model, entries, tp))

    def _resolve_one(
        self, model: nn.Module, fqn: str, mod: nn.Module, style: Style, rule: str, tp: int
    ) -> Entry:
        kind = kind_of(mod)
        note = self.notes.get(rule, self.notes.get(fqn, ""))
        tname = type(mod).__name__
        if style == Style.REPLICATE:
            return Entry(
                fqn, tname, Style.REPLICATE, None, note or "replicated: by plan", kind, None, style
            )
        if kind is None:
            raise PlanError(
                f"style {style!r} does not fit {fqn} ({tname}): quantmesh splits Linear, "
                f"transformers Conv1D, Embedding and Conv2d (groups=1); use 'replicate' for it"
            )
        if style == Style.VOCAB and kind.name != "Embedding":
            raise PlanError(
                f"style 'vocab' needs an Embedding, but {fqn} is a {tname}; "
                f"use 'colwise' or 'rowwise'"
            )
        if style != Style.VOCAB and kind.name == "Embedding":
            raise PlanError(f"{fqn} is an Embedding; use 'vocab' (split its rows) or 'replicate'")
        in_f, out_f = kind.in_out(mod)
        n = out_f if style.is_colwise else in_f
        heads = find_heads(model, fqn) if style in (Style.COLWISE, Style.ROWWISE) else None
        if tp == 1:
            return Entry(fqn, tname, style, None, "tp=1", kind, heads, style)
        split, how = split_features(n, tp, heads)
        if split is None:
            return Entry(
                fqn, tname, Style.REPLICATE, None, f"replicated: {how}", kind, heads, style
            )
        why = f"{note + ', ' if note else ''}{how}"
        return Entry(fqn, tname, style, split, why, kind, heads, style)

    # ------------------------------------------------------------------------------------------
    def table(
        self,
        model: nn.Module | None = None,
        tp: int | None = None,
        extra: list[tuple[str, str, str, str, str]] | None = None,
    ) -> str:
        """The plan as a table: module, type, style, local weight shape per rank, and why.
        `extra`: rows of modules split outside the plan, (fqn, type, style, shapes, why), listed
        after the plan's own (repeated blocks once, as theirs): the experts modules
        (`quantmesh.tp.experts.expert_rows`)."""
        model = model if model is not None else self._model
        tp = tp if tp is not None else self._tp
        if model is None or tp is None:
            return "\n".join(f"{k}: {v}" for k, v in self.rules.items())
        res = self.resolve(model, tp)
        rows: list[tuple[str, ...]] = [("module", "type", "style", "local weight per rank", "why")]
        for e in _collapse(res, model):
            rows.append(e)
        rows += _collapse_rows(
            [(_globify(f, model), t, st, sh, why) for f, t, st, sh, why in extra or []]
        )
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = [
            "  ".join(c.ljust(w) for c, w in zip(r[:4], widths, strict=True)) + "  " + r[4]
            for r in rows
        ]
        lines.insert(1, "-" * min(120, len(lines[0])))
        for owner, attrs in res.attr_updates.items():
            for a, vals in attrs.items():
                where = _globify(owner, model)
                line = f"per-rank attribute: {where}.{a} = {'/'.join(map(str, vals))}"
                if line not in lines:  # repeated blocks: one line for all of them
                    lines.append(line)
        for norm, ranges in res.split_norms.items():
            feats = "/".join(f"{lo}:{hi}" for lo, hi in ranges)
            line = f"split norm: {_globify(norm, model)} over features {feats}, statistic over tp"
            if line not in lines:
                lines.append(line)
        for owner, views in res.head_views.items():
            for a, ranges in views.items():
                heads = "/".join(f"{lo}:{hi}" for lo, hi in ranges)
                line = f"per-head parameter: {_globify(owner, model)}.{a} read at heads {heads}"
                if line not in lines:
                    lines.append(line)
        return f"Plan for tp={tp}:\n" + "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        return f"Plan({self.rules!r})"


def _globify(fqn: str, model: nn.Module) -> str:
    """`fqn` with the index of every repeated block replaced by `*` (elements of a ModuleList;
    a Sequential's positions stay, they name different layers)."""
    parts = fqn.split(".") if fqn else []
    out = []
    for i, p in enumerate(parts):
        parent = model.get_submodule(".".join(parts[:i]))
        out.append("*" if p.isdigit() and isinstance(parent, nn.ModuleList) else p)
    return ".".join(out)


def _collapse(res: Resolved, model: nn.Module) -> list[tuple[str, ...]]:
    """One row per distinct (glob, type, style, shapes, why): repeated blocks print once."""
    keys = []
    for e in res.entries.values():
        mod = model.get_submodule(e.fqn)
        shapes = "/".join(
            "x".join(str(d) for d in e.local_shape(mod, r)) for r in range(res.tp if e.split else 1)
        )
        keys.append((_globify(e.fqn, model), e.type_name, str(e.style), shapes, e.reason))
    return _collapse_rows(keys)


def _collapse_rows(keys: list[tuple[str, str, str, str, str]]) -> list[tuple[str, ...]]:
    """Equal rows once, their count after the name (" (x32)")."""
    seen: dict[tuple, int] = {}
    rows: list[list] = []
    for key in keys:
        if key in seen:
            rows[seen[key]][5] += 1
            continue
        seen[key] = len(rows)
        rows.append([*key, 1])
    out: list[tuple[str, ...]] = []
    for g, t, s, sh, why, count in rows:
        out.append((g + (f" (x{count})" if count > 1 else ""), t, s, sh, why))
    return out


def _per_group(e: Entry, mod: nn.Module, tp: int) -> None:
    """A fused q|k|v laid out per head or per KV group ([q.. k v] of group 0, then group 1, ...):
    split on group boundaries, so each rank holds whole groups of all three."""
    e.contiguous = True
    h = e.heads
    if e.split is None or h is None or e.kind is None:
        return
    out_f = e.kind.in_out(mod)[1]
    if out_f != h.q_size + 2 * h.kv_size or h.kv_heads < tp:
        return
    counts = balanced_counts(h.kv_heads, tp)
    e.split = unit_split(out_f, out_f // h.kv_heads, counts)
    e.reason = f"fused q|k|v per KV group, {'+'.join(map(str, counts))} groups"


def _segment_packed(model: nn.Module, entries: dict[str, Entry], tp: int) -> None:
    """Packed projections (q|k|v, gate|up): split each segment alike with the rowwise reader."""
    from .styles import segmented_split

    for e in list(entries.values()):
        if e.style != Style.COLWISE or e.split is None or e.contiguous:
            continue
        parent = e.fqn.rsplit(".", 1)[0] if "." in e.fqn else ""
        mod = model.get_submodule(e.fqn)
        assert e.kind is not None  # a split module has a Kind
        out_f = e.kind.in_out(mod)[1]
        for o in entries.values():
            if (
                o.style != Style.ROWWISE
                or (o.fqn.rsplit(".", 1)[0] if "." in o.fqn else "") != parent
            ):
                continue
            assert o.kind is not None  # planned rowwise: a Kind
            in_r = o.kind.in_out(model.get_submodule(o.fqn))[0]
            h = e.heads
            segs = None
            if out_f == in_r:
                break
            if h is not None and in_r == h.q_size and out_f == h.q_size + 2 * h.kv_size:
                segs = [h.q_size, h.kv_size, h.kv_size]
            elif out_f in (2 * in_r, 3 * in_r):
                segs = [in_r] * (out_f // in_r)
            if segs:
                parts, hows = [], []
                for n in segs:
                    s, how = split_features(n, tp, h)
                    if s is None:
                        break
                    parts.append(s)
                    hows.append(how)
                if len(parts) == len(segs) and o.split is not None:
                    e.split = segmented_split(parts)
                    # the reason said how the whole dimension splits; say how each segment does
                    base = e.reason.rsplit(", ", 1)[0] + ", " if ", " in e.reason else ""
                    e.reason = f"{base}{len(segs)} packed segments, each {hows[0]}"
                else:
                    e.style, e.split = Style.REPLICATE, None
                    e.reason = f"replicated: packed segments of {e.fqn} cannot be split over {tp}"
                break


_SRC_CACHE: dict[type, str] = {}


def _forward_src(cls: type[nn.Module]) -> str:
    if cls not in _SRC_CACHE:
        try:
            _SRC_CACHE[cls] = inspect.getsource(cls.forward)
        except (OSError, TypeError):
            _SRC_CACHE[cls] = ""
    return _SRC_CACHE[cls]


def _check_direct_use(model: nn.Module, entries: dict[str, Entry]) -> None:
    """Replicate modules whose weight a parent reads directly (F.linear(x, self.proj.weight))."""
    for e in entries.values():
        if e.split is None:
            continue
        parts = e.fqn.split(".")
        name = parts[-1]
        pat = re.compile(rf"\.{re.escape(name)}\.(weight|bias)\b")
        for i in range(len(parts) - 1, -1, -1):
            anc = model.get_submodule(".".join(parts[:i]))
            src = _forward_src(type(anc))
            if any(_reads_values(src, m) for m in pat.finditer(src)):
                e.style, e.split = Style.REPLICATE, None
                e.reason = f"replicated: {type(anc).__name__}.forward reads {name}.weight directly"
                break


def _reads_values(src: str, m: re.Match) -> bool:
    """Whether the `.name.weight` at `m` reads the tensor's values (F.linear(x, self.proj.weight)),
    not only its dtype, device or shape, or its type (isinstance(self.wo.weight, torch.Tensor))."""
    after = src[m.end() : m.end() + 8]
    before = src[max(0, m.start() - 40) : m.start()]
    if re.match(r"\.(dtype|device|shape)\b", after):
        return False
    return not re.search(r"isinstance\(\s*self$", before)


def _check_partners(model: nn.Module, entries: dict[str, Entry]) -> None:
    """A colwise layer's output stays split until a rowwise layer reads it; when that reader is not
    split rowwise (heads that cannot be split, a weight read directly, a user override, no rule),
    replicate the writer too: otherwise the reader would get this rank's slice of its input.

    Readers are found by structure, not by tracing: the layers of the same family (linear-like, or
    conv) in the writer's scope that are not writers themselves, in the parent first, then the
    grandparent, and so on. At the first level that has any, those whose input size equals the
    writer's output win, then a multiple either way (KV heads into o_proj), then a smaller one (one
    segment of a packed q|k|v). A writer with no reader in scope is left alone.
    """
    layers = {n: k for n, m in model.named_modules() if (k := kind_of(m)) is not None}
    in_size = {n: k.in_out(model.get_submodule(n))[0] for n, k in layers.items()}
    writers = {
        n for n, e in entries.items() if e.requested is not None and e.requested.is_colwise
    } | {n for n, k in layers.items() if k.name == "Embedding"}
    for e in entries.values():
        if e.style != Style.COLWISE or e.split is None:
            continue
        assert e.kind is not None  # a split module has a Kind
        out_f = e.kind.in_out(model.get_submodule(e.fqn))[1]
        conv = e.kind.name == "Conv2d"
        parts = e.fqn.split(".")
        for i in range(len(parts) - 1, -1, -1):
            scope = ".".join(parts[:i])
            cands = [
                n
                for n, k in layers.items()
                if (not scope or n.startswith(scope + "."))
                and n not in writers
                and (k.name == "Conv2d") == conv
            ]
            tiers = (
                [n for n in cands if in_size[n] == out_f],
                [n for n in cands if out_f % in_size[n] == 0 or in_size[n] % out_f == 0],
                [n for n in cands if in_size[n] < out_f],
            )
            readers = next((t for t in tiers if t), None)
            if readers is None:
                continue
            lost = [
                n
                for n in readers
                if n not in entries or entries[n].style != Style.ROWWISE or entries[n].split is None
            ]
            if lost:
                e.style, e.split = Style.REPLICATE, None
                rel = lost[0][len(scope) + 1 :] if scope else lost[0]  # the same in every block
                e.reason = f"replicated: its reader {rel} is not split rowwise"
            break


def _split_head_tables(model: nn.Module, entries: dict[str, Entry], tp: int) -> None:
    """A table of per-head values (an Embedding with one column per head: T5's relative position
    bias) in an attention whose heads are split: split its columns with the heads, so each rank
    looks up its own heads' values. Anything else per head is left to verify_plan."""
    split_q: dict[str, Entry] = {}
    for e in entries.values():
        h = e.heads
        if e.style == Style.COLWISE and e.split is not None and h is not None:
            if e.kind is not None and e.kind.in_out(model.get_submodule(e.fqn))[1] == h.q_size:
                split_q.setdefault(h.owner, e)
    for owner, q in split_q.items():
        h = q.heads
        assert h is not None and q.split is not None
        prefix = f"{owner}." if owner else ""
        for name, m in model.get_submodule(owner).named_children():
            fqn = prefix + name
            cur = entries.get(fqn)
            if (
                not isinstance(m, nn.Embedding)
                or m.embedding_dim != h.heads
                or h.kv_heads != h.heads
            ):
                continue
            if cur is not None and cur.style != Style.REPLICATE:
                continue
            counts = [q.split.size(r) // h.head_dim for r in range(tp)]
            entries[fqn] = Entry(
                fqn, type(m).__name__, Style.COLWISE, unit_split(h.heads, 1, counts),
                "one column per head, split with the heads", kind_of(m), h, Style.COLWISE,
            )  # fmt: skip


def _check_ties(model: nn.Module, entries: dict[str, Entry]) -> None:
    """Tied parameters (an embedding and its head, a head's bias and its owner's) must be split
    alike: a split tensor cannot also be whole somewhere else."""
    owners: dict[int, list[tuple[str, str]]] = {}
    for fqn, mod in model.named_modules(remove_duplicate=False):
        for pname, p in mod._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((fqn, pname))
    for names in owners.values():
        if len(names) < 2:
            continue
        es = [entries.get(n) for n, _ in names]
        splits = {_param_split(e, pname) for e, (_, pname) in zip(es, names, strict=True)}
        if len(splits) > 1:
            desc = ", ".join(
                f"{n}.{pname} ({e.style if e else 'replicate'})"
                for e, (n, pname) in zip(es, names, strict=True)
            )
            raise PlanError(
                f"tied weights are split differently: {desc}; give both the same split "
                f"(an embedding 'vocab' with its head 'colwise_gather'), or replicate both"
            )


def _param_split(e: Entry | None, pname: str) -> tuple[Ranges, ...] | None:
    """Per-rank ranges of parameter `pname` of a planned module; None when it stays whole (a
    rowwise or colwise_gather bias is whole on every rank: see tp/layers.py)."""
    if e is None or e.split is None:
        return None
    if pname == "weight" or (pname == "bias" and e.style == Style.COLWISE):
        return e.split.per_rank
    return None


def _attr_updates(model: nn.Module, entries: dict[str, Entry], tp: int) -> dict:
    """Per-rank head counts for attention modules that store them; for one that reads them from its
    transformers config (Phi-3 slices q|k|v by config.num_attention_heads), the counts of a private
    copy of that config ("config.num_attention_heads"; apply_tp copies the config per module)."""
    out: dict[str, dict[str, list[int]]] = {}
    for e in entries.values():
        h = e.heads
        if e.split is None or h is None or e.style != Style.COLWISE:
            continue
        mod = model.get_submodule(e.fqn)
        assert e.kind is not None  # a split module has a Kind
        q = h.q_size
        out_f = e.kind.in_out(mod)[1]
        if out_f not in (q, q + 2 * h.kv_size):  # q, or packed q|k|v
            continue
        owner = model.get_submodule(h.owner)
        if e.contiguous:  # whole groups of q|k|v per rank: q is the same share of each
            q_local = [e.split.size(r) * q // out_f for r in range(tp)]
        else:
            q_local = [sum(min(b, q) - a for a, b in e.split.ranges(r) if a < q) for r in range(tp)]
        ups = out.setdefault(h.owner, {})
        if h.from_config:
            cfg = getattr(owner, "config", None)
            if isinstance(getattr(cfg, "num_attention_heads", None), int):
                ups["config.num_attention_heads"] = [q // h.head_dim for q in q_local]
            if isinstance(getattr(cfg, "num_key_value_heads", None), int):
                g = h.heads // h.kv_heads
                ups["config.num_key_value_heads"] = [q // h.head_dim // g for q in q_local]
        for a in Q_ATTRS:
            if isinstance(getattr(owner, a, None), int):
                ups[a] = [q // h.head_dim for q in q_local]
        for a in KV_ATTRS:
            if isinstance(getattr(owner, a, None), int):
                ups[a] = [q // h.head_dim // (h.heads // h.kv_heads) for q in q_local]
        for a in SIZE_ATTRS:
            if getattr(owner, a, None) == h.q_size:
                ups[a] = q_local
    return out


def _head_views(model: nn.Module, entries: dict[str, Entry], tp: int) -> dict:
    """Per-head parameters of attention modules whose q projection is split by heads: a direct
    parameter of the head owner whose first dimension is the head count (gpt-oss's attention
    sinks) is applied to the heads, so each rank reads the rows of its own heads. Where a rank's
    heads are not one range the parameter is left alone (the probe then replicates the attention).
    A structural guess like every split: verify_plan checks it."""
    out: dict[str, dict[str, list[tuple[int, int]]]] = {}
    for e in entries.values():
        h = e.heads
        if e.split is None or h is None or e.style != Style.COLWISE or h.heads < 2:
            continue
        assert e.kind is not None  # a split module has a Kind
        if e.kind.in_out(model.get_submodule(e.fqn))[1] != h.q_size:
            continue  # k, v, or a packed q|k|v (its rows are not one range of heads per rank)
        owner = model.get_submodule(h.owner)
        names = [n for n, p in owner._parameters.items()
                 if p is not None and p.dim() >= 1 and p.shape[0] == h.heads]  # fmt: skip
        per_rank = []
        for r in range(tp):
            rs = e.split.ranges(r)
            if len(rs) != 1 or rs[0][0] % h.head_dim or rs[0][1] % h.head_dim:
                break
            per_rank.append((rs[0][0] // h.head_dim, rs[0][1] // h.head_dim))
        else:
            if names:
                out[h.owner] = {n: per_rank for n in names}
    return out


def _split_norms(model: nn.Module, entries: dict[str, Entry], tp: int) -> dict:
    """Norms over the whole output of a split colwise layer: a sibling module (same parent) whose
    name says norm, holding a one-dimensional weight of that layer's output width and an epsilon
    (OLMoE's and OLMo-2's q_norm / k_norm over all heads at once). Each rank then normalizes its
    own features with the statistic of all of them (`quantmesh.tp.apply.split_norm`). Where a
    rank's features are not one range the norm is left alone (the probe then replicates). A
    structural guess like every split: verify_plan checks it (a norm that centers, as LayerNorm
    does, comes out not exact and its layers are replicated)."""
    out: dict[str, list[tuple[int, int]]] = {}
    for e in entries.values():
        if e.split is None or e.style != Style.COLWISE:
            continue
        assert e.kind is not None  # a split module has a Kind
        width = e.kind.in_out(model.get_submodule(e.fqn))[1]
        parent, _, _ = e.fqn.rpartition(".")
        for name, child in model.get_submodule(parent).named_children():
            fqn = f"{parent}.{name}" if parent else name
            w = child._parameters.get("weight")
            if (
                fqn in out
                or "norm" not in type(child).__name__.lower()
                or w is None
                or tuple(w.shape) != (width,)
                or next(child.children(), None) is not None
                or not any(isinstance(v, float) and "eps" in k for k, v in vars(child).items())
            ):
                continue
            per_rank = [e.split.ranges(r) for r in range(tp)]
            if all(len(rs) == 1 for rs in per_rank):
                out[fqn] = [rs[0] for rs in per_rank]
    return out


def _writers_of(entries: dict[str, Entry], owner: str) -> list[Entry]:
    """The split colwise children of module `owner` (its q / k / v, its up projection)."""
    return [
        e
        for e in entries.values()
        if e.style == Style.COLWISE
        and e.split is not None
        and e.kind is not None
        and (e.fqn.rsplit(".", 1)[0] if "." in e.fqn else "") == owner
    ]


def _scaled(value: int, writers: list[Entry], model: nn.Module, tp: int) -> list[int] | None:
    """`value` per rank as a count of equal units of a split layer's output (a head count, a
    width): value * local / whole, for the widest writer where every rank's share is whole."""
    widths = []
    for e in writers:
        assert e.kind is not None and e.split is not None  # from _writers_of
        widths.append((e.kind.in_out(model.get_submodule(e.fqn))[1], e.split))
    for whole, split in sorted(widths, key=lambda w: -w[0]):
        if whole % value:
            continue
        local = [split.size(r) * value for r in range(tp)]
        if all(n % whole == 0 for n in local):
            return [n // whole for n in local]
    return None


def size_candidates(
    model: nn.Module, res: Resolved, owner: str
) -> dict[str, tuple[int, list[int]]]:
    """Integer attributes of module `owner` that may hold a global size its split children
    changed: {name: (value, per-rank value)}, for every value that divides a split colwise child's
    output width into units each rank holds whole (a head count, a head size, the width itself).
    Values only: which of them the forward reads as a global size is for a probe to find out
    (verify_plan) or the user to say. Attributes set per rank already are left out.

    Example:
        >>> size_candidates(model, plan.resolve(model, 2), "blocks.0.attn")   # doctest: +SKIP
        {'n_head': (4, [2, 2]), 'hd': (16, [8, 8])}
    """
    writers = _writers_of(res.entries, owner)
    if not writers:
        return {}
    mod = model.get_submodule(owner)
    done = res.attr_updates.get(owner, {})
    out: dict[str, tuple[int, list[int]]] = {}
    for name, v in vars(mod).items():
        if name.startswith("_") or name in done or isinstance(v, bool) or not isinstance(v, int):
            continue
        if v > 1:
            per_rank = _scaled(v, writers, model, res.tp)
            if per_rank is not None and per_rank != [v] * res.tp:
                out[name] = (v, per_rank)
    return out


def _value_updates(
    model: nn.Module, entries: dict[str, Entry], tp: int, glob: str, attrs: Mapping[str, int]
) -> dict[str, dict[str, list[int]]]:
    """Per-rank values of the attributes `attrs` ({name: global value}) of every module matching
    `glob` that holds that value (a block whose attribute holds another value is left alone)."""
    out: dict[str, dict[str, list[int]]] = {}
    for fqn, mod in model.named_modules():
        if not fnmatch.fnmatchcase(fqn, glob) and fqn != glob:
            continue
        writers = _writers_of(entries, fqn)
        for name, value in attrs.items():
            cur = getattr(mod, name, None)
            if writers and cur == value and not isinstance(cur, bool):
                per_rank = _scaled(value, writers, model, tp)
                if per_rank is not None:
                    out.setdefault(fqn, {})[name] = per_rank
    return out
