"""The README's examples, run as written on a tiny model: its CLI commands in order, and the Python
example (examples/quickstart.py, which the README quotes verbatim).

The README names the demo's SmolLM2 folder and examples/finetune.toml; here the folder is a tiny
random Llama of the same head layout, and the TOML is examples/finetune.toml with only its
`model` and `data` lines pointed at tiny files. Every other setting is the example's own.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest

from .test_cli_common import CORPUS, REPO, cli, make_tiny_llama, peft_chat_reply

pytestmark = pytest.mark.slow  # make test-fast leaves this module out

README = REPO / "README.md"
SMOLLM2 = "~/.cache/quantmesh/SmolLM2-135M-Instruct"


def readme_commands() -> list[list[str]]:
    """`$ quantmesh ...` lines of the README's console blocks, in order, as argv lists."""
    text = README.read_text()
    blocks = re.findall(r"```console\n(.*?)```", text, flags=re.S)
    lines = [ln[2:] for b in blocks for ln in b.splitlines() if ln.startswith("$ quantmesh ")]
    return [shlex.split(ln)[1:] for ln in lines]


def _metrics(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding the tiny model, its data and the example TOML pointed at them."""
    d = tmp_path_factory.mktemp("readme")
    make_tiny_llama(d / "tiny")
    (d / "plays.txt").write_text(CORPUS * 60)
    toml = (REPO / "examples" / "finetune.toml").read_text()
    toml, n1 = re.subn(r"(?m)^model = .*$", f'model = "{d / "tiny"}"', toml)
    toml, n2 = re.subn(r"(?m)^data = .*$", f'data = ["{d / "plays.txt"}"]', toml)
    assert n1 == n2 == 1, "examples/finetune.toml must keep one `model =` and one `data =` line"
    (d / "finetune.toml").write_text(toml)
    return d


def _as_test(argv: list[str], d: Path) -> list[str]:
    out = []
    for a in argv:
        a = a.replace(SMOLLM2, str(d / "tiny"))
        out.append(str(d / "finetune.toml") if a == "examples/finetune.toml" else a)
    return out


@pytest.fixture(scope="module")
def readme_run(workdir: Path) -> list[tuple[list[str], Any, list[dict]]]:
    """The README's commands run in order, once for the module: (argv, process, the metrics file's
    rows right after it). Stops at the first command that fails (the later ones build on it)."""
    metrics = workdir / "quantmesh-out" / "metrics.jsonl"
    ran = []
    for argv in readme_commands():
        proc = cli(*_as_test(argv, workdir), cwd=workdir)
        ran.append((argv, proc, _metrics(metrics) if metrics.is_file() else []))
        if proc.returncode != 0:
            break
    return ran


def test_the_readme_commands_run_in_order(workdir: Path, readme_run: list) -> None:
    assert [c[0] for c in readme_commands()] == ["plan", "finetune", "finetune", "generate"]
    out = workdir / "quantmesh-out"
    first_run: list[dict] = []
    for argv, proc, rows in readme_run:
        assert proc.returncode == 0, (argv, proc.stdout[-2000:], proc.stderr[-3000:])
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
        if argv[0] == "plan":
            assert "Plan for tp=2" in proc.stdout and "total" in proc.stdout
            # 9 heads / 3 KV heads over 2 ranks: 2 + 1 KV groups, so q_proj is 6 + 3 heads of 8
            assert re.search(
                r"self_attn\.q_proj \(x2\)\s+Linear\s+colwise\s+48x72/24x72", proc.stdout
            )
        elif argv[0] == "finetune" and "--resume" not in argv:
            assert [r["step"] for r in rows] == list(range(1, 31))
            assert [r["step"] for r in rows if "eval_loss" in r] == [10, 20, 30]
            for name in ("adapter/adapter_config.json", "adapter/adapter_model.safetensors"):
                assert (out / name).is_file(), name
            for step in (10, 20, 30):
                assert (out / f"checkpoints/step-{step:06d}/state").is_dir()
            assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
            first_run = rows
        elif argv[0] == "finetune":
            steps = int(argv[argv.index("--steps") + 1])
            assert first_run, "the resumed run came before the first one"
            assert [r["step"] for r in rows] == list(range(1, steps + 1))
            assert rows[: len(first_run)] == first_run  # history kept, then continued
        else:  # generate: the same text as transformers + peft on one process, unsharded
            assert proc.stdout.strip() == _peft_reference(workdir, argv), proc.stdout
    assert len(readme_run) == len(readme_commands())  # every command ran


def _peft_reference(d: Path, argv: list[str]) -> str:
    """What plain transformers + peft generate for the README's generate command (greedy)."""
    assert "--quant" not in argv and "--temperature" not in argv, argv
    opt = {argv[i]: argv[i + 1] for i in range(1, len(argv) - 1) if argv[i].startswith("--")}
    reply = peft_chat_reply(
        d / "tiny", d / opt["--adapter"], opt["--prompt"],
        max_new_tokens=int(opt.get("--max-new-tokens", 128)),
        repetition_penalty=float(opt.get("--repetition-penalty", 1.0)),
    )  # fmt: skip
    return reply.strip()


