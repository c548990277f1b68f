"""A Qwen3.5 file's MTP block as a draft source (`models/mtp.py`, `drafters/mtp.py`).

- The file: the test writer's MTP tensors are llama.cpp's converter's, bit for bit, from a
  checkpoint folder carrying `mtp.*` weights (where the converter is here).
- The block: llama.cpp's `graph_mtp`, computed here in float32 from the checkpoint's weights
  with transformers' own layer; the file's block (bf16 activations) within bf16's reach of it.
- The plumbing: the states the loop hands a drafter are the target's own at those positions,
  bit for bit; the drafter's cached rows give what the block computes from scratch.
- Exactness: `mtp`, and `hybrid` with the block as a source, give plain decoding's tokens,
  alone and batched (random weights: the drafts are mostly rejected, which is the point).
"""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from drafters_for_tests import RandomTreeDrafter
from gguf_files import (
    convert_qwen35_like_llama_cpp,
    convert_with_llama_cpp,
    llama_cpp_converter,
    qwen35_model,
    qwen35_mtp_weights,
    save_transformers_folder,
)
from safetensors.torch import load_file, save_file
from test_batch import run_batched
from test_gguf_rope_scaling import VOCAB

from dresd.decoding import speculative_generate
from dresd.decoding.batch import Request
from dresd.decoding.drafter import DraftContext, Drafter
from dresd.decoding.forward import make_forward
from dresd.decoding.segments import Segment, additive_mask
from dresd.drafters import HybridDrafter, MTPDrafter, NoDrafter
from dresd.errors import UserError
from dresd.kernels import quant
from dresd.models.gguf_file import describe, open_gguf
from dresd.models.mtp import MultiTokenPredictor
from dresd.models.target import load_target

pytestmark = pytest.mark.skipif(quant.kernel() is None,
                                reason="the C kernels need a kernel tier (AVX2 or AVX-512)")


@pytest.fixture(scope="module")
def model():
    return qwen35_model(seed=0)


@pytest.fixture(scope="module")
def mtp_weights(model):
    return qwen35_mtp_weights(model)


@pytest.fixture(scope="module")
def path(model, mtp_weights, tmp_path_factory):
    return convert_qwen35_like_llama_cpp(model, tmp_path_factory.mktemp("mtp") / "m.gguf",
                                         mtp=mtp_weights)


@pytest.fixture(scope="module")
def target(path):
    return load_target(str(path))


def test_the_file_has_a_block_and_a_file_without_has_none(target, path, model, tmp_path):
    assert isinstance(target.model.mtp, MultiTokenPredictor)
    assert describe(open_gguf(path))["mtp_blocks"] == 1  # what `dresd inspect` says
    assert target.model.config.num_hidden_layers == 4  # the block is not one of the layers
    plain = load_target(str(convert_qwen35_like_llama_cpp(model, tmp_path / "p.gguf")))
    assert not hasattr(plain.model, "mtp")
    with pytest.raises(UserError, match="no-mtp"):
        MTPDrafter().check_target(plain)
    hybrid = HybridDrafter(cost={1: 1.0, 2: 1.1, 4: 1.2, 8: 1.5, 16: 2.0}, mtp=True)
    hybrid.check_target(plain)
    assert "mtp" not in hybrid.sources
    by_default = HybridDrafter(cost={1: 1.0, 2: 1.1})  # asked for only (mtp=True)
    by_default.check_target(target)
    assert "mtp" not in by_default.sources


@pytest.mark.skipif(llama_cpp_converter() is None,
                    reason="llama.cpp's converter or sentencepiece is not here (benchmarks/peers/)")
def test_llama_cpps_converter_writes_the_same_mtp_tensors(model, mtp_weights, path, tmp_path):
    folder = save_transformers_folder(model, tmp_path / "qwen35")
    weights = load_file(folder / "model.safetensors")
    weights.update({name: value.to(torch.bfloat16) for name, value in mtp_weights.items()})
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))
    theirs = gguf.GGUFReader(convert_with_llama_cpp(folder, tmp_path / "converted.gguf"))
    ours = gguf.GGUFReader(path)
    tensors = {t.name: t for t in ours.tensors}
    assert {t.name for t in theirs.tensors} == set(tensors)
    assert any(name.startswith("blk.4.nextn.") for name in tensors)
    for tensor in theirs.tensors:
        assert np.array_equal(np.asarray(tensor.data), np.asarray(tensors[tensor.name].data)), \
            tensor.name
    for key in ("qwen35.block_count", "qwen35.nextn_predict_layers"):
        assert theirs.fields[key].contents() == ours.fields[key].contents(), key


