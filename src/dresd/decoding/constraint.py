"""Grammar constraints (a JSON schema, a regex, a choice, a Lark grammar) on a generation,
exact under speculation, with the grammar's forced tokens drafted for free.

The grammar engine is llguidance (the one llama.cpp and vLLM use): a `Grammar` is compiled
once per request; each sequence holds a `Constraint`, its matcher at the state after every
token emitted so far. A grammar changes what is allowed, never what is chosen among the
allowed, so constrained decoding is the model's own decoding over the allowed tokens:

    greedy:   the allowed token with the largest logit;
    sampling: p(x) = softmax over the allowed tokens (then temperature, top-k, top-p).

Under speculation every tree node has its own state: the grammar after the tokens on its path
from the root. So (`TreeMasks`):

1. a drafted token the grammar forbids is cut before the forward, with everything after it
   (`allowed_prefix`): it costs no row;
2. where the grammar allows one continuation only (a key, a bracket, a fixed string), those
   tokens (`forced`) enter the tree as a draft: each is the only allowed token at its node, so
   it is always accepted, by greedy and by sampling alike;
3. at each node the walk reaches, the target's token is chosen among the tokens that node's
   state allows: its argmax, where the grammar allows it (a check of one token), else the
   argmax of its logits masked to the allowed set; under sampling, a sample of its masked
   distribution. The walk is then plain decoding's choice at every emitted position, so the
   output is token for token constrained `ar`'s (greedy), and its distribution (sampling).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

import numpy as np
import torch
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from dresd.decoding.tree import DraftTree
from dresd.errors import MissingPackageError, UserError

KINDS = ("json_schema", "json_object", "regex", "choice", "lark", "grammar")
# JSON as Python's json.dumps writes it: `, ` and `: `, no other whitespace. What models write
# most often, and it leaves the grammar one way to go after a value (the next key, a bracket):
# those tokens are forced, so they are drafted for free. A schema's "x-guidance" overrides it.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(UserError):
    """A grammar the engine cannot compile (a bad schema, regex or Lark text)."""


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
    except ImportError as err:
        raise MissingPackageError(f"grammar constraints need llguidance ({err}); install it "
                                  "with pip install llguidance") from None
    return llguidance


@functools.lru_cache(maxsize=8)
def _engine_tokenizer(tokenizer: PreTrainedTokenizerBase):
    """llguidance's view of the tokenizer: built once per tokenizer (about a second)."""
    return _llguidance().hf.from_tokenizer(tokenizer)


@dataclass(frozen=True)
class ThinkTokens:
    """A reasoning model's think block: its opening and closing tokens, and whether the prompt
    left one open (the output then starts inside it)."""

    start: int
    end: int
    starts_inside: bool


