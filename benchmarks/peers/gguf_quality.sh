#!/usr/bin/env bash
# dresd's correctness on GGUF files, checked against llama.cpp on the same file: teacher-forced
# over real text (GSM8K training answers, ~$TOKENS tokens), the next-token top-1 agreement
# with llama.cpp's and the perplexity beside `llama-perplexity`'s (gguf_agreement.py).
#
#   bash benchmarks/peers/gguf_quality.sh    # builds llama-perplexity once (llama_cpp_tools.sh)
#
# Files: the default model's own Q4_1 file, and any FILES=... given (real weights give a
# meaningful perplexity; random ones only the agreement). Results:
# benchmarks/results/peers/gguf_quality.md (and .jsonl). Not part of the tests.
set -euo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/peers/llama_cpp_tools.sh
BUILD=$PEERS/llama.cpp-build
OUT=benchmarks/results/peers
TOKENS=${TOKENS:-9000}
DATA=${DRESD_DATA:-../shared/data}
mkdir -p "$OUT"
build_llama_tool "$BUILD" llama-perplexity -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF
fetch_q4_1
TEXT=$PEERS/gsm8k-answers.txt
.venv/bin/python -c "import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
print('\n\n'.join(r['question'] + '\n' + r['answer'] for r in rows[:int(sys.argv[2]) // 90]))" \
  "$DATA/gsm8k/train.jsonl" "$TOKENS" > "$TEXT"
read -r -a files <<< "$Q4_1 ${FILES:-}"
: > "$OUT/gguf_quality.jsonl"
: > "$OUT/gguf_quality_self.jsonl"
for file in "${files[@]}"; do
  logits=$PEERS/$(basename "$file" .gguf).logits
  "$BUILD/bin/llama-perplexity" -m "$file" -f "$TEXT" -c 512 -t 2 \
    --kl-divergence-base "$logits" > "$PEERS/perplexity.log" 2>&1
  ppl=$(grep -o 'Final estimate: PPL = [0-9.]*' "$PEERS/perplexity.log" | grep -o '[0-9.]*$' \
        || true)
  if [ -z "$ppl" ]; then  # this version prints the running estimate: take the last one
    ppl=$(grep -o '\[[0-9]*\][0-9.]*' "$PEERS/perplexity.log" | tail -1 | sed 's/.*\]//')
  fi
  PYTHONPATH=src .venv/bin/python benchmarks/peers/gguf_agreement.py "$file" "$logits" \
    --llama-ppl "$ppl" >> "$OUT/gguf_quality.jsonl"
  # llama.cpp against itself: the same file and text in micro-batches of 32 rows at 1 thread
  # (other matmul kernels, another split of the work), its own top-1 agreement
  "$BUILD/bin/llama-perplexity" -m "$file" -f "$TEXT" -c 512 -b 512 -ub 32 -t 1 \
    --kl-divergence-base "$logits.ub32" > "$PEERS/perplexity-ub32.log" 2>&1
  PYTHONPATH=src .venv/bin/python benchmarks/peers/gguf_agreement.py "$file" "$logits" \
    --against "$logits.ub32" >> "$OUT/gguf_quality_self.jsonl"
done
.venv/bin/python - "$OUT/gguf_quality.jsonl" > "$OUT/gguf_quality.md" <<'PY'
import json, os, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
print("# dresd against llama.cpp on the same GGUF files: next-token agreement and perplexity\n")
print(f"CPU: {rows[0]['cpu']}. Teacher-forced over GSM8K training questions and answers as "
      "llama-perplexity tokenizes and chunks them (n_ctx 512, the second half of each chunk "
      "scored). Made by `bash benchmarks/peers/gguf_quality.sh`.\n")
print("| file | dresd linears | positions | top-1 agreement | dresd PPL | llama.cpp PPL | ratio |")
print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
for r in rows:
    print(f"| {os.path.basename(r['model'])} | {r['linears']} | {r['positions']} | "
          f"{100 * r['top1_agreement']:.2f}% | {r['dresd_ppl']:.4f} | {r['llama_ppl']} | "
          f"{r.get('ppl_ratio', float('nan')):.4f} |")
print(f"\nAway from near-ties (llama.cpp's two best next tokens {rows[0]['near_tie_nats']} nats "
      "or more apart):\n")
for r in rows:
    print(f"- {os.path.basename(r['model'])}: {100 * r['share_not_near_tie']:.1f}% of positions, "
          f"top-1 agreement {100 * r['top1_agreement_not_near_tie']:.2f}%")
selfs = [json.loads(line) for line in open(sys.argv[1].replace(".jsonl", "_self.jsonl"))]
print("\nllama.cpp against itself (the same file and text, micro-batches of 32 rows at 1 "
      "thread against its default batch at 2 threads):\n")
for r in selfs:
    print(f"- {os.path.basename(r['logits'])}: top-1 agreement {100 * r['top1_agreement']:.2f}%")
PY
cat "$OUT/gguf_quality.md"
