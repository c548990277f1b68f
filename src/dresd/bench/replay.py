"""Replaying the speculative loop on AR's own outputs, without verify forwards.

Greedy verification accepts exactly the longest tree path that equals the target's own next
tokens, and the output is AR's. So, given AR's tokens for a prompt, the loop replays:

1. one target forward over prompt + AR output gives every position's last-layer hidden state;
2. at a step whose bonus token sits at position i, the drafter proposes from ids[: i + 1] and
   hidden[i - 1] (the state that predicted the bonus token, as in the engine);
3. the drafts merge into a token tree; accepted = the longest tree path equal to ids[i + 1 :];
4. the next step's bonus token is at i + accepted + 1.

Up to float noise in the hidden states (one forward instead of the incremental ones, which can
move an ANN neighbour) these are the engine's own steps. A step is priced with the machine's
verify-cost curve (`dresd calibrate`): cost(1 + tree nodes) decode steps, plus the drafting time
measured in CPU time (`process_time`, so that other jobs on the machine do not inflate it):

    est. speedup = tokens x t_step / (sum over steps of (cost(1 + nodes) x t_step + t_draft)
                                      + t_step)                 (+ t_step: the prefill's token)

with t_step AR's time per token. It is an estimate; `dresd bench` measures the real figure.

Live, a verify forward streams the model's weights through the caches between two drafting
calls, so a drafter finds its own data evicted; back to back in a replay it finds it warm, and
pointer-heavy drafters (tries of dicts) look 2-5x cheaper than they are. `evict_bytes` reads a
buffer that large between calls, outside the timed region, to price drafting as a live run
sees it (the bf16 weights' size is the honest choice).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from dresd.calibrate import cost_at
from dresd.decoding.tree import DraftTree
from dresd.drafters import DraftContext
from dresd.models.target import Target


@dataclass
class Reference:
    ids: list[int]  # prompt + AR output
    prompt_len: int
    hidden: np.ndarray | None  # [len(ids), d] float32: every position's last-layer state
    # (None: for drafters that read tokens only)


def reference(target: Target, prompt: list[int], output: list[int]) -> Reference:
    """A prompt and AR's output, with the states of one forward over both."""
    ids = prompt + output
    with torch.inference_mode():
        hidden = target.model.base_model(input_ids=torch.tensor([ids])).last_hidden_state
    return Reference(ids, len(prompt), hidden[0].float().numpy())


def accepted_length(tree: DraftTree, future: list[int]) -> int:
    """Greedy verification: how far the tree follows the target's own next tokens."""
    node, accepted = 0, 0
    for token in future:
        node = tree.children[node].get(token)
        if node is None:
            break
        accepted += 1
    return accepted


Propose = Callable[[int, int, int], list]  # (reference number, bonus position i, tokens left)


def drafter_proposer(drafter, refs: list[Reference]) -> Propose:
    """`propose` of a real drafter, fed the context the engine would give it."""
    def propose(n: int, i: int, remaining: int) -> list:
        ref = refs[n]
        tokens = np.asarray(ref.ids[: i + 1], dtype=np.int64)
        hidden = None if ref.hidden is None else torch.from_numpy(ref.hidden[i - 1])
        return drafter.propose(DraftContext(tokens, hidden, remaining))
    return propose


def replay(refs: list[Reference], propose: Propose, drafter=None, evict_bytes: int = 0
           ) -> tuple[list[tuple[int, int]], float]:
    """(tree nodes, accepted) per step over every reference, in order, and the CPU seconds
    `propose` took. A `drafter` that learns from finished outputs (`observe`) is shown each
    reference's output after its steps, as the engine does. `evict_bytes` > 0: that much
    memory is read before every call, as a verify forward would (module docstring)."""
    sweep = np.ones(evict_bytes // 8) if evict_bytes > 0 else None
    steps, seconds = [], 0.0
    for n, ref in enumerate(refs):
        i = ref.prompt_len
        while i < len(ref.ids) - 1:
            remaining = len(ref.ids) - 1 - i
            if sweep is not None:
                sweep.sum()  # stream it through the caches, evicting the drafter's data
            started = time.process_time()
            drafts = propose(n, i, remaining)
            seconds += time.process_time() - started
            tree = DraftTree.from_drafts(ref.ids[i], [d[:remaining] for d in drafts if len(d)])
            accepted = accepted_length(tree, ref.ids[i + 1 :])
            steps.append((tree.num_drafted, accepted))
            i += accepted + 1
        drafter.observe(ref.ids[: ref.prompt_len], ref.ids[ref.prompt_len :])
    return steps, seconds


def summarise(steps: list[tuple[int, int]], draft_seconds: float, tokens: int,
              curve: dict[int, float], step_seconds: float) -> dict:
    """The figures of one replayed method (see the module docstring)."""
    nodes = np.array([n for n, _ in steps])
    accepted = np.array([a for _, a in steps])
    verify = sum(cost_at(curve, 1 + int(n)) for n in nodes) * step_seconds
    return {"mean_accepted_length": float((accepted + 1).mean()),
            "acceptance_rate": float(accepted.sum() / max(nodes.sum(), 1)),
            "drafted_per_step": float(nodes.mean()), "steps": len(steps),
            "draft_ms_per_step": 1e3 * draft_seconds / len(steps),
            "draft_share": draft_seconds / (verify + draft_seconds),
            "est_speedup": tokens * step_seconds / (verify + draft_seconds + step_seconds)}
