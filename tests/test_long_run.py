"""Long runs: many generations in one process, every method, mixed prompts.

Resident memory (VmRSS, and its anonymous part RssAnon) is read after a warm-up, in which every
method has met every prompt, and again at the end: it must grow by less than 5%. Every greedy
output must equal AR's (transformers `generate`) token for token, all run long.

The CI version: the default model as `dresd` loads it (`--dtype auto`: bf16 on a CPU with AVX-512
bf16 or AMX, four times faster than float32 here; float32 elsewhere), a small store built here,
28 generations. The full version (`-m slow`): the same model, the GSM8K ID store
from the cache if it is there, prompts from GSM8K, HumanEval and MT-Bench (../shared/data);
DRESD_LONG_RUN_GENERATIONS (500), DRESD_LONG_RUN_TOKENS (new tokens per prompt in turn,
"8,24,16,32") and DRESD_LONG_RUN_PROMPTS_PER_SET (4) size it; it prints what it measured.
"""

from __future__ import annotations

import gc
import json
import os
import re
from pathlib import Path

import pytest
import torch

from dresd.corpus import CorpusSpec
from dresd.datasets import load_prompts
from dresd.datastore.dense import DenseBuildConfig, build_dense
from dresd.models.fastpath import resolve_dtype
from dresd.models.target import load_target
from dresd.prompts import encode_prompt
from dresd.runner import AR, GenerationSettings, MethodRunner

METHODS = [AR, "none", "pld", "suffix", "rest", "dresd", "hybrid"]
NEW_TOKENS = [8, 24, 16, 32]  # per prompt, in turn: runs of mixed lengths
FLAT_COST = {1: 1.0, 16: 1.2, 64: 2.0}  # hybrid's verify-cost curve, fixed (no calibration)
CACHED_STORE = Path.home() / ".cache" / "dresd" / "datastores" / "gsm8k-id"
FALLBACK_PROMPTS = [
    "What is 12 times 7? Explain step by step.",
    "Write a Python function that reverses a string.",
    "Give three tips for better sleep.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Summarise the plot of a heist film in two sentences.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips "
    "in May. How many clips did Natalia sell altogether in April and May?",
]


def memory() -> dict[str, int]:
    """This process's resident memory in bytes: VmRSS and RssAnon (/proc/self/status)."""
    gc.collect()
    status = Path("/proc/self/status").read_text()
    return {key: int(re.search(rf"^{key}:\s+(\d+) kB", status, re.M).group(1)) * 1024
            for key in ("VmRSS", "RssAnon")}


def mixed_prompts(limit: int) -> list[str]:
    """GSM8K, HumanEval and MT-Bench prompts in turn, or a fixed mix without the data."""
    try:
        sets = [load_prompts(name, limit) for name in ("gsm8k", "humaneval", "mt_bench")]
    except (FileNotFoundError, ValueError):
        return FALLBACK_PROMPTS
    return [p.text for group in zip(*sets, strict=False) for p in group]


