"""GGUF files run natively: the quantized kernel against references no one here wrote (the
`gguf` package's dequantizers, transformers' own GGUF loader), its rows batch-invariant, and
every method exactly the file's own plain decoding, alone and batched."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from drafters_for_tests import OracleDrafter, RandomTreeDrafter
from gguf_files import (
    GEMMA3_TINY,
    Q,
    gemma3_model,
    gemma_vocab,
    random_blocks,
    write_tiny_gguf,
)
from test_batch import run_batched
from transformers import AutoModelForCausalLM, AutoTokenizer

from dresd.decoding import speculative_generate
from dresd.decoding.batch import Request
from dresd.decoding.forward import LlamaForward, make_forward
from dresd.drafters import NoDrafter, PromptLookupDrafter, make_drafter
from dresd.errors import DresdError
from dresd.kernels import quant
from dresd.models import gguf as gguf_model
from dresd.models.gguf_file import Field, describe, open_gguf
from dresd.models.target import load_target

pytestmark = pytest.mark.skipif(quant.kernel() is None,
                                reason="the quantized kernel needs AVX-512 VNNI")
TYPES = list(quant.LAYOUTS)


def raw_tensor(qtype: Q, n: int, k: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        return random_blocks(qtype, n, k, rng)
    return gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05, qtype)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_unpacked_blocks_are_the_gguf_packages_values(qtype):
    n, k = 40, 512
    raw = raw_tensor(qtype, n, k)
    expected = gguf.quants.dequantize(raw, qtype).reshape(n, k)
    assert np.array_equal(quant.dequantize(qtype, raw, n, k), expected)


def quantized_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [m, k] float32 -> (xq, dx per block), as quant.c's header says."""
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = np.abs(blocks).max(axis=2, keepdims=True)
    inverse = np.where(amax > 0, np.float32(127) / np.maximum(amax, 1e-30), 0).astype(np.float32)
    xq = np.rint((blocks * inverse).astype(np.float32))
    return xq.reshape(x.shape), (amax / np.float32(127))[..., 0]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_kernel_computes_the_sum_its_header_states(qtype):
    n, k = 50, 256  # 50 outputs: a panel and a part-filled one
    raw = raw_tensor(qtype, n, k, seed=1)
    packed = quant.pack(qtype, raw, n, k)
    x = torch.randn(5, k).to(torch.bfloat16)
    xq, dx = quantized_rows(x.float().numpy())
    weight = quant.dequantize(qtype, raw, n, k).astype(np.float64)
    # sum over blocks of dx * (sum of w * xq): the same sum, in float64
    per_block = np.einsum("mbj,nbj->mnb", xq.reshape(5, -1, 32), weight.reshape(n, -1, 32))
    expected = (per_block * dx[:, None, :]).sum(axis=2)
    got = quant.linear(x, qtype, packed, n, out_dtype=torch.float32).double().numpy()
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q6_K],
                         ids=lambda t: t.name)
def test_a_rows_output_does_not_depend_on_the_rows_beside_it(qtype):
    n, k = 70, 256
    raw = raw_tensor(qtype, n, k, seed=2)
    packed = quant.pack(qtype, raw, n, k)
    bias = torch.randn(n)
    x = torch.randn(13, k).to(torch.bfloat16)
    alone = torch.cat([quant.linear(x[i:i + 1], qtype, packed, n, bias) for i in range(13)])
    threads = torch.get_num_threads()
    try:
        for count in (2, 3, 4, 5, 8, 13):
            for t in (1, 2):
                torch.set_num_threads(t)
                assert torch.equal(quant.linear(x[:count], qtype, packed, n, bias),
                                   alone[:count])
    finally:
        torch.set_num_threads(threads)


