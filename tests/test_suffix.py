"""SuffixDecoding (`--method suffix`): the tries against brute-force counting on random token
streams, the drafts against a brute-force search, losslessness through the loop, and learning."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import test_sampling
import torch
from test_lossless_greedy import reference_greedy, spec, varied_prompts

from dresd.decoding.drafter import DraftContext
from dresd.drafters import SuffixDrafter, make_drafter
from dresd.drafters.suffix import SpeculationTree, SuffixTrie, speculation_budget
from dresd.kernels import drafting


def random_stream(rng: np.random.Generator, length: int, vocab: int) -> list[int]:
    """Random tokens with repeated motifs, so that long matches and ties occur."""
    tokens: list[int] = []
    motifs = [rng.integers(0, vocab, int(rng.integers(2, 6))).tolist() for _ in range(3)]
    while len(tokens) < length:
        if rng.random() < 0.5:
            tokens += motifs[int(rng.integers(len(motifs)))]
        else:
            tokens.append(int(rng.integers(vocab)))
    return tokens[:length]


# ---------------------------------------------------------------- brute force, from definitions

def brute_count(sequences: list[list[int]], s: list[int]) -> int:
    """Positions i of any sequence with seq[i : i + |s|] = s."""
    return sum(seq[i : i + len(s)] == s for seq in sequences
               for i in range(len(seq) - len(s) + 1))


def brute_tree(sequences, pattern, depth_limit, budget, min_prob, max_len, tree=True):
    """The best-first tree below `pattern`, with every count found by scanning the sequences:
    a node s + [t] has prob(s) * count(s + [t]) / count(s); strings longer than the trie's
    depth do not exist; the frontier node of highest prob (earliest pushed on ties) is next."""
    grown = SpeculationTree()
    frontier = []  # (prob, push order, path, parent index)
    order = itertools.count()

    def push_children(path, prob, index):
        s = pattern + path
        if len(path) >= max_len or len(s) >= depth_limit:
            return
        followers = sorted({seq[i + len(s)] for seq in sequences
                            for i in range(len(seq) - len(s)) if seq[i : i + len(s)] == s})
        if not tree and followers:
            followers = [max(followers, key=lambda t: (brute_count(sequences, s + [t]), -t))]
        for t in followers:
            p = prob * brute_count(sequences, s + [t]) / brute_count(sequences, s)
            if p >= min_prob:
                frontier.append((p, next(order), path + [t], index))

    push_children([], 1.0, -1)
    while frontier and len(grown.tokens) < budget:
        best = min(frontier, key=lambda item: (-item[0], item[1]))
        frontier.remove(best)
        prob, _, path, parent = best
        grown.tokens.append(path[-1])
        grown.parents.append(parent)
        grown.probs.append(prob)
        push_children(path, prob, len(grown.tokens) - 1)
    return grown


def brute_best(drafter: SuffixDrafter, request: list[int], history: list[list[int]],
               max_len: int) -> SpeculationTree:
    """The speculation tree by the module's rule, every match found by scanning the token lists."""
    depth = drafter.max_depth
    best = SpeculationTree()
    stores = [[request]] + ([history] if drafter.learn and history else [])
    for which, sequences in enumerate(stores):
        store_best = SpeculationTree()
        for m in range(1, min(depth - 1, len(request)) + 1):
            pattern = request[-m:]
            if brute_count(sequences, pattern) == 0:
                break
            budget = speculation_budget(m, drafter.max_spec_factor, drafter.max_spec_offset,
                                        drafter.max_tree_nodes)
            grown = brute_tree(sequences, pattern, depth, budget, drafter.min_token_prob,
                               max_len, drafter.tree)
            if grown.tokens and grown.score >= store_best.score:
                store_best = grown
        if which == 0 or store_best.score > best.score:
            best = store_best
    return best


# ---------------------------------------------------------------- the tries

def trie_strings(trie: SuffixTrie) -> dict[tuple[int, ...], int]:
    """Every string the trie holds (lazy chains followed), with its count."""
    found, stack = {}, [((), trie.root)]
    while stack:
        path, node = stack.pop()
        for token, child in trie.children(node, len(path)).items():
            found[path + (token,)] = child.count
            stack.append((path + (token,), child))
    return found


