"""A byte-pair tokenizer's vocabulary and merges held compactly, as llama.cpp holds them: a GGUF
file's tokenizer in a few MB where the `tokenizers` library's own tables take 40-100 MB (a
262k vocabulary, Llama 3's 128k with its 280k merges), the same token ids.

Why: a run's peak memory is the file's weights + the KV cache + the runtime, and the tokenizer
library keeps every token twice in hash maps of strings (token -> id, id -> token) beside the
merges: for a 1B model, more than the KV cache of a long prompt.

How: the library's pipeline is kept whole (added and special tokens, normalizer, pre-tokenizer,
byte-level mapping, byte fallback, post-processor, decoder), but its BPE model holds only the
vocabulary's single characters (and byte pieces `<0x41>`, added tokens, unk), with no merges.
Encoding through it gives each pre-tokenized word as its initial symbols with their true ids,
and `word_ids` says which word each belongs to. The merges are then applied here, word by
word, exactly as the library's BPE does (`Word::merge_all`):

    queue every adjacent pair that has a merge, keyed (rank, position)
    pop the lowest; skip it if its left symbol is gone, or the pair there is no longer the one
    queued; else merge the two into the merge's token, and queue the new pairs it makes with
    its left and right neighbours

The merges live in three sorted arrays (pair key -> rank, merged id), the vocabulary in one
byte blob with offsets; both are written once beside the cached tokenizer (`COMPACT`).

Anything else the library's `Tokenizer` offers (truncation, padding, pre-split words, adding
tokens, its model object) is served by the full tokenizer, read from the saved file the first
time it is asked for: exact always, compact where the run's ordinary calls are.
"""

from __future__ import annotations

import copy
import heapq
import json
import mmap
import re
import shutil
import tempfile
from bisect import bisect_left
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Encoding, Tokenizer
from transformers import AutoTokenizer
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

# The subfolder of a cached tokenizer folder holding its compact form; a new version of the
# tables or of how they are read gets a new name, so no cache holds a stale form.
COMPACT = "compact-v2"
TABLES, TABLES_LAYOUT = "tables.bin", "tables.json"
NOT_COMPACT = "not-compact.txt"  # written where a tokenizer has no compact form: why
BYTE_PIECE = re.compile(r"<0x[0-9A-F]{2}>")  # byte fallback's tokens, as the library names them
WORD_CACHE_SIZE = 20_000  # words kept merged (the library keeps 10,000); cleared when full
SAMPLE_TEXT = ("Hello world! It's 2026: dresd's naïve café costs €3.50 — ok?\n\n\tdef f(x):"
               "  return x**2  # 你好，世界。Привет, мир! こんにちは 🤖🚀 <b>tag</b>   end")


