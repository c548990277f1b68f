"""Draft budgets priced by the whole batch's forward: what they keep, and that they change no
output."""

from __future__ import annotations

import numpy as np
import torch
from conftest import TINY_VOCAB
from drafters_for_tests import OracleDrafter, RandomTreeDrafter
from test_batch import run_batched
from test_lossless_greedy import reference_greedy, varied_prompts

from dresd.decoding.batch import BatchEngine, Request
from dresd.decoding.budget import (
    MAX_BACKOFF,
    PRIOR_ACCEPTED,
    PRIOR_TRIED,
    PROBE_EVERY,
    WARMUP_STEPS,
    AcceptanceEstimates,
    CostCurve,
    DraftingLedger,
    batch_budget,
    restrict,
)
from dresd.decoding.tree import DraftTree


def random_tree(rng: np.random.Generator) -> DraftTree:
    drafts = [rng.integers(0, 5, int(rng.integers(1, 6))).tolist()
              for _ in range(int(rng.integers(1, 5)))]
    return DraftTree.from_drafts(0, drafts)


def test_a_flat_cost_keeps_everything_and_a_steep_one_nothing():
    rng = np.random.default_rng(0)
    trees = [random_tree(rng) for _ in range(4)]
    estimates = AcceptanceEstimates()
    reaches = [estimates.reach("m", tree) for tree in trees]
    kept = batch_budget(reaches, fixed_rows=4, decoding=4, cost=lambda rows: 1.0)
    assert [len(k) for k in kept] == [len(tree) - 1 for tree in trees]
    # every row costs a whole step: no draft with reach < 1 pays for its row
    kept = batch_budget(reaches, fixed_rows=4, decoding=4, cost=lambda rows: rows / 4)
    assert all(not k for k in kept)


def test_the_budget_keeps_root_paths_and_the_best_ratio():
    rng = np.random.default_rng(1)
    for _ in range(50):
        trees = [random_tree(rng) for _ in range(int(rng.integers(1, 5)))]
        reaches = [[1.0] + rng.uniform(0, 1, len(tree) - 1).tolist() for tree in trees]
        for tree, reach in zip(trees, reaches, strict=True):  # a child never beats its parent
            for node in range(1, len(tree)):
                reach[node] = min(reach[node], reach[tree.parents[node]])
        slope = rng.uniform(0.01, 0.5)

        def cost(rows: int, slope: float = slope) -> float:
            return 1.0 + slope * max(0, rows - 3)

        fixed = len(trees)
        kept = batch_budget(reaches, fixed, len(trees), cost)
        for tree, nodes in zip(trees, kept, strict=True):
            assert all(tree.parents[node] == 0 or tree.parents[node] in nodes for node in nodes)
        chosen = sum(len(nodes) for nodes in kept)
        ratio = ((len(trees) + sum(r[v] for r, nodes in zip(reaches, kept, strict=True)
                                   for v in nodes)) / cost(fixed + chosen))
        # no single node added or removed does better
        everything = [(r[v], v, i) for i, r in enumerate(reaches) for v in range(1, len(r))]
        best_left = max((r for r, v, i in everything if v not in kept[i]), default=None)
        if best_left is not None:
            gained = (len(trees) + sum(r[v] for r, nodes in zip(reaches, kept, strict=True)
                                       for v in nodes) + best_left) / cost(fixed + chosen + 1)
            assert gained <= ratio + 1e-12


def test_restrict_keeps_the_paths():
    tree = DraftTree.from_drafts(7, [[1, 2, 3], [1, 4], [5, 6]])
    pruned = restrict(tree, {1, 2, 4})  # 1 -> 2, 1 -> 4
    assert pruned.tokens == [7, 1, 2, 4]
    assert pruned.parents == [-1, 0, 1, 1]
    assert pruned.depths == [0, 1, 2, 2]
    assert pruned.children == [{1: 1}, {2: 2, 4: 3}, {}, {}]


def test_estimates_learn_what_is_accepted():
    estimates = AcceptanceEstimates()
    tree = DraftTree.from_drafts(0, [[1, 2], [3]])
    before = estimates.reach("m", tree)
    for _ in range(20):
        estimates.observe("m", tree, [1, 2, 9])  # the first draft is always right
    after = estimates.reach("m", tree)
    assert after[1] > before[1] and after[2] > before[2]
    assert after[3] < before[3]  # the second sibling never is
    assert estimates.reach("other", tree) == before  # per method


