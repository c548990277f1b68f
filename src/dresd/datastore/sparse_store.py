"""The sparse (REST) datastore as a folder: the suffix array of a corpus, with the shared manifest.

    DIR/manifest.json   kind "sparse" (or "dense,sparse" beside a dense store), the model and
                        tokenizer fingerprints, counts, corpus sources, a sha256 per file
    DIR/sparse/         the suffix array's files (see sparse.py)

It is built from the same formatted, tokenised documents as the dense store (corpus.py) and
made atomic and resumable by the shared `AtomicBuild` (format.py). `dresd build --kind
dense,sparse` builds both parts from one pass over the corpus into one folder (dense.py calls
`write_sparse_part`).

Binding: REST reads token ids only, never hidden states, so a sparse store is bound to the
tokenizer that built it: a target with another tokenizer is refused; a target with the same
tokenizer is accepted (REST shares one datastore between the models of a family). The model's
fingerprint is still recorded in the manifest.
"""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np

from dresd.corpus import CorpusSpec, corpus_fingerprint, tokenize_corpus
from dresd.datastore.format import (
    AtomicBuild,
    DatastoreError,
    Manifest,
    check_compatible,
    open_manifest,
)
from dresd.datastore.sparse import FILES, SparseIndex, build_sparse
from dresd.fingerprint import tokenizer_fingerprint
from dresd.models.target import Target

KIND = "sparse"
SPARSE_DIR = "sparse"  # the suffix array's subfolder in a datastore folder


def kinds(manifest: Manifest) -> set[str]:
    """The parts a datastore holds: "dense,sparse" -> {"dense", "sparse"}."""
    return set(manifest.kind.split(","))


def write_sparse_part(token_ids: np.ndarray, doc_starts: np.ndarray,
                      folder: Path) -> tuple[list[str], dict]:
    """Build the suffix array of the documents into `folder/sparse`.

    `token_ids`: the documents one after another; `doc_starts`: [documents + 1] offsets.
    Returns (its file names relative to `folder`, for the manifest; its settings).
    """
    index = build_sparse(token_ids, doc_starts, folder / SPARSE_DIR)
    settings = {
        "num_suffixes": len(index.suffix_array),
        "distinct_ids": len(index.alphabet),
        "symbol_bytes": index.width,
        "suffix_array_dtype": index.suffix_array.dtype.name,
    }
    return [f"{SPARSE_DIR}/{name}" for name in FILES], settings


def build_sparse_datastore(target: Target, spec: CorpusSpec, out: str | Path,
                           progress: bool = True) -> Path:
    """Build a sparse datastore for `target` from the corpus `spec` into `out`; returns `out`.

    The suffix array is one step: a build that dies leaves `out.partial`, and the next build of
    the same plan resumes there by building the suffix array again.
    """
    model, tokenizer = target.model, target.tokenizer
    docs = tokenize_corpus(tokenizer, spec, target.fingerprint)
    fingerprints = {"model": target.name, "model_fingerprint": target.fingerprint,
                    "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer)}
    spec_fields = {k: v for k, v in asdict(spec).items() if k != "sources"}
    plan = {"kind": KIND, **fingerprints, "corpus": corpus_fingerprint(spec),
            "corpus_spec": spec_fields}
    with AtomicBuild(out).start(plan) as build:  # locked until the store is in place
        if build.finished:
            return build.out
        if progress:
            note = " (resuming an unfinished build)" if build.resumed else ""
            print(f"dresd: building the suffix array of {len(docs)} documents{note}",
                  file=sys.stderr)
        lengths = np.array([len(d.ids) for d in docs], dtype=np.int64)
        doc_starts = np.concatenate([[0], np.cumsum(lengths)])
        token_ids = np.concatenate([np.asarray(d.ids, dtype=np.int64) for d in docs])
        files, settings = write_sparse_part(token_ids, doc_starts, build.dir)
        manifest = Manifest(
            kind=KIND, model=target.name, model_fingerprint=fingerprints["model_fingerprint"],
            tokenizer_fingerprint=fingerprints["tokenizer_fingerprint"],
            vocab_size=model.config.vocab_size, num_entries=int(lengths.sum()),
            num_corpus_tokens=int(lengths.sum()), num_documents=len(docs),
            corpus=plan["corpus"], settings={"sparse": settings, "corpus_spec": spec_fields},
        )
        return build.finish(manifest, files)


def open_sparse_datastore(folder: str | Path) -> tuple[SparseIndex, Manifest | None]:
    """The suffix array of a datastore folder and its manifest.

    `folder` is a datastore (manifest + `sparse/`), or a bare suffix-array folder written by
    `sparse.build_sparse` (no manifest: nothing to check a target against).
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"datastore folder {folder} does not exist")
    if not (folder / "manifest.json").is_file() and all((folder / n).is_file() for n in FILES):
        return SparseIndex.open(folder), None
    manifest = open_manifest(folder)
    if KIND not in kinds(manifest):
        raise DatastoreError(f"{folder} is a {manifest.kind} datastore without a sparse part; "
                             "build one with `dresd build --kind sparse` (or dense,sparse)")
    return SparseIndex.open(folder / SPARSE_DIR), manifest


def check_sparse_target(manifest: Manifest | None, target: Target, folder: str | Path) -> None:
    """Refuse a target other than the model and tokenizer the store was built with.

    A suffix array reads only token ids, so a sibling model with the same tokenizer would
    work; we still bind it to its model, as every datastore is (DESIGN.md's invariant): the
    corpus may be the model's own outputs (an "ID" store), and figures must name one model."""
    if manifest is None:
        raise DatastoreError(f"{folder} holds a suffix array without a manifest, so nothing says "
                             "which tokenizer made it; build it with `dresd build --kind sparse`")
    check_compatible(manifest, target)
