"""SlotBatch: the serving batch in fixed KV slots, its decode step compiled and CUDA-graphed.

The same `Plan`s as `engine.Batch` (rows join, decode together, leave; every tp rank in lock step),
executed so that a decode step can be one CUDA-graph replay, as `qm.fast_decode`'s step is:

- The KV cache is one preallocated (slots, kv heads, max_len, head dim) key and value tensor per
  layer. Row i of the batch lives in slot i, its tokens in columns [0, length): rows are kept
  packed at the front (a row that leaves is filled by shifting the rows after it down, order kept).
- A decode step runs on the first `b` slots, `b` the smallest size of a ladder (1, 4, 16, 64, ...,
  and `max_batch`) that holds the rows; the extra rows are padding (token 0, position 0, the base
  adapter) whose outputs are dropped. The keys are read up to `le` columns, the smallest of 256,
  512, 1024, ... (up to max_len) past every row's length. The step is compiled as three graphs,
  all by `warm_up`: one row at the shortest key length (static), one row at any key length, and
  any batch at any key length (symbolic sizes); each (b, le) pair is captured as a CUDA graph of
  its own (`graphs="captured"`, the default: a `torch.cuda.CUDAGraph` replayed with no host work;
  `graphs="trees"`: inductor's CUDA graph trees, `mode="reduce-overhead"`).
- Each row writes its new key and value at its own column (its length) and reads the columns
  before it: the step gets each row's position, a boolean (b, 1, 1, le) attention mask built from
  it, and a `SlotCache` whose layers write per row. The row's adapter comes from the bank's
  per-row slot ids (`AdapterBank.set_rows(..., size=b)`: one fixed graph for every mix).
- Prefill: with the step compiled, whole short prompts (no echo, `prefill` tokens at most) of one
  adapter are packed into one sequence of `prefill` tokens (`pack_prompts`), each token attending
  to its own prompt and its key and value written straight into its row's slot: one compiled,
  CUDA-graphed forward for several new rows, which reads the weights once. Other prompts (longer,
  echo, chunks) run eagerly: the rows admitted together as one forward, their prompts
  right-padded to the longest, their keys and values written straight into their slots.

A row sees exactly the keys it would alone: tests compare the logits of every step with `Batch`'s
on CPU ranks (eager), and the compiled step with the eager one on a GPU.

Example:
    >>> batch = SlotBatch(model, AdapterBank(model, slots=4), max_batch=32, max_len=2048)  # doctest: +SKIP
    >>> batch.warm_up()                                      # doctest: +SKIP  (every size, at start)
    >>> step, pre, errors = batch.execute(Plan(admit=[Admit(7, ids, 0)]))     # doctest: +SKIP
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..blocks.compile import mark_block_regions, unmark_block_regions
from ..config import CUDA_GRAPHS
from ..errors import said
from ..infer.decode import CACHE_STEP, _static_statistics
from ..infer.prefill_graph import cuda_graph
from ..quant.bnb import fuse_held_siblings, join_sibling_codes
from .bank import AdapterBank
from .engine import Admit, Batch, ServeError
from .host import upload

__all__ = ["LADDER", "PREFILL_TOKENS", "SlotBatch", "SlotCache", "pack_prompts"]

LADDER = (1, 4, 16, 64, 256)
"""Batch sizes a decode step is compiled for (each capped by max_batch, which is one too)."""
PREFILL_TOKENS = 256
"""The compiled prefill's length: whole prompts up to it take it, packed (`pack_prompts`)."""


def _ladder(n: int, sizes: tuple[int, ...]) -> int:
    """The smallest size in `sizes` (ascending) that holds n rows."""
    for s in sizes:
        if s >= n:
            return s
    raise RuntimeError(f"{n} rows exceed the largest compiled batch {sizes[-1]}")


