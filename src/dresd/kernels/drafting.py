"""Drafting in C (`kernels/drafting.c`): PLD's lookup, the suffix drafter's tree over the
request's own tokens, REST's whole lookup, DReSD's query (its key, its search where the store is
an IVF index with fp16 codes, its drafts from the searched neighbours: one call) and the
neighbours' agreeing prefixes, the most frequent prefixes of many continuations (REST, DReSD
with a node budget), and hybrid's step: learning from the last tree, merge, reach estimates and
cut, in one call, with its sources' lookups in the same call where it can (`hybrid_step`).

Why: drafting runs between two verify forwards, on the critical path, and the forward got fast
(~8 ms a step for the default model on one core). The forward leaves every cache cold, and
there a numpy call on a few numbers costs ~3 us, a call into C ~8 us, whatever the work: so each
drafter's step is a few calls here, token ids in and out, rather than numpy over the context.
The suffix drafter kept a per-request suffix trie of Python nodes, D nodes touched for every
token of the context (~60 us a token); the kernel reads the context itself in one pass and grows
the same tree. Hybrid merged and scored its candidates one Python object per node; here they are
columns of one int32 block, and its acceptance table three arrays indexed by cell. What each
piece saved: `benchmarks/results/drafter_profile/` and `benchmarks/results/drafting_ab.md`.

Portable C (no instruction-set flags): where there is no compiler, or `DRESD_C_DRAFTING=0`,
`kernel()` is None and the Python versions draft the same trees, as the tests check.
"""

from __future__ import annotations

import ctypes
import functools
from array import array
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from dresd import kernels
from dresd.errors import DresdError

SOURCE = Path(__file__).with_name("drafting.c")
# -O3: the loops of DReSD's key (`dresd_dense_key`) vectorize; no flag that reorders a sum.
FLAGS = ("-O3", "-std=gnu11", "-shared", "-fPIC", "-lm")


@functools.cache
def kernel() -> ctypes.CDLL | None:
    """The compiled kernel (compiled on first use, then cached), or None where it cannot be."""
    library = kernels.load(SOURCE, FLAGS, "DRESD_C_DRAFTING", "Python drafting")
    if library is None:
        return None
    function = library.dresd_suffix_context_tree
    pointer, i64, i32, f64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_double
    function.argtypes = [pointer, i64, i32, f64, f64, i32, f64, i32, i32,
                         pointer, pointer, pointer, pointer]
    function.restype = i32
    library.dresd_hybrid_draft.argtypes = [pointer, i32, pointer, i32, i32, pointer, i32,
                                           pointer, pointer, i32, pointer, pointer, pointer,
                                           i32, pointer, pointer, pointer, f64, pointer, i32,
                                           pointer]
    library.dresd_hybrid_draft.restype = i32
    library.dresd_frequent_prefixes.argtypes = [pointer, i64, i64, i32, i32, pointer, pointer]
    library.dresd_frequent_prefixes.restype = i32
    library.dresd_rest_lookup.argtypes = [pointer, i64, i32, pointer, i32, i64, pointer, i64,
                                          pointer, i64, pointer, i32, i32, i32, i32, pointer,
                                          pointer]
    library.dresd_rest_lookup.restype = i32
    library.dresd_dense_drafts.argtypes = [pointer, i32, pointer, i32, i64, pointer, i32, i64,
                                           pointer, i64, i32, i64, i32, pointer]
    library.dresd_dense_drafts.restype = i32
    library.dresd_dense_key.argtypes = [pointer, i32, i32, pointer, pointer, i32, pointer]
    library.dresd_dense_key.restype = None
    library.dresd_prompt_lookup.argtypes = [pointer, i64, i32, i32, i32, i32, pointer, pointer]
    library.dresd_prompt_lookup.restype = i32
    library.dresd_agreeing_prefixes.argtypes = [pointer, i64, i64, pointer, pointer]
    library.dresd_agreeing_prefixes.restype = i32
    library.dresd_ivf_search.argtypes = [pointer, i32, pointer, pointer, i64, ctypes.c_float,
                                         i32, i32, pointer, pointer, pointer, i32, pointer,
                                         pointer]
    library.dresd_ivf_search.restype = i32
    library.dresd_dense_neighbour_rows.argtypes = [pointer, pointer, i32, i32, i64, i32,
                                                   pointer]
    library.dresd_dense_neighbour_rows.restype = i32
    library.dresd_dense_candidates.argtypes = [pointer, pointer, i32, i32, i64, i32, pointer]
    library.dresd_dense_candidates.restype = i32
    library.dresd_hybrid_step.argtypes = [pointer, pointer, pointer, i32, pointer, i64, pointer,
                                          i32, i32, i32, pointer, pointer, pointer, i32, f64,
                                          pointer, pointer, i32, pointer, i32, i32, pointer,
                                          i32, pointer, pointer, pointer, f64, pointer, i32,
                                          pointer]
    library.dresd_hybrid_step.restype = i32
    return library


