"""F16 GGUF files of random weights in the shapes of the models people pick, for llama.cpp's own
`llama-quantize` to quantize and both engines to time (speed does not depend on the values):

- `llama-3.2-3b`: Llama-3.2-3B's config with its Llama 3 rope scaling (factor 32, original
  context 8192) as llama.cpp's converter stores it, a `rope_freqs` tensor; tied embedding.
- `qwen3-4b`: Qwen3-4B's (36 layers, head size 128 beside a hidden size of 2560, q/k RMSNorm);
  tied embedding.
- `gemma3-1b`: Gemma-3-1B's (26 layers, window 512, every 6th layer global, head size 256,
  four norms a layer); tied embedding.
- `qwen3.5-4b`: Qwen3.5-4B's published shape (32 layers, every 4th full attention with 16
  query and 4 key-value heads of 256, the others Gated DeltaNet; hidden size 2560, 248,320
  tokens) with the sizes its public descriptions leave out taken from transformers'
  `Qwen3_5TextConfig` defaults (assumed, not read from the checkpoint): MLP 9216, Gated
  DeltaNet 16 key and 32 value heads of 128, convolution of 4; tied embedding.
- `phi-3-mini`: Phi-3-mini-4k's (32 layers, 32 heads of 96, MLP 8192, a window of 2047 on
  every layer), q/k/v and gate/up each one tensor as llama.cpp's converter writes them; its
  own output head; the default model's 49,152 tokens, not Phi-3's 32,064 (the padded tokenizer
  below cannot be cut: 1.5% more weight bytes a step, for both engines).
- `phi-4-mini`: Phi-4-mini-instruct's (32 layers, 24 query and 8 key-value heads of 128, MLP
  8192, 200,064 tokens, tied embedding), its rope as its converted file holds it: 96 of each
  head's 128 dimensions turned, LongRoPE factors (`rope_factors_long`/`_short`, made up: speed
  does not depend on them) over an original context of 4,096 in 131,072; no window.
- `qwen3-30b-a3b`: Qwen3-30B-A3B's layer shape (128 experts of 768, 8 used, the router in F32)
  for `--layers` of its 48 layers (each layer is ~1.2 GB in F16, ~0.3 GB in Q4_K_M).
- `gpt-oss-20b`: gpt-oss-20b's (24 layers, 64 query and 8 key-value heads of 64, a window of
  128 on every other layer, 32 experts of 2880, 4 used, 201,088 tokens, its own output head,
  YaRN: factor 32 over an original context of 4,096), with the biases, sinks and router bias
  llama.cpp's converter writes (F32), for `--layers` of them (each ~1.6 GB in F16, ~0.42 GB
  with llama-quantize's MXFP4_MOE: its experts in MXFP4, the rest Q8_0).

Every file has its model's whole vocabulary: the default model's tokenizer (49,152 tokens)
padded with `[PAD<i>]` tokens of type UNUSED, as llama.cpp's converter pads Qwen's, so that
the embedding and the LM head are the real ones' size and llama.cpp loads the file.

Tensors of one shape share one random array (the file holds each in full; the writer holds one
copy), so writing the 4B model's 8 GB takes ~1 GB of memory.

    PYTHONPATH=src:tests python benchmarks/peers/model_shapes.py qwen3-4b OUT-F16.gguf

benchmarks/peers/model_shapes.sh quantizes them and times both engines on the files.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf_files import default_tokens, llama3_rope_factors

from dresd.models.target import ensure_default_model

UNUSED = int(gguf.TokenType.UNUSED)


@dataclass(frozen=True)
class Config:
    arch: str
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    vocab: int
    rope_theta: float
    rms_eps: float = 1e-6
    tied: bool = True
    window: int = 0  # gemma3: its sliding window
    experts: int = 0  # qwen3moe: expert count, used per token, each expert's hidden size
    experts_used: int = 0
    expert_ffn: int = 0
    llama3_rope: dict | None = None  # Llama 3's rope scaling, written as rope_freqs.weight
    turned: int = 0  # phi3: the rope's dimensions of a head, where it turns part of it
    longrope: bool = False  # phi3: LongRoPE factors, an original context of 4,096
    linear_heads: tuple[int, int, int, int] = (0, 0, 0, 0)  # qwen35: Gated DeltaNet key and
    # value heads and their sizes (every `full_every`-th layer full attention, the rest these)
    full_every: int = 4


CONFIGS = {
    "llama-3.2-3b": Config("llama", 3072, 8192, 24, 8, 128, 28, 128256, 500000.0, 1e-5,
                           llama3_rope={"factor": 32.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 8192}),
    "qwen3-4b": Config("qwen3", 2560, 9728, 32, 8, 128, 36, 151936, 1_000_000.0),
    "gemma3-1b": Config("gemma3", 1152, 6912, 4, 1, 256, 26, 262144, 1_000_000.0, window=512),
    "qwen3.5-4b": Config("qwen35", 2560, 9216, 16, 4, 256, 32, 248320, 10_000_000.0,
                         linear_heads=(16, 32, 128, 128)),
    "phi-3-mini": Config("phi3", 3072, 8192, 32, 32, 96, 32, 49152, 10000.0, 1e-5, tied=False,
                         window=2047),
    "phi-4-mini": Config("phi3", 3072, 8192, 24, 8, 128, 32, 200064, 10000.0, 1e-5,
                         turned=96, longrope=True),
    "qwen3-30b-a3b": Config("qwen3moe", 2048, 6144, 32, 4, 128, 48, 151936, 1_000_000.0,
                            tied=False, experts=128, experts_used=8, expert_ffn=768),
    "gpt-oss-20b": Config("gpt-oss", 2880, 2880, 64, 8, 64, 24, 201088, 150000.0, 1e-5,
                          tied=False, window=128, experts=32, experts_used=4, expert_ffn=2880),
}


def add_padded_tokenizer(writer: gguf.GGUFWriter, vocab: int) -> None:
    """The default model's byte-level tokenizer, its token list padded to `vocab`."""
    tokens, token_types = default_tokens()
    padding = vocab - len(tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens + [f"[PAD{i}]" for i in range(padding)])
    writer.add_token_types(token_types + [UNUSED] * padding)
    gguf.vocab.SpecialVocab(ensure_default_model(quiet=True), load_merges=True,
                            n_vocab=vocab).add_to_gguf(writer, quiet=True)


