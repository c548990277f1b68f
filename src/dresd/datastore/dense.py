"""The dense (DReSD) datastore: its build from a corpus, and reading it back.

Files in a dense datastore folder:

    transform.npz     the key transform (z-score, PCA, L2 norm; see transform.py)
    keys.npy          fp16 [N, dim] keys (exact, and ivfpq's re-ranking; `ivf` holds them)
    index.faiss       the ANN index (ivf, ivfpq), or scann/ (scann)
    offsets.npy       [N] for entry e, the position in the token stream of the token whose
                      hidden state is key e; its value is the next `value_len` tokens
    stream.npy        every corpus document's token ids, one after another (uint16 if the
                      vocabulary allows): values are slices of it, never copies
    doc_starts.npy    int64 [D + 1]: where each document starts in the stream (and the end), so
                      that a value stops at its document's end instead of running into the next
                      (the paper pads values with EOS; a cut value is just a shorter draft)
    sparse/           with `--kind dense,sparse` only: REST's suffix array (sparse_store.py)
    states.npy        with `--keep-states` only: fp16 [N, hidden] raw hidden states, row e the
                      state behind key e; a study can refit the transform or choose other key
                      positions without new forwards (benchmarks/studies/retrieval_study.py)

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
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

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
    DatastoreError,
    Manifest,
    check_compatible,
    open_manifest,
    save_npy_atomic,
    save_npy_blocks,
)
from dresd.datastore.sparse_store import KIND as SPARSE_KIND
from dresd.datastore.sparse_store import kinds, write_sparse_part

if TYPE_CHECKING:  # Ray is optional, and imported only by a build that uses it
    from dresd.raypool import RayPool
from dresd.datastore.transform import KeyTransform, StatsAccumulator
from dresd.errors import UserError
from dresd.fingerprint import tokenizer_fingerprint
from dresd.models.fastpath import dtype_name
from dresd.models.target import Target

KIND = "dense"
TRANSFORM_FILE = "transform.npz"
OFFSETS_FILE = "offsets.npy"
STREAM_FILE = "stream.npy"
DOC_STARTS_FILE = "doc_starts.npy"
STATES_FILE = "states.npy"


@dataclass
class DenseBuildConfig:
    """How a dense datastore is built; the defaults are the paper's where it has one."""

    pca_dim: int = 64  # key dimensions after PCA (paper: 64)
    value_len: int = 20  # tokens stored after each key position (paper: N = 20)
    index: str = "auto"  # auto | exact | ivf | ivfpq | scann (auto: exact if small, else ivf)
    recall_target: float = 0.9  # ivf, ivfpq: nprobe is raised until recall@10 reaches this
    sample_max: int = 1_000_000  # the transform is fitted on at most this many positions ...
    sample_fraction: float = 0.05  # ... about this share of all positions ...
    sample_min: int = 50_000  # ... but at least this many (or all, for small corpora)
    chunk_tokens: int = 65_536  # corpus tokens per resumable chunk
    batch_tokens: int = 8_192  # padded tokens per forward (memory bound)
    keep_keys: bool = False  # keep keys.npy beside an ANN index that holds the keys already
    keep_states: bool = False  # also keep raw states.npy (hidden_size x 2 bytes per entry)
    seed: int = 0  # sample and index training randomness

    def __post_init__(self) -> None:
        if self.pca_dim < 1 or self.value_len < 2:
            raise UserError("pca_dim must be >= 1 and value_len >= 2")
        if self.chunk_tokens < 1 or self.batch_tokens < 1:
            raise UserError("chunk_tokens and batch_tokens must be >= 1")


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
    device = next(model.parameters()).device
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
        states = decoder(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state
        for row, doc in enumerate(batch):
            yield start + row, states[row, doc.key_start : len(doc.ids) - 1].float().cpu()
        start = end


def pad_token_id(tokenizer) -> int:
    """The id right-padded batches are filled with (masked out: any id would do)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0


def key_states(model: torch.nn.Module, docs: list[TokenizedDocument], starts: np.ndarray,
               batch_tokens: int, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Raw fp16 hidden states [keys, d] at the key positions of `docs` (sorted by length), and
    each key's position in the token stream (`starts[i]`: where docs[i] starts in it)."""
    states, offsets = [], []
    for i, h in hidden_states(model, docs, batch_tokens, pad_id):
        states.append(h.half().numpy())
        offsets.append(starts[i] + np.arange(docs[i].key_start, len(docs[i].ids) - 1))
    return np.concatenate(states), np.concatenate(offsets)


def chunk_states(target: Target, number: int, docs: list[TokenizedDocument], starts: np.ndarray,
                 batch_tokens: int, pad_id: int) -> tuple[int, np.ndarray, np.ndarray]:
    """(number, raw fp16 states, stream offsets) of one chunk's key positions: the job a build
    runs for each chunk, here or on a Ray actor."""
    raw, offsets = key_states(target.model, docs, starts, batch_tokens, pad_id)
    return number, raw, offsets


def build_dense(target: Target, spec: CorpusSpec, out: str | Path,
                config: DenseBuildConfig | None = None, progress: bool = True,
                with_sparse: bool = False, ray: RayPool | None = None) -> Path:
    """Build a dense datastore for `target` from the corpus `spec` into `out`; returns `out`.

    Resumes an unfinished build of the same plan in `out.partial`. With `with_sparse`, the
    same documents' suffix array (REST's sparse part, sparse_store.py) goes into the same
    folder, whose kind is then "dense,sparse". With `ray`, the chunks' forwards run on its
    actors (raypool.py); everything else, and the files written, are the same.
    """
    config = config or DenseBuildConfig()
    context = getattr(target.model.config, "max_position_embeddings", None)
    if context and spec.max_tokens > context:  # one forward never exceeds the model's context
        spec = replace(spec, max_tokens=context)
    docs = tokenize_corpus(target.tokenizer, spec, target.fingerprint)
    total_keys = sum(d.num_keys for d in docs)
    if total_keys <= config.pca_dim:
        raise CorpusError(f"the corpus has {total_keys} key positions; a PCA to "
                          f"{config.pca_dim} dimensions needs more (use a bigger corpus or a "
                          "smaller --pca-dim)")
    hidden_size = target.model.config.hidden_size
    if config.pca_dim > hidden_size:
        raise UserError(f"--pca-dim {config.pca_dim} exceeds the hidden size {hidden_size}")
    return _DenseBuild(target, spec, docs, config, out, progress, with_sparse, ray).run()


class _DenseBuild:
    """The steps of one build; chunk files in `build.chunks` carry the state between them:

        NNNNN.offsets.npy  stream positions of the chunk's keys (every chunk)
        NNNNN.states.npy   raw fp16 hidden states (fit chunks, until the transform exists)
        NNNNN.keys.npy     fp16 keys (every chunk, once done; NNNNN.done marks it)
    """

    def __init__(self, target: Target, spec: CorpusSpec, docs: list[TokenizedDocument],
                 config: DenseBuildConfig, out: str | Path, progress: bool,
                 with_sparse: bool = False, ray: RayPool | None = None) -> None:
        self.target, self.spec, self.docs, self.config = target, spec, docs, config
        self.progress, self.with_sparse, self.ray = progress, with_sparse, ray
        self.kind = f"{KIND},{SPARSE_KIND}" if with_sparse else KIND
        self.model = target.model
        self.num_keys = sum(d.num_keys for d in docs)
        # Token stream and document boundaries, in corpus order: the values live there.
        lengths = np.array([len(d.ids) for d in docs], dtype=np.int64)
        self.doc_starts = np.concatenate([[0], np.cumsum(lengths)])
        self.chunks = plan_chunks(docs, config)
        self.token_dtype = np.uint16 if self.model.config.vocab_size <= 2**16 else np.uint32
        tokenizer = target.tokenizer
        self.pad_id = pad_token_id(tokenizer)
        self.plan = {"kind": self.kind, "model": target.name,
                     "model_fingerprint": target.fingerprint,
                     "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
                     "corpus": corpus_fingerprint(spec),
                     "corpus_spec": {k: v for k, v in asdict(spec).items() if k != "sources"},
                     "config": asdict(config),
                     # Keys from a bf16 forward differ in the last bits from fp32 ones: a
                     # resumed build must not mix them.
                     "build_dtype": dtype_name(target.dtype)}
        self.build = AtomicBuild(out)

    def run(self) -> Path:
        with self.build.start(self.plan):  # locked until the store is in place (or we fail)
            if self.build.finished:
                return self.build.out
            return self._run()

    def _run(self) -> Path:
        if self.progress and self.build.resumed:
            print(f"dresd: resuming the unfinished build in {self.build.dir}", file=sys.stderr)
        bar = tqdm(total=int(self.doc_starts[-1]), unit="tok", unit_scale=True,
                   disable=not self.progress, desc="dresd build", smoothing=0.1)
        fit_chunks = [n for n, c in enumerate(self.chunks) if c.fit]
        other_chunks = [n for n, c in enumerate(self.chunks) if not c.fit]
        # 1. Fit chunks: forward a random sample of documents, keep their raw states.
        self.forward_chunks(fit_chunks, None, bar)
        # 2. The transform, from the sample's running sums; then the sample's own keys.
        transform = self.fit_transform(fit_chunks)
        for number in fit_chunks:
            if not self.build.chunk_done(number):
                raw = np.load(self._raw_path(number))
                self._save_keys(number, transform.apply(raw))
                if not self.config.keep_states:
                    self._raw_path(number).unlink()
        # 3. Every other chunk: forward, transform, write.
        self.forward_chunks(other_chunks, transform, bar)
        bar.close()
        # 4. Join the chunks, write the values, build the index, finish.
        keys_path, offsets = self.join_chunks()
        files, stream = self.write_values(offsets)
        keys = np.load(keys_path, mmap_mode="r")
        index_kind = key_index.choose_kind(self.config.index, self.num_keys)
        index_settings = key_index.build_index(index_kind, keys, self.build.dir,
                                               self.config.recall_target)
        del keys
        files += key_index.index_files(index_kind, self.build.dir)
        if self.with_sparse:  # REST's suffix array over the same token stream
            sparse_files, sparse_settings = write_sparse_part(stream, self.doc_starts,
                                                              self.build.dir)
            files += sparse_files
            index_settings = {**index_settings, "sparse": sparse_settings}
        if key_index.KEYS_FILE not in files and not self.config.keep_keys:
            keys_path.unlink()  # the index holds the keys: do not store them twice
        elif key_index.KEYS_FILE not in files:
            files.append(key_index.KEYS_FILE)
        return self.build.finish(self.manifest(transform, index_settings), files)

    def _chunk_tokens(self, number: int) -> int:
        return sum(len(self.docs[n].ids) for n in self.chunks[number].docs)

    def _raw_path(self, number: int) -> Path:
        return self.build.chunk_path(number, "states.npy")

    def _save_keys(self, number: int, keys: np.ndarray) -> None:
        save_npy_atomic(self.build.chunk_path(number, "keys.npy"), keys.astype(np.float16))
        self.build.mark_chunk_done(number)  # only after its files are complete

    def forward_chunks(self, numbers: list[int], transform: KeyTransform | None, bar) -> None:
        """Forward the chunks `numbers` not saved yet (here, or on the Ray actors) and save each
        as it is done: keys if `transform`, else raw states (fit chunks, before the transform)."""
        todo = []
        for number in numbers:
            saved = self.build.chunk_done(number) or (transform is None
                                                      and self._raw_path(number).exists())
            if saved:  # by an earlier, interrupted run of this build
                bar.update(self._chunk_tokens(number))
            else:
                todo.append(number)
        jobs = [self.chunk_job(number) for number in todo]
        if self.ray is None:
            results = (chunk_states(self.target, *job) for job in jobs)
        else:  # in the order the actors finish: each chunk's files are its own
            results = (result for _, result in self.ray.map_unordered(chunk_states, jobs))
        for number, raw, offsets in results:
            self.save_chunk(number, raw, offsets, transform)
            bar.update(self._chunk_tokens(number))

    def chunk_job(self, number: int) -> tuple:
        """`chunk_states`'s arguments after the target, for chunk `number`."""
        docs = self.chunks[number].docs
        return (number, [self.docs[n] for n in docs], self.doc_starts[docs],
                self.config.batch_tokens, self.pad_id)

    def save_chunk(self, number: int, raw: np.ndarray, offsets: np.ndarray,
                   transform: KeyTransform | None) -> None:
        """A forwarded chunk's files: keys if `transform`, else (and with `keep_states`) its raw
        states."""
        save_npy_atomic(self.build.chunk_path(number, "offsets.npy"), offsets)
        if transform is None or self.config.keep_states:  # fit chunks wait for the transform
            save_npy_atomic(self._raw_path(number), raw)
        if transform is not None:
            self._save_keys(number, transform.apply(raw))

    def fit_transform(self, fit_chunks: list[int]) -> KeyTransform:
        """The transform fitted on the fit chunks' raw states (or the one a resumed build saved)."""
        path = self.build.dir / TRANSFORM_FILE
        if path.exists():
            return KeyTransform.load(path)
        stats = StatsAccumulator(self.model.config.hidden_size)
        for number in fit_chunks:
            stats.add(np.load(self._raw_path(number)))
        transform = stats.fit(self.config.pca_dim)
        transform.save(path)
        return transform

    def join_chunks(self) -> tuple[Path, np.ndarray]:
        """All chunks' keys into one fp16 `keys.npy` and their stream offsets into one array,
        in chunk order: entry ids follow that order (with `keep_states`, the raw states too).
        The files are written sequentially (not through a memory map, where a full disk is a
        SIGBUS rather than an error) through a temporary file and a rename."""
        keys_path = self.build.dir / key_index.KEYS_FILE
        wide = self.doc_starts[-1] >= 2**32
        offsets = np.empty(self.num_keys, dtype=np.int64 if wide else np.uint32)
        row = 0

        def chunk_keys():
            nonlocal row
            for number in range(len(self.chunks)):
                keys = np.load(self.build.chunk_path(number, "keys.npy"))
                offsets[row : row + len(keys)] = np.load(
                    self.build.chunk_path(number, "offsets.npy"))
                row += len(keys)
                yield keys

        save_npy_blocks(keys_path, np.float16, (self.num_keys, self.config.pca_dim),
                        chunk_keys())
        if row != self.num_keys:
            raise RuntimeError(f"the chunks hold {row} keys, the plan {self.num_keys}")
        if self.config.keep_states:
            save_npy_blocks(self.build.dir / STATES_FILE, np.float16,
                            (self.num_keys, self.model.config.hidden_size),
                            (np.load(self._raw_path(n), mmap_mode="r")
                             for n in range(len(self.chunks))))
        return keys_path, offsets

    def write_values(self, offsets: np.ndarray) -> tuple[list[str], np.ndarray]:
        """The value files: offsets, the token stream (each token once), document bounds;
        returns their names and the stream."""
        stream = np.concatenate([np.asarray(d.ids, dtype=self.token_dtype) for d in self.docs])
        save_npy_atomic(self.build.dir / OFFSETS_FILE, offsets)
        save_npy_atomic(self.build.dir / STREAM_FILE, stream)
        save_npy_atomic(self.build.dir / DOC_STARTS_FILE, self.doc_starts)
        files = [TRANSFORM_FILE, OFFSETS_FILE, STREAM_FILE, DOC_STARTS_FILE]
        if self.config.keep_states:
            files.append(STATES_FILE)
        return files, stream

    def manifest(self, transform: KeyTransform, index_settings: dict) -> Manifest:
        sample = sum(self.docs[n].num_keys for c in self.chunks if c.fit for n in c.docs)
        return Manifest(
            kind=self.kind, model=self.target.name,
            model_fingerprint=self.plan["model_fingerprint"],
            tokenizer_fingerprint=self.plan["tokenizer_fingerprint"],
            vocab_size=self.model.config.vocab_size, num_entries=self.num_keys,
            num_corpus_tokens=int(self.doc_starts[-1]), num_documents=len(self.docs),
            corpus=self.plan["corpus"],
            settings={"hidden_size": self.model.config.hidden_size,
                      "pca_dim": self.config.pca_dim, "value_len": self.config.value_len,
                      "key_dtype": "float16", "token_dtype": np.dtype(self.token_dtype).name,
                      "transform_sample": int(sample),
                      "build_dtype": self.plan["build_dtype"],
                      "pca_explained_variance": transform.explained,
                      "corpus_spec": self.plan["corpus_spec"], **index_settings},
        )


class DenseDatastore:
    """A dense datastore opened for search: transform, index and memory-mapped values."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.manifest = open_manifest(self.folder)  # checked against its files first
        if KIND not in kinds(self.manifest):
            raise DatastoreError(f"{self.folder} is a {self.manifest.kind} datastore, "
                                 "not a dense one")
        self.settings = self.manifest.settings
        self.transform = KeyTransform.load(self.folder / TRANSFORM_FILE)
        self.index = key_index.open_index(self.folder, self.settings)
        self.offsets = np.load(self.folder / OFFSETS_FILE, mmap_mode="r")
        # A plain ndarray view of the mapped file: slicing a np.memmap costs ~1 us more per
        # slice, and a step slices up to k values.
        self.stream = np.asarray(np.load(self.folder / STREAM_FILE, mmap_mode="r"))
        self.doc_starts = np.load(self.folder / DOC_STARTS_FILE)
        self.value_len = int(self.settings["value_len"])

    def check_compatible(self, target: Target) -> None:
        check_compatible(self.manifest, target)

    def search(self, state: torch.Tensor | np.ndarray, k: int, padded: bool = False
               ) -> np.ndarray:
        """Entry ids of the k nearest keys to hidden state `state` [d], best first; `padded`:
        as the index gives them, -1 after the last where it finds fewer than k (the C drafts
        skip those, and a step saves the numpy calls that drop them)."""
        _, ids = self.index.search(self.transform.key(state)[None, :], k)
        return ids[0] if padded else ids[0][ids[0] >= 0]

    def value_bounds(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(start, end) in the stream of each entry's value: the up to `value_len` tokens after
        its position, cut at its document's end."""
        positions = self.offsets[ids].astype(np.int64)
        doc = np.searchsorted(self.doc_starts, positions, side="right") - 1
        start = positions + 1
        end = np.minimum(start + self.value_len, self.doc_starts[doc + 1])
        return start, end
