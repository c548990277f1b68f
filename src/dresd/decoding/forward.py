"""One target forward over many sequences at once, each on its own preallocated KV cache.

The batched loop (`decoding/batch.py`) hands a forward a list of `Segment`s, one per sequence
that takes part in this step: a running sequence's draft tree (its root is the last emitted
token) or a chunk of a new request's prompt. The forward returns, per segment, the logits and
the last-layer hidden states of its rows.

    rows of every segment, concatenated -> embeddings
    per layer: norm -> q, k, v for all rows at once (one fused matmul on dresd's kernel)
               -> each segment's k, v written into its sequence's cache
               -> attention per segment: its rows see its own cache and, within the segment,
                  their ancestors (tree) or the rows before them (prompt chunk); on the C
                  attention kernel every segment in one call
               -> output projection, norm, MLP for all rows at once
    final norm -> LM head on the rows whose logits are wanted

On a bf16 CPU model with dresd's kernels, all of the above per layer runs in C, every layer in
one call (`kernels/decoder.py`), every row of every segment on the row-invariant C attention,
prompt chunks of any length included. The PyTorch code below is the same forward for every
other case (float32, GPUs, CPUs without AVX-512 bf16).

Why prompt chunks take the C attention too (not PyTorch's SDPA, whose sums depend on how many
rows and keys it is given): then a cached key or value is a function of its token, its position
and the tokens before it only, whatever chunk, step or tree computed it. That is what lets the
prefix cache (`decoding/prefix_cache.py`) reuse a prompt's keys at any length, and a finished
answer's keys (written by decode and verify steps) for the next turn, with no change to any
output. It also costs nothing: a 1,024-token prompt in two 512-row chunks, default model, one
thread: 0.85-0.96 s on the C attention, 1.25-1.77 s with the chunks' attention in SDPA layer
by layer (the machine shared; the C path also saves the per-layer Python round trips).

Why a forward of our own: transformers' forward takes one rectangular batch, so sequences of
different lengths need padding, and its `DynamicCache` appends with `torch.cat`, which copies
the whole cache at every step. Here the rows of every sequence share the matrix multiplies
(the weights stream once per step however many sequences run) and each sequence's cache is a
preallocated buffer written in place.

Exactness: every operation computes a row from that row alone: the same modules as
transformers' Llama (RMSNorm, rotary embedding, the linears of `kernels/linear.py` or
`fastpath.py`, whose rows are batch-invariant; fused projections give the separate ones' bits)
and, per segment, the same attention function the model is set to (on a CPU in bf16 the
batch-invariant kernel). So a sequence's logits do not depend on which
other sequences share the forward, and a batch of one computes what transformers computes.

Gemma-3's text model runs here on the C decoder only (`LlamaForward.takes_on_c_decoder`: its
sandwich norms, GELU-tanh gate and sliding-window layers are the C decoder's `LayerForm`, not
the PyTorch path's), and so does a Llama-shaped model with a window on every layer (Mistral's,
a Phi-3 file's); where the C decoder does not build, `make_forward` gives them `HFForward`.
Its windowed layers read each segment's keys from the first one a row's window holds
(`_window`), with a mask of their own only where rows of the segment see different windows.

Qwen3.5's text models (Gated DeltaNet layers, a recurrent state instead of a KV cache) run on
`decoding/recurrent.GatedDeltaNetForward`: a state per tree node. Other models with recurrent
layers are refused: transformers' forward cannot take back a state a rejected draft changed.

`HFForward` is the fallback for every other architecture: transformers' own forward, one
sequence at a time on a `DynamicCache`. Same results, no cross-sequence batching.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from dresd.decoding.cache import keep_cache_entries, rollback_cache, sliding_window
from dresd.decoding.kv_cache import SequenceKV
from dresd.decoding.recurrent import ARCHITECTURES as RECURRENT_ARCHITECTURES
from dresd.decoding.recurrent import GatedDeltaNetForward, has_recurrent_layers
from dresd.decoding.segments import (  # noqa: F401 - Segment, SegmentOutput: imported from here
    Segment,
    SegmentOutput,
    additive_mask,
    row_choices,
    split_outputs,
)
from dresd.errors import DresdError
from dresd.host import give_back_free_heap, large_allocations_mapped
from dresd.kernels import attention as cpu_attention
from dresd.kernels import quant
from dresd.kernels.decoder import CDecoder, SegmentRows
from dresd.kernels.experts import MoEDecoder, is_moe
from dresd.kernels.linear import InvariantLinear, fuse, share_storage
from dresd.kernels.quant import QuantLinear
from dresd.models import spec
from dresd.models.fastpath import INVARIANT_ATTENTION


def _dtype_and_device(model: PreTrainedModel) -> tuple[torch.dtype, torch.device]:
    """The dtype the model computes in, and its device: its final norm's where it has one (a
    gpt-oss file's first parameter is a float32 attention sink where its embedding is
    quantized, and has none), else its first parameter's."""
    parameter = getattr(getattr(getattr(model, "model", None), "norm", None), "weight", None)
    if not isinstance(parameter, torch.Tensor):
        parameter = next(model.parameters())
    return parameter.dtype, parameter.device


