"""Saving, part 1: the shared machinery (atomic, rank-0, streamed) and LoRA adapters in PEFT format.

Every save is collective and follows one pattern (`collective_save`):

    1. validate on every rank (same inputs, same verdict), agree, before any collective;
    2. global rank 0 opens `atomic_dir(path)`; all ranks agree it worked;
    3. the ranks of the first data-parallel replica gather tp shards one module at a time; rank 0
       writes each as it arrives (write errors are kept, not raised, so that rank 0 keeps joining
       the gathers and no rank is left waiting);
    4. rank 0 swaps the folder in (or drops it on any error); all ranks agree, which is also the
       barrier: every rank returns after the files are in place, or every rank raises.

A process killed mid-save leaves the previous save at `path` intact (atomic.py).

PEFT mapping (what `peft.PeftModel.from_pretrained` reads): `adapter_config.json` (peft_type LORA,
r, lora_alpha, lora_dropout, target_modules, bias "none", fan_in_fan_out for Conv1D bases,
task_type CAUSAL_LM for causal LMs) and `adapter_model.safetensors` holding the unsharded
`base_model.model.<module fqn>.lora_A.weight` (r, in) and `...lora_B.weight` (out, r).

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
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .atomic import atomic_dir
from .checkpoint import open_checkpoint
from .load import _rank, all_ranks_ok, sharded_fqns
from .lora import LoraConfig, LoraError
from .state import gather_param, tp_sharded
from .tp.layers import ShardedModule

__all__ = [
    "save_adapter",
    "load_adapter",
    "adapter_lora_config",
    "collective_save",
    "agreed",
    "ShardWriter",
    "full_tensor",
    "in_first_replica",
    "parse_size",
]

PEFT_PREFIX = "base_model.model."
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


# ---- the collective save pattern ----------------------------------------------------------------
def agreed(fn: Callable[[], Any], what: str) -> Any:
    """Run `fn` on every rank; if it raises on any rank, raise on every rank (collective).

    Example:
        >>> layout = agreed(lambda: check(model), "save_state")  # doctest: +SKIP
    """
    err, out = None, None
    try:
        out = fn()
    except Exception as e:
        err = e
    all_ranks_ok(err, what)
    return out


def _save_file(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """One safetensors file (one function, so that a test can stop a process in the middle)."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})


def _owned(t: torch.Tensor) -> torch.Tensor:
    # safetensors refuses tensors that share storage; a view of a bigger tensor gets its own copy
    t = t.detach().to("cpu").contiguous()
    return t if t.untyped_storage().nbytes() == t.nbytes else t.clone()


def parse_size(size: int | str) -> int:
    """Bytes of "2GB", "500MB", "64KiB" or an int.

    Example:
        >>> parse_size("2GB"), parse_size("1MiB")
        (2000000000, 1048576)
    """
    if isinstance(size, int):
        value = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", str(size), re.IGNORECASE)
        if m is None:
            raise ValueError(f"size {size!r} is not understood; use an int of bytes or '2GB'")
        base = 1024 if m[3] else 1000
        value = int(float(m[1]) * base ** " KMGT".index(m[2].upper() or " "))
    if value <= 0:
        raise ValueError(f"size {size!r} must be positive")
    return value


