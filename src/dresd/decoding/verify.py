"""Acceptance: which path of a verified draft tree the target agrees with.

Both rules walk down from the root. At node i the target's logits `logits[i]` give its next
token after the root path of i; if one of i's children carries that token the walk descends,
otherwise that token is the bonus token and the step ends. Emitted this step: the tokens of the
accepted child nodes, then the bonus token, so a step emits `accepted + 1` tokens.

Greedy: the target's token is its argmax, so the output is exactly plain greedy decoding.

Sampling: the target's token is a sample x ~ p(. | path). Drafts are deterministic (their
distribution q is a point mass), so the usual rule "accept a draft token d with probability
min(1, p(d)/q(d)), else resample from the residual" reduces to: sample x from p; descend if a
child equals x. Each emitted token is a sample of p given everything before it, which is the
model's own distribution.

Exactness in reduced precision. Both rules are exact given the target's logits; what can differ
between a verify forward and a one-token decode step is how those logits are computed: more
rows, another matmul blocking, a tree mask, so sums may run in another order. In float32 that
moves logits by ~1e-6 and the output is token for token plain decoding (tested). In bfloat16 it
moved them by up to 3 units in the last place (ulp) of their magnitude (measured: default
model, 6 GSM8K prompts, 144 positions, a 24-token verify against decode steps), enough to flip
a near-tied token. On a CPU dresd removes the cause (`fastpath.py`): packed linear layers and
batch-invariant attention compute every row the same way in any batch, so bf16 speculative
output is token-identical to bf16 plain decoding too (tested, and counted by `dresd bench`).
Where that does not hold (on transformers' own forward, trees over
`fastpath.INVARIANT_MAX_ROWS` rows; a GPU; a model whose attention cannot be swapped) the rule
is:

    a speculative output may differ from same-dtype plain decoding only at a near-tie: at the
    first differing position, the reference's top-2 logit gap is at most
    NEAR_TIE_ULPS * ulp(|top logit|), with ulp(m) = 2^floor(log2 m) * eps(dtype).

4 ulp covers the 3 measured. For bf16 logits near 32 it is 4 * 0.125 = 0.5; for float32,
4 * 2^-23 * 16, about 8e-6. `dresd bench` counts each divergence as a near-tie or as
unexplained; an unexplained one is a bug.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from dresd.decoding.processing import NodeLogits
from dresd.decoding.sampling import SamplingConfig, next_token_probs, sample
from dresd.decoding.tree import DraftTree

NEAR_TIE_ULPS = 4  # top-2 gaps within this many ulps of the top logit are near-ties


def near_tie_tolerance(dtype: torch.dtype, top_logit: float) -> float:
    """The largest top-2 logit gap at which two computations in `dtype` may disagree:
    NEAR_TIE_ULPS * ulp(|top_logit|), ulp(m) = 2^floor(log2 m) * eps(dtype)."""
    magnitude = max(abs(top_logit), torch.finfo(dtype).tiny)
    return NEAR_TIE_ULPS * 2.0 ** math.floor(math.log2(magnitude)) * torch.finfo(dtype).eps


def classify_divergence(
    output: list[int],
    reference: list[int],
    reference_top2: list[tuple[float, float]],
    dtype: torch.dtype,
) -> str:
    """`identical`, `near_tie` or `unexplained`: how a greedy output compares with plain
    decoding's `reference`, whose two best logits at each new token are `reference_top2`."""
    if output == reference:
        return "identical"
    shorter = min(len(output), len(reference))
    first = next((i for i in range(shorter) if output[i] != reference[i]), shorter)
    if first >= len(reference_top2):
        return "unexplained"  # one output stopped early at a token both agree on
    top, second = reference_top2[first]
    return "near_tie" if top - second <= near_tie_tolerance(dtype, top) else "unexplained"


def greedy_accept(tree: DraftTree, predicted: Sequence[int], nodes: NodeLogits | None = None,
                  logits: torch.Tensor | None = None) -> tuple[list[int], int]:
    """Return (accepted path of node indices starting at the root, bonus token), given the
    target's argmax at every node (`SegmentOutput.greedy`); with a request's processing
    (`nodes`: penalties, a grammar) the argmax of each node's processed `logits` row."""
    path = [0]
    while True:
        token = predicted[path[-1]]
        if nodes is not None:
            token = nodes.greedy(path[-1], token, logits[path[-1]])
        child = tree.children[path[-1]].get(token)
        if child is None:
            return path, token
        path.append(child)


def sampling_accept(
    tree: DraftTree, logits: torch.Tensor, config: SamplingConfig, generator: torch.Generator,
    nodes: NodeLogits | None = None,
) -> tuple[list[int], int]:
    """Return (accepted path of node indices starting at the root, bonus token), sampling;
    with a request's processing (`nodes`), from each node's processed distribution."""
    path = [0]
    while True:
        row = logits[path[-1]] if nodes is None else nodes.processed(path[-1], logits[path[-1]])
        token = sample(next_token_probs(row, config), generator)
        child = tree.children[path[-1]].get(token)
        if child is None:
            return path, token
        path.append(child)
