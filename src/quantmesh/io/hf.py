"""transformers convenience: open a saved causal-LM folder straight into a parallelized model.

config -> skeleton on meta -> plan -> parallelize (TP + quant + LoRA) -> slice-streaming load. No
rank ever holds the whole model: the skeleton costs nothing and each rank reads its own slices.

Checkpoint key names are mapped to the model's the way transformers itself does for plain renames:
its own renaming rules for the model (legacy `LayerNorm.gamma` -> `.weight`, ...), then adding or
stripping the model's `base_model_prefix` (GPT-2 checkpoints saved from `GPT2Model` hold `h.0...`,
the LM head model expects `transformer.h.0...`), and dropping keys the model class declares
ignorable (`_keys_to_ignore_on_load_unexpected`, e.g. GPT-2's old `attn.bias` mask buffers).
Conversions that fuse or split tensors (transformers' WeightConverter rules: mixture-of-experts
checkpoints store one tensor per expert, the model holds them stacked) are applied slice by slice:
each rank reads only the parts of the stored tensors its slice holds (`quantmesh.io.convert`).
A conversion that is not a rearrangement of elements is refused with the op, the key and the fix.

transformers is imported only when a function here is called.

Example:
    >>> mesh = qm.init_mesh(tp=2)                                              # doctest: +SKIP
    >>> model = qm.from_pretrained("llama_dir", mesh, quant="nf4",
    ...                            lora=qm.LoraConfig(r=16, targets=["q_proj", "v_proj"]))  # doctest: +SKIP
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from ..lora.adapter import LoraConfig
from ..parallel.empty import empty_model
from ..parallel.parallelize import parallelize
from ..parallel.state import parallel_state
from ..pipeline.cut import PipelineConfig
from ..plan.plan import Plan
from ..quant.base import QuantConfig, QuantError
from .convert import Piece, check_converter
from .load import _rank, _targets, expected_keys, load_checkpoint
from .prequant import folder_quant, held_as_float, stored_weights
from .reader import open_checkpoint

if TYPE_CHECKING:
    from ..parallel.mesh import Mesh

__all__ = ["from_pretrained", "hf_key_map"]


def _transformers_renames(model: nn.Module) -> tuple[list, list]:
    """(renamings, converters) transformers would apply to this model's checkpoint keys."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:  # an older transformers without the conversion registry
        return [], []
    try:
        transforms = get_model_conversion_mapping(cast(Any, model))  # a PreTrainedModel
    except Exception:  # an internal API: never let its drift break loading plain checkpoints
        return [], []
    renames = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    return renames, converters


def hf_key_map(model: nn.Module) -> Callable[[str], str | Piece | None]:
    """A key_map for `load_checkpoint` that maps a transformers checkpoint's keys onto `model`.

    Plain renames give the model key. A stored key that transformers would convert on load (a
    mixture-of-experts checkpoint's per-expert `mlp.experts.3.up_proj.weight`, stacked and
    concatenated into the model's fused `mlp.experts.gate_up_proj`) gives a
    `quantmesh.io.convert.Piece`: the reader assembles the pieces into the fused tensor and reads
    each rank's slice from the parts of the stored tensors it holds. Raises NotImplementedError
    (when called on such a key) for a conversion that is not a rearrangement of elements.

    Example:
        >>> qm.load_checkpoint(model, "gpt2_dir", key_map=hf_key_map(model))  # doctest: +SKIP
    """
    targets = _targets(model)
    shapes = {k: t.shape for t in targets for k in t.keys}
    want = set(expected_keys(model))
    st = parallel_state(model, required=False)
    if st is not None and st.mesh.pp > 1:  # other stages' keys: theirs to load, not unexpected
        from ..pipeline.parts import elsewhere_keys

        want |= elsewhere_keys(model)
    prefix = getattr(model, "base_model_prefix", "") or ""
    ignore = [
        re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []
    ]
    renames, converters = _transformers_renames(model)
    config = getattr(model, "config", None)

    def in_model(k: str) -> str | None:
        if k in want:
            return k
        if prefix and f"{prefix}.{k}" in want:  # a base-model checkpoint into an LM head model
            return f"{prefix}.{k}"
        if prefix and k.startswith(prefix + ".") and k[len(prefix) + 1 :] in want:
            return k[len(prefix) + 1 :]
        return None

    def rename(key: str) -> str | Piece | None:
        k = key
        if k not in want:
            for t in renames:
                k, _ = t.rename_source_key(k)
        found = in_model(k)
        if found is not None:
            return found
        if any(p.search(key) for p in ignore):  # only keys the model has no place for
            return None
        for c in converters:
            target, pattern = c.rename_source_key(k)
            if pattern is None:
                continue
            check_converter(c, key, type(model).__name__)
            fused = in_model(target)
            if fused is None:
                return key  # the model has no place for it: reported as unexpected
            return Piece(fused, pattern, k, c, config, shapes)
        return key

    return rename


