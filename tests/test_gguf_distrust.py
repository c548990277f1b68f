"""Damaged GGUF files (RELIABILITY.md, "Damaged GGUF files"): tiny files mutated one field at a
time (a tensor's shape, type or offset, the header's counts, a string's or an array's length,
the metadata's sizes, the file cut short), each loaded and run: every one must end in one
`GGUFError` naming the file (and the tensor, where a tensor is at fault), never a signal, a
hang, or an error from deep inside a library.

The files are loaded in one child process, case after case, each printing its outcome as a
line of JSON: a mutation that got past the checks into C and crashed there kills the child,
not pytest, and the case it was on fails with the signal."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from gguf import GGUFReader
from gguf_files import Q, write_tiny_gguf

from dresd.host import cache_dir
from dresd.kernels import quant

pytestmark = pytest.mark.skipif(quant.kernel() is None,
                                reason="the quantized kernel needs AVX-512 VNNI")
TESTS = Path(__file__).parent
HUGE = 2**40


@dataclass(frozen=True)
class Mutation:
    """One damage done to a copy of a base file; `blames`: the tensor the error must name."""

    name: str
    base: str  # "llama" or "qwen2"
    apply: Callable[[Path], None] | None  # None: the file as written (it must run)
    blames: str | None = None


def edit(path: Path, change: Callable[[GGUFReader], None]) -> None:
    """Applies `change` to the file's header fields in place (the reader's arrays are views of
    the file, opened for writing)."""
    reader = GGUFReader(path, "r+")
    change(reader)
    reader.data.flush()
    del reader


def tensor_part(name: str, part: int, value: Callable[[int], int], index: int = 0):
    """A mutation of tensor `name`'s header part (2: dimension count, 3: dims, 4: type,
    5: offset), element `index`: its value becomes value(old)."""
    def apply(path: Path) -> None:
        def change(reader: GGUFReader) -> None:
            [tensor] = [t for t in reader.tensors if t.name == name]
            array = tensor.field.parts[part]
            array[index] = value(int(array[index]))
        edit(path, change)
    return apply


def field_part(key: str, part: int, value: Callable[[int], int]):
    """A mutation of metadata `key`'s part (0: key length, 3: a scalar, or a string's length,
    4: an array's length): it becomes value(old)."""
    def apply(path: Path) -> None:
        def change(reader: GGUFReader) -> None:
            array = reader.fields[key].parts[part]
            array[0] = value(int(array[0]))
        edit(path, change)
    return apply


def header_count(at: int, value: Callable[[int], int]):
    """A mutation of the header's tensor count (at 8) or metadata count (at 16)."""
    def apply(path: Path) -> None:
        with open(path, "r+b") as file:
            file.seek(at)
            old = struct.unpack("<Q", file.read(8))[0]
            file.seek(at)
            file.write(struct.pack("<Q", value(old)))
    return apply


def truncate(where: Callable[[Path], int]):
    def apply(path: Path) -> None:
        size = where(path)
        with open(path, "r+b") as file:
            file.truncate(size)
    return apply


def data_offset(path: Path) -> int:
    return GGUFReader(path).data_offset


def key_offset(key: str) -> Callable[[Path], int]:
    """Where metadata `key`'s value starts, plus 4 bytes: a cut inside it."""
    return lambda path: GGUFReader(path).fields[key].offset + 4


def halved(size: int) -> int:
    return size // 2


def doubled(size: int) -> int:
    return size * 2


LAYER = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
MATRICES = ("token_embd.weight", "output.weight", *(f"blk.0.{n}.weight" for n in LAYER))
NORMS = ("output_norm.weight", "blk.0.attn_norm.weight", "blk.0.ffn_norm.weight")
LLAMA = "llama"


