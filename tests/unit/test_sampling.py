"""quantmesh.infer.sampling: Gumbel-max draws follow the tempered nucleus distribution exactly."""

from __future__ import annotations

import pytest
import torch

from quantmesh.infer.sampling import (
    counter_noise,
    nucleus_logits,
    penalize,
    pick_tokens,
    sample_tokens,
    uniform_noise,
)

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
N = 60_000  # draws: one row each, so a single call


def _freqs(temperature: float, top_p: float, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    toks = sample_tokens(LOGITS.expand(N, -1), temperature, top_p, gen)
    return torch.bincount(toks, minlength=LOGITS.numel()).double() / N


def _close(freq: torch.Tensor, p: torch.Tensor) -> None:
    sigma = (p * (1 - p) / N).sqrt()
    assert ((freq - p).abs() <= 5 * sigma + 1e-12).all(), (freq, p)


@pytest.mark.parametrize("temperature", [1.0, 0.5, 1.7])
def test_draws_follow_the_tempered_softmax(temperature: float) -> None:
    _close(_freqs(temperature, 1.0), torch.softmax(LOGITS.double() / temperature, -1))


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_counter_noise_draws_follow_the_tempered_softmax(temperature: float) -> None:
    # N rows: one seed, counters 0..N-1 (a reply's successive tokens) and N seeds at counter 0
    for seeds, counters in ((torch.full((N,), 12345), torch.arange(N)),
                            (torch.arange(N), torch.zeros(N, dtype=torch.long))):  # fmt: skip
        noise = counter_noise(seeds, counters, LOGITS.numel())
        assert noise.dtype == torch.float32 and bool((noise > 0).all() and (noise < 1).all())
        toks = pick_tokens(LOGITS.expand(N, -1), noise, temperature, 1.0)
        freq = torch.bincount(toks, minlength=LOGITS.numel()).double() / N
        _close(freq, torch.softmax(LOGITS.double() / temperature, -1))


def test_counter_noise_is_a_pure_function_of_seed_counter_and_column() -> None:
    a = counter_noise(torch.tensor([3, 2**40 + 3, 3]), torch.tensor([5, 5, 6]), 1000)
    b = counter_noise(torch.tensor([2**40 + 3]), torch.tensor([5]), 1000)
    assert torch.equal(a[1:2], b)  # the row alone gives the same bits
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[0], a[2])  # the seed's high bits count
    # a wider vocabulary extends a row, its first columns unchanged
    assert torch.equal(counter_noise(torch.tensor([3]), torch.tensor([5]), 1500)[0, :1000], a[0])


def test_top_p_draws_only_from_the_renormalized_nucleus() -> None:
    p = torch.softmax(LOGITS.double(), -1)  # 0.53, 0.20, 0.12, 0.07, ...
    keep = torch.tensor([True, True, True, False, False, False])  # 0.53 + 0.20 < 0.8 <= + 0.12
    nucleus = torch.where(keep, p, 0) / p[keep].sum()
    freq = _freqs(1.0, 0.8)
    assert (freq[~keep] == 0).all()
    _close(freq, nucleus)
    assert torch.isinf(nucleus_logits(LOGITS[None], 1.0, 0.8)[0, ~keep]).all()


def test_top_p_one_keeps_every_token_and_tiny_top_p_keeps_the_argmax() -> None:
    flat = torch.zeros(1, 50_000)  # cumsum rounding must not drop the tail at top_p = 1
    assert torch.isfinite(nucleus_logits(flat, 1.0, 1.0)).all()
    assert (_freqs(1.0, 1e-6) == torch.eye(6, dtype=torch.float64)[0]).all()


def test_temperature_zero_rows_are_greedy_and_rows_have_their_own_settings() -> None:
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(0))
    noise = uniform_noise(4, 30, torch.Generator().manual_seed(1))
    got = pick_tokens(logits, noise, torch.tensor([0.0, 1.0, 0.0, 1.0]), 1.0)
    sampled = pick_tokens(logits, noise, 1.0, 1.0)
    assert got[0] == logits[0].argmax() and got[2] == logits[2].argmax()
    assert got[1] == sampled[1] and got[3] == sampled[3]
    assert (sample_tokens(logits, 0.0) == logits.argmax(-1)).all()


