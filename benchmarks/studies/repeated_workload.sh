#!/usr/bin/env bash
# The repeated-workload runs recorded in benchmarks/results/repeated_workload/ (see
# repeated_workload.py). Needs a dense + sparse GSM8K store (200 training answers, ~5 min):
#   .venv/bin/dresd build --kind dense,sparse --corpus ../shared/data/gsm8k/train.jsonl \
#       --prompt-field question --response-field answer --limit 200 --out runs/gsm8k-200
set -euo pipefail
STORE=${STORE:-runs/gsm8k-200}
OUT=benchmarks/results/repeated_workload
for SET in gsm8k_variants mt_bench2; do
    .venv/bin/python benchmarks/studies/repeated_workload.py --set "$SET" --limit "${LIMIT:-5}" \
        --datastore "$STORE" --threads 1 --out "$OUT/$SET" 2>&1 | grep --line-buffered -v "Loading weights" \
        | tee "$OUT/$SET.log"
done
