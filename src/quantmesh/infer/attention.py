"""Decode attention: one query token against a static key/value cache, by a split-KV Triton kernel
that never reads the keys the attention mask hides.

A compiled decode step (`fast_decode`) attends one new token per row to transformers'
`StaticCache`, whose every layer holds `max_cache_len` slots (a multiple of 256) of which only
the prompt and the tokens so far are written; transformers' sdpa path (cuDNN's or flash's kernel
through torch's SDPA) reads all of them under a mask. `decode_attention_forward` reads only the
blocks of keys the mask shows: the kernel (`launch_decode_attention`; `_triton_attention.py`)
runs a program per (row, kv head, split of the keys), holding all the query heads of that kv
head (grouped-query attention reads each K/V once for the group); a block of `BLOCK_L` keys none
of whose keys any of those heads sees is skipped before its K and V are loaded (the cache's
unwritten tail costs its mask's bytes only), and within a block only the keys some head sees are
loaded. The softmax runs online in fp32 (elementwise products and sums, no tensor cores: one
query row gains nothing from them), each split writes its (max, sum, output) and a second small
kernel merges them; with one split the first kernel writes the output. Inputs bf16 or fp16, head
dimension up to 256, output in the query's dtype.

Masks: what transformers' sdpa path hands its attention (`sdpa_mask`): None (every key visible),
a bool tensor (batch or 1, heads or 1, 1, keys) where True attends, or a float one added to the
scores (0 / -inf, or very negative: a value at or below `HIDDEN` (-65504, fp16's lowest) counts as
hidden, whose weight fp32 rounds to 0 anyway). A head that sees no key gets zeros.

Wiring: the module registers `IMPLEMENTATION` ("quantmesh_decode") in transformers'
`AttentionInterface` (`decode_attention_forward`) and `AttentionMaskInterface` (sdpa's mask) at
import; `decode_attention(model)` switches a model that runs "sdpa" to it while entered. The
function takes the kernel only with `ENABLED` (on by default; QUANTMESH_DECODE_ATTENTION=0 turns it
off), one query token, one row (`MAX_ROWS`: at 32 rows the kernel was measured slower than
sdpa), inputs on `KERNEL_DEVICES`, bf16/fp16, no dropout and no keyword that changes the math
(softcap, sinks, a position bias, attention weights asked for...); everything else goes to
transformers' own `sdpa_attention_forward` unchanged. The kernel is the custom op
`quantmesh::decode_attention`, so `torch.compile(fullgraph=True)` (CUDA graphs) traces it as one
opaque op.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..config import env_switch
from ..quant import kernel4
from ..quant.kernel4 import _pow2

__all__ = [
    "ENABLED",
    "HIDDEN",
    "IMPLEMENTATION",
    "KERNEL_DEVICES",
    "MAX_ROWS",
    "decode_attention",
    "decode_attention_applies",
    "decode_attention_forward",
    "decode_attention_op",
    "decode_attention_runs",
    "decode_attention_wanted",
    "decode_config",
    "launch_decode_attention",
]

# The kernel in place of sdpa for one query token, where it applies (`decode_attention_applies`):
# on by default where it runs (docs/benchmarks.md, "Figures the code relies on");
# QUANTMESH_DECODE_ATTENTION=0 turns it off.
# Read at call time: a compiled step is guarded on it.
ENABLED = env_switch("QUANTMESH_DECODE_ATTENTION", default=True)
IMPLEMENTATION = "quantmesh_decode"  # the name in transformers' AttentionInterface
# The most rows (batch) the kernel takes; more go to sdpa. The kernel reads keys at about half
# SDPA's rate at one row, which skipping a static cache's unwritten slots repays, and at a third
# of it at 32 rows, which it does not (docs/benchmarks.md, "Figures the code relies on"); 2 to 31
# rows were not timed, so torch's kernel keeps them. Read at call time (a compiled step is
# guarded on the batch); None: any batch (the tests of the wiring).
MAX_ROWS: int | None = 1
# A float mask's values at or below this hide their key (fp16's lowest: transformers' eager masks
# use the dtype's lowest, -inf or below); the kernel skips a block of such keys unread.
HIDDEN = -65504.0
MAX_HEAD_DIM = 256
# decode_config cuts the keys into splits so that a grid holds about this many programs (a few per
# SM of a current data-center GPU), at most MAX_SPLITS (the combine holds them all in one program)
PROGRAMS = 512
MAX_SPLITS = 64
# The keyword arguments a model hands its attention function that leave the math of sdpa's path
# as it is (sdpa_attention_forward ignores them: they describe the inputs, or serve other
# implementations). Any other keyword that is not None (or False) sends the call to sdpa.
NEUTRAL_KWARGS = frozenset({
    "position_ids", "cache_position", "use_cache", "sliding_window", "layer_idx",
    "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx",
    "output_hidden_states", "output_router_logits", "num_items_in_batch", "return_dict",
    "position_embeddings", "past_key_values", "cache", "token_type_ids",
})  # fmt: skip

# Triton runs where it is installed (the GPU images): the 4-bit kernels' finding, a seam of this
# module's own for the tests
_HAS_TRITON = kernel4._HAS_TRITON
# the devices whose inputs the kernel takes (Triton's interpreter runs it on CPU: the tests that
# check the wiring there add "cpu")
KERNEL_DEVICES: tuple[str, ...] = ("cuda",)


def decode_config(batch: int, kv_heads: int, groups: int, head_dim: int,
                  keys: int) -> dict[str, int]:  # fmt: skip
    """The kernel's tiles: BLOCK_L keys a block (the unit of the skip; fewer with more query
    heads a kv head, as a program holds (heads, BLOCK_L, head_dim) products), SPLIT keys a split
    (a multiple of BLOCK_L) so that the grid holds about `PROGRAMS` programs and at most
    `MAX_SPLITS` splits, num_warps. Not yet timed on a GPU: benchmarks/decode_attention_bench.py
    --sweep times the candidates.

    Example:
        >>> cfg = decode_config(1, 32, 1, 128, 512)
        >>> cfg["BLOCK_L"], cfg["SPLIT"], 512 // cfg["SPLIT"]
        (64, 64, 8)
        >>> decode_config(32, 32, 1, 128, 512)["SPLIT"]  # enough programs: one split
        512
    """
    gp, dp = _pow2(groups), _pow2(head_dim)
    block = max(8, min(64, 8192 // (gp * dp)))
    blocks = -(-keys // block)
    splits = max(1, min(blocks, MAX_SPLITS, -(-PROGRAMS // max(1, batch * kv_heads))))
    per = -(-blocks // splits)
    # about 32 products a thread (ptxas for sm_90: 105-170 registers, no spills, at D = 128)
    warps = min(8, max(4, gp * block * dp // 1024))
    return dict(BLOCK_L=block, SPLIT=per * block, num_warps=warps)


def launch_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            mask: torch.Tensor | None, scaling: float,
                            cfg: dict[str, int] | None = None,
                            counts: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """softmax(q k^T * scaling + mask) v for one query token: q (B, Hq, 1, D), k and v
    (B, Hkv, L, D) (any strides; Hq a multiple of Hkv, query head i reading kv head
    i // (Hq / Hkv)), mask None, bool (True attends) or float (added), broadcastable to
    (B, Hq, 1, L); returns (B, 1, Hq, D) in q's dtype, contiguous (what transformers' attention
    functions return). `cfg`: `decode_config`'s keys (default its tiles); `counts`: an int32
    (B * Hkv, splits) tensor that gets the blocks each program read (the tests' check of the
    skip). Anything the kernel does not take is refused before any launch.

    Example:
        >>> out = launch_decode_attention(q, k_cache, v_cache, mask, 128**-0.5)  # doctest: +SKIP
    """
    B, Hq, one, D = q.shape
    Bk, Hkv, L, Dk = k.shape
    if (one != 1 or Bk != B or Dk != D or v.shape != k.shape or Hq % max(Hkv, 1)
            or not 1 <= D <= MAX_HEAD_DIM or L < 1):  # fmt: skip
        raise ValueError(
            f"decode attention takes q (B, Hq, 1, D), k and v (B, Hkv, L, D) with Hq a multiple "
            f"of Hkv and D <= {MAX_HEAD_DIM}, not q {tuple(q.shape)}, k {tuple(k.shape)}, "
            f"v {tuple(v.shape)}"
        )
    if q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"decode attention computes in bf16 or fp16, not {q.dtype}/{k.dtype}")
    groups = Hq // Hkv
    cfg = dict(decode_config(B, Hkv, groups, D, L), **(cfg or {}))
    block, per = cfg["BLOCK_L"], cfg["SPLIT"]
    if block < 1 or block & (block - 1) or per < block or per % block:
        raise ValueError(f"BLOCK_L a power of two and SPLIT a multiple of it, not {cfg}")
    kind, m, m_strides = _mask_args(mask, q, B, Hq, L)
    triton = kernel4._triton()[0]
    from ._triton_attention import qm_decode_attn_combine, qm_decode_attn_split

    splits = triton.cdiv(L, per)
    out = torch.empty((B, 1, Hq, D), dtype=q.dtype, device=q.device)
    if splits == 1:
        m_part = l_part = acc = out  # never read
    else:
        m_part = torch.empty((B * Hq, splits), dtype=torch.float32, device=q.device)
        l_part = torch.empty_like(m_part)
        acc = torch.empty((B * Hq, splits, D), dtype=torch.float32, device=q.device)
    if counts is not None and tuple(counts.shape) != (B * Hkv, splits):
        raise ValueError(f"counts of shape {tuple(counts.shape)}; expected {(B * Hkv, splits)}")
    qm_decode_attn_split[(B * Hkv, splits)](
        q, k, v, m, m_part, l_part, acc, out, out if counts is None else counts,
        Hkv, groups, L, float(scaling) * math.log2(math.e), HIDDEN,
        q.stride(0), q.stride(1), q.stride(3), *k.stride(), *v.stride(), *m_strides,
        per, splits,
        D=D, MASK=kind, BLOCK_L=block, GP=_pow2(groups), DP=_pow2(D), ONE=splits == 1,
        COUNT=counts is not None, num_warps=cfg.get("num_warps", 4), num_stages=1,
    )  # fmt: skip
    if splits > 1:
        qm_decode_attn_combine[(B * Hq,)](m_part, l_part, acc, out, splits, D=D,
                                          SP=_pow2(splits), DP=_pow2(D), num_warps=4)  # fmt: skip
    return out


def _mask_args(mask: torch.Tensor | None, q: torch.Tensor, B: int, Hq: int,
               L: int) -> tuple[int, torch.Tensor, tuple[int, int, int]]:  # fmt: skip
    """(the kernel's MASK: 0 none, 1 bool, 2 float; the tensor it reads, bool as uint8; its
    strides along batch, head and key, 0 along a broadcast dimension)."""
    if mask is None:
        return 0, q, (0, 0, 0)
    if mask.dim() > 4 or (mask.dim() == 4 and mask.shape[2] != 1):
        raise ValueError(f"a decode mask broadcastable to {(B, Hq, 1, L)}, not {tuple(mask.shape)}")
    full = mask.expand(B, Hq, 1, L)  # raises where it does not broadcast
    if full.dtype == torch.bool:
        full, kind = full.view(torch.uint8), 1
    elif full.dtype.is_floating_point:
        kind = 2
    else:
        raise ValueError(f"a bool or float attention mask, not {mask.dtype}")
    return kind, full, (full.stride(0), full.stride(1), full.stride(3))


@torch.library.custom_op("quantmesh::decode_attention", mutates_args=())
def decode_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        mask: torch.Tensor | None, scaling: float) -> torch.Tensor:  # fmt: skip
    """`launch_decode_attention` at `decode_config`'s tiles as the custom op
    `quantmesh::decode_attention` (q (B, Hq, 1, D) -> (B, 1, Hq, D)): one opaque op that
    `torch.compile` traces whole; check `decode_attention_applies` first.

    Example:
        >>> out = decode_attention_op(q, k_cache, v_cache, mask, 128**-0.5)  # doctest: +SKIP
    """
    return launch_decode_attention(q, k, v, mask, scaling)


@decode_attention_op.register_fake
def _(q, k, v, mask, scaling):
    return q.new_empty((q.shape[0], 1, q.shape[1], q.shape[3]))


def decode_attention_applies(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0,
                             **kwargs: Any) -> bool:  # fmt: skip
    """Whether `decode_attention_forward` takes the kernel for these arguments (transformers'):
    `ENABLED` (read at call time), Triton, one query token, at most `MAX_ROWS` rows (one),
    inputs on `KERNEL_DEVICES`, all bf16 or all fp16, q (B, Hq, 1, D) and k, v (B, Hkv, L, D)
    alike with Hq a multiple of Hkv and D <= 256, a mask of None, bool or float broadcastable to
    (B, Hq, 1, L), no dropout, and no keyword outside `NEUTRAL_KWARGS` set (softcap, sinks
    (`s_aux`), a position bias, `output_attentions`...: sdpa's path keeps those).

    Example:
        >>> q = torch.zeros(1, 4, 1, 64, dtype=torch.bfloat16)
        >>> kv = torch.zeros(1, 4, 256, 64, dtype=torch.bfloat16)
        >>> decode_attention_applies(q, kv, kv, None)  # CPU: not a kernel device
        False
    """
    if not ENABLED or not _HAS_TRITON:
        return False
    if any(v is not None and v is not False for n, v in kwargs.items() if n not in NEUTRAL_KWARGS):
        return False
    if dropout != 0.0 or query.dim() != 4 or key.dim() != 4 or query.shape[2] != 1:
        return False
    if query.device.type not in KERNEL_DEVICES or key.device != query.device:
        return False
    if query.dtype not in (torch.bfloat16, torch.float16):
        return False
    if key.dtype != query.dtype or value.dtype != query.dtype or value.device != query.device:
        return False
    B, Hq, _, D = query.shape
    if MAX_ROWS is not None and B > MAX_ROWS:
        return False
    Bk, Hkv, L, Dk = key.shape
    if Bk != B or Dk != D or tuple(value.shape) != (Bk, Hkv, L, Dk) or Hkv < 1 or Hq % Hkv:
        return False
    if not 1 <= D <= MAX_HEAD_DIM or L < 1:
        return False
    return attention_mask is None or _mask_fits(attention_mask, query, B, Hq, L)


def _mask_fits(mask: torch.Tensor, query: torch.Tensor, B: int, Hq: int, L: int) -> bool:
    """A bool or float mask on the query's device, broadcastable to (B, Hq, 1, L)."""
    if mask.device != query.device or not (mask.dtype == torch.bool or mask.is_floating_point()):
        return False
    shape = (1,) * (4 - mask.dim()) + tuple(mask.shape) if mask.dim() <= 4 else None
    want = (B, Hq, 1, L)
    return shape is not None and all(s in (1, w) for s, w in zip(shape, want, strict=True))


def decode_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                             value: torch.Tensor, attention_mask: torch.Tensor | None,
                             dropout: float = 0.0, scaling: float | None = None,
                             is_causal: bool | None = None,
                             **kwargs: Any) -> tuple[torch.Tensor, None]:  # fmt: skip
    """An attention function of transformers' (`AttentionInterface`, as
    `IMPLEMENTATION`): the kernel (`decode_attention_op`) where `decode_attention_applies`,
    else transformers' own `sdpa_attention_forward` with the same arguments. Returns what sdpa's
    does: the output (batch, q_len, heads, head_dim), contiguous, and None. `is_causal` changes
    nothing for one query token (sdpa ignores it there too).

    Example:
        >>> out, _ = decode_attention_forward(attn, q, k_cache, v_cache, mask, scaling=0.088)  # doctest: +SKIP
    """
    if decode_attention_applies(query, key, value, attention_mask, dropout, **kwargs):
        scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
        return decode_attention_op(query, key, value, attention_mask, scale), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    out: tuple[torch.Tensor, None] = sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
        is_causal=is_causal, **kwargs,
    )  # fmt: skip
    return out


