"""Tool calls (serve/tool_calls.py): each format parsed whole and streamed in random pieces
(the deltas joined must be the whole parse), malformed calls kept as content, rendering through
the default model's template (the generic prompt) and through a template that takes tools, and
the schema and grammar of a required call."""

from __future__ import annotations

import copy
import itertools
import json
import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dresd.models.target import default_model_dir
from dresd.serve.engine import RequestError
from dresd.serve.tool_calls import (
    TOOL_FORMATS,
    FunctionGemmaFormat,
    HermesFormat,
    Llama3JsonFormat,
    MistralFormat,
    Qwen3CoderFormat,
    check_tools,
    join_deltas,
    prepare_messages,
    render_tools_prompt,
    render_tools_text,
    select_tool_format,
    template_takes_tools,
    tool_call_grammar,
    tool_call_schema,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string"},
                                  "days": {"type": "integer"},
                                  "metric": {"type": "boolean"},
                                  "hours": {"type": "array", "items": {"type": "integer"}}},
                   "required": ["city"], "additionalProperties": False}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "parameters": {"type": "object",
                                     "properties": {"query": {"type": "string"}},
                                     "required": ["query"]}}}
NOW = {"type": "function", "function": {"name": "now"}}  # no parameters at all
TOOLS = [WEATHER, SEARCH, NOW]
# parameters as pydantic writes them: $defs and a $ref, a property named like a keyword
BOOK = {"type": "function", "function": {"name": "book", "parameters": {
    "type": "object", "$defs": {"when": {"type": "object",
                                         "properties": {"day": {"type": "string"}}}},
    "properties": {"properties": {"type": "object", "properties": {"a": {"type": "integer"}}},
                   "when": {"$ref": "#/$defs/when"},
                   "rooms": {"type": "array", "items": {"type": "object", "properties": {
                       "beds": {"type": "integer"}}}},
                   "notes": {"type": "object", "additionalProperties": True,
                             "properties": {"x": {"type": "string"}}}}}}}


def counter_ids():
    """Deterministic call ids, so a streamed parse and a whole one compare equal."""
    numbers = itertools.count()
    return lambda: f"call_{next(numbers)}"


def calls_of(parsed):
    """(name, arguments as an object) of each call, for readable expectations."""
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed[1]]


def streamed(fmt, text, rng):
    """The text fed in random pieces (1 to 9 characters, sometimes empty): all deltas."""
    stream = fmt.stream(counter_ids())
    deltas, i = [], 0
    while i < len(text):
        size = rng.choice([0, 1, 1, 2, 3, 5, 9])
        deltas += stream.feed(text[i:i + size])
        i += size
    return deltas + stream.finish(), stream


