"""REST's sparse datastore: build time, bytes per corpus token, and `propose` latency.

    PYTHONPATH=src python benchmarks/micro/rest_latency.py [--sizes 1000000 10000000] \\
        [--queries 1000]

Corpora (real tokens): Python source files (the interpreter's standard library, then the
installed packages'), sorted by path, one document per file, tokenised with the default model's
tokenizer (SmolLM2, 49,152 ids), cut to the first 1M and 10M tokens. The queries are contexts
from held-out files (every 20th file, never in the corpus): each query is the held-out file's
tokens up to a random position, so the last token plays the bonus token. One more corpus of
random ids, uniform over 128,256 ids (Llama 3's vocabulary), shows the large-alphabet case
(4-byte symbols); its lookups rarely match, so its latency is a lower bound.

Latency is the wall clock of `RestDrafter.propose` with REST's defaults (16..2 suffix, k=5000,
10 tokens, 64 nodes), after 50 untimed warm-up calls; a query's latency is the fastest of
`--repeats` (3) calls, so that other processes' preemption on a shared machine does not
count (`--repeats 1` times single calls); one thread (numpy's element-wise work and
libdivsufsort's search are single-threaded; BLAS is not used). `lookup_p50_us` is one
suffix-array range search alone (a query's last two tokens), single calls. The setup line
records the load average: the machine's cores may be shared with other work. Results go to
benchmarks/results/rest_latency.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sysconfig
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from dresd.datastore.sparse import build_sparse  # noqa: E402
from dresd.drafters import DraftContext, RestDrafter  # noqa: E402

RESULTS = Path(__file__).parents[1] / "results"
HELD_OUT_EVERY = 20  # every 20th source file is a query file, never in the corpus


def python_sources() -> list[Path]:
    roots = [Path(sysconfig.get_paths()["stdlib"]), Path(sysconfig.get_paths()["purelib"])]
    files = []
    for root in roots:
        files += sorted(p for p in root.rglob("*.py")
                        if "site-packages" not in p.relative_to(root).parts or root == roots[1])
    return list(dict.fromkeys(files))  # stdlib first; no file twice


def tokenize_sources(max_tokens: int, cache: Path) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(corpus documents up to max_tokens tokens, held-out documents), cached as .npz."""
    if cache.exists():
        data = np.load(cache, allow_pickle=False)
        split = lambda key: np.split(data[key], data[key + "_offsets"][1:-1])  # noqa: E731
        return split("corpus"), split("held_out")
    from transformers import AutoTokenizer

    from dresd.models.target import ensure_default_model

    tokenizer = AutoTokenizer.from_pretrained(ensure_default_model())
    corpus, held_out, total = [], [], 0
    files = python_sources()
    for start in range(0, len(files), 200):
        batch = files[start : start + 200]
        texts = [f.read_text(encoding="utf-8", errors="replace") for f in batch]
        for number, ids in enumerate(tokenizer(texts)["input_ids"], start):
            ids = np.array(ids, dtype=np.int32)
            if number % HELD_OUT_EVERY == 0:
                held_out.append(ids)
            elif total < max_tokens:
                corpus.append(ids)
                total += len(ids)
        if total >= max_tokens and len(held_out) >= 50:
            break
    offsets = lambda docs: np.cumsum([0] + [len(d) for d in docs])  # noqa: E731
    np.savez(cache, corpus=np.concatenate(corpus), corpus_offsets=offsets(corpus),
             held_out=np.concatenate(held_out), held_out_offsets=offsets(held_out))
    return corpus, held_out


