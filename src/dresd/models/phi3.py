"""A Phi-3 transformers folder as the Mistral model that computes the same (`spec.PHI3`).

transformers' `Phi3ForCausalLM` keeps q, k and v in one projection (`qkv_proj`) and the MLP's
gate and up in another (`gate_up_proj`, gate first), and splits their outputs. Splitting the
weights by rows instead gives Mistral's modules (RMSNorm, SiLU-gated MLP, the rope on the whole
head, the window on every layer where the config sets one), which the C decoder runs; a
`phi3` GGUF file is read into the same model (`gguf.phi3_config`). Each output row is the same
dot product either way, so nothing is approximated.

Two things about Phi-3's rope Mistral's module does not do; `RotaryByPosition` does them:

- **LongRoPE** (Phi-3-mini-128k, Phi-3.5-mini, Phi-4-mini): each turned pair's frequency divided
  by a factor, the short factors' below the original context (4,096) and the long factors'
  from it, cos and sin times an attention factor. transformers picks one set per call, by the
  call's last position, which would make a row's bits depend on the rows beside it; here a
  row's set is its own position's: what transformers gives when the call holds that row alone,
  as its `generate` decodes (so dresd's tokens are transformers' whenever the prompt fits in
  the original context; llama.cpp picks one set per context size, the long where it is over
  the original).
- **A partial rotary factor** (Phi-4-mini's 0.75: 96 of 128 dimensions turned). transformers
  turns pairs (i, i + 48) of the first 96 and leaves the rest. The C decoder turns pairs
  (i, i + 64) of the whole head; so each head's q and k dimensions are stored reordered
  (`turned_pairs_apart`: the turned halves at 0 and 64, the untouched ones after each), with
  cos 1 and sin 0 on the untouched ones: x * 1 + y * 0 is x exactly. q . k then adds the same
  products in another order (in float32, as the attention kernel's order is its own anyway);
  v, and so the attention's output, is not reordered.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from transformers import MistralConfig, MistralForCausalLM, PreTrainedModel

from dresd.errors import DresdError


def runs_as_mistral(model: PreTrainedModel) -> bool:
    """Whether `model` is a Phi-3 model Mistral's layers compute: its rope plain or LongRoPE,
    on the whole head or a part of it (`rope_of_config`)."""
    if model.config.model_type != "phi3":
        return False
    try:
        rope_of_config(model.config)
    except DresdError:
        return False
    return True


def rope_of_config(config) -> dict:
    """A Phi3Config's rope as `RotaryByPosition` takes it (also what a GGUF file's reader gives,
    `gguf.phi3_config`): JSON values, kept on the Mistral config as `phi3_rope`."""
    rope = config.rope_parameters or {}
    kind = rope.get("rope_type", "default")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    turned = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    if kind not in ("default", "longrope"):
        raise DresdError(f"a Phi-3 rope of type {kind!r} is not one dresd runs "
                         "(it runs plain rope and LongRoPE)")
    if kind == "default":
        return check_rope(head_dim, {"turned": turned})
    original = rope["original_max_position_embeddings"]
    factor = rope.get("factor") or config.max_position_embeddings / original
    attention = rope.get("attention_factor")
    if attention is None:  # transformers' default, as `_compute_longrope_parameters` has it
        attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
    return check_rope(head_dim, {
        "turned": turned, "short_factor": [float(f) for f in rope["short_factor"]],
        "long_factor": [float(f) for f in rope["long_factor"]],
        "original_max_position_embeddings": int(original), "attention_factor": float(attention)})


def check_rope(head_dim: int, rope: dict) -> dict:
    """`rope`, where `RotaryByPosition` can turn a head of `head_dim` by it; else a DresdError."""
    turned = rope["turned"]
    if not (0 < turned <= head_dim and turned % 2 == 0 and (head_dim - turned) % 2 == 0):
        raise DresdError(f"a rope turning {turned} of each head's {head_dim} dimensions is "
                         "not one dresd runs")
    for name in ("short_factor", "long_factor"):
        factors = rope.get(name)
        if factors is not None and (len(factors) != turned // 2
                                    or not all(f > 0 for f in factors)):
            raise DresdError(f"LongRoPE's {name}: {len(factors)} factors for {turned // 2} "
                             "turned pairs, or factors that are not positive")
    return rope


def turned_pairs_apart(head_dim: int, turned: int) -> np.ndarray:
    """For each dimension of a head as stored here, the model's own dimension: the model turns
    pairs (i, i + turned/2) of its first `turned` and leaves the rest; stored in this order, the
    turned pairs are (i, i + head_dim/2), the pairs the C decoder turns, and the untouched
    dimensions fill each half after them."""
    half, rest = turned // 2, (head_dim - turned) // 2
    return np.concatenate([np.arange(half), turned + np.arange(rest),
                           half + np.arange(half), turned + rest + np.arange(rest)])


def head_rows(heads: int, head_dim: int, rope: dict) -> np.ndarray | None:
    """The q (or k) projection's rows in the order its heads are stored here, or None where
    that is the model's own (the rope turns the whole head)."""
    if rope["turned"] == head_dim:
        return None
    order = turned_pairs_apart(head_dim, rope["turned"])
    return (np.arange(heads)[:, None] * head_dim + order[None, :]).reshape(-1)


