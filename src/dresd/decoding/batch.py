"""The speculative loop over many sequences at once: one target forward per step for all.

    admit waiting requests (up to `max_batch_size` running)
    loop, one step:
      1. every running sequence contributes its rows: a prompt chunk while it prefills (as
         many chunks as fit in `prefill_chunk` x `prefill_chunks_per_step` rows, the first
         always), else its drafter's drafts after its last token, merged into a token tree
      2. one forward over every sequence's rows (`decoding/forward.py`): each row sees its own
         sequence's cache and its own ancestors
      3. per sequence: a prompt's last chunk gives the first token; a tree gives the longest
         path the target agrees with, plus one token of its own
      4. per sequence: keep only the accepted path in its cache; the hidden state of the last
         accepted node is its drafter's next query
      5. emit the new tokens one by one, stopping where plain decoding would; a finished or
         cancelled sequence leaves, and a waiting one takes its place at the next step

Single-stream generation is the batch of one (`generate.speculative_generate`).

Exactness, batched: the forward computes every row from its own sequence alone (see
forward.py), acceptance reads only its own sequence's logits, and a sampled sequence draws
from its own generator; so a sequence's output is the same whatever shares its forwards and
whenever it arrived. Prompt chunks start at fixed multiples of `prefill_chunk`, never where the
load puts them, so a prompt's cache is computed the same way in any batch.

With a prefix cache (`decoding/prefix_cache.py`): when a request's first chunk is due, the
longest cached prefix of its prompt (at most all but its last token, so the first token always
comes from a row computed now) is copied into its KV buffer and its prefill starts after it.
Its prompt's rows are cached once prefilled, and everything it committed when it ends. Exact
where the forward's rows are row-invariant (the C decoder: `decoding/forward.py`): a cached
row is the bits a fresh prefill of the same tokens writes, so hits change no output.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from dresd.decoding.budget import (
    AcceptanceEstimates,
    DraftingLedger,
    batch_budget,
    restrict,
)
from dresd.decoding.constraint import Constraint, constrain_drafts, forced_nodes
from dresd.decoding.drafter import DraftContext, Drafter
from dresd.decoding.forward import (
    HFForward,
    LlamaForward,
    Segment,
    SegmentOutput,
    make_forward,
    supports_tree_attention,
)
from dresd.decoding.prefix_cache import Hit, PrefixCache
from dresd.decoding.processing import NodeLogits, Penalties
from dresd.decoding.sampling import SamplingConfig, next_token_probs, sample, token_logprobs
from dresd.decoding.stopping import StoppingRule
from dresd.decoding.tree import DraftTree
from dresd.decoding.verify import greedy_accept, sampling_accept
from dresd.device import clock
from dresd.metrics import GenerationResult, StepRecord

PREFILL_CHUNK = 512  # prompt tokens per chunk; a chunk rides in one step beside the others


@dataclass
class Request:
    """One generation: a prompt, the drafter that drafts for it, and when it stops."""

    prompt: Sequence[int]
    drafter: Drafter
    max_new_tokens: int = 128
    sampling: SamplingConfig | None = None  # None: greedy
    eos_token_ids: Sequence[int] = ()
    stop_strings: Sequence[str] = ()
    tokenizer: PreTrainedTokenizerBase | None = None  # needed for stop strings
    max_length: int | None = None  # prompt + output at most (the model's context)
    # Gets each step's emitted tokens as they are accepted (streaming); returning False
    # cancels the generation there (stop reason "cancelled").
    on_tokens: Callable[[list[int]], bool | None] | None = None
    # Greedy only: keep the two best logits behind every emitted token (result.top2_logits),
    # so that another method's divergence from this output can be told a near-tie or not.
    record_top2: bool = False
    # Keep each emitted token's log-probability and this many alternatives (result.logprobs),
    # from the logits row that chose it; None: none.
    logprobs: int | None = None
    # Cut its trees to the nodes that pay for their rows in the step's forward (`budget.py`),
    # where the engine has a cost curve; False: verify them as drafted (a fixed shape).
    budget: bool = True
    # Requests share prefix cache entries only with requests of the same salt (a tenant's
    # prompts cannot be timed by another tenant).
    cache_salt: str = ""
    # Another request with the same prompt (a sibling of `n` > 1): this one's prefill waits
    # until that one's prompt is in the prefix cache, then reads all but its last token there.
    prefill_after: Running | None = None
    # A grammar the output must follow (`constraint.py`): this sequence's own state of it.
    constraint: Constraint | None = None
    # Penalties and a logit bias (`processing.py`), each tree node's by its own path.
    penalties: Penalties | None = None
    # Keep each prompt token's log-probability (after the first) and this many alternatives
    # (result.prompt_logprobs): every prompt row is computed, none read from the prefix cache.
    prompt_logprobs: int | None = None


@dataclass
class Running:
    """A request's state while it is in the batch."""

    request: Request
    cache: object  # its KV cache (the forward's handle)
    context: np.ndarray  # prompt + output; the cache holds all but the last of its `n` tokens
    n: int
    stopping: StoppingRule
    generator: torch.Generator | None
    result: GenerationResult
    started: float
    prefilled: int = 0  # prompt tokens in the cache so far
    query: torch.Tensor | None = None  # the hidden state that predicted the last token
    recent: torch.Tensor | None = None  # [k, d]: the states the last step kept, ending in query
    tree: DraftTree | None = None  # this step's tree
    drafted_tree: DraftTree | None = None  # the tree as drafted, before the budget cut it
    draft_seconds: float = 0.0
    drafted: bool = False  # whether its drafter was consulted this step
    states: list[torch.Tensor] = field(default_factory=list)  # for a drafter that learns
    error: Exception | None = None  # what ended it, where its drafter failed
    looked_up: bool = False  # whether the prefix cache was asked for its prompt
    hold: Hit | None = None  # its lock on the prefix cache's entries of its own tokens
    forced: set[int] = field(default_factory=set)  # tree nodes its grammar forces (kept)

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt)

    @property
    def prefilling(self) -> bool:
        return self.prefilled < self.prompt_len


