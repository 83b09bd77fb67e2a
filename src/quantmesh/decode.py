"""greedy_decode: a lean greedy decoding loop for transformers causal LMs, sharded or not.

Batch-1 decoding is bound by the host, not the GPU: a 7B bf16 model reads its weights in ~3 ms per
token on one H200 (~1.6 ms per rank at tp=2), while transformers' `generate` spends a few
milliseconds of Python per token and reads a flag back from the GPU every step, so the host waits
for each token before it launches the next. Here the loop is: one eager prefill that fills a
transformers `StaticCache`, then one compiled step per token (the whole forward, tp all-reduces
included, replayed as a CUDA graph with mode "reduce-overhead"), with every token kept on the
device. The host reads the tokens back only every `check_every` steps (to stop at EOS) and at the
end, so it runs ahead of the GPU.

On tp ranks every rank runs the same loop in lock step: the LM head gathers the logits, so each rank
picks the same token. Greedy only (argmax); for sampling use `model.generate`.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

__all__ = ["greedy_decode"]

CACHE_STEP = 256  # the static cache's length is a multiple of this


class _Decoder:
    """The static cache and the compiled step of one model, reused while the shapes stay the same
    (a new cache object would fail the compiled step's guards and compile it again)."""

    def __init__(
        self, model: nn.Module, batch: int, max_len: int, compile: bool, mode: str | None
    ) -> None:
        from transformers import StaticCache

        params = inspect.signature(model.forward).parameters
        names = [n for n in ("past_key_values", "cache") if n in params]  # by transformers version
        if not names:
            raise TypeError(
                f"{type(model).__name__}.forward takes neither `past_key_values` nor `cache`; "
                "greedy_decode needs a transformers causal LM"
            )
        self.key = (batch, max_len, compile, mode)
        config: Any = model.config  # a transformers PreTrainedConfig
        self.cache = StaticCache(config=config, max_cache_len=max_len)
        self.kw = {names[0]: self.cache, "use_cache": True}
        self.prefill_kw = {
            **self.kw,
            **({"logits_to_keep": 1} if "logits_to_keep" in params else {}),
        }
        self.model = model
        self.run = torch.compile(self.step, mode=mode, fullgraph=True) if compile else self.step

    def logits(self, tok: torch.Tensor) -> torch.Tensor:  # (batch, 1) -> (batch, vocab)
        """One step's next-token logits (the cache advances by one position)."""
        out: torch.Tensor = self.model(input_ids=tok, **self.kw).logits  # (batch, 1, vocab)
        return out[:, -1]

    def step(self, tok: torch.Tensor) -> torch.Tensor:  # (batch, 1) -> (batch, 1)
        return self.logits(tok).argmax(dim=-1, keepdim=True)

    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:  # (batch, prompt) -> (batch, 1)
        self.cache.reset()  # in place: the tensors keep their addresses
        logits: torch.Tensor = self.model(input_ids=input_ids, **self.prefill_kw).logits
        return logits[:, -1].argmax(dim=-1, keepdim=True)


@torch.no_grad()
def greedy_decode(
    model: nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    eos_token_id: int | list[int] | None = None,
    compile: bool = True,
    mode: str | None = "reduce-overhead",
    check_every: int = 32,
) -> torch.Tensor:
    """Greedy continuation of `input_ids` (batch, prompt); returns (batch, <= max_new_tokens) ids.

    The model must be a transformers causal LM (plain, quantized, or parallelized by quantmesh);
    its config gives the static cache's layout. `compile=False` runs the same loop eagerly. The
    first call compiles the step (tens of seconds for a 7B model); later calls reuse it while the
    batch size and the cache length (prompt + new tokens, rounded up to a multiple of 256) stay.
    `eos_token_id` may be one id or several (any of them ends a row); a row that reaches one is
    filled with it after its first EOS, and decoding stops once every row has one (checked every
    `check_every` tokens).

    Example:
        >>> ids = tok("Once upon a time", return_tensors="pt").input_ids.to(mesh.device)  # doctest: +SKIP
        >>> new = qm.greedy_decode(model, ids, 256)                                        # doctest: +SKIP
        >>> print(tok.decode(new[0]))                                                      # doctest: +SKIP
    """
    if input_ids.dim() != 2 or input_ids.shape[1] < 1:
        raise ValueError(
            f"input_ids of shape {tuple(input_ids.shape)}; expected (batch, prompt length >= 1)"
        )
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}; expected >= 1")
    if check_every < 1:
        raise ValueError(f"check_every={check_every}; expected >= 1")
    from .state import parallel_state

    st = parallel_state(model, required=False)
    if st is not None and st.mesh.pp > 1:
        raise NotImplementedError(
            f"greedy_decode at pp={st.mesh.pp}: each rank holds one pipeline stage, and decoding "
            f"through the stages (one token crossing every stage per step) is not implemented; "
            f"decode with tp instead: qm.init_mesh(tp={st.mesh.tp * st.mesh.pp}) (or pp=1)"
        )
    batch, prompt = input_ids.shape
    # The cache length in steps of CACHE_STEP: prompts of other lengths reuse the compiled step
    # (a new cache would compile it again); unused slots are masked out.
    max_len = -(-(prompt + max_new_tokens) // CACHE_STEP) * CACHE_STEP
    key = (batch, max_len, compile, mode)
    # the compiled step is cached on the model itself (a plain model works too), not in the
    # parallel state: it is a cache of this function, not a decision of parallelize
    dec = model.__dict__.get("_quantmesh_decoder")
    if dec is None or dec.key != key:
        dec = _Decoder(model, batch, max_len, compile, mode)
        model.__dict__["_quantmesh_decoder"] = dec
    # prefill, eager: it allocates the cache (transformers marks its tensors static for the graphs)
    tok = dec.prefill(input_ids)  # (batch, 1)
    eos = None
    if eos_token_id is not None:
        ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        eos = torch.tensor(ids, dtype=tok.dtype, device=tok.device)  # (n_eos,)
    out = torch.empty(batch, max_new_tokens, dtype=tok.dtype, device=tok.device)
    out[:, :1] = tok
    done = 1
    for i in range(1, max_new_tokens):
        tok = dec.run(
            tok
        ).clone()  # a copy: a CUDA graph's output buffer is rewritten by the next replay
        out[:, i : i + 1] = tok
        done = i + 1
        if eos is not None and done % check_every == 0:
            if bool(torch.isin(out[:, :done], eos).any(dim=1).all()):
                break
    out = out[:, :done]
    if eos is not None:  # everything after a row's first EOS becomes that EOS
        hit = torch.isin(out, eos)  # (batch, done)
        after = hit.int().cumsum(dim=1) > 0
        first = torch.where(hit, out, 0).gather(1, hit.int().argmax(dim=1, keepdim=True))
        out = torch.where(after, first, out)
    return out
