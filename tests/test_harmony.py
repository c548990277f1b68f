"""gpt-oss's harmony messages as OpenAI's message (serve/harmony.py): reasoning, content and
tool calls, the same whole and streamed in any pieces, through the server's own text."""

from __future__ import annotations

import json
import random

import pytest
from transformers import AutoTokenizer

from dresd.models.target import ensure_default_model
from dresd.serve import app as server
from dresd.serve.chat_output import message
from dresd.serve.engine import RequestError
from dresd.serve.harmony import MARKERS, HarmonyParser, is_harmony
from dresd.serve.protocol import ChatCompletionRequest, IncrementalText

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
THINK = "<|channel|>analysis<|message|>The user wants Paris's weather.<|end|>"
NEXT = "<|start|>assistant"

# (output, tools, the message a client gets: content, reasoning, calls as (name, arguments))
CASES = [
    pytest.param(THINK + NEXT + "<|channel|>final<|message|>Sunny, 21 C.<|return|>", None,
                 ("Sunny, 21 C.", "The user wants Paris's weather.", []), id="analysis-final"),
    pytest.param(THINK + NEXT + '<|channel|>commentary to=functions.get_weather <|constrain|>json'
                 '<|message|>{"city": "Paris"}<|call|>', [WEATHER],
                 (None, "The user wants Paris's weather.",
                  [("get_weather", '{"city": "Paris"}')]), id="call"),
    pytest.param(THINK + NEXT + ' to=functions.get_weather<|channel|>commentary json<|message|>'
                 '{"city": "Paris"}<|call|>', [WEATHER],
                 (None, "The user wants Paris's weather.",
                  [("get_weather", '{"city": "Paris"}')]), id="recipient-first"),
    pytest.param("<|channel|>commentary<|message|>Let me look.<|end|>" + NEXT +
                 "<|channel|>commentary to=functions.get_weather<|message|>"
                 '{"city": "Paris"}<|call|>', [WEATHER],
                 ("Let me look.", None, [("get_weather", '{"city": "Paris"}')]), id="preamble"),
    pytest.param(THINK + NEXT + '<|channel|>commentary to=functions.get_weather<|message|>'
                 '{"city": "Par', [WEATHER],
                 ('<|start|>assistant<|channel|>commentary to=functions.get_weather<|message|>'
                  '{"city": "Par', "The user wants Paris's weather.", []), id="cut-call"),
    pytest.param(THINK + NEXT + '<|channel|>commentary to=functions.get_weather<|message|>'
                 '{"city": NaN}<|call|>', [WEATHER],
                 ('<|start|>assistant<|channel|>commentary to=functions.get_weather<|message|>'
                  '{"city": NaN}', "The user wants Paris's weather.", []), id="nan-is-no-json"),
    pytest.param(THINK + NEXT + '<|channel|>commentary to=functions.get_weather<|message|>'
                 '{"city": "Paris"}<|call|>', None,
                 ('<|start|>assistant<|channel|>commentary to=functions.get_weather<|message|>'
                  '{"city": "Paris"}', "The user wants Paris's weather.", []), id="no-tools"),
    pytest.param("<|channel|>analysis<|message|>Search it.<|end|>" + NEXT +
                 '<|channel|>analysis to=browser.search code<|message|>{"query": "x"}<|call|>',
                 [WEATHER], ('<|start|>assistant<|channel|>analysis to=browser.search code'
                             '<|message|>{"query": "x"}', "Search it.", []), id="built-in-tool"),
    pytest.param(THINK + NEXT + "<|channel|>fin", None,
                 ("", "The user wants Paris's weather.", []), id="cut-header"),
    pytest.param("<|channel|>analysis<|message|>Still thinking", None,
                 ("", "Still thinking", []), id="cut-reasoning"),
    pytest.param("Plain text, no harmony.", None, ("Plain text, no harmony.", None, []),
                 id="not-harmony"),
    pytest.param("<|channel|>anal", None, ("", None, []), id="cut-first-header"),
]


