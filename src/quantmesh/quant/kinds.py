"""Which layers have a quantized form, and the compute dtype a quantized linear uses on a device.

Only linear-like layers are quantized: nn.Linear and transformers' Conv1D (GPT-2), whose weight is
stored transposed as (in, out); the caller transposes it to (out, in) before `quantize_into`.
Nothing here imports bitsandbytes, torchao or transformers: the checks run while a plan is built.
"""

from __future__ import annotations

import torch
from torch import nn

from .base import QuantConfig, QuantError

__all__ = [
    "not_a_linear",
    "quantizable",
    "check_quantizable",
    "is_conv1d",
    "is_quantized_linear",
    "compute_dtype_for",
]

# class names of linears that already hold a quantized weight (bitsandbytes, torchao, ours)
_QUANTIZED_NAMES = frozenset(
    {"Linear4bit", "LinearNF4", "LinearFP4", "Linear8bitLt", "QuantLinear4bit", "QuantLinear8bit",
     "AoNF4Linear", "AoInt8Linear"}
)  # fmt: skip


def is_conv1d(module: nn.Module) -> bool:
    """True for transformers' Conv1D (a linear with its weight stored (in, out)).

    Recognised by name and attributes so that transformers need not be imported.

    Example:
        >>> is_conv1d(nn.Linear(4, 4))
        False
    """
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")


def is_quantized_linear(module: nn.Module) -> bool:
    """True for a linear that already holds a quantized weight (bitsandbytes, torchao, ours).

    Example:
        >>> is_quantized_linear(nn.Linear(4, 4))
        False
    """
    return any(c.__name__ in _QUANTIZED_NAMES for c in type(module).__mro__)


_FORWARDS: dict[type, str | None] = {}  # nn.Linear subclass with a forward of its own -> verdict


def not_a_linear(module: nn.Module) -> str | None:
    """Why an nn.Linear subclass with a forward of its own is not a linear layer (its forward
    returns something other than the linear's output: PhiMoE's router returns a tuple of logits,
    weights and chosen experts), else None. Decided once per class, by one forward of the module
    on a probe input (on meta where the weights are; in eval mode, the random state kept).

    Example:
        >>> not_a_linear(nn.Linear(4, 2)) is None
        True
    """
    cls = type(module)
    if not isinstance(module, nn.Linear) or cls.forward is nn.Linear.forward:
        return None
    if is_quantized_linear(module):
        return None
    if cls in _FORWARDS:
        return _FORWARDS[cls]
    w = module.weight
    x = torch.ones(2, module.in_features, dtype=w.dtype, device=w.device)
    why: str | None = None
    was = module.training
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            module.eval()
            y = module(x)
    except Exception as e:  # noqa: BLE001 - any failure means: not a plain linear
        why = f"its forward fails on a probe input ({type(e).__name__}: {str(e)[:80]})"
    else:
        if not isinstance(y, torch.Tensor):
            why = f"its forward returns a {type(y).__name__}, not the linear's output"
        elif tuple(y.shape) != (2, module.out_features):
            why = f"its forward returns shape {tuple(y.shape)} for (2, {module.in_features})"
    finally:
        module.train(was)
    if why is not None:
        why = f"{cls.__name__} is an nn.Linear whose own forward is not a linear's: {why}"
    _FORWARDS[cls] = why
    return why


def _why_not(module: nn.Module) -> str | None:
    """None when `module` can be quantized, else the reason (a sentence fragment)."""
    kind = type(module).__name__
    a_kind = ("an " if kind[:1].lower() in "aeiou" else "a ") + kind
    if is_quantized_linear(module):
        return f"is already quantized ({kind})"
    if isinstance(module, nn.modules.linear.NonDynamicallyQuantizableLinear):
        # nn.MultiheadAttention reads out_proj.weight directly, never calling out_proj(x)
        return (
            "is the output projection of an nn.MultiheadAttention, which reads its weight "
            "directly instead of calling it"
        )
    if isinstance(module, nn.modules.lazy.LazyModuleMixin) and module.has_uninitialized_params():
        return f"is {a_kind} whose shape is not known yet; run one forward to materialize it"
    if (why := not_a_linear(module)) is not None:
        return f"is not a linear layer ({why})"
    if isinstance(module, nn.Linear) or is_conv1d(module):
        return None
    return f"is {a_kind}"


def quantizable(module: nn.Module) -> bool:
    """True when `module` is a float linear-like layer that a QuantFormat can quantize.

    Example:
        >>> quantizable(nn.Linear(8, 8)), quantizable(nn.Conv2d(3, 8, 3))
        (True, False)
    """
    return _why_not(module) is None


def check_quantizable(fqn: str, module: nn.Module, backend: str = "bitsandbytes") -> None:
    """Raise QuantError, naming the fix, when the layer at `fqn` has no quantized form.

    Example:
        >>> check_quantizable("model.conv1", nn.Conv2d(3, 8, 3))
        Traceback (most recent call last):
        ...
        quantmesh.quant.base.QuantError: model.conv1 is a Conv2d; bitsandbytes quantizes only \
linear layers (nn.Linear, transformers' Conv1D); add it to QuantConfig(skip=["model.conv1"])
    """
    why = _why_not(module)
    if why is None:
        return
    raise QuantError(
        f"{fqn} {why}; {backend} quantizes only linear layers (nn.Linear, transformers' Conv1D); "
        f'add it to QuantConfig(skip=["{fqn}"])'
    )


def compute_dtype_for(config: QuantConfig, device: torch.device | str) -> torch.dtype:
    """The matmul dtype of a quantized linear on `device`: config's, else bf16 on CUDA, fp32 else.

    fp32 on CPU because CPU bf16 matmuls are slow without AMX and lose precision for no gain here.

    Example:
        >>> compute_dtype_for(QuantConfig(), "cpu")
        torch.float32
    """
    if config.compute_dtype is not None:
        return config.compute_dtype
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
