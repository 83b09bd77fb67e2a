"""The LoRA training loop behind `quantmesh finetune` and `quantmesh demo`, usable on its own.

One optimizer step = `grad_accum` micro-batches on every dp rank, run by `train_step`
(train/step.py) at every pp: the loss of a step is the mean over every next-token target of the
whole global batch (all micro-batches, all dp ranks), so a step gives the same gradient for any
dp x pp x grad_accum split of the same global batch. The loss is the chunked one
(`loss_chunk_tokens`) at pp = 1.

Determinism: the data order depends only on (seed, epoch) (`data.iterate_batches`), and the RNG
(dropout) is reseeded every step from (seed, step, dp rank): tp ranks of one replica draw the same
numbers, and a resumed run continues exactly where a checkpoint was taken.

Example:
    >>> result = train(model, mesh, dataset, TrainConfig(steps=100, lr=2e-4), output_dir="out")
    ...                                                               # doctest: +SKIP
"""

from __future__ import annotations

import itertools
import json
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..config import TrainConfig, TrainError
from ..io.adapter import save_adapter
from ..io.resume import load_state, save_state
from ..lora.adapter import trainable_parameters
from ..parallel.state import parallel_state
from .clip import clip_grad_norm_
from .loss import chunked_loss_sum, plain_loss_sum
from .step import autocast, eval_loss_sum, train_step

__all__ = ["TrainConfig", "TrainResult", "evaluate", "lr_at", "train"]


@dataclass
class TrainResult:
    """What a run did, as seen by this rank."""

    steps: int
    """The last optimizer step completed."""
    losses: list[float] = field(default_factory=list)
    """Training loss of each step this process ran."""
    eval_losses: dict[int, float] = field(default_factory=dict)
    """Evaluation loss by step; step 0 is the model before training (a run that starts at 0)."""
    tokens_per_s: float = 0.0
    """Mean training throughput of this process, input tokens over all dp ranks."""


def lr_at(step: int, cfg: TrainConfig, total: int) -> float:
    """Learning rate of optimizer step `step` (0-based) out of `total`.

    Example:
        >>> cfg = TrainConfig(lr=1.0, warmup_steps=2, schedule="linear")
        >>> [round(lr_at(s, cfg, 6), 2) for s in range(6)]
        [0.5, 1.0, 1.0, 0.75, 0.5, 0.25]
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    span = max(1, total - cfg.warmup_steps)
    frac = (step - cfg.warmup_steps) / span  # 0 at the end of warm-up, -> 1 at the last step
    if cfg.schedule == "linear":
        return cfg.lr * (1.0 - frac)
    return cfg.lr * 0.5 * (1.0 + math.cos(math.pi * frac))


def _device(model: nn.Module) -> torch.device:
    st = parallel_state(model, required=False)  # a plain model too: evaluate takes one
    if st is not None:
        return st.mesh.device
    return next(model.parameters()).device


def loss_sum(
    model: nn.Module, batch: dict[str, torch.Tensor], chunk_tokens: int = 0
) -> tuple[torch.Tensor, int]:
    """(summed next-token cross-entropy over labelled tokens, their count) of one micro-batch;
    `chunk_tokens` > 0: the chunked loss (train/loss.py), never the whole logits at once.

    Example:
        >>> total, n = loss_sum(model, {"input_ids": ids, "labels": ids})  # doctest: +SKIP
    """
    device = _device(model)
    ids = batch["input_ids"].to(device)  # (B, T)
    labels = batch["labels"].to(device)  # (B, T); the model predicts position t+1 at t
    with autocast(device):
        if chunk_tokens > 0:
            return chunked_loss_sum(model, ids, labels, chunk_tokens=chunk_tokens)
        return plain_loss_sum(model, ids, labels)


def _all_sum(values: list[float], mesh, device: torch.device) -> list[float]:
    """Sum floats over the dp group (tp ranks of one replica hold the same values already)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if mesh is not None and mesh.dp > 1:
        dist.all_reduce(t, group=mesh.dp_group)
    return t.tolist()


