"""The prefix cache changes no output: a request with a full hit, a partial hit or none, batched
beside others, generates the tokens it generates with the cache off, for every method; the keys
and values a decode or verify step writes are the bits a fresh prefill of the same tokens
writes (so a chat's next turn may reuse them); and the cache keeps to its size, its LRU order,
its locks and its salts."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from conftest import TINY_VOCAB
from drafters_for_tests import RandomTreeDrafter
from test_kernel_decoder import tiny_bf16

from dresd.decoding.batch import BatchEngine, Request
from dresd.decoding.forward import LlamaForward, Segment
from dresd.decoding.kv_cache import SequenceKV
from dresd.decoding.prefix_cache import PrefixCache
from dresd.drafters import HybridDrafter, NoDrafter, PromptLookupDrafter, SuffixDrafter
from dresd.kernels import runnable_tiers
from dresd.prompts import encode_prompt

C_DECODER = pytest.mark.skipif(not runnable_tiers() or shutil.which("cc") is None,
                               reason="the C decoder needs a kernel tier (AVX2 with FMA, "
                                      "AVX-512 or NEON) and a compiler")
METHODS = ["none", "pld", "suffix", "hybrid", "random"]
BF16_VOCAB = 300  # test_kernel_decoder's tiny bf16 model


def drafter(method: str, seed: int = 0, vocab: int = TINY_VOCAB):
    """A fresh drafter of one method (suffix and hybrid learn: each run starts from nothing)."""
    if method == "none":
        return NoDrafter()
    if method == "pld":
        return PromptLookupDrafter(num_drafts=3)
    if method == "suffix":
        return SuffixDrafter()
    if method == "hybrid":
        return HybridDrafter(cost={1: 1.0, 64: 1.0})
    return RandomTreeDrafter(vocab, seed=seed)


def generate(model, prompts: list[list[int]], method: str, cache: PrefixCache | None,
             max_new_tokens: int = 24, salts: list[str] | None = None, vocab: int = TINY_VOCAB,
             prefill_chunk: int = 512, eos: tuple[int, ...] = ()) -> list:
    """All prompts through one batch (each its own drafter); their results in order."""
    engine = BatchEngine(model, max_batch_size=len(prompts), prefill_chunk=prefill_chunk,
                         prefix_cache=cache)
    salts = salts or [""] * len(prompts)
    states = [engine.add(Request(prompt=prompt, drafter=drafter(method, i, vocab),
                                 max_new_tokens=max_new_tokens, cache_salt=salt,
                                 eos_token_ids=eos))
              for i, (prompt, salt) in enumerate(zip(prompts, salts, strict=True))]
    engine.run()
    return [state.result for state in states]


def shared_prefix_prompts(vocab: int, system_len: int, seed: int = 0) -> dict[str, list[int]]:
    """A system prompt, then: the same prompt twice (a full hit), one sharing part of the
    system prompt (a partial hit), one sharing nothing (no hit)."""
    rng = np.random.default_rng(seed)
    system = rng.integers(1, vocab, system_len).tolist()
    motif = rng.integers(1, vocab, 5).tolist()
    return {
        "first": system + (motif * 4) + rng.integers(1, vocab, 7).tolist(),
        "other": system + rng.integers(1, vocab, 11).tolist(),
        "partial": system[: system_len // 2] + (motif * 3) + rng.integers(1, vocab, 9).tolist(),
        "none": rng.integers(1, vocab, system_len // 2).tolist(),
    }


def check_hits_change_nothing(model, method: str, vocab: int, system_len: int,
                              prefill_chunk: int = 512) -> None:
    prompts = shared_prefix_prompts(vocab, system_len)
    order = ["first", "other", "partial", "none"]
    batch = [prompts[name] for name in order]
    reference = [r.token_ids for r in generate(model, batch, method, None, vocab=vocab,
                                               prefill_chunk=prefill_chunk)]
    cache = PrefixCache(64)
    # cold: the requests after the first hit what it prefilled while they waited for the chunk
    cold = generate(model, batch, method, cache, vocab=vocab, prefill_chunk=prefill_chunk)
    assert [r.token_ids for r in cold] == reference
    assert cold[0].cached_tokens == 0 and cold[1].cached_tokens >= system_len
    # warm: a full hit (all but the prompt's last token), partial hits, and none
    warm = generate(model, batch, method, cache, vocab=vocab, prefill_chunk=prefill_chunk)
    assert [r.token_ids for r in warm] == reference
    assert warm[0].cached_tokens == len(prompts["first"]) - 1
    assert warm[1].cached_tokens == len(prompts["other"]) - 1
    assert system_len // 2 <= warm[2].cached_tokens < len(prompts["partial"])
    assert warm[3].cached_tokens == len(prompts["none"]) - 1  # itself, from the cold run
    # the next turn: history + answer + a new message hits on the history and the answer
    turns = [prompt + answer + prompts["none"][:6] for prompt, answer in zip(batch, reference,
                                                                           strict=True)]
    plain = [r.token_ids for r in generate(model, turns, method, None, vocab=vocab,
                                           prefill_chunk=prefill_chunk)]
    again = generate(model, turns, method, cache, vocab=vocab, prefill_chunk=prefill_chunk)
    assert [r.token_ids for r in again] == plain
    for prompt, answer, result in zip(batch, reference, again, strict=True):
        assert result.cached_tokens >= len(prompt) + len(answer) - 1


@pytest.mark.parametrize("method", METHODS)
def test_hits_change_no_output_float64(tiny, method):
    """Tiny float64 models (Llama and Qwen2), prompts over several chunks."""
    check_hits_change_nothing(tiny, method, TINY_VOCAB, system_len=40, prefill_chunk=16)


@C_DECODER
@pytest.mark.parametrize("method", METHODS)
def test_hits_change_no_output_bf16_c_decoder(method):
    """A tiny bf16 model on the C decoder, a system prompt longer than the C attention took
    before (128 rows) in one chunk, and in chunks that a hit splits elsewhere."""
    model = bf16_model()
    check_hits_change_nothing(model, method, BF16_VOCAB, system_len=300)
    check_hits_change_nothing(model, method, BF16_VOCAB, system_len=150, prefill_chunk=64)


_BF16: list[torch.nn.Module] = []


def bf16_model() -> torch.nn.Module:
    if not _BF16:
        _BF16.append(tiny_bf16())
    return _BF16[0]


def prefill(forward: LlamaForward, tokens: list[int], chunks: list[int]) -> SequenceKV:
    """A fresh sequence prefilled with `tokens`, cut into chunks of the given lengths."""
    sequence = forward.new_sequence()
    start = 0
    for length in chunks:
        forward([Segment(sequence, tokens[start:start + length], start, logits_rows="none")])
        start += length
    assert start == len(tokens)
    return sequence


def same_rows(a: SequenceKV, b: SequenceKV, rows: int) -> bool:
    return (torch.equal(a.key_buffer[:, :, :rows], b.key_buffer[:, :, :rows])
            and torch.equal(a.value_buffer[:, :, :rows], b.value_buffer[:, :, :rows]))


@C_DECODER
def test_a_row_is_the_same_bits_however_it_was_computed():
    """On the C decoder a token's key and value do not depend on the chunk that computed it:
    one chunk of 300 rows, chunks of 200 + 100, of 37, or one token at a time give the same
    bits; and the rows that decode and verify steps committed (random trees, PLD) equal a
    fresh prefill of the same tokens, bit for bit."""
    model = bf16_model()
    forward = LlamaForward(model)
    assert forward.c_decoder is not None
    tokens = np.random.default_rng(3).integers(1, BF16_VOCAB, 300).tolist()
    whole = prefill(forward, tokens, [300])
    for chunks in ([200, 100], [37] * 8 + [4], [1] * 300):
        assert same_rows(whole, prefill(forward, tokens, chunks), 300)
    for method in ("random", "pld", "none"):
        engine = BatchEngine(model, max_batch_size=1)
        state = engine.add(Request(prompt=tokens[:150], drafter=drafter(method, 1, BF16_VOCAB),
                                   max_new_tokens=60))
        sequence = None
        while engine.busy():
            sequence = state.cache or sequence
            engine.step()
        written = state.n - 1  # every row but the last token's
        context = state.context[:written].tolist()
        assert same_rows(sequence, prefill(forward, context, [written]), written)


def test_default_model_bf16_hits_change_no_output(default_target_bf16):
    """The default model in bf16: a system prompt of ~200 tokens before three questions, then
    each question's second turn; greedy tokens with the cache equal those without it."""
    target = default_target_bf16
    tokenizer = target.tokenizer
    system = ("You are a careful math tutor. Solve each problem step by step, show the "
              "arithmetic, and give the final answer as a number on its own line. " * 6)
    questions = ["Natalia sold clips to 48 of her friends in April, and then she sold half "
                 "as many clips in May. How many clips did Natalia sell altogether?",
                 "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes "
                 "of babysitting. How much did she earn?",
                 "What is 17 times 3?"]
    prompts = [encode_prompt(tokenizer, system + "\n" + q) for q in questions]
    eos = tuple(target.eos_token_ids)
    plain = [r.token_ids for r in generate(target.model, prompts, "pld", None, 16, eos=eos)]
    cache = PrefixCache(256)
    cold = generate(target.model, prompts, "pld", cache, 16, eos=eos)
    assert [r.token_ids for r in cold] == plain
    # the first two prefill in one step; the third waits for room, and hits their prefix
    assert [r.cached_tokens > 150 for r in cold] == [False, False, True]
    warm = generate(target.model, prompts, "pld", cache, 16, eos=eos)
    assert [r.token_ids for r in warm] == plain
    assert [r.cached_tokens for r in warm] == [len(p) - 1 for p in prompts]
    follow = tokenizer.encode(" Now explain it to a child.", add_special_tokens=False)
    turns = [p + a + follow for p, a in zip(prompts, plain, strict=True)]
    reference = [r.token_ids for r in generate(target.model, turns, "none", None, 16, eos=eos)]
    again = generate(target.model, turns, "none", cache, 16, eos=eos)
    assert [r.token_ids for r in again] == reference
    assert all(r.cached_tokens >= len(p) + len(a) - 1
               for r, p, a in zip(again, prompts, plain, strict=True))


