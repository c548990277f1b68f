#!/usr/bin/env bash
# llama.cpp's server beside `dresd serve`, under 1 and 16 concurrent streaming clients.
#
# Builds llama.cpp's `llama-server` once, outside the repository (llama_cpp_tools.sh's
# build_llama_server: in $PEERS/llama.cpp-build beside llama-bench, from the same vendored
# sources as benchmarks/peers/llama_cpp.sh, PyPI's llama-cpp-python 0.3.36 source archive), and
# converts the default model to the same bf16 GGUF where that script has not. Then, REPEATS
# times, each server in turn on 127.0.0.1 at THREADS threads:
#   - `llama-server -np CLIENTS -t THREADS -tb THREADS` (the GGUF's own chat template, which
#     is the default model's; its prompt cache as it comes, `cache_prompt` on, unless
#     CACHE_PROMPT=off sends `cache_prompt: false`);
#   - `dresd serve --method M` for each M of METHODS (default: ar, then hybrid with the demo
#     store, runs/demo-gsm8k-id-store, where `make demo` built it), each a fresh process, its
#     prefix cache on (its default) unless CACHE_PROMPT=off;
# both on the same weights: WEIGHTS=bf16 (default) the bf16 GGUF for llama-server and the
# default model in bf16 for dresd; WEIGHTS=q4_1 the default model's own Q4_1 file for both
# (`dresd serve --model default-gguf` is that file, its quantized weights run by dresd's kernels);
# each driven by benchmarks/serve_load.py --url: the 16 prompts one at a time (1 client), then
# CLIENTS clients at once streaming ROUNDS x the prompts (aggregate tokens/s, TTFT, latency),
# greedy (temperature 0), TOKENS new tokens at most. Every server this script starts is
# stopped when it ends, however it ends (trap).
#
#   bash benchmarks/peers/servers.sh      # the first time +15 min (the build, 2 cores), then
#                                         # ~5 min on 2 quiet cores (REPEATS=2)
#   THREADS=1 TOKENS=16 ROUNDS=1 REPEATS=1 SMOKE=1 bash benchmarks/peers/servers.sh  # ~1 min
#
# Run it on a quiet machine: llama.cpp's threads spin at every barrier, and with THREADS=2 on 2
# cores while another process ran, one llama-server decode step took 2.2 s (0.46 tokens/s).
#
# Settings (environment): THREADS (2), CLIENTS (16), TOKENS (64), ROUNDS (2), REPEATS (2),
# WEIGHTS (bf16 | q4_1), METHODS ("ar hybrid"), PROMPT_SET (builtin: serve_load.py's own 16
# questions | gsm8k: 16 short GSM8K test questions), CACHE_PROMPT (on | off), DATASTORE
# (runs/demo-gsm8k-id-store if present; `none`: without), OUTPUT (the table's path without suffix,
# default benchmarks/results/peers/servers), SMOKE=1 (the table goes to WORK/smoke.md, labelled
# a smoke run).
#   WEIGHTS=q4_1 METHODS=ar PROMPT_SET=gsm8k THREADS=1 REPEATS=3 \
#     OUTPUT=benchmarks/results/peers/servers_q4_1_1thread bash benchmarks/peers/servers.sh
# Results: OUTPUT.md and .jsonl; serve_load's reports and the servers' logs in
# runs/peers/<OUTPUT's name>/. Not part of the tests.
set -euo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/peers/llama_cpp_tools.sh
THREADS=${THREADS:-2}
CLIENTS=${CLIENTS:-16}
TOKENS=${TOKENS:-64}
ROUNDS=${ROUNDS:-2}
REPEATS=${REPEATS:-2}
WEIGHTS=${WEIGHTS:-bf16}
METHODS=${METHODS:-ar hybrid}
PROMPT_SET=${PROMPT_SET:-builtin}
CACHE_PROMPT=${CACHE_PROMPT:-on}
OUTPUT=${OUTPUT:-benchmarks/results/peers/servers}
WORK=runs/peers/$(basename "$OUTPUT")
mkdir -p "$WORK" "$(dirname "$OUTPUT")"
build_llama_server
case $WEIGHTS in
  bf16) convert_gguf; LLAMA_MODEL=$GGUF; DRESD_MODEL=() ;;
  q4_1) fetch_q4_1; LLAMA_MODEL=$Q4_1; DRESD_MODEL=(--model default-gguf) ;;
  *) echo "WEIGHTS must be bf16 or q4_1" >&2; exit 2 ;;
esac
LLAMA_BODY='{}'
DRESD_CACHE=()
if [ "$CACHE_PROMPT" = off ]; then
  LLAMA_BODY='{"cache_prompt": false}'
  DRESD_CACHE=(--no-prefix-cache)
fi

