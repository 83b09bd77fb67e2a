"""load_checkpoint: stream each rank's slices of a checkpoint into a parallelized model.

Every rank reads only what it holds. For each parameter of a ShardedModule the wrapper says which
part of the FULL checkpoint tensor it keeps (`param_slices()`: dim and ranges, checkpoint layout);
the reader fetches exactly those ranges, cast and moved in the read, and `load_param` quantizes on
the device when the module has a format. Everything else (norms, replicated embeddings, persistent
buffers) is read whole and copied in. Host memory stays near one slice plus one read chunk.

Before any data is read, the checkpoint's keys and shapes (header metadata only) are checked
against the model: missing, unexpected and mis-shaped keys are listed together in one error. Tied
weights are one tensor: a checkpoint may hold any one of their names (HF drops `lm_head.weight`
when embeddings are tied). LoRA adapters are optional: loaded when present (a `full_state_dict`
round trip), never "missing" from a base checkpoint.

Weights stored already quantized by bitsandbytes (a folder saved by transformers with
`BitsAndBytesConfig`) fill quantized layers with their stored codes, cut per rank on block
boundaries, or fill float layers with their exact dequantized values (io/prequant.py); what was done
for each is in `LoadResult.prequantized`.

Example:
    >>> with qm.empty_model():                                 # doctest: +SKIP
    ...     model = MyModel(cfg)
    >>> qm.parallelize(model, mesh, quant="nf4")               # doctest: +SKIP
    >>> qm.load_checkpoint(model, "path/to/model_dir")         # doctest: +SKIP
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import QuantmeshError
from ..parallel.state import parallel_state
from ..tp.gather import tp_sharded
from ..tp.layers import ShardedModule, inside_sharded, sharded_modules
from .prequant import StoredWeight, check_target, fill_stored, stored_weights
from .reader import CheckpointReader, KeyMap, Ranges, open_checkpoint

__all__ = [
    "LoadError",
    "LoadResult",
    "all_ranks_ok",
    "expected_keys",
    "load_checkpoint",
]

_SHOW = 20  # names listed per category in an error before "... and N more"


class LoadError(QuantmeshError, ValueError):
    """A checkpoint that does not fit the model; the message lists every offending key."""


@dataclass
class LoadResult:
    """What `load_checkpoint` did on this rank."""

    missing_keys: list[str] = field(default_factory=list)
    """Model keys the checkpoint does not hold (always empty with strict=True)."""
    unexpected_keys: list[str] = field(default_factory=list)
    """Checkpoint keys the model has no place for (always empty with strict=True)."""
    bytes_read: int = 0
    """Bytes of checkpoint data this rank read (its slices, at the stored dtype)."""
    prequantized: dict[str, str] = field(default_factory=dict)
    """{module: how} for weights stored quantized: "codes as stored", "codes cut on block
    boundaries", "int8 rows and scales as stored" (all exact), "requantized: ..." (this rank's
    part cut quantization blocks; not exact) or "dequantized (...)" (a float layer; exact)."""


@dataclass
class _Target:
    """One tensor to fill: where it comes from in the checkpoint and where it goes."""

    key: str  # model key (the parameter's FQN)
    shape: tuple[int, ...]  # full shape, checkpoint layout
    dim: int | None  # slice dim, or None for the whole tensor
    ranges: Ranges | None
    owners: list[tuple[nn.Module, str, str]]  # (module, attr, kind) holding this same tensor
    dtype: torch.dtype
    device: torch.device
    optional: bool = False  # LoRA: loaded when present, never missing
    keys: list[str] = field(default_factory=list)  # every model key of this tensor (tied names)
    module: ShardedModule | None = None  # kind "sharded": the wrapper whose load_param fills it
    name: str = ""  # kind "sharded": the base parameter name ("weight", "bias")

    def nbytes(self, itemsize: int) -> int:
        n = math.prod(self.shape)
        if self.dim is not None and self.shape[self.dim]:
            assert self.ranges is not None  # a slice dim comes with its ranges
            n = n // self.shape[self.dim] * sum(b - a for a, b in self.ranges)
        return n * itemsize


# ---- agreement across ranks ---------------------------------------------------------------------
def _coll_device() -> torch.device:
    backend = str(dist.get_backend())
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_ranks_ok(err: BaseException | None, what: str) -> None:
    """Collective: raise on every rank when any rank failed (`err` is this rank's failure).

    A failing rank re-raises its own exception; the others raise RuntimeError naming the failed
    ranks. Doubles as a barrier. Call it on every rank of the default group.

    Example:
        >>> all_ranks_ok(None, "save_adapter")  # doctest: +SKIP
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        if err is not None:
            raise err
        return
    flags = torch.zeros(dist.get_world_size(), dtype=torch.int32, device=_coll_device())
    flags[dist.get_rank()] = int(err is not None)
    dist.all_reduce(flags)  # (world,) 1 where a rank failed
    if err is not None:
        raise err
    bad = flags.nonzero().flatten().tolist()
    if bad:
        raise RuntimeError(
            f"{what} failed on rank(s) {bad} (this rank {dist.get_rank()} was fine); see the "
            f"traceback of rank {bad[0]} for the cause"
        )


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


# ---- what the model expects ---------------------------------------------------------------------
def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _targets(model: nn.Module) -> list[_Target]:
    """Every tensor a checkpoint fills, one target per distinct tensor (tied names merged)."""
    sharded = sharded_modules(model)
    by_id: dict[int, _Target] = {}
    out: list[_Target] = []

    def add(t: _Target, tensor: torch.Tensor) -> None:
        same = by_id.get(id(tensor))
        if same is not None:  # tied: one tensor under several names
            same.owners += t.owners
            same.keys.append(t.key)
            return
        t.keys = [t.key]
        by_id[id(tensor)] = t
        out.append(t)

    for fqn, m in sharded.items():
        for name, sl in m.param_slices().items():
            p = m._parameters[name]
            assert p is not None, f"{fqn}.{name} is None"
            dim, ranges = sl if sl is not None else (None, None)
            if name == "weight" and m.fmt is not None:
                # load_param quantizes from fp32 on CPU, from the compute dtype on accelerators
                dtype = torch.float32 if m.device_hint.type == "cpu" else m.float_dtype
            else:
                dtype = p.dtype if p.is_floating_point() else m.float_dtype
            t = _Target(_join(fqn, name), m.full_shape(name), dim, ranges, [(m, name, "sharded")],
                        dtype, m.device_hint, module=m, name=name)  # fmt: skip
            add(t, p)
        if (ad := m.lora) is not None:
            split = tp_sharded(m)
            r = ad.r
            for name, full in (
                ("lora_A.weight", (r, m.in_full)),
                ("lora_B.weight", (m.out_full, r)),
            ):
                p = m.get_parameter(name)
                dim, fs = split.get(name, (None, None))
                ranges = fs.ranges(m.tp_rank) if fs is not None else None
                sub = m.get_submodule(name.split(".")[0])
                t = _Target(_join(fqn, name), full, dim, ranges, [(sub, "weight", "lora")],
                            p.dtype, p.device, optional=True)  # fmt: skip
                add(t, p)
    for mname, mod in model.named_modules(remove_duplicate=False):
        for pname, p in mod._parameters.items():
            key = _join(mname, pname)
            if p is None or inside_sharded(key, sharded) or mname in sharded:
                continue
            dev = p.device if p.device.type != "meta" else torch.device("cpu")
            add(_Target(key, tuple(p.shape), None, None, [(mod, pname, "param")], p.dtype, dev), p)
        for bname, b in mod._buffers.items():
            key = _join(mname, bname)
            if (
                b is None
                or bname in mod._non_persistent_buffers_set
                or inside_sharded(key, sharded)
            ):
                continue
            if mname in sharded:
                continue
            dev = b.device if b.device.type != "meta" else torch.device("cpu")
            add(_Target(key, tuple(b.shape), None, None, [(mod, bname, "buffer")], b.dtype, dev), b)
    return out


def _tied_aliases(model: nn.Module, targets: list[_Target]) -> dict[str, list[str]]:
    """{key: other keys with the same data}: names sharing one tensor, plus weights that were tied
    before parallelize untied them (a quantized head next to a float embedding)."""
    groups = [t.keys for t in targets if len(t.keys) > 1]
    st = parallel_state(model, required=False)
    groups += [list(g) for g in (st.tied if st is not None else [])]  # recorded by parallelize
    alias: dict[str, list[str]] = {}
    for g in groups:
        for k in g:
            alias.setdefault(k, [])
            alias[k] += [o for o in g if o != k and o not in alias[k]]
    return alias


def expected_keys(model: nn.Module) -> list[str]:
    """Every key a checkpoint may hold for `model`: parameters, persistent buffers, tied names, LoRA.

    Example:
        >>> expected_keys(nn.Linear(2, 3))
        ['weight', 'bias']
    """
    targets = _targets(model)
    alias = _tied_aliases(model, targets)
    keys = [k for t in targets for k in t.keys]
    keys += [a for k in list(keys) for a in alias.get(k, [])]
    return list(dict.fromkeys(keys))


# ---- validation ---------------------------------------------------------------------------------
def _listing(title: str, items: list[str]) -> str:
    more = f", ... and {len(items) - _SHOW} more" if len(items) > _SHOW else ""
    return f"  {title} ({len(items)}): {', '.join(items[:_SHOW])}{more}"


def _owner(t: _Target) -> nn.Module:
    return t.module if t.module is not None else t.owners[0][0]


def _plan_sources(
    model: nn.Module,
    reader: CheckpointReader,
    targets: list[_Target],
    strict: bool,
    stored: Mapping[str, StoredWeight],
) -> tuple[dict[int, str], LoadResult]:
    """{target index: checkpoint key to read}; raises LoadError listing every problem at once."""
    present = set(reader.keys())
    alias = _tied_aliases(model, targets)
    sources: dict[int, str] = {}
    missing, bad_shape, unassembled = [], [], []
    expected: set[str] = set()
    for i, t in enumerate(targets):
        cands = list(t.keys) + [a for k in t.keys for a in alias.get(k, [])]
        expected.update(cands)
        src = next((c for c in cands if c in present), None)
        if src is None:
            broken = [c for c in cands if c in reader.conversion_errors]
            if broken:  # its stored pieces are there but do not assemble: listed below
                unassembled.append(f"{broken[0]}: {reader.conversion_errors[broken[0]]}")
            elif not t.optional:
                missing.append(t.key)
            continue
        if src in stored:  # a quantized weight: its logical shape and format must fit
            expected.update(stored[src].extra)
            problem = check_target(stored[src], _owner(t), t.shape)
            if problem is not None:
                bad_shape.append(problem)
                continue
        elif tuple(reader.shape(src)) != t.shape:
            bad_shape.append(f"{src}: checkpoint {tuple(reader.shape(src))}, model {t.shape}")
            continue
        sources[i] = src
    st = parallel_state(model, required=False)
    if st is not None and st.mesh.pp > 1:  # other pipeline stages' keys are theirs to load
        from ..pipeline.parts import elsewhere_keys

        expected |= elsewhere_keys(model)
    unexpected = [k for k in reader.keys() if k not in expected]
    unassembled += [
        f"{k}: {why}" for k, why in reader.conversion_errors.items() if k not in expected
    ]  # pieces of a tensor the model does not have
    if bad_shape or unassembled or (strict and (missing or unexpected)):
        parts = [_listing("missing", missing)] if strict and missing else []
        parts += [_listing("unexpected", unexpected)] if strict and unexpected else []
        parts += [_listing("mis-shaped", bad_shape)] if bad_shape else []
        if unassembled:
            parts.append(_listing("not assembled from their stored pieces", unassembled))
        raise LoadError(
            f"load_checkpoint: {reader.source} does not fit {type(model).__name__} "
            f"(full shapes, checkpoint layout):\n" + "\n".join(parts) + "\nFix: build the model "
            "from the checkpoint's own config; rename checkpoint keys with key_map= (a dict or a "
            "callable; None drops a key); or pass strict=False to skip missing and unexpected keys "
            "(mis-shaped keys and converted keys whose pieces do not assemble are always an error)"
        )
    return sources, LoadResult(missing, unexpected)


# ---- writing one tensor -------------------------------------------------------------------------
@torch.no_grad()
def _put(t: _Target, value: torch.Tensor) -> None:
    owner, attr, kind = t.owners[0]
    if kind == "sharded":
        assert t.module is not None  # set for every "sharded" target
        t.module.load_param(t.name, value)
        return
    table = "_buffers" if kind == "buffer" else "_parameters"
    cur = getattr(owner, table)[attr]
    if cur.device.type != "meta":
        cur.copy_(value)  # every tied owner holds this same tensor
        return
    new = value if kind == "buffer" else nn.Parameter(value, requires_grad=cur.requires_grad)
    for mod, a, k in t.owners:  # replace the meta tensor under every name that shares it
        getattr(mod, "_buffers" if k == "buffer" else "_parameters")[a] = new


def _fsdp_stream(
    model: nn.Module, targets: list[_Target], sources: dict[int, str], strict: bool
) -> tuple[list[tuple[int, str]], Any]:
    """The (target, source) pairs in the order to read them, and the BlockSharder that shards
    each block once filled (parallelize(fsdp=True) of a model on meta, strict loads only): the
    tensors outside the blocks first, then block after block, so a rank holds one block of its
    tp shard whole at a time. Without fsdp: checkpoint-plan order, no sharder."""
    st = parallel_state(model, required=False)
    items = list(sources.items())
    if st is None or not st.fsdp or st.sharded is not None or not strict:
        return items, None
    from ..parallel.fsdp import BlockSharder
    from ..plan.auto import blocks_of

    names = [n for n, _ in blocks_of(model)]
    index = {n: i for i, n in enumerate(names)}

    def block_of(key: str) -> str | None:
        parts = key.split(".")
        for j in range(len(parts) - 1, 0, -1):
            b = ".".join(parts[:j])
            if b in index:
                return b
        return None

    pending: dict[str, set[str]] = {}
    unfilled: set[str] = set()  # blocks with a tensor this checkpoint does not hold: left whole
    for i, t in enumerate(targets):
        for b in {block_of(k) for k in t.keys}:
            if b is None:
                continue
            if i in sources:
                pending.setdefault(b, set()).update(t.keys)
            elif not t.optional:
                unfilled.add(b)
    pending = {b: keys for b, keys in pending.items() if b not in unfilled}
    items.sort(key=lambda it: index.get(block_of(targets[it[0]].key) or "", -1))  # stable
    return items, BlockSharder(model, pending)


def _leftovers(model: nn.Module, written: set[str]) -> list[str]:
    """Names still uninitialized: never-loaded shards, meta tensors, empty materialized ones."""
    st = parallel_state(model, required=False)
    left = [n for n in (st.uninitialized if st is not None else ()) if n not in written]
    for fqn, m in sharded_modules(model).items():
        if not getattr(m, "loaded", True):
            left += [_join(fqn, n) for n in m.param_slices() if _join(fqn, n) not in written]
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]:
        if t.device.type == "meta":
            left.append(name)
    return sorted(set(left), key=left.index)