def test_fused_projections_give_the_separate_ones_bits():
    k = 128
    parts = [quant.QuantLinear.from_blocks(Q.Q4_1, raw_tensor(Q.Q4_1, n, k, seed=n), n, k,
                                           torch.randn(n)) for n in (64, 32, 32)]
    x = torch.randn(6, k).to(torch.bfloat16)
    separate = torch.cat([part(x) for part in parts], dim=-1)
    fused = quant.fuse(parts)
    assert isinstance(fused, quant.QuantLinear)
    assert torch.equal(fused(x), separate)
    assert torch.equal(torch.cat([part(x) for part in parts], dim=-1), separate)  # views
    mixed = [parts[0], quant.QuantLinear.from_blocks(Q.Q8_0, raw_tensor(Q.Q8_0, 20, k), 20, k)]
    together = quant.fuse(mixed)
    assert isinstance(together, quant.QuantParts)
    assert torch.equal(together(x), torch.cat([m(x) for m in mixed], dim=-1))


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("gguf")
    return {
        "llama-q4_1": write_tiny_gguf(folder / "llama-q4_1.gguf", Q.Q4_1, tied=False),
        "qwen2-q8_0": write_tiny_gguf(folder / "qwen2-q8_0.gguf", Q.Q8_0, arch="qwen2",
                                      embedding_type=Q.Q4_0, tied=False),
        "llama-mixed": write_tiny_gguf(folder / "llama-mixed.gguf", Q.Q4_K, v_type=Q.Q8_0,
                                       embedding_type=Q.F32, seed=3),
    }


@pytest.fixture(scope="module")
def targets(tiny_files) -> dict:
    return {name: load_target(str(path)) for name, path in tiny_files.items()}


@pytest.mark.parametrize("name", ["llama-q4_1", "qwen2-q8_0"])
def test_logits_match_transformers_on_the_dequantized_file(tiny_files, targets, name):
    """transformers' own GGUF loader (its dequantizers, its q/k unpermutation) in float32 is
    the reference: dresd's logits on the blocks, with 8-bit activations, stay close to it."""
    path = tiny_files[name]
    reference = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                     dtype=torch.float32).eval()
    ids = torch.tensor([np.random.default_rng(0).integers(0, 49152, 48).tolist()])
    with torch.inference_mode():
        expected = reference(ids).logits[0]
        got = teacher_forced_logits(targets[name], ids[0].tolist())
    error = (got - expected).norm(dim=-1) / expected.norm(dim=-1)
    assert error.max() < 0.08, error.max()
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9


def teacher_forced_logits(target, ids: list[int]) -> torch.Tensor:
    from dresd.decoding.forward import Segment

    forward = make_forward(target.model)
    sequence = forward.new_sequence()
    [out] = forward([Segment(sequence, ids, 0)])
    return out.logits.float()


def test_every_method_is_the_files_own_plain_decoding(targets):
    target = targets["llama-q4_1"]
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 49152, size).tolist() for size in (5, 17, 40)]
    prompts.append([11, 12, 13, 11, 12, 13, 11, 12])  # repeats: PLD drafts
    eos = target.eos_token_ids
    for prompt in prompts:
        plain = speculative_generate(target.model, NoDrafter(),
                                     torch.tensor(prompt), max_new_tokens=24,
                                     eos_token_ids=eos).token_ids
        drafters = [PromptLookupDrafter(num_drafts=3),
                    OracleDrafter(len(prompt), plain, draft_len=6, corrupt=0.5, seed=1,
                                  vocab_size=49152),
                    RandomTreeDrafter(seed=len(prompt), vocab_size=49152)]
        for drafter in drafters:
            got = speculative_generate(target.model, drafter, torch.tensor(prompt),
                                       max_new_tokens=24, eos_token_ids=eos).token_ids
            assert got == plain, type(drafter).__name__


def test_batched_is_bit_for_bit_alone(targets):
    # q, k: Q5_0 (too narrow for Q4_K, as llama-quantize falls back), v: Q8_0, so q/k/v run
    # as parts; the MLP's down projection in Q4_K
    target = targets["llama-mixed"]
    rng = np.random.default_rng(6)
    prompts = [rng.integers(0, 49152, size).tolist() for size in (3, 30, 9, 21)]
    alone = [speculative_generate(target.model, PromptLookupDrafter(num_drafts=2),
                                  torch.tensor(p), max_new_tokens=20).token_ids
             for p in prompts]
    requests = [Request(prompt=p, drafter=PromptLookupDrafter(num_drafts=2), max_new_tokens=20,
                        eos_token_ids=[]) for p in prompts]
    results = run_batched(target.model, requests, [0, 0, 2, 5], max_batch_size=3,
                          prefill_chunk=8)
    assert [r.token_ids for r in results] == alone


