"""A small zoo of models shared by the tests: tiny, random, and shaped like the real thing.

- `mlp()`: a plain MLP (nn.Sequential of Linear / GELU / Linear pairs), no attention, no blocks.
- `NMTModel`: an OpenNMT-style encoder-decoder transformer written as plain PyTorch: multi-head
  attention with separate `linear_keys` / `linear_values` / `linear_query` / `final_linear`, the head
  count kept in `head_count` and `dim_per_head` and used in `view()`, a position-wise feed-forward
  (`w_1`, `w_2`), LayerNorms, sinusoidal positions, decoder cross-attention over the encoder output,
  and a generator head (optionally tied to the decoder embedding).
- `cnn()`: conv -> relu -> conv pairs, then a pooled linear classifier.
- `tiny_gpt()`: a nanoGPT-like model whose fused q|k|v attention stores `n_head` / `n_kv_head`
  (grouped-query) and uses them in view().
- `DirectProj`, `MHABlock` (in a `Stack`): blocks whose weights a parent reads directly.
- `llama()`, `gpt2()`, `opt()`, `bert()`: transformers models from tiny configs.
- `case(name)`, `check_case`, `check_empty`, `compare_tp`: what the distributed tests run inside
  each rank (a parallelized copy against the one-process reference).

Every builder fills *all* parameters with random values (`randomize_`): biases and norm weights
included, because zero biases and unit norms hide bugs (a rowwise bias added on every rank is
invisible when the bias is zero).

Example:
    >>> model = nmt(seed=0)
    >>> src, tgt = nmt_inputs(seed=1)
    >>> model(src, tgt).shape
    torch.Size([2, 5, 40])
"""

from __future__ import annotations

import math
import operator

import torch
import torch.nn.functional as F
from torch import nn

# ----------------------------------------------------------------------------------------------
# helpers


@torch.no_grad()
def nonzero_lora_b_(model: nn.Module, std: float = 0.05) -> nn.Module:
    """Give every LoRA B (zero at init) N(0, std) values, seeded by its name's length, so that every
    adapter's output and both its gradients are nonzero."""
    for n, p in model.named_parameters():
        if "lora_B" in n:
            p.normal_(0, std, generator=torch.Generator().manual_seed(len(n)))
    return model


@torch.no_grad()
def randomize_(model: nn.Module, seed: int = 0, std: float = 0.2) -> nn.Module:
    """Fill every parameter with N(0, std) noise (norm weights: 1 + noise); tied weights stay tied.

    Matrices are scaled by 1.5/sqrt(fan-in) so activations keep a unit-ish size through a few layers
    (large enough that an error shows, small enough that softmax does not saturate).

    Example:
        >>> randomize_(nn.Linear(4, 2), seed=0).bias.abs().sum() > 0
        tensor(True)
    """
    g = torch.Generator().manual_seed(seed)
    seen: set[int] = set()
    for name, p in model.named_parameters(remove_duplicate=True):
        if id(p) in seen or p.device.type == "meta":
            continue
        seen.add(id(p))
        noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
        if "norm" in name.lower() and p.dim() == 1 and name.endswith("weight"):
            p.copy_(1.0 + std * noise)
        elif p.dim() > 2:  # conv (out, in, kh, kw): fan-in is in * kh * kw
            p.copy_(noise * 1.5 / math.sqrt(p[0].numel()))
        elif p.dim() == 2:  # Linear (out, in), Conv1D (in, out), Embedding: the smaller side
            p.copy_(noise * 1.5 / math.sqrt(min(p.shape)))
        else:
            p.copy_(std * noise)
    return model


# ----------------------------------------------------------------------------------------------
# a plain MLP


def mlp(d: int = 16, hidden: int = 48, seed: int = 0) -> nn.Sequential:
    """A plain MLP, two up/down pairs: (B, d) -> (B, d).

    Example:
        >>> mlp()(torch.randn(3, 16)).shape
        torch.Size([3, 16])
    """
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(d, hidden),
        nn.GELU(),
        nn.Linear(hidden, d),
        nn.ReLU(),
        nn.Linear(d, hidden + 8),
        nn.Tanh(),
        nn.Linear(hidden + 8, d),
    )
    return randomize_(model, seed)


# ----------------------------------------------------------------------------------------------
# an OpenNMT-style encoder-decoder transformer (plain PyTorch)


