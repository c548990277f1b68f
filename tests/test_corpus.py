"""Corpus reading and formatting: pairs as generation formats them, clear errors for bad input."""

from __future__ import annotations

import gzip
import json
import sysconfig
from pathlib import Path

import pytest

from dresd.corpus import (
    CorpusError,
    CorpusSpec,
    Document,
    TokenizedDocument,
    read_documents,
    resolve_source,
    split_document,
    tokenize_corpus,
    tokenize_document,
)
from dresd.prompts import encode_prompt


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_jsonl_pairs_with_configured_fields(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [{"q": "one?", "a": "1"}, {"q": "two?", "a": "2"}])
    docs = read_documents(CorpusSpec([str(path)], prompt_field="q", response_field="a"))
    assert [(d.prompt, d.response) for d in docs] == [("one?", "1"), ("two?", "2")]
    assert docs[1].source.endswith("c.jsonl:2")


def test_gzipped_jsonl_and_limit(tmp_path):
    path = tmp_path / "c.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for i in range(5):
            f.write(json.dumps({"prompt": f"p{i}", "response": f"r{i}"}) + "\n")
    docs = read_documents(CorpusSpec([str(path)], limit=3))
    assert [d.response for d in docs] == ["r0", "r1", "r2"]


def test_missing_field_names_file_line_and_fields(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [{"question": "q", "answer": "a"}])
    with pytest.raises(CorpusError, match=r"c\.jsonl:1: no field 'prompt' \(fields: question"):
        read_documents(CorpusSpec([str(path)]))


def test_bad_corpora_give_clear_errors(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(CorpusError, match="holds no documents"):
        read_documents(CorpusSpec([str(empty)]))
    with pytest.raises(CorpusError, match="does not exist"):
        read_documents(CorpusSpec([str(tmp_path / "nope.txt")]))
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"\xff\xfe\x00\x81")
    with pytest.raises(CorpusError, match="cannot read"):
        read_documents(CorpusSpec([str(binary)]))
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "a", "response": "b"}\n{oops\n')
    with pytest.raises(CorpusError, match=r"broken\.jsonl:2: not valid JSON"):
        read_documents(CorpusSpec([str(broken)]))
    blank = tmp_path / "blank.txt"
    blank.write_text("   \n")
    with pytest.raises(CorpusError, match="only empty documents"):
        read_documents(CorpusSpec([str(blank)]))
    with pytest.raises(CorpusError, match="unknown format"):
        CorpusSpec(["x"], format="markdown")


def test_text_files_and_source_trees(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    (tmp_path / "pkg" / "b.py").write_text("y = 2\n")
    (tmp_path / "pkg" / "notes.txt").write_text("not python")
    (tmp_path / "pkg" / "site-packages").mkdir()
    (tmp_path / "pkg" / "site-packages" / "dep.py").write_text("installed = True\n")
    (tmp_path / "readme.md").write_text("hello")
    docs = read_documents(CorpusSpec([str(tmp_path / "pkg"), str(tmp_path / "readme.md")]))
    assert [d.response for d in docs] == ["x = 1\n", "y = 2\n", "hello"]
    assert all(d.prompt is None for d in docs)


def test_stdlib_shortcut_is_the_standard_library():
    folder = resolve_source("stdlib")
    assert folder == Path(sysconfig.get_paths()["stdlib"])
    assert (folder / "os.py").is_file()


def test_chat_pairs_start_with_the_generation_prompt(default_target):
    tokenizer = default_target.tokenizer
    doc = Document(response="The answer is 4.", prompt="What is 2 + 2?")
    prompt_ids = encode_prompt(tokenizer, doc.prompt)
    every = tokenize_document(tokenizer, doc, "chat", "all")
    assert every.ids[: len(prompt_ids)] == prompt_ids  # the state generation will meet
    assert "The answer is 4." in tokenizer.decode(every.ids[len(prompt_ids) :])
    assert every.key_start == 0 and every.num_keys == len(every.ids) - 1
    response_only = tokenize_document(tokenizer, doc, "chat", "response")
    # The first key is the state that predicts the first response token.
    assert response_only.key_start == len(prompt_ids) - 1


def test_qa_format_is_the_papers(default_target):
    tokenizer = default_target.tokenizer
    doc = Document(response="4", prompt="What is 2 + 2?")
    ids = tokenize_document(tokenizer, doc, "qa").ids
    assert tokenizer.decode(ids).startswith("Question: What is 2 + 2?\nAnswer:\n4")
    assert ids[-1] == tokenizer.eos_token_id


def test_long_documents_are_split_with_keys_kept_in_place():
    doc = TokenizedDocument(list(range(10)), key_start=4)
    pieces = split_document(doc, 4)
    assert [p.ids for p in pieces] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert [p.key_start for p in pieces] == [4, 0, 0]
    assert sum(p.num_keys for p in pieces) == 0 + 3 + 1


def test_tokenize_corpus_needs_key_positions(tmp_path, default_target):
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("a")
    with pytest.raises(CorpusError, match="no key positions"):
        tokenize_corpus(default_target.tokenizer, CorpusSpec([str(tiny)]))
