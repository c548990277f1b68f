"""A Llama-shaped decoder's layers in one C call per forward (the kernel: `kernels/decoder.c`).

Why: with the linears and attention already in C (`kernels/linear.py`, `kernels/attention.py`), what
was left of a bf16 decode step in PyTorch was ~300 small operations (norms, rotary embedding,
residual adds, cache writes, the SiLU gate) and the Python around them: about a third of the
step. `kernels/decoder.c` runs a whole forward, every layer, in one call; its header says what it
computes and how it rounds.

Where it runs: bf16 Llama-shaped models (`decoding/forward.LlamaForward`) whose q/k/v and
gate/up projections are fused on the C linear kernel, the attention is the batch-invariant C
kernel, the MLP is SiLU-gated without biases, and the sizes are whole vectors (hidden size and
intermediate size multiples of 16); per-head q and k norms before the rotary embedding
(Qwen3's) where the attention has them. Gemma-3's text layers too (`LayerForm` says what
differs: Gemma's RMSNorm with its 1 + weight, the GELU-tanh gate, norms of the attention's and
the MLP's outputs, sliding-window layers with their own rotary table); those run on the C
decoder only (`forward.LlamaForward.takes_on_c_decoder`). `CDecoder.build` returns None
elsewhere, and the forward keeps its PyTorch path (or transformers', for Gemma-3).
`DRESD_CPU_DECODER=0` turns it off. Compiled once per machine, like the other kernels
(`kernels.load`). On aarch64 (the neon tiers) the same: its whole forward runs under qemu in
the tests (tests/test_neon_qemu.py: Llama's and Gemma's layers, bf16 and quantized, every
output bit for bit the x86 avx2 tier's).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from dresd import kernels
from dresd.kernels import attention as cpu_attention
from dresd.kernels import linear as cpu_linear
from dresd.kernels import quant
from dresd.kernels.linear import InvariantLinear
from dresd.kernels.quant import QuantLinear, QuantParts
from dresd.models import spec

SOURCE = Path(__file__).with_name("decoder.c")
FLAGS = cpu_attention.FLAGS  # the attention kernel's: this file compiles it in

_pointer, _i32, _i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
_pointers = ctypes.POINTER(ctypes.c_void_p)


class WeightStruct(ctypes.Structure):
    """decoder.c's `Weight`: a projection's parts, each bf16 packed or one quant.c layout."""

    _fields_ = [("count", _i32), ("layout", _i32 * 3), ("n", _i32 * 3),
                ("data", _pointer * 3)]


def weight_struct(module: torch.nn.Module, k: int | None = None, n: int | None = None,
                  name: str = "a projection") -> WeightStruct:
    """The `Weight` of an `InvariantLinear`, a `QuantLinear` or a `QuantParts`; with k and n,
    checked first to take k inputs to n outputs, its packed buffers of the size the C kernels
    read for that (they cannot see a buffer's size: a weight of another shape than the model's
    would be read, or written, past its end)."""
    parts = module.parts if isinstance(module, QuantParts) else [module]
    if k is not None:
        _check_parts(parts, k, n, name)
    struct = WeightStruct(len(parts))
    for index, part in enumerate(parts):
        if isinstance(part, InvariantLinear):
            struct.layout[index], struct.data[index] = -1, part.packed_weight.data_ptr()
        else:
            struct.layout[index] = quant.LAYOUTS[part.qtype].number
            struct.data[index] = part.packed.data_ptr()
        struct.n[index] = part.out_features
    return struct


def _check_parts(parts: list[torch.nn.Module], k: int, n: int, name: str) -> None:
    """A ValueError naming the projection unless its parts take k inputs to n outputs in all,
    each packed as its kernel reads it."""
    if not 1 <= len(parts) <= 3 or sum(part.out_features for part in parts) != n:
        raise ValueError(f"C decoder: {name} has {[p.out_features for p in parts]} outputs "
                         f"where the model needs {n}")
    for part in parts:
        if part.in_features != k:
            raise ValueError(f"C decoder: {name} takes {part.in_features} inputs where the "
                             f"model gives it {k}")
        if isinstance(part, InvariantLinear):
            need = -(-part.out_features // cpu_linear.PANEL) * cpu_linear.PANEL * (k + k % 2)
            have = part.packed_weight.numel()
        else:
            need, have = quant.packed_bytes(part.qtype, part.out_features, k), part.packed.numel()
        if have != need:
            raise ValueError(f"C decoder: {name}'s packed weight holds {have} elements where "
                             f"{part.out_features} x {k} packs into {need}")


def _weights(modules: list[torch.nn.Module], k: int, n: int, name: str) -> ctypes.Array:
    return (WeightStruct * len(modules))(*[weight_struct(module, k, n, f"layer {i}'s {name}")
                                           for i, module in enumerate(modules)])


def _vectors(tensors: list[torch.Tensor | None], size: int, dtype: torch.dtype,
             name: str) -> ctypes.Array:
    """The addresses of per-layer vectors (norms, biases) the C decoder reads `size` of."""
    for i, tensor in enumerate(tensors):
        if tensor is not None and (tensor.dtype != dtype or tensor.numel() < size
                                   or not tensor.is_contiguous()):
            raise ValueError(f"C decoder: layer {i}'s {name} is {tensor.dtype} "
                             f"[{tensor.numel()}] where it reads {dtype} [{size}]")
    return _addresses(tensors)


PROJECTIONS = (InvariantLinear, QuantLinear, QuantParts)  # what the C decoder multiplies by


class DecoderStruct(ctypes.Structure):
    """kernels/decoder.c's `Decoder`: the sizes and the weights' addresses."""

    _fields_ = [("layers", _i32), ("hidden", _i32), ("heads", _i32), ("kv_heads", _i32),
                ("head_dim", _i32), ("intermediate", _i32), ("eps", ctypes.c_float),
                ("scale", ctypes.c_float), ("input_norm", _pointers), ("post_norm", _pointers),
                ("final_norm", _pointer), ("qkv", ctypes.POINTER(WeightStruct)),
                ("qkv_bias", _pointers), ("o", ctypes.POINTER(WeightStruct)),
                ("gate_up", ctypes.POINTER(WeightStruct)), ("down", ctypes.POINTER(WeightStruct)),
                ("q_norm", _pointers), ("k_norm", _pointers),
                ("norm_plus_one", _i32), ("activation", _i32),
                ("attention_out_norm", _pointers), ("mlp_out_norm", _pointers),
                ("windowed", ctypes.POINTER(ctypes.c_ubyte)), ("sinks", _pointers),
                ("o_bias", _pointers)]


class SegmentsStruct(ctypes.Structure):
    """kernels/decoder.c's `Segments`: the sequences of one forward."""

    _fields_ = [("count", _i32), ("first", ctypes.POINTER(_i32)), ("rows", ctypes.POINTER(_i32)),
                ("start", ctypes.POINTER(_i32)), ("keys", _pointers), ("values", _pointers),
                ("capacity", ctypes.POINTER(_i64)), ("masks", _pointers),
                ("mask_strides", ctypes.POINTER(_i64)), ("window_start", ctypes.POINTER(_i32)),
                ("window_masks", _pointers), ("window_mask_strides", ctypes.POINTER(_i64))]


