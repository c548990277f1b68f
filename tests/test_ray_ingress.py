"""The Ray Serve ingress (serve/ray_routing.py) without Ray running: its ASGI app in front of a
fake deployment handle, its request router on stand-in replicas, a model replica's health
check on a stand-in app.

What it must hold (issue 47, item 7): the API key is checked before any body is read; at most
`max_in_flight` requests are held, the rest get 503 at once; odd JSON never makes a 500 (a body
it cannot key goes to a replica unkeyed, one nested too deep gets 400); a replica whose /health
is not 200 gets no requests until it answers 200 again.
"""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve", reason="Ray is optional: pip install 'dresd[ray]'")

from dresd.serve.auth import unauthorized_body  # noqa: E402
from dresd.serve.ray_routing import (  # noqa: E402
    MAX_JSON_DEPTH,
    AffinityIngress,
    ModelReplica,
    PrefixAffinityRouter,
    ReplicaHealth,
    conversation_key,
    json_too_deep,
    rank_replicas,
)

KEY = "sk-ingress-test"
CHAT = json.dumps({"messages": [{"role": "user", "content": "Hi?"}]}).encode()


class FakeReplicas:
    """A deployment handle's stand-in: records each forwarded call (its session_id and body)
    and answers 200 with a small JSON body, once `gate` is set."""

    def __init__(self) -> None:
        self.calls: list[tuple[str | None, bytes]] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.session_id: str | None = None

    def options(self, stream: bool = False, session_id: str | None = None) -> FakeReplicas:
        self.session_id = session_id
        return self

    @property
    def forward(self) -> SimpleNamespace:
        return SimpleNamespace(remote=self.remote)

    def remote(self, scope: dict, body: bytes) -> FakeResponses:
        self.calls.append((self.session_id, body))
        return FakeResponses(self.gate)


class FakeResponses:
    """What `handle.forward.remote()` returns: an async iterator of ASGI messages."""

    def __init__(self, gate: asyncio.Event) -> None:
        self.gate = gate

    def cancel(self) -> None:
        pass

    async def __aiter__(self):
        await self.gate.wait()
        yield {"type": "http.response.start", "status": 200,
               "headers": [(b"content-type", b"application/json")]}
        yield {"type": "http.response.body", "body": b"{}"}


class Reply(SimpleNamespace):
    status: int
    headers: dict
    body: bytes
    reads: int  # how many times the app called receive()

    def json(self):
        return json.loads(self.body)


async def request(app, body: bytes = b"", path: str = "/v1/chat/completions",
                  method: str = "POST", key: str | None = KEY) -> Reply:
    """One HTTP request through an ASGI app (the body in one message)."""
    headers = [(b"content-length", str(len(body)).encode())]
    if key is not None:
        headers.append((b"authorization", f"Bearer {key}".encode()))
    scope = {"type": "http", "method": method, "path": path, "headers": headers,
             "query_string": b"", "client": ("127.0.0.1", 1)}
    reply = Reply(status=None, headers={}, body=b"", reads=0)

    async def receive() -> dict:
        reply.reads += 1
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            reply.status = message["status"]
            reply.headers = dict(message.get("headers", ()))
        else:
            reply.body += message.get("body", b"")

    await app(scope, receive, send)
    return reply


def ingress(replicas: FakeReplicas | None = None, **options) -> AffinityIngress:
    options = {"api_key": KEY, "health": ReplicaHealth(), **options}
    return AffinityIngress(replicas or FakeReplicas(), 64 << 20, **options)


# -- 1. the API key, before the body --------------------------------------------------------

def test_the_key_is_checked_before_the_body_is_read():
    replicas = FakeReplicas()
    app = ingress(replicas)

    async def run() -> list[Reply]:
        return [await request(app, CHAT, key=None), await request(app, CHAT, key="sk-wrong"),
                await request(app, CHAT, path="/reset_prefix_cache", key="sk-wrong"),
                await request(app, b"", path="/health", method="GET", key=None),
                await request(app, CHAT)]

    missing, wrong, reset, health, right = asyncio.run(run())
    # the single-process server's 401: the same body, the same header
    assert (missing.status, missing.json()) == (401, unauthorized_body(False))
    assert (wrong.status, wrong.json()) == (401, unauthorized_body(True))
    assert reset.status == 401
    assert missing.headers[b"www-authenticate"] == b"Bearer"
    assert missing.reads == wrong.reads == reset.reads == 0  # no body read for a refusal
    assert health.status == 200 and right.status == 200  # /health needs no key
    assert [body for _, body in replicas.calls] == [b"", CHAT]  # only those two reached one


# -- 2. a bound on requests in flight -------------------------------------------------------

