"""One request never harms another: a failure in one sequence's own part of a shared step (its
drafting, sampling, stop strings, streaming callback) ends that sequence with its error, and
every other sequence in the batch generates exactly what it generates alone."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import TINY_VOCAB
from drafters_for_tests import RandomTreeDrafter
from test_batch import mixed_drafter, run_batched
from test_lossless_greedy import reference_greedy, varied_prompts

from dresd.decoding import SamplingConfig
from dresd.decoding.batch import Request
from dresd.decoding.drafter import Draft, DraftContext, Drafter
from dresd.drafters import NoDrafter


class Fault(Exception):
    """What an injected failure raises."""


class Countdown:
    """Raises `Fault` on its `after`-th call and every one after."""

    def __init__(self, after: int) -> None:
        self.left = after

    def tick(self) -> None:
        self.left -= 1
        if self.left <= 0:
            raise Fault("injected")


class FailingDrafter(Drafter):
    name = "failing"

    def __init__(self, after: int) -> None:
        self.countdown = Countdown(after)

    def propose(self, context: DraftContext) -> list[Draft]:
        self.countdown.tick()
        return []


class FailingTokenizer:
    """Decodes stop strings' windows until its countdown ends."""

    def __init__(self, after: int) -> None:
        self.countdown = Countdown(after)

    def decode(self, ids, **kwargs) -> str:
        self.countdown.tick()
        return " ".join(map(str, ids))


def faulty_request(kind: str, prompt: list[int], rng: np.random.Generator) -> Request:
    """A request that fails in one per-sequence part of a step, a few steps in."""
    after = int(rng.integers(1, 6))
    if kind == "drafting":
        return Request(prompt=prompt, drafter=FailingDrafter(after), max_new_tokens=30)
    if kind == "sampling":
        # below sampling_or_greedy's floor: dividing the logits by it gives NaN probabilities
        return Request(prompt=prompt, drafter=RandomTreeDrafter(TINY_VOCAB, seed=after),
                       max_new_tokens=30, sampling=SamplingConfig(temperature=1e-40, seed=1))
    if kind == "stopping":
        return Request(prompt=prompt, drafter=NoDrafter(), max_new_tokens=30,
                       stop_strings=["never"], tokenizer=FailingTokenizer(after))
    countdown = Countdown(after)  # streaming: the request's on_tokens callback fails
    return Request(prompt=prompt, drafter=RandomTreeDrafter(TINY_VOCAB, seed=after),
                   max_new_tokens=30, on_tokens=lambda tokens: countdown.tick())


FAULTS = ["drafting", "sampling", "stopping", "streaming"]


@pytest.mark.parametrize("max_batch_size", [16, 3])
def test_a_failing_sequence_ends_alone(tiny, max_batch_size):
    rng = np.random.default_rng(7)
    prompts = varied_prompts(12, seed=11)
    good = prompts[:8]
    lengths = rng.integers(5, 30, len(good)).tolist()
    references = [reference_greedy(tiny, p, n) for p, n in zip(good, lengths, strict=True)]
    requests = [Request(prompt=p, drafter=mixed_drafter(i, p, ref), max_new_tokens=n)
                for i, (p, n, ref) in enumerate(zip(good, lengths, references, strict=True))]
    # a seeded sampled request too: it must draw the same tokens beside the failures
    sampled = SamplingConfig(temperature=0.8, top_p=0.9, seed=3)
    alone = run_batched(tiny, [Request(prompt=good[0], drafter=NoDrafter(), max_new_tokens=20,
                                       sampling=sampled)], [0], 1)[0].token_ids
    requests.append(Request(prompt=good[0], drafter=NoDrafter(), max_new_tokens=20,
                            sampling=sampled))
    faulty = [faulty_request(kind, prompt, rng)
              for kind, prompt in zip(FAULTS * 2, prompts[8:] * 2, strict=True)]
    arrivals = rng.integers(0, 8, len(requests) + len(faulty)).tolist()
    results = run_batched(tiny, requests + faulty, arrivals, max_batch_size)

    for result, reference in zip(results[:len(references)], references, strict=True):
        assert result.token_ids == reference and result.stop_reason == "max_new_tokens"
    assert results[len(references)].token_ids == alone
    for kind, result in zip(FAULTS * 2, results[len(requests):], strict=True):
        assert result.stop_reason == "error", kind
