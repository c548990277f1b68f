"""`dresd corpus regenerate`: input checks and resumption bookkeeping (no model needed)."""

from __future__ import annotations

import json

import pytest

from dresd.cli.main import main
from dresd.corpus import CorpusError
from dresd.regenerate import RegenerateConfig, count_done, read_prompt_rows


def test_partial_last_line_is_dropped_so_appending_is_safe(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"prompt": "a", "response": "x"}\n{"prompt": "b", "resp')
    assert count_done(out) == 1
    assert out.read_text() == '{"prompt": "a", "response": "x"}\n'
    assert count_done(tmp_path / "missing.jsonl") == 0


def test_prompt_rows_need_the_prompt_field(tmp_path):
    corpus = tmp_path / "p.jsonl"
    corpus.write_text(json.dumps({"question": "q1"}) + "\n" + json.dumps({"question": "q2"}) + "\n")
    rows = read_prompt_rows(corpus, RegenerateConfig(prompt_field="question", limit=1))
    assert rows == [{"question": "q1"}]
    with pytest.raises(CorpusError, match=r"p\.jsonl:1: no text field 'prompt'"):
        read_prompt_rows(corpus, RegenerateConfig())


def test_cli_refuses_bad_input_before_loading_a_model(tmp_path, capsys):
    corpus = tmp_path / "p.jsonl"
    corpus.write_text(json.dumps({"question": "q1"}) + "\n")
    args = ["corpus", "regenerate", "--model", str(tmp_path / "no-such-model"),
            "--corpus", str(corpus), "--out", str(tmp_path / "o.jsonl")]
    assert main(args) == 2
    assert "no text field 'prompt'" in capsys.readouterr().err  # not a model error
    assert main([*args[:-4], "--corpus", str(tmp_path / "none.jsonl"), "--out", "o"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_batched_fp32_responses_equal_single_stream_generate(tmp_path, default_target):
    """Left-padded batches of different prompt lengths, rows stopping at different steps: each
    response is the one a single-stream greedy `generate` gives (float32)."""
    from dresd.corpus import format_prompt_ids
    from dresd.regenerate import regenerate
    from dresd.runner import AR, GenerationSettings, MethodRunner

    questions = ["What is 2 + 2? Answer with one number.", "Name a fruit.",
                 "Write one sentence about the sea, then stop.",
                 "List the first five prime numbers, separated by commas."]
    corpus = tmp_path / "prompts.jsonl"
    corpus.write_text("".join(json.dumps({"question": q}) + "\n" for q in questions))
    out = tmp_path / "answers.jsonl"
    config = RegenerateConfig(prompt_field="question", max_new_tokens=24, batch_size=3)
    regenerate(default_target, corpus, out, config, progress=False)
    written = [json.loads(line)["response"] for line in out.read_text().splitlines()]

    ar = MethodRunner(default_target, AR, GenerationSettings(24))
    tokenizer = default_target.tokenizer
    for question, response in zip(questions, written, strict=True):
        tokens = ar.generate(format_prompt_ids(tokenizer, question, "chat")).token_ids
        eos = [i for i, t in enumerate(tokens) if t in default_target.eos_token_ids]
        expected = tokenizer.decode(tokens[: eos[0] if eos else None], skip_special_tokens=True)
        assert response == expected