# (format, output text, content, calls): what each parser must make of the text.
CASES = [
    # Hermes / Qwen: one call, content before it, and the whitespace around calls dropped.
    (HermesFormat, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
     '</tool_call>', None, [("get_weather", {"city": "Paris"})]),
    (HermesFormat, 'Let me look.\n<tool_call>\n{"name": "search", "arguments": {"query": '
     '"a<b </tool"}}\n</tool_call>\n', "Let me look.", [("search", {"query": "a<b </tool"})]),
    # several calls, a list inside one block, "parameters" for "arguments", and arguments
    # written as a JSON string
    (HermesFormat, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
     '</tool_call>\n<tool_call>\n[{"name": "now", "arguments": {}}, {"name": "search", '
     '"parameters": {"query": "x"}}]\n</tool_call>\n<tool_call>{"name": "search", "arguments": '
     '"{\\"query\\": \\"y\\"}"}</tool_call>', None,
     [("get_weather", {"city": "Oslo"}), ("now", {}), ("search", {"query": "x"}),
      ("search", {"query": "y"})]),
    # text between and after calls stays; a call the output never closed is still a call
    (HermesFormat, 'A <tool_call>{"name": "now", "arguments": {}}</tool_call> B\n'
     '<tool_call>{"name": "now"}', "A B", [("now", {}), ("now", {})]),
    # no call: the text exactly as written, whitespace and a lone "<" included
    (HermesFormat, "  Hello <world> <tool\n\n", "  Hello <world> <tool\n\n", []),
    (HermesFormat, "", "", []),
    # malformed: bad JSON, no name, arguments not an object, an empty block, unclosed junk
    (HermesFormat, 'Hi <tool_call>{"name": "now", "arguments": {</tool_call> there',
     'Hi <tool_call>{"name": "now", "arguments": {</tool_call> there', []),
    (HermesFormat, '<tool_call>{"arguments": {}}</tool_call>',
     '<tool_call>{"arguments": {}}</tool_call>', []),
    (HermesFormat, '<tool_call>{"name": "now", "arguments": [1]}</tool_call>',
     '<tool_call>{"name": "now", "arguments": [1]}</tool_call>', []),
    (HermesFormat, "x<tool_call></tool_call>", "x<tool_call></tool_call>", []),
    (HermesFormat, '<tool_call>{"name": "now", "arguments": {"x": NaN}}</tool_call>',
     '<tool_call>{"name": "now", "arguments": {"x": NaN}}</tool_call>', []),
    (HermesFormat, '<tool_call>{"name": "now", "argu', '<tool_call>{"name": "now", "argu', []),
    # a malformed call beside a good one: the good one is a call, the bad one content
    (HermesFormat, '<tool_call>{bad}</tool_call>\n<tool_call>{"name": "now", "arguments": {}}'
     '</tool_call>', "<tool_call>{bad}</tool_call>", [("now", {})]),
    # Qwen3-Coder XML, values typed by the tool's schema
    (Qwen3CoderFormat, 'Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n'
     'New York\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n'
     '</parameter>\n<parameter=hours>\n[1, 2]\n</parameter>\n</function>\n</tool_call>',
     "Checking.", [("get_weather", {"city": "New York", "days": 3, "metric": True,
                                    "hours": [1, 2]})]),
    # a string parameter stays a string even when it reads as a number; an unknown function's
    # parameters are strings; a missing </parameter>; two calls; multi-line values
    (Qwen3CoderFormat, '<tool_call>\n<function=search>\n<parameter=query>\n42\n</parameter>\n'
     '</function>\n</tool_call>\n<tool_call>\n<function=other>\n<parameter=code>\ndef f():\n'
     '    return 1\n<parameter=n>\n7\n</function>\n</tool_call>', None,
     [("search", {"query": "42"}), ("other", {"code": "def f():\n    return 1", "n": "7"})]),
    (Qwen3CoderFormat, '<tool_call>\n<function=now>\n</function>\n</tool_call>', None,
     [("now", {})]),
    (Qwen3CoderFormat, "<tool_call>\nnot xml\n</tool_call>", "<tool_call>\nnot xml\n</tool_call>",
     []),
    (Qwen3CoderFormat, "<tool_call>\n<function=now>\n", "<tool_call>\n<function=now>\n", []),
    # Llama 3.x JSON, bare or after <|python_tag|>, several apart by ";"
    (Llama3JsonFormat, '{"name": "get_weather", "parameters": {"city": "Rome", "days": 2}}',
     None, [("get_weather", {"city": "Rome", "days": 2})]),
    (Llama3JsonFormat, '\n<|python_tag|>{"name": "now", "parameters": {}}; {"name": "search", '
     '"parameters": {"query": "q"}}', None, [("now", {}), ("search", {"query": "q"})]),
    # JSON after some text, or JSON that is not a call, is content
    (Llama3JsonFormat, 'Here: {"name": "now", "parameters": {}}',
     'Here: {"name": "now", "parameters": {}}', []),
    (Llama3JsonFormat, '{"answer": 42}', '{"answer": 42}', []),
    (Llama3JsonFormat, '<|python_tag|>brave_search.call(query="x")',
     '<|python_tag|>brave_search.call(query="x")', []),
    # Mistral: the JSON list, and the later name[ARGS]{...} form
    (MistralFormat, 'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Lyon"}}, '
     '{"name": "now", "arguments": {}}]', "Sure.",
     [("get_weather", {"city": "Lyon"}), ("now", {})]),
    (MistralFormat, '[TOOL_CALLS]search[ARGS]{"query": "a b"}[TOOL_CALLS]now[ARGS]{}', None,
     [("search", {"query": "a b"}), ("now", {})]),
    (MistralFormat, "[TOOL_CALLS][{broken", "[TOOL_CALLS][{broken", []),
    (MistralFormat, "[TOOL_CALLS]search[ARGS]not json", "[TOOL_CALLS]search[ARGS]not json", []),
    (MistralFormat, "An [array] of [TOOL", "An [array] of [TOOL", []),
    # FunctionGemma: strings in <escape> markers, numbers, booleans and lists bare
    (FunctionGemmaFormat, "<start_function_call>call:get_weather{city:<escape>Paris<escape>,"
     "days:3,metric:true,hours:[1,2]}<end_function_call>", None,
     [("get_weather", {"city": "Paris", "days": 3, "metric": True, "hours": [1, 2]})]),
    # text before, two calls, nested objects and lists, a string holding the syntax's own
    # characters, a bare word for a string, no arguments
    (FunctionGemmaFormat, "Sure.\n<start_function_call>call:book{when:{day:<escape>Mon, 3:00 "
     "{pm}<escape>},rooms:[{beds:2},{beds:1}],notes:null}<end_function_call>"
     "<start_function_call>call:search{query:cats}<end_function_call>"
     "<start_function_call>call:now{}<end_function_call>", "Sure.",
     [("book", {"when": {"day": "Mon, 3:00 {pm}"}, "rooms": [{"beds": 2}, {"beds": 1}],
                "notes": None}), ("search", {"query": "cats"}), ("now", {})]),
    # a block the output never closed is still a call
    (FunctionGemmaFormat, "<start_function_call>call:now{}", None, [("now", {})]),
    # malformed: no "call:", a string never closed, an empty value, a bracket that does not
    # match, text after the arguments
    (FunctionGemmaFormat, "<start_function_call>now{}<end_function_call>",
     "<start_function_call>now{}<end_function_call>", []),
    (FunctionGemmaFormat, "<start_function_call>call:search{query:<escape>x}<end_function_call>",
     "<start_function_call>call:search{query:<escape>x}<end_function_call>", []),
    (FunctionGemmaFormat, "<start_function_call>call:now{a:}<end_function_call>",
     "<start_function_call>call:now{a:}<end_function_call>", []),
    (FunctionGemmaFormat, "<start_function_call>call:now{a:[1}<end_function_call>",
     "<start_function_call>call:now{a:[1}<end_function_call>", []),
    (FunctionGemmaFormat, "<start_function_call>call:now{}{}<end_function_call>",
     "<start_function_call>call:now{}{}<end_function_call>", []),
]