def mutations() -> list[Mutation]:
    cases = [Mutation("as written", LLAMA, None), Mutation("qwen2 as written", "qwen2", None)]
    # shapes: each dimension halved (the tensor stays inside its bytes: only the shape check
    # can catch it), the outer one doubled (its data runs into the next tensor's, or past
    # the end for the last)
    for tensor in (*MATRICES, *NORMS):
        dims = 1 if tensor in NORMS else 2
        for dim in range(dims):
            cases.append(Mutation(f"{tensor} dim {dim} halved", LLAMA,
                                  tensor_part(tensor, 3, halved, dim), tensor))
        cases.append(Mutation(f"{tensor} outer dim doubled", LLAMA,
                              tensor_part(tensor, 3, doubled, dims - 1), tensor))
    cases += [Mutation(f"qwen2 {bias} halved", "qwen2", tensor_part(bias, 3, halved), bias)
              for bias in ("blk.0.attn_q.bias", "blk.1.attn_v.bias")]
    # types
    for tensor, qtype in (("blk.0.attn_q.weight", Q.IQ4_NL),  # a type dresd does not run
                          ("blk.0.attn_norm.weight", Q.Q8_0),  # a quantized norm
                          ("blk.0.attn_k.weight", Q.Q8_0),  # larger: runs into attn_v
                          ("token_embd.weight", Q.I32),
                          ("blk.1.ffn_up.weight", Q.F32)):
        cases.append(Mutation(f"{tensor} as {qtype.name}", LLAMA,
                              tensor_part(tensor, 4, lambda _, q=qtype: int(q)), tensor))
    cases += [Mutation("blk.0.ffn_gate.weight type 99", LLAMA,
                       tensor_part("blk.0.ffn_gate.weight", 4, lambda _: 99),
                       "blk.0.ffn_gate.weight"),
              Mutation("qwen2 blk.0.attn_v.bias as Q8_0", "qwen2",
                       tensor_part("blk.0.attn_v.bias", 4, lambda _: int(Q.Q8_0)),
                       "blk.0.attn_v.bias")]
    # offsets and dimension counts
    cases += [
        Mutation("output.weight offset past the end", LLAMA,
                 tensor_part("output.weight", 5, lambda old: old + HUGE), "output.weight"),
        Mutation("blk.0.attn_q.weight offset near 2^64", LLAMA,
                 tensor_part("blk.0.attn_q.weight", 5, lambda _: 2**64 - 32),
                 "blk.0.attn_q.weight"),
        Mutation("blk.0.attn_v.weight offset misaligned", LLAMA,
                 tensor_part("blk.0.attn_v.weight", 5, lambda old: old + 1),
                 "blk.0.attn_v.weight"),
        Mutation("blk.0.ffn_down.weight on ffn_up's bytes", LLAMA,
                 tensor_part("blk.0.ffn_down.weight", 5, lambda old: old - 16 * 256 * 20 // 32 * 8),
                 "blk.0.ffn_down.weight"),
        Mutation("blk.0.attn_q.weight 5 dimensions", LLAMA,
                 tensor_part("blk.0.attn_q.weight", 2, lambda _: 5), "blk.0.attn_q.weight"),
        Mutation("blk.0.attn_q.weight 0 dimensions", LLAMA,
                 tensor_part("blk.0.attn_q.weight", 2, lambda _: 0), "blk.0.attn_q.weight"),
    ]
    # counts and lengths the reader would trust
    cases += [
        Mutation("tensor count 2^40", LLAMA, header_count(8, lambda _: HUGE)),
        Mutation("tensor count + 1", LLAMA, header_count(8, lambda old: old + 1)),
        Mutation("metadata count 2^40", LLAMA, header_count(16, lambda _: HUGE)),
        Mutation("metadata count + 1", LLAMA, header_count(16, lambda old: old + 1)),
        Mutation("metadata count - 1", LLAMA, header_count(16, lambda old: old - 1)),
        Mutation("a key's length 2^62", LLAMA, field_part("general.name", 0, lambda _: 2**62)),
        Mutation("a string's length 2^40", LLAMA,
                 field_part("general.name", 3, lambda _: HUGE)),
        Mutation("the token list's length 2^40", LLAMA,
                 field_part("tokenizer.ggml.tokens", 4, lambda _: HUGE)),
        Mutation("the token list's length + 1", LLAMA,
                 field_part("tokenizer.ggml.tokens", 4, lambda old: old + 1)),
        Mutation("a tensor name's length 2^40", LLAMA,
                 tensor_part("blk.0.attn_k.weight", 0, lambda _: HUGE)),
    ]
    # the metadata's sizes against the tensors'
    cases += [
        Mutation("head count 0", LLAMA, field_part("llama.attention.head_count", 3, lambda _: 0)),
        Mutation("head count 3", LLAMA, field_part("llama.attention.head_count", 3, lambda _: 3)),
        Mutation("kv head count 2", LLAMA,
                 field_part("llama.attention.head_count_kv", 3, lambda _: 2),
                 "blk.0.attn_k.weight"),
        Mutation("hidden size 256", LLAMA,
                 field_part("llama.embedding_length", 3, lambda _: 256), "output_norm.weight"),
        Mutation("intermediate size 512", LLAMA,
                 field_part("llama.feed_forward_length", 3, lambda _: 512),
                 "blk.0.ffn_gate.weight"),
        Mutation("block count 3", LLAMA, field_part("llama.block_count", 3, lambda _: 3),
                 "blk.2.attn_norm.weight"),
        Mutation("block count 2^31", LLAMA, field_part("llama.block_count", 3, lambda _: 2**31)),
    ]
    # cut short
    for name, where in (("empty", lambda path: 0), ("3 bytes", lambda path: 3),
                        ("in the counts", lambda path: 20),
                        ("in the token list", key_offset("tokenizer.ggml.tokens")),
                        ("in the tensor infos", lambda path: data_offset(path) - 40),
                        ("at the data", data_offset),
                        ("one byte short", lambda path: path.stat().st_size - 1)):
        # cut in the data: the first tensor that does not fit is named
        blames = {"at the data": "token_embd.weight", "one byte short": "output.weight"}.get(name)
        cases.append(Mutation(f"cut {name}", LLAMA, truncate(where), blames))
    return cases


CASES = mutations()


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, dict]:
    """Every case's outcome, from one child process that loads and runs them in turn."""
    folder = tmp_path_factory.mktemp("distrust")
    bases = {LLAMA: write_tiny_gguf(folder / "llama.gguf", Q.Q4_1, tied=False,
                                    sentencepiece=True),
             "qwen2": write_tiny_gguf(folder / "qwen2.gguf", Q.Q8_0, arch="qwen2",
                                      sentencepiece=True)}
    paths = []
    for number, case in enumerate(CASES):
        path = folder / f"case{number}.gguf"
        shutil.copyfile(bases[case.base], path)
        if case.apply is not None:
            case.apply(path)
        paths.append(str(path))
    child = subprocess.run(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(TESTS)!r}); "
         "from test_gguf_distrust import load_and_run; load_and_run(sys.argv[1:])", *paths],
        capture_output=True, text=True, timeout=300)
    results = {}
    for line in child.stdout.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            results[CASES[paths.index(record["path"])].name] = record
    if child.returncode != 0:  # the case after the last reported one killed it
        dead = CASES[len(results)].name if len(results) < len(CASES) else None
        if dead is not None:
            results[dead] = {"outcome": f"the child died (exit {child.returncode})",
                             "message": child.stderr[-3000:]}
    return results


