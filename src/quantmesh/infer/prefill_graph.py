"""Captured prefills: a decoder's prompt forward replayed as a CUDA graph, one per length bucket.

An eager prefill launches every op of every layer from the host: about 0.15 s on a 7B model
(docs/benchmarks.md, "Figures the code relies on"), against a few milliseconds of GPU work for a
short prompt, so at batch 1 it is a fifth of a 256-token call. `PrefillGraphs` records that forward
once per (batch, bucket) as a CUDA graph, without compiling anything, and replays it: the prompt is
copied into a static buffer of the bucket's length (16, 32, ... `BUCKETS`), right-padded, and the
graph runs the model on it with the static cache, then sets every layer's length back to the
prompt's. The pads' keys and values land in the cache's slots after the prompt, which the decode
steps overwrite one by one and which every query until then is masked from (the cache's slots
past a step's position are hidden), so they are never read. The masks are transformers' own, on
the eager prefill's path (a prompt's token sees the slots up to its own; see `_forward`), and the
logits are those of the last real token (`logits_to_keep` as an index tensor). On CPU a prompt
that fills its bucket gives the eager prefill's values exactly; on a GPU the recording differed from
the eager prefill by about 1% of the logits' norm (the kernels chosen while capturing, not the
path's arithmetic; docs/benchmarks.md, twenty-seventh sitting).

Where it applies (`PrefillGraphs.why_not` says why not): a CUDA model (`DEVICES`) on one rank (a
sharded or replicated model keeps the eager prefill: its collectives would be captured), sdpa or
eager attention (whose masks follow the query offset), a transformers `StaticCache` whose layers
are all plain `StaticLayer`s with a tensor length (sliding windows keep a host-side count a graph
cannot replay), no left-padded rows, a forward that takes `logits_to_keep`, a prompt of at most
`BUCKETS[-1]` tokens whose bucket fits the cache. Elsewhere the prefill runs eagerly, as before.

Safety. A graph reads every tensor at the address it had when it was recorded and replays the
branches the Python code took then. So each call first takes the model's state (`model_state`):
every module's parameters', buffers' and tensor attributes' addresses, shapes and dtypes, the
4-bit statistics, its scalar attributes (its training flag, an adapter's scaling...), its hooks,
the attention implementation, and quantmesh's kernel switches and environment. Any change drops
the graphs and records them again. The first recording of a bucket is checked against the eager
prefill of the same prompt, run just before: where the logits differ by more than `TOLERANCE` of
their norm (a model whose masks or lengths work otherwise, or dropout left on), the decoder keeps
the eager prefill for good and warns. A recording the CUDA runtime refuses (an op that reads a
value back to the host) does the same. (A prompt shorter than its bucket runs the matmuls on more
rows, whose kernels may round otherwise: `TOLERANCE` leaves room for bf16's rounding, far below
what a token that sees a pad would change.)

On by default (`ENABLED`; `QUANTMESH_CAPTURED_PREFILL=0` turns it off). With the recordings'
warm-up on the current stream, a 7B decode's steps keep their time and a call saves most of its
prefill's host time; its CUDA tests pass, the trained model's tokens included (the figures:
docs/benchmarks.md, forty-third sitting). A warm-up on a side stream had left every later
decode step slower (forty-second sitting). A fault after a recording, seen once on a 7B model
(twenty-seventh sitting), has not come back in any run since. Memory: each recorded (batch,
bucket) keeps what its forward allocates (its intermediates and logits) in a memory pool of its
own for as long as the decoder lives; where GPU memory is tight, `QUANTMESH_CAPTURED_PREFILL=0`.

Example:
    >>> graphs = PrefillGraphs(model, cache)                  # doctest: +SKIP
    >>> logits = graphs.replay(input_ids)                     # doctest: +SKIP
"""

from __future__ import annotations

import functools
import inspect
import os
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..config import env_switch
from ..errors import said
from ..quant import kernel4

__all__ = ["BUCKETS", "DEVICES", "ENABLED", "TOLERANCE", "PrefillGraphs", "bucket", "model_state"]

