"""The on-disk shape every datastore shares: a folder with a manifest, built atomically.

    DIR/manifest.json     kind, model and tokenizer fingerprints, dims, counts, corpus sources,
                          versions, and a sha256 per data file
    DIR/...               the kind's own files (dense: keys/index, values, transform)

A datastore appears complete or not at all: it is built in the sibling folder `DIR.partial`,
which is renamed to `DIR` only once every file and the manifest are written. A build that dies
leaves `DIR.partial` behind with the chunks it finished (`chunks/NNNNN.done` markers and their
files); the next build of the same plan resumes from there.

A datastore is bound to the model and tokenizer that built it: `check_compatible` compares
their fingerprints with the target's and refuses a mismatch with a message naming both.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from dresd.models import file_sha256

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
PLAN = "plan.json"  # in the partial folder: what is being built, to check a resume is the same


class DatastoreError(ValueError):
    """A datastore that is missing, incomplete, corrupt or built for another model."""


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """sha256 of what decides the token ids: vocabulary, merges, added and special tokens.

    For fast tokenizers the whole serialized pipeline (normalizer, pre-tokenizer, model) is
    hashed, with the vocabulary sorted so that map order cannot change the hash.
    """
    digest = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        spec = json.loads(backend.to_str())
        model = spec.get("model", {})
        if isinstance(model.get("vocab"), dict):
            model["vocab"] = sorted(model["vocab"].items(), key=lambda kv: kv[1])
        digest.update(json.dumps(spec, sort_keys=True).encode())
    else:
        digest.update(json.dumps(sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]))
                      .encode())
    special = {name: str(value) for name, value in tokenizer.special_tokens_map.items()}
    digest.update(json.dumps(special, sort_keys=True).encode())
    return digest.hexdigest()


def model_fingerprint(model: torch.nn.Module) -> str:
    """sha256 of the model's shape and a few of its weights (embeddings, final layers).

    Hidden states depend on every weight; hashing all of them would cost seconds for big
    models, so the hash covers the config's shape fields and the weights that differ between
    any two distinct checkpoints in practice (first embedding rows, the last parameters).
    `load_target` takes it from the checkpoint's own weights before casting them to the
    run's dtype and stores it on the model: a checkpoint has one fingerprint in every dtype.
    """
    cached = getattr(model, "_dresd_fingerprint", None)
    if cached is not None:
        return cached
    digest = hashlib.sha256()
    config = model.config
    shape = {key: getattr(config, key, None) for key in
             ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "intermediate_size", "vocab_size")}
    digest.update(json.dumps(shape, sort_keys=True).encode())
    embeddings = model.get_input_embeddings().weight
    tensors = [embeddings[:64]] + [p for _, p in list(model.named_parameters())[-4:]]
    for tensor in tensors:
        digest.update(tensor.detach().to(torch.float32).flatten()[:65536].cpu().numpy().tobytes())
    return digest.hexdigest()


@dataclass
class Manifest:
    """What a datastore holds and what built it; written last, as `manifest.json`."""

    kind: str  # "dense" (DReSD) or "sparse" (REST)
    model: str  # the model name the build was given
    model_fingerprint: str  # `model_fingerprint(model)`
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

    def to_json(self) -> str:
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
        return Manifest.from_json(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, TypeError) as err:
        raise DatastoreError(f"{path} is not a valid manifest: {err}") from err


def check_compatible(manifest: Manifest, model: torch.nn.Module,
                     tokenizer: PreTrainedTokenizerBase, model_name: str = "") -> None:
    """Refuse a datastore built by another model or tokenizer, naming both."""
    here = model_name or getattr(model.config, "_name_or_path", "") or "the target"
    check_tokenizer_compatible(manifest, tokenizer, here)
    model_hash = model_fingerprint(model)
    if model_hash != manifest.model_fingerprint:
        raise DatastoreError(
            f"this datastore was built with model {manifest.model!r} "
            f"(fingerprint {manifest.model_fingerprint[:12]}), but the target is {here!r} "
            f"(fingerprint {model_hash[:12]}): its hidden states and outputs are not the ones "
            "stored. "
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


def verify_files(folder: str | Path, manifest: Manifest) -> list[str]:
    """Names of data files whose size or sha256 differs from the manifest (empty: all good)."""
    bad = []
    for name, meta in manifest.files.items():
        path = Path(folder) / name
        if not path.is_file() or path.stat().st_size != meta["bytes"] \
                or file_sha256(path) != meta["sha256"]:
            bad.append(name)
    return bad


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
        self.resumed = False

    def start(self, plan: dict) -> None:
        if self.out.exists():
            raise DatastoreError(f"{self.out} already exists; remove it or choose another --out")
        plan_text = json.dumps(plan, indent=2, sort_keys=True)
        if self.dir.exists():
            old = self.dir / PLAN
            if not old.is_file() or old.read_text(encoding="utf-8") != plan_text:
                raise DatastoreError(
                    f"{self.dir} holds an unfinished build of a different plan (other corpus, "
                    "model or settings); remove it to start over"
                )
            self.resumed = True
        else:
            self.dir.mkdir(parents=True)
            write_atomic(self.dir / PLAN, plan_text.encode())
        self.chunks.mkdir(exist_ok=True)

    def chunk_done(self, number: int) -> bool:
        return (self.chunks / f"{number:05d}.done").exists()

    def mark_chunk_done(self, number: int) -> None:
        (self.chunks / f"{number:05d}.done").touch()

    def chunk_path(self, number: int, suffix: str) -> Path:
        return self.chunks / f"{number:05d}.{suffix}"

    def finish(self, manifest: Manifest, keep: list[str]) -> Path:
        """Checksum the files in `keep`, write the manifest, drop the rest, rename into place."""
        for name in keep:
            path = self.dir / name
            manifest.files[name] = {"bytes": path.stat().st_size, "sha256": file_sha256(path)}
        manifest.versions = manifest.versions or software_versions()
        shutil.rmtree(self.chunks, ignore_errors=True)
        (self.dir / PLAN).unlink(missing_ok=True)
        write_atomic(self.dir / MANIFEST, manifest.to_json().encode())
        os.replace(self.dir, self.out)  # atomic on one file system: all or nothing
        return self.out


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temporary file and a rename: never a half file."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_npy_atomic(path: Path, array: np.ndarray) -> None:
    """`np.save` through a temporary file and a rename."""
    tmp = path.with_name(path.name + ".tmp.npy")
    np.save(tmp, array)
    os.replace(tmp, path)
