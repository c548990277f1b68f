"""dresd's side of `openvino.sh`: the prompts, transformers' prompt lookup, dresd's bench runs
gathered, and the table.

Runs in dresd's environment (`.venv`); OpenVINO runs in its own (`ov_genai_run.py`). Steps:

- `prompts`: the first N GSM8K test questions, as `dresd bench --dataset gsm8k` loads them,
  chat-templated by `dresd.prompts.encode_prompt` with the default model's tokenizer: one
  JSON line per prompt with `prompt` and `prompt_ids`; every runner reads these ids;
- `transformers`: transformers' `generate`, greedy, without and with `prompt_lookup_num_tokens`
  (5 tokens, `max_matching_ngram_size` 3, as OpenVINO's prompt lookup), interleaved prompt by
  prompt after one untimed warm-up each; one JSON line per variant. `--model plain`:
  `AutoModelForCausalLM` in bf16 as transformers loads it (its default attention, no dresd
  code); `--model dresd`: the model `dresd.models.load_target` returns (bf16, dresd's
  prepacked linears and attention kernel, still transformers' own forward and `DynamicCache`);
- `collect`: a `dresd bench` output folder (report.json and outputs.jsonl, or
  concurrency.json) as JSON lines of the same shape;
- `table`: the raw JSON lines of a run (several rounds) as the markdown table and the figures
  without token ids (`benchmarks/results/peers/openvino.md`, `.jsonl`).

    PYTHONPATH=src .venv/bin/python benchmarks/peers/openvino_side.py prompts --limit 16 \
        --out runs/peers/openvino/prompts.jsonl
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time
from collections import defaultdict
from pathlib import Path

PL_TOKENS = 5  # prompt_lookup_num_tokens, as OpenVINO's num_assistant_tokens
PL_NGRAM = 3  # max_matching_ngram_size, as OpenVINO's max_ngram_size
# CPU flags worth stating beside a bf16 / fp16 run
FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile",
         "amx_bf16", "amx_int8")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def cmd_prompts(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    from dresd.datasets import load_prompts
    from dresd.models.target import resolve_model_path
    from dresd.prompts import encode_prompt

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("default"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        for index, prompt in enumerate(load_prompts("gsm8k", args.limit)):
            ids = encode_prompt(tokenizer, prompt.text)
            f.write(json.dumps({"prompt_index": index, "prompt": prompt.text,
                                "prompt_ids": ids}) + "\n")


def cmd_transformers(args: argparse.Namespace) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from dresd.models.target import resolve_model_path

    torch.set_num_threads(args.threads)
    if args.model == "dresd":
        from dresd.models.target import load_target

        target = load_target("default", dtype="bfloat16", device="cpu")
        model, linears = target.model, target.linears
    else:
        path = resolve_model_path("default")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
        linears = "plain"
    prompts = [row["prompt_ids"] for row in read_jsonl(args.prompts)[:args.limit]]
    variants = {"generate": {},
                "generate-pl": {"prompt_lookup_num_tokens": PL_TOKENS,
                                "max_matching_ngram_size": PL_NGRAM}}

    def generate(ids: list[int], max_new_tokens: int, extra: dict) -> list[int]:
        input_ids = torch.tensor([ids])
        with torch.inference_mode():
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                 do_sample=False, max_new_tokens=max_new_tokens,
                                 pad_token_id=model.generation_config.eos_token_id, **extra)
        return out[0, len(ids):].tolist()

    for extra in variants.values():  # warm-up, untimed
        generate(prompts[0][:64], 8, extra)
    seconds = dict.fromkeys(variants, 0.0)
    outputs: dict[str, list] = {name: [] for name in variants}
    for ids in prompts:
        for name, extra in variants.items():
            began = time.perf_counter()
            outputs[name].append(generate(ids, args.max_new_tokens, extra))
            seconds[name] += time.perf_counter() - began
    for name in variants:
        tokens = sum(len(ids) for ids in outputs[name])
        print(json.dumps({
            "runner": "transformers", "pipeline": f"{name}[{args.model}]", "set": args.set,
            "requests": 1,
            "threads": args.threads, "round": args.round, "weights": "bf16",
            "prompt_lookup": {"prompt_lookup_num_tokens": PL_TOKENS,
                              "max_matching_ngram_size": PL_NGRAM} if variants[name] else None,
            "max_new_tokens": args.max_new_tokens, "num_prompts": len(prompts),
            "num_new_tokens": tokens, "seconds": seconds[name],
            "tokens_per_s": tokens / seconds[name],
            "runtime": {"torch": torch.__version__, "transformers": transformers.__version__,
                        "attention": model.config._attn_implementation,
                        "model": args.model, "linears": linears},
            "token_ids": outputs[name]}), flush=True)


def cmd_collect(args: argparse.Namespace) -> None:
    """One line per method (and concurrency level) of a dresd bench folder."""
    folder = args.run
    if (folder / "concurrency.json").exists():
        report = json.loads((folder / "concurrency.json").read_text())
        meta = report["meta"]
        for row in report["rows"]:
            print(json.dumps({
                "runner": "dresd", "pipeline": row["method"], "set": args.set,
                "requests": row["concurrency"], "threads": meta["threads"],
                "round": args.round, "weights": meta["dtype"],
                "max_new_tokens": meta["max_new_tokens"],
                "num_prompts": row.get("num_outputs", row["num_prompts"]),  # over its rounds
                "num_new_tokens": row["num_new_tokens"], "seconds": row["seconds"],
                "tokens_per_s": row["tokens_per_s"], "identical_to_ar": row["identical"],
                "mean_accepted_length": row["mean_accepted_length"], "runtime": _meta(meta)}))
        return
    report = json.loads((folder / "report.json").read_text())
    meta = report["meta"]
    outputs: dict[str, dict[int, list]] = defaultdict(dict)
    for row in read_jsonl(folder / "outputs.jsonl"):
        outputs[row["method"]][row["prompt_index"]] = row["token_ids"]
    for method, figures in report["methods"].items():
        ids = outputs[method]
        print(json.dumps({
            "runner": "dresd", "pipeline": method, "set": args.set, "requests": 1,
            "threads": meta["threads"], "round": args.round, "weights": meta["dtype"],
            "max_new_tokens": meta["max_new_tokens"], "num_prompts": figures["num_prompts"],
            "num_new_tokens": figures["num_new_tokens"], "seconds": figures["seconds"],
            "tokens_per_s": figures["tokens_per_s"],
            "identical_to_ar": round(figures["identical_fraction"] * figures["num_prompts"]),
            "mean_accepted_length": figures["mean_accepted_length"], "runtime": _meta(meta),
            "datastore": meta["drafter_options"].get(method, {}).get("datastore"),
            "token_ids": [ids[i] for i in sorted(ids)]}))


def _meta(meta: dict) -> dict:
    return {key: meta.get(key) for key in ("dtype", "linears", "attention", "torch",
                                           "transformers", "cpu", "cpu_native_bf16", "date")}


# --- the table -------------------------------------------------------------------------------

RUNNERS = ["dresd", "openvino", "transformers"]
PIPELINES = ["ar", "pld", "suffix", "hybrid", "llm", "llm-pl", "cb", "cb-pl", "generate",
             "generate-pl"]


def _rank(pipeline: str) -> int:
    bare = pipeline.split("[")[0]
    return PIPELINES.index(bare) if bare in PIPELINES else len(PIPELINES)


def _strip_eos(ids: list[int], eos: set[int]) -> list[int]:
    return ids[:-1] if ids and ids[-1] in eos else ids


def _equal(mine: list[list[int]] | None, reference: list[list[int]] | None, tokens: int,
           eos: set[int]) -> tuple[int, int] | None:
    """(outputs equal to the reference over their first `tokens` tokens, prompts compared)."""
    if not mine or not reference:
        return None
    pairs = list(zip(mine, reference, strict=False))
    same = sum(_strip_eos(a[:tokens], eos) == _strip_eos(b[:tokens], eos) for a, b in pairs)
    return same, len(pairs)


def _label(row: dict) -> str:
    runner, pipeline = row["runner"], row["pipeline"]
    if runner == "dresd":
        return f"dresd `{pipeline}` ({row['weights']}, dresd's forward)"
    if runner == "transformers":
        name, _, model = pipeline.partition("[")
        what = ("`generate`, plain" if name == "generate" else
                f"`generate(prompt_lookup_num_tokens={PL_TOKENS}, "
                f"max_matching_ngram_size={PL_NGRAM})`")
        on = ("dresd's loaded model: its linears and attention kernel" if model.startswith("dresd")
              else "plain transformers model")
        return f"transformers {what} (bf16, {on})"
    names = {"llm": "`LLMPipeline`, plain",
             "llm-pl": f"`LLMPipeline(prompt_lookup=True)`, {PL_TOKENS} tokens, n-gram {PL_NGRAM}",
             "cb": "`ContinuousBatchingPipeline`, plain",
             "cb-pl": f"`ContinuousBatchingPipeline`, prompt lookup ({PL_TOKENS}, {PL_NGRAM})"}
    return f"OpenVINO GenAI {names.get(pipeline, pipeline)} ({row.get('weights', '?')} IR)"


def _spread(values: list[float]) -> str:
    mean = sum(values) / len(values)
    if len(values) == 1:
        return f"{mean:.1f}"
    return f"{mean:.1f} ± {(max(values) - min(values)) / 2:.1f}"


def cmd_table(args: argparse.Namespace) -> None:
    from dresd.host import cpu_flags, cpu_model

    rows = read_jsonl(args.raw)
    eos = set(args.eos)
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        groups[(row["set"], row["runner"], row["pipeline"], row["requests"])].append(row)
    rounds = sorted({row["round"] for row in rows})
    threads = sorted({row["threads"] for row in rows})

    def ar_of(set_name: str, round_: int, requests: int = 1) -> dict | None:
        return next((r for r in groups.get((set_name, "dresd", "ar", requests), [])
                     if r["round"] == round_ and "error" not in r), None)

    figures, lines = [], []
    single_ref = ar_of("single", rounds[0]) if rounds else None
    for set_name in ("single", "batch"):
        keys = [key for key in groups if key[0] == set_name]
        if not keys:
            continue
        keys.sort(key=lambda k: (k[3], RUNNERS.index(k[1]) if k[1] in RUNNERS else 9,
                                 _rank(k[2]), k[2]))
        sample = groups[keys[0]][0]
        if set_name == "single":
            lines += [f"## One request at a time: the first {sample['num_prompts']} GSM8K test "
                      f"questions, {sample['max_new_tokens']} new tokens", "",
                      "| runner | requests | tokens/s | x dresd `ar` | outputs equal to dresd "
                      "`ar` |", "| --- | ---: | ---: | ---: | ---: |"]
        else:
            lines += ["", f"## Batched: the first {sample['num_prompts']} GSM8K test questions, "
                      f"{sample['max_new_tokens']} new tokens, 1 request at a time and all "
                      "submitted at once", "",
                      "| runner | requests | tokens/s (aggregate) | x dresd `ar`, 1 request | "
                      "x dresd `ar`, same requests | outputs equal to dresd `ar` |",
                      "| --- | ---: | ---: | ---: | ---: | ---: |"]
        for key in keys:
            runs = groups[key]
            good = [r for r in runs if "error" not in r]
            _, runner, pipeline, requests = key
            entry = {"set": set_name, "runner": runner, "pipeline": pipeline,
                     "requests": requests, "weights": runs[0].get("weights"),
                     "threads": runs[0]["threads"], "rounds": len(runs)}
            if not good:
                entry["error"] = runs[0]["error"]
                figures.append(entry)
                cells = [f"died: {runs[0]['error']}"] + ["-"] * (2 if set_name == "single"
                                                                   else 3)
                lines.append(f"| {_label(runs[0])} | {requests} | " + " | ".join(cells) + " |")
                continue
            speeds = [r["tokens_per_s"] for r in good]
            ratio_one = [r["tokens_per_s"] / ar["tokens_per_s"] for r in good
                         if (ar := ar_of(set_name, r["round"]))]
            ratio_same = [r["tokens_per_s"] / ar["tokens_per_s"] for r in good
                          if (ar := ar_of(set_name, r["round"], requests))]
            first = good[0]
            if runner == "dresd":
                equal = (first["identical_to_ar"], first["num_prompts"])
                equal_text = f"{equal[0]}/{equal[1]} (dresd's own check)"
            else:  # greedy outputs against dresd ar's single-stream ones, informative only
                equal = _equal(first.get("token_ids"),
                               single_ref.get("token_ids") if single_ref else None,
                               first["max_new_tokens"], eos)
                equal_text = f"{equal[0]}/{equal[1]}" if equal else "-"
                if equal and set_name == "batch":
                    equal_text += f" (first {equal[1]}, {first['max_new_tokens']} tokens)"
            entry.update({
                "tokens_per_s": sum(speeds) / len(speeds), "tokens_per_s_rounds": speeds,
                "over_dresd_ar": sum(ratio_one) / len(ratio_one) if ratio_one else None,
                "over_dresd_ar_same_requests":
                    sum(ratio_same) / len(ratio_same) if ratio_same else None,
                "equal_to_dresd_ar": list(equal) if equal else None,
                "num_prompts": first["num_prompts"], "max_new_tokens": first["max_new_tokens"],
                "runtime": first.get("runtime"), "prompt_lookup": first.get("prompt_lookup"),
                "mean_accepted_length": first.get("mean_accepted_length"),
                "datastore": first.get("datastore")})
            figures.append(entry)

            def ratio(values: list[float]) -> str:
                return f"{sum(values) / len(values):.2f}x" if values else "-"

            cells = [_spread(speeds), ratio(ratio_one)]
            if set_name == "batch":
                cells.append(ratio(ratio_same))
            cells.append(equal_text)
            lines.append(f"| {_label(first)} | {requests} | " + " | ".join(cells) + " |")

    ov = next((r.get("runtime") for r in rows if r["runner"] == "openvino" and "error" not in r),
              None) or {}
    dresd = next((r.get("runtime") for r in rows if r["runner"] == "dresd"), None) or {}
    hf = next((r.get("runtime") for r in rows if r["runner"] == "transformers"), None) or {}
    hf_models = list(dict.fromkeys(r["runtime"]["model"] for r in rows
                                   if r["runner"] == "transformers" and "runtime" in r))
    store = next((r.get("datastore") for r in rows
                  if r["runner"] == "dresd" and r["pipeline"] == "hybrid"), None)
    flags = [flag for flag in FLAGS if flag in cpu_flags()]
    header = [
        f"# dresd beside OpenVINO GenAI and transformers{' (SMOKE RUN)' if args.smoke else ''}",
        "",
        f"Measured {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC on "
        f"{cpu_model()} ({platform.machine()}, {os.cpu_count()} cores; flags: "
        f"{', '.join(flags) or 'none of ' + ', '.join(FLAGS)}), {', '.join(map(str, threads))} "
        f"thread(s) for every runner, {len(rounds)} round(s) (tokens/s: the mean over rounds "
        "± half their range; ratios: over dresd `ar` in the same round, then averaged). "
        "Greedy. Produced by `bash benchmarks/peers/openvino.sh`"
        f"{' (' + args.command_line + ')' if args.command_line else ''}.",
        "",
        "- dresd: `dresd bench` (methods interleaved prompt by prompt; batched: `--concurrency "
        f"1,N`), {dresd.get('dtype', '?')}, linears: {dresd.get('linears', '?')}, attention: "
        f"{dresd.get('attention', '?')}; torch {dresd.get('torch', '?')}, transformers "
        f"{dresd.get('transformers', '?')}; hybrid's datastore: "
        f"{store or 'none (PLD and suffix sources only)'}.",
        f"- OpenVINO GenAI {ov.get('openvino_genai', '?')} (runtime {ov.get('openvino', '?')}): "
        "the default model exported with `optimum-cli export openvino --task "
        "text-generation-with-past --weight-format fp16`; **not like for like**: the IR's "
        "weights are fp16 and the CPU plugin computes in the precision it reports on this CPU "
        f"(`INFERENCE_PRECISION_HINT` {ov.get('INFERENCE_PRECISION_HINT', '?')}, KV cache "
        f"`KV_CACHE_PRECISION` {ov.get('KV_CACHE_PRECISION', '?')}), against dresd's bf16 "
        "weights and bf16 KV cache. `INFERENCE_NUM_THREADS` set to the thread count. Pipelines "
        "interleaved prompt by prompt in one process per group; `ContinuousBatchingPipeline` "
        "with prefix caching off (dresd has none) and 1 GB of KV cache.",
        f"- transformers {hf.get('transformers', '?')} `generate` (its own decoding loop, "
        "forward and `DynamicCache`; prompt lookup: its `PromptLookupCandidateGenerator`) on "
        + " and on ".join(
            "the model as `dresd.models.load_target` loads it (bf16, dresd's prepacked "
            "linears and attention kernel)" if kind == "dresd" else
            "plain `AutoModelForCausalLM` in bf16 (transformers' own linears and attention)"
            for kind in hf_models) + ".",
        "- Prompts: the same token ids for every runner (GSM8K test questions, dresd's chat "
        "template via `dresd.prompts.encode_prompt`). \"Outputs equal to dresd `ar`\": greedy "
        "outputs of another runner equal to dresd `ar`'s single-stream ones (trailing EOS "
        "ignored; batched rows: the prompts both sets share, cut to the batched length); "
        "informative only: fp16/bf16 runtimes differ at near-ties. dresd rows: dresd's own "
        "exactness check against its `ar` (must be all).",
        "",
    ]
    args.out.with_suffix(".md").write_text("\n".join(header + lines) + "\n")
    with open(args.out.with_suffix(".jsonl"), "w") as f:
        for entry in figures:
            f.write(json.dumps(entry) + "\n")
    print("\n".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("prompts")
    p.add_argument("--limit", type=int, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.set_defaults(func=cmd_prompts)
    p = commands.add_parser("transformers")
    p.add_argument("--prompts", type=Path, required=True)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--round", type=int, default=1)
    p.add_argument("--set", default="single")
    p.add_argument("--model", choices=("plain", "dresd"), default="plain",
                   help="plain transformers bf16, or the model as dresd loads it")
    p.set_defaults(func=cmd_transformers)
    p = commands.add_parser("collect")
    p.add_argument("--run", type=Path, required=True, help="a dresd bench --out folder")
    p.add_argument("--round", type=int, default=1)
    p.add_argument("--set", default="single")
    p.set_defaults(func=cmd_collect)
    p = commands.add_parser("table")
    p.add_argument("--raw", type=Path, required=True, help="the run's raw JSON lines")
    p.add_argument("--out", type=Path, required=True, help="writes OUT.md and OUT.jsonl")
    p.add_argument("--eos", type=int, nargs="*", default=[2], help="EOS ids (ignored at ends)")
    p.add_argument("--smoke", action="store_true", help="label the table a smoke run")
    p.add_argument("--command-line", default="", help="the settings, for the table's header")
    p.set_defaults(func=cmd_table)
    args = parser.parse_args()
    args.func(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
