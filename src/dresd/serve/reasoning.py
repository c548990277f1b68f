"""Reasoning: a `<think>...</think>` block split off an output as `reasoning_content`.

Reasoning models (Qwen3, DeepSeek-R1 and their distillations, QwQ, ...) think in a block
before they answer. Some chat templates open the block in the prompt, so the output starts
inside it and only closes it (DeepSeek-R1's, Qwen3-2507 thinking models'); others leave the
model to open it (Qwen3's with `enable_thinking`), or close an empty one in the prompt to turn
thinking off (Qwen3's with `enable_thinking: false`, where the output is all content).
`prompt_opens_think` tells the two apart from the rendered prompt.

`ReasoningParser` takes the output in pieces and gives OpenAI-style deltas
(`{"reasoning_content": ...}` and `{"content": ...}`), holding back what could be part of a
tag (a trailing "</thi"); `split_reasoning` is the same parser over a whole text, so a stream's
deltas joined are exactly the whole split. The rules:

- a block opens only at the start of the output (after whitespace), or in the prompt
  (`starts_inside`); a `<think>` later in the text is content;
- the reasoning is the text up to `</think>`, or to the end of the output if it never closes
  (a response cut by max_tokens while thinking), less the whitespace at its edges;
- the content is what follows `</think>`, less the whitespace right after the tag; an output
  with no block is all content, as written.

`ended` says when the reasoning is over (a grammar for the answer applies from there).
"""

from __future__ import annotations

from collections.abc import Iterable

THINK_START = "<think>"
THINK_END = "</think>"


def prompt_opens_think(prompt: str, start: str = THINK_START, end: str = THINK_END) -> bool:
    """Whether a rendered prompt leaves a think block open for the output (its last `<think>`
    is not closed), so that the output starts inside the reasoning."""
    opened = prompt.rfind(start)
    return opened >= 0 and prompt.find(end, opened) < 0


def partial_tag(text: str, tag: str) -> int:
    """How many characters at text's end could begin tag."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class ReasoningParser:
    """Output text in pieces -> deltas: `{"reasoning_content": ...}` inside the think block,
    `{"content": ...}` after it (or throughout, where no block opens)."""

    def __init__(self, starts_inside: bool = False, start: str = THINK_START,
                 end: str = THINK_END) -> None:
        self.starts_inside = starts_inside
        self.start, self.end = start, end
        self._state = "start"  # "start": a block may still open; "reasoning"; "content"
        self._buffer = ""  # text not yet decided
        self._whitespace = ""  # the reasoning's trailing whitespace, held
        self._strip_next = False  # drop the whitespace at the start of what comes next

    @property
    def ended(self) -> bool:
        """Whether the output is past its reasoning (or has none): the content has begun."""
        return self._state == "content"

    def feed(self, text: str) -> list[dict]:
        self._buffer += text
        out: list[dict] = []
        self._advance(out, final=False)
        return merge_text_deltas(out)

    def finish(self) -> list[dict]:
        """The end of the output: what was held back is decided (an unclosed block's text is
        reasoning; its trailing whitespace is dropped)."""
        out: list[dict] = []
        self._advance(out, final=True)
        return merge_text_deltas(out)

    def _advance(self, out: list[dict], final: bool) -> None:
        while True:
            if self._state == "start":
                text = self._buffer.lstrip()
                if text.startswith(self.start):
                    self._buffer = text[len(self.start):]
                    self._state, self._strip_next = "reasoning", True
                    continue
                if not final and self.start.startswith(text):
                    return  # whitespace, or a tag begun: the next piece tells
                if self.starts_inside:
                    self._state, self._strip_next = "reasoning", True
                else:
                    self._state = "content"
                continue
            if self._state == "reasoning":
                index = self._buffer.find(self.end)
                if index >= 0:
                    self._reasoning(self._buffer[:index], out)
                    self._buffer = self._buffer[index + len(self.end):]
                    self._whitespace = ""  # the reasoning's trailing whitespace
                    self._state, self._strip_next = "content", True
                    continue
                held = 0 if final else partial_tag(self._buffer, self.end)
                self._reasoning(self._buffer[:len(self._buffer) - held], out)
                self._buffer = self._buffer[len(self._buffer) - held:]
                return
            text, self._buffer = self._buffer, ""
            if self._strip_next:
                text = text.lstrip()
                self._strip_next = not text
            if text:
                out.append({"content": text})
            return

    def _reasoning(self, text: str, out: list[dict]) -> None:
        if self._strip_next:
            text = text.lstrip()
            self._strip_next = not text
        text = self._whitespace + text
        kept = text.rstrip()
        self._whitespace = text[len(kept):]
        if kept:
            out.append({"reasoning_content": kept})


def merge_text_deltas(deltas: list[dict]) -> list[dict]:
    """Adjacent deltas of the same text field (`content`, `reasoning_content`) as one, as a
    piece may release held text and new text; tool call deltas as they are. The chat parsers'
    (this one, `tool_calls.ToolCallStream`, `harmony.HarmonyParser`) deltas have one field each."""
    merged: list[dict] = []
    for delta in deltas:
        (key, value), = delta.items()
        if merged and key != "tool_calls" and key in merged[-1]:
            merged[-1] = {key: merged[-1][key] + value}
        else:
            merged.append(delta)
    return merged


def join_reasoning_deltas(deltas: Iterable[dict]) -> tuple[str | None, str]:
    """Deltas joined as a client joins them: (reasoning or None, content)."""
    deltas = list(deltas)
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    return reasoning or None, "".join(d.get("content") or "" for d in deltas)


def split_reasoning(text: str, starts_inside: bool = False, start: str = THINK_START,
                    end: str = THINK_END) -> tuple[str | None, str]:
    """A whole output split: (reasoning_content or None, content)."""
    parser = ReasoningParser(starts_inside, start, end)
    return join_reasoning_deltas([*parser.feed(text), *parser.finish()])
