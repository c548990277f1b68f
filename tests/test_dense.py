"""The dense datastore and the DReSD drafter end to end, on the default model.

An in-distribution corpus (the model's own greedy responses, as `dresd corpus regenerate`
writes them) is built into a datastore; prompting with one of its prompts must then draft
the stored response (long accepted runs) while the output stays plain greedy, token for token.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import tiny_model

from dresd.cli.main import main
from dresd.corpus import CorpusError, CorpusSpec, encode_prompt
from dresd.datastore import dense
from dresd.datastore.format import AtomicBuild, DatastoreError, partial_dir, read_manifest
from dresd.datastore.inspect import describe
from dresd.drafters import DenseDrafter, DraftContext
from dresd.drafters.dense import agreeing_prefixes, unpadded
from dresd.errors import UserError
from dresd.kernels import drafting
from dresd.models.target import Target
from dresd.regenerate import RegenerateConfig, regenerate
from dresd.runner import GenerationSettings, MethodRunner

PROMPTS = [
    "Write a short poem about the sea.",
    "Explain what a prime number is.",
    "List three uses of the Python language.",
]
NEW_TOKENS = 40
SMALL_BUILD = dict(chunk_tokens=64, sample_min=100, sample_fraction=0.0)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def id_corpus(tmp_path_factory, default_target):
    folder = tmp_path_factory.mktemp("corpus")
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    out = folder / "responses.jsonl"
    config = RegenerateConfig(max_new_tokens=NEW_TOKENS, batch_size=len(PROMPTS))
    regenerate(default_target, prompts, out, config, progress=False)
    return out


def build_id_store(folder, target, corpus, index: str):
    return dense.build_dense(target, CorpusSpec([str(corpus)]), folder / index,
                             dense.DenseBuildConfig(pca_dim=16, index=index, **SMALL_BUILD),
                             progress=False)


@pytest.fixture(scope="module")
def datastore(tmp_path_factory, default_target, id_corpus):
    return build_id_store(tmp_path_factory.mktemp("stores"), default_target, id_corpus, "exact")


@pytest.fixture(scope="module")
def ivf_datastore(tmp_path_factory, default_target, id_corpus):
    return build_id_store(tmp_path_factory.mktemp("stores"), default_target, id_corpus, "ivf")


@pytest.fixture(scope="module")
def ivf_sparse_datastore(tmp_path_factory, default_target, id_corpus):
    """An IVF store with a suffix array beside it: hybrid's four sources."""
    return dense.build_dense(default_target, CorpusSpec([str(id_corpus)]),
                             tmp_path_factory.mktemp("stores") / "both",
                             dense.DenseBuildConfig(pca_dim=16, index="ivf", **SMALL_BUILD),
                             progress=False, with_sparse=True)


