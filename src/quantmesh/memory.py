"""Bytes per GPU (or per CPU rank) of a planned model, estimated from shapes alone: no weights read.

The estimate is the sum of these parts, for the tp rank that holds the most (uneven head splits give
rank 0 more), in bytes:

  weights      every parameter's local slice under the plan: quantized linears at the format's
               bytes per parameter (nf4/fp4 0.5 + block statistics, int8 1 + row scales), the rest at
               `dtype` (fp32 on CPU, bf16 on GPU as the CLI loads them); tied weights counted once
  lora         adapter parameters (fp32): A (r x in) and B (out x r), sliced as the base layer is
  grads        fp32 gradients of the adapters: 4 bytes per adapter parameter
  optimizer    AdamW's two fp32 moments: 8 bytes per adapter parameter
  ddp          with dp > 1, DDP's flat gradient buckets: 4 more bytes per adapter parameter
  activations  what autograd keeps for the backward pass, per layer and token, in elements of the
               activation size `a` (fp32 where named):
                 2 x h (fp32)   the two RMSNorm inputs (Llama-style norms upcast to fp32), plus
                                the final norm's input once
                 2 q + 2 kv     q and k after RoPE, v, and the attention output (SDPA keeps them;
                                memory-efficient / flash attention: no T x T matrix)
                 3 i            gate, SiLU(gate) and up of a gated MLP (1 i: fc1's output otherwise)
                 inputs         what the adapters' A read. Computing in the activation dtype (CPU,
                                fp32), adapters share one tensor per role: h for q/k/v, h for
                                gate/up, i for down_proj (o_proj reads the attention output, kept
                                anyway). Under bf16 autocast or dropout each adapter keeps its own
                                copy (its local in-width), and dropout adds a mask (1 byte on CUDA,
                                a 4-byte noise tensor on CPU)
                 n r            each adapter's A output, kept by B (n adapters per layer)
                                (a rowwise adapter's A output shares the base output's all-reduce
                                buffer, then is copied out: B keeps r columns, not the buffer)
                 int8 only      LLM.int8 keeps each matmul's input too (one per role)
               where h is the hidden size and q, kv, i this rank's query, key-value and MLP widths;
               times micro_batch * seq_len * layers
  logits       micro_batch * seq_len * vocab * (a + 12, +4 when a < 4): the gathered logits, their
               fp32 copy, the log-softmax kept by cross-entropy, and in backward its gradient and
               the logits' gradient
  transient    the largest linear's weight dequantized for a matmul (quantized formats)

Assumptions, named so that a measured peak can be held against them: activation checkpointing
off; bf16 autocast on GPU (a = 2), fp32 on CPU (a = 4); SDPA attention without a padding mask;
all weights frozen except the adapters; allocator fragmentation, the CUDA context (~0.5 GiB) and
framework workspaces are not included. Without LoRA the estimate is for a forward pass (generation):
no gradients, no optimizer; activations are one layer's temporaries, (4 h + 3 q + 2 kv + 4 i) x a
per token (1 i less for a non-gated MLP), and the logits b * s * vocab * (a + 4).

Example:
    >>> with qm.empty_model():                                          # doctest: +SKIP
    ...     model = AutoModelForCausalLM.from_config(cfg)
    >>> est = estimate_memory(model, tp=2, quant="nf4", lora=qm.LoraConfig(r=16),
    ...                       seq_len=2048, micro_batch=2)              # doctest: +SKIP
    >>> print(est)                                                      # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["MemoryEstimate", "estimate_memory", "format_bytes"]

ADAPTER_BYTES = 4  # adapters are fp32 (lora.attach_lora), whatever the base dtype


@dataclass(kw_only=True)
class MemoryEstimate:
    """Estimated bytes on one rank's device, by part (see the module docstring for each formula).

    Example:
        >>> MemoryEstimate(weights=2**30, activations=2**29).total
        1610612736
    """

    weights: int = 0
    """Local slices of all parameters (quantized where the format applies)."""
    lora: int = 0
    """Adapter parameters, fp32."""
    grads: int = 0
    """Adapter gradients, fp32."""
    optimizer: int = 0
    """AdamW moments, 2 x fp32 per adapter parameter."""
    ddp: int = 0
    """DDP gradient buckets when dp > 1, fp32."""
    activations: int = 0
    """Saved for backward (training), or one layer's worth (forward only)."""
    logits: int = 0
    """Logits, their fp32 log-softmax and gradients."""
    transient: int = 0
    """The largest dequantized weight during a quantized matmul."""
    rank: int = 0
    """The tp rank this estimate is for (the one with the most)."""
    lora_params: int = 0
    """Adapter parameters on this rank (a count, not bytes)."""
    notes: list[str] = field(default_factory=list)
    """Assumptions and caveats that apply to this model."""

    def __post_init__(self) -> None:
        for name in ("weights", "lora", "grads", "optimizer", "ddp", "activations", "logits"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} bytes; expected >= 0")

    @property
    def total(self) -> int:
        """Sum of all parts, in bytes."""
        return (
            self.weights
            + self.lora
            + self.grads
            + self.optimizer
            + self.ddp
            + self.activations
            + self.logits
            + self.transient
        )

    def table(self) -> str:
        """The parts and the total, one per line, in GiB / MiB."""
        rows = [
            ("weights", self.weights),
            ("lora adapters (fp32)", self.lora),
            ("lora gradients (fp32)", self.grads),
            ("AdamW states (2 x fp32)", self.optimizer),
            ("DDP gradient buckets", self.ddp),
            ("activations", self.activations),
            ("logits + loss", self.logits),
            ("dequantized weight (transient)", self.transient),
        ]
        w = max(len(r[0]) for r in rows)
        lines = [f"  {name.ljust(w)}  {format_bytes(v):>10}" for name, v in rows if v]
        lines.append(f"  {'total'.ljust(w)}  {format_bytes(self.total):>10}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def format_bytes(n: float) -> str:
    """Bytes as a short human string (binary units).

    Example:
        >>> format_bytes(3 * 2**30 + 2**29)
        '3.50 GiB'
    """
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


@dataclass
class _Dims:
    """Transformer geometry read from a transformers config (None when the model has none)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    vocab: int


def _dims(model: nn.Module) -> _Dims | None:
    cfg = getattr(model, "config", None)
    if cfg is None:
        return None
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    try:
        h = int(cfg.hidden_size)
        heads = int(cfg.num_attention_heads)
        layers = int(cfg.num_hidden_layers)
        vocab = int(cfg.vocab_size)
    except (AttributeError, TypeError):
        return None
    kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
    hd = int(getattr(cfg, "head_dim", None) or h // heads)
    inter = getattr(cfg, "intermediate_size", None) or getattr(cfg, "n_inner", None) or 4 * h
    return _Dims(h, layers, heads, kv, hd, int(inter), vocab)


def estimate_memory(
    model: nn.Module,
    *,
    tp: int = 1,
    dp: int = 1,
    plan=None,
    quant=None,
    lora=None,
    seq_len: int = 2048,
    micro_batch: int = 1,
    dtype: torch.dtype = torch.float32,
    act_bytes: int | None = None,
) -> MemoryEstimate:
    """Bytes one rank needs to train (with `lora`) or run (without) `model` under the plan.

    `model` may be a meta skeleton (`qm.empty_model()`); only shapes are read. `dtype` is the dtype of
    unquantized weights; `act_bytes` the activation size (default: 2 for bf16/fp16 `dtype`, else 4).

    Example:
        >>> est = estimate_memory(model, tp=2, quant="nf4", lora=qm.LoraConfig(r=16),
        ...                       seq_len=512, micro_batch=4, dtype=torch.bfloat16)  # doctest: +SKIP
        >>> est.total / 2**30                                                         # doctest: +SKIP
        1.9
    """
    from .autoplan import auto_plan
    from .plan import Plan
    from .quant.base import get_format, resolve_quant

    if seq_len < 1 or micro_batch < 1:
        raise ValueError(f"seq_len={seq_len}, micro_batch={micro_batch}; both must be >= 1")
    if dp < 1 or tp < 1:
        raise ValueError(f"tp={tp}, dp={dp}; both must be >= 1")
    if isinstance(plan, dict):
        plan = Plan(plan)
    resolved = (plan or auto_plan(model, tp)).resolve(model, tp)
    qcfg = resolve_quant(quant)
    fmt = get_format(qcfg) if qcfg is not None else None
    a = act_bytes or (2 if dtype in (torch.bfloat16, torch.float16) else 4)
    best: MemoryEstimate | None = None
    for r in range(tp):
        est = _for_rank(model, resolved, r, qcfg, fmt, lora, dtype, a, seq_len, micro_batch, dp)
        if best is None or est.total > best.total:
            best = est
    assert best is not None
    return best


def _local(n: int, entry, rank: int) -> int:
    """This rank's share of a dimension of size n split by `entry` (n when not split)."""
    if entry is None or entry.split is None:
        return n
    return entry.split.size(rank)


def _for_rank(model, resolved, rank, qcfg, fmt, lora, dtype, a, seq, mb, dp) -> MemoryEstimate:
    from .lora import lora_targets
    from .tp.kinds import kind_of

    est = MemoryEstimate(rank=rank)
    dt_bytes = torch.empty((), dtype=dtype).element_size()
    seen: set[int] = set()
    largest_dq = 0
    widths: dict[str, tuple[int, int]] = {}  # fqn -> (local in, local out) of linear-like modules
    for fqn, mod in model.named_modules():
        own = list(mod.named_parameters(recurse=False))
        if not own:
            continue
        entry = resolved.entries.get(fqn)
        kind = kind_of(mod)
        quantized = (
            fmt is not None
            and kind is not None
            and kind.linear_like
            and qcfg.selects(fqn)
            and not qcfg.skips(fqn)
        )
        if kind is not None:
            in_f, out_f = kind.in_out(mod)
            style = entry.style if entry is not None and entry.split is not None else "replicate"
            in_l = _local(in_f, entry, rank) if style in ("rowwise", "vocab") else in_f
            out_l = _local(out_f, entry, rank) if style.startswith("colwise") else out_f
            widths[fqn] = (in_f, out_f, in_l, out_l)
        for pname, p in own:
            # A weight tied to another module is one tensor, unless quantization unties it.
            if id(p) in seen and not quantized:
                continue
            seen.add(id(p))
            if kind is None:
                est.weights += p.numel() * (dt_bytes if p.is_floating_point() else p.element_size())
                continue
            if pname == "weight":
                n = in_l * out_l * (p.numel() // max(1, in_f * out_f))  # conv kernels
                if quantized:
                    est.weights += int(n * fmt.bytes_per_param(in_l))
                    largest_dq = max(largest_dq, n * (2 if a == 2 else 4))
                else:
                    est.weights += n * dt_bytes
            else:  # bias: split with the outputs of a colwise layer, whole otherwise
                n = out_l if style.startswith("colwise") else p.numel()
                est.weights += n * dt_bytes
    est.transient = largest_dq

    targets = lora_targets(model, lora) if lora is not None else []
    for fqn in targets:
        mod = model.get_submodule(fqn)
        _, _, in_l, out_l = widths[fqn]
        est.lora_params += lora.r * (in_l + out_l)  # A (r x in_l), B (out_l x r)
    est.lora = est.lora_params * ADAPTER_BYTES
    if lora is not None:
        est.grads = est.lora_params * 4
        est.optimizer = est.lora_params * 8
        est.ddp = est.lora_params * 4 if dp > 1 else 0

    dims = _dims(model)
    if dims is None:
        est.notes.append("no transformers config: activations and logits are not estimated")
        return est
    act, logits = _activations(dims, resolved, rank, widths, targets, lora, fmt, a, seq, mb)
    est.activations, est.logits = act, logits
    return est


def _activations(
    dims: _Dims, resolved, rank, widths, targets, lora, fmt, a, seq, mb
) -> tuple[int, int]:
    """(activation bytes, logits bytes) from the per-layer formula in the module docstring."""
    h, hd = dims.hidden, dims.head_dim
    q_full, kv_full = dims.heads * hd, dims.kv_heads * hd

    def local_width(full_out: int) -> int:
        # This rank's width of a colwise projection with `full_out` outputs (first one found).
        for e in resolved.entries.values():
            if e.split is not None and e.style == "colwise" and e.split.full == full_out:
                return e.split.size(rank)
        return full_out

    q, kv, i = local_width(q_full), local_width(kv_full), local_width(dims.inter)
    tokens = seq * mb
    # The first block's linears, by role; told apart by their full widths.
    block = _first_block(widths)
    gated = sum(1 for f in block if widths[f][0] == h and widths[f][1] == dims.inter) >= 2
    mlp_keep = (3 if gated else 1) * i  # gate, SiLU(gate), up  |  fc1 output
    if lora is None:
        # Forward only: no autograd graph; one layer's temporaries at a time, plus the logits.
        one_layer = tokens * (4 * h + 3 * q + 2 * kv + mlp_keep + i) * a
        return int(one_layer), int(tokens * dims.vocab * (a + 4))

    roles_of = _roles(block)
    mine = [f for f in block if f in set(targets)]
    roles = {roles_of[f] for f in mine}
    # The one tensor each role's adapters read when they need no copy. o_proj reads the attention
    # output, which SDPA keeps anyway (counted above), so it adds nothing.
    shared = {"attn_in": h, "mlp_in": h, "attn_out": 0, "mlp_out": i}
    copies = a < 4 or lora.dropout > 0  # each adapter casts (autocast) or drops out its own copy
    per_tok = 2 * 4 * h / a  # the two norm inputs, upcast to fp32 (in units of `a` bytes)
    per_tok += 2 * q + 2 * kv  # SDPA: q, k, v and its output
    per_tok += mlp_keep
    adapter_inputs = sum(widths[f][2] for f in mine)  # local in-width of each adapter's A
    if copies:
        per_tok += adapter_inputs
    else:
        per_tok += sum(shared[r] for r in roles)
    if fmt is not None and fmt.name == "int8":
        # LLM.int8's matmul keeps its input for backward: every role's shared input, once.
        per_tok += sum(shared[r] for r in shared if copies or r not in roles)
    per_tok += len(mine) * lora.r  # A's output, kept by B (a rowwise adapter copies it out of the
    # all-reduce buffer it shared with the base output, so that buffer is not kept: r, not out + r)
    act = tokens * dims.layers * per_tok * a + tokens * h * 4  # + the final norm's fp32 input
    if lora.dropout > 0:
        # Dropout masks: bool on CUDA (fused kernel); a float noise tensor on CPU.
        act += tokens * dims.layers * adapter_inputs * (1 if a < 4 else 4)
    return int(act), int(tokens * dims.vocab * (a + 12 + (4 if a < 4 else 0)))


def _roles(block: list[str]) -> dict[str, str]:
    """attn_in / attn_out / mlp_in / mlp_out of a block's linears: grouped by parent module, the
    last linear of a group writes the residual stream back ("out"); a parent named like attention
    makes the group "attn"."""
    groups: dict[str, list[str]] = {}
    for f in block:
        groups.setdefault(f.rpartition(".")[0], []).append(f)
    out = {}
    for parent, names in groups.items():
        kind = (
            "attn"
            if any(k in parent.rpartition(".")[2].lower() for k in ("attn", "attention"))
            else "mlp"
        )
        for f in names:
            out[f] = f"{kind}_out" if f == names[-1] and len(names) > 1 else f"{kind}_in"
    return out


def _first_block(widths: dict) -> list[str]:
    """Linear-like modules of the first repeated block (FQNs with a `.0.` segment)."""
    block = [f for f in widths if ".0." in f".{f}."]
    return block or list(widths)
