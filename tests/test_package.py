"""An installed dresd is the same dresd: a wheel built from this repository, installed into a
fresh virtual environment (not the editable install `make` does), generates with the default
model on the fast forward, its C kernels compiled from the sources the wheel carries."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from dresd.host import cache_dir, cpu_flags
from dresd.kernels import attention, decoder, linear, runnable_tiers
from dresd.models.target import ensure_default_model

ROOT = Path(__file__).resolve().parents[1]


def run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    """`command`, where this checkout's sources are not on the path (PYTHONPATH would make pip
    take the repository's dresd for an installed one, and the venv import it)."""
    kwargs.setdefault("env", {k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    done = subprocess.run(command, capture_output=True, text=True, **kwargs)
    assert done.returncode == 0, f"{command} failed:\n{done.stdout}\n{done.stderr}"
    return done


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
         "-w", str(out), str(ROOT)])
    [built] = out.glob("dresd-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(tmp_path_factory, wheel) -> Path:
    """A fresh virtual environment with the wheel installed; its dependencies are this
    environment's packages (a path in a .pth file), so nothing is downloaded."""
    ensure_default_model(quiet=True)
    root = tmp_path_factory.mktemp("venv")
    run([sys.executable, "-m", "venv", "--without-pip", str(root)])
    python = root / "bin" / "python"
    run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
         "--no-index", "--quiet", str(wheel)])
    site = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
                    ).stdout.strip())
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return root


def kernel_sources() -> set[str]:
    """Every C file a kernel compiles from: the sources and what they include."""
    names = set()
    for source in (attention.SOURCE, linear.SOURCE, decoder.SOURCE):
        names.add(source.name)
        names.update(re.findall(r'#include "([^"]+)"', source.read_text()))
    return names


def test_the_wheel_carries_every_kernel_source(wheel):
    with zipfile.ZipFile(wheel) as archive:
        shipped = {Path(name).name for name in archive.namelist()
                   if name.startswith("dresd/kernels/")}
    assert kernel_sources() <= shipped, kernel_sources() - shipped


def test_the_installed_wheel_generates_on_the_fast_forward(venv, tmp_path):
    # A kernel cache of its own, so that the kernels compile from the installed sources; the
    # default model is the one already converted.
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "models").symlink_to(cache_dir() / "models")
    env = {**os.environ, "DRESD_CACHE": str(cache)}
    env.pop("PYTHONPATH", None)  # the wheel's dresd, not this checkout's
    dresd = str(venv / "bin" / "dresd")

    where = run([str(venv / "bin" / "python"), "-c", "import dresd; print(dresd.__file__)"],
                env=env, cwd=tmp_path).stdout
    assert where.startswith(str(venv)), where  # the wheel's dresd, not the repository's

    version = run([dresd, "--version"], env=env, cwd=tmp_path).stdout
    assert version.startswith("dresd ") and "torch " in version
    # the C decoder wherever a kernel tier runs (AVX2 and up, NEON); the default model on it
    # under --dtype auto where bf16 is native (elsewhere auto is float32: PyTorch's linears)
    assert ("forward: C decoder" in version) == bool(runnable_tiers()), version
    fast = "avx512_bf16" in cpu_flags()

    done = run([dresd, "generate", "--prompt", "What is 2+3?", "--max-new-tokens", "8",
                "--method", "pld", "--no-budget", "--json", "--threads", "1"],
               env=env, cwd=tmp_path)
    record = json.loads(done.stdout.strip().splitlines()[-1])
    assert record["num_new_tokens"] > 0 and record["text"].strip()
    compiled = {path.name.split("-")[0] for path in (cache / "kernels").glob("*.so")}
    if fast:  # the whole forward ran in C, compiled from the wheel's own sources
        assert {"linear", "attention", "decoder"} <= compiled, compiled
