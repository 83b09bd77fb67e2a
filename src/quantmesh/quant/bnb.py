"""bitsandbytes formats: nf4 / fp4 (QLoRA's Linear4bit) and int8 (LLM.int8's Linear8bitLt).

Quantization goes through bitsandbytes.functional on the shard's own device, exactly once; nothing
relies on the quantize-on-`.to()` side effect of Params4bit / Int8Params. The local modules are
subclasses of bitsandbytes' Linear4bit / Linear8bitLt (so `isinstance` checks in peft and
transformers hold) whose forward casts the bias instead of rewriting `bias.data` in place, never
repacks the weight for the CPU avx512-bf16 kernel (that path silently drops input gradients), and
says clearly when the weight was never quantized.

bitsandbytes is imported lazily: `bnb_format(cfg).bytes_per_param()` costs no import, and the
module classes are built on first use (`QuantLinear4bit` / `QuantLinear8bit` resolve through the
module's __getattr__, so pickling them works).

Weights stored already quantized (transformers' layout) are put into a local module as they are
by `load_state` (4-bit: packed codes + QuantState; int8: CB + SCB); quant/prequant.py cuts them
per rank.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any, cast

import torch
from torch import nn

from . import kernel4
from .base import QuantConfig, QuantError, QuantFormat
from .kernel4 import (
    LowRankTensors,
    dequant_kernel_applies,
    dequantize_weight,
    dequantize_weight_applies,
    gemv_applies,
    joined_codes_on,
    matmul_4bit_dequant,
    matmul_4bit_gemv,
    matmul_4bit_mma,
    matmul_4bit_rows,
    mma_applies,
    rows_kernel_applies,
)
from .kinds import compute_dtype_for

__all__ = [
    "bnb_format",
    "Bnb4bitFormat",
    "Bnb8bitFormat",
    "dequantize_4bit_flat",
    "format_of",
    "fuse_held_siblings",
    "held_bytes",
    "hold_dequantized",
    "quant_state_from_tensors",
]

NESTED_BLOCK = 256  # bitsandbytes quantizes the per-block absmax in blocks of 256 (double quant)
INT8_REF_IN = 1024  # in_features assumed by int8 bytes_per_param when none is given (upper bound)


def bnb_format(config: QuantConfig) -> QuantFormat:
    """The bitsandbytes QuantFormat for `config` ("nf4" / "fp4" -> 4-bit, "int8" -> LLM.int8).

    Example:
        >>> fmt = bnb_format(QuantConfig(format="nf4"))
        >>> round(fmt.bytes_per_param(), 4), fmt.block_elems()
        (0.5159, 64)
    """
    if config.format in ("nf4", "fp4"):
        return Bnb4bitFormat(config)
    if config.format == "int8":
        return Bnb8bitFormat(config)
    raise QuantError(f"bitsandbytes has no format {config.format!r}; use 'nf4', 'fp4' or 'int8'")


def int8_scales(module: nn.Module) -> torch.Tensor | None:
    """The (out,) row scales of a bitsandbytes Linear8bitLt: on its weight until its first
    forward, which moves them to `module.state.SCB`."""
    scb = getattr(module.weight, "SCB", None)
    if scb is None:
        scb = getattr(getattr(module, "state", None), "SCB", None)
    return scb


def format_of(module: nn.Module) -> QuantFormat | None:
    """The QuantFormat of a bitsandbytes Linear4bit / Linear8bitLt that holds quantized weights
    (None for any other module); QuantError, with the fix, when its weights are not usable.

    Example:
        >>> format_of(nn.Linear(4, 4)) is None
        True
    """
    if not any(c.__name__ in ("Linear4bit", "Linear8bitLt") for c in type(module).__mro__):
        return None
    bnb = _bnb()
    kind = type(module).__name__
    w: Any = module.weight
    if isinstance(module, bnb.nn.Linear4bit):
        qs = getattr(w, "quant_state", None)
        if qs is None or w.device.type == "meta":
            raise QuantError(
                f"this {kind} holds no quantized weight yet (bitsandbytes quantizes a Params4bit "
                "when it is moved to a device); move the model first (model.to('cpu') or "
                "'cuda'), or build it float and pass quant='nf4' to parallelize"
            )
        if getattr(qs, "packing_format_for_cpu", False):
            raise QuantError(
                f"this {kind}'s weight was repacked for bitsandbytes' CPU inference kernel (an "
                "eval-mode forward on a CPU with avx512-bf16); set support_avx512bf16_for_cpu = "
                "False on every Linear4bit before running it, or hand the model over unrun"
            )
        cd = getattr(module, "compute_dtype", None)
        cfg = QuantConfig(format=qs.quant_type, double_quant=bool(qs.nested),
                          blocksize=int(qs.blocksize), compute_dtype=cd, skip=[])  # fmt: skip
        return Bnb4bitFormat(cfg)
    if isinstance(module, bnb.nn.Linear8bitLt):
        if w.dtype != torch.int8 or int8_scales(module) is None:
            raise QuantError(
                f"this {kind} holds no int8 weight (has_fp16_weights=True, or not moved to a "
                "device yet); build it with has_fp16_weights=False and move it, or build the "
                "model float and pass quant='int8' to parallelize"
            )
        state: Any = getattr(module, "state", None)
        threshold = float(getattr(state, "threshold", 0.0) or 0.0)
        return Bnb8bitFormat(QuantConfig(format="int8", int8_threshold=threshold, skip=[]))
    return None


# ---- the local module classes, built on first use -----------------------------------------------
class _Int8CastFilter(logging.Filter):
    # MatMul8bitLt logs this on every forward whose input is not fp16 (the cast is by design)
    def filter(self, record: logging.LogRecord) -> bool:
        return "inputs will be cast from" not in record.getMessage()


_BNB: Any = None  # bitsandbytes once imported (`_bnb`)


def _bnb() -> Any:
    """bitsandbytes, imported once and quietly (it warns that an optional CPU kernel is absent).
    Kept in a global, not a `functools.cache`: torch.compile reads a global as a constant, where
    it traces a cached function's body again (its logging calls break a fullgraph compile: the
    int8 experts' dequantize in a decode step)."""
    global _BNB
    if _BNB is not None:
        return _BNB
    lg = logging.getLogger("bitsandbytes")
    level = lg.level
    lg.setLevel(logging.ERROR)
    try:
        import bitsandbytes
        import bitsandbytes.functional  # noqa: F401
    finally:
        lg.setLevel(level)
    logging.getLogger("bitsandbytes.autograd._functions").addFilter(_Int8CastFilter())
    _BNB = bitsandbytes
    return bitsandbytes


