"""The OpenAI wire format, for the subset served: requests in, completions and chunks out.

Requests are pydantic models, so a field of the wrong type is a 400 with the field named.
Fields this server does not know are ignored (and logged), as vLLM does. Besides OpenAI's
fields a request may carry dresd's own in the body (the `openai` client's `extra_body`):
`method`, `datastore`, `top_k` and the drafter options in `engine.REQUEST_DRAFTER_OPTIONS`.
`cache_salt` (vLLM's and OpenAI's name) keeps a request's prefix cache entries to the requests
with the same salt; `logprobs` / `top_logprobs` and `n` as OpenAI defines them.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Collection
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from dresd.decoding.processing import Penalties
from dresd.metrics import TokenLogprob
from dresd.serve.engine import REQUEST_DRAFTER_OPTIONS, RequestError
from dresd.serve.tool_calls import check_tools, render_tools_prompt

MAX_TOP_LOGPROBS = 20  # alternatives per token at most (OpenAI's chat limit)
MAX_CHOICES = 16  # `n` at most: each choice is a sequence in the batch
MAX_LOGIT_BIAS = 300  # tokens a logit_bias may name
# Fields of OpenAI's API (and vLLM's, llama-server's) that this server does not honour yet. A
# client that sends one expects its effect (a tool call, a JSON object, a penalty): each is
# refused with a 400 naming it, unless its value is the one that changes nothing (clients
# such as LangChain send `presence_penalty: 0` and `logit_bias: {}` with every request).
NOT_HONOURED = ("tools", "tool_choice", "functions", "function_call", "parallel_tool_calls",
                "best_of", "suffix", "chat_template_kwargs", "reasoning_effort", "modalities",
                "audio", "web_search_options")
# (the chat endpoint declares `tools`, `tool_choice`, `parallel_tool_calls` and
# `chat_template_kwargs` as its own fields: there they are honoured, not refused)
# Where a request asks for structured output, by the API that named it: OpenAI's
# `response_format`, vLLM's `guided_*` and `structured_outputs`, llama-server's `json_schema`
# and `grammar` (GBNF). A request may use one.
GRAMMAR_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice",
                  "guided_grammar", "structured_outputs", "json_schema", "grammar")


class StreamOptions(BaseModel):
    include_usage: bool = False


class GenerationFields(BaseModel):
    """The fields both endpoints share."""

    # Unknown fields are ignored, as vLLM does; NaN and infinities (which Python's JSON reader
    # takes) are refused, since they slip past every range check.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    logprobs: Any = None  # chat: true / false; completions: how many alternatives (int)
    top_logprobs: int | None = None  # chat: alternatives per token, with logprobs true
    cache_salt: str | None = None  # prefix cache entries shared only within one salt
    # structured output (`grammar_spec`): OpenAI's, vLLM's and llama-server's names
    response_format: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict | None = None
    json_schema: dict | None = None
    grammar: str | None = None
    # OpenAI's Predicted Outputs: {"type": "content", "content": text or text parts}
    prediction: dict | None = None
    # logit processing (decoding/processing.py), each tree node's by its own path
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    min_p: float | None = None
    # dresd's own, from the request body
    method: str | None = None
    datastore: str | None = None
    top_k: int | None = None
    num_drafts: int | None = None
    draft_len: int | None = None
    max_tree_nodes: int | None = None
    k: int | None = None
    max_ngram: int | None = None
    min_ngram: int | None = None
    max_suffix: int | None = None
    min_suffix: int | None = None
    max_matches: int | None = None

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]

    def drafter_options(self) -> dict[str, int]:
        return {key: getattr(self, key) for key in REQUEST_DRAFTER_OPTIONS
                if getattr(self, key) is not None}

    def check_supported(self) -> None:
        """Refuse what this server does not do, rather than silently do something else."""
        if not 1 <= self.n <= MAX_CHOICES:
            raise RequestError(f"n must be from 1 to {MAX_CHOICES}", param="n")
        extra = self.model_extra or {}
        for name in NOT_HONOURED:
            if name in extra and not changes_nothing(name, extra[name]):
                raise RequestError(f"{name} is not supported by this server yet; send the "
                                   "request without it", param=name)

    def grammar_spec(self) -> tuple[str, object] | None:
        """(kind, spec) for `constraint.Grammar.compile`, or None: what the output must
        follow, from whichever field the request used to say it."""
        given = [name for name in GRAMMAR_FIELDS if getattr(self, name) is not None]
        if len(given) > 1:
            raise RequestError(f"give one of {', '.join(given)}, not several", param=given[1])
        if not given:
            return None
        name = given[0]
        value = getattr(self, name)
        if name == "response_format":
            return _response_format(value)
        if name == "structured_outputs":  # vLLM's newer form: {"json": ...} or the like
            kinds = {"json": "json_schema", "regex": "regex", "choice": "choice",
                     "grammar": "grammar"}
            chosen = [key for key in kinds if value.get(key) is not None]
            if len(chosen) != 1:
                raise RequestError("structured_outputs takes one of json, regex, choice, "
                                   "grammar", param=name)
            name, value = f"guided_{chosen[0]}", value[chosen[0]]
        kind = {"guided_json": "json_schema", "json_schema": "json_schema",
                "guided_regex": "regex", "guided_choice": "choice",
                "guided_grammar": "grammar", "grammar": "grammar"}[name]
        return kind, value

    def penalties(self, vocab_size: int) -> Penalties | None:
        """The request's penalties and logit bias, checked as OpenAI and vLLM check them."""
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise RequestError(f"{name} must be from -2 to 2", param=name)
        if not 0 < self.repetition_penalty <= 2:
            raise RequestError("repetition_penalty must be > 0 and <= 2",
                               param="repetition_penalty")
        bias = self.logit_bias or {}
        if len(bias) > MAX_LOGIT_BIAS:
            raise RequestError(f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens",
                               param="logit_bias")
        tokens: dict[int, float] = {}
        for key, value in bias.items():
            if not key.isdigit() or int(key) >= vocab_size or not -100 <= value <= 100:
                raise RequestError(f"logit_bias maps token ids (0 to {vocab_size - 1}) to "
                                   f"values from -100 to 100; got {key!r}: {value}",
                                   param="logit_bias")
            tokens[int(key)] = value
        penalties = Penalties(self.presence_penalty, self.frequency_penalty,
                              self.repetition_penalty, tokens)
        return penalties if penalties.active else None

    def prediction_text(self) -> str | None:
        """The predicted output's text, or None."""
        if self.prediction is None:
            return None
        content = self.prediction.get("content")
        if isinstance(content, list):  # text parts, as OpenAI's messages have them
            if not all(isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) for p in content):
                raise RequestError("prediction.content parts must be text parts",
                                   param="prediction")
            content = "".join(part["text"] for part in content)
        if self.prediction.get("type") != "content" or not isinstance(content, str):
            raise RequestError('prediction must be {"type": "content", "content": TEXT}',
                               param="prediction")
        return content

    def ignored_fields(self) -> list[str]:
        """Unknown fields (not OpenAI's, nor dresd's), and the ones above at a value that
        changes nothing."""
        return sorted(self.model_extra or {})

    def logprobs_wanted(self) -> int | None:
        """Alternatives per token to report (0: the chosen token's logprob only), or None."""
        raise NotImplementedError


