"""Tiny GGUF files for the tests, written with the `gguf` package (llama.cpp's own writer and
quantizers): a few layers of random weights in the types a test asks for, and the default
model's tokenizer (vocabulary, merges, special tokens, chat template), so that transformers
reads the file as it reads any llama.cpp file.

A `gemma3` file is written from a random transformers `Gemma3ForCausalLM` (`gemma3_model`), as
llama.cpp's converter (`conversion/gemma.py`, `Gemma3Model`) writes one: its norms plus one, no
q/k permutation, the LM head tied to the embedding, no layer pattern in the metadata (llama.cpp
takes every 6th layer as global). `gemma3_model` with the file's types gives the model the file
holds (weights through the `gguf` package's quantizers and back): the test's reference."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from dresd.models.target import ensure_default_model

Q = GGMLQuantizationType


@dataclass(frozen=True)
class Shape:
    hidden: int = 128
    intermediate: int = 256
    heads: int = 2  # head size 64: the C attention's
    kv_heads: int = 1
    layers: int = 2
    rope_theta: float = 10000.0
    # gemma3 only: its head size (the file's key_length), the sliding window, and the linear
    # rope scaling of its global layers (Gemma-3 4B and larger: 8)
    head_dim: int | None = None
    window: int = 0
    rope_scale: float = 1.0


TINY = Shape()
# 6 layers: five windowed, the sixth global (llama.cpp's default pattern); window 8
GEMMA3_TINY = Shape(128, 256, 2, 1, 6, 1_000_000.0, head_dim=64, window=8, rope_scale=8.0)
# Gemma-3 1B's shape (its 262k vocabulary left out: the tokenizer here is the default model's)
GEMMA3_1B = Shape(1152, 6912, 4, 1, 26, 1_000_000.0, head_dim=256, window=512)
# Llama-3.2's 1B and 3B shapes (their rotary scaling left out: speed does not depend on it)
LLAMA_32_1B = Shape(2048, 8192, 32, 8, 16, 500000.0)
LLAMA_32_3B = Shape(3072, 8192, 24, 8, 28, 500000.0)


# A tiny sentencepiece vocabulary as a Gemma-3 file holds one (tokenizer.ggml.model "llama", no
# merges, scores, token types; Gemma's special tokens first, then byte fallbacks): every prefix
# of these words, so transformers' Gemma builder can rebuild a merge for each
GEMMA_WORDS = ("Hello", "\u2581world", "\u2581hello", "\u2581the", "\u2581cat", "\u2581sat")
GEMMA_SPECIAL = ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>")
GEMMA_CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
                       "{{ m['content'] }}<end_of_turn>\n{% endfor %}"
                       "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def gemma_vocab() -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types) of the tiny sentencepiece vocabulary."""
    tokens = list(GEMMA_SPECIAL) + [f"<0x{byte:02X}>" for byte in range(256)]
    types = [3] * len(GEMMA_SPECIAL) + [6] * 256  # CONTROL, BYTE
    types[3] = 2  # <unk>: UNKNOWN
    pieces = ["\u2581", *"abcdefghijklmnopqrstuvwxyzH"]
    pieces += [f"\u2581{letter}" for letter in "abcdefghijklmnopqrstuvwxyz"]
    for word in GEMMA_WORDS:
        pieces += [word[:end] for end in range(2, len(word) + 1)]
    for piece in dict.fromkeys(pieces):  # in order, once each
        if piece not in tokens:
            tokens.append(piece)
            types.append(1)
    scores = [0.0] * len(GEMMA_SPECIAL) + [0.0] * 256
    scores += [-float(i) for i in range(len(tokens) - len(scores))]
    return tokens, scores, types


def default_tokens() -> tuple[list[str], list[int]]:
    """The default model's byte-level vocabulary: (tokens, token types), as gguf-py reads it."""
    vocab = gguf.vocab.BpeVocab(ensure_default_model(quiet=True))
    tokens, _, token_types = zip(*vocab.all_tokens(), strict=True)
    return list(tokens), list(token_types)


def add_default_tokenizer(writer: gguf.GGUFWriter) -> None:
    """The default model's tokenizer (vocabulary, merges, special tokens, chat template) as
    llama.cpp's converter writes a byte-level one."""
    tokens, token_types = default_tokens()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    gguf.vocab.SpecialVocab(ensure_default_model(quiet=True), load_merges=True,
                            n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)


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


def as_stored(qtype: Q, weights: np.ndarray) -> np.ndarray:
    """The float32 values a file holds for `weights` stored as `qtype` (the `gguf` package's
    quantizer, then its dequantizer)."""
    if qtype == Q.F32:
        return weights.astype(np.float32)
    return gguf.quants.dequantize(tensor_bytes(qtype, weights, np.random.default_rng()),
                                  qtype).reshape(weights.shape)


