#!/usr/bin/env bash
# Recorded results on the fast path (--dtype auto: bf16 where the CPU has native bf16, weights
# prepacked, batch-invariant attention), default model, greedy, 1 thread:
# AR, PLD, REST and DReSD at their default shapes and at smaller tree budgets, side by side.
#
#   bash benchmarks/fast_path.sh          (from the repository root, after `make model`)
#
# Steps (each skipped when its output exists, so the script resumes):
#   1. ID corpus: the model's own answers to the first 1,024 GSM8K train questions (batched)
#   2. a dense + sparse datastore from it (one pass)
#   3. bench: GSM8K test (first $PROMPTS), every method and shape interleaved prompt by prompt
# Reports land in benchmarks/results/fast_path/<run>/ (report.md, report.json, plots).
set -euo pipefail
cd "$(dirname "$0")/.."

DATA=${DRESD_DATA:-../shared/data}
WORK=${DRESD_CACHE:-$HOME/.cache/dresd}
STORES=$WORK/datastores
RESULTS=benchmarks/results/fast_path
PROMPTS=${PROMPTS:-40}
DRESD=.venv/bin/dresd
GSM8K_FIELDS=(--prompt-field question --response-field answer)
mkdir -p "$STORES" "$WORK/corpora" "$RESULTS"

# 1. The ID corpus (greedy, batched, resumable). The recorded store was built from the first
#    1,024 rows of gsm8k-train-id.jsonl, which retrieval.sh has since grown to every question.
ID_CORPUS=$WORK/corpora/gsm8k-train-id-1024.jsonl
$DRESD corpus regenerate --model default --corpus "$DATA/gsm8k/train.jsonl" "${GSM8K_FIELDS[@]}" \
    --out "$ID_CORPUS" --limit 1024 --max-new-tokens 128 --batch-size 32 --threads 1

# 2. The datastore.
[ -f "$STORES/gsm8k-id/manifest.json" ] || \
    $DRESD build --kind dense,sparse --corpus "$ID_CORPUS" "${GSM8K_FIELDS[@]}" \
        --out "$STORES/gsm8k-id" --threads 1 --quiet

# 3. Every method at its default shape, and the tree budgets that a CPU verify curve favours.
METHODS='ar,pld,rest,rest[max_tree_nodes=4],dresd,dresd[max_tree_nodes=2]'
METHODS+=',dresd[max_tree_nodes=4],dresd[max_tree_nodes=8],dresd[max_tree_nodes=16]'
$DRESD bench --methods "$METHODS" --datastore "$STORES/gsm8k-id" --dataset gsm8k \
    --limit "$PROMPTS" --max-new-tokens 128 --threads 1 --dtype auto \
    --out "$RESULTS/gsm8k-id" > "$RESULTS/gsm8k-id.log" 2>&1
