"""The batch every tp rank decodes in lock step: rows join, decode together and leave.

A `Plan` is one step's work, decided by rank 0 and executed identically on every rank of the tp
group (serve/ranks.py sends it): adapters to load into bank slots, rows that leave, where each
remaining row's next token is in `Batch.tokens` (chosen on rank 0's device by the last step, not
yet read back: the ranks share them by a device broadcast), and new rows to admit.
`Batch.execute` runs it:

1. adapters are loaded (each rank its own slices; the ranks agree on success);
2. leaving rows are dropped from the KV cache;
3. one decode step over the remaining rows (each row at its own position, with its own adapter),
   fed their tokens from `Batch.tokens` on the device;
4. the new rows are prefilled (consecutive ones with prompts of one length together, without
   padding) and their caches join the batch's. A row admitted with `echo` keeps the logits of
   every prompt position (its client asked for the prompt's logprobs); the others keep the last.

The batch's KV cache is a transformers `DynamicCache` whose rows are left-padded to one length;
the attention mask hides the padding, `position_ids` give each row its own positions, so a row
attends to exactly the keys it would attend to alone. New rows' prompts are prefilled without
padding (alone, or with rows of the same prompt length), then padded into the batch. Leading columns that no row needs
any more are trimmed when rows leave.

Sliding-window attention (gpt-oss, Gemma 2 and 3, Mistral's first models: `attention_windows`)
is served by the mask, not by the cache: every layer keeps all its keys, and a sliding layer's
mask lets a token read its last W keys (itself included), as transformers' own sliding-window
mask does. Here the model builds that mask from the padding mask (the window counts cache
columns, and a row's padding shifts its queries and keys alike); the slot engine builds it itself.

Example:
    >>> batch = Batch(model, bank)                                      # doctest: +SKIP
    >>> step, pre, errors = batch.execute(Plan(admit=[Admit(7, ids, 0)]))  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import QuantmeshError
from .bank import AdapterBank
from .host import upload

__all__ = ["Admit", "Batch", "Plan", "ServeError", "attention_windows", "autocast_dtype"]


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The autocast dtype the engines run their forwards under on `device` (bf16 on GPUs, as
    `quantmesh generate`; None: no autocast, on CPU).

    Example:
        >>> autocast_dtype(torch.device("cpu")) is None
        True
    """
    return torch.bfloat16 if device.type == "cuda" else None


class ServeError(QuantmeshError, RuntimeError):
    """The model cannot be served this way; the message names the fix."""


def attention_windows(model: nn.Module, config: Any) -> list[int | None]:
    """Each decoder layer's attention: None for full attention, W for a sliding window (a token
    reads its last W keys, itself included), as transformers' cache for `config` lays the layers
    out. Other kinds (chunked, recurrent, linear attention) are refused: the engines serve these
    two only.

    Example:
        >>> attention_windows(model, model.config)  # doctest: +SKIP
        [128, None, 128, None]
    """
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    out: list[int | None] = []
    other: set[str] = set()
    for layer in DynamicCache(config=config).layers:
        if type(layer) is DynamicLayer:
            out.append(None)
        elif type(layer) is DynamicSlidingWindowLayer:
            out.append(int(layer.sliding_window))
        else:
            other.add(type(layer).__name__)
    if other:
        raise ServeError(
            f"{type(model).__name__} uses KV cache layers {sorted(other)}; serve runs full and "
            "sliding-window attention only (no chunked, recurrent or linear-attention layers)"
        )
    return out


@dataclass
class Admit:
    """A new row, or the next chunk of a row's prompt: its request id, the prompt's token ids (of
    this chunk) and adapter slot; `echo`: keep the logits of every prompt position, not only the
    last. A prompt prefilled in chunks (engines with a `chunk`) comes in several Admits: `start`
    tokens of it are in the cache already, `last` marks the chunk that ends it."""

    rid: int
    prompt: list[int]
    slot: int
    echo: bool = False
    start: int = 0
    last: bool = True


@dataclass
class Plan:
    """One step of work for every tp rank (picklable: rank 0 broadcasts it)."""

    drop: list[int] = field(default_factory=list)
    """Rows (request ids) that leave before the step."""
    order: list[int] = field(default_factory=list)
    """The rows that stay, in batch order (every rank checks that it holds these)."""
    feed: list[int] = field(default_factory=list)
    """Where each row of `order` finds its next input token in `Batch.tokens`: the tokens the
    last step chose stay on the device, so a step can be launched before they are read back."""
    tokens: int = 0
    """How many entries of `Batch.tokens` the last step chose: the tp group shares them (rank 0
    chose them) before the step."""
    admit: list[Admit] = field(default_factory=list)
    """New rows and prompt chunks, prefilled after the step, in this order."""
    filling: list[int] = field(default_factory=list)
    """Rows mid-prefill (a prompt in chunks, not yet decoding), after `order` in slot order."""
    loads: list[tuple[int, str]] = field(default_factory=list)
    """(slot, adapter folder) to load before anything else."""
    stop: bool = False
    """Leave the loop (shutdown)."""