def address(array: np.ndarray) -> int:
    """Where `array`'s data starts, for a kernel call. `array.ctypes.data` builds a ctypes
    object each time: ~3 us with the caches a forward leaves, where a view of the buffer costs
    ~1, and a hybrid step makes ~30 such calls (5-11 us a step saved in two paired runs of
    `benchmarks/micro/drafting_ab.py`, whose noise floor is ~4). Read-only arrays (a
    memory-mapped store's) and empty ones take the slow path.
    The array must be C-contiguous, as every kernel here reads it."""
    if array.flags.writeable and array.nbytes:
        return ctypes.addressof(ctypes.c_char.from_buffer(array))
    return array.ctypes.data


def cut_rows(rows: np.ndarray, lengths: np.ndarray, count: int) -> list[list[int]]:
    """A kernel's output rows [>= count, width] as lists: the first `count`, each cut to its
    length."""
    return [row[:length] for row, length in zip(rows[:count].tolist(),
                                                lengths[:count].tolist(), strict=True)]


class ContextTree(NamedTuple):
    """A speculation tree: tokens[i] below parents[i] (-1: below the match), its probs."""

    tokens: list[int]
    parents: list[int]
    probs: list[float]
    match_len: int


def suffix_context_tree(context: np.ndarray, max_depth: int, factor: float, offset: float,
                        max_nodes: int, min_prob: float, max_len: int, tree: bool
                        ) -> ContextTree:
    """The best speculation tree of the suffix trie of `context` (int64), as
    `SuffixDrafter.best_tree` grows it from its per-request trie; the kernel must be loaded."""
    library = kernel()
    context = np.ascontiguousarray(context, dtype=np.int64)
    tokens = np.empty(max_nodes, dtype=np.int32)
    parents = np.empty(max_nodes, dtype=np.int32)
    probs = np.empty(max_nodes, dtype=np.float64)
    match_len = ctypes.c_int32(0)
    count = library.dresd_suffix_context_tree(
        address(context), len(context), max_depth, factor, offset, max_nodes, min_prob,
        max_len, 0 if tree else 1, address(tokens), address(parents), address(probs),
        ctypes.byref(match_len))
    if count < 0:
        raise MemoryError("the suffix drafting kernel ran out of memory")
    return ContextTree(tokens[:count].tolist(), parents[:count].tolist(),
                       probs[:count].tolist(), match_len.value)


# The columns of a `HybridTree` block, in the kernel's order (`T_TOKEN` ... in drafting.c).
TREE_COLUMNS = ("tokens", "parents", "depths", "sources", "support", "votes", "shares",
                "first_kid", "next_sibling", "last_kid")


