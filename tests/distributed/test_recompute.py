"""Activation checkpointing (qm.checkpoint_blocks) and the chunked loss change memory, never values.

One launch of 4 ranks (dp=2 x tp=2, so every case runs at tp=2 and under DDP): a tiny Llama with
attention and LoRA dropout, LoRA on every projection, fp32 and nf4. For each, one step's loss and
every LoRA gradient (gathered over tp) with checkpointing, with checkpointing + offload, and with
the chunked loss, with the MLP run in token tiles (`tile_tokens`), and with one of the two
blocks checkpointed (`blocks=1`), against the plain step from
the same seed. Dropout masks must replay exactly in
the recompute (the tp RNG regions derive from the state torch restores), so the gradients agree to
rounding; the chunked loss only sums in another order. Compiled blocks are not combined here (a
CPU compile per variant would dominate the suite); see docs/design.md.
"""

from __future__ import annotations

import pytest
import torch

from quantmesh.testing import run_ranks
from tests.distributed._lora_cases import TARGETS, VOCAB, whole_lora

pytestmark = pytest.mark.slow  # one launch of 4 ranks: left out by make test-fast

SEQ, MB = 16, 2


def _model(quant, dropout=0.1):
    from transformers import LlamaConfig, LlamaForCausalLM

    import quantmesh as qm

    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        attention_dropout=0.1,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).float()
    mesh = qm.init_mesh(tp=2, dp=2) if not hasattr(_model, "mesh") else _model.mesh
    _model.mesh = mesh
    lora = qm.LoraConfig(r=4, dropout=dropout, targets=TARGETS)
    qm.parallelize(model, mesh, quant=quant, lora=lora)
    with torch.no_grad():  # B nonzero, so every adapter gradient is nonzero
        for n, p in model.named_parameters():
            if n.endswith("lora_B.weight"):
                p.copy_(0.01 * torch.ones_like(p))
    return model, mesh


def _step(
    quant, *, ckpt=False, offload=False, chunk=0, tile=None, dropout=0.1, blocks=None
) -> dict:
    import quantmesh as qm
    from quantmesh.train.loop import loss_sum

    model, mesh = _model(quant, dropout)
    if ckpt:
        got = qm.checkpoint_blocks(model, offload=offload, tile_tokens=tile, blocks=blocks)
        assert got == (blocks or 2)
    model.train()
    g = torch.Generator().manual_seed(7 + mesh.dp_rank)
    ids = torch.randint(0, VOCAB, (MB, SEQ), generator=g)
    torch.manual_seed(11)  # the same dropout draws for every variant
    total, n = loss_sum(model, {"input_ids": ids, "labels": ids}, chunk)
    (total / n).backward()
    tiled = [b.__dict__.get("_quantmesh_tiled") for b in model.model.layers]
    from quantmesh.blocks.recompute import is_checkpointed

    recomputed = [is_checkpointed(b) for b in model.model.layers]
    return {
        "loss": float(total),
        "grads": whole_lora(model),
        "rng": torch.get_rng_state(),
        "tiled": tiled,
        "recomputed": recomputed,
    }


def _rank(rank: int) -> dict:
    out = {}
    for quant in (None, "nf4"):
        plain = {0.1: _step(quant), 0.0: _step(quant, dropout=0.0)}
        for name, kw in {
            "ckpt": {"ckpt": True},
            "offload": {"ckpt": True, "offload": True},
            "chunked": {"chunk": 5},
            "ckpt_chunked": {"ckpt": True, "chunk": 7},
            # 16 tokens: tiles of 5, 5, 5 and 1; LoRA dropout in the MLP: kept whole (its masks
            # would change), without it: tiled
            "tiled": {"ckpt": True, "tile": 5},
            "tiled_no_dropout": {"ckpt": True, "tile": 5, "dropout": 0.0},
            # one of the two blocks recomputed (the first: never the last), the other keeps all
            "partial": {"ckpt": True, "blocks": 1, "offload": True},
        }.items():
            got = _step(quant, **kw)
            base = plain[kw.get("dropout", 0.1)]
            err = max(
                ((got["grads"][k] - v).abs().max() / v.abs().max()).item()
                for k, v in base["grads"].items()
            )
            out[(quant, name)] = {
                "loss_err": abs(got["loss"] - base["loss"]) / abs(base["loss"]),
                "grad_err": err,
                "rng_same": torch.equal(got["rng"], base["rng"]),
                "rng": hash(got["rng"].numpy().tobytes()),
                "tiled": got["tiled"],
                "recomputed": got["recomputed"],
            }
    return out


@pytest.fixture(scope="module")
def facts() -> list[dict]:
    return run_ranks(_rank, 4, timeout=600)


@pytest.mark.parametrize("quant", [None, "nf4"])
@pytest.mark.parametrize(
    "variant",
    ["ckpt", "offload", "chunked", "ckpt_chunked", "tiled", "tiled_no_dropout", "partial"],
)
def test_same_loss_and_gradients(facts: list[dict], quant, variant: str) -> None:
    for rank, f in enumerate(facts):
        got = f[(quant, variant)]
        assert got["loss_err"] < 1e-6, (rank, got)
        assert got["grad_err"] < 1e-5, (rank, got)
        # the head's tp RNG region is entered once per loss chunk: the chunked loss moves the
        # shared stream on by a draw per chunk, the same on every rank of the tp group
        if "chunk" not in variant:
            assert got["rng_same"], (rank, "the random streams ended elsewhere")
        if variant == "tiled":  # LoRA dropout in the MLP: not tiled (other masks), with a warning
            assert got["tiled"] == [[], []], got["tiled"]
        if variant == "partial":
            assert got["recomputed"] == [True, False], got["recomputed"]
        if variant == "tiled_no_dropout":  # proven position-wise and tiled in every block
            assert got["tiled"] == [["mlp"], ["mlp"]], got["tiled"]
    for a, b in ((0, 1), (2, 3)):  # the tp groups of a dp=2 x tp=2 mesh
        assert facts[a][(quant, variant)]["rng"] == facts[b][(quant, variant)]["rng"]