class Batch:
    """The rows decoding together on this rank: KV cache, attention mask, positions, adapters.

    Example:
        >>> batch = Batch(model, AdapterBank(model, slots=4))  # doctest: +SKIP
    """

    def __init__(
        self,
        model: nn.Module,
        bank: AdapterBank,
        *,
        agree: Callable[[list[bool]], list[bool]] | None = None,
        share: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        config = getattr(model, "config", None)
        params = inspect.signature(model.forward).parameters
        names = [n for n in ("past_key_values", "cache") if n in params]  # by transformers version
        if config is None or not names:
            raise ServeError(
                f"{type(model).__name__} is not a transformers causal LM with a KV cache "
                "(its forward takes neither past_key_values nor cache); serve needs one"
            )
        self.cache_arg = names[0]
        windows = attention_windows(model, config)
        sizes = {w for w in windows if w is not None}
        if len(sizes) > 1:
            raise ServeError(
                f"{type(model).__name__}'s sliding layers have windows of {sorted(sizes)} "
                "tokens; serve masks one window size"
            )
        self.window: int | None = sizes.pop() if sizes else None
        """The sliding layers' window (None: every layer attends fully)."""
        types = getattr(config, "layer_types", None)
        # a model with layer types takes one mask per type; without, one mask serves every layer
        self.masks_by_type = self.window is not None and types is not None
        if self.window is not None and not self.masks_by_type and None in windows:
            raise ServeError(
                f"{type(model).__name__} mixes sliding-window and full layers without "
                "config.layer_types, so it cannot take a mask per layer; serve cannot mask it"
            )
        self.model, self.bank, self.config = model, bank, config
        self.agree = agree or (lambda ok: ok)
        self.share = share or (lambda t: None)  # rank 0's tensor to every tp rank, in place
        self.keep_kw = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        self.device = next(model.parameters()).device
        self.rids: list[int] = []
        self.slots: list[int] = []
        self.lens: list[int] = []  # real tokens in the cache, per row
        self.pending = 0  # the last rows, mid-prefill (their prompts' last chunk still to come)
        self.chunk: int | None = None
        """Prompt tokens prefilled per step, in chunks (None: whole prompts at admission)."""
        self.cache: Any = None  # a transformers DynamicCache, or None while empty
        self.tokens = torch.zeros(0, dtype=torch.long, device=self.device)
        """The tokens the last step chose, one entry per row of that step (written by rank 0's
        scheduler on the device; `Plan.feed` points into it)."""
        self.mask = torch.zeros(0, 0, dtype=torch.long, device=self.device)  # (B, T)

    # ---- the plan -----------------------------------------------------------------------------
    def token_buffer(self, n: int) -> torch.Tensor:
        """`tokens`, grown to hold at least `n` entries (the rows of a step)."""
        if self.tokens.numel() < n:
            self.tokens = torch.zeros(max(n, 2 * self.tokens.numel()), dtype=torch.long,
                                      device=self.device)  # fmt: skip
        return self.tokens

    def feed_tokens(self, toks: list[int]) -> list[int]:
        """Host tokens as the next plan's `feed` (for drivers other than the scheduler, which
        chooses its tokens on the device): written to `tokens`; returns their indices.

        Example:
            >>> plan = Plan(order=[7, 9], feed=batch.feed_tokens([17, 4]))  # doctest: +SKIP
        """
        self.token_buffer(len(toks))[: len(toks)].copy_(upload(toks, self.device))
        return list(range(len(toks)))

    def execute(self, plan: Plan) -> tuple[torch.Tensor | None, list[torch.Tensor], list[str]]:
        """Run one plan. Returns (the step's logits (B, vocab) for `plan.order`, or None; the
        prefill logits of each admission that ends its prompt (`last`), in plan order, (vocab,)
        or (prompt length, vocab) for an `echo` row; an error message per load, "" when it
        worked)."""
        errors = []
        for slot, path in plan.loads:
            try:
                self.bank.load(slot, path)
                errors.append("")
            except Exception as e:  # reported to the client that asked; the slot stays free
                errors.append(f"{type(e).__name__}: {e}")
        if plan.loads:
            ok = self.agree([not e for e in errors])
            errors = [
                e or ("" if k else "failed on another rank")
                for e, k in zip(errors, ok, strict=True)
            ]
        if plan.drop:
            self._drop(set(plan.drop))
        # a bug or a lost message, not a user's mistake: RuntimeError, not ServeError
        if self.rids != plan.order + plan.filling:
            raise RuntimeError(
                f"ranks out of step: this rank holds rows {self.rids}, rank 0 planned "
                f"{plan.order + plan.filling}"
            )
        if plan.order and plan.tokens:  # the last step's tokens, chosen on rank 0
            self.share(self.token_buffer(plan.tokens)[: plan.tokens])
        with self._running():
            step = self._step(plan.feed) if len(self.rids) > self.pending else None
            pre = []
            for group in self._groups(plan.admit):
                pre += self._prefill(group)
        return step, pre, errors

    def _running(self) -> contextlib.AbstractContextManager:
        """The global state every forward of the batch runs under: no autograd, and autocast in
        `autocast_dtype` (bf16 on GPUs, as `quantmesh generate`). One place, so
        that a compiled step warmed up outside `execute` meets the same dynamo guards (grad mode
        and autocast are part of them: a step compiled under other settings compiles again)."""
        stack = contextlib.ExitStack()
        stack.enter_context(torch.no_grad())
        dtype = autocast_dtype(self.device)
        if dtype is not None:
            stack.enter_context(torch.autocast(self.device.type, dtype=dtype))
        return stack

    def _groups(self, admit: list[Admit]) -> list[list[Admit]]:
        """The admissions prefilled together: consecutive prompts of one length and one `echo`."""
        return _same_length_runs(admit)

    # ---- rows ---------------------------------------------------------------------------------
    def _layers(self) -> list:
        assert self.cache is not None
        return list(self.cache.layers)

    def _drop(self, drop: set[int]) -> None:
        keep = [i for i, r in enumerate(self.rids) if r not in drop]
        if not keep:
            self.rids, self.slots, self.lens, self.cache = [], [], [], None
            self.mask = self.mask[:0, :0]
            return
        self.rids = [self.rids[i] for i in keep]
        self.slots = [self.slots[i] for i in keep]
        self.lens = [self.lens[i] for i in keep]
        cut = self.mask.shape[1] - max(self.lens)  # leading columns no kept row uses
        idx = upload(keep, self.device)
        for layer in self._layers():
            layer.keys = layer.keys.index_select(0, idx)[:, :, cut:]
            layer.values = layer.values.index_select(0, idx)[:, :, cut:]
        self.mask = self.mask.index_select(0, idx)[:, cut:]

    def _step(self, feed: list[int]) -> torch.Tensor:  # -> (B, vocab)
        b = len(self.rids)
        ids = self.tokens[upload(feed, self.device)].view(b, 1)
        pos = upload(self.lens, self.device).view(b, 1)
        self.mask = torch.cat([self.mask, self.mask.new_ones(b, 1)], dim=1)  # (B, T + 1)
        self.bank.set_rows(self.slots)
        out = self.model(input_ids=ids, attention_mask=self.mask, position_ids=pos,
                         use_cache=True, **{self.cache_arg: self.cache})  # fmt: skip
        self.lens = [n + 1 for n in self.lens]
        return out.logits[:, -1]

    def _prefill(self, group: list[Admit]) -> list[torch.Tensor]:  # (vocab,) or (p, vocab) each
        """Prefill k new rows whose prompts have one length (no padding), then join the batch;
        echo rows (a group is all echo or none) return every position's logits."""
        from transformers import DynamicCache

        if any(a.start or not a.last for a in group):
            raise RuntimeError("this engine prefills whole prompts (its chunk is None)")
        # sliding layers keep every key too: the mask limits what they read (module doc)
        cache = DynamicCache(config=self.config) if self.window is None else DynamicCache()
        k, p = len(group), len(group[0].prompt)
        ids = upload([a.prompt for a in group], self.device)  # (k, p)
        self.bank.set_rows([a.slot for a in group])
        keep = {} if group[0].echo else self.keep_kw
        out = self.model(input_ids=ids, use_cache=True, **{self.cache_arg: cache}, **keep)
        if self.cache is None:
            self.cache = cache
            self.mask = torch.ones(k, p, dtype=torch.long, device=self.device)
        else:
            t = self.mask.shape[1]
            n = max(t, p)
            new_layers: list[Any] = list(cache.layers)
            for old, new in zip(self._layers(), new_layers, strict=True):
                old.keys = torch.cat([F.pad(old.keys, (0, 0, n - t, 0)),
                                      F.pad(new.keys, (0, 0, n - p, 0))])  # fmt: skip
                old.values = torch.cat([F.pad(old.values, (0, 0, n - t, 0)),
                                        F.pad(new.values, (0, 0, n - p, 0))])  # fmt: skip
            rows = F.pad(self.mask.new_ones(k, p), (n - p, 0))
            self.mask = torch.cat([F.pad(self.mask, (n - t, 0)), rows])  # (B + k, n)
        self.rids += [a.rid for a in group]
        self.slots += [a.slot for a in group]
        self.lens += [p] * k
        return list(out.logits if group[0].echo else out.logits[:, -1])


def _same_length_runs(admit: list[Admit]) -> list[list[Admit]]:
    """Consecutive admissions with prompts of one length (and one `echo`), prefilled together
    (order kept)."""
    runs: list[list[Admit]] = []
    for a in admit:
        first = runs[-1][0] if runs else None
        if first is not None and len(first.prompt) == len(a.prompt) and first.echo == a.echo:
            runs[-1].append(a)
        else:
            runs.append([a])
    return runs
