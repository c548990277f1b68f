"""The hybrid drafter's parts: the acceptance table, reach probabilities, the budget choice,
and learning from what the target emitted. (Losslessness: test_lossless_greedy, test_dense.)"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from test_sampling import (  # noqa: F401 - small_vocab_model is a fixture used below
    ALPHA,
    PROMPT,
    RUNS,
    VOCAB,
    exact_distributions,
    goodness_of_fit,
    small_vocab_model,
)

from dresd.bench.replay import Reference, drafter_proposer, replay, summarise
from dresd.calibrate import cost_at, cost_table
from dresd.decoding import SamplingConfig, speculative_generate
from dresd.decoding.budget import CostCurve
from dresd.decoding.drafter import Candidate, DraftContext, Drafter
from dresd.decoding.tree import DraftTree
from dresd.drafters.dense import agreeing_prefixes
from dresd.drafters.hybrid import (
    AcceptanceTable,
    CandidateTree,
    Cell,
    HybridDrafter,
    LastStep,
    SourceLedger,
    best_budget,
)
from dresd.kernels import drafting


def test_cost_curve_interpolates_and_extrapolates():
    curve = {1: 1.0, 4: 1.3, 8: 2.1}
    assert cost_at(curve, 4) == 1.3
    assert cost_at(curve, 2) == pytest.approx(1.1)
    assert cost_at(curve, 6) == pytest.approx(1.7)
    assert cost_at(curve, 12) == pytest.approx(2.9)  # the last slope, 0.2 per token
    remembered = CostCurve(curve)  # each size worked out once, asked in any order
    for rows in [5, 0, 12, 3, 40, 1, 12, 7]:
        assert remembered(rows) == cost_at(curve, rows)


def test_table_moves_from_its_prior_to_the_observed_rate():
    table = AcceptanceTable(prior_strength=4.0)
    cell = Cell(("pld",), 0, 1, True, -1)
    prior = table.probability(cell)
    # Before any observation: agreement between sources and neighbours raises the estimate,
    # and a sibling's second choice is less likely than its first; so does the share of a
    # suffix node's parent occurrences that continue with it.
    assert table.probability(Cell(("dresd", "pld"), 3, 1, True, -1)) > prior
    assert table.probability(Cell(("pld",), 0, 1, False, -1)) < prior
    shares = [table.probability(Cell(("suffix",), 0, 1, True, bucket)) for bucket in (0, 1, 2)]
    assert shares == sorted(set(shares))
    for accepted in [True] * 90 + [False] * 10:
        table.observe(cell, accepted)
    assert table.probability(cell) == pytest.approx((90 + 4 * prior) / 104)


def test_a_fitted_prior_replaces_the_guess(tmp_path):
    fitted = AcceptanceTable()
    often, rare = Cell(("suffix",), 0, 2, True, 2), Cell(("rest",), 0, 1, False, -1)
    for accepted in [True] * 27 + [False] * 3:
        fitted.observe(often, accepted)
    fitted.observe(rare, True)  # tried once: too few to fit, left out
    fitted.save(tmp_path / "prior.json")
    drafter = HybridDrafter(prior=str(tmp_path / "prior.json"), cost={1: 1.0})
    assert drafter.table.probability(often) == pytest.approx(0.9)
    assert drafter.table.probability(rare) == AcceptanceTable().probability(rare)


def test_dense_drafts_are_cut_where_no_other_neighbour_follows():
    drafts = [list(d) for d in ([9, 9, 9], [1, 2, 3, 4], [1, 2, 5, 6], [1, 2, 3, 4],
                                    [7, 8, 9])]
    kept = agreeing_prefixes(drafts)
    assert kept == {(9, 9, 9): 1,  # the nearest neighbour's draft: whole
                    (1, 2, 3, 4): 2,  # two neighbours agree: whole
                    (1, 2, 5): 1,  # shares [1, 2] with another: one token past it
                    (7,): 1}  # shares nothing: its first token only
    assert sum(kept.values()) == len(drafts)  # every neighbour still counts once


def test_reach_probabilities_fall_with_depth_and_siblings_share_one_token():
    tree = CandidateTree()
    for draft in ([1, 2, 3], [1, 4], [5], [6], [7]):
        tree.add(Candidate(draft), "pld")
    table = AcceptanceTable()
    nodes = range(1, len(tree.tokens))
    for cell in {tree.cell(v, v == tree.first_child(tree.parents[v])) for v in nodes}:
        for _ in range(50):
            table.observe(cell, True)  # p near 1: four siblings at the root must share 1
    reach = tree.reach_probabilities(table)
    root_children = list(tree.children[0].values())
    assert sum(reach[v] for v in root_children) <= 1.0 + 1e-9
    for v in range(1, len(tree.tokens)):
        assert reach[v] <= reach[tree.parents[v]]


def test_suffix_count_shares_are_a_feature_of_the_nodes_suffix_proposes():
    tree = CandidateTree()
    tree.add(Candidate([1, 2, 3], shares=[0.9, 0.5, 0.1]), "suffix")
    tree.add(Candidate([1, 4]), "pld")
    one = tree.children[0][1]
    two, four = tree.children[one][2], tree.children[one][4]
    three = tree.children[two][3]
    assert [tree.cell(v, True).share for v in (one, two, three, four)] == [2, 1, 0, -1]


@pytest.mark.parametrize(("reach", "curve", "expected"), [
    ([0.9, 0.8, 0.7, 0.1], {1: 1.0, 64: 1.0}, 4),  # free verification: keep every candidate
    ([0.9, 0.8, 0.7, 0.1], {1: 1.0, 2: 2.0, 64: 64.0}, 0),  # each token a step: never pays
    # cost 1, 1.1, 1.2, 1.6, 2.0 for 1..5 tokens: ratios 1, 1.73, 2.25, 1.56, 1.3 -> keep 2
    ([0.9, 0.8, 0.2, 0.1], {1: 1.0, 2: 1.1, 3: 1.2, 4: 1.6, 5: 2.0}, 2),
    ([], {1: 1.0, 64: 1.0}, 0),
])
def test_budget_maximises_expected_tokens_per_cost(reach, curve, expected):
    assert best_budget(reach, cost_table(curve, len(reach) + 1)) == expected


class FixedBudget(HybridDrafter):
    """hybrid with its budget fixed at n nodes: the same candidates and estimates."""

    def __init__(self, n: int, **options) -> None:
        super().__init__(**options)
        self.n = n

    def _budget(self) -> tuple[np.ndarray, int]:
        # Free rows: the n most probable nodes (fewer where the tree holds fewer).
        return np.ones(self.n + 2), self.n


def recorded(name: str) -> list[Reference]:
    """AR outputs recorded by a bench run (bf16, default model): tests/data/recorded_*.jsonl."""
    rows = (Path(__file__).parent / "data" / f"recorded_{name}.jsonl").read_text().splitlines()
    return [Reference(r["prompt_ids"] + r["output_ids"], len(r["prompt_ids"]), None)
            for r in map(json.loads, rows)]


def estimated_speedup(drafter: HybridDrafter, refs: list[Reference]) -> float:
    """Tokens per unit of verify cost, replayed (drafting time left out)."""
    steps, _ = replay(refs, drafter_proposer(drafter, refs), drafter)
    tokens = sum(len(r.ids) - r.prompt_len for r in refs)
    return summarise(steps, 0.0, tokens, drafter.cost, 1.0)["est_speedup"]


CURVES = {  # verify cost by tree tokens, in decode steps
    "nearly flat (a GPU)": {1: 1.0, 64: 1.3},
    "this CPU, bf16": {1: 1.0, 4: 0.98, 8: 1.24, 16: 1.61, 32: 2.56, 64: 4.69},
    "steep (fp32 on a small CPU)": {1: 1.0, 2: 1.3, 4: 1.9, 8: 3.1, 16: 5.5, 64: 20.0},
}


@pytest.mark.parametrize("curve_name", CURVES)
@pytest.mark.parametrize("recording", ["humaneval", "mt_bench"])
def test_chosen_budget_beats_every_fixed_budget_on_recorded_runs(recording, curve_name):
    """On recorded AR outputs, hybrid's per-step budget is at least as good as the best fixed
    budget over the same candidates, whatever the cost curve: a wrong budget fails here."""
    refs, curve = recorded(recording), CURVES[curve_name]
    chosen = estimated_speedup(HybridDrafter(cost=curve), refs)
    fixed = {n: estimated_speedup(FixedBudget(n, cost=curve), refs) for n in (1, 2, 4, 8, 16, 32)}
    assert chosen >= 0.97 * max(fixed.values()), (chosen, fixed)
    assert chosen >= 0.99  # never slower than plain decoding, by the curve


def context(tokens: list[int], remaining: int = 50) -> DraftContext:
    return DraftContext(np.array(tokens, dtype=np.int64), torch.zeros(4), remaining)


def test_hybrid_learns_from_the_emitted_tokens_and_stops_drafting_when_it_pays_not():
    # The prompt repeats "1 2 3 4 5" so that PLD (and suffix) propose "3 4 5 ..." after "1 2"; each
    # step the model emits a token never seen before, then "1 2" again: every candidate fails.
    motif = [1, 2, 3, 4, 5]
    drafter = HybridDrafter(cost={1: 1.0, 2: 1.15, 4: 1.45, 8: 2.1, 16: 3.4})
    tokens = motif * 4 + [1, 2]
    drafts = drafter.propose(context(tokens))
    assert drafts and drafts[0][0] == 3  # the prior finds PLD's match worth a try
    for fresh in range(100, 130):
        tokens = tokens + [fresh, 1, 2]
        drafts = drafter.propose(context(tokens))
    depth_one = [c for cell, c in drafter.table.counts.items() if cell[2] == 1]
    assert sum(tried for _, tried in depth_one) >= 30
    assert sum(accepted for accepted, _ in depth_one) == 0
    assert drafts == []  # nothing is worth verifying any more: plain decoding


def test_hybrid_needs_a_cost_curve():
    with pytest.raises(ValueError, match="verify-cost curve"):
        HybridDrafter().propose(context([1, 2, 3]))


def test_hybrid_sampling_matches_model_distribution(small_vocab_model):  # noqa: F811
    """Sampling stays exact with hybrid's drafts, although they adapt to earlier samples: one
    drafter across all runs, so its table and suffix tries learn from every output so far."""
    model = small_vocab_model
    config = SamplingConfig(temperature=0.7)
    drafter = HybridDrafter(cost={1: 1.0, 64: 1.0})
    next_counts, pair_counts, accepted = np.zeros(VOCAB), np.zeros((VOCAB, VOCAB)), 0
    for run in range(RUNS):
        result = speculative_generate(model, drafter, torch.tensor([PROMPT]), max_new_tokens=3,
                                      sampling=SamplingConfig(0.7, seed=run))
        _, x2, x3 = result.token_ids
        next_counts[x2] += 1
        pair_counts[x2, x3] += 1
        accepted += sum(step.num_accepted for step in result.steps)
    assert accepted > RUNS // 10, "hybrid's drafts should often be accepted, or nothing is tested"
    next_probs, pair_probs = exact_distributions(model, config)
    assert goodness_of_fit(next_counts, next_probs) > ALPHA
    assert goodness_of_fit(pair_counts, pair_probs) > ALPHA


def test_calibrate_measures_once_and_caches(tmp_path, monkeypatch, tiny):
    from dresd.calibrate import cached_step_seconds, curve_path, load_or_measure, random_tree
    from dresd.models.target import Target

    rng = np.random.default_rng(0)
    for size in (1, 2, 5, 17):
        assert len(random_tree(size, 50, rng)) == size
    monkeypatch.setenv("DRESD_CACHE", str(tmp_path))
    target = Target(model=tiny, tokenizer=None, name="tiny")
    curve = load_or_measure(target, quiet=True)
    assert curve[1] == 1.0 and set(curve) >= {1, 2, 4, 8, 16, 32, 64}
    assert all(cost > 0 for cost in curve.values())
    ordered = [curve[size] for size in sorted(curve)]
    assert ordered == sorted(ordered), "a larger tree never costs less"
    assert curve_path(target).is_file() and str(tmp_path) in str(curve_path(target))
    assert 0 < cached_step_seconds(target) < 1  # the one-token step, for hybrid's ledger
    cached = json.loads(curve_path(target).read_text())
    cached["cost"]["2"] = 9.0
    curve_path(target).write_text(json.dumps(cached))
    assert load_or_measure(target, quiet=True)[2] == 9.0  # read back, not measured again
    del cached["version"]  # a curve measured the old way is measured again
    curve_path(target).write_text(json.dumps(cached))
    assert load_or_measure(target, quiet=True)[2] != 9.0


def test_replay_steps_do_not_depend_on_evicting_the_caches():
    """`evict_bytes` only changes what drafting costs, never which steps it takes."""
    refs = recorded("humaneval")[:2]
    warm, cold = (replay(refs, drafter_proposer(drafter, refs), drafter, evict_bytes=evict)[0]
                  for drafter, evict in ((HybridDrafter(cost=CURVES["this CPU, bf16"]), 0),
                                         (HybridDrafter(cost=CURVES["this CPU, bf16"]), 1 << 20)))
    assert warm == cold and len(warm) > 10


def test_ledger_leaves_out_the_one_source_whose_share_of_the_time_exceeds_its_share_of_tokens():
    ledger = SourceLedger(warmup=4, explore_every=5)
    # A 10 ms step emitting 3 tokens. pld: 2 of them lost without it, in 10% of the time;
    # suffix: 0.5 in 25%; rest: 0.4 in 10%; dresd: 0.3 in 20%. Both suffix and dresd lose
    # 8/60 and 10/60 of the tokens.
    seconds = {"pld": 0.001, "suffix": 0.0025, "rest": 0.001, "dresd": 0.002}
    for step in range(8):
        if step == 3:
            assert ledger.to_skip(1) is None  # still warming up
        ledger.record(seconds, Counter(pld=2, suffix=step % 2, rest=0.4, dresd=0.3), 3, 0.010)
    assert ledger.to_skip(1) == "suffix"  # the largest excess of time share over token share
    assert ledger.to_skip(5) is None  # every explore_every-th step consults every source
    for _ in range(100):  # suffix's content starts to pay: dresd is now the one left out
        ledger.record(seconds, Counter(pld=2, suffix=2, rest=0.4, dresd=0.3), 3, 0.010)
    assert ledger.to_skip(1) == "dresd"
    for _ in range(100):  # every source pays
        ledger.record(seconds, Counter(pld=2, suffix=2, rest=0.4, dresd=1), 3, 0.010)
    assert ledger.to_skip(1) is None


def test_a_source_is_charged_every_accepted_token_from_where_it_alone_proposed():
    """Without the source that alone proposed accepted node d, the path breaks at d: every
    accepted token from d on is lost, whoever proposed them."""
    drafter = HybridDrafter(cost={1: 1.0, 64: 1.0}, step_seconds=0.01)
    tree = CandidateTree()
    tree.add(Candidate([5, 6, 7, 8]), "pld")
    tree.add(Candidate([5, 6]), "suffix")  # 5, 6: both; 7, 8: pld alone
    tree.add(Candidate([5, 9]), "suffix")  # 9: suffix alone, not accepted
    records = []
    drafter.ledger.record = lambda *args: records.append(args)
    prompt = np.arange(20, 40)
    step = LastStep(tree, len(prompt), prompt[-16:].tobytes(), prompt.dtype,
                    {"pld": 0.001, "suffix": 0.002}, first=False)
    emitted = [5, 6, 7, 3]  # 3 accepted, then the bonus 3
    drafter._record(step, tree.learn(emitted, drafter.table), emitted)
    (seconds, lost, emitted, step_seconds), = records
    assert lost == Counter(pld=1) and emitted == 4 and step_seconds > 0.003


class ManualClock:
    """Seconds that pass only when a test advances them: a verdict that weighs time must not
    depend on how loaded the machine running the test is."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class SlowGuesser(Drafter):
    """A source that takes 10 ms on `clock` and proposes a token the model never emits (the
    other sources take no time on it)."""

    def __init__(self, clock: ManualClock) -> None:
        self.clock = clock
        self.calls = 0

    def propose(self, context: DraftContext) -> list[list[int]]:
        self.calls += 1
        self.clock.now += 0.010
        return [[10**6]]


