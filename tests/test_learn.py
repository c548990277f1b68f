"""`--learn`: finished outputs join an in-memory side store searched with the datastore (REST's
token ids; DReSD's keys, from the hidden states the verify passes computed)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import TINY_VOCAB
from corpus_helpers import concat, random_docs
from drafters_for_tests import RandomTreeDrafter
from test_dense import SMALL_BUILD, text_corpus
from test_lossless_greedy import reference_greedy, spec, varied_prompts
from test_rest import brute_force_rest, rest_drafts

from dresd.datastore import dense
from dresd.datastore.sparse import build_sparse
from dresd.drafters import DraftContext, RestDrafter
from dresd.drafters.learned import LearnedSparseStore
from dresd.prompts import encode_prompt
from dresd.runner import GenerationSettings, MethodRunner

torch.set_num_threads(1)


@pytest.mark.parametrize("options", [{}, dict(max_tree_nodes=5, draft_len=4),
                                     dict(max_suffix=4, min_suffix=1, max_tree_nodes=12)])
def test_rest_with_learned_outputs_equals_brute_force_over_both(tmp_path, options):
    """With fewer than k matches in each store, REST over the datastore plus the learned side
    store drafts exactly what REST drafts over one corpus holding both."""
    rng = np.random.default_rng(len(options))
    ids = rng.choice(np.arange(70_000), size=8, replace=False)  # ids > 65,535 too
    docs = random_docs(rng, ids, num_docs=20, max_len=80)
    index = build_sparse(*concat(docs), tmp_path)
    drafter = RestDrafter(index, learn=True, **options)
    outputs = [docs[0][5:40] + rng.choice(ids, 15).tolist(),
               rng.choice(ids[:5], 60).tolist(),  # a subset of the tokens: other alphabet
               rng.choice(np.arange(70_000, 70_010), 30).tolist()]  # tokens the store lacks
    for output in outputs:
        drafter.observe([1, 2], output)
    both = docs + outputs
    nonempty = 0
    for trial in range(80):
        doc = both[rng.integers(len(both))]
        context = rng.choice(ids, 3).tolist() + doc[: int(rng.integers(0, len(doc) + 1))]
        max_len = 100 if trial % 5 else 3
        got = [tuple(d) for d in drafter.propose(DraftContext(np.array(context), torch.zeros(1),
                                                              max_len))]
        capped = {**options, "draft_len": min(options.get("draft_len", 10), max_len)}
        assert got == brute_force_rest(both, context, **capped)
        nonempty += bool(got)
    assert nonempty > 40
    # Without learning, the same drafter options see the datastore only.
    context = outputs[2][:10]
    assert rest_drafts(index, context, **options) == []
    assert drafter.propose(DraftContext(np.array(context), torch.zeros(1), 100)) != []


def test_learned_store_is_bounded_oldest_first():
    store = LearnedSparseStore(max_requests=3, max_tokens=100)
    outputs = [list(range(i * 10, i * 10 + 20)) for i in range(5)]
    for out in outputs:
        store.add(out)
    assert list(store.outputs) == outputs[2:]
    assert store.index.num_tokens == 60 and store.index.num_documents == 3
    store.add(list(range(1000, 1070)))  # 60 + 70 tokens > 100: the oldest two go
    assert list(store.outputs) == [outputs[4], list(range(1000, 1070))]
    assert store.num_tokens == store.index.num_tokens == 90
    assert store.nbytes < 90 * 16  # (w + 4) bytes per token, w = 1 here, plus bookkeeping


def test_a_second_identical_request_drafts_from_the_first_output(tiny, tmp_path):
    """REST over a store that cannot help (unrelated tokens): with --learn the same prompt again
    drafts the first output; without it, nothing."""
    index = build_sparse(*concat([list(range(500, 512)) * 3]), tmp_path)
    prompt = varied_prompts()[1]
    for learn in (True, False):
        drafter = RestDrafter(index, learn=learn, max_tree_nodes=8)
        first = spec(tiny, drafter, prompt, 40)
        second = spec(tiny, drafter, prompt, 40)
        assert second.token_ids == first.token_ids == reference_greedy(tiny, prompt, 40)
        if learn:
            assert sum(s.num_accepted for s in second.steps) >= 30
            assert len(second.steps) < len(first.steps) / 3
        else:
            assert len(second.steps) == len(first.steps)


class RecordingDrafter(RandomTreeDrafter):
    """Random trees (varied accepted runs), and a record of what `observe` is handed."""

    def observe(self, prompt, output, hidden_states=None):
        self.seen = (prompt, output, hidden_states)


def test_the_loop_hands_observe_the_states_that_predicted_each_output_token(tiny):
    """states[j] is the last-layer hidden state that predicted output token j: a plain forward
    over prompt + output gives it at position len(prompt) - 1 + j. Also when an EOS inside an
    accepted run ends the generation mid-step."""
    for i, prompt in enumerate(varied_prompts(8, seed=5)):
        free_run = reference_greedy(tiny, prompt, 30)
        eos = free_run[20] if i % 2 else None
        drafter = RecordingDrafter(TINY_VOCAB, seed=i)
        result = spec(tiny, drafter, prompt, 30, eos=eos)
        seen_prompt, output, states = drafter.seen
        assert seen_prompt == prompt and output == result.token_ids
        with torch.inference_mode():
            full = tiny(torch.tensor([prompt + output]), output_hidden_states=True)
        expected = full.hidden_states[-1][0, len(prompt) - 1 : len(prompt) - 1 + len(output)]
        assert states.shape == expected.shape
        torch.testing.assert_close(states, expected, rtol=1e-9, atol=1e-9)


@pytest.fixture(scope="module")
def unrelated_dense_store(tmp_path_factory, default_target):
    """A dense datastore of short numbered texts: nothing a chat answer would continue."""
    folder = tmp_path_factory.mktemp("dense")
    return dense.build_dense(default_target, text_corpus(folder / "texts"), folder / "store",
                             dense.DenseBuildConfig(pca_dim=8, **SMALL_BUILD), progress=False)


def test_dresd_second_identical_request_drafts_from_the_first_output(default_target,
                                                                     default_references,
                                                                     unrelated_dense_store):
    torch.set_num_threads(1)
    settings = GenerationSettings(40)
    ids = encode_prompt(default_target.tokenizer, "Explain what a prime number is.")
    expected = default_references(ids, 40)  # `ar`'s (test_dense asks for the same)
    per_forward = {}
    for learn in (True, False):
        runner = MethodRunner(default_target, "dresd", settings, learn=learn,
                              datastore=str(unrelated_dense_store))
        first, second = runner.generate(ids), runner.generate(ids)
        assert first.token_ids == second.token_ids == expected
        per_forward[learn] = len(second.token_ids) / second.num_target_forwards
        if learn:
            assert runner.drafter.learned.num_tokens == 2 * len(expected)
    assert per_forward[True] >= 3.0 > 1.5 >= per_forward[False], per_forward


def test_hybrid_learn_reaches_every_source(default_target, unrelated_dense_store):
    """hybrid: by default only its suffix source keeps outputs; --learn adds DReSD's (and
    REST's) side stores; --no-learn keeps nothing."""
    from dresd.drafters import HybridDrafter

    store = str(unrelated_dense_store)
    cost = {1: 1.0, 8: 1.2, 32: 2.0}
    default, learning, forgetting = (HybridDrafter(store, cost=cost, learn=learn)
                                     for learn in (None, True, False))
    assert default.sources["suffix"].learn and default.sources["dresd"].learned is None
    assert learning.sources["suffix"].learn and learning.sources["dresd"].learned is not None
    assert not forgetting.sources["suffix"].learn
    assert forgetting.sources["dresd"].learned is None
    runner = MethodRunner(default_target, "hybrid", GenerationSettings(16), datastore=store,
                          learn=True, cost=cost)
    runner.generate(encode_prompt(default_target.tokenizer, "Name a colour."))
    assert runner.drafter.sources["dresd"].learned.num_tokens == 16