def gemma3_model(shape: Shape = GEMMA3_TINY, vocab: int = 49152, seed: int = 0,
                 linear_type: Q | None = None, embedding_type: Q | None = None
                 ) -> torch.nn.Module:
    """A random float32 transformers `Gemma3ForCausalLM` of `shape` (weights large enough that
    its next tokens are no near-ties, norms away from 0); with `linear_type` and
    `embedding_type`, each weight as a file of those types holds it."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    global_rope = {"rope_type": "default", "rope_theta": shape.rope_theta}
    if shape.rope_scale != 1.0:
        global_rope = {"rope_type": "linear", "rope_theta": shape.rope_theta,
                       "factor": shape.rope_scale}
    config = Gemma3TextConfig(
        vocab_size=vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
        query_pre_attn_scalar=shape.head_dim, sliding_window=shape.window,
        rope_parameters={"full_attention": global_rope,
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=True,
        pad_token_id=None, bos_token_id=None, eos_token_id=None)
    with torch.device("meta"):
        model = Gemma3ForCausalLM(config)
    rng = np.random.default_rng(seed)
    values = {}
    for name, parameter in model.named_parameters():
        if name.endswith("norm.weight"):  # Gemma's norm multiplies by 1 + weight
            weights = 0.2 * rng.standard_normal(parameter.shape, dtype=np.float32)
            if ".post_" in name:  # the blocks' outputs weigh more than the scaled embedding,
                weights += 3.0  # else the tied head mostly predicts the token just read
        elif name == "model.embed_tokens.weight":
            weights = rng.standard_normal(parameter.shape, dtype=np.float32) * 0.3
            weights = weights if embedding_type is None else as_stored(embedding_type, weights)
        else:
            weights = rng.standard_normal(parameter.shape, dtype=np.float32) * 0.08
            weights = weights if linear_type is None else as_stored(linear_type, weights)
        values[name] = torch.from_numpy(weights)
    model.load_state_dict(values, assign=True, strict=False)
    model.tie_weights()
    with torch.device("cpu"):  # buffers: rotary frequencies, the embedding's scale
        model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    model.model.embed_tokens.embed_scale = torch.tensor(float(shape.hidden) ** 0.5)
    return model.eval()


def write_tiny_gguf(path: Path, linear_type: Q = Q.Q4_1, embedding_type: Q = Q.Q8_0,
                    arch: str = "llama", seed: int = 0, v_type: Q | None = None,
                    tied: bool = True, shape: Shape = TINY, sentencepiece: bool = False
                    ) -> Path:
    """A `shape` (by default 2-layer) `arch` model; every linear in `linear_type` (the
    attention's v in `v_type` if given), the token embedding in `embedding_type`, an LM head of
    its own unless `tied`. F16 for every type writes a file for llama-quantize to quantize.
    The default model's tokenizer, or with `sentencepiece` the tiny one of `gemma_vocab`."""
    hidden, intermediate, heads = shape.hidden, shape.intermediate, shape.heads
    kv_heads, layers = shape.kv_heads, shape.layers
    rng = np.random.default_rng(seed)
    if sentencepiece:
        tokens, scores, token_types = gemma_vocab()
    else:
        tokens = default_tokens()[0]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny test model")
    writer.add_block_count(layers)
    writer.add_context_length(2048)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    if arch == "gemma3":  # as llama.cpp's Gemma3Model.set_gguf_parameters writes them
        writer.add_layer_norm_rms_eps(1e-6)
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
        writer.add_sliding_window(shape.window)
        if shape.rope_scale != 1.0:
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(shape.rope_scale)
    else:
        writer.add_layer_norm_rms_eps(1e-5)
        writer.add_rope_dimension_count(hidden // heads)
    writer.add_vocab_size(len(tokens))
    writer.add_file_type(1)
    if sentencepiece:  # as llama.cpp's _set_vocab_sentencepiece writes Gemma's
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(token_types)
        writer.add_bos_token_id(2)
        writer.add_eos_token_id(1)
        writer.add_unk_token_id(3)
        writer.add_pad_token_id(0)
        writer.add_add_bos_token(True)
        writer.add_add_eos_token(False)
        writer.add_add_space_prefix(False)
        writer.add_chat_template(GEMMA_CHAT_TEMPLATE)
    else:
        add_default_tokenizer(writer)

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

    if arch == "gemma3":
        _add_gemma3_tensors(writer, gemma3_model(shape, len(tokens), seed), linear_type,
                            embedding_type, rng)
        return _finish(writer, path)
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
    return _finish(writer, path)


def _finish(writer: gguf.GGUFWriter, path: Path) -> Path:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# transformers' names of a layer's tensors -> llama.cpp's (gguf-py's tensor_mapping.py)
LAYER_TENSORS = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
LLAMA_LAYER_TENSORS = {**LAYER_TENSORS, "post_attention_layernorm": "ffn_norm",
                       "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}  # Phi-3
GEMMA3_LAYER_TENSORS = {
    **LAYER_TENSORS, "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
}


def _add_gemma3_tensors(writer: gguf.GGUFWriter, model: torch.nn.Module, linear_type: Q,
                        embedding_type: Q, rng: np.random.Generator) -> None:
    """`model`'s weights under llama.cpp's names: norms in F32 plus one (the converter's
    `norm_shift`), linears in `linear_type`, the embedding (also the LM head) in
    `embedding_type`."""
    for name, value in model.state_dict().items():
        weights = value.float().numpy()
        if name == "lm_head.weight":
            continue  # tied: llama.cpp writes no output.weight
        if name == "model.embed_tokens.weight":
            gguf_name, qtype = "token_embd.weight", embedding_type
        elif name == "model.norm.weight":
            gguf_name, qtype = "output_norm.weight", None
        else:
            _, _, index, rest = name.split(".", 3)
            part = rest.removesuffix(".weight")
            gguf_name = f"blk.{index}.{GEMMA3_LAYER_TENSORS[part]}.weight"
            qtype = None if part.endswith("norm") else linear_type
        if qtype is None:
            writer.add_tensor(gguf_name, (weights + 1.0).astype(np.float32))
            continue
        data = tensor_bytes(qtype, weights, rng)
        floats = qtype in (Q.F32, Q.F16)
        writer.add_tensor(gguf_name, data, raw_shape=None if floats else data.shape,
                          raw_dtype=None if floats else qtype)


# --- transformers folders, converted as llama.cpp converts them ----------------------------
# For references no one here wrote: a tiny random transformers model (Llama with rope scaling,
# Qwen3) saved as a folder, its float32 forward the reference, and the folder converted to a
# GGUF file by llama.cpp's own `convert_hf_to_gguf.py` where its sources are on this machine
# (`llama_cpp_converter`: benchmarks/peers/llama_cpp_tools.sh fetches them), else by
# `convert_like_llama_cpp`, which writes what that converter writes (checked against it by
# tests/test_gguf_rope_scaling.py where both run).

HF_SHAPE = dict(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False)
# Llama 3.1's scaling with its original context cut to 32 tokens, so that a test's prompts run
# far past it: the converter stores it as rope_freqs.weight
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
LINEAR_ROPE = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
             "original_max_position_embeddings": 32}


PHI3_WINDOW = 20  # keys a row sees (itself included): a test's 72 positions run far past it
# Phi-4-mini's rope, tiny: LongRoPE with its original context cut to 32 tokens (the long
# factors from position 32 on), turning 48 of each head's 64 dimensions (its 0.75)
PHI3_LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                 "original_max_position_embeddings": 32,
                 "short_factor": [1.0 + 0.02 * i for i in range(24)],
                 "long_factor": [1.0 + 0.5 * i for i in range(24)]}

# Qwen3-MoE's experts, tiny: 8 experts of hidden size 64, 2 used per token, renormalised
MOE_SHAPE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                 norm_topk_prob=True)


