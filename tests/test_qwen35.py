"""Qwen3.5's Gated DeltaNet layers under tree verification (decoding/recurrent.py).

The references are transformers' own: `model.generate`'s greedy tokens in float32 (its chunked
prefill, then one token at a time). Each draft tree's nodes carry their own recurrent state, so
every drafter (rejected branches, partial chains, random trees) must give exactly those tokens,
batched or alone; in bf16 on dresd's kernels, every method and every batch must give `ar`'s
tokens bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from drafters_for_tests import OracleDrafter, RandomTreeDrafter
from test_batch import run_batched
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3NextConfig,
)

from dresd.decoding import speculative_generate
from dresd.decoding.batch import Request
from dresd.decoding.forward import make_forward
from dresd.decoding.recurrent import GatedDeltaNetForward
from dresd.decoding.segments import Segment
from dresd.drafters import NoDrafter, PromptLookupDrafter, SuffixDrafter
from dresd.errors import DresdError
from dresd.models.target import default_model_dir, load_target

VOCAB = 256
SHAPE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
             eos_token_id=None, bos_token_id=None, pad_token_id=0)
# three Gated DeltaNet layers, then full attention, as Qwen3.5 alternates them (3:1)
LAYERS = ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 2


def tiny_qwen35(moe: bool = False, vocab: int = VOCAB, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    if moe:
        config = Qwen3_5MoeTextConfig(vocab_size=vocab, num_hidden_layers=len(LAYERS),
                                      layer_types=LAYERS, num_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=32,
                                      shared_expert_intermediate_size=32, **SHAPE)
    else:
        config = Qwen3_5TextConfig(vocab_size=vocab, num_hidden_layers=len(LAYERS),
                                   layer_types=LAYERS, **SHAPE)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # random norms and decays, not init's ones: every weight matters
        for name, parameter in model.named_parameters():
            if name.endswith(("norm.weight", "A_log", "dt_bias")):
                parameter.normal_(0.0, 0.5)
    return model


def prompts(count: int, seed: int) -> list[list[int]]:
    """Random and repetitive prompts, some longer than the chunked rule's 64-token chunk."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        length = int(rng.integers(1, 150))
        motif = rng.integers(0, VOCAB, int(rng.integers(2, 9))).tolist()
        out.append((motif * 40)[:length] if i % 2 else rng.integers(0, VOCAB, length).tolist())
    return out


