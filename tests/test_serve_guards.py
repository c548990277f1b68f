"""One request never harms another, against real `dresd serve` processes on the tiny model:
every field checked at the edge (a 400 naming it, never a 500), a fuzzer of request bodies
beside a good request whose output must not change, and a worker that dies taking the process
with it (/health 503, every waiting request answered, exit code 70), never a silent hang."""

from __future__ import annotations

import http.client
import json
import os
import threading
import time
from pathlib import Path

import jinja2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reliability_helpers import save_tiny_model

from dresd.cli.serve import WORKER_DIED_EXIT
from dresd.serve import protocol
from dresd.serve.app import tokenize
from dresd.serve.engine import RequestError
from dresd.serve.local import LocalServer

COMMON = ["--threads", "1", "--max-new-tokens", "8", "--dtype", "float32", "--method", "pld",
          "--max-batch-size", "4"]
# The tiny model's tokens take 256 bytes of KV cache, a request's buffer 64 KB (256 rows) or
# 128 KB: half a MB holds four to eight requests, and 16 choices of one never fit.
KV_MB = 0.5

# Loaded by the doomed server's interpreter (on PYTHONPATH): its batched step raises a
# BaseException, which no per-request guard catches, once the test creates DIE_FILE.
SITECUSTOMIZE = """
import os, time, dresd.decoding.batch as batch

class InjectedDeath(BaseException):
    pass

_step = batch.BatchEngine.step

def step(self):
    if os.path.exists(os.environ["DRESD_TEST_DIE_FILE"]):
        raise InjectedDeath("killed on purpose by the test")
    time.sleep(0.02)  # slow enough that requests are still running when it dies
    return _step(self)

batch.BatchEngine.step = step
"""


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("guards") / "tiny")


@pytest.fixture(scope="module")
def server(tiny_folder):
    with LocalServer(["--model", str(tiny_folder), *COMMON, "--max-kv-mb", str(KV_MB)]) as live:
        yield live
    assert "Traceback" not in live.log()


def post(server: LocalServer, body: bytes | dict, path: str = "/v1/completions",
         timeout: float = 60) -> tuple[int, dict | str]:
    """(status, the JSON reply, or its text where it is not JSON)."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)
    try:
        conn.request("POST", path, raw, {"Content-Type": "application/json"})
        reply = conn.getresponse()
        text = reply.read().decode("utf-8", "replace")
    finally:
        conn.close()
    try:
        return reply.status, json.loads(text)
    except ValueError:
        return reply.status, text


def health(server: LocalServer) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status
    finally:
        conn.close()


def completion(server: LocalServer, prompt: str, **fields) -> str:
    status, reply = post(server, {"prompt": prompt, "max_tokens": 8, **fields})
    assert status == 200, reply
    return reply["choices"][0]["text"]


def streamed(server: LocalServer, prompt: str, max_tokens: int = 8) -> tuple[str, list[dict]]:
    """A streamed completion's text and its events (an error arrives as one)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(
        {"prompt": prompt, "max_tokens": max_tokens, "stream": True}),
        {"Content-Type": "application/json"})
    reply = conn.getresponse()
    events = [json.loads(line[6:]) for line in reply.read().decode().splitlines()
              if line.startswith("data: {")]
    conn.close()
    text = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
    return text, events


