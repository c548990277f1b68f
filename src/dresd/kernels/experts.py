"""Mixture-of-experts MLPs (Qwen3-MoE's, gpt-oss's) on a GGUF file's expert blocks, in C (the
kernel: `kernels/experts.c`, whose header says what it computes and why a row's bits never
depend on the rows beside it).

    `MoEMLP`     one layer's sparse MLP: the router (float32) and each expert's gate/up and down
                 as the file's own linears (`QuantLinear` on quantized blocks, `InvariantLinear`
                 on bf16); its forward is one C call (`dresd_moe_mlp`): routing, the chosen
                 experts' MLPs, their weighted sum. `LlamaForward`'s PyTorch layer loop calls it
                 as a layer's `mlp` where the C decoder does not run (DRESD_CPU_DECODER=0).
    `MoEDecoder` the C decoder (`kernels/decoder.py`'s `CDecoder`) whose layers end in those
                 MLPs: the whole forward in one C call (`dresd_moe_decoder`), as for a dense
                 model.

Every size and weight the C code reads by is checked here first (`decoder.weight_struct`: each
expert's parts against the sizes the model says), as for the dense decoder.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from dresd import kernels
from dresd.kernels import attention as cpu_attention
from dresd.kernels import decoder as c_decoder
from dresd.kernels import linear as cpu_linear
from dresd.kernels import quant
from dresd.kernels.decoder import PROJECTIONS, CDecoder, DecoderStruct, WeightStruct
from dresd.models import spec

SOURCE = Path(__file__).with_name("experts.c")
_pointer, _i32 = ctypes.c_void_p, ctypes.c_int
_pointers = ctypes.POINTER(ctypes.c_void_p)


class ExpertsStruct(ctypes.Structure):
    """kernels/experts.c's `Experts`."""

    _fields_ = [("experts", _i32), ("used", _i32), ("ffn", _i32), ("norm", _i32),
                ("router", _pointers), ("gate_up", ctypes.POINTER(WeightStruct)),
                ("down", ctypes.POINTER(WeightStruct)), ("gating", _i32), ("activation", _i32),
                ("alpha", ctypes.c_float), ("limit", ctypes.c_float),
                ("router_bias", _pointers), ("gate_up_bias", _pointers),
                ("down_bias", _pointers)]


# experts.c's GATING_SOFTMAX, GATING_TOP_K_SOFTMAX: softmax over every expert, then the top k
# (Qwen3-MoE); the top k logits, then softmax over them (gpt-oss)
GATINGS = {"softmax": 0, "top_k_softmax": 1}
# experts.c's EXPERTS_SILU, EXPERTS_SWIGLU_CLAMPED (gpt-oss's, with its alpha and limit)
SWIGLU_CLAMPED = "swiglu_clamped"
ACTIVATIONS = {spec.SILU: 0, SWIGLU_CLAMPED: 1}


@functools.cache
def kernel() -> ctypes.CDLL | None:
    """The compiled kernel (compiled on first use, then cached), or None where it cannot be
    (`DRESD_CPU_EXPERTS=0` too; then a MoE file is refused). `DRESD_CPU_DECODER=0`
    leaves it: the layers then run in PyTorch, each layer's experts still here (`MoEMLP`)."""
    if cpu_linear.kernel() is None or cpu_attention.kernel() is None:
        return None
    library = kernels.load(SOURCE, c_decoder.FLAGS, "DRESD_CPU_EXPERTS", "no MoE models",
                           includes=(c_decoder.SOURCE, cpu_linear.SOURCE, cpu_attention.SOURCE,
                                     quant.SOURCE, *kernels.HEADERS))
    if library is None:
        return None
    experts = ctypes.POINTER(ExpertsStruct)
    library.dresd_moe_route.argtypes = [experts, _i32, _pointer, _i32, _i32, _pointer, _pointer,
                                        _i32]
    library.dresd_moe_mlp.argtypes = [experts, _i32, _pointer, _i32, _i32, _pointer, _i32]
    library.dresd_moe_decoder.argtypes = [ctypes.POINTER(DecoderStruct), experts, _pointer,
                                          _i32, _pointer, _pointer,
                                          ctypes.POINTER(c_decoder.SegmentsStruct), _pointer,
                                          _i32]
    for name in ("dresd_moe_route", "dresd_moe_mlp", "dresd_moe_decoder"):
        getattr(library, name).restype = _i32
    return library


def _check(status: int, name: str) -> None:
    if status == -2:
        raise ValueError(f"{name}: sizes it does not take (kernels/experts.c)")
    if status != 0:
        raise MemoryError(f"{name}: out of memory")


