"""A Phi-3 transformers folder as the Mistral model that computes the same (`spec.PHI3`).

transformers' `Phi3ForCausalLM` keeps q, k and v in one projection (`qkv_proj`) and the MLP's
gate and up in another (`gate_up_proj`, gate first), and splits their outputs. Splitting the
weights by rows instead gives Mistral's modules (RMSNorm, SiLU-gated MLP, the rope on the whole
head, the window on every layer where the config sets one), which the C decoder runs; a
`phi3` GGUF file is read into the same model (`gguf.phi3_config`). Each output row is the same
dot product either way, so nothing is approximated.
"""

from __future__ import annotations

import torch
from transformers import MistralConfig, MistralForCausalLM, PreTrainedModel


def runs_as_mistral(model: PreTrainedModel) -> bool:
    """Whether `model` is a Phi-3 model Mistral's layers compute: its rope turns the whole of
    each head (not Phi-4-mini's partial rotary factor) with fixed frequencies (not LongRoPE,
    which changes them with the longest position in a call)."""
    config = model.config
    if config.model_type != "phi3":
        return False
    rope = config.rope_parameters or {}
    return (rope.get("rope_type", "default") == "default"
            and rope.get("partial_rotary_factor", 1.0) == 1.0)


def as_mistral(model: PreTrainedModel) -> PreTrainedModel:
    """`model` (a Phi-3 model `runs_as_mistral` takes) as a `MistralForCausalLM` holding the
    same tensors, the fused ones split by rows (views: nothing is copied)."""
    config = model.config
    heads, hidden = config.num_attention_heads, config.hidden_size
    head_dim = hidden // heads
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
    q_size, kv_size = heads * head_dim, config.num_key_value_heads * head_dim
    weights = {}
    for name, value in model.state_dict().items():
        if name.endswith("self_attn.qkv_proj.weight"):
            prefix = name.removesuffix("qkv_proj.weight")
            q, k, v = value.split([q_size, kv_size, kv_size])
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
        decoder.rotary_emb = type(decoder.rotary_emb)(config=mistral_config)
    mistral.generation_config = model.generation_config
    return mistral.eval()
