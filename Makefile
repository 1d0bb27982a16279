# The one entry point for people and CI. Every target installs what it needs first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# torch for the dev venv: the CPU build, never a multi-GB CUDA download. Where WHEELS holds the CPU
# wheel (this machine) pip takes it from there; elsewhere set TORCH_INDEX to a CPU-only torch index
# (README, Install). pyproject.toml itself only asks for torch>=2.4.
TORCH_VERSION ?= 2.13.0
WHEELS ?= /opt/wheels
TORCH_INDEX ?=
TORCH_SOURCE := $(if $(wildcard $(WHEELS)),--find-links $(WHEELS),$(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)))

.PHONY: install demo test test-fast test-unit test-loaded lint proto bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	if [ -n "$(TORCH_SOURCE)" ]; then $(BIN)/python -m pip install --quiet $(TORCH_SOURCE) "torch==$(TORCH_VERSION)"; \
	elif $(BIN)/python -c "import torch" 2>/dev/null; then echo "no torch source given: keeping the venv's torch"; \
	elif [ "$$(uname -s)" != Linux ]; then $(BIN)/python -m pip install --quiet "torch==$(TORCH_VERSION)"; \
	else echo "$(WHEELS) is absent and TORCH_INDEX is unset; on Linux the default index serves torch's CUDA" \
		"build (GBs): make $(MAKECMDGOALS) TORCH_INDEX=<CPU-only torch index URL> (see README, Install)" >&2; exit 2; fi
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
	BIN=$(BIN) .ci/lint-deploy

proto: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. proto/dreamp2p/v1/peer.proto

bench: $(STAMP)
	$(BIN)/dreamp2p bench codec --json
	$(BIN)/dreamp2p bench transport --json
	$(BIN)/dreamp2p bench allreduce --json --peers 4 --mbytes 64

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis report runs