def test_requests_past_the_bound_get_503_at_once():
    replicas = FakeReplicas()
    app = ingress(replicas, max_in_flight=2)

    async def run() -> tuple[Reply, list[Reply], Reply]:
        replicas.gate.clear()  # the replicas hold every request until the gate opens
        held = [asyncio.create_task(request(app, CHAT)) for _ in range(2)]
        await asyncio.sleep(0.01)
        assert app.in_flight == 2
        refused = await asyncio.wait_for(request(app, CHAT), 1)  # no waiting for a slot
        replicas.gate.set()
        done = await asyncio.gather(*held)
        return refused, done, await request(app, CHAT)

    refused, done, after = asyncio.run(run())
    assert refused.status == 503 and refused.reads == 0
    assert refused.json()["error"]["type"] == "ServiceUnavailableError"
    assert refused.headers[b"retry-after"] == b"1"
    assert [reply.status for reply in done] == [200, 200]
    assert after.status == 200 and app.in_flight == 0  # the slots came back
    assert len(replicas.calls) == 3


def test_the_default_bound_is_what_the_replicas_hold():
    from argparse import Namespace

    from dresd.serve.ray_serve import ingress_max_requests

    args = Namespace(replicas=2, max_replicas=None, max_queue=64, max_batch_size=16)
    assert ingress_max_requests(args) == 2 * (64 + 16)
    assert ingress_max_requests(Namespace(**{**vars(args), "max_replicas": 3})) == 3 * 80
    assert ingress_max_requests(Namespace(**vars(args), ingress_max_requests=5)) == 5


# -- 3. odd bodies: 400 or a replica's answer, never a 500 ---------------------------------

ODD_BODIES = [
    b'{"model": "m", "prompt": [{}]}',  # was TypeError in conversation_key
    b'{"prompt": [null, "x"]}', b'{"prompt": [[{}]]}', b'{"prompt": {}}',
    b'{"messages": [1, null, {"role": 5}]}', b'{"messages": "hi"}',
    b'[1, 2]', b'"text"', b'null', b'3',  # not objects
    b'\xff\xfe{"prompt": "x"}',  # not UTF-8
    b'{"prompt": "unterminated', b'{"a": NaN}',
]


@pytest.mark.parametrize("body", ODD_BODIES)
def test_odd_json_goes_to_a_replica_unkeyed(body):
    replicas = FakeReplicas()
    reply = asyncio.run(request(ingress(replicas), body))
    assert reply.status == 200  # the replica's own answer (the fake's 200; a real one: 400)
    assert [sent for _, sent in replicas.calls] == [body]


def test_json_nested_too_deep_gets_400_unforwarded():
    replicas = FakeReplicas()
    app = ingress(replicas)
    deep = b"[" * 5000 + b"]" * 5000  # json.loads: RecursionError (a 500 before)
    large_deep = b"[" * (2 << 20)  # past PARSE_ON_THREAD_BYTES: checked on a thread
    deep_object = json.dumps({"messages": [{"role": "user", "content": "x"}],
                              "extra": json.loads("[" * 200 + "]" * 200)}).encode()
    replies = [asyncio.run(request(app, body)) for body in (deep, deep_object, large_deep)]
    for reply in replies:
        assert reply.status == 400
        assert reply.json()["error"]["type"] == "BadRequestError"
        assert str(MAX_JSON_DEPTH) in reply.json()["error"]["message"]
    assert replicas.calls == []
    # brackets inside strings do not nest; as deep as the limit is fine
    fine = [json.dumps({"prompt": "[" * 5000}).encode(),
            json.dumps(json.loads("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH)).encode()]
    assert [asyncio.run(request(app, body)).status for body in fine] == [200, 200]


def test_json_too_deep_counts_only_nesting():
    limit = MAX_JSON_DEPTH
    assert not json_too_deep(b"[" * limit + b"]" * limit)
    assert json_too_deep(b"[" * (limit + 1) + b"]" * (limit + 1))
    assert not json_too_deep(json.dumps([[1]] * 10_000).encode())  # many, shallow
    assert not json_too_deep(json.dumps(["[{" * 1000, 'a"\\[' * 500]).encode())  # in strings
    # one pass over a long string (a backtracking pattern took 3.5 s on this one)
    started = time.perf_counter()
    assert not json_too_deep(b'["' + b"[" * (8 << 20) + b'"]')
    assert time.perf_counter() - started < 1
    # past one scanning chunk (1 MiB of brackets): the depth carries over
    assert json_too_deep(b"[]" * (1 << 20) + b"{" * (limit + 1))
    assert not json_too_deep(b"[]" * (1 << 20) + b"{" * limit)


def test_conversation_key_takes_any_json():
    for body in ODD_BODIES[:10]:
        conversation_key(json.loads(body))  # no exception
    assert conversation_key({"prompt": [{}]}) is None  # unkeyed: any replica refuses it
    assert conversation_key({"prompt": {}}) is None and conversation_key([1]) is None
    assert conversation_key({"prompt": [[1, 2], [3]]}) == conversation_key({"prompt": [1, 2]})
    assert conversation_key({"prompt": ["ab", "cd"]}) == conversation_key({"prompt": "ab"})
    assert conversation_key({"messages": [{1: "a", "b": 2}]}) is None  # not from JSON


# -- 4. a replica whose /health is not 200 gets no requests ---------------------------------

def router_choice(health: ReplicaHealth, key: str, replicas: list[str]) -> list[list[str]]:
    """PrefixAffinityRouter.choose_replicas on stand-ins: the replicas' ranks for `key`."""
    router = SimpleNamespace(spill_at=None, health=health,
                             replica_queue_len_cache=SimpleNamespace(get=lambda _: None))
    router.busy = lambda replica: PrefixAffinityRouter.busy(router, replica)
    stand_ins = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=name))
                 for name in replicas]
    request = SimpleNamespace(metadata=SimpleNamespace(session_id=key),
                              routing_context=SimpleNamespace(should_backoff=False))
    ranks = asyncio.run(PrefixAffinityRouter.choose_replicas(router, stand_ins, request))
    return [[replica.replica_id.unique_id for replica in rank] for rank in ranks]


