"""models/spec.py: each declared architecture says what transformers' own model of that type
computes (checked on the modules transformers builds, not on our reading of them), and the C
decoder and the forwards take their form from the spec."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from dresd.decoding.forward import LlamaForward
from dresd.decoding.recurrent import ARCHITECTURES as RECURRENT_MODEL_TYPES
from dresd.kernels.decoder import ACTIVATIONS, LayerForm
from dresd.models import spec
from dresd.models.gguf_file import GGUFError
from dresd.models.spec import Architecture

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            # mixtures of experts
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
            # Qwen3.5's Gated DeltaNet layers
            linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
            linear_value_head_dim=8)


def tiny_model(model_type: str) -> torch.nn.Module:
    config = AutoConfig.for_model(model_type, **TINY)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def multiplies_by_one_plus_weight(norm: torch.nn.Module) -> bool:
    """Whether an RMSNorm class scales by (1 + weight): with a zero weight its output is then
    x / rms(x), not zero."""
    real = type(norm)(8, eps=1e-6)
    real.weight.data.zero_()
    return bool(real(torch.randn(2, 8)).abs().sum() > 0)


@pytest.mark.parametrize("arch", spec.ARCHITECTURES, ids=lambda arch: arch.gguf)
def test_each_spec_says_what_transformers_model_computes(arch: Architecture) -> None:
    for model_type in arch.model_types:
        model = tiny_model(model_type)
        config, layers = model.config, model.model.layers
        activation = getattr(config, "hidden_activation", None) or config.hidden_act
        assert activation == arch.activation, model_type
        attention_layers = [layer for layer in layers if hasattr(layer, "self_attn")]
        assert attention_layers, model_type
        for layer in attention_layers:
            has_head_norms = hasattr(layer.self_attn, "q_norm") and hasattr(layer.self_attn,
                                                                             "k_norm")
            assert has_head_norms == arch.head_norms, model_type
        for layer in layers:
            assert hasattr(layer, "post_feedforward_layernorm") == arch.out_norms, model_type
            assert hasattr(layer.mlp, "experts") == arch.moe, model_type
            assert hasattr(layer.mlp, "shared_expert") == (arch.experts == "routed+shared")
            modules = [module for _, module in arch.layer_norms]
            assert all(hasattr(layer, module) for module in modules), model_type
        assert multiplies_by_one_plus_weight(layers[0].input_layernorm) == arch.norm_plus_one
        types = set(getattr(config, "layer_types", None) or ())
        assert ("linear_attention" in types) == arch.recurrent_layers, model_type
        assert ("sliding_attention" in types) <= arch.sliding_windows, model_type
        scale = getattr(model.model.embed_tokens, "embed_scale", None)
        assert (scale is not None) == arch.embedding_scale, model_type


def test_the_forwards_take_the_spec_model_types() -> None:
    c_decoder = {t for a in spec.ARCHITECTURES if a.forward == spec.C_DECODER
                 for t in a.model_types}
    assert set(LlamaForward.ARCHITECTURES) | set(LlamaForward.C_DECODER_ONLY) == c_decoder
    assert set(LlamaForward.C_DECODER_ONLY) == {"gemma3_text", "gpt_oss"}
    assert set(RECURRENT_MODEL_TYPES) == {"qwen3_5_text", "qwen3_5_moe_text"}
    assert len(spec.BY_GGUF) == len(spec.ARCHITECTURES)  # one spec a GGUF name
    assert len(spec.BY_MODEL_TYPE) == sum(len(a.model_types) for a in spec.ARCHITECTURES)


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "qwen3_moe", "gemma3_text"])
def test_the_c_decoders_layer_form_is_the_specs(model_type: str) -> None:
    model = tiny_model(model_type)
    arch = spec.BY_MODEL_TYPE[model_type]
    form = LayerForm.of(model.model, model.config)
    assert form is not None
    assert form.norm_plus_one == arch.norm_plus_one
    assert form.activation == ACTIVATIONS[arch.activation]
    assert form.out_norms == arch.out_norms
    assert any(form.windowed) == ("sliding_attention" in (getattr(model.config, "layer_types",
                                                                  None) or ()))
    # a config that asks for another activation than its spec's layers compute: no C form
    model.config.hidden_act = model.config.hidden_activation = "relu"
    assert LayerForm.of(model.model, model.config) is None


def test_a_model_type_without_a_spec_has_no_c_form() -> None:
    model = tiny_model("llama")
    model.config.model_type = "not_declared"
    assert LayerForm.of(model.model, model.config) is None
    assert spec.of_config(model.config) is None


def test_an_undeclared_gguf_architecture_is_one_error_naming_it() -> None:
    with pytest.raises(spec.ArchitectureError) as raised:
        spec.of_gguf("gptoss", "model.gguf")
    message = str(raised.value)
    assert "model.gguf" in message and "'gptoss'" in message
    assert all(name in message for name in spec.GGUF_NAMES)
    assert not issubclass(GGUFError, spec.ArchitectureError)  # each its own class
