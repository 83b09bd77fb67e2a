"""Scheduler: rank 0's serving loop. Requests in, one Plan per step out, tokens back to clients.

The HTTP side (serve/app.py, on the event loop's thread) calls `submit`, `cancel`, `add_adapter`
and `remove_adapter`; those only queue work under a lock. The loop (its own thread) turns the queue
into a Plan per step: rows that finished, whose client left or whose tokens are all chosen are
dropped, the rest are fed their last token, waiting requests are admitted up to `max_batch`
(first come, first served), adapter loads go first. After the step it picks every row's next
token at once on the device (`choose_tokens`: greedy rows the argmax; sampled rows a Gumbel-max
draw whose noise is a pure function of the request's seed and its count of generated tokens, so a
seed gives the same reply whatever else is in the batch; penalties, top-k, top-p and min-p as
`quantmesh.infer.sampling` applies them). Only this rank picks tokens: the others get them by a
device broadcast before the next step (`Batch.share`), so every setting is consistent across
ranks by construction.

The step is asynchronous: the tokens a step chose stay on the device (`Batch.tokens`), the next
plan's feed points at them, and `run` launches step k+1 before it reads step k's tokens back
(one copy to pinned memory, waited for while step k+1 runs). Then it decodes and sends step k's
text and launches step k+1's choice, so the host's work between two steps (the plan, the
clients' text, the launches) overlaps the device's step instead of leaving the device idle. A row
whose max_tokens is met leaves as soon as its last token is chosen; a row that meets its EOS
token or a stop string is known only at the read-back, so it computes one more token, never
sent, and leaves at the step after. With nothing to overlap (the last step, or a shutdown) the
tokens are read and the events sent before the loop waits.

Logprobs are those of the model's own distribution: `log_softmax` of the raw logits in float32,
before penalties, temperature or any filter (what OpenAI's API and vLLM report by default), with
the `logprobs` most likely alternatives. A request with `echo` also gets its prompt's logprobs
(the first prompt token has none: nothing predicts it).

If the loop raises, every waiting request gets a plain "the server failed" (the error itself goes
to the server's log, never to a client), `on_fatal` is called (the server then exits with it) and
nothing is retried.

Example:
    >>> sched = Scheduler(batch, lockstep, tokenizer, eos_ids=[2], max_batch=32)  # doctest: +SKIP
    >>> threading.Thread(target=sched.run).start()                                # doctest: +SKIP
"""

from __future__ import annotations