class HybridTree:
    """Hybrid's merged candidate trie in the kernel's columns (node 0: the root), made and cut
    by `drafted`. `sources` holds each node's proposing sources as a bitmask (bit i: the
    acceptance table's i-th source), `shares` the best count-share bucket (-1: none). `block`
    holds the columns, `capacity` nodes apart, from `address` on. The kernel must be loaded."""

    def __len__(self) -> int:
        """Nodes, the root included."""
        return self.nodes

    @classmethod
    def drafted(cls, tokens: array, offsets: array, sources: array, neighbours: array,
                shares: array, max_len: int, accepted: np.ndarray, tried: np.ndarray,
                prior: np.ndarray, strength: float, costs: np.ndarray, max_nodes: int,
                last: HybridTree | None = None, emitted: list[int] = (), num_sources: int = 0
                ) -> tuple[HybridTree, list[list[int]], int, list[int]]:
        """A hybrid step in one kernel call. First, with `last` (the previous step's tree),
        its learning: every child of the emitted path's nodes is a trial of its cell in the
        table's `accepted` and `tried`, accepted if its token came. Then merge candidates:
        candidate c is tokens[offsets[c] : offsets[c + 1]] (cut to `max_len`) with its
        source's bit, its neighbour count and per-token shares (NaN: none). Then the cut:
        reach estimates from the table (accepted, tried, prior, strength), and of the
        `max_nodes` most probable nodes the first n maximising (1 + their reach) /
        costs[n + 1]. Returns (the tree, the kept leaves' paths from the root's child down,
        most probable first, n, per source bit the accepted tokens `last` lost without it
        (-1: none)).

        The candidates come as `array`s (int64 'q', shares float64 'd'), which Python fills
        and hands over at half numpy's cost with the caches a forward leaves (~2 us an array
        against ~4); the outputs come back in one int32 record, read with one call."""
        tree, record = cls._room(len(tokens) + 1, num_sources, max_nodes, max_len)
        emitted = array("q", emitted)  # named, so that it lives until the call returns
        written = kernel().dresd_hybrid_draft(
            None if last is None else last.address, 0 if last is None else last.capacity,
            emitted.buffer_info()[0], len(emitted), num_sources, tree.address, tree.capacity,
            tokens.buffer_info()[0], offsets.buffer_info()[0], len(offsets) - 1,
            sources.buffer_info()[0], neighbours.buffer_info()[0], shares.buffer_info()[0],
            max_len, address(accepted), address(tried), address(prior), strength,
            address(costs), max_nodes, address(record))
        return (tree, *tree._read(record, written, num_sources))

    @classmethod
    def _room(cls, capacity: int, num_sources: int, max_nodes: int, max_len: int
              ) -> tuple[HybridTree, np.ndarray]:
        """A tree of `capacity` nodes for the kernel to fill, and its record."""
        tree = cls.__new__(cls)
        tree.capacity = capacity
        tree.block = np.empty((len(TREE_COLUMNS), capacity), dtype=np.int32)
        tree.address = address(tree.block)
        # the kernel's record: nodes, kept, lost per source, then (length, tokens...) per path
        record = np.empty(2 + num_sources + max_nodes * (max(max_len, 0) + 1), dtype=np.int32)
        return tree, record

    def _read(self, record: np.ndarray, written: int, num_sources: int
              ) -> tuple[list[list[int]], int, list[int]]:
        """(paths, kept, lost per source) from the kernel's record; sets the tree's size."""
        if written < 0:
            raise MemoryError("the hybrid kernel ran out of room for its tree")
        values = record[:written].tolist()
        self.nodes, kept = values[0], values[1]
        paths, at = [], 2 + num_sources
        while at < written:
            length = values[at]
            paths.append(values[at + 1 : at + 1 + length])
            at += 1 + length
        return paths, kept, values[2 : 2 + num_sources]


def frequent_prefixes(rows: np.ndarray, max_nodes: int, is_sorted: bool = False
                      ) -> list[np.ndarray]:
    """`prefixes.most_frequent_prefixes` in C: the leaves of the trie of the `max_nodes` most
    frequent prefixes of `rows` (int [m, width], positive ids then zeros), in rank order.
    `is_sorted`: the rows are in lexicographic order already."""
    rows = np.array(rows, dtype=np.int32, order="C")  # a copy: the kernel sorts it in place
    leaf_rows = np.empty(max_nodes, dtype=np.int32)
    leaf_depths = np.empty(max_nodes, dtype=np.int32)
    count = kernel().dresd_frequent_prefixes(address(rows), rows.shape[0], rows.shape[1],
                                             int(is_sorted), max_nodes, address(leaf_rows),
                                             address(leaf_depths))
    if count < 0:
        raise MemoryError("the prefix-tree kernel ran out of memory")
    return [rows[r, :d] for r, d in zip(leaf_rows[:count].tolist(),
                                        leaf_depths[:count].tolist(), strict=True)]


class RestIndex(NamedTuple):
    """A suffix array's arrays as `rest_lookup` reads them: their addresses, taken once
    (`rest_index`). A memory map's address costs ~3 us (~11 with the caches a forward leaves),
    every step, where an int costs nothing; the owner keeps the arrays alive."""

    symbols: int  # the index's big-endian symbol stream
    symbols_bytes: int
    symbol_width: int  # bytes a symbol
    suffix_array: int
    suffix_array_wide: int  # 1: int64, 0: int32
    suffixes: int
    symbol_of: int  # token id -> symbol (`SparseIndex.symbol_table`)
    table_len: int
    alphabet: int


class DamagedStore(DresdError):
    """A datastore's arrays that do not fit together: the kernel would read outside them."""


