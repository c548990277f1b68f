#!/usr/bin/env bash
# `hybrid` against every single method, one interleaved run per prompt set, on the fast path
# (--dtype auto), default model, greedy, 128 new tokens, 1 thread.
#
#   bash benchmarks/hybrid.sh            (after benchmarks/retrieval.sh built gsm8k-id-all)
#
# Stores: gsm8k-id-all (retrieval.sh: the model's own answers to all 7,473 GSM8K train
# questions, 1.59M tokens), stdlib (the first 20 standard-library files) and all (both corpora
# in one store, for MT-Bench, whose 80 first turns are 10 per category). The single methods run at the shapes that paid best on
# this CPU (benchmarks/results/fast_path/); hybrid picks its own tree at every step from the
# verify-cost curve that `dresd calibrate` measured. Reports: benchmarks/results/hybrid/<set>/.
set -euo pipefail
cd "$(dirname "$0")/.."

WORK=${DRESD_CACHE:-$HOME/.cache/dresd}
STORES=$WORK/datastores
RESULTS=benchmarks/results/hybrid
DRESD=.venv/bin/dresd
mkdir -p "$RESULTS"

[ -f "$STORES/stdlib/manifest.json" ] || $DRESD build --kind dense,sparse --corpus stdlib \
    --limit 20 --max-doc-tokens 1024 --out "$STORES/stdlib" --threads 1 --quiet
[ -f "$STORES/all/manifest.json" ] || $DRESD build --kind dense,sparse \
    --corpus "$WORK/corpora/gsm8k-train-id.jsonl" --corpus stdlib --prompt-field question \
    --response-field answer --max-doc-tokens 1024 --limit 1044 --out "$STORES/all" \
    --threads 1 --quiet
$DRESD calibrate --threads 1 --force  # measured afresh: run this script on a quiet machine

# DReSD at two shapes: 4 nodes paid best before the C attention kernel made trees cheaper, 16
# may pay now (calibrate's curve: cost(16) 1.18 with the kernel, 1.27 without, on AMX)
METHODS=${METHODS:-'ar,pld,suffix,rest[max_tree_nodes=4],dresd[max_tree_nodes=4],dresd[max_tree_nodes=16],hybrid'}
bench() {  # bench SET STORE DATASET LIMIT
    [ -f "$RESULTS/$1/report.json" ] || $DRESD bench --methods "$METHODS" \
        --datastore "$STORES/$2" --dataset "$3" --limit "$4" --max-new-tokens 128 \
        --threads 1 --out "$RESULTS/$1" > "$RESULTS/$1.log" 2>&1
}
bench gsm8k-id gsm8k-id-all gsm8k 30
bench humaneval-stdlib stdlib humaneval 20
bench humaneval-typehints stdlib humaneval-typehints 16
bench mt-bench all mt_bench 80
.venv/bin/python benchmarks/hybrid_summary.py