def transformers_model(arch: str = "llama", rope: dict | None = None, seed: int = 0,
                       expert_type: Q | None = None):
    """A random float32 transformers `LlamaForCausalLM` (with `rope` as its rope parameters),
    `Qwen3ForCausalLM` (`arch` "qwen3"), `Qwen3MoeForCausalLM` ("qwen3_moe", `MOE_SHAPE`) or
    `Phi3ForCausalLM` ("phi3"; "phi3-window": with a window of `PHI3_WINDOW`) of `HF_SHAPE`,
    every weight a bf16 value (so that a bf16 file holds exactly the reference's weights),
    large enough that its next tokens are rarely near-ties. With `expert_type`, the experts'
    weights as a file of that type holds them."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    rope = rope or {"rope_type": "default", "rope_theta": 10000.0}
    if arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**HF_SHAPE, rope_parameters=rope))
    elif arch.startswith("phi3"):
        window = PHI3_WINDOW if arch == "phi3-window" else None
        original = rope.get("original_max_position_embeddings")  # (Phi3Config's own key)
        model = Phi3ForCausalLM(Phi3Config(**HF_SHAPE, rope_parameters=rope,
                                           sliding_window=window, **(
                                               {"original_max_position_embeddings": original}
                                               if original else {})))
    elif arch == "qwen3_moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**HF_SHAPE, **MOE_SHAPE,
                                                   rope_parameters=rope))
    else:
        model = LlamaForCausalLM(LlamaConfig(**HF_SHAPE, rope_parameters=rope))

    def stored(name: str, value: torch.Tensor) -> torch.Tensor:
        if expert_type is None or ".experts." not in name:
            return value
        return torch.from_numpy(as_stored(expert_type, value.reshape(
            -1, value.shape[-1]).numpy()).reshape(value.shape))

    return randomized(model, seed, stored)


def randomized(model, seed: int, stored=None):
    """`model` with every weight random and a bf16 value (norms 1 + 0.1 noise, the token
    embedding noise, the LM head 0.3 noise, the rest 0.08 noise), large enough that its next
    tokens are rarely near-ties; `stored(name, value)`: the value as a file holds it (quantized
    experts)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            if name.endswith("norm.weight"):
                value = 1.0 + 0.1 * noise
            else:
                value = noise * {"model.embed_tokens.weight": 1.0,
                                 "lm_head.weight": 0.3}.get(name, 0.08)
            value = value.to(torch.bfloat16).float()
            parameter.copy_(stored(name, value) if stored else value)
    return model.eval()


def save_transformers_folder(model, folder: Path) -> Path:
    """`model` saved as a folder with the default model's tokenizer (what the converter reads)."""
    import shutil

    model.save_pretrained(folder)
    source = ensure_default_model(quiet=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, folder / name)
    return folder


