"""gpt-oss (`gpt-oss`) files on the C decoder: every layer's MLP its experts (the router and the
experts biased, the top k logits then their softmax, a clamped SwiGLU), attention with biases,
a learned sink per head and a window on every other layer, YaRN with its correction range not
truncated. The reference no one here wrote: transformers' float32 `GptOssForCausalLM` on the
folder the file was converted from (`gguf_files.convert_gpt_oss_like_llama_cpp`, checked here
to write llama.cpp's own converter's tensors bit for bit where its sources are on this
machine). The exactness rules: every method is plain decoding, a sequence batched is the
sequence alone, a row's attention and experts' output do not depend on the rows beside it."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf_files import (
    GPT_OSS_WINDOW,
    Q,
    convert_gpt_oss_like_llama_cpp,
    convert_with_llama_cpp,
    gpt_oss_model,
    llama_cpp_converter,
    save_transformers_folder,
)
from test_gguf_qwen3moe import check_moe_against_reference
from test_gguf_rope_scaling import (
    LOGIT_TOLERANCE,
    VOCAB,
    check_every_method_and_batching,
    dresd_logits,
    random_and_repeating_prompts,
    reference_greedy,
)

from dresd.decoding.forward import LlamaForward, make_forward
from dresd.errors import DresdError
from dresd.kernels import attention as cpu_attention
from dresd.kernels import quant
from dresd.kernels.experts import SWIGLU_CLAMPED, MoEDecoder, MoEMLP
from dresd.models import gguf as gguf_model
from dresd.models.gguf_file import Field, describe, open_gguf
from dresd.models.target import load_target

pytestmark = pytest.mark.skipif(quant.kernel() is None,
                                reason="the C kernels need AVX2, FMA and F16C at least")
PROMPT, NEW = 24, 40  # 64 positions: past the window (20) and YaRN's original context (32)
# A routing near-tie: the reference's k-th and (k+1)-th router logits closer than this in some
# layer; there a last-bit difference may choose the other expert and move that position's
# logits by O(1) (measured: 0.0006 moved three positions by 35%)
ROUTING_TIE = 2e-3


def check_against_reference(target, model, prompt_seed: int) -> None:
    """Tokens agree, or part only after a near-tie of the reference's logits or routing (by
    the router's logits, as gpt-oss picks its experts); every position's logits within 2% of
    the largest, except at routing near-ties."""
    check_moe_against_reference(target, model, prompt_seed, PROMPT, NEW, ROUTING_TIE,
                                by_logits=True)


@pytest.fixture(scope="module")
def model():
    return gpt_oss_model(seed=1)


@pytest.fixture(scope="module")
def path(model, tmp_path_factory):
    return convert_gpt_oss_like_llama_cpp(model, tmp_path_factory.mktemp("gpt_oss") / "g.gguf")


@pytest.fixture(scope="module")
def target(path):
    return load_target(str(path))


# The same shape with its experts in Q8_0 and in MXFP4, gpt-oss's own (the reference holds the
# file's values); the MXFP4 file's embedding and output head in Q8_0, as llama-quantize's
# MXFP4_MOE writes them (its first parameter then an attention sink, float32)
QUANTIZED_EXPERTS = {"q8": Q.Q8_0, "mxfp4": Q.MXFP4}


@pytest.fixture(scope="module")
def quantized_models() -> dict:
    return {name: gpt_oss_model(seed=2, expert_type=qtype)
            for name, qtype in QUANTIZED_EXPERTS.items()}


@pytest.fixture(scope="module")
def quantized_targets(quantized_models, tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("gpt_oss_quantized")
    return {name: load_target(str(convert_gpt_oss_like_llama_cpp(
        quantized_models[name], folder / f"{name}.gguf", qtype,
        Q.Q8_0 if qtype == Q.MXFP4 else Q.BF16)))
        for name, qtype in QUANTIZED_EXPERTS.items()}


def test_gpt_oss_file_runs_on_the_c_decoder_as_its_config_says(target, path):
    forward = make_forward(target.model)
    assert isinstance(forward, LlamaForward) and isinstance(forward.c_decoder, MoEDecoder)
    config = target.model.config
    assert config.layer_types == ["sliding_attention", "full_attention"]
    assert config.sliding_window == GPT_OSS_WINDOW and forward.window == GPT_OSS_WINDOW
    assert config.rope_parameters["rope_type"] == "yarn"
    assert config.rope_parameters["truncate"] is False
    assert config.rope_parameters["original_max_position_embeddings"] == 32
    mlp = target.model.model.layers[0].mlp
    assert isinstance(mlp, MoEMLP) and (mlp.experts, mlp.used, mlp.ffn) == (8, 2, 64)
    assert (mlp.gating, mlp.activation, mlp.swiglu) == ("top_k_softmax", SWIGLU_CLAMPED,
                                                         (1.702, 7.0))
    attention = target.model.model.layers[1].self_attn
    assert attention.sinks.dtype == torch.float32 and attention.sinks.shape == (2,)
    described = describe(open_gguf(path))
    assert described["dresd_runs_it_natively"] == "yes"
    assert described["sliding_window"] == GPT_OSS_WINDOW
    assert (described["experts"], described["experts_used"]) == (8, 2)


@pytest.mark.parametrize("prompt_seed", [0, 1])
def test_gpt_oss_file_matches_transformers_float32(target, model, prompt_seed):
    """Greedy tokens and logits against the reference past the window and the original
    context (bf16 activations against float32: measured within 0.9% of the largest logit)."""
    check_against_reference(target, model, prompt_seed)


@pytest.mark.parametrize("name", list(QUANTIZED_EXPERTS))
def test_gpt_oss_quantized_experts_match_their_reference(quantized_targets, quantized_models,
                                                         name):
    """Experts in Q8_0 or MXFP4 (activations quantized to 8 bits per block, as llama.cpp
    does), each expert's blocks run as the file stores them."""
    mlp = quantized_targets[name].model.model.layers[0].mlp
    assert mlp.down[0].qtype == QUANTIZED_EXPERTS[name]
    assert isinstance(make_forward(quantized_targets[name].model).c_decoder, MoEDecoder)
    check_against_reference(quantized_targets[name], quantized_models[name], 0)


