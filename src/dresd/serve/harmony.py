"""gpt-oss's harmony format: an output's messages as reasoning, content and tool calls.

gpt-oss writes its answer as one or more messages, each a header and a body:

    <|channel|>analysis<|message|>The user wants the weather: call the tool.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json
    <|message|>{"city": "Paris"}<|call|>

Its chat template ends the prompt with `<|start|>assistant`, so the output opens with the first
message's header. A header runs to `<|message|>`: `<|channel|>NAME` names its channel,
`to=RECIPIENT` (before or after the channel) says whom the body is for, and `<|constrain|>json`
or a bare `json` its type. A body runs to `<|end|>` (another message follows, after
`<|start|>assistant`), `<|call|>` (a tool call: the output ends) or `<|return|>` (the answer is
over: the output ends), or to the end of the output.

As OpenAI's chat completions give it (what llama.cpp's and vLLM's servers do for gpt-oss):
- the `analysis` channel -> `reasoning_content`;
- a message to `functions.NAME`, in a request with tools -> a tool call NAME, its arguments the
  body (a body that is no JSON value, cut short by max_tokens, is content as written);
- `final`, and `commentary` to no one (a preamble meant for the user) -> `content`;
- anything else (a built-in tool's call such as `browser.search`, or a request without tools)
  -> content, the body as written.
A header cut off by the end of the output says nothing; an output with no header at all (not
harmony) is content as written.

`HarmonyParser` takes the text in pieces (its markers kept: they are special tokens, which the
server's text leaves out but for those `marker_ids` names) and gives the deltas that
`chat_output.ChatParsers` gives, so that a stream's deltas joined are the whole response's
message. A body streams as it comes, less a trailing piece that could begin a marker; a call
comes out whole at its end, as `tool_calls.ToolCallStream` gives calls.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from dresd.serve.reasoning import merge_text_deltas, partial_tag
from dresd.serve.tool_calls import is_json_value, new_call_id

CHANNEL, MESSAGE, START = "<|channel|>", "<|message|>", "<|start|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")  # a body's ends: another message, a call, the answer
MARKERS = (CHANNEL, MESSAGE, START, "<|constrain|>", *ENDS)
FUNCTIONS = "functions."  # the recipient prefix of the request's own tools

_CHANNEL_NAME = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_RECIPIENT = re.compile(r"(?:^|\s)to=([^\s<]+)")


def is_harmony(tokenizer: Any) -> bool:
    """Whether the model writes harmony messages: `<|channel|>` and `<|message|>` are tokens of
    its own (gpt-oss's tokenizer)."""
    try:
        vocab = tokenizer.get_added_vocab()
    except AttributeError:
        return False
    return CHANNEL in vocab and MESSAGE in vocab


class HarmonyParser:
    """Output text in pieces -> deltas: `{"reasoning_content": ...}`, `{"content": ...}` and
    `{"tool_calls": [...]}` (see the module's docstring for which message gives which).

    `tools`: the request's tools; without them no message is a call."""

    def __init__(self, tools: list[dict] | None = None,
                 call_id: Callable[[], str] = new_call_id) -> None:
        self.tool_names = {tool.get("function", {}).get("name") for tool in tools or []}
        self.call_id = call_id
        self.calls = 0
        self._buffer = ""  # text not yet decided
        self._kind: str | None = None  # the open body's: "reasoning", "content" or "call"
        self._name = ""  # the open call's function
        self._header = ""  # the open message's header where its body may come back as written
        self._headers = 0  # headers closed so far

    @property
    def called(self) -> bool:
        """Whether a tool call was parsed: finish_reason "tool_calls"."""
        return self.calls > 0

    def marker_ids(self, tokenizer: Any) -> set[int]:
        """The ids of harmony's markers: the server's text keeps them (they are special)."""
        return {token_id for token, token_id in tokenizer.get_added_vocab().items()
                if token in MARKERS}

    def feed(self, text: str) -> list[dict]:
        self._buffer += text
        out: list[dict] = []
        self._advance(out, final=False)
        return merge_text_deltas(out)

    def finish(self) -> list[dict]:
        """The end of the output: an open body ends here; an open header is dropped (or, where
        no header came at all, the text is content as written)."""
        out: list[dict] = []
        self._advance(out, final=True)
        return merge_text_deltas(out)

    def _advance(self, out: list[dict], final: bool) -> None:
        while True:
            if self._kind is None:  # in a header
                index = self._buffer.find(MESSAGE)
                if index < 0:
                    if final and not self._headers and not any(m in self._buffer
                                                                for m in MARKERS):
                        out.append({"content": self._buffer})  # no harmony at all
                    if final:
                        self._buffer = ""
                    return
                self._open(self._buffer[:index])
                self._buffer = self._buffer[index + len(MESSAGE):]
                continue
            hits = [(i, end) for end in ENDS if (i := self._buffer.find(end)) >= 0]
            if hits:
                index, end = min(hits)
                self._body(self._buffer[:index], out, closed=True)
                self._buffer = self._buffer[index + len(end):]
                continue
            if final:
                self._body(self._buffer, out, closed=True)
                self._buffer = ""
                return
            if self._kind != "call":  # stream it, less what could begin a marker
                held = max(partial_tag(self._buffer, marker) for marker in ENDS)
                self._body(self._buffer[:len(self._buffer) - held], out, closed=False)
                self._buffer = self._buffer[len(self._buffer) - held:]
            return

    def _open(self, header: str) -> None:
        """A header is closed: what its body will be."""
        self._headers += 1
        channel = _CHANNEL_NAME.search(header)
        recipient = _RECIPIENT.search(header)
        channel_name = channel.group(1) if channel else ""
        to = recipient.group(1) if recipient else ""
        if to.startswith(FUNCTIONS) and to[len(FUNCTIONS):] in self.tool_names:
            self._kind, self._name, self._header = "call", to[len(FUNCTIONS):], header
        elif channel_name == "analysis" and not to:
            self._kind = "reasoning"
        else:
            self._kind = "content"
            if to:  # a built-in tool's call, or one to no tool of the request: as written
                self._header = header

    def _body(self, text: str, out: list[dict], closed: bool) -> None:
        """Body text out; `closed`: the body ends here (the message is over)."""
        kind = self._kind
        if kind == "call":
            if not closed:
                return
            arguments = text.strip()
            if is_json_value(arguments):
                index, self.calls = self.calls, self.calls + 1
                out.append({"tool_calls": [{"index": index, "id": self.call_id(),
                                            "type": "function",
                                            "function": {"name": self._name, "arguments": ""}}]})
                out.append({"tool_calls": [{"index": index,
                                            "function": {"arguments": arguments}}]})
            else:
                out.append({"content": self._header + MESSAGE + text})
        else:
            if self._header:  # a message to some other recipient: its header as written too
                text, self._header = self._header + MESSAGE + text, ""
            if text:
                out.append({"reasoning_content" if kind == "reasoning" else "content": text})
        if closed:
            self._kind, self._name, self._header = None, "", ""

