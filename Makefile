# Two commands for a newcomer: `make demo` and `make test`. Each sets itself up.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Re-install when the dependency files change.
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | cksum | cut -d' ' -f1)
DATA_DIR ?= ../shared/datasets
TOKENIZER_DIR ?= ../shared/tokenizers/gpt2

.PHONY: setup demo test test-gpu lint unit proto clean bench-engine-cpu bench-engine-gpu predictor-default bench-predictor

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev]'
	rm -f $(VENV)/.installed-*
	touch $@

demo: setup
	$(BIN)/python -m gateway.demo --data-dir $(DATA_DIR) --tokenizer-dir $(TOKENIZER_DIR) $(DEMO_ARGS)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# GPU tests run on a CUDA machine with `make test-gpu`; everything else runs here and in CI.
test: lint
	$(BIN)/python -m pytest -m "not gpu" $(PYTEST_ARGS)

test-gpu:
	python3 -m pytest -m gpu $(PYTEST_ARGS)

unit: setup
	$(BIN)/python -m pytest tests/unit $(PYTEST_ARGS)

bench-engine-cpu: setup
	$(BIN)/python -m bench.engine.cpu --tokenizer-dir $(TOKENIZER_DIR) $(if $(DATA_DIR),--data-dir $(DATA_DIR))

# On the GPU machine (its own python3 with torch + CUDA): the H200 benchmark of docs/engine-gpu.md.
bench-engine-gpu:
	python3 -m bench.engine.gpu --tokenizer-dir $(TOKENIZER_DIR)

# The demo's default length-predictor artifact (reused when the training data has not changed).
predictor-default: setup
	$(BIN)/python -m predictor.build_default --data-dir $(DATA_DIR) --tokenizer-dir $(TOKENIZER_DIR)

bench-predictor: setup
	$(BIN)/python -m bench.predictor --data-dir $(DATA_DIR) --tokenizer-dir $(TOKENIZER_DIR)

proto: setup
	$(BIN)/python -m site_engine.proto.generate

clean:
	rm -rf $(VENV) var .mypy_cache .ruff_cache
