"""What launched workers run: `python -m quantmesh.cli.worker {finetune,generate,demo,verify,serve} JSON`.

The launching command has already validated everything it could; the JSON holds its resolved
settings, so every rank runs exactly the same thing. A failure becomes one line naming the rank
(runner.worker_main); the traceback of an unexpected one is kept in OUTPUT/logs/rank-R.log.

Example:
    $ torchrun --nproc-per-node 2 -m quantmesh.cli.worker finetune '{"model": "m", ...}'
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

__all__ = [
    "FORKABLE",
    "KINDS",
    "compile_for_training",
    "forked",
    "main",
    "name_process",
    "run_in_place",
    "setup_worker",
    "worker_environment",
]


def worker_environment() -> None:
    """The environment a worker's libraries read when imported, and their import-time chatter
    (printed once per rank) quieted: before any of them is imported, in a worker or in the fork
    server workers start from (`quantmesh.cli.preload`)."""
    # Models and tokenizers come from local folders (checked by the launching command); never let
    # a typo turn into minutes of hub retries on every rank.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # CUDA memory in segments that grow in place: near a card's limit the default allocator's
    # cached blocks of the wrong sizes ran a run out of memory that expandable segments train
    # (docs/benchmarks.md, "Figures the code relies on"). A user's own setting wins. Read when
    # CUDA first allocates, so it is set before anything does.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    from .errors import quiet_libraries

    quiet_libraries()


def compile_for_training(model: Any, *, cuda_graphs: bool = False) -> int:
    """Compile the model's decoder layers for a training run (`qm.compile_blocks`); with
    `cuda_graphs` in torch.compile's mode "reduce-overhead" (each layer's forward and backward
    replayed from CUDA graphs), and the 4-bit weights dequantized by quantmesh's Triton kernel under
    autograd (`kernel4.DEQUANT_TRAINING`), whose host cost a replay does not pay, unless
    $QUANTMESH_TRITON_DEQUANT_TRAINING says otherwise. Returns the number of layers compiled.

    Example:
        >>> compile_for_training(model, cuda_graphs=True)  # doctest: +SKIP
        32
    """
    import quantmesh as qm

    if not cuda_graphs:
        return qm.compile_blocks(model)
    from ..quant import kernel4

    if os.environ.get("QUANTMESH_TRITON_DEQUANT_TRAINING", "") == "":
        kernel4.DEQUANT_TRAINING = True
    return qm.compile_blocks(model, mode="reduce-overhead")


def setup_worker() -> None:
    """The worker's environment (`worker_environment`), its CPU threads sized to its share of the
    host's cores, and its process named after its rank (`qm-rank0`, ... in ps and top)."""
    worker_environment()
    name_process(f"qm-rank{os.environ.get('RANK', '0')}")
    import torch

    if not torch.cuda.is_available():
        # Ranks of one host share its cores; more threads than cores only adds contention.
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()


