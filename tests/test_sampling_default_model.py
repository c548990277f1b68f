"""Sampling stays exact on the real default model with real drafts (PLD, REST, DReSD).

Method: the default model in float32, temperature 0.7 and top-p 0.9, one raw-text prompt (a
list of colour words) whose next token is spread over six candidates, five of them words the
prompt already holds, so that PLD drafts after most first tokens; REST and DReSD draft from a
store of other random colour lists. Each run draws
three new tokens with its own seed: x1 from the prefill, x2 at the root of the first verified
tree (whose drafts are accepted or rejected), x3 beyond. The empirical distribution of the first
two tokens (x1, x2) is compared with the exact one, p(x1) p(x2 | x1) from plain forwards over
every x1 in the nucleus, by a chi-square goodness-of-fit test at level ALPHA = 1e-3 (cells
expected below 5 pooled). Plain sampling (`ar`, transformers' `generate`) runs through the
same test as a control. Power: the same counts must be rejected (p < ALPHA) against the exact
distribution at temperature 0.91 (x1.3), a sampler only slightly off.

The CI version runs PLD on SEEDS_CI seeds, 20 runs at a time in the batched loop, every draft
verified as drafted (a seeded run draws the same tokens alone or in a batch: tests/test_batch.py;
the counts and accepted drafts are those of the runs one after the other); the full one
(`-m slow`, or DRESD_SAMPLING_SEEDS=N) runs every method on more seeds, one run after the
other, and prints what it measured (RELIABILITY.md records it).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from dresd.corpus import CorpusSpec
from dresd.datastore.dense import DenseBuildConfig, build_dense
from dresd.decoding import SamplingConfig
from dresd.decoding.sampling import next_token_probs
from dresd.prompts import encode_prompt
from dresd.runner import AR, GenerationSettings, MethodRunner

PROMPT = "red blue green red blue green yellow red green blue yellow green red"
COLOURS = ["red", "blue", "green", "yellow"]
CONFIG = SamplingConfig(temperature=0.7, top_p=0.9)
WRONG = SamplingConfig(temperature=0.7 * 1.3, top_p=0.9)  # for the power check
ALPHA = 1e-3
SEEDS_CI = 100
SEEDS_FULL = int(os.environ.get("DRESD_SAMPLING_SEEDS", "1500"))


@pytest.fixture(scope="module")
def prompt_ids(default_target) -> list[int]:
    return encode_prompt(default_target.tokenizer, PROMPT, chat_template=False)


@torch.inference_mode()
def exact_first_two(target, prompt_ids: list[int], config: SamplingConfig) -> dict:
    """{(x1, x2): p(x1) p(x2 | x1)} over the nucleus, from plain full forwards."""
    model = target.model
    p1 = next_token_probs(model(torch.tensor([prompt_ids])).logits[0, -1:], config)[0]
    firsts = p1.nonzero().flatten().tolist()
    rows = torch.tensor([prompt_ids + [x1] for x1 in firsts])
    p2 = next_token_probs(model(rows).logits[:, -1], config)
    joint = {}
    for row, x1 in enumerate(firsts):
        for x2 in p2[row].nonzero().flatten().tolist():
            joint[(x1, x2)] = float(p1[x1]) * float(p2[row, x2])
    return joint


def chi_square_p(counts: dict, exact: dict) -> float:
    """Goodness of fit of the observed pairs to `exact`; cells expected below 5 are pooled.
    A pair the exact distribution gives probability 0 fails outright (p = 0)."""
    if any(pair not in exact for pair in counts):
        return 0.0
    total = sum(counts.values())
    cells = sorted(exact)
    observed = np.array([counts.get(c, 0) for c in cells], dtype=np.float64)
    expected = np.array([exact[c] for c in cells]) / sum(exact.values()) * total
    small = expected < 5
    observed = np.append(observed[~small], observed[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    keep = expected > 0
    return float(chisquare(observed[keep], expected[keep]).pvalue)


def sample_pairs(runner: MethodRunner, prompt_ids: list[int], seeds: int,
                 batch: int = 1) -> tuple[dict, int]:
    """Counts of (x1, x2) over `seeds` runs of three new tokens; and draft tokens accepted.
    `batch` 1: one run after the other (single-stream). More: the runs in one batched loop,
    `batch` at a time, each with its own seed and its own fork of the drafter; a seeded run
    draws the same tokens in any batch (tests/test_batch.py), so the counts are the same."""
    results = []
    engine = runner.batch(batch) if batch > 1 else None
    for seed in range(seeds):
        sampling = SamplingConfig(CONFIG.temperature, CONFIG.top_k, CONFIG.top_p, seed=seed)
        runner.settings = GenerationSettings(max_new_tokens=3, sampling=sampling)
        if engine is None:
            results.append(runner.generate(prompt_ids))
        else:
            results.append(engine.add(runner.request(prompt_ids, runner.drafter.fork())))
    if engine is not None:
        engine.run()
        results = [state.result for state in results]
    counts: dict = {}
    accepted = 0
    for result in results:
        pair = tuple(result.token_ids[:2])
        counts[pair] = counts.get(pair, 0) + 1
        accepted += sum(step.num_accepted for step in result.steps)
    return counts, accepted


@pytest.fixture(scope="module")
def colour_store(tmp_path_factory, default_target):
    """A dense + sparse store of 24 random lists of colour words."""
    folder = tmp_path_factory.mktemp("sampling-store")
    rng = np.random.default_rng(0)
    for i in range(24):
        (folder / f"list{i}.txt").write_text(" ".join(rng.choice(COLOURS, size=40)))
    return build_dense(default_target, CorpusSpec([str(folder)], tree_glob="*.txt"),
                       folder / "store", DenseBuildConfig(pca_dim=16, index="exact"),
                       progress=False, with_sparse=True)


def check_method(default_target, prompt_ids, method: str, seeds: int, store=None,
                 batch: int = 1) -> dict:
    options = {"datastore": str(store)} if store else {}
    if batch > 1:
        # Every draft verified as drafted, as a run alone verifies PLD's here: the step budget
        # prices a step by all its rows, and at 20 rows in float32 it finds no draft worth
        # verifying (then nothing would be tested).
        options["budget"] = False
    runner = MethodRunner(default_target, method, GenerationSettings(), **options)
    counts, accepted = sample_pairs(runner, prompt_ids, seeds, batch)
    exact = exact_first_two(default_target, prompt_ids, CONFIG)
    figures = {"method": method, "seeds": seeds, "batch": batch,
               "accepted_draft_tokens": accepted,
               "distinct_pairs": len(counts), "p_value": chi_square_p(counts, exact),
               "p_value_vs_temperature_x1.3":
                   chi_square_p(counts, exact_first_two(default_target, prompt_ids, WRONG))}
    print(f"\nsampling exactness: {json.dumps(figures)}")
    return figures


def test_pld_sampling_matches_the_model_on_its_first_two_tokens(default_target, prompt_ids):
    # The runs 20 at a time in one batched loop: a third of the time of one after the other
    # here, the same counts and accepted drafts (a run's seed decides its tokens in any batch).
    figures = check_method(default_target, prompt_ids, "pld", SEEDS_CI, batch=20)
    assert figures["accepted_draft_tokens"] > 0, "no draft was accepted: nothing was tested"
    assert figures["p_value"] > ALPHA
    assert figures["p_value_vs_temperature_x1.3"] < ALPHA


@pytest.mark.slow
@pytest.mark.parametrize("method", [AR, "pld", "rest", "dresd"])
def test_sampling_matches_the_model_full(default_target, prompt_ids, colour_store, method):
    store = colour_store if method in ("rest", "dresd") else None
    figures = check_method(default_target, prompt_ids, method, SEEDS_FULL, store)
    if method != AR:
        assert figures["accepted_draft_tokens"] > SEEDS_FULL // 10
    assert figures["p_value"] > ALPHA
    assert figures["p_value_vs_temperature_x1.3"] < ALPHA  # the test has the power to notice
