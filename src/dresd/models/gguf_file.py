"""A GGUF file's header, read and distrusted: its metadata and tensor list, each checked as it
is read, the tensors' data memory-mapped (`open_gguf`). The metadata helpers here read a value
as llama.cpp does (`metadata`, `metadata_number`, `metadata_size`); `describe` is what `dresd
inspect` says of a file. What the tensors become is `models/gguf.py`'s."""

from __future__ import annotations

import hashlib
import itertools
import json
import mmap
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from dresd.errors import DresdError
from dresd.kernels import quant
from dresd.models import spec

Q = GGMLQuantizationType
FLOAT_TYPES = {Q.F32: np.float32, Q.F16: np.float16}
SUPPORTED_TYPES = set(quant.LAYOUTS) | set(FLOAT_TYPES) | {Q.BF16}
# Rope scaling as llama.cpp's converter stores it in tensors: Llama 3.1-3.3's factor per turned
# pair (`rope_freqs`), Phi-3's LongRoPE factors (long, then short: its 128k-context models)
ROPE_FREQS = "rope_freqs.weight"
PHI3_ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")


class GGUFError(DresdError):
    """A GGUF file that dresd cannot run; the message names the file and what is wrong."""


def is_gguf(name: str) -> bool:
    return name.lower().endswith(".gguf")


def metadata(reader: GGUFFile, key: str):
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def forget_vocabulary(reader: GGUFFile) -> None:
    """Drop the header's per-token arrays (`tokenizer.ggml.tokens`, `scores`, `token_type`,
    `merges`): once the tokenizer is built they are read by nothing. Fingerprints leave them out
    already (`gguf_fingerprint`). The header's file pages, read, are let go too (7.6 MB for Llama
    3's vocabulary, resident as long as they stay mapped and touched)."""
    for key in [key for key, field in reader.fields.items()
                if key.startswith("tokenizer.ggml.")
                and isinstance(field.value, list | LongArray)]:
        del reader.fields[key]
    if reader.mapping is not None and reader.data_offset > 0:
        quant.drop_file_pages(reader.mapping, 0, min(reader.data_offset, len(reader.mapping)))


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
class LongArray:
    """A long array of the header (a vocabulary's tokens, scores, merges), checked where it lies
    but read into Python values only when asked for (`read`). Why: 10^5 strings read while the
    header is walked leave their memory's pages half used once dropped, other objects read
    after them in between (13.6 MB resident after Llama 3's 128k tokens and 280k merges were
    dropped and the heap trimmed); read when asked for, used and dropped, they leave none."""

    data: memoryview
    start: int  # the first item's offset in `data`
    count: int
    item: GGUFValueType

    def read(self) -> list:
        cursor = _Cursor(self.data, Path("?"))
        cursor.at = self.start
        if self.item == GGUFValueType.STRING:
            return cursor.strings(self.count, "an array")
        dtype = np.dtype(_SCALARS[self.item][1]).newbyteorder("<")
        return np.frombuffer(self.data, dtype, self.count, self.start).tolist()

    def __len__(self) -> int:
        return self.count

    def first_indices(self, wanted: Iterable[str]) -> dict[str, int]:
        """Where each of `wanted` first stands among the array's strings (those it has), each
        compared as bytes, none kept (the array was checked as the header was read)."""
        targets = {text.encode("utf-8"): text for text in wanted}
        lengths, found, at = {len(target) for target in targets}, {}, self.start
        unpack = struct.Struct("<Q").unpack_from
        for index in range(self.count):
            length = unpack(self.data, at)[0]
            if length in lengths:
                text = targets.get(bytes(self.data[at + 8:at + 8 + length]))
                if text is not None:
                    found.setdefault(text, index)
            at += 8 + length
        return found


def token_indices(reader: GGUFFile, texts: Iterable[str]) -> dict[str, int]:
    """The ids of those of `texts` that are tokens of the file's vocabulary."""
    field = reader.fields.get("tokenizer.ggml.tokens")
    if field is None:
        return {}
    if isinstance(field.value, LongArray):
        return field.value.first_indices(texts)
    tokens = field.contents()
    return {text: tokens.index(text) for text in texts if text in tokens}


LONG_ARRAY = 4096  # items: an array this long is read when asked for (`LongArray`)


