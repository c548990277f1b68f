"""A chat choice's text as OpenAI's message: reasoning split off, tool calls parsed.

    text pieces -> ReasoningParser (reasoning.py; models whose tokenizer has <think>)
                -> ToolCallStream (tool_calls.py; requests with tools)
                -> deltas: {"reasoning_content"}, {"content"}, {"tool_calls"}

A whole response runs the same parsers over its whole text, so a stream's deltas joined are
always exactly the whole response's message.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dresd.serve.reasoning import THINK_START, ReasoningParser, join_reasoning_deltas
from dresd.serve.tool_calls import ToolCallFormat, ToolCallStream, join_deltas


def thinks(tokenizer) -> bool:
    """Whether the model writes a think block: its tokenizer has `<think>` as a token of its
    own (Qwen3, DeepSeek-R1 and their kin); only then is reasoning split off."""
    try:
        return THINK_START in tokenizer.get_added_vocab()
    except AttributeError:
        return False


class ChatParsers:
    """One choice's parsers; `feed` a piece of text, `finish` at the end, each giving deltas."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolCallFormat | None) -> None:
        self.reasoning = reasoning
        self.tools: ToolCallStream | None = tools.stream() if tools is not None else None

    def marker_ids(self, tokenizer: Any) -> set[int]:
        """The special tokens the text must keep for the tool call parser (see
        `ToolCallFormat.marker_ids`)."""
        return self.tools.fmt.marker_ids(tokenizer) if self.tools is not None else set()

    @property
    def called(self) -> bool:
        """Whether a tool call was parsed: finish_reason "tool_calls"."""
        return self.tools is not None and self.tools.called

    def feed(self, text: str) -> list[dict]:
        return self._content(self.reasoning.feed(text) if self.reasoning else
                             [{"content": text}], final=False)

    def finish(self) -> list[dict]:
        return self._content(self.reasoning.finish() if self.reasoning else [], final=True)

    def _content(self, deltas: list[dict], final: bool) -> list[dict]:
        """The reasoning's deltas as they are; its content through the tool call parser."""
        if self.tools is None:
            return [delta for delta in deltas if any(delta.values())]
        out: list[dict] = []
        for delta in deltas:
            if "content" in delta:
                out.extend(self.tools.feed(delta["content"]))
            elif delta.get("reasoning_content"):
                out.append(delta)
        if final:
            out.extend(self.tools.finish())
        return out


def message(deltas: Sequence[dict]) -> dict:
    """The assistant's message that `deltas` make, as a whole response gives it."""
    reasoning, _ = join_reasoning_deltas(deltas)
    content, calls = join_deltas([d for d in deltas if "reasoning_content" not in d])
    body: dict = {"role": "assistant", "content": content}
    if calls:
        body["tool_calls"] = calls
    if reasoning is not None:
        body["reasoning_content"] = reasoning
    return body
