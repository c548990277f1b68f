"""The machine's verify-cost curve: what a forward over a tree of t tokens costs, in decode steps.

Whether a draft pays depends on this curve: a tree of t tokens that is expected to yield E tokens
is worth verifying when E / cost(t) beats plain decoding's 1 / cost(1) = 1. The curve depends on
the model, the dtype, the thread count and the device (on a GPU: which GPU), so `dresd
calibrate` measures it once for each and caches it as JSON under `$DRESD_CACHE/calibration/`;
the `hybrid` drafter reads it. On a GPU every timed forward ends with a synchronisation, so the
curve is the GPU's, not its kernel-launch times.

    cost(t) = median over repeats of (time of a forward over t tree tokens
                                      / time of the one-token step timed just before it)

measured on a warm KV cache of `context_len` random tokens (384: a prompt plus part of its
answer), tree sizes in a new random order each repetition. Pairing each tree with the step just
before it cancels drift and other jobs on the machine, which shift both alike; a fixed order
(1, 2, ..., 64, 1, ...) measured every one-token step right after the largest tree, and on this
CPU read cost(16) as 1.38 one run and 1.64 the next. The mask is built inside the timed region,
as the generation loop pays it. A larger tree never costs less: where noise says so, the curve
keeps the smaller tree's cost (a running maximum). Between measured sizes the curve is
interpolated linearly, and beyond the last it grows by the last segment's slope.

The forward timed is the loop's own (`decoding/forward.py`), and its cost is mostly the weights
streamed once per forward, so the same curve prices a batched step by its rows in all: the
batched loop's budget (`decoding/budget.py`) reads it that way.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

from dresd.decoding.budget import cost_at
from dresd.decoding.forward import Forward, Segment, make_forward
from dresd.decoding.tree import DraftTree
from dresd.device import clock, device_name
from dresd.host import cache_dir
from dresd.models.fastpath import dtype_name
from dresd.models.target import Target

# rows of one forward: a tree, or (the same price) every row of a batched step
# (14 and 28: where linear.c's row tiles are full, before a curve's steps up)
TREE_SIZES = (1, 2, 3, 4, 6, 8, 12, 14, 16, 24, 28, 32, 48, 64, 96, 128)


def random_tree(size: int, vocab: int, rng: np.random.Generator) -> DraftTree:
    """A bushy tree of exactly `size` nodes (root included), like merged retrieval drafts."""
    tree = DraftTree.from_drafts(int(rng.integers(vocab)), [])
    leaves: list[list[int]] = []
    while len(tree) < size:
        parent = int(rng.integers(len(tree)))
        leaves.append([tree.tokens[i] for i in tree.path_to(parent)[1:]]
                      + [int(rng.integers(vocab))])
        tree = DraftTree.from_drafts(tree.tokens[0], leaves)
    return tree


CONTEXT_LEN = 384  # cached tokens the trees are verified on
REPEATS = 15  # timed sweeps over the sizes, after one warm-up sweep
# how the curve is measured (4: C attention; 5: the loop's own forward, up to 128 rows; 6: that
# forward on the C decoder; 8: quant.c's flatter multi-row tiles; 9: linear.c's 14-row tiles;
# 10: and its 4 KB prefetch again for tiles of up to 6 rows); a cached other one is measured again
CURVE_VERSION = 10


@torch.inference_mode()
def measure_verify_cost(model: torch.nn.Module, sizes: tuple[int, ...] = TREE_SIZES,
                        context_len: int = CONTEXT_LEN, repeats: int = REPEATS
                        ) -> tuple[dict[int, float], float]:
    """(cost(t) for each tree size t, t = 1 being the one-token step of cost 1.0: paired
    ratios (module doc), made non-decreasing; the one-token step's median seconds)."""
    vocab = model.config.vocab_size
    rng = np.random.default_rng(0)
    cache = filled_cache(model, context_len, rng)
    ratios: dict[int, list[float]] = {size: [] for size in sizes if size > 1}
    steps: list[float] = []
    for repeat in range(repeats + 1):
        for size in rng.permutation(sorted(ratios)).tolist():
            step = timed_verify(model, cache, random_tree(1, vocab, rng), context_len)
            tree = timed_verify(model, cache, random_tree(size, vocab, rng), context_len)
            if repeat > 0:  # the first sweep is a warm-up
                ratios[size].append(tree / step)
                steps.append(step)
    cost, running = {1: 1.0}, 1.0
    for size in sorted(ratios):
        running = max(running, statistics.median(ratios[size]))
        cost[size] = running
    return {size: cost[size] for size in sizes}, statistics.median(steps)


@torch.inference_mode()
def measure_verify_seconds(model: torch.nn.Module, sizes: tuple[int, ...] = TREE_SIZES,
                           context_len: int = CONTEXT_LEN, repeats: int = REPEATS
                           ) -> dict[int, float]:
    """Median seconds of a forward over a tree of t tokens on a warm cache, for each t, the
    sizes interleaved within each repetition (absolute times: `benchmarks/gpu.py`)."""
    vocab = model.config.vocab_size
    rng = np.random.default_rng(0)
    cache = filled_cache(model, context_len, rng)
    times: dict[int, list[float]] = {size: [] for size in sizes}
    for repeat in range(repeats + 1):
        for size in sizes:
            elapsed = timed_verify(model, cache, random_tree(size, vocab, rng), context_len)
            if repeat > 0:  # the first round is a warm-up
                times[size].append(elapsed)
    return {size: statistics.median(t) for size, t in times.items()}


def filled_cache(model: torch.nn.Module, context_len: int, rng: np.random.Generator
                 ) -> tuple[Forward, object]:
    """The loop's forward of `model` and a sequence of `context_len` random tokens in it."""
    forward = make_forward(model)
    sequence = forward.new_sequence()
    ids = rng.integers(model.config.vocab_size, size=context_len).tolist()
    forward([Segment(sequence, ids, 0, logits_rows="last")])
    return forward, sequence


def timed_verify(model: torch.nn.Module, cache: tuple[Forward, object], tree: DraftTree,
                 context_len: int) -> float:
    """Seconds of one verify over `tree` (its mask built, then the forward) on a sequence that
    holds `context_len` tokens, cut back to them afterwards: what a step of the loop runs."""
    forward, sequence = cache
    device = next(model.parameters()).device
    started = clock(device)
    linear = tree.is_linear()
    forward([Segment(sequence, tree.tokens, context_len, depths=None if linear else tree.depths,
                     ancestors=None if linear else tree.ancestor_matrix(device))])
    elapsed = clock(device) - started
    forward.keep(sequence, context_len, [])
    return elapsed


def curve_path(target: Target) -> Path:
    """Where the curve of this model, dtype, linear kernels, thread count and device is cached.
    A GPU's key names the GPU (`cuda-NVIDIA-H200`): another card has another curve."""
    device = target.device.type
    if device == "cuda":
        device += "-" + re.sub(r"[^A-Za-z0-9]+", "-", torch.cuda.get_device_name(target.device))
    linears = re.sub(r"[^A-Za-z0-9]+", "-", target.linears)
    name = (f"{target.fingerprint[:16]}-{dtype_name(target.dtype)}-{linears}-"
            f"{torch.get_num_threads()}threads-{device}.json")
    return cache_dir() / "calibration" / name


def load_or_measure(target: Target, force: bool = False, quiet: bool = False) -> dict[int, float]:
    """The cached curve for `target` as it runs now, measured (and cached) the first time."""
    path = curve_path(target)
    cached = json.loads(path.read_text()) if path.exists() and not force else {}
    if cached.get("version") == CURVE_VERSION:
        return {int(size): cost for size, cost in cached["cost"].items()}
    if not quiet:
        print(f"dresd: measuring the verify-cost curve once for this model, dtype and thread "
              f"count (cached in {path})", file=sys.stderr)
    cost, step_seconds = measure_verify_cost(target.model)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"version": CURVE_VERSION, "model": target.name, "dtype": dtype_name(target.dtype),
              "threads": torch.get_num_threads(), "device": device_name(target.device),
              "step_seconds": step_seconds,
              "cost": {str(size): value for size, value in cost.items()}}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(path)  # atomic: a reader sees a whole curve or none
    return cost


def cached_step_seconds(target: Target) -> float | None:
    """The one-token step's seconds measured with `target`'s cached curve (None: no curve)."""
    path = curve_path(target)
    return json.loads(path.read_text()).get("step_seconds") if path.exists() else None


def cost_table(curve: dict[int, float], up_to: int) -> np.ndarray:
    """cost(t) for t = 0 .. up_to (`cost_at`; t = 0 reads as 1), to index by tree size."""
    return np.array([cost_at(curve, max(t, 1)) for t in range(up_to + 1)])


