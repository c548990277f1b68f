"""What a load leaves resident: freed buffers handed back at once, no copies kept."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import subprocess
import sys

import pytest

libc = ctypes.util.find_library("c")
glibc = pytest.mark.skipif(libc is None or not hasattr(ctypes.CDLL(libc), "mallopt"),
                           reason="glibc's mallopt")

# In a fresh process, so that glibc's heap holds no free chunk a buffer could be served from
# (it would reuse those pages, whatever the threshold: no growth to measure).
ALLOCATE_AND_FREE = """
import json, torch
from dresd import host

def resident_mb():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 2**20

def allocate_and_free():
    before = resident_mb()
    buffers, small = [], []
    for _ in range(24):  # 96 MB, each buffer written so that its pages are resident
        buffers.append(torch.ones(4 << 20, dtype=torch.uint8))
        small.append(torch.ones(2048, dtype=torch.uint8))  # pins the heap above it
    grown = resident_mb() - before
    del buffers
    return grown, resident_mb() - before

with host.large_allocations_mapped():
    inside = allocate_and_free()
outside = allocate_and_free()  # the threshold a run keeps afterwards (32 MB)
print(json.dumps({"inside": inside, "outside": outside}))
"""


@glibc
@pytest.mark.subprocess
def test_a_loads_large_buffers_leave_nothing_resident_once_freed():
    """Inside `large_allocations_mapped`, 4 MB buffers freed between small allocations that
    stay alive give their pages back; outside it, with the threshold a run keeps, glibc serves
    them from its heap, where what is freed below a live allocation stays resident."""
    done = subprocess.run([sys.executable, "-c", ALLOCATE_AND_FREE], capture_output=True,
                          text=True, check=True)
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    (grown_inside, kept_inside), kept_outside = measured["inside"], measured["outside"][1]
    assert grown_inside > 80 and kept_inside < 16, measured
    assert kept_outside > 16, measured  # the contrast: without the mapping, pages are kept


@pytest.mark.default_model
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