def write_file(config: Config, path: Path, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    shared: dict[tuple[int, ...], np.ndarray] = {}

    def weights(*shape: int) -> np.ndarray:  # one random F16 array per shape
        if shape not in shared:
            scale = 1.0 / np.sqrt(shape[-1])
            shared[shape] = (rng.standard_normal(shape, dtype=np.float32) * scale
                             ).astype(np.float16)
        return shared[shape]

    def norm(name: str, size: int) -> None:
        writer.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(size)).astype(np.float32))

    c = config
    writer = gguf.GGUFWriter(str(path), c.arch)
    # (llama.cpp looks for Phi-3's </s>, <s> and <unk> in a file whose name says "phi3")
    writer.add_name("random shape" if c.arch == "phi3" else f"random {c.arch} shape")
    writer.add_block_count(c.layers)
    context = 131072 if c.llama3_rope or c.longrope or c.arch == "gpt-oss" else 32768
    writer.add_context_length(context)
    writer.add_embedding_length(c.hidden)
    writer.add_feed_forward_length(c.intermediate)
    writer.add_head_count(c.heads)
    writer.add_head_count_kv(c.kv_heads)
    writer.add_rope_freq_base(c.rope_theta)
    writer.add_layer_norm_rms_eps(c.rms_eps)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    if c.arch in ("llama", "phi3"):
        writer.add_rope_dimension_count(c.turned or c.head_dim)
    if c.longrope:  # as the converter writes it (`Phi3MiniModel`): attention factor, factors
        original = 4096
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_rope_scaling_attn_factors(
            float(np.sqrt(1 + np.log(context / original) / np.log(original))))
        pairs = (c.turned or c.head_dim) // 2
        writer.add_tensor("rope_factors_long.weight", np.linspace(1, 40, pairs, dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.linspace(1, 3, pairs, dtype=np.float32))
    if c.arch == "llama":
        writer.add_vocab_size(c.vocab)
    if c.window or c.arch == "phi3":  # (the converter writes Phi-3's always: 0 for none)
        writer.add_sliding_window(c.window)
    linear_layers = []
    if c.arch == "qwen35":  # the Gated DeltaNet's sizes and the layer pattern
        key_heads, value_heads, key_size, value_size = c.linear_heads
        writer.add_ssm_conv_kernel(4)
        writer.add_ssm_state_size(key_size)
        writer.add_ssm_group_count(key_heads)
        writer.add_ssm_time_step_rank(value_heads)
        writer.add_ssm_inner_size(value_heads * value_size)
        linear_layers = [(i + 1) % c.full_every != 0 for i in range(c.layers)]
        writer.add_array("qwen35.attention.recurrent_layers", linear_layers)
        writer.add_full_attention_interval(c.full_every)
        writer.add_rope_dimension_count(c.head_dim // 4)
        writer.add_rope_dimension_sections([11, 11, 10, 0])
    if c.arch == "gpt-oss":  # YaRN, as the converter writes gpt-oss-20b's
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(32.0)
        writer.add_rope_scaling_orig_ctx_len(4096)
        writer.add_rope_scaling_yarn_beta_fast(32.0)
        writer.add_rope_scaling_yarn_beta_slow(1.0)
    if c.experts:
        writer.add_expert_count(c.experts)
        writer.add_expert_used_count(c.experts_used)
        writer.add_expert_feed_forward_length(c.expert_ffn)
    add_padded_tokenizer(writer, c.vocab)
    if c.llama3_rope:
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(
            {**c.llama3_rope, "rope_theta": c.rope_theta}, c.head_dim))
    writer.add_tensor("token_embd.weight", weights(c.vocab, c.hidden))
    q_size, kv_size = c.heads * c.head_dim, c.kv_heads * c.head_dim
    for i in range(c.layers):
        blk = f"blk.{i}."
        norm(blk + "attn_norm.weight", c.hidden)
        if c.arch == "qwen35":
            norm(blk + "post_attention_norm.weight", c.hidden)
            add_qwen35_mixer(writer, c, blk, linear_layers[i], weights, norm, rng)
            add_mlp(writer, c, blk, weights)
            continue
        norm(blk + ("post_attention_norm.weight" if c.arch == "gpt-oss" else "ffn_norm.weight"),
             c.hidden)
        if c.arch == "gpt-oss":
            add_gpt_oss_biases(writer, c, blk, rng)
        if c.arch in ("qwen3", "qwen3moe", "gemma3"):
            norm(blk + "attn_q_norm.weight", c.head_dim)
            norm(blk + "attn_k_norm.weight", c.head_dim)
        if c.arch == "gemma3":
            norm(blk + "post_attention_norm.weight", c.hidden)
            norm(blk + "post_ffw_norm.weight", c.hidden)
        if c.arch == "phi3":  # q, k, v in one tensor; gate then up in another
            writer.add_tensor(blk + "attn_qkv.weight", weights(q_size + 2 * kv_size, c.hidden))
        else:
            writer.add_tensor(blk + "attn_q.weight", weights(q_size, c.hidden))
            writer.add_tensor(blk + "attn_k.weight", weights(kv_size, c.hidden))
            writer.add_tensor(blk + "attn_v.weight", weights(kv_size, c.hidden))
        writer.add_tensor(blk + "attn_output.weight", weights(c.hidden, q_size))
        if c.experts:  # the router differs per layer, so each layer routes a row its own way
            writer.add_tensor(blk + "ffn_gate_inp.weight", (0.05 * rng.standard_normal(
                (c.experts, c.hidden), dtype=np.float32)))
            writer.add_tensor(blk + "ffn_gate_exps.weight",
                              weights(c.experts, c.expert_ffn, c.hidden))
            writer.add_tensor(blk + "ffn_up_exps.weight",
                              weights(c.experts, c.expert_ffn, c.hidden))
            writer.add_tensor(blk + "ffn_down_exps.weight",
                              weights(c.experts, c.hidden, c.expert_ffn))
        else:
            add_mlp(writer, c, blk, weights)
    norm("output_norm.weight", c.hidden)
    if not c.tied:
        writer.add_tensor("output.weight", weights(c.vocab, c.hidden))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=True)
    writer.close()
    return path


