"""The command line's options come from the library's config dataclasses, once: every field is a
flag with its docstring as help, no flag is written by hand, the TOML keys and the workers' JSON are
the same names, and each rule and each list of names lives in one place (quantmesh.config,
quantmesh.quant.names)."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import re
import subprocess
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from quantmesh import config
from quantmesh.cli import finetune, flags
from quantmesh.cli.errors import CliError
from quantmesh.cli.finetune import FinetuneConfig
from quantmesh.cli.main import build_parser

SRC = Path(__file__).resolve().parents[2] / "src" / "quantmesh"

# The TOML keys (and flags, with dashes) finetune took before its options were generated: a user's
# file or command must keep working.
KEYS_BEFORE = """model data data_format train_on packing output_dir tp dp nproc nnodes node_rank
rdzv_endpoint quant lora_r lora_alpha lora_dropout lora_targets seq_len micro_batch grad_accum lr
weight_decay warmup_steps schedule steps epochs eval_fraction eval_every save_every resume
overwrite seed max_grad_norm pp pp_schedule pp_virtual compile checkpointing offload_activations
tile_tokens checkpoint_blocks loss_chunk_tokens quant_backend fsdp offload_base""".split()
FLAGS_BEFORE = ["--no-packing", "--microbatches", "--no-compile"]  # the hand-written extras


def _finetune_parser() -> argparse.ArgumentParser:
    sub = build_parser()._subparsers._group_actions[0]  # type: ignore[union-attr]
    return sub.choices["finetune"]


def _sections(cls: type, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], type, dict]]:
    """[(path, section class, the section field's metadata)] of every dataclass field, nested."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out.append(((*path, f.name), hints[f.name], dict(f.metadata)))
            out += _sections(hints[f.name], (*path, f.name))
    return out


def test_every_field_of_every_section_is_an_option_with_help() -> None:
    """The option list is the fields, not a list kept beside them: each field of FinetuneConfig
    and of each of its sections (the library's classes among them) is an option, except the ones
    a section's metadata skips, and each has a non-empty help from its docstring."""
    opts = {o.path: o for o in flags.options(FinetuneConfig)}
    sections = _sections(FinetuneConfig)
    want = set()
    for path, cls, meta in [((), FinetuneConfig, {}), *sections]:
        for f in dataclasses.fields(cls):
            here = (*path, f.name)
            if f.name not in meta.get("skip", ()) and here not in {p for p, _, _ in sections}:
                want.add(here)
    assert set(opts) == want
    assert {s[1] for s in sections} >= {
        config.ParallelConfig, config.PipelineConfig, config.LoraConfig, config.TrainConfig
    }  # fmt: skip
    empty = [o.name for o in opts.values() if len(o.help) < 10]
    assert empty == []
    # the skipped fields are set by the command: the LoRA seed is --seed, the stages balanced
    cfg = FinetuneConfig.from_settings({"model": "m", "data": ["d"], "seed": 7})
    assert cfg.lora.seed == 7 and cfg.pipeline.stages is None


def test_the_parser_is_exactly_the_options() -> None:
    """No flag is written by hand: the finetune parser's optional arguments are one per option
    (plus the declared aliases), its only positional the config file."""
    p = _finetune_parser()
    opts = flags.options(FinetuneConfig)
    actions = [a for a in p._actions if not isinstance(a, argparse._HelpAction)]
    assert [a.dest for a in actions if not a.option_strings] == ["config"]
    named = [a for a in actions if a.option_strings]
    assert [a.dest for a in named] == [o.name for o in opts]
    for a, o in zip(named, opts, strict=True):
        extra = set(a.option_strings) - {o.flag, "--no-" + o.flag[2:]}
        assert extra == set(finetune.ALIASES.get(o.name, ())), (o.name, a.option_strings)
        assert a.help and o.help in a.help.replace("%%", "%")
        assert a.default is None  # not given: the TOML file's value or the default stays
    names = {o.name for o in opts}
    assert set(KEYS_BEFORE) <= names
    # the option the CLI did not offer then, and those added since
    assert names - set(KEYS_BEFORE) == {
        "progress",
        "keep_dequantized",
        "keep_dequantized_blocks",
        "lora_rslora",
        "cuda_graphs",
    }
    strings = {s for a in named for s in a.option_strings}
    assert {"--" + k.replace("_", "-") for k in KEYS_BEFORE} | set(FLAGS_BEFORE) <= strings


def test_flags_reach_the_sections() -> None:
    args = build_parser().parse_args(
        ["finetune", "--model", "m", "--data", "a.txt", "b.txt", "--microbatches", "4",
         "--no-packing", "--lora-targets", "q_proj,v_proj", "k_proj", "--pp-schedule", "gpipe",
         "--quant", "nf4", "--no-compile", "--lr", "1e-3", "--no-progress", "--seed", "3"]
    )  # fmt: skip
    cfg = finetune.config_from_args(args)
    assert cfg.data == ["a.txt", "b.txt"] and cfg.packing is False
    assert cfg.train.grad_accum == 4 and cfg.train.lr == 1e-3 and cfg.train.progress is False
    assert cfg.train.pp_schedule == "gpipe" and cfg.parallel.quant == "nf4"
    assert cfg.lora.targets == ["q_proj", "v_proj", "k_proj"] and cfg.lora.seed == 3
    assert cfg.activations.compile is False
    assert FinetuneConfig.from_json(cfg.to_json()) == cfg  # what the workers rebuild
    assert set(json.loads(cfg.to_json())) == {o.name for o in flags.options(FinetuneConfig)}


def test_toml_keys_are_the_option_names(tmp_path: Path) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text(
        'model = "m"\ndata = "d.txt"\ntp = 2\nnproc = 4\nlora_r = 8\nlora-alpha = 16\n'
        "pp_virtual = 1\nlr = 1\ncheckpointing = true\ntile_tokens = 4096\n"
    )
    args = build_parser().parse_args(["finetune", str(toml), "--lora-r", "4"])
    cfg = finetune.config_from_args(args)
    assert (cfg.parallel.tp, cfg.parallel.dp, cfg.launch.nproc) == (2, 2, 4)
    assert cfg.lora.r == 4 and cfg.lora.alpha == 16.0  # the flag over the file
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)
    assert cfg.activations.tile_tokens == 4096 and cfg.data == ["d.txt"]

    toml.write_text('model = "m"\nlora_rank = 8\n')
    with pytest.raises(CliError) as e:
        finetune.load_config(toml)
    msg = str(e.value)
    assert f"{toml}: unknown key 'lora_rank'; did you mean 'lora_r'?" in msg
    assert "valid keys: model, data, " in msg and "loss_chunk_tokens" in msg
    toml.write_text('model = "m"\n[train]\nlr = 1\n')
    with pytest.raises(CliError, match=r"\[train\] is a table; write flat `key = value` lines"):
        finetune.load_config(toml)
    toml.write_text('model = "m"\ndata = ["d"]\nlr = "fast"\n')
    args = build_parser().parse_args(["finetune", str(toml)])
    with pytest.raises(CliError, match=re.escape(f"{toml}: lr='fast'; expected a number")):
        finetune.config_from_args(args)


def test_a_model_folder_or_data_file_in_the_settings_place_names_its_flag(tmp_path: Path) -> None:
    """`quantmesh finetune FOLDER` (as `generate FOLDER`) was told the "config file" did not
    exist; a data file there was parsed as TOML."""
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with pytest.raises(CliError, match=re.escape(f"is a model folder, and the positional "
                                                 f"argument is a TOML settings file; pass "
                                                 f"--model {model}")):  # fmt: skip
        finetune.load_config(model)
    with pytest.raises(CliError, match=re.escape(f"pass --model or --data {tmp_path}")):
        finetune.load_config(tmp_path)
    data = tmp_path / "chat.jsonl.gz"
    data.write_bytes(b"")
    with pytest.raises(CliError, match=re.escape(f"looks like training data, and the positional "
                                                 f"argument is a TOML settings file; pass "
                                                 f"--data {data}")):  # fmt: skip
        finetune.load_config(data)
    with pytest.raises(CliError, match="config file .* does not exist; check the path"):
        finetune.load_config(tmp_path / "run.toml")


@pytest.mark.parametrize(
    ("settings", "error", "text"),
    [
        ({"tp": True}, CliError, "tp=True; expected an integer"),
        ({"steps": "3"}, CliError, "steps='3'; expected an integer (or leave it unset)"),
        ({"data": [1]}, CliError, "data=[1]; expected a list of strings"),
        ({"quant": "fp4", "quant_backend": "torchao"}, config.QuantError, "torchao has no fp4"),
        ({"quant": "nf4", "fsdp": True}, config.FsdpError, "cannot shard bitsandbytes nf4"),
        ({"fsdp": True, "pp": 2, "nproc": 2}, config.FsdpError, "fsdp=True with pp=2"),
        ({"offload_base": True}, config.FsdpError, "--offload-base needs --fsdp"),
        ({"pp_schedule": "zb"}, config.TrainError, "pp_schedule='zb'; use one of gpipe, 1f1b"),
        ({"schedule": "step"}, config.TrainError, "schedule='step'; use one of cosine"),
        ({"lr": 0}, config.TrainError, "lr=0.0; expected a positive learning rate"),
        ({"lora_dropout": 1.0}, config.LoraError, "LoRA dropout=1.0; use a value in [0, 1)"),
        ({"pp": 2, "nproc": 2}, config.PipelineError,
         "--pp-schedule 1f1b needs --grad-accum >= --pp: 1 < 2; pass --grad-accum 2 or "
         "--pp-schedule gpipe"),
        ({"pp_virtual": 2}, config.PipelineError, "--pp-schedule interleaved1f1b with --pp-virtual 2"),
        ({"pp_schedule": "interleaved1f1b"}, config.PipelineError, "--pp-virtual 2 or more"),
        ({"tile_tokens": 8}, CliError, "--tile-tokens needs --checkpointing"),
    ],
)  # fmt: skip
def test_each_rule_is_the_library_s(settings: dict, error: type, text: str) -> None:
    """A rule of a library class is raised by that class (the CLI keeps no copy of it); the
    command line's own rules (its sections, the process counts) stay CliErrors."""
    with pytest.raises(error) as e:
        FinetuneConfig.from_settings({"model": "m", "data": ["d"], **settings})
    assert text in str(e.value)
    assert isinstance(e.value, CliError) == (error is CliError)  # no CLI copy of a library rule


def test_the_cli_s_rule_names_match_the_library_s() -> None:
    """The library's own callers get the same rule: train_step's schedule check is the CLI's."""
    with pytest.raises(config.PipelineError, match="microbatches >= pp ranks"):
        config.check_pp_schedule("1f1b", pp=4, microbatches=2)
    config.check_pp_schedule("gpipe", pp=4, microbatches=1)
    config.check_pp_schedule("interleaved1f1b", pp=2, microbatches=2)  # virtual not known here
    from quantmesh.lora import adapter as lora
    from quantmesh.parallel import fsdp
    from quantmesh.pipeline import cut
    from quantmesh.quant import base
    from quantmesh.train import loop, step

    # the classes live in config; their old homes re-export them (imports keep working)
    assert lora.LoraConfig is config.LoraConfig and lora.LoraError is config.LoraError
    assert cut.PipelineConfig is config.PipelineConfig and cut.PipelineError is config.PipelineError
    assert loop.TrainConfig is config.TrainConfig and step.TrainError is config.TrainError
    assert fsdp.FsdpError is config.FsdpError and base.QuantError is config.QuantError


def _string_tuples(path: Path) -> list[tuple[int, set[str]]]:
    """(line, the strings) of every tuple / list literal of strings in a source file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Tuple, ast.List)):
            vals = {e.value for e in node.elts if isinstance(e, ast.Constant)}
            if vals and all(isinstance(v, str) for v in vals):
                out.append((node.lineno, vals))
    return out


@pytest.mark.parametrize(
    ("names", "home"),
    [
        ({"gpipe", "1f1b", "interleaved1f1b"}, "config.py"),
        ({"cosine", "linear", "constant"}, "config.py"),
        ({"bitsandbytes", "torchao"}, "quant/names.py"),
        ({"nf4", "fp4", "int8"}, "quant/names.py"),
    ],
)
def test_each_list_of_names_is_written_once(names: set[str], home: str) -> None:
    """The pipeline schedules, learning-rate schedules, quant backends and formats: one tuple
    each, imported everywhere else (a literal of all of them, with at most "none" or "auto"
    besides, is another copy)."""
    copies = [
        f"{p.relative_to(SRC)}:{line}"
        for p in sorted(SRC.rglob("*.py"))
        for line, vals in _string_tuples(p)
        if names <= vals <= names | {"none", "auto"}
    ]
    assert [c.split(":")[0] for c in copies] == [home], copies


def test_building_the_parser_imports_no_torch() -> None:
    """The options come from torch-free classes: `quantmesh --help` stays fast."""
    code = (
        "import sys\nfrom quantmesh.cli.main import build_parser\nbuild_parser()\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


# --- the generator on classes of its own -----------------------------------------------------

CHOICES = ("a", "b")


@dataclass(kw_only=True)
class _Inner:
    """A section."""

    size: int = 2
    """How big; 100% of it."""
    secret: int = 0
    """Set by the owner, no flag."""


@dataclass(kw_only=True)
class _Demo:
    flag: bool = False
    """A switch."""
    maybe: bool | None = None
    """Three states."""
    names: list[str] = field(default_factory=list)
    """Several names."""
    count: int | None = None
    """An optional count."""
    ratio: float = 0.5
    """A share."""
    pick: str = field(default="a", metadata={"choices": CHOICES})
    """One of CHOICES."""
    inner: _Inner = field(default_factory=_Inner, metadata={"prefix": "in_", "skip": ("secret",)})
    """The inner section."""


def _demo_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(exit_on_error=False)
    flags.add_flags(p, _Demo, aliases={"count": ("-n",)})
    return p


def test_generated_flags_by_type() -> None:
    p = _demo_parser()
    none = vars(p.parse_args([]))
    assert none == dict.fromkeys(["flag", "maybe", "names", "count", "ratio", "pick", "in_size"])
    a = p.parse_args(["--flag", "--no-maybe", "--names", "x", "y", "-n", "3", "--ratio", "1",
                      "--pick", "b", "--in-size", "5"])  # fmt: skip
    assert (a.flag, a.maybe, a.names, a.count, a.ratio, a.pick, a.in_size) == (
        True, False, ["x", "y"], 3, 1.0, "b", 5
    )  # fmt: skip
    assert p.parse_args(["--no-flag", "--maybe"]).flag is False
    with pytest.raises(argparse.ArgumentError, match="invalid choice: 'c'"):
        p.parse_args(["--pick", "c"])
    with pytest.raises(argparse.ArgumentError, match="invalid int value"):
        p.parse_args(["--count", "x"])
    assert p.parse_known_args(["--secret", "1"])[1] == ["--secret", "1"]  # skipped: no flag
    text = p.format_help()
    assert "--flag, --no-flag" in text and "--maybe, --no-maybe" in text
    assert "Several names." in text and "(default: 0.5)" in text and "100% of it" in text
    assert "inner:" in text and "The inner section." in text  # the section's group


def test_build_and_flatten_round_trip() -> None:
    d = flags.build(_Demo, {"flag": True, "names": "one", "ratio": 2, "in_size": 7})
    assert d == _Demo(flag=True, names=["one"], ratio=2.0, inner=_Inner(size=7))
    assert flags.flatten(d) == {
        "flag": True, "maybe": None, "names": ["one"], "count": None, "ratio": 2.0, "pick": "a",
        "in_size": 7,
    }  # fmt: skip
    assert flags.build(_Demo, flags.flatten(d)) == d
    for bad, text in [({"flag": "yes"}, "flag='yes'; expected true or false"),
                      ({"count": 1.5}, "count=1.5; expected an integer (or leave it unset)"),
                      ({"names": [1]}, "names=[1]; expected a list of strings"),
                      ({"in_secret": 1}, "unknown key 'in_secret'")]:  # fmt: skip
        with pytest.raises(CliError, match=re.escape(text)):
            flags.build(_Demo, bad)


def test_the_generator_refuses_what_it_cannot_name() -> None:
    @dataclass
    class Twice:
        inner: _Inner = field(default_factory=_Inner)
        size: int = 1
        """Clashes with inner's size."""

    with pytest.raises(TypeError, match="two options named 'size'"):
        flags.options(Twice)

    @dataclass
    class Odd:
        pair: tuple[int, int] = (1, 2)
        """No flag takes a tuple."""

    with pytest.raises(TypeError, match="has no flag"):
        flags.options(Odd)
