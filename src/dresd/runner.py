"""Run one generation method on a loaded target: `ar` or any drafter through the speculative loop.

`ar` is plain `transformers` `generate`: the reference every method is compared with. The other
methods are drafters (see `dresd.drafters`) driving `speculative_generate`; `none` drafts nothing
and so is plain decoding through the same loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dresd.decoding import SamplingConfig, speculative_generate
from dresd.device import clock
from dresd.drafters import Drafter, make_drafter
from dresd.metrics import GenerationResult
from dresd.models import Target

AR = "ar"


@dataclass
class GenerationSettings:
    max_new_tokens: int = 128  # new tokens at most
    sampling: SamplingConfig | None = None  # None: greedy
    stop_strings: list[str] = field(default_factory=list)  # end after the token completing one

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


class MethodRunner:
    """Generates with one method; the same settings make methods comparable."""

    def __init__(
        self,
        target: Target,
        method: str,
        settings: GenerationSettings,
        label: str | None = None,
        **drafter_options,
    ) -> None:
        self.target = target
        self.method = method
        self.label = label or method  # its name in reports: "dresd[max_tree_nodes=2]"
        self.settings = settings
        self.drafter: Drafter | None = (
            None if method == AR else make_drafter(method, **drafter_options)
        )
        # Drafters bound to a model (datastores) refuse a target they were not built for.
        check_target = getattr(self.drafter, "check_target", None)
        if check_target is not None:
            check_target(target)

    def check_fits(self, prompt_ids: list[int]) -> int:
        """How many new tokens the prompt leaves room for; an error if it fills the context."""
        limit = self.target.max_length
        if limit is None:
            return self.settings.max_new_tokens
        if len(prompt_ids) >= limit:
            raise ValueError(
                f"the prompt has {len(prompt_ids)} tokens; the model's context is {limit} tokens"
            )
        return min(self.settings.max_new_tokens, limit - len(prompt_ids))

    def generate(self, prompt_ids: list[int]) -> GenerationResult:
        max_new_tokens = self.check_fits(prompt_ids)
        input_ids = torch.tensor([prompt_ids], device=self.target.device)
        if self.drafter is None:
            return self._hf_generate(input_ids, max_new_tokens)
        return speculative_generate(
            self.target.model,
            self.drafter,
            input_ids,
            max_new_tokens=max_new_tokens,
            sampling=self.settings.sampling,
            eos_token_ids=self.target.eos_token_ids,
            stop_strings=self.settings.stop_strings,
            tokenizer=self.target.tokenizer,
            max_length=self.target.max_length,
        )

    @torch.inference_mode()
    def _hf_generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> GenerationResult:
        sampling = self.settings.sampling
        options: dict = {"do_sample": False}
        if sampling is not None:
            torch.manual_seed(sampling.seed if sampling.seed is not None else torch.seed())
            # top_k=0 spells "no top-k" for generate, whose own default would be 50.
            options = dict(
                do_sample=True,
                temperature=sampling.temperature,
                top_k=sampling.top_k,
                top_p=sampling.top_p,
            )
        if self.settings.stop_strings:
            options.update(stop_strings=self.settings.stop_strings, tokenizer=self.target.tokenizer)
        eos = self.target.eos_token_ids
        device = self.target.device
        started = clock(device)
        output = self.target.model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            eos_token_id=eos or None,
            pad_token_id=eos[0] if eos else 0,
            output_logits=True,  # keeps each step's raw logits: a reference, at no extra work
            return_dict_in_generate=True,
            **options,
        )
        seconds = clock(device) - started
        new_tokens = output.sequences[0, input_ids.shape[1] :].tolist()
        top2 = torch.stack([step[0] for step in output.logits]).float().topk(2, dim=-1).values
        # generate runs one forward per new token: the prefill gives the first.
        return GenerationResult(
            token_ids=new_tokens, total_seconds=seconds, num_target_forwards=len(new_tokens),
            top2_logits=[(a, b) for a, b in top2.tolist()] if sampling is None else None,
        )
