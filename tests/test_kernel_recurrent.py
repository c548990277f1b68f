"""The gated delta rule in C over a tree's rows (kernels/recurrent.c): the rule PyTorch computes,
and the invariances verification rests on, bit for bit."""

from __future__ import annotations

import pytest
import torch

from dresd.kernels import recurrent

pytestmark = pytest.mark.skipif(recurrent.kernel() is None, reason="no C compiler")

# a tree: root, two children of it, then branches: rows 0-1-3-5 and 0-2-4, 3-6
PARENTS = [-1, 0, 0, 1, 2, 3, 3]


def inputs(rows: int, heads: int = 4, key_heads: int = 2, dk: int = 32, dv: int = 16,
           seed: int = 0) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape):
        return torch.randn(*shape, generator=generator)

    return (normal(rows, key_heads, dk), normal(rows, key_heads, dk), normal(rows, heads, dv),
            torch.rand(rows, heads, generator=generator),
            -torch.rand(rows, heads, generator=generator) * 3, normal(heads, dk, dv))


@pytest.mark.parametrize("tiled", [False, True])
def test_the_kernel_computes_the_rule(tiled):
    q, k, v, beta, g, state = inputs(len(PARENTS))
    out, _ = recurrent.delta_rule(PARENTS, q, k, v, beta, g, state, tiled, last=False)
    reference, _ = recurrent._delta_rule_torch(PARENTS, q, k, v, beta, g, state, tiled, False)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    other, _ = recurrent.delta_rule(PARENTS, q, k, v, beta, g, state, not tiled, last=False)
    assert (other - out).abs().max() > 1e-2  # the head order matters: the test can fail


def test_a_tree_row_is_its_path_alone_and_its_one_token_steps():
    """Row 6's output in the tree equals, bit for bit, the last row of its path run as a chain,
    and the outputs and final state of one-token calls along that path (what `ar` runs)."""
    q, k, v, beta, g, state = inputs(len(PARENTS))
    tree, _ = recurrent.delta_rule(PARENTS, q, k, v, beta, g, state, False, last=False)
    path = [0, 1, 3, 6]
    chain, after = recurrent.delta_rule([-1, 0, 1, 2], q[path], k[path], v[path], beta[path],
                                        g[path], state, False, last=True)
    assert torch.equal(tree[path], chain)
    steps, kept = [], state
    for row in path:
        out, kept = recurrent.delta_rule([-1], q[[row]], k[[row]], v[[row]], beta[[row]],
                                         g[[row]], kept, False, last=True)
        steps.append(out[0])
    assert torch.equal(torch.stack(steps), chain) and torch.equal(kept, after)


def test_threads_change_no_bit():
    q, k, v, beta, g, state = inputs(len(PARENTS), heads=8, key_heads=2)
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            results.append(recurrent.delta_rule(PARENTS, q, k, v, beta, g, state, True,
                                                last=True))
    finally:
        torch.set_num_threads(threads)
    for out, after in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(after, results[0][1])


def test_bad_sizes_are_refused():
    q, k, v, beta, g, state = inputs(3)
    with pytest.raises(ValueError):  # a row's parent after it
        recurrent.delta_rule([-1, 2, 0], q, k, v, beta, g, state, False, last=False)