def test_regenerate_writes_one_response_per_prompt_and_resumes(id_corpus, default_target):
    rows = [json.loads(line) for line in id_corpus.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == PROMPTS
    assert all(r["response"].strip() for r in rows)
    before = id_corpus.read_text()
    regenerate(default_target, id_corpus.with_name("prompts.jsonl"), id_corpus,
               RegenerateConfig(max_new_tokens=NEW_TOKENS), progress=False)
    assert id_corpus.read_text() == before  # all rows done: nothing generated twice


def test_manifest_describes_the_store(datastore, default_target):
    manifest = read_manifest(datastore)
    assert manifest.kind == "dense" and manifest.model == "default"
    assert manifest.num_documents == len(PROMPTS)
    assert manifest.num_entries == manifest.num_corpus_tokens - len(PROMPTS)  # all but the last
    assert manifest.settings["pca_dim"] == 16 and manifest.settings["index"] == "exact"
    figures = describe(datastore, verify=True)
    assert figures["checksums"] == "every file's sha256 verified"
    assert figures["bytes_per_corpus_token_total"] == pytest.approx(
        sum(figures["bytes_per_corpus_token"].values()))
    # No duplicated values: the stream holds each corpus token once (2 bytes, uint16), plus
    # the .npy header.
    stream_bytes = figures["bytes_per_corpus_token"]["token stream (values)"]
    assert stream_bytes * manifest.num_corpus_tokens <= 2 * manifest.num_corpus_tokens + 256


@pytest.mark.parametrize("store", ["datastore", "ivf_datastore"])
def test_first_draft_is_the_stored_continuation(store, request, default_target, id_corpus):
    datastore = request.getfixturevalue(store)
    tokenizer, model = default_target.tokenizer, default_target.model
    response = json.loads(id_corpus.read_text().splitlines()[0])["response"]
    prompt_ids = encode_prompt(tokenizer, PROMPTS[0])
    stored = dense.tokenize_corpus(tokenizer, CorpusSpec([str(id_corpus)]))[0].ids
    continuation = stored[len(prompt_ids) :]
    assert tokenizer.decode(continuation).startswith(response[:20])
    with torch.inference_mode():
        state = model.base_model(input_ids=torch.tensor([prompt_ids])).last_hidden_state[0, -1]
    drafter = DenseDrafter(str(datastore), draft_len=10)
    context = DraftContext(np.array(prompt_ids + continuation[:1]), state, max_draft_len=64)
    drafts = drafter.propose(context)
    assert drafts[0] == continuation[1:11]
    assert len(drafts) <= drafter.num_drafts
    assert all(len(d) <= 10 for d in drafts)
    # For hybrid: every kept neighbour's draft once, with how many neighbours propose it (the
    # nearest one's whole)
    candidates = drafter.candidates(context)
    assert sum(c.neighbours for c in candidates) == len(drafter.neighbour_drafts(context, 10))
    assert continuation[1:11] in [c.tokens for c in candidates]


def test_another_shape_shares_the_opened_store_and_what_it_learned(datastore):
    drafter = DenseDrafter(str(datastore), learn=True)
    variant = drafter.with_options(max_tree_nodes=2, k=20)
    assert variant.store is drafter.store and variant.learned is drafter.learned
    assert (variant.k, variant.max_tree_nodes, drafter.k, drafter.max_tree_nodes) == (
        20, 2, 200, None)


def test_response_only_keys(tmp_path, default_target, id_corpus):
    spec = CorpusSpec([str(id_corpus)], keys="response")
    store = dense.build_dense(default_target, spec, tmp_path / "response",
                              dense.DenseBuildConfig(pca_dim=16, **SMALL_BUILD), progress=False)
    manifest = read_manifest(store)
    prompt_tokens = sum(len(encode_prompt(default_target.tokenizer, p)) for p in PROMPTS)
    # One key per response token: the state before it (the prompt's last position included).
    assert manifest.num_entries == manifest.num_corpus_tokens - prompt_tokens
    offsets = np.load(store / "offsets.npy").astype(np.int64)
    starts = np.load(store / "doc_starts.npy")
    first_prompt = len(encode_prompt(default_target.tokenizer, PROMPTS[0]))
    assert offsets[(offsets >= starts[0]) & (offsets < starts[1])].min() == first_prompt - 1


def test_ivf_store_records_its_search_settings(ivf_datastore):
    settings = read_manifest(ivf_datastore).settings
    assert settings["index"] == "ivf" and not (ivf_datastore / "keys.npy").exists()
    assert 1 <= settings["nprobe"] <= settings["nlist"] and settings["recall_at_10"] >= 0.9


def test_inspect_finds_a_corrupt_file(datastore, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(datastore, copy)
    stream = copy / "stream.npy"
    data = bytearray(stream.read_bytes())
    data[-1] ^= 0xFF
    stream.write_bytes(bytes(data))
    with pytest.raises(DatastoreError, match=r"is damaged: stream\.npy \(sha256 differs"):
        describe(copy, verify=True)


def test_dresd_drafts_the_corpus_and_stays_greedy(datastore, default_target,
                                                 default_references):
    settings = GenerationSettings(max_new_tokens=NEW_TOKENS)
    dresd = MethodRunner(default_target, "dresd", settings, datastore=str(datastore))
    for prompt in PROMPTS[:2]:
        ids = encode_prompt(default_target.tokenizer, prompt)
        result = dresd.generate(ids)
        assert result.token_ids == default_references(ids, NEW_TOKENS)  # `ar`'s, once a session
        tokens_per_forward = len(result.token_ids) / result.num_target_forwards
        assert tokens_per_forward >= 3.0, tokens_per_forward


@pytest.mark.parametrize("max_tree_nodes", [1, 3, 8])
def test_dresd_node_budget_keeps_small_trees_and_stays_greedy(datastore, default_target,
                                                              default_references,
                                                              max_tree_nodes):
    settings = GenerationSettings(max_new_tokens=NEW_TOKENS)
    ids = encode_prompt(default_target.tokenizer, PROMPTS[0])
    expected = default_references(ids, NEW_TOKENS)
    runner = MethodRunner(default_target, "dresd", settings, datastore=str(datastore),
                          max_tree_nodes=max_tree_nodes)
    result = runner.generate(ids)
    assert result.token_ids == expected
    assert max(step.num_drafted for step in result.steps) == max_tree_nodes
    # The stored response continues alike from every neighbour: a chain, long accepted runs.
    assert len(result.token_ids) / result.num_target_forwards >= 1.5


def test_unrelated_prompt_is_still_exact(datastore, default_target, default_references):
    settings = GenerationSettings(max_new_tokens=24)
    ids = encode_prompt(default_target.tokenizer, "Name a colour of the rainbow.")
    expected = default_references(ids, 24)
    got = MethodRunner(default_target, "dresd", settings, datastore=str(datastore)).generate(ids)
    assert got.token_ids == expected


def test_mismatched_model_or_tokenizer_is_refused(datastore, default_target):
    other = Target(tiny_model("llama"), default_target.tokenizer, "tiny-random")
    with pytest.raises(DatastoreError, match=r"'default'.*'tiny-random'"):
        MethodRunner(other, "dresd", GenerationSettings(), datastore=str(datastore))
    from transformers import AutoTokenizer

    from dresd.models.target import default_model_dir

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    tokenizer.add_tokens(["<an_extra_token>"])
    renamed = Target(default_target.model, tokenizer, "default-extra-token")
    with pytest.raises(DatastoreError, match=r"tokenizer of 'default'.*'default-extra-token'"):
        DenseDrafter(str(datastore)).check_target(renamed)


def text_corpus(folder) -> CorpusSpec:
    folder.mkdir()
    for i in range(6):
        (folder / f"doc{i}.txt").write_text(
            f"Document {i}. " + " ".join(f"item {i * 7 + j} is {j * j}" for j in range(8 + i)))
    return CorpusSpec([str(folder)], tree_glob="*.txt")


def test_interrupted_build_leaves_no_store_and_resumes(tmp_path, default_target, monkeypatch):
    spec = text_corpus(tmp_path / "texts")
    config = dense.DenseBuildConfig(pca_dim=8, **SMALL_BUILD)
    out = tmp_path / "store"
    real_mark = AtomicBuild.mark_chunk_done
    marks = []

    def dies_on_third_chunk(self, number):
        if len(marks) == 2:
            raise KeyboardInterrupt
        marks.append(number)
        real_mark(self, number)

    monkeypatch.setattr(AtomicBuild, "mark_chunk_done", dies_on_third_chunk)
    with pytest.raises(KeyboardInterrupt):
        dense.build_dense(default_target, spec, out, config, progress=False)
    assert not out.exists() and partial_dir(out).is_dir()
    monkeypatch.setattr(AtomicBuild, "mark_chunk_done", real_mark)

    # Another plan in the same place is refused, not mixed in.
    with pytest.raises(DatastoreError, match="different plan"):
        dense.build_dense(default_target, spec, out,
                          dense.DenseBuildConfig(pca_dim=4, **SMALL_BUILD), progress=False)

    forwarded = []
    real_states = dense.hidden_states

    def counting(model, docs, *args, **kwargs):
        forwarded.extend(docs)
        yield from real_states(model, docs, *args, **kwargs)

    monkeypatch.setattr(dense, "hidden_states", counting)
    dense.build_dense(default_target, spec, out, config, progress=False)
    assert out.is_dir() and not partial_dir(out).exists()
    num_docs = read_manifest(out).num_documents
    assert 0 < len(forwarded) < num_docs  # finished chunks were not forwarded again

    fresh = dense.build_dense(default_target, spec, tmp_path / "fresh", config, progress=False)
    resumed_keys = np.load(out / "keys.npy")
    assert np.allclose(resumed_keys, np.load(fresh / "keys.npy"), atol=2e-3)
    assert np.array_equal(np.load(out / "offsets.npy"), np.load(fresh / "offsets.npy"))


def test_kept_states_are_the_states_behind_the_keys(tmp_path, default_target):
    """--keep-states: row e of states.npy is the raw state of key e, over fit and other
    chunks alike; the transform maps it to the stored key, and the state is the model's."""
    spec = text_corpus(tmp_path / "texts")
    config = dense.DenseBuildConfig(pca_dim=8, keep_states=True, **SMALL_BUILD)
    out = dense.build_dense(default_target, spec, tmp_path / "store", config, progress=False)
    states = np.load(out / dense.STATES_FILE)
    keys, offsets = np.load(out / "keys.npy"), np.load(out / "offsets.npy")
    assert states.shape == (len(keys), default_target.model.config.hidden_size)
    assert dense.STATES_FILE in read_manifest(out).files
    transform = dense.KeyTransform.load(out / dense.TRANSFORM_FILE)
    assert np.allclose(transform.apply(states), keys, atol=2e-3)
    # The last entry's state, recomputed: a forward over its document's prefix.
    doc_starts, stream = np.load(out / "doc_starts.npy"), np.load(out / "stream.npy")
    position = int(offsets[-1])
    doc = np.searchsorted(doc_starts, position, side="right") - 1
    prefix = torch.tensor(stream[doc_starts[doc] : position + 1].astype(np.int64))[None]
    with torch.inference_mode():
        state = default_target.model.base_model(input_ids=prefix).last_hidden_state[0, -1]
    assert np.allclose(states[-1], state.numpy(), atol=1e-2, rtol=1e-2)
    plain = dense.build_dense(default_target, spec, tmp_path / "plain",
                              dense.DenseBuildConfig(pca_dim=8, **SMALL_BUILD), progress=False)
    assert not (plain / dense.STATES_FILE).exists()


def test_corpus_smaller_than_pca_is_refused(tmp_path, default_target):
    small = tmp_path / "small.txt"
    small.write_text("Just a few words.")
    with pytest.raises(CorpusError, match="needs more"):
        dense.build_dense(default_target, CorpusSpec([str(small)]), tmp_path / "s",
                          progress=False)
    assert not (tmp_path / "s").exists() and not partial_dir(tmp_path / "s").exists()


def test_existing_output_is_not_overwritten(datastore, default_target, id_corpus):
    with pytest.raises(DatastoreError, match="already exists"):
        dense.build_dense(default_target, CorpusSpec([str(id_corpus)]), datastore,
                          progress=False)


def test_cli_generate_json_reports_the_same_figures(datastore, capsys):
    common = ["generate", "--prompt", PROMPTS[1], "--max-new-tokens", "12", "--json"]
    assert main([*common, "--method", "pld"]) == 0
    pld = json.loads(capsys.readouterr().out)
    assert main([*common, "--method", "dresd", "--datastore", str(datastore)]) == 0
    dresd = json.loads(capsys.readouterr().out)
    assert set(dresd) == set(pld) and dresd["method"] == "dresd"
    assert dresd["token_ids"] == pld["token_ids"]  # both lossless


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert main(["generate", "--prompt", "hi", "--method", "dresd"]) == 2
    assert "needs --datastore" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path)]) == 2
    assert "not a datastore" in capsys.readouterr().err


