"""auto_plan: the model's own tp plan where it has one, otherwise one inferred from structure.

Structure: in each repeated block (the elements of the model's largest ModuleList), linears are read in
definition order; a linear that reads the block's width opens (or joins) a column group, and the linear
that writes the width back (the residual stream) and reads a column group's output closes it as
rowwise. Layers in a Sequential pair the same way when only elementwise ops sit between them
(Linear -> GELU -> Linear, Conv2d -> ReLU -> Conv2d), so a plain MLP or CNN splits too. A column group
left without a rowwise partner is replicated (its output would otherwise stay sharded).
The input embedding is vocab-split and the output head colwise with gathered logits, tied or not.
Every other module with parameters gets a "replicated: why" row (norms, small embeddings, layers
outside any pair, modules with no parallel form).
"""

from __future__ import annotations

import fnmatch

from torch import nn

from ..quant.kinds import not_a_linear
from ..tp.kinds import Kind, expert_tensors, kind_of
from .plan import Plan
from .styles import HF_STYLE_ALIASES, STYLES, Style

__all__ = ["auto_plan"]

# Names that read the block input: never chosen as the rowwise closer of a group.
INPUT_NAMES = {
    "q",
    "k",
    "v",
    "query",
    "key",
    "value",
    "q_proj",
    "k_proj",
    "v_proj",
    "c_attn",
    "qkv",
    "qkv_proj",
    "in_proj",
    "linear_query",
    "linear_keys",
    "linear_values",
    "w_q",
    "w_k",
    "w_v",
    "wq",
    "wk",
    "wv",
    "gate_proj",
    "up_proj",
    "w1",
    "w3",
    "w_1",
    "fc1",
    "c_fc",
    "gate_up_proj",
    "query_key_value",
    "dense_h_to_4h",
    "lin1",
    "to_q",
    "to_k",
    "to_v",
}
# Names that write the residual stream back.
OUTPUT_NAMES = {
    "o_proj",
    "out_proj",
    "c_proj",
    "final_linear",
    "down_proj",
    "fc2",
    "w2",
    "w_2",
    "wo",
    "dense",
    "proj",
    "dense_4h_to_h",
    "lin2",
    "to_out",
    "out",
}
ELEMENTWISE = (
    nn.ReLU,
    nn.GELU,
    nn.SiLU,
    nn.Tanh,
    nn.Sigmoid,
    nn.LeakyReLU,
    nn.Dropout,
    nn.Identity,
    nn.ReLU6,
    nn.Mish,
    nn.Hardswish,
)


def auto_plan(model: nn.Module, tp: int) -> Plan:
    """A Plan for `model` over `tp` ranks; `print(plan)` explains every decision.

    Example:
        >>> plan = qm.auto_plan(model, tp=2)  # doctest: +SKIP
        >>> print(plan)                       # doctest: +SKIP
    """
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp={tp!r}; use a positive int")
    rules: dict[str, str] = {}
    notes: dict[str, str] = {}
    embs, head = _embedding_and_head(model)
    hf = _hf_rules(model)
    r, n = _structural_rules(model, skip={head})
    if hf:
        rules.update(hf)
        for k, v in hf.items():
            unknown = v not in HF_STYLE_ALIASES and v not in STYLES  # a newer transformers' style
            if unknown or (HF_STYLE_ALIASES.get(v, v) == "replicate" and v not in _HF_REPLICATE):
                rules[k] = Style.REPLICATE
                notes[k] = f"replicated: the model's plan asks for {v!r}, not implemented here"
            else:
                notes[k] = "model's own tp plan"
        # what the model's plan leaves out (a shared expert, a low-rank projection): structure,
        # for modules none of whose siblings the model's plan names (verify_plan checks the result)
        named = [n for n, _ in model.named_modules() if n and _matches(n, hf)]
        parents = {x.rsplit(".", 1)[0] if "." in x else "" for x in named}
        for k, v in r.items():
            parent = k.rsplit(".", 1)[0] if "." in k else ""
            if not _matches(k, hf) and parent not in parents:
                rules[k], notes[k] = v, n[k]
    else:
        rules.update(r)
        notes.update(n)
    for emb in embs:
        rules[emb] = Style.VOCAB
        notes[emb] = "input embedding"
    if head is not None:
        rules[head] = Style.COLWISE_GATHER
        notes[head] = "output head, logits gathered"
    # experts modules (fused 3-D expert tensors) are split by tp/experts.py, by their
    # intermediate features, not by a plan rule (the model's plan names them 'moe_tp_experts')
    experts = [n for n, m in model.named_modules() if n and expert_tensors(m) is not None]
    for k in [k for k in rules if any(_matches(e, {k: ""}) for e in experts)]:
        del rules[k]
        notes.pop(k, None)
    _replicate_notes(model, rules, notes)
    contiguous = tuple(k for k, v in hf.items() if v in ("colwise", "local_colwise"))
    return Plan(rules, notes=notes, model=model, tp=tp, user_rules=(), contiguous=contiguous)