@pytest.mark.parametrize("mutation", ["no sinks", "truncated yarn"])
def test_gpt_oss_reference_sees_what_sinks_and_yarn_do(path, model, mutation):
    """The comparison can fail: without the sinks, or with YaRN's correction range truncated
    (llama.cpp's reading of the same file), the logits part from the reference's by far more
    than the tolerance (measured: 36% and 23% of the largest logit)."""
    target = load_target(str(path))
    if mutation == "no sinks":
        for layer in target.model.model.layers:
            layer.self_attn.sinks.data.fill_(-float("inf"))
    else:
        config = target.model.config
        config.rope_parameters = {**config.rope_parameters, "truncate": True}
        with torch.device("cpu"):
            target.model.model.rotary_emb = type(target.model.model.rotary_emb)(config=config)
    prompt = np.random.default_rng(0).integers(0, VOCAB, PROMPT).tolist()
    expected, logits, _ = reference_greedy(model, prompt, NEW)
    difference = (dresd_logits(target, prompt + expected) - logits).abs().max()
    assert float(difference) > 5 * LOGIT_TOLERANCE * float(logits.abs().max())


def test_gpt_oss_attention_sinks_in_the_kernel():
    """The C attention with sinks against float64 softmax over [scores, sink] (the sink's
    column dropped); each row's bits as alone, with other rows and another thread count."""
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, length = 4, 2, 64, 50
    keys = torch.randn(1, kv_heads, length, dim, generator=generator).bfloat16()
    values = torch.randn(1, kv_heads, length, dim, generator=generator).bfloat16()
    query = torch.randn(length, heads, dim, generator=generator).bfloat16()
    sinks = torch.tensor([3.0, -1.0, 0.5, 30.0])  # the last outweighs every key
    out = cpu_attention.attention_batch(query, [0, length], [keys], [values], [None], 0.125,
                                        sinks=sinks)
    group = heads // kv_heads
    k = keys[0].double().repeat_interleave(group, 0)
    v = values[0].double().repeat_interleave(group, 0)
    scores = torch.einsum("rhd,hjd->hrj", query.double(), k) * 0.125
    scores = scores.masked_fill(~torch.ones(length, length, dtype=torch.bool).tril(),
                                -float("inf"))
    with_sink = torch.cat([scores, sinks.double()[:, None, None].expand(-1, length, 1)], -1)
    weights = torch.softmax(with_sink, -1)[..., :-1]
    expected = torch.einsum("hrj,hjd->rhd", weights, v)
    assert (out.double() - expected).abs().max() < 0.02
    assert out[:, 3].abs().max() < 1e-3  # the sink takes almost all of head 3's weight
    without = cpu_attention.attention_batch(query, [0, length], [keys], [values], [None], 0.125)
    assert (without.double() - expected).abs().max() > 0.1
    # a row's bits: the last row alone (its keys all there), then with 2 threads and 2 rows
    last = cpu_attention.attention_batch(query[-1:], [0, 1], [keys], [values], [None], 0.125,
                                         sinks=sinks, threads=1)
    assert torch.equal(last, out[-1:])
    two = cpu_attention.attention_batch(query[-2:], [0, 2], [keys], [values], [None], 0.125,
                                        sinks=sinks, threads=2)
    assert torch.equal(two, out[-2:])


