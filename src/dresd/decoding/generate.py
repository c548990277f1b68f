"""Single-stream speculative generation: the batched loop (`decoding/batch.py`) with one
request in it.

    prompt -> prefill -> first token
    loop:  drafter proposes drafts after the last token -> merge into a token tree
           -> one target forward over the tree (tree mask, per-node positions, on the KV cache)
           -> accept the longest agreeing path + one bonus token -> compact the KV cache
           -> the hidden state at the last accepted node is the next step's query

Lossless: with greedy acceptance the output is token for token plain greedy decoding; with
sampling acceptance every token is drawn from the model's own distribution (see verify.py).

Device: every tensor the loop makes (prompt ids, tree ids, mask, positions, the sampling
generator) is created on the model's device. Per step the host reads back only the tokens it
accepts; the drafter gets the query state where it is and moves it itself, once, if its index
lives elsewhere (`drafters/dense.py`). Timings wait for the device (`clock`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from dresd.decoding.batch import BatchEngine, Request
from dresd.decoding.drafter import Drafter
from dresd.decoding.forward import supports_tree_attention
from dresd.decoding.sampling import SamplingConfig
from dresd.decoding.stopping import StoppingRule
from dresd.metrics import GenerationResult

__all__ = ["StoppingRule", "speculative_generate", "supports_tree_attention", "target_forward"]


def target_forward(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    cache: DynamicCache | None,
    position_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    logits_to_keep: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward of transformers' own model; returns (logits [t, vocab], last-layer hidden
    states [t, d]). The reference the batched forward is tested against.

    `logits_to_keep=1` computes the LM head on the last position only (prefill); 0 keeps all.
    """
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        cache=cache,
        use_cache=cache is not None,
        output_hidden_states=True,
        logits_to_keep=logits_to_keep,
    )
    return out.logits[0], out.hidden_states[-1][0]


@torch.inference_mode()
def speculative_generate(
    model: PreTrainedModel,
    drafter: Drafter,
    input_ids: torch.Tensor,
    *,
    max_new_tokens: int = 128,
    sampling: SamplingConfig | None = None,
    eos_token_ids: Sequence[int] = (),
    stop_strings: Sequence[str] = (),
    tokenizer: PreTrainedTokenizerBase | None = None,
    max_length: int | None = None,
    on_tokens: Callable[[list[int]], bool] | None = None,
    engine: BatchEngine | None = None,
) -> GenerationResult:
    """Generate up to `max_new_tokens` after `input_ids` ([1, n] or [n]) with `drafter`'s drafts.

    Greedy when `sampling` is None. Returns the new tokens and one record per verify step.
    `max_length` bounds prompt + output (the model's context); drafts never cross it.
    `on_tokens`, if given, gets each step's emitted tokens as they are accepted (streaming);
    returning False stops the generation there (stop reason "cancelled"). `engine`: an idle
    `BatchEngine` of `model` to reuse (its forward and buffers), else a new one.
    """
    engine = engine or BatchEngine(model, max_batch_size=1)
    state = engine.add(Request(
        prompt=input_ids.reshape(-1).tolist(),  # `input_ids` may be on any device
        drafter=drafter,
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        eos_token_ids=eos_token_ids,
        stop_strings=stop_strings,
        tokenizer=tokenizer,
        max_length=max_length,
        on_tokens=on_tokens,
    ))
    engine.run()
    return state.result
