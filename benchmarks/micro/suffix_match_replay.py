"""Does a SuffixDecoding draft's acceptance depend on how long a match found it?

`hybrid` learns each node's acceptance by features (`drafters/hybrid.py`); for the suffix
source, the count share count(s + [t]) / count(s) and the depth. This replays a bench's plain
(AR) outputs through a `SuffixDrafter` as `hybrid` holds it (16 nodes, learning each output
after it ends): at every position of every output it drafts, and each tree node whose parent
lay on the text that came is a trial, accepted if its token came next. The trials are counted
by share bucket, depth and the length of the context suffix the tree was found after. Greedy
outputs are what every method emits, so the AR outputs are every method's.

    .venv/bin/dresd bench --methods ar --dataset mt_bench --max-new-tokens 128 --out runs/mt-ar
    PYTHONPATH=src .venv/bin/python benchmarks/micro/suffix_match_replay.py \\
        runs/mt-ar/outputs.jsonl --dataset mt_bench
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from transformers import AutoTokenizer

from dresd.datasets import load_prompts
from dresd.decoding.drafter import DraftContext
from dresd.drafters.hybrid import share_bucket
from dresd.drafters.suffix import SuffixDrafter
from dresd.models.target import default_model_dir
from dresd.prompts import encode_prompt

MATCHES = ("0-2", "3-5", "6-10", "11+")  # `match_bucket`'s buckets


def match_bucket(match: int) -> int:
    """Context tokens the tree was found after -> 0 (0-2), 1 (3-5), 2 (6-10), 3 (11+)."""
    return 0 if match <= 2 else 1 if match <= 5 else 2 if match <= 10 else 3


def count_trials(outputs: list[list[int]], prompts: list[list[int]], draft_len: int
                 ) -> tuple[Counter, Counter]:
    """(accepted, tried) by (share bucket, depth 1-4, match bucket)."""
    drafter = SuffixDrafter(max_tree_nodes=16, learn=True)
    accepted, tried = Counter(), Counter()
    no_state = torch.zeros(1)
    for prompt, output in zip(prompts, outputs, strict=True):
        for position in range(1, len(output)):
            ids = np.array(prompt + output[:position], dtype=np.int64)
            came = output[position:]
            tree = drafter.speculation_tree(
                DraftContext(ids, no_state, max_draft_len=min(draft_len, len(came))))
            depth, on_text = [], []
            for node, (token, parent) in enumerate(zip(tree.tokens, tree.parents, strict=True)):
                depth.append(1 if parent < 0 else depth[parent] + 1)
                reached = parent < 0 or on_text[parent]
                on_text.append(reached and came[depth[node] - 1] == token)
                if reached:
                    share = tree.probs[node] / (tree.probs[parent] if parent >= 0 else 1.0)
                    cell = (share_bucket(share), min(depth[node], 4), match_bucket(tree.match_len))
                    tried[cell] += 1
                    accepted[cell] += on_text[node]
        drafter.observe(prompt, output)
    return accepted, tried


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("outputs", type=Path, help="a bench's outputs.jsonl with `ar` outputs")
    parser.add_argument("--dataset", required=True, help="the set the bench ran")
    parser.add_argument("--draft-len", type=int, default=10)
    args = parser.parse_args()
    rows = [json.loads(line) for line in args.outputs.read_text().splitlines()]
    rows = [row for row in rows if row["method"] == "ar"]
    if not rows:
        raise SystemExit(f"{args.outputs} holds no `ar` outputs")
    prompts = load_prompts(args.dataset, limit=max(row["prompt_index"] for row in rows) + 1)
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    encoded = [encode_prompt(tokenizer, prompts[row["prompt_index"]].text) for row in rows]
    accepted, tried = count_trials([row["token_ids"] for row in rows], encoded, args.draft_len)
    print(f"{len(rows)} {args.dataset} outputs; accepted / tried (rate) by the match length")
    print("| share | depth | " + " | ".join(f"match {m}" for m in MATCHES) + " |")
    print("| --- | ---: |" + " ---: |" * len(MATCHES))
    for share, name in enumerate(("< 0.4", "0.4-0.8", ">= 0.8")):
        for depth in range(1, 5):
            cells = [(accepted[share, depth, m], tried[share, depth, m]) for m in range(4)]
            print(f"| {name} | {depth}{'+' if depth == 4 else ''} | " + " | ".join(
                f"{a}/{t} ({a / t:.2f})" if t else "-" for a, t in cells) + " |")


if __name__ == "__main__":
    main()
