#!/usr/bin/env bash
# dresd beside llama.cpp on the same GGUF files: plain decoding (tg128) at 1 and 2 threads.
#
# Files: the default model's own Q4_1 file (from its PyPI wheel), and any FILES=... given.
# Each round runs, per file and thread count, llama.cpp's `llama-bench -p 0 -n 128 -r 5` and then
# dresd's `ar` on the same file (decode_step.py --model FILE), so both see the same machine at
# the same time; ROUNDS rounds (default 2), the ratio's per-round range beside it.
#
#   bash benchmarks/peers/gguf_speed.sh      # builds llama-bench once (llama_cpp_tools.sh)
#
# Results: benchmarks/results/peers/$OUTPUT.md (and .jsonl; OUTPUT=gguf_speed by default).
# THREADS="1" runs one thread count only. Not part of the tests.
set -euo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/peers/llama_cpp_tools.sh
BUILD=$PEERS/llama.cpp-build
OUT=benchmarks/results/peers
ROUNDS=${ROUNDS:-2}
THREADS=${THREADS:-1 2}  # thread counts, each file at each
OUTPUT=${OUTPUT:-gguf_speed}  # the results' file names under benchmarks/results/peers
TOKENS=${TOKENS:-128}  # tg128 by default; fewer (and fewer REPETITIONS) for large files
REPETITIONS=${REPETITIONS:-5}
mkdir -p "$OUT"
# LLAMA_BENCH: another llama-bench (the tiers build's zen4 variant where the native build
# crashes, as on the Intel Xeon with AMX: benchmarks/results/peers/load_time.md)
LLAMA_BENCH=${LLAMA_BENCH:-$BUILD/bin/llama-bench}
[ "$LLAMA_BENCH" != "$BUILD/bin/llama-bench" ] ||
  build_llama_tool "$BUILD" llama-bench -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF
fetch_q4_1
read -r -a files <<< "$Q4_1 ${FILES:-}"
: > "$OUT/$OUTPUT.jsonl"
for round in $(seq "$ROUNDS"); do
  for file in "${files[@]}"; do
    name=$(basename "$file" .gguf)
    for threads in $THREADS; do
      "$LLAMA_BENCH" -m "$file" -p 0 -n "$TOKENS" -r "$REPETITIONS" -t "$threads" -o jsonl \
        | sed "s/^{/{\"runner\": \"llama.cpp $name\", \"round\": $round, /" \
        >> "$OUT/$OUTPUT.jsonl"
      PYTHONPATH=src .venv/bin/python benchmarks/peers/decode_step.py --model "$file" \
        --runner "dresd $name" --threads "$threads" --round "$round" --tokens "$TOKENS" \
        --repetitions "$REPETITIONS" >> "$OUT/$OUTPUT.jsonl"
    done
  done
done
PYTHONPATH=src .venv/bin/python benchmarks/peers/decode_step.py --summarize-files \
  "$OUT/$OUTPUT.jsonl" > "$OUT/$OUTPUT.md"
cat "$OUT/$OUTPUT.md"
