"""The fast path: dtype choice, prepacked linears, and what reduced precision may change."""

from __future__ import annotations

import platform

import pytest
import torch

from dresd.decoding.verify import classify_divergence, near_tie_tolerance
from dresd.fingerprint import model_fingerprint
from dresd.host import cpu_flags, cpu_model
from dresd.models.fastpath import (
    PackedLinear,
    can_prepack,
    onednn_packs,
    prepack_linears,
    resolve_dtype,
)
from dresd.models.target import load_target
from dresd.prompts import encode_prompt
from dresd.runner import AR, GenerationSettings, MethodRunner
from tests.conftest import tiny_model

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                  reason="PyTorch built without oneDNN")


def test_cpu_flags_and_auto_dtype(tmp_path, monkeypatch):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Some CPU: v2\n"
                       "flags\t\t: fpu sse2 avx512f avx512_bf16\n")
    assert {"avx512_bf16", "sse2"} <= cpu_flags(cpuinfo)
    assert cpu_flags(tmp_path / "missing") == set()
    assert cpu_model(cpuinfo) == "Some CPU: v2"  # the first colon splits; the rest is the name
    assert cpu_model(tmp_path / "missing") == platform.machine()
    monkeypatch.setattr("dresd.host.cpu_flags", lambda: {"avx2"})
    assert resolve_dtype("auto") == torch.float32  # emulated bf16 would be slower than fp32
    monkeypatch.setattr("dresd.host.cpu_flags", lambda: {"avx2", "amx_bf16"})
    assert resolve_dtype("auto") == torch.bfloat16
    assert resolve_dtype("float16") == torch.float16
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        resolve_dtype("fp8")


needs_onednn_bf16 = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available() or not onednn_packs(torch.bfloat16),
    reason="oneDNN packs no bf16 weight on this CPU (it needs AVX-512 or AVX-NE-CONVERT)")


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32,
                                   pytest.param(torch.bfloat16, marks=needs_onednn_bf16)])
def test_packed_linear_computes_the_same_linear(dtype):
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 200, bias=True).to(dtype)
    packed = PackedLinear(linear)
    x = torch.randn(3, 7, 96, dtype=dtype)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(packed(x), linear(x), rtol=tolerance, atol=tolerance)


@needs_onednn_bf16
def test_packed_linear_rows_do_not_depend_on_the_batch():
    """A decode step's row must be bit for bit the same row of any verify forward."""
    torch.manual_seed(0)
    for in_features, out_features in [(576, 1536), (1536, 576), (576, 192)]:
        packed = PackedLinear(torch.nn.Linear(in_features, out_features, bias=False)
                              .to(torch.bfloat16))
        rows = torch.randn(64, in_features, dtype=torch.bfloat16)
        one_by_one = torch.cat([packed(rows[i : i + 1]) for i in range(64)])
        for count in (2, 3, 17, 64):
            assert torch.equal(packed(rows[:count]), one_by_one[:count])


@needs_onednn
def test_prepacked_model_gives_the_same_greedy_tokens():
    model = tiny_model().to(torch.float32)
    ids = torch.randint(0, 500, (1, 12), generator=torch.Generator().manual_seed(1))
    reference = model.generate(ids, max_new_tokens=16, do_sample=False)
    assert prepack_linears(model) == 2 * 7 + 1  # 7 linears per layer and the LM head
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert torch.equal(model.generate(ids, max_new_tokens=16, do_sample=False), reference)
    assert prepack_linears(tiny_model()) == 0  # float64: oneDNN has no kernel, left as is


@pytest.mark.default_model
def test_fingerprint_names_the_checkpoint_not_its_dtype():
    fp32 = load_target("default", dtype="float32", prepack=False)
    bf16 = load_target("default", dtype="bfloat16")
    assert bf16.fingerprint == fp32.fingerprint == model_fingerprint(fp32.model)
    other = tiny_model()
    assert model_fingerprint(other) != fp32.fingerprint


def test_near_tie_rule():
    # bf16: eps 2^-7; a top logit of 20 lies in [16, 32), ulp 0.125, tolerance 4 ulp = 0.5.
    assert near_tie_tolerance(torch.bfloat16, 20.0) == 0.5
    assert near_tie_tolerance(torch.float32, 20.0) == 4 * 16 * 2**-23
    top2 = [(20.0, 10.0), (20.0, 19.75), (20.0, 12.0)]
    assert classify_divergence([1, 2, 3], [1, 2, 3], top2, torch.bfloat16) == "identical"
    assert classify_divergence([1, 5, 6], [1, 2, 3], top2, torch.bfloat16) == "near_tie"
    assert classify_divergence([1, 2, 4], [1, 2, 3], top2, torch.bfloat16) == "unexplained"
    assert classify_divergence([1, 5], [1, 2, 3], top2, torch.float32) == "unexplained"
    assert classify_divergence([1, 2], [1, 2, 3], top2, torch.bfloat16) == "unexplained"


