# Two entry points for a fresh machine (see README): `make demo` and `make test`.
# Both create the virtual environment, install dresd with its pinned CPU PyTorch, and fetch
# the default model into the cache (~/.cache/dresd, or $DRESD_CACHE) the first time.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test lint model

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

model: $(STAMP)
	$(BIN)/dresd fetch-model

demo: model
	$(BIN)/dresd demo --threads 1

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

test: model lint
	$(BIN)/python -m pytest -q
