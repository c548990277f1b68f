"""Per-step records of a speculative generation and the figures computed from them.

One vocabulary everywhere (DESIGN.md). A "step" is one verification forward of the target after
the prefill; a "target forward" is the prefill or a step.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class StepRecord:
    num_drafted: int  # draft tokens verified: nodes of the token tree, root excluded
    num_accepted: int  # draft tokens the target agreed with (the accepted path, root excluded)
    draft_depth: int  # longest draft in the tree (0: nothing drafted)
    draft_seconds: float  # the drafter's propose() and the tree's construction
    verify_seconds: float  # the target forward, acceptance and cache compaction
    num_forced: int = 0  # of the accepted, the tokens a grammar forced (drafted for free)


@dataclass
class TokenLogprob:
    """An emitted token's log-probability under the model's own distribution at the row that
    chose it (softmax of the raw logits: before temperature, top-k or top-p), and the `top`
    most likely tokens there with theirs, best first."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class GenerationResult:
    token_ids: list[int]  # the new tokens only, as plain decoding would have produced them
    steps: list[StepRecord] = field(default_factory=list)
    prefill_seconds: float = 0.0
    total_seconds: float = 0.0  # wall clock of the whole call, prefill included
    num_target_forwards: int = 0  # prefill + verify steps (plain decoding: one per token)
    stop_reason: str = ""  # "eos", "stop_string", "max_new_tokens", "max_length", "cancelled"
    # Plain decoding (`ar`) only: its two best logits at each new token, so that another
    # method's divergence from it can be told a near-tie or not (decoding/verify.py).
    top2_logits: list[tuple[float, float]] | None = None
    cached_tokens: int = 0  # prompt tokens read from the prefix cache, not prefilled
    logprobs: list[TokenLogprob] | None = None  # per new token, where the request asked
    # per prompt token after the first (each from the row before it), where the request asked
    prompt_logprobs: list[TokenLogprob] | None = None


def summarize(results: Iterable[GenerationResult]) -> dict:
    """Aggregate figures over one or more generations (pooled, not averaged per call).

    - num_new_tokens = sum of new tokens
    - num_target_forwards = prefills + verification steps
    - mean_accepted_length = new tokens / target forwards: tokens emitted per target forward,
      the bonus token included, so plain decoding is exactly 1.0
    - acceptance_rate = accepted draft tokens / drafted tokens (tree nodes verified); None when
      nothing was drafted
    - per_position_acceptance[d-1] = steps that accepted at least d draft tokens / steps whose
      tree reached depth d
    - drafted_tokens_per_step = drafted tokens / steps
    - tokens_per_s = new tokens / wall-clock seconds (prefill included)
    - draft_time_share, verify_time_share = seconds drafting (verifying) / wall-clock seconds
    """
    results = list(results)
    steps = [step for result in results for step in result.steps]
    new_tokens = sum(len(result.token_ids) for result in results)
    forwards = sum(result.num_target_forwards for result in results)
    seconds = sum(result.total_seconds for result in results)
    drafted = sum(step.num_drafted for step in steps)
    accepted = sum(step.num_accepted for step in steps)
    max_depth = max((step.draft_depth for step in steps), default=0)
    per_position = []
    for depth in range(1, max_depth + 1):
        reached = sum(1 for step in steps if step.draft_depth >= depth)
        per_position.append(sum(1 for step in steps if step.num_accepted >= depth) / reached)
    return {
        "num_new_tokens": new_tokens,
        "num_target_forwards": forwards,
        "mean_accepted_length": new_tokens / forwards if forwards else None,
        "acceptance_rate": accepted / drafted if drafted else None,
        "per_position_acceptance": per_position,
        "drafted_tokens_per_step": drafted / len(steps) if steps else 0.0,
        "tokens_per_s": new_tokens / seconds if seconds > 0 else None,
        "seconds": seconds,
        "draft_time_share": sum(s.draft_seconds for s in steps) / seconds if seconds else None,
        "verify_time_share": sum(s.verify_seconds for s in steps) / seconds if seconds else None,
    }