_HF_REPLICATE = (
    "replicate",
    "replicated_with_grad_allreduce",
    "local",
    "gather",
    "sequence_parallel",
)


def _hf_rules(model: nn.Module) -> dict[str, str]:
    cfg = getattr(model, "config", None)
    base_plan = getattr(cfg, "base_model_tp_plan", None) if cfg is not None else None
    if not base_plan:
        return {}
    prefix = getattr(model, "base_model_prefix", "")
    has_prefix = bool(prefix) and hasattr(model, prefix)
    out = {}
    for k, v in base_plan.items():
        out[f"{prefix}.{k}" if has_prefix else k] = v
    for k, v in (getattr(model, "_tp_plan", None) or {}).items():
        out[k] = v
    # A fused projection whose output the model's plan gathers, read by a sibling that splits its
    # input again (Phi-3's qkv_proj -> o_proj, gate_up_proj -> down_proj), is a plain column/row
    # pair: keeping the output split saves both collectives and the whole-width compute. The fused
    # output is split per segment (q|k|v, gate|up) and the probe checks it (verify_plan).
    readers = {k.rsplit(".", 1)[0] for k, v in out.items() if v == "rowwise_split_input"}
    for k, v in list(out.items()):
        if v == "colwise_gather_output" and "." in k and k.rsplit(".", 1)[0] in readers:
            out[k] = "packed_colwise"  # split per segment, not in contiguous blocks
    for k, v in list(out.items()):
        if v == "rowwise_split_input":
            out[k] = "rowwise"
    return out


