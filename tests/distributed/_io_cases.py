"""Shared by test_load / test_hf / test_save: tiny transformers folders and rank-side helpers.

Every builder fills all parameters with random values (biases and norm weights included: a zero bias
or a unit norm hides a slice that lands in the wrong place) and saves with `save_pretrained`
(safetensors), so the files are exactly what transformers writes.
"""

from __future__ import annotations

import math
import threading
from pathlib import Path

import torch
from torch import nn

VOCAB = 128


@torch.no_grad()
def randomize(model: nn.Module, seed: int = 0) -> nn.Module:
    """N(0, 1) noise scaled by 1/sqrt(fan-in) for matrices, 1 + 0.2 noise for norm weights, 0.2
    noise for other vectors; tied weights stay tied (one tensor)."""
    g = torch.Generator().manual_seed(seed)
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        noise = torch.randn(p.shape, generator=g)
        if p.dim() >= 2:
            p.copy_(noise * 1.5 / math.sqrt(min(p.shape)))
        elif "norm" in name or "ln_" in name:
            p.copy_(1 + 0.2 * noise)
        else:
            p.copy_(0.2 * noise)
    return model


def llama_dir(root: Path, *, hidden=72, heads=9, kv=3, head_dim=8, inter=96, bias=True,
              tie=True, seed=0) -> Path:  # fmt: skip
    """A LlamaForCausalLM folder; the default has 9 heads / 3 KV heads (uneven splits)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
        max_position_embeddings=64, tie_word_embeddings=tie, attention_bias=bias, mlp_bias=bias,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = randomize(LlamaForCausalLM(cfg), seed)
    model.generation_config.max_new_tokens = 7  # a value from_pretrained must bring back
    model.save_pretrained(root, safe_serialization=True)
    return root


def gpt2_dir(root: Path, seed: int = 1) -> Path:
    """A GPT2LMHeadModel folder: Conv1D (in, out) weights, fused q|k|v, tied head, no dropout."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=VOCAB, n_positions=64, n_embd=48, n_layer=2, n_head=4, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(seed)
    randomize(GPT2LMHeadModel(cfg), seed).save_pretrained(root, safe_serialization=True)
    return root


def gpt2_legacy_dir(src: Path, root: Path) -> Path:
    """The GPT-2 folder rewritten the way the original hub checkpoints are: keys without the
    `transformer.` prefix, plus the old causal-mask buffers `h.N.attn.bias` (to be ignored)."""
    from safetensors.torch import load_file, save_file

    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text((src / "config.json").read_text())
    tensors = {
        k.removeprefix("transformer."): v for k, v in load_file(src / "model.safetensors").items()
    }
    for i in range(2):
        tensors[f"h.{i}.attn.bias"] = torch.tril(torch.ones(64, 64)).view(1, 1, 64, 64)
    save_file(tensors, root / "model.safetensors", metadata={"format": "pt"})
    return root


def token_ids(seed: int = 0, batch: int = 2, length: int = 9) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def hf_logits(path, ids: torch.Tensor) -> torch.Tensor:
    """Logits of plain transformers (the reference), eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        return model(ids).logits


def logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def rss_anon() -> int:
    """Anonymous resident memory of this process, bytes (file-backed page cache excluded)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


class PeakRss(threading.Thread):
    """Samples RssAnon every ~1 ms while running (torch kernels release the GIL)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak, self.stop = rss_anon(), False

    def run(self) -> None:
        while not self.stop:
            self.peak = max(self.peak, rss_anon())
            threading.Event().wait(0.001)

    def __enter__(self) -> PeakRss:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop = True
        self.join()
        self.peak = max(self.peak, rss_anon())