def long_run(target, store: Path, prompts: list[str], generations: int,
             new_tokens: list[int] = NEW_TOKENS) -> dict:
    """`generations` generations, method and prompt in turn; memory after a warm-up (every
    method on every prompt) and at the end; every output compared with AR's."""
    runners = {method: MethodRunner(target, method, GenerationSettings(),
                                    datastore=str(store), cost=FLAT_COST)
               for method in METHODS}
    encoded = [encode_prompt(target.tokenizer, p) for p in prompts]
    budgets = [new_tokens[i % len(new_tokens)] for i in range(len(prompts))]
    references = []
    for ids, budget in zip(encoded, budgets, strict=True):
        runners[AR].settings = GenerationSettings(budget)
        references.append(runners[AR].generate(ids).token_ids)
    warmup = len(METHODS) * len(prompts)
    assert generations > warmup, "the run must outlast its warm-up"
    mismatches, tokens, samples = [], 0, []
    for i in range(generations):
        method = METHODS[i % len(METHODS)]
        p = (i // len(METHODS)) % len(prompts)
        runners[method].settings = GenerationSettings(budgets[p])
        output = runners[method].generate(encoded[p]).token_ids
        tokens += len(output)
        if output != references[p]:
            mismatches.append((i, method, p))
        if i + 1 == warmup:
            after_warmup = memory()
        if (i + 1) % 50 == 0:
            samples.append((i + 1, memory()["VmRSS"] >> 20))
            print(f"long run: {i + 1} generations, VmRSS {samples[-1][1]} MiB", flush=True)
    end = memory()
    return {"generations": generations, "prompts": len(prompts), "methods": METHODS,
            "new_tokens": tokens, "warmup_generations": warmup,
            "rss_after_warmup_mib": after_warmup["VmRSS"] / 2**20,
            "rss_end_mib": end["VmRSS"] / 2**20,
            "rss_growth": end["VmRSS"] / after_warmup["VmRSS"] - 1,
            "anon_after_warmup_mib": after_warmup["RssAnon"] / 2**20,
            "anon_end_mib": end["RssAnon"] / 2**20,
            "anon_growth": end["RssAnon"] / after_warmup["RssAnon"] - 1,
            "rss_mib_every_50": samples, "mismatches": mismatches}


def check(figures: dict) -> None:
    print(f"\nlong run: {json.dumps(figures)}")
    assert figures["mismatches"] == []
    assert figures["rss_growth"] < 0.05 and figures["anon_growth"] < 0.05


@pytest.fixture(scope="module")
def auto_target(default_target, default_target_bf16):
    """The session's default model in the dtype `--dtype auto` picks on this CPU."""
    return default_target_bf16 if resolve_dtype("auto") == torch.bfloat16 else default_target


@pytest.fixture(scope="module")
def small_store(tmp_path_factory, auto_target) -> Path:
    folder = tmp_path_factory.mktemp("long-run")
    corpus = folder / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"prompt": p, "response": p.upper() + " " + p})
                              + "\n" for p in FALLBACK_PROMPTS))
    return build_dense(auto_target, CorpusSpec([str(corpus)]), folder / "store",
                       DenseBuildConfig(pca_dim=16, index="exact"), progress=False,
                       with_sparse=True)


def test_long_run_stays_exact_and_keeps_its_memory(auto_target, small_store):
    prompts = FALLBACK_PROMPTS[:2]
    figures = long_run(auto_target, small_store, prompts, 2 * len(METHODS) * len(prompts))
    check(figures)


@pytest.mark.slow
def test_long_run_full_on_a_tiny_model(tmp_path):
    """500 generations where CPU time is short: a 2-layer random model with the default
    tokenizer (reliability_helpers), and a store built for it here."""
    from reliability_helpers import TINY_CONTEXT, save_tiny_model, write_corpus

    torch.set_num_threads(1)
    target = load_target(str(save_tiny_model(tmp_path / "tiny")))
    room = TINY_CONTEXT - max(NEW_TOKENS)  # prompts that leave room for every budget
    prompts = [p for p in mixed_prompts(3) if len(encode_prompt(target.tokenizer, p)) < room]
    store = build_dense(target, CorpusSpec([str(write_corpus(tmp_path / "corpus.jsonl"))]),
                        tmp_path / "store", DenseBuildConfig(pca_dim=8, index="exact"),
                        progress=False, with_sparse=True)
    generations = int(os.environ.get("DRESD_LONG_RUN_GENERATIONS", "500"))
    check(long_run(target, store, prompts, generations))


@pytest.mark.slow
@pytest.mark.skipif(not CACHED_STORE.is_dir(), reason=f"needs the store {CACHED_STORE}")
def test_long_run_full():
    torch.set_num_threads(1)
    target = load_target("default")  # --dtype auto, as `dresd generate` loads it
    generations = int(os.environ.get("DRESD_LONG_RUN_GENERATIONS", "500"))
    budgets = os.environ.get("DRESD_LONG_RUN_TOKENS", ",".join(map(str, NEW_TOKENS)))
    prompts = mixed_prompts(int(os.environ.get("DRESD_LONG_RUN_PROMPTS_PER_SET", "4")))
    check(long_run(target, CACHED_STORE, prompts, generations,
                   [int(n) for n in budgets.split(",")]))
