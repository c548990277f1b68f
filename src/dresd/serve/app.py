"""The HTTP layer: FastAPI routes over the engine, OpenAI's formats, errors, one log line each.

    POST /v1/completions, /v1/chat/completions   whole responses, or server-sent events
    POST /v1/messages                            Anthropic's Messages API (anthropic.py)
    POST /reset_prefix_cache                     empty the prefix cache (vLLM's route)
    GET  /v1/models, /health, /metrics

A request is checked (fields, method, datastore, context) before it is queued, so bad input
costs the queue nothing and gets a 400; a full queue gets a 503. Errors are OpenAI's error
object and never carry a traceback; the log has one line per request (`RequestLog`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from time import perf_counter

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from dresd.decoding.constraint import Grammar, GrammarError, ThinkTokens
from dresd.drafters.prediction import prediction_tokens
from dresd.metrics import GenerationResult, TokenLogprob, summarize
from dresd.serve import anthropic, chat_output, protocol
from dresd.serve.auth import APIKeyCheck
from dresd.serve.chat_output import ChatParsers, thinks
from dresd.serve.engine import (
    WORKER_STOPPED,
    Engine,
    Job,
    Plan,
    RequestError,
    check_context,
    request_settings,
    tenant_salt,
)
from dresd.serve.harmony import HarmonyParser, is_harmony
from dresd.serve.limits import BodyLimit, default_body_limit
from dresd.serve.metrics import ServerMetrics
from dresd.serve.reasoning import THINK_END, THINK_START, ReasoningParser, prompt_opens_think
from dresd.serve.tool_calls import HermesFormat, select_tool_format, tool_call_grammar

log = logging.getLogger("dresd.serve")

MESSAGES_PATH = "/v1/messages"  # Anthropic's Messages API
# `usage.prompt_tokens_details.cached_tokens` is rounded down to whole blocks of this many.
CACHED_TOKENS_BLOCK = 16
# How often a request waiting for its generation checks that its client is still there.
DISCONNECT_POLL_S = 0.25


def create_app(engine: Engine, model_name: str, model_aliases: tuple[str, ...] = (),
               api_key: str | Mapping[str, str] | None = None, metrics_open: bool = False,
               metrics: ServerMetrics | None = None,
               metrics_text: Callable[[], Awaitable[str]] | None = None,
               max_body_bytes: int | None = None) -> FastAPI:
    """The app over `engine`. `api_key`: every request but /health (and /metrics with
    `metrics_open`) must carry it (auth.py). `metrics` / `metrics_text`: where the figures are
    recorded and how /metrics renders them, when not this process's alone (a Ray Serve replica
    reports every replica's, ray_serve.py). `max_body_bytes`: larger bodies get 413 unread
    (default: `limits.default_body_limit` of the model's context)."""
    metrics = metrics if metrics is not None else ServerMetrics(model_name)

    def on_step(sequences: int, rows: int) -> None:
        metrics.record_step(sequences, rows)
        if engine.prefix_cache is not None:
            metrics.record_prefix_cache(engine.prefix_cache.stats)

    engine.on_step = on_step
    accepted_names = {model_name, *model_aliases}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        engine.stop()

    app = FastAPI(title="dresd", lifespan=lifespan)
    if api_key:  # added first, so it runs inside the request log: a refusal is logged too
        app.add_middleware(APIKeyCheck, api_key=api_key, metrics_open=metrics_open)
    app.add_middleware(BodyLimit, limit=max_body_bytes or default_body_limit(
        engine.target.max_length))  # before the key check: a refusal reads no body either
    app.add_middleware(RequestLog)

    # -- errors: OpenAI's error object, never a traceback --------------------------------

    def error(status: int, message: str, request: Request, param: str | None = None) -> Response:
        request.state.log.setdefault("error", message)
        if status >= 400 and request.url.path.startswith("/v1/"):
            metrics.record_rejected(status)
        if request.url.path == MESSAGES_PATH:  # Anthropic's clients read Anthropic's shape
            body = anthropic.error_body(protocol.error_body(message, status)["error"]["message"],
                                        status)
            return JSONResponse(body, status_code=status)
        return JSONResponse(protocol.error_body(message, status, param), status_code=status)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> Response:
        problems = []
        for problem in exc.errors():
            if problem.get("type") == "json_invalid":
                reason = (problem.get("ctx") or {}).get("error", "")
                problems.append(f"the body is not valid JSON ({reason})")
                continue
            where = ".".join(str(part) for part in problem.get("loc", ())[1:]) or "body"
            problems.append(f"{where}: {problem.get('msg', 'invalid')}")
        return error(400, "invalid request: " + "; ".join(problems), request)

    @app.exception_handler(RequestError)
    async def refused(request: Request, exc: RequestError) -> Response:
        return error(exc.status, str(exc), request, exc.param)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        return error(exc.status_code, str(exc.detail), request)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        return error(500, f"internal error ({type(exc).__name__})", request)

    # -- the routes ------------------------------------------------------------------------

    @app.get("/health")
    async def health() -> Response:
        """200 while the generation worker runs; 503 once it has died (the process exits
        next, for its supervisor to restart it)."""
        if not engine.healthy:
            return JSONResponse(protocol.error_body(WORKER_STOPPED, 503), status_code=503)
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": protocol.now(), "owned_by": "dresd",
            "max_model_len": engine.target.max_length, "methods": engine.methods,
            "datastores": engine.datastores}]}

    @app.get("/metrics")
    async def prometheus() -> Response:
        text = (await metrics_text() if metrics_text is not None
                else metrics.render(engine.running, engine.waiting))
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> dict:
        """Empty the caller's tenant's entries of the prefix cache (every entry on a server
        without tenants; entries running requests hold stay until they end); behind the API
        key like every route but /health."""
        freed = await asyncio.to_thread(engine.clear_prefix_cache, tenant_of(request))
        if engine.prefix_cache is not None:
            metrics.record_prefix_cache(engine.prefix_cache.stats)
        return {"freed_bytes": freed, "prefix_cache": engine.prefix_cache_line()}

    @app.post("/v1/completions")
    async def completions(body: protocol.CompletionRequest, request: Request) -> Response:
        return await serve(body, body.max_tokens, "text", request)

    @app.post("/v1/chat/completions")
    async def chat(body: protocol.ChatCompletionRequest, request: Request) -> Response:
        newer = body.max_completion_tokens  # OpenAI's newer name wins where both are given
        return await serve(body, newer if newer is not None else body.max_tokens, "chat",
                           request)

    @app.post(MESSAGES_PATH)
    async def messages(request: Request) -> Response:
        """Anthropic's Messages API: the request served as a chat request, the reply (or the
        stream) turned into Anthropic's shape (anthropic.py)."""
        try:
            raw = json.loads(await request.body())
        except ValueError as err:
            raise RequestError(f"the body is not valid JSON ({err})") from None
        try:
            body = protocol.ChatCompletionRequest.model_validate(anthropic.to_openai(raw))
        except ValidationError as err:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}"
                                 for e in err.errors())
            raise RequestError(f"invalid request: {problems}") from None
        reply = await serve(body, body.max_tokens, "chat", request)
        if isinstance(reply, StreamingResponse):
            return StreamingResponse(anthropic_events(reply), media_type="text/event-stream")
        if reply.status_code != 200:
            return reply
        return JSONResponse(anthropic.from_openai(json.loads(reply.body)))

    async def anthropic_events(reply: StreamingResponse) -> AsyncIterator[str]:
        stream = anthropic.MessageStream(model_name)
        async for piece in reply.body_iterator:
            text = piece if isinstance(piece, str) else piece.decode()
            for event in text.split("\n\n"):
                if event.startswith("data: {"):
                    for converted in stream.chunk(json.loads(event[len("data: "):])):
                        yield converted

    async def serve(body: protocol.GenerationFields, max_tokens: int | None, kind: str,
                    request: Request) -> Response:
        try:
            return await start(body, max_tokens, kind, request)
        except RequestError:
            raise
        except Exception as err:  # noqa: BLE001 - a message for the client, one line for the log
            request.state.log["error"] = f"internal error ({type(err).__name__}: {err})"
            return error(500, f"internal error ({type(err).__name__})", request)

    async def start(body: protocol.GenerationFields, max_tokens: int | None, kind: str,
                    request: Request) -> Response:
        """Check the request, queue it, and answer: a stream, or the whole response."""
        arrived = perf_counter()
        if body.model is not None and body.model not in accepted_names:
            raise RequestError(f"the model `{body.model}` does not exist", status=404,
                               param="model")
        body.check_supported()
        target = engine.target
        echo = isinstance(body, protocol.CompletionRequest) and body.echo_wanted()
        only_prompt = echo and max_tokens == 0  # the prompt's logprobs and nothing more
        if only_prompt:
            max_tokens = 1  # (one token is generated, and left out of the reply)
        settings = request_settings(engine.defaults, max_tokens, body.temperature, body.top_p,
                                    body.top_k, body.seed, body.stop_strings(), body.min_p)
        penalties = body.penalties(vocab_size(target))
        logprobs = body.logprobs_wanted()
        engine.check_room(body.n)  # a full queue costs no tokenization
        # Off the event loop: a long prompt's tokenization, or a large schema's compilation,
        # must not hold other requests
        prompt_ids = await asyncio.to_thread(tokenize, body, target.tokenizer)
        grammar = await asyncio.to_thread(request_grammar, body, target, prompt_ids)
        predicted = body.prediction_text()
        prediction = (None if predicted is None else
                      target.tokenizer(predicted, add_special_tokens=False)["input_ids"])
        settings = check_context(target, prompt_ids, settings, max_tokens is not None)
        kv_bytes = engine.check_kv(len(prompt_ids), settings.max_new_tokens, body.n)
        tenant = tenant_of(request)
        plan = engine.plan(body.method, body.datastore, body.drafter_options(), settings,
                           tenant)
        jobs = choice_jobs(prompt_ids, plan, body.n, tenant_salt(tenant, body.cache_salt or ""),
                           logprobs)
        for job in jobs:
            job.kv_bytes, job.grammar, job.prediction = kv_bytes, grammar, prediction
            job.penalties = penalties
            job.prompt_logprobs = logprobs if echo else None
        engine.submit(*jobs)
        request.state.log.update(method=plan.method, prompt_tokens=len(prompt_ids))
        if tenant:
            request.state.log["tenant"] = tenant
        if body.ignored_fields():  # as JSON strings: a field name cannot forge a log line
            request.state.log["ignored"] = ",".join(json.dumps(name)
                                                    for name in body.ignored_fields())
        make_parsers = chat_parsers(body, target.tokenizer, prompt_ids)
        echoed = (Echo(body.prompt_text(target.tokenizer, prompt_ids), prompt_ids, only_prompt)
                  if echo else None)
        runs = [Generation(job, target.tokenizer, settings.stop_strings, request, metrics,
                           arrived, index, alive=lambda: engine.healthy,
                           parsers=make_parsers() if make_parsers else None, echo=echoed)
                for index, job in enumerate(jobs)]
        choices = Choices(runs, request, protocol.new_id("chatcmpl" if kind == "chat"
                                                         else "cmpl"))
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(choices.sse(kind, model_name, include_usage),
                                     media_type="text/event-stream")
        return await choices.whole(kind, model_name)

    return app