def _load(
    model: nn.Module,
    source: str | os.PathLike | Mapping[str, torch.Tensor] | CheckpointReader,
    strict: bool,
    key_map: KeyMap | None,
    progress: bool,
) -> LoadResult:
    own = not isinstance(source, CheckpointReader)
    if not own and key_map is not None:
        raise ValueError(
            "key_map= was given with an open CheckpointReader, which already maps its keys; "
            "pass key_map to open_checkpoint instead, or pass the path here"
        )
    st0 = parallel_state(model, required=False)
    if st0 is not None and st0.sharded is not None:
        raise LoadError(
            "this model is already sharded over dp by FSDP (parallelize(fsdp=True) of a model "
            "with real weights); build it under qm.empty_model() so that load_checkpoint fills "
            "it before sharding, or load the weights before parallelize"
        )
    targets = _targets(model)
    reader = (
        source if isinstance(source, CheckpointReader) else open_checkpoint(source, key_map=key_map)
    )
    try:
        stored = stored_weights(reader)
        sources, result = _plan_sources(model, reader, targets, strict, stored)
        total = sum(_nbytes(targets[i], k, reader, stored) for i, k in sources.items())
        bar = _bar(total, progress and _rank() == 0, str(reader.source))
        written: set[str] = set()
        items, sharder = _fsdp_stream(model, targets, sources, strict)
        for i, src in items:
            t = targets[i]
            if src in stored:
                put = lambda v, t=t: _put(t, v.to(dtype=t.dtype, device=t.device))  # noqa: E731
                n, how = fill_stored(stored[src], reader, _owner(t), t.dim, t.ranges, put)
                result.prequantized[t.key.rsplit(".", 1)[0]] = how
                written.update(t.keys)
                result.bytes_read += n
                if bar is not None:
                    bar.update(_nbytes(t, src, reader, stored))
                continue
            if src in reader.decoded:
                result.prequantized[t.key.rsplit(".", 1)[0]] = _decoded_how(
                    reader.decoded[src], _owner(t)
                )
            value = reader.read(src, t.dim, t.ranges, dtype=t.dtype, device=t.device)
            _put(t, value)
            del value
            written.update(t.keys)
            if sharder is not None:  # fsdp: a block whose tensors are all written is sharded
                sharder.filled(t.keys)
            n = _nbytes(t, src, reader, stored)
            result.bytes_read += n
            if bar is not None:
                bar.update(n)
        if bar is not None:
            bar.close()
    finally:
        if own:
            reader.close()
    _report_requantized(result)
    for m in sharded_modules(model).values():
        names = [_join(m.fqn, n) for n in m.param_slices()]
        if all(n in written for n in names):
            m.mark_loaded()
    st = parallel_state(model, required=False)
    if st is not None:
        st.uninitialized -= written
    left = _leftovers(model, written)
    if left:
        msg = (
            f"after loading {reader.source}, {len(left)} tensor(s) of {type(model).__name__} "
            f"hold no values: {', '.join(left[:_SHOW])}{' ...' if len(left) > _SHOW else ''}; "
            "load another checkpoint that holds them, or initialize them yourself (a buffer on "
            "meta that no checkpoint holds: build the skeleton with qm.empty_model(), which keeps "
            "buffers real)"
        )
        if strict:
            raise LoadError(msg)
        if _rank() == 0:
            warnings.warn(msg, stacklevel=3)
    return result


