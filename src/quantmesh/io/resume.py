"""Resume: save_state / load_state of trainable parameters, optimizer state, RNG states and step.

Tensors are stored UNSHARDED (gathered over tp, one replica's copy), so a state saved at one layout
resumes at any other layout the plan allows (dp x tp x pp): each rank reads back the slice its own
parameters hold. At pp > 1 the first tp rank of each stage sends its part to global rank 0, which
writes one folder; on load each rank reads its stages' names only. Only safetensors and JSON are written and read; nothing is unpickled (which is
why torch.distributed.checkpoint, whose metadata file is a pickle, is not used).

Folder layout:
    state.json                   format, step, mesh, parameter names/shapes, optimizer groups and
                                 per-parameter non-tensor state
    rng.json                     per global rank: torch CPU (+ CUDA) generator states, python
                                 `random`, numpy
    trainable.safetensors        {parameter fqn: full tensor} (sharded + index json when large)
    optimizer.safetensors        {"<fqn>:<state key>": full tensor} (AdamW exp_avg, step, ...)

Resuming at the same layout is bit-exact (the RNG of every rank is restored too); at a different
world size the RNG states cannot be mapped and are left alone (a warning says so).

Example:
    >>> qm.save_state(model, opt, "out/step100", step=100)   # doctest: +SKIP
    >>> step = qm.load_state(model, opt, "out/step100")      # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
import random
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..parallel.fsdp import fill_from_whole, like_param, whole
from ..parallel.state import parallel_state
from ..tp.gather import tp_sharded
from ..tp.layers import sharded_modules
from .load import _coll_device, _rank
from .reader import open_checkpoint
from .save import (
    ShardWriter,
    _owned,
    _Rank0Writer,
    agreed,
    collective_save,
    full_tensor,
    gathers_here,
    parse_size,
)

__all__ = ["save_state", "load_state"]

FORMAT = "quantmesh-state"
VERSION = 1


# ---- what is trainable, and how it is split -----------------------------------------------------
def _trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    """{fqn: parameter} of the parameters with requires_grad, one name per tensor, model order."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def _splits(model: nn.Module) -> dict[str, tuple[Any, str]]:
    """{fqn: (ShardedModule, local name)} of tensors split over tp."""
    out = {}
    for fqn, m in sharded_modules(model).items():
        for name in tp_sharded(m):
            out[f"{fqn}.{name}" if fqn else name] = (m, name)
    return out


# (ShardedModule, local parameter name) of a tensor split over tp, or None for a whole one
Split = tuple[Any, str] | None


def _full_shape(p: torch.Tensor, split: Split) -> list[int]:
    shape = list(p.shape)
    if split is not None:
        m, name = split
        dim, fs = tp_sharded(m)[name]
        shape[dim] = fs.full
    return shape


def _full(t: torch.Tensor, split: Split) -> torch.Tensor:
    return whole(t).detach() if split is None else full_tensor(split[0], split[1], t)


def _slice_of(split: Split) -> tuple[int | None, Any]:
    if split is None:
        return None, None
    m, name = split
    dim, fs = tp_sharded(m)[name]
    return dim, fs.ranges(m.tp_rank)


# ---- JSON for optimizer hyper-parameters (tuples survive the round trip) -----------------------
def _enc(v: Any, where: str) -> Any:
    if isinstance(v, tuple):
        return {"__tuple__": [_enc(x, where) for x in v]}
    if isinstance(v, list):
        return [_enc(x, where) for x in v]
    if v is None or isinstance(v, bool | int | float | str):
        return v
    raise TypeError(
        f"{where} is a {type(v).__name__} ({v!r}); save_state stores optimizer settings as JSON "
        "(numbers, strings, bools, None, tuples, lists); use a plain float (e.g. lr=2e-4)"
    )


def _dec(v: Any) -> Any:
    if isinstance(v, dict) and "__tuple__" in v:
        return tuple(_dec(x) for x in v["__tuple__"])
    if isinstance(v, list):
        return [_dec(x) for x in v]
    return v


