"""A batch-invariant bf16 linear layer in C, for CPUs with AVX-512 or AVX2 (`kernels/linear.c`).

Why: a bf16 decode step on a CPU is mostly linear layers streaming their weights, and the
project's exactness rule needs every output row bit for bit independent of the rows that share
its call. oneDNN (`fastpath.PackedLinear`) gives that only from two rows up, and streams the
weights at about half what one core can read. This kernel sums every output in one fixed order
(`kernels/linear.c`'s header: one vector lane per output, one `vdpbf16ps` per pair of k, in
increasing k; two float32 multiply-adds in its place on tiers without AVX-512 bf16), so any
row count and any thread count give the same bits, and it reads the weights in a layout packed
once (`pack`) that streams contiguously.

It is compiled once per machine (`kernels.load`, with OpenMP: torch's own libgomp, already
loaded in the process, serves it) into `$DRESD_CACHE/kernels/`. `kernel()` is None where the
CPU runs no kernel tier (`kernels.tier()`: AVX2 at least, or NEON with the dot product), where
no compiler builds it, or with `DRESD_CPU_LINEAR=0`; callers then keep `fastpath.PackedLinear`.
The two round differently (another summation order), so one process uses one of them for
every method.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from dresd import kernels
from dresd.kernels import HEADERS
from dresd.models.fastpath import PackedLinear

SOURCE = Path(__file__).with_name("linear.c")
# No -ffast-math (nothing to gain: the sums are intrinsics; the bias add must stay one add).
FLAGS = ("-O3", "-march=native", "-std=gnu11", "-shared", "-fPIC", "-fopenmp")
PANEL = 32  # outputs per panel of the packed layout (kernels/linear.c's PANEL)


@functools.cache
def kernel() -> ctypes.CDLL | None:
    """The compiled kernel (compiled on first use, then cached), or None where it cannot be."""
    if kernels.tier() is None:
        return None
    library = kernels.load(SOURCE, FLAGS, "DRESD_CPU_LINEAR", "oneDNN linears",
                           includes=HEADERS)
    if library is None:
        return None
    function = library.dresd_linear
    pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    function.argtypes = [pointer, i64, i32, pointer, i32, i32, pointer, pointer, i64, i32]
    function.restype = None
    return library


def pack(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] bf16 -> the kernel's layout: packed[panel][p][part][lane][2] =
    W[panel * 32 + part * 16 + lane][2p + (0, 1)], N padded to whole panels and K to even
    with zeros. Returned flat, contiguous."""
    n, k = weight.shape
    n_padded, k_padded = -(-n // PANEL) * PANEL, k + k % 2
    padded = torch.zeros(n_padded, k_padded, dtype=torch.bfloat16)
    padded[:n, :k] = weight.detach().to(torch.bfloat16)
    blocked = padded.view(n_padded // PANEL, PANEL, k_padded // 2, 2).permute(0, 2, 1, 3)
    return blocked.contiguous().view(-1)


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
           bias: torch.Tensor | None = None, threads: int | None = None) -> torch.Tensor:
    """y = x W^T (+ bias) for x [..., K] bf16 on the CPU, W packed by `pack`; bias: float32
    [N padded to 32] or None. threads: default `torch.get_num_threads()`. Returns [..., N]."""
    k = x.shape[-1]
    # the kernel reads (k + 1) / 2 pairs of every output's panel: a packed weight of another k
    # would be read past its end
    if packed.numel() != -(-out_features // PANEL) * PANEL * (k + k % 2) or (
            bias is not None and bias.numel() < out_features):
        raise ValueError(f"linear: a weight packed in {packed.numel()} elements does not take "
                         f"inputs of {k} to {out_features} outputs"
                         + ("" if bias is None else f" (bias: {bias.numel()})"))
    rows = x if x.dim() == 2 else x.reshape(-1, k)
    if rows.stride(-1) != 1 or k % 2:
        rows = torch.nn.functional.pad(rows, (0, k % 2)) if k % 2 else rows.contiguous()
    count = rows.shape[0]
    out = torch.empty(count, out_features, dtype=torch.bfloat16)
    if count:
        _function(rows.data_ptr(), rows.stride(0), count, packed.data_ptr(), (k + 1) // 2,
                  out_features, None if bias is None else bias.data_ptr(), out.data_ptr(),
                  out_features, threads or torch.get_num_threads())
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out_features)


def _function(*args) -> None:
    """The kernel's dresd_linear (looked up once: this is on every linear's hot path)."""
    global _function
    _function = kernel().dresd_linear
    _function(*args)