@pytest.mark.parametrize("cls, text, content, calls", CASES)
def test_whole_parse(cls, text, content, calls):
    parsed = cls(TOOLS).parse(text, counter_ids())
    assert parsed[0] == content
    assert calls_of(parsed) == calls
    for i, call in enumerate(parsed[1]):
        assert call["id"] == f"call_{i}" and call["type"] == "function"
        assert isinstance(call["function"]["arguments"], str)


@pytest.mark.parametrize("cls, text, content, calls", CASES)
def test_streamed_in_random_pieces_joins_to_the_whole_parse(cls, text, content, calls):
    fmt = cls(TOOLS)
    whole = fmt.parse(text, counter_ids())
    for seed in range(25):
        deltas, stream = streamed(fmt, text, random.Random(seed))
        assert join_deltas(deltas) == whole
        assert stream.called == bool(whole[1])


def test_stream_deltas_are_shaped_as_openai_streams_them():
    text = ('Looking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')
    deltas, _ = streamed(HermesFormat(TOOLS), text, random.Random(0))
    parts = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert all(set(d) == {"content"} or set(d) == {"tool_calls"} for d in deltas)
    # per call: first its index, id, type and name (arguments ""), then the arguments
    assert parts[0] == {"index": 0, "id": "call_0", "type": "function",
                        "function": {"name": "get_weather", "arguments": ""}}
    assert parts[1] == {"index": 0, "function": {"arguments": '{"city": "Paris"}'}}
    assert parts[2]["index"] == 1 and parts[2]["id"] == "call_1"
    assert parts[2]["function"]["name"] == "now"
    assert parts[3] == {"index": 1, "function": {"arguments": "{}"}}
    # the content came out before any call
    assert deltas[0] == {"content": "Looking."}


