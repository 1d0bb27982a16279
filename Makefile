# The one entry point for people and CI. Every target installs what it needs first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# torch for the dev venv: the CPU build, never a multi-GB CUDA download. On Linux the pin names the
# CPU build itself (torch==X+cpu: only CPU-only wheels carry that local version, so no index can hand
# pip a CUDA build), taken from WHEELS where that folder exists (this machine) and else from
# TORCH_INDEX, PyTorch's CPU-only index (torch's own dependencies still come from PyPI). Elsewhere
# (macOS) PyPI's torch is the CPU build already. A venv that already has torch keeps it.
# pyproject.toml itself only asks for torch>=2.4.
TORCH_VERSION ?= 2.13.0
WHEELS ?= /opt/wheels
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_SOURCE := $(if $(wildcard $(WHEELS)),--find-links $(WHEELS),--extra-index-url $(TORCH_INDEX))

.PHONY: install demo test test-serial test-fast test-unit test-loaded coverage lint proto bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	if $(BIN)/python -c "import torch" 2>/dev/null; then echo "keeping the venv's torch"; \
	elif [ "$$(uname -s)" = Linux ]; then $(BIN)/python -m pip install --progress-bar off $(TORCH_SOURCE) "torch==$(TORCH_VERSION)+cpu"; \
	else $(BIN)/python -m pip install --progress-bar off "torch==$(TORCH_VERSION)"; fi
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/dreamp2p demo

# The suite on pytest-xdist workers, two per core: most multi-process tests spend their time waiting (on
# timeouts, heartbeats, shaped links), so twice the cores keeps the CPUs busy. One test at a time per worker
# (--maxschedchunk 1): the slow tests, sorted first (tests/conftest.py), spread over every worker instead of
# landing in one worker's first chunk. The 15 slowest tests are listed at the end: where the suite's time goes.
TEST_WORKERS ?= $(shell $(PY) -c 'import os; print(2 * (os.cpu_count() or 1))')
test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist load --maxschedchunk 1 --durations 15

# the whole suite in one process, in order: for reading a failure without other tests' load beside it
test-serial: $(STAMP)
	$(BIN)/python -m pytest -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

test-unit: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

# line coverage of the in-process tests (the daemons' own processes are not traced)
coverage: $(STAMP)
	$(BIN)/python -m pytest -q -n auto --cov=dreamp2p --cov-report=term tests/unit

# the slow multi-process tests with a busy process on every core beside them
test-loaded: $(STAMP)
	$(BIN)/python -m dreamp2p.devtools.cpuhog -- $(BIN)/python -m pytest -q -m slow

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy dreamp2p
	BIN=$(BIN) .ci/lint-deploy

proto: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. proto/dreamp2p/v1/peer.proto

bench: $(STAMP)
	$(BIN)/dreamp2p bench codec --json
	$(BIN)/dreamp2p bench transport --json
	$(BIN)/dreamp2p bench allreduce --json --peers 4 --mbytes 64

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis .coverage report runs
