"""Which replica answers a request under `dresd serve --ray --replicas N`: the one that holds
its conversation's prefix cache.

Each replica has its own prefix cache, so a chat's second turn hits only if it reaches the
replica that answered the first. Ray Serve's proxy cannot route on what it has not read (the
body reaches a replica after it is chosen), so the deployment has a small ingress in front of
the replicas (no model, no CPU reserved):

- `AffinityIngress` (the app's HTTP ingress) checks the API key from the headers (a refused
  request reads no body), answers 503 past `max_in_flight` requests at once (by default what
  the replicas hold) and 400 to a body nested past MAX_JSON_DEPTH; it reads the body, derives
  the request's *conversation key* (`conversation_key`: the `cache_salt` and the messages up
  to and including the first user message, or the first characters of a completion's prompt;
  none for a body that is not JSON or not a request, which any replica refuses), and passes the
  request on to the model replicas through a deployment handle with the key as Ray Serve's
  `session_id`; the replica's response (the app's ASGI messages, streamed) comes back the same
  way. Requests without a body (/health, /metrics, /v1/models) carry no key.
- `PrefixAffinityRouter` (the replicas' Ray Serve request router) ranks the replicas for a key
  by rendezvous hashing (highest hash of key and replica id first): the same key always ranks
  the same replica first while it lives, and a replica added or gone moves only the keys it
  gains or held. The first replica in the ranking that accepts the request (fewer than
  `max_ongoing_requests` in flight) gets it. One whose batch is full (`spill_at` requests in
  flight: new ones would wait) yields its place to a replica with room, so one hot prefix
  cannot hold requests in a queue while another replica idles; a request without a key goes to
  the least loaded replica.
- `ReplicaHealth`: a replica whose /health is not 200 (the server's answer once its worker
  thread has died), or that has not reported one for HEALTH_STALE_S, is skipped by the router
  until it reports 200 again: a conversation pinned to it moves to the next replica in its
  ranking. Each replica reports its status to the metrics board at Ray Serve's health checks
  (`ModelReplica.check_health`, which also fails, so that Ray Serve replaces a replica that
  stays unhealthy); the ingress reads the board every HEALTH_EVERY_S.

Why the first user message and not the first K tokens: every chat of an application shares its
system prompt, so a key of the first K tokens would send all of them to one replica; the first
user message tells conversations apart, and stays the same in every later turn of one
conversation (the history is resent whole). Requests that differ only after it (different
second turns of one first question) share a replica, which is where their shared prefix is.

This module imports Ray at its top: `ray_serve.deploy` imports it only with affinity on.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import numpy as np
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from dresd.serve import protocol
from dresd.serve.auth import APIKeyCheck

log = logging.getLogger(__name__)

# A completion's prompt has no structure to split on: its first characters (or token ids) are
# the key, long enough to tell documents apart, short enough that a conversation's next turn
# (the same text, more appended) keeps it.
COMPLETION_PREFIX_CHARS = 256
COMPLETION_PREFIX_TOKENS = 64
# Bodies larger than this are not read by the ingress (without --max-body-bytes): the replica
# refuses them with 413 from their declared length or from what arrived.
INGRESS_BODY_CAP = 64 << 20
# The key of a request meant for one replica (ONE_REPLICA + its id): /reset_prefix_cache goes
# to every replica, each cache being its own. Conversation keys are hex, never this.
ONE_REPLICA = "@replica:"
BROADCAST_ROUTES = {("POST", "/reset_prefix_cache")}
BROADCAST_TIMEOUT_S = 30.0
# A request still running this long after its client left is cancelled outright (the app
# notices a client gone within a second and stops by itself; this is the backstop).
ABANDONED_S = 60.0


# Bodies nested deeper than this are refused (400) before they are parsed: no OpenAI request
# comes near it (a tool's JSON schema, the deepest part, is a few levels), and Python's json
# raises RecursionError near 1,000 levels, on the ingress and again on a replica.
MAX_JSON_DEPTH = 64
PARSE_ON_THREAD_BYTES = 1 << 20
# Requests the ingress holds at once without --ingress-max-requests: what the replicas hold
# (`max_ongoing_requests` each); past it the ingress answers 503 at once, so a burst waits
# nowhere unbounded. Ray Serve sends the ingress INGRESS_HEADROOM more than that, so the
# requests past the bound reach it and get OpenAI's 503, not Ray Serve's own.
INGRESS_HEADROOM = 64
# A replica's health reaches the ingress through the metrics board: each replica writes its
# /health status there when Ray Serve checks it (every health_check_period_s, 5 s), the ingress
# reads it every HEALTH_EVERY_S, and a replica not heard from for HEALTH_STALE_S (three
# checks missed: its event loop is stuck) counts as down.
HEALTH_EVERY_S = 1.0
HEALTH_STALE_S = 15.0
HEALTH_PROBE_TIMEOUT_S = 10.0


class BadRequest(ValueError):
    """A body the ingress refuses itself (400), before any replica parses it."""


# A JSON string; possessive (Python 3.11), so that a long or unterminated one costs one pass
# (`(?:[^"\\]|\\.)*` took 28 s on a 64 MiB string of brackets, this 0.2 s).
_JSON_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"')
_NOT_BRACKETS = bytes(byte for byte in range(256) if byte not in b"[]{}")
_DEPTH_CHUNK = 1 << 20


def json_too_deep(body: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether `body` nests arrays and objects more than `limit` levels deep, found without
    parsing it (nor recursing). Almost every body has fewer brackets than `limit` and is
    answered from two counts; the others are scanned once, in C and numpy, strings removed
    (brackets in them do not nest)."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    brackets = _JSON_STRING.sub(b"", body).translate(None, _NOT_BRACKETS)
    depth = 0
    for start in range(0, len(brackets), _DEPTH_CHUNK):
        chunk = np.frombuffer(brackets, np.uint8, min(_DEPTH_CHUNK, len(brackets) - start),
                              start)
        running = depth + np.cumsum(np.where((chunk == ord("[")) | (chunk == ord("{")), 1, -1),
                                    dtype=np.int64)
        if running.max() > limit:
            return True
        depth = int(running[-1])
    return False


def parse_body(body: bytes) -> Any:
    """The body's JSON, None where there is none (empty, not JSON, not UTF-8: the replica
    answers those as one server does, 400); BadRequest for one nested past MAX_JSON_DEPTH."""
    if not body:
        return None
    if json_too_deep(body):
        raise BadRequest(f"the body's JSON is nested more than {MAX_JSON_DEPTH} levels deep")
    try:
        return json.loads(body)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None


class ReplicaHealth:
    """Which model replicas are down: their last /health answer was not 200, or they have not
    reported one for HEALTH_STALE_S. The ingress writes it (`update`) and the request router
    reads it (`usable`): both run in the ingress's process (a deployment handle routes in its
    caller's process) but on different threads, so `down` is replaced whole, never changed in
    place. A replica never heard from (just started) counts as up."""

    def __init__(self, stale_s: float = HEALTH_STALE_S) -> None:
        self.stale_s = stale_s
        self.known: frozenset[str] = frozenset()
        self.down: frozenset[str] = frozenset()

    def update(self, reports: dict[str, tuple[float, int]], now: float) -> None:
        """`reports`: each replica's last (time, /health status)."""
        down = frozenset(replica for replica, (at, status) in reports.items()
                         if status != 200 or now - at > self.stale_s)
        if down - self.down:
            log.warning("replicas down (no routing to them until /health says 200): %s",
                        ", ".join(sorted(down - self.down)))
        if self.down - down:
            log.warning("replicas up again: %s", ", ".join(sorted(self.down - down)))
        self.known, self.down = frozenset(reports), down

    def usable(self, replicas: list, replica_id: Callable[[Any], str] = str) -> list:
        """`replicas` less the down ones; all of them if every one is down (a request then
        gets a replica's own answer rather than waiting for one to come back)."""
        down = self.down
        up = [replica for replica in replicas if replica_id(replica) not in down]
        return up or replicas

    def none_up(self) -> bool:
        """Every replica heard from is down."""
        known = self.known
        return bool(known) and known <= self.down


