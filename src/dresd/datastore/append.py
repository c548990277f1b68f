"""`dresd build --append`: add documents to an existing datastore, atomically.

What is appended is a corpus like any build's: typically the outputs of earlier sessions,
saved with `dresd generate --save-outputs F.jsonl` (what `--learn` keeps in memory, made
permanent), or any new documents. Nothing already stored is recomputed:

- dense part: the new documents are forwarded through the target once and their states keyed
  with the store's own transform. It is not refitted: the stored keys stay valid as they are
  (a refit would mean keying every stored document again), and a few appended documents barely
  move a z-score and PCA fitted on thousands. The keys join the index (exact: `keys.npy` grows;
  ivf, ivfpq: they are added to the trained lists, nlist and nprobe kept; scann: rebuilt from
  `keys.npy`, so only a store built with its keys kept can grow); offsets, the token stream
  and the document bounds grow by the new documents'.
- sparse part: the suffix array is built again over the stored documents followed by the new
  ones, so it is exactly the one a build from scratch over both corpora writes (libdivsufsort:
  seconds for millions of tokens; an incremental merge would save little).
- manifest: counts and corpus sources grow; `settings["appends"]` records each append.

New documents are formatted as the stored ones were (the store's recorded `format`, `keys` and
`max_tokens`); saved outputs keep their exact ids. The target must be the store's model (its
fingerprints are checked against the manifest), and saved outputs must be that model's own.

Atomicity: the grown store is written complete into the sibling folder `DIR.append`
(unchanged files hard-linked, never written through: every changed file is a new file), then
exchanged with `DIR` in one rename (Linux `renameat2(RENAME_EXCHANGE)`), and the old store,
now in `DIR.append`, is deleted. A crash before the exchange leaves `DIR` as it was (the next
append clears the leftover `DIR.append`); after it, `DIR` is the grown store. Where the kernel
or file system cannot exchange, `DIR` is renamed to `DIR.old` and then `DIR.append` to `DIR`:
a crash between these two renames leaves both stores complete, the old one in `DIR.old`.
"""

from __future__ import annotations

import ctypes
import datetime
import errno
import os
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from dresd import __version__
from dresd.corpus import CorpusSpec, TokenizedDocument, corpus_fingerprint, tokenize_corpus
from dresd.datastore import index as key_index
from dresd.datastore.dense import (
    DOC_STARTS_FILE,
    OFFSETS_FILE,
    STATES_FILE,
    STREAM_FILE,
    TRANSFORM_FILE,
    key_states,
    pad_token_id,
)
from dresd.datastore.format import (
    MANIFEST,
    DatastoreError,
    Manifest,
    check_compatible,
    read_manifest,
    save_npy_atomic,
    write_atomic,
)
from dresd.datastore.sparse import SparseIndex
from dresd.datastore.sparse_store import SPARSE_DIR, kinds, write_sparse_part
from dresd.datastore.transform import KeyTransform
from dresd.host import file_sha256
from dresd.models.fastpath import dtype_name
from dresd.models.target import Target


def staging_dir(folder: Path) -> Path:
    """Where an append writes the grown store before it takes `folder`'s place."""
    return folder.with_name(folder.name + ".append")


