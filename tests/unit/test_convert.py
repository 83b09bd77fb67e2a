"""Converted checkpoint keys (io/convert.py): per-expert MoE folders saved by transformers load into
the fused experts, bitwise like transformers' own from_pretrained; a slice of a fused tensor reads
only the rows of the stored tensors it holds (bytes counted); every rearrangement op matches
transformers' op on random multi-segment slices; what cannot be streamed is refused up front.
"""

from __future__ import annotations

import random

import pytest
import torch

import quantmesh as qm
from quantmesh.io import reader as reader_mod
from quantmesh.io.convert import Piece
from quantmesh.io.hf import hf_key_map
from quantmesh.io.load import LoadError
from quantmesh.io.reader import open_checkpoint
from tests.moe_folders import ARCHS, PER_EXPERT, expert_keys, moe_dir


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {name: moe_dir(name, root / name) for name in ARCHS}


def _skeleton(folder):
    from transformers import AutoConfig, AutoModelForCausalLM

    with qm.empty_model():
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))


def _reference(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder)


@pytest.mark.parametrize("name", list(ARCHS))
def test_transformers_folder_loads_bitwise_like_transformers(folders, name):
    folder = folders[name]
    stored = expert_keys(folder)
    if name in PER_EXPERT:  # the folder really holds one tensor per expert: the path under test
        assert len(stored) >= 4 * 3
    else:  # gpt-oss: no conversion rule, stored fused (E, H, 2I) with biases: loads as before
        assert stored == []
    model = _skeleton(folder)
    result = qm.load_checkpoint(model, folder, key_map=hf_key_map(model), progress=False)
    assert result.missing_keys == [] and result.unexpected_keys == []
    got, want = model.state_dict(), _reference(folder).state_dict()
    assert got.keys() == want.keys()
    fused = [k for k in want if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert len(fused) >= 2
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


class _Counted:
    """Wraps the safetensors shard reads: which stored keys were read, and how many bytes."""

    def __init__(self, monkeypatch):
        self.keys: list[str] = []
        self.bytes = self.largest = 0
        block = reader_mod._SafetensorsShard.block

        def counted(shard, key, index):
            t = block(shard, key, index)
            self.keys.append(key)
            self.bytes += t.numel() * t.element_size()
            self.largest = max(self.largest, t.numel() * t.element_size())
            return t

        monkeypatch.setattr(reader_mod._SafetensorsShard, "block", counted)

    def reset(self):
        self.keys, self.bytes, self.largest = [], 0, 0


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_a_slice_of_the_fused_experts_reads_only_its_rows(folders, name, monkeypatch):
    folder = folders[name]
    ref = _reference(folder).state_dict()
    gate_up = ref["model.layers.1.mlp.experts.gate_up_proj"]  # (E, 2I, H)
    down = ref["model.layers.1.mlp.experts.down_proj"]  # (E, H, I)
    E, I2, H = gate_up.shape
    inter = I2 // 2
    count = _Counted(monkeypatch)
    chunk = 4 * H * 4  # 4 rows of a stored expert tensor per read step: pieces stream in chunks
    with open_checkpoint(folder, key_map=hf_key_map(_skeleton(folder)), chunk_bytes=chunk) as ckpt:
        assert len(ckpt.sources("model.layers.1.mlp.experts.gate_up_proj")) == 2 * E
        cases = [
            # a tp rank of the intermediate dim: rows [a, b) of the gate half and of the up half
            ("gate_up_proj", gate_up, 1, ((3, 9), (inter + 3, inter + 9)), E * 2 * 6 * H),
            # expert parallelism: experts 1 and 2 only
            ("gate_up_proj", gate_up, 0, ((1, 3),), 2 * I2 * H),
            # down's input columns, two segments, out of order
            ("down_proj", down, 2, ((10, 14), (1, 3)), E * H * 6),
            ("down_proj", down, 1, ((0, 5),), E * 5 * inter),
        ]
        for proj, full, dim, ranges, nbytes in cases:
            count.reset()
            got = ckpt.read(f"model.layers.1.mlp.experts.{proj}", dim, ranges)
            want = torch.cat([full.narrow(dim, a, b - a) for a, b in ranges], dim)
            assert torch.equal(got, want), (proj, dim, ranges)
            assert count.bytes == nbytes * full.element_size(), (proj, dim, ranges)
            assert count.largest <= chunk
            assert all(".layers.1." in k for k in count.keys)
            if dim == 0:  # only the experts asked for
                assert {k.split(".experts.")[1].split(".")[0] for k in count.keys} == {"1", "2"}
        count.reset()  # whole: every piece's bytes once, in chunks
        assert torch.equal(ckpt.read("model.layers.1.mlp.experts.gate_up_proj"), gate_up)
        assert count.bytes == gate_up.numel() * 4 and len(set(count.keys)) == 2 * E
        assert count.largest <= chunk


def _transformers_convert(converter, stored: dict[str, torch.Tensor], target: str):
    """transformers' own conversion of the stored tensors (the reference)."""
    for k in sorted(stored, key=lambda k: [int(p) if p.isdigit() else p for p in k.split(".")]):
        _, pattern = converter.rename_source_key(k)
        converter.add_tensor(target, k, pattern, stored[k])
    return converter.convert(target)


def _random_ranges(rng: random.Random, n: int) -> tuple[tuple[int, int], ...]:
    cuts = sorted(rng.sample(range(n + 1), min(n + 1, rng.choice([2, 4, 6]))))
    pairs = [(a, b) for a, b in zip(cuts[::2], cuts[1::2], strict=False) if a < b] or [(0, n)]
    rng.shuffle(pairs)
    return tuple(pairs)


def _rules():
    from transformers.core_model_loading import (
        Chunk,
        Concatenate,
        Interleave,
        MergeModulelist,
        Transpose,
        WeightConverter,
    )

    g = torch.Generator().manual_seed(0)

    def experts(name, shape, n=3):
        return {f"l.experts.{e}.{name}.weight": torch.randn(shape, generator=g) for e in range(n)}

    return [
        (WeightConverter(["experts.*.gate.weight", "experts.*.up.weight"], "experts.gate_up",
                         [MergeModulelist(dim=0), Concatenate(dim=1)]),
         {**experts("gate", (6, 5)), **experts("up", (6, 5))}, "l.experts.gate_up"),
        (WeightConverter("experts.*.down.weight", "experts.down", [MergeModulelist(dim=0)]),
         experts("down", (5, 6), n=11), "l.experts.down"),
        (WeightConverter("attn.qkv", ["attn.q", "attn.k", "attn.v"], [Chunk(dim=0)]),
         {"l.attn.qkv": torch.randn(12, 7, generator=g)}, "l.attn.q"),
        (WeightConverter("w13", ["gate", "up"], [Interleave(dim=1), Chunk(dim=1)]),
         {"l.w13": torch.randn(3, 10, 4, generator=g)}, "l.gate"),
        (WeightConverter("experts.w13", "experts.gate_up", [Interleave(dim=1)]),
         {"l.experts.w13": torch.randn(3, 8, 5, generator=g)}, "l.experts.gate_up"),
        (WeightConverter("experts.gu", "experts.gate_up", [Interleave(dim=2, inverse=True)]),
         {"l.experts.gu": torch.randn(3, 4, 8, generator=g)}, "l.experts.gate_up"),
        (WeightConverter("experts.down_t", "experts.down", [Transpose(1, 2)]),
         {"l.experts.down_t": torch.randn(3, 4, 9, generator=g)}, "l.experts.down"),
        (WeightConverter(["a.weight", "b.weight"], "ab.weight", [Concatenate(dim=0)]),
         {"l.a.weight": torch.randn(3, 4, generator=g), "l.b.weight": torch.randn(5, 4, generator=g)},
         "l.ab.weight"),
    ]  # fmt: skip


def test_every_rearrangement_matches_transformers_on_random_slices():
    import copy

    rng = random.Random(0)
    for converter, stored, target in _rules():
        want = _transformers_convert(copy.deepcopy(converter), stored, target)

        def key_map(k, c=converter):
            renamed, pattern = c.rename_source_key(k)
            return Piece(renamed, pattern, k, c) if pattern is not None else k

        with open_checkpoint(stored, key_map=key_map) as ckpt:
            assert sorted(ckpt.keys()) == sorted(want), converter
            for key, full in want.items():
                assert ckpt.shape(key) == tuple(full.shape)
                assert torch.equal(ckpt.read(key), full), (converter, key)
                for _ in range(12):
                    dim = rng.randrange(full.dim())
                    ranges = _random_ranges(rng, full.shape[dim])
                    got = ckpt.read(key, dim, ranges, dtype=torch.float64)
                    ref = torch.cat([full.narrow(dim, a, b - a) for a, b in ranges], dim)
                    assert torch.equal(got, ref.double()), (converter, key, dim, ranges)


def test_an_op_that_is_no_rearrangement_is_refused_before_anything_is_read(folders, monkeypatch):
    from transformers.core_model_loading import MergeModulelist, PermuteForRope, WeightConverter

    from quantmesh.io import hf

    rule = WeightConverter("mlp.experts.*.down_proj.weight", "mlp.experts.down_proj",
                           [MergeModulelist(dim=0), PermuteForRope()])  # fmt: skip
    monkeypatch.setattr(hf, "_transformers_renames", lambda model: ([], [rule]))
    count = _Counted(monkeypatch)
    model = _skeleton(folders["qwen3_moe"])
    with pytest.raises(NotImplementedError) as e:
        qm.load_checkpoint(model, folders["qwen3_moe"], key_map=hf.hf_key_map(model))
    msg = str(e.value)
    assert "PermuteForRope" in msg and "experts.0.down_proj.weight" in msg
    assert "safetensors.torch.save_file" in msg  # the fix
    assert count.bytes == 0
    assert all(p.device.type == "meta" for p in model.parameters())


@pytest.mark.parametrize(
    "name, gone, target",
    [("olmoe", "model.layers.1.mlp.experts.2.up_proj.weight",
      "model.layers.1.mlp.experts.gate_up_proj"),
     # the last expert, under Mixtral's stored names (renamed block_sparse_moe -> mlp on load)
     ("mixtral", "model.layers.0.block_sparse_moe.experts.3.w3.weight",
      "model.layers.0.mlp.experts.gate_up_proj")],
)  # fmt: skip
def test_a_missing_expert_is_named_and_always_an_error(folders, tmp_path, name, gone, target):
    from safetensors.torch import load_file, save_file

    src = folders[name]
    tensors = load_file(str(src / "model.safetensors"))
    del tensors[gone]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    for strict in (True, False):
        model = _skeleton(tmp_path)
        with pytest.raises(LoadError) as e:
            qm.load_checkpoint(model, tmp_path, key_map=hf_key_map(model), strict=strict)
        msg = str(e.value)
        assert "not assembled from their stored pieces (1)" in msg
        assert f"{target}: stacked from one stored tensor per expert" in msg
        assert f"1 are absent: {gone}\n" in msg
        assert "\n  missing (" not in msg  # not listed twice
        assert all(p.device.type == "meta" for p in model.parameters())


def test_transpose_with_check_dims_follows_the_model_shape():
    from transformers.core_model_loading import Transpose, WeightConverter

    rule = WeightConverter("experts.down", "experts.down", [Transpose(1, 2, check_dims=True)])
    stored = {"l.experts.down": torch.randn(3, 4, 9, generator=torch.Generator().manual_seed(0))}
    for model_shape, want in (((3, 4, 9), stored["l.experts.down"]),
                              ((3, 9, 4), stored["l.experts.down"].transpose(1, 2))):  # fmt: skip
        shapes = {"l.experts.down": model_shape}

        def key_map(k, shapes=shapes):
            renamed, pattern = rule.rename_source_key(k)
            return Piece(renamed, pattern, k, rule, None, shapes)

        with open_checkpoint(stored, key_map=key_map) as ckpt:
            assert ckpt.shape("l.experts.down") == model_shape
            assert torch.equal(ckpt.read("l.experts.down", 1, ((1, 3),)), want[:, 1:3])
