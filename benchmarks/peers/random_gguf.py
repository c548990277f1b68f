"""A GGUF file of random weights in a real model's shape, for timing (speed does not depend on
the values): Llama-3.2-1B's or -3B's config, the default model's tokenizer, F16 weights that
llama.cpp's own `llama-quantize` then quantizes (gguf_shapes.sh).

    PYTHONPATH=src:tests python benchmarks/peers/random_gguf.py 1b OUT.gguf
"""

from __future__ import annotations

import argparse
from pathlib import Path

from gguf_files import LLAMA_32_1B, LLAMA_32_3B, Q, write_tiny_gguf

SHAPES = {"1b": LLAMA_32_1B, "3b": LLAMA_32_3B}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    write_tiny_gguf(args.out, Q.F16, embedding_type=Q.F16, shape=SHAPES[args.shape])


if __name__ == "__main__":
    main()