def rest_index(symbols: np.ndarray, suffix_array: np.ndarray, symbol_of: np.ndarray,
               alphabet: np.ndarray) -> RestIndex:
    """`symbols`: the index's big-endian stream; `symbol_of`: its id -> symbol table. The
    arrays come from files: checked once here to fit together (every suffix inside the stream,
    every symbol one the alphabet has), as `dresd_rest_lookup` reads them unchecked."""
    width = symbols.dtype.itemsize
    if len(suffix_array) and (int(suffix_array.min()) < 0
                              or int(suffix_array.max()) > symbols.nbytes - width
                              or np.any(suffix_array % width)):
        raise DamagedStore(f"the sparse store's suffix array points outside its {len(symbols)}"
                           " symbols: is the store damaged?")
    if (len(symbols) and int(symbols.max()) > len(alphabet)) or (
            len(symbol_of) and int(symbol_of.max()) > len(alphabet)):
        raise DamagedStore(f"the sparse store holds symbols its alphabet of {len(alphabet)} "
                           "has not: is the store damaged?")
    return RestIndex(address(symbols), symbols.nbytes, symbols.dtype.itemsize,
                     address(suffix_array), int(suffix_array.dtype == np.int64),
                     len(suffix_array), address(symbol_of), len(symbol_of), address(alphabet))


def rest_lookup(index: RestIndex, token_ids: np.ndarray, min_suffix: int, max_matches: int,
                draft_len: int, max_nodes: int) -> list[list[int]]:
    """REST's lookup in one suffix array (`RestDrafter.propose`, one store), token ids in and
    out: the leaves of the draft tree, most frequent first. `token_ids`: the context's last
    tokens (the longest suffix looked up at most)."""
    token_ids = np.ascontiguousarray(token_ids, dtype=np.int64)
    leaf_tokens = np.empty((max_nodes, draft_len), dtype=np.int32)
    leaf_lengths = np.empty(max_nodes, dtype=np.int32)
    count = kernel().dresd_rest_lookup(
        index.symbols, index.symbols_bytes, index.symbol_width, index.suffix_array,
        index.suffix_array_wide, index.suffixes, address(token_ids), len(token_ids),
        index.symbol_of, index.table_len, index.alphabet, min_suffix, max_matches, draft_len,
        max_nodes, address(leaf_tokens), address(leaf_lengths))
    if count < 0:
        raise MemoryError("the REST kernel ran out of memory")
    return cut_rows(leaf_tokens, leaf_lengths, count)


class DenseStore(NamedTuple):
    """A dense datastore's arrays as `dense_drafts` reads them: their addresses, taken once
    (`dense_store`, as `RestIndex`'s); the owner keeps the arrays alive."""

    offsets: int
    offset_width: int  # bytes an offset (uint32 or int64)
    stream: int
    token_width: int  # bytes a token (uint16 or uint32)
    stream_len: int
    doc_starts: int
    documents: int
    value_len: int
    entries: int  # the offsets' count (the ids the index may return)


def dense_store(offsets: np.ndarray, stream: np.ndarray, doc_starts: np.ndarray,
                value_len: int) -> DenseStore | None:
    """The store as `dense_drafts` reads it, or None where it cannot (no kernel, or dtypes
    it does not read: offsets uint32 or int64, stream uint16 or uint32, C-contiguous). The
    arrays come from the store's files: checked once here to fit together (`DamagedStore`)."""
    if not (kernel() is not None and offsets.dtype in (np.uint32, np.int64)
            and stream.dtype in (np.uint16, np.uint32) and doc_starts.dtype == np.int64
            and all(a.flags.c_contiguous for a in (offsets, stream, doc_starts))):
        return None
    if len(offsets) and (int(offsets.min()) < 0 or int(offsets.max()) >= len(stream)):
        raise DamagedStore(f"the dense store's offsets point outside its stream of "
                           f"{len(stream)} tokens: is the store damaged?")
    if (len(doc_starts) < 2 or doc_starts[0] != 0 or doc_starts[-1] != len(stream)
            or np.any(np.diff(doc_starts) < 0)):
        raise DamagedStore(f"the dense store's document starts do not run from 0 to its "
                           f"stream's {len(stream)} tokens: is the store damaged?")
    return DenseStore(address(offsets), offsets.dtype.itemsize, address(stream),
                      stream.dtype.itemsize, len(stream), address(doc_starts),
                      len(doc_starts) - 1, value_len, len(offsets))


def dense_drafts(ids: np.ndarray, store: DenseStore, bonus: int, draft_len: int) -> np.ndarray:
    """`DenseDrafter.neighbour_drafts` after the search: the drafts of the entries `ids` (rank
    order) whose value starts with `bonus`, as rows of token ids + 1 followed by zeros (int32
    [kept, draft_len])."""
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    rows = np.empty((len(ids), draft_len), dtype=np.int32)
    kept = kernel().dresd_dense_drafts(
        address(ids), len(ids), store.offsets, store.offset_width, store.entries, store.stream,
        store.token_width, store.stream_len, store.doc_starts, store.documents,
        store.value_len, bonus, draft_len, address(rows))
    return rows[:kept]