class SegmentRows(NamedTuple):
    """Where one sequence's rows sit in a forward, as the C decoder takes them."""

    first: int  # its first row among the forward's rows
    rows: int
    start: int  # cache entries before its rows
    cache: object  # its `decoding.kv_cache.SequenceKV`
    mask: tuple[int, int] | None  # (address, row stride) of `cpu_attention.kernel_mask`'s
    #                               bf16 rows, or None: causal
    # The windowed layers' view (a model with sliding-window layers): the first key they read
    # and their own mask's (address, row stride), or None: `mask` from that key on
    window: tuple[int, tuple[int, int] | None] | None = None


@functools.cache
def kernel() -> ctypes.CDLL | None:
    """The compiled kernel (compiled on first use, then cached), or None where it cannot be."""
    if cpu_linear.kernel() is None or cpu_attention.kernel() is None:
        return None
    library = kernels.load(SOURCE, FLAGS, "DRESD_CPU_DECODER", "PyTorch's element-wise ops",
                           includes=(cpu_linear.SOURCE, cpu_attention.SOURCE, quant.SOURCE,
                                     *kernels.HEADERS))
    if library is None:
        return None
    decoder, segments = ctypes.POINTER(DecoderStruct), ctypes.POINTER(SegmentsStruct)
    library.dresd_decoder.argtypes = [decoder, _pointer, _i32, _pointer, _pointer, _pointer,
                                      _pointer, segments, _pointer, _i32]
    library.dresd_decoder.restype = _i32
    return library


