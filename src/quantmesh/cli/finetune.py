"""`quantmesh finetune [CONFIG.toml] [--flags]`: LoRA fine-tuning of a transformers causal LM.

Settings come from three layers, each overriding the one before: the defaults of FinetuneConfig,
the TOML file (flat `key = value`, the flag names with underscores; paths as you would type them
on the command line: relative to the current directory, `~` expanded), then the flags.
FinetuneConfig is made of the library's own option classes (quantmesh.config: ParallelConfig,
PipelineConfig, LoraConfig, TrainConfig) and of this command's (the data, activation memory and
launch settings); its flags and TOML keys are built from their fields (cli/flags.py), and each
class checks its own rules. Everything is checked here, in the launching process, before any
worker starts; the workers (cli/worker.py) then load, train and save. Under torchrun (RANK and
WORLD_SIZE set) the command runs in place instead of launching.

Example:
    $ quantmesh finetune examples/finetune.toml --nproc 2 --tp 2 --steps 20
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import (
    LoraConfig,
    ParallelConfig,
    PipelineConfig,
    TrainConfig,
    check_pp_schedule,
)
from ..train.formats import FORMATS
from ..train.readers import data_name
from . import flags
from .errors import CliError, user_errors

if TYPE_CHECKING:
    from ..quant.base import QuantConfig
    from .plan_cmd import RunShape

__all__ = [
    "ActivationOptions",
    "FinetuneConfig",
    "LaunchOptions",
    "add_parser",
    "config_from_args",
    "load_config",
    "run",
]

DATA_FORMATS = ("auto", *FORMATS)  # the choices of --data-format
# the choices of --train-on (quantmesh.train.data.TRAIN_ON; written out so that `--help` imports
# no torch)
TRAIN_ON = ("assistant", "last", "all")


@dataclass(kw_only=True)
class ActivationOptions:
    """How the decoder layers keep what backward needs: compiled, recomputed, offloaded, tiled.

    Example:
        >>> ActivationOptions(checkpointing=True, tile_tokens=8192).compile_on(cuda=True)
        True
    """

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
    cuda_graphs: bool = False
    """One GPU: replay each compiled decoder layer's forward and backward from CUDA graphs
    (torch.compile mode reduce-overhead) and dequantize 4-bit weights with quantmesh's Triton
    kernel there, whose launches a replay no longer pays for (unless
    QUANTMESH_TRITON_DEQUANT_TRAINING=0). Opt-in: 3-6% faster steps on one GPU in the
    benchmark's loop, and its CUDA test through this loop passes; not yet verified with tp, pp,
    dp, FSDP or checkpointing, which it refuses. The graphs' memory pool is not in the memory
    check's estimate (0.7 GiB more reserved on the 7B shape)."""

    def __post_init__(self) -> None:
        if self.offload_activations and not self.checkpointing:
            raise CliError(
                "--offload-activations needs --checkpointing (it offloads what it keeps)"
            )
        if isinstance(self.tile_tokens, int) and self.tile_tokens < 0:
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
        if self.cuda_graphs and self.compile is False:
            raise CliError(
                "--cuda-graphs replays the compiled decoder layers: drop --no-compile (or "
                "--cuda-graphs)"
            )
        if self.cuda_graphs and self.checkpointing:
            raise CliError(
                "--cuda-graphs with --checkpointing: recomputed layers replayed from CUDA graphs "
                "are not verified yet; use one of the two"
            )

    def compile_on(self, cuda: bool) -> bool:
        """Whether the blocks are compiled on this device: as asked, else on CUDA (with MLP tiles
        too: each tile is compiled on its own, and a compiled tiled block peaked below the eager
        one: docs/benchmarks.md, "Figures the code relies on")."""
        return cuda if self.compile is None else self.compile