def llama_cpp_converter() -> Path | None:
    """llama.cpp's `convert_hf_to_gguf.py`, where benchmarks/peers/ installed its sources and
    the sentencepiece package it imports for a Llama folder's vocabulary (as convert_gguf in
    benchmarks/peers/llama_cpp_tools.sh installs it)."""
    import importlib.util
    import os

    if importlib.util.find_spec("sentencepiece") is None:
        return None
    peers = Path(os.environ.get("PEERS", Path.home() / ".cache/dresd/peers"))
    found = sorted(peers.glob("llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py"))
    return found[-1] if found else None


# Runs the converter with its BPE pre-tokenizer check answering "smollm" whatever the hash: for
# a class that refuses the test folders' tokenizer (Qwen3.5-MoE's), a vocabulary matter that
# changes no tensor.
ANY_PRE_TOKENIZER = """
import runpy, sys
converter = sys.argv[1]
sys.path[:0] = [str(__import__("pathlib").Path(converter).parent)]
import conversion.base as base
for value in vars(base).values():
    if isinstance(value, type) and hasattr(value, "get_vocab_base_pre"):
        value.get_vocab_base_pre = lambda self, tokenizer: "smollm"
sys.argv = sys.argv[1:]
runpy.run_path(converter, run_name="__main__")
"""


def convert_with_llama_cpp(folder: Path, path: Path, *options: str,
                           any_pre_tokenizer: bool = False) -> Path:
    """The folder as a bf16 GGUF file, by llama.cpp's own converter (it imports its own
    gguf-py; nothing is built); `options`: more of its command-line options."""
    import subprocess
    import sys

    launcher = ["-c", ANY_PRE_TOKENIZER] if any_pre_tokenizer else []
    subprocess.run([sys.executable, *launcher, str(llama_cpp_converter()), str(folder),
                    "--outtype", "bf16", "--outfile", str(path), *options], check=True,
                   capture_output=True)
    return path


def convert_phi3_with_llama_cpp(model, folder: Path) -> Path:
    """A Phi-3 model (`transformers_model("phi3", ...)`) saved in `folder` and converted by
    llama.cpp's own converter to `folder/converted.gguf`; its tokenizer class GPT-2's, as
    Phi-4's (else the converter asks for a sentencepiece tokenizer.model)."""
    import json

    save_transformers_folder(model, folder / "model")
    config_file = folder / "model" / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = "GPT2Tokenizer"
    config_file.write_text(json.dumps(config))
    return convert_with_llama_cpp(folder / "model", folder / "converted.gguf")


def llama3_rope_factors(rope: dict, head_dim: int) -> np.ndarray:
    """rope_freqs.weight as llama.cpp's converter computes it (`LlamaModel.
    generate_extra_tensors`): per rotated pair, 1 for short wavelengths, `factor` for long
    ones, and between them 1 / ((1 - smooth) / factor + smooth); in float32 torch scalars as
    there, so the bits are the converter's."""
    base, factor = rope["rope_theta"], rope["factor"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    old_context = rope["original_max_position_embeddings"]
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factors = []
    for freq in freqs:  # 0-d float32 tensors
        wavelength = 2 * np.pi / freq
        if wavelength < old_context / high:
            factors.append(1)
        elif wavelength > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32).numpy()


def llama_cpp_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """The converter's q/k row permutation of a Llama file (`LlamaModel.permute`)."""
    return (weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def add_converted_metadata(writer: gguf.GGUFWriter, config, extra_blocks: int = 0) -> None:
    """The keys llama.cpp's converter writes for every text model (`TextModel.
    set_gguf_parameters`), from a transformers config, in its order (`extra_blocks`: MTP
    blocks, counted in block_count)."""
    writer.add_name("tiny converted model")
    writer.add_block_count(config.num_hidden_layers + extra_blocks)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    if getattr(config, "intermediate_size", None) is not None:  # none in Qwen3.5-MoE's
        writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)


def add_phi3_metadata(writer: gguf.GGUFWriter, config) -> None:
    """The keys llama.cpp's converter writes for a Phi-3 model (`Phi3MiniModel.
    set_gguf_parameters`), in its order: a window of 0 where the config has none (Phi-4); and
    LongRoPE's (`generate_extra_tensors`): the attention factor, the factors as two tensors."""
    writer.add_name("tiny converted model")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_rope_scaling_orig_ctx_len(config.rope_parameters.get(
        "original_max_position_embeddings", config.max_position_embeddings))
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(int(config.rope_parameters.get(
        "partial_rotary_factor", 1.0) * config.hidden_size) // config.num_attention_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    writer.add_sliding_window(config.sliding_window or 0)
    rope = config.rope_parameters
    if rope.get("rope_type") == "longrope":
        scale = config.max_position_embeddings / rope["original_max_position_embeddings"]
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(
            rope["original_max_position_embeddings"])) if scale > 1.0 else 1.0)
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
        writer.add_tensor("rope_factors_short.weight",
                          np.array(rope["short_factor"], np.float32))


# transformers' names of the tensors outside the layers -> llama.cpp's
TOP_TENSORS = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
               "model.norm.weight": "output_norm.weight"}