def stored_nodes(trie: SuffixTrie) -> int:
    """Nodes held in memory (a lazy chain is one node)."""
    count, stack = 0, [trie.root]
    while stack:
        node = stack.pop()
        children = list(node.children.values()) if node.children else []
        count += len(children)
        stack.extend(children)
    return count


def all_strings(sequences: list[list[int]], depth: int) -> dict[tuple[int, ...], int]:
    counts: dict[tuple[int, ...], int] = {}
    for seq in sequences:
        for i in range(len(seq)):
            for j in range(i + 1, min(i + depth, len(seq)) + 1):
                counts[tuple(seq[i:j])] = counts.get(tuple(seq[i:j]), 0) + 1
    return counts


@pytest.mark.parametrize("depth", [2, 5, 24])
def test_trie_counts_equal_brute_force_counts(depth):
    """Whole sequences (`add`, lazy tails) and one growing sequence (`append`, plain nodes)."""
    rng = np.random.default_rng(depth)
    sequences = [random_stream(rng, int(rng.integers(1, 80)), 5) for _ in range(6)]
    trie = SuffixTrie(depth)
    for seq in sequences:
        trie.add(seq)
    expected = all_strings(sequences, depth)
    assert trie_strings(trie) == expected
    assert trie.num_nodes == stored_nodes(trie) <= len(expected)
    if depth == 24:
        assert trie.num_nodes < len(expected) / 2  # long unique tails are one lazy node each
    assert trie.root.count == sum(map(len, sequences))
    growing, active = SuffixTrie(depth), []
    for token in sequences[0]:
        active = growing.append(active, token)
    assert trie_strings(growing) == all_strings(sequences[:1], depth)
    assert growing.num_nodes == len(all_strings(sequences[:1], depth))


@pytest.mark.parametrize("seed", range(4))
def test_removing_sequences_leaves_the_trie_of_the_others(seed):
    rng = np.random.default_rng(seed)
    sequences = [random_stream(rng, int(rng.integers(1, 60)), 3 + seed) for _ in range(10)]
    sequences.append(list(sequences[0]))  # a repeat: equal lists, distinct objects
    trie = SuffixTrie(6)
    kept: list[list[int]] = []
    for step, seq in enumerate(sequences):  # add and remove interleaved, oldest out first
        trie.add(seq)
        kept.append(seq)
        if step % 3 == 2:
            trie.remove(kept.pop(0))
        assert trie_strings(trie) == all_strings(kept, 6)
        assert trie.num_nodes == stored_nodes(trie)
    for seq in list(kept):
        trie.remove(seq)
        kept.remove(seq)
        assert trie_strings(trie) == all_strings(kept, 6)
    assert trie.num_nodes == 0 and trie.root.count == 0 and not trie.root.children


# ---------------------------------------------------------------- the drafts

@pytest.mark.parametrize("options", [
    dict(),
    dict(max_depth=6, max_tree_nodes=5, min_token_prob=0.0),
    dict(max_spec_factor=2.0, max_spec_offset=1.0, min_token_prob=0.05),
    dict(tree=False, max_spec_factor=3.0),
    dict(learn=False, max_depth=8),
], ids=["defaults", "shallow", "wide", "path", "no-learn"])
@pytest.mark.parametrize("request_tree", ["C kernel", "Python trie"])
def test_drafts_equal_brute_force_search(options, request_tree, monkeypatch):
    """Requests drafted step by step (the per-request trie extended, then rebuilt for the next
    request, or the C kernel's tree over the request's tokens), with finished requests in the
    global trie: drafts equal the brute-force ones."""
    if request_tree == "Python trie":
        monkeypatch.setattr(drafting, "kernel", lambda: None)
    elif drafting.kernel() is None:
        pytest.skip("no C compiler: the Python trie drafts")
    rng = np.random.default_rng(len(str(options)))
    drafter = SuffixDrafter(**options)
    history: list[list[int]] = []
    drafted = 0
    for _ in range(6):
        prompt = random_stream(rng, int(rng.integers(1, 30)), 6)
        output = random_stream(rng, 40, 6)
        for step in range(0, len(output), 3):
            request = prompt + output[:step]
            max_len = int(rng.integers(1, 12))
            context = DraftContext(np.array(request), torch.zeros(1), max_len)
            got, expected = drafter.propose(context), brute_best(drafter, request, history,
                                                                 max_len)
            assert got == expected.drafts()
            assert all(len(d) <= max_len for d in got)
            drafted += len(got)
            # As candidates (for hybrid): the same drafts, each token with its count share;
            # a path's shares multiply to its leaf's prob.
            candidates = drafter.candidates(context)
            assert [candidate.tokens for candidate in candidates] == got
            leaves = [i for i in range(len(expected.tokens)) if i not in expected.parents]
            for candidate, leaf in zip(candidates, leaves, strict=True):
                shares = candidate.shares
                assert len(shares) == len(candidate.tokens) and candidate.neighbours == 0
                assert all(0 < share <= 1 for share in shares)
                assert np.prod(shares) == pytest.approx(expected.probs[leaf])
        drafter.observe(prompt, output)
        history.append(output)
    assert drafted > 50  # matches happened: the comparison was not between empty lists


