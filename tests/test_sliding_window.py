"""Sliding-window models (Gemma-3's mix of windowed and full layers, and a window on every
layer) under speculation on transformers' forward, with sequences longer than the window:
rejected rows are cut back from a cache that keeps every entry, and a tree's windowed layers
see only the window, as transformers' own decoding does."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import TINY_VOCAB
from drafters_for_tests import OracleDrafter, RandomTreeDrafter
from test_lossless_greedy import reference_greedy, spec
from transformers import AutoModelForCausalLM, Gemma3TextConfig, MistralConfig

from dresd.calibrate import measure_verify_cost
from dresd.decoding.forward import HFForward, make_forward
from dresd.drafters import PromptLookupDrafter

WINDOW = 6


def gemma3(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = Gemma3TextConfig(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        max_position_embeddings=512, pad_token_id=0, eos_token_id=None, bos_token_id=None)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float64).eval()


def mistral_windowed(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = MistralConfig(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=WINDOW,
        max_position_embeddings=512, pad_token_id=0, eos_token_id=None, bos_token_id=None)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float64).eval()


@pytest.fixture(scope="module", params=["gemma3", "mistral"])
def windowed(request) -> torch.nn.Module:
    return gemma3() if request.param == "gemma3" else mistral_windowed()


def test_the_window_models_run_on_transformers_forward(windowed):
    assert isinstance(make_forward(windowed), HFForward)


@pytest.mark.parametrize("seed", range(4))
def test_speculation_past_the_window_is_the_models_own_output(windowed, seed):
    rng = np.random.default_rng(seed)
    motif = rng.integers(1, TINY_VOCAB, 4).tolist()
    prompt = (motif * 6)[:int(rng.integers(3, 20))]
    expected = reference_greedy(windowed, prompt, 30)  # transformers' own windowed cache
    drafters = [PromptLookupDrafter(num_drafts=3),
                OracleDrafter(len(prompt), expected, draft_len=8, corrupt=0.5, seed=seed,
                              vocab_size=TINY_VOCAB),
                RandomTreeDrafter(TINY_VOCAB, seed=seed)]
    for drafter in drafters:
        got = spec(windowed, drafter, prompt, 30).token_ids
        assert got == expected, type(drafter).__name__


def test_calibration_measures_past_the_window(windowed):
    cost, seconds = measure_verify_cost(windowed, sizes=(1, 2, 4, 8), context_len=4 * WINDOW,
                                        repeats=1)
    assert set(cost) == {1, 2, 4, 8} and seconds > 0
