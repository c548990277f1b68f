"""How strong DReSD's retrieval is, and what makes it so: store size, key positions, PCA, k,
neighbour ranking, value length and index, each against REST on the same store and prompts.

    python benchmarks/studies/retrieval_study.py --store STORE --dataset gsm8k --limit 100 \
        --name gsm8k-id [--ablations] [--sizes 10000,30000,...]
        [--variants 'IVF-PQ at recall 0.9']   (add variants to a finished study)

STORE must be built with `dresd build --kind dense,sparse --keep-states`: its raw hidden states
let every variant refit its own keys without a new forward. Each variant is replayed, not run:

1. AR's greedy output for each prompt (bf16 here, as `--dtype auto` runs), and one forward over
   prompt + output for the query states (as `draft_shapes.py` does: greedy verification accepts
   exactly the longest tree path equal to AR's own next tokens, so the loop replays without
   verify forwards);
2. a variant's keys: a subset of the store's entries (the first documents up to a size; key
   positions; template positions), a transform refitted on them, an index;
3. every query's top-200 neighbours in one batched search; the replay then takes each step's
   drafts from the precomputed neighbours of the position its bonus token sits at;
4. REST on the same documents: a suffix array over the same token stream, real `RestDrafter`.

Metrics per variant, over all steps of all prompts (a step = one verify; `dresd.bench.replay`):

    mean accepted length = mean over steps of (accepted draft tokens + 1)    (the bonus counts)
    acceptance rate      = accepted draft tokens / drafted tokens
    est. speedup         = from the verify-cost curve, AR's time per token and the variant's
                           measured single-query search plus draft time (`dresd.bench.replay`)

The estimate is derived, not run; `bench` measures the real figure for the shapes that matter.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

import faiss
import numpy as np
import torch
from tqdm import tqdm

from dresd.bench.replay import Reference, drafter_proposer, reference, replay, summarise
from dresd.calibrate import load_or_measure
from dresd.corpus import CorpusSpec, tokenize_corpus
from dresd.datasets import load_prompts
from dresd.datastore import index as key_index
from dresd.datastore.dense import STATES_FILE
from dresd.datastore.format import read_manifest
from dresd.datastore.sparse import sparse_in_memory
from dresd.datastore.transform import KeyTransform, StatsAccumulator
from dresd.drafters import RestDrafter
from dresd.drafters.dense import distinct_drafts
from dresd.drafters.prefixes import prefix_tree_drafts
from dresd.models.target import Target, load_target
from dresd.prompts import encode_prompt

RESULTS = Path(__file__).parents[1] / "results" / "retrieval"
MAX_K = 200  # neighbours searched once per query; smaller k are its prefixes
FIT_SAMPLE = 200_000  # entries the transform of a variant is fitted on (random, seeded)


# --- 1. references: AR's output and the query states ------------------------------------------

def references(target: Target, dataset: str, limit: int, max_new_tokens: int,
               cache: Path) -> tuple[list[Reference], float]:
    """AR's greedy outputs (cached in `cache`: they are the figures' ground truth) and their
    query states; also AR's measured seconds per generated token."""
    prompts = load_prompts(dataset, limit=limit)
    cached = json.loads(cache.read_text()) if cache.exists() else {}
    refs, seconds, tokens = [], 0.0, 0
    for n, prompt in enumerate(tqdm(prompts, desc="AR references", unit="prompt")):
        ids = encode_prompt(target.tokenizer, prompt.text)
        row = cached.get(str(n))
        if row is None or row["prompt"] != ids:
            eos = target.eos_token_ids
            started = time.process_time()
            out = target.model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens,
                                        do_sample=False, eos_token_id=eos or None,
                                        pad_token_id=eos[0] if eos else 0)
            row = {"prompt": ids, "output": out[0, len(ids):].tolist(),
                   "seconds": time.process_time() - started}
            cached[str(n)] = row
        seconds += row["seconds"]
        tokens += len(row["output"])
        refs.append(reference(target, ids, row["output"]))
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(cached))
    return refs, seconds / max(tokens, 1)


