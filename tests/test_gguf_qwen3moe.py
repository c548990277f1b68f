"""Qwen3-MoE (`qwen3moe`) files: Qwen3's attention (q/k norms per head) and, in every layer, a
mixture of experts (router in float32, softmax, the top k renormalised, each chosen expert's
SiLU MLP on the file's own weights) on the C kernels (`kernels/experts.c`). The reference no
one here wrote: transformers' float32 `Qwen3MoeForCausalLM` on the folder the file was
converted from (`gguf_files.convert_like_llama_cpp`, as llama.cpp's `Qwen3MoeModel` writes
it). The exactness rules: every method is plain decoding, a sequence batched is the sequence
alone, and a row's experts' output does not depend on the rows beside it (which experts they
reach, how many there are)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf_files import MOE_SHAPE, Q, convert_like_llama_cpp, transformers_model
from test_gguf_rope_scaling import (
    LOGIT_TOLERANCE,
    NEAR_TIE,
    NEW,
    PROMPT,
    VOCAB,
    check_every_method_and_batching,
    dresd_logits,
    random_and_repeating_prompts,
    reference_greedy,
    tokens_agreeing,
)

from dresd.decoding import speculative_generate
from dresd.decoding.forward import LlamaForward, Segment, make_forward
from dresd.drafters import NoDrafter
from dresd.kernels import quant
from dresd.kernels.experts import MoEDecoder, MoEMLP
from dresd.models.gguf_file import GGUFError, describe, open_gguf
from dresd.models.target import load_target

pytestmark = pytest.mark.skipif(quant.kernel() is None,
                                reason="the C kernels need AVX2, FMA and F16C at least")
ROPE = {"rope_type": "default", "rope_theta": 1e6}
# A routing near-tie: the reference's k-th and (k+1)-th expert probabilities closer than this
# in some layer. There a difference of the last bits (bf16 activations, 8-bit quantized ones)
# may choose the other expert, and that position's logits move by O(1) (measured: such
# positions had gaps of 5e-5 to 5e-4; every other position stays within 2%).
ROUTING_TIE = 1e-3


def routing_gaps(model, ids: list[int], by_logits: bool = False) -> torch.Tensor:
    """Per position, the smallest gap over the layers between the reference's k-th and
    (k+1)-th expert probabilities (`by_logits`: logits, by which gpt-oss picks its experts)."""
    used = model.config.num_experts_per_tok
    with torch.inference_mode():
        out = model(torch.tensor([ids]), output_router_logits=True)
    gaps = []
    for logits in out.router_logits:
        scores = logits.float() if by_logits else torch.softmax(logits.float(), -1)
        ordered = scores.sort(-1, descending=True).values
        gaps.append(ordered[:, used - 1] - ordered[:, used])
    return torch.stack(gaps).min(0).values


def check_moe_against_reference(target, model, prompt_seed: int, prompt_length: int = PROMPT,
                                new: int = NEW, routing_tie: float = ROUTING_TIE,
                                by_logits: bool = False) -> None:
    """dresd's greedy tokens and logits from the file against transformers' float32 model:
    tokens agree, or part only after a near-tie of the reference's logits or routing
    (`routing_gaps` below `routing_tie`); every position's logits within 2% of the largest
    logit, except at routing near-ties (at most one position in ten)."""
    prompt = np.random.default_rng(prompt_seed).integers(0, VOCAB, prompt_length).tolist()
    expected, logits, gaps = reference_greedy(model, prompt, new)
    got = speculative_generate(target.model, NoDrafter(), torch.tensor(prompt),
                               max_new_tokens=new).token_ids
    routing = routing_gaps(model, prompt + expected, by_logits)
    agree = tokens_agreeing(got, expected)
    assert agree == new or gaps[agree] < NEAR_TIE \
        or routing[:prompt_length + agree].min() < routing_tie, (agree, gaps)
    difference = (dresd_logits(target, prompt + expected) - logits).abs().max(-1).values
    off = difference > LOGIT_TOLERANCE * logits.abs().max()
    assert bool((routing[off] < routing_tie).all()), (difference[off], routing[off])
    assert int(off.sum()) <= len(off) // 10


@pytest.fixture(scope="module")
def model():
    return transformers_model("qwen3_moe", ROPE, seed=1)


@pytest.fixture(scope="module")
def path(model, tmp_path_factory):
    return convert_like_llama_cpp(model, tmp_path_factory.mktemp("qwen3moe") / "moe.gguf")


@pytest.fixture(scope="module")
def target(path):
    return load_target(str(path))


@pytest.fixture(scope="module")
def q8_model():
    """The same shape with its experts in Q8_0 (the reference holds the file's values)."""
    return transformers_model("qwen3_moe", ROPE, seed=2, expert_type=Q.Q8_0)


@pytest.fixture(scope="module")
def q8_target(q8_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3moe_q8") / "moe-q8.gguf"
    return load_target(str(convert_like_llama_cpp(q8_model, path, expert_type=Q.Q8_0)))


def test_qwen3moe_file_runs_on_the_c_decoder_with_c_experts(target, path):
    forward = make_forward(target.model)
    assert isinstance(forward, LlamaForward) and isinstance(forward.c_decoder, MoEDecoder)
    config = target.model.config
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
            config.norm_topk_prob) == (8, 2, 64, True)
    assert all(isinstance(layer.mlp, MoEMLP) for layer in target.model.model.layers)
    described = describe(open_gguf(path))
    assert described["dresd_runs_it_natively"] == "yes"
    assert described["forward"] == ("dresd's C decoder, each layer's experts in C "
                                    "(kernels/experts.c)")
    assert (described["experts"], described["experts_used"]) == (8, 2)


@pytest.mark.parametrize("prompt_seed", [0, 1])
def test_qwen3moe_file_matches_transformers_float32(target, model, prompt_seed):
    """Greedy tokens equal over 24 new tokens (these prompts have no near-tie), logits within
    2% of the largest (bf16 activations against float32; measured ~0.6%)."""
    check_moe_against_reference(target, model, prompt_seed)
    prompt = np.random.default_rng(prompt_seed).integers(0, VOCAB, PROMPT).tolist()
    got = speculative_generate(target.model, NoDrafter(), torch.tensor(prompt),
                               max_new_tokens=NEW).token_ids
    assert got == reference_greedy(model, prompt)[0]


def test_qwen3moe_q8_experts_match_their_reference(q8_target, q8_model):
    """Experts in Q8_0 (activations quantized to 8 bits per block, as llama.cpp does): this
    prompt has two routing near-ties (positions 26 and 52 moved by 1.7), every other position
    within 2%."""
    check_moe_against_reference(q8_target, q8_model, 0)


def test_qwen3moe_c_decoder_is_the_layer_loop(target):
    """The whole forward in C gives the bits of the PyTorch layer loop calling the experts'
    C MLP as each layer's `mlp` (what runs with DRESD_CPU_DECODER=0)."""
    ids = np.random.default_rng(4).integers(0, VOCAB, 37).tolist()
    forward = make_forward(target.model)
    [whole] = forward([Segment(forward.new_sequence(), ids, 0)])
    forward.c_decoder = None
    [loop] = forward([Segment(forward.new_sequence(), ids, 0)])
    assert torch.equal(whole.logits, loop.logits)


def _reference_route(mlp: MoEMLP, x: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 routing: (experts, weights, each row's gap between its k-th and (k+1)-th
    probabilities)."""
    probs = torch.softmax(x.double() @ mlp.router.double().T, dim=-1)
    ordered = torch.sort(probs, dim=-1, descending=True, stable=True)
    index = ordered.indices[:, :mlp.used]
    weights = ordered.values[:, :mlp.used]
    weights = weights / weights.sum(-1, keepdim=True)
    return index, weights, ordered.values[:, mlp.used - 1] - ordered.values[:, mlp.used]


def test_qwen3moe_routing_and_ties(target):
    mlp = target.model.model.layers[0].mlp
    x = torch.randn(64, mlp.hidden, generator=torch.Generator().manual_seed(0)).bfloat16()
    index, weights = mlp.route(x)
    expected, expected_weights, gaps = _reference_route(mlp, x.float())
    clear = gaps > 1e-5  # no near-tie: the same experts in the same order
    assert int(clear.sum()) >= 60
    assert torch.equal(index.long()[clear], expected[clear])
    assert torch.allclose(weights.double()[clear], expected_weights[clear], atol=1e-5)
    assert torch.allclose(weights.sum(-1), torch.ones(64))
    # equal probabilities: the lower expert first. Experts 2 and 5 share a router row, the
    # others' logits are 0: a row whose shared logit is positive takes 2, 5, then 0; a
    # negative one 0, 1, 3; a zero row (every logit equal) 0, 1, 2
    tied = MoEMLP(torch.zeros(8, mlp.hidden), list(mlp.gate_up), list(mlp.down), 3, True)
    tied.router[5] = tied.router[2] = 0.01
    rows = torch.cat([x[:6], torch.zeros(2, mlp.hidden).bfloat16()])
    index, weights = tied.route(rows)
    for row, chosen in zip(rows, index.tolist(), strict=True):
        shared = float(row.float().sum())
        assert chosen == ([2, 5, 0] if shared > 0 else [0, 1, 3] if shared < 0 else [0, 1, 2])
    assert torch.allclose(weights[-1], torch.full((3,), 1 / 3))


@pytest.mark.parametrize("which", ["bf16", "q8"])
def test_qwen3moe_experts_rows_as_alone(which, target, q8_target):
    """A row's experts' output has the bits it has alone, among 1 to 40 rows that reach
    other experts, with 1 thread or 2."""
    mlp = (target if which == "bf16" else q8_target).model.model.layers[1].mlp
    x = torch.randn(40, mlp.hidden, generator=torch.Generator().manual_seed(1)).bfloat16()
    alone = torch.cat([mlp(x[i:i + 1]) for i in range(len(x))])
    threads = torch.get_num_threads()
    try:
        for count in (2, 7, 40):
            torch.set_num_threads(1 if count == 7 else threads)
            assert torch.equal(mlp(x[:count]), alone[:count]), count
    finally:
        torch.set_num_threads(threads)
    # and what it computes: the chosen experts' MLPs, weighted (float32 in PyTorch)
    index, weights = mlp.route(x)
    expected = torch.zeros(len(x), mlp.hidden)
    for row in range(len(x)):
        for rank in range(mlp.used):
            expert = int(index[row, rank])
            gate, up = mlp.gate_up[expert](x[row:row + 1]).chunk(2, dim=-1)
            out = mlp.down[expert](torch.nn.functional.silu(gate) * up)
            expected[row] += weights[row, rank] * out[0].float()
    assert (alone.float() - expected).abs().max() <= 0.02 * expected.abs().max()


@pytest.mark.parametrize("which", ["bf16", "q8"])
def test_qwen3moe_every_method_is_plain_decoding_and_batched_is_alone(which, target,
                                                                       q8_target):
    target = target if which == "bf16" else q8_target
    check_every_method_and_batching(target.model, random_and_repeating_prompts(), [0, 0, 2, 5],
                                    8)


@pytest.mark.parametrize("metadata, message", [
    ({"expert_feed_forward_length": 32}, "ffn_gate_exps.weight' has shape"),
    ({"expert_count": 4}, "ffn_gate_inp.weight' has shape"),
    ({"expert_used_count": 9}, "9 experts used per token of 8"),
    ({"expert_shared_count": 1}, "shared experts"),
])
def test_qwen3moe_file_that_lies_is_one_error(model, tmp_path, metadata, message):
    """Sizes in the metadata that the expert tensors do not have (or routing dresd does not
    run) are one error naming what is wrong, before any C call."""
    path = convert_like_llama_cpp(model, tmp_path / "lies.gguf", metadata=metadata)
    with pytest.raises(GGUFError, match=message):
        load_target(str(path))


def test_qwen3moe_transformers_folder_keeps_transformers_forward(model):
    """A transformers Qwen3-MoE (its experts in PyTorch, not batch-invariant) is not taken by
    the batched forward: only a file's experts on the C kernels are."""
    assert model.config.num_experts == MOE_SHAPE["num_experts"]
    assert not LlamaForward.takes(model)
