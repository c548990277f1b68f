"""Phi-3 and Phi-4 files (`phi3`): q, k and v in one tensor, gate and up in another, split by
rows into the Mistral layers they compute; a window on every layer where the file sets one
(Phi-3-mini-4k's 2047), none where it is 0 (Phi-4). The reference no one here wrote:
transformers' float32 `Phi3ForCausalLM` on the folder the file was converted from (llama.cpp's
own converter where its sources are here, else `gguf_files.convert_like_llama_cpp`)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from drafters_for_tests import RandomTreeDrafter
from gguf_files import (
    HF_SHAPE,
    PHI3_WINDOW,
    convert_like_llama_cpp,
    convert_phi3_with_llama_cpp,
    llama_cpp_converter,
    save_transformers_folder,
    transformers_model,
)
from test_gguf_rope_scaling import (
    NEW,
    PROMPT,
    VOCAB,
    check_against_reference,
    check_every_method_and_batching,
    dresd_logits,
    random_and_repeating_prompts,
)

from dresd.cli.main import main
from dresd.decoding import speculative_generate
from dresd.decoding.forward import LlamaForward, make_forward
from dresd.drafters import NoDrafter, PromptLookupDrafter
from dresd.errors import DresdError
from dresd.kernels import quant
from dresd.models.gguf_file import describe, open_gguf
from dresd.models.target import load_target

pytestmark = pytest.mark.skipif(quant.kernel() is None,
                                reason="the C kernels need AVX-512 bf16 and VNNI")
ARCHS = ("phi3", "phi3-window")


@pytest.fixture(scope="module")
def models() -> dict:
    return {arch: transformers_model(arch, seed=2) for arch in ARCHS}


@pytest.fixture(scope="module")
def paths(models, tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("phi3")
    return {arch: convert_like_llama_cpp(model, folder / f"{arch}.gguf")
            for arch, model in models.items()}


@pytest.fixture(scope="module")
def targets(paths) -> dict:
    return {arch: load_target(str(path)) for arch, path in paths.items()}


@pytest.fixture(scope="module")
def quantized(models, tmp_path_factory):
    """The windowed model's file with Q4_0 layers: the split rows are whole blocks' rows."""
    return load_target(str(convert_like_llama_cpp(
        models["phi3-window"], tmp_path_factory.mktemp("phi3") / "q4_0.gguf",
        linear_type=gguf.GGMLQuantizationType.Q4_0)))


def test_a_phi3_file_is_mistrals_layers_its_projections_split(targets, paths, models):
    """Either way the C decoder, the window (where the file sets one) on every layer as
    Phi3 applies it. The split rows are the fused tensor's, in order."""
    for target in targets.values():
        forward = make_forward(target.model)
        assert isinstance(forward, LlamaForward) and forward.c_decoder is not None
    assert make_forward(targets["phi3-window"].model).window == PHI3_WINDOW
    assert targets["phi3-window"].model.config.sliding_window == PHI3_WINDOW
    assert targets["phi3"].model.config.sliding_window is None
    layer = targets["phi3"].model.model.layers[0]
    fused = models["phi3"].model.layers[0].self_attn.qkv_proj.weight
    x = torch.randn(3, fused.shape[1]).to(torch.bfloat16)
    split = torch.cat([layer.self_attn.q_proj(x), layer.self_attn.k_proj(x),
                       layer.self_attn.v_proj(x)], dim=-1).float()
    assert (split - x.float() @ fused.T).abs().max() < 0.05  # bf16 activations, bf16 weights
    described = describe(open_gguf(paths["phi3"]))
    assert described["dresd_runs_it_natively"] == "yes"


def test_a_quantized_fused_tensors_rows_split_into_whole_blocks(quantized):
    """Q4_0 q/k/v and gate/up: each part computes the bits of its rows of the whole tensor."""
    reader = open_gguf(Path(quantized.name))
    layer = quantized.model.model.layers[1]
    x = torch.randn(5, HF_SHAPE["hidden_size"]).to(torch.bfloat16)
    for fused, parts in (("attn_qkv", [layer.self_attn.q_proj, layer.self_attn.k_proj,
                                       layer.self_attn.v_proj]),
                         ("ffn_up", [layer.mlp.gate_proj, layer.mlp.up_proj])):
        [tensor] = [t for t in reader.tensors if t.name == f"blk.1.{fused}.weight"]
        assert tensor.tensor_type == gguf.GGMLQuantizationType.Q4_0
        k, n = tensor.shape[:2]
        whole = quant.QuantLinear.from_blocks(tensor.tensor_type, np.asarray(tensor.data), n, k)
        assert torch.equal(torch.cat([part(x) for part in parts], dim=-1), whole(x))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("prompt_seed", [0, 1])
def test_phi3_file_matches_transformers_float32(targets, models, arch, prompt_seed):
    """Logits of 72 positions (with the window, past it more than 3 times), and greedy tokens
    until the reference's own near-tie (these tiny random Phi-3 models have one within 24
    tokens for every seed tried, 0-7: gaps down to 0.001)."""
    assert PROMPT + NEW > 3 * PHI3_WINDOW
    check_against_reference(targets[arch], models[arch], prompt_seed, all_equal=False)


def test_phi3_without_its_window_is_wrong(targets, models, paths):
    """The window matters: the same weights read as if the file set none part from the
    reference (so the test above checks the window, not only the weights)."""
    reader_free = load_target(str(paths["phi3-window"]))
    reader_free.model.config.sliding_window = None
    with pytest.raises(AssertionError):
        check_against_reference(reader_free, models["phi3-window"], all_equal=False)