@dataclass(frozen=True)
class Grammar:
    """A compiled grammar for one tokenizer; `start()` gives a sequence its own state."""

    tokenizer: PreTrainedTokenizerBase
    text: str  # llguidance's grammar, as `grammar_from_*` wrote it
    vocab_size: int  # the model's logits width (at least the tokenizer's)
    # a model that thinks first: the grammar applies from the end of its think block
    think: ThinkTokens | None = None

    @classmethod
    def compile(cls, kind: str, spec: object, tokenizer: PreTrainedTokenizerBase,
                vocab_size: int) -> Grammar:
        """`kind`: `json_schema` (spec: a schema, a dict or its JSON text), `json_object`
        (any JSON object), `regex`, `choice` (a list of strings: exactly one of them), `lark`,
        `grammar` (Lark, or llama.cpp's GBNF). A GrammarError names what is
        wrong with the spec."""
        matcher_class = _llguidance().LLMatcher
        try:
            if kind in ("json_schema", "json_object"):
                schema = spec if kind == "json_schema" else {"type": "object"}
                if isinstance(schema, str):  # a schema as JSON text (vLLM's guided_json)
                    schema = json.loads(schema)
                text = matcher_class.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
            elif kind == "regex":
                text = matcher_class.grammar_from_regex(str(spec))
            elif kind == "choice":
                if not isinstance(spec, list) or not spec or not all(
                        isinstance(s, str) for s in spec):
                    raise GrammarError("a choice is a non-empty list of strings")
                text = matcher_class.grammar_from_regex(
                    "|".join(_regex_literal(choice) for choice in spec))
            elif kind in ("lark", "grammar"):
                lark = str(spec)
                if kind == "grammar":
                    from llguidance.gbnf_to_lark import any_to_lark  # GBNF, or Lark as it is

                    lark = any_to_lark(lark)
                text = matcher_class.grammar_from_lark(lark)
            else:
                raise GrammarError(f"unknown grammar kind {kind!r}; one of {', '.join(KINDS)}")
        except (ValueError, TypeError) as err:
            raise GrammarError(f"the {kind} cannot be compiled: {err}") from None
        problem = matcher_class.validate_grammar(text, _engine_tokenizer(tokenizer))
        if problem:  # "" where it is valid
            raise GrammarError(f"the {kind} cannot be compiled: {problem}")
        return cls(tokenizer, text, vocab_size)

    def start(self) -> Constraint | AfterThinking:
        """A sequence's constraint, at the grammar's start (no token emitted yet)."""
        engine = _llguidance()
        matcher = engine.LLMatcher(_engine_tokenizer(self.tokenizer), self.text)
        if matcher.is_error():
            raise GrammarError(f"the grammar cannot be used: {matcher.get_error()}")
        answer = Constraint(matcher, self.vocab_size)
        return answer if self.think is None else AfterThinking(answer, self.think)


def _regex_literal(text: str) -> str:
    """`text` as a regex that matches exactly it (llguidance's regex syntax is Rust's)."""
    return "(" + "".join("\\" + c if c in r"\.+*?()|[]{}^$#&-~" else c for c in text) + ")"


