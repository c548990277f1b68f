"""`dresd bench` on a tiny random model: a complete, self-consistent report; clean failures."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from tiny_targets import tiny_target
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from dresd.bench.concurrency import run_concurrency
from dresd.cli.main import main
from dresd.models.target import ensure_default_model
from dresd.runner import GenerationSettings, MethodRunner

METHODS = ["ar", "none", "pld"]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A 2-layer random model with the default model's tokenizer, saved as a local folder."""
    folder = tmp_path_factory.mktemp("tiny-model")
    tokenizer = AutoTokenizer.from_pretrained(ensure_default_model())  # not the model: no load
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048, eos_token_id=tokenizer.eos_token_id)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture()
def dataset(tmp_path) -> Path:
    path = tmp_path / "prompts.jsonl"
    rows = [{"prompt": f"Say {word} {word} {word} again.", "category": cat}
            for word, cat in [("red", "a"), ("blue", "a"), ("green", "b"), ("pink", "b")]]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def bench(model_dir: Path, dataset: Path, out: Path, *extra: str) -> int:
    return main(["bench", "--model", str(model_dir), "--methods", ",".join(METHODS),
                 "--dataset", str(dataset), "--max-new-tokens", "12", "--out", str(out),
                 "--threads", "1", *extra])


def test_report_is_complete_and_consistent(tiny_model_dir, dataset, tmp_path):
    out = tmp_path / "out"
    assert bench(tiny_model_dir, dataset, out) == 0
    report = json.loads((out / "report.json").read_text())
    outputs = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    assert not report["meta"]["interrupted"] and report["meta"]["threads"] == 1
    assert report["meta"]["drafter_options"]["pld"]["max_ngram"] == 3
    assert set(report["methods"]) == set(METHODS)
    assert set(report["categories"]["prompts"]) == {"a", "b"}
    ar_outputs = {o["prompt_index"]: o["token_ids"] for o in outputs if o["method"] == "ar"}
    for method, figures in report["methods"].items():
        mine = [o for o in outputs if o["method"] == method]
        assert figures["num_prompts"] == len(mine) == 4
        assert figures["num_new_tokens"] == sum(len(o["token_ids"]) for o in mine)
        assert figures["tokens_per_s"] == pytest.approx(figures["num_new_tokens"]
                                                        / figures["seconds"])
        same = sum(o["token_ids"] == ar_outputs[o["prompt_index"]] for o in mine)
        assert figures["identical_fraction"] == same / len(mine) == 1.0  # greedy: lossless
        for key in ["speedup", "mean_accepted_length", "acceptance_rate",
                    "per_position_acceptance", "drafted_tokens_per_step", "draft_time_share"]:
            assert key in figures
    assert report["methods"]["ar"]["speedup"] == 1.0
    assert report["methods"]["none"]["mean_accepted_length"] == 1.0
    for plot in ["speedup.png", "per_position_acceptance.png", "accepted_length.png"]:
        assert (out / plot).stat().st_size > 1000
    assert "| pld |" in (out / "report.md").read_text()


def test_one_method_with_several_option_sets(tiny_model_dir, dataset, tmp_path):
    out = tmp_path / "out"
    methods = "pld, pld[num_drafts=3,max_ngram=2]"
    assert main(["bench", "--model", str(tiny_model_dir), "--methods", methods, "--dataset",
                 str(dataset), "--max-new-tokens", "12", "--out", str(out),
                 "--save-outputs", str(tmp_path / "saved.jsonl")]) == 0
    report = json.loads((out / "report.json").read_text())
    saved = [json.loads(line) for line in (tmp_path / "saved.jsonl").read_text().splitlines()]
    outputs = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    assert [row["token_ids"] for row in saved] == [o["token_ids"] for o in outputs
                                                  if o["method"] == "ar"]  # a corpus of them
    assert saved[0]["prompt"] == "Say red red red again." and saved[0]["model_fingerprint"]
    variant = "pld[num_drafts=3,max_ngram=2]"
    assert report["meta"]["methods"] == ["ar", "pld", variant]
    options = report["meta"]["drafter_options"]
    assert (options["pld"]["num_drafts"], options["pld"]["max_ngram"]) == (1, 3)
    assert (options[variant]["num_drafts"], options[variant]["max_ngram"]) == (3, 2)
    assert report["methods"][variant]["identical_fraction"] == 1.0
    assert report["methods"][variant]["num_prompts"] == 4


def test_sigint_leaves_a_valid_partial_report(tiny_model_dir, dataset, tmp_path, monkeypatch):
    calls = {"n": 0}
    original = MethodRunner.generate

    def generate_then_interrupt(self, prompt_ids):
        calls["n"] += 1
        if calls["n"] == len(METHODS) * 2 + 2:  # warm-ups, one whole prompt, then mid-prompt
            os.kill(os.getpid(), signal.SIGINT)
        return original(self, prompt_ids)

    monkeypatch.setattr(MethodRunner, "generate", generate_then_interrupt)
    out = tmp_path / "out"
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as in a background job
    try:
        assert bench(tiny_model_dir, dataset, out) == 130
    finally:
        signal.signal(signal.SIGINT, previous)
    report = json.loads((out / "report.json").read_text())
    assert report["meta"]["interrupted"]
    assert {f["num_prompts"] for f in report["methods"].values()} == {1}


