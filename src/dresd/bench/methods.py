"""The method names, and the `--methods` mini-language that gives a method its own options.

    --methods 'ar,pld,dresd[max_tree_nodes=2,k=20],rest[max_tree_nodes=2]'

Each entry is a method with, optionally, drafter options in brackets (the drafter's field
names, numbers only, and `budget=0` for a fixed shape), so that one run compares several
shapes of the same method; the entry as written is its label in the report.
"""

from __future__ import annotations

import math
import re

from dresd.drafters import DRAFTERS
from dresd.errors import UserError
from dresd.runner import AR

METHODS = [AR, *DRAFTERS]  # every --method: the reference, then each drafter

# Drafter fields a --methods entry cannot set: they are objects, or shared by the whole run.
NOT_PER_METHOD = ("datastore", "name", "model", "cost")
# Options of the loop rather than the drafter: `budget=0` verifies the drafts as drafted
# (`--no-budget`), e.g. `dresd[budget=0]`, DReSD at the paper's shape.
LOOP_OPTIONS = ("budget",)


def parse_methods(text: str) -> list[tuple[str, str, dict]]:
    """(label, method, options) for each entry of --methods: `pld`, or a method with its own
    drafter options, `dresd[max_tree_nodes=2,k=20]` (so one run can compare shapes)."""
    specs, seen = [], set()
    for label in re.findall(r"[^,\[\]]+(?:\[[^\]]*\])?", text.replace(" ", "")):
        method, _, inside = label.partition("[")
        if method not in METHODS:
            raise UserError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
        fields = getattr(DRAFTERS.get(method), "__dataclass_fields__", {})
        known = [k for k, f in fields.items() if f.init and k not in NOT_PER_METHOD]
        known += list(LOOP_OPTIONS) if method != AR else []
        options = {}
        for item in filter(None, inside.rstrip("]").split(",")):
            key, equals, value = item.partition("=")
            if not equals or key not in known:
                raise UserError(f"--methods {label}: {item!r} is not OPTION=VALUE with an option "
                                f"of {method} ({', '.join(known) or 'none'})")
            options[key] = parse_number(value)
            if not isinstance(options[key], int | float) or not math.isfinite(options[key]):
                raise UserError(f"--methods {label}: {key} must be a number, got {value!r}")
        if label in seen:
            raise UserError(f"--methods lists {label} twice")
        seen.add(label)
        specs.append((label, method, options))
    if not specs:
        raise UserError("--methods lists no method")
    return specs


def parse_number(value: str) -> int | float | str:
    """`2` -> 2, `0.5` -> 0.5, anything else stays text."""
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def drafter_settings(drafter: object) -> dict:
    """A drafter's plain options (numbers, strings), for the record."""
    fields = getattr(drafter, "__dataclass_fields__", {})
    values = {name: getattr(drafter, name) for name, f in fields.items() if f.repr}
    return {k: v for k, v in values.items() if isinstance(v, int | float | str)}
