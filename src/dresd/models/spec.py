"""Every architecture dresd runs, declared in one table (as llama.cpp keeps a table of tensors
per architecture and vLLM one registry of models).

An `Architecture` says what a model's layers compute, in the terms the C decoder computes them
(`kernels/decoder.LayerForm` reads its norms and activation from here), and how a GGUF file
names and stores its tensors (`models/gguf.py` reads the file by it). Both ways in fill the
same spec: a GGUF file by its `general.architecture`, a transformers folder by its config's
`model_type`. A GGUF file of an architecture not in the table is refused with one error naming
it; a transformers folder of another type runs on transformers' own forward (`forward.
HFForward`), its linears still dresd's.

Sizes (layers, heads, experts) are not here: they are each file's or config's own. The spec is
what is the same for every model of an architecture.
"""

from __future__ import annotations

from dataclasses import dataclass

from dresd.errors import DresdError

# The forwards that run a model (`decoding/forward.make_forward` takes the model types each
# forward's spec entries name):
C_DECODER = "c_decoder"  # decoding/forward.LlamaForward, its layers in kernels/decoder.c
RECURRENT = "recurrent"  # decoding/recurrent.GatedDeltaNetForward: a state per tree node

SILU, GELU_TANH = "silu", "gelu_pytorch_tanh"  # the gated MLP's activations, transformers' names


@dataclass(frozen=True)
class Architecture:
    """One architecture as dresd runs it. Defaults: a Llama layer (RMSNorm, SiLU-gated MLP,
    grouped-query attention, rope on every layer)."""

    gguf: str  # `general.architecture` in a GGUF file
    model_types: tuple[str, ...]  # transformers' `config.model_type` for the same layers
    forward: str = C_DECODER  # C_DECODER or RECURRENT
    # --- what each layer computes
    activation: str = SILU  # the gated MLP's: act(gate(x)) * up(x)
    norm_plus_one: bool = False  # RMSNorm scales by (1 + weight) (Gemma), not by weight
    out_norms: bool = False  # norms of the attention's and the MLP's outputs (Gemma's sandwich)
    head_norms: bool = False  # an RMSNorm per head on q and k before the rope (Qwen3, Gemma-3)
    attention_biases: bool = True  # q, k and v may have biases (Qwen2's do), taken where
    #                                a file has them
    sliding_windows: bool = False  # layers that see a window of keys: some, each with a rope
    #                                 of their own (Gemma-3), or every one (Mistral, Phi-3)
    embedding_scale: bool = False  # embedded rows times sqrt(hidden size) (Gemma)
    experts: str = ""  # "": a dense MLP; "routed": top-k experts; "routed+shared": and a
    #                    shared expert scaled by sigmoid(x . w) (Qwen3.5-MoE)
    expert_gating: str = "softmax"  # softmax then the top k; "top_k_softmax": the top k
    #                                 logits, then their softmax (gpt-oss)
    expert_activation: str = SILU  # each expert's; "swiglu_clamped": gpt-oss's
    expert_biases: bool = False  # biases on the router and every expert's projections
    attention_sinks: bool = False  # a learned logit per head in the softmax, and a bias on
    #                                the attention's output projection (gpt-oss)
    recurrent_layers: bool = False  # Gated DeltaNet layers beside full attention (Qwen3.5)
    # True where LlamaForward's PyTorch path computes these layers too (where the C decoder
    # does not build: no compiler, float32); False: the C decoder, else transformers' forward
    pytorch_layers: bool = True
    # --- how its GGUF file stores it (llama.cpp's converter)
    permuted_qk: bool = False  # q and k rows permuted: llama.cpp ropes this one in pairs
    rope_scaling: tuple[str, ...] = ()  # what the file's rope scaling may be: "linear",
    #                                      "yarn" metadata; "rope_freqs" (Llama 3.1+'s tensor)
    stored_plus_one: bool = False  # norms stored as weight + 1 (the converter adds Gemma's one)
    # q, k and v stored one after another in `attn_qkv`, gate then up in `ffn_up` (Phi-3):
    # split by rows when the file is read, as transformers' Phi3 modules split their outputs
    fused_projections: bool = False
    mlp_norm: str = "ffn_norm"  # the norm before the MLP (gpt-oss's file: post_attention_norm)

    @property
    def layer_norms(self) -> tuple[tuple[str, str], ...]:
        """A layer's norms of the whole hidden vector: (the GGUF tensor, transformers' module),
        input norm first (llama.cpp's gguf-py tensor_mapping names them)."""
        if self.out_norms:  # Gemma: post_attention_layernorm norms the attention's output
            return (("attn_norm", "input_layernorm"), ("ffn_norm", "pre_feedforward_layernorm"),
                    ("post_attention_norm", "post_attention_layernorm"),
                    ("post_ffw_norm", "post_feedforward_layernorm"))
        return ("attn_norm", "input_layernorm"), (self.mlp_norm, "post_attention_layernorm")

    @property
    def moe(self) -> bool:
        """Whether each layer's MLP is a mixture of experts (run on kernels/experts.c)."""
        return bool(self.experts)