@pytest.mark.skipif(llama_cpp_converter() is None,
                    reason="llama.cpp's converter or sentencepiece is not here (benchmarks/peers/)")
@pytest.mark.parametrize("arch", ARCHS)
def test_phi3_llama_cpps_own_converter_file(models, paths, arch, tmp_path):
    """llama.cpp's converter writes the same tensors, bit for bit, and the window (0 for
    none); dresd runs its file as the reference does."""
    converted = convert_phi3_with_llama_cpp(models[arch], tmp_path)
    theirs, ours = gguf.GGUFReader(converted), gguf.GGUFReader(paths[arch])
    tensors = {t.name: t for t in ours.tensors}
    assert {t.name for t in theirs.tensors} == set(tensors)
    for tensor in theirs.tensors:
        assert np.array_equal(np.asarray(tensor.data), np.asarray(tensors[tensor.name].data))
    window = theirs.fields["phi3.attention.sliding_window"]
    assert int(window.parts[window.data[0]][0]) == (PHI3_WINDOW if arch == "phi3-window" else 0)
    check_against_reference(load_target(str(converted)), models[arch], all_equal=False)


@pytest.mark.parametrize("arch", [*ARCHS, "phi3-window-q4_0"])
def test_phi3_every_method_is_plain_decoding_and_batched_is_alone(targets, quantized, arch):
    model = quantized.model if arch.endswith("q4_0") else targets[arch].model
    check_every_method_and_batching(model, random_and_repeating_prompts(), [0, 0, 2, 5], 8)


def test_phi3_files_dresd_does_not_run_are_one_clear_error(models, tmp_path, capsys):
    """A rope turning an odd number of a head's dimensions, and LongRoPE with one of its two
    factor tensors, are refused, and `dresd inspect` says so (LongRoPE and partial rotary
    factors dresd runs: test_gguf_phi3_longrope.py)."""
    partial = transformers_model("phi3", seed=2)
    partial.config.rope_parameters["partial_rotary_factor"] = 33 / 64
    partial_file = convert_like_llama_cpp(partial, tmp_path / "partial.gguf")
    with pytest.raises(DresdError, match="turning 33 of each head's 64"):
        load_target(str(partial_file))
    assert main(["inspect", str(partial_file), "--json"]) == 0  # says so before a load
    figures = json.loads(capsys.readouterr().out)
    assert figures["dresd_runs_it_natively"].startswith("no (")
    assert "turning 33" in figures["dresd_runs_it_natively"]
    assert figures["forward"] is None
    path = convert_like_llama_cpp(models["phi3"], tmp_path / "longrope.gguf",
                                  extra_tensors={"rope_factors_long.weight": np.ones(32)})
    with pytest.raises(DresdError, match="LongRoPE needs both"):
        load_target(str(path))


def test_a_mistral_folder_with_a_window_runs_on_the_c_decoder(tmp_path):
    """The same path for a transformers folder (Mistral-7B-v0.1's window on every layer):
    the batched C decoder, the bits of transformers' own forward, 72 positions past a window
    of 20."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(**HF_SHAPE, sliding_window=PHI3_WINDOW))
    target = load_target(str(save_transformers_folder(model, tmp_path / "mistral")),
                         dtype="bfloat16")
    forward = make_forward(target.model)
    assert isinstance(forward, LlamaForward) and forward.c_decoder is not None
    assert forward.window == PHI3_WINDOW
    ids = np.random.default_rng(2).integers(0, VOCAB, PROMPT + NEW).tolist()
    with torch.inference_mode():
        own = target.model(torch.tensor([ids])).logits[0].float()
    assert torch.equal(dresd_logits(target, ids), own)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_phi3_folder_runs_as_its_file_does(models, arch, tmp_path):
    """A transformers folder takes the same path: its fused weights split by rows into
    Mistral's modules, on the C decoder, the window on every layer; the reference's logits
    and tokens, every method `ar`'s."""
    target = load_target(str(save_transformers_folder(models[arch], tmp_path / arch)),
                         dtype="bfloat16")
    assert type(target.model).__name__ == "MistralForCausalLM"
    forward = make_forward(target.model)
    assert isinstance(forward, LlamaForward) and forward.c_decoder is not None
    assert forward.window == (PHI3_WINDOW if arch == "phi3-window" else None)
    check_against_reference(target, models[arch], all_equal=False)
    prompt = [21, 22, 23, 24] * 6
    plain = speculative_generate(target.model, NoDrafter(), torch.tensor(prompt),
                                 max_new_tokens=24).token_ids
    for drafter in (PromptLookupDrafter(num_drafts=3), RandomTreeDrafter(seed=3,
                                                                         vocab_size=VOCAB)):
        assert speculative_generate(target.model, drafter, torch.tensor(prompt),
                                    max_new_tokens=24).token_ids == plain


def test_a_phi3_folder_mistral_cannot_compute_stays_phi3(tmp_path):
    """A rope dresd's layers cannot turn (an odd number of each head's dimensions) stays on
    transformers' own Phi3 forward (Phi-4-mini's 0.75 runs: test_gguf_phi3_longrope.py)."""
    model = transformers_model("phi3", seed=2)
    model.config.rope_parameters["partial_rotary_factor"] = 33 / 64
    target = load_target(str(save_transformers_folder(model, tmp_path / "partial")))
    assert type(target.model).__name__ == "Phi3ForCausalLM"
