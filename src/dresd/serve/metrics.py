"""The server's figures, served at GET /metrics in Prometheus' text format.

Names follow vLLM's (`vllm:num_requests_waiting` is `dresd:num_requests_waiting` here), so a
dashboard made for vLLM needs only its prefix changed. The speculative figures use this
project's vocabulary and formulas (`dresd.metrics.summarize`), pooled over every request:

- mean acceptance length = generated tokens / target forwards (the prefill counts as one
  forward emitting one token, so plain decoding is 1.0)
- draft acceptance rate = accepted draft tokens / drafted tokens
- per-position acceptance at position p (0-based) = steps that accepted at least p+1 draft
  tokens / steps whose draft tree reached depth p+1
- generation tokens/s = generated tokens / seconds spent generating (prefill included)
- prefix cache hit rate = prompt tokens found in the prefix cache / prompt tokens looked up
  (vLLM's `prefix_cache_queries` and `prefix_cache_hits`, in tokens)

Everything here is updated on the server's event loop only, so it needs no lock.
"""

from __future__ import annotations

from dresd.decoding.prefix_cache import PrefixCacheStats
from dresd.metrics import GenerationResult

PREFIX = "dresd:"
# Seconds; the buckets vLLM uses for time to first token, cut to what a CPU server sees.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)  # observations <= each bound (cumulative at render)
        self.total = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.total += 1
        self.sum += value
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
                break

    def lines(self, name: str, labels: str) -> list[str]:
        out, cumulative = [], 0
        for bound, count in zip(self.buckets, self.counts, strict=True):
            cumulative += count
            out.append(f'{name}_bucket{{{labels}le="{bound}"}} {cumulative}')
        out.append(f'{name}_bucket{{{labels}le="+Inf"}} {self.total}')
        out.append(f"{name}_sum{{{labels.rstrip(',')}}} {self.sum}")
        out.append(f"{name}_count{{{labels.rstrip(',')}}} {self.total}")
        return out


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.labels = f'model_name="{model_name}",'
        self.finished: dict[str, int] = {}  # finished_reason -> requests
        self.rejected: dict[str, int] = {}  # HTTP status -> requests refused
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.target_forwards = 0
        self.batch_forwards = 0  # forwards of the batched loop (one per step, all requests)
        self.batch_sequences = 0  # requests in them, summed over forwards
        self.batch_rows = 0  # token rows in them (prompt chunks, draft trees), summed
        self.generation_seconds = 0.0
        self.drafted_tokens = 0
        self.accepted_tokens = 0
        self.verify_steps = 0
        self.reached: list[int] = []  # [p]: steps whose tree reached depth p+1
        self.accepted_at: list[int] = []  # [p]: steps that accepted at least p+1 draft tokens
        self.ttft = Histogram(TTFT_BUCKETS)
        self.e2e = Histogram(LATENCY_BUCKETS)
        # the prefix cache's counters, as it last reported them (`record_prefix_cache`)
        self.prefix_cache_queries = 0  # prompt tokens looked up
        self.prefix_cache_hits = 0  # of those, found cached
        self.prefix_cache_evictions = 0  # entries evicted
        self.prefix_cache_bytes = 0  # held now
        self.prefix_cache_capacity_bytes = 0

    def record_finished(self, reason: str, prompt_tokens: int, result: GenerationResult | None,
                        ttft: float | None, seconds: float) -> None:
        """One request done ("stop", "length" or "abort"), with its generation if it ran."""
        self.finished[reason] = self.finished.get(reason, 0) + 1
        self.prompt_tokens += prompt_tokens
        if ttft is not None:
            self.ttft.observe(ttft)
        self.e2e.observe(seconds)
        if result is None:
            return
        self.generation_tokens += len(result.token_ids)
        self.target_forwards += result.num_target_forwards
        self.generation_seconds += result.total_seconds
        for step in result.steps:
            self.verify_steps += 1
            self.drafted_tokens += step.num_drafted
            self.accepted_tokens += step.num_accepted
            while len(self.reached) < step.draft_depth:
                self.reached.append(0)
                self.accepted_at.append(0)
            for p in range(step.draft_depth):
                self.reached[p] += 1
            for p in range(min(step.num_accepted, step.draft_depth)):
                self.accepted_at[p] += 1

    def record_step(self, sequences: int, rows: int) -> None:
        """One forward of the batched loop: how many requests and token rows it carried."""
        self.batch_forwards += 1
        self.batch_sequences += sequences
        self.batch_rows += rows

    def record_prefix_cache(self, stats: PrefixCacheStats) -> None:
        """The prefix cache's counters now (they are its own totals: set, not added)."""
        self.prefix_cache_queries, self.prefix_cache_hits = stats.queries, stats.hits
        self.prefix_cache_evictions = stats.evictions
        self.prefix_cache_bytes = stats.bytes
        self.prefix_cache_capacity_bytes = stats.capacity_bytes

    def record_rejected(self, status: int) -> None:
        self.rejected[str(status)] = self.rejected.get(str(status), 0) + 1

    def add(self, other: ServerMetrics) -> None:
        """Add another process's figures to these (Ray Serve replicas, ray_serve.py). Every
        figure here is a count or a sum, and the ratios are computed from them at `render`, so
        the pooled ratios are those of one server that had served every replica's requests."""
        for name, value in vars(other).items():
            mine = getattr(self, name)
            if isinstance(value, Histogram):
                mine.counts = [a + b for a, b in zip(mine.counts, value.counts, strict=True)]
                mine.total += value.total
                mine.sum += value.sum
            elif isinstance(value, dict):
                for key, count in value.items():
                    mine[key] = mine.get(key, 0) + count
            elif isinstance(value, list):
                mine.extend([0] * (len(value) - len(mine)))
                for i, count in enumerate(value):
                    mine[i] += count
            elif isinstance(value, int | float):
                setattr(self, name, mine + value)
            # anything else (the labels) is the same for every replica

    def render(self, running: int, waiting: int) -> str:
        lab = self.labels
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP {PREFIX}{name} {help_}")
            lines.append(f"# TYPE {PREFIX}{name} {kind}")
            sample_name = f"{PREFIX}{name}_total" if kind == "counter" else f"{PREFIX}{name}"
            for extra, value in samples:
                lines.append(f"{sample_name}{{{(lab + extra).rstrip(',')}}} {value}")

        metric("num_requests_running", "gauge", "Requests generating now.", [("", running)])
        metric("num_requests_waiting", "gauge", "Requests waiting in the queue.",
               [("", waiting)])
        metric("request_success", "counter", "Requests finished, by finish reason.",
               [(f'finished_reason="{r}",', n) for r, n in sorted(self.finished.items())]
               or [('finished_reason="stop",', 0)])
        metric("request_rejected", "counter", "Requests refused, by HTTP status.",
               [(f'status="{s}",', n) for s, n in sorted(self.rejected.items())]
               or [('status="400",', 0)])
        metric("prompt_tokens", "counter", "Prompt tokens of finished requests.",
               [("", self.prompt_tokens)])
        metric("generation_tokens", "counter", "Generated tokens.", [("", self.generation_tokens)])
        metric("generation_seconds", "counter", "Seconds spent generating, prefill included.",
               [("", round(self.generation_seconds, 6))])
        metric("num_target_forwards", "counter", "Target forwards: prefills + verify steps.",
               [("", self.target_forwards)])
        metric("batch_forwards", "counter", "Forwards of the batched loop (one per step).",
               [("", self.batch_forwards)])
        metric("batch_sequences", "counter", "Requests carried by those forwards, summed.",
               [("", self.batch_sequences)])
        metric("batch_rows", "counter", "Token rows of those forwards (prompt chunks, draft "
               "trees), summed.", [("", self.batch_rows)])
        metric("mean_batch_size", "gauge", "Requests per forward of the batched loop.",
               [("", self.batch_sequences / self.batch_forwards if self.batch_forwards
                 else 0.0)])
        metric("spec_decode_num_drafts", "counter", "Verify steps.", [("", self.verify_steps)])
        metric("spec_decode_num_draft_tokens", "counter", "Drafted tokens (tree nodes verified).",
               [("", self.drafted_tokens)])
        metric("spec_decode_num_accepted_tokens", "counter", "Accepted draft tokens.",
               [("", self.accepted_tokens)])
        metric("spec_decode_num_accepted_tokens_per_pos", "counter",
               "Steps that accepted a draft token at this position (0-based).",
               [(f'position="{p}",', n) for p, n in enumerate(self.accepted_at)])
        metric("spec_decode_num_drafts_per_pos", "counter",
               "Steps whose draft tree reached this position (0-based).",
               [(f'position="{p}",', n) for p, n in enumerate(self.reached)])
        mean_len = (self.generation_tokens / self.target_forwards if self.target_forwards
                    else 0.0)
        metric("spec_decode_mean_acceptance_length", "gauge",
               "Generated tokens per target forward (plain decoding: 1.0).", [("", mean_len)])
        rate = self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0
        metric("spec_decode_draft_acceptance_rate", "gauge",
               "Accepted draft tokens / drafted tokens.", [("", rate)])
        metric("spec_decode_per_position_acceptance", "gauge",
               "Per-position acceptance: accepted at this position / reached it.",
               [(f'position="{p}",', a / r if r else 0.0)
                for p, (a, r) in enumerate(zip(self.accepted_at, self.reached, strict=True))])
        metric("prefix_cache_queries", "counter", "Prompt tokens looked up in the prefix cache.",
               [("", self.prefix_cache_queries)])
        metric("prefix_cache_hits", "counter", "Prompt tokens found in the prefix cache.",
               [("", self.prefix_cache_hits)])
        metric("prefix_cache_hit_rate", "gauge", "Prefix cache hits / queries, in tokens.",
               [("", self.prefix_cache_hits / self.prefix_cache_queries
                 if self.prefix_cache_queries else 0.0)])
        metric("prefix_cache_evictions", "counter", "Prefix cache entries evicted for room.",
               [("", self.prefix_cache_evictions)])
        metric("prefix_cache_bytes", "gauge", "Bytes of keys and values the prefix cache holds.",
               [("", self.prefix_cache_bytes)])
        metric("prefix_cache_capacity_bytes", "gauge", "The prefix cache's size (0: off).",
               [("", self.prefix_cache_capacity_bytes)])
        speed = (self.generation_tokens / self.generation_seconds if self.generation_seconds
                 else 0.0)
        metric("avg_generation_throughput_toks_per_s", "gauge",
               "Generated tokens / seconds generating, over all requests.", [("", speed)])
        for name, histogram, help_ in (
            ("time_to_first_token_seconds", self.ttft, "Time from request to first token."),
            ("e2e_request_latency_seconds", self.e2e, "Time from request to its end."),
        ):
            lines.append(f"# HELP {PREFIX}{name} {help_}")
            lines.append(f"# TYPE {PREFIX}{name} histogram")
            lines.extend(histogram.lines(PREFIX + name, lab))
        return "\n".join(lines) + "\n"