@dataclass(frozen=True)
class Field:
    """One metadata entry's value, as Python values (`contents()`, as the `gguf` package's
    reader gives it: a number, a string, or a list of them)."""

    value: Any

    def contents(self) -> Any:
        return self.value.read() if isinstance(self.value, LongArray) else self.value


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

    @property
    def mapping(self) -> mmap.mmap | None:
        """The file's memory map under `data` (None for an empty file's array)."""
        return getattr(self.data, "_mmap", None)


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
            if count >= LONG_ARRAY:
                return LongArray(self.data, start, count, GGUFValueType(item))
            return np.frombuffer(self.data, dtype, count, start).tolist()  # no view kept
        if count * 8 > len(self.data) - self.at:  # every string or array item takes 8 bytes
            raise self.fail(f"metadata {key!r} claims {count} items")
        if item == GGUFValueType.STRING:  # a vocabulary: 10^5 strings, read in one tight loop
            start = self.at
            strings = self.strings(count, f"metadata {key!r}", keep=count < LONG_ARRAY)
            return strings if count < LONG_ARRAY else LongArray(
                self.data, start, count, GGUFValueType.STRING)
        return [self.value(item, key, depth + 1) for _ in range(count)]

    def strings(self, count: int, what: str, keep: bool = True) -> list[str]:
        """`count` strings one after another (`string`'s checks, without its calls); with
        `keep` False, checked (each decoded, then dropped) but not kept: []."""
        data, size, at, values = self.data, len(self.data), self.at, []
        unpack = struct.Struct("<Q").unpack_from
        try:
            for _ in range(count):
                if at + 8 > size:
                    raise self.fail(f"{what}: a string's length runs past the file's end")
                end = at + 8 + unpack(data, at)[0]
                if end > size:
                    raise self.fail(f"{what}: a string runs past the file's end")
                text = str(data[at + 8:end], "utf-8")
                if keep:
                    values.append(text)
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
    entries = {"GGUF.version": Field(version), "GGUF.tensor_count": Field(tensors),
            "GGUF.kv_count": Field(fields)}
    for _ in range(fields):
        key = cursor.string("a metadata key")
        value = cursor.value(cursor.number("I", f"metadata {key!r}'s type"), key)
        entries[key] = Field(value)
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
    return entries, infos, start


def rope_scaling(reader: GGUFFile, architecture: str) -> str | None:
    """How the file scales its rope, as llama.cpp's converter stores it: LongRoPE's factor
    tensors (Phi-3's 128k models), Llama 3's `rope_freqs`, else `rope.scaling.type`."""
    names = {tensor.name for tensor in reader.tensors}
    if PHI3_ROPE_FACTORS[0] in names:
        return "longrope"
    if ROPE_FREQS in names:
        return "llama3 (rope_freqs)"
    return metadata(reader, f"{architecture}.rope.scaling.type")


def describe(reader: GGUFFile) -> dict:
    """What `dresd inspect`-style output says about a file: architecture, name, tensor types
    with their counts, parameters and bytes."""
    types: dict[str, int] = {}
    for tensor in reader.tensors:
        types[tensor.tensor_type.name] = types.get(tensor.tensor_type.name, 0) + 1
    architecture = metadata(reader, "general.architecture")
    unsupported = sorted({t.tensor_type.name for t in reader.tensors
                          if t.tensor_type not in SUPPORTED_TYPES})
    known = spec.BY_GGUF.get(architecture)
    why_not = ([f"architecture {architecture}"] if known is None else []) + (
        [f"types {', '.join(unsupported)}"] if unsupported else [])
    runs = f"no ({'; '.join(why_not)})" if why_not else "yes"
    forward = None
    if known is not None and not why_not:  # the linears run in the C quantized kernel either way
        forward = ("dresd's C decoder" if known.forward == spec.C_DECODER else
                   "dresd's per-node recurrent forward (decoding/recurrent.py), its linears in "
                   "dresd's C quantized kernel")
        if known.moe:
            forward += ", each layer's experts in C (kernels/experts.c)"
    return {"architecture": architecture,
            "name": metadata(reader, "general.name"),
            "layers": metadata(reader, f"{architecture}.block_count"),
            "context_length": metadata(reader, f"{architecture}.context_length"),
            "sliding_window": metadata(reader, f"{architecture}.attention.sliding_window"),
            "rope_dimensions": metadata(reader, f"{architecture}.rope.dimension_count"),
            "rope_scaling": rope_scaling(reader, architecture),
            "rope_original_context": metadata(
                reader, f"{architecture}.rope.scaling.original_context_length"),
            "experts": metadata(reader, f"{architecture}.expert_count"),
            "experts_used": metadata(reader, f"{architecture}.expert_used_count"),
            # MTP blocks (Qwen3.5's NextN): `--method mtp` drafts with one
            "mtp_blocks": metadata(reader, f"{architecture}.nextn_predict_layers"),
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


def metadata_number(reader: GGUFFile, path: Path, key: str, default=None):
    """A scalar metadata value, `default` where the file has none; a clear error where the file
    has an array (a per-layer value dresd does not take) or nothing and there is no default."""
    value = metadata(reader, key)
    if value is None:
        if default is None:
            raise GGUFError(f"{path}: metadata {key!r} is missing.")
        return default
    if isinstance(value, list):
        raise GGUFError(f"{path}: metadata {key!r} is per layer ({value[:4]}...); dresd takes "
                        "one value for every layer.")
    return value


def token_rows(reader: GGUFFile, path: Path) -> int:
    """The vocabulary the model has rows for: the token embedding's (the converter cuts rows
    past the tokenizer's vocabulary, so they need not be the config's original size)."""
    for tensor in reader.tensors:
        if tensor.name == "token_embd.weight":
            return int(tensor.shape[1])
    raise GGUFError(f"{path}: tensor 'token_embd.weight' is missing.")


C_INT = 2**31 - 1  # the C kernels take sizes as int


def metadata_size(reader: GGUFFile, path: Path, key: str, default: int | None = None) -> int:
    """A size from the metadata: a whole number from 1 to what a C int holds."""
    value = metadata_number(reader, path, key, default)
    if isinstance(value, (bool, str)) or not float(value).is_integer() \
            or not 1 <= int(value) <= C_INT:
        raise GGUFError(f"{path}: metadata {key!r} is {value!r}, not a size.")
    return int(value)