import functools
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import QuantmeshError
from ..infer.sampling import counter_noise, penalize, pick_tokens
from .engine import Admit, Batch, Plan
from .host import upload
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
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # 1 = off; prompt and output tokens
    presence_penalty: float = 0.0  # output tokens
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    """None: no logprobs; k >= 0: each token's logprob and its k most likely alternatives."""
    echo: bool = False
    """Report the prompt's logprobs too (needs `logprobs`)."""

    @property
    def penalized(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


@dataclass
class Job:
    """One request on rank 0."""

    rid: int
    prompt: list[int]
    slot: int
    sampling: Sampling
    emit: Callable[[Event], None]
    stream: TextStream
    seed: int = 0  # the noise of its draws: counter_noise(seed, tokens generated so far)
    filled: int = 0  # prompt tokens in the KV cache (a prompt prefilled in chunks)
    generated: int = 0  # tokens read back
    chosen: int = 0  # tokens chosen on the device (one ahead of `generated` until read back)
    finish: str | None = None  # why it leaves the batch (set when it is known)
    ended: bool = False  # the client got its last event (done, or an error)
    cancelled: bool = False
    seen: torch.Tensor | None = None  # (vocab,) bool: prompt tokens (penalized requests only)
    counts: torch.Tensor | None = None  # (vocab,) generated tokens' counts (idem)


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
        self.filling: list[int] = []  # rows mid-prefill (a prompt in chunks), after `order`
        self.loads: list[tuple[int, str, Callable[[str], None]]] = []
        self.names: dict[str, int] = dict(adapters or {})  # adapter name -> slot
        self.users: dict[int, int] = {}  # slot -> requests using it
        self.reserved: set[int] = set()  # slots with a load in flight
        self.loading: set[str] = set()  # names of those loads
        self.stopping = False
        self.peak = self.steps = self.rows = 0
        self.step_s = self.host_s = 0.0  # `load`
        self.chosen: dict[int, int] = {}  # row -> its entry in Batch.tokens (the last step's)
        self.pending: _Chosen | None = None  # the last step's tokens, not yet read back
        self.error: BaseException | None = None
        self.on_fatal: Callable[[BaseException], None] = lambda e: None
        self.on_slow: Callable[[str], None] | None = None  # told of a step over `slow_s`
        self.slow_s = 0.5
        self._ids = itertools.count(1)
        self._seed = torch.Generator().manual_seed(torch.seed())  # seeds of unseeded requests

    # ---- called from the HTTP side --------------------------------------------------------------
    def load(self) -> dict[str, float]:
        """{"running": rows in the batch, "waiting": requests not yet admitted, and since the
        start: "peak_batch" (the most rows one decode step ran), "decode_steps", "decoded_rows",
        "step_s" (the loop's time per step where rows went on, plan to plan) and "host_s" (the
        part of it the host was busy, not waiting for a step's tokens: where it nears step_s,
        the device waits for the host)}."""
        with self.cv:
            return {"running": len(self.order) + len(self.filling), "waiting": len(self.waiting),
                    "peak_batch": self.peak, "decode_steps": self.steps,
                    "decoded_rows": self.rows, "step_s": self.step_s,
                    "host_s": self.host_s}  # fmt: skip

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
            seed = sampling.seed
            if seed is None:
                seed = int(torch.randint(0, 2**62, (1,), generator=self._seed))
            job = Job(next(self._ids), prompt, slot, sampling, emit,
                      TextStream(self.tokenizer, sampling.stop), seed % 2**63)  # fmt: skip
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
                t0 = time.perf_counter()
                if self.pending is not None and not self._busy():  # nothing to overlap it with
                    _send(self._read())  # (a stop, too, sends the rows that ended before it)
                plan, loads = self._next_plan()
                t1 = time.perf_counter()
                plan = self.lockstep.broadcast(plan)
                if plan.stop:
                    return
                step, pre, errors = self.batch.execute(plan)  # a GPU's step: launched
                waited = time.perf_counter()
                events = self._read()  # the last step's tokens, while this step runs
                waited = time.perf_counter() - waited
                _send(events)
                for (_, _, done), err in zip(loads, errors, strict=True):
                    done(err)
                loads = []
                self._choose(plan, step, pre)  # this step's tokens: launched, read back next
                took = time.perf_counter() - (t0 if plan.order else t1)
                if plan.order:  # a step of rows that went on: no wait for requests in it
                    self.step_s += took
                    self.host_s += took - waited
                if took > self.slow_s and self.on_slow is not None:
                    self.on_slow(_slow_step(took, plan))
        except BaseException as e:
            with self.cv:
                self.error = e
                jobs = [j for j in self.jobs.values() if not j.ended]
                if self.pending is not None:  # rows that left the batch, their tokens unread
                    jobs += [j for j in self.pending.jobs if not j.ended and j not in jobs]
                loads, self.loads = loads + self.loads, []
            # the error (often a transport's raw text) is for the server's log, not for clients
            msg = "the server failed and is stopping; its log says why"
            for j in jobs:
                j.ended = True
                j.emit({"type": "error", "message": msg})
            for _, _, done in loads:
                done(msg)
            self.on_fatal(e)

    def _busy(self) -> bool:
        """Whether the next plan gives the device work: rows that go on, prompts, loads."""
        with self.cv:
            if self.stopping:
                return False
            rows = (self.jobs[r] for r in self.order + self.filling)
            return any(not _done(j) for j in rows) or bool(self.waiting or self.loads)

    def _next_plan(self) -> tuple[Plan, list[tuple[int, str, Callable[[str], None]]]]:
        with self.cv:
            if not (self.order or self.filling or self.waiting or self.loads or self.stopping):
                self.cv.wait(timeout=self.heartbeat_s)
            if self.stopping:
                for j in self.jobs.values():
                    if j.finish is None:
                        j.finish = "cancelled"
                        j.ended = True
                        j.emit({"type": "error", "message": "the server is shutting down"})
                for _, _, done in self.loads:
                    done("the server is shutting down")
                self.loads = []
                return Plan(stop=True), []
            held = self.order + self.filling
            drop = [r for r in held if _done(self.jobs[r])]
            for r in drop:
                self._release(self.jobs.pop(r))
            self.order = [r for r in self.order if r not in drop]
            self.filling = [r for r in self.filling if r not in drop]
            # prompt tokens this step: the engine's chunk (None: whole prompts), first come first
            # served: the row mid-prefill, then new rows while slots and tokens are left. Only a
            # prompt longer than a chunk is split: one that would fit a chunk but not what is
            # left of this step's waits for the next step whole (a split one would send its
            # group to the eager prefill, op by op from the host, instead of the compiled one)
            chunk = self.batch.chunk
            budget = chunk or sum(len(j.prompt) for j in self.jobs.values()) + 1
            admit: list[Admit] = []
            for r in self.filling:
                job = self.jobs[r]
                if budget > 0:
                    admit.append(self._chunk(job, budget))
                    budget -= len(admit[-1].prompt)
            new = 0
            while self.waiting and budget > 0 and len(held) - len(drop) + new < self.max_batch:
                job = self.waiting[0]
                if job.cancelled:
                    self.waiting.popleft()
                    self._release(self.jobs.pop(job.rid))
                    continue
                if admit and chunk is not None and budget < len(job.prompt) <= chunk:
                    break
                self.waiting.popleft()
                admit.append(self._chunk(job, budget))
                budget -= len(admit[-1].prompt)
                new += 1
            loads, self.loads = self.loads, []
            plan = Plan(drop=drop, order=list(self.order), feed=[self.chosen[r] for r in self.order],
                        tokens=len(self.chosen), admit=admit,
                        loads=[(s, p) for s, p, _ in loads], filling=list(self.filling))  # fmt: skip
            return plan, loads

    @staticmethod
    def _chunk(job: Job, budget: int) -> Admit:
        """The next piece of a job's prompt, at most `budget` tokens."""
        n = min(len(job.prompt) - job.filled, budget)
        return Admit(job.rid, job.prompt[job.filled : job.filled + n], job.slot,
                     echo=job.sampling.echo, start=job.filled,
                     last=job.filled + n == len(job.prompt))  # fmt: skip

    def _release(self, job: Job) -> None:
        self.users[job.slot] -= 1

    def _choose(self, plan: Plan, step: torch.Tensor | None, pre: list[torch.Tensor]) -> None:
        """After a step is launched: every row's next token chosen on the device (no read-back)
        into `Batch.tokens`, where the next plan's feed points, its copy to the host started;
        `_read` finishes it while the next step runs. A row whose prompt's logprobs were asked
        for (echo) gets them here (a read-back: they are rare)."""
        ended = [a.rid for a in plan.admit if a.last]  # prompts prefilled whole: they decode now
        for a in plan.admit:
            self.jobs[a.rid].filled = a.start + len(a.prompt)
        rows = list(plan.order) + ended
        filling = [r for r in plan.filling if r not in ended]
        filling += [a.rid for a in plan.admit if not a.start and not a.last]
        logits = [step] if step is not None else []
        if pre:  # an echo row's prefill holds every prompt position: its last one predicts
            logits.append(torch.stack([p[-1] if p.dim() == 2 else p for p in pre]))
        with self.cv:  # the batch's rows first: a client that heard of its row finds it running
            self.filling = filling
            if not rows:
                return
            jobs = [self.jobs[r] for r in rows]
            self.order = rows
            self.chosen = {r: i for i, r in enumerate(rows)}
            self.peak = max(self.peak, len(plan.order))
            if plan.order:
                self.steps += 1
                self.rows += len(plan.order)
        all_logits = torch.cat(logits)  # (rows, vocab)
        n_old = len(plan.order)
        pick: list[int] = []  # the rows that get a token this step
        events: list[Callable[[], None]] = []
        for i, job in enumerate(jobs):
            if job.finish is not None or job.cancelled:  # (ended while this step ran: not sent)
                continue
            s = job.sampling
            if i >= n_old and s.echo:
                ev: Event = {"type": "prompt_logprobs",
                             "entries": _prompt_logprobs(pre[i - n_old], job.prompt, s.logprobs or 0)}  # fmt: skip
                events.append(functools.partial(_emit, job, ev))
            if s.max_tokens == 0:  # the prompt's logprobs were all it asked for
                job.finish = "length"
                events.append(functools.partial(self._end, job))
                continue
            pick.append(i)
        self.pending = _Chosen(events=events)
        if not pick:
            return
        picked = [jobs[i] for i in pick]
        at = upload(pick, all_logits.device)
        rows_logits = all_logits if len(pick) == len(jobs) else all_logits[at]
        toks = choose_tokens(rows_logits, picked)
        self.batch.token_buffer(len(rows))[at] = toks
        for job in picked:
            job.chosen += 1
        lp = _logprob_tensors(rows_logits, picked, toks)
        host, lp_host = _to_host(toks), _to_host(lp)
        ready = _recorded(toks.device)  # after the copies: `_read` waits for them, no more
        self.pending = _Chosen(picked, host, lp_host, ready, events)

    def _read(self) -> list[Callable[[], None]]:
        """The pending step's tokens read back (waiting for its device work, not for the step
        launched after it) and what the next plan needs of them: the penalties' counts, a finish
        by EOS or max_tokens; returns the clients' events of that step, in order."""
        c, self.pending = self.pending, None
        if c is None:
            return []
        if c.ready is not None:
            c.ready.synchronize()
        if c.toks is None:
            return c.events
        toks: list[int] = c.toks.tolist()
        entries = _logprob_entries(c.logprobs, c.jobs, toks)
        events = c.events
        for job, tok, entry in zip(c.jobs, toks, entries, strict=True):
            if job.counts is not None:
                job.counts[tok] += 1
            job.generated += 1
            if tok in self.eos:
                job.finish = "stop"
            elif job.generated >= job.sampling.max_tokens:
                job.finish = "length"
            events.append(functools.partial(self._emit_token, job, tok, entry))
        return events

    def _emit_token(self, job: Job, tok: int, entry: Logprob | None) -> None:
        """One generated token's text (and logprobs) to its client; a stop string ends it."""
        if job.ended:
            return
        text, stopped = job.stream.add(tok)
        if stopped:  # the next plan drops the row (its token of the step running now is unsent)
            job.finish = "stop"
        if job.finish is not None:
            text += "" if stopped else job.stream.flush()
        if text or entry is not None:
            ev: Event = {"type": "delta", "text": text}
            if entry is not None:
                ev["logprobs"] = [entry]
            job.emit(ev)
        if job.finish is not None:
            self._end(job)

    def _end(self, job: Job) -> None:
        """The request's last event: why it ended and its token counts."""
        if job.ended:
            return
        job.ended = True
        job.emit({"type": "done", "finish_reason": job.finish, "prompt_tokens": len(job.prompt),
                  "completion_tokens": job.generated})  # fmt: skip


def _emit(job: Job, ev: Event) -> None:
    if not job.ended:
        job.emit(ev)


def _send(events: list[Callable[[], None]]) -> list[Callable[[], None]]:
    """Send a step's client events, in order; returns an empty list (the next step's)."""
    for send in events:
        send()
    return []


Logprob = tuple[int, float | None, list[tuple[int, float]]]
"""(token id, its logprob (None: a prompt's first token), [(alternative id, logprob), ...] most
likely first)."""


def _slow_step(took: float, plan: Plan) -> str:
    """What a slow step ran, for the server's log."""
    admitted = sum(len(a.prompt) for a in plan.admit)
    return (
        f"a step took {took:.2f} s: rows decoding {len(plan.order)}, admitted {len(plan.admit)} "
        f"({admitted} prompt tokens), dropped {len(plan.drop)}, adapter loads {len(plan.loads)}"
    )


def choose_tokens(logits: torch.Tensor, jobs: list[Job]) -> torch.Tensor:
    """Each row's next token, every row at once on the logits' device (no read-back): the
    penalties of the rows that have them (`penalize`), then one `pick_tokens` over the batch with
    each row's temperature, top-p, top-k and min-p, its noise `counter_noise(seed, tokens
    generated)`; a row at temperature 0 takes the argmax. A row's token depends on its own
    logits, settings, seed and count only, never on the rest of the batch.

    Example:
        >>> choose_tokens(logits, [job_a, job_b]).tolist()  # doctest: +SKIP
        [17, 4]
    """
    samp = [j.sampling for j in jobs]
    pen = [i for i, s in enumerate(samp) if s.penalized]
    if not pen and all(s.temperature == 0 for s in samp):
        return logits.argmax(dim=-1)
    dev = logits.device
    z = logits.to(torch.float32, copy=True)  # the logprobs read the raw logits after this
    if pen:
        for i in pen:
            j = jobs[i]
            if j.seen is None:
                j.seen = torch.zeros(z.shape[-1], dtype=torch.bool)
                j.seen[torch.tensor(j.prompt)] = True
                j.counts = torch.zeros(z.shape[-1])
        seen = upload(torch.stack([jobs[i].seen for i in pen]), dev, None)  # type: ignore[misc]
        counts = upload(torch.stack([jobs[i].counts for i in pen]), dev, None)  # type: ignore[misc]
        knobs = upload([[samp[i].repetition_penalty, samp[i].presence_penalty,
                         samp[i].frequency_penalty] for i in pen], dev, torch.float32)  # fmt: skip
        at = upload(pen, dev)
        z[at] = penalize(z[at], seen, counts, knobs[:, 0], knobs[:, 1], knobs[:, 2])
    cfg = upload([[s.temperature, s.top_p, s.top_k, s.min_p] for s in samp], dev, torch.float32)
    seeds = upload([j.seed for j in jobs], dev)
    counters = upload([j.generated for j in jobs], dev)
    noise = counter_noise(seeds, counters, z.shape[-1])
    return pick_tokens(z, noise, cfg[:, 0], cfg[:, 1], cfg[:, 2], cfg[:, 3])


@dataclass
class _Chosen:
    """A step's tokens, chosen on the device, on their way to the host (`Scheduler._read`)."""

    jobs: list[Job] = field(default_factory=list)  # the rows that got one, in order
    toks: torch.Tensor | None = None  # (rows,) on the host once `ready`
    logprobs: _LogprobTensors | None = None  # idem
    ready: Any = None  # a CUDA event after the copies (None: on the CPU, done)
    events: list[Callable[[], None]] = field(default_factory=list)  # the step's, before its tokens


_LogprobTensors = tuple[list[int], torch.Tensor, torch.Tensor | None, torch.Tensor | None]
"""(the rows that want logprobs, the chosen tokens' logprobs, the top k ids, their logprobs)."""


def _done(job: Job) -> bool:
    """Whether the row leaves the batch at the next plan: it ended, its client left, or all its
    tokens are chosen (the last may still be on its way back)."""
    return job.finish is not None or job.cancelled or 0 < job.sampling.max_tokens <= job.chosen


def _to_host(x: Any) -> Any:
    """Tensors (alone or in a tuple) copied to the host without waiting (pinned, from a GPU)."""
    if isinstance(x, torch.Tensor):
        return x.to("cpu", non_blocking=True)
    if isinstance(x, tuple):
        return tuple(_to_host(t) for t in x)
    return x


def _recorded(device: torch.device) -> Any:
    """A CUDA event recorded after the work launched so far (None on the CPU)."""
    if device.type != "cuda":
        return None
    ev = torch.cuda.Event()
    ev.record()
    return ev


def _logprob_tensors(
    logits: torch.Tensor, jobs: list[Job], toks: torch.Tensor
) -> _LogprobTensors | None:
    """For the rows that asked for logprobs, on the device: the model's own log_softmax of the raw
    logits (float32) at the chosen token and the top k (`_logprob_entries` reads them)."""
    want = [i for i, j in enumerate(jobs) if j.sampling.logprobs is not None]
    if not want:
        return None
    at = upload(want, logits.device)
    lp = torch.log_softmax(logits[at].float(), dim=-1)  # (w, vocab)
    own = lp.gather(-1, toks[at][:, None])[:, 0]
    kmax = max(jobs[i].sampling.logprobs or 0 for i in want)
    if kmax == 0:
        return want, own, None, None
    top = lp.topk(kmax, dim=-1)
    return want, own, top.indices, top.values


def _logprob_entries(
    lp: _LogprobTensors | None, jobs: list[Job], toks: list[int]
) -> list[Logprob | None]:
    """The logprob entry of each row that asked for logprobs (None for the others), from
    `_logprob_tensors` on the host."""
    out: list[Logprob | None] = [None] * len(jobs)
    if lp is None:
        return out
    want, own, idx, val = lp
    own_l = own.tolist()
    ids = idx.tolist() if idx is not None else []
    vals = val.tolist() if val is not None else []
    for w, i in enumerate(want):
        k = jobs[i].sampling.logprobs or 0
        alts = list(zip(ids[w][:k], vals[w][:k], strict=True)) if k > 0 else []
        out[i] = (toks[i], own_l[w], alts)
    return out


def _prompt_logprobs(logits: torch.Tensor, prompt: list[int], k: int) -> list[Logprob]:
    """Each prompt token's logprob given the tokens before it; the first has none (None)."""
    lp = torch.log_softmax(logits[:-1].float().cpu(), dim=-1)  # (p - 1, vocab): position i -> i+1
    nxt = torch.tensor(prompt[1:], dtype=torch.long)
    own = lp.gather(-1, nxt[:, None])[:, 0].tolist()
    out: list[Logprob] = [(prompt[0], None, [])]
    if k > 0:
        top = lp.topk(k, dim=-1)
        ids, vals = top.indices.tolist(), top.values.tolist()
    for j, t in enumerate(prompt[1:]):
        alts = list(zip(ids[j], vals[j], strict=True)) if k > 0 else []
        out.append((t, own[j], alts))
    return out