@functools.cache
def _classes() -> dict[str, type]:
    bnb = _bnb()

    class QuantLinear4bit(bnb.nn.Linear4bit):  # type: ignore[name-defined]  # bnb: a module
        """bitsandbytes Linear4bit, filled by `Bnb4bitFormat.quantize_into`; weight frozen.
        Without autograd, two rows or more multiply the weight held dequantized where one is
        (`keep_dequantized`); on CUDA, rows a kernel of quantmesh's takes go through it
        (quant/kernel4.py: the gemv by default, the others opt-in; under autograd only the
        dequantize); the rest through bitsandbytes."""

        dense: torch.Tensor | None = None
        """The weight dequantized (`keep_dequantized`), or None: the codes alone."""
        held_run: HeldRun | None = None
        """Its siblings' held weights as one (`fuse_held_siblings`), or None."""
        held_index = 0
        codes_run: CodesRun | None = None
        """Its siblings' codes as one (`join_sibling_codes`), or None."""
        codes_index = 0

        def reset_parameters(self) -> None:  # the weight comes from quantize_into
            pass

        def keep_dequantized(self, dtype: torch.dtype | None) -> int:
            """Hold the weight dequantized in `dtype` beside its codes (None: drop it); inputs of
            two rows or more, and any input under autograd, then multiply it directly, with the
            values bitsandbytes' dequantize gives (what its own matmul multiplies from 8 rows on,
            and under autograd in forward and backward). Returns the bytes held."""
            self.__dict__.pop("dense", None)
            self.__dict__.pop("held_run", None)
            if dtype is None:
                return 0
            qs = getattr(self.weight, "quant_state", None)
            if qs is None:
                raise RuntimeError(_not_quantized(self))
            w = dequantize_4bit_flat(self.weight.data, qs).to(dtype)
            if w.is_cuda:
                torch._dynamo.mark_static_address(w, guard=False)  # read in place by CUDA graphs
            self.dense = w
            return w.numel() * w.element_size()

        def _kernel_product(self, matmul: Callable, x: torch.Tensor, xc: torch.Tensor, qs: Any,
                            grad: bool) -> torch.Tensor:  # fmt: skip
            """x @ W^T by a kernel of quantmesh's (`matmul`, `xc`: x in the compute dtype): the
            run's joined codes read once for its siblings where it has one
            (`join_sibling_codes`), else this layer's own codes."""
            run = self.codes_run
            if (
                run is None
                or grad
                or matmul not in _JOINED_KERNELS
                or not joined_codes_on()
                or run.codes.device != x.device
            ):  # (a model moved since: its own codes)
                return matmul(xc, self.weight.data, qs)
            x2 = xc.reshape(-1, x.shape[-1])
            y = run.output(self.codes_index, x, lambda: matmul(x2, run.codes, run.qs),
                           lambda: matmul(x2, self.weight.data, qs))  # fmt: skip
            return y.reshape(*x.shape[:-1], y.shape[-1])

        def _joined_product(self, run: CodesRun, x: torch.Tensor, xc: torch.Tensor, qs: Any,
                            cd: torch.dtype, grad: bool) -> torch.Tensor:  # fmt: skip
            """x @ W^T while compiling, for a member of a joined run (`join_sibling_codes`): a
            compiled block region refuses inputs that alias, and this layer's codes and
            statistics are views of the run's, so it reads the run's tensors alone. The run's
            product (the gemv or the tensor-core kernel on the joined codes where they apply,
            else `CodesRun.flat_product`) gives each sibling its columns when it gets the very
            tensor the first one got; otherwise its own rows of the joined weight."""
            i = self.codes_index
            x2 = xc.reshape(-1, x.shape[-1])
            joined = functools.partial(run.flat_product, x2)
            own = functools.partial(run.flat_product, x2, i)
            if not grad:
                for applies, matmul in _KERNELS:
                    if matmul in _JOINED_KERNELS and applies(x, qs, cd):
                        c0, c1 = run.code_at[i]  # its own codes: the kernel's unjoined form
                        own = functools.partial(matmul, x2, run.codes[c0:c1], qs,
                                                run.member_statistics(i))  # fmt: skip
                        if not joined_codes_on():  # (off since the join: its own launch)
                            y = own()
                            return y.reshape(*x.shape[:-1], y.shape[-1])
                        joined = functools.partial(matmul, x2, run.codes, run.qs)
                        break
            y = run.output(i, x, joined, own)
            return y.reshape(*x.shape[:-1], y.shape[-1])

        def _joined_run(self, x: torch.Tensor) -> CodesRun | None:
            """Its run when the kernels read the run's joined codes for `x` (one launch for the
            siblings), else None."""
            run = self.codes_run
            if run is None or run.codes.device != x.device or not joined_codes_on():
                return None
            return run

        def takes_low_rank(self, x: torch.Tensor, lr: Any = None) -> bool:
            """Whether `forward(x, low_rank=lr)` adds the adapter's delta (`lora.adapter.
            LowRank`) inside its launch: `kernel4.gemv_lora_on`, the gemv's inputs (`gemv_applies`:
            CUDA, 1 to 8 rows, no autograd), x in the compute dtype, no held weight, the
            delta's tensors on x's device; for a joined run, a delta for the very siblings
            (`lr.whole`), which the run's one launch adds for all of them. A bias (a plain tensor)
            is added in the launch before the delta; a joined run's are the members' joined
            (`CodesRun.refresh_bias`). Without `lr`: whether it would take one at all (asked
            first, so that no delta is made for nothing)."""
            qs = getattr(self.weight, "quant_state", None)
            cd = self.compute_dtype or x.dtype
            if (
                not kernel4.gemv_lora_on(x.device)
                or qs is None
                or (self.bias is not None and not kernel4.plain_tensor(self.bias))
                or self.dense is not None
                or x.dtype != cd
                or not gemv_applies(x, qs, cd)
            ):
                return False
            if lr is None:
                return True
            if lr.e.device != x.device:
                return False
            run = self._joined_run(x)
            if run is None:
                return True
            bias_ok = not run.biased or (run.bias is not None and run.bias.dtype == cd)
            return bias_ok and lr.whole is not None and lr.members == run.member_ids

        def _low_rank_product(self, x: torch.Tensor, lr: Any) -> torch.Tensor:
            """x @ W^T plus the bias and the adapter's delta `lr`, in the gemv's launch
            (`takes_low_rank` said yes): for a joined run, the run's one launch with every
            sibling's bias and delta, each sibling taking its columns when it gets the tensor
            the first one got."""
            qs = self.weight.quant_state
            x2 = x.reshape(-1, x.shape[-1])
            cd = self.compute_dtype or x.dtype
            own_bias = None if self.bias is None else self.bias.to(cd)

            def add(d: Any, bias: torch.Tensor | None) -> LowRankTensors:
                t = d.down(x2).contiguous()
                return (t, d.e, d.col, d.scale, bias)

            run = self.codes_run
            if run is None or run.codes.device != x.device:
                y = matmul_4bit_gemv(x2, self.weight.data, qs, low_rank=add(lr, own_bias))
            else:  # the run's tensors alone (a compiled block region refuses inputs that alias)
                i = self.codes_index
                c0, c1 = run.code_at[i]

                def own() -> torch.Tensor:
                    return matmul_4bit_gemv(x2, run.codes[c0:c1], qs, run.member_statistics(i),
                                            low_rank=add(lr, own_bias))  # fmt: skip

                def joined() -> torch.Tensor:
                    return matmul_4bit_gemv(x2, run.codes, run.qs,
                                            low_rank=add(lr.whole, run.bias))  # fmt: skip

                y = run.output(i, x, joined, own, "low_rank") if joined_codes_on() else own()
            return y.reshape(*x.shape[:-1], y.shape[-1])

        def forward(self, x: torch.Tensor, low_rank: Any = None) -> torch.Tensor:
            if low_rank is not None:  # the adapter's delta inside the gemv (takes_low_rank)
                return self._low_rank_product(x, low_rank)
            qs = getattr(self.weight, "quant_state", None)
            if qs is None:
                raise RuntimeError(_not_quantized(self))
            cd = self.compute_dtype or x.dtype
            bias = None if self.bias is None else self.bias.to(cd)  # differentiable, no rewrite
            dense = self.dense
            grad = torch.is_grad_enabled()
            if dense is not None and (grad or x.numel() > x.shape[-1]):
                # the held weight: two rows or more, or any under autograd (training: no
                # dequantize in forward or backward; autograd keeps the held tensor itself)
                x2 = x.reshape(-1, x.shape[-1]).to(dense.dtype)
                run = None if grad else self.held_run  # (a member reads the run's tensor, never
                # its own view: a compiled block region refuses two inputs that alias)
                if run is not None:
                    w = run.w
                    o, n = run.out_at[self.held_index], run.outs[self.held_index]
                    y = run.output(self.held_index, x, lambda: torch.nn.functional.linear(x2, w),
                                   lambda: torch.nn.functional.linear(x2, w[o : o + n]))  # fmt: skip
                else:
                    y = torch.nn.functional.linear(x2, dense)
                if bias is not None:
                    y = y + bias.to(dense.dtype)
                return y.reshape(*x.shape[:-1], y.shape[-1]).to(x.dtype)
            if _rows_cut_blocks_on_cpu(self.weight, qs):
                # see dequantize_4bit_flat; eager and compiled alike (bitsandbytes' CPU kernel
                # would compute with the wrong statistics)
                y = _flat_matmul_4bit(x.to(cd), self.weight.data, *_flat_args(qs))
                return (y if bias is None else y + bias).to(x.dtype)
            codes_run = self.codes_run
            if (
                codes_run is not None
                and codes_run.codes.device == x.device
                and torch.compiler.is_compiling()
            ):
                y = self._joined_product(codes_run, x, x.to(cd), qs, cd, grad)
                return (y if bias is None else y + bias).to(x.dtype)
            for applies, matmul in _KERNELS:  # quantmesh's kernels (CUDA; see quant/kernel4.py)
                if applies(x, qs, cd):
                    y = self._kernel_product(matmul, x, x.to(cd), qs, grad)
                    return (y if bias is None else y + bias).to(x.dtype)
            # (rows, in) @ (out, in)^T -> (rows, out); the kernel dequantizes blocks in `cd`. The
            # rows flattened first: a 3-D input whose strides do not fold (an attention output
            # of one position per row) made the compiled matmul a batched one against the weight
            # expanded per row (docs/benchmarks.md, "Figures the code relies on")
            x2 = x.reshape(-1, x.shape[-1]).to(cd)
            y = bnb.matmul_4bit(x2, self.weight, quant_state=qs, bias=bias)
            return y.reshape(*x.shape[:-1], y.shape[-1]).to(x.dtype)

    class QuantLinear8bit(bnb.nn.Linear8bitLt):  # type: ignore[name-defined]  # bnb: a module
        """bitsandbytes Linear8bitLt (LLM.int8), filled by `Bnb8bitFormat.quantize_into`."""

        def reset_parameters(self) -> None:
            pass

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            w = self.weight
            scb = getattr(w, "SCB", None)
            if scb is None:
                raise RuntimeError(_not_quantized(self))
            if scb.device != w.device:  # nn.Module._apply swaps .data and leaves SCB behind
                w.SCB = scb = scb.to(w.device)
            # the state is rebuilt from the weight each call, so module moves cannot leave it stale
            self.state.CB, self.state.SCB = w.data, scb
            self.state.is_training = self.training
            bias = None if self.bias is None else self.bias.to(x.dtype)
            # as (rows, in): bitsandbytes' int8 matmul flattens 3-D inputs only, and fails on
            # more dims (DeepSeek-V3's attention reads a 4-D tensor through kv_b_proj)
            y = bnb.matmul(x.reshape(-1, x.shape[-1]), w, bias=bias, state=self.state)
            return y.view(*x.shape[:-1], y.shape[-1])

    out: dict[str, type] = {"QuantLinear4bit": QuantLinear4bit, "QuantLinear8bit": QuantLinear8bit}
    for cls in out.values():
        cls.__module__, cls.__qualname__ = __name__, cls.__name__
    return out


