"""Reasoning (serve/reasoning.py): `<think>` blocks into reasoning_content, whole and streamed in
random pieces (the deltas joined must be the whole split), for outputs that open the block
themselves and for prompts that open it."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dresd.serve.reasoning import (
    ReasoningParser,
    join_reasoning_deltas,
    prompt_opens_think,
    split_reasoning,
)
from dresd.serve.tool_calls import HermesFormat, join_deltas


def streamed(text, rng, starts_inside=False):
    parser = ReasoningParser(starts_inside)
    deltas, i = [], 0
    while i < len(text):
        size = rng.choice([0, 1, 1, 2, 3, 5, 8])
        deltas += parser.feed(text[i:i + size])
        i += size
    return deltas + parser.finish(), parser


# (output, starts_inside, reasoning, content)
CASES = [
    # Qwen3 with thinking: the model opens the block
    ("<think>\nThe user asks 7*8.\n</think>\n\n56", False, "The user asks 7*8.", "56"),
    ("\n<think>a</think>b", False, "a", "b"),
    # the prompt opened it (DeepSeek-R1, Qwen3-2507 thinking): the output only closes it
    ("Let me think.\nOK.\n</think>\n\nThe answer.", True, "Let me think.\nOK.", "The answer."),
    # ... and a model that opens it again anyway
    ("<think>\nhm\n</think>\nyes", True, "hm", "yes"),
    # no block: all content, as written
    ("  Just an answer.\n", False, None, "  Just an answer.\n"),
    ("", False, None, ""),
    # a block later in the text is content; a lone "<" too
    ("Answer <think>x</think> more", False, None, "Answer <think>x</think> more"),
    ("<thinking>", False, None, "<thinking>"),
    ("<", False, None, "<"),
    # cut off while thinking (max_tokens): all reasoning
    ("<think>\nstill going\n", False, "still going", ""),
    ("still going </thi", True, "still going </thi", ""),
    # an empty block (Qwen3 with thinking off writes one in the prompt; a model may too)
    ("<think>\n\n</think>\n\nHi", False, None, "Hi"),
    # only the first </think> ends it; the content keeps its inner whitespace
    ("<think>a</think>x\n\n</think> y ", False, "a", "x\n\n</think> y "),
    ("</think>", True, None, ""),
]


@pytest.mark.parametrize("text, starts_inside, reasoning, content", CASES)
def test_split_reasoning(text, starts_inside, reasoning, content):
    assert split_reasoning(text, starts_inside) == (reasoning, content)


@pytest.mark.parametrize("text, starts_inside, reasoning, content", CASES)
def test_streamed_in_random_pieces_joins_to_the_whole_split(text, starts_inside, reasoning,
                                                            content):
    for seed in range(25):
        deltas, parser = streamed(text, random.Random(seed), starts_inside)
        assert join_reasoning_deltas(deltas) == (reasoning, content)
        assert all(len(d) == 1 and next(iter(d.values())) for d in deltas)  # nothing empty


def test_stream_holds_back_partial_tags_and_says_when_the_reasoning_ended():
    parser = ReasoningParser()
    assert parser.feed("<thi") == []  # could be the block's start
    assert parser.feed("nk>\nStep one") == [{"reasoning_content": "Step one"}]
    assert not parser.ended
    assert parser.feed(".\n</th") == [{"reasoning_content": "."}]  # "\n</th" held
    assert parser.feed("ink>\n\nDone") == [{"content": "Done"}]
    assert parser.ended
    assert parser.finish() == []
    # a "<" that is not a tag goes out as soon as the next piece tells
    parser = ReasoningParser(starts_inside=True)
    assert parser.feed("a <") == [{"reasoning_content": "a"}]
    assert parser.feed("b") == [{"reasoning_content": " <b"}]
    # no block: content streams at once, ended from the start
    parser = ReasoningParser()
    assert parser.feed("Hi") == [{"content": "Hi"}]
    assert parser.ended


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["<think>", "</think>", "<thi", "nk>", "</", "\n", " ", "a",
                                 "<", ">"]), max_size=12), st.booleans(), st.integers(0, 2**16))
def test_any_text_streams_as_it_splits(pieces, starts_inside, seed):
    text = "".join(pieces)
    whole = split_reasoning(text, starts_inside)
    deltas, _ = streamed(text, random.Random(seed), starts_inside)
    assert join_reasoning_deltas(deltas) == whole
    if not starts_inside and not text.lstrip().startswith("<think>"):
        assert whole == (None, text)


def test_prompt_opens_think():
    assert prompt_opens_think("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_think("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_think("<|im_start|>assistant\n")
    # an earlier turn's closed block does not count, a later open one does
    assert prompt_opens_think("<think>a</think>b<|im_end|>\n<|im_start|>assistant\n<think>\n")


def test_reasoning_then_tool_calls():
    """The tool parser reads the reasoning parser's content: a call written while thinking
    is reasoning, one after it a call."""
    text = ('<think>\nMaybe <tool_call>{"name": "now", "arguments": {}}</tool_call>?\n'
            '</think>\n\n<tool_call>\n{"name": "search", "arguments": {"query": "x"}}\n'
            '</tool_call>')
    for seed in range(10):
        rng = random.Random(seed)
        reasoning = ReasoningParser()
        tools = HermesFormat().stream()

        def chained(deltas, tools=tools):
            return [out for d in deltas
                    for out in (tools.feed(d["content"]) if "content" in d else [d])]

        deltas, i = [], 0
        while i < len(text):
            size = rng.randint(0, 6)
            deltas += chained(reasoning.feed(text[i:i + size]))
            i += size
        deltas += chained(reasoning.finish()) + tools.finish()
        assert tools.called
        assert join_reasoning_deltas(deltas)[0] == (
            'Maybe <tool_call>{"name": "now", "arguments": {}}</tool_call>?')
        content, calls = join_deltas(deltas)
        assert content is None
        assert [c["function"]["name"] for c in calls] == ["search"]


def test_a_chats_grammar_holds_the_answer_after_a_reasoning_models_think_block():
    """The server's grammar for a chat with a model whose tokenizer has `<think>` and
    `</think>` (Qwen3's kind) starts after the block (constraint.AfterThinking), open from the
    first token or from the prompt; for a model without them, and for completions, from the
    first token."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from dresd.decoding.constraint import AfterThinking, Constraint
    from dresd.models.target import ensure_default_model
    from dresd.serve import protocol
    from dresd.serve.app import request_grammar

    tokenizer = AutoTokenizer.from_pretrained(ensure_default_model())
    plain = SimpleNamespace(tokenizer=tokenizer, model=SimpleNamespace(
        config=SimpleNamespace(vocab_size=len(tokenizer))))
    thinking_tokenizer = AutoTokenizer.from_pretrained(ensure_default_model())
    thinking_tokenizer.add_tokens(["<think>", "</think>"], special_tokens=True)
    thinking = SimpleNamespace(tokenizer=thinking_tokenizer, model=SimpleNamespace(
        config=SimpleNamespace(vocab_size=len(thinking_tokenizer))))
    chat = protocol.ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}],
                                          response_format={"type": "json_object"})
    completion = protocol.CompletionRequest(prompt="hi", response_format={"type": "json_object"})

    def ids(text: str) -> list[int]:
        return thinking_tokenizer(text, add_special_tokens=False)["input_ids"]

    assert type(request_grammar(chat, plain, ids("hi")).start()) is Constraint
    assert type(request_grammar(completion, thinking, ids("hi")).start()) is Constraint
    opened = request_grammar(chat, thinking, ids("assistant\n<think>\n")).start()
    closed = request_grammar(chat, thinking, ids("assistant\n<think>\n\n</think>\n\n")).start()
    start, end = thinking_tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    assert isinstance(opened, AfterThinking) and opened.state == "thinking"
    assert isinstance(closed, AfterThinking) and closed.state == "open"
    brace = ids("{")
    # inside the block anything goes, "{" starts the answer only after </think>
    assert opened.allowed_prefix(ids("Let me see") + [end] + brace) == len(ids("Let me see")) + 2
    assert opened.allowed_prefix(ids("Let me see") + [end] + ids("x")) == len(ids("Let me see")) + 1
    # with the block not open: the first token opens it, or is the answer's
    assert closed.allowed_prefix(ids("x")) == 0 and closed.allowed_prefix(brace) == 1
    assert closed.allowed_prefix([start] + ids("x")) == 1 + len(ids("x"))
