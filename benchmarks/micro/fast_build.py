"""Build and regenerate throughput on the fast path, each as a ratio measured in one run.

1. `dresd build` (dense, the forward over every corpus token): float32 against bfloat16
   (both prepacked), the same first `--docs` GSM8K training pairs, best of `--repeats`
   interleaved runs. Goal: bf16 at least 3.5x fp32 tokens/s.
2. `dresd corpus regenerate`: the same `--prompts` GSM8K training questions answered one at a
   time (`--batch-size 1`) and in batches of `--batch-size`, in the dtype `auto` picks.
   tokens/s = response tokens (re-tokenized, so the same count for both) / wall seconds.
   Goal: batched at least 8x single-stream.

    .venv/bin/python benchmarks/micro/fast_build.py [--docs 120] [--prompts 32] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

from dresd.corpus import CorpusSpec
from dresd.datasets import data_dir
from dresd.datastore.dense import DenseBuildConfig, build_dense
from dresd.datastore.format import read_manifest
from dresd.host import native_bf16_flags
from dresd.models.fastpath import dtype_name
from dresd.models.target import load_target
from dresd.regenerate import RegenerateConfig, regenerate

RESULTS = Path(__file__).parents[1] / "results"


def build_seconds(target, docs: int, workdir: Path) -> tuple[float, int]:
    """Seconds for one dense build of the first `docs` GSM8K pairs, and its corpus tokens."""
    spec = CorpusSpec(sources=[str(data_dir() / "gsm8k" / "train.jsonl")],
                      prompt_field="question", response_field="answer", limit=docs)
    out = Path(tempfile.mkdtemp(dir=workdir)) / "store"
    started = time.perf_counter()
    build_dense(target, spec, out, DenseBuildConfig(index="exact"), progress=False)
    seconds = time.perf_counter() - started
    return seconds, read_manifest(out).num_corpus_tokens


def regenerate_seconds(target, prompts: int, batch_size: int, max_new_tokens: int,
                       workdir: Path) -> tuple[float, int]:
    """Seconds to answer the first `prompts` GSM8K questions, and the answers' tokens."""
    out = Path(tempfile.mkdtemp(dir=workdir)) / "answers.jsonl"
    config = RegenerateConfig(prompt_field="question", response_field="answer",
                              max_new_tokens=max_new_tokens, batch_size=batch_size,
                              limit=prompts)
    started = time.perf_counter()
    regenerate(target, data_dir() / "gsm8k" / "train.jsonl", out, config, progress=False)
    seconds = time.perf_counter() - started
    answers = [json.loads(line)["answer"] for line in out.read_text().splitlines()]
    tokens = sum(len(target.tokenizer(a, add_special_tokens=False).input_ids) for a in answers)
    return seconds, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=120)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    targets = {name: load_target("default", dtype=name) for name in ("float32", "bfloat16")}
    auto = load_target("default")
    report = {"cpu": platform.processor() or platform.machine(),
              "cpu_native_bf16": native_bf16_flags(), "torch": torch.__version__,
              "threads": args.threads, "auto_dtype": dtype_name(auto.dtype)}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        best: dict[str, float] = {}
        for _ in range(args.repeats):  # interleaved: fp32, bf16, fp32, bf16
            for name, target in targets.items():
                seconds, tokens = build_seconds(target, args.docs, workdir)
                best[name] = min(best.get(name, seconds), seconds)
        report["build"] = {"docs": args.docs, "corpus_tokens": tokens,
                           **{f"{name}_tokens_per_s": tokens / s for name, s in best.items()},
                           "bf16_over_fp32": best["float32"] / best["bfloat16"]}
        print(json.dumps(report["build"]), flush=True)
        runs = {}
        for batch_size in (1, args.batch_size):
            seconds, tokens = regenerate_seconds(auto, args.prompts, batch_size,
                                                 args.max_new_tokens, workdir)
            runs[batch_size] = {"seconds": seconds, "response_tokens": tokens,
                                "tokens_per_s": tokens / seconds}
        report["regenerate"] = {"prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
                                "by_batch_size": runs,
                                "batched_over_single": runs[args.batch_size]["tokens_per_s"]
                                / runs[1]["tokens_per_s"]}
        print(json.dumps(report["regenerate"]), flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "fast_build.json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
