"""What a datastore holds, for `dresd inspect`: counts, dims, model, sources, and the bytes
each component costs per corpus token (file bytes / corpus tokens)."""

from __future__ import annotations

from pathlib import Path

from dresd.datastore.format import MANIFEST, read_manifest, verify_store

# file name (or its first folder) -> the component it belongs to
COMPONENTS = {
    "keys.npy": "keys",
    "index.faiss": "keys (index)",
    "scann": "keys (index)",
    "offsets.npy": "value offsets",
    "stream.npy": "token stream (values)",
    "states.npy": "raw hidden states (--keep-states)",
    "doc_starts.npy": "document bounds",
    "transform.npz": "transform",
    "sparse/symbols.npy": "sparse: token stream",
    "sparse/suffix_array.npy": "sparse: suffix array",
    "sparse/alphabet.npy": "sparse: alphabet",
    "sparse/doc_starts.npy": "sparse: document bounds",
}


def describe(folder: str | Path, verify: bool = False) -> dict:
    """A dict of the datastore's figures. A damaged store is an error naming its bad files
    (`verify_store`): the open-time checks, or with `verify` every file's sha256."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    verify_store(folder, manifest, full=verify)
    tokens = max(1, manifest.num_corpus_tokens)
    by_component: dict[str, int] = {}
    for name in [*manifest.files, MANIFEST]:
        component = COMPONENTS.get(name) or COMPONENTS.get(name.split("/")[0], "other")
        if name == MANIFEST:
            component = "manifest"
        by_component[component] = by_component.get(component, 0) + (folder / name).stat().st_size
    figures = {
        "path": str(folder),
        "kind": manifest.kind,
        "model": manifest.model,
        "model_fingerprint": manifest.model_fingerprint[:12],
        "tokenizer_fingerprint": manifest.tokenizer_fingerprint[:12],
        "entries": manifest.num_entries,
        "corpus_tokens": manifest.num_corpus_tokens,
        "documents": manifest.num_documents,
        "settings": manifest.settings,
        "sources": [f"{c['source']} ({c['files']} file(s), {c['bytes']} bytes)"
                    for c in manifest.corpus],
        "bytes": sum(by_component.values()),
        "bytes_per_corpus_token": {k: v / tokens for k, v in sorted(by_component.items())},
        "bytes_per_corpus_token_total": sum(by_component.values()) / tokens,
        "versions": manifest.versions,
    }
    figures["checksums"] = "every file's sha256 verified" if verify else "open-time checks passed"
    return figures


def format_description(f: dict) -> str:
    s = f["settings"]
    lines = [
        f"{f['path']}: {f['kind']} datastore for {f['model']} "
        f"(model {f['model_fingerprint']}, tokenizer {f['tokenizer_fingerprint']})",
        f"  entries {f['entries']:,}, corpus tokens {f['corpus_tokens']:,}, "
        f"documents {f['documents']:,}",
    ]
    kinds = f["kind"].split(",")
    if "dense" in kinds:
        index = s.get("index")
        detail = f", nlist {s['nlist']}, nprobe {s['nprobe']}, recall@10 {s['recall_at_10']:.3f}" \
            if index in ("ivf", "ivfpq") else ""
        lines.append(f"  keys: {s['pca_dim']} dims ({s['key_dtype']}) from hidden size "
                     f"{s['hidden_size']}; values: {s['value_len']} tokens; index: {index}{detail}")
        # Stores from before --dtype were all built in float32.
        lines.append(f"  built in {s.get('build_dtype', 'float32')}")
    if "sparse" in kinds:
        sp = s["sparse"]
        lines.append(f"  sparse: suffix array ({sp['suffix_array_dtype']}) of "
                     f"{sp['num_suffixes']:,} suffixes (tokens + document ends); "
                     f"{sp['distinct_ids']:,} distinct token ids as {sp['symbol_bytes']}-byte "
                     "symbols")
    lines.append("  sources: " + "; ".join(f["sources"]))
    for grown in s.get("appends", []):  # `dresd build --append`
        lines.append(f"  appended {grown['date']}: {grown['documents']:,} documents, "
                     f"{grown['tokens']:,} tokens, {grown['entries']:,} entries")
    lines.append(f"  size: {f['bytes']:,} bytes = {f['bytes_per_corpus_token_total']:.1f} bytes "
                 "per corpus token:")
    for component, value in f["bytes_per_corpus_token"].items():
        lines.append(f"    {component:24} {value:8.2f}")
    lines.append(f"  checksums: {f['checksums']}")
    return "\n".join(lines)
