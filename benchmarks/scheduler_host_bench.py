"""The serving loop's host work per decode step, with no model: `quantmesh.serve`'s Scheduler over
a stand-in batch whose step is one tiny op (each row's next token is its last + 1), its replies'
events posted to a real asyncio loop on another thread, as the HTTP side receives them. What it
measures is what the loop's host spends a step on rows (plans, the tokens' read-back, their text,
the events), which on a GPU runs while the device computes the next step: where it reaches the
device's step time, the device waits (docs/benchmarks.md, the server's `host_s`).

--post picks how events reach the loop: "mail" (the server's: one wake-up for a step's events)
or "each" (one `call_soon_threadsafe` per event, as before). The tokenizer is a word-level one
built here.

Usage (from the repository root, CPU):
    python3 benchmarks/scheduler_host_bench.py [--rows 64] [--tokens 200] [--repeat 3]
        [--post mail|each] [--out DIR]
Writes DIR/scheduler_host.json (default DIR: .bench/scheduler-host).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from quantmesh.serve.app import _Mail
from quantmesh.serve.engine import Plan
from quantmesh.serve.ranks import Lockstep
from quantmesh.serve.scheduler import Sampling, Scheduler


def tokenizer() -> Any:
    """A word-level fast tokenizer of 500 words (and an EOS), built in memory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(500)} | {"</s>": 500}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.decoder = decoders.WordPiece(prefix="##")  # words joined by spaces
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="</s>")


class StandIn:
    """Plays Batch with no model: each row's next token is its last + 1 (one-hot logits)."""

    def __init__(self, vocab: int) -> None:
        self.vocab, self.device, self.chunk = vocab, torch.device("cpu"), None
        self.tokens = torch.zeros(0, dtype=torch.long)
        self.bank = type("Bank", (), {"slots": 1})()

    def token_buffer(self, n: int) -> torch.Tensor:
        if self.tokens.numel() < n:
            self.tokens = torch.zeros(n, dtype=torch.long)
        return self.tokens

    def execute(self, plan: Plan) -> tuple[Any, list[torch.Tensor], list[str]]:
        fed = self.tokens[plan.feed]
        step = F.one_hot((fed + 1) % self.vocab, self.vocab).float() if plan.order else None
        pre = [F.one_hot(torch.tensor((a.prompt[-1] + 1) % self.vocab), self.vocab).float()
               for a in plan.admit]  # fmt: skip
        return step, pre, ["" for _ in plan.loads]


def run(rows: int, tokens: int, post: str, tok: Any, loop: asyncio.AbstractEventLoop) -> dict:
    """One burst of `rows` requests of `tokens` tokens each: the loop's ms per decode step and the
    host's part of it."""
    sched = Scheduler(StandIn(len(tok)), Lockstep(None, torch.device("cpu")), tok,  # type: ignore[arg-type]
                      eos_ids=[-1], max_batch=rows, heartbeat_s=0.05)  # fmt: skip
    left = [rows]
    lock = threading.Lock()
    mail = _Mail(loop)

    def handle(ev: dict) -> None:
        if ev["type"] == "done":
            with lock:
                left[0] -= 1

    for _ in range(rows):
        emit = (functools.partial(mail.post, handle) if post == "mail"
                else functools.partial(loop.call_soon_threadsafe, handle))  # fmt: skip
        sched.submit(None, tok("w1 w2")["input_ids"], Sampling(max_tokens=tokens), emit)
    thread = threading.Thread(target=sched.run)
    t0 = time.perf_counter()
    thread.start()
    while left[0]:
        time.sleep(0.002)
    wall = time.perf_counter() - t0
    sched.stop()
    thread.join(30)
    load = sched.load()
    steps = max(load["decode_steps"], 1)
    return {"steps": load["decode_steps"], "wall_ms_per_step": wall / steps * 1e3,
            "host_ms_per_step": load["host_s"] / steps * 1e3}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--post", choices=["mail", "each"], default="mail")
    p.add_argument("--out", default=".bench/scheduler-host")
    a = p.parse_args(argv)
    tok = tokenizer()
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    runs = [run(a.rows, a.tokens, a.post, tok, loop) for _ in range(a.repeat)]
    loop.call_soon_threadsafe(loop.stop)
    res = {"rows": a.rows, "tokens": a.tokens, "post": a.post, "runs": runs,
           "host_ms_per_step_median": statistics.median(r["host_ms_per_step"] for r in runs),
           "torch": torch.__version__}  # fmt: skip
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scheduler_host.json").write_text(json.dumps(res, indent=1))
    print(
        f"{a.rows} rows, post={a.post}: host {res['host_ms_per_step_median']:.3f} ms a step "
        f"(median of {a.repeat})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
