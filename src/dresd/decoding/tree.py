"""Drafts -> token tree -> the tensors of one verification forward.

Several drafts often share a prefix (retrieval returns near-duplicates), so they are merged into
a trie and each distinct prefix is verified once. Node 0 is the root: the last token the target
emitted, which is not yet in the KV cache. Nodes are numbered in insertion order, so a parent
always comes before its children and the root path of any node is increasing.

In the verification forward node i sits at position `prefix_len + depth[i]` and attends to the
whole cache plus its own ancestors (itself included): the tree attention mask. The tensors are
created on the device given (the model's), as one host-to-device copy each.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class DraftTree:
    tokens: list[int]  # tokens[i]: the token at node i (tokens[0] is the root)
    parents: list[int]  # parents[i]: index of node i's parent (-1 for the root)
    depths: list[int]  # depths[i]: distance from the root (0 for the root)
    children: list[dict[int, int]] = field(default_factory=list)  # node -> {token: child}

    @classmethod
    def from_drafts(cls, root_token: int, drafts: Sequence[Sequence[int]]) -> DraftTree:
        """Merge drafts (each a continuation of the root token) into a trie."""
        tree = cls(tokens=[root_token], parents=[-1], depths=[0], children=[{}])
        for draft in drafts:
            node = 0
            for token in draft:
                token = int(token)
                child = tree.children[node].get(token)
                if child is None:
                    child = len(tree.tokens)
                    tree.tokens.append(token)
                    tree.parents.append(node)
                    tree.depths.append(tree.depths[node] + 1)
                    tree.children.append({})
                    tree.children[node][token] = child
                node = child
        return tree

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_drafted(self) -> int:
        """Draft tokens to verify: every node but the root."""
        return len(self.tokens) - 1

    @property
    def depth(self) -> int:
        return max(self.depths)

    def is_linear(self) -> bool:
        """True when the tree is a single chain, so a plain causal mask verifies it."""
        return all(parent == i - 1 for i, parent in enumerate(self.parents))

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root to `node`, both included."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def ancestor_matrix(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Bool [n, n]: entry (i, j) is True when node j is node i or one of its ancestors."""
        n = len(self.tokens)
        # Built in host memory (numpy: ~30 us for 128 nodes) and copied over in one piece; row
        # by row on a GPU would launch small kernels per node.
        allowed = np.zeros((n, n), dtype=bool)
        for i, parent in enumerate(self.parents):
            if parent >= 0:
                allowed[i] = allowed[parent]  # parents precede children, so this row is final
            allowed[i, i] = True
        return torch.as_tensor(allowed, device=device)

    def attention_mask(self, prefix_len: int, dtype: torch.dtype,
                       device: torch.device | str = "cpu") -> torch.Tensor:
        """Additive 4D mask [1, 1, n, prefix_len + n]: 0 where attention is allowed, -inf-ish
        elsewhere. Additive float masks are read the same way by eager and SDPA attention."""
        n = len(self.tokens)
        allowed = torch.ones(n, prefix_len + n, dtype=torch.bool, device=device)
        allowed[:, prefix_len:] = self.ancestor_matrix(device)
        mask = torch.zeros(n, prefix_len + n, dtype=dtype, device=device)
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)
        return mask[None, None]

    def position_ids(self, prefix_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.tensor([[prefix_len + depth for depth in self.depths]], dtype=torch.long,
                            device=device)

    def input_ids(self, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.tensor([self.tokens], dtype=torch.long, device=device)