def chat_parsers(body: protocol.GenerationFields, tokenizer: PreTrainedTokenizerBase,
                 prompt_ids: list[int]) -> Callable[[], ChatParsers | HarmonyParser] | None:
    """What makes each chat choice's parsers (chat_output.py): the think block split off for
    a model that thinks, tool calls parsed for a request with tools, gpt-oss's harmony
    messages split into both (harmony.py); None: the text as it is."""
    if not isinstance(body, protocol.ChatCompletionRequest):
        return None
    tools = body.tools if body.tools and body.tool_choice != "none" else None
    if is_harmony(tokenizer):
        return lambda: HarmonyParser(tools)
    calls = select_tool_format(tokenizer, tools=tools) if tools else None
    think = think_tokens(tokenizer, prompt_ids)
    if not (calls or think):
        return None
    return lambda: ChatParsers(ReasoningParser(think.starts_inside) if think else None, calls)


def think_tokens(tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int]) -> ThinkTokens | None:
    """A reasoning model's think block (`<think>` and `</think>`, each a token of its own) and
    whether the chat prompt left it open; None for a model that does not think."""
    added = tokenizer.get_added_vocab() if thinks(tokenizer) else {}
    if THINK_START not in added or THINK_END not in added:
        return None
    return ThinkTokens(added[THINK_START], added[THINK_END], prompt_opens_think(
        tokenizer.decode(prompt_ids, skip_special_tokens=False)))