# On by default since its GPU check (tests/distributed/test_cuda_decode.py; the timing in
# docs/benchmarks.md, forty-third sitting).
ENABLED = env_switch("QUANTMESH_CAPTURED_PREFILL", default=True)
"""Whether a compiled decoder replays its prefills as CUDA graphs ($QUANTMESH_CAPTURED_PREFILL=0
turns it off)."""
BUCKETS = (16, 32, 64, 128, 256, 512)  # a prompt is padded to the first that holds it
DEVICES = ("cuda",)  # where a graph is recorded (tests stand in a recorder elsewhere)
TOLERANCE = 0.05  # the first replay's logits against the eager prefill's: relative to their norm

Recorder = Callable[[Callable[[], torch.Tensor]], Callable[[], torch.Tensor]]


def bucket(prompt: int, cache_len: int) -> int | None:
    """The padded length of a `prompt`-token prefill, or None where no bucket holds it in a cache
    of `cache_len` slots.

    Example:
        >>> bucket(20, 256), bucket(600, 1024), bucket(200, 256)
        (32, None, 256)
    """
    for b in BUCKETS:
        if prompt <= b:
            return b if b <= cache_len else None
    return None


_SCALARS = (bool, int, float, str, type(None))
_CALLABLES = (types.FunctionType, types.BuiltinFunctionType, functools.partial)


def model_state(model: nn.Module) -> tuple[Any, ...]:
    """What a recorded forward of `model` depends on beyond its inputs: a value that changes
    whenever a parameter, buffer or tensor attribute is replaced (address, shape, dtype), a
    4-bit weight's statistics are, a module's scalar attribute or hooks change, a module's
    forward is replaced, or the attention implementation, quantmesh's kernel switches or its
    environment variables change. Equal states replay the same graph.

    Example:
        >>> lin = torch.nn.Linear(2, 2)
        >>> before = model_state(lin)
        >>> lin.weight = torch.nn.Parameter(torch.zeros(2, 2))
        >>> model_state(lin) == before
        False
    """
    from . import attention

    out: list[Any] = []
    add = out.append
    scalars, tensor, method, callables = _SCALARS, torch.Tensor, types.MethodType, _CALLABLES
    for m in model.modules():
        add(id(m))
        for k, v in m.__dict__.items():
            if isinstance(v, scalars):
                add(k)
                add(v)
            elif isinstance(v, dict):  # (_parameters, _buffers, _modules, the hooks: below)
                continue
            elif isinstance(v, tensor):
                add(k)
                add(_tensor(v))
            elif isinstance(v, method):  # a forward replaced (bound anew per call)
                add(k)
                add(id(v.__func__))
                add(id(v.__self__))
            elif isinstance(v, callables):
                add(k)
                add(id(v))
        for ts in (m._parameters, m._buffers):
            for k, t in ts.items():
                if t is not None:
                    add(k)
                    add(t.data_ptr())
                    add(t.shape)
                    add(t.dtype)
                    add(t.requires_grad)
                    qs = getattr(t, "quant_state", None)
                    if qs is not None:  # its statistics' addresses
                        for x in kernel4.quant_state_tensors(qs):
                            add(x.data_ptr() if isinstance(x, tensor) else x)
        add(len(m._forward_hooks))
        add(len(m._forward_pre_hooks))
    config = getattr(model, "config", None)
    out.append(getattr(config, "_attn_implementation", None))
    for module in (kernel4, attention):
        out.extend(
            (k, v) for k, v in vars(module).items() if k.isupper() and isinstance(v, _SCALARS)
        )
    out.extend(sorted((k, v) for k, v in os.environ.items() if k.startswith("QUANTMESH_")))
    return tuple(out)


def _tensor(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.data_ptr(), tuple(t.shape), t.dtype, t.requires_grad)