def query_rows(ref: Reference) -> range:
    """Positions i whose bonus token ids[i] a step can sit at; its query is hidden[i - 1]."""
    return range(ref.prompt_len, len(ref.ids) - 1)


# --- 2. the store and a variant's keys ----------------------------------------------------------

class StudyStore:
    """A --keep-states store's arrays, read once."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.manifest = read_manifest(folder)
        if STATES_FILE not in self.manifest.files:
            raise SystemExit(f"{folder} has no {STATES_FILE}: build it with --keep-states")
        self.states = np.load(folder / STATES_FILE, mmap_mode="r")
        self.offsets = np.load(folder / "offsets.npy").astype(np.int64)
        self.stream = np.load(folder / "stream.npy").astype(np.int64)
        self.doc_starts = np.load(folder / "doc_starts.npy")
        self.value_len = int(self.manifest.settings["value_len"])
        self.entry_doc = np.searchsorted(self.doc_starts, self.offsets, side="right") - 1
        self.entry_pos = self.offsets - self.doc_starts[self.entry_doc]  # position in its doc

    def docs_for_size(self, tokens: int) -> int:
        """The number of first documents (corpus order) that hold about `tokens` tokens."""
        return int(min(len(self.doc_starts) - 1,
                       np.searchsorted(self.doc_starts, tokens, side="left")))

    def template_length(self, num_docs: int) -> int:
        """Length of the token prefix every document shares (the chat template's system turn):
        states there are identical in every document."""
        first = self.stream[self.doc_starts[0] : self.doc_starts[1]]
        length = len(first)
        for d in range(1, num_docs):
            doc = self.stream[self.doc_starts[d] : self.doc_starts[d] + length]
            differs = np.flatnonzero(doc != first[: len(doc)])
            length = min(length, len(doc), differs[0] if len(differs) else length)
        return int(length)

    def response_starts(self, tokenizer) -> np.ndarray:
        """Per document, the first key position of its response (prompt/response corpora)."""
        spec = self.manifest.settings["corpus_spec"]
        source = self.manifest.corpus[0]["path"]
        docs = tokenize_corpus(tokenizer, CorpusSpec([source], **{**spec, "keys": "response"}))
        if [len(d.ids) for d in docs] != np.diff(self.doc_starts).tolist():
            raise SystemExit("re-tokenized documents differ from the store's")
        return np.array([d.key_start for d in docs])


@dataclass(frozen=True)
class KeySet:
    """Which entries get keys, and how: one variant of the store's keys."""

    size: int  # corpus tokens (first documents)
    positions: str = "all"  # all | response
    template: str = "kept"  # kept | dedup | dropped: the shared template prefix's keys
    pca: int | None = 64  # None: z-score and L2 norm only (the full hidden size)
    index: str = "exact"  # exact | ivf | ivfpq (at the build's recall target, 0.9)


@dataclass
class Keys:
    entries: np.ndarray  # store entry ids, row r of the index is entries[r]
    index: object  # a KeyIndex (dresd.datastore.index)
    transform: KeyTransform
    num_docs: int


def make_keys(store: StudyStore, spec: KeySet, response_starts: np.ndarray | None,
              work: Path) -> Keys:
    num_docs = store.docs_for_size(spec.size)
    selected = store.entry_doc < num_docs
    if spec.positions == "response":
        selected &= store.entry_pos >= response_starts[store.entry_doc]
    if spec.template != "kept":
        shared = store.entry_pos < store.template_length(num_docs)
        if spec.template == "dedup":  # the first document's copy stays
            shared &= store.entry_doc > 0
        selected &= ~shared
    entries = np.flatnonzero(selected)
    rng = np.random.default_rng(0)
    sample = np.sort(rng.choice(entries, min(FIT_SAMPLE, len(entries)), replace=False))
    stats = StatsAccumulator(store.states.shape[1])
    stats.add(store.states[sample])
    if spec.pca is None:
        transform = stats.fit(1)
        eye = np.eye(store.states.shape[1], dtype=np.float32)
        transform = KeyTransform(transform.mean, transform.std, eye, 1.0)
    else:
        transform = stats.fit(spec.pca)
    keys = np.concatenate([transform.apply(store.states[entries[s : s + 65536]])
                           for s in range(0, len(entries), 65536)])
    keys = keys.astype(np.float16)  # as a store keeps them
    if spec.index == "exact":
        index = key_index.ExactIndex(keys)
    else:
        folder = work / spec.index
        folder.mkdir(parents=True, exist_ok=True)
        if spec.index == "ivfpq":  # its exact re-ranking reads the fp16 keys from here
            np.save(folder / key_index.KEYS_FILE, keys)
        index = key_index.open_index(folder, key_index.build_index(spec.index, keys, folder))
    return Keys(entries, index, transform, num_docs)


def neighbours(keys: Keys, refs: list[Reference]) -> list[np.ndarray]:
    """Per reference, [positions, MAX_K] store entry ids (-1: none), best first."""
    queries = np.concatenate([r.hidden[query_rows(r).start - 1 : query_rows(r).stop - 1]
                              for r in refs])
    faiss.omp_set_num_threads(1)
    found = np.concatenate([keys.index.search(keys.transform.apply(queries[s : s + 1024]),
                                              MAX_K)[1] for s in range(0, len(queries), 1024)])
    found = np.where(found >= 0, keys.entries[np.maximum(found, 0)], -1)
    per_ref, start = [], 0
    for r in refs:
        per_ref.append(found[start : start + len(query_rows(r))])
        start += len(query_rows(r))
    return per_ref


def search_seconds(keys: Keys, refs: list[Reference], k: int, repeats: int = 64) -> float:
    """Median single-query search time (the engine searches one query per step)."""
    rows = [r.hidden[r.prompt_len - 1] for r in refs][:repeats]
    times = []
    for state in rows:
        started = time.process_time()
        keys.index.search(keys.transform.apply(state)[None, :], k)
        times.append(time.process_time() - started)
    return float(np.median(times))


# --- 3. drafts and replay -------------------------------------------------------------------------

@dataclass(frozen=True)
class Shape:
    """How a step's drafts come from its ranked neighbours."""

    k: int = 50  # neighbours used (paper: 50)
    draft_len: int = 10  # tokens per draft (paper: 10)
    ranking: str = "distance"  # distance: ANN rank order; agreement: most frequent prefixes
    num_drafts: int = 10  # distance: drafts kept (paper: 10)
    max_nodes: int | None = None  # a node budget (distance: drafts in rank order until full)

    @property
    def label(self) -> str:
        budget = f"{self.max_nodes} nodes" if self.max_nodes else f"{self.num_drafts} drafts"
        return f"{self.ranking}, {budget}, k={self.k}, len={self.draft_len}"


def neighbour_values(store: StudyStore, entries: np.ndarray, bonus: int,
                     draft_len: int) -> list[list[int]]:
    """As `DenseDrafter.neighbour_drafts`: the drafts of the entries whose stored next token is
    the bonus token, in rank order, cut at their document's end."""
    entries = entries[entries >= 0]
    start = store.offsets[entries] + 1
    end = np.minimum(start + store.value_len, store.doc_starts[store.entry_doc[entries] + 1])
    keep = store.stream[start] == bonus
    return [store.stream[b + 1 : min(e, b + 1 + draft_len)].tolist()
            for b, e in zip(start[keep], end[keep], strict=True)]


def budget_in_rank_order(drafts: list[list[int]], max_nodes: int) -> list[list[int]]:
    """Drafts in rank order, each adding its new nodes, until the tree holds `max_nodes`."""
    nodes: set[tuple[int, ...]] = set()
    kept = []
    for draft in drafts:
        path = []
        for token in draft:
            path.append(token)
            if tuple(path) not in nodes:
                if len(nodes) == max_nodes:
                    break
                nodes.add(tuple(path))
        if path:
            kept.append(path if tuple(path) in nodes else path[:-1])
    return [d for d in kept if d]


def dense_drafts(store: StudyStore, ranked: np.ndarray, bonus: int, shape: Shape,
                 remaining: int) -> list[list[int]]:
    every = neighbour_values(store, ranked[: shape.k], bonus, min(shape.draft_len, remaining))
    if shape.ranking == "agreement":
        return prefix_tree_drafts(every, shape.max_nodes or 64)
    if shape.max_nodes is not None:
        return budget_in_rank_order(every, shape.max_nodes)
    return distinct_drafts(every, shape.num_drafts)  # the paper's shape


# --- 4. the study ---------------------------------------------------------------------------------

DRESD_DEFAULT = Shape()  # the paper's: 10 drafts x 10 tokens from k = 50, rank order
BUDGETS = (4, 16, 64)  # equal tree budgets for DReSD and REST


def evaluate(store, keys, refs, shapes, rest_budgets, tokens, curve, step_seconds) -> dict:
    """Every shape's DReSD figures on `keys`, and REST's on the same documents."""
    found = neighbours(keys, refs)
    results = {}
    for shape in shapes:
        search = search_seconds(keys, refs, shape.k)

        def propose(n, i, remaining, shape=shape):
            row = found[n][i - refs[n].prompt_len]
            return dense_drafts(store, row, refs[n].ids[i], shape, remaining)

        steps, seconds = replay(refs, propose)
        results[f"dresd ({shape.label})"] = summarise(
            steps, seconds + search * len(steps), tokens, curve, step_seconds)
    if rest_budgets:
        end = int(store.doc_starts[keys.num_docs])
        sparse = sparse_in_memory(store.stream[:end], store.doc_starts[: keys.num_docs + 1])
        for budget in rest_budgets:
            drafter = RestDrafter(sparse, max_tree_nodes=budget)
            steps, seconds = replay(refs, drafter_proposer(drafter, refs))
            results[f"rest ({budget} nodes)"] = summarise(steps, seconds, tokens, curve,
                                                          step_seconds)
    return results


def scaling(store, refs, sizes, ctx) -> list[dict]:
    """DReSD (default and equal budgets) and REST at each store size."""
    shapes = [DRESD_DEFAULT] + [Shape(ranking="agreement", max_nodes=b) for b in BUDGETS]
    rows = []
    for size in sizes:
        keys = make_keys(store, KeySet(size), None, ctx["work"])
        result = evaluate(store, keys, refs, shapes, BUDGETS, **ctx["pricing"])
        rows.append({"size_tokens": int(store.doc_starts[keys.num_docs]),
                     "documents": keys.num_docs, "entries": len(keys.entries),
                     "methods": result})
        print(f"size {rows[-1]['size_tokens']:>9,}: " + ", ".join(
            f"{m} {r['mean_accepted_length']:.2f}" for m, r in result.items()), flush=True)
    return rows


def ablations(store, refs, size, response_starts, ctx, only: list[str] | None = None) -> dict:
    """One change at a time from the default keys and shape, on the same store and prompts
    (`only`: just the key variants of these names)."""
    base = KeySet(size)
    key_variants = {"default (all positions, template kept, PCA 64, exact)": base,
                    "template deduplicated": replace(base, template="dedup"),
                    "template dropped": replace(base, template="dropped"),
                    "PCA 32": replace(base, pca=32), "PCA 128": replace(base, pca=128),
                    "no PCA (z-score + L2)": replace(base, pca=None),
                    "IVF at recall 0.9": replace(base, index="ivf"),
                    "IVF-PQ at recall 0.9": replace(base, index="ivfpq")}
    if response_starts is not None:
        key_variants["response positions only"] = replace(base, positions="response")
    if only:
        key_variants = {name: key_variants[name] for name in only}
    shape_variants = [DRESD_DEFAULT, Shape(k=10), Shape(k=200),
                      Shape(draft_len=5), Shape(draft_len=20),
                      *[Shape(max_nodes=b) for b in BUDGETS],
                      *[Shape(ranking="agreement", max_nodes=b) for b in BUDGETS],
                      Shape(ranking="agreement", max_nodes=16, k=200),
                      Shape(ranking="agreement", max_nodes=4, k=10)]
    out = {}
    for name, spec in key_variants.items():
        keys = make_keys(store, spec, response_starts, ctx["work"])
        shapes = shape_variants if spec == base else [DRESD_DEFAULT, Shape(
            ranking="agreement", max_nodes=4), Shape(ranking="agreement", max_nodes=16)]
        out[name] = {"entries": len(keys.entries),
                     "methods": evaluate(store, keys, refs, shapes,
                                         BUDGETS if spec == base else (), **ctx["pricing"])}
        print(f"{name}: " + ", ".join(f"{m} {r['mean_accepted_length']:.2f}"
                                      for m, r in out[name]["methods"].items()), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", type=Path, help="built with --keep-states")
    parser.add_argument("--dataset", default="gsm8k", help="gsm8k | humaneval | a .jsonl")
    parser.add_argument("--limit", type=int, default=100, help="first N prompts")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--sizes", default="10000,30000,100000,300000,1000000,0",
                        help="store sizes in corpus tokens (0: the whole store)")
    parser.add_argument("--ablations", action="store_true", help="also the ablations")
    parser.add_argument("--ablation-size", type=int, default=0, help="0: the whole store")
    parser.add_argument("--variants", default=None,
                        help="only these ablation key variants (names as in the table, comma-"
                             "separated), merged into an existing NAME.json; no scaling rerun")
    parser.add_argument("--name", required=True, help="results/retrieval/NAME.json")
    parser.add_argument("--references-only", action="store_true",
                        help="only compute (and cache) AR's outputs for the prompts")
    args = parser.parse_args()
    torch.set_num_threads(1)

    target = load_target("default", dtype="auto")
    refs, step_seconds = references(target, args.dataset, args.limit, args.max_new_tokens,
                                    RESULTS / f"ar-{args.dataset}-{args.limit}.json")
    if args.references_only:
        return
    tokens = sum(len(r.ids) - r.prompt_len for r in refs)
    store = StudyStore(args.store)
    total = int(store.doc_starts[-1])
    curve = load_or_measure(target)
    ctx = {"work": Path("/tmp") / f"retrieval-study-{args.name}",
           "pricing": {"tokens": tokens, "curve": curve, "step_seconds": step_seconds}}
    # Sizes that round to the same documents are one size.
    sizes = sorted({int(store.doc_starts[store.docs_for_size(min(int(s), total) or total)])
                    for s in args.sizes.split(",")})
    out = RESULTS / f"{args.name}.json"
    only = args.variants.split(",") if args.variants else None
    if only:  # a few variants added to a finished study of the same store and prompts
        result = json.loads(out.read_text())
    else:
        result = {"store": str(args.store), "store_tokens": total, "dataset": args.dataset,
                  "prompts": len(refs), "tokens": tokens, "dtype": str(target.dtype),
                  "threads": 1, "ar_ms_per_token": 1e3 * step_seconds,
                  "verify_cost_curve": curve, "scaling": scaling(store, refs, sizes, ctx)}
    if args.ablations or only:
        starts = None
        if store.manifest.corpus[0]["path"].endswith(".jsonl"):  # prompt/response pairs
            starts = store.response_starts(target.tokenizer)
        found = ablations(store, refs, args.ablation_size or total, starts, ctx, only)
        result["ablations"] = {**result.get("ablations", {}), **found}
    RESULTS.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"written {RESULTS / args.name}.json")


if __name__ == "__main__":
    main()