def test_stream_holds_back_what_could_start_a_marker_and_no_more():
    stream = HermesFormat().stream(counter_ids())
    assert stream.feed("Hi <tool_c") == [{"content": "Hi"}]  # " <tool_c" held
    assert stream.feed("all") == []
    assert stream.feed('>{"name": "now", "arguments": {}}</tool_') == []  # the call not closed
    out = stream.feed("call> ok")
    assert [d.get("tool_calls", [{}])[0].get("function", {}).get("name") for d in out][0] \
        == "now"
    assert out[-1] == {"content": " ok"}  # text after a call, after text: as written
    # a "<" that turns out not to be a marker is released as soon as the next piece says so
    stream = HermesFormat().stream(counter_ids())
    assert stream.feed("a <") == [{"content": "a"}]
    assert stream.feed("b") == [{"content": " <b"}]
    assert stream.finish() == []
    # Llama's bare JSON counts only at the start: once text is out, "{" is content at once
    stream = Llama3JsonFormat().stream(counter_ids())
    assert stream.feed("x") == [{"content": "x"}]
    assert stream.feed(" {") == [{"content": " {"}]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(
    ["<tool_call>", "</tool_call>", "<tool_", "call>", '{"name": "now", "arguments": {}}',
     '{"name": ', '"x"', "}", "{", "[", "]", "\n", " ", "text", "<", "<function=f>",
     "</function>", "<parameter=p>", "</parameter>", "[TOOL_CALLS]", "[ARGS]",
     "<|python_tag|>", ";", "<start_function_call>", "<end_function_call>", "call:now{",
     "<escape>", ":", ","]), max_size=14),
    st.sampled_from(sorted(TOOL_FORMATS)), st.integers(0, 2**16))
def test_any_text_parses_without_raising_and_streams_the_same(pieces, name, seed):
    text = "".join(pieces)
    fmt = TOOL_FORMATS[name](TOOLS)
    whole = fmt.parse(text, counter_ids())
    deltas, _ = streamed(fmt, text, random.Random(seed))
    assert join_deltas(deltas) == whole
    if not whole[1]:
        assert whole[0] == text  # no call: nothing of the text is lost or changed


def test_long_call_streams_in_linear_time():
    """A call's end is searched from where the last search stopped, not from its start."""
    arguments = {"code": "x = 1\n" * 20000}
    text = f'<tool_call>{json.dumps({"name": "edit", "arguments": arguments})}</tool_call>'
    stream = HermesFormat().stream(counter_ids())
    deltas = [d for i in range(0, len(text), 3) for d in stream.feed(text[i:i + 3])]
    _, calls = join_deltas(deltas + stream.finish())
    assert json.loads(calls[0]["function"]["arguments"]) == arguments


# --- choosing the format ---------------------------------------------------------------------

HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Answer with <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'tool' %}<|im_start|>user
<tool_response name="{{ m.name }}" id="{{ m.tool_call_id }}">
{{ m.content }}
</tool_response><|im_end|>
{% elif m.role == 'assistant' %}<|im_start|>assistant
{{ m.content }}{% for call in m.tool_calls or [] %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif m.role != 'system' %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}{% endif %}"""


@pytest.mark.parametrize("template, expected", [
    (HERMES_TEMPLATE, HermesFormat),
    ("{% for t in tools %}<function={{ t.function.name }}><parameter=x>{% endfor %}"
     "<tool_call>", Qwen3CoderFormat),
    ("{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
     "[TOOL_CALLS]", MistralFormat),
    ("{% if tools %}Environment: ipython{% endif %}<|python_tag|>", Llama3JsonFormat),
    ("{% for t in tools %}<start_function_declaration>{{ t.function.name }}"
     "<end_function_declaration>{% endfor %}<start_function_call>", FunctionGemmaFormat),
    ("{% for t in tools %}{{ t | tojson }}{% endfor %}", HermesFormat),  # markers unknown
    # a template that takes no tools: the generic prompt asks for Hermes calls
    ("{% for m in messages %}[TOOL_CALLS]{{ m.content }}{% endfor %}", HermesFormat),
])
def test_select_tool_format_from_the_template(template, expected):
    assert type(select_tool_format(chat_template=template)) is expected


def test_select_tool_format_by_architecture_and_tokens():
    takes_tools = "{{ tools }}"
    assert type(select_tool_format(chat_template=takes_tools, architecture="mistral")) \
        is MistralFormat
    assert type(select_tool_format(chat_template=takes_tools, architecture="qwen2")) \
        is HermesFormat
    assert type(select_tool_format()) is HermesFormat  # nothing known: the default
    assert select_tool_format(chat_template=takes_tools, tools=TOOLS).tools == TOOLS


def test_template_takes_tools():
    assert template_takes_tools(HERMES_TEMPLATE)
    assert not template_takes_tools("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert not template_takes_tools(None)
    # a tag plain Jinja does not know (transformers' {% generation %}): read as text
    assert template_takes_tools("{% generation %}{{ tools }}{% endgeneration %}")


# --- rendering -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    if not (default_model_dir() / "config.json").exists():
        pytest.skip("the default model is not cached (run `dresd fetch-model`)")
    return AutoTokenizer.from_pretrained(default_model_dir())


@pytest.fixture(scope="module")
def hermes_tokenizer(tokenizer):
    """The default model's tokenizer with a template that takes tools."""
    other = copy.deepcopy(tokenizer)
    other.chat_template = HERMES_TEMPLATE
    return other


HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_a", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_b", "type": "function", "function": {"name": "now", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "call_a", "content": "18 C, sunny"},
    {"role": "tool", "tool_call_id": "call_b", "content": [{"type": "text", "text": "noon"}]},
]


def test_the_servers_text_keeps_a_formats_special_markers(tokenizer):
    """A marker that is a special token (Mistral's [TOOL_CALLS] here, added as one to the
    default tokenizer) stays in the server's text for the call parser, while the other special
    tokens (the end of turn) are left out as always; text without it decodes as before."""
    from dresd.serve.protocol import IncrementalText

    mistral = copy.deepcopy(tokenizer)
    mistral.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    marker = mistral.convert_tokens_to_ids("[TOOL_CALLS]")
    assert MistralFormat(TOOLS).marker_ids(mistral) == {marker}
    assert HermesFormat(TOOLS).marker_ids(mistral) == set()  # <tool_call>: not in this vocab
    call = '[{"name": "get_weather", "arguments": {"city": "Lyon"}}]'
    ids = mistral("Sure. ", add_special_tokens=False)["input_ids"] + [marker] + \
        mistral(call, add_special_tokens=False)["input_ids"] + [mistral.eos_token_id]

    def text(keep) -> str:
        pieces = IncrementalText(mistral, [], keep)
        return "".join(pieces.add([token]) for token in ids) + pieces.finish()

    kept = text(MistralFormat(TOOLS).marker_ids(mistral))
    assert kept == "Sure. [TOOL_CALLS]" + call
    assert calls_of(MistralFormat(TOOLS).parse(kept)) == [("get_weather", {"city": "Lyon"})]
    assert text(()) == "Sure. " + call  # without: the marker is gone, and with it the call
    assert MistralFormat(TOOLS).parse(text(()))[1] == []


def test_no_tools_renders_as_the_chat_endpoint_does(tokenizer):
    from dresd.serve.protocol import ChatCompletionRequest

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    expected = ChatCompletionRequest(messages=messages).prompt_ids(tokenizer)
    assert render_tools_prompt(tokenizer, messages) == expected
    # tool_choice "none": the tools are not rendered
    assert render_tools_prompt(tokenizer, messages, TOOLS, "none") == expected


