"""The library's options as plain dataclasses, the rules between their values, and the errors for
breaking them; torch-free, so that the command line can build its flags from these classes
(`quantmesh --help` imports no torch).

Each option is documented by the string under its field. `quantmesh finetune` turns every field
of the classes it is made of into a flag and a TOML key (cli/flags.py): a field added here is an
option there, with its docstring as the help and its `metadata["choices"]` (one of the constant
tuples below) as the choices. Every rule is written once, here: a class checks its own fields in
`__post_init__`; a rule between the options of two classes, or between an option and what only the
running code knows (the mesh, the number of stages), is a `check_*` function that both the library
and the command line call.

- `LoraConfig`: the adapters (`qm.parallelize(lora=...)`).
- `PipelineConfig`: how a model is cut into pp stages (`qm.parallelize(pipeline=...)`).
- `ParallelConfig`: the mesh sizes and `parallelize`'s other choices as plain values (quantization
  of the base by name, FSDP).
- `TrainConfig`: the training loop (`quantmesh.train.loop.train`).

Example:
    >>> TrainConfig(steps=30, lr=2e-3).schedule
    'cosine'
    >>> ParallelConfig(tp=2, quant="nf4").quant_backend
    'bitsandbytes'
"""

from __future__ import annotations

import contextlib
import fnmatch
import logging
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

from .errors import QuantmeshError
from .quant.names import BACKENDS, FORMATS, QUANTS

__all__ = [
    "LR_SCHEDULES",
    "PP_SCHEDULES",
    "ConfigError",
    "FsdpError",
    "LoraConfig",
    "LoraError",
    "ParallelConfig",
    "PipelineConfig",
    "PipelineError",
    "QuantError",
    "TrainConfig",
    "TrainError",
    "check_fsdp_options",
    "check_offload_base",
    "check_pp_schedule",
    "check_quant",
    "compile_options",
    "env_switch",
    "lora_scale",
]

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b")
"""The pipeline schedules at pp > 1: GPipe and 1F1B (one stage per rank), Interleaved 1F1B
(several stages per rank, `PipelineConfig(virtual=...)`)."""
LR_SCHEDULES = ("cosine", "linear", "constant")
"""The learning rate after warm-up: cosine or linear decay to 0 at the last step, or constant."""
CUDA_GRAPHS = ("captured", "trees")
"""How the server's compiled slot step becomes CUDA graphs (the first is the default):
"captured", compiled without CUDA graph trees and captured per (batch, key length) into a
`torch.cuda.CUDAGraph` that each step replays with no host work; "trees", inductor's CUDA graph
trees (mode reduce-overhead: dynamo's guards and the graph's input checks run on the host every
step; captured is the faster: docs/benchmarks.md, "Figures the code relies on")."""
COMPILE_BACKEND_ENV = "QUANTMESH_COMPILE_BACKEND"
"""The environment variable naming torch.compile's backend for every compile quantmesh makes."""


def compile_options(mode: str | None = None, backend: str | None = None) -> dict:
    """torch.compile's `backend` (and `mode`) for a compile quantmesh makes (`compile_blocks`,
    the decode step of `fast_decode` and `generate --fast`, the server's slot steps, `finetune
    --compile`): `backend` when given, else $QUANTMESH_COMPILE_BACKEND, else "inductor". A mode
    (CUDA graphs, autotuning) is inductor's: another backend compiles without it, as documented
    under that variable. `make test` sets "aot_eager" on CPU ranks: dynamo's tracing and AOT
    autograd's graphs (what quantmesh's code meets) without inductor's C++ code generation; the
    tests of inductor's own choices (what compiled blocks save, compiled tiles' memory and
    gradients) name "inductor" themselves.

    Example:
        >>> compile_options("reduce-overhead", backend="inductor")
        {'backend': 'inductor', 'mode': 'reduce-overhead'}
        >>> compile_options("reduce-overhead", backend="aot_eager")
        {'backend': 'aot_eager'}
    """
    backend = backend or os.environ.get(COMPILE_BACKEND_ENV) or "inductor"
    if backend == "inductor" and mode is not None:
        return {"backend": backend, "mode": mode}
    return {"backend": backend}


class ConfigError(QuantmeshError, ValueError):
    """An option out of its range (a mesh size below 1); the message names the fix."""


