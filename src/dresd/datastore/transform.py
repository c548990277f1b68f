"""The key transform of DReSD: z-score, PCA, L2 normalisation.

For a hidden state h (d dims), with per-dimension mean mu and standard deviation sigma and the
top `dim` principal directions P (dim x d) of the z-scored states:

    z = (h - mu) / sigma                    z-score, per dimension
    y = P z                                 PCA (z has mean 0 by construction)
    key = y / ||y||_2                       unit length: inner product = cosine similarity

The statistics come from running sums, so fitting needs no copy of the sample:
mu = S1 / n, C = S2 / n - mu mu^T (covariance of h), sigma = sqrt(diag C), and the covariance of
z is C / (sigma sigma^T); P are its eigenvectors of the largest eigenvalues. The affine part
folds into one matrix: y = W h + b with W = P diag(1/sigma), b = -W mu.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dresd.datastore.format import save_npz_atomic
from dresd.errors import UserError
from dresd.kernels import drafting

STD_FLOOR = 1e-6  # a constant dimension gets this std, not a division by zero


class StatsAccumulator:
    """Running sums of hidden states in float64: enough to fit a `KeyTransform`."""

    def __init__(self, dim: int) -> None:
        self.count = 0
        self.sum = np.zeros(dim, dtype=np.float64)
        self.sum_outer = np.zeros((dim, dim), dtype=np.float64)

    def add(self, states: np.ndarray, block: int = 8192) -> None:
        """Add rows of `states` [n, d], `block` rows at a time (bounded float64 copies)."""
        for start in range(0, len(states), block):
            x = np.asarray(states[start : start + block], dtype=np.float64)
            self.count += len(x)
            self.sum += x.sum(axis=0)
            self.sum_outer += x.T @ x

    def fit(self, dim: int) -> KeyTransform:
        """The transform to `dim` dimensions; needs more samples than `dim`."""
        if self.count <= dim:
            raise UserError(f"fitting a PCA to {dim} dimensions needs more than {dim} "
                            f"positions; the sample has {self.count}")
        if dim > len(self.sum):
            raise UserError(f"PCA dimension {dim} exceeds the hidden size {len(self.sum)}")
        mean = self.sum / self.count
        cov = self.sum_outer / self.count - np.outer(mean, mean)
        std = np.sqrt(np.clip(np.diag(cov), 0.0, None))
        std = np.maximum(std, STD_FLOOR)
        z_cov = cov / np.outer(std, std)
        eigenvalues, eigenvectors = np.linalg.eigh(z_cov)  # ascending order
        order = np.argsort(eigenvalues)[::-1][:dim]
        components = eigenvectors[:, order].T  # [dim, d]
        # An eigenvector's sign is arbitrary; fix it so that refits on the same data agree.
        signs = np.sign(components[np.arange(dim), np.abs(components).argmax(axis=1)])
        components *= signs[:, None]
        return KeyTransform(mean=mean.astype(np.float32), std=std.astype(np.float32),
                            components=components.astype(np.float32),
                            explained=float(eigenvalues[order].sum() / eigenvalues.sum()))


@dataclass
class KeyTransform:
    """z-score -> PCA -> L2 norm, fitted; `apply` maps hidden states [n, d] to keys [n, dim]."""

    mean: np.ndarray  # [d] mu
    std: np.ndarray  # [d] sigma
    components: np.ndarray  # [dim, d] P, rows are the principal directions of z
    explained: float = 0.0  # share of z's variance the kept directions explain

    def __post_init__(self) -> None:
        # W = P diag(1/sigma), b = -W mu: one matrix product per query.
        self._weight = (self.components / self.std[None, :]).astype(np.float32)
        self._bias = -(self._weight @ self.mean).astype(np.float32)
        # W^T [d, dim] and b as the C key reads them (None: no kernel), their addresses once
        self._weight_t = np.ascontiguousarray(self._weight.T)
        self.key_weights = (drafting.key_weights(self._weight_t, self._bias)
                          if drafting.kernel() is not None else None)

    @property
    def dim(self) -> int:
        return self.components.shape[0]

    @property
    def input_dim(self) -> int:
        return self.components.shape[1]

    def apply(self, states: np.ndarray) -> np.ndarray:
        """Unit-length keys [n, dim] (float32) for hidden states [n, d] (or one state [d])."""
        x = np.asarray(states, dtype=np.float32)
        single = x.ndim == 1
        y = np.atleast_2d(x) @ self._weight.T + self._bias
        norms = np.linalg.norm(y, axis=1, keepdims=True)
        y /= np.maximum(norms, 1e-12)
        return y[0] if single else y

    def key(self, state: torch.Tensor | np.ndarray) -> np.ndarray:
        """`apply` for one hidden state [d]: a decode step's query. A CPU tensor goes to the C
        kernel as it is (`drafting.dense_key`: one call where numpy takes several); the keys
        agree with `apply`'s to float32 rounding (the sums' order differs)."""
        if isinstance(state, torch.Tensor):
            # is_cpu: ~2 us with the caches a forward leaves, .device.type ~5
            if self.key_weights is not None and state.is_cpu and drafting.kernel() is not None:
                return drafting.dense_key(state, self.key_weights)
            state = state.detach().to("cpu").float().numpy()
        return self.apply(state)

    def save(self, path: str | Path) -> None:
        """An `.npz` file, written atomically; the same transform always gives the same bytes."""
        save_npz_atomic(Path(path), {"mean": self.mean, "std": self.std,
                                     "components": self.components,
                                     "explained": np.float64(self.explained)})

    @classmethod
    def load(cls, path: str | Path) -> KeyTransform:
        with np.load(path) as data:
            return cls(mean=data["mean"], std=data["std"], components=data["components"],
                       explained=float(data["explained"]))
