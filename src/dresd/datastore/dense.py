"""The dense (DReSD) datastore: its build from a corpus, and reading it back.

Files in a dense datastore folder:

    transform.npz     the key transform (z-score, PCA, L2 norm; see transform.py)
    keys.npy          fp16 [N, dim] keys (exact index; with `ivf` the index holds them)
    index.faiss       the ANN index (ivf), or scann/ (scann)
    offsets.npy       [N] for entry e, the position in the token stream of the token whose
                      hidden state is key e; its value is the next `value_len` tokens
    stream.npy        every corpus document's token ids, one after another (uint16 if the
                      vocabulary allows): values are slices of it, never copies
    doc_starts.npy    int64 [D + 1]: where each document starts in the stream (and the end), so
                      that a value stops at its document's end instead of running into the next

Build (`build_dense`), as the authors do it but resumable and in one forward per document:
  1. tokenize the corpus (corpus.py); plan chunks of length-sorted documents;
  2. a random sample of documents (the "fit" chunks) is forwarded first and its raw states
     kept (fp16) until the transform is fitted on them;
  3. every other chunk is forwarded, its states transformed to keys at once;
  4. chunks are joined, the index is built, the manifest written, the folder renamed.
Hidden states come from the model's base (decoder) forward, which is exactly the last-layer,
post-norm state that the verify pass hands the drafter at generation time.
"""

from __future__ import annotations

import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from dresd.corpus import (
    CorpusError,
    CorpusSpec,
    TokenizedDocument,
    corpus_fingerprint,
    tokenize_corpus,
)
from dresd.datastore import index as key_index
from dresd.datastore.format import (
    AtomicBuild,
    Manifest,
    check_compatible,
    model_fingerprint,
    read_manifest,
    save_npy_atomic,
    tokenizer_fingerprint,
)
from dresd.datastore.sparse_store import KIND as SPARSE_KIND
from dresd.datastore.sparse_store import kinds, write_sparse_part
from dresd.datastore.transform import KeyTransform, StatsAccumulator
from dresd.models import Target

KIND = "dense"
TRANSFORM_FILE = "transform.npz"
OFFSETS_FILE = "offsets.npy"
STREAM_FILE = "stream.npy"
DOC_STARTS_FILE = "doc_starts.npy"


@dataclass
class DenseBuildConfig:
    """How a dense datastore is built; the defaults are the paper's where it has one."""

    pca_dim: int = 64  # key dimensions after PCA (paper: 64)
    value_len: int = 20  # tokens stored after each key position (paper: N = 20)
    index: str = "auto"  # auto | exact | ivf | scann (auto: exact for small stores, else ivf)
    recall_target: float = 0.9  # ivf: nprobe is raised until recall@10 reaches this
    sample_max: int = 1_000_000  # the transform is fitted on at most this many positions ...
    sample_fraction: float = 0.05  # ... about this share of all positions ...
    sample_min: int = 50_000  # ... but at least this many (or all, for small corpora)
    chunk_tokens: int = 65_536  # corpus tokens per resumable chunk
    batch_tokens: int = 8_192  # padded tokens per forward (memory bound)
    keep_keys: bool = False  # keep keys.npy beside an ANN index that holds the keys already
    seed: int = 0  # sample and index training randomness

    def __post_init__(self) -> None:
        if self.pca_dim < 1 or self.value_len < 2:
            raise ValueError("pca_dim must be >= 1 and value_len >= 2")
        if self.chunk_tokens < 1 or self.batch_tokens < 1:
            raise ValueError("chunk_tokens and batch_tokens must be >= 1")


@dataclass
class Chunk:
    """Documents forwarded and written together; `fit` chunks feed the transform's sample."""

    docs: list[int]  # document numbers, sorted by length
    fit: bool


def plan_chunks(docs: list[TokenizedDocument], config: DenseBuildConfig) -> list[Chunk]:
    """Fit chunks (a random sample of documents) first, then the rest; each group is sorted by
    length so that a batch pads little, and cut into chunks of about `chunk_tokens` tokens."""
    total_keys = sum(d.num_keys for d in docs)
    wanted = min(config.sample_max,
                 max(config.sample_min, math.ceil(config.sample_fraction * total_keys)))
    order = np.random.default_rng(config.seed).permutation(len(docs))
    fit, rest, taken = [], [], 0
    for number in order.tolist():
        if taken < wanted:
            fit.append(number)
            taken += docs[number].num_keys
        else:
            rest.append(number)
    chunks = []
    for group, is_fit in ((fit, True), (rest, False)):
        group.sort(key=lambda n: (len(docs[n].ids), n))
        current, tokens = [], 0
        for number in group:
            current.append(number)
            tokens += len(docs[number].ids)
            if tokens >= config.chunk_tokens:
                chunks.append(Chunk(current, is_fit))
                current, tokens = [], 0
        if current:
            chunks.append(Chunk(current, is_fit))
    return chunks