def reference_block(model, mtp_weights: dict, tokens: list[int], states: torch.Tensor,
                    positions: list[int]) -> torch.Tensor:
    """llama.cpp's graph_mtp in float32 on the checkpoint's weights: logits [t, vocab]."""
    config, decoder = model.config, model.model
    full = config.layer_types.index("full_attention")
    layer = type(decoder.layers[full])(config, full).eval()
    layer.load_state_dict({name.removeprefix("mtp.layers.0."): value
                           for name, value in mtp_weights.items()
                           if name.startswith("mtp.layers.0.")})

    def norm(name: str) -> torch.nn.Module:
        module = type(decoder.norm)(config.hidden_size, eps=config.rms_norm_eps)
        module.weight.data = mtp_weights[f"mtp.{name}.weight"]
        return module

    with torch.inference_mode():
        joined = torch.cat([norm("pre_fc_norm_embedding")(decoder.embed_tokens(
            torch.tensor(tokens))), norm("pre_fc_norm_hidden")(states)], dim=-1)
        hidden = (joined @ mtp_weights["mtp.fc.weight"].T)[None]
        where = torch.tensor(positions)[None]
        rope = decoder.rotary_emb(hidden, where[None].expand(3, 1, -1))
        causal = torch.ones(len(tokens), len(tokens), dtype=torch.bool).tril()
        attended, _ = layer.self_attn(hidden_states=layer.input_layernorm(hidden),
                                      position_embeddings=rope,
                                      attention_mask=additive_mask(0, causal, torch.float32))
        hidden = hidden + attended
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return model.lm_head(norm("norm")(hidden))[0]


def test_the_block_computes_llama_cpps_graph(target, model, mtp_weights):
    """Six rows of (state, token) pairs: the file's block (bf16 activations) against the
    float32 reference: the same argmax where the reference's top two are apart, and logits
    within a quarter of their spread. Measured by hand: the file's block lies 0.024 spreads
    away; with enorm's +1 left on, 1.97; with eh_proj's halves swapped, 7.2. (Positions off by
    seven: 0.025, inside the bound: the rope turns a quarter of each head, and these random
    weights barely notice: the pairs' positions follow vLLM's MTP convention, position i
    for (h_i, x_{i+1}), and only a trained block could check them.)"""
    generator = torch.Generator().manual_seed(3)
    states = torch.randn(6, model.config.hidden_size, generator=generator)
    states = states / states.pow(2).mean(-1, keepdim=True).sqrt()  # a final norm's scale
    tokens, positions = [11, 900, 4000, 17, 23, 5], [7, 8, 9, 10, 11, 12]
    expected = reference_block(model, mtp_weights, tokens, states, positions)
    block = target.model.mtp
    _, logits = block(block.new_cache(), 0, tokens, states.to(torch.bfloat16), positions)
    scale = expected.std().item()
    assert (logits - expected).abs().max().item() < 0.25 * scale
    top2 = expected.topk(2, dim=-1).values
    apart = (top2[:, 0] - top2[:, 1]) > 0.1 * scale
    assert apart.sum() >= 3
    assert torch.equal(logits.argmax(-1)[apart], expected.argmax(-1)[apart])


class Recording(Drafter):
    """Wraps a drafter, keeping each context it was asked with."""

    name = "recording"

    def __init__(self, inner: Drafter) -> None:
        self.inner, self.contexts = inner, []

    def propose(self, context: DraftContext) -> list[list[int]]:
        self.contexts.append(context)
        return self.inner.propose(context)


def test_the_states_handed_over_are_the_targets_own(target):
    """Each context's `hidden_states` row j is the target's state at its position (the one
    that predicted token first + j + 1), bit for bit a forward of the whole sequence, and its
    last row is `hidden_state`."""
    prompt = [21, 22, 23, 24] * 6 + [5, 6]
    drafter = MTPDrafter(depth=3)
    drafter.check_target(target)
    recording = Recording(drafter)
    result = speculative_generate(target.model, recording, torch.tensor(prompt),
                                  max_new_tokens=16)
    sequence = prompt + result.token_ids
    forward = make_forward(target.model)  # one forward of the whole sequence: its states
    whole = forward([Segment(forward.new_sequence(), sequence, 0, logits_rows="none")])[0].hidden
    assert len(recording.contexts) >= 5
    for context in recording.contexts:
        n, states = len(context.token_ids), context.hidden_states
        assert torch.equal(states[-1], context.hidden_state)
        first = n - 1 - len(states)
        assert torch.equal(states, whole[first:n - 1])


