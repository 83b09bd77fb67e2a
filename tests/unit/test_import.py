"""`import quantmesh` stays cheap next to `import torch`, and pulls in no optional integration."""

from __future__ import annotations

import importlib.metadata
import json
import statistics
import subprocess
import sys

import quantmesh

# Each measurement runs in a fresh interpreter: torch first, then quantmesh, timed separately in the
# same process. Timing the two imports side by side (rather than two separate processes, one with
# and one without quantmesh) cancels out how loaded the machine is at that moment.
_MEASURE = """
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import quantmesh
t2 = time.perf_counter()
loaded_by_import = sorted(m.split(".")[0] for m in sys.modules)
from quantmesh import Mesh, MeshError, init_mesh
t3 = time.perf_counter()
loaded_by_mesh = sorted(m.split(".")[0] for m in sys.modules)
print(json.dumps({"torch_s": t1 - t0, "quantmesh_s": t2 - t1, "mesh_s": t3 - t2,
                  "after_import": loaded_by_import, "after_mesh": loaded_by_mesh}))
"""

# Optional integrations: loaded only by the modules that use them, when they are used.
HEAVY = ("bitsandbytes", "transformers", "peft", "torchao", "accelerate")


def _measure() -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _MEASURE], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_adds_under_a_second_to_torch_and_loads_no_optional_integration() -> None:
    runs = [_measure() for _ in range(3)]
    added = statistics.median(r["quantmesh_s"] for r in runs)
    torch_s = statistics.median(r["torch_s"] for r in runs)
    assert added < 1.0, (
        f"import quantmesh added {added:.2f} s (median of 3) to torch's {torch_s:.2f} s"
    )
    # What every program does next; mesh.py must stay as light as the package.
    with_mesh = statistics.median(r["quantmesh_s"] + r["mesh_s"] for r in runs)
    assert with_mesh < 1.0, f"import quantmesh + init_mesh took {with_mesh:.2f} s (median of 3)"
    for r in runs:
        assert not set(HEAVY) & set(r["after_import"]), "loaded by `import quantmesh`"
        assert not set(HEAVY) & set(r["after_mesh"]), "loaded by `from quantmesh import init_mesh`"


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
