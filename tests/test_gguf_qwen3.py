"""Qwen3 (dense) files on the C decoder: RMSNorm on each head of q and k before the rotary
embedding, no q/k/v bias, no q/k permutation. The reference no one here wrote: transformers'
float32 `Qwen3ForCausalLM` on the folder the file was converted from (llama.cpp's own
converter where its sources are here, else `gguf_files.convert_like_llama_cpp`)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf_files import (
    convert_like_llama_cpp,
    convert_with_llama_cpp,
    llama_cpp_converter,
    save_transformers_folder,
    transformers_model,
)
from test_gguf_rope_scaling import (
    VOCAB,
    check_against_reference,
    check_every_method_and_batching,
    dresd_logits,
    random_and_repeating_prompts,
)

from dresd.decoding.forward import LlamaForward, Segment, make_forward
from dresd.kernels import quant
from dresd.models.gguf_file import describe, open_gguf
from dresd.models.target import load_target

pytestmark = pytest.mark.skipif(quant.kernel() is None,
                                reason="the C kernels need AVX-512 bf16 and VNNI")


@pytest.fixture(scope="module")
def model():
    return transformers_model("qwen3", {"rope_type": "default", "rope_theta": 1e6}, seed=1)


@pytest.fixture(scope="module")
def path(model, tmp_path_factory):
    return convert_like_llama_cpp(model, tmp_path_factory.mktemp("qwen3") / "qwen3.gguf")


@pytest.fixture(scope="module")
def target(path):
    return load_target(str(path))


def test_qwen3_file_runs_on_the_c_decoder(target, path):
    forward = make_forward(target.model)
    assert isinstance(forward, LlamaForward) and forward.c_decoder is not None
    assert target.model.config.head_dim == 64  # the file's key_length
    described = describe(open_gguf(path))
    assert described["dresd_runs_it_natively"] == "yes"
    assert described["forward"] == "dresd's C decoder"


@pytest.mark.parametrize("prompt_seed", [0, 1])
def test_qwen3_file_matches_transformers_float32(target, model, prompt_seed):
    check_against_reference(target, model, prompt_seed)


def test_qwen3_without_head_norms_is_wrong(target):
    """The q/k norms matter: left out of one forward's C decoder, the logits are far off."""
    forward = make_forward(target.model)  # its own C decoder struct
    forward.c_decoder.struct.q_norm = forward.c_decoder.struct.k_norm = None  # NULL: none
    ids = np.random.default_rng(3).integers(0, VOCAB, 40).tolist()
    [out] = forward([Segment(forward.new_sequence(), ids, 0)])
    assert (out.logits.float() - dresd_logits(target, ids)).abs().max() > 1.0


@pytest.mark.skipif(llama_cpp_converter() is None,
                    reason="llama.cpp's converter or sentencepiece is not here (benchmarks/peers/)")
def test_qwen3_llama_cpps_own_converter_file(model, path, tmp_path):
    """llama.cpp's converter writes the same tensors, bit for bit; dresd runs its file as the
    reference does."""
    folder = save_transformers_folder(model, tmp_path / "qwen3")
    converted = convert_with_llama_cpp(folder, tmp_path / "converted.gguf")
    theirs, ours = gguf.GGUFReader(converted), gguf.GGUFReader(path)
    tensors = {t.name: t for t in ours.tensors}
    assert {t.name for t in theirs.tensors} == set(tensors)
    for tensor in theirs.tensors:
        assert np.array_equal(np.asarray(tensor.data), np.asarray(tensors[tensor.name].data))
    check_against_reference(load_target(str(converted)), model)


def test_qwen3_every_method_is_plain_decoding_and_batched_is_alone(target):
    check_every_method_and_batching(target.model, random_and_repeating_prompts(), [0, 0, 2, 5],
                                    8)


def test_qwen3_transformers_folder_runs_on_the_c_decoder(model, tmp_path):
    """A bf16 Qwen3 folder: the batched C decoder, the bits of transformers' own forward."""
    target = load_target(str(save_transformers_folder(model, tmp_path / "folder")),
                         dtype="bfloat16")
    forward = make_forward(target.model)
    assert isinstance(forward, LlamaForward) and forward.c_decoder is not None
    ids = np.random.default_rng(2).integers(0, VOCAB, 50).tolist()
    with torch.inference_mode():
        own = target.model(torch.tensor([ids])).logits[0].float()
    assert torch.equal(dresd_logits(target, ids), own)
