"""`dresd serve` against real uvicorn processes on 127.0.0.1, with the official `openai` client.

Two servers start at once (their model loads overlap): the main one, with a small dense +
sparse datastore so that every method can be asked for, and one with a queue of a single
request, for the 503 and disconnect tests. References are computed in this process as `dresd
generate` computes them (`MethodRunner`, single-stream): `ar`'s output, which every method
prints greedily; conftest's `default_references` keeps each for the session.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pydantic
import pytest
import torch

from dresd.corpus import CorpusSpec
from dresd.datastore.dense import DenseBuildConfig, build_dense
from dresd.prompts import encode_prompt
from dresd.serve import protocol
from dresd.serve.engine import on_a_passing_thread
from dresd.serve.local import LocalServer

MAX_TOKENS = 12
QUESTIONS = [f"What is {a} plus {b}? Answer in one sentence." for a, b in
             [(2, 3), (7, 5), (10, 4), (6, 6), (12, 9), (3, 8), (15, 1), (4, 4),
              (9, 2), (11, 7), (5, 13), (8, 8), (14, 6), (1, 19), (20, 2), (16, 3)]]


@pytest.fixture(scope="module")
def servers(tmp_path_factory, default_target):
    folder = tmp_path_factory.mktemp("serve")
    corpus = folder / "sums.jsonl"
    with corpus.open("w") as out:
        for a in range(1, 9):
            for b in range(1, 5):
                out.write(json.dumps({"prompt": f"What is {a} plus {b}?",
                                      "response": f"{a} plus {b} is {a + b}."}) + "\n")
    store = build_dense(default_target, CorpusSpec([str(corpus)]), folder / "sums",
                        DenseBuildConfig(pca_dim=8, index="exact"), progress=False,
                        with_sparse=True)
    # float32, as the references: token-identical to plain decoding on any machine
    common = ["--threads", "1", "--max-new-tokens", str(MAX_TOKENS), "--dtype", "float32"]
    main = LocalServer([*common, "--datastore", str(store), "--max-queue", "32"]).start()
    saved = folder / "saved.jsonl"  # the small server keeps its outputs (--save-outputs)
    # one request generates at a time there, so that exactly one more waits in its queue
    small = LocalServer([*common, "--max-queue", "1", "--max-batch-size", "1",
                         "--save-outputs", str(saved)]).start()
    try:
        yield main.wait_ready(), small.wait_ready(), saved
    finally:
        main.stop()
        small.stop()
    assert "Traceback" not in main.log() + small.log()


@pytest.fixture(scope="module")
def server(servers):
    return servers[0]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


def reference(references, prompt: str, chat: bool = True) -> str:
    """What `dresd generate --prompt PROMPT` prints: greedy, every method prints `ar`'s output,
    here generated alone in this process (`default_references`: once a session)."""
    tokenizer = references.target.tokenizer
    output = references(encode_prompt(tokenizer, prompt, chat), MAX_TOKENS)
    return tokenizer.decode(output, skip_special_tokens=True)


def chat(client, prompt: str, **options):
    return client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": prompt}],
        **{"max_tokens": MAX_TOKENS, **options})


def stream_chat(client, prompt: str, **options) -> tuple[list[str], str | None, object]:
    """(content pieces, finish_reason, usage) of a streamed chat completion."""
    pieces, finish, usage = [], None, None
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": prompt}],
        stream=True, stream_options={"include_usage": True},
        **{"max_tokens": MAX_TOKENS, **options})
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
            finish = choice.finish_reason or finish
    return pieces, finish, usage


def raw_post(url: str, path: str, body: bytes) -> tuple[int, dict]:
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    connection.request("POST", path, body, {"Content-Type": "application/json"})
    reply = connection.getresponse()
    status, text = reply.status, reply.read().decode()
    connection.close()
    return status, json.loads(text)


def metric(url: str, name: str, labels: str = "") -> float:
    """One sample of GET /metrics (0 when absent)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as reply:
        text = reply.read().decode()
    pattern = rf'^{re.escape(name)}\{{[^}}]*{re.escape(labels)}[^}}]*\}} (\S+)$'
    found = re.findall(pattern, text, re.MULTILINE)
    return float(found[0]) if found else 0.0


