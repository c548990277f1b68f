"""What a request does to the logits before choosing (penalties, a logit bias, a grammar),
per tree node, so that speculation chooses at every node exactly what plain decoding would.

OpenAI's and vLLM's fields, applied in vLLM's order to a row of raw logits:

    logit_bias:          logits[t] += bias[t]
    repetition_penalty:  for t seen in the prompt or the output so far: logits[t] / r where
                         positive, logits[t] * r where not (transformers' and vLLM's rule)
    frequency_penalty:   logits[t] -= f * count(t in the output so far)
    presence_penalty:    logits[t] -= p * [t in the output so far]
    grammar:             logits[t] = -inf where the grammar forbids t (constraint.py)

then temperature, top-k, top-p and min-p as sampling.py has them. "The output so far" at a
tree node is the sequence's output plus the tokens on the node's path from the root: each
node's penalties follow its own path, as each node's grammar state does. So a verify row's
choice is a decode step's, and every method's output is `ar`'s (greedy) or drawn as `ar`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dresd.decoding.constraint import Constraint, TreeMasks
from dresd.decoding.tree import DraftTree


@dataclass(frozen=True)
class Penalties:
    """A request's logit changes (all off by default)."""

    presence: float = 0.0  # OpenAI's presence_penalty, in [-2, 2]
    frequency: float = 0.0  # OpenAI's frequency_penalty, in [-2, 2]
    repetition: float = 1.0  # vLLM's repetition_penalty, > 0 (1: none)
    logit_bias: dict[int, float] = field(default_factory=dict)  # token -> bias, in [-100, 100]

    @property
    def active(self) -> bool:
        return bool(self.presence or self.frequency or self.repetition != 1.0
                    or self.logit_bias)


class NodeLogits:
    """A tree's nodes' logits as the request processes them (`Penalties`, its grammar).

    `greedy` and `processed` are what acceptance asks of a node (verify.py): with a grammar
    only, the argmax is checked in one token and masked only where the grammar forbids it;
    with penalties, the node's row is processed whole."""

    def __init__(self, tree: DraftTree, penalties: Penalties | None,
                 constraint: Constraint | None, prompt: torch.Tensor,
                 output: torch.Tensor) -> None:
        """`prompt`, `output`: int64 token ids; `output` ends with the tree's root token."""
        self.tree = tree
        self.penalties = penalties if penalties is not None and penalties.active else None
        self.masks = TreeMasks(constraint, tree) if constraint is not None else None
        self.prompt, self.output = prompt, output

    def _path(self, node: int) -> torch.Tensor:
        tokens = [self.tree.tokens[i] for i in self.tree.path_to(node)[1:]]
        return torch.tensor(tokens, dtype=torch.int64)

    def processed(self, node: int, logits: torch.Tensor) -> torch.Tensor:
        """The node's logits row (float32) with the penalties and the grammar applied."""
        row = logits.float().clone()
        if self.penalties is not None:
            row = self._penalized(row, torch.cat([self.output, self._path(node)]))
        if self.masks is not None:
            row = self.masks.masked(node, row)
        return row

    def greedy(self, node: int, argmax: int, logits: torch.Tensor) -> int:
        """The token plain greedy decoding picks at `node` (`argmax`: of the raw row)."""
        if self.penalties is None:
            return argmax if self.masks is None else self.masks.greedy(node, argmax, logits)
        return int(self.processed(node, logits).argmax())

    def _penalized(self, row: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        penalties, vocab = self.penalties, row.shape[-1]
        if penalties.logit_bias:
            tokens = torch.tensor(list(penalties.logit_bias), dtype=torch.int64)
            row[tokens] += torch.tensor(list(penalties.logit_bias.values()), dtype=row.dtype)
        if penalties.repetition != 1.0:
            seen = torch.unique(torch.cat([self.prompt, output]))
            values = row[seen]
            row[seen] = torch.where(values > 0, values / penalties.repetition,
                                    values * penalties.repetition)
        if penalties.frequency or penalties.presence:
            counts = torch.bincount(output, minlength=vocab)[:vocab].to(row.dtype)
            row -= penalties.frequency * counts + penalties.presence * (counts > 0).to(row.dtype)
        return row
