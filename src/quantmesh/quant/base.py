"""The quantization contract: a format quantizes one local shard of a linear weight on its device.

TP code never names a format. A parallel layer asks its format for an empty local module, then hands
it this rank's float shard (already sliced, already on the target device) to quantize in place.
"""

from __future__ import annotations

import abc
import dataclasses
import fnmatch
import re
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["QuantConfig", "QuantFormat", "QuantError", "get_format", "resolve_quant"]

from ..config import QuantError, check_quant
from .names import FORMATS


@dataclass(kw_only=True)
class QuantConfig:
    """How to quantize the frozen base of a model.

    Example:
        >>> QuantConfig(format="nf4", skip=["lm_head", "*.mlp.down_proj"])
        QuantConfig(format='nf4', ...)
    """

    format: str = "nf4"
    """"nf4" or "fp4" (4-bit, bitsandbytes Linear4bit) or "int8" (LLM.int8, Linear8bitLt)."""
    backend: str = "bitsandbytes"
    """"bitsandbytes" (default) or "torchao" (nf4 via NF4Tensor, int8 weight-only)."""
    double_quant: bool = True
    """4-bit only: quantize the per-block absmax statistics too (saves ~0.37 bit/param)."""
    compute_dtype: torch.dtype | None = None
    """dtype of the matmul; None = bfloat16 on CUDA, float32 on CPU."""
    blocksize: int = 64
    """4-bit only: elements per quantization block of the flattened (out, in) weight."""
    int8_threshold: float = 6.0
    """int8 only: LLM.int8 outlier threshold (0 disables the mixed-precision decomposition)."""
    skip: list[str] = field(default_factory=lambda: ["lm_head"])
    """Module FQNs or globs to keep unquantized; a bare name matches any module of that name."""
    targets: list[str] | None = None
    """Modules to quantize (FQNs, globs or bare names); None = every linear layer not skipped. A
    target that is not a linear layer is an error (only linears have quantized forms)."""

    kept_float: list[str] = field(default_factory=list, repr=False)
    """Patterns of modules the model itself keeps in float (transformers'
    `_keep_in_fp32_modules`), set by `for_model`: skipped as transformers' bitsandbytes
    integration skips them (`keeps_float`), unless `targets` names modules explicitly."""

    def __post_init__(self) -> None:
        check_quant(self.format, self.backend)
        if self.blocksize not in (32, 64, 128, 256, 512, 1024, 2048, 4096):
            raise QuantError(f"blocksize={self.blocksize}; use a power of two from 32 to 4096")
        self.skip = list(self.skip)
        if self.targets is not None:
            self.targets = [self.targets] if isinstance(self.targets, str) else list(self.targets)

    def selects(self, fqn: str) -> bool:
        """True when `fqn` is named by `targets` (always True when targets is None)."""
        if self.targets is None:
            return True
        last = fqn.rsplit(".", 1)[-1]
        return any(fnmatch.fnmatchcase(fqn, p) or p == last for p in self.targets)

    def skips(self, fqn: str) -> bool:
        """True when `fqn` matches one of `skip` (glob on the FQN, or a bare module name), or,
        with no `targets`, one of `kept_float` (the model's own float modules)."""
        return self.skip_names(fqn) or self.model_keeps_float(fqn)

    def skip_names(self, fqn: str) -> bool:
        """True when `fqn` matches one of `skip` (the skips asked for, not the model's own)."""
        last = fqn.rsplit(".", 1)[-1]
        return any(fnmatch.fnmatchcase(fqn, p) or p == last for p in self.skip)

    def model_keeps_float(self, fqn: str) -> bool:
        """True when `fqn` is one of the model's own float modules (`kept_float`) and no
        `targets` are given (named targets are quantized as named)."""
        return self.targets is None and keeps_float(fqn, self.kept_float)

    def for_model(self, model: nn.Module) -> QuantConfig:
        """This config with `kept_float` set to the modules `model` keeps in float32
        (transformers' `_keep_in_fp32_modules`: T5's `wo`, DeepSeek-V3.2's
        `indexer.weights_proj`), which transformers' bitsandbytes integration leaves
        unquantized; quantmesh leaves them so too, so that its nf4 model is transformers'.

        Example:
            >>> class M(nn.Module):
            ...     _keep_in_fp32_modules = ["indexer.weights_proj"]
            >>> QuantConfig().for_model(M()).skips("model.layers.0.attn.indexer.weights_proj")
            True
        """
        keep = getattr(model, "_keep_in_fp32_modules", None) or ()
        return dataclasses.replace(self, kept_float=sorted(str(k) for k in keep))