def add_gpt_oss_biases(writer: gguf.GGUFWriter, c: Config, blk: str,
                       rng: np.random.Generator) -> None:
    """A gpt-oss layer's float32 tensors beside its weights: q, k, v and output biases, a sink
    per head, the router's bias, each expert's gate, up and down biases."""
    def small(name: str, *shape: int) -> None:
        writer.add_tensor(blk + name, (0.02 * rng.standard_normal(shape)).astype(np.float32))

    q_size, kv_size = c.heads * c.head_dim, c.kv_heads * c.head_dim
    for name, size in (("attn_q", q_size), ("attn_k", kv_size), ("attn_v", kv_size),
                       ("attn_output", c.hidden)):
        small(name + ".bias", size)
    small("attn_sinks.weight", c.heads)
    small("ffn_gate_inp.bias", c.experts)
    small("ffn_gate_exps.bias", c.experts, c.expert_ffn)
    small("ffn_up_exps.bias", c.experts, c.expert_ffn)
    small("ffn_down_exps.bias", c.experts, c.hidden)


def add_mlp(writer: gguf.GGUFWriter, c: Config, blk: str, weights) -> None:
    if c.arch == "phi3":
        writer.add_tensor(blk + "ffn_up.weight", weights(2 * c.intermediate, c.hidden))
    else:
        writer.add_tensor(blk + "ffn_gate.weight", weights(c.intermediate, c.hidden))
        writer.add_tensor(blk + "ffn_up.weight", weights(c.intermediate, c.hidden))
    writer.add_tensor(blk + "ffn_down.weight", weights(c.hidden, c.intermediate))


