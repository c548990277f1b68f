"""The one small interface every drafter implements.

At each step the loop hands the drafter a `DraftContext` and gets back a list of drafts: token
sequences that would follow the context's last token (the bonus token the target just emitted).
Drafts come in the drafter's order of preference; the loop merges them into one token tree and
verifies it in one target forward. A drafter may return no drafts: the step is then a plain
one-token decode.

A drafter that drafts for another (`hybrid` merges several sources into one tree) asks for
`candidates` instead: the same drafts, each with what its drafter knows of it (how many
retrieved neighbours propose it, how often its tokens followed in the drafter's data). Those
are features `hybrid` learns acceptance by, without knowing which drafter it asks.

Two more hooks, both no-ops unless a drafter needs them: `check_target` before the first step
(a datastore refuses a model it was not built for; `hybrid` measures the verify-cost curve it
budgets by) and `observe` after a generation ends (drafters that learn from finished outputs).
The batched loop runs `observe` beside its next forward, where the forward leaves a core free,
so that learning an output never delays a step.

A drafter's options are the fields of a frozen dataclass it derives from (what `make_drafter`
passes, `--methods` may set and a bench report records); what it opens, learns or caches are
plain attributes beside them. `fork` gives one more generation its own per-generation state,
`with_options` another shape that shares what the drafter opened.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

if TYPE_CHECKING:
    from dresd.models.target import Target

Draft = list[int]


@dataclass
class DraftContext:
    token_ids: np.ndarray  # int64 [n]: prompt + output so far; the last is the bonus token
    # [d]: the target's last-layer hidden state at the position that predicted the bonus token,
    # on the model's device (a drafter whose index lives in host memory moves it there)
    hidden_state: torch.Tensor
    max_draft_len: int  # drafts are cut to this many tokens (fewer remain to be generated)
    # The step it drafts for: how many sequences decode in it (each one's drafting holds up
    # all of them), and the batch's previous step, its tokens and its seconds (drafting and the
    # forward; 0.0 where there was none): what a drafter that prices its own time weighs it
    # against under load (`hybrid`'s source ledger).
    batch_size: int = 1
    batch_tokens: int = 0
    batch_seconds: float = 0.0
    # [k, d]: the hidden states of the k positions before the bonus token that the last step
    # kept (its accepted path; after the prompt, its last chunk's rows), ending with
    # `hidden_state`; for a drafter that follows every position (MTP). None: only the last.
    hidden_states: torch.Tensor | None = None


class Candidate(NamedTuple):
    """A draft with what its drafter knows of it: the features `hybrid` learns acceptance by."""

    tokens: Draft
    # how many of the drafter's retrieved neighbours propose it (DReSD: neighbours that agree
    # make a draft likelier); 0 from a drafter that retrieves no neighbours
    neighbours: int = 0
    # per token, the share of the drafter's occurrences of what precedes it that continue with
    # it (SuffixDecoding's count(s + [t]) / count(s)); None from a drafter that counts none
    shares: list[float] | None = None


class Drafter:
    """What every drafter is: `propose` is its own; the hooks do nothing unless it overrides
    them. `make_drafter` builds one by name from its options."""

    name: str  # the method, as --method spells it
    # True for a drafter that prices its own trees by the verify-cost curve (hybrid): the
    # batched loop then cuts its trees only when other sequences share the forward
    sizes_its_trees: bool = False

    def propose(self, context: DraftContext) -> list[Draft]:
        """Drafts continuing `context.token_ids`, best first."""
        raise NotImplementedError

    def candidates(self, context: DraftContext) -> list[Candidate]:
        """`propose`'s drafts with their features, for a drafter that merges several drafters'
        candidates (`hybrid`). A drafter that knows nothing more of its drafts gives none."""
        return [Candidate(draft) for draft in self.propose(context)]

    def check_target(self, target: Target) -> None:
        """Called once with the target before generating: refuse one this drafter cannot
        serve, or prepare what depends on it."""

    def fork(self) -> Drafter:
        """A drafter for one more generation running beside this one's (the batched loop
        interleaves their steps): it shares what is learned across generations (datastores,
        learned outputs, acceptance statistics) and keeps its own per-generation state.
        Drafters with no per-generation state are their own fork."""
        return self

    def with_options(self, **options) -> Drafter:
        """This drafter with some options changed (a server request's own tree shape, say),
        built anew from them; a drafter that opened a datastore shares it instead of opening it
        again. A UserError if an option's value is refused."""
        return dataclasses.replace(self, **options)

    def for_tenant(self) -> Drafter:
        """This drafter for another tenant of a server: the same options, sharing what it
        opened, learning from that tenant's outputs alone (nothing it learned so far)."""
        return self.with_options()

    def observe(self, prompt: Sequence[int], output: Sequence[int],
                hidden_states: torch.Tensor | None = None) -> None:
        """Called with every finished generation (`hidden_states`: the target's last-layer
        states of `output`, where the loop kept them), for drafters that learn from outputs.
        The batched loop calls it beside its next forward: a request that starts in the next
        step drafts without it, those after with it."""