class LlamaForward:
    """Batched forward for Llama-shaped decoders (Llama, Mistral, its window on the C decoder
    only, Qwen2, Qwen3 with its per-head q/k norms, a Qwen3-MoE file's with its experts on
    `kernels/experts.py`): see the module docstring."""

    # transformers' model types whose layers this forward's PyTorch path computes too
    ARCHITECTURES = tuple(model_type for arch in spec.ARCHITECTURES
                          if arch.forward == spec.C_DECODER and arch.pytorch_layers
                          for model_type in arch.model_types)
    # Rotary embeddings whose frequencies are fixed when the model is built: a row's cos and
    # sin are then a function of its position alone (transformers' `attention_scaling`
    # included), whatever rows share the forward. "dynamic" and "longrope" recompute them from
    # the longest position in the call, which would tie a row's bits to the rows beside it.
    STATIC_ROPE = ("default", "linear", "llama3", "yarn")

    @classmethod
    def takes(cls, model: PreTrainedModel, windowed: bool = False) -> bool:
        """Whether `model` has the layout this forward implements, module for module
        (`windowed`: with a window on every layer, which only the C decoder computes)."""
        config = model.config
        if config.model_type not in cls.ARCHITECTURES:
            return False
        if not type(model).__module__.startswith("transformers.models."):
            return False  # a subclass may change the forward this one stands in for
        rope = getattr(config, "rope_parameters", None) or {}
        if rope.get("rope_type", "default") not in cls.STATIC_ROPE:
            return False  # dynamic rotary variants are left to transformers
        if sliding_window(config) and not windowed:
            return False
        if getattr(config, "layer_types", None) and any(
                kind != "full_attention" for kind in config.layer_types):
            return False
        decoder = getattr(model, "model", None)
        if decoder is None or not all(hasattr(decoder, name) for name in
                                      ("embed_tokens", "layers", "norm", "rotary_emb")):
            return False
        # Qwen3-MoE: only a GGUF file's, whose experts run on dresd's kernels (kernels/experts.py)
        return config.model_type != "qwen3_moe" or is_moe(decoder)

    # Architectures whose layers only the C decoder runs (its `LayerForm`), not the PyTorch path
    C_DECODER_ONLY = tuple(model_type for arch in spec.ARCHITECTURES
                           if arch.forward == spec.C_DECODER and not arch.pytorch_layers
                           for model_type in arch.model_types)

    @classmethod
    def takes_on_c_decoder(cls, model: PreTrainedModel) -> bool:
        """Whether `model` is one this forward runs where its C decoder builds: Gemma-3's text
        model (its rope per layer type, each static), a gpt-oss file's (one static rope), or a
        Llama-shaped one with a window on every layer (Mistral's; a Phi-3 file's)."""
        config = model.config
        if config.model_type not in cls.C_DECODER_ONLY:
            return cls.takes(model, windowed=True)
        if not type(model).__module__.startswith("transformers.models."):
            return False
        ropes = _ropes_by_layer_type(config).values()
        if not ropes or any(not isinstance(rope, dict)
                            or rope.get("rope_type", "default") not in cls.STATIC_ROPE
                            for rope in ropes):
            return False
        decoder = getattr(model, "model", None)
        return decoder is not None and all(hasattr(decoder, name) for name in
                                           ("embed_tokens", "layers", "norm", "rotary_emb"))

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.decoder = model.model
        config = model.config
        self.dtype, self.device = _dtype_and_device(model)
        self.num_layers = config.num_hidden_layers
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.attention = ALL_ATTENTION_FUNCTIONS[config._attn_implementation]
        self.invariant_kernel = (config._attn_implementation == INVARIANT_ATTENTION
                                 and self.device.type == "cpu"
                                 and cpu_attention.takes(self.dtype, self.head_dim))
        # On dresd's linear kernel, projections that read the same input run as one matmul:
        # q, k, v (sizes `qkv_sizes`) and the MLP's gate and up. Each output is the same sum in
        # the same order either way (cpu_linear.fuse), so this changes no bit, only the calls.
        self.qkv_sizes = (self.heads * self.head_dim, self.kv_heads * self.head_dim,
                          self.kv_heads * self.head_dim)
        self.fused = fuse_layers(self.decoder.layers)
        # On a bf16 CPU model with dresd's kernels, every layer in one C call (kernels/decoder.py).
        c_decoder = MoEDecoder if is_moe(self.decoder) else CDecoder
        self.c_decoder = (c_decoder.build(self.decoder, config, self.fused)
                          if self.invariant_kernel else None)
        # Gemma-3: a rotary table per layer type; the windowed layers' window (Gemma-3's
        # sliding layers, gpt-oss's, every layer of a Mistral with one)
        types = set(getattr(config, "layer_types", None) or ()) \
            if _nested_rope(config) else set()
        self.rope_types = sorted(types)  # [] a Llama's one table (its rotary_emb takes no type)
        self.window = sliding_window(config)

    def new_sequence(self) -> SequenceKV:
        return SequenceKV(self.num_layers, self.kv_heads, self.head_dim, self.dtype, self.device)

    def keep(self, sequence: SequenceKV, prefix_len: int, kept_rows: list[int]) -> None:
        """Keep the cache's first `prefix_len` entries plus the rows `kept_rows` after them."""
        sequence.keep(prefix_len, kept_rows)

    def _mask(self, segment: Segment) -> torch.Tensor | None:
        """The additive mask [1, 1, t, start + t] of a segment, or None where the attention's
        own causal rule is the same thing (one row; or a chain on an empty cache, which is
        how transformers prefills a prompt, so the prompt's first chunk rounds as it does)."""
        rows = len(segment)
        if rows == 1 or (segment.ancestors is None and segment.start == 0):
            return None
        within = segment.ancestors
        if within is None:  # a prompt chunk: each row sees the rows before it
            within = torch.ones(rows, rows, dtype=torch.bool, device=self.device).tril()
        return additive_mask(segment.start, within, self.dtype)

    def _inputs(self, segments: list[Segment]) -> tuple[torch.Tensor, torch.Tensor,
                                                          torch.Tensor, list[int]]:
        """The embedded rows [rows, d], their rotary cos and sin [rows, head_dim] and the
        segments' row bounds; makes room in each sequence's cache for its rows. (Gemma-3:
        cos and sin of its full-attention layers, `_local_rope` the windowed layers'.)"""
        token_ids = [token for segment in segments for token in segment.token_ids]
        positions = [p for segment in segments for p in segment.positions()]
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        position_ids = torch.tensor([positions], dtype=torch.long, device=self.device)
        hidden = self.decoder.embed_tokens(ids)  # [rows, d]
        # [1, rows, head_dim], from the model's own rotary embedding: its scaling (linear,
        # llama3, yarn; a GGUF file's `rope_freqs`) and its `attention_scaling` on cos and sin
        # included, so the C decoder and the code below apply exactly transformers' values
        if self.rope_types:  # Gemma-3: the global layers' table (the local one's if none is)
            cos, sin = self.decoder.rotary_emb(hidden, position_ids, self.rope_types[0])
            self._positions = position_ids
        else:
            cos, sin = self.decoder.rotary_emb(hidden, position_ids)
        if cos.shape[-1] == self.head_dim // 2:  # gpt-oss's: one value per turned pair, which
            # rotates (x1, x2) to (x1 cos - x2 sin, x2 cos + x1 sin): Llama's rotation by the
            # table written twice
            cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
        bounds = [0]
        for segment in segments:
            bounds.append(bounds[-1] + len(segment))
            segment.sequence.reserve(segment.start + len(segment))
        return hidden, cos[0], sin[0], bounds

    @torch.inference_mode()
    def __call__(self, segments: list[Segment]) -> list[SegmentOutput]:
        if self.c_decoder is not None:
            return self._c_forward(segments)
        hidden, cos, sin, bounds = self._inputs(segments)
        cos, sin = cos[:, None], sin[:, None]  # [rows, 1, head_dim]: broadcast over heads
        masks = [self._mask(segment) for segment in segments]
        # The batch-invariant C attention takes every segment, prompt chunks of any length
        # included, in one call: each row's bits depend on its own keys only (module docstring).
        one_kernel_call = self.invariant_kernel

        for index, layer in enumerate(self.decoder.layers):
            attn = layer.self_attn
            normed = layer.input_layernorm(hidden)
            fused = self.fused[index]
            if fused is not None:
                query, key, value = fused.qkv(normed).split(self.qkv_sizes, dim=-1)
            else:
                query, key, value = attn.q_proj(normed), attn.k_proj(normed), attn.v_proj(normed)
            query = query.reshape(-1, self.heads, self.head_dim)
            key = key.reshape(-1, self.kv_heads, self.head_dim)
            value = value.reshape(-1, self.kv_heads, self.head_dim)
            if hasattr(attn, "q_norm"):  # Qwen3: each head normed before the rotary embedding
                query, key = attn.q_norm(query), attn.k_norm(key)
            # Rotary embedding, the expression transformers evaluates (rotate_half inlined).
            query = query * cos + _rotate_half(query) * sin
            key = key * cos + _rotate_half(key) * sin
            mixed = torch.empty(hidden.shape[0], self.heads, self.head_dim, dtype=self.dtype,
                                device=self.device)
            views = []
            for segment, first, last in zip(segments, bounds[:-1], bounds[1:], strict=True):
                cache = segment.sequence
                cache.write(index, segment.start, key[first:last], value[first:last])
                # [1, kv_heads, end, head_dim] each, no copy
                views.append(cache.view(index, segment.start + len(segment)))
            if one_kernel_call:  # every segment's attention in one C call, rows as alone
                cpu_attention.attention_batch(query, bounds, [k for k, _ in views],
                                              [v for _, v in views], masks, attn.scaling,
                                              out=mixed)
            else:
                for (keys, values), mask, first, last in zip(views, masks, bounds[:-1],
                                                             bounds[1:], strict=True):
                    out, _ = self.attention(attn, query[first:last].transpose(0, 1)[None],
                                            keys, values, mask, dropout=0.0,
                                            scaling=attn.scaling)
                    mixed[first:last] = out[0]  # [t, heads, head_dim]
            hidden = hidden + attn.o_proj(mixed.view(hidden.shape[0], -1))
            normed = layer.post_attention_layernorm(hidden)
            if fused is not None and fused.gate_up is not None:  # down(act(gate(x)) * up(x))
                gate, up = fused.gate_up(normed).chunk(2, dim=-1)
                hidden = hidden + layer.mlp.down_proj(layer.mlp.act_fn(gate) * up)
            else:
                hidden = hidden + layer.mlp(normed)

        hidden = self.decoder.norm(hidden)
        for segment in segments:
            segment.sequence.length = segment.start + len(segment)
        return split_outputs(self.model, segments, bounds, hidden)

    def _local_rope(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Gemma-3's windowed layers' cos and sin [rows, head_dim] for the rows `_inputs` just
        embedded, where they differ from the global layers' table; else None."""
        if "sliding_attention" not in self.rope_types[1:]:
            return None
        cos, sin = self.decoder.rotary_emb(hidden, self._positions, "sliding_attention")
        return cos[0].contiguous(), sin[0].contiguous()

    def _window(self, segment: Segment, kernel_masks: list) -> tuple[int, tuple | None]:
        """A segment's view in the windowed layers, as `SegmentRows.window`: the first key
        any of its rows' windows holds (a row at position q sees key k where q - k < window,
        transformers' rule), and where its rows' windows differ beyond that, a mask of their
        own over the keys from there on ((address, row stride), its rows kept alive in
        `kernel_masks`)."""
        window, start, rows = self.window, segment.start, len(segment)
        positions = segment.positions()
        first = max(0, min(start, min(positions) - window + 1))
        if max(positions) - window + 1 <= first and max(positions) - min(positions) < window:
            return first, None  # every key from `first` on is in every row's window
        within = segment.ancestors
        if within is None:
            within = torch.ones(rows, rows, dtype=torch.bool, device=self.device).tril()
        rows_at = torch.tensor(positions, device=self.device)
        columns = torch.cat([torch.arange(first, start, device=self.device), rows_at])
        allowed = torch.ones(rows, start - first + rows, dtype=torch.bool, device=self.device)
        allowed[:, start - first:] = within
        allowed &= (rows_at[:, None] - columns[None, :]) < window
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        rows_mask, address, stride = cpu_attention.kernel_mask(mask[None, None], allowed.shape[1])
        kernel_masks.append(rows_mask)
        return first, (address, stride)

    def _c_forward(self, segments: list[Segment]) -> list[SegmentOutput]:
        """The forward on `kernels/decoder.c`: the whole decoder in one C call, every segment's
        rows (prompt chunks of any length too) on its row-invariant attention."""
        decoder = self.c_decoder
        hidden, cos, sin, bounds = self._inputs(segments)
        cos, sin = cos.contiguous(), sin.contiguous()
        local = self._local_rope(hidden) if self.rope_types else None
        kernel_masks, parts = [], []  # the kernel's bf16 rows of each mask, alive till the end
        for segment, first in zip(segments, bounds, strict=False):
            mask = self._mask(segment)
            where = None  # the mask's rows as the kernel reads them: (address, row stride)
            if mask is not None:
                rows_mask, address, stride = cpu_attention.kernel_mask(
                    mask, segment.start + len(segment))
                kernel_masks.append(rows_mask)
                where = (address, stride)
            window = self._window(segment, kernel_masks) if self.window else None
            parts.append(SegmentRows(first, len(segment), segment.start, segment.sequence, where,
                                     window))
        if local is not None:
            hidden = decoder.forward(hidden, cos, sin, decoder.segments(parts), local)
        else:  # (a subclass's forward may take no table for windowed layers)
            hidden = decoder.forward(hidden, cos, sin, decoder.segments(parts))
        for segment in segments:
            segment.sequence.length = segment.start + len(segment)
        return split_outputs(self.model, segments, bounds, hidden)


def _nested_rope(config) -> bool:
    """Whether the config's rope parameters are one set per layer type (Gemma-3's), not one."""
    rope = getattr(config, "rope_parameters", None) or {}
    return bool(rope) and "rope_type" not in rope and all(isinstance(value, dict)
                                                          for value in rope.values())


def _ropes_by_layer_type(config) -> dict:
    """The config's rope parameters per layer type (one set: {"all": it}), {} where none."""
    rope = getattr(config, "rope_parameters", None) or {}
    return rope if _nested_rope(config) or not rope else {"all": rope}


@dataclass
class FusedProjections:
    qkv: InvariantLinear  # [q | k | v] outputs
    gate_up: InvariantLinear | None  # [gate | up] outputs; None: the MLP is experts (MoEMLP)


# Each layer is fused once, while it keeps the same projection modules: a batched engine (a
# forward) is made per `generate_many` and per bench level, and fusing the default model's 30
# layers again took ~0.15 s each time.
_FUSED: weakref.WeakKeyDictionary[torch.nn.Module, tuple[list, FusedProjections | None]] = (
    weakref.WeakKeyDictionary())


def fuse_layers(layers: torch.nn.ModuleList) -> list[FusedProjections | None]:
    """`fuse_layer` of each layer; where any is fused anew, the heap's free pages go back to
    the system afterwards: the parts below the mapped size (a 1B model's k and v, ~0.2 MB
    each) were freed into the heap as their fused copies were made, and stayed resident
    (Gemma-3-1B: 5.4 MB at the run's peak)."""
    anew = any(_FUSED.get(layer) is None for layer in layers)
    fused = [fuse_layer(layer) for layer in layers]
    if anew:
        give_back_free_heap()
    return fused


def fuse_layer(layer: torch.nn.Module) -> FusedProjections | None:
    """A decoder layer's q/k/v and gate/up as two fused kernel linears, or None where its
    projections are not on dresd's linear kernel. The separate modules then read their
    weights from the fused ones (`cpu_linear.share_storage`): no weight is held twice."""
    attn, mlp = layer.self_attn, layer.mlp
    parts = ([attn.q_proj, attn.k_proj, attn.v_proj],
             [mlp.gate_proj, mlp.up_proj] if hasattr(mlp, "gate_proj") else [])  # [] experts
    modules = parts[0] + parts[1]
    cached = _FUSED.get(layer)
    if cached is None or cached[0] != modules:  # modules compare by identity
        with large_allocations_mapped():  # each part's buffer freed as its copy is made
            cached = _FUSED[layer] = (modules, _fuse(parts))
    return cached[1]


def _fuse(parts: tuple[list, list]) -> FusedProjections | None:
    if all(isinstance(module, QuantLinear) for group in parts for module in group):
        return FusedProjections(*(quant.fuse(group) if group else None
                                  for group in parts))  # a GGUF file's
    if not all(isinstance(module, InvariantLinear) for group in parts for module in group):
        return None
    qkv, gate_up = (fuse(group) if group else None for group in parts)
    for fused, group in zip((qkv, gate_up), parts, strict=True):
        if group:
            share_storage(fused, group)
    return FusedProjections(qkv, gate_up)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class HFSequence:
    """A sequence's `DynamicCache` for `HFForward` (every entry kept: `cache.rollback_cache`)."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.cache = rollback_cache(model.config)
        self.length = 0


class HFForward:
    """transformers' own forward, one sequence at a time: any causal LM that takes a 4D mask
    and position ids (`supports_tree_attention` checks it; otherwise drafts are linear)."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.dtype, self.device = _dtype_and_device(model)
        self.window = sliding_window(model.config)
        types = getattr(model.config.get_text_config(decoder=True), "layer_types", None)
        self.layer_types = set(types) if types else None

    def _tree_mask(self, segment: Segment) -> torch.Tensor | dict[str, torch.Tensor]:
        """A tree's additive mask; with sliding-window layers, those layers' mask also hides
        every entry `window` or more positions behind the row (transformers' rule: position
        q sees k where q - k < window), as a mask per layer type where the model has both."""
        full = additive_mask(segment.start, segment.ancestors, self.dtype)
        if self.window is None:
            return full
        rows = torch.tensor(segment.positions(), device=self.device)
        columns = torch.cat([torch.arange(segment.start, device=self.device), rows])
        outside = (rows[:, None] - columns[None, :]) >= self.window
        windowed = full.masked_fill(outside[None, None], torch.finfo(self.dtype).min)
        if self.layer_types is None or self.layer_types == {"sliding_attention"}:
            return windowed
        return {"full_attention": full, "sliding_attention": windowed}

    def new_sequence(self) -> HFSequence:
        return HFSequence(self.model)

    def keep(self, sequence: HFSequence, prefix_len: int, kept_rows: list[int]) -> None:
        keep_cache_entries(sequence.cache, prefix_len, kept_rows)
        sequence.length = prefix_len + len(kept_rows)

    @torch.inference_mode()
    def __call__(self, segments: list[Segment]) -> list[SegmentOutput]:
        outputs = []
        for segment in segments:
            rows = len(segment)
            mask = None
            if segment.ancestors is not None:  # a tree; a chain keeps transformers' mask
                mask = self._tree_mask(segment)
            keep = {"all": 0, "last": 1, "none": 1}[segment.logits_rows]
            out = self.model(
                input_ids=torch.tensor([segment.token_ids], device=self.device),
                position_ids=torch.tensor([segment.positions()], device=self.device),
                attention_mask=mask,
                cache=segment.sequence.cache,
                use_cache=True,
                output_hidden_states=True,
                logits_to_keep=keep,
            )
            segment.sequence.length = segment.start + rows
            output = SegmentOutput(logits=None, hidden=out.hidden_states[-1][0])
            if segment.logits_rows != "none":
                output.logits = out.logits[0]
                output.greedy, output.top2 = row_choices(output.logits, [segment],
                                                          [len(output.logits)])
                output.top2 = output.top2 if segment.top2 else None
            outputs.append(output)
        return outputs


# Each model's answer, checked once (every `speculative_generate` call builds an engine that
# asks): kept beside the model, not on it, and gone with it.
_TREE_ATTENTION: weakref.WeakKeyDictionary[PreTrainedModel, bool] = weakref.WeakKeyDictionary()


@torch.inference_mode()
def supports_tree_attention(model: PreTrainedModel) -> bool:
    """Whether the model honours a custom 4D attention mask with custom position ids.

    The batched Llama forward always does (it builds each segment's mask itself). For any other
    model it is checked, not guessed: token c at position 1 masked off from token b (also at
    position 1) must give the same logits as the plain sequence [a, c]. A model that ignores or
    rejects the mask fails the check and is verified with linear drafts only.
    """
    if LlamaForward.takes(model) or GatedDeltaNetForward.takes(model):
        return True
    cached = _TREE_ATTENTION.get(model)
    if cached is not None:
        return cached
    vocab = model.config.vocab_size
    a, b, c = 1 % vocab, 2 % vocab, 3 % vocab
    forward = HFForward(model)
    try:
        tree_rows = torch.tensor([[True, False, False], [True, True, False],
                                  [True, False, True]], device=forward.device)
        tree = forward([Segment(forward.new_sequence(), [a, b, c], 0, depths=[0, 1, 1],
                                ancestors=tree_rows)])[0]
        plain = forward([Segment(forward.new_sequence(), [a, c], 0)])[0]
        scale = plain.logits[1].abs().max().clamp_min(1e-6)
        # A mask that is ignored changes logits by O(1); reduced precision moves them by a
        # few ulps (bf16: eps = 2^-7), which must not read as "ignored".
        tolerance = max(1e-3, 8 * torch.finfo(forward.dtype).eps)
        ok = bool(((tree.logits[2] - plain.logits[1]).abs().max() / scale) < tolerance)
    except Exception:  # noqa: BLE001 - any failure means "cannot take a tree mask"
        ok = False
    _TREE_ATTENTION[model] = ok
    return ok


Forward = LlamaForward | GatedDeltaNetForward | HFForward  # what `make_forward` gives


def make_forward(model: PreTrainedModel) -> Forward:
    """The batched Llama forward where the model is Llama-shaped (or Gemma-3's, where the C
    decoder runs it), Qwen3.5's per-node recurrent states for its linear-attention layers,
    else transformers' own. A model with other recurrent layers is refused: transformers'
    forward cannot take back a state that a rejected draft changed."""
    if LlamaForward.takes(model):
        return LlamaForward(model)
    if LlamaForward.takes_on_c_decoder(model):
        forward = LlamaForward(model)
        if forward.c_decoder is not None:
            return forward
        if is_moe(forward.decoder):  # gpt-oss: its experts' layers have no other forward
            raise DresdError(
                f"model type {model.config.model_type!r} runs on dresd's C decoder only, which "
                "does not take it here (DRESD_CPU_DECODER=0, or kernels this CPU or compiler "
                "cannot build: `dresd --version` says which)")
    if GatedDeltaNetForward.takes(model):
        return GatedDeltaNetForward(model)
    if has_recurrent_layers(model):
        raise DresdError(
            f"model type {model.config.model_type!r} keeps a recurrent state (linear-attention "
            f"or state-space layers); dresd verifies drafts over such layers for Qwen3.5 "
            f"({', '.join(RECURRENT_ARCHITECTURES)}) only")
    return HFForward(model)