@dataclass(kw_only=True)
class LaunchOptions:
    """Where the workers run: processes on this node, and the nodes of a multi-node run.

    Example:
        >>> LaunchOptions(nproc=4).nnodes
        1
    """

    nproc: int | None = None
    """Worker processes on this node; None = tp x pp x dp / nnodes."""
    nnodes: int = 1
    """Nodes of a multi-node run launched by quantmesh (each runs the same command)."""
    node_rank: int | None = None
    """This node's rank in a multi-node run."""
    rdzv_endpoint: str | None = None
    """host:port of the rendezvous for a multi-node run."""

    def __post_init__(self) -> None:
        if isinstance(self.nnodes, bool) or not isinstance(self.nnodes, int) or self.nnodes < 1:
            raise CliError(f"nnodes={self.nnodes!r}; expected an integer >= 1")
        v = self.nproc
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise CliError(f"nproc={v!r}; expected an integer >= 1 (or leave it unset)")


@dataclass(kw_only=True)
class FinetuneConfig:
    """Everything one fine-tuning run needs; a TOML file and flags fill it (`from_settings`).

    Example:
        >>> cfg = FinetuneConfig.from_settings({"model": "m", "data": ["a.txt"], "tp": 2, "nproc": 4})
        >>> cfg.parallel.dp, cfg.train.lr
        (2, 0.0002)
    """

    model: str = ""
    """Folder of a transformers causal LM (config.json, weights, tokenizer)."""
    data: list[str] = field(default_factory=list)
    """Training files and folders: .jsonl, .json, .csv, .tsv, .parquet, .arrow, .txt (text
    kinds also .gz, .bz2, .xz), datasets folders (save_to_disk), folders of shards (README:
    "Training data")."""
    data_format: str = field(default="auto", metadata={"choices": DATA_FORMATS})
    """The records' format: auto (named by each record's keys) or one format for every record."""
    train_on: str = field(default="assistant", metadata={"choices": TRAIN_ON})
    """Tokens trained: assistant (every assistant turn; the response / completion), last (the
    last assistant turn), all (every token)."""
    packing: bool = True
    """Pack documents back to back into seq_len examples (EOS between them); off: one document per
    example, padded."""
    seq_len: int = 512
    """Tokens per example."""
    eval_fraction: float = 0.0
    """Share of the packed examples held out for evaluation."""
    output_dir: str = "quantmesh-out"
    """Where the adapter, checkpoints, metrics.jsonl and loss.png go."""
    resume: str | None = None
    """A checkpoint folder (checkpoints/step-N) or an output dir (its latest checkpoint)."""
    overwrite: bool = False
    """Allow an output_dir that already holds a run (its files are replaced)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """The mesh (tp x pp x dp processes), the quantization of the frozen base, FSDP."""
    pipeline: PipelineConfig = field(
        default_factory=PipelineConfig, metadata={"prefix": "pp_", "skip": ("stages",)}
    )
    """At pp > 1: the stages per rank (stages balanced by compute)."""
    lora: LoraConfig = field(
        default_factory=LoraConfig, metadata={"prefix": "lora_", "skip": ("seed",)}
    )
    """The adapters trained (their initialization seeded by --seed)."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The training loop: batch, learning rate, length, evaluation, checkpoints."""
    activations: ActivationOptions = field(default_factory=ActivationOptions)
    """Activation memory: compiled, recomputed, offloaded or tiled decoder layers."""
    launch: LaunchOptions = field(default_factory=LaunchOptions)
    """Worker processes and nodes."""

    def __post_init__(self) -> None:
        if isinstance(self.data, str):
            self.data = [self.data]
        flags.check_types(self)
        if self.data_format not in DATA_FORMATS:
            raise CliError(
                f"data_format={self.data_format!r}; use one of {', '.join(DATA_FORMATS)}"
            )
        if self.train_on not in TRAIN_ON:
            raise CliError(f"train_on={self.train_on!r}; use one of {', '.join(TRAIN_ON)}")
        if self.seq_len < 1:
            raise CliError(f"seq_len={self.seq_len!r}; expected an integer >= 1")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise CliError(f"eval_fraction={self.eval_fraction}; expected a value in [0, 1)")
        self.lora.seed = self.train.seed  # one seed: data order, LoRA A, dropout
        pp = self.parallel.pp
        if self.activations.checkpoint_blocks is not None and pp > 1:
            raise CliError(
                f"--checkpoint-blocks with --pp {pp}: each stage would choose among its "
                "own layers, which the memory check does not model; use --checkpointing "
                "alone (every layer) with --pp"
            )
        if self.parallel.keep_dequantized_blocks is not None and pp > 1:
            raise CliError(
                f"--keep-dequantized-blocks with --pp {pp}: each stage would choose among its "
                "own layers, which the memory check does not model; use --keep-dequantized "
                "alone (every layer) with --pp"
            )
        check_pp_schedule(
            self.train.pp_schedule,
            pp=pp,
            microbatches=self.train.grad_accum,
            virtual=self.pipeline.virtual,
        )
        self._resolve_mesh()
        par = self.parallel
        if self.activations.cuda_graphs and (
            par.tp * par.pp * (par.dp or 1) * self.launch.nnodes > 1 or par.fsdp
        ):
            layout = f"--tp {par.tp} --pp {par.pp} --dp {par.dp}" + (" --fsdp" if par.fsdp else "")
            raise CliError(
                f"--cuda-graphs with {layout}: CUDA graphs of the layers are verified on one GPU "
                "only so far (their collectives, hooks and stage sends are not); drop "
                "--cuda-graphs for this layout"
            )

    def _resolve_mesh(self) -> None:
        """Fill in nproc / dp from each other so that nproc * nnodes == tp * pp * dp."""
        par, launch = self.parallel, self.launch
        n, tp = launch.nnodes, par.tp * par.pp  # the processes of one replica
        what = f"--tp {par.tp}" if par.pp == 1 else f"--tp {par.tp} x --pp {par.pp} = {tp}"
        if launch.nproc is None:
            dp = par.dp or 1
            if (tp * dp) % n:
                raise CliError(
                    f"{what} x dp={dp} = {tp * dp} processes cannot be spread evenly over "
                    f"nnodes={n}; give --nproc (workers per node)"
                )
            par.dp, launch.nproc = dp, tp * dp // n
            return
        world = launch.nproc * n
        if world % tp:
            fits = [t for t in range(1, world + 1) if world % t == 0]
            fix = (
                f"use --tp {' or '.join(map(str, fits))}"
                if par.pp == 1
                else (f"make tp x pp one of {', '.join(map(str, fits))}")
            )
            raise CliError(
                f"{what} does not divide the {world} processes (--nproc {launch.nproc} x "
                f"--nnodes {n}); {fix}, or change --nproc"
            )
        if par.dp is not None and par.dp * tp != world:
            raise CliError(
                f"{what} x --dp {par.dp} = {tp * par.dp} processes, but --nproc {launch.nproc}"
                f" x --nnodes {n} = {world}; drop --dp (it is then {world // tp}) or fix one"
            )
        par.dp = world // tp

    def quant_config(self) -> QuantConfig | None:
        """The QuantConfig of --quant / --quant-backend (None for --quant none)."""
        from ..quant.base import QuantConfig

        par = self.parallel
        return (
            None
            if par.quant == "none"
            else QuantConfig(format=par.quant, backend=par.quant_backend)
        )

    @property
    def world_size(self) -> int:
        assert self.launch.nproc is not None  # set by _resolve_mesh
        return self.launch.nproc * self.launch.nnodes

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any], *, where: str = "") -> FinetuneConfig:
        """A FinetuneConfig from flat settings {option name: value} (the TOML keys; flags; the
        workers' JSON): unknown names and wrong types refused with the valid ones (CliError)."""
        settings = dict(settings)
        targets = settings.get("lora_targets")
        if targets:  # "q_proj,v_proj" as one item: the command line's shorthand
            targets = [targets] if isinstance(targets, str) else targets
            if isinstance(targets, list) and all(isinstance(t, str) for t in targets):
                settings["lora_targets"] = [t for item in targets for t in item.split(",") if t]
        if isinstance(settings.get("data"), str):
            settings["data"] = [settings["data"]]
        return flags.build(cls, settings, where=where)

    def to_settings(self) -> dict[str, Any]:
        """The flat settings `from_settings` takes back (every option, resolved)."""
        return flags.flatten(self)

    def to_json(self) -> str:
        return json.dumps(self.to_settings())

    @classmethod
    def from_json(cls, text: str) -> FinetuneConfig:
        return cls.from_settings(json.loads(text))