def finished(url: str) -> float:
    """Requests that ended with their whole response."""
    return sum(metric(url, "dresd:request_success_total", f'finished_reason="{reason}"')
               for reason in ("stop", "length"))


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]
    status = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    status.request("GET", "/health")
    assert status.getresponse().status == 200
    assert metric(server.url, "dresd:num_requests_waiting") == 0


def test_chat_is_what_generate_prints(client, default_target, default_references):
    reply = chat(client, QUESTIONS[0])
    expected = reference(default_references, QUESTIONS[0])
    assert reply.choices[0].message.content == expected
    assert reply.choices[0].message.role == "assistant"
    assert reply.usage.completion_tokens <= MAX_TOKENS
    assert reply.usage.prompt_tokens == len(encode_prompt(default_target.tokenizer, QUESTIONS[0]))
    assert reply.model_extra["dresd"]["method"] == "pld"


def test_prefix_cache_hits_are_reported_and_change_nothing(server, client, default_references):
    """The same chat again reads its prompt from the prefix cache (usage says how much, in
    whole and streamed responses) and prints the same text; another `cache_salt` shares
    nothing; /metrics counts it; POST /reset_prefix_cache empties the cache."""
    question = "Name a colour of the rainbow, in one word."
    expected = reference(default_references, question)
    first = chat(client, question, extra_body={"cache_salt": "tenant-a"})
    again = chat(client, question, extra_body={"cache_salt": "tenant-a"})
    other = chat(client, question, extra_body={"cache_salt": "tenant-b"})
    assert [r.choices[0].message.content for r in (first, again, other)] == [expected] * 3
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # all but the last prompt token hit, reported in whole blocks of 16 (app.py)
    assert again.usage.prompt_tokens_details.cached_tokens == (
        (again.usage.prompt_tokens - 1) // 16 * 16) > 0
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    pieces, _, usage = stream_chat(client, question, extra_body={"cache_salt": "tenant-a"})
    assert "".join(pieces) == expected
    assert usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 1) // 16 * 16
    assert metric(server.url, "dresd:prefix_cache_hits_total") >= 2 * (usage.prompt_tokens - 1)
    assert metric(server.url, "dresd:prefix_cache_bytes") > 0
    status, reply = raw_post(server.url, "/reset_prefix_cache", b"")
    assert status == 200 and reply["freed_bytes"] > 0
    assert metric(server.url, "dresd:prefix_cache_bytes") == 0
    after = chat(client, question, extra_body={"cache_salt": "tenant-a"})
    assert after.usage.prompt_tokens_details.cached_tokens == 0
    assert after.choices[0].message.content == expected