SERVER_PID=
LOAD_PID=
stop() {  # the load generator and the server this script started, if any
  if [ -n "$LOAD_PID" ]; then
    kill "$LOAD_PID" 2> /dev/null || true
    wait "$LOAD_PID" 2> /dev/null || true
  fi
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2> /dev/null; then
    kill -TERM "$SERVER_PID" 2> /dev/null || true
    for _ in $(seq 50); do kill -0 "$SERVER_PID" 2> /dev/null || break; sleep 0.2; done
    kill -KILL "$SERVER_PID" 2> /dev/null || true
    wait "$SERVER_PID" 2> /dev/null || true
  fi
  LOAD_PID=
  SERVER_PID=
}
trap stop EXIT
trap 'exit 130' INT TERM

free_port() { .venv/bin/python -c "from dresd.serve.local import free_port; print(free_port())"; }

wait_ready() {  # URL: until /health answers 200 (the model loaded), or the server died
  for _ in $(seq 600); do
    kill -0 "$SERVER_PID" 2> /dev/null || { echo "the server died: see its log" >&2; return 1; }
    [ "$(curl -s -o /dev/null -w '%{http_code}' "$1/health")" = 200 ] && return 0
    sleep 0.5
  done
  echo "the server did not get ready in 300 s" >&2
  return 1
}

# serve_load.py against the running server; NAME OUT [more serve_load options]
load() {
  local name=$1 out=$2
  shift 2
  PYTHONPATH=src .venv/bin/python benchmarks/serve_load.py --url "$URL" --server-name "$name" \
    --clients "$CLIENTS" --rounds "$ROUNDS" --max-tokens "$TOKENS" --threads "$THREADS" \
    --temperature 0 --prompt-set "$PROMPT_SET" --out "$out" "$@" >> "$WORK/load.log" 2>&1 &
  LOAD_PID=$!
  local rc=0
  wait "$LOAD_PID" || rc=$?
  LOAD_PID=
  # 1: some concurrent output differed from the sequential one (recorded in the report)
  [ "$rc" -le 1 ] || { echo "serve_load.py failed ($rc): see $WORK/load.log" >&2; exit 1; }
}

started=$(date +%s)
: > "$WORK/load.log"
rm -f "$WORK"/r*-*.json "$WORK"/r*-*.md
for repeat in $(seq 1 "$REPEATS"); do
  port=$(free_port)
  URL=http://127.0.0.1:$port
  echo "repeat $repeat of $REPEATS: llama-server ($(uptime))"
  # -c: 1,024 tokens per slot (-np splits the context among the slots)
  "$LLAMA_SERVER" -m "$LLAMA_MODEL" -np "$CLIENTS" -t "$THREADS" -tb "$THREADS" \
    -c $((CLIENTS * 1024)) --host 127.0.0.1 --port "$port" --no-webui \
    > "$WORK/llama-server.log" 2>&1 &
  SERVER_PID=$!
  wait_ready "$URL"
  load llama-server "$WORK/r$repeat-llama-server" --dtype "$WEIGHTS" --extra-body "$LLAMA_BODY"
  stop
  for method in $METHODS; do
    port=$(free_port)
    URL=http://127.0.0.1:$port
    echo "repeat $repeat of $REPEATS: dresd serve --method $method ($(uptime))"
    store=()
    if [ "$method" = hybrid ]; then store=("${STORE_ARGS[@]}"); fi
    .venv/bin/dresd serve "${DRESD_MODEL[@]}" --host 127.0.0.1 --port "$port" \
      --method "$method" --threads "$THREADS" --max-batch-size "$CLIENTS" \
      --max-queue $((CLIENTS * 4)) --log-level warning "${DRESD_CACHE[@]}" "${store[@]}" \
      > "$WORK/dresd-$method.log" 2>&1 &
    SERVER_PID=$!
    wait_ready "$URL"
    load "dresd serve --method $method" "$WORK/r$repeat-dresd-$method" --dtype auto
    stop
  done
done

settings="WEIGHTS=$WEIGHTS METHODS='$METHODS' PROMPT_SET=$PROMPT_SET CACHE_PROMPT=$CACHE_PROMPT"
settings+=" THREADS=$THREADS CLIENTS=$CLIENTS TOKENS=$TOKENS ROUNDS=$ROUNDS REPEATS=$REPEATS"
settings+=", $(( $(date +%s) - started )) s"
out=$OUTPUT
[ -n "${SMOKE:-}" ] && out=$WORK/smoke
PYTHONPATH=src .venv/bin/python benchmarks/peers/servers_table.py --runs "$WORK" --out "$out" \
  --datastore "$DATASTORE" --build "$(dirname "$(dirname "$LLAMA_SERVER")")" \
  --weights "$WEIGHTS" --cache-prompt "$CACHE_PROMPT" --command-line "$settings" \
  ${SMOKE:+--smoke}
echo "table: $out.md"
