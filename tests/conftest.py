"""Shared fixtures: tiny random models built from configs, the default model, and plain
decoding's outputs on it (computed once a session); and the tiers `make test-fast` and
`make test` run (docs/testing.md)."""

from __future__ import annotations

import os
import sys
from collections import Counter

# One OpenBLAS thread, set before NumPy loads it: on these shared 2-core machines OpenBLAS's own
# threads contend with PyTorch's, and the transform's eigh (576 x 576) took 4 s instead of 0.04.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from dresd.models.target import Target, load_target
from dresd.runner import AR, GenerationSettings, MethodRunner

TINY_VOCAB = 512

# One thread: on 2 cores under load, 2 PyTorch threads are often slower, and steadier is better.
torch.set_num_threads(1)


def tiny_model(arch: str = "llama", seed: int = 0) -> torch.nn.Module:
    """A 2-layer random model in float64: with float64, tree and one-token forwards agree to
    ~1e-15, so greedy ties cannot flip and any mismatch in a test is a real bug."""
    torch.manual_seed(seed)
    common = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=1024, eos_token_id=None, bos_token_id=None,
                  pad_token_id=0)
    config = LlamaConfig(**common) if arch == "llama" else Qwen2Config(**common)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float64).eval()


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny(request) -> torch.nn.Module:
    return tiny_model(request.param)