@dataclass
class Tables:
    """The model's vocabulary and merges as flat arrays: `tables.bin`, mapped read-only, so
    only the pages a run touches (the tokens it decodes, the merges of the words it encodes)
    are ever in memory; `tables.json` says where each array lies."""
    token_bytes: memoryview  # bytes: every token's UTF-8, in id order
    token_starts: memoryview  # int64: token i is token_bytes[token_starts[i]:token_starts[i + 1]]
    by_bytes: memoryview  # int32: the ids sorted by their bytes (token_to_id's binary search)
    merge_keys: memoryview  # int64: left id << 32 | right id, sorted
    merge_ranks: memoryview  # int32: the merge's index in the merges list (lower merges first)
    merge_results: memoryview  # int32: the merged token's id
    vocab_size: int  # the model's vocabulary, without added tokens
    vocab_size_with_added: int

    ARRAYS = {"token_bytes": "B", "token_starts": "q", "by_bytes": "i", "merge_keys": "q",
              "merge_ranks": "i", "merge_results": "i"}  # each array's struct code

    @classmethod
    def load(cls, folder: Path) -> Tables:
        layout = json.loads((folder / TABLES_LAYOUT).read_text())
        with open(folder / TABLES, "rb") as file:
            mapped = memoryview(mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ))
        arrays = {}
        for name, code in cls.ARRAYS.items():
            start, size = layout[name]
            if start + size > len(mapped):
                raise ValueError(f"{folder / TABLES} is shorter than {TABLES_LAYOUT} says")
            arrays[name] = mapped[start:start + size].cast(code)
        return cls(**arrays, vocab_size=layout["vocab_size"],
                   vocab_size_with_added=layout["vocab_size_with_added"])

    @classmethod
    def from_arrays(cls, vocab_size: int, vocab_size_with_added: int,
                    **arrays: np.ndarray) -> Tables:
        """Tables held in memory (to be saved): each array as its struct code says."""
        typed = {name: memoryview(np.ascontiguousarray(arrays[name], np.dtype(code)).tobytes()
                                  ).cast(code) for name, code in cls.ARRAYS.items()}
        return cls(**typed, vocab_size=vocab_size, vocab_size_with_added=vocab_size_with_added)

    def save(self, folder: Path) -> None:
        layout: dict[str, object] = {"vocab_size": self.vocab_size,
                                     "vocab_size_with_added": self.vocab_size_with_added}
        with open(folder / TABLES, "wb") as file:
            for name in self.ARRAYS:
                file.write(bytes(-file.tell() % 8))  # each array 8-byte aligned
                layout[name] = [file.tell(), getattr(self, name).nbytes]
                file.write(getattr(self, name))
        (folder / TABLES_LAYOUT).write_text(json.dumps(layout) + "\n")

    def token(self, token_id: int) -> str | None:
        if not 0 <= token_id < len(self.token_starts) - 1:
            return None
        start, end = self.token_starts[token_id], self.token_starts[token_id + 1]
        return str(self.token_bytes[start:end], "utf-8") if end > start else None

    def token_id(self, token: str) -> int | None:
        wanted = token.encode("utf-8")
        at = bisect_left(self.by_bytes, wanted, key=self._bytes_of)
        if at < len(self.by_bytes) and self._bytes_of(self.by_bytes[at]) == wanted:
            return self.by_bytes[at]
        return None

    def _bytes_of(self, token_id: int) -> bytes:
        return bytes(self.token_bytes[self.token_starts[token_id]:self.token_starts[token_id + 1]])

    def merge(self, left: int, right: int) -> tuple[int, int] | None:
        """(rank, merged id) of the merge of this pair, or None."""
        key = left << 32 | right
        at = bisect_left(self.merge_keys, key)
        if at < len(self.merge_keys) and self.merge_keys[at] == key:
            return self.merge_ranks[at], self.merge_results[at]
        return None

    def merged_word(self, symbols: list[int]) -> list[int]:
        """The word's tokens after every merge, in the library's order (the module docstring)."""
        ids, count = list(symbols), len(symbols)
        right_of = list(range(1, count)) + [-1]
        left_of = list(range(-1, count - 1))
        alive = [True] * count
        queue = []
        for position in range(count - 1):
            found = self.merge(ids[position], ids[position + 1])
            if found is not None:
                queue.append((found[0], position, found[1]))
        heapq.heapify(queue)
        while queue:
            rank, position, result = heapq.heappop(queue)
            right = right_of[position]
            if not alive[position] or right < 0:
                continue
            now = self.merge(ids[position], ids[right])
            if now is None or now[1] != result:
                continue  # the pair queued there has changed since
            ids[position], alive[right] = result, False
            after = right_of[right]
            right_of[position] = after
            if after >= 0:
                left_of[after] = position
            before = left_of[position]
            if before >= 0 and (found := self.merge(ids[before], result)) is not None:
                heapq.heappush(queue, (found[0], before, found[1]))
            if after >= 0 and (found := self.merge(result, ids[after])) is not None:
                heapq.heappush(queue, (found[0], position, found[1]))
        return [token for token, kept in zip(ids, alive, strict=True) if kept]


