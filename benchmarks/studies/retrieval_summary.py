"""The scaling curve and the ablations of `retrieval_study.py`, as tables and one plot.

Reads every `results/retrieval/<name>.json` and writes `results/retrieval/README.md` and
`results/retrieval/scaling.png` (mean accepted length against store size, log scale, DReSD and
REST at their defaults and at equal tree budgets). Two ratios, since "accepted length" is
read both ways (same store, prompts and steps):

    DReSD / REST         = DReSD's mean accepted length / REST's  (tokens per verify, bonus in)
    drafted DReSD / REST = (DReSD's mean accepted length - 1) / (REST's - 1)
                           (accepted draft tokens per verify, bonus out)

    .venv/bin/python benchmarks/studies/retrieval_summary.py
"""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).parents[1] / "results" / "retrieval"
DRESD_DEFAULT = "dresd (distance, 10 drafts, k=50, len=10)"
REST_DEFAULT = "rest (64 nodes)"
PAIRS = [("defaults (DReSD 10x10, REST 64 nodes)", DRESD_DEFAULT, REST_DEFAULT),
         *[(f"{n} nodes each", f"dresd (agreement, {n} nodes, k=50, len=10)", f"rest ({n} nodes)")
           for n in (4, 16, 64)]]


def fmt_size(tokens: int) -> str:
    return f"{tokens / 1e6:.2f}M" if tokens >= 1e6 else f"{tokens / 1e3:.0f}k"


IVF_ABLATION = "IVF at recall 0.9"


def ivf_draft_ms(result: dict) -> dict[str, float]:
    """DReSD's draft time per step with the IVF index (the index a store of this size gets),
    by shape, from the ablations; the scaling runs search exactly (slower, ~9 ms at 1M)."""
    variant = result.get("ablations", {}).get(IVF_ABLATION)
    return {m: r["draft_ms_per_step"] for m, r in variant["methods"].items()} if variant else {}


def repriced(method: dict, draft_ms: float, result: dict) -> float:
    """est. speedup with the step's drafting time replaced by `draft_ms`:
    verify time V = tokens t / est - drafting - t, then tokens t / (V + steps draft_ms + t)."""
    t = result["ar_ms_per_token"]
    tokens, steps = result["tokens"], method["steps"]
    verify = tokens * t / method["est_speedup"] - steps * method["draft_ms_per_step"] - t
    return tokens * t / (verify + steps * draft_ms + t)


def scaling_table(name: str, result: dict) -> list[str]:
    lines = [f"### {name}: {result['prompts']} {result['dataset']} prompts, {result['tokens']} "
             f"AR tokens, store `{Path(result['store']).name}`, {result['dtype']}, "
             f"{result['threads']} thread", "",
             "Mean accepted length (tokens per verify, bonus included), DReSD / REST; in "
             "brackets the ratio, and the ratio of accepted draft tokens (bonus out). Est. "
             "speedup over AR: from the verify-cost curve, AR's time per token and the drafting "
             "time (DReSD's with the IVF index, as measured on the whole store in the "
             "ablations, where they ran).", "",
             "| store tokens | entries | " + " | ".join(p[0] for p in PAIRS)
             + " | est. speedup, defaults | est. speedup, 4 nodes |",
             "| ---: | ---: |" + " ---: |" * (len(PAIRS) + 2)]
    ivf, seen = ivf_draft_ms(result), set()
    for row in result["scaling"]:
        if row["documents"] in seen:  # two sizes that round to the same documents
            continue
        seen.add(row["documents"])
        methods = row["methods"]
        cells = []
        for _, dresd, rest in PAIRS:
            d, r = methods[dresd]["mean_accepted_length"], methods[rest]["mean_accepted_length"]
            drafted = (d - 1) / (r - 1) if r > 1 else float("inf")
            cells.append(f"{d:.2f} / {r:.2f} (**{d / r:.2f}x**; {drafted:.2f}x)")
        speeds = []
        for _, dresd, rest in PAIRS[:2]:  # the defaults, and 4 nodes (this CPU's best shape)
            d = methods[dresd]
            d_speed = repriced(d, ivf[dresd], result) if dresd in ivf else d["est_speedup"]
            speeds.append(f"{d_speed:.2f}x / {methods[rest]['est_speedup']:.2f}x")
        speed = " | ".join(speeds)
        lines.append(f"| {fmt_size(row['size_tokens'])} | {row['entries']:,} | "
                     + " | ".join(cells) + f" | {speed} |")
    return lines + [""]


