"""`dresd build --append`: documents (saved outputs, new corpora) added to an existing datastore,
atomically, equal to a build from scratch where that is defined (the sparse part, the token
stream), found by search with their own keys, and refused when another model made them."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import tiny_model

from dresd.cli.main import main
from dresd.corpus import CorpusError, CorpusSpec, output_row, tokenize_corpus
from dresd.datastore import append, dense
from dresd.datastore.append import append_to_datastore, staging_dir
from dresd.datastore.format import DatastoreError, read_manifest, verify_store
from dresd.datastore.sparse import FILES, SparseIndex
from dresd.datastore.sparse_store import build_sparse_datastore
from dresd.drafters import RestDrafter
from dresd.models.target import Target
from dresd.prompts import encode_prompt
from dresd.runner import GenerationSettings, MethodRunner

torch.set_num_threads(1)
SMALL = dict(pca_dim=8, chunk_tokens=64, sample_min=100, sample_fraction=0.0)


def texts(folder, first: int, count: int) -> CorpusSpec:
    """`count` short numbered texts, each opening differently (distinct contexts)."""
    folder.mkdir()
    for i in range(first, first + count):
        (folder / f"doc{i}.txt").write_text(
            f"Text {i} about {['owls', 'rivers', 'clocks', 'maps', 'salt'][i % 5]}. "
            + " ".join(f"entry {i * 7 + j} holds {j * j + i}" for j in range(6 + i % 4)))
    return CorpusSpec([str(folder)], tree_glob="*.txt")


@pytest.fixture
def corpora(tmp_path) -> tuple[CorpusSpec, CorpusSpec]:
    """(the stored corpus, the one appended)."""
    return texts(tmp_path / "old", 0, 6), texts(tmp_path / "new", 6, 3)


def build(target, spec: CorpusSpec, out, kind: str, index: str = "exact"):
    if kind == "sparse":
        return build_sparse_datastore(target, spec, out, progress=False)
    return dense.build_dense(target, spec, out, dense.DenseBuildConfig(index=index, **SMALL),
                             progress=False, with_sparse=kind == "dense,sparse")


@pytest.mark.parametrize("kind", ["sparse", "dense,sparse"])
def test_appended_sparse_part_equals_a_build_from_scratch(tmp_path, corpora, default_target,
                                                          kind):
    old, new = corpora
    store = build(default_target, old, tmp_path / "store", kind)
    append_to_datastore(default_target, new, store, progress=False)
    union = CorpusSpec([*old.sources, *new.sources], tree_glob="*.txt")
    scratch = build(default_target, union, tmp_path / "scratch", kind)

    grown, fresh = read_manifest(store), read_manifest(scratch)
    verify_store(store, grown, full=True)  # every file as its manifest says
    assert not staging_dir(store).exists()
    assert (grown.num_documents, grown.num_corpus_tokens, grown.settings["sparse"]) == \
        (fresh.num_documents, fresh.num_corpus_tokens, fresh.settings["sparse"])
    assert grown.settings["appends"][0]["documents"] == 3
    assert [c["path"] for c in grown.corpus] == [c["path"] for c in fresh.corpus]
    for name in FILES:  # the same suffix array, byte for byte: the same search results
        assert np.array_equal(np.load(store / "sparse" / name), np.load(scratch / "sparse" / name))
    if kind == "dense,sparse":  # the dense values read the same stream
        for name in (dense.STREAM_FILE, dense.DOC_STARTS_FILE):
            assert np.array_equal(np.load(store / name), np.load(scratch / name))
    index = SparseIndex.open(store / "sparse")
    docs = tokenize_corpus(default_target.tokenizer, union)
    for number in range(len(docs) - 3, len(docs)):  # each appended document is found in it
        assert (number, 0) in index.occurrences(docs[number].ids[:12])


def test_appended_dense_entries_are_found_with_their_own_states(tmp_path, corpora,
                                                                default_target):
    """With an IVF index (new keys join its trained lists); the exact index's keys.npy grows
    in the tests below."""
    old, new = corpora
    store = build(default_target, old, tmp_path / "store", "dense", "ivf")
    before = dense.DenseDatastore(store)
    old_offsets, old_entries = np.array(before.offsets), before.manifest.num_entries
    append_to_datastore(default_target, new, store, progress=False)
    grown = dense.DenseDatastore(store)
    new_docs = tokenize_corpus(default_target.tokenizer, new)
    assert grown.manifest.num_entries == old_entries + sum(d.num_keys for d in new_docs)
    assert np.array_equal(grown.offsets[:old_entries], old_offsets)  # stored entries unchanged
    assert grown.manifest.settings["index"] == "ivf"

    # The state at each position of an appended document finds that position's entry (among
    # the 3 nearest: 8 PCA dimensions leave near-ties between similar contexts), whose value
    # is what followed it in the document.
    doc_start = int(before.doc_starts[-1])
    for number, states in dense.hidden_states(default_target.model, new_docs, 8192):
        doc = new_docs[number]
        for position in range(2, len(doc.ids) - 1, 3):  # 0, 1: "Text", as in every text
            nearest = grown.search(states[position].numpy(), 3)
            own = nearest[grown.offsets[nearest] == doc_start + position]
            assert len(own) == 1, (number, position)
            start, end = grown.value_bounds(own)
            assert grown.stream[start[0] : end[0]].tolist() == \
                doc.ids[position + 1 : position + 1 + grown.value_len]
        doc_start += len(doc.ids)


def test_a_second_identical_request_drafts_from_the_first_output_after_append(
        tmp_path, corpora, default_target, capsys):
    """generate --save-outputs, build --append, then the same prompt again: DReSD and REST
    draft its first output from the datastore (without --learn, in a fresh drafter)."""
    store = build(default_target, corpora[0], tmp_path / "store", "dense,sparse")
    saved = tmp_path / "session.jsonl"
    prompt = "Explain what a prime number is."
    assert main(["generate", "--prompt", prompt, "--max-new-tokens", "40", "--dtype", "float32",
                 "--threads", "1", "--json", "--method", "dresd", "--datastore", str(store),
                 "--max-tree-nodes", "8", "--save-outputs", str(saved)]) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["mean_accepted_length"] < 1.5  # the store knows nothing of prime numbers
    assert main(["build", "--append", "--corpus", str(saved), "--out", str(store),
                 "--quiet"]) == 0
    assert capsys.readouterr().out.strip() == str(store)
    assert read_manifest(store).settings["appends"][0]["documents"] == 1
    assert main(["inspect", str(store)]) == 0
    assert "appended " in capsys.readouterr().out
    settings = GenerationSettings(40)
    for method in ("dresd", "rest"):
        runner = MethodRunner(default_target, method, settings, datastore=str(store),
                              max_tree_nodes=8)
        second = runner.generate(encode_prompt(default_target.tokenizer, prompt))
        assert second.token_ids == first["token_ids"]
        assert len(second.token_ids) / second.num_target_forwards > 3.0


def test_a_crash_mid_append_leaves_the_old_store_intact(tmp_path, corpora, default_target,
                                                        monkeypatch):
    store = build(default_target, corpora[0], tmp_path / "store", "dense,sparse")
    manifest_text = (store / "manifest.json").read_text()

    def crash(*args, **kwargs):
        raise RuntimeError("killed mid-append")

    for step in ("write_sparse_part", "exchange_folders"):  # mid-way; all written but the swap
        monkeypatch.setattr(append, step, crash)
        with pytest.raises(RuntimeError, match="killed"):
            append_to_datastore(default_target, corpora[1], store, progress=False)
        monkeypatch.undo()
        assert (store / "manifest.json").read_text() == manifest_text
        verify_store(store, read_manifest(store), full=True)
        dense.DenseDatastore(store).search(np.ones(576, dtype=np.float32), 3)  # still usable
        RestDrafter(str(store))

    # The next append clears the leftover; where folders cannot be exchanged, two renames.
    monkeypatch.setattr(append, "exchange_folders", lambda a, b: False)
    append_to_datastore(default_target, corpora[1], store, progress=False)
    assert read_manifest(store).num_documents == 9
    verify_store(store, read_manifest(store), full=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new", "old", "store"]


def saved_output(path, target: Target, **made_by) -> CorpusSpec:
    prompt_ids = encode_prompt(target.tokenizer, "Count to three.")
    origin = {"model": "default", "model_fingerprint": "", "tokenizer_fingerprint": "",
              **made_by}
    row = output_row("Count to three.", "one two three", prompt_ids, [505, 827, 1392], origin)
    path.write_text(json.dumps(row) + "\n")
    return CorpusSpec([str(path)])


def test_outputs_of_another_model_or_tokenizer_are_refused(tmp_path, corpora, default_target):
    from dresd.fingerprint import tokenizer_fingerprint

    store = build(default_target, corpora[0], tmp_path / "store", "sparse")
    manifest_text = (store / "manifest.json").read_text()
    ours = {"model_fingerprint": default_target.fingerprint,
            "tokenizer_fingerprint": tokenizer_fingerprint(default_target.tokenizer)}
    for part in ("model", "tokenizer"):
        spec = saved_output(tmp_path / f"{part}.jsonl", default_target,
                            **{**ours, f"{part}_fingerprint": "f" * 64, "model": "other"})
        with pytest.raises(CorpusError, match=f"made by 'other' \\({part} fingerprint ffff"):
            append_to_datastore(default_target, spec, store, progress=False)
    other = Target(tiny_model("llama"), default_target.tokenizer, "tiny-random")
    with pytest.raises(DatastoreError, match="'default'.*'tiny-random'"):
        append_to_datastore(other, corpora[1], store, progress=False)
    assert (store / "manifest.json").read_text() == manifest_text

    # Saved outputs of this model keep their ids, whatever their text would tokenize to.
    spec = saved_output(tmp_path / "ours.jsonl", default_target, **ours)
    append_to_datastore(default_target, spec, store, progress=False)
    ids = encode_prompt(default_target.tokenizer, "Count to three.") + [505, 827]
    assert (6, 0) in SparseIndex.open(store / "sparse").occurrences(ids)  # the 7th document
    with pytest.raises(DatastoreError, match="already in .* store its documents twice"):
        append_to_datastore(default_target, spec, store, progress=False)