def keeps_float(fqn: str, patterns: list[str]) -> bool:
    """Whether `fqn` matches one of `patterns` as transformers matches the modules its quantizers
    leave alone: from the start up to a module boundary, as a regex with that boundary, or as a
    suffix.

    Example:
        >>> keeps_float("encoder.block.0.layer.1.DenseReluDense.wo", ["wo"])
        True
        >>> keeps_float("model.layers.0.mlp.gate_proj", ["mlp.gate"])
        False
    """
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    return any(re.match(rf"(?:{p}){boundary}", fqn) or fqn.endswith(p) for p in patterns)


def resolve_quant(quant: str | QuantConfig | None) -> QuantConfig | None:
    """Turn the `quant=` argument of parallelize into a QuantConfig (or None)."""
    if quant is None or isinstance(quant, QuantConfig):
        return quant
    if isinstance(quant, str):
        return QuantConfig(format=quant)
    names = ", ".join(map(repr, FORMATS))
    raise QuantError(f"quant={quant!r}; use None, {names} or qm.QuantConfig(...)")


class QuantFormat(abc.ABC):
    """One quantized format of a linear layer's weight (implemented in quant/bnb.py, quant/torchao.py)."""

    name: str

    def __init__(self, config: QuantConfig):
        self.config = config

    @abc.abstractmethod
    def new_linear(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        device: torch.device,
        dtype: torch.dtype,
    ) -> nn.Module:
        """An empty local quantized linear (in_features -> out_features); weight set later.

        `dtype` is the dtype of the bias and of activations; the bias, if any, is an ordinary float
        parameter named `bias` on the returned module.
        """

    @abc.abstractmethod
    def quantize_into(self, module: nn.Module, weight: torch.Tensor) -> None:
        """Quantize `weight` (out, in), a float tensor already on the module's device, into `module`."""

    @abc.abstractmethod
    def dequantize(self, module: nn.Module) -> torch.Tensor:
        """The module's weight as a float tensor (out, in), for export and merging."""

    def compute_weight(self, module: nn.Module) -> torch.Tensor:
        """The weight (out, in) as a float tensor to compute with, inside a forward (traced by
        torch.compile); by default `dequantize`. Used where the model's own code reads a weight
        tensor (experts), not a linear's forward."""
        return self.dequantize(module)

    def compute_units(self, module: nn.Module, units: int, index: torch.Tensor) -> torch.Tensor:
        """Rows of the weight as `compute_weight` gives them, for some of its `units` equal
        groups of rows only (the experts of an (E*a, b) expert store): (len(index) * a, b).
        By default the whole weight is computed and the groups picked; a format that can read
        the groups' codes alone overrides it (fewer bytes read and dequantized).

        Example:
            >>> fmt.compute_units(q, 8, torch.tensor([1, 5])).shape  # doctest: +SKIP
            torch.Size([2 * 96, 64])
        """
        w = self.compute_weight(module)
        return w.view(units, -1, w.shape[-1]).index_select(0, index).flatten(0, 1)

    @abc.abstractmethod
    def bytes_per_param(self, in_features: int | None = None) -> float:
        """Average bytes per weight element, statistics included (for the memory planner).

        Per-row formats amortize their per-row statistics over `in_features` (None: an upper
        bound); block formats ignore it."""

    def block_elems(self) -> int:
        """Elements per quantization block of the flattened weight (1 for per-row formats)."""
        return 1

    def cut_from(
        self,
        module: nn.Module,
        source: nn.Module,
        dim: int | None,
        ranges: tuple[tuple[int, int], ...] | None,
        device: torch.device,
    ) -> str:
        """Fill `module` with rows (dim 0) / columns (dim 1) `ranges` of `source`, a linear already
        quantized in this format, on `device`; returns how (see quant/prequant.py)."""
        raise QuantError(
            f"{type(self).__name__} cannot take weights from a module quantized already; "
            "build the model in float and pass quant= to parallelize"
        )


def get_format(config: QuantConfig) -> QuantFormat:
    """The QuantFormat for a config (imports the backend lazily)."""
    if config.backend == "torchao":
        from .torchao import torchao_format

        return torchao_format(config)
    from .bnb import bnb_format

    return bnb_format(config)