def _nbytes(t: _Target, src: str, reader: CheckpointReader, stored: Mapping[str, Any]) -> int:
    """Stored bytes of this rank's part of `src` (the progress bar's unit)."""
    sw = stored.get(src)
    fmt = sw.format if sw is not None else reader.decoded.get(src)
    if fmt is None:
        return t.nbytes(reader.dtype(src).itemsize)
    four = {"nf4", "fp4", "mxfp4"}  # read as values (io/encoded.py): counted at the stored width
    return t.nbytes(1) // (2 if set(fmt.split("/")) <= four else 1)


def _decoded_how(fmt: str, owner: nn.Module) -> str:
    """What loading a key read as its stored values does (`io.encoded`)."""
    if fmt in ("fp8", "mxfp4"):  # formats quantmesh does not compute in: quant= chose the model's
        return f"dequantized ({fmt} -> float, exact)" + (
            "" if getattr(owner, "fmt", None) is None else ", then quantized as the model says"
        )
    if getattr(owner, "fmt", None) is None:
        return f"dequantized ({fmt} pieces -> float, exact)"
    return (
        f"requantized: stored as one {fmt} tensor per piece (one linear per expert), fused here "
        "from their exact values and quantized again in the model's blocks (the stored values "
        "where the blocks line up and the statistics are not double-quantized)"
    )