def agreeing_prefixes(rows: np.ndarray) -> list[tuple[list[int], int]]:
    """`dense.agreeing_prefixes` of the kernel's padded rows (`dense_drafts`: token ids + 1
    followed by zeros, int32 C-contiguous, rank order), as (draft, count) pairs in its order.
    Sorts `rows` in place."""
    lengths = np.empty(len(rows), dtype=np.int32)
    counts = np.empty(len(rows), dtype=np.int32)
    found = kernel().dresd_agreeing_prefixes(address(rows), rows.shape[0], rows.shape[1],
                                             address(lengths), address(counts))
    if found < 0:
        raise MemoryError("the DReSD candidates kernel ran out of memory")
    return list(zip(cut_rows(rows, lengths, found), counts[:found].tolist(), strict=True))


class KeyWeights(NamedTuple):
    """DReSD's key transform as `dense_key` reads it: W transposed ([d, dim] float32,
    C-contiguous) and b ([dim]), their addresses taken once (`key_weights`); the owner
    (`KeyTransform`) keeps the arrays alive."""

    weight_t: int
    bias: int
    d: int
    dim: int


def key_weights(weight_t: np.ndarray, bias: np.ndarray) -> KeyWeights:
    return KeyWeights(address(weight_t), address(bias), weight_t.shape[0], weight_t.shape[1])


def kernel_row(hidden: torch.Tensor) -> torch.Tensor:
    """A hidden state [d] on the CPU as the kernels read it: bf16 as it is, any other dtype as
    float32, contiguous (the caller keeps it alive through the call)."""
    if hidden.dtype not in (torch.bfloat16, torch.float32):
        hidden = hidden.float()
    return hidden.contiguous()


def dense_key(hidden: torch.Tensor, weights: KeyWeights) -> np.ndarray:
    """`KeyTransform.apply` for one hidden state [d] (bf16 or float32, on the CPU): the unit key
    [dim] float32. One C call on the forward's own row, where numpy's path (a float copy, a
    product, a norm, a division) costs ~80 us with the caches a forward leaves, and this ~30."""
    hidden = kernel_row(hidden)
    key = np.empty(weights.dim, dtype=np.float32)
    kernel().dresd_dense_key(hidden.data_ptr(), int(hidden.dtype == torch.bfloat16), weights.d,
                             weights.weight_t, weights.bias, weights.dim, address(key))
    return key


def prompt_lookup(tokens: np.ndarray, max_ngram: int, min_ngram: int, draft_len: int,
                  num_drafts: int) -> list[list[int]]:
    """`PromptLookupDrafter.propose` over `tokens` (the context, int64) in one call: numpy's
    path makes ~10 calls over the context, ~3 us each with the caches a forward leaves."""
    tokens = np.ascontiguousarray(tokens, dtype=np.int64)
    drafts = np.empty((num_drafts, draft_len), dtype=np.int32)
    lengths = np.empty(num_drafts, dtype=np.int32)
    count = kernel().dresd_prompt_lookup(address(tokens), len(tokens), max_ngram, min_ngram,
                                         draft_len, num_drafts, address(drafts),
                                         address(lengths))
    return cut_rows(drafts, lengths, count)


CENTROID_BLOCK = 32  # centroids a block of `IvfLists.centroid_blocks` holds (drafting.c)
MAX_PROBES = 32  # lists `ivf_search` probes at most (drafting.c)


class IvfLists(NamedTuple):
    """A FAISS IVF index with fp16 codes as `ivf_search` reads it (`ivf_lists`), its arrays'
    addresses taken once (as `RestIndex`'s): its centroids (float32 [nlist, dim], and in half
    precision in blocks of 32, [block][dim][32], zeros past nlist, for the coarse pass), and
    per list where FAISS keeps its codes and ids and how many entries it holds. `arrays` keeps
    ours alive; the owner keeps the FAISS index alive."""

    centroids: int
    centroid_blocks: int
    nlist: int
    dim: int
    max_norm: float  # the largest centroid's norm (the coarse pass's rounding bound)
    codes: int  # int64 [nlist]: addresses
    ids: int  # int64 [nlist]: addresses
    sizes: int  # int64 [nlist]
    by_residual: bool
    arrays: tuple[np.ndarray, ...]


