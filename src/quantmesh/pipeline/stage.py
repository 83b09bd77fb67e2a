"""One pipeline stage of a model: the module a `torch.distributed.pipelining.PipelineStage` runs.

`StageModule(model, cut, stage)` runs the model's own root forward on the micro-batch's input ids,
so everything the model computes from its inputs for the blocks (positions, masks, rotary
embeddings) is computed as the model computes it. Other stages' modules are `StandIn`s (cut.py).
Two hooks make the forward a stage's:

- a forward pre-hook on the stage's first block swaps its hidden-state input (the first positional
  argument, or `hidden_states=`) for the activation received from the previous stage;
- a forward hook on the stage's last block (every stage but the last) ends the forward there and
  hands its hidden-state output (the tensor, or the first element of a tuple) to the next stage.

(The schedule also runs each stage once on uninitialized inputs to learn its shapes; that is why
the NaN check of the stand-ins is made on the first step's loss, in step.py, not here.)

The last stage returns the model's logits (`.logits`, a tensor, or the first element of a tuple).

Example:
    >>> runner = StageModule(model, cut, stage=1)          # doctest: +SKIP
    >>> h = runner(h0, input_ids=ids)                      # doctest: +SKIP  (B, T, D) activation
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .cut import PipelineError, StageCut, StandIn, active, current

__all__ = ["StageModule", "call_model", "logits_of"]


class _StageEnd(Exception):
    """Raised by the last block's hook of a non-last stage: carries the stage's output."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__("pipeline stage end")
        self.hidden = hidden


def _is_transformers(model: nn.Module) -> bool:
    return any(c.__module__.startswith("transformers.") for c in type(model).__mro__)


def call_model(model: nn.Module, input_ids: torch.Tensor) -> Any:
    """The model's forward on token ids: transformers models by keyword (no KV cache), any other
    model positionally.

    Example:
        >>> logits_of(call_model(model, ids)).shape   # doctest: +SKIP
        torch.Size([2, 16, 100])
    """
    if _is_transformers(model):
        return model(input_ids=input_ids, use_cache=False)
    return model(input_ids)


def logits_of(out: Any) -> torch.Tensor:
    """The logits in a model's output: `.logits`, the tensor itself, or a tuple's first element."""
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise PipelineError(
        f"the model returned a {type(out).__name__}; train_step needs logits: a tensor, an "
        f"output with .logits, or a tuple whose first element is the logits"
    )


def _hidden_of(fqn: str, out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise PipelineError(
        f"block {fqn} returned a {type(out).__name__}; a pipeline stage boundary needs a block "
        f"that returns its hidden states (a tensor, or a tuple whose first element is it)"
    )


class StageModule(nn.Module):
    """The part of `model` that pipeline stage `stage` runs; its parameters are this stage's."""

    def __init__(
        self,
        model: nn.Module,
        cut: StageCut,
        stage: int,
        swaps: dict[str, StandIn] | None = None,
    ) -> None:
        super().__init__()
        self.model = model  # a child: parameters() are this rank's (the rest are StandIns)
        self.stage, self.pp = stage, cut.pp
        # other local stages' modules (several stages per rank): stand-ins while this one runs
        self._swaps = dict(swaps or {})
        self.first_name, self.last_name = cut.blocks[stage][0], cut.blocks[stage][-1]
        self._incoming: torch.Tensor | None = None
        if stage > 0:
            model.get_submodule(self.first_name).register_forward_pre_hook(
                self._swap_input, with_kwargs=True
            )
        if stage < cut.pp - 1:
            model.get_submodule(self.last_name).register_forward_hook(self._end)

    def _swap_input(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if current() is not self:
            raise PipelineError(
                f"{self.first_name} starts pipeline stage {self.stage}; at pp > 1 run the model "
                f"through qm.train_step"
            )
        x = self._incoming
        assert x is not None  # set by forward
        if args:
            old, args = args[0], (x, *args[1:])
        elif "hidden_states" in kwargs:
            old = kwargs["hidden_states"]
            kwargs = {**kwargs, "hidden_states": x}
        else:
            raise PipelineError(
                f"block {self.first_name} takes no positional input and no hidden_states=; the "
                f"pipeline cannot tell which argument carries the activation: use pp=1"
            )
        if not isinstance(old, torch.Tensor) or old.shape != x.shape:
            got = tuple(old.shape) if isinstance(old, torch.Tensor) else type(old).__name__
            raise PipelineError(
                f"block {self.first_name}'s first input is {got} but the previous stage sent "
                f"{tuple(x.shape)}; the blocks do not pass one hidden state along: use pp=1"
            )
        return args, kwargs

    def _end(self, module: nn.Module, args: tuple, out: Any) -> None:
        if current() is self:
            raise _StageEnd(_hidden_of(self.last_name, out))

    def forward(self, *received: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Stage 0: `received` is the micro-batch's ids; later stages: the previous stage's (B, T,
        D) output. `input_ids` (B, T) reach every stage. Returns (B, T, D), or the last stage's
        logits (B, T, V)."""
        self._incoming = received[0] if self.stage > 0 else None
        real = {fqn: self._swap(fqn, s) for fqn, s in self._swaps.items()}
        try:
            with active(self):
                out = logits_of(call_model(self.model, input_ids))
        except _StageEnd as end:
            out = end.hidden
        finally:
            self._incoming = None
            for fqn, m in real.items():
                self._swap(fqn, m)
        return out

    def _swap(self, fqn: str, module: nn.Module) -> nn.Module:
        """Put `module` at `fqn`; returns what was there."""
        parent_name, _, child = fqn.rpartition(".")
        parent = self.model.get_submodule(parent_name)
        old = parent._modules[child]
        parent._modules[child] = module
        assert old is not None
        return old
