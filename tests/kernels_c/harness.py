"""dresd's C kernels on aarch64 (the `neon` and `neoni8mm` tiers), run under qemu-aarch64.

`driver.c` compiles the kernels (experts.c with the decoder.c, quant.c, linear.c and attention.c
it holds, drafting.c and recurrent.c) into a static binary for each
aarch64 tier with `aarch64-linux-gnu-gcc`; this module writes the inputs (numpy, torch), runs
every job under `qemu-aarch64` in one process, and checks the outputs three ways:

1. References, the same ones and the same tolerances as the x86 tests':
   - quantized linears (every GGUF layout): the sum quant.c's header states, in float64, from
     the `gguf` package's dequantized weights; max error <= 1e-5 of the largest |value|
     (tests/test_gguf.py: the float32 steps' own error, far below it);
   - the bf16 linear: x W^T + b in float64, within one bf16 rounding, |error| <= 2^-8 |value|
     + 1e-5 (tests/test_kernel_linear.py);
   - attention: softmax(q k^T scale + mask) v in float64, atol = rtol = 8e-3 (bf16's output
     rounding; tests/test_kernel_attention.py);
   - DReSD's key (drafting.c) against W h + b in float64, unit length, |error| < 1e-5;
   - the whole decoder (decoder.c) has no float64 reference here: its bits are compared with
     the avx2 tier's (3. below), whose decoder tests/test_kernel_decoder.py checks against
     the PyTorch forward; the suffix tree and prompt lookup likewise (integer search, checked
     on x86 against the Python drafters).
2. Batch and thread invariance on the tier itself, bit for bit: every row of a call of 2..29
   rows at 1, 2 or 3 threads equals the same row computed alone; an attention row of a tree
   batch equals the row alone over only the keys it sees; the decoder's output and cache
   are the same at 1 and 3 threads.
3. Across tiers, bit for bit, where this machine runs x86's avx2 tier: the same jobs through
   an x86 build of the driver (-mavx2 -mfma -mf16c). Exactness across tiers is not promised in
   general (docs/exactness.md: avx512bf16's vdpbf16ps sums differently, as llama.cpp's tiers
   differ), but here it is expected: NEON's fused multiply-add, float16 and int32 conversions
   and round-to-nearest-even are the IEEE operations AVX2's are, applied per output in the
   order the kernels' headers fix, and the integer dots (sdot / usdot / vpmaddubsw) are exact.
   So a difference here is a bug in the port, not a tolerance.

Run it as a script (`python tests/kernels_c/harness.py`, or `make test-neon`), or through
tests/test_neon_qemu.py, which skips where the cross tools are absent.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
KERNELS = ROOT / "src" / "dresd" / "kernels"
sys.path.insert(0, str(HERE.parent))  # tests/: gguf_files
sys.path.insert(0, str(ROOT / "src"))

from dresd import kernels  # noqa: E402
from dresd.kernels import linear as cpu_linear  # noqa: E402
from dresd.kernels import quant  # noqa: E402

CROSS_CC = "aarch64-linux-gnu-gcc"
QEMUS = ("qemu-aarch64", "qemu-aarch64-static")
COMMON = ("-O3", "-std=gnu11", "-fopenmp", "-ffp-contract=fast", f"-I{KERNELS}")
X86_AVX2 = next(t for t in kernels.TIERS if t.name == "avx2")
ARM_TIERS = [t for t in kernels.TIERS if t.arch == "aarch64"]


def missing_tools() -> str | None:
    """Why the harness cannot run here (None: it can)."""
    if shutil.which(CROSS_CC) is None:
        return f"{CROSS_CC} is absent (apt-get install gcc-aarch64-linux-gnu " \
               "libc6-dev-arm64-cross, or `make test-neon`)"
    if not any(shutil.which(q) for q in QEMUS):
        return "qemu-aarch64 is absent (apt-get install qemu-user, or `make test-neon`)"
    return None


def qemu() -> str:
    return next(shutil.which(q) for q in QEMUS if shutil.which(q))


def build(compiler: str, flags: tuple[str, ...], out: Path, static: bool) -> Path:
    command = [compiler, str(HERE / "driver.c"), *COMMON, *flags, "-o", str(out), "-lm"]
    if static:  # qemu-user then needs no aarch64 libraries at run time
        command.insert(1, "-static")
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}:\n{done.stderr[-4000:]}")
    return out


def bf16_bits(tensor: torch.Tensor) -> np.ndarray:
    return tensor.contiguous().view(torch.int16).numpy()


def from_bf16(raw: bytes) -> np.ndarray:
    bits = np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16
    return bits.view(np.float32).astype(np.float64)


@dataclass
class Suite:
    """Jobs for the driver and the checks on their outputs (run after every job ran)."""

    folder: Path
    lines: list[str] = field(default_factory=list)
    checks: list[tuple[str, object]] = field(default_factory=list)  # (name, check(outputs))
    files: int = 0

    def array(self, data: np.ndarray | torch.Tensor) -> str:
        if isinstance(data, torch.Tensor):
            data = bf16_bits(data) if data.dtype == torch.bfloat16 else data.numpy()
        self.files += 1
        path = self.folder / f"in{self.files}.bin"
        np.ascontiguousarray(data).tofile(path)
        return str(path)

    def job(self, *parts: object) -> str:
        """A job line whose last field is its output file; returns that file's name."""
        self.files += 1
        name = f"out{self.files}.bin"
        self.lines.append(" ".join(str(p) for p in (*parts, "{dir}/" + name)))
        return name

    def check(self, name: str, function) -> None:
        self.checks.append((name, function))


