"""The engine behind the server: one model, one worker thread, every request in one batch.

Continuous batching: requests wait in a bounded queue (`--max-queue`; a full queue is refused
with 503). The worker thread moves them into the batched loop (`decoding/batch.py`) as they
come, up to `--max-batch-size` running at once, and runs one step after another: every running
request's rows (a prompt chunk, or its draft tree) share one target forward. A request that
finishes leaves at once and a waiting one takes its place at the next step. Each generation is
still exactly what `dresd generate` computes for that prompt: the batched forward computes
every sequence's rows from that sequence alone (tested), and greedy decoding is deterministic.

The model and every datastore are loaded once, at start-up. Each method has one drafter built
from the command line's options; a request that asks for other drafter options (a different
tree shape) gets a copy of that drafter sharing its opened datastore.

Streaming: the loop calls back with the tokens each verify step accepts (`on_tokens`); the
worker hands them to the request's asyncio queue. A request whose client went away sets its
`cancelled` flag, and the worker takes it out of the batch before the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from dresd.calibrate import load_or_measure
from dresd.datastore.format import read_manifest
from dresd.datastore.sparse_store import kinds
from dresd.decoding.batch import BatchEngine, Request, Running
from dresd.decoding.budget import CostCurve
from dresd.decoding.constraint import Grammar
from dresd.decoding.kv_cache import INITIAL_CAPACITY
from dresd.decoding.prefix_cache import PrefixCache
from dresd.decoding.processing import Penalties
from dresd.decoding.sampling import sampling_or_greedy
from dresd.drafters import Drafter, NoDrafter, make_drafter
from dresd.drafters.prediction import with_prediction
from dresd.errors import UserError
from dresd.host import libc_function
from dresd.metrics import GenerationResult
from dresd.models.target import Target
from dresd.runner import AR, GenerationSettings, make_request

log = logging.getLogger("dresd.serve")
WORKER_STOPPED = ("the server's generation worker stopped; the server is restarting, try "
                  "again shortly")

# Drafter options a request may set, with the largest value taken: a bigger draft tree costs
# every queued request time (each verify forward grows with it), so absurd shapes are refused.
REQUEST_DRAFTER_OPTIONS: dict[str, int] = {
    "num_drafts": 64,
    "draft_len": 64,
    "max_tree_nodes": 512,
    "k": 1024,
    "max_ngram": 64,
    "min_ngram": 64,
    "max_suffix": 64,
    "min_suffix": 64,
    "max_matches": 100_000,
}

HEAP_TRIM_S = 10.0  # how often the server gives freed C heap back to the system
# Rows a draft tree may add to a sequence's cache beyond its prompt and output, in the KV budget.
TREE_ROWS = 64

# Methods whose drafter reads a datastore, and the part of the datastore it reads.
DATASTORE_METHODS = {"dresd": "dense", "rest": "sparse"}
# Methods that run without a datastore and read one when a request names it.
OPTIONAL_DATASTORE_METHODS = ("hybrid",)


class RequestError(UserError):
    """A request the server refuses; `status` is the HTTP status (400, 404, 503)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


@dataclass
class Plan:
    """What one request runs: a method, its drafter (None for `ar`) and the settings."""

    method: str
    drafter: Drafter | None
    settings: GenerationSettings


T = TypeVar("T")


def on_a_passing_thread(function: Callable[..., T], *args, **kwargs) -> T:
    """`function(*args, **kwargs)` run on a thread that ends when it returns (its exception
    raised here).

    Why: OpenMP (libgomp: PyTorch's and the C kernels') keeps a pool of threads for every thread
    that has run a parallel region, and once it manages more threads than there are CPUs it
    stops spinning between regions, so each of a forward's regions waits on a futex. Loading the
    model runs parallel regions; run on the main thread, its pool outlives the load beside the
    worker's. Measured at 2 threads on 2 cores: a served request decoded at 65 tokens/s against
    99 in-process; generating on a second thread after loading on the first made 99k context
    switches for 8 requests, against 605 on the loading thread itself. A pool ends with its
    thread."""
    with ThreadPoolExecutor(1, thread_name_prefix="dresd-load") as loader:  # joined on exit
        return loader.submit(function, *args, **kwargs).result()


