"""`import quantmesh` pulls in no optional integration; its public names resolve."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys

import quantmesh

# In a fresh interpreter: what `import quantmesh` (and the mesh, what every program uses next)
# loads. A cheap import is a structural property (no optional integration at import time), checked
# as such: a timed assertion would pass or fail with the machine's load.
_LOADED = """
import json, sys
import torch
before = set(sys.modules)
import quantmesh
loaded_by_import = sorted({m.split(".")[0] for m in set(sys.modules) - before})
from quantmesh import Mesh, MeshError, init_mesh
loaded_by_mesh = sorted({m.split(".")[0] for m in set(sys.modules) - before})
print(json.dumps({"after_import": loaded_by_import, "after_mesh": loaded_by_mesh}))
"""

# Optional integrations: loaded only by the modules that use them, when they are used.
HEAVY = (
    "bitsandbytes", "transformers", "peft", "torchao", "accelerate", "datasets", "pyarrow",
    "fastapi", "uvicorn", "openai", "lm_eval", "triton", "safetensors",
)  # fmt: skip


def test_import_loads_no_optional_integration() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _LOADED], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "quantmesh" in r["after_import"]  # the probe saw the import at all
    assert not set(HEAVY) & set(r["after_import"]), r["after_import"]
    assert not set(HEAVY) & set(r["after_mesh"]), r["after_mesh"]


def test_version_matches_the_installed_distribution() -> None:
    assert quantmesh.__version__ == importlib.metadata.version("quantmesh")


def test_every_public_name_resolves() -> None:
    # __all__ is what `from quantmesh import *` promises; each lazy export must exist.
    missing = [n for n in quantmesh.__all__ if not hasattr(quantmesh, n)]
    assert missing == [], f"quantmesh.__all__ lists names that do not resolve: {missing}"
    assert set(dir(quantmesh)) >= set(quantmesh.__all__)


def test_public_functions_are_not_shadowed_by_submodules():
    """Importing every submodule first (as other modules do) must not turn a public function into
    the module of the same name (Python sets package attributes on submodule import)."""
    import importlib
    import pkgutil

    import quantmesh as qm

    for info in pkgutil.walk_packages(qm.__path__, "quantmesh."):
        if ".cli" in info.name or info.name.rsplit(".", 1)[-1].startswith("_"):
            continue  # a private module shadows no public name (_triton4 needs Triton: GPU only)
        importlib.import_module(info.name)
    import types

    for name in qm.__all__:
        assert not isinstance(getattr(qm, name), types.ModuleType), name
