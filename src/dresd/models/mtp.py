"""A Qwen3.5 file's multi-token prediction block (MTP, llama.cpp's "NextN"): one more decoder
layer the model was trained with to guess the token after next, which `drafters/mtp.py` drafts
with.

From the target's hidden state h_i at position i (after its final norm: the state that
predicted token x_{i+1}) and that token, the block computes, as llama.cpp's `graph_mtp` does:

    e  = enorm(embed(x_{i+1}))                       RMSNorm (1 + weight), as the model's norms
    u  = eh_proj([e, hnorm(h_i)])                    [2d] -> [d]: embedding first, then state
    u' = layer(u) at position i                      a full-attention Qwen3.5 layer (gated q,
                                                     q/k norms, partial rope) on a KV cache of
                                                     its own, then the layer's MLP
    h' = shared_head_norm(u')                        (the model's final norm where the file has
                                                     none of its own)
    logits = head(h')                                (the model's LM head where none of its own)

h' is the state the next guess starts from: drafting k tokens chains the block k times. The
block's cache holds one row per position it was given (the positions the loop reports back),
so its attention sees the generation as the drafter saw it. The block only drafts: every
drafted token is verified by the model itself, so nothing here can change an output.
"""

from __future__ import annotations

import torch

from dresd.decoding.kv_cache import SequenceKV
from dresd.decoding.recurrent import LayerCache, layer_mlp, text_rope
from dresd.decoding.segments import additive_mask


class MultiTokenPredictor(torch.nn.Module):
    """The block's modules (each filled from the file by `models/gguf.mtp_block`)."""

    def __init__(self, embed: torch.nn.Module, enorm: torch.nn.Module, hnorm: torch.nn.Module,
                 eh_proj: torch.nn.Module, layer: torch.nn.Module, head_norm: torch.nn.Module,
                 head: torch.nn.Module, rotary: torch.nn.Module) -> None:
        super().__init__()
        self.embed, self.enorm, self.hnorm, self.eh_proj = embed, enorm, hnorm, eh_proj
        self.layer, self.head_norm, self.head = layer, head_norm, head
        self.rotary = rotary  # the model's own rotary embedding (no weights: shared)
        attention = layer.self_attn
        self.kv_heads, self.head_dim = attention.config.num_key_value_heads, attention.head_dim

    def new_cache(self) -> SequenceKV:
        dtype, device = self.head_norm.weight.dtype, self.head_norm.weight.device
        return SequenceKV(1, self.kv_heads, self.head_dim, dtype, device)

    @torch.inference_mode()
    def forward(self, cache: SequenceKV, start: int, tokens: list[int], states: torch.Tensor,
                positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows for (state, token) pairs [t, d] at `positions`, written to the cache at rows
        start .. start + t - 1 (a chain: each row sees the cache before `start` and the rows
        before it). Returns each row's h' [t, d] and logits [t, vocab]."""
        rows = len(tokens)
        cache.reserve(start + rows)
        ids = torch.tensor(tokens, dtype=torch.long, device=states.device)
        joined = torch.cat([self.enorm(self.embed(ids)), self.hnorm(states.to(
            self.head_norm.weight.dtype))], dim=-1)
        hidden = self.eh_proj(joined)[None]  # [1, t, d]
        rope = text_rope(self.rotary, hidden, positions)
        mask = None
        if rows > 1 or start > 0:
            causal = torch.ones(rows, rows, dtype=torch.bool, device=states.device).tril()
            mask = additive_mask(start, causal, hidden.dtype)
        layer = self.layer
        attended, _ = layer.self_attn(hidden_states=layer.input_layernorm(hidden),
                                      position_embeddings=rope, attention_mask=mask,
                                      cache=LayerCache(cache, 0, start))
        hidden = hidden + attended
        hidden = hidden + layer_mlp(layer.mlp, layer.post_attention_layernorm(hidden))
        cache.length = start + rows
        out = self.head_norm(hidden)[0]
        return out, self.head(out).float()
