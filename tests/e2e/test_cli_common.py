"""Shared helpers of the CLI end-to-end tests: a tiny random Llama folder and a CLI runner.

The model is shaped like SmolLM2 where it matters for tensor parallelism (9 heads, 3 KV heads, tied
embeddings) but tiny (hidden 72, 2 layers), with a word-level tokenizer built offline over a few
sentences and a ChatML chat template.

`cli()` starts the launching `quantmesh` process forked from the suite's fork server (torch,
transformers, bitsandbytes, peft and the CLI workers' imports already done: quantmesh.testing.PRELOAD
and tests/conftest.py), in its own session, working folder, environment, stdout and stderr; it runs
what the console script runs (`main(argv)`, ended by `runner.exit_fast`) and launches its workers
through torchrun, forked from itself since it holds their imports (cli/launch.py). `cli(...,
fresh=True)` starts a fresh interpreter for the launching process, as a shell does: its workers come
from a fork server, as a user's do (the demo's test), and the tests of what a user sees at a
command's start (its exit code and message) use it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "quantmesh.cli.main"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = (
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer "
    "the slings and arrows of outrageous fortune, or to take arms against a sea of troubles. "
    "Now is the winter of our discontent made glorious summer by this sun of York. "
    "All the world's a stage, and all the men and women merely players. "
)


def cli(
    *args: str, timeout: float = 170, env: dict | None = None, cwd: Path = REPO, fresh: bool = False
) -> subprocess.CompletedProcess:
    """Run `quantmesh ARGS` (from the repository root by default) as a user would; never longer
    than `timeout` seconds (then subprocess.TimeoutExpired, as subprocess.run raises).

    The launching process is forked from the suite's fork server (its imports done once per
    worker, seconds of CPU per command), or with `fresh=True` a new interpreter
    (`python -m quantmesh.cli.main`)."""
    full = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        full.pop(k, None)  # the CLI launches its own workers: nothing from outside may leak in
    if fresh:
        return subprocess.run(
            [*CLI, *args], cwd=cwd, env=full, capture_output=True, text=True, timeout=timeout
        )
    return _forked_cli(list(args), timeout, full, cwd)


def _forked_cli(
    argv: list[str], timeout: float, env: dict[str, str], cwd: Path
) -> subprocess.CompletedProcess:
    import tempfile

    from quantmesh import testing

    ctx = testing._context()
    with tempfile.TemporaryDirectory(prefix="quantmesh-cli-") as d:
        out, err = Path(d, "stdout"), Path(d, "stderr")
        proc = ctx.Process(target=_cli_child, args=(argv, str(cwd), env, str(out), str(err)))
        proc.start()
        proc.join(timeout)
        timed_out = proc.exitcode is None
        if timed_out:  # SIGTERM first: torchrun's agent stops the workers it started
            os.kill(proc.pid, signal.SIGTERM)
            proc.join(15)
            if proc.exitcode is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.join()
        stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
    if timed_out:
        raise subprocess.TimeoutExpired([*CLI, *argv], timeout, stdout, stderr)
    return subprocess.CompletedProcess([*CLI, *argv], proc.exitcode, stdout, stderr)


def _cli_child(argv: list[str], cwd: str, env: dict[str, str], out: str, err: str) -> None:
    """The launching process: what `python -m quantmesh.cli.main ARGV` runs, in a new session."""
    os.setsid()
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's own
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.argv = [CLI[-1], *argv]

    from quantmesh.cli.main import main
    from quantmesh.cli.runner import exit_fast

    exit_fast(lambda: main(argv))


def refused(argv: list[str], capsys, monkeypatch) -> str:
    """Run the CLI's `main(argv)` in this process; it must exit with code 2 before launching any
    worker (a launch is replaced by a tripwire). Returns its stderr, one `quantmesh: error:` line.

    A check that the launching process makes needs no process of its own: the tests keep one real
    CLI start per command for the exit code and message as a user sees them.
    """
    import pytest

    from quantmesh.cli import runner
    from quantmesh.cli.main import main

    def tripwire(*a, **k):
        raise AssertionError(f"workers were launched for {argv}")

    monkeypatch.setattr(runner, "run_workers", tripwire)
    capsys.readouterr()  # what the test printed before
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert err.startswith("quantmesh: error: "), err
    assert "Traceback" not in err
    return err


def peft_chat_reply(
    model_dir: Path,
    adapter_dir: Path,
    prompt: str,
    max_new_tokens: int,
    repetition_penalty: float = 1.0,
) -> str:
    """The oracle for adapters: transformers + peft on one process, unsharded, fp32; the greedy
    reply to `prompt` as a chat's user turn (the CLI's `generate --adapter` and the server's chat
    are checked against it)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter_dir).eval()
    text = tok.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    ids = tok(text, add_special_tokens=False, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(
            **ids,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            repetition_penalty=repetition_penalty,
            pad_token_id=tok.pad_token_id,
        )
    return tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)


def make_tokenizer():
    """A word-level tokenizer over CORPUS's words, with EOS, pad, unk and a ChatML template.

    Word-level (not byte-level) on purpose: every token decodes to whole words, so text streamed
    token by token equals the text decoded at once, and the tests can compare strings exactly.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
    words = sorted(set(CORPUS.split()) | {"user", "assistant", "system"})
    vocab = {w: i for i, w in enumerate(specials + words)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>"],
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def make_tiny_llama(path: Path, *, seed: int = 0, layers: int = 2) -> Path:
    """Save a random tiny LlamaForCausalLM + tokenizer to `path` (a transformers folder)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = make_tokenizer()
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=72,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=8,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # larger than the default init, so that greedy decoding is not flat
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.25)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def make_adapter(
    model: Path, out: Path, *, r: int, targets: list[str], seed: int,
    parameters: list[str] | None = None,
) -> Path:  # fmt: skip
    """A PEFT LoRA adapter of `model` with random A and B (so it changes the replies); with
    `parameters`, on those expert tensors too (PEFT's `target_parameters`)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model)
    peft_model = get_peft_model(
        base,
        LoraConfig(
            r=r,
            lora_alpha=2 * r,
            target_modules=targets,
            init_lora_weights=False,
            target_parameters=parameters,
        ),  # fmt: skip
    )
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.3)
    peft_model.save_pretrained(out)
    return out


def test_tiny_llama_round_trips(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    make_tiny_llama(tmp_path / "m")
    tok = AutoTokenizer.from_pretrained(tmp_path / "m")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert model.config.num_attention_heads == 9 and model.config.num_key_value_heads == 3
    text = "whether 'tis nobler in the mind"
    assert tok.decode(tok(text)["input_ids"]) == text  # corpus words: nothing is unknown
    assert "<|im_start|>assistant" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
