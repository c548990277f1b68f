"""llama.cpp's lookup decoding (`llama-lookup`, its prompt n-gram speculation) beside dresd's
`ar`, `pld` and `hybrid`, on the same GSM8K questions, back to back in each round.

    PYTHONPATH=src .venv/bin/python benchmarks/peers/llama_lookup.py \
        --lookup ~/.cache/dresd/peers/llama.cpp-lookup-build/bin/llama-lookup \
        --gguf ~/.cache/dresd/peers/SmolLM2-135M-Instruct-bf16.gguf --threads 2

(`llama_lookup.sh` builds the tool and runs this.) Per round: `dresd bench --methods
ar,pld,hybrid` on the first N questions (chat-templated by dresd), then `llama-lookup` on each
question's text with the same template (`--spec-draft-n-max 5`, greedy), its time the prompt's
encoding plus decoding, as dresd's includes the prefill. llama.cpp tokenizes the text itself
and samples with its own sampler: its outputs are not checked against dresd's. Writes a
markdown table (stdout) and the raw figures (`--out` JSON lines).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from transformers import AutoTokenizer

from dresd.datasets import load_prompts
from dresd.host import cpu_flags, cpu_model
from dresd.models.target import resolve_model_path
from dresd.prompts import encode_prompt

TIMES = re.compile(r"(encoded|decoded)\s+(\d+) tokens in\s+([\d.]+) seconds")
ACCEPT = re.compile(r"accept\s+=\s+([\d.]+)%")


def lookup_run(tool: Path, gguf: Path, text: str, tokens: int, threads: int) -> dict:
    """One `llama-lookup` generation: tokens/s over encoding plus decoding, acceptance."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as prompt:
        prompt.write(text)
        prompt.flush()
        done = subprocess.run([str(tool), "-m", str(gguf), "-f", prompt.name, "-n", str(tokens),
                               "-t", str(threads), "--spec-draft-n-max", "5", "--temp", "0",
                               "-c", "2048"], capture_output=True, text=True)
    times = {kind: (int(count), float(seconds)) for kind, count, seconds
             in TIMES.findall(done.stderr)}
    if done.returncode != 0 or "decoded" not in times:
        raise RuntimeError(f"llama-lookup failed ({done.returncode}): {done.stderr[-2000:]}")
    accept = ACCEPT.search(done.stderr)
    decoded, seconds = times["decoded"][0], times["decoded"][1] + times["encoded"][1]
    return {"tokens": decoded, "seconds": seconds,
            "acceptance": float(accept.group(1)) / 100 if accept else None}


def dresd_run(limit: int, tokens: int, threads: int, store: str | None, out: Path) -> dict:
    """`dresd bench` tokens/s per method (generated tokens over their seconds, all prompts)."""
    command = [str(Path(sys.executable).with_name("dresd")), "bench", "--methods", "ar,pld,hybrid",
               "--dataset", "gsm8k", "--limit", str(limit), "--max-new-tokens", str(tokens),
               "--threads", str(threads), "--out", str(out)]
    if store:
        command += ["--datastore", store]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"dresd bench failed ({done.returncode}): {done.stderr[-2000:]}")
    report = json.loads((out / "report.json").read_text())
    return {name: summary["tokens_per_s"] for name, summary in report["methods"].items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lookup", type=Path, required=True)
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--datastore", default=None)
    parser.add_argument("--work", type=Path, default=Path("runs/peers/llama_lookup"))
    parser.add_argument("--out", type=Path, default=None, help="raw figures, JSON lines")
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("default"))  # not the model
    texts = [tokenizer.decode(encode_prompt(tokenizer, prompt.text))
             for prompt in load_prompts("gsm8k", args.prompts)]
    rows = []
    for round_number in range(1, args.rounds + 1):
        speeds = dresd_run(args.prompts, args.tokens, args.threads, args.datastore,
                           args.work / f"round{round_number}")
        runs = [lookup_run(args.lookup, args.gguf, text, args.tokens, args.threads)
                for text in texts]
        speeds["llama-lookup"] = (sum(run["tokens"] for run in runs)
                                  / sum(run["seconds"] for run in runs))
        acceptance = [run["acceptance"] for run in runs if run["acceptance"] is not None]
        rows.append({"round": round_number, "threads": args.threads, "tokens_per_s": speeds,
                     "lookup_acceptance": statistics.mean(acceptance) if acceptance else None})
    if args.out:
        args.out.write_text("".join(json.dumps(row) + "\n" for row in rows))

    def mean_ratio(name: str) -> float:  # over dresd ar in the same round
        return statistics.mean(r["tokens_per_s"][name] / r["tokens_per_s"]["ar"] for r in rows)

    bf16 = [flag for flag in ("amx_bf16", "avx512_bf16") if flag in cpu_flags()]
    print("# llama.cpp's lookup decoding beside dresd\n")
    print(f"CPU: {cpu_model()} ({', '.join(bf16) or 'no native bf16'}), {args.threads} thread(s), "
          f"{args.rounds} round(s) back to back, the first {args.prompts} GSM8K test questions "
          f"(dresd's chat template), {args.tokens} new tokens, greedy. llama.cpp: "
          "`llama-lookup --spec-draft-n-max 5` on the bf16 GGUF (its own tokenizer and sampler; "
          "tokens/s over prompt encoding plus decoding); dresd: `dresd bench`, bf16. Produced by "
          "`bash benchmarks/peers/llama_lookup.sh`.\n")
    print("| runner | tokens/s (mean of rounds) | x dresd `ar` (same round) |")
    print("| --- | ---: | ---: |")
    for name in ("ar", "pld", "hybrid", "llama-lookup"):
        label = f"dresd `{name}`" if name != "llama-lookup" else "llama.cpp `llama-lookup`"
        mean = statistics.mean(r["tokens_per_s"][name] for r in rows)
        print(f"| {label} | {mean:.1f} | {mean_ratio(name):.2f}x |")
    acceptance = [r["lookup_acceptance"] for r in rows if r["lookup_acceptance"] is not None]
    if acceptance:
        print(f"\nllama-lookup's draft acceptance: {100 * statistics.mean(acceptance):.1f}%.")


if __name__ == "__main__":
    main()
