"""Gemma-3 files on the C decoder (`kernels/decoder.LayerForm`'s Gemma form): Gemma's norms
(1 + weight, in float32), the GELU-tanh gate, norms of the attention's and the MLP's outputs,
per-head q/k norms, sliding-window layers (window 8, every 6th layer global) with their own
rope base, the attention scale 1/sqrt(query_pre_attn_scalar), the scaled embedding and the tied
head. The reference no one here wrote: transformers' float32 `Gemma3ForCausalLM` holding the
weights the file holds (`gguf_files.gemma3_model`, the model the file was written from, its
weights through the `gguf` package's quantizers and back). Prompts run past the window."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from drafters_for_tests import OracleDrafter, RandomTreeDrafter
from gguf_files import GEMMA3_TINY, Q, gemma3_model, gemma_vocab, write_tiny_gguf
from test_batch import run_batched

from dresd.decoding import speculative_generate
from dresd.decoding.batch import Request
from dresd.decoding.forward import HFForward, LlamaForward, Segment, make_forward
from dresd.drafters import NoDrafter, PromptLookupDrafter
from dresd.kernels import quant
from dresd.models.gguf_file import describe, open_gguf
from dresd.models.target import load_target

pytestmark = pytest.mark.skipif(quant.kernel() is None,
                                reason="the C kernels need AVX-512 bf16 and VNNI")

VOCAB = len(gemma_vocab()[0])
WINDOW = GEMMA3_TINY.window


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gemma3c") / "gemma3-q4_0.gguf", Q.Q4_0,
                           Q.Q8_0, arch="gemma3", shape=GEMMA3_TINY, sentencepiece=True)


@pytest.fixture(scope="module")
def target(path):
    return load_target(str(path))


@pytest.fixture(scope="module")
def reference():
    return gemma3_model(GEMMA3_TINY, vocab=VOCAB, linear_type=Q.Q4_0, embedding_type=Q.Q8_0)


def logits(forward, ids: list[int]) -> torch.Tensor:
    [out] = forward([Segment(forward.new_sequence(), ids, 0)])
    return out.logits.float()


def test_gemma3_file_runs_on_the_c_decoder(target, path):
    forward = make_forward(target.model)
    assert isinstance(forward, LlamaForward) and forward.c_decoder is not None
    form = forward.c_decoder.form
    assert form.norm_plus_one and form.out_norms and form.activation == 1  # GELU-tanh
    assert form.windowed == (True,) * 5 + (False,)
    assert forward.window == WINDOW
    assert target.model.config.final_logit_softcapping is None  # Gemma 3 has none
    described = describe(open_gguf(path))
    assert described["dresd_runs_it_natively"] == "yes"
    assert described["forward"] == "dresd's C decoder"


def test_gemma3_c_decoder_matches_transformers_float32(target, reference):
    """48 tokens, six windows: dresd's logits within bf16 and 8-bit activations' error of the
    float32 reference; greedy's token agrees wherever the reference is no near-tie, and each of
    dresd's greedy tokens past the window is the reference's (or within its near-tie)."""
    ids = np.random.default_rng(1).integers(0, VOCAB, 48).tolist()
    with torch.inference_mode():
        expected = reference(torch.tensor([ids])).logits[0]
    got = logits(make_forward(target.model), ids)
    error = (got - expected).norm(dim=-1) / expected.norm(dim=-1)
    assert error.max() < 0.08, error.max()
    best = expected.topk(2, dim=-1).values
    agree = got.argmax(-1) == expected.argmax(-1)
    assert agree.float().mean() >= 0.85
    assert agree[best[:, 0] - best[:, 1] > 1.0].all()
    # greedy over a prompt longer than the window, then 24 tokens
    prompt = ids[:20]
    tokens = speculative_generate(target.model, NoDrafter(), torch.tensor(prompt),
                                  max_new_tokens=24).token_ids
    with torch.inference_mode():
        scores = reference(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    chosen = scores.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    assert (scores.max(-1).values - chosen <= 1.0).all()  # the best, or a near-tie's other
    assert (scores.argmax(-1) == torch.tensor(tokens)).float().mean() >= 0.85


def test_gemma3_c_decoder_is_transformers_bf16_forward(target):
    """On the same loaded model, the C decoder computes what transformers' Gemma3 forward does
    in bf16 (HFForward, what ran these files before): rounding op by op as PyTorch does (bit
    for bit on the machine this was written on; a last-bit difference of an exp or a sum of
    squares may move a bf16 value elsewhere)."""
    ids = np.random.default_rng(2).integers(0, VOCAB, 40).tolist()
    got = logits(make_forward(target.model), ids)
    expected = logits(HFForward(target.model), ids)
    error = (got - expected).norm(dim=-1) / expected.norm(dim=-1)
    assert error.max() < 0.01, error.max()


def test_gemma3_prompt_chunks_and_trees_give_the_rows_bits(target):
    """Chunks crossing the window (their rows see different windows: a mask of the windowed
    layers' own), single decode rows (keys from the window's first only) and one whole prompt
    give every row the same bits."""
    forward = make_forward(target.model)
    ids = np.random.default_rng(3).integers(0, VOCAB, 45).tolist()
    whole = logits(forward, ids)
    sequence, outputs, at = forward.new_sequence(), [], 0
    for size in (3, 11, 1, 1, 2, 19, 1, 7):
        [out] = forward([Segment(sequence, ids[at:at + size], at)])
        outputs.append(out.logits.float())
        at += size
    assert torch.equal(torch.cat(outputs), whole)


def test_gemma3_every_method_is_plain_decoding_and_batched_is_alone(target):
    rng = np.random.default_rng(6)
    prompts = [rng.integers(0, VOCAB, size).tolist() for size in (5, 19, 33)]
    prompts.append([211, 212, 213, 214] * 4)  # repeats: PLD drafts
    plain = [speculative_generate(target.model, NoDrafter(), torch.tensor(prompt),
                                  max_new_tokens=24).token_ids for prompt in prompts]
    for prompt, expected in zip(prompts, plain, strict=True):
        for drafter in (PromptLookupDrafter(num_drafts=3),
                        OracleDrafter(len(prompt), expected, draft_len=6, corrupt=0.5, seed=1,
                                      vocab_size=VOCAB),
                        # trees deeper than the window: their rows' windows differ
                        RandomTreeDrafter(seed=len(prompt), vocab_size=VOCAB, max_len=12)):
            got = speculative_generate(target.model, drafter, torch.tensor(prompt),
                                       max_new_tokens=24).token_ids
            assert got == expected, type(drafter).__name__
    requests = [Request(prompt=p, drafter=PromptLookupDrafter(num_drafts=2), max_new_tokens=24,
                        eos_token_ids=[]) for p in prompts]
    results = run_batched(target.model, requests, [0, 0, 2, 5], max_batch_size=3,
                          prefill_chunk=8)
    assert [r.token_ids for r in results] == plain
