"""Tiny GGUF files for the tests, written with the `gguf` package (llama.cpp's own writer and
quantizers): a few layers of random weights in the types a test asks for, and the default
model's tokenizer (vocabulary, merges, special tokens, chat template), so that transformers
reads the file as it reads any llama.cpp file."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from dresd.models import ensure_default_model

Q = GGMLQuantizationType


@dataclass(frozen=True)
class Shape:
    hidden: int = 128
    intermediate: int = 256
    heads: int = 2  # head size 64: the C attention's
    kv_heads: int = 1
    layers: int = 2
    rope_theta: float = 10000.0


TINY = Shape()
# Llama-3.2's 1B and 3B shapes (their rotary scaling left out: speed does not depend on it)
LLAMA_32_1B = Shape(2048, 8192, 32, 8, 16, 500000.0)
LLAMA_32_3B = Shape(3072, 8192, 24, 8, 28, 500000.0)


def random_blocks(qtype: Q, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """A K-quant tensor's raw blocks, random (gguf has no quantizer for these): random quants
    and scales, with small finite float16 super-block scales."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    for first in ((size - 2,) if qtype == Q.Q6_K else (0, 2)):  # d (Q6_K: last), dmin
        scale = rng.uniform(0.0005, 0.002, (n, k // block)).astype(np.float16)
        raw[..., first:first + 2] = scale.view(np.uint8).reshape(n, k // block, 2)
    return raw.reshape(n, -1)


def tensor_bytes(qtype: Q, weights: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """float32 [n, k] weights as `qtype` blocks (K-quants: random blocks instead)."""
    if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        return random_blocks(qtype, *weights.shape, rng)
    if qtype == Q.F32:
        return weights.astype(np.float32)
    if qtype == Q.F16:
        return weights.astype(np.float16)
    return gguf.quants.quantize(weights.astype(np.float32), qtype)


def write_tiny_gguf(path: Path, linear_type: Q = Q.Q4_1, embedding_type: Q = Q.Q8_0,
                    arch: str = "llama", seed: int = 0, v_type: Q | None = None,
                    tied: bool = True, shape: Shape = TINY) -> Path:
    """A `shape` (by default 2-layer) `arch` model; every linear in `linear_type` (the
    attention's v in `v_type` if given), the token embedding in `embedding_type`, an LM head of
    its own unless `tied`. F16 for every type writes a file for llama-quantize to quantize."""
    hidden, intermediate, heads = shape.hidden, shape.intermediate, shape.heads
    kv_heads, layers = shape.kv_heads, shape.layers
    rng = np.random.default_rng(seed)
    folder = ensure_default_model(quiet=True)
    vocab = gguf.vocab.BpeVocab(folder)
    tokens, _, token_types = zip(*vocab.all_tokens(), strict=True)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny test model")
    writer.add_block_count(layers)
    writer.add_context_length(2048)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_vocab_size(len(tokens))
    writer.add_file_type(1)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(list(tokens))
    writer.add_token_types(list(token_types))
    gguf.vocab.SpecialVocab(folder, load_merges=True, n_vocab=len(tokens)).add_to_gguf(
        writer, quiet=True)

    def add(name: str, n: int, k: int, qtype: Q, scale: float = 0.08) -> None:
        if k % GGML_QUANT_SIZES[qtype][0]:  # rows too narrow for a K-quant: as llama-quantize
            qtype = Q.Q5_0
        weights = rng.standard_normal((n, k), dtype=np.float32) * scale
        data = tensor_bytes(qtype, weights, rng)
        floats = qtype in (Q.F32, Q.F16)
        writer.add_tensor(name, data, raw_shape=None if floats else data.shape,
                          raw_dtype=None if floats else qtype)

    def norm(name: str) -> None:
        writer.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))

    head_dim = hidden // heads
    add("token_embd.weight", len(tokens), hidden, embedding_type, scale=1.0)
    for i in range(layers):
        blk = f"blk.{i}."
        norm(blk + "attn_norm.weight")
        norm(blk + "ffn_norm.weight")
        add(blk + "attn_q.weight", heads * head_dim, hidden, linear_type)
        add(blk + "attn_k.weight", kv_heads * head_dim, hidden, linear_type)
        add(blk + "attn_v.weight", kv_heads * head_dim, hidden, v_type or linear_type)
        add(blk + "attn_output.weight", hidden, heads * head_dim, linear_type)
        add(blk + "ffn_gate.weight", intermediate, hidden, linear_type)
        add(blk + "ffn_up.weight", intermediate, hidden, linear_type)
        add(blk + "ffn_down.weight", hidden, intermediate, linear_type)
        if arch == "qwen2":
            for part, size in (("q", heads * head_dim), ("k", kv_heads * head_dim),
                               ("v", kv_heads * head_dim)):
                writer.add_tensor(f"{blk}attn_{part}.bias",
                                  (0.05 * rng.standard_normal(size)).astype(np.float32))
    norm("output_norm.weight")
    if not tied:
        add("output.weight", len(tokens), hidden, linear_type, scale=0.3)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