def finetune(payload: str) -> int:
    """A finetune worker: mesh, tokenizer, data, model, train, save (every rank)."""
    import torch
    from transformers import AutoTokenizer

    import quantmesh as qm

    from ..train.data import shared_dataset
    from ..train.loop import train
    from .finetune import FinetuneConfig

    cfg = FinetuneConfig.from_json(payload)
    par, act = cfg.parallel, cfg.activations
    mesh = qm.init_mesh(tp=par.tp, pp=par.pp, dp=-1)
    rank0 = mesh.rank == 0
    tok = AutoTokenizer.from_pretrained(cfg.model)
    # a user's mistake raises a QuantmeshError (DataError, TrainError, ...): worker_main reports it
    # as one line with exit code 2, like every other command. One rank per host reads and
    # tokenizes into OUTPUT/data-cache (reused while the files and settings stay the same); every
    # rank maps that file.
    dataset = shared_dataset(
        cfg.data,
        tok,
        cfg.seq_len,
        cache_dir=Path(cfg.output_dir).expanduser() / "data-cache",
        eval_fraction=cfg.eval_fraction,
        seed=cfg.train.seed,
        data_format=cfg.data_format,
        train_on=cfg.train_on,
        packing=cfg.packing,
    )
    if rank0:  # what each file held, the text the chat template added, the examples
        print(dataset.summary(), flush=True)
    dtype = torch.bfloat16 if mesh.device.type == "cuda" else torch.float32
    model = qm.from_pretrained(
        cfg.model,
        mesh,
        quant=cfg.quant_config(),
        lora=cfg.lora,
        dtype=dtype,
        progress=rank0,
        pipeline=cfg.pipeline if par.pp > 1 else None,
        fsdp=par.fsdp,
        offload_base=par.offload_base,
    )
    if par.keep_dequantized:  # in the dtype the 4-bit matmuls compute in: the codes' values
        from ..quant.kinds import compute_dtype_for

        qc = cfg.quant_config()
        assert qc is not None  # ParallelConfig refuses keep_dequantized without a 4-bit quant
        blocks = par.keep_dequantized_blocks
        held = qm.keep_dequantized(model, compute_dtype_for(qc, mesh.device), blocks=blocks)
        if rank0:
            of = "" if blocks is None else f" (the first {blocks} decoder layers')"
            print(f"keep-dequantized: {held / 2**30:.2f} GiB of 4-bit weights held{of}", flush=True)
    if act.checkpointing:
        qm.checkpoint_blocks(
            model,
            offload=act.offload_activations,
            tile_tokens=act.tile_tokens or None,
            blocks=act.checkpoint_blocks,
        )
    if act.compile_on(mesh.device.type == "cuda"):
        n = compile_for_training(model, cuda_graphs=act.cuda_graphs)
        if rank0:
            graphs = ", replayed from CUDA graphs" if act.cuda_graphs else ""
            print(
                f"compile: {n} blocks{graphs}; the first steps compile them (tens of seconds)",
                flush=True,
            )
    result = train(model, dataset, cfg.train, output_dir=cfg.output_dir, resume=cfg.resume)
    if rank0:
        out = Path(cfg.output_dir)
        last = result.losses[-1] if result.losses else float("nan")
        ev = (
            f", eval loss {list(result.eval_losses.values())[-1]:.4f}" if result.eval_losses else ""
        )
        print(
            f"done: step {result.steps}, loss {last:.4f}{ev}, "
            f"{result.tokens_per_s:.0f} tokens/s\n"
            f"  adapter      {out / 'adapter'}\n"
            f"  checkpoints  {out / 'checkpoints'} (resume with --resume {out})\n"
            f"  metrics      {out / 'metrics.jsonl'}\n"
            f"  loss plot    {out / 'loss.png'}",
            flush=True,
        )
    return 0


def generate(payload: str) -> int:
    """A generate worker: load on tp ranks (with the adapter), answer each prompt."""
    import torch
    from transformers import AutoTokenizer

    import quantmesh as qm

    from ..io.adapter import adapter_lora_config
    from .generate import GenerateConfig, generate_text

    cfg = GenerateConfig(**json.loads(payload))
    mesh = qm.init_mesh(tp=cfg.tp, dp=1)
    lora = adapter_lora_config(cfg.adapter) if cfg.adapter else None
    dtype = torch.bfloat16 if mesh.device.type == "cuda" else torch.float32
    quant = None if cfg.quant == "none" else cfg.quant
    model = qm.from_pretrained(cfg.model, mesh, quant=quant, lora=lora, dtype=dtype, progress=False)
    if cfg.adapter:
        qm.load_adapter(model, cfg.adapter)
    tok = AutoTokenizer.from_pretrained(cfg.model)
    for i, prompt in enumerate(cfg.prompts):
        if mesh.rank == 0 and len(cfg.prompts) > 1:
            print(f"{'' if i == 0 else chr(10)}>>> {prompt}", flush=True)
        generate_text(model, tok, prompt, cfg, stream=True)
        if mesh.rank == 0:
            print(flush=True)
    return 0


def demo(payload: str) -> int:
    from .demo import demo_worker

    return demo_worker(payload)


def verify(payload: str) -> int:
    from .verify_cmd import verify_worker

    return verify_worker(payload)


def serve(payload: str) -> int:
    from .serve import serve_worker

    return serve_worker(payload)


