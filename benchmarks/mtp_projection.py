"""What a Qwen3.5 file's MTP block costs to draft with, and what it would gain: measured costs,
projected speed-ups (random weights accept nothing, so no acceptance rate is measured here).

A random-weight Qwen3.5 model of `recurrent_verify.py`'s shape (24 layers, 18 Gated DeltaNet
and 6 full attention, hidden 1024; the default model's 49k vocabulary) with an MTP block (a
full-attention layer, eh_proj, norms), written as llama.cpp's converter writes it
(`tests/gguf_files.convert_qwen35_like_llama_cpp`), Q4_0 linears, loaded as any GGUF file.
Measured in one process, one thread:

- the one-token step and the verify-cost curve cost(t) (`calibrate.measure_verify_cost`);
- the block's call on one row after 128 cached rows, and its LM head's share of it (the head
  grows with the vocabulary: Qwen3.5's is 248k, 5x this one);
- `ar`, `mtp`, `hybrid` and `hybrid[mtp=1]` tokens/s on the same prompts (outputs compared),
  each drafter new every round: with random weights `mtp` accepts ~nothing, so these show
  what drafting with the block costs when it never pays.

Projected: tokens a step E = 1 + a + ... + a^d for a chain of d drafts, each accepted with
probability a given the one before; time a step = cost(d + 1) + d r (r: the block's call /
the step); speed-up = E / time.

    PYTHONPATH=src:tests .venv/bin/python benchmarks/mtp_projection.py

Results: benchmarks/results/mtp/.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf_files import convert_qwen35_like_llama_cpp
from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

from dresd import kernels
from dresd.calibrate import measure_verify_cost
from dresd.decoding import speculative_generate
from dresd.drafters import HybridDrafter, MTPDrafter, NoDrafter
from dresd.host import cpu_model
from dresd.models.target import load_target

SHAPE = dict(vocab_size=49152, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
             num_attention_heads=8, num_key_value_heads=2, head_dim=256,
             linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
             linear_value_head_dim=128, linear_conv_kernel_dim=4, tie_word_embeddings=False)
OUT = Path("benchmarks/results/mtp")
ACCEPTANCE = (0.5, 0.7, 0.9)  # assumed per-token acceptance, for the projection only


def random_model_and_block() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The model, and MTP weights under a checkpoint's names (its own first full-attention
    layer's values reused: speed does not depend on them)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3_5TextConfig(**SHAPE)).eval()
    full = model.config.layer_types.index("full_attention")
    weights = {f"mtp.layers.0.{name}": value.clone()
               for name, value in model.model.layers[full].state_dict().items()}
    hidden = SHAPE["hidden_size"]
    weights["mtp.fc.weight"] = 0.02 * torch.randn(hidden, 2 * hidden)
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        weights[f"mtp.{name}.weight"] = torch.zeros(hidden)
    return model, weights


def block_seconds(target, rows: int = 128, repeats: int = 20) -> tuple[float, float]:
    """Median seconds of the block on one row after `rows` cached rows, and of its head."""
    block = target.model.mtp
    cache = block.new_cache()
    hidden = torch.randn(rows + 1, SHAPE["hidden_size"]).to(torch.bfloat16)
    block(cache, 0, list(range(rows)), hidden[:rows], list(range(rows)))
    calls, heads = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        out, _ = block(cache, rows, [7], hidden[rows:], [rows])
        calls.append(time.perf_counter() - started)
        started = time.perf_counter()
        block.head(out)
        heads.append(time.perf_counter() - started)
    return statistics.median(calls), statistics.median(heads)


def tokens_per_second(target, drafter_for, prompts, new_tokens: int) -> tuple[float, list]:
    outputs, seconds = [], 0.0
    for prompt in prompts:
        started = time.perf_counter()
        result = speculative_generate(target.model, drafter_for(), torch.tensor(prompt),
                                      max_new_tokens=new_tokens)
        seconds += time.perf_counter() - started
        outputs.append(result.token_ids)
    return len(prompts) * new_tokens / seconds, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--file", default="/tmp/dresd-mtp-projection.gguf",
                        help="the random-weight file: written there once, then reused")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = Path(args.file)
    if not path.exists():
        model, weights = random_model_and_block()
        convert_qwen35_like_llama_cpp(model, path, Q.Q4_0, mtp=weights)
        del model
    target = load_target(str(path))
    cost, step = measure_verify_cost(target.model, sizes=(1, 2, 3, 4), repeats=5)
    call, head = block_seconds(target)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, SHAPE["vocab_size"], 64).tolist() for _ in range(3)]
    def fresh(make):  # a drafter new each round: nothing learned from an earlier round
        def drafter_for_round():
            drafter = make()
            drafter.check_target(target)
            return drafter
        return drafter_for_round

    methods = {"ar": NoDrafter, "mtp": fresh(lambda: MTPDrafter(depth=2)),
               "hybrid with mtp": fresh(lambda: HybridDrafter(mtp=True)),
               "hybrid": fresh(HybridDrafter)}
    speeds: dict[str, list[float]] = {name: [] for name in methods}
    reference = None
    for _ in range(args.rounds):  # interleaved: each round times every method once
        for name, make_round in methods.items():
            drafter = make_round()
            speed, outputs = tokens_per_second(target, drafter.fork, prompts, args.new_tokens)
            reference = reference or outputs
            assert outputs == reference, f"{name}'s output differs from ar's"
            speeds[name].append(speed)
    ratio = call / step
    projection = {}
    for depth in (1, 2, 3):
        for accept in ACCEPTANCE:
            expected = sum(accept ** i for i in range(depth + 1))
            projection[f"d={depth} a={accept}"] = expected / (cost[depth + 1] + depth * ratio)
    report = {"meta": {"cpu": cpu_model(), "tier": getattr(kernels.tier(), "name", None),
                       "threads": args.threads, "shape": SHAPE,
                       "linears": "Q4_0", "rounds": args.rounds,
                       "new_tokens": args.new_tokens, "prompts": len(prompts)},
              "step_ms": step * 1e3, "cost": cost, "block_ms": call * 1e3,
              "block_head_ms": head * 1e3, "block_over_step": ratio,
              "tokens_per_second": speeds, "projected_speedup": projection}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "report.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