def _optimizer_layout(optimizer: torch.optim.Optimizer, trainable: dict[str, nn.Parameter]) -> dict:
    """Groups (settings + parameter names) and each parameter's state split into tensors
    (param-shaped or 0-d) and JSON scalars. Raises for what cannot be resharded."""
    name_of = {id(p): n for n, p in trainable.items()}
    groups: list[dict] = []
    tensors: dict[str, dict[str, str]] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for gi, group in enumerate(optimizer.param_groups):
        names = []
        for p in group["params"]:
            if id(p) not in name_of:
                raise ValueError(
                    f"optimizer group {gi} holds a parameter of shape {tuple(p.shape)} that is not a "
                    "trainable parameter of the model; build the optimizer from "
                    "qm.trainable_parameters(model)"
                )
            n = name_of[id(p)]
            names.append(n)
            st = optimizer.state.get(p, {})
            tensors[n], scalars[n] = {}, {}
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    if v.dim() > 0 and tuple(v.shape) != tuple(p.shape):
                        raise NotImplementedError(
                            f"optimizer state {k!r} of {n} has shape {tuple(v.shape)}, neither the "
                            f"parameter's {tuple(p.shape)} nor a scalar; save_state reshards "
                            "only param-shaped and scalar state (AdamW, Adam, SGD, ...)"
                        )
                    tensors[n][k] = "param" if v.dim() > 0 else "scalar"
                else:
                    scalars[n][k] = _enc(v, f"optimizer state {k!r} of {n}")
        settings = {
            k: _enc(v, f"optimizer setting {k!r}") for k, v in group.items() if k != "params"
        }
        groups.append({"settings": settings, "params": names})
    return {"class": type(optimizer).__name__, "groups": groups, "tensors": tensors,
            "scalars": scalars}  # fmt: skip


