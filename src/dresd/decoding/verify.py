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
"""

from __future__ import annotations

import torch

from dresd.decoding.sampling import SamplingConfig, next_token_probs, sample
from dresd.decoding.tree import DraftTree


def greedy_accept(tree: DraftTree, logits: torch.Tensor) -> tuple[list[int], int]:
    """Return (accepted path of node indices starting at the root, bonus token)."""
    predicted = logits.argmax(dim=-1).tolist()  # one argmax per node, in one call
    path = [0]
    while True:
        token = predicted[path[-1]]
        child = tree.children[path[-1]].get(token)
        if child is None:
            return path, token
        path.append(child)


def sampling_accept(
    tree: DraftTree, logits: torch.Tensor, config: SamplingConfig, generator: torch.Generator
) -> tuple[list[int], int]:
    """Return (accepted path of node indices starting at the root, bonus token), sampling."""
    path = [0]
    while True:
        token = sample(next_token_probs(logits[path[-1]], config), generator)
        child = tree.children[path[-1]].get(token)
        if child is None:
            return path, token
        path.append(child)
