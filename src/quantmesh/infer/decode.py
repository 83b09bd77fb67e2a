"""fast_decode / greedy_decode: a lean decoding loop for transformers causal LMs, sharded or not.

Batch-1 decoding is bound by the host, not the GPU: reading a 7B bf16 model's weights takes a
GPU a few milliseconds per token (docs/benchmarks.md, "Figures the code relies on"), while transformers' `generate` spends a few
milliseconds of Python per token and reads a flag back from the GPU every step, so the host waits
for each token before it launches the next. Here the loop is: one prefill that fills a
transformers `StaticCache`, then one compiled step per token (the whole forward, tp all-reduces
included), recorded once as a CUDA graph and replayed with no host work but copying the step's
inputs in (`step_graph`; $QUANTMESH_STEP_GRAPH=0: inductor's CUDA graph trees, mode
"reduce-overhead", whose host work per step was about as long as a 7B step's GPU work), with
every token kept on the device. The host reads the tokens back only every `check_every` steps
(to stop at EOS) and at the end, so it runs ahead of the GPU. With `PREFILL_COMPILED` the
prefill is compiled too, for prompts of any length (an eager one launches every op of every
layer from the host: about 0.15 s on a 7B model, against a compile of more than a minute).

On tp ranks every rank runs the same loop in lock step: the LM head gathers the logits, so each rank
picks the same token. Sampling (temperature, top-p) runs inside the compiled step too: the uniform
noise of each step is drawn outside it from a generator seeded alike on every rank and handed in,
and `quantmesh.infer.sampling.pick_tokens` turns it into an exact draw (Gumbel-max), so ranks agree
without a collective and the eager and compiled steps pick the same token from the same noise.

LoRA adapters of sibling layers that read one tensor (q, k, v; gate, up) run stacked in the steps
(`AdapterStack`): the first prefill finds them (`stack_sibling_adapters`) and gives each member a
`StackedLora` (`set_adapter`), the same adapter taking its delta from the stack while decoding.
At one row, the stacks' and the other adapters' matmuls are a product and a sum in the compiled
step (`quantmesh.lora.adapter.lean_linear`), fused with the ops around them.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ..blocks.compile import blocks_for_decoding, regions_available, unmark_block_regions
from ..config import env_switch
from ..errors import said
from ..lora.adapter import LoraAdapter, LowRank, _adds_in_launch, lean_linear, static_on_cuda
from ..plan.styles import Style
from ..quant import kernel4
from ..tp.layers import ShardedModule, sharded_modules
from . import attention, step_graph
from .prefill_graph import PrefillGraphs
from .sampling import pick_tokens, repetition_penalized, sample_tokens, uniform_noise

__all__ = [
    "AdapterStack",
    "StackedLora",
    "fast_decode",
    "greedy_decode",
    "join_sibling_codes_in",
    "prepare_low_rank",
    "refresh_stacks",
    "sibling_runs",
    "stack_sibling_adapters",
]

CACHE_STEP = 256  # the static cache's length is a multiple of this
# Opt-in: it saves a 7B call a few percent and makes its first compile about three times as long
# (docs/benchmarks.md, "Figures the code relies on"); transformers' and gpt-fast's loops leave the
# prefill eager by default for the same reason.
PREFILL_COMPILED = env_switch("QUANTMESH_COMPILED_PREFILL", default=False)
"""Whether a compiled decoder runs its prefill compiled ($QUANTMESH_COMPILED_PREFILL=1), read at
each call."""


class _Decoder:
    """The static cache and the compiled step of one model, reused while the shapes stay the same
    (a new cache object would fail the compiled step's guards and compile it again)."""

    def __init__(
        self,
        model: nn.Module,
        batch: int,
        max_len: int,
        compile: bool,
        mode: str | None,
        sampled: bool = False,
        padded: bool = False,
        fuse: bool = True,
        penalized: bool = False,
    ) -> None:
        from transformers import StaticCache

        params = inspect.signature(model.forward).parameters
        names = [n for n in ("past_key_values", "cache") if n in params]  # by transformers version
        if not names:
            raise TypeError(
                f"{type(model).__name__}.forward takes neither `past_key_values` nor `cache`; "
                "greedy_decode needs a transformers causal LM"
            )
        self.key = _decoder_key(batch, max_len, compile, mode, sampled, padded, fuse, penalized)
        self.fuse = fuse
        self.stacks: list[AdapterStack] | None = None  # found in the first prefill (fuse)
        self.joined = False  # the 4-bit siblings' codes joined (fuse, kernel4.JOIN_ENABLED)
        config: Any = model.config  # a transformers PreTrainedConfig
        self.cache = StaticCache(config=config, max_cache_len=max_len)
        self.kw = {names[0]: self.cache, "use_cache": True}
        self.prefill_kw = {
            **self.kw,
            **({"logits_to_keep": 1} if "logits_to_keep" in params else {}),
        }
        self.model = model
        # the step compiles one block for all of them: fast_decode marks the blocks as one
        # region while it decodes (blocks_for_decoding)
        self.regions = compile and regions_available()
        if compile:
            _static_statistics(model)
        from ..config import compile_options  # (read at call time: tests stand in a compiler)

        self.opts = compile_options(mode)  # inductor unless $QUANTMESH_COMPILE_BACKEND says so
        # where CUDA graph trees would replay the step (mode "reduce-overhead" on a GPU), it is
        # compiled without them and recorded by hand as one CUDA graph (step_graph)
        self.step_graph: step_graph.StepGraph | None = None
        if compile and mode == "reduce-overhead" and step_graph.ENABLED:
            p = next(model.parameters(), None)
            if p is not None and p.device.type in step_graph.DEVICES:
                self.step_graph = step_graph.StepGraph(step_graph.RECORDER)
                self.opts = {"backend": step_graph.backend(compile_options(None)["backend"])}
        self.compiled: Any = torch.compile(self.step, fullgraph=True, **self.opts)
        # the compiled step (its first call: `_first_run`), and what each step calls
        self.inner: Any = (
            (self._first_run if self.regions else self.compiled) if compile else self.step
        )
        self.run: Any = self.inner if self.step_graph is None else self._recorded
        # the prefill, compiled for prompts of any length (no CUDA graphs: one per length would
        # be recorded); None: eager (compile=False, or the compiler refused it once)
        self.prefill_run: Any = None
        self.prefill_opts = compile_options(None)
        if compile:  # (taken while PREFILL_COMPILED, read at each call)
            self.prefill_run = self._compile_prefill()
        # the eager prefill recorded as CUDA graphs per length bucket, where it applies (a
        # compiled decoder's; the eager loop stays the reference)
        self.graphs = PrefillGraphs(model, self.cache) if compile else None

    def _compile_prefill(self) -> Any:
        return torch.compile(self._prefill_logits, fullgraph=True, **self.prefill_opts)

    def _first_run(self, *args: Any) -> torch.Tensor:
        """The compiled step's first call; where the compiler refuses the block regions (a
        torch version's limit), it compiles every block instead, with a warning. A refusal comes
        while tracing, before the step runs: the cache has not moved."""
        try:
            out: torch.Tensor = self.compiled(*args)
        except Exception as e:  # noqa: BLE001 - a compiler's error; the retry raises its own
            self._drop_regions(e)
            out = self.compiled(*args)
        self._use(self.compiled)
        return out

    def _use(self, compiled: Any) -> None:
        """Step with `compiled` from now on (recorded anew where the step is recorded)."""
        self.inner = compiled
        if self.step_graph is None:
            self.run = compiled
        else:
            self.step_graph.drop()

    def _recorded(self, *args: Any) -> torch.Tensor:
        """One step through the step's recording (`step_graph.StepGraph`)."""
        assert self.step_graph is not None  # (the step's `run` only then)
        out: torch.Tensor = self.step_graph(self.inner, *args)
        return out

    def begin(self) -> None:
        """A decode call's steps start: the first checks the step's recording, if any."""
        if self.step_graph is not None:
            self.step_graph.begin()

    def release(self) -> None:
        """Drop the step's recording (a decoder of other shapes takes this one's place; the
        compiler's cache, which outlives it, would keep the recording alive)."""
        if self.step_graph is not None:
            self.step_graph.drop()

    def _drop_regions(self, e: BaseException) -> None:
        """After the compiler refused the block regions (`e`): warn, unmark the blocks and
        compile the step and the prefill again, every block on its own."""
        warnings.warn(
            f"quantmesh: compiling one block for every block failed ({said(e)}); compiling "
            "them all",
            stacklevel=4,
        )
        self.regions = False  # later calls leave the blocks unmarked
        unmark_block_regions(self.model)
        torch._dynamo.reset()
        self.compiled = torch.compile(self.step, fullgraph=True, **self.opts)
        self._use(self.compiled)
        if self.prefill_run is not None:
            self.prefill_run = self._compile_prefill()

    def logits(
        self, tok: torch.Tensor, **extra: Any
    ) -> torch.Tensor:  # (batch, 1) -> (batch, vocab)
        """One step's next-token logits (the cache advances by one position); `extra`: the
        attention mask and position ids of left-padded rows."""
        out: torch.Tensor = self.model(input_ids=tok, **self.kw, **extra).logits  # (b, 1, vocab)
        return out[:, -1]

    def step(
        self,
        tok: torch.Tensor,  # (batch, 1)
        sample: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        padding: tuple[torch.Tensor, torch.Tensor] | None = None,
        repeat: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:  # -> (batch, 1)
        """The next tokens: argmax, or with `sample` = (noise (batch, vocab), temperature
        (batch,), top_p (batch,)) a draw; `padding` = (attention mask (batch, cache length),
        position ids (batch, 1)) for left-padded rows; `repeat` = (seen (batch, vocab) bool,
        repetition penalty (batch,)): the penalty on the tokens seen."""
        logits = self.logits(tok, **_padding_kw(padding))
        if repeat is not None:
            logits = repetition_penalized(logits, *repeat)
        if sample is None:
            return logits.argmax(dim=-1, keepdim=True)
        return pick_tokens(logits, *sample).unsqueeze(-1)

    def _prefill_logits(self, input_ids: torch.Tensor, kw: dict[str, Any]) -> torch.Tensor:
        """The prompt's last logits (batch, vocab); the cache then holds the prompt."""
        logits: torch.Tensor = self.model(input_ids=input_ids, **kw).logits
        return logits[:, -1]

    def prefill(
        self, input_ids: torch.Tensor, padding: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> torch.Tensor:  # (batch, prompt) -> (batch, vocab)
        """The last position's logits; the cache then holds the prompt. The first prefill of a
        fusing decoder also finds the adapters that read one tensor (`stack_sibling_adapters`)
        and, where `kernel4.joins_pay_on` the device (a GPU), joins the 4-bit codes of such layers
        (`join_sibling_codes_in`): an eager forward run, of the prompt's first token where the
        prefill is compiled or the codes are joined (its cache is then cleared). Every prefill
        copies the adapters' current weights into the stacks.

        With `PREFILL_COMPILED` a compiled decoder compiles the prefill too, the prompt's length
        dynamic: an eager prefill launches every op of every layer from the host, about a
        tenth of a second on a 7B model. Where the compiler refuses it, the prefill runs
        eagerly from then on, with a warning. Otherwise, with `prefill_graph.ENABLED` (the default),
        a compiled decoder replays its eager prefill as a CUDA graph per length bucket where
        that applies (`PrefillGraphs`: recorded after an eager prefill, which it is checked
        against)."""
        self.cache.reset()  # in place: the tensors keep their addresses
        kw = {**self.prefill_kw, **_padding_kw(padding)}
        join = self.fuse and not self.joined and kernel4.joins_pay_on(input_ids.device)
        compiled = PREFILL_COMPILED and self.prefill_run is not None
        stacks = None
        # the prompt's logits, where the finding forward gave them
        eager: torch.Tensor | None = None
        if (self.fuse and self.stacks is None) or join:
            with contextlib.ExitStack() as finding:
                if self.fuse and self.stacks is None:
                    stacks = finding.enter_context(stack_sibling_adapters(self.model))
                if join:  # the 4-bit siblings' codes, joined once per decoder (the switch may flip)
                    finding.enter_context(join_sibling_codes_in(self.model))
                    self.joined = True
                if not compiled and not join:  # the eager prefill finds them
                    eager = self._prefill_logits(input_ids, kw)
                else:  # (a join: the prefill itself runs on the joined codes, so that the first
                    # call, not the second, compiles the kernels' forms for them)
                    self.model(input_ids=input_ids[:, :1], **self.prefill_kw)
            if eager is None:
                self.cache.reset()
        logits = self._compiled_prefill(input_ids, kw) if compiled else None
        if logits is None:  # (after an eager finding forward: its bucket recorded, if it applies)
            logits = self._replayed_prefill(input_ids, kw, padding, eager)
        return self._found(stacks, logits)

    def _replayed_prefill(
        self,
        input_ids: torch.Tensor,
        kw: dict[str, Any],
        padding: Any,
        eager: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The prompt's last logits from its bucket's recorded prefill (`PrefillGraphs`): recorded
        after an eager prefill (`eager`: its logits where it has run, the cache holding it) the
        first time, replayed after; the eager prefill where it does not apply or was refused."""
        graphs = self.graphs
        if graphs is None or graphs.why_not(input_ids, padding) is not None:
            return self._prefill_logits(input_ids, kw) if eager is None else eager
        # (None for a fresh decoder, whose first call gave `eager`)
        logits = graphs.replay(input_ids)
        if logits is None:
            if eager is None:
                eager = self._prefill_logits(input_ids, kw)
            logits = graphs.record_after(input_ids, eager)
            if logits is None:  # refused (and said): the eager prefill again, on a clean cache
                self.cache.reset()
                logits = self._prefill_logits(input_ids, kw)
        return logits

    def _found(self, stacks: list[AdapterStack] | None, logits: torch.Tensor) -> torch.Tensor:
        """`logits`, after keeping the stacks a prefill found (or refreshing the earlier ones)
        and making the adapters' launch vectors (`prepare_low_rank`)."""
        if stacks is not None:
            self.stacks = stacks  # built from the current weights
        else:  # the adapters may have trained since the last call
            refresh_stacks(self.stacks or [])
        prepare_low_rank(self.model)
        return logits

    def _compiled_prefill(self, input_ids: torch.Tensor, kw: dict[str, Any]) -> torch.Tensor | None:
        """The compiled prefill's logits, or None where the compiler refused it (then with a
        warning, and eager from then on); a refusal of the block regions compiles every block
        instead, as the step's first call does. A refusal comes while tracing, before the model
        ran: the cache has not moved."""
        input_ids = input_ids.contiguous()  # (a slice's strides would compile it again)
        if input_ids.shape[1] > 1:  # one graph for every length (a length of 1 gets its own)
            torch._dynamo.maybe_mark_dynamic(input_ids, 1)
        try:
            out: torch.Tensor = self.prefill_run(input_ids, kw)
            return out
        except torch._dynamo.exc.TorchDynamoException as e:
            if self.regions:
                self._drop_regions(e)
                return self._compiled_prefill(input_ids, kw)
            warnings.warn(
                f"quantmesh: compiling the prefill failed ({said(e)}); it runs eagerly",
                stacklevel=4,
            )
            self.prefill_run = None
            return None

    def stacked(self, on: bool) -> None:
        """Turn the adapter stacks on (for the steps) or off."""
        for stack in self.stacks or []:
            stack.active = on


def _decoder_key(*shape: Any) -> tuple[Any, ...]:
    """What a `_Decoder` is made for: its arguments after the model (batch, cache length, compile,
    mode, sampled, padded, fused adapters, penalized) and the step-graph switch; `fast_decode`
    makes a new one when the key differs."""
    return (*shape, step_graph.ENABLED)


def _refuse_eager_experts(model: nn.Module) -> None:
    """Refuse a compiled step over experts that run transformers' eager implementation: it loops
    over the experts a batch hits, a count only the data gives, which a fullgraph compile cannot
    trace (torch stops with a data-dependent-size error deep in the model's code)."""
    for name, m in model.named_modules():
        local = m.__dict__.get("local", m)  # a sharded layer's own module
        cfg = getattr(local, "config", None)
        if hasattr(local, "has_gate") and getattr(cfg, "_experts_implementation", None) == "eager":
            raise ValueError(
                f"{name} runs transformers' eager experts implementation, which loops over the "
                "experts each batch hits: a compiled decode step cannot trace that loop. Load the "
                'model with experts_implementation="grouped_mm" (transformers\' default), or set '
                'model.config._experts_implementation = "grouped_mm" before decoding; or decode '
                "with compile=False"
            )


def _static_statistics(model: nn.Module) -> None:
    """Mark the statistics of the model's 4-bit weights (a QuantState's tensors: attributes, not
    parameters or buffers) as fixed addresses, so that the CUDA graphs read them where they are
    instead of copying them in before every replay, as they do with other inputs."""
    for p in model.parameters():
        qs = getattr(p, "quant_state", None)
        if qs is None:
            continue
        for t in kernel4.quant_state_tensors(qs):
            if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                torch._dynamo.mark_static_address(t, guard=False)


def _padding_kw(padding: tuple[torch.Tensor, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """The forward's keywords for left-padded rows: (attention mask, position ids), or none."""
    return {} if padding is None else {"attention_mask": padding[0], "position_ids": padding[1]}


@torch.no_grad()
def fast_decode(
    model: nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float | list[float] = 0.0,
    top_p: float | list[float] = 1.0,
    seed: int = 0,
    repetition_penalty: float | list[float] = 1.0,
    attention_mask: torch.Tensor | None = None,
    eos_token_id: int | list[int] | None = None,
    compile: bool = True,
    mode: str | None = "reduce-overhead",
    check_every: int = 32,
    fuse_adapters: bool = True,
) -> torch.Tensor:
    """Continue `input_ids` (batch, prompt); returns (batch, <= max_new_tokens) new ids.

    Rows of different lengths come left-padded, with their `attention_mask` (the tokenizer's, with
    `padding_side="left"`): each row then decodes as it would alone. Without a mask every token of
    every row is taken as part of its prompt.

    Greedy when `temperature` is 0 (the default), else sampled with `temperature` and nucleus
    `top_p`, either one value for every row or one per row (a row with temperature 0 is greedy).
    Draws come from `seed` alone: the same seed and batch size give the same tokens on every rank,
    eager or compiled (up to near-ties that rounding may flip). `repetition_penalty` (one value
    or one per row; 1 = off) is transformers': the logits of every token already in the row
    (prompt or reply; pads excluded) are divided by it where positive and multiplied where
    negative, before temperature and top-p. The model must be a transformers
    causal LM (plain, quantized, or parallelized by quantmesh); its config gives the static
    cache's layout. `compile=False` runs the same loop eagerly. With `mode` "reduce-overhead"
    (the default) on a GPU the compiled step is recorded as one CUDA graph at the first call's
    second step and replayed by every later step; each call's first step runs the compiled frame
    (its guards, its inputs gathered) and checks the recording against it without launching the
    step (`quantmesh.infer.step_graph`: a recompile, or a tensor the step reads at another
    address, runs it and records it again; otherwise it is replayed;
    $QUANTMESH_STEP_CHECK_REPLAYS=0 runs the step in every check). The first call compiles the step
    (tens of seconds for a 7B model); later calls reuse it while the batch size, the cache length
    (prompt + new tokens, rounded up to a multiple of 256) and greedy-or-sampled stay. With
    $QUANTMESH_COMPILED_PREFILL=1 the prefill is compiled too, one graph for prompts of any length
    but 1: about 0.08 s less a call on a 7B model, for a first compile about three times as long.
    `eos_token_id` may be one id or several (any of them ends a row); a row that reaches one is
    filled with it after its first EOS, and decoding stops once every row has one (checked every
    `check_every` tokens).

    LoRA adapters of sibling layers that read one tensor (q, k, v; gate, up) run stacked in the
    steps: one matmul for their A's and one for their B's (block-diagonal) instead of two per
    adapter (`quantmesh.infer.decode.AdapterStack`; it keeps a copy of those adapters, refreshed at
    every call). `fuse_adapters=False` runs each adapter on its own. On a GPU with Triton an sdpa
    model attends through quantmesh's split-KV kernel in the steps (`quantmesh.infer.attention`;
    QUANTMESH_DECODE_ATTENTION=0 keeps sdpa). Blocks compiled for training
    (`compile_blocks`) run uncompiled while it decodes (the step is compiled as a whole) and
    compiled again after.

    Example:
        >>> ids = tok("Once upon a time", return_tensors="pt").input_ids.to(mesh.device)  # doctest: +SKIP
        >>> new = qm.fast_decode(model, ids, 256, temperature=0.8, top_p=0.95, seed=1)    # doctest: +SKIP
        >>> print(tok.decode(new[0]))                                                      # doctest: +SKIP
    """
    if input_ids.dim() != 2 or input_ids.shape[1] < 1:
        raise ValueError(
            f"input_ids of shape {tuple(input_ids.shape)}; expected (batch, prompt length >= 1)"
        )
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}; expected >= 1")
    if check_every < 1:
        raise ValueError(f"check_every={check_every}; expected >= 1")
    batch, prompt = input_ids.shape
    temps = _rows("temperature", temperature, batch)
    tops = _rows("top_p", top_p, batch)
    reps = _rows("repetition_penalty", repetition_penalty, batch)
    if any(t < 0 or t != t for t in temps) or not all(0 < p <= 1 for p in tops):
        raise ValueError(
            f"temperature={temperature}, top_p={top_p}; expected temperature >= 0 (0 = greedy) "
            "and 0 < top_p <= 1"
        )
    if not all(r > 0 and r != float("inf") for r in reps):
        raise ValueError(
            f"repetition_penalty={repetition_penalty}; expected > 0 (1 = off; > 1 curbs loops)"
        )
    from ..parallel.state import parallel_state

    st = parallel_state(model, required=False)
    if st is not None and st.mesh.pp > 1:
        raise NotImplementedError(
            f"decoding at pp={st.mesh.pp}: each rank holds one pipeline stage, and decoding "
            f"through the stages (one token crossing every stage per step) is not implemented; "
            f"decode with tp instead: qm.init_mesh(tp={st.mesh.tp * st.mesh.pp}) (or pp=1)"
        )
    if compile:
        _refuse_eager_experts(model)
    padded = _check_mask(attention_mask, input_ids)
    sampled = any(t > 0 for t in temps)
    penalized = any(r != 1.0 for r in reps)
    # The cache length in steps of CACHE_STEP: prompts of other lengths reuse the compiled step
    # (a new cache would compile it again); unused slots are masked out.
    max_len = -(-(prompt + max_new_tokens) // CACHE_STEP) * CACHE_STEP
    key = _decoder_key(batch, max_len, compile, mode, sampled, padded, fuse_adapters, penalized)
    # the compiled step is cached on the model itself (a plain model works too), not in the
    # parallel state: it is a cache of this function, not a decision of parallelize
    dec = model.__dict__.get("_quantmesh_decoder")
    if dec is None or dec.key != key:
        if dec is not None:  # (its recording holds its cache's tensors and its graph's memory)
            dec.release()
        dec = _Decoder(model, batch, max_len, compile, mode, sampled, padded, fuse_adapters,
                       penalized)  # fmt: skip
        model.__dict__["_quantmesh_decoder"] = dec
    padding = None
    if padded:
        assert attention_mask is not None  # padded
        # the mask over the whole cache (the slots after the prompt are the new tokens', and the
        # causal mask hides those not written yet); positions count each row's own tokens
        mask = attention_mask.to(device=input_ids.device, dtype=torch.long)
        full = torch.ones(batch, max_len, dtype=torch.long, device=input_ids.device)
        full[:, :prompt] = mask
        pos = (mask.cumsum(dim=1) - 1).clamp(min=0)  # (batch, prompt)
        padding = (full, pos)
    # the blocks as the step's compile wants them while decoding: one region, and a training
    # compile of theirs (compile_blocks) set aside (blocks_for_decoding)
    with contextlib.ExitStack() as decoding:
        decoding.enter_context(blocks_for_decoding(model, dec.regions))
        if attention.decode_attention_wanted(model):  # sdpa's, one query token: the kernel
            decoding.enter_context(attention.decode_attention(model))
            if not attention.decode_attention_runs(model):
                impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
                warnings.warn(
                    f"quantmesh: QUANTMESH_DECODE_ATTENTION is on, but {type(model).__name__} "
                    f"runs attention with {impl!r}, and the decode attention takes the place of "
                    "sdpa only: it decodes with its own; load the model with "
                    "attn_implementation='sdpa' to use the kernel (QUANTMESH_DECODE_ATTENTION=0 "
                    "says nothing)",
                    stacklevel=2,
                )
        # prefill (eager, or compiled after an eager forward that finds the siblings): it fills
        # the cache (transformers marks its tensors static for the graphs)
        logits = dec.prefill(input_ids, padding)  # (batch, vocab)
        device = logits.device
        if padding is not None:
            step_pos = padding[1][:, -1:] + 1  # (batch, 1): the first new token's position per row
        repeat = None
        if penalized:  # (seen, penalty): the prompt's tokens, pads excluded, then each new one
            vocab = logits.shape[-1]
            prompt_ids = input_ids.to(device)
            if attention_mask is not None:  # pads go to a spare column, dropped
                prompt_ids = torch.where(attention_mask.to(device) != 0, prompt_ids, vocab)
            seen = torch.zeros(batch, vocab + 1, dtype=torch.bool, device=device)
            seen = seen.scatter_(1, prompt_ids, True)[:, :vocab].contiguous()
            repeat = (seen, torch.tensor(reps, dtype=torch.float32, device=device))
            logits = repetition_penalized(logits, *repeat)
        if sampled:
            gen = torch.Generator(device=device).manual_seed(seed)  # alike on every rank
            t_rows = torch.tensor(temps, dtype=torch.float32, device=device)  # (batch,)
            p_rows = torch.tensor(tops, dtype=torch.float32, device=device)  # (batch,)
            vocab = logits.shape[-1]
            tok = sample_tokens(logits, t_rows, p_rows, gen).unsqueeze(-1)  # (batch, 1)
        else:
            tok = logits.argmax(dim=-1, keepdim=True)  # (batch, 1)
        eos = None
        if eos_token_id is not None:
            ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
            eos = torch.tensor(ids, dtype=tok.dtype, device=tok.device)  # (n_eos,)
        out = torch.empty(batch, max_new_tokens, dtype=tok.dtype, device=tok.device)
        out[:, :1] = tok
        done = 1
        dec.stacked(True)
        dec.begin()
        try:
            for i in range(1, max_new_tokens):
                sample = None
                if sampled:
                    sample = (uniform_noise(batch, vocab, gen, device), t_rows, p_rows)
                if repeat is not None:  # outside the step: it reads `seen`, never writes it
                    repeat[0].scatter_(1, tok, True)
                if padding is not None:
                    tok = dec.run(tok, sample, (padding[0], step_pos), repeat)
                    step_pos = step_pos + 1
                else:
                    tok = dec.run(tok, sample, None, repeat)
                tok = tok.clone()  # a copy: a CUDA graph's output is rewritten by the next replay
                out[:, i : i + 1] = tok
                done = i + 1
                if eos is not None and done % check_every == 0:
                    if bool(torch.isin(out[:, :done], eos).any(dim=1).all()):
                        break
        finally:
            dec.stacked(False)
    out = out[:, :done]
    if eos is not None:  # everything after a row's first EOS becomes that EOS
        hit = torch.isin(out, eos)  # (batch, done)
        after = hit.int().cumsum(dim=1) > 0
        first = torch.where(hit, out, 0).gather(1, hit.int().argmax(dim=1, keepdim=True))
        out = torch.where(after, first, out)
    return out


def _check_mask(mask: torch.Tensor | None, input_ids: torch.Tensor) -> bool:
    """Whether `mask` pads any row (then it must be a left-padding mask); refuses others."""
    if mask is None:
        return False
    if mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask of shape {tuple(mask.shape)} for input_ids of shape "
            f"{tuple(input_ids.shape)}; expected the same shape"
        )
    m = mask.to(torch.long)
    if bool(((m != 0) & (m != 1)).any()):
        raise ValueError("attention_mask holds values other than 0 and 1")
    if bool((m.sum(dim=1) == 0).any()):
        raise ValueError("a row of attention_mask is all 0: every prompt needs a token")
    if bool((m.cummax(dim=1).values != m).any()):  # a 0 after a 1: right padding
        raise ValueError(
            "attention_mask pads on the right; decoding appends after the last position, so pad "
            "on the left (tokenizer.padding_side = 'left')"
        )
    return bool((m == 0).any())


def _rows(name: str, v: float | list[float], batch: int) -> list[float]:
    """One setting per row: a number for all, or a list of `batch` numbers."""
    if isinstance(v, (int, float)):
        return [float(v)] * batch
    vals = [float(x) for x in v]
    if len(vals) != batch:
        raise ValueError(
            f"{name} has {len(vals)} values for a batch of {batch}; give one or {batch}"
        )
    return vals


def greedy_decode(
    model: nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    eos_token_id: int | list[int] | None = None,
    compile: bool = True,
    mode: str | None = "reduce-overhead",
    check_every: int = 32,
    fuse_adapters: bool = True,
) -> torch.Tensor:
    """Greedy continuation of `input_ids` (batch, prompt): `fast_decode` with temperature 0.

    Example:
        >>> ids = tok("Once upon a time", return_tensors="pt").input_ids.to(mesh.device)  # doctest: +SKIP
        >>> new = qm.greedy_decode(model, ids, 256)                                        # doctest: +SKIP
        >>> print(tok.decode(new[0]))                                                      # doctest: +SKIP
    """
    return fast_decode(
        model,
        input_ids,
        max_new_tokens,
        eos_token_id=eos_token_id,
        compile=compile,
        mode=mode,
        check_every=check_every,
        fuse_adapters=fuse_adapters,
    )


# ---- sibling adapters stacked for the decode step ---------------------------------------------------


class AdapterStack:
    """The adapters of sibling layers that read one tensor (q, k, v; gate, up), as two matmuls.

    `x @ [A_1; ...; A_n]^T` gives every sibling's (..., r) at once, and that times the
    block-diagonal of B_1 ... B_n every sibling's (..., out_i): each sibling then adds its own slice,
    times its own scale. The zero blocks add exact zeros, so each slice is that sibling's
    `B_i(A_i(x))`, up to the order in which the matmul sums. Made for the decode step, where
    2n small matmuls per group cost more in launches than their bytes (`fast_decode` builds the
    stacks from its first eager forward and refreshes them before each call).

    The stack holds copies of the weights (`refresh` copies them in again, in place) and is used
    only while `active`, without autograd, and by siblings that get the very tensor the first one
    got; any other call takes the sibling's own adapter (`StackedLora`).

    Example:
        >>> with stack_sibling_adapters(model) as stacks:  # doctest: +SKIP
        ...     model(input_ids=ids)   # one eager forward: who reads what
        >>> len(stacks)                # q/k/v and gate/up of each block  # doctest: +SKIP
        4
    """

    def __init__(self, members: list[ShardedModule]) -> None:
        self.members = members
        self.ranks = [_lora(m).r for m in members]
        self.outs = [int(_lora(m).lora_B.weight.shape[0]) for m in members]
        self.out_at = [sum(self.outs[:i]) for i in range(len(members))]
        self.active = False
        self.x: torch.Tensor | None = None  # the input of this forward's first sibling
        self.out: torch.Tensor | None = None  # (..., sum of outs): every sibling's B(A(x))
        self.a = torch.empty(0)
        self.b = torch.empty(0)
        # the deltas as a joined 4-bit launch adds them (`low_rank`): B's rows, r_max wide (zeros
        # past a member's rank), where each row's A products begin, each member's scale; made
        # only where kernel4.gemv_lora_on (empty otherwise)
        self.e = self.col = self.scale = torch.empty(0)
        self.locals = tuple(id(m.local) for m in members)
        # the views `refresh` copies into, and the scales last written (`_copies`)
        self._into: list[torch.Tensor] | None = None
        self._scales: list[float] | None = None
        self.refresh()

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the members' current A and B in (in place, so a captured CUDA graph reads them);
        `refresh_stacks` does it for many stacks at once."""
        refresh_stacks([self])

    def _copies(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(where, what): the views of the stack's tensors each member's A and B go to, and those
        weights now; (re)makes the tensors where the weights' shape, dtype or device moved, and
        writes the columns and the scales where they are new or changed."""
        w = _lora(self.members[0]).lora_A.weight
        r_at = [sum(self.ranks[:i]) for i in range(len(self.members) + 1)]
        a_shape = (r_at[-1], int(w.shape[1]))
        b_shape = (sum(self.outs), r_at[-1])
        if self.a.shape != a_shape or self.a.dtype != w.dtype or self.a.device != w.device:
            # fixed addresses on CUDA: CUDA graphs read them, never copy them
            self.a = static_on_cuda(torch.empty(a_shape, dtype=w.dtype, device=w.device))
            self.b = static_on_cuda(torch.zeros(b_shape, dtype=w.dtype, device=w.device))
            self._into = None
        n, r_max = sum(self.outs), max(self.ranks)
        if not kernel4.gemv_lora_on(w.device):  # (made when it is on at a prefill's refresh)
            if self.e.numel():
                self.e = self.col = self.scale = torch.empty(0)
                self._into = None
        elif (
            tuple(self.e.shape) != (n, r_max)
            or self.e.dtype != w.dtype
            or self.e.device != w.device
        ):
            self.e = static_on_cuda(torch.zeros(n, r_max, dtype=w.dtype, device=w.device))
            self.col = static_on_cuda(torch.zeros(n, dtype=torch.int32, device=w.device))
            self.scale = static_on_cuda(torch.zeros(n, dtype=torch.float32, device=w.device))
            self._into, self._scales = None, None
            for i in range(len(self.members)):  # (the ranks are the stack's: fixed)
                self.col[self.out_at[i] : self.out_at[i] + self.outs[i]].fill_(r_at[i])
        if self._into is None:  # the views, made once for the tensors' life
            into = []
            for i in range(len(self.members)):
                o = self.out_at[i]
                into += [
                    self.a[r_at[i] : r_at[i + 1]],
                    self.b[o : o + self.outs[i], r_at[i] : r_at[i + 1]],
                ]
                if self.e.numel():
                    into.append(self.e[o : o + self.outs[i], : self.ranks[i]])
            self._into = into
        what = []
        for m in self.members:
            ad = _lora(m)
            what += [ad.lora_A.weight, ad.lora_B.weight]
            if self.e.numel():
                what.append(ad.lora_B.weight)
        if self.e.numel():
            scales = [float(_lora(m).scale) for m in self.members]  # (the member's own)
            if scales != self._scales:
                for i, sc in enumerate(scales):
                    self.scale[self.out_at[i] : self.out_at[i] + self.outs[i]].fill_(sc)
                self._scales = scales
        return self._into, what

    def down(self, cast: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """Every member's A product of `x` (..., sum of ranks), fp32: what `low_rank`'s `col`
        indexes."""
        return lean_linear(cast(x), self.a)

    def low_rank(self, i: int, cast: Callable[[torch.Tensor], torch.Tensor]) -> LowRank:
        """Member `i`'s delta as a 4-bit launch adds it (`lora.adapter.LowRank`): its rows of the
        stack's B rows, scales and columns of A products, its `whole` the stack's (a joined
        launch of the members' codes adds every member's)."""
        down = functools.partial(self.down, cast)
        whole = LowRank(self.e, self.col, self.scale, down, None, self.locals)
        rows = slice(self.out_at[i], self.out_at[i] + self.outs[i])
        return LowRank(self.e[rows], self.col[rows], self.scale[rows], down, whole, self.locals)

    def delta(
        self, i: int, x: torch.Tensor, cast: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor | None:
        """Member `i`'s `B(A(x))` (..., out_i), or None when `x` is not the tensor the first member
        got in this forward; `cast` turns x into what the adapters take (`Adapter.cast_in`)."""
        d = None
        if i == 0:
            self.x = x
            a = lean_linear(cast(x), self.a)  # (..., sum of ranks)
            self.out = lean_linear(a, self.b)  # (..., sum of outs)
        if self.x is x and self.out is not None:
            o = self.out_at[i]
            d = self.out[..., o : o + self.outs[i]]
        if i == len(self.members) - 1:  # the last sibling: hold no tensor past this forward
            self.x = self.out = None
        return d


@torch.no_grad()
def refresh_stacks(stacks: list[AdapterStack]) -> None:
    """Copy every stack's members' current A and B in (`AdapterStack.refresh`), as one foreach
    copy rather than one copy per weight: a prefill refreshes about 700 weights on a 7B model.

    Example:
        >>> refresh_stacks(decoder.stacks)  # doctest: +SKIP
    """
    into: list[torch.Tensor] = []
    what: list[torch.Tensor] = []
    for stack in stacks:
        i, w = stack._copies()
        into += i
        what += w
    if into:
        torch._foreach_copy_(into, what)


@torch.no_grad()
def prepare_low_rank(model: nn.Module) -> int:
    """Unless `kernel4.GEMV_LORA_ENABLED` is off, make every LoRA adapter's tensors for the
    gemv's launch where its device takes them (`kernel4.gemv_lora_on`, which
    `LoraAdapter.low_rank` asks: kept, never made while a graph is traced, where the adapter's delta
    then stays outside the launch) and copy the biases of joined 4-bit siblings in
    (`CodesRun.refresh_bias`: a joined launch adds them before the deltas); `fast_decode` calls
    it after each prefill. Returns how many adapters have them.

    Example:
        >>> prepare_low_rank(model)  # on CPU: nothing made  # doctest: +SKIP
        0
    """
    if not kernel4.GEMV_LORA_ENABLED:
        return 0
    made = 0
    runs: dict[int, tuple[Any, torch.dtype, dict[int, nn.Module]]] = {}  # each joined run once:
    for module in model.modules():  # its members' compute dtype, its members by index
        if isinstance(module, ShardedModule) and isinstance(module.lora, LoraAdapter):
            made += LoraAdapter.low_rank(module.lora) is not None
        m = module.__dict__.get("local", module)  # (a sharded layer holds its own in `local`)
        run = m.__dict__.get("codes_run")
        cd = getattr(m, "compute_dtype", None)
        if run is not None and cd is not None:
            runs.setdefault(id(run), (run, cd, {}))[2][int(m.codes_index)] = m
    for run, cd, members in runs.values():
        run.refresh_bias(cd, [members[i] for i in sorted(members)])
    return made


class StackedLora(LoraAdapter):
    """A stack member's adapter: the very A, B, dropout and scale of its `LoraAdapter`, whose
    delta comes from its group's `AdapterStack` (times its own scale) while the stack is active,
    without autograd and without an active dropout, for the tensor the group's first member got;
    otherwise it runs as the plain adapter. Saved, loaded and trained as one (it is one).

    Example:
        >>> layer.set_adapter(StackedLora(layer.lora, stack, 0))  # doctest: +SKIP
    """

    def __init__(self, base: LoraAdapter, stack: AdapterStack, index: int) -> None:
        super().__init__(base.lora_A, base.lora_B, base.lora_dropout, base.scale)
        self.stack, self.index = stack, index

    def retuned(self, *, scale: float, dropout: float) -> StackedLora:
        """Another scale and dropout; still in its stack."""
        return StackedLora(super().retuned(scale=scale, dropout=dropout), self.stack, self.index)

    def plain(self) -> LoraAdapter:
        """The same adapter, out of any stack."""
        return LoraAdapter(self.lora_A, self.lora_B, self.lora_dropout, self.scale)

    def shortcut(self, x: torch.Tensor) -> torch.Tensor | None:
        drop = self.lora_dropout
        if (
            not self.stack.active
            or torch.is_grad_enabled()
            or (drop.training and not isinstance(drop, nn.Identity))
        ):
            return None  # stacked adapters: without autograd or dropout only (decoding)
        d = self.stack.delta(self.index, x, self.cast_in)  # one matmul pair for the siblings
        return None if d is None else d * self.scale

    def low_rank(self) -> LowRank | None:
        """The stack's `LowRank` for this member while the stack is active (the same conditions
        as `shortcut`, and fp32 factors); otherwise the plain adapter's."""
        st = self.stack
        if st.active and st.e.numel() and _adds_in_launch(self, st.e, st.a):
            return st.low_rank(self.index, self.cast_in)
        return super().low_rank()


def _lora(m: ShardedModule) -> LoraAdapter:
    ad = m.lora
    assert ad is not None  # stack members carry a LoraAdapter (_stackable)
    return ad


def _stackable(m: ShardedModule) -> bool:
    """A layer whose adapter sees the whole input as it comes (not a rowwise shard of it), with
    plain weights (FSDP's sharded DTensors are gathered only inside the forward)."""
    from torch.distributed.tensor import DTensor

    ad = m.lora
    return (
        ad is not None
        and not isinstance(ad.lora_A.weight, DTensor)
        and not isinstance(ad.lora_B.weight, DTensor)
        and m.style not in (Style.ROWWISE, Style.VOCAB)
    )


@contextlib.contextmanager
def sibling_runs(
    mods: Iterable[ShardedModule], same: Callable[[ShardedModule, ShardedModule], bool]
) -> Iterator[list[list[ShardedModule]]]:
    """The layers of `mods` that read the same tensor one after another (q, k, v; gate, up),
    found during the forward run inside the block: the list it yields is filled when the block
    ends, with each run of two or more. `same(first, m)`: whether `m` may join the run `first`
    began (decoding asks for one adapter dtype). A layer called more than once is left out.

    Example:
        >>> with sibling_runs(layers, lambda a, b: True) as runs:  # doctest: +SKIP
        ...     model(input_ids=ids)
        >>> [len(r) for r in runs]  # doctest: +SKIP
        [3, 2, 3, 2]
    """
    runs: list[list[ShardedModule]] = []
    seen: dict[int, int] = {}
    last: list[torch.Tensor | None] = [None]

    def pre(mod: ShardedModule, args: tuple) -> None:
        x = args[0] if args else None
        seen[id(mod)] = seen.get(id(mod), 0) + 1
        if not isinstance(x, torch.Tensor):
            last[0] = None
            return
        first = runs[-1][0] if runs and last[0] is x else None
        if first is not None and same(first, mod):
            runs[-1].append(mod)
        else:
            runs.append([mod])
            last[0] = x

    handles = [m.register_forward_pre_hook(pre) for m in mods]
    found: list[list[ShardedModule]] = []
    try:
        yield found
    finally:
        for h in handles:
            h.remove()
        last[0] = None
    for run in runs:
        members = [m for m in run if seen[id(m)] == 1]
        if len(members) >= 2:
            found.append(members)


@contextlib.contextmanager
def join_sibling_codes_in(model: nn.Module) -> Iterator[None]:
    """Find, during the one eager forward run inside the block, the layers that read the same
    tensor one after another (`sibling_runs`; not rowwise or vocabulary shards), and join the 4-bit
    codes of each run where the kernels can read them as one weight (`quant.bnb.
    join_sibling_codes`: only with `quant.kernel4.JOIN_ENABLED`; in place, no memory added).

    Example:
        >>> with join_sibling_codes_in(model):  # doctest: +SKIP
        ...     model(input_ids=ids)
    """
    if not kernel4.JOIN_ENABLED:
        yield
        return
    from ..quant.bnb import join_sibling_codes

    layers = sharded_modules(model).values()
    mods = [m for m in layers if m.style not in (Style.ROWWISE, Style.VOCAB)]
    with sibling_runs(mods, lambda first, m: True) as runs:
        yield
    join_sibling_codes([[m.local for m in run] for run in runs])


@contextlib.contextmanager
def stack_sibling_adapters(model: nn.Module) -> Iterator[list[AdapterStack]]:
    """Find, during the one eager forward run inside the block, the adapter layers that read the
    same tensor one after another (`sibling_runs`), and give each such group an `AdapterStack`
    (inactive): each member's adapter becomes a `StackedLora` of it. The list it yields is
    filled when the block ends.

    A layer called more than once in that forward, or whose adapter has another dtype than the
    first of its run, is left out; a run whose adapters sit on several devices gets no stack.
    Earlier stacks of the model are dropped first (their members' adapters made plain again).

    Example:
        >>> with stack_sibling_adapters(model) as stacks:  # doctest: +SKIP
        ...     model(input_ids=ids)
    """
    layers = sharded_modules(model).values()
    for old in layers:
        if isinstance(old.lora, StackedLora):
            old.set_adapter(old.lora.plain())
    mods = [m for m in layers if _stackable(m)]

    def same(first: ShardedModule, m: ShardedModule) -> bool:
        return _lora(first).lora_A.weight.dtype == _lora(m).lora_A.weight.dtype

    stacks: list[AdapterStack] = []
    with sibling_runs(mods, same) as runs:
        yield stacks
    for members in runs:
        if len({_lora(m).lora_A.weight.device for m in members}) > 1:
            continue
        stack = AdapterStack(members)
        for i, m in enumerate(members):
            m.set_adapter(StackedLora(_lora(m), stack, i))
        stacks.append(stack)
