# Two entry points for a fresh machine (see README): `make demo` and `make test`.
# Both create the virtual environment, install dresd with its pinned CPU PyTorch, and fetch
# the default model into the cache (~/.cache/dresd, or $DRESD_CACHE) the first time.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

# The demo: a dense + sparse datastore of 400 GSM8K training answers (built once, a few minutes
# on 2 cores), then AR, PLD, suffix, REST, DReSD and hybrid side by side on the first GSM8K test
# questions, DReSD at its default (the step budget), at the paper's shape (budget=0) and at the
# 4-node tree (benchmarks/results/fast_path), in the dtype --dtype auto picks.
DATA       ?= ../shared/data
DEMO_STORE := runs/demo-gsm8k-store
DEMO_OUT   := runs/demo

.PHONY: demo test lint model

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

model: $(STAMP)
	$(BIN)/dresd fetch-model

$(DEMO_STORE)/manifest.json: | model
	$(BIN)/dresd build --kind dense,sparse --corpus $(DATA)/gsm8k/train.jsonl \
		--prompt-field question --response-field answer --limit 400 --out $(DEMO_STORE)

demo: model $(DEMO_STORE)/manifest.json
	$(BIN)/dresd bench --methods 'ar,pld,suffix,rest[max_tree_nodes=4],dresd,dresd[budget=0],dresd[max_tree_nodes=4],hybrid' \
		--datastore $(DEMO_STORE) --dataset gsm8k \
		--limit 6 --max-new-tokens 128 --threads 1 --out $(DEMO_OUT)

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

test: model lint
	$(BIN)/python -m pytest -q