@pytest.fixture(scope="session")
def default_target() -> Target:
    """The default model in float32: token-identical to plain decoding, on any machine."""
    return load_target("default", dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def default_target_bf16() -> Target:
    """The default model in bfloat16 with prepacked weights, the fast CPU path."""
    return load_target("default", dtype="bfloat16", device="cpu")


class References:
    """Plain decoding's (`ar`) greedy outputs on one target, each computed once a session.

    Several modules compare a method with `ar` on the same prompts (the default model's real
    prompts, test_dense's and test_learn's, test_serve's questions); in float32 one such output
    took ~1 s, so the session keeps each. `references(ids, n)` is the output of the prompt
    alone (single-stream, as `dresd generate` runs it). `references.many(prompts, n)` runs the
    prompts it has not seen through one batch (`MethodRunner.generate_many`): each output is
    the single-stream one token for token, as tests/test_batch.py (tiny models, float64 and
    the default model in bf16), test_regenerate.py (the default model in float32, batches
    against single-stream `ar`) and test_serve.py (sixteen concurrent streams against
    single-stream outputs) check."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.outputs: dict[tuple, list[int]] = {}
        self.alone: set[tuple] = set()  # the keys whose output was computed single-stream

    @staticmethod
    def key(prompt_ids: list[int], max_new_tokens: int, stop_strings) -> tuple:
        return tuple(prompt_ids), max_new_tokens, tuple(stop_strings)

    def runner(self, max_new_tokens: int, stop_strings) -> MethodRunner:
        return MethodRunner(self.target, AR,
                            GenerationSettings(max_new_tokens, None, list(stop_strings)))

    def __call__(self, prompt_ids: list[int], max_new_tokens: int,
                 stop_strings: list[str] = ()) -> list[int]:
        """The prompt's output, generated alone (single-stream)."""
        key = self.key(prompt_ids, max_new_tokens, stop_strings)
        if key not in self.alone:
            result = self.runner(max_new_tokens, stop_strings).generate(list(prompt_ids))
            self.outputs[key] = result.token_ids
            self.alone.add(key)
        return list(self.outputs[key])

    def many(self, prompts: list[list[int]], max_new_tokens: int,
             stop_strings: list[str] = ()) -> list[list[int]]:
        """The prompts' outputs; those not known yet generated together, in one batch."""
        keys = [self.key(ids, max_new_tokens, stop_strings) for ids in prompts]
        missing = [key for key in dict.fromkeys(keys) if key not in self.outputs]
        if missing:
            runner = self.runner(max_new_tokens, stop_strings)
            results = runner.generate_many([list(key[0]) for key in missing], len(missing))
            for key, result in zip(missing, results, strict=True):
                self.outputs[key] = result.token_ids
        return [list(self.outputs[key]) for key in keys]


@pytest.fixture(scope="session")
def default_references(default_target) -> References:
    """`ar`'s greedy outputs on the default model in float32, each computed once a session."""
    return References(default_target)


# ---------------------------------------------------------------- the tiers (docs/testing.md)

# `make test-fast` deselects every test with one of these markers; `make test` runs them all.
TIER_MARKERS = {
    "default_model": "loads the default model (SmolLM2-135M) in this process",
    "server": "starts `dresd serve` processes",
    "ray": "starts a local Ray",
    "subprocess": "runs dresd or Python in a child process (a CLI run, a kill, a wheel build)",
}
# What marks a test: a fixture it uses (directly or through another fixture) ...
FIXTURE_MARKERS = {
    "default_target": "default_model", "default_target_bf16": "default_model",
    "default_tokenizer": "default_model",
    "servers": "server", "deployment": "server",
    "local_ray": "ray",
}
# ... or the module it is in (files whose every test needs one), or an explicit mark.
MODULE_MARKERS = {
    "test_serve_ray.py": ["ray", "server", "default_model"],
    "test_ray.py": ["ray"],
    "test_package.py": ["subprocess", "default_model"],  # builds a wheel, installs it, generates
    "test_serve_guards.py": ["server"],  # `dresd serve` processes on a tiny model
}


def pytest_configure(config) -> None:
    for name, why in TIER_MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {why} (deselected by `make test-fast`)")


_collected: list = []
_deselected: list = []
_from_workers: list[str] = []  # xdist: the workers' deselection line, for the controller
_exit_status: list[int] = []  # the session's, for the hard exit at the end


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by these markers
def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        names = {FIXTURE_MARKERS[f] for f in item.fixturenames if f in FIXTURE_MARKERS}
        names.update(MODULE_MARKERS.get(item.path.name, []))
        for name in sorted(names - {mark.name for mark in item.iter_markers()}):
            item.add_marker(name)
    _collected[:] = items


def pytest_deselected(items) -> None:
    _deselected.extend(items)


def pytest_collection_finish(session) -> None:
    """An xdist worker (`make test` runs two) hands its deselection to the controller, which
    collects nothing itself and reports it (`pytest_testnodedown`)."""
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["deselected"] = _deselection_line()


@pytest.hookimpl(optionalhook=True)  # an xdist hook: called in the controller
def pytest_testnodedown(node, error) -> None:
    line = getattr(node, "workeroutput", {}).get("deselected")
    if line and not _from_workers:  # every worker collects the same tests
        _from_workers.append(line)


def pytest_sessionfinish(session, exitstatus) -> None:
    _exit_status[:] = [int(exitstatus)]


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config) -> None:
    """Last, after pytest's own summary: how many tests the run left out, and why (the first of
    each one's markers), so that `make test-fast` says what it did not run; then the process
    ends with the session's status, without Python's teardown of its modules.

    Why the hard exit: one whole-suite run in four (2026-12-06, 1,012 passed) ended with a
    segmentation fault after pytest had printed its summary, while the interpreter tore down
    what the session had loaded (native libraries: torch's OpenMP pools, Ray, tokenizers,
    llguidance, the kernels); the status was 139 for a passing run. The tests' own outcomes are
    all reported by then, so the status is the session's, not the teardown's. The crash
    itself is not found yet (no test hits it; RELIABILITY.md)."""
    _report_deselected(config)
    if _exit_status and os.environ.get("DRESD_TEST_TEARDOWN") != "1":  # 1: tear down, to debug
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_status[0])


def _report_deselected(config) -> None:
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    line = _deselection_line() or next(iter(_from_workers), "")
    if line and reporter is not None:
        reporter.write_line(line)


def _deselection_line() -> str:
    """How many tests this process's collection left out, and why; "" for none."""
    if not _deselected:
        return ""
    why = Counter()
    for item in _deselected:
        marks = {mark.name for mark in item.iter_markers()}
        why[next((m for m in ["slow", "ray", "server", "subprocess", "default_model"]
                  if m in marks), "unmarked")] += 1
    return (f"deselected {len(_deselected)} of {len(_collected)} tests (by first marker: "
            + ", ".join(f"{name} {count}" for name, count in why.most_common()) + ")")