def convert_like_llama_cpp(model, path: Path, expert_type: Q = Q.BF16,
                           metadata: dict | None = None,
                           extra_tensors: dict[str, np.ndarray] | None = None,
                           linear_type: Q = Q.BF16) -> Path:
    """`model` (from `transformers_model`) as the bf16 GGUF file llama.cpp's converter writes
    from its folder: its metadata, 2D weights in BF16, norms and rope_freqs in F32, a Llama
    file's q and k rows permuted, Llama 3 scaling as rope_freqs.weight, linear and YaRN scaling
    as `rope.scaling.*` metadata (`TextModel.set_gguf_parameters`). A Qwen3-MoE model's experts
    as `Qwen3MoeModel` writes them: the router `ffn_gate_inp` in F32, each of gate, up and down
    one 3-D tensor of every expert (in `expert_type`), the expert count, used count and size.
    `metadata`: keys (without the architecture) written instead of the model's, and
    `extra_tensors` (float32), for the tests of files that lie or that dresd refuses;
    `linear_type`: the layers' 2-D weights quantized to it (as llama-quantize would)."""
    config = model.config
    arch = {"qwen3_moe": "qwen3moe"}.get(config.model_type, config.model_type)
    rope = config.rope_parameters
    writer = gguf.GGUFWriter(str(path), arch)
    if arch == "qwen3moe":
        moe = {"expert_count": config.num_experts, "expert_used_count": config.num_experts_per_tok,
               "expert_feed_forward_length": config.moe_intermediate_size, **(metadata or {})}
        for key, value in moe.items():
            writer.add_uint32(f"{arch}.{key}", value)
    if arch == "phi3":  # Phi3MiniModel writes its own keys, not TextModel's
        add_phi3_metadata(writer, config)
    else:
        add_converted_metadata(writer, config)
    if arch == "llama":
        writer.add_vocab_size(config.vocab_size)
        writer.add_rope_dimension_count(config.head_dim)
    if rope["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    elif rope["rope_type"] == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    elif rope["rope_type"] == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(rope, config.head_dim))
    add_default_tokenizer(writer)
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    for name, value in model.state_dict().items():
        weights = value.float().numpy()
        if ".mlp." in name and arch == "qwen3moe":
            _add_experts(writer, name, weights, expert_type)
            continue
        if name in TOP_TENSORS:
            gguf_name = TOP_TENSORS[name]
        else:
            _, _, index, rest = name.split(".", 3)
            part = rest.removesuffix(".weight")
            gguf_name = f"blk.{index}.{LLAMA_LAYER_TENSORS[part]}.weight"
            projection = part.split(".")[-1]
            if arch == "llama" and projection in heads:
                weights = llama_cpp_permute(weights, heads[projection])
        if weights.ndim == 1:
            writer.add_tensor(gguf_name, weights.astype(np.float32))
        else:
            qtype = linear_type if gguf_name.startswith("blk.") else Q.BF16
            data = gguf.quants.quantize(weights, qtype)
            writer.add_tensor(gguf_name, data, raw_shape=data.shape, raw_dtype=qtype)
    for name, values in (extra_tensors or {}).items():
        writer.add_tensor(name, values.astype(np.float32))
    return _finish(writer, path)


def _add_experts(writer: gguf.GGUFWriter, name: str, weights: np.ndarray, qtype: Q) -> None:
    """A Qwen3-MoE layer's router or experts under llama.cpp's names (`Qwen2MoeModel.
    modify_tensors`: gate_up_proj [experts, 2 ffn, hidden] split into gate and up)."""
    blk = "blk." + name.split(".")[2] + "."
    if name.endswith("mlp.gate.weight"):  # the router: always F32 (the converter forces it)
        writer.add_tensor(blk + "ffn_gate_inp.weight", weights.astype(np.float32))
        return
    if name.endswith("gate_up_proj"):
        ffn = weights.shape[1] // 2
        parts = {"ffn_gate_exps": weights[:, :ffn], "ffn_up_exps": weights[:, ffn:]}
    else:
        parts = {"ffn_down_exps": weights}
    for gguf_name, part in parts.items():
        part = np.ascontiguousarray(part)
        data = gguf.quants.quantize(part.reshape(-1, part.shape[-1]), qtype)
        data = data.reshape(*part.shape[:-1], -1)
        writer.add_tensor(blk + gguf_name + ".weight", data, raw_shape=data.shape,
                          raw_dtype=qtype)


# --- Qwen3.5 (qwen35) ---------------------------------------------------------------------
# a tiny Qwen3.5 text model: three Gated DeltaNet layers, then one full-attention layer;
# twice as many value heads as key heads, so that the converter's value-head reorder matters
QWEN35_SHAPE = dict(vocab_size=49152, hidden_size=128, intermediate_size=256,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                    linear_value_head_dim=32, linear_conv_kernel_dim=4,
                    max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
                    layer_types=["linear_attention"] * 3 + ["full_attention"],
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                     "partial_rotary_factor": 0.25})
# transformers' names in a Qwen3.5 layer -> llama.cpp's (the converter's tensor map for qwen35)
QWEN35_LAYER_TENSORS = {
    **LAYER_TENSORS, "post_attention_layernorm": "post_attention_norm",
    "linear_attn.in_proj_qkv": "attn_qkv", "linear_attn.in_proj_z": "attn_gate",
    "linear_attn.in_proj_b": "ssm_beta", "linear_attn.in_proj_a": "ssm_alpha",
    "linear_attn.out_proj": "ssm_out", "linear_attn.norm": "ssm_norm",
    "linear_attn.conv1d": "ssm_conv1d", "linear_attn.A_log": "ssm_a",
    "linear_attn.dt_bias": "ssm_dt",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}


