"""Anthropic's Messages API (`POST /v1/messages`) over the chat endpoint, for the clients that
speak it (the `anthropic` SDK, agents built on it).

A translation both ways, no generation of its own: the request becomes an OpenAI chat request
(`to_openai`: the system prompt, text, `tool_use` and `tool_result` blocks, tools with their
`input_schema`, `tool_choice`, `stop_sequences`), which the chat endpoint serves exactly as it
serves any (every method, speculation, the prefix cache, tenants, grammars); its reply comes
back as a Message (`from_openai`), and its stream as Anthropic's events (`MessageStream`:
`message_start`, `content_block_start` / `_delta` / `_stop` for each text or `tool_use` block,
`message_delta` with the stop reason, `message_stop`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

from dresd.serve.engine import RequestError

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               404: "not_found_error", 413: "request_too_large", 503: "overloaded_error"}
DRESD_FIELDS = ("method", "datastore", "cache_salt", "num_drafts", "draft_len",
                "max_tree_nodes", "seed", "response_format", "prediction")


def _text(content: object, where: str) -> str:
    """A text content: a string, or text blocks."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(b, dict) and b.get("type") == "text"
                                         for b in content):
        return "".join(str(block.get("text", "")) for block in content)
    raise RequestError(f"{where} must be a string or a list of text blocks", param=where)


def _messages(body: dict) -> list[dict]:
    """Anthropic's system prompt and messages as OpenAI's messages."""
    messages = []
    if body.get("system") is not None:
        messages.append({"role": "system", "content": _text(body["system"], "system")})
    turns = body.get("messages")
    if not isinstance(turns, list) or not turns:
        raise RequestError("messages must be a non-empty list", param="messages")
    for turn in turns:
        if not isinstance(turn, dict) or turn.get("role") not in ("user", "assistant"):
            raise RequestError("each message has a role, user or assistant", param="messages")
        content = turn.get("content")
        if isinstance(content, str):
            messages.append({"role": turn["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise RequestError("a message's content is a string or a list of blocks",
                               param="messages")
        text, calls = [], []
        for block in content:
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                text.append(str(block.get("text", "")))
            elif kind == "tool_use":
                calls.append({"id": block.get("id"), "type": "function", "function": {
                    "name": block.get("name"), "arguments": json.dumps(block.get("input", {}))}})
            elif kind == "tool_result":
                result = block.get("content", "")
                messages.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                                 "content": _text(result, "messages") if result else ""})
            else:
                raise RequestError(f"content blocks of type {kind!r} are not supported "
                                   "(text, tool_use, tool_result are)", param="messages")
        if text or calls:
            message: dict = {"role": turn["role"], "content": "".join(text) or None}
            if calls:
                message["tool_calls"] = calls
            messages.append(message)
    return messages


def _tool_choice(choice: object) -> object:
    if choice is None:
        return None
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise RequestError('tool_choice is {"type": "auto" | "any" | "none"} or {"type": "tool", '
                       '"name": ...}', param="tool_choice")


def to_openai(body: object) -> dict:
    """An Anthropic Messages request as the OpenAI chat request the chat endpoint serves."""
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    if not isinstance(body.get("max_tokens"), int) or isinstance(body.get("max_tokens"), bool):
        raise RequestError("max_tokens is required (a whole number)", param="max_tokens")
    request: dict = {"messages": _messages(body), "max_tokens": body["max_tokens"],
                     "stream": bool(body.get("stream", False))}
    for name in ("model", "temperature", "top_p", "top_k", *DRESD_FIELDS):
        if body.get(name) is not None:
            request[name] = body[name]
    if body.get("stop_sequences"):
        request["stop"] = body["stop_sequences"]
    if body.get("tools"):
        tools = body["tools"]
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise RequestError("tools must be a list of tools", param="tools")
        request["tools"] = [{"type": "function", "function": {
            "name": tool.get("name"), "description": tool.get("description", ""),
            "parameters": tool.get("input_schema") or {"type": "object"}}} for tool in tools]
        choice = _tool_choice(body.get("tool_choice"))
        if choice is not None:
            request["tool_choice"] = choice
        if isinstance(body.get("tool_choice"), dict) and body["tool_choice"].get(
                "disable_parallel_tool_use"):
            request["parallel_tool_calls"] = False
    if request["stream"]:
        request["stream_options"] = {"include_usage": True}
    return request


