"""Drafting in C (`kernels/drafting.c`): the suffix drafter's tree over the request's own tokens.

Why: drafting runs between two verify forwards, on the critical path, and the forward got fast
(~8 ms a step for the default model on one core). The suffix drafter kept a per-request suffix
trie of Python nodes, D nodes touched for every token of the context (~60 us a token); the
kernel reads the context itself in one pass and grows the same tree, so a step costs what its
matches cost, whatever the drafter skipped before (`benchmarks/results/drafter_profile/`).

Portable C (no instruction-set flags): where there is no compiler, or `DRESD_C_DRAFTING=0`,
`kernel()` is None and the Python trie drafts the same trees.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import NamedTuple

import numpy as np

from dresd import kernels

SOURCE = Path(__file__).with_name("drafting.c")
FLAGS = ("-O2", "-std=gnu11", "-shared", "-fPIC")


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
    return library


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
        context.ctypes.data, len(context), max_depth, factor, offset, max_nodes, min_prob,
        max_len, 0 if tree else 1, tokens.ctypes.data, parents.ctypes.data, probs.ctypes.data,
        ctypes.byref(match_len))
    if count < 0:
        raise MemoryError("the suffix drafting kernel ran out of memory")
    return ContextTree(tokens[:count].tolist(), parents[:count].tolist(),
                       probs[:count].tolist(), match_len.value)