def greedy(model, prompt: list[int], new: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                         do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def drafters(index: int, prompt: list[int], reference: list[int]) -> list:
    return [NoDrafter(), PromptLookupDrafter(num_drafts=3), SuffixDrafter(),
            RandomTreeDrafter(VOCAB, seed=index),
            OracleDrafter(len(prompt), reference, draft_len=8, corrupt=0.3, seed=index,
                          vocab_size=VOCAB)]


@pytest.fixture(scope="module", params=[False, True], ids=["dense", "moe"])
def qwen35(request) -> torch.nn.Module:
    return tiny_qwen35(moe=request.param)


def test_the_recurrent_forward_runs_qwen35(qwen35):
    assert isinstance(make_forward(qwen35), GatedDeltaNetForward)


def test_every_drafter_gives_transformers_greedy_tokens(qwen35):
    """Trees of random tokens, chains accepted in part (an oracle corrupted 30% of the time),
    prompt lookup and suffix drafts: each row's state follows its own path, and a rejected
    branch leaves nothing behind."""
    for index, prompt in enumerate(prompts(8, seed=1)):
        reference = greedy(qwen35, prompt, 24)
        for drafter in drafters(index, prompt, reference):
            out = speculative_generate(qwen35, drafter, torch.tensor([prompt]),
                                       max_new_tokens=24, eos_token_ids=[])
            assert out.token_ids == reference, (index, drafter.name)


def test_batched_with_small_prefill_chunks_equals_generate(qwen35):
    """Requests arrive at random steps, prompts prefill in chunks of 7 beside other requests'
    verify trees: each sequence's states stay its own."""
    rng = np.random.default_rng(3)
    cases = prompts(10, seed=2)
    references = [greedy(qwen35, p, 16) for p in cases]
    requests = [Request(prompt=p, drafter=drafters(i, p, r)[i % 5], max_new_tokens=16)
                for i, (p, r) in enumerate(zip(cases, references, strict=True))]
    results = run_batched(qwen35, requests, rng.integers(0, 12, len(cases)).tolist(),
                          max_batch_size=4, prefill_chunk=7)
    # a prompt chunked in 7s runs the chunked rule from each chunk's state, not over the whole
    # prompt at once as generate does: float32 rounding apart, the same tokens
    assert [result.token_ids for result in results] == references


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_in_bf16_every_method_and_batch_is_ar_bit_for_bit(tmp_path, moe):
    """Through dresd's loader (bf16, its row-invariant linears and attention where this CPU
    has them): `ar` alone is the reference, and every method, alone or batched, gives it."""
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    tiny_qwen35(moe=moe, vocab=len(tokenizer)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    target = load_target(str(tmp_path), dtype="bfloat16")
    vocab = len(tokenizer)
    cases = [(list(range(5, 5 + n)) * 3)[: n * 2] for n in (3, 9, 40, 90)]
    reference = [speculative_generate(target.model, NoDrafter(), torch.tensor([p]),
                                      max_new_tokens=20, eos_token_ids=[]).token_ids
                 for p in cases]
    for index, prompt in enumerate(cases):
        for drafter in [PromptLookupDrafter(num_drafts=3), RandomTreeDrafter(vocab, seed=index),
                        OracleDrafter(len(prompt), reference[index], draft_len=6,
                                      corrupt=0.3, seed=index, vocab_size=vocab)]:
            out = speculative_generate(target.model, drafter, torch.tensor([prompt]),
                                       max_new_tokens=20, eos_token_ids=[])
            assert out.token_ids == reference[index], (index, drafter.name)
    requests = [Request(prompt=p, drafter=RandomTreeDrafter(vocab, seed=i), max_new_tokens=20)
                for i, p in enumerate(cases)]
    results = run_batched(target.model, requests, [0, 0, 2, 3], max_batch_size=3,
                          prefill_chunk=512)
    assert [result.token_ids for result in results] == reference


def test_other_recurrent_models_are_refused():
    """transformers' own forward cannot take back a state a rejected draft changed: a model
    with recurrent layers dresd does not run per node is refused, not run inexactly."""
    torch.manual_seed(0)
    config = Qwen3NextConfig(vocab_size=VOCAB, num_hidden_layers=4, num_experts=4,
                             num_experts_per_tok=2, moe_intermediate_size=32,
                             shared_expert_intermediate_size=32, **SHAPE)
    model = AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(DresdError, match="recurrent state"):
        make_forward(model)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(tmp_path, moe):
    """40 tokens as one chunk, and the same tokens one forward each: every row's hidden state
    and every layer's state after them bit for bit the same. (PyTorch's float32 sigmoid, SiLU
    and softplus round a tensor's last few elements on a scalar path and the rest on a
    vector one: with them, the decay of a row computed alone differed from the same row's in a
    chunk, and a tree's tokens from `ar`'s on a 16-head model.)"""
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    tiny_qwen35(moe=moe, vocab=len(tokenizer)).save_pretrained(tmp_path)
    target = load_target(str(tmp_path), dtype="bfloat16")
    forward = make_forward(target.model)
    tokens = np.random.default_rng(2).integers(0, len(tokenizer), 48).tolist()
    prompt, rest = tokens[:8], tokens[8:]
    runs = []
    for chunks in ([rest], [[token] for token in rest]):
        sequence = forward.new_sequence()
        forward([Segment(sequence, prompt, 0, logits_rows="none")])
        hidden, start = [], len(prompt)
        for chunk in chunks:
            hidden.append(forward([Segment(sequence, chunk, start, logits_rows="none")])[0].hidden)
            start += len(chunk)
        runs.append((torch.cat(hidden), sequence))
    (chunked, one), (single, each) = runs
    assert torch.equal(chunked, single)
    for a, b in zip(one.linear, each.linear, strict=True):
        assert torch.equal(a.conv, b.conv) and torch.equal(a.recurrent, b.recurrent)