# The values of NOT_HONOURED fields that ask for nothing: these, and null, false, 0, "", {}, [].
NEUTRAL_VALUES = {"best_of": 1, "repetition_penalty": 1, "tool_choice": "none"}


def changes_nothing(name: str, value: object) -> bool:
    """Whether a field at this value asks for nothing this server would have to do."""
    return value in (None, False, 0, "", {}, []) or value == NEUTRAL_VALUES.get(name)


def _response_format(value: dict) -> tuple[str, object] | None:
    """OpenAI's `response_format`: `{"type": "text"}`, `{"type": "json_object"}` or
    `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`."""
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return "json_object", None
    if kind == "json_schema":
        described = value.get("json_schema")
        if not isinstance(described, dict) or not isinstance(described.get("schema", {}), dict):
            raise RequestError("response_format.json_schema must be an object with a `schema`",
                               param="response_format")
        return "json_schema", described.get("schema", {})
    raise RequestError("response_format.type must be text, json_object or json_schema",
                       param="response_format")


def _alternatives(value: object, param: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not (
            0 <= value <= MAX_TOP_LOGPROBS):
        raise RequestError(f"{param} must be a whole number from 0 to {MAX_TOP_LOGPROBS}",
                           param=param)
    return value


class CompletionRequest(GenerationFields):
    # text, or token ids (as lm-evaluation-harness sends them); one prompt per request
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False  # the prompt before the completion, with its logprobs where asked

    def echo_wanted(self) -> bool:
        if self.echo and self.stream:
            raise RequestError("echo is served whole, not streamed", param="echo")
        return self.echo

    def logprobs_wanted(self) -> int | None:
        """Completions: `logprobs` is the number of alternatives (0: the token's own)."""
        if self.logprobs is None:
            return None
        return _alternatives(self.logprobs, "logprobs")

    def prompt_ids(self, tokenizer: PreTrainedTokenizerBase) -> list[int]:
        """The raw text tokenized as it is (as `dresd generate --no-chat-template`)."""
        one = isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int))
        prompts = [self.prompt] if one else self.prompt
        if len(prompts) != 1:
            raise RequestError("this server takes one prompt per request", param="prompt")
        prompt = prompts[0]
        if isinstance(prompt, list):  # token ids, taken as they are
            if not prompt or not all(0 <= token < len(tokenizer) for token in prompt):
                raise RequestError(f"a prompt of token ids holds ids from 0 to "
                                   f"{len(tokenizer) - 1}, at least one", param="prompt")
            return list(prompt)
        if not prompt.strip():
            raise RequestError("the prompt is empty", param="prompt")
        return tokenizer(prompt, add_special_tokens=True)["input_ids"]

    def prompt_text(self, tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> str:
        """The prompt as `echo` gives it back: as sent, or its token ids decoded."""
        prompt = self.prompt if isinstance(self.prompt, str) or not self.prompt or isinstance(
            self.prompt[0], int) else self.prompt[0]
        return prompt if isinstance(prompt, str) else tokenizer.decode(ids)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if any(part.type != "text" for part in self.content):
            raise RequestError("only text content parts are supported", param="messages")
        return "".join(part.text or "" for part in self.content)


class ChatCompletionRequest(GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    tools: list[dict] | None = None  # functions the model may call (tool_calls.py)
    tool_choice: str | dict | None = None  # "none", "auto", "required" or a named function
    parallel_tool_calls: bool = True  # under "required" or a named one: one call or more
    chat_template_kwargs: dict | None = None  # passed to the chat template (enable_thinking)

    def uses_tools(self) -> bool:
        """Whether the prompt needs tool_calls.py's rendering: tools, a tool call or result
        in the history, or arguments for the template."""
        return bool(self.tools or self.chat_template_kwargs or any(
            m.role == "tool" or (m.model_extra or {}).get("tool_calls") for m in self.messages))

    def logprobs_wanted(self) -> int | None:
        """Chat: `logprobs` true turns them on, `top_logprobs` asks for alternatives."""
        if self.logprobs not in (None, True, False):
            raise RequestError("logprobs must be true or false", param="logprobs")
        if not self.logprobs:
            if self.top_logprobs:
                raise RequestError("top_logprobs needs logprobs to be true",
                                   param="top_logprobs")
            return None
        return _alternatives(self.top_logprobs or 0, "top_logprobs")

    def prompt_ids(self, tokenizer: PreTrainedTokenizerBase) -> list[int]:
        """The conversation through the chat template, the assistant's turn opened (for one
        user message, exactly `dresd generate --prompt`'s token ids)."""
        if not tokenizer.chat_template:
            raise RequestError("this model has no chat template; use /v1/completions")
        messages = [{"role": m.role, "content": m.text()} for m in self.messages]
        if self.uses_tools():
            check_tools(self.tools, self.tool_choice)
            history = [{**(m.model_extra or {}), **message}
                       for m, message in zip(self.messages, messages, strict=True)]
            return render_tools_prompt(tokenizer, history, self.tools,
                                       self.tool_choice or "auto",
                                       **(self.chat_template_kwargs or {}))
        if not any(m["content"].strip() for m in messages):
            raise RequestError("the messages are empty", param="messages")
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                tokenize=True)
        # Depending on the tokenizer this is a list of ids or a BatchEncoding.
        return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


class IncrementalText:
    """Token ids in, text out in pieces, for streaming, in time linear in the output.

    Each call decodes only the tokens since the last whole character, with a few tokens
    before them as context (a tokenizer may decode a token differently at the start of a
    text): the new text is what the window decodes to beyond what its context alone decodes
    to, released once it ends in a whole character (a character whose bytes span two tokens
    comes out whole, as vLLM's detokenizer does it). With stop strings, the last (longest stop
    string - 1) characters are held back, since they could begin one, and each stop string is
    searched for only in the text that could hold a new match. As in OpenAI's API the stop
    string itself is never sent: the text ends where it begins.

    Special tokens are left out of the text, as `skip_special_tokens` does, but for those in
    `keep`: a tool call format's markers that are special tokens in the model's tokenizer
    (Mistral's `[TOOL_CALLS]`, Llama's `<|python_tag|>`), without which the call parser would
    see the call's JSON as plain content.
    """

    CONTEXT_TOKENS = 4  # tokens decoded before the new ones, for the tokenizer's context

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: list[str],
                 keep: Collection[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.keep = frozenset(keep)
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
        self.decoded = ""  # the text of every token up to `self.read`
        self.context = 0  # the window's context starts at this token
        self.read = 0  # tokens whose text is in `decoded`
        self.searched = 0  # no stop string starts before this character of `decoded`
        self.end: int | None = None  # where the first stop string starts, once found
        self.sent = 0  # characters released so far

    @property
    def stopped(self) -> bool:
        """Whether a stop string was found."""
        return self.end is not None

    def _decode(self, ids: list[int]) -> str:
        if not self.keep or self.keep.isdisjoint(ids):  # (most requests keep nothing)
            return self.tokenizer.decode(ids, skip_special_tokens=True)
        # the runs between kept tokens decoded as always, each kept token as its own text
        pieces, run = [], []
        for token in ids:
            if token in self.keep:
                pieces += [self.tokenizer.decode(run, skip_special_tokens=True),
                           self.tokenizer.decode([token], skip_special_tokens=False)]
                run = []
            else:
                run.append(token)
        return "".join([*pieces, self.tokenizer.decode(run, skip_special_tokens=True)])

    def _read(self, final: bool) -> None:
        """Decode the tokens after `self.read` into `decoded`: once they end in a whole
        character, or all of them when the output has ended."""
        if self.read == len(self.ids) or self.end is not None:
            return
        before = self._decode(self.ids[self.context:self.read])
        window = self._decode(self.ids[self.context:])
        if not window.startswith(before):  # the context decoded otherwise: decode it all
            before, window = self.decoded, self._decode(self.ids)
        if window.endswith("\ufffd") and not final:
            return  # a character's bytes are still coming
        self.decoded += window[len(before):]
        self.context = max(0, len(self.ids) - self.CONTEXT_TOKENS)
        self.read = len(self.ids)
        self._find_stop()

    def _find_stop(self) -> None:
        """Look for the stop strings in the text that can hold a match not seen before."""
        cuts = [i for i in (self.decoded.find(s, self.searched) for s in self.stop) if i >= 0]
        if cuts:
            self.end = min(cuts)
        else:
            self.searched = max(0, len(self.decoded) - self.hold)

    def _release(self, safe: int) -> str:
        if self.end is not None:
            safe = self.end
        piece = self.decoded[self.sent:safe] if safe > self.sent else ""
        self.sent += len(piece)
        return piece

    def add(self, tokens: list[int]) -> str:
        """The new text that is safe to send after these tokens."""
        self.ids.extend(tokens)
        self._read(final=False)
        return self._release(len(self.decoded) - self.hold)

    def finish(self) -> str:
        """The rest of the text once generation has ended."""
        self._read(final=True)
        return self._release(len(self.decoded))

    @property
    def text(self) -> str:
        """All the text so far, up to a stop string."""
        return self.decoded[:self.end]


def chat_logprobs(entries: list[TokenLogprob], tokenizer: PreTrainedTokenizerBase) -> dict:
    """A chat choice's `logprobs`: per token its text, logprob, UTF-8 bytes and the
    alternatives, as OpenAI gives them."""
    def item(token: int, logprob: float) -> dict:
        text = tokenizer.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**item(e.token, e.logprob),
                         "top_logprobs": [item(token, lp) for token, lp in e.top]}
                        for e in entries]}


