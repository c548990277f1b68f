"""Code edits with OpenAI's `prediction`: the file being edited as the predicted output, on
the default model, every method with and without it.

Each prompt asks the model to return a HumanEval function (its signature, docstring and
canonical solution: code no one here wrote) with a small change; the prediction is the
function as it stands, as an editor sends it. Greedy, so every run must give `ar`'s tokens.
Methods alternate prompt by prompt, `--rounds` times.

Reported: tokens/s as the user times it (prefill included), the ratio over `ar` without a
prediction per round and its spread, tokens per forward, and OpenAI's accepted and rejected
prediction tokens (`drafters/prediction.py`).

    PYTHONPATH=src .venv/bin/python benchmarks/prediction_edits.py --rounds 2 \
        --out benchmarks/results/prediction_edits
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import statistics
import time
from pathlib import Path

import torch

from dresd.datasets import data_dir
from dresd.drafters.prediction import prediction_tokens, with_prediction
from dresd.host import cpu_model
from dresd.models.target import load_target
from dresd.prompts import encode_prompt
from dresd.runner import GenerationSettings, MethodRunner

EDITS = ["Rename the function to `solve` and return the whole function, nothing else.",
         "Add a comment above the return statement and return the whole function, nothing "
         "else.",
         "Return the whole function unchanged but for type hints on its arguments."]


def functions(count: int) -> list[str]:
    """The first `count` HumanEval functions under 1,200 characters, whole."""
    with gzip.open(data_dir() / "humaneval" / "HumanEval.jsonl.gz", "rt") as lines:
        rows = [json.loads(line) for line in lines]
    whole = [row["prompt"] + row["canonical_solution"] for row in rows]
    return [code.strip() for code in whole if len(code) < 1200][:count]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="ar,pld,hybrid")
    parser.add_argument("--count", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/prediction_edits"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    target = load_target("default")
    settings = GenerationSettings(max_new_tokens=args.max_new_tokens)
    runners = {method: MethodRunner(target, method, settings)
               for method in args.methods.split(",")}
    tokenizer = target.tokenizer
    cases = [(encode_prompt(tokenizer, f"{EDITS[i % len(EDITS)]}\n\n```python\n{code}\n```",
                            True), tokenizer(code, add_special_tokens=False)["input_ids"])
             for i, code in enumerate(functions(args.count))]
    labels = [f"{method}{suffix}" for method in runners for suffix in ("", "+prediction")]

    runs: dict[str, list[dict]] = {label: [] for label in labels}
    reference: dict[int, list[int]] = {}
    for round_ in range(args.rounds):
        for index, (prompt, predicted) in enumerate(cases):
            for label in labels:
                runner = runners[label.split("+")[0]]
                drafter = runner.drafter
                if label.endswith("+prediction"):
                    drafter = with_prediction(drafter, predicted, len(prompt))
                started = time.perf_counter()
                state = runner.engine.add(runner.request(prompt, drafter))
                runner.engine.run()
                seconds = time.perf_counter() - started
                tokens = state.result.token_ids
                assert tokens == reference.setdefault(index, tokens), (label, index)
                accepted, rejected = prediction_tokens(predicted, tokens)
                runs[label].append({"round": round_, "case": index, "tokens": len(tokens),
                                    "seconds": seconds,
                                    "forwards": state.result.num_target_forwards,
                                    "accepted_prediction_tokens": accepted,
                                    "rejected_prediction_tokens": rejected})

    def speed(label: str, round_: int) -> float:
        rows = [r for r in runs[label] if r["round"] == round_]
        return sum(r["tokens"] for r in rows) / sum(r["seconds"] for r in rows)

    summary = {}
    for label in labels:
        ratios = [speed(label, r) / speed("ar", r) for r in range(args.rounds)]
        rows = runs[label]
        summary[label] = {"speedup_over_ar": ratios, "speedup_mean": statistics.mean(ratios),
                          "tokens_per_s": statistics.mean(speed(label, r)
                                                          for r in range(args.rounds)),
                          "tokens_per_forward": sum(r["tokens"] for r in rows)
                          / sum(r["forwards"] for r in rows)}
    report = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "cpu": cpu_model(), "threads": args.threads, "dtype": str(target.dtype),
              "cases": len(cases), "rounds": args.rounds, "outputs_identical_to_ar": True,
              "summary": summary, "runs": runs,
              "examples": [tokenizer.decode(reference[i], skip_special_tokens=True)
                           for i in range(min(2, len(cases)))]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: report[k] for k in ("date", "cpu", "threads", "dtype", "summary")},
                     indent=1))


if __name__ == "__main__":
    main()
