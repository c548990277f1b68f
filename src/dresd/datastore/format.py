"""The on-disk shape every datastore shares: a folder with a manifest, built atomically.

    DIR/manifest.json     kind, model and tokenizer fingerprints, dims, counts, corpus sources,
                          versions, and a sha256 per data file
    DIR/...               the kind's own files (dense: keys/index, values, transform)

A datastore appears complete or not at all: it is built in the sibling folder `DIR.partial`,
which is renamed to `DIR` only once every file and the manifest are written. A build that dies
leaves `DIR.partial` behind with the chunks it finished (`chunks/NNNNN.done` markers and their
files); the next build of the same plan resumes from there.

Only one build writes a partial folder at a time: `AtomicBuild.start` takes an exclusive
`flock` on the folder itself (the lock moves with it when it is renamed, and the kernel drops
it when the process dies, even by `kill -9`, so there is never a stale lock to clean up).
Every file is flushed to disk (`fsync`) before it is renamed into place or marked done, so a
marker or a manifest never points at data still in flight.

A datastore is bound to the model and tokenizer that built it: `check_compatible` compares
their fingerprints with the target's and refuses a mismatch with a message naming both.

A datastore is checked when it is opened (`verify_store`): the manifest's own checksum, then
every data file's presence, size and (for `.npy` files) header, and the sha256 of the files
that fit in `OPEN_HASH_BUDGET` bytes, smallest first. Stores up to that size (every store this
project builds by default) are hashed whole (about 1.7 GB/s); in bigger ones the large
memory-mapped files are not read whole at open, and `dresd inspect --verify` hashes them all.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import io
import json
import os
import platform
import shutil
import zipfile
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from dresd.errors import DresdError
from dresd.fingerprint import tokenizer_fingerprint
from dresd.host import file_sha256
from dresd.models.target import Target

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
PLAN = "plan.json"  # in the partial folder: what is being built, to check a resume is the same
# Files hashed at open, smallest first, until this many bytes (about 0.15 s at 1.7 GB/s);
# larger files get the size and header checks only (see `verify_store`).
OPEN_HASH_BUDGET = 256 << 20


class DatastoreError(DresdError, ValueError):
    """A datastore that is missing, incomplete, corrupt or built for another model."""


@dataclass
class Manifest:
    """What a datastore holds and what built it; written last, as `manifest.json`."""

    kind: str  # "dense" (DReSD) or "sparse" (REST)
    model: str  # the model name the build was given
    model_fingerprint: str  # `Target.fingerprint` of the model that built it
    tokenizer_fingerprint: str  # `tokenizer_fingerprint(tokenizer)`
    vocab_size: int
    num_entries: int  # keys (dense) / indexed positions (sparse)
    num_corpus_tokens: int  # tokens of the corpus as stored (all documents, all positions)
    num_documents: int
    corpus: list[dict]  # per source: path, bytes, files, sha256 (corpus.corpus_fingerprint)
    settings: dict[str, Any]  # the kind's build settings (dims, value length, index ...)
    files: dict[str, dict] = field(default_factory=dict)  # name -> {"bytes", "sha256"}
    versions: dict[str, str] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    # sha256 of the build plan (AtomicBuild): a build killed between writing this manifest
    # and renaming its folder is recognised as finished by a rerun of the same plan.
    build_plan: str = ""
    # sha256 of the manifest's other fields (`content_sha256`), so that a flipped digit in a
    # count or a setting is caught too; "" in stores written before it existed.
    checksum: str = ""

    def content_sha256(self) -> str:
        fields = {k: v for k, v in asdict(self).items() if k != "checksum"}
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()

    def to_json(self) -> str:
        self.checksum = self.content_sha256()
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        return cls(**json.loads(text))


def software_versions() -> dict[str, str]:
    import transformers

    from dresd import __version__ as dresd_version

    versions = {"dresd": dresd_version, "python": platform.python_version(),
                "numpy": np.__version__, "torch": torch.__version__,
                "transformers": transformers.__version__}
    try:
        import faiss

        versions["faiss"] = faiss.__version__
    except ImportError:
        pass
    return versions


def read_manifest(folder: str | Path) -> Manifest:
    """The manifest of a complete datastore; a clear error if `folder` is not one."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.is_file():
        partial = partial_dir(folder)
        hint = (f" (an unfinished build is in {partial}: run the same build again to resume it)"
                if partial.exists() else "")
        raise DatastoreError(f"{folder} is not a datastore: no {MANIFEST}{hint}")
    try:
        manifest = Manifest.from_json(path.read_text(encoding="utf-8"))
    except (ValueError, TypeError) as err:  # JSON, UTF-8 or a field that is not one of ours
        raise DatastoreError(f"{path} is not a valid manifest: {err}") from err
    if manifest.checksum and manifest.checksum != manifest.content_sha256():
        raise DatastoreError(f"{path} is damaged: its checksum does not match its content; "
                             "rebuild the datastore or restore a good copy")
    return manifest


