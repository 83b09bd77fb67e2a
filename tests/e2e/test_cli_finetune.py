"""`quantmesh finetune` on instruction data at dp=2 with gradient accumulation: the logged loss of
the first step is the token-mean over the whole global batch, with prompts masked out.

The reference is computed here, on one process, with plain transformers: the same examples
(`build_dataset` + `iterate_batches` with the run's seed), the same model (the adapters start at
zero, so step 1 sees the base model), cross-entropy summed over response tokens only and divided by
their count over all 4 micro-batches of the step.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from .test_cli_common import cli, make_tiny_llama

pytestmark = pytest.mark.slow  # make test-fast leaves this module out

WORDS = "the sea of troubles and the winter of our discontent made glorious summer".split()


def _instructions(path: Path, n: int = 48) -> None:
    g = torch.Generator().manual_seed(0)
    with path.open("w") as f:
        for _ in range(n):
            pick = torch.randint(0, len(WORDS), (12,), generator=g).tolist()
            prompt = " ".join(WORDS[j] for j in pick[:7])
            response = " ".join(WORDS[j] for j in pick[7:])
            f.write(json.dumps({"prompt": prompt, "response": response}) + "\n")


def _reference(
    model_dir: Path, data: Path, seq_len: int, dp: int = 2, **build_kw
) -> tuple[float, float]:
    """(masked loss, unmasked loss) of step 1 of a `dp`-replica, micro_batch=1, grad_accum=2 run
    (`build_kw`: build_dataset's data options, as the run's flags set them)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantmesh import build_dataset, iterate_batches

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ds = build_dataset([data], tok, seq_len, seed=0, **build_kw)
    assert 0 < ds.num_labelled < len(ds.train) * seq_len  # prompts really are masked
    micro = []
    for rank in range(dp):  # the first 2 micro-batches (grad_accum=2) of each dp rank
        it = iterate_batches(ds.train, 1, dp_rank=rank, dp_size=dp, seed=0, epoch=0)
        micro += [next(it), next(it)]
    sums, counts, all_sum, all_count = 0.0, 0, 0.0, 0
    with torch.no_grad():
        for b in micro:
            logits = model(input_ids=b["input_ids"]).logits[0, :-1]  # (T-1, V)
            labels = b["labels"][0, 1:]
            ids = b["input_ids"][0, 1:]
            sums += float(F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum"))
            counts += int((labels != -100).sum())
            all_sum += float(F.cross_entropy(logits, ids, reduction="sum"))
            all_count += ids.numel()
    return sums / counts, all_sum / all_count


def test_instruction_loss_is_masked_and_averaged_over_dp2_grad_accum2(tmp_path: Path) -> None:
    model_dir = make_tiny_llama(tmp_path / "tiny")
    data = tmp_path / "instructions.jsonl"
    _instructions(data)
    proc = cli(
        "finetune",
        "--model",
        str(model_dir),
        "--data",
        str(data),
        "--nproc",
        "2",
        "--tp",
        "1",
        "--micro-batch",
        "1",
        "--grad-accum",
        "2",
        "--seq-len",
        "32",
        "--steps",
        "2",
        "--lr",
        "1e-2",
        "--output-dir",
        str(tmp_path / "out"),
        "--compile",
        "--checkpointing",
        "--checkpoint-blocks",
        "1",
        "--tile-tokens",
        "10",
        "--loss-chunk-tokens",
        "7",
    )  # fmt: skip (compiled, one of two blocks recomputed, its MLP in tiles, a chunked loss: the
    # eager reference's loss)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tp=1 x dp=2" in proc.stderr
    assert "train:" in proc.stderr  # a forked worker's own stderr (rank 0's progress) arrives
    assert "compile: 2 blocks" in proc.stdout + proc.stderr
    rows = [json.loads(ln) for ln in (tmp_path / "out/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["tokens"] == 2 * 2 * 1 * 32  # dp x grad_accum x micro_batch x seq_len
    masked, unmasked = _reference(model_dir, data, 32)
    assert abs(masked - unmasked) > 0.05  # the two readings are far apart: the test can tell
    # fp32 on both sides; the sharded run sums in another order: 1e-4 is loose for 1e-6 noise.
    assert abs(rows[0]["loss"] - masked) < 1e-4, (rows[0]["loss"], masked, unmasked)


def test_pipelined_finetune_pp2_logs_the_global_loss(tmp_path: Path) -> None:
    """--pp 2: each worker holds one decoder layer; 1F1B over 2 micro-batches; the first step's
    loss is the same masked token-mean; the adapter is saved as one PEFT folder, the resumable
    state as one folder. Its workers are fresh interpreters (QUANTMESH_FORK_WORKERS=0), as on a
    host with CUDA: the suite's one worker command started that way (the others fork)."""
    model_dir = make_tiny_llama(tmp_path / "tiny")
    data = tmp_path / "instructions.jsonl"
    _instructions(data)
    proc = cli(
        "finetune", "--model", str(model_dir), "--data", str(data), "--nproc", "2", "--pp", "2",
        "--micro-batch", "1", "--microbatches", "2", "--pp-schedule", "1f1b", "--seq-len", "32",
        "--steps", "2", "--lr", "1e-2", "--output-dir", str(tmp_path / "out"),
        env={"QUANTMESH_FORK_WORKERS": "0"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tp=1 x pp=2 x dp=1" in proc.stderr
    rows = [json.loads(ln) for ln in (tmp_path / "out/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    masked, _ = _reference(model_dir, data, 32, dp=1)
    assert abs(rows[0]["loss"] - masked) < 1e-4, (rows[0]["loss"], masked)
    cfg = json.loads((tmp_path / "out/adapter/adapter_config.json").read_text())
    from safetensors.torch import load_file

    weights = load_file(tmp_path / "out/adapter/adapter_model.safetensors")
    assert {k.split(".layers.")[1].split(".")[0] for k in weights} == {"0", "1"}  # both stages
    assert cfg["peft_type"] == "LORA"
    assert (tmp_path / "out/checkpoints/step-000002/state/state.json").is_file()  # resumable
    # one worker tokenized, into the run's cache, which both mapped
    assert len(list((tmp_path / "out/data-cache").glob("*.safetensors"))) == 1


@pytest.mark.slow
def test_fsdp_finetune_matches_the_masked_reference(tmp_path: Path) -> None:
    """--fsdp through the whole CLI: from_pretrained on meta, sharded once loaded, grad
    accumulation under no_sync, a checkpoint; the first loss is the eager reference's."""
    model_dir = make_tiny_llama(tmp_path / "tiny")
    data = tmp_path / "instructions.jsonl"
    _instructions(data)
    proc = cli("finetune", "--model", str(model_dir), "--data", str(data), "--nproc", "2",
               "--micro-batch", "1", "--grad-accum", "2", "--seq-len", "32", "--steps", "2",
               "--lr", "1e-2", "--output-dir", str(tmp_path / "out"), "--fsdp")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(ln) for ln in (tmp_path / "out/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    masked, _ = _reference(model_dir, data, 32)
    assert abs(rows[0]["loss"] - masked) < 1e-4, (rows[0]["loss"], masked)
    assert any((tmp_path / "out").rglob("adapter_model.safetensors"))


def test_some_layers_weights_held_dequantized_train_as_the_codes(tmp_path: Path) -> None:
    """--keep-dequantized --keep-dequantized-blocks 1 through the CLI: the first layer's 4-bit
    weights held (said, with their size), the losses those of the codes' path (eager on CPU: the
    held values are bitsandbytes' own dequantize's); a count past the model's layers is refused
    before any worker starts."""
    model_dir = make_tiny_llama(tmp_path / "tiny")
    data = tmp_path / "instructions.jsonl"
    _instructions(data)
    common = ["finetune", "--model", str(model_dir), "--data", str(data), "--quant", "nf4",
              "--micro-batch", "2", "--seq-len", "32", "--steps", "2", "--lr", "1e-2"]  # fmt: skip
    losses = []
    for name, extra in (
        ("codes", []),
        ("held", ["--keep-dequantized", "--keep-dequantized-blocks", "1"]),
    ):
        out = tmp_path / name
        proc = cli(*common, "--output-dir", str(out), *extra)
        assert proc.returncode == 0, proc.stderr[-3000:]
        if extra:
            assert re.search(
                r"keep-dequantized: [0-9.]+ GiB of 4-bit weights held \(the first 1 decoder layers'\)",
                proc.stdout,
            ), proc.stdout
        rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
        losses.append([r["loss"] for r in rows])
    assert losses[0] == losses[1]
    proc = cli(*common, "--output-dir", str(tmp_path / "x"), "--keep-dequantized",
               "--keep-dequantized-blocks", "99")  # fmt: skip
    assert proc.returncode == 2
    assert "--keep-dequantized-blocks 99, but the model has 2 decoder layers" in proc.stderr


def _conversations(folder: Path, n: int = 48) -> None:
    """A folder of two shards: multi-turn OpenAI-style messages (JSONL), ShareGPT (Parquet)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    g = torch.Generator().manual_seed(1)

    def say(k: int) -> str:
        return " ".join(WORDS[j] for j in torch.randint(0, len(WORDS), (k,), generator=g).tolist())

    folder.mkdir()
    with (folder / "part-0.jsonl").open("w") as f:
        for _ in range(n):
            msgs = [{"role": "user", "content": say(4)}, {"role": "assistant", "content": say(3)},
                    {"role": "user", "content": say(3)}, {"role": "assistant", "content": say(3)}]  # fmt: skip
            f.write(json.dumps({"messages": msgs}) + "\n")
    rows = [{"conversations": [{"from": "human", "value": say(5)}, {"from": "gpt", "value": say(4)}]}
            for _ in range(16)]  # fmt: skip
    pq.write_table(pa.Table.from_pylist(rows), folder / "part-1.parquet")


def test_conversations_dp2_tp2_pp2_no_packing(tmp_path: Path) -> None:
    """A folder of chat shards (messages JSONL, ShareGPT Parquet), one conversation per example
    (--no-packing), at dp=2 x tp=2 x pp=2: the run reports each file's format and trained tokens
    (the assistant turns with their <|im_end|>), and its first loss is the single-process loss
    over the assistant tokens of the same examples."""
    model_dir = make_tiny_llama(tmp_path / "tiny")
    data = tmp_path / "chat"
    _conversations(data)
    proc = cli(
        "finetune", "--model", str(model_dir), "--data", str(data), "--nproc", "8", "--tp", "2",
        "--pp", "2", "--micro-batch", "1", "--microbatches", "2", "--seq-len", "32", "--steps", "2",
        "--lr", "1e-2", "--no-packing", "--output-dir", str(tmp_path / "out"), timeout=480,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tp=2 x pp=2 x dp=2" in proc.stderr
    # ChatML: <|im_start|> role words... <|im_end|>; an assistant turn trains its words + <|im_end|>
    assert f"data: {data / 'part-0.jsonl'}: messages, 48 documents, 1200 tokens, 384 trained\n" in (
        proc.stdout
    )
    assert f"data: {data / 'part-1.parquet'}: sharegpt, 16 documents, 240 tokens, 80 trained\n" in (
        proc.stdout
    )
    assert "data: 64 documents, 1440 tokens, 464 trained (assistant turns) -> 64 train / 0 eval " \
        "examples of 32 (one per document, padded)" in proc.stdout  # fmt: skip
    rows = [json.loads(ln) for ln in (tmp_path / "out/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    masked, unmasked = _reference(model_dir, data, 32, dp=2, packing=False)
    # the loss over every token is 5e-3 away (a random model): 50x the tolerance below
    assert abs(masked - unmasked) > 1e-3
    # fp32 on both sides; the sharded run sums in another order: 1e-4 is loose for 1e-6 noise.
    assert abs(rows[0]["loss"] - masked) < 1e-4, (rows[0]["loss"], masked, unmasked)


def test_ctrl_c_stops_the_run_and_names_the_checkpoint_to_resume(tmp_path: Path) -> None:
    """Ctrl-C in a terminal (SIGINT to the whole process group: the launcher and every worker,
    the launcher forwarding its own) stops the run with one line naming the latest checkpoint
    and how to resume, exit code 130, and no traceback. Before, the launcher's SignalException
    and a worker's KeyboardInterrupt during a checkpoint's clean-up were printed as tracebacks."""
    import os
    import signal
    import subprocess
    import sys
    import time

    model_dir = make_tiny_llama(tmp_path / "tiny")
    data = tmp_path / "instructions.jsonl"
    _instructions(data, n=96)
    out = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(k, None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "quantmesh.cli.main", "finetune", "--model", str(model_dir),
         "--data", str(data), "--nproc", "2", "--tp", "2", "--seq-len", "32", "--epochs", "50",
         "--save-every", "2", "--no-progress", "--output-dir", str(out)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.time() + 150
        while not (out / "checkpoints/step-000002/state").is_dir() and time.time() < deadline:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        assert (out / "checkpoints/step-000002/state").is_dir(), "no checkpoint in 150 s"
        os.killpg(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, (proc.returncode, stderr[-3000:])
    assert re.search(r"quantmesh finetune: stopped \(SIGINT\); the latest checkpoint is \S+"
                     r"checkpoints/step-\d{6}; resume with --resume \S+", stderr), stderr[-3000:]  # fmt: skip
    assert "Traceback" not in stderr + stdout, stderr[-3000:]
