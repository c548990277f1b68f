#!/usr/bin/env bash
# dresd beside OpenVINO GenAI and transformers' prompt lookup, on the prompts dresd bench uses.
#
# Installs OpenVINO GenAI once in its own virtual environment outside the repository
# ($OV_VENV, default $PEERS/openvino-venv, $PEERS default ~/.cache/dresd/peers):
# openvino-genai, optimum-intel[openvino] and torch==2.13.0 (pinned, so that pip takes the CPU
# wheel on local disk; the torchvision optimum-intel pulls in does not load with that torch
# ("operator torchvision::nms does not exist") and breaks the export, so it is removed).
# Exports the default model (dresd's cached folder) once to an fp16 IR with
# `optimum-cli export openvino --task text-generation-with-past --weight-format fp16`.
# Then, per round, back to back at THREADS threads, on the same token ids (the first PROMPTS
# GSM8K test questions, dresd's chat template; greedy):
#   1. `dresd bench --methods ar,pld,suffix,hybrid` (interleaved prompt by prompt), TOKENS new
#      tokens; hybrid with the demo store (runs/demo-gsm8k-id-store, `make demo`) where it exists;
#   2. OpenVINO `LLMPipeline` plain and with prompt lookup (5 tokens, n-gram 3), interleaved;
#   3. transformers' `generate` without and with `prompt_lookup_num_tokens` (5, n-gram 3), on
#      the model as dresd loads it (HF_MODELS=dresd; add `plain` for transformers' own bf16
#      model, slow on a CPU);
#   4. batched, on the first BATCH questions, BATCH_TOKENS new tokens: OpenVINO
#      `ContinuousBatchingPipeline` plain and with prompt lookup, 1 request at a time and BATCH
#      at once, then `dresd bench --concurrency 1,BATCH` (ar, pld, suffix, hybrid).
# Each OpenVINO group runs in its own process: one that dies (OpenVINO 2026.x was seen to die
# with SIGFPE at one thread on a Xeon) is recorded as such in the table, and the run goes on.
#
#   bash benchmarks/peers/openvino.sh       # ~4 min the first time (install ~3, export ~1),
#                                           # then ~12 min on 2 quiet cores (ROUNDS=2)
#   PROMPTS=2 TOKENS=16 BATCH=4 BATCH_TOKENS=16 ROUNDS=1 SMOKE=1 bash benchmarks/peers/openvino.sh
#
# Settings (environment): THREADS (2), PROMPTS (6), TOKENS (128), BATCH (16), BATCH_TOKENS
# (64), ROUNDS (2), DATASTORE (runs/demo-gsm8k-id-store if present; `none`: without), HF_MODELS
# (dresd; `dresd,plain` adds plain transformers), OV_PROPERTIES (CPU plugin properties for
# every OpenVINO pipeline, e.g. "KV_CACHE_PRECISION=bf16"), SMOKE=1 (writes
# runs/peers/openvino/smoke.md instead of the results, labelled a smoke run).
# Results: benchmarks/results/peers/openvino.md and .jsonl; the raw lines (token ids too), the
# bench folders and logs in runs/peers/openvino/. Not part of the tests.
set -euo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/peers/common.sh
OV_VENV=${OV_VENV:-$PEERS/openvino-venv}
OV_GENAI=${OV_GENAI:-2026.4.1.0}
OPTIMUM_INTEL=${OPTIMUM_INTEL:-2.2.0}
IR=$PEERS/SmolLM2-135M-Instruct-ov-fp16
THREADS=${THREADS:-2}
PROMPTS=${PROMPTS:-6}
TOKENS=${TOKENS:-128}
BATCH=${BATCH:-16}
BATCH_TOKENS=${BATCH_TOKENS:-64}
ROUNDS=${ROUNDS:-2}
HF_MODELS=${HF_MODELS:-dresd}
METHODS=ar,pld,suffix,hybrid
WORK=runs/peers/openvino
RAW=$WORK/raw.jsonl
LOG=$WORK/run.log
mkdir -p "$WORK" benchmarks/results/peers

installed="import openvino_genai, importlib.util as u; assert u.find_spec('optimum.intel')"
if ! "$OV_VENV/bin/python" -c "$installed" 2> /dev/null; then
  echo "installing OpenVINO GenAI into $OV_VENV (a few minutes; log: $PEERS/openvino-install.log)"
  python3 -m venv "$OV_VENV"
  "$OV_VENV/bin/pip" install --quiet "torch==2.13.0" "openvino-genai==$OV_GENAI" \
    "optimum-intel[openvino]==$OPTIMUM_INTEL" > "$PEERS/openvino-install.log" 2>&1
fi
if "$OV_VENV/bin/pip" show torchvision > /dev/null 2>&1 \
    && ! "$OV_VENV/bin/python" -c "import torchvision" 2> /dev/null; then
  "$OV_VENV/bin/pip" uninstall --quiet -y torchvision  # built for another torch: breaks export
