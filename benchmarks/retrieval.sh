#!/usr/bin/env bash
# DReSD's retrieval at scale: the stores, the scaling curve and the ablations (issue: DReSD's
# retrieval as strong as the paper says). Default model, bf16 (--dtype auto), 1 thread.
#
#   bash benchmarks/retrieval.sh        (from the repository root, after `make model`)
#
# Steps (each skipped when its output exists, so the script resumes where it stopped):
#   1. ID corpus: the model's own greedy answers to all 7,473 GSM8K train questions (batched)
#   2. stores, built with --keep-states so that the study refits keys without new forwards:
#      gsm8k-id-all (the ID corpus), gsm8k-ood (the dataset's own answers, first $OOD_DOCS),
#      stdlib-1m (the first $STDLIB_FILES files of the standard library, ~1M tokens) and
#      stdlib-all (all of it: 1,790 files, 9.10M tokens, 11.8 GB with the states; ~3.2 h of one
#      quiet core at ~780 tokens/s, ~2 h at --threads 2 on an idle 2-core machine; resumable by
#      chunk, so the same command goes on where a stopped build left off)
#   3. the study: GSM8K test (first 100) on the ID and OOD stores, HumanEval on stdlib-1m (with
#      the ablations) and on stdlib-all at 1M, 3M and all of it (exact search, then IVF)
#   4. the summary: results/retrieval/README.md and scaling.png
# Build times on this 2-core machine: ~1,000 bf16 tokens/s per core for a dense build, ~250
# response tokens/s for a batched regenerate.
set -euo pipefail
cd "$(dirname "$0")/.."

DATA=${DRESD_DATA:-../shared/data}
WORK=${DRESD_CACHE:-$HOME/.cache/dresd}
STORES=$WORK/datastores
DRESD=.venv/bin/dresd
OOD_DOCS=${OOD_DOCS:-1500}
STDLIB_FILES=${STDLIB_FILES:-300}
GSM8K_FIELDS=(--prompt-field question --response-field answer)
BUILD=(build --kind dense,sparse --keep-states --threads 1 --quiet)
mkdir -p "$STORES" "$WORK/corpora"

# 1. The ID corpus (greedy, batched, resumable).
ID_CORPUS=$WORK/corpora/gsm8k-train-id.jsonl
$DRESD corpus regenerate --model default --corpus "$DATA/gsm8k/train.jsonl" "${GSM8K_FIELDS[@]}" \
    --out "$ID_CORPUS" --max-new-tokens 128 --batch-size 32 --threads 1

# 2. The stores.
[ -f "$STORES/gsm8k-id-all/manifest.json" ] || $DRESD "${BUILD[@]}" --corpus "$ID_CORPUS" \
    "${GSM8K_FIELDS[@]}" --out "$STORES/gsm8k-id-all"
[ -f "$STORES/gsm8k-ood/manifest.json" ] || $DRESD "${BUILD[@]}" \
    --corpus "$DATA/gsm8k/train.jsonl" "${GSM8K_FIELDS[@]}" --limit "$OOD_DOCS" \
    --out "$STORES/gsm8k-ood"
[ -f "$STORES/stdlib-1m/manifest.json" ] || $DRESD "${BUILD[@]}" --corpus stdlib \
    --limit "$STDLIB_FILES" --out "$STORES/stdlib-1m"
[ -f "$STORES/stdlib-all/manifest.json" ] || $DRESD "${BUILD[@]}" --corpus stdlib \
    --out "$STORES/stdlib-all"
for store in gsm8k-id-all gsm8k-ood stdlib-1m stdlib-all; do $DRESD inspect "$STORES/$store"; done

# 3. The study (AR outputs are cached in results/retrieval/ar-<dataset>-<limit>.json; a study
#    whose results/retrieval/NAME.json exists is skipped: delete it to rerun).
STUDY=(.venv/bin/python benchmarks/studies/retrieval_study.py --limit 100 --max-new-tokens 128)
study() {  # study NAME STORE DATASET [OPTIONS...]
    local name=$1 store=$2 dataset=$3
    shift 3
    [ -f "benchmarks/results/retrieval/$name.json" ] || "${STUDY[@]}" --store "$STORES/$store" \
        --dataset "$dataset" --name "$name" "$@"
}
study gsm8k-id gsm8k-id-all gsm8k --ablations
study gsm8k-ood gsm8k-ood gsm8k
study humaneval-stdlib stdlib-1m humaneval --ablations
study humaneval-stdlib-all stdlib-all humaneval --sizes 1000000,3000000,0
# ... and on the whole stdlib with the IVF index it gets, at the recall a build targets: the
# accepted length that approximate search keeps, and the draft time the est. speedup is priced by
grep -q '"IVF at recall 0.9"' benchmarks/results/retrieval/humaneval-stdlib-all.json ||
    "${STUDY[@]}" --store "$STORES/stdlib-all" --dataset humaneval --name humaneval-stdlib-all \
        --variants "IVF at recall 0.9"

# 4. Tables and the plot.
.venv/bin/python benchmarks/studies/retrieval_summary.py
