"""Sampling settings and the pure helpers that turn logits into a next-token distribution.

The processing is the one `transformers.generate` applies, in the same order (temperature, then
top-k, then top-p), so that "the model's own distribution" means the same thing for plain
decoding and for every speculative method.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dresd.errors import UserError


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 1.0  # > 0; logits are divided by it
    top_k: int = 0  # keep the k most likely tokens (0: all)
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches p (1.0: all)
    seed: int | None = None  # seeds the generator that draws every sample

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise UserError(f"temperature must be > 0 for sampling, got {self.temperature}")
        if self.top_k < 0:
            raise UserError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"top_p must be in (0, 1], got {self.top_p}")

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        """The generator of every sample, on the device the probabilities live on (a CUDA
        stream of random numbers differs from the CPU's: a seed reproduces a run per device)."""
        gen = torch.Generator(device=device)
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(self.seed)
        return gen


def process_logits(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """Temperature, top-k and top-p on logits [..., vocab]; removed tokens get -inf."""
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
    return logits


def next_token_probs(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """The target's next-token distribution p(x) under the sampling settings."""
    return process_logits(logits, config).softmax(dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Draw one token from a 1-D distribution."""
    return int(torch.multinomial(probs, 1, generator=generator))