def load_and_run(paths: list[str]) -> None:
    """(In the child.) Each file loaded and, where it loads, a few tokens generated; one line of
    JSON per file, flushed before the next one starts."""
    import torch

    from dresd.decoding import speculative_generate
    from dresd.drafters import NoDrafter
    from dresd.models.target import load_target

    for path in paths:
        record = {"path": path}
        try:
            target = load_target(path)
            speculative_generate(target.model, NoDrafter(), torch.tensor([2, 40, 41, 42]),
                                 max_new_tokens=4)
            record.update(outcome="ran")
        except Exception as err:  # what a damaged file ends in: checked by the test
            record.update(outcome="error", type=type(err).__name__, message=str(err))
        print(json.dumps(record), flush=True)


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_a_damaged_file_is_one_clear_error(outcomes, case):
    result = outcomes.get(case.name, {"outcome": "no outcome (the child died before it)"})
    if case.apply is None:
        assert result["outcome"] == "ran", result
        return
    assert result["outcome"] == "error", result
    assert result["type"] == "GGUFError", result
    assert Path(result["path"]).name in result["message"], result  # the file is named
    if case.blames is not None:
        assert repr(case.blames) in result["message"], result


# The kernels' own tests (and the damaged files above), against the kernels built with
# AddressSanitizer and UBSan: an out-of-bounds read or write, or undefined behaviour, in any C
# kernel they reach aborts the child with the sanitizer's report.
SANITIZED_TESTS = ["tests/test_kernel_linear.py", "tests/test_kernel_attention.py",
                   "tests/test_kernel_decoder.py", "tests/test_gguf_distrust.py",
                   "tests/test_gguf.py", "tests/test_datastore_distrust.py",
                   "tests/test_gguf_qwen3moe.py"]
