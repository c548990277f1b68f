"""Which draft shape pays on this CPU: accepted lengths replayed from a recorded bench run,
priced with the measured verify-cost curve.

    python benchmarks/studies/draft_shapes.py --outputs RUN/outputs.jsonl --datastore STORE \\
        [--limit N]

The loop is replayed on AR's own tokens (`dresd.bench.replay`; a bench run's outputs.jsonl
holds them). Each step is priced at cost(1 + tree nodes) one-token decode steps, from
`results/engine.json` (linear between the measured tree sizes; the step's drafting time, under
1% in the recorded runs, is left out), and

    estimated speedup = generated tokens / sum over steps of cost(1 + tree nodes)

against AR's one token per cost-1 step. The recorded bench runs give the measured speedups of
the default shapes, to read these estimates against.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from dresd.bench.replay import Reference, drafter_proposer, reference, replay
from dresd.datasets import load_prompts
from dresd.drafters import make_drafter
from dresd.models.target import load_target
from dresd.prompts import encode_prompt

RESULTS = Path(__file__).parents[1] / "results"

# (label, method, options): the defaults, then node budgets that the verify-cost curve favours.
SHAPES = [
    ("pld (1 draft)", "pld", {}),
    ("pld (3 drafts)", "pld", dict(num_drafts=3)),
    ("rest (64 nodes)", "rest", {}),
    *[(f"rest ({n} nodes)", "rest", dict(max_tree_nodes=n)) for n in (16, 8, 4, 3, 2, 1)],
    ("dresd (10 x 10, paper)", "dresd", {}),
    ("dresd (1 x 10, nearest)", "dresd", dict(num_drafts=1)),
    *[(f"dresd ({n} nodes)", "dresd", dict(max_tree_nodes=n)) for n in (16, 8, 4, 3, 2, 1)],
]


def step_cost(curve: dict[int, float], tree_tokens: int) -> float:
    """Verify cost of a tree of `tree_tokens` tokens in one-token steps (linear in between)."""
    sizes = sorted(curve)
    return float(np.interp(tree_tokens, sizes, [curve[s] for s in sizes]))


def recorded_references(target, ar_rows: list[dict]) -> list[Reference]:
    """The replay references of a bench run's AR rows (outputs.jsonl)."""
    prompts, refs = {}, []
    for row in ar_rows:
        if row["dataset"] not in prompts:
            prompts[row["dataset"]] = load_prompts(row["dataset"])
        text = prompts[row["dataset"]][row["prompt_index"]].text
        refs.append(reference(target, encode_prompt(target.tokenizer, text), row["token_ids"]))
    return refs


def recorded_outputs(path: Path) -> list[dict]:
    """The rows of a bench run's outputs.jsonl (one per method and prompt). The runs under
    benchmarks/results keep their reports but not these: a run writes them, they are not
    committed. Missing, say where they come from rather than fail on a bare path."""
    if not path.is_file():
        raise SystemExit(f"{path} not found: a bench run's per-prompt outputs are written when "
                         "it runs and are not committed. Run the script that makes that folder "
                         "(benchmarks/README.md names it, e.g. benchmarks/hybrid.sh for "
                         "results/hybrid/) or pass your own `dresd bench --out` folder's.")
    return [json.loads(line) for line in path.read_text().splitlines()]


def recorded_run(run: Path, limit: int | None = None
                 ) -> tuple[dict, dict[int, float], list[dict], list[Reference]]:
    """A bench --out folder: its report, its verify-cost curve, its first `limit` AR rows and
    their replay references (the run's model loaded in the run's dtype)."""
    report = json.loads((run / "report.json").read_text())
    meta = report["meta"]
    curve = {int(n): c for n, c in meta["verify_cost_curve"].items()}
    ar_rows = [r for r in recorded_outputs(run / "outputs.jsonl") if r["method"] == "ar"][:limit]
    target = load_target(meta["model"], dtype=meta["dtype"])
    return report, curve, ar_rows, recorded_references(target, ar_rows)


def print_table(lines: list[str], folder: Path, name: str | None) -> None:
    """Print a markdown table's lines; with a `name`, also write them to folder/NAME.md."""
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if name:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{name}.md").write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--outputs", type=Path, required=True, help="a bench run's outputs.jsonl")
    parser.add_argument("--datastore", required=True, help="the store that run used")
    parser.add_argument("--limit", type=int, default=None, help="first N prompts of the run")
    parser.add_argument("--threads", type=int, default=1, help="verify-cost curve to price with")
    parser.add_argument("--name", required=True, help="results/draft_shapes/NAME.json")
    args = parser.parse_args()
    torch.set_num_threads(1)

    curve = {int(n): c for n, c in json.loads((RESULTS / "engine.json").read_text())[
        "by_threads"][str(args.threads)]["verify_cost"].items()}
    ar_rows = [r for r in recorded_outputs(args.outputs) if r["method"] == "ar"][: args.limit]
    target = load_target("default")
    drafters = {label: make_drafter(method, datastore=args.datastore, **options)
                for label, method, options in SHAPES}
    started = time.perf_counter()
    refs = recorded_references(target, ar_rows)
    steps = {label: replay(refs, drafter_proposer(drafter, refs))[0]
             for label, drafter in drafters.items()}
    tokens = sum(len(r["token_ids"]) for r in ar_rows)

    table = {}
    for label, records in steps.items():
        nodes = np.array([n for n, _ in records])
        accepted = np.array([a for _, a in records])
        cost = sum(step_cost(curve, 1 + n) for n in nodes) + 1  # + the prefill's token
        table[label] = {
            "mean_accepted_length": float((accepted + 1).mean()),
            "drafted_tokens_per_step": float(nodes.mean()),
            "acceptance_rate": float(accepted.sum() / max(nodes.sum(), 1)),
            "mean_step_cost": float(cost / (len(records) + 1)),
            "estimated_speedup": tokens / cost,
        }
    result = {"outputs": str(args.outputs), "datastore": args.datastore, "prompts": len(ar_rows),
              "tokens": tokens, "threads_of_curve": args.threads,
              "seconds": round(time.perf_counter() - started, 1), "shapes": table}
    out = RESULTS / "draft_shapes" / f"{args.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    table_md = markdown(args.name, result)
    out.with_suffix(".md").write_text(table_md)
    print(table_md, end="")
    print(f"written {out} and {out.with_suffix('.md').name}")


def markdown(name: str, result: dict) -> str:
    lines = [f"# Draft shapes replayed: {name}", "",
             f"AR outputs: `{result['outputs']}` (first {result['prompts']} prompts, "
             f"{result['tokens']} tokens); store `{Path(result['datastore']).name}`; priced with "
             f"the {result['threads_of_curve']}-thread verify-cost curve of `engine.json`.", "",
             "| shape | mean accepted length | drafted/step | acceptance rate | step cost | "
             "est. speedup |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for label, t in result["shapes"].items():
        lines.append(f"| {label} | {t['mean_accepted_length']:.2f} "
                     f"| {t['drafted_tokens_per_step']:.1f} | {t['acceptance_rate']:.1%} "
                     f"| {t['mean_step_cost']:.2f} | {t['estimated_speedup']:.2f}x |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
