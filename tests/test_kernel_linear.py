"""The C linear kernel: it is x W^T + b to bf16 rounding, and each row is bit for bit
independent of its batch and of the thread count."""

from __future__ import annotations

import pytest
import torch

from dresd.kernels import linear as cpu_linear
from dresd.models.fastpath import PackedLinear, onednn_packs

needs_kernel = pytest.mark.skipif(cpu_linear.kernel() is None,
                                  reason="no kernel tier or no C compiler: oneDNN stands in")
# The default model's shapes (in, out), an odd K and an N off the 32-output panels.
SHAPES = [(576, 1536), (1536, 576), (576, 192), (576, 576), (37, 70)]


def bf16_linear(generator: torch.Generator, k: int, n: int, bias: bool) -> torch.nn.Linear:
    linear = torch.nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k, generator=generator) * k**-0.5)
        if bias:
            linear.bias.copy_(torch.randn(n, generator=generator))
    return linear.to(torch.bfloat16)


@needs_kernel
@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_is_the_linear(k, n, bias):
    """Against float64 x W^T + b: within one bf16 rounding (the float32 sum's own error is
    ~1e-6 relative, far below bf16's 2^-9)."""
    generator = torch.Generator().manual_seed(k + n)
    linear = bf16_linear(generator, k, n, bias)
    ours = cpu_linear.InvariantLinear.from_module(linear)
    for rows in (1, 5, 70):
        x = torch.randn(rows, k, generator=generator).to(torch.bfloat16)
        expected = x.double() @ linear.weight.double().T
        if bias:
            expected = expected + linear.bias.double()
        y = ours(x)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
        # one rounding of the exact value to bf16: |error| <= 2^-8 |value| (plus float32 slack)
        error = (y.double() - expected).abs()
        assert (error <= expected.abs() * 2**-8 + 1e-5).all(), error.max()


@needs_kernel
@pytest.mark.parametrize("k,n", SHAPES)
def test_rows_do_not_depend_on_their_batch_or_threads(k, n):
    """Every row of a call with M in {1, 2, 3, 14, 15, 17, 29, 64, 513} rows (one tile of 14,
    the first two-tile split, uneven tiles), at 1, 2 and 3 threads, equals bit for bit the same
    row computed alone at 1 thread."""
    generator = torch.Generator().manual_seed(3 * k + n)
    linear = bf16_linear(generator, k, n, bias=True)
    ours = cpu_linear.InvariantLinear.from_module(linear)
    x = torch.randn(513, k, generator=generator).to(torch.bfloat16)
    alone = torch.cat([cpu_linear.linear(x[m:m + 1], ours.packed_weight, n, ours.bias,
                                         threads=1) for m in range(513)])
    for rows in (1, 2, 3, 14, 15, 17, 29, 64, 513):
        for threads in (1, 2, 3):
            for first in (0, 513 - rows):  # different rows share the call
                batch = cpu_linear.linear(x[first:first + rows], ours.packed_weight, n,
                                          ours.bias, threads=threads)
                assert torch.equal(batch, alone[first:first + rows]), (rows, threads, first)


@needs_kernel
def test_module_takes_any_leading_shape_and_strides():
    """forward(x) for x [..., K] as PackedLinear takes it, non-contiguous rows included; from a
    PackedLinear, the same weights (unpacked from oneDNN exactly), where oneDNN packs bf16 on
    this CPU (not on an AVX2-only one)."""
    generator = torch.Generator().manual_seed(5)
    linear = bf16_linear(generator, 64, 128, bias=False)
    ours = cpu_linear.InvariantLinear.from_module(linear)
    x = torch.randn(2, 3, 128, generator=generator).to(torch.bfloat16)[..., ::2]
    y = ours(x)
    assert y.shape == (2, 3, 128)
    assert torch.equal(y, ours(x.contiguous()))
    assert torch.equal(y[1, 2], ours(x[1, 2]))
    if onednn_packs(torch.bfloat16):
        from_packed = cpu_linear.InvariantLinear.from_module(PackedLinear(linear))
        assert torch.equal(y, from_packed(x))


