"""The side-by-side runner: all methods on the same prompts, interleaved prompt by prompt.

Fairness on a noisy machine: one untimed warm-up per method, then for each prompt every method
in turn (A B C D, A B C D, ...), so that drift hits all of them alike. Every method gets the same
token ids, sampling settings and `max_new_tokens` (they share one `GenerationSettings`).
Ctrl-C stops after the prompt in flight is dropped: what remains covers the same prompts for
every method.
"""

from __future__ import annotations

from dataclasses import dataclass

from tqdm import tqdm

from dresd.datasets import EvalPrompt
from dresd.metrics import GenerationResult
from dresd.runner import MethodRunner


@dataclass
class BenchRecord:
    method: str  # the runner's label: a method, or a method with options ("rest[draft_len=4]")
    prompt_index: int
    prompt: EvalPrompt
    result: GenerationResult


def run_bench(
    runners: list[MethodRunner],
    prompts: list[EvalPrompt],
    prompt_ids: list[list[int]],
    progress: bool = True,
) -> tuple[list[BenchRecord], bool]:
    """Run every method on every prompt; returns (records, interrupted)."""
    records: list[BenchRecord] = []
    bar = tqdm(total=len(prompts) * len(runners), disable=not progress, unit="gen",
               desc="bench")
    try:
        for runner in runners:  # warm-up, untimed: lazy initialisation, caches, allocator
            runner.generate(prompt_ids[0][:64])
        for index, (prompt, ids) in enumerate(zip(prompts, prompt_ids, strict=True)):
            row = []
            for runner in runners:
                bar.set_postfix_str(f"{prompt.dataset} #{index} {runner.label}")
                row.append(BenchRecord(runner.label, index, prompt, runner.generate(ids)))
                bar.update()
            records.extend(row)  # only whole rows: every method covers the same prompts
    except KeyboardInterrupt:
        return records, True
    finally:
        bar.close()
    return records, False
