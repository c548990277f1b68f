"""Which draft shape pays on this CPU: accepted lengths replayed from a recorded bench run,
priced with the measured verify-cost curve.

    python benchmarks/draft_shapes.py --outputs RUN/outputs.jsonl --datastore STORE [--limit N]

Greedy verification accepts exactly the longest tree path that equals the target's own next
tokens, and the output is AR's. So, given AR's tokens for a prompt (a bench run's outputs.jsonl
holds them), the speculative loop can be replayed without verify forwards:

1. one target forward over prompt + AR output gives every position's last-layer hidden state;
2. at a step whose bonus token sits at position i, the drafter proposes from ids[: i + 1] and
   hidden[i - 1] (the state that predicted the bonus token, as in the engine);
3. the drafts merge into a token tree; accepted = the longest tree path equal to ids[i + 1 :];
4. the next step's bonus token is at i + accepted + 1.

Up to float noise in the hidden states (one forward instead of the incremental ones, which can
move an ANN neighbour) these are the engine's own steps. Each step is priced at
cost(1 + tree nodes) one-token decode steps, from `results/engine.json` (linear between the
measured tree sizes; the step's drafting time, under 1% in the recorded runs, is left out), and

    estimated speedup = generated tokens / sum over steps of cost(1 + tree nodes)

against AR's one token per cost-1 step. The recorded bench runs give the measured speedups of
the default shapes, to read these estimates against.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from dresd.datasets import load_prompts
from dresd.decoding.tree import DraftTree
from dresd.drafters import DraftContext, make_drafter
from dresd.models import load_target
from dresd.prompts import encode_prompt

RESULTS = Path(__file__).parent / "results"

# (label, method, options): the defaults, then node budgets that the verify-cost curve favours.
SHAPES = [
    ("pld (1 draft)", "pld", {}),
    ("pld (3 drafts)", "pld", dict(num_drafts=3)),
    ("rest (64 nodes)", "rest", {}),
    *[(f"rest ({n} nodes)", "rest", dict(max_tree_nodes=n)) for n in (16, 8, 4, 3, 2, 1)],
    ("dresd (10 x 10, paper)", "dresd", {}),
    ("dresd (1 x 10, nearest)", "dresd", dict(num_drafts=1)),
    *[(f"dresd ({n} nodes)", "dresd", dict(max_tree_nodes=n)) for n in (16, 8, 4, 3, 2, 1)],
]


def step_cost(curve: dict[int, float], tree_tokens: int) -> float:
    """Verify cost of a tree of `tree_tokens` tokens in one-token steps (linear in between)."""
    sizes = sorted(curve)
    return float(np.interp(tree_tokens, sizes, [curve[s] for s in sizes]))


def accepted_length(tree: DraftTree, future: list[int]) -> int:
    """Greedy verification: how far the tree follows the target's own next tokens."""
    node, accepted = 0, 0
    for token in future:
        node = tree.children[node].get(token)
        if node is None:
            break
        accepted += 1
    return accepted


def replay(drafter, ids: list[int], hidden: torch.Tensor, prompt_len: int) -> list[tuple]:
    """(tree nodes, accepted) for every step of the loop over `ids` (prompt + AR output)."""
    steps, i = [], prompt_len  # ids[prompt_len] is the first token, emitted by the prefill
    tokens = np.asarray(ids, dtype=np.int64)
    while i < len(ids) - 1:
        remaining = len(ids) - 1 - i
        drafts = drafter.propose(DraftContext(tokens[: i + 1], hidden[i - 1], remaining))
        tree = DraftTree.from_drafts(ids[i], [d[:remaining] for d in drafts if d])
        accepted = accepted_length(tree, ids[i + 1 :])
        steps.append((tree.num_drafted, accepted))
        i += accepted + 1
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--outputs", type=Path, required=True, help="a bench run's outputs.jsonl")
    parser.add_argument("--datastore", required=True, help="the store that run used")
    parser.add_argument("--limit", type=int, default=None, help="first N prompts of the run")
    parser.add_argument("--threads", type=int, default=1, help="verify-cost curve to price with")
    parser.add_argument("--name", required=True, help="results/draft_shapes/NAME.json")
    args = parser.parse_args()
    torch.set_num_threads(1)

    curve = {int(n): c for n, c in json.loads((RESULTS / "engine.json").read_text())[
        "by_threads"][str(args.threads)]["verify_cost"].items()}
    rows = [json.loads(line) for line in args.outputs.read_text().splitlines()]
    ar_rows = [r for r in rows if r["method"] == "ar"][: args.limit]
    target = load_target("default")
    drafters = {label: make_drafter(method, datastore=args.datastore, **options)
                for label, method, options in SHAPES}
    prompts = {}
    steps: dict[str, list[tuple]] = {label: [] for label in drafters}
    started = time.perf_counter()
    for row in ar_rows:
        if row["dataset"] not in prompts:
            prompts[row["dataset"]] = load_prompts(row["dataset"])
        prompt = encode_prompt(target.tokenizer, prompts[row["dataset"]][row["prompt_index"]].text)
        ids = prompt + row["token_ids"]
        with torch.inference_mode():
            out = target.model(torch.tensor([ids]), output_hidden_states=True)
        hidden = out.hidden_states[-1][0]
        for label, drafter in drafters.items():
            steps[label] += replay(drafter, ids, hidden, len(prompt))
    tokens = sum(len(r["token_ids"]) for r in ar_rows)

    table = {}
    for label, records in steps.items():
        nodes = np.array([n for n, _ in records])
        accepted = np.array([a for _, a in records])
        cost = sum(step_cost(curve, 1 + n) for n in nodes) + 1  # + the prefill's token
        table[label] = {
            "mean_accepted_length": float((accepted + 1).mean()),
            "drafted_tokens_per_step": float(nodes.mean()),
            "acceptance_rate": float(accepted.sum() / max(nodes.sum(), 1)),
            "mean_step_cost": float(cost / (len(records) + 1)),
            "estimated_speedup": tokens / cost,
        }
    result = {"outputs": str(args.outputs), "datastore": args.datastore, "prompts": len(ar_rows),
              "tokens": tokens, "threads_of_curve": args.threads,
              "seconds": round(time.perf_counter() - started, 1), "shapes": table}
    out = RESULTS / "draft_shapes" / f"{args.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    table_md = markdown(args.name, result)
    out.with_suffix(".md").write_text(table_md)
    print(table_md, end="")
    print(f"written {out} and {out.with_suffix('.md').name}")


def markdown(name: str, result: dict) -> str:
    lines = [f"# Draft shapes replayed: {name}", "",
             f"AR outputs: `{result['outputs']}` (first {result['prompts']} prompts, "
             f"{result['tokens']} tokens); store `{Path(result['datastore']).name}`; priced with "
             f"the {result['threads_of_curve']}-thread verify-cost curve of `engine.json`.", "",
             "| shape | mean accepted length | drafted/step | acceptance rate | step cost | "
             "est. speedup |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for label, t in result["shapes"].items():
        lines.append(f"| {label} | {t['mean_accepted_length']:.2f} "
                     f"| {t['drafted_tokens_per_step']:.1f} | {t['acceptance_rate']:.1%} "
                     f"| {t['mean_step_cost']:.2f} | {t['estimated_speedup']:.2f}x |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
