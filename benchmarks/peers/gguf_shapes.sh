#!/usr/bin/env bash
# The 1B and 3B shapes beside llama.cpp: Llama-3.2-1B's and -3B's configs with random weights
# (random_gguf.py, F16), quantized by llama.cpp's own `llama-quantize` to Q4_0 and Q4_K_M (the
# same files for both engines), then gguf_speed.sh on those files (tg128, 1 and 2 threads,
# interleaved rounds) and each engine's peak resident memory on a short generation.
#
#   SHAPES="1b 3b" bash benchmarks/peers/gguf_shapes.sh   # files in $PEERS (~2 GB F16 for 1B,
#                                                          # ~6 GB for 3B; removed after)
#
# Results: benchmarks/results/peers/gguf_speed.md (with the default model's file) and
# gguf_memory.md. Figures on random weights are speed and memory only: no acceptance.
set -euo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/peers/llama_cpp_tools.sh
BUILD=$PEERS/llama.cpp-build
OUT=benchmarks/results/peers
build_llama_tool "$BUILD" llama-quantize -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF
files=()
for shape in ${SHAPES:-1b 3b}; do
  f16=$PEERS/llama-3.2-$shape-random-F16.gguf
  for type in Q4_0 Q4_K_M; do
    out=$PEERS/llama-3.2-$shape-random-$type.gguf
    if [ ! -f "$out" ]; then
      [ -f "$f16" ] || PYTHONPATH=src:tests .venv/bin/python benchmarks/peers/random_gguf.py \
        "$shape" "$f16"
      "$BUILD/bin/llama-quantize" "$f16" "$out" "$type" 2 > "$PEERS/quantize.log" 2>&1
    fi
    files+=("$out")
  done
  rm -f "$f16"
done
FILES="${files[*]}" bash benchmarks/peers/gguf_speed.sh
# peak resident memory of a short run, each engine in its own process (llama-bench: 8 prompt
# tokens, 16 generated; dresd generate: 16 tokens after a short chat prompt)
{
  echo "# Peak resident memory on the same GGUF files (a short run, 1 thread)"
  echo
  echo "| file | file size | llama.cpp peak RSS | dresd peak RSS |"
  echo "| --- | ---: | ---: | ---: |"
  for file in "${files[@]}"; do
    /usr/bin/time -f "%M" -o "$PEERS/rss" "$BUILD/bin/llama-bench" -m "$file" -p 8 -n 16 -r 1 \
      -t 1 > /dev/null 2>&1
    theirs=$(tail -1 "$PEERS/rss")
    /usr/bin/time -f "%M" -o "$PEERS/rss" .venv/bin/dresd generate --model "$file" --method ar \
      --prompt "Hello" --max-new-tokens 16 --threads 1 > /dev/null 2>&1
    mine=$(tail -1 "$PEERS/rss")
    echo "| $(basename "$file") | $(du -m "$file" | cut -f1) MB | $((theirs / 1024)) MB |" \
      "$((mine / 1024)) MB |"
  done
} > "$OUT/gguf_memory.md"
cat "$OUT/gguf_memory.md"
