"""A `qwen35` GGUF file (Qwen3.5's text model, as llama.cpp's converter writes it) as
transformers' `Qwen3_5ForCausalLM`, run by `decoding/recurrent.py` with its linears on dresd's
quantized C kernel.

What the converter (`conversion/qwen.py`: `Qwen3NextModel`, `_LinearAttentionVReorderBase`)
changes, and how it is read back:

- norms: every RMSNorm but the Gated DeltaNet's output norm (`ssm_norm`) is stored plus one
  (the model multiplies by 1 + weight, llama.cpp by the stored value): one is taken off again.
- `ssm_a` = -exp(A_log): A_log = log(-ssm_a), kept in float32 (the rule reads it as float32).
- `ssm_dt.bias` is dt_bias; `ssm_conv1d` the depthwise convolution's [channels, kernel].
- Value heads: where there are more value heads than key heads, the converter reorders the
  value heads from grouped (value head h reads key head h // r) to tiled (key head h % nk), in
  every tensor on the value side (`attn_qkv`'s value rows, `attn_gate`, `ssm_beta`,
  `ssm_alpha`, `ssm_a`, `ssm_dt`, the convolution's value channels and `ssm_out`'s columns).
  Reordering a quantized tensor's columns back would split its blocks; instead the layers keep
  the file's tiled order and read their query and key heads tiled too
  (`TILED_VALUE_HEADS`): the same sums, in llama.cpp's head order.
- `attn_q` holds each head's query and output gate side by side, as transformers' q_proj.
- NextN/MTP layers (`nextn_predict_layers`) are counted in `block_count`; they are not read.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PreTrainedModel, Qwen3_5TextConfig

from dresd.decoding.recurrent import TILED_VALUE_HEADS
from dresd.gguf_model import (
    NORM_TYPES,
    SUPPORTED_TYPES,
    GGUFError,
    GGUFFile,
    _field,
    _norm,
    _number,
    _size,
    _Tensors,
    _token_rows,
)

ARCHITECTURE = "qwen35"


def qwen35_config(reader: GGUFFile, path: Path) -> Qwen3_5TextConfig:
    """The file's transformers config, read as llama.cpp reads a qwen35 file
    (`llama_model::load_hparams`): the layer pattern from `attention.recurrent_layers` (else
    every `full_attention_interval`-th layer full), the rotary dimensions from
    `rope.dimension_count` (a quarter of a head in Qwen3.5), the Gated DeltaNet's sizes from the
    `ssm.*` keys (state size: the key head size; group count: key heads; time step rank: value
    heads; inner size: value heads x value head size)."""
    key = f"{ARCHITECTURE}.{{}}".format
    blocks = _size(reader, path, key("block_count"))
    layers = blocks - int(_number(reader, path, key("nextn_predict_layers"), 0))
    heads = _size(reader, path, key("attention.head_count"))
    head_dim = _size(reader, path, key("attention.key_length"))
    value_heads = _size(reader, path, key("ssm.time_step_rank"))
    inner = _size(reader, path, key("ssm.inner_size"))
    if inner % value_heads:
        raise GGUFError(f"{path}: ssm.inner_size {inner} is not a whole number of "
                        f"{value_heads} value heads.")
    key_heads = _size(reader, path, key("ssm.group_count"))
    if value_heads % key_heads:
        raise GGUFError(f"{path}: {key_heads} key heads do not divide {value_heads} value heads.")
    recurrent = _field(reader, key("attention.recurrent_layers"))
    if isinstance(recurrent, list):
        if len(recurrent) < layers:
            raise GGUFError(f"{path}: attention.recurrent_layers has {len(recurrent)} flags "
                            f"for {layers} layers.")
        linear = [bool(flag) for flag in recurrent[:layers]]
    else:
        interval = _size(reader, path, key("full_attention_interval"), 4)
        linear = [(i + 1) % interval != 0 for i in range(layers)]
    rotary = _size(reader, path, key("rope.dimension_count"), head_dim // 4)
    sections = _field(reader, key("rope.dimension_sections")) or [11, 11, 10]
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return Qwen3_5TextConfig(
        vocab_size=_token_rows(reader, path),
        hidden_size=_size(reader, path, key("embedding_length")),
        intermediate_size=_size(reader, path, key("feed_forward_length")),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=_size(reader, path, key("attention.head_count_kv"), heads),
        head_dim=head_dim,
        linear_conv_kernel_dim=_size(reader, path, key("ssm.conv_kernel")),
        linear_key_head_dim=_size(reader, path, key("ssm.state_size")),
        linear_num_key_heads=key_heads,
        linear_num_value_heads=value_heads,
        linear_value_head_dim=inner // value_heads,
        layer_types=["linear_attention" if flag else "full_attention" for flag in linear],
        rope_parameters={"rope_type": "default",
                         "rope_theta": float(_number(reader, path, key("rope.freq_base"), 1e7)),
                         "partial_rotary_factor": rotary / head_dim,
                         "mrope_section": [int(s) for s in sections[:3]]},
        rms_norm_eps=float(_number(reader, path, key("attention.layer_norm_rms_epsilon"), 1e-6)),
        max_position_embeddings=int(_number(reader, path, key("context_length"), 32768)),
        tie_word_embeddings="output.weight" not in {t.name for t in reader.tensors},
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=eos,
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"))


def expected_qwen35_tensors(config: Qwen3_5TextConfig) -> dict[str, tuple[tuple[int, ...], set]]:
    """Every tensor a qwen35 file's layers read: shape (outer size first) and allowed types."""
    hidden, inter, head_dim = config.hidden_size, config.intermediate_size, config.head_dim
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
    mlp = {"ffn_gate.weight": (inter, hidden), "ffn_up.weight": (inter, hidden),
           "ffn_down.weight": (hidden, inter)}
    norms = {"attn_norm.weight": (hidden,), "post_attention_norm.weight": (hidden,)}
    expected = {"output_norm.weight": ((hidden,), NORM_TYPES)}
    for i, kind in enumerate(config.layer_types):
        blk = f"blk.{i}."
        weights, floats = (linear, small) if kind == "linear_attention" else (full, full_small)
        expected.update({blk + n: (s, SUPPORTED_TYPES) for n, s in (weights | mlp).items()})
        expected.update({blk + n: (s, NORM_TYPES) for n, s in (floats | norms).items()})
    return expected


