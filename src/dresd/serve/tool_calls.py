"""Tool calls for the chat endpoint: the tools into the prompt, the calls out of the text.

Pure functions and small classes, no server state, so that each piece is tested alone:

- **Rendering**: `render_tools_prompt` puts the conversation and the tools through the model's
  own chat template where it takes `tools` (Qwen, Hermes, Llama 3.1+, Mistral templates do);
  where it does not (SmolLM2's), through a generic system prompt in the Hermes style
  (`tools_system_prompt`): the tools as JSON within <tools></tools>, calls asked for as
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. OpenAI history messages (assistant
  `tool_calls`, `role: "tool"` results) are converted to what each path expects
  (`prepare_messages`).
- **Parsing**: one `ToolCallFormat` per format models write (Hermes/Qwen JSON, Qwen3-Coder XML,
  Llama 3.x JSON, Mistral `[TOOL_CALLS]`, FunctionGemma's `<start_function_call>`), all with
  one interface: `parse(text)` for a whole output and `stream()` for an incremental parser of
  text pieces into OpenAI `delta`s.
  `select_tool_format` picks the format from the model's chat template, tokenizer and
  architecture (Hermes by default, and always where the generic prompt was used).
- **Constraint**: `tool_call_schema` (a JSON schema of one call, or a list of calls) and
  `tool_call_grammar` (a Lark grammar for llguidance with the Hermes markers around the JSON)
  for `tool_choice: "required"` or a named function.

How the server is expected to use them::

    check_tools(tools, tool_choice)                 # RequestError (400) naming the field
    ids = render_tools_prompt(tokenizer, messages, tools, tool_choice, **chat_template_kwargs)
    fmt = select_tool_format(tokenizer, tools=tools)
    content, calls = fmt.parse(text)                # whole; finish_reason "tool_calls" if calls
    stream = fmt.stream()                           # streamed:
    for piece in pieces: deltas = stream.feed(piece)  # each a chunk's `delta` (content or
    deltas = stream.finish()                          # tool_calls); stream.called -> finish

The whole parse is the stream run over the whole text in one piece, so a streamed response's
deltas, joined (`join_deltas`), are always exactly the whole response. That is why a call is
streamed once its closing marker is seen (name first, then its arguments), not character by
character: a call whose JSON turns out bad must come back as content, never as a call, and
that is known only at its end. Content outside the calls streams as it comes, less what could
still be the start of a marker (a trailing "<tool_c" is held back until the next piece tells).

Special tokens: Llama's `<|python_tag|>`, Mistral's `[TOOL_CALLS]` and FunctionGemma's markers
are special tokens in their tokenizers; the text given to these parsers must be decoded with
them kept, else the calls lose their marker: the server's text keeps a format's markers
(`ToolCallFormat.marker_ids`, `protocol.IncrementalText`) and leaves the other special tokens
out. (Qwen's `<tool_call>` is an added token that is not special: it survives either way.)

With reasoning models, feed the tool parser the `content` of `reasoning.ReasoningParser`, so
that a `<tool_call>` written while thinking is not taken for a call.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar

import jinja2
import jinja2.meta
import jinja2.sandbox

from dresd.decoding.constraint import JSON_LAYOUT
from dresd.serve.engine import RequestError
from dresd.serve.reasoning import merge_text_deltas

# --- the request's fields --------------------------------------------------------------------


def _function(tool: dict) -> dict:
    return tool.get("function") or {}


def check_tools(tools: Sequence[dict] | None, tool_choice: Any = None) -> None:
    """Refuse (RequestError, a 400 naming the field) tools or a tool_choice OpenAI refuses:
    tools that are not `{"type": "function", "function": {"name": ...}}` with distinct names,
    a tool_choice other than "none", "auto", "required" or `{"type": "function", "function":
    {"name": <one of the tools>}}`, and "required" or a named function without tools."""
    tools = tools or []
    if not isinstance(tools, list):
        raise RequestError("tools must be a list", param="tools")
    seen = set()
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" \
                or not isinstance(tool.get("function"), dict):
            raise RequestError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": "
                               "{...}}", param="tools")
        name = tool["function"].get("name")
        if not isinstance(name, str) or not name:
            raise RequestError(f"tools[{i}].function.name must be a non-empty string",
                               param="tools")
        if name in seen:
            raise RequestError(f"tools has two functions named {json.dumps(name)}",
                               param="tools")
        seen.add(name)
        parameters = tool["function"].get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise RequestError(f"tools[{i}].function.parameters must be a JSON schema object",
                               param="tools")
    if tool_choice is None or tool_choice in ("none", "auto"):
        return
    if tool_choice == "required":
        if not tools:
            raise RequestError('tool_choice "required" needs tools', param="tool_choice")
        return
    name = chosen_function(tool_choice)
    if name is None:
        raise RequestError('tool_choice must be "none", "auto", "required" or {"type": '
                           '"function", "function": {"name": ...}}', param="tool_choice")
    if name not in seen:
        raise RequestError(f"tool_choice names {json.dumps(name)}, which is not in tools",
                           param="tool_choice")


def chosen_function(tool_choice: Any) -> str | None:
    """The function's name where tool_choice names one (`{"type": "function", "function":
    {"name": ...}}`), else None."""
    if isinstance(tool_choice, dict) and tool_choice.get("type", "function") == "function":
        function = tool_choice.get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            return function["name"]
    return None


# --- rendering -------------------------------------------------------------------------------


def template_text(tokenizer: Any, tools: Sequence[dict] | None = None) -> str | None:
    """The chat template the tokenizer would apply (with several named templates, the one
    transformers picks: "tool_use" where tools are given and it exists, else "default")."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        if tools and "tool_use" in template:
            return template["tool_use"]
        return template.get("default")
    return template


def template_takes_tools(template: str | None) -> bool:
    """Whether a chat template reads the `tools` variable (so renders tools given to it)."""
    if not template:
        return False
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
    try:
        return "tools" in jinja2.meta.find_undeclared_variables(env.parse(template))
    except jinja2.TemplateError:
        # transformers' own tags (`{% generation %}`) are unknown to a plain environment.
        return re.search(r"\btools\b", template) is not None


def _text(content: Any) -> str:
    """A message's content as text: a string, None, or OpenAI's list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise RequestError("only text content parts are supported", param="messages")
            parts.append(part.get("text") or "")
        return "".join(parts)
    raise RequestError("a message's content must be a string or a list of parts",
                       param="messages")


def _arguments_object(arguments: Any) -> Any:
    """An assistant tool call's `arguments` (OpenAI's JSON string) as the object templates
    expect (they write it with `| tojson`); a string that is not JSON stays a string."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments if arguments is not None else {}


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def prepare_messages(messages: Sequence[Any], native: bool) -> list[dict]:
    """OpenAI chat messages (dicts or pydantic models) as a chat template takes them.

    native (the template takes tools): assistant `tool_calls` keep OpenAI's shape with each
    `function.arguments` parsed to an object, content None becomes "" (templates add it to
    strings), and a `tool` message keeps its `tool_call_id` and gains the `name` of the call
    it answers (some templates write it).
    generic (the Hermes-style fallback): the calls become the assistant's text
    (`<tool_call>{"name": ..., "arguments": ...}</tool_call>`, as the system prompt asks for
    them) and consecutive tool results one user message of `<tool_response>` blocks: a
    template that knows no tools may refuse or garble the role "tool".
    """
    out: list[dict] = []
    call_names: dict[str, str] = {}  # tool_call_id -> function name, for the results
    for message in messages:
        if hasattr(message, "model_dump"):
            message = message.model_dump(exclude_none=True)
        message = dict(message)
        role = message.get("role")
        content = _text(message.get("content"))
        if role == "assistant" and message.get("tool_calls"):
            calls = []
            for call in message["tool_calls"]:
                function = call.get("function") or {}
                name = function.get("name", "")
                call_names[call.get("id", "")] = name
                calls.append({"id": call.get("id", ""), "type": "function",
                              "function": {"name": name,
                                           "arguments": _arguments_object(
                                               function.get("arguments"))}})
            if native:
                out.append({**message, "content": content, "tool_calls": calls})
            else:
                blocks = [_hermes_block(c["function"]["name"], c["function"]["arguments"])
                          for c in calls]
                text = "\n".join(([content] if content else []) + blocks)
                out.append({"role": "assistant", "content": text})
        elif role == "tool":
            call_id = message.get("tool_call_id", "")
            name = message.get("name") or call_names.get(call_id, "")
            if native:
                out.append({**message, "content": content, "tool_call_id": call_id,
                            "name": name})
            else:
                block = f"<tool_response>\n{content}\n</tool_response>"
                if out and out[-1].get("_tool_results"):
                    out[-1]["content"] += "\n" + block
                else:
                    out.append({"role": "user", "content": block, "_tool_results": True})
        else:
            out.append({**message, "content": content} if native
                       else {"role": role, "content": content})
    for message in out:
        message.pop("_tool_results", None)
    return out


_MISTRAL_ID = re.compile(r"[a-zA-Z0-9]{9}")


def _mistral_call_ids(messages: list[dict]) -> list[dict]:
    """Mistral's templates refuse a call id that is not 9 letters or digits (its tokenizer's
    rule); OpenAI's ("call_...", which this server hands out too) are mapped to 9 hex digits of
    their hash: the same id always maps the same, so a call and its result still match, and
    the rendered history is the same from one turn to the next (for the prefix cache)."""
    def short(call_id: str) -> str:
        if _MISTRAL_ID.fullmatch(call_id):
            return call_id
        return hashlib.sha256(call_id.encode()).hexdigest()[:9]

    out = []
    for message in messages:
        if message.get("tool_calls"):
            message = {**message, "tool_calls": [{**call, "id": short(call["id"])}
                                                 for call in message["tool_calls"]]}
        if message.get("role") == "tool":
            message = {**message, "tool_call_id": short(message["tool_call_id"])}
        out.append(message)
    return out


def _hermes_block(name: str, arguments: Any) -> str:
    return f"<tool_call>\n{_dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def tools_system_prompt(tools: Sequence[dict], tool_choice: Any = "auto") -> str:
    """The generic tools prompt for templates that take no tools, in the Hermes style (the
    format Qwen2.5/3 and Hermes models are trained on, and that `HermesFormat` parses): the
    tools as JSON lines within <tools></tools>, each call asked for as a JSON object within
    <tool_call></tool_call>. "required" and a named function add a line saying so (the
    server's grammar is what enforces them)."""
    lines = [
        "# Tools",
        "",
        "You may call one or more functions to help with the user's request. The functions "
        "are described by JSON schemas within <tools></tools> XML tags:",
        "<tools>",
        *(_dumps(tool) for tool in tools),
        "</tools>",
        "",
        "To call a function, answer with a JSON object holding its name and arguments within "
        "<tool_call></tool_call> XML tags, one block per call:",
        "<tool_call>",
        '{"name": <function-name>, "arguments": <arguments-json-object>}',
        "</tool_call>",
        "The results come back within <tool_response></tool_response> XML tags.",
    ]
    name = chosen_function(tool_choice)
    if name is not None:
        lines.append(f"You must call the function {json.dumps(name)}.")
    elif tool_choice == "required":
        lines.append("You must call at least one function.")
    return "\n".join(lines)


def render_tools_text(tokenizer: Any, messages: Sequence[Any], tools: Sequence[dict] | None = None,
                      tool_choice: Any = "auto", **template_kwargs: Any) -> str:
    """The conversation and tools through the chat template, the assistant's turn opened, as
    text. `tool_choice: "none"` renders no tools (the model is not to call any). Template
    kwargs (`enable_thinking`, ...: the request's `chat_template_kwargs`) reach the template.
    Raises RequestError for a model without a chat template; the template's own errors (a
    role it refuses) propagate, as in `protocol.ChatCompletionRequest.prompt_ids`."""
    active = list(tools or []) if tool_choice != "none" else []
    template = template_text(tokenizer, active)
    if not template:
        raise RequestError("this model has no chat template; use /v1/completions")
    native = template_takes_tools(template)
    prepared = prepare_messages(messages, native)
    if native and "[TOOL_CALLS]" in template:
        prepared = _mistral_call_ids(prepared)
    if native or not active:
        return tokenizer.apply_chat_template(
            prepared, tools=active or None, add_generation_prompt=True, tokenize=False,
            **template_kwargs)
    prompt = tools_system_prompt(active, tool_choice)
    if prepared and prepared[0]["role"] == "system":
        with_system = [{**prepared[0], "content": prepared[0]["content"] + "\n\n" + prompt},
                       *prepared[1:]]
    else:
        with_system = [{"role": "system", "content": prompt}, *prepared]
    try:
        return tokenizer.apply_chat_template(with_system, add_generation_prompt=True,
                                             tokenize=False, **template_kwargs)
    except jinja2.TemplateError:
        # Some templates (Gemma's) refuse a system role: the tools go before the first user
        # message instead.
        system = with_system[0]["content"]
        rest = with_system[1:]
        first_user = next((i for i, m in enumerate(rest) if m["role"] == "user"), None)
        if first_user is None:
            raise
        rest[first_user] = {**rest[first_user],
                            "content": system + "\n\n" + rest[first_user]["content"]}
        return tokenizer.apply_chat_template(rest, add_generation_prompt=True,
                                             tokenize=False, **template_kwargs)


def render_tools_prompt(tokenizer: Any, messages: Sequence[Any],
                        tools: Sequence[dict] | None = None, tool_choice: Any = "auto",
                        **template_kwargs: Any) -> list[int]:
    """`render_tools_text`'s prompt as token ids (no special tokens added: the template
    writes its own, as `apply_chat_template(tokenize=True)` does). Without tools and tool
    messages these are exactly `protocol.ChatCompletionRequest.prompt_ids`'s."""
    text = render_tools_text(tokenizer, messages, tools, tool_choice, **template_kwargs)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


# --- parsing: the formats --------------------------------------------------------------------

ParsedCall = tuple[str, str]  # (function name, arguments as a JSON object's text)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _call_from_object(value: Any) -> ParsedCall | None:
    """A call from a JSON value models write: {"name": ..., "arguments" or "parameters": {...}}
    (arguments also as a JSON string of an object), or OpenAI's {"function": {...}}."""
    if not isinstance(value, dict):
        return None
    if "name" not in value and isinstance(value.get("function"), dict):
        value = value["function"]
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = _JSON.decode(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return name, _dumps(arguments)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# Python's reader takes NaN and Infinity, which are not JSON: arguments holding one would reach
# the client as text no JSON parser reads, so such a call is malformed (content).
_JSON = json.JSONDecoder(parse_constant=_no_constant)


def _json_values(text: str, separators: str = "") -> list[Any] | None:
    """The JSON values of a text holding one or more, apart by whitespace and `separators`;
    None unless the whole text is such values."""
    values, i = [], 0
    while True:
        while i < len(text) and (text[i].isspace() or text[i] in separators):
            i += 1
        if i == len(text):
            return values
        try:
            value, i = _JSON.raw_decode(text, i)
        except ValueError:
            return None
        values.append(value)


def is_json_value(text: str) -> bool:
    """Whether text is one JSON value (whitespace around it allowed; NaN and Infinity not)."""
    values = _json_values(text)
    return values is not None and len(values) == 1


def _json_calls(text: str, separators: str = "") -> list[ParsedCall] | None:
    """Calls from JSON text: objects (a list of them is flattened), each a call, or None."""
    values = _json_values(text, separators)
    if not values:
        return None
    calls = []
    for value in values:
        for item in value if isinstance(value, list) else [value]:
            call = _call_from_object(item)
            if call is None:
                return None
            calls.append(call)
    return calls or None


class ToolCallFormat:
    """How one family of models writes tool calls. A call region opens with one of `starts`
    and closes with `end` (None: it runs to the end of the output); `parse_region` turns a
    region's text into calls, or None where it is not valid (then the region is content).
    `only_at_start`: regions count only before any content (Llama's bare JSON)."""

    name: ClassVar[str]
    starts: ClassVar[tuple[str, ...]]
    end: ClassVar[str | None]
    only_at_start: ClassVar[bool] = False

    def __init__(self, tools: Sequence[dict] | None = None) -> None:
        self.tools = list(tools or [])

    def parse_region(self, start: str, body: str) -> list[ParsedCall] | None:
        raise NotImplementedError

    def parse(self, text: str, call_id: Callable[[], str] = new_call_id,
              ) -> tuple[str | None, list[dict]]:
        """A whole output: (content, OpenAI tool calls). Content is the text outside the valid
        calls, less the whitespace that only set it apart from them ("Sure.\n<tool_call>...":
        "Sure."); None when there are calls and nothing else.
        A malformed call stays in the content, as written; this never raises on any text."""
        stream = self.stream(call_id)
        return join_deltas([*stream.feed(text), *stream.finish()])

    def stream(self, call_id: Callable[[], str] = new_call_id) -> ToolCallStream:
        """An incremental parser of this format (see `ToolCallStream`)."""
        return ToolCallStream(self, call_id)

    def marker_ids(self, tokenizer: Any) -> set[int]:
        """The ids of this format's markers that are special tokens of the tokenizer: the
        server's text must keep them (`protocol.IncrementalText`), where it leaves other
        special tokens out."""
        markers = {*self.starts, *([self.end] if self.end else [])}
        decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
        return {token_id for token_id, token in decoder.items()
                if token.special and token.content in markers}

    def find_start(self, text: str) -> tuple[int, str] | None:
        """The first complete start marker in text: (index, marker)."""
        found = [(i, s) for s in self.starts if (i := text.find(s)) >= 0]
        return min(found, key=lambda hit: (hit[0], -len(hit[1]))) if found else None

    def partial_start(self, text: str) -> int:
        """How many characters at text's end could begin a start marker (held back)."""
        longest = 0
        for start in self.starts:
            for k in range(min(len(start) - 1, len(text)), longest, -1):
                if start.startswith(text[-k:]):
                    longest = k
                    break
        return longest


class HermesFormat(ToolCallFormat):
    """Hermes, Qwen2.5, Qwen3 (and the generic prompt): `<tool_call>\\n{"name": ...,
    "arguments": {...}}\\n</tool_call>`, one block per call, anywhere in the text. A block's
    JSON may also be a list of calls, or several objects."""

    name = "hermes"
    starts = ("<tool_call>",)
    end = "</tool_call>"

    def parse_region(self, start: str, body: str) -> list[ParsedCall] | None:
        return _json_calls(body)


_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
# A parameter's value runs to its closing tag; Qwen3-Coder sometimes leaves that out, so the
# next parameter or the end of the function also ends it.
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.S)


class Qwen3CoderFormat(ToolCallFormat):
    """Qwen3-Coder's XML: `<tool_call>\\n<function=name>\\n<parameter=p>\\nvalue\\n</parameter>
    \\n</function>\\n</tool_call>`. The values are text: each is converted by its parameter's
    type in the tool's schema (a string stays a string; numbers, booleans, objects and arrays
    are read as JSON); a parameter the schema does not type stays a string."""

    name = "qwen3_coder"
    starts = ("<tool_call>",)
    end = "</tool_call>"

    def parse_region(self, start: str, body: str) -> list[ParsedCall] | None:
        calls, i = [], 0
        for match in _FUNCTION.finditer(body):
            if body[i:match.start()].strip():
                return None
            i = match.end()
            name = match.group(1).strip()
            arguments, j = {}, 0
            inner = match.group(2)
            for param in _PARAMETER.finditer(inner):
                if inner[j:param.start()].strip():
                    return None
                j = param.end()
                key = param.group(1).strip()
                raw = param.group(2).removeprefix("\n").removesuffix("\n")
                arguments[key] = self._convert(name, key, raw)
            if inner[j:].strip() or not name:
                return None
            calls.append((name, _dumps(arguments)))
        if body[i:].strip():
            return None
        return calls or None

    def _convert(self, function: str, parameter: str, raw: str) -> Any:
        schema = next((_function(t).get("parameters") or {} for t in self.tools
                       if _function(t).get("name") == function), {})
        spec = (schema.get("properties") or {}).get(parameter) or {}
        types = spec.get("type", [])
        types = [types] if isinstance(types, str) else list(types)
        if not types or "string" in types:
            return raw
        if raw.strip() == "null" and "null" in types:
            return None
        try:
            return _JSON.decode(raw)
        except ValueError:
            return raw


class Llama3JsonFormat(ToolCallFormat):
    """Llama 3.1-3.3's JSON calls: the whole output is `{"name": ..., "parameters": {...}}`
    (several apart by `;` or new lines), optionally after `<|python_tag|>`. Only at the start
    of the output: a JSON object after some text is content (a user may ask for JSON)."""

    name = "llama3_json"
    starts = ("<|python_tag|>", "{")
    end = None
    only_at_start = True

    def parse_region(self, start: str, body: str) -> list[ParsedCall] | None:
        text = body if start == "<|python_tag|>" else start + body
        return _json_calls(text, separators=";,")


class MistralFormat(ToolCallFormat):
    """Mistral's `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (v3 tokenizers), and
    the later `[TOOL_CALLS]name[ARGS]{...}` (one marker per call), to the end of the output."""

    name = "mistral"
    starts = ("[TOOL_CALLS]",)
    end = None

    def parse_region(self, start: str, body: str) -> list[ParsedCall] | None:
        if body.lstrip().startswith(("[", "{")):
            return _json_calls(body)
        calls = []
        for part in body.split(start):
            name, marker, arguments = part.partition("[ARGS]")
            name = name.strip()
            values = _json_values(arguments) if marker else None
            if not name or not values or len(values) != 1 or not isinstance(values[0], dict):
                return None
            calls.append((name, _dumps(values[0])))
        return calls


_ESCAPE = "<escape>"
_FUNCTION_GEMMA_CALL = re.compile(r"\s*call:([^{}\s]+)(\{.*\})\s*", re.S)
_BARE_VALUE = re.compile(r"[^,{}\[\]]*")


def _gemma_value(text: str, i: int) -> tuple[Any, int]:
    """FunctionGemma's value at text[i] and the index after it; ValueError where there is
    none. A string sits between `<escape>` markers (or is a bare word that is no number,
    boolean or null: small models leave the markers out); objects are `{key:value,...}` with
    bare keys, lists `[value,...]`."""
    if text.startswith(_ESCAPE, i):
        end = text.find(_ESCAPE, i + len(_ESCAPE))
        if end < 0:
            raise ValueError("a string without its closing <escape>")
        return text[i + len(_ESCAPE):end], end + len(_ESCAPE)
    if text.startswith("{", i) or text.startswith("[", i):
        is_object, close = text[i] == "{", "}" if text[i] == "{" else "]"
        items: Any = {} if is_object else []
        i += 1
        while not text.startswith(close, i):
            if is_object:
                colon = text.find(":", i)
                key = text[i:colon] if colon > i else ""
                if not key or any(c in key for c in "{}[],<>"):
                    raise ValueError("an object key")
                items[key], i = _gemma_value(text, colon + 1)
            else:
                value, i = _gemma_value(text, i)
                items.append(value)
            if text.startswith(",", i):
                i += 1
            elif not text.startswith(close, i):
                raise ValueError(f"no {close!r}")
        return items, i + 1
    word = _BARE_VALUE.match(text, i).group()
    if not word.strip():
        raise ValueError("an empty value")
    try:
        return _JSON.decode(word.strip()), i + len(word)
    except ValueError:
        return word.strip(), i + len(word)


class FunctionGemmaFormat(ToolCallFormat):
    """FunctionGemma's (Gemma 3 270M tuned for calls; its template declares the tools between
    `<start_function_declaration>` markers): `<start_function_call>call:get_weather{city:
    <escape>Paris<escape>,days:3}<end_function_call>`, one block per call; the values as
    `_gemma_value` reads them."""

    name = "functiongemma"
    starts = ("<start_function_call>",)
    end = "<end_function_call>"

    def parse_region(self, start: str, body: str) -> list[ParsedCall] | None:
        match = _FUNCTION_GEMMA_CALL.fullmatch(body)
        if match is None:
            return None
        try:
            arguments, end = _gemma_value(match.group(2), 0)
        except ValueError:
            return None
        if end != len(match.group(2)):
            return None
        return [(match.group(1), _dumps(arguments))]


TOOL_FORMATS: dict[str, type[ToolCallFormat]] = {
    cls.name: cls for cls in (HermesFormat, Qwen3CoderFormat, Llama3JsonFormat, MistralFormat,
                              FunctionGemmaFormat)}


def select_tool_format(tokenizer: Any = None, *, chat_template: str | None = None,
                       architecture: str | None = None,
                       tools: Sequence[dict] | None = None) -> ToolCallFormat:
    """The format the model writes its calls in, from its chat template (given, or the
    tokenizer's), its special tokens and its architecture (a GGUF's `general.architecture`
    or a config's `model_type`). Where the template takes no tools the generic prompt asked
    for Hermes calls, so Hermes it is; Hermes is also the default."""
    template = chat_template if chat_template is not None else template_text(tokenizer, tools)
    if not template_takes_tools(template):
        return HermesFormat(tools)
    vocab = _special_tokens(tokenizer)
    architecture = (architecture or "").lower()
    if "<function=" in template and "<parameter=" in template:
        return Qwen3CoderFormat(tools)
    if "[TOOL_CALLS]" in template:
        return MistralFormat(tools)
    if "<start_function_call>" in template or "<start_function_call>" in vocab:
        return FunctionGemmaFormat(tools)
    if "<tool_call>" in template:
        return HermesFormat(tools)
    if "<|python_tag|>" in template or "ipython" in template:
        return Llama3JsonFormat(tools)
    if "[TOOL_CALLS]" in vocab or architecture.startswith(("mistral", "mixtral")):
        return MistralFormat(tools)
    if "<|python_tag|>" in vocab:
        return Llama3JsonFormat(tools)
    return HermesFormat(tools)


def _special_tokens(tokenizer: Any) -> set[str]:
    if tokenizer is None:
        return set()
    tokens = set(getattr(tokenizer, "all_special_tokens", []) or [])
    try:
        tokens |= set(tokenizer.get_added_vocab())
    except Exception:  # noqa: BLE001 - a tokenizer without added vocab: the special ones do
        pass
    return tokens


# --- streaming -------------------------------------------------------------------------------


class ToolCallStream:
    """Text pieces in, OpenAI `delta`s out: `{"content": ...}` for the text outside calls,
    and for each call `{"tool_calls": [{"index", "id", "type": "function", "function":
    {"name", "arguments": ""}}]}` then `{"tool_calls": [{"index", "function": {"arguments"}}]}`.

    Held back until the next piece decides: the end of the text that could begin a start
    marker, a call until its end marker (or the end of the output), and trailing whitespace
    (dropped where a call follows it). `called` says whether any call was emitted
    (finish_reason "tool_calls")."""

    def __init__(self, fmt: ToolCallFormat, call_id: Callable[[], str] = new_call_id) -> None:
        self.fmt = fmt
        self.call_id = call_id
        self.calls = 0
        self._buffer = ""  # text not yet decided
        self._start: str | None = None  # the start marker of the region open, if one is
        self._searched = 0  # how far the open region was searched for its end already
        self._whitespace = ""  # trailing whitespace of the content, held
        self._after_call = False  # drop the whitespace that follows a call
        self._content_seen = False  # any non-whitespace content out yet

    @property
    def called(self) -> bool:
        return self.calls > 0

    def feed(self, text: str) -> list[dict]:
        self._buffer += text
        out: list[dict] = []
        self._advance(out, final=False)
        return merge_text_deltas(out)

    def finish(self) -> list[dict]:
        """The end of the output: what was held back is decided (an open region is a call if
        its text is one, else content)."""
        out: list[dict] = []
        self._advance(out, final=True)
        if self._whitespace and not self._after_call:
            out.append({"content": self._whitespace})
            self._whitespace = ""
        return merge_text_deltas(out)

    def _advance(self, out: list[dict], final: bool) -> None:
        fmt = self.fmt
        while True:
            if self._start is None:
                searching = not (fmt.only_at_start and self._content_seen)
                hit = fmt.find_start(self._buffer) if searching else None
                if hit is not None:
                    index, start = hit
                    self._content(self._buffer[:index], out)
                    self._buffer = self._buffer[index:]
                    if fmt.only_at_start and self._content_seen:
                        continue  # text came before the marker: no call here after all
                    self._start, self._searched = start, 0
                    self._buffer = self._buffer[len(start):]
                    continue
                held = fmt.partial_start(self._buffer) if searching and not final else 0
                self._content(self._buffer[:len(self._buffer) - held], out)
                self._buffer = self._buffer[len(self._buffer) - held:]
                return
            if fmt.end is None:
                end = -1
            else:
                end = self._buffer.find(fmt.end, self._searched)
                self._searched = max(0, len(self._buffer) - len(fmt.end) + 1)
            if end < 0 and not final:
                return
            body = self._buffer if end < 0 else self._buffer[:end]
            closing = "" if end < 0 else fmt.end
            self._buffer = self._buffer[len(body) + len(closing):]
            start, self._start = self._start, None
            self._region(start, body, closing, out)

    def _region(self, start: str, body: str, closing: str, out: list[dict]) -> None:
        try:
            calls = self.fmt.parse_region(start, body)
        except Exception:  # noqa: BLE001 - a parser's slip on odd text: the text is content
            calls = None
        if not calls:
            self._content(start + body + closing, out, raw=True)
            return
        self._whitespace = ""  # the whitespace before a call is no content
        for name, arguments in calls:
            index, self.calls = self.calls, self.calls + 1
            out.append({"tool_calls": [{"index": index, "id": self.call_id(),
                                        "type": "function",
                                        "function": {"name": name, "arguments": ""}}]})
            out.append({"tool_calls": [{"index": index, "function": {"arguments": arguments}}]})
        self._after_call = True

    def _content(self, text: str, out: list[dict], raw: bool = False) -> None:
        """Content out. Its trailing whitespace is held (dropped if a call follows it, or if
        it follows the last call and ends the output); whitespace after a call that opens the
        output is dropped. `raw`: a region that was no call, only ever content."""
        if self._after_call and not self._content_seen:
            text = text.lstrip()
        if not text:
            return
        text = self._whitespace + text
        kept = text.rstrip()
        self._whitespace = text[len(kept):]
        if kept:
            out.append({"content": kept})
            self._content_seen, self._after_call = True, False


def join_deltas(deltas: Iterable[dict]) -> tuple[str | None, list[dict]]:
    """Deltas joined as a client joins a stream: (content, tool calls). Content is None when
    there are calls and no text."""
    content: list[str] = []
    calls: list[dict] = []
    for delta in deltas:
        if delta.get("content"):
            content.append(delta["content"])
        for part in delta.get("tool_calls") or []:
            if part["index"] == len(calls):
                calls.append({"id": part.get("id"), "type": "function",
                              "function": {"name": "", "arguments": ""}})
            function = part.get("function") or {}
            calls[part["index"]]["function"]["name"] += function.get("name") or ""
            calls[part["index"]]["function"]["arguments"] += function.get("arguments") or ""
    text = "".join(content)
    return (text or None) if calls else text, calls


# --- constraint ------------------------------------------------------------------------------


def closed_objects(schema: Any) -> Any:
    """The schema with every object that lists its properties and says nothing of others
    taking no others (`additionalProperties: false`), in place; returned for convenience.

    Why: JSON Schema lets an object without `additionalProperties` hold any other key, and a
    small model under a call grammar then invents arguments the function does not take and
    nests them until `max_tokens` (seen with the default model on a one-argument tool). A
    function takes the arguments it names; llama.cpp's grammars read a schema the same way."""
    if isinstance(schema, list):
        for item in schema:
            closed_objects(item)
    if not isinstance(schema, dict):
        return schema
    if isinstance(schema.get("properties"), dict):
        schema.setdefault("additionalProperties", False)
        for value in schema["properties"].values():
            closed_objects(value)
    for key in ("items", "prefixItems", "anyOf", "oneOf", "allOf", "additionalProperties",
                "not", "if", "then", "else"):
        closed_objects(schema.get(key))
    for key in ("$defs", "definitions"):
        for value in (schema.get(key) or {}).values():
            closed_objects(value)
    return schema


# values that are data, not schemas: a "$ref" key inside them is not a reference
_DATA_KEYWORDS = ("const", "enum", "default", "examples")


def _rebased(schema: Any, base: str) -> Any:
    """The schema with every local reference ("#", "#/$defs/x", ...) made to start at `base`,
    a JSON pointer to where the schema now sits inside a larger one; in place."""
    if isinstance(schema, list):
        for item in schema:
            _rebased(item, base)
    elif isinstance(schema, dict):
        ref = schema.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            schema["$ref"] = base + ref[1:]
        for key, value in schema.items():
            if key not in _DATA_KEYWORDS:
                _rebased(value, base)
    return schema


def _call_schema(tool: dict, key: str, defs: dict) -> dict:
    """One call of `tool`: its name, and its parameters (closed, see `closed_objects`) kept in
    the root's `defs[key]`, so that the references inside them ("#/$defs/...", as pydantic
    writes them) still resolve from there."""
    function = _function(tool)
    parameters = closed_objects(copy.deepcopy(function.get("parameters")
                                              or {"type": "object", "properties": {}}))
    defs[key] = _rebased(parameters, f"#/$defs/{key}")
    return {"type": "object",
            "properties": {"name": {"type": "string", "enum": [function["name"]]},
                           "arguments": {"$ref": f"#/$defs/{key}"}},
            "required": ["name", "arguments"],
            "additionalProperties": False}


def tool_call_schema(tools: Sequence[dict], tool_choice: Any = "required",
                     parallel: bool = False) -> dict:
    """A JSON schema of the call(s) `tool_choice` demands: for "required" one call of any of
    the tools, `{"name": <its name>, "arguments": <its parameters' schema>}` (anyOf over the
    tools), for a named function that one's only. parallel: a list of one or more such calls
    (the JSON-list form); for calls in Hermes markers use `tool_call_grammar`. Each tool's
    parameters sit in the root's `$defs` (as `tool0`, `tool1`, ...)."""
    name = chosen_function(tool_choice)
    if name is not None:
        chosen = [t for t in tools if _function(t).get("name") == name]
        if not chosen:
            raise RequestError(f"tool_choice names {json.dumps(name)}, which is not in tools",
                               param="tool_choice")
    elif tool_choice == "required":
        chosen = list(tools)
        if not chosen:
            raise RequestError('tool_choice "required" needs tools', param="tool_choice")
    else:
        raise RequestError('a tool call schema is for tool_choice "required" or a named '
                           "function", param="tool_choice")
    defs: dict[str, dict] = {}
    branches = [_call_schema(tool, f"tool{index}", defs) for index, tool in enumerate(chosen)]
    one = branches[0] if len(branches) == 1 else {"anyOf": branches}
    schema = {"type": "array", "items": one, "minItems": 1} if parallel else one
    return {**schema, "$defs": defs}


def tool_call_grammar(tools: Sequence[dict], tool_choice: Any = "required",
                      parallel: bool = False) -> str:
    """A Lark grammar (llguidance's dialect) of the call(s) in Hermes markers, the JSON inside
    by `tool_call_schema`: `<tool_call>\\n{...}\\n</tool_call>`, one block, or with parallel
    one or more apart by a new line. What `HermesFormat` parses back."""
    # one layout of the JSON (JSON_LAYOUT: ", " and ": ", no other white space): without it a
    # small model indents and pads a call with new lines until max_tokens (seen with the
    # default model: 160 tokens for `{"table": "employees"}`), and the separators are forced
    schema = json.dumps({**tool_call_schema(tools, tool_choice, parallel=False),
                         "x-guidance": JSON_LAYOUT})
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    return (f'{start}\n'
            'call: "<tool_call>\\n" arguments "\\n</tool_call>"\n'
            f'arguments: %json {schema}\n')