# Qwen3.5-MoE's MLP instead of the dense one: routed experts and a gated shared expert
QWEN35_MOE_SHAPE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                        shared_expert_intermediate_size=96)


def qwen35_model(seed: int = 0, moe: bool = False, **sizes):
    """A random float32 `Qwen3_5ForCausalLM` of `QWEN35_SHAPE` (`sizes` replacing some; with
    `moe`, a `Qwen3_5MoeForCausalLM` with `QWEN35_MOE_SHAPE`'s experts), every weight a bf16
    value: norms near zero (the model multiplies by 1 + weight), decays and step sizes
    spread."""
    from transformers import (
        Qwen3_5ForCausalLM,
        Qwen3_5MoeForCausalLM,
        Qwen3_5MoeTextConfig,
        Qwen3_5TextConfig,
    )

    shape = {**QWEN35_SHAPE, **sizes}
    layers = len(shape["layer_types"])
    if moe:
        shape.pop("intermediate_size")
        model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(num_hidden_layers=layers, **shape,
                                                           **QWEN35_MOE_SHAPE))
    else:
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(num_hidden_layers=layers, **shape))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            if name.endswith("linear_attn.norm.weight"):
                value = 1.0 + 0.1 * noise
            elif name.endswith(("norm.weight", "dt_bias")):
                value = 0.1 * noise
            elif name.endswith("A_log"):
                value = noise.clamp(-2, 2)
            else:
                value = noise * {"model.embed_tokens.weight": 1.0, "lm_head.weight": 0.3,
                                 }.get(name, 0.3 if "conv1d" in name else 0.08)
            parameter.copy_(value.to(torch.bfloat16).float())
    return model.eval()


