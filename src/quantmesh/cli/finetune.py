"""`quantmesh finetune [CONFIG.toml] [--flags]`: LoRA fine-tuning of a transformers causal LM.

Settings come from three layers, each overriding the one before: the defaults of FinetuneConfig,
the TOML file (flat `key = value`, the flag names with underscores; paths as you would type them
on the command line: relative to the current directory, `~` expanded), then the flags. Everything is checked here, in the launching process, before
any worker starts; the workers (cli/worker.py) then load, train and save. Under torchrun (RANK and
WORLD_SIZE set) the command runs in place instead of launching.

Example:
    $ quantmesh finetune examples/finetune.toml --nproc 2 --tp 2 --steps 20
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..quant.names import BACKENDS, FORMATS
from .errors import CliError, user_errors

__all__ = ["FinetuneConfig", "add_parser", "load_config", "run"]

QUANTS = ("none", *FORMATS)  # the choices of --quant
SCHEDULES = ("cosine", "linear", "constant")
# the choices of --data-format and --train-on (quantmesh.train.formats.FORMATS, data.TRAIN_ON;
# written out so that `--help` imports no torch)
DATA_FORMATS = ("auto", "messages", "sharegpt", "alpaca", "prompt-completion", "prompt-response",
                "text")  # fmt: skip
TRAIN_ON = ("assistant", "last", "all")


@dataclass(kw_only=True)
class FinetuneConfig:
    """Everything one fine-tuning run needs; a TOML file and flags fill it.

    Example:
        >>> FinetuneConfig(model="m", data=["a.txt"], tp=2, nproc=4).dp
        2
    """

    model: str = ""
    """Folder of a transformers causal LM (config.json, weights, tokenizer)."""
    data: list[str] = field(default_factory=list)
    """Training files and folders: .jsonl, .json, .parquet, .arrow, .txt, datasets folders
    (save_to_disk), folders of shards (README: "Training data")."""
    data_format: str = "auto"
    """The records' format: auto (named by each record's keys) or one of formats.FORMATS."""
    train_on: str = "assistant"
    """Tokens trained: assistant (every assistant turn; the response / completion), last (the
    last assistant turn), all (every token)."""
    packing: bool = True
    """Pack documents back to back into seq_len examples; False: one per example, padded."""
    output_dir: str = "quantmesh-out"
    """Where the adapter, checkpoints, metrics.jsonl and loss.png go."""
    tp: int = 1
    """Tensor-parallel size: ranks that split each layer."""
    dp: int | None = None
    """Data-parallel size; None = nproc * nnodes / tp (or 1 when nproc is not given)."""
    nproc: int | None = None
    """Worker processes on this node; None = tp * dp / nnodes."""
    nnodes: int = 1
    """Nodes of a multi-node run launched by quantmesh (each runs the same command)."""
    node_rank: int | None = None
    """This node's rank in a multi-node run."""
    rdzv_endpoint: str | None = None
    """host:port of the rendezvous for a multi-node run."""
    quant: str = "none"
    """Quantization of the frozen base: none, nf4, fp4 or int8 (library: quant_backend)."""
    lora_r: int = 16
    """LoRA rank."""
    lora_alpha: float = 32.0
    """LoRA scale numerator (the adapter output is scaled by alpha / r)."""
    lora_dropout: float = 0.0
    """Dropout on the adapters' input while training."""
    lora_targets: list[str] | None = None
    """Module names to adapt; None = every attention and MLP projection of a Llama-style model."""
    seq_len: int = 512
    """Tokens per example; documents are packed back to back (EOS between them)."""
    micro_batch: int = 1
    """Examples per forward pass on each data-parallel rank."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step."""
    lr: float = 2e-4
    """Peak learning rate (AdamW)."""
    weight_decay: float = 0.0
    """AdamW weight decay of the adapters."""
    warmup_steps: int = 0
    """Steps of linear warm-up from 0 to lr."""
    schedule: str = "cosine"
    """After warm-up: cosine or linear decay to 0, or constant."""
    steps: int | None = None
    """Optimizer steps to run; None = epochs over the data."""
    epochs: float | None = None
    """Passes over the training data when steps is not given (default 1)."""
    eval_fraction: float = 0.0
    """Share of the packed examples held out for evaluation."""
    eval_every: int = 0
    """Evaluate every N steps (and at the end); 0 = only at the end, when there is eval data."""
    save_every: int = 0
    """Save the adapter and resumable state every N steps; 0 = only at the end."""
    resume: str | None = None
    """A checkpoint folder (checkpoints/step-N) or an output dir (its latest checkpoint)."""
    overwrite: bool = False
    """Allow an output_dir that already holds a run (its files are replaced)."""
    seed: int = 0
    """Seed of the data order, LoRA initialization and dropout."""
    max_grad_norm: float = 1.0
    """Clip the adapters' global gradient norm to this; 0 = no clipping."""
    pp: int = 1
    """Pipeline-parallel stages (whole decoder layers per stage); tp x pp x dp processes."""
    pp_schedule: str = "1f1b"
    """At pp > 1: the schedule of each step's grad_accum micro-batches: 1f1b or gpipe (one stage
    per rank), interleaved1f1b (pp_virtual stages per rank)."""
    pp_virtual: int = 1
    """Pipeline stages per rank (interleaved1f1b needs 2 or more)."""
    compile: bool | None = None
    """torch.compile each decoder layer (qm.compile_blocks): faster steps after a one-off compile.
    None (the default): on with CUDA GPUs, off on CPU (where the compile costs more than it saves)."""
    checkpointing: bool = False
    """Recompute each decoder layer in backward (qm.checkpoint_blocks): far less activation memory."""
    offload_activations: bool = False
    """With checkpointing: keep the layers' saved inputs in host memory."""
    tile_tokens: int = 0
    """With checkpointing: run each layer's MLP this many tokens at a time (long sequences); 0 = off."""
    checkpoint_blocks: int | None = None
    """With checkpointing: recompute only this many decoder layers (the others keep their
    activations: less recompute, more memory); None = all. The memory check proposes the fewest
    that fit when the run does not."""
    loss_chunk_tokens: int = 1024
    """Tokens per chunk of the loss (never the whole logits at once); 0 = the plain loss."""
    quant_backend: str = "bitsandbytes"
    """Library of the quantized base: bitsandbytes, or torchao (NF4Tensor; the one --fsdp shards)."""
    fsdp: bool = False
    """Shard the frozen base and the adapters over dp with torch's FSDP2, one layer at a time."""
    offload_base: bool = False
    """With fsdp: keep the layers' shards of the base in host memory."""

    def __post_init__(self) -> None:
        if isinstance(self.data, str):
            self.data = [self.data]
        if isinstance(self.lora_targets, str):
            self.lora_targets = [t for t in self.lora_targets.split(",") if t]
        if self.data_format not in DATA_FORMATS:
            raise CliError(
                f"data_format={self.data_format!r}; use one of {', '.join(DATA_FORMATS)}"
            )
        if self.train_on not in TRAIN_ON:
            raise CliError(f"train_on={self.train_on!r}; use one of {', '.join(TRAIN_ON)}")
        if not isinstance(self.packing, bool):
            raise CliError(f"packing={self.packing!r}; expected true or false")
        if self.quant not in QUANTS:
            raise CliError(f"quant={self.quant!r}; use one of {', '.join(QUANTS)}")
        if self.schedule not in SCHEDULES:
            raise CliError(f"schedule={self.schedule!r}; use one of {', '.join(SCHEDULES)}")
        if self.loss_chunk_tokens < 0:
            raise CliError(
                f"--loss-chunk-tokens {self.loss_chunk_tokens}; expected >= 1 (or 0: plain loss)"
            )
        if self.quant_backend not in BACKENDS:
            raise CliError(
                f"quant_backend={self.quant_backend!r}; use one of {', '.join(BACKENDS)}"
            )
        if self.offload_base and not self.fsdp:
            raise CliError("--offload-base needs --fsdp (it offloads FSDP's shards of the base)")
        if self.fsdp and self.pp > 1:
            raise CliError(
                f"--fsdp with --pp {self.pp}: sharding pipeline stages over dp is not implemented; "
                "use --fsdp with --pp 1, or --pp without --fsdp"
            )
        if self.fsdp and self.quant != "none" and self.quant_backend != "torchao":
            raise CliError(
                f"--fsdp cannot shard bitsandbytes {self.quant} exactly (its statistics live "
                "beside the weight); add --quant-backend torchao"
                + (" and use --quant nf4 (torchao has no fp4)" if self.quant == "fp4" else "")
            )
        if self.quant_backend == "torchao" and self.quant == "fp4":
            raise CliError("--quant-backend torchao has nf4 and int8; use --quant nf4")
        if self.offload_activations and not self.checkpointing:
            raise CliError(
                "--offload-activations needs --checkpointing (it offloads what it keeps)"
            )
        if self.tile_tokens < 0:
            raise CliError(f"--tile-tokens {self.tile_tokens}; expected >= 1 (or 0: no tiling)")
        if self.tile_tokens and not self.checkpointing:
            raise CliError("--tile-tokens needs --checkpointing (the tiles are recomputed too)")
        if self.checkpoint_blocks is not None:
            v = self.checkpoint_blocks
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise CliError(
                    f"--checkpoint-blocks {v!r}; expected an integer >= 1 (how many decoder "
                    "layers to recompute; leave it out for all)"
                )
            if not self.checkpointing:
                raise CliError(
                    "--checkpoint-blocks needs --checkpointing (it says how many layers to recompute)"
                )
            if self.pp > 1:
                raise CliError(
                    f"--checkpoint-blocks with --pp {self.pp}: each stage would choose among its "
                    "own layers, which the memory check does not model; use --checkpointing "
                    "alone (every layer) with --pp"
                )
        if self.pp_schedule not in ("1f1b", "gpipe", "interleaved1f1b"):
            raise CliError(f"pp_schedule={self.pp_schedule!r}; use 1f1b, gpipe or interleaved1f1b")
        if (self.pp_virtual > 1) != (self.pp_schedule == "interleaved1f1b"):
            raise CliError(
                "--pp-schedule interleaved1f1b goes with --pp-virtual 2 or more (stages per "
                "rank), and --pp-virtual > 1 with --pp-schedule interleaved1f1b"
            )
        for name in ("tp", "pp", "pp_virtual", "nnodes", "lora_r", "seq_len", "micro_batch",
                     "grad_accum"):  # fmt: skip
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise CliError(f"{name}={v!r}; expected an integer >= 1")
        for name in ("dp", "nproc", "steps"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise CliError(f"{name}={v!r}; expected an integer >= 1 (or leave it unset)")
        for name in ("warmup_steps", "eval_every", "save_every", "seed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise CliError(f"{name}={v!r}; expected an integer >= 0")
        if not self.lr > 0:
            raise CliError(f"lr={self.lr}; expected a positive learning rate such as 2e-4")
        if self.epochs is not None and not self.epochs > 0:
            raise CliError(f"epochs={self.epochs}; expected a positive number")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise CliError(f"eval_fraction={self.eval_fraction}; expected a value in [0, 1)")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise CliError(f"lora_dropout={self.lora_dropout}; expected a value in [0, 1)")
        if self.max_grad_norm < 0 or self.weight_decay < 0:
            raise CliError("max_grad_norm and weight_decay must be >= 0 (0 turns clipping off)")
        if self.pp > 1:
            if self.pp_schedule != "gpipe" and self.grad_accum < self.pp:
                raise CliError(
                    f"--pp-schedule {self.pp_schedule} needs --microbatches (grad_accum) >= --pp: "
                    f"{self.grad_accum} < {self.pp}; use --microbatches {self.pp} or more, or "
                    f"--pp-schedule gpipe"
                )
        self._resolve_mesh()

    def _resolve_mesh(self) -> None:
        """Fill in nproc / dp from each other so that nproc * nnodes == tp * pp * dp."""
        n, tp = self.nnodes, self.tp * self.pp  # the processes of one replica
        what = f"--tp {self.tp}" if self.pp == 1 else f"--tp {self.tp} x --pp {self.pp} = {tp}"
        if self.nproc is None:
            dp = self.dp or 1
            if (tp * dp) % n:
                raise CliError(
                    f"{what} x dp={dp} = {tp * dp} processes cannot be spread evenly over "
                    f"nnodes={n}; give --nproc (workers per node)"
                )
            self.dp, self.nproc = dp, tp * dp // n
            return
        world = self.nproc * n
        if world % tp:
            fits = [t for t in range(1, world + 1) if world % t == 0]
            fix = (
                f"use --tp {' or '.join(map(str, fits))}"
                if self.pp == 1
                else (f"make tp x pp one of {', '.join(map(str, fits))}")
            )
            raise CliError(
                f"{what} does not divide the {world} processes (--nproc {self.nproc} x "
                f"--nnodes {n}); {fix}, or change --nproc"
            )
        if self.dp is not None and self.dp * tp != world:
            raise CliError(
                f"{what} x --dp {self.dp} = {tp * self.dp} processes, but --nproc {self.nproc}"
                f" x --nnodes {n} = {world}; drop --dp (it is then {world // tp}) or fix one"
            )
        self.dp = world // tp

    def compile_on(self, cuda: bool) -> bool:
        """Whether the blocks are compiled on this device: as asked, else on CUDA (with MLP tiles
        too: each tile is compiled on its own, and a compiled tiled block was measured below the
        eager one's memory on one H200)."""
        return cuda if self.compile is None else self.compile

    @property
    def world_size(self) -> int:
        assert self.nproc is not None  # set by _resolve_mesh
        return self.nproc * self.nnodes

    def quant_config(self):
        """The QuantConfig of --quant / --quant-backend (None for --quant none)."""
        from ..quant.base import QuantConfig

        if self.quant == "none":
            return None
        return QuantConfig(format=self.quant, backend=self.quant_backend)

    def lora_config(self):
        """The qm.LoraConfig of this run (LoRA A initialized from `seed`)."""
        from ..lora import LoraConfig

        kw = {"targets": list(self.lora_targets)} if self.lora_targets else {}
        return LoraConfig(
            r=self.lora_r, alpha=self.lora_alpha, dropout=self.lora_dropout, seed=self.seed, **kw
        )

    def train_config(self):
        """The quantmesh.train.TrainConfig part of this run."""
        from ..train.loop import TrainConfig

        names = ("micro_batch", "grad_accum", "lr", "weight_decay", "warmup_steps", "schedule")
        names += ("steps", "epochs", "eval_every", "save_every", "seed", "max_grad_norm")
        names += ("loss_chunk_tokens", "pp_schedule")
        return TrainConfig(**{n: getattr(self, n) for n in names})

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> FinetuneConfig:
        return cls(**json.loads(text))


FIELDS = {f.name: f for f in dataclasses.fields(FinetuneConfig)}
PATH_KEYS = ("model", "output_dir", "resume")


def load_config(path: str | os.PathLike) -> dict:
    """Read a TOML file into FinetuneConfig keyword arguments (`~` in paths expanded).

    Example:
        >>> load_config("examples/finetune.toml")["seq_len"]  # doctest: +SKIP
        256
    """
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # Python 3.10: the same parser, as a package
        try:
            import tomli as tomllib
        except ImportError:
            raise CliError(
                "reading a TOML config needs Python 3.11+ (tomllib) or `pip install tomli`; "
                "or pass every setting as a flag"
            ) from None

    path = Path(path)
    if not path.is_file():
        raise CliError(f"config file {str(path)!r} does not exist; check the path")
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise CliError(f"{path} is not valid TOML: {e}") from None
    out = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in FIELDS:
            close = difflib.get_close_matches(name, FIELDS, n=1)
            hint = (
                f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(FIELDS)}"
            )
            raise CliError(f"{path}: unknown key {key!r}{hint}")
        if isinstance(value, dict):
            raise CliError(f"{path}: [{key}] is a table; write flat `key = value` lines")
        out[name] = value
    for name in PATH_KEYS:
        if isinstance(out.get(name), str):
            out[name] = os.path.expanduser(out[name])
    if "data" in out:
        data = [out["data"]] if isinstance(out["data"], str) else out["data"]
        out["data"] = [os.path.expanduser(d) if isinstance(d, str) else d for d in data]
    return out


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `finetune` and its flags (each flag overrides the TOML key of the same name)."""
    p = sub.add_parser(
        "finetune",
        help="LoRA fine-tuning of a transformers causal LM over dp x tp ranks",
        description="Fine-tune LoRA adapters. Flags override CONFIG.toml, which overrides the "
        "defaults. Under torchrun the command runs in place; otherwise it launches its workers.",
    )
    p.add_argument("config", nargs="?", help="a TOML file of settings (flag names, underscores)")
    p.add_argument("--model", help="transformers model folder")
    p.add_argument(
        "--data",
        nargs="+",
        help="files or folders: .jsonl / .json / .parquet / .arrow / .txt, datasets folders",
    )
    p.add_argument("--output-dir", help="where results go (default quantmesh-out)")
    g = p.add_argument_group("mesh")
    g.add_argument("--tp", type=int, help="tensor-parallel size (default 1)")
    g.add_argument("--dp", type=int, help="data-parallel size (default nproc*nnodes/(tp*pp))")
    g.add_argument("--pp", type=int, help="pipeline stages of whole layers (default 1)")
    g.add_argument("--nproc", type=int, help="workers on this node (default tp*dp)")
    g.add_argument("--nnodes", type=int, help="nodes (multi-node launch)")
    g.add_argument("--node-rank", type=int, help="this node's rank (multi-node launch)")
    g.add_argument("--rdzv-endpoint", help="host:port of the rendezvous (multi-node launch)")
    g = p.add_argument_group("model")
    g.add_argument("--quant", choices=QUANTS, help="quantize the frozen base (default none)")
    g.add_argument(
        "--quant-backend", choices=BACKENDS, help="bitsandbytes (default) or torchao (for --fsdp)"
    )
    g.add_argument(
        "--fsdp",
        action="store_true",
        default=None,
        help="shard the base and adapters over dp (torch FSDP2), gathered one layer at a time",
    )
    g.add_argument(
        "--offload-base",
        action="store_true",
        default=None,
        help="with --fsdp: the layers' shards of the base in host memory",
    )
    g.add_argument("--lora-r", type=int, help="LoRA rank (default 16)")
    g.add_argument("--lora-alpha", type=float, help="LoRA alpha (default 32)")
    g.add_argument("--lora-dropout", type=float, help="LoRA dropout (default 0)")
    g.add_argument("--lora-targets", nargs="+", help="module names (default all projections)")
    g = p.add_argument_group("data")
    g.add_argument(
        "--data-format",
        choices=DATA_FORMATS,
        help="the records' format (default auto: named by each record's keys)",
    )
    g.add_argument(
        "--train-on",
        choices=TRAIN_ON,
        help="tokens trained: every assistant turn (default), the last one, or all",
    )
    g.add_argument(
        "--no-packing",
        dest="packing",
        action="store_false",
        default=None,
        help="one document per example, padded to --seq-len (default: packed back to back)",
    )
    g = p.add_argument_group("training")
    g.add_argument("--seq-len", type=int, help="tokens per example (default 512)")
    g.add_argument("--micro-batch", type=int, help="examples per forward per dp rank (default 1)")
    g.add_argument(
        "--grad-accum",
        "--microbatches",
        dest="grad_accum",
        type=int,
        help="micro-batches per optimizer step; at --pp > 1 the pipeline's micro-batches (default 1)",
    )
    g.add_argument(
        "--pp-schedule",
        choices=("1f1b", "gpipe", "interleaved1f1b"),
        help="pipeline schedule at --pp > 1 (default 1f1b; --schedule is the lr schedule)",
    )
    g.add_argument(
        "--pp-virtual", type=int, help="stages per rank for --pp-schedule interleaved1f1b"
    )
    g.add_argument("--lr", type=float, help="peak learning rate (default 2e-4)")
    g.add_argument("--weight-decay", type=float, help="AdamW weight decay (default 0)")
    g.add_argument("--warmup-steps", type=int, help="linear warm-up steps (default 0)")
    g.add_argument("--schedule", choices=SCHEDULES, help="lr after warm-up (default cosine)")
    g.add_argument("--steps", type=int, help="optimizer steps (default: --epochs)")
    g.add_argument("--epochs", type=float, help="passes over the data (default 1)")
    g.add_argument("--eval-fraction", type=float, help="held-out share of examples (default 0)")
    g.add_argument("--eval-every", type=int, help="evaluate every N steps (default: at the end)")
    g.add_argument("--save-every", type=int, help="checkpoint every N steps (default: at the end)")
    g.add_argument("--resume", help="checkpoint folder, or an output dir (its latest checkpoint)")
    g.add_argument("--overwrite", action="store_true", default=None, help="reuse output-dir")
    g.add_argument("--seed", type=int, help="seed of data order, LoRA init, dropout (default 0)")
    g.add_argument("--max-grad-norm", type=float, help="gradient clipping, 0 = off (default 1)")
    g.add_argument(
        "--compile",
        action="store_true",
        default=None,
        help="torch.compile each decoder layer: a one-off compile, then faster steps "
        "(default on GPUs)",
    )
    g.add_argument(
        "--no-compile",
        dest="compile",
        action="store_false",
        help="run the layers eagerly (the default on CPU)",
    )
    g.add_argument(
        "--checkpointing",
        action="store_true",
        default=None,
        help="recompute each decoder layer in backward: long sequences in little memory",
    )
    g.add_argument(
        "--offload-activations",
        action="store_true",
        default=None,
        help="with --checkpointing: keep the layers' saved inputs in host memory",
    )
    g.add_argument(
        "--tile-tokens",
        type=int,
        help="with --checkpointing: each layer's MLP N tokens at a time (for 32k+ sequences)",
    )
    g.add_argument(
        "--checkpoint-blocks",
        type=int,
        metavar="N",
        help="with --checkpointing: recompute only N decoder layers, the others keep their "
        "activations (faster, more memory; default all)",
    )
    g.add_argument(
        "--loss-chunk-tokens",
        type=int,
        help="tokens per chunk of the loss; 0 = the plain loss on the whole logits (default 1024)",
    )
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace, *, torchrun: bool = False) -> FinetuneConfig:
    """Defaults <- TOML file <- flags, as one validated FinetuneConfig.

    Under torchrun the process count is torchrun's (LOCAL_WORLD_SIZE per node, WORLD_SIZE in all),
    whatever the file or flags say about nproc, nnodes or dp.
    """
    kw = load_config(args.config) if args.config else {}
    for name in FIELDS:
        v = getattr(args, name, None)
        if v is not None:
            kw[name] = v
    if kw.get("lora_targets"):
        targets = kw["lora_targets"]
        targets = [targets] if isinstance(targets, str) else targets
        kw["lora_targets"] = [t for item in targets for t in item.split(",") if t]
    if not kw.get("model"):
        raise CliError('no model given; pass --model DIR (or `model = "DIR"` in the TOML file)')
    if not kw.get("data"):
        raise CliError("no training data given; pass --data FILE... (or `data = [...]` in TOML)")
    if torchrun:
        world = int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        kw.update(nproc=local, nnodes=max(1, world // local), dp=None)
    try:
        return FinetuneConfig(**kw)
    except TypeError as e:  # a TOML value of the wrong type reached a comparison
        raise CliError(f"invalid setting: {e}") from None


def run(args: argparse.Namespace) -> int:
    """The `finetune` command: validate, then launch the workers (or run in place under torchrun)."""
    from . import worker
    from .runner import run_workers

    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    with user_errors():
        cfg = config_from_args(args, torchrun=under_torchrun)
        check_finetune(cfg, in_place=under_torchrun)
    if cfg.overwrite and not cfg.resume and int(os.environ.get("RANK", "0")) == 0:
        _clear_run(Path(cfg.output_dir).expanduser())
    if under_torchrun:
        return worker.run_in_place("finetune", cfg.to_json())
    print(
        f"quantmesh finetune: {cfg.world_size} processes (tp={cfg.tp} x "
        f"{f'pp={cfg.pp} x ' if cfg.pp > 1 else ''}dp={cfg.dp}), "
        f"output in {cfg.output_dir}",
        file=sys.stderr,
        flush=True,
    )
    assert cfg.nproc is not None  # set by _resolve_mesh
    return run_workers(
        cfg.nproc,
        ["quantmesh.cli.worker", "finetune", cfg.to_json()],
        nnodes=str(cfg.nnodes),
        rdzv_endpoint=cfg.rdzv_endpoint,
        node_rank=cfg.node_rank,
    )


RUN_PRODUCTS = ("metrics.jsonl", "loss.png", "adapter", "checkpoints", "logs")


def _clear_run(out: Path) -> None:
    """--overwrite: drop what a previous run wrote (a stale checkpoint must not be "the latest")."""
    import shutil

    for name in RUN_PRODUCTS:
        p = out / name
        shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)


def check_finetune(cfg: FinetuneConfig, *, in_place: bool = False) -> None:
    """Every check that needs no worker: files, formats, mesh, LoRA targets, plan, memory.

    Raises CliError (or another user error) with the fix. Runs in the launching process, so a
    mistake costs seconds, not a model load on every rank.

    Example:
        >>> check_finetune(FinetuneConfig(model="m", data=["a.txt"]))  # doctest: +SKIP
    """
    import torch

    from ..io.prequant import folder_quant
    from ..lora import lora_targets
    from ..plan.auto import auto_plan, blocks_of
    from ..plan.memory import estimate_memory
    from ..train.data import scan_data
    from ..train.loop import resolve_resume
    from .plan_cmd import check_memory, device_budget, load_skeleton, memory_alternatives

    assert cfg.nproc is not None and cfg.dp is not None  # set by _resolve_mesh
    config, model = load_skeleton(cfg.model)
    _check_tokenizer(Path(cfg.model).expanduser())
    max_pos = getattr(config, "max_position_embeddings", None)
    if isinstance(max_pos, int) and cfg.seq_len > max_pos:
        raise CliError(
            f"--seq-len {cfg.seq_len} is longer than the model's context "
            f"(max_position_embeddings={max_pos} in config.json); use --seq-len {max_pos} or less"
        )
    from transformers import AutoTokenizer

    # every record read once, streamed; DataError names the file, the line or row, the keys
    # found and the formats accepted; a conversation needs the tokenizer's chat template
    scan_data(cfg.data, cfg.data_format, AutoTokenizer.from_pretrained(cfg.model))
    cuda = torch.cuda.is_available()
    if cuda and not in_place and cfg.nproc > torch.cuda.device_count():
        raise CliError(
            f"--nproc {cfg.nproc} workers on this node, but it has {torch.cuda.device_count()} "
            "GPU(s); one worker drives one GPU: lower --nproc (or --tp / --dp)"
        )
    lora = cfg.lora_config()
    lora_targets(model, lora)  # names that match nothing: LoraError listing the linear layers
    plan = auto_plan(model, cfg.tp)
    plan.resolve(model, cfg.tp)  # PlanError: a split the model cannot take
    if cfg.pp > 1:  # PipelineError: a model that cannot be cut into these stages
        from ..pipeline.cut import PipelineConfig, plan_stages

        plan_stages(model, cfg.pp, PipelineConfig(virtual=cfg.pp_virtual))
    if cfg.resume:
        resolve_resume(cfg.resume)
    out = Path(cfg.output_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise CliError(f"--output-dir {str(out)!r} is a file; pass a folder")
    if (out / "metrics.jsonl").exists() and not (cfg.resume or cfg.overwrite):
        raise CliError(
            f"--output-dir {str(out)!r} already holds a run (metrics.jsonl); pass --resume "
            f"{out} to continue it, --overwrite to replace it, or another --output-dir"
        )
    mem = dict(
        model=model,
        tp=cfg.tp,
        dp=cfg.dp,
        plan=plan,
        quant=folder_quant(cfg.model, cfg.quant_config()),
        lora=lora,
        seq_len=cfg.seq_len,
        micro_batch=cfg.micro_batch,
        dtype=torch.bfloat16 if cuda else torch.float32,
        compiled=cfg.compile_on(cuda),
        checkpointing=cfg.checkpointing,
        offload_activations=cfg.offload_activations,
        loss_chunk_tokens=cfg.loss_chunk_tokens,
        tile_tokens=cfg.tile_tokens or None,
        checkpointed_blocks=cfg.checkpoint_blocks,
    )
    n_blocks = len(blocks_of(model))
    if cfg.checkpoint_blocks is not None and cfg.checkpoint_blocks > n_blocks:
        raise CliError(
            f"--checkpoint-blocks {cfg.checkpoint_blocks}, but the model has {n_blocks} decoder "
            f"layers; pass 1 to {n_blocks}, or leave it out to recompute all of them"
        )
    est = estimate_memory(**mem, fsdp=cfg.fsdp, offload_base=cfg.offload_base)
    # the layouts that need less (fewer layers kept, checkpointing, offload, tiles, FSDP), named
    # in the error; a partial checkpointing needs the budget to say how many layers
    budget = device_budget(cfg.nproc)[1]
    hints = memory_alternatives(mem, fsdp=cfg.fsdp, offload_base=cfg.offload_base, budget=budget)
    if cfg.pp > 1:  # each rank holds one pipeline stage: the fullest rank must fit
        import argparse

        from .plan_cmd import stage_alternatives, stage_estimates

        args = argparse.Namespace(
            pp=cfg.pp, microbatches=cfg.grad_accum, pp_schedule=cfg.pp_schedule,
            pp_virtual=cfg.pp_virtual, tp=cfg.tp, dp=cfg.dp, seq=cfg.seq_len,
            micro_batch=cfg.micro_batch, device="cuda" if cuda else "cpu", compile=cfg.compile_on(cuda),
            checkpointing=cfg.checkpointing, offload_activations=cfg.offload_activations,
            loss_chunk_tokens=0,  # the pipelined step's loss is plain (train_step)
        )  # fmt: skip
        quant = None if cfg.quant == "none" else cfg.quant
        stages = stage_estimates(model, args, plan=plan, quant=quant, lora=lora)
        est = max((r.estimate for r in stages), key=lambda e: e.total)
        hints = stage_alternatives(model, args, plan=plan, quant=quant, lora=lora)
    check_memory(est, cfg.nproc, what="training", hints=hints)
    if cfg.checkpointing and cfg.checkpoint_blocks is None and cfg.pp == 1 and lora is not None:
        note = _fewer_checkpointed(mem, budget, n_blocks, fsdp=cfg.fsdp, offload=cfg.offload_base)
        if note and int(os.environ.get("RANK", "0")) == 0:
            print(f"quantmesh finetune: note: {note}", file=sys.stderr, flush=True)


def _fewer_checkpointed(
    mem: dict, budget: int, n_blocks: int, *, fsdp: bool, offload: bool
) -> str | None:
    """With every layer checkpointed, what fits with less recompute (the same margin as the
    memory check's proposal), as a note; None when all layers (or all but one) are needed."""
    from ..plan.memory import estimate_memory, format_bytes
    from .plan_cmd import PARTIAL_MARGIN, fewest_checkpointed

    plain = {**mem, "checkpointing": False, "checkpointed_blocks": None}
    total = estimate_memory(**plain, fsdp=fsdp, offload_base=offload).total
    if total <= budget * (1 - PARTIAL_MARGIN):
        return (
            f"the run fits without --checkpointing (about {format_bytes(total)} per rank), and "
            "each recomputed layer costs about a third of its step time"
        )
    fewest = fewest_checkpointed(plain, budget, fsdp=fsdp, offload_base=offload)
    if fewest is None or fewest[0] >= n_blocks - 1:
        return None
    k, t = fewest
    return (
        f"every layer is recomputed; --checkpoint-blocks {k} (of {n_blocks}) fits too, about "
        f"{format_bytes(t)} per rank, and runs faster (each recomputed layer costs about a third "
        "of its step time)"
    )


def _check_tokenizer(path: Path) -> None:
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((path / n).is_file() for n in names):
        raise CliError(
            f"model folder {str(path)!r} has no tokenizer (none of {', '.join(names)}); save "
            "the tokenizer next to the model (tokenizer.save_pretrained(folder))"
        )