def tool_choice_grammar(body: protocol.ChatCompletionRequest,
                        tokenizer: PreTrainedTokenizerBase) -> tuple[str, object] | None:
    """(kind, spec) of the grammar `tool_choice: "required"` or a named function demands: the
    call in Hermes markers, its JSON by the tool's parameters (tool_calls.py); None for
    "auto" and "none"."""
    if not body.tools or body.tool_choice in (None, "auto", "none"):
        return None
    if is_harmony(tokenizer) or not isinstance(select_tool_format(tokenizer, tools=body.tools),
                                               HermesFormat):
        raise RequestError("tool_choice \"required\" or a named function is enforced by a "
                           "grammar for models that write Hermes-style <tool_call> blocks; "
                           "this model writes another format: use \"auto\"",
                           param="tool_choice")
    return "lark", tool_call_grammar(body.tools, body.tool_choice, body.parallel_tool_calls)


def request_grammar(body: protocol.GenerationFields, target,
                    prompt_ids: list[int]) -> Grammar | None:
    """The grammar the request's output must follow (`response_format` or the like, or a
    required tool call), compiled for the model's tokenizer; a grammar that does not compile
    is a 400 naming its field. A chat with a reasoning model: the grammar holds the answer,
    from the end of the think block (constraint.AfterThinking)."""
    spec = body.grammar_spec()
    field = next((name for name in protocol.GRAMMAR_FIELDS if getattr(body, name) is not None),
                 None)
    if isinstance(body, protocol.ChatCompletionRequest):
        calls = tool_choice_grammar(body, target.tokenizer)
        if calls is not None and spec is not None:
            raise RequestError(f"a required tool call and {field} cannot both constrain the "
                               "output", param="tool_choice")
        if calls is not None:
            spec, field = calls, "tool_choice"
    if spec is None:
        return None
    try:
        grammar = Grammar.compile(*spec, target.tokenizer, vocab_size(target))
    except GrammarError as err:
        raise RequestError(str(err), param=field) from None
    if isinstance(body, protocol.ChatCompletionRequest):
        grammar = dataclasses.replace(grammar, think=think_tokens(target.tokenizer, prompt_ids))
    return grammar


