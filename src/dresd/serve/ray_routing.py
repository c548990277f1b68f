"""Which replica answers a request under `dresd serve --ray --replicas N`: the one that holds
its conversation's prefix cache.

Each replica has its own prefix cache, so a chat's second turn hits only if it reaches the
replica that answered the first. Ray Serve's proxy cannot route on what it has not read (the
body reaches a replica after it is chosen), so the deployment has a small ingress in front of
the replicas (no model, no CPU reserved):

- `AffinityIngress` (the app's HTTP ingress) reads the body, derives the request's
  *conversation key* (`conversation_key`: the `cache_salt` and the messages up to and including
  the first user message, or the first characters of a completion's prompt), and passes the
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
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from dresd.serve import protocol

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


def conversation_key(payload: Any) -> str | None:
    """The key that sends every turn of one conversation to one replica: a hash of the
    request's `cache_salt` and its messages up to and including the first user message (chat),
    or its prompt's first COMPLETION_PREFIX_CHARS characters / COMPLETION_PREFIX_TOKENS token
    ids (completions). None for a body that is neither."""
    if not isinstance(payload, dict):
        return None
    messages = payload.get("messages")
    if isinstance(messages, list) and messages:
        head = []
        for message in messages:
            head.append(message)
            if isinstance(message, dict) and message.get("role") == "user":
                break
        material: Any = head
    elif isinstance(payload.get("prompt"), (str, list)) and payload["prompt"]:
        prompt = payload["prompt"]
        if isinstance(prompt, list) and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch of prompts: the first one's replica takes them all
        material = (prompt[:COMPLETION_PREFIX_CHARS] if isinstance(prompt, str)
                    else prompt[:COMPLETION_PREFIX_TOKENS])
    else:
        return None
    text = json.dumps([payload.get("cache_salt") or "", material], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def rank_replicas(key: str, replica_ids: list[str]) -> list[str]:
    """The replicas in the order `key` prefers them (rendezvous hashing)."""
    def weight(replica_id: str) -> bytes:
        return hashlib.sha256(f"{key}\0{replica_id}".encode()).digest()[:8]

    return sorted(replica_ids, key=weight, reverse=True)


class PrefixAffinityRouter(RequestRouter):
    """Ray Serve request router: a request's conversation key (its `session_id`) ranks the
    replicas (`rank_replicas`); replicas with a full batch go after those with room."""

    spill_at: int | None = None

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
        if not key or not candidate_replicas:
            return [candidate_replicas]  # one rank: the least loaded of all
        # Every rank tried and none accepted: wait (Ray Serve's backoff) before trying again.
        pending_request.routing_context.should_backoff = True
        by_id = {replica.replica_id.unique_id: replica for replica in candidate_replicas}
        if key.startswith(ONE_REPLICA):  # a request for every replica, this one's copy
            named = by_id.get(key.removeprefix(ONE_REPLICA))
            return [[named]] if named is not None else []
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


class AffinityIngress:
    """The HTTP ingress (an ASGI app): reads a request, keys it, passes it to a model replica
    through `server` (a deployment handle) and streams the replica's response back."""

    def __init__(self, server: Any, body_cap: int,
                 replica_ids: Callable[[], Awaitable[list[str]]] | None = None) -> None:
        self.server = server
        self.body_cap = body_cap
        # the live replicas' ids (async): where a broadcast route goes
        self.replica_ids = replica_ids

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        body = await self.read_body(scope, receive)
        if (scope.get("method"), scope.get("path")) in BROADCAST_ROUTES and self.replica_ids:
            await self.broadcast(scope, body, send)
            return
        try:
            key = conversation_key(json.loads(body)) if body else None
        except ValueError:
            key = None  # not JSON: the replica answers it (a 400 or 422), from any replica
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
        body = json.dumps(protocol.error_body("no replica could take the request; retry",
                                              503, None)).encode()
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class IngressDeployment:
    """Ray Serve deployment class of the ingress (wrapped by `serve.ingress()` in deploy)."""

    def __init__(self, server: Any, body_cap: int, board: Any = None,
                 stale_s: float = 10.0) -> None:
        async def replica_ids() -> list[str]:  # the replicas heard from in the last stale_s
            now = time.time()
            return [name for name, report in (await board.get.remote()).items()
                    if now - report[0] <= stale_s]

        self.asgi = AffinityIngress(server, body_cap, replica_ids if board is not None else None)

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


class ModelReplica:
    """Ray Serve deployment class of a model replica behind the ingress: builds the server's
    app once and starts it, then runs each forwarded request through it."""

    async def __init__(self, build: Callable[[], Callable]) -> None:
        self.app = build()
        self.lifespan = Lifespan(self.app)
        await self.lifespan.startup()

    async def forward(self, scope: dict, body: bytes) -> AsyncIterator[dict]:
        # a fresh request state, as an ASGI server gives each request
        async for message in run_asgi(self.app, {**scope, "state": {}}, body):
            yield message

    async def __del__(self) -> None:
        await self.lifespan.shutdown()


def affinity_router_config(spill_at: int) -> Any:
    """The model replicas' `request_router_config`."""
    from ray.serve.config import RequestRouterConfig

    return RequestRouterConfig(request_router_class=PrefixAffinityRouter,
                               request_router_kwargs={"spill_at": spill_at})
