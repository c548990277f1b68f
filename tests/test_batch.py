"""Batching changes no output: a sequence generated beside others, arriving whenever, is token
for token what it is alone, and a seeded sampled request draws the same tokens."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from conftest import TINY_VOCAB
from drafters_for_tests import OracleDrafter, RandomTreeDrafter
from test_lossless_greedy import reference_greedy, varied_prompts
from transformers import AutoModelForCausalLM, DynamicCache, GemmaConfig

from dresd.decoding import SamplingConfig, speculative_generate
from dresd.decoding.batch import BatchEngine, Request
from dresd.decoding.forward import HFForward, LlamaForward, Segment, make_forward
from dresd.decoding.generate import target_forward
from dresd.decoding.tree import DraftTree
from dresd.drafters import HybridDrafter, NoDrafter, PromptLookupDrafter, SuffixDrafter
from dresd.prompts import encode_prompt


def mixed_drafter(index: int, prompt: list[int], reference: list[int]):
    """A different drafter for each request: one batch mixes methods."""
    kind = index % 4
    if kind == 0:
        return NoDrafter()
    if kind == 1:
        return PromptLookupDrafter(num_drafts=3)
    if kind == 2:
        return RandomTreeDrafter(TINY_VOCAB, seed=index)
    return OracleDrafter(len(prompt), reference, draft_len=8, corrupt=0.3, seed=index,
                         vocab_size=TINY_VOCAB)


def run_batched(model, requests: list[Request], arrivals: list[int], max_batch_size: int,
                prefill_chunk: int = 512, cost=None) -> list:
    """Add request i at step arrivals[i]; step until all are done."""
    engine = BatchEngine(model, max_batch_size=max_batch_size, prefill_chunk=prefill_chunk,
                         cost=cost)
    states = [None] * len(requests)
    step = 0
    while step <= max(arrivals) or engine.busy():
        for i, arrival in enumerate(arrivals):
            if arrival == step:
                states[i] = engine.add(requests[i])
        engine.step()
        step += 1
    return [state.result for state in states]


@pytest.mark.parametrize("max_batch_size,prefill_chunk", [(16, 512), (3, 7)])
def test_batched_greedy_equals_generate(tiny, max_batch_size, prefill_chunk):
    """Random arrival times, prompt lengths, stop points and drafters; sequences finish mid-batch
    and waiting ones take their place; prompts longer than a chunk prefill in several steps."""
    rng = np.random.default_rng(1)
    prompts = varied_prompts(16, seed=5)
    lengths = rng.integers(1, 40, len(prompts)).tolist()
    references = [reference_greedy(tiny, p, n) for p, n in zip(prompts, lengths, strict=True)]
    requests = [Request(prompt=p, drafter=mixed_drafter(i, p, ref), max_new_tokens=n)
                for i, (p, n, ref) in enumerate(zip(prompts, lengths, references, strict=True))]
    arrivals = rng.integers(0, 30, len(prompts)).tolist()
    results = run_batched(tiny, requests, arrivals, max_batch_size, prefill_chunk)
    for result, reference in zip(results, references, strict=True):
        assert result.token_ids == reference
        assert result.stop_reason == "max_new_tokens"


def test_eos_and_cancel_leave_the_others_untouched(tiny):
    prompts = varied_prompts(6, seed=6)
    references = [reference_greedy(tiny, p, 30) for p in prompts]
    eos = references[0][5]  # request 0 stops at its 6th token (or earlier)
    seen: list[int] = []

    def cancel_after_ten(tokens: list[int]) -> bool:
        seen.extend(tokens)
        return len(seen) < 10

    requests = [Request(prompt=p, drafter=PromptLookupDrafter(), max_new_tokens=30)
                for p in prompts]
    requests[0].eos_token_ids = [eos]
    requests[1].on_tokens = cancel_after_ten
    results = run_batched(tiny, requests, [0, 0, 1, 2, 2, 5], max_batch_size=4)
    stop = references[0].index(eos) + 1
    assert results[0].token_ids == references[0][:stop] and results[0].stop_reason == "eos"
    assert results[1].stop_reason == "cancelled"
    assert 10 <= len(results[1].token_ids) < 30
    assert results[1].token_ids == references[1][: len(results[1].token_ids)]
    for result, reference in zip(results[2:], references[2:], strict=True):
        assert result.token_ids == reference


def test_engine_cancel_frees_the_slot(tiny):
    prompts = varied_prompts(3, seed=7)
    engine = BatchEngine(tiny, max_batch_size=1)
    first = engine.add(Request(prompt=prompts[0], drafter=NoDrafter(), max_new_tokens=50))
    second = engine.add(Request(prompt=prompts[1], drafter=NoDrafter(), max_new_tokens=5))
    engine.step()
    engine.cancel(first)
    engine.run()
    assert first.result.stop_reason == "cancelled"
    assert second.result.token_ids == reference_greedy(tiny, prompts[1], 5)


def test_seeded_sampling_is_the_same_in_any_batch(tiny):
    sampling = SamplingConfig(temperature=0.9, top_p=0.95, seed=3)
    prompts = varied_prompts(8, seed=8)
    alone = [speculative_generate(tiny, RandomTreeDrafter(TINY_VOCAB, seed=i), torch.tensor(p),
                                  max_new_tokens=25, sampling=sampling).token_ids
             for i, p in enumerate(prompts)]
    requests = [Request(prompt=p, drafter=RandomTreeDrafter(TINY_VOCAB, seed=i),
                        max_new_tokens=25, sampling=sampling) for i, p in enumerate(prompts)]
    results = run_batched(tiny, requests, [0, 3, 0, 7, 1, 1, 2, 9], max_batch_size=5)
    assert [result.token_ids for result in results] == alone


def tiny_gemma() -> torch.nn.Module:
    torch.manual_seed(0)
    config = GemmaConfig(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=1024, pad_token_id=0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float64).eval()


def test_models_that_are_not_llama_shaped_fall_back_to_transformers(tiny):
    """Llama and Qwen2 take the batched forward; a Gemma-style model (another norm, scaled
    embeddings) runs transformers' own forward and is just as exact, batched."""
    assert isinstance(make_forward(tiny), LlamaForward)
    gemma = tiny_gemma()
    assert isinstance(make_forward(gemma), HFForward)
    prompts = varied_prompts(6, seed=9)
    references = [reference_greedy(gemma, p, 20) for p in prompts]
    requests = [Request(prompt=p, drafter=mixed_drafter(i, p, ref), max_new_tokens=20)
                for i, (p, ref) in enumerate(zip(prompts, references, strict=True))]
    results = run_batched(gemma, requests, [0, 0, 2, 3, 3, 4], max_batch_size=4)
    assert [result.token_ids for result in results] == references