LLAMA_ROPE = ("linear", "yarn", "rope_freqs")  # as llama.cpp reads a Llama-family file
LLAMA = Architecture("llama", ("llama", "mistral"), sliding_windows=True, permuted_qk=True,
                     rope_scaling=LLAMA_ROPE)
QWEN2 = Architecture("qwen2", ("qwen2",), rope_scaling=LLAMA_ROPE)
QWEN3 = Architecture("qwen3", ("qwen3",), head_norms=True, rope_scaling=LLAMA_ROPE)
QWEN3_MOE = Architecture("qwen3moe", ("qwen3_moe",), head_norms=True, experts="routed",
                         rope_scaling=LLAMA_ROPE)
GEMMA3 = Architecture("gemma3", ("gemma3_text",), activation=GELU_TANH, norm_plus_one=True,
                      out_norms=True, head_norms=True, attention_biases=False,
                      sliding_windows=True,
                      embedding_scale=True, pytorch_layers=False, rope_scaling=("linear",),
                      stored_plus_one=True)
# Phi-3 and Phi-4: once its fused projections are split, a Phi-3 layer is Mistral's (its
# RMSNorms, SiLU-gated MLP, a window on every layer or on none; LongRoPE and a partial rotary
# factor by `models/phi3.RotaryByPosition`), so a file (`gguf.phi3_config`) and a transformers
# folder (`models/phi3.as_mistral`) are read into transformers' Mistral model and run as one
# (hence no model type here).
PHI3 = Architecture("phi3", (), attention_biases=False, fused_projections=True)
# gpt-oss (20b, 120b): every layer's MLP its experts (the router and the experts biased, the
# top 4 logits then their softmax, a clamped SwiGLU), attention with biases, a sink per head,
# a window on every other layer, YaRN; run on the C decoder only (`kernels/experts.py`)
GPT_OSS = Architecture("gpt-oss", ("gpt_oss",), sliding_windows=True, experts="routed",
                       expert_gating="top_k_softmax", expert_activation="swiglu_clamped",
                       expert_biases=True, attention_sinks=True, pytorch_layers=False,
                       rope_scaling=("yarn",), mlp_norm="post_attention_norm")
QWEN35 = Architecture("qwen35", ("qwen3_5_text",), forward=RECURRENT, norm_plus_one=True,
                      head_norms=True, recurrent_layers=True, stored_plus_one=True)
QWEN35_MOE = Architecture("qwen35moe", ("qwen3_5_moe_text",), forward=RECURRENT,
                          norm_plus_one=True, head_norms=True, recurrent_layers=True,
                          experts="routed+shared", stored_plus_one=True)

ARCHITECTURES: tuple[Architecture, ...] = (LLAMA, QWEN2, QWEN3, QWEN3_MOE, GEMMA3, PHI3,
                                           GPT_OSS, QWEN35, QWEN35_MOE)
BY_GGUF = {spec.gguf: spec for spec in ARCHITECTURES}
BY_MODEL_TYPE = {model_type: spec for spec in ARCHITECTURES for model_type in spec.model_types}
GGUF_NAMES = tuple(BY_GGUF)  # for messages: the GGUF architectures dresd runs


class ArchitectureError(DresdError):
    """An architecture dresd does not run; the message names it and those it runs."""


def of_gguf(name: str, where: str = "") -> Architecture:
    """The spec of a GGUF file's `general.architecture`, or one clear error."""
    if name not in BY_GGUF:
        raise ArchitectureError(f"{where}{': ' if where else ''}architecture {name!r} is not one "
                                f"dresd runs from a GGUF file yet ({', '.join(GGUF_NAMES)}).")
    return BY_GGUF[name]


def of_config(config) -> Architecture | None:
    """The spec of a transformers config (its `model_type`), or None: transformers' forward."""
    return BY_MODEL_TYPE.get(getattr(config, "model_type", None))
