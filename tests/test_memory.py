"""What a load leaves resident: freed buffers handed back at once, no copies kept."""

from __future__ import annotations

import ctypes
import ctypes.util

import pytest
import torch

from dresd import host

libc = ctypes.util.find_library("c")
glibc = pytest.mark.skipif(libc is None or not hasattr(ctypes.CDLL(libc), "mallopt"),
                           reason="glibc's mallopt")


def resident_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 2**20


@glibc
def test_a_loads_large_buffers_leave_nothing_resident_once_freed():
    """Inside `large_allocations_mapped`, 4 MB buffers take pages of their own (resident
    memory grows by their size, where buffers from glibc's heap would reuse pages it holds)
    and give them back once freed, though small allocations that stay alive lie between them
    (from the heap, what is freed below one stays resident: the first run here, outside the
    context, kept 32 of 96 MB)."""
    with host.large_allocations_mapped():
        before = resident_mb()
        buffers, small = [], []
        for _ in range(24):  # 96 MB, each buffer written so that its pages are resident
            buffers.append(torch.ones(4 << 20, dtype=torch.uint8))
            small.append(torch.ones(2048, dtype=torch.uint8))  # pins the heap above it
        assert resident_mb() - before > 80
        del buffers
        assert resident_mb() - before < 16


def test_generate_without_saving_outputs_never_fingerprints_the_tokenizer(monkeypatch, capsys,
                                                                            tmp_path):
    """The tokenizer's fingerprint parses its whole JSON (60 MB at the peak for a 262k
    vocabulary): `generate` takes it only to save outputs."""
    from dresd.cli import options
    from dresd.cli.main import main

    def refuse(tokenizer):
        raise AssertionError("tokenizer fingerprinted")

    monkeypatch.setattr(options, "tokenizer_fingerprint", refuse)
    assert main(["generate", "--model", "default", "--prompt", "Hi", "--max-new-tokens", "2",
                 "--method", "ar", "--threads", "1"]) == 0
    saving = main(["generate", "--model", "default", "--prompt", "Hi", "--max-new-tokens", "2",
                   "--method", "ar", "--threads", "1", "--save-outputs", str(tmp_path / "o")])
    assert saving != 0 and "tokenizer fingerprinted" in capsys.readouterr().err