@needs_kernel
def test_fused_projections_equal_the_separate_ones():
    """q, k, v fused into one matmul give, column for column, bit for bit the separate
    modules' outputs (each output is one lane's sum, wherever its weight row sits)."""
    generator = torch.Generator().manual_seed(9)
    projections = [bf16_linear(generator, 576, n, bias=b) for n, b in
                   [(576, False), (192, True), (192, False)]]
    separate_modules = [cpu_linear.InvariantLinear.from_module(p) for p in projections]
    x = torch.randn(7, 576, generator=generator).to(torch.bfloat16)
    separate = torch.cat([module(x) for module in separate_modules], dim=-1)
    # from the original linears, or from their InvariantLinear replacements (unpacked)
    for fused in (cpu_linear.fuse(projections), cpu_linear.fuse(separate_modules)):
        assert torch.equal(fused(x), separate)


@needs_kernel
def test_invariant_linears_replaces_a_models_linears():
    from tests.conftest import tiny_model

    model = tiny_model().to(torch.bfloat16)
    count = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    ids = torch.tensor([[1, 2, 3, 4]])
    before = model(ids).logits
    assert cpu_linear.invariant_linears(model) == count > 0
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    after = model(ids).logits
    torch.testing.assert_close(after.float(), before.float(), atol=0.1, rtol=0.05)


def test_no_compiler_means_no_kernel(monkeypatch, tmp_path):
    """Where the kernel cannot be built (here: a compiler that fails), `kernel()` is None,
    nothing is replaced, and the model keeps its linears; likewise with DRESD_CPU_LINEAR=0."""
    monkeypatch.setenv("CC", "false")
    monkeypatch.setenv("DRESD_CACHE", str(tmp_path))
    cpu_linear.kernel.cache_clear()
    try:
        assert cpu_linear.kernel() is None
        linear = torch.nn.Linear(8, 4).to(torch.bfloat16)
        model = torch.nn.Sequential(linear)
        assert not cpu_linear.usable(linear)
        assert cpu_linear.invariant_linears(model) == 0 and model[0] is linear
        monkeypatch.delenv("CC")
        monkeypatch.setenv("DRESD_CPU_LINEAR", "0")
        cpu_linear.kernel.cache_clear()
        assert cpu_linear.kernel() is None
    finally:
        cpu_linear.kernel.cache_clear()


def test_no_kernel_tier_means_no_kernel(monkeypatch):
    monkeypatch.setattr(cpu_linear.kernels, "tier", lambda: None)
    cpu_linear.kernel.cache_clear()
    try:
        assert cpu_linear.kernel() is None
    finally:
        cpu_linear.kernel.cache_clear()


@needs_kernel
@pytest.mark.parametrize("name", ["tiny", pytest.param("default", marks=pytest.mark.default_model)])
def test_model_rows_do_not_depend_on_their_batch(name):
    """A bf16 model on the C linears (and invariant attention; the default model's on the C
    attention kernel): a 6-token chain in one forward, beside another sequence, gives every row
    the logits its one-token decode step gives, bit for bit."""
    from dresd.decoding.forward import LlamaForward, Segment
    from dresd.models.fastpath import use_invariant_attention
    from dresd.models.target import load_target
    from tests.conftest import tiny_model

    if name == "tiny":
        model = tiny_model().to(torch.bfloat16)
    else:
        model = load_target("default", dtype="bfloat16", device="cpu", prepack=False).model
    cpu_linear.invariant_linears(model)
    assert use_invariant_attention(model)
    forward = LlamaForward(model)
    tokens = [5, 17, 3, 99, 42, 7]
    chain, other = forward.new_sequence(), forward.new_sequence()
    together = forward([Segment(chain, tokens, 0), Segment(other, [8, 9, 10], 0)])[0].logits
    stepped = forward.new_sequence()
    for position, token in enumerate(tokens):
        alone = forward([Segment(stepped, [token], position)])[0].logits
        assert torch.equal(alone[0], together[position]), position