def add_qwen35_mixer(writer: gguf.GGUFWriter, c: Config, blk: str, linear: bool, weights, norm,
                     rng: np.random.Generator) -> None:
    """A qwen35 layer's token mixer under llama.cpp's names: a Gated DeltaNet (its projections,
    the convolution, ssm_a = -exp(A_log) < 0, the step bias, the output norm) or gated full
    attention (each head's query and output gate side by side in attn_q)."""
    if not linear:
        q_size, kv_size = c.heads * c.head_dim, c.kv_heads * c.head_dim
        norm(blk + "attn_q_norm.weight", c.head_dim)
        norm(blk + "attn_k_norm.weight", c.head_dim)
        writer.add_tensor(blk + "attn_q.weight", weights(2 * q_size, c.hidden))
        writer.add_tensor(blk + "attn_k.weight", weights(kv_size, c.hidden))
        writer.add_tensor(blk + "attn_v.weight", weights(kv_size, c.hidden))
        writer.add_tensor(blk + "attn_output.weight", weights(c.hidden, q_size))
        return
    key_heads, value_heads, key_size, value_size = c.linear_heads
    channels, value_dim = 2 * key_heads * key_size + value_heads * value_size, \
        value_heads * value_size
    writer.add_tensor(blk + "attn_qkv.weight", weights(channels, c.hidden))
    writer.add_tensor(blk + "attn_gate.weight", weights(value_dim, c.hidden))
    writer.add_tensor(blk + "ssm_beta.weight", weights(value_heads, c.hidden))
    writer.add_tensor(blk + "ssm_alpha.weight", weights(value_heads, c.hidden))
    writer.add_tensor(blk + "ssm_out.weight", weights(c.hidden, value_dim))
    writer.add_tensor(blk + "ssm_a", -np.exp(rng.uniform(-2, 2, value_heads)).astype(np.float32))
    writer.add_tensor(blk + "ssm_dt.bias", rng.standard_normal(value_heads).astype(np.float32))
    writer.add_tensor(blk + "ssm_conv1d.weight",
                      (0.3 * rng.standard_normal((channels, 4))).astype(np.float32))
    norm(blk + "ssm_norm.weight", value_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", choices=sorted(CONFIGS))
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, help="this many of the model's layers")
    args = parser.parse_args()
    config = CONFIGS[args.shape]
    if args.layers:
        config = Config(**{**config.__dict__, "layers": args.layers})
    write_file(config, args.out)


if __name__ == "__main__":
    main()
