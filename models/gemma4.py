"""Gemma-4 text model on the packed layout: the hybrid sliding/global block and config.json conversion.

Block (sandwich norms; ``moe`` runs beside the dense MLP where enabled; ``ple`` where the model
has per-layer inputs)::

    h = h + post_attn_norm(attn(input_norm(h)))
    m = mlp(pre_ff_norm(h))
    m = post_ff_norm_1(m) + post_ff_norm_2(experts(pre_ff_norm_2(h), router(h)))      # moe only
    h = h + post_ff_norm(m)
    h = h + post_ple_norm(ple_proj(act(ple_gate(h)) * per_layer_input))              # ple only
    h = h * layer_scalar

Attention per layer type: sliding layers (window, head dim 256, default RoPE theta 10K) and global
layers (no window, head dim 512 = ``global_head_dim``, K = V where ``attention_k_eq_v``, proportional
RoPE: 25% of the frequencies rotate, theta 1M). q and k get RMSNorm, v a scale-free RMSNorm, and
the softmax scale is 1.0. The last ``num_kv_shared_layers`` layers reuse the keys/values of the
last earlier layer of their type (and may use a double-wide MLP). Embeddings are scaled by
sqrt(hidden) rounded to the weight dtype; logits are soft-capped.

Shape legend: T tokens, D hidden, L layers, P per-layer input size, E experts, k experts per token.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .config import AttentionConfig, LayerConfig, MLPConfig, ModelConfig, MoEConfig, PerLayerInputConfig
from .layers import Attention, BlockInputs, BlockOutput, GatedMLP, RMSNorm, ScaledEmbedding, activation_fn
from .moe import Experts, Gemma4Router, router_stats
from .qwen3 import rope_from_hf, rope_to_hf

__all__ = ["Gemma4Block", "add_per_layer_input_modules", "per_layer_inputs", "HF_PARSERS", "to_hf_config"]

SLIDING, FULL = "sliding_attention", "full_attention"
_ACT = {"gelu_pytorch_tanh": "gelu_tanh", "silu": "silu"}


class Gemma4Block(nn.Module):
    """One Gemma-4 decoder layer (sliding or global attention; dense MLP, optionally + experts)."""

    def __init__(self, layer: LayerConfig, model: ModelConfig, keeps_kv: bool = False):
        super().__init__()
        D, eps = model.hidden_size, model.norm_eps
        self.keeps_kv = keeps_kv  # return this layer's K/V (later layers share them); otherwise None

        def norm():
            return RMSNorm(D, eps, "gemma4")

        self.input_layernorm = norm()
        self.self_attn = Attention(layer.attention, D, eps, "gemma4")
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = GatedMLP(D, layer.mlp.intermediate_size, layer.mlp.activation)
        self.post_feedforward_layernorm = norm()
        if layer.moe is not None:
            self.router = Gemma4Router(layer.moe, D, eps)
            self.experts = Experts(layer.moe, D)
            self.post_feedforward_layernorm_1 = norm()
            self.post_feedforward_layernorm_2 = norm()
            self.pre_feedforward_layernorm_2 = norm()
        if model.per_layer_input is not None:
            P = model.per_layer_input.size
            self.per_layer_act = activation_fn(layer.mlp.activation)
            self.per_layer_input_gate = nn.Linear(D, P, bias=False)
            self.per_layer_projection = nn.Linear(P, D, bias=False)
            self.post_per_layer_input_norm = norm()
        self.register_buffer("layer_scalar", torch.ones(1))

    def _feed_forward(self, h_TD: torch.Tensor, token_weight_T):
        m_TD = self.mlp(self.pre_feedforward_layernorm(h_TD))
        if not hasattr(self, "experts"):
            return m_TD, None
        probs_TE, idx_Tk, weight_Tk = self.router(h_TD)
        stats = None if token_weight_T is None else router_stats(probs_TE, idx_Tk, token_weight_T)
        e_TD = self.experts(self.pre_feedforward_layernorm_2(h_TD), idx_Tk, weight_Tk)
        return self.post_feedforward_layernorm_1(m_TD) + self.post_feedforward_layernorm_2(e_TD), stats

    def forward(self, h_TD: torch.Tensor, inputs: BlockInputs) -> BlockOutput:
        cfg = self.self_attn.cfg
        cos_Td, sin_Td = inputs.rope[cfg.rope_key]
        attn_TD, kv = self.self_attn(self.input_layernorm(h_TD), cos_Td, sin_Td, inputs.layout, inputs.shared_kv)
        h_TD = h_TD + self.post_attention_layernorm(attn_TD)
        m_TD, stats = self._feed_forward(h_TD, inputs.token_weight_T)
        h_TD = h_TD + self.post_feedforward_layernorm(m_TD)
        if inputs.per_layer_input_TP is not None:
            g_TP = self.per_layer_act(self.per_layer_input_gate(h_TD)) * inputs.per_layer_input_TP
            h_TD = h_TD + self.post_per_layer_input_norm(self.per_layer_projection(g_TP))
        return BlockOutput(h_TD * self.layer_scalar, kv if self.keeps_kv else None, stats)


# --------------------------------------------------------------------------------------- per-layer inputs

def add_per_layer_input_modules(stack: nn.Module, cfg: ModelConfig) -> None:
    """The model-level per-layer-input modules (names as in transformers' Gemma-4 text model)."""
    ple, L, D = cfg.per_layer_input, cfg.num_layers, cfg.hidden_size
    stack.embed_tokens_per_layer = ScaledEmbedding(ple.vocab_size, L * ple.size, cfg.pad_token_id, scale=ple.size ** 0.5)
    stack.per_layer_model_projection = nn.Linear(D, L * ple.size, bias=False)
    stack.per_layer_projection_norm = RMSNorm(ple.size, cfg.norm_eps, "gemma4")


def per_layer_inputs(stack: nn.Module, cfg: ModelConfig, input_ids_T: torch.Tensor, x_TD: torch.Tensor) -> torch.Tensor:
    """(T, L, P): (norm(project(embeddings) / sqrt(D)) + scaled token table) / sqrt(2). Per token."""
    T, L, P = input_ids_T.shape[0], cfg.num_layers, cfg.per_layer_input.size
    tok_TLP = stack.embed_tokens_per_layer(input_ids_T).reshape(T, L, P)
    proj_TLP = (stack.per_layer_model_projection(x_TD) * cfg.hidden_size ** -0.5).reshape(T, L, P)
    return (stack.per_layer_projection_norm(proj_TLP) + tok_TLP) * 2.0 ** -0.5


# --------------------------------------------------------------------------------------- config.json

def _get(hf: dict, key: str, default=None):
    value = hf.get(key, default)
    return default if value is None else value


def _layer_types(text: dict, L: int) -> list[str]:
    types = list(text.get("layer_types") or [SLIDING if (i + 1) % 6 else FULL for i in range(L)])
    if len(types) != L:
        raise ValueError(f"layer_types: expected {L} entries (num_hidden_layers), got {len(types)}")
    bad = sorted({t for t in types if t not in (SLIDING, FULL)})
    if bad:
        raise ValueError(f"layer_types: expected 'sliding_attention' or 'full_attention', got {bad}")
    types[-1] = FULL  # transformers forces the last layer to global attention
    return types


def _per_layer_overrides(text: dict, types: list[str]) -> dict[int, dict]:
    """head_dim / num_key_value_heads of each layer that differs from the base (the global layers)."""
    if text.get("per_layer_config") is not None:
        overrides = {int(k): dict(v) for k, v in text["per_layer_config"].items()}
        for i, o in overrides.items():
            unknown = sorted(set(o) - {"head_dim", "num_key_value_heads", "intermediate_size"})
            if unknown:
                raise ValueError(f"per_layer_config[{i}]: expected head_dim / num_key_value_heads / intermediate_size, got {unknown}")
        return overrides
    over: dict[str, Any] = {"head_dim": _get(text, "global_head_dim", 512)}
    n_global_kv = text.get("num_global_key_value_heads")
    if text.get("attention_k_eq_v", False) and n_global_kv is not None:
        over["num_key_value_heads"] = n_global_kv
    return {i: dict(over) for i, t in enumerate(types) if t == FULL}


def _kv_sources(types: list[str], num_shared: int) -> list[int | None]:
    L = len(types)
    first_shared = L - num_shared
    if num_shared and first_shared < 1:
        raise ValueError(f"num_kv_shared_layers: expected fewer than num_hidden_layers={L}, got {num_shared}")
    sources: list[int | None] = []
    for i, t in enumerate(types):
        if i < first_shared:
            sources.append(None)
            continue
        producers = [j for j in range(first_shared) if types[j] == t]
        if not producers:
            raise ValueError(f"num_kv_shared_layers: layer {i} ({t}) shares k/v but no earlier layer of that type has its own")
        sources.append(producers[-1])
    return sources


def _moe(text: dict, act: str) -> MoEConfig | None:
    if not text.get("enable_moe_block", False):
        return None
    missing = [k for k in ("num_experts", "top_k_experts", "moe_intermediate_size") if text.get(k) is None]
    if missing:
        raise ValueError(f"config.json: enable_moe_block is set but {missing} are missing")
    return MoEConfig(num_experts=text["num_experts"], top_k=text["top_k_experts"],
                     intermediate_size=text["moe_intermediate_size"], activation=act, router="gemma4",
                     norm_topk_prob=True, aux_loss_coef=float(_get(text, "router_aux_loss_coef", 0.0)))


_CONSUMED = {
    "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "global_head_dim", "num_global_key_value_heads",
    "hidden_activation", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "rope_parameters",
    "attention_bias", "sliding_window", "layer_types", "final_logit_softcapping", "use_bidirectional_attention",
    "vocab_size_per_layer_input", "hidden_size_per_layer_input", "attention_k_eq_v", "num_kv_shared_layers",
    "enable_moe_block", "use_double_wide_mlp", "num_experts", "top_k_experts", "moe_intermediate_size",
    "per_layer_config", "pad_token_id", "router_aux_loss_coef", "text_config", "vision_config", "audio_config",
}

_DEFAULT_ROPE = {SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                 FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}


def _layers(text: dict, types: list[str]) -> list[LayerConfig]:
    act_name = _get(text, "hidden_activation", "gelu_pytorch_tanh")
    if act_name not in _ACT:
        raise ValueError(f"hidden_activation: expected one of {sorted(_ACT)}, got {act_name!r}")
    act = _ACT[act_name]
    ropes = {t: rope_from_hf(_get(text, "rope_parameters", _DEFAULT_ROPE).get(t) or _DEFAULT_ROPE[t]) for t in set(types)}
    overrides = _per_layer_overrides(text, types)
    sources = _kv_sources(types, _get(text, "num_kv_shared_layers", 0))
    heads, base_kv = _get(text, "num_attention_heads", 8), _get(text, "num_key_value_heads", 4)
    moe, layers = _moe(text, act), []
    for i, t in enumerate(types):
        o = overrides.get(i, {})
        attn = AttentionConfig(
            num_heads=heads, num_kv_heads=o.get("num_key_value_heads", base_kv),
            head_dim=o.get("head_dim", _get(text, "head_dim", 256)), rope=ropes[t],
            window=_get(text, "sliding_window", 512) if t == SLIDING else None, softmax_scale=1.0,
            bias=bool(text.get("attention_bias", False)), qk_norm=True, v_norm=True,
            k_eq_v=bool(text.get("attention_k_eq_v", False)) and t == FULL and sources[i] is None, kv_source=sources[i],
        )
        width = o.get("intermediate_size", _get(text, "intermediate_size", 9216))
        if text.get("use_double_wide_mlp", False) and sources[i] is not None:
            width *= 2
        layers.append(LayerConfig(attn, mlp=MLPConfig(width, act), moe=moe))
    return layers


def parse_gemma4(hf: dict[str, Any]) -> ModelConfig:
    """Gemma-4 text model from a ``gemma4_text`` config, or the text part of a ``gemma4`` config."""
    text = (hf.get("text_config") or {}) if hf.get("model_type") == "gemma4" else hf
    if hf.get("model_type") == "gemma4" and not text:
        raise ValueError("config.json: a gemma4 config needs a text_config, which is missing")
    if text.get("use_bidirectional_attention") == "all":
        raise ValueError("use_bidirectional_attention: 'all' makes the model non-causal; a causal LM expects None or 'vision'")
    L = _get(text, "num_hidden_layers", 30)
    types = _layer_types(text, L)
    D = _get(text, "hidden_size", 2304)
    ple_size = _get(text, "hidden_size_per_layer_input", 256)
    tie = text.get("tie_word_embeddings", hf.get("tie_word_embeddings", True))
    extra = {k: v for k, v in text.items() if k not in _CONSUMED}
    return ModelConfig(
        family="gemma4",
        vocab_size=_get(text, "vocab_size", 262_144),
        hidden_size=D,
        layers=tuple(_layers(text, types)),
        norm_eps=float(_get(text, "rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(True if tie is None else tie),
        embed_scale=D ** 0.5,
        final_logit_softcap=text.get("final_logit_softcapping"),
        per_layer_input=PerLayerInputConfig(_get(text, "vocab_size_per_layer_input", 262_144), ple_size) if ple_size else None,
        pad_token_id=text.get("pad_token_id", 0),
        max_position_embeddings=_get(text, "max_position_embeddings", 131_072),
        extra=extra,
    )


HF_PARSERS = {"gemma4_text": parse_gemma4, "gemma4": parse_gemma4}


def _one(values: set, what: str):
    if len(values) != 1:
        raise ValueError(f"config: a Gemma-4 config.json holds one {what} per layer type, got {sorted(map(str, values))}")
    return next(iter(values))



def to_hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """A ``gemma4_text`` config.json (loads as transformers' ``Gemma4ForCausalLM``)."""
    layers = cfg.layers
    types = [SLIDING if l.attention.window is not None else FULL for l in layers]
    by_type = {t: [l for l, lt in zip(layers, types) if lt == t] for t in set(types)}
    sliding = by_type.get(SLIDING, by_type[FULL])
    base_kv = _one({l.attention.num_kv_heads for l in sliding}, "num_key_value_heads")
    base_hd = _one({l.attention.head_dim for l in sliding}, "head_dim")
    shared = [l.attention.kv_source is not None for l in layers]
    num_shared = sum(shared)
    if num_shared and not all(shared[-num_shared:]):
        raise ValueError("config: Gemma-4 KV sharing covers the last num_kv_shared_layers layers only")
    own = [l for l, s in zip(layers, shared) if not s]
    k_eq_v = any(l.attention.k_eq_v for l in own)
    width = _one({l.mlp.intermediate_size for l in own}, "intermediate_size")
    double = any(l.mlp.intermediate_size == 2 * width for l, s in zip(layers, shared) if s)
    moe = _one({l.moe for l in layers}, "MoE config")
    per_layer = {str(i): {"head_dim": l.attention.head_dim, "num_key_value_heads": l.attention.num_kv_heads}
                 for i, l in enumerate(layers)
                 if (l.attention.head_dim, l.attention.num_kv_heads) != (base_hd, base_kv)}
    full = by_type.get(FULL, [])
    out: dict[str, Any] = dict(cfg.extra)
    out.update(
        architectures=["Gemma4ForCausalLM"], model_type="gemma4_text", vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size, intermediate_size=width, num_hidden_layers=cfg.num_layers,
        num_attention_heads=_one({l.attention.num_heads for l in layers}, "num_attention_heads"),
        num_key_value_heads=base_kv, head_dim=base_hd,
        global_head_dim=full[0].attention.head_dim if full else base_hd,
        num_global_key_value_heads=full[0].attention.num_kv_heads if full and k_eq_v else None,
        attention_k_eq_v=k_eq_v, per_layer_config=per_layer, layer_types=types,
        sliding_window=_one({l.attention.window for l in by_type[SLIDING]}, "sliding_window") if SLIDING in by_type else 512,
        rope_parameters={t: rope_to_hf(_one({l.attention.rope for l in ls}, "RoPE")) for t, ls in by_type.items()},
        hidden_activation={"gelu_tanh": "gelu_pytorch_tanh", "silu": "silu"}[layers[0].mlp.activation],
        max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_word_embeddings, pad_token_id=cfg.pad_token_id,
        attention_bias=layers[0].attention.bias, final_logit_softcapping=cfg.final_logit_softcap,
        hidden_size_per_layer_input=cfg.per_layer_input.size if cfg.per_layer_input else 0,
        vocab_size_per_layer_input=cfg.per_layer_input.vocab_size if cfg.per_layer_input else cfg.vocab_size,
        num_kv_shared_layers=num_shared, use_double_wide_mlp=double, enable_moe_block=moe is not None,
        num_experts=moe.num_experts if moe else None, top_k_experts=moe.top_k if moe else None,
        moe_intermediate_size=moe.intermediate_size if moe else None,
    )
    return out