class BatchEngine:
    """Runs many requests through one model, one forward per step for all of them."""

    def __init__(self, model: PreTrainedModel, max_batch_size: int = 16,
                 prefill_chunk: int = PREFILL_CHUNK, prefill_chunks_per_step: int = 1,
                 cost: Callable[[int], float] | None = None,
                 prefix_cache: PrefixCache | None = None) -> None:
        """`cost(rows)`: a forward's cost in one-token steps (`calibrate.py`); given, every
        request that takes the budget has its tree cut to what pays (`budget.py`); None:
        trees are verified as drafted. `prefix_cache`: keys and values shared across
        requests (several engines of one model may share one); used on the batched Llama
        forward, whose sequences are `SequenceKV` buffers."""
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        self.forward = make_forward(model)
        self.device = next(model.parameters()).device
        # dresd's own forwards build each segment's tree mask; transformers' is checked
        self.tree_attention = (not isinstance(self.forward, HFForward)
                               or supports_tree_attention(model))
        self.max_batch_size = max_batch_size
        self.prefill_chunk = prefill_chunk
        self.prefill_chunks_per_step = prefill_chunks_per_step
        self.waiting: deque[Running] = deque()
        self.running: list[Running] = []
        self.steps = 0  # forwards run so far
        self.last_step = (0, 0)  # (sequences, rows) of the last forward
        # (tokens emitted, seconds) of the last step, drafting included: what one sequence's
        # drafting time is weighed against under load (`DraftContext.batch_seconds`)
        self.last_step_output = (0, 0.0)
        # Finished generations' `Drafter.observe`, waiting for the next forward to run beside
        # it on one worker thread: the forward releases the GIL, so it takes a core the forward
        # leaves free (learning an output can cost milliseconds: a suffix trie's insertions,
        # a learned store's suffix array rebuilt).
        self.deferred: list[Callable[[], None]] = []
        self.worker: ThreadPoolExecutor | None = None
        self.cost = cost
        self.estimates = AcceptanceEstimates()  # learned from every tree verified here
        self.ledger = DraftingLedger()  # what drafting gains and costs, per method
        self.prefix_cache = prefix_cache if isinstance(self.forward, LlamaForward) else None

    def add(self, request: Request) -> Running:
        """Queue a request; it joins the batch at a step when there is room."""
        prompt = list(request.prompt)
        if not prompt:
            raise ValueError("the prompt is empty")
        if request.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        sampling = request.sampling
        state = Running(
            request=request,
            cache=None,
            context=np.array(prompt + [0] * (request.max_new_tokens + 1), dtype=np.int64),
            n=len(prompt),
            stopping=StoppingRule(request.max_new_tokens, request.eos_token_ids,
                                  request.stop_strings, request.tokenizer),
            generator=sampling.generator(self.device) if sampling else None,
            result=GenerationResult(
                token_ids=[], top2_logits=[] if request.record_top2 else None,
                logprobs=[] if request.logprobs is not None else None,
                prompt_logprobs=[] if request.prompt_logprobs is not None else None),
            started=clock(self.device),
        )
        self.waiting.append(state)
        return state

    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    def run(self) -> None:
        """Step until every request has finished, then do the drafters' deferred work."""
        while self.busy():
            self.step()
        self._run_deferred(self.deferred)
        self.deferred = []

    @staticmethod
    def _run_deferred(work: list[Callable[[], None]]) -> None:
        for job in work:
            job()

    def _beside_forward(self, segments: list[Segment], work: list[Callable[[], None]]
                        ) -> list[SegmentOutput]:
        """The forward over `segments`, with `work` run beside it on the worker thread."""
        if not work:
            return self.forward(segments)
        if self.worker is None:
            self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dresd-drafting")
        done = self.worker.submit(self._run_deferred, work)
        try:
            return self.forward(segments)
        finally:
            done.result()  # the drafters' state is settled before the next step reads it

    @torch.inference_mode()
    def step(self) -> list[Running]:
        """One forward for every running sequence; returns the sequences that finished."""
        step_started = clock(self.device)
        while self.waiting and len(self.running) < self.max_batch_size:
            state = self.waiting.popleft()
            state.cache = self.forward.new_sequence()
            self.running.append(state)

        # 1. Every running sequence's rows: a prompt chunk, or its draft tree.
        members, chunks, failed = [], {}, []
        decoding = sum(not state.prefilling for state in self.running)
        room = self.prefill_chunk * self.prefill_chunks_per_step  # prompt rows in this step
        for state in self.running:
            try:
                if state.prefilling:
                    if self._waits_for_sibling(state):
                        continue
                    rows = self._next_chunk_rows(state)
                    if chunks and rows > room:
                        continue  # its next chunk waits for a later step
                    chunks[id(state)] = self._prompt_chunk(state)
                    room -= rows
                else:
                    self._draft(state, decoding)
            except Exception as err:  # noqa: BLE001 - a sequence's failure ends it alone
                self._fail(state, err, failed)
                continue
            members.append(state)
        if not members:
            for state in failed:
                self._finish(state)
            return failed
        # The trees' nodes that pay for their rows in this step's forward (budget.py).
        if self.cost is not None:
            self._fit_budget([state for state in members if id(state) not in chunks],
                             sum(len(chunk) for chunk in chunks.values()))
        segments = [chunks.get(id(state)) or self._tree_segment(state) for state in members]

        # 2. One forward over all of them, finished generations' `observe` beside it.
        work, self.deferred = self.deferred, []
        forward_started = clock(self.device)
        outputs = self._beside_forward(segments, work)
        self.steps += 1
        self.last_step = (len(segments), sum(len(segment) for segment in segments))
        if self.cost is not None:
            self.ledger.record_forward(clock(self.device) - forward_started,
                                       self.cost(self.last_step[1]))

        finished, emitted_tokens = failed, 0
        for state, segment, output in zip(members, segments, outputs, strict=True):
            # 3-5 read only this sequence's rows and state: a failure in them (its sampling,
            # its stop strings, its streaming callback) ends this sequence alone.
            try:
                emitted = self._advance(state, segment, output, forward_started)
                if emitted is None:
                    continue  # its prompt is not all in the cache yet
                emitted_tokens += len(emitted)
                done = self._emit(state, emitted)  # 5. Emit, stop where plain decoding stops.
            except Exception as err:  # noqa: BLE001 - a sequence's failure ends it alone
                self._fail(state, err, finished)
                continue
            if done:
                finished.append(state)
        self.last_step_output = (emitted_tokens, clock(self.device) - step_started)
        for state in finished:
            self._finish(state)
        return finished

    def _advance(self, state: Running, segment: Segment, output: SegmentOutput,
                 forward_started: float) -> list[int] | None:
        """Steps 3 and 4 for one sequence: the tokens its rows give (None while its prompt is
        still prefilling)."""
        if not state.prefilling:
            return self._accept(state, segment, output, forward_started)
        if state.result.prompt_logprobs is not None:
            self._record_prompt(state, output, state.prefilled, len(segment))
        state.prefilled += len(segment)
        if state.prefilling:
            return None
        self._cache_prefix(state, state.prompt_len)
        # 3a. The prompt's last position gives the first token.
        state.result.prefill_seconds = clock(self.device) - state.started
        state.query, state.recent = output.hidden[-1], output.hidden
        state.states.append(output.hidden[-1:])
        emitted = [self._choose(state, output)]
        self._record(state, output, [-1], emitted)
        return emitted

    @staticmethod
    def _fail(state: Running, err: Exception, finished: list[Running]) -> None:
        """End one sequence with its error; the batch goes on without it."""
        state.error, state.result.stop_reason = err, "error"
        finished.append(state)

    def cancel(self, state: Running) -> None:
        """Stop a request now (a client that went away)."""
        if state in self.waiting:
            self.waiting.remove(state)
            state.result.stop_reason = "cancelled"
        elif state in self.running:
            state.result.stop_reason = "cancelled"
            self._finish(state)

    def _chunk_end(self, start: int, state: Running) -> int:
        """Where the prompt chunk starting at `start` ends: at the next multiple of
        `prefill_chunk`, or the prompt's end."""
        return min(state.prompt_len, (start // self.prefill_chunk + 1) * self.prefill_chunk)

    def _waits_for_sibling(self, state: Running) -> bool:
        """Whether the sequence's prefill waits for a sibling's (its prompt's keys will be
        in the prefix cache once that one is prefilled)."""
        sibling = state.request.prefill_after
        return (self.prefix_cache is not None and not state.looked_up and sibling is not None
                and sibling.prefilling and sibling.result.stop_reason == "")

    def _next_chunk_rows(self, state: Running) -> int:
        """The rows of the sequence's next prompt chunk (before its first, after the prefix
        the cache holds now, without taking it)."""
        start = state.prefilled
        if not state.looked_up and self.prefix_cache is not None:
            start = self.prefix_cache.match_length(state.request.prompt,
                                                   state.request.cache_salt,
                                                   limit=state.prompt_len - 1)
        return self._chunk_end(start, state) - start

    def _prompt_chunk(self, state: Running) -> Segment:
        if not state.looked_up:
            self._reuse_prefix(state)
        start = state.prefilled
        end = self._chunk_end(start, state)
        last = end == state.prompt_len
        rows = ("all" if state.request.prompt_logprobs is not None else
                "last" if last else "none")
        return Segment(state.cache, list(state.request.prompt[start:end]), start,
                       logits_rows=rows, top2=state.request.record_top2)

    def _reuse_prefix(self, state: Running) -> None:
        """Start the prefill after the longest cached prefix of the prompt (its last token
        is always computed afresh: it gives the first token)."""
        state.looked_up = True
        if self.prefix_cache is None or state.request.prompt_logprobs is not None:
            return  # (prompt logprobs need every prompt row's logits: none is skipped)
        request = state.request
        state.hold = self.prefix_cache.lookup(request.prompt, request.cache_salt, state.cache,
                                              limit=state.prompt_len - 1)
        state.prefilled = state.result.cached_tokens = state.hold.length

    def _cache_prefix(self, state: Running, rows: int) -> None:
        """Cache the sequence's first `rows` tokens (their rows are committed in its buffer)."""
        if self.prefix_cache is not None and rows > 0:
            state.hold = self.prefix_cache.insert(state.context[:rows].tolist(),
                                                  state.request.cache_salt, state.cache,
                                                  hold=state.hold)

    def _draft(self, state: Running, decoding: int) -> None:
        """The drafter's drafts after the sequence's last token, merged into `state.tree`
        (none where the ledger says drafting does not pay in a step of `decoding` sequences)."""
        request, result = state.request, state.result
        started = clock(self.device)
        max_length = request.max_length or state.prompt_len + request.max_new_tokens
        max_draft_len = min(request.max_new_tokens - len(result.token_ids) - 1,
                            max_length - state.n)
        state.drafted = max_draft_len > 0 and (
            self.cost is None or not request.budget or self.ledger.worth_drafting(
                request.drafter.name, len(result.steps), decoding, self.cost))
        drafts = []
        if state.drafted:
            context = DraftContext(state.context[: state.n], state.query, max_draft_len,
                                   decoding, *self.last_step_output,
                                   hidden_states=state.recent)
            drafts = [d[:max_draft_len] for d in request.drafter.propose(context) if len(d) > 0]
        root = int(state.context[state.n - 1])
        forced: list[int] = []
        if request.constraint is not None and max_draft_len > 0:
            # what the grammar forbids, cut; what it forces, drafted first (constraint.py)
            forced, drafts = constrain_drafts(request.constraint, drafts, max_draft_len)
        if not self.tree_attention:
            drafts = ([forced] if forced else drafts)[:1]  # a causal mask: one linear draft
            forced = []
        # the drafter's own tree is what its acceptance estimates learn from
        state.drafted_tree = DraftTree.from_drafts(root, drafts)
        state.tree = DraftTree.from_drafts(root, [forced, *drafts]) if forced else (
            state.drafted_tree)
        state.forced = forced_nodes(state.tree, forced)
        state.draft_seconds = clock(self.device) - started

    def _fit_budget(self, decoding: list[Running], chunk_rows: int) -> None:
        """Cut every tree that takes the budget to the nodes that pay (`budget.batch_budget`);
        the others' rows count as fixed. A drafter that sizes its own trees (hybrid) is cut
        only when it shares the step with other sequences."""
        trimmed = [state for state in decoding if state.request.budget and len(state.tree) > 1
                   and (len(decoding) > 1 or not state.request.drafter.sizes_its_trees)]
        if not trimmed:  # no draft to cut: under load, most steps
            return
        fixed = chunk_rows + sum(len(state.tree) for state in decoding) - sum(
            len(state.tree) - 1 for state in trimmed)
        reaches = [self.estimates.reach(state.request.drafter.name, state.tree)
                   for state in trimmed]
        for state, kept in zip(trimmed, batch_budget(reaches, fixed, len(decoding), self.cost),
                               strict=True):
            kept = set(kept) | state.forced  # certain tokens: always worth their rows
            if len(kept) < len(state.tree) - 1:
                state.tree = restrict(state.tree, kept)

    def _tree_segment(self, state: Running) -> Segment:
        tree = state.tree
        linear = tree.is_linear()
        return Segment(state.cache, tree.tokens, state.n - 1,
                       depths=None if linear else tree.depths,
                       ancestors=None if linear else tree.ancestor_matrix(self.device),
                       top2=state.request.record_top2)

    def _node_logits(self, state: Running, tree: DraftTree) -> NodeLogits | None:
        """How the request processes each node's logits (penalties, a grammar), or None."""
        request = state.request
        if request.constraint is None and (request.penalties is None
                                           or not request.penalties.active):
            return None
        context = torch.from_numpy(state.context[: state.n])
        return NodeLogits(tree, request.penalties, request.constraint,
                          context[: state.prompt_len], context[state.prompt_len:])

    def _choose(self, state: Running, output: SegmentOutput) -> int:
        """The token after the output's last logits row (as the request processes it)."""
        sampling = state.request.sampling
        nodes = self._node_logits(state, DraftTree.from_drafts(
            int(state.context[state.n - 1]), []))
        if sampling is None:
            token = output.greedy[-1]
            return token if nodes is None else nodes.greedy(0, token, output.logits[-1])
        logits = output.logits[-1] if nodes is None else nodes.processed(0, output.logits[-1])
        return sample(next_token_probs(logits, sampling), state.generator)

    def _accept(self, state: Running, segment: Segment, output: SegmentOutput,
                forward_started: float) -> list[int]:
        tree = state.tree
        # 3b. The longest path the target agrees with, plus its own next token (each chosen
        #     from the node's logits as the request processes them: penalties, a grammar).
        nodes = self._node_logits(state, tree)
        if state.request.sampling is None:
            path, bonus = greedy_accept(tree, output.greedy, nodes, output.logits)
        else:
            path, bonus = sampling_accept(tree, output.logits, state.request.sampling,
                                          state.generator, nodes)
        emitted = [tree.tokens[node] for node in path[1:]] + [bonus]
        # every node drafted, cut or not, whose parent the emitted tokens reach is a trial: the
        # budget's cut does not keep the estimates from learning the nodes it cut
        self.estimates.observe(state.request.drafter.name, state.drafted_tree, emitted)
        if state.drafted and self.cost is not None:  # what drafting cost: itself, its rows
            rows = self.last_step[1]
            row_seconds = (self.cost(rows) - self.cost(rows - tree.num_drafted)) * (
                self.ledger.unit_seconds or 0.0)
            self.ledger.record_draft(state.request.drafter.name, len(path) - 1,
                                     state.draft_seconds + row_seconds)
        # 4. Only the accepted path stays in the cache; its last state is the next query.
        self.forward.keep(state.cache, segment.start, path)
        state.query, state.recent = output.hidden[path[-1]], output.hidden[path]
        state.states.append(state.recent)
        state.result.steps.append(StepRecord(
            num_drafted=tree.num_drafted,
            num_accepted=len(path) - 1,
            draft_depth=tree.depth,
            draft_seconds=state.draft_seconds,
            # the whole step's forward, shared by every sequence in it, and this acceptance
            verify_seconds=clock(self.device) - forward_started,
            num_forced=sum(node in state.forced for node in path[1:]),
        ))
        self._record(state, output, path, emitted)  # the rows that chose each token
        return emitted

    @staticmethod
    def _record(state: Running, output: SegmentOutput, rows: list[int],
                tokens: list[int]) -> None:
        """What the request keeps of the logits rows that chose `tokens`: their two best
        logits (the exactness check's record) and their log-probabilities."""
        result = state.result
        if result.top2_logits is not None:
            result.top2_logits.extend(output.top2[row] for row in rows)
        if result.logprobs is not None:
            result.logprobs.extend(token_logprobs(output.logits[rows], tokens,
                                                  state.request.logprobs))

    @staticmethod
    def _record_prompt(state: Running, output: SegmentOutput, start: int, rows: int) -> None:
        """The log-probabilities of the prompt tokens this chunk's rows predict: row j, at
        position start + j, predicts the prompt's token start + j + 1 (the chunk's last row,
        past the prompt's end, predicts the first new token: `_record` keeps that one)."""
        prompt = state.request.prompt
        predicted = min(rows, state.prompt_len - 1 - start)
        if predicted > 0:
            state.result.prompt_logprobs.extend(token_logprobs(
                output.logits[:predicted], list(prompt[start + 1:start + 1 + predicted]),
                state.request.prompt_logprobs))

    def _emit(self, state: Running, emitted: list[int]) -> bool:
        """Append the step's tokens; True when the sequence is done."""
        result, request = state.result, state.request
        first = len(result.token_ids)
        for token in emitted:
            state.context[state.n] = token
            state.n += 1
            result.token_ids.append(token)
            result.stop_reason = state.stopping.reason(result.token_ids) or ""
            if request.constraint is not None:  # its grammar's state moves with each token
                request.constraint.commit([token])
                if not result.stop_reason and request.constraint.finished():
                    # the grammar allows nothing more: its end is the output's end, here
                    # rather than after end-of-text tokens up to max_tokens where the
                    # grammar's end-of-text token is not one the request stops at
                    result.stop_reason = "eos"
            if result.stop_reason:
                break
        max_length = request.max_length or state.prompt_len + request.max_new_tokens
        if not result.stop_reason and state.n >= max_length:
            result.stop_reason = "max_length"
        if request.on_tokens is not None and request.on_tokens(result.token_ids[first:]) is False:
            result.stop_reason = result.stop_reason or "cancelled"
        return bool(result.stop_reason)

    def _finish(self, state: Running) -> None:
        self.running.remove(state)
        if self.prefix_cache is not None:
            # Rows committed before any step that may have failed midway: a prompt's
            # prefilled chunks, else every token but the last (whose row the next step
            # would write); a stop inside an accepted path leaves rows past the context.
            committed = state.prefilled if state.prefilling else min(
                state.n - 1, state.cache.length)
            self._cache_prefix(state, committed)
            self.prefix_cache.release(state.hold)
        result = state.result
        if state.states and state.error is None:  # a drafter that learns keeps what was said
            states = torch.cat(state.states)[: len(result.token_ids)]
            self.deferred.append(functools.partial(
                state.request.drafter.observe, list(state.request.prompt),
                list(result.token_ids), states))
        result.num_target_forwards = (1 if state.query is not None else 0) + len(result.steps)
        for kept in (result.top2_logits, result.logprobs):  # rows past a stop: not emitted
            if kept is not None:
                del kept[len(result.token_ids):]
        result.total_seconds = clock(self.device) - state.started
        state.cache = None
