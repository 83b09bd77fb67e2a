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
  activations  what autograd keeps for the backward pass (each storage once), per layer and token,
               in bytes, with `a` the activation size (2 under bf16 autocast, 4 in fp32):
                 2 x 4 h        the two RMSNorm inputs, upcast to fp32 (plus 2 x 4 bytes: their
                                rsqrt(mean(x^2)) rows)
                 (2 q + 2 kv) a q and k after RoPE, v, and SDPA's output (flash / memory-efficient
                                SDPA: no T x T matrix; the output is laid out (b, s, heads, d),
                                so o_proj's input is the same storage), plus 4 bytes of fp32
                                log-sum-exp per local head
                 3 i a          gate, SiLU(gate) and up of a gated MLP (1 i: fc1's output otherwise)
                 inputs         what the adapters' A read and keep for A's gradient. A frozen
                                base keeps no input (bitsandbytes' 4-bit matmul saves only the
                                packed weight; a frozen bf16 linear, none), and A reads x itself: under autocast its
                                matmul takes bf16 x uncast, in fp32 x has the adapters' dtype
                                already. So adapters share one tensor per role: h for q/k/v, h
                                for gate/up, i for down_proj (o_proj reads SDPA's output, counted
                                above), times a. With dropout each adapter keeps its own dropped
                                copy (its local in-width, times a) and a mask (1 byte on CUDA; on
                                CPU an a-byte noise tensor, which the estimate takes as 4 bytes:
                                it assumes CUDA whenever a < 4)
                 n r a          each adapter's A output, kept by B (n adapters per layer)
                                (a rowwise adapter's A output shares the base output's all-reduce
                                buffer, then is copied out: B keeps r columns, not the buffer)
                 int8 only      LLM.int8 keeps each matmul's input too (the adapters' tensor
                                when they share it; its own per role with dropout or no adapter)
               where h is the hidden size and q, kv, i this rank's query, key-value and MLP widths;
               times micro_batch * seq_len * layers. Layer 0's input norm keeps nothing (the
               embedding is frozen, so no gradient flows there), and the final norm's fp32 input
               takes its place. Once per model: under autocast the bf16 copies of the fp32 adapter
               weights (2 bytes per adapter parameter; none for layer 0's q/k/v adapters, whose
               input needs no gradient, which also keep no dropout mask), and RoPE's cos and sin
               (2 x seq_len x head_dim x a). Checked against saved-tensor hooks on CPU (exact, byte
               for byte, at tp 1 and 2, fp32 and bf16 autocast, with and without dropout but for
               the CPU noise size noted above). Norms on the queries and keys (Qwen3, Gemma 3)
               keep their fp32 inputs and rsqrt rows: 4 (q + kv) + 4 x their rows per token
  experts      a layer whose MLP is fused experts (a mixture of experts) keeps, instead of a dense
               MLP's terms, the experts' input (h a: they run checkpointed with a quantized base
               or expert adapters) and the routing: k int64 ids, k weights in fp32 and in a, the
               router's fp32 probabilities over the E experts, 4 bytes of their sum, per token;
               a shared expert's linears add a dense MLP's terms. Dense and expert layers are
               summed, each kind from its own first layer (DeepSeek-V3's first layers are
               dense). Routers differ: within 2% of the saved bytes for Qwen3-MoE, Mixtral and
               OLMoE shapes, 6% for Qwen2-MoE's (its gated shared expert keeps its output)
  compiled     activations instead, with `compiled=True` (`qm.compile_blocks`: each block one
               inductor graph): a block keeps what AOTAutograd's min-cut partitioner returns from
               the compiled forward for the backward, not what eager autograd keeps: it recomputes
               cheap elementwise work (the norms' fp32 upcasts and normalization, SiLU) from what
               it keeps, per layer and token:
                 2 (h a + 4)    the two norms' inputs as the residual stream holds them (the
                                block's input and the residual after attention: a bytes, not fp32)
                                and their fp32 rsqrt rows
                 (2 q + 2 kv) a v, q and k after RoPE, SDPA's output; 4 bytes of log-sum-exp per
                                local head (as eager)
                 2 i a          gate and up (SiLU(gate) is recomputed)
                 n r a          the adapters' A outputs (as eager)
               in all (2 h + 2 q + 2 kv + 2 i + n r) a + 8 + 4 x local heads. That is with
               `compile_blocks`' default `recompute_elementwise`: the adapters' shared inputs (the
               two norms' outputs and down_proj's input SiLU(gate) * up) are recomputed in
               backward from what the block keeps, and so are autocast's bf16 copies of the
               adapter weights, except in layer 0, which keeps its input norm's output (h a; its
               input is not kept). With `recompute_elementwise=False` (torch's own partitioner
               rules, which never recompute what the backward holds for a matmul) a block keeps
               those inputs too, (h, h, i) a, and the weight copies as eager: (4 h + 2 q + 2 kv +
               3 i + n r) a + 8 + 4 x local heads, where eager keeps 8 h + (2 h + 2 q + 2 kv + 4 i
               + n r) a + 8 + 4 x local heads. Layer 0's block keeps neither its input nor that
               rsqrt row (no gradient flows into it); the final norm runs eager and keeps its fp32
               input (4 h + 4). RoPE's tables and the logits are as eager. The 4-bit
               matmul keeps only its packed weight and quant state in the graph too (the input is
               not saved). dp > 1: DDP runs the blocks under dynamo's DDPOptimizer, which splits
               each compiled block where DDP's first gradient bucket fills
               (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES, 1 MiB, counted back from the
               block's end). When that is at up_proj (down's and up's fp32 adapters pass 1 MiB: 7B's
               shapes with r = 16, tp 1 or 2), SiLU(gate) is the first graph's output and the
               second graph keeps it: + i a per layer and token. Elsewhere the split is not
               modelled (a note says so). Measured on CPU, torch 2.11 inductor (and 2.13 for
               the test), nf4 + bf16 autocast and fp32, at tp 1 and 2, dp 2 (DDP's caps scaled
               down with the model so that it splits where 7B does), at two widths: exact to the
               byte, both from the partitioner's saved forward outputs and from saved-tensor hooks
               (which see the compiled Function's saved tensors, one per storage). CUDA runs the
               same partitioner, whose choices follow op types, not the device; the CUDA graph
               itself was not traced. Dropout, int8 and non-gated MLPs were not measured compiled:
               their eager terms stay (a note says so)
  logits       the peak comes at the start of backward, in cross-entropy's backward: the fp32
               log-softmax kept for it, the gradient nll_loss hands it and the gradient it returns,
               (micro_batch, seq_len, vocab) fp32 each and live together: 12 bytes per logit, on top
               of every saved activation. (The forward's bf16 logits + fp32 copy + log-softmax, 10
               bytes per logit, are gone by then: nothing keeps the logits themselves.) The
               vocabulary is whole: the auto plan's head is colwise_gather. (The chunked
               loss instead holds one chunk of this rank's columns of a colwise_gather head:
               chunk x vocab / tp logits, tp/cross_entropy.py.)
  transient    the largest linear's weight dequantized for a matmul (quantized formats)
  fsdp         with `fsdp=True` (FSDP2 over dp, parallel/fsdp.py) the parts above change so: weights,
               adapters, their gradients and AdamW states are split over dp (each / dp); no DDP
               buckets; `gathered` adds what FSDP holds whole at the peak (the start of backward):
               the root group (embeddings, final norm, head: FSDP2 keeps the root gathered
               between forward and backward) and two of the largest blocks (the one running and
               the one prefetched), each with its adapters, plus one block's unsharded fp32
               adapter gradients before their reduce-scatter. `offload_base=True` moves the
               blocks' shards to host memory (`host`, not in the total) and adds the two blocks'
               shards copied in for their gathers to `transient`. FSDP2's all-gather output is a
               buffer of its own, so the gathered blocks count also at dp = 1. Not yet held
               against measured peaks (docs/benchmarks.md gives the command)

