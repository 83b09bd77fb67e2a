"""checkpoint_blocks: activation checkpointing of every repeated block (recompute in backward).

A block under checkpointing keeps only its inputs for backward; its inner activations are
recomputed when backward reaches it. Memory for activations falls from every layer's intermediates
to one block input per layer (plus one block's intermediates at a time), for about one extra block
forward per step.

It composes with the rest because it is torch's own non-reentrant `torch.utils.checkpoint`:
- tp: the recompute replays the random state (torch saves it at the block's forward), and the tp
  RNG regions derive their per-rank streams from that state, so dropout masks are the same again;
  the copy shares and RNG regions are per forward and are rebuilt by the recompute.
- dp (DDP), nf4/int8 bases, LoRA: nothing special (gradients come out of the same backward).
- the KV cache: a block that writes it would write it again in the recompute, so a checkpointed
  training forward runs without it (`_without_cache`, with a warning; a cache already holding
  tokens is refused), as transformers' own checkpointing does.
- compile_blocks: either order. The block's own forward is compiled *inside* the checkpoint, which
  stays eager (as does the offload) around the compiled graph. (Compiled around the checkpoint,
  the graph saved far more than the inputs, and the offload broke the graph;
  docs/benchmarks.md, "Figures the code relies on".) With `tile_tokens`,
  the tiles run outside the block's graph (`_run_tiles`, a graph break), each tile compiled on
  its own: traced into the block's graph they were scheduled together and kept more than a tile.
  With dropout at tp > 1 a checkpointed block is not compiled (warned): the RNG regions break
  its graph into pieces, and the recompute could run another piece than the forward did.
- `tile_tokens=N`: the block's position-wise parts (a child with weights and one input, whose
  output for a token depends on that token alone, such as the MLP) run N tokens at a time, each
  tile checkpointed again: at long sequences the MLP's (tokens x intermediate) tensors, saved and
  in its backward, were most of a block's memory. Position-wise is proven, not assumed: on the
  first training call each candidate runs on an 8-token prefix of the block's input whole and in
  two halves; a child whose halves differ, that draws random numbers (dropout: tiles would draw
  other masks than the whole), or that cannot take the input is kept whole, with a warning. The cost is one more forward of the tiled parts per step.
- `blocks=N`: only N blocks are checkpointed, the others keep their activations (the memory
  between none and all, for less recompute: the fewest that fit is the fastest run, and
  `quantmesh finetune` proposes it when the whole run does not fit). They are spread over all but
  the last block, whose recompute would lower no peak (`spread`).
- `offload=True`: the saved block inputs go to (pinned, on CUDA) host memory through
  `torch.autograd.graph.save_on_cpu` and come back when backward needs them. torch copies them back
  synchronously when the block's backward starts; there is no prefetch ahead of need yet.

Example:
    >>> qm.parallelize(model, mesh, quant="nf4", lora=qm.LoraConfig(r=16))  # doctest: +SKIP
    >>> qm.checkpoint_blocks(model)                                          # doctest: +SKIP
    32
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..plan.auto import blocks_of
from .compile import compile_fn, compile_module

__all__ = ["checkpoint_blocks"]

_MARK = "_quantmesh_checkpointed"  # block.__dict__: the block's own forward
_OFFLOAD = "_quantmesh_offload"
COMPILE_KWARGS = "_quantmesh_compile_kwargs"  # set by compile_blocks
_TILE = "_quantmesh_tile_tokens"  # block.__dict__: tokens per tile of its position-wise children
_TILED = "_quantmesh_tiled"  # block.__dict__: names of the children proven position-wise
PROBE_TOKENS = 8
# The names transformers' layers give the KV cache (by version and family).
CACHE_KWARGS = ("past_key_values", "past_key_value", "cache", "layer_past")


def checkpoint_blocks(
    model: nn.Module,
    *,
    offload: bool = False,
    tile_tokens: int | None = None,
    blocks: int | None = None,
) -> int:
    """Recompute the repeated blocks of `model` in backward instead of keeping their activations.

    The blocks are the ones `compile_blocks` and the planner find (the elements of the largest
    ModuleLists). Only training forwards with gradients enabled are checkpointed; evaluation and
    generation run the block as it is. With `compile_blocks` (before or after), the block's own
    forward is compiled inside the checkpoint: the checkpoint and the offload stay eager around
    the compiled graph. `tile_tokens`: run the blocks' position-wise parts (the MLP) that many
    tokens at a time, for long sequences (module docstring). `blocks`: checkpoint only that many
    of them, spread evenly over all but the last (`spread`); the others keep their activations
    and skip the recompute: each block left out holds one block's activations for the step and
    saves about a third of its share of the step time (a frozen base's backward costs about one
    forward, the recompute another). `None`: all. Calling it again sets
    `offload`, `tile_tokens` and `blocks` anew (a block left out runs as before the first call,
    compiled if `compile_blocks` asked). Returns the number of blocks checkpointed.

    Example:
        >>> qm.checkpoint_blocks(model, offload=True)  # doctest: +SKIP
        32
        >>> qm.checkpoint_blocks(model, blocks=12)  # the other 20 keep their activations  # doctest: +SKIP
        12
        >>> qm.checkpoint_blocks(model, tile_tokens=8192)  # 64k+ tokens  # doctest: +SKIP
        32
    """
    if tile_tokens is not None and tile_tokens < 1:
        raise ValueError(f"tile_tokens={tile_tokens}; expected >= 1 (or None: no tiling)")
    found = blocks_of(model)
    if not found:
        raise ValueError(
            f"{type(model).__name__} has no repeated blocks (no nn.ModuleList with children) to "
            "checkpoint; wrap the parts you want recomputed in torch.utils.checkpoint yourself"
        )
    if blocks is not None and not 1 <= blocks <= len(found):
        raise ValueError(
            f"checkpoint_blocks(blocks={blocks}): {type(model).__name__} has {len(found)} "
            f"blocks; pass 1 to {len(found)} (or None: all of them)"
        )
    chosen = spread(len(found), len(found) if blocks is None else blocks)
    for i, (_, block) in enumerate(found):
        if i not in chosen:
            _uncheckpoint(block)
            continue
        block.__dict__.setdefault(_MARK, block.forward)
        block.__dict__[_OFFLOAD] = offload
        block.__dict__[_TILE] = tile_tokens
        for name in block.__dict__.get(_TILED, []):  # tiled by an earlier call: the new size
            child = block.get_submodule(name)
            if tile_tokens is None:
                child.__class__ = _untiled_class(type(child))
            else:
                child.__dict__[_TILE_OF] = (tile_tokens, child.__dict__[_TILE_OF][1])
        if tile_tokens is None:
            block.__dict__.pop(_TILED, None)
        install(block)
    return len(chosen)


def spread(n: int, k: int) -> set[int]:
    """Which `k` of `n` blocks to checkpoint: all for k = n, else k spread evenly over all but
    the last. The last block's backward comes first, right after the forward: recomputed, its
    activations would be back at the very moment they would have been kept, so checkpointing it
    lowers no peak (only the loss's, by one block input against one block's activations).

    Example:
        >>> sorted(spread(8, 3)), sorted(spread(8, 8))
        ([2, 4, 6], [0, 1, 2, 3, 4, 5, 6, 7])
    """
    if k >= n:
        return set(range(n))
    return {i for i in range(n - 1) if k * (i + 1) // (n - 1) > k * i // (n - 1)}


def _uncheckpoint(block: nn.Module) -> None:
    """Undo checkpoint_blocks on `block`: its own forward back, its tiled children whole again,
    and compiled as compile_blocks asked (the compile had moved inside the checkpoint)."""
    if _MARK not in block.__dict__:
        return
    own = block.__dict__.pop(_MARK)
    if getattr(own, "__self__", None) is block and getattr(own, "__func__", None) is getattr(
        type(block).forward, "__func__", type(block).forward
    ):
        block.__dict__.pop("forward", None)  # the class's forward, as before
    else:
        block.forward = own
    for name in block.__dict__.pop(_TILED, []):
        child = block.get_submodule(name)
        child.__class__ = _untiled_class(type(child))
    for key in (_OFFLOAD, _TILE):
        block.__dict__.pop(key, None)
    kwargs = block.__dict__.get(COMPILE_KWARGS)
    if kwargs is not None:
        compile_module(block, kwargs)


def install(block: nn.Module) -> None:
    """(Re)build a checkpointed block's forward from what is recorded on it: its own forward,
    compiled when compile_blocks asked for it (then not around the checkpoint), and the offload."""
    inner = block.__dict__[_MARK]
    kwargs = block.__dict__.get(COMPILE_KWARGS)
    if kwargs is not None and _tp_dropout(block):  # _compile_kwargs says None: warn once here
        # The tp RNG regions break the compiled graph into pieces, and the recompute in backward
        # can then run another piece's graph than the forward did (torch raises CheckpointError:
        # other saved tensors). Not provably the same computation: the block runs eagerly.
        warnings.warn(
            "quantmesh: a checkpointed block with dropout at tp > 1 runs eagerly, not compiled: "
            "the dropout bookkeeping breaks its compiled graph, and the recompute in backward "
            "could run another piece of it. Set dropout to 0 (model config and LoraConfig) to "
            "compile checkpointed blocks.",
            stacklevel=3,
        )
        block._compiled_call_impl = None
        kwargs = None
    if kwargs is not None:
        block._compiled_call_impl = None  # a compile around the checkpoint moves inside it
        if block.__dict__.get(_TILE) is not None:
            # the tiles run outside the block's graph (_run_tiles): a break by design
            kwargs = {**kwargs, "fullgraph": False}
        inner = compile_fn(inner, kwargs)
        for name in block.__dict__.get(_TILED, ()):  # children tiled before compile_blocks
            block.get_submodule(name).__dict__[_TILE_COMPILE] = _compile_kwargs(block)
    offload = block.__dict__.get(_OFFLOAD, False)
    block.forward = functools.partial(_checkpointed, block, inner, offload)


def _compile_kwargs(block: nn.Module) -> dict[str, Any] | None:
    """The torch.compile keywords of a checkpointed block's code (its own forward, its tiles), or
    None when it runs eagerly: not compiled, or dropout at tp > 1 (see install)."""
    kwargs = block.__dict__.get(COMPILE_KWARGS)
    return None if kwargs is None or _tp_dropout(block) else kwargs


def _tp_dropout(block: nn.Module) -> bool:
    """Whether `block` holds sharded layers at tp > 1 that keep dropout masks aligned (RNG
    regions: eager bookkeeping that breaks a compiled graph)."""
    from ..tp.layers import ShardedModule

    return any(isinstance(m, ShardedModule) and m.tp > 1 and m.track_rng for m in block.modules())


def is_checkpointed(block: nn.Module) -> bool:
    """Whether checkpoint_blocks wrapped `block`."""
    return _MARK in block.__dict__


def _checkpointed(
    block: nn.Module, inner: Callable[..., Any], offload: bool, *args: Any, **kwargs: Any
) -> Any:
    if not (block.training and torch.is_grad_enabled()):
        return inner(*args, **kwargs)
    kwargs = _without_cache(kwargs)
    tile = block.__dict__.get(_TILE)
    if tile is not None and _TILED not in block.__dict__:
        x = args[0] if args else next(iter(kwargs.values()), None)
        if isinstance(x, torch.Tensor) and x.dim() == 3 and x.shape[1] >= PROBE_TOKENS:
            _tile_positionwise(block, x[:1, :PROBE_TOKENS].detach(), tile)
    ctx: contextlib.AbstractContextManager[Any] = (
        torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())
        if offload
        else contextlib.nullcontext()
    )
    with ctx:
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)


def _without_cache(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A checkpointed training forward's keyword arguments without the KV cache.

    A block that writes the cache would write it again when backward replays it (the recompute
    would then read its own first keys back, and a compiled block recompiles for the filled cache:
    other saved tensors than the backward expects). A training forward needs no cache, so it runs
    without one, as transformers' own gradient checkpointing does; a cache that already holds
    tokens is refused instead, since dropping it would change the output.
    """
    out = dict(kwargs)
    for name in CACHE_KWARGS:
        cache = out.get(name)
        if cache is None:
            continue
        held = cache.get_seq_length() if hasattr(cache, "get_seq_length") else None
        if held != 0:
            raise ValueError(
                f"checkpoint_blocks: a training forward got a KV cache ({name}) that "
                + (f"already holds {held} tokens" if held else "is not empty")
                + "; a checkpointed block is run again in backward and would not see the same "
                "cache. Train without one: model(..., use_cache=False)"
            )
        out[name] = None
        warnings.warn(
            "checkpoint_blocks: checkpointed training forwards do not fill the KV cache (the "
            "recompute in backward would fill it twice); pass use_cache=False when training",
            stacklevel=3,
        )
    if out.get("use_cache"):
        out["use_cache"] = False
    return out