def test_resume_repeats_the_uninterrupted_run_exactly(workdir: Path, readme_run: list) -> None:
    """Resumes the README's first fine-tune (run by the fixture, whatever ran before) from its
    step-20 checkpoint: steps 21-30 repeat that run's losses."""
    out = workdir / "quantmesh-out"
    first = next(
        rows for argv, proc, rows in readme_run if argv[0] == "finetune" and "--resume" not in argv
    )
    assert (out / "checkpoints/step-000020").is_dir(), "the README's fine-tune saved no step 20"
    original = {r["step"]: r["loss"] for r in first}
    proc = cli(
        "finetune",
        str(workdir / "finetune.toml"),
        "--resume",
        str(out / "checkpoints/step-000020"),
        "--output-dir",
        str(workdir / "resumed"),
        cwd=workdir,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = _metrics(workdir / "resumed/metrics.jsonl")
    assert [r["step"] for r in resumed] == list(range(21, 31))
    # Same layout, same data order, RNG reseeded per step: the losses repeat to the last digit.
    assert [r["loss"] for r in resumed] == [original[s] for s in range(21, 31)]


def test_resuming_a_finished_run_says_nothing_is_left(workdir: Path, readme_run: list) -> None:
    """A run resumed from its last checkpoint has no step left: it is refused with the fix, not
    reported as "done: loss nan, 0 tokens/s"."""
    out = workdir / "quantmesh-out"
    assert (out / "checkpoints/step-000030").is_dir(), "the README's fine-tune saved no step 30"
    proc = cli("finetune", str(workdir / "finetune.toml"), "--resume",
               str(out / "checkpoints/step-000030"), "--output-dir", str(workdir / "again"),
               cwd=workdir)  # fmt: skip
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert (
        "the checkpoint is at step 30, this run's last step: nothing is left to train; raise "
        "steps (or epochs)" in proc.stderr
    ), proc.stderr[-3000:]


def test_the_python_example_is_the_file_and_runs(workdir: Path) -> None:
    script = REPO / "examples" / "quickstart.py"
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert any(b.strip() and b in script.read_text() for b in blocks), (
        "the README's Python example must be examples/quickstart.py (after its docstring)"
    )
    proc = cli(
        "run", "--nproc", "2", str(script), str(workdir / "tiny"), str(workdir / "plays.txt"),
        cwd=workdir,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"step \d+\s+loss ([\d.]+)", proc.stdout)]
    assert len(losses) == 10, proc.stdout
    assert losses[-1] < losses[0], losses  # 10 steps at lr 2e-3 on a repeated text
    assert (workdir / "quickstart-adapter" / "adapter_config.json").is_file()