def append_to_datastore(target: Target, spec: CorpusSpec, folder: str | Path,
                        batch_tokens: int = 8_192, progress: bool = True) -> Path:
    """Add the documents of `spec` to the datastore `folder` (see the module docstring).

    Only `spec`'s reading fields (sources, fields, glob, limit) are used; the formatting ones
    come from the store. Returns `folder`, now holding the old and the new documents.
    """
    folder = Path(folder)
    manifest = read_manifest(folder)
    check_compatible(manifest, target)
    parts = kinds(manifest)
    if "dense" in parts:
        _check_keys_can_grow(folder, manifest)
    sources = corpus_fingerprint(spec)
    _check_not_stored_yet(sources, manifest, folder)
    stored_spec = manifest.settings["corpus_spec"]
    spec = replace(spec, format=stored_spec["format"], keys=stored_spec["keys"],
                   max_tokens=stored_spec["max_tokens"])
    docs = tokenize_corpus(target.tokenizer, spec, manifest.model_fingerprint)

    old_tokens, old_starts = stored_documents(folder, parts)
    new_tokens = np.concatenate([np.asarray(d.ids, dtype=np.int64) for d in docs])
    new_starts = old_starts[-1] + np.cumsum([0] + [len(d.ids) for d in docs])
    tokens = np.concatenate([old_tokens, new_tokens])
    starts = np.concatenate([old_starts, new_starts[1:]])
    if progress:
        print(f"dresd: appending {len(docs)} documents ({len(new_tokens)} tokens) to {folder}",
              file=sys.stderr)

    staging = staging_dir(folder)
    shutil.rmtree(staging, ignore_errors=True)  # a crashed append's leftover, never the store
    staging.mkdir()
    settings = dict(manifest.settings)
    written: list[str] = []  # files of the grown store that are new (the rest are linked)
    added_entries = len(new_tokens)  # a sparse store's entries are its tokens
    if "dense" in parts:
        dense_files, added_entries = _append_dense(target, folder, staging, docs, new_starts,
                                                   tokens, starts, settings, batch_tokens)
        written += dense_files
    if "sparse" in parts:
        sparse_files, settings["sparse"] = write_sparse_part(tokens, starts, staging)
        written += sparse_files
    record = {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
              "corpus": sources, "documents": len(docs),
              "tokens": len(new_tokens), "entries": added_entries,
              "dtype": dtype_name(target.dtype), "dresd": __version__}
    settings["appends"] = [*settings.get("appends", []), record]
    grown = replace(manifest, num_entries=manifest.num_entries + added_entries,
                    num_corpus_tokens=len(tokens), num_documents=len(starts) - 1,
                    corpus=manifest.corpus + record["corpus"], settings=settings,
                    files=_files_of_grown_store(folder, staging, manifest, written))
    write_atomic(staging / MANIFEST, grown.to_json().encode())  # last: the store is complete
    replace_folder(folder, staging)
    return folder


def _check_not_stored_yet(sources: list[dict], manifest: Manifest, folder: Path) -> None:
    """Refuse a source whose bytes the store already holds: its documents would be stored
    twice (a session file appended once already, say)."""
    stored = {entry["sha256"]: entry["source"] for entry in manifest.corpus}
    for entry in sources:
        if entry["sha256"] in stored:
            raise DatastoreError(
                f"{entry['source']} is already in {folder} (the same bytes as "
                f"{stored[entry['sha256']]!r}): appending it again would store its documents "
                "twice. Append each session's outputs once (a new --save-outputs file per "
                "session, or only the rows added since)")


def _check_keys_can_grow(folder: Path, manifest: Manifest) -> None:
    """A ScaNN index is rebuilt from the keys, so they must be stored beside it."""
    if manifest.settings["index"] == "scann" and not (folder / key_index.KEYS_FILE).is_file():
        raise DatastoreError(f"{folder} has a ScaNN index without its keys ({key_index.KEYS_FILE})"
                             ", so new keys cannot join it; build it again with the new corpus")


def stored_documents(folder: Path, parts: set[str]) -> tuple[np.ndarray, np.ndarray]:
    """(token ids of every stored document, one after another; int64 [documents + 1] bounds),
    read from the dense token stream, or from the suffix array's stream in a sparse store."""
    if "dense" in parts:
        return (np.load(folder / STREAM_FILE).astype(np.int64),
                np.load(folder / DOC_STARTS_FILE).astype(np.int64))
    index = SparseIndex.open(folder / SPARSE_DIR)
    symbols = np.asarray(index.symbols).astype(np.int64)
    # Every document is followed by one separator (0): drop them, and the ones before each start.
    tokens = index.to_token_ids(symbols[symbols != 0])
    starts = np.asarray(index.doc_starts, dtype=np.int64) - np.arange(index.num_documents + 1)
    return tokens, starts


