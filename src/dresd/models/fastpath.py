"""The fast forward on CPUs: bf16 where the hardware multiplies it natively, prepacked weights.

Why it matters for speculative decoding: a verify forward over a tree of t tokens must cost
close to one decode step, or drafting cannot pay. On a CPU two things decide that.

1. The dtype. A decode step streams every weight once, so its floor is weight bytes / memory
   bandwidth: bf16 halves it. A tree's extra rows cost multiply-adds, which AVX-512 bf16
   (`avx512_bf16`, 32 multiply-adds per instruction) or AMX (`amx_bf16`, tiles) do several
   times faster than fp32 FMAs. `--dtype auto` picks bf16 where the CPU has either, and fp32
   elsewhere (bf16 emulated in fp32 is slower than fp32 itself).
2. The weight layout. `torch.nn.functional.linear` hands oneDNN a plain row-major weight and
   oneDNN reorders it into its blocked layout on every call; prepacked, the default model's bf16
   decode step took 30% less time (benchmarks/results/engine.md). `prepack_linears` does the
   reorder once, at load time, as `torch.compile`'s inductor does with `freezing=True`, and
   calls the packed matmul directly (no compilation, so no warm-up, and every tree size runs
   the same kernel family).

Exactness: packing changes no maths, only the memory layout, but the blocked kernel may sum in
another order than the plain one, so fp32 results move in the last bits (~1e-7 relative).
Every method (the `ar` reference included) runs the same packed model, so comparisons stay
like for like. In bf16 and fp16 the packed linears (single rows run as two) and
`invariant_attention` make every row's arithmetic independent of its batch, so speculative
output equals plain decoding in the same dtype; `decoding/verify.py` states the rule.
"""

from __future__ import annotations

import functools

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from dresd.errors import UserError
from dresd.host import native_bf16_flags
from dresd.kernels import attention as cpu_attention

# The --dtype choices; "auto" resolves with `resolve_dtype`.
DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

