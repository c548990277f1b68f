"""A GGUF file as a target: the model llama.cpp and Ollama users already have, run as it is.

    --model FILE.gguf -> the file's metadata (architecture, sizes) -> a transformers config
                      -> its tokenizer (transformers reads it from the file: chat template,
                         special tokens)
                      -> a transformers model built on the meta device (no weights allocated),
                         whose modules then take the file's tensors:
                           linears: `kernels.quant.QuantLinear`, the blocks packed once, never
                                    dequantized (float tensors: `kernels.linear.InvariantLinear`)
                           token embedding: rows dequantized when looked up
                           norms: the file's float32 values as bf16 parameters

For `llama`, `qwen2` and `qwen3` the forward is dresd's own (`decoding/forward.LlamaForward` on
the C decoder; Qwen3's per-head q/k norms included), with the file's rope scaling as llama.cpp
reads it (`file_rope_parameters`; Llama 3.x's `rope_freqs` tensor: `divide_rope_frequencies`);
a `gemma3` file (Gemma-3's text model: sliding-window layers, tied embedding) is built as
transformers' `Gemma3ForCausalLM` and runs on the same C decoder in its Gemma form
(`kernels/decoder.LayerForm`: Gemma's norms, GELU-tanh, the windowed layers with their own
rope), or on transformers' forward (`forward.HFForward`) where the C decoder does not build.
Either way every method runs on
the file's own weights with the same batch-invariance as a bf16 model: the reference for a GGUF
model is its own plain decoding on the same file.

llama.cpp's converter permutes the rows of a Llama-architecture file's q and k projections (its
rotary embedding pairs neighbouring dimensions, transformers' pairs the two halves of a head);
`unpermute_rows` undoes that, whole rows at a time, so the blocks stay as they are. A Gemma-3
file has no such permutation (llama.cpp ropes it NEOX-style, as transformers does); its norms
are stored plus one (`gemma3_config` and `_fill_gemma3` say what else differs).

A `qwen3moe` file runs as a `qwen3` one, each layer's MLP its experts: `_Tensors.experts` reads
the router and the 3-D expert tensors into a `kernels/experts.MoEMLP`, run in C.

A `qwen35` file (Qwen3.5's text model: Gated DeltaNet layers beside gated full attention) is
built as transformers' `Qwen3_5ForCausalLM` and runs on `decoding/recurrent.py`, its draft
trees verified over the recurrent states node by node (the Qwen3.5 section below says how the
file is read back); a `qwen35moe` file as `Qwen3_5MoeForCausalLM`, each layer's MLP its routed
experts in C plus the gated shared expert (`SharedExpertMoE`).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import mmap
import struct
import tempfile
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import Any, NamedTuple

import gguf
import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma3TextConfig,
    PreTrainedModel,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
)
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from dresd.decoding.recurrent import TILED_VALUE_HEADS
from dresd.errors import DresdError
from dresd.host import cache_dir
from dresd.kernels import quant
from dresd.kernels.experts import MoEMLP
from dresd.kernels.experts import kernel as experts_kernel
from dresd.kernels.linear import InvariantLinear, dense_weight
from dresd.kernels.linear import kernel as linear_kernel

Q = GGMLQuantizationType
C_DECODER_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe")  # `LlamaForward`'s layers
HEAD_NORM_ARCHITECTURES = ("gemma3", "qwen3", "qwen3moe")  # a norm per head on q and k
MOE_ARCHITECTURES = ("qwen3moe",)  # each layer's MLP a mixture of experts (kernels/experts.py)
# gemma3: its own config and layers; qwen35: its own too (`qwen35_config`), and its own forward
QWEN35_ARCHITECTURES = ("qwen35", "qwen35moe")  # decoding/recurrent.py's (the Qwen3.5 section)
# whose experts run on kernels/experts.c (qwen35moe: beside its shared expert)
EXPERT_KERNEL_ARCHITECTURES = (*MOE_ARCHITECTURES, "qwen35moe")
ARCHITECTURES = (*C_DECODER_ARCHITECTURES, "gemma3", *QWEN35_ARCHITECTURES)
C_DECODER_RUNS = (*C_DECODER_ARCHITECTURES, "gemma3")  # gemma3 in the C decoder's Gemma form
FLOAT_TYPES = {Q.F32: np.float32, Q.F16: np.float16}
SUPPORTED_TYPES = set(quant.LAYOUTS) | set(FLOAT_TYPES) | {Q.BF16}


class GGUFError(DresdError):
    """A GGUF file that dresd cannot run; the message names the file and what is wrong."""


class QuantEmbedding(torch.nn.Module):
    """A token embedding kept in the file's blocks: the rows asked for are dequantized (the
    same values every time), the rest never are. `scale`: a factor on every row (Gemma's
    sqrt(hidden size)), applied in float32 before the rows are rounded to bf16, as llama.cpp
    scales its float32 rows."""

    def __init__(self, qtype: Q, raw: np.ndarray, vocab: int, dim: int,
                 scale: float = 1.0) -> None:
        super().__init__()
        self.qtype, self.raw, self.num_embeddings, self.embedding_dim = qtype, raw, vocab, dim
        self.scale = scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).cpu().numpy()
        rows = quant.dequantize(self.qtype, np.asarray(self.raw[flat]), len(flat),
                                self.embedding_dim)
        if self.scale != 1.0:
            rows = rows * np.float32(self.scale)
        return torch.from_numpy(rows).to(torch.bfloat16).reshape(*ids.shape, -1)


class ScaledEmbedding(torch.nn.Embedding):
    """A float (bf16) token embedding whose rows are multiplied by `scale` in float32 before
    they are rounded to bf16 (Gemma's sqrt(hidden size), as `QuantEmbedding` applies it)."""

    def __init__(self, weight: torch.Tensor, scale: float) -> None:
        super().__init__(*weight.shape, dtype=weight.dtype)
        self.weight.data, self.scale = weight, scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return (super().forward(ids).float() * self.scale).to(self.weight.dtype)


def is_gguf(name: str) -> bool:
    return name.lower().endswith(".gguf")


def _field(reader: GGUFFile, key: str):
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def open_gguf(path: Path) -> GGUFFile:
    """The file, its header read and its tensors memory-mapped, or one clear error for a file
    that is not there, not GGUF, damaged or truncated: every count, length, type, shape and
    offset of the header is checked as it is read (`read_header`). (The `gguf` package's reader
    trusts them, and took 6-10 s on a 128k vocabulary: a numpy view per string.)"""
    if not path.is_file():
        raise GGUFError(f"GGUF file {str(path)!r} does not exist.")
    return read_header(path)


# --- the header, distrusted ---------------------------------------------------------------
# GGUF (ggml/docs/gguf.md): magic, version, tensor count, metadata count; the metadata (key
# string, value type, value); the tensor infos (name, dimension count, dimensions innermost
# first, type, offset from the data section); padding to the alignment; the data section.

MAX_DIMS = 4  # GGML_MAX_DIMS
# each scalar type's struct format (little-endian: "<" + format) and numpy type
_SCALARS = {GGUFValueType.UINT8: ("B", np.uint8), GGUFValueType.INT8: ("b", np.int8),
            GGUFValueType.UINT16: ("H", np.uint16), GGUFValueType.INT16: ("h", np.int16),
            GGUFValueType.UINT32: ("I", np.uint32), GGUFValueType.INT32: ("i", np.int32),
            GGUFValueType.FLOAT32: ("f", np.float32), GGUFValueType.BOOL: ("?", np.bool_),
            GGUFValueType.UINT64: ("Q", np.uint64), GGUFValueType.INT64: ("q", np.int64),
            GGUFValueType.FLOAT64: ("d", np.float64)}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's entry in the header, as the file states it."""

    name: str
    dims: tuple[int, ...]  # innermost first, as GGUF lists them
    qtype: Q
    offset: int  # from the start of the data section
    n_bytes: int


@dataclass(frozen=True)
class Field:
    """One metadata entry's value, as Python values (`contents()`, as the `gguf` package's
    reader gives it: a number, a string, or a list of them)."""

    value: Any

    def contents(self) -> Any:
        return self.value


class GGUFTensor(NamedTuple):
    """One tensor: its header entry and its bytes, mapped (uint8 [rows, bytes per row])."""

    name: str
    tensor_type: Q
    shape: tuple[int, ...]  # innermost first, as GGUF lists them
    n_bytes: int
    data_offset: int  # from the start of the file
    data: np.ndarray


@dataclass
class GGUFFile:
    """A GGUF file's metadata (`fields`), tensors, and the memory map they read (`data`)."""

    fields: dict[str, Field]
    tensors: list[GGUFTensor]
    data: np.memmap
    data_offset: int  # where the data section starts


class _Cursor:
    """Reads the header's little-endian fields, every length checked against the bytes left."""

    def __init__(self, data: memoryview, path: Path) -> None:
        self.data, self.path, self.at = data, path, 0

    def fail(self, what: str) -> GGUFError:
        return GGUFError(f"{self.path} is damaged or truncated: {what} (at byte {self.at} of "
                         f"{len(self.data)}).")

    def take(self, size: int, what: str) -> int:
        """Skips `size` bytes; the offset they started at."""
        if size < 0 or self.at + size > len(self.data):
            raise self.fail(f"{what} needs {size} bytes, the file has {len(self.data) - self.at}"
                            " left")
        start, self.at = self.at, self.at + size
        return start

    def number(self, form: str, what: str) -> int:
        return struct.unpack_from("<" + form, self.data, self.take(struct.calcsize(form), what))[0]

    def string(self, what: str) -> str:
        length = self.number("Q", f"the length of {what}")
        start = self.take(length, what)
        try:
            return bytes(self.data[start:start + length]).decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8") from None

    def value(self, kind: int, key: str, depth: int = 0) -> Any:
        """One metadata value of type `kind`, read: a number, a string, or a list of them."""
        try:
            kind = GGUFValueType(kind)
        except ValueError:
            raise self.fail(f"metadata {key!r} has value type {kind}, which GGUF has not") \
                from None
        if kind in _SCALARS:
            return self.number(_SCALARS[kind][0], f"metadata {key!r}")
        if kind == GGUFValueType.STRING:
            return self.string(f"metadata {key!r}")
        if depth > 2:
            raise self.fail(f"metadata {key!r} nests arrays deeper than GGUF files do")
        item = self.number("I", f"metadata {key!r}'s item type")
        count = self.number("Q", f"metadata {key!r}'s length")
        if item in _SCALARS:  # fixed-size items: one check for all of them
            dtype = np.dtype(_SCALARS[GGUFValueType(item)][1]).newbyteorder("<")
            start = self.take(count * dtype.itemsize, f"metadata {key!r} ({count} items)")
            return np.frombuffer(self.data, dtype, count, start).tolist()  # no view kept
        if count * 8 > len(self.data) - self.at:  # every string or array item takes 8 bytes
            raise self.fail(f"metadata {key!r} claims {count} items")
        if item == GGUFValueType.STRING:  # a vocabulary: 10^5 strings, read in one tight loop
            return self.strings(count, f"metadata {key!r}")
        return [self.value(item, key, depth + 1) for _ in range(count)]

    def strings(self, count: int, what: str) -> list[str]:
        """`count` strings one after another (`string`'s checks, without its calls)."""
        data, size, at, values = self.data, len(self.data), self.at, []
        unpack = struct.Struct("<Q").unpack_from
        try:
            for _ in range(count):
                if at + 8 > size:
                    raise self.fail(f"{what}: a string's length runs past the file's end")
                end = at + 8 + unpack(data, at)[0]
                if end > size:
                    raise self.fail(f"{what}: a string runs past the file's end")
                values.append(str(data[at + 8:end], "utf-8"))
                at = end
        except UnicodeDecodeError:
            raise self.fail(f"{what}: a string is not UTF-8") from None
        finally:
            self.at = at
        return values


def read_header(path: Path) -> GGUFFile:
    """The file's metadata and tensors, after every count, length, type, shape and offset of
    its header has been checked against the file itself: each tensor's data lies inside the
    file's data section, aligned, apart from every other tensor's. One `GGUFError` naming the
    file (and the tensor, where one is at fault) otherwise."""
    try:
        data = np.memmap(path, np.uint8, mode="r")
    except ValueError:  # an empty file cannot be mapped
        data = np.zeros(0, np.uint8)
    fields, infos, start = _walk_header(_Cursor(memoryview(data), path))
    tensors = []
    for info in infos:
        rows = int(np.prod(info.dims[1:], dtype=np.int64))
        offset = start + info.offset
        tensors.append(GGUFTensor(info.name, info.qtype, info.dims, info.n_bytes, offset,
                                  data[offset:offset + info.n_bytes].reshape(rows, -1)))
    return GGUFFile(fields, tensors, data, start)


def _walk_header(cursor: _Cursor) -> tuple[dict[str, Field], list[TensorInfo], int]:
    path = cursor.path
    cursor.take(4, "the magic")
    if bytes(cursor.data[0:4]) != b"GGUF":
        raise GGUFError(f"{path} is not a readable GGUF file (it does not start with 'GGUF').")
    version = cursor.number("I", "the version")
    if version not in (2, 3):
        raise GGUFError(f"{path}: GGUF version {version}; dresd reads versions 2 and 3.")
    tensors = cursor.number("Q", "the tensor count")
    fields = cursor.number("Q", "the metadata count")
    left = len(cursor.data) - cursor.at
    # the smallest metadata entry takes 13 bytes, the smallest tensor info 24
    if fields * 13 > left or tensors * 24 > left:
        raise cursor.fail(f"the header claims {tensors} tensors and {fields} metadata entries")
    alignment = 32  # GGUF's default, unless general.alignment says otherwise
    # the `gguf` package's reader lists these three as fields too (fingerprints include them)
    metadata = {"GGUF.version": Field(version), "GGUF.tensor_count": Field(tensors),
                "GGUF.kv_count": Field(fields)}
    for _ in range(fields):
        key = cursor.string("a metadata key")
        value = cursor.value(cursor.number("I", f"metadata {key!r}'s type"), key)
        metadata[key] = Field(value)
        if key == "general.alignment":
            if type(value) is not int or value < 1 or value & (value - 1):
                raise cursor.fail(f"general.alignment is {value}, not a power of two")
            alignment = value
    infos = []
    for _ in range(tensors):
        name = cursor.string("a tensor name")
        n_dims = cursor.number("I", f"tensor {name!r}'s dimension count")
        if not 1 <= n_dims <= MAX_DIMS:
            raise cursor.fail(f"tensor {name!r} has {n_dims} dimensions (1 to {MAX_DIMS})")
        dims = tuple(cursor.number("Q", f"tensor {name!r}'s shape") for _ in range(n_dims))
        number = cursor.number("I", f"tensor {name!r}'s type")
        offset = cursor.number("Q", f"tensor {name!r}'s offset")
        try:
            qtype = Q(number)
            block, block_bytes = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise GGUFError(f"{path}: tensor {name!r} has type number {number}, which is no "
                            "ggml type.") from None
        if any(size < 1 for size in dims) or dims[0] % block:
            raise GGUFError(f"{path}: tensor {name!r} has shape {list(dims)}, which a "
                            f"{qtype.name} tensor cannot have (dimensions of at least 1, the "
                            f"first a multiple of {block}).")
        elements = int(np.prod(dims, dtype=object))
        infos.append(TensorInfo(name, dims, qtype, offset, elements // block * block_bytes))
    start = -(-cursor.at // alignment) * alignment  # the data section, aligned
    size = len(cursor.data)
    names = set()
    for info in infos:
        if info.name in names:
            raise GGUFError(f"{path}: tensor {info.name!r} is listed twice.")
        names.add(info.name)
        if info.offset % alignment:
            raise GGUFError(f"{path}: tensor {info.name!r}'s data starts at offset {info.offset},"
                            f" not a multiple of the file's alignment {alignment}.")
        if start + info.offset + info.n_bytes > size:
            raise GGUFError(f"{path} is damaged or truncated: tensor {info.name!r} "
                            f"({info.qtype.name} {list(info.dims)}, {info.n_bytes} bytes at "
                            f"offset {info.offset}) ends past the file's {size} bytes.")
    by_offset = sorted(infos, key=lambda info: info.offset)
    for before, after in itertools.pairwise(by_offset):
        if before.offset + before.n_bytes > after.offset:
            raise GGUFError(f"{path} is damaged: tensor {before.name!r}'s data ({before.n_bytes}"
                            f" bytes at offset {before.offset}) runs into tensor "
                            f"{after.name!r}'s (at {after.offset}).")
    return metadata, infos, start


def describe(reader: GGUFFile) -> dict:
    """What `dresd inspect`-style output says about a file: architecture, name, tensor types
    with their counts, parameters and bytes."""
    types: dict[str, int] = {}
    for tensor in reader.tensors:
        types[tensor.tensor_type.name] = types.get(tensor.tensor_type.name, 0) + 1
    architecture = _field(reader, "general.architecture")
    unsupported = sorted({t.tensor_type.name for t in reader.tensors
                          if t.tensor_type not in SUPPORTED_TYPES})
    why_not = ([f"architecture {architecture}"] if architecture not in ARCHITECTURES else []) + (
        [f"types {', '.join(unsupported)}"] if unsupported else [])
    runs = f"no ({'; '.join(why_not)})" if why_not else "yes"
    forward = None
    if not why_not:  # the linears run in the C quantized kernel either way
        forward = ("dresd's C decoder" if architecture in C_DECODER_RUNS else
                   "dresd's per-node recurrent forward (decoding/recurrent.py), its linears in "
                   "dresd's C quantized kernel" if architecture in QWEN35_ARCHITECTURES else
                   "transformers' forward, its linears in dresd's C quantized kernel")
        if architecture in EXPERT_KERNEL_ARCHITECTURES:
            forward += ", each layer's experts in C (kernels/experts.c)"
    return {"architecture": architecture,
            "name": _field(reader, "general.name"),
            "layers": _field(reader, f"{architecture}.block_count"),
            "context_length": _field(reader, f"{architecture}.context_length"),
            "sliding_window": _field(reader, f"{architecture}.attention.sliding_window"),
            "experts": _field(reader, f"{architecture}.expert_count"),
            "experts_used": _field(reader, f"{architecture}.expert_used_count"),
            "tensor_types": types,
            "parameters": int(sum(int(np.prod(t.shape)) for t in reader.tensors)),
            "tensor_bytes": int(sum(t.n_bytes for t in reader.tensors)),
            "dresd_runs_it_natively": runs,
            "forward": forward}


def gguf_fingerprint(reader: GGUFFile) -> str:
    """sha256 of the file's metadata and a few of its tensors' bytes (as `model_fingerprint`
    does for a checkpoint: cheap, and different for any two different files in practice)."""
    digest = hashlib.sha256()
    meta = {key: str(field.contents()) for key, field in reader.fields.items()
            if not key.startswith("tokenizer.ggml.")}
    digest.update(json.dumps(meta, sort_keys=True).encode())
    for tensor in reader.tensors[:2] + reader.tensors[-4:]:
        digest.update(tensor.name.encode() + tensor.tensor_type.name.encode())
        digest.update(np.asarray(tensor.data).reshape(-1).view(np.uint8)[:65536].tobytes())
    return digest.hexdigest()


def unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """The row order that undoes llama.cpp's q/k permutation: its converter stores row
    (h, i, p) of a head (p: which half, i: the pair) at (h, p', i') with the pair index and
    the half swapped; this returns, for each row of transformers' layout, the file's row."""
    head_dim = rows // heads
    index = np.arange(rows).reshape(heads, head_dim // 2, 2)  # the file's rows: (h, i, p)
    return index.transpose(0, 2, 1).reshape(rows)  # transformers' rows: (h, p, i)


class _Tensors:
    """The file's tensors by name, each checked for a type dresd runs."""

    def __init__(self, reader: GGUFFile, path: Path) -> None:
        self.path = path
        self.mapping = getattr(reader.data, "_mmap", None)  # the file, memory-mapped
        self.by_name = {tensor.name: tensor for tensor in reader.tensors}
        for tensor in reader.tensors:
            if tensor.tensor_type not in SUPPORTED_TYPES:
                raise GGUFError(
                    f"{path}: tensor {tensor.name!r} is {tensor.tensor_type.name}, a type dresd "
                    f"does not run (it runs {', '.join(sorted(t.name for t in SUPPORTED_TYPES))}"
                    "). Requantize the file with llama.cpp's llama-quantize, e.g. to Q4_K_M.")

    def __contains__(self, name: str) -> bool:
        return name in self.by_name

    def get(self, name: str):
        if name not in self.by_name:
            raise GGUFError(f"{self.path}: tensor {name!r} is missing.")
        return self.by_name[name]

    def floats(self, name: str) -> torch.Tensor:
        """A small float tensor (a norm, a bias) as float32."""
        tensor = self.get(name)
        return self._dense(tensor, np.asarray(tensor.data)).float().reshape(-1).clone()

    def linear(self, name: str, rows: np.ndarray | None = None, bias: str | None = None,
               out_dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
        """`name` as a linear layer; `rows`: the order to take the output rows in."""
        tensor = self.get(name)
        k, n = (int(size) for size in tensor.shape[:2])  # GGUF lists the inner size first
        raw = np.asarray(tensor.data).reshape(n, -1)
        if rows is not None:
            raw = raw[rows]
        bias_values = self.floats(bias) if bias and bias in self else None
        if bias_values is not None and rows is not None:
            bias_values = bias_values[torch.from_numpy(rows)]
        if tensor.tensor_type in quant.LAYOUTS:
            layer = quant.QuantLinear.from_blocks(tensor.tensor_type, raw, n, k, bias_values,
                                                  out_dtype)
            self.release(tensor)
            return layer
        weight = self._dense(tensor, raw).to(torch.bfloat16)
        if out_dtype == torch.float32:  # an LM head in floats: logits in float32
            layer = torch.nn.Linear(k, n, bias=bias_values is not None, dtype=torch.float32)
            layer.weight.data = weight.float()
            if bias_values is not None:
                layer.bias.data = bias_values
            return _FloatHead(layer)
        return InvariantLinear(weight, bias_values)

    def experts(self, blk: str, used: int, norm: bool) -> MoEMLP:
        """A layer's mixture of experts (`blk`: "blk.N."): the router `ffn_gate_inp` as float32,
        and each expert's slice of `ffn_gate_exps`, `ffn_up_exps` (one module, gate then up)
        and `ffn_down_exps`, packed as any linear (shapes checked before:
        `check_model_tensors`)."""
        router = self.get(blk + "ffn_gate_inp.weight")
        hidden, count = (int(size) for size in router.shape[:2])
        weights = self._dense(router, np.asarray(router.data).reshape(count, -1)).float()
        gate_up, down = [], []
        gates, ups, downs = (self.get(f"{blk}ffn_{name}_exps.weight")
                             for name in ("gate", "up", "down"))
        for expert in range(count):
            parts = [self._expert(tensor, expert) for tensor in (gates, ups)]
            if all(isinstance(part, quant.QuantLinear) for part in parts):
                gate_up.append(quant.fuse(parts))
            elif all(isinstance(part, InvariantLinear) for part in parts):  # one bf16 weight
                gate_up.append(InvariantLinear(torch.cat([dense_weight(part)
                                                          for part in parts])))
            else:  # one part quantized, one in floats: each into its own outputs
                gate_up.append(quant.QuantParts(parts))
            down.append(self._expert(downs, expert))
        for tensor in (gates, ups, downs):
            self.release(tensor)
        return MoEMLP(weights.contiguous(), gate_up, down, used, norm)

    def _expert(self, tensor, expert: int) -> torch.nn.Module:
        """Expert `expert`'s slice of a 3-D expert tensor as a linear layer."""
        k, n, count = (int(size) for size in tensor.shape[:3])
        raw = np.asarray(tensor.data).reshape(count, n, -1)[expert]
        if tensor.tensor_type in quant.LAYOUTS:
            return quant.QuantLinear.from_blocks(tensor.tensor_type, raw, n, k)
        return InvariantLinear(self._dense(tensor, raw).to(torch.bfloat16))

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape, outer size first (as torch lists it; GGUF lists it reversed)."""
        return tuple(int(size) for size in reversed(self.get(name).shape))

    def embedding(self, name: str, scale: float = 1.0) -> torch.nn.Module:
        tensor = self.get(name)
        dim, vocab = (int(size) for size in tensor.shape[:2])
        raw = np.asarray(tensor.data).reshape(vocab, -1)
        if tensor.tensor_type in quant.LAYOUTS:
            return QuantEmbedding(tensor.tensor_type, raw, vocab, dim, scale)
        if scale != 1.0:
            return ScaledEmbedding(self._dense(tensor, raw).to(torch.bfloat16), scale)
        embedding = torch.nn.Embedding(vocab, dim, dtype=torch.bfloat16)
        embedding.weight.data = self._dense(tensor, raw).to(torch.bfloat16)
        return embedding

    def release(self, tensor) -> None:
        """Let the kernel drop the file's pages of a tensor now packed: they were read once, and
        would otherwise stay in this process's resident memory beside the packed copy."""
        if self.mapping is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = tensor.data_offset - tensor.data_offset % mmap.PAGESIZE
        self.mapping.madvise(mmap.MADV_DONTNEED, start, tensor.data_offset + tensor.n_bytes - start)

    @staticmethod
    def _dense(tensor, raw: np.ndarray) -> torch.Tensor:
        """A float tensor (F32, F16, BF16): bf16 bits as they are, the others as float32."""
        if tensor.tensor_type == Q.BF16:
            return torch.from_numpy(raw.view(np.int16).copy()).view(torch.bfloat16)
        return torch.from_numpy(raw.view(FLOAT_TYPES[tensor.tensor_type]).astype(np.float32))


class _FloatHead(torch.nn.Module):
    """An LM head on float weights: bf16 rows in, float32 logits out."""

    def __init__(self, layer: torch.nn.Linear) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x.float())


def _number(reader: GGUFFile, path: Path, key: str, default=None):
    """A scalar metadata value, `default` where the file has none; a clear error where the file
    has an array (a per-layer value dresd does not take) or nothing and there is no default."""
    value = _field(reader, key)
    if value is None:
        if default is None:
            raise GGUFError(f"{path}: metadata {key!r} is missing.")
        return default
    if isinstance(value, list):
        raise GGUFError(f"{path}: metadata {key!r} is per layer ({value[:4]}...); dresd takes "
                        "one value for every layer.")
    return value


def gemma3_config(reader: GGUFFile, path: Path) -> Gemma3TextConfig:
    """A Gemma-3 file's transformers config, read as llama.cpp reads the file
    (`src/models/gemma3.cpp`, `conversion/gemma.py`), not as transformers' GGUF loader does:
    that one takes neither the attention scale, nor the global layers' rope scaling, nor the
    layer pattern from the file, and a file whose head size is not 256 would run wrong.

    - head size: `attention.key_length` (the converter writes head_dim; 256 where absent).
    - attention scale: llama.cpp's rule, 1/sqrt(head size), and 1/sqrt(hidden / heads) for the
      62-layer 27B model (transformers' `query_pre_attn_scalar`: 256 and 168 in Google's
      configs, the same numbers).
    - layers: windowed where `attention.sliding_window` is set, except every 6th
      (`attention.sliding_window_pattern`: a period, or a flag per layer, where the file has
      one); with no window every layer sees the whole context.
    - rope: the global layers' base `rope.freq_base` with the file's linear scaling (Gemma-3
      4B-27B: factor 8); the windowed layers' base `rope.freq_base_swa`, 10000 where absent,
      never scaled (llama.cpp's defaults).
    """
    arch = "gemma3"
    key = f"{arch}.{{}}".format
    layers = int(_number(reader, path, key("block_count")))
    hidden = int(_number(reader, path, key("embedding_length")))
    heads = int(_number(reader, path, key("attention.head_count")))
    head_dim = int(_number(reader, path, key("attention.key_length"), 256))
    value_dim = int(_number(reader, path, key("attention.value_length"), head_dim))
    if value_dim != head_dim:
        raise GGUFError(f"{path}: key length {head_dim} and value length {value_dim} differ; "
                        "a Gemma-3 head has one size.")
    window = int(_number(reader, path, key("attention.sliding_window"), 0))
    pattern = _field(reader, key("attention.sliding_window_pattern"))
    if not window:
        windowed = [False] * layers
    elif isinstance(pattern, list):
        if len(pattern) != layers:
            raise GGUFError(f"{path}: the sliding-window pattern has {len(pattern)} flags for "
                            f"{layers} layers.")
        windowed = [bool(flag) for flag in pattern]
    else:
        period = int(pattern or 6)  # llama.cpp's set_swa_pattern: the last of each period full
        windowed = [period == 0 or i % period < period - 1 for i in range(layers)]
    scaling = str(_field(reader, key("rope.scaling.type")) or "linear")
    factor = float(_field(reader, key("rope.scaling.factor"))
                   or _field(reader, key("rope.scale_linear")) or 1.0)
    full_rope: dict = {"rope_type": "default",
                       "rope_theta": float(_number(reader, path, key("rope.freq_base"), 1e6))}
    if scaling not in ("none", "linear"):
        raise GGUFError(f"{path}: rope scaling {scaling!r} is not one dresd runs for Gemma-3 "
                        "(linear).")
    if scaling == "linear" and factor != 1.0:
        full_rope.update(rope_type="linear", factor=factor)
    local_rope = {"rope_type": "default",
                  "rope_theta": float(_number(reader, path, key("rope.freq_base_swa"), 10000.0))}
    softcap = _field(reader, key("final_logit_softcapping"))
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    # llama.cpp ends generation at <end_of_turn> too (an end-of-generation token by its text);
    # a chat turn of a Gemma instruct model ends with it, not with <eos>
    ends = [eos] if eos is not None else []
    if "<end_of_turn>" in tokens and tokens.index("<end_of_turn>") not in ends:
        ends.append(tokens.index("<end_of_turn>"))
    return Gemma3TextConfig(
        vocab_size=_token_rows(reader, path),
        hidden_size=hidden,
        intermediate_size=int(_number(reader, path, key("feed_forward_length"))),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(_number(reader, path, key("attention.head_count_kv"), heads)),
        head_dim=head_dim,
        query_pre_attn_scalar=hidden // heads if layers == 62 else head_dim,
        sliding_window=window or None,
        layer_types=["sliding_attention" if w else "full_attention" for w in windowed],
        rope_parameters={"full_attention": full_rope, "sliding_attention": local_rope},
        rms_norm_eps=float(_number(reader, path, key("attention.layer_norm_rms_epsilon"), 1e-6)),
        max_position_embeddings=int(_number(reader, path, key("context_length"), 131072)),
        final_logit_softcapping=float(softcap) if softcap else None,
        hidden_activation="gelu_pytorch_tanh",  # llama.cpp's LLM_FFN_GELU: the tanh form
        tie_word_embeddings="output.weight" not in {t.name for t in reader.tensors},
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=ends[0] if len(ends) == 1 else (ends or None),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"))


# --- Qwen3.5 (qwen35) ----------------------------------------------------------------------
# A `qwen35` file as transformers' `Qwen3_5ForCausalLM`, run by decoding/recurrent.py with its
# linears on dresd's quantized C kernel.
#
# What the converter (`conversion/qwen.py`: `Qwen3NextModel`, `_LinearAttentionVReorderBase`)
# changes, and how it is read back:
#
# - norms: every RMSNorm but the Gated DeltaNet's output norm (`ssm_norm`) is stored plus one
#   (the model multiplies by 1 + weight, llama.cpp by the stored value): one is taken off again.
# - `ssm_a` = -exp(A_log): A_log = log(-ssm_a), kept in float32 (the rule reads it as float32).
# - `ssm_dt.bias` is dt_bias; `ssm_conv1d` the depthwise convolution's [channels, kernel].
# - Value heads: where there are more value heads than key heads, the converter reorders the
#   value heads from grouped (value head h reads key head h // r) to tiled (key head h % nk), in
#   every tensor on the value side (`attn_qkv`'s value rows, `attn_gate`, `ssm_beta`,
#   `ssm_alpha`, `ssm_a`, `ssm_dt`, the convolution's value channels and `ssm_out`'s columns).
#   Reordering a quantized tensor's columns back would split its blocks; instead the layers keep
#   the file's tiled order and read their query and key heads tiled too
#   (`TILED_VALUE_HEADS`): the same sums, in llama.cpp's head order.
# - `attn_q` holds each head's query and output gate side by side, as transformers' q_proj.
# - NextN/MTP layers (`nextn_predict_layers`) are counted in `block_count`; they are not read.
# - `qwen35moe` (`Qwen3_5MoeTextModel`, whose experts `Qwen2MoeModel` writes): the router
#   `ffn_gate_inp` and the shared expert's gate `ffn_gate_inp_shexp` in F32, the routed experts
#   as 3-D `ffn_{gate,up,down}_exps`, the shared expert as `ffn_{gate,up,down}_shexp`; the
#   expert counts and sizes in `expert_*` keys, no `feed_forward_length`. The router's top k
#   weights are always renormalised (transformers' `Qwen3_5MoeTopKRouter`).

QWEN35_MOE = "qwen35moe"


def qwen35_config(reader: GGUFFile, path: Path) -> Qwen3_5TextConfig | Qwen3_5MoeTextConfig:
    """The file's transformers config, read as llama.cpp reads a qwen35 file
    (`llama_model::load_hparams`): the layer pattern from `attention.recurrent_layers` (else
    every `full_attention_interval`-th layer full), the rotary dimensions from
    `rope.dimension_count` (a quarter of a head in Qwen3.5), the Gated DeltaNet's sizes from the
    `ssm.*` keys (state size: the key head size; group count: key heads; time step rank: value
    heads; inner size: value heads x value head size); a `qwen35moe` file's experts from its
    `expert_*` keys."""
    architecture = _field(reader, "general.architecture")
    key = f"{architecture}.{{}}".format
    blocks = _size(reader, path, key("block_count"))
    layers = blocks - int(_number(reader, path, key("nextn_predict_layers"), 0))
    heads = _size(reader, path, key("attention.head_count"))
    head_dim = _size(reader, path, key("attention.key_length"))
    value_heads = _size(reader, path, key("ssm.time_step_rank"))
    inner = _size(reader, path, key("ssm.inner_size"))
    if inner % value_heads:
        raise GGUFError(f"{path}: ssm.inner_size {inner} is not a whole number of "
                        f"{value_heads} value heads.")
    key_heads = _size(reader, path, key("ssm.group_count"))
    if value_heads % key_heads:
        raise GGUFError(f"{path}: {key_heads} key heads do not divide {value_heads} value heads.")
    recurrent = _field(reader, key("attention.recurrent_layers"))
    if isinstance(recurrent, list):
        if len(recurrent) < layers:
            raise GGUFError(f"{path}: attention.recurrent_layers has {len(recurrent)} flags "
                            f"for {layers} layers.")
        linear = [bool(flag) for flag in recurrent[:layers]]
    else:
        interval = _size(reader, path, key("full_attention_interval"), 4)
        linear = [(i + 1) % interval != 0 for i in range(layers)]
    rotary = _size(reader, path, key("rope.dimension_count"), head_dim // 4)
    sections = _field(reader, key("rope.dimension_sections")) or [11, 11, 10]
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    if architecture == QWEN35_MOE:
        config_class, mlp = Qwen3_5MoeTextConfig, dict(
            num_experts=_size(reader, path, key("expert_count")),
            num_experts_per_tok=_size(reader, path, key("expert_used_count")),
            moe_intermediate_size=_size(reader, path, key("expert_feed_forward_length")),
            shared_expert_intermediate_size=_size(reader, path,
                                                  key("expert_shared_feed_forward_length")))
        if mlp["num_experts_per_tok"] > mlp["num_experts"]:
            raise GGUFError(f"{path}: {mlp['num_experts_per_tok']} experts used per token of "
                            f"{mlp['num_experts']}.")
    else:
        config_class = Qwen3_5TextConfig
        mlp = dict(intermediate_size=_size(reader, path, key("feed_forward_length")))
    return config_class(
        vocab_size=_token_rows(reader, path),
        hidden_size=_size(reader, path, key("embedding_length")),
        **mlp,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=_size(reader, path, key("attention.head_count_kv"), heads),
        head_dim=head_dim,
        linear_conv_kernel_dim=_size(reader, path, key("ssm.conv_kernel")),
        linear_key_head_dim=_size(reader, path, key("ssm.state_size")),
        linear_num_key_heads=key_heads,
        linear_num_value_heads=value_heads,
        linear_value_head_dim=inner // value_heads,
        layer_types=["linear_attention" if flag else "full_attention" for flag in linear],
        rope_parameters={"rope_type": "default",
                         "rope_theta": float(_number(reader, path, key("rope.freq_base"), 1e7)),
                         "partial_rotary_factor": rotary / head_dim,
                         "mrope_section": [int(s) for s in sections[:3]]},
        rms_norm_eps=float(_number(reader, path, key("attention.layer_norm_rms_epsilon"), 1e-6)),
        max_position_embeddings=int(_number(reader, path, key("context_length"), 32768)),
        tie_word_embeddings="output.weight" not in {t.name for t in reader.tensors},
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=eos,
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"))


def expected_qwen35_tensors(config: Qwen3_5TextConfig | Qwen3_5MoeTextConfig,
                            ) -> dict[str, tuple[tuple[int, ...], set]]:
    """Every tensor a qwen35 (or qwen35moe) file's layers read: shape (outer size first) and
    allowed types."""
    hidden, head_dim = config.hidden_size, config.head_dim
    key_dim = config.linear_num_key_heads * config.linear_key_head_dim
    value_dim = config.linear_num_value_heads * config.linear_value_head_dim
    value_heads, kernel = config.linear_num_value_heads, config.linear_conv_kernel_dim
    q_rows, kv_rows = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    linear = {"attn_qkv.weight": (2 * key_dim + value_dim, hidden),
              "attn_gate.weight": (value_dim, hidden), "ssm_beta.weight": (value_heads, hidden),
              "ssm_alpha.weight": (value_heads, hidden), "ssm_out.weight": (hidden, value_dim)}
    small = {"ssm_a": (value_heads,), "ssm_dt.bias": (value_heads,),
             "ssm_conv1d.weight": (2 * key_dim + value_dim, kernel),
             "ssm_norm.weight": (config.linear_value_head_dim,)}
    full = {"attn_q.weight": (2 * q_rows, hidden), "attn_k.weight": (kv_rows, hidden),
            "attn_v.weight": (kv_rows, hidden), "attn_output.weight": (hidden, q_rows)}
    full_small = {"attn_q_norm.weight": (head_dim,), "attn_k_norm.weight": (head_dim,)}
    if isinstance(config, Qwen3_5MoeTextConfig):
        experts, ffn = config.num_experts, config.moe_intermediate_size
        shared = config.shared_expert_intermediate_size
        mlp = {"ffn_gate_exps.weight": (experts, ffn, hidden),
               "ffn_up_exps.weight": (experts, ffn, hidden),
               "ffn_down_exps.weight": (experts, hidden, ffn),
               "ffn_gate_shexp.weight": (shared, hidden), "ffn_up_shexp.weight": (shared, hidden),
               "ffn_down_shexp.weight": (hidden, shared)}
        mlp_floats = {"ffn_gate_inp.weight": (experts, hidden),
                      "ffn_gate_inp_shexp.weight": (1, hidden)}
    else:
        inter = config.intermediate_size
        mlp = {"ffn_gate.weight": (inter, hidden), "ffn_up.weight": (inter, hidden),
               "ffn_down.weight": (hidden, inter)}
        mlp_floats = {}
    norms = {"attn_norm.weight": (hidden,), "post_attention_norm.weight": (hidden,),
             **mlp_floats}
    expected = {"output_norm.weight": ((hidden,), NORM_TYPES)}
    for i, kind in enumerate(config.layer_types):
        blk = f"blk.{i}."
        weights, floats = (linear, small) if kind == "linear_attention" else (full, full_small)
        expected.update({blk + n: (s, SUPPORTED_TYPES) for n, s in (weights | mlp).items()})
        expected.update({blk + n: (s, NORM_TYPES) for n, s in (floats | norms).items()})
    return expected


def fill_qwen35(model: PreTrainedModel, tensors: _Tensors) -> None:
    """A `Qwen3_5ForCausalLM` (built on the meta device) takes the file's tensors (module doc)."""
    config, decoder = model.config, model.model
    hidden, head_dim = config.hidden_size, config.head_dim
    decoder.embed_tokens = tensors.embedding("token_embd.weight")
    for i, layer in enumerate(decoder.layers):
        blk = f"blk.{i}."
        layer.input_layernorm.weight = _norm(tensors, blk + "attn_norm.weight", hidden, -1.0)
        layer.post_attention_layernorm.weight = _norm(
            tensors, blk + "post_attention_norm.weight", hidden, -1.0)
        if isinstance(config, Qwen3_5MoeTextConfig):
            layer.mlp = shared_expert_moe(layer.mlp.shared_expert, tensors, blk,
                                          config.num_experts_per_tok)
        else:
            fill_gated_mlp(layer.mlp, tensors, blk)
        if config.layer_types[i] == "full_attention":
            attn = layer.self_attn
            attn.q_norm.weight = _norm(tensors, blk + "attn_q_norm.weight", head_dim, -1.0)
            attn.k_norm.weight = _norm(tensors, blk + "attn_k_norm.weight", head_dim, -1.0)
            for part, name in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"),
                               ("o_proj", "attn_output")):
                setattr(attn, part, tensors.linear(f"{blk}{name}.weight"))
            continue
        mixer = layer.linear_attn
        for part, name in (("in_proj_qkv", "attn_qkv"), ("in_proj_z", "attn_gate"),
                           ("in_proj_b", "ssm_beta"), ("in_proj_a", "ssm_alpha"),
                           ("out_proj", "ssm_out")):
            setattr(mixer, part, tensors.linear(f"{blk}{name}.weight"))
        negative_a = tensors.floats(blk + "ssm_a")
        if not bool((negative_a < 0).all()):
            raise GGUFError(f"{tensors.path}: {blk}ssm_a holds values >= 0; it is -exp(A_log).")
        mixer.A_log = _float32(torch.log(-negative_a))
        mixer.dt_bias = _float32(tensors.floats(blk + "ssm_dt.bias"))
        mixer.conv1d.weight = _float32(tensors.floats(blk + "ssm_conv1d.weight").reshape(
            mixer.conv_dim, 1, mixer.conv_kernel_size))
        mixer.norm.weight = _norm(tensors, blk + "ssm_norm.weight", mixer.head_v_dim)
        setattr(mixer, TILED_VALUE_HEADS, mixer.num_v_heads != mixer.num_k_heads)
    decoder.norm.weight = _norm(tensors, "output_norm.weight", hidden, -1.0)


class SharedExpertMoE(torch.nn.Module):
    """Qwen3.5-MoE's sparse MLP on a file's weights, as transformers' `Qwen3_5MoeSparseMoeBlock`
    computes it: the routed experts (`experts`: the C kernel's softmax over the router, the top
    k renormalised, each expert on its quantized blocks) plus the shared expert scaled by
    sigmoid(x . w_gate), every tensor between two steps bf16 as in the model. It has
    `experts`, so decoding/recurrent.py runs it a row at a time: each row's bits its own."""

    def __init__(self, experts: MoEMLP, shared_expert: torch.nn.Module,
                 gate: torch.Tensor) -> None:
        super().__init__()
        self.experts = experts
        self.shared_expert = shared_expert
        self.register_buffer("gate", gate.float().contiguous(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.sigmoid((x.float() * self.gate).sum(-1, keepdim=True)).to(x.dtype)
        return self.experts(x) + scale * self.shared_expert(x)


def fill_gated_mlp(mlp: torch.nn.Module, tensors: _Tensors, blk: str, suffix: str = "") -> None:
    """A gated MLP's gate, up and down projections from the file's `ffn_gate{suffix}`,
    `ffn_up{suffix}`, `ffn_down{suffix}` (a shared expert's: suffix "_shexp")."""
    for part, name in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"),
                       ("down_proj", "ffn_down")):
        setattr(mlp, part, tensors.linear(f"{blk}{name}{suffix}.weight"))


def shared_expert_moe(shared_expert: torch.nn.Module, tensors: _Tensors, blk: str,
                      used: int) -> SharedExpertMoE:
    """A qwen35moe layer's MLP: its routed experts, and the model's own shared expert module
    (`shared_expert`, built on the meta device) given the file's projections."""
    fill_gated_mlp(shared_expert, tensors, blk, "_shexp")
    gate = tensors.floats(blk + "ffn_gate_inp_shexp.weight").reshape(-1)
    return SharedExpertMoE(tensors.experts(blk, used, norm=True), shared_expert, gate)


def _float32(values: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(values.float().contiguous(), requires_grad=False)


# Architectures whose transformers config dresd reads from the metadata itself (cheap, so never
# taken from the cache), not through transformers' GGUF mapping
OWN_CONFIGS = {"gemma3": gemma3_config, "qwen35": qwen35_config, QWEN35_MOE: qwen35_config}


# --- rotary embedding scaling, as llama.cpp reads it ---------------------------------------
# llama.cpp's converter writes rope scaling two ways: `{arch}.rope.scaling.*` metadata (linear,
# YaRN), and for Llama 3.1-3.3's "llama3" scaling a tensor, `rope_freqs.weight`: one factor per
# rotated pair of dimensions, by which llama.cpp divides that pair's frequency
# (ggml_rope_ext's freq_factors). transformers' GGUF loader reads neither for these
# architectures, so without what follows a Llama 3.1 file ran as if unscaled.

ROPE_FREQS = "rope_freqs.weight"


def _yarn_mscale(factor: float, mscale: float) -> float:
    """llama.cpp's and transformers' YaRN magnitude: 1 + 0.1 mscale ln(factor) (1 for factor
    <= 1)."""
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


def file_rope_parameters(reader: GGUFFile, path: Path, architecture: str) -> dict:
    """A Llama-family file's rotary embedding as transformers' `config.rope_parameters`, read
    as llama.cpp reads it (`llama_model::load_hparams`, `llama_context`'s YaRN set-up):

    - base: `rope.freq_base`, 10000 where absent.
    - scaling: `rope.scaling.type` (llama.cpp's default: linear) with `rope.scaling.factor`
      (or the older `rope.scale_linear`); none, or a factor of 1: no scaling.
    - YaRN: the original context `rope.scaling.original_context_length` (default: the
      file's context length), `yarn_beta_fast`/`yarn_beta_slow` (32 and 1), and the magnitude
      llama.cpp gives cos and sin: mscale(factor, 1) / mscale(factor, yarn_log_multiplier)
      times `rope.scaling.attn_factor`, as transformers' `attention_factor`.
    Anything else (LongRoPE, a YaRN extrapolation factor other than 1) is one error.
    `rope_freqs.weight` is not here: `load_gguf` divides the frequencies by it."""
    key = f"{architecture}.rope.{{}}".format
    rope: dict = {"rope_type": "default",
                  "rope_theta": float(_number(reader, path, key("freq_base"), 10000.0))}
    kind = str(_field(reader, key("scaling.type")) or "linear")
    factor = float(_field(reader, key("scaling.factor"))
                   or _field(reader, key("scale_linear")) or 1.0)
    if kind == "none" or factor == 1.0:
        return rope
    if kind == "linear":
        return {**rope, "rope_type": "linear", "factor": factor}
    if kind != "yarn":
        raise GGUFError(f"{path}: rope scaling {kind!r} is not one dresd runs (linear, yarn, "
                        "and Llama 3's rope_freqs).")
    if float(_field(reader, key("scaling.yarn_ext_factor")) or 1.0) != 1.0:
        raise GGUFError(f"{path}: a YaRN extrapolation factor other than 1 is not one dresd "
                        "runs.")
    log_multiplier = float(_field(reader, key("scaling.yarn_log_multiplier")) or 0.0)
    original = _field(reader, key("scaling.original_context_length")) or _number(
        reader, path, f"{architecture}.context_length")
    return {**rope, "rope_type": "yarn", "factor": factor,
            "original_max_position_embeddings": int(original),
            "beta_fast": float(_field(reader, key("scaling.yarn_beta_fast")) or 32.0),
            "beta_slow": float(_field(reader, key("scaling.yarn_beta_slow")) or 1.0),
            "attention_factor": _yarn_mscale(factor, 1.0)
            / _yarn_mscale(factor, log_multiplier)
            * float(_field(reader, key("scaling.attn_factor")) or 1.0)}


def divide_rope_frequencies(rotary: torch.nn.Module, factors: torch.Tensor) -> None:
    """A file's `rope_freqs` applied to transformers' rotary embedding: each pair's frequency
    divided by its factor, as llama.cpp divides it (cos and sin, and so the C decoder's
    values, come from this module: `forward.LlamaForward._inputs`)."""
    if factors.shape != rotary.inv_freq.shape or not bool((factors > 0).all()):
        raise GGUFError(f"rope_freqs: {factors.numel()} factors for "
                        f"{rotary.inv_freq.numel()} frequencies, or factors that are not "
                        "positive.")
    rotary.inv_freq = rotary.inv_freq / factors
    rotary.original_inv_freq = rotary.inv_freq.clone()


def _token_rows(reader: GGUFFile, path: Path) -> int:
    """The vocabulary the model has rows for: the token embedding's (the converter cuts rows
    past the tokenizer's vocabulary, so they need not be the config's original size)."""
    for tensor in reader.tensors:
        if tensor.name == "token_embd.weight":
            return int(tensor.shape[1])
    raise GGUFError(f"{path}: tensor 'token_embd.weight' is missing.")


@dataclass(frozen=True)
class Sizes:
    """The sizes every tensor of a model must agree with (its metadata's, or its config's)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    experts: int = 0  # a mixture of experts: experts per layer, used per token, and each
    experts_used: int = 0  # expert's hidden size (0: a dense MLP)
    expert_ffn: int = 0

    @classmethod
    def of_config(cls, config) -> Sizes:
        experts = int(getattr(config, "num_experts", 0) or 0)
        return cls(config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
                   config.num_key_value_heads,
                   getattr(config, "head_dim", None)
                   or config.hidden_size // config.num_attention_heads,
                   getattr(config, "intermediate_size", None) or 0, experts,
                   int(config.num_experts_per_tok) if experts else 0,
                   int(config.moe_intermediate_size) if experts else 0)


C_INT = 2**31 - 1  # the C kernels take sizes as int


def _size(reader: GGUFFile, path: Path, key: str, default: int | None = None) -> int:
    """A size from the metadata: a whole number from 1 to what a C int holds."""
    value = _number(reader, path, key, default)
    if isinstance(value, (bool, str)) or not float(value).is_integer() \
            or not 1 <= int(value) <= C_INT:
        raise GGUFError(f"{path}: metadata {key!r} is {value!r}, not a size.")
    return int(value)


def model_sizes(reader: GGUFFile, path: Path, architecture: str) -> Sizes:
    """The sizes the file's metadata states, read as llama.cpp reads them (head size: the key
    length, else hidden / heads), and checked to fit together."""
    if architecture in OWN_CONFIGS:
        return Sizes.of_config(OWN_CONFIGS[architecture](reader, path))
    key = f"{architecture}.{{}}".format
    hidden, heads = _size(reader, path, key("embedding_length")), \
        _size(reader, path, key("attention.head_count"))
    if hidden % heads and _field(reader, key("attention.key_length")) is None:
        raise GGUFError(f"{path}: {heads} attention heads do not divide the hidden size "
                        f"{hidden}, and the file states no head size.")
    sizes = Sizes(_size(reader, path, key("block_count")), hidden, heads,
                  _size(reader, path, key("attention.head_count_kv"), heads),
                  _size(reader, path, key("attention.key_length"), hidden // heads),
                  _size(reader, path, key("feed_forward_length")))
    if sizes.heads % sizes.kv_heads:
        raise GGUFError(f"{path}: {sizes.kv_heads} key-value heads do not divide the "
                        f"{sizes.heads} attention heads.")
    if architecture in MOE_ARCHITECTURES:
        experts = _size(reader, path, key("expert_count"))
        used = _size(reader, path, key("expert_used_count"))
        if used > experts:
            raise GGUFError(f"{path}: {used} experts used per token of {experts}.")
        # llama.cpp's default where the file has no expert size: feed_forward_length / used
        ffn = _size(reader, path, key("expert_feed_forward_length"),
                    max(sizes.intermediate // used, 1))
        moe_routing(reader, path, architecture)
        sizes = Sizes(*astuple(sizes)[:6], experts, used, ffn)
    return sizes


def moe_routing(reader: GGUFFile, path: Path, architecture: str) -> bool:
    """Whether a MoE file's chosen experts' weights are renormalised to sum to 1
    (`expert_weights_norm`; llama.cpp's qwen3moe always does, transformers' GGUF reading
    defaults to it); one error for routing dresd does not run: gating other than softmax,
    shared experts, a scale on the weights."""
    key = f"{architecture}.{{}}".format
    gating = _field(reader, key("expert_gating_func"))
    if gating not in (None, int(gguf.ExpertGatingFuncType.SOFTMAX)):
        raise GGUFError(f"{path}: expert gating function {gating}; dresd runs softmax gating "
                        "only.")
    if _field(reader, key("expert_shared_count")) or \
            _field(reader, key("expert_shared_feed_forward_length")):
        raise GGUFError(f"{path}: shared experts are not something dresd runs.")
    scale = _field(reader, key("expert_weights_scale"))
    if scale not in (None, 0.0, 1.0):
        raise GGUFError(f"{path}: expert weights scaled by {scale}; dresd runs unscaled weights "
                        "only.")
    norm = _field(reader, key("expert_weights_norm"))
    return True if norm is None else bool(norm)


NORM_TYPES = {Q.F32, Q.F16, Q.BF16}  # norms and biases are read as floats


def expected_tensors(sizes: Sizes, architecture: str, present: set[str]
                     ) -> dict[str, tuple[tuple[int, ...], set]]:
    """Every tensor the architecture reads (the optional ones where the file has them): its
    shape, outer size first (as torch lists it), and the types it may have. The token
    embedding's rows (the vocabulary) are any number: `check_model_tensors` checks them."""
    hidden, inter, head_dim = sizes.hidden, sizes.intermediate, sizes.head_dim
    q_rows, kv_rows = sizes.heads * head_dim, sizes.kv_heads * head_dim
    norms = ["attn_norm", "ffn_norm"]
    if architecture == "gemma3":
        norms += ["post_attention_norm", "post_ffw_norm"]
    expected: dict[str, tuple[tuple[int, ...], set]] = {"output_norm.weight": ((hidden,),
                                                                               NORM_TYPES)}
    if architecture in MOE_ARCHITECTURES:  # the router, then every expert in one 3-D tensor
        experts, ffn = sizes.experts, sizes.expert_ffn
        mlp = (("ffn_gate_inp", (experts, hidden), NORM_TYPES),
               ("ffn_gate_exps", (experts, ffn, hidden), SUPPORTED_TYPES),
               ("ffn_up_exps", (experts, ffn, hidden), SUPPORTED_TYPES),
               ("ffn_down_exps", (experts, hidden, ffn), SUPPORTED_TYPES))
    else:
        mlp = tuple((name, shape, SUPPORTED_TYPES) for name, shape in (
            ("ffn_gate", (inter, hidden)), ("ffn_up", (inter, hidden)),
            ("ffn_down", (hidden, inter))))
    for i in range(sizes.layers):
        blk = f"blk.{i}."
        expected.update({blk + name + ".weight": ((hidden,), NORM_TYPES) for name in norms})
        expected.update({blk + name + ".weight": (shape, SUPPORTED_TYPES) for name, shape in (
            ("attn_q", (q_rows, hidden)), ("attn_k", (kv_rows, hidden)),
            ("attn_v", (kv_rows, hidden)), ("attn_output", (hidden, q_rows)))})
        expected.update({blk + name + ".weight": (shape, types) for name, shape, types in mlp})
        if architecture in HEAD_NORM_ARCHITECTURES:
            expected.update({blk + f"attn_{part}_norm.weight": ((head_dim,), NORM_TYPES)
                             for part in "qk"})
        for part, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
            if f"{blk}attn_{part}.bias" in present:
                expected[f"{blk}attn_{part}.bias"] = ((rows,), NORM_TYPES)
    if ROPE_FREQS in present:  # a factor per rotated pair of dimensions
        expected[ROPE_FREQS] = ((head_dim // 2,), NORM_TYPES)
    return expected


def check_model_tensors(reader: GGUFFile, path: Path, architecture: str) -> Sizes:
    """The validation pass before anything is built from the file, and before any C call: every
    tensor the architecture reads is present, of a type it may have, of the shape its metadata's
    sizes say. One `GGUFError` naming the tensor, the expected and the found shape otherwise.
    Returns the sizes (`load_gguf` checks transformers' config against them)."""
    sizes = model_sizes(reader, path, architecture)
    by_name = {tensor.name: tensor for tensor in reader.tensors}

    def shape(name: str) -> tuple[int, ...]:
        return tuple(int(size) for size in reversed(by_name[name].shape))

    def check(name: str, wanted: tuple[int, ...], types: set) -> None:
        if name not in by_name:
            raise GGUFError(f"{path}: tensor {name!r} is missing.")
        qtype = by_name[name].tensor_type
        if qtype not in types:
            raise GGUFError(f"{path}: tensor {name!r} is {qtype.name}, which dresd does not "
                            f"take for it (it takes {', '.join(sorted(t.name for t in types))})."
                            + (" Requantize the file with llama.cpp's llama-quantize, e.g. to "
                               "Q4_K_M." if qtype not in SUPPORTED_TYPES else ""))
        if shape(name) != wanted:
            raise GGUFError(f"{path}: tensor {name!r} has shape {shape(name)} where the file's "
                            f"metadata needs {wanted} (outer size first).")

    present = set(by_name)
    expected = (expected_qwen35_tensors(qwen35_config(reader, path))
                if architecture in QWEN35_ARCHITECTURES else
                expected_tensors(sizes, architecture, present))
    for name, (wanted, types) in expected.items():
        check(name, wanted, types)
    embedding = "token_embd.weight"
    vocab = shape(embedding)[0] if embedding in by_name else 0  # any number of rows
    check(embedding, (vocab, sizes.hidden), SUPPORTED_TYPES)
    tokens = _field(reader, "tokenizer.ggml.tokens")
    if tokens is not None and len(tokens) > vocab:
        raise GGUFError(f"{path}: tensor 'token_embd.weight' has {vocab} rows for a tokenizer "
                        f"of {len(tokens)} tokens.")
    if "output.weight" in by_name:
        check("output.weight", (vocab, sizes.hidden), SUPPORTED_TYPES)
    return sizes


def config_and_tokenizer(path: Path, reader: GGUFFile
                         ) -> tuple[AutoConfig, PreTrainedTokenizerBase]:
    """The file's transformers config and tokenizer. transformers reads both from the file's
    metadata, parsing its vocabulary each time (~8 s for a 49k vocabulary); so the first load
    saves them in the cache, keyed by the metadata's bytes (everything before the tensors'
    data: the same for every copy of the file), and later loads read that folder. A Gemma-3
    file's config is dresd's reading (`gemma3_config`, cheap, so never taken from the cache);
    its tokenizer is transformers' (a sentencepiece vocabulary: its Gemma builder, which
    rebuilds the merges from the tokens' order; a byte-level one: as for Llama files)."""
    architecture = _field(reader, "general.architecture")
    own = OWN_CONFIGS[architecture](reader, path) if architecture in OWN_CONFIGS else None
    with open(path, "rb") as file:
        key = hashlib.sha256(file.read(reader.data_offset))
    folder = cache_dir() / "gguf" / key.hexdigest()[:24]
    if (folder / "config.json").exists():
        return (own or AutoConfig.from_pretrained(folder),
                with_chat_template(AutoTokenizer.from_pretrained(folder), reader))
    config = own or AutoConfig.for_model(
        **load_gguf_checkpoint(str(path), return_tensors=False)["config"])
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as err:
        raise GGUFError(f"{path}: its tokenizer could not be read ({err}).") from err
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent) as staging:
        config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        try:
            Path(staging).rename(folder)  # atomic: the cache holds a whole folder or none
        except OSError:
            pass  # another process saved it first
    return config, with_chat_template(tokenizer, reader)


def with_chat_template(tokenizer: PreTrainedTokenizerBase,
                       reader: GGUFFile) -> PreTrainedTokenizerBase:
    """The tokenizer with the file's own chat template (`tokenizer.chat_template`), which
    transformers' GGUF reading leaves out: without it a chat prompt went to the model as raw
    text (the default model's Q4_1 file answered "What is 2 plus 3?" with its end of turn)."""
    template = _field(reader, "tokenizer.chat_template")
    if template and not tokenizer.chat_template:
        tokenizer.chat_template = str(template)
    return tokenizer


def load_gguf(path: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, str, str]:
    """(model, tokenizer, fingerprint, what runs its linears) for a GGUF file."""
    reader = open_gguf(path)
    architecture = _field(reader, "general.architecture")
    if architecture not in ARCHITECTURES:
        raise GGUFError(f"{path}: architecture {architecture!r} is not one dresd runs from a "
                        f"GGUF file yet ({', '.join(ARCHITECTURES)}).")
    if quant.kernel() is None or linear_kernel() is None:
        raise GGUFError(f"{path}: a quantized GGUF model runs on dresd's C kernels, which need "
                        "an x86 CPU with AVX2, FMA and F16C (or AVX-512) and a C compiler; "
                        "this machine has not got them (see `dresd --version`).")
    if architecture in EXPERT_KERNEL_ARCHITECTURES and experts_kernel() is None:
        raise GGUFError(f"{path}: a mixture-of-experts file runs its experts on dresd's C "
                        "kernel (kernels/experts.c), which could not be built here (or "
                        "DRESD_CPU_EXPERTS=0).")
    sizes = check_model_tensors(reader, path, architecture)
    tensors = _Tensors(reader, path)
    config, tokenizer = config_and_tokenizer(path, reader)
    if architecture in C_DECODER_ARCHITECTURES:
        config.rope_parameters = file_rope_parameters(reader, path, architecture)
        if architecture in ("qwen3", "qwen3moe"):  # transformers' qwen3 mapping has no head size
            config.head_dim = sizes.head_dim
        if architecture in MOE_ARCHITECTURES:  # what transformers' GGUF mapping leaves out
            config.num_experts, config.num_experts_per_tok = sizes.experts, sizes.experts_used
            config.moe_intermediate_size = sizes.expert_ffn
            config.norm_topk_prob = moe_routing(reader, path, architecture)
            config.mlp_only_layers, config.decoder_sparse_step = [], 1  # every layer's MLP
        if ROPE_FREQS in tensors and config.rope_parameters["rope_type"] == "yarn":
            raise GGUFError(f"{path}: rope_freqs with YaRN scaling is not one dresd runs.")
    elif ROPE_FREQS in tensors:
        raise GGUFError(f"{path}: a {architecture} file with rope_freqs is not one dresd runs.")
    if Sizes.of_config(config) != sizes:  # the shapes were checked against these sizes
        raise GGUFError(f"{path}: transformers reads the file's sizes as {Sizes.of_config(config)}"
                        f", dresd as {sizes}; dresd cannot run a file read two ways.")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.eval()
    if architecture == "gemma3":
        _fill_gemma3(model, tensors)
    elif architecture in QWEN35_ARCHITECTURES:
        fill_qwen35(model, tensors)
    else:
        _fill_llama(model, tensors, architecture)
    decoder = model.model
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"  # tied
    model.lm_head = tensors.linear(head, out_dtype=torch.float32)
    with torch.device("cpu"):  # its frequencies, computed (they are no weights of the file)
        decoder.rotary_emb = type(decoder.rotary_emb)(config=config)
    if ROPE_FREQS in tensors:  # Llama 3.1-3.3's scaling, as the converter stores it
        divide_rope_frequencies(decoder.rotary_emb, tensors.floats(ROPE_FREQS))
    left = [name for name, value in [*model.named_parameters(), *model.named_buffers()]
            if value is not None and value.is_meta]
    if left:
        raise GGUFError(f"{path}: no tensor in the file for {', '.join(left[:4])}.")
    types = sorted({t.tensor_type.name for t in reader.tensors if t.tensor_type != Q.F32})
    return model, tokenizer, gguf_fingerprint(reader), f"GGUF {'+'.join(types) or 'F32'}"


def _norm(tensors: _Tensors, name: str, size: int, offset: float = 0.0) -> torch.nn.Parameter:
    """A norm's weight (the file's float32 values plus `offset`) as a bf16 parameter."""
    values = tensors.floats(name)
    if values.numel() != size:
        raise GGUFError(f"{tensors.path}: tensor {name!r} has {values.numel()} values where "
                        f"the model's config needs {size}.")
    return torch.nn.Parameter((values + offset).to(torch.bfloat16), requires_grad=False)


def _fill_llama(model: PreTrainedModel, tensors: _Tensors, architecture: str) -> None:
    """A Llama, Qwen2 or Qwen3 model's layers from the file (the C decoder then runs them).
    Only Llama files have their q and k rows permuted (llama.cpp ropes Qwen NEOX-style)."""
    config, decoder = model.config, model.model
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    q_rows = k_rows = None
    if architecture == "llama":  # undo the converter's q/k row permutation
        q_rows = unpermute_rows(heads * head_dim, heads)
        k_rows = unpermute_rows(kv_heads * head_dim, kv_heads)

    def norm(name: str) -> torch.nn.Parameter:
        return torch.nn.Parameter(tensors.floats(name).to(torch.bfloat16), requires_grad=False)

    decoder.embed_tokens = tensors.embedding("token_embd.weight")
    for i, layer in enumerate(decoder.layers):
        blk = f"blk.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        layer.input_layernorm.weight = norm(blk + "attn_norm.weight")
        layer.post_attention_layernorm.weight = norm(blk + "ffn_norm.weight")
        attn.q_proj = tensors.linear(blk + "attn_q.weight", q_rows, blk + "attn_q.bias")
        attn.k_proj = tensors.linear(blk + "attn_k.weight", k_rows, blk + "attn_k.bias")
        attn.v_proj = tensors.linear(blk + "attn_v.weight", None, blk + "attn_v.bias")
        attn.o_proj = tensors.linear(blk + "attn_output.weight")
        if architecture in MOE_ARCHITECTURES:
            layer.mlp = tensors.experts(blk, config.num_experts_per_tok, config.norm_topk_prob)
        else:
            mlp.gate_proj = tensors.linear(blk + "ffn_gate.weight")
            mlp.up_proj = tensors.linear(blk + "ffn_up.weight")
            mlp.down_proj = tensors.linear(blk + "ffn_down.weight")
        if architecture in HEAD_NORM_ARCHITECTURES:  # per-head q and k norms, before the rope
            attn.q_norm.weight = norm(blk + "attn_q_norm.weight")
            attn.k_norm.weight = norm(blk + "attn_k_norm.weight")
    decoder.norm.weight = norm("output_norm.weight")


def _fill_gemma3(model: PreTrainedModel, tensors: _Tensors) -> None:
    """A `Gemma3ForCausalLM`'s layers from the file, as llama.cpp's converter wrote them
    (gguf-py's tensor_mapping: input_layernorm -> attn_norm, pre_feedforward_layernorm ->
    ffn_norm, post_attention_layernorm -> post_attention_norm, post_feedforward_layernorm ->
    post_ffw_norm, q_norm/k_norm -> attn_q_norm/attn_k_norm).

    - Norms: the converter stores Gemma3RMSNorm's weight plus one (`norm_shift`: the model
      multiplies by 1 + weight, llama.cpp by the stored value), so one is taken off again;
      a bf16 checkpoint's weights come back exactly.
    - q and k: rows as they are (no permutation: llama.cpp ropes Gemma NEOX-style).
    - Shapes: checked before, with every other tensor's (`check_model_tensors`).
    - Embedding: scaled by sqrt(hidden size) as Gemma3TextScaledWordEmbedding and llama.cpp
      scale it, in float32 before the rows round to bf16; the LM head is the same tensor
      (tied) unless the file has output.weight.
    """
    config, decoder = model.config, model.model
    hidden, head_dim = config.hidden_size, config.head_dim
    decoder.embed_tokens = tensors.embedding("token_embd.weight", scale=hidden ** 0.5)
    for i, layer in enumerate(decoder.layers):
        blk = f"blk.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        layer.input_layernorm.weight = _norm(tensors, blk + "attn_norm.weight", hidden, -1.0)
        layer.post_attention_layernorm.weight = _norm(
            tensors, blk + "post_attention_norm.weight", hidden, -1.0)
        layer.pre_feedforward_layernorm.weight = _norm(tensors, blk + "ffn_norm.weight",
                                                       hidden, -1.0)
        layer.post_feedforward_layernorm.weight = _norm(tensors, blk + "post_ffw_norm.weight",
                                                        hidden, -1.0)
        attn.q_norm.weight = _norm(tensors, blk + "attn_q_norm.weight", head_dim, -1.0)
        attn.k_norm.weight = _norm(tensors, blk + "attn_k_norm.weight", head_dim, -1.0)
        for part, name in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"),
                           ("o_proj", "attn_output")):
            setattr(attn, part, tensors.linear(f"{blk}{name}.weight"))
        fill_gated_mlp(mlp, tensors, blk)
    decoder.norm.weight = _norm(tensors, "output_norm.weight", hidden, -1.0)