# ---- RNG ----------------------------------------------------------------------------------------
def _rng_state() -> dict:
    st: dict[str, Any] = {"torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    v, mt, gauss = random.getstate()
    st["python"] = [v, list(mt), gauss]
    try:
        import numpy as np

        name, keys, pos, has_gauss, cached = np.random.get_state()
        st["numpy"] = [name, np.asarray(keys).tolist(), int(pos), int(has_gauss), float(cached)]
    except ImportError:
        pass
    return st


def _set_rng_state(st: dict) -> None:
    torch.set_rng_state(torch.tensor(st["torch"], dtype=torch.uint8))
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in st["cuda"]])
    v, mt, gauss = st["python"]
    random.setstate((v, tuple(mt), gauss))
    if "numpy" in st:
        import numpy as np

        name, keys, pos, has_gauss, cached = st["numpy"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def _gather_json(obj: Any) -> list:
    """Every rank's JSON-able `obj`, on every rank (tensor all_gathers; no pickle). Collective."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    dev, world = _coll_device(), dist.get_world_size()
    data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8).to(dev)
    n = torch.tensor([data.numel()], device=dev)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    width = int(max(s.item() for s in sizes))
    buf = torch.zeros(width, dtype=torch.uint8, device=dev)
    buf[: data.numel()] = data
    outs = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(outs, buf)
    return [
        json.loads(o[: int(s.item())].cpu().numpy().tobytes())
        for o, s in zip(outs, sizes, strict=True)
    ]


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _optimizer_tensors(
    optimizer: torch.optim.Optimizer, trainable: dict, layout: dict, splits: dict
) -> Iterator[tuple[str, torch.Tensor]]:
    """("<fqn>:<key>", full tensor) of every optimizer state tensor, gathered one at a time."""
    for n, kinds in layout["tensors"].items():
        st = optimizer.state[trainable[n]]
        for k, kind in sorted(kinds.items()):
            yield f"{n}:{k}", (_full(st[k], splits.get(n)) if kind == "param" else st[k].detach())


def _write_tensors(
    w: _Rank0Writer,
    stem: str,
    max_bytes: int,
    items: Iterable[tuple[str, torch.Tensor]],
) -> None:
    """Consume `items` on every rank (they may gather); rank 0 streams them into files."""
    writer = ShardWriter(w.folder, stem, max_bytes) if w.folder is not None else None
    for key, t in items:
        if writer is not None:
            w.run(writer.add, key, t)
    if writer is not None:
        w.run(writer.close)


# ---- pipeline stages: each holds part of the trainable parameters --------------------------------
def _merge_stages(infos: list) -> tuple[dict, dict]:
    """(params, optimizer layout) of the whole model from every rank's [pp rank, params, layout]
    (one per stage kept; stage order, so names stay in model order)."""
    by_stage: dict[int, tuple[dict, dict]] = {}
    for stage, stage_params, stage_layout in infos:
        by_stage.setdefault(stage, (stage_params, stage_layout))
    params: dict = {}
    merged: dict = {"class": None, "groups": [], "tensors": {}, "scalars": {}}
    for stage in sorted(by_stage):
        p, lay = by_stage[stage]
        params.update(p)
        merged["class"] = merged["class"] or lay["class"]
        if lay["class"] != merged["class"] or (
            merged["groups"] and len(lay["groups"]) != len(merged["groups"])
        ):
            raise ValueError(
                "pipeline stages hold different optimizers (classes or group counts); build "
                "the optimizer the same way on every rank from qm.trainable_parameters(model)"
            )
        for gi, g in enumerate(lay["groups"]):
            if gi == len(merged["groups"]):
                merged["groups"].append({"settings": g["settings"], "params": []})
            merged["groups"][gi]["params"] += g["params"]
        merged["tensors"].update(lay["tensors"])
        merged["scalars"].update(lay["scalars"])
    return params, merged


def _stage_items(mesh: Any, t_items: list, o_items: list) -> tuple[list, list]:
    """Every stage's (key, tensor) items on global rank 0, in stage order (others: empty).
    Called by the ranks of the first replica; the first tp rank of each stage takes part."""
    if mesh.tp_rank != 0:
        return [], []
    from ..pipeline.parts import gather_stages

    mine = {"t": [(k, _owned(v)) for k, v in t_items], "o": [(k, _owned(v)) for k, v in o_items]}
    parts = gather_stages(mine, mesh)  # [stage 0's, stage 1's, ...] on rank 0
    return [x for p in parts for x in p["t"]], [x for p in parts for x in p["o"]]


def _stage_part(manifest: dict, pipe: Any) -> dict:
    """The manifest kept to this rank's stages' parameters (the others are other ranks' to load)."""
    keep = [n for n in manifest["params"] if pipe.cut.stage_of(n) in pipe.stages]
    opt = manifest["optimizer"]
    groups = [{**g, "params": [n for n in g["params"] if n in keep]} for g in opt["groups"]]
    return {
        **manifest,
        "params": {n: manifest["params"][n] for n in keep},
        "optimizer": {**opt, "groups": groups},
    }


# ---- save ---------------------------------------------------------------------------------------
def save_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    path: str | os.PathLike,
    *,
    step: int | None = None,
    max_shard_size: int | str = "2GB",
) -> None:
    """Save what resuming needs: trainable parameters, optimizer state, every rank's RNG, step.

    Collective: every rank calls it; global rank 0 writes `path` atomically (a crash mid-save
    leaves the previous save intact); all ranks return after the write.

    Example:
        >>> qm.save_state(model, opt, "out/step100", step=100)  # doctest: +SKIP
    """

    def check() -> tuple[dict, dict, dict, int]:
        if step is not None and not isinstance(step, int):
            raise TypeError(f"step={step!r}; pass an int (the number of optimizer steps) or None")
        trainable = _trainable(model)
        if not trainable:
            raise ValueError(f"{type(model).__name__} has no trainable parameters to save")
        return (
            trainable,
            _splits(model),
            _optimizer_layout(optimizer, trainable),
            parse_size(max_shard_size),
        )

    trainable, splits, layout, max_bytes = agreed(check, "save_state")
    rngs = _gather_json(_rng_state())  # (world,) one state per global rank
    st = parallel_state(model, required=False)
    mesh = st.mesh if st is not None else None
    params = {
        n: {"shape": _full_shape(p, splits.get(n)), "dtype": str(p.dtype)}
        for n, p in trainable.items()
    }
    pp = mesh is not None and mesh.pp > 1
    local_layout = layout
    if mesh is not None and pp:  # every stage's names and optimizer layout, in stage order
        params, layout = _merge_stages(_gather_json([mesh.pp_rank, params, layout]))

    def produce(w: _Rank0Writer) -> None:
        if gathers_here(model):
            t_items: Iterable = ((n, _full(p, splits.get(n))) for n, p in trainable.items())
            o_items: Iterable = _optimizer_tensors(optimizer, trainable, local_layout, splits)
            if pp:  # the first tp rank of each stage sends its part to global rank 0
                t_items, o_items = _stage_items(mesh, list(t_items), list(o_items))
            _write_tensors(w, "trainable", max_bytes, t_items)
            _write_tensors(w, "optimizer", max_bytes, o_items)
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "step": step,
            "world_size": _world(),
            "mesh": None
            if mesh is None
            else {"dp": mesh.dp, "tp": mesh.tp, **({"pp": mesh.pp} if pp else {})},
            "params": params,
            "optimizer": layout,
            "torch": torch.__version__,
        }
        w.json("state.json", manifest)
        w.json("rng.json", {"ranks": rngs})

    collective_save(path, produce, "save_state")


# ---- load ---------------------------------------------------------------------------------------
def _files(folder: Path, stem: str) -> Path:
    index = folder / f"{stem}.safetensors.index.json"
    return index if index.is_file() else folder / f"{stem}.safetensors"