def _report_requantized(result: LoadResult) -> None:
    redo = [m for m, how in result.prequantized.items() if how.startswith("requantized")]
    if redo:
        warnings.warn(
            f"load_checkpoint: {len(redo)} pre-quantized weight(s) were requantized on rank "
            f"{_rank()} (e.g. {redo[0]}: {result.prequantized[redo[0]]}); their values may differ "
            "from the stored ones by up to the format's rounding error. Where a tp cut splits "
            "quantization blocks, a tp whose cuts fall on blocks loads them exactly "
            "(LoadResult.prequantized says what was done per module)",
            stacklevel=4,
        )


def _bar(total: int, show: bool, what: str) -> Any:
    if not show:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is optional; loading works without a bar
        return None
    name = os.path.basename(what.rstrip("/")) or what
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=f"loading {name}")


def load_checkpoint(
    model: nn.Module,
    source: str | os.PathLike | Mapping[str, torch.Tensor] | CheckpointReader,
    *,
    strict: bool = True,
    key_map: KeyMap | None = None,
    progress: bool = True,
) -> LoadResult:
    """Fill a parallelized model (built on meta or CPU) from a checkpoint, slice by slice.

    Collective: every rank calls it (dp x tp meshes included); each reads only its own slices.
    A failure on any rank raises on every rank (no rank is left waiting).

    Args:
        source: a .safetensors / .bin / .pt file, an HF folder (index or single file), a dict of
            tensors, or an open CheckpointReader (left open).
        strict: missing and unexpected keys are an error, listed by name before anything is read;
            afterwards no parameter may be left without values. Mis-shaped keys always raise.
        key_map: renames checkpoint keys to model keys ({checkpoint key: model key or None} or a
            callable); see `quantmesh.checkpoint.open_checkpoint`.
        progress: a tqdm bar counting this rank's bytes, on global rank 0.

    Returns:
        LoadResult(missing_keys, unexpected_keys, bytes_read) of this rank.

    Example:
        >>> qm.parallelize(model, mesh, quant="nf4")                       # doctest: +SKIP
        >>> qm.load_checkpoint(model, "llama_dir").bytes_read              # doctest: +SKIP
        1073741824
    """
    err, result = None, None
    try:
        result = _load(model, source, strict, key_map, progress)
    except Exception as e:  # reported on every rank by all_ranks_ok
        err = e
    all_ranks_ok(err, "load_checkpoint")
    assert result is not None  # all_ranks_ok raised otherwise
    _shard_when_filled(model)
    return result


def _shard_when_filled(model: nn.Module) -> None:
    """parallelize(fsdp=True) of a model on meta: FSDP2 shards it once every rank's tensors hold
    values (the ranks agree first). Each rank held its whole tp shard until here."""
    st = parallel_state(model, required=False)
    if st is None or not st.fsdp or st.sharded is not None:
        return
    ready = torch.tensor([int(not _leftovers(model, set()))], device=_coll_device())
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(ready, op=dist.ReduceOp.MIN)
    if not int(ready):
        return  # a later load_checkpoint fills the rest, then shards
    from ..parallel.fsdp import apply_fsdp

    err = None
    try:
        apply_fsdp(model, st.mesh, offload=st.offload_base)
    except Exception as e:  # the same on every rank (checked before any collective); reported
        err = e
    all_ranks_ok(err, "load_checkpoint (sharding with FSDP)")