def fill_qwen35(model: PreTrainedModel, tensors: _Tensors) -> None:
    """A `Qwen3_5ForCausalLM` (built on the meta device) takes the file's tensors (module doc)."""
    config, decoder = model.config, model.model
    hidden, head_dim = config.hidden_size, config.head_dim
    decoder.embed_tokens = tensors.embedding("token_embd.weight")
    for i, layer in enumerate(decoder.layers):
        blk = f"blk.{i}."
        layer.input_layernorm.weight = _norm(tensors, blk + "attn_norm.weight", hidden, -1.0)
        layer.post_attention_layernorm.weight = _norm(
            tensors, blk + "post_attention_norm.weight", hidden, -1.0)
        for part, name in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"),
                           ("down_proj", "ffn_down")):
            setattr(layer.mlp, part, tensors.linear(f"{blk}{name}.weight"))
        if config.layer_types[i] == "full_attention":
            attn = layer.self_attn
            attn.q_norm.weight = _norm(tensors, blk + "attn_q_norm.weight", head_dim, -1.0)
            attn.k_norm.weight = _norm(tensors, blk + "attn_k_norm.weight", head_dim, -1.0)
            for part, name in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"),
                               ("o_proj", "attn_output")):
                setattr(attn, part, tensors.linear(f"{blk}{name}.weight"))
            continue
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
    decoder.norm.weight = _norm(tensors, "output_norm.weight", hidden, -1.0)


def _float32(values: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(values.float().contiguous(), requires_grad=False)