def test_logprobs_are_plain_decodings_for_every_method(client):
    """`logprobs` / `top_logprobs` (chat) and `logprobs` (completions), whole and streamed:
    each method reports plain decoding's (`ar`) log-probabilities for the same tokens."""
    question = QUESTIONS[2]

    def chat_logprobs(method: str):
        reply = chat(client, question, logprobs=True, top_logprobs=3,
                     extra_body={"method": method})
        return reply.choices[0].message.content, reply.choices[0].logprobs.content

    text, plain = chat_logprobs("ar")
    assert "".join(entry.token for entry in plain) == text
    for entry in plain:
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob >= entry.logprob
        assert entry.bytes == list(entry.token.encode())
    for method in ("pld", "suffix", "hybrid"):
        other_text, other = chat_logprobs(method)
        assert other_text == text
        assert [e.token for e in other] == [e.token for e in plain]
        assert [e.logprob for e in other] == pytest.approx([e.logprob for e in plain], abs=1e-4)
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": question}],
        max_tokens=MAX_TOKENS, stream=True, logprobs=True, top_logprobs=2)
    streamed = [entry for chunk in stream for choice in chunk.choices
                if choice.logprobs and choice.logprobs.content
                for entry in choice.logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in plain]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in plain], abs=1e-4)
    completion = client.completions.create(model="SmolLM2-135M-Instruct", prompt="One, two,",
                                           max_tokens=6, logprobs=2)
    logprobs = completion.choices[0].logprobs
    assert "".join(logprobs.tokens) == completion.choices[0].text
    assert len(logprobs.token_logprobs) == len(logprobs.tokens) == len(logprobs.top_logprobs)
    assert all(len(top) <= 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset[0] == 0
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        chat(client, question, top_logprobs=3)
    with pytest.raises(openai.BadRequestError, match="from 0 to 20"):
        chat(client, question, logprobs=True, top_logprobs=50)


def test_n_choices_share_the_prompt(server, client, default_references):
    """`n` > 1: the choices after the first read the prompt from the prefix cache; greedy, all
    are the reference; a seeded sample's first choice is the `n` = 1 sample; streamed choices
    come apart by `index`."""
    question = "Name an animal that lives in the sea, in one word."
    expected = reference(default_references, question)
    hits = metric(server.url, "dresd:prefix_cache_hits_total")
    reply = chat(client, question, n=3, extra_body={"cache_salt": "n-test"})
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.message.content for c in reply.choices] == [expected] * 3
    single = chat(client, question)
    assert reply.usage.prompt_tokens == single.usage.prompt_tokens  # counted once
    assert reply.usage.completion_tokens == 3 * single.usage.completion_tokens
    assert metric(server.url, "dresd:prefix_cache_hits_total") - hits >= 2 * (
        reply.usage.prompt_tokens - 1)
    sample = chat(client, question, temperature=1.0, seed=5, n=2)
    alone = chat(client, question, temperature=1.0, seed=5)
    assert sample.choices[0].message.content == alone.choices[0].message.content
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": question}],
        max_tokens=MAX_TOKENS, stream=True, n=2)
    texts, finished = ["", ""], [None, None]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finished[choice.index] = choice.finish_reason or finished[choice.index]
    assert texts == [expected] * 2 and None not in finished
    with pytest.raises(openai.BadRequestError, match="n must be"):
        chat(client, question, n=100)


def test_streamed_chat_is_the_whole_reply_in_pieces(client):
    whole = chat(client, QUESTIONS[1])
    pieces, finish, usage = stream_chat(client, QUESTIONS[1])
    assert "".join(pieces) == whole.choices[0].message.content
    assert len(pieces) > 1  # streamed as steps accept tokens, not in one piece at the end
    assert finish == whole.choices[0].finish_reason
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_completions_take_raw_text(client, default_references):
    prompt = "The three primary colours are"
    reply = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt,
                                      max_tokens=MAX_TOKENS)
    assert reply.choices[0].text == reference(default_references, prompt, chat=False)
    assert reply.choices[0].finish_reason == "length"
    streamed = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt,
                                         max_tokens=MAX_TOKENS, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed) == reply.choices[0].text


@pytest.mark.parametrize("method", ["none", "ar", "rest", "dresd", "suffix", "hybrid"])
def test_every_method_is_lossless(client, default_references, method):
    # Chosen per request; greedy, every method gives the model's own output.
    reply = chat(client, QUESTIONS[2], extra_body={"method": method})
    assert reply.choices[0].message.content == reference(default_references, QUESTIONS[2])
    assert reply.model_extra["dresd"]["method"] == method


class Sum(pydantic.BaseModel):
    """The structured answer the client asks for (openai's `parse` turns it into a schema)."""

    a: int
    b: int
    total: int


def test_structured_output_is_the_same_object_for_every_method(client):
    """`response_format` with a schema: the reply parses into the model, and every method
    gives `ar`'s reply under the grammar (greedy), its forced keys drafted for free."""
    replies = {}
    for method in ["ar", "pld", "suffix", "hybrid", "dresd"]:
        reply = client.chat.completions.parse(
            model="SmolLM2-135M-Instruct", response_format=Sum, max_tokens=40,
            messages=[{"role": "user", "content": QUESTIONS[1] + " Answer in JSON."}],
            extra_body={"method": method})
        replies[method] = reply.choices[0].message.content
        if reply.choices[0].finish_reason == "stop":
            assert isinstance(reply.choices[0].message.parsed, Sum)
    assert len(set(replies.values())) == 1, replies
    assert replies["ar"].startswith('{"a": ')


