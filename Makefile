# Two entry points for a fresh machine: `make run` (whole pipeline) and `make test`.
# torch is installed first and pinned: on these machines `torch==2.13.0` is a local CPU wheel,
# while a bare `torch` requirement resolved first would pull a multi-GB CUDA build.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
TORCH   ?= torch==2.13.0
export DVC_NO_ANALYTICS := 1
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
# dvc.yaml runs `python -m stages ...`: that `python` must be the venv's.
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: install run test bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

# The tests also run the DeepSpeed ones (skipped where deepspeed is missing); torch is named again so that pip keeps
# the pinned build whatever deepspeed asks for.
$(VENV)/.installed-deepspeed: $(VENV)/.installed
	$(BIN)/pip install -q "$(TORCH)" -e ".[dev,deepspeed]"
	touch $@

install: $(VENV)/.installed

run: install
	@test -d .dvc || $(BIN)/dvc init -q
	$(BIN)/dvc repro

# lint first (seconds), then every test, the slow ones included (`pytest -m "not slow"` is the fast loop)
test: $(VENV)/.installed-deepspeed
	$(BIN)/ruff check .
	$(BIN)/python -m pytest tests

bench: install
	$(BIN)/python bench/compare.py

clean:
	rm -rf $(VENV)
