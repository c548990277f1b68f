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

The forward is dresd's own (`decoding/forward.LlamaForward` on the C decoder), so every method
runs on the file's own weights with the same batch-invariance as a bf16 model: the reference
for a GGUF model is its own plain decoding on the same file.

llama.cpp's converter permutes the rows of a Llama-architecture file's q and k projections (its
rotary embedding pairs neighbouring dimensions, transformers' pairs the two halves of a head);
`unpermute_rows` undoes that, whole rows at a time, so the blocks stay as they are.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import tempfile
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from dresd.errors import DresdError
from dresd.host import cache_dir
from dresd.kernels import quant
from dresd.kernels.linear import InvariantLinear
from dresd.kernels.linear import kernel as linear_kernel

Q = GGMLQuantizationType
ARCHITECTURES = ("llama", "qwen2")  # whose layers `LlamaForward` runs
FLOAT_TYPES = {Q.F32: np.float32, Q.F16: np.float16}
SUPPORTED_TYPES = set(quant.LAYOUTS) | set(FLOAT_TYPES) | {Q.BF16}


class GGUFError(DresdError):
    """A GGUF file that dresd cannot run; the message names the file and what is wrong."""


class QuantEmbedding(torch.nn.Module):
    """A token embedding kept in the file's blocks: the rows asked for are dequantized (the
    same values every time), the rest never are."""

    def __init__(self, qtype: Q, raw: np.ndarray, vocab: int, dim: int) -> None:
        super().__init__()
        self.qtype, self.raw, self.num_embeddings, self.embedding_dim = qtype, raw, vocab, dim

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).cpu().numpy()
        rows = quant.dequantize(self.qtype, np.asarray(self.raw[flat]), len(flat),
                                self.embedding_dim)
        return torch.from_numpy(rows).to(torch.bfloat16).reshape(*ids.shape, -1)


def is_gguf(name: str) -> bool:
    return name.lower().endswith(".gguf")


def _field(reader: GGUFReader, key: str):
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def open_gguf(path: Path) -> GGUFReader:
    """The file's reader (tensors memory-mapped), or one clear error for a file that is not
    there, not GGUF, damaged or truncated."""
    if not path.is_file():
        raise GGUFError(f"GGUF file {str(path)!r} does not exist.")
    try:
        reader = GGUFReader(path, "r")
    except Exception as err:  # the reader's own errors: bad magic, short reads, bad offsets
        raise GGUFError(f"{path} is not a readable GGUF file ({type(err).__name__}: "
                        f"{str(err).splitlines()[0] if str(err) else 'no detail'}); is it "
                        "damaged or truncated?") from err
    size = path.stat().st_size
    for tensor in reader.tensors:
        if tensor.data_offset + tensor.n_bytes > size:
            raise GGUFError(f"{path} is truncated: tensor {tensor.name!r} ends past the file's "
                            f"{size} bytes.")
    return reader


def describe(reader: GGUFReader) -> dict:
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
    return {"architecture": architecture,
            "name": _field(reader, "general.name"),
            "layers": _field(reader, f"{architecture}.block_count"),
            "context_length": _field(reader, f"{architecture}.context_length"),
            "tensor_types": types,
            "parameters": int(sum(int(np.prod(t.shape)) for t in reader.tensors)),
            "tensor_bytes": int(sum(t.n_bytes for t in reader.tensors)),
            "dresd_runs_it_natively": runs}


def gguf_fingerprint(reader: GGUFReader) -> str:
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

    def __init__(self, reader: GGUFReader, path: Path) -> None:
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

    def embedding(self, name: str) -> torch.nn.Module:
        tensor = self.get(name)
        dim, vocab = (int(size) for size in tensor.shape[:2])
        raw = np.asarray(tensor.data).reshape(vocab, -1)
        if tensor.tensor_type in quant.LAYOUTS:
            return QuantEmbedding(tensor.tensor_type, raw, vocab, dim)
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


def config_and_tokenizer(path: Path, reader: GGUFReader
                         ) -> tuple[AutoConfig, PreTrainedTokenizerBase]:
    """The file's transformers config and tokenizer. transformers reads both from the file's
    metadata, parsing its vocabulary each time (~8 s for a 49k vocabulary); so the first load
    saves them in the cache, keyed by the metadata's bytes (everything before the tensors'
    data: the same for every copy of the file), and later loads read that folder."""
    with open(path, "rb") as file:
        key = hashlib.sha256(file.read(reader.data_offset))
    folder = cache_dir() / "gguf" / key.hexdigest()[:24]
    if (folder / "config.json").exists():
        return (AutoConfig.from_pretrained(folder),
                AutoTokenizer.from_pretrained(folder))
    settings = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    config = AutoConfig.for_model(**settings)
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
    return config, tokenizer


def load_gguf(path: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, str, str]:
    """(model, tokenizer, fingerprint, what runs its linears) for a GGUF file."""
    reader = open_gguf(path)
    architecture = _field(reader, "general.architecture")
    if architecture not in ARCHITECTURES:
        raise GGUFError(f"{path}: architecture {architecture!r} is not one dresd runs from a "
                        f"GGUF file yet ({', '.join(ARCHITECTURES)}).")
    if quant.kernel() is None or linear_kernel() is None:
        raise GGUFError(f"{path}: a quantized GGUF model runs on dresd's C kernels, which need "
                        "a CPU with AVX-512 bf16 and VNNI and a C compiler; this machine has "
                        "not got them (see `dresd --version`).")
    tensors = _Tensors(reader, path)
    config, tokenizer = config_and_tokenizer(path, reader)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.eval()

    decoder = model.model
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
        mlp.gate_proj = tensors.linear(blk + "ffn_gate.weight")
        mlp.up_proj = tensors.linear(blk + "ffn_up.weight")
        mlp.down_proj = tensors.linear(blk + "ffn_down.weight")
    decoder.norm.weight = norm("output_norm.weight")
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"  # tied
    model.lm_head = tensors.linear(head, out_dtype=torch.float32)
    with torch.device("cpu"):  # its frequencies, computed (they are no weights of the file)
        decoder.rotary_emb = type(decoder.rotary_emb)(config=config)
    left = [name for name, value in [*model.named_parameters(), *model.named_buffers()]
            if value is not None and value.is_meta]
    if left:
        raise GGUFError(f"{path}: no tensor in the file for {', '.join(left[:4])}.")
    types = sorted({t.tensor_type.name for t in reader.tensors if t.tensor_type != Q.F32})
    return model, tokenizer, gguf_fingerprint(reader), f"GGUF {'+'.join(types)}"