@pytest.mark.parametrize("fields,param", [
    ({"seed": 2**64}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": "x" * 300}, "stop"),
    ({"n": 16, "max_tokens": 100}, "max_tokens"),  # never fits --max-kv-mb
    ({"max_tokens": 200_000}, "max_tokens"),  # past the context
    ({"temperature": -1}, "temperature"),
    ({"temperature": 0.5, "top_p": 0}, "top_p"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logit_bias": {"10": 101}}, "logit_bias"),
    ({"logit_bias": {"999999999": 1}}, "logit_bias"),
    ({"logit_bias": {"a": 1}}, "logit_bias"),
    ({"temperature": 0.5, "min_p": 1.5}, "min_p"),
])
def test_a_bad_field_is_a_400_naming_it(server, fields, param):
    status, reply = post(server, {"prompt": "Hello", "max_tokens": 4, **fields})
    assert status == 400, reply
    assert reply["error"]["param"] == param, reply


@pytest.mark.parametrize("raw", [
    b'{"prompt": "Hello", "temperature": NaN}',
    b'{"prompt": "Hello", "top_p": Infinity, "temperature": 1}',
    b'{"prompt": "a\\ud800b"}',  # a lone surrogate: the tokenizer cannot take it
    b'{"prompt": [{}]}',
])
def test_odd_bodies_are_a_json_400(server, raw):
    status, reply = post(server, raw)
    assert status == 400 and isinstance(reply, dict) and "error" in reply, (status, reply)


def test_a_chat_template_that_fails_is_a_400():
    """A template that raises on what it is given (as Mistral's do on roles out of order)."""
    class Refusing:
        chat_template = "{{ raise_exception('roles must alternate') }}"

        def apply_chat_template(self, *args, **kwargs):
            raise jinja2.exceptions.TemplateError("roles must alternate")

    body = protocol.ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(RequestError, match="roles must alternate") as refused:
        tokenize(body, Refusing())
    assert refused.value.status == 400 and refused.value.param == "messages"


def test_a_lone_surrogate_in_the_model_name_is_a_json_404(server):
    status, reply = post(server, b'{"model": "\\ud800", "prompt": "Hello"}')
    assert status == 404 and isinstance(reply, dict), reply


def test_edge_values_that_are_valid_are_served(server):
    assert completion(server, "Hello", seed=2**63 - 1, n=2, temperature=0.9) is not None
    # six choices fit beside each other in --max-kv-mb; what does not fit now waits its turn
    assert completion(server, "Hello", n=6, max_tokens=100) is not None
    # a temperature below 1e-5 is greedy decoding, not NaN probabilities
    assert completion(server, "Hello", temperature=1e-40, seed=1) == completion(server, "Hello")


def test_a_tiny_temperature_beside_a_stream_harms_neither(server):
    alone, _ = streamed(server, "Once upon a time", max_tokens=24)
    results = {}
    stream = threading.Thread(target=lambda: results.update(
        text=streamed(server, "Once upon a time", max_tokens=24)))
    stream.start()
    for _ in range(4):
        completion(server, "Hello", temperature=1e-40, seed=1)
    stream.join()
    assert results["text"][0] == alone and "error" not in str(results["text"][1])


# -- the fuzzer -------------------------------------------------------------------------------

SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                    st.floats(allow_nan=False), st.text(max_size=20))
JSON = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12)
TYPED = {  # each of the server's fields with values of its type, in range or out of it
    "max_tokens": st.one_of(st.integers(-5, 40), st.integers(-(2**70), 2**70)),
    "temperature": st.one_of(st.floats(0, 3), st.floats(-1e-30, 1e-30), st.floats(-10, 1e6)),
    "top_p": st.floats(-1, 2),
    "top_k": st.integers(-3, 100),
    "seed": st.integers(-(2**65), 2**65),
    "stop": st.one_of(st.text(max_size=300), st.lists(st.text(max_size=12), max_size=6)),
    "n": st.integers(-2, 20),
    "logprobs": st.integers(-2, 25),
    "stream": st.booleans(),
    "method": st.sampled_from(["ar", "pld", "suffix", "hybrid", "dresd", "rest", "x"]),
    "num_drafts": st.integers(-2, 100),
    "max_tree_nodes": st.integers(-2, 600),
    "cache_salt": st.text(max_size=10),
    "echo": st.booleans(),
}
PROMPT = st.one_of(st.text(max_size=40), st.lists(st.text(max_size=10), max_size=3))
TYPED_BODIES = st.fixed_dictionaries({"prompt": PROMPT}, optional=TYPED)
# ... and bodies whose every field may hold any JSON at all, unknown fields beside them
JUNK_BODIES = st.fixed_dictionaries(
    {"prompt": st.one_of(PROMPT, JSON)},
    optional={name: st.one_of(values, JSON) for name, values in TYPED.items()}).flatmap(
    lambda body: st.dictionaries(st.text(max_size=10), JSON, max_size=2).map(
        lambda extra: {**extra, **body}))
