"""Named presets: the config.json facts of the released models, plus tiny configs for tests.

Each preset is the relevant part of the model's published ``config.json``, parsed by the same code
that reads a downloaded checkpoint (``from_hf_config``), so a preset and the checkpoint agree.
"""

from __future__ import annotations

import copy
from typing import Any

from .config import ModelConfig, from_hf_config

__all__ = ["PRESETS", "get_preset", "preset_hf_config", "list_presets"]

_QWEN3_COMMON = {
    "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "head_dim": 128,
    "hidden_act": "silu", "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "rope_scaling": None, "attention_bias": False, "use_sliding_window": False, "sliding_window": None,
    "max_window_layers": 28, "bos_token_id": 151643, "eos_token_id": 151645,
}


def _qwen3(**shape) -> dict[str, Any]:
    return {**_QWEN3_COMMON, **shape}


def _gemma4_31b() -> dict[str, Any]:
    # Text config of google/gemma-4-31B: 60 layers, every sixth global (5 sliding : 1 global).
    types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(60)]
    return {
        "model_type": "gemma4_text", "architectures": ["Gemma4ForCausalLM"], "vocab_size": 262144,
        "hidden_size": 5376, "intermediate_size": 21504, "num_hidden_layers": 60, "num_attention_heads": 32,
        "num_key_value_heads": 16, "head_dim": 256, "global_head_dim": 512, "num_global_key_value_heads": 4,
        "attention_k_eq_v": True, "sliding_window": 1024, "layer_types": types,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
        },
        "final_logit_softcapping": 30.0, "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
        "max_position_embeddings": 262144, "tie_word_embeddings": True, "hidden_size_per_layer_input": 0,
        "vocab_size_per_layer_input": 262144, "num_kv_shared_layers": 0, "enable_moe_block": False,
        "use_double_wide_mlp": False, "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 1,
    }


def _tiny_gemma4(**over) -> dict[str, Any]:
    base = {
        "model_type": "gemma4_text", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "global_head_dim": 32, "num_global_key_value_heads": 1, "attention_k_eq_v": True, "sliding_window": 6,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
        },
        "final_logit_softcapping": 30.0, "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True, "hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 256,
        "num_kv_shared_layers": 0, "enable_moe_block": False, "use_double_wide_mlp": False,
        "max_position_embeddings": 4096, "pad_token_id": 0,
    }
    base.update(over)
    return base


PRESETS: dict[str, dict[str, Any]] = {
    # Released models (config.json facts).
    "qwen3-0.6b": _qwen3(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                         num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-1.7b": _qwen3(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                         num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-4b": _qwen3(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                       num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-8b": _qwen3(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                       num_key_value_heads=8, tie_word_embeddings=False),
    "qwen3-30b-a3b": _qwen3(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_size=2048,
                            intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                            num_attention_heads=32, num_key_value_heads=4, num_experts=128, num_experts_per_tok=8,
                            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                            router_aux_loss_coef=0.001, tie_word_embeddings=False),
    "gemma4-31b": _gemma4_31b(),
    # Tiny test configs (2-5 layers, hidden 64, vocab 256).
    "tiny-qwen3": _qwen3(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
                         max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
    "tiny-qwen3-moe": _qwen3(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=256,
                             hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                             num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
                             router_aux_loss_coef=0.001, rope_theta=10000.0, max_position_embeddings=4096,
                             tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
    "tiny-gemma4": _tiny_gemma4(),
    # Per-layer inputs, KV sharing (last 2 layers) with double-wide MLPs, separate v projections.
    "tiny-gemma4-e": _tiny_gemma4(
        num_hidden_layers=5, attention_k_eq_v=False, num_global_key_value_heads=None,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention", "full_attention"],
        hidden_size_per_layer_input=16, num_kv_shared_layers=2, use_double_wide_mlp=True, final_logit_softcapping=None),
    "tiny-gemma4-moe": _tiny_gemma4(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32),
}


def list_presets() -> list[str]:
    return sorted(PRESETS)


def preset_hf_config(name: str) -> dict[str, Any]:
    """The config.json dict behind a preset (a copy)."""
    if name not in PRESETS:
        raise ValueError(f"preset: expected one of {list_presets()}, got {name!r}")
    return copy.deepcopy(PRESETS[name])


def get_preset(name: str) -> ModelConfig:
    """The ModelConfig of a named preset."""
    return from_hf_config(preset_hf_config(name))
