"""Shared by the fault and bad-input tests: a tiny model with the default tokenizer saved as a
model folder (so real `dresd` processes load it in a fraction of a second), a small corpus, the
CLI run in-process or as a real process, and a byte-for-byte comparison of two folders."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

import dresd
from dresd.cli.main import main
from dresd.models.target import ensure_default_model

TINY_CONTEXT = 256  # the tiny model's context: prompts reach it cheaply
SRC = Path(dresd.__file__).resolve().parents[1]  # this checkout's sources, for child processes


def save_tiny_model(folder: Path) -> Path:
    """A 2-layer random Llama (float32) with the default model's tokenizer and chat template."""
    tokenizer = AutoTokenizer.from_pretrained(ensure_default_model())
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=TINY_CONTEXT, tie_word_embeddings=True,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
                         pad_token_id=tokenizer.pad_token_id)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def write_corpus(path: Path, docs: int = 60, seed: int = 0) -> Path:
    """Prompt/response pairs of random words: a few thousand tokens."""
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "river", "stone", "seven", "blue", "quick",
             "lamp", "north", "paper", "zero", "field", "glass", "orbit"]
    with open(path, "w", encoding="utf-8") as f:
        for i in range(docs):
            prompt = f"Question {i}: " + " ".join(rng.choice(words, size=8))
            response = " ".join(rng.choice(words, size=int(rng.integers(20, 60))))
            f.write(json.dumps({"prompt": prompt, "response": response}) + "\n")
    return path


def run_main(capsys, *argv: str) -> tuple[int, str]:
    """`dresd ARGV` in this process: (exit status, stderr); a traceback fails the test."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as stop:  # argparse's own usage errors
        code = stop.code
    return code, capsys.readouterr().err


PROGRESS = re.compile(r"^[^:]*: +\d+%\|")  # a progress bar (tqdm): "Loading weights:  20%|"


def assert_one_line_error(code: int, err: str, *expected: str) -> None:
    """Exit status 2 and one `dresd: error:` line holding every `expected` text; besides it
    stderr may hold only progress bars and the note saying which dtype `--dtype auto` chose."""
    lines = [line for line in err.splitlines() if line.strip()
             and not line.startswith("dresd: dtype") and not PROGRESS.match(line)]
    assert code == 2, (code, err)
    assert len(lines) == 1 and lines[0].startswith("dresd: error:"), err
    assert "Traceback" not in err
    for text in expected:
        assert text in lines[0], (text, lines[0])


def spawn(*argv: str, **popen) -> subprocess.Popen:
    """`dresd ARGV` as a real process of this checkout."""
    env = dict(os.environ, PYTHONPATH=str(SRC), TQDM_DISABLE="1")
    return subprocess.Popen([sys.executable, "-m", "dresd.cli", *map(str, argv)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def folder_bytes(folder: Path) -> dict[str, bytes]:
    """Every file under `folder`, by relative path."""
    return {str(p.relative_to(folder)): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def assert_same_files(got: Path, expected: Path) -> None:
    a, b = folder_bytes(got), folder_bytes(expected)
    assert sorted(a) == sorted(b)
    different = [name for name in a if a[name] != b[name]]
    assert not different, f"files differ from the uninterrupted build: {different}"
