"""A GGUF file as a target: the model llama.cpp and Ollama users already have, run as it is.

    --model FILE.gguf -> its header (`gguf_file.open_gguf`, every offset checked)
                      -> its architecture's spec (`spec.of_gguf`: what its layers compute and
                         which tensors they read; an architecture not declared is refused)
                      -> every tensor the spec reads checked: present, typed, shaped
                      -> the file's metadata (sizes, rope) -> a transformers config
                      -> its tokenizer (transformers reads it from the file: chat template,
                         special tokens; held compactly, `compact_tokenizer`)
                      -> a transformers model built on the meta device (no weights allocated),
                         whose modules then take the file's tensors:
                           linears: `kernels.quant.QuantLinear`, the blocks packed once, never
                                    dequantized (float tensors: `kernels.linear.InvariantLinear`)
                           token embedding: rows dequantized when looked up
                           norms: the file's float32 values as bf16 parameters

For `llama`, `qwen2` and `qwen3` the forward is dresd's own (`decoding/forward.LlamaForward` on
the C decoder; Qwen3's per-head q/k norms included), with the file's rope scaling as llama.cpp
reads it (`file_rope_parameters`; Llama 3.x's `rope_freqs` tensor: `divide_rope_frequencies`);
a `gemma3` file (Gemma-3's text model: sliding-window layers, tied embedding) is built as
transformers' `Gemma3ForCausalLM` and runs on the same C decoder in its Gemma form
(`kernels/decoder.LayerForm`: Gemma's norms, GELU-tanh, the windowed layers with their own
rope), or on transformers' forward (`forward.HFForward`) where the C decoder does not build.
Either way every method runs on
the file's own weights with the same batch-invariance as a bf16 model: the reference for a GGUF
model is its own plain decoding on the same file.

llama.cpp's converter permutes the rows of a Llama-architecture file's q and k projections (its
rotary embedding pairs neighbouring dimensions, transformers' pairs the two halves of a head);
`unpermute_rows` undoes that, whole rows at a time, so the blocks stay as they are. A Gemma-3
file has no such permutation (llama.cpp ropes it NEOX-style, as transformers does); its norms
are stored plus one (`gemma3_config` and `_fill_layers` say what else differs).

A `phi3` file (Phi-3, Phi-4) keeps q, k and v in one tensor and gate and up in another; split
by rows, its layers are Mistral's, and it is built as transformers' `MistralForCausalLM`
(`phi3_config`), run on the C decoder with the file's window on every layer (Phi-3-mini-4k:
2047; Phi-4: none), LongRoPE and a partial rotary factor (Phi-3.5-mini, Phi-4-mini) by
`phi3.RotaryByPosition`, the q and k heads' rows reordered for the latter (`phi3.head_rows`).

A `qwen3moe` file runs as a `qwen3` one, each layer's MLP its experts: `_Tensors.experts` reads
the router and the 3-D expert tensors into a `kernels/experts.MoEMLP`, run in C.

A `qwen35` file (Qwen3.5's text model: Gated DeltaNet layers beside gated full attention) is
built as transformers' `Qwen3_5ForCausalLM` and runs on `decoding/recurrent.py`, its draft
trees verified over the recurrent states node by node (the Qwen3.5 section below says how the
file is read back); a `qwen35moe` file as `Qwen3_5MoeForCausalLM`, each layer's MLP its routed
experts in C plus the gated shared expert (`SharedExpertMoE`).
"""

from __future__ import annotations

import hashlib
import math
import tempfile
from dataclasses import astuple, dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma3TextConfig,
    GptOssConfig,
    MistralConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
)
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from dresd.decoding.recurrent import TILED_VALUE_HEADS
from dresd.errors import DresdError
from dresd.host import cache_dir, give_back_free_heap
from dresd.kernels import quant
from dresd.kernels.experts import MoEMLP
from dresd.kernels.experts import kernel as experts_kernel
from dresd.kernels.linear import InvariantLinear, dense_weight
from dresd.kernels.linear import kernel as linear_kernel
from dresd.models import compact_tokenizer, phi3, spec
from dresd.models.gguf_file import (
    FLOAT_TYPES,
    PHI3_ROPE_FACTORS,
    ROPE_FREQS,
    SUPPORTED_TYPES,
    GGUFError,
    GGUFFile,
    Q,
    forget_vocabulary,
    gguf_fingerprint,
    metadata,
    metadata_number,
    metadata_size,
    open_gguf,
    token_indices,
    token_rows,
)
from dresd.models.mtp import MultiTokenPredictor
from dresd.models.spec import Architecture


class QuantEmbedding(torch.nn.Module):
    """A token embedding kept in the file's blocks: the rows asked for are dequantized (the
    same values every time), the rest never are. `scale`: a factor on every row (Gemma's
    sqrt(hidden size)), applied in float32 before the rows are rounded to bf16, as llama.cpp
    scales its float32 rows."""

    def __init__(self, qtype: Q, raw: np.ndarray, vocab: int, dim: int,
                 scale: float = 1.0) -> None:
        super().__init__()
        self.qtype, self.raw, self.num_embeddings, self.embedding_dim = qtype, raw, vocab, dim
        self.scale = scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).cpu().numpy()
        rows = quant.dequantize(self.qtype, np.asarray(self.raw[flat]), len(flat),
                                self.embedding_dim)
        if self.scale != 1.0:
            rows = rows * np.float32(self.scale)
        return torch.from_numpy(rows).to(torch.bfloat16).reshape(*ids.shape, -1)


class ScaledEmbedding(torch.nn.Embedding):
    """A float (bf16) token embedding whose rows are multiplied by `scale` in float32 before
    they are rounded to bf16 (Gemma's sqrt(hidden size), as `QuantEmbedding` applies it)."""

    def __init__(self, weight: torch.Tensor, scale: float) -> None:
        super().__init__(*weight.shape, dtype=weight.dtype)
        self.weight.data, self.scale = weight, scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return (super().forward(ids).float() * self.scale).to(self.weight.dtype)


def unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """The row order that undoes llama.cpp's q/k permutation: its converter stores row
    (h, i, p) of a head (p: which half, i: the pair) at (h, p', i') with the pair index and
    the half swapped; this returns, for each row of transformers' layout, the file's row."""
    head_dim = rows // heads
    index = np.arange(rows).reshape(heads, head_dim // 2, 2)  # the file's rows: (h, i, p)
    return index.transpose(0, 2, 1).reshape(rows)  # transformers' rows: (h, p, i)


class _Tensors:
    """The file's tensors by name, each checked for a type dresd runs."""

    def __init__(self, reader: GGUFFile, path: Path) -> None:
        self.path = path
        self.mapping = reader.mapping  # the file, memory-mapped
        self.by_name = {tensor.name: tensor for tensor in reader.tensors}
        for tensor in reader.tensors:
            if tensor.tensor_type not in SUPPORTED_TYPES:
                raise GGUFError(
                    f"{path}: tensor {tensor.name!r} is {tensor.tensor_type.name}, a type dresd "
                    f"does not run (it runs {', '.join(sorted(t.name for t in SUPPORTED_TYPES))}"
                    "). Requantize the file with llama.cpp's llama-quantize, e.g. to Q4_K_M.")

    def __contains__(self, name: str) -> bool:
        return name in self.by_name

    def get(self, name: str):
        if name not in self.by_name:
            raise GGUFError(f"{self.path}: tensor {name!r} is missing.")
        return self.by_name[name]

    def floats(self, name: str) -> torch.Tensor:
        """A small float tensor (a norm, a bias) as float32."""
        tensor = self.get(name)
        return self._dense(tensor, np.asarray(tensor.data)).float().reshape(-1).clone()

    def linear(self, name: str, rows: np.ndarray | None = None, bias: str | None = None,
               out_dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
        """`name` as a linear layer; `rows`: which output rows to take, in which order (a
        permutation, or a range of a fused tensor's rows)."""
        tensor = self.get(name)
        k, n = (int(size) for size in tensor.shape[:2])  # GGUF lists the inner size first
        raw = np.asarray(tensor.data).reshape(n, -1)
        if rows is not None:
            raw, n = raw[rows], len(rows)
        bias_values = self.floats(bias) if bias and bias in self else None
        if bias_values is not None and rows is not None:
            bias_values = bias_values[torch.from_numpy(rows)]
        if tensor.tensor_type in quant.LAYOUTS:
            layer = quant.QuantLinear.from_blocks(tensor.tensor_type, raw, n, k, bias_values,
                                                  out_dtype)
            self.release(tensor)
            return layer
        weight = self._dense(tensor, raw).to(torch.bfloat16)
        if out_dtype == torch.float32:  # an LM head in floats: logits in float32
            layer = torch.nn.Linear(k, n, bias=bias_values is not None, dtype=torch.float32)
            layer.weight.data = weight.float()
            if bias_values is not None:
                layer.bias.data = bias_values
            return _FloatHead(layer)
        return InvariantLinear(weight, bias_values)

    def experts(self, blk: str, used: int, norm: bool, arch: Architecture,
                swiglu: tuple[float, float] = (0.0, 0.0)) -> MoEMLP:
        """A layer's mixture of experts (`blk`: "blk.N."): the router `ffn_gate_inp` as float32,
        and each expert's slice of `ffn_gate_exps`, `ffn_up_exps` (one module, gate then up)
        and `ffn_down_exps`, packed as any linear (shapes checked before:
        `check_model_tensors`); where `arch.expert_biases` (gpt-oss), each tensor's `.bias`
        too, and the routing and activation `arch` declares."""
        router = self.get(blk + "ffn_gate_inp.weight")
        hidden, count = (int(size) for size in router.shape[:2])
        weights = self._dense(router, np.asarray(router.data).reshape(count, -1)).float()
        gate_up, down = [], []
        names = [f"{blk}ffn_{name}_exps" for name in ("gate", "up", "down")]
        gates, ups, downs = (self.get(name + ".weight") for name in names)
        biases = ([self.floats(name + ".bias").reshape(count, -1) for name in names]
                  if arch.expert_biases else [None] * 3)
        for expert in range(count):
            parts = [self._expert(tensor, expert, bias)
                     for tensor, bias in ((gates, biases[0]), (ups, biases[1]))]
            if all(isinstance(part, quant.QuantLinear) for part in parts):
                gate_up.append(quant.fuse(parts))
            elif all(isinstance(part, InvariantLinear) for part in parts):  # one bf16 weight
                gate_up.append(InvariantLinear(
                    torch.cat([dense_weight(part) for part in parts]),
                    None if biases[0] is None else torch.cat([biases[0][expert],
                                                              biases[1][expert]])))
            else:  # one part quantized, one in floats: each into its own outputs
                gate_up.append(quant.QuantParts(parts))
            down.append(self._expert(downs, expert, biases[2]))
        for tensor in (gates, ups, downs):
            self.release(tensor)
        router_bias = self.floats(blk + "ffn_gate_inp.bias") if arch.expert_biases else None
        return MoEMLP(weights.contiguous(), gate_up, down, used, norm, router_bias=router_bias,
                      gating=arch.expert_gating, activation=arch.expert_activation,
                      swiglu=swiglu)

    def _expert(self, tensor, expert: int, bias: torch.Tensor | None = None
                ) -> torch.nn.Module:
        """Expert `expert`'s slice of a 3-D expert tensor as a linear layer (`bias`: every
        expert's, [experts, outputs] float32, or None)."""
        k, n, count = (int(size) for size in tensor.shape[:3])
        raw = np.asarray(tensor.data).reshape(count, n, -1)[expert]
        own_bias = None if bias is None else bias[expert].contiguous()
        if tensor.tensor_type in quant.LAYOUTS:
            return quant.QuantLinear.from_blocks(tensor.tensor_type, raw, n, k, own_bias)
        return InvariantLinear(self._dense(tensor, raw).to(torch.bfloat16), own_bias)

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape, outer size first (as torch lists it; GGUF lists it reversed)."""
        return tuple(int(size) for size in reversed(self.get(name).shape))

    def embedding(self, name: str, scale: float = 1.0) -> torch.nn.Module:
        tensor = self.get(name)
        dim, vocab = (int(size) for size in tensor.shape[:2])
        raw = np.asarray(tensor.data).reshape(vocab, -1)
        if tensor.tensor_type in quant.LAYOUTS:
            return QuantEmbedding(tensor.tensor_type, raw, vocab, dim, scale)
        if scale != 1.0:
            return ScaledEmbedding(self._dense(tensor, raw).to(torch.bfloat16), scale)
        embedding = torch.nn.Embedding(vocab, dim, dtype=torch.bfloat16)
        embedding.weight.data = self._dense(tensor, raw).to(torch.bfloat16)
        return embedding

    def release(self, tensor) -> None:
        """Let the kernel drop the file's pages of a tensor now packed: they were read once, and
        would otherwise stay in this process's resident memory beside the packed copy."""
        if self.mapping is not None:
            quant.drop_file_pages(self.mapping, tensor.data_offset,
                                  tensor.data_offset + tensor.n_bytes)

    @staticmethod
    def _dense(tensor, raw: np.ndarray) -> torch.Tensor:
        """A float tensor (F32, F16, BF16): bf16 bits as they are, the others as float32."""
        if tensor.tensor_type == Q.BF16:
            return torch.from_numpy(raw.view(np.int16).copy()).view(torch.bfloat16)
        return torch.from_numpy(raw.view(FLOAT_TYPES[tensor.tensor_type]).astype(np.float32))


class _FloatHead(torch.nn.Module):
    """An LM head on float weights: bf16 rows in, float32 logits out."""

    def __init__(self, layer: torch.nn.Linear) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x.float())


def gemma3_config(reader: GGUFFile, path: Path) -> Gemma3TextConfig:
    """A Gemma-3 file's transformers config, read as llama.cpp reads the file
    (`src/models/gemma3.cpp`, `conversion/gemma.py`), not as transformers' GGUF loader does:
    that one takes neither the attention scale, nor the global layers' rope scaling, nor the
    layer pattern from the file, and a file whose head size is not 256 would run wrong.

    - head size: `attention.key_length` (the converter writes head_dim; 256 where absent).
    - attention scale: llama.cpp's rule, 1/sqrt(head size), and 1/sqrt(hidden / heads) for the
      62-layer 27B model (transformers' `query_pre_attn_scalar`: 256 and 168 in Google's
      configs, the same numbers).
    - layers: windowed where `attention.sliding_window` is set, except every 6th
      (`attention.sliding_window_pattern`: a period, or a flag per layer, where the file has
      one); with no window every layer sees the whole context.
    - rope: the global layers' base `rope.freq_base` with the file's linear scaling (Gemma-3
      4B-27B: factor 8); the windowed layers' base `rope.freq_base_swa`, 10000 where absent,
      never scaled (llama.cpp's defaults).
    """
    arch = "gemma3"
    key = f"{arch}.{{}}".format
    layers = int(metadata_number(reader, path, key("block_count")))
    hidden = int(metadata_number(reader, path, key("embedding_length")))
    heads = int(metadata_number(reader, path, key("attention.head_count")))
    head_dim = int(metadata_number(reader, path, key("attention.key_length"), 256))
    value_dim = int(metadata_number(reader, path, key("attention.value_length"), head_dim))
    if value_dim != head_dim:
        raise GGUFError(f"{path}: key length {head_dim} and value length {value_dim} differ; "
                        "a Gemma-3 head has one size.")
    window = int(metadata_number(reader, path, key("attention.sliding_window"), 0))
    pattern = metadata(reader, key("attention.sliding_window_pattern"))
    if not window:
        windowed = [False] * layers
    elif isinstance(pattern, list):
        if len(pattern) != layers:
            raise GGUFError(f"{path}: the sliding-window pattern has {len(pattern)} flags for "
                            f"{layers} layers.")
        windowed = [bool(flag) for flag in pattern]
    else:
        period = int(pattern or 6)  # llama.cpp's set_swa_pattern: the last of each period full
        windowed = [period == 0 or i % period < period - 1 for i in range(layers)]
    scaling = str(metadata(reader, key("rope.scaling.type")) or "linear")
    factor = float(metadata(reader, key("rope.scaling.factor"))
                   or metadata(reader, key("rope.scale_linear")) or 1.0)
    full_rope: dict = {"rope_type": "default",
                       "rope_theta": float(metadata_number(reader, path, key("rope.freq_base"),
                                                           1e6))}
    if scaling not in ("none", "linear"):
        raise GGUFError(f"{path}: rope scaling {scaling!r} is not one dresd runs for Gemma-3 "
                        "(linear).")
    if scaling == "linear" and factor != 1.0:
        full_rope.update(rope_type="linear", factor=factor)
    local_rope = {"rope_type": "default",
                  "rope_theta": float(metadata_number(reader, path, key("rope.freq_base_swa"),
                                                      10000.0))}
    softcap = metadata(reader, key("final_logit_softcapping"))
    # a chat turn of a Gemma instruct model ends with <end_of_turn>, not with <eos>
    ends = end_of_generation(reader, "<end_of_turn>")
    return Gemma3TextConfig(
        vocab_size=token_rows(reader, path),
        hidden_size=hidden,
        intermediate_size=int(metadata_number(reader, path, key("feed_forward_length"))),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(metadata_number(reader, path, key("attention.head_count_kv"),
                                                heads)),
        head_dim=head_dim,
        query_pre_attn_scalar=hidden // heads if layers == 62 else head_dim,
        sliding_window=window or None,
        layer_types=["sliding_attention" if w else "full_attention" for w in windowed],
        rope_parameters={"full_attention": full_rope, "sliding_attention": local_rope},
        rms_norm_eps=float(metadata_number(reader, path,
                                           key("attention.layer_norm_rms_epsilon"), 1e-6)),
        max_position_embeddings=int(metadata_number(reader, path, key("context_length"), 131072)),
        final_logit_softcapping=float(softcap) if softcap else None,
        hidden_activation="gelu_pytorch_tanh",  # llama.cpp's LLM_FFN_GELU: the tanh form
        tie_word_embeddings="output.weight" not in {t.name for t in reader.tensors},
        bos_token_id=metadata(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=ends,
        pad_token_id=metadata(reader, "tokenizer.ggml.padding_token_id"))


def end_of_generation(reader: GGUFFile, *texts: str) -> int | list[int] | None:
    """The file's end of sequence and the tokens among `texts` it has, as a config's
    `eos_token_id`: llama.cpp also ends generation at such tokens (end-of-generation by their
    text), which end an instruct model's chat turn where its end of sequence does not."""
    eos = metadata(reader, "tokenizer.ggml.eos_token_id")
    ends = [eos] if eos is not None else []
    present = token_indices(reader, texts)
    ends += [present[text] for text in texts if text in present and present[text] not in ends]
    return ends[0] if len(ends) == 1 else (ends or None)


def phi3_config(reader: GGUFFile, path: Path) -> MistralConfig:
    """A Phi-3 or Phi-4 file (`phi3`) as the transformers Mistral config that computes its
    layers once their fused projections are split (`spec.PHI3`), read as llama.cpp's converter
    writes it (`conversion/phi.py`):

    - head size: hidden / heads; the rope turns `rope.dimension_count` of it (Phi-4-mini's 96
      of 128; `phi3.turned_pairs_apart` says how the others are kept), base `rope.freq_base`.
    - LongRoPE (the 128k-context models: `rope_factors_long` / `_short` tensors, the original
      context `rope.scaling.original_context_length`, `rope.scaling.attn_factor`): each
      row's set by its own position (`phi3.RotaryByPosition`).
    - the window: `attention.sliding_window` on every layer (0: none, Phi-4's), as
      transformers' Phi3 applies it. llama.cpp ignores it ("Phi SWA is currently disabled"):
      past the window its outputs are not the model's, and dresd's are.
    - chat turns end with <|end|> (Phi-3) or <|im_end|> (Phi-4), as in llama.cpp.
    """
    key = "phi3.{}".format
    hidden = metadata_size(reader, path, key("embedding_length"))
    heads = metadata_size(reader, path, key("attention.head_count"))
    if hidden % heads:
        raise GGUFError(f"{path}: {heads} attention heads do not divide the hidden size "
                        f"{hidden}.")
    head_dim = hidden // heads
    rope = {"turned": metadata_size(reader, path, key("rope.dimension_count"), head_dim)}
    factors = {tensor.name: tensor for tensor in reader.tensors
               if tensor.name in PHI3_ROPE_FACTORS}
    if factors:
        if len(factors) != len(PHI3_ROPE_FACTORS):
            raise GGUFError(f"{path}: LongRoPE needs both {' and '.join(PHI3_ROPE_FACTORS)}.")
        if any(tensor.tensor_type != Q.F32 for tensor in factors.values()):
            raise GGUFError(f"{path}: LongRoPE's factors are not F32 tensors.")
        long, short = (np.asarray(factors[name].data).view(np.float32).reshape(-1).tolist()
                       for name in PHI3_ROPE_FACTORS)
        rope.update(
            long_factor=long, short_factor=short,
            original_max_position_embeddings=metadata_size(
                reader, path, key("rope.scaling.original_context_length")),
            attention_factor=float(metadata_number(reader, path,
                                                   key("rope.scaling.attn_factor"), 1.0)))
    try:
        phi3.check_rope(head_dim, rope)
    except DresdError as error:
        raise GGUFError(f"{path}: {error}.") from None
    window = int(metadata_number(reader, path, key("attention.sliding_window"), 0))
    if window < 0:
        raise GGUFError(f"{path}: metadata 'phi3.attention.sliding_window' is {window}.")
    names = {tensor.name for tensor in reader.tensors}
    config = MistralConfig(
        vocab_size=token_rows(reader, path),
        hidden_size=hidden,
        intermediate_size=metadata_size(reader, path, key("feed_forward_length")),
        num_hidden_layers=metadata_size(reader, path, key("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=metadata_size(reader, path, key("attention.head_count_kv"), heads),
        head_dim=head_dim,
        sliding_window=window or None,
        rope_parameters={"rope_type": "default", "rope_theta": float(
            metadata_number(reader, path, key("rope.freq_base"), 10000.0))},
        rms_norm_eps=float(metadata_number(reader, path,
                                           key("attention.layer_norm_rms_epsilon"), 1e-5)),
        max_position_embeddings=metadata_size(reader, path, key("context_length"), 4096),
        hidden_act="silu",
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=metadata(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=end_of_generation(reader, "<|end|>", "<|im_end|>"),
        pad_token_id=metadata(reader, "tokenizer.ggml.padding_token_id"))
    config.phi3_rope = rope  # read by `_fill_layers` and `load_gguf` (`phi3.own_rotary`)
    return config


# --- Qwen3.5 (qwen35) ----------------------------------------------------------------------
# A `qwen35` file as transformers' `Qwen3_5ForCausalLM`, run by decoding/recurrent.py with its
# linears on dresd's quantized C kernel.
#
# What the converter (`conversion/qwen.py`: `Qwen3NextModel`, `_LinearAttentionVReorderBase`)
# changes, and how it is read back:
#
# - norms: every RMSNorm but the Gated DeltaNet's output norm (`ssm_norm`) is stored plus one
#   (the model multiplies by 1 + weight, llama.cpp by the stored value): one is taken off again.
# - `ssm_a` = -exp(A_log): A_log = log(-ssm_a), kept in float32 (the rule reads it as float32).
# - `ssm_dt.bias` is dt_bias; `ssm_conv1d` the depthwise convolution's [channels, kernel].
# - Value heads: where there are more value heads than key heads, the converter reorders the
#   value heads from grouped (value head h reads key head h // r) to tiled (key head h % nk), in
#   every tensor on the value side (`attn_qkv`'s value rows, `attn_gate`, `ssm_beta`,
#   `ssm_alpha`, `ssm_a`, `ssm_dt`, the convolution's value channels and `ssm_out`'s columns).
#   Reordering a quantized tensor's columns back would split its blocks; instead the layers keep
#   the file's tiled order and read their query and key heads tiled too
#   (`TILED_VALUE_HEADS`): the same sums, in llama.cpp's head order.
# - `attn_q` holds each head's query and output gate side by side, as transformers' q_proj.
# - NextN/MTP layers (`nextn_predict_layers`) are counted in `block_count`, after the model's
#   own: a file's one MTP block (`blk.{n}.nextn.*` and a full-attention layer's tensors at
#   index n) becomes `models/mtp.MultiTokenPredictor` (`mtp_block`), a draft source.
# - `qwen35moe` (`Qwen3_5MoeTextModel`, whose experts `Qwen2MoeModel` writes): the router
#   `ffn_gate_inp` and the shared expert's gate `ffn_gate_inp_shexp` in F32, the routed experts
#   as 3-D `ffn_{gate,up,down}_exps`, the shared expert as `ffn_{gate,up,down}_shexp`; the
#   expert counts and sizes in `expert_*` keys, no `feed_forward_length`. The router's top k
#   weights are always renormalised (transformers' `Qwen3_5MoeTopKRouter`).

QWEN35_MOE = "qwen35moe"


def qwen35_config(reader: GGUFFile, path: Path) -> Qwen3_5TextConfig | Qwen3_5MoeTextConfig:
    """The file's transformers config, read as llama.cpp reads a qwen35 file
    (`llama_model::load_hparams`): the layer pattern from `attention.recurrent_layers` (else
    every `full_attention_interval`-th layer full), the rotary dimensions from
    `rope.dimension_count` (a quarter of a head in Qwen3.5), the Gated DeltaNet's sizes from the
    `ssm.*` keys (state size: the key head size; group count: key heads; time step rank: value
    heads; inner size: value heads x value head size); a `qwen35moe` file's experts from its
    `expert_*` keys."""
    architecture = metadata(reader, "general.architecture")
    key = f"{architecture}.{{}}".format
    blocks = metadata_size(reader, path, key("block_count"))
    mtp_layers = int(metadata_number(reader, path, key("nextn_predict_layers"), 0))
    if mtp_layers > 1:
        raise GGUFError(f"{path}: {mtp_layers} MTP blocks; dresd reads one (as llama.cpp "
                        "does).")
    layers = blocks - mtp_layers
    heads = metadata_size(reader, path, key("attention.head_count"))
    head_dim = metadata_size(reader, path, key("attention.key_length"))
    value_heads = metadata_size(reader, path, key("ssm.time_step_rank"))
    inner = metadata_size(reader, path, key("ssm.inner_size"))
    if inner % value_heads:
        raise GGUFError(f"{path}: ssm.inner_size {inner} is not a whole number of "
                        f"{value_heads} value heads.")
    key_heads = metadata_size(reader, path, key("ssm.group_count"))
    if value_heads % key_heads:
        raise GGUFError(f"{path}: {key_heads} key heads do not divide {value_heads} value heads.")
    recurrent = metadata(reader, key("attention.recurrent_layers"))
    if isinstance(recurrent, list):
        if len(recurrent) < layers:
            raise GGUFError(f"{path}: attention.recurrent_layers has {len(recurrent)} flags "
                            f"for {layers} layers.")
        linear = [bool(flag) for flag in recurrent[:layers]]
    else:
        interval = metadata_size(reader, path, key("full_attention_interval"), 4)
        linear = [(i + 1) % interval != 0 for i in range(layers)]
    rotary = metadata_size(reader, path, key("rope.dimension_count"), head_dim // 4)
    sections = metadata(reader, key("rope.dimension_sections")) or [11, 11, 10]
    eos = metadata(reader, "tokenizer.ggml.eos_token_id")
    if architecture == QWEN35_MOE:
        config_class, mlp = Qwen3_5MoeTextConfig, dict(
            num_experts=metadata_size(reader, path, key("expert_count")),
            num_experts_per_tok=metadata_size(reader, path, key("expert_used_count")),
            moe_intermediate_size=metadata_size(reader, path, key("expert_feed_forward_length")),
            shared_expert_intermediate_size=metadata_size(reader, path,
                                                  key("expert_shared_feed_forward_length")))
        if mlp["num_experts_per_tok"] > mlp["num_experts"]:
            raise GGUFError(f"{path}: {mlp['num_experts_per_tok']} experts used per token of "
                            f"{mlp['num_experts']}.")
    else:
        config_class = Qwen3_5TextConfig
        mlp = dict(intermediate_size=metadata_size(reader, path, key("feed_forward_length")))
    config = config_class(
        vocab_size=token_rows(reader, path),
        hidden_size=metadata_size(reader, path, key("embedding_length")),
        **mlp,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=metadata_size(reader, path, key("attention.head_count_kv"), heads),
        head_dim=head_dim,
        linear_conv_kernel_dim=metadata_size(reader, path, key("ssm.conv_kernel")),
        linear_key_head_dim=metadata_size(reader, path, key("ssm.state_size")),
        linear_num_key_heads=key_heads,
        linear_num_value_heads=value_heads,
        linear_value_head_dim=inner // value_heads,
        layer_types=["linear_attention" if flag else "full_attention" for flag in linear],
        rope_parameters={"rope_type": "default",
                         "rope_theta": float(metadata_number(reader, path,
                                                             key("rope.freq_base"), 1e7)),
                         "partial_rotary_factor": rotary / head_dim,
                         "mrope_section": [int(s) for s in sections[:3]]},
        rms_norm_eps=float(metadata_number(reader, path,
                                           key("attention.layer_norm_rms_epsilon"), 1e-6)),
        max_position_embeddings=int(metadata_number(reader, path, key("context_length"), 32768)),
        tie_word_embeddings="output.weight" not in {t.name for t in reader.tensors},
        bos_token_id=metadata(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=eos,
        pad_token_id=metadata(reader, "tokenizer.ggml.padding_token_id"))
    # as Qwen3.5's own config.json names it (transformers' config has no such field)
    config.mtp_num_hidden_layers = mtp_layers
    return config


def expected_qwen35_tensors(config: Qwen3_5TextConfig | Qwen3_5MoeTextConfig,
                            present: set[str]) -> dict[str, tuple[tuple[int, ...], set]]:
    """Every tensor a qwen35 (or qwen35moe) file's layers read, and its MTP block's where
    it has one (its own embedding, head and head norm where `present` has them): shape (outer
    size first) and allowed types."""
    hidden, head_dim = config.hidden_size, config.head_dim
    key_dim = config.linear_num_key_heads * config.linear_key_head_dim
    value_dim = config.linear_num_value_heads * config.linear_value_head_dim
    value_heads, kernel = config.linear_num_value_heads, config.linear_conv_kernel_dim
    q_rows, kv_rows = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    linear = {"attn_qkv.weight": (2 * key_dim + value_dim, hidden),
              "attn_gate.weight": (value_dim, hidden), "ssm_beta.weight": (value_heads, hidden),
              "ssm_alpha.weight": (value_heads, hidden), "ssm_out.weight": (hidden, value_dim)}
    small = {"ssm_a": (value_heads,), "ssm_dt.bias": (value_heads,),
             "ssm_conv1d.weight": (2 * key_dim + value_dim, kernel),
             "ssm_norm.weight": (config.linear_value_head_dim,)}
    full = {"attn_q.weight": (2 * q_rows, hidden), "attn_k.weight": (kv_rows, hidden),
            "attn_v.weight": (kv_rows, hidden), "attn_output.weight": (hidden, q_rows)}
    full_small = {"attn_q_norm.weight": (head_dim,), "attn_k_norm.weight": (head_dim,)}
    if isinstance(config, Qwen3_5MoeTextConfig):
        experts, ffn = config.num_experts, config.moe_intermediate_size
        shared = config.shared_expert_intermediate_size
        mlp = {"ffn_gate_exps.weight": (experts, ffn, hidden),
               "ffn_up_exps.weight": (experts, ffn, hidden),
               "ffn_down_exps.weight": (experts, hidden, ffn),
               "ffn_gate_shexp.weight": (shared, hidden), "ffn_up_shexp.weight": (shared, hidden),
               "ffn_down_shexp.weight": (hidden, shared)}
        mlp_floats = {"ffn_gate_inp.weight": (experts, hidden),
                      "ffn_gate_inp_shexp.weight": (1, hidden)}
    else:
        inter = config.intermediate_size
        mlp = {"ffn_gate.weight": (inter, hidden), "ffn_up.weight": (inter, hidden),
               "ffn_down.weight": (hidden, inter)}
        mlp_floats = {}
    norms = {"attn_norm.weight": (hidden,), "post_attention_norm.weight": (hidden,),
             **mlp_floats}
    expected = {"output_norm.weight": ((hidden,), NORM_TYPES)}
    layers = len(config.layer_types)
    mtp = ["full_attention"] * getattr(config, "mtp_num_hidden_layers", 0)
    for i, kind in enumerate([*config.layer_types, *mtp]):
        blk = f"blk.{i}."
        weights, floats = (linear, small) if kind == "linear_attention" else (full, full_small)
        expected.update({blk + n: (s, SUPPORTED_TYPES) for n, s in (weights | mlp).items()})
        expected.update({blk + n: (s, NORM_TYPES) for n, s in (floats | norms).items()})
        if i < layers:
            continue
        # the MTP block: [embedding, state] -> hidden, its norms; its own embedding, head and
        # head norm are optional (the model's are used where it has none)
        vocab = config.vocab_size
        block = {"eh_proj": ((hidden, 2 * hidden), SUPPORTED_TYPES),
                 "enorm": ((hidden,), NORM_TYPES), "hnorm": ((hidden,), NORM_TYPES)}
        optional = {"shared_head_norm": ((hidden,), NORM_TYPES),
                    "embed_tokens": ((vocab, hidden), SUPPORTED_TYPES),
                    "shared_head_head": ((vocab, hidden), SUPPORTED_TYPES)}
        for name, wanted in (block | optional).items():
            tensor = f"{blk}nextn.{name}.weight"
            if name in block or tensor in present:
                expected[tensor] = wanted
    return expected


def fill_qwen35(model: PreTrainedModel, tensors: _Tensors) -> None:
    """A `Qwen3_5ForCausalLM` (built on the meta device) takes the file's tensors (module doc)."""
    config, decoder = model.config, model.model
    decoder.embed_tokens = tensors.embedding("token_embd.weight")
    for i, layer in enumerate(decoder.layers):
        _fill_qwen35_layer(layer, tensors, f"blk.{i}.", config, config.layer_types[i])
    decoder.norm.weight = _norm(tensors, "output_norm.weight", config.hidden_size, -1.0)


def _fill_qwen35_layer(layer: torch.nn.Module, tensors: _Tensors, blk: str, config,
                       kind: str) -> None:
    """One Qwen3.5 layer (`kind`: full or linear attention) from the file's `blk` tensors."""
    hidden, head_dim = config.hidden_size, config.head_dim
    layer.input_layernorm.weight = _norm(tensors, blk + "attn_norm.weight", hidden, -1.0)
    layer.post_attention_layernorm.weight = _norm(
        tensors, blk + "post_attention_norm.weight", hidden, -1.0)
    if isinstance(config, Qwen3_5MoeTextConfig):
        layer.mlp = shared_expert_moe(layer.mlp.shared_expert, tensors, blk,
                                      config.num_experts_per_tok)
    else:
        fill_gated_mlp(layer.mlp, tensors, blk)
    if kind == "full_attention":
        attn = layer.self_attn
        attn.q_norm.weight = _norm(tensors, blk + "attn_q_norm.weight", head_dim, -1.0)
        attn.k_norm.weight = _norm(tensors, blk + "attn_k_norm.weight", head_dim, -1.0)
        for part, name in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"),
                           ("o_proj", "attn_output")):
            setattr(attn, part, tensors.linear(f"{blk}{name}.weight"))
        return
    mixer = layer.linear_attn
    for part, name in (("in_proj_qkv", "attn_qkv"), ("in_proj_z", "attn_gate"),
                       ("in_proj_b", "ssm_beta"), ("in_proj_a", "ssm_alpha"),
                       ("out_proj", "ssm_out")):
        setattr(mixer, part, tensors.linear(f"{blk}{name}.weight"))
    negative_a = tensors.floats(blk + "ssm_a")
    if not bool((negative_a < 0).all()):
        raise GGUFError(f"{tensors.path}: {blk}ssm_a holds values >= 0; it is -exp(A_log).")
    mixer.A_log = _float32(torch.log(-negative_a))
    mixer.dt_bias = _float32(tensors.floats(blk + "ssm_dt.bias"))
    mixer.conv1d.weight = _float32(tensors.floats(blk + "ssm_conv1d.weight").reshape(
        mixer.conv_dim, 1, mixer.conv_kernel_size))
    mixer.norm.weight = _norm(tensors, blk + "ssm_norm.weight", mixer.head_v_dim)
    setattr(mixer, TILED_VALUE_HEADS, mixer.num_v_heads != mixer.num_k_heads)


def mtp_block(model: PreTrainedModel, tensors: _Tensors) -> MultiTokenPredictor:
    """The file's MTP block (`models/mtp.py`; the module comment above says how it is stored),
    on a model whose own layers, head and rotary embedding are filled. Its layer is one of the
    model's full-attention layer class, filled as those are; its embedding, head and head norm
    are the model's where the file has none of its own (llama.cpp's rule)."""
    config, decoder = model.config, model.model
    hidden, blk = config.hidden_size, f"blk.{len(config.layer_types)}."
    full = config.layer_types.index("full_attention")  # its config index: attention's kind
    with torch.device("meta"):
        layer = type(decoder.layers[full])(config, full)
    _fill_qwen35_layer(layer, tensors, blk, config, "full_attention")

    def norm(name: str) -> torch.nn.Module:
        module = type(decoder.norm)(hidden, eps=config.rms_norm_eps)
        module.weight = _norm(tensors, f"{blk}nextn.{name}.weight", hidden, -1.0)
        return module

    def own(name: str) -> bool:
        return f"{blk}nextn.{name}.weight" in tensors

    embed = (tensors.embedding(f"{blk}nextn.embed_tokens.weight") if own("embed_tokens")
             else decoder.embed_tokens)
    head = (tensors.linear(f"{blk}nextn.shared_head_head.weight", out_dtype=torch.float32)
            if own("shared_head_head") else model.lm_head)
    head_norm = norm("shared_head_norm") if own("shared_head_norm") else decoder.norm
    return MultiTokenPredictor(embed, norm("enorm"), norm("hnorm"),
                               tensors.linear(f"{blk}nextn.eh_proj.weight"), layer, head_norm,
                               head, decoder.rotary_emb)


class SharedExpertMoE(torch.nn.Module):
    """Qwen3.5-MoE's sparse MLP on a file's weights, as transformers' `Qwen3_5MoeSparseMoeBlock`
    computes it: the routed experts (`experts`: the C kernel's softmax over the router, the top
    k renormalised, each expert on its quantized blocks) plus the shared expert scaled by
    sigmoid(x . w_gate), every tensor between two steps bf16 as in the model. It has
    `experts`, so decoding/recurrent.py runs it a row at a time: each row's bits its own."""

    def __init__(self, experts: MoEMLP, shared_expert: torch.nn.Module,
                 gate: torch.Tensor) -> None:
        super().__init__()
        self.experts = experts
        self.shared_expert = shared_expert
        self.register_buffer("gate", gate.float().contiguous(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.sigmoid((x.float() * self.gate).sum(-1, keepdim=True)).to(x.dtype)
        return self.experts(x) + scale * self.shared_expert(x)


def fill_gated_mlp(mlp: torch.nn.Module, tensors: _Tensors, blk: str, suffix: str = "") -> None:
    """A gated MLP's gate, up and down projections from the file's `ffn_gate{suffix}`,
    `ffn_up{suffix}`, `ffn_down{suffix}` (a shared expert's: suffix "_shexp")."""
    for part, name in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"),
                       ("down_proj", "ffn_down")):
        setattr(mlp, part, tensors.linear(f"{blk}{name}{suffix}.weight"))


def shared_expert_moe(shared_expert: torch.nn.Module, tensors: _Tensors, blk: str,
                      used: int) -> SharedExpertMoE:
    """A qwen35moe layer's MLP: its routed experts, and the model's own shared expert module
    (`shared_expert`, built on the meta device) given the file's projections."""
    fill_gated_mlp(shared_expert, tensors, blk, "_shexp")
    gate = tensors.floats(blk + "ffn_gate_inp_shexp.weight").reshape(-1)
    return SharedExpertMoE(tensors.experts(blk, used, True, spec.QWEN35_MOE), shared_expert,
                           gate)


def _float32(values: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(values.float().contiguous(), requires_grad=False)


def gpt_oss_config(reader: GGUFFile, path: Path) -> GptOssConfig:
    """A gpt-oss file's transformers config, read as llama.cpp reads the file
    (`conversion/gpt_oss.py`, `src/models/openai-moe-iswa.cpp`): its sizes; every expert of
    `expert_feed_forward_length`, `expert_used_count` of `expert_count` per token; a window of
    `attention.sliding_window` on the even layers (llama.cpp's pattern of 2, transformers'
    default `layer_types`); the clamped SwiGLU's alpha 1.702 and limit 7 (llama.cpp's and
    transformers' constants: the file holds none); generation ending at the harmony format's
    `<|return|>` and `<|call|>` as well as the end of sequence, not at `<|end|>` (which ends a
    message, not the answer: llama.cpp's end-of-generation tokens for this vocabulary). Its
    YaRN as `file_rope_parameters` reads it, with the correction range not truncated:
    gpt-oss's own rope (transformers' and OpenAI's; llama.cpp rounds the range to whole
    dimensions, a small difference in every frequency between the two)."""
    key = "gpt-oss.{}".format
    hidden = metadata_size(reader, path, key("embedding_length"))
    heads = metadata_size(reader, path, key("attention.head_count"))
    vocab = next(int(t.shape[1]) for t in reader.tensors if t.name == "token_embd.weight")
    rope = file_rope_parameters(reader, path, spec.GPT_OSS)
    if rope["rope_type"] == "yarn":
        rope["truncate"] = False
    window = metadata(reader, key("attention.sliding_window"))
    return GptOssConfig(
        vocab_size=vocab, hidden_size=hidden,
        num_hidden_layers=metadata_size(reader, path, key("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=metadata_size(reader, path, key("attention.head_count_kv"), heads),
        head_dim=metadata_size(reader, path, key("attention.key_length"), hidden // heads),
        intermediate_size=metadata_size(reader, path, key("expert_feed_forward_length")),
        num_local_experts=metadata_size(reader, path, key("expert_count")),
        num_experts_per_tok=metadata_size(reader, path, key("expert_used_count")),
        sliding_window=int(window) if window else None,
        layer_types=None if window else ["full_attention"] * metadata_size(
            reader, path, key("block_count")),
        rms_norm_eps=float(metadata_number(reader, path, key("attention.layer_norm_rms_epsilon"),
                                           1e-5)),
        max_position_embeddings=int(metadata_number(reader, path, key("context_length"), 4096)),
        rope_parameters=rope, attention_bias=True,
        tie_word_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
        eos_token_id=end_of_generation(reader, "<|return|>", "<|call|>"))


# Architectures whose transformers config dresd reads from the metadata itself (cheap, so never
# taken from the cache), not through transformers' GGUF mapping
OWN_CONFIGS = {"gemma3": gemma3_config, "phi3": phi3_config, "qwen35": qwen35_config,
               QWEN35_MOE: qwen35_config, "gpt-oss": gpt_oss_config}


# --- rotary embedding scaling, as llama.cpp reads it ---------------------------------------
# llama.cpp's converter writes rope scaling two ways: `{arch}.rope.scaling.*` metadata (linear,
# YaRN), and for Llama 3.1-3.3's "llama3" scaling a tensor, `rope_freqs.weight`: one factor per
# rotated pair of dimensions, by which llama.cpp divides that pair's frequency
# (ggml_rope_ext's freq_factors). transformers' GGUF loader reads neither for these
# architectures, so without what follows a Llama 3.1 file ran as if unscaled
# (`gguf_file.ROPE_FREQS` names the tensor).


def _yarn_mscale(factor: float, mscale: float) -> float:
    """llama.cpp's and transformers' YaRN magnitude: 1 + 0.1 mscale ln(factor) (1 for factor
    <= 1)."""
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


def file_rope_parameters(reader: GGUFFile, path: Path, arch: Architecture) -> dict:
    """A Llama-family file's rotary embedding as transformers' `config.rope_parameters`, read
    as llama.cpp reads it (`llama_model::load_hparams`, `llama_context`'s YaRN set-up):

    - base: `rope.freq_base`, 10000 where absent.
    - scaling: `rope.scaling.type` (llama.cpp's default: linear) with `rope.scaling.factor`
      (or the older `rope.scale_linear`); none, or a factor of 1: no scaling.
    - YaRN: the original context `rope.scaling.original_context_length` (default: the
      file's context length), `yarn_beta_fast`/`yarn_beta_slow` (32 and 1), and the magnitude
      llama.cpp gives cos and sin: mscale(factor, 1) / mscale(factor, yarn_log_multiplier)
      times `rope.scaling.attn_factor`, as transformers' `attention_factor`.
    Anything else (LongRoPE, a YaRN extrapolation factor other than 1) is one error.
    `rope_freqs.weight` is not here: `load_gguf` divides the frequencies by it."""
    key = f"{arch.gguf}.rope.{{}}".format
    rope: dict = {"rope_type": "default",
                  "rope_theta": float(metadata_number(reader, path, key("freq_base"), 10000.0))}
    kind = str(metadata(reader, key("scaling.type")) or "linear")
    factor = float(metadata(reader, key("scaling.factor"))
                   or metadata(reader, key("scale_linear")) or 1.0)
    if kind == "none" or factor == 1.0:
        return rope
    if kind == "linear":
        return {**rope, "rope_type": "linear", "factor": factor}
    if kind != "yarn":
        raise GGUFError(f"{path}: rope scaling {kind!r} is not one dresd runs (linear, yarn, "
                        "and Llama 3's rope_freqs).")
    if float(metadata(reader, key("scaling.yarn_ext_factor")) or 1.0) != 1.0:
        raise GGUFError(f"{path}: a YaRN extrapolation factor other than 1 is not one dresd "
                        "runs.")
    log_multiplier = float(metadata(reader, key("scaling.yarn_log_multiplier")) or 0.0)
    original = metadata(reader, key("scaling.original_context_length")) or metadata_number(
        reader, path, f"{arch.gguf}.context_length")
    return {**rope, "rope_type": "yarn", "factor": factor,
            "original_max_position_embeddings": int(original),
            "beta_fast": float(metadata(reader, key("scaling.yarn_beta_fast")) or 32.0),
            "beta_slow": float(metadata(reader, key("scaling.yarn_beta_slow")) or 1.0),
            "attention_factor": _yarn_mscale(factor, 1.0)
            / _yarn_mscale(factor, log_multiplier)
            * float(metadata(reader, key("scaling.attn_factor")) or 1.0)}


def divide_rope_frequencies(rotary: torch.nn.Module, factors: torch.Tensor) -> None:
    """A file's `rope_freqs` applied to transformers' rotary embedding: each pair's frequency
    divided by its factor, as llama.cpp divides it (cos and sin, and so the C decoder's
    values, come from this module: `forward.LlamaForward._inputs`)."""
    if factors.shape != rotary.inv_freq.shape or not bool((factors > 0).all()):
        raise GGUFError(f"rope_freqs: {factors.numel()} factors for "
                        f"{rotary.inv_freq.numel()} frequencies, or factors that are not "
                        "positive.")
    rotary.inv_freq = rotary.inv_freq / factors
    rotary.original_inv_freq = rotary.inv_freq.clone()


@dataclass(frozen=True)
class Sizes:
    """The sizes every tensor of a model must agree with (its metadata's, or its config's)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    experts: int = 0  # a mixture of experts: experts per layer, used per token, and each
    experts_used: int = 0  # expert's hidden size (0: a dense MLP)
    expert_ffn: int = 0

    @classmethod
    def of_config(cls, config) -> Sizes:
        """(gpt-oss's config names its experts `num_local_experts`, their size
        `intermediate_size`.)"""
        experts = int(getattr(config, "num_experts", 0)
                      or getattr(config, "num_local_experts", 0) or 0)
        expert_ffn = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        return cls(config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
                   config.num_key_value_heads,
                   getattr(config, "head_dim", None)
                   or config.hidden_size // config.num_attention_heads,
                   getattr(config, "intermediate_size", None) or 0, experts,
                   int(config.num_experts_per_tok) if experts else 0,
                   int(expert_ffn) if experts else 0)


def model_sizes(reader: GGUFFile, path: Path, arch: Architecture) -> Sizes:
    """The sizes the file's metadata states, read as llama.cpp reads them (head size: the key
    length, else hidden / heads), and checked to fit together."""
    if arch.gguf in OWN_CONFIGS:
        return Sizes.of_config(OWN_CONFIGS[arch.gguf](reader, path))
    key = f"{arch.gguf}.{{}}".format
    hidden, heads = metadata_size(reader, path, key("embedding_length")), \
        metadata_size(reader, path, key("attention.head_count"))
    if hidden % heads and metadata(reader, key("attention.key_length")) is None:
        raise GGUFError(f"{path}: {heads} attention heads do not divide the hidden size "
                        f"{hidden}, and the file states no head size.")
    sizes = Sizes(metadata_size(reader, path, key("block_count")), hidden, heads,
                  metadata_size(reader, path, key("attention.head_count_kv"), heads),
                  metadata_size(reader, path, key("attention.key_length"), hidden // heads),
                  metadata_size(reader, path, key("feed_forward_length")))
    if sizes.heads % sizes.kv_heads:
        raise GGUFError(f"{path}: {sizes.kv_heads} key-value heads do not divide the "
                        f"{sizes.heads} attention heads.")
    if arch.moe:
        experts = metadata_size(reader, path, key("expert_count"))
        used = metadata_size(reader, path, key("expert_used_count"))
        if used > experts:
            raise GGUFError(f"{path}: {used} experts used per token of {experts}.")
        # llama.cpp's default where the file has no expert size: feed_forward_length / used
        ffn = metadata_size(reader, path, key("expert_feed_forward_length"),
                    max(sizes.intermediate // used, 1))
        moe_routing(reader, path, arch)
        sizes = Sizes(*astuple(sizes)[:6], experts, used, ffn)
    return sizes


def moe_routing(reader: GGUFFile, path: Path, arch: Architecture) -> bool:
    """Whether a MoE file's chosen experts' weights are renormalised to sum to 1
    (`expert_weights_norm`; llama.cpp's qwen3moe always does, transformers' GGUF reading
    defaults to it); one error for routing dresd does not run: gating other than softmax,
    shared experts, a scale on the weights."""
    key = f"{arch.gguf}.{{}}".format
    gating = metadata(reader, key("expert_gating_func"))
    if gating not in (None, int(gguf.ExpertGatingFuncType.SOFTMAX)):
        raise GGUFError(f"{path}: expert gating function {gating}; dresd runs softmax gating "
                        "only.")
    if metadata(reader, key("expert_shared_count")) or \
            metadata(reader, key("expert_shared_feed_forward_length")):
        raise GGUFError(f"{path}: shared experts are not something dresd runs.")
    scale = metadata(reader, key("expert_weights_scale"))
    if scale not in (None, 0.0, 1.0):
        raise GGUFError(f"{path}: expert weights scaled by {scale}; dresd runs unscaled weights "
                        "only.")
    norm = metadata(reader, key("expert_weights_norm"))
    return True if norm is None else bool(norm)


NORM_TYPES = {Q.F32, Q.F16, Q.BF16}  # norms and biases are read as floats


def expected_tensors(sizes: Sizes, arch: Architecture, present: set[str]
                     ) -> dict[str, tuple[tuple[int, ...], set]]:
    """Every tensor the architecture reads (the optional ones where the file has them): its
    shape, outer size first (as torch lists it), and the types it may have. The token
    embedding's rows (the vocabulary) are any number: `check_model_tensors` checks them."""
    hidden, inter, head_dim = sizes.hidden, sizes.intermediate, sizes.head_dim
    q_rows, kv_rows = sizes.heads * head_dim, sizes.kv_heads * head_dim
    norms = [name for name, _ in arch.layer_norms]
    expected: dict[str, tuple[tuple[int, ...], set]] = {"output_norm.weight": ((hidden,),
                                                                               NORM_TYPES)}
    if arch.moe:  # the router, then every expert in one 3-D tensor
        experts, ffn = sizes.experts, sizes.expert_ffn
        mlp = (("ffn_gate_inp", (experts, hidden), NORM_TYPES),
               ("ffn_gate_exps", (experts, ffn, hidden), SUPPORTED_TYPES),
               ("ffn_up_exps", (experts, ffn, hidden), SUPPORTED_TYPES),
               ("ffn_down_exps", (experts, hidden, ffn), SUPPORTED_TYPES))
    elif arch.fused_projections:  # Phi-3: gate then up in one tensor
        mlp = (("ffn_up", (2 * inter, hidden), SUPPORTED_TYPES),
               ("ffn_down", (hidden, inter), SUPPORTED_TYPES))
    else:
        mlp = tuple((name, shape, SUPPORTED_TYPES) for name, shape in (
            ("ffn_gate", (inter, hidden)), ("ffn_up", (inter, hidden)),
            ("ffn_down", (hidden, inter))))
    attention = ((("attn_qkv", (q_rows + 2 * kv_rows, hidden)),) if arch.fused_projections
                 else (("attn_q", (q_rows, hidden)), ("attn_k", (kv_rows, hidden)),
                       ("attn_v", (kv_rows, hidden))))
    for i in range(sizes.layers):
        blk = f"blk.{i}."
        expected.update({blk + name + ".weight": ((hidden,), NORM_TYPES) for name in norms})
        expected.update({blk + name + ".weight": (shape, SUPPORTED_TYPES) for name, shape in (
            *attention, ("attn_output", (hidden, q_rows)))})
        expected.update({blk + name + ".weight": (shape, types) for name, shape, types in mlp})
        if arch.expert_biases:  # gpt-oss: the router's, each expert's gate, up and down
            expected.update({blk + name + ".bias": (shape[:-1], NORM_TYPES)
                             for name, shape, _ in mlp})
        if arch.attention_sinks:  # and q, k, v and the output's biases (taken below)
            expected[blk + "attn_sinks.weight"] = ((sizes.heads,), NORM_TYPES)
            expected[blk + "attn_output.bias"] = ((hidden,), NORM_TYPES)
        if arch.head_norms:
            expected.update({blk + f"attn_{part}_norm.weight": ((head_dim,), NORM_TYPES)
                             for part in "qk"})
        for part, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
            if arch.attention_biases and (f"{blk}attn_{part}.bias" in present
                                          or arch.attention_sinks):
                expected[f"{blk}attn_{part}.bias"] = ((rows,), NORM_TYPES)
    if ROPE_FREQS in present:  # a factor per rotated pair of dimensions
        expected[ROPE_FREQS] = ((head_dim // 2,), NORM_TYPES)
    return expected


def refusal(reader: GGUFFile, path: Path) -> str | None:
    """Why loading the file would stop at its metadata or tensors (`check_model_tensors`'s
    error, without the path), or None: what `dresd inspect` says of a file before it is run."""
    try:
        check_model_tensors(reader, path, spec.of_gguf(metadata(reader, "general.architecture")))
    except (GGUFError, spec.ArchitectureError) as err:
        return str(err).removeprefix(f"{path}: ").removeprefix(f"{path} ")
    return None


def check_model_tensors(reader: GGUFFile, path: Path, arch: Architecture) -> Sizes:
    """The validation pass before anything is built from the file, and before any C call: every
    tensor the architecture reads is present, of a type it may have, of the shape its metadata's
    sizes say. One `GGUFError` naming the tensor, the expected and the found shape otherwise.
    Returns the sizes (`load_gguf` checks transformers' config against them)."""
    sizes = model_sizes(reader, path, arch)
    by_name = {tensor.name: tensor for tensor in reader.tensors}

    def shape(name: str) -> tuple[int, ...]:
        return tuple(int(size) for size in reversed(by_name[name].shape))

    def check(name: str, wanted: tuple[int, ...], types: set) -> None:
        if name not in by_name:
            raise GGUFError(f"{path}: tensor {name!r} is missing.")
        qtype = by_name[name].tensor_type
        if qtype not in types:
            raise GGUFError(f"{path}: tensor {name!r} is {qtype.name}, which dresd does not "
                            f"take for it (it takes {', '.join(sorted(t.name for t in types))})."
                            + (" Requantize the file with llama.cpp's llama-quantize, e.g. to "
                               "Q4_K_M." if qtype not in SUPPORTED_TYPES else ""))
        if shape(name) != wanted:
            raise GGUFError(f"{path}: tensor {name!r} has shape {shape(name)} where the file's "
                            f"metadata needs {wanted} (outer size first).")

    present = set(by_name)
    expected = (expected_qwen35_tensors(qwen35_config(reader, path), present)
                if arch.recurrent_layers else expected_tensors(sizes, arch, present))
    for name, (wanted, types) in expected.items():
        check(name, wanted, types)
    embedding = "token_embd.weight"
    vocab = shape(embedding)[0] if embedding in by_name else 0  # any number of rows
    check(embedding, (vocab, sizes.hidden), SUPPORTED_TYPES)
    tokens = reader.fields.get("tokenizer.ggml.tokens")  # (its length: the strings unread)
    if tokens is not None and len(tokens.value) > vocab:
        raise GGUFError(f"{path}: tensor 'token_embd.weight' has {vocab} rows for a tokenizer "
                        f"of {len(tokens.value)} tokens.")
    if "output.weight" in by_name:
        check("output.weight", (vocab, sizes.hidden), SUPPORTED_TYPES)
    return sizes


def config_and_tokenizer(path: Path, reader: GGUFFile
                         ) -> tuple[AutoConfig, PreTrainedTokenizerBase]:
    """The file's transformers config and tokenizer. transformers reads both from the file's
    metadata, parsing its vocabulary each time (~8 s for a 49k vocabulary); so the first load
    saves them in the cache, keyed by the metadata's bytes (everything before the tensors'
    data: the same for every copy of the file), and every load reads that folder (the
    tokenizer: `cached_tokenizer`). A Gemma-3
    file's config is dresd's reading (`gemma3_config`, cheap, so never taken from the cache);
    its tokenizer is transformers' (a sentencepiece vocabulary: its Gemma builder, which
    rebuilds the merges from the tokens' order; a byte-level one: as for Llama files)."""
    architecture = metadata(reader, "general.architecture")
    own = OWN_CONFIGS[architecture](reader, path) if architecture in OWN_CONFIGS else None
    with open(path, "rb") as file:
        key = hashlib.sha256(file.read(reader.data_offset))
    folder = cache_dir() / "gguf" / key.hexdigest()[:24]
    if not (folder / "config.json").exists():
        config = own or AutoConfig.for_model(
            **load_gguf_checkpoint(str(path), return_tensors=False)["config"])
        try:
            tokenizer = file_tokenizer(path, architecture)
        except Exception as err:
            raise GGUFError(f"{path}: its tokenizer could not be read ({err}).") from err
        folder.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder.parent) as staging:
            config.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
            try:
                Path(staging).rename(folder)  # atomic: the cache holds a whole folder or none
            except OSError:
                pass  # another process saved it first
        del tokenizer
    return (own or AutoConfig.from_pretrained(folder),
            with_chat_template(cached_tokenizer(folder), reader))


def file_tokenizer(path: Path, architecture: str) -> PreTrainedTokenizerBase:
    """transformers' tokenizer of the file's vocabulary. A gpt-oss file's by its fast tokenizer
    class directly: AutoTokenizer reads the file's config first, and transformers (5.25) reads
    a gpt-oss file's rope scaling from the wrong part of each field (a TypeError)."""
    if architecture == "gpt-oss":
        return PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def cached_tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved in `folder`, compact (`compact_tokenizer`: the same ids in a few MB)
    where it has a compact form, written there on its first load. Always as the folder loads
    it, the first load too: a tokenizer read from the file can differ from its saved copy
    (a Qwen2 file's loses Qwen2Tokenizer's NFC normalizer, added tokens' hidden state), and
    every load of a file must give the same ids and fingerprint."""
    tokenizer = compact_tokenizer.load_compact(folder)
    if tokenizer is None and not compact_tokenizer.has_no_compact_form(folder):
        try:
            compact_tokenizer.save_compact(folder)
        except OSError:  # a cache this process may not write: the full tokenizer, as before
            pass
        give_back_free_heap()  # the full tokenizer, parsed to write the tables
        tokenizer = compact_tokenizer.load_compact(folder)
    return without_build_copies(tokenizer or AutoTokenizer.from_pretrained(folder))


def without_build_copies(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """The tokenizer without the Python copies of its vocabulary and merges that transformers'
    tokenizer classes keep after building the `tokenizers` backend from them (`_vocab`,
    `_merges`: read by nothing afterwards in the classes a causal LM's files load): 48 MB of
    Python objects for a 262k vocabulary, beside the backend's own 50 MB."""
    if getattr(tokenizer, "backend_tokenizer", None) is not None:
        for name in ("_vocab", "_merges"):
            if getattr(tokenizer, name, None) is not None:
                setattr(tokenizer, name, None)
    return tokenizer


def with_chat_template(tokenizer: PreTrainedTokenizerBase,
                       reader: GGUFFile) -> PreTrainedTokenizerBase:
    """The tokenizer with the file's own chat template (`tokenizer.chat_template`), which
    transformers' GGUF reading leaves out: without it a chat prompt went to the model as raw
    text (the default model's Q4_1 file answered "What is 2 plus 3?" with its end of turn)."""
    template = metadata(reader, "tokenizer.chat_template")
    if template and not tokenizer.chat_template:
        tokenizer.chat_template = str(template)
    return tokenizer


def load_gguf(path: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, str, str]:
    """(model, tokenizer, fingerprint, what runs its linears) for a GGUF file."""
    reader = open_gguf(path)
    arch = spec.of_gguf(metadata(reader, "general.architecture"), str(path))
    if quant.kernel() is None or linear_kernel() is None:
        raise GGUFError(f"{path}: a quantized GGUF model runs on dresd's C kernels, which need "
                        "an x86 CPU with AVX2, FMA and F16C (or AVX-512) and a C compiler; "
                        "this machine has not got them (see `dresd --version`).")
    if arch.moe and experts_kernel() is None:
        raise GGUFError(f"{path}: a mixture-of-experts file runs its experts on dresd's C "
                        "kernel (kernels/experts.c), which could not be built here (or "
                        "DRESD_CPU_EXPERTS=0).")
    sizes = check_model_tensors(reader, path, arch)
    tensors = _Tensors(reader, path)
    config, tokenizer = config_and_tokenizer(path, reader)
    forget_vocabulary(reader)  # read by nothing from here on; the weights' packing comes next
    give_back_free_heap()
    if ROPE_FREQS in tensors and "rope_freqs" not in arch.rope_scaling:
        raise GGUFError(f"{path}: a {arch.gguf} file with rope_freqs is not one dresd runs.")
    if arch.gguf not in OWN_CONFIGS:  # what transformers' GGUF mapping reads wrong or not
        config.rope_parameters = file_rope_parameters(reader, path, arch)
        config.head_dim = sizes.head_dim  # its qwen3 mapping has none
        if arch.moe:
            config.num_experts, config.num_experts_per_tok = sizes.experts, sizes.experts_used
            config.moe_intermediate_size = sizes.expert_ffn
            config.norm_topk_prob = moe_routing(reader, path, arch)
            config.mlp_only_layers, config.decoder_sparse_step = [], 1  # every layer's MLP
        if ROPE_FREQS in tensors and config.rope_parameters["rope_type"] == "yarn":
            raise GGUFError(f"{path}: rope_freqs with YaRN scaling is not one dresd runs.")
    if Sizes.of_config(config) != sizes:  # the shapes were checked against these sizes
        raise GGUFError(f"{path}: transformers reads the file's sizes as {Sizes.of_config(config)}"
                        f", dresd as {sizes}; dresd cannot run a file read two ways.")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.eval()
    if arch.recurrent_layers:
        fill_qwen35(model, tensors)
    else:
        _fill_layers(model, tensors, arch)
    decoder = model.model
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"  # tied
    model.lm_head = tensors.linear(head, out_dtype=torch.float32)
    with torch.device("cpu"):  # its frequencies, computed (they are no weights of the file)
        decoder.rotary_emb = (phi3.own_rotary(config)
                              or type(decoder.rotary_emb)(config=config))
    if ROPE_FREQS in tensors:  # Llama 3.1-3.3's scaling, as the converter stores it
        divide_rope_frequencies(decoder.rotary_emb, tensors.floats(ROPE_FREQS))
    if getattr(config, "mtp_num_hidden_layers", 0):  # a draft source (drafters/mtp.py)
        model.mtp = mtp_block(model, tensors)
    left = [name for name, value in [*model.named_parameters(), *model.named_buffers()]
            if value is not None and value.is_meta]
    if left:
        raise GGUFError(f"{path}: no tensor in the file for {', '.join(left[:4])}.")
    types = sorted({t.tensor_type.name for t in reader.tensors if t.tensor_type != Q.F32})
    return model, tokenizer, gguf_fingerprint(reader), f"GGUF {'+'.join(types) or 'F32'}"


def _norm(tensors: _Tensors, name: str, size: int, offset: float = 0.0) -> torch.nn.Parameter:
    """A norm's weight (the file's float32 values plus `offset`) as a bf16 parameter."""
    values = tensors.floats(name)
    if values.numel() != size:
        raise GGUFError(f"{tensors.path}: tensor {name!r} has {values.numel()} values where "
                        f"the model's config needs {size}.")
    return torch.nn.Parameter((values + offset).to(torch.bfloat16), requires_grad=False)


def _fill_layers(model: PreTrainedModel, tensors: _Tensors, arch: Architecture) -> None:
    """The layers of a model the C decoder runs (Llama, Qwen2, Qwen3, Qwen3-MoE, Gemma-3,
    Phi-3), filled from the file as its spec declares them. The file's tensors, as llama.cpp's
    converter wrote them (shapes checked before: `check_model_tensors`):

    - norms: `arch.layer_norms` (Gemma: four a layer), and q/k norms per head where
      `arch.head_norms`. Where `arch.stored_plus_one` (Gemma) the converter stored the
      weight plus one (the model multiplies by 1 + weight, llama.cpp by the stored value), so
      one is taken off again: a bf16 checkpoint's weights come back exactly.
    - q and k: rows permuted by the converter where `arch.permuted_qk` (it ropes Llama in
      pairs; Qwen and Gemma NEOX-style, as transformers does): `unpermute_rows` undoes it.
      Biases where `arch.attention_biases` and the file has them.
    - q, k, v and gate, up: rows of one tensor each where `arch.fused_projections` (Phi-3),
      split by row ranges (every quantized block stays whole).
    - MLP: gate, up and down, or (`arch.moe`) the router and the experts, run in C.
    - embedding: scaled by sqrt(hidden size) where `arch.embedding_scale`, in float32 before
      the rows round to bf16 (as Gemma3TextScaledWordEmbedding and llama.cpp scale it).
    """
    config, decoder = model.config, model.model
    hidden, heads, kv_heads = (config.hidden_size, config.num_attention_heads,
                               config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    offset = -1.0 if arch.stored_plus_one else 0.0
    q_rows = k_rows = None
    if arch.permuted_qk:  # undo the converter's q/k row permutation
        q_rows = unpermute_rows(heads * head_dim, heads)
        k_rows = unpermute_rows(kv_heads * head_dim, kv_heads)
    decoder.embed_tokens = tensors.embedding(
        "token_embd.weight", scale=hidden ** 0.5 if arch.embedding_scale else 1.0)
    for i, layer in enumerate(decoder.layers):
        blk = f"blk.{i}."
        for name, module in arch.layer_norms:
            getattr(layer, module).weight = _norm(tensors, f"{blk}{name}.weight", hidden, offset)
        attn = layer.self_attn
        if arch.fused_projections:  # q, k, v: consecutive rows of one tensor (Phi-3's q and k
            # heads stored reordered where the rope turns part of them: `phi3.head_rows`)
            ends = np.cumsum([0, heads * head_dim, kv_heads * head_dim, kv_heads * head_dim])
            orders = (phi3.head_rows(heads, head_dim, config.phi3_rope),
                      phi3.head_rows(kv_heads, head_dim, config.phi3_rope), None)
            projections = [(part, "attn_qkv", start + (np.arange(end - start) if order is None
                                                       else order), None)
                           for part, start, end, order in zip(
                               ("q_proj", "k_proj", "v_proj"), ends[:-1], ends[1:], orders,
                               strict=True)]
        else:
            projections = [(part, f"attn_{name}", rows, f"{blk}attn_{name}.bias"
                            if arch.attention_biases else None) for part, name, rows in (
                                ("q_proj", "q", q_rows), ("k_proj", "k", k_rows),
                                ("v_proj", "v", None))]
        for part, name, rows, bias in projections:
            setattr(attn, part, tensors.linear(f"{blk}{name}.weight", rows, bias))
        attn.o_proj = tensors.linear(blk + "attn_output.weight", bias=blk + "attn_output.bias"
                                     if arch.attention_sinks else None)
        if arch.attention_sinks:  # gpt-oss: a logit per head, float32 as the C kernel reads it
            attn.sinks = _float32(tensors.floats(blk + "attn_sinks.weight"))
        if arch.head_norms:  # per-head q and k norms, before the rope
            attn.q_norm.weight = _norm(tensors, blk + "attn_q_norm.weight", head_dim, offset)
            attn.k_norm.weight = _norm(tensors, blk + "attn_k_norm.weight", head_dim, offset)
        if arch.moe:
            layer.mlp = tensors.experts(blk, config.num_experts_per_tok,
                                        getattr(config, "norm_topk_prob", True), arch,
                                        (getattr(config, "swiglu_alpha", 0.0),
                                         getattr(config, "swiglu_limit", 0.0)))
        elif arch.fused_projections:  # gate, then up: the rows of one tensor
            inter = config.intermediate_size
            layer.mlp.gate_proj = tensors.linear(blk + "ffn_up.weight", np.arange(inter))
            layer.mlp.up_proj = tensors.linear(blk + "ffn_up.weight", np.arange(inter, 2 * inter))
            layer.mlp.down_proj = tensors.linear(blk + "ffn_down.weight")
        else:
            fill_gated_mlp(layer.mlp, tensors, blk)
    decoder.norm.weight = _norm(tensors, "output_norm.weight", hidden, offset)
