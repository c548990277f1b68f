"""Qwen3.5 (`qwen35`) GGUF files: Gated DeltaNet layers beside full attention, as llama.cpp's
converter writes them (norms plus one, ssm_a = -exp(A_log), value heads tiled), run by
decoding/recurrent.py on dresd's quantized kernels; and Qwen3.5-MoE (`qwen35moe`) files, each
layer's MLP routed experts in C plus a gated shared expert. The reference no one here wrote:
transformers' float32 `Qwen3_5ForCausalLM` (`Qwen3_5MoeForCausalLM`) on the folder the file
was converted from. The file is `gguf_files.convert_qwen35_like_llama_cpp`'s, checked here to
be llama.cpp's converter's bit for bit where that converter is on this machine (for the MoE
class with the converter's pre-tokenizer check answered: it refuses the test tokenizer's
there, a vocabulary matter that changes no tensor)."""

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
from dresd.decoding.segments import Segment
from dresd.drafters import NoDrafter, PromptLookupDrafter, SuffixDrafter
from dresd.kernels import quant
from dresd.models.fastpath import attention_name
from dresd.models.gguf import SharedExpertMoE
from dresd.models.gguf_file import describe, open_gguf
from dresd.models.target import load_target

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
    # its activations are bf16 though its decays are float32 parameters: the attention must be
    # the batch-invariant one (it was SDPA, and a 20-node tree's root differed from `ar`'s)
    assert target.dtype == torch.bfloat16
    assert attention_name(target.model).startswith("invariant")
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


def greedy_agrees_until_a_near_tie(target, model, prompt_seed: int):
    """dresd's greedy tokens on the file against transformers' float32 model on a random
    prompt: equal until the reference's own near-tie (bf16 activations against float32).
    Returns (prompt, the reference's tokens, its logits)."""
    prompt = np.random.default_rng(prompt_seed).integers(0, VOCAB, PROMPT).tolist()
    expected, logits, gaps = reference_greedy(model, prompt, NEW)
    got = speculative_generate(target.model, NoDrafter(), torch.tensor(prompt),
                               max_new_tokens=NEW).token_ids
    agree = tokens_agreeing(got, expected)
    assert agree == NEW or gaps[agree] < NEAR_TIE, (agree, gaps)
    return prompt, expected, logits