class MoEMLP(torch.nn.Module):
    """One layer's sparse MLP on the file's experts (the module docstring).

    router: float32 [experts, hidden]; gate_up[e]: expert e's gate and up side by side (2 ffn
    outputs), down[e]: its down projection (hidden outputs), each a `PROJECTIONS` module (with
    a float32 bias, gpt-oss's, or none). gpt-oss's routing and activation: `router_bias`
    (float32 [experts]), `gating` "top_k_softmax" (`GATINGS`), `activation` SWIGLU_CLAMPED
    with its `swiglu` (alpha, limit)."""

    def __init__(self, router: torch.Tensor, gate_up: list[torch.nn.Module],
                 down: list[torch.nn.Module], used: int, norm: bool, *,
                 router_bias: torch.Tensor | None = None, gating: str = "softmax",
                 activation: str = spec.SILU, swiglu: tuple[float, float] = (0.0, 0.0)) -> None:
        super().__init__()
        experts, hidden = router.shape
        self.experts, self.used, self.hidden, self.norm = experts, used, hidden, norm
        self.gating, self.activation, self.swiglu = gating, activation, swiglu
        self.ffn = down[0].in_features if down else 0
        if (not 1 <= used <= experts or len(gate_up) != experts or len(down) != experts
                or router.dtype != torch.float32 or hidden % 16 or self.ffn % 16
                or gating not in GATINGS or activation not in ACTIVATIONS
                or (router_bias is not None and (router_bias.dtype != torch.float32
                                                 or router_bias.shape != (experts,)))):
            raise ValueError(f"MoE MLP: {experts} experts ({len(gate_up)} gate/up, {len(down)} "
                             f"down), {used} used, hidden {hidden}, expert size {self.ffn}, "
                             f"router {router.dtype}, gating {gating!r}, activation "
                             f"{activation!r}: not one the C kernel takes")
        self.register_buffer("router", router.contiguous(), persistent=False)
        self.register_buffer("router_bias", None if router_bias is None
                             else router_bias.contiguous(), persistent=False)
        self.gate_up = torch.nn.ModuleList(gate_up)
        self.down = torch.nn.ModuleList(down)
        self._struct = None

    def weight_structs(self) -> tuple[list[WeightStruct], list[WeightStruct]]:
        """Each expert's `Weight`s, checked against the sizes the C code reads them by."""
        hidden, ffn = self.hidden, self.ffn
        for module in (*self.gate_up, *self.down):
            if not isinstance(module, PROJECTIONS):
                raise ValueError(f"MoE MLP: an expert's projection is {type(module).__name__}"
                                 ", which the C kernel does not take")
        for modules, size, name in ((self.gate_up, 2 * ffn, "gate/up"),
                                    (self.down, hidden, "down")):
            c_decoder._vectors([module.bias for module in modules], size, torch.float32,
                               f"expert's {name} bias")
            if len({module.bias is None for module in modules}) > 1:
                raise ValueError(f"MoE MLP: some experts' {name} have a bias, some not")
        return ([c_decoder.weight_struct(m, hidden, 2 * ffn, f"expert {e}'s gate/up")
                 for e, m in enumerate(self.gate_up)],
                [c_decoder.weight_struct(m, ffn, hidden, f"expert {e}'s down")
                 for e, m in enumerate(self.down)])

    def struct(self) -> ExpertsStruct:
        if self._struct is None:
            self._struct = experts_struct([self])
        return self._struct

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        library = kernel()
        if library is None:
            raise RuntimeError("MoE MLP: the C kernel (kernels/experts.c) is not available")
        shape = x.shape
        rows = x.reshape(-1, self.hidden).to(torch.bfloat16).contiguous()
        out = torch.empty_like(rows)
        _check(library.dresd_moe_mlp(ctypes.byref(self.struct()), 0, rows.data_ptr(),
                                     rows.shape[0], self.hidden, out.data_ptr(),
                                     torch.get_num_threads()), "dresd_moe_mlp")
        return out.reshape(shape)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(experts [rows, used] int32, weights [rows, used] float32) of x [rows, hidden], as the
        C kernel routes them."""
        rows = x.reshape(-1, self.hidden).to(torch.bfloat16).contiguous()
        index = torch.empty(rows.shape[0], self.used, dtype=torch.int32)
        weight = torch.empty(rows.shape[0], self.used, dtype=torch.float32)
        _check(kernel().dresd_moe_route(ctypes.byref(self.struct()), 0, rows.data_ptr(),
                                        rows.shape[0], self.hidden, index.data_ptr(),
                                        weight.data_ptr(), torch.get_num_threads()),
               "dresd_moe_route")
        return index, weight

    def extra_repr(self) -> str:
        return (f"experts={self.experts}, used={self.used}, hidden={self.hidden}, "
                f"ffn={self.ffn}, norm={self.norm}, gating={self.gating}, "
                f"activation={self.activation}")


def experts_struct(mlps: list[MoEMLP]) -> ExpertsStruct:
    """The `Experts` of these layers (one size for all); it keeps the arrays it points into."""
    first = mlps[0]

    def form(m: MoEMLP) -> tuple:
        return (m.experts, m.used, m.ffn, m.hidden, m.norm, m.gating, m.activation, m.swiglu,
                m.router_bias is None, m.gate_up[0].bias is None, m.down[0].bias is None)

    if any(form(m) != form(first) for m in mlps):
        raise ValueError("MoE MLP: layers of different expert sizes or forms")
    gate_up, down = [], []
    for mlp in mlps:
        ups, downs = mlp.weight_structs()
        gate_up += ups
        down += downs
    routers = (ctypes.c_void_p * len(mlps))(*[m.router.data_ptr() for m in mlps])
    gate_up_array = (WeightStruct * len(gate_up))(*gate_up)
    down_array = (WeightStruct * len(down))(*down)
    # the biases' addresses, or NULL where the experts have none
    biases = [None if all(t is None for t in tensors) else c_decoder._addresses(tensors)
              for tensors in ([m.router_bias for m in mlps],
                              [e.bias for m in mlps for e in m.gate_up],
                              [e.bias for m in mlps for e in m.down])]
    struct = ExpertsStruct(first.experts, first.used, first.ffn, int(first.norm),
                           ctypes.cast(routers, _pointers), gate_up_array, down_array,
                           GATINGS[first.gating], ACTIVATIONS[first.activation], *first.swiglu,
                           *[ctypes.cast(array, _pointers) if array is not None else None
                             for array in biases])
    # the modules: their owner keeps them
    struct._keep = (routers, gate_up_array, down_array, biases)
    return struct


def _assign(struct: ctypes.Structure, **values) -> None:
    for name, value in values.items():
        setattr(struct, name, value)


def _attribute(module: torch.nn.Module, dotted: str):
    """module.a.b for "a.b", or None where a part is missing."""
    for name in dotted.split("."):
        module = getattr(module, name, None)
    return module


def is_moe(decoder: torch.nn.Module) -> bool:
    """Whether the decoder has layers and every layer's MLP is a `MoEMLP`."""
    layers = getattr(decoder, "layers", None)
    return bool(layers) and all(isinstance(getattr(layer, "mlp", None), MoEMLP)
                                for layer in layers)