def __getattr__(name: str) -> Any:
    if name in ("QuantLinear4bit", "QuantLinear8bit"):
        return _classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _not_quantized(m: nn.Module) -> str:
    return (
        f"{type(m).__name__}({m.in_features} -> {m.out_features}) has no quantized weight yet; "
        "call fmt.quantize_into(module, weight) or load a checkpoint first"
    )


def _check_shard(module: nn.Module, weight: torch.Tensor) -> None:
    lin = cast(nn.Linear, module)  # a bitsandbytes linear: a subclass of nn.Linear
    want = (lin.out_features, lin.in_features)
    if tuple(weight.shape) != want:
        raise ValueError(
            f"quantize_into got a weight of shape {tuple(weight.shape)}, expected (out, in) = "
            f"{want}; transpose Conv1D weights and slice to this rank's shard first"
        )
    if not weight.is_floating_point():
        raise ValueError(f"quantize_into got a {weight.dtype} weight; pass the float shard")
    bias = getattr(module, "bias", None)
    if bias is not None and bias.device.type != "meta" and bias.device != weight.device:
        raise ValueError(
            f"the weight shard is on {weight.device} but the module's bias is on {bias.device}; "
            f"move the shard to {bias.device} (quantization happens where the shard is)"
        )


def _materialize_bias(module: nn.Module, device: torch.device) -> None:
    # a module built on meta becomes real on the shard's device; the caller loads the bias values
    b = getattr(module, "bias", None)
    if b is not None and b.device.type == "meta":
        real = torch.zeros(b.shape, dtype=b.dtype, device=device)
        module.bias = nn.Parameter(real, requires_grad=b.requires_grad)


class _BnbFormat(QuantFormat):
    """What the bitsandbytes formats share: cutting a layer bitsandbytes quantized already."""

    def cut_from(
        self,
        module: nn.Module,
        source: nn.Module,
        dim: int | None,
        ranges: tuple[tuple[int, int], ...] | None,
        device: torch.device,
    ) -> str:
        """Rows / columns of a bitsandbytes layer quantized already, into `module` (prequant.py).

        Example:
            >>> fmt.cut_from(shard.local, user_layer, 0, ((0, 128),), torch.device("cpu"))  # doctest: +SKIP
            'codes cut on block boundaries'
        """
        from .prequant import cut_module

        return cut_module(self, module, source, dim, ranges, device)


