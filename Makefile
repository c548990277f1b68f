# Two entry points for a fresh machine (see README): `make demo` and `make test`.
# Both create the virtual environment, install dresd with its pinned CPU PyTorch, and fetch
# the default model into the cache (~/.cache/dresd, or $DRESD_CACHE) the first time.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

# The demo: the default model's own greedy answers to 400 GSM8K training questions (regenerated
# once, batched), and a dense + sparse datastore of them (built once; ~2 minutes a model on 2
# cores): DReSD's setting, a store of the target's own outputs on the workload. Then AR, PLD,
# suffix, REST, DReSD and hybrid side by side on the first GSM8K test questions, DReSD at its
# default (the step budget), at the paper's shape (budget=0) and at the 4-node tree
# (benchmarks/results/fast_path), in bf16 (BENCH_DTYPE). Then the default model's own
# Q4_1 GGUF file, its quantized weights run natively, with a store of its own answers (another
# model: its hidden states and answers are its own): AR, PLD, suffix, DReSD and hybrid.
# The benches in bf16: what --dtype auto picks on a CPU that multiplies bf16 natively; on one
# that does not, dresd's C decoder still decodes bf16 (its AVX2 and NEON tiers): on an
# AVX2-only AMD EPYC 4.6x float32's speed (`dresd generate`, the default model, 1 thread: 30.2
# against 6.6 tokens/s, side by side). The default model's corpus is regenerated in the same
# dtype (its own answers in the dtype it is benched in; there, batches of 16 in bf16 took 1.7 s
# a prompt against float32's 2.5, 2 threads); the stores are built in auto's dtype (the
# build's long padded forwards: float32 there, 41 s against bf16's 56 for 32 answers).
# `make demo BENCH_DTYPE=auto` for auto's choice throughout.
BENCH_DTYPE ?= bfloat16
DATA       ?= ../shared/data
DEMO_OUT   := runs/demo
DEMO_STORE := runs/demo-gsm8k-id-store
DEMO_GGUF_STORE := runs/demo-gsm8k-id-gguf-store
# regenerate's options for both models; it resumes a .part file, renamed once whole
REGENERATE := corpus regenerate --corpus $(DATA)/gsm8k/train.jsonl --prompt-field question \
	--response-field answer --limit 400 --max-new-tokens 128 --batch-size 16
STORE_FROM := build --kind dense,sparse --prompt-field question --response-field answer

.PHONY: demo test test-fast lint model

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

model: $(STAMP)
	$(BIN)/dresd fetch-model

runs/demo-gsm8k-id.jsonl: | model
	$(BIN)/dresd $(REGENERATE) --model default --dtype $(BENCH_DTYPE) --out $@.part && mv $@.part $@

runs/demo-gsm8k-id-gguf.jsonl: | model
	$(BIN)/dresd $(REGENERATE) --model default-gguf --out $@.part && mv $@.part $@

$(DEMO_STORE)/manifest.json: runs/demo-gsm8k-id.jsonl
	$(BIN)/dresd $(STORE_FROM) --model default --corpus $< --out $(DEMO_STORE)

$(DEMO_GGUF_STORE)/manifest.json: runs/demo-gsm8k-id-gguf.jsonl
	$(BIN)/dresd $(STORE_FROM) --model default-gguf --corpus $< --out $(DEMO_GGUF_STORE)

demo: model $(DEMO_STORE)/manifest.json $(DEMO_GGUF_STORE)/manifest.json
	$(BIN)/dresd bench --methods 'ar,pld,suffix,rest[max_tree_nodes=4],dresd,dresd[budget=0],dresd[max_tree_nodes=4],hybrid' \
		--datastore $(DEMO_STORE) --dataset gsm8k \
		--limit 6 --max-new-tokens 128 --threads 1 --dtype $(BENCH_DTYPE) --out $(DEMO_OUT)
	$(BIN)/dresd bench --model default-gguf --methods 'ar,pld,suffix,dresd,hybrid' \
		--datastore $(DEMO_GGUF_STORE) --dataset gsm8k \
		--limit 6 --max-new-tokens 128 --threads 1 --dtype $(BENCH_DTYPE) --out $(DEMO_OUT)-gguf

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

# The whole suite but the heavy reliability runs (`pytest -m slow`); docs/testing.md. In
# TEST_WORKERS processes (pytest-xdist; each test module in one of them, its fixtures built
# once): the tests run one PyTorch thread each, so two workers use both of a 2-core machine
# (an AVX2-only EPYC: 24 minutes against 42 in one process). At most 4 by default: each
# worker holds its own models.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ $$n -gt 4 ] && n=4; echo $$n)
XDIST := -n $(TEST_WORKERS) --dist loadfile
test: model lint
	$(BIN)/python -m pytest -q $(XDIST)

# The edit loop: unit tests and tiny models. Deselects every test that loads the default model
# in this process, starts a server or Ray, or runs a child process (markers that tests/conftest.py
# sets), and says how many. The tiny models borrow the default model's tokenizer, hence `model`.
FAST := not slow and not default_model and not server and not ray and not subprocess
test-fast: model lint
	$(BIN)/python -m pytest -q $(XDIST) -m '$(FAST)'

# The aarch64 kernel tiers (neon, neoni8mm) under qemu-aarch64 (tests/kernels_c/harness.py):
# installs the cross compiler and qemu-user where they are missing and apt-get can (as root),
# then runs tests/test_neon_qemu.py, which skips without them. `neon-tools` alone tries the
# install and only warns when it cannot (CI: .ci/run), so that a machine without apt-get
# reports the qemu test as skipped rather than failing the run.
NEON_TOOLS := gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user
.PHONY: test-neon neon-tools
neon-tools:
	@if ! command -v aarch64-linux-gnu-gcc >/dev/null || ! command -v qemu-aarch64 >/dev/null; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			(apt-get update -q && apt-get install -y -q $(NEON_TOOLS)) \
				|| echo "neon-tools: apt-get could not install $(NEON_TOOLS)"; \
		else \
			echo "neon-tools: install $(NEON_TOOLS) (as root: apt-get install -y ...)"; \
		fi; \
	fi
test-neon: $(STAMP) neon-tools
	$(BIN)/python -m pytest -q -rs tests/test_neon_qemu.py
