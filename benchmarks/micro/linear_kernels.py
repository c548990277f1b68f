"""Linear kernels: oneDNN prepacked (`fastpath.PackedLinear`) against dresd's batch-invariant C
kernel (`cpu_linear.InvariantLinear`), in bf16, on the default model's shapes.

1. Per shape (576->1536 gate/up, 1536->576 down, 576->192 k/v, 576->576 q/o, and the LM head
   576->49152), rows M = 1, 2, 4, 8, 16, 64, 256, threads 1 and 2: microseconds per call and
   the weight bytes streamed per second. Each shape gets enough copies of its weights (~128 MB,
   as the model's 30 layers would) that a sweep over them reads from memory, not from the
   cache; the two kernels alternate sweep by sweep, medians over the repeats.
2. Fusion: q, k, v as one 576->960 call and gate, up as one 576->3072 call, against the
   separate calls (both on the C kernel).
3. A whole decode step of the default model (a one-token step on a 256-token cache, invariant
   attention), threads 1 and 2, variants interleaved step by step: `LlamaForward` on oneDNN;
   on the C kernel with one call per projection; with q/k/v and gate/up fused (what
   `LlamaForward` does on the C kernel); and fused plus one `cpu_attention.attention_batch`
   call per layer (`FusedForward` below). The C-kernel variants' logits must be equal bit for
   bit (fusion and batching change no sum).

Results go to benchmarks/results/linear_kernels.{json,md}; a run of some --parts keeps the
other parts' results from the JSON, and the markdown keeps its hand-written `## Reading`
section.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/micro/linear_kernels.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path
from time import perf_counter

import torch

from dresd.decoding.forward import LlamaForward, Segment, _rotate_half
from dresd.decoding.segments import split_outputs
from dresd.host import cpu_flags, cpu_model
from dresd.kernels import attention as cpu_attention
from dresd.kernels import linear as cpu_linear
from dresd.models.fastpath import (
    INVARIANT_MAX_ROWS,
    PackedLinear,
    prepack_linears,
    use_invariant_attention,
)
from dresd.models.target import load_target

RESULTS = Path(__file__).parents[1] / "results"
SHAPES = {"gate/up 576->1536": (576, 1536), "down 1536->576": (1536, 576),
          "k/v 576->192": (576, 192), "q/o 576->576": (576, 576),
          "lm head 576->49152": (576, 49152)}
ROWS = [1, 2, 4, 8, 16, 64, 256]
THREADS = [1, 2]
SWEEP_BYTES = 128 << 20  # weights per sweep: past any L3 this machine has
MAX_CALL_MACS = 4e8  # fewer copies per sweep where one call is compute-bound


READ_SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
/* Sums 64-byte words of `bytes` bytes with four independent chains: a pure read stream. */
int64_t read_all(const char *data, int64_t bytes) {
    __m512i sum[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                      _mm512_setzero_si512()};
    for (int64_t i = 0; i + 256 <= bytes; i += 256)
        for (int part = 0; part < 4; part++)
            sum[part] = _mm512_add_epi64(sum[part], _mm512_loadu_si512(data + i + 64 * part));
    return _mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_add_epi64(sum[0], sum[1]),
                                                    _mm512_add_epi64(sum[2], sum[3])));
}
"""


def read_stream() -> ctypes.CDLL:
    """One core reading memory as fast as it can: the floor a weight stream is measured
    against (compiled here, into a temporary folder)."""
    folder = Path(tempfile.mkdtemp())
    (folder / "read.c").write_text(READ_SOURCE)
    subprocess.run(["cc", "-O2", "-march=native", "-shared", "-fPIC", "-o",
                    str(folder / "read.so"), str(folder / "read.c")], check=True)
    library = ctypes.CDLL(str(folder / "read.so"))
    library.read_all.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    library.read_all.restype = ctypes.c_int64
    return library