def usable(module: torch.nn.Module) -> bool:
    """Whether `InvariantLinear` can stand in for this module: an `nn.Linear` or a
    `fastpath.PackedLinear` with bf16 weights on the CPU, where the kernel builds."""
    weight = dense_weight(module)
    return (weight is not None and weight.dtype == torch.bfloat16
            and weight.device.type == "cpu" and kernel() is not None)


def unpack(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The inverse of `pack`: W [N, K]."""
    k_padded = in_features + in_features % 2
    blocked = packed.view(-1, k_padded // 2, PANEL, 2).permute(0, 2, 1, 3)
    return blocked.reshape(-1, k_padded)[:out_features, :in_features]


def dense_weight(module: torch.nn.Module) -> torch.Tensor | None:
    """The [N, K] weight of an `nn.Linear`, a `fastpath.PackedLinear` (its oneDNN-packed
    weight converted back, exactly) or an `InvariantLinear`, else None."""
    if isinstance(module, InvariantLinear):
        return unpack(module.packed_weight, module.out_features, module.in_features)
    if isinstance(module, torch.nn.Linear):
        return module.weight.detach()
    if isinstance(module, PackedLinear):
        packed = module.packed_weight
        return packed.to_dense() if packed.layout == torch._mkldnn else packed
    return None


class InvariantLinear(torch.nn.Module):
    """A linear layer on the C kernel: y = x W^T + b, each output row bit for bit independent
    of the other rows in the call and of the thread count. Same interface as
    `fastpath.PackedLinear` (forward(x) for x [..., in_features])."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("packed_weight", pack(weight), persistent=False)
        padded_bias = None
        if bias is not None:  # float32, exactly the bf16 values, padded to whole panels
            padded_bias = torch.zeros(-(-self.out_features // PANEL) * PANEL)
            padded_bias[:self.out_features] = bias.detach().float()
        self.register_buffer("bias", padded_bias, persistent=False)

    @classmethod
    def from_module(cls, module: torch.nn.Module) -> InvariantLinear:
        """From an `nn.Linear` or a `fastpath.PackedLinear` (check `usable` first)."""
        return cls(dense_weight(module), _bias(module))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.packed_weight, self.out_features, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                "batch-invariant C kernel")


def _bias(module: torch.nn.Module) -> torch.Tensor | None:
    """A linear module's bias [N] (an `InvariantLinear`'s without its panel padding)."""
    bias = getattr(module, "bias", None)
    if isinstance(module, InvariantLinear) and bias is not None:
        return bias[:module.out_features]
    return bias


def fuse(modules: list[torch.nn.Module]) -> InvariantLinear:
    """One `InvariantLinear` for projections that share an input (q, k, v; gate, up): their
    weights stacked along N. Its output columns are, bit for bit, the separate modules'
    outputs: each output's sum is one lane running the same instructions over the same k
    (kernels/linear.c's header), wherever its weight row sits."""
    weights = [dense_weight(module) for module in modules]
    biases = [_bias(module) for module in modules]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([b.detach() if b is not None else torch.zeros(w.shape[0],
                                                                       dtype=w.dtype)
                          for b, w in zip(biases, weights, strict=True)])
    return InvariantLinear(torch.cat(weights), bias)


def invariant_linears(model: torch.nn.Module) -> int:
    """Replace every `nn.Linear` and `fastpath.PackedLinear` of a bf16 CPU model by an
    `InvariantLinear`; returns how many were replaced (0 where the kernel is not available).
    Tied weights (an LM head sharing the embedding) give the head its own packed copy."""
    replaced = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if not isinstance(child, InvariantLinear) and usable(child):
                setattr(module, name, InvariantLinear.from_module(child))
                replaced += 1
    return replaced


def share_storage(fused: InvariantLinear, modules: list[InvariantLinear]) -> bool:
    """Make `modules` (the parts `fuse` stacked into `fused`) read their packed weights from
    `fused`'s buffer instead of their own copies; True if they now do. Possible where every
    part fills whole panels (out_features a multiple of PANEL): the fused packed buffer is
    then the parts' packed buffers one after another."""
    if any(module.out_features % PANEL for module in modules):
        return False
    offset = 0
    for module in modules:
        size = module.packed_weight.numel()
        view = fused.packed_weight[offset:offset + size]
        if not torch.equal(view, module.packed_weight):  # the layout is what `pack` says
            return False
        module.packed_weight = view
        offset += size
    return True