def _usage(usage: dict) -> dict:
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": usage.get("prompt_tokens", 0) - cached,
            "cache_read_input_tokens": cached,
            "output_tokens": usage.get("completion_tokens", 0)}


def _tool_use(call: dict) -> dict:
    try:
        arguments = json.loads(call["function"]["arguments"] or "{}")
    except ValueError:
        arguments = {}
    return {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"),
            "name": call["function"]["name"], "input": arguments}


def from_openai(reply: dict) -> dict:
    """The chat endpoint's whole reply as a Message."""
    choice = reply["choices"][0]
    message = choice["message"]
    content = []
    if message.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": message["reasoning_content"],
                        "signature": ""})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    content.extend(_tool_use(call) for call in message.get("tool_calls") or [])
    reason = STOP_REASONS.get(choice["finish_reason"], "end_turn")
    return {"id": "msg_" + reply["id"].split("-", 1)[-1], "type": "message",
            "role": "assistant", "model": reply["model"], "content": content,
            "stop_reason": reason, "stop_sequence": None, "usage": _usage(reply["usage"]),
            "dresd": reply.get("dresd")}


def error_body(message: str, status: int) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"),
                                       "message": message}}


def _event(kind: str, body: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **body}, ensure_ascii=False)}\n\n"


class MessageStream:
    """The chat endpoint's streamed chunks (parsed `data:` lines) as Anthropic's events."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.started = False
        self.block: str | None = None  # the kind of the content block open, if any
        self.index = -1  # its index
        self.reason = "end_turn"

    def _open(self, kind: str, block: dict) -> Iterator[str]:
        yield from self._close()
        self.block, self.index = kind, self.index + 1
        yield _event("content_block_start", {"index": self.index, "content_block": block})

    def _close(self) -> Iterator[str]:
        if self.block is not None:
            yield _event("content_block_stop", {"index": self.index})
            self.block = None

    def chunk(self, chunk: dict) -> Iterator[str]:
        """The events of one chunk."""
        if "error" in chunk:  # a failure after the stream began
            error = chunk["error"]
            yield _event("error", {"error": error_body(error["message"],
                                                       int(error.get("code") or 500))["error"]})
            return
        if not self.started:
            self.started = True
            yield _event("message_start", {"message": {
                "id": "msg_" + chunk["id"].split("-", 1)[-1], "type": "message",
                "role": "assistant", "model": self.model, "content": [],
                "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": 0, "output_tokens": 0}}})
        if chunk.get("usage") is not None and not chunk.get("choices"):  # the last chunk
            yield from self._close()
            yield _event("message_delta", {"delta": {"stop_reason": self.reason,
                                                     "stop_sequence": None},
                                           "usage": _usage(chunk["usage"])})
            yield _event("message_stop", {})
            return
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                if self.block != "thinking":
                    yield from self._open("thinking", {"type": "thinking", "thinking": ""})
                yield _event("content_block_delta", {"index": self.index, "delta": {
                    "type": "thinking_delta", "thinking": delta["reasoning_content"]}})
            if delta.get("content"):
                if self.block != "text":
                    yield from self._open("text", {"type": "text", "text": ""})
                yield _event("content_block_delta", {"index": self.index, "delta": {
                    "type": "text_delta", "text": delta["content"]}})
            for part in delta.get("tool_calls") or []:
                if part.get("id"):  # a new call: its block, then its arguments
                    yield from self._open("tool_use", {**_tool_use({
                        "id": part["id"], "function": {"name": part["function"]["name"],
                                                       "arguments": "{}"}}), "input": {}})
                arguments = (part.get("function") or {}).get("arguments")
                if arguments:
                    yield _event("content_block_delta", {"index": self.index, "delta": {
                        "type": "input_json_delta", "partial_json": arguments}})
            if choice.get("finish_reason"):
                self.reason = STOP_REASONS.get(choice["finish_reason"], "end_turn")