def completion_logprobs(entries: list[TokenLogprob], tokenizer: PreTrainedTokenizerBase,
                        offset: int = 0) -> dict:
    """A completion choice's `logprobs` (the legacy shape): tokens, their logprobs, the
    alternatives as {token: logprob} and each token's character offset from `offset`."""
    tokens = [tokenizer.decode([e.token]) for e in entries]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{tokenizer.decode([token]): lp for token, lp in e.top or []}
                             for e in entries],
            "text_offset": offsets}


def echo_logprobs(prompt_ids: list[int], entries: list[TokenLogprob],
                  tokenizer: PreTrainedTokenizerBase) -> dict:
    """The prompt's part of an echoed completion's `logprobs`: each token, its logprob given
    the tokens before it (None for the first, which nothing predicts), its alternatives."""
    first = [TokenLogprob(prompt_ids[0], None, None)]  # type: ignore[arg-type]
    body = completion_logprobs([*first, *entries], tokenizer)
    body["top_logprobs"][0] = None
    return body


def join_logprobs(head: dict, tail: dict) -> dict:
    """Two completion `logprobs` one after the other (the tail's offsets moved past the
    head's text)."""
    shift = sum(len(token) for token in head["tokens"])
    return {"tokens": head["tokens"] + tail["tokens"],
            "token_logprobs": head["token_logprobs"] + tail["token_logprobs"],
            "top_logprobs": head["top_logprobs"] + tail["top_logprobs"],
            "text_offset": head["text_offset"] + [offset + shift
                                                  for offset in tail["text_offset"]]}