@torch.inference_mode()
def hidden_states(model: torch.nn.Module, docs: list[TokenizedDocument],
                  batch_tokens: int, pad_id: int = 0):
    """Yield (document index, key states [num_keys, d] float32) for `docs` (sorted by length),
    forwarding right-padded batches of at most `batch_tokens` padded tokens."""
    decoder = model.base_model  # the LM head is not needed: states only
    start = 0
    while start < len(docs):
        end = start + 1  # grow the batch while (docs so far) x (longest) fits the budget
        while end < len(docs) and (end + 1 - start) * len(docs[end].ids) <= batch_tokens:
            end += 1
        batch = docs[start:end]
        width = max(len(d.ids) for d in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, doc in enumerate(batch):
            ids[row, : len(doc.ids)] = torch.tensor(doc.ids)
            mask[row, : len(doc.ids)] = 1
        states = decoder(input_ids=ids, attention_mask=mask).last_hidden_state
        for row, doc in enumerate(batch):
            yield start + row, states[row, doc.key_start : len(doc.ids) - 1].float()
        start = end


def build_dense(target: Target, spec: CorpusSpec, out: str | Path,
                config: DenseBuildConfig | None = None, progress: bool = True,
                with_sparse: bool = False) -> Path:
    """Build a dense datastore for `target` from the corpus `spec` into `out`; returns `out`.

    Resumes an unfinished build of the same plan in `out.partial`. With `with_sparse`, the
    same documents' suffix array (REST's sparse part, sparse_store.py) goes into the same
    folder, whose kind is then "dense,sparse".
    """
    config = config or DenseBuildConfig()
    kind = f"{KIND},{SPARSE_KIND}" if with_sparse else KIND
    model, tokenizer = target.model, target.tokenizer
    docs = tokenize_corpus(tokenizer, spec)
    total_keys = sum(d.num_keys for d in docs)
    if total_keys <= config.pca_dim:
        raise CorpusError(f"the corpus has {total_keys} key positions; a PCA to "
                          f"{config.pca_dim} dimensions needs more (use a bigger corpus or a "
                          "smaller --pca-dim)")
    hidden_size = model.config.hidden_size
    if config.pca_dim > hidden_size:
        raise ValueError(f"--pca-dim {config.pca_dim} exceeds the hidden size {hidden_size}")
    fingerprints = {"model": target.name, "model_fingerprint": model_fingerprint(model),
                    "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer)}
    spec_fields = {k: v for k, v in asdict(spec).items() if k != "sources"}
    plan = {"kind": kind, **fingerprints, "corpus": corpus_fingerprint(spec),
            "corpus_spec": spec_fields, "config": asdict(config)}
    build = AtomicBuild(out)
    build.start(plan)
    if progress and build.resumed:
        print(f"dresd: resuming the unfinished build in {build.dir}", file=sys.stderr)

    # Token stream and document boundaries, in corpus order: the values live here.
    lengths = np.array([len(d.ids) for d in docs], dtype=np.int64)
    doc_starts = np.concatenate([[0], np.cumsum(lengths)])
    chunks = plan_chunks(docs, config)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    bar = tqdm(total=int(lengths.sum()), unit="tok", unit_scale=True, disable=not progress,
               desc="dresd build", smoothing=0.1)

    def forward_chunk(number: int, chunk: Chunk, transform: KeyTransform | None) -> None:
        chunk_docs = [docs[n] for n in chunk.docs]
        states, offsets = [], []
        for i, h in hidden_states(model, chunk_docs, config.batch_tokens, pad_id):
            doc = chunk_docs[i]
            states.append(h.half().numpy())
            positions = np.arange(doc.key_start, len(doc.ids) - 1)
            offsets.append(doc_starts[chunk.docs[i]] + positions)
        raw = np.concatenate(states)
        offsets_array = np.concatenate(offsets)
        save_npy_atomic(build.chunk_path(number, "offsets.npy"), offsets_array)
        if transform is None:  # a fit chunk: raw states wait for the transform
            save_npy_atomic(build.chunk_path(number, "states.npy"), raw)
        else:
            save_npy_atomic(build.chunk_path(number, "keys.npy"),
                            transform.apply(raw).astype(np.float16))
            build.mark_chunk_done(number)

    # 1. Fit chunks: forward a random sample of documents, keep their raw states.
    for number, chunk in enumerate(chunks):
        if chunk.fit and not (build.chunk_done(number) or build.chunk_path(number, "states.npy")
                              .exists()):
            forward_chunk(number, chunk, None)
        bar.update(sum(len(docs[n].ids) for n in chunk.docs) if chunk.fit else 0)

    # 2. The transform, from the sample's running sums; then the sample's own keys.
    transform_path = build.dir / TRANSFORM_FILE
    if transform_path.exists():
        transform = KeyTransform.load(transform_path)
    else:
        stats = StatsAccumulator(hidden_size)
        for number, chunk in enumerate(chunks):
            if chunk.fit:
                stats.add(np.load(build.chunk_path(number, "states.npy")))
        transform = stats.fit(config.pca_dim)
        tmp = transform_path.with_name("transform.tmp.npz")
        transform.save(tmp)
        tmp.replace(transform_path)
    for number, chunk in enumerate(chunks):
        if chunk.fit and not build.chunk_done(number):
            raw_path = build.chunk_path(number, "states.npy")
            save_npy_atomic(build.chunk_path(number, "keys.npy"),
                            transform.apply(np.load(raw_path)).astype(np.float16))
            build.mark_chunk_done(number)
            raw_path.unlink()

    # 3. Every other chunk: forward, transform, write.
    for number, chunk in enumerate(chunks):
        if chunk.fit:
            continue
        if not build.chunk_done(number):
            forward_chunk(number, chunk, transform)
        bar.update(sum(len(docs[n].ids) for n in chunk.docs))
    bar.close()

    # 4. Join the chunks, write the values, build the index, finish.
    keys_path = build.dir / key_index.KEYS_FILE
    keys = np.lib.format.open_memmap(keys_path, mode="w+", dtype=np.float16,
                                     shape=(total_keys, config.pca_dim))
    stream_len = int(doc_starts[-1])
    offsets = np.empty(total_keys, dtype=np.uint32 if stream_len < 2**32 else np.int64)
    row = 0
    for number in range(len(chunks)):
        chunk_keys = np.load(build.chunk_path(number, "keys.npy"))
        keys[row : row + len(chunk_keys)] = chunk_keys
        offsets[row : row + len(chunk_keys)] = np.load(build.chunk_path(number, "offsets.npy"))
        row += len(chunk_keys)
    keys.flush()
    token_dtype = np.uint16 if model.config.vocab_size <= 2**16 else np.uint32
    stream = np.concatenate([np.asarray(d.ids, dtype=token_dtype) for d in docs])
    save_npy_atomic(build.dir / OFFSETS_FILE, offsets)
    save_npy_atomic(build.dir / STREAM_FILE, stream)
    save_npy_atomic(build.dir / DOC_STARTS_FILE, doc_starts)

    index_kind = key_index.choose_kind(config.index, total_keys)
    index_settings = key_index.build_index(index_kind, keys, build.dir, config.recall_target)
    files = [TRANSFORM_FILE, OFFSETS_FILE, STREAM_FILE, DOC_STARTS_FILE]
    files += key_index.index_files(index_kind, build.dir)
    sparse_settings = {}
    if with_sparse:
        sparse_files, sparse_settings = write_sparse_part(stream, doc_starts, build.dir)
        files += sparse_files
    del keys
    if index_kind != "exact" and not config.keep_keys:
        keys_path.unlink()  # the index holds the keys: do not store them twice
    elif key_index.KEYS_FILE not in files:
        files.append(key_index.KEYS_FILE)
    manifest = Manifest(
        kind=kind, model=target.name, model_fingerprint=fingerprints["model_fingerprint"],
        tokenizer_fingerprint=fingerprints["tokenizer_fingerprint"],
        vocab_size=model.config.vocab_size, num_entries=total_keys,
        num_corpus_tokens=stream_len, num_documents=len(docs), corpus=plan["corpus"],
        settings={"hidden_size": hidden_size, "pca_dim": config.pca_dim,
                  "value_len": config.value_len, "key_dtype": "float16",
                  "token_dtype": np.dtype(token_dtype).name,
                  "transform_sample": int(sum(docs[n].num_keys for c in chunks if c.fit
                                              for n in c.docs)),
                  "pca_explained_variance": transform.explained,
                  "corpus_spec": spec_fields, **index_settings,
                  **({"sparse": sparse_settings} if with_sparse else {})},
    )
    return build.finish(manifest, files)


class DenseDatastore:
    """A dense datastore opened for search: transform, index and memory-mapped values."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.manifest = read_manifest(self.folder)
        if KIND not in kinds(self.manifest):
            raise ValueError(f"{self.folder} is a {self.manifest.kind} datastore, not a dense one")
        self.settings = self.manifest.settings
        self.transform = KeyTransform.load(self.folder / TRANSFORM_FILE)
        self.index = key_index.open_index(self.folder, self.settings)
        self.offsets = np.load(self.folder / OFFSETS_FILE, mmap_mode="r")
        self.stream = np.load(self.folder / STREAM_FILE, mmap_mode="r")
        self.doc_starts = np.load(self.folder / DOC_STARTS_FILE)
        self.value_len = int(self.settings["value_len"])

    def check_compatible(self, target: Target) -> None:
        check_compatible(self.manifest, target.model, target.tokenizer, target.name)

    def search(self, state: np.ndarray, k: int) -> np.ndarray:
        """Entry ids of the k nearest keys to hidden state `state` [d], best first."""
        query = self.transform.apply(np.asarray(state, dtype=np.float32))
        _, ids = self.index.search(query[None, :], k)
        return ids[0][ids[0] >= 0]

    def value_bounds(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(start, end) in the stream of each entry's value: the up to `value_len` tokens after
        its position, cut at its document's end."""
        positions = self.offsets[ids].astype(np.int64)
        doc = np.searchsorted(self.doc_starts, positions, side="right") - 1
        start = positions + 1
        end = np.minimum(start + self.value_len, self.doc_starts[doc + 1])
        return start, end
