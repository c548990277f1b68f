"""Drafters, one module each, behind the interface in `dresd/decoding/drafter.py`."""

from __future__ import annotations

from dresd.decoding.drafter import Candidate, Draft, DraftContext, Drafter
from dresd.drafters.dense import DenseDrafter
from dresd.drafters.hybrid import HybridDrafter
from dresd.drafters.lookup import PromptLookupDrafter
from dresd.drafters.model import DraftModelDrafter
from dresd.drafters.mtp import MTPDrafter
from dresd.drafters.none import NoDrafter
from dresd.drafters.rest import RestDrafter
from dresd.drafters.suffix import SuffixDrafter
from dresd.errors import UserError

# method name -> drafter class; each takes its options (its dataclass fields) as keywords
DRAFTERS: dict[str, type] = {
    "none": NoDrafter,
    "pld": PromptLookupDrafter,
    "draft": DraftModelDrafter,
    "dresd": DenseDrafter,  # needs datastore=DIR
    "rest": RestDrafter,  # needs datastore=DIR
    "suffix": SuffixDrafter,  # SuffixDecoding: suffix tries over the request and past outputs
    "hybrid": HybridDrafter,  # PLD, and REST / DReSD from datastore=DIR if given
    "mtp": MTPDrafter,  # the target's own MTP block (a Qwen3.5 GGUF file that keeps one)
}


def make_drafter(method: str, **options) -> Drafter:
    """The drafter for `method`, built with the options that apply to it (None = default)."""
    if method not in DRAFTERS:
        raise UserError(f"unknown method {method!r}; choose from ar, {', '.join(DRAFTERS)}")
    cls = DRAFTERS[method]
    fields = getattr(cls, "__dataclass_fields__", {})
    return cls(**{k: v for k, v in options.items() if k in fields and v is not None})


__all__ = ["DRAFTERS", "Candidate", "DenseDrafter", "Draft", "DraftContext", "DraftModelDrafter",
           "Drafter", "HybridDrafter", "MTPDrafter", "NoDrafter", "PromptLookupDrafter",
           "RestDrafter", "SuffixDrafter", "make_drafter"]