@pytest.mark.parametrize(("step_seconds", "skip_sources"), [(None, True), (0.02, False),
                                                           (0.02, True)])
def test_hybrid_consults_a_source_that_does_not_pay_only_to_check_it(step_seconds, skip_sources):
    """With a step's seconds known, a slow source that never finds an accepted token is left
    out of most steps (consulted during warm-up and every explore_every-th step); unknown, or
    with skip_sources off, every source is consulted at every step."""
    refs = recorded("humaneval")[:2]
    drafter = HybridDrafter(cost=CURVES["this CPU, bf16"], step_seconds=step_seconds,
                            skip_sources=skip_sources)
    drafter.clock = ManualClock()
    drafter.sources["slow"] = guesser = SlowGuesser(drafter.clock)
    steps, _ = replay(refs, drafter_proposer(drafter, refs), drafter)
    assert len(steps) > 60 and sum(accepted for _, accepted in steps) > len(steps) // 2
    if step_seconds is None or not skip_sources:
        assert guesser.calls == len(steps)
    else:
        explore = drafter.ledger.explore_every
        assert guesser.calls <= drafter.ledger.warmup + len(steps) // explore + 2
        assert drafter.ledger.lost["slow"] == 0


def test_nodes_take_their_features_from_the_candidates_whatever_the_source_is_called():
    """hybrid composes its sources without knowing them: a node's neighbours and count shares
    are what its candidates carry, its source's name only one more feature."""
    tree = CandidateTree()
    tree.add(Candidate([1, 2, 3], neighbours=3), "a retriever")
    tree.add(Candidate([1, 2], neighbours=2, shares=[0.5, 0.9]), "another")
    tree.add(Candidate([1, 4]), "pld")
    one = tree.children[0][1]
    two = tree.children[one][2]
    assert (tree.support[one], tree.votes[one]) == (5, 6)  # a neighbour is a vote; pld one
    assert (tree.support[two], tree.votes[two]) == (5, 5)
    assert tree.cell(two, True) == Cell(("a retriever", "another"), 3, 2, True, 2)
    assert tree.cell(tree.children[one][4], False) == Cell(("pld",), 0, 2, False, -1)