def vocab_size(target) -> int:
    """The model's logits width."""
    config = target.model.config
    return (getattr(config, "text_config", None) or config).vocab_size


def tenant_of(request: Request) -> str:
    """The tenant whose key the request carried (auth.py), "" on a server without tenants."""
    return getattr(request.state, "tenant", "")


def tokenize(body: protocol.GenerationFields, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The request's prompt as token ids; a prompt or a chat template that fails on it (a
    template that raises on the roles given, text the tokenizer cannot encode) is the
    request's fault: a 400 that says why, never a 500."""
    try:
        return body.prompt_ids(tokenizer)
    except RequestError:
        raise
    except Exception as err:  # noqa: BLE001 - jinja2's, the tokenizer's: all the input's
        param = "messages" if isinstance(body, protocol.ChatCompletionRequest) else "prompt"
        raise RequestError(f"the {param} could not be turned into tokens "
                           f"({type(err).__name__}: {err})", param=param) from None


def choice_jobs(prompt_ids: list[int], plan: Plan, n: int, cache_salt: str,
                logprobs: int | None) -> list[Job]:
    """The jobs of a request's `n` choices. Each after the first reads the prompt's keys from
    the prefix cache once the first has prefilled it; a seeded sample's choice i draws with
    seed + i (the first with the seed itself: `n` = 1 is unchanged), so choices differ and each
    is reproducible."""
    loop = asyncio.get_running_loop()
    jobs: list[Job] = []
    for index in range(n):
        choice_plan = plan
        sampling = plan.settings.sampling
        if index and sampling is not None and sampling.seed is not None:
            seeded = dataclasses.replace(sampling, seed=sampling.seed + index)
            choice_plan = dataclasses.replace(
                plan, settings=dataclasses.replace(plan.settings, sampling=seeded))
        job = Job(prompt_ids, choice_plan, loop, cache_salt, logprobs)
        job.sibling_of = jobs[0] if jobs else None
        jobs.append(job)
    return jobs