def test_budgeted_batches_are_lossless(tiny):
    """With a steep cost curve many trees are cut or dropped mid-run; output is unchanged."""
    rng = np.random.default_rng(2)
    prompts = varied_prompts(10, seed=11)
    references = [reference_greedy(tiny, p, 30) for p in prompts]

    def drafter(i: int, prompt: list[int], reference: list[int]):
        if i % 2:
            return RandomTreeDrafter(TINY_VOCAB, seed=i)
        return OracleDrafter(len(prompt), reference, draft_len=10, corrupt=0.5, seed=i,
                             vocab_size=TINY_VOCAB)

    requests = [Request(prompt=p, drafter=drafter(i, p, ref), max_new_tokens=30)
                for i, (p, ref) in enumerate(zip(prompts, references, strict=True))]
    arrivals = rng.integers(0, 10, len(prompts)).tolist()
    results = run_batched(tiny, requests, arrivals, max_batch_size=6,
                          cost=lambda rows: 1.0 + 0.05 * rows)
    for result, reference in zip(results, references, strict=True):
        assert result.token_ids == reference
    drafted = [step.num_drafted for result in results for step in result.steps]
    assert 0 in drafted and max(drafted) > 0  # some steps cut to nothing, others kept nodes


def test_a_cost_that_never_pays_is_plain_decoding(tiny):
    prompt = varied_prompts(3, seed=12)[0]
    request = Request(prompt=prompt, drafter=RandomTreeDrafter(TINY_VOCAB, seed=1),
                      max_new_tokens=20)
    result = run_batched(tiny, [request], [0], max_batch_size=1,
                         cost=lambda rows: float(rows))[0]
    assert result.token_ids == reference_greedy(tiny, prompt, 20)
    assert all(step.num_drafted == 0 for step in result.steps)
    torch.testing.assert_close(torch.tensor(len(result.steps) + 1.0),
                               torch.tensor(float(len(result.token_ids))))


def test_the_engine_learns_from_the_nodes_the_budget_cut(tiny):
    """Where no draft row pays (each costs a whole step) the budget cuts every node, and the
    estimates still learn from them against the emitted tokens: an always-right drafter's first
    tokens are counted tried and accepted, where counting only verified nodes saw none."""
    prompt = varied_prompts(3, seed=13)[0]
    reference = reference_greedy(tiny, prompt, 24)
    engine = BatchEngine(tiny, max_batch_size=1, cost=lambda rows: float(rows))
    state = engine.add(Request(prompt=prompt, drafter=OracleDrafter(
        len(prompt), reference, draft_len=6, corrupt=0.0, seed=0, vocab_size=TINY_VOCAB),
        max_new_tokens=24))
    while engine.busy():
        engine.step()
    assert state.result.token_ids == reference
    assert all(step.num_drafted == 0 for step in state.result.steps)  # every node cut
    accepted, tried = engine.estimates.counts[(state.request.drafter.name, 1, 0)]
    assert tried - PRIOR_TRIED >= WARMUP_STEPS  # a trial at every drafted step, none verified
    assert accepted - PRIOR_ACCEPTED == tried - PRIOR_TRIED  # and every one right


