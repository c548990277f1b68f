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

For `llama` and `qwen2` the forward is dresd's own (`decoding/forward.LlamaForward` on the C
decoder); a `gemma3` file (Gemma-3's text model: sliding-window layers, tied embedding) runs
transformers' `Gemma3ForCausalLM` forward (`forward.HFForward`, which keeps the window under
speculation) with the same quantized linears in the C kernel. Either way every method runs on
the file's own weights with the same batch-invariance as a bf16 model: the reference for a GGUF
model is its own plain decoding on the same file.

llama.cpp's converter permutes the rows of a Llama-architecture file's q and k projections (its
rotary embedding pairs neighbouring dimensions, transformers' pairs the two halves of a head);
`unpermute_rows` undoes that, whole rows at a time, so the blocks stay as they are. A Gemma-3
file has no such permutation (llama.cpp ropes it NEOX-style, as transformers does); its norms
are stored plus one (`gemma3_config` and `_fill_gemma3` say what else differs).
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
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma3TextConfig,
    PreTrainedModel,
)
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from dresd.errors import DresdError
from dresd.host import cache_dir
from dresd.kernels import quant
from dresd.kernels.linear import InvariantLinear
from dresd.kernels.linear import kernel as linear_kernel

Q = GGMLQuantizationType
C_DECODER_ARCHITECTURES = ("llama", "qwen2")  # whose layers `LlamaForward` runs
ARCHITECTURES = (*C_DECODER_ARCHITECTURES, "gemma3")  # gemma3: transformers' forward
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
    forward = None
    if not why_not:  # the linears run in the C quantized kernel either way
        forward = ("dresd's C decoder" if architecture in C_DECODER_ARCHITECTURES else
                   "transformers' forward, its linears in dresd's C quantized kernel")
    return {"architecture": architecture,
            "name": _field(reader, "general.name"),
            "layers": _field(reader, f"{architecture}.block_count"),
            "context_length": _field(reader, f"{architecture}.context_length"),
            "sliding_window": _field(reader, f"{architecture}.attention.sliding_window"),
            "tensor_types": types,
            "parameters": int(sum(int(np.prod(t.shape)) for t in reader.tensors)),
            "tensor_bytes": int(sum(t.n_bytes for t in reader.tensors)),
            "dresd_runs_it_natively": runs,
            "forward": forward}


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


def _number(reader: GGUFReader, path: Path, key: str, default=None):
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


def gemma3_config(reader: GGUFReader, path: Path) -> Gemma3TextConfig:
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


def _token_rows(reader: GGUFReader, path: Path) -> int:
    """The vocabulary the model has rows for: the token embedding's (the converter cuts rows
    past the tokenizer's vocabulary, so they need not be the config's original size)."""
    for tensor in reader.tensors:
        if tensor.name == "token_embd.weight":
            return int(tensor.shape[1])
    raise GGUFError(f"{path}: tensor 'token_embd.weight' is missing.")


def config_and_tokenizer(path: Path, reader: GGUFReader
                         ) -> tuple[AutoConfig, PreTrainedTokenizerBase]:
    """The file's transformers config and tokenizer. transformers reads both from the file's
    metadata, parsing its vocabulary each time (~8 s for a 49k vocabulary); so the first load
    saves them in the cache, keyed by the metadata's bytes (everything before the tensors'
    data: the same for every copy of the file), and later loads read that folder. A Gemma-3
    file's config is dresd's reading (`gemma3_config`, cheap, so never taken from the cache);
    its tokenizer is transformers' (a sentencepiece vocabulary: its Gemma builder, which
    rebuilds the merges from the tokens' order; a byte-level one: as for Llama files)."""
    own = gemma3_config(reader, path) if _field(reader, "general.architecture") == "gemma3" \
        else None
    with open(path, "rb") as file:
        key = hashlib.sha256(file.read(reader.data_offset))
    folder = cache_dir() / "gguf" / key.hexdigest()[:24]
    if (folder / "config.json").exists():
        return (own or AutoConfig.from_pretrained(folder),
                AutoTokenizer.from_pretrained(folder))
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
    if architecture == "gemma3":
        _fill_gemma3(model, tensors)
    else:
        _fill_llama(model, tensors, architecture)
    decoder = model.model
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"  # tied
    model.lm_head = tensors.linear(head, out_dtype=torch.float32)
    with torch.device("cpu"):  # its frequencies, computed (they are no weights of the file)
        decoder.rotary_emb = type(decoder.rotary_emb)(config=config)
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
    """A Llama or Qwen2 model's layers from the file (the C decoder then runs them)."""
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
        mlp.gate_proj = tensors.linear(blk + "ffn_gate.weight")
        mlp.up_proj = tensors.linear(blk + "ffn_up.weight")
        mlp.down_proj = tensors.linear(blk + "ffn_down.weight")
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
    - Embedding: scaled by sqrt(hidden size) as Gemma3TextScaledWordEmbedding and llama.cpp
      scale it, in float32 before the rows round to bf16; the LM head is the same tensor
      (tied) unless the file has output.weight.
    """
    config, decoder = model.config, model.model
    hidden, head_dim = config.hidden_size, config.head_dim
    decoder.embed_tokens = tensors.embedding("token_embd.weight", scale=hidden ** 0.5)
    expected = {"q_proj": (config.num_attention_heads * head_dim, hidden),
                "k_proj": (config.num_key_value_heads * head_dim, hidden),
                "v_proj": (config.num_key_value_heads * head_dim, hidden),
                "o_proj": (hidden, config.num_attention_heads * head_dim),
                "gate_proj": (config.intermediate_size, hidden),
                "up_proj": (config.intermediate_size, hidden),
                "down_proj": (hidden, config.intermediate_size)}

    def linear(name: str, part: str) -> torch.nn.Module:
        if tensors.shape(name)[:2] != expected[part]:
            raise GGUFError(f"{tensors.path}: tensor {name!r} is {tensors.shape(name)} where "
                            f"the model's config needs {expected[part]} (out, in).")
        return tensors.linear(name)

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
            setattr(attn, part, linear(f"{blk}{name}.weight", part))
        for part, name in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"),
                           ("down_proj", "ffn_down")):
            setattr(mlp, part, linear(f"{blk}{name}.weight", part))
    decoder.norm.weight = _norm(tensors, "output_norm.weight", hidden, -1.0)
