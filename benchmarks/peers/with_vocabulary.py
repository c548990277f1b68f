"""A GGUF file's tensors under another file's tokenizer: a random-weight shape (model_shapes.py,
which writes the default model's 49k vocabulary padded to the model's size) with its model's
real vocabulary, e.g. Llama-3.2's 128,256 tokens and 280,147 merges from llama.cpp's
`models/ggml-vocab-llama-bpe.gguf`. Every `tokenizer.*` key is the vocabulary file's (the
chat template stays the shape's where the vocabulary file has none); every other key and every
tensor is the shape's, byte for byte. The two must have the same number of tokens.

    python benchmarks/peers/with_vocabulary.py SHAPE.gguf VOCAB.gguf OUT.gguf
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf


def copy_field(writer: gguf.GGUFWriter, field) -> None:
    kind = field.types[0]
    sub = field.types[1] if kind == gguf.GGUFValueType.ARRAY else None
    writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", type=Path)
    parser.add_argument("vocabulary", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    shape, vocabulary = gguf.GGUFReader(args.shape), gguf.GGUFReader(args.vocabulary)
    tokens = "tokenizer.ggml.tokens"
    if len(shape.fields[tokens].data) != len(vocabulary.fields[tokens].data):
        raise SystemExit(f"{args.shape} has {len(shape.fields[tokens].data)} tokens, "
                         f"{args.vocabulary} {len(vocabulary.fields[tokens].data)}")
    architecture = shape.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(args.out, architecture)
    for name, field in shape.fields.items():
        keep = not name.startswith("tokenizer.") or (
            name == "tokenizer.chat_template" and name not in vocabulary.fields)
        if keep and not name.startswith("GGUF.") and name != "general.architecture":
            copy_field(writer, field)
    for name, field in vocabulary.fields.items():
        if name.startswith("tokenizer."):
            copy_field(writer, field)
    for tensor in shape.tensors:
        writer.add_tensor_info(tensor.name, tensor.data.shape, tensor.data.dtype,
                               tensor.data.nbytes, tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in shape.tensors:
        writer.write_tensor_data(tensor.data)
    writer.close()


if __name__ == "__main__":
    main()
