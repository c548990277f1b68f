"""Batch-invariant attention in C, for bf16 models on CPUs (the kernel: `kernels/attention.c`).

Why a kernel: a tree's verify forward must give each node, bit for bit, what a one-token decode
step gives it (`fastpath.invariant_attention` says why). PyTorch's fused attention sums in an
order that depends on the batch; doing the sums in float64 with PyTorch ops makes the order
irrelevant but costs 4x PyTorch's fused attention on a 16-token tree (0.53 vs 0.12 ms a layer on
one core), which is most of what a tree costs beyond a decode step. The kernel keeps every sum
in float32, in an order fixed by the code (its header says which), at about the fused cost.

It is compiled once per machine with the system C compiler (`cc`, or `$CC`) into the cache
(`$DRESD_CACHE/kernels/`), with -march=native, and loaded with ctypes (`kernels.load`). Where
there is no compiler, or the compile fails, `kernel()` returns None and the float64 PyTorch
path stays: slower, equally batch-invariant. `DRESD_CPU_ATTENTION=0` turns the kernel off.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from dresd import kernels

SOURCE = Path(__file__).with_name("attention.c")
# No -ffast-math: the kernel's invariance rests on the IEEE order of its sums. Fused
# multiply-adds are allowed: every row runs the same instructions (the kernel's header).
# -fopenmp: `attention_batch`'s threads (torch's own libgomp, already loaded, serves them).
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-std=gnu11", "-shared", "-fPIC",
         "-fopenmp")


@functools.cache
def kernel() -> ctypes.CDLL | None:
    """The compiled kernel (compiled on first use, then cached), or None where it cannot be."""
    library = kernels.load(SOURCE, FLAGS, "DRESD_CPU_ATTENTION", "float64 attention")
    if library is None:
        return None
    function = library.dresd_attention
    pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    function.argtypes = [pointer, pointer, pointer, pointer, i64, i64, i64,
                         i32, i32, i32, i32, i32, ctypes.c_float, pointer]
    function.restype = i32
    batch = library.dresd_attention_batch
    batch.argtypes = [i32, pointer, i64, pointer, pointer, pointer, pointer, pointer, pointer,
                      pointer, pointer, pointer, i32, i32, i32, ctypes.c_float, pointer, pointer,
                      i32]
    batch.restype = i32
    return library


HEAD_DIM_MULTIPLE = 64  # the kernel's BLOCK: it takes head sizes in whole blocks


def takes(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether a CPU model of this dtype and head size runs on the kernel (where it builds)."""
    return (dtype == torch.bfloat16 and head_dim % HEAD_DIM_MULTIPLE == 0
            and kernel() is not None)