def test_damaged_and_unsupported_files_are_one_clear_error(tiny_files, tmp_path):
    truncated = tmp_path / "cut.gguf"
    data = tiny_files["llama-q4_1"].read_bytes()
    truncated.write_bytes(data[:len(data) // 2])
    with pytest.raises(DresdError, match="truncated|damaged"):
        load_target(str(truncated))
    with pytest.raises(DresdError, match="does not exist"):
        load_target(str(tmp_path / "none.gguf"))
    not_gguf = tmp_path / "text.gguf"
    not_gguf.write_text("hello")
    with pytest.raises(DresdError, match="not a readable GGUF"):
        load_target(str(not_gguf))


def test_cli_generates_from_a_gguf_file(tiny_files, capsys):
    from dresd.cli.main import main

    code = main(["generate", "--model", str(tiny_files["llama-q4_1"]), "--method", "pld",
                 "--prompt", "Say hello.", "--max-new-tokens", "6", "--json", "--threads", "1",
                 "--no-budget"])
    assert code == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["num_new_tokens"] == 6


@pytest.mark.parametrize("qtype", list(quant.LAYOUTS), ids=lambda t: t.name)
def test_packing_in_c_gives_numpys_bytes(qtype):
    """quant.c's `dresd_quant_pack` (what loading runs) against quant.py's numpy `pack`, on
    random bytes (every bit of every field, float16 NaNs among the scales), rows that end part
    way into a group, rows farther apart than their bytes (a mapped slice), 1 and 2 threads."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(int(qtype))
    threads_before = torch.get_num_threads()
    try:
        for n, k in [(1, 256), (33, 512), (200, 768)]:
            wide = rng.integers(0, 256, (n, k // block * size + 40), dtype=np.uint8)
            raw = wide[:, 40:]  # each row 40 bytes after the last one's end
            expected = quant.pack(qtype, np.ascontiguousarray(raw), n, k)
            for threads in (1, 2):
                torch.set_num_threads(threads)
                assert torch.equal(quant.pack_blocks(qtype, raw, n, k), expected), (n, k)
    finally:
        torch.set_num_threads(threads_before)


# Gemma-3: sliding-window layers (window 8, the 6th layer global) on transformers' forward, its
# linears in the quantized kernel; sequences of 35-48 tokens, four windows and more. The files
# carry a tiny sentencepiece vocabulary as Gemma's files do (`gguf_files.gemma_vocab`).

GEMMA3_FILES = {"gemma3-bf16": (Q.BF16, Q.F32), "gemma3-q4_0": (Q.Q4_0, Q.Q8_0)}
GEMMA3_VOCAB = len(gemma_vocab()[0])


@pytest.fixture(scope="module")
def gemma3_files(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("gemma3")
    return {name: write_tiny_gguf(folder / f"{name}.gguf", linear, embedding, arch="gemma3",
                                  shape=GEMMA3_TINY, sentencepiece=True)
            for name, (linear, embedding) in GEMMA3_FILES.items()}


@pytest.fixture(scope="module")
def gemma3_targets(gemma3_files) -> dict:
    return {name: load_target(str(path)) for name, path in gemma3_files.items()}


def test_gemma3_file_is_read_as_llama_cpp_reads_it(gemma3_targets):
    model = gemma3_targets["gemma3-q4_0"].model
    config = model.config
    forward = make_forward(model)  # the C decoder in its Gemma form (windowed layers)
    assert isinstance(forward, LlamaForward) and forward.c_decoder is not None
    assert config.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    assert config.sliding_window == GEMMA3_TINY.window
    assert config.query_pre_attn_scalar == GEMMA3_TINY.head_dim  # llama.cpp: 1/sqrt(head)
    assert config.rope_parameters["full_attention"] == {
        "rope_type": "linear", "rope_theta": 1e6, "factor": GEMMA3_TINY.rope_scale}
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
    assert config.hidden_activation == "gelu_pytorch_tanh"
    assert isinstance(model.model.layers[0].self_attn.q_proj, quant.QuantLinear)
    assert isinstance(model.model.layers[0].mlp.down_proj, quant.QuantLinear)
    assert model.lm_head.qtype == Q.Q8_0  # tied: the embedding's blocks


def test_gemma3_tokenizer_is_the_files_sentencepiece_vocabulary(gemma3_targets, gemma3_files):
    """transformers builds Gemma's tokenizer from the file (merges rebuilt from the tokens'
    order, byte fallback); the chat turn's end is an end of generation, as in llama.cpp."""
    target = gemma3_targets["gemma3-q4_0"]
    tokenizer = target.tokenizer
    tokens = gemma_vocab()[0]
    assert tokenizer.tokenize("Hello world") == ["Hello", "\u2581world"]
    ids = tokenizer("Hello world the cat sat!").input_ids
    assert ids[0] == tokens.index("<bos>")  # the file's add_bos_token
    assert tokenizer.decode(ids[1:]) == "Hello world the cat sat!"
    assert tokenizer.tokenize("x!") == ["x", "<0x21>"]  # byte fallback
    assert tokenizer.tokenize("<start_of_turn>hello")[0] == "<start_of_turn>"
    assert target.eos_token_ids == [tokens.index("<eos>"), tokens.index("<end_of_turn>")]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}],
                                           tokenize=False, add_generation_prompt=True)
    assert prompt == "<bos><start_of_turn>user\nhello<end_of_turn>\n<start_of_turn>model\n"
    described = describe(open_gguf(gemma3_files["gemma3-q4_0"]))
    assert described["dresd_runs_it_natively"] == "yes"
    assert described["forward"] == "dresd's C decoder"