# The one table of the ingress's process (see ReplicaHealth).
REPLICA_HEALTH = ReplicaHealth()


def process_health() -> ReplicaHealth:
    """REPLICA_HEALTH of this module as this process imported it. Not the global itself: Ray
    Serve sends the request router's class to the ingress by value (cloudpickle), with copies
    of the module globals it refers to, so a router reading REPLICA_HEALTH would read a copy
    the ingress never updates. An import at call time finds the module the ingress runs."""
    from dresd.serve import ray_routing

    return ray_routing.REPLICA_HEALTH


def conversation_key(payload: Any) -> str | None:
    """The key that sends every turn of one conversation to one replica: a hash of the
    request's `cache_salt` and its messages up to and including the first user message (chat),
    or its prompt's first COMPLETION_PREFIX_CHARS characters / COMPLETION_PREFIX_TOKENS token
    ids (completions). None for a body that is neither. Never raises: a key is only where a
    request would rather go, and a body it cannot be derived from is for the replica to refuse."""
    if not isinstance(payload, dict):
        return None
    messages = payload.get("messages")
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch of prompts: the first one's replica takes them all
    if isinstance(messages, list) and messages:
        head = []
        for message in messages:
            head.append(message)
            if isinstance(message, dict) and message.get("role") == "user":
                break
        material: Any = head
    elif isinstance(prompt, str) and prompt:
        material = prompt[:COMPLETION_PREFIX_CHARS]
    elif isinstance(prompt, list) and prompt:  # token ids (or what the replica will refuse)
        material = prompt[:COMPLETION_PREFIX_TOKENS]
    else:
        return None  # no prompt, or one of another type (`[{}]`): the replica answers 400
    try:
        text = json.dumps([payload.get("cache_salt") or "", material], sort_keys=True,
                          default=str)
    except (TypeError, ValueError, RecursionError):  # not from JSON: keys of mixed types
        return None
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def rank_replicas(key: str, replica_ids: list[str]) -> list[str]:
    """The replicas in the order `key` prefers them (rendezvous hashing)."""
    def weight(replica_id: str) -> bytes:
        return hashlib.sha256(f"{key}\0{replica_id}".encode()).digest()[:8]

    return sorted(replica_ids, key=weight, reverse=True)