def ids():
    counter = iter(range(100))
    return lambda: f"call_{next(counter)}"


def as_expected(body: dict) -> tuple:
    calls = [(c["function"]["name"], c["function"]["arguments"])
             for c in body.get("tool_calls", [])]
    return body["content"], body.get("reasoning_content"), calls


@pytest.mark.parametrize("text, tools, expected", CASES)
def test_a_whole_output_and_any_pieces_of_it_give_the_same_message(text, tools, expected):
    whole = HarmonyParser(tools, ids())
    body = message([*whole.feed(text), *whole.finish()])
    assert as_expected(body) == expected
    assert whole.called == bool(expected[2])
    for seed in range(30):
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))
        parser, deltas = HarmonyParser(tools, ids()), []
        for start, end in zip([0, *cuts], [*cuts, len(text)], strict=True):
            deltas += parser.feed(text[start:end])
        deltas += parser.finish()
        assert message(deltas) == body, (seed, cuts)


def test_reasoning_and_content_stream_as_they_come_calls_whole_at_their_end():
    parser = HarmonyParser([WEATHER], ids())
    assert parser.feed("<|channel|>analysis<|message|>Think") == [{"reasoning_content": "Think"}]
    assert parser.feed(" more<|") == [{"reasoning_content": " more"}]  # "<|" held: a marker?
    assert parser.feed("end|>" + NEXT + "<|channel|>commentary to=functions.get_weather"
                       "<|message|>{\"city\":") == []
    deltas = parser.feed(' "Paris"}<|call|>')
    assert [d["tool_calls"][0]["index"] for d in deltas] == [0, 0]
    assert json.loads(deltas[1]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    assert parser.called


@pytest.fixture(scope="module")
def harmony_tokenizer():
    """The default model's tokenizer with harmony's markers as special tokens, as gpt-oss's
    tokenizer holds them."""
    tokenizer = AutoTokenizer.from_pretrained(ensure_default_model())
    tokenizer.add_special_tokens({"additional_special_tokens": list(MARKERS)})
    return tokenizer


def test_the_servers_text_keeps_the_markers_for_the_parser(harmony_tokenizer):
    """The server leaves special tokens out of its text but for the parser's markers: token
    ids of a harmony output, through `IncrementalText` a token at a time, give the message."""
    tokenizer = harmony_tokenizer
    assert is_harmony(tokenizer) and not is_harmony(AutoTokenizer.from_pretrained(
        ensure_default_model()))
    text = THINK + NEXT + ('<|channel|>commentary to=functions.get_weather <|constrain|>json'
                           '<|message|>{"city": "Paris"}<|call|>')
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    parser = HarmonyParser([WEATHER], ids())
    pieces = IncrementalText(tokenizer, [], parser.marker_ids(tokenizer))
    deltas = []
    for token in token_ids:
        deltas += parser.feed(pieces.add([token]))
    deltas += parser.feed(pieces.finish()) + parser.finish()
    assert as_expected(message(deltas)) == (
        None, "The user wants Paris's weather.", [("get_weather", '{"city": "Paris"}')])
    plain = IncrementalText(tokenizer, [])  # without the markers kept: no messages to parse
    assert MARKERS[0] not in "".join(plain.add([token]) for token in token_ids)


def test_the_server_picks_the_harmony_parser_and_refuses_a_forced_call(harmony_tokenizer):
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Hi"}],
                                    tools=[WEATHER])
    make = server.chat_parsers(request, harmony_tokenizer, [])
    assert isinstance(make(), HarmonyParser) and make().tool_names == {"get_weather"}
    forced = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Hi"}],
                                   tools=[WEATHER], tool_choice="required")
    with pytest.raises(RequestError, match="use \"auto\""):
        server.tool_choice_grammar(forced, harmony_tokenizer)
