#!/usr/bin/env bash
# llama.cpp's lookup decoding (`llama-lookup`, prompt n-gram speculation) beside dresd's ar, pld
# and hybrid on the same GSM8K questions (llama_lookup.py says how). Builds `llama-lookup` once
# outside the repository ($PEERS/llama.cpp-lookup-build, ~5 min on 2 cores) from the sources
# llama_cpp.sh unpacked, on the bf16 GGUF llama_cpp.sh converted (run that first).
#
#   bash benchmarks/peers/llama_lookup.sh      # THREADS=2 PROMPTS=6 TOKENS=128 ROUNDS=2, ~3 min
#
# Results: benchmarks/results/peers/llama_lookup.md and .jsonl. Not part of the tests.
set -euo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/peers/llama_cpp_tools.sh
BUILD=$PEERS/llama.cpp-lookup-build
OUT=${OUT:-benchmarks/results/peers}
build_llama_tool "$BUILD" llama-lookup -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=OFF
convert_gguf

PYTHONPATH=src .venv/bin/python benchmarks/peers/llama_lookup.py --lookup "$BUILD/bin/llama-lookup" \
  --gguf "$GGUF" --threads "${THREADS:-2}" --prompts "${PROMPTS:-6}" --tokens "${TOKENS:-128}" \
  --rounds "${ROUNDS:-2}" "${STORE_ARGS[@]}" --out "$OUT/llama_lookup.jsonl" > "$OUT/llama_lookup.md"
cat "$OUT/llama_lookup.md"
