"""`quantmesh serve MODEL`: an OpenAI-compatible HTTP server over tp ranks, many LoRA adapters.

Rank 0 serves HTTP (uvicorn + FastAPI, serve/app.py) and schedules (serve/scheduler.py); every
rank of the tp group decodes the same batch in lock step (serve/ranks.py, serve/engine.py). One
base model (quantized or not) is in memory once; each request's `model` picks an adapter from a
bank of slots (serve/bank.py), so one batch mixes adapters.

Example:
    $ quantmesh serve ~/.cache/quantmesh/SmolLM2-135M-Instruct --tp 2 --quant nf4 \\
        --adapter shakespeare=quantmesh-demo/adapter --port 8000
    $ curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"model": "shakespeare", "messages": [{"role": "user", "content": "Hi"}]}'
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..config import CUDA_GRAPHS
from .errors import CliError, user_errors
from .generate import QUANTS

__all__ = ["ServeConfig", "add_parser", "choose_engine", "run", "serve_worker"]

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$")
API_KEY_ENV = "QUANTMESH_API_KEY"
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
ENGINES = ("auto", "dynamic", "slots")
GC_PAUSE_S = 0.05
"""A garbage collection pausing the serving process longer than this is said."""
SAME_PRESS_S = 1.0
"""Signals to the server within this many seconds of the first are one press of Ctrl-C (a
terminal's reaches rank 0 directly and through the launcher); a later one stops at once."""
SWITCH_INTERVAL_S = 0.0005
"""The serving process's GIL switch interval (Python's default: 5 ms): see `_serve`."""


@dataclass(kw_only=True)
class ServeConfig:
    """One `serve` run.

    Example:
        >>> ServeConfig(model="m", adapters={"a": "out/adapter"}).slots
        9
    """

    model: str
    """transformers model folder."""
    tp: int = 1
    """Tensor-parallel ranks (one process each)."""
    quant: str = "none"
    """none, nf4, fp4 or int8."""
    adapters: dict[str, str] = field(default_factory=dict)
    """Adapters served from the start: name -> PEFT adapter folder."""
    host: str = "127.0.0.1"
    port: int = 8000
    """0 = any free port (the line printed at start-up names it)."""
    served_model_name: str | None = None
    """The base model's name in requests (default: the model folder's name)."""
    max_batch: int = 32
    """Rows decoded together at most; more requests wait."""
    max_adapters: int = 8
    """Adapter slots (loaded at start or at run time)."""
    max_lora_rank: int | None = None
    """The largest adapter rank the bank holds (default: the largest of --adapter, else 16)."""
    lora_targets: list[str] | None = None
    """Modules the bank covers (default: those of the --adapter adapters, else the attention and
    MLP projections). Adapters added at run time may target any subset of them."""
    max_model_len: int | None = None
    """Prompt plus generated tokens, at most (default: the model's max_position_embeddings)."""
    grace_s: float = 10.0
    """On SIGTERM or Ctrl-C, how long running requests may go on before they are cancelled."""
    adapter_dir: str | None = None
    """Adapters may be loaded and unloaded at run time, from inside this directory only (None:
    runtime loading is off)."""
    max_request_bytes: int = 8 << 20
    """Larger request bodies are refused (413)."""
    max_tokens: int | None = None
    """The most tokens one choice may ask to generate (default: up to the context length)."""
    max_choices: int = 256
    """Prompts times n in one request, at most."""
    engine: str = "auto"
    """The decode engine: slots (fixed KV slots, the step compiled and CUDA-graphed on GPUs,
    eager on CPU), dynamic (eager, a growing cache), or auto: slots on GPUs when its KV slots
    fit (several times the dynamic engine's tokens/s on a GPU: docs/benchmarks.md), else
    dynamic, saying why."""
    cuda_graphs: str | None = None
    """Slot engine on GPUs: how its compiled step becomes CUDA graphs. captured (default): one
    torch.cuda.CUDAGraph per (batch, key length), replayed with no host work per step (the
    faster: docs/benchmarks.md); trees: inductor's CUDA graph trees. Only for the slot engine: the dynamic engine runs eagerly."""
    keep_dequantized: bool = False
    """Hold every 4-bit weight dequantized (bf16 on GPUs) beside its codes: steps of two rows or
    more multiply it instead of dequantizing every weight again (memory for speed: about 4x the
    codes' memory more; one row keeps the 4-bit kernel). Refused when it does not fit."""
    prefill_chunk: int | None = None
    """Prompt tokens prefilled per step (slots engine; default 512): a longer prompt is
    prefilled in chunks between decode steps, so that it does not stall the rows decoding. 0:
    whole prompts. The dynamic engine prefills whole prompts only."""

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise CliError(f"--tp {self.tp}; expected >= 1")
        if not 0 <= self.port < 65536:
            raise CliError(f"--port {self.port}; expected 0..65535 (0 = any free port)")
        if self.max_batch < 1:
            raise CliError(f"--max-batch {self.max_batch}; expected >= 1")
        if self.max_adapters < len(self.adapters):
            raise CliError(
                f"--max-adapters {self.max_adapters} is fewer than the {len(self.adapters)} "
                f"--adapter given; pass --max-adapters {len(self.adapters)} or more"
            )
        if self.max_lora_rank is not None and self.max_lora_rank < 1:
            raise CliError(f"--max-lora-rank {self.max_lora_rank}; expected >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise CliError(f"--max-model-len {self.max_model_len}; expected >= 2")
        if self.grace_s < 0:
            raise CliError(f"--grace {self.grace_s}; expected >= 0 seconds")
        for flag, v in (("--max-request-bytes", self.max_request_bytes),
                        ("--max-choices", self.max_choices)):  # fmt: skip
            if v < 1:
                raise CliError(f"{flag} {v}; expected >= 1")
        if self.engine not in ENGINES:
            raise CliError(f"--engine {self.engine}; use one of {', '.join(ENGINES)}")
        if self.cuda_graphs is not None and self.cuda_graphs not in CUDA_GRAPHS:
            raise CliError(f"--cuda-graphs {self.cuda_graphs}; use one of {', '.join(CUDA_GRAPHS)}")
        if self.engine == "dynamic" and self.cuda_graphs is not None:
            raise CliError(
                f"--cuda-graphs {self.cuda_graphs} needs --engine slots or auto (the dynamic "
                "engine runs eagerly)"
            )
        if self.prefill_chunk is not None:
            if self.prefill_chunk < 0:
                raise CliError(f"--prefill-chunk {self.prefill_chunk}; expected >= 0 (0: off)")
            if self.engine == "dynamic" and self.prefill_chunk:
                raise CliError(
                    f"--prefill-chunk {self.prefill_chunk} needs --engine slots or auto (the "
                    "dynamic engine prefills whole prompts)"
                )
        if self.max_tokens is not None and self.max_tokens < 1:
            raise CliError(f"--max-tokens {self.max_tokens}; expected >= 1")
        if self.adapter_dir is not None and not Path(self.adapter_dir).expanduser().is_dir():
            raise CliError(
                f"--adapter-dir {self.adapter_dir}: no such directory; create it (adapters are "
                "loaded at run time from inside it)"
            )
        for name in self.adapters:
            if not NAME.match(name):
                raise CliError(
                    f"adapter name {name!r}: use letters, digits and . _ : / - (a letter or "
                    "digit first)"
                )

    @property
    def slots(self) -> int:
        return self.max_adapters + 1  # slot 0: the base

    @property
    def base_name(self) -> str:
        return self.served_model_name or Path(self.model).expanduser().resolve().name


def _adapter_arg(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=DIR")
    return name, path


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `serve`."""
    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible server on tp ranks; the request's model picks a LoRA adapter",
    )
    p.add_argument("model", help="transformers model folder")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (default 1)")
    p.add_argument("--quant", choices=QUANTS, default="none")
    p.add_argument("--adapter", action="append", type=_adapter_arg, default=[],
                   metavar="NAME=DIR", help="serve a PEFT adapter under NAME (repeatable)")  # fmt: skip
    p.add_argument("--host", default="127.0.0.1", help="default 127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="default 8000; 0 = any free port")
    p.add_argument("--served-model-name", help="the base's name (default: the folder's name)")
    p.add_argument("--max-batch", type=int, default=32, help="rows decoded together (default 32)")
    p.add_argument("--max-adapters", type=int, default=8, help="adapter slots (default 8)")
    p.add_argument(
        "--max-lora-rank",
        type=int,
        help="largest adapter rank (default: the largest --adapter rank, else 16)",
    )
    p.add_argument("--lora-targets", help="comma-separated modules adapters may target")
    p.add_argument("--max-model-len", type=int, help="context length (default: the model's)")
    p.add_argument("--grace", type=float, default=10.0,
                   help="seconds running requests get on SIGTERM or Ctrl-C (default 10)")  # fmt: skip
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every route "
                   f"(default: ${API_KEY_ENV} if set, else no key)")  # fmt: skip
    p.add_argument("--adapter-dir", metavar="DIR",
                   help="allow loading adapters at run time (POST /v1/adapters), from inside DIR "
                   "only (default: off)")  # fmt: skip
    p.add_argument("--max-request-bytes", type=int, default=8 << 20,
                   help="largest request body (default 8 MiB)")  # fmt: skip
    p.add_argument("--max-tokens", type=int,
                   help="most tokens one choice may generate (default: the context length)")  # fmt: skip
    p.add_argument("--max-choices", type=int, default=256,
                   help="prompts x n in one request, at most (default 256)")  # fmt: skip
    p.add_argument("--engine", choices=ENGINES, default="auto",
                   help="slots: fixed KV slots, the decode step compiled and CUDA-graphed on "
                   "GPUs; dynamic: eager, a growing KV cache; auto (default): slots on GPUs when "
                   "the KV slots fit, else dynamic (said at start)")  # fmt: skip
    p.add_argument("--cuda-graphs", choices=CUDA_GRAPHS, default=None,
                   help="slot engine on GPUs: captured (default): one CUDA graph per batch size "
                   "and key length, replayed with no host work per step; trees: inductor's CUDA "
                   "graph trees")  # fmt: skip
    p.add_argument("--keep-dequantized", action="store_true",
                   help="hold every 4-bit weight dequantized beside its codes: steps of 2+ rows "
                   "multiply it instead of dequantizing again (about 4x the codes' memory more)")  # fmt: skip
    p.add_argument("--prefill-chunk", type=int, metavar="N",
                   help="slots engine: prompt tokens prefilled per step, longer prompts in "
                   "chunks between decode steps (default 512; 0: whole prompts)")  # fmt: skip
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """The `serve` command: check, then launch tp workers (rank 0 serves HTTP)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from .runner import run_workers

    with user_errors():
        names = [n for n, _ in args.adapter]
        if len(set(names)) != len(names):
            raise CliError(f"--adapter names repeat: {names}; give each adapter its own name")
        targets = [t.strip() for t in args.lora_targets.split(",")] if args.lora_targets else None
        cfg = ServeConfig(
            model=args.model, tp=args.tp, quant=args.quant, adapters=dict(args.adapter),
            host=args.host, port=args.port, served_model_name=args.served_model_name,
            max_batch=args.max_batch, max_adapters=args.max_adapters,
            max_lora_rank=args.max_lora_rank, lora_targets=targets,
            max_model_len=args.max_model_len, grace_s=args.grace, adapter_dir=args.adapter_dir,
            max_request_bytes=args.max_request_bytes, max_tokens=args.max_tokens,
            max_choices=args.max_choices, engine=args.engine, prefill_chunk=args.prefill_chunk,
            cuda_graphs=args.cuda_graphs, keep_dequantized=args.keep_dequantized,
        )  # fmt: skip
        check(cfg)
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            raise CliError("serve launches its own tp ranks; run it without torchrun")
        if args.api_key is not None:
            if not args.api_key:
                raise CliError("--api-key is empty; give a key, or leave the flag out")
            # to the workers through the environment: a command line is visible to every user
            os.environ[API_KEY_ENV] = args.api_key
        if not os.environ.get(API_KEY_ENV) and cfg.host not in LOCAL_HOSTS:
            print(f"quantmesh serve: warning: listening on {cfg.host} without --api-key: anyone "
                  "who reaches this port can use the model", file=sys.stderr, flush=True)  # fmt: skip
    try:
        return run_workers(cfg.tp, ["quantmesh.cli.worker", "serve", json.dumps(asdict(cfg))])
    except SignalException as e:  # SIGTERM/SIGINT to this process: the ranks stopped gracefully
        # the reader of our stdout may be gone already (a supervisor that stopped us, then left)
        with contextlib.suppress(OSError):
            print(f"quantmesh serve: stopped ({e.sigval.name})", flush=True)
        return 0


def missing_server_packages() -> list[str]:
    """The server's own packages (the `serve` extra and what fastapi needs) that do not import
    here, each with the reason when it is not the package itself missing (a dependency of it, a
    version that does not match), found before any model is loaded. They are imported, not just
    looked up: an installed fastapi without its own dependencies is found but fails to import.

    Example:
        >>> missing_server_packages()  # doctest: +SKIP
        []
    """
    import importlib

    missing = []
    for m in ("fastapi", "pydantic", "uvicorn", "sse_starlette"):
        try:
            importlib.import_module(m)
        except ImportError as e:
            plain = isinstance(e, ModuleNotFoundError) and e.name == m
            missing.append(m if plain else f"{m} ({type(e).__name__}: {e})")
    return missing


def check(cfg: ServeConfig) -> None:
    """Everything checkable before a worker starts: the model, the tp plan, each adapter."""
    from ..io.adapter import adapter_lora_config
    from ..plan.auto import auto_plan
    from .generate import check_adapter
    from .plan_cmd import check_tokenizer, load_skeleton

    missing = missing_server_packages()
    if missing:
        raise CliError(
            f"quantmesh serve needs {', '.join(missing)}, not installed here: pip install "
            "'quantmesh[serve]' (fastapi, uvicorn, sse-starlette)"
        )
    config, model = load_skeleton(cfg.model)
    check_tokenizer(cfg.model)
    for name, path in cfg.adapters.items():
        try:
            check_adapter(model, path)
        except (CliError, ValueError) as e:
            raise CliError(f"--adapter {name}={path}: {e}") from None
        r = adapter_lora_config(path).r
        if cfg.max_lora_rank is not None and r > cfg.max_lora_rank:
            raise CliError(
                f"--adapter {name}={path} has r={r} > --max-lora-rank {cfg.max_lora_rank}; "
                f"raise --max-lora-rank to {r}"
            )
    if cfg.lora_targets:
        from ..lora.adapter import LoraConfig, lora_targets
        from ..tp.experts import find_experts

        tensors = [f"{f}.{t.name}" for f, ts in find_experts(model).items() for t in ts]
        # raises when one matches nothing (expert tensors count: adapters on them are served too)
        lora_targets(model, LoraConfig(targets=cfg.lora_targets), extra=tensors)
    auto_plan(model, cfg.tp).resolve(model, cfg.tp)
    limit = getattr(config, "max_position_embeddings", None)
    if cfg.max_model_len is None and limit is None:
        raise CliError("the model's config has no max_position_embeddings; pass --max-model-len")


def _lora(cfg: ServeConfig, model) -> tuple[Any, dict[str, int]]:
    """The LoraConfig of the bank (union of targets, largest rank) and the slots of --adapter."""
    from ..io.adapter import adapter_lora_config
    from ..lora.adapter import LoraConfig

    found = {n: adapter_lora_config(p) for n, p in cfg.adapters.items()}
    targets = cfg.lora_targets
    if not targets:
        targets = sorted({t for c in found.values() for t in c.targets})
    if not targets:  # no adapter at start: the usual projections this model has
        leaves = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
        targets = [t for t in LoraConfig().targets if t in leaves]
    r = cfg.max_lora_rank or max([c.r for c in found.values()], default=16)
    if not targets:
        return None, {}
    return LoraConfig(r=r, targets=targets), {n: i + 1 for i, n in enumerate(cfg.adapters)}


def serve_worker(payload: str) -> int:
    """One rank of `serve`: load, bank the adapters, then serve (rank 0) or follow (the others)."""
    import signal

    import torch
    from transformers import AutoTokenizer

    import quantmesh as qm

    from ..serve.bank import AdapterBank
    from ..serve.engine import Batch, autocast_dtype
    from ..serve.ranks import Lockstep, control_group, follow
    from ..serve.slots import SlotBatch

    cfg = ServeConfig(**json.loads(payload))
    mesh = qm.init_mesh(tp=cfg.tp, dp=1)
    dtype = torch.bfloat16 if mesh.device.type == "cuda" else torch.float32
    from .plan_cmd import load_skeleton

    config, skeleton = load_skeleton(cfg.model)
    lora, slots = _lora(cfg, skeleton)
    del skeleton
    quant = None if cfg.quant == "none" else cfg.quant
    model = qm.from_pretrained(cfg.model, mesh, quant=quant, lora=lora, dtype=dtype, progress=False)
    model.eval()
    if cfg.keep_dequantized:
        _keep_dequantized(model, mesh.device, dtype)
    bank = AdapterBank(model, slots=cfg.slots, dtype=autocast_dtype(mesh.device))
    for name, slot in slots.items():
        bank.load(slot, cfg.adapters[name])
    lockstep = Lockstep(mesh.tp_group, mesh.device, control_group(mesh.tp_group))
    max_len = cfg.max_model_len or int(config.max_position_embeddings)
    say = (
        (lambda m: print(f"quantmesh serve: {m}", file=sys.stderr, flush=True))
        if mesh.tp_rank == 0
        else None
    )
    chunk = 512 if cfg.prefill_chunk is None else cfg.prefill_chunk
    batch, engine = choose_engine(
        cfg, mesh.device.type,
        lambda: SlotBatch(model, bank, max_batch=cfg.max_batch, max_len=max_len,
                          agree=lockstep.agree, share=lockstep.share, chunk=chunk or None,
                          graphs=cfg.cuda_graphs or CUDA_GRAPHS[0]),
        lambda: Batch(model, bank, agree=lockstep.agree, share=lockstep.share), lockstep.agree,
        say,
    )  # fmt: skip
    _freeze_garbage(say)
    if mesh.tp_rank != 0:
        # rank 0 decides when to stop (after its graceful shutdown); a follower that left on the
        # launcher's SIGTERM or SIGINT (Ctrl-C, forwarded) would break the in-flight steps
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        follow(batch, lockstep)
        return 0
    tok = AutoTokenizer.from_pretrained(cfg.model)
    assert say is not None  # rank 0's
    return _serve(cfg, batch, lockstep, tok, model, slots, max_len, engine, say)


def _freeze_garbage(say: Callable[[str], None] | None) -> None:
    """What the start made (the model, the compiled graphs, their guards) lives as long as the
    server: one full collection, then those objects are moved out of the garbage collector's
    reach (`gc.freeze`), so that no collection during serving walks them all while every request
    waits. A collection that still pauses serving for over `GC_PAUSE_S` is said."""
    import gc
    import time

    t0 = time.perf_counter()
    gc.collect()
    took = time.perf_counter() - t0
    gc.freeze()
    if say is None:
        return
    say(f"{gc.get_freeze_count():,} objects kept out of garbage collection (a full collection "
        f"of them took {took:.2f} s)")  # fmt: skip
    started: list[float] = [0.0]

    def watch(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
            return
        paused = time.perf_counter() - started[0]
        if paused > GC_PAUSE_S:
            say(f"a garbage collection (generation {info.get('generation')}) paused serving "
                f"for {paused:.2f} s")  # fmt: skip

    gc.callbacks.append(watch)


def _keep_dequantized(model: Any, device: Any, dtype: Any) -> None:
    """`--keep-dequantized`: every 4-bit weight held dequantized, after checking that it fits 90% of
    the free GPU memory (ServeError naming the fix otherwise; no check on CPU)."""
    import torch

    from ..parallel.held import dequantized_bytes, keep_dequantized
    from ..serve.engine import ServeError

    need = dequantized_bytes(model, dtype)
    if need == 0:
        raise ServeError(
            "--keep-dequantized: the model has no 4-bit linear layers (serve it with --quant nf4 "
            "or fp4, or leave the flag out)"
        )
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if need > 0.9 * free:
            raise ServeError(
                f"--keep-dequantized needs {need / 2**30:.1f} GiB for the dequantized weights and "
                f"{free / 2**30:.1f} GiB are free on {device}; leave the flag out, or serve at a "
                "larger --tp"
            )
    keep_dequantized(model, dtype)


def choose_engine(
    cfg: ServeConfig,
    device_type: str,
    slot_batch: Callable[[], Any],
    dynamic_batch: Callable[[], Any],
    agree: Callable[[list[bool]], list[bool]],
    say: Callable[[str], None] | None,
) -> tuple[Any, str]:
    """The serving batch and its engine's name. `--engine auto`: the slot engine on GPUs (its gain
    is its CUDA graphs) when it can serve the model and its KV slots fit every tp rank's GPU, and
    the dynamic engine otherwise, saying why; `--engine slots` refuses what auto falls back on.
    Every rank takes the same engine (`agree`), then warms the slot engine up (its compiles'
    collectives meet).

    Example:
        >>> choose_engine(cfg, "cpu", make_slots, make_dynamic, agree, print)  # doctest: +SKIP
        (<Batch>, 'dynamic')
    """
    from ..serve.engine import ServeError

    engine = cfg.engine
    if engine == "auto":
        engine = "slots" if device_type == "cuda" else "dynamic"
    if engine == "slots":
        try:
            batch = slot_batch()
            problem = batch.memory_problem()
        except ServeError as e:
            if cfg.engine == "slots":
                raise
            batch, problem = None, str(e)
        if agree([problem is None])[0]:
            batch.warm_up(say)
            return batch, "slots"
        why = problem or "it does not fit another tp rank"
        if cfg.engine == "slots":
            raise CliError(why)
        if say is not None:
            say(f"engine dynamic (eager, growing KV caches), not the faster slot engine: {why}")
    if cfg.prefill_chunk and say is not None:  # never silently ignored
        say(f"--prefill-chunk {cfg.prefill_chunk} is not used: the dynamic engine prefills whole "
            "prompts")  # fmt: skip
    return dynamic_batch(), "dynamic"


def _serve(
    cfg: ServeConfig,
    batch,
    lockstep,
    tok,
    model,
    slots: dict[str, int],
    max_len: int,
    engine: str,
    say: Callable[[str], None],
) -> int:
    import asyncio
    import logging
    import math
    import signal
    import socket
    import threading
    import time

    import uvicorn

    from ..serve.app import ServeInfo, build_app
    from ..serve.scheduler import Scheduler
    from .runner import launcher_gone

    eos = model.generation_config.eos_token_id
    eos = tok.eos_token_id if eos is None else eos
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    sched = Scheduler(batch, lockstep, tok, eos_ids=eos_ids, max_batch=cfg.max_batch,
                      adapters=slots)  # fmt: skip
    adapter_dir = None
    if cfg.adapter_dir is not None:
        adapter_dir = str(Path(cfg.adapter_dir).expanduser().resolve())
    info = ServeInfo(
        base=cfg.base_name, max_model_len=max_len, created=int(time.time()), grace_s=cfg.grace_s,
        vocab_size=getattr(model.config, "vocab_size", None), max_tokens=cfg.max_tokens,
        max_choices=cfg.max_choices, api_key=os.environ.get(API_KEY_ENV) or None,
        adapter_dir=adapter_dir, max_body=cfg.max_request_bytes,
    )  # fmt: skip
    app = build_app(sched, tok, info)

    class Server(uvicorn.Server):
        first_exit = 0.0  # when the first signal came

        def handle_exit(self, sig: int, frame: Any) -> None:
            # SIGTERM or Ctrl-C (SIGINT): the first drains the running requests for up to --grace
            # seconds, a second one stops at once. A terminal's Ctrl-C reaches this rank twice,
            # from the terminal (one process group) and forwarded by the launcher, within
            # milliseconds: a signal within SAME_PRESS_S of the first is that same press. Not
            # re-raised after the server returns (uvicorn's own handler would re-raise a SIGINT
            # as a KeyboardInterrupt here, before the tp ranks were told to stop).
            now = time.monotonic()
            if not self.should_exit:
                self.first_exit = now
            elif now - self.first_exit > SAME_PRESS_S:
                self.force_exit = True
            self.should_exit = True

    # lifespan off: the app has no startup or shutdown handlers, and a stop at once (a second
    # Ctrl-C) left uvicorn's lifespan task to be cancelled with a traceback
    server = Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                   timeout_graceful_shutdown=max(1, math.ceil(cfg.grace_s))))  # fmt: skip

    def asked_for(record: logging.LogRecord) -> bool:
        # a stop at once cancels the running streams: that is what was asked, not an error
        err = record.exc_info[1] if record.exc_info else None
        return not (server.force_exit and isinstance(err, asyncio.CancelledError))

    logging.getLogger("uvicorn.error").addFilter(asked_for)

    def fatal(e: BaseException) -> None:
        server.should_exit = True

    sched.on_fatal = fatal
    sched.on_slow = say
    # the serving loop shares the interpreter with the HTTP server, which writes every stream's
    # tokens while a step runs: a loop whose step has ended waits for the GIL until the server
    # thread hands it over, by default after up to 5 ms (a decode step of 32 rows is about 10)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    loop = threading.Thread(target=sched.run, name="quantmesh-serve-loop", daemon=True)
    loop.start()
    parent = os.getppid()

    def watch_launcher() -> None:  # a launcher killed outright cannot stop us: stop ourselves
        while not server.should_exit:
            if launcher_gone(parent):
                print("quantmesh serve: the launcher is gone; stopping", flush=True)
                server.should_exit = True
            time.sleep(1.0)

    threading.Thread(target=watch_launcher, name="quantmesh-serve-watch", daemon=True).start()
    fam = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
    sock = socket.socket(fam, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((cfg.host, cfg.port))
    except OSError as e:
        sched.stop()
        loop.join()
        raise CliError(
            f"cannot listen on {cfg.host}:{cfg.port}: {e}; pick another --port"
        ) from None
    host, port = sock.getsockname()[:2]
    names = ", ".join([cfg.base_name, *slots]) if slots else cfg.base_name
    print(f"quantmesh serve: {names} on http://{host}:{port} (tp {cfg.tp}, engine {engine})",
          flush=True)  # fmt: skip
    # uvicorn puts back the handlers it found when it returns: ignored, so that a signal during
    # the stop (the launcher SIGTERMs every rank as it shuts down; a supervisor may send more)
    # cannot end this rank, by SIGTERM's default action, before it told the other ranks to stop.
    # A stop that hangs is the launcher's to end (SIGKILL after its shutdown timeout).
    if threading.current_thread() is threading.main_thread():  # (handlers are the main thread's)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    server.run(sockets=[sock])
    sched.stop()
    loop.join(timeout=60)
    if sched.error is not None:
        raise RuntimeError(
            f"the decoding loop failed (when another tp rank died, its error is above): "
            f"{type(sched.error).__name__}: {sched.error}"
        ) from sched.error
    return 0