def test_the_ledger_drafts_while_drafting_pays_and_probes_when_it_does_not():
    def cost(rows: int) -> float:
        return 1.0 + 0.1 * (rows - 1)

    ledger = DraftingLedger()
    ledger.record_forward(0.020, 1.0)  # a one-token step: 20 ms
    assert ledger.worth_drafting("slow", 1, 1, cost)  # no record yet
    for _ in range(WARMUP_STEPS):
        ledger.record_draft("slow", 0, 0.005)  # 5 ms of drafting for nothing accepted
        ledger.record_draft("fast", 2, 0.001)  # 2 tokens a step for 1 ms
    assert not ledger.worth_drafting("slow", 1, 1, cost)
    for _ in range(MAX_BACKOFF + 2):  # alone in its step: a probe every 8th step, the first too
        assert ledger.worth_drafting("slow", 0, 1, cost)
        assert ledger.worth_drafting("slow", PROBE_EVERY, 1, cost)
        assert not ledger.worth_drafting("slow", PROBE_EVERY + 1, 1, cost)
    # beside others: not at a sequence's first step, and probes that keep saying no come ever
    # further apart, up to every 8 * 2^MAX_BACKOFF steps
    assert not ledger.worth_drafting("slow", 0, 2, cost)
    assert ledger.worth_drafting("slow", PROBE_EVERY, 2, cost)
    for misses in range(1, MAX_BACKOFF + 2):
        interval = PROBE_EVERY << min(misses, MAX_BACKOFF)
        assert not ledger.worth_drafting("slow", interval // 2 * 3, 2, cost)
        assert ledger.worth_drafting("slow", interval * 5, 2, cost)
    for _ in range(40):  # its drafts pay again: probing starts over
        ledger.record_draft("slow", 6, 0.001)
    assert ledger.worth_drafting("slow", 1, 2, cost)
    assert ledger.misses["slow"] == 0
    assert ledger.worth_drafting("fast", 1, 1, cost)
    # 32 sequences: the batch makes 32 / (4.1 * 20 ms) = 390 tokens/s without drafts, so
    # 2 tokens in 1 ms (2000/s) still pay, 2 tokens in 10 ms (200/s) no longer do
    for _ in range(40):
        ledger.record_draft("fast", 2, 0.010)
    assert ledger.worth_drafting("fast", 1, 1, cost)
    assert not ledger.worth_drafting("fast", 1, 32, cost)


def test_reach_is_the_product_of_each_nodes_cell_rate_down_its_path():
    """On random trees with deep paths and many siblings, after random observations: every
    node's reach is its parent's times its (depth, rank) cell's accepted / tried, the cell read
    node by node (`_cell`), as the estimates define it."""
    rng = np.random.default_rng(0)
    estimates = AcceptanceEstimates()
    for _ in range(200):
        drafts = [rng.integers(0, 4, int(rng.integers(1, 12))).tolist()
                  for _ in range(int(rng.integers(1, 9)))]
        tree = DraftTree.from_drafts(0, drafts)
        path = [0]
        while tree.children[path[-1]] and rng.random() < 0.7:
            path.append(list(tree.children[path[-1]].values())[0])
        estimates.observe("m", tree, [tree.tokens[node] for node in path[1:]] + [99])
        expected = [1.0] * len(tree)
        for node in range(1, len(tree)):
            accepted, tried = estimates.counts[estimates._cell("m", tree, node)]
            expected[node] = expected[tree.parents[node]] * accepted / tried
        assert estimates.reach("m", tree) == expected


def test_the_budget_is_the_first_best_ratio_of_expected_tokens_to_cost():
    """On random batches of trees (equal reaches included), with a measured curve and with a
    plain function: the node sets of the first k maximising (decoding + the k best reaches) /
    cost(fixed + k), as numpy's cumulative sums and argmax pick them."""
    rng = np.random.default_rng(1)
    curve = {1: 1.0, 2: 1.03, 4: 1.11, 8: 1.48, 16: 2.15, 64: 6.7}
    for trial in range(300):
        trees = [random_tree(rng) for _ in range(int(rng.integers(1, 5)))]
        reaches = [[1.0] + [float(rng.choice([0.5, 0.25, rng.random()])) for _ in tree.tokens[1:]]
                   for tree in trees]
        fixed, decoding = int(rng.integers(len(trees), 3 * len(trees) + 1)), len(trees)
        cost = CostCurve(curve) if trial % 2 else (lambda rows: 1.0 + 0.1 * rows)
        ranked = sorted((-r[node], node, t) for t, r in enumerate(reaches)
                        for node in range(1, len(r)))
        expected = decoding + np.concatenate(([0.0], np.cumsum([-g for g, _, _ in ranked])))
        costs = np.array([cost(fixed + k) for k in range(len(ranked) + 1)])
        best = int(np.argmax(expected / costs))
        want = [set() for _ in trees]
        for _, node, t in ranked[:best]:
            want[t].add(node)
        assert batch_budget(reaches, fixed, decoding, cost) == want