class MergedEncoding:
    """What transformers reads of a `tokenizers.Encoding`, for the merged tokens. Their texts
    and offsets are worked out only when asked for (`tokens`, `offsets`)."""

    def __init__(self, source: Encoding, owner: CompactBPE) -> None:
        self._source, self._owner = source, owner
        # (each of an Encoding's properties builds its whole list anew)
        self._columns = (source.word_ids, source.sequence_ids, source.type_ids,
                         source.special_tokens_mask)
        self._pieces: list[tuple[int, tuple[int, ...], list[int]]] = []  # (start, symbols, merged)
        self.ids: list[int] = []
        self.word_ids: list[int | None] = []
        self.sequence_ids: list[int | None] = []
        self.type_ids: list[int] = []
        self.special_tokens_mask: list[int] = []
        self.overflowing: list[MergedEncoding] = []

    def add(self, start: int, symbols: tuple[int, ...], merged: list[int]) -> None:
        """The word of the source's tokens from `start` on (`symbols`), merged."""
        words, sequences, types, special = self._columns
        self._pieces.append((start, symbols, merged))
        self.ids += merged
        self.word_ids += [words[start]] * len(merged)
        self.sequence_ids += [sequences[start]] * len(merged)
        self.type_ids += [types[start]] * len(merged)
        self.special_tokens_mask += [special[start]] * len(merged)

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def attention_mask(self) -> list[int]:
        return [1] * len(self.ids)

    @property
    def n_sequences(self) -> int:
        return len({s for s in self.sequence_ids if s is not None}) or 1

    @property
    def words(self) -> list[int | None]:
        return self.word_ids

    @property
    def tokens(self) -> list[str]:
        return [self._owner.id_to_token(token) or "" for token in self.ids]

    @property
    def offsets(self) -> list[tuple[int, int]]:
        """Each merged token spans the characters of the symbols it was made of."""
        source, owner = self._source.offsets, self._owner

        def text_of(token_id: int) -> str:
            return owner.id_to_token(token_id) or ""

        spans = []
        for start, symbols, merged in self._pieces:
            at = start
            for token in merged:
                width, first = len(text_of(token)), at
                while width > 0 and at < start + len(symbols):
                    width -= len(text_of(symbols[at - start]))
                    at += 1
                at = max(at, first + 1)
                spans.append((source[first][0], source[min(at, start + len(symbols)) - 1][1]))
        return spans


