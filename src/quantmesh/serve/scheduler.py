"""Scheduler: rank 0's serving loop. Requests in, one Plan per step out, tokens back to clients.

The HTTP side (serve/app.py, on the event loop's thread) calls `submit`, `cancel`, `add_adapter`
and `remove_adapter`; those only queue work under a lock. The loop (its own thread) turns the queue
into a Plan per step: rows that finished or whose client left are dropped, the rest are fed their
last token, waiting requests are admitted up to `max_batch` (first come, first served), adapter
loads go first. After the step it picks each row's next token (greedy: argmax; sampled: the
request's own generator, so a seed gives the same reply whatever else is in the batch), releases
text through a TextStream and reports to the request's `emit` callback.

If the loop raises, every waiting request gets the error, `on_fatal` is called (the server then
exits with it) and nothing is retried.

Example:
    >>> sched = Scheduler(batch, lockstep, tokenizer, eos_ids=[2], max_batch=32)  # doctest: +SKIP
    >>> threading.Thread(target=sched.run).start()                                # doctest: +SKIP
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import QuantmeshError
from .engine import Admit, Batch, Plan, sample_token
from .ranks import Lockstep
from .text import TextStream

__all__ = ["AdapterSlotsFull", "Job", "Scheduler", "Sampling", "UnknownModel"]

Event = dict[str, Any]


class UnknownModel(QuantmeshError, KeyError):
    """A request names a model (adapter) the server does not hold."""


class AdapterSlotsFull(RuntimeError):
    """Every adapter slot is taken."""


@dataclass
class Sampling:
    """How one reply is generated."""

    max_tokens: int
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)


@dataclass
class Job:
    """One request on rank 0."""

    rid: int
    prompt: list[int]
    slot: int
    sampling: Sampling
    emit: Callable[[Event], None]
    stream: TextStream
    generator: torch.Generator | None = None
    generated: int = 0
    last: int = -1  # the token to feed next
    finish: str | None = None
    cancelled: bool = False


class Scheduler:
    """Rank 0's loop over the tp group (see the module docstring)."""

    def __init__(
        self,
        batch: Batch,
        lockstep: Lockstep,
        tokenizer: Any,
        *,
        eos_ids: list[int],
        max_batch: int,
        adapters: dict[str, int] | None = None,
        heartbeat_s: float = 2.0,
    ) -> None:
        self.batch, self.lockstep, self.tokenizer = batch, lockstep, tokenizer
        self.eos = set(eos_ids)
        self.max_batch = max_batch
        self.heartbeat_s = heartbeat_s
        self.cv = threading.Condition()
        self.waiting: deque[Job] = deque()
        self.jobs: dict[int, Job] = {}  # submitted and not yet dropped from the batch
        self.order: list[int] = []  # rows in the batch, in batch order
        self.loads: list[tuple[int, str, Callable[[str], None]]] = []
        self.names: dict[str, int] = dict(adapters or {})  # adapter name -> slot
        self.users: dict[int, int] = {}  # slot -> requests using it
        self.reserved: set[int] = set()  # slots with a load in flight
        self.loading: set[str] = set()  # names of those loads
        self.stopping = False
        self.peak = self.steps = self.rows = 0
        self.error: BaseException | None = None
        self.on_fatal: Callable[[BaseException], None] = lambda e: None
        self._ids = itertools.count(1)
        self._seed = torch.Generator().manual_seed(torch.seed())  # seeds of unseeded requests

    # ---- called from the HTTP side --------------------------------------------------------------
    def load(self) -> dict[str, int]:
        """{"running": rows in the batch, "waiting": requests not yet admitted, and since the
        start: "peak_batch" (the most rows one decode step ran), "decode_steps", "decoded_rows"}."""
        with self.cv:
            return {"running": len(self.order), "waiting": len(self.waiting),
                    "peak_batch": self.peak, "decode_steps": self.steps,
                    "decoded_rows": self.rows}  # fmt: skip

    def adapter_names(self) -> list[str]:
        with self.cv:
            return sorted(self.names)

    def submit(
        self,
        adapter: str | None,
        prompt: list[int],
        sampling: Sampling,
        emit: Callable[[Event], None],
    ) -> int:
        """Queue a request (adapter None = the base); returns its id. Raises UnknownModel."""
        with self.cv:
            if self.error is not None or self.stopping:
                raise RuntimeError("the server is shutting down")
            slot = 0
            if adapter is not None:
                if adapter not in self.names:
                    raise UnknownModel(adapter)
                slot = self.names[adapter]
            gen = None
            if sampling.temperature > 0:
                seed = sampling.seed
                if seed is None:
                    seed = int(torch.randint(0, 2**62, (1,), generator=self._seed))
                gen = torch.Generator().manual_seed(seed)
            job = Job(next(self._ids), prompt, slot, sampling, emit,
                      TextStream(self.tokenizer, sampling.stop), gen)  # fmt: skip
            self.users[slot] = self.users.get(slot, 0) + 1
            self.jobs[job.rid] = job
            self.waiting.append(job)
            self.cv.notify()
            return job.rid

    def cancel(self, rid: int) -> None:
        """The client left: the row leaves the batch at the next step (no-op when finished)."""
        with self.cv:
            job = self.jobs.get(rid)
            if job is not None and job.finish is None:
                job.cancelled = True
                self.cv.notify()

    def add_adapter(self, name: str, path: str, done: Callable[[str], None]) -> None:
        """Load an adapter into a free slot at the next step; `done("")` once every rank has it,
        `done(message)` when loading failed. Raises KeyError (name taken) or AdapterSlotsFull."""
        with self.cv:
            if name in self.names or name in self.loading:
                raise KeyError(name)
            busy = (
                set(self.names.values()) | self.reserved | {s for s, n in self.users.items() if n}
            )
            free = [s for s in range(1, self.batch.bank.slots) if s not in busy]
            if not free:
                raise AdapterSlotsFull(
                    f"all {self.batch.bank.slots - 1} adapter slots are in use; DELETE "
                    "/v1/adapters/NAME one, or restart with a larger --max-adapters"
                )
            slot = free[0]
            self.reserved.add(slot)
            self.loading.add(name)

            def finished(err: str) -> None:
                with self.cv:
                    self.reserved.discard(slot)
                    self.loading.discard(name)
                    if not err:
                        self.names[name] = slot
                done(err)

            self.loads.append((slot, path, finished))
            self.cv.notify()

    def remove_adapter(self, name: str) -> None:
        """New requests may no longer name it; requests already running finish. Raises KeyError."""
        with self.cv:
            del self.names[name]  # its slot is free once no request uses it

    def stop(self) -> None:
        """Cancel what is left and end the loop (every rank leaves)."""
        with self.cv:
            self.stopping = True
            self.cv.notify()

    # ---- the loop ------------------------------------------------------------------------------------
    def run(self) -> None:
        """The loop (rank 0's serving thread). Returns after a stop, or after an error: then
        `self.error` holds it, every open request got it, and `on_fatal` was called."""
        if self.batch.device.type == "cuda":  # the current device is per thread
            torch.cuda.set_device(self.batch.device)
        loads: list[tuple[int, str, Callable[[str], None]]] = []
        try:
            while True:
                plan, loads = self._next_plan()
                plan = self.lockstep.broadcast(plan)
                if plan.stop:
                    return
                step, pre, errors = self.batch.execute(plan)
                for (_, _, done), err in zip(loads, errors):
                    done(err)
                loads = []
                self._after(plan, step, pre)
        except BaseException as e:
            with self.cv:
                self.error = e
                jobs = [j for j in self.jobs.values() if j.finish is None]
                loads, self.loads = loads + self.loads, []
            msg = f"the server failed: {type(e).__name__}: {e}"
            for j in jobs:
                j.emit({"type": "error", "message": msg})
            for _, _, done in loads:
                done(msg)
            self.on_fatal(e)

    def _next_plan(self) -> tuple[Plan, list[tuple[int, str, Callable[[str], None]]]]:
        with self.cv:
            if not (self.order or self.waiting or self.loads or self.stopping):
                self.cv.wait(timeout=self.heartbeat_s)
            if self.stopping:
                for j in self.jobs.values():
                    if j.finish is None:
                        j.finish = "cancelled"
                        j.emit({"type": "error", "message": "the server is shutting down"})
                for _, _, done in self.loads:
                    done("the server is shutting down")
                self.loads = []
                return Plan(stop=True), []
            drop = [r for r in self.order if self.jobs[r].finish or self.jobs[r].cancelled]
            for r in drop:
                self._release(self.jobs.pop(r))
            self.order = [r for r in self.order if r not in drop]
            admit: list[Admit] = []
            while self.waiting and len(self.order) + len(admit) < self.max_batch:
                job = self.waiting.popleft()
                if job.cancelled:
                    self._release(self.jobs.pop(job.rid))
                    continue
                admit.append(Admit(job.rid, job.prompt, job.slot))
            loads, self.loads = self.loads, []
            plan = Plan(drop=drop, order=list(self.order), feed=[self.jobs[r].last for r in self.order],
                        admit=admit, loads=[(s, p) for s, p, _ in loads])  # fmt: skip
            return plan, loads

    def _release(self, job: Job) -> None:
        self.users[job.slot] -= 1

    def _after(self, plan: Plan, step: torch.Tensor | None, pre: list[torch.Tensor]) -> None:
        rows = list(plan.order) + [a.rid for a in plan.admit]
        logits = [step] if step is not None else []
        if pre:
            logits.append(torch.stack(pre))
        if not rows:
            return
        all_logits = torch.cat(logits)  # (rows, vocab)
        greedy = all_logits.argmax(dim=-1).tolist()  # one read-back per step
        with self.cv:  # the batch's rows first: a client that heard of its row finds it running
            jobs = [self.jobs[r] for r in rows]
            self.order = rows
            self.peak = max(self.peak, len(plan.order))
            if plan.order:
                self.steps += 1
                self.rows += len(plan.order)
        for i, job in enumerate(jobs):
            if job.generator is not None:
                tok = sample_token(all_logits[i], job.sampling.temperature, job.sampling.top_p,
                                   job.generator)  # fmt: skip
            else:
                tok = greedy[i]
            self._emit_token(job, tok)

    def _emit_token(self, job: Job, tok: int) -> None:
        if job.finish is not None or job.cancelled:
            return
        job.generated += 1
        job.last = tok
        text, stopped = job.stream.add(tok)
        finish = None
        if stopped or tok in self.eos:
            finish = "stop"
        elif job.generated >= job.sampling.max_tokens:
            finish = "length"
        if finish is not None:
            text += "" if stopped else job.stream.flush()
        if text:
            job.emit({"type": "delta", "text": text})
        if finish is not None:
            job.finish = finish
            job.emit({"type": "done", "finish_reason": finish, "prompt_tokens": len(job.prompt),
                      "completion_tokens": job.generated})  # fmt: skip