def blocks_of(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Elements of the largest ModuleList (by parameters): the repeated blocks. Several lists
    (encoder and decoder) all count when they are large."""
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        return []
    sizes = {n: sum(p.numel() for p in m.parameters()) for n, m in lists}
    top = max(sizes.values())
    out: list[tuple[str, nn.Module]] = []
    for n, m in lists:
        if sizes[n] >= top * 0.2 and not any(n.startswith(o + ".") for o, _ in out):
            out += [(f"{n}.{i}", b) for i, b in enumerate(m)]
    return out


def _structural_rules(
    model: nn.Module, skip: set[str | None]
) -> tuple[dict[str, str], dict[str, str]]:
    """Rules from structure; modules in `skip` (the output head) are left to the caller."""
    rules: dict[str, str] = {}
    notes: dict[str, str] = {}
    for bname, block in blocks_of(model):
        _pair_block(bname, block, rules, notes)
    for sname, seq in model.named_modules():
        if isinstance(seq, nn.Sequential):
            _pair_sequential(sname, seq, rules, notes, skip)
    return rules, notes


def _kind(module: nn.Module) -> Kind:
    """kind_of for a module already known to be shardable (filtered by kind_of before)."""
    k = kind_of(module)
    assert k is not None, f"{type(module).__name__} has no Kind"
    return k


def _pair_block(bname: str, block: nn.Module, rules: dict, notes: dict) -> None:
    lins = [
        (f"{bname}.{n}", m)
        for n, m in block.named_modules()
        if n and (k := kind_of(m)) is not None and k.linear_like
    ]
    if not lins:
        return
    width = _kind(lins[0][1]).in_out(lins[0][1])[0]
    siblings: dict[str, list[str]] = {}
    for n, _ in lins:
        siblings.setdefault(n.rsplit(".", 1)[0], []).append(n)
    group: list[tuple[str, int]] = []  # open column group: (fqn, out features)
    for fqn, m in lins:
        fin, fout = _kind(m).in_out(m)
        name = fqn.rsplit(".", 1)[-1]
        closes = (
            group
            and fout == width
            and name not in INPUT_NAMES
            and (name in OUTPUT_NAMES or siblings[fqn.rsplit(".", 1)[0]][-1] == fqn)
            # it reads (part of) a group's output: all of it, or one segment of a packed q|k|v
            and any(fin <= o for _, o in group)
        )
        if closes:
            for g, _ in group:
                rules[g] = Style.COLWISE
                notes[g] = "structure: reads the block input"
            rules[fqn] = Style.ROWWISE
            notes[fqn] = "structure: writes the residual stream"
            group = []
        elif fin == width:
            group.append((fqn, fout))
        else:
            rules[fqn] = Style.REPLICATE
            notes[fqn] = "replicated: not part of a column/row pair"
    for g, _ in group:
        rules[g] = Style.REPLICATE
        notes[g] = "replicated: no rowwise partner found after it"


def _pair_sequential(
    sname: str, seq: nn.Sequential, rules: dict, notes: dict, skip: set[str | None]
) -> None:
    """In a Sequential, a layer followed (through elementwise ops only) by one that reads exactly
    its output becomes a colwise -> rowwise pair: Linear -> GELU -> Linear, Conv2d -> ReLU -> Conv2d.
    Layers already planned (inside a block) and the output head are left alone."""
    items = [(f"{sname}.{n}" if sname else n, m) for n, m in seq.named_children()]

    def free(i: int) -> bool:
        n, m = items[i]
        k = kind_of(m)
        return k is not None and k.name != "Embedding" and n not in rules and n not in skip

    i = 0
    while i < len(items):
        if not free(i):
            i += 1
            continue
        j = i + 1
        while j < len(items) and isinstance(items[j][1], ELEMENTWISE):
            j += 1
        if j == len(items) or not free(j):
            i += 1
            continue
        (a, ma), (b, mb) = items[i], items[j]
        ka, kb = _kind(ma), _kind(mb)
        if (ka.name == "Conv2d") == (kb.name == "Conv2d") and kb.in_out(mb)[0] == ka.in_out(ma)[1]:
            what = "conv, output channels split" if ka.name == "Conv2d" else "output features split"
            rules[a], notes[a] = Style.COLWISE, f"structure: {what}"
            what = "conv, input channels split" if ka.name == "Conv2d" else "input features split"
            rules[b], notes[b] = Style.ROWWISE, f"structure: {what}"
            i = j + 1
            continue
        i += 1


def _embedding_and_head(model: nn.Module) -> tuple[list[str], str | None]:
    """(token embeddings to split on rows, the output head) of `model`.

    A transformers model names them (get_input_embeddings / get_output_embeddings). A custom model:
    the largest embeddings (within 2x of the largest, so an encoder-decoder's source and target
    tables both count; position tables are far smaller), and the last linear whose outputs are one
    of their vocabularies. An embedding tied to the head is always split (the tie must be split
    alike, see plan._check_ties).
    """
    names = {id(m): n for n, m in model.named_modules()}
    embs: list[str] = []
    head = None
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    try:
        e = get_in() if callable(get_in) else None
        h = get_out() if callable(get_out) else None
    except (NotImplementedError, AttributeError):
        e = h = None
    if isinstance(e, nn.Embedding) and id(e) in names:
        embs.append(names[id(e)])
    if h is not None and (kh := kind_of(h)) is not None and kh.linear_like:
        head = names.get(id(h))
    all_embs = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Embedding)]
    if not embs and all_embs:  # a custom model
        top = max(m.num_embeddings for _, m in all_embs)
        embs = [n for n, m in all_embs if 2 * m.num_embeddings >= top]
    if head is None and embs:
        vocabs = {model.get_submodule(n).num_embeddings for n in embs}
        lins = [
            n
            for n, m in model.named_modules()
            if (k := kind_of(m)) is not None and k.linear_like and k.in_out(m)[1] in vocabs
        ]
        head = lins[-1] if lins else None
    if head is not None:
        w = model.get_submodule(head).weight
        embs += [n for n, m in all_embs if m.weight is w and n not in embs]
    return embs, head


def _replicate_notes(model: nn.Module, rules: dict, notes: dict) -> None:
    """Say why norms and other parameterized leaves stay whole (shown in the table)."""
    for n, m in model.named_modules():
        # leaves with parameters, and containers with parameters of their own
        # (nn.MultiheadAttention's in_proj_weight, BERT's cls.predictions.bias)
        if not n or not any(True for _ in m.parameters(False)):
            continue
        parts = n.split(".")  # skip it when a rule (a name or a glob) covers it or an ancestor
        if any(_matches(".".join(parts[:i]), rules) for i in range(1, len(parts) + 1)):
            continue
        if expert_tensors(m) is not None:  # split by ShardedExperts, outside the plan
            continue
        t = type(m).__name__
        if "Norm" in t:
            why = f"replicated: {t}"
        elif isinstance(m, nn.Embedding):
            why = "replicated: small embedding"
        elif (odd := not_a_linear(m)) is not None:
            why = f"replicated: {odd}"
        elif kind_of(m) is None:
            why = f"replicated: {t} has no parallel form"
        else:  # a linear or conv outside any column/row pair (a classifier, a pooler)
            why = "replicated: not part of a column/row pair"
        rules[n] = Style.REPLICATE
        notes[n] = why


def _matches(fqn: str, rules: dict) -> bool:
    """Whether a rule of `rules` names `fqn` exactly or as a glob (model.layers.*.mlp.up_proj)."""
    return fqn in rules or any(
        any(c in pat for c in "*?[") and fnmatch.fnmatchcase(fqn, pat) for pat in rules
    )
