"""The key transform: z-score, PCA, L2 norm, fitted from running sums."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dresd.datastore.transform import KeyTransform, StatsAccumulator
from dresd.kernels import drafting


def correlated_states(n: int = 4000, d: int = 24, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    mixing = rng.normal(size=(d, d))
    scales = rng.uniform(0.1, 20.0, size=d)  # per-dimension scales the z-score must remove
    return (rng.normal(size=(n, d)) @ mixing) * scales + rng.normal(size=d) * 5


def fit(states: np.ndarray, dim: int, parts: int = 3) -> KeyTransform:
    stats = StatsAccumulator(states.shape[1])
    for part in np.array_split(states, parts):  # sums over parts = sums over the whole
        stats.add(part)
    return stats.fit(dim)


def test_matches_zscore_then_pca_then_l2_computed_directly():
    x = correlated_states()
    transform = fit(x, 8)
    z = (x - x.mean(0)) / x.std(0)
    _, _, vt = np.linalg.svd(z, full_matrices=False)  # PCA of z, directly
    y = z @ vt[:8].T
    expected = y / np.linalg.norm(y, axis=1, keepdims=True)
    keys = transform.apply(x)
    # Principal directions are defined up to sign: compare |cosine| per dimension.
    agreement = np.abs((keys * expected).sum(0)) / np.linalg.norm(keys, axis=0) \
        / np.linalg.norm(expected, axis=0)
    assert agreement.min() > 0.999
    assert np.allclose(np.linalg.norm(keys, axis=1), 1.0, atol=1e-5)


def test_single_state_and_batch_agree():
    x = correlated_states()
    transform = fit(x, 6)
    assert np.allclose(transform.apply(x[5]), transform.apply(x)[5], atol=1e-6)
    assert transform.apply(x[5]).shape == (6,)


def test_save_load_round_trip(tmp_path):
    x = correlated_states()
    transform = fit(x, 8)
    path = tmp_path / "t.npz"
    transform.save(path)
    loaded = KeyTransform.load(path)
    assert path.exists() and loaded.dim == 8 and loaded.input_dim == x.shape[1]
    assert np.array_equal(loaded.apply(x), transform.apply(x))
    assert loaded.explained == pytest.approx(transform.explained)


def test_constant_dimension_does_not_divide_by_zero():
    x = correlated_states()
    x[:, 3] = 7.0
    keys = fit(x, 4).apply(x)
    assert np.isfinite(keys).all()


def test_too_small_a_sample_is_refused():
    with pytest.raises(ValueError, match="needs more than 8 positions"):
        fit(correlated_states(n=8), 8, parts=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_query_in_c_is_apply_to_float_rounding(dtype, monkeypatch):
    """A decode step's key (`key`: one C call on the forward's own row, bf16 or float32) is
    `apply`'s key up to float32 rounding, and the same as numpy's where no kernel compiles."""
    x = correlated_states(n=600, d=40)
    transform = fit(x, 12)
    for state in x[:50]:
        tensor = torch.tensor(state).to(dtype)
        expected = transform.apply(tensor.float().numpy())
        key = transform.key(tensor)
        assert key.dtype == np.float32 and key.shape == (12,)
        assert np.abs(key - expected).max() < 1e-5
        assert np.array_equal(transform.key(tensor.float().numpy()), expected)
        with monkeypatch.context() as patch:
            patch.setattr(drafting, "kernel", lambda: None)
            assert np.array_equal(transform.key(tensor), expected)
    at_mean = transform.key(torch.tensor(transform.mean))  # W mu + b ~ 0: rounding's residue
    assert np.all(np.isfinite(at_mean))
