"""Engine benchmark: what a decode step and a token tree cost in each dtype, and PLD against AR.

1. The floor: a decode step reads every weight it multiplies once (the linear layers and the LM
   head; the embedding lookup reads one row), so weight bytes / memory read bandwidth (measured
   here, one thread streaming a 512 MB tensor) bounds the step from below.
2. Engines: float32 and bfloat16, each with plain `nn.Linear` and with weights prepacked for
   oneDNN (`fastpath.prepack_linears`), and bf16 prepacked with the batch-invariant attention
   (`fastpath.invariant_attention`), which is what dresd runs on such a CPU. For each: the
   one-token step in ms and the verify cost, one forward over a tree of 1, 2, 4, ..., 64 nodes
   on a warm KV cache relative to the same engine's one-token step. Engines and sizes are
   interleaved within each repetition so that machine drift hits all of them alike; medians.
3. PLD vs AR: tokens/s and mean accepted length on "add type hints" requests over HumanEval
   solutions (the output mostly repeats the input), methods interleaved prompt by prompt, in
   the dtype `auto` picks.

Results go to benchmarks/results/engine.{json,md}.

    .venv/bin/python benchmarks/micro/forward_step.py [--prompts 12] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from pathlib import Path
from time import perf_counter

import numpy as np
import torch
import transformers
from transformers import DynamicCache

from dresd.calibrate import random_tree, timed_verify
from dresd.datasets import type_hint_prompts
from dresd.decoding.generate import target_forward
from dresd.host import native_bf16_flags
from dresd.metrics import summarize
from dresd.models.fastpath import INVARIANT_ATTENTION, PackedLinear, dtype_name
from dresd.models.target import load_target
from dresd.prompts import encode_prompt
from dresd.runner import AR, GenerationSettings, MethodRunner

TREE_SIZES = [1, 2, 4, 8, 16, 32, 64]
RESULTS = Path(__file__).parents[1] / "results"


ENGINES = {  # name -> (dtype, prepacked, attention); the last is what dresd runs by default
    "float32": (torch.float32, False, "sdpa"),
    "float32, prepacked": (torch.float32, True, "sdpa"),
    "bfloat16": (torch.bfloat16, False, "sdpa"),
    "bfloat16, prepacked": (torch.bfloat16, True, "sdpa"),
    "bfloat16, prepacked, invariant attention": (torch.bfloat16, True, INVARIANT_ATTENTION),
}


def load_engine(dtype: torch.dtype, packed: bool, attention: str) -> torch.nn.Module:
    model = load_target("default", dtype=dtype, prepack=packed).model
    model.set_attn_implementation(attention)
    return model


def read_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes per second one thread reads from memory (a sum over a tensor far above cache)."""
    data = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32)
    data.sum()
    best = min(_timed(data.sum) for _ in range(repeats))
    return data.numel() * 4 / best


def _timed(fn) -> float:
    started = perf_counter()
    fn()
    return perf_counter() - started


