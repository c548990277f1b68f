#!/usr/bin/env bash
# Tokens/s along the store-size curve, measured (not replayed): DReSD and REST at 4 nodes (the
# budget that pays on a CPU) against AR, one interleaved bench per store size, on the first 30
# GSM8K test questions. Stores: the first N documents of the ID corpus (retrieval.sh step 1),
# built as real stores (dense + sparse, default options); the whole ID store is gsm8k-id-all.
#
#   bash benchmarks/retrieval_speed.sh      (after benchmarks/retrieval.sh; on a quiet machine)
#
# Reports: benchmarks/results/retrieval/speed/<size>/; summary: speed/README.md.
set -euo pipefail
cd "$(dirname "$0")/.."

WORK=${DRESD_CACHE:-$HOME/.cache/dresd}
STORES=$WORK/datastores
RESULTS=benchmarks/results/retrieval/speed
DRESD=.venv/bin/dresd
ID_CORPUS=$WORK/corpora/gsm8k-train-id.jsonl
METHODS='ar,rest[max_tree_nodes=4],dresd[max_tree_nodes=4]'
mkdir -p "$RESULTS"

# ~212 corpus tokens per document: 47, 470 and 1,415 documents are ~10k, 100k and 300k tokens.
for docs in 47 470 1415; do
    [ -f "$STORES/gsm8k-id-$docs/manifest.json" ] || $DRESD build --kind dense,sparse \
        --corpus "$ID_CORPUS" --prompt-field question --response-field answer --limit "$docs" \
        --out "$STORES/gsm8k-id-$docs" --threads 1 --quiet
done
for store in gsm8k-id-47 gsm8k-id-470 gsm8k-id-1415 gsm8k-id-all; do
    [ -f "$RESULTS/$store/report.json" ] || $DRESD bench --methods "$METHODS" \
        --datastore "$STORES/$store" --dataset gsm8k --limit 30 --max-new-tokens 128 \
        --threads 1 --out "$RESULTS/$store" > "$RESULTS/$store.log" 2>&1
done
.venv/bin/python benchmarks/retrieval_speed_summary.py