def check_compatible(manifest: Manifest, target: Target) -> None:
    """Refuse a datastore built by another model or tokenizer, naming both."""
    here = target.name or getattr(target.model.config, "_name_or_path", "") or "the target"
    check_tokenizer_compatible(manifest, target.tokenizer, here)
    if target.fingerprint != manifest.model_fingerprint:
        raise DatastoreError(
            f"this datastore was built with model {manifest.model!r} "
            f"(fingerprint {manifest.model_fingerprint[:12]}), but the target is {here!r} "
            f"(fingerprint {target.fingerprint[:12]}): its hidden states and outputs are not the "
            "ones stored. "
            "Build a datastore with this model."
        )


def check_tokenizer_compatible(manifest: Manifest, tokenizer: PreTrainedTokenizerBase,
                               here: str = "the target") -> None:
    """Refuse a datastore whose token ids come from another tokenizer (`here`: the target's
    name, for the message)."""
    tokenizer_hash = tokenizer_fingerprint(tokenizer)
    if tokenizer_hash != manifest.tokenizer_fingerprint:
        raise DatastoreError(
            f"this datastore was built with the tokenizer of {manifest.model!r} "
            f"(fingerprint {manifest.tokenizer_fingerprint[:12]}), but the target {here!r} has "
            f"another tokenizer (fingerprint {tokenizer_hash[:12]}): its token ids would be "
            "garbage here. Build a datastore with this model."
        )


def file_problem(path: Path, meta: dict, hash_it: bool) -> str | None:
    """What is wrong with one data file against its manifest entry (None: nothing found):
    missing, another size, a `.npy` header that does not describe the file, another sha256."""
    if not path.is_file():
        return "missing"
    size = path.stat().st_size
    if size != meta["bytes"]:
        return f"{size} bytes, the manifest says {meta['bytes']}"
    if path.suffix == ".npy":
        problem = npy_header_problem(path, size)
        if problem:
            return problem
    if hash_it and file_sha256(path) != meta["sha256"]:
        return "sha256 differs from the manifest"
    return None


def npy_header_problem(path: Path, size: int) -> str | None:
    """A `.npy` file whose header cannot be read or whose shape does not fill the file."""
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                           else np.lib.format.read_array_header_2_0)
            shape, _, dtype = read_header(f)
            data_start = f.tell()
    except (ValueError, TypeError, SyntaxError, OSError, EOFError) as err:
        return f"not a valid .npy header ({err})"
    expected = data_start + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if expected != size:
        return f"its header describes {expected} bytes, the file has {size}"
    return None


# (folder, the files' sizes and mtimes) already hashed in this process: a store opened by
# several drafters (hybrid, serve) is hashed once.
_VERIFIED: set[tuple] = set()