class PrefixAffinityRouter(RequestRouter):
    """Ray Serve request router: a request's conversation key (its `session_id`) ranks the
    replicas (`rank_replicas`); replicas with a full batch go after those with room; replicas
    whose /health is not 200 (`health`) are skipped, so a conversation pinned to one moves to
    the next in its ranking, and comes back when it answers 200 again."""

    spill_at: int | None = None
    health: ReplicaHealth | None = None  # None: this process's table (`process_health`)

    def initialize_state(self, spill_at: int | None = None, **kwargs) -> None:
        self.spill_at = spill_at

    def busy(self, replica: RunningReplica) -> bool:
        """Known (from Ray Serve's cache of queue lengths) to hold a full batch."""
        queue_len = self.replica_queue_len_cache.get(replica.replica_id)
        return self.spill_at is not None and queue_len is not None and queue_len >= self.spill_at

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        key = pending_request.metadata.session_id if pending_request is not None else ""
        if key:  # every rank tried and none accepted: wait (Ray Serve's backoff), try again
            pending_request.routing_context.should_backoff = True
        if key.startswith(ONE_REPLICA):  # a request for every replica, this one's copy
            named = [replica for replica in candidate_replicas
                     if replica.replica_id.unique_id == key.removeprefix(ONE_REPLICA)]
            return [named] if named else []
        candidate_replicas = (self.health or process_health()).usable(
            candidate_replicas, lambda replica: replica.replica_id.unique_id)
        if not key or not candidate_replicas:
            return [candidate_replicas]  # one rank: the least loaded of all
        by_id = {replica.replica_id.unique_id: replica for replica in candidate_replicas}
        ranked = [by_id[replica_id] for replica_id in rank_replicas(key, list(by_id))]
        busy = [self.busy(replica) for replica in ranked]
        ranked = ([r for r, b in zip(ranked, busy, strict=True) if not b]
                  + [r for r, b in zip(ranked, busy, strict=True) if b])
        return [[replica] for replica in ranked]