def test_hybrid_drafts_from_the_store_and_stays_greedy(datastore, default_target,
                                                      default_references):
    """Hybrid with a dense store and a cheap verify curve: exact, and DReSD's candidates pay."""
    settings = GenerationSettings(max_new_tokens=NEW_TOKENS)
    flat = {1: 1.0, 16: 1.2, 64: 2.0}
    hybrid = MethodRunner(default_target, "hybrid", settings, datastore=str(datastore), cost=flat)
    assert set(hybrid.drafter.sources) == {"pld", "suffix", "dresd"}  # dense-only: no REST
    for prompt in PROMPTS[:2]:
        ids = encode_prompt(default_target.tokenizer, prompt)
        result = hybrid.generate(ids)
        assert result.token_ids == default_references(ids, NEW_TOKENS)
        assert len(result.token_ids) / result.num_target_forwards >= 2.0


@pytest.mark.skipif(drafting.kernel() is None, reason="no C compiler: numpy reads the store")
@pytest.mark.parametrize("store", ["datastore", "ivf_datastore"])
def test_the_kernel_reads_the_neighbours_drafts_as_numpy_does(store, request, monkeypatch):
    """The drafts the C kernel slices from the store after the search (bonus filter, document
    ends, draft length) and what DReSD makes of them (the paper's shape, a node budget, the
    candidates hybrid takes) equal the numpy path's, on states around the store's own; on an
    IVF store the kernel also searches (FAISS without it)."""
    datastore = request.getfixturevalue(store)
    rng = np.random.default_rng(0)
    shapes = [DenseDrafter(str(datastore), k=50),
              DenseDrafter(str(datastore), k=50, max_tree_nodes=4),
              DenseDrafter(str(datastore), k=200, max_tree_nodes=32, num_drafts=3)]
    with monkeypatch.context() as patch:  # the same shapes, made where no kernel compiles
        patch.setattr(drafting, "kernel", lambda: None)
        without = [drafter.with_options() for drafter in shapes]
    transform = shapes[0].store.transform
    compared = 0
    for trial in range(20):
        state = transform.mean + transform.std * rng.normal(size=len(transform.mean))
        state = torch.tensor(state, dtype=torch.float32)
        ids = shapes[0].store.search(state.numpy(), 50)
        start, _ = shapes[0].store.value_bounds(ids[trial % 5 : trial % 5 + 1])
        bonus = int(shapes[0].store.stream[start[0]])  # a searched entry's next token
        for pair, draft_len in zip(zip(shapes, without, strict=True), (10, 3, 1), strict=True):
            context = DraftContext(np.array([1, 2, bonus]), state, draft_len)
            outputs = []
            for drafter, kernel in zip(pair, (drafting.kernel, lambda: None), strict=True):
                with monkeypatch.context() as patch:
                    patch.setattr(drafting, "kernel", kernel)
                    outputs.append((drafter.neighbour_drafts(context, draft_len),
                                    drafter.propose(context), drafter.candidates(context)))
            assert outputs[0] == outputs[1]
            compared += len(outputs[0][0])
    assert compared > 100


