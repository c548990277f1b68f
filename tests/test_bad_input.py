"""Bad input, tried systematically: every case ends with one `dresd: error:` line and exit 2.

Files (prompt files, corpora, bench datasets): empty, binary, invalid UTF-8, a huge line, JSON
that is not an object, fields of the wrong type. Values: `--max-new-tokens 0`, negative, NaN
and infinite sampling values and drafter options, prompts at and beyond the model's context
(a tiny model with a 256-token context). Then a seeded fuzz: random values for every numeric
option of `generate`, each run must exit 0 or with one error line, never a traceback.
"""

from __future__ import annotations

import json
import random

import pytest
from reliability_helpers import (
    TINY_CONTEXT,
    assert_one_line_error,
    run_main,
    save_tiny_model,
    write_corpus,
)

from dresd.prompts import encode_prompt

FUZZ_RUNS_CI = 20


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("bad-input") / "tiny")


BAD_FILES = {
    "empty": b"",
    "blank lines": b"\n\n   \n",
    "binary": bytes(range(256)) * 4,
    "invalid UTF-8": b'{"prompt": "caf\xe9"}\n',
    "huge line": b'{"prompt": "' + b"x" * (8 << 20) + b'"',  # 8 MiB, no closing brace
    "not JSON": b"prompt: hello\n",
    "a JSON list": b'["hello"]\n',
    "a number field": b'{"prompt": 5, "response": 6}\n',
    "a null field": b'{"prompt": null, "response": null}\n',
    "a list field": b'{"prompt": ["a"], "response": ["b"]}\n',
    "an object field": b'{"prompt": {"a": 1}, "response": {}}\n',
    "no field": b'{"question": "hello"}\n',
    "truncated JSON": b'{"prompt": "hello", "response": "wor',
}


def commands_reading(path, tiny, out) -> dict[str, list]:
    """Every command that reads a JSON Lines file from the user."""
    return {
        "generate": ["generate", "--model", tiny, "--prompt-file", path],
        "bench": ["bench", "--model", tiny, "--dataset", path, "--out", out / "bench"],
        "build": ["build", "--model", tiny, "--corpus", path, "--out", out / "store"],
        "regenerate": ["corpus", "regenerate", "--model", tiny, "--corpus", path,
                       "--out", out / "own.jsonl"],
    }


def no_model_load(*args, **kwargs):
    raise AssertionError("the model was loaded before the input file was checked")


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_bad_jsonl_files(tiny, tmp_path, case, capsys, monkeypatch):
    path = tmp_path / "input.jsonl"
    path.write_bytes(BAD_FILES[case])
    # every input check comes first: each command loads its model through cli/options.py
    monkeypatch.setattr("dresd.cli.options.load_target", no_model_load)
    for argv in commands_reading(path, tiny, tmp_path).values():
        code, err = run_main(capsys, *argv)
        assert_one_line_error(code, err, "input.jsonl")
        assert not (tmp_path / "store").exists() and not (tmp_path / "own.jsonl").exists()


@pytest.mark.parametrize("case", ["empty", "binary", "invalid UTF-8"])
def test_bad_plain_prompt_files(tiny, tmp_path, case, capsys):
    path = tmp_path / "prompt.txt"
    path.write_bytes(BAD_FILES[case])
    code, err = run_main(capsys, "generate", "--model", tiny, "--prompt-file", path)
    assert_one_line_error(code, err)
    assert "prompt.txt" in err or "prompt is empty" in err


def test_binary_corpus_folder_and_text(tiny, tmp_path, capsys):
    folder = tmp_path / "tree"
    folder.mkdir()
    (folder / "a.py").write_bytes(b"\xff\xfe\x00binary")
    code, err = run_main(capsys, "build", "--model", tiny, "--corpus", folder,
                         "--out", tmp_path / "s")
    assert_one_line_error(code, err, "holds no documents")
    text = tmp_path / "corpus.txt"
    text.write_bytes(b"\xff\xfe\x00binary")
    code, err = run_main(capsys, "build", "--model", tiny, "--corpus", text,
                         "--out", tmp_path / "s")
    assert_one_line_error(code, err, "corpus.txt")