def test_generic_prompt_where_the_template_takes_no_tools(tokenizer):
    text = render_tools_text(tokenizer, [{"role": "user", "content": "Weather in Paris?"}],
                             TOOLS)
    # the tools in the system turn (in place of the template's default system prompt)
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert "SmolLM" not in text
    assert "<tools>\n" + json.dumps(WEATHER) + "\n" + json.dumps(SEARCH) in text
    assert '<tool_call>\n{"name": <function-name>, "arguments"' in text
    assert text.endswith("<|im_start|>user\nWeather in Paris?<|im_end|>\n"
                         "<|im_start|>assistant\n")
    assert "must call" not in text
    # what the prompt asks for is what the chosen parser reads
    assert type(select_tool_format(tokenizer, tools=TOOLS)) is HermesFormat
    # the user's own system prompt comes first
    text = render_tools_text(tokenizer, [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "Hi"}], TOOLS, "required")
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert "You must call at least one function." in text
    text = render_tools_text(tokenizer, [{"role": "user", "content": "Hi"}], TOOLS,
                             {"type": "function", "function": {"name": "search"}})
    assert 'You must call the function "search".' in text
    ids = render_tools_prompt(tokenizer, [{"role": "user", "content": "Hi"}], TOOLS)
    assert tokenizer.decode(ids) == render_tools_text(tokenizer, [{"role": "user",
                                                                   "content": "Hi"}], TOOLS)


def test_generic_prompt_renders_the_history_of_calls_and_results(tokenizer):
    text = render_tools_text(tokenizer, HISTORY, TOOLS)
    # the assistant's calls as the text the prompt asks for; the results as one user turn
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n'
            '</tool_call><|im_end|>\n') in text
    assert ("<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response>\n"
            "<tool_response>\nnoon\n</tool_response><|im_end|>\n") in text
    assert "<|im_start|>tool" not in text
    # the calls written in the history parse back to the same calls
    assistant = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert calls_of(HermesFormat().parse(assistant)) == [("get_weather", {"city": "Paris"}),
                                                         ("now", {})]


def test_generic_prompt_where_the_template_refuses_a_system_turn(tokenizer):
    strict = copy.deepcopy(tokenizer)
    strict.chat_template = (
        "{% for m in messages %}{% if m.role == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}"
        "<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}<assistant>")
    text = render_tools_text(strict, [{"role": "user", "content": "Hi"}], TOOLS)
    assert text.startswith("<user># Tools\n") and text.endswith("\n\nHi</user><assistant>")


def test_a_template_that_takes_tools_renders_them_itself(hermes_tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, *HISTORY]
    text = render_tools_text(hermes_tokenizer, messages, TOOLS, enable_thinking=False)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n<tools>\n")
    assert "You may call" not in text  # the template's own words, not the generic prompt
    assert json.dumps(WEATHER["function"]["parameters"]["properties"]["city"]).replace(
        " ", "") in text.replace(" ", "")
    # the history's arguments reach the template as objects (written with tojson, not as a
    # quoted string), and each result carries the name of the call it answers
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert '<tool_response name="get_weather" id="call_a">\n18 C, sunny\n' in text
    assert '<tool_response name="now" id="call_b">\nnoon\n' in text
    # template kwargs reach the template
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert render_tools_text(hermes_tokenizer, messages, TOOLS).endswith(
        "<|im_start|>assistant\n")
    assert type(select_tool_format(hermes_tokenizer, tools=TOOLS)) is HermesFormat
    # tool_choice "none": rendered without tools
    assert "<tools>" not in render_tools_text(hermes_tokenizer, messages, TOOLS, "none")


def test_mistral_templates_get_call_ids_they_take(tokenizer):
    """Mistral's templates refuse ids that are not 9 letters or digits; OpenAI's ids are
    mapped, the same id the same way, so a call and its result still match."""
    mistral = copy.deepcopy(tokenizer)
    mistral.chat_template = (
        "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
        "{% for m in messages %}"
        "{% for c in m.tool_calls or [] %}{% if c.id | length != 9 %}"
        "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}"
        "{% endif %}[TOOL_CALLS]{{ c.id }}{% endfor %}"
        "{% if m.role == 'tool' %}[TOOL_RESULTS]{{ m.tool_call_id }}[/TOOL_RESULTS]"
        "{% else %}{{ m.content }}{% endif %}{% endfor %}")
    text = render_tools_text(mistral, HISTORY, TOOLS)
    ids = re.findall(r"\[TOOL_CALLS\](\w+)", text)
    assert len(ids) == 2 and all(len(i) == 9 for i in ids)
    assert re.findall(r"\[TOOL_RESULTS\](\w+)", text) == ids
    assert render_tools_text(mistral, HISTORY, TOOLS) == text  # the same every turn
    assert type(select_tool_format(mistral, tools=TOOLS)) is MistralFormat