def weight_copies(k: int, n: int, rows: int) -> int:
    by_bytes = max(2, SWEEP_BYTES // (2 * k * n))
    by_time = max(2, int(MAX_CALL_MACS // (rows * k * n) * 8))
    return min(by_bytes, by_time)


def sweep_seconds(modules: list[torch.nn.Module], x: torch.Tensor) -> float:
    """Seconds per call, over one call of each module on the same input."""
    start = perf_counter()
    for module in modules:
        module(x)
    return (perf_counter() - start) / len(modules)


def bench_shapes(repeats: int) -> list[dict]:
    rows_out = []
    generator = torch.Generator().manual_seed(0)
    reader = read_stream()
    stream = torch.zeros(SWEEP_BYTES, dtype=torch.uint8)
    for name, (k, n) in SHAPES.items():
        copies = weight_copies(k, n, 1)
        linears = [torch.nn.Linear(k, n, bias=False).to(torch.bfloat16) for _ in range(copies)]
        onednn = [PackedLinear(linear) for linear in linears]
        ours = [cpu_linear.InvariantLinear.from_module(linear) for linear in linears]
        del linears
        for rows in ROWS:
            used = weight_copies(k, n, rows)
            x = torch.randn(rows, k, generator=generator).to(torch.bfloat16)
            for threads in THREADS:
                torch.set_num_threads(threads)
                times = {"onednn": [], "ours": []}
                for modules in (onednn, ours):
                    sweep_seconds(modules[:used], x)  # warm-up
                reads = []
                for _ in range(repeats):
                    for variant, modules in (("onednn", onednn), ("ours", ours)):
                        times[variant].append(sweep_seconds(modules[:used], x))
                    if rows == 1 and threads == 1:  # the one-core floor, in the same loop
                        start = perf_counter()
                        reader.read_all(stream.data_ptr(), stream.numel())
                        reads.append(stream.numel() / (perf_counter() - start) / 1e9)
                result = {"shape": name, "k": k, "n": n, "rows": rows, "threads": threads,
                          "copies": used}
                if reads:
                    result["read_gbps"] = statistics.median(reads)
                for variant, seconds in times.items():
                    median = statistics.median(seconds)
                    result[f"{variant}_us"] = median * 1e6
                    result[f"{variant}_gbps"] = 2 * k * n / median / 1e9
                rows_out.append(result)
                speedup = result["onednn_us"] / result["ours_us"]
                print(f"{name:20s} M={rows:3d} t={threads}  oneDNN {result['onednn_us']:9.1f} us"
                      f" {result['onednn_gbps']:5.1f} GB/s   ours {result['ours_us']:9.1f} us"
                      f" {result['ours_gbps']:5.1f} GB/s   x{speedup:.2f}"
                      + (f"   (one core reads {result['read_gbps']:.1f} GB/s)"
                         if reads else ""), flush=True)
        del onednn, ours
    return rows_out


def bench_fusion(repeats: int) -> list[dict]:
    """Fused q/k/v and gate/up against the separate calls, on the C kernel, memory-cold."""
    results = []
    generator = torch.Generator().manual_seed(1)
    for name, outs in (("q/k/v 576->576+192+192", (576, 192, 192)),
                       ("gate/up 576->1536+1536", (1536, 1536))):
        copies = max(2, SWEEP_BYTES // (2 * 576 * sum(outs)))
        groups = [[torch.nn.Linear(576, n, bias=False).to(torch.bfloat16) for n in outs]
                  for _ in range(copies)]
        separate = [[cpu_linear.InvariantLinear.from_module(p) for p in g] for g in groups]
        fused = [cpu_linear.fuse(g) for g in groups]
        del groups
        for rows in (1, 2, 4, 16):
            x = torch.randn(rows, 576, generator=generator).to(torch.bfloat16)
            for threads in THREADS:
                torch.set_num_threads(threads)
                times = {"separate": [], "fused": []}
                for _ in range(repeats + 1):
                    start = perf_counter()
                    for group in separate:
                        for module in group:
                            module(x)
                    times["separate"].append((perf_counter() - start) / copies)
                    start = perf_counter()
                    for module in fused:
                        module(x)
                    times["fused"].append((perf_counter() - start) / copies)
                result = {"projections": name, "rows": rows, "threads": threads,
                          **{f"{v}_us": statistics.median(t[1:]) * 1e6 for v, t in times.items()}}
                results.append(result)
                print(f"{name:24s} M={rows:2d} t={threads}  separate {result['separate_us']:7.1f}"
                      f" us  fused {result['fused_us']:7.1f} us", flush=True)
    return results


class FusedForward(LlamaForward):
    """`LlamaForward` with q/k/v and gate/up as one `InvariantLinear` call each and every
    segment's attention in one `attention_batch` call (segments of up to
    `fastpath.INVARIANT_MAX_ROWS` rows on the C attention kernel; this benchmark's are)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        layers = self.decoder.layers
        self.qkv = [cpu_linear.fuse([layer.self_attn.q_proj, layer.self_attn.k_proj,
                                     layer.self_attn.v_proj]) for layer in layers]
        self.gate_up = [cpu_linear.fuse([layer.mlp.gate_proj, layer.mlp.up_proj])
                        for layer in layers]
        self.widths = [self.heads * self.head_dim, self.kv_heads * self.head_dim,
                       self.kv_heads * self.head_dim]

    @torch.inference_mode()
    def __call__(self, segments: list[Segment]) -> list:
        if any(len(segment) > INVARIANT_MAX_ROWS for segment in segments):
            # invariant_attention hands these (prompt prefills) to SDPA: so does this
            return super().__call__(segments)
        token_ids = [token for segment in segments for token in segment.token_ids]
        positions = [p for segment in segments for p in segment.positions()]
        hidden = self.decoder.embed_tokens(torch.tensor(token_ids))
        cos, sin = self.decoder.rotary_emb(hidden, torch.tensor([positions]))
        cos, sin = cos[0, :, None], sin[0, :, None]
        bounds = [0]
        for segment in segments:
            bounds.append(bounds[-1] + len(segment))
            segment.sequence.reserve(segment.start + len(segment))
        masks = [self._mask(segment) for segment in segments]
        rows = hidden.shape[0]
        for index, layer in enumerate(self.decoder.layers):
            attn, mlp = layer.self_attn, layer.mlp
            normed = layer.input_layernorm(hidden)
            query, key, value = self.qkv[index](normed).split(self.widths, dim=-1)
            query = query.view(rows, self.heads, self.head_dim)
            key = key.view(rows, self.kv_heads, self.head_dim)
            value = value.view(rows, self.kv_heads, self.head_dim)
            query = query * cos + _rotate_half(query) * sin
            key = key * cos + _rotate_half(key) * sin
            keys, values = [], []
            for segment, first, last in zip(segments, bounds[:-1], bounds[1:], strict=True):
                segment.sequence.write(index, segment.start, key[first:last], value[first:last])
                k, v = segment.sequence.view(index, segment.start + len(segment))
                keys.append(k)
                values.append(v)
            mixed = cpu_attention.attention_batch(query, bounds, keys, values, masks,
                                                  attn.scaling)
            hidden = hidden + attn.o_proj(mixed.view(rows, -1))
            gate, up = self.gate_up[index](layer.post_attention_layernorm(hidden)).chunk(2, -1)
            hidden = hidden + mlp.down_proj(mlp.act_fn(gate) * up)
        hidden = self.decoder.norm(hidden)
        for segment in segments:
            segment.sequence.length = segment.start + len(segment)
        return split_outputs(self.model, segments, bounds, hidden)


VARIANTS = {"onednn": "oneDNN", "ours": "C kernel", "ours_fused": "C kernel, fused",
            "ours_batched": "C kernel, fused, batched attention"}


def bench_decode_step(steps: int, context: int) -> list[dict]:
    """One-token steps of the default model with oneDNN and with the C kernel, interleaved."""
    base = load_target("default", prepack=False).model
    engines = {}
    for variant in VARIANTS:
        model = copy.deepcopy(base)
        if variant == "onednn":
            prepack_linears(model)
        else:
            cpu_linear.invariant_linears(model)
        use_invariant_attention(model)
        forward = FusedForward(model) if variant == "ours_batched" else LlamaForward(model)
        if variant == "ours" and hasattr(forward, "fused"):
            forward.fused = [None] * len(forward.fused)  # one call per projection
        sequence = forward.new_sequence()
        prompt = [(7 * i) % 1000 + 10 for i in range(context)]
        forward([Segment(sequence, prompt, 0, logits_rows="last")])
        engines[variant] = (forward, sequence)
    del base
    results = []
    for threads in THREADS:
        torch.set_num_threads(threads)
        times = {variant: [] for variant in engines}
        last_logits = {}
        for step in range(steps + 2):
            for variant, (forward, sequence) in engines.items():
                start = perf_counter()
                out = forward([Segment(sequence, [42 + step], context)])
                elapsed = perf_counter() - start
                forward.keep(sequence, context, [])
                last_logits[variant] = out[0].logits
                if step >= 2:
                    times[variant].append(elapsed)
        gap = (last_logits["onednn"].float() - last_logits["ours"].float()).abs().max().item()
        result = {"threads": threads, "context": context, "steps": steps,
                  **{f"{v}_ms": statistics.median(t) * 1e3 for v, t in times.items()},
                  "max_logit_difference": gap,
                  "c_kernel_variants_equal": all(
                      torch.equal(last_logits["ours"], last_logits[v])
                      for v in ("ours_fused", "ours_batched"))}
        results.append(result)
        print(f"decode step t={threads}: " + ", ".join(
            f"{label} {result[f'{v}_ms']:.2f} ms" for v, label in VARIANTS.items())
            + f"; logits oneDNN vs C kernel differ by <= {gap:.3f}; C-kernel variants bit for"
            f" bit equal: {result['c_kernel_variants_equal']}", flush=True)
    return results


READING = "## Reading"


def fmt_load(load: list[float]) -> str:
    return ", ".join(f"{value:.1f}" for value in load)


def write_markdown(report: dict, path: Path) -> None:
    lines = [
        "# Linear kernels: oneDNN prepacked vs dresd's batch-invariant C kernel (bf16)",
        "",
        f"CPU: {report['cpu']}; flags: {', '.join(report['flags'])}; torch "
        f"{report['torch']}. Generated by `benchmarks/micro/linear_kernels.py` "
        f"(median of {report['repeats']} interleaved repeats; weights read from memory: each "
        "shape cycles over ~128 MB of copies). GB/s: weight bytes / time per call. Load "
        "average (1, 5, 15 min) before and after each part: " + "; ".join(
            f"{part} {fmt_load(load)}" for part, load in report.get("load_averages", {}).items())
        + f", on {os.cpu_count()} CPUs: other processes share the cores, so absolute times "
        "are inflated and 2-thread runs can stall on a descheduled thread; the ratios come "
        "from interleaved runs.",
        "",
        "## Per shape",
        "",
        "One core's plain read stream, measured in the same loop as each shape's M = 1, "
        "1-thread runs (a C loop summing 128 MB): " + ", ".join(
            f"{r['read_gbps']:.1f}" for r in report["shapes"] if "read_gbps" in r) + " GB/s.",
        "",
        "| shape | M | threads | oneDNN us | oneDNN GB/s | ours us | ours GB/s | speedup |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in report["shapes"]:
        lines.append(f"| {r['shape']} | {r['rows']} | {r['threads']} | {r['onednn_us']:.1f} | "
                     f"{r['onednn_gbps']:.1f} | {r['ours_us']:.1f} | {r['ours_gbps']:.1f} | "
                     f"{r['onednn_us'] / r['ours_us']:.2f} |")
    lines += ["", "## Fused projections (C kernel; per layer)", "",
              "| projections | M | threads | separate us | fused us |",
              "| --- | ---: | ---: | ---: | ---: |"]
    for r in report["fusion"]:
        lines.append(f"| {r['projections']} | {r['rows']} | {r['threads']} | "
                     f"{r['separate_us']:.1f} | {r['fused_us']:.1f} |")
    lines += ["", "## Decode step of the default model (one token, "
              f"{report['decode'][0]['context']}-token cache, invariant attention)", "",
              "| threads | " + " | ".join(f"{label} ms" for label in VARIANTS.values())
              + " | max logit difference oneDNN vs C kernel | C-kernel variants bit for bit"
              " equal |",
              "| ---: | " + "---: | " * len(VARIANTS) + "---: | --- |"]
    for r in report["decode"]:
        times = " | ".join(f"{r[f'{v}_ms']:.2f} (x{r['onednn_ms'] / r[f'{v}_ms']:.2f})"
                           if v != "onednn" else f"{r['onednn_ms']:.2f}" for v in VARIANTS)
        lines.append(f"| {r['threads']} | {times} | {r['max_logit_difference']:.3f} | "
                     f"{r['c_kernel_variants_equal']} |")
    if path.exists() and READING in path.read_text():  # the hand-written reading stays
        lines += ["", READING + path.read_text().split(READING, 1)[1].rstrip("\n")]
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=40, help="decode steps per kernel")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--parts", default="shapes,fusion,decode",
                        help="which of shapes, fusion, decode to run")
    parser.add_argument("--out", default="linear_kernels", help="results file stem")
    args = parser.parse_args()
    parts = args.parts.split(",")
    if cpu_linear.kernel() is None:
        raise SystemExit("the C linear kernel is not available here (avx512_bf16, compiler)")
    torch.set_grad_enabled(False)
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx512", "amx", "avx2", "fma")))
    saved = RESULTS / f"{args.out}.json"
    report = json.loads(saved.read_text()) if saved.exists() else {}
    report.update({"cpu": cpu_model(), "flags": flags, "torch": torch.__version__,
                   "repeats": args.repeats})
    report.pop("load_average_before", None), report.pop("load_average_after", None)
    loads = report.setdefault("load_averages", {})  # part -> before and after, 1/5/15 min
    benches = {"shapes": lambda: bench_shapes(args.repeats),
               "fusion": lambda: bench_fusion(args.repeats),
               "decode": lambda: bench_decode_step(args.steps, args.context)}
    for part in parts:
        before = os.getloadavg()
        report[part] = benches[part]()
        loads[part] = [*before, *os.getloadavg()]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(report, indent=1) + "\n")
    write_markdown(report, RESULTS / f"{args.out}.md")


if __name__ == "__main__":
    main()