class Bnb4bitFormat(_BnbFormat):
    """nf4 / fp4 blockwise 4-bit (bitsandbytes Linear4bit, Params4bit + QuantState).

    Example:
        >>> fmt = bnb_format(QuantConfig(format="nf4"))
        >>> m = fmt.new_linear(64, 32, bias=True, device="cpu", dtype=torch.float32)
        >>> fmt.quantize_into(m, torch.randn(32, 64))
        >>> m(torch.randn(2, 64)).shape
        torch.Size([2, 32])
    """

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
        """An empty QuantLinear4bit; its weight is a packed uint8 placeholder until quantize_into.

        Example:
            >>> m = bnb_format(QuantConfig()).new_linear(64, 32, bias=False, device="meta",
            ...                                          dtype=torch.bfloat16)
            >>> m.weight.shape, m.weight.is_meta
            (torch.Size([1024, 1]), True)
        """
        Params4bit = _bnb().nn.Params4bit
        device = torch.device(device)
        cfg = self.config
        m = _classes()["QuantLinear4bit"](
            in_features, out_features, bias=bias, quant_type=cfg.format,
            compress_statistics=cfg.double_quant, device="meta",
        )  # fmt: skip
        m.support_avx512bf16_for_cpu = False  # the repacked CPU layout loses input gradients
        m.compute_dtype = None if device.type == "meta" else compute_dtype_for(cfg, device)
        m.compute_type_is_set = True
        # (ceil(out*in/2), 1) uint8: bitsandbytes' packed layout, two 4-bit codes per byte
        n_bytes = (in_features * out_features + 1) // 2
        m.weight = Params4bit(
            torch.empty((n_bytes, 1), dtype=torch.uint8, device=device), requires_grad=False,
            blocksize=cfg.blocksize, compress_statistics=cfg.double_quant, quant_type=cfg.format,
            module=m, bnb_quantized=True,  # True: a later .to() moves it and never quantizes
        )  # fmt: skip
        if bias:
            m.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype))
        return m

    @torch.no_grad()
    def quantize_into(self, module: nn.Module, weight: torch.Tensor) -> None:
        """Quantize the float shard `weight` (out, in) on its device into `module`.

        Example:
            >>> fmt = bnb_format(QuantConfig(format="fp4", double_quant=False))
            >>> m = fmt.new_linear(64, 8, bias=False, device="meta", dtype=torch.float32)
            >>> fmt.quantize_into(m, torch.randn(8, 64)); m.weight.device.type
            'cpu'
        """
        F = _bnb().functional
        _check_shard(module, weight)
        cfg = self.config
        packed, qs = F.quantize_4bit(
            weight.detach().contiguous(), blocksize=cfg.blocksize,
            compress_statistics=cfg.double_quant, quant_type=cfg.format,
        )  # fmt: skip
        _set_4bit(module, packed, qs, compute_dtype_for(cfg, weight.device))

    def load_quantized(
        self,
        module: nn.Module,
        tensors: Mapping[str, torch.Tensor],
        *,
        device: torch.device | str | None = None,
        dim: int | None = None,
        start: int = 0,
        stop: int | None = None,
    ) -> None:
        """Fill `module` from one stored 4-bit entry (all in memory), optionally rows or columns.

        `tensors` holds the entry's keys without the module prefix ("weight", "weight.absmax",
        "weight.quant_map", ["weight.nested_absmax", "weight.nested_quant_map"],
        "weight.quant_state.bitsandbytes__nf4"). `dim`/`start`/`stop` select rows (dim 0) or
        columns (dim 1) of the logical (out, in) weight, on block boundaries (quant/prequant.py
        `slice_4bit`); `load_checkpoint` streams the same cut from a file instead.

        Example:
            >>> fmt.load_quantized(m, {"weight": w, "weight.absmax": a, ...},  # doctest: +SKIP
            ...                    device="cuda:0", dim=0, start=0, stop=2048)
        """
        from .prequant import slice_4bit

        packed, qs = quant_state_from_tensors(tensors)
        if dim is not None:
            flat = packed.reshape(-1).view(torch.uint8)
            stop = int(qs.shape[dim]) if stop is None else stop
            packed, qs = slice_4bit(qs, dim, ((start, stop),), lambda a, b: flat[a:b])
        self.load_state(module, packed, qs, device=device)

    def load_state(
        self,
        module: nn.Module,
        packed: torch.Tensor,
        qs: Any,
        *,
        device: torch.device | str | None = None,
    ) -> None:
        """Put stored codes `packed` ((n, 1) uint8) and their QuantState into `module`, moved to
        `device` (default: where the module's weight is). Nothing is requantized.

        Example:
            >>> fmt.load_state(m, packed, qs, device="cpu")  # doctest: +SKIP
        """
        cfg = self.config
        if qs.quant_type != cfg.format:
            raise QuantError(
                f"the stored weight is {qs.quant_type}, but the QuantConfig says {cfg.format}; "
                f"use QuantConfig(format={qs.quant_type!r})"
            )
        if tuple(qs.shape) != (module.out_features, module.in_features):
            raise ValueError(
                f"the pre-quantized weight is {tuple(qs.shape)}, the module expects "
                f"{(module.out_features, module.in_features)}; cut it to this rank's rows/columns"
            )
        if device is None:
            device = cast(nn.Linear, module).weight.device
        device = torch.device(device)
        if device.type == "meta":
            raise ValueError("the module is on meta; pass load_state(..., device=...)")
        qs.to(device)
        _set_4bit(module, packed.to(device), qs, compute_dtype_for(cfg, device))

    def dequantize(self, module: nn.Module) -> torch.Tensor:
        """The float weight (out, in) in the dtype the shard had when quantized.

        Example:
            >>> fmt.dequantize(m).shape  # doctest: +SKIP
            torch.Size([8, 64])
        """
        packed, qs = _packed_state(module)
        return dequantize_4bit_flat(packed, qs)

    def compute_weight(self, module: nn.Module) -> torch.Tensor:
        """The float weight (out, in) from plain tensors and values (traced by torch.compile),
        blocks over the flattened weight as quantize_4bit made them.

        Example:
            >>> fmt.compute_weight(m).shape  # doctest: +SKIP
            torch.Size([8, 64])
        """
        packed, qs = _packed_state(module)
        return _flat_weight(packed, *_flat_args(qs))

    def compute_units(self, module: nn.Module, units: int, index: torch.Tensor) -> torch.Tensor:
        """The rows of some of `units` equal groups (experts): only their codes are dequantized
        when a group is whole blocks (the absmax, one float per block, is computed whole: 1/32
        of the codes' bytes at blocksize 64). Equal to `compute_weight`'s rows.

        Example:
            >>> fmt.compute_units(q, 4, torch.tensor([2])).shape  # doctest: +SKIP
            torch.Size([16, 64])
        """
        packed, qs = _packed_state(module)
        absmax, bs, qt, out_f, in_f, dtype = _flat_args(qs)
        per = out_f * in_f // units  # elements of one group
        if out_f % units or per % bs or per % 2:
            return super().compute_units(module, units, index)
        codes = packed.reshape(units, per // 2).index_select(0, index)
        scales = absmax.reshape(units, per // bs).index_select(0, index)
        rows = len(index) * (out_f // units)
        return _flat_weight(codes.reshape(-1, 1), scales.reshape(-1), bs, qt, rows, in_f, dtype)

    def bytes_per_param(self, in_features: int | None = None) -> float:
        """0.5 for the codes, plus the absmax: fp32 per block, or (double quant) uint8 per block and
        fp32 per 256 blocks. Per-tensor constants (code books, ~1 KiB a layer) are left out.

        Example:
            >>> bnb_format(QuantConfig(format="nf4", double_quant=False)).bytes_per_param()
            0.5625
        """
        bs = self.config.blocksize
        if self.config.double_quant:
            return 0.5 + 1 / bs + 4 / (bs * NESTED_BLOCK)
        return 0.5 + 4 / bs

    def block_elems(self) -> int:
        """Elements per quantization block of the flattened (out, in) weight (= blocksize)."""
        return self.config.blocksize


def _packed_state(module: nn.Module) -> tuple[torch.Tensor, Any]:
    """A 4-bit linear's packed codes and QuantState; raises when it was never quantized."""
    w = cast(torch.Tensor, module.weight)
    qs = getattr(w, "quant_state", None)
    if qs is None:
        raise RuntimeError(_not_quantized(module))
    return w.data, qs


def _rows_cut_blocks_on_cpu(packed: torch.Tensor, qs: Any) -> bool:
    return packed.device.type == "cpu" and int(qs.shape[-1]) % int(qs.blocksize) != 0


def _four_bit_layers(layers: Iterable[nn.Module]) -> list[nn.Module]:
    """The bitsandbytes 4-bit linears among `layers`, each once. A model is refused: its sharded
    layers' local modules are not its children (`qm.keep_dequantized` walks a model)."""
    if isinstance(layers, nn.Module):
        raise TypeError(
            f"hold_dequantized / held_bytes take a list of layers, not a {type(layers).__name__}: "
            "for a model (parallelized or not) use qm.keep_dequantized(model, dtype)"
        )
    cls = _classes()["QuantLinear4bit"]
    found: dict[int, nn.Module] = {}
    for m in layers:
        if isinstance(m, cls):
            found.setdefault(id(m), m)
    return list(found.values())


def hold_dequantized(layers: Iterable[nn.Module], dtype: torch.dtype | None) -> int:
    """Hold the weight of every bitsandbytes 4-bit linear among `layers` dequantized in `dtype`
    beside its codes (None: drop them); returns the bytes held. What holding does, and the model
    level (a parallelized model's sharded layers included): `qm.keep_dequantized`.

    Example:
        >>> hold_dequantized([q_proj, k_proj], torch.bfloat16)  # doctest: +SKIP
        67108864
    """
    return sum(cast(Any, m).keep_dequantized(dtype) for m in _four_bit_layers(layers))


_KERNELS = (  # (applies, matmul) in the order QuantLinear4bit tries them
    (gemv_applies, matmul_4bit_gemv),  # decoding: 1 to 8 rows, codes read once
    (mma_applies, matmul_4bit_mma),  # 9 to 64 rows: codes read once, tensor cores
    (rows_kernel_applies, matmul_4bit_rows),  # opt-in: a few rows, codes read once
    (dequant_kernel_applies, matmul_4bit_dequant),  # many rows, training: Triton's dequantize
)
# the kernels that read a CodesRun's joined codes (an offset per nested block: kernel4._offsets)
_JOINED_KERNELS = (matmul_4bit_gemv, matmul_4bit_mma)


class _SiblingRun:
    """Sibling layers that read one tensor (q, k, v; gate, up) whose weights are one (sum of
    outs, in) weight: the first sibling's forward multiplies it once (`joined`), and each sibling
    takes its own columns of that output when it gets the very tensor the first one got
    (otherwise `own`, its own product). `HeldRun` holds the weights dequantized; `CodesRun` joins
    the 4-bit codes themselves."""

    def __init__(self, outs: list[int]) -> None:
        self.outs = outs
        self.out_at = [sum(outs[:i]) for i in range(len(outs))]
        self.n = len(outs)
        self.x: torch.Tensor | None = None  # the input of this forward's first sibling
        self.out: torch.Tensor | None = None  # (rows, sum of outs)
        self.kind = ""  # what the first sibling's product holds besides x @ W^T

    def output(self, i: int, x: torch.Tensor, joined: Callable[[], torch.Tensor],
               own: Callable[[], torch.Tensor], kind: str = "") -> torch.Tensor:  # fmt: skip
        """Sibling `i`'s (rows, out_i) without bias: its columns of `joined()` (the first
        sibling's product, for all of them) when `x` (its input as it came) is the tensor the
        first sibling got in this forward and the product is of the same `kind` ("": x @ W^T
        alone; "low_rank": with the adapters' deltas, `QuantLinear4bit.takes_low_rank`), else
        `own()`: a sibling never takes columns that lack its delta or hold one it adds again."""
        o, n = self.out_at[i], self.outs[i]
        if i == 0:
            self.x, self.kind = x, kind
            self.out = joined()
        if self.x is x and self.out is not None and self.kind == kind:
            y = self.out[:, o : o + n]
        else:
            y = own()
        if i == self.n - 1:  # the last sibling: hold no tensor past this forward
            self.x = self.out = None
        return y


class HeldRun(_SiblingRun):
    """Sibling 4-bit layers that read one tensor (q, k, v; gate, up), their held weights
    (`keep_dequantized`) one (sum of outs, in) tensor: the first sibling's forward multiplies it
    once, and each sibling takes its own columns of that output, when it gets the very tensor the
    first one got (otherwise its own weight, a view of the joined one: no memory is added). One
    matmul of the joined width reads the weights at a higher share of the memory's rate than
    two or three narrower ones (docs/benchmarks.md, "Figures the code relies on").

    Example:
        >>> run = HeldRun([q, k, v])  # doctest: +SKIP
    """

    def __init__(self, members: list[nn.Module]) -> None:
        ws = [cast(torch.Tensor, cast(Any, m).dense) for m in members]
        super().__init__([int(w.shape[0]) for w in ws])
        self.w = torch.cat(ws)
        for i, m in enumerate(members):
            o = self.out_at[i]
            view = self.w[o : o + self.outs[i]]
            if view.is_cuda:  # read in place by CUDA graphs
                torch._dynamo.mark_static_address(view, guard=False)
            m.dense, m.held_run, m.held_index = view, self, i  # type: ignore[assignment]
        if self.w.is_cuda:
            torch._dynamo.mark_static_address(self.w, guard=False)


class CodesRun(_SiblingRun):
    """Sibling 4-bit layers that read one tensor (q, k, v; gate, up), their packed codes and
    statistics joined into one (sum of outs, in) weight: the gemv and the tensor-core kernel
    (quant/kernel4.py) then read all of them in one launch, with more programs in flight than
    each narrow weight gives. The members' codes and statistics become views of the joined
    tensors, so no memory is added; each keeps its own QuantState (bitsandbytes' path, training
    and saving read them as before). Under double quant each member keeps its own offset: the
    joined state holds one per nested block (the kernels' OFFS), so every weight is the one
    bitsandbytes dequantizes. Made by `join_sibling_codes`.

    Example:
        >>> run = CodesRun([q, k, v])  # doctest: +SKIP
    """

    def __init__(self, members: list[nn.Module]) -> None:
        F = _bnb().functional
        qss = [cast(Any, m).weight.quant_state for m in members]
        super().__init__([int(q.shape[0]) for q in qss])
        first = qss[0]
        codes = [cast(Any, m).weight.data for m in members]
        self.codes = torch.cat([c.reshape(-1).view(torch.uint8) for c in codes])
        absmax = torch.cat([q.absmax for q in qss])
        state2, offset = None, first.offset
        if first.nested:
            nested = torch.cat([q.state2.absmax for q in qss])
            offset = torch.cat([  # one offset per nested block, each member's own
                torch.full_like(q.state2.absmax, float(q.offset), dtype=torch.float32)
                for q in qss
            ])  # fmt: skip
            s2 = first.state2
            state2 = F.QuantState(absmax=nested, code=s2.code, blocksize=s2.blocksize,
                                  dtype=s2.dtype)  # fmt: skip
        self.qs = F.QuantState(absmax=absmax, shape=torch.Size([sum(self.outs), first.shape[1]]),
                               code=first.code, blocksize=first.blocksize,
                               quant_type=first.quant_type, dtype=first.dtype, offset=offset,
                               state2=state2)  # fmt: skip
        at_c = at_a = at_n = 0  # where each member's codes, absmax and nested absmax begin
        views: list[torch.Tensor] = []
        self.code_at: list[tuple[int, int]] = []  # each member's bytes of `codes`, its blocks
        self.block_at: list[tuple[int, int]] = []  # (and nested blocks)
        self.nested_at: list[tuple[int, int]] = []
        for i, (m, q, c) in enumerate(zip(members, qss, codes, strict=True)):
            n, k = c.numel() * c.element_size(), q.absmax.numel()
            self.code_at.append((at_c, at_c + n))
            self.block_at.append((at_a, at_a + k))
            cast(Any, m).weight.data = self.codes[at_c : at_c + n].view(c.dtype).view(c.shape)
            q.absmax = absmax[at_a : at_a + k]
            views.append(q.absmax)  # (the codes are a parameter's: static already)
            at_c, at_a = at_c + n, at_a + k
            if state2 is not None:
                k2 = q.state2.absmax.numel()
                self.nested_at.append((at_n, at_n + k2))
                q.state2.absmax = state2.absmax[at_n : at_n + k2]
                views.append(q.state2.absmax)
                at_n += k2
            m.codes_run, m.codes_index = self, i  # type: ignore[assignment]
        self.member_ids = tuple(id(m) for m in members)  # (what a stack's LowRank names)
        # the members' biases joined, in the compute dtype, for the low-rank launch (made by
        # `refresh_bias`; zeros for a member without one), and whether any member has one
        self.biased = any(getattr(m, "bias", None) is not None for m in members)
        self.bias: torch.Tensor | None = None
        if self.codes.is_cuda:  # read in place by CUDA graphs (the members' views too)
            joined = [self.codes, absmax, *(() if state2 is None else (state2.absmax, offset))]
            for t in joined + views:
                torch._dynamo.mark_static_address(t, guard=False)

    @torch.no_grad()
    def refresh_bias(self, dtype: torch.dtype, members: list[nn.Module]) -> torch.Tensor | None:
        """Copy the current biases of `members` (the run's, in order) into `bias` (sum of outs,)
        in `dtype` (in place, at a fixed address: CUDA graphs read it; zeros for a member without
        one), what the joined low-rank launch adds (`QuantLinear4bit.takes_low_rank`); None where
        no member has a bias, `members` are not the run's, or a bias is not a plain tensor.
        `infer.decode.prepare_low_rank` calls it after each prefill, as the adapter stacks are
        refreshed.

        Example:
            >>> run.refresh_bias(torch.bfloat16, [q, k, v])  # with biases  # doctest: +SKIP
            tensor([...], dtype=torch.bfloat16)
        """
        biases = [getattr(m, "bias", None) for m in members]
        plain = all(b is None or kernel4.plain_tensor(b) for b in biases)
        if not self.biased or tuple(id(m) for m in members) != self.member_ids or not plain:
            self.bias = None
            return None
        dev, n = self.codes.device, sum(self.outs)
        if self.bias is None or self.bias.dtype != dtype or self.bias.device != dev:
            self.bias = torch.zeros(n, dtype=dtype, device=dev)
            if self.bias.is_cuda:
                torch._dynamo.mark_static_address(self.bias, guard=False)
        for i, b in enumerate(biases):
            part = self.bias[self.out_at[i] : self.out_at[i] + self.outs[i]]
            if b is None:
                part.zero_()
            else:
                part.copy_(b)  # (rounded to `dtype` as the layer's `bias.to(dtype)` is)
        return self.bias

    def member_statistics(self, member: int) -> tuple[Any, ...]:
        """Member `member`'s statistics as the kernels take them (`kernel4._statistics`' order),
        slices of the joined tensors (never the member's views of them): its absmax and, under
        double quant, its nested absmax, the nested code and its one offset."""
        b0, b1 = self.block_at[member]
        qs = self.qs
        if not qs.nested:
            return qs.absmax[b0:b1], None, None, None
        n0, n1 = self.nested_at[member]
        return qs.absmax[b0:b1], qs.state2.absmax[n0:n1], qs.state2.code, qs.offset[n0 : n0 + 1]

    def flat_product(self, x2: torch.Tensor, member: int | None = None) -> torch.Tensor:
        """x2 (rows, in) @ W^T of the joined weight (rows, sum of outs), or of member `member`'s
        rows of it, read from the joined tensors alone (never a member's views of them), with
        the weight bitsandbytes' dequantize gives: each block's absmax from the nested
        statistics plus its member's offset. Under autograd as `_flat_matmul_4bit` (the codes
        kept for backward, no float weight)."""
        absmax, bs, qt, out_f, in_f, dtype = _flat_args(self.qs)
        codes = self.codes
        if member is not None:
            (c0, c1), (b0, b1) = self.code_at[member], self.block_at[member]
            codes, absmax, out_f = codes[c0:c1], absmax[b0:b1], self.outs[member]
        return _flat_matmul_4bit(x2, codes, absmax, bs, qt, out_f, in_f, dtype)


def join_sibling_codes(runs: Iterable[list[nn.Module]]) -> int:
    """Join the packed codes of each run of sibling 4-bit layers (`CodesRun`) where the gemv and
    the tensor-core kernel can read them as one weight (`kernel4.joins_pay_on` their device:
    `JOIN_ENABLED`, Triton, a GPU; else none): every member a 4-bit linear of
    quantmesh's in no run yet, on one device, with one input width, quant type, compute dtype
    and code table, blocks of 64 that rows fill whole, and under double quant nested blocks of
    256 that no two members share. Returns the number of runs joined; a run that does not
    qualify is left as it is (its members keep their own launches).

    Example:
        >>> join_sibling_codes([[q, k, v], [gate, up]])  # doctest: +SKIP
        2
    """
    runs = [run for run in runs if len(run) >= 2]
    if not runs or not joined_codes_on():  # (nothing to join: bitsandbytes stays unimported)
        return 0
    cls = _classes()["QuantLinear4bit"]
    joined = 0
    for run in runs:
        if (all(isinstance(m, cls) for m in run) and _joinable(run)
                and kernel4.joins_pay_on(cast(Any, run[0]).weight.device)):  # fmt: skip
            CodesRun(list(run))
            joined += 1
    return joined


def _joinable(run: list[nn.Module]) -> bool:
    """Whether `CodesRun` can join the codes of `run` (see `join_sibling_codes`)."""
    qss: list[Any] = [getattr(cast(Any, m).weight, "quant_state", None) for m in run]
    if any(q is None or getattr(m, "codes_run", None) is not None
           for m, q in zip(run, qss, strict=True)):  # fmt: skip
        return False
    first = qss[0]
    codes = [cast(Any, m).weight.data for m in run]
    same = {(c.device, c.dtype, int(q.shape[1]), q.quant_type, q.dtype, q.nested,
             int(q.blocksize)) for c, q in zip(codes, qss, strict=True)}  # fmt: skip
    if len(same) > 1 or int(first.blocksize) != 64 or int(first.shape[1]) % 64:
        return False
    if sum(int(q.shape[0]) for q in qss) * int(first.shape[1]) >= 2**31 - 1:
        return False  # (the kernels index the flat weight in int32)
    if not all(c.is_contiguous() and torch.equal(q.code, first.code)
               for c, q in zip(codes, qss, strict=True)):  # fmt: skip
        return False
    if first.nested:
        s2 = first.state2
        return all(
            int(q.state2.blocksize) == 256
            and q.absmax.numel() % 256 == 0
            and torch.equal(q.state2.code, s2.code)
            for q in qss
        )
    return True


def fuse_held_siblings(runs: Iterable[list[nn.Module]]) -> int:
    """Join the held weights of each run of sibling layers (`HeldRun`), where every member is a
    4-bit linear holding its weight (`keep_dequantized`) in one dtype, on one device, with one
    input width, and not yet in a run. Returns the number of runs joined.

    Example:
        >>> fuse_held_siblings([[q, k, v], [gate, up]])  # doctest: +SKIP
        2
    """

    def free(m: nn.Module) -> bool:  # holds its weight, in no run yet
        return getattr(m, "dense", None) is not None and getattr(m, "held_run", None) is None

    runs = [run for run in runs if len(run) >= 2 and all(free(m) for m in run)]
    if not runs:  # (nothing held: bitsandbytes stays unimported)
        return 0
    cls = _classes()["QuantLinear4bit"]
    joined = 0
    for run in runs:
        held = [cast(torch.Tensor, cast(Any, m).dense) for m in run]
        kinds = {(d.dtype, d.device, int(d.shape[1])) for d in held}
        if len(kinds) == 1 and all(isinstance(m, cls) for m in run):
            HeldRun(list(run))
            joined += 1
    return joined


def held_bytes(layers: Iterable[nn.Module], dtype: torch.dtype) -> int:
    """The bytes `hold_dequantized(layers, dtype)` would hold, computed without allocating.

    Example:
        >>> held_bytes(layers, torch.bfloat16) / 2**30  # doctest: +SKIP
        12.1
    """
    per = torch.empty(0, dtype=dtype).element_size()
    quantized = [cast(nn.Linear, m) for m in _four_bit_layers(layers)]
    return sum(m.in_features * m.out_features * per for m in quantized)


def dequantize_4bit_flat(packed: torch.Tensor, qs: Any) -> torch.Tensor:
    """The (out, in) weight of 4-bit codes, with blocks over the flattened weight as quantize_4bit
    made them. bitsandbytes' CPU dequantize kernel (0.50) indexes the statistics per row when
    given a 2-D shape, which is wrong when `in` is not a multiple of the blocksize (its own
    quantizer blocks the flattened weight); there the weight is dequantized as one row.

    Example:
        >>> dequantize_4bit_flat(m.weight.data, m.weight.quant_state).shape  # doctest: +SKIP
        torch.Size([256, 48])
    """
    if not _rows_cut_blocks_on_cpu(packed, qs):
        return _bnb().functional.dequantize_4bit(packed, qs)
    return _flat_weight(packed, *_flat_args(qs))


def _flat_args(qs: Any) -> tuple:
    # tensors and plain values only (torch.compile traces them): the fp32 absmax, per block; the
    # offset one value, or one per nested block (a joined run's state, `CodesRun`: each of its
    # members' own)
    if qs.nested:
        s2 = qs.state2
        absmax = torch.ops.bitsandbytes.dequantize_blockwise(
            qs.absmax, s2.absmax, s2.code, s2.blocksize, torch.float32
        )
        offset = qs.offset
        if isinstance(offset, torch.Tensor) and offset.numel() > 1:
            absmax = (absmax.view(-1, s2.blocksize) + offset[:, None]).view(-1)
        else:
            absmax = absmax + offset
    else:
        absmax = qs.absmax
    out_f, in_f = int(qs.shape[0]), int(qs.shape[1])
    return absmax, int(qs.blocksize), str(qs.quant_type), out_f, in_f, qs.dtype


def _flat_weight(packed: torch.Tensor, absmax: torch.Tensor, bs: int, qt: str, out_f: int,
                 in_f: int, dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    # (out, in): the codes dequantized as one row of out*in elements (blocks of the flat weight),
    # by quantmesh's Triton dequantize where kernel4.DEQUANT_ENABLED turns it on (the same values)
    if dequantize_weight_applies(packed, qt, out_f * in_f, dtype):
        return dequantize_weight(packed, absmax, bs, qt, out_f, in_f, dtype)
    flat = torch.ops.bitsandbytes.dequantize_4bit(packed, absmax, bs, qt, [1, out_f * in_f], dtype)
    return flat.view(out_f, in_f)


# x @ W^T with W dequantized over flat blocks, as one opaque op in forward and another in backward:
# like bitsandbytes' MatMul4Bit it keeps only the packed weight for backward (no input, no float
# weight). Two ops rather than an autograd.Function, so that compiled blocks keep that property too:
# traced, the Function's two dequantizations were merged into one whose float weight was saved.
@torch.library.custom_op("quantmesh::flat_matmul_4bit", mutates_args=())
def _flat_matmul_4bit(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, bs: int, qt: str,
                      out_f: int, in_f: int, dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    return x @ _flat_weight(packed, absmax, bs, qt, out_f, in_f, dtype).to(x.dtype).t()


@torch.library.custom_op("quantmesh::flat_matmul_4bit_grad", mutates_args=())
def _flat_matmul_4bit_grad(g: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, bs: int,
                           qt: str, out_f: int, in_f: int, dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    return g @ _flat_weight(packed, absmax, bs, qt, out_f, in_f, dtype).to(g.dtype)


@_flat_matmul_4bit.register_fake
def _(x, packed, absmax, bs, qt, out_f, in_f, dtype):  # (..., in) -> (..., out)
    return x.new_empty((*x.shape[:-1], out_f))


@_flat_matmul_4bit_grad.register_fake
def _(g, packed, absmax, bs, qt, out_f, in_f, dtype):  # (..., out) -> (..., in)
    return g.new_empty((*g.shape[:-1], in_f))


def _flat_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    ctx.save_for_backward(inputs[1], inputs[2])  # the packed codes and the absmax only
    ctx.meta = inputs[3:]


def _flat_backward(ctx: Any, g: torch.Tensor) -> tuple:
    packed, absmax = ctx.saved_tensors
    gx = _flat_matmul_4bit_grad(g, packed, absmax, *ctx.meta) if ctx.needs_input_grad[0] else None
    return (gx,) + (None,) * 7


_flat_matmul_4bit.register_autograd(_flat_backward, setup_context=_flat_setup)


def _set_4bit(module: nn.Module, packed: torch.Tensor, qs: Any, cd: torch.dtype) -> None:
    Params4bit = _bnb().nn.Params4bit
    layer: Any = module  # a bitsandbytes Linear4bit (untyped)
    layer.weight = Params4bit(
        packed, requires_grad=False, quant_state=qs, blocksize=qs.blocksize,
        compress_statistics=qs.nested, quant_type=qs.quant_type, quant_storage=packed.dtype,
        module=module, bnb_quantized=True,
    )  # fmt: skip
    layer.quant_state = qs
    layer.quant_storage = packed.dtype
    layer.compute_dtype, layer.compute_type_is_set = cd, True
    layer.support_avx512bf16_for_cpu = False
    _materialize_bias(module, packed.device)


class Bnb8bitFormat(_BnbFormat):
    """LLM.int8: int8 weight with one absmax scale per output row (bitsandbytes Linear8bitLt).

    On CPU in train mode bitsandbytes dequantizes the weight and ignores the outlier threshold; in
    eval mode (and always on CUDA) it quantizes activations too, with fp16 outlier columns.

    Example:
        >>> fmt = bnb_format(QuantConfig(format="int8"))
        >>> m = fmt.new_linear(64, 32, bias=True, device="cpu", dtype=torch.float32)
        >>> fmt.quantize_into(m, torch.randn(32, 64)); m.weight.dtype
        torch.int8
    """

    name = "int8"

    def new_linear(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> nn.Module:
        """An empty QuantLinear8bit with an int8 (out, in) placeholder weight.

        Example:
            >>> m = bnb_format(QuantConfig(format="int8")).new_linear(
            ...     16, 8, bias=False, device="meta", dtype=torch.float32)
            >>> m.weight.dtype, m.weight.shape
            (torch.int8, torch.Size([8, 16]))
        """
        Int8Params = _bnb().nn.Int8Params
        device = torch.device(device)
        m = _classes()["QuantLinear8bit"](
            in_features, out_features, bias=bias, has_fp16_weights=False,
            threshold=self.config.int8_threshold, device="meta",
        )  # fmt: skip
        m.weight = Int8Params(
            torch.empty((out_features, in_features), dtype=torch.int8, device=device),
            requires_grad=False,
            has_fp16_weights=False,
        )
        if bias:
            m.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype))
        return m

    @torch.no_grad()
    def quantize_into(self, module: nn.Module, weight: torch.Tensor) -> None:
        """Row-wise int8 quantization of the float shard (out, in), on its device.

        Example:
            >>> fmt.quantize_into(m, torch.randn(8, 16))  # doctest: +SKIP
        """
        F, Int8Params = _bnb().functional, _bnb().nn.Int8Params
        _check_shard(module, weight)
        top = float(weight.abs().max()) if weight.numel() else 0.0
        if top > torch.finfo(torch.float16).max:
            raise QuantError(
                f"a weight value of magnitude {top:.3g} overflows float16, which LLM.int8 "
                "quantizes from; skip this layer (QuantConfig(skip=[...])) or use format='nf4'"
            )
        # CB (out, in) int8, SCB (out,) fp32 row absmax; bitsandbytes quantizes from fp16
        cb, scb, _ = F.int8_vectorwise_quant(weight.detach().to(torch.float16).contiguous())
        layer: Any = module  # a bitsandbytes Linear8bitLt (untyped)
        layer.weight = Int8Params(cb, requires_grad=False, has_fp16_weights=False, CB=cb, SCB=scb)
        layer.state.reset_grads()  # drop a previous quantization's CB / SCB
        layer.orig_dtype = weight.dtype
        _materialize_bias(module, weight.device)

    @torch.no_grad()
    def load_state(
        self,
        module: nn.Module,
        cb: torch.Tensor,
        scb: torch.Tensor,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        """Put a stored int8 weight `cb` (out, in) and its row scales `scb` (out,) into `module`,
        moved to `device`; `dtype` is what `dequantize` returns. Nothing is requantized.

        Example:
            >>> fmt.load_state(m, cb, scb, device="cpu")  # doctest: +SKIP
        """
        Int8Params = _bnb().nn.Int8Params
        lin = cast(nn.Linear, module)
        if tuple(cb.shape) != (lin.out_features, lin.in_features) or cb.dtype != torch.int8:
            raise ValueError(
                f"the stored int8 weight is {cb.dtype} {tuple(cb.shape)}, the module expects "
                f"int8 {(lin.out_features, lin.in_features)}; cut it to this rank's rows/columns"
            )
        device = torch.device(device) if device is not None else lin.weight.device
        if device.type == "meta":
            raise ValueError("the module is on meta; pass load_state(..., device=...)")
        cb, scb = cb.to(device), scb.to(device=device, dtype=torch.float32)
        layer: Any = module  # a bitsandbytes Linear8bitLt (untyped)
        layer.weight = Int8Params(cb, requires_grad=False, has_fp16_weights=False, CB=cb, SCB=scb)
        layer.state.reset_grads()
        layer.orig_dtype = dtype
        _materialize_bias(module, device)

    def dequantize(self, module: nn.Module) -> torch.Tensor:
        """CB * SCB / 127 as (out, in), in the dtype the shard had.

        Example:
            >>> fmt.dequantize(m).shape  # doctest: +SKIP
            torch.Size([8, 16])
        """
        return _int8_rows(module)

    def compute_units(self, module: nn.Module, units: int, index: torch.Tensor) -> torch.Tensor:
        """The rows of some of `units` equal groups (experts): only their int8 rows and row
        scales are read. Equal to `compute_weight`'s rows.

        Example:
            >>> fmt.compute_units(q, 4, torch.tensor([2])).shape  # doctest: +SKIP
            torch.Size([16, 64])
        """
        return _int8_rows(module, units, index)

    def bytes_per_param(self, in_features: int | None = None) -> float:
        """1 byte per weight plus an fp32 scale per row, amortized over `in_features`
        (default 1024, an upper bound for typical hidden sizes).

        Example:
            >>> bnb_format(QuantConfig(format="int8")).bytes_per_param(in_features=4096)
            1.0009765625
        """
        return 1.0 + 4 / (in_features or INT8_REF_IN)


# ---- pre-quantized 4-bit tensors ----------------------------------------------------------------
def quant_state_from_tensors(tensors: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, Any]:
    """(packed weight, QuantState) from one Linear4bit's checkpoint keys, module prefix removed.

    Example:
        >>> packed, qs = quant_state_from_tensors(  # doctest: +SKIP
        ...     {k[len(pre):]: v for k, v in sd.items() if k.startswith(pre)})
    """
    QuantState = _bnb().functional.QuantState
    if "weight" not in tensors:
        raise KeyError(f"no 'weight' among the pre-quantized keys {sorted(tensors)}")
    stats = {k[len("weight.") :]: v for k, v in tensors.items() if k.startswith("weight.")}
    if not any(k.startswith("quant_state.") for k in stats):
        raise QuantError(
            f"the keys {sorted(tensors)} hold no 'weight.quant_state.bitsandbytes__nf4' (or fp4) "
            "entry; this is not a bitsandbytes 4-bit checkpoint"
        )
    return tensors["weight"], QuantState.from_dict(dict(stats), device=torch.device("cpu"))


def _float_absmax(F: Any, qs: Any) -> torch.Tensor:
    # (n_blocks,) fp32, computed exactly as bitsandbytes' own dequantize_4bit does for nested stats
    if not qs.nested:
        return qs.absmax
    return F.dequantize_blockwise(qs.absmax, qs.state2) + qs.offset


def _int8_rows(
    module: nn.Module, units: int = 1, index: torch.Tensor | None = None
) -> torch.Tensor:
    """CB * SCB / 127 in the dtype the shard had: every row, or the rows of the groups `index` of
    `units` equal groups of rows (only their int8 rows and scales read)."""
    w = module.weight
    scb = getattr(w, "SCB", None)
    if scb is None:
        raise RuntimeError(_not_quantized(module))
    cb, scales = cast(torch.Tensor, w.data), scb.to(w.device)
    if index is not None:
        cb = cb.view(units, -1, cb.shape[-1]).index_select(0, index).flatten(0, 1)
        scales = scales.view(units, -1).index_select(0, index).flatten()
    out = _bnb().functional.int8_vectorwise_dequant(cb, scales)
    return out.to(getattr(module, "orig_dtype", torch.float32))