def streamed_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step multiplies: every linear weight (packed or not) and the LM head."""
    total = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            total += module.weight.numel() * module.weight.element_size()
        elif isinstance(module, PackedLinear):
            total += module.in_features * module.out_features * module.packed_weight.element_size()
    return total


@torch.inference_mode()
def engine_costs(context_len: int, repeats: int) -> dict:
    """Per engine: the one-token step (ms) and the verify cost of each tree size (in steps)."""
    models = {name: load_engine(*engine) for name, engine in ENGINES.items()}
    vocab = next(iter(models.values())).config.vocab_size
    rng = np.random.default_rng(0)
    prompt = torch.tensor([rng.integers(vocab, size=context_len).tolist()])
    caches = {}
    for name, model in models.items():
        caches[name] = DynamicCache(config=model.config)
        target_forward(model, prompt, caches[name])
    times = {(name, size): [] for name in models for size in TREE_SIZES}
    for repeat in range(repeats + 1):
        for size in TREE_SIZES:
            tree = random_tree(size, vocab, rng)
            for name, model in models.items():
                elapsed = timed_verify(model, caches[name], tree, context_len)
                if repeat > 0:  # the first round is a warm-up
                    times[(name, size)].append(elapsed)
    table = {}
    for name, model in models.items():
        step = statistics.median(times[(name, 1)])
        table[name] = {
            "step_ms": step * 1000,
            "weight_bytes": streamed_weight_bytes(model),
            "verify_cost": {str(size): statistics.median(times[(name, size)]) / step
                            for size in TREE_SIZES},
        }
    return table


def pld_vs_ar(target, prompts: list[list[int]], max_new_tokens: int) -> dict:
    settings = GenerationSettings(max_new_tokens)
    runners = {
        "ar": MethodRunner(target, AR, settings),
        "pld-1": MethodRunner(target, "pld", settings, num_drafts=1),
        "pld-3": MethodRunner(target, "pld", settings, num_drafts=3),
    }
    for runner in runners.values():
        runner.generate(prompts[0][:32])  # warm-up, untimed
    results = {name: [] for name in runners}
    for ids in prompts:
        for name, runner in runners.items():  # interleaved: A B C, A B C, ...
            results[name].append(runner.generate(ids))
    ar_speed = summarize(results["ar"])["tokens_per_s"]
    table = {}
    for name, runs in results.items():
        figures = summarize(runs)
        identical = sum(r.token_ids == a.token_ids for r, a in zip(runs, results["ar"],
                                                                    strict=True))
        table[name] = {
            "tokens_per_s": figures["tokens_per_s"],
            "speedup": figures["tokens_per_s"] / ar_speed,
            "mean_accepted_length": figures["mean_accepted_length"],
            "acceptance_rate": figures["acceptance_rate"],
            "drafted_tokens_per_step": figures["drafted_tokens_per_step"],
            "draft_time_share": figures["draft_time_share"],
            "identical_fraction": identical / len(runs),
        }
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=12, help="PLD vs AR prompts (0: skip)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--context-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1, help="PyTorch threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    print("read bandwidth ...", flush=True)
    bandwidth = read_bandwidth()
    print("engines: step and verify cost ...", flush=True)
    engines = engine_costs(args.context_len, args.repeats)
    for figures in engines.values():
        figures["floor_ms"] = figures["weight_bytes"] / bandwidth * 1000
        figures["step_over_floor"] = figures["step_ms"] / figures["floor_ms"]
    target = load_target("default")  # dtype auto, prepacked: what dresd runs by default
    report = {
        "model": target.name,
        "cpu": platform.processor() or platform.machine(),
        "cpu_native_bf16": native_bf16_flags(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": args.threads,
        "context_len": args.context_len,
        "read_bandwidth_gb_s": bandwidth / 1e9,
        "engines": engines,
        "auto_dtype": dtype_name(target.dtype),
    }
    if args.prompts:
        print("PLD vs AR ...", flush=True)
        prompts = [encode_prompt(target.tokenizer, p) for p in type_hint_prompts(args.prompts)]
        report.update(prompts=len(prompts), max_new_tokens=args.max_new_tokens,
                      methods=pld_vs_ar(target, prompts, args.max_new_tokens))
    print(json.dumps(report, indent=1), flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "engine.json").write_text(json.dumps(report, indent=1) + "\n")
    (RESULTS / "engine.md").write_text(markdown(report))


def markdown(report: dict) -> str:
    lines = [
        "# Engine benchmark (recorded by benchmarks/micro/forward_step.py)",
        "",
        f"Model {report['model']}, torch {report['torch']}, transformers "
        f"{report['transformers']}, CPU {report['cpu']} (native bf16: "
        f"{', '.join(report['cpu_native_bf16']) or 'none'}), {report['threads']} thread(s), "
        f"context {report['context_len']} tokens. Read bandwidth (1 thread): "
        f"{report['read_bandwidth_gb_s']:.1f} GB/s. `--dtype auto` picks "
        f"{report['auto_dtype']} here.",
        "",
        "## Decode step against its floor, and verify cost (tree of N tokens / one-token step)",
        "",
        "floor = streamed weight bytes / read bandwidth; medians, engines interleaved.",
        "",
        "| engine | weights streamed | floor | step | step / floor | step / fp32 step | "
        + " | ".join(f"N={n}" for n in TREE_SIZES) + " |",
        "| --- | ---: | ---: | ---: | ---: | ---: |" + " ---: |" * len(TREE_SIZES),
    ]
    fp32_step = report["engines"]["float32"]["step_ms"]
    for name, e in report["engines"].items():
        costs = e["verify_cost"]
        lines.append(
            f"| {name} | {e['weight_bytes'] / 1e6:.0f} MB | {e['floor_ms']:.1f} ms | "
            f"{e['step_ms']:.1f} ms | {e['step_over_floor']:.1f}x | "
            f"{e['step_ms'] / fp32_step:.2f} | "
            + " | ".join(f"{costs[str(n)]:.2f}" for n in TREE_SIZES) + " |")
    if "methods" in report:
        lines += [
            "",
            f"## PLD vs AR on {report['prompts']} HumanEval 'add type hints' prompts "
            f"(greedy, up to {report['max_new_tokens']} new tokens, {report['auto_dtype']}, "
            "interleaved)",
            "",
            "| method | tokens/s | speedup | mean accepted length | acceptance rate "
            "| drafted/step | draft time | identical |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for name, row in report["methods"].items():
            rate = row["acceptance_rate"]
            share = row["draft_time_share"]
            lines.append(
                f"| {name} | {row['tokens_per_s']:.1f} | {row['speedup']:.2f}x | "
                f"{row['mean_accepted_length']:.2f} | {'-' if rate is None else f'{rate:.1%}'} | "
                f"{row['drafted_tokens_per_step']:.1f} | "
                f"{'-' if share is None else f'{share:.1%}'} | {row['identical_fraction']:.0%} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