class CompactBPE:
    """Stands in for a byte-pair `tokenizers.Tokenizer` (a transformers tokenizer's backend):
    the same ids and text, from `Tables` and the library's pipeline over single characters."""

    def __init__(self, pipeline: Tokenizer, tables: Tables, full_file: Path) -> None:
        self._pipeline, self._tables, self._full_file = pipeline, tables, full_file
        self._full: Tokenizer | None = None
        self._words: dict[tuple[int, ...], list[int]] = {}
        # (fixed: adding tokens moves every call to the full tokenizer)
        added = pipeline.get_added_tokens_decoder()
        self._added = {token_id: token.content for token_id, token in added.items()}
        self._added_ids = {content: token_id for token_id, content in self._added.items()}
        self._special = {token.content for token in added.values() if token.special}

    # -- the full tokenizer, for whatever the compact form does not do --------------------
    def full(self) -> Tokenizer:
        """The library's own tokenizer, built once from the saved file and the pipeline's
        present state; from then on it serves every call."""
        if self._full is None:
            self._full = Tokenizer.from_str(self.to_str())
        return self._full

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        if self._full is not None or name not in PIPELINE_ATTRIBUTES:
            return getattr(self.full(), name)
        return getattr(self._pipeline, name)

    def __setattr__(self, name: str, value) -> None:
        if name.startswith("_"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._full or self._pipeline, name, value)

    def __copy__(self) -> CompactBPE:
        twin = CompactBPE(copy.copy(self._pipeline), self._tables, self._full_file)
        twin._full = copy.copy(self._full) if self._full is not None else None
        return twin

    def __reduce__(self):
        return Tokenizer.from_str, (self.to_str(),)

    def to_str(self, pretty: bool = False) -> str:
        """The full tokenizer's JSON: the pipeline's present state with the saved model."""
        if self._full is not None:
            return self._full.to_str(pretty)
        spec = json.loads(self._pipeline.to_str())
        with open(self._full_file, encoding="utf-8") as file:
            spec["model"] = json.load(file)["model"]
        return json.dumps(spec, ensure_ascii=False, indent=2 if pretty else None)

    def save(self, path: str, pretty: bool = True) -> None:
        Path(path).write_text(self.to_str(pretty), encoding="utf-8")

    @property
    def model(self):
        return self.full().model

    # -- what truncation, padding and new tokens need of the full tokenizer --------------
    def enable_truncation(self, *args, **kwargs) -> None:
        self.full().enable_truncation(*args, **kwargs)

    def enable_padding(self, *args, **kwargs) -> None:
        self.full().enable_padding(*args, **kwargs)

    def add_tokens(self, tokens) -> int:
        return self.full().add_tokens(tokens)

    def add_special_tokens(self, tokens) -> int:
        return self.full().add_special_tokens(tokens)

    # -- encoding ------------------------------------------------------------------------
    def encode(self, sequence, pair=None, is_pretokenized: bool = False,
               add_special_tokens: bool = True):
        if self._full is not None or is_pretokenized:
            return self.full().encode(sequence, pair, is_pretokenized, add_special_tokens)
        return self._merged(self._pipeline.encode(sequence, pair, False, add_special_tokens))

    def encode_batch(self, inputs, add_special_tokens: bool = True,
                     is_pretokenized: bool = False):
        if self._full is not None or is_pretokenized:
            return self.full().encode_batch(inputs, add_special_tokens=add_special_tokens,
                                            is_pretokenized=is_pretokenized)
        return [self._merged(encoding) for encoding in self._pipeline.encode_batch(
            inputs, add_special_tokens=add_special_tokens, is_pretokenized=False)]

    def _merged(self, encoding: Encoding) -> MergedEncoding:
        """The encoding with each word's symbols merged. A word is a run of tokens with the
        same (sequence, word index): the pipeline numbers its pre-tokenized splits, added
        tokens included, one index each; the post-processor's tokens have none."""
        ids, words, sequences = encoding.ids, encoding.word_ids, encoding.sequence_ids
        merged = MergedEncoding(encoding, self)
        start = 0
        while start < len(ids):
            end = start + 1
            if words[start] is not None:
                while (end < len(ids) and words[end] == words[start]
                       and sequences[end] == sequences[start]):
                    end += 1
            symbols = tuple(ids[start:end])
            tokens = self._words.get(symbols) if len(symbols) > 1 else list(symbols)
            if tokens is None:
                tokens = self._tables.merged_word(list(symbols))
                if len(self._words) >= WORD_CACHE_SIZE:
                    self._words.clear()
                self._words[symbols] = tokens
            merged.add(start, symbols, tokens)
            start = end
        return merged

    # -- ids and tokens ------------------------------------------------------------------
    def id_to_token(self, token_id: int) -> str | None:
        if self._full is not None:
            return self._full.id_to_token(token_id)
        added = self._added.get(token_id)
        return added if added is not None else self._tables.token(token_id)

    def token_to_id(self, token: str) -> int | None:
        if self._full is not None:
            return self._full.token_to_id(token)
        added = self._added_ids.get(token)
        return added if added is not None else self._tables.token_id(token)

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        if self._full is not None:
            return self._full.get_vocab_size(with_added_tokens)
        tables = self._tables
        return tables.vocab_size_with_added if with_added_tokens else tables.vocab_size

    def get_vocab(self, with_added_tokens: bool = True) -> dict[str, int]:
        if self._full is not None:
            return self._full.get_vocab(with_added_tokens)
        vocab = {}
        for token_id in range(len(self._tables.token_starts) - 1):
            token = self._tables.token(token_id)
            if token is not None:
                vocab[token] = token_id
        if with_added_tokens:
            vocab.update({content: token_id for token_id, content in self._added.items()})
        return vocab

    # -- decoding ------------------------------------------------------------------------
    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        if self._full is not None:
            return self._full.decode(ids, skip_special_tokens=skip_special_tokens)
        tokens = []
        for token_id in ids:
            token = self.id_to_token(int(token_id))
            if token is not None and not (skip_special_tokens and token in self._special):
                tokens.append(token)
        decoder = self._pipeline.decoder
        return decoder.decode(tokens) if decoder is not None else " ".join(tokens)

    def decode_batch(self, sequences, skip_special_tokens: bool = True) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in sequences]


# What the pipeline answers as the full tokenizer would (none of it reads the model).
PIPELINE_ATTRIBUTES = frozenset({
    "normalizer", "pre_tokenizer", "post_processor", "decoder", "truncation", "padding",
    "encode_special_tokens", "num_special_tokens_to_add", "get_added_tokens_decoder",
    "no_truncation", "no_padding", "post_process"})