def _reference_experts(mlp: MoEMLP, x: torch.Tensor) -> torch.Tensor:
    """gpt-oss's MoE MLP in float32 PyTorch on the same modules: the top k of the biased
    router logits, their softmax, each chosen expert's clamped SwiGLU (with biases)."""
    alpha, limit = mlp.swiglu
    logits = x.float() @ mlp.router.T + mlp.router_bias
    top = torch.topk(logits, mlp.used, dim=-1)
    weights = torch.softmax(top.values, -1)
    out = torch.zeros(len(x), mlp.hidden)
    for row in range(len(x)):
        for rank in range(mlp.used):
            expert = int(top.indices[row, rank])
            gate, up = mlp.gate_up[expert](x[row:row + 1]).float().chunk(2, dim=-1)
            gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
            act = (up + 1) * gate * torch.sigmoid(alpha * gate)
            out[row] += weights[row, rank] * mlp.down[expert](act.bfloat16())[0].float()
    return out


@pytest.mark.parametrize("which", ["bf16", *QUANTIZED_EXPERTS])
def test_gpt_oss_experts_compute_gpt_oss_mlp_rows_as_alone(which, target, quantized_targets):
    """A row's experts' output has the bits it has alone among 2 to 40 rows that reach other
    experts, with 1 thread or 2; and it is gpt-oss's MLP (within bf16 rounding), rows large
    enough that the clamp is reached."""
    mlp = (target if which == "bf16" else quantized_targets[which]).model.model.layers[1].mlp
    x = (8 * torch.randn(40, mlp.hidden, generator=torch.Generator().manual_seed(1))).bfloat16()
    alone = torch.cat([mlp(x[i:i + 1]) for i in range(len(x))])
    threads = torch.get_num_threads()
    try:
        for count in (2, 7, 40):
            torch.set_num_threads(1 if count == 7 else threads)
            assert torch.equal(mlp(x[:count]), alone[:count]), count
    finally:
        torch.set_num_threads(threads)
    expected = _reference_experts(mlp, x)
    assert (alone.float() - expected).abs().max() <= 0.02 * expected.abs().max()
    # the clamp is reached: some gate or up values past the limit in these rows
    gate_up = torch.cat([mlp.gate_up[e](x).float() for e in range(mlp.experts)], -1)
    assert bool((gate_up.abs() > mlp.swiglu[1]).any())


@pytest.mark.parametrize("which", ["bf16", "mxfp4"])
def test_gpt_oss_every_method_is_plain_decoding_and_batched_is_alone(which, target,
                                                                      quantized_targets):
    target = target if which == "bf16" else quantized_targets[which]
    check_every_method_and_batching(target.model, random_and_repeating_prompts(), [0, 0, 2, 5],
                                    8)


@pytest.mark.skipif(llama_cpp_converter() is None,
                    reason="llama.cpp's converter is not on this machine (benchmarks/peers/)")
def test_llama_cpps_own_converter_writes_the_same_file(model, path, tmp_path):
    """The converter's file from the folder: the same tensors (names, types, shapes, bytes)
    and the same gpt-oss keys as `convert_gpt_oss_like_llama_cpp`'s."""
    folder = save_transformers_folder(model, tmp_path / "model")
    theirs = gguf.GGUFReader(convert_with_llama_cpp(folder, tmp_path / "theirs.gguf"))
    mine = gguf.GGUFReader(path)
    mine_tensors = {tensor.name: tensor for tensor in mine.tensors}
    assert set(mine_tensors) == {tensor.name for tensor in theirs.tensors}
    for tensor in theirs.tensors:
        ours = mine_tensors[tensor.name]
        assert (ours.tensor_type, list(ours.shape)) == (tensor.tensor_type, list(tensor.shape))
        assert np.array_equal(np.asarray(ours.data).view(np.uint8),
                              np.asarray(tensor.data).view(np.uint8)), tensor.name
    keys = {key for key in theirs.fields if key.startswith("gpt-oss.")}
    assert keys == {key for key in mine.fields if key.startswith("gpt-oss.")}
    for key in keys:
        field, ours = theirs.fields[key], mine.fields[key]
        assert np.array_equal(field.parts[field.data[0]], ours.parts[ours.data[0]]), key


def test_gpt_oss_without_the_c_decoder_is_one_clear_error(target, monkeypatch):
    """Where the C decoder does not build, a gpt-oss model has no other forward (its experts'
    layers are the C kernel's): one error saying so, not transformers' forward failing."""
    monkeypatch.setattr(MoEDecoder, "build", staticmethod(lambda *args: None))
    with pytest.raises(DresdError, match="'gpt_oss' runs on dresd's C decoder only"):
        make_forward(target.model)


def test_gpt_oss_generation_ends_at_return_and_call_not_at_end(path):
    """The harmony format's answer ends at <|return|> (or <|call|>, a tool call), as llama.cpp
    ends it; <|end|> ends one message of several and is not an end here."""
    reader = open_gguf(path)
    stored = reader.fields["tokenizer.ggml.tokens"].value
    tokens = stored.read()
    eos = reader.fields["tokenizer.ggml.eos_token_id"].value
    for index, text in ((100, "<|return|>"), (101, "<|call|>"), (102, "<|end|>")):
        tokens[index] = text
    reader.fields["tokenizer.ggml.tokens"] = Field(tokens)
    assert gguf_model.gpt_oss_config(reader, path).eos_token_id == [eos, 100, 101]
