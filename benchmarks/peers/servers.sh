#!/usr/bin/env bash
# llama.cpp's server beside `dresd serve`, under 1 and 16 concurrent streaming clients.
#
# Builds llama.cpp's `llama-server` once, outside the repository ($PEERS, default
# ~/.cache/dresd/peers/llama.cpp-server-build: its own build folder, so that the one
# llama_cpp.sh builds `llama-bench` in is never reconfigured under a running benchmark), from
# the same vendored sources as benchmarks/peers/llama_cpp.sh (PyPI's llama-cpp-python 0.3.36
# source archive), and converts the default model to the same bf16 GGUF where that script has
# not. Then, REPEATS times, each server in turn on 127.0.0.1 at THREADS threads:
#   - `llama-server -np CLIENTS -t THREADS -tb THREADS` (the GGUF's own chat template, which
#     is the default model's; `cache_prompt: false` in every request, as dresd keeps no prompt
#     cache);
#   - `dresd serve --method ar`, then `dresd serve --method hybrid` (with the demo store,
#     runs/demo-gsm8k-store, where `make demo` built it), each a fresh process;
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
# DATASTORE (runs/demo-gsm8k-store if present; `none`: without), SMOKE=1 (the table goes to
# runs/peers/servers/smoke.md, labelled a smoke run).
# Results: benchmarks/results/peers/servers.md and .jsonl; serve_load's reports and the
# servers' logs in runs/peers/servers/. Not part of the tests.
set -euo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/peers/llama_cpp_tools.sh
BUILD=$PEERS/llama.cpp-server-build
THREADS=${THREADS:-2}
CLIENTS=${CLIENTS:-16}
TOKENS=${TOKENS:-64}
ROUNDS=${ROUNDS:-2}
REPEATS=${REPEATS:-2}
WORK=runs/peers/servers
mkdir -p "$WORK" benchmarks/results/peers
build_llama_tool "$BUILD" llama-server -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON
convert_gguf

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
    --temperature 0 --out "$out" "$@" >> "$WORK/load.log" 2>&1 &
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
  echo "repeat $repeat of $REPEATS: llama-server"
  "$BUILD/bin/llama-server" -m "$GGUF" -np "$CLIENTS" -t "$THREADS" -tb "$THREADS" \
    -c $((CLIENTS * 1024)) --host 127.0.0.1 --port "$port" --no-webui \
    > "$WORK/llama-server.log" 2>&1 &
  SERVER_PID=$!
  wait_ready "$URL"
  load llama-server "$WORK/r$repeat-llama-server" --dtype bf16 \
    --extra-body '{"cache_prompt": false}'
  stop
  for method in ar hybrid; do
    port=$(free_port)
    URL=http://127.0.0.1:$port
    echo "repeat $repeat of $REPEATS: dresd serve --method $method"
    store=()
    if [ "$method" = hybrid ]; then store=("${STORE_ARGS[@]}"); fi
    .venv/bin/dresd serve --host 127.0.0.1 --port "$port" --method "$method" \
      --threads "$THREADS" --max-batch-size "$CLIENTS" --max-queue $((CLIENTS * 4)) \
      --log-level warning "${store[@]}" > "$WORK/dresd-$method.log" 2>&1 &
    SERVER_PID=$!
    wait_ready "$URL"
    load "dresd serve --method $method" "$WORK/r$repeat-dresd-$method" --dtype auto
    stop
  done
done

settings="THREADS=$THREADS CLIENTS=$CLIENTS TOKENS=$TOKENS ROUNDS=$ROUNDS REPEATS=$REPEATS"
settings+=", $(( $(date +%s) - started )) s"
out=benchmarks/results/peers/servers
[ -n "${SMOKE:-}" ] && out=$WORK/smoke
PYTHONPATH=src .venv/bin/python benchmarks/peers/servers_table.py --runs "$WORK" --out "$out" \
  --datastore "$DATASTORE" --build "$BUILD" --command-line "$settings" ${SMOKE:+--smoke}
echo "table: $out.md"
