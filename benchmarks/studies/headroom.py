"""Where hybrid's accepted tokens sit among its candidates, ranked by its own estimates.

    python benchmarks/studies/headroom.py --run benchmarks/results/hybrid/gsm8k-id --limit 20 \
        --name gsm8k-id

Replays hybrid (every source at every step) on a recorded bench run's AR outputs and keeps,
at each step, every candidate it merged. The candidate nodes are ranked by hybrid's reach
estimate P(v) (`CandidateTree.reach_probabilities`), and for k = 1, 2, 3, ... the table gives

    accepted(k)   the tokens greedy verification accepts from the k most probable nodes (the
                  path stops at its first node outside them), a step on average;
    expected(k)   the sum of their P: what hybrid expects them to hold;
    pays(k)       tokens per decode step of a fixed top-k tree: the steps' emitted tokens
                  (1 + accepted) over their verify cost, cost(k + 1) each (fewer nodes where a
                  step has fewer), with the run's verify-cost curve; drafting time left out.

The last row, "oracle", verifies only the path that will be accepted, among all candidates:
the bound for these candidates on this curve. The steps are those of verifying every candidate
(each advances as far as all of them reach), so every row counts over the same steps. A gap
between accepted(k) and expected(k) is a miscalibrated estimate; a gap between the best pays(k)
and the oracle is what a better ranking could still win. Results: results/headroom/NAME.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
from draft_shapes import print_table, recorded_run

from dresd.bench.replay import drafter_proposer, replay
from dresd.calibrate import cost_at
from dresd.drafters import make_drafter

RESULTS = Path(__file__).parents[1] / "results" / "headroom"
TOP_K = (1, 2, 3, 4, 6, 8, 12, 16, 32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, required=True, help="a bench --out folder")
    parser.add_argument("--limit", type=int, default=None, help="first N prompts of the run")
    parser.add_argument("--name", default=None, help="write results/headroom/NAME.md")
    args = parser.parse_args()
    torch.set_num_threads(1)

    report, curve, _, refs = recorded_run(args.run, args.limit)
    meta = report["meta"]
    # A flat curve and room for every node: hybrid returns all its candidates.
    drafter = make_drafter("hybrid", datastore=meta.get("datastore"), cost={1: 1.0, 2: 1.0},
                           skip_sources=False, max_tree_nodes=10_000)
    propose_all = drafter_proposer(drafter, refs)
    # per row (each k, then the oracle): accepted tokens, expected ones, verify cost in steps
    accepted, expected, cost = (np.zeros(len(TOP_K) + 1) for _ in range(3))
    steps = 0

    def ranked_propose(n: int, i: int, remaining: int) -> list:
        nonlocal steps
        drafts = propose_all(n, i, remaining)
        tree = drafter.last.tree
        reach = np.asarray(tree.reach_probabilities(drafter.table))
        order = np.argsort(-reach[1:], kind="stable") + 1
        rank = {int(v): r for r, v in enumerate(order)}
        path, node = [], 0  # the nodes verification accepts, were every candidate verified
        for token in refs[n].ids[i + 1 : i + 1 + remaining]:
            node = tree.children[node].get(token, -1)
            if node < 0:
                break
            path.append(node)
        for j, k in enumerate(TOP_K):
            accepted[j] += next((d for d, v in enumerate(path) if rank[v] >= k), len(path))
            expected[j] += reach[order[:k]].sum()
            cost[j] += cost_at(curve, 1 + min(k, len(order)))
        accepted[-1] += len(path)
        cost[-1] += cost_at(curve, 1 + len(path))
        steps += 1
        return drafts

    replay(refs, ranked_propose, drafter)
    pays = (steps + accepted) / cost
    accepted, expected = accepted / steps, expected / steps
    lines = [f"# hybrid's candidates ranked by its estimates: `{args.run}` ({len(refs)} prompts, "
             f"{steps} steps, {meta['dtype']})", "",
             "| top k nodes | accepted a step | expected a step | tokens per step-cost |",
             "| ---: | ---: | ---: | ---: |"]
    for j, k in enumerate(TOP_K):
        lines.append(f"| {k} | {accepted[j]:.3f} | {expected[j]:.3f} | {pays[j]:.2f} |")
    lines.append(f"| oracle | {accepted[-1]:.3f} | - | {pays[-1]:.2f} |")
    print_table(lines, RESULTS, args.name)


if __name__ == "__main__":
    main()