def _append_dense(target: Target, folder: Path, staging: Path, docs: list[TokenizedDocument],
                  new_starts: np.ndarray, tokens: np.ndarray, starts: np.ndarray,
                  settings: dict, batch_tokens: int) -> tuple[list[str], int]:
    """Key the new documents with the stored transform; write the grown values and keys into
    `staging`. Returns (the files written, the number of new keys)."""
    transform = KeyTransform.load(folder / TRANSFORM_FILE)
    by_length = sorted(range(len(docs)), key=lambda i: len(docs[i].ids))  # batches pad little
    raw, new_offsets = key_states(target.model, [docs[i] for i in by_length],
                                  new_starts[by_length], batch_tokens,
                                  pad_token_id(target.tokenizer))
    keys = transform.apply(raw).astype(np.float16)
    offsets = np.concatenate([np.load(folder / OFFSETS_FILE), new_offsets])
    offsets_dtype = np.uint32 if len(tokens) < 2**32 else np.int64  # as a build chooses
    save_npy_atomic(staging / OFFSETS_FILE, offsets.astype(offsets_dtype))
    save_npy_atomic(staging / STREAM_FILE, tokens.astype(settings["token_dtype"]))
    save_npy_atomic(staging / DOC_STARTS_FILE, starts)
    return [OFFSETS_FILE, STREAM_FILE, DOC_STARTS_FILE, *grow_index(folder, staging, settings,
                                                                    keys)], len(keys)


def grow_index(folder: Path, staging: Path, settings: dict, keys: np.ndarray) -> list[str]:
    """The stored keys and index with `keys` added, written into `staging`; returns the files."""
    files = []
    if (folder / key_index.KEYS_FILE).is_file():  # exact search, or keys kept beside an index
        old = np.load(folder / key_index.KEYS_FILE, mmap_mode="r")
        grown = np.lib.format.open_memmap(staging / key_index.KEYS_FILE, mode="w+",
                                          dtype=np.float16, shape=(len(old) + len(keys),
                                                                   keys.shape[1]))
        grown[: len(old)] = old
        grown[len(old) :] = keys
        grown.flush()
        files.append(key_index.KEYS_FILE)
    kind = settings["index"]
    if kind in ("ivf", "ivfpq"):  # new keys go to their nearest trained list; no retraining
        import faiss

        index = faiss.read_index(str(folder / key_index.IVF_FILE))
        index.add(np.ascontiguousarray(keys, dtype=np.float32))
        faiss.write_index(index, str(staging / key_index.IVF_FILE))
        files.append(key_index.IVF_FILE)
    elif kind == "scann":
        all_keys = np.load(staging / key_index.KEYS_FILE, mmap_mode="r")
        settings.update(key_index.build_scann(all_keys, staging))
        files += key_index.index_files(kind, staging)
    return files


def _files_of_grown_store(folder: Path, staging: Path, manifest: Manifest,
                          written: list[str]) -> dict[str, dict]:
    """The manifest's file list: checksums of the new files; the unchanged ones hard-linked
    into `staging` (copied where links are not possible), their checksums as recorded."""
    files = {}
    for name in written:
        path = staging / name
        files[name] = {"bytes": path.stat().st_size, "sha256": file_sha256(path)}
    for name, meta in manifest.files.items():
        if name in files or name == STATES_FILE:  # kept states would miss the new entries
            continue
        (staging / name).parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(folder / name, staging / name)
        except OSError:
            shutil.copy2(folder / name, staging / name)
        files[name] = meta
    return files


def replace_folder(folder: Path, grown: Path) -> None:
    """Put the complete folder `grown` in `folder`'s place, then delete the old one."""
    if exchange_folders(folder, grown):
        shutil.rmtree(grown)  # it now holds the old store
        return
    old = folder.with_name(folder.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    os.replace(folder, old)
    os.replace(grown, folder)
    shutil.rmtree(old)


def exchange_folders(a: Path, b: Path) -> bool:
    """Swap the names of folders `a` and `b` in one atomic step (Linux renameat2 with
    RENAME_EXCHANGE); False, with nothing changed, where that is not available."""
    rename_exchange, at_fdcwd = 2, -100
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    error = ctypes.get_errno()
    if error in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # not here: fall back
        return False
    raise OSError(error, os.strerror(error), str(a))