KINDS = {"finetune": finetune, "generate": generate, "demo": demo, "verify": verify, "serve": serve}
# The kinds that may run as forked workers (cli/launch.py; docs/design.md, "On a Linux host
# without CUDA, workers are forks").
FORKABLE = ("finetune", "generate", "demo", "verify", "serve")
# The kinds whose workers end when stopped (SIGTERM or Ctrl-C, drained) or on a failure: mostly
# by the launcher, which then, shutting down, no longer collects a forked worker's result (a
# worker that returned would wait for it, in torch's `_wrap`, until the agent kills it 30 s
# later); sometimes on their own (a signal to one rank), when the launcher, still watching,
# waits for every worker's result. A forked worker of these kinds returns its result and ends
# its process itself `UNCOLLECTED_S` later if the launcher has not collected it by then (a
# worker of any kind as soon as its launcher is gone: `runner.LauncherWatch`).
ENDS_WHEN_STOPPED = ("serve",)
UNCOLLECTED_S = 1.0
"""A watching launcher collects a result within its monitor interval (torchrun's 0.1 s)."""


def run_in_place(kind: str, payload: str) -> int:
    """Run worker `kind` in this process (already one of torchrun's ranks). Returns the exit code.

    Example:
        >>> run_in_place("generate", json.dumps({"model": "m", "prompts": ["Hi"]}))  # doctest: +SKIP
        0
    """
    setup_worker()
    out = json.loads(payload).get("output_dir")
    log_dir = Path(out) / "logs" if out else None
    from .runner import worker_main

    rc = worker_main(lambda: KINDS[kind](payload), log_dir=log_dir)
    import torch.distributed as dist

    # On failure, leave at once: the launcher stops the other ranks, and tearing down a group that
    # still has peers inside a collective could wait on them.
    if rc == 0 and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    return rc


def forked(kind: str, payload: str) -> int:
    """A forked worker (cli/launch.py: from the launcher's fork server, or from the launcher
    itself): `run_in_place`, and a failure's exit code as the process's own, as a worker run by
    `python -m` would end.

    Example:
        >>> launch(2, [], fn=forked, fn_args=("generate", payload))  # doctest: +SKIP
        0
    """
    from .runner import LauncherWatch

    _as_started_fresh()
    watch = LauncherWatch.start()
    try:
        rc = run_in_place(kind, payload)
    except KeyboardInterrupt:
        rc = 130
    except Exception:  # noqa: BLE001 - before worker_main could report it (the worker's imports)
        traceback.print_exc()  # as a fresh interpreter prints it, for the launcher's "above"
        rc = 1
    if rc:
        sys.stdout.flush()
        sys.stderr.flush()
        sys.exit(rc)
    # the result goes back through torch's `_wrap`, which then waits for the launcher to collect
    # it: a launcher that was stopped (serve) or is gone (killed outright) never will
    watch.finished(UNCOLLECTED_S if kind in ENDS_WHEN_STOPPED else None)
    return 0


def _as_started_fresh() -> None:
    """What a fresh process starts with, where a fork of the launcher itself (torchrun's `fork`)
    would inherit the launcher's own: stdout and stderr as the process's file descriptors 1 and
    2 (the launcher captures its Python-level stderr while workers run: `runner.run_workers`),
    and the default SIGTERM and Ctrl-C handling (torchrun's agent turns both into an exception
    in its process). A no-op in a fork server's child, which has them already."""
    import signal

    sys.stdout = sys.__stdout__ or sys.stdout
    sys.stderr = sys.__stderr__ or sys.stderr
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def name_process(name: str) -> None:
    """Name this process (Linux: what ps, top and psutil show; 15 characters at most); a no-op
    where the platform has no such call.

    Example:
        >>> name_process("qm-rank0")
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> int:
    """`python -m quantmesh.cli.worker KIND JSON`."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] not in KINDS:
        print(f"usage: python -m quantmesh.cli.worker {{{','.join(KINDS)}}} JSON", file=sys.stderr)
        return 2
    from .runner import LAUNCHER_ENV, LauncherWatch

    if os.environ.get(LAUNCHER_ENV) or os.environ.get("TORCHELASTIC_RUN_ID"):
        LauncherWatch.start()  # a launcher gone before this rank joined the others ends it
    return run_in_place(argv[0], argv[1])


if __name__ == "__main__":
    from .runner import exit_fast

    exit_fast(main)
