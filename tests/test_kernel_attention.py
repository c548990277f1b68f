"""The C attention kernel: it is attention, and each row is bit for bit independent of its batch."""

from __future__ import annotations

import pytest
import torch

from dresd.kernels import attention as cpu_attention
from dresd.models import fastpath

needs_kernel = pytest.mark.skipif(cpu_attention.kernel() is None,
                                  reason="no C compiler: the float64 attention stands in")
BF16_MIN = torch.finfo(torch.bfloat16).min


def random_case(generator: torch.Generator, heads: int, kv_heads: int, rows: int, length: int,
                dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query, key, value and a tree-like visibility: every row sees a shared prefix, then a
    random subset of the last `rows` keys (its ancestors and itself, say)."""
    query = torch.randn(1, heads, rows, dim, generator=generator).to(torch.bfloat16)
    key, value = (torch.randn(1, kv_heads, length, dim, generator=generator).to(torch.bfloat16)
                  for _ in range(2))
    visible = torch.ones(rows, length, dtype=torch.bool)
    visible[:, length - rows:] = torch.rand(rows, rows, generator=generator) < 0.5
    visible[:, length - rows:] |= torch.eye(rows, dtype=torch.bool)
    return query, key, value, visible


def additive(visible: torch.Tensor) -> torch.Tensor:
    mask = torch.zeros(1, 1, *visible.shape, dtype=torch.bfloat16)
    return mask.masked_fill_(~visible, BF16_MIN)


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 128), (8, 1, 64)])
def test_kernel_is_attention(heads, kv_heads, dim):
    """softmax(q k^T * scale + mask) v with grouped heads, against float64 to bf16 rounding:
    tree masks, causal rows without a mask, boolean masks, lengths off the 64-key blocks."""
    generator = torch.Generator().manual_seed(dim + heads)
    groups = heads // kv_heads
    for rows, length in [(1, 1), (1, 130), (5, 64), (17, 200), (40, 41)]:
        query, key, value, visible = random_case(generator, heads, kv_heads, rows, length, dim)
        keys, values = (t.double().repeat_interleave(groups, dim=1) for t in (key, value))
        causal = torch.ones(rows, length, dtype=torch.bool).tril(length - rows)
        for mask, seen in [(additive(visible), visible), (visible[None, None], visible),
                           (None, causal)]:
            ours = cpu_attention.attention(query, key, value, mask, dim**-0.5)
            scores = (query.double() @ keys.transpose(-1, -2) * dim**-0.5)
            expected = (scores.masked_fill(~seen, -torch.inf).softmax(-1) @ values)
            torch.testing.assert_close(ours.double(), expected.transpose(1, 2), atol=8e-3,
                                       rtol=8e-3)


@needs_kernel
def test_kernel_rows_do_not_depend_on_their_batch():
    """Each row of a batch, with hidden keys between the ones it sees, equals bit for bit the
    same row computed alone on only the keys it sees: a tree node is its decode step."""
    generator = torch.Generator().manual_seed(7)
    for rows, length in [(3, 70), (16, 300), (33, 97), (64, 450)]:
        query, key, value, visible = random_case(generator, 9, 3, rows, length, 64)
        batch = cpu_attention.attention(query, key, value, additive(visible), 0.125)
        for row in range(rows):
            seen = visible[row]
            alone = cpu_attention.attention(query[:, :, row:row + 1], key[:, :, seen],
                                            value[:, :, seen], None, 0.125)
            assert torch.equal(alone[0, 0], batch[0, row]), (rows, length, row)


@needs_kernel
def test_invariant_attention_takes_the_kernel_on_cpu_bf16():
    """`fastpath.invariant_attention` hands bf16 rows to the kernel (the same result), and
    keeps float64 for what the kernel does not take (a head size off the 64-blocks)."""
    generator = torch.Generator().manual_seed(1)
    query, key, value, visible = random_case(generator, 9, 3, 6, 80, 64)
    ours, _ = fastpath.invariant_attention(torch.nn.Module(), query, key, value, additive(visible))
    assert torch.equal(ours, cpu_attention.attention(query, key, value, additive(visible), 0.125))
    assert not cpu_attention.usable(query[..., :48], key[..., :48])


def test_no_compiler_falls_back_to_float64(monkeypatch, tmp_path):
    """Where the kernel cannot be built (here: a compiler that fails), `kernel()` is None and
    invariant attention still runs, in float64."""
    monkeypatch.setenv("CC", "false")
    monkeypatch.setenv("DRESD_CACHE", str(tmp_path))
    cpu_attention.kernel.cache_clear()
    try:
        assert cpu_attention.kernel() is None
        generator = torch.Generator().manual_seed(2)
        query, key, value, visible = random_case(generator, 9, 3, 4, 30, 64)
        assert not cpu_attention.usable(query, key)
        out, _ = fastpath.invariant_attention(torch.nn.Module(), query, key, value,
                                              additive(visible))
        assert out.shape == (1, 4, 9, 64) and torch.isfinite(out.float()).all()
    finally:
        cpu_attention.kernel.cache_clear()


def test_reports_name_the_attention(default_target_bf16):
    """`dresd bench` records which attention ran: the kernel for the default model in bf16
    (where it builds), float64 for a bf16 model whose head size it does not take."""
    from tests.conftest import tiny_model

    expected = "invariant (C kernel)" if cpu_attention.kernel() else "invariant (float64)"
    assert fastpath.attention_name(default_target_bf16.model) == expected
    small_heads = tiny_model().to(torch.bfloat16)  # head size 16
    assert fastpath.use_invariant_attention(small_heads)
    assert fastpath.attention_name(small_heads) == "invariant (float64)"


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_batch_call_equals_one_call_per_sequence(threads):
    """`attention_batch` over sequences of different lengths (tree masks, boolean masks,
    causal chunks, a cache with room to spare) gives every row bit for bit what `attention`
    gives it one sequence at a time, at 1 and 2 threads."""
    generator = torch.Generator().manual_seed(11)
    heads, kv_heads, dim = 9, 3, 64
    cases = [(1, 1, "causal"), (16, 300, "additive"), (5, 70, "bool"), (1, 450, "causal"),
             (33, 97, "additive"), (40, 40, "causal")]
    queries, keys, values, masks, bounds = [], [], [], [], [0]
    for rows, length, kind in cases:
        query, key, value, visible = random_case(generator, heads, kv_heads, rows, length, dim)
        # a preallocated cache: room past `length`, heads `capacity` rows apart
        capacity = length + 13
        cache = torch.zeros(2, 1, kv_heads, capacity, dim, dtype=torch.bfloat16)
        cache[0, :, :, :length], cache[1, :, :, :length] = key, value
        queries.append(query)
        keys.append(cache[0, :, :, :length])
        values.append(cache[1, :, :, :length])
        masks.append({"causal": None, "additive": additive(visible),
                      "bool": visible[None, None]}[kind])
        bounds.append(bounds[-1] + rows)
    # [total_rows, heads, dim], the batched forward's layout
    stacked = torch.cat([q[0].transpose(0, 1) for q in queries])
    batch = cpu_attention.attention_batch(stacked, bounds, keys, values, masks, 0.125,
                                          threads=threads)
    segments = zip(queries, keys, values, masks, strict=True)
    for s, (query, key, value, mask) in enumerate(segments):
        alone = cpu_attention.attention(query, key, value, mask, 0.125)[0]
        assert torch.equal(batch[bounds[s]:bounds[s + 1]], alone), s
