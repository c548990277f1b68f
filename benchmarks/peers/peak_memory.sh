#!/usr/bin/env bash
# Peak resident memory of a short run on GGUF files: llama.cpp's llama-bench (8 prompt tokens,
# 16 generated) beside `dresd generate` (16 tokens after a short chat prompt), each in its own
# process under /usr/bin/time, ROUNDS interleaved rounds; and dresd's baseline (its imports
# alone). BEFORE=<a source tree> adds a column for an earlier dresd (run with this venv).
#   FILES="a.gguf b.gguf" LLAMA_BENCH=path/to/llama-bench bash benchmarks/peers/peak_memory.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
ROUNDS=${ROUNDS:-2}
peak() { /usr/bin/time -f "%M" -o /tmp/dresd-peak "$@" > /dev/null 2>&1; echo $(( $(tail -1 /tmp/dresd-peak) / 1024 )); }
dresd_run() { PYTHONPATH="$1/src" peak .venv/bin/python -m dresd generate --model "$2" \
  --method ar --prompt Hello --max-new-tokens 16 --threads 1; }
echo "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD)"
echo
echo "baseline (\`import dresd.cli.main\`): $(peak .venv/bin/python -c 'import dresd.cli.main') MB"
echo
echo "| file | file size | llama.cpp | ${BEFORE:+dresd before | }dresd |"
echo "| --- | ---: | ---: | ${BEFORE:+---: | }---: |"
for file in $FILES; do
  theirs=() before=() mine=()
  for _ in $(seq "$ROUNDS"); do
    theirs+=("$(peak "$LLAMA_BENCH" -m "$file" -p 8 -n 16 -r 1 -t 1)")
    [ -n "${BEFORE:-}" ] && before+=("$(dresd_run "$BEFORE" "$file")")
    mine+=("$(dresd_run "$PWD" "$file")")
  done
  join() { local IFS=,; echo "$*" | sed 's/,/, /g'; }
  echo "| $(basename "$file") | $(du -m "$file" | cut -f1) MB | $(join "${theirs[@]}") MB |" \
    "${BEFORE:+$(join "${before[@]}") MB |} $(join "${mine[@]}") MB |"
done
