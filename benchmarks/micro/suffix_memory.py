"""SuffixDecoding's tries on real text: nodes and bytes per stored token, insert and draft time.

Stores the first N GSM8K training answers (default-model tokenizer) in one suffix trie of depth
24, as the global trie holds finished outputs, and measures with tracemalloc the bytes it holds,
then times `SuffixDrafter.propose` on contexts taken from GSM8K test answers (the per-request
trie extended by one token per call, as in generation). Writes results/suffix_memory.json.

    .venv/bin/python benchmarks/micro/suffix_memory.py [--answers 1000]
"""

from __future__ import annotations

import argparse
import json
import platform
import tracemalloc
from pathlib import Path
from time import perf_counter

import numpy as np
import torch
from transformers import AutoTokenizer

from dresd.datasets import data_dir, read_jsonl
from dresd.decoding.drafter import DraftContext
from dresd.drafters.suffix import SuffixDrafter, SuffixTrie
from dresd.models.target import default_model_dir

OUT = Path(__file__).parents[1] / "results" / "suffix_memory.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--answers", type=int, default=1000)
    parser.add_argument("--depth", type=int, default=24)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    train = read_jsonl(data_dir() / "gsm8k" / "train.jsonl")[: args.answers]
    outputs = [tokenizer(row["answer"])["input_ids"] for row in train]
    tokens = sum(map(len, outputs))

    tracemalloc.start()
    started = perf_counter()
    trie = SuffixTrie(args.depth)
    for output in outputs:
        trie.add(output)
    insert_seconds = perf_counter() - started
    held_bytes, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()

    # Draft latency: a drafter whose global trie holds the same answers, on test answers.
    drafter = SuffixDrafter(max_depth=args.depth, max_cached_tokens=tokens + 1)
    for output in outputs:
        drafter.observe([], output)
    test = read_jsonl(data_dir() / "gsm8k" / "test.jsonl")[:20]
    latencies, drafted = [], []
    for row in test:
        ids = np.array(tokenizer(row["question"] + "\n" + row["answer"])["input_ids"])
        for n in range(8, len(ids)):
            started = perf_counter()
            drafts = drafter.propose(DraftContext(ids[:n], torch.zeros(1), 64))
            latencies.append(perf_counter() - started)
            drafted.append(len({tuple(d[:i + 1]) for d in drafts for i in range(len(d))}))
    result = {
        "answers": len(outputs), "tokens": tokens, "depth": args.depth,
        "nodes": trie.num_nodes, "nodes_per_token": trie.num_nodes / tokens,
        "bytes_per_token": held_bytes / tokens, "bytes_per_node": held_bytes / trie.num_nodes,
        "insert_us_per_token": 1e6 * insert_seconds / tokens,
        "propose_ms_median": 1e3 * float(np.median(latencies)),
        "propose_ms_p90": 1e3 * float(np.percentile(latencies, 90)),
        "drafted_tokens_per_call_mean": float(np.mean(drafted)),
        "propose_calls": len(latencies),
        "python": platform.python_version(), "cpu": platform.machine(),
    }
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
