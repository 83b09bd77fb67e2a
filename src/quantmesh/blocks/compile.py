"""compile_blocks: torch.compile each repeated block of a parallelized model, in place.

A tp step is bound by the host when every block issues hundreds of small kernels from Python (the
4-bit matmuls, the adapters, norms, rotary, casts) and each tp all-reduce waits for the slower rank's
launches. Compiling a block turns its forward and backward into one graph each: the elementwise work
is fused and the launches come from a few generated calls. The sharded layers are written to trace
without graph breaks: their collectives are torch.distributed calls that dynamo maps to functional
collectives, and they keep no Python-side state under compile.

Blocks, not the whole model: the blocks of a model are one class, so every block reuses one compiled
graph (parameters are graph inputs), and the code around them (masks, embeddings, generation loops)
stays eager. Names, state_dict keys and parameters are unchanged (the module's call is compiled in
place, as `nn.Module.compile` does).

What a compiled block keeps for backward is chosen by AOTAutograd's min-cut partitioner. By default
it never recomputes a result that the backward must hold whole anyway, for a matmul: the norms'
outputs (the adapters' A read them for their gradients), SiLU(gate) * up (down_proj's adapter) and
autocast's bf16 copies of the adapters' weights. Each is one elementwise pass over tensors the
block keeps anyway (the block's input and the residual with their rsqrt rows; gate and up), so
`compile_blocks` lets the partitioner recompute them in backward (`recompute_elementwise`, on by
default): 2 h + i of the 4 h + 2 q + 2 kv + 3 i values a layer keeps per token, about 29% of a
Llama-2-7B block's saved activations, for one more write of each in backward.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ..config import env_switch
from ..plan.auto import blocks_of

__all__ = [
    "blocks_for_decoding",
    "compile_blocks",
    "compile_fn",
    "mark_block_regions",
    "replays_cuda_graphs",
    "unmark_block_regions",
]

RECOMPUTE_ELEMENTWISE = "recompute_elementwise"
"""compile_blocks' own keyword, kept with torch.compile's in a block's recorded keywords and taken
out by `compile_fn`."""


def compile_blocks(
    model: nn.Module, *, recompute_elementwise: bool = True, **compile_kwargs: Any
) -> int:
    """`torch.compile` every repeated block of `model` (the elements of its largest ModuleList).

    Call it after `qm.parallelize` (and after loading weights, or before: compiling is lazy and
    happens on the first forward). Keyword arguments go to `torch.compile` (e.g. `fullgraph=True` to
    fail on any graph break, `mode="max-autotune"`); without `backend`, $QUANTMESH_COMPILE_BACKEND
    or inductor (`quantmesh.config.compile_options`). `recompute_elementwise` (default on): the
    backward recomputes the norms' outputs, SiLU(gate) * up and the adapters' autocast weight
    copies instead of keeping them (module docstring; `estimate_memory(compiled=True)` counts
    either choice). In a mode that replays CUDA graphs ("reduce-overhead"), each forward of
    `model` then begins a new step of the graph trees (`replays_cuda_graphs`). Returns the number
    of blocks compiled.

    Example:
        >>> qm.parallelize(model, mesh, quant="nf4", lora=qm.LoraConfig(r=16))  # doctest: +SKIP
        >>> qm.compile_blocks(model)                                             # doctest: +SKIP
        32
    """
    blocks = blocks_of(model)
    if not blocks:
        raise ValueError(
            f"{type(model).__name__} has no repeated blocks (no nn.ModuleList with children) to "
            "compile; call torch.compile(model) on the whole model instead"
        )
    from ..tp.layers import ShardedModule

    if any(isinstance(m, ShardedModule) and m.tp > 1 and m.track_rng for m in model.modules()):
        warnings.warn(
            "dropout is active in a tensor-parallel model: the bookkeeping that keeps dropout masks "
            "consistent across tp ranks runs eagerly, so each sharded layer breaks the compiled "
            "graph (results stay correct; the speed-up is smaller). Set dropout to 0 (model config "
            "and LoraConfig) for the fastest compiled steps.",
            stacklevel=2,
        )
    from ..config import compile_options
    from .recompute import COMPILE_KWARGS, install, is_checkpointed

    if "backend" not in compile_kwargs:
        rest = {k: v for k, v in compile_kwargs.items() if k != "mode"}
        compile_kwargs = {**rest, **compile_options(compile_kwargs.get("mode"))}
    for _, block in blocks:
        block.__dict__[COMPILE_KWARGS] = {
            **compile_kwargs,
            RECOMPUTE_ELEMENTWISE: bool(recompute_elementwise),
        }
        if is_checkpointed(block):  # compile inside the checkpoint, which stays eager
            install(block)
        else:
            compile_module(block, block.__dict__[COMPILE_KWARGS])
    replays = replays_cuda_graphs(model)
    if replays and STEP_MARK not in model.__dict__:
        model.__dict__[STEP_MARK] = model.register_forward_pre_hook(_new_graph_step)
    elif not replays and STEP_MARK in model.__dict__:  # compiled again without graphs
        model.__dict__.pop(STEP_MARK).remove()
    return len(blocks)


STEP_MARK = "_quantmesh_graph_step_mark"
"""A model whose blocks replay CUDA graphs: the handle of its forward pre-hook that begins a new
step of the graph trees (`_new_graph_step`), removed when `compile_blocks` compiles them again
without graphs."""


def _new_graph_step(module: nn.Module, args: Any) -> None:
    """Every forward of a model whose blocks replay CUDA graphs is a new step of the graph trees:
    nothing of the previous forward's outputs is read again (its backward has run, or it was an
    evaluation), so the trees may reuse their pool. Without the mark, a forward under no_grad (an
    evaluation) or a second micro-batch's can replay over outputs the trees still count as live,
    and torch raises that an output was overwritten. A forward traced whole (a decode step
    compiled by `fast_decode`) marks nothing: the mark is for the blocks' own graphs."""
    if not torch.compiler.is_compiling():
        torch.compiler.cudagraph_mark_step_begin()


