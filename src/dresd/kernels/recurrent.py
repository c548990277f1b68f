"""The gated delta rule over a draft tree's rows (Qwen3.5's Gated DeltaNet layers), in C
(`kernels/recurrent.c`, whose header states the rule and why a row's bits never depend on the
rows beside it), with the same rule in PyTorch where the C kernel cannot be built.

    delta_rule(parents, q, k, v, beta, g, state, tiled, last) -> (out, state after last row)

q, k: [rows, key heads, dk]; v: [rows, heads, dv]; beta, g: [rows, heads]; state: the layer's
kept state [heads, dk, dv]; all float32. parents[r] < r is the row row r continues from (-1:
the kept state). `tiled`: value head h reads key head h % key heads (a GGUF file's order),
else h // (heads / key heads) (transformers'). `last`: whether to return the state after the
last row (a chain's end), else None.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from dresd import kernels
from dresd.kernels import attention as cpu_attention

SOURCE = cpu_attention.SOURCE.with_name("recurrent.c")
_pointer, _i32 = ctypes.c_void_p, ctypes.c_int


@functools.cache
def kernel() -> ctypes.CDLL | None:
    """The compiled kernel (compiled on first use, then cached), or None where it cannot be
    (`DRESD_CPU_RECURRENT=0` too): then `delta_rule` runs in PyTorch."""
    library = kernels.load(SOURCE, cpu_attention.FLAGS, "DRESD_CPU_RECURRENT",
                           "PyTorch's delta rule")
    if library is None:
        return None
    library.dresd_delta_rule.argtypes = [_i32, _pointer, _i32, _i32, _i32, _i32, _i32,
                                         *[_pointer] * 8, _i32]
    library.dresd_delta_rule.restype = _i32
    return library


def delta_rule(parents: list[int], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               beta: torch.Tensor, g: torch.Tensor, state: torch.Tensor, tiled: bool,
               last: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each row's output [rows, heads, dv], and the state after the last row where `last`."""
    rows, heads, dv = v.shape
    key_heads, dk = q.shape[1], q.shape[2]
    tensors = [x.float().contiguous() for x in (q, k, v, beta, g, state)]
    library = kernel()
    if library is None or q.device.type != "cpu":
        return _delta_rule_torch(parents, *tensors, tiled, last)
    out = torch.empty(rows, heads, dv, dtype=torch.float32)
    after = torch.empty(heads, dk, dv, dtype=torch.float32) if last else None
    parent_rows = torch.tensor(parents, dtype=torch.int32)
    status = library.dresd_delta_rule(
        rows, parent_rows.data_ptr(), heads, key_heads, dk, dv, int(tiled),
        *[x.data_ptr() for x in tensors], out.data_ptr(),
        after.data_ptr() if last else None, torch.get_num_threads())
    if status == -2:
        raise ValueError("dresd_delta_rule: sizes it does not take (kernels/recurrent.c)")
    if status != 0:
        raise MemoryError("dresd_delta_rule: out of memory")
    return out, after


def _delta_rule_torch(parents, q, k, v, beta, g, state, tiled: bool, last: bool):
    """The same rule, row by row in PyTorch (the kernel's header states it)."""
    rows, heads, dv = v.shape
    key_heads, dk = q.shape[1], q.shape[2]
    repeats = heads // key_heads
    if tiled:
        q, k = q.repeat(1, repeats, 1), k.repeat(1, repeats, 1)
    else:
        q, k = q.repeat_interleave(repeats, 1), k.repeat_interleave(repeats, 1)
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) / dk ** 0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    states, out = [], torch.empty(rows, heads, dv)
    for row, parent in enumerate(parents):
        s = (state if parent < 0 else states[parent]) * g[row].exp()[:, None, None]
        missed = v[row] - (s * k[row][:, :, None]).sum(1)  # [heads, dv]
        s = s + k[row][:, :, None] * (beta[row][:, None] * missed)[:, None, :]
        out[row] = (s * q[row][:, :, None]).sum(1)
        states.append(s)
    return out, states[-1] if last else None
