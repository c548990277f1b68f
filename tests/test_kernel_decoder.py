"""The C decoder (`kernels/decoder.c`): a whole bf16 forward in one call, batch-invariant, computing
what the PyTorch path computes, and every method on it exactly its own plain decoding."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from drafters_for_tests import RandomTreeDrafter
from test_batch import run_batched
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from dresd import kernels
from dresd.decoding import speculative_generate
from dresd.decoding.batch import Request
from dresd.decoding.forward import LlamaForward, Segment
from dresd.decoding.tree import DraftTree
from dresd.drafters import NoDrafter, PromptLookupDrafter
from dresd.kernels import decoder as cpu_decoder
from dresd.kernels.linear import invariant_linears
from dresd.models.fastpath import INVARIANT_ATTENTION, INVARIANT_MAX_ROWS

VOCAB = 300

# Where the CPU runs a kernel tier and there is a compiler, the kernel must build: a compile
# error fails these tests instead of quietly leaving the PyTorch path.
pytestmark = pytest.mark.skipif(kernels.tier() is None or shutil.which("cc") is None,
                                reason="needs a CPU with AVX2 at least and a C compiler")


def test_the_kernel_builds():
    assert cpu_decoder.kernel() is not None


def tiny_bf16(config_class=LlamaConfig, **extra) -> torch.nn.Module:
    """A random bf16 model on dresd's kernels, with the shapes the C decoder takes (head size 64,
    sizes in whole vectors)."""
    torch.manual_seed(0)
    config = config_class(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                          num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
                          head_dim=64, max_position_embeddings=2048, **extra)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    with torch.no_grad():  # larger weights than the default init: logits far from uniform
        for parameter in model.parameters():
            parameter.mul_(4.0)
    assert invariant_linears(model) > 0
    model.set_attn_implementation(INVARIANT_ATTENTION)
    return model


@pytest.fixture(scope="module")
def tiny():
    return tiny_bf16()


def prompts(count: int, seed: int, low: int = 3, high: int = 40) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, VOCAB, size=int(rng.integers(low, high))).tolist()
            for _ in range(count)]


def test_the_forward_takes_the_c_decoder(tiny):
    assert LlamaForward(tiny).c_decoder is not None
    qwen = tiny_bf16(Qwen2Config)  # q/k/v with biases
    assert LlamaForward(qwen).c_decoder is not None
    gelu = tiny_bf16(hidden_act="gelu")
    assert LlamaForward(gelu).c_decoder is None  # not a SiLU-gated MLP: the PyTorch path


@pytest.mark.parametrize("config_class", [LlamaConfig, Qwen2Config])
def test_c_decoder_computes_the_pytorch_forward(config_class):
    """Same logits as the forward's PyTorch path, to bf16 rounding: the two differ only where
    the norm's sum of squares or SiLU's exp (computed in another order) round differently."""
    model = tiny_bf16(config_class)
    forward = LlamaForward(model)
    python = LlamaForward(model)
    python.c_decoder = None
    for prompt in prompts(4, seed=1, low=20, high=200):  # past 128 rows too
        mine = forward([Segment(forward.new_sequence(), prompt, 0)])[0].logits.float()
        theirs = python([Segment(python.new_sequence(), prompt, 0)])[0].logits.float()
        scale = theirs.abs().max()
        assert (mine - theirs).abs().max() <= 0.05 * scale
        assert (mine.argmax(-1) == theirs.argmax(-1)).float().mean() >= 0.95


@pytest.mark.parametrize("threads", [1, 2])
def test_rows_do_not_depend_on_the_batch(tiny, threads):
    """Each segment's logits in a forward shared with others, a prompt chunk past
    INVARIANT_MAX_ROWS rows among them, at 1 or 2 threads, equal, bit for bit, its logits alone
    on one thread."""
    forward = LlamaForward(tiny)
    histories = prompts(5, seed=2, low=5, high=60)
    long_prompt = prompts(1, seed=3, low=INVARIANT_MAX_ROWS + 20,
                          high=INVARIANT_MAX_ROWS + 60)[0]
    trees = [DraftTree.from_drafts(7, [[1, 2, 3], [1, 4], [5]]),
             DraftTree.from_drafts(9, [[8]]), DraftTree.from_drafts(4, [[6, 7, 8, 9, 10]])]

    def segments(sequences) -> list[Segment]:
        made = [Segment(sequences[-1], long_prompt, 0, logits_rows="all")]
        for i, (history, sequence) in enumerate(zip(histories, sequences, strict=False)):
            tree = trees[i % len(trees)]
            made.append(Segment(sequence, tree.tokens, len(history), depths=tree.depths,
                                ancestors=tree.ancestor_matrix()))
        return made

    def fresh() -> list:
        sequences = []
        for history in histories:
            sequence = forward.new_sequence()
            forward([Segment(sequence, history, 0, logits_rows="none")])
            sequences.append(sequence)
        return [*sequences, forward.new_sequence()]

    torch.set_num_threads(threads)  # the row loops and linears share rows between threads
    try:
        together = forward(segments(fresh()))
    finally:
        torch.set_num_threads(1)
    for index, segment in enumerate(segments(fresh())):
        alone = forward([segment])[0]
        assert torch.equal(alone.logits, together[index].logits)
        assert torch.equal(alone.hidden, together[index].hidden)


def test_every_method_is_its_plain_decoding(tiny):
    """Random trees, prompt lookup and plain decoding, batched with arrivals and long prompts
    (a cache that grows past its first allocation), give plain decoding's tokens."""
    texts = prompts(6, seed=4, low=3, high=40) + prompts(2, seed=5, low=250, high=300)
    plain = [speculative_generate(tiny, NoDrafter(), torch.tensor(p), max_new_tokens=24).token_ids
             for p in texts]
    alone = [speculative_generate(tiny, RandomTreeDrafter(VOCAB, seed=i), torch.tensor(p),
                                  max_new_tokens=24).token_ids for i, p in enumerate(texts)]
    assert alone == plain
    drafters = [NoDrafter(), PromptLookupDrafter(num_drafts=3)]
    requests = [Request(prompt=p, max_new_tokens=24,
                        drafter=(RandomTreeDrafter(VOCAB, seed=i) if i % 3 == 0
                                 else drafters[i % 2]))
                for i, p in enumerate(texts)]
    results = run_batched(tiny, requests, [0, 0, 1, 2, 2, 5, 6, 9], max_batch_size=5,
                          prefill_chunk=64)
    assert [result.token_ids for result in results] == plain
