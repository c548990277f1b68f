"""Every drafter is a `Drafter`: `propose`, `candidates` for `hybrid`, and the hooks
`check_target` and `observe` that the loop and `hybrid` call without asking whether a drafter
has them; its options are a dataclass apart from what it learns."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from dresd.decoding.drafter import Candidate, DraftContext, Drafter
from dresd.drafters import DRAFTERS, PromptLookupDrafter, SuffixDrafter


def test_every_drafter_is_a_drafter():
    for method, cls in DRAFTERS.items():
        assert issubclass(cls, Drafter), method


def test_the_hooks_do_nothing_by_default():
    class Quiet(Drafter):
        name = "quiet"

    drafter = Quiet()
    assert drafter.check_target(object()) is None
    assert drafter.observe([1, 2], [3]) is None


def test_one_name_per_option():
    """draft_len is spelled one way by every drafter that has it (DReSD once said len_drafts)."""
    for method, cls in DRAFTERS.items():
        assert "len_drafts" not in getattr(cls, "__dataclass_fields__", {}), method
    assert "draft_len" in {f.name for f in dataclasses.fields(DRAFTERS["dresd"])}


def test_a_drafter_that_knows_nothing_more_gives_its_drafts_as_featureless_candidates():
    context = DraftContext(np.array([1, 2, 3, 1, 2]), torch.zeros(1), 10)
    drafter = PromptLookupDrafter()
    assert drafter.candidates(context) == [Candidate(draft) for draft in drafter.propose(context)]
    assert drafter.candidates(context) == [Candidate([3, 1, 2], neighbours=0, shares=None)]


def test_options_are_the_fields_and_frozen():
    """A drafter's dataclass fields are its options and nothing else (what it opens or learns
    is no field); they cannot change under it, except hybrid's, whose `check_target` fills in
    the measured cost curve."""
    for method, cls in DRAFTERS.items():
        if method == "none":
            assert not dataclasses.is_dataclass(cls)
            continue
        fields = dataclasses.fields(cls)
        assert all(f.init and f.repr and not f.name.startswith("_") for f in fields), method
        assert "name" not in {f.name for f in fields}, method
        assert cls.__dataclass_params__.frozen == (method != "hybrid"), method
    suffix = SuffixDrafter(max_tree_nodes=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        suffix.max_tree_nodes = 4


def test_with_options_gives_another_shape_and_fork_shares_what_is_learned():
    suffix = SuffixDrafter(max_tree_nodes=8)
    suffix.observe([1], [5, 6, 7, 5, 6])
    variant = suffix.with_options(max_tree_nodes=2)
    assert (variant.max_tree_nodes, suffix.max_tree_nodes) == (2, 8)
    assert variant.min_token_prob == suffix.min_token_prob and variant.name == "suffix"
    forked = suffix.fork()
    assert forked.global_trie is suffix.global_trie
    assert forked.request_trie is not suffix.request_trie
