"""The compiled decode step recorded by hand as one CUDA graph: `fast_decode`'s steps on a GPU.

Inductor's CUDA graph trees (torch.compile's mode "reduce-overhead") replay a step as a graph, but
the host still runs the compiled frame every step: it gathers every tensor the graph reads (each
parameter, statistic and cache tensor of the model: thousands on a 7B model), checks dynamo's
guards and the inputs' addresses, then replays. On a 7B nf4 + LoRA model at batch 1 that took
2.2 to 3.9 ms of host time a step against 3.7 ms of GPU work, so the GPU waited whenever the host
slowed (docs/benchmarks.md, "A decode step's host time", thirty-first sitting). `StepGraph`
records the step (compiled without CUDA graph trees) once as a `torch.cuda.CUDAGraph` and replays
it with no host work but copying the step's own inputs (the tokens, a sampled step's noise) into
the recording's: about 10 us of host time a step.

Safety. A graph reads every tensor where it was when it was recorded. The step is compiled by a
backend that notes the flat inputs of each call (`backend`): every tensor the compiled graph reads,
the model's included, as dynamo gathers them. So at each decode call (`begin`) the first step runs
the compiled frame, dynamo's guards included, and its inputs are compared with those the graph
was recorded with: another compiled function (a recompile: a kernel switch flipped, a shape
changed) or any input tensor away from the address the graph reads it at (a parameter replaced,
or given new storage in place as `Module.to` does, a model moved, statistics remade) drops the
recording, and the next step records it again. With `CHECK_REPLAYS` (the default) the frame's
call of the recorded function launches nothing (it hands back the outputs the recording writes):
the step is then replayed if nothing changed, or run for real if something did; with it off the
check runs the step itself, every kernel of it launched from the host (docs/benchmarks.md,
"Figures the code relies on"). Values changed in place (an optimizer's step, the adapters'
stacks refreshed) need nothing: the graph reads them. The recording keeps the tensors it read
alive until it is dropped, and compares their addresses with those it noted when it was made, so
no other tensor can take one's address unseen. A recording the runtime refuses (or one that
would compile) is said once, and the decoder's steps run the compiled function from then on.

On (`ENABLED`, $QUANTMESH_STEP_GRAPH, default 1) on CUDA devices when the step's mode is
"reduce-overhead" (fast_decode's default); 0 keeps inductor's CUDA graph trees.

Example:
    >>> graph = StepGraph()                                     # doctest: +SKIP
    >>> step = torch.compile(fn, backend=backend("inductor"))   # doctest: +SKIP
    >>> graph.begin()                          # each call: the next step checks  # doctest: +SKIP
    >>> out = graph(step, tok)                                  # doctest: +SKIP
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..config import env_switch
from ..errors import said

__all__ = [
    "CHECK_REPLAYS",
    "DEVICES",
    "ENABLED",
    "RECORDER",
    "CudaRecorder",
    "Recorder",
    "StepGraph",
    "backend",
    "tensor_addresses",
]

ENABLED = env_switch("QUANTMESH_STEP_GRAPH", default=True)
"""Whether fast_decode records its compiled step by hand as one CUDA graph on a GPU (`StepGraph`;
$QUANTMESH_STEP_GRAPH=0: inductor's CUDA graph trees, mode "reduce-overhead")."""
# On since the trained model's CUDA decode test passed with it (docs/benchmarks.md, "Figures the
# code relies on").
CHECK_REPLAYS = env_switch("QUANTMESH_STEP_CHECK_REPLAYS", default=True)
"""Whether a call's first step, checking the recording, launches nothing and replays it when
nothing changed (`StepGraph._check`; $QUANTMESH_STEP_CHECK_REPLAYS=0: the check runs the
compiled step from the host)."""
DEVICES = ("cuda",)
"""The devices whose decoders record their step (tests add "cpu", with `RECORDER` standing in)."""
RECORDER: Callable[[StepGraph], Recorder] | None = None
"""What records a decoder's step (None: `CudaRecorder`); tests stand in one that runs on CPU."""


class Recorder(Protocol):
    """How a `StepGraph` records and replays: `CudaRecorder` on GPUs (tests stand in another)."""

    def record(self, fn: Callable[[], Any]) -> Any:
        """Record `fn()` (not run); returns its output as the recording leaves it."""
        ...

    def replay(self) -> None:
        """Run the recording once more."""
        ...


class CudaRecorder:
    """A `torch.cuda.CUDAGraph` of one call (its own memory pool).

    Example:
        >>> rec = CudaRecorder()                      # doctest: +SKIP
        >>> out = rec.record(lambda: x * 2)           # doctest: +SKIP
        >>> rec.replay()                              # doctest: +SKIP
    """

    def __init__(self) -> None:
        self.graph = torch.cuda.CUDAGraph()

    def record(self, fn: Callable[[], Any]) -> Any:
        # (the step has run before, compiled and autotuned: no warm-up run, which would advance
        # the cache; the calls of other threads, a compile's workers, may go on: thread-local)
        torch.cuda.synchronize()
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            return fn()

    def replay(self) -> None:
        self.graph.replay()


_NOTING = threading.local()  # .graph: the StepGraph whose check or recording runs, if any
_BACKENDS: dict[Any, Callable[..., Any]] = {}


def backend(name: str | Callable[..., Any]) -> Callable[..., Any]:
    """torch.compile's `backend` `name`, each function it compiles wrapped so that a
    `StepGraph` checking or recording a step notes that function and its flat inputs (every
    tensor the compiled graph reads). One per name: decoders of other shapes then share the
    compiler's cache entries (a batch size dynamo has made dynamic compiles nothing new).

    Example:
        >>> step = torch.compile(lambda x: x * 2, backend=backend("eager"))
        >>> step(torch.ones(2)).tolist()
        [2.0, 2.0]
    """
    if name not in _BACKENDS:
        inner = torch._dynamo.lookup_backend(name) if isinstance(name, str) else name

        def noting_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
            compiled = inner(gm, example_inputs)

            def run(*args: Any) -> Any:
                graph = getattr(_NOTING, "graph", None)
                if graph is None:
                    return compiled(*args)
                graph.noted = (run, list(args))
                if graph.dry and run is graph.fn:  # a check of the recorded function: nothing
                    graph.dried = True  # launched; the replay will write these outputs
                    return graph.fn_out
                out = compiled(*args)
                graph.noted_out = out
                return out

            return run

        _BACKENDS[name] = noting_backend
    return _BACKENDS[name]


def tensor_addresses(args: Sequence[Any]) -> list[Any]:
    """Where each of `args` lives: a tensor's (data address, device), a wrapper subclass's (such
    as a DTensor) its inner tensors', anything else itself.

    Example:
        >>> x = torch.zeros(2)
        >>> tensor_addresses([x, 3]) == [(x.data_ptr(), x.device), 3]
        True
    """
    out: list[Any] = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(_address(a))
        else:
            out.append(a)
    return out


def _address(t: torch.Tensor) -> Any:
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return tuple(_address(getattr(t, n)) for n in names)
    return (t.data_ptr(), t.device)


class StepGraph:
    """A compiled step recorded once as a CUDA graph and replayed (the module's doc says when it
    records again).

    The step must be compiled with `backend(name)`, which lets a check or a recording note the
    compiled function and its inputs; `begin()` marks the start of a decode call;
    `__call__(step, *args)` runs one step: `step` (the compiled function) itself on a call's
    first step (a check) and where nothing is recorded yet; else the recording, replayed on a
    copy of `args` (tensors, or nested tuples of them and None).

    Example:
        >>> graph = StepGraph()                                         # doctest: +SKIP
        >>> step = torch.compile(fn, backend=backend("inductor"))       # doctest: +SKIP
        >>> graph.begin(); out = graph(step, tok)                       # doctest: +SKIP
    """

    def __init__(self, recorder: Callable[[StepGraph], Recorder] | None = None) -> None:
        self.new_recorder = recorder or (lambda graph: CudaRecorder())
        self.recording: Recorder | None = None
        self.out: Any = None  # the recording's output
        self.static: list[torch.Tensor | None] = []  # the recording's copies of the step's inputs
        self.spec: Any = None  # the step's inputs' structure, as recorded
        self.fn: Any = None  # the compiled function the recording ran, and its flat inputs
        self.inputs: list[Any] = []
        # the inputs' addresses as recorded: where the graph reads them (a tensor's storage may
        # move while the tensor stays: `.data` assigned, as `Module.to` does)
        self.addresses: list[Any] = []
        self.fn_out: Any = None  # what `fn` returned while recorded (the graph writes them)
        self.noted_out: Any = None  # what the compiled function returned in the last noted call
        self.dry = False  # a check runs: the recorded function, if it is called, launches nothing
        self.dried = False  # ...and it was called so
        self.checked = False  # this call's first step has run (and checked the recording)
        self.noted: tuple[Any, list[Any]] | None = None  # (function, flat inputs) of the last call
        self.records = 0  # recordings made (the tests count them)
        self.refused: str | None = None  # why a recording failed (then none is tried again)
        self.changed: str | None = None  # why the last check dropped the recording

    def begin(self) -> None:
        """A decode call starts: its first step checks the recording."""
        self.checked = False

    def drop(self) -> None:
        """Forget the recording (its memory with it)."""
        self.recording = self.out = self.spec = self.fn = self.fn_out = None
        self.static, self.inputs, self.addresses = [], [], []

    def __call__(self, step: Callable[..., Any], *args: Any) -> Any:
        leaves, spec = pytree.tree_flatten(args)
        if not self.checked:  # the call's first step: the compiled function, its inputs noted
            return self._check(step, args, leaves, spec)
        if self.recording is None and self.refused is None:
            self._record(step, leaves, spec)
        if self.recording is None:  # refused (and said): the compiled function itself
            return step(*args)
        return self._replay(leaves)

    def _replay(self, leaves: list[Any]) -> Any:
        for mine, theirs in zip(self.static, leaves, strict=True):
            if mine is not theirs and mine is not None:
                mine.copy_(theirs)
        assert self.recording is not None  # (replayed only while recorded)
        self.recording.replay()
        return self.out

    def _check(self, step: Callable[..., Any], args: tuple[Any, ...], leaves: list[Any],
               spec: Any) -> Any:  # fmt: skip
        """A call's first step: the compiled function's frame runs (dynamo's guards, its
        inputs gathered and noted), then its inputs are compared with the recording's. With
        `CHECK_REPLAYS`, where the frame calls the recorded function, that call launches nothing
        (it returns the outputs the recording writes): an unchanged step is then replayed, a
        changed one dropped and run for real. Otherwise, and for another function (a
        recompile), the frame runs the step for real; a change drops the recording."""
        self.dry = CHECK_REPLAYS and self.recording is not None and self.fn is not None
        self.dried = False
        try:
            out = self._noting(lambda: step(*args))
        finally:
            self.dry = False
        self.checked = True
        if self.recording is not None:
            self.changed = self._changed(leaves, spec)
            if self.changed is not None:
                self.drop()
                if self.dried:  # (nothing ran): the step itself, on its inputs
                    out = step(*args)
            elif self.dried:
                out = self._replay(leaves)
        self.noted = self.noted_out = None  # (holds no tensor past the check)
        return out

    def _noting(self, fn: Callable[[], Any]) -> Any:
        """`fn()`, the compiled function it calls and that function's inputs noted (`noted`)."""
        _NOTING.graph, self.noted = self, None
        try:
            return fn()
        finally:
            _NOTING.graph = None

    def _changed(self, leaves: list[Any], spec: Any) -> str | None:
        """What differs between the step just run (noted) and the recording: another compiled
        function, other inputs, an input at another address (but the step's own, copied into
        the recording's at every replay); None: nothing."""
        if self.noted is None:
            return "the compiled function was not seen"
        if spec != self.spec:
            return "the step's inputs are of another structure"
        if self.noted[0] is not self.fn:
            return "another compiled function (the step was compiled again)"
        now = self.noted[1]
        if len(now) != len(self.inputs):
            return f"{len(now)} inputs against {len(self.inputs)}"
        own = {_address(t) for t in leaves if isinstance(t, torch.Tensor)}
        mine = {_address(t) for t in self.static if t is not None}
        at = zip(tensor_addresses(now), self.addresses, strict=True)
        for i, (a, b) in enumerate(at):
            if a in own and b in mine:  # the step's own input: copied in at every replay
                continue
            if a != b:
                t = now[i]
                what = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else repr(t)
                return f"input {i} of {len(now)} ({what}) at another address or of another value"
        return None

    def _record(self, step: Callable[..., Any], leaves: list[Any], spec: Any) -> None:
        for t in leaves:
            if t is not None and not isinstance(t, torch.Tensor):
                raise TypeError(f"a recorded step takes tensors (and None); got {type(t).__name__}")
        self.static = [None if t is None else t.clone() for t in leaves]
        args = pytree.tree_unflatten(self.static, spec)
        rec = self.new_recorder(self)
        try:  # (a compile while recording would run kernels into the graph: refused instead)
            with torch.compiler.set_stance("fail_on_recompile"):
                self.out = self._noting(lambda: rec.record(lambda: step(*args)))
        except Exception as e:  # noqa: BLE001 - the recorder's or the compiler's own error
            self.drop()
            self.refused = said(e)
            warnings.warn(
                f"quantmesh: recording the decode step as a CUDA graph failed ({self.refused}); "
                "this decoder's steps run compiled without a recording from now on "
                "($QUANTMESH_STEP_GRAPH=0: inductor's CUDA graph trees)",
                stacklevel=3,
            )
            return
        if self.noted is None:  # the backend did not see the call: nothing to check it by
            warnings.warn(
                "quantmesh: the decode step's compiled function was not seen while recording "
                "it; each call records it again ($QUANTMESH_STEP_GRAPH=0: CUDA graph trees)",
                stacklevel=3,
            )
            self.fn, self.inputs, self.addresses = None, [], []
        else:
            self.fn, self.inputs = self.noted
            self.addresses = tensor_addresses(self.inputs)
            self.fn_out = self.noted_out
        self.noted_out = None
        self.recording, self.spec = rec, spec
        self.records += 1
