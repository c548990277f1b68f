"""A GGUF file of random weights in a real model's shape, for timing (speed does not depend on
the values): Llama-3.2-1B's or -3B's config, the default model's tokenizer, F16 weights that
llama.cpp's own `llama-quantize` then quantizes (gguf_shapes.sh); or Gemma-3-1B's (`gemma3-1b`:
26 layers, window 512, every 6th layer global; the default model's tokenizer in place of its
262k vocabulary) written in `--type` directly (Q4_0 through the `gguf` package's quantizer,
K-quants as random blocks), its tied embedding in `--embedding-type`.

    PYTHONPATH=src:tests python benchmarks/peers/random_gguf.py 1b OUT.gguf
    PYTHONPATH=src:tests python benchmarks/peers/random_gguf.py gemma3-1b OUT.gguf --type Q4_0
"""

from __future__ import annotations

import argparse
from pathlib import Path

from gguf_files import GEMMA3_1B, LLAMA_32_1B, LLAMA_32_3B, Q, write_tiny_gguf

SHAPES = {"1b": LLAMA_32_1B, "3b": LLAMA_32_3B, "gemma3-1b": GEMMA3_1B}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("out", type=Path)
    parser.add_argument("--type", default="F16", help="gemma3-1b: the linears' type")
    parser.add_argument("--embedding-type", default="Q8_0", help="gemma3-1b: the embedding's")
    args = parser.parse_args()
    if args.shape == "gemma3-1b":
        write_tiny_gguf(args.out, Q[args.type], embedding_type=Q[args.embedding_type],
                        arch="gemma3", shape=GEMMA3_1B)
        return
    write_tiny_gguf(args.out, Q.F16, embedding_type=Q.F16, shape=SHAPES[args.shape])


if __name__ == "__main__":
    main()