def cuda_graph(
    fn: Callable[[], torch.Tensor], *, warmups: int = 1, pool: Any = None
) -> Callable[[], torch.Tensor]:
    """Record `fn` (run `warmups` times eagerly just before, so that every kernel is built and
    every buffer it keeps exists) as a CUDA graph, in memory pool `pool` (a
    `torch.cuda.graph_pool_handle()` that graphs share; None: its own); returns what replays it
    and gives its output (the same tensor every time).

    The warm-up runs on the current stream, as every eager forward does, not on a side stream:
    one forward of a model on a side stream, nothing recorded, left every later replay of the
    decode step slower for the rest of the process, its kernels no slower (docs/benchmarks.md,
    forty-second sitting; pytorch/pytorch#161104 reports replayed kernels slower once work has
    run on two streams). The capture itself (on `torch.cuda.graph`'s own stream) launches
    nothing. The prefill graphs and the slot engine's captured steps are both recorded here.

    Example:
        >>> replay = cuda_graph(lambda: x * 2)      # doctest: +SKIP
        >>> replay() is replay()                    # doctest: +SKIP
        True
    """
    for _ in range(warmups):
        fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()

    def replay() -> torch.Tensor:
        graph.replay()
        return out

    replay.graph = graph  # type: ignore[attr-defined]  # (kept alive with the replay)
    return replay


class _Entry:
    """One bucket's static inputs and its recorded forward."""

    def __init__(self, batch: int, length: int, device: torch.device) -> None:
        self.ids = torch.zeros(batch, length, dtype=torch.long, device=device)
        self.last = torch.zeros(1, dtype=torch.long, device=device)  # the prompt's last index
        self.prompt = torch.zeros((), dtype=torch.long, device=device)  # its length
        self.replay: Callable[[], torch.Tensor] | None = None

    def fill(self, input_ids: torch.Tensor) -> None:
        n = input_ids.shape[1]
        self.ids[:, :n].copy_(input_ids)
        self.ids[:, n:] = 0  # pads: any token; their slots are overwritten before being read
        self.last.fill_(n - 1)
        self.prompt.fill_(n)


def _empty_offset(layer_idx: int = 0) -> int:
    """A prefill's query offset: 0, the cache being empty (see `PrefillGraphs._forward`)."""
    return 0