@pytest.mark.skipif(drafting.kernel() is None, reason="no C compiler")
def test_dresds_query_in_one_call_is_its_three_calls(ivf_datastore):
    """Key, IVF search and drafts in one kernel call (`dense_neighbour_rows`) give the rows
    that the three calls give one after the other, from bf16 and float32 states; with the
    agreeing prefixes too (`dense_candidates`), the candidates of those rows."""
    drafter = DenseDrafter(str(ivf_datastore), k=50)
    assert drafter._query_in_c is not None  # an IVF store with fp16 codes: one call
    store, rng = drafter.store, np.random.default_rng(0)
    transform = store.transform
    compared = 0
    for trial in range(30):
        state = transform.mean + transform.std * rng.normal(size=len(transform.mean))
        state = torch.tensor(state, dtype=torch.bfloat16 if trial % 2 else torch.float32)
        _, ids = store.index.search(transform.key(state)[None, :], 50)
        start, _ = store.value_bounds(ids[0][trial % 5 : trial % 5 + 1])
        bonus = int(store.stream[start[0]])  # a searched entry's next token
        draft_len = 1 + trial % 10
        expected = drafting.dense_drafts(ids[0], drafter._store_in_c, bonus, draft_len)
        rows = drafting.dense_neighbour_rows(drafter._query_in_c, state, 50, bonus, draft_len)
        assert np.array_equal(rows, expected)
        assert (drafting.dense_candidates(drafter._query_in_c, state, 50, bonus, draft_len)
                == drafting.agreeing_prefixes(expected))
        compared += len(rows)
    assert compared >= 60


