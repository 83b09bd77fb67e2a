"""torchao formats: nf4 through torchao's NF4Tensor, and int8 weight-only (one scale per row).

nf4: the weight becomes `nn.Parameter(NF4Tensor)`; F.linear on it dispatches to torchao's
LinearNF4, which dequantizes to the input's dtype and gives input gradients. NF4Tensor always
quantizes its block scales (int8 per block, one factor per `scaler_block_size` blocks), so
`double_quant=False` is refused. Shards must hold a multiple of `blocksize` elements.

int8: a small module holding an int8 (out, in) weight and an fp32 (out,) scale, quantized with
torchao's affine primitives (symmetric, per row, the scheme of torchao's Int8WeightOnlyConfig);
forward is (x @ W_int8^T) * scale + bias in the compute dtype. Plain tensors rather than torchao's
Int8Tensor subclass: they survive meta construction, state_dict and module moves in every torchao
version, and the tensor-parallel wrapper sees ordinary parameters. The LLM.int8 outlier threshold
does not apply here.

torchao is imported lazily and quietly (its import logs warnings about optional kernels); the
import paths of torchao 0.17 and 0.18 are both tried.
"""

from __future__ import annotations

import copy
import functools
import math
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from ..config import quiet_loggers
from .base import QuantConfig, QuantError, QuantFormat
from .kinds import compute_dtype_for

__all__ = ["torchao_format", "AoNF4Format", "AoInt8Format", "AoNF4Linear", "AoInt8Linear"]

SCALER_BLOCK = 256  # NF4Tensor's default number of block scales sharing one quantization factor
INT8_REF_IN = 1024  # in_features assumed by int8 bytes_per_param when none is given (upper bound)


def torchao_format(config: QuantConfig) -> QuantFormat:
    """The torchao QuantFormat for `config` ("nf4" -> NF4Tensor, "int8" -> int8 weight-only).

    Example:
        >>> fmt = torchao_format(QuantConfig(format="int8", backend="torchao"))
        >>> fmt.name, fmt.block_elems()
        ('int8', 1)
    """
    if config.format == "nf4":
        if not config.double_quant:
            raise QuantError(
                "torchao's NF4Tensor always quantizes its block scales (double quantization); "
                "use QuantConfig(double_quant=True) with backend='torchao', or "
                "backend='bitsandbytes' for fp32 block scales"
            )
        return AoNF4Format(config)
    if config.format == "int8":
        return AoInt8Format(config)
    raise QuantError(f"torchao has no format {config.format!r} here; use 'nf4' or 'int8'")


@functools.cache
def _ao() -> dict[str, Any]:
    """torchao's pieces used here, from whichever path this torchao version has."""
    with quiet_loggers("torchao", "torch.utils._pytree"):
        try:  # torchao >= 0.18
            from torchao.quantization import NF4Tensor, to_nf4
        except ImportError:  # torchao <= 0.17
            from torchao.dtypes.nf4tensor import NF4Tensor, to_nf4
        from torchao.quantization.quant_primitives import (
            MappingType,
            choose_qparams_affine,
            quantize_affine,
        )
    return {
        "NF4Tensor": NF4Tensor, "to_nf4": to_nf4, "MappingType": MappingType,
        "choose_qparams_affine": choose_qparams_affine, "quantize_affine": quantize_affine,
    }  # fmt: skip


class _AoLinear(nn.Linear):
    """A linear whose weight is set by its format's quantize_into (built on meta, no init)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, device: torch.device,
        dtype: torch.dtype, compute_dtype: torch.dtype | None,
    ):  # fmt: skip
        super().__init__(in_features, out_features, bias=bias, device="meta", dtype=dtype)
        self.weight.requires_grad_(False)
        if bias and device.type != "meta":
            self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype))
        self.compute_dtype = compute_dtype
        self.orig_dtype = dtype

    def reset_parameters(self) -> None:  # the weight comes from quantize_into
        pass

    def _ready(self) -> None:
        if self.weight.is_meta:
            raise RuntimeError(
                f"{type(self).__name__}({self.in_features} -> {self.out_features}) has no "
                "quantized weight yet; call fmt.quantize_into(module, weight) first"
            )

    def _finish(self, device: torch.device, cd: torch.dtype, orig: torch.dtype) -> None:
        self.compute_dtype, self.orig_dtype = cd, orig
        b = self.bias
        if b is not None and b.is_meta:  # made real on the shard's device; the caller loads it
            real = torch.zeros(b.shape, dtype=b.dtype, device=device)
            self.bias = nn.Parameter(real, requires_grad=b.requires_grad)


class AoNF4Linear(_AoLinear):
    """Linear with a torchao NF4Tensor weight (out, in); frozen, input gradients flow.

    Example:
        >>> fmt = torchao_format(QuantConfig(backend="torchao"))
        >>> m = fmt.new_linear(64, 32, bias=True, device="cpu", dtype=torch.float32)
        >>> fmt.quantize_into(m, torch.randn(32, 64)); m(torch.randn(2, 64)).shape
        torch.Size([2, 32])
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._ready()
        cd = self.compute_dtype or x.dtype
        y = F.linear(x.to(cd), self.weight)  # NF4Tensor -> LinearNF4: dequantize to cd, matmul
        if self.bias is not None:
            y = y + self.bias.to(cd)
        return y.to(x.dtype)

    def __deepcopy__(self, memo: dict) -> AoNF4Linear:
        # NF4Tensor.clone re-quantizes with torchao's default block sizes (and fails for others):
        # copy the inner tensors instead; everything else is copied as usual
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            new.__dict__[key] = copy.deepcopy(value, memo) if key != "_parameters" else {}
        for name, p in self._parameters.items():
            if name == "weight" and isinstance(p, _ao()["NF4Tensor"]):
                new._parameters[name] = memo[id(p)] = nn.Parameter(_clone_nf4(p), False)
            else:
                new._parameters[name] = copy.deepcopy(p, memo)
        return new