class _SlotLayer:
    """One attention layer's keys and values in slots: (slots, kv heads, max_len, head dim).

    `update` writes each of the step's b rows at its own column (the owner's positions) and returns
    the first b slots up to `le` columns (the mask hides the columns past each row's length)."""

    is_compileable = True
    is_sliding = False

    def __init__(self, owner: SlotBatch, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.owner = owner
        self.keys, self.values = keys, values
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass  # allocated by the owner

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        o = self.owner
        lo, b, le = o.lo, o.b, o.le
        if o.packed:  # the compiled prefill: prompts packed in one sequence (b = 1)
            # each token's key and value go straight to its row's slot at its own column (the
            # padding's to the scratch column); the attention reads this forward's keys alone
            keys = key_states.to(self.keys.dtype)
            values = value_states.to(self.values.dtype)
            row, col = o.pack_buf[3], o.pack_buf[4]
            self.keys[row, :, col] = keys[0].transpose(0, 1)
            self.values[row, :, col] = values[0].transpose(0, 1)
            return keys, values
        rows, pos = o.rows[lo : lo + b], o.pos_buf[lo : lo + b]
        t = key_states.shape[2]
        if t == 1:  # a decode step: (b, heads, 1, dim) -> each row's column (a padding row's:
            col = o.col_buf[lo : lo + b]  # the scratch column, past max_len)
            self.keys[rows, :, col] = key_states[:, :, 0].to(self.keys.dtype)
            self.values[rows, :, col] = value_states[:, :, 0].to(self.values.dtype)
        else:  # a prefill: row r's t tokens -> its columns pos[r] .. pos[r] + t - 1 (a padded
            # chunk's tail past max_len lands in the scratch column)
            cols = (pos[:, None] + torch.arange(t, device=pos.device)).clamp(max=o.max_len)
            self.keys[rows[:, None], :, cols] = key_states.transpose(1, 2).to(self.keys.dtype)
            self.values[rows[:, None], :, cols] = value_states.transpose(1, 2).to(self.values.dtype)
        return self.keys[lo : lo + b, :, :le], self.values[lo : lo + b, :, :le]

    def get_mask_sizes(self, *args: Any, **kwargs: Any) -> tuple[int, int]:
        return self.owner.le, 0

    def get_seq_length(self, *args: Any, **kwargs: Any) -> int:
        return self.owner.le

    def get_max_length(self) -> int:
        return int(self.keys.shape[2])


def SlotCache(layers: list[_SlotLayer]) -> Any:  # noqa: N802 - a transformers Cache, built here
    """A transformers `Cache` over slot layers (what the model's attention calls `update` on).

    Example:
        >>> cache = SlotCache([])  # doctest: +SKIP
    """
    from transformers.cache_utils import Cache

    return Cache(layers=layers)  # type: ignore[arg-type]


class SlotBatch(Batch):
    """The rows decoding together, in fixed KV slots, with a compiled decode step per batch size.

    `max_batch`: rows at most (the slots); `max_len`: tokens a row may hold (prompt and reply);
    `compile`: compile and CUDA-graph the step (default: on CUDA devices); `ladder`: batch sizes
    compiled (each capped by max_batch); `chunk`: prompt tokens prefilled per step (the scheduler
    splits longer prompts, so that a long prompt does not stall the rows decoding; None: whole
    prompts); `backend`: torch.compile's (None: `quantmesh.config.compile_options`'s, inductor
    unless $QUANTMESH_COMPILE_BACKEND names another; `mode` applies to inductor only); `graphs`:
    how the compiled step becomes CUDA graphs on GPUs (`quantmesh.config.CUDA_GRAPHS`);
    `stack_adapters`: the banked adapters of sibling layers that read one tensor (q, k, v; gate,
    up) run as one A and one B matmul per group (`AdapterBank.stack_siblings`, found by the
    first forward); `prefill`: with `compile`, whole prompts of at most this many tokens (no
    echo) are prefilled by one compiled graph of that many tokens, several prompts of one
    adapter packed in each call (`pack_prompts`; an eager prefill is launched op by op from the
    host, and a prefill a row at a time reads every weight once per row: docs/benchmarks.md,
    "Figures the code relies on"); longer prompts, echo and chunks prefill eagerly (None: every
    prefill). Raises ServeError
    when the model cannot be served this way.

    Example:
        >>> batch = SlotBatch(model, bank, max_batch=8, max_len=1024, compile=False)  # doctest: +SKIP
    """

    def __init__(
        self,
        model: nn.Module,
        bank: AdapterBank,
        *,
        max_batch: int,
        max_len: int,
        compile: bool | None = None,
        mode: str | None = "reduce-overhead",
        ladder: tuple[int, ...] = LADDER,
        agree: Callable[[list[bool]], list[bool]] | None = None,
        share: Callable[[torch.Tensor], None] | None = None,
        chunk: int | None = None,
        backend: str | None = None,
        graphs: str = CUDA_GRAPHS[0],
        stack_adapters: bool = True,
        prefill: int | None = PREFILL_TOKENS,
    ) -> None:
        super().__init__(model, bank, agree=agree, share=share)
        self.stack_adapters = stack_adapters
        if prefill is not None and not 1 <= prefill <= CACHE_STEP:
            raise ServeError(f"prefill={prefill} tokens; expected 1 to {CACHE_STEP} (or None)")
        if graphs not in CUDA_GRAPHS:
            raise ServeError(f"graphs={graphs!r}; expected one of {', '.join(CUDA_GRAPHS)}")
        if max_batch < 1 or max_len < 2:
            raise ServeError(f"max_batch={max_batch}, max_len={max_len}; expected >= 1 and >= 2")
        if chunk is not None and chunk < 1:
            raise ServeError(f"a prefill chunk of {chunk} tokens; expected >= 1 (or None: whole)")
        self.chunk = chunk
        self.parts: dict[int, list[torch.Tensor]] = {}  # echo rows mid-prefill: chunks' logits
        attn = getattr(self.config, "_attn_implementation", None) or "eager"
        if attn not in ("sdpa", "eager"):
            raise ServeError(
                f"the model runs attention with {attn!r}; the slot engine passes each row's mask "
                "to the attention, which sdpa and eager take: load the model with "
                "attn_implementation='sdpa', or serve with --engine dynamic"
            )
        self.additive = attn == "eager"  # eager attention adds a float mask; sdpa takes booleans
        self.sizes = tuple(sorted({s for s in ladder if s < max_batch} | {max_batch}))
        self.max_len = -(-max_len // CACHE_STEP) * CACHE_STEP
        lens, le = [], CACHE_STEP
        while le < self.max_len:
            lens.append(le)
            le *= 2
        self.lens_ladder = (*lens, self.max_len)
        self.compiled = self.device.type == "cuda" if compile is None else compile
        s = self.sizes[-1]
        self.prefill = prefill if self.compiled else None
        # the compiled prefill's prompts packed in one sequence, a row of this per token: its
        # id, its position, its prompt's first column in the pack, and the slot and column its
        # key and value go to
        self.pack_buf = torch.zeros(5, self.prefill or 1, dtype=torch.long, device=self.device)
        self.packed = False  # the compiled prefill is running (`_SlotLayer.update`)
        self.ids_buf = torch.zeros(s, 1, dtype=torch.long, device=self.device)
        self.pos_buf = torch.zeros(s, dtype=torch.long, device=self.device)
        self.col_buf = torch.zeros(s, dtype=torch.long, device=self.device)  # decode's
        self.rows = torch.arange(s, device=self.device)
        self.token_buffer(s)  # padding rows read entry 0 (warm-up's steps too)
        self.layers: list[_SlotLayer] = []  # allocated at the first prefill
        self._shapes: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # `_kv_shapes`
        self.slot_cache: Any = None
        self.lo = self.b = self.le = 0  # the rows a forward runs: slots lo..lo+b-1, keys [:le]
        self.run: Callable[[], torch.Tensor] = self._decode
        self.compiled_step: Callable[[], torch.Tensor] = self._decode
        # graphs="captured": (b, le) -> the replay of a CUDA graph of the compiled step; (0, 0):
        # the compiled prefill's
        self.captured: dict[tuple[int, int], Callable[[], torch.Tensor]] = {}
        self._pool: Any = None  # one memory pool for every captured graph
        self.regions = 0  # blocks marked to compile as one (`mark_block_regions`)
        if self.compiled:
            _static_statistics(model)
            # one block compiled, reused by all: minutes off a 7B start (undone by `warm_up`
            # where the compiler refuses it)
            self.regions = mark_block_regions(model)
            for t in (self.ids_buf, self.pack_buf, self.pos_buf, self.col_buf, self.rows):
                torch._dynamo.mark_static_address(t, guard=False)
            # at most one compiled graph per (b, le): past dynamo's default limit, it would fall
            # back to eager without a word
            most = len(self.sizes) * len(self.lens_ladder) + 9  # and the prefill
            cfg = torch._dynamo.config
            for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit"):
                if hasattr(cfg, name) and getattr(cfg, name) < most:
                    setattr(cfg, name, most)
            # dynamic=None: a static graph for the first (b, le), then graphs with the sizes
            # that changed made symbolic (`warm_up`: three in all); CUDA graphs are still
            # captured per shape. One static graph per batch size (dynamic=False) compiled the
            # step once per size at start (minutes for a 7B model). dynamic=True (two graphs)
            # made the blocks' float attributes (norm eps, attention scaling) symbolic inputs of
            # the compiled block, which inductor refused on torch 2.11 (an unbacked float). Both
            # measured: docs/benchmarks.md, "Figures the code relies on".
            from ..config import compile_options

            capture = graphs == "captured" and self.device.type == "cuda"
            self._opts = compile_options(None if capture else mode, backend)
            self._capture_graphs = capture
            self._compile()

    def _compile(self) -> None:
        """The compiled step and prefill (compiled on their first calls) and what each step
        runs."""
        self.compiled_step = torch.compile(self._decode, fullgraph=True, dynamic=None, **self._opts)
        self.run = self._replay if self._capture_graphs else self.compiled_step
        self.compiled_prefill = torch.compile(
            self._prefill_step, fullgraph=True, dynamic=False, **self._opts
        )

    # ---- the step -----------------------------------------------------------------------------
    def _forward(self, ids: torch.Tensor, logits_to_keep: Any = None) -> torch.Tensor:
        """The model on `ids` (b, t) of the rows in slots lo..lo+b-1, each row's tokens written
        from its column `pos_buf[row]` on and attending to the columns up to each token's own;
        the logits (b, kept positions, vocab)."""
        lo, b, le = self.lo, self.b, self.le
        t = ids.shape[1]
        pos = self.pos_buf[lo : lo + b]
        q = pos[:, None] + torch.arange(t, device=pos.device)  # (b, t): positions of the tokens
        ahead = q[:, :, None] - torch.arange(le, device=pos.device)[None, None, :]  # (b, t, le)
        mask = self._masks(ahead[:, None] >= 0, ahead[:, None])  # (b, 1, t, le)
        keep = {} if logits_to_keep is None else {"logits_to_keep": logits_to_keep}
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=q, use_cache=True,
                         **{self.cache_arg: self.slot_cache}, **keep)  # fmt: skip
        logits: torch.Tensor = out.logits
        return logits

    def _decode(self) -> torch.Tensor:  # -> (b, vocab); compiled per (b, le)
        # the bank's per-row ids (b rows) met here first, outside the blocks: their size is then
        # the batch's in every block, so that every block traces alike (mark_block_regions)
        for t in (self.bank.ids, self.bank.rel):
            torch._check(t.shape[0] == self.b)
        return self._forward(self.ids_buf[: self.b])[:, -1]

    def _prefill_step(self) -> torch.Tensor:  # -> (prefill, vocab); compiled once
        """The packed prompts of `pack_buf` through the model (one adapter: b = 1): each token
        attends to the tokens of its own prompt up to itself, at its position in that prompt."""
        for t in (self.bank.ids, self.bank.rel):
            torch._check(t.shape[0] == 1)
        ids, pos, seg = self.pack_buf[0:1], self.pack_buf[1:2], self.pack_buf[2]
        at = torch.arange(seg.shape[0], device=seg.device)
        ahead = at[:, None] - at[None, :]  # (t, t): within a prompt, its positions' distance
        ok = (seg[None, :] == seg[:, None]) & (ahead >= 0)
        out = self.model(input_ids=ids, attention_mask=self._masks(ok[None, None], ahead),
                         position_ids=pos, use_cache=True,
                         **{self.cache_arg: self.slot_cache})  # fmt: skip
        logits: torch.Tensor = out.logits
        return logits[0]

    def _masks(self, ok: torch.Tensor, ahead: torch.Tensor) -> Any:
        """The attention mask of the forward: `ok` (b, 1, t, keys) the keys each token may read
        under full attention, `ahead` its position minus each key's. Sliding layers read the
        keys fewer than `window` behind too: the mask for every layer when all slide, else one
        mask per layer type (the engine module's doc)."""
        if self.window is None:
            return self._mask(ok)
        near = self._mask(ok & (ahead < self.window))
        if not self.masks_by_type:
            return near
        return {"full_attention": self._mask(ok), "sliding_attention": near}

    def _mask(self, ok: torch.Tensor) -> torch.Tensor:
        """A boolean (b, 1, t, keys) mask as the attention takes it: eager adds a float one."""
        if not self.additive:
            return ok
        return torch.zeros(ok.shape, device=ok.device).masked_fill(
            ~ok, torch.finfo(torch.float32).min
        )

    def _replay(self, key: tuple[int, int] | None = None) -> torch.Tensor:
        """graphs="captured": the step (or with key (0, 0), the prefill) as one graph replay."""
        key = (self.b, self.le) if key is None else key
        if key not in self.captured:
            fn = self.compiled_prefill if key == (0, 0) else self.compiled_step
            self.captured[key] = self._capture(fn)
        return self.captured[key]()

    def _capture(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """A compiled function (the step for the current (b, le), or the prefill), captured
        into a CUDA graph (`prefill_graph.cuda_graph`: its warm-up on the current stream, not a
        side stream, which left later replays slower). It runs twice first (a capture must not
        compile, autotune or synchronize); the step is idempotent (the same keys written at the
        same columns), so a capture in the middle of serving changes nothing. Every graph
        shares one memory pool: a step's output is cloned before the next replay."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return cuda_graph(fn, warmups=2, pool=self._pool)

    def _step(self, feed: list[int]) -> torch.Tensor:  # -> (rows, vocab)
        n = len(self.rids) - self.pending  # the rows mid-prefill (after these) do not decode
        b = _ladder(n, self.sizes)
        lens = self.lens[:n]
        need = max(lens) + 1
        if need > self.max_len:
            raise RuntimeError(f"a row needs {need} KV columns, more than max_len {self.max_len}")
        le = _ladder(need, self.lens_ladder)
        pad = [0] * (b - n)
        # padding rows (whose slots may hold rows mid-prefill) write to the scratch column
        host = upload([feed + pad, lens + pad, lens + [self.max_len] * (b - n)], self.device)
        self.ids_buf[:b, 0] = self.tokens[host[0]]  # the last step's tokens, on the device
        self.pos_buf[:b].copy_(host[1])
        self.col_buf[:b].copy_(host[2])
        self.bank.set_rows(self.slots[:n] + pad, fixed=self.sizes[-1])
        self.lo, self.b, self.le = 0, b, le
        logits = self.run()[:n]
        if self.compiled:  # a graph's output is rewritten by its next replay
            logits = logits.clone()
        self.lens[:n] = [x + 1 for x in lens]
        return logits

    def warm_up(self, progress: Callable[[str], None] | None = None) -> None:
        """Compile (and capture) the step for every batch size of the ladder at the two shortest
        key lengths, so that no request waits for a compilation: dynamo compiles a static graph
        for one row, then one whose key length is symbolic, then one whose batch and key length
        both are; every later (batch, key length) pair reuses one of the three (CUDA graphs are
        captured per shape, without compiling). Needs a prefilled row for the cache's shapes: it
        prefills (and drops) a one-token row.

        Example:
            >>> batch.warm_up(print)  # doctest: +SKIP
        """
        if not self.compiled:
            return
        if self.rids:
            raise RuntimeError("warm_up runs before any request")
        t0 = time.perf_counter()
        failed = self._warm_steps(progress, catch=self.regions > 0)
        if self.regions and not self.agree([failed is None])[0]:  # every rank takes one path
            # the compiler refused one block for all (a torch version's limit): compile every
            # block instead, as before regions, and say so
            unmark_block_regions(self.model)
            self.regions = 0
            torch._dynamo.reset()
            self.captured.clear()
            self._compile()
            if progress is not None:
                why = failed or "on another rank"
                progress(f"compiling one block for every block failed ({why}); compiling them all")
            self._warm_steps(progress, catch=False)
        if progress is not None:
            progress(f"compiled the decode steps in {time.perf_counter() - t0:.0f} s")

    def _warm_steps(self, progress: Callable[[str], None] | None, catch: bool) -> str | None:
        """`warm_up`'s steps, the batch left empty after them; with `catch`, an error of the
        compiler is returned (its type and first line) instead of raised."""
        first = self.lens_ladder[0]
        with self._running():  # the guards of the serving steps (grad mode, autocast)
            saved = (self.rids, self.slots, self.lens)
            try:
                if progress is not None and self.prefill is not None:
                    progress(f"compiling the prefill of prompts up to {self.prefill} tokens")
                self._prefill([Admit(-1, [0], 0)])  # compiles the prefill (with `prefill`)
                saved = (self.rids, self.slots, self.lens)
                for b in self.sizes:
                    for le in self.lens_ladder[:2]:
                        if progress is not None:
                            progress(f"compiling the decode step for {b} rows x {le} key columns")
                        # rows of 1 token read `first` columns; rows of `first` tokens the next
                        length = 1 if le == first else first
                        self.rids, self.slots, self.lens = [-1] * b, [0] * b, [length] * b
                        self._step([0] * b)
            except Exception as e:  # noqa: BLE001 - a compiler's error, reported or raised
                if not catch:
                    raise
                return said(e)[:300]  # (a backend's own error, in one line)
            finally:
                self.rids, self.slots, self.lens = saved
                self._drop({-1})
        return None

    # ---- rows ---------------------------------------------------------------------------------
    def _drop(self, drop: set[int]) -> None:
        keep = [i for i, r in enumerate(self.rids) if r not in drop]
        moved = [(j, i) for j, i in enumerate(keep) if i != j]  # (new slot, old slot)
        if moved and self.layers:
            dst, src = upload([list(x) for x in zip(*moved, strict=True)], self.device)
            m = max(self.lens[i] for _, i in moved)
            for layer in self.layers:
                for t in (layer.keys, layer.values):
                    t[dst, :, :m] = t[src, :, :m]  # the right side is a copy: overlaps are safe
        first_pending = len(self.rids) - self.pending
        self.pending = sum(1 for i in keep if i >= first_pending)
        for r in drop:
            self.parts.pop(r, None)
        self.rids = [self.rids[i] for i in keep]
        self.slots = [self.slots[i] for i in keep]
        self.lens = [self.lens[i] for i in keep]

    def _kv_shapes(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each attention layer's keys and values of a one-token forward (this rank's kv heads,
        the cache's dtype): the shapes the slots take."""
        from transformers import DynamicCache

        if self._shapes is None:
            cache = DynamicCache(config=self.config)
            self.bank.set_rows([0])

            def forward() -> None:
                self.model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=self.device),
                           use_cache=True, **{self.cache_arg: cache}, **self.keep_kw)  # fmt: skip

            with self._running():
                if self.stack_adapters:  # the same forward shows which adapters read one tensor
                    self.bank.stack_siblings(forward)
                    # ... and which held 4-bit weights: each run's joined into one (a no-op
                    # without `keep_dequantized`)
                    fuse_held_siblings([[m.local for m in run] for run in self.bank.runs])
                    # ... and their codes, read as one weight by the kernels (a no-op unless
                    # kernel4.JOIN_ENABLED)
                    join_sibling_codes([[m.local for m in run] for run in self.bank.runs])
                else:
                    forward()
            layers: list[Any] = list(cache.layers)
            self._shapes = [(layer.keys, layer.values) for layer in layers]
        return self._shapes

    def memory_problem(self) -> str | None:
        """Why the KV slots (max_batch rows of max_len tokens, one scratch column) and what the
        compiled step builds for expert adapters do not fit 90% of the free GPU memory, naming
        the flags that lower them; None when they fit (always on CPU: no check there).

        Example:
            >>> SlotBatch(model, bank, max_batch=32, max_len=4096).memory_problem()  # doctest: +SKIP
            'the KV slots (32 rows x 4096 tokens) need 64.0 GiB, and 40.1 GiB are free on cuda:0; ...'
        """
        if self.device.type != "cuda":
            return None
        s = self.sizes[-1]
        need = sum(s * (self.max_len + 1) * (k[0, :, 0].numel() + v[0, :, 0].numel())
                   * k.element_size() for k, v in self._kv_shapes())  # fmt: skip
        pairs = self.bank.pair_bytes() if self.compiled else 0
        free, _ = torch.cuda.mem_get_info(self.device)
        if need + pairs <= 0.9 * free:
            return None
        also = (
            f", and the compiled step's expert adapters {pairs / 2**30:.1f} GiB a layer "
            f"({self.bank.slots} slots x every expert; --max-adapters sets the slots, "
            "--engine dynamic builds only the experts a step routes to)"
            if pairs
            else ""
        )
        return (
            f"the KV slots ({s} rows x {self.max_len} tokens) need {need / 2**30:.1f} GiB"
            f"{also}, and {free / 2**30:.1f} GiB are free on {self.device}; lower "
            "--max-batch or --max-model-len"
        )

    def _allocate(self) -> None:
        """The slot tensors, shaped after the cache layers of a one-token forward, before the
        first prefill: max_len columns and one scratch column (where padding rows and padded
        chunks write). Refused (ServeError) when they do not fit: `memory_problem`."""
        problem = self.memory_problem()
        if problem is not None:
            raise ServeError(problem)
        s = self.sizes[-1]
        for k, v in self._kv_shapes():
            keys = k.new_zeros(s, k.shape[1], self.max_len + 1, k.shape[3])
            values = v.new_zeros(s, v.shape[1], self.max_len + 1, v.shape[3])
            if self.compiled:
                torch._dynamo.mark_static_address(keys, guard=False)
                torch._dynamo.mark_static_address(values, guard=False)
            self.layers.append(_SlotLayer(self, keys, values))
        self._shapes = None  # the probe's tensors are not kept
        self.slot_cache = SlotCache(self.layers)

    def _groups(self, admit: list[Admit]) -> list[list[Admit]]:
        """Consecutive admissions with one `echo`, prompts of any lengths: one forward each; the
        whole short prompts that the compiled prefill takes run apart from the others, so that
        one long prompt or chunk does not send them all to the eager prefill."""
        runs: list[list[Admit]] = []
        kind = lambda a: (a.echo, self._packable(a))  # noqa: E731 - a key, used twice
        for a in admit:
            if runs and kind(runs[-1][0]) == kind(a):
                runs[-1].append(a)
            else:
                runs.append([a])
        return runs

    def _packable(self, a: Admit) -> bool:
        """Whether the compiled prefill takes this admission: a whole prompt of at most
        `prefill` tokens, without echo."""
        p = self.prefill
        return p is not None and a.start == 0 and a.last and not a.echo and 0 < len(a.prompt) <= p

    def _prefill(self, group: list[Admit]) -> list[torch.Tensor]:  # (vocab,) or (p, vocab) each
        """Prefill k rows' prompts (or chunks of them) in one eager forward, right-padded to the
        longest and written straight into the rows' slots from each one's `start` on (a row's
        padding lands past its length, where the mask hides it until its own tokens overwrite
        it). A new row takes the next slot; a chunk continues its row, mid-prefill in the last
        slots. Returns the logits of the admissions that end their prompts: an echo row's every
        prompt position (its chunks' together), the others' last position."""
        k = len(group)
        lens = [len(a.prompt) for a in group]
        t = max(lens)
        if max(a.start + n for a, n in zip(group, lens, strict=True)) > self.max_len:
            raise RuntimeError(f"a prompt exceeds max_len {self.max_len}")
        new = sum(1 for a in group if a.start == 0)
        if len(self.rids) + new > self.sizes[-1]:
            raise RuntimeError(f"{len(self.rids) + new} rows exceed max_batch {self.sizes[-1]}")
        if not self.layers:
            self._allocate()
        lo = len(self.rids) - self.pending  # the group's rows: the slots from the first pending on
        for i, a in enumerate(group):
            at = self.rids.index(a.rid) if a.start else len(self.rids)
            if at != lo + i or (a.start and (self.lens[at] != a.start or self.slots[at] != a.slot)):
                raise RuntimeError(f"prefill out of order: row {a.rid} is not the next mid-prefill")
            if not a.start:  # a new row: mid-prefill until its last chunk
                self.rids.append(a.rid)
                self.slots.append(a.slot)
                self.lens.append(0)
                self.pending += 1
        if all(self._packable(a) for a in group):
            return self._prefill_packed(group, lo)
        ids = upload([a.prompt + [0] * (t - n) for a, n in zip(group, lens, strict=True)],
                     self.device)  # fmt: skip
        starts = upload([a.start for a in group], self.device)
        self.pos_buf[lo : lo + k].copy_(starts)
        self.col_buf[lo : lo + k].copy_(starts)  # a one-token chunk writes as a decode step does
        self.bank.set_rows([a.slot for a in group])
        self.lo, self.b = lo, k
        self.le = max(a.start + n for a, n in zip(group, lens, strict=True))
        echo = group[0].echo
        ends = sorted({n - 1 for a, n in zip(group, lens, strict=True) if a.last})
        if echo or not self.keep_kw:
            logits = self._forward(ids)  # (k, t, vocab)
            at_end = [n - 1 for n in lens]
        else:  # only the positions that end a prompt (or one, when none does)
            logits = self._forward(ids, upload(ends or [0], self.device))
            at_end = [ends.index(n - 1) if a.last else 0 for a, n in zip(group, lens, strict=True)]
        out: list[torch.Tensor] = []
        for r, (a, n) in enumerate(zip(group, lens, strict=True)):
            self.lens[lo + r] += n
            if echo:
                self.parts.setdefault(a.rid, []).append(logits[r, :n])
            if not a.last:
                continue
            if lo + r != len(self.rids) - self.pending:
                raise RuntimeError(f"row {a.rid} ends its prompt behind a row mid-prefill")
            self.pending -= 1
            out.append(torch.cat(self.parts.pop(a.rid)) if echo else logits[r, at_end[r]])
        return out

    def _prefill_packed(self, group: list[Admit], lo: int) -> list[torch.Tensor]:
        """Whole short prompts (new rows lo, lo + 1, ...) through the compiled prefill: packed
        `pack_prompts`, each pack one sequence of `prefill` tokens (the padding's keys land in
        the scratch column), each token's key and value written straight into its row's slot.
        The last position's logits of each prompt, in the group's order."""
        p = self.prefill
        assert p is not None  # only called with a compiled prefill
        lens = [len(a.prompt) for a in group]
        out: list[torch.Tensor | None] = [None] * len(group)
        run = (lambda: self._replay((0, 0))) if self._capture_graphs else self.compiled_prefill
        for pack in pack_prompts(lens, [a.slot for a in group], p):
            host = torch.zeros(5, p, dtype=torch.long)
            host[2] = torch.arange(p)  # the padding: a prompt of its own token
            host[4] = self.max_len  # ... whose key goes to the scratch column
            at, ends = 0, []
            for r in pack:
                n = lens[r]
                host[0, at : at + n] = torch.tensor(group[r].prompt)
                host[1, at : at + n] = torch.arange(n)
                host[2, at : at + n] = at
                host[3, at : at + n] = lo + r
                host[4, at : at + n] = torch.arange(n)
                at += n
                ends.append(at - 1)
            self.pack_buf.copy_(upload(host, self.device))
            self.bank.set_rows([group[pack[0]].slot], fixed=self.sizes[-1])
            self.lo, self.b, self.le = 0, 1, p
            self.packed = True
            try:
                logits = run()[upload(ends, self.device)]  # a copy: the graph's
            finally:  # output is rewritten by its next call
                self.packed = False
            for j, r in enumerate(pack):
                out[r] = logits[j]
        for r, n in enumerate(lens):
            self.lens[lo + r] = n
        self.pending -= len(group)
        done = [x for x in out if x is not None]
        assert len(done) == len(group), "pack_prompts left a prompt out"  # every one is packed
        return done


def pack_prompts(lens: list[int], adapters: list[int], size: int) -> list[list[int]]:
    """The prompts (by index) that share one compiled prefill: prompts of one adapter, each put
    in the first pack of its adapter with room for it (first fit, in order), `size` tokens a
    pack. Every prompt must fit one pack.

    Example:
        >>> pack_prompts([30, 40, 20, 10], [1, 1, 2, 1], 64)
        [[0, 3], [1], [2]]
    """
    packs: list[list[int]] = []
    room: list[int] = []
    of: list[int] = []  # each pack's adapter
    for i, (n, a) in enumerate(zip(lens, adapters, strict=True)):
        if not 0 < n <= size:
            raise ValueError(f"a prompt of {n} tokens does not fit a pack of {size}")
        j = next((j for j in range(len(packs)) if of[j] == a and room[j] >= n), None)
        if j is None:
            packs.append([])
            room.append(size)
            of.append(a)
            j = len(packs) - 1
        packs[j].append(i)
        room[j] -= n
    return packs