def cut(docs: list[np.ndarray], num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """The first `num_tokens` tokens of the documents (the last one cut short)."""
    tokens = np.concatenate(docs)[:num_tokens]
    offsets = np.cumsum([0] + [len(d) for d in docs])
    offsets = np.append(offsets[offsets < len(tokens)], len(tokens))
    return tokens, offsets


def measure(name: str, tokens: np.ndarray, offsets: np.ndarray, queries: list[np.ndarray],
            workdir: Path, repeats: int) -> dict:
    started = time.perf_counter()
    index = build_sparse(tokens, offsets, workdir / name)
    build_seconds = time.perf_counter() - started
    drafter = RestDrafter(index)
    contexts = [DraftContext(q, torch.zeros(1), 10) for q in queries]
    for context in contexts[:50]:
        drafter.propose(context)
    latencies, nodes = [], []
    for context in contexts:
        fastest = float("inf")
        for _ in range(repeats):  # the fastest of a few calls: the code's cost, not preemption's
            t0 = time.perf_counter_ns()
            drafts = drafter.propose(context)
            fastest = min(fastest, (time.perf_counter_ns() - t0) / 1e6)
        latencies.append(fastest)
        nodes.append(len({tuple(d[:k]) for d in drafts for k in range(1, len(d) + 1)}))
    latencies = np.array(latencies)
    # The suffix-array lookup alone: one range search (two sa_search calls) for a query's
    # last two tokens, the shortest suffix REST looks up.
    searches = []
    for context in contexts:
        symbols = index.to_symbols(context.token_ids[-2:])
        t0 = time.perf_counter_ns()
        index.match_rows(symbols)
        searches.append((time.perf_counter_ns() - t0) / 1e3)
    disk_bytes = sum(f.stat().st_size for f in (workdir / name).iterdir())
    return {
        "corpus": name,
        "tokens": index.num_tokens,
        "documents": index.num_documents,
        "distinct_ids": len(index.alphabet),
        "symbol_bytes": index.width,
        "build_seconds": round(build_seconds, 2),
        "bytes_per_token": round(disk_bytes / index.num_tokens, 3),
        "queries": len(latencies),
        "p50_ms": round(float(np.percentile(latencies, 50)), 4),
        "p99_ms": round(float(np.percentile(latencies, 99)), 4),
        "mean_ms": round(float(latencies.mean()), 4),
        "lookup_p50_us": round(float(np.percentile(searches, 50)), 2),
        "queries_with_drafts": round(float(np.mean(np.array(nodes) > 0)), 3),
        "mean_tree_nodes": round(float(np.mean(nodes)), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3,
                        help="calls per query; its latency is the fastest (1: a single call)")
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "dresd-py.npz")
    args = parser.parse_args()
    torch.set_num_threads(1)

    corpus, held_out = tokenize_sources(max(args.sizes), args.cache)
    rng = np.random.default_rng(0)
    queries = []
    for _ in range(args.queries):
        doc = held_out[rng.integers(len(held_out))]
        end = int(rng.integers(2, len(doc) + 1)) if len(doc) > 2 else len(doc)
        queries.append(doc[max(0, end - 64) : end].astype(np.int64))

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            name = f"python-{size // 1_000_000}M" if size >= 1_000_000 else f"python-{size}"
            rows.append(measure(name, *cut(corpus, size), queries, Path(tmp), args.repeats))
            print(rows[-1], flush=True)
        size = max(args.sizes)
        random_tokens = rng.integers(0, 128_256, size=size)
        offsets = np.arange(0, size + 1, 4096)
        offsets = np.append(offsets[offsets < size], size)
        random_queries = [rng.integers(0, 128_256, size=64) for _ in range(args.queries)]
        rows.append(measure(f"random-128k-{size // 1_000_000}M", random_tokens, offsets,
                            random_queries, Path(tmp), args.repeats))
        print(rows[-1], flush=True)

    setup = {"threads": torch.get_num_threads(), "repeats_per_query": args.repeats,
             "load_average_1min": round(os.getloadavg()[0], 2),
             "cpu": platform.processor() or platform.machine(),
             "cpu_count": os.cpu_count(), "python": platform.python_version(),
             "numpy": np.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "rest_latency.json").write_text(json.dumps({"setup": setup, "rows": rows},
                                                          indent=2) + "\n")
    (RESULTS / "rest_latency.md").write_text(markdown(setup, rows))
    print(markdown(setup, rows))


def markdown(setup: dict, rows: list[dict]) -> str:
    columns = ["corpus", "tokens", "distinct_ids", "symbol_bytes", "build_seconds",
               "bytes_per_token", "p50_ms", "p99_ms", "mean_ms", "lookup_p50_us",
               "queries_with_drafts", "mean_tree_nodes"]
    lines = ["# REST sparse datastore: build and `propose` latency", "",
             "Command: `PYTHONPATH=src python benchmarks/micro/rest_latency.py` "
             "(see the script's docstring for the corpora and queries).", "",
             "Setup: " + ", ".join(f"{k} {v}" for k, v in setup.items()), "",
             "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(row[c]) for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