def finish_reason(stop_reason: str, stop_string_found: bool) -> str:
    """OpenAI's finish_reason for the loop's stop reason."""
    if stop_string_found or stop_reason in ("eos", "stop_string"):
        return "stop"
    return "length"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
          prediction: tuple[int, int] | None = None) -> dict:
    """OpenAI's usage object; `cached_tokens`: the prompt tokens read from the prefix cache;
    `prediction`: (accepted, rejected) prediction tokens, where the request gave one."""
    body = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    if prediction is not None:
        body["completion_tokens_details"] = {"accepted_prediction_tokens": prediction[0],
                                             "rejected_prediction_tokens": prediction[1]}
    return body


def choice_body(kind: Literal["chat", "text"], index: int, text: str | dict, reason: str,
                logprobs: dict | None = None) -> dict:
    """One choice of a whole response (chat: its text, or its whole message)."""
    if kind == "chat":
        message = text if isinstance(text, dict) else {"role": "assistant", "content": text}
        return {"index": index, "message": message, "logprobs": logprobs,
                "finish_reason": reason}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}


def completion_body(kind: Literal["chat", "text"], request_id: str, created: int, model: str,
                    choices: list[dict], usage_: dict, figures: dict) -> dict:
    """A whole (non-streaming) response; `dresd` carries the speculative figures."""
    obj = "chat.completion" if kind == "chat" else "text_completion"
    return {"id": request_id, "object": obj, "created": created, "model": model,
            "choices": choices, "usage": usage_, "dresd": figures}


