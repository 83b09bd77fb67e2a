"""Likely mistakes give one clear `quantmesh: error: ...` and exit code 2, before any worker starts;
a worker that fails later gives one line naming its rank and the first line of its error.

Most cases call the CLI's `main()` in this process (the launching process is where they are caught,
and a launch here would be a bug: it is replaced by a tripwire); two run it as a user does.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from .test_cli_common import CORPUS, cli, make_tiny_llama, refused


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("errors")
    make_tiny_llama(d / "tiny")
    (d / "ok.txt").write_text(CORPUS * 4)
    return d


_fails = refused  # main() in this process, a tripwire on the launch


def test_missing_model_folder(tiny: Path, capsys, monkeypatch) -> None:
    err = _fails(["finetune", "--model", str(tiny / "nope"), "--data", str(tiny / "ok.txt")],
                 capsys, monkeypatch)  # fmt: skip
    assert f"model folder '{tiny / 'nope'}' does not exist" in err


def test_a_folder_without_config_json(tiny: Path, capsys, monkeypatch) -> None:
    err = _fails(["plan", str(tiny)], capsys, monkeypatch)
    assert "has no config.json (it holds: " in err and "ok.txt" in err


def test_a_folder_without_a_tokenizer(tiny: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    """finetune, generate and serve need the tokenizer: each says so before a worker starts
    (generate and serve failed in rank 0 with transformers' own error about slow tokenizers)."""
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(tiny / "tiny", bare)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "chat_template.jinja"):  # fmt: skip
        (bare / name).unlink(missing_ok=True)
    for argv in (["finetune", "--model", str(bare), "--data", str(tiny / "ok.txt")],
                 ["generate", str(bare), "--prompt", "hi"], ["serve", str(bare)]):  # fmt: skip
        err = _fails(argv, capsys, monkeypatch)
        assert f"model folder '{bare}' has no tokenizer (none of tokenizer.json" in err, argv


def test_fsdp_with_experts_is_refused_before_launch(tiny: Path, tmp_path: Path, capsys,
                                                    monkeypatch) -> None:  # fmt: skip
    """FSDP does not shard experts modules: --fsdp on a mixture of experts is refused before any
    worker starts (rank 0 refused it after loading)."""
    import shutil

    from tests.moe_folders import moe_dir

    folder = moe_dir("mixtral", tmp_path / "m")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / "tiny" / name, folder / name)
    err = _fails(["finetune", "--model", str(folder), "--data", str(tiny / "ok.txt"), "--fsdp",
                  "--nproc", "2", "--seq-len", "32", "--quant-backend", "torchao"],
                 capsys, monkeypatch)  # fmt: skip
    assert "--fsdp with experts modules (model.layers.0.mlp.experts, ...): FSDP2" in err, err
    assert "(leave --fsdp out)" in err
    # dropout on expert adapters: refused here too, not on rank 0 after loading
    err = _fails(["finetune", "--model", str(folder), "--data", str(tiny / "ok.txt"),
                  "--seq-len", "32", "--lora-dropout", "0.1"], capsys, monkeypatch)  # fmt: skip
    assert "LoRA on the expert tensors of model.layers.0.mlp.experts with dropout=0.1" in err


def test_data_in_the_wrong_format(tiny: Path, capsys, monkeypatch) -> None:
    bad = tiny / "bad.jsonl"
    bad.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"foo": 1}) + "\n")
    err = _fails(["finetune", "--model", str(tiny / "tiny"), "--data", str(bad), "--seq-len", "64"],
                 capsys, monkeypatch)  # fmt: skip
    assert f"{bad} line 2: no known format in the keys ['foo']; accepted formats: messages" in err
    pq = tiny / "chat.parquet"
    pq.write_bytes(b"PAR1" + b"\xde" * 64)  # Parquet's magic: never read (nor refused) as text
    err = _fails(["finetune", "--model", str(tiny / "tiny"), "--data", str(pq), "--seq-len", "64"],
                 capsys, monkeypatch)  # fmt: skip
    assert f"{pq}: not a readable parquet file" in err and "UTF-8" not in err
    chat = tiny / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "To be"}]}) + "\n")
    err = _fails(["finetune", "--model", str(tiny / "tiny"), "--data", str(chat), "--seq-len", "64",
                  "--data-format", "alpaca"], capsys, monkeypatch)  # fmt: skip
    assert f"{chat} line 1: --data-format alpaca needs the keys ['instruction', 'output']" in err


