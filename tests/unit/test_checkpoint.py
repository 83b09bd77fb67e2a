"""The checkpoint reader: every source kind gives the same tensors and slices as indexing the full
tensor; casts, key maps and each error message.

All comparisons are exact (torch.equal): reading copies bytes and casts with the same kernel as
`Tensor.to`, so there is no tolerance to justify.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from quantmesh.io.reader import CheckpointKeyError, open_checkpoint

TINY_CHUNK = 16  # bytes: smaller than any row, so every read walks one row per chunk


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "blk.qkv.weight": torch.randn(12, 10, generator=g),  # fused q|k|v, 4 rows each
        "blk.qkv.bias": torch.randn(12, generator=g),
        "blk.out.weight": torch.randn(10, 12, generator=g).to(torch.bfloat16),
        "conv.weight": torch.randn(6, 4, 5, generator=g),
        "scale": torch.tensor(0.5),
        "ids": torch.arange(15, dtype=torch.int64).view(5, 3),
    }


def _write(kind: str, root: Path, ts: dict[str, torch.Tensor]) -> str | dict:
    """Write `ts` as a checkpoint of `kind` under root; return what open_checkpoint takes."""
    names = sorted(ts)
    half = [dict((k, ts[k]) for k in names[:3]), dict((k, ts[k]) for k in names[3:])]
    if kind == "dict":
        return ts
    if kind == "st_file":
        save_file(ts, root / "w.safetensors")
        return str(root / "w.safetensors")
    if kind == "st_folder":
        save_file(ts, root / "model.safetensors")
        return str(root)
    if kind in ("st_index", "bin_index"):
        ext, save = (
            ("safetensors", save_file)
            if kind == "st_index"
            else ("bin", lambda t, p: torch.save(t, p))
        )
        stem = "model" if kind == "st_index" else "pytorch_model"
        weight_map = {}
        for i, part in enumerate(half):
            name = f"{stem}-{i + 1:05d}-of-00002.{ext}"
            save(part, root / name)
            weight_map.update(dict.fromkeys(part, name))
        (root / f"{stem}.{ext}.index.json").write_text(json.dumps({"weight_map": weight_map}))
        return str(root)
    if kind == "st_many":  # several *.safetensors files, no index
        save_file(half[0], root / "a.safetensors")
        save_file(half[1], root / "b.safetensors")
        return str(root)
    if kind == "bin_folder":
        torch.save(ts, root / "pytorch_model.bin")
        return str(root)
    if kind == "pt_file":
        torch.save({"state_dict": ts, "step": 3}, root / "ckpt.pt")  # nested, as trainers write
        return str(root / "ckpt.pt")
    raise AssertionError(kind)


KINDS = [
    "dict",
    "st_file",
    "st_folder",
    "st_index",
    "st_many",
    "bin_folder",
    "bin_index",
    "pt_file",
]


@pytest.mark.parametrize("chunk_bytes", [TINY_CHUNK, 64 << 20])
@pytest.mark.parametrize("kind", KINDS)
def test_every_source_reads_whole_tensors_and_slices(kind, chunk_bytes, tmp_path) -> None:
    ts = _tensors()
    with open_checkpoint(_write(kind, tmp_path, ts), chunk_bytes=chunk_bytes) as ckpt:
        assert sorted(ckpt.keys()) == sorted(ts)
        for k, t in ts.items():
            assert ckpt.shape(k) == tuple(t.shape)
            assert ckpt.dtype(k) == t.dtype
            assert ckpt.nbytes(k) == t.numel() * t.element_size()
            got = ckpt.read(k)
            assert got.dtype == t.dtype and torch.equal(got, t), k
        # tp rank 1 of 2 of a fused q|k|v: the second half of each 4-row segment, concatenated
        w = ts["blk.qkv.weight"]
        qkv = ((2, 4), (6, 8), (10, 12))
        assert torch.equal(
            ckpt.read("blk.qkv.weight", 0, qkv), torch.cat([w[2:4], w[6:8], w[10:12]])
        )
        assert torch.equal(
            ckpt.read("blk.qkv.bias", 0, qkv), ts["blk.qkv.bias"][[2, 3, 6, 7, 10, 11]]
        )
        # rowwise: input-feature (dim 1) slices, several ranges, out of order too
        o = ts["blk.out.weight"]
        got = ckpt.read("blk.out.weight", 1, ((6, 12), (0, 3)))
        assert torch.equal(got, torch.cat([o[:, 6:12], o[:, 0:3]], dim=1))
        # dim 2 of a 3-d tensor, negative dim, a bare (start, stop) pair, dim with ranges=None
        c = ts["conv.weight"]
        assert torch.equal(ckpt.read("conv.weight", 2, ((1, 2), (3, 5))), c[:, :, [1, 3, 4]])
        assert torch.equal(ckpt.read("conv.weight", -1, (1, 4)), c[:, :, 1:4])
        assert torch.equal(ckpt.read("conv.weight", 1), c)
        # an empty range is legal (an uneven split can leave a rank nothing)
        assert ckpt.read("ids", 0, ((2, 2),)).shape == (0, 3)


@pytest.mark.parametrize("kind", ["dict", "st_index", "bin_folder"])
def test_cast_happens_per_chunk_and_matches_tensor_to(kind, tmp_path) -> None:
    ts = _tensors()
    ckpt = open_checkpoint(_write(kind, tmp_path, ts), chunk_bytes=TINY_CHUNK)
    w = ts["blk.qkv.weight"]
    got = ckpt.read("blk.qkv.weight", 1, ((0, 5), (7, 10)), dtype=torch.bfloat16)
    ref = torch.cat([w[:, 0:5], w[:, 7:10]], dim=1).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, ref)
    up = ckpt.read("blk.out.weight", 0, ((0, 5),), dtype="float32")
    assert up.dtype == torch.float32 and torch.equal(up, ts["blk.out.weight"][:5].float())
    assert torch.equal(ckpt.read("scale", dtype=torch.float16), ts["scale"].half())


def test_file_reads_are_owned_copies_not_views_of_the_file(tmp_path) -> None:
    # safetensors >= 0.8 returns views into its mapping of the file; read() must not leak them
    # (a view pins the whole file mapping and a write into it would be a copy-on-write surprise).
    ts = _tensors()
    src = _write("st_file", tmp_path, ts)
    with open_checkpoint(src) as ckpt:
        got = ckpt.read("blk.qkv.weight", 0, ((0, 4),))
    assert got.is_contiguous() and got.untyped_storage().nbytes() == got.nbytes
    got.zero_()
    assert torch.equal(open_checkpoint(src).read("blk.qkv.weight"), ts["blk.qkv.weight"])


def test_dict_source_returns_a_view_only_when_nothing_changes() -> None:
    ts = _tensors()
    ckpt = open_checkpoint(ts)
    w = ts["blk.qkv.weight"]
    view = ckpt.read("blk.qkv.weight", 0, ((4, 8),))
    assert view.data_ptr() == w[4].data_ptr()  # shares w's storage
    cast = ckpt.read("blk.qkv.weight", 0, ((4, 8),), dtype=torch.float64)
    fused = ckpt.read("blk.qkv.weight", 0, ((0, 1), (4, 5)))
    cast.zero_()
    fused.zero_()
    assert torch.equal(w, _tensors()["blk.qkv.weight"])  # copies: the source is untouched


def test_key_map_dict_and_callable(tmp_path) -> None:
    ts = _tensors()
    src = _write("st_index", tmp_path, ts)
    ckpt = open_checkpoint(src, key_map={"blk.qkv.weight": "attn.qkv.weight", "scale": None})
    assert "attn.qkv.weight" in ckpt and "blk.qkv.weight" not in ckpt and "scale" not in ckpt
    assert "ids" in ckpt  # keys absent from the dict keep their name
    assert torch.equal(ckpt.read("attn.qkv.weight", 0, ((0, 2),)), ts["blk.qkv.weight"][:2])

    def strip(k: str) -> str | None:
        return None if k == "ids" else k.removeprefix("blk.")

    ckpt = open_checkpoint(src, key_map=strip)
    assert sorted(ckpt.keys()) == ["conv.weight", "out.weight", "qkv.bias", "qkv.weight", "scale"]
    assert torch.equal(ckpt.read("out.weight", 1, ((0, 4),)), ts["blk.out.weight"][:, :4])


def test_error_missing_path(tmp_path) -> None:
    with pytest.raises(
        FileNotFoundError, match=r"no checkpoint at .*nope: expected a \.safetensors"
    ):
        open_checkpoint(tmp_path / "nope")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(FileNotFoundError, match=r"folder with model\.safetensors.*notes\.txt"):
        open_checkpoint(tmp_path)
    with pytest.raises(ValueError, match=r"unsupported checkpoint file .*notes\.txt.*'\.txt'"):
        open_checkpoint(tmp_path / "notes.txt")


def test_error_unknown_key_lists_close_matches(tmp_path) -> None:
    ckpt = open_checkpoint(_write("st_file", tmp_path, _tensors()))
    with pytest.raises(CheckpointKeyError) as e:
        ckpt.read("blk.qkv.weigth")
    assert isinstance(e.value, KeyError)
    msg = str(e.value)
    assert msg.startswith("'blk.qkv.weigth' is not a key of the checkpoint")
    assert "close matches: ['blk.qkv.weight'" in msg and "key_map=" in msg
    renamed = open_checkpoint(_tensors(), key_map={"scale": "norm.scale", "ids": None})
    with pytest.raises(KeyError, match=r"key_map renames this checkpoint key to 'norm.scale'"):
        renamed.shape("scale")
    with pytest.raises(KeyError, match=r"key_map drops this checkpoint key"):
        renamed.read("ids")


def test_error_ranges_out_of_bounds_and_bad_requests() -> None:
    ckpt = open_checkpoint(_tensors())
    with pytest.raises(
        ValueError,
        match=r"range \(8, 13\) .* along dim 0 is out of bounds for 'blk.qkv.weight' of shape "
        r"\(12, 10\): expected 0 <= start <= stop <= 12",
    ):
        ckpt.read("blk.qkv.weight", 0, ((0, 4), (8, 13)))
    with pytest.raises(ValueError, match=r"range \(5, 3\)"):
        ckpt.read("blk.qkv.weight", 1, ((5, 3),))
    with pytest.raises(
        ValueError, match=r"dim=2 is out of range for 'blk.qkv.bias' of shape \(12,\)"
    ):
        ckpt.read("blk.qkv.bias", 2, ((0, 1),))
    with pytest.raises(ValueError, match=r"given with dim=None for 'ids': pass the dim"):
        ckpt.read("ids", None, ((0, 1),))
    with pytest.raises(ValueError, match=r"not a tuple of \(start, stop\) pairs"):
        ckpt.read("ids", 0, ((0, 1, 2),))
    with pytest.raises(ValueError, match=r"dtype='bf16' is not a torch dtype"):
        ckpt.read("ids", dtype="bf16")


def test_error_broken_folders(tmp_path) -> None:
    ts = _tensors()
    _write("st_index", tmp_path, ts)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(
        FileNotFoundError, match=r"shard model-00002-of-00002.safetensors listed in"
    ):
        open_checkpoint(tmp_path)
    dup = tmp_path / "dup"
    dup.mkdir()
    save_file({"x": torch.zeros(1)}, dup / "a.safetensors")
    save_file({"x": torch.ones(1)}, dup / "b.safetensors")
    with pytest.raises(ValueError, match=r"key 'x' is in both a.safetensors and b.safetensors"):
        open_checkpoint(dup)
    with pytest.raises(ValueError, match=r"key_map maps both 'scale' and 'ids' to 'same'"):
        open_checkpoint(ts, key_map={"ids": "same", "scale": "same"})
    with pytest.raises(TypeError, match=r"values must be tensors; not so for keys \['n'\]"):
        open_checkpoint({"n": 3})
    ckpt = open_checkpoint(ts)
    ckpt.close()
    with pytest.raises(ValueError, match=r"reader of <dict of 6 tensors> is closed"):
        ckpt.read("ids")


def test_torch_legacy_format_warns_and_still_reads(tmp_path) -> None:
    ts = _tensors()
    torch.save(ts, tmp_path / "old.bin", _use_new_zipfile_serialization=False)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got = open_checkpoint(tmp_path / "old.bin").read("ids", 1, ((1, 3),))
    assert torch.equal(got, ts["ids"][:, 1:3])
    assert any("legacy serialization, which cannot be memory-mapped" in str(x.message) for x in w)


def test_torch_file_without_tensors_is_rejected(tmp_path) -> None:
    torch.save({"step": 3}, tmp_path / "meta.pt")
    with pytest.raises(ValueError, match=r"holds no tensors by name \(found \['step'\]\)"):
        open_checkpoint(tmp_path / "meta.pt")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_read_to_cuda_in_chunks(tmp_path) -> None:
    ts = _tensors()
    ckpt = open_checkpoint(_write("st_file", tmp_path, ts), chunk_bytes=TINY_CHUNK)
    got = ckpt.read("blk.out.weight", 1, ((6, 12), (0, 3)), dtype=torch.float16, device="cuda")
    o = ts["blk.out.weight"]
    assert got.is_cuda
    assert torch.equal(got.cpu(), torch.cat([o[:, 6:12], o[:, 0:3]], dim=1).half())