def test_bf16_speculative_outputs_equal_bf16_plain_decoding(default_target_bf16):
    """Real prompts, PLD chains and trees in bf16: with batch-invariant attention every output
    equals bf16 plain decoding; the near-tie rule would still explain any that did not."""
    target = default_target_bf16
    settings = GenerationSettings(48)
    prompts = ["Repeat exactly: the quick brown fox jumps over the lazy dog, twice.",
               "Write a Python function that returns the sum of a list of numbers.",
               "Name three colours of the rainbow and explain why the sky is blue.",
               "Rewrite with type hints: def area(w, h):\n    return w * h"]
    ar = MethodRunner(target, AR, settings)
    runners = [MethodRunner(target, "pld", settings, num_drafts=n) for n in (1, 4)]
    runners.append(MethodRunner(target, "none", settings))
    kinds = []
    for prompt in prompts:
        ids = encode_prompt(target.tokenizer, prompt)
        reference = ar.generate(ids)
        assert len(reference.top2_logits) == len(reference.token_ids)
        for runner in runners:
            result = runner.generate(ids)
            kinds.append(classify_divergence(result.token_ids, reference.token_ids,
                                             reference.top2_logits, torch.bfloat16))
    assert "unexplained" not in kinds, kinds
    assert kinds.count("identical") == len(kinds), kinds



def test_bf16_tree_rows_are_bit_for_bit_decode_steps(default_target_bf16):
    """Batch invariance: in a verify forward over a tree (decoys before, beside and after the
    path), each path node gets the logits, hidden state and cache entries that one-token
    decode steps give; so bf16 speculative decoding is token-identical to bf16 plain decoding."""
    from transformers import DynamicCache

    from dresd.decoding.cache import keep_cache_entries
    from dresd.decoding.generate import target_forward
    from dresd.decoding.tree import DraftTree

    model = default_target_bf16.model
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, vocab, (1, 90), generator=generator)
    path = torch.randint(0, vocab, (6,), generator=generator).tolist()
    decoys = [torch.randint(0, vocab, (k,), generator=generator).tolist() for k in (3, 5, 2)]
    tree = DraftTree.from_drafts(path[0], [decoys[0], path[1:4] + decoys[1], path[1:],
                                           decoys[2]])
    assert not tree.is_linear()
    nodes = [0]
    for token in path[1:]:
        nodes.append(tree.children[nodes[-1]][token])
    with torch.inference_mode():
        verified, stepped = DynamicCache(config=model.config), DynamicCache(config=model.config)
        target_forward(model, prompt, verified)
        target_forward(model, prompt, stepped)
        logits, hidden = target_forward(model, tree.input_ids(), verified, tree.position_ids(90),
                                        tree.attention_mask(90, torch.bfloat16))
        keep_cache_entries(verified, 90, nodes)
        for depth, node in enumerate(nodes):
            step_logits, step_hidden = target_forward(
                model, torch.tensor([[path[depth]]]), stepped, torch.tensor([[90 + depth]]))
            assert torch.equal(step_logits[0], logits[node])
            assert torch.equal(step_hidden[0], hidden[node])
    for a, b in zip(verified.layers, stepped.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


@pytest.mark.parametrize("kernel", [True, False], ids=["C kernel", "float64"])
def test_invariant_attention_is_attention(kernel, monkeypatch):
    """Both ways of invariant attention (the C kernel where it builds, float64 PyTorch ops
    where not) are softmax(q k^T / sqrt(d) + mask) v with grouped heads (checked against the
    formula in float32, to bf16 rounding): with a tree mask, causally without one (the last
    rows of a longer key sequence), and for a single decode row."""
    from dresd.kernels import attention as cpu_attention
    from dresd.models.fastpath import invariant_attention

    if kernel and cpu_attention.kernel() is None:
        pytest.skip("no C compiler")
    if not kernel:
        monkeypatch.setattr(cpu_attention, "usable", lambda query, key: False)

    generator = torch.Generator().manual_seed(0)
    for rows, masked in [(1, False), (5, False), (5, True)]:
        query = torch.randn(1, 9, rows, 64, generator=generator).to(torch.bfloat16)
        key, value = (torch.randn(1, 3, 40, 64, generator=generator).to(torch.bfloat16)
                      for _ in range(2))
        visible = torch.ones(rows, 40, dtype=torch.bool).tril(40 - rows)
        mask = None
        if masked:
            visible = torch.ones(rows, 40, dtype=torch.bool)
            visible[:, 36] = False  # a sibling's key, hidden
            mask = torch.zeros(1, 1, rows, 40, dtype=torch.bfloat16)
            mask[..., ~visible] = torch.finfo(torch.bfloat16).min
        ours, _ = invariant_attention(torch.nn.Module(), query, key, value, mask)
        # Head h reads kv head h // 3.
        keys, values = (t.float().repeat_interleave(3, dim=1) for t in (key, value))
        scores = (query.float() @ keys.transpose(-1, -2) / 8).masked_fill(~visible, -torch.inf)
        expected = (scores.softmax(-1) @ values).transpose(1, 2)
        torch.testing.assert_close(ours.float(), expected, atol=1e-2, rtol=1e-2)


@needs_onednn
def test_a_bf16_model_is_prepacked_only_where_onednn_packs_bf16():
    """On an AVX2-only CPU oneDNN refuses to pack bf16 weights (a RuntimeError at load): such a
    model keeps PyTorch's linears there, and float32 is packed on every CPU."""
    assert onednn_packs(torch.float32)
    assert can_prepack(tiny_model().to(torch.bfloat16)) == onednn_packs(torch.bfloat16)
    assert prepack_linears(tiny_model().to(torch.bfloat16)) == (
        15 if onednn_packs(torch.bfloat16) else 0)