fi
if [ ! -f "$IR/openvino_model.xml" ]; then
  echo "exporting the default model to $IR (fp16 IR, about a minute)"
  "$OV_VENV/bin/optimum-cli" export openvino --model "$MODEL_DIR" \
    --task text-generation-with-past --weight-format fp16 "$IR" > "$PEERS/export.log" 2>&1
fi

side() { PYTHONPATH=src .venv/bin/python benchmarks/peers/openvino_side.py "$@"; }

# One OpenVINO group in its own process; if it dies, one line per pipeline says how.
openvino() {  # SET PIPELINES REQUESTS LIMIT NEW_TOKENS ROUND
  local props=() rc=0
  for p in ${OV_PROPERTIES:-}; do props+=(--property "$p"); done
  "$OV_VENV/bin/python" benchmarks/peers/ov_genai_run.py --model "$IR" \
    --prompts "$WORK/prompts.jsonl" --set "$1" --pipelines "$2" --requests "$3" --limit "$4" \
    --max-new-tokens "$5" --round "$6" --threads "$THREADS" "${props[@]}" \
    >> "$RAW" 2>> "$LOG" || rc=$?
  if [ "$rc" != 0 ]; then
    local why="exit status $rc"
    [ "$rc" -gt 128 ] && why="signal $((rc - 128)) (SIG$(kill -l $((rc - 128))))"
    echo "openvino $2 x$3 at $THREADS thread(s) failed: $why" | tee -a "$LOG"
    for p in ${2//,/ }; do
      printf '{"runner": "openvino", "pipeline": "%s", "set": "%s", "requests": %s, "threads": %s, "round": %s, "weights": "fp16", "max_new_tokens": %s, "error": "%s"}\n' \
        "$p" "$1" "$3" "$THREADS" "$6" "$5" "$why" >> "$RAW"
    done
  fi
}

started=$(date +%s)
: > "$RAW"
: > "$LOG"
side prompts --limit $((PROMPTS > BATCH ? PROMPTS : BATCH)) --out "$WORK/prompts.jsonl"
for round in $(seq 1 "$ROUNDS"); do
  echo "round $round of $ROUNDS: dresd bench, $PROMPTS prompts, $TOKENS tokens"
  .venv/bin/dresd bench --methods "$METHODS" "${STORE_ARGS[@]}" --dataset gsm8k \
    --limit "$PROMPTS" --max-new-tokens "$TOKENS" --threads "$THREADS" \
    --out "$WORK/dresd-single-r$round" >> "$LOG" 2>&1
  side collect --run "$WORK/dresd-single-r$round" --set single --round "$round" >> "$RAW"
  echo "round $round: OpenVINO LLMPipeline"
  openvino single llm,llm-pl 1 "$PROMPTS" "$TOKENS" "$round"
  for model in ${HF_MODELS//,/ }; do
    echo "round $round: transformers generate ($model)"
    side transformers --model "$model" --prompts "$WORK/prompts.jsonl" --limit "$PROMPTS" \
      --threads "$THREADS" --max-new-tokens "$TOKENS" --round "$round" >> "$RAW" 2>> "$LOG"
  done
  echo "round $round: OpenVINO ContinuousBatchingPipeline, $BATCH prompts, $BATCH_TOKENS tokens"
  openvino batch cb,cb-pl 1 "$BATCH" "$BATCH_TOKENS" "$round"
  openvino batch cb,cb-pl "$BATCH" "$BATCH" "$BATCH_TOKENS" "$round"
  echo "round $round: dresd bench --concurrency 1,$BATCH"
  .venv/bin/dresd bench --methods "$METHODS" "${STORE_ARGS[@]}" --dataset gsm8k \
    --limit "$BATCH" --max-new-tokens "$BATCH_TOKENS" --threads "$THREADS" \
    --concurrency "1,$BATCH" --out "$WORK/dresd-batch-r$round" >> "$LOG" 2>&1
  side collect --run "$WORK/dresd-batch-r$round" --set batch --round "$round" >> "$RAW"
done

settings="THREADS=$THREADS PROMPTS=$PROMPTS TOKENS=$TOKENS BATCH=$BATCH"
settings+=" BATCH_TOKENS=$BATCH_TOKENS ROUNDS=$ROUNDS HF_MODELS=$HF_MODELS"
[ -n "${OV_PROPERTIES:-}" ] && settings+=" OV_PROPERTIES='$OV_PROPERTIES'"
settings+=", $(( $(date +%s) - started )) s"
if [ -n "${SMOKE:-}" ]; then
  side table --raw "$RAW" --out "$WORK/smoke" --smoke --command-line "$settings"
  echo "smoke table: $WORK/smoke.md"
else
  side table --raw "$RAW" --out benchmarks/results/peers/openvino --command-line "$settings"
  echo "table: benchmarks/results/peers/openvino.md"
fi
