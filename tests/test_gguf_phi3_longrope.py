"""Phi-3's LongRoPE and partial rotary factor (Phi-3-mini-128k, Phi-3.5-mini, Phi-4-mini): a
tiny Phi-4-mini-shaped model (`PHI3_LONGROPE`: 48 of each head's 64 dimensions turned, the
long factors from position 32 on) from its GGUF file and from its transformers folder, against
transformers' float32 `Phi3ForCausalLM` decoding token by token (its `generate`: a call per
new token, so each row's factors are its own position's, as dresd's are: `models/phi3.py`)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf_files import (
    PHI3_LONGROPE,
    convert_like_llama_cpp,
    convert_phi3_with_llama_cpp,
    llama_cpp_converter,
    save_transformers_folder,
    transformers_model,
)
from test_gguf_rope_scaling import (
    LOGIT_TOLERANCE,
    NEAR_TIE,
    VOCAB,
    check_every_method_and_batching,
    dresd_logits,
    random_and_repeating_prompts,
    tokens_agreeing,
)
from transformers import DynamicCache

from dresd.decoding import speculative_generate
from dresd.decoding.forward import LlamaForward, make_forward
from dresd.drafters import NoDrafter
from dresd.errors import DresdError
from dresd.kernels import quant
from dresd.models import phi3
from dresd.models.gguf_file import describe, open_gguf
from dresd.models.target import load_target

pytestmark = pytest.mark.skipif(quant.kernel() is None,
                                reason="the C kernels need AVX-512 bf16 and VNNI")
PROMPT, NEW = 24, 40  # inside the original context of 32, then 32 positions past it


@pytest.fixture(scope="module")
def model():
    return transformers_model("phi3", rope=dict(PHI3_LONGROPE), seed=2)


@pytest.fixture(scope="module")
def path(model, tmp_path_factory):
    return convert_like_llama_cpp(model, tmp_path_factory.mktemp("longrope") / "phi3.gguf")


@pytest.fixture(scope="module")
def targets(model, path, tmp_path_factory) -> dict:
    folder = save_transformers_folder(model, tmp_path_factory.mktemp("longrope") / "folder")
    return {"file": load_target(str(path)),
            "folder": load_target(str(folder), dtype="bfloat16")}


def reference_decoding(model, prompt: list[int], new: int = NEW
                       ) -> tuple[list[int], torch.Tensor, list[float]]:
    """transformers' float32 greedy decoding as its `generate` runs it (the prompt in one call,
    then one call per token on its cache): the tokens, the logits each token was chosen from,
    and each step's gap between the two best logits."""
    cache, tokens, logits, gaps = DynamicCache(config=model.config), [], [], []
    with torch.inference_mode():
        out = model(torch.tensor([prompt]), cache=cache, use_cache=True)
        for _ in range(new):
            step = out.logits[0, -1]
            best = step.topk(2).values
            gaps.append(float(best[0] - best[1]))
            logits.append(step)
            tokens.append(int(step.argmax()))
            out = model(torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True)
    return tokens, torch.stack(logits), gaps


def check_against_reference(target, model, prompt_seed: int = 0) -> None:
    """dresd's greedy tokens equal the reference's (or part only after its near-tie), and the
    logits of every new position are within LOGIT_TOLERANCE of its largest."""
    prompt = np.random.default_rng(prompt_seed).integers(0, VOCAB, PROMPT).tolist()
    expected, logits, gaps = reference_decoding(model, prompt)
    got = speculative_generate(target.model, NoDrafter(), torch.tensor(prompt),
                               max_new_tokens=NEW).token_ids
    agree = tokens_agreeing(got, expected)
    assert agree == NEW or gaps[agree] < NEAR_TIE, (agree, gaps)
    mine = dresd_logits(target, prompt + expected)[PROMPT - 1:PROMPT - 1 + NEW]
    difference = (mine - logits).abs().max().item()
    assert difference < LOGIT_TOLERANCE * logits.abs().max().item(), difference


@pytest.mark.parametrize("source", ["file", "folder"])
@pytest.mark.parametrize("prompt_seed", [0, 1])
def test_longrope_matches_transformers_decoding_past_the_original_context(
        targets, model, source, prompt_seed):
    target = targets[source]
    forward = make_forward(target.model)
    assert isinstance(forward, LlamaForward) and forward.c_decoder is not None
    assert isinstance(target.model.model.rotary_emb, phi3.RotaryByPosition)
    check_against_reference(target, model, prompt_seed)


def test_inspect_names_the_rope(path):
    """`dresd inspect` says how the file turns its heads: 48 dimensions, LongRoPE over 32."""
    described = describe(open_gguf(path))
    assert described["dresd_runs_it_natively"] == "yes"
    assert (described["rope_dimensions"], described["rope_scaling"],
            described["rope_original_context"]) == (48, "longrope", 32)