@pytest.mark.parametrize("extra,check", [
    ({"guided_choice": ["yes", "no"]}, lambda text: text in ("yes", "no")),
    ({"guided_regex": "[0-9]{1,3}"}, lambda text: text.isdigit() and len(text) <= 3),
    ({"response_format": {"type": "json_object"}}, lambda text: text.startswith("{")),
    ({"grammar": 'root ::= "seven" | "eight"'}, lambda text: text in ("seven", "eight")),
])
def test_extensions_of_vllm_and_llama_server_constrain_too(client, extra, check):
    reply = chat(client, QUESTIONS[5], extra_body={"method": "pld", **extra})
    assert check(reply.choices[0].message.content), reply.choices[0].message.content


def test_a_prediction_changes_nothing_but_the_forwards(client, default_references):
    """OpenAI's `prediction`: the same reply, fewer forwards when it is right, and OpenAI's
    accepted / rejected prediction token counts."""
    expected = reference(default_references, QUESTIONS[6])
    for method in ["ar", "hybrid"]:
        plain = chat(client, QUESTIONS[6], extra_body={"method": method})
        predicted = chat(client, QUESTIONS[6], extra_body={"method": method},
                         prediction={"type": "content", "content": expected})
        assert plain.choices[0].message.content == expected
        assert predicted.choices[0].message.content == expected
        details = predicted.usage.completion_tokens_details
        assert details.accepted_prediction_tokens >= predicted.usage.completion_tokens - 1
        assert details.rejected_prediction_tokens <= 1
        assert (predicted.model_extra["dresd"]["num_target_forwards"]
                < plain.model_extra["dresd"]["num_target_forwards"])
    wrong = chat(client, QUESTIONS[6], prediction={"type": "content",
                                                   "content": "Nothing like the answer."})
    assert wrong.choices[0].message.content == expected
    assert wrong.usage.completion_tokens_details.rejected_prediction_tokens > 0


WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "required": ["city"], "additionalProperties": False,
                   "properties": {"city": {"type": "string"},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}},
    # maxLength: under a grammar the default model writes a zone string until max_tokens
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "maxLength": 16}}}}}]


def test_a_required_tool_call_is_a_call_for_every_method_whole_and_streamed(client):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    calls = {}
    for method in ["ar", "pld", "hybrid"]:
        reply = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=ask, tools=WEATHER, max_tokens=48,
            tool_choice="required", parallel_tool_calls=False, extra_body={"method": method})
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        [call] = choice.message.tool_calls
        assert call.function.name in ("get_weather", "get_time") and call.id.startswith("call_")
        json.loads(call.function.arguments)  # the arguments are JSON, by the grammar
        calls[method] = (call.function.name, call.function.arguments)
    assert len(set(calls.values())) == 1, calls  # greedy: every method's call is ar's
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=ask, tools=WEATHER, max_tokens=48,
        tool_choice="required", parallel_tool_calls=False, stream=True)
    name, arguments, finish = "", "", None
    for chunk in stream:
        for choice in chunk.choices:
            for part in choice.delta.tool_calls or []:
                name += part.function.name or ""
                arguments += part.function.arguments or ""
            finish = choice.finish_reason or finish
    assert (name, arguments) == calls["ar"] and finish == "tool_calls"


