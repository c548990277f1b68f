"""The speculative decoding loop: draft, verify the drafts' tree in one forward, keep what agrees.

    prompt -> prefill -> first token
    loop:  drafter proposes drafts after the last token -> merge into a token tree
           -> one target forward over the tree (tree mask, per-node positions, on the KV cache)
           -> accept the longest agreeing path + one bonus token -> compact the KV cache
           -> the hidden state at the last accepted node is the next step's query

Lossless: with greedy acceptance the output is token for token plain greedy decoding; with
sampling acceptance every token is drawn from the model's own distribution (see verify.py).

Device: every tensor the loop makes (prompt ids, tree ids, mask, positions, the cache index,
the sampling generator) is created on the model's device. Per step the host reads back only
the tokens it accepts; the drafter gets the query state where it is and moves it itself, once,
if its index lives elsewhere (`drafters/dense.py`). Timings wait for the device (`clock`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from dresd.decoding.cache import keep_cache_entries
from dresd.decoding.drafter import DraftContext, Drafter
from dresd.decoding.sampling import SamplingConfig, next_token_probs, sample
from dresd.decoding.tree import DraftTree
from dresd.decoding.verify import greedy_accept, sampling_accept
from dresd.device import clock
from dresd.metrics import GenerationResult, StepRecord


def target_forward(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    cache: DynamicCache | None,
    position_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    logits_to_keep: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward of the target; returns (logits [t, vocab], last-layer hidden states [t, d]).

    The last-layer hidden state (after the final norm) comes with the forward at no extra cost:
    it is what retrieval drafters use as their query. `logits_to_keep=1` computes the LM head on
    the last position only (prefill); 0 keeps all positions.
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
def supports_tree_attention(model: PreTrainedModel) -> bool:
    """Whether the model honours a custom 4D attention mask with custom position ids.

    Checked, not guessed: token c at position 1 masked off from token b (also at position 1)
    must give the same logits as the plain sequence [a, c]. A model that ignores or rejects
    the mask fails the check and is verified with linear drafts only.
    """
    cached = getattr(model, "_dresd_tree_attention", None)
    if cached is not None:
        return cached
    vocab = model.config.vocab_size
    a, b, c = 1 % vocab, 2 % vocab, 3 % vocab
    tree = DraftTree(tokens=[a, b, c], parents=[-1, 0, 0], depths=[0, 1, 1])
    dtype, device = next(model.parameters()).dtype, next(model.parameters()).device
    try:
        tree_logits, _ = target_forward(
            model,
            tree.input_ids(device),
            cache=None,
            position_ids=tree.position_ids(0, device),
            attention_mask=tree.attention_mask(0, dtype, device),
        )
        plain_logits, _ = target_forward(model, torch.tensor([[a, c]], device=device), cache=None)
        scale = plain_logits[1].abs().max().clamp_min(1e-6)
        # A mask that is ignored changes logits by O(1); reduced precision moves them by a
        # few ulps (bf16: eps = 2^-7), which must not read as "ignored".
        tolerance = max(1e-3, 8 * torch.finfo(dtype).eps)
        ok = bool(((tree_logits[2] - plain_logits[1]).abs().max() / scale) < tolerance)
    except Exception:  # noqa: BLE001 - any failure means "cannot take a tree mask"
        ok = False
    model._dresd_tree_attention = ok
    return ok


class StoppingRule:
    """Ends generation exactly where plain decoding would: after an EOS token, after the token
    that completes a stop string, or at `max_new_tokens`. Checked after every emitted token."""

    def __init__(
        self,
        max_new_tokens: int,
        eos_token_ids: Sequence[int] = (),
        stop_strings: Sequence[str] = (),
        tokenizer: PreTrainedTokenizerBase | None = None,
    ) -> None:
        if stop_strings and tokenizer is None:
            raise ValueError("stop strings need the tokenizer to decode the output")
        self.max_new_tokens = max_new_tokens
        self.eos_token_ids = set(eos_token_ids)
        self.stop_strings = [s for s in stop_strings if s]
        self.tokenizer = tokenizer
        # Enough trailing tokens to hold the longest stop string (every token is >= 1 char).
        self.window = max((len(s) for s in self.stop_strings), default=0) + 2

    def reason(self, new_tokens: list[int]) -> str | None:
        if new_tokens and new_tokens[-1] in self.eos_token_ids:
            return "eos"
        if self.stop_strings:
            tail = self.tokenizer.decode(new_tokens[-self.window :])
            if any(s in tail for s in self.stop_strings):
                return "stop_string"
        if len(new_tokens) >= self.max_new_tokens:
            return "max_new_tokens"
        return None


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
) -> GenerationResult:
    """Generate up to `max_new_tokens` after `input_ids` ([1, n] or [n]) with `drafter`'s drafts.

    Greedy when `sampling` is None. Returns the new tokens and one record per verify step.
    `max_length` bounds prompt + output (the model's context); drafts never cross it.
    `on_tokens`, if given, gets each step's emitted tokens as they are accepted (streaming);
    returning False stops the generation there (stop reason "cancelled").
    """
    device = next(model.parameters()).device
    started = clock(device)
    prompt = input_ids.reshape(-1).tolist()  # `input_ids` may be on any device
    if not prompt:
        raise ValueError("the prompt is empty")
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    max_length = max_length or len(prompt) + max_new_tokens
    tree_attention = supports_tree_attention(model)
    dtype = next(model.parameters()).dtype
    generator = sampling.generator(device) if sampling else None
    stopping = StoppingRule(max_new_tokens, eos_token_ids, stop_strings, tokenizer)

    def choose(logits: torch.Tensor) -> int:
        if sampling is None:
            return int(logits.argmax())
        return sample(next_token_probs(logits, sampling), generator)

    # 1. Prefill: the prompt enters the cache; its last position gives the first token.
    cache = DynamicCache(config=model.config)
    logits, hidden = target_forward(model, torch.tensor([prompt], device=device), cache,
                                    logits_to_keep=1)
    query = hidden[-1]  # the state that predicted the pending token: the drafter's query
    emitted = [choose(logits[-1])]
    context = np.array(prompt + [0] * (max_new_tokens + 1), dtype=np.int64)
    n = len(prompt)  # tokens in `context`; the cache holds all but the last one
    result = GenerationResult(token_ids=[], prefill_seconds=clock(device) - started)
    observe = getattr(drafter, "observe", None)  # a drafter that learns sees what was generated
    states = [hidden[-1:]]  # states[j] predicted output token j: keys for a learning drafter

    while True:
        # 2. Emit the step's tokens one by one, stopping where plain decoding would stop.
        first = len(result.token_ids)
        for token in emitted:
            context[n] = token
            n += 1
            result.token_ids.append(token)
            result.stop_reason = stopping.reason(result.token_ids) or ""
            if result.stop_reason:
                break
        if not result.stop_reason and n >= max_length:
            result.stop_reason = "max_length"
        if on_tokens is not None and on_tokens(result.token_ids[first:]) is False:
            result.stop_reason = result.stop_reason or "cancelled"
        if result.stop_reason:
            break

        # 3. Draft continuations of the last token; merge them into a tree rooted at it.
        draft_started = clock(device)
        max_draft_len = min(max_new_tokens - len(result.token_ids) - 1, max_length - n)
        drafts = drafter.propose(DraftContext(context[:n], query, max_draft_len))
        drafts = [d[:max_draft_len] for d in drafts if len(d) > 0 and max_draft_len > 0]
        if not tree_attention:
            drafts = drafts[:1]  # a causal mask can only verify one linear draft
        tree = DraftTree.from_drafts(int(context[n - 1]), drafts)
        verify_started = clock(device)

        # 4. Verify: one forward over the whole tree on top of the cache (which holds n-1).
        prefix_len = n - 1
        mask = None if tree.is_linear() else tree.attention_mask(prefix_len, dtype, device)
        logits, hidden = target_forward(
            model, tree.input_ids(device), cache, tree.position_ids(prefix_len, device), mask
        )

        # 5. Accept the longest path the target agrees with, plus its own next token.
        if sampling is None:
            path, bonus = greedy_accept(tree, logits)
        else:
            path, bonus = sampling_accept(tree, logits, sampling, generator)

        # 6. Keep only the accepted path in the cache; its last state is the next query.
        keep_cache_entries(cache, prefix_len, path)
        query = hidden[path[-1]]
        if observe is not None:
            states.append(hidden[path])
        emitted = [tree.tokens[node] for node in path[1:]] + [bonus]
        result.steps.append(
            StepRecord(
                num_drafted=tree.num_drafted,
                num_accepted=len(path) - 1,
                draft_depth=tree.depth,
                draft_seconds=verify_started - draft_started,
                verify_seconds=clock(device) - verify_started,
            )
        )

    if observe is not None:  # a drafter that learns keeps what the model just said
        observe(prompt, result.token_ids, torch.cat(states)[: len(result.token_ids)])
    result.num_target_forwards = 1 + len(result.steps)
    result.total_seconds = clock(device) - started
    return result