def test_the_cached_rows_give_what_the_block_computes_from_scratch(target):
    """Step after step, the drafter's draft is the block's chain over every reported row,
    recomputed on a fresh cache (rows once, in order)."""
    prompt = np.random.default_rng(4).integers(0, VOCAB, 30).tolist()
    drafter = MTPDrafter(depth=3)
    drafter.check_target(target)
    recording = Recording(drafter)
    drafts = []
    original = drafter.propose

    def propose(context):
        drafts.append(original(context))
        return drafts[-1]

    drafter.propose = propose
    speculative_generate(target.model, recording, torch.tensor(prompt), max_new_tokens=12)
    block = target.model.mtp
    reported: dict[int, tuple[torch.Tensor, int]] = {}  # position -> (state, next token)
    for context, draft in zip(recording.contexts, drafts, strict=True):
        n, states = len(context.token_ids), context.hidden_states
        first = n - 1 - len(states)
        for j in range(len(states)):
            reported[first + j] = (states[j], int(context.token_ids[first + j + 1]))
        positions = sorted(reported)
        cache = block.new_cache()
        out, logits = block(cache, 0, [reported[p][1] for p in positions],
                            torch.stack([reported[p][0] for p in positions]), positions)
        chain, state = [int(logits[-1].argmax())], out[-1:]
        while len(chain) < len(draft[0]):
            state, logits = block(cache, len(positions) + len(chain) - 1, chain[-1:], state,
                                  [n - 2 + len(chain)])
            chain.append(int(logits[-1].argmax()))
        assert draft == [chain]


@pytest.mark.parametrize("quantized", [False, True], ids=["bf16", "q4_0"])
def test_mtp_and_hybrid_with_it_give_plain_decodings_tokens(model, mtp_weights, tmp_path,
                                                            quantized):
    if quantized:
        target = load_target(str(convert_qwen35_like_llama_cpp(
            model, tmp_path / "q4.gguf", gguf.GGMLQuantizationType.Q4_0, mtp=mtp_weights)))
    else:
        target = load_target(str(convert_qwen35_like_llama_cpp(model, tmp_path / "b.gguf",
                                                               mtp=mtp_weights)))
    rng = np.random.default_rng(8)
    prompts = [rng.integers(0, VOCAB, size).tolist() for size in (3, 40)]
    prompts.append([31, 32, 33, 34] * 8)  # repeats: hybrid's other sources draft too
    plain = [speculative_generate(target.model, NoDrafter(), torch.tensor(prompt),
                                  max_new_tokens=20).token_ids for prompt in prompts]
    hybrid = HybridDrafter(cost={1: 1.0, 2: 1.1, 4: 1.2, 8: 1.5, 16: 2.0, 32: 3.0}, mtp=True)
    hybrid.check_target(target)
    assert isinstance(hybrid.sources["mtp"], MTPDrafter)
    mtp = MTPDrafter(depth=3)
    mtp.check_target(target)
    # a request's own options (the server's `with_options`) keep the block
    requests_own = (mtp.with_options(depth=2), hybrid.with_options(draft_len=3))
    assert requests_own[0].block is requests_own[1].sources["mtp"].block is target.model.mtp
    for prompt, expected in zip(prompts, plain, strict=True):
        for drafter in (mtp.fork(), hybrid.fork(), *(own.fork() for own in requests_own)):
            got = speculative_generate(target.model, drafter, torch.tensor(prompt),
                                       max_new_tokens=20).token_ids
            assert got == expected, drafter.name
    requests = [Request(prompt=p, drafter=(mtp if i % 2 else hybrid).fork(),
                        max_new_tokens=20, eos_token_ids=[]) for i, p in enumerate(prompts)]
    requests.append(Request(prompt=prompts[0], drafter=RandomTreeDrafter(seed=1,
                                                                         vocab_size=VOCAB),
                            max_new_tokens=20, eos_token_ids=[]))
    results = run_batched(target.model, requests, [0, 1, 1, 3], max_batch_size=3,
                          prefill_chunk=8)
    assert [r.token_ids for r in results] == [*plain, plain[0]]