def test_a_named_tool_and_a_tool_history_are_served(client):
    reply = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", tools=WEATHER, max_tokens=48,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        messages=[{"role": "user", "content": "Weather in Oslo, then the time there?"},
                  {"role": "assistant", "content": None, "tool_calls": [{
                      "id": "call_1", "type": "function", "function": {
                          "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "4 C, rain"}])
    assert [call.function.name for call in reply.choices[0].message.tool_calls] == ["get_time"]
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        client.chat.completions.create(
            model="SmolLM2-135M-Instruct", tools=WEATHER, max_tokens=8,
            messages=[{"role": "user", "content": "hi"}],
            tool_choice={"type": "function", "function": {"name": "nope"}})


def test_penalties_and_a_logit_bias_give_ar_s_reply_for_every_method(client):
    fields = {"presence_penalty": 1.2, "frequency_penalty": 0.4, "repetition_penalty": 1.3,
              "logit_bias": {"28": -100, "30": 3.5}}
    replies = {method: chat(client, QUESTIONS[7], max_tokens=24,
                            extra_body={"method": method, **fields}).choices[0].message.content
               for method in ["ar", "pld", "suffix", "hybrid"]}
    assert len(set(replies.values())) == 1, replies
    assert replies["ar"] != chat(client, QUESTIONS[7], max_tokens=24).choices[0].message.content


def test_anthropic_messages_whole_streamed_and_with_tools(server, default_references):
    """The `anthropic` client against /v1/messages: the chat endpoint's own reply, in
    Anthropic's shapes."""
    anthropic = pytest.importorskip("anthropic")
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    expected = reference(default_references, QUESTIONS[8])
    ask = [{"role": "user", "content": QUESTIONS[8]}]
    reply = claude.messages.create(model="SmolLM2-135M-Instruct", max_tokens=MAX_TOKENS,
                                   messages=ask, extra_body={"method": "hybrid"})
    assert reply.content[0].text == expected and reply.role == "assistant"
    assert reply.stop_reason in ("end_turn", "max_tokens") and reply.usage.output_tokens > 0
    with claude.messages.stream(model="SmolLM2-135M-Instruct", max_tokens=MAX_TOKENS,
                                messages=ask) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == expected and final.stop_reason == reply.stop_reason
    tools = [{"name": "get_weather", "description": "The weather in a city.",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                               "required": ["city"]}}]
    called = claude.messages.create(
        model="SmolLM2-135M-Instruct", max_tokens=48, tools=tools,
        tool_choice={"type": "any"}, messages=[{"role": "user", "content": "Weather in Rome?"}])
    [use] = [block for block in called.content if block.type == "tool_use"]
    assert use.name == "get_weather" and "city" in use.input and called.stop_reason == "tool_use"
    status, refused = raw_post(server.url, "/v1/messages", json.dumps({"messages": ask}).encode())
    assert status == 400 and refused["type"] == "error" and "max_tokens" in str(refused)


def test_langchain_tools_and_structured_output(server, client):
    """`langchain-openai` as agents use it: `bind_tools` with a required call (whole and
    streamed), and `with_structured_output` of a pydantic model, each the reply the `openai`
    client gets for the same request."""
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city now."""
        return "sunny"

    model = langchain_openai.ChatOpenAI(
        base_url=server.url + "/v1", api_key="unused", model="SmolLM2-135M-Instruct",
        max_tokens=48, temperature=0, max_retries=0, extra_body={"method": "hybrid"})
    ask = "What is the weather in Paris?"
    with_tools = model.bind_tools([get_weather], tool_choice="required")
    [call] = with_tools.invoke(ask).tool_calls
    assert call["name"] == "get_weather" and set(call["args"]) == {"city"}
    streamed = None
    for chunk in with_tools.stream(ask):
        streamed = chunk if streamed is None else streamed + chunk
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [(call["name"], call["args"])]
    direct = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": ask}],
        tools=[{"type": "function", "function": {
            "name": "get_weather", "description": "The weather in a city now.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}}],
        tool_choice="required", max_tokens=48, temperature=0)
    assert json.loads(direct.choices[0].message.tool_calls[0].function.arguments) == call["args"]
    question = QUESTIONS[1] + " Answer in JSON."
    answer = model.with_structured_output(Sum, method="json_schema").invoke(question)
    parsed = client.chat.completions.parse(
        model="SmolLM2-135M-Instruct", response_format=Sum, max_tokens=48,
        messages=[{"role": "user", "content": question}]).choices[0].message.parsed
    assert isinstance(answer, Sum) and answer == parsed


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_gives_the_prompts_logprobs_as_lm_eval_asks(server, default_target, max_tokens):
    """lm-evaluation-harness's loglikelihood request (`local-completions`): the prompt as
    token ids, `echo`, `logprobs: 1`; each prompt token's logprob is the model's own."""
    tokenizer = default_target.tokenizer
    ids = tokenizer("The capital of France is Paris", add_special_tokens=False)["input_ids"]
    status, reply = raw_post(server.url, "/v1/completions", json.dumps({
        "model": "SmolLM2-135M-Instruct", "prompt": [ids], "echo": True, "logprobs": 1,
        "max_tokens": max_tokens, "temperature": 0}).encode())
    assert status == 200, reply
    choice = reply["choices"][0]
    logprobs = choice["logprobs"]["token_logprobs"]
    assert len(logprobs) == len(ids) + max_tokens and logprobs[0] is None
    assert choice["text"].startswith(tokenizer.decode(ids))
    with torch.inference_mode():
        logits = default_target.model(torch.tensor([ids])).logits[0].float()
    expected = torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), ids[1:]]
    assert torch.allclose(torch.tensor(logprobs[1:len(ids)]), expected, atol=1e-4)
    assert reply["usage"]["completion_tokens"] == max_tokens


def test_a_bad_grammar_is_a_400_naming_its_field(client):
    with pytest.raises(openai.BadRequestError, match="cannot be compiled") as refused:
        chat(client, QUESTIONS[5], extra_body={"guided_regex": "(unclosed"})
    assert refused.value.body["param"] == "guided_regex"


def test_hybrid_reads_a_datastore_when_asked(client, default_references):
    reply = chat(client, QUESTIONS[4], extra_body={"method": "hybrid", "datastore": "sums"})
    assert reply.choices[0].message.content == reference(default_references, QUESTIONS[4])
    with pytest.raises(openai.BadRequestError, match="unknown datastore 'nope'"):
        chat(client, QUESTIONS[4], extra_body={"method": "hybrid", "datastore": "nope"})


def test_drafter_options_per_request(client, default_references):
    reply = chat(client, QUESTIONS[3],
                 extra_body={"method": "dresd", "datastore": "sums", "max_tree_nodes": 2})
    assert reply.choices[0].message.content == reference(default_references, QUESTIONS[3])


def test_stop_string_ends_the_text_before_it(client, default_references):
    full = reference(default_references, QUESTIONS[4])
    words = full.split()
    assert len(words) >= 3, full
    stop = " " + words[2]
    expected = full[: full.index(stop)]
    reply = chat(client, QUESTIONS[4], stop=[stop])
    assert reply.choices[0].message.content == expected
    assert reply.choices[0].finish_reason == "stop"
    pieces, finish, _ = stream_chat(client, QUESTIONS[4], stop=stop)
    assert "".join(pieces) == expected and finish == "stop"


def test_a_seed_reproduces_a_sample(client):
    def sample(seed: int) -> str:
        reply = chat(client, "Tell me a story.", temperature=1.0, seed=seed, max_tokens=16)
        return reply.choices[0].message.content

    first = sample(7)
    assert sample(7) == first
    assert len({first, sample(8), sample(9)}) > 1  # the seed, not greedy decoding, decides


@pytest.mark.parametrize("body, status, says", [
    (b'{"messages": [', 400, "not valid JSON"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": "many"}', 400,
     "max_tokens"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}', 400, "at least 1"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000000}', 400,
     "maximum context length"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "method": "magic"}', 400,
     "unknown method"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "method": "dresd", '
     b'"datastore": "elsewhere"}', 400, "unknown datastore"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "method": "pld", "k": 5}', 400,
     "does not apply"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "num_drafts": 100000}', 400,
     "between 1 and"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": -2}', 400,
     "temperature"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4"}', 404,
     "does not exist"),
    (b'{"prompt": "' + b"hello " * 9000 + b'"}', 400, "maximum context length"),
])
def test_bad_input_is_an_openai_error(server, body, status, says):
    path = "/v1/completions" if body.startswith(b'{"prompt"') else "/v1/chat/completions"
    code, reply = raw_post(server.url, path, body)
    assert code == status
    assert says in reply["error"]["message"] and reply["error"]["code"] == status
    assert "Traceback" not in json.dumps(reply)


def test_the_client_sees_errors_and_the_server_stays_up(client, server):
    with pytest.raises(openai.BadRequestError, match="at least 1"):
        chat(client, "hi", max_tokens=0)
    assert chat(client, "hi", max_tokens=2).choices[0].message.content
    lines = [line for line in server.log().splitlines() if "/v1/chat/completions" in line]
    assert any(" 400 " in line and "at least 1" in line for line in lines)


def test_sixteen_concurrent_streams_equal_sequential_output(client, server, default_references):
    # Sequential first (each prompt alone), in this process, so the server is busy only with
    # the streams below.
    expected = [reference(default_references, q) for q in QUESTIONS]
    done_before = finished(server.url)

    def one(question: str) -> tuple[str, float]:
        started = time.perf_counter()
        first = None
        pieces = []
        for chunk in client.chat.completions.create(
                model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": question}],
                max_tokens=MAX_TOKENS, stream=True):
            for choice in chunk.choices:
                if choice.delta.content:
                    first = first or time.perf_counter() - started
                    pieces.append(choice.delta.content)
        return "".join(pieces), first

    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        answers = list(pool.map(one, QUESTIONS))
    assert [text for text, _ in answers] == expected
    assert all(ttft is not None for _, ttft in answers)
    assert metric(server.url, "dresd:num_requests_running") == 0
    assert finished(server.url) - done_before == len(QUESTIONS)
    assert metric(server.url, "dresd:spec_decode_mean_acceptance_length") >= 1.0
    assert metric(server.url, "dresd:mean_batch_size") > 1.0  # requests shared forwards


def test_a_full_queue_is_503(servers):
    small = servers[1]
    client = openai.OpenAI(base_url=small.url + "/v1", api_key="unused", max_retries=0,
                           timeout=120)
    # One long generation runs and one waits; the queue (1) is then full. Plain decoding
    # ("none"): a count is what prompt lookup would draft well, and this one must be slow.
    def long_one() -> None:
        chat(client, "Count from 1 to 300, one number per line.", max_tokens=60,
             extra_body={"method": "none"})

    def wait_for(name: str) -> None:
        deadline = time.monotonic() + 30
        while metric(small.url, name) < 1 and time.monotonic() < deadline:
            time.sleep(0.02)

    threads = [threading.Thread(target=long_one) for _ in range(2)]
    threads[0].start()
    wait_for("dresd:num_requests_running")
    threads[1].start()
    wait_for("dresd:num_requests_waiting")
    with pytest.raises(openai.APIStatusError) as refused:
        chat(client, "hi")
    assert refused.value.status_code == 503 and "queue is full" in str(refused.value)
    for thread in threads:
        thread.join()
    assert chat(client, "hi", max_tokens=2).choices[0].message.content  # up, and serving


def test_saved_outputs_hold_the_exact_ids(servers, default_target):
    """--save-outputs: each generation a corpus row, ids as the model saw and produced them."""
    small, saved = servers[1], servers[2]
    client = openai.OpenAI(base_url=small.url + "/v1", api_key="unused", max_retries=0,
                           timeout=120)
    reply = chat(client, QUESTIONS[3]).choices[0].message.content
    row = json.loads(saved.read_text().splitlines()[-1])  # written before the reply was sent
    tokenizer = default_target.tokenizer
    assert row["prompt_ids"] == encode_prompt(tokenizer, QUESTIONS[3])
    assert tokenizer.decode(row["token_ids"], skip_special_tokens=True) == reply
    assert row["response"] == reply and row["prompt"] == tokenizer.decode(row["prompt_ids"])
    assert row["model_fingerprint"] == default_target.fingerprint


def test_a_client_that_leaves_stops_its_generation(servers):
    small = servers[1]
    aborted = metric(small.url, "dresd:request_success_total", 'finished_reason="abort"')
    connection = http.client.HTTPConnection("127.0.0.1", small.port, timeout=60)
    essay = "Write a very long essay about the history of Rome, with many details."
    body = {"messages": [{"role": "user", "content": essay}],
            "max_tokens": 4000, "stream": True, "method": "none"}
    connection.request("POST", "/v1/chat/completions", json.dumps(body),
                       {"Content-Type": "application/json"})
    reply = connection.getresponse()
    assert reply.status == 200
    while not re.search(rb'"content": "[^"]', reply.readline()):
        pass  # until the first piece of text
    connection.sock.shutdown(socket.SHUT_RDWR)  # the client goes away mid-stream
    connection.close()
    # The verdict is the finish reason, not a time: a generation that went on would end with
    # "length", never "abort". The deadline only bounds a hang, so a loaded machine, slow to
    # reach the next step, does not fail the test.
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if (metric(small.url, "dresd:request_success_total", 'finished_reason="abort"')
                > aborted and metric(small.url, "dresd:num_requests_running") == 0):
            break
        time.sleep(0.2)
    else:
        pytest.fail("the generation went on after its client left")
    assert chat(openai.OpenAI(base_url=small.url + "/v1", api_key="unused", max_retries=0),
                "hi", max_tokens=2).choices[0].message.content


def test_streamed_text_keeps_multibyte_characters_whole(default_target):
    tokenizer = default_target.tokenizer
    text = "Drachen 🐉 fliegen über Zürich, 東京 too."
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(text.split())  # some characters take several tokens
    pieces = protocol.IncrementalText(tokenizer, stop=[])
    sent = [pieces.add([token]) for token in ids] + [pieces.finish()]
    assert "".join(sent) == tokenizer.decode(ids)
    assert not any("\ufffd" in piece for piece in sent)


def test_streamed_text_never_sends_a_stop_string(default_target):
    tokenizer = default_target.tokenizer
    ids = tokenizer("one two three four five", add_special_tokens=False)["input_ids"]
    pieces = protocol.IncrementalText(tokenizer, stop=[" four"])
    sent = [pieces.add([token]) for token in ids] + [pieces.finish()]
    assert "".join(sent) == "one two three" and pieces.stopped


def big_body(port: int, size: int, chunked: bool) -> tuple[int, dict]:
    """POST a chat body of `size` bytes; (status, JSON reply). Chunked: no Content-Length, so
    the server counts the bytes as they come."""
    text = "x" * size
    body = json.dumps({"model": "SmolLM2-135M-Instruct",
                       "messages": [{"role": "user", "content": text}]}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.putrequest("POST", "/v1/chat/completions")
    conn.putheader("Content-Type", "application/json")
    if chunked:
        conn.putheader("Transfer-Encoding", "chunked")
    else:
        conn.putheader("Content-Length", str(len(body)))
    conn.endheaders()
    try:
        for start in range(0, len(body), 1 << 16):
            piece = body[start:start + (1 << 16)]
            conn.send(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
        if chunked:
            conn.send(b"0\r\n\r\n")
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server answered and closed before the whole body was sent
    reply = conn.getresponse()
    return reply.status, json.loads(reply.read() or b"{}")


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_huge_body_is_413_and_the_server_stays_responsive(server, client, chunked):
    """A 20 MB body is refused before it is parsed; /health and a small request answer
    meanwhile (the event loop is never held by it)."""
    with ThreadPoolExecutor(1) as pool:
        huge = pool.submit(big_body, server.port, 20_000_000, chunked)
        started = time.perf_counter()
        with urllib.request.urlopen(server.url + "/health", timeout=30) as reply:
            assert reply.status == 200
        health_seconds = time.perf_counter() - started
        assert chat(client, "hi", max_tokens=2).choices[0].message.content
        status, reply = huge.result()
    assert status == 413 and "larger than this server's limit" in reply["error"]["message"]
    assert health_seconds < 5  # a held event loop took 22 s here


def test_loading_runs_on_a_thread_that_ends():
    """The server loads on a thread of its own that is gone when loading returns (its OpenMP
    pool with it), and a failure there is raised on the caller's thread."""
    seen = {}

    def load(value: int) -> int:
        seen["thread"] = threading.current_thread()
        return value + 1

    assert on_a_passing_thread(load, 41) == 42
    assert seen["thread"] is not threading.current_thread()
    assert not seen["thread"].is_alive()

    def fail() -> None:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        on_a_passing_thread(fail)
