"""Verifying draft trees over linear-attention layers: Qwen3.5's Gated DeltaNet.

Qwen3.5 (and its mixture of experts) interleaves full-attention layers, which keep a KV cache
like Llama's, with Gated DeltaNet layers, which keep a *recurrent state* instead: per layer a
matrix S [value heads, key dim, value dim] and the last K-1 inputs of a short causal
convolution. A token t updates them (the gated delta rule; `kernels/recurrent.c` states it):

    x_t  = silu(conv(last K-1 inputs, input_t))      -> q_t, k_t, v_t
    S_t  = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T
    o_t  = S_t^T q_t

A KV cache keeps one entry per token, so a verify step writes every tree node and keeps the
accepted path's rows. A recurrent state has no entries to keep or drop: the state after a node
is a function of every token on its path. So here:

1. a forward computes each row from its parent's state (row 0's parent: the sequence's kept
   state), and each row's convolution over the inputs on its own path; a rejected branch's
   states are never written anywhere;
2. `keep` rebuilds the kept state along the accepted path, from the per-row inputs the forward
   saved (q, k, v, beta, g: a few kB a row), by the same rule: the state a one-token step after
   each of those tokens would have left;
3. a chain (a prompt chunk, a linear draft) also leaves the state after its last row at once,
   so a prompt needs no `keep`, and a chain kept whole needs no rebuild.

Every row, prompt rows included, runs that one-token rule (never a chunked form, whose sums
would depend on where a chunk starts), and every other step of a row reads the row alone
(dresd's linears are row-invariant): so a token's state and logits depend only on the tokens
before it, under every method, chunk size and batch, and every method's output is `ar`'s.

The full-attention layers run transformers' attention module on this sequence's KV buffer
(`LayerCache`) with the tree's mask. Segments run one after another.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from dresd.decoding.kv_cache import SequenceKV
from dresd.decoding.segments import Segment, SegmentOutput, additive_mask, split_outputs
from dresd.kernels.recurrent import delta_rule
from dresd.models import spec
from dresd.models.fastpath import activation_dtype

# set by models/gguf.fill_qwen35 on a layer whose value heads are in a GGUF file's tiled order
TILED_VALUE_HEADS = "dresd_tiled_value_heads"
# transformers' model types whose decoder layers run here (Qwen3.5's, dense and mixture of
# experts: the spec's RECURRENT architectures)
ARCHITECTURES = tuple(model_type for arch in spec.ARCHITECTURES if arch.forward == spec.RECURRENT
                      for model_type in arch.model_types)
# layer types that keep a recurrent state instead of (or beside) a KV cache: a model with any
# of them that is not run here has no exact draft verification in dresd (`make_forward`)
RECURRENT_LAYERS = ("linear_attention", "mamba", "mamba2", "conv", "recurrent")


def has_recurrent_layers(model: PreTrainedModel) -> bool:
    config = model.config.get_text_config(decoder=True)
    types = getattr(config, "layer_types", None) or ()
    return any(kind in RECURRENT_LAYERS for kind in types) or bool(
        getattr(config, "layers_block_type", None))


# PyTorch's float32 sigmoid, SiLU and softplus compute most of a tensor's elements on a vector
# path and its last few (a tensor's tail; a one-row call's every element) on a scalar one, and
# the two round differently (measured: ~4% of sigmoid's outputs, ~11% of softplus's differ by an
# ulp). A row's decay would then depend on how many rows shared its call, and a tree's tokens
# drifted from `ar`'s. These are written with exp, log1p, + and / only, which give the same bits
# on both paths: each row's bits its own.

def row_sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-x))


def row_silu(x: torch.Tensor) -> torch.Tensor:
    return x * row_sigmoid(x)


def row_softplus(x: torch.Tensor) -> torch.Tensor:
    """log(1 + e^x), x itself above 20 (as `F.softplus`'s threshold)."""
    return torch.where(x > 20.0, x, torch.log1p(torch.exp(x.clamp(max=20.0))))


def gated_norm(norm: torch.nn.Module, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """transformers' `Qwen3_5RMSNormGated` (RMSNorm per head, then times SiLU(gate), both in
    float32), its SiLU `row_silu`."""
    dtype = x.dtype
    normed = x.float()
    normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    normed = norm.weight * normed.to(dtype)
    return (normed * row_silu(gate.float())).to(dtype)


@dataclass
class LinearState:
    """One Gated DeltaNet layer's state after a sequence's kept tokens."""

    conv: torch.Tensor  # [channels, kernel - 1]: the convolution's last inputs, oldest first
    recurrent: torch.Tensor  # [value heads, key dim, value dim], float32


@dataclass
class RowInputs:
    """What one layer's rule read for each row of a segment: enough to rebuild a kept path's
    state (`keep`) without the projections."""

    conv: torch.Tensor  # [rows, channels]: the convolution's inputs
    q: torch.Tensor  # [rows, key heads, dk], float32 (as the rule reads them)
    k: torch.Tensor
    v: torch.Tensor  # [rows, value heads, dv]
    beta: torch.Tensor  # [rows, value heads]
    g: torch.Tensor


@dataclass
class LastSegment:
    """A segment whose rows `keep` may cut: where it started, each layer's state before it and
    what each row read."""

    start: int
    rows: int
    chain: bool  # its rows a chain (then the state after its last row is already kept)
    before: list[LinearState]
    inputs: list[RowInputs]


@dataclass
class RecurrentSequence:
    """A sequence on `GatedDeltaNetForward`: the full-attention layers' KV cache and each
    linear layer's state after its kept tokens."""

    kv: SequenceKV
    linear: list[LinearState]
    length: int = 0
    last: LastSegment | None = None

    def reserve(self, rows: int) -> None:
        self.kv.reserve(rows)


def text_rope(rotary: torch.nn.Module, hidden: torch.Tensor, positions: list[int]
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of rows at `positions`. Qwen3.5's multimodal rotary takes (temporal,
    height, width) positions: text has the three equal, which makes it the plain rotary
    embedding of the position."""
    where = torch.tensor(positions, device=hidden.device)[None]
    return rotary(hidden, where[None].expand(3, 1, -1))


def layer_mlp(mlp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A layer's MLP over rows x [1, t, d]. A mixture of experts (Qwen3.5-MoE's sparse
    block) multiplies the rows routed to an expert together with PyTorch's matmul, whose
    sums may depend on how many rows there are (oneDNN picks kernels by shape; not seen on
    the Intel Xeon this was written on, not promised elsewhere): its rows go one at a time,
    so a row's bits are the same in a tree, a prompt or a one-token step on any CPU."""
    if not hasattr(mlp, "experts") or x.shape[1] == 1:
        return mlp(x)
    return torch.cat([mlp(x[:, row:row + 1]) for row in range(x.shape[1])], dim=1)


class LayerCache:
    """What transformers' attention module calls `update` on: writes one segment's keys and
    values into the sequence's KV buffer and returns every key and value the rows see."""

    def __init__(self, kv: SequenceKV, layer: int, start: int) -> None:
        self.kv, self.layer, self.start = kv, layer, start

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, **_) -> tuple:
        rows = keys.shape[2]  # [1, kv_heads, rows, head_dim]
        self.kv.write(self.layer, self.start, keys[0].transpose(0, 1), values[0].transpose(0, 1))
        return self.kv.view(self.layer, self.start + rows)


class GatedDeltaNetForward:
    """The target forward (`decoding/forward.py`'s interface) for Qwen3.5's text models."""

    @classmethod
    def takes(cls, model: PreTrainedModel) -> bool:
        config = model.config
        if config.model_type not in ARCHITECTURES:
            return False
        if not type(model).__module__.startswith("transformers.models."):
            return False
        decoder = getattr(model, "model", None)
        return decoder is not None and all(hasattr(decoder, name) for name in
                                           ("embed_tokens", "layers", "norm", "rotary_emb"))

    def __init__(self, model: PreTrainedModel) -> None:
        self.model, self.decoder, config = model, model.model, model.config
        self.dtype, self.device = activation_dtype(model), self.decoder.norm.weight.device
        self.full_layers = [i for i, kind in enumerate(config.layer_types)
                            if kind == "full_attention"]
        self.kv_index = {layer: i for i, layer in enumerate(self.full_layers)}
        self.linear_layers = [i for i, kind in enumerate(config.layer_types)
                              if kind == "linear_attention"]
        self.linear_index = {layer: i for i, layer in enumerate(self.linear_layers)}
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or \
            config.hidden_size // config.num_attention_heads

    def new_sequence(self) -> RecurrentSequence:
        linear = []
        for index in self.linear_layers:
            mixer = self.decoder.layers[index].linear_attn
            conv = torch.zeros(mixer.conv_dim, mixer.conv_kernel_size - 1, dtype=self.dtype,
                               device=self.device)
            recurrent = torch.zeros(mixer.num_v_heads, mixer.head_k_dim, mixer.head_v_dim,
                                    dtype=torch.float32, device=self.device)
            linear.append(LinearState(conv, recurrent))
        kv = SequenceKV(len(self.full_layers), self.kv_heads, self.head_dim, self.dtype,
                        self.device)
        return RecurrentSequence(kv, linear)

    def keep(self, sequence: RecurrentSequence, prefix_len: int, kept_rows: list[int]) -> None:
        """Keep the first `prefix_len` tokens and the last segment's rows `kept_rows` (a path
        from its first row): those KV rows, and each linear layer's state after them."""
        last = sequence.last
        if last is None or prefix_len != last.start or any(
                not 0 <= row < last.rows for row in kept_rows):
            raise ValueError("a recurrent state keeps a path of the last verified segment only")
        if not (last.chain and kept_rows == list(range(last.rows))):  # else: kept already
            sequence.linear = [self._state_along(mixer_index, last, kept_rows)
                               for mixer_index in range(len(self.linear_layers))]
        sequence.kv.keep(prefix_len, kept_rows)
        sequence.length = sequence.kv.length = prefix_len + len(kept_rows)
        sequence.last = None

    def _state_along(self, index: int, last: LastSegment, path: list[int]) -> LinearState:
        """Layer `index`'s state after the rows `path` (a chain from the segment's start)."""
        before = last.before[index]
        if not path:
            return before
        mixer = self.decoder.layers[self.linear_layers[index]].linear_attn
        inputs = last.inputs[index]
        rows = torch.tensor(path, device=self.device)
        _, recurrent = delta_rule(
            list(range(-1, len(path) - 1)), inputs.q[rows], inputs.k[rows], inputs.v[rows],
            inputs.beta[rows], inputs.g[rows], before.recurrent,
            getattr(mixer, TILED_VALUE_HEADS, False), last=True)
        conv = torch.cat([before.conv, inputs.conv[rows].T], dim=1)
        return LinearState(conv[:, conv.shape[1] - before.conv.shape[1]:].clone(), recurrent)

    @torch.inference_mode()
    def __call__(self, segments: list[Segment]) -> list[SegmentOutput]:
        hidden_rows, bounds = [], [0]
        for segment in segments:
            hidden_rows.append(self._segment(segment))
            bounds.append(bounds[-1] + len(segment))
        return split_outputs(self.model, segments, bounds, torch.cat(hidden_rows))

    def _segment(self, segment: Segment) -> torch.Tensor:
        """One segment's last-layer hidden rows [t, d] (after the final norm)."""
        sequence: RecurrentSequence = segment.sequence
        if sequence.length != segment.start:
            raise ValueError(f"the segment starts at {segment.start}, the sequence holds "
                             f"{sequence.length} tokens")
        rows = len(segment)
        sequence.reserve(segment.start + rows)
        ids = torch.tensor(segment.token_ids, dtype=torch.long, device=self.device)
        hidden = self.decoder.embed_tokens(ids)[None]  # [1, t, d]
        rope = text_rope(self.decoder.rotary_emb, hidden, segment.positions())
        mask = self._mask(segment)
        parents = self._parents(segment)
        chain = parents == list(range(-1, rows - 1))
        kept: list[LinearState] = []
        inputs: list[RowInputs] = []
        for index, layer in enumerate(self.decoder.layers):
            normed = layer.input_layernorm(hidden)
            if index in self.kv_index:
                cache = LayerCache(sequence.kv, self.kv_index[index], segment.start)
                mixed, _ = layer.self_attn(hidden_states=normed, position_embeddings=rope,
                                           attention_mask=mask, cache=cache)
            else:
                state = sequence.linear[self.linear_index[index]]
                mixed, read, after = self._linear(layer.linear_attn, normed[0], state, parents,
                                                  chain)
                inputs.append(read)
                kept.append(after)
                mixed = mixed[None]
            hidden = hidden + mixed
            hidden = hidden + layer_mlp(layer.mlp, layer.post_attention_layernorm(hidden))
        # a segment whose rows are verified (logits of every row) may be cut by `keep`: its
        # rows' inputs stay until then; a chain's end state is kept at once (a prompt chunk's
        # is final), a tree's only once `keep` picks its path
        sequence.last = (LastSegment(segment.start, rows, chain, sequence.linear, inputs)
                         if segment.logits_rows == "all" else None)
        if chain:
            sequence.linear = kept
        sequence.length = sequence.kv.length = segment.start + rows
        return self.decoder.norm(hidden)[0]

    def _mask(self, segment: Segment) -> torch.Tensor:
        """The additive [1, 1, t, start + t] mask: every cached token, and the rows on the
        row's own path (a chain: the rows before it)."""
        within = segment.ancestors
        if within is None:
            within = torch.ones(len(segment), len(segment), dtype=torch.bool,
                                device=self.device).tril()
        return additive_mask(segment.start, within, self.dtype)

    @staticmethod
    def _parents(segment: Segment) -> list[int]:
        """Each row's parent row (-1: the sequence's kept state). A tree lists a node after its
        parent, so a row's parent is its ancestor of highest index."""
        if segment.ancestors is None:
            return list(range(-1, len(segment) - 1))
        parents = []
        for row, seen in enumerate(segment.ancestors.tolist()):
            before = [j for j in range(row) if seen[j]]
            parents.append(before[-1] if before else -1)
        return parents

    def _linear(self, mixer, x: torch.Tensor, state: LinearState, parents: list[int],
                chain: bool) -> tuple[torch.Tensor, RowInputs, LinearState | None]:
        """A Gated DeltaNet layer over one segment's rows x [t, d]: its output [t, d], what the
        rule read for each row, and (a chain) the state after the last row."""
        rows = x.shape[0]
        conv_in = mixer.in_proj_qkv(x)  # [t, channels]
        gate = mixer.in_proj_z(x).reshape(rows, -1, mixer.head_v_dim)
        beta = row_sigmoid(mixer.in_proj_b(x).float())  # [t, value heads]
        g = -mixer.A_log.float().exp() * row_softplus(mixer.in_proj_a(x).float()
                                                      + mixer.dt_bias.float())
        # Each row's convolution window: the K-1 inputs before it on its own path (the kept
        # ones where the path is shorter), then its own. Summed tap by tap in one order, an
        # element-wise op per tap: a row's bits do not depend on the other rows.
        width = state.conv.shape[1]
        inputs = torch.cat([state.conv.T.to(conv_in.dtype), conv_in])  # kept first
        window = torch.empty(rows, width + 1, dtype=torch.long)
        for row, parent in enumerate(parents):
            window[row, width] = width + row
            window[row, :width] = (window[parent, 1:] if parent >= 0
                                   else torch.arange(width))
        taps = inputs[window.to(self.device)].float()  # [t, kernel, channels]
        weight = mixer.conv1d.weight.float()[:, 0, :]  # [channels, kernel]
        mixed = taps[:, 0] * weight[:, 0]
        for tap in range(1, width + 1):
            mixed = mixed + taps[:, tap] * weight[:, tap]
        mixed = row_silu(mixed).to(x.dtype)  # as transformers rounds it: to the model's dtype
        q, k, v = mixed.split([mixer.key_dim, mixer.key_dim, mixer.value_dim], dim=-1)
        read = RowInputs(conv_in, q.reshape(rows, -1, mixer.head_k_dim).float(),
                         k.reshape(rows, -1, mixer.head_k_dim).float(),
                         v.reshape(rows, -1, mixer.head_v_dim).float(), beta, g)
        out, recurrent = delta_rule(parents, read.q, read.k, read.v, beta, g, state.recurrent,
                                    getattr(mixer, TILED_VALUE_HEADS, False), last=chain)
        after = None
        if chain:
            conv = inputs[inputs.shape[0] - width:].T.contiguous()
            after = LinearState(conv, recurrent)
        # [t, value heads, value dim] -> gated norm per head -> [t, d]
        out = gated_norm(mixer.norm, out.to(x.dtype).reshape(-1, mixer.head_v_dim),
                         gate.reshape(-1, mixer.head_v_dim))
        return mixer.out_proj(out.reshape(rows, -1)), read, after