def _clone_nf4(t: torch.Tensor) -> torch.Tensor:
    sub: Any = t  # an NF4Tensor: torch's stubs do not declare the tensor-subclass protocol
    names, meta = sub.__tensor_flatten__()  # the tensor-subclass protocol, stable across versions
    inner = {n: getattr(t, n).clone() for n in names}
    result: torch.Tensor = type(sub).__tensor_unflatten__(inner, meta, t.size(), t.stride())
    return result


class AoInt8Linear(_AoLinear):
    """Linear with an int8 weight (out, in) and an fp32 per-row scale `weight_scale` (out,).

    Example:
        >>> fmt = torchao_format(QuantConfig(format="int8", backend="torchao"))
        >>> m = fmt.new_linear(64, 32, bias=False, device="cpu", dtype=torch.float32)
        >>> fmt.quantize_into(m, torch.randn(32, 64)); m.weight.dtype
        torch.int8
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        device = torch.device(kwargs["device"])
        shape = (self.out_features, self.in_features)
        self.weight = nn.Parameter(
            torch.zeros(shape, dtype=torch.int8, device=device), requires_grad=False
        )
        self.weight_scale: torch.Tensor  # (out,) fp32, registered as a buffer
        self.register_buffer("weight_scale", torch.zeros(shape[0], device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._ready()
        cd = self.compute_dtype or x.dtype
        # (..., in) @ (in, out) -> (..., out), then the per-row scale of W becomes a column scale
        y = F.linear(x.to(cd), self.weight.to(cd)) * self.weight_scale.to(cd)
        if self.bias is not None:
            y = y + self.bias.to(cd)
        return y.to(x.dtype)


class _AoFormat(QuantFormat):
    module_cls: type[_AoLinear]

    def __init__(self, config: QuantConfig):
        super().__init__(config)
        self.name = config.format

    def new_linear(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> nn.Module:
        """An empty quantized linear (weight on meta for nf4, zeros for int8) for the shard.

        Example:
            >>> fmt = torchao_format(QuantConfig(backend="torchao"))
            >>> fmt.new_linear(64, 32, bias=False, device="meta", dtype=torch.bfloat16)
            AoNF4Linear(in_features=64, out_features=32, bias=False)
        """
        self._check_shape(in_features, out_features)
        device = torch.device(device)
        cd = None if device.type == "meta" else compute_dtype_for(self.config, device)
        return self.module_cls(in_features, out_features, bias, device=device, dtype=dtype,
                               compute_dtype=cd)  # fmt: skip

    def _check_shape(self, in_features: int, out_features: int) -> None:
        pass

    def _check_shard(self, module: nn.Module, weight: torch.Tensor) -> None:
        want = (cast(nn.Linear, module).out_features, cast(nn.Linear, module).in_features)
        if tuple(weight.shape) != want or not weight.is_floating_point():
            raise ValueError(
                f"quantize_into got a {weight.dtype} weight of shape {tuple(weight.shape)}, "
                f"expected a float (out, in) = {want}; slice and transpose it first"
            )
        b = module.bias
        if b is not None and not b.is_meta and b.device != weight.device:
            raise ValueError(
                f"the weight shard is on {weight.device} but the module's bias is on {b.device}; "
                f"move the shard to {b.device} (quantization happens where the shard is)"
            )


class AoNF4Format(_AoFormat):
    """nf4 through torchao's NF4Tensor (blocks of `blocksize`, int8 block scales)."""

    module_cls = AoNF4Linear
    shards = 1
    """FSDP's dp size (set by parallelize(fsdp=True)): block-scale groups never straddle a
    dp shard, so FSDP2 splits and gathers the NF4Tensor's inner tensors as they are."""

    def fsdp_problem(self, weight: torch.Tensor) -> str | None:
        """Why `weight` (an NF4Tensor) cannot be split in `shards` dim-0 chunks exactly, or None."""
        nf4: Any = weight
        n = self.shards
        if weight.shape[0] % n:
            return f"{weight.shape[0]} rows do not split in {n} equal dp shards"
        for attr in ("quantized_data", "quantized_scalers", "quantization_factor"):
            if getattr(nf4, attr).numel() % n:
                return f"its {getattr(nf4, attr).numel()} {attr} do not split in {n}"
        return None

    def _check_shape(self, in_features: int, out_features: int) -> None:
        n, bs = in_features * out_features, self.config.blocksize
        if n % bs:
            raise QuantError(
                f"a ({out_features}, {in_features}) shard holds {n} elements, not a multiple of "
                f"blocksize {bs}, which torchao's NF4Tensor requires; use backend='bitsandbytes' "
                f"(partial blocks allowed), a smaller blocksize, or skip this layer"
            )

    @torch.no_grad()
    def quantize_into(self, module: nn.Module, weight: torch.Tensor) -> None:
        """Quantize the float shard (out, in) into an NF4Tensor on its device.

        Example:
            >>> fmt.quantize_into(m, torch.randn(32, 64))  # doctest: +SKIP
        """
        self._check_shard(module, weight)
        n_blocks = weight.numel() // self.config.blocksize
        # NF4Tensor needs n_blocks % scaler_block_size == 0: the largest such power of two <= 256
        # (dividing each FSDP shard's blocks too, when the shards divide them)
        per_shard = n_blocks // self.shards if n_blocks % self.shards == 0 else n_blocks
        sbs = math.gcd(per_shard, SCALER_BLOCK)
        w = weight.detach().contiguous()
        if w.storage_offset():  # a row slice: NF4Tensor would keep its offset, which FSDP2's
            w = w.clone()  # gathered (offset 0) tensor then could not take
        nf4 = _ao()["to_nf4"](w, self.config.blocksize, sbs)
        layer = cast(AoNF4Linear, module)  # built by new_linear
        layer.weight = nn.Parameter(nf4, requires_grad=False)
        layer._finish(weight.device, compute_dtype_for(self.config, weight.device), weight.dtype)

    def dequantize(self, module: nn.Module) -> torch.Tensor:
        """The float weight (out, in) in the shard's dtype.

        Example:
            >>> fmt.dequantize(m).shape  # doctest: +SKIP
            torch.Size([32, 64])
        """
        layer = cast(AoNF4Linear, module)  # built by new_linear
        layer._ready()
        nf4: Any = layer.weight  # an NF4Tensor (torchao, untyped)
        w: torch.Tensor = nf4.get_original_weight()
        return w

    def bytes_per_param(self, in_features: int | None = None) -> float:
        """0.5 for the codes + 1/blocksize (int8 scales) + 4 per 256 blocks (fp32 factors).

        Example:
            >>> round(torchao_format(QuantConfig(backend="torchao")).bytes_per_param(), 4)
            0.5159
        """
        bs = self.config.blocksize
        return 0.5 + 1 / bs + 4 / (bs * SCALER_BLOCK)

    def block_elems(self) -> int:
        """Elements per quantization block of the flattened (out, in) weight (= blocksize)."""
        return self.config.blocksize


