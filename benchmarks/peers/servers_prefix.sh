#!/usr/bin/env bash
# llama.cpp's `llama-server` in benchmarks/prefix_cache.py's two workloads (a ~1,000-token
# shared system prompt under CLIENTS concurrent streaming clients, cold and warm; MT-Bench
# second turns), beside `dresd serve` with its prefix cache off and on, in the same run: the
# three servers take each wave in turn (prefix_cache.py --peer-command).
#
# Builds llama-server once (llama_cpp_tools.sh's build_llama_server) and the same weights for
# both: llama-server on the bf16 GGUF converted from the default model by llama.cpp's own
# converter (convert_gguf), dresd on the default model in bf16 with METHOD (default pld, dresd
# serve's and prefix_cache.py's default; `ar`: plain decoding, as llama-server's). llama-server
# runs with its defaults otherwise (`cache_prompt` on, its RAM prompt cache, continuous
# batching), `-np CLIENTS`, THREADS threads, 2,048 tokens of context per slot; greedy
# (`temperature: 0` in its requests; dresd is greedy by default). It binds to 127.0.0.1 and
# is restarted before each round after the first (nothing else empties its caches).
#
#   bash benchmarks/peers/servers_prefix.sh     # ~10 min on 2 cores after the build
#
# Settings (environment): THREADS (2), CLIENTS (16), TOKENS (64), ROUNDS (3), METHOD (pld),
# OUTPUT (default benchmarks/results/peers/prefix_cache). Results: OUTPUT/
# (prefix_cache.py's README.md and prefix_cache.json). Not part of the tests.
set -euo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/peers/llama_cpp_tools.sh
THREADS=${THREADS:-2}
CLIENTS=${CLIENTS:-16}
TOKENS=${TOKENS:-64}
ROUNDS=${ROUNDS:-3}
METHOD=${METHOD:-pld}
OUTPUT=${OUTPUT:-benchmarks/results/peers/prefix_cache}
build_llama_server
convert_gguf
peer="$LLAMA_SERVER -m $GGUF --host 127.0.0.1 --port {port} -np $CLIENTS -t $THREADS"
peer+=" -tb $THREADS -c $((CLIENTS * 2048)) --no-webui"
echo "before: $(uptime)"
PYTHONPATH=src:benchmarks .venv/bin/python benchmarks/prefix_cache.py --threads "$THREADS" \
  --clients "$CLIENTS" --max-tokens "$TOKENS" --rounds "$ROUNDS" --dtype bfloat16 \
  --method "$METHOD" \
  --peer-command "$peer" --out "$OUTPUT"
echo "after: $(uptime)"