def test_llama_forward_is_transformers_forward(tiny):
    """Logits and hidden states of a prompt chunk, a second chunk and a tree equal transformers'
    forward on the same inputs (float64: to rounding)."""
    forward = LlamaForward(tiny)
    prompt = varied_prompts(3, seed=10)[1] + [5, 6, 7]
    sequence = forward.new_sequence()
    cache = DynamicCache(config=tiny.config)
    split = len(prompt) // 2
    mine = forward([Segment(sequence, prompt[:split], 0, logits_rows="all")])[0]
    theirs = target_forward(tiny, torch.tensor([prompt[:split]]), cache)
    torch.testing.assert_close(mine.logits, theirs[0])
    mine = forward([Segment(sequence, prompt[split:], split, logits_rows="all")])[0]
    theirs = target_forward(tiny, torch.tensor([prompt[split:]]), cache)
    torch.testing.assert_close(mine.logits, theirs[0])
    torch.testing.assert_close(mine.hidden, theirs[1])
    tree = DraftTree.from_drafts(9, [[1, 2, 3], [1, 4], [5]])
    n = len(prompt)
    mine = forward([Segment(sequence, tree.tokens, n, depths=tree.depths,
                            ancestors=tree.ancestor_matrix())])[0]
    theirs = target_forward(tiny, tree.input_ids(), cache, tree.position_ids(n),
                            tree.attention_mask(n, torch.float64))
    torch.testing.assert_close(mine.logits, theirs[0])
    torch.testing.assert_close(mine.hidden, theirs[1])


def test_bf16_batched_is_bit_for_bit_single_stream(default_target_bf16):
    """The default model in bf16 on the batch-invariant path: each of several requests with
    real drafts, batched with small prefill chunks (so chunks ride beside verify trees), gives
    exactly its single-stream tokens."""
    target = default_target_bf16
    texts = ["Natalia sold clips to 48 of her friends in April, and then she sold half as many "
             "clips in May. How many clips did Natalia sell altogether?",
             "Write a Python function that returns the sum of a list of numbers.",
             "Repeat after me: the cat sat on the mat, the cat sat on the mat.",
             "What is the capital of France? Answer in one sentence.",
             "List three prime numbers larger than ten."]
    prompts = [encode_prompt(target.tokenizer, text) for text in texts]

    def request(prompt: list[int]) -> Request:
        return Request(prompt=prompt, drafter=PromptLookupDrafter(num_drafts=3),
                       max_new_tokens=40, eos_token_ids=target.eos_token_ids)

    alone = [speculative_generate(target.model, PromptLookupDrafter(num_drafts=3),
                                  torch.tensor(p), max_new_tokens=40,
                                  eos_token_ids=target.eos_token_ids).token_ids
             for p in prompts]
    results = run_batched(target.model, [request(p) for p in prompts], [0, 0, 1, 4, 6],
                          max_batch_size=4, prefill_chunk=16)
    assert [result.token_ids for result in results] == alone


