"""The models dresd runs, and how each is read into the C decoder's terms.

    spec.py       every architecture dresd runs, declared: its norms, activation, rope, heads,
                  experts, recurrent layers, and the names its GGUF file gives each tensor
    target.py     `load_target`: the default model, a transformers folder, a Hub id or a GGUF
                  file, as a `Target` (model, tokenizer, fingerprint)
    gguf_file.py  a GGUF file's header, read and checked; `dresd inspect`'s description
    gguf.py       a GGUF file as a model: its config and tensors read as llama.cpp reads them,
                  linears packed for dresd's quantized kernel
    fastpath.py   --dtype, oneDNN-packed linears and batch-invariant attention

Nothing is imported here, so that the decoding and kernel modules can read `spec` without
loading the loaders (which import them).
"""
