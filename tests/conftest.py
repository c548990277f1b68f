"""Shared fixtures: tiny random models built from configs, and the default model."""

from __future__ import annotations

import os

# One OpenBLAS thread, set before NumPy loads it: on these shared 2-core machines OpenBLAS's own
# threads contend with PyTorch's, and the transform's eigh (576 x 576) took 4 s instead of 0.04.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from dresd.models import Target, load_target

TINY_VOCAB = 512

# One thread: on 2 cores under load, 2 PyTorch threads are often slower, and steadier is better.
torch.set_num_threads(1)


def tiny_model(arch: str = "llama", seed: int = 0) -> torch.nn.Module:
    """A 2-layer random model in float64: with float64, tree and one-token forwards agree to
    ~1e-15, so greedy ties cannot flip and any mismatch in a test is a real bug."""
    torch.manual_seed(seed)
    common = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=1024, eos_token_id=None, bos_token_id=None,
                  pad_token_id=0)
    config = LlamaConfig(**common) if arch == "llama" else Qwen2Config(**common)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float64).eval()


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny(request) -> torch.nn.Module:
    return tiny_model(request.param)


@pytest.fixture(scope="session")
def default_target() -> Target:
    """The default model in float32: token-identical to plain decoding, on any machine."""
    return load_target("default", dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def default_target_bf16() -> Target:
    """The default model in bfloat16 with prepacked weights, the fast CPU path."""
    return load_target("default", dtype="bfloat16", device="cpu")
