"""Fingerprints of a model and a tokenizer: what binds a datastore, a corpus of token ids or a
cached cost curve to the checkpoint that made it.

A leaf module (it imports no other dresd module): the model loader keeps a loaded target's
fingerprint on its `Target`, and the datastores, corpora and calibration compare them.
"""

from __future__ import annotations

import hashlib
import json

import torch
from transformers.tokenization_utils_base import PreTrainedTokenizerBase


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """sha256 of what decides the token ids: vocabulary, merges, added and special tokens.

    For fast tokenizers the whole serialized pipeline (normalizer, pre-tokenizer, model) is
    hashed, with the vocabulary sorted so that map order cannot change the hash.
    """
    digest = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        spec = json.loads(backend.to_str())
        model = spec.get("model", {})
        if isinstance(model.get("vocab"), dict):
            model["vocab"] = sorted(model["vocab"].items(), key=lambda kv: kv[1])
        digest.update(json.dumps(spec, sort_keys=True).encode())
    else:
        digest.update(json.dumps(sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]))
                      .encode())
    special = {name: str(value) for name, value in tokenizer.special_tokens_map.items()}
    digest.update(json.dumps(special, sort_keys=True).encode())
    return digest.hexdigest()


def model_fingerprint(model: torch.nn.Module) -> str:
    """sha256 of the model's shape and a few of its weights (embeddings, final layers).

    Hidden states depend on every weight; hashing all of them would cost seconds for big
    models, so the hash covers the config's shape fields and the weights that differ between
    any two distinct checkpoints in practice (first embedding rows, the last parameters).
    `load_target` takes it from the checkpoint's own weights before casting them to the
    run's dtype and keeps it as `Target.fingerprint`: a checkpoint has one fingerprint in every
    dtype.
    """
    digest = hashlib.sha256()
    config = model.config
    shape = {key: getattr(config, key, None) for key in
             ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "intermediate_size", "vocab_size")}
    digest.update(json.dumps(shape, sort_keys=True).encode())
    embeddings = model.get_input_embeddings().weight
    tensors = [embeddings[:64]] + [p for _, p in list(model.named_parameters())[-4:]]
    for tensor in tensors:
        digest.update(tensor.detach().to(torch.float32).flatten()[:65536].cpu().numpy().tobytes())
    return digest.hexdigest()
