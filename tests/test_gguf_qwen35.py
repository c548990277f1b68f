"""Qwen3.5 (`qwen35`) GGUF files: Gated DeltaNet layers beside full attention, as llama.cpp's
converter writes them (norms plus one, ssm_a = -exp(A_log), value heads tiled), run by
decoding/recurrent.py on dresd's quantized kernels. The reference no one here wrote:
transformers' float32 `Qwen3_5ForCausalLM` on the folder the file was converted from. The file
is `gguf_files.convert_qwen35_like_llama_cpp`'s, checked here to be llama.cpp's converter's bit
for bit where that converter is on this machine."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from drafters_for_tests import OracleDrafter, RandomTreeDrafter
from gguf_files import (
    convert_qwen35_like_llama_cpp,
    convert_with_llama_cpp,
    llama_cpp_converter,
    qwen35_model,
    save_transformers_folder,
)
from test_batch import run_batched
from test_gguf_rope_scaling import (
    NEAR_TIE,
    VOCAB,
    dresd_logits,
    reference_greedy,
    tokens_agreeing,
)

from dresd.decoding import speculative_generate
from dresd.decoding.batch import Request
from dresd.decoding.forward import make_forward
from dresd.decoding.recurrent import TILED_VALUE_HEADS, GatedDeltaNetForward
from dresd.drafters import NoDrafter, PromptLookupDrafter, SuffixDrafter
from dresd.gguf_model import describe, open_gguf
from dresd.kernels import quant
from dresd.models import load_target

pytestmark = pytest.mark.skipif(quant.kernel() is None,
                                reason="the C kernels need a kernel tier (AVX2 or AVX-512)")
PROMPT, NEW = 48, 24


@pytest.fixture(scope="module")
def model():
    return qwen35_model(seed=0)


@pytest.fixture(scope="module")
def path(model, tmp_path_factory):
    return convert_qwen35_like_llama_cpp(model, tmp_path_factory.mktemp("qwen35") / "q.gguf")


@pytest.fixture(scope="module")
def target(path):
    return load_target(str(path))


def test_the_file_runs_on_the_recurrent_forward(target, path):
    assert isinstance(make_forward(target.model), GatedDeltaNetForward)
    mixer = target.model.model.layers[0].linear_attn
    assert getattr(mixer, TILED_VALUE_HEADS) and mixer.num_v_heads == 2 * mixer.num_k_heads
    described = describe(open_gguf(path))
    assert described["dresd_runs_it_natively"] == "yes"
    assert "recurrent" in described["forward"]


def bf16_error(model, ids: list[int], logits: torch.Tensor) -> float:
    """How far transformers' own bf16 forward of the same weights lies from its float32."""
    copy = qwen35_model(seed=0).to(torch.bfloat16)
    copy.load_state_dict(model.state_dict())
    with torch.inference_mode():
        own = copy(torch.tensor([ids])).logits[0].float()
    return (own - logits).abs().max().item()


@pytest.mark.parametrize("prompt_seed", [0, 1])
def test_the_file_gives_transformers_float32_tokens(target, model, prompt_seed):
    """Greedy tokens agree until the reference's own near-tie (bf16 activations against
    float32), and every logit lies no farther from float32's than transformers' own bf16
    forward of the same weights does (a wrong mapping is off by the logits' whole size)."""
    prompt = np.random.default_rng(prompt_seed).integers(0, VOCAB, PROMPT).tolist()
    expected, logits, gaps = reference_greedy(model, prompt, NEW)
    got = speculative_generate(target.model, NoDrafter(), torch.tensor(prompt),
                               max_new_tokens=NEW).token_ids
    agree = tokens_agreeing(got, expected)
    assert agree == NEW or gaps[agree] < NEAR_TIE, (agree, gaps)
    difference = (dresd_logits(target, prompt + expected) - logits).abs().max().item()
    assert difference <= 1.1 * bf16_error(model, prompt + expected, logits), difference


def test_the_value_heads_order_matters(target, model):
    """Read as grouped (transformers' order) instead of the file's tiled order, the logits lie
    far from the reference: the test above would catch a wrong head order."""
    prompt = np.random.default_rng(0).integers(0, VOCAB, PROMPT).tolist()
    _, logits, _ = reference_greedy(model, prompt, 1)
    mixers = [layer.linear_attn for layer in target.model.model.layers
              if hasattr(layer, "linear_attn")]
    for mixer in mixers:
        setattr(mixer, TILED_VALUE_HEADS, False)
    try:
        wrong = (dresd_logits(target, prompt)[:PROMPT] - logits[:PROMPT]).abs().max().item()
    finally:
        for mixer in mixers:
            setattr(mixer, TILED_VALUE_HEADS, True)
    assert wrong > 3 * bf16_error(model, prompt, logits[:PROMPT]), wrong


@pytest.mark.skipif(llama_cpp_converter() is None,
                    reason="llama.cpp's converter or sentencepiece is not here (benchmarks/peers/)")
def test_llama_cpps_own_converter_writes_the_same_file(model, path, tmp_path):
    folder = save_transformers_folder(model, tmp_path / "qwen35")
    converted = convert_with_llama_cpp(folder, tmp_path / "converted.gguf", "--no-mtp")
    theirs, ours = gguf.GGUFReader(converted), gguf.GGUFReader(path)
    tensors = {t.name: t for t in ours.tensors}
    assert {t.name for t in theirs.tensors} == set(tensors)
    for tensor in theirs.tensors:
        assert np.array_equal(np.asarray(tensor.data), np.asarray(tensors[tensor.name].data)), \
            tensor.name
    for key in ("qwen35.attention.recurrent_layers", "qwen35.ssm.time_step_rank",
                "qwen35.rope.dimension_count", "qwen35.ssm.inner_size"):
        assert theirs.fields[key].contents() == ours.fields[key].contents(), key


def test_quantized_file_every_method_is_ar_and_batched_is_alone(model, tmp_path):
    """A Q4_0 file (every weight in 4-bit blocks): each drafter, alone or batched with small
    prefill chunks, gives plain decoding's tokens on the same file."""
    target = load_target(str(convert_qwen35_like_llama_cpp(model, tmp_path / "q4.gguf",
                                                           gguf.GGMLQuantizationType.Q4_0)))
    rng = np.random.default_rng(6)
    prompts = [rng.integers(0, VOCAB, size).tolist() for size in (5, 33, 70)]
    prompts.append([21, 22, 23, 24] * 8)  # repeats: PLD and suffix draft
    plain = [speculative_generate(target.model, NoDrafter(), torch.tensor(prompt),
                                  max_new_tokens=20).token_ids for prompt in prompts]
    for prompt, expected in zip(prompts, plain, strict=True):
        for drafter in (PromptLookupDrafter(num_drafts=3), SuffixDrafter(),
                        OracleDrafter(len(prompt), expected, draft_len=6, corrupt=0.5, seed=1,
                                      vocab_size=VOCAB),
                        RandomTreeDrafter(seed=len(prompt), vocab_size=VOCAB)):
            got = speculative_generate(target.model, drafter, torch.tensor(prompt),
                                       max_new_tokens=20).token_ids
            assert got == expected, type(drafter).__name__
    requests = [Request(prompt=p, drafter=RandomTreeDrafter(seed=i, vocab_size=VOCAB),
                        max_new_tokens=20, eos_token_ids=[]) for i, p in enumerate(prompts)]
    results = run_batched(target.model, requests, [0, 0, 2, 5], max_batch_size=3,
                          prefill_chunk=8)
    assert [r.token_ids for r in results] == plain