class MultiHeadedAttention(nn.Module):
    """Multi-head attention: separate key / value / query projections and a final linear.

    `head_count` and `dim_per_head` are instance attributes read in forward, as in OpenNMT-py: after
    tensor parallelism each rank holds a few heads, so the planner must rewrite `head_count`.
    """

    def __init__(self, head_count: int, model_dim: int, dropout: float = 0.0):
        super().__init__()
        assert model_dim % head_count == 0, (model_dim, head_count)
        self.dim_per_head = model_dim // head_count
        self.model_dim = model_dim
        self.head_count = head_count
        self.linear_keys = nn.Linear(model_dim, head_count * self.dim_per_head)
        self.linear_values = nn.Linear(model_dim, head_count * self.dim_per_head)
        self.linear_query = nn.Linear(model_dim, head_count * self.dim_per_head)
        self.dropout = nn.Dropout(dropout)
        self.final_linear = nn.Linear(model_dim, model_dim)

    def forward(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        query: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """key/value (B, S, D), query (B, T, D), mask (B, 1 or T, S) True = masked -> (B, T, D)."""
        b = key.size(0)

        def shape(x: torch.Tensor) -> torch.Tensor:  # (B, L, H*d) -> (B, H, L, d); -1 = L
            return x.view(b, -1, self.head_count, self.dim_per_head).transpose(1, 2)

        def unshape(x: torch.Tensor) -> torch.Tensor:  # (B, H, L, d) -> (B, L, H*d)
            return x.transpose(1, 2).contiguous().view(b, -1, self.head_count * self.dim_per_head)

        k = shape(self.linear_keys(key))  # (B, H, S, d)
        v = shape(self.linear_values(value))  # (B, H, S, d)
        q = shape(self.linear_query(query)) / math.sqrt(self.dim_per_head)  # (B, H, T, d)
        scores = q @ k.transpose(2, 3)  # (B, H, T, S)
        if mask is not None:
            scores = scores.masked_fill(mask.unsqueeze(1), -1e18)
        attn = self.dropout(torch.softmax(scores, dim=-1))
        return self.final_linear(unshape(attn @ v))  # (B, T, D)


class PositionwiseFeedForward(nn.Module):
    """Pre-norm feed-forward with its own residual: x + w_2(relu(w_1(norm(x))))."""

    def __init__(self, d_model: int, d_ff: int, dropout: float = 0.0):
        super().__init__()
        self.w_1 = nn.Linear(d_model, d_ff)
        self.w_2 = nn.Linear(d_ff, d_model)
        self.layer_norm = nn.LayerNorm(d_model, eps=1e-6)
        self.dropout_1 = nn.Dropout(dropout)
        self.dropout_2 = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inter = self.dropout_1(F.relu(self.w_1(self.layer_norm(x))))  # (B, L, d_ff)
        return self.dropout_2(self.w_2(inter)) + x


class PositionalEncoding(nn.Module):
    """Sinusoidal positions added to scaled embeddings (a buffer, no parameters)."""

    def __init__(self, dim: int, max_len: int = 64):
        super().__init__()
        pos = torch.arange(max_len).unsqueeze(1).float()
        div = torch.exp(torch.arange(0, dim, 2).float() * -(math.log(10000.0) / dim))
        pe = torch.zeros(max_len, dim)
        pe[:, 0::2] = torch.sin(pos * div)
        pe[:, 1::2] = torch.cos(pos * div)
        self.register_buffer("pe", pe, persistent=False)  # (max_len, D)
        self.dim = dim

    def forward(self, emb: torch.Tensor) -> torch.Tensor:
        return emb * math.sqrt(self.dim) + self.pe[: emb.size(1)]


class Embeddings(nn.Module):
    """Word lookup table plus sinusoidal positions."""

    def __init__(self, vocab: int, dim: int, padding_idx: int = 1):
        super().__init__()
        self.word_lut = nn.Embedding(vocab, dim, padding_idx=padding_idx)
        self.pe = PositionalEncoding(dim)

    @property
    def weight(self) -> torch.Tensor:
        return self.word_lut.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.pe(self.word_lut(ids))  # (B, L, D)


class TransformerEncoderLayer(nn.Module):
    def __init__(self, d_model: int, heads: int, d_ff: int, dropout: float = 0.0):
        super().__init__()
        self.self_attn = MultiHeadedAttention(heads, d_model, dropout)
        self.feed_forward = PositionwiseFeedForward(d_model, d_ff, dropout)
        self.layer_norm = nn.LayerNorm(d_model, eps=1e-6)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.layer_norm(x)
        out = self.dropout(self.self_attn(h, h, h, mask=mask)) + x
        return self.feed_forward(out)


class TransformerDecoderLayer(nn.Module):
    def __init__(self, d_model: int, heads: int, d_ff: int, dropout: float = 0.0):
        super().__init__()
        self.self_attn = MultiHeadedAttention(heads, d_model, dropout)
        self.context_attn = MultiHeadedAttention(heads, d_model, dropout)
        self.feed_forward = PositionwiseFeedForward(d_model, d_ff, dropout)
        self.layer_norm_1 = nn.LayerNorm(d_model, eps=1e-6)
        self.layer_norm_2 = nn.LayerNorm(d_model, eps=1e-6)
        self.drop = nn.Dropout(dropout)

    def forward(
        self,
        x: torch.Tensor,
        memory_bank: torch.Tensor,
        src_pad_mask: torch.Tensor,
        tgt_mask: torch.Tensor,
    ) -> torch.Tensor:
        h = self.layer_norm_1(x)
        query = self.drop(self.self_attn(h, h, h, mask=tgt_mask)) + x  # (B, T, D)
        query_norm = self.layer_norm_2(query)
        mid = self.context_attn(memory_bank, memory_bank, query_norm, mask=src_pad_mask)
        return self.feed_forward(self.drop(mid) + query)


class TransformerEncoder(nn.Module):
    def __init__(self, layers: int, d_model: int, heads: int, d_ff: int, emb: Embeddings):
        super().__init__()
        self.embeddings = emb
        self.transformer = nn.ModuleList(
            TransformerEncoderLayer(d_model, heads, d_ff) for _ in range(layers)
        )
        self.layer_norm = nn.LayerNorm(d_model, eps=1e-6)

    def forward(self, src: torch.Tensor, pad_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        mask = (src == pad_idx).unsqueeze(1)  # (B, 1, S)
        x = self.embeddings(src)
        for layer in self.transformer:
            x = layer(x, mask)
        return self.layer_norm(x), mask


class TransformerDecoder(nn.Module):
    def __init__(self, layers: int, d_model: int, heads: int, d_ff: int, emb: Embeddings):
        super().__init__()
        self.embeddings = emb
        self.transformer_layers = nn.ModuleList(
            TransformerDecoderLayer(d_model, heads, d_ff) for _ in range(layers)
        )
        self.layer_norm = nn.LayerNorm(d_model, eps=1e-6)

    def forward(
        self, tgt: torch.Tensor, memory_bank: torch.Tensor, src_pad_mask: torch.Tensor
    ) -> torch.Tensor:
        t = tgt.size(1)
        future = torch.triu(torch.ones(t, t, dtype=torch.bool, device=tgt.device), 1)  # (T, T)
        tgt_mask = future.unsqueeze(0) | (tgt == 1).unsqueeze(1)  # (B, T, T)
        x = self.embeddings(tgt)
        for layer in self.transformer_layers:
            x = layer(x, memory_bank, src_pad_mask, tgt_mask)
        return self.layer_norm(x)


class NMTModel(nn.Module):
    """Encoder-decoder translation model: (src (B, S), tgt (B, T)) -> logits (B, T, tgt_vocab)."""

    pad_idx = 1

    def __init__(
        self,
        src_vocab: int = 36,
        tgt_vocab: int = 40,
        d_model: int = 24,
        heads: int = 6,
        d_ff: int = 48,
        layers: int = 2,
        share_decoder_embeddings: bool = False,
    ):
        super().__init__()
        self.encoder = TransformerEncoder(
            layers, d_model, heads, d_ff, Embeddings(src_vocab, d_model, self.pad_idx)
        )
        self.decoder = TransformerDecoder(
            layers, d_model, heads, d_ff, Embeddings(tgt_vocab, d_model, self.pad_idx)
        )
        self.generator = nn.Linear(d_model, tgt_vocab)
        if share_decoder_embeddings:
            self.generator.weight = self.decoder.embeddings.word_lut.weight

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        memory_bank, src_mask = self.encoder(src, self.pad_idx)  # (B, S, D), (B, 1, S)
        return self.generator(self.decoder(tgt, memory_bank, src_mask))  # (B, T, V)


def nmt(seed: int = 0, **kw) -> NMTModel:
    """A random NMTModel (see its arguments for the sizes)."""
    torch.manual_seed(seed)
    return randomize_(NMTModel(**kw), seed)


def nmt_inputs(
    batch: int = 2,
    src_len: int = 6,
    tgt_len: int = 5,
    src_vocab: int = 36,
    tgt_vocab: int = 40,
    seed=0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids with some padding (id 1) at the end of the second source sentence."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(2, src_vocab, (batch, src_len), generator=g)
    tgt = torch.randint(2, tgt_vocab, (batch, tgt_len), generator=g)
    src[-1, -2:] = NMTModel.pad_idx
    return src, tgt


# ----------------------------------------------------------------------------------------------
# a small CNN


def cnn(seed: int = 0, classes: int = 10) -> nn.Module:
    """Two conv -> relu -> conv pairs and a pooled classifier: (B, 3, H, W) -> (B, classes).

    Example:
        >>> cnn()(torch.randn(2, 3, 8, 8)).shape
        torch.Size([2, 10])
    """
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 8, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(8, 12, 1),
            nn.GELU(),
            nn.Conv2d(12, 8, 3, padding=1, bias=False),
        ),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, classes),
    )
    return randomize_(model, seed)


