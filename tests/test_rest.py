"""REST against an independent brute-force REST, and lossless through the engine."""

from __future__ import annotations

import functools
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TINY_VOCAB, tiny_model
from corpus_helpers import SEP, concat, random_docs

from dresd.datastore.sparse import build_sparse
from dresd.decoding import speculative_generate
from dresd.drafters import DraftContext, RestDrafter, make_drafter
from dresd.drafters.prefixes import prefix_tree_drafts
from dresd.kernels import drafting
from dresd.models.target import default_model_dir

torch.set_num_threads(1)


def brute_force_rest(docs: list[list[int]], context: list[int], max_suffix=16, min_suffix=2,
                     max_matches=5000, draft_len=10, max_tree_nodes=64) -> list[tuple[int, ...]]:
    """REST written plainly: scan every corpus position, no suffix array.

    The longest suffix of the context (max_suffix down to min_suffix tokens) that occurs in a
    document with at least one token after it wins. If it occurs more than `max_matches` times,
    the occurrences whose corpus suffix (the rest of the stream, documents joined by SEP) is
    smallest are taken. Every prefix of every continuation is counted; prefixes are ranked by
    (count desc, length asc, tokens asc); the first `max_tree_nodes` are kept; the kept prefixes
    that no kept prefix extends are returned, in rank order.
    """
    stream, starts = [], []
    for doc in docs:
        starts.append(len(stream))
        stream += [*doc, SEP]
    for n in range(min(max_suffix, len(context)), min_suffix - 1, -1):
        query = context[-n:]
        matches = [(d, i) for d, doc in enumerate(docs) for i in range(len(doc) - n)
                   if doc[i : i + n] == query]
        if matches:
            break
    else:
        return []

    if len(matches) > max_matches:
        def compare_suffixes(a: tuple[int, int], b: tuple[int, int]) -> int:
            i, j = starts[a[0]] + a[1], starts[b[0]] + b[1]
            while stream[i : i + 64] == stream[j : j + 64]:  # suffixes are distinct: this ends
                i, j = i + 64, j + 64
            return -1 if stream[i : i + 64] < stream[j : j + 64] else 1
        matches = sorted(matches, key=functools.cmp_to_key(compare_suffixes))[:max_matches]

    return brute_force_top_prefixes([docs[d][i + n : i + n + draft_len] for d, i in matches],
                                    max_tree_nodes)


def brute_force_top_prefixes(continuations: list[list[int]], max_nodes: int
                             ) -> list[tuple[int, ...]]:
    """Count every prefix of every continuation; rank by (count desc, length asc, tokens asc);
    keep the first `max_nodes`; return the kept prefixes no kept prefix extends, in rank order."""
    counts: dict[tuple[int, ...], int] = {}
    for continuation in continuations:
        for length in range(1, len(continuation) + 1):
            prefix = tuple(continuation[:length])
            counts[prefix] = counts.get(prefix, 0) + 1
    ranked = sorted(counts, key=lambda p: (-counts[p], len(p), p))
    kept = ranked[:max_nodes]
    extended = {p[:-1] for p in kept}
    return [p for p in kept if p not in extended]


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("ranking", ["C kernel", "numpy"])
def test_prefix_tree_drafts_equal_brute_force(seed, ranking, monkeypatch):
    """Any token ids (0 included), repeats and empty rows, every node budget."""
    if ranking == "numpy":
        monkeypatch.setattr(drafting, "kernel", lambda: None)
    elif drafting.kernel() is None:
        pytest.skip("no C compiler: numpy ranks")
    rng = np.random.default_rng(seed)
    vocab = int(rng.integers(2, 6))  # few tokens: many shared prefixes and ties
    continuations = [rng.integers(vocab, size=int(rng.integers(0, 7))).tolist()
                     for _ in range(int(rng.integers(1, 30)))]
    for max_nodes in (1, 2, 3, 5, 8, 64):
        got = [tuple(d) for d in prefix_tree_drafts(continuations, max_nodes)]
        assert got == brute_force_top_prefixes(continuations, max_nodes), max_nodes
        assert len(tree_nodes(got)) <= max_nodes