def _tiled_value_heads(weights: np.ndarray, config, size: int, axis: int = 0) -> np.ndarray:
    """The converter's reorder of value heads from grouped (head g * r + j) to tiled
    (j * nk + g) along `axis`, `size` entries a head (`_LinearAttentionVReorderBase`)."""
    key_heads, value_heads = config.linear_num_key_heads, config.linear_num_value_heads
    if key_heads == value_heads:
        return weights
    moved = np.moveaxis(weights, axis, 0)
    shape = moved.shape
    moved = moved.reshape(key_heads, value_heads // key_heads, size, *shape[1:])
    return np.moveaxis(moved.swapaxes(0, 1).reshape(shape), 0, axis)


def qwen35_mtp_weights(model, seed: int = 1) -> dict[str, torch.Tensor]:
    """Random weights of a Qwen3.5 MTP block for `model`, under the names a Qwen3.5
    checkpoint gives them (`mtp.*`): a full-attention layer (another random model's), the
    [embedding, state] projection `fc` and the norms, each a bf16 value."""
    other = qwen35_model(seed=seed, moe=hasattr(model.model.layers[0].mlp, "experts"))
    full = model.config.layer_types.index("full_attention")
    weights = {f"mtp.layers.0.{name}": value for name, value in
               other.model.layers[full].state_dict().items()}
    generator = torch.Generator().manual_seed(seed)
    hidden = model.config.hidden_size
    weights["mtp.fc.weight"] = (0.08 * torch.randn(hidden, 2 * hidden, generator=generator))
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        weights[f"mtp.{name}.weight"] = 0.1 * torch.randn(hidden, generator=generator)
    return {name: value.to(torch.bfloat16).float() for name, value in weights.items()}


# an MTP block's own tensors: a checkpoint's name -> llama.cpp's, after `blk.{layers}.`
# (`_QwenMtpMixin.filter_tensors`' remap, then the tensor map)
QWEN35_MTP_TENSORS = {"mtp.fc.weight": "nextn.eh_proj.weight",
                      "mtp.pre_fc_norm_embedding.weight": "nextn.enorm.weight",
                      "mtp.pre_fc_norm_hidden.weight": "nextn.hnorm.weight",
                      "mtp.norm.weight": "nextn.shared_head_norm.weight"}


def convert_qwen35_like_llama_cpp(model, path: Path, linear_type: Q = Q.BF16,
                                  mtp: dict[str, torch.Tensor] | None = None) -> Path:
    """`model` (from `qwen35_model`) as llama.cpp's converter writes its folder with
    `--no-mtp`, or with `mtp` (`qwen35_mtp_weights`) as it writes a checkpoint that has an MTP
    block: one more block after the model's layers (`nextn_predict_layers` 1), the block's
    layer under that index, its own tensors as `QWEN35_MTP_TENSORS` names them
    (`Qwen3_5TextModel`, `Qwen3NextModel.modify_tensors`): norms plus one but the
    Gated DeltaNet's own, ssm_a = -exp(A_log), the convolution squeezed, value heads tiled,
    2-D weights in `linear_type` (the converter's bf16; another type quantized from them). A
    Qwen3.5-MoE model as `Qwen3_5MoeTextModel` writes it: the router and the shared expert's
    gate in F32, the routed experts as `_add_experts` writes Qwen3-MoE's, the shared expert's
    projections as `ffn_*_shexp`, the expert counts and sizes."""
    config = model.config
    key_dim = config.linear_num_key_heads * config.linear_key_head_dim
    value_size = config.linear_value_head_dim
    arch = "qwen35moe" if config.model_type == "qwen3_5_moe_text" else "qwen35"
    writer = gguf.GGUFWriter(str(path), arch)
    add_converted_metadata(writer, config, 1 if mtp else 0)
    if mtp:
        writer.add_nextn_predict_layers(1)
    if arch == "qwen35moe":  # `Qwen2MoeModel.set_gguf_parameters`
        for key, value in {"expert_count": config.num_experts,
                           "expert_used_count": config.num_experts_per_tok,
                           "expert_feed_forward_length": config.moe_intermediate_size,
                           "expert_shared_feed_forward_length":
                               config.shared_expert_intermediate_size}.items():
            writer.add_uint32(f"{arch}.{key}", value)
    writer.add_ssm_conv_kernel(config.linear_conv_kernel_dim)
    writer.add_ssm_state_size(config.linear_key_head_dim)
    writer.add_ssm_group_count(config.linear_num_key_heads)
    writer.add_ssm_time_step_rank(config.linear_num_value_heads)
    writer.add_ssm_inner_size(value_size * config.linear_num_value_heads)
    writer.add_array(f"{arch}.attention.recurrent_layers",  # (gguf 0.19 has no adder for it)
                     [kind == "linear_attention" for kind in config.layer_types])
    writer.add_full_attention_interval(4)
    writer.add_rope_dimension_count(int(config.head_dim
                                        * config.rope_parameters["partial_rotary_factor"]))
    writer.add_rope_dimension_sections([11, 11, 10, 0])
    add_default_tokenizer(writer)
    rng = np.random.default_rng(0)
    layers = config.num_hidden_layers
    tensors = dict(model.state_dict())
    for name, value in (mtp or {}).items():  # the block's layer: one more layer index
        tensors[name.replace("mtp.layers.0.", f"model.layers.{layers}.")] = value
    for name, value in tensors.items():
        weights = value.float().numpy()
        if ".mlp.gate." in name or ".mlp.experts." in name:  # the router, the routed experts
            _add_experts(writer, name, weights, linear_type)
            continue
        if name in QWEN35_MTP_TENSORS:
            gguf_name = f"blk.{layers}.{QWEN35_MTP_TENSORS[name]}"
        elif name in TOP_TENSORS:
            gguf_name = TOP_TENSORS[name]
        else:
            _, _, index, rest = name.split(".", 3)
            part = rest.removesuffix(".weight")
            suffix = "" if part.endswith("A_log") else ".bias" if part.endswith("dt_bias") \
                else ".weight"
            gguf_name = f"blk.{index}.{QWEN35_LAYER_TENSORS[part]}{suffix}"
            if part.endswith("A_log"):  # in torch's float32 exp, as the converter's
                weights = (-torch.exp(torch.from_numpy(weights))).numpy()
            if "conv1d" in part:
                weights = weights.reshape(weights.shape[0], -1)
            if part.endswith(("in_proj_qkv", "conv1d")):  # the value rows only
                weights = np.concatenate([weights[:2 * key_dim], _tiled_value_heads(
                    weights[2 * key_dim:], config, value_size)])
            elif part.endswith("in_proj_z"):
                weights = _tiled_value_heads(weights, config, value_size)
            elif part.endswith(("in_proj_b", "in_proj_a", "A_log", "dt_bias")):
                weights = _tiled_value_heads(weights, config, 1)
            elif part.endswith("out_proj"):
                weights = _tiled_value_heads(weights, config, value_size, axis=1)
        if gguf_name.endswith("norm.weight") and "ssm_norm" not in gguf_name:  # as it checks
            weights = weights + 1
        if weights.ndim == 1 or "conv1d" in name or "shared_expert_gate" in name:
            writer.add_tensor(gguf_name, np.ascontiguousarray(weights, dtype=np.float32))
        else:
            data = tensor_bytes(linear_type, np.ascontiguousarray(weights), rng)
            writer.add_tensor(gguf_name, data, raw_shape=data.shape, raw_dtype=linear_type)
    return _finish(writer, path)


# --- gpt-oss ------------------------------------------------------------------------------
# A tiny gpt-oss: two layers (the first windowed), 8 experts of 64, 2 used per token; its
# window and YaRN's original context cut short (20 and 32 tokens), so that a test's 64
# positions run past both; a learned sink per head; biases everywhere gpt-oss has them
GPT_OSS_WINDOW = 20
GPT_OSS_SHAPE = dict(vocab_size=49152, hidden_size=128, intermediate_size=64,
                     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                     head_dim=64, max_position_embeddings=256, rms_norm_eps=1e-5,
                     tie_word_embeddings=False, num_local_experts=8, num_experts_per_tok=2,
                     sliding_window=GPT_OSS_WINDOW, attention_bias=True,
                     rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0,
                                      "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                      "truncate": False,
                                      "original_max_position_embeddings": 32})