class Constraint:
    """One sequence's grammar state, after every token it emitted (`commit`)."""

    def __init__(self, matcher, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size

    def allowed_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, emitted next, the grammar allows in a row."""
        return self.matcher.validate_tokens(list(tokens)) if tokens else 0

    def forced(self) -> list[int]:
        """The tokens the grammar allows alone from here (none where it allows a choice)."""
        return list(self.matcher.compute_ff_tokens())

    def mask_after(self, tokens: list[int]) -> torch.Tensor:
        """bool [vocab_size]: the tokens allowed after `tokens` (themselves allowed)."""
        if tokens and not self.matcher.consume_tokens(list(tokens)):
            raise RuntimeError(f"the grammar refused a path it had allowed: {tokens}")
        try:
            bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        finally:
            if tokens:
                self.matcher.rollback(len(tokens))
        allowed = np.zeros(self.vocab_size, dtype=bool)
        width = min(self.vocab_size, bits.size * 8)
        allowed[:width] = np.unpackbits(bits, bitorder="little")[:width]
        return torch.from_numpy(allowed)

    def finished(self) -> bool:
        """Whether the grammar allows nothing more but the end of the text."""
        return self.matcher.is_stopped()

    def commit(self, tokens: list[int]) -> None:
        """The tokens the sequence emitted (each one the grammar allowed)."""
        for token in tokens:
            if self.matcher.is_stopped():  # the end of text that completed it: nothing to add
                return
            if not self.matcher.consume_token(int(token)):
                raise RuntimeError(f"the grammar refused an emitted token ({token}): "
                                   f"{self.matcher.get_error()}")


class AfterThinking:
    """A grammar that applies from the end of a reasoning model's think block (the answer),
    not to the reasoning before it: a Constraint's interface over three states of a path,

    - "open": nothing emitted yet, no block open: the first token opens one (`<think>`) or
      begins the answer, which the grammar then holds from that token on;
    - "thinking": inside the block, every token allowed, up to and including `</think>`;
    - "answer": the grammar's own state after the answer's tokens.

    The state after a path is a function of the path alone, as a Constraint's is, so every
    tree node's mask still follows its own path and speculation stays exact: a draft that
    runs past `</think>` is held to the grammar from there, even within one step. (Where
    reasoning ends inside speculated tokens, vLLM applied no grammar: its PR #36138.)"""

    def __init__(self, answer: Constraint, think: ThinkTokens) -> None:
        self.answer = answer
        self.think = think
        self.state = "thinking" if think.starts_inside else "open"

    def _answer_start(self, tokens: list[int]) -> int | None:
        """Where the answer begins in `tokens` emitted next (its first token's index; len
        (tokens) where it begins right after them); None where the block is still open."""
        state = self.state
        for i, token in enumerate(tokens):
            if state == "answer":
                return i
            if state == "open":
                if token != self.think.start:
                    return i
                state = "thinking"
            elif token == self.think.end:
                state = "answer"
        return len(tokens) if state == "answer" else None

    def allowed_prefix(self, tokens: list[int]) -> int:
        begin = self._answer_start(tokens)
        if begin is None:
            return len(tokens)
        return begin + self.answer.allowed_prefix(tokens[begin:])

    def forced(self) -> list[int]:
        return self.answer.forced() if self.state == "answer" else []

    def mask_after(self, tokens: list[int]) -> torch.Tensor:
        begin = self._answer_start(tokens)
        if begin is not None:
            return self.answer.mask_after(tokens[begin:])
        if self._state_after(tokens) == "thinking":
            return torch.ones(self.answer.vocab_size, dtype=torch.bool)
        mask = self.answer.mask_after([])  # "open": the answer's first token, or the block's
        mask[self.think.start] = True
        return mask

    def _state_after(self, tokens: list[int]) -> str:
        return "open" if self.state == "open" and not tokens else "thinking"

    def finished(self) -> bool:
        return self.state == "answer" and self.answer.finished()

    def commit(self, tokens: list[int]) -> None:
        begin = self._answer_start(tokens)
        if begin is None:
            self.state = self._state_after(tokens)
            return
        self.state = "answer"
        self.answer.commit(tokens[begin:])


def constrain_drafts(constraint: Constraint, drafts: list[list[int]],
                     max_len: int) -> tuple[list[int], list[list[int]]]:
    """(the grammar's forced tokens, at most `max_len` of them (step 2 above); the drafts cut
    where the grammar forbids a token (step 1), the empty ones left out)."""
    kept = [draft[:constraint.allowed_prefix(draft)] for draft in drafts]
    return constraint.forced()[:max_len], [draft for draft in kept if draft]


def forced_nodes(tree: DraftTree, forced: list[int]) -> set[int]:
    """The tree's nodes of the forced draft: the budget never cuts them (always accepted)."""
    nodes, node = set(), 0
    for token in forced:
        node = tree.children[node].get(token, -1)
        if node < 0:
            break
        nodes.add(node)
    return nodes


class TreeMasks:
    """What the grammar allows at each node of a tree (step 3 above), computed as the walk
    asks: a one-token check where the target's argmax is allowed, the node's whole mask
    where it is not (or to sample)."""

    def __init__(self, constraint: Constraint, tree: DraftTree) -> None:
        self.constraint = constraint
        self.tree = tree
        self._masks: dict[int, torch.Tensor] = {}

    def _path_tokens(self, node: int) -> list[int]:
        return [self.tree.tokens[i] for i in self.tree.path_to(node)[1:]]

    def allows(self, node: int, token: int) -> bool:
        path = self._path_tokens(node)
        return self.constraint.allowed_prefix([*path, token]) == len(path) + 1

    def mask(self, node: int) -> torch.Tensor:
        if node not in self._masks:
            self._masks[node] = self.constraint.mask_after(self._path_tokens(node))
        return self._masks[node]

    def masked(self, node: int, logits: torch.Tensor) -> torch.Tensor:
        """A node's logits row with every token the grammar forbids there at -inf."""
        mask = self.mask(node).to(logits.device)
        return logits.float().masked_fill(~mask[: logits.shape[-1]], float("-inf"))

    def greedy(self, node: int, argmax: int, logits: torch.Tensor) -> int:
        """The allowed token with the largest logit at `node` (`argmax`: the unmasked one)."""
        if self.allows(node, argmax):
            return argmax
        return int(self.masked(node, logits).argmax())


