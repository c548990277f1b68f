"""Llama 3.1-3.3's rope scaling, and linear and YaRN scaling, as llama.cpp's converter stores
them (`rope_freqs.weight`; `rope.scaling.*` metadata), against a reference no one here wrote:
transformers' float32 model on the folder the file was converted from, over prompts far past
the scaling's original context (32 tokens). The file is written by llama.cpp's own
`convert_hf_to_gguf.py` where its sources are on this machine, and always by
`gguf_files.convert_like_llama_cpp` (checked here to write the converter's tensors bit for
bit). A transformers folder with scaled rope runs on the batched C decoder, its bits those of
transformers' own bf16 forward."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from drafters_for_tests import OracleDrafter, RandomTreeDrafter
from gguf_files import (
    LINEAR_ROPE,
    LLAMA3_ROPE,
    YARN_ROPE,
    convert_like_llama_cpp,
    convert_with_llama_cpp,
    llama_cpp_converter,
    save_transformers_folder,
    transformers_model,
)
from test_batch import run_batched

from dresd.decoding import speculative_generate
from dresd.decoding.batch import Request
from dresd.decoding.forward import LlamaForward, Segment, make_forward
from dresd.drafters import NoDrafter, PromptLookupDrafter
from dresd.kernels import quant
from dresd.models import gguf as gguf_model
from dresd.models.target import load_target

pytestmark = pytest.mark.skipif(quant.kernel() is None,
                                reason="the C kernels need AVX-512 bf16 and VNNI")
VOCAB = 49152
PROMPT, NEW = 48, 24  # 72 positions: more than twice the original context of 32
# bf16 activations against float32: logits within 2% of the largest logit (measured: 0.7%),
# and greedy tokens equal wherever the reference's two best logits are 0.05 or more apart
LOGIT_TOLERANCE, NEAR_TIE = 0.02, 0.05
ROPES = {"llama3": LLAMA3_ROPE, "linear": LINEAR_ROPE, "yarn": YARN_ROPE}
SEED = 1  # the weights' (seed 1's greedy path has no near-tie in the llama3 case)


def reference_greedy(model, prompt: list[int], new: int = NEW
                     ) -> tuple[list[int], torch.Tensor, list[float]]:
    """transformers' float32 greedy continuation, the logits of every position of prompt +
    continuation, and each step's gap between the two best logits."""
    ids, gaps = torch.tensor([prompt]), []
    with torch.inference_mode():
        for _ in range(new):
            logits = model(ids).logits[0, -1]
            best = logits.topk(2).values
            gaps.append(float(best[0] - best[1]))
            ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
        return ids[0, len(prompt):].tolist(), model(ids).logits[0], gaps


def dresd_logits(target, ids: list[int]) -> torch.Tensor:
    forward = make_forward(target.model)
    [out] = forward([Segment(forward.new_sequence(), ids, 0)])
    return out.logits.float()


def tokens_agreeing(got: list[int], expected: list[int]) -> int:
    """How many tokens agree before the first that differs."""
    return next((i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b),
                len(expected))


def check_against_reference(target, model, prompt_seed: int = 0, all_equal: bool = True
                            ) -> tuple[int, float]:
    """dresd's greedy tokens and logits from the file against transformers' float32 model:
    (tokens agreeing, largest logit difference). With `all_equal` every token must agree;
    else they may part only after a near-tie of the reference."""
    prompt = np.random.default_rng(prompt_seed).integers(0, VOCAB, PROMPT).tolist()
    expected, logits, gaps = reference_greedy(model, prompt)
    got = speculative_generate(target.model, NoDrafter(), torch.tensor(prompt),
                               max_new_tokens=NEW).token_ids
    agree = tokens_agreeing(got, expected)
    assert agree == NEW if all_equal else (agree == NEW or gaps[agree] < NEAR_TIE), (agree, gaps)
    difference = (dresd_logits(target, prompt + expected) - logits).abs().max().item()
    assert difference < LOGIT_TOLERANCE * logits.abs().max().item(), difference
    return agree, difference


def random_and_repeating_prompts() -> list[list[int]]:
    """Random prompts of 5, 33 and 60 tokens, and one of a repeated motif (PLD drafts)."""
    rng = np.random.default_rng(6)
    prompts = [rng.integers(0, VOCAB, size).tolist() for size in (5, 33, 60)]
    return [*prompts, [21, 22, 23, 24] * 6]


def check_every_method_and_batching(model, prompts: list[list[int]], arrivals: list[int],
                                    prefill_chunk: int) -> None:
    """PLD, an oracle with half its drafts corrupted and random trees give plain decoding's 24
    tokens on every prompt; batched (requests arriving at the steps `arrivals`, 3 at a time,
    prompts in chunks of `prefill_chunk`), each prompt gives its tokens alone."""
    plain = [speculative_generate(model, NoDrafter(), torch.tensor(prompt),
                                  max_new_tokens=24).token_ids for prompt in prompts]
    for prompt, expected in zip(prompts, plain, strict=True):
        for drafter in (PromptLookupDrafter(num_drafts=3),
                        OracleDrafter(len(prompt), expected, draft_len=6, corrupt=0.5, seed=1,
                                      vocab_size=VOCAB),
                        RandomTreeDrafter(seed=len(prompt), vocab_size=VOCAB)):
            got = speculative_generate(model, drafter, torch.tensor(prompt),
                                       max_new_tokens=24).token_ids
            assert got == expected, type(drafter).__name__
    requests = [Request(prompt=p, drafter=PromptLookupDrafter(num_drafts=2), max_new_tokens=24,
                        eos_token_ids=[]) for p in prompts]
    results = run_batched(model, requests, arrivals, max_batch_size=3,
                          prefill_chunk=prefill_chunk)
    assert [r.token_ids for r in results] == plain


