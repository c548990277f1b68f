"""What a bench report records about its run: model, settings, machine, software, drafters.

Everything a reader needs to reproduce the figures or to know why they differ from another
run's: the dtype and attention that ran, the CPU, library versions, each method's drafter
options, the verify-cost curve `hybrid` budgeted by, and the datastore's manifest.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import torch
import transformers

from dresd.bench.methods import drafter_settings
from dresd.device import device_name
from dresd.host import cpu_model, native_bf16_flags
from dresd.models.fastpath import attention_name, dtype_name
from dresd.models.target import Target
from dresd.runner import GenerationSettings, MethodRunner


def bench_metadata(target: Target, runners: list[MethodRunner], settings: GenerationSettings,
                   datasets: list[str], num_prompts: int, datastore: Path | None) -> dict:
    """The report's `meta` object for a run of `runners` (one per method label)."""
    meta = {
        "model": target.name,
        "methods": [r.label for r in runners],
        "datasets": datasets,
        "prompts": num_prompts,
        "max_new_tokens": settings.max_new_tokens,
        "sampling": "greedy" if settings.sampling is None else vars(settings.sampling),
        "threads": torch.get_num_threads(),
        "dtype": dtype_name(target.dtype),
        "device": device_name(target.device),
        "linears": target.linears,
        "attention": attention_name(target.model),
        "cpu": cpu_model(),
        "cpu_native_bf16": native_bf16_flags(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "drafter_options": {r.label: drafter_settings(r.drafter) for r in runners if r.drafter},
    }
    curves = {r.label: r.drafter.cost for r in runners if getattr(r.drafter, "cost", None)}
    if curves:  # what `hybrid` budgeted by: the verify cost by tree tokens, in decode steps
        meta["verify_cost_curve"] = next(iter(curves.values()))
    if datastore and (datastore / "manifest.json").is_file():
        meta["datastore"] = str(datastore)
        meta["datastore_manifest"] = json.loads((datastore / "manifest.json").read_text())
    return meta