def verify_store(folder: str | Path, manifest: Manifest, full: bool = False) -> None:
    """Refuse a datastore whose files do not match its manifest, naming every bad file.

    Every file: present, the recorded size, a consistent `.npy` header. sha256: every file
    with `full`, else the files that fit in `OPEN_HASH_BUDGET` bytes, smallest first (so the
    small files, where a flipped bit changes settings or every draft, are always hashed)."""
    folder = Path(folder)
    entries = sorted(manifest.files.items(), key=lambda item: item[1]["bytes"])
    signature = (str(folder.resolve()), full,
                 tuple(_stat_signature(folder / name) for name, _ in entries))
    if signature in _VERIFIED:
        return
    problems, hashed = [], 0
    for name, meta in entries:
        hash_it = full or hashed + meta["bytes"] <= OPEN_HASH_BUDGET
        hashed += meta["bytes"] if hash_it else 0
        problem = file_problem(folder / name, meta, hash_it)
        if problem:
            problems.append(f"{name} ({problem})")
    if problems:
        raise DatastoreError(f"datastore {folder} is damaged: {'; '.join(problems)}; rebuild it "
                             "or restore a good copy")
    _VERIFIED.add(signature)


def _stat_signature(path: Path) -> tuple:
    try:
        stat = path.stat()
    except OSError:
        return (path.name, None)
    return (path.name, stat.st_size, stat.st_mtime_ns, stat.st_ino)


def open_manifest(folder: str | Path) -> Manifest:
    """The manifest of a datastore about to be used, after `verify_store`'s open-time checks."""
    manifest = read_manifest(folder)
    verify_store(folder, manifest)
    return manifest


def partial_dir(out: str | Path) -> Path:
    """The sibling folder a datastore is built in before it is renamed into place."""
    out = Path(out)
    return out.with_name(out.name + ".partial")