def test_generation_ends_at_the_files_end_of_sequence_and_its_turn_end(gemma3_files):
    """`eos_token_id` as a config takes it: one id, or the end of sequence and the turn's end
    where the vocabulary has that token (a Gemma file without <end_of_turn> ran into a crash)."""
    reader = open_gguf(gemma3_files["gemma3-q4_0"])
    tokens = reader.fields["tokenizer.ggml.tokens"].value
    eos, turn = tokens.index("<eos>"), tokens.index("<end_of_turn>")
    assert gguf_model.gemma3_config(reader, gemma3_files["gemma3-q4_0"]).eos_token_id == [eos,
                                                                                          turn]
    reader.fields["tokenizer.ggml.tokens"] = Field([t if t != "<end_of_turn>" else "<x>"
                                                    for t in tokens])
    assert gguf_model.gemma3_config(reader, gemma3_files["gemma3-q4_0"]).eos_token_id == eos
    assert gguf_model.end_of_generation(reader, "<x>", "<eos>") == [eos, turn]
    del reader.fields["tokenizer.ggml.eos_token_id"]
    assert gguf_model.end_of_generation(reader, "<|end|>") is None
    assert gguf_model.end_of_generation(reader, "<x>") == turn


def test_a_files_tokenizer_keeps_no_python_copy_of_its_vocabulary(gemma3_targets,
                                                                    gemma3_files, tmp_path):
    """transformers' tokenizer classes keep the vocabulary and merges they built the backend
    from as Python objects (48 MB for a 262k vocabulary): a loaded target's tokenizer has
    dropped them, and tokenizes and decodes as the tokenizer that kept them."""
    path = gemma3_files["gemma3-q4_0"]
    # as every load after the first reads it: from the folder the first saved in the cache
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(tmp_path)
    kept = AutoTokenizer.from_pretrained(tmp_path)
    assert len(kept._vocab) == kept.vocab_size > 100  # what there was to drop
    tokenizer = gemma3_targets["gemma3-q4_0"].tokenizer
    assert tokenizer._vocab is None and tokenizer._merges is None
    assert tokenizer.get_vocab() == kept.get_vocab()
    for text in ["Hello world the cat sat!", "x! <start_of_turn>hello", " two  spaces\n"]:
        ids = tokenizer(text).input_ids
        assert ids == kept(text).input_ids
        assert tokenizer.decode(ids) == kept.decode(ids)