@pytest.fixture(scope="module")
def models() -> dict:
    return {name: transformers_model("llama", rope, seed=SEED) for name, rope in ROPES.items()}


@pytest.fixture(scope="module")
def files(models, tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("rope")
    return {name: convert_like_llama_cpp(model, folder / f"{name}.gguf")
            for name, model in models.items()}


@pytest.fixture(scope="module")
def targets(files) -> dict:
    return {name: load_target(str(path)) for name, path in files.items()}


@pytest.mark.parametrize("name", list(ROPES))
def test_file_matches_transformers_float32_past_the_original_context(targets, models, name):
    check_against_reference(targets[name], models[name], all_equal=name == "llama3")


def test_inspect_names_each_files_rope_scaling(files):
    """`dresd inspect` says how each file scales its rope, as the converter stored it."""
    from dresd.models.gguf_file import describe, open_gguf

    named = {name: describe(open_gguf(path))["rope_scaling"] for name, path in files.items()}
    assert named == {"llama3": "llama3 (rope_freqs)", "linear": "linear", "yarn": "yarn"}


def test_llama3_file_fails_without_rope_freqs(files, models, monkeypatch):
    """The bug this fixes: with rope_freqs ignored (as before), the file's tokens part from the
    reference's at once and its logits are far off."""
    monkeypatch.setattr(gguf_model, "divide_rope_frequencies", lambda rotary, factors: None)
    target = load_target(str(files["llama3"]))
    prompt = np.random.default_rng(0).integers(0, VOCAB, PROMPT).tolist()
    expected, logits, _ = reference_greedy(models["llama3"], prompt)
    got = speculative_generate(target.model, NoDrafter(), torch.tensor(prompt),
                               max_new_tokens=NEW).token_ids
    assert tokens_agreeing(got, expected) < NEW // 2
    difference = (dresd_logits(target, prompt + expected) - logits).abs().max().item()
    assert difference > 5 * LOGIT_TOLERANCE * logits.abs().max().item()


@pytest.mark.skipif(llama_cpp_converter() is None,
                    reason="llama.cpp's converter or sentencepiece is not here (benchmarks/peers/)")
@pytest.mark.parametrize("name", list(ROPES))
def test_llama_cpps_own_converter_writes_the_same_tensors(models, files, name, tmp_path):
    """The converter's file holds every tensor of `convert_like_llama_cpp`'s, bit for bit
    (rope_freqs included), and the same rope metadata; dresd runs the converter's Llama 3
    file as the reference does (the others' tensors and rope being the same, so is their
    run)."""
    folder = save_transformers_folder(models[name], tmp_path / name)
    theirs = gguf.GGUFReader(convert_with_llama_cpp(folder, tmp_path / "converted.gguf"))
    ours = gguf.GGUFReader(files[name])
    tensors = {t.name: t for t in ours.tensors}
    assert {t.name for t in theirs.tensors} == set(tensors)
    for tensor in theirs.tensors:
        assert tensor.tensor_type == tensors[tensor.name].tensor_type, tensor.name
        assert np.array_equal(np.asarray(tensor.data), np.asarray(tensors[tensor.name].data))
    rope = {key: field.contents() for key, field in ours.fields.items() if ".rope." in key}
    assert {key: field.contents() for key, field in theirs.fields.items()
            if ".rope." in key} == rope
    if name == "llama3":
        check_against_reference(load_target(str(tmp_path / "converted.gguf")), models[name])


def test_every_method_is_plain_decoding_and_batched_is_alone(targets):
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, VOCAB, size).tolist() for size in (40, 70)]
    prompts.append([11, 12, 13, 11, 12, 13] * 7)  # repeats: PLD drafts, past position 32
    check_every_method_and_batching(targets["llama3"].model, prompts, [0, 1, 3], 16)


@pytest.mark.parametrize("name", list(ROPES))
def test_scaled_transformers_folder_runs_on_the_c_decoder(models, name, tmp_path):
    """A folder with rope scaling: the batched forward on the C decoder (no more fallback to
    transformers' unbatched forward), its logits the bits of transformers' own bf16 forward
    (cos and sin from the model's rotary embedding, attention_scaling included: YaRN's is
    1.14 here). In bf16, as `--dtype auto` loads it where the CPU multiplies bf16 natively
    (elsewhere auto is float32, which runs on PyTorch's linears)."""
    target = load_target(str(save_transformers_folder(models[name], tmp_path / name)),
                         dtype="bfloat16")
    forward = make_forward(target.model)
    assert isinstance(forward, LlamaForward) and forward.c_decoder is not None
    ids = np.random.default_rng(2).integers(0, VOCAB, 70).tolist()
    with torch.inference_mode():
        own = target.model(torch.tensor([ids])).logits[0].float()
    assert torch.equal(dresd_logits(target, ids), own)


def test_dynamic_rope_stays_on_transformers_forward():
    """Dynamic scaling recomputes the frequencies from the longest position in a call: a row's
    bits would depend on the rows beside it, so the batched forward does not take it."""
    model = transformers_model("llama", {"rope_type": "dynamic", "rope_theta": 10000.0,
                                         "factor": 2.0})
    assert not LlamaForward.takes(model)