def test_the_long_factors_and_the_partial_turn_each_matter(targets, model, path, monkeypatch):
    """The checks above can fail: with the short factors at every position, or the heads kept
    in the model's own order (the C decoder then turns the wrong pairs), the logits part."""
    short_only = load_target(str(path))
    short_only.model.model.rotary_emb.original = 10 ** 9
    with pytest.raises(AssertionError):
        check_against_reference(short_only, model)
    monkeypatch.setattr(phi3, "head_rows", lambda heads, head_dim, rope: None)
    unordered = load_target(str(path))
    with pytest.raises(AssertionError):
        check_against_reference(unordered, model)


def test_a_rows_cos_and_sin_are_its_positions_alone_and_transformers_bits(model):
    """Each row's cos and sin, whatever rows share the call, are the bits transformers'
    Phi3RotaryEmbedding gives for a call holding that row alone (its turned dimensions;
    the others cos 1, sin 0), short factors below 32 and long from 32 on."""
    config = model.config
    rope = phi3.rope_of_config(config)
    mine = phi3.RotaryByPosition(rope, config.head_dim, config.rope_parameters["rope_theta"])
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = mine(x, torch.arange(100)[None])
    theirs = type(model.model.rotary_emb)(config=config)
    order = phi3.turned_pairs_apart(config.head_dim, rope["turned"])
    turned = torch.from_numpy(order < rope["turned"])
    for position in (0, 5, 31, 32, 33, 99):
        alone_cos, alone_sin = mine(x, torch.tensor([[position]]))
        assert torch.equal(alone_cos[0, 0], cos[0, position])
        assert torch.equal(alone_sin[0, 0], sin[0, position])
        their_cos, their_sin = theirs(x, torch.tensor([[position]]))
        back = torch.from_numpy(order[turned.numpy()])  # the model's turned dimensions
        assert torch.equal(cos[0, position, turned], their_cos[0, 0, back])
        assert torch.equal(sin[0, position, turned], their_sin[0, 0, back])
        assert bool((cos[0, position, ~turned] == 1).all())
        assert bool((sin[0, position, ~turned] == 0).all())
    # transformers' own call over positions 0-99 turns position 5 by the long factors: a row's
    # bits there depend on the rows beside it, which is why dresd does not call it so
    their_cos = theirs(x, torch.arange(100)[None])[0]
    assert not torch.equal(cos[0, 5, turned], their_cos[0, 5, torch.from_numpy(
        order[turned.numpy()])])


def test_longrope_every_method_is_plain_decoding_and_batched_is_alone(targets):
    """Prompts of 5 to 60 tokens and 24 new: drafts verified across position 32, in chunks of
    8, three sequences at a time."""
    check_every_method_and_batching(targets["file"].model, random_and_repeating_prompts(),
                                    [0, 0, 2, 5], 8)


@pytest.mark.skipif(llama_cpp_converter() is None,
                    reason="llama.cpp's converter or sentencepiece is not here (benchmarks/peers/)")
def test_llama_cpps_own_converter_writes_longrope_as_read_here(model, path, tmp_path):
    """llama.cpp's converter writes the same tensors (the two factor tensors among them) and the
    same attention factor and original context; dresd runs its file as the reference does."""
    converted = convert_phi3_with_llama_cpp(model, tmp_path)
    theirs, ours = gguf.GGUFReader(converted), gguf.GGUFReader(path)
    tensors = {t.name: t for t in ours.tensors}
    assert {t.name for t in theirs.tensors} == set(tensors)
    assert "rope_factors_long.weight" in tensors
    for tensor in theirs.tensors:
        assert np.array_equal(np.asarray(tensor.data), np.asarray(tensors[tensor.name].data))
    for key in ("phi3.rope.scaling.attn_factor", "phi3.rope.scaling.original_context_length",
                "phi3.rope.dimension_count"):
        field, own = theirs.fields[key], ours.fields[key]
        assert field.parts[field.data[0]][0] == own.parts[own.data[0]][0], key
    check_against_reference(load_target(str(converted)), model)


@pytest.mark.parametrize("change, message", [
    ({"partial_rotary_factor": 33 / 64}, "turning 33 of each head's 64"),
    ({"long_factor": [1.0] * 23}, "23 factors for 24 turned pairs"),
])
def test_a_rope_dresd_does_not_run_is_one_clear_error(change, message, tmp_path):
    model = transformers_model("phi3", rope=dict(PHI3_LONGROPE), seed=2)
    model.config.rope_parameters.update(change)
    with pytest.raises(DresdError, match=message):
        load_target(str(convert_like_llama_cpp(model, tmp_path / "odd.gguf")))