def ablation_table(name: str, result: dict) -> list[str]:
    lines = [f"### Ablations, {name} (store of {fmt_size(result['store_tokens'])} tokens, "
             f"{result['prompts']} prompts)", "",
             "| keys | shape | entries | mean accepted length | acceptance rate | drafted/step "
             "| draft ms/step | est. speedup |", "| --- | --- | ---: | ---: | ---: | ---: | ---: "
             "| ---: |"]
    for keys, variant in result["ablations"].items():
        for method, m in variant["methods"].items():
            lines.append(f"| {keys} | {method} | {variant['entries']:,} | "
                         f"{m['mean_accepted_length']:.3f} | {m['acceptance_rate']:.1%} | "
                         f"{m['drafted_per_step']:.1f} | {m['draft_ms_per_step']:.2f} | "
                         f"{m['est_speedup']:.2f}x |")
    return lines + [""]


def panels(results: dict[str, dict]) -> dict[str, list[dict]]:
    """The scaling rows to plot, one panel per study. A study `NAME-all` (the same prompts on
    a larger store whose first documents are NAME's store, e.g. the whole standard library
    after its first 300 files) continues NAME's curve: its rows follow NAME's smaller sizes."""
    rows = {name: list(result["scaling"]) for name, result in results.items()}
    for name in [n for n in rows if n.endswith("-all") and n[: -len("-all")] in rows]:
        smaller = rows[name[: -len("-all")]]
        largest = max(row["size_tokens"] for row in smaller)
        smaller += [row for row in rows.pop(name) if row["size_tokens"] > largest]
    return rows


def plot(results: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = panels(results)
    fig, axes = plt.subplots(1, len(curves), figsize=(5.5 * len(curves), 4), squeeze=False)
    for ax, (name, rows) in zip(axes[0], curves.items(), strict=True):
        result = results[name]
        sizes = [row["size_tokens"] for row in rows]
        for label, method, style in [("DReSD 10x10 (paper)", DRESD_DEFAULT, "C0-o"),
                                     ("DReSD 16 nodes", PAIRS[2][1], "C0--s"),
                                     ("REST 64 nodes (default)", REST_DEFAULT, "C3-o"),
                                     ("REST 16 nodes", PAIRS[2][2], "C3--s")]:
            ax.plot(sizes, [row["methods"][method]["mean_accepted_length"] for row in rows],
                    style, label=label)
        ax.set_xscale("log")
        ax.set_xlabel("store size (corpus tokens)")
        ax.set_ylabel("mean accepted length")
        ax.set_title(f"{name} ({result['prompts']} prompts)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    results = {p.stem: json.loads(p.read_text()) for p in sorted(RESULTS.glob("*.json"))
               if not p.name.startswith("ar-")}
    lines = ["# DReSD's retrieval: store size and ablations "
             "(benchmarks/studies/retrieval_study.py)", "",
             "Replayed on AR's own outputs (greedy), bf16, 1 thread; see the study's docstring. "
             "Regenerate with `benchmarks/retrieval.sh`.", "", "![scaling](scaling.png)", ""]
    for name, result in results.items():
        lines += scaling_table(name, result)
    for name, result in results.items():
        if "ablations" in result:
            lines += ablation_table(name, result)
    (RESULTS / "README.md").write_text("\n".join(lines))
    plot(results, RESULTS / "scaling.png")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