def replays_cuda_graphs(model: nn.Module) -> bool:
    """Whether `compile_blocks` compiled any block of `model` to be replayed from CUDA graphs
    (inductor in mode "reduce-overhead" or "max-autotune", or with the option
    "triton.cudagraphs"). Their graph trees hand out results, gradients included, in a memory
    pool that a later replay reuses; `train_step` keeps gradients in memory of their own then.

    Example:
        >>> qm.compile_blocks(model, mode="reduce-overhead")  # doctest: +SKIP
        >>> replays_cuda_graphs(model)                         # doctest: +SKIP
        True
    """
    from .recompute import COMPILE_KWARGS

    for _, block in blocks_of(model):
        kw = block.__dict__.get(COMPILE_KWARGS) or {}
        if kw.get("backend") != "inductor":
            continue
        options = kw.get("options") or {}  # torch.compile takes a mode or options, not both
        if kw.get("mode"):
            from torch._inductor import list_mode_options

            options = list_mode_options(kw["mode"])
        if options.get("triton.cudagraphs"):
            return True
    return False


def compile_fn(fn: Callable[..., Any], kwargs: dict[str, Any]) -> Callable[..., Any]:
    """`torch.compile(fn, **kwargs)` for a block's recorded keywords (`compile_blocks`): with
    `recompute_elementwise` (the default) every call lets the partitioner recompute results the
    backward holds for a matmul (AOTAutograd's `ban_recompute_materialized_backward` off while the
    call runs, which is when dynamo compiles; the partitioner reads it then, and a compiled graph's
    later calls do not read it).

    Example:
        >>> f = compile_fn(torch.sin, {"backend": "eager"})
        >>> float(f(torch.zeros(1)))
        0.0
    """
    kwargs = dict(kwargs)
    lean = kwargs.pop(RECOMPUTE_ELEMENTWISE, True)
    compiled = torch.compile(fn, **kwargs)
    if not lean:
        return compiled
    import torch._functorch.config as aot_config

    @functools.wraps(fn)
    def call(*args: Any, **kw: Any) -> Any:
        if torch.compiler.is_compiling():  # traced into an outer graph: its compile decides
            return compiled(*args, **kw)
        before = aot_config.ban_recompute_materialized_backward
        aot_config.ban_recompute_materialized_backward = False
        try:
            return compiled(*args, **kw)
        finally:
            aot_config.ban_recompute_materialized_backward = before

    return call


def compile_module(module: nn.Module, kwargs: dict[str, Any]) -> None:
    """`module.compile(**kwargs)` through `compile_fn`: the module's call compiled in place."""
    module._compiled_call_impl = compile_fn(module._call_impl, kwargs)