@torch.no_grad()
def evaluate(model: nn.Module, examples: list, micro_batch: int) -> float:
    """Mean next-token loss over `examples`, split over the dp ranks. Collective.

    Example:
        >>> evaluate(model, dataset.eval, micro_batch=4)  # doctest: +SKIP
        2.87
    """
    st = parallel_state(model, required=False)
    dp, dp_rank = (st.mesh.dp, st.mesh.dp_rank) if st is not None else (1, 0)
    was_training = model.training
    model.eval()
    mine = examples[dp_rank::dp]
    total, count = 0.0, 0
    # FSDP: each forward gathers over dp, so every dp rank runs as many as the one with the most
    most = len(examples[0::dp]) if st is not None and st.sharded is not None else len(mine)
    for i in range(0, most, micro_batch):
        rows = mine[i : i + micro_batch]
        batch = {
            k: torch.stack([r[k] for r in rows or examples[:1]]) for k in ("input_ids", "labels")
        }
        if st is not None and st.mesh.pp > 1:  # through the pipeline stages, forward only
            s, n = eval_loss_sum(model, batch)
        else:
            s, n = loss_sum(model, batch)
        if rows:  # else a forward for the gathers only; its loss is not counted
            total, count = total + float(s), count + n
    total_all, count_all = _all_sum(
        [total, count], st.mesh if st is not None else None, _device(model)
    )
    model.train(was_training)
    return total_all / max(count_all, 1.0)


def _micro_batches(examples, cfg: TrainConfig, mesh, start_micro: int) -> Iterator[dict]:
    """This dp rank's micro-batches forever (epoch after epoch), from micro-batch `start_micro`."""
    from .data import iterate_batches, steps_per_epoch

    dp, dp_rank = (mesh.dp, mesh.dp_rank) if mesh is not None else (1, 0)
    per_epoch = steps_per_epoch(len(examples), cfg.micro_batch, dp)
    epoch, skip = divmod(start_micro, per_epoch)
    for e in itertools.count(epoch):
        it = iterate_batches(
            examples, cfg.micro_batch, dp_rank=dp_rank, dp_size=dp, seed=cfg.seed, epoch=e
        )
        yield from itertools.islice(it, skip if e == epoch else 0, None)


def total_steps(num_examples: int, cfg: TrainConfig, dp: int) -> int:
    """Optimizer steps of the run: cfg.steps, or epochs x (global batches per epoch / grad_accum).

    Example:
        >>> total_steps(100, TrainConfig(micro_batch=2, grad_accum=2, epochs=1.0), dp=1)
        25
    """
    if cfg.steps is not None:
        return cfg.steps
    per_epoch = num_examples // (cfg.micro_batch * dp)
    steps = int((cfg.epochs or 1.0) * per_epoch) // cfg.grad_accum
    if steps < 1:
        raise TrainError(
            f"{num_examples} training examples make no full optimizer step of "
            f"micro_batch={cfg.micro_batch} x dp={dp} x grad_accum={cfg.grad_accum}; "
            "lower those, raise --epochs, or add data"
        )
    return steps


def _step_seed(seed: int, step: int, dp_rank: int) -> int:
    # Same on the tp ranks of one replica (their dropout masks on replicated inputs must agree).
    return (seed * 1_000_003 + step * 7_919 + dp_rank * 104_729) % (2**63)


def resolve_resume(path: str | Path) -> Path:
    """The checkpoint folder to resume from: `path` itself (holding state/), or the latest
    checkpoints/step-N of an output dir.

    Example:
        >>> resolve_resume("out")  # doctest: +SKIP
        PosixPath('out/checkpoints/step-000040')
    """
    p = Path(path).expanduser()
    if (p / "state").is_dir():
        return p
    steps = sorted((p / "checkpoints").glob("step-*/state"))
    if steps:
        return steps[-1].parent
    raise FileNotFoundError(
        f"nothing to resume at {str(p)!r}: expected a checkpoint folder holding state/ "
        "(OUTPUT/checkpoints/step-N) or an output dir with checkpoints/; "
        "checkpoints are written every --save-every steps and at the end"
    )


