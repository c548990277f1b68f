#!/bin/bash
# Every tier forced in turn, two rounds: ar tokens/s of the default Q4_1 GGUF file (README.md).
mkdir -p "${OUT:-/tmp/isa}"
# old: the source before the tiers (git archive 5da8d77 src | tar -x -C /tmp/oldsrc).
# pre50-<tier>: the source before issue 50's AVX2 work (git archive 602ba4a src | tar -x -C
# /tmp/pre50), under that tier.
cd "$(git rev-parse --show-toplevel)"
for round in 1 2; do
for t in old avx512bf16 avx512vnni avx2vnni avx2 pre50-avx2vnni pre50-avx2; do
  case $t in
    old) env="PYTHONPATH=/tmp/oldsrc/src" ;;
    pre50-*) env="PYTHONPATH=/tmp/pre50/src DRESD_ISA=${t#pre50-}" ;;
    *) env="DRESD_ISA=$t" ;;
  esac
  start=$(date +%s)
  env $env .venv/bin/dresd bench --model default-gguf --methods ar --dataset gsm8k --limit 4 --threads 1 --out ${OUT:-/tmp/isa}/$t-$round.json > ${OUT:-/tmp/isa}/$t-$round.log 2>&1
  echo "$t round $round rc=$? $(( $(date +%s) - start ))s" >> ${OUT:-/tmp/isa}/progress
done
done