def test_a_requests_own_hybrid_shares_the_opened_stores_and_what_is_learned(
        ivf_sparse_datastore, default_target, default_references):
    """A request's own draft length (`with_options`, as the server asks it): the opened stores,
    the acceptance table and the ledger the server's drafter has (it opened every store again
    and learned apart), sources reshaped, the one-call step planned for them; AR's outputs."""
    settings = GenerationSettings(max_new_tokens=NEW_TOKENS)
    flat = {1: 1.0, 16: 1.2, 64: 2.0}
    base = MethodRunner(default_target, "hybrid", settings, datastore=str(ivf_sparse_datastore),
                        cost=flat).drafter
    variant = base.with_options(draft_len=4)
    assert variant.table is base.table and variant.ledger is base.ledger
    assert variant.sources["rest"].index is base.sources["rest"].index
    assert variant.sources["dresd"].store is base.sources["dresd"].store
    assert [variant.sources[name].draft_len for name in ("pld", "rest", "dresd")] == [4] * 3
    assert base.sources["pld"].draft_len == base.draft_len == 10
    assert (variant._step_plan is None) == (base._step_plan is None)
    with pytest.raises(UserError, match=">= 1"):
        base.with_options(max_tree_nodes=0)
    runner = MethodRunner(default_target, "hybrid", settings, datastore=str(ivf_sparse_datastore),
                          cost=flat)
    runner.drafter = variant
    for prompt in PROMPTS[:2]:
        ids = encode_prompt(default_target.tokenizer, prompt)
        assert runner.generate(ids).token_ids == default_references(ids, NEW_TOKENS)


