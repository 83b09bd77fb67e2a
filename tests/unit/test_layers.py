"""Every import inside the package against the layer table of docs/design.md.

The table ("The tree, and what each part may import") gives each module (or folder) a layer; a
module may import only from its own layer or a lower one. This test reads the table from the doc
itself, parses every module under src/quantmesh with `ast` (module-level imports, imports inside
functions and `if TYPE_CHECKING:` imports alike) and fails on any import that runs upward and is
not one of the exceptions below, each with its reason. A module missing from the table fails too,
so the doc and the tree stay one picture.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src" / "quantmesh"
DESIGN = REPO / "docs" / "design.md"

# Imports that run upward on purpose, (importer, imported) -> why. Each must be lazy (inside a
# function) or for annotations only (`if TYPE_CHECKING:`), so no import cycle exists at run time;
# an entry that no longer matches any import fails `test_every_exception_is_still_needed`. None
# today: the last ones (tp_sharded, gather_param in io/full.py) moved to their home, tp/gather.py.
EXCEPTIONS: dict[tuple[str, str], str] = {}

# Modules outside the table: the package's own entry points.
ENTRY_POINTS = {
    "__init__.py": "the public facade: names are imported lazily by importlib, from every layer",
    "__main__.py": "`python -m quantmesh`: runs the CLI",
}

# Importing the facade (`import quantmesh`) reaches every layer; only the top layer may.
TOP = 6


def _table() -> dict[str, int]:
    """{module path or folder/ relative to src/quantmesh: layer} from docs/design.md."""
    text = DESIGN.read_text()
    block = text.split("## The tree, and what each part may import", 1)[1].split("```")[1]
    table: dict[str, int] = {}
    layer = None
    for line in block.splitlines():
        if m := re.match(r"^(\d)\s", line):
            layer = int(m.group(1))
        if m := re.match(r"^(?:\d)?\s+(\S+\.py|\S+/)\s", line + " "):
            assert layer is not None, f"a module before any layer number: {line!r}"
            table[m.group(1)] = layer
    return table


TABLE = _table()
MODULES = sorted(p.relative_to(SRC).as_posix() for p in SRC.rglob("*.py"))


def _layer(rel: str) -> int | None:
    if rel in TABLE:
        return TABLE[rel]
    parts = rel.split("/")
    for i in range(len(parts) - 1, 0, -1):
        folder = "/".join(parts[:i]) + "/"
        if folder in TABLE:
            return TABLE[folder]
    if parts[-1] == "__init__.py" and len(parts) > 1:  # a subpackage: its lowest module's layer
        inside = [v for k, v in TABLE.items() if k.startswith("/".join(parts[:-1]) + "/")]
        return min(inside) if inside else None
    return None


def _module(parts: list[str]) -> str | None:
    """The module file a dotted path (relative to the package, as parts) names, if any."""
    for cand in ("/".join(parts) + ".py", "/".join([*parts, "__init__.py"])):
        if cand in MODULES:
            return cand
    return None


def _imports(rel: str, source: str | None = None) -> list[tuple[str, int]]:
    """(imported module, line) for every quantmesh import of the module at `rel` (its file, or
    `source` read as if it were that module)."""
    tree = ast.parse((SRC / rel).read_text() if source is None else source)
    package = rel.split("/")[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "quantmesh" or alias.name.startswith("quantmesh."):
                    target = _module(alias.name.split(".")[1:])
                    if target:
                        found.append((target, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                name = node.module or ""
                if name != "quantmesh" and not name.startswith("quantmesh."):
                    continue
                base = name.split(".")[1:]
            else:
                base = package[: len(package) - (node.level - 1)]
                base += node.module.split(".") if node.module else []
            for alias in node.names:  # `from . import save` imports the module save.py
                target = _module([*base, alias.name]) or _module(base)
                if target:
                    found.append((target, node.lineno))
    return found


def _upward(rel: str, source: str | None = None) -> list[tuple[str, str, int]]:
    """(importer, imported, line) of each import of `rel` that runs upward."""
    mine = _layer(rel)
    assert mine is not None, rel
    out = []
    for target, line in _imports(rel, source):
        if target == "__init__.py":
            if mine < TOP:
                out.append((rel, target, line))
            continue
        theirs = _layer(target)
        if theirs is not None and theirs > mine:
            out.append((rel, target, line))
    return out


def _violations() -> list[tuple[str, str, int]]:
    return [v for rel in MODULES if rel not in ENTRY_POINTS for v in _upward(rel)]


def test_the_table_parses_and_names_the_layers() -> None:
    # a few fixed points, so a change of the doc's layout cannot turn this test into nothing
    assert TABLE["parallel/mesh.py"] == 0 and TABLE["errors.py"] == 0
    assert TABLE["parallel/state.py"] == 4 and TABLE["train/step.py"] == 5 and TABLE["cli/"] == 6
    assert len(TABLE) > 40


def test_every_module_has_a_layer() -> None:
    missing = [r for r in MODULES if r not in ENTRY_POINTS and _layer(r) is None]
    assert missing == [], f"add these to the table in docs/design.md: {missing}"


def test_no_import_runs_upward() -> None:
    bad = [
        f"{rel}:{line} imports {target} (layer {_layer(rel)} -> {_layer(target)})"
        for rel, target, line in _violations()
        if (rel, target) not in EXCEPTIONS
    ]
    assert bad == [], "\n".join(bad)


def test_every_exception_is_still_needed() -> None:
    seen = {(rel, target) for rel, target, _ in _violations()}
    assert set(EXCEPTIONS) <= seen, f"no longer needed: {sorted(set(EXCEPTIONS) - seen)}"


def test_the_parallel_state_depends_on_nothing_above_it() -> None:
    """parallel/state.py sits under everything that reads the state: no module it imports
    (annotations included) imports it back, and of its own layer only parallel/verify.py, for the
    annotation of ParallelState.verify (parallel/fsdp.py once was one, for FsdpConfig, which now
    lives in the state's module)."""
    imported = {t for t, _ in _imports("parallel/state.py")}
    same = {t for t in imported if _layer(t) == TABLE["parallel/state.py"]}
    assert same <= {"parallel/verify.py"}, same
    for target in imported:
        assert "parallel/state.py" not in {t for t, _ in _imports(target)}, target


def test_the_checker_finds_an_upward_import() -> None:
    """Relative imports resolve as Python resolves them, lazy and TYPE_CHECKING ones included:
    a layer-0 module that imported the CLI and the loader would be caught."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "from ..errors import QuantmeshError\n"
        "if TYPE_CHECKING:\n"
        "    from ..cli.errors import CliError\n"
        "def f():\n"
        "    from ..io import load\n"
        "    import quantmesh\n"
    )
    got = [(t, line) for _, t, line in _upward("parallel/mesh.py", source)]
    assert got == [("cli/errors.py", 4), ("io/load.py", 6), ("__init__.py", 7)]


# A GPU named in the package is a measurement written into the code: those live in
# docs/benchmarks.md ("Figures the code relies on"), with their date, machine and run.
GPU_NAMES = re.compile(r"\b(?:[ABHLV]\d{2,3}[A-Z]?|RTX ?\d{4}|GB?\d{3})\b")


def _gpu_mentions(text: str) -> list[str]:
    text = re.sub(r"noqa: *[A-Z]+\d+(?:, *[A-Z]+\d+)*", "", text)  # a linter's codes (B036)
    return [m.group(0) for m in GPU_NAMES.finditer(text)]


def test_no_measurement_rides_in_the_code() -> None:
    found = [(rel, n + 1, name) for rel in MODULES
             for n, line in enumerate((SRC / rel).read_text().splitlines())
             for name in _gpu_mentions(line)]  # fmt: skip
    assert found == [], (
        f"GPU names in the package (a figure belongs in docs/benchmarks.md, 'Figures the code "
        f"relies on', with the code pointing there): {found[:10]}"
    )


def test_the_measurement_check_sees_gpu_names() -> None:
    assert _gpu_mentions("on one H200: 7.5 ms; an A100, an RTX 4090, a GB200, an L40S") == [
        "H200", "A100", "RTX 4090", "GB200", "L40S"
    ]  # fmt: skip
    assert _gpu_mentions("bf16 on cuda:0, x.H, int4, sm90  # noqa: B036, B010") == []