def ivf_lists(index) -> IvfLists | None:
    """`index`'s lists for `ivf_search`, or None where the kernel cannot search it: no kernel,
    or not an inner-product `IndexIVFScalarQuantizer` with fp16 codes over a flat quantizer."""
    import faiss

    if kernel() is None or not isinstance(index, faiss.IndexIVFScalarQuantizer):
        return None
    quantizer = faiss.downcast_index(index.quantizer)
    if (index.sq.qtype != faiss.ScalarQuantizer.QT_fp16
            or index.metric_type != faiss.METRIC_INNER_PRODUCT
            or not isinstance(quantizer, faiss.IndexFlat)
            or quantizer.metric_type != faiss.METRIC_INNER_PRODUCT or index.nlist < 1):
        return None
    nlist, dim = index.nlist, index.d
    centroids = np.array(faiss.rev_swig_ptr(quantizer.get_xb(), nlist * dim),
                         dtype=np.float32).reshape(nlist, dim)
    blocks = -(-nlist // CENTROID_BLOCK)
    padded = np.zeros((blocks * CENTROID_BLOCK, dim), dtype=np.float16)
    padded[:nlist] = centroids
    centroid_blocks = np.ascontiguousarray(
        padded.reshape(blocks, CENTROID_BLOCK, dim).transpose(0, 2, 1))
    lists = index.invlists
    # an empty list's pointers are NULL (None here), and never read
    codes = np.array([int(lists.get_codes(i) or 0) for i in range(nlist)], dtype=np.int64)
    ids = np.array([int(lists.get_ids(i) or 0) for i in range(nlist)], dtype=np.int64)
    sizes = np.array([lists.list_size(i) for i in range(nlist)], dtype=np.int64)
    return IvfLists(address(centroids), address(centroid_blocks), nlist, dim,
                    float(np.linalg.norm(centroids, axis=1).max()), address(codes),
                    address(ids), address(sizes), bool(index.by_residual),
                    (centroids, centroid_blocks, codes, ids, sizes))


def ivf_search(query: np.ndarray, lists: IvfLists, nprobe: int, k: int
               ) -> tuple[np.ndarray, np.ndarray]:
    """(scores [k], ids [k]) of one query [dim] float32 in `lists`, best first, -1 ids after
    the last found: FAISS's search of the same index (the same lists probed, the same scores up
    to the order of a sum's terms), in one call. 1 <= nprobe <= MAX_PROBES."""
    scores = np.empty(k, dtype=np.float32)
    found = np.empty(k, dtype=np.int64)
    status = kernel().dresd_ivf_search(
        address(query), lists.dim, lists.centroids, lists.centroid_blocks, lists.nlist,
        lists.max_norm, nprobe, int(lists.by_residual), lists.codes, lists.ids, lists.sizes, k,
        address(scores), address(found))
    if status == -1:
        raise ValueError(f"ivf_search probes 1 to {MAX_PROBES} lists, not {nprobe}")
    if status < 0:
        raise MemoryError("the IVF search kernel ran out of memory")
    return scores, found


class DensePlan(ctypes.Structure):
    """What DReSD's query in one call (`dense_neighbour_rows`) reads, set once per store:
    `drafting.c`'s struct dense_plan, field for field. `arrays` keeps the IVF lists' arrays
    alive; the owners keep the transform, the store and the FAISS index alive."""

    _fields_ = [("weight_t", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("d", ctypes.c_int64), ("dim", ctypes.c_int64),
                ("centroids", ctypes.c_void_p), ("centroid_blocks", ctypes.c_void_p),
                ("nlist", ctypes.c_int64), ("nprobe", ctypes.c_int64),
                ("by_residual", ctypes.c_int64), ("max_norm", ctypes.c_double),
                ("codes", ctypes.c_void_p), ("ids", ctypes.c_void_p), ("sizes", ctypes.c_void_p),
                ("offsets", ctypes.c_void_p), ("offset_width", ctypes.c_int64),
                ("stream", ctypes.c_void_p), ("token_width", ctypes.c_int64),
                ("stream_len", ctypes.c_int64), ("doc_starts", ctypes.c_void_p),
                ("documents", ctypes.c_int64), ("value_len", ctypes.c_int64),
                ("entries", ctypes.c_int64)]


def dense_plan(weights: KeyWeights, lists: IvfLists, nprobe: int, store: DenseStore
               ) -> tuple[DensePlan, int] | None:
    """The plan and its address for `dense_neighbour_rows`, or None where nprobe is out of
    the kernel's range (FAISS searches then)."""
    if not 1 <= nprobe <= MAX_PROBES:
        return None
    plan = DensePlan(weights.weight_t, weights.bias, weights.d, weights.dim, lists.centroids,
                     lists.centroid_blocks, lists.nlist, nprobe, int(lists.by_residual),
                     lists.max_norm, lists.codes, lists.ids, lists.sizes, store.offsets,
                     store.offset_width, store.stream, store.token_width, store.stream_len,
                     store.doc_starts, store.documents, store.value_len, store.entries)
    plan.arrays = lists.arrays
    return plan, ctypes.addressof(plan)


def dense_neighbour_rows(plan: tuple[DensePlan, int], hidden: torch.Tensor, k: int, bonus: int,
                         draft_len: int) -> np.ndarray:
    """`dense_key`, `ivf_search` and `dense_drafts` in one call: the drafts of the k nearest
    entries to hidden state `hidden` [d] (bf16 or float32, on the CPU) whose value starts with
    `bonus`, as `dense_drafts` gives them (int32 [kept, draft_len])."""
    hidden = kernel_row(hidden)
    rows = np.empty((k, draft_len), dtype=np.int32)
    kept = kernel().dresd_dense_neighbour_rows(plan[1], hidden.data_ptr(),
                                               int(hidden.dtype == torch.bfloat16), k, bonus,
                                               draft_len, address(rows))
    if kept < 0:
        raise MemoryError("the DReSD query kernel ran out of memory")
    return rows[:kept]


def dense_candidates(plan: tuple[DensePlan, int], hidden: torch.Tensor, k: int, bonus: int,
                     draft_len: int) -> list[tuple[list[int], int]]:
    """`dense_neighbour_rows` and `agreeing_prefixes` in one call: (draft, count) pairs in
    `agreeing_prefixes`' order, read from one int32 record."""
    hidden = kernel_row(hidden)
    record = np.empty(1 + k * (draft_len + 2), dtype=np.int32)
    written = kernel().dresd_dense_candidates(plan[1], hidden.data_ptr(),
                                              int(hidden.dtype == torch.bfloat16), k, bonus,
                                              draft_len, address(record))
    if written < 0:
        raise MemoryError("the DReSD query kernel ran out of memory")
    values = record[:written].tolist()
    found, at = [], 1
    for _ in range(values[0]):
        length, count = values[at], values[at + 1]
        found.append((values[at + 2 : at + 2 + length], count))
        at += 2 + length
    return found


# The sources `hybrid_step` consults, by kind (`SOURCE_PLD` ... in drafting.c).
SOURCE_KINDS = {"pld": 0, "suffix": 1, "rest": 2, "dresd": 3}


class HybridSources(ctypes.Structure):
    """Hybrid's sources as `hybrid_step` reads them, set once: `drafting.c`'s struct
    hybrid_sources, field for field (a source hybrid lacks keeps zeros)."""

    _fields_ = [("pld_max_ngram", ctypes.c_int64), ("pld_min_ngram", ctypes.c_int64),
                ("pld_num_drafts", ctypes.c_int64), ("suffix_max_depth", ctypes.c_int64),
                ("suffix_max_nodes", ctypes.c_int64), ("suffix_single_path", ctypes.c_int64),
                ("suffix_factor", ctypes.c_double), ("suffix_offset", ctypes.c_double),
                ("suffix_min_prob", ctypes.c_double), ("rest_symbols", ctypes.c_void_p),
                ("rest_symbols_bytes", ctypes.c_int64), ("rest_symbol_width", ctypes.c_int64),
                ("rest_suffix_array", ctypes.c_void_p), ("rest_wide", ctypes.c_int64),
                ("rest_suffixes", ctypes.c_int64), ("rest_symbol_of", ctypes.c_void_p),
                ("rest_table_len", ctypes.c_int64), ("rest_alphabet", ctypes.c_void_p),
                ("rest_min_suffix", ctypes.c_int64), ("rest_max_suffix", ctypes.c_int64),
                ("rest_max_matches", ctypes.c_int64), ("rest_max_nodes", ctypes.c_int64),
                ("dense", ctypes.c_void_p), ("dense_k", ctypes.c_int64)]


class StepSources(NamedTuple):
    """A `HybridSources` and what `hybrid_step` is called with for it: its address, the most
    candidate tokens a step's sources give (the tree's room) and what keeps its pointers
    valid (the DReSD plan)."""

    sources: HybridSources
    address: int
    most_tokens: int
    keep: object


class StepBuffers:
    """One hybrid drafter's buffers for `hybrid_step`, kept from step to step with their
    addresses: with the caches a forward leaves, an `np.empty` and an `address` cost ~2-5 us
    each, and a step made ~15 of them (~25 us in all). Two tree blocks are used in turn (the
    last step's tree is read while the new one is written), then the record and the sources'
    seconds; arrays owned elsewhere (the acceptance table's, the cost table) have their
    addresses remembered for as long as they are the same objects. A fork has its own."""

    def __init__(self) -> None:
        self.blocks: list[tuple[np.ndarray, int]] = []
        self.turn = 0
        self.record: tuple[np.ndarray, int] = (np.empty(0, dtype=np.int32), 0)
        self.seconds = np.zeros(len(SOURCE_KINDS), dtype=np.float64)
        self.seconds_at = address(self.seconds)
        self.known: dict[int, tuple[np.ndarray, int]] = {}  # id -> (array, its address)

    def tree(self, capacity: int, last: HybridTree | None) -> HybridTree:
        """A tree of at least `capacity` nodes to fill, in the block `last` does not use."""
        if len(self.blocks) < 2:
            self.blocks.append((np.empty(0, dtype=np.int32), 0))
        turn = self.turn
        if last is not None and last.block is self.blocks[turn][0]:
            turn = 1 - turn  # never the block the last tree is read from
        block, at = self.blocks[turn]
        if block.size == 0 or block.shape[1] < capacity:
            block = np.empty((len(TREE_COLUMNS), max(capacity, 2 * block.shape[-1])),
                             dtype=np.int32)
            at = address(block)
            self.blocks[turn] = (block, at)
        self.turn = 1 - turn
        tree = HybridTree.__new__(HybridTree)
        tree.block, tree.capacity, tree.address = block, block.shape[1], at
        return tree

    def record_of(self, size: int) -> tuple[np.ndarray, int]:
        if self.record[0].size < size:
            record = np.empty(size, dtype=np.int32)
            self.record = (record, address(record))
        return self.record

    def address(self, array: np.ndarray) -> int:
        """`address(array)`, remembered while `array` is the same object (held here, so that
        its id cannot be another array's)."""
        found = self.known.get(id(array))
        if found is None or found[0] is not array:
            if len(self.known) > 16:
                self.known.clear()
            found = self.known[id(array)] = (array, address(array))
        return found[1]


def hybrid_step(plan: StepSources, buffers: StepBuffers, kinds: array, bits: array,
                context: np.ndarray, hidden: torch.Tensor | None, draft_len: int,
                max_draft_len: int, suffix_global: tuple[array, array, array, float] | None,
                accepted: np.ndarray, tried: np.ndarray, prior: np.ndarray, strength: float,
                costs: np.ndarray, max_nodes: int, last: HybridTree | None,
                emitted: list[int], num_sources: int
                ) -> tuple[HybridTree, list[list[int]], int, list[int], list[float]]:
    """A hybrid step in one call, the sources' lookups included: the sources of `kinds`
    (`SOURCE_KINDS`, in hybrid's order, each with its table bit) consulted on `context` (int64,
    C-contiguous; `hidden`: its last state, for DReSD), then `HybridTree.drafted` on their
    candidates, written into `buffers`. `suffix_global`: the suffix drafter's tree of its
    global trie (tokens, offsets, shares, score), or None. Returns `drafted`'s four, then each
    source's seconds."""
    global_count = -1
    global_tokens = global_offsets = global_shares = None
    global_score = 0.0
    if suffix_global is not None:
        global_tokens, global_offsets, global_shares, global_score = suffix_global
        global_count = len(global_offsets) - 1
    room = plan.most_tokens + (len(global_tokens) if global_tokens is not None else 0) + 1
    tree = buffers.tree(room, last)
    record, record_at = buffers.record_of(2 + num_sources + max_nodes * (max(draft_len, 0) + 1))
    emitted = array("q", emitted)  # named, so that it lives until the call returns
    if hidden is not None:
        hidden = kernel_row(hidden)
    remembered = buffers.address
    written = kernel().dresd_hybrid_step(
        plan.address, kinds.buffer_info()[0], bits.buffer_info()[0], len(kinds),
        address(context), len(context), None if hidden is None else hidden.data_ptr(),
        int(hidden is not None and hidden.dtype == torch.bfloat16), draft_len, max_draft_len,
        None if global_tokens is None else global_tokens.buffer_info()[0],
        None if global_offsets is None else global_offsets.buffer_info()[0],
        None if global_shares is None else global_shares.buffer_info()[0], global_count,
        global_score, buffers.seconds_at, None if last is None else last.address,
        0 if last is None else last.capacity, emitted.buffer_info()[0], len(emitted),
        num_sources, tree.address, tree.capacity, remembered(accepted), remembered(tried),
        remembered(prior), strength, remembered(costs), max_nodes, record_at)
    return (tree, *tree._read(record, written, num_sources), buffers.seconds[:len(kinds)].tolist())
