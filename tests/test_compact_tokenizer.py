"""The compact tokenizer (`models/compact_tokenizer.py`) gives the full tokenizer's ids and text:
on GGUF files' byte-level and sentencepiece vocabularies, on many random texts (every script,
the added tokens among them) and random ids, with each call the run makes answered without the
full tokenizer, and the rest (padding, truncation, new tokens) answered by it."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
from gguf_files import GEMMA3_TINY, write_tiny_gguf
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from dresd.fingerprint import tokenizer_fingerprint
from dresd.models import compact_tokenizer
from dresd.models.compact_tokenizer import CompactBPE, Tables
from dresd.models.gguf import cached_tokenizer, config_and_tokenizer
from dresd.models.gguf_file import open_gguf

ALPHABET = ("abcdefghij ABC  \n\t.,!?'\"éàüß日本語中文한국어🤖😀—–…0123456789<>/{}()[]_-+=\u0301"
            "\u2581Hello world the cat sat")
PEERS = Path(os.environ.get("PEERS", Path.home() / ".cache/dresd/peers"))
LLAMA_CPP_VOCABS = ("llama-bpe", "llama-spm", "qwen2", "phi-3", "gpt-2", "deepseek-llm")


def random_texts(tokenizer, count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    added = list(tokenizer.get_added_vocab()) or [""]
    texts = ["", " ", "  leading", "trailing  ", "\n\n\n", compact_tokenizer.SAMPLE_TEXT]
    for _ in range(count):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 60)))
        if rng.random() < 0.4:  # added tokens inside text, and beside spaces
            at = rng.randint(0, len(text))
            text = text[:at] + rng.choice(added) + text[at:] + " " + rng.choice(added)
        texts.append(text)
    return texts


def saved_pair(tokenizer_folder: Path) -> tuple[PreTrainedTokenizerFast, PreTrainedTokenizerFast]:
    """(the full tokenizer as the folder loads it, its compact form)."""
    assert compact_tokenizer.save_compact(tokenizer_folder) is None
    full = AutoTokenizer.from_pretrained(tokenizer_folder)
    compact = compact_tokenizer.load_compact(tokenizer_folder)
    assert isinstance(compact.backend_tokenizer, CompactBPE)
    return full, compact


def assert_same_tokenizer(full, compact, texts: list[str], seed: int = 0) -> None:
    """Every answer the run asks of a tokenizer, the same; none of them loads the full one."""
    for text in texts:
        for special in (True, False):
            assert compact(text, add_special_tokens=special)["input_ids"] == full(
                text, add_special_tokens=special)["input_ids"], text
    batch = texts[:20]
    assert compact(batch)["input_ids"] == full(batch)["input_ids"]
    rng = random.Random(seed)
    size = len(full)
    specials = sorted(full.get_added_vocab().values())
    for _ in range(300):
        ids = [rng.randrange(size) for _ in range(rng.randint(1, 24))]
        ids.insert(rng.randint(0, len(ids)), rng.choice(specials))
        for skip in (True, False):
            assert compact.decode(ids, skip_special_tokens=skip) == full.decode(
                ids, skip_special_tokens=skip), ids
    assert len(compact) == len(full) and compact.vocab_size == full.vocab_size
    assert compact.get_vocab() == full.get_vocab()
    assert compact.get_added_vocab() == full.get_added_vocab()
    assert compact.all_special_ids == full.all_special_ids
    assert (compact.eos_token_id, compact.bos_token_id) == (full.eos_token_id, full.bos_token_id)
    ids = list(range(0, size, 37))
    tokens = full.convert_ids_to_tokens(ids)
    assert compact.convert_ids_to_tokens(ids) == tokens
    assert compact.convert_tokens_to_ids(tokens) == full.convert_tokens_to_ids(tokens)
    assert compact.convert_tokens_to_ids(["no such token \u2603\u2603"]) == \
        full.convert_tokens_to_ids(["no such token \u2603\u2603"])
    messages = [{"role": "user", "content": texts[-1]}]
    if full.chat_template:
        assert compact.apply_chat_template(messages, add_generation_prompt=True) == \
            full.apply_chat_template(messages, add_generation_prompt=True)
    assert compact.backend_tokenizer._full is None  # none of the above needed it
    assert tokenizer_fingerprint(compact) == tokenizer_fingerprint(full)
    assert compact.backend_tokenizer._full is None


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("compact")
    return {"byte-level": write_tiny_gguf(folder / "bytes.gguf"),
            "sentencepiece": write_tiny_gguf(folder / "spm.gguf", arch="gemma3",
                                             shape=GEMMA3_TINY, sentencepiece=True)}


@pytest.mark.parametrize("kind", ["byte-level", "sentencepiece"])
def test_a_gguf_files_compact_tokenizer_is_its_tokenizer(gguf_files, kind, tmp_path):
    path = gguf_files[kind]
    full = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    full.save_pretrained(tmp_path)
    full, compact = saved_pair(tmp_path)
    assert_same_tokenizer(full, compact, random_texts(full, 400))


@pytest.mark.parametrize("name", LLAMA_CPP_VOCABS)
def test_real_vocabularies_from_llama_cpp(name, tmp_path):
    """llama.cpp's vocabulary files (Llama 3's 128k byte-level BPE with 280k merges, Llama 2's
    and Phi-3's sentencepiece, Qwen2's, GPT-2's, DeepSeek's), with their test texts."""
    found = sorted(PEERS.glob(f"llama_cpp_python-*/vendor/llama.cpp/models/ggml-vocab-{name}.gguf"))
    if not found:
        pytest.skip("llama.cpp's vocabulary files are not here (benchmarks/peers/)")
    path = found[-1]
    full = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    full.save_pretrained(tmp_path)
    full, compact = saved_pair(tmp_path)
    texts = random_texts(full, 150)
    inputs = Path(str(path) + ".inp")
    if inputs.exists():
        texts += inputs.read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    assert_same_tokenizer(full, compact, texts)


def test_merges_are_applied_in_the_librarys_order(tmp_path):
    """A vocabulary built so that the order matters: overlapping pairs, a pair repeated in a
    word, and merges listed twice (the library keeps the later)."""
    letters = "abc"
    vocab = {letter: index for index, letter in enumerate(letters)}
    merges = [("a", "a"), ("a", "b"), ("b", "a"), ("aa", "a"), ("ab", "a"), ("a", "ab"),
              ("b", "b"), ("bb", "b"), ("a", "a"), ("c", "a"), ("ca", "b"), ("aa", "b")]
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    backend = Tokenizer(models.BPE(vocab, merges))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "tokenizer.json").read_text())
    saved["model"]["merges"].append(["a", "b"])  # a file may repeat a pair: the later counts
    (tmp_path / "tokenizer.json").write_text(json.dumps(saved))
    full, compact = saved_pair(tmp_path)
    rng = random.Random(1)
    words = [" ".join("".join(rng.choice(letters) for _ in range(rng.randint(1, 12)))
                      for _ in range(rng.randint(1, 5))) for _ in range(2000)]
    for text in words:
        assert compact(text)["input_ids"] == full(text)["input_ids"], text


def test_offsets_and_tokens_are_the_merged_tokens(gguf_files, tmp_path):
    path = gguf_files["byte-level"]
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(tmp_path)
    full, compact = saved_pair(tmp_path)
    for text in random_texts(full, 50, seed=3):
        ours = compact(text, return_offsets_mapping=True)
        theirs = full(text, return_offsets_mapping=True)
        assert ours["offset_mapping"] == theirs["offset_mapping"], text
        assert ours.tokens() == theirs.tokens()


def test_padding_truncation_and_new_tokens_use_the_full_tokenizer(gguf_files, tmp_path):
    path = gguf_files["sentencepiece"]
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(tmp_path)
    full, compact = saved_pair(tmp_path)
    texts = ["Hello world", "the cat sat on the mat, again and again"]
    for options in ({"padding": True}, {"truncation": True, "max_length": 5}):
        assert compact(texts, **options)["input_ids"] == full(texts, **options)["input_ids"]
    assert compact.backend_tokenizer._full is not None
    full.add_tokens(["<new>"])
    compact.add_tokens(["<new>"])
    assert compact("a <new> b")["input_ids"] == full("a <new> b")["input_ids"]
    assert len(compact) == len(full)


def test_a_tokenizer_without_a_compact_form_says_why(tmp_path):
    backend = Tokenizer(models.WordLevel({"hello": 0, "world": 1, "<unk>": 2}, "<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend).save_pretrained(tmp_path)
    assert "WordLevel" in compact_tokenizer.save_compact(tmp_path)
    assert compact_tokenizer.load_compact(tmp_path) is None
    assert compact_tokenizer.has_no_compact_form(tmp_path)
    tokenizer = cached_tokenizer(tmp_path)  # the full one
    assert tokenizer("hello world")["input_ids"] == [0, 1]


def test_tables_round_trip_on_disk(gguf_files, tmp_path):
    path = gguf_files["byte-level"]
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(tmp_path)
    compact_tokenizer.save_compact(tmp_path)
    tables = Tables.load(tmp_path / compact_tokenizer.COMPACT)
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    for token, token_id in list(vocab.items())[::97]:
        assert tables.token(token_id) == token and tables.token_id(token) == token_id
    left, right = spec["model"]["merges"][5]
    assert tables.merge(vocab[left], vocab[right]) == (5, vocab[left + right])


def test_every_load_of_a_file_gives_the_same_tokenizer(gguf_files):
    """The first load (which reads the file and writes the cache) and a later one (from the
    cache) give one tokenizer: the compact one, the same fingerprint."""
    path = gguf_files["byte-level"]
    first = config_and_tokenizer(path, open_gguf(path))[1]
    later = config_and_tokenizer(path, open_gguf(path))[1]
    assert isinstance(first.backend_tokenizer, CompactBPE)
    assert tokenizer_fingerprint(first) == tokenizer_fingerprint(later)
    text = compact_tokenizer.SAMPLE_TEXT
    assert first(text)["input_ids"] == later(text)["input_ids"]


def test_grammars_see_the_same_vocabulary(gguf_files, tmp_path):
    """llguidance reads a tokenizer through its backend's JSON (`to_str`, on a copy): the
    compact tokenizer gives it the full one's, so a grammar allows the same tokens."""
    import llguidance
    import llguidance.hf
    import numpy as np

    path = gguf_files["byte-level"]
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(tmp_path)
    full, compact = saved_pair(tmp_path)
    lark = llguidance.LLMatcher.grammar_from_json_schema(
        {"type": "object", "properties": {"colour": {"enum": ["red", "green"]}},
         "required": ["colour"]})
    answer = compact('{"colour": "green"}', add_special_tokens=False)["input_ids"]
    matchers = [llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokenizer), lark)
                for tokenizer in (full, compact)]
    for token in answer:
        masks = [np.frombuffer(matcher.compute_bitmask(), np.uint8) for matcher in matchers]
        assert masks[0].tobytes() == masks[1].tobytes()
        assert all(matcher.consume_token(token) for matcher in matchers)
    assert compact.backend_tokenizer._full is None


def test_a_cache_it_may_not_write_gives_the_full_tokenizer(gguf_files, tmp_path, monkeypatch):
    path = gguf_files["byte-level"]
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(tmp_path)

    def refused(folder):
        raise PermissionError(f"{folder} is read-only")

    monkeypatch.setattr(compact_tokenizer, "save_compact", refused)
    tokenizer = cached_tokenizer(tmp_path)
    assert not isinstance(tokenizer.backend_tokenizer, CompactBPE)
    assert tokenizer("hello world")["input_ids"] == AutoTokenizer.from_pretrained(tmp_path)(
        "hello world")["input_ids"]