def test_a_replica_not_healthy_is_skipped_until_it_answers_200():
    health, replicas, now = ReplicaHealth(stale_s=15), ["a", "b", "c"], 1000.0
    key = conversation_key(json.loads(CHAT))
    first, second, third = rank_replicas(key, replicas)
    health.update({name: (now, 200) for name in replicas}, now)
    assert router_choice(health, key, replicas) == [[first], [second], [third]]
    # the conversation's replica says 503 (its worker died): the next in its ranking
    health.update({first: (now + 5, 503), second: (now, 200), third: (now, 200)}, now + 5)
    assert router_choice(health, key, replicas) == [[second], [third]]
    [unkeyed] = router_choice(health, "", replicas)  # one rank: the least loaded live one
    assert sorted(unkeyed) == sorted([second, third])
    # 200 again: back to its replica, whose cache holds the conversation
    health.update({name: (now + 10, 200) for name in replicas}, now + 10)
    assert router_choice(health, key, replicas) == [[first], [second], [third]]
    # one that stopped answering (no report for stale_s) is down too
    health.update({first: (now, 200), second: (now + 20, 200), third: (now + 20, 200)},
                  now + 20)
    assert router_choice(health, key, replicas) == [[second], [third]]
    # every one down: all of them, for their own answer (a request never waits for one)
    health.update({name: (now, 503) for name in replicas}, now + 20)
    assert router_choice(health, key, replicas) == [[first], [second], [third]]
    assert health.none_up()


def test_the_ingress_reads_the_replicas_health_and_answers_503_when_none_is_up():
    reports = {"a": (0.0, 200), "b": (0.0, 200)}

    async def health_reports() -> dict:
        return {name: (time.time(), status) for name, (_, status) in reports.items()}

    replicas = FakeReplicas()
    app = ingress(replicas, health_reports=health_reports)

    async def run() -> list[Reply]:
        replies = []
        for statuses in ((200, 200), (503, 200), (503, 503), (200, 503)):
            reports.update({"a": (0.0, statuses[0]), "b": (0.0, statuses[1])})
            await app.refresh_health()
            replies.append(await request(app, CHAT))
        return replies

    replies = asyncio.run(run())
    assert [reply.status for reply in replies] == [200, 200, 503, 200]
    assert replies[2].json()["error"]["type"] == "ServiceUnavailableError"
    assert len(replicas.calls) == 3


class HealthApp:
    """A stand-in for the server's app: its lifespan, and GET /health answered with
    `status` (the single-process server's 503 once its worker thread has died)."""

    def __init__(self) -> None:
        self.status = 200

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        await send({"type": "http.response.start", "status": self.status, "headers": []})
        await send({"type": "http.response.body", "body": b""})


def test_a_model_replica_reports_its_health_and_fails_ray_serves_check():
    """Each of Ray Serve's health checks puts the replica's /health status on the board (where
    the ingress reads it); a status not 200 fails the check, so Ray Serve replaces it."""
    app, sent = HealthApp(), []
    board = SimpleNamespace(put_health=SimpleNamespace(
        remote=lambda replica, status: sent.append(status)))

    class Replica(ModelReplica):
        def __del__(self) -> None:  # Ray Serve awaits the async one; the test shuts it down
            pass

    async def run() -> None:
        replica = object.__new__(Replica)
        await replica.__init__(lambda: app, board)
        await replica.check_health()
        app.status = 503
        with pytest.raises(RuntimeError, match="503"):
            await replica.check_health()
        app.status = 200
        await replica.check_health()
        await replica.lifespan.shutdown()

    asyncio.run(run())
    assert sent == [200, 200, 503, 200]  # at its start, then at each check