def test_mesh_sizes_that_do_not_divide_the_process_count(tiny: Path, capsys, monkeypatch) -> None:
    base = [
        "finetune",
        "--model",
        str(tiny / "tiny"),
        "--data",
        str(tiny / "ok.txt"),
        "--seq-len",
        "64",
    ]
    err = _fails([*base, "--nproc", "3", "--tp", "2"], capsys, monkeypatch)
    assert "--tp 2 does not divide the 3 processes (--nproc 3 x --nnodes 1); use --tp 1 or 3" in err
    err = _fails([*base, "--nproc", "4", "--tp", "2", "--dp", "3"], capsys, monkeypatch)
    assert "--tp 2 x --dp 3 = 6 processes, but --nproc 4 x --nnodes 1 = 4" in err


def test_lora_targets_that_match_nothing(tiny: Path, capsys, monkeypatch) -> None:
    err = _fails(["finetune", "--model", str(tiny / "tiny"), "--data", str(tiny / "ok.txt"),
                  "--seq-len", "64", "--lora-targets", "qkv"], capsys, monkeypatch)  # fmt: skip
    assert "LoRA target 'qkv' matches no module" in err and "q_proj" in err


def test_a_sequence_longer_than_the_context(tiny: Path, capsys, monkeypatch) -> None:
    err = _fails(["finetune", "--model", str(tiny / "tiny"), "--data", str(tiny / "ok.txt"),
                  "--seq-len", "4096"], capsys, monkeypatch)  # fmt: skip
    assert "--seq-len 4096 is longer than the model's context" in err
    assert "max_position_embeddings=256" in err


def test_an_estimated_out_of_memory(tiny: Path, capsys, monkeypatch) -> None:
    # 200k examples of 256 tokens per micro-batch: the logits alone are ~250 GiB.
    err = _fails(["finetune", "--model", str(tiny / "tiny"), "--data", str(tiny / "ok.txt"),
                  "--seq-len", "256", "--micro-batch", "200000"], capsys, monkeypatch)  # fmt: skip
    assert re.search(r"estimated out of memory: training needs about [\d.]+ GiB per rank", err)
    assert "logits + loss" in err and "--micro-batch" in err


def test_an_adapter_that_does_not_fit_the_model(tiny: Path, capsys, monkeypatch) -> None:
    from safetensors.torch import save_file

    ad = tiny / "adapter"
    ad.mkdir(exist_ok=True)
    (ad / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"],
        "base_model_name_or_path": "some-other-model",
    }))  # fmt: skip
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
    save_file({key.format("A"): torch.zeros(4, 50), key.format("B"): torch.zeros(72, 4)},
              ad / "adapter_model.safetensors")  # fmt: skip
    err = _fails(["generate", str(tiny / "tiny"), "--adapter", str(ad), "--prompt", "hi"],
                 capsys, monkeypatch)  # fmt: skip
    assert "does not fit the model" in err
    assert "model.layers.0.self_attn.q_proj.lora_A: (4, 50) in the adapter, the model needs " \
        "(4, 72)" in err  # fmt: skip
    assert "'some-other-model'" in err


def test_exit_code_and_message_as_a_user_sees_them(tiny: Path) -> None:
    proc = cli("plan", str(tiny / "missing"), "--tp", "2", timeout=120, fresh=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"quantmesh: error: model folder '{tiny / 'missing'}' does not exist; pass a folder "
        "written by save_pretrained (config.json, weights, tokenizer)"
    ]