GENERATE_VALUES = [
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--max-new-tokens", "-3"], "--max-new-tokens must be >= 1"),
    (["--max-new-tokens", "ten"], "invalid int value"),
    (["--temperature", "nan"], "--temperature: must be a finite number"),
    (["--temperature", "inf"], "--temperature: must be a finite number"),
    (["--temperature", "-0.5"], "--temperature must be >= 0"),
    (["--temperature", "0.7", "--top-p", "nan"], "--top-p: must be a finite number"),
    (["--temperature", "0.7", "--top-p", "-0.1"], "top_p must be in (0, 1]"),
    (["--temperature", "0.7", "--top-p", "0"], "top_p must be in (0, 1]"),
    (["--temperature", "0.7", "--top-k", "-1"], "top_k must be >= 0"),
    (["--temperature", "0.7", "--seed", "-1"], "--seed: must be in [0, 2**63)"),
    (["--threads", "-2"], "--threads: must be in [1, 4096]"),
    (["--num-drafts", "0"], "num_drafts"),
    (["--draft-len", "-1"], "draft_len"),
    (["--pld-max-ngram", "0"], "min_ngram <= max_ngram"),
    (["--method", "hybrid", "--max-tree-nodes", "0"], "max_tree_nodes"),
    (["--method", "suffix", "--suffix-min-prob", "nan"], "--suffix-min-prob"),
    (["--method", "suffix", "--suffix-spec-factor", "-1"], "max_spec_factor"),
    (["--method", "dresd"], "needs --datastore"),
    (["--method", "rest", "--datastore", "/no/such/store"], "does not exist"),
    (["--method", "draft"], "needs --draft-model"),
]


@pytest.mark.parametrize("options, message", GENERATE_VALUES,
                         ids=[" ".join(o) for o, _ in GENERATE_VALUES])
def test_bad_generate_values(tiny, options, message, capsys):
    code, err = run_main(capsys, "generate", "--model", tiny, "--prompt", "hello", *options)
    assert_one_line_error(code, err, message)