GPT_OSS_LAYER_TENSORS = {
    **LAYER_TENSORS, "post_attention_layernorm": "post_attention_norm",
    "self_attn.sinks": "attn_sinks", "mlp.router": "ffn_gate_inp",
}


def gpt_oss_model(seed: int = 0, expert_type: Q | None = None):
    """A random float32 `GptOssForCausalLM` of `GPT_OSS_SHAPE`, every weight a bf16 value (so
    that a bf16 file holds the reference's weights exactly); with `expert_type`, the experts'
    weights as a file of that type holds them (each quantized along its inputs, as the file's
    rows run)."""
    from transformers import GptOssConfig, GptOssForCausalLM

    def stored(name: str, value: torch.Tensor) -> torch.Tensor:
        if expert_type is None or not name.endswith(("gate_up_proj", "down_proj")):
            return value
        rows = value.transpose(1, 2)  # [experts, outputs, inputs]
        values = as_stored(expert_type, rows.reshape(-1, rows.shape[-1]).numpy())
        return torch.from_numpy(values).reshape(rows.shape).transpose(1, 2)

    return randomized(GptOssForCausalLM(GptOssConfig(**GPT_OSS_SHAPE)), seed, stored)


def convert_gpt_oss_like_llama_cpp(model, path: Path, expert_type: Q = Q.BF16,
                                   embedding_type: Q = Q.BF16) -> Path:
    """A `gpt_oss_model` as the GGUF file llama.cpp's converter writes from its folder
    (`conversion/gpt_oss.py`), its experts then quantized to `expert_type` and its embedding
    and output head to `embedding_type` as llama-quantize would: TextModel's keys, the window,
    the expert count, used count and size, YaRN's factor, original context and betas; 2-D
    weights in BF16, norms, biases, sinks and the router in F32; each expert tensor transposed
    to [experts, outputs, inputs], gate_up's interleaved rows split into gate (even) and up
    (odd), their biases alike."""
    config = model.config
    arch = "gpt-oss"
    writer = gguf.GGUFWriter(str(path), arch)
    add_converted_metadata(writer, config)
    rope = config.rope_parameters
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    writer.add_expert_count(config.num_local_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_sliding_window(config.sliding_window)
    writer.add_expert_feed_forward_length(config.intermediate_size)
    add_default_tokenizer(writer)
    for name, value in model.state_dict().items():
        weights = value.float().numpy()
        if name in TOP_TENSORS:
            gguf_name = TOP_TENSORS[name]
        else:
            _, _, index, rest = name.split(".", 3)
            blk = f"blk.{index}."
            if rest.startswith("mlp.experts."):
                _add_gpt_oss_experts(writer, blk, rest.removeprefix("mlp.experts."), weights,
                                     expert_type)
                continue
            part, kind = rest.rsplit(".", 1) if rest != "self_attn.sinks" else (rest, "weight")
            gguf_name = f"{blk}{GPT_OSS_LAYER_TENSORS[part]}.{kind}"
        if weights.ndim == 1 or gguf_name.endswith("ffn_gate_inp.weight"):  # the router: F32,
            writer.add_tensor(gguf_name, weights.astype(np.float32))       # as the converter
        else:
            qtype = embedding_type if name in TOP_TENSORS else Q.BF16
            data = gguf.quants.quantize(weights, qtype)
            writer.add_tensor(gguf_name, data, raw_shape=data.shape, raw_dtype=qtype)
    return _finish(writer, path)


def _add_gpt_oss_experts(writer: gguf.GGUFWriter, blk: str, name: str, weights: np.ndarray,
                         qtype: Q) -> None:
    """One of a gpt-oss layer's expert tensors under llama.cpp's names (`GptOssModel.
    modify_tensors`)."""
    if name.endswith("_bias"):  # [experts, outputs]
        parts = ({"ffn_gate_exps": weights[:, ::2], "ffn_up_exps": weights[:, 1::2]}
                 if name.startswith("gate_up") else {"ffn_down_exps": weights})
        for gguf_name, part in parts.items():
            writer.add_tensor(f"{blk}{gguf_name}.bias", np.ascontiguousarray(part, np.float32))
        return
    rows = weights.transpose(0, 2, 1)  # [experts, outputs, inputs]
    parts = ({"ffn_gate_exps": rows[:, ::2], "ffn_up_exps": rows[:, 1::2]}
             if name.startswith("gate_up") else {"ffn_down_exps": rows})
    for gguf_name, part in parts.items():
        part = np.ascontiguousarray(part)
        data = gguf.quants.quantize(part.reshape(-1, part.shape[-1]), qtype)
        data = data.reshape(*part.shape[:-1], -1)
        writer.add_tensor(f"{blk}{gguf_name}.weight", data, raw_shape=data.shape,
                          raw_dtype=qtype)