def _head_norms(attention: torch.nn.Module) -> tuple[torch.nn.Module, ...]:
    """An attention's per-head q and k norms (Qwen3's, applied before the rotary embedding),
    or () where it has none."""
    norms = tuple(getattr(attention, name, None) for name in ("q_norm", "k_norm"))
    return norms if all(norm is not None for norm in norms) else ()


ACTIVATIONS = {spec.SILU: 0, spec.GELU_TANH: 1}  # decoder.c's ACTIVATION_SILU, _GELU_TANH


@dataclass(frozen=True)
class LayerForm:
    """What a model's layers compute, in the terms decoder.c's `Decoder` declares them:
    the norms' kind, the MLP's activation, norms of the attention's and the MLP's outputs
    (Gemma's post_attention_layernorm and post_feedforward_layernorm; its
    pre_feedforward_layernorm is the norm before the MLP), the sliding-window layers."""

    norm_plus_one: bool
    activation: int
    out_norms: bool
    windowed: tuple[bool, ...]

    @staticmethod
    def of(decoder: torch.nn.Module, config) -> LayerForm | None:
        """The form of `decoder`'s layers, as their architecture's spec declares it
        (`models/spec.py`, found by the config's model type), or None where decoder.c does
        not compute them: no spec, a config that asks for more than the spec's layers do (an
        activation of its own, logit soft-capping, bidirectional attention), modules that
        are not the spec's (sandwich norms where it has none), norms with several epsilons."""
        arch = spec.of_config(config)
        if arch is None or arch.forward != spec.C_DECODER:
            return None
        # Gemma names its activation hidden_activation (hidden_act is its older name)
        name = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
        if name != arch.activation or getattr(config, "attn_logit_softcapping", None):
            return None
        if getattr(config, "use_bidirectional_attention", False):
            return None
        layers = decoder.layers
        if any(bool(_out_norms(layer)) != arch.out_norms for layer in layers):
            return None
        norms = [norm for layer in layers for norm in _norms(layer)] + [decoder.norm]
        if len({_epsilon(norm) for norm in norms}) > 1:
            return None  # the C code has one epsilon for every norm
        # a window on the layers `layer_types` names (Gemma-3), else on every layer where the
        # config sets one (Mistral's; Qwen2's only with use_sliding_window)
        window = getattr(config, "sliding_window", None) \
            if getattr(config, "use_sliding_window", True) else None
        types = getattr(config, "layer_types", None) or [
            "sliding_attention" if window else "full_attention"] * len(layers)
        if len(types) != len(layers) or not set(types) <= {"full_attention",
                                                            "sliding_attention"}:
            return None
        windowed = tuple(kind == "sliding_attention" for kind in types)
        if any(windowed) and not (arch.sliding_windows and window):
            return None
        return LayerForm(arch.norm_plus_one, ACTIVATIONS[arch.activation], arch.out_norms,
                         windowed)


def _norms(layer: torch.nn.Module) -> list[torch.nn.Module]:
    """Every norm of a layer: input, before the MLP, the outputs' (Gemma), q's and k's."""
    return [layer.input_layernorm, _mlp_norm(layer), *_out_norms(layer),
            *_head_norms(layer.self_attn)]


def _mlp_norm(layer: torch.nn.Module) -> torch.nn.Module:
    """The norm before the MLP: Gemma's pre_feedforward_layernorm (its post_attention_layernorm
    norms the attention's output), Llama's post_attention_layernorm."""
    return getattr(layer, "pre_feedforward_layernorm", None) or layer.post_attention_layernorm


def _out_norms(layer: torch.nn.Module) -> tuple[torch.nn.Module, ...]:
    """Gemma's norms of the attention's and the MLP's outputs, or () where it has none."""
    if getattr(layer, "post_feedforward_layernorm", None) is None:
        return ()
    return layer.post_attention_layernorm, layer.post_feedforward_layernorm


def _epsilon(norm: torch.nn.Module) -> float | None:
    return getattr(norm, "variance_epsilon", getattr(norm, "eps", None))