def resolve_dtype(name: str | torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    """The torch dtype for a --dtype value; `auto` is bf16 where the device multiplies it
    natively (CUDA with bf16 support; a CPU with AMX or AVX-512 bf16), fp32 elsewhere."""
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise UserError(f"unknown dtype {name!r}; choose from {', '.join(DTYPES)}")
    if name != "auto":
        return DTYPES[name]
    if torch.device(device).type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if native_bf16_flags() else torch.float32


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> `bfloat16`, as --dtype spells it."""
    return str(dtype).removeprefix("torch.")


class PackedLinear(torch.nn.Module):
    """`nn.Linear` with its weight reordered once into oneDNN's blocked layout.

    y = x W^T + b, exactly the linear it replaces; only the weight's memory layout differs.
    The packed weight is an opaque oneDNN tensor: CPU only, not saved with the model.
    """

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # The second argument is the expected batch size, a hint for the layout; decode steps
        # and small trees are the hot path, and the packed weight serves any number of rows.
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[:-1].numel() == 1:
            # oneDNN picks another kernel for a single row, one that sums in another order.
            # Two rows (the row twice) take the kernel every tree uses, so a decode step's row
            # is bit for bit the same row of a verify forward: batch invariance, for free at
            # this size (the step streams the weights either way).
            twice = torch.cat([x, x], dim=-2)
            return self._linear(twice).narrow(-2, 0, 1)
        return self._linear(x)

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [],
                                                  "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


def can_prepack(model: torch.nn.Module) -> bool:
    """Whether `prepack_linears` applies: a CPU model in fp32 or bf16, with oneDNN built in and
    able to pack that dtype here."""
    parameter = next(model.parameters())
    return (parameter.device.type == "cpu" and parameter.dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available() and onednn_packs(parameter.dtype))


@functools.cache
def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN reorders a linear weight of `dtype` on this CPU: float32 everywhere; bf16
    where torch's own check says so (AVX-512 BW, VL and DQ, or AVX-NE-CONVERT; Arm's bf16). An
    AVX2-only CPU has neither: the reorder raises there, and a bf16 model keeps PyTorch's own
    linears. (Asked, not tried: a C++ exception aborts a process under AddressSanitizer.)"""
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return True


def prepack_linears(model: torch.nn.Module) -> int:
    """Replace every `nn.Linear` of `model` by a `PackedLinear`; returns how many were packed.

    Tied weights (an LM head sharing the embedding matrix) keep the embedding as it is and give
    the head its own packed copy. Does nothing where `can_prepack` says no.
    """
    if not can_prepack(model):
        return 0
    packed = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(module, name, PackedLinear(child))
                packed += 1
    return packed


# Query lengths up to this use `invariant_attention`: every decode step and every draft tree.
# Longer ones (prompt prefills) are computed alike by every method, so they keep PyTorch SDPA.
INVARIANT_MAX_ROWS = 128
INVARIANT_ATTENTION = "dresd_invariant"


def invariant_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention whose every row is bit for bit the same in a decode step and in a tree.

    Why: a fused kernel (SDPA) sums a row's scores and values in an order that depends on how
    many rows and keys it was given, and on where the masked keys sit, so a tree row and the
    decode step it stands for round differently; in bf16 that flips near-tied tokens.

    How, two ways that give each row a result that depends only on its own query and the keys
    it may see, in their order:
    1. `kernels/attention.c` (bf16 on a CPU, head size a multiple of 64; compiled on first use):
       float32 sums in an order fixed by the code (its header says how each sum keeps it).
       One core, 9 heads, 400 keys, per layer: 0.07 ms for a decode step, 0.22 ms for 16 rows
       (PyTorch SDPA: 0.03 and 0.13 ms).
    2. Elsewhere, or without a C compiler: softmax(q k^T * scale + mask) v in float64 from the
       bf16 (or fp16) inputs. A product of two bf16 numbers has 16 significant bits, so q.k over
       a head (64 products) is exact in float64 whatever the order; softmax and the weighted sum
       of values carry ~1e-16 relative error, which the final rounding to bf16 (2^-8 relative)
       erases except with probability ~1e-13 per element; masked keys get weight exactly 0.
       Same sizes: 0.10 ms for a decode step, 0.53 ms for 16 rows.
    The two round differently, so a process uses one of them for every method.
    """
    batch, heads, rows, dim = query.shape
    if batch != 1 or rows > INVARIANT_MAX_ROWS or dropout:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    scale = dim**-0.5 if scaling is None else scaling
    if cpu_attention.usable(query, key):
        return cpu_attention.attention(query, key, value, attention_mask, scale), None
    kv_heads, length = key.shape[1], key.shape[2]
    groups = heads // kv_heads  # grouped-query attention: head h reads kv head h // groups
    grouped = query.double().reshape(batch, kv_heads, groups * rows, dim)
    scores = grouped @ key.double().transpose(-1, -2) * scale
    scores = scores.view(batch, kv_heads, groups, rows, length)
    if attention_mask is not None:
        mask = attention_mask[..., -length:]
        if mask.dtype == torch.bool:
            mask = torch.zeros_like(mask, dtype=torch.float64).masked_fill_(~mask, -torch.inf)
        scores = scores + mask.double().unsqueeze(1)
    elif rows > 1:  # causal: row i sees the keys up to its own position
        visible = torch.ones(rows, length, dtype=torch.bool, device=query.device)
        visible = visible.tril(length - rows)
        scores = scores.masked_fill(~visible, -torch.inf)
    weights = torch.softmax(scores, dim=-1).view(batch, kv_heads, groups * rows, length)
    out = (weights @ value.double()).view(batch, heads, rows, dim)
    return out.transpose(1, 2).to(query.dtype).contiguous(), None


AttentionInterface.register(INVARIANT_ATTENTION, invariant_attention)
AttentionMaskInterface.register(INVARIANT_ATTENTION, eager_mask)


def activation_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype a model's hidden states are in: its final norm's weight's where it has one
    (a GGUF file's Qwen3.5 model keeps its decay parameters in float32 and its activations in
    bf16, so its first parameter does not say it), else its first parameter's."""
    weight = getattr(getattr(getattr(model, "model", None), "norm", None), "weight", None)
    return weight.dtype if isinstance(weight, torch.Tensor) else next(model.parameters()).dtype


def use_invariant_attention(model: torch.nn.Module) -> bool:
    """Switch a reduced-precision model to `invariant_attention`; True if it took it."""
    dtype = activation_dtype(model)
    if dtype not in (torch.bfloat16, torch.float16):
        return False
    try:
        model.set_attn_implementation(INVARIANT_ATTENTION)
    except (AttributeError, ValueError, NotImplementedError):  # only its own attention
        return False
    return True


def attention_name(model: torch.nn.Module) -> str:
    """How `model` computes attention, for reports: `invariant (C kernel)`, `invariant
    (float64)` (no C compiler), or transformers' implementation name (`sdpa`, `eager`)."""
    config = model.config
    name = getattr(config, "_attn_implementation", None) or "unknown"
    if name != INVARIANT_ATTENTION:
        return name
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kernel = cpu_attention.takes(activation_dtype(model), head_dim)
    return "invariant (C kernel)" if kernel else "invariant (float64)"