def test_named_templates_pick_tool_use_with_tools(tokenizer):
    named = copy.deepcopy(tokenizer)
    named.chat_template = {"default": tokenizer.chat_template, "tool_use": HERMES_TEMPLATE}
    text = render_tools_text(named, [{"role": "user", "content": "Hi"}], TOOLS)
    assert "Answer with <tool_call>" in text


def test_prepare_messages_native_keeps_openai_shapes():
    native = prepare_messages(HISTORY, native=True)
    assert native[1]["content"] == ""
    assert native[1]["tool_calls"][0] == {"id": "call_a", "type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}
    assert native[2] == {"role": "tool", "tool_call_id": "call_a", "content": "18 C, sunny",
                         "name": "get_weather"}
    assert native[3]["content"] == "noon"
    # an argument string that is not JSON stays a string
    bad = [{"role": "assistant", "tool_calls": [
        {"id": "c", "function": {"name": "f", "arguments": "{oops"}}]}]
    assert prepare_messages(bad, True)[0]["tool_calls"][0]["function"]["arguments"] == "{oops"
    with pytest.raises(RequestError):
        prepare_messages([{"role": "user", "content": [{"type": "image_url"}]}], True)


def test_no_chat_template_is_a_request_error(tokenizer):
    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    with pytest.raises(RequestError, match="no chat template"):
        render_tools_prompt(bare, [{"role": "user", "content": "Hi"}], TOOLS)


# --- the request's fields --------------------------------------------------------------------


@pytest.mark.parametrize("tools, tool_choice, param", [
    ("nope", None, "tools"),
    ([{"type": "retrieval"}], None, "tools"),
    ([{"type": "function", "function": {"description": "no name"}}], None, "tools"),
    ([WEATHER, WEATHER], None, "tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], None, "tools"),
    ([], "required", "tool_choice"),
    (TOOLS, "always", "tool_choice"),
    (TOOLS, {"type": "function", "function": {"name": "missing"}}, "tool_choice"),
    (TOOLS, {"type": "function"}, "tool_choice"),
])
def test_check_tools_refuses_what_openai_refuses(tools, tool_choice, param):
    with pytest.raises(RequestError) as err:
        check_tools(tools, tool_choice)
    assert err.value.param == param and err.value.status == 400


def test_check_tools_takes_what_openai_takes():
    for choice in (None, "none", "auto", "required",
                   {"type": "function", "function": {"name": "search"}}):
        check_tools(TOOLS, choice)
    check_tools(None, "auto")
    check_tools([], "none")


# --- the schema and grammar of a required call -----------------------------------------------


def test_required_schema_takes_a_call_of_any_tool_and_nothing_else():
    jsonschema = pytest.importorskip("jsonschema")
    schema = tool_call_schema(TOOLS, "required")
    jsonschema.Draft202012Validator.check_schema(schema)
    good = [{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}},
            {"name": "search", "arguments": {"query": "x"}},
            {"name": "now", "arguments": {}}]
    bad = [{"name": "get_weather", "arguments": {"days": 2}},  # city required
           {"name": "get_weather", "arguments": {"city": "P", "wind": 1}},  # no extra keys
           {"name": "get_weather", "arguments": {"city": 3}},
           {"name": "search", "arguments": {"city": "Paris"}},  # another tool's arguments
           {"name": "unknown", "arguments": {}},
           {"name": "now"},
           {"name": "now", "arguments": {}, "extra": 1}]
    for call in good:
        jsonschema.validate(call, schema)
    for call in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(call, schema)
    # a valid call, in Hermes markers, parses back to itself
    text = "<tool_call>\n" + json.dumps(good[0]) + "\n</tool_call>"
    assert calls_of(HermesFormat().parse(text)) == [(good[0]["name"], good[0]["arguments"])]


def test_named_and_parallel_schemas():
    jsonschema = pytest.importorskip("jsonschema")
    named = tool_call_schema(TOOLS, {"type": "function", "function": {"name": "search"}})
    assert named["properties"]["name"] == {"type": "string", "enum": ["search"]}
    jsonschema.validate({"name": "search", "arguments": {"query": "x"}}, named)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "now", "arguments": {}}, named)
    parallel = tool_call_schema(TOOLS, "required", parallel=True)
    jsonschema.validate([{"name": "now", "arguments": {}},
                         {"name": "search", "arguments": {"query": "x"}}], parallel)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], parallel)
    # the tool's own schema is copied, never changed
    assert "strict" not in json.dumps(tool_call_schema([WEATHER], "required"))
    tool_call_schema(TOOLS, "required")["$defs"]["tool0"]["x"] = 1
    assert "x" not in WEATHER["function"]["parameters"]
    for choice in ("auto", "none", {"type": "function", "function": {"name": "missing"}}):
        with pytest.raises(RequestError):
            tool_call_schema(TOOLS, choice)
    with pytest.raises(RequestError):
        tool_call_schema([], "required")


