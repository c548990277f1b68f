"""The server's API keys: one (`dresd serve --api-key KEY`, or `DRESD_API_KEY`), as vLLM's and
llama.cpp's servers have one, or one per tenant (`--api-key-file`, `read_key_file`): a
tenant's prefix cache entries, learned drafting tables and figures are its own (app.py).

Every request must carry `Authorization: Bearer KEY` (or `x-api-key: KEY`, as Anthropic's
clients send it), except `GET /health` (load balancers and Ray Serve probe it without
credentials) and, with `--metrics-open`, `GET /metrics` (for a Prometheus scraper that holds
no key). Anything else gets 401 with OpenAI's error object,
`{"error": {"message", "type": "invalid_request_error", "param": null, "code":
"invalid_api_key"}}`, which the `openai` client raises as `AuthenticationError`.

The key is compared in constant time (`hmac.compare_digest` of the two SHA-256 digests, so the
comparison takes as long for a key of another length) and never written anywhere: the refusal
says only whether a key was given, the request log never sees headers, and the start-up line
says "API key: required", not the key.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import re
from collections.abc import Mapping
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from dresd.errors import UserError

# Paths answered without the key: liveness probes carry no credentials.
OPEN_PATHS = frozenset({"/health"})
METRICS_PATH = "/metrics"
API_KEY_ENV = "DRESD_API_KEY"
TENANT_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


def _digest(key: str | bytes) -> bytes:
    raw = key.encode("utf-8") if isinstance(key, str) else key
    return hashlib.sha256(raw).digest()


def unauthorized_body(key_given: bool) -> dict:
    """OpenAI's 401 error object. The message never repeats the key that was sent."""
    message = ("Incorrect API key provided." if key_given else
               "You didn't provide an API key. You need to provide your API key in an "
               "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).")
    return {"error": {"message": message, "type": "invalid_request_error", "param": None,
                      "code": "invalid_api_key"}}


def read_key_file(path: Path) -> dict[str, str]:
    """Tenants and their keys from `--api-key-file`: one `TENANT KEY` per line (blank lines and
    lines starting with # skipped). A UserError names the line at fault, never the key."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"cannot read the API key file {path}: {err}") from None
    keys: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        fields = line.split()
        if len(fields) != 2 or not TENANT_NAME.fullmatch(fields[0]):
            raise UserError(f"{path}:{number}: each line is `TENANT KEY` (a tenant's name of "
                            "letters, digits, '.', '_' or '-', then its key)")
        tenant, key = fields
        if tenant in keys:
            raise UserError(f"{path}:{number}: tenant {tenant!r} is named twice")
        if key in keys.values():
            raise UserError(f"{path}:{number}: this key is given to two tenants")
        keys[tenant] = key
    if not keys:
        raise UserError(f"the API key file {path} names no tenant")
    return keys


class APIKeyCheck:
    """ASGI middleware: refuses (401) every HTTP request without `Authorization: Bearer KEY`,
    but for the open paths, and notes the key's tenant in `scope["state"]["tenant"]` ("" for
    the one key of `--api-key`). It sits inside the request log (a refusal gets its log line)
    and outside everything else, so a refused request reaches no route and no body parser."""

    def __init__(self, app: ASGIApp, api_key: str | Mapping[str, str],
                 metrics_open: bool = False) -> None:
        """`api_key`: the one key, or each tenant's (`read_key_file`)."""
        keys = {"": api_key} if isinstance(api_key, str) else dict(api_key)
        if not keys or not all(keys.values()):
            raise ValueError("an API key is empty")
        self.app = app
        # the keys themselves are not kept: their digests, and each one's tenant
        self.tenants = [(_digest(key), tenant) for tenant, key in keys.items()]
        self.open_paths = OPEN_PATHS | ({METRICS_PATH} if metrics_open else set())

    def tenant(self, scope: Scope) -> tuple[str | None, bool]:
        """(the key's tenant, or None where it is not authorized; a key was given). Every key
        is compared, in constant time, so the time taken says nothing of which matched."""
        token = None
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, bearer = value.partition(b" ")
                token = bearer.strip() if scheme.lower() == b"bearer" else b""
                break
            if name == b"x-api-key":  # Anthropic's clients send the key so
                token = value.strip()
        if token is None:
            return None, False
        given, found = _digest(token), None
        for expected, tenant in self.tenants:
            if token and hmac.compare_digest(given, expected):
                found = tenant
        return found, True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        tenant, key_given = self.tenant(scope)
        if tenant is not None:
            scope.setdefault("state", {})["tenant"] = tenant
            await self.app(scope, receive, send)
            return
        log_entry = scope.get("state", {}).get("log")
        if log_entry is not None:  # the request log's line says why, without the key
            log_entry["error"] = "wrong API key" if key_given else "no API key"
        body = json.dumps(unauthorized_body(key_given)).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the server on this machine (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """The start-up warning for a server that anyone who reaches the port may use."""
    if api_key or is_loopback(host):
        return None
    return (f"dresd serve binds {host} without an API key: anyone who can reach this port can "
            f"generate with the model. Give --api-key KEY (or set {API_KEY_ENV}).")
