"""Where the model runs: `--device auto|cpu|cuda[:N]`, and clocks that read true on a GPU.

One rule for the whole package: every tensor the loop feeds the model is created on the model's
device (`next(model.parameters()).device`), never on the CPU and copied later. What crosses to
the CPU is what the host must read anyway: the accepted tokens (one small copy per step) and a
retrieval drafter's query, where its index lives in host memory (FAISS CPU).

Nothing falls back silently: asking for CUDA where none is usable is an error that says so.
"""

from __future__ import annotations

from time import perf_counter

import torch

from dresd.errors import DresdError

DEVICE_HELP = ("where the model runs: auto (default: CUDA when available, else the CPU), cpu, "
               "cuda, cuda:N")


class DeviceError(DresdError, ValueError):
    """A device that cannot be used here; the message says why."""


def resolve_device(name: str | torch.device = "auto") -> torch.device:
    """The torch device for a --device value: `auto`, `cpu`, `cuda` or `cuda:N`.

    `auto` is the first CUDA device when one is usable, else the CPU. `cuda` without CUDA, or
    a CUDA index past the last device, is a DeviceError, not a quiet CPU run.
    """
    if isinstance(name, str) and name == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise DeviceError(f"unknown device {name!r}; choose auto, cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise DeviceError(f"unknown device {name!r}; choose auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        why = ("this PyTorch is built without CUDA" if torch.version.cuda is None
               else "no CUDA device is visible (driver, CUDA_VISIBLE_DEVICES?)")
        raise DeviceError(f"device {name!r} asked for, but {why}; use --device cpu")
    index = 0 if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise DeviceError(f"device {name!r} asked for, but only {torch.cuda.device_count()} "
                          "CUDA device(s) are visible")
    return torch.device("cuda", index)


def device_name(device: torch.device) -> str:
    """What a report names the device by: `cpu`, or `cuda:0 (NVIDIA H200)`."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


def synchronize(device: torch.device) -> None:
    """Wait until the device has finished its queued work (CUDA runs asynchronously), so that
    a clock read afterwards times the work itself, not its launch. Nothing on a CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def clock(device: torch.device) -> float:
    """`perf_counter()` once `device` is idle: the end (or start) of a timed interval."""
    synchronize(device)
    return perf_counter()