class Retriever(Drafter):
    """A source hybrid has never heard of, whose drafts come with neighbour counts."""

    def candidates(self, context: DraftContext) -> list[Candidate]:
        return [Candidate([7, 8], neighbours=4), Candidate([7, 9], neighbours=1)]


def test_hybrid_scores_a_new_source_by_the_features_it_gives(monkeypatch):
    monkeypatch.setattr(drafting, "kernel", lambda: None)  # the Python tree, to look inside
    drafter = HybridDrafter(cost={1: 1.0, 64: 1.0})
    drafter.sources = {"retriever": Retriever()}
    assert drafter.propose(context([1, 2, 3])) == [[7, 8], [7, 9]]
    tree = drafter.last.tree
    seven = tree.children[0][7]
    assert tree.support[seven] == 5 and tree.cell(seven, True).support == 3
    assert tree.first_child(seven) == tree.children[seven][8]  # four neighbours to one


class RandomSource(Drafter):
    """Random candidates over a small vocabulary (shared prefixes, repeats), with random
    neighbour counts or count shares: what any source may give hybrid."""

    def __init__(self, seed: int, neighbours: bool, shares: bool) -> None:
        self.rng = np.random.default_rng(seed)
        self.neighbours, self.shares = neighbours, shares

    def candidates(self, context: DraftContext) -> list[Candidate]:
        rng, found = self.rng, []
        for _ in range(int(rng.integers(0, 6))):
            tokens = rng.integers(0, 4, int(rng.integers(1, 12))).tolist()
            found.append(Candidate(
                tokens, neighbours=int(rng.integers(0, 6)) if self.neighbours else 0,
                shares=rng.random(len(tokens)).tolist() if self.shares else None))
        return found