def _register() -> None:
    """`IMPLEMENTATION` in transformers' attention functions (`decode_attention_forward`) and
    mask functions (sdpa's: the masks are sdpa's); once, at import, where transformers is."""
    if importlib.util.find_spec("transformers") is None:
        return
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, decode_attention_forward)
    AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)


_register()


@contextlib.contextmanager
def decode_attention(model: nn.Module) -> Iterator[bool]:
    """While entered, every transformers config of `model` (its own, its sub-configs, its
    submodules') that runs "sdpa" runs `IMPLEMENTATION` instead: sdpa's masks and, where
    `decode_attention_applies` (one query token, `ENABLED`...), the kernel, else sdpa itself. The
    model's attention layers read the implementation at call time, so a compiled step traced
    inside is guarded on it. Restored on exit, also on an exception. Configs running anything
    else (eager, flash, flex...) are left alone; entering it again inside changes nothing (the
    outer one restores). Yields whether any config was switched.

    Example:
        >>> with decode_attention(model):  # doctest: +SKIP
        ...     new = qm.fast_decode(model, ids, 64)
    """
    switched = [c for c in _configs(model) if c.__dict__.get(_ATTR) == "sdpa"]
    for c in switched:
        setattr(c, _ATTR, IMPLEMENTATION)  # this config alone: each sub-config is in the list
    try:
        yield bool(switched)
    finally:
        for c in switched:
            if c.__dict__.get(_ATTR) == IMPLEMENTATION:
                setattr(c, _ATTR, "sdpa")