REGIONS_ENV = "QUANTMESH_COMPILE_REGIONS"
"""On (default) or off: whether a compiled decode step of the whole model (`fast_decode`, the
server's slot steps) compiles one block and reuses it for every block (`mark_block_regions`)."""


def mark_block_regions(model: nn.Module) -> int:
    """Mark every repeated block's forward as a nested compile region, so that a compile of the
    whole model (a decode step, fullgraph) traces and compiles one block and reuses its code for
    every block of the same structure, instead of tracing and compiling all of them: a 7B decode
    step compiles one block instead of 32. Eagerly the marked forward runs as before; blocks that
    differ (another class, other shapes or options) are traced apart, by torch's own checks, so the
    values do not change. Blocks whose forward is already replaced are left as they are, and so is
    everything when $QUANTMESH_COMPILE_REGIONS is 0. Returns the number of blocks marked now.

    Example:
        >>> mark_block_regions(model)  # doctest: +SKIP
        32
    """
    return len(_mark(model))


def regions_available() -> bool:
    """Whether `mark_block_regions` marks anything: torch has nested compile regions and
    $QUANTMESH_COMPILE_REGIONS is not 0."""
    has = getattr(torch.compiler, "nested_compile_region", None) is not None
    return has and env_switch(REGIONS_ENV, default=True)


_REGION_FORWARD: weakref.WeakKeyDictionary[type, Any] = weakref.WeakKeyDictionary()
"""A block class -> its forward marked as a region, made once: blocks marked again (every
`fast_decode` call) get the very function the step was compiled with, whatever a torch version's
guards check of it (torch 2.13's hold for a new wrapper too: no recompile either way)."""


def _mark(model: nn.Module, blocks: list[nn.Module] | None = None) -> list[nn.Module]:
    """`mark_block_regions`: the blocks marked now (of `blocks`, the model's found again when
    None)."""
    if not regions_available():
        return []
    marked = []
    for block in [b for _, b in blocks_of(model)] if blocks is None else blocks:
        if "forward" in block.__dict__:  # marked already, or replaced by someone else
            continue
        cls = type(block)
        if cls not in _REGION_FORWARD:
            _REGION_FORWARD[cls] = torch.compiler.nested_compile_region(cls.forward)
        block.forward = _REGION_FORWARD[cls].__get__(block, cls)
        marked.append(block)
    return marked


def _unmark(block: nn.Module) -> bool:
    """Undo `_mark` on one block, if ours; whether it was."""
    fn = getattr(block.__dict__.get("forward"), "__func__", None)
    if hasattr(fn, "__marked_compile_region_fn__"):  # ours: torch's region wrapper
        del block.__dict__["forward"]
        return True
    return False


def unmark_block_regions(model: nn.Module) -> int:
    """Undo `mark_block_regions`: the blocks it marked run their class's forward again, and a
    later compile traces every block (what a compiler that refuses the regions needs). Returns the
    number of blocks unmarked.

    Example:
        >>> unmark_block_regions(model)  # doctest: +SKIP
        32
    """
    return sum(_unmark(block) for _, block in blocks_of(model))


@contextlib.contextmanager
def blocks_for_decoding(model: nn.Module, regions: bool) -> Iterator[int]:
    """The blocks as a decode step's whole-model compile wants them, while the context lasts:
    with `regions`, marked as one compile region (`mark_block_regions`; yields how many), and
    with a training compile of theirs (`compile_blocks`) set aside. On leaving, both are undone,
    and a training forward runs the blocks' compiled call, without regions, again: a block's own
    compile that traced a marked forward around a KV cache's writes is refused by torch (the
    writes alias the region's inputs). Marking again installs the same function, and the step
    does not recompile (test). A checkpointed block keeps its compile inside the
    checkpoint: its forward is not the class's, so it is neither marked nor set aside.

    Example:
        >>> with blocks_for_decoding(model, regions=True) as n:  # doctest: +SKIP
        ...     logits = step(tok)
    """
    blocks = [b for _, b in blocks_of(model)]  # (walks the model: once a call)
    held = [(b, b._compiled_call_impl) for b in blocks if b._compiled_call_impl is not None]
    for block, _ in held:
        block._compiled_call_impl = None
    marked = _mark(model, blocks) if regions else []
    try:
        yield len(marked)
    finally:
        for block in marked:
            _unmark(block)
        for block, impl in held:
            block._compiled_call_impl = impl