BODIES = st.one_of(TYPED_BODIES, JUNK_BODIES)


def test_fuzzed_requests_get_2xx_or_4xx_and_harm_no_good_request(server):
    fuzz(server, examples=150)


@pytest.mark.slow
def test_many_fuzzed_requests(server):
    fuzz(server, examples=3000)


def fuzz(server: LocalServer, examples: int) -> None:
    """`examples` generated bodies, each answered 2xx or 4xx with a JSON error, while a good
    request runs again and again beside them and always generates the same text."""
    good = "Count with me: one, two,"
    expected, _ = streamed(server, good, max_tokens=32)
    outcomes: dict[int, int] = {}
    stop = threading.Event()
    good_runs: list[str] = []

    def keep_generating() -> None:  # a good request, again and again, beside the fuzz
        while not stop.is_set():
            good_runs.append(streamed(server, good, max_tokens=32)[0])

    beside = threading.Thread(target=keep_generating)
    beside.start()

    @settings(max_examples=examples, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(BODIES, st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    def one(body: dict, path: str) -> None:
        if path.endswith("chat/completions") and "prompt" in body:
            body["messages"] = [{"role": "user", "content": body.pop("prompt")}]
        status, reply = post(server, body, path)
        outcomes[status] = outcomes.get(status, 0) + 1
        assert 200 <= status < 500, (body, status, reply)
        if status >= 400:
            assert isinstance(reply, dict) and "error" in reply, (body, status, reply)

    try:
        one()
    finally:
        stop.set()
        beside.join()
    print(f"fuzzed requests by status: {dict(sorted(outcomes.items()))}; "
          f"the good request ran {len(good_runs)} times beside them")
    assert good_runs and all(text == expected for text in good_runs)
    assert health(server) == 200


# -- a worker that dies ----------------------------------------------------------------------

def test_a_dead_worker_fails_every_request_and_ends_the_process(tiny_folder, tmp_path):
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    die_file = tmp_path / "die-now"
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
           "DRESD_TEST_DIE_FILE": str(die_file)}
    doomed = LocalServer(["--model", str(tiny_folder), *COMMON], env=env)
    with doomed:
        assert completion(doomed, "Hello")  # it serves until the worker dies
        replies: list = []
        waiting = [threading.Thread(target=lambda: replies.append(
            post(doomed, {"prompt": "Hello there", "max_tokens": 240}, timeout=30)))
            for _ in range(6)]  # some in the batch, some queued
        for thread in waiting:
            thread.start()
        time.sleep(1.0)
        die_file.touch()
        started = time.monotonic()
        while True:  # /health says so at once (or the port has closed: the process ended)
            try:
                if health(doomed) == 503:
                    break
            except OSError:
                break
            assert time.monotonic() - started < 1.0, "/health still 200 a second later"
            time.sleep(0.02)
        unhealthy_after = time.monotonic() - started
        for thread in waiting:
            thread.join(timeout=30)
            assert not thread.is_alive(), "a request was left hanging"
        answered_after = time.monotonic() - started
        assert len(replies) == 6 and all(status == 503 for status, _ in replies), replies
        assert doomed.process.wait(timeout=30) == WORKER_DIED_EXIT
        print(f"worker killed: /health 503 after {unhealthy_after:.3f} s, all 6 requests "
              f"answered 503 after {answered_after:.3f} s, exit {WORKER_DIED_EXIT} after "
              f"{time.monotonic() - started:.3f} s")
    assert "InjectedDeath" in doomed.log()


# -- tenants -----------------------------------------------------------------------------------

TENANT_KEYS = {"alice": "sk-alice-0123", "bob": "sk-bob-4567"}
LONG_PROMPT = " ".join(f"item {i}: a line of the shared system prompt." for i in range(12))


@pytest.fixture(scope="module")
def tenants_server(tiny_folder, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    key_file.write_text("# tenant key\n" + "".join(f"{t} {k}\n" for t, k in TENANT_KEYS.items()))
    # --no-budget: trees verified as drafted, so that a run's forwards depend on what its
    # drafter learned alone (the budget's acceptance estimates are the server's, docs/serving.md)
    with LocalServer(["--model", str(tiny_folder), *COMMON, "--no-budget", "--api-key-file",
                      str(key_file)]) as live:
        yield live
    assert "Traceback" not in live.log()
    assert not any(key in live.log() for key in TENANT_KEYS.values())


def as_tenant(server: LocalServer, tenant: str, body: dict,
              path: str = "/v1/completions") -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.request("POST", path, json.dumps(body), {
            "Content-Type": "application/json",
            "Authorization": f"Bearer {TENANT_KEYS[tenant]}"})
        reply = conn.getresponse()
        assert reply.status == 200, reply.read()
        return json.loads(reply.read())
    finally:
        conn.close()


def test_anthropic_clients_key_header_names_the_tenant_too(tenants_server):
    conn = http.client.HTTPConnection("127.0.0.1", tenants_server.port, timeout=60)
    for key, status in [(TENANT_KEYS["bob"], 200), ("sk-wrong", 401)]:
        conn.request("POST", "/v1/messages", json.dumps(
            {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}),
            {"Content-Type": "application/json", "x-api-key": key})
        reply = conn.getresponse()
        reply.read()
        assert reply.status == status
    conn.close()


def cached(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_tenants_share_no_prefix_cache_entry_and_reset_their_own(tenants_server):
    body = {"prompt": LONG_PROMPT, "max_tokens": 4, "method": "ar"}
    assert cached(as_tenant(tenants_server, "alice", body)) == 0
    again = cached(as_tenant(tenants_server, "alice", body))
    assert again > 0 and again % 16 == 0  # whole blocks: it says nothing to the token
    # the same prompt, and even the same cache_salt, from bob: none of alice's entries
    assert cached(as_tenant(tenants_server, "bob", body)) == 0
    assert cached(as_tenant(tenants_server, "bob", {**body, "cache_salt": ""})) > 0
    as_tenant(tenants_server, "bob", {}, "/reset_prefix_cache")  # bob's entries only
    assert cached(as_tenant(tenants_server, "bob", body)) == 0
    assert cached(as_tenant(tenants_server, "alice", body)) == again


def test_a_tenant_drafts_from_its_own_outputs_only(tenants_server):
    body = {"prompt": "Tell me the story of the tiny random model.", "max_tokens": 48,
            "method": "suffix"}
    forwards = {}
    for turn, tenant in enumerate(["alice", "alice", "bob"]):
        reply = as_tenant(tenants_server, tenant, body)
        forwards[turn] = reply["dresd"]["num_target_forwards"]
    assert forwards[1] < forwards[0]  # alice's second run drafts her first output
    assert forwards[2] == forwards[0]  # bob's first run knows nothing of hers


@pytest.mark.parametrize("field,value", [
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ("best_of", 3),
    ("suffix", "and then"),
])
def test_a_field_not_honoured_is_refused_not_dropped(server, field, value):
    status, reply = post(server, {"prompt": "Hello", "max_tokens": 2, field: value})
    assert status == 400 and reply["error"]["param"] == field, reply


def test_fields_at_values_that_ask_nothing_are_served(server):
    assert completion(server, "Hello", presence_penalty=0, frequency_penalty=0.0,
                      logit_bias={}, tool_choice="none", best_of=1, user="u-1") is not None
