"""What every worker imports, imported once by the fork server that workers start from on Linux
hosts without CUDA (cli/launch.py): each worker is then a fork of a process that already holds
torch, transformers and bitsandbytes, instead of a fresh interpreter importing them (several
seconds of CPU per rank, paid by every rank of every launch).

Imported for its effect, by name, through `multiprocessing.set_forkserver_preload`. Not on hosts
with CUDA: bitsandbytes initializes CUDA when it is imported, and a process that has initialized
CUDA cannot hand it to processes forked from it.
"""

from __future__ import annotations

import importlib

from .worker import worker_environment

__all__ = ["MODULES"]

# The libraries every worker command imports, then quantmesh's own layers; Llama's modeling (the
# most common architecture, and the demo's), other architectures load in the worker.
MODULES = (
    "torch",
    "transformers",
    "transformers.modeling_utils",
    "transformers.models.llama.modeling_llama",
    "bitsandbytes",
    "bitsandbytes.functional",
    "quantmesh",
    "quantmesh.io.load",
    "quantmesh.parallel.parallelize",
    "quantmesh.train.loop",
    "quantmesh.train.data",
)

worker_environment()
for _name in MODULES:
    try:
        importlib.import_module(_name)
    except Exception:  # noqa: BLE001 - absent or broken: the worker imports it again and says why
        pass