The total is the sum of the parts. Two small parts are not live at the training peak itself and are
kept as a named margin: `grads` (the adapters' gradients exist from their backward until
`zero_grad(set_to_none=True)`, so at the peak, the start of backward, only under gradient
accumulation) and `transient` (no weight is dequantized during cross-entropy's backward).

Assumptions, named so that a measured peak can be held against them: activation checkpointing
off; bf16 autocast on GPU (a = 2) with fp32 adapters, fp32 on CPU (a = 4); SDPA attention without a
padding mask; all weights frozen except the adapters; the loss is cross-entropy over the gathered
logits, upcast to fp32. Left out: allocator rounding and fragmentation, the CUDA context (~0.5 GiB),
framework workspaces (cuBLAS), and buffers a collective backend may still hold (at tp=2 on gloo the
CPU peak was, in some runs, one or two b * s * (h + r) * a buffers higher: the size of a rowwise
adapter's all-reduce). Without
LoRA the estimate is for a forward pass (generation): no gradients, no optimizer; activations are
one layer's temporaries, (4 h + 3 q + 2 kv + 4 i) x a per token (1 i less for a non-gated MLP),
and the logits b * s * vocab * (a + 4).

How close the estimate comes to measured GPU peaks: docs/benchmarks.md, "Figures the code relies on".

Example:
    >>> with qm.empty_model():                                          # doctest: +SKIP
    ...     model = AutoModelForCausalLM.from_config(cfg)
    >>> est = estimate_memory(model, tp=2, quant="nf4", lora=qm.LoraConfig(r=16),
    ...                       seq_len=2048, micro_batch=2)              # doctest: +SKIP
    >>> print(est)                                                      # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..config import check_keep_dequantized, check_offload_base
from .styles import Style

if TYPE_CHECKING:
    from ..config import LoraConfig
    from ..quant.base import QuantConfig, QuantFormat
    from .plan import Entry, Plan, Resolved

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
    """Adapter gradients, fp32 (live at the peak only under gradient accumulation)."""
    optimizer: int = 0
    """AdamW moments, 2 x fp32 per adapter parameter."""
    ddp: int = 0
    """DDP gradient buckets when dp > 1, fp32."""
    activations: int = 0
    """Saved for backward (training), or one layer's worth (forward only)."""
    logits: int = 0
    """Cross-entropy's backward over the logits: fp32 log-softmax and two gradients (+ the head's
    input held at tp > 1)."""
    transient: int = 0
    """The largest dequantized weight during a quantized matmul (+ FSDP offload's copied-in
    shards)."""
    held: int = 0
    """The 4-bit weights held dequantized (`keep_dequantized`), in the compute dtype."""
    gathered: int = 0
    """FSDP: parameters gathered whole at the peak (the root group, two blocks in flight)."""
    host: int = 0
    """FSDP offload: the blocks' shards in host memory (not part of `total`, a device figure)."""
    rank: int = 0
    """The tp rank this estimate is for (the one with the most)."""
    lora_params: int = 0
    """Adapter parameters on this rank (a count, not bytes)."""
    notes: list[str] = field(default_factory=list)
    """Assumptions and caveats that apply to this model."""

    def __post_init__(self) -> None:
        for name in (
            "weights", "lora", "grads", "optimizer", "ddp", "activations", "logits", "held",
        ):  # fmt: skip
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
            + self.held
            + self.gathered
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
            ("4-bit weights held dequantized", self.held),
            ("FSDP: gathered (root + 2 blocks)", self.gathered),
        ]
        w = max(len(r[0]) for r in rows)
        lines = [f"  {name.ljust(w)}  {format_bytes(v):>10}" for name, v in rows if v]
        lines.append(f"  {'total'.ljust(w)}  {format_bytes(self.total):>10}")
        if self.host:
            lines.append(f"  {'(host: offloaded base)'.ljust(w)}  {format_bytes(self.host):>10}")
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
    rotary: bool = False
    qk_norm: str | None = None
    """A norm on the queries and keys (Qwen3, OLMo 2, Gemma 3): "head" (per head), "all" (over a
    projection's whole output) or None."""


def _qk_norm(model: nn.Module, head_dim: int) -> str | None:
    """Whether the first layer's attention norms its queries (a `q_norm` module), per head or
    over the whole projection, by the norm weight's size."""
    for fqn, m in model.named_modules():
        if fqn.rsplit(".", 1)[-1] == "q_norm":
            w = getattr(m, "weight", None)
            if w is None:
                return None
            return "head" if w.numel() == head_dim else "all"
    return None


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
    rotary = any(
        getattr(cfg, k, None) is not None for k in ("rope_parameters", "rope_theta", "rotary_dim")
    )
    return _Dims(h, layers, heads, kv, hd, int(inter), vocab, rotary, _qk_norm(model, hd))


def estimate_memory(
    model: nn.Module,
    *,
    tp: int = 1,
    dp: int = 1,
    plan: Plan | dict[str, str] | None = None,
    quant: str | QuantConfig | None = None,
    lora: LoraConfig | None = None,
    seq_len: int = 2048,
    micro_batch: int = 1,
    dtype: torch.dtype = torch.float32,
    act_bytes: int | None = None,
    compiled: bool = False,
    recompute_elementwise: bool = True,
    checkpointing: bool = False,
    offload_activations: bool = False,
    loss_chunk_tokens: int = 0,
    tile_tokens: int | None = None,
    checkpointed_blocks: int | None = None,
    fsdp: bool = False,
    offload_base: bool = False,
    keep_dequantized: bool = False,
    held_blocks: int | None = None,
) -> MemoryEstimate:
    """Bytes one rank needs to train (with `lora`) or run (without) `model` under the plan.

    `model` may be a meta skeleton (`qm.empty_model()`); only shapes are read. `dtype` is the dtype of
    unquantized weights; `act_bytes` the activation size (default: 2 for bf16/fp16 `dtype`, else 4).
    `compiled`: the blocks are compiled (`qm.compile_blocks`), so their activations are what the
    compiled graphs save (module docstring, "compiled"), less than eager autograd keeps;
    `recompute_elementwise` as `compile_blocks`' (on by default: the norms' outputs, SiLU(gate) * up
    and the adapters' autocast weight copies are recomputed in backward, not kept).
    `checkpointing` (`qm.checkpoint_blocks`): each block keeps only its input, one block's
    activations live at a time (recomputed in backward); `offload_activations`: those inputs are in
    host memory. `loss_chunk_tokens` > 0: the chunked loss (train/loss.py), one chunk of logits at a
    time plus the labelled tokens' final hidden states. `tile_tokens` (with `checkpointing`): the
    MLP runs that many tokens at a time (`checkpoint_blocks(tile_tokens=...)`), so its
    intermediates and its backward's gradients are one tile's (the block's backward then peaks in
    its attention, whose gradients are not tiled). `checkpointed_blocks` (with `checkpointing`):
    only that many blocks are (`checkpoint_blocks(blocks=...)`, all when None); the others keep
    their activations, untiled. `fsdp` / `offload_base`: as
    `qm.parallelize(fsdp=..., offload_base=...)` (module docstring, "fsdp"). `keep_dequantized`:
    the 4-bit linears' weights are also held dequantized (`qm.keep_dequantized`), at 2 bytes a
    weight with bf16 activations, else 4; `held_blocks` (with it): only those of the first that
    many repeated blocks (`keep_dequantized(blocks=...)`).

    Example:
        >>> est = estimate_memory(model, tp=2, quant="nf4", lora=qm.LoraConfig(r=16),
        ...                       seq_len=512, micro_batch=4, dtype=torch.bfloat16)  # doctest: +SKIP
        >>> est.total / 2**30                                                         # doctest: +SKIP
        1.9
    """
    from ..quant.base import get_format, resolve_quant
    from .auto import auto_plan
    from .plan import Plan

    if seq_len < 1 or micro_batch < 1:
        raise ValueError(f"seq_len={seq_len}, micro_batch={micro_batch}; both must be >= 1")
    if dp < 1 or tp < 1:
        raise ValueError(f"tp={tp}, dp={dp}; both must be >= 1")
    check_offload_base(fsdp=fsdp, offload_base=offload_base)
    if checkpointed_blocks is not None and checkpointed_blocks < 1:
        raise ValueError(
            f"checkpointed_blocks={checkpointed_blocks}; expected >= 1 (or None: all blocks)"
        )
    if isinstance(plan, dict):
        plan = Plan(plan)
    resolved = (plan or auto_plan(model, tp)).resolve(model, tp)
    qcfg = resolve_quant(quant)
    if qcfg is not None:  # as parallelize reads it: the model's own float modules stay float
        qcfg = qcfg.for_model(model)
    fmt = get_format(qcfg) if qcfg is not None else None
    if keep_dequantized:
        check_keep_dequantized(
            quant=qcfg.format if qcfg is not None else None,
            backend=qcfg.backend if qcfg is not None else "bitsandbytes",
        )
    held_in: tuple[str, ...] | None = None  # the names under which weights are held; None: all
    if held_blocks is not None:
        from .auto import blocks_of

        found = blocks_of(model)
        if not keep_dequantized or not 1 <= held_blocks <= len(found):
            raise ValueError(
                f"held_blocks={held_blocks} (keep_dequantized={keep_dequantized}): expected 1 to "
                f"{len(found)} (the model's repeated blocks) with keep_dequantized=True, or None"
            )
        held_in = tuple(f"{name}." for name, _ in found[:held_blocks])
    a = act_bytes or (2 if dtype in (torch.bfloat16, torch.float16) else 4)
    best: MemoryEstimate | None = None
    for r in range(tp):
        est = _for_rank(
            model, resolved, r, qcfg, fmt, lora, dtype, a, seq_len, micro_batch, dp, compiled,
            (checkpointing, offload_activations, loss_chunk_tokens, tile_tokens,
             checkpointed_blocks), lean=compiled and recompute_elementwise, held_in=held_in,
        )  # fmt: skip
        if not keep_dequantized:
            est.held = 0
        if fsdp:
            _shard_over_dp(est, model, resolved, r, qcfg, fmt, lora, dtype, dp, offload_base)
        if best is None or est.total > best.total:
            best = est
    assert best is not None
    return best


def _shard_over_dp(
    est: MemoryEstimate,
    model: nn.Module,
    resolved: Resolved,
    rank: int,
    qcfg: QuantConfig | None,
    fmt: QuantFormat | None,
    lora: LoraConfig | None,
    dtype: torch.dtype,
    dp: int,
    offload: bool,
) -> None:
    """Turn a replica's estimate into FSDP's (module docstring, "fsdp"), in place."""
    from .auto import blocks_of

    def ceil(n: float) -> int:
        return -(-int(n) // dp)

    blocks = blocks_of(model)
    if not blocks:
        est.notes.append("fsdp: no repeated blocks found; the estimate is a plain replica's")
        return
    # one block's weights and adapters, measured by estimating a one-block model's parts: the
    # blocks of a model are alike, so per block = (whole - root) / n_blocks
    root = _root_bytes(model, resolved, rank, qcfg, fmt, dtype, {n for n, _ in blocks})
    block_w = (est.weights - root) / len(blocks)
    block_lora = est.lora / len(blocks)
    blocks_total = est.weights - root
    est.weights = ceil(root) + (0 if offload else ceil(blocks_total))
    est.host = ceil(blocks_total) if offload else 0
    if offload:
        est.transient += 2 * ceil(block_w)
    est.gathered = int(root + 2 * (block_w + block_lora) + (block_lora if lora else 0))
    est.lora, est.grads, est.optimizer, est.ddp = (
        ceil(est.lora),
        ceil(est.grads),
        ceil(est.optimizer),
        0,
    )
    est.notes.append(
        f"fsdp over dp={dp}: parameters, adapter gradients and AdamW states split over dp; "
        "the root group and two blocks gathered at the peak"
        + ("; the blocks' shards in host memory (CPUOffloadPolicy)" if offload else "")
        + " (a model, not yet held against measured peaks)"
    )


def _root_bytes(
    model: nn.Module,
    resolved: Resolved,
    rank: int,
    qcfg: QuantConfig | None,
    fmt: QuantFormat | None,
    dtype: torch.dtype,
    block_names: set[str],
) -> int:
    """Bytes of the parameters outside the repeated blocks (FSDP's root group) on tp rank `rank`,
    counted as `_for_rank` counts weights (quantized where the format applies)."""
    from ..tp.kinds import kind_of

    dt_bytes = torch.empty((), dtype=dtype).element_size()
    seen: set[int] = set()
    total = 0.0
    for fqn, mod in model.named_modules():
        if any(fqn == b or fqn.startswith(b + ".") for b in block_names):
            continue
        entry = resolved.entries.get(fqn)
        kind = kind_of(mod)
        quantized = (
            fmt is not None and qcfg is not None and kind is not None and kind.linear_like
            and qcfg.selects(fqn) and not qcfg.skips(fqn)
        )  # fmt: skip
        for pname, p in mod.named_parameters(recurse=False):
            if id(p) in seen and not quantized:
                continue
            seen.add(id(p))
            if kind is None:
                total += p.numel() * (dt_bytes if p.is_floating_point() else p.element_size())
                continue
            in_f, out_f = kind.in_out(mod)
            style = (
                entry.style if entry is not None and entry.split is not None else Style.REPLICATE
            )
            in_l = _local(in_f, entry, rank) if style.splits_input else in_f
            out_l = _local(out_f, entry, rank) if style.is_colwise else out_f
            if pname == "weight":
                n = in_l * out_l * (p.numel() // max(1, in_f * out_f))
                total += n * fmt.bytes_per_param(in_l) if quantized and fmt else n * dt_bytes
            else:
                total += (out_l if style.is_colwise else p.numel()) * dt_bytes
    return int(total)


def _local(n: int, entry: Entry | None, rank: int) -> int:
    """This rank's share of a dimension of size n split by `entry` (n when not split)."""
    if entry is None or entry.split is None:
        return n
    return entry.split.size(rank)


def _for_rank(
    model: nn.Module,
    resolved: Resolved,
    rank: int,
    qcfg: QuantConfig | None,
    fmt: QuantFormat | None,
    lora: LoraConfig | None,
    dtype: torch.dtype,
    a: int,
    seq: int,
    mb: int,
    dp: int,
    compiled: bool = False,
    memory_modes: tuple[bool, bool, int, int | None, int | None] = (False, False, 0, None, None),
    lean: bool = False,
    held_in: tuple[str, ...] | None = None,
) -> MemoryEstimate:
    from ..lora.adapter import lora_targets
    from ..tp.experts import expert_lora_targets, find_experts, local_sizes
    from ..tp.kinds import kind_of

    est = MemoryEstimate(rank=rank)
    dt_bytes = torch.empty((), dtype=dtype).element_size()
    seen: set[int] = set()
    largest_dq = 0
    # fqn -> (in, out, local in, local out) of linear-like modules
    widths: dict[str, tuple[int, int, int, int]] = {}
    experts = find_experts(model)
    expert_names = [f"{f}.{t.name}" for f, ts in experts.items() for t in ts]
    expert_lora = (
        expert_lora_targets(experts, lora_targets(model, lora, extra=expert_names))
        if lora is not None
        else {}
    )
    moe_layers: set[int] = set()
    moe_shape = (0, 0)  # (experts, this rank's intermediate features of one)
    moe_checkpointed = False
    for fqn, mod in model.named_modules():
        own = list(mod.named_parameters(recurse=False))
        if not own:
            continue
        if fqn in experts:  # expert tensors: split like ShardedExperts, quantized when selected
            q = fmt is not None and qcfg is not None and qcfg.selects(fqn) and not qcfg.skips(fqn)
            sizes = local_sizes(mod, experts[fqn], resolved.tp, rank)
            second = next(t for t in experts[fqn] if not t.first)
            if (layer := _layer_of(fqn)) is not None:
                moe_layers.add(layer)
            moe_shape = (int(getattr(mod, "num_experts", 1)), sizes[second.name][1][0])
            moe_checkpointed = moe_checkpointed or q or fqn in expert_lora
            deq = 0
            for name, (n, (in_l, out_l)) in sizes.items():
                est.weights += int(n * fmt.bytes_per_param(in_l)) if q and fmt else n * dt_bytes
                deq += n * (2 if a == 2 else 4)
                if name in expert_lora.get(fqn, []):
                    assert lora is not None  # expert_lora comes from it
                    e = int(getattr(mod, "num_experts", 1))
                    est.lora_params += lora.r * e * (in_l + out_l)
            first = next(t for t in experts[fqn] if t.first)
            share = (sizes[first.name][0], mod._parameters[first.name].numel())  # local / whole
            for pname, p in own:  # biases: the first projection's split, the second's whole
                if pname not in sizes:
                    n = p.numel() * share[0] // share[1] if pname == first.bias else p.numel()
                    est.weights += n * dt_bytes
            # the forward dequantizes both tensors (and adds the adapters' deltas), and backward
            # holds one tensor's gradient too
            extra = deq if fqn in expert_lora else 0
            largest_dq = max(largest_dq, (deq if q else 0) + extra + extra // 2)
            continue
        entry = resolved.entries.get(fqn)
        kind = kind_of(mod)
        quantized = (
            fmt is not None
            and qcfg is not None  # fmt is its format
            and kind is not None
            and kind.linear_like
            and qcfg.selects(fqn)
            and not qcfg.skips(fqn)
        )
        if kind is not None:
            in_f, out_f = kind.in_out(mod)
            style = (
                entry.style if entry is not None and entry.split is not None else Style.REPLICATE
            )
            in_l = _local(in_f, entry, rank) if style.splits_input else in_f
            out_l = _local(out_f, entry, rank) if style.is_colwise else out_f
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
                    assert fmt is not None
                    est.weights += int(n * fmt.bytes_per_param(in_l))
                    largest_dq = max(largest_dq, n * (2 if a == 2 else 4))
                    if held_in is None or fqn.startswith(held_in):  # (kept only if asked)
                        est.held += n * (2 if a == 2 else 4)
                else:
                    est.weights += n * dt_bytes
            else:  # bias: split with the outputs of a colwise layer, whole otherwise
                n = out_l if style.is_colwise else p.numel()
                est.weights += n * dt_bytes
    est.transient = largest_dq
    moe = (
        _Moe(
            frozenset(moe_layers),
            experts=moe_shape[0],
            top_k=_top_k(model),
            inter=moe_shape[1],
            checkpointed=moe_checkpointed,
        )  # fmt: skip
        if experts
        else None
    )

    targets = (
        [
            t
            for t in lora_targets(model, lora, extra=expert_names)
            if t in widths  # linear-like modules (expert tensors are counted above)
        ]
        if lora is not None
        else []
    )
    for fqn in targets:
        assert lora is not None  # targets come from it
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
    if moe is not None and lora is not None:
        est.notes.append(
            "mixture of experts: the experts keep their input and the routing"
            + ("" if moe.checkpointed else " and each routed copy's intermediates")
            + "; the routing's terms differ by router (measured within 10% of the saved bytes "
            "on CPU, eager): the activations are approximate"
        )
    act, logits, workspace, mlp_tok, attn_workspace = _activations(
        dims, resolved, rank, widths, targets, lora, fmt, a, seq, mb, dp, compiled, est.notes,
        lean=lean, moe=moe,
    )  # fmt: skip
    ckpt, offload, chunk, tile, k = memory_modes
    tokens = seq * mb
    if k is not None and k > dims.layers:
        raise ValueError(f"checkpointed_blocks={k}, but the model has {dims.layers} layers")
    k = dims.layers if k is None else k
    if ckpt and lora is not None and k < dims.layers:
        # Some blocks checkpointed (recompute.spread: never the last): the others keep their
        # activations, and the peak is at the start of backward, when the last block's backward
        # runs over all that is kept: L - k layers' activations, k block inputs and the last
        # block's backward workspace.
        per_layer = act // dims.layers
        act = (dims.layers - k) * per_layer + max(workspace, attn_workspace)
        act += 0 if offload else k * tokens * dims.hidden * a
        est.notes.append(
            f"checkpointing {k} of {dims.layers} blocks: {dims.layers - k} keep their "
            f"activations (about {format_bytes(per_layer)} each), {k} their inputs"
            + (" in host memory" if offload else "")
        )
    elif ckpt and lora is not None:
        # Each block keeps its input (the residual stream, h wide) unless offloaded; the one block
        # being recomputed holds its own activations (one layer's share of `act`) and, during its
        # backward, the MLP's gradients (`workspace`): without checkpointing that is one layer's
        # transient against L layers' saved activations, with it comparable to what is saved
        # (left out, the estimate fell far under a measured peak: docs/benchmarks.md, "Figures the code relies on").
        one_block = act // dims.layers
        if tile is not None and tokens > tile * mb:
            # Tiled MLP: its intermediates and gradients are one tile's (tile x mb tokens); the
            # tiles' inputs (h wide) are what the inner checkpoints keep.
            one_block -= (tokens - tile * mb) * mlp_tok - tokens * dims.hidden * a
            workspace = workspace * tile * mb // tokens
            est.notes.append(f"tile_tokens={tile}: the MLP one tile at a time")
        # The block's backward peaks in its MLP or in its attention, whichever needs more: untiled
        # that is the MLP; with one tile's MLP, the attention's gradients, untiled (the MLP's
        # workspace alone fell under measured tiled peaks: docs/benchmarks.md, "Figures the code relies on").
        act = one_block + max(workspace, attn_workspace)
        act += 0 if offload else dims.layers * tokens * dims.hidden * a
        est.notes.append(
            "checkpointing: block inputs"
            + (" in host memory" if offload else "")
            + " + one block's activations (held against GPU peaks, eager and compiled: docs/benchmarks.md)"
        )
    if chunk > 0 and lora is not None and tokens > chunk:
        # One chunk's logits at a time (12 bytes per logit with their gradient), plus one tensor
        # of the labelled tokens' hidden-state size kept for backward (a frozen head: their
        # gradient, made in the forward; else the hidden states, for the chunks' recompute;
        # train/loss.py). A head split over tp
        # (colwise_gather) is not gathered: this rank's columns only (tp/cross_entropy.py).
        logits = chunk * _head_columns(model, resolved, widths, dims.vocab) * 12
        logits += tokens * dims.hidden * a
    est.activations, est.logits = act, logits
    return est


def _head_columns(
    model: nn.Module, resolved: Resolved, widths: dict[str, tuple[int, int, int, int]], vocab: int
) -> int:
    """The logits' columns one rank computes in the chunked loss: its share of a head split
    colwise_gather (the vocab-parallel loss reads them ungathered), else the whole `vocab`."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    fqn = next((n for n, m in model.named_modules() if m is head), None) if head else None
    entry = resolved.entries.get(fqn) if fqn is not None else None
    if entry is None or entry.style != Style.COLWISE_GATHER or entry.split is None:
        return vocab
    if not entry.split.contiguous() or fqn not in widths:
        return vocab
    return widths[fqn][3]


@dataclass(frozen=True)
class _Moe:
    """The experts of a model, as the activation terms need them: their layers, how many experts,
    how many a token is routed to, this rank's intermediate features of one expert, and whether
    they run checkpointed (a quantized base or expert adapters: tp/experts.py)."""

    layers: frozenset[int]
    experts: int
    top_k: int
    inter: int
    checkpointed: bool


def _activations(
    dims: _Dims,
    resolved: Resolved,
    rank: int,
    widths: dict[str, tuple[int, int, int, int]],
    targets: list[str],
    lora: LoraConfig | None,
    fmt: QuantFormat | None,
    a: int,
    seq: int,
    mb: int,
    dp: int = 1,
    compiled: bool = False,
    notes: list[str] | None = None,
    lean: bool = False,
    moe: _Moe | None = None,
) -> tuple[int, int, int, int, int]:
    """(activation bytes, logits bytes, one block's backward workspace, the MLP's share of a
    layer's activations per token, the attention's backward workspace) from the per-layer formula
    in the module docstring; `lean`: compiled with `recompute_elementwise`. The workspace is the
    MLP's widest gradients, live together in its backward: the down projection's input gradient
    and, gated, those of gate and up; the attention's are the gradients of SDPA's output, q, k and
    v and flash attention's fp32 accumulator of q's gradient. A model with experts (`moe`) sums
    its dense and its expert layers, each kind by its own first layer: an expert layer's MLP
    keeps the experts' input and the routing (the experts run checkpointed), plus the dense
    terms of a shared expert's linears."""
    h, hd = dims.hidden, dims.head_dim
    q_full, kv_full = dims.heads * hd, dims.kv_heads * hd

    def local_width(full_out: int) -> int:
        # This rank's width of a colwise projection with `full_out` outputs (first one found).
        for e in resolved.entries.values():
            if e.split is not None and e.style == Style.COLWISE and e.split.full == full_out:
                return e.split.size(rank)
        return full_out

    q, kv = local_width(q_full), local_width(kv_full)
    tokens = seq * mb
    notes = notes if notes is not None else []
    expert_layers = moe.layers if moe is not None else frozenset()
    dense = [n for n in range(dims.layers) if n not in expert_layers]
    kinds = [(len(dense), _block(widths, dense[0]) if dense else [], False)]
    if moe is not None and expert_layers:
        kinds.append((len(expert_layers), _block(widths, min(expert_layers)), True))
    kinds = [k for k in kinds if k[0]]

    def mlp_of(block: list[str], routed: bool) -> tuple[bool, int]:
        """(gated, this rank's intermediate width) of a block's dense MLP linears; a layer with
        experts only has none (0)."""
        if not routed:  # told apart by their full widths
            gated = sum(1 for f in block if widths[f][0] == h and widths[f][1] == dims.inter) >= 2
            return gated, local_width(dims.inter)
        roles_of = _roles(block)
        ins = [f for f in block if roles_of[f] == "mlp_in" and widths[f][0] == h]
        outs = [f for f in block if roles_of[f] == "mlp_out"]
        if not outs:
            return False, 0
        return len(ins) >= 2, widths[outs[0]][2]  # the down projection's local in-width

    def routed_keep() -> int:
        """Bytes an expert layer's MLP keeps per token for the experts: checkpointed, their
        input (h a) and the routing (the ids, int64; the weights, fp32 and in a; the router's
        fp32 probabilities over every expert; their sum); else also each routed copy's
        intermediates (gate, up and their product: 3 i a)."""
        assert moe is not None
        keep = h * a + 4 * moe.experts + moe.top_k * (8 + 4 + a) + 4
        if not moe.checkpointed:
            keep += moe.top_k * 3 * moe.inter * a
        return keep

    if compiled and lora is None:
        notes.append(
            "compiled=True: without LoRA nothing is saved; the forward estimate is eager's"
        )
    elif compiled:
        unmeasured = [
            what
            for what, cond in (
                ("LoRA dropout", lora is not None and lora.dropout > 0),
                ("int8", fmt is not None and fmt.name == "int8"),
                ("a non-gated MLP", any(not mlp_of(b, r)[0] for _, b, r in kinds if not r)),
                ("experts", moe is not None),
                ("q and k norms", dims.qk_norm is not None),
            )
            if cond
        ]
        if unmeasured:
            notes.append(
                f"compiled=True with {', '.join(unmeasured)}: not measured; those terms are eager's"
            )
    if lora is None:
        # Forward only: no autograd graph; one layer's temporaries at a time, plus the logits.
        one_layer = 0
        for _, block, routed in kinds:
            gated, i = mlp_of(block, routed)
            mlp_keep = (3 if gated else 1) * i
            moe_tmp = moe.top_k * 3 * moe.inter if routed and moe is not None else 0
            one = tokens * (4 * h + 3 * q + 2 * kv + mlp_keep + i + moe_tmp) * a
            one_layer = max(one_layer, one)
        return int(one_layer), int(tokens * dims.vocab * (a + 4)), 0, 0, 0

    copies = lora.dropout > 0
    adapted = set(targets)
    # Compiled with recompute_elementwise, the shared inputs are recomputed in backward: the norms'
    # outputs from the norms' inputs and rsqrt rows, SiLU(gate) * up from gate and up, all kept.
    lean = lean and not copies
    mask = 1 if a < 4 else 4  # a dropout mask: bool on CUDA (fused kernel); fp32 noise on CPU

    def per_token(block: list[str], routed: bool) -> tuple[int, int, int]:
        """(bytes one layer of this kind keeps per token, its MLP's share, its MLP's backward
        workspace per token)."""
        gated, i = mlp_of(block, routed)
        mlp_keep = (3 if gated else 1) * i  # gate, SiLU(gate), up  |  fc1 output
        if compiled and gated:
            mlp_keep = 2 * i  # the compiled backward recomputes SiLU(gate) from gate
        roles_of = _roles(block)
        mine = [f for f in block if f in adapted]
        roles = {roles_of[f] for f in mine}
        # The one tensor each role's adapters read when they need no copy. o_proj reads the
        # attention output, which SDPA keeps anyway (counted above), so it adds nothing. In an
        # expert layer the experts keep the MLP's input themselves (routed_keep).
        shared = {"attn_in": h, "mlp_in": 0 if routed else h, "attn_out": 0, "mlp_out": i}
        # Only dropout gives an adapter its own input: under autocast A's matmul reads x itself
        # (bf16, no cast), and without autocast x already has the adapters' dtype (fp32), so
        # `.to` is a no-op.
        kept = dict.fromkeys(shared, 0) if lean else shared
        # the two RMSNorm inputs, upcast to fp32 (eager); compiled, as they are (the upcast is
        # redone)
        per_tok = 2 * (h * a if compiled else 4 * h)
        per_tok += 2 * 4  # and their fp32 rsqrt(mean(x^2)) rows
        per_tok += (2 * q + 2 * kv) * a  # SDPA: q and k after RoPE, v, and its output
        per_tok += 4 * (q // hd)  # SDPA's fp32 log-sum-exp, one per local head
        if dims.qk_norm is not None:
            # the q and k norms keep their fp32 inputs and rsqrt rows (per head, or one a token)
            rows = (q + kv) // hd if dims.qk_norm == "head" else 2
            per_tok += 4 * (q + kv) + 4 * rows
        per_tok += mlp_keep * a
        adapter_inputs = sum(widths[f][2] for f in mine)  # local in-width of each adapter's A
        if copies:
            per_tok += adapter_inputs * a
        else:
            per_tok += sum(kept[r] for r in roles) * a
        if fmt is not None and fmt.name == "int8":
            # LLM.int8's matmul keeps its input for backward: every role's shared input, once.
            per_tok += sum(shared[r] for r in shared if copies or r not in roles) * a
        per_tok += len(mine) * lora.r * a  # A's output, kept by B (a rowwise adapter copies it
        # out of the all-reduce buffer it shared with the base output, so that buffer is not
        # kept: r, not out + r)
        if lora.dropout > 0:
            per_tok += adapter_inputs * mask
        split = _ddp_split_at(block, mine, widths, lora, roles_of) if compiled and dp > 1 else None
        if split == "up":
            per_tok += i * a  # SiLU(gate): the first split graph's output, kept by the second
        elif split is not None:
            notes.append(
                f"compiled=True, dp > 1: DDPOptimizer splits each block at {split} (not "
                "measured; only a split at up_proj is in the estimate)"
            )
        mlp_tok = (mlp_keep + (kept["mlp_out"] if "mlp_out" in roles and not copies else 0)) * a
        work = (3 if gated else 2) * i * a
        if routed:
            keep = routed_keep()
            per_tok += keep
            mlp_tok += keep
            assert moe is not None
            # the experts' recompute and backward: gate, up and their product per routed copy
            work = max(work, moe.top_k * 3 * moe.inter * a)
        return per_tok, mlp_tok, work

    # Layer 0's input norm keeps nothing (the embedding is frozen: no gradient flows back there);
    # the final norm keeps its fp32 input instead: L layers' worth in all.
    act = mlp_tok = work = 0
    for n, block, routed in kinds:
        per_tok, mlp_kind, work_kind = per_token(block, routed)
        act += tokens * n * per_tok
        mlp_tok, work = max(mlp_tok, mlp_kind), max(work, work_kind)
    if compiled:
        # That norm input was counted as h a (the compiled blocks'); the final norm is eager: fp32.
        act += tokens * (4 * h - h * a)
    # Layer 0's attention-input adapters read that norm's output, which needs no gradient either:
    # no dropout mask and no weight cast is kept for them (A's input, kept for A's gradient, is).
    block0 = _block(widths, 0)
    roles0 = _roles(block0)
    first = [f for f in block0 if f in adapted and roles0[f] == "attn_in"]
    if lora.dropout > 0:
        act -= tokens * sum(widths[f][2] for f in first) * mask
    if lean and first:
        # Layer 0 keeps its input norm's output for its adapters instead: that norm's input is
        # not kept (above), so the output cannot be recomputed from it.
        act += tokens * h * a
    if a < 4 and not lean:
        # Autocast's bf16 copies of the fp32 adapter weights, kept by their matmuls for backward
        # (compiled with recompute_elementwise, cast again in backward).
        act += sum(lora.r * (widths[f][2] + widths[f][3]) for f in targets) * a
        act -= sum(lora.r * widths[f][2] for f in first) * a
    if dims.rotary:
        act += 2 * seq * hd * a  # RoPE's cos and sin, one (seq, head_dim) each, shared by layers
    # Cross-entropy's backward: the fp32 log-softmax kept for it, the gradient nll_loss hands it and
    # the gradient it returns, all (b, s, vocab) fp32 and all live at once: 12 bytes per logit.
    # (A split head's input is not held past its forward: copy shares are emptied by their
    # parent's forward hook, and the head has no colwise sibling to share with.)
    logits = tokens * dims.vocab * 12
    workspace = tokens * work
    # The attention's backward, live together: the gradient of SDPA's output, those of q, k and v,
    # and (eager) a further 4 bytes per q feature, the size of an fp32 q-gradient accumulator.
    # Compiled blocks leave that term out: their measured peaks came closer without it
    # (docs/benchmarks.md, "Figures the code relies on").
    attn_workspace = tokens * ((2 * q + 2 * kv) * a + (0 if compiled else 4 * q))
    return int(act), int(logits), int(workspace), int(mlp_tok), int(attn_workspace)


def _ddp_split_at(
    block: list[str],
    mine: list[str],
    widths: dict[str, tuple[int, int, int, int]],
    lora: LoraConfig,
    roles_of: dict[str, str],
) -> str | None:
    """Where dynamo's DDPOptimizer splits a compiled block: at the adapter whose gradients fill
    DDP's first bucket, counted from the block's end ("down", "up", "gate" for a gated MLP's
    linears, else the FQN; None when the block's adapters never fill it)."""
    try:
        import torch.distributed as dist

        cap = dist._DEFAULT_FIRST_BUCKET_BYTES
    except (ImportError, AttributeError):
        cap = 2**20
    mlp_in = [f for f in block if roles_of.get(f) == "mlp_in"]
    names = {f: n for f, n in zip(mlp_in, ("gate", "up"), strict=False)} if len(mlp_in) == 2 else {}
    names.update({f: "down" for f in block if roles_of.get(f) == "mlp_out"})
    size = 0
    for f in reversed([f for f in block if f in set(mine)]):
        size += lora.r * (widths[f][2] + widths[f][3]) * ADAPTER_BYTES
        if size >= cap:
            return names.get(f, f)
    return None


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


def _top_k(model: nn.Module) -> int:
    """Experts a token is routed to, from the model's config (1 where it names none)."""
    cfg = getattr(model, "config", None)
    cfg = cfg.get_text_config() if cfg is not None and hasattr(cfg, "get_text_config") else cfg
    for name in ("num_experts_per_tok", "moe_top_k", "top_k", "num_experts_per_token"):
        k = getattr(cfg, name, None)
        if isinstance(k, int) and k > 0:
            return k
    return 1


def _layer_of(fqn: str) -> int | None:
    """The layer a module belongs to: the first number in its name (`model.layers.3.mlp`: 3)."""
    for part in fqn.split("."):
        if part.isdigit():
            return int(part)
    return None


def _block(widths: dict, layer: int) -> list[str]:
    """Linear-like modules of repeated block `layer` (all of them where no name has a layer)."""
    block = [f for f in widths if _layer_of(f) == layer]
    return block or ([] if any(_layer_of(f) is not None for f in widths) else list(widths))