_ATTR = "_attn_implementation_internal"  # what transformers' `config._attn_implementation` reads


def decode_attention_wanted(model: nn.Module) -> bool:
    """Whether `fast_decode` switches `model` to `IMPLEMENTATION` (`decode_attention`): `ENABLED`,
    Triton, and the model's weights on one of `KERNEL_DEVICES`. Elsewhere the kernel could never
    run, and the model keeps its own attention.

    Example:
        >>> decode_attention_wanted(torch.nn.Linear(2, 2))  # CPU
        False
    """
    if not ENABLED or not _HAS_TRITON:
        return False
    first = next(model.parameters(), None)
    return first is not None and first.device.type in KERNEL_DEVICES


def decode_attention_runs(model: nn.Module) -> bool:
    """Whether any transformers config of `model` runs `IMPLEMENTATION` now (inside
    `decode_attention`, for a model that ran "sdpa").

    Example:
        >>> with decode_attention(model):  # doctest: +SKIP
        ...     decode_attention_runs(model)
        True
    """
    return any(c.__dict__.get(_ATTR) == IMPLEMENTATION for c in _configs(model))


def _configs(model: nn.Module) -> list[Any]:
    """The transformers configs of `model`: each submodule's `config` and, recursively, their
    sub-configs, each once."""
    found: dict[int, Any] = {}
    todo = [getattr(m, "config", None) for m in model.modules()]
    while todo:
        c = todo.pop()
        if c is None or id(c) in found or not hasattr(c, "sub_configs"):
            continue
        found[id(c)] = c
        todo.extend(getattr(c, key, None) for key in c.sub_configs)
    return list(found.values())