def own_rotary(config: MistralConfig) -> RotaryByPosition | None:
    """The rotary embedding a Phi-3 model read as Mistral's needs (`config.phi3_rope`), or None
    where Mistral's own computes the same (plain rope on the whole head)."""
    rope = getattr(config, "phi3_rope", None)
    if rope is None or (rope.get("short_factor") is None and rope["turned"] == config.head_dim):
        return None
    return RotaryByPosition(rope, config.head_dim, config.rope_parameters["rope_theta"])


class RotaryByPosition(torch.nn.Module):
    """cos and sin [batch, rows, head_dim] of each row's position alone (module docstring), as
    transformers' Phi3RotaryEmbedding computes them for a call holding that row, laid out for
    heads stored in `turned_pairs_apart`'s order: cos 1 and sin 0 on the untouched dimensions."""

    def __init__(self, rope: dict, head_dim: int, base: float) -> None:
        super().__init__()
        turned = rope["turned"]
        self.head_dim, self.turned = head_dim, turned
        # transformers' formula, term for term, so every frequency has its bits
        shape = torch.arange(0, turned, 2, dtype=torch.int64).float() / turned
        self.original, self.scaling = None, 1.0
        short = long = 1.0 / (base ** shape)
        if rope.get("short_factor") is not None:
            short, long = (1.0 / (torch.tensor(rope[name], dtype=torch.float32) * base ** shape)
                           for name in ("short_factor", "long_factor"))
            self.original = rope["original_max_position_embeddings"]
            self.scaling = rope["attention_factor"]
        # float32 always (as buffers, a model's .to(bfloat16) would round them)
        self.short, self.long = short, long

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        positions = position_ids[..., None]
        frequencies = positions.float() * self.short.to(x.device)
        if self.original is not None:  # LongRoPE: the long factors from the original context on
            frequencies = torch.where(positions >= self.original,
                                      positions.float() * self.long.to(x.device), frequencies)
        cos, sin = frequencies.cos() * self.scaling, frequencies.sin() * self.scaling
        rest = (self.head_dim - self.turned) // 2
        if rest:
            ones = torch.ones(*cos.shape[:-1], rest, dtype=cos.dtype, device=cos.device)
            cos, sin = torch.cat([cos, ones], dim=-1), torch.cat([sin, 0 * ones], dim=-1)
        return (torch.cat([cos, cos], dim=-1).to(x.dtype),
                torch.cat([sin, sin], dim=-1).to(x.dtype))


def as_mistral(model: PreTrainedModel) -> PreTrainedModel:
    """`model` (a Phi-3 model `runs_as_mistral` takes) as a `MistralForCausalLM` holding the
    same tensors, the fused ones split by rows (views: nothing is copied, but q and k where a
    partial rotary factor reorders their heads' rows)."""
    config = model.config
    heads, hidden = config.num_attention_heads, config.hidden_size
    head_dim = hidden // heads
    rope = rope_of_config(config)
    mistral_config = MistralConfig(
        vocab_size=config.vocab_size, hidden_size=hidden,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=head_dim,
        sliding_window=config.sliding_window or None,
        rope_parameters={"rope_type": "default",
                         "rope_theta": config.rope_parameters["rope_theta"]},
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        hidden_act=config.hidden_act, tie_word_embeddings=config.tie_word_embeddings,
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id)
    mistral_config.phi3_rope = rope
    kv_heads = config.num_key_value_heads
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    q_rows, k_rows = head_rows(heads, head_dim, rope), head_rows(kv_heads, head_dim, rope)
    weights = {}
    for name, value in model.state_dict().items():
        if name.endswith("self_attn.qkv_proj.weight"):
            prefix = name.removesuffix("qkv_proj.weight")
            q, k, v = value.split([q_size, kv_size, kv_size])
            if q_rows is not None:  # a partial rotary factor: heads stored reordered (copies)
                q, k = q[torch.from_numpy(q_rows)], k[torch.from_numpy(k_rows)]
            weights.update({prefix + "q_proj.weight": q, prefix + "k_proj.weight": k,
                            prefix + "v_proj.weight": v})
        elif name.endswith("mlp.gate_up_proj.weight"):
            prefix = name.removesuffix("gate_up_proj.weight")
            gate, up = value.chunk(2)
            weights.update({prefix + "gate_proj.weight": gate, prefix + "up_proj.weight": up})
        else:
            weights[name] = value
    with torch.device("meta"):
        mistral = MistralForCausalLM(mistral_config)
    mistral.load_state_dict(weights, assign=True)
    if config.tie_word_embeddings:
        mistral.tie_weights()
    decoder = mistral.model
    with torch.device("cpu"):  # its frequencies, computed (they are no weights)
        decoder.rotary_emb = (own_rotary(mistral_config)
                              or type(decoder.rotary_emb)(config=mistral_config))
    mistral.generation_config = model.generation_config
    return mistral.eval()