# --- the cases ---------------------------------------------------------------------------

def raw_tensor(qtype, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    import gguf
    from gguf_files import random_blocks
    if qtype in quant.K_QUANTS:  # gguf has no quantizer for these
        return random_blocks(qtype, n, k, rng)
    return gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05, qtype)


def quantized_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [m, k] float32 -> (xq, dx per block), as quant.c's header says (tests/test_gguf.py)."""
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = np.abs(blocks).max(axis=2, keepdims=True)
    inverse = np.where(amax > 0, np.float32(127) / np.maximum(amax, 1e-30), 0).astype(np.float32)
    xq = np.rint((blocks * inverse).astype(np.float32))
    return xq.reshape(x.shape), (amax / np.float32(127))[..., 0]


def quant_cases(suite: Suite) -> None:
    rng = np.random.default_rng(5)
    rows, counts, threads = 13, (2, 3, 4, 5, 8, 13), (1, 2, 3)
    for qtype, layout in quant.LAYOUTS.items():
        n, k = 50, 256  # 50 outputs: a group of 32 and a part-filled one
        raw = raw_tensor(qtype, n, k, rng)
        expected_packing = quant.pack(qtype, raw, n, k).numpy()
        expected_bytes = expected_packing.tobytes()
        packed = suite.array(expected_packing)
        # 0. packing in C (what loading runs) gives numpy's bytes, at 1 and 2 threads
        for t in (1, 2):
            packing = suite.job("pack", layout.number, n, k, t, suite.array(raw))

            def packed_as_numpy(out, packing=packing, expected=expected_bytes):
                assert out[packing] == expected
            suite.check(f"quant {qtype.name}: packed in C at {t} threads = numpy", packed_as_numpy)
        x = torch.from_numpy(rng.standard_normal((rows, k))).to(torch.bfloat16)
        bias = torch.from_numpy(rng.standard_normal(n)).float()
        x_file, bias_file = suite.array(x), suite.array(bias)
        # 1. the header's sum in float64 (float32 out, no bias)
        whole = suite.job("quant", layout.number, rows, k, n, 0, 1, x_file, packed, "-")
        xq, dx = quantized_rows(x.float().numpy())
        weight = quant.dequantize(qtype, raw, n, k).astype(np.float64)
        per_block = np.einsum("mbj,nbj->mnb", xq.reshape(rows, -1, 32),
                              weight.reshape(n, -1, 32))
        expected = (per_block * dx[:, None, :]).sum(axis=2)

        def against_sum(out, whole=whole, expected=expected, n=n):
            got = np.frombuffer(out[whole], dtype=np.float32).reshape(-1, n).astype(np.float64)
            error = np.abs(got - expected).max()
            assert error <= 1e-5 * np.abs(expected).max(), error
        suite.check(f"quant {qtype.name}: the header's sum (float64)", against_sum)
        # 2. rows alone, then in calls of `count` rows at `t` threads (bf16 out with a bias)
        alone = [suite.job("quant", layout.number, 1, k, n, 1, 1,
                           suite.array(x[m:m + 1]), packed, bias_file) for m in range(rows)]
        for count in counts:
            for t in threads:
                batch = suite.job("quant", layout.number, count, k, n, 1, t,
                                  suite.array(x[:count]), packed, bias_file)

                def invariant(out, batch=batch, count=count, alone=alone):
                    assert out[batch] == b"".join(out[a] for a in alone[:count])
                suite.check(f"quant {qtype.name}: {count} rows at {t} threads = alone",
                            invariant)


