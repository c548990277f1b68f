"""Log-probabilities from the verify forward's own logits: every method reports, for each token
it emits, what plain decoding reports (bit for bit on the row-invariant C decoder), and that is
the log-softmax of a fresh forward over the same tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import TINY_VOCAB
from test_prefix_cache import BF16_VOCAB, C_DECODER, bf16_model, drafter

from dresd.decoding.batch import BatchEngine, Request
from dresd.decoding.forward import LlamaForward, Segment
from dresd.decoding.sampling import SamplingConfig

TOP = 3


def generate(model, prompts: list[list[int]], method: str, vocab: int,
             sampling: SamplingConfig | None = None) -> list:
    engine = BatchEngine(model, max_batch_size=len(prompts))
    states = [engine.add(Request(prompt=p, drafter=drafter(method, i, vocab), max_new_tokens=20,
                                 logprobs=TOP, sampling=sampling))
              for i, p in enumerate(prompts)]
    engine.run()
    return [state.result for state in states]


def fresh(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """log-softmax of one forward over prompt + output: the rows that chose each output token."""
    forward = LlamaForward(model)
    tokens = prompt + output[:-1]
    logits = forward([Segment(forward.new_sequence(), tokens, 0)])[0].logits
    return torch.log_softmax(logits.float(), dim=-1)[len(prompt) - 1:]


def prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(7)
    motif = rng.integers(1, vocab, 4).tolist()
    return [rng.integers(1, vocab, 30).tolist(), motif * 8, rng.integers(1, vocab, 140).tolist()]


@C_DECODER
@pytest.mark.parametrize("method", ["pld", "suffix", "random"])
def test_every_method_reports_plain_decodings_logprobs_bf16(method):
    model = bf16_model()
    plain = generate(model, prompts(BF16_VOCAB), "none", BF16_VOCAB)
    mine = generate(model, prompts(BF16_VOCAB), method, BF16_VOCAB)
    for a, b, prompt in zip(plain, mine, prompts(BF16_VOCAB), strict=True):
        assert a.token_ids == b.token_ids and len(b.logprobs) == len(b.token_ids)
        assert a.logprobs == b.logprobs  # bit for bit, alternatives included
        expected = fresh(model, prompt, b.token_ids)
        for row, entry in zip(expected, b.logprobs, strict=True):
            assert entry.logprob == row[entry.token].item()
            assert [token for token, _ in entry.top] == row.topk(TOP).indices.tolist()
            assert entry.top[0][1] >= entry.logprob


def test_logprobs_float64_and_sampled(tiny):
    texts = prompts(TINY_VOCAB)
    for method in ("none", "pld"):
        for result, prompt in zip(generate(tiny, texts, method, TINY_VOCAB), texts, strict=True):
            expected = fresh(tiny, prompt, result.token_ids)
            got = torch.tensor([entry.logprob for entry in result.logprobs], dtype=torch.float32)
            want = expected.gather(1, torch.tensor(result.token_ids)[:, None])[:, 0]
            torch.testing.assert_close(got, want)
            assert all(entry.token == token for entry, token
                       in zip(result.logprobs, result.token_ids, strict=True))
    sampled = generate(tiny, texts, "pld", TINY_VOCAB, SamplingConfig(temperature=0.8, seed=3))
    assert all(len(r.logprobs) == len(r.token_ids) for r in sampled)
    assert all(entry.logprob <= 0 for r in sampled for entry in r.logprobs)
