# Two entry points for a fresh machine: `make demo` and `make test`.
# Both create (or reuse) the local virtualenv .venv and install pinned versions by themselves.
# torch is installed first and pinned in every pip call: an unpinned torch pulls a multi-GB CUDA build.
PYTHON ?= python3
TORCH ?= 2.13.0
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.quantmesh-installed

.PHONY: demo test test-fast lint format venv clean

$(STAMP): pyproject.toml requirements.lock
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==$(TORCH)
	$(PIP) install -q torch==$(TORCH) -r requirements.lock
	$(PIP) install -q --no-deps -e .
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/quantmesh demo

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/ruff format --check src tests benchmarks examples
	$(PY) -m mypy

format: $(STAMP)
	$(VENV)/bin/ruff check --fix src tests benchmarks examples
	$(VENV)/bin/ruff format src tests benchmarks examples

# Two workers (pytest-xdist): a module runs whole on one worker (--dist loadfile), handed out in
# the order tests/conftest.py sets (the CLI runs, then the other modules with slow tests, first;
# --no-loadscope-reorder: xdist would hand out the modules with the most tests first, leaving the
# long CLI modules, which hold few tests each, to the end). TEST_WORKERS=0: serially.
# QUANTMESH_COMPILE_BACKEND=aot_eager: the CPU compiles trace (dynamo, AOT autograd: what our code
# meets) without inductor's code generation, most of a cold run's compile time; the tests of
# inductor's own choices (what compiled blocks save, compiled tiles' memory and gradients) name it.
TEST_WORKERS ?= 2

test: lint
	QUANTMESH_COMPILE_BACKEND=aot_eager $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not cuda" --durations=25 tests

# The inner loop: lint, then every test but the slow ones (the CLI end-to-end runs, the demo and
# its assets, the benchmark smokes, CPU compiles, the tp=4, recompute and hf launches of 4 ranks,
# the MoE folder loads, the 512 MiB load, the Triton interpreter's long families). `make test` stays the full suite: it runs every slow test.
test-fast: lint
	QUANTMESH_COMPILE_BACKEND=aot_eager $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not cuda and not slow" tests

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