# ----------------------------------------------------------------------------------------------
# transformers models from tiny configs (imported lazily: transformers is slow to import)


def llama(
    heads: int = 8,
    kv_heads: int = 4,
    head_dim: int = 8,
    hidden: int | None = None,
    vocab: int = 100,
    layers: int = 2,
    tie: bool = True,
    seed: int = 0,
):
    """LlamaForCausalLM with grouped-query attention (heads / kv_heads query heads per KV head)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden or heads * head_dim,
        intermediate_size=88,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
        attention_bias=True,
        mlp_bias=True,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    return randomize_(LlamaForCausalLM(cfg).eval(), seed)


def gpt2(heads: int = 4, head_dim: int = 8, vocab: int = 99, layers: int = 2, seed: int = 0):
    """GPT2LMHeadModel: transformers Conv1D layers, fused q|k|v in c_attn, tied head."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=vocab,
        n_positions=64,
        n_embd=heads * head_dim,
        n_layer=layers,
        n_head=heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    return randomize_(GPT2LMHeadModel(cfg).eval(), seed)


def opt(
    heads: int = 4,
    head_dim: int = 8,
    vocab: int = 96,
    layers: int = 2,
    proj_dim: int | None = None,
    seed: int = 0,
):
    """OPTForCausalLM: q/k/v/out_proj, fc1/fc2, learned positions with an offset, tied head.
    `proj_dim` < hidden adds project_in / project_out around the decoder (as in opt-350m)."""
    from transformers import OPTConfig, OPTForCausalLM

    d = heads * head_dim
    cfg = OPTConfig(
        vocab_size=vocab,
        hidden_size=d,
        num_hidden_layers=layers,
        ffn_dim=80,
        num_attention_heads=heads,
        max_position_embeddings=64,
        word_embed_proj_dim=proj_dim or d,
        dropout=0.0,
        attention_dropout=0.0,
        pad_token_id=1,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    return randomize_(OPTForCausalLM(cfg).eval(), seed)


def bert(heads: int = 4, head_dim: int = 8, vocab: int = 90, layers: int = 2, seed: int = 0):
    """BertForMaskedLM: query/key/value, dense layers, a decoder tied to the word embeddings (its
    bias shared with cls.predictions.bias)."""
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(
        vocab_size=vocab,
        hidden_size=heads * head_dim,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=72,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    return randomize_(BertForMaskedLM(cfg).eval(), seed)


def token_ids(vocab: int, batch: int = 2, length: int = 7, seed: int = 0) -> torch.Tensor:
    """Random ids in [2, vocab): ids 0 and 1 are often pad / special."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (batch, length), generator=g)


# ----------------------------------------------------------------------------------------------
# a nanoGPT-like model whose attention stores n_head / n_kv_head and uses them in view()


class FusedAttention(nn.Module):
    """Causal attention with one fused q|k|v linear and grouped-query heads.

    `n_head` and `n_kv_head` are read in forward (split sizes and view shapes), so tensor parallelism
    only works when the planner rewrites them per rank.
    """

    def __init__(self, d: int, n_head: int, n_kv_head: int, head_dim: int):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = n_head, n_kv_head, head_dim
        self.qkv = nn.Linear(d, (n_head + 2 * n_kv_head) * head_dim)
        self.proj = nn.Linear(n_head * head_dim, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q_size, kv_size = self.n_head * self.head_dim, self.n_kv_head * self.head_dim
        q, k, v = self.qkv(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(b, t, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        k = k.view(b, t, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, K, T, hd)
        v = v.view(b, t, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, K, T, hd)
        rep = self.n_head // self.n_kv_head  # query heads per KV head
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # (B, H, T, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, hd)
        return self.proj(y.transpose(1, 2).reshape(b, t, self.n_head * self.head_dim))


class GPTBlock(nn.Module):
    def __init__(self, d: int, n_head: int, n_kv_head: int, head_dim: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = FusedAttention(d, n_head, n_kv_head, head_dim)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 3 * d), nn.GELU(), nn.Linear(3 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """(B, T) ids -> (B, T, vocab) logits; positions learned; head not tied."""

    def __init__(
        self,
        vocab: int = 99,
        d: int = 24,
        n_head: int = 6,
        n_kv_head: int = 3,
        head_dim: int = 4,
        layers: int = 2,
        max_len: int = 32,
    ):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList(GPTBlock(d, n_head, n_kv_head, head_dim) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.size(1), device=ids.device)
        x = self.wte(ids) + self.wpe(pos)  # (B, T, d)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def tiny_gpt(seed: int = 0, **kw) -> TinyGPT:
    """A random TinyGPT (see its arguments for the sizes)."""
    torch.manual_seed(seed)
    return randomize_(TinyGPT(**kw), seed)


# ----------------------------------------------------------------------------------------------
# models the planner must refuse to split (a parent reads a child's weight directly)


class DirectProj(nn.Module):
    """A block whose forward reads `self.proj.weight` itself, bypassing proj's own forward."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.fc = nn.Linear(d, 2 * d)
        self.proj = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.linear(torch.relu(self.fc(x)), self.proj.weight, self.proj.bias)


class MHABlock(nn.Module):
    """torch's nn.MultiheadAttention (its forward reads out_proj.weight) and a feed-forward."""

    def __init__(self, d: int = 16, heads: int = 4):
        super().__init__()
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x, x, x, need_weights=False)[0]
        return x + self.fc2(torch.relu(self.fc1(x)))


class Stack(nn.Module):
    """Blocks of one type in a ModuleList: (B, T, d) -> (B, T, d)."""

    def __init__(self, block: type[nn.Module], n: int = 2, **kw):
        super().__init__()
        self.layers = nn.ModuleList(block(**kw) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


# ----------------------------------------------------------------------------------------------
# checking a parallelized copy against the single-process reference (runs inside a rank)


def rel_err(got: torch.Tensor, want: torch.Tensor, scale: float | None = None) -> float:
    """max |got - want| / scale (default max |want|): one number per tensor, comparable across
    models and sizes."""
    got, want = got.detach().double(), want.detach().double()
    if got.shape != want.shape:
        return float("inf")
    scale = float(want.abs().max()) if scale is None else scale
    return float((got - want).abs().max()) / max(scale, 1e-30)


def _probe(y: torch.Tensor, seed: int = 123) -> torch.Tensor:
    """A fixed random cotangent: loss = (y * probe).sum() gives every output its own gradient."""
    g = torch.Generator().manual_seed(seed)
    # drawn in fp32 on the CPU: the same values in fp64 and on any device
    return torch.randn(y.shape, generator=g).to(device=y.device, dtype=y.dtype)


def forward_backward(model: nn.Module, run) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """`run(model)` -> (output, leaf inputs); backpropagates a probe loss; returns both."""
    y, leaves = run(model)
    (y * _probe(y)).sum().backward()
    return y.detach(), [x.grad for x in leaves]


def compare_tp(ref: nn.Module, model: nn.Module, run) -> dict[str, float]:
    """Relative errors of a parallelized `model` against its reference `ref` (same weights).

    Keys: "out", "input_grad.i", and "grad.<param name>" for every parameter, where a sharded
    parameter's local gradient is compared with the matching slice of the reference gradient
    (`ShardedModule.param_slices()`), and a replicated one with the whole reference gradient.

    Gradient errors are divided by the largest reference gradient of the same module: a key
    projection's bias has an exactly-zero true gradient (softmax ignores a constant added to every
    score), so its computed value is rounding noise of the size of the weight's gradient terms, and
    dividing noise by noise would say nothing.
    """
    from quantmesh.plan.styles import slice_dim
    from quantmesh.tp.layers import ShardedModule

    y_ref, in_ref = forward_backward(ref, run)
    y, in_got = forward_backward(model, run)
    errs = {"out": rel_err(y, y_ref)}
    for i, (a, b) in enumerate(zip(in_got, in_ref, strict=True)):
        errs[f"input_grad.{i}"] = rel_err(a, b)
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    scale: dict[str, float] = {}
    for name, p in ref_params.items():
        owner = name.rpartition(".")[0]
        if p.grad is not None:
            scale[owner] = max(scale.get(owner, 0.0), float(p.grad.abs().max()))
    mods = dict(model.named_modules())
    for name, p in model.named_parameters():
        owner, _, pname = name.rpartition(".")
        want = ref_params[name].grad
        if p.grad is None or want is None:
            errs[f"grad.{name}"] = float("inf") if (p.grad is None) != (want is None) else 0.0
            continue
        m = mods[owner]
        sl = m.param_slices().get(pname) if isinstance(m, ShardedModule) else None
        errs[f"grad.{name}"] = rel_err(p.grad, slice_dim(want, *sl) if sl else want, scale[owner])
    return errs


def split_param_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of this rank's split parameters, bytes of the parameters a ShardedModule keeps whole)
    over all ShardedModules with a split; tied parameters counted once."""
    from quantmesh.tp.layers import ShardedModule

    seen: set[int] = set()
    split = whole = 0
    for m in model.modules():
        if not isinstance(m, ShardedModule) or m.split is None:
            continue
        for pname, sl in m.param_slices().items():
            p = m._parameters[pname]
            if id(p) in seen:
                continue
            seen.add(id(p))
            if sl is None:
                whole += p.numel() * p.element_size()
            else:
                split += p.numel() * p.element_size()
    return split, whole


# ----------------------------------------------------------------------------------------------
# named cases: (reference model, run) pairs the distributed tests parallelize and compare


def _leaf_run(x: torch.Tensor):
    """run(model) for a model fed one dense tensor: the input is a fresh leaf in the model's dtype,
    so its gradient is compared too."""

    def run(m: nn.Module):
        p = next(m.parameters())
        xx = x.to(device=p.device, dtype=p.dtype).clone().requires_grad_()
        return m(xx), [xx]

    return run


def _hf_run(ids: torch.Tensor, pad_last: int = 2):
    """run(model) for a transformers model: ids plus an attention mask that pads the last
    `pad_last` positions of the second sequence; returns the logits."""
    mask = torch.ones_like(ids)
    mask[-1, -pad_last:] = 0

    def run(m: nn.Module):
        dev = next(m.parameters()).device
        return m(input_ids=ids.to(dev), attention_mask=mask.to(dev)).logits, []

    return run


def _on(m: nn.Module, *xs: torch.Tensor) -> list[torch.Tensor]:
    dev = next(m.parameters()).device
    return [x.to(dev) for x in xs]


def case(name: str) -> tuple[nn.Module, object]:
    """(reference model, run) for a named case; run(model) -> (output, leaf inputs).

    Example:
        >>> ref, run = case("mlp")
        >>> run(ref)[0].shape
        torch.Size([4, 16])
    """
    g = torch.Generator().manual_seed(7)
    if name == "mlp":
        return mlp(), _leaf_run(torch.randn(4, 16, generator=g))
    if name == "cnn":
        return cnn(), _leaf_run(torch.randn(2, 3, 8, 8, generator=g))
    if name in ("nmt", "nmt_tied"):
        ref = nmt(share_decoder_embeddings=name == "nmt_tied")
        src, tgt = nmt_inputs()
        return ref, lambda m: (m(*_on(m, src, tgt)), [])
    if name == "tiny_gpt":
        ids = token_ids(99)
        return tiny_gpt(), lambda m: (m(*_on(m, ids)), [])
    builders = {
        "llama": lambda: llama(heads=8, kv_heads=4),  # GQA, 2 query heads per KV head
        "llama_9h_3kv": lambda: llama(heads=9, kv_heads=3),  # tp=2: 2+1 groups; tp=4: none
        "llama_12h_6kv": lambda: llama(heads=12, kv_heads=6, head_dim=4),  # tp=4: 2+2+1+1
        "gpt2": lambda: gpt2(heads=4),
        "gpt2_6h": lambda: gpt2(heads=6),  # tp=4: 2+2+1+1 heads in every c_attn segment
        "opt": lambda: opt(),
        "opt_proj": lambda: opt(proj_dim=16),  # project_in / project_out around the decoder
        "bert": lambda: bert(),
    }
    ref = builders[name]()
    return ref, _hf_run(token_ids(ref.config.vocab_size))


@torch.no_grad()
def fill_from(model: nn.Module, sd: dict[str, torch.Tensor]) -> None:
    """Load a full state dict into a parallelized skeleton: each ShardedModule takes its slices
    (`param_slices()` + `load_param`), everything else is copied whole."""
    from quantmesh.plan.styles import slice_dim
    from quantmesh.tp.layers import ShardedModule

    sharded = {n: m for n, m in model.named_modules() if isinstance(m, ShardedModule)}
    for fqn, m in sharded.items():
        for pname, sl in m.param_slices().items():
            t = sd[f"{fqn}.{pname}"]
            m.load_param(pname, slice_dim(t, *sl) if sl else t)
    for name, t in model.state_dict(keep_vars=True).items():
        if name.rpartition(".")[0] not in sharded:
            t.copy_(sd[name])


def _no_tf32(device: torch.device) -> None:
    """fp32 means fp32 on a GPU too: cuDNN convolutions default to TF32 (10-bit mantissas)."""
    if device.type == "cuda":
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False


def check_case(name: str, mesh, plan=None, floors: bool = False) -> dict:
    """Parallelize a copy of case `name` over `mesh` and report what the tests assert on.

    Returns: errs (compare_tp), keys_same (state_dict keys unchanged), sd_mismatch (keys whose
    full_state_dict tensor differs from the reference, or is missing / extra; rank 0, else None),
    split_bytes / whole_bytes (this rank's split and whole-kept bytes of the sharded modules),
    ref_split_bytes (the same parameters in the reference), replicated_grads (name -> grad of every
    parameter not split, for a cross-rank comparison), shapes ({fqn: {param: local shape}}), attrs
    (per-rank head attributes the plan rewrote), ties (groups of names sharing one parameter in
    the reference) and ties_broken (those no longer sharing one), and with `floors`, the reference's own fp32 error
    against an fp64 copy (floor_out, floor_grad).
    """
    import copy

    import torch.distributed as dist

    import quantmesh as qm
    from quantmesh.tp.layers import ShardedModule

    ref, run = case(name)
    model = copy.deepcopy(ref)
    keys = list(model.state_dict())
    qm.parallelize(model, mesh, plan=plan)
    facts: dict = {"keys_same": keys == list(model.state_dict())}
    sd = qm.full_state_dict(model)
    if dist.get_rank() == 0:
        want = ref.state_dict()
        bad = sorted(set(sd) ^ set(want))
        bad += [k for k in want if k in sd and not torch.equal(sd[k], want[k])]
        facts["sd_mismatch"] = bad
    else:
        facts["sd_mismatch"] = None
    _no_tf32(mesh.device)
    ref.to(mesh.device)  # on a GPU mesh, compare on the GPU
    if floors:
        e64 = compare_tp(copy.deepcopy(ref).double(), copy.deepcopy(ref), run)
        facts["floor_out"] = e64["out"]
        facts["floor_grad"] = max((v for k, v in e64.items() if k != "out"), default=0.0)
    facts["errs"] = compare_tp(ref, model, run)

    facts["split_bytes"], facts["whole_bytes"] = split_param_bytes(model)
    ref_mods = dict(ref.named_modules())
    seen: set[int] = set()
    facts["ref_split_bytes"] = 0
    facts["shapes"] = {}
    split_ids: set[int] = set()
    for fqn, m in model.named_modules():
        if not isinstance(m, ShardedModule):
            continue
        facts["shapes"][fqn] = {p: tuple(m._parameters[p].shape) for p in m.param_slices()}
        for pname, sl in m.param_slices().items():
            if sl is None or m.split is None:
                continue
            split_ids.add(id(m._parameters[pname]))
            rp = getattr(ref_mods[fqn], pname)
            if id(rp) not in seen:
                seen.add(id(rp))
                facts["ref_split_bytes"] += rp.numel() * rp.element_size()
    facts["replicated_grads"] = {
        n: p.grad.detach().cpu().clone()
        for n, p in model.named_parameters()
        if id(p) not in split_ids and p.grad is not None
    }
    # parameters shared in the reference (a tied embedding and head, a tied bias) must still be
    # one tensor: otherwise each copy would get part of the gradient and drift apart
    groups: dict[int, list[str]] = {}
    for n, p in ref.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(n)
    got = dict(model.named_parameters(remove_duplicate=False))
    facts["ties"] = [g for g in groups.values() if len(g) > 1]
    facts["ties_broken"] = [g for g in facts["ties"] if len({id(got[n]) for n in g}) > 1]
    from quantmesh.parallel.state import parallel_state

    res = parallel_state(model).plan
    facts["attrs"] = {
        owner: {a: operator.attrgetter(a)(model.get_submodule(owner)) for a in attrs}
        for owner, attrs in res.attr_updates.items()
    }
    return facts


def check_empty(name: str, mesh) -> dict:
    """Build case `name` under `qm.empty_model()` (meta), parallelize it, then fill it from the
    reference's state dict.

    Returns: bad_shapes (sharded parameters whose shape is not this rank's local shape, or whose
    device is not the mesh's), full_size (split parameters that nevertheless hold the full tensor),
    meta_left (parameters or buffers still on meta), n_sharded, errs (compare_tp after filling)
    and sd_mismatch (as in check_case).
    """
    import torch.distributed as dist

    import quantmesh as qm
    from quantmesh.tp.layers import ShardedModule

    ref, run = case(name)
    with qm.empty_model():
        skel, _ = case(name)
    full = {n: tuple(t.shape) for n, t in ref.state_dict().items()}
    qm.parallelize(skel, mesh)
    facts: dict = {"bad_shapes": [], "full_size": [], "n_sharded": 0}
    for fqn, m in skel.named_modules():
        if not isinstance(m, ShardedModule):
            continue
        facts["n_sharded"] += 1
        for pname, sl in m.param_slices().items():
            p = m._parameters[pname]
            if tuple(p.shape) != m.local_shape(pname) or p.device != mesh.device:
                facts["bad_shapes"].append((f"{fqn}.{pname}", tuple(p.shape), str(p.device)))
            if sl is not None and tuple(p.shape) == full[f"{fqn}.{pname}"]:
                facts["full_size"].append(f"{fqn}.{pname}")
    facts["meta_left"] = [
        n for n, t in [*skel.named_parameters(), *skel.named_buffers()] if t.device.type == "meta"
    ]
    fill_from(skel, ref.state_dict())
    sd = qm.full_state_dict(skel)
    if dist.get_rank() == 0:
        want = ref.state_dict()
        bad = sorted(set(sd) ^ set(want))
        facts["sd_mismatch"] = bad + [
            k for k in want if k in sd and not torch.equal(sd[k], want[k])
        ]
    else:
        facts["sd_mismatch"] = None
    _no_tf32(mesh.device)
    facts["errs"] = compare_tp(ref.to(mesh.device), skel, run)
    return facts


def check_dropout(mesh, lora: bool = False) -> dict:
    """Train-mode NMTModel with dropout 0.1 everywhere (and LoRA dropout 0.1 with `lora`): one
    forward / backward after the same torch.manual_seed on every rank.

    Returns: replicated_grads (name -> grad of every parameter not split over tp: norms, rowwise
    biases, LoRA A of colwise and B of rowwise layers), and dropout_active (the train-mode logits
    differ from the eval-mode ones, so masks were drawn).
    """
    import copy

    import quantmesh as qm
    from quantmesh.tp.gather import tp_sharded
    from quantmesh.tp.layers import ShardedModule

    ref = nmt()
    for m in ref.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.1
    model = copy.deepcopy(ref)
    cfg = None
    if lora:
        names = ["linear_query", "linear_values", "final_linear", "w_1", "w_2"]
        cfg = qm.LoraConfig(r=4, alpha=8, dropout=0.1, targets=names)
    qm.parallelize(model, mesh, lora=cfg)
    if lora:  # B starts at zero: give it values, so that A gets a gradient
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))))
    src, tgt = nmt_inputs()
    with torch.no_grad():
        y_eval = model.eval()(*_on(model, src, tgt))
    model.train()
    torch.manual_seed(1234)
    y = model(*_on(model, src, tgt))
    (y * _probe(y)).sum().backward()
    split: set[int] = set()
    for m in model.modules():
        if isinstance(m, ShardedModule):
            split |= {id(m.get_parameter(n)) for n in tp_sharded(m)}
    return {
        "replicated_grads": {
            n: p.grad.detach().cpu().clone()
            for n, p in model.named_parameters()
            if id(p) not in split and p.grad is not None
        },
        "dropout_active": not torch.equal(y.detach(), y_eval),
    }