@pytest.mark.parametrize("name", list(GEMMA3_FILES))
def test_gemma3_logits_match_transformers_own_model(gemma3_targets, name):
    """The reference: transformers' Gemma3ForCausalLM in float32 with the weights the file
    holds (the model it was written from, its weights through the `gguf` package's quantizers
    and back), on 48 tokens, six windows. With bf16 weights dresd's error is bf16's own
    (transformers' model cast to bf16 errs as much); 8-bit activations add ~2%. Top-1 flips
    are at near-ties of the reference."""
    linear, embedding = GEMMA3_FILES[name]
    reference = gemma3_model(GEMMA3_TINY, vocab=GEMMA3_VOCAB, linear_type=linear,
                             embedding_type=embedding)
    ids = np.random.default_rng(1).integers(0, GEMMA3_VOCAB, 48).tolist()
    with torch.inference_mode():
        expected = reference(torch.tensor([ids])).logits[0]
    got = teacher_forced_logits(gemma3_targets[name], ids)
    error = (got - expected).norm(dim=-1) / expected.norm(dim=-1)
    assert error.max() < (0.04 if linear == Q.BF16 else 0.08), error.max()
    agree = got.argmax(-1) == expected.argmax(-1)
    assert agree.float().mean() >= 0.85
    best = expected.topk(2, dim=-1).values
    assert agree[best[:, 0] - best[:, 1] > 1.0].all()


def test_gemma3_every_method_is_the_files_own_plain_decoding_past_the_window(gemma3_targets):
    target = gemma3_targets["gemma3-q4_0"]
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, GEMMA3_VOCAB, 5).tolist(),
               rng.integers(0, GEMMA3_VOCAB, 19).tolist(),
               [211, 212, 213, 214] * 4]  # repeats: PLD and suffix drafts
    for prompt in prompts:
        plain = speculative_generate(target.model, NoDrafter(), torch.tensor(prompt),
                                     max_new_tokens=30).token_ids
        drafters = [make_drafter("pld"), make_drafter("suffix"),
                    make_drafter("hybrid", cost={1: 1.0, 4: 1.1, 16: 1.6, 64: 4.0}),
                    make_drafter("draft", model=gemma3_targets["gemma3-bf16"].model),
                    OracleDrafter(len(prompt), plain, draft_len=6, corrupt=0.5, seed=1,
                                  vocab_size=GEMMA3_VOCAB),
                    RandomTreeDrafter(seed=len(prompt), vocab_size=GEMMA3_VOCAB)]
        for drafter in drafters:
            got = speculative_generate(target.model, drafter, torch.tensor(prompt),
                                       max_new_tokens=30).token_ids
            assert got == plain, type(drafter).__name__


@pytest.mark.parametrize("name", ["blk.1.post_ffw_norm.weight", "blk.0.attn_q_norm.weight",
                                  "blk.2.attn_k.weight"])
def test_gemma3_file_missing_or_misshapen_tensor_is_an_error_naming_it(tmp_path, monkeypatch,
                                                                       name):
    write = gguf.GGUFWriter.add_tensor

    def add_tensor(writer, tensor_name, tensor, *args, **kwargs):
        if tensor_name != name:
            write(writer, tensor_name, tensor, *args, **kwargs)
        elif name == "blk.0.attn_q_norm.weight":  # a value short
            write(writer, tensor_name, tensor[:-1], *args, **kwargs)
        # the others: left out

    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", add_tensor)
    path = write_tiny_gguf(tmp_path / "bad.gguf", Q.Q8_0, Q.Q8_0, arch="gemma3",
                           shape=GEMMA3_TINY, sentencepiece=True)
    monkeypatch.undo()
    with pytest.raises(DresdError, match=name.replace(".", r"\.")):
        load_target(str(path))