def test_call_arguments_take_only_the_properties_a_tool_names():
    """A tool whose schema says nothing of other keys takes none, however deep (as llama.cpp
    reads a schema); a schema that allows them keeps them; names that look like keywords are
    property names, not schema."""
    jsonschema = pytest.importorskip("jsonschema")
    for tool, good, bad in [
            (SEARCH, {"query": "x"}, {"query": "x", "columns": {"name": "y"}}),
            (BOOK, {"properties": {"a": 1}, "when": {"day": "Mon"}, "rooms": [{"beds": 2}],
                      "notes": {"x": "y", "free": 1}},
             {"properties": {"a": 1, "b": 2}}),
            (BOOK, {"when": {"day": "Mon"}}, {"when": {"day": "Mon", "hour": 3}}),
            (BOOK, {"rooms": [{"beds": 1}]}, {"rooms": [{"beds": 1, "cots": 1}]})]:
        schema = tool_call_schema([tool], "required")
        jsonschema.Draft202012Validator.check_schema(schema)
        jsonschema.validate({"name": tool["function"]["name"], "arguments": good}, schema)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({"name": tool["function"]["name"], "arguments": bad}, schema)
    assert "additionalProperties" not in SEARCH["function"]["parameters"]  # a copy was closed


@pytest.mark.parametrize("parallel", [False, True])
def test_grammar_takes_calls_in_hermes_markers(parallel):
    llguidance = pytest.importorskip("llguidance")
    grammar = tool_call_grammar(TOOLS, "required", parallel)
    assert grammar.startswith("start: call")
    compiled = llguidance.grammar_from("lark", grammar)
    assert llguidance.LLMatcher.validate_grammar(compiled) == ""
    # the matcher over a byte-level tokenizer: what it accepts and refuses
    import llguidance.hf
    from transformers import AutoTokenizer

    if not (default_model_dir() / "config.json").exists():
        pytest.skip("the default model is not cached")
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    lltokenizer = llguidance.hf.from_tokenizer(tokenizer)

    def accepts(text: str) -> bool:
        matcher = llguidance.LLMatcher(lltokenizer, compiled)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()

    one = '<tool_call>\n{"name": "search", "arguments": {"query": "x"}}\n</tool_call>'
    assert not accepts(one.replace('"x"', '"x", "columns": 1'))  # a key search does not take
    assert not accepts(one.replace('{"query"', '{\n    "query"'))  # one layout: ", " and ": "
    two = one + '\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    assert accepts(one)
    assert accepts(two) == parallel
    assert not accepts('<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>')
    assert not accepts('Sure! ' + one)
    # a tool's own references resolve inside the call grammar
    booking = llguidance.grammar_from("lark", tool_call_grammar([BOOK], "required"))
    assert llguidance.LLMatcher.validate_grammar(booking) == ""
    compiled = booking
    call = '<tool_call>\n{"name": "book", "arguments": {"when": {"day": "Mon"%s}}}\n</tool_call>'
    assert accepts(call % "") and not accepts(call % ', "hour": 3')