PATH_KEYS = ("model", "output_dir", "resume")
ALIASES = {"grad_accum": ("--microbatches",)}  # the pipeline's name for the micro-batches


def load_config(path: str | os.PathLike) -> dict:
    """Read a TOML file into flat FinetuneConfig settings (`~` in paths expanded); an unknown key
    is refused with a close match and the valid keys.

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
    if path.is_dir():
        what = "a model folder" if (path / "config.json").is_file() else "a folder"
        fix = f"--model {path}" if what == "a model folder" else f"--model or --data {path}"
        raise CliError(
            f"{str(path)!r} is {what}, and the positional argument is a TOML settings file; "
            f"pass {fix}"
        )
    if not path.is_file():
        raise CliError(f"config file {str(path)!r} does not exist; check the path")
    if data_name(path.name):
        raise CliError(
            f"{str(path)!r} looks like training data, and the positional argument is a TOML "
            f"settings file; pass --data {path}"
        )
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise CliError(f"{path} is not valid TOML: {e}") from None
    out = {}
    for key, value in raw.items():
        if isinstance(value, dict):
            raise CliError(f"{path}: [{key}] is a table; write flat `key = value` lines")
        out[key.replace("-", "_")] = value
    flags.check_keys(FinetuneConfig, out, where=f"{path}: ")
    for name in PATH_KEYS:
        if isinstance(out.get(name), str):
            out[name] = os.path.expanduser(out[name])
    if "data" in out:
        data = [out["data"]] if isinstance(out["data"], str) else out["data"]
        out["data"] = [os.path.expanduser(d) if isinstance(d, str) else d for d in data]
    return out


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `finetune`: the config file, and one flag per FinetuneConfig option (each
    overrides the TOML key of the same name)."""
    p = sub.add_parser(
        "finetune",
        help="LoRA fine-tuning of a transformers causal LM over dp x tp ranks",
        description="Fine-tune LoRA adapters. Flags override CONFIG.toml, which overrides the "
        "defaults. Under torchrun the command runs in place; otherwise it launches its workers.",
    )
    p.add_argument("config", nargs="?", help="a TOML file of settings (flag names, underscores)")
    flags.add_flags(p, FinetuneConfig, aliases=ALIASES)
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace, *, torchrun: bool = False) -> FinetuneConfig:
    """Defaults <- TOML file <- flags, as one validated FinetuneConfig.

    Under torchrun the process count is torchrun's (LOCAL_WORLD_SIZE per node, WORLD_SIZE in all),
    whatever the file or flags say about nproc, nnodes or dp.
    """
    settings = load_config(args.config) if args.config else {}
    for o in flags.options(FinetuneConfig):
        v = getattr(args, o.name, None)
        if v is not None:
            settings[o.name] = v
    if not settings.get("model"):
        raise CliError('no model given; pass --model DIR (or `model = "DIR"` in the TOML file)')
    if not settings.get("data"):
        raise CliError("no training data given; pass --data FILE... (or `data = [...]` in TOML)")
    if torchrun:
        world = int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        settings.update(nproc=local, nnodes=max(1, world // local), dp=None)
    where = f"{args.config}: " if args.config else ""
    return FinetuneConfig.from_settings(settings, where=where)


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
    par, launch = cfg.parallel, cfg.launch
    print(
        f"quantmesh finetune: {cfg.world_size} processes (tp={par.tp} x "
        f"{f'pp={par.pp} x ' if par.pp > 1 else ''}dp={par.dp}), "
        f"output in {cfg.output_dir}",
        file=sys.stderr,
        flush=True,
    )
    assert launch.nproc is not None  # set by _resolve_mesh
    return run_workers(
        launch.nproc,
        ["quantmesh.cli.worker", "finetune", cfg.to_json()],
        on_signal=lambda sig: _interrupted(sig, Path(cfg.output_dir).expanduser()),
        nnodes=str(launch.nnodes),
        rdzv_endpoint=launch.rdzv_endpoint,
        node_rank=launch.node_rank,
    )


def _interrupted(sig: str, out: Path) -> None:
    """Ctrl-C or SIGTERM stopped the run: say where it can go on from."""
    from ..train.loop import resolve_resume

    try:
        where = f"the latest checkpoint is {resolve_resume(out)}; resume with --resume {out}"
    except FileNotFoundError:
        where = "no checkpoint was saved yet (--save-every sets how often)"
    print(f"quantmesh finetune: stopped ({sig}); {where}", file=sys.stderr, flush=True)


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
    from ..parallel.fsdp import fsdp_blocked_by
    from ..plan.auto import auto_plan, blocks_of
    from ..tp.experts import select_lora
    from ..train.data import scan_data
    from ..train.loop import resolve_resume
    from .plan_cmd import (
        RunShape,
        check_memory,
        check_tokenizer,
        device_budget,
        layer_count_problem,
        load_skeleton,
        memory_alternatives,
        stage_alternatives,
    )

    par, act, launch = cfg.parallel, cfg.activations, cfg.launch
    assert launch.nproc is not None and par.dp is not None  # set by _resolve_mesh
    config, model = load_skeleton(cfg.model)
    check_tokenizer(cfg.model)
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
    if act.cuda_graphs and not cuda:
        raise CliError("--cuda-graphs needs a CUDA GPU, and this machine has none: drop it")
    if cuda and not in_place and launch.nproc > torch.cuda.device_count():
        raise CliError(
            f"--nproc {launch.nproc} workers on this node, but it has {torch.cuda.device_count()} "
            "GPU(s); one worker drives one GPU: lower --nproc (or --tp / --dp)"
        )
    # names that match nothing (modules or expert tensors), dropout on expert tensors: LoraError
    select_lora(model, cfg.lora)
    if par.fsdp and (why := fsdp_blocked_by(model)) is not None:
        raise CliError(f"--fsdp with {why} (leave --fsdp out)")
    plan = auto_plan(model, par.tp)
    plan.resolve(model, par.tp)  # PlanError: a split the model cannot take
    if par.pp > 1:  # PipelineError: a model that cannot be cut into these stages
        from ..pipeline.cut import plan_stages

        plan_stages(model, par.pp, cfg.pipeline)
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
    n_blocks = len(blocks_of(model))
    # the flags they need and --pp were checked with the settings: what is left is the count
    why = layer_count_problem(
        n_blocks, pp=par.pp,
        checkpoint_blocks=act.checkpoint_blocks, checkpointing=act.checkpointing,
        keep_dequantized_blocks=par.keep_dequantized_blocks, keep_dequantized=par.keep_dequantized,
    )  # fmt: skip
    if why:
        raise CliError(why)
    shape = RunShape(
        model=model,
        plan=plan,
        tp=par.tp,
        dp=par.dp,
        pp=par.pp,
        quant=folder_quant(cfg.model, cfg.quant_config()),
        lora=cfg.lora,
        fsdp=par.fsdp,
        offload_base=par.offload_base,
        seq_len=cfg.seq_len,
        micro_batch=cfg.train.micro_batch,
        dtype=torch.bfloat16 if cuda else torch.float32,
        compiled=act.compile_on(cuda),
        checkpointing=act.checkpointing,
        offload_activations=act.offload_activations,
        loss_chunk_tokens=cfg.train.loss_chunk_tokens,
        tile_tokens=act.tile_tokens or None,
        checkpointed_blocks=act.checkpoint_blocks,
        keep_dequantized=par.keep_dequantized,
        held_blocks=par.keep_dequantized_blocks,
        microbatches=cfg.train.grad_accum,
        pp_schedule=cfg.train.pp_schedule,
        pipeline=cfg.pipeline,
    )
    # the layouts that need less (fewer layers kept, checkpointing, offload, tiles, FSDP), named
    # in the error; a partial checkpointing needs the budget to say how many layers; at pp > 1
    # each rank holds its stages: the fullest rank must fit
    budget = device_budget(launch.nproc)[1]
    if par.pp > 1:
        hints = stage_alternatives(shape)
    else:
        hints = memory_alternatives(shape, budget=budget)
    check_memory(shape.fullest(), launch.nproc, what="training", hints=hints)
    notes = []
    if act.checkpointing and act.checkpoint_blocks is None and par.pp == 1:
        notes.append(_fewer_checkpointed(shape, budget, n_blocks))
    if cuda and not par.keep_dequantized and par.pp == 1 and not par.fsdp:
        notes.append(_room_to_hold(shape, budget, n_blocks))
    for note in notes:
        if note and int(os.environ.get("RANK", "0")) == 0:
            print(f"quantmesh finetune: note: {note}", file=sys.stderr, flush=True)


def _room_to_hold(shape: RunShape, budget: int, n_blocks: int) -> str | None:
    """On a GPU with memory left over, how many layers' 4-bit weights the run could also hold
    dequantized (`--keep-dequantized-blocks`, the memory check's margin), as a note; None for a
    base without bitsandbytes' 4-bit linears, or with no room for one layer."""
    from ..config import QuantError, check_keep_dequantized
    from ..plan.memory import format_bytes
    from .plan_cmd import most_held

    q = shape.quant
    try:
        check_keep_dequantized(quant=q.format if q else None, backend=q.backend if q else "")
    except QuantError:
        return None
    most = most_held(shape, budget)
    if most is None:
        return None
    k, t = most
    flags = "--keep-dequantized" + ("" if k == n_blocks else f" --keep-dequantized-blocks {k}")
    whose = "every layer's" if k == n_blocks else f"{k} of {n_blocks} layers'"
    return (
        f"the GPU has room to hold {whose} 4-bit weights dequantized as well ({flags}: "
        f"about {format_bytes(t)} per rank), so that their matmuls do not dequantize them, in "
        "forward or backward"
    )


def _fewer_checkpointed(shape: RunShape, budget: int, n_blocks: int) -> str | None:
    """With every layer checkpointed, what fits with less recompute (the same margin as the
    memory check's proposal), as a note; None when all layers (or all but one) are needed."""
    from ..plan.memory import format_bytes
    from .plan_cmd import PARTIAL_MARGIN, fewest_checkpointed

    plain = shape.but(checkpointing=False, checkpointed_blocks=None)
    total = plain.estimate().total
    if total <= budget * (1 - PARTIAL_MARGIN):
        return (
            f"the run fits without --checkpointing (about {format_bytes(total)} per rank), and "
            "each recomputed layer costs about a third of its step time"
        )
    fewest = fewest_checkpointed(plain, budget)
    if fewest is None or fewest[0] >= n_blocks - 1:
        return None
    k, t = fewest
    return (
        f"every layer is recomputed; --checkpoint-blocks {k} (of {n_blocks}) fits too, about "
        f"{format_bytes(t)} per rank, and runs faster (each recomputed layer costs about a third "
        "of its step time)"
    )
