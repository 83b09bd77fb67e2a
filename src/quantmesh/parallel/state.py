"""The parallel state of a parallelized model: one typed object, attached once, read through one
accessor.

`qm.parallelize` builds a `ParallelState` and attaches it to the model; every later step (loading,
saving, training, decoding) reads it with `parallel_state(model)`, which raises on a model that was
never parallelized instead of silently using defaults. Functions that also accept a plain model ask
`parallel_state(model, required=False)` and handle None explicitly.

Example:
    >>> st = parallel_state(model)   # doctest: +SKIP
    >>> st.mesh.tp, st.quant         # doctest: +SKIP
    (2, QuantConfig(format='nf4', ...))
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, overload

from ..errors import QuantmeshError

if TYPE_CHECKING:
    from torch import nn

    from ..lora.adapter import LoraConfig
    from ..pipeline.schedule import PipelineRuntime
    from ..plan.plan import Resolved
    from ..quant.base import QuantConfig
    from ..tp.rng import RngRegions
    from .mesh import Mesh
    from .verify import VerifyReport

__all__ = ["FsdpConfig", "ParallelState", "NotParallelizedError", "parallel_state", "attach_state"]

_ATTR = "_quantmesh_state"


class NotParallelizedError(QuantmeshError, RuntimeError):
    """A function that needs a parallelized model got one that `qm.parallelize` never saw."""


@dataclass(frozen=True)
class FsdpConfig:
    """How the model was sharded over dp (recorded in ParallelState.sharded).

    blocks: FQNs of the repeated blocks, one FSDP group each (the root holds the rest).
    offload: the frozen base of each block lives in host memory (CPUOffloadPolicy).
    reshard_after_forward: free each gathered block after its forward (gather again in backward).
    """

    blocks: tuple[str, ...]
    offload: bool = False
    reshard_after_forward: bool = True


@dataclass
class ParallelState:
    """Everything `qm.parallelize` decided about a model.

    mesh: the process groups and device of this rank.
    plan: the resolved plan (one Entry per sharded module, with its split).
    lora, quant: the adapter and quantization configs (None when off).
    tied: groups of tensor names that share one tensor (a checkpoint may hold one of each group).
    uninitialized: tensor names that hold no values yet (built on meta; load_checkpoint fills them).
    rng: the dropout RNG regions of this model's tp layers.
    dp: True once the trainable gradients are synced over mesh.dp (apply_dp or apply_fsdp).
    fsdp, offload_base: FSDP2 over dp was asked for (parallelize(fsdp=True, offload_base=...)).
    sharded: what apply_fsdp did (None until it ran: a model built on meta is sharded by
        load_checkpoint once every tensor holds its values).
    verify: what verify_plan found (None when not run: tp=1 or verify=False).
    pipeline: this rank's pipeline stage and schedules (None at pp = 1).
    """

    mesh: Mesh
    plan: Resolved
    lora: LoraConfig | None
    quant: QuantConfig | None
    rng: RngRegions
    tied: list[list[str]] = field(default_factory=list)
    uninitialized: set[str] = field(default_factory=set)
    dp: bool = False
    verify: VerifyReport | None = None
    pipeline: PipelineRuntime | None = None
    fsdp: bool = False
    offload_base: bool = False
    sharded: FsdpConfig | None = None


def attach_state(model: nn.Module, state: ParallelState) -> None:
    """Attach `state` to `model` (once, by qm.parallelize)."""
    model.__dict__[_ATTR] = state  # a plain attribute: not a submodule, not in state_dict


@overload
def parallel_state(model: nn.Module, *, required: Literal[True] = ...) -> ParallelState: ...
@overload
def parallel_state(model: nn.Module, *, required: bool) -> ParallelState | None: ...
def parallel_state(model: nn.Module, *, required: bool = True) -> ParallelState | None:
    """The ParallelState of `model`; raises NotParallelizedError when there is none and `required`.

    Example:
        >>> parallel_state(torch.nn.Linear(2, 2), required=False) is None  # doctest: +SKIP
        True
    """
    st = model.__dict__.get(_ATTR)
    if st is None and required:
        raise NotParallelizedError(
            f"{type(model).__name__} is not parallelized: call qm.parallelize(model, mesh, ...) "
            "first (on a wrapped model, pass the object parallelize returned)"
        )
    return st
