"""OpenVINO GenAI on the prompts dresd bench uses: one JSON line per pipeline measured.

Runs in OpenVINO's own environment (`openvino.sh` makes it), not dresd's: it imports neither
dresd nor torch. The prompts come as token ids (`openvino_side.py prompts` wrote them with
dresd's tokenizer and chat template), so every runner sees exactly the same input.

Pipelines (`--pipelines`, comma-separated; several in one process are interleaved prompt by
prompt, each warmed up once untimed):

- `llm`: `LLMPipeline`, plain greedy decoding, one prompt at a time;
- `llm-pl`: `LLMPipeline(prompt_lookup=True)`, `num_assistant_tokens` 5, `max_ngram_size` 3;
- `cb`: `ContinuousBatchingPipeline`, plain greedy decoding; `--requests 1`: the prompts one at
  a time, `--requests R`: R prompts submitted at once in one `generate` call (aggregate
  tokens/s = all new tokens / wall seconds of the call);
- `cb-pl`: the same with `prompt_lookup` (5 tokens, n-gram 3).

    python ov_genai_run.py --model IR_DIR --prompts prompts.jsonl --pipelines llm,llm-pl \
        --threads 2 --max-new-tokens 128 --round 1

Each line: runner, pipeline, requests, threads, round, num_prompts, num_new_tokens, seconds,
tokens_per_s, the runtime's precision properties, and `token_ids` per prompt (greedy outputs,
to compare with dresd's `ar`). `openvino.sh` runs this in a child process per group, so a
crash (OpenVINO 2026.x dies with SIGFPE at one thread) is recorded by the shell, not lost.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import openvino as ov
import openvino_genai as ov_genai

PL_TOKENS = 5  # num_assistant_tokens
PL_NGRAM = 3  # max_ngram_size


def read_prompts(path: Path, limit: int | None) -> list[list[int]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [row["prompt_ids"] for row in rows[:limit]]


def as_tensor(ids: list[int]) -> ov.Tensor:
    return ov.Tensor(np.array([ids], dtype=np.int64))


def greedy_config(base: ov_genai.GenerationConfig, max_new_tokens: int,
                  lookup: bool) -> ov_genai.GenerationConfig:
    config = base
    config.max_new_tokens = max_new_tokens
    config.do_sample = False
    if lookup:
        config.num_assistant_tokens = PL_TOKENS
        config.max_ngram_size = PL_NGRAM
    return config


class LLM:
    """LLMPipeline, one prompt at a time."""

    def __init__(self, model: Path, threads: int, lookup: bool, max_new_tokens: int,
                 extra: dict) -> None:
        properties = {"INFERENCE_NUM_THREADS": threads, **extra}
        if lookup:
            properties["prompt_lookup"] = True
        self.pipe = ov_genai.LLMPipeline(str(model), "CPU", **properties)
        self.config = greedy_config(self.pipe.get_generation_config(), max_new_tokens, lookup)

        self.ttft_ms: list[float] = []  # OpenVINO's own perf metrics, per generate call
        self.tpot_ms: list[float] = []

    def run(self, prompts: list[list[int]]) -> list[list[int]]:
        outputs = []
        for ids in prompts:
            result = self.pipe.generate(as_tensor(ids), self.config)
            self.ttft_ms.append(result.perf_metrics.get_ttft().mean)
            self.tpot_ms.append(result.perf_metrics.get_tpot().mean)
            outputs.append(list(result.tokens[0]))
        return outputs


class CB:
    """ContinuousBatchingPipeline: `requests` prompts per `generate` call."""

    def __init__(self, model: Path, threads: int, lookup: bool, max_new_tokens: int,
                 extra: dict, requests: int) -> None:
        scheduler = ov_genai.SchedulerConfig()
        scheduler.cache_size = 1  # GB of KV cache: 16 requests of a few hundred tokens
        scheduler.enable_prefix_caching = False  # dresd has none: no reuse across prompts
        properties = {"INFERENCE_NUM_THREADS": threads, **extra}
        if lookup:
            properties["prompt_lookup"] = True
        self.pipe = ov_genai.ContinuousBatchingPipeline(str(model), scheduler, "CPU",
                                                        properties)
        self.config = greedy_config(self.pipe.get_config(), max_new_tokens, lookup)
        self.requests = requests

    def run(self, prompts: list[list[int]]) -> list[list[int]]:
        outputs = []
        for start in range(0, len(prompts), self.requests):
            group = prompts[start:start + self.requests]
            results = self.pipe.generate([as_tensor(ids) for ids in group],
                                         [self.config] * len(group))
            outputs += [list(r.m_generation_ids[0]) for r in results]
        return outputs


def runtime_properties(threads: int, extra: dict) -> dict:
    """What the CPU plugin computes in on this machine (by default bf16 on a CPU with native
    bf16, whatever the IR's weights are), and the KV cache's element type (by default u8)."""
    core = ov.Core()
    if extra:
        core.set_property("CPU", extra)
    found = {"openvino": ov.get_version(), "openvino_genai": ov_genai.__version__,
             "threads": threads, "properties_set": extra}
    for name in ("INFERENCE_PRECISION_HINT", "KV_CACHE_PRECISION", "EXECUTION_MODE_HINT"):
        try:
            value = core.get_property("CPU", name)
        except RuntimeError:
            found[name] = None
            continue
        found[name] = value.to_string() if hasattr(value, "to_string") else str(value)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="the exported IR folder")
    parser.add_argument("--prompts", type=Path, required=True, help="jsonl with prompt_ids")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--pipelines", default="llm,llm-pl")
    parser.add_argument("--requests", type=int, default=1, help="cb: prompts per generate call")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--round", type=int, default=1)
    parser.add_argument("--weights", default="fp16", help="the IR's weight format, recorded")
    parser.add_argument("--set", default="single", help="the prompt set's name, recorded")
    parser.add_argument("--property", action="append", default=[], metavar="KEY=VALUE",
                        help="a CPU plugin property for every pipeline, e.g. "
                             "KV_CACHE_PRECISION=bf16 (repeatable)")
    args = parser.parse_args()
    extra = dict(item.split("=", 1) for item in args.property)

    prompts = read_prompts(args.prompts, args.limit)
    names = [name.strip() for name in args.pipelines.split(",") if name.strip()]
    runners = {}
    for name in names:
        lookup = name.endswith("-pl")
        if name.startswith("llm"):
            runners[name] = LLM(args.model, args.threads, lookup, args.max_new_tokens, extra)
        elif name.startswith("cb"):
            runners[name] = CB(args.model, args.threads, lookup, args.max_new_tokens, extra,
                               args.requests)
        else:
            parser.error(f"unknown pipeline {name!r}")
    warm = [ids[:64] for ids in prompts[:max(1, args.requests)]]
    for runner in runners.values():  # warm-up, untimed (compilation, allocator)
        runner.run(warm)

    seconds = dict.fromkeys(runners, 0.0)
    outputs: dict[str, list[list[int]]] = {name: [] for name in runners}
    step = 1 if args.requests == 1 else args.requests
    for start in range(0, len(prompts), step):  # interleaved: each pipeline in turn
        group = prompts[start:start + step]
        for name, runner in runners.items():
            began = time.perf_counter()
            outputs[name] += runner.run(group)
            seconds[name] += time.perf_counter() - began

    properties = runtime_properties(args.threads, extra)
    for name, runner in runners.items():
        tokens = sum(len(ids) for ids in outputs[name])
        timed = getattr(runner, "ttft_ms", [])[1:]  # the warm-up's first
        print(json.dumps({
            "runner": "openvino", "pipeline": name, "set": args.set, "requests": args.requests,
            "threads": args.threads, "round": args.round, "weights": args.weights,
            "prompt_lookup": {"num_assistant_tokens": PL_TOKENS, "max_ngram_size": PL_NGRAM}
            if name.endswith("-pl") else None,
            "max_new_tokens": args.max_new_tokens, "num_prompts": len(prompts),
            "num_new_tokens": tokens, "seconds": seconds[name],
            "tokens_per_s": tokens / seconds[name], "runtime": properties,
            "ttft_ms_mean": sum(timed) / len(timed) if timed else None,
            "tpot_ms_mean": (sum(runner.tpot_ms[1:]) / len(timed)) if timed else None,
            "token_ids": outputs[name]}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
