"""`quantmesh plan`: the plan table and the estimate it prints, from config.json alone."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from quantmesh.cli.main import main

from .test_cli_common import cli, make_tiny_llama


@pytest.fixture(scope="module")
def config_only(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with the tiny model's config.json and nothing else: no weights are needed."""
    d = tmp_path_factory.mktemp("plan")
    make_tiny_llama(d / "full")
    (d / "cfg").mkdir()
    (d / "cfg" / "config.json").write_text((d / "full" / "config.json").read_text())
    return d / "cfg"


def _expected(
    model_dir: Path, *, tp: int, quant, r: int, seq: int, mb: int, dtype, compiled: bool = False
) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    import quantmesh as qm

    with qm.empty_model():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    lora = qm.LoraConfig(r=r) if r else None
    est = qm.estimate_memory(model, tp=tp, quant=quant, lora=lora, seq_len=seq, micro_batch=mb,
                             dtype=dtype, compiled=compiled)  # fmt: skip
    return est.table()


def test_plan_prints_the_table_and_the_estimate(config_only: Path, capsys) -> None:
    argv = ["plan", str(config_only), "--tp", "2", "--quant", "nf4", "--lora-r", "8",
            "--seq", "64", "--micro-batch", "2"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    rows = {  # module glob -> (style, local weight shape per rank)
        "model.embed_tokens": ("vocab", None),
        "model.layers.*.self_attn.q_proj (x2)": ("colwise", "48x72/24x72"),  # 6 + 3 heads of 8
        "model.layers.*.self_attn.k_proj (x2)": ("colwise", "16x72/8x72"),  # 2 + 1 KV heads
        "model.layers.*.self_attn.o_proj (x2)": ("rowwise", "72x48/72x24"),
        "model.layers.*.mlp.gate_proj (x2)": ("colwise", "48x72/48x72"),
        "model.layers.*.mlp.down_proj (x2)": ("rowwise", "72x48/72x48"),
        "lm_head": ("colwise_gather", None),
    }
    for glob, (style, shapes) in rows.items():
        line = next((ln for ln in out.splitlines() if ln.startswith(glob + " ")), None)
        assert line is not None, (glob, out)
        assert line.split()[len(glob.split()) + 1] == style, line
        if shapes:
            assert shapes in line, line
    assert "GPU (tp rank 0 of 2, dp=1; quant=nf4; training LoRA r=8" in out
    # on GPUs finetune compiles the blocks by default, and plan estimates what finetune runs
    table = _expected(config_only, tp=2, quant="nf4", r=8, seq=64, mb=2, dtype=torch.bfloat16,
                      compiled=True)  # fmt: skip
    assert table in out
    total = re.search(r"^  total\s+([\d.]+) (\w+)$", out, flags=re.M)
    assert total and float(total.group(1)) > 0


def test_plan_no_compile_estimates_eager_blocks(config_only: Path, capsys) -> None:
    argv = ["plan", str(config_only), "--tp", "2", "--quant", "nf4", "--lora-r", "8",
            "--seq", "64", "--micro-batch", "2"]  # fmt: skip
    assert main([*argv, "--compile"]) == 0
    compiled_out = capsys.readouterr().out
    assert main([*argv, "--no-compile"]) == 0
    eager_out = capsys.readouterr().out
    assert "bf16 autocast, compiled blocks" in compiled_out
    assert "compiled blocks" not in eager_out
    kw = dict(tp=2, quant="nf4", r=8, seq=64, mb=2, dtype=torch.bfloat16)
    compiled, eager = _expected(config_only, compiled=True, **kw), _expected(config_only, **kw)
    assert compiled in compiled_out and eager in eager_out
    assert compiled != eager  # compiled blocks keep less


def test_plan_says_which_weights_it_holds_dequantized(config_only: Path, capsys) -> None:
    argv = ["plan", str(config_only), "--quant", "nf4", "--lora-r", "8", "--seq", "64"]
    said = {}
    for extra in ([], ["--keep-dequantized"], ["--keep-dequantized", "--keep-dequantized-blocks",
                                                "1"]):  # fmt: skip
        assert main([*argv, *extra]) == 0
        out = capsys.readouterr().out
        said[len(extra)] = out.split("Assumes: ")[1].splitlines()[0]
        held = re.search(r"4-bit weights held dequantized\s+(\S+ \S+)", out)
        said[f"held{len(extra)}"] = held and held.group(1)
    assert "held dequantized" not in said[0] and said["held0"] is None
    assert "activation checkpointing off, every 4-bit weight held dequantized," in said[1]
    assert "off, the first layer's 4-bit weights held dequantized," in said[3]
    assert said["held1"] and said["held3"] and said["held1"] != said["held3"]


def test_plan_without_lora_is_a_forward_estimate(config_only: Path, capsys) -> None:
    assert main(["plan", str(config_only), "--tp", "1", "--seq", "32", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "forward only (inference); add --lora-r to estimate training" in out
    assert "per CPU rank" in out and "fp32 weights and activations" in out
    assert "lora" not in out.split("Estimated memory")[1].lower().replace("--lora-r", "")
    table = _expected(config_only, tp=1, quant=None, r=0, seq=32, mb=1, dtype=torch.float32)
    assert table in out


@pytest.mark.slow  # a CLI start; the in-process tests above check the same command's output
def test_plan_as_a_user_runs_it_reads_only_config_json(config_only: Path) -> None:
    assert sorted(p.name for p in config_only.iterdir()) == ["config.json"]
    proc = cli("plan", str(config_only), "--tp", "2", "--lora-r", "4", timeout=120, fresh=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Plan for tp=2:")
    assert json.loads((config_only / "config.json").read_text())["num_attention_heads"] == 9


def test_plan_shows_the_fsdp_layouts(config_only: Path, capsys) -> None:
    argv = ["plan", str(config_only), "--dp", "2", "--quant", "nf4", "--lora-r", "8",
            "--seq", "64"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "If this does not fit: --checkpointing:" in out
    assert "; --fsdp:" in out and "--fsdp --offload-base:" in out
    argv += ["--fsdp", "--offload-base", "--quant-backend", "torchao"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "FSDP: gathered" in out and "(host: offloaded base)" in out
    assert "fsdp over dp=2" in out
    with pytest.raises(SystemExit):  # --offload-base needs --fsdp
        main(["plan", str(config_only), "--offload-base"])
    assert "--offload-base needs --fsdp" in capsys.readouterr().err


def test_plan_says_whether_a_gpu_fits_and_the_fewest_layers_to_checkpoint(
    tmp_path: Path, capsys
) -> None:
    """--gpu-memory: the run against one card, and the first layout that fits it: here the 7B
    shape at 8192 tokens on a 24 GiB card, where checkpointing some of the 32 layers does."""
    from transformers import LlamaConfig

    from quantmesh.cli import plan_cmd

    LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                max_position_embeddings=8192).save_pretrained(tmp_path)  # fmt: skip
    base = ["plan", str(tmp_path), "--quant", "nf4", "--lora-r", "16", "--seq", "8192"]
    assert main([*base, "--gpu-memory", "24"]) == 0
    out = capsys.readouterr().out
    got = re.search(r"This run does not fit a 24 GiB GPU \(22.50 GiB after the CUDA context and "
                    r"workspaces\); --checkpointing --checkpoint-blocks (\d+) does \(about "
                    r"([\d.]+) GiB", out)  # fmt: skip
    assert got, out
    k, gib = int(got.group(1)), float(got.group(2))
    assert 1 < k < 32 and gib <= 22.5 * (1 - plan_cmd.PARTIAL_MARGIN)
    # one layer fewer would not leave the margin: the printed k is the fewest
    assert main([*base, "--checkpointing", "--checkpoint-blocks", str(k - 1)]) == 0
    total = re.search(r"^  total +([\d.]+) GiB", capsys.readouterr().out, re.M)
    assert total and float(total.group(1)) > 22.5 * (1 - plan_cmd.PARTIAL_MARGIN), total
    assert main([*base, "--checkpointing", "--gpu-memory", "24"]) == 0
    assert "This run fits a 24 GiB GPU" in capsys.readouterr().out
    assert main([*base, "--gpu-memory", "24", "--pp", "4", "--microbatches", "4"]) == 0
    out = capsys.readouterr().out
    assert "The fullest pp rank does not fit a 24 GiB GPU (22.50 GiB" in out
    assert "workspaces); --checkpointing does (about" in out
    # at pp > 1 the ways out are per pp rank, without the ones pp refuses (fsdp, partial)
    assert "If this does not fit, the fullest pp rank needs: --checkpointing: " in out
    assert "--checkpoint-blocks" not in out and "--fsdp" not in out


def test_plan_lists_the_experts_beside_the_plan(tmp_path: Path, capsys) -> None:
    """The experts modules, split by quantmesh outside the plan's rules, get their rows too (they
    had none: the largest tensors of a mixture of experts were missing from the table)."""
    from tests.moe_folders import moe_dir

    folder = moe_dir("qwen3_moe", tmp_path / "full")  # hidden 32, 4 experts of 16 features
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text((folder / "config.json").read_text())
    assert main(["plan", str(tmp_path / "cfg"), "--tp", "2"]) == 0
    out = capsys.readouterr().out
    glob = "model.layers.*.mlp.experts (x2)"
    line = next((ln for ln in out.splitlines() if ln.startswith(glob + " ")), None)
    assert line is not None, out
    assert line.split()[3] == "experts", line
    assert "gate_up_proj 4x16x32/4x16x32, down_proj 4x32x8/4x32x8" in line, line
    assert line.endswith("experts: 16 intermediate features split over tp"), line


def test_plan_says_what_a_folder_in_a_format_quantmesh_does_not_compute_in_costs(
    tmp_path: Path, capsys
) -> None:
    """gpt-oss' MXFP4 experts load as float without --quant: the plan's estimate is of that, and
    a note says so and names the flag that keeps them in 4 bits (the loader warned; the plan,
    where the memory is decided, did not)."""
    from tests.moe_folders import moe_dir, mxfp4_folder

    stored, _ = mxfp4_folder(moe_dir("gpt_oss", tmp_path / "f", intermediate_size=64,
                                     hidden_size=64), tmp_path / "mx")  # fmt: skip
    assert main(["plan", str(stored), "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "is stored in mxfp4, which quantmesh does not compute in: without quantization its " \
           "weights load as float, about four times the stored bytes in bf16, as estimated " \
           "here; --quant nf4 (or int8) holds them in 4" in out, out  # fmt: skip
    assert main(["plan", str(stored), "--tp", "2", "--quant", "nf4"]) == 0
    assert "stored in mxfp4" not in capsys.readouterr().out


def test_plan_never_proposes_fsdp_for_experts(tmp_path: Path, capsys) -> None:
    """FSDP does not shard experts modules (parallelize refuses it): the ways out a plan lists
    for a mixture of experts leave --fsdp out, and so does the note on --quant-backend."""
    from tests.moe_folders import moe_dir

    folder = moe_dir("mixtral", tmp_path / "m")
    assert main(["plan", str(folder), "--tp", "2", "--lora-r", "8", "--quant", "nf4"]) == 0
    out = capsys.readouterr().out
    assert "If this does not fit: --checkpointing" in out, out
    assert "--fsdp" not in out, out


def test_plan_and_finetune_take_expert_tensor_targets(tmp_path: Path, capsys, monkeypatch) -> None:
    """An expert tensor (`gate_up_proj`, `*experts.down_proj`) is a LoRA target parallelize and
    serve take: plan and finetune's checks refused it as matching no module."""
    from quantmesh.cli.finetune import FinetuneConfig, check_finetune
    from tests.moe_folders import moe_dir

    from .test_cli_common import make_tiny_llama

    folder = moe_dir("qwen3_moe", tmp_path / "m")
    assert main(["plan", str(folder), "--lora-r", "8", "--lora-targets", "gate_up_proj"]) == 0
    assert "lora adapters" in capsys.readouterr().out
    tiny = make_tiny_llama(tmp_path / "tiny")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((tiny / name).read_bytes())
    (tmp_path / "d.txt").write_text("to be or not to be " * 20)
    cfg = FinetuneConfig.from_settings({"model": str(folder), "data": [str(tmp_path / "d.txt")],
                                        "lora_targets": ["q_proj", "*experts.down_proj"],
                                        "seq_len": 32, "output_dir": str(tmp_path / "o")})  # fmt: skip
    check_finetune(cfg)  # no error