def test_the_cut_lists_each_nodes_children_most_probable_first():
    """On 300 random trees and tables: the drafts hold exactly the n most probable nodes, and
    merged as the engine merges them (`DraftTree.from_drafts`), every node's children come in
    the order of their reach (then node), so a node's rank among its siblings, which the batch
    budget prices under load, is its rank by reach. A cut that listed leaves by their own reach
    fails this: a probable node whose children are less probable than a sibling leaf."""
    rng = np.random.default_rng(11)
    checked = 0
    for _ in range(300):
        tree = CandidateTree()
        for _ in range(int(rng.integers(1, 12))):
            tree.add(Candidate(rng.integers(0, 4, int(rng.integers(1, 6))).tolist()),
                     str(rng.choice(["pld", "suffix", "rest"])))
        table = AcceptanceTable()
        for v in range(1, len(tree.tokens)):
            cell = tree.cell(v, v == tree.first_child(tree.parents[v]))
            for _ in range(int(rng.integers(0, 8))):
                table.observe(cell, bool(rng.random() < 0.6))
        costs = cost_table({1: 1.0, 2: 1.02, 8: 1.1, 32: 2.0}, 64)
        drafts, n = tree.cut(table, costs, max_nodes=int(rng.integers(1, 40)))
        reach = tree.reach_probabilities(table)
        ranked = sorted(range(1, len(tree.tokens)), key=lambda v: (-reach[v], v))
        merged = DraftTree.from_drafts(-1, drafts)
        ids = {0: 0}  # merged node -> candidate tree node, by their tokens
        for node in range(1, len(merged.tokens)):
            ids[node] = tree.children[ids[merged.parents[node]]][merged.tokens[node]]
        assert sorted(ids.values())[1:] == sorted(ranked[:n])
        for node, children in enumerate(merged.children):
            order = [ids[child] for child in children.values()]  # insertion: the drafts' order
            assert order == sorted(order, key=lambda v: (-reach[v], v)), (node, order)
            checked += len(order) > 1
    assert checked > 50