def linear_cases(suite: Suite) -> None:
    generator = torch.Generator().manual_seed(11)
    for k, n in [(64, 70), (37, 70), (576, 192)]:  # an odd K, N off the 32-output panels
        weight = (torch.randn(n, k, generator=generator) * k**-0.5).to(torch.bfloat16)
        bias = torch.randn(n, generator=generator).to(torch.bfloat16).float()
        packed = suite.array(cpu_linear.pack(weight))
        pairs = (k + 1) // 2
        padded_bias = torch.zeros(-(-n // cpu_linear.PANEL) * cpu_linear.PANEL)
        padded_bias[:n] = bias
        bias_file = suite.array(padded_bias)
        rows = 29
        x = torch.randn(rows, k, generator=generator).to(torch.bfloat16)
        x_even = torch.zeros(rows, 2 * pairs, dtype=torch.bfloat16)
        x_even[:, :k] = x
        whole = suite.job("linear", rows, pairs, n, 1, suite.array(x_even), packed, bias_file)
        expected = (x.double() @ weight.double().T + bias.double()).numpy()

        def against_linear(out, whole=whole, expected=expected, n=n):
            got = from_bf16(out[whole]).reshape(-1, n)
            error = np.abs(got - expected)
            assert (error <= np.abs(expected) * 2**-8 + 1e-5).all(), error.max()
        suite.check(f"linear {k}x{n}: x W^T + b within one bf16 rounding (float64)",
                    against_linear)
        alone = [suite.job("linear", 1, pairs, n, 1, suite.array(x_even[m:m + 1]), packed,
                           bias_file) for m in range(rows)]
        for count in (2, 3, 14, 15, 17, 29):
            for t in (1, 3):
                batch = suite.job("linear", count, pairs, n, t, suite.array(x_even[:count]),
                                  packed, bias_file)

                def invariant(out, batch=batch, count=count, alone=alone):
                    assert out[batch] == b"".join(out[a] for a in alone[:count])
                suite.check(f"linear {k}x{n}: {count} rows at {t} threads = alone", invariant)


BF16_MIN = torch.finfo(torch.bfloat16).min


def attention_cases(suite: Suite) -> None:
    generator = torch.Generator().manual_seed(13)
    for heads, kv_heads, dim in [(9, 3, 64), (4, 4, 128)]:
        groups = heads // kv_heads
        for rows, length in [(1, 1), (1, 130), (5, 64), (17, 200), (40, 41)]:
            query = torch.randn(heads, rows, dim, generator=generator).to(torch.bfloat16)
            key, value = (torch.randn(kv_heads, length, dim, generator=generator)
                          .to(torch.bfloat16) for _ in range(2))
            visible = torch.ones(rows, length, dtype=torch.bool)
            visible[:, length - rows:] = torch.rand(rows, rows, generator=generator) < 0.5
            visible[:, length - rows:] |= torch.eye(rows, dtype=torch.bool)
            causal = torch.ones(rows, length, dtype=torch.bool).tril(length - rows)
            mask = torch.zeros(rows, length + 3, dtype=torch.bfloat16)  # 3 columns before
            mask[:, 3:].masked_fill_(~visible, BF16_MIN)
            files = [suite.array(t) for t in (query, key, value)]
            scale = dim**-0.5
            keys, values = (t.double().repeat_interleave(groups, dim=0) for t in (key, value))
            scores = query.double() @ keys.transpose(-1, -2) * scale
            for mask_file, stride, seen in [(suite.array(mask), length + 3, visible),
                                            ("-", 0, causal)]:
                out = suite.job("attention", heads, kv_heads, rows, length, dim,
                                repr(float(np.float32(scale))), *files, mask_file, stride)
                expected = (scores.masked_fill(~seen, -torch.inf).softmax(-1) @ values)
                expected = expected.transpose(0, 1).numpy()  # rows x heads x dim

                def against(out_files, out=out, expected=expected):
                    got = from_bf16(out_files[out]).reshape(expected.shape)
                    assert np.allclose(got, expected, atol=8e-3, rtol=8e-3), \
                        np.abs(got - expected).max()
                name = "tree mask" if stride else "causal"
                suite.check(f"attention {heads}/{kv_heads} heads, dim {dim}, {rows} rows x "
                            f"{length} keys, {name}: softmax(q k^T s + m) v (float64)", against)
            if rows < 5 or heads != 9:
                continue
            # each row of the tree batch = the row alone over only the keys it sees
            batch = suite.job("attention", heads, kv_heads, rows, length, dim, "0.125", *files,
                              suite.array(mask), length + 3)
            alone = []
            for row in range(rows):
                seen = visible[row]
                alone.append(suite.job(
                    "attention", heads, kv_heads, 1, int(seen.sum()), dim, "0.125",
                    suite.array(query[:, row:row + 1]), suite.array(key[:, seen]),
                    suite.array(value[:, seen]), "-", 0))

            def invariant(out, batch=batch, alone=alone):
                assert out[batch] == b"".join(out[a] for a in alone)
            suite.check(f"attention {rows} rows x {length} keys: each row of a tree batch = "
                        "the row alone on the keys it sees", invariant)


def bf16_near(generator: torch.Generator, *shape: int, mean: float = 0.0,
              std: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=generator) * std + mean).to(torch.bfloat16)


def packed_weight(suite: Suite, qtype, n: int, k: int, generator: torch.Generator,
                  rng: np.random.Generator) -> str:
    """A random n x k weight's file as the kernels read it: bf16 packed for linear.c (qtype
    None), else quant.c's layout of random `qtype` blocks."""
    if qtype is None:
        return suite.array(cpu_linear.pack(bf16_near(generator, n, k, std=k ** -0.5)))
    return suite.array(quant.pack(qtype, raw_tensor(qtype, n, k, rng), n, k).numpy())


def rotary_table(positions: range, head_dim: int, base: float) -> tuple[torch.Tensor, ...]:
    """cos and sin, rows x head_dim bf16, as transformers' Llama rotary embedding makes them."""
    inverse = base ** -(torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.tensor(list(positions), dtype=torch.float64)[:, None] * inverse[None]
    angles = torch.cat([angles, angles], dim=1)
    return angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)


def decoder_cases(suite: Suite) -> None:
    """The whole C decoder (decoder.c) on a two-layer model: Llama's layers in bf16 (causal),
    Gemma's (norms plus one, GELU-tanh, q/k norms, sandwich norms, a sliding-window layer with
    its own rotary table, a tree mask), and Llama's on quantized blocks (Q4_0, Q4_K, Q6_K):
    its output rows and the cache it writes, the same bits at 1 and 3 threads. Against the
    x86 avx2 tier's bits (run()), whose decoder tests/test_kernel_decoder.py checks against
    the PyTorch forward."""
    generator = torch.Generator().manual_seed(17)
    rng = np.random.default_rng(17)
    layers, hidden, heads, kv_heads, head_dim, inter = 2, 256, 4, 2, 64, 512
    rows, start = 5, 6
    width = (heads + 2 * kv_heads) * head_dim
    shapes = [(width, hidden), (hidden, heads * head_dim), (2 * inter, hidden), (hidden, inter)]

    cos, sin = (suite.array(t) for t in rotary_table(range(start, start + rows), head_dim,
                                                     10000.0))
    local_cos, local_sin = (suite.array(t) for t in rotary_table(range(start, start + rows),
                                                                 head_dim, 10.0))
    visible = torch.ones(rows, start + rows, dtype=torch.bool).tril(start)
    visible[:, start:] |= (torch.rand(rows, rows, generator=generator) < 0.5).tril()
    mask = torch.zeros(rows, start + rows, dtype=torch.bfloat16).masked_fill(~visible, BF16_MIN)
    cases = [("Llama bf16, causal", None, 0, "-", -1), ("Gemma bf16, window, tree", None, 1,
                                                         suite.array(mask), start - 3)]
    cases += [(f"Llama {q.name}, tree", q, 0, suite.array(mask), -1)
              for q in (quant.Q.Q4_0, quant.Q.Q4_K, quant.Q.Q6_K)]
    for name, qtype, gemma, mask_file, window_start in cases:
        # the rows, then the cache's START keys and values per layer and kv head
        state = suite.array(torch.cat([
            bf16_near(generator, rows * hidden),
            bf16_near(generator, 2 * layers * kv_heads * start * head_dim)]))
        per_layer = []
        for layer in range(layers):
            norms = [suite.array(bf16_near(generator, hidden, mean=0.0 if gemma else 1.0,
                                           std=0.1)) for _ in range(2)]
            extra = ([suite.array(bf16_near(generator, head_dim, std=0.1)) for _ in range(2)]
                     + [suite.array(bf16_near(generator, hidden, std=0.1)) for _ in range(2)]
                     if gemma else ["-"] * 4)
            weights = [packed_weight(suite, qtype, n, k, generator, rng) for n, k in shapes]
            per_layer += [*norms, *weights, *extra, int(layer == 0 and gemma)]
        windows = [local_cos, local_sin] if window_start >= 0 else ["-", "-"]
        layout = -1 if qtype is None else quant.LAYOUTS[qtype].number
        final_norm = suite.array(bf16_near(generator, hidden, mean=0.0 if gemma else 1.0,
                                           std=0.1))
        outputs = [suite.job("decoder", layers, hidden, heads, kv_heads, head_dim, inter, gemma,
                             layout, rows, start, threads, final_norm, state, cos, sin, *windows,
                             window_start, mask_file, *per_layer) for threads in (1, 3)]

        def same_bits(out, outputs=outputs, size=(rows * hidden + 2 * layers * kv_heads
                                                  * (start + rows) * head_dim) * 2):
            first, other = (out[o] for o in outputs)
            assert len(first) == size and first == other
            assert np.isfinite(from_bf16(first)).all()
        suite.check(f"decoder, {name}: 1 and 3 threads the same bits", same_bits)


def drafting_cases(suite: Suite) -> None:
    """drafting.c's kernels: the suffix drafter's tree over a repetitive context (tree and
    chain), prompt lookup, and DReSD's key (bf16 and float32 hidden rows, against float64)."""
    rng = np.random.default_rng(19)
    motif = rng.integers(0, 50, size=12)
    context = np.concatenate([motif, rng.integers(0, 50, size=30), motif, motif[:5],
                              rng.integers(0, 9, size=200), motif[:7]]).astype(np.int64)
    context_file = suite.array(context)
    for single_path in (0, 1):
        tree = suite.job("suffix", 64, 1.0, 0.0, 24, 0.05, 16, single_path, context_file)

        def found(out, tree=tree):
            assert np.frombuffer(out[tree][:4], dtype=np.int32)[0] > 0  # a tree to compare
        suite.check(f"suffix tree (single path {single_path}): a tree is found", found)
    lookup = suite.job("lookup", 3, 1, 10, 4, context_file)

    def drafted(out, lookup=lookup):
        assert np.frombuffer(out[lookup][:4], dtype=np.int32)[0] > 0
    suite.check("prompt lookup: drafts are found", drafted)
    d, dim = 576, 64
    weight_t = rng.standard_normal((d, dim)).astype(np.float32) * d ** -0.5
    bias = rng.standard_normal(dim).astype(np.float32)
    row = torch.from_numpy(rng.standard_normal(d)).to(torch.bfloat16)
    for as_bf16, values in ((1, row), (0, row.float())):
        key = suite.job("densekey", d, dim, as_bf16, suite.array(values),
                        suite.array(weight_t), suite.array(bias))
        expected = row.double().numpy() @ weight_t.astype(np.float64) + bias
        expected /= np.linalg.norm(expected)

        def against(out, key=key, expected=expected):
            got = np.frombuffer(out[key], dtype=np.float32).astype(np.float64)
            assert np.abs(got - expected).max() < 1e-5, np.abs(got - expected).max()
        suite.check(f"dense key ({'bf16' if as_bf16 else 'float32'} hidden): W h + b, unit "
                    "length (float64)", against)


def experts_cases(suite: Suite) -> None:
    """experts.c's mixture-of-experts MLP (Qwen3-MoE's: softmax routing, top-k, renormalised
    weights): every row of a call of 13 rows (which route to different experts) bit for bit
    the row alone, at 1 and 3 threads; bf16 and Q4_K experts."""
    generator = torch.Generator().manual_seed(29)
    rng = np.random.default_rng(29)
    experts, used, ffn, d, rows = 8, 2, 256, 256, 13
    router = suite.array((torch.randn(experts, d, generator=generator) * d ** -0.5).float())
    x = bf16_near(generator, rows, d)
    alone_inputs = [suite.array(x[r:r + 1]) for r in range(rows)]
    batch_input = suite.array(x)
    for qtype in (None, quant.Q.Q4_K):
        weights = [packed_weight(suite, qtype, n, k, generator, rng)
                   for _ in range(experts) for n, k in ((2 * ffn, d), (d, ffn))]
        layout = -1 if qtype is None else quant.LAYOUTS[qtype].number
        head = ("moe", experts, used, ffn, 1, layout)
        alone = [suite.job(*head, 1, d, 1, router, row, *weights) for row in alone_inputs]
        batches = [suite.job(*head, rows, d, threads, router, batch_input, *weights)
                   for threads in (1, 3)]

        def invariant(out, alone=alone, batches=batches):
            joined = b"".join(out[a] for a in alone)
            assert all(out[b] == joined for b in batches)
            assert np.isfinite(from_bf16(joined)).all() and from_bf16(joined).any()
        suite.check(f"experts ({'bf16' if qtype is None else qtype.name}): {rows} rows at 1 and "
                    "3 threads = each row alone", invariant)


def recurrent_cases(suite: Suite) -> None:
    """recurrent.c's gated delta rule (Qwen3.5's linear attention) over a draft tree's rows,
    grouped and tiled key heads: against the PyTorch rule it states (float32, as the x86 test
    tests/test_kernel_recurrent.py: within 1e-5), the same bits at 1 and 3 threads."""
    from dresd.kernels.recurrent import _delta_rule_torch

    generator = torch.Generator().manual_seed(23)
    parents = [-1, 0, 1, 1, 3, -1, 5, 2]  # two branches from the kept state, one forking
    rows, heads, key_heads, dk, dv = len(parents), 4, 2, 32, 48
    q, k = (torch.randn(rows, key_heads, dk, generator=generator) for _ in range(2))
    v = torch.randn(rows, heads, dv, generator=generator)
    beta = torch.rand(rows, heads, generator=generator)
    g = -torch.rand(rows, heads, generator=generator)
    state = torch.randn(heads, dk, dv, generator=generator) * 0.1
    files = [suite.array(np.array(parents, dtype=np.int32)),
             *(suite.array(t) for t in (q, k, v, beta, g, state))]
    for tiled in (0, 1):
        out, last = _delta_rule_torch(parents, q, k, v, beta, g, state, bool(tiled), True)
        expected = torch.cat([out.flatten(), last.flatten()]).double().numpy()
        jobs = [suite.job("delta", rows, heads, key_heads, dk, dv, tiled, threads, *files)
                for threads in (1, 3)]

        def against(outputs, jobs=jobs, expected=expected):
            first, other = (np.frombuffer(outputs[j], dtype=np.float32) for j in jobs)
            assert first.tobytes() == other.tobytes()
            error = np.abs(first.astype(np.float64) - expected).max()
            assert error <= 1e-5 * np.abs(expected).max(), error
        suite.check(f"delta rule over a tree ({'tiled' if tiled else 'grouped'} heads): the "
                    "PyTorch rule within 1e-5, 1 and 3 threads the same bits", against)


# --- running -----------------------------------------------------------------------------

def run_jobs(command: list[str], suite: Suite, folder: Path) -> dict[str, bytes]:
    folder.mkdir(parents=True, exist_ok=True)
    jobs = folder / "jobs.txt"
    jobs.write_text("\n".join(line.replace("{dir}", str(folder)) for line in suite.lines)
                    + "\n")
    done = subprocess.run([*command, str(jobs)], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n"
                           f"{done.stderr[-4000:]}")
    return {path.name: path.read_bytes() for path in folder.glob("out*.bin")}


@dataclass
class Report:
    passed: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        lines = [*self.notes, f"{len(self.passed)} checks passed, {len(self.failed)} failed"]
        return "\n".join([*lines, *("FAILED " + f for f in self.failed)])


def run(workdir: Path, tiers: list[str] | None = None) -> Report:
    """Build the driver for each aarch64 tier (all by default), run every job under qemu and
    check them; returns what passed and failed."""
    reason = missing_tools()
    if reason:
        raise RuntimeError(reason)
    report = Report()
    inputs = workdir / "inputs"
    inputs.mkdir(parents=True, exist_ok=True)
    suite = Suite(inputs)
    quant_cases(suite)
    linear_cases(suite)
    attention_cases(suite)
    decoder_cases(suite)
    drafting_cases(suite)
    experts_cases(suite)
    recurrent_cases(suite)
    report.notes.append(f"{len(suite.lines)} kernel calls a tier, {len(suite.checks)} checks")

    x86 = None  # the avx2 tier's outputs: the bits every aarch64 tier should give
    if X86_AVX2.needs <= kernels.machine_flags() and shutil.which("cc"):
        binary = build("cc", X86_AVX2.flags, workdir / "driver-avx2", static=False)
        x86 = run_jobs([str(binary)], suite, workdir / "avx2")
    else:
        report.notes.append("no x86 avx2 here: the bits across tiers are not compared")

    for tier in [t for t in ARM_TIERS if tiers is None or t.name in tiers]:
        binary = build(CROSS_CC, tier.flags, workdir / f"driver-{tier.name}", static=True)
        outputs = run_jobs([qemu(), "-cpu", "max", str(binary)], suite, workdir / tier.name)
        for name, check in suite.checks:
            try:
                check(outputs)
                report.passed.append(f"{tier.name}: {name}")
            except AssertionError as error:
                report.failed.append(f"{tier.name}: {name}: {error}")
        if x86 is not None:
            differ = sorted(name for name in x86 if x86[name] != outputs.get(name))
            label = f"{tier.name}: all {len(x86)} outputs bit for bit the avx2 tier's"
            (report.failed if differ else report.passed).append(
                label + (f": {len(differ)} differ ({', '.join(differ[:8])})" if differ else ""))
    return report


def main() -> int:
    import tempfile
    with tempfile.TemporaryDirectory() as folder:
        report = run(Path(folder), sys.argv[1:] or None)
    print(report.summary())
    return 1 if report.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
