"""`quantmesh generate` and `quantmesh finetune` take a folder saved quantized by transformers +
bitsandbytes (nf4) as it is, at tp=2; a --quant that contradicts the folder, and a GPTQ folder,
are refused in the launching process with the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .test_cli_common import cli, make_tiny_llama, refused

pytestmark = pytest.mark.slow  # make test-fast leaves this module out


def _nf4_folder(tmp_path: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    src = make_tiny_llama(tmp_path / "tiny")
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                           bnb_4bit_compute_dtype=torch.float32)  # fmt: skip
    out = tmp_path / "tiny-nf4"
    AutoModelForCausalLM.from_pretrained(
        src, quantization_config=q, device_map="cpu"
    ).save_pretrained(out)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    return out


def test_generate_and_finetune_take_a_prequantized_folder(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    model = _nf4_folder(tmp_path)
    gen = cli("generate", str(model), "--tp", "2", "--prompt", "whether tis nobler",
              "--max-new-tokens", "8")  # fmt: skip
    assert gen.returncode == 0, gen.stderr[-3000:]
    assert gen.stdout.strip()
    data = tmp_path / "data.txt"
    data.write_text("To be, or not to be, that is the question.\n" * 20)
    ft = cli("finetune", "--model", str(model), "--data", str(data), "--nproc", "2", "--tp", "2",
             "--seq-len", "16", "--steps", "2", "--output-dir", str(tmp_path / "out"))  # fmt: skip
    assert ft.returncode == 0, ft.stderr[-3000:]
    rows = [json.loads(ln) for ln in (tmp_path / "out/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert (tmp_path / "out/adapter/adapter_model.safetensors").is_file()

    # the refusals come from the launching process: main() here, a tripwire on the launch
    wrong = refused(
        ["generate", str(model), "--quant", "int8", "--prompt", "hi"], capsys, monkeypatch
    )
    assert "is stored as bitsandbytes nf4, but quant= asks for bitsandbytes int8" in wrong
    cfg = json.loads((model / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (model / "config.json").write_text(json.dumps(cfg))
    gptq = refused(["generate", str(model), "--prompt", "hi"], capsys, monkeypatch)
    assert "holds a checkpoint quantized by gptq" in gptq