def _candidates(block: nn.Module) -> list[tuple[str, nn.Module]]:
    """Direct children with matrix weights whose forward takes exactly one input."""
    out = []
    for name, child in block.named_children():
        if not any(p.dim() >= 2 for p in child.parameters()):
            continue
        kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        params = inspect.signature(child.forward).parameters.values()
        if sum(p.kind in kinds for p in params) == 1:
            out.append((name, child))
    return out


def _close(whole: torch.Tensor, parts: torch.Tensor) -> bool:
    """Equal up to rounding, as a whole: fewer rows can take other matmul kernels, which round
    differently (bf16: ~1e-2 of the norm; elementwise bounds fail near zero), while a token-mixing
    child differs by the order of the output itself."""
    tol = 1e-4 if whole.dtype == torch.float32 else 3e-2
    err = (whole.float() - parts.float()).norm() / whole.float().norm().clamp_min(1e-12)
    return bool(err <= tol)


def _rng_states(device: torch.device) -> list[torch.Tensor]:
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


def _set_rng_states(device: torch.device, states: list[torch.Tensor]) -> None:
    torch.set_rng_state(states[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(states[1], device)


def _tile_positionwise(block: nn.Module, x: torch.Tensor, tile: int) -> None:
    """Prove which candidates are position-wise on `x` (1, PROBE_TOKENS, h) and tile those.

    Position-wise: the two halves' outputs are the whole's. Random-neutral: the random state after
    the tiled run (the first tile as it is, the others from a forked state, as `_tiled` runs them)
    is the one after the whole run. Dropout draws per element, so a child with dropout fails it;
    the tp RNG regions' one draw per entry passes (every tile enters once, the first one counts).
    """
    tiled = []
    half = PROBE_TOKENS // 2
    devices = [x.device.index or 0] if x.device.type == "cuda" else []
    for name, child in _candidates(block):
        forward = functools.partial(_untiled_class(type(child)).forward, child)
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=devices):
                start = _rng_states(x.device)
                whole = forward(x)
                after_whole = _rng_states(x.device)
                _set_rng_states(x.device, start)
                first = forward(x[:, :half])
                after_tiles = _rng_states(x.device)
                with torch.random.fork_rng(devices=devices):
                    parts = torch.cat([first, forward(x[:, half:])], dim=1)
            draws = not all(
                torch.equal(a, b) for a, b in zip(after_whole, after_tiles, strict=True)
            )
            moves = not all(torch.equal(a, b) for a, b in zip(start, after_whole, strict=True))
            same = (
                not draws
                and isinstance(whole, torch.Tensor)
                and whole.shape == parts.shape
                and _close(whole, parts)
            )
        except Exception as e:  # noqa: BLE001 - a child that cannot take the block's input
            same, why = False, f"{type(e).__name__}: {e}"
        else:
            why = (
                "it draws random numbers per element in training (dropout), and tiles would "
                "draw other masks"
                if draws
                else "its output for a token depends on other tokens"
            )
        if not same:
            warnings.warn(
                f"quantmesh: checkpoint_blocks(tile_tokens=...) keeps "
                f"{type(block).__name__}.{name} ({type(child).__name__}) whole: {why}",
                stacklevel=3,
            )
            continue
        child.__dict__[_TILE_OF] = (tile, moves)
        child.__dict__[_TILE_COMPILE] = _compile_kwargs(block)
        child.__class__ = _tiled_class(type(child))
        tiled.append(name)
    block.__dict__[_TILED] = tiled


_TILE_OF = "_quantmesh_tile_of"  # child.__dict__: (tokens per tile, whether a call moves the RNG)
_TILE_COMPILE = "_quantmesh_tile_compile"  # child.__dict__: its block's compile kwargs, or None
_TILED_CLASSES: dict[type[nn.Module], type[nn.Module]] = {}
_COMPILED_TILES: dict[tuple[type[nn.Module], str], Callable[..., Any]] = {}


def _tiled_class(cls: type[nn.Module]) -> type[nn.Module]:
    """`cls` with a forward that runs the original over token tiles (one subclass per class, the
    same name: a class swap, so dynamo traces the tiles inside a compiled block and no module or
    parameter name changes)."""
    if getattr(cls, "_quantmesh_untiled_class", None) is not None:
        return cls
    made = _TILED_CLASSES.get(cls)
    if made is None:

        def forward(self: nn.Module, x: torch.Tensor) -> Any:
            tile, moves = self.__dict__[_TILE_OF]
            if (
                x.dim() != 3
                or x.shape[1] <= tile
                or not (self.training and torch.is_grad_enabled())
            ):
                return cls.forward(self, x)  # one tile or none: as it is (traced when compiled)
            return _run_tiles(self, cls, tile, moves, x)

        made = type(
            cls.__name__,
            (cls,),
            {
                "forward": forward,
                "_quantmesh_untiled_class": cls,
                "__module__": cls.__module__,
                "__qualname__": cls.__qualname__,
            },
        )
        _TILED_CLASSES[cls] = made
    return made


@torch._dynamo.disable  # type: ignore[untyped-decorator]
def _run_tiles(
    child: nn.Module, cls: type[nn.Module], tile: int, moves: bool, x: torch.Tensor
) -> Any:
    """The tiles of one call, outside any compiled block graph: traced into the block's graph, the
    tiles' recomputes and backwards were scheduled together and kept more than a tile. When the
    block is compiled, each tile runs `cls.forward` compiled on its own (one graph for every tile
    of every block of this class and shape), which peaked below eager tiled blocks
    (docs/benchmarks.md, "Figures the code relies on")."""
    kwargs = child.__dict__.get(_TILE_COMPILE)
    forward: Callable[..., Any] = cls.forward
    if kwargs is not None:
        key = (cls, repr(sorted(kwargs.items())))
        if key not in _COMPILED_TILES:
            _COMPILED_TILES[key] = compile_fn(cls.forward, kwargs)
        forward = _COMPILED_TILES[key]
    return _tiled(child, functools.partial(forward, child), tile, moves, x)


def _untiled_class(cls: type[nn.Module]) -> type[nn.Module]:
    base: type[nn.Module] | None = getattr(cls, "_quantmesh_untiled_class", None)
    return base if base is not None else cls


def _tiled(
    child: nn.Module, forward: Callable[..., Any], tile: int, moves: bool, x: torch.Tensor
) -> Any:
    """`forward` over `tile` tokens at a time (dim 1), each tile checkpointed. When a call moves
    the random state (the tp RNG regions' one draw), the tiles after the first run from a forked
    state, so it moves on as after one whole call (a graph break under compile, so only then)."""
    if x.dim() != 3 or x.shape[1] <= tile or not (child.training and torch.is_grad_enabled()):
        return forward(x)
    outs = [checkpoint(forward, x[:, :tile], use_reentrant=False)]
    devices = [x.device.index or 0] if x.device.type == "cuda" else []
    fork = torch.random.fork_rng(devices=devices) if moves else contextlib.nullcontext()
    with fork:
        for s in range(tile, x.shape[1], tile):
            outs.append(checkpoint(forward, x[:, s : s + tile], use_reentrant=False))
    return torch.cat(outs, dim=1)
