# The one entry point for people and CI. Every target installs what it needs first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# pip must take the torch CPU wheel lying on disk, never a multi-GB CUDA build.
WHEELS ?= /opt/wheels

.PHONY: install demo test test-fast test-unit test-loaded lint proto bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(if $(wildcard $(WHEELS)),--find-links $(WHEELS)) "torch==2.13.0"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/dreamp2p demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

test-unit: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

# the slow multi-process tests with a busy process on every core beside them
test-loaded: $(STAMP)
	$(BIN)/python -m dreamp2p.devtools.cpuhog -- $(BIN)/python -m pytest -q -m slow

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy dreamp2p

proto: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. proto/dreamp2p/v1/peer.proto

bench: $(STAMP)
	$(BIN)/dreamp2p bench codec --json
	$(BIN)/dreamp2p bench transport --json
	$(BIN)/dreamp2p bench allreduce --json --peers 4 --mbytes 64

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis report runs
