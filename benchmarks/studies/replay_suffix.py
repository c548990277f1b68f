"""SuffixDecoding settings on the GSM8K repeated workload, replayed from a recorded run.

    python benchmarks/studies/replay_suffix.py --outputs RUN/outputs.jsonl [--dtype bfloat16]

Greedy output is AR's whatever drafts, so a drafter's steps on a request can be replayed from
AR's recorded tokens without the model (`draft_shapes.replay`), in the run's request order so
that the global trie learns what it learned there. Mean accepted length is then exact (the
engine's own figure for the same outputs); the speedup is estimated as generated tokens over
the sum of verify costs cost(1 + tree tokens) from the machine's cached curve (`dresd
calibrate`; drafting time and the loop's own per-step cost are left out, so it runs above the
measured one: read it to compare settings, not as a speed).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from draft_shapes import recorded_outputs, replay
from repeated_workload import bump_first_number
from transformers import AutoTokenizer

from dresd.calibrate import cost_at
from dresd.datasets import data_dir, read_jsonl
from dresd.drafters.suffix import SuffixDrafter
from dresd.host import cache_dir
from dresd.models.target import default_model_dir
from dresd.prompts import encode_prompt

SETTINGS = {
    "suffix[learn=0]": dict(learn=False),
    "suffix": {},
    "suffix[max_spec_factor=2]": dict(max_spec_factor=2.0),
    "suffix[max_spec_factor=4]": dict(max_spec_factor=4.0),
    "suffix[max_depth=32]": dict(max_depth=32),
    "suffix[min_token_prob=0.3]": dict(min_token_prob=0.3),
    "suffix[tree=0]": dict(tree=False),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--outputs", type=Path, required=True,
                        help="a gsm8k_variants run's outputs.jsonl (AR's rows are replayed)")
    parser.add_argument("--dtype", default="bfloat16", help="whose cached verify-cost curve")
    args = parser.parse_args()

    outputs = [row["token_ids"] for row in recorded_outputs(args.outputs) if row["method"] == "ar"]
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    requests = [(category, encode_prompt(tokenizer, text))
                for row in read_jsonl(data_dir() / "gsm8k" / "test.jsonl")[: len(outputs) // 2]
                for category, text in (("original", row["question"]),
                                       ("variant", bump_first_number(row["question"])))]
    curve_file = next((cache_dir() / "calibration").glob(f"*-{args.dtype}-1threads-cpu.json"))
    curve = {int(k): v for k, v in json.loads(curve_file.read_text())["cost"].items()}

    print("| settings | original: mean accepted length | est. speedup | variant: mean accepted "
          "length | est. speedup |\n| --- | ---: | ---: | ---: | ---: |")
    for label, options in SETTINGS.items():
        drafter = SuffixDrafter(**options)
        totals = {"original": [0, 0, 0.0], "variant": [0, 0, 0.0]}  # tokens, forwards, cost
        for (category, prompt), output in zip(requests, outputs, strict=True):
            ids = prompt + output
            steps = replay(drafter, ids, torch.zeros(len(ids), 1), len(prompt))
            drafter.observe(prompt, output)
            total = totals[category]
            total[0] += len(output)
            total[1] += 1 + len(steps)  # the prefill emits the first token
            total[2] += 1 + sum(cost_at(curve, 1 + nodes) for nodes, _ in steps)
        print(f"| {label} | " + " | ".join(f"{t / f:.2f} | {t / c:.2f}x"
                                          for t, f, c in totals.values()) + " |")


if __name__ == "__main__":
    main()
