"""Structured output: constrained `hybrid` (the grammar's forced tokens drafted) against
constrained `ar` over JSON schemas no one here wrote, on the default model.

The schemas are the JSON schemas of real pydantic models shipped in installed packages
(`openai`'s API types, `fastapi`'s OpenAPI models): nested objects, enums, optional fields,
`$defs`. For each, the model is asked for one example object; every method runs under the
same grammar (`decoding/constraint.py`), greedy, so every output must be `ar`'s, token for
token. Methods alternate prompt by prompt, `--rounds` times.

Reported: tokens/s as the user times it (prefill included) and its ratio over constrained
`ar` per round, the spread over rounds, forwards per token, the share of emitted tokens the
grammar forced (drafted for free, `StepRecord.num_forced`), and the grammar's own cost per
step (every call into the constraint: draft checks, forced tokens, masks, commits).

    PYTHONPATH=src .venv/bin/python benchmarks/structured_output.py --rounds 2 \
        --out benchmarks/results/structured_output
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import statistics
import time
from pathlib import Path

import torch
from pydantic import TypeAdapter

from dresd.decoding.constraint import Constraint, Grammar
from dresd.host import cpu_model
from dresd.models.target import load_target
from dresd.prompts import encode_prompt
from dresd.runner import GenerationSettings, MethodRunner

GRAMMAR_SECONDS = [0.0]  # every call into a Constraint, summed (its methods are wrapped)


def timed(method):
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            GRAMMAR_SECONDS[0] += time.perf_counter() - started
    return wrapper


for _name in ("allowed_prefix", "forced", "mask_after", "commit"):
    setattr(Constraint, _name, timed(getattr(Constraint, _name)))


def real_schemas() -> dict[str, dict]:
    """JSON schemas of pydantic models other projects wrote and ship."""
    from fastapi.openapi import models as openapi
    from openai.types import chat, shared

    models = {"openai.FunctionDefinition": shared.FunctionDefinition,
              "openai.CompletionUsage": __import__("openai").types.CompletionUsage,
              "openai.ChatCompletionMessageToolCall": chat.ChatCompletionMessageToolCall,
              "openai.ChatCompletionTokenLogprob": chat.ChatCompletionTokenLogprob,
              "fastapi.openapi.Contact": openapi.Contact,
              "fastapi.openapi.License": openapi.License,
              "fastapi.openapi.ServerVariable": openapi.ServerVariable,
              "fastapi.openapi.ExternalDocumentation": openapi.ExternalDocumentation}
    return {name: TypeAdapter(model).json_schema() for name, model in models.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="ar,hybrid")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/structured_output"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    target = load_target("default")
    vocab = target.model.config.vocab_size
    settings = GenerationSettings(max_new_tokens=args.max_new_tokens)
    methods = args.methods.split(",")
    runners = {method: MethodRunner(target, method, settings) for method in methods}
    schemas = real_schemas()
    grammars = {name: Grammar.compile("json_schema", schema, target.tokenizer, vocab)
                for name, schema in schemas.items()}
    prompts = {name: encode_prompt(target.tokenizer, "Write one example JSON object for this "
                                   f"schema, and nothing else: {json.dumps(schema)}", True)
               for name, schema in schemas.items()}

    runs: dict[str, list[dict]] = {method: [] for method in methods}
    outputs: dict[tuple[str, str], list[int]] = {}
    for round_ in range(args.rounds):
        for name in schemas:
            for method in methods:
                runner = runners[method]
                GRAMMAR_SECONDS[0] = 0.0
                request = runner.request(prompts[name])
                request.constraint = grammars[name].start()
                started = time.perf_counter()
                state = runner.engine.add(request)
                runner.engine.run()
                seconds = time.perf_counter() - started
                result = state.result
                outputs.setdefault((method, name), result.token_ids)
                assert result.token_ids == outputs[(method, name)], (method, name)
                runs[method].append({
                    "round": round_, "schema": name, "tokens": len(result.token_ids),
                    "seconds": seconds, "forwards": result.num_target_forwards,
                    "forced": sum(step.num_forced for step in result.steps),
                    "grammar_seconds": GRAMMAR_SECONDS[0], "stop": result.stop_reason})

    identical = all(outputs[(method, name)] == outputs[("ar", name)]
                    for method in methods for name in schemas)

    def totals(method: str, round_: int) -> dict:
        rows = [r for r in runs[method] if r["round"] == round_]
        tokens = sum(r["tokens"] for r in rows)
        forwards = sum(r["forwards"] for r in rows)
        return {"tokens_per_s": tokens / sum(r["seconds"] for r in rows),
                "tokens_per_forward": tokens / forwards,
                "forced_share": sum(r["forced"] for r in rows) / tokens,
                "grammar_ms_per_forward": 1000 * sum(r["grammar_seconds"] for r in rows)
                / forwards}

    summary = {}
    for method in methods:
        per_round = [totals(method, r) for r in range(args.rounds)]
        speedups = [per_round[r]["tokens_per_s"] / totals("ar", r)["tokens_per_s"]
                    for r in range(args.rounds)]
        summary[method] = {
            "speedup_over_constrained_ar": speedups,
            "speedup_mean": statistics.mean(speedups),
            **{key: statistics.mean(p[key] for p in per_round) for key in per_round[0]}}
    report = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "cpu": cpu_model(), "threads": args.threads, "dtype": str(target.dtype),
              "schemas": list(schemas), "max_new_tokens": args.max_new_tokens,
              "rounds": args.rounds, "outputs_identical_to_ar": identical,
              "summary": summary, "runs": runs,
              "examples": {name: target.tokenizer.decode(outputs[("ar", name)],
                                                         skip_special_tokens=True)
                           for name in schemas}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: report[k] for k in ("date", "cpu", "threads", "dtype",
                                              "outputs_identical_to_ar", "summary")}, indent=1))


if __name__ == "__main__":
    main()
