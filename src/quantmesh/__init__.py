"""quantmesh: quantized + LoRA training and serving of any PyTorch model over dp x tp meshes.

Example:
    >>> import quantmesh as qm
    >>> mesh = qm.init_mesh(tp=2)                      # doctest: +SKIP
    >>> with qm.empty_model():                         # doctest: +SKIP
    ...     model = MyModel(cfg)
    >>> qm.parallelize(model, mesh, quant="nf4", lora=qm.LoraConfig(r=16))  # doctest: +SKIP

Names are imported lazily: `import quantmesh` costs little on top of `import torch`, and optional
integrations (bitsandbytes, transformers, peft, torchao) load only when used.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "QuantmeshError": "errors",
    "Mesh": "parallel.mesh",
    "MeshError": "parallel.mesh",
    "init_mesh": "parallel.mesh",
    "empty_model": "parallel.empty",
    "Plan": "plan.plan",
    "PlanError": "plan.plan",
    "auto_plan": "plan.auto",
    "SplitForwardError": "parallel.parallelize",
    "parallelize": "parallel.parallelize",
    "QuantConfig": "quant.base",
    "QuantError": "config",
    "LoraConfig": "config",
    "LoraError": "config",
    "trainable_parameters": "lora.adapter",
    "apply_dp": "parallel.dp",
    "compile_blocks": "blocks.compile",
    "checkpoint_blocks": "blocks.recompute",
    "chunked_loss_sum": "train.loss",
    "build_dataset": "train.data",
    "shared_dataset": "train.data",
    "iterate_batches": "train.data",
    "DataError": "train.data",
    "greedy_decode": "infer.decode",
    "fast_decode": "infer.decode",
    "no_sync": "parallel.dp",
    "train_step": "train.step",
    "PipelineConfig": "config",
    "PipelineError": "config",
    "split_layers": "parallel.layersplit",
    "full_state_dict": "io.full",
    "clip_grad_norm_": "train.clip",
    "load_checkpoint": "io.load",
    "from_pretrained": "io.hf",
    "save_adapter": "io.adapter",
    "load_adapter": "io.adapter",
    "save_state": "io.resume",
    "load_state": "io.resume",
    "export": "io.export",
    "verify_plan": "parallel.verify",
    "VerifyReport": "parallel.verify",
    "estimate_memory": "plan.memory",
    "keep_dequantized": "parallel.held",
    "MemoryEstimate": "plan.memory",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'quantmesh' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{mod}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