@pytest.mark.skipif(drafting.kernel() is None, reason="no C compiler")
def test_hybrids_step_in_one_call_is_its_sources_one_by_one(ivf_sparse_datastore,
                                                            default_target, default_references):
    """Hybrid's step as one kernel call (PLD, suffix, REST and DReSD looked up in C, then
    learn, merge and cut) drafts at every step of real generations what it drafts asking its
    sources one by one, the suffix drafter's trie of earlier outputs included (from the second
    prompt on), and learns the same acceptance counts; the outputs are AR's."""
    settings = GenerationSettings(max_new_tokens=64)
    flat = {1: 1.0, 16: 1.2, 64: 2.0}
    runner = MethodRunner(default_target, "hybrid", settings, datastore=str(ivf_sparse_datastore),
                          cost=flat)
    fused = runner.drafter
    apart = MethodRunner(default_target, "hybrid", settings,
                         datastore=str(ivf_sparse_datastore), cost=flat).drafter
    assert set(fused.sources) == {"pld", "suffix", "rest", "dresd"}
    assert fused._step_plan is not None
    apart._step_plan = None  # a source at a time
    for drafter in (fused, apart):
        drafter.skip_sources = False  # the kernel's clock is not the drafter's: no verdicts
    steps, global_steps = 0, 0

    def propose(context, propose=fused.propose):
        nonlocal steps, global_steps
        drafts = propose(context)
        assert drafts == apart.propose(context)
        steps += 1
        global_steps += bool(fused.sources["suffix"].cached)
        return drafts

    def observe(prompt, output, hidden_states=None, observe=fused.observe):
        observe(prompt, output, hidden_states)
        apart.observe(prompt, output, hidden_states)

    fused.propose, fused.observe = propose, observe
    for prompt in PROMPTS:
        ids = encode_prompt(default_target.tokenizer, prompt)
        assert runner.generate(ids).token_ids == default_references(ids, 64)
    assert steps >= 40 and global_steps >= 20
    assert isinstance(fused.last.tree, drafting.HybridTree)
    assert fused.table.counts == apart.table.counts


@pytest.mark.skipif(drafting.kernel() is None, reason="no C compiler")
def test_agreeing_prefixes_in_c_are_the_pythons():
    """On random padded rows over a small vocabulary (repeats, shared prefixes, empty drafts):
    the same candidates, counts and order as `agreeing_prefixes` on the unpadded drafts."""
    rng = np.random.default_rng(0)
    for trial in range(300):
        width = int(rng.integers(1, 6))
        lengths = rng.integers(0, width + 1, int(rng.integers(0, 30)))
        rows = np.zeros((len(lengths), width), dtype=np.int32)
        for row, length in zip(rows, lengths, strict=True):
            row[:length] = rng.integers(1, 2 + trial % 4, length)
        expected = list(agreeing_prefixes(unpadded(rows)).items())
        got = drafting.agreeing_prefixes(rows.copy())
        assert [(tuple(draft), count) for draft, count in got] == expected