@contextlib.contextmanager
def quiet_loggers(
    *names: str, level: int = logging.ERROR, children: bool = False
) -> Iterator[None]:
    """The loggers `names` (with `children`, every logger below them made so far too, as torch
    sets a level on each of its own) at `level` while the context lasts, as they were after.

    Example:
        >>> with quiet_loggers("torchao"):
        ...     pass
    """
    all_names = list(names)
    if children:
        made = logging.root.manager.loggerDict
        all_names += [n for n in made if any(n.startswith(f"{p}.") for p in names)]
    loggers = [logging.getLogger(n) for n in all_names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(level)
    try:
        yield
    finally:
        for lg, old in zip(loggers, levels, strict=True):
            lg.setLevel(old)


def env_switch(name: str, default: bool) -> bool:
    """An on/off environment variable: "1" on, "0" off, unset or "" `default`; anything else is
    refused (ConfigError naming the variable), never read as either.

    Example:
        >>> env_switch("QUANTMESH_NO_SUCH_SWITCH", default=True)
        True
    """
    value = os.environ.get(name, "")
    if value not in ("", "0", "1"):
        raise ConfigError(f"{name}={value!r}; expected 1 (on) or 0 (off)")
    return default if value == "" else value == "1"


class QuantError(QuantmeshError, ValueError):
    """A quantization request that cannot be honoured; the message names the fix."""


class LoraError(QuantmeshError, ValueError):
    """A LoRA request that cannot be honoured; the message names the fix."""


class PipelineError(QuantmeshError, ValueError):
    """A model or a call the pipeline cannot run as asked; the message names the fix."""


class FsdpError(QuantmeshError, ValueError):
    """An fsdp request that cannot be honoured exactly; the message names the fix."""


class TrainError(QuantmeshError, ValueError):
    """A training request that cannot run as given (batch, micro-batches, schedule, run length);
    the message names the fix."""


def _positive_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def check_quant(format: str | None, backend: str) -> None:
    """Raise QuantError unless `format` (None: no quantization) and `backend` name a quantized base
    quantmesh has. The rule of `QuantConfig` and `ParallelConfig` alike.

    Example:
        >>> check_quant("nf4", "torchao")
        >>> check_quant("fp4", "torchao")
        Traceback (most recent call last):
        quantmesh.config.QuantError: torchao has no fp4 format here; use format='nf4' or backend='bitsandbytes'
    """
    if format is not None and format not in FORMATS:
        raise QuantError(f"quant format {format!r} is unknown; use one of {', '.join(FORMATS)}")
    if backend not in BACKENDS:
        raise QuantError(f"quant backend {backend!r} is unknown; use one of {', '.join(BACKENDS)}")
    if backend == "torchao" and format == "fp4":
        raise QuantError(
            "torchao has no fp4 format here; use format='nf4' or backend='bitsandbytes'"
        )


def check_offload_base(*, fsdp: bool, offload_base: bool) -> None:
    """Raise FsdpError when the base is to be offloaded without FSDP (it offloads FSDP's shards).

    Example:
        >>> check_offload_base(fsdp=True, offload_base=True)
    """
    if offload_base and not fsdp:
        raise FsdpError(
            "offload_base=True offloads FSDP's shards of the base; pass fsdp=True too "
            "(CLI: --offload-base needs --fsdp)"
        )


def check_keep_dequantized(*, quant: str | None, backend: str) -> None:
    """Raise QuantError when weights are to be held dequantized without a base of bitsandbytes'
    4-bit linears (`quant`: the format, None for an unquantized base), the only layers that hold
    one (`qm.keep_dequantized`).

    Example:
        >>> check_keep_dequantized(quant="nf4", backend="bitsandbytes")
    """
    if not (quant in ("nf4", "fp4") and backend == "bitsandbytes"):
        raise QuantError(
            f"keep_dequantized with quant={quant!r}, quant_backend={backend!r}: only "
            "bitsandbytes' 4-bit linears (nf4, fp4) hold a dequantized weight; pass --quant nf4 "
            "(or fp4) with --quant-backend bitsandbytes, or leave --keep-dequantized out (API: "
            "keep_dequantized=False)"
        )


def check_fsdp_options(*, pp: int, quant: str | None, backend: str) -> None:
    """Raise FsdpError when fsdp cannot shard this layout exactly: pipeline stages, or a base that
    bitsandbytes quantizes (`quant`: its format, None for an unquantized base).

    Example:
        >>> check_fsdp_options(pp=1, quant="nf4", backend="torchao")
    """
    if pp > 1:
        raise FsdpError(
            f"fsdp=True with pp={pp}: sharding pipeline stages over dp is not implemented; "
            "use pp=1 with fsdp (dp x tp), or pp > 1 without it"
        )
    if quant is not None and backend == "bitsandbytes":
        raise FsdpError(
            f"fsdp=True cannot shard bitsandbytes {quant}: its weights keep their "
            "statistics beside the tensor (Params4bit.quant_state / Int8Params.SCB), which FSDP2's "
            "all-gather drops. Use torchao, whose tensors shard exactly: "
            f"quant=qm.QuantConfig(format={quant if quant != 'fp4' else 'nf4'!r}, "
            "backend='torchao') (CLI: --quant-backend torchao"
            + (" --quant nf4: torchao has no fp4)" if quant == "fp4" else ")")
        )


def check_pp_schedule(
    schedule: str, *, pp: int, microbatches: int | None = None, virtual: int | None = None
) -> None:
    """Raise PipelineError unless pipeline schedule `schedule` can run `microbatches` per step
    over `pp` ranks holding `virtual` stages each (None: not known here, not checked).

    Example:
        >>> check_pp_schedule("1f1b", pp=2, microbatches=4, virtual=1)
        >>> check_pp_schedule("gpipe", pp=4, microbatches=1)
    """
    if schedule not in PP_SCHEDULES:
        raise PipelineError(f"schedule={schedule!r}; use one of {', '.join(PP_SCHEDULES)}")
    if virtual is not None and virtual > 1 and schedule != "interleaved1f1b":
        raise PipelineError(
            f"schedule={schedule!r} with {virtual} stages per rank: use "
            f"schedule='interleaved1f1b' (CLI: --pp-schedule interleaved1f1b with --pp-virtual "
            f"{virtual})"
        )
    if virtual is not None and virtual < 2 and schedule == "interleaved1f1b":
        raise PipelineError(
            "schedule='interleaved1f1b' needs several stages on every rank: parallelize with "
            "pipeline=qm.PipelineConfig(virtual=2) or more (CLI: --pp-virtual 2 or more)"
        )
    if microbatches is not None and pp > 1 and schedule != "gpipe" and microbatches < pp:
        raise PipelineError(
            f"schedule={schedule!r} needs microbatches >= pp ranks ({microbatches} < {pp}); use "
            f"microbatches={pp} or more, or schedule='gpipe' (CLI: --pp-schedule {schedule} "
            f"needs --grad-accum >= --pp: {microbatches} < {pp}; pass --grad-accum {pp} or "
            "--pp-schedule gpipe)"
        )


# "every projection": attention (q, k, v, o; DeepSeek's multi-head latent attention), MLP, and
# the fused expert tensors of transformers' experts modules (gate_up_proj, down_proj)
DEFAULT_TARGETS = (
    "q_proj", "k_proj", "v_proj", "o_proj",
    "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
    "gate_proj", "up_proj", "down_proj", "gate_up_proj",
)  # fmt: skip


def lora_scale(alpha: float, r: int, rslora: bool = False) -> float:
    """The factor on an adapter's output: alpha / r, or alpha / sqrt(r) for rsLoRA (PEFT's).

    Example:
        >>> lora_scale(32, 16), lora_scale(32, 16, rslora=True)
        (2.0, 8.0)
    """
    return alpha / math.sqrt(r) if rslora else alpha / r


ALL_LINEAR = "all-linear"  # PEFT's target: every linear layer but the output head


@dataclass(kw_only=True)
class LoraConfig:
    """Low-rank adapters on linear layers (plain or quantized), sharded to follow the base layer.

    Example:
        >>> LoraConfig(r=16, alpha=32, dropout=0.05, targets=["q_proj", "v_proj"])
        LoraConfig(r=16, alpha=32, ...)
    """

    r: int = 16
    """Rank of the adapter (A is r x in, B is out x r)."""
    alpha: float = 32
    """Scale numerator: the adapter's output is multiplied by alpha / r."""
    dropout: float = 0.0
    """Dropout on the adapter's input (training only)."""
    targets: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    """Module names (a bare name matches any module of that name) or globs on full names; a
    name also selects the expert tensors of that name (`gate_up_proj`, `down_proj` of an experts
    module), and an experts module's own name selects all of its expert tensors; "all-linear" is
    PEFT's shorthand for every linear layer but the output head. The default,
    every projection of the common families (attention, MLA, MLP, experts), skips names a model
    does not have; names given explicitly must each match something."""
    seed: int = 0
    """Seed of A's initialization; the same seed gives the same adapters at any tp size."""
    rslora: bool = False
    """Rank-stabilized LoRA (PEFT's `use_rslora`): the output is multiplied by alpha / sqrt(r)
    instead of alpha / r."""

    def __post_init__(self) -> None:
        if not _positive_int(self.r):
            raise LoraError(f"LoRA rank r={self.r!r}; use a positive int such as 8 or 16")
        if not 0.0 <= self.dropout < 1.0:
            raise LoraError(f"LoRA dropout={self.dropout}; use a value in [0, 1)")
        if isinstance(self.targets, str):
            self.targets = [self.targets]
        if not self.targets:
            raise LoraError("LoRA targets is empty; name modules such as ['q_proj', 'v_proj']")
        self.targets = list(self.targets)

    @property
    def scaling(self) -> float:
        return lora_scale(self.alpha, self.r, self.rslora)

    @property
    def default_targets(self) -> bool:
        """Whether `targets` are the default (every projection a model has), not names given."""
        return sorted(self.targets) == sorted(DEFAULT_TARGETS)

    def matches(self, fqn: str) -> bool:
        last = fqn.rsplit(".", 1)[-1]
        return any(t == last or t == fqn or fnmatch.fnmatchcase(fqn, t) for t in self.targets)


@dataclass(kw_only=True)
class PipelineConfig:
    """How `qm.parallelize` cuts a model into the mesh's pp stages.

    Example:
        >>> PipelineConfig(stages=[3, 1]).stages   # 3 blocks on stage 0, 1 on stage 1
        [3, 1]
    """

    stages: list[int] | None = None
    """Blocks per stage, in order (sums to the model's block count); None = balanced by compute:
    consecutive runs of blocks whose largest stage cost is least, a block's cost being its matmul
    weights (the FLOPs per token of a frozen base are proportional to them) and the last stage's
    also the output head's (equal blocks and a small head: equal counts, extras on the first
    stages)."""
    virtual: int = 1
    """Pipeline stages per rank: pp x virtual stages, stage s on pp rank s mod pp (the
    interleaved1f1b schedule needs 2 or more, the others 1)."""

    def __post_init__(self) -> None:
        if not _positive_int(self.virtual):
            raise PipelineError(f"PipelineConfig(virtual={self.virtual!r}); use an int >= 1")


@dataclass(kw_only=True)
class ParallelConfig:
    """The mesh sizes (`qm.init_mesh`) and `qm.parallelize`'s other choices as plain values: the
    quantization of the frozen base by name, FSDP. The rules between them are checked here.

    Example:
        >>> ParallelConfig(tp=2, quant="nf4", quant_backend="torchao", fsdp=True).quant
        'nf4'
    """

    tp: int = 1
    """Tensor-parallel size: ranks that split each layer."""
    pp: int = 1
    """Pipeline-parallel stages (whole decoder layers per stage); tp x pp x dp processes."""
    dp: int | None = None
    """Data-parallel size; None = the processes left over by tp x pp."""
    quant: str = field(default="none", metadata={"choices": QUANTS})
    """Quantization of the frozen base: none, or a format (nf4, fp4, int8)."""
    quant_backend: str = field(default=BACKENDS[0], metadata={"choices": BACKENDS})
    """Library of the quantized base: bitsandbytes, or torchao (NF4Tensor: the one fsdp shards)."""
    fsdp: bool = False
    """Shard the frozen base and the adapters over dp with torch's FSDP2, one layer at a time."""
    offload_base: bool = False
    """With fsdp: keep the layers' shards of the base in host memory."""
    keep_dequantized: bool = False
    """bitsandbytes nf4/fp4: also hold each 4-bit weight dequantized (qm.keep_dequantized): no
    dequantization in any matmul, forward or backward, for 4x the codes' memory (bf16)."""
    keep_dequantized_blocks: int | None = None
    """With keep_dequantized: hold only the first this many decoder layers' weights (for the
    memory a run has left); None = every 4-bit weight. The memory check counts what they take."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp"):
            if not _positive_int(getattr(self, name)):
                raise ConfigError(f"{name}={getattr(self, name)!r}; expected an integer >= 1")
        if self.dp is not None and not _positive_int(self.dp):
            raise ConfigError(
                f"dp={self.dp!r}; expected an integer >= 1, or None (unset) for the processes "
                "tp x pp leave"
            )
        if self.quant not in QUANTS:
            raise QuantError(f"quant={self.quant!r}; use one of {', '.join(QUANTS)}")
        check_quant(None if self.quant == "none" else self.quant, self.quant_backend)
        check_offload_base(fsdp=self.fsdp, offload_base=self.offload_base)
        if self.fsdp:
            quant = None if self.quant == "none" else self.quant
            check_fsdp_options(pp=self.pp, quant=quant, backend=self.quant_backend)
        if self.keep_dequantized:
            check_keep_dequantized(quant=self.quant, backend=self.quant_backend)
        if self.keep_dequantized_blocks is not None:
            v = self.keep_dequantized_blocks
            if not _positive_int(v):
                raise ConfigError(
                    f"keep_dequantized_blocks={v!r}; expected an integer >= 1 (how many decoder "
                    "layers' weights to hold; leave it out for all)"
                )
            if not self.keep_dequantized:
                raise ConfigError(
                    f"keep_dequantized_blocks={v} without keep_dequantized: it says how many "
                    "layers' weights to hold; add --keep-dequantized, or leave "
                    "--keep-dequantized-blocks out"
                )


@dataclass(kw_only=True)
class TrainConfig:
    """How to train: batch, schedule, length, evaluation and checkpoints.

    Example:
        >>> TrainConfig(steps=30, lr=2e-3, warmup_steps=3).schedule
        'cosine'
    """

    micro_batch: int = 1
    """Examples per forward pass on each data-parallel rank."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step; at pp > 1, the pipeline's micro-batches."""
    lr: float = 2e-4
    """Peak learning rate (AdamW)."""
    weight_decay: float = 0.0
    """AdamW weight decay of the adapters."""
    warmup_steps: int = 0
    """Steps of linear warm-up from 0 to lr."""
    schedule: str = field(default="cosine", metadata={"choices": LR_SCHEDULES})
    """The learning rate after warm-up: cosine or linear decay to 0 at the last step, or
    constant."""
    steps: int | None = None
    """Optimizer steps to run; None = `epochs` passes over the training examples."""
    epochs: float | None = None
    """Passes over the training data when steps is not given (default 1)."""
    eval_every: int = 0
    """Evaluate every N steps and at the end; 0 = only at the end (when there is eval data)."""
    save_every: int = 0
    """Save the adapter and resumable state every N steps; 0 = only at the end."""
    seed: int = 0
    """Seed of the data order, the LoRA initialization and the per-step RNG (dropout)."""
    max_grad_norm: float = 1.0
    """Clip the adapters' global gradient norm to this; 0 = no clipping."""
    progress: bool = True
    """A progress bar (tqdm) on global rank 0."""
    pp_schedule: str = field(default="1f1b", metadata={"choices": PP_SCHEDULES})
    """At pp > 1: the pipeline schedule of each step's grad_accum micro-batches: 1f1b (needs
    grad_accum >= pp) or gpipe with one stage per rank, interleaved1f1b with several."""
    loss_chunk_tokens: int = 1024
    """Tokens per chunk of the loss (head + cross-entropy run chunk by chunk: at most this many
    rows of logits at once; a frozen head's gradient is made in the forward, a trained or tp-split
    head's chunks are recomputed in backward); 0 = the plain loss on the whole logits.
    At pp > 1 the pipeline's last stage computes the plain loss whatever this says."""

    def __post_init__(self) -> None:
        if not (_positive_int(self.micro_batch) and _positive_int(self.grad_accum)):
            raise TrainError(
                f"micro_batch={self.micro_batch}, grad_accum={self.grad_accum}; both >= 1"
            )
        if self.schedule not in LR_SCHEDULES:
            raise TrainError(f"schedule={self.schedule!r}; use one of {', '.join(LR_SCHEDULES)}")
        if self.steps is not None and not _positive_int(self.steps):
            raise TrainError(f"steps={self.steps}; expected >= 1 (or None for epochs)")
        if self.epochs is not None and not self.epochs > 0:
            raise TrainError(f"epochs={self.epochs}; expected a positive number")
        if not self.lr > 0:
            raise TrainError(f"lr={self.lr}; expected a positive learning rate such as 2e-4")
        for name in ("warmup_steps", "eval_every", "save_every", "seed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise TrainError(f"{name}={v!r}; expected an integer >= 0")
        if self.max_grad_norm < 0 or self.weight_decay < 0:
            raise TrainError(
                f"max_grad_norm={self.max_grad_norm}, weight_decay={self.weight_decay}; both "
                ">= 0 (max_grad_norm=0 turns clipping off)"
            )
        if self.pp_schedule not in PP_SCHEDULES:
            raise TrainError(
                f"pp_schedule={self.pp_schedule!r}; use one of {', '.join(PP_SCHEDULES)}"
            )
        if self.loss_chunk_tokens < 0:
            raise TrainError(f"loss_chunk_tokens={self.loss_chunk_tokens}; expected >= 0 (0 = off)")