@pytest.mark.skipif(drafting.kernel() is None, reason="no C compiler: the Python tree drafts")
@pytest.mark.parametrize("seed", range(3))
def test_the_kernels_tree_drafts_and_learns_as_the_python_tree(seed, monkeypatch):
    """Merge, reach estimates, cut and learning in C give the Python tree's drafts at every
    step, and the same acceptance counts and ledger after many steps."""
    rng = np.random.default_rng(seed)
    kernels = (drafting.kernel, lambda: None)  # compiled, then none: the Python tree
    drafters = []
    for kernel in kernels:
        monkeypatch.setattr(drafting, "kernel", kernel)
        drafter = HybridDrafter(cost={1: 1.0, 2: 1.1, 8: 1.6, 32: 3.0}, step_seconds=0.01,
                                max_tree_nodes=int(rng.integers(4, 40)))
        drafter.clock = ManualClock()
        drafter.sources = {name: RandomSource(seed * 10 + i, "n" in name, "s" in name)
                           for i, name in enumerate(["pld", "a retriever (n)", "counts (s)",
                                                     "both (n, s)"])}
        drafters.append(drafter)
    tokens, compared = [7, 7, 7], 0
    for _ in range(300):
        drafted, remaining = [], int(rng.integers(1, 12))
        for drafter, kernel in zip(drafters, kernels, strict=True):
            monkeypatch.setattr(drafting, "kernel", kernel)
            drafter.clock.now += 0.001
            drafted.append(drafter.propose(context(tokens, remaining)))
        assert drafted[0] == drafted[1]
        compared += sum(map(len, drafted[0]))
        # The step emits the first draft's tokens up to a random point, then a bonus token.
        first = drafted[0][0] if drafted[0] else []
        tokens = tokens + first[: int(rng.integers(0, len(first) + 1))] + [int(rng.integers(4))]
    c, python = (d.table for d in drafters)
    assert isinstance(drafters[0].last.tree, drafting.HybridTree)
    assert isinstance(drafters[1].last.tree, CandidateTree)
    assert c.counts == python.counts and sum(t for _, t in c.counts.values()) > 1000
    assert vars(drafters[0].ledger) == vars(drafters[1].ledger)
    assert compared > 500


