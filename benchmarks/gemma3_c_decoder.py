"""A Gemma-3 GGUF file's plain decoding (`ar`) on the C decoder against transformers' forward
(`forward.HFForward`, what ran a gemma3 file before the C decoder took its layers), side by
side in one process: each round times both on the same loaded model, one after the other, so
both see the same machine; the ratio per round, and its spread.

    PYTHONPATH=src:tests python benchmarks/peers/random_gguf.py gemma3-1b G.gguf --type Q4_0
    PYTHONPATH=src python benchmarks/gemma3_c_decoder.py G.gguf --rounds 4 --threads 1

Each timing: a 16-token prompt, then `--tokens` tokens of `ar` through dresd's loop (one
untimed warm-up run per forward first). Results: one JSON line per round on stdout, the
summary last. Not part of the tests.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from dresd.decoding.batch import BatchEngine, Request
from dresd.decoding.forward import HFForward
from dresd.drafters import NoDrafter
from dresd.host import cpu_model
from dresd.models.target import load_target


def tokens_per_second(model, forward: str, tokens: int) -> tuple[float, list[int]]:
    engine = BatchEngine(model, max_batch_size=1)
    if forward == "transformers":
        engine.forward = HFForward(model)
    else:
        assert getattr(engine.forward, "c_decoder", None) is not None, "no C decoder"
    state = engine.add(Request(prompt=list(range(100, 116)), drafter=NoDrafter(),
                               max_new_tokens=tokens, eos_token_ids=[]))
    started = time.perf_counter()
    engine.run()
    seconds = time.perf_counter() - started
    return tokens / seconds, state.result.token_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_target(args.model).model
    for forward in ("transformers", "c"):
        tokens_per_second(model, forward, 4)  # warm-up
    ratios, speeds = [], {"transformers": [], "c": []}
    for round_number in range(1, args.rounds + 1):
        order = ("transformers", "c") if round_number % 2 else ("c", "transformers")
        row, outputs = {}, {}
        for forward in order:
            row[forward], outputs[forward] = tokens_per_second(model, forward, args.tokens)
            speeds[forward].append(row[forward])
        ratios.append(row["c"] / row["transformers"])
        print(json.dumps({"round": round_number, "transformers_ts": row["transformers"],
                          "c_decoder_ts": row["c"], "ratio": ratios[-1],
                          "same_tokens": outputs["c"] == outputs["transformers"]}), flush=True)
    print(json.dumps({
        "cpu": cpu_model(), "threads": args.threads, "tokens": args.tokens,
        "transformers_ts_mean": statistics.mean(speeds["transformers"]),
        "c_decoder_ts_mean": statistics.mean(speeds["c"]),
        "ratio_mean": statistics.mean(ratios), "ratio_min": min(ratios),
        "ratio_max": max(ratios)}))


if __name__ == "__main__":
    main()