class ShardWriter:
    """Tensors streamed into safetensors files of at most `max_bytes` each (one tensor may exceed
    it alone), plus an HF index when there are several: `{stem}.safetensors` or
    `{stem}-00001-of-0000N.safetensors` + `{stem}.safetensors.index.json`.

    Example:
        >>> w = ShardWriter(folder, "model", 2 << 30)  # doctest: +SKIP
        >>> w.add("lm_head.weight", t); w.close()      # doctest: +SKIP
    """

    def __init__(self, folder: Path, stem: str, max_bytes: int):
        self.folder, self.stem, self.max_bytes = Path(folder), stem, max_bytes
        self._buf: dict[str, torch.Tensor] = {}
        self._size = 0
        self._files: list[tuple[str, list[str]]] = []  # (temporary name, keys)
        self.total = 0

    def add(self, key: str, tensor: torch.Tensor) -> None:
        if key in self._buf or any(key in ks for _, ks in self._files):
            raise AssertionError(f"{key} written twice")
        t = _owned(tensor)
        if self._buf and self._size + t.nbytes > self.max_bytes:
            self._flush()
        self._buf[key] = t
        self._size += t.nbytes
        self.total += t.nbytes

    def _flush(self) -> None:
        name = f"{self.stem}-part{len(self._files) + 1:05d}.safetensors"
        _save_file(self._buf, self.folder / name)
        self._files.append((name, list(self._buf)))
        self._buf, self._size = {}, 0

    def close(self) -> list[str]:
        """Write what is left, give the files their final names; returns them."""
        if self._buf or not self._files:
            self._flush()
        n = len(self._files)
        if n == 1:
            final = [f"{self.stem}.safetensors"]
        else:
            final = [f"{self.stem}-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        weight_map = {}
        for (tmp, keys), name in zip(self._files, final):
            os.rename(self.folder / tmp, self.folder / name)
            weight_map.update(dict.fromkeys(keys, name))
        if n > 1:
            index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
            (self.folder / f"{self.stem}.safetensors.index.json").write_text(
                json.dumps(index, indent=2, sort_keys=True) + "\n"
            )
        return final


class _Rank0Writer:
    """Rank 0's handle on the temporary folder; a failed write is kept and raised at the end."""

    def __init__(self, folder: Path | None):
        self.folder = folder
        self.error: BaseException | None = None

    def __bool__(self) -> bool:
        return self.folder is not None

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self.folder is None or self.error is not None:
            return None
        try:
            return fn(*args)
        except Exception as e:  # keep joining the collectives; raised after them
            self.error = e
            return None

    def json(self, name: str, obj: Any) -> None:
        text = json.dumps(obj, indent=2, sort_keys=True) + "\n"
        self.run(lambda: (self.folder / name).write_text(text))


def collective_save(path: str | os.PathLike, produce: Callable[[_Rank0Writer], None], what: str):
    """Run `produce(writer)` on every rank; rank 0's writes land atomically at `path`.

    `writer` is falsy on other ranks. Collective; see the module docstring for the protocol.

    Example:
        >>> collective_save("out/x", lambda w: w.json("a.json", {}), "save_x")  # doctest: +SKIP
    """
    stack = ExitStack()
    writer = _Rank0Writer(None)

    def enter() -> None:
        if _rank() == 0:
            writer.folder = stack.enter_context(atomic_dir(path))

    agreed(enter, what)
    err = None
    try:
        produce(writer)
        if writer.error is not None:
            raise writer.error
    except Exception as e:
        err = e
    if _rank() == 0:
        try:
            if err is None:
                stack.close()  # swap the new folder in
            else:
                stack.__exit__(type(err), err, err.__traceback__)  # drop it; keep the old save
        except Exception as e:
            err = err or e
    all_ranks_ok(err, what)


def in_first_replica(model: nn.Module) -> bool:
    """True on the ranks of data-parallel replica 0 (the ones that gather and write)."""
    mesh = getattr(model, "_qm_mesh", None)
    return mesh is None or mesh.dp_rank == 0


def full_tensor(m: ShardedModule, name: str, local: torch.Tensor | None = None) -> torch.Tensor:
    """The whole tensor `name` of `m` (all-gathered over tp when split; collective then).

    Example:
        >>> full_tensor(q_proj, "lora_B.weight").shape  # doctest: +SKIP
        torch.Size([576, 16])
    """
    t = (local if local is not None else m.get_parameter(name)).detach()
    spec = tp_sharded(m).get(name)
    return t if spec is None else gather_param(t, spec[0], spec[1], m.group)


# ---- PEFT adapters ------------------------------------------------------------------------------
def _lora_modules(model: nn.Module) -> dict[str, ShardedModule]:
    return {f: m for f, m in sharded_fqns(model).items() if m.lora_scale is not None}


def _peft_targets(model: nn.Module, targets: set[str]) -> list[str] | str:
    """Bare module names when they select exactly `targets` in the plain model, else a regex."""
    leaves = sorted({f.rsplit(".", 1)[-1] for f in targets})
    lora_children = {f"{f}.{c}" for f in targets for c in ("lora_A", "lora_B", "lora_dropout")}
    covered = {
        n
        for n, _ in model.named_modules()
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


def _number(x: float) -> float | int:
    return int(x) if float(x).is_integer() else float(x)


def _adapter_config(model: nn.Module, mods: dict[str, ShardedModule], base: str | None) -> dict:
    first = next(iter(mods.values()))
    r = int(first.lora_A.weight.shape[0])
    for f, m in mods.items():
        if m.lora_A.weight.shape[0] != r or not math.isclose(m.lora_scale, first.lora_scale):
            raise LoraError(
                f"LoRA of {f} has r={m.lora_A.weight.shape[0]}, scale={m.lora_scale}, but "
                f"{first.fqn} has r={r}, scale={first.lora_scale}; a PEFT adapter_config holds "
                "one r and one alpha: save adapters of one rank"
            )
    drop = first.lora_dropout
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
        "lora_alpha": _number(first.lora_scale * r),
        "lora_dropout": float(drop.p) if isinstance(drop, nn.Dropout) else 0.0,
        "target_modules": _peft_targets(model, set(mods)),
        "exclude_modules": None,
        "bias": "none",
        "fan_in_fan_out": any(m.kind.name == "Conv1D" for m in mods.values()),
        "use_rslora": False,
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

    def check() -> tuple[dict, dict]:
        mods = _lora_modules(model)
        if not mods:
            raise LoraError(
                f"{type(model).__name__} has no LoRA adapters to save; parallelize it with "
                "lora=qm.LoraConfig(...) (or load_adapter into such a model) first"
            )
        return mods, _adapter_config(model, mods, base_model_name_or_path)

    mods, config = agreed(check, "save_adapter")

    def produce(w: _Rank0Writer) -> None:
        if not in_first_replica(model):
            return
        tensors = {}
        for fqn, m in mods.items():  # gathered one module at a time; adapters are small
            for name in ("lora_A.weight", "lora_B.weight"):
                t = full_tensor(m, name)
                if w:
                    tensors[f"{PEFT_PREFIX}{fqn}.{name}"] = _owned(t)
        w.run(_save_file, tensors, w.folder / ADAPTER_WEIGHTS if w else None)
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
    cfg = json.loads(cfg_path.read_text())
    bad = []
    if cfg.get("peft_type") != "LORA":
        bad.append(f"peft_type={cfg.get('peft_type')!r} (expected 'LORA')")
    for flag in ("use_dora", "use_rslora", "lora_bias"):
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
            "loads plain LoRA (one r and alpha, no bias, no DoRA/rsLoRA, no extra saved modules)"
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
    with open_checkpoint(_adapter_weights(path), key_map=_peft_key) as reader:
        fqns = sorted({k.rsplit(".", 2)[0] for k in reader.keys() if ".lora_" in k})
    return LoraConfig(
        r=int(cfg["r"]), alpha=cfg["lora_alpha"], dropout=float(cfg.get("lora_dropout") or 0.0),
        targets=fqns,
    )  # fmt: skip


def _check_adapter(model: nn.Module, reader, cfg: dict, mods: dict[str, ShardedModule]) -> None:
    keys = set(reader.keys())
    r = int(cfg["r"])
    in_file = {k.rsplit(".", 2)[0] for k in keys if re.search(r"\.lora_[AB]\.weight$", k)}
    other = sorted(k for k in keys if not re.search(r"\.lora_[AB]\.weight$", k))
    problems = []
    if other:
        problems.append(f"tensors other than lora_A/lora_B: {other[:10]}")
    if missing := sorted(in_file - set(mods)):
        problems.append(f"adapter modules without LoRA in the model: {missing[:10]}")
    if extra := sorted(set(mods) - in_file):
        problems.append(f"model LoRA modules absent from the adapter: {extra[:10]}")
    for fqn in sorted(in_file & set(mods)):
        m = mods[fqn]
        if m.lora_A.weight.shape[0] != r:
            problems.append(f"{fqn}: model r={m.lora_A.weight.shape[0]}, adapter r={r}")
            continue
        for name, want in (("lora_A.weight", (r, m.in_full)), ("lora_B.weight", (m.out_full, r))):
            key = f"{fqn}.{name}"
            if key not in keys:
                problems.append(f"{key} missing")
            elif tuple(reader.shape(key)) != want:
                problems.append(f"{key}: adapter {tuple(reader.shape(key))}, model {want}")
    if problems:
        raise LoraError(
            f"the adapter at {reader.source} does not fit {type(model).__name__}:\n  "
            + "\n  ".join(problems)
            + f"\nFix: parallelize the base model with lora=qm.LoraConfig(r={r}, "
            f"alpha={cfg.get('lora_alpha')}, targets=...) naming exactly the adapter's modules "
            "(quantmesh.save.adapter_lora_config(path) builds it), on the base model it was "
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

    def run() -> None:
        cfg = _read_adapter_config(path)
        mods = _lora_modules(model)
        if not mods:
            raise LoraError(
                f"{type(model).__name__} has no LoRA modules to load {path} into; parallelize it "
                "with lora=quantmesh.save.adapter_lora_config(path) first"
            )
        r, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
        p = float(cfg.get("lora_dropout") or 0.0)
        with open_checkpoint(_adapter_weights(path), key_map=_peft_key) as reader:
            _check_adapter(model, reader, cfg, mods)  # everything, before reading any data
            with torch.no_grad():
                for fqn, m in mods.items():
                    split = tp_sharded(m)
                    for name in ("lora_A.weight", "lora_B.weight"):
                        dest = m.get_parameter(name)
                        dim, fs = split.get(name, (None, None))
                        ranges = fs.ranges(m.tp_rank) if fs is not None else None
                        dest.copy_(reader.read(f"{fqn}.{name}", dim, ranges, dtype=dest.dtype,
                                               device=dest.device))  # fmt: skip
                    m.lora_scale = alpha / r
                    m.lora_dropout = (nn.Dropout(p) if p > 0 else nn.Identity()).train(m.training)
        if isinstance(getattr(model, "_qm_lora", None), LoraConfig):
            model._qm_lora = dataclasses.replace(model._qm_lora, alpha=alpha, dropout=p)

    agreed(run, "load_adapter")