class ClientGone(Exception):
    """The client closed the connection before its response was complete."""


@dataclasses.dataclass(frozen=True)
class Echo:
    """Completions' `echo`: the prompt's text and ids, given back before the completion;
    `only`: `max_tokens: 0`, the prompt alone (its logprobs are what the client wants)."""

    text: str
    ids: list[int]
    only: bool

    def text_of(self, completion: str) -> str:
        return self.text if self.only else self.text + completion

    def logprobs_of(self, run: Generation) -> dict | None:
        """The prompt's logprobs, then the completion's (every token: a client such as
        lm-evaluation-harness counts them by position)."""
        if run.job.logprobs is None:
            return None
        tokenizer = run.tokenizer
        body = protocol.echo_logprobs(self.ids, run.result.prompt_logprobs or [], tokenizer)
        if self.only:
            return body
        return protocol.join_logprobs(body, protocol.completion_logprobs(
            run.result.logprobs or [], tokenizer))


class Generation:
    """One generation (a request's choice) as the event loop sees it: the job's events,
    turned into text pieces and logprobs, with its figures recorded at the end."""

    def __init__(self, job: Job, tokenizer: PreTrainedTokenizerBase, stop: list[str],
                 request: Request, metrics: ServerMetrics, arrived: float,
                 index: int = 0, alive: Callable[[], bool] = lambda: True,
                 parsers: ChatParsers | HarmonyParser | None = None,
                 echo: Echo | None = None) -> None:
        self.job = job
        self.echo = echo  # the prompt to give back before the completion (completions' echo)
        self.parsers = parsers  # a chat choice's reasoning and tool call parsers, if any
        self.alive = alive  # whether the engine's worker still runs: else nothing will come
        self.request = request
        self.metrics = metrics
        self.arrived = arrived
        self.index = index  # its place among the request's choices
        self.pieces = protocol.IncrementalText(
            tokenizer, stop, parsers.marker_ids(tokenizer) if parsers else ())
        self.first_token_at: float | None = None
        self.result: GenerationResult | None = None
        self.tokenizer = tokenizer
        self.pending: list[TokenLogprob] = []  # logprobs of tokens not yet sent (streaming)
        self.text_offset = 0  # characters of the tokens whose logprobs were sent

    async def pieces_of_text(self) -> AsyncIterator[str]:
        """The text as the worker's events come in; ends with the finished text's last piece.
        A client that leaves (seen while waiting) cancels the generation."""
        checked = perf_counter()
        try:
            while True:
                try:
                    kind, payload = await asyncio.wait_for(self.job.events.get(),
                                                           DISCONNECT_POLL_S)
                except TimeoutError:
                    kind, payload = "", None
                # Checked by the clock, not only when idle: tokens may keep coming meanwhile.
                if perf_counter() - checked >= DISCONNECT_POLL_S:
                    checked = perf_counter()
                    if await self.request.is_disconnected():
                        raise ClientGone
                    if not kind and not self.alive():  # the worker died: no event will come
                        raise RequestError(WORKER_STOPPED, status=503)
                if kind == "tokens":
                    if self.first_token_at is None:
                        self.first_token_at = perf_counter()
                    tokens, entries = payload
                    self.pending.extend(entries or [])
                    piece = self.pieces.add(tokens)
                    if piece:
                        yield piece
                elif kind == "error":
                    raise payload
                elif kind == "done":
                    self.result = payload
                    piece = self.pieces.finish()
                    if piece:
                        yield piece
                    return
        finally:
            if self.result is None:
                self.job.cancelled.set()  # the loop stops at its next step

    def finish_reason(self) -> str:
        if self.parsers is not None and self.parsers.called:
            return "tool_calls"
        return protocol.finish_reason(self.result.stop_reason, self.pieces.stopped)

    def record(self) -> None:
        """The request's figures: into /metrics and its log line."""
        reason = self.finish_reason() if self.result else "abort"
        seconds = perf_counter() - self.arrived
        ttft = self.first_token_at - self.arrived if self.first_token_at else None
        self.metrics.record_finished(reason, len(self.job.prompt_ids), self.result, ttft, seconds)
        entry = self.request.state.log
        entry["finish"] = reason
        if self.result is not None:
            entry["tokens"] = len(self.result.token_ids)
            entry["cached"] = self.result.cached_tokens
            entry["forwards"] = self.result.num_target_forwards
        if ttft is not None:
            entry["ttft_ms"] = round(ttft * 1000)

    def logprobs(self, kind: str, entries: list[TokenLogprob]) -> dict | None:
        """The choice's `logprobs` for these tokens (special tokens such as the end of the
        sequence left out, as the text leaves them out), or None where none were asked for."""
        if self.job.logprobs is None:
            return None
        special = set(self.tokenizer.all_special_ids)
        entries = [entry for entry in entries if entry.token not in special]
        if kind == "chat":
            return protocol.chat_logprobs(entries, self.tokenizer)
        body = protocol.completion_logprobs(entries, self.tokenizer, self.text_offset)
        self.text_offset += sum(len(token) for token in body["tokens"])
        return body

    def sent_logprobs(self, kind: str) -> dict | None:
        """The logprobs of the tokens received since the last chunk (streaming)."""
        entries, self.pending = self.pending, []
        return self.logprobs(kind, entries)

    def figures(self) -> dict:
        figures = summarize([self.result])
        keys = ("num_target_forwards", "mean_accepted_length", "acceptance_rate",
                "tokens_per_s")
        return {"method": self.job.plan.method, **{key: figures[key] for key in keys}}