def _read_metrics(path: Path, upto: int) -> list[dict]:
    if not path.is_file():
        return []
    rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    return [r for r in rows if r["step"] <= upto]


def _save_checkpoint(model, opt, out: Path, step: int) -> Path:
    ckpt = out / "checkpoints" / f"step-{step:06d}"
    save_adapter(model, ckpt / "adapter")
    save_state(model, opt, ckpt / "state", step=step)
    return ckpt


def train(
    model: nn.Module,
    dataset,
    cfg: TrainConfig,
    *,
    output_dir: str | Path,
    resume: str | Path | None = None,
    on_step: Callable[[dict], None] | None = None,
) -> TrainResult:
    """Train the model's trainable parameters (its LoRA adapters) with AdamW; save as it goes.

    Collective: every rank calls it with the same arguments. `dataset` has `.train` and `.eval`
    lists of {"input_ids", "labels"} (`quantmesh.data.build_dataset`). Writes, on global rank 0:
    OUTPUT/metrics.jsonl (one line per step), OUTPUT/adapter (PEFT, at the end),
    OUTPUT/checkpoints/step-N/{adapter,state} (every save_every steps and at the end) and
    OUTPUT/loss.png.

    Example:
        >>> model = qm.from_pretrained("model_dir", mesh, quant="nf4", lora=qm.LoraConfig(r=16))
        ...                                                                 # doctest: +SKIP
        >>> train(model, build_dataset(["a.txt"], tok, 256), TrainConfig(steps=50),
        ...       output_dir="out")                                         # doctest: +SKIP
    """
    mesh = parallel_state(model).mesh  # a model from qm.parallelize or qm.from_pretrained
    out = Path(output_dir)
    rank0 = mesh.rank == 0
    params = trainable_parameters(model)
    if not params:
        raise TrainError("the model has no trainable parameters; parallelize it with lora=...")
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    if len(dataset.train) < cfg.micro_batch * mesh.dp:
        raise TrainError(
            f"{len(dataset.train)} training examples are fewer than one global batch of "
            f"micro_batch={cfg.micro_batch} x dp={mesh.dp}; lower those or seq_len, or add data"
        )
    total = total_steps(len(dataset.train), cfg, mesh.dp)
    start = 0
    if resume:
        state = resolve_resume(resume) / "state"
        saved = load_state(model, opt, state)
        if saved is None:  # save_state(step=None): a state this loop did not write
            raise TrainError(
                f"{str(state)!r} holds no step count (saved by save_state without step=); "
                "resume from a checkpoint written by train, or call load_state yourself"
            )
        start = saved
    if start >= total:
        raise TrainError(
            f"the checkpoint is at step {start}, "
            + (f"past this run's {total} steps" if start > total else "this run's last step")
            + ": nothing is left to train; raise steps (or epochs) to train on from it"
        )

    metrics = out / "metrics.jsonl"
    history = _read_metrics(metrics, start) if resume else []
    if rank0:
        out.mkdir(parents=True, exist_ok=True)
        metrics.write_text("".join(json.dumps(r) + "\n" for r in history))
    seq = dataset.train[0]["input_ids"].shape[0]
    step_tokens = cfg.micro_batch * seq * cfg.grad_accum * mesh.dp
    tokens = history[-1]["tokens"] if history else start * step_tokens
    elapsed0 = history[-1]["elapsed"] if history else 0.0
    batches = _micro_batches(dataset.train, cfg, mesh, start * cfg.grad_accum)
    result = TrainResult(steps=start)

    if dataset.eval and start == 0:  # the baseline: held-out loss before any update
        result.eval_losses[0] = round(evaluate(model, dataset.eval, cfg.micro_batch), 6)
        if rank0:
            print(f"eval loss before training: {result.eval_losses[0]:.4f}", flush=True)
    bar = None
    if rank0 and cfg.progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, initial=start, desc="train", unit="step", dynamic_ncols=True)
    model.train()
    t_start = time.perf_counter()
    train_time = 0.0
    for step in range(start, total):
        t0 = time.perf_counter()
        torch.manual_seed(_step_seed(cfg.seed, step, mesh.dp_rank))
        lr = lr_at(step, cfg, total)
        for g in opt.param_groups:
            g["lr"] = lr
        micro = [next(batches) for _ in range(cfg.grad_accum)]
        whole = {k: torch.cat([b[k] for b in micro]) for k in ("input_ids", "labels")}
        # one step at every pp: accumulated over the micro-batches at pp = 1 (the chunked loss),
        # the pipeline schedule at pp > 1; the mean over every target of the global batch
        loss = float(
            train_step(
                model,
                whole,
                microbatches=len(micro),
                schedule=cfg.pp_schedule,
                chunk_tokens=cfg.loss_chunk_tokens if mesh.pp == 1 else 0,
            )
        )
        if cfg.max_grad_norm > 0:
            clip_grad_norm_(model, cfg.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        train_time += dt
        tokens += step_tokens
        n = step + 1
        rec = {
            "step": n,
            "loss": round(loss, 6),
            "lr": lr,
            "tokens": tokens,
            "tokens_per_s": round(step_tokens / dt, 2),
            "elapsed": round(elapsed0 + time.perf_counter() - t_start, 3),
        }
        if dataset.eval and ((cfg.eval_every and n % cfg.eval_every == 0) or n == total):
            rec["eval_loss"] = round(evaluate(model, dataset.eval, cfg.micro_batch), 6)
            result.eval_losses[n] = rec["eval_loss"]
        result.losses.append(loss)
        result.steps = n
        if rank0:
            with metrics.open("a") as f:
                f.write(json.dumps(rec) + "\n")
        if bar is not None:
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{step_tokens / dt:.0f}", lr=f"{lr:.1e}")
            bar.update(1)
        if on_step is not None:
            on_step(rec)
        if cfg.save_every and n % cfg.save_every == 0 and n != total:
            _save_checkpoint(model, opt, out, n)
    if bar is not None:
        bar.close()
    result.tokens_per_s = (total - start) * step_tokens / max(train_time, 1e-9)
    _save_checkpoint(model, opt, out, total)
    save_adapter(model, out / "adapter")
    if rank0:
        plot_losses(metrics, out / "loss.png", baseline=result.eval_losses.get(0))
    return result


def plot_losses(
    metrics: str | Path, png: str | Path, *, title: str | None = None, baseline: float | None = None
) -> Path:
    """Draw loss (and eval loss) against step from a metrics.jsonl into a PNG (matplotlib, Agg).

    One step's loss is noisy (a small batch each time), so a moving average over about a sixth
    of the run is drawn over it; `baseline` is the eval loss before training, drawn at step 0.

    Example:
        >>> plot_losses("out/metrics.jsonl", "out/loss.png")  # doctest: +SKIP
        PosixPath('out/loss.png')
    """
    import matplotlib

    matplotlib.use("Agg")  # no display needed, and never a window popping up mid-training
    import matplotlib.pyplot as plt

    rows = [json.loads(ln) for ln in Path(metrics).read_text().splitlines() if ln.strip()]
    steps, losses = [r["step"] for r in rows], [r["loss"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(steps, losses, color="tab:blue", alpha=0.35, lw=1, label="train loss (per step)")
    w = max(1, len(rows) // 6)
    if w > 1:
        avg = [sum(losses[max(0, i - w + 1) : i + 1]) / (i + 1 - max(0, i - w + 1))
               for i in range(len(losses))]  # fmt: skip
        ax.plot(steps, avg, color="tab:blue", lw=2, label=f"train loss ({w}-step mean)")
    ev = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    if baseline is not None:
        ev.insert(0, (0, baseline))
    if ev:
        ax.plot(*zip(*ev, strict=True), "o-", color="tab:orange", label="eval loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title or f"{Path(metrics).parent.name}: loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    png = Path(png)
    fig.savefig(png)
    plt.close(fig)
    return png
