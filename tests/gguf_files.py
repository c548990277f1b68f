"""Tiny GGUF files for the tests, written with the `gguf` package (llama.cpp's own writer and
quantizers): a few layers of random weights in the types a test asks for, and the default
model's tokenizer (vocabulary, merges, special tokens, chat template), so that transformers
reads the file as it reads any llama.cpp file."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from dresd.models import ensure_default_model

Q = GGMLQuantizationType
HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, LAYERS = 128, 256, 2, 1, 2  # head size 64: C attention


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
    return gguf.quants.quantize(weights.astype(np.float32), qtype)


def write_tiny_gguf(path: Path, linear_type: Q = Q.Q4_1, embedding_type: Q = Q.Q8_0,
                    arch: str = "llama", seed: int = 0, v_type: Q | None = None,
                    tied: bool = True) -> Path:
    """A 2-layer `arch` model; every linear in `linear_type` (the attention's v in `v_type`
    if given), the token embedding in `embedding_type`, an LM head of its own unless `tied`."""
    rng = np.random.default_rng(seed)
    folder = ensure_default_model(quiet=True)
    vocab = gguf.vocab.BpeVocab(folder)
    tokens, _, token_types = zip(*vocab.all_tokens(), strict=True)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny test model")
    writer.add_block_count(LAYERS)
    writer.add_context_length(2048)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
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
        weights = rng.standard_normal((n, k)).astype(np.float32) * scale
        data = tensor_bytes(qtype, weights, rng)
        writer.add_tensor(name, data, raw_shape=None if qtype == Q.F32 else data.shape,
                          raw_dtype=None if qtype == Q.F32 else qtype)

    def norm(name: str) -> None:
        writer.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))

    head_dim = HIDDEN // HEADS
    add("token_embd.weight", len(tokens), HIDDEN, embedding_type, scale=1.0)
    for i in range(LAYERS):
        blk = f"blk.{i}."
        norm(blk + "attn_norm.weight")
        norm(blk + "ffn_norm.weight")
        add(blk + "attn_q.weight", HEADS * head_dim, HIDDEN, linear_type)
        add(blk + "attn_k.weight", KV_HEADS * head_dim, HIDDEN, linear_type)
        add(blk + "attn_v.weight", KV_HEADS * head_dim, HIDDEN, v_type or linear_type)
        add(blk + "attn_output.weight", HIDDEN, HEADS * head_dim, linear_type)
        add(blk + "ffn_gate.weight", INTERMEDIATE, HIDDEN, linear_type)
        add(blk + "ffn_up.weight", INTERMEDIATE, HIDDEN, linear_type)
        add(blk + "ffn_down.weight", HIDDEN, INTERMEDIATE, linear_type)
        if arch == "qwen2":
            for part, size in (("q", HEADS * head_dim), ("k", KV_HEADS * head_dim),
                               ("v", KV_HEADS * head_dim)):
                writer.add_tensor(f"{blk}attn_{part}.bias",
                                  (0.05 * rng.standard_normal(size)).astype(np.float32))
    norm("output_norm.weight")
    if not tied:
        add("output.weight", len(tokens), HIDDEN, linear_type, scale=0.3)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