def _config_dtype(config: Any) -> torch.dtype | None:
    dt = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dt, str):
        dt = getattr(torch, dt, None)
    return dt if isinstance(dt, torch.dtype) and dt.is_floating_point else None


def _say_float_experts(path: Path, model: nn.Module, stored: set[str], fmt: str) -> None:
    """Warn (rank 0) when a folder loaded as stored keeps experts in float: transformers 5's
    bitsandbytes quantizes linears only, so its folders hold quantized attention and float
    experts, most of a mixture of experts' bytes."""
    import warnings

    from ..tp.experts import find_experts

    floats = sorted(set(find_experts(model)) - stored)
    if floats and _rank() == 0:
        warnings.warn(
            f"{path} stores {len(floats)} experts module(s) in float (e.g. {floats[0]}), beside "
            f"layers quantized as {fmt}: they stay float as stored (transformers' bitsandbytes "
            f"quantizes linear layers only). Pass quant={fmt!r} to quantize the experts too",
            stacklevel=3,
        )


def from_pretrained(
    path: str | os.PathLike,
    mesh: Mesh,
    *,
    quant: str | QuantConfig | None = None,
    lora: LoraConfig | None = None,
    dtype: torch.dtype | None = None,
    plan: Plan | dict[str, str] | None = None,
    progress: bool = True,
    pipeline: PipelineConfig | None = None,
    fsdp: bool = False,
    offload_base: bool = False,
) -> nn.Module:
    """A transformers causal LM from a local folder, parallelized over `mesh` and loaded by slices.

    Collective: every rank calls it. The model comes back in eval mode, as transformers'
    `from_pretrained` returns it (call `model.train()` to fine-tune), with the folder's
    `generation_config.json` as `model.generation_config` when there is one.

    Args:
        path: a folder written by `save_pretrained` (config.json + safetensors or .bin weights),
            float or saved quantized by bitsandbytes (nf4 / fp4 / int8: a `quantization_config`
            in config.json; other quantization methods are refused with the fix).
        quant, lora, plan: as in `qm.parallelize`; plan None = `qm.auto_plan`. For a
            bitsandbytes folder quant None means "as stored" (the layers stored quantized stay
            so, with their stored codes where the tp cuts fall on blocks); a quant naming another
            format is an error.
        dtype: the float dtype of the weights; None = the config's `dtype` (float32 if unset).
        progress: a tqdm bar of bytes read, on global rank 0.
        pipeline: at pp > 1, the stage cut (`qm.PipelineConfig`); each stage reads only its keys.
        fsdp, offload_base: as in `qm.parallelize`; the model is sharded once loaded.

    Example:
        >>> model = qm.from_pretrained("llama_dir", mesh, quant="nf4")  # doctest: +SKIP
        >>> model.generate(ids, max_new_tokens=8)                        # doctest: +SKIP
    """
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"from_pretrained({str(path)!r}): no config.json there; expected a folder written by "
            "save_pretrained (download a hub model first, e.g. huggingface_hub.snapshot_download)"
        )
    config = AutoConfig.from_pretrained(path)
    qcfg = folder_quant(path, quant)  # refuses quantization methods it cannot read
    dtype = dtype or _config_dtype(config) or torch.float32
    with empty_model():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.config._name_or_path = str(path)  # save_adapter writes it as base_model_name_or_path
    grows = held_as_float(path)
    if quant is None and grows is not None and _rank() == 0:
        import warnings

        warnings.warn(
            f"{grows} (quant=None: {dtype}). Pass quant='nf4' (or 'int8') to quantize them on "
            "the ranks as they load",
            stacklevel=2,
        )
    if quant is None and qcfg is not None:  # as stored: exactly the layers saved quantized
        with open_checkpoint(path, key_map=hf_key_map(model)) as ckpt:
            stored = {sw.module for sw in stored_weights(ckpt).values()}
            # experts stored one quantized linear each, fused here: their module quantizes again
            stored |= {k.rsplit(".", 1)[0] for k in ckpt.decoded}
            qcfg.targets = sorted(stored)
        _say_float_experts(path, model, stored, qcfg.format)
        if not qcfg.targets:
            raise QuantError(
                f"{path}/config.json has a bitsandbytes quantization_config, but the checkpoint "
                "holds no quantized weights; remove quantization_config from config.json and "
                f"pass quant={qcfg.format!r} to quantize the float weights after slicing"
            )
        qcfg.skip = []
    parallelize(model, mesh, plan=plan, quant=qcfg, lora=lora, dtype=dtype, pipeline=pipeline,
                fsdp=fsdp, offload_base=offload_base)  # fmt: skip
    load_checkpoint(model, path, key_map=hf_key_map(model), progress=progress)
    if (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path)
    loaded: nn.Module = model.eval()
    return loaded
