"""The fast path: dtype choice, prepacked linears, and what reduced precision may change."""

from __future__ import annotations

import pytest
import torch

from dresd.datastore.format import model_fingerprint
from dresd.decoding.verify import classify_divergence, near_tie_tolerance
from dresd.fastpath import PackedLinear, cpu_flags, prepack_linears, resolve_dtype
from dresd.models import load_target
from dresd.prompts import encode_prompt
from dresd.runner import AR, GenerationSettings, MethodRunner
from tests.conftest import tiny_model

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                  reason="PyTorch built without oneDNN")


def test_cpu_flags_and_auto_dtype(tmp_path, monkeypatch):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx512f avx512_bf16\n")
    assert {"avx512_bf16", "sse2"} <= cpu_flags(cpuinfo)
    assert cpu_flags(tmp_path / "missing") == set()
    monkeypatch.setattr("dresd.fastpath.cpu_flags", lambda: {"avx2"})
    assert resolve_dtype("auto") == torch.float32  # emulated bf16 would be slower than fp32
    monkeypatch.setattr("dresd.fastpath.cpu_flags", lambda: {"avx2", "amx_bf16"})
    assert resolve_dtype("auto") == torch.bfloat16
    assert resolve_dtype("float16") == torch.float16
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        resolve_dtype("fp8")


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_computes_the_same_linear(dtype):
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 200, bias=True).to(dtype)
    packed = PackedLinear(linear)
    x = torch.randn(3, 7, 96, dtype=dtype)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(packed(x), linear(x), rtol=tolerance, atol=tolerance)


@needs_onednn
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


def test_fingerprint_names_the_checkpoint_not_its_dtype():
    fp32 = load_target("default", dtype="float32", prepack=False)
    bf16 = load_target("default", dtype="bfloat16")
    assert model_fingerprint(bf16.model) == model_fingerprint(fp32.model)
    other = tiny_model()
    assert model_fingerprint(other) != model_fingerprint(fp32.model)


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


def test_bf16_speculative_outputs_differ_only_at_near_ties(default_target_bf16):
    """Real prompts, wide PLD trees in bf16: every output equals bf16 plain decoding, or it
    departs from it first where plain decoding's own top-2 logits were a near-tie."""
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
    assert kinds.count("identical") >= len(kinds) // 2, kinds