class MoEDecoder(CDecoder):
    """`CDecoder` for a decoder whose layers' MLPs are `MoEMLP`s: attention as the dense
    decoder's, each layer's MLP the experts' (`dresd_moe_decoder`)."""

    @staticmethod
    def build(decoder: torch.nn.Module, config, fused: list) -> MoEDecoder | None:
        """The decoder, or None where the C code does not apply (the kernel missing; a
        layer's projections other than the dense decoder takes; layers other than a Llama
        form's: `dresd_moe_decoder` computes RMSNorm, and attention over every key or over a
        window (gpt-oss's alternate layers, with its sinks and output bias))."""
        layers = decoder.layers
        if (kernel() is None or c_decoder.kernel() is None or not is_moe(decoder)
                or any(parts is None for parts in fused) or config.hidden_size % 16):
            return None
        form = c_decoder.LayerForm.of(decoder, config)
        if form is None or form.norm_plus_one or form.out_norms \
                or form.activation != c_decoder.ACTIVATIONS[spec.SILU]:
            return None
        for layer in layers:
            if not isinstance(layer.self_attn.o_proj, PROJECTIONS):
                return None
        for name in ("sinks", "o_proj.bias"):  # on every layer or none
            if len({_attribute(layer.self_attn, name) is None for layer in layers}) > 1:
                return None
        if len({len(c_decoder._head_norms(layer.self_attn)) for layer in layers}) > 1:
            return None
        return MoEDecoder(decoder, config, fused, form)

    def __init__(self, decoder: torch.nn.Module, config, fused: list,
                 form: c_decoder.LayerForm) -> None:
        layers = decoder.layers
        self.form = form  # its windowed layers: `CDecoder.segments` gives them their view
        attention = layers[0].self_attn
        self.threads = None
        hidden = config.hidden_size
        heads, kv_heads, head_dim = (config.num_attention_heads, config.num_key_value_heads,
                                     attention.head_dim)
        q_width, qkv_width = heads * head_dim, (heads + 2 * kv_heads) * head_dim
        self.sizes = (hidden, head_dim)
        bf16 = torch.bfloat16
        vectors = c_decoder._vectors
        input_norms = vectors([layer.input_layernorm.weight for layer in layers], hidden, bf16,
                              "input norm")
        post_norms = vectors([layer.post_attention_layernorm.weight for layer in layers], hidden,
                             bf16, "post-attention norm")
        vectors([decoder.norm.weight], hidden, bf16, "final norm")
        qkv_biases = vectors([parts.qkv.bias for parts in fused], qkv_width, torch.float32,
                             "q/k/v bias")
        qkv = c_decoder._weights([parts.qkv for parts in fused], hidden, qkv_width, "q/k/v")
        o = c_decoder._weights([layer.self_attn.o_proj for layer in layers], q_width, hidden,
                               "o")
        head_norms = {}
        if c_decoder._head_norms(attention):
            head_norms = {name: ctypes.cast(vectors([getattr(layer.self_attn, name).weight
                                                     for layer in layers], head_dim, bf16, name),
                                            _pointers) for name in ("q_norm", "k_norm")}
        self.experts = experts_struct([layer.mlp for layer in layers])
        # gpt-oss's: its windowed layers, each head's attention sink, the output bias
        extra = {}
        if any(form.windowed):
            extra["windowed"] = (ctypes.c_ubyte * len(layers))(*form.windowed)
        if attention.o_proj.bias is not None:
            extra["o_bias"] = vectors([layer.self_attn.o_proj.bias for layer in layers],
                                      hidden, torch.float32, "output bias")
        if getattr(attention, "sinks", None) is not None:
            extra["sinks"] = vectors([layer.self_attn.sinks for layer in layers], heads,
                                     torch.float32, "attention sinks")
        self._arrays = [input_norms, post_norms, qkv_biases, qkv, o, head_norms, extra]
        # By name, in a zeroed buffer larger than the struct: fields the dense decoder's struct
        # gains (another family's) are 0 / NULL here, read as "none" by decoder.c.
        self._buffer = ctypes.create_string_buffer(ctypes.sizeof(DecoderStruct) + 512)
        self.struct = DecoderStruct.from_buffer(self._buffer)
        _assign(self.struct,
            layers=len(layers), hidden=hidden, heads=heads, kv_heads=kv_heads,
            head_dim=head_dim, intermediate=self.experts.ffn,
            eps=layers[0].input_layernorm.variance_epsilon, scale=attention.scaling,
            input_norm=ctypes.cast(input_norms, _pointers),
            post_norm=ctypes.cast(post_norms, _pointers), final_norm=decoder.norm.weight.data_ptr(),
            qkv=qkv, qkv_bias=ctypes.cast(qkv_biases, _pointers), o=o, **head_norms,
            **{name: ctypes.cast(array, ctypes.POINTER(ctypes.c_ubyte) if name == "windowed"
                                 else _pointers) for name, array in extra.items()})
        self._weights = (decoder, fused)
        self.library = kernel()

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                segments: c_decoder.SegmentsStruct) -> torch.Tensor:
        """As `CDecoder.forward`, every layer's MLP the experts'."""
        hidden_size, head_dim = self.sizes
        rows = hidden.shape[0]
        if (hidden.dtype != torch.bfloat16 or not hidden.is_contiguous()
                or hidden.shape != (rows, hidden_size)
                or any(t.dtype != torch.bfloat16 or not t.is_contiguous()
                       or t.shape != (rows, head_dim) for t in (cos, sin))):
            raise ValueError(f"MoE decoder: rows [{rows}, {hidden_size}] and cos/sin [{rows}, "
                             f"{head_dim}] bf16 contiguous, not {tuple(hidden.shape)}, "
                             f"{tuple(cos.shape)}, {tuple(sin.shape)}")
        out = torch.empty_like(hidden)
        _check(self.library.dresd_moe_decoder(
            ctypes.byref(self.struct), ctypes.byref(self.experts), hidden.data_ptr(), rows,
            cos.data_ptr(), sin.data_ptr(), ctypes.byref(segments), out.data_ptr(),
            self._threads()), "dresd_moe_decoder")
        return out
