"""`dresd calibrate`: measure this machine's verify-cost curve (what `hybrid` budgets by)."""

from __future__ import annotations

import argparse

import torch

from dresd.calibrate import curve_path, load_or_measure
from dresd.cli.options import (
    add_device_option,
    add_dtype_option,
    add_threads_option,
    load_target_from_args,
    set_threads,
)
from dresd.device import device_name
from dresd.models.fastpath import dtype_name
from dresd.models.target import DEFAULT_MODEL


def add_parser(commands: argparse._SubParsersAction) -> None:
    calibrate = commands.add_parser(
        "calibrate", help="measure this machine's verify-cost curve (what `hybrid` budgets by)")
    calibrate.add_argument("--model", default=DEFAULT_MODEL)
    add_threads_option(calibrate)
    add_dtype_option(calibrate)
    add_device_option(calibrate)
    calibrate.add_argument("--force", action="store_true", help="measure again, even if cached")
    calibrate.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    set_threads(args)
    target = load_target_from_args(args)
    cost = load_or_measure(target, force=args.force)
    print(f"verify cost in decode steps ({dtype_name(target.dtype)}, {device_name(target.device)}, "
          f"{torch.get_num_threads()} thread(s)); cached in {curve_path(target)}")
    for size, value in cost.items():
        print(f"  {size:3d} tokens: {value:.2f}")
    return 0
