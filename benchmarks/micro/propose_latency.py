"""`DenseDrafter.propose` latency at 100k and 1M entries, and the target's one-token decode step.

Synthetic stores (stated in the results), keys in two distributions: `clustered`, 64-d unit
vectors drawn around 2,000 random centres with overlapping spread (hidden states cluster), and
`uniform`, uniform on the sphere (no structure at all: the worst case for IVF, whose nprobe must
then grow to reach the recall target). The token stream is random, and the transform is a
random orthonormal projection 576 -> 64 with zero mean and unit std. A query is the hidden
state that the projection maps next to a random stored key, so every search has a true near
neighbour. The stores are written in the real
layout (datastore/dense.py) and opened through `DenseDatastore`, so `propose` runs the real path:
transform, search (k = 50), first-token filter, draft slicing.

Goal (issue 3): p50 <= 1 ms on one thread at 1M entries, and <= 5% of a one-token decode step.

    PYTHONPATH=src python benchmarks/micro/propose_latency.py [--sizes 100000 1000000] \\
        [--queries 2000]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from itertools import product
from pathlib import Path

import numpy as np
import torch

from dresd.datastore import index as key_index
from dresd.datastore.dense import DOC_STARTS_FILE, OFFSETS_FILE, STREAM_FILE, TRANSFORM_FILE
from dresd.datastore.format import Manifest
from dresd.datastore.transform import KeyTransform
from dresd.decoding.drafter import DraftContext
from dresd.drafters.dense import DenseDrafter

HIDDEN, DIM, VOCAB, CENTRES = 576, 64, 49152, 2000


def synthetic_keys(n: int, distribution: str, rng: np.random.Generator) -> np.ndarray:
    if distribution == "uniform":
        return rng.normal(size=(n, DIM)).astype(np.float32)
    centres = rng.normal(size=(CENTRES, DIM)).astype(np.float32)
    return centres[rng.integers(0, CENTRES, n)] + rng.normal(size=(n, DIM)).astype(np.float32)


def synthetic_store(folder: Path, n: int, index: str, distribution: str,
                    rng: np.random.Generator) -> dict:
    """Write a dense datastore of `n` synthetic entries; returns build figures."""
    folder.mkdir(parents=True)
    keys = synthetic_keys(n, distribution, rng)
    keys /= np.linalg.norm(keys, axis=1, keepdims=True)
    keys = keys.astype(np.float16)
    projection, _ = np.linalg.qr(rng.normal(size=(HIDDEN, DIM)))  # orthonormal columns
    transform = KeyTransform(mean=np.zeros(HIDDEN, np.float32), std=np.ones(HIDDEN, np.float32),
                             components=projection.T.astype(np.float32))
    transform.save(folder / TRANSFORM_FILE)
    np.save(folder / OFFSETS_FILE, np.arange(n, dtype=np.uint32))
    np.save(folder / STREAM_FILE, rng.integers(0, VOCAB, n + 32).astype(np.uint16))
    np.save(folder / DOC_STARTS_FILE, np.array([0, n + 32], dtype=np.int64))
    started = time.perf_counter()
    np.save(folder / key_index.KEYS_FILE, keys)
    settings = key_index.build_index(index, keys, folder)
    build_seconds = time.perf_counter() - started
    if index != "exact":
        (folder / key_index.KEYS_FILE).unlink()
    files = [p for p in folder.rglob("*") if p.is_file()]
    manifest = Manifest(kind="dense", model="synthetic", model_fingerprint="-",
                        tokenizer_fingerprint="-", vocab_size=VOCAB, num_entries=n,
                        num_corpus_tokens=n + 32, num_documents=1, corpus=[],
                        settings={"hidden_size": HIDDEN, "pca_dim": DIM, "value_len": 20,
                                  **settings})
    (folder / "manifest.json").write_text(manifest.to_json())
    index_bytes = sum(p.stat().st_size for p in files
                      if p.name in ("index.faiss", "keys.npy") or "scann" in p.parts)
    return {"index_settings": settings, "index_build_seconds": round(build_seconds, 2),
            "index_bytes_per_entry": round(index_bytes / n, 2), "keys": keys,
            "projection": projection}


def measure_propose(folder: Path, keys: np.ndarray, projection: np.ndarray, queries: int,
                    rng: np.random.Generator) -> dict:
    drafter = DenseDrafter(str(folder))
    stream = drafter.store.stream
    picks = rng.integers(0, len(keys), queries)
    noise = 0.05 * rng.normal(size=(queries, DIM)).astype(np.float32)
    states = torch.from_numpy(((keys[picks].astype(np.float32) + noise) @ projection.T)
                              .astype(np.float32))
    contexts = [DraftContext(np.array([1, 2, int(stream[p + 1])]), states[i], 64)
                for i, p in enumerate(picks)]
    for context in contexts[:50]:  # warm-up: page in the memory-mapped files
        drafter.propose(context)
    times, drafts = [], []
    for context in contexts:
        started = time.perf_counter()
        out = drafter.propose(context)
        times.append(time.perf_counter() - started)
        drafts.append(len(out))
    ms = np.array(times) * 1e3
    return {"p50_ms": round(float(np.percentile(ms, 50)), 4),
            "p99_ms": round(float(np.percentile(ms, 99)), 4),
            "mean_ms": round(float(ms.mean()), 4),
            "mean_drafts": round(float(np.mean(drafts)), 2)}


@torch.inference_mode()
def decode_step_ms(context_len: int = 256, steps: int = 50) -> float:
    """Median time of one-token decode forwards of the default model on a KV cache."""
    from transformers import DynamicCache

    from dresd.models.target import load_target

    model = load_target("default").model
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.randint(0, 1000, (1, context_len)), cache=cache, use_cache=True)
    times = []
    token = torch.tensor([[42]])
    for _ in range(steps):
        started = time.perf_counter()
        model(input_ids=token, cache=cache, use_cache=True, logits_to_keep=1)
        times.append(time.perf_counter() - started)
    return float(np.median(times) * 1e3)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--indexes", nargs="+", default=["exact", "ivf", "scann"])
    parser.add_argument("--queries", type=int, default=2000)
    parser.add_argument("--distributions", nargs="+", default=["clustered", "uniform"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/propose_latency.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import faiss

    faiss.omp_set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    step_ms = decode_step_ms()
    print(f"target one-token decode step: {step_ms:.2f} ms", file=sys.stderr)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n, distribution, index in product(args.sizes, args.distributions, args.indexes):
            if index == "exact" and n > 200_000:
                continue  # exact search is for small stores only
            if index == "scann":
                try:
                    import scann  # noqa: F401
                except ImportError:
                    print("scann not installed: skipped", file=sys.stderr)
                    continue
            folder = Path(tmp) / f"{index}-{distribution}-{n}"
            built = synthetic_store(folder, n, index, distribution, rng)
            figures = measure_propose(folder, built.pop("keys"), built.pop("projection"),
                                      args.queries, rng)
            row = {"entries": n, "keys": distribution, "index": index, **built, **figures,
                   "p50_share_of_decode_step": round(figures["p50_ms"] / step_ms, 4)}
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    result = {"benchmark": "propose_latency", "threads": args.threads, "k": 50,
              "num_drafts": 10, "len_drafts": 10, "queries": args.queries,
              "synthetic": "64-d unit keys, clustered (2000 centres) or uniform; random tokens; "
                           "random orthonormal transform; see the script's docstring",
              "decode_step_ms": round(step_ms, 3), "decode_step_context": 256,
              "machine": platform.processor() or platform.machine(),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