BENCH_AND_BUILD_VALUES = [
    (["bench", "--methods", "", "--dataset", "gsm8k"], "lists no method"),
    (["bench", "--methods", "pld[k=3]", "--dataset", "gsm8k"], "is not OPTION=VALUE"),
    (["bench", "--methods", "pld[draft_len=abc]", "--dataset", "gsm8k"], "draft_len"),
    (["bench", "--methods", "pld", "--dataset", "nosuchset"], "unknown dataset"),
    (["bench", "--methods", "pld", "--dataset", "/no/such.jsonl"], "/no/such.jsonl"),
    (["bench", "--methods", "pld", "--dataset", "gsm8k", "--limit", "0"], "--limit"),
    (["build", "--corpus", "/no/such/corpus.jsonl"], "does not exist"),
    (["build", "--pca-dim", "0"], "pca_dim"),
    (["build", "--value-len", "1"], "value_len"),
    (["build", "--chunk-tokens", "0"], "chunk_tokens"),
    (["build", "--max-doc-tokens", "1"], "max_tokens"),
    (["build", "--recall-target", "nan"], "--recall-target"),
    (["build", "--recall-target", "1.5"], "--recall-target"),
    (["build", "--limit", "0"], "--limit"),
    (["corpus", "regenerate", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["corpus", "regenerate", "--temperature", "nan"], "--temperature"),
    (["corpus", "regenerate", "--limit", "-1"], "--limit"),
    (["inspect", "/no/such/store"], "not a datastore"),
]


@pytest.mark.parametrize("argv, message", BENCH_AND_BUILD_VALUES,
                         ids=[" ".join(a) for a, _ in BENCH_AND_BUILD_VALUES])
def test_bad_bench_build_regenerate_values(tiny, tmp_path, argv, message, capsys):
    corpus = write_corpus(tmp_path / "corpus.jsonl", docs=4)
    extra = {"bench": ["--out", tmp_path / "b"],
             "build": ["--out", tmp_path / "s"] + ([] if "--corpus" in argv
                                                     else ["--corpus", corpus]),
             "corpus": ["--out", tmp_path / "o.jsonl", "--corpus", corpus],
             "inspect": []}[argv[0]]
    model = [] if argv[0] == "inspect" else ["--model", tiny]
    code, err = run_main(capsys, *argv, *model, *extra)
    assert_one_line_error(code, err, message)


def words_for(tokenizer, tokens: int) -> str:
    """A prompt of exactly `tokens` tokens under the chat template."""
    text = ""
    while len(encode_prompt(tokenizer, text + " word")) <= tokens:
        text += " word"
    return text


def test_prompts_at_and_beyond_the_context(tiny, tmp_path, capsys):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    at_limit = words_for(tokenizer, TINY_CONTEXT)
    assert len(encode_prompt(tokenizer, at_limit)) == TINY_CONTEXT
    below = words_for(tokenizer, TINY_CONTEXT - 1)
    code, err = run_main(capsys, "generate", "--model", tiny, "--prompt", below, "--json")
    assert code == 0, err  # one token of room: one token
    for prompt in (at_limit, at_limit + " word" * 50, "word " * 20_000):
        code, err = run_main(capsys, "generate", "--model", tiny, "--prompt", prompt)
        assert_one_line_error(code, err, f"the model's context is {TINY_CONTEXT} tokens")
        prompts = tmp_path / "long.jsonl"
        prompts.write_text(json.dumps({"prompt": prompt}) + "\n")
        code, err = run_main(capsys, "bench", "--model", tiny, "--dataset", prompts,
                             "--out", tmp_path / "bench", "--methods", "pld")
        assert_one_line_error(code, err, f"the model's context is {TINY_CONTEXT} tokens")


FUZZ_OPTIONS = ["--max-new-tokens", "--temperature", "--top-p", "--top-k", "--seed",
                "--num-drafts", "--draft-len", "--pld-max-ngram", "--pld-min-ngram", "--k",
                "--max-tree-nodes", "--suffix-max-depth", "--suffix-min-prob", "--threads"]
FUZZ_VALUES = ["0", "-1", "1", "2", "nan", "-inf", "inf", "1e309", "0.5", "-0.0", "abc", "",
               " ", "9" * 30, "\u00e9", "0x10", "1_000", "3.0"]


def fuzz_generate(tiny, capsys, runs: int, seed: int) -> dict[int, int]:
    """`generate` with 1-3 random options set to random values; exit codes seen."""
    rng = random.Random(seed)
    seen: dict[int, int] = {}
    for _ in range(runs):
        argv = ["generate", "--model", tiny, "--prompt", "alpha beta alpha beta",
                "--method", rng.choice(["pld", "suffix", "none"])]  # hybrid would calibrate
        for option in rng.sample(FUZZ_OPTIONS, rng.randint(1, 3)):
            argv += [option, rng.choice(FUZZ_VALUES)]
        if "--max-new-tokens" not in argv:
            argv += ["--max-new-tokens", "3"]
        code, err = run_main(capsys, *argv)
        capsys.readouterr()
        if code != 0:
            assert_one_line_error(code, err)
        seen[code] = seen.get(code, 0) + 1
    return seen


def test_fuzzed_generate_options(tiny, capsys):
    seen = fuzz_generate(tiny, capsys, FUZZ_RUNS_CI, seed=0)
    assert seen.get(2, 0) > 0


@pytest.mark.slow
def test_fuzzed_generate_options_full(tiny, capsys):
    seen = fuzz_generate(tiny, capsys, 1000, seed=1)
    print(f"\nfuzzed generate: exit codes {seen}")
