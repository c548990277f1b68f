"""The sparse datastore folder: `dresd build --kind sparse` / `dense,sparse`, `dresd inspect`, the
tokenizer check, atomic and resumable builds."""

from __future__ import annotations

import json
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from dresd.cli.main import main
from dresd.corpus import CorpusSpec, tokenize_corpus
from dresd.datastore import sparse_store
from dresd.datastore.dense import DenseBuildConfig, DenseDatastore, build_dense
from dresd.datastore.format import DatastoreError, partial_dir, read_manifest, verify_store
from dresd.datastore.inspect import describe, format_description
from dresd.datastore.sparse import build_sparse
from dresd.datastore.sparse_store import build_sparse_datastore
from dresd.drafters import RestDrafter
from dresd.models.target import Target, default_model_dir
from dresd.runner import GenerationSettings, MethodRunner

torch.set_num_threads(1)


def copy_modules(folder: Path, names: list[str]) -> Path:
    folder.mkdir()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in names:
        shutil.copy(stdlib / name, folder / name)
    return folder


@pytest.fixture
def source_tree(tmp_path) -> Path:
    """A few standard-library modules, copied: a small source-tree corpus."""
    return copy_modules(tmp_path / "corpus", ["bisect.py", "heapq.py", "keyword.py"])


def stored_documents(index) -> list[list[int]]:
    """The documents of a suffix-array index, read back as token ids."""
    starts = index.doc_starts
    return [index.to_token_ids(index.symbols[starts[d] : starts[d + 1] - 1]).tolist()
            for d in range(index.num_documents)]


def test_sparse_build_holds_the_corpus_documents(tmp_path, source_tree, default_target):
    spec = CorpusSpec(sources=[str(source_tree)], max_tokens=512)
    out = build_sparse_datastore(default_target, spec, tmp_path / "store", progress=False)
    assert not partial_dir(out).exists()
    manifest = read_manifest(out)
    assert manifest.kind == "sparse"
    verify_store(out, manifest, full=True)  # raises if a file does not match
    assert sorted(manifest.files) == [f"sparse/{n}" for n in sorted(sparse_store.FILES)]

    drafter = RestDrafter(str(out))
    expected = [doc.ids for doc in tokenize_corpus(default_target.tokenizer, spec)]
    assert stored_documents(drafter.index) == expected  # the dense build's documents
    assert manifest.num_corpus_tokens == sum(len(d) for d in expected)

    figures = describe(out, verify=True)
    assert figures["checksums"] == "every file's sha256 verified"
    assert figures["bytes_per_corpus_token"]["sparse: suffix array"] == pytest.approx(
        4 * (manifest.num_corpus_tokens + manifest.num_documents) / manifest.num_corpus_tokens,
        rel=0.01)
    text = format_description(figures)
    suffixes = manifest.num_corpus_tokens + manifest.num_documents
    assert f"sparse: suffix array (int32) of {suffixes:,} suffixes" in text


def other_tokenizer_target(default_target) -> Target:
    """The default model with a tokenizer that has one more token: other token ids."""
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    tokenizer.add_tokens(["<not-in-the-store>"])
    return Target(model=default_target.model, tokenizer=tokenizer, name="other-tokenizer")


def test_target_with_another_tokenizer_is_refused(tmp_path, source_tree, default_target):
    spec = CorpusSpec(sources=[str(source_tree)])
    out = build_sparse_datastore(default_target, spec, tmp_path / "store", progress=False)
    settings = GenerationSettings(max_new_tokens=4)
    MethodRunner(default_target, "rest", settings, datastore=str(out))  # same tokenizer: fine
    with pytest.raises(DatastoreError, match="another tokenizer"):
        MethodRunner(other_tokenizer_target(default_target), "rest", settings, datastore=str(out))
    variant = RestDrafter(str(out)).with_options(draft_len=2)  # a server request's own shape
    variant.check_target(default_target)
    with pytest.raises(DatastoreError, match="another tokenizer"):
        variant.check_target(other_tokenizer_target(default_target))


