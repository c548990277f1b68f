"""Drafters, one module each, behind the interface in `base.py`."""

from __future__ import annotations

from dresd.drafters.base import Draft, DraftContext, Drafter
from dresd.drafters.lookup import PromptLookupDrafter
from dresd.drafters.none import NoDrafter

__all__ = ["Draft", "DraftContext", "Drafter", "NoDrafter", "PromptLookupDrafter"]
