"""Token sampling shared by the fast decode loop and the server: temperature, nucleus (top-p), greedy.

One mechanism for every caller: the Gumbel-max draw. With `u` uniform in (0, 1),
`argmax(logits / T - log(-log u))` is an exact draw from `softmax(logits / T)`; masking the tokens
outside the nucleus to -inf first makes it an exact draw from the renormalized nucleus. The noise is
an input, not drawn inside: a compiled (CUDA-graph) decode step then stays one static graph, eager
and compiled steps given the same noise pick the same token, and tp ranks that draw the noise from
the same seed agree without a collective. Rows may have their own temperature and top-p; a row with
temperature 0 is greedy (its noise is ignored).
"""

from __future__ import annotations

import torch

__all__ = ["nucleus_logits", "pick_tokens", "sample_tokens", "uniform_noise"]


def _per_row(v: float | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A scalar or (batch,) setting as a (batch, 1) float32 tensor on `like`'s device."""
    t = torch.as_tensor(v, dtype=torch.float32, device=like.device)
    return t.reshape(-1, 1).expand(like.shape[0], 1)


def nucleus_logits(
    logits: torch.Tensor, temperature: float | torch.Tensor, top_p: float | torch.Tensor
) -> torch.Tensor:  # (batch, vocab) -> (batch, vocab) float32
    """`logits / temperature` with every token outside the top-p nucleus set to -inf.

    The nucleus of a row is the smallest set of most likely tokens whose probability reaches
    `top_p` (the most likely token always stays); `top_p=1` keeps every token. A temperature of 0
    divides by 1 instead (greedy rows only need the argmax, which dividing does not move).

    Example:
        >>> nucleus_logits(torch.tensor([[0.0, 3.0, 1.0]]), 1.0, 0.5)
        tensor([[-inf, 3., -inf]])
    """
    t = _per_row(temperature, logits)
    p = _per_row(top_p, logits)
    z = logits.float() / torch.where(t > 0, t, torch.ones_like(t))
    sorted_z, order = z.sort(dim=-1, descending=True)
    probs = torch.softmax(sorted_z, dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above each one
    drop_sorted = (before >= p) & (p < 1)  # top_p = 1 keeps all, whatever cumsum's rounding
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return z.masked_fill(drop, float("-inf"))


def pick_tokens(
    logits: torch.Tensor,
    noise: torch.Tensor,
    temperature: float | torch.Tensor,
    top_p: float | torch.Tensor,
) -> torch.Tensor:  # (batch, vocab), (batch, vocab) -> (batch,)
    """One token per row: a Gumbel-max draw from the tempered nucleus, given uniform `noise`
    (`uniform_noise`); argmax for rows whose temperature is 0. Traceable: no data-dependent
    Python branches, so it compiles into a decode step.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> pick_tokens(torch.tensor([[0.0, 9.0]]), uniform_noise(1, 2, g), 1.0, 1.0)
        tensor([1])
    """
    z = nucleus_logits(logits, temperature, top_p)
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


def sample_tokens(
    logits: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    top_p: float | torch.Tensor = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:  # (batch, vocab) -> (batch,)
    """Draw one token per row of `logits` with temperature and top-p (0 = greedy), the noise
    drawn from `generator` on the logits' device.

    Example:
        >>> sample_tokens(torch.tensor([[0.0, 9.0], [9.0, 0.0]]), 0.0)
        tensor([1, 0])
    """
    noise = uniform_noise(logits.shape[0], logits.shape[-1], generator, logits.device)
    return pick_tokens(logits, noise, temperature, top_p)