def test_another_model_with_the_same_tokenizer_is_refused(tmp_path, source_tree,
                                                          default_target):
    spec = CorpusSpec(sources=[str(source_tree)])
    out = build_sparse_datastore(default_target, spec, tmp_path / "store", progress=False)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(default_target.tokenizer), hidden_size=64,
                         intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2)
    sibling = Target(model=AutoModelForCausalLM.from_config(config).eval(),
                     tokenizer=default_target.tokenizer, name="tiny-sibling")
    with pytest.raises(DatastoreError, match="built with model .* but the target is 'tiny-sib"):
        MethodRunner(sibling, "rest", GenerationSettings(), datastore=str(out))


def test_bare_suffix_array_cannot_be_checked(tmp_path, default_target):
    build_sparse(np.array([1, 2, 3]), np.array([0, 3]), tmp_path / "bare")
    with pytest.raises(DatastoreError, match="without a manifest"):
        MethodRunner(default_target, "rest", GenerationSettings(), datastore=str(tmp_path / "bare"))


def test_failed_build_leaves_no_store_and_resumes(tmp_path, source_tree, default_target,
                                                   monkeypatch):
    spec = CorpusSpec(sources=[str(source_tree)])
    out = tmp_path / "store"

    def dies(*args, **kwargs):
        raise RuntimeError("killed mid-build")

    monkeypatch.setattr(sparse_store, "write_sparse_part", dies)
    with pytest.raises(RuntimeError):
        build_sparse_datastore(default_target, spec, out, progress=False)
    assert not out.exists() and partial_dir(out).exists()
    monkeypatch.undo()
    build_sparse_datastore(default_target, spec, out, progress=False)  # the same plan: resumes
    assert out.exists() and not partial_dir(out).exists()
    verify_store(out, read_manifest(out), full=True)


def test_dense_and_sparse_from_one_pass(tmp_path, default_target):
    # Small, so that the dense build's forward stays quick on a CPU.
    tree = copy_modules(tmp_path / "corpus", ["keyword.py", "this.py"])
    spec = CorpusSpec(sources=[str(tree)], max_tokens=256)
    out = build_dense(default_target, spec, tmp_path / "both",
                      DenseBuildConfig(pca_dim=8, index="exact"), progress=False, with_sparse=True)
    manifest = read_manifest(out)
    assert manifest.kind == "dense,sparse"
    verify_store(out, manifest, full=True)  # raises if a file does not match
    dense = DenseDatastore(out)
    sparse = RestDrafter(str(out)).index
    # The two parts index the same documents: the dense token stream, cut at its bounds.
    dense_docs = [dense.stream[a:b].tolist() for a, b in zip(dense.doc_starts[:-1],
                                                              dense.doc_starts[1:], strict=True)]
    assert stored_documents(sparse) == dense_docs
    text = format_description(describe(out))
    assert "keys: 8 dims" in text and "sparse: suffix array" in text
    with pytest.raises(DatastoreError, match="without a sparse part"):
        dense_only = build_dense(default_target, spec, tmp_path / "dense",
                                 DenseBuildConfig(pca_dim=8, index="exact"), progress=False)
        RestDrafter(str(dense_only))


def test_cli_build_inspect_generate(tmp_path, source_tree, default_target, capsys):
    out = tmp_path / "store"
    assert main(["build", "--kind", "sparse", "--corpus", str(source_tree), "--out", str(out),
                 "--quiet"]) == 0
    assert main(["inspect", str(out), "--json"]) == 0
    figures = json.loads(capsys.readouterr().out.split("\n", 1)[1])  # after the path line
    assert figures["kind"] == "sparse" and figures["settings"]["sparse"]["symbol_bytes"] == 2
    common = ["generate", "--prompt", "Import the heapq module.", "--max-new-tokens", "12",
              "--json"]
    assert main([*common, "--method", "rest", "--datastore", str(out),
                 "--max-tree-nodes", "8"]) == 0
    rest = json.loads(capsys.readouterr().out)
    assert 0 < rest["drafted_tokens_per_step"] <= 8  # the option reached the drafter
    assert main([*common, "--method", "ar"]) == 0
    ar = json.loads(capsys.readouterr().out)
    assert rest["token_ids"] == ar["token_ids"]
    assert main(["generate", "--prompt", "hi", "--method", "rest"]) == 2
    assert "needs --datastore" in capsys.readouterr().err
