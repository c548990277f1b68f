"""Qwen3-30B-A3B's layer shape on dresd's C decoder and experts (kernels/experts.c): plain
decoding's tokens/s and the verify-cost curve, on a GGUF file of random weights (speed does not
depend on the values; the routing of random weights spreads rows over the experts about
uniformly, as distinct real tokens mostly do).

Shape (Qwen3-30B-A3B's config): hidden 2048, 32 query heads and 4 key-value heads of 128, 128
experts of hidden size 768, 8 used per token, renormalised; the vocabulary's 151,936 rows
(embedding and LM head); `--layers` of its 48 layers (RAM: each layer's experts are ~340 MB in
Q4_K). Experts, attention and embedding in Q4_K, the LM head in Q6_K (as a Q4_K_M file's).

    PYTHONPATH=src:tests python benchmarks/qwen3moe_speed.py --layers 8 --out results/qwen3moe

`--dense` measures the same on Llama-3.2-3B's dense shape instead (28 layers, Q4_K, its LM head
in Q4_K over the default tokenizer's 49,152 rows): about Qwen3-30B-A3B's active parameters per
token, so its curve is what the MoE's would be if every row read the same weights.

Writes `speed.json` there (`speed-dense-3b.json` with `--dense`): ar tokens/s (1 thread), the
forward seconds for 1, 2, 4, 8, 16 and 32 rows of a tree on a warm cache, and the experts
those rows reach.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf_files import LLAMA_32_3B, Q, add_default_tokenizer, random_blocks, write_tiny_gguf

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 2048, 32, 4, 128
EXPERTS, USED, EXPERT_FFN, VOCAB, LAYERS = 128, 8, 768, 151936, 48
SIZES = (1, 2, 4, 8, 16, 32)


def write_file(path: Path, layers: int, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    writer.add_name("random Qwen3-30B-A3B shape")
    writer.add_block_count(layers)
    writer.add_context_length(40960)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(6144)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(1e6)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_expert_count(EXPERTS)
    writer.add_expert_used_count(USED)
    writer.add_expert_feed_forward_length(EXPERT_FFN)
    add_default_tokenizer(writer)

    def blocks(name: str, qtype: Q, *shape: int) -> None:  # shape outer first, k last
        rows = int(np.prod(shape[:-1]))
        data = random_blocks(qtype, rows, shape[-1], rng).reshape(*shape[:-1], -1)
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)

    def norm(name: str, size: int) -> None:
        writer.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(size)).astype(np.float32))

    blocks("token_embd.weight", Q.Q4_K, VOCAB, HIDDEN)
    for i in range(layers):
        blk = f"blk.{i}."
        norm(blk + "attn_norm.weight", HIDDEN)
        norm(blk + "ffn_norm.weight", HIDDEN)
        norm(blk + "attn_q_norm.weight", HEAD_DIM)
        norm(blk + "attn_k_norm.weight", HEAD_DIM)
        blocks(blk + "attn_q.weight", Q.Q4_K, HEADS * HEAD_DIM, HIDDEN)
        blocks(blk + "attn_k.weight", Q.Q4_K, KV_HEADS * HEAD_DIM, HIDDEN)
        blocks(blk + "attn_v.weight", Q.Q4_K, KV_HEADS * HEAD_DIM, HIDDEN)
        blocks(blk + "attn_output.weight", Q.Q4_K, HIDDEN, HEADS * HEAD_DIM)
        writer.add_tensor(blk + "ffn_gate_inp.weight",
                          (0.05 * rng.standard_normal((EXPERTS, HIDDEN))).astype(np.float32))
        blocks(blk + "ffn_gate_exps.weight", Q.Q4_K, EXPERTS, EXPERT_FFN, HIDDEN)
        blocks(blk + "ffn_up_exps.weight", Q.Q4_K, EXPERTS, EXPERT_FFN, HIDDEN)
        blocks(blk + "ffn_down_exps.weight", Q.Q4_K, EXPERTS, HIDDEN, EXPERT_FFN)
    norm("output_norm.weight", HIDDEN)
    blocks("output.weight", Q.Q6_K, VOCAB, HIDDEN)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def experts_reached(model, rows: int, rng: np.random.Generator, samples: int = 20) -> float:
    """Mean distinct experts per layer that `rows` random tokens' rows reach (layer 0's router
    on their embedded, normed rows)."""
    layer = model.model.layers[0]
    counts = []
    for _ in range(samples):
        ids = torch.from_numpy(rng.integers(0, VOCAB, rows))
        x = layer.post_attention_layernorm(model.model.embed_tokens(ids))
        index, _ = layer.mlp.route(x)
        counts.append(len(set(index.flatten().tolist())))
    return float(np.mean(counts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/qwen3moe"))
    parser.add_argument("--file", type=Path, default=Path("/tmp/qwen3moe-30b-a3b-random.gguf"))
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dense", action="store_true", help="Llama-3.2-3B's shape instead")
    args = parser.parse_args()

    from dresd.calibrate import measure_verify_seconds
    from dresd.decoding import speculative_generate
    from dresd.decoding.forward import make_forward
    from dresd.drafters import NoDrafter
    from dresd.kernels.experts import MoEDecoder
    from dresd.models.target import load_target

    torch.set_num_threads(1)
    started = time.perf_counter()
    if not args.file.exists():
        if args.dense:
            write_tiny_gguf(args.file, Q.Q4_K, embedding_type=Q.Q4_K, tied=False,
                            shape=LLAMA_32_3B)
        else:
            write_file(args.file, args.layers)
    written = time.perf_counter() - started
    target = load_target(str(args.file))
    loaded = time.perf_counter() - started - written
    model = target.model
    decoder = make_forward(model).c_decoder
    assert decoder is not None and isinstance(decoder, MoEDecoder) != args.dense
    rng = np.random.default_rng(0)
    prompt = torch.from_numpy(rng.integers(0, 49152, 64))
    def generate_seconds(new: int) -> float:
        begin = time.perf_counter()
        out = speculative_generate(model, NoDrafter(), prompt, max_new_tokens=new)
        assert len(out.token_ids) == new
        return time.perf_counter() - begin

    generate_seconds(4)  # warm-up
    runs = []  # decoding tokens/s: the new tokens after the first, the prompt's prefill apart
    for _ in range(3):
        runs.append((args.new - 1) / (generate_seconds(args.new) - generate_seconds(1)))
    seconds = measure_verify_seconds(model, SIZES, context_len=128, repeats=args.repeats)
    reached = None if args.dense else {rows: experts_reached(model, rows, rng)
                                       for rows in SIZES}
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    cpu = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines()
                if line.startswith("Model name")), platform.processor())
    result = {
        "date": time.strftime("%Y-%m-%d"), "cpu": cpu, "threads": 1,
        "shape": "Llama-3.2-3B (dense)" if args.dense else "Qwen3-30B-A3B",
        "layers": model.config.num_hidden_layers,
        "file_bytes": args.file.stat().st_size, "write_s": round(written, 1),
        "load_s": round(loaded, 1),
        # plain decoding (ar) after a 64-token prompt, its prefill left out
        "ar_tokens_per_s_runs": [round(r, 3) for r in runs],
        "ar_tokens_per_s": round(float(np.median(runs)), 3),
        "prompt": 64, "new_tokens": args.new,
        "verify_seconds": {rows: round(s, 4) for rows, s in seconds.items()},
        "verify_cost": {rows: round(s / seconds[1], 3) for rows, s in seconds.items()},
        "experts_reached_per_layer": reached,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    name = "speed-dense-3b.json" if args.dense else "speed.json"
    (args.out / name).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
