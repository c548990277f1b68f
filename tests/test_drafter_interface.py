"""Every drafter is a `Drafter`: `propose`, and the hooks `check_target` and `observe` that the
loop and `hybrid` call without asking whether a drafter has them."""

from __future__ import annotations

import dataclasses

from dresd.decoding.drafter import Drafter
from dresd.drafters import DRAFTERS


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