# -- the cache itself ---------------------------------------------------------------------


def filled(length: int, seed: int) -> SequenceKV:
    """A float32 sequence of `length` rows of random keys and values (2 layers, 1 head, 4)."""
    sequence = SequenceKV(2, 1, 4, torch.float32, "cpu")
    generator = torch.Generator().manual_seed(seed)
    sequence.reserve(length)
    sequence.key_buffer[:, :, :length] = torch.rand(2, 1, length, 4, generator=generator)
    sequence.value_buffer[:, :, :length] = torch.rand(2, 1, length, 4, generator=generator)
    sequence.length = length
    return sequence


BYTES_PER_TOKEN = 2 * 2 * 1 * 4 * 4  # keys and values, 2 layers, 1 head of 4 floats


def test_lookup_copies_the_rows_inserted_at_any_split():
    cache = PrefixCache(1)
    a = filled(10, seed=0)
    cache.insert(list(range(10)), "", a)
    b = filled(12, seed=1)  # shares 6 tokens with a: the edge splits there
    tokens_b = list(range(6)) + [50 + i for i in range(6)]
    b.key_buffer[:, :, :6], b.value_buffer[:, :, :6] = a.rows(0, 6)
    cache.insert(tokens_b, "", b)
    assert cache.bytes == (10 + 6) * BYTES_PER_TOKEN
    for tokens, source, expected in ((list(range(10)) + [99], a, 10), (tokens_b, b, 11),
                                     (list(range(8)), a, 7), ([7, 8], a, 0)):
        target = SequenceKV(2, 1, 4, torch.float32, "cpu")
        hit = cache.lookup(tokens, "", target, limit=len(tokens) - 1)
        assert hit.length == expected == target.length
        assert same_rows(target, source, expected)
        cache.release(hit)
    assert cache.stats.hits == 10 + 11 + 7