class PrefillGraphs:
    """The recorded prefills of one decoder (its model and static cache), per (batch, bucket).

    Example:
        >>> graphs = PrefillGraphs(model, cache)                    # doctest: +SKIP
        >>> graphs.why_not(input_ids, None) is None                 # doctest: +SKIP
        True
        >>> logits = graphs.replay(input_ids)  # None: not recorded yet  # doctest: +SKIP
    """

    def __init__(self, model: nn.Module, cache: Any, record: Recorder | None = None) -> None:
        self.model = model
        self.cache = cache
        self.record = record or cuda_graph
        self.keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.entries: dict[tuple[int, int], _Entry] = {}
        self.state: tuple[Any, ...] | None = None
        self.refused: str | None = None  # why this decoder keeps the eager prefill for good
        self.replays = 0  # prefills replayed (the first replay of each recording included)

    def why_not(self, input_ids: torch.Tensor, padding: Any) -> str | None:
        """Why a prefill of `input_ids` cannot be replayed (None: it can)."""
        from transformers.cache_utils import Cache, StaticLayer

        from ..parallel.state import parallel_state
        from . import attention

        if not ENABLED:
            return "off (QUANTMESH_CAPTURED_PREFILL=0)"
        if self.refused is not None:
            return self.refused
        if input_ids.device.type not in DEVICES:
            return f"a {input_ids.device.type} model"
        if padding is not None:
            return "left-padded rows"
        st = parallel_state(self.model, required=False)
        if st is not None and st.mesh.world_size > 1:
            return "a model on several ranks"
        impl = getattr(getattr(self.model, "config", None), "_attn_implementation", None)
        if impl not in ("sdpa", "eager", attention.IMPLEMENTATION):
            return f"attention {impl!r} (sdpa's and eager's masks are known)"
        layers = getattr(self.cache, "layers", None) or []
        if type(self.cache).get_query_offset is not Cache.get_query_offset:
            return f"a cache ({type(self.cache).__name__}) whose queries' offset is its own"
        if not layers or not all(
            type(layer) is StaticLayer and isinstance(getattr(layer, "cumulative_length", None),
                                                      torch.Tensor)
            for layer in layers
        ):  # fmt: skip
            return "a cache with other layers than full-attention StaticLayers"
        if not self.keeps_logits:
            return "a forward without logits_to_keep"
        if bucket(input_ids.shape[1], self._cache_len()) is None:
            return f"a prompt of {input_ids.shape[1]} tokens (up to {BUCKETS[-1]} are replayed)"
        return None

    def replay(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        """The prompt's last logits (batch, vocab) from the recorded bucket, the cache then
        holding the prompt (its `reset` done by the caller); None where this bucket is not
        recorded for the model's present state (`record_after` then records it). Takes the
        model's state for the call: asked first in every call that may record."""
        state = model_state(self.model)
        if state != self.state:
            self.entries.clear()  # a parameter, flag or switch changed: record again
            self.state = state
        entry = self.entries.get(self._key(input_ids))
        if entry is None or entry.replay is None:
            return None
        entry.fill(input_ids)
        self.replays += 1
        return entry.replay().clone()  # (the graph's output is rewritten by the next replay)

    def record_after(self, input_ids: torch.Tensor, eager: torch.Tensor) -> torch.Tensor | None:
        """Record the bucket of `input_ids`, whose eager prefill just gave `eager` (the cache
        holding it), replay it once and compare: the replay's logits (the cache then holds the
        replay's prompt), or None where the recording was refused or its logits differ (then with
        a warning, and this decoder keeps the eager prefill: the caller runs it again). Called
        after `replay` gave None in the same call (the state it took is the recording's)."""
        key = self._key(input_ids)
        entry = _Entry(*key, input_ids.device)
        entry.fill(input_ids)
        try:
            # the recorder's warm-up runs the forward once: on an empty cache, as every replay
            # does (after the eager prefill it would write the bucket's slots past the prompt's,
            # beyond a cache that holds the bucket alone)
            self.cache.reset()
            entry.replay = self.record(lambda: self._forward(entry))
            self.cache.reset()
            got = entry.replay().clone()
            self.replays += 1
        except Exception as e:  # noqa: BLE001 - the runtime's refusal: said, then eager for good
            self._refuse(f"recording it failed ({said(e)})")
            return None
        err = float((got.float() - eager.float()).norm() / eager.float().norm().clamp_min(1e-30))
        if not err <= TOLERANCE:
            self._refuse(
                f"its logits differ from the eager prefill's by {err:.3g} of their norm (more "
                f"than {TOLERANCE})"
            )
            return None
        self.entries[key] = entry
        return got

    def _cache_len(self) -> int:
        return int(self.cache.layers[0].max_cache_len)

    def _key(self, input_ids: torch.Tensor) -> tuple[int, int]:
        b = bucket(input_ids.shape[1], self._cache_len())
        assert b is not None  # (why_not)
        return (input_ids.shape[0], b)

    def _forward(self, entry: _Entry) -> torch.Tensor:
        """The padded prefill: the model on the bucket's tokens, the logits of the prompt's last,
        then every layer's length set back to the prompt's. While it runs, the cache gives its
        query offset as the number 0 (what it is at a prefill's start) instead of a tensor:
        transformers' masks then take the eager prefill's own path (sdpa's causal flag, or the
        same mask) without reading the offset back from the GPU, which a recording cannot do."""
        self.cache.get_query_offset = _empty_offset  # (an instance attribute, removed below)
        try:
            out: torch.Tensor = self.model(
                input_ids=entry.ids, past_key_values=self.cache, use_cache=True,
                logits_to_keep=entry.last,
            ).logits[:, -1]  # fmt: skip
        finally:
            del self.cache.get_query_offset
        for layer in self.cache.layers:
            layer.cumulative_length.copy_(entry.prompt)
        return out

    def _refuse(self, why: str) -> None:
        self.refused = why
        self.entries.clear()
        warnings.warn(
            f"quantmesh: replaying {type(self.model).__name__}'s prefill as a CUDA graph: {why}; "
            "its prefills run eagerly (QUANTMESH_CAPTURED_PREFILL=0: no recording, no warning)",
            stacklevel=5,
        )