class AtomicBuild:
    """A datastore under construction in `OUT.partial`, with resumable chunks.

    `start(plan)` creates the partial folder, or resumes it if it holds the same plan (a dict
    that says what is being built: corpus fingerprint, model, settings); a different plan is
    an error rather than a silent mix of two builds. Chunks are marked done only after their
    files are fully written, so a marker implies complete data. `finish(manifest)` writes the
    checksums and the manifest and renames the folder into place.
    """

    def __init__(self, out: str | Path) -> None:
        self.out = Path(out)
        self.dir = partial_dir(self.out)
        self.chunks = self.dir / "chunks"
        self.resumed = False  # start() found an unfinished build of the same plan
        self.finished = False  # start() found it finished but not renamed: it renamed it
        self.plan_sha256 = ""
        self._fd: int | None = None

    def start(self, plan: dict) -> AtomicBuild:
        """Create or resume the partial folder, locked to this build; returns self, a context
        manager that releases the lock (`with build.start(plan): ...`)."""
        if self.out.exists():
            raise DatastoreError(f"{self.out} already exists; remove it or choose another --out")
        plan_text = json.dumps(plan, indent=2, sort_keys=True)
        self.plan_sha256 = hashlib.sha256(plan_text.encode()).hexdigest()
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock()
        if self.out.exists():  # another build finished while we waited for the lock
            self.close()
            _remove_if_empty(self.dir)
            raise DatastoreError(f"{self.out} already exists; remove it or choose another --out")
        old = self.dir / PLAN
        if old.is_file():
            if old.read_text(encoding="utf-8") != plan_text:
                self.close()
                raise DatastoreError(
                    f"{self.dir} holds an unfinished build of a different plan (other corpus, "
                    "model or settings); remove it to start over"
                )
            self.resumed = True
        elif self._finished_before():
            shutil.rmtree(self.chunks, ignore_errors=True)  # killed while removing them
            self._rename()
            self.finished = True
            return self
        elif _holds_data(self.dir):
            self.close()
            raise DatastoreError(f"{self.dir} holds files but no build plan: it is not an "
                                 "unfinished dresd build; remove it or choose another --out")
        else:  # new, or killed before its plan was written: start afresh
            write_atomic(self.dir / PLAN, plan_text.encode())
        self.chunks.mkdir(exist_ok=True)
        return self

    def _finished_before(self) -> bool:
        """The partial folder holds this plan's complete store, manifest written, plan file
        removed: the build was killed just before its rename."""
        if not (self.dir / MANIFEST).is_file():
            return False
        manifest = read_manifest(self.dir)
        if manifest.build_plan != self.plan_sha256:
            return False
        verify_store(self.dir, manifest, full=True)
        return True

    def _lock(self) -> None:
        """An exclusive, non-blocking flock on the partial folder itself."""
        self._fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.close()
            raise DatastoreError(
                f"another dresd build is writing {self.out} right now (it holds the lock on "
                f"{self.dir}); wait for it to finish, or stop it and run this build again to "
                "resume") from None

    def close(self) -> None:
        """Release the lock (the kernel also does when the process ends)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> AtomicBuild:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def chunk_done(self, number: int) -> bool:
        return (self.chunks / f"{number:05d}.done").exists()

    def mark_chunk_done(self, number: int) -> None:
        write_atomic(self.chunks / f"{number:05d}.done", b"")

    def chunk_path(self, number: int, suffix: str) -> Path:
        return self.chunks / f"{number:05d}.{suffix}"

    def finish(self, manifest: Manifest, keep: list[str]) -> Path:
        """Checksum the files in `keep`, write the manifest, drop the rest, rename into place."""
        for name in keep:
            path = self.dir / name
            fsync_file(path)  # on disk before the manifest that vouches for it
            manifest.files[name] = {"bytes": path.stat().st_size, "sha256": file_sha256(path)}
        manifest.versions = manifest.versions or software_versions()
        manifest.build_plan = self.plan_sha256
        for folder in {(self.dir / name).parent for name in keep}:
            fsync_file(folder)  # the files' names too
        # The manifest, then the plan file's removal, then the chunks': a rerun after a kill
        # anywhere in between either resumes with every chunk file in place (plan present) or
        # recognises the finished store (`_finished_before`) and drops what is left of the
        # chunks. Removing the chunks first would let a kill halfway through them leave chunks
        # marked done without their keys, which a resumed build then cannot join.
        write_atomic(self.dir / MANIFEST, manifest.to_json().encode())
        (self.dir / PLAN).unlink(missing_ok=True)
        fsync_file(self.dir)
        shutil.rmtree(self.chunks, ignore_errors=True)
        return self._rename()

    def _rename(self) -> Path:
        os.replace(self.dir, self.out)  # atomic on one file system: all or nothing
        fsync_file(self.out.parent)
        self.close()
        return self.out


def _holds_data(folder: Path) -> bool:
    """Anything in `folder` but an empty chunks folder and a temporary file a kill left."""
    for entry in folder.iterdir():
        if entry.name.endswith(".tmp") or (entry.name == "chunks" and not any(entry.iterdir())):
            continue
        return True
    return False


def _remove_if_empty(folder: Path) -> None:
    try:
        folder.rmdir()
    except OSError as err:
        if err.errno not in (errno.ENOTEMPTY, errno.ENOENT, errno.EEXIST):
            raise


def fsync_file(path: Path) -> None:
    """Flush a file's (or a folder's entries') data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temporary file and a rename: never a half file."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_npy_atomic(path: Path, array: np.ndarray) -> None:
    """`np.save` through a temporary file, flushed to disk, and a rename."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:  # a file object: np.save must not append ".npy"
        np.save(f, array)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_npy_blocks(path: Path, dtype: np.dtype, shape: tuple[int, ...],
                    blocks: Iterable[np.ndarray]) -> None:
    """An .npy file of `shape` from consecutive row `blocks`, written sequentially (a memory
    map would turn a full disk into a SIGBUS), flushed, through a temporary file and a rename."""
    header = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False,
              "shape": shape}
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.lib.format.write_array_header_1_0(f, header)
        for block in blocks:
            f.write(np.ascontiguousarray(block, dtype=dtype).tobytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_npz_atomic(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Like `np.savez`, but the same arrays always give the same bytes (`np.savez` stamps each
    member with the current time), written through a temporary file and a rename."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        for name, array in arrays.items():
            member = io.BytesIO()
            np.lib.format.write_array(member, np.asanyarray(array), allow_pickle=False)
            archive.writestr(zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0)),
                             member.getvalue())
    write_atomic(path, buffer.getvalue())
