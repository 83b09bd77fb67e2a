"""Token sampling shared by the fast decode loop and the server: temperature, top-k, nucleus (top-p),
min-p, greedy, and the repetition / presence / frequency penalties.

One mechanism for every caller: the Gumbel-max draw. With `u` uniform in (0, 1),
`argmax(logits / T - log(-log u))` is an exact draw from `softmax(logits / T)`; masking the tokens
outside the nucleus to -inf first makes it an exact draw from the renormalized nucleus. The noise is
an input, not drawn inside: a compiled (CUDA-graph) decode step then stays one static graph, eager
and compiled steps given the same noise pick the same token, and tp ranks that draw the noise from
the same seed agree without a collective. Rows may have their own temperature, top-k, top-p and
min-p; a row with temperature 0 is greedy (its noise is ignored).

The filters follow vLLM's order: penalties on the raw logits (`penalize`), then the temperature,
then top-k, top-p and min-p, each computed on the tempered distribution; the most likely token
always survives, so a greedy row's argmax is never filtered out.
"""

from __future__ import annotations

import torch

__all__ = [
    "counter_noise",
    "nucleus_logits",
    "penalize",
    "pick_tokens",
    "repetition_penalized",
    "sample_tokens",
    "uniform_noise",
]


def _per_row(v: float | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A scalar or (batch,) setting as a (batch, 1) float32 tensor on `like`'s device."""
    t = torch.as_tensor(v, dtype=torch.float32, device=like.device)
    return t.reshape(-1, 1).expand(like.shape[0], 1)


def nucleus_logits(
    logits: torch.Tensor,
    temperature: float | torch.Tensor,
    top_p: float | torch.Tensor,
    top_k: int | torch.Tensor = 0,
    min_p: float | torch.Tensor = 0.0,
) -> torch.Tensor:  # (batch, vocab) -> (batch, vocab) float32
    """`logits / temperature` with every token outside the top-k, the top-p nucleus or the min-p
    floor set to -inf.

    The nucleus of a row is the smallest set of most likely tokens whose probability reaches
    `top_p` (the most likely token always stays); `top_p=1` keeps every token. `top_k` keeps the
    k most likely tokens (0 = all). `min_p` drops the tokens less likely than `min_p` times the most
    likely one (0 = none). A temperature of 0 divides by 1 instead (greedy rows only need the
    argmax, which dividing does not move).

    Example:
        >>> nucleus_logits(torch.tensor([[0.0, 3.0, 1.0]]), 1.0, 0.5)
        tensor([[-inf, 3., -inf]])
        >>> nucleus_logits(torch.tensor([[0.0, 3.0, 1.0]]), 1.0, 1.0, top_k=2)
        tensor([[-inf, 3., 1.]])
    """
    t = _per_row(temperature, logits)
    p = _per_row(top_p, logits)
    k = _per_row(top_k, logits)
    m = _per_row(min_p, logits)
    z = logits.float() / torch.where(t > 0, t, torch.ones_like(t))
    sorted_z, order = z.sort(dim=-1, descending=True)
    rank = torch.arange(z.shape[-1], device=z.device).expand_as(z)
    drop_sorted = (k > 0) & (rank >= k)  # top-k first: top-p then sees the renormalized top k
    probs = torch.softmax(sorted_z.masked_fill(drop_sorted, float("-inf")), dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above each one
    drop_sorted |= (before >= p) & (p < 1)  # top_p = 1 keeps all, whatever cumsum's rounding
    drop_sorted |= probs < m * probs[:, :1]  # min_p = 0 drops nothing (a ratio: renormalizing
    # after top-k does not move it)
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return z.masked_fill(drop, float("-inf"))


def penalize(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor,
    counts: torch.Tensor,
    repetition: float | torch.Tensor = 1.0,
    presence: float | torch.Tensor = 0.0,
    frequency: float | torch.Tensor = 0.0,
) -> torch.Tensor:  # (batch, vocab) x3 -> (batch, vocab) float32
    """Logits with the repetition, presence and frequency penalties applied (vLLM's definitions).

    `prompt_mask` (bool) marks the tokens of each row's prompt, `counts` how often each token was
    generated so far. The repetition penalty (CTRL's: 1 = off) divides the positive logits and
    multiplies the negative ones of every token seen in the prompt or the output; the presence
    penalty subtracts itself once from every generated token, the frequency penalty once per
    occurrence (OpenAI's: 0 = off, generated tokens only).

    Example:
        >>> seen = torch.tensor([[False, True]])
        >>> penalize(torch.tensor([[2.0, 2.0]]), seen, torch.zeros(1, 2), repetition=2.0)
        tensor([[2., 1.]])
    """
    z = repetition_penalized(logits, prompt_mask | (counts > 0), repetition)
    c = counts.float()
    z = z - _per_row(frequency, z) * c - _per_row(presence, z) * (c > 0).float()
    return z


def repetition_penalized(
    logits: torch.Tensor, seen: torch.Tensor, repetition: float | torch.Tensor
) -> torch.Tensor:  # (batch, vocab), (batch, vocab) bool -> (batch, vocab) float32
    """Logits with CTRL's repetition penalty (transformers' `repetition_penalty`; 1 = off): the
    tokens marked `seen` have their positive logits divided by it and their negative ones
    multiplied. Traceable (a compiled decode step applies it).

    Example:
        >>> repetition_penalized(torch.tensor([[2.0, -2.0, 2.0]]),
        ...                      torch.tensor([[True, True, False]]), 2.0)
        tensor([[ 1., -4.,  2.]])
    """
    z = logits.float()
    r = _per_row(repetition, z)
    return torch.where(seen, torch.where(z > 0, z / r, z * r), z)


def pick_tokens(
    logits: torch.Tensor,
    noise: torch.Tensor,
    temperature: float | torch.Tensor,
    top_p: float | torch.Tensor,
    top_k: int | torch.Tensor = 0,
    min_p: float | torch.Tensor = 0.0,
) -> torch.Tensor:  # (batch, vocab), (batch, vocab) -> (batch,)
    """One token per row: a Gumbel-max draw from the tempered, filtered logits (`nucleus_logits`),
    given uniform `noise`
    (`uniform_noise`); argmax for rows whose temperature is 0. Traceable: no data-dependent
    Python branches, so it compiles into a decode step.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> pick_tokens(torch.tensor([[0.0, 9.0]]), uniform_noise(1, 2, g), 1.0, 1.0)
        tensor([1])
    """
    z = nucleus_logits(logits, temperature, top_p, top_k, min_p)
    gumbel = -torch.log(-torch.log(noise.float()))
    sampled = (z + gumbel).argmax(dim=-1)
    greedy = logits.argmax(dim=-1)
    return torch.where(_per_row(temperature, logits)[:, 0] > 0, sampled, greedy)


def uniform_noise(
    batch: int,
    vocab: int,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:  # -> (batch, vocab) float32 in (0, 1)
    """Uniform noise strictly inside (0, 1) for `pick_tokens` (both logs stay finite).

    Example:
        >>> uniform_noise(2, 5, torch.Generator().manual_seed(0)).shape
        torch.Size([2, 5])
    """
    u = torch.rand(batch, vocab, generator=generator, device=device)
    tiny = torch.finfo(torch.float32).tiny
    return u.clamp_(min=tiny, max=1.0 - torch.finfo(torch.float32).eps / 2)


_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 `x` in [0, 2**32) and a 32-bit constant, in two 16-bit halves
    so that no int64 product overflows (wrapping is undefined in C; the halves stay < 2**49)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finalizer (xor-shift-multiply rounds; constants from the public
    "lowbias32" search): every input bit moves every output bit."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def counter_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniform noise in (0, 1) for `pick_tokens`, a pure function of each row's (seed, counter):
    (batch,) int64 seeds (>= 0) and counters (e.g. the tokens a row generated so far) ->
    (batch, vocab) float32, on their device.

    A counter-based generator: element j of row r is a hash of (seeds[r], counters[r], j), so the
    draw of a row depends on nothing else in the batch, is the same on every device (integer ops
    only; CPU and GPU give equal bits), needs no generator state, and traces into a compiled
    step. 24 bits per value: (h + 0.5) / 2**24 is strictly inside (0, 1).

    Example:
        >>> u = counter_noise(torch.tensor([7, 7]), torch.tensor([0, 1]), 4)
        >>> u.shape, bool((u > 0).all() and (u < 1).all()), bool((u[0] != u[1]).any())
        (torch.Size([2, 4]), True, True)
    """
    s = seeds.to(torch.long).reshape(-1, 1)
    c = counters.to(torch.long).reshape(-1, 1)
    key = _mix32((s & _M32) ^ _mix32(((s >> 32) & _M32) ^ _mix32(c & _M32)))  # (batch, 1)
    j = _mix32(torch.arange(vocab, device=s.device, dtype=torch.long))[None, :]
    h = _mix32(_mix32(key ^ j) ^ key)  # (batch, vocab)
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def sample_tokens(
    logits: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    top_p: float | torch.Tensor = 1.0,
    generator: torch.Generator | None = None,
    top_k: int | torch.Tensor = 0,
    min_p: float | torch.Tensor = 0.0,
) -> torch.Tensor:  # (batch, vocab) -> (batch,)
    """Draw one token per row of `logits` with temperature (0 = greedy), top-k, top-p and min-p,
    the noise drawn from `generator` on the logits' device.

    Example:
        >>> sample_tokens(torch.tensor([[0.0, 9.0], [9.0, 0.0]]), 0.0)
        tensor([1, 0])
    """
    noise = uniform_noise(logits.shape[0], logits.shape[-1], generator, logits.device)
    return pick_tokens(logits, noise, temperature, top_p, top_k, min_p)