def test_the_same_noise_gives_the_same_tokens_and_other_seeds_others() -> None:
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(0))

    def draw(seed: int) -> torch.Tensor:
        return sample_tokens(logits, 1.0, 0.9, torch.Generator().manual_seed(seed))

    assert torch.equal(draw(5), draw(5))
    assert not torch.equal(draw(5), draw(6))


def test_noise_stays_strictly_inside_zero_one() -> None:
    u = uniform_noise(64, 4096, torch.Generator().manual_seed(0))
    assert bool((u > 0).all() and (u < 1).all())
    assert torch.isfinite(-torch.log(-torch.log(u))).all()


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"temperature": -0.5}, "expected temperature >= 0"),
        ({"temperature": 0.7, "top_p": 0.0}, "0 < top_p <= 1"),
        ({"temperature": [0.5]}, "temperature has 1 values for a batch of 2"),
        ({"top_p": [0.9, 0.9, 0.9]}, "top_p has 3 values for a batch of 2"),
        ({"attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]])}, "pad on the left"),
        ({"attention_mask": torch.tensor([[1, 1, 1], [0, 0, 0]])}, "every prompt needs a token"),
        ({"attention_mask": torch.ones(2, 4)}, "expected the same shape"),
        ({"attention_mask": torch.full((2, 3), 2)}, "other than 0 and 1"),
    ],
)
def test_fast_decode_refuses_bad_settings_before_touching_the_model(kw: dict, match: str) -> None:
    from quantmesh.infer.decode import fast_decode

    with pytest.raises(ValueError, match=match):
        fast_decode(torch.nn.Identity(), torch.zeros(2, 3, dtype=torch.long), 4, **kw)


def test_top_k_and_min_p_draw_from_the_renormalized_rest() -> None:
    gen = torch.Generator().manual_seed(3)
    toks = sample_tokens(LOGITS.expand(N, -1), 1.0, 1.0, gen, top_k=3)
    freq = torch.bincount(toks, minlength=LOGITS.numel()).double() / N
    want = torch.softmax(LOGITS.double(), -1)
    want[3:] = 0
    _close(freq, want / want.sum())
    # min_p=0.3: tokens under 0.3 x the top probability go (e^-1 = 0.37 stays, e^-1.5 = 0.22 not)
    kept = torch.isfinite(nucleus_logits(LOGITS[None], 1.0, 1.0, min_p=0.3))[0]
    assert kept.tolist() == [True, True, False, False, False, False]
    # top-k before top-p (vLLM's order): top_p sees the renormalized top 2 (0.73, 0.27)
    kept = torch.isfinite(nucleus_logits(LOGITS[None], 1.0, 0.7, top_k=2))[0]
    assert kept.tolist() == [True, False, False, False, False, False]
    kept = torch.isfinite(nucleus_logits(LOGITS[None], 1.0, 0.75, top_k=2))[0]
    assert kept.tolist() == [True, True, False, False, False, False]
    # per-row settings; a greedy row ignores them all
    z = nucleus_logits(LOGITS.expand(2, -1), torch.tensor([1.0, 1.0]), 1.0,
                       top_k=torch.tensor([1, 0]))  # fmt: skip
    assert torch.isfinite(z).sum(-1).tolist() == [1, 6]
    assert pick_tokens(LOGITS[None], uniform_noise(1, 6), 0.0, 1.0, top_k=2, min_p=0.9).item() == 0


def test_penalties_follow_their_definitions() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 3.0]])
    seen = torch.tensor([[True, True, False, False]])  # in the prompt
    counts = torch.tensor([[0.0, 0.0, 2.0, 0.0]])  # generated twice
    out = penalize(logits, seen, counts, repetition=2.0)
    assert out.tolist() == [[1.0, -4.0, 0.5, 3.0]]  # seen: positive halved, negative doubled
    out = penalize(logits, seen, counts, presence=0.5, frequency=0.25)
    assert out.tolist() == [[2.0, -2.0, 1.0 - 0.5 - 0.5, 3.0]]  # generated tokens only
    assert torch.equal(penalize(logits, seen, counts), logits)  # the defaults are off
