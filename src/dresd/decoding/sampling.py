"""Sampling settings and the pure helpers that turn logits into a next-token distribution.

The processing is the one `transformers.generate` applies, in the same order (temperature, then
top-k, then top-p, then min-p), so that "the model's own distribution" means the same thing for
plain decoding and for every speculative method. (A request's penalties, logit bias and grammar
come before all of them: processing.py.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dresd.errors import UserError
from dresd.metrics import TokenLogprob

# Below this temperature sampling is greedy decoding: dividing logits by a tinier one overflows
# float32 (at 1e-40, a denormal, every logit becomes inf and softmax gives NaN), and the
# distribution it tends to is the argmax's anyway. vLLM draws the same line (its _SAMPLING_EPS).
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 1.0  # > 0; logits are divided by it
    top_k: int = 0  # keep the k most likely tokens (0: all)
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches p (1.0: all)
    seed: int | None = None  # seeds the generator that draws every sample
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely (0: none)

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise UserError(f"temperature must be > 0 for sampling, got {self.temperature}")
        if self.top_k < 0:
            raise UserError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise UserError(f"min_p must be in [0, 1], got {self.min_p}")

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        """The generator of every sample, on the device the probabilities live on (a CUDA
        stream of random numbers differs from the CPU's: a seed reproduces a run per device)."""
        gen = torch.Generator(device=device)
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(self.seed)
        return gen


def sampling_or_greedy(temperature: float, top_k: int = 0, top_p: float = 1.0,
                       seed: int | None = None, min_p: float = 0.0) -> SamplingConfig | None:
    """The sampling settings, or None (greedy) for a temperature below `GREEDY_BELOW`."""
    if not temperature >= 0 or math.isinf(temperature):
        raise UserError(f"temperature must be a finite number >= 0, got {temperature}")
    if temperature < GREEDY_BELOW:
        return None
    return SamplingConfig(temperature, top_k, top_p, seed, min_p)


def process_logits(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p on logits [..., vocab]; removed tokens get -inf."""
    logits = logits.float() / config.temperature
    if config.top_k > 0 and config.top_k < logits.shape[-1]:
        kth_largest = torch.topk(logits, config.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if config.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1)  # ascending
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop the low tail whose mass is at most 1 - p; the most likely token always stays.
        drop_sorted = cumulative <= 1 - config.top_p
        drop_sorted[..., -1] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if config.min_p > 0:
        # p(t) < min_p * p(best)  <=>  logit(t) < logit(best) + log(min_p)
        floor = logits.amax(dim=-1, keepdim=True) + math.log(config.min_p)
        logits = logits.masked_fill(logits < floor, float("-inf"))
    return logits


def next_token_probs(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """The target's next-token distribution p(x) under the sampling settings."""
    return process_logits(logits, config).softmax(dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Draw one token from a 1-D distribution."""
    return int(torch.multinomial(probs, 1, generator=generator))


# Greedy decoding's argmax, and the two best logits the exactness check keeps. PyTorch's CPU
# argmax and top-k walk a row scalar by scalar (~42 and ~115 us for a 49k vocabulary: 0.7 and
# 1.8 ms for a 16-row step, all on one core); the maximum of each block of columns is
# vectorised, so these take two passes: every block's maximum, then inside the best block.
BLOCK = 512  # columns per block


def _blocks(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(rows [n, vocab], their whole blocks [n, blocks, BLOCK], the columns after them), or None
    where the two passes would not pay (off the CPU, or fewer than 4 blocks)."""
    rows = logits.reshape(-1, logits.shape[-1])
    whole = rows.shape[-1] - rows.shape[-1] % BLOCK
    if rows.device.type != "cpu" or whole < 4 * BLOCK:
        return None
    return rows, rows[:, :whole].unflatten(-1, (-1, BLOCK)), rows[:, whole:]


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(-1), the same indices (the first of equal maxima; a NaN counts as the
    largest, as torch.argmax has it): the best block's first maximum, unless a column after
    the whole blocks is strictly larger."""
    split = _blocks(logits)
    if split is None:
        return logits.argmax(-1)
    rows, blocks, tail = split
    best_block = blocks.amax(-1).argmax(-1)
    inside = blocks[torch.arange(len(rows), device=rows.device), best_block]
    best = inside.argmax(-1)
    tokens = best_block * BLOCK + best
    if tail.shape[-1]:
        top = inside.gather(-1, best[:, None])[:, 0]
        tail_best = tail.argmax(-1)
        tail_top = tail.gather(-1, tail_best[:, None])[:, 0]
        later = (tail_top > top) | (tail_top.isnan() & ~top.isnan())
        tokens = torch.where(later, blocks.shape[1] * BLOCK + tail_best, tokens)
    return tokens.view(logits.shape[:-1])


def top_two(logits: torch.Tensor) -> torch.Tensor:
    """logits.topk(2, dim=-1).values for rows without NaN: the best block's two largest, and
    the next block's maximum, whichever two are largest (the tail's two with them)."""
    split = _blocks(logits)
    if split is None:
        return logits.topk(2, dim=-1).values
    rows, blocks, tail = split
    two_blocks = blocks.amax(-1).topk(2, dim=-1)
    best_blocks = blocks[torch.arange(len(rows), device=rows.device), two_blocks.indices[:, 0]]
    inside = best_blocks.topk(2, dim=-1).values
    candidates = [inside, two_blocks.values[:, 1:]]
    if tail.shape[-1]:
        candidates.append(tail.topk(min(2, tail.shape[-1]), dim=-1).values)
    return torch.cat(candidates, -1).topk(2, dim=-1).values.view(*logits.shape[:-1], 2)


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Per row of logits [rows, vocab]: the log-probability of `tokens[row]` and the `top` most
    likely tokens with theirs, under softmax of the logits as the forward gave them (a verify
    row's logits are a plain decode step's on the row-invariant path, so these are too)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, torch.tensor(tokens, device=logits.device)[:, None])[:, 0]
    best = [[] for _ in tokens]
    if top > 0:
        values, ids = logprobs.topk(min(top, logprobs.shape[-1]), dim=-1)
        best = [list(zip(row_ids, row_values, strict=True))
                for row_ids, row_values in zip(ids.tolist(), values.tolist(), strict=True)]
    return [TokenLogprob(token, logprob, alternatives) for token, logprob, alternatives
            in zip(tokens, chosen.tolist(), best, strict=True)]