class AoInt8Format(_AoFormat):
    """int8 weight-only, symmetric per output row (torchao's affine quantization primitives)."""

    module_cls = AoInt8Linear

    @torch.no_grad()
    def quantize_into(self, module: nn.Module, weight: torch.Tensor) -> None:
        """Quantize the float shard (out, in) to int8 rows with fp32 scales, on its device.

        Example:
            >>> fmt.quantize_into(m, torch.randn(32, 64))  # doctest: +SKIP
        """
        self._check_shard(module, weight)
        ao = _ao()
        w = weight.detach().contiguous()
        block = (1, w.shape[1])  # one scale per output row
        scale, zero = ao["choose_qparams_affine"](
            w, ao["MappingType"].SYMMETRIC, block, torch.int8, quant_min=-128, quant_max=127,
            eps=torch.finfo(torch.float32).eps, scale_dtype=torch.float32,
            zero_point_dtype=torch.int8,
        )  # fmt: skip
        q = ao["quantize_affine"](w, block, scale, zero, torch.int8, quant_min=-128, quant_max=127)
        layer = cast(AoInt8Linear, module)  # built by new_linear
        layer.weight = nn.Parameter(q, requires_grad=False)  # (out, in) int8
        layer.weight_scale = scale.reshape(-1).to(torch.float32)  # (out,) buffer
        layer._finish(weight.device, compute_dtype_for(self.config, weight.device), weight.dtype)

    def dequantize(self, module: nn.Module) -> torch.Tensor:
        """int8 * scale as (out, in), in the shard's dtype.

        Example:
            >>> fmt.dequantize(m).shape  # doctest: +SKIP
            torch.Size([32, 64])
        """
        layer = cast(AoInt8Linear, module)  # built by new_linear
        layer._ready()
        w = layer.weight.to(torch.float32) * layer.weight_scale[:, None]
        return w.to(layer.orig_dtype)

    def bytes_per_param(self, in_features: int | None = None) -> float:
        """1 byte per weight plus an fp32 scale per row, amortized over `in_features`.

        Example:
            >>> torchao_format(QuantConfig(format="int8", backend="torchao")).bytes_per_param(4096)
            1.0009765625
        """
        return 1.0 + 4 / (in_features or INT8_REF_IN)