def _check(manifest: dict, trainable: dict, splits: dict, layout: dict, where: Path) -> None:
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise ValueError(
            f"{where}/state.json is not a {FORMAT} v{VERSION} manifest (found format "
            f"{manifest.get('format')!r} v{manifest.get('version')!r}); pass a folder written "
            "by qm.save_state"
        )
    saved = manifest["params"]
    problems = []
    if missing := [n for n in trainable if n not in saved]:
        problems.append(f"trainable here, not in the save: {missing[:10]}")
    if extra := [n for n in saved if n not in trainable]:
        problems.append(f"in the save, not trainable here: {extra[:10]}")
    for n, p in trainable.items():
        if n in saved and saved[n]["shape"] != _full_shape(p, splits.get(n)):
            problems.append(
                f"{n}: saved full shape {saved[n]['shape']}, here {_full_shape(p, splits.get(n))}"
            )
    opt = manifest["optimizer"]
    if opt["class"] != layout["class"]:
        problems.append(f"optimizer saved as {opt['class']}, here {layout['class']}")
    mine = [g["params"] for g in layout["groups"]]
    theirs = [g["params"] for g in opt["groups"]]
    if mine != theirs:
        problems.append(
            f"optimizer parameter groups differ: saved {[len(g) for g in theirs]} parameters per "
            f"group, here {[len(g) for g in mine]} (or another order)"
        )
    if problems:
        old = manifest.get("mesh")
        raise ValueError(
            f"the state at {where} (saved at mesh {old}) does not fit this model:\n  "
            + "\n  ".join(problems)
            + "\nFix: resume with the same model, LoRA config and optimizer construction "
            "(qm.trainable_parameters order); a different dp x tp layout is fine"
        )


@torch.no_grad()
def load_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, path: str | os.PathLike
) -> int | None:
    """Restore a `save_state` folder into `model` and `optimizer` (any dp x tp layout); the step.

    Each rank reads only its slices. At the layout it was saved with, training continues
    bit-exactly (RNG states included). Collective.

    Example:
        >>> step = qm.load_state(model, opt, "out/step100")  # doctest: +SKIP
    """
    folder = Path(path)

    def run() -> int | None:
        if not (folder / "state.json").is_file():
            raise FileNotFoundError(f"{folder} has no state.json; expected a qm.save_state folder")
        manifest = json.loads((folder / "state.json").read_text())
        trainable, splits = _trainable(model), _splits(model)
        layout = _optimizer_layout(optimizer, trainable)
        pst = parallel_state(model, required=False)
        if pst is not None and pst.pipeline is not None:  # this rank's stages: their part
            manifest = _stage_part(manifest, pst.pipeline)
        _check(manifest, trainable, splits, layout, folder)
        with open_checkpoint(_files(folder, "trainable")) as reader:
            for n, p in trainable.items():
                dim, ranges = _slice_of(splits.get(n))
                fill_from_whole(p, reader.read(n, dim, ranges, dtype=p.dtype, device=p.device))
        opt = manifest["optimizer"]
        sd: dict[str, Any] = {"state": {}, "param_groups": []}
        index = 0
        with open_checkpoint(_files(folder, "optimizer")) as reader:
            for g in opt["groups"]:
                ids = []
                for n in g["params"]:
                    st = {k: _dec(v) for k, v in opt["scalars"].get(n, {}).items()}
                    for k, kind in opt["tensors"].get(n, {}).items():
                        dim, ranges = _slice_of(splits.get(n)) if kind == "param" else (None, None)
                        st[k] = reader.read(f"{n}:{k}", dim, ranges)
                        if kind == "param":  # laid out like its parameter (an FSDP shard)
                            st[k] = like_param(st[k], trainable[n])
                    if st:
                        sd["state"][index] = st
                    ids.append(index)
                    index += 1
                sd["param_groups"].append({**{k: _dec(v) for k, v in g["settings"].items()},
                                           "params": ids})  # fmt: skip
        optimizer.load_state_dict(sd)
        rng = json.loads((folder / "rng.json").read_text())["ranks"]
        if len(rng) == _world():
            _set_rng_state(rng[_rank()])
        elif _rank() == 0:
            warnings.warn(
                f"{folder} was saved by {len(rng)} ranks, this run has {_world()}: parameters "
                "and optimizer state are restored, RNG states are not (dropout masks and data "
                "shuffles differ from an uninterrupted run)",
                stacklevel=3,
            )
        step: int | None = manifest["step"]
        return step

    step: int | None = agreed(run, "load_state")
    return step