SANITIZED_SELECTION = ("damaged_file or (not gguf_distrust and not test_gguf) "
                       "or unpacked_blocks or packing_in_c "
                       "or header_states or rows_beside or fused_projections "
                       "or experts_rows_as_alone or c_decoder_is_the_layer_loop")


def test_the_kernels_tests_pass_under_address_and_undefined_behaviour_sanitizers():
    compiler = shutil.which(os.environ.get("CC", "cc"))
    runtime = compiler and subprocess.run([compiler, "-print-file-name=libasan.so"],
                                          capture_output=True, text=True).stdout.strip()
    if not runtime or not Path(runtime).is_absolute():
        pytest.skip("no AddressSanitizer runtime for this compiler")
    env = dict(os.environ,
               # a build of their own (the flags are part of each library's key as well)
               DRESD_KERNEL_DIR=str(cache_dir() / "kernels-sanitized"),
               DRESD_KERNEL_FLAGS="-fsanitize=address,undefined -fno-omit-frame-pointer "
                                  "-fno-sanitize-recover=undefined",
               LD_PRELOAD=runtime,  # the runtime must come before everything Python loads
               # Python and torch leak and mismatch allocators by design: the kernels are
               # what is checked here
               ASAN_OPTIONS="detect_leaks=0:alloc_dealloc_mismatch=0:detect_odr_violation=0",
               UBSAN_OPTIONS="print_stacktrace=1")
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k",
         SANITIZED_SELECTION, *SANITIZED_TESTS], cwd=TESTS.parent, env=env,
        capture_output=True, text=True, timeout=600)
    output = child.stdout + child.stderr
    assert "Sanitizer" not in output and "runtime error" not in output, output[-6000:]
    assert child.returncode == 0, output[-6000:]
    assert " passed" in output and "skipped" not in output.splitlines()[-1], output[-2000:]
    # with -s: how many ran under the sanitizers
    print(next(line for line in reversed(output.splitlines()) if " passed" in line))


def test_long_arrays_are_checked_at_once_and_read_when_asked(tmp_path):
    """A vocabulary's arrays (tokens, types, merges) are walked and checked as the header is
    read, but kept as `LongArray`s, read into Python values only when asked for: the same
    values as the `gguf` package's reader; a token that is not UTF-8 is still refused at once."""
    from dresd.models.gguf_file import (
        GGUFError,
        LongArray,
        forget_vocabulary,
        open_gguf,
        token_indices,
    )

    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    reader, theirs = open_gguf(path), GGUFReader(path)
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges"):
        assert isinstance(reader.fields[key].value, LongArray)
        assert reader.fields[key].contents() == theirs.fields[key].contents()
    assert reader.fields["tokenizer.ggml.bos_token_id"].contents() == \
        theirs.fields["tokenizer.ggml.bos_token_id"].contents()
    tokens = theirs.fields["tokenizer.ggml.tokens"].contents()
    wanted = [tokens[7], tokens[-1], tokens[1000], "no such token", tokens[7]]
    assert token_indices(reader, wanted) == {text: tokens.index(text) for text in wanted
                                             if text in tokens}
    forget_vocabulary(reader)
    assert "tokenizer.ggml.tokens" not in reader.fields
    assert "tokenizer.ggml.bos_token_id" in reader.fields
    data = bytearray(path.read_bytes())
    token = struct.pack("<Q", 3) + b"the"  # a token of the vocabulary, as the header holds it
    at = data.index(token, 0, theirs.data_offset) + 8
    data[at] = 0xFF
    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match="not UTF-8"):
        open_gguf(damaged)
