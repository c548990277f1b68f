"""What checking a datastore costs when it is opened (RELIABILITY.md, "Datastores").

Times, on a store that is only read (default: the GSM8K ID store in the cache), the median of
REPEATS runs, in CPU time of this process (the machines are shared: wall time would mostly
measure the other jobs), of: reading the manifest; the open-time check (`verify_store`: sizes,
headers and sha256 within OPEN_HASH_BUDGET); the same with a budget of 0 (what a store larger
than the budget gets: sizes and headers only); the full check (`dresd inspect --verify`); and
opening the dense part (`DenseDatastore`) with and without the check. The files are in the page
cache (the first, untimed, pass puts them there): the figures are the CPU cost of the check.

    python benchmarks/micro/open_cost.py [--store DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from dresd.datastore import format as store_format
from dresd.datastore.dense import DenseDatastore

REPEATS = 7


def median_seconds(function) -> float:
    times = []
    for _ in range(REPEATS):
        store_format._VERIFIED.clear()  # measure the check, not its in-process memo
        started = time.process_time()
        function()
        times.append(time.process_time() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", type=Path,
                        default=Path.home() / ".cache/dresd/datastores/gsm8k-id")
    store = parser.parse_args().store
    manifest = store_format.read_manifest(store)
    store_format.verify_store(store, manifest, full=True)  # warm the page cache; and it is whole
    data_bytes = sum(meta["bytes"] for meta in manifest.files.values())
    figures = {"store": str(store), "corpus_tokens": manifest.num_corpus_tokens,
               "data_bytes": data_bytes, "open_hash_budget": store_format.OPEN_HASH_BUDGET}
    figures["clock"] = f"CPU time (time.process_time), median of {REPEATS}"
    figures["read_manifest_ms"] = 1e3 * median_seconds(lambda: store_format.read_manifest(store))
    figures["open_check_ms"] = 1e3 * median_seconds(
        lambda: store_format.verify_store(store, manifest))
    budget = store_format.OPEN_HASH_BUDGET
    store_format.OPEN_HASH_BUDGET = 0
    figures["sizes_and_headers_only_ms"] = 1e3 * median_seconds(
        lambda: store_format.verify_store(store, manifest))
    store_format.OPEN_HASH_BUDGET = budget
    figures["full_check_ms"] = 1e3 * median_seconds(
        lambda: store_format.verify_store(store, manifest, full=True))
    figures["dense_open_ms"] = 1e3 * median_seconds(lambda: DenseDatastore(store))
    real_verify = store_format.verify_store
    store_format.verify_store = lambda *args, **kwargs: None
    try:
        figures["dense_open_unchecked_ms"] = 1e3 * median_seconds(lambda: DenseDatastore(store))
    finally:
        store_format.verify_store = real_verify
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