@pytest.mark.skipif(drafting.kernel() is None, reason="no C compiler: the Python trie drafts")
@pytest.mark.parametrize("seed", range(4))
def test_c_request_tree_is_the_python_tries_tree(seed):
    """The kernel's tree over a context is the per-request trie's, node for node and bit for
    bit in its probs, at every step of long contexts (repeats, long matches, deep trees)."""
    rng = np.random.default_rng(seed)
    options = [dict(), dict(max_depth=5, max_tree_nodes=3, min_token_prob=0.0),
               dict(max_spec_factor=4.0, max_spec_offset=2.0, min_token_prob=0.01),
               dict(tree=False, max_spec_factor=2.0, max_tree_nodes=64)][seed]
    drafter = SuffixDrafter(learn=False, **options)
    stream = random_stream(rng, 400, int(rng.integers(3, 40)))
    compared = 0
    for end in range(1, len(stream) + 1, 7):
        tokens = np.array(stream[:end])
        max_len = int(rng.integers(1, 16))
        drafter._update_request(tokens)
        trie = drafter.best_tree(drafter.request_trie,
                                 tokens[-(drafter.max_depth - 1):].tolist(), max_len)
        kernel = SpeculationTree(*drafting.suffix_context_tree(
            tokens, drafter.max_depth, drafter.max_spec_factor, drafter.max_spec_offset,
            drafter.max_tree_nodes, drafter.min_token_prob, max_len, drafter.tree))
        assert (kernel.tokens, kernel.parents, kernel.probs, kernel.match_len) == (
            trie.tokens, trie.parents, trie.probs, trie.match_len)
        compared += len(trie.tokens)
    assert compared > 100


def test_budget_grows_with_match_length():
    """A long repeated run drafts more than a one-token match: budget = floor(factor * m)."""
    drafter = SuffixDrafter(learn=False, min_token_prob=0.0, max_tree_nodes=32)
    motif = list(range(10, 30))
    short = drafter.propose(DraftContext(np.array([1, 2, 3, 9, 5, 6, 7, 8, 9]), torch.zeros(1),
                                         20))
    long = drafter.propose(DraftContext(np.array(motif + [0] + motif[:15]), torch.zeros(1), 20))
    assert max(map(len, short)) == 1  # "9" seen once before, followed by 5: one token
    # Every match of m <= 15 tokens continues alike (prob 1/2 per token: the occurrence at the
    # end has no continuation), drafting min(m, 24 - m) tokens: m = 12 scores most.
    assert long == [(motif[15:] + [0] + motif)[:12]]
    assert speculation_budget(3, 1.5, 1.0, 32) == 5 and speculation_budget(40, 1.0, 0.0, 32) == 32


def test_global_store_is_bounded_oldest_first():
    drafter = SuffixDrafter(max_cached_requests=3, max_cached_tokens=50, max_depth=4)
    outputs = [list(range(i * 10, i * 10 + 12)) for i in range(5)]
    for out in outputs:
        drafter.observe([1], out)
    assert list(drafter.cached) == outputs[2:]
    assert trie_strings(drafter.global_trie) == all_strings(outputs[2:], 4)
    assert drafter.global_trie.num_nodes == stored_nodes(drafter.global_trie)
    for out in [list(range(100, 130)), list(range(200, 230))]:  # 60 tokens > 50: evict
        drafter.observe([1], out)
    assert list(drafter.cached) == [list(range(200, 230))]
    assert drafter.global_trie.num_nodes <= 4 * 30