class Job:
    """One queued request. The worker thread posts ("tokens", ([ids], [TokenLogprob] or None)),
    then ("done", result) or ("error", exception) to `events`, an asyncio queue read on the
    server's event loop."""

    def __init__(self, prompt_ids: list[int], plan: Plan, loop: asyncio.AbstractEventLoop,
                 cache_salt: str = "", logprobs: int | None = None) -> None:
        self.prompt_ids = prompt_ids
        self.plan = plan
        self.cache_salt = cache_salt  # prefix cache entries are shared within a salt only
        self.logprobs = logprobs  # alternatives per token to report; None: no logprobs
        self.result: GenerationResult | None = None  # the loop's, once it is in the batch
        self.posted = 0  # tokens posted so far
        # `n` > 1: the request's first choice, whose prompt this one reads from the prefix
        # cache once it is prefilled; and this one's place in the batch, for its siblings
        self.sibling_of: Job | None = None
        self.state: Running | None = None
        self.loop = loop
        self.events: asyncio.Queue[tuple[str, object]] = asyncio.Queue()
        self.cancelled = threading.Event()
        self.kv_bytes = 0  # the KV cache it may hold (`Engine.kv_need`)
        self.grammar: Grammar | None = None  # what its output must follow
        self.prediction: list[int] | None = None  # the output the client expects (drafted)
        self.penalties: Penalties | None = None  # its logit processing (processing.py)
        self.prompt_logprobs: int | None = None  # alternatives per prompt token (echo)

    def post(self, kind: str, payload: object) -> None:
        """From the worker thread: hand an event to the request's event loop."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # the event loop has closed: the server is shutting down
            self.cancelled.set()

    def on_tokens(self, tokens: list[int]) -> bool:
        """The loop's streaming callback: pass the step's tokens on; False stops the loop."""
        if tokens:
            kept = self.result.logprobs if self.result is not None else None
            entries = (None if kept is None
                       else kept[self.posted:self.posted + len(tokens)])
            self.posted += len(tokens)
            self.post("tokens", (list(tokens), entries))
        return not self.cancelled.is_set()


class Engine:
    """The loaded model and drafters, the request queue and the worker thread."""

    def __init__(
        self,
        target: Target,
        drafters: dict[tuple[str, str | None], Drafter],
        defaults: GenerationSettings,
        default_method: str,
        datastores: list[str],
        max_queue: int = 64,
        on_finished: Callable[[list[int], GenerationResult], None] | None = None,
        max_batch_size: int = 16,
        budget: bool = True,
        prefix_cache: PrefixCache | None = None,
        max_kv_bytes: int | None = None,
        tenants: Sequence[str] = (),
    ) -> None:
        """`max_kv_bytes`: the KV cache memory all running requests may hold together (None:
        no bound); a request that could never fit is refused (`check_kv`). `tenants`: the
        names of `--api-key-file`'s tenants, each with drafters that learn from its own
        outputs alone ("", no tenant: the drafters given)."""
        self.target = target
        # keys and values of prompts and answers, shared by every request (and kept when a
        # failed step replaces the batch: what it holds was committed by finished steps)
        self.prefix_cache = prefix_cache
        # (method, datastore name or None) -> the drafter built from the command line's options
        self.drafters = drafters
        self.tenant_drafters = {tenant: tenant_copies(target, drafters) for tenant in tenants}
        self.defaults = defaults
        self.default_method = default_method
        self.datastores = datastores  # names, the first is the default
        self.jobs: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self.max_batch_size = max_batch_size  # requests running in one batch at most
        # Each step's trees cut to what pays for its rows in the whole batch's forward, priced
        # by this machine's verify-cost curve (decoding/budget.py); off: trees as drafted.
        self.budget = budget
        self.cost = None
        if budget:
            curve = load_or_measure(target)
            self.cost = CostCurve(curve)
        self.running = 0  # requests in the batch now
        self.batch_waiting = 0  # admitted to the loop, waiting for room in the batch
        # called after every forward with its (requests, token rows): the server's metrics
        self.on_step: Callable[[int, int], None] | None = None
        self._worker: threading.Thread | None = None
        self.on_finished = on_finished  # called with (prompt ids, result) after each generation
        self._jobs: dict[int, tuple[Running, Job]] = {}  # in the batch: id(state) -> both
        self.dead: str | None = None  # why the worker died, once it has
        self.on_death: Callable[[], None] | None = None  # called once the worker has died
        # KV cache memory: every running request holds its whole buffer's worth from the start
        # (`kv_bytes`); a request that does not fit beside them waits, first come first served
        self.max_kv_bytes = max_kv_bytes
        self.kv_per_token = kv_bytes_per_token(target)
        self._held: Job | None = None  # taken from the queue, waiting for KV memory

    # -- building a request's plan --------------------------------------------------------

    @property
    def methods(self) -> list[str]:
        return [AR] + sorted({method for method, _ in self.drafters})

    def plan(
        self,
        method: str | None,
        datastore: str | None,
        options: dict[str, int],
        settings: GenerationSettings,
        tenant: str = "",
    ) -> Plan:
        """The method and drafter a request asked for, or a RequestError saying what is wrong.
        A tenant's drafter learns from that tenant's outputs only."""
        method = method or self.default_method
        if method == AR:
            if options:
                raise RequestError(f"method ar takes no drafter options (got {sorted(options)})")
            return Plan(AR, None, settings)
        store = None
        if method in DATASTORE_METHODS:
            part = DATASTORE_METHODS[method]
            having = [name for name in self.datastores if (method, name) in self.drafters]
            if not having:
                raise RequestError(f"method {method} needs a datastore with a {part} part; "
                                   "this server has none", param="method")
            store = datastore or having[0]
            if store not in self.datastores:
                raise RequestError(f"unknown datastore {store!r}; this server has "
                                   f"{', '.join(self.datastores)}", param="datastore")
            if store not in having:
                raise RequestError(f"datastore {store!r} has no {part} part for method "
                                   f"{method}", param="datastore")
        elif method in OPTIONAL_DATASTORE_METHODS and datastore is not None:
            if (method, datastore) not in self.drafters:
                raise RequestError(f"unknown datastore {datastore!r}; this server has "
                                   f"{', '.join(self.datastores) or 'none'}", param="datastore")
            store = datastore
        elif method not in self.methods:
            extra = " (start it with --draft-model)" if method == "draft" else ""
            raise RequestError(f"unknown method {method!r}; this server has "
                               f"{', '.join(self.methods)}{extra}", param="method")
        elif datastore is not None:
            raise RequestError(f"method {method} reads no datastore", param="datastore")
        base = self.tenant_drafters.get(tenant, self.drafters)[(method, store)]
        return Plan(method, drafter_variant(base, options), settings)

    # -- the queue and the worker ------------------------------------------------------------

    def start(self) -> None:
        self._worker = threading.Thread(target=self._work, name="dresd-generate", daemon=True)
        self._worker.start()
        trimmer = libc_function("malloc_trim")
        if trimmer is not None:
            threading.Thread(target=self._trim_heap, args=(trimmer,), name="dresd-trim",
                             daemon=True).start()

    def _trim_heap(self, trim: Callable[[int], int]) -> None:
        """Give the C heap's free pages back to the system every `HEAP_TRIM_S` while the worker
        lives. Why: a request's tensors come in every size (its KV buffer, its logits, its
        trees), and glibc keeps what they freed: a soak of fuzzed requests grew 2.03 -> 2.18 GB
        in 4 minutes without it, and stayed at 1.94-1.97 GB with it (RELIABILITY.md)."""
        while self.healthy and self._worker is not None and self._worker.is_alive():
            time.sleep(HEAP_TRIM_S)
            trim(0)

    def stop(self, timeout: float = 10.0) -> None:
        """Refuse what is queued, cancel what runs, then join the worker."""
        self._refuse_queued(RequestError("the server is shutting down", status=503))
        self.jobs.put(None)
        if self._worker is not None:
            self._worker.join(timeout)

    def check_room(self, count: int) -> None:
        """A 503 RequestError unless the worker runs and the queue has room for `count` jobs
        (checked before a request is tokenized, and again as it is queued)."""
        if not self.healthy:
            raise RequestError(WORKER_STOPPED, status=503)
        if self.jobs.maxsize - self.jobs.qsize() < count:
            raise RequestError(
                f"the server's queue is full ({self.jobs.maxsize} requests waiting); "
                "try again later", status=503)

    def submit(self, *jobs: Job) -> None:
        """Queue jobs (a request's `n` choices: all or none), or refuse them with 503 when
        `--max-queue` leaves no room for them all. Called on the event loop only."""
        self.check_room(len(jobs))
        for job in jobs:
            self.jobs.put_nowait(job)

    @property
    def waiting(self) -> int:
        return self.jobs.qsize() + self.batch_waiting + (self._held is not None)

    def kv_need(self, prompt_len: int, max_new_tokens: int) -> int:
        """The KV cache bytes one generation holds at most: its buffer grown to the prompt,
        the output and a draft tree's rows (`SequenceKV` doubles it as it grows)."""
        rows = max(INITIAL_CAPACITY, prompt_len + max_new_tokens + TREE_ROWS)
        return (1 << (rows - 1).bit_length()) * self.kv_per_token

    def check_kv(self, prompt_len: int, max_new_tokens: int, n: int) -> int:
        """Each choice's KV need; a RequestError where the request's `n` choices together could
        never fit in the server's KV memory."""
        need = self.kv_need(prompt_len, max_new_tokens)
        if self.max_kv_bytes is not None and n * need > self.max_kv_bytes:
            raise RequestError(
                f"this request needs {n * need / 2**20:.0f} MB of KV cache ({n} x "
                f"({prompt_len} prompt + {max_new_tokens} completion tokens)); this server "
                f"holds {self.max_kv_bytes / 2**20:.0f} MB (--max-kv-mb): ask for fewer "
                "max_tokens or choices", param="max_tokens")
        return need

    def _kv_fits(self, job: Job) -> bool:
        held = sum(running.kv_bytes for _, running in self._jobs.values())
        return self.max_kv_bytes is None or held + job.kv_bytes <= self.max_kv_bytes

    def request(self, job: Job) -> Request:
        """The batched loop's request for a job, as `dresd generate` makes it (`ar` is plain
        decoding on the same forward); its own drafter fork: sequences side by side keep
        their own per-generation state."""
        drafter = job.plan.drafter.fork() if job.plan.drafter else NoDrafter()
        if job.prediction:  # a draft source for every method, `ar` included
            drafter = with_prediction(drafter, job.prediction, len(job.prompt_ids))
        sibling = job.sibling_of.state if job.sibling_of is not None else None
        return make_request(self.target, job.prompt_ids, drafter, job.plan.settings,
                            on_tokens=job.on_tokens, budget=self.budget,
                            cache_salt=job.cache_salt, logprobs=job.logprobs,
                            prefill_after=sibling, penalties=job.penalties,
                            prompt_logprobs=job.prompt_logprobs,
                            constraint=job.grammar.start() if job.grammar else None)

    def batch(self) -> BatchEngine:
        return BatchEngine(self.target.model, max_batch_size=self.max_batch_size,
                           cost=self.cost, prefix_cache=self.prefix_cache)

    def prefix_cache_line(self) -> str:
        """The prefix cache's size and hit rate, for the log."""
        if self.prefix_cache is None:
            return "off"
        stats = self.prefix_cache.stats
        return (f"{stats.capacity_bytes / 2**20:.0f} MB, {stats.bytes / 2**20:.1f} MB held, "
                f"hit rate {stats.hit_rate:.1%} of {stats.queries} prompt tokens")

    def clear_prefix_cache(self, tenant: str = "") -> int:
        """Empty the prefix cache of a tenant's entries (all of them with no tenants), but what
        running requests hold; returns bytes freed."""
        if self.prefix_cache is None:
            return 0
        return self.prefix_cache.clear(tenant_salt(tenant, ""))

    def _work(self) -> None:
        """The worker thread: jobs through the batched loop until `stop()`. Every failure is
        kept to the jobs it concerns (`_serve`); if the thread dies anyway, nothing is left
        waiting on it (`_die`)."""
        try:
            self._serve()
        except BaseException as err:  # noqa: BLE001 - the end of the worker, whatever it was
            self._die(err)

    def _serve(self) -> None:
        batch = self.batch()
        jobs = self._jobs  # id(state) -> (state, job)
        while True:
            # 1. Take what was submitted while the batch has room (the rest waits in the
            #    bounded queue): wait for it when idle, else only what is there.
            while len(batch.running) + len(batch.waiting) < self.max_batch_size:
                try:
                    job, self._held = self._held or self.jobs.get(block=not batch.busy()), None
                except queue.Empty:
                    break
                if job is None:  # stop(): cancel what runs and leave
                    for state, running_job in jobs.values():
                        batch.cancel(state)
                        running_job.post("error", RequestError("the server is shutting down",
                                                               status=503))
                    jobs.clear()
                    return
                if job.cancelled.is_set():  # its client left while it waited
                    continue
                if jobs and not self._kv_fits(job):  # it waits, and every job after it
                    self._held = job
                    break
                try:
                    state = batch.add(self.request(job))
                except Exception as err:  # noqa: BLE001 - this job's failure, reported to it
                    job.post("error", err)
                    continue
                job.state, job.result = state, state.result
                jobs[id(state)] = (state, job)
            # 2. Requests whose clients left go now, before they cost a forward.
            for key, (state, job) in list(jobs.items()):
                if job.cancelled.is_set():
                    batch.cancel(state)
                    del jobs[key]
            # 3. One step for the whole batch. A sequence's own failure (its drafting,
            #    sampling, stopping, streaming) ends that sequence alone, inside the step;
            #    what escapes it failed the shared forward, which every running request was in.
            try:
                finished = batch.step()
            except Exception as err:  # noqa: BLE001 - reported to its requests; the worker lives on
                log.exception("a batched step failed; its %d requests fail with it", len(jobs))
                for state, job in jobs.values():
                    batch.cancel(state)
                    job.post("error", err)
                jobs.clear()
                batch = self.batch()
                finished = []
            self.running, self.batch_waiting = len(batch.running), len(batch.waiting)
            if self.on_step is not None and batch.last_step[0]:
                self._guarded("the step's metrics", self.on_step, *batch.last_step)
                batch.last_step = (0, 0)
            for state in finished:
                state, job = jobs.pop(id(state))
                if state.error is not None:
                    job.post("error", state.error)
                    continue
                if self.on_finished is not None:  # --save-outputs: a full disk fails no reply
                    self._guarded("saving an output", self.on_finished, job.prompt_ids,
                                  state.result)
                job.post("done", state.result)

    @staticmethod
    def _guarded(what: str, function: Callable[..., object], *args: object) -> None:
        """Run one of the server's own callbacks; its failure is logged, and the requests it
        was called for go on."""
        try:
            function(*args)
        except Exception:  # noqa: BLE001 - logged with its traceback
            log.exception("%s failed", what)

    def _die(self, err: BaseException) -> None:
        """The worker is ending on an error nothing caught: say so at once (/health answers
        503, `submit` refuses), answer every running and queued request 503 so that none waits
        forever, and call `on_death` (the server exits non-zero, so that its supervisor,
        systemd, Kubernetes or Ray, restarts it)."""
        self.dead = f"{type(err).__name__}: {err}"
        log.critical("the generation worker died (%s); failing every request", self.dead,
                     exc_info=err)
        failure = RequestError(WORKER_STOPPED, status=503)
        for _, job in self._jobs.values():
            job.post("error", failure)
        self._jobs.clear()
        if self._held is not None:
            self._held.post("error", failure)
        self._refuse_queued(failure)
        if self.on_death is not None:
            self.on_death()

    def _refuse_queued(self, failure: RequestError) -> None:
        """Answer every job still in the queue with `failure`; none will run."""
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job.cancelled.set()
                job.post("error", failure)

    @property
    def healthy(self) -> bool:
        """Whether the worker is running (or not started yet) and has not died."""
        return self.dead is None and (self._worker is None or self._worker.is_alive())


def kv_bytes_per_token(target: Target) -> int:
    """Bytes of keys and values a token takes in every layer's cache."""
    config = target.model.config
    config = getattr(config, "text_config", None) or config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * target.dtype.itemsize


def default_max_kv_bytes() -> int:
    """Half the memory available when the server starts: the rest is the model's, the
    prefix cache's and the system's."""
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    with contextlib.suppress(OSError, ValueError):  # MemAvailable counts reclaimable caches
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    return available // 2


def tenant_salt(tenant: str, cache_salt: str) -> str:
    """The prefix cache's salt of a request: its tenant's name and its own `cache_salt`, so
    that no two tenants share an entry whatever salts they send ("": no tenants)."""
    return f"{tenant}\x00{cache_salt}" if tenant else cache_salt


def tenant_copies(target: Target, drafters: dict[tuple[str, str | None], Drafter]
                  ) -> dict[tuple[str, str | None], Drafter]:
    """A tenant's drafters: its own copy of each that learns from finished outputs (suffix,
    hybrid, and dresd or rest with `--learn`), sharing the opened datastores; the others
    (learning nothing) shared."""
    copies = {}
    for key, drafter in drafters.items():
        if getattr(drafter, "learn", False) is False:
            copies[key] = drafter
            continue
        copies[key] = drafter.for_tenant()
        copies[key].check_target(target)
    return copies


def drafter_variant(base: Drafter, options: dict[str, int]) -> Drafter:
    """`base` with some options changed, sharing its opened datastore (`with_options`); a
    RequestError if an option does not apply to the drafter or has a value it refuses."""
    if not options:
        return base
    fields = {f.name for f in dataclasses.fields(base) if f.init}
    takes = sorted(key for key in REQUEST_DRAFTER_OPTIONS if key in fields)
    for key, value in options.items():
        if key not in takes:
            raise RequestError(f"option {key} does not apply to method {base.name}; it takes "
                               f"{', '.join(takes) or 'none'}", param=key)
        if not 1 <= value <= REQUEST_DRAFTER_OPTIONS[key]:
            raise RequestError(f"option {key} must be between 1 and "
                               f"{REQUEST_DRAFTER_OPTIONS[key]}, got {value}", param=key)
    try:
        return base.with_options(**options)
    except ValueError as err:
        raise RequestError(str(err)) from None


def load_drafters(
    target: Target,
    datastores: list[Path],
    options: dict,
    draft_model_options: dict | None = None,
) -> tuple[dict[tuple[str, str | None], Drafter], list[str]]:
    """Every drafter the server offers, built once: none, pld, suffix and hybrid always, draft
    with a draft model, dresd and rest for each datastore holding their part, and hybrid with
    each datastore. Suffix and hybrid learn from every request they serve. Returns them and
    the datastores' names (their folder names)."""
    drafters: dict[tuple[str, str | None], Drafter] = {
        ("none", None): make_drafter("none"),
        ("pld", None): make_drafter("pld", **options),
        ("suffix", None): make_drafter("suffix", **options),
        ("hybrid", None): make_drafter("hybrid", **{**options, "datastore": None}),
    }
    drafters[("hybrid", None)].check_target(target)  # its verify-cost curve, cached
    if draft_model_options is not None:
        drafters[("draft", None)] = make_drafter("draft", **options, **draft_model_options)
    names: list[str] = []
    for folder in datastores:
        name = folder.name
        if name in names:
            raise ValueError(f"two datastores are named {name!r}; a request names one by its "
                             "folder name, so give folders distinct names")
        names.append(name)
        parts = kinds(read_manifest(folder))
        for method, part in DATASTORE_METHODS.items():
            if part in parts:
                drafter = make_drafter(method, **{**options, "datastore": str(folder)})
                drafter.check_target(target)  # a store built for another model is refused
                drafters[(method, name)] = drafter
        hybrid = make_drafter("hybrid", **{**options, "datastore": str(folder)})
        hybrid.check_target(target)
        drafters[("hybrid", name)] = hybrid
    return drafters, names


# A request's own limits, as OpenAI's API sets them: at most 4 stop strings; each bounded too,
# since every emitted token is checked against every stop string's window of text.
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256
# Seeds are 64-bit signed integers (vLLM's range); each of `n` choices adds its index, which
# stays within the 64 bits torch's generators take.
SEED_RANGE = (-(2**63), 2**63 - 1)


def request_settings(
    defaults: GenerationSettings,
    max_tokens: int | None,
    temperature: float | None,
    top_p: float | None,
    top_k: int | None,
    seed: int | None,
    stop: list[str],
    min_p: float | None = None,
) -> GenerationSettings:
    """A request's generation settings: its own fields, else the command line's defaults.
    Temperature 0 (or below `GREEDY_BELOW`) is greedy, and then top_p / top_k / seed do not
    matter (as in vLLM)."""
    base = defaults.sampling
    temperature = temperature if temperature is not None else (base.temperature if base else 0.0)
    if seed is not None and not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise RequestError(f"seed must be a 64-bit signed integer (from {SEED_RANGE[0]} to "
                           f"{SEED_RANGE[1]}), got {seed}", param="seed")
    if len(stop) > MAX_STOP_STRINGS:
        raise RequestError(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stop)}",
                           param="stop")
    if any(len(string) > MAX_STOP_CHARS for string in stop):
        raise RequestError(f"each stop string has at most {MAX_STOP_CHARS} characters",
                           param="stop")
    try:
        sampling = sampling_or_greedy(
            temperature,
            top_k=top_k if top_k is not None else (base.top_k if base else 0),
            top_p=top_p if top_p is not None else (base.top_p if base else 1.0),
            seed=seed if seed is not None else (base.seed if base else None),
            min_p=min_p if min_p is not None else (base.min_p if base else 0.0))
    except UserError as err:  # "temperature must ...", "top_p must ...": the field first
        raise RequestError(str(err), param=str(err).split(" ", 1)[0]) from None
    if max_tokens is not None and max_tokens < 1:
        raise RequestError(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    return GenerationSettings(
        max_new_tokens=max_tokens if max_tokens is not None else defaults.max_new_tokens,
        sampling=sampling,
        stop_strings=stop or list(defaults.stop_strings),
    )


def check_context(target: Target, prompt_ids: list[int], settings: GenerationSettings,
                  max_tokens_given: bool) -> GenerationSettings:
    """Refuse a prompt that does not fit the context, and (as vLLM does) a `max_tokens` that
    would run past it; without `max_tokens` the default is cut to the room left."""
    limit = target.max_length
    if limit is None:
        return settings
    if len(prompt_ids) >= limit:
        raise RequestError(f"the prompt has {len(prompt_ids)} tokens; this model's maximum "
                           f"context length is {limit} tokens")
    room = limit - len(prompt_ids)
    if settings.max_new_tokens <= room:
        return settings
    if max_tokens_given:
        raise RequestError(
            f"this model's maximum context length is {limit} tokens; you requested "
            f"{len(prompt_ids) + settings.max_new_tokens} tokens ({len(prompt_ids)} in the "
            f"prompt, {settings.max_new_tokens} in the completion)", param="max_tokens")
    return dataclasses.replace(settings, max_new_tokens=room)