@pytest.mark.slow
def test_a_failing_worker_gives_one_line_naming_its_rank(tiny: Path, tmp_path: Path) -> None:
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny / "tiny", broken)
    (broken / "model.safetensors").write_bytes(b"\x00" * 64)  # not a safetensors file
    out = tmp_path / "out"
    proc = cli("finetune", "--model", str(broken), "--data", str(tiny / "ok.txt"), "--nproc", "2",
               "--tp", "2", "--seq-len", "16", "--output-dir", str(out))  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("quantmesh: error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    m = re.match(r"quantmesh: error: rank (\d): (\w+): .+ \(traceback: (.+)\)$", lines[0])
    assert m, lines[0]
    assert "Traceback" not in proc.stderr
    assert Path(m.group(3)) == out / "logs" / f"rank-{m.group(1)}.log"
    assert "Traceback (most recent call last)" in Path(m.group(3)).read_text()


def test_pipeline_settings_that_cannot_run(tiny: Path, capsys, monkeypatch) -> None:
    base = ["finetune", "--model", str(tiny / "tiny"), "--data", str(tiny / "ok.txt"),
            "--seq-len", "64", "--nproc", "2", "--pp", "2"]  # fmt: skip
    err = _fails([*base, "--microbatches", "1"], capsys, monkeypatch)
    assert (
        "--pp-schedule 1f1b needs --grad-accum >= --pp: 1 < 2; pass --grad-accum 2 or "
        "--pp-schedule gpipe" in err
    )
    err = _fails([*base[:-4], "--nproc", "3", "--pp", "2", "--microbatches", "2"], capsys,
                 monkeypatch)  # fmt: skip
    assert "--tp 1 x --pp 2 = 2 does not divide the 3 processes" in err
    err = _fails(["generate", str(tiny / "tiny"), "--prompt", "hi", "--pp", "2"], capsys,
                 monkeypatch)  # fmt: skip
    assert "--pp 2: generation does not run over pipeline stages" in err and "--tp 2" in err
    err = _fails([*base, "--microbatches", "2", "--pp-virtual", "2", "--pp-schedule",
                  "interleaved1f1b"], capsys, monkeypatch)  # fmt: skip
    assert "4 stages (pp=2 x virtual=2) but LlamaForCausalLM has 2 blocks" in err


def test_checkpoint_blocks_that_cannot_run(tiny: Path, capsys, monkeypatch) -> None:
    base = ["finetune", "--model", str(tiny / "tiny"), "--data", str(tiny / "ok.txt"),
            "--seq-len", "64"]  # fmt: skip
    err = _fails([*base, "--checkpoint-blocks", "1"], capsys, monkeypatch)
    assert "--checkpoint-blocks needs --checkpointing" in err
    err = _fails([*base, "--checkpointing", "--checkpoint-blocks", "0"], capsys, monkeypatch)
    assert "--checkpoint-blocks 0; expected an integer >= 1" in err
    err = _fails([*base, "--checkpointing", "--checkpoint-blocks", "3"], capsys, monkeypatch)
    assert "--checkpoint-blocks 3, but the model has 2 decoder layers; pass 1 to 2" in err
    err = _fails([*base, "--nproc", "2", "--pp", "2", "--checkpointing", "--checkpoint-blocks",
                  "1"], capsys, monkeypatch)  # fmt: skip
    assert "--checkpoint-blocks with --pp 2" in err
    plan = ["plan", str(tiny / "tiny"), "--lora-r", "4"]
    # plan says which of the three is wrong, in finetune's words, for both per-layer counts
    for flag, needs in (("--checkpoint-blocks", "--checkpointing"),
                        ("--keep-dequantized-blocks", "--keep-dequantized")):  # fmt: skip
        quant = ["--quant", "nf4"] if needs == "--keep-dequantized" else []
        err = _fails([*plan, *quant, flag, "1"], capsys, monkeypatch)
        assert f"{flag} 1 without {needs}: it says how many layers {needs} applies to" in err
        err = _fails([*plan, *quant, needs, flag, "3"], capsys, monkeypatch)
        assert f"{flag} 3, but the model has 2 decoder layers; pass 1 to 2" in err
        err = _fails([*plan, *quant, "--pp", "2", needs, flag, "1"], capsys, monkeypatch)
        assert f"{flag} with --pp 2: each stage would choose among its own layers" in err


def test_cuda_graphs_where_they_are_not_verified(tiny: Path, capsys, monkeypatch) -> None:
    """--cuda-graphs is refused, with the reason, wherever it is not verified: without compiled
    layers, with checkpointing, with more than one GPU or FSDP, and on a machine without CUDA."""
    base = ["finetune", "--model", str(tiny / "tiny"), "--data", str(tiny / "ok.txt"),
            "--seq-len", "64", "--cuda-graphs"]  # fmt: skip
    err = _fails([*base, "--no-compile"], capsys, monkeypatch)
    assert "--cuda-graphs replays the compiled decoder layers: drop --no-compile" in err
    err = _fails([*base, "--checkpointing"], capsys, monkeypatch)
    assert "--cuda-graphs with --checkpointing: recomputed layers replayed" in err
    for extra, layout in ((["--nproc", "2", "--tp", "2"], "--tp 2 --pp 1 --dp 1"),
                          (["--nproc", "2"], "--tp 1 --pp 1 --dp 2"),
                          (["--nproc", "2", "--pp", "2", "--grad-accum", "2"], "--tp 1 --pp 2"),
                          (["--fsdp"], "--tp 1 --pp 1 --dp 1 --fsdp")):  # fmt: skip
        err = _fails([*base, *extra], capsys, monkeypatch)
        assert f"--cuda-graphs with {layout}" in err and "verified on one GPU only" in err, extra
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = _fails(base, capsys, monkeypatch)
    assert "--cuda-graphs needs a CUDA GPU, and this machine has none: drop it" in err


def test_full_checkpointing_notes_what_fits_with_less_recompute(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    """--checkpointing alone: finetune says when the run fits without it, or with fewer layers
    recomputed (the memory check's margin), and says nothing when every layer is needed."""
    from quantmesh.cli import finetune, plan_cmd
    from quantmesh.cli.main import build_parser
    from quantmesh.plan.memory import estimate_memory

    make_tiny_llama(tmp_path / "six", layers=6)
    (tmp_path / "ok.txt").write_text(CORPUS * 4)
    argv = ["finetune", "--model", str(tmp_path / "six"), "--data", str(tmp_path / "ok.txt"),
            "--seq-len", "256", "--micro-batch", "8", "--checkpointing", "--nproc", "1"]  # fmt: skip
    cfg = finetune.config_from_args(build_parser().parse_args(argv))
    _, model = plan_cmd.load_skeleton(cfg.model)
    mem = dict(model=model, lora=cfg.lora, seq_len=256, micro_batch=8,
               dtype=torch.float32, loss_chunk_tokens=cfg.train.loss_chunk_tokens)  # fmt: skip
    free = 1 - plan_cmd.PARTIAL_MARGIN
    plain = estimate_memory(**mem).total
    k3 = estimate_memory(**mem, checkpointing=True, checkpointed_blocks=3).total
    k2 = estimate_memory(**mem, checkpointing=True, checkpointed_blocks=2).total
    every = estimate_memory(**mem, checkpointing=True).total
    for budget, want in (
        (int(plain / free) + 1, "fits without --checkpointing"),
        (int((k2 + k3) / 2 / free), "--checkpoint-blocks 3 (of 6) fits too"),
        (int(every / free), None),  # only (nearly) all of them fit
    ):
        monkeypatch.setattr(plan_cmd, "device_budget", lambda n, b=budget: ("cpu", b, "test"))
        finetune.check_finetune(cfg)
        err = capsys.readouterr().err
        if want is None:
            assert "note:" not in err, err
        else:
            assert "quantmesh finetune: note: " in err and want in err, err
