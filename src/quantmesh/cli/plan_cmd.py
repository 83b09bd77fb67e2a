"""`quantmesh plan MODEL --tp N`: the plan table and the bytes per GPU, from config.json alone.

No weights are read and no workers start: the model is built on the meta device from its config,
planned, and measured by `quantmesh.plan.memory.estimate_memory`. The helpers here (the skeleton, the
memory check) are shared by `finetune` and `generate`, which run them before launching.

Example:
    $ quantmesh plan ~/.cache/quantmesh/SmolLM2-135M-Instruct --tp 2 --quant nf4 --lora-r 16
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import PP_SCHEDULES, LoraConfig, PipelineConfig
from ..quant.names import BACKENDS, QUANTS
from .errors import CliError, user_errors

if TYPE_CHECKING:
    from ..pipeline.memory import StageMemory
    from ..plan.memory import MemoryEstimate

__all__ = [
    "RunShape",
    "add_parser",
    "check_memory",
    "device_budget",
    "load_skeleton",
    "memory_alternatives",
    "run",
]

CPU_RUNTIME_BYTES = 1 << 30  # a CPU worker's python, torch, transformers and bitsandbytes (~1 GiB)
CUDA_RUNTIME_BYTES = 3 << 29  # CUDA context (~0.5 GiB), cuBLAS / NCCL workspaces, fragmentation


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def check_tokenizer(model_dir: str | Path) -> None:
    """CliError when the model folder holds no tokenizer (finetune, generate and serve need one;
    transformers' own error, deep in a worker, does not say what is missing).

    Example:
        >>> check_tokenizer("SmolLM2-135M-Instruct")  # doctest: +SKIP
    """
    path = Path(model_dir).expanduser()
    if path.is_dir() and not any((path / n).is_file() for n in TOKENIZER_FILES):
        raise CliError(
            f"model folder {str(path)!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
            "save the tokenizer next to the model (tokenizer.save_pretrained(folder))"
        )


def load_skeleton(model_dir: str | Path):
    """(config, model on meta) of a transformers folder; CliError when it is not one.

    Example:
        >>> cfg, model = load_skeleton("SmolLM2-135M-Instruct")  # doctest: +SKIP
        >>> next(model.parameters()).device
        device(type='meta')
    """
    path = Path(model_dir).expanduser()
    if not path.exists():
        raise CliError(
            f"model folder {str(path)!r} does not exist; pass a folder written by "
            "save_pretrained (config.json, weights, tokenizer)"
        )
    if not path.is_dir():
        raise CliError(f"model {str(path)!r} is a file; pass the folder that holds config.json")
    if not (path / "config.json").is_file():
        raise CliError(
            f"model folder {str(path)!r} has no config.json (it holds: "
            f"{', '.join(sorted(p.name for p in path.iterdir())[:8]) or 'nothing'}); expected a "
            "transformers model folder written by save_pretrained"
        )
    try:
        json.loads((path / "config.json").read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise CliError(f"{path / 'config.json'} is not valid JSON ({e})") from None
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..io.prequant import folder_quant
    from ..parallel.empty import empty_model

    folder_quant(path, None)  # a quantization method quantmesh cannot read: QuantError, the fix

    try:
        config = AutoConfig.from_pretrained(path)
        with empty_model():
            model = AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError) as e:
        raise CliError(
            f"{path / 'config.json'} does not describe a causal LM transformers can build: "
            f"{str(e).splitlines()[0]}"
        ) from None
    return config, model


def device_budget(nproc_local: int) -> tuple[str, int, str]:
    """(device kind, bytes one rank may use, where the figure comes from) on this machine.

    CUDA: the smallest total memory of the first `nproc_local` GPUs less CUDA_RUNTIME_BYTES (read
    from the device properties: this process creates no CUDA context, which would hold memory on
    every GPU while the workers train). CPU: available RAM shared by the local ranks, less
    CPU_RUNTIME_BYTES per rank.

    Example:
        >>> device_budget(2)  # doctest: +SKIP
        ('cpu', 11274289152, 'available RAM 23.1 GiB / 2 rank(s), less 1.00 GiB runtime each')
    """
    import torch

    from ..plan.memory import format_bytes

    if torch.cuda.is_available():
        n = min(nproc_local, torch.cuda.device_count())
        total = min(torch.cuda.get_device_properties(i).total_memory for i in range(n))
        return (
            "cuda",
            int(total - CUDA_RUNTIME_BYTES),
            f"the smallest of {n} GPU(s), {format_bytes(total)}, less "
            f"{format_bytes(CUDA_RUNTIME_BYTES)} for the CUDA context and workspaces",
        )
    import psutil

    avail = psutil.virtual_memory().available
    per = avail // max(1, nproc_local) - CPU_RUNTIME_BYTES
    return (
        "cpu",
        int(per),
        f"available RAM {format_bytes(avail)} / {nproc_local} rank(s), less "
        f"{format_bytes(CPU_RUNTIME_BYTES)} runtime each",
    )


@dataclass(frozen=True, kw_only=True, eq=False)
class RunShape:
    """One run as the memory estimate sees it: the model (a meta skeleton), its layout over the
    ranks, and what each step holds. `quantmesh plan` builds one from its flags (`shape_of_args`),
    `quantmesh finetune` from its FinetuneConfig; every estimate and proposal here reads it, and a
    proposal is this shape with a few fields changed (`but`).

    Example:
        >>> shape = RunShape(model=skeleton, lora=qm.LoraConfig(r=16), seq_len=4096)  # doctest: +SKIP
        >>> shape.but(checkpointing=True).estimate().total < shape.estimate().total  # doctest: +SKIP
        True
    """

    model: Any
    """The model, built on the meta device (only shapes are read)."""
    plan: Any = None
    """Its tp Plan (None: auto_plan)."""
    tp: int = 1
    dp: int = 1
    pp: int = 1
    quant: Any = None
    """None, a format name or a QuantConfig (as parallelize takes it)."""
    lora: LoraConfig | None = None
    """The adapters trained; None: a forward-only run."""
    fsdp: bool = False
    offload_base: bool = False
    seq_len: int = 2048
    micro_batch: int = 1
    dtype: Any = None
    """The weights' and activations' dtype: torch.bfloat16 on GPUs; None: float32."""
    compiled: bool = False
    checkpointing: bool = False
    offload_activations: bool = False
    loss_chunk_tokens: int = 0
    tile_tokens: int | None = None
    checkpointed_blocks: int | None = None
    keep_dequantized: bool = False
    """The 4-bit weights also held dequantized (`qm.keep_dequantized`)."""
    held_blocks: int | None = None
    """With keep_dequantized: only the first this many decoder layers' (None: all)."""
    microbatches: int = 1
    """At pp > 1: micro-batches per step, each of micro_batch rows."""
    pp_schedule: str = "1f1b"
    pipeline: PipelineConfig | None = None

    def but(self, **changes: Any) -> RunShape:
        """This shape with `changes` (a layout to propose)."""
        return dataclasses.replace(self, **changes)

    def _options(self) -> dict[str, Any]:
        """What each step does, as estimate_memory's keywords."""
        import torch

        return dict(
            seq_len=self.seq_len,
            micro_batch=self.micro_batch,
            dtype=self.dtype if self.dtype is not None else torch.float32,
            compiled=self.compiled,
            checkpointing=self.checkpointing,
            offload_activations=self.offload_activations,
            loss_chunk_tokens=self.loss_chunk_tokens,
            tile_tokens=self.tile_tokens or None,
            checkpointed_blocks=self.checkpointed_blocks,
            keep_dequantized=self.keep_dequantized,
            held_blocks=self.held_blocks,
        )

    def estimate(self) -> MemoryEstimate:
        """quantmesh.plan.memory.estimate_memory of the whole model on one rank."""
        from ..plan.memory import estimate_memory

        return estimate_memory(
            self.model,
            tp=self.tp,
            dp=self.dp,
            plan=self.plan,
            quant=self.quant,
            lora=self.lora,
            fsdp=self.fsdp,
            offload_base=self.offload_base,
            **self._options(),
        )

    def stages(self) -> list[StageMemory]:
        """quantmesh.pipeline.memory.estimate_stages: one estimate per pp rank (the pipelined
        step's loss is the plain one, whatever loss_chunk_tokens says: train_step)."""
        from ..pipeline.memory import estimate_stages

        return estimate_stages(
            self.model,
            pp=self.pp,
            microbatches=self.microbatches,
            schedule=self.pp_schedule,
            pipeline=self.pipeline,
            tp=self.tp,
            dp=self.dp,
            plan=self.plan,
            quant=self.quant,
            lora=self.lora,
            **{**self._options(), "loss_chunk_tokens": 0},
        )

    def fullest(self) -> MemoryEstimate:
        """The estimate of the rank that needs the most: the one rank at pp = 1, else the fullest
        pp rank."""
        if self.pp == 1:
            return self.estimate()
        return max((r.estimate for r in self.stages()), key=lambda e: e.total)


TILE_TOKENS = 8192
"""The MLP tile proposed for long sequences (docs/benchmarks.md, "Figures the code relies on")."""


PARTIAL_MARGIN = 0.10
"""The share of the budget a proposed partial checkpointing leaves free. It is chosen to sit just
under the budget, where the estimate's error and the allocator's fragmentation decide: a run
estimated just under its GPU's cap ran out of memory, one layer more recomputed trained
(docs/benchmarks.md, "Figures the code relies on")."""


def memory_alternatives(shape: RunShape, *, budget: int | None = None) -> list[tuple[str, int]]:
    """[(flags, estimated bytes per rank)] of the layouts that need less memory than the training
    run `shape`, cheapest in speed first: with `budget` (bytes per rank), the fewest checkpointed
    layers that fit it (`fewest_checkpointed`); then checkpointing every layer, its saved inputs
    offloaded, MLP tiles (for sequences over two tiles), then FSDP and FSDP with the base
    offloaded (each with the run's own activation settings). Forward-only runs (no LoRA) get none.

    Example:
        >>> memory_alternatives(shape, budget=2**34)[0]  # doctest: +SKIP
        ('--checkpointing --checkpoint-blocks 12', 17112760320)
    """
    from ..parallel.fsdp import fsdp_blocked_by

    if shape.lora is None:
        return []
    if shape.keep_dequantized:  # the held weights first: they are the run's own choice of speed
        plain = shape.but(keep_dequantized=False, held_blocks=None)
        most = most_held(shape, budget) if budget is not None else None
        fewer = (
            [(f"--keep-dequantized-blocks {most[0]}", most[1])]
            if most is not None and most[0] != shape.held_blocks
            else []
        )
        return [
            *fewer,
            ("without --keep-dequantized", plain.estimate().total),
            *memory_alternatives(plain, budget=budget),
        ]
    out: list[tuple[str, int]] = []
    partial = shape.checkpointed_blocks is not None
    if budget is not None and (not shape.checkpointing or partial):
        fewest = fewest_checkpointed(shape, budget)
        if fewest is not None and fewest[0] != shape.checkpointed_blocks:
            k, t = fewest
            out.append((f"--checkpointing --checkpoint-blocks {k}", t))
    steps: list[tuple[str, dict[str, Any]]] = []
    every = {"checkpointing": True, "checkpointed_blocks": None}
    if not shape.checkpointing or partial:
        steps.append(("--checkpointing", every))
    ckpt_off = {**every, "offload_activations": True}
    if not shape.offload_activations or partial:
        steps.append(("--checkpointing --offload-activations", ckpt_off))
    if not shape.tile_tokens and shape.seq_len * shape.micro_batch > 2 * TILE_TOKENS:
        flags = f"--checkpointing --offload-activations --tile-tokens {TILE_TOKENS}"
        steps.append((flags, {**ckpt_off, "tile_tokens": TILE_TOKENS}))
    out += [(flags, shape.but(**kw).estimate().total) for flags, kw in steps]
    if not shape.fsdp and fsdp_blocked_by(shape.model) is None:
        for flags, off in (("--fsdp", False), ("--fsdp --offload-base", True)):
            out.append((flags, shape.but(fsdp=True, offload_base=off).estimate().total))
    return out


def _layers_and_fit(shape: RunShape, budget: int, least: int) -> tuple[int, int] | None:
    """(decoder layers, bytes an estimate may reach): what `most_held` and `fewest_checkpointed`
    search over, `budget` less PARTIAL_MARGIN; None for a run without adapters (a partial layout
    is for training) or with fewer than `least` layers."""
    from ..plan.auto import blocks_of

    n = len(blocks_of(shape.model))
    if n < least or shape.lora is None:
        return None
    return n, int(budget * (1 - PARTIAL_MARGIN))


def most_held(shape: RunShape, budget: int) -> tuple[int, int] | None:
    """(k, estimated bytes): the most decoder layers whose 4-bit weights the training run `shape`
    can hold dequantized (`--keep-dequantized-blocks k`, the run's other settings as they are)
    and fit `budget` bytes per rank with PARTIAL_MARGIN to spare; None when not even one fits.
    Each layer held adds its weights, so a bisection finds it.

    Example:
        >>> most_held(shape, 24 * 2**30)  # doctest: +SKIP
        (11, 23084769280)
    """
    space = _layers_and_fit(shape, budget, least=1)
    if space is None:
        return None
    n, fit = space

    def total(k: int) -> int:
        return shape.but(keep_dequantized=True, held_blocks=k).estimate().total

    # how many of 1..n fit: the totals grow with k, so the first that does not fit, found by a
    # bisection, is one past the most that fit
    k = bisect.bisect_left(range(1, n + 1), True, key=lambda k: total(k) > fit)
    return (k, total(k)) if k else None


def fewest_checkpointed(shape: RunShape, budget: int) -> tuple[int, int] | None:
    """(k, estimated bytes): the fewest decoder layers to checkpoint (of all but the last:
    recompute.spread) for the training run `shape` to fit `budget` bytes per rank with
    PARTIAL_MARGIN to spare, with the run's offload and tile settings; None when even all but one
    do not. The estimate falls by one layer's activations per layer checkpointed, so a bisection
    finds it.

    Example:
        >>> fewest_checkpointed(shape, 24 * 2**30)  # doctest: +SKIP
        (14, 25518190592)
    """
    space = _layers_and_fit(shape, budget, least=2)
    if space is None:
        return None
    n, fit = space

    def total(k: int) -> int:
        return shape.but(checkpointing=True, checkpointed_blocks=k).estimate().total

    if total(n - 1) > fit:
        return None
    # the totals fall as k grows: the first k of 1..n-1 that fits, by a bisection
    k = 1 + bisect.bisect_left(range(1, n), True, key=lambda k: total(k) <= fit)
    return k, total(k)


def _why(flags: str) -> str:
    """What the last mechanism `flags` turns on does, for an error message."""
    if flags.startswith("without --keep-dequantized"):
        return "each matmul dequantizes its weight again, in forward and in backward"
    if flags.startswith("--keep-dequantized-blocks"):
        return "the other layers' matmuls dequantize their weights again, forward and backward"
    if flags.startswith("--fsdp"):
        return (
            "the base sharded over dp, gathered one layer at a time; --quant-backend torchao "
            "for a quantized base"
        )
    if "--checkpoint-blocks" in flags:
        return "that many layers recomputed in backward, the others keep their activations"
    if "--tile-tokens" in flags:
        return "the MLP a tile of tokens at a time, each tile recomputed"
    if "--offload-activations" in flags:
        return "the layers recomputed in backward, their saved inputs in host memory"
    return "the layers recomputed in backward"


def check_memory(
    est, nproc_local: int, *, what: str, hints: list[tuple[str, int]] | None = None
) -> None:
    """Raise CliError when the estimate does not fit one rank's share of this machine.
    `hints`: [(flags, estimated total)] of layouts that need less (`memory_alternatives`); the
    first that fits is proposed.

    Example:
        >>> check_memory(estimate_memory(model, tp=2, ...), 2, what="training")  # doctest: +SKIP
    """
    from ..plan.memory import format_bytes

    kind, budget, source = device_budget(nproc_local)
    if est.total <= budget:
        return
    fits = [(f, t) for f, t in (hints or []) if t <= budget]
    fix = (
        f"Fix: {fits[0][0]} (about {format_bytes(fits[0][1])} per rank: {_why(fits[0][0])}); or "
        if fits
        else "Fix: "
    )
    raise CliError(
        f"estimated out of memory: {what} needs about {format_bytes(est.total)} per rank (tp rank "
        f"{est.rank}), but a rank has {format_bytes(max(budget, 0))} ({source}).\n"
        f"{est.table()}\n"
        f"{fix}--checkpointing (recompute the layers in backward), a smaller --micro-batch or "
        "--seq-len, a larger --tp, or --quant nf4; "
        "`quantmesh plan` shows the estimate for any choice"
    )


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `plan`."""
    p = sub.add_parser(
        "plan",
        help="print the tp plan and estimated bytes per GPU (reads only config.json)",
        description="Build the model on meta from config.json, print the plan table and the "
        "estimated memory of one rank (formula: quantmesh.memory). No weights are read.",
    )
    p.add_argument("model", help="transformers model folder (only config.json is read)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel size (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages: memory per pp rank")
    p.add_argument("--microbatches", type=int, default=1, help="at --pp > 1 (default 1)")
    p.add_argument("--pp-schedule", choices=PP_SCHEDULES, default="1f1b")
    p.add_argument("--pp-virtual", type=int, default=1, help="stages per rank (interleaved)")
    p.add_argument("--quant", choices=QUANTS, default="none")
    p.add_argument("--lora-r", type=int, default=0, help="LoRA rank; 0 = no training (default)")
    p.add_argument("--lora-targets", nargs="+", help="module names (default all projections)")
    p.add_argument("--lora-dropout", type=float, default=0.0, help="LoRA dropout (default 0)")
    p.add_argument("--seq", "--seq-len", dest="seq", type=int, default=2048, help="tokens/example")
    p.add_argument("--micro-batch", type=int, default=1, help="examples per forward (default 1)")
    p.add_argument(
        "--compile",
        action="store_true",
        default=None,
        help="blocks compiled (qm.compile_blocks; finetune's default on GPUs, and so here)",
    )
    p.add_argument("--no-compile", dest="compile", action="store_false", help="blocks eager")
    p.add_argument(
        "--checkpointing", action="store_true", help="blocks recomputed (qm.checkpoint_blocks)"
    )
    p.add_argument(
        "--offload-activations", action="store_true", help="checkpointed inputs in host memory"
    )
    p.add_argument(
        "--checkpoint-blocks",
        type=int,
        metavar="N",
        help="with --checkpointing: only N layers recomputed, the others keep their activations",
    )
    p.add_argument(
        "--tile-tokens",
        type=int,
        default=0,
        help="with --checkpointing: the MLP N tokens at a time",
    )
    p.add_argument(
        "--loss-chunk-tokens",
        type=int,
        default=1024,
        help="tokens per chunk of the loss, as finetune computes it (default 1024; 0: the plain "
        "loss on the whole logits)",
    )
    p.add_argument(
        "--quant-backend",
        choices=BACKENDS,
        default=BACKENDS[0],
        help="library of the quantized base (torchao: the one --fsdp shards)",
    )
    p.add_argument("--fsdp", action="store_true", help="base and adapters sharded over dp (FSDP2)")
    p.add_argument("--offload-base", action="store_true", help="with --fsdp: base shards on host")
    p.add_argument(
        "--keep-dequantized",
        action="store_true",
        help="bitsandbytes nf4/fp4: the weights also held dequantized, as finetune's flag holds them",
    )
    p.add_argument(
        "--keep-dequantized-blocks",
        type=int,
        metavar="K",
        help="with --keep-dequantized: only the first K decoder layers' weights held",
    )
    p.add_argument(
        "--gpu-memory",
        type=float,
        metavar="GIB",
        help="memory of one GPU in GiB (e.g. 24): say whether the run fits, and if not, the "
        "first layout that does (starting with the fewest layers to checkpoint)",
    )
    p.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cuda: bf16 weights and activations (default); cpu: fp32, as CPU ranks run",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """The `plan` command: one process, no workers."""
    with user_errors():
        for name in ("tp", "dp", "pp", "microbatches", "pp_virtual", "seq", "micro_batch"):
            if getattr(args, name) < 1:
                raise CliError(f"--{name.replace('_', '-')} {getattr(args, name)}; expected >= 1")
        if args.lora_r < 0:
            raise CliError(f"--lora-r {args.lora_r}; expected >= 1 (or 0 for no LoRA)")
        gib = getattr(args, "gpu_memory", None)
        if gib is not None and not gib * 2**30 > CUDA_RUNTIME_BYTES:
            raise CliError(
                f"--gpu-memory {gib}; expected a GPU's memory in GiB, more than the "
                f"{CUDA_RUNTIME_BYTES / 2**30:.1f} GiB the CUDA context and workspaces take (e.g. 24)"
            )
        _, model = load_skeleton(args.model)
        from ..plan.auto import blocks_of

        why = layer_count_problem(
            len(blocks_of(model)), pp=args.pp,
            checkpoint_blocks=args.checkpoint_blocks, checkpointing=args.checkpointing,
            keep_dequantized_blocks=args.keep_dequantized_blocks,
            keep_dequantized=args.keep_dequantized,
        )  # fmt: skip
        if why:
            raise CliError(why)
        print(plan_report(model, args))
    return 0


def layer_count_problem(
    n: int,
    *,
    pp: int,
    checkpoint_blocks: int | None,
    checkpointing: bool,
    keep_dequantized_blocks: int | None,
    keep_dequantized: bool,
) -> str | None:
    """What is wrong with `--checkpoint-blocks` or `--keep-dequantized-blocks` (how many of the
    model's `n` decoder layers the flag they need applies to): that flag missing, --pp, or the
    count; None when nothing is. `quantmesh plan` and finetune's checks say it alike.

    Example:
        >>> layer_count_problem(2, pp=1, checkpoint_blocks=3, checkpointing=True,  # doctest: +ELLIPSIS
        ...                     keep_dequantized_blocks=None, keep_dequantized=False)
        '--checkpoint-blocks 3, but the model has 2 decoder layers; pass 1 to 2, or leave it ...'
    """
    for flag, k, needs, has_needed, all_of in (
        ("--checkpoint-blocks", checkpoint_blocks, "--checkpointing", checkpointing,
         "recompute all of them"),
        ("--keep-dequantized-blocks", keep_dequantized_blocks, "--keep-dequantized",
         keep_dequantized, "hold every layer's weights"),
    ):  # fmt: skip
        if k is None:
            continue
        if not has_needed:
            return f"{flag} {k} without {needs}: it says how many layers {needs} applies to; add {needs}"
        if pp > 1:
            return (
                f"{flag} with --pp {pp}: each stage would choose among its own layers, which "
                f"the memory check does not model; use {needs} alone (every layer) with --pp"
            )
        if not 1 <= k <= n:
            return (
                f"{flag} {k}, but the model has {n} decoder layers; pass 1 to {n}, or leave it "
                f"out to {all_of}"
            )
    return None


def plan_report(model, args: argparse.Namespace) -> str:
    """The table and the estimate as printed by `quantmesh plan`."""

    from ..plan.auto import auto_plan
    from ..plan.memory import format_bytes
    from ..tp.experts import expert_rows, select_lora

    plan = auto_plan(model, args.tp)
    table = plan.table(model, args.tp, extra=expert_rows(model, args.tp))
    lora = None
    if args.lora_r:
        kw: dict[str, Any] = (
            {"targets": [t for x in args.lora_targets for t in x.split(",")]}
            if (args.lora_targets)
            else {}
        )
        lora = LoraConfig(r=args.lora_r, dropout=args.lora_dropout, **kw)
        select_lora(model, lora)  # names that match nothing are an error, with the valid names
    from ..io.prequant import folder_quant, held_as_float
    from ..quant.base import QuantConfig

    backend = getattr(args, "quant_backend", BACKENDS[0])
    asked = None if args.quant == "none" else QuantConfig(format=args.quant, backend=backend)
    # a folder saved quantized by bitsandbytes: its stored format unless --quant names it
    folder = getattr(args, "model", None)  # a preset name or a folder; absent in some callers
    quant = folder_quant(folder, asked) if folder else asked
    shown = "none" if quant is None else quant.format
    gpu = args.device == "cuda"
    shape = shape_of_args(model, args, plan=plan, quant=quant, lora=lora)
    est = shape.estimate()  # offload_base without fsdp: FsdpError, the fix
    mode = (
        f"training LoRA r={args.lora_r} with AdamW"
        if lora
        else "forward only (inference); add --lora-r to estimate training"
    )
    unit = "GPU" if gpu else "CPU rank"
    dtypes = "bf16 weights, bf16 autocast" if gpu else "fp32 weights and activations"
    if shape.compiled:
        dtypes += ", compiled blocks"
    chunk = shape.loss_chunk_tokens
    lines = [
        table,
        "",
        f"Estimated memory per {unit} (tp rank {est.rank} of {args.tp}, dp={args.dp}; "
        f"quant={shown}; {mode}; seq {args.seq} x micro-batch {args.micro_batch}; {dtypes}):",
        est.table(),
        "Assumes: activation checkpointing "
        + _checkpointing(shape)
        + _held(shape)
        + (f", the loss in chunks of {chunk} tokens" if lora and chunk else "")
        + ", SDPA attention, frozen base; excludes the CUDA "
        "context, allocator fragmentation and workspaces. Formula: quantmesh.plan.memory.",
    ]
    lines += [f"Note: {n}" for n in est.notes]
    grows = held_as_float(folder) if folder and quant is None else None
    if grows is not None:
        lines.append(f"Note: {grows}, as estimated here; --quant nf4 (or int8) holds them in 4 "
                     "(or 8) bits, quantized on the ranks as they load")  # fmt: skip
    if shape.pp > 1:
        lines += ["", stage_report(shape)]
    gib = getattr(args, "gpu_memory", None)
    budget = None if gib is None else int(gib * 2**30) - CUDA_RUNTIME_BYTES
    if shape.pp > 1:  # each pp rank holds its stages: the fullest must fit (fsdp, partial: refused)
        alternatives = stage_alternatives(shape) if lora else []
    else:
        alternatives = memory_alternatives(shape, budget=budget)
    if gib is not None and budget is not None:
        fullest = shape.fullest().total if shape.pp > 1 else est.total
        lines.append(_verdict(fullest, budget, gib, alternatives, stage=shape.pp > 1))
    if alternatives:  # the ways out when this does not fit, side by side
        alt = [f"{flags}: {format_bytes(total)}" for flags, total in alternatives]
        if shape.pp > 1:
            lines.append(f"If this does not fit, the fullest pp rank needs: {'; '.join(alt)}")
        else:
            lines.append(
                f"If this does not fit: {'; '.join(alt)} per {unit} (dp={args.dp}"
                + (
                    "; with --fsdp a quantized base needs --quant-backend torchao)"
                    if any(flags.startswith("--fsdp") for flags, _ in alternatives)
                    else ")"
                )
            )
    return "\n".join(lines)


def shape_of_args(
    model, args: argparse.Namespace, *, plan: Any, quant: Any, lora: LoraConfig | None
) -> RunShape:
    """The RunShape of `quantmesh plan`'s flags (those a caller's namespace lacks at their
    defaults), for `model` under `plan` with `quant` and `lora` already resolved."""
    import torch

    gpu = getattr(args, "device", "cuda") == "cuda"
    return RunShape(
        model=model,
        plan=plan,
        tp=args.tp,
        dp=args.dp,
        pp=getattr(args, "pp", 1),
        quant=quant,
        lora=lora,
        fsdp=getattr(args, "fsdp", False),
        offload_base=getattr(args, "offload_base", False),
        seq_len=args.seq,
        micro_batch=args.micro_batch,
        dtype=torch.bfloat16 if gpu else torch.float32,
        compiled=_compiled(args, gpu),
        checkpointing=getattr(args, "checkpointing", False),
        offload_activations=getattr(args, "offload_activations", False),
        loss_chunk_tokens=getattr(args, "loss_chunk_tokens", 0),
        tile_tokens=getattr(args, "tile_tokens", 0) or None,
        checkpointed_blocks=getattr(args, "checkpoint_blocks", None),
        keep_dequantized=getattr(args, "keep_dequantized", False),
        held_blocks=getattr(args, "keep_dequantized_blocks", None),
        microbatches=getattr(args, "microbatches", 1),
        pp_schedule=getattr(args, "pp_schedule", "1f1b"),
        pipeline=PipelineConfig(virtual=getattr(args, "pp_virtual", 1)),
    )


def _verdict(
    total: int,
    budget: int,
    gib: float,
    alternatives: list[tuple[str, int]],
    *,
    stage: bool = False,
) -> str:
    """Whether a run of `total` bytes fits a GPU of `gib` GiB (`budget` after the CUDA context),
    and if not, the first alternative that does; `stage`: `total` is the fullest pp rank's."""
    from ..plan.memory import format_bytes

    room = f"a {gib:g} GiB GPU ({format_bytes(budget)} after the CUDA context and workspaces)"
    who = "The fullest pp rank" if stage else "This run"
    if total <= budget:
        return f"{who} fits {room}."
    fits = [(f, t) for f, t in alternatives if t <= budget]
    if not fits:
        nor = ", nor does any layout below" if alternatives else ""
        return (
            f"{who} does not fit {room}{nor}: a smaller --micro-batch or --seq-len, a larger --tp "
            "or more --pp stages"
        )
    flags, t = fits[0]
    return f"{who} does not fit {room}; {flags} does (about {format_bytes(t)}: {_why(flags)})."


def _checkpointing(shape: RunShape) -> str:
    """How many layers the run recomputes, for the report's assumptions."""
    if not shape.checkpointing:
        return "off"
    k = shape.checkpointed_blocks
    return "on" if k is None else f"on for {k} of the layers (--checkpoint-blocks)"


def _held(shape: RunShape) -> str:
    """Which 4-bit weights the run holds dequantized, for the report's assumptions."""
    if not shape.keep_dequantized:
        return ""
    k = shape.held_blocks
    if k is None:
        return ", every 4-bit weight held dequantized"
    layers = "layer's" if k == 1 else f"{k} layers'"
    return f", the first {layers} 4-bit weights held dequantized"


def _compiled(args: argparse.Namespace, gpu: bool) -> bool:
    """Compiled blocks: as asked, else finetune's default (on GPUs, not on CPU:
    ActivationOptions.compile_on)."""
    c = getattr(args, "compile", None)
    return gpu if c is None else bool(c)


def stage_alternatives(shape: RunShape) -> list[tuple[str, int]]:
    """[(flags, the fullest pp rank's estimated bytes)] of the layouts that need less memory at
    pp > 1: checkpointing, and its inputs offloaded (partial checkpointing and fsdp are refused
    with pp).

    Example:
        >>> stage_alternatives(shape)  # doctest: +SKIP
        [('--checkpointing', 5948061696), ('--checkpointing --offload-activations', 5411190784)]
    """
    steps: list[tuple[str, dict[str, Any]]] = []
    if not shape.checkpointing:
        steps.append(("--checkpointing", {"checkpointing": True}))
    if not shape.offload_activations:
        flags = "--checkpointing --offload-activations"
        steps.append((flags, {"checkpointing": True, "offload_activations": True}))
    return [(flags, shape.but(**change).fullest().total) for flags, change in steps]


def stage_report(shape: RunShape) -> str:
    """One row per pp rank: its stages, blocks, micro-batches in flight, and memory by part."""
    from ..plan.memory import format_bytes

    rows = shape.stages()
    head = ("pp rank", "stages", "blocks", "in flight", "weights", "activations", "logits", "total")
    body = [
        (
            str(r.rank),
            ",".join(map(str, r.stages)),
            str(r.blocks),
            str(r.in_flight),
            format_bytes(r.estimate.weights),
            format_bytes(r.estimate.activations),
            format_bytes(r.estimate.logits),
            format_bytes(r.estimate.total),
        )
        for r in rows
    ]
    w = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]

    def line(cells: tuple[str, ...]) -> str:
        return "  ".join(c.ljust(n) for c, n in zip(cells, w, strict=True)).rstrip()

    return "\n".join(
        [
            f"Pipeline: pp={shape.pp} ({shape.pp_schedule}, {shape.microbatches} micro-batches "
            f"of {shape.micro_batch}); per pp rank (the estimate above is for the whole model):",
            line(head),
            *[line(b) for b in body],
            "Activations: the per-layer figure x the rank's layers x the stage forwards the "
            "schedule keeps in flight (quantmesh.pipeline.memory); not yet checked on a GPU.",
        ]
    )