def compact_form(full: Tokenizer) -> tuple[dict, Tables] | str:
    """(the pipeline's JSON, with a model of single characters and no merges; the tables), or
    why this tokenizer has no compact form."""
    spec = json.loads(full.to_str())
    model = spec["model"]
    if model.get("type") != "BPE":
        return f"its model is {model.get('type')}, not BPE"
    for option, off in (("dropout", None), ("ignore_merges", False),
                        ("continuing_subword_prefix", None), ("end_of_word_suffix", None)):
        if model.get(option) not in (off, ""):
            return f"its BPE model sets {option}"
    vocab: dict[str, int] = model["vocab"]
    count = max(vocab.values(), default=-1) + 1
    by_id: list[bytes] = [b""] * count
    for token, token_id in vocab.items():
        by_id[token_id] = token.encode("utf-8")
    starts = np.zeros(count + 1, np.int64)
    starts[1:] = np.cumsum([len(token) for token in by_id])
    keys, results = [], []
    for merge in model["merges"]:
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        keys.append(vocab[left] << 32 | vocab[right])
        results.append(vocab[left + right])
    keys_array = np.array(keys, np.int64)
    order = np.argsort(keys_array)  # (the library writes each pair once, at its rank)
    tables = Tables.from_arrays(
        full.get_vocab_size(with_added_tokens=False), full.get_vocab_size(with_added_tokens=True),
        token_bytes=np.frombuffer(b"".join(by_id), np.uint8), token_starts=starts,
        by_bytes=np.array(sorted(range(count), key=by_id.__getitem__)),
        merge_keys=keys_array[order], merge_ranks=order, merge_results=np.array(results)[order])
    keep = {token: token_id for token, token_id in vocab.items()
            if len(token) == 1 or BYTE_PIECE.fullmatch(token) or token == model.get("unk_token")}
    # Every added token with its id, those outside the vocabulary too: loading gives an added
    # token the model's id for its text, else the model's size (+ k), which is not the full's.
    keep.update({token["content"]: token["id"] for token in spec["added_tokens"]})
    spec["model"] = dict(model, vocab=keep, merges=[])
    return spec, tables


def save_compact(folder: Path) -> str | None:
    """Write `folder/COMPACT` for the tokenizer saved in `folder`: its files, with the
    pipeline's tokenizer.json, and the tables; checked against the tokenizer as `folder` loads
    it, on a sample of many scripts. Where it has no compact form, write why not instead, and
    return it."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    form = compact_form(tokenizer.backend_tokenizer)
    target = folder / COMPACT
    with tempfile.TemporaryDirectory(dir=folder) as staging:
        staging = Path(staging)
        if isinstance(form, str):
            (staging / NOT_COMPACT).write_text(form + "\n")
        else:
            spec, tables = form
            for path in folder.iterdir():
                if path.is_file() and path.name not in ("tokenizer.json", "config.json"):
                    shutil.copy(path, staging / path.name)
            (staging / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
            tables.save(staging)
            compact = _load(staging, folder / "tokenizer.json")
            reason = _differs(tokenizer, compact)
            if reason is not None:
                for path in staging.iterdir():
                    path.unlink()
                (staging / NOT_COMPACT).write_text(reason + "\n")
                form = reason
        try:
            staging.rename(target)  # atomic: the folder is whole or absent
        except OSError:
            pass  # another process wrote it first
    return form if isinstance(form, str) else None


def _differs(full: PreTrainedTokenizerBase, compact: PreTrainedTokenizerBase) -> str | None:
    """Where the compact tokenizer answers otherwise than the full one on a sample, or None."""
    texts = [SAMPLE_TEXT, SAMPLE_TEXT.upper(), " " + SAMPLE_TEXT[::-1]]
    texts += [token + SAMPLE_TEXT for token in list(full.get_added_vocab())[:8]]
    for text in texts:
        if full(text)["input_ids"] != compact(text)["input_ids"]:
            return f"its compact form encodes {text[:40]!r} otherwise"
    ids = full(SAMPLE_TEXT)["input_ids"] + sorted(full.get_added_vocab().values())[:32]
    for skip in (False, True):
        if full.decode(ids, skip_special_tokens=skip) != compact.decode(
                ids, skip_special_tokens=skip):
            return "its compact form decodes otherwise"
    if len(full) != len(compact) or full.get_added_vocab() != compact.get_added_vocab():
        return "its compact form has other added tokens"
    return None


def _load(compact_folder: Path, full_file: Path) -> PreTrainedTokenizerBase:
    tokenizer = AutoTokenizer.from_pretrained(compact_folder)
    tables = Tables.load(compact_folder)
    tokenizer._tokenizer = CompactBPE(tokenizer._tokenizer, tables, full_file)
    return tokenizer


def load_compact(folder: Path) -> PreTrainedTokenizerBase | None:
    """The compact tokenizer of a cached tokenizer folder, or None where it has none (yet:
    `save_compact` writes it)."""
    if not (folder / COMPACT / TABLES).exists():
        return None
    return _load(folder / COMPACT, folder / "tokenizer.json")


def has_no_compact_form(folder: Path) -> bool:
    return (folder / COMPACT / NOT_COMPACT).exists()