def rest_drafts(index, context: list[int], max_draft_len: int = 100, **options):
    drafter = RestDrafter(index, **options)
    context_ids = np.array(context, dtype=np.int64)
    drafts = drafter.propose(DraftContext(context_ids, torch.zeros(1), max_draft_len))
    return [tuple(d) for d in drafts]


def tree_nodes(drafts: list[tuple[int, ...]]) -> set[tuple[int, ...]]:
    return {d[:k] for d in drafts for k in range(1, len(d) + 1)}


OPTION_SETS = [
    {},  # REST's defaults
    dict(max_matches=3, max_tree_nodes=5, draft_len=4),  # cut-offs and ties at every step
    dict(max_suffix=4, min_suffix=1, max_matches=20, max_tree_nodes=12),
]


@pytest.mark.parametrize("options", OPTION_SETS)
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("lookup", ["C kernel", "numpy"])
def test_rest_equals_brute_force_on_random_streams(tmp_path, seed, options, lookup,
                                                    monkeypatch):
    if lookup == "numpy":
        monkeypatch.setattr(drafting, "kernel", lambda: None)
    elif drafting.kernel() is None:
        pytest.skip("no C compiler: numpy looks up")
    rng = np.random.default_rng(seed)
    ids = rng.choice(np.arange(100_000), size=6 + 4 * seed, replace=False)  # ids > 65,535 too
    docs = random_docs(rng, ids, num_docs=30, max_len=150)
    # Repeated passages, so that long suffixes match and continuations agree for a while.
    docs += [docs[0][10:60] + rng.choice(ids, 20).tolist() for _ in range(5)]
    index = build_sparse(*concat(docs), tmp_path)
    nonempty = 0
    for trial in range(60):
        doc = docs[rng.integers(len(docs))]
        cut = int(rng.integers(0, len(doc) + 1))
        context = rng.choice(ids, size=int(rng.integers(1, 5))).tolist() + doc[:cut]
        if trial % 4 == 0:
            context = rng.choice(ids, size=int(rng.integers(1, 30))).tolist()
        max_draft_len = 100 if trial % 5 else 3  # the engine's cap near max_new_tokens
        drafts = rest_drafts(index, context, max_draft_len, **options)
        capped = {**options, "draft_len": min(options.get("draft_len", 10), max_draft_len)}
        expected = brute_force_rest(docs, context, **capped)
        assert drafts == expected
        assert len(tree_nodes(drafts)) <= options.get("max_tree_nodes", 64)
        nonempty += bool(drafts)
    assert nonempty > 30


def stdlib_documents(tokenizer, names: list[str]) -> list[list[int]]:
    folder = Path(sysconfig.get_paths()["stdlib"])
    return [tokenizer(folder.joinpath(name).read_text(encoding="utf-8"))["input_ids"]
            for name in names]


@pytest.fixture(scope="module")
def default_tokenizer():
    from transformers import AutoTokenizer

    if not (default_model_dir() / "config.json").exists():
        pytest.skip("the default model is not cached (run `dresd fetch-model`)")
    return AutoTokenizer.from_pretrained(default_model_dir())


@pytest.mark.parametrize("options", [{}, dict(max_matches=40, max_tree_nodes=16)])
def test_rest_equals_brute_force_on_python_sources(tmp_path, default_tokenizer, options):
    """The default model's tokenizer over a few stdlib modules; contexts from other modules."""
    docs = stdlib_documents(default_tokenizer, ["textwrap.py", "bisect.py", "heapq.py",
                                                "shlex.py", "fnmatch.py"])
    held_out = stdlib_documents(default_tokenizer, ["glob.py", "keyword.py"])
    index = build_sparse(*concat(docs), tmp_path)
    rng = np.random.default_rng(0)
    sizes = []
    for _ in range(25):
        source = held_out[rng.integers(len(held_out))] if rng.random() < 0.6 else docs[0]
        cut = int(rng.integers(2, len(source)))
        context = source[:cut]
        drafts = rest_drafts(index, context, **options)
        assert drafts == brute_force_rest(docs, context, **options)
        sizes.append(len(tree_nodes(drafts)))
    assert max(sizes) > 10  # real trees, not just single tokens


