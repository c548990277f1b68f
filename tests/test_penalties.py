"""Penalties, a logit bias and min-p follow each tree node's own path: every method's output
is plain decoding's under them (greedy, against a loop written apart), and draws what plain
sampling draws for a seed."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import TINY_VOCAB
from drafters_for_tests import OracleDrafter, RandomTreeDrafter
from test_batch import run_batched
from test_lossless_greedy import varied_prompts

from dresd.decoding import SamplingConfig
from dresd.decoding.batch import Request
from dresd.decoding.processing import Penalties
from dresd.drafters import NoDrafter, PromptLookupDrafter, SuffixDrafter

SETTINGS = [Penalties(presence=1.5), Penalties(frequency=0.7),
            Penalties(repetition=1.8), Penalties(logit_bias={3: 4.0, 7: -100.0, 11: 2.5}),
            Penalties(presence=-0.5, frequency=0.3, repetition=1.2, logit_bias={5: 1.0})]
MAX_NEW = 24


@torch.inference_mode()
def penalized_plain(model, prompt: list[int], penalties: Penalties) -> list[int]:
    """The reference, one whole forward per token, the rules as OpenAI and vLLM state them."""
    ids, out = list(prompt), []
    for _ in range(MAX_NEW):
        row = model(torch.tensor([ids])).logits[0, -1].float().clone()
        for token, bias in penalties.logit_bias.items():
            row[token] += bias
        for token in set(ids):  # prompt and output
            value = row[token]
            row[token] = value / penalties.repetition if value > 0 else (
                value * penalties.repetition)
        for token in set(out):
            row[token] -= penalties.frequency * out.count(token) + penalties.presence
        token = int(row.argmax())
        out.append(token)
        ids.append(token)
    return out


def drafters(index: int, prompt: list[int], reference: list[int]):
    return [NoDrafter(), PromptLookupDrafter(num_drafts=3), SuffixDrafter(),
            RandomTreeDrafter(TINY_VOCAB, seed=index),
            OracleDrafter(len(prompt), reference, draft_len=8, corrupt=0.4, seed=index,
                          vocab_size=TINY_VOCAB)]


@pytest.mark.parametrize("penalties", SETTINGS, ids=range(len(SETTINGS)))
def test_penalized_greedy_is_penalized_plain_decoding(tiny, penalties):
    requests, references = [], []
    for index, prompt in enumerate(varied_prompts(4, seed=21)):
        reference = penalized_plain(tiny, prompt, penalties)
        for drafter in drafters(index, prompt, reference):
            requests.append(Request(prompt=prompt, drafter=drafter, max_new_tokens=MAX_NEW,
                                    penalties=penalties))
            references.append(reference)
    arrivals = np.random.default_rng(2).integers(0, 5, len(requests)).tolist()
    results = run_batched(tiny, requests, arrivals, max_batch_size=6)
    for request, result, reference in zip(requests, results, references, strict=True):
        assert result.token_ids == reference, type(request.drafter).__name__


def test_penalized_sampling_draws_what_plain_sampling_draws(tiny):
    prompt = varied_prompts(3, seed=8)[2]
    for seed in range(5):
        sampling = SamplingConfig(temperature=0.9, top_p=0.95, seed=seed, min_p=0.05)
        requests = [Request(prompt=prompt, drafter=drafter, max_new_tokens=MAX_NEW,
                            sampling=sampling, penalties=SETTINGS[-1])
                    for drafter in drafters(seed, prompt, [])[:4]]
        results = run_batched(tiny, requests, [0, 0, 1, 2], max_batch_size=4)
        assert all(result.token_ids == results[0].token_ids for result in results), seed


def test_min_p_drops_the_unlikely():
    from dresd.decoding.sampling import process_logits
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = process_logits(logits, SamplingConfig(temperature=1.0, min_p=0.2)).isfinite()
    assert kept.tolist() == [True, True, True, False]  # 0.05 < 0.2 * 0.5