def test_salts_never_share():
    cache = PrefixCache(1)
    cache.insert(list(range(10)), "tenant-a", filled(10, 0))
    target = SequenceKV(2, 1, 4, torch.float32, "cpu")
    assert cache.lookup(list(range(10)), "tenant-b", target, limit=9).length == 0
    assert cache.lookup(list(range(10)), "tenant-a", target, limit=9).length == 9


def test_lru_leaves_go_first_and_held_entries_stay():
    cache = PrefixCache(20 * BYTES_PER_TOKEN / 2**20)  # room for 20 tokens
    cache.insert(list(range(8)), "", filled(8, 0))  # older
    cache.insert([100 + i for i in range(8)], "", filled(8, 1))
    held = cache.lookup(list(range(8)) + [7], "", SequenceKV(2, 1, 4, torch.float32, "cpu"),
                        limit=8)  # the older one is in use now, and used more recently too
    cache.insert([200 + i for i in range(8)], "", filled(8, 2))  # 24 > 20: one must go
    assert cache.stats.evictions == 1
    probe = SequenceKV(2, 1, 4, torch.float32, "cpu")
    assert cache.lookup([100 + i for i in range(9)], "", probe, limit=8).length == 0
    # with every entry held or needed, a request longer than the cache caches what fits
    cache.insert([300 + i for i in range(40)], "", filled(40, 3))
    assert cache.bytes <= cache.capacity_bytes
    again = cache.lookup(list(range(9)), "", SequenceKV(2, 1, 4, torch.float32, "cpu"), limit=8)
    assert again.length == 8  # held: never evicted
    cache.release(held)
    cache.release(again)
    assert cache.clear() > 0 and cache.bytes == 0


def test_a_prompt_longer_than_the_cache_still_runs(tiny):
    prompt = np.random.default_rng(0).integers(1, TINY_VOCAB, 60).tolist()
    plain = generate(tiny, [prompt], "pld", None)[0].token_ids
    cache = PrefixCache(2**-10)  # 1 KiB: a few tokens of the tiny model
    for _ in range(2):
        assert generate(tiny, [prompt], "pld", cache)[0].token_ids == plain
    assert cache.bytes <= cache.capacity_bytes


def test_siblings_wait_for_the_first_prefill_and_read_it(tiny):
    """`n` choices of one prompt: the later ones wait for the first's prefill (short prompts
    would otherwise prefill side by side in one step) and read all but their last token."""
    prompt = np.random.default_rng(5).integers(1, TINY_VOCAB, 30).tolist()
    plain = generate(tiny, [prompt], "pld", None)[0].token_ids
    engine = BatchEngine(tiny, max_batch_size=3, prefix_cache=PrefixCache(16))
    first = engine.add(Request(prompt=prompt, drafter=drafter("pld"), max_new_tokens=24))
    others = [engine.add(Request(prompt=prompt, drafter=drafter("pld"), max_new_tokens=24,
                                 prefill_after=first)) for _ in range(2)]
    engine.run()
    assert [s.result.token_ids for s in [first, *others]] == [plain] * 3
    assert [s.result.cached_tokens for s in [first, *others]] == [0, 29, 29]
