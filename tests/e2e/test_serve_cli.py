"""`quantmesh serve` refuses what it can check before any worker starts: one line, exit code 2.

One refusal runs as a user starts the command (its own process); the others call the CLI's
`main()` in this process (`refused`: the launch is a tripwire), since every check runs in the
launching process before any worker could start.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from quantmesh.cli.main import main

from .test_cli_common import cli, make_adapter, make_tiny_llama, refused


@pytest.mark.slow  # one CLI start
def test_serve_refuses_bad_setups_before_starting(tmp_path: Path, capsys, monkeypatch) -> None:
    proc = cli("serve", str(tmp_path / "missing"), fresh=True)
    assert proc.returncode == 2 and "does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr
    with pytest.raises(SystemExit) as e:  # argparse's own usage error
        main(["serve", str(tmp_path), "--adapter", "no-equals-sign"])
    assert e.value.code == 2 and "NAME=DIR" in capsys.readouterr().err
    model = make_tiny_llama(tmp_path / "tiny")
    adapter = make_adapter(model, tmp_path / "a", r=4, targets=["q_proj"], seed=0)
    err = refused(["serve", str(model), "--adapter", f"a={adapter}", "--max-lora-rank", "2"],
                  capsys, monkeypatch)  # fmt: skip
    assert "raise --max-lora-rank to 4" in err, err
    err = refused(["serve", str(model), "--adapter", f"a={tmp_path / 'nope'}"], capsys, monkeypatch)
    assert "--adapter a=" in err and "does not exist" in err
    err = refused(["serve", str(model), "--adapter-dir", str(tmp_path / "none")], capsys,
                  monkeypatch)  # fmt: skip
    assert "--adapter-dir" in err and "no such directory" in err
    err = refused(["serve", str(model), "--api-key", ""], capsys, monkeypatch)
    assert "--api-key is empty" in err, err
    err = refused(["serve", str(model), "--engine", "dynamic", "--prefill-chunk", "64"], capsys,
                  monkeypatch)  # fmt: skip
    assert "--prefill-chunk 64 needs --engine slots or auto" in err, err
    err = refused(["serve", str(model), "--engine", "dynamic", "--cuda-graphs", "captured"],
                  capsys, monkeypatch)  # fmt: skip
    assert "--cuda-graphs captured needs --engine slots or auto" in err, err
    err = refused(["serve", str(model), "--engine", "slots", "--prefill-chunk", "-1"], capsys,
                  monkeypatch)  # fmt: skip
    assert "--prefill-chunk -1; expected >= 0" in err, err
    # the server's packages are imported before a model is loaded
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # `import uvicorn` raises ImportError
    err = refused(["serve", str(model)], capsys, monkeypatch)
    assert "needs uvicorn, not installed here" in err and "quantmesh[serve]" in err, err


@pytest.mark.slow  # a MoE folder, a peft adapter, three checks of the CLI
def test_serve_takes_expert_adapters_and_expert_targets(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """A mixture of experts with an adapter on its expert tensors (PEFT's `target_parameters`):
    every check passes and the workers are launched with the bank's targets (the per-row serving
    itself: tests/distributed/test_serve_bank.py). `--lora-targets` may name expert tensors."""
    from quantmesh.cli import runner
    from quantmesh.cli.plan_cmd import load_skeleton
    from quantmesh.cli.serve import ServeConfig, _lora
    from tests.moe_folders import moe_dir

    model = moe_dir("qwen3_moe", tmp_path / "moe")
    tiny = make_tiny_llama(tmp_path / "tiny")  # its tokenizer: serve checks the folder has one
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).write_bytes((tiny / name).read_bytes())
    adapter = make_adapter(model, tmp_path / "a", r=4, targets=["q_proj"], seed=0,
                           parameters=["mlp.experts.down_proj"])  # fmt: skip
    launched: list[list[str]] = []
    monkeypatch.setattr(runner, "run_workers", lambda n, argv: launched.append(argv) or 0)
    assert main(["serve", str(model), "--adapter", f"a={adapter}"]) == 0
    assert main(["serve", str(model), "--lora-targets", "q_proj,*experts.gate_up_proj"]) == 0
    assert len(launched) == 2
    with pytest.raises(SystemExit):  # a suffix is not a glob: the message shows both forms
        main(["serve", str(model), "--lora-targets", "experts.gate_up"])
    err = capsys.readouterr().err
    assert "expert tensors: down_proj, gate_up_proj (or a glob such as '*experts." in err, err
    cfg = ServeConfig(model=str(model), adapters={"a": str(adapter)})
    lora, slots = _lora(cfg, load_skeleton(str(model))[1])
    assert "*mlp.experts.down_proj" in lora.targets and slots == {"a": 1}
