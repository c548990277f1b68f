#!/usr/bin/env bash
# The batched engine's figures (README "Under load"), about 25 minutes on 2 cores:
#   1. every method under load: dresd bench --concurrency 1,4,16,32 --rounds 3 on 32 GSM8K
#      questions (results/concurrency/gsm8k/concurrency.md, .json, .png);
#   2. the server under 16 streaming clients, hybrid, against single-stream AR in the same run
#      (results/serve.md, .json);
#   3. DReSD at its default (the step budget) against AR and against the paper's fixed shape,
#      single-stream, on GSM8K (the store's own domain), MT-Bench and HumanEval (out of it):
#      the promise that no method is slower than plain decoding by default
#      (results/dresd_default/<set>/report.md).
# One PyTorch thread; the datastore is make demo's (the model's own answers to 400 GSM8K
# training questions), made here by make if absent.
set -euo pipefail
cd "$(dirname "$0")/.."
DRESD=.venv/bin/dresd
STORE=runs/demo-gsm8k-id-store
RESULTS=benchmarks/results
export OMP_NUM_THREADS=1

make "$STORE/manifest.json"

$DRESD bench --methods ar,pld,suffix,hybrid --dataset gsm8k --limit 32 --max-new-tokens 64 \
  --threads 1 --concurrency 1,4,16,32 --rounds 3 --out "$RESULTS/concurrency/gsm8k"

PYTHONPATH=src .venv/bin/python benchmarks/serve_load.py --clients 16 --rounds 2 \
  --max-tokens 64 --method hybrid --threads 1 --out "$RESULTS/serve"

for set in gsm8k mt_bench humaneval; do
  $DRESD bench --methods 'ar,dresd,dresd[budget=0]' --datastore "$STORE" --dataset "$set" \
    --limit 16 --max-new-tokens 96 --threads 1 --out "$RESULTS/dresd_default/$set"
done
