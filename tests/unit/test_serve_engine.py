"""`quantmesh serve`'s choice of engine (`cli.serve.choose_engine`), over stand-in batches: which
engine each setting and device gets, what is said when auto falls back, what `--engine slots`
refuses, and that the tp ranks take one engine together."""

from __future__ import annotations

import pytest

from quantmesh.cli.errors import CliError
from quantmesh.cli.serve import ServeConfig, choose_engine
from quantmesh.serve.engine import ServeError


class _Slots:
    """A stand-in SlotBatch: `problem` is what its memory check says."""

    def __init__(self, problem: str | None = None) -> None:
        self.problem = problem
        self.warmed = False

    def memory_problem(self) -> str | None:
        return self.problem

    def warm_up(self, say) -> None:
        self.warmed = True


def _choose(engine: str, device: str, slots=None, others_fit: bool = True, **cfg):
    said: list[str] = []
    made: list[str] = []

    def slot_batch():
        made.append("slots")
        if isinstance(slots, Exception):
            raise slots
        return slots or _Slots()

    def dynamic_batch():
        made.append("dynamic")
        return "dynamic batch"

    def agree(ok: list[bool]) -> list[bool]:  # another tp rank's answer ANDed in
        return [k and others_fit for k in ok]

    out = choose_engine(ServeConfig(model="m", engine=engine, **cfg), device, slot_batch,
                        dynamic_batch, agree, said.append)  # fmt: skip
    return out, made, said


def test_auto_takes_the_slot_engine_on_gpus_where_it_fits() -> None:
    (batch, name), made, said = _choose("auto", "cuda")
    assert name == "slots" and batch.warmed and made == ["slots"] and said == []
    (batch, name), made, said = _choose("auto", "cpu", prefill_chunk=64)
    assert (batch, name) == ("dynamic batch", "dynamic") and made == ["dynamic"]  # never built
    assert said == ["--prefill-chunk 64 is not used: the dynamic engine prefills whole prompts"]


@pytest.mark.parametrize(
    ("slots", "others_fit", "why"),
    [
        (_Slots("the KV slots (32 rows x 4096 tokens) need 64.0 GiB, ...; lower --max-batch"), True,
         "the KV slots (32 rows x 4096 tokens) need 64.0 GiB"),
        (ServeError("the model runs attention with 'flex_attention'; ..."), True,
         "the model runs attention with 'flex_attention'"),
        (None, False, "it does not fit another tp rank"),
    ],
)  # fmt: skip
def test_auto_falls_back_to_the_dynamic_engine_and_says_why(slots, others_fit, why) -> None:
    (batch, name), made, said = _choose("auto", "cuda", slots=slots, others_fit=others_fit)
    assert (batch, name) == ("dynamic batch", "dynamic") and made == ["slots", "dynamic"]
    assert len(said) == 1 and said[0].startswith(
        "engine dynamic (eager, growing KV caches), not the faster slot engine: " + why
    ), said
    assert not isinstance(slots, _Slots) or not slots.warmed


def test_engine_slots_refuses_what_auto_falls_back_on() -> None:
    with pytest.raises(CliError, match="need 64.0 GiB"):
        _choose("slots", "cuda", slots=_Slots("the KV slots need 64.0 GiB"))
    with pytest.raises(ServeError, match="flex_attention"):
        _choose("slots", "cuda", slots=ServeError("attention with 'flex_attention'"))
    with pytest.raises(CliError, match="another tp rank"):
        _choose("slots", "cuda", others_fit=False)
    (batch, name), made, _ = _choose("slots", "cpu")  # asked for: eager on CPU
    assert name == "slots" and made == ["slots"]
    (batch, name), made, _ = _choose("dynamic", "cuda")
    assert name == "dynamic" and made == ["dynamic"]


def test_cuda_graphs_default_to_captured_and_are_refused_with_the_dynamic_engine_when_given() -> (
    None
):
    """`--cuda-graphs` unset means the slot engine's default (captured, the first of
    CUDA_GRAPHS); given with `--engine dynamic`, which runs eagerly, it is refused, not ignored;
    unset, the dynamic engine starts."""
    import inspect

    from quantmesh.config import CUDA_GRAPHS
    from quantmesh.serve.slots import SlotBatch

    assert CUDA_GRAPHS[0] == "captured"
    assert inspect.signature(SlotBatch).parameters["graphs"].default == CUDA_GRAPHS[0]
    assert ServeConfig(model="m", engine="dynamic").cuda_graphs is None
    for graphs in CUDA_GRAPHS:
        with pytest.raises(CliError, match=f"--cuda-graphs {graphs} needs --engine slots or auto"):
            ServeConfig(model="m", engine="dynamic", cuda_graphs=graphs)
        assert ServeConfig(model="m", engine="auto", cuda_graphs=graphs).cuda_graphs == graphs
    with pytest.raises(CliError, match="--cuda-graphs none; use one of captured, trees"):
        ServeConfig(model="m", cuda_graphs="none")


def test_prompts_pack_by_adapter_first_fit() -> None:
    """The compiled prefill's packs: one adapter a pack, each prompt in the first pack of its
    adapter with room (so a burst of 31 short prompts takes a few calls, not 31)."""
    from quantmesh.serve.slots import pack_prompts

    assert pack_prompts([30, 40, 20, 10], [1, 1, 2, 1], 64) == [[0, 3], [1], [2]]
    assert pack_prompts([32] * 31, [0] * 31, 256) == [list(range(i, min(i + 8, 31)))
                                                      for i in range(0, 31, 8)]  # fmt: skip
    assert pack_prompts([64, 1], [0, 0], 64) == [[0], [1]]  # a full pack takes no more
    with pytest.raises(ValueError, match="65 tokens does not fit a pack of 64"):
        pack_prompts([65], [0], 64)


def test_the_start_s_objects_are_kept_out_of_garbage_collection(monkeypatch) -> None:
    """After the start, every object is frozen out of the collector (a full collection over a
    7B server's compiled graphs and guards would pause every request); a collection that still
    pauses serving past `GC_PAUSE_S` is said."""
    import gc

    from quantmesh.cli import serve

    said: list[str] = []
    before = list(gc.callbacks)
    try:
        serve._freeze_garbage(said.append)
        assert gc.get_freeze_count() > 1000, gc.get_freeze_count()
        assert said[0].endswith("s)") and "kept out of garbage collection" in said[0], said
        monkeypatch.setattr(serve, "GC_PAUSE_S", -1.0)  # every collection is "long"
        gc.collect()
        assert any("paused serving for" in m for m in said[1:]), said
    finally:
        gc.callbacks[:] = before
        gc.unfreeze()
