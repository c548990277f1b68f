"""`dresd corpus regenerate`: input checks and resumption bookkeeping (no model needed)."""

from __future__ import annotations

import json

import pytest

from dresd.cli import main
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
