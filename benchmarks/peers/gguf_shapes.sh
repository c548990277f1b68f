#!/usr/bin/env bash
# Real models' shapes beside llama.cpp: random weights in a model's config, written in F16, then
# quantized by llama.cpp's own `llama-quantize` (the same files for both engines), then
# gguf_speed.sh on those files (tg128, 1 and 2 threads, interleaved rounds) and each engine's
# peak resident memory on a short generation.
#
# SHAPES are `shape:type,type` items (the types default to TYPES, "Q4_0 Q4_K_M"):
# - `1b`, `3b`: Llama-3.2-1B's and -3B's configs without their rope scaling and with the
#   default model's 49k vocabulary (random_gguf.py);
# - `llama-3.2-3b`, `qwen3-4b`, `gemma3-1b`, `qwen3-30b-a3b`: the configs whole, rope scaling
#   and vocabulary included (model_shapes.py); the MoE's first LAYERS layers (default 8).
#
#   SHAPES="1b 3b" bash benchmarks/peers/gguf_shapes.sh     # files in $PEERS (~2 GB F16 for
#                                                            # 1B, ~6 GB for 3B; removed after)
#   SHAPES="qwen3-4b:Q4_K_M gemma3-1b" OUTPUT=model_shapes bash benchmarks/peers/gguf_shapes.sh
#
# Results: benchmarks/results/peers/$OUTPUT.md (gguf_speed by default: with the default model's
# file) and ${OUTPUT}_memory.md (gguf_memory.md). Figures on random weights are speed and
# memory only: no acceptance.
set -euo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/peers/llama_cpp_tools.sh
BUILD=$PEERS/llama.cpp-build
OUT=benchmarks/results/peers
export OUTPUT=${OUTPUT:-gguf_speed}
MEMORY=$OUT/${OUTPUT%_speed}_memory.md
build_llama_tool "$BUILD" llama-quantize -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF
files=()
for item in ${SHAPES:-1b 3b}; do
  shape=${item%%:*}
  types=${TYPES:-Q4_0 Q4_K_M}
  [ "$item" = "$shape" ] || types=${item#*:}
  case $shape in
    1b | 3b) name=llama-3.2-$shape-random
             write=(benchmarks/peers/random_gguf.py "$shape") ;;
    qwen3-30b-a3b) name=$shape-${LAYERS:-8}-layers-random
                   write=(benchmarks/peers/model_shapes.py "$shape" --layers "${LAYERS:-8}") ;;
    *) name=$shape-random
       write=(benchmarks/peers/model_shapes.py "$shape") ;;
  esac
  f16=$PEERS/$name-F16.gguf
  for type in ${types//,/ }; do
    out=$PEERS/$name-$type.gguf
    if [ ! -f "$out" ]; then
      [ -f "$f16" ] || PYTHONPATH=src:tests .venv/bin/python "${write[0]}" "${write[@]:1}" "$f16"
      "$BUILD/bin/llama-quantize" "$f16" "$out.part" "$type" 2 > "$PEERS/quantize.log" 2>&1
      mv "$out.part" "$out"
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
} > "$MEMORY"
cat "$MEMORY"
