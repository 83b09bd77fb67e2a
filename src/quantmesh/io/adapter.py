"""LoRA adapters in PEFT's format: save_adapter, load_adapter (any tp size), adapter_lora_config.

What `peft.PeftModel.from_pretrained` reads: `adapter_config.json` (peft_type LORA, r, lora_alpha,
lora_dropout, target_modules, bias "none", fan_in_fan_out for Conv1D bases, task_type CAUSAL_LM
for causal LMs, base_model_name_or_path) and `adapter_model.safetensors` holding the unsharded
`base_model.model.<module fqn>.lora_A.weight` (r, in) and `...lora_B.weight` (out, r). The A/B
layout is the same for Linear and Conv1D bases (only the base weight is transposed in a Conv1D).

Example:
    >>> qm.save_adapter(model, "out/adapter")   # doctest: +SKIP
    >>> qm.load_adapter(model4, "out/adapter")  # doctest: +SKIP  (a model at another tp size)
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import lora_scale
from ..lora.adapter import LoraAdapter, LoraConfig, LoraError
from ..lora.peft import inner_model
from ..parallel.fsdp import fill_from_whole
from ..parallel.state import parallel_state
from ..tp.experts import ShardedExperts
from ..tp.gather import tp_sharded
from ..tp.layers import ShardedModule, sharded_modules
from . import save as saving  # saving._save_file is looked up at call time (tests stop it)
from .reader import CheckpointReader, open_checkpoint
from .save import _owned, _Rank0Writer, agreed, collective_save, full_tensor, gathers_here

__all__ = ["save_adapter", "load_adapter", "adapter_lora_config"]

PEFT_PREFIX = "base_model.model."
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


# ---- the adapter config ------------------------------------------------------------------------------


def _shape_problems(
    fqn: str, r: int, in_full: int, out_full: int, keys: Any, reader: Any
) -> list[str]:
    """What is missing or mis-shaped among `fqn`'s lora_A (r x in) and lora_B (out x r) in an
    adapter file (`keys`: its tensor names; `reader`: gives their shapes)."""
    problems = []
    for name, want in (("lora_A.weight", (r, in_full)), ("lora_B.weight", (out_full, r))):
        problems += _key_problems(f"{fqn}.{name}", want, keys, reader)
    return problems


def _key_problems(
    key: str, want: tuple[int, ...], keys: Any, reader: Any, of: str = ""
) -> list[str]:
    """[what is wrong with tensor `key` of an adapter file]: missing, or not of shape `want`
    (`of`: what the tensor is, said when it is missing)."""
    if key not in keys:
        return [f"{key} missing{of}"]
    if tuple(reader.shape(key)) != want:
        return [f"{key}: adapter {tuple(reader.shape(key))}, model {want}"]
    return []


def _lora_modules(model: nn.Module) -> dict[str, ShardedModule]:
    """{fqn: layer} of the layers holding a trainable LoraAdapter."""
    return {f: m for f, m in sharded_modules(model).items() if m.lora is not None}


def _lora(m: ShardedModule) -> LoraAdapter:
    ad = m.lora
    assert ad is not None  # one of _lora_modules
    return ad


def _expert_modules(model: nn.Module) -> dict[str, ShardedExperts]:
    """{fqn: experts module} of the experts modules with per-expert adapters."""
    return {
        f: m
        for f, m in sharded_modules(model).items()
        if isinstance(m, ShardedExperts) and len(m.expert_lora) > 0
    }


def expert_adapter_keys(m: ShardedExperts) -> dict[str, tuple[str, str]]:
    """{PEFT key without prefix: (tensor name, "lora_A" / "lora_B")} of an experts module's
    adapters. PEFT wraps each targeted tensor of one module in a wrapper of its own, the first
    registered innermost, so the i-th of k adapted tensors sits under k-1-i `base_layer.` levels.

    Example:
        >>> sorted(expert_adapter_keys(experts))  # doctest: +SKIP
        ['m.experts.base_layer.lora_A.weight', 'm.experts.base_layer.lora_B.weight',
         'm.experts.lora_A.weight', 'm.experts.lora_B.weight']
    """
    return peft_expert_keys(m.fqn, [t for t in m.tensors if t in m.expert_lora])


def peft_expert_keys(fqn: str, order: list[str]) -> dict[str, tuple[str, str]]:
    """{PEFT key without prefix: (tensor name, "lora_A" / "lora_B")} of the adapters of tensors
    `order` (in the module's registration order) of module `fqn`.

    Example:
        >>> sorted(peft_expert_keys("e", ["up", "down"]))
        ['e.base_layer.lora_A.weight', 'e.base_layer.lora_B.weight', 'e.lora_A.weight', 'e.lora_B.weight']
    """
    out = {}
    for i, t in enumerate(order):
        for ab in ("lora_A", "lora_B"):
            out[f"{fqn}.{'base_layer.' * (len(order) - 1 - i)}{ab}.weight"] = (t, ab)
    return out


def targets_parameter(target_parameters: list[str], name: str) -> bool:
    """True when PEFT's `target_parameters` select parameter `name` (a full name or a suffix).

    Example:
        >>> targets_parameter(["mlp.experts.down_proj"], "model.layers.0.mlp.experts.down_proj")
        True
    """
    return any(name == t or name.endswith(f".{t}") for t in target_parameters if t)


def _file_params(
    mods: dict[str, ShardedModule], experts: dict[str, ShardedExperts]
) -> Iterator[tuple[str, ShardedModule, str]]:
    """(key in a PEFT file, without its prefix; module; the module's parameter) of every adapter
    tensor: save_adapter and load_adapter walk the same list."""
    for fqn, m in mods.items():
        for name in ("lora_A.weight", "lora_B.weight"):
            yield f"{fqn}.{name}", m, name
    for e in experts.values():
        for key, (t, ab) in expert_adapter_keys(e).items():
            yield key, e, f"expert_lora.{t}.{ab}.weight"


def expert_shapes(m: ShardedExperts, t: str, r: int) -> dict[str, tuple[int, int]]:
    """Whole shapes of tensor `t`'s adapter of rank `r`: A (E*r, in), B (out, E*r).

    Example:
        >>> expert_shapes(experts, "down_proj", 2)["lora_A"]  # doctest: +SKIP
        (8, 24)
    """
    er = m.num_experts * r
    spec = m.tensors[t]
    full = m.full_shapes[t]
    return {"lora_A": (er, full[spec.in_dim]), "lora_B": (full[spec.out_dim], er)}


def _peft_targets(model: nn.Module, targets: set[str]) -> list[str] | str:
    """Bare module names when they select exactly `targets` in the plain model, else a regex."""
    leaves = sorted({f.rsplit(".", 1)[-1] for f in targets})
    lora_children = {f"{f}.{c}" for f in targets for c in ("lora_A", "lora_B", "lora_dropout")}
    from ..pipeline.parts import module_names  # other pipeline stages' modules count too

    covered = {
        n
        for n in module_names(model)
        if n and n.rsplit(".", 1)[-1] in leaves and n not in lora_children
    }
    if covered == targets:
        return leaves
    return "(" + "|".join(re.escape(f) for f in sorted(targets)) + ")"  # PEFT: re.fullmatch


def _task_type(model: nn.Module) -> str | None:
    if not type(model).__module__.startswith("transformers."):
        return None
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return None
    return (
        "CAUSAL_LM" if type(model).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() else None
    )


def _rslora(model: nn.Module) -> bool:
    """Whether the model's adapters are rank-stabilized (LoraConfig.rslora)."""
    st = parallel_state(model, required=False)
    return bool(getattr(st.lora, "rslora", False)) if st is not None else False


def _alpha(model: nn.Module, scale: float, r: int) -> float | int:
    """lora_alpha as the user gave it (scale = alpha / r, or alpha / sqrt(r) for rsLoRA), not
    re-derived through a float product."""
    st = parallel_state(model, required=False)
    cfg = st.lora if st is not None else None
    rs = _rslora(model)
    alpha = (
        cfg.alpha
        if isinstance(cfg, LoraConfig) and math.isclose(lora_scale(cfg.alpha, r, rs), scale)
        else None
    )
    alpha = round(scale * (math.sqrt(r) if rs else r), 9) if alpha is None else alpha
    return int(alpha) if float(alpha).is_integer() else float(alpha)


def _adapter_config(
    model: nn.Module,
    mods: dict[str, ShardedModule],
    base: str | None,
    experts: dict[str, ShardedExperts] | None = None,
) -> dict:
    experts = _expert_modules(model) if experts is None else experts
    ranks: list[tuple[str, int, float]] = []  # (module, r, scale) of every adapter
    for f, m in mods.items():
        ranks.append((f, _lora(m).r, _lora(m).scale))
    for f, e in experts.items():
        for t, ead in e.expert_adapters().items():
            ranks.append((f"{f}.{t}", ead.r, ead.scale))
    first_name, r, scale = ranks[0]
    for f, r_f, s_f in ranks:
        if r_f != r or not math.isclose(s_f, scale):
            raise LoraError(
                f"LoRA of {f} has r={r_f}, scale={s_f}, but {first_name} has r={r}, "
                f"scale={scale}; a PEFT adapter_config holds one r and one alpha: save adapters "
                "of one rank"
            )
    dropout = _lora(next(iter(mods.values()))).dropout if mods else 0.0
    if base is None:
        cfg = getattr(model, "config", None)
        base = getattr(cfg, "_name_or_path", None) or getattr(model, "name_or_path", None) or None
    return {
        "peft_type": "LORA",
        "task_type": _task_type(model),
        "base_model_name_or_path": base,
        "revision": None,
        "inference_mode": True,
        "r": r,
        "lora_alpha": _alpha(model, scale, r),
        "lora_dropout": dropout,
        "target_modules": _peft_targets(model, set(mods)) if mods else [],
        "target_parameters": sorted(f"{f}.{t}" for f, e in experts.items() for t in e.expert_lora)
        or None,
        "exclude_modules": None,
        "bias": "none",
        "fan_in_fan_out": any(m.kind.name == "Conv1D" for m in mods.values()),
        "use_rslora": _rslora(model),
        "use_dora": False,
        "lora_bias": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "auto_mapping": None,
    }


def save_adapter(
    model: nn.Module, path: str | os.PathLike, *, base_model_name_or_path: str | None = None
) -> None:
    """Write the model's LoRA adapters as a PEFT adapter folder (unsharded, any tp size).

    Collective: every rank calls it; global rank 0 writes, atomically; all return after the write.

    Args:
        base_model_name_or_path: recorded in adapter_config.json; default: the model's
            `config._name_or_path` (set by `qm.from_pretrained`) or None.

    Example:
        >>> qm.save_adapter(model, "out/adapter")                     # doctest: +SKIP
        >>> peft.PeftModel.from_pretrained(plain_model, "out/adapter")  # doctest: +SKIP
    """
    model = inner_model(model)  # a PeftModel root: names as peft writes them (no double prefix)

    def check() -> tuple[dict, dict]:
        mods = _lora_modules(model)
        if not mods and not _expert_modules(model):
            raise LoraError(
                f"{type(model).__name__} has no LoRA adapters to save; parallelize it with "
                "lora=qm.LoraConfig(...) (or load_adapter into such a model) first"
            )
        return mods, _adapter_config(model, mods, base_model_name_or_path)

    st = parallel_state(model, required=False)
    pp_mesh = st.mesh if st is not None and st.mesh.pp > 1 else None
    if pp_mesh is not None:  # the file and its config cover every pipeline stage's adapters
        from ..pipeline.parts import stage_lora_config

        mods, config = agreed(
            lambda: stage_lora_config(
                model,
                _lora_modules(model),
                lambda m, mods: _adapter_config(m, mods, base_model_name_or_path),
                _peft_targets,
                other_adapters=bool(_expert_modules(model)),
            ),
            "save_adapter",
        )
    else:
        mods, config = agreed(check, "save_adapter")

    def produce(w: _Rank0Writer) -> None:
        if not gathers_here(model):
            return
        tensors = {}
        # at pp > 1 the first tp rank of each stage keeps its part and sends it to global rank 0
        keep = bool(w) or (pp_mesh is not None and pp_mesh.tp_rank == 0)
        # gathered one tensor at a time; adapters are small
        for key, m, name in _file_params(mods, _expert_modules(model)):
            t = full_tensor(m, name)
            if keep:
                tensors[f"{PEFT_PREFIX}{key}"] = _owned(t)
        if pp_mesh is not None and pp_mesh.tp_rank == 0:
            from ..pipeline.parts import gather_stages

            tensors = {k: v for part in gather_stages(tensors, pp_mesh) for k, v in part.items()}
        w.run(saving._save_file, tensors, w.folder / ADAPTER_WEIGHTS if w.folder else None)
        w.json(ADAPTER_CONFIG, config)

    collective_save(path, produce, "save_adapter")


def _peft_key(key: str) -> str:
    """PEFT file key -> model key: drop the wrapper prefix and an adapter name (".default")."""
    key = key.removeprefix(PEFT_PREFIX)
    return re.sub(r"\.(lora_[AB])\.(?!weight$)[^.]+\.weight$", r".\1.weight", key)


def _read_adapter_config(path: Path) -> dict:
    cfg_path = path / ADAPTER_CONFIG
    if not cfg_path.is_file():
        raise FileNotFoundError(
            f"{path} has no {ADAPTER_CONFIG}; expected a PEFT adapter folder (adapter_config.json "
            "+ adapter_model.safetensors), as written by qm.save_adapter or PeftModel.save_pretrained"
        )
    cfg: dict = json.loads(cfg_path.read_text())
    bad = []
    if cfg.get("peft_type") != "LORA":
        bad.append(f"peft_type={cfg.get('peft_type')!r} (expected 'LORA')")
    for flag in ("use_dora", "lora_bias"):
        if cfg.get(flag):
            bad.append(f"{flag}=true")
    if cfg.get("bias", "none") != "none":
        bad.append(f"bias={cfg['bias']!r} (expected 'none')")
    if cfg.get("modules_to_save"):
        bad.append(f"modules_to_save={cfg['modules_to_save']}")
    for pat in ("rank_pattern", "alpha_pattern"):
        if cfg.get(pat):
            bad.append(f"{pat}={cfg[pat]}")
    if bad:
        raise LoraError(
            f"{cfg_path} uses LoRA features quantmesh does not load: {', '.join(bad)}; quantmesh "
            "loads plain LoRA and rsLoRA (one r and alpha, no bias, no DoRA, no extra saved "
            "modules)"
        )
    return cfg


def _adapter_weights(path: Path) -> Path:
    for name in (ADAPTER_WEIGHTS, "adapter_model.bin"):
        if (path / name).is_file():
            return path / name
    raise FileNotFoundError(f"{path} has no {ADAPTER_WEIGHTS} (nor adapter_model.bin)")


def adapter_lora_config(path: str | os.PathLike) -> LoraConfig:
    """The LoraConfig that builds a model fitting the adapter at `path` (targets: exact names).

    Example:
        >>> qm.parallelize(model, mesh, lora=adapter_lora_config("out/adapter"))  # doctest: +SKIP
        >>> qm.load_adapter(model, "out/adapter")                                # doctest: +SKIP
    """
    path = Path(path)
    cfg = _read_adapter_config(path)
    params = list(cfg.get("target_parameters") or [])
    owners = [t.rpartition(".")[0] for t in params]
    with open_checkpoint(_adapter_weights(path), key_map=_peft_key) as reader:
        fqns = sorted(
            {
                k.rsplit(".", 2)[0]
                for k in reader.keys()
                if ".lora_" in k and not _is_expert_key(k, owners)
            }
        )
    # PEFT selects a parameter by its full name or a suffix of it: one glob matches both
    fqns += [f"*{t}" for t in params]
    return LoraConfig(
        r=int(cfg["r"]), alpha=cfg["lora_alpha"], dropout=float(cfg.get("lora_dropout") or 0.0),
        targets=fqns, rslora=bool(cfg.get("use_rslora")),
    )  # fmt: skip


def _key_module(key: str) -> str:
    """The module an adapter file key belongs to (PEFT's `base_layer` levels dropped)."""
    return key.rsplit(".", 2)[0].replace(".base_layer", "")


def _is_expert_key(key: str, owners: list[str]) -> bool:
    """True when file key `key` is an adapter of an expert tensor of one of `owners` (modules
    named in target_parameters, as full names or suffixes)."""
    module = _key_module(key)
    return any(module == o or module.endswith(f".{o}") for o in owners if o)


def _check_adapter(
    model: nn.Module, reader: CheckpointReader, cfg: dict, mods: dict[str, ShardedModule]
) -> None:
    keys = set(reader.keys())
    r = int(cfg["r"])
    problems = []
    expert_keys: dict[str, tuple[ShardedExperts, str, str]] = {}
    for e in _expert_modules(model).values():
        for key, (t, ab) in expert_adapter_keys(e).items():
            expert_keys[key] = (e, t, ab)
    for key, (e, t, ab) in expert_keys.items():
        want = expert_shapes(e, t, e.expert_adapters()[t].r)[ab]
        problems += _key_problems(
            key, want, keys, reader, f" (the adapter of expert tensor {e.fqn}.{t})"
        )
    owners = [t.rpartition(".")[0] for t in cfg.get("target_parameters") or []]
    st = parallel_state(model, required=False)
    elsewhere: set[str] = set()  # module names other pipeline stages hold: theirs to load
    if st is not None and st.mesh.pp > 1:
        from ..pipeline.parts import elsewhere_keys

        elsewhere = {k.rsplit(".", 1)[0] for k in elsewhere_keys(model)}
    if extra_experts := sorted(
        k
        for k in keys
        if _is_expert_key(k, owners) and k not in expert_keys and _key_module(k) not in elsewhere
    ):
        problems.append(f"expert adapters the model has no LoRA for: {extra_experts[:10]}")
    keys -= {k for k in keys if k in expert_keys or _is_expert_key(k, owners)}
    in_file = {k.rsplit(".", 2)[0] for k in keys if re.search(r"\.lora_[AB]\.weight$", k)}
    other = sorted(k for k in keys if not re.search(r"\.lora_[AB]\.weight$", k))
    if other:
        problems.append(f"tensors other than lora_A/lora_B: {other[:10]}")
    in_file -= elsewhere
    if missing := sorted(in_file - set(mods)):
        problems.append(f"adapter modules without LoRA in the model: {missing[:10]}")
    if extra := sorted(set(mods) - in_file):
        problems.append(f"model LoRA modules absent from the adapter: {extra[:10]}")
    for fqn in sorted(in_file & set(mods)):
        m = mods[fqn]
        if _lora(m).r != r:
            problems.append(f"{fqn}: model r={_lora(m).r}, adapter r={r}")
            continue
        problems += _shape_problems(fqn, r, m.in_full, m.out_full, keys, reader)
    if problems:
        raise LoraError(
            f"the adapter at {reader.source} does not fit {type(model).__name__}:\n  "
            + "\n  ".join(problems)
            + f"\nFix: parallelize the base model with lora=qm.LoraConfig(r={r}, "
            f"alpha={cfg.get('lora_alpha')}, targets=...) naming exactly the adapter's modules "
            "(quantmesh.io.adapter.adapter_lora_config(path) builds it), on the base model it was "
            "trained on"
        )


def load_adapter(model: nn.Module, path: str | os.PathLike) -> None:
    """Load a PEFT LoRA adapter into a parallelized model with LoRA attached, at any tp size.

    Each rank reads only its slice of A and B (colwise base: B's rows; rowwise base: A's columns).
    The adapter's lora_alpha and lora_dropout replace the model's. Collective.

    Example:
        >>> qm.parallelize(model, mesh, lora=adapter_lora_config("out/adapter"))  # doctest: +SKIP
        >>> qm.load_adapter(model, "out/adapter")                                # doctest: +SKIP
    """
    path = Path(path)
    model = inner_model(model)

    def run() -> None:
        cfg = _read_adapter_config(path)
        mods = _lora_modules(model)
        experts = _expert_modules(model)
        if not mods and not experts:
            raise LoraError(
                f"{type(model).__name__} has no LoRA modules to load {path} into; parallelize it "
                "with lora=quantmesh.io.adapter.adapter_lora_config(path) first"
            )
        r, alpha, rs = int(cfg["r"]), float(cfg["lora_alpha"]), bool(cfg.get("use_rslora"))
        scale = lora_scale(alpha, r, rs)
        p = float(cfg.get("lora_dropout") or 0.0)
        with open_checkpoint(_adapter_weights(path), key_map=_peft_key) as reader:
            _check_adapter(model, reader, cfg, mods)  # everything, before reading any data
            with torch.no_grad():
                for key, m, name in _file_params(mods, experts):  # this rank's slice of each
                    dest = m.get_parameter(name)
                    dim, fs = tp_sharded(m).get(name, (None, None))
                    ranges = fs.ranges(m.tp_rank) if fs is not None else None
                    fill_from_whole(dest, reader.read(key, dim, ranges, dtype=dest.dtype,
                                                      device=dest.device))  # fmt: skip
                for m in mods.values():  # the same A and B, the adapter's scale and dropout
                    m.set_adapter(_lora(m).retuned(scale=scale, dropout=p))
                for e in experts.values():
                    for t, ead in e.expert_adapters().items():
                        e.set_expert_adapter(t, ead.retuned(scale=scale))
        st = parallel_state(model, required=False)
        if st is not None and st.lora is not None:
            st.lora = dataclasses.replace(st.lora, alpha=alpha, dropout=p, rslora=rs)

    agreed(run, "load_adapter")
