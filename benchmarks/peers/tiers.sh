#!/usr/bin/env bash
# dresd's kernel tiers, each beside llama.cpp built for the same instructions (issue 50, item 3):
# plain decoding (tg128) on the default model's Q4_1 file (or FILES, each a row per tier), 1 and 2
# threads, interleaved rounds.
#
# llama.cpp is built once with every CPU variant as its own library (GGML_BACKEND_DL,
# GGML_CPU_ALL_VARIANTS, GGML_NATIVE=OFF; only the variants named below are compiled); each
# tier's run copies llama-bench into a folder holding that one variant, so that llama.cpp loads
# it and no other (it looks for variants beside its executable and in the working folder). dresd
# runs the same tier forced with DRESD_ISA.
#
#   bash benchmarks/peers/tiers.sh        # ~15 min to build on 2 cores, ~10 min to run
#   FILES="a.gguf b.gguf" OUTPUT=peers_1b bash benchmarks/peers/tiers.sh
#
# Results: benchmarks/results/isa_tiers/$OUTPUT.md (and .jsonl; OUTPUT: peers by default). Not
# part of the tests.
set -euo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/peers/llama_cpp_tools.sh
BUILD=$PEERS/llama.cpp-tiers
OUT=benchmarks/results/isa_tiers
ROUNDS=${ROUNDS:-2}
THREADS=${THREADS:-1 2}
# dresd's tier : llama.cpp's CPU variant for the same instructions (ggml/src/CMakeLists.txt)
TIERS=${TIERS:-avx2:haswell avx2vnni:alderlake avx512vnni:icelake avx512bf16:zen4}
build_llama_tool "$BUILD" llama-bench -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
  -DGGML_NATIVE=OFF -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON
fetch_q4_1
FILES=${FILES:-$Q4_1}
OUTPUT=${OUTPUT:-peers}
for item in $TIERS; do
  variant=${item#*:}
  [ -f "$BUILD/bin/libggml-cpu-$variant.so" ] || nice -n 10 cmake --build "$BUILD" -j 2 \
    --target "ggml-cpu-$variant" >> "$PEERS/tiers-build.log"
  mkdir -p "$BUILD/only-$variant"
  cp "$BUILD/bin/llama-bench" "$BUILD/bin/libggml-cpu-$variant.so" "$BUILD/only-$variant/"
done
: > "$OUT/$OUTPUT.jsonl"
for round in $(seq "$ROUNDS"); do
  for file in $FILES; do
    # a row per tier (and per file where there are several)
    label() { if [ "$FILES" = "$Q4_1" ]; then echo "$1"; else echo "$1 $(basename "$file")"; fi; }
    for item in $TIERS; do
      tier=${item%%:*} variant=${item#*:}
      for threads in $THREADS; do
        (cd "$BUILD/only-$variant" && ./llama-bench -m "$file" -p 0 -n 128 -r 5 -t "$threads" \
          -o jsonl) | sed "s/^{/{\"runner\": \"llama.cpp $(label "$tier")\", \"round\": $round, /" \
          >> "$OUT/$OUTPUT.jsonl"
        DRESD_ISA=$tier PYTHONPATH=src .venv/bin/python benchmarks/peers/decode_step.py \
          --model "$file" --runner "dresd $(label "$tier")" --threads "$threads" \
          --round "$round" >> "$OUT/$OUTPUT.jsonl"
      done
    done
  done
done
{
  echo "# Each kernel tier beside llama.cpp built for the same instructions"
  echo
  echo "Files: $(for f in $FILES; do basename "$f"; done | paste -sd, -); rows are dresd's tiers (DRESD_ISA), each against"
  echo "llama.cpp's CPU variant for the same instructions: $TIERS. Made by"
  echo "\`bash benchmarks/peers/tiers.sh\`."
  echo
  PYTHONPATH=src .venv/bin/python benchmarks/peers/decode_step.py --summarize-files \
    "$OUT/$OUTPUT.jsonl" | tail -n +3 | sed -e 's/ Made by `bash benchmarks\/peers\/gguf_speed.sh`\.//' \
    -e 's/^| file |/| tier |/'
} > "$OUT/$OUTPUT.md"
cat "$OUT/$OUTPUT.md"
