#!/usr/bin/env bash
# Recorded results for the default model (SmolLM2-135M-Instruct), greedy, 1 thread per run:
# AR, PLD, REST and DReSD side by side on the same prompts, REST and DReSD on the same corpus.
#
#   bash benchmarks/default_model.sh            (from the repository root, after `make model`)
#
# Steps (each skipped when its output exists, so the script resumes):
#   1. ID corpus: the model's own answers to the first 1,024 GSM8K train questions
#   2. datastores (dense + sparse from one pass): GSM8K ID, GSM8K OOD (the reference answers to
#      the same 1,024 questions), Python standard library (its first 20 files, ~150k tokens),
#      and "all": the three corpora in one store
#   3. benches: GSM8K test (first 100) with the OOD and with the ID store, HumanEval stubs
#      (first 30) with the stdlib store, MT-Bench first turns (all 80) with the "all" store,
#      side by side on the two cores
# Reports land in benchmarks/results/default_model/<run>/ (report.md, report.json, plots).
set -euo pipefail
cd "$(dirname "$0")/.."

DATA=${DRESD_DATA:-../shared/data}
WORK=${DRESD_CACHE:-$HOME/.cache/dresd}
STORES=$WORK/datastores
RESULTS=benchmarks/results/default_model
DRESD=.venv/bin/dresd
GSM8K_FIELDS=(--prompt-field question --response-field answer)
mkdir -p "$STORES" "$WORK/corpora" "$RESULTS"

# 1. The ID corpus (greedy, batched, resumable).
ID_CORPUS=$WORK/corpora/gsm8k-train-id.jsonl
$DRESD corpus regenerate --model default --corpus "$DATA/gsm8k/train.jsonl" "${GSM8K_FIELDS[@]}" \
    --out "$ID_CORPUS" --limit 1024 --max-new-tokens 128 --batch-size 32 --threads 2

# 2. Datastores, two builds at a time (one thread each).
build() {  # build NAME CORPUS-ARGS...
    local name=$1; shift
    [ -f "$STORES/$name/manifest.json" ] || \
        $DRESD build --kind dense,sparse --out "$STORES/$name" --threads 1 --quiet "$@"
}
build gsm8k-id --corpus "$ID_CORPUS" "${GSM8K_FIELDS[@]}" &
build gsm8k-ood --corpus "$DATA/gsm8k/train.jsonl" "${GSM8K_FIELDS[@]}" --limit 1024 &
build stdlib --corpus stdlib --limit 20 --max-doc-tokens 1024 &  # ~150k tokens
wait
# --limit counts documents over all corpora: 1,024 + 1,024 + the same first 20 stdlib files.
head -n 1024 "$DATA/gsm8k/train.jsonl" > "$WORK/corpora/gsm8k-train-ref-1024.jsonl"
build all --corpus "$ID_CORPUS" --corpus "$WORK/corpora/gsm8k-train-ref-1024.jsonl" \
    --corpus stdlib "${GSM8K_FIELDS[@]}" --max-doc-tokens 1024 --limit 2068

# 3. Benches: methods interleaved prompt by prompt within each run.
bench() {  # bench RUN STORE DATASET LIMIT
    $DRESD bench --methods ar,pld,rest,dresd --datastore "$STORES/$2" --dataset "$3" \
        --limit "$4" --max-new-tokens 128 --threads 1 --out "$RESULTS/$1"
}
bench gsm8k-ood gsm8k-ood gsm8k 100 > "$RESULTS/gsm8k-ood.log" 2>&1 &
bench gsm8k-id gsm8k-id gsm8k 100 > "$RESULTS/gsm8k-id.log" 2>&1 &
wait
bench humaneval-stdlib stdlib humaneval 30 > "$RESULTS/humaneval-stdlib.log" 2>&1 &
bench mt-bench-all all mt_bench 80 > "$RESULTS/mt-bench-all.log" 2>&1 &
wait

# 4. The reports read against the paper's goals.
.venv/bin/python benchmarks/goals.py "$RESULTS"/*/ > "$RESULTS/summary.md"