def chunk_body(kind: Literal["chat", "text"], request_id: str, created: int, model: str,
               text: str | dict | None, reason: str | None, first: bool = False,
               logprobs: dict | None = None, index: int = 0) -> dict:
    """One streamed chunk: a piece of text (chat: or a whole delta, as `chat_output` gives
    them: reasoning, tool calls), or the last one with its finish_reason."""
    if kind == "chat":
        delta: dict = {}
        if first:
            delta["role"] = "assistant"
        if isinstance(text, dict):
            delta.update(text)
        elif text is not None:
            delta["content"] = text
        choice = {"index": index, "delta": delta, "logprobs": logprobs,
                  "finish_reason": reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs,
                  "finish_reason": reason}
        obj = "text_completion"
    return {"id": request_id, "object": obj, "created": created, "model": model,
            "choices": [choice]}


def usage_chunk(kind: Literal["chat", "text"], request_id: str, created: int, model: str,
                usage_: dict) -> dict:
    """The last chunk when the request asked for `stream_options.include_usage`."""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": request_id, "object": obj, "created": created, "model": model,
            "choices": [], "usage": usage_}


def error_body(message: str, status: int, param: str | None = None) -> dict:
    """OpenAI's error object. A message may quote the request (a model name, a template's
    complaint): a lone surrogate there is escaped, so that the body still encodes as UTF-8."""
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    kinds = {400: "BadRequestError", 404: "NotFoundError", 413: "RequestTooLargeError",
             503: "ServiceUnavailableError"}
    return {"error": {"message": message, "type": kinds.get(status, "InternalServerError"),
                      "param": param, "code": status}}
