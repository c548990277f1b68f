"""Verifying draft trees over linear-attention layers: Qwen3.5's Gated DeltaNet.

Qwen3.5 (and its mixture of experts) interleaves full-attention layers, which keep a KV cache
like Llama's, with Gated DeltaNet layers, which keep a *recurrent state* instead: per layer a
matrix S [value heads, key dim, value dim] and the last K-1 inputs of a short causal
convolution. A token t updates them (gated delta rule, as transformers' reference computes it):

    S_t = exp(g_t) S_{t-1}                          decay
    S_t = S_t + k_t (beta_t (v_t - S_t^T k_t))^T    write v_t at key k_t, in proportion beta_t
    o_t = S_t^T q_t                                 read at the query

A KV cache keeps one entry per token, so a verify step writes every tree node and keeps the
accepted path's rows. A recurrent state has no entries to keep or drop: the state after a node
is a function of every token on its path. So here each tree node gets its own state, computed
from its parent's (node 0's parent: the state after the sequence's last kept token), and after
verification the state of the last accepted node becomes the sequence's; the other nodes'
states are dropped, so a rejected branch leaves no trace. The convolution's window follows the
same path: a node's window is its parent's with the node's input appended.

Each generated token's state is computed by the same function on the same inputs whether it
came from a one-token `ar` step or from a node of a verified tree (a row's projections do not
depend on the other rows: dresd's linears are row-invariant), so every method's output is
`ar`'s, and a sequence's output does not depend on which others share its step. A prompt chunk
is kept whole, so it runs transformers' chunked form of the same rule from the sequence's
state, as transformers prefills.

The full-attention layers run transformers' own attention module on this sequence's KV cache
(`_LayerCache`) with the tree's mask. Segments run one after another: the per-node recurrence
is a loop over a tree's rows, and batching sequences would not shorten it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from dresd.decoding.forward import Segment, SegmentOutput, _split_outputs, additive_mask
from dresd.decoding.kv_cache import SequenceKV

# transformers' model types whose decoder layers are Qwen3.5's (dense and mixture of experts)
ARCHITECTURES = ("qwen3_5_text", "qwen3_5_moe_text")
# layer types that keep a recurrent state instead of (or beside) a KV cache: a model with any
# of them but not run here has no exact draft verification in dresd (`refuse_recurrent`)
RECURRENT_LAYERS = ("linear_attention", "mamba", "mamba2", "conv", "recurrent")


def has_recurrent_layers(model: PreTrainedModel) -> bool:
    config = model.config.get_text_config(decoder=True)
    types = getattr(config, "layer_types", None) or ()
    return any(kind in RECURRENT_LAYERS for kind in types) or bool(
        getattr(config, "layers_block_type", None))


@dataclass
class LinearState:
    """One Gated DeltaNet layer's state after a sequence's kept tokens."""

    conv: torch.Tensor  # [channels, kernel - 1]: the convolution's last inputs, oldest first
    recurrent: torch.Tensor  # [value heads, key dim, value dim], float32


@dataclass
class RecurrentSequence:
    """A sequence on `GatedDeltaNetForward`: the full-attention layers' KV cache, each linear
    layer's state, and the states of the last segment's rows until `keep` picks one."""

    kv: SequenceKV
    linear: list[LinearState]  # after the sequence's tokens (the last segment's: all kept)
    length: int = 0
    # the last segment: where it started, each linear layer's state before it, and (a tree or
    # draft chain) each layer's state after each of its rows, until `keep` picks a path
    segment_start: int = 0
    before: list[LinearState] = field(default_factory=list)
    by_row: list[list[LinearState]] | None = None

    def reserve(self, rows: int) -> None:
        self.kv.reserve(rows)


class _LayerCache:
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
        # transformers' own functions of the rule (their torch forms), imported here: only a
        # Qwen3.5 model pays for the module
        from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

        self.rule_by_token = qwen.torch_recurrent_gated_delta_rule
        self.rule_by_chunk = qwen.torch_chunk_gated_delta_rule
        self.model, self.decoder, config = model, model.model, model.config
        parameter = next(model.parameters())
        self.dtype, self.device = parameter.dtype, parameter.device
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
        from its first row): those KV rows, and each linear layer's state after the last."""
        rows = sequence.length - sequence.segment_start
        if prefix_len != sequence.segment_start or any(not 0 <= r < rows for r in kept_rows):
            raise ValueError("a recurrent state keeps a path of its last segment only")
        if not kept_rows:
            sequence.linear = sequence.before
        elif sequence.by_row is not None:
            sequence.linear = [states[kept_rows[-1]] for states in sequence.by_row]
        elif kept_rows != list(range(rows)):
            raise ValueError("a prompt chunk's state is kept whole or not at all")
        sequence.kv.keep(prefix_len, kept_rows)
        sequence.length = sequence.kv.length = prefix_len + len(kept_rows)
        sequence.by_row = None

    @torch.inference_mode()
    def __call__(self, segments: list[Segment]) -> list[SegmentOutput]:
        hidden_rows, bounds = [], [0]
        for segment in segments:
            hidden_rows.append(self._segment(segment))
            bounds.append(bounds[-1] + len(segment))
        return _split_outputs(self.model, segments, bounds, torch.cat(hidden_rows))

    def _segment(self, segment: Segment) -> torch.Tensor:
        """One segment's last-layer hidden rows [t, d] (after the final norm); its sequence
        then holds the states after its rows (`by_row`, until `keep`)."""
        sequence: RecurrentSequence = segment.sequence
        if sequence.length != segment.start:
            raise ValueError(f"the segment starts at {segment.start}, the sequence holds "
                             f"{sequence.length} tokens")
        rows = len(segment)
        sequence.reserve(segment.start + rows)
        ids = torch.tensor(segment.token_ids, dtype=torch.long, device=self.device)
        hidden = self.decoder.embed_tokens(ids)[None]  # [1, t, d]
        positions = torch.tensor(segment.positions(), device=self.device)[None]
        # Qwen3.5's multimodal rotary takes (temporal, height, width) positions: text has the
        # three equal, which makes it the plain rotary embedding of the position
        rope = self.decoder.rotary_emb(hidden, positions[None].expand(3, 1, -1))
        mask = self._mask(segment)
        parents = self._parents(segment)
        by_row: list[list[LinearState]] = []
        for index, layer in enumerate(self.decoder.layers):
            normed = layer.input_layernorm(hidden)
            if index in self.kv_index:
                cache = _LayerCache(sequence.kv, self.kv_index[index], segment.start)
                mixed, _ = layer.self_attn(hidden_states=normed, position_embeddings=rope,
                                           attention_mask=mask, cache=cache)
            else:
                state = sequence.linear[self.linear_index[index]]
                mixed, states = self._linear(layer.linear_attn, normed[0], state, parents)
                by_row.append(states)
                mixed = mixed[None]
            hidden = hidden + mixed
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        # until `keep`, the sequence is as if every row were kept (a prompt chunk is)
        sequence.segment_start, sequence.before = segment.start, sequence.linear
        sequence.by_row = by_row if parents is not None else None
        sequence.linear = [states[-1] for states in by_row]
        sequence.length = sequence.kv.length = segment.start + rows
        return self.decoder.norm(hidden)[0]

    def _mask(self, segment: Segment) -> torch.Tensor:
        """The additive [1, 1, t, start + t] mask: every cached token, and the rows on the
        row's own path (a prompt chunk: the rows before it)."""
        within = segment.ancestors
        if within is None:
            within = torch.ones(len(segment), len(segment), dtype=torch.bool,
                                device=self.device).tril()
        return additive_mask(segment.start, within, self.dtype)

    @staticmethod
    def _parents(segment: Segment) -> list[int] | None:
        """Each row's parent row (-1: the sequence's kept state), or None for a prompt chunk
        (kept whole: the chunked rule). A tree lists a node after its parent, so a row's
        parent is its ancestor of highest index."""
        if segment.logits_rows != "all":
            return None
        if segment.ancestors is None:
            return list(range(-1, len(segment) - 1))
        parents = []
        for row, seen in enumerate(segment.ancestors.tolist()):
            before = [j for j in range(row) if seen[j]]
            parents.append(before[-1] if before else -1)
        return parents

    def _linear(self, mixer, x: torch.Tensor, state: LinearState, parents: list[int] | None
                ) -> tuple[torch.Tensor, list[LinearState]]:
        """A Gated DeltaNet layer over one segment's rows x [t, d]: its output [t, d] and the
        state after each row (`parents` None: the rows as one chain, the state after the last
        only, by transformers' chunked rule)."""
        rows = x.shape[0]
        inputs = mixer.in_proj_qkv(x)  # [t, channels]: the convolution's inputs
        gate = mixer.in_proj_z(x).reshape(rows, -1, mixer.head_v_dim)
        beta = mixer.in_proj_b(x).sigmoid()[None]  # [1, t, value heads]
        decay = (-mixer.A_log.float().exp() * F.softplus(mixer.in_proj_a(x).float()
                                                         + mixer.dt_bias))[None]
        weight = mixer.conv1d.weight  # [channels, 1, kernel]
        if parents is None:  # one chain: the window slides over the kept inputs, then these
            window = torch.cat([state.conv, inputs.T.to(state.conv.dtype)], dim=1)[None]
            mixed = F.silu(F.conv1d(window.to(weight.dtype), weight, groups=mixer.conv_dim))
            query, key, value = self._heads(mixer, mixed[0].T.to(x.dtype))
            out, recurrent = self.rule_by_chunk(
                query, key, value, g=decay, beta=beta, initial_state=state.recurrent,
                output_final_state=True, use_qk_l2norm_in_kernel=True)
            conv_tail = window[0, :, window.shape[2] - state.conv.shape[1]:]
            states = [LinearState(conv_tail.clone(), recurrent)]
        else:  # each row from its parent's state, as a one-token step computes it
            outs, states = [], []
            for row, parent in enumerate(parents):
                before = state if parent < 0 else states[parent]
                window = torch.cat([before.conv, inputs[row, :, None].to(before.conv.dtype)],
                                   dim=1)[None]  # [1, channels, kernel]
                mixed = F.silu(F.conv1d(window.to(weight.dtype), weight,
                                        groups=mixer.conv_dim))  # [1, channels, 1]
                query, key, value = self._heads(mixer, mixed[0].T.to(x.dtype))
                out, recurrent = self.rule_by_token(
                    query, key, value, g=decay[:, row:row + 1], beta=beta[:, row:row + 1],
                    initial_state=before.recurrent, output_final_state=True,
                    use_qk_l2norm_in_kernel=True)
                outs.append(out)
                states.append(LinearState(window[0, :, 1:], recurrent))
            out = torch.cat(outs, dim=1)
        # [1, t, value heads, value dim] -> gated norm per head -> [t, d]
        out = mixer.norm(out[0].reshape(-1, mixer.head_v_dim),
                         gate.reshape(-1, mixer.head_v_dim))
        return mixer.out_proj(out.reshape(rows, -1)), states

    @staticmethod
    def _heads(mixer, mixed: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The convolution's outputs [t, channels] as query, key [1, t, key heads, key dim]
        and value [1, t, value heads, value dim]."""
        query, key, value = mixed.split([mixer.key_dim, mixer.key_dim, mixer.value_dim], dim=-1)
        rows = mixed.shape[0]
        return (query.reshape(1, rows, -1, mixer.head_k_dim),
                key.reshape(1, rows, -1, mixer.head_k_dim),
                value.reshape(1, rows, -1, mixer.head_v_dim))