def forwarded_scope(scope: dict) -> dict:
    """What a replica's app needs of the ingress's ASGI scope (plain, picklable values)."""
    keep = ("type", "asgi", "http_version", "method", "scheme", "path", "raw_path", "root_path",
            "query_string", "headers", "client", "server")
    return {name: scope[name] for name in keep if name in scope}


async def run_asgi(app: Callable, scope: dict, body: bytes) -> AsyncIterator[dict]:
    """Run an ASGI app on one HTTP request whose body has been read; yields the messages it
    sends. Closing the generator early (the client left) makes the app's next receive() say
    http.disconnect, which the app answers by cancelling the generation."""
    messages: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    body_sent = False

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await messages.put(message)

    task = asyncio.ensure_future(app(scope, receive, send))
    task.add_done_callback(lambda _: messages.put_nowait(None))
    try:
        while (message := await messages.get()) is not None:
            yield message
        await task  # the app's own error, if it raised one
    finally:
        if not task.done():
            gone.set()
            asyncio.get_running_loop().call_later(ABANDONED_S, task.cancel)


HealthReports = Callable[[], Awaitable[dict[str, tuple[float, int]]]]


class AffinityIngress:
    """The HTTP ingress (an ASGI app): checks the API key, holds at most `max_in_flight`
    requests, reads a request, keys it, passes it to a model replica through `server` (a
    deployment handle) and streams the replica's response back.

    Each refusal comes before the work it saves: the key from the headers (a refused request
    reads no body), the bound before the body is read, the nesting depth before it is parsed."""

    def __init__(self, server: Any, body_cap: int,
                 replica_ids: Callable[[], Awaitable[list[str]]] | None = None, *,
                 api_key: str | None = None, metrics_open: bool = False,
                 max_in_flight: int | None = None, health_reports: HealthReports | None = None,
                 health: ReplicaHealth = REPLICA_HEALTH) -> None:
        self.server = server
        self.body_cap = body_cap
        # the live replicas' ids (async): where a broadcast route goes
        self.replica_ids = replica_ids
        self.max_in_flight = max_in_flight
        self.in_flight = 0
        # each replica's last (time, /health status), read every HEALTH_EVERY_S into `health`
        self.health_reports = health_reports
        self.health = health
        self.watcher: asyncio.Task | None = None
        # The replicas check the key too; checked here, a refused request costs no body read,
        # no parse and no replica call. The same middleware: the same 401 and compare.
        self.app: Callable = (APIKeyCheck(self.admit, api_key, metrics_open) if api_key
                              else self.admit)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    self.start_watching()
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    if self.watcher is not None:
                        self.watcher.cancel()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] == "http":
            await self.app(scope, receive, send)

    async def admit(self, scope: dict, receive: Callable, send: Callable) -> None:
        """The request, unless `max_in_flight` are already here (503 at once, body unread: a
        burst past what the replicas hold gets an answer to retry, not a place in a queue
        without end) or no replica is up (503)."""
        if self.max_in_flight is not None and self.in_flight >= self.max_in_flight:
            await send_error(send, 503, f"the server holds {self.max_in_flight} requests "
                                        "already; retry", [(b"retry-after", b"1")])
            return
        if self.health.none_up():
            await send_error(send, 503, "no replica is healthy; retry",
                             [(b"retry-after", b"5")])
            return
        self.in_flight += 1
        try:
            await self.route(scope, receive, send)
        finally:
            self.in_flight -= 1

    async def route(self, scope: dict, receive: Callable, send: Callable) -> None:
        body = await self.read_body(scope, receive)
        try:
            # A large body is parsed on a thread: the loop goes on streaming other replies.
            payload = (await asyncio.to_thread(parse_body, body)
                       if len(body) > PARSE_ON_THREAD_BYTES else parse_body(body))
        except BadRequest as refusal:
            await send_error(send, 400, str(refusal))
            return
        if (scope.get("method"), scope.get("path")) in BROADCAST_ROUTES and self.replica_ids:
            await self.broadcast(scope, body, send)
            return
        key = conversation_key(payload)
        handle = self.server.options(stream=True, **({"session_id": key} if key else {}))
        responses = handle.forward.remote(forwarded_scope(scope), body)
        started = finished = False
        try:
            async for message in responses:
                started = started or message["type"] == "http.response.start"
                await send(message)
            finished = True
        except Exception:  # noqa: BLE001 - the replica died or failed
            if started:
                raise  # the stream is cut: the client sees an error, never a shortened answer
            log.exception("no replica answered %s %s", scope.get("method"), scope.get("path"))
            await self.unavailable(send)
        finally:
            if not finished:
                responses.cancel()  # the client left: the replica stops generating

    def start_watching(self) -> None:
        """Read the replicas' health every HEALTH_EVERY_S, for as long as the ingress runs."""
        if self.health_reports is None or self.watcher is not None:
            return

        async def watch() -> None:
            while True:
                await self.refresh_health()
                await asyncio.sleep(HEALTH_EVERY_S)

        self.watcher = asyncio.ensure_future(watch())

    async def refresh_health(self) -> None:
        try:
            reports = await self.health_reports()
        except Exception:  # noqa: BLE001 - the board gone: every report goes stale, all down
            log.exception("the replicas' health could not be read")
            return
        self.health.update(reports, time.time())

    async def broadcast(self, scope: dict, body: bytes, send) -> None:
        """The request sent to every live replica; the first refusal is the answer (a wrong
        key: 401), else one JSON object: the bytes freed in all, each replica's line."""
        async def one(replica_id: str) -> tuple[int, list, bytes]:
            handle = self.server.options(stream=True, session_id=ONE_REPLICA + replica_id)
            status, headers, parts = 500, [], []
            async for message in handle.forward.remote(forwarded_scope(scope), body):
                if message["type"] == "http.response.start":
                    status, headers = message["status"], message.get("headers", [])
                else:
                    parts.append(message.get("body", b""))
            return status, headers, b"".join(parts)

        ids = sorted(await self.replica_ids())
        try:
            # One copy after another: the copies carry this request's id, and Ray Serve's router
            # matches a routed request by that id, so two in flight at once would wait forever.
            replies = [await asyncio.wait_for(one(replica_id), BROADCAST_TIMEOUT_S)
                       for replica_id in ids]
        except Exception:  # noqa: BLE001 - a replica gone meanwhile, or one that never answered
            log.exception("%s did not reach every replica", scope.get("path"))
            await self.unavailable(send)
            return
        failed = [reply for reply in replies if reply[0] != 200]
        if failed:
            status, headers, payload = failed[0]
        else:
            answers = {replica: json.loads(reply[2]) for replica, reply in zip(ids, replies,
                                                                                strict=True)}
            payload = json.dumps({"freed_bytes": sum(a.get("freed_bytes", 0)
                                                     for a in answers.values()),
                                  "replicas": answers}).encode()
            status, headers = 200, [(b"content-type", b"application/json")]
        headers = [(name, value) for name, value in headers if name != b"content-length"]
        await send({"type": "http.response.start", "status": status,
                    "headers": [*headers, (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})

    async def read_body(self, scope: dict, receive) -> bytes:
        """The whole body, or (past body_cap) what arrived so far: the replica's own limit
        refuses it (413) from the declared length or from the bytes it is sent."""
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > self.body_cap:
                return b""
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break  # the client left
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            if not message.get("more_body") or size > self.body_cap:
                break
        return b"".join(parts)

    @staticmethod
    async def unavailable(send) -> None:
        await send_error(send, 503, "no replica could take the request; retry")


async def send_error(send: Callable, status: int, message: str,
                     headers: list[tuple[bytes, bytes]] = ()) -> None:
    """Answer with OpenAI's error object."""
    body = json.dumps(protocol.error_body(message, status, None)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


class IngressDeployment:
    """Ray Serve deployment class of the ingress (wrapped by `serve.ingress()` in deploy).
    `board`: the metrics board, where the replicas say they are alive (their figures) and
    healthy (their /health status)."""

    def __init__(self, server: Any, body_cap: int, board: Any = None, stale_s: float = 10.0,
                 *, api_key: str | None = None, metrics_open: bool = False,
                 max_in_flight: int | None = None) -> None:
        async def replica_ids() -> list[str]:  # the replicas heard from in the last stale_s
            now = time.time()
            return [name for name, report in (await board.get.remote()).items()
                    if now - report[0] <= stale_s]

        async def health_reports() -> dict[str, tuple[float, int]]:
            return await board.get_health.remote()

        self.asgi = AffinityIngress(
            server, body_cap, replica_ids if board is not None else None, api_key=api_key,
            metrics_open=metrics_open, max_in_flight=max_in_flight,
            health_reports=health_reports if board is not None else None)

    def __serve_build_asgi_app__(self) -> AffinityIngress:
        return self.asgi


class Lifespan:
    """An ASGI app's lifespan (its engine's start and stop), driven by hand: a model replica
    behind the ingress is called through a handle, not by Ray Serve's HTTP server, which would
    otherwise run it."""

    def __init__(self, app: Callable) -> None:
        self.app = app
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.task: asyncio.Future | None = None

    async def startup(self) -> None:
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"},
                 "state": {}}
        self.task = asyncio.ensure_future(self.app(scope, self.inbox.get, self.outbox.put))
        await self.inbox.put({"type": "lifespan.startup"})
        reply = await self.outbox.get()
        if reply["type"] != "lifespan.startup.complete":
            raise RuntimeError(f"the app did not start: {reply.get('message', reply)}")

    async def shutdown(self) -> None:
        if self.task is not None and not self.task.done():
            await self.inbox.put({"type": "lifespan.shutdown"})
            await asyncio.wait_for(self.outbox.get(), 30)


HEALTH_SCOPE = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
                "http_version": "1.1", "method": "GET", "scheme": "http", "path": "/health",
                "raw_path": b"/health", "root_path": "", "query_string": b"", "headers": [],
                "client": ("127.0.0.1", 0), "server": None}


def replica_name() -> str:
    """This replica's id as Ray Serve names it (a fresh random one outside a replica)."""
    try:
        from ray import serve

        context = serve.get_replica_context()
        tag = getattr(context, "replica_tag", None) or context.replica_id.unique_id
        return str(tag)
    except Exception:  # noqa: BLE001 - any Ray version, or no replica context
        return uuid.uuid4().hex[:8]


class ModelReplica:
    """Ray Serve deployment class of a model replica behind the ingress: builds the server's
    app once and starts it, then runs each forwarded request through it. `board`: where its
    /health status goes at each of Ray Serve's health checks, for the ingress to route by."""

    async def __init__(self, build: Callable[[], Callable], board: Any = None) -> None:
        self.app = build()
        self.lifespan = Lifespan(self.app)
        await self.lifespan.startup()
        self.board = board
        self.name = replica_name()
        await self.report_health()  # known to the ingress from its start

    async def forward(self, scope: dict, body: bytes) -> AsyncIterator[dict]:
        # a fresh request state, as an ASGI server gives each request
        async for message in run_asgi(self.app, {**scope, "state": {}}, body):
            yield message

    async def health_status(self) -> int:
        """The app's answer to GET /health (the single-process server's 503 once its worker
        thread has died); 0 for none within HEALTH_PROBE_TIMEOUT_S or an error."""
        async def status() -> int:
            async for message in run_asgi(self.app, {**HEALTH_SCOPE, "state": {}}, b""):
                if message["type"] == "http.response.start":
                    return message["status"]
            return 0

        try:
            return await asyncio.wait_for(status(), HEALTH_PROBE_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - no answer is an answer: down
            log.exception("GET /health failed on this replica")
            return 0

    async def check_health(self) -> None:
        """Ray Serve's health check (every health_check_period_s): the status goes to the
        board, and a replica that is not 200 raises, so that Ray Serve replaces it after three
        failed checks (a dead worker thread does not come back); until then, and for a
        passing failure, the ingress routes around it."""
        status = await self.report_health()
        if status != 200:
            raise RuntimeError(f"GET /health answered {status or 'nothing'}")

    async def report_health(self) -> int:
        status = await self.health_status()
        if self.board is not None:
            self.board.put_health.remote(self.name, status)
        return status

    async def __del__(self) -> None:
        await self.lifespan.shutdown()


def affinity_router_config(spill_at: int) -> Any:
    """The model replicas' `request_router_config`."""
    from ray.serve.config import RequestRouterConfig

    return RequestRouterConfig(request_router_class=PrefixAffinityRouter,
                               request_router_kwargs={"spill_at": spill_at})