class Choices:
    """A request's `n` generations (one, unless it asked for more) answered as one response:
    whole, or one stream of chunks whose `index` says which choice each piece belongs to."""

    def __init__(self, runs: list[Generation], request: Request, request_id: str) -> None:
        self.runs = runs
        self.request = request
        self.request_id = request_id
        self.created = protocol.now()

    def usage(self) -> dict:
        """The prompt counted once (the choices share it), the completions summed."""
        first = self.runs[0].result
        # in whole blocks, as vLLM counts them: a count to the token would let a client learn
        # another's prompt (where they share a salt) one token at a time
        cached = first.cached_tokens // CACHED_TOKENS_BLOCK * CACHED_TOKENS_BLOCK
        prediction = self.runs[0].job.prediction
        counts = None
        if prediction is not None:  # summed over the choices, as completion_tokens is
            each = [prediction_tokens(prediction, run.result.token_ids) for run in self.runs]
            counts = (sum(a for a, _ in each), sum(r for _, r in each))
        completion = sum(len(run.result.token_ids) for run in self.runs
                         if run.echo is None or not run.echo.only)
        return protocol.usage(len(self.runs[0].job.prompt_ids), completion, cached, counts)

    def record(self) -> None:
        for run in self.runs:
            run.record()
        if len(self.runs) > 1:
            done = [run.result for run in self.runs if run.result is not None]
            self.request.state.log.update(n=len(self.runs), tokens=sum(
                len(result.token_ids) for result in done))

    async def whole(self, kind: str, model: str) -> Response:
        async def text(run: Generation) -> str:
            return "".join([piece async for piece in run.pieces_of_text()])

        tasks = [asyncio.ensure_future(text(run)) for run in self.runs]
        try:
            texts = await asyncio.gather(*tasks)
        except ClientGone:
            return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
        finally:
            for task in tasks:
                task.cancel()  # where one failed, the others stop too (their jobs cancelled)
            self.record()
        messages = [text if run.parsers is None else  # the parsers' message: calls, reasoning
                    chat_output.message([*run.parsers.feed(text), *run.parsers.finish()])
                    for run, text in zip(self.runs, texts, strict=True)]
        choices = [protocol.choice_body(kind, run.index, message, run.finish_reason(),
                                        run.logprobs(kind, run.result.logprobs or []))
                   if run.echo is None else
                   protocol.choice_body(kind, run.index, run.echo.text_of(message),
                                        "length" if run.echo.only else run.finish_reason(),
                                        run.echo.logprobs_of(run))
                   for run, message in zip(self.runs, messages, strict=True)]
        return JSONResponse(protocol.completion_body(
            kind, self.request_id, self.created, model, choices, self.usage(),
            self.runs[0].figures()))

    async def sse(self, kind: str, model: str, include_usage: bool) -> AsyncIterator[str]:
        """Server-sent events: OpenAI's chunks, then `data: [DONE]`. An error after the
        stream began is sent as an error event (the status line has gone already)."""
        def event(body: dict) -> str:
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        ids = (self.request_id, self.created, model)
        pieces: asyncio.Queue[tuple[Generation, str | None, Exception | None]] = asyncio.Queue()

        async def feed(run: Generation) -> None:
            try:
                async for piece in run.pieces_of_text():
                    await pieces.put((run, piece, None))
                await pieces.put((run, None, None))  # its end
            except Exception as err:  # noqa: BLE001 - raised where the stream is written
                await pieces.put((run, None, err))

        tasks = [asyncio.ensure_future(feed(run)) for run in self.runs]
        try:
            if kind == "chat":  # the assistant's role first, as OpenAI and vLLM send it
                for run in self.runs:
                    yield event(protocol.chunk_body(kind, *ids, "", None, first=True,
                                                    index=run.index))
            ended = 0
            while ended < len(self.runs):
                run, piece, failure = await pieces.get()
                if failure is not None:
                    raise failure
                if piece is not None:
                    for delta in [piece] if run.parsers is None else run.parsers.feed(piece):
                        yield event(protocol.chunk_body(kind, *ids, delta, None,
                                                        index=run.index,
                                                        logprobs=run.sent_logprobs(kind)))
                    continue
                for delta in run.parsers.finish() if run.parsers is not None else []:
                    yield event(protocol.chunk_body(kind, *ids, delta, None, index=run.index))
                ended += 1
                final = "" if kind == "text" else None
                yield event(protocol.chunk_body(kind, *ids, final, run.finish_reason(),
                                                index=run.index,
                                                logprobs=run.sent_logprobs(kind)))
            if include_usage:
                yield event(protocol.usage_chunk(kind, *ids, self.usage()))
        except ClientGone:
            return
        except RequestError as err:
            self.request.state.log["error"] = str(err)
            yield event(protocol.error_body(str(err), err.status, err.param))
        except Exception as err:  # noqa: BLE001 - the client gets a message, not a traceback
            self.request.state.log["error"] = f"internal error ({type(err).__name__}: {err})"
            yield event(protocol.error_body(f"internal error ({type(err).__name__})", 500))
        finally:
            for task in tasks:
                task.cancel()
            self.record()
        yield "data: [DONE]\n\n"


class RequestLog:
    """ASGI middleware: one log line per request, when its response has been sent, with what
    the handler noted in `request.state.log` (method, tokens, finish reason, error)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = perf_counter()
        entry: dict = {}
        scope.setdefault("state", {})["log"] = entry
        status = {"code": 500}

        async def send_noting_status(message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_noting_status)
        finally:
            client = scope.get("client") or ("-", 0)
            details = " ".join(f"{key}={value}" for key, value in entry.items()
                               if key != "error")
            if "error" in entry:
                details += f" error={json.dumps(entry['error'])}"
            log.info("%s:%s %s %s %d %.0fms %s", client[0], client[1], scope["method"],
                     scope["path"], status["code"], (perf_counter() - started) * 1000,
                     details.strip())
