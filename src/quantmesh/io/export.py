"""export: an unsharded transformers-style folder from a parallelized (quantized, LoRA) model.

Tensor by tensor, in model order: the ranks of the first data-parallel replica gather one
module's shards over tp (quantized weights dequantized first), LoRA is merged in
(W + scale * B @ A, transposed for Conv1D's (in, out) layout; an experts module's per-expert
adapters into each expert of its fused tensors, `ShardedExperts.merged_local`), and global rank 0
appends the result to the current safetensors shard file, which is written and freed once it
reaches `max_shard_size`. So rank 0 holds at most one shard file's worth plus one module (a
transformers model: one repeated block, see below), never the model.

The folder: `model.safetensors` (or `model-0000i-of-0000N.safetensors` + the index json),
`config.json` and `generation_config.json` when the model has a transformers config. Tied weights
are written once, as transformers does (`lm_head.weight` is left out when tied to the embedding);
if merging LoRA or quantizing made the tied tensors differ, both are written and the config says
`tie_word_embeddings: false`.
A transformers model's tensors are written in the stored layout its `save_pretrained` writes
(transformers' `revert_weight_conversion`, one repeated block at a time: a mixture of experts'
fused expert tensors as one tensor per expert, as on the Hub), so that tools reading Hub
checkpoints read the folder too.

Example:
    >>> qm.export(model, "out/merged")                             # doctest: +SKIP
    >>> AutoModelForCausalLM.from_pretrained("out/merged")         # doctest: +SKIP
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..parallel.state import parallel_state
from ..plan.auto import blocks_of
from ..tp.experts import ShardedExperts
from ..tp.gather import module_tensors
from ..tp.layers import ShardedModule
from .full import _refuse_fsdp
from .load import _Target, _targets
from .save import (
    ShardWriter,
    _Rank0Writer,
    agreed,
    collective_save,
    full_tensor,
    in_first_replica,
    parse_size,
)

__all__ = ["export"]


def _merged(m: ShardedModule, name: str, local: torch.Tensor, merge: bool) -> torch.Tensor:
    """Full tensor `name` of `m` in checkpoint layout, LoRA merged into the weight (an experts
    module's per-expert adapters into its expert tensors). Collective."""
    if isinstance(m, ShardedExperts):  # per-expert adapters, merged in this rank's slice
        return full_tensor(m, name, m.merged_local(name, local) if merge else local)
    t = full_tensor(m, name, local)
    if name != "weight" or not merge or m.lora is None:
        return t
    a = full_tensor(m, "lora_A.weight").float()  # (r, in)
    b = full_tensor(m, "lora_B.weight").float()  # (out, r)
    delta = (b @ a) * m.lora.scale  # (out, in)
    if m.kind.name == "Conv1D":  # checkpoint layout (in, out)
        delta = delta.t()
    return (t.float() + delta).to(t.dtype)


class _StoredLayout:
    """Hands each (name, tensor) to `add` in the layout transformers' `save_pretrained` stores:
    its `revert_weight_conversion` (the model's conversion mapping run backwards) over one
    repeated block's tensors at a time, since a conversion's tensors (an expert's gate and up, a
    fused q|k|v) all live in one block; other tensors one by one. Without a reverter (not a
    transformers model, or a transformers without one) the names go through as they are."""

    def __init__(self, model: nn.Module, add: Any, hf: bool) -> None:
        self.model, self.add = model, add
        self.revert: Any = None
        if hf:
            try:
                from transformers.core_model_loading import revert_weight_conversion

                self.revert = revert_weight_conversion
            except ImportError:  # a transformers before conversion mappings: names as they are
                pass
        self.blocks = [f"{n}." for n, _ in blocks_of(model)]
        self.block: str | None = None
        self.pending: dict[str, torch.Tensor] = {}

    def put(self, name: str, value: torch.Tensor) -> None:
        if self.revert is None:
            self.add(name, value)
            return
        block = next((b for b in self.blocks if name.startswith(b)), None)
        if block != self.block:
            self.flush()
            self.block = block
        self.pending[name] = value
        if block is None:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            for name, value in self.revert(self.model, self.pending).items():
                self.add(name, value.contiguous())
        self.pending = {}


def _is_hf(model: nn.Module) -> bool:
    return hasattr(getattr(model, "config", None), "to_json_string")


def _tensors(
    model: nn.Module, merge: bool, dtype: torch.dtype | None
) -> Iterator[tuple[list[str], torch.Tensor, Any]]:
    """(names, full tensor, target) in model order; every rank of the first replica runs it (it
    gathers). `names` are all the keys that share the tensor (tied weights), first one first."""
    done: dict[int, dict[str, torch.Tensor]] = {}  # dequantized locals, per module
    for t in _targets(model):
        kind = t.owners[0][2]
        if kind == "lora":
            continue  # merged into its base weight (or left out: base only)
        if kind == "sharded":
            m = t.module
            assert m is not None  # set for every "sharded" target
            if id(m) not in done:
                done.clear()  # one module's dequantized tensors at a time
                done[id(m)] = module_tensors(m)
            value = _merged(m, t.name, done[id(m)][t.name], merge)
            cast = dtype or m.float_dtype
        else:
            owner, attr, _ = t.owners[0]
            value = getattr(owner, "_buffers" if kind == "buffer" else "_parameters")[attr]
            value = value.detach()
            cast = dtype or value.dtype
        if value.is_floating_point():
            value = value.to(cast)
        yield list(t.keys), value, t


def _tie_views(model: nn.Module, t: _Target, merge: bool) -> bool:
    """True when every name of a tied target shows the same values (no LoRA merged into any)."""
    if not merge:
        return True
    return all(
        not (isinstance(mod, ShardedModule) and mod.lora is not None) for mod, _, _ in t.owners
    )


def _save_configs(model: nn.Module, folder: Path, dtype: torch.dtype | None, untied: bool) -> None:
    cfg: Any = copy.deepcopy(model.config)  # a transformers PreTrainedConfig
    cfg.architectures = [type(model).__name__]
    cfg.__dict__.pop("quantization_config", None)  # the folder holds float weights
    if dtype is not None:
        cfg.dtype = dtype
    if untied and getattr(cfg, "tie_word_embeddings", False):
        cfg.tie_word_embeddings = False
    cfg.save_pretrained(folder)
    gen = getattr(model, "generation_config", None)
    if gen is not None and hasattr(gen, "save_pretrained"):
        gen.save_pretrained(folder)


def export(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    merge_lora: bool = True,
    dtype: torch.dtype | None = None,
    max_shard_size: int | str = "2GB",
) -> None:
    """Write an unsharded, dequantized, LoRA-merged safetensors folder that transformers opens.

    Collective: every rank calls it; global rank 0 writes `path` atomically; all return after.

    Args:
        merge_lora: add scale * B @ A into each adapted weight; False writes the base only (save
            the adapters with `qm.save_adapter`).
        dtype: float dtype of the written tensors; None = each module's own (quantized modules:
            the dtype they were quantized from).
        max_shard_size: bytes per safetensors file ("2GB", "500MB" or an int).

    Example:
        >>> qm.export(model, "out/merged", dtype=torch.bfloat16)  # doctest: +SKIP
    """

    def check() -> int:
        pst = parallel_state(model, required=False)
        if pst is not None and pst.mesh.pp > 1:  # one stage per rank: the export would be partial
            raise NotImplementedError(
                f"export at pp={pst.mesh.pp}: each rank holds only its pipeline stage, and "
                f"writing the stages into one model folder is not implemented; save the adapter "
                f"(qm.save_adapter works at any pp) and export it at pp=1"
            )
        _refuse_fsdp(model, "export")
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"dtype={dtype!r}; pass a float torch dtype such as torch.bfloat16")
        return parse_size(max_shard_size)

    max_bytes = agreed(check, "export")
    hf = _is_hf(model)
    st = parallel_state(model, required=False)
    tied_groups = [set(g) for g in (st.tied if st is not None else [])]

    def produce(w: _Rank0Writer) -> None:
        untied = False
        if in_first_replica(model):
            writer = ShardWriter(w.folder, "model", max_bytes) if w.folder is not None else None
            stored = _StoredLayout(model, writer.add if writer is not None else None, hf)
            written: set[str] = set()
            for names, value, t in _tensors(model, merge_lora, dtype):
                if hf and _tie_views(model, t, merge_lora):
                    names = names[:1]  # transformers re-ties the others from the config
                elif len(names) > 1:
                    untied = True
                for n in names:
                    # a tie that parallelize broke (a quantized head): both sides are written
                    if any(n in g and (g - {n}) & written for g in tied_groups):
                        untied = True
                    if writer is not None:
                        w.run(stored.put, n, value)
                    written.add(n)
                del value
            if writer is not None:
                w.run(stored.flush)
                w.run(writer.close)
        if hf and w:
            w.run(_save_configs, model, w.folder, dtype, untied)

    collective_save(path, produce, "export")