def test_forks_share_what_is_learned_and_keep_their_own_request_state():
    suffix = SuffixDrafter()
    fork = suffix.fork()
    fork.observe([1, 2], [3, 4, 5, 3, 4, 6])
    assert fork.global_trie is suffix.global_trie and suffix.cached  # learned for all
    assert fork.request_trie is not suffix.request_trie
    hybrid = HybridDrafter(cost={1: 1.0, 64: 1.0})
    forked = hybrid.fork()
    assert forked.table is hybrid.table
    assert forked.sources["suffix"].global_trie is hybrid.sources["suffix"].global_trie
    assert forked.sources["suffix"].request_trie is not hybrid.sources["suffix"].request_trie
    assert forked.sizes_its_trees and not suffix.sizes_its_trees


def test_forked_drafters_in_one_batch_are_lossless(tiny):
    prompts = varied_prompts(8, seed=13)
    references = [reference_greedy(tiny, p, 30) for p in prompts]
    bases = [SuffixDrafter(), HybridDrafter(cost={1: 1.0, 64: 1.2})]
    requests = [Request(prompt=p, drafter=bases[i % 2].fork(), max_new_tokens=30)
                for i, p in enumerate(prompts)]
    results = run_batched(tiny, requests, [0, 0, 0, 1, 1, 2, 2, 3], max_batch_size=8)
    assert [result.token_ids for result in results] == references


@pytest.mark.parametrize("model_name", ["llama", "gemma"])
def test_recorded_top2_are_each_tokens_two_best_logits(tiny, model_name):
    """The reference's record (`record_top2`), taken for the whole step in one pass, gives each
    emitted token the two best logits of the row that chose it, beside requests that record
    nothing and drafters whose trees accept paths of several nodes."""
    model = tiny if model_name == "llama" else tiny_gemma()
    prompts = varied_prompts(5, seed=11)
    references = [reference_greedy(model, p, 12) for p in prompts]
    requests = [Request(prompt=p, drafter=mixed_drafter(i, p, ref), max_new_tokens=12,
                        record_top2=i != 2)
                for i, (p, ref) in enumerate(zip(prompts, references, strict=True))]
    results = run_batched(model, requests, [0, 0, 1, 2, 2], max_batch_size=4)
    for i, (prompt, result) in enumerate(zip(prompts, results, strict=True)):
        if i == 2:
            assert result.top2_logits is None
            continue
        ids = torch.tensor([prompt + result.token_ids[:-1]])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1:].float()
        expected = logits.topk(2, dim=-1).values
        assert result.top2_logits is not None and len(result.top2_logits) == len(expected)
        torch.testing.assert_close(torch.tensor(result.top2_logits), expected,
                                   rtol=1e-5, atol=1e-5)


class ThreadRecorder(PromptLookupDrafter):
    """PLD that records which thread runs its `observe`, and when, against forwards."""

    def __init__(self, engine_steps) -> None:
        super().__init__()
        object.__setattr__(self, "log", [])
        object.__setattr__(self, "engine_steps", engine_steps)

    def observe(self, prompt, output, hidden_states=None) -> None:
        self.log.append(("observe", threading.current_thread().name, self.engine_steps()))


def test_drafters_observe_runs_beside_the_next_forward(tiny):
    """`observe` after a generation runs on the loop's worker thread during the next forward,
    or at the end of `run`; outputs unchanged."""
    prompts = varied_prompts(2, seed=5)
    engine = BatchEngine(tiny, max_batch_size=2)
    drafter = ThreadRecorder(lambda: engine.steps)
    states = [engine.add(Request(prompt=p, drafter=drafter, max_new_tokens=12 + 8 * i))
              for i, p in enumerate(prompts)]
    engine.run()
    assert [s.result.token_ids for s in states] == [reference_greedy(tiny, p, 12 + 8 * i)
                                                    for i, p in enumerate(prompts)]
    observes = [entry for entry in drafter.log if entry[0] == "observe"]
    assert len(observes) == 2 and sum(len(s.result.steps) for s in states) > 0
    # The first generation's observe ran beside a later forward of the second one; the
    # second's, the last, when `run` ended (on the caller's thread).
    assert observes[0][1].startswith("dresd-drafting")
    assert observes[1][1] == threading.current_thread().name
    assert observes[1][2] == engine.steps