def test_a_second_identical_request_drafts_from_the_first_output(tiny):
    """With learning, the first request's output sits in the global trie: the same prompt again
    drafts it whole; without learning, only the prompt and output so far are searched."""
    prompt = varied_prompts()[1]  # random tokens: the output does not repeat the prompt
    for learn in (True, False):
        drafter = SuffixDrafter(learn=learn)
        first = spec(tiny, drafter, prompt, 40)
        second = spec(tiny, drafter, prompt, 40)
        assert second.token_ids == first.token_ids == reference_greedy(tiny, prompt, 40)
        if learn:
            assert len(second.steps) < len(first.steps) / 3
            accepted = sum(s.num_accepted for s in second.steps)
            assert accepted >= 30
        else:
            assert len(second.steps) == len(first.steps)


# ---------------------------------------------------------------- lossless through the loop

@pytest.mark.parametrize("options", [dict(), dict(max_tree_nodes=4, min_token_prob=0.0),
                                     dict(tree=False, max_spec_factor=4.0)],
                         ids=["defaults", "small-trees", "path"])
def test_greedy_matches_generate(tiny, options):
    drafter = make_drafter("suffix", **options)  # one drafter across prompts: it learns
    drafted = 0
    for prompt in varied_prompts(12) * 2:  # every prompt twice: the second time from the store
        ref = reference_greedy(tiny, prompt, 40)
        result = spec(tiny, drafter, prompt, 40)
        assert result.token_ids == ref, f"prompt {prompt}"
        drafted += sum(s.num_drafted for s in result.steps)
    assert drafted > 0


def test_default_model_greedy_is_identical_to_generate(default_target, default_references):
    from test_default_model import MAX_NEW, real_prompts

    from dresd.prompts import encode_prompt
    from dresd.runner import GenerationSettings, MethodRunner

    torch.set_num_threads(1)
    prompts = [encode_prompt(default_target.tokenizer, p) for p in real_prompts()[::5]]
    # `ar`'s outputs: test_default_model's references for these prompts (the session's)
    expected = default_references.many(prompts, MAX_NEW)
    suffix = MethodRunner(default_target, "suffix", GenerationSettings(MAX_NEW))
    accepted = 0
    for ids, ref in zip(prompts + prompts[:2], expected + expected[:2], strict=True):
        result = suffix.generate(ids)  # two prompts again: drafted from the global trie
        assert result.token_ids == ref
        accepted += sum(s.num_accepted for s in result.steps)
    assert accepted > 0


# ---------------------------------------------------------------- sampling

@pytest.fixture(scope="module")
def vocab8_model():
    """test_sampling's 8-token model: exact distributions are cheap."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=test_sampling.VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         initializer_range=0.12, eos_token_id=None, bos_token_id=None,
                         pad_token_id=0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float64).eval()


def test_sampling_with_learned_suffix_drafts_keeps_the_model_distribution(vocab8_model):
    """One drafter over all runs, so later runs draft what earlier samples were (the global
    trie): drafts that depend on earlier randomness but not on this run's must leave p(x2) and
    p(x2, x3) exact (chi-square at 1e-3, as test_sampling), and they are often accepted."""
    from dresd.decoding import SamplingConfig, speculative_generate

    config = SamplingConfig(temperature=0.7)
    vocab, runs = test_sampling.VOCAB, 2000
    drafter = SuffixDrafter(min_token_prob=0.0)
    next_counts, pair_counts, accepted = np.zeros(vocab), np.zeros((vocab, vocab)), 0
    for run in range(runs):
        result = speculative_generate(
            vocab8_model, drafter, torch.tensor([test_sampling.PROMPT]), max_new_tokens=3,
            sampling=SamplingConfig(config.temperature, seed=run))
        _, x2, x3 = result.token_ids
        next_counts[x2] += 1
        pair_counts[x2, x3] += 1
        accepted += sum(step.num_accepted for step in result.steps)
    next_probs, pair_probs = test_sampling.exact_distributions(vocab8_model, config)
    assert accepted > runs // 4
    assert test_sampling.goodness_of_fit(next_counts, next_probs) > test_sampling.ALPHA
    assert test_sampling.goodness_of_fit(pair_counts, pair_probs) > test_sampling.ALPHA
    _, other = test_sampling.exact_distributions(vocab8_model, SamplingConfig(0.7 * 1.3))
    assert test_sampling.goodness_of_fit(pair_counts, other) < test_sampling.ALPHA