def _addresses(tensors: list[torch.Tensor | None]) -> ctypes.Array:
    return (ctypes.c_void_p * len(tensors))(*[None if t is None else t.data_ptr()
                                              for t in tensors])


class CDecoder:
    """A model's decoder layers as `kernels/decoder.c` reads them; `fused[i]` is layer i's
    `forward.FusedProjections`. Holds the addresses of the model's own weights (no copy)."""

    @staticmethod
    def build(decoder: torch.nn.Module, config, fused: list) -> CDecoder | None:
        """The C decoder for a `LlamaForward`'s decoder, or None where it does not apply (the
        module docstring says when)."""
        layers = decoder.layers
        if kernel() is None or any(parts is None for parts in fused):
            return None
        form = LayerForm.of(decoder, config)
        if form is None:
            return None
        if config.hidden_size % 16 or config.intermediate_size % 16:
            return None
        if any(getattr(layer.self_attn, "sinks", None) is not None for layer in layers):
            return None  # attention sinks: gpt-oss's, whose MLPs are experts (MoEDecoder)
        for layer, parts in zip(layers, fused, strict=True):
            modules = (layer.self_attn.o_proj, layer.mlp.down_proj)
            if not all(isinstance(m, PROJECTIONS) and m.bias is None for m in modules):
                return None
            if parts.gate_up is None or parts.gate_up.bias is not None:
                return None
        if len({len(_head_norms(layer.self_attn)) for layer in layers}) > 1:
            return None  # q/k norms in some layers only: no model has that
        if len({layer.self_attn.scaling for layer in layers}) > 1:
            return None  # one attention scale for every layer
        return CDecoder(decoder, config, fused, form)

    form: LayerForm | None = None  # None: Llama's layers, no window (a subclass's)

    def __init__(self, decoder: torch.nn.Module, config, fused: list,
                 form: LayerForm) -> None:
        layers = decoder.layers
        self.form = form
        attention = layers[0].self_attn
        self.threads = None  # default: torch.get_num_threads() at each call
        # every size the C code reads a weight or a vector by, checked here against the model's
        hidden, inter = config.hidden_size, config.intermediate_size
        heads, kv_heads, head_dim = (config.num_attention_heads, config.num_key_value_heads,
                                     attention.head_dim)
        q_width, qkv_width = heads * head_dim, (heads + 2 * kv_heads) * head_dim
        self.sizes = (hidden, head_dim)
        bf16 = torch.bfloat16
        input_norms = _vectors([layer.input_layernorm.weight for layer in layers], hidden, bf16,
                               "input norm")
        post_norms = _vectors([_mlp_norm(layer).weight for layer in layers], hidden, bf16,
                              "MLP's norm")
        out_norms = [None, None]  # the attention's and the MLP's outputs' norms (Gemma)
        if form.out_norms:
            out_norms = [ctypes.cast(_vectors([_out_norms(layer)[i].weight for layer in layers],
                                              hidden, bf16, name), _pointers)
                         for i, name in enumerate(("attention output's norm",
                                                   "MLP output's norm"))]
        windowed = ((ctypes.c_ubyte * len(layers))(*form.windowed) if any(form.windowed)
                    else None)
        _vectors([decoder.norm.weight], hidden, bf16, "final norm")
        qkv_biases = _vectors([parts.qkv.bias for parts in fused], qkv_width, torch.float32,
                              "q/k/v bias")
        qkv = _weights([parts.qkv for parts in fused], hidden, qkv_width, "q/k/v")
        o = _weights([layer.self_attn.o_proj for layer in layers], q_width, hidden, "o")
        gate_up = _weights([parts.gate_up for parts in fused], hidden, 2 * inter, "gate/up")
        down = _weights([layer.mlp.down_proj for layer in layers], inter, hidden, "down")
        head_norms = [None, None]  # q's and k's per-head norms: NULL in C where there are none
        if _head_norms(attention):
            head_norms = [ctypes.cast(_vectors([getattr(layer.self_attn, name).weight
                                                for layer in layers], head_dim, bf16, name),
                                      _pointers) for name in ("q_norm", "k_norm")]
        # kept alive: the struct points into them
        self._arrays = [input_norms, post_norms, qkv_biases, qkv, o, gate_up, down, head_norms,
                        out_norms, windowed]
        self.struct = DecoderStruct(
            len(layers), config.hidden_size, config.num_attention_heads,
            config.num_key_value_heads, attention.head_dim, config.intermediate_size,
            _epsilon(layers[0].input_layernorm), attention.scaling,
            ctypes.cast(input_norms, _pointers), ctypes.cast(post_norms, _pointers),
            decoder.norm.weight.data_ptr(), qkv, ctypes.cast(qkv_biases, _pointers), o, gate_up,
            down, *head_norms, int(form.norm_plus_one), form.activation, *out_norms,
            ctypes.cast(windowed, ctypes.POINTER(ctypes.c_ubyte)) if windowed else None)
        self._weights = (decoder, fused)  # the addresses above stay valid while these live
        self.library = kernel()

    def segments(self, parts: list[SegmentRows]) -> SegmentsStruct:
        """The struct kernels/decoder.c reads for these segments (it points into arrays it
        holds)."""
        count = len(parts)
        ints = [(ctypes.c_int * count)(*values) for values in
                ([p.first for p in parts], [p.rows for p in parts], [p.start for p in parts])]
        keys = _addresses([p.cache.key_buffer for p in parts])
        values = _addresses([p.cache.value_buffer for p in parts])
        capacity = (ctypes.c_int64 * count)(*[p.cache.capacity for p in parts])
        masks = (ctypes.c_void_p * count)(*[p.mask and p.mask[0] for p in parts])
        strides = (ctypes.c_int64 * count)(*[p.mask[1] if p.mask else 0 for p in parts])
        struct = SegmentsStruct(count, *ints, ctypes.cast(keys, _pointers),
                                ctypes.cast(values, _pointers), capacity,
                                ctypes.cast(masks, _pointers), strides)
        window = None
        if self.form is not None and any(self.form.windowed):  # where each window starts
            views = [p.window or (0, None) for p in parts]
            window = ((ctypes.c_int * count)(*[start for start, _ in views]),
                      (ctypes.c_void_p * count)(*[mask and mask[0] for _, mask in views]),
                      (ctypes.c_int64 * count)(*[mask[1] if mask else 0 for _, mask in views]))
            struct.window_start = ctypes.cast(window[0], ctypes.POINTER(_i32))
            struct.window_masks = ctypes.cast(window[1], _pointers)
            struct.window_mask_strides = ctypes.cast(window[2], ctypes.POINTER(_i64))
        struct._keep = (ints, keys, values, capacity, masks, strides, window)
        return struct

    def _threads(self) -> int:
        return self.threads or torch.get_num_threads()

    @staticmethod
    def _check(status: int, name: str) -> None:
        if status == -2:
            raise ValueError(f"{name}: sizes it does not take (decoder.c's `dresd_decoder`)")
        if status != 0:
            raise MemoryError(f"{name}: out of memory")

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                segments: SegmentsStruct, local: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor:
        """Every layer and the final norm on hidden [rows, hidden] (embedded rows, bf16,
        contiguous; updated in place), cos/sin [rows, head_dim] bf16; `local`: the windowed
        layers' cos and sin, where they rotate by a table of their own. Returns the normed
        rows."""
        hidden_size, head_dim = self.sizes
        rows = hidden.shape[0]
        if (hidden.dtype != torch.bfloat16 or not hidden.is_contiguous()
                or hidden.shape != (rows, hidden_size)
                or any(t.dtype != torch.bfloat16 or not t.is_contiguous()
                       or t.shape != (rows, head_dim) for t in (cos, sin, *(local or ())))):
            raise ValueError(f"C decoder: rows [{rows}, {hidden_size}] and cos/sin [{rows}, "
                             f"{head_dim}] bf16 contiguous, not {tuple(hidden.shape)}, "
                             f"{tuple(cos.shape)}, {tuple(sin.shape)}")
        out = torch.empty_like(hidden)
        status = self.library.dresd_decoder(
            ctypes.byref(self.struct), hidden.data_ptr(), hidden.shape[0], cos.data_ptr(),
            sin.data_ptr(), *([t.data_ptr() for t in local] if local else [None, None]),
            ctypes.byref(segments), out.data_ptr(), self._threads())
        self._check(status, "dresd_decoder")
        return out