def test_under_load_a_source_pays_by_its_share_of_the_batch():
    """A source that pays alone (a third of the tokens for a tenth of the time) does not beside
    15 other sequences: its seconds hold up the batch's step, and its tokens are one
    sequence's. It is then left out, and probed B times more rarely."""
    alone, batched = SourceLedger(warmup=4), SourceLedger(warmup=4)
    for _ in range(50):
        alone.record({"slow": 0.001}, Counter(slow=1), 3, 0.010)
        # 16 sequences: 48 tokens in a step of 0.010 + 16 x 0.001 s of drafting
        batched.record({"slow": 0.001}, Counter(slow=1), 48, 0.026)
    assert alone.to_skip(1) is None
    assert batched.to_skip(1, batch_size=16) == "slow"
    assert batched.to_skip(alone.explore_every, batch_size=16) == "slow"  # no probe yet
    assert batched.to_skip(alone.explore_every * 16, batch_size=16) is None  # a probe


def test_hybrid_takes_the_batch_from_the_context():
    """The batch's previous step (tokens, seconds) reaches the ledger as E and T."""
    drafter = HybridDrafter(cost={1: 1.0, 64: 1.0}, step_seconds=0.01)
    records = []
    drafter.ledger.record = lambda *args: records.append(args)
    prompt = list(range(20, 40))
    batch = dict(batch_size=16, batch_tokens=40, batch_seconds=0.03)
    drafter.propose(DraftContext(np.array(prompt + [1, 2, 3, 1, 2]), torch.zeros(4), 20, **batch))
    drafter.propose(DraftContext(np.array(prompt + [1, 2, 3, 1, 2, 3, 9]), torch.zeros(4), 20,
                                 **batch))
    drafter.propose(DraftContext(np.array(prompt + [1, 2, 3, 1, 2, 3, 9, 4]), torch.zeros(4), 20,
                                 **batch))
    assert [(tokens, seconds) for _, _, tokens, seconds in records] == [(40, 0.03)]


def test_step_buffers_never_write_the_tree_the_last_step_reads():
    """Hybrid's kept buffers (`drafting.StepBuffers`): a new tree never takes the block of the
    tree it learns from, whichever came before (a tree of its own, or one made elsewhere), and
    grows when a step needs more room."""
    buffers = drafting.StepBuffers()
    last, elsewhere = None, drafting.HybridTree._room(8, 1, 4, 4)[0]
    rng = np.random.default_rng(0)
    for step in range(50):
        before = last if step % 7 else elsewhere
        need = int(rng.integers(2, 300))
        tree = buffers.tree(need, before)
        assert before is None or tree.block is not before.block
        assert tree.capacity == tree.block.shape[1] >= need
        assert tree.address == drafting.address(tree.block)
        last = tree
    assert len({id(block) for block, _ in buffers.blocks}) == 2
