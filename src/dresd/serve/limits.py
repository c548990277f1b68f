"""A request body larger than any prompt the model can take is refused (413) before it is read.

Why: FastAPI reads and parses a JSON body on the event loop, so one 20 MB body held every other
request (and /health) for seconds. The limit follows the context length: a prompt of n tokens
is rarely more than a few bytes a token as text, and JSON escaping at most doubles it, so
BYTES_PER_TOKEN bytes a token of context is generous for any body that can be served.
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dresd.serve import protocol

BYTES_PER_TOKEN = 64  # body bytes allowed per token of the model's context
MIN_BODY_BYTES = 1 << 16  # a small context still takes a 64 KiB body
UNKNOWN_CONTEXT_TOKENS = 32_768  # where the model does not say its context length


def default_body_limit(context_tokens: int | None) -> int:
    """BYTES_PER_TOKEN bytes per token of context, at least MIN_BODY_BYTES."""
    return max(MIN_BODY_BYTES, BYTES_PER_TOKEN * (context_tokens or UNKNOWN_CONTEXT_TOKENS))


class BodyLimit:
    """ASGI middleware: a body past `limit` bytes gets 413 with OpenAI's error object. A
    declared Content-Length past it is refused before a byte is read; a chunked body is counted
    as it arrives and refused when it crosses the limit."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > self.limit:
                await self.refuse(scope, send)
                return
        received = 0
        started = refused = False

        async def counted_receive() -> Message:
            # Past the limit: answer 413 here, then tell the app the client left, so that
            # whatever it makes of that (FastAPI: a 400 for an unreadable body) is not sent.
            nonlocal received, refused
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit and not started:
                    refused = True
                    await self.refuse(scope, send)
                    return {"type": "http.disconnect"}
            return message

        async def watched_send(message: Message) -> None:
            nonlocal started
            if refused:
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, counted_receive, watched_send)

    async def refuse(self, scope: Scope, send: Send) -> None:
        message = (f"the request body is larger than this server's limit of {self.limit} "
                   "bytes (--max-body-bytes)")
        log_entry = scope.get("state", {}).get("log")
        if log_entry is not None:
            log_entry["error"] = message
        body = json.dumps(protocol.error_body(message, 413, None)).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