def usable(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether the kernel takes these inputs: `takes` their dtype and head size, one sequence
    on the CPU, key rows contiguous."""
    return (query.device.type == "cpu" and query.shape[0] == 1 and key.dtype == query.dtype
            and key.stride(-1) == 1 and key.stride(-2) == key.shape[-1]
            and takes(query.dtype, query.shape[-1]))


def kernel_mask(mask: torch.Tensor, length: int) -> tuple[torch.Tensor, int, int]:
    """A [1, 1, rows, >= length] mask as the kernel reads it: bf16 additive rows (a boolean
    True: may attend), with the address of its last `length` columns and its row stride."""
    rows_mask = mask[0, 0]
    if rows_mask.dtype == torch.bool:
        rows_mask = torch.zeros(rows_mask.shape, dtype=torch.bfloat16).masked_fill_(
            ~rows_mask, -torch.inf)
    elif rows_mask.dtype != torch.bfloat16 or rows_mask.stride(-1) != 1:
        rows_mask = rows_mask.to(torch.bfloat16).contiguous()  # 0 and -inf-ish stay so
    pointer = rows_mask.data_ptr() + (rows_mask.shape[1] - length) * 2
    return rows_mask, pointer, rows_mask.stride(0)


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v for query [1, heads, rows, dim] and key, value
    [1, kv_heads, length, dim] in bf16 (check `usable` first); mask: [1, 1, rows, >= length],
    additive or boolean, its last `length` columns read; None: causal. Returns
    [1, rows, heads, dim], the layout transformers' attention functions return."""
    _, heads, rows, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    if mask is not None and mask.shape[:2] != (1, 1):
        raise ValueError(f"expected a mask shared by all heads, got shape {tuple(mask.shape)}")
    query = query.contiguous()
    value = value if value.stride(-2) == dim and value.stride(-1) == 1 else value.contiguous()
    out = torch.empty(1, rows, heads, dim, dtype=query.dtype)
    mask_pointer, mask_stride = None, 0
    if mask is not None:  # its last `length` columns: the keys this layer holds
        rows_mask, mask_pointer, mask_stride = kernel_mask(mask, length)
    status = kernel().dresd_attention(
        query.data_ptr(), key.data_ptr(), value.data_ptr(), mask_pointer, key.stride(1),
        value.stride(1), mask_stride, heads, kv_heads, rows, length, dim, scale,
        out.data_ptr())
    if status != 0:
        raise MemoryError("dresd_attention: out of memory")
    return out


def attention_batch(query: torch.Tensor, bounds: list[int], keys: list[torch.Tensor],
                    values: list[torch.Tensor], masks: list[torch.Tensor | None], scale: float,
                    threads: int | None = None, out: torch.Tensor | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Every segment's attention in one kernel call, threads sharing the (segment, kv head)
    pairs; each row bit for bit what `attention` gives it.

    query: [total_rows, heads, dim] bf16 (the layout a batched forward's projection gives, head
    rows contiguous); segment s owns rows bounds[s]:bounds[s + 1]. keys[s], values[s]: its
    [1, kv_heads, length_s, dim] (rows contiguous, e.g. a preallocated cache's view); masks[s]:
    as `attention` takes it, or None (causal). threads: default `torch.get_num_threads()`.
    sinks: float32 [heads], each head's attention sink (gpt-oss's), or None.
    Returns (or fills) out [total_rows, heads, dim]."""
    total, heads, dim = query.shape
    if sinks is not None and (sinks.dtype != torch.float32 or sinks.shape != (heads,)
                              or not sinks.is_contiguous()):
        raise ValueError(f"attention_batch: sinks float32 [{heads}], not {sinks.dtype} "
                         f"{tuple(sinks.shape)}")
    if query.stride(-1) != 1 or query.stride(-2) != dim:
        query = query.contiguous()
    if out is None:
        out = torch.empty(total, heads, dim, dtype=query.dtype)
    count = len(keys)
    kv_heads = keys[0].shape[1] if count else 1
    first, rows, lengths = (ctypes.c_int * count)(), (ctypes.c_int * count)(), (
        ctypes.c_int * count)()
    key_pointers, value_pointers, mask_pointers = ((ctypes.c_void_p * count)() for _ in range(3))
    key_strides, value_strides, mask_strides = ((ctypes.c_int64 * count)() for _ in range(3))
    held = []  # converted masks, alive until the call returns
    for s, (key, value, mask) in enumerate(zip(keys, values, masks, strict=True)):
        length = key.shape[2]
        if key.stride(-1) != 1 or key.stride(-2) != dim:
            raise ValueError("attention_batch: key rows must be contiguous")
        if value.stride(-1) != 1 or value.stride(-2) != dim:
            value = value.contiguous()
            held.append(value)
        first[s], rows[s], lengths[s] = bounds[s], bounds[s + 1] - bounds[s], length
        key_pointers[s], value_pointers[s] = key.data_ptr(), value.data_ptr()
        key_strides[s], value_strides[s] = key.stride(1), value.stride(1)
        if mask is not None:
            if mask.shape[:2] != (1, 1):
                raise ValueError(f"expected a mask shared by all heads, got {tuple(mask.shape)}")
            rows_mask, mask_pointers[s], mask_strides[s] = kernel_mask(mask, length)
            held.append(rows_mask)
    status = kernel().dresd_attention_batch(
        count, query.data_ptr(), query.stride(0), first, rows, key_pointers, value_pointers,
        key_strides, value_strides, mask_pointers, mask_strides, lengths, heads, kv_heads, dim,
        scale, None if sinks is None else sinks.data_ptr(), out.data_ptr(),
        threads or torch.get_num_threads())
    if status != 0:
        raise MemoryError("dresd_attention_batch: out of memory")
    return out