@pytest.mark.parametrize("argv, message", [
    (["--methods", "ar,magic"], "unknown method 'magic'"),
    (["--methods", "pld[max_tree_nodes=2]"], "'max_tree_nodes=2' is not OPTION=VALUE with an "
                                             "option of pld (max_ngram, min_ngram"),
    (["--methods", "pld[num_drafts]"], "'num_drafts' is not OPTION=VALUE"),
    (["--methods", "ar[k=3]"], "option of ar (none)"),
    (["--methods", "pld,pld"], "lists pld twice"),
    (["--dataset", "nonsense"], "unknown dataset 'nonsense'"),
])
def test_bad_bench_arguments(capsys, tmp_path, argv, message):
    code = main(["bench", "--dataset", "gsm8k", "--out", str(tmp_path), *argv])
    assert code == 2 and message in capsys.readouterr().err


def test_dataset_without_the_prompt_field(capsys, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"question": "hi"}\n')
    code = main(["bench", "--dataset", str(path), "--out", str(tmp_path / "out")])
    assert code == 2 and "row 1 has no text field 'prompt'" in capsys.readouterr().err


def test_built_in_datasets_load_with_their_categories():
    from dresd.datasets import data_dir, load_prompts, read_jsonl

    assert len(load_prompts("gsm8k")) == 1319 and len(load_prompts("humaneval", limit=7)) == 7
    every = load_prompts("mt_bench")
    rows = read_jsonl(data_dir() / "mt_bench" / "question.jsonl")
    assert sorted(p.text for p in every) == sorted(row["turns"][0] for row in rows)
    categories = {row["category"] for row in rows}
    first = load_prompts("mt_bench", limit=2 * len(categories))
    # The categories in turn: any --limit is a balanced sample.
    assert all(sum(p.category == c for p in first) == 2 for c in categories)
    assert [p.text for p in first if p.category == "writing"] == [
        row["turns"][0] for row in rows if row["category"] == "writing"][:2]


@pytest.mark.parametrize("rounds", [1, 2])
def test_concurrency_report(tiny_model_dir, dataset, tmp_path, rounds):
    """`--concurrency`: a row per level and method, AR's speedup 1, every output of every round
    identical to AR's single-stream one, the ratio between its rounds' lowest and highest, and
    the table, JSON and plot written."""
    out = tmp_path / "load"
    assert bench(tiny_model_dir, dataset, out, "--concurrency", "1,3",
                 "--rounds", str(rounds)) == 0
    rows = json.loads((out / "concurrency.json").read_text())["rows"]
    assert [(row["concurrency"], row["method"]) for row in rows] == [
        (level, method) for level in (1, 3) for method in METHODS]
    for row in rows:
        assert row["rounds"] == rounds and row["num_prompts"] == 4
        assert row["identical"] == row["num_outputs"] == 4 * rounds
        assert row["num_new_tokens"] > 0 and row["tokens_per_s"] > 0
        assert row["ttft_p50"] <= row["latency_p50"]
        assert row["speedup_min"] - 1e-9 <= row["speedup"] <= row["speedup_max"] + 1e-9
        if row["method"] == "ar":
            assert row["speedup"] == row["speedup_min"] == row["speedup_max"] == 1.0
    assert (out / "concurrency.png").stat().st_size > 0
    assert "| 3 | pld |" in (out / "concurrency.md").read_text()


def test_rounds_need_concurrency(tiny_model_dir, dataset, tmp_path, capsys):
    assert bench(tiny_model_dir, dataset, tmp_path / "x", "--rounds", "2") != 0
    assert "--rounds" in capsys.readouterr().err


def test_every_timed_concurrency_run_starts_from_a_drafter_that_learned_nothing(monkeypatch):
    """Every level runs the same prompts: suffix must not draft a level's answers from the
    answers it learned at the level before (or in the warm-up)."""
    target = tiny_target()
    settings = GenerationSettings(max_new_tokens=8)
    runners = [MethodRunner(target, "ar", settings),
               MethodRunner(target, "suffix", settings, budget=False)]
    suffix = runners[1]
    learned_before = []
    generate_many = MethodRunner.generate_many

    def counting(runner, prompts, concurrency):
        if runner is suffix:
            learned_before.append(len(runner.drafter.cached))
        return generate_many(runner, prompts, concurrency)

    prompts = [[5, 6, 7, 8, 9] * 3, [9, 8, 7] * 4, [3, 4] * 6]
    monkeypatch.setattr(MethodRunner, "generate_many", counting)
    rows = run_concurrency(runners, prompts, [1, 2], rounds=2, progress=False)
    assert learned_before[1:] == [0] * 4  # 2 levels x 2 rounds (the first call: the warm-up)
    assert len(suffix.drafter.cached) == len(prompts)  # it did learn, within its run
    assert all(row["identical"] == 2 * len(prompts) for row in rows)
