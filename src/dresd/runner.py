"""Run one generation method on a loaded target: `ar` or any drafter, through the one loop.

`ar` is plain decoding: the batched loop (`decoding/batch.py`) with no drafts, on the same
forward as every other method, so that every comparison is like for like. That forward is
transformers' own, row for row (`decoding/forward.py`; tested against `model.generate`). The
other methods are drafters (see `dresd.drafters`); `none` drafts nothing, as `ar` does.

`generate` runs one prompt alone (single-stream); `generate_many` runs many prompts through
one batch, `concurrency` of them at a time, as a server under that many clients would, with a
prefix cache of its own where the runner has one (`prefix_cache_mb`): the prompts of one run
share what they have in common, and every run starts cold, so that levels and rounds measure
the same thing. `batch` engines (corpus regeneration's batches) share the runner's cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dresd.calibrate import load_or_measure
from dresd.decoding import SamplingConfig
from dresd.decoding.batch import BatchEngine, Request
from dresd.decoding.budget import CostCurve
from dresd.decoding.drafter import Drafter
from dresd.decoding.prefix_cache import PrefixCache
from dresd.drafters import make_drafter
from dresd.errors import UserError
from dresd.metrics import GenerationResult
from dresd.models.target import Target

AR = "ar"


@dataclass
class GenerationSettings:
    max_new_tokens: int = 128  # new tokens at most
    sampling: SamplingConfig | None = None  # None: greedy
    stop_strings: list[str] = field(default_factory=list)  # end after the token completing one

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise UserError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


def make_request(target: Target, prompt_ids: list[int], drafter: Drafter,
                 settings: GenerationSettings, max_new_tokens: int | None = None,
                 **fields) -> Request:
    """The loop's request for one prompt: `settings` on `target` (its EOS tokens, tokenizer
    and context length), the same for `generate`, `bench` and `serve`. `fields`: the
    request's other fields (`on_tokens`, `budget`, `record_top2`)."""
    return Request(
        prompt=prompt_ids,
        drafter=drafter,
        max_new_tokens=max_new_tokens or settings.max_new_tokens,
        sampling=settings.sampling,
        eos_token_ids=target.eos_token_ids,
        stop_strings=settings.stop_strings,
        tokenizer=target.tokenizer,
        max_length=target.max_length,
        **fields,
    )


class MethodRunner:
    """Generates with one method; the same settings make methods comparable."""

    def __init__(
        self,
        target: Target,
        method: str,
        settings: GenerationSettings,
        label: str | None = None,
        budget: bool | None = None,
        prefix_cache_mb: float | None = None,
        **drafter_options,
    ) -> None:
        """`budget`: cut each step's tree to the nodes that pay by the machine's verify-cost
        curve (`decoding/budget.py`, measured once and cached); None (default): yes, unless
        `max_tree_nodes` fixes the tree's shape. False: verify the drafts as drafted (DReSD at
        the paper's shape, say). `prefix_cache_mb`: the size of the batched runs' prefix
        cache (`decoding/prefix_cache.py`); None: none (single-stream `generate` has none)."""
        self.target = target
        self.prefix_cache_mb = prefix_cache_mb
        self.prefix_cache = self.new_prefix_cache()
        self.method = method
        self.label = label or method  # its name in reports: "dresd[max_tree_nodes=2]"
        self.settings = settings
        self.drafter_options = drafter_options
        self.drafter = self._new_drafter()
        if budget is None:
            budget = drafter_options.get("max_tree_nodes") is None
        self.budget = budget and method not in (AR, "none")  # nothing drafted, nothing to cut
        self.cost = None
        if self.budget:
            curve = load_or_measure(target)
            self.cost = CostCurve(curve)
        self.engine = self.batch(1, prefix_cache=None)  # reused prompt to prompt

    def _new_drafter(self) -> Drafter:
        drafter = make_drafter("none" if self.method == AR else self.method,
                               **self.drafter_options)
        # Drafters bound to a model (datastores) refuse a target they were not built for.
        drafter.check_target(self.target)
        return drafter

    def forget(self) -> None:
        """Start again from a drafter that has learned nothing: a new one from the same options
        (what the old one kept of finished generations, such as suffix's global trie and
        hybrid's acceptance table, is gone; datastores are opened again)."""
        self.drafter = self._new_drafter()

    def check_fits(self, prompt_ids: list[int]) -> int:
        """How many new tokens the prompt leaves room for; an error if it fills the context."""
        limit = self.target.max_length
        if limit is None:
            return self.settings.max_new_tokens
        if len(prompt_ids) >= limit:
            raise UserError(
                f"the prompt has {len(prompt_ids)} tokens; the model's context is {limit} tokens"
            )
        return min(self.settings.max_new_tokens, limit - len(prompt_ids))

    def request(self, prompt_ids: list[int], drafter: Drafter | None = None) -> Request:
        """The loop's request for one prompt with this method's settings."""
        return make_request(
            self.target, prompt_ids, drafter or self.drafter, self.settings,
            self.check_fits(prompt_ids), budget=self.budget,
            # the reference keeps its logits' top two, to classify others' divergences
            record_top2=self.method == AR and self.settings.sampling is None)

    def new_prefix_cache(self) -> PrefixCache | None:
        """An empty prefix cache of the runner's size, or None where it has none."""
        return None if self.prefix_cache_mb is None else PrefixCache(self.prefix_cache_mb)

    def batch(self, max_batch_size: int, prefix_cache: PrefixCache | None | bool = True
              ) -> BatchEngine:
        """A batched loop for this method's requests, with its cost curve and a prefix cache
        (True: the runner's own, shared by every such loop)."""
        if prefix_cache is True:
            prefix_cache = self.prefix_cache
        return BatchEngine(self.target.model, max_batch_size=max_batch_size, cost=self.cost,
                           prefix_cache=prefix_cache or None)

    def generate(self, prompt_ids: list[int]) -> GenerationResult:
        state = self.engine.add(self.request(prompt_ids))
        self.engine.run()
        return state.result

    def generate_many(self, prompts: list[list[int]], concurrency: int) -> list[GenerationResult]:
        """All prompts through one batch, at most `concurrency` generating at once (the rest
        queue and join as others finish). Each request drafts with its own fork of the
        drafter. A result's `prefill_seconds` counts from the moment all were submitted."""
        engine = self.batch(concurrency, self.new_prefix_cache())
        states = [engine.add(self.request(ids, self.drafter.fork())) for ids in prompts]
        engine.run()
        return [state.result for state in states]
