"""What a draft tree costs to verify over Qwen3.5's Gated DeltaNet layers (decoding/recurrent.py),
beside the same shape with full attention only on dresd's C decoder.

A random-weight model of the shape below (chosen here: about Qwen3.5's small size, with the
default model's 49k vocabulary so that its tokenizer serves; not a published config) is
written as a transformers folder and loaded as dresd loads any folder (bf16, its row-invariant
linears). For each model: the one-token step in ms and the verify cost curve, cost(t) = one
forward over a tree of t nodes / the one-token step, from `calibrate.measure_verify_cost`
(paired ratios, sizes shuffled per repetition): the curve dresd's budget prices trees with.

    PYTHONPATH=src .venv/bin/python benchmarks/micro/recurrent_verify.py [--threads 1]

Results: benchmarks/results/recurrent/verify_cost.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Qwen3_5TextConfig

from dresd.calibrate import measure_verify_cost
from dresd.host import native_bf16_flags
from dresd.models.target import default_model_dir, load_target

SIZES = (1, 2, 4, 8, 16)
SHAPE = dict(hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
             num_attention_heads=8, num_key_value_heads=2, head_dim=256)
LINEAR = dict(linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
              linear_value_head_dim=128, linear_conv_kernel_dim=4)
OUT = Path("benchmarks/results/recurrent")


def write(folder: Path, config, tokenizer) -> str:
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    vocab = len(tokenizer)
    models = {
        "qwen3.5 shape (18 Gated DeltaNet + 6 full attention)":
            Qwen3_5TextConfig(vocab_size=vocab, **SHAPE, **LINEAR),
        "the same shape, full attention only (Llama layers, C decoder)":
            LlamaConfig(vocab_size=vocab, **SHAPE),
    }
    rows = {}
    with tempfile.TemporaryDirectory() as scratch:
        for index, (name, config) in enumerate(models.items()):
            folder = write(Path(scratch) / str(index), config, tokenizer)
            target = load_target(folder, dtype="bfloat16")
            cost, step = measure_verify_cost(target.model, sizes=SIZES, repeats=args.repeats)
            rows[name] = {"step_ms": step * 1e3, "cost": cost, "linears": target.linears}
            print(name, f"{step * 1e3:.1f} ms", {t: round(c, 2) for t, c in cost.items()})
            del target
    OUT.mkdir(parents=True, exist_ok=True)
    meta = {"cpu": platform.processor() or platform.machine(), "threads": args.threads,
            "bf16_flags": native_bf16_flags(), "sizes": SIZES, "shape": SHAPE | LINEAR,
            "vocab": vocab}
    (OUT / "verify_cost.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = ["| model | linears | one-token step | " + " | ".join(f"cost({t})" for t in SIZES)
             + " |", "| --- | --- | ---: | " + " | ".join("---:" for _ in SIZES) + " |"]
    for name, row in rows.items():
        lines.append(f"| {name} | {row['linears']} | {row['step_ms']:.1f} ms | "
                     + " | ".join(f"{row['cost'][t]:.2f}" for t in SIZES) + " |")
    (OUT / "verify_cost.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