def test_no_drafts_without_a_match(tmp_path):
    index = build_sparse(*concat([[1, 2, 3, 4]]), tmp_path)
    assert rest_drafts(index, [9, 1]) == []  # 9 is not in the corpus; [1] is too short
    assert rest_drafts(index, [3, 4]) == []  # matches only at the document's end
    assert rest_drafts(index, [1, 2]) == [(3, 4)]
    assert rest_drafts(index, [1, 2], max_draft_len=0) == []


def test_make_drafter_opens_a_folder(tmp_path):
    build_sparse(*concat([[1, 2, 3, 4]]), tmp_path / "store")
    drafter = make_drafter("rest", datastore=str(tmp_path / "store"), draft_len=1)
    assert drafter.propose(DraftContext(np.array([1, 2]), torch.zeros(1), 10)) == [[3]]
    with pytest.raises(ValueError, match="datastore"):
        make_drafter("rest")
    with pytest.raises(FileNotFoundError):
        make_drafter("rest", datastore=tmp_path / "nowhere")


def test_another_shape_shares_the_opened_index(tmp_path):
    build_sparse(*concat([[1, 2, 3, 4]]), tmp_path / "store")
    drafter = make_drafter("rest", datastore=str(tmp_path / "store"), learn=True)
    variant = drafter.with_options(draft_len=1)
    assert variant.index is drafter.index and variant.learned is not drafter.learned
    assert variant.propose(DraftContext(np.array([1, 2]), torch.zeros(1), 10)) == [[3]]
    assert drafter.propose(DraftContext(np.array([1, 2]), torch.zeros(1), 10)) == [[3, 4]]


# ---- lossless through the engine ----

@torch.inference_mode()
def greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_lossless_on_a_tiny_model(tmp_path, arch):
    model = tiny_model(arch)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, TINY_VOCAB, size=int(rng.integers(3, 12))).tolist()
               for _ in range(4)]
    # The datastore: the model's own continuations of two prompts (so drafts get accepted,
    # REST's "in-domain" case) and random documents (so they also get rejected).
    docs = [p + greedy(model, p, 40) for p in prompts[:2]]
    docs += random_docs(rng, np.arange(TINY_VOCAB), num_docs=20, max_len=200)
    drafter = RestDrafter(build_sparse(*concat(docs), tmp_path))
    accepted = 0
    for prompt in prompts:
        result = speculative_generate(model, drafter, torch.tensor([prompt]), max_new_tokens=30)
        assert result.token_ids == greedy(model, prompt, 30)
        accepted += sum(step.num_accepted for step in result.steps)
    assert accepted > 20


def test_lossless_on_the_default_model(tmp_path, default_target):
    from dresd.prompts import encode_prompt

    tokenizer = default_target.tokenizer
    texts = ["Write a Python function that returns the n-th Fibonacci number.",
             "Explain what a suffix array is in two sentences.",
             "List three uses of the heapq module."]
    prompts = [encode_prompt(tokenizer, text, True) for text in texts]
    answers = [greedy(default_target.model, p, 40) for p in prompts]  # transformers' generate
    # In-domain for the first two prompts: their greedy answers; Python sources for the rest.
    docs = [p + answer for p, answer in zip(prompts[:2], answers, strict=False)]
    docs += stdlib_documents(tokenizer, ["heapq.py", "bisect.py"])
    drafter = RestDrafter(build_sparse(*concat(docs), tmp_path))
    accepted = 0
    for prompt, answer in zip(prompts, answers, strict=True):
        result = speculative_generate(default_target.model, drafter, torch.tensor([prompt]),
                                      max_new_tokens=40,
                                      eos_token_ids=default_target.eos_token_ids)
        assert result.token_ids == answer
        accepted += sum(step.num_accepted for step in result.steps)
    assert accepted > 20