@pytest.mark.parametrize("prompt_seed", [0, 1])
def test_the_file_gives_transformers_float32_tokens(target, model, prompt_seed):
    """Greedy tokens agree until the reference's own near-tie, and every logit lies no farther
    from float32's than transformers' own bf16 forward of the same weights does (a wrong
    mapping is off by the logits' whole size)."""
    prompt, expected, logits = greedy_agrees_until_a_near_tie(target, model, prompt_seed)
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
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_llama_cpps_own_converter_writes_the_same_file(model, moe_model, path, tmp_path, moe):
    """(The MoE class's converter refuses the test tokenizer's pre-tokenizer: that check is
    answered for it, `ANY_PRE_TOKENIZER`; no tensor depends on it.)"""
    if moe:
        model, path = moe_model, convert_qwen35_like_llama_cpp(moe_model, tmp_path / "ours.gguf")
    folder = save_transformers_folder(model, tmp_path / "qwen35")
    converted = convert_with_llama_cpp(folder, tmp_path / "converted.gguf", "--no-mtp",
                                       any_pre_tokenizer=moe)
    theirs, ours = gguf.GGUFReader(converted), gguf.GGUFReader(path)
    arch = "qwen35moe" if moe else "qwen35"
    tensors = {t.name: t for t in ours.tensors}
    assert {t.name for t in theirs.tensors} == set(tensors)
    for tensor in theirs.tensors:
        assert np.array_equal(np.asarray(tensor.data), np.asarray(tensors[tensor.name].data)), \
            tensor.name
    for key in [f"{arch}.{name}" for name in (
            "attention.recurrent_layers", "ssm.time_step_rank", "rope.dimension_count",
            "ssm.inner_size", *(["expert_count", "expert_used_count",
                                 "expert_feed_forward_length",
                                 "expert_shared_feed_forward_length"] if moe else []))]:
        assert theirs.fields[key].contents() == ours.fields[key].contents(), key


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_quantized_file_every_method_is_ar_and_batched_is_alone(model, moe_model, tmp_path,
                                                                moe):
    """A Q4_0 file (every weight in 4-bit blocks): each drafter, alone or batched with small
    prefill chunks, gives plain decoding's tokens on the same file."""
    target = load_target(str(convert_qwen35_like_llama_cpp(moe_model if moe else model,
                                                           tmp_path / "q4.gguf",
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


def random_tree(rows: int, rng: np.random.Generator) -> tuple[list[int], torch.Tensor]:
    """Depths and the ancestors mask of a random tree of `rows` nodes (node 0 the root; each
    later node's parent an earlier node)."""
    parents, depths = [-1], [0]
    for row in range(1, rows):
        parents.append(int(rng.integers(0, row)))
        depths.append(depths[parents[-1]] + 1)
    ancestors = torch.zeros(rows, rows, dtype=torch.bool)
    for row in range(rows):
        node = row
        while node >= 0:
            ancestors[row, node], node = True, parents[node]
    return depths, ancestors


def test_a_wider_files_tree_rows_are_a_steps_bit_for_bit(tmp_path):
    """A wider model than the others here (16 value heads a Gated DeltaNet layer, attention
    heads of 256): a 20-node tree's root row is the one-row step's, bit for bit, and random
    trees give `ar`'s tokens, on its Q4_0 file. (With SDPA in place of the invariant attention,
    as a qwen35 file once ran, the root row differs; the element-wise ops' row invariance is
    test_qwen35's `test_a_rows_bits_do_not_depend_on_the_rows_beside_it`.)"""
    model = qwen35_model(seed=2, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                         num_key_value_heads=1, head_dim=256, linear_num_key_heads=8,
                         linear_num_value_heads=16, linear_key_head_dim=32,
                         linear_value_head_dim=32)
    target = load_target(str(convert_qwen35_like_llama_cpp(
        model, tmp_path / "wide.gguf", gguf.GGMLQuantizationType.Q4_0)))
    forward = make_forward(target.model)
    rng = np.random.default_rng(3)
    for prompt in [rng.integers(0, VOCAB, size).tolist() for size in (12, 64)]:
        tokens = rng.integers(0, VOCAB, 20).tolist()
        depths, ancestors = random_tree(20, rng)
        rows = []
        for segment in ([tokens[0]], None, None), (tokens, depths, ancestors):
            sequence = forward.new_sequence()
            forward([Segment(sequence, prompt, 0, logits_rows="none")])
            rows.append(forward([Segment(sequence, segment[0], len(prompt), depths=segment[1],
                                         ancestors=segment[2])])[0].hidden[0])
        assert torch.equal(rows[0], rows[1])
        expected = speculative_generate(target.model, NoDrafter(), torch.tensor(prompt),
                                        max_new_tokens=16).token_ids
        for seed in range(2):
            got = speculative_generate(target.model, RandomTreeDrafter(seed=seed,
                                                                       vocab_size=VOCAB),
                                       torch.tensor(prompt), max_new_tokens=16).token_ids
            assert got == expected, seed


# --- Qwen3.5-MoE (qwen35moe) -----------------------------------------------------------------

@pytest.fixture(scope="module")
def moe_model():
    return qwen35_model(seed=0, moe=True)


@pytest.fixture(scope="module")
def moe_target(moe_model, tmp_path_factory):
    return load_target(str(convert_qwen35_like_llama_cpp(
        moe_model, tmp_path_factory.mktemp("qwen35moe") / "q.gguf")))


def test_the_moe_file_runs_its_experts_in_c(moe_target):
    assert isinstance(make_forward(moe_target.model), GatedDeltaNetForward)
    mlps = [layer.mlp for layer in moe_target.model.model.layers]
    assert all(isinstance(mlp, SharedExpertMoE) for mlp in mlps)
    assert mlps[0].experts.experts == 4 and mlps[0].experts.used == 2 and mlps[0].experts.norm


def test_each_moe_layer_is_transformers_own_block(moe_target, moe_model):
    """Each layer's MLP on the same bf16 rows as transformers' float32 sparse block (router,
    top 2 renormalised, experts, the shared expert and its sigmoid gate): within bf16's
    rounding of its steps (a wrong router, gate or expert order is off by tens of percent)."""
    rows = torch.randn(1, 24, moe_model.config.hidden_size,
                       generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    for ours, theirs in zip(moe_target.model.model.layers, moe_model.model.layers, strict=True):
        with torch.inference_mode():
            expected = theirs.mlp(rows.float())
            got = ours.mlp(rows).float()
        error = ((got - expected).abs().max() / expected.abs().max()).item()
        assert error < 0.02, error


@pytest.mark.parametrize("prompt_seed", [0, 1])
def test_the_moe_file_gives_transformers_float32_tokens(moe_target, moe_model, prompt_seed):
    """Greedy tokens agree with transformers' float32 model until its own near-tie (the
    whole-model logit bound above is not used for MoE, whose routing flips at near-ties move
    whole logits either way: test_each_moe_layer_is_transformers_own_block checks the mapping)."""
    greedy_agrees_until_a_near_tie(moe_target, moe_model, prompt_seed)
