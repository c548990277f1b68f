"""The loop on a GPU: what a verify forward costs by tree size, and what the loop adds per step.

Models are built from a config with random weights, so no checkpoint has to travel to the GPU
machine: a SmolLM2-135M-shaped and a Llama-2-7B-shaped Llama, in bfloat16 (`--smoke`: a tiny
Llama in float32 on the CPU, to check the script itself in seconds). For each model:

1. Verify cost: median time of one forward over a tree of t tokens (t = 1 ... 128) on a warm
   KV cache of `--context` tokens, and cost(t) = that / the one-token step
   (`calibrate.measure_verify_seconds`, the curve `hybrid` budgets by; sizes interleaved).
2. The loop's own work per step, each part timed alone between two device synchronisations,
   against the forward of the same tree: building the tree's tensors on the device (ids,
   positions, mask), acceptance (argmax, the accepted tokens read back), cache compaction
   (the accepted path moved to the front of the tree's slot), for trees of 1, 16, 64, 128.
3. End to end, greedy, `--new-tokens` tokens after a repetitive prompt: `ar` (transformers
   generate), `none` (plain decoding through the loop: its overhead over `ar`), `pld`,
   `hybrid` (budgeted by the curve of part 1), and an oracle that knows `ar`'s output and
   drafts it as one branch among decoys (acceptance as good as drafts get; its branch is not
   the first, so compaction moves entries). Per method: tokens/s, forwards, ms per step,
   drafting's share, and whether the output equals `ar`'s (`verify.classify_divergence`: in
   bf16 a near-tie may flip a token, see decoding/verify.py; `unexplained` is a bug).

Random weights give meaningless text, so acceptance (PLD, hybrid) says nothing about real
models; the costs do not depend on the weights.

    # on the GPU machine (an environment with a CUDA build of torch), from the repository root:
    PYTHONPATH=src python benchmarks/gpu.py --out $OUT/gpu.json      # writes gpu.json, gpu.md
    PYTHONPATH=src python benchmarks/gpu.py --smoke --out /tmp/gpu.json   # CPU, seconds
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig

from dresd.calibrate import filled_cache, measure_verify_seconds, random_tree
from dresd.decoding import speculative_generate
from dresd.decoding.drafter import Draft, DraftContext, Drafter
from dresd.decoding.forward import Segment
from dresd.decoding.verify import classify_divergence, greedy_accept
from dresd.device import clock, device_name, resolve_device
from dresd.drafters import HybridDrafter, NoDrafter, PromptLookupDrafter
from dresd.metrics import summarize
from dresd.models.fastpath import dtype_name

SHAPES = {  # the models' own config.json values that decide the cost
    "SmolLM2-135M": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         tie_word_embeddings=True, max_position_embeddings=8192),
    "Llama-2-7B": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                       tie_word_embeddings=False, max_position_embeddings=4096),
}
SMOKE_SHAPE = {"tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            tie_word_embeddings=False, max_position_embeddings=1024)}
CURVE_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
PART_SIZES = (1, 16, 64, 128)


def build_model(shape: dict, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """A Llama of this shape with random weights, made directly on the device."""
    config = LlamaConfig(**shape, eos_token_id=None, bos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    with device:
        return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


@torch.inference_mode()
def loop_parts(model: torch.nn.Module, sizes: tuple[int, ...], context_len: int, repeats: int
               ) -> dict[int, dict[str, float]]:
    """Median ms of each part of a step, per tree size: tree tensors, forward, accept, compact."""
    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    rng = np.random.default_rng(1)
    forward, sequence = filled_cache(model, context_len, rng)  # the loop's own forward
    times: dict[int, dict[str, list[float]]] = {
        size: {"tree_tensors": [], "forward": [], "accept": [], "compact": []} for size in sizes}
    for repeat in range(repeats + 1):
        for size in sizes:
            tree = random_tree(size, vocab, rng)
            t0 = clock(device)
            segment = Segment(sequence, tree.tokens, context_len, depths=tree.depths,
                              ancestors=tree.ancestor_matrix(device))
            t1 = clock(device)
            output = forward([segment])[0]
            t2 = clock(device)
            greedy_accept(tree, output.greedy)
            t3 = clock(device)
            # The deepest node's path: on a bushy tree not the first nodes, so entries move.
            forward.keep(sequence, context_len, tree.path_to(len(tree) - 1))
            t4 = clock(device)
            forward.keep(sequence, context_len, [])
            if repeat > 0:  # the first round is a warm-up
                for part, seconds in zip(times[size], (t1 - t0, t2 - t1, t3 - t2, t4 - t3),
                                         strict=True):
                    times[size][part].append(seconds)
    return {size: {part: 1000 * statistics.median(values) for part, values in parts.items()}
            for size, parts in times.items()}


class OracleDrafter(Drafter):
    """Knows the reference output: drafts its next `depth` tokens as the second of `width`
    branches, the others random decoys (so the accepted path is never the first nodes)."""

    name = "oracle"

    def __init__(self, prompt_len: int, reference: list[int], width: int, depth: int,
                 vocab: int) -> None:
        self.prompt_len, self.reference, self.width, self.depth = (prompt_len, reference,
                                                                   width, depth)
        self.vocab, self.rng = vocab, np.random.default_rng(2)

    def propose(self, context: DraftContext) -> list[Draft]:
        done = len(context.token_ids) - self.prompt_len
        truth = self.reference[done : done + min(self.depth, context.max_draft_len)]
        decoys = [self.rng.integers(self.vocab, size=len(truth)).tolist()
                  for _ in range(self.width - 1)]
        return decoys[:1] + [truth] + decoys[1:] if truth else []


@torch.inference_mode()
def end_to_end(model: torch.nn.Module, curve: dict[int, float], new_tokens: int,
               prompt_len: int) -> dict[str, dict]:
    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    vocab = model.config.vocab_size
    rng = np.random.default_rng(3)
    motif = rng.integers(vocab, size=32).tolist()
    prompt = (motif * (prompt_len // 32 + 1))[:prompt_len]  # repetitive: PLD finds matches
    ids = torch.tensor([prompt], device=device)

    def ar() -> tuple[list[int], list[tuple[float, float]], float]:
        started = clock(device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
        seconds = clock(device) - started
        top2 = torch.stack([step[0] for step in out.logits]).float().topk(2, dim=-1).values
        return out.sequences[0, len(prompt):].tolist(), [tuple(t) for t in top2.tolist()], seconds

    ar()  # warm-up: allocator, kernels
    reference, top2, ar_seconds = ar()
    rows = {"ar": {"tokens_per_s": len(reference) / ar_seconds, "num_target_forwards":
                   len(reference), "ms_per_forward": 1000 * ar_seconds / len(reference)}}
    methods = {
        "none": lambda: NoDrafter(),
        "pld": lambda: PromptLookupDrafter(),
        "hybrid": lambda: HybridDrafter(cost=curve),
        "oracle 1x8": lambda: OracleDrafter(len(prompt), reference, 1, 8, vocab),
        "oracle 4x8": lambda: OracleDrafter(len(prompt), reference, 4, 8, vocab),
    }
    for name, make in methods.items():
        speculative_generate(model, make(), ids, max_new_tokens=8)  # warm-up
        result = speculative_generate(model, make(), ids, max_new_tokens=new_tokens)
        figures = summarize([result])
        steps = result.steps
        rows[name] = {
            "tokens_per_s": figures["tokens_per_s"],
            "speedup_over_ar": figures["tokens_per_s"] / rows["ar"]["tokens_per_s"],
            "num_target_forwards": result.num_target_forwards,
            "mean_accepted_length": figures["mean_accepted_length"],
            "drafted_tokens_per_step": figures["drafted_tokens_per_step"],
            "ms_per_step": 1000 * sum(s.draft_seconds + s.verify_seconds for s in steps)
            / max(len(steps), 1),
            "draft_ms_per_step": 1000 * sum(s.draft_seconds for s in steps) / max(len(steps), 1),
            "draft_time_share": figures["draft_time_share"],
            "output": classify_divergence(result.token_ids, reference, top2, dtype),
        }
    return rows


def run_model(name: str, shape: dict, args: argparse.Namespace, device: torch.device,
              dtype: torch.dtype) -> dict:
    started = clock(device)
    model = build_model(shape, dtype, device)
    print(f"{name}: built in {clock(device) - started:.1f} s", file=sys.stderr, flush=True)
    curve_sizes = CURVE_SIZES if not args.smoke else (1, 2, 4, 8)
    part_sizes = PART_SIZES if not args.smoke else (1, 4)
    seconds = measure_verify_seconds(model, curve_sizes, args.context, args.repeats)
    curve = {size: seconds[size] / seconds[1] for size in curve_sizes}
    parts = loop_parts(model, part_sizes, args.context, args.repeats)
    rows = end_to_end(model, curve, args.new_tokens, args.context)
    record = {
        "shape": shape,
        "parameters": sum(p.numel() for p in model.parameters()),
        "verify_ms": {size: 1000 * s for size, s in seconds.items()},
        "verify_cost": curve,
        "loop_parts_ms": parts,
        "end_to_end": rows,
    }
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return record


def markdown(report: dict) -> str:
    meta = report["meta"]
    lines = [f"# dresd on {meta['device']}", "",
             f"{meta['date']}; torch {meta['torch']} (CUDA {meta['cuda']}), transformers "
             f"{meta['transformers']}; {meta['dtype']}; random weights; KV cache of "
             f"{meta['context']} tokens; medians of {meta['repeats']} repetitions.", ""]
    for name, rec in report["models"].items():
        lines += [f"## {name}-shaped ({rec['parameters'] / 1e6:.1f}M parameters)", "",
                  "Verify forward by tree tokens t: ms, and cost(t) in one-token steps.", "",
                  "| t | " + " | ".join(str(t) for t in rec["verify_ms"]) + " |",
                  "|---|" + "---:|" * len(rec["verify_ms"]),
                  "| ms | " + " | ".join(f"{v:.2f}" for v in rec["verify_ms"].values()) + " |",
                  "| cost | " + " | ".join(f"{v:.2f}" for v in rec["verify_cost"].values())
                  + " |", "",
                  "The loop's own work per step (ms), against the forward of the same tree:", "",
                  "| tree tokens | tree tensors | forward | accept | compact | "
                  "loop work / forward |", "|---:|---:|---:|---:|---:|---:|"]
        for size, p in rec["loop_parts_ms"].items():
            extra = p["tree_tensors"] + p["accept"] + p["compact"]
            lines.append(f"| {size} | {p['tree_tensors']:.3f} | {p['forward']:.2f} | "
                         f"{p['accept']:.3f} | {p['compact']:.3f} | {extra / p['forward']:.1%} |")
        lines += ["", f"End to end, greedy, {meta['new_tokens']} new tokens:", "",
                  "| method | tokens/s | x ar | forwards | accepted length | drafted/step | "
                  "ms/step | draft ms/step | output vs ar |", "|---|" + "---:|" * 7 + "---|"]
        for method, r in rec["end_to_end"].items():
            if method == "ar":
                lines.append(f"| ar | {r['tokens_per_s']:.1f} | 1.00 | "
                             f"{r['num_target_forwards']} | 1.00 | | "
                             f"{r['ms_per_forward']:.2f} | | reference |")
                continue
            lines.append(f"| {method} | {r['tokens_per_s']:.1f} | {r['speedup_over_ar']:.2f} | "
                         f"{r['num_target_forwards']} | {r['mean_accepted_length']:.2f} | "
                         f"{r['drafted_tokens_per_step']:.1f} | {r['ms_per_step']:.2f} | "
                         f"{r['draft_ms_per_step']:.3f} | {r['output']} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON file (and .md beside)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--models", default=",".join(SHAPES), help="comma-separated shapes")
    parser.add_argument("--context", type=int, default=512, help="tokens in the KV cache")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny model on the CPU in float32, few sizes: checks the script")
    args = parser.parse_args(argv)
    if args.smoke:
        args.device, args.dtype, args.context, args.repeats, args.new_tokens = (
            "cpu", "float32", 64, 2, 16)
    device = resolve_device(args.device)
    dtype = getattr(torch, args.dtype)
    shapes = SMOKE_SHAPE if args.smoke else {name: SHAPES[name] for name in args.models.split(",")}
    report = {"meta": {
        "device": device_name(device), "dtype": dtype_name(dtype), "context": args.context,
        "repeats": args.repeats, "new_tokens": args.new_tokens, "torch": torch.__version__,
        "cuda": torch.version.cuda, "transformers": transformers.__version__,
        "host": platform.processor() or platform.machine(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }, "models": {}}
    for name, shape in shapes.items():
        report["models"][name] = run_model(name, shape, args, device, dtype)
        args.out.parent.mkdir(parents=True, exist_ok=True)  # written after each model
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(markdown(report) + "\n")
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
