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

.PHONY: install demo test test-parallel test-fast test-unit test-loaded coverage lint proto bench clean

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

test: $(STAMP)
	$(BIN)/python -m pytest -q

# the suite on one worker per core (pytest-xdist; an idle worker steals queued tests): 17 min here instead of
# 27, but the load it adds still makes a multi-process test fail now and then (issue 35), so CI runs make test
test-parallel: $(STAMP)
	$(BIN)/python -m pytest -q -n auto --dist worksteal

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
