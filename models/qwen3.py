"""Qwen3 (dense) and Qwen3-MoE on the packed layout: the decoder block and the config.json conversion.

Block (pre-norm)::

    h = h + o_proj(attn(rope(q_norm(q_proj(n1(h)))), rope(k_norm(k_proj(n1(h)))), v_proj(n1(h))))
    h = h + mlp(n2(h))            # mlp: SwiGLU, or the routed experts of a Qwen3-MoE layer

Shape legend: T tokens, D hidden, E experts, k experts per token.
Parameter names equal transformers' (``self_attn.q_proj``, ``mlp.gate``, ``mlp.experts.gate_up_proj``
...), so checkpoints map by name; Qwen3-MoE checkpoints store each expert separately
(``mlp.experts.{e}.gate_proj.weight``), fused here on load and split again on save.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .config import ROPE_TYPES, AttentionConfig, LayerConfig, MLPConfig, ModelConfig, MoEConfig, RopeConfig
from .layers import Attention, BlockInputs, BlockOutput, GatedMLP, RMSNorm
from .moe import Experts, SoftmaxTopKRouter, router_stats

__all__ = ["Qwen3Block", "Qwen3SparseMoE", "HF_PARSERS", "to_hf_config", "rope_from_hf", "rope_to_hf"]

_ACT = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


class Qwen3SparseMoE(nn.Module):
    """Router ``gate`` + ``experts``; records the layer's router statistics."""

    def __init__(self, cfg: MoEConfig, hidden_size: int):
        super().__init__()
        self.gate = SoftmaxTopKRouter(cfg, hidden_size)
        self.experts = Experts(cfg, hidden_size)

    def forward(self, x_TD: torch.Tensor, token_weight_T: torch.Tensor | None):
        probs_TE, idx_Tk, weight_Tk = self.gate(x_TD)
        stats = None if token_weight_T is None else router_stats(probs_TE, idx_Tk, token_weight_T)
        return self.experts(x_TD, idx_Tk, weight_Tk), stats


class Qwen3Block(nn.Module):
    """One Qwen3 / Qwen3-MoE decoder layer."""

    def __init__(self, layer: LayerConfig, model: ModelConfig, keeps_kv: bool = False):
        super().__init__()
        D, eps = model.hidden_size, model.norm_eps
        self.keeps_kv = keeps_kv  # return this layer's K/V (later layers share them); otherwise None
        self.input_layernorm = RMSNorm(D, eps, "qwen3")
        self.self_attn = Attention(layer.attention, D, eps, "qwen3")
        self.post_attention_layernorm = RMSNorm(D, eps, "qwen3")
        if layer.moe is not None:
            self.mlp = Qwen3SparseMoE(layer.moe, D)
        else:
            self.mlp = GatedMLP(D, layer.mlp.intermediate_size, layer.mlp.activation)

    def forward(self, h_TD: torch.Tensor, inputs: BlockInputs) -> BlockOutput:
        cos_Td, sin_Td = inputs.rope[self.self_attn.cfg.rope_key]
        attn_TD, kv = self.self_attn(self.input_layernorm(h_TD), cos_Td, sin_Td, inputs.layout, inputs.shared_kv)
        h_TD = h_TD + attn_TD
        x_TD = self.post_attention_layernorm(h_TD)
        stats = None
        if isinstance(self.mlp, Qwen3SparseMoE):
            mlp_TD, stats = self.mlp(x_TD, inputs.token_weight_T)
        else:
            mlp_TD = self.mlp(x_TD)
        return BlockOutput(h_TD + mlp_TD, kv if self.keeps_kv else None, stats)


# --------------------------------------------------------------------------------------- config.json

def _get(hf: dict, key: str, default=None):
    value = hf.get(key, default)
    return default if value is None else value


def rope_from_hf(params: dict | None, fallback_theta: float = 10000.0,
                 max_position_embeddings: int | None = None) -> RopeConfig:
    """A RopeConfig from a ``rope_parameters`` dict (or a legacy ``rope_scaling``). YaRN without
    ``original_max_position_embeddings`` takes ``max_position_embeddings``, as transformers does."""
    params = dict(params or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_type: expected one of {ROPE_TYPES} (the RoPE types these models ship with), "
                         f"got {rope_type!r}")
    yarn = {}
    if rope_type == "yarn":
        if params.get("mscale") or params.get("mscale_all_dim"):
            raise ValueError("rope_parameters: YaRN's mscale / mscale_all_dim (DeepSeek's attention factor) are "
                             "not supported; give attention_factor instead")
        yarn = dict(original_max_position_embeddings=params.get("original_max_position_embeddings",
                                                                 max_position_embeddings),
                    beta_fast=float(params.get("beta_fast") or 32.0), beta_slow=float(params.get("beta_slow") or 1.0),
                    attention_factor=params.get("attention_factor"), truncate=bool(params.get("truncate", True)))
    return RopeConfig(
        theta=float(params.get("rope_theta", fallback_theta)),
        rope_type=rope_type,
        partial_rotary_factor=float(params.get("partial_rotary_factor", 1.0)),
        factor=float(params.get("factor", 1.0)),
        **yarn,
    )


def rope_to_hf(rope: RopeConfig) -> dict[str, Any]:
    """``rope_from_hf``'s inverse: the ``rope_parameters`` dict of a RopeConfig (Qwen3's and Gemma-4's)."""
    out: dict[str, Any] = {"rope_type": rope.rope_type, "rope_theta": rope.theta}
    if rope.rope_type in ("linear", "yarn") or rope.factor != 1.0:
        out["factor"] = rope.factor
    if rope.rope_type == "proportional":
        out["partial_rotary_factor"] = rope.partial_rotary_factor
    if rope.rope_type == "yarn":
        out.update(original_max_position_embeddings=rope.original_max_position_embeddings,
                   beta_fast=rope.beta_fast, beta_slow=rope.beta_slow, truncate=rope.truncate)
        if rope.attention_factor is not None:
            out["attention_factor"] = rope.attention_factor
    return out


def _qwen_rope(hf: dict) -> RopeConfig:
    max_pos = hf.get("max_position_embeddings")
    if hf.get("rope_parameters"):
        return rope_from_hf(hf["rope_parameters"], max_position_embeddings=max_pos)
    scaling = dict(hf.get("rope_scaling") or {})
    scaling.setdefault("rope_theta", _get(hf, "rope_theta", 10000.0))
    return rope_from_hf(scaling, max_position_embeddings=max_pos)


def _activation(hf: dict, key: str) -> str:
    name = _get(hf, key, "silu")
    if name not in _ACT:
        raise ValueError(f"{key}: expected one of {sorted(_ACT)}, got {name!r}")
    return _ACT[name]


def _windows(hf: dict, moe: bool) -> list[int | None]:
    L = hf["num_hidden_layers"]
    window = _get(hf, "sliding_window") if hf.get("use_sliding_window") else None
    if moe:  # Qwen3-MoE: one window for every layer when enabled
        return [window] * L
    types = hf.get("layer_types") or [
        "sliding_attention" if window is not None and i >= _get(hf, "max_window_layers", 28) else "full_attention"
        for i in range(L)
    ]
    if len(types) != L:
        raise ValueError(f"layer_types: expected {L} entries (num_hidden_layers), got {len(types)}")
    return [window if t == "sliding_attention" else None for t in types]


def _attention(hf: dict, window: int | None) -> AttentionConfig:
    heads = hf["num_attention_heads"]
    return AttentionConfig(
        num_heads=heads,
        num_kv_heads=_get(hf, "num_key_value_heads", heads),
        head_dim=_get(hf, "head_dim", hf["hidden_size"] // heads),
        rope=_qwen_rope(hf),
        window=window,
        bias=bool(hf.get("attention_bias", False)),
    )


_CONSUMED = {
    "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings",
    "rms_norm_eps", "tie_word_embeddings", "rope_parameters", "rope_theta", "rope_scaling", "attention_bias",
    "use_sliding_window", "sliding_window", "max_window_layers", "layer_types", "pad_token_id",
    "moe_intermediate_size", "num_experts", "num_experts_per_tok", "norm_topk_prob", "router_aux_loss_coef",
    "decoder_sparse_step", "mlp_only_layers", "output_router_logits", "num_local_experts",
}


def _model(hf: dict, layers: list[LayerConfig]) -> ModelConfig:
    return ModelConfig(
        family="qwen3",
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        layers=tuple(layers),
        norm_eps=float(_get(hf, "rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        pad_token_id=hf.get("pad_token_id"),
        max_position_embeddings=_get(hf, "max_position_embeddings", 32768),
        extra={k: v for k, v in hf.items() if k not in _CONSUMED},
    )


def _require(hf: dict, keys: tuple[str, ...], model_type: str) -> None:
    missing = [k for k in keys if k not in hf]
    if missing:
        raise ValueError(f"config.json: a {model_type} config needs {missing}, which are missing")


def parse_qwen3(hf: dict[str, Any]) -> ModelConfig:
    _require(hf, ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"), "qwen3")
    mlp = MLPConfig(hf["intermediate_size"], _activation(hf, "hidden_act"))
    layers = [LayerConfig(_attention(hf, w), mlp=mlp) for w in _windows(hf, moe=False)]
    return _model(hf, layers)


def parse_qwen3_moe(hf: dict[str, Any]) -> ModelConfig:
    if "num_experts" not in hf and "num_local_experts" in hf:  # transformers >= 5 writes this alias
        hf = {**hf, "num_experts": hf["num_local_experts"]}
    _require(hf, ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "moe_intermediate_size",
                  "num_experts", "num_experts_per_tok"), "qwen3_moe")
    act = _activation(hf, "hidden_act")
    moe = MoEConfig(
        num_experts=hf["num_experts"], top_k=hf["num_experts_per_tok"], intermediate_size=hf["moe_intermediate_size"],
        activation=act, router="softmax_topk", norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        aux_loss_coef=float(_get(hf, "router_aux_loss_coef", 0.001)),
    )
    dense_only = set(hf.get("mlp_only_layers") or [])
    step = _get(hf, "decoder_sparse_step", 1)
    layers = []
    for i, w in enumerate(_windows(hf, moe=True)):
        if i not in dense_only and (i + 1) % step == 0:
            layers.append(LayerConfig(_attention(hf, w), moe=moe))
        else:
            layers.append(LayerConfig(_attention(hf, w), mlp=MLPConfig(hf["intermediate_size"], act)))
    return _model(hf, layers)


HF_PARSERS = {"qwen3": parse_qwen3, "qwen3_moe": parse_qwen3_moe}


def _uniform(values: list, what: str):
    if len(set(values)) != 1:
        raise ValueError(f"config: a Qwen3 config.json holds one {what} for all layers, got {sorted(set(map(str, values)))}")
    return values[0]


def _act_name(act: str) -> str:
    return {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh"}[act]


def to_hf_config(cfg: ModelConfig) -> dict[str, Any]:
    attn = _uniform([(l.attention.num_heads, l.attention.num_kv_heads, l.attention.head_dim, l.attention.rope,
                      l.attention.bias) for l in cfg.layers], "attention shape")
    heads, kv_heads, head_dim, rope, bias = attn
    windows = [l.attention.window for l in cfg.layers]
    window = _uniform([w for w in windows if w is not None] or [None], "sliding window")
    moe_layers = [l.moe for l in cfg.layers if l.moe is not None]
    dense = [l.mlp for l in cfg.layers if l.mlp is not None]
    out: dict[str, Any] = dict(cfg.extra)
    out.update(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_word_embeddings, attention_bias=bias, pad_token_id=cfg.pad_token_id,
        rope_parameters=rope_to_hf(rope),
        use_sliding_window=window is not None, sliding_window=window,
    )
    if moe_layers:
        moe = _uniform(moe_layers, "MoE config")
        out.update(
            architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_act=_act_name(moe.activation),
            moe_intermediate_size=moe.intermediate_size, num_experts=moe.num_experts,
            num_experts_per_tok=moe.top_k, norm_topk_prob=moe.norm_topk_prob, router_aux_loss_coef=moe.aux_loss_coef,
            decoder_sparse_step=1, mlp_only_layers=[i for i, l in enumerate(cfg.layers) if l.moe is None],
            intermediate_size=_uniform(dense, "dense MLP").intermediate_size if dense
            else cfg.extra.get("intermediate_size", moe.intermediate_size),
        )
        if any(w != windows[0] for w in windows):
            raise ValueError("config: Qwen3-MoE applies its sliding window to every layer or none")
    else:
        mlp = _uniform(dense, "MLP config")
        out.update(
            architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_act=_act_name(mlp.activation),
            intermediate_size=mlp.intermediate_size,
            layer_types=["sliding_attention" if w is not None else "full_attention" for w in windows],
        )
        if window is not None:
            first = windows.index(window)
            out["max_window_layers"] = first
    return out


# --------------------------------------------------------------------------------------- checkpoints

def save_tensors(key: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Internal tensor -> the names transformers' Qwen3-MoE checkpoints use (experts one by one)."""
    if key.endswith("mlp.experts.gate_up_proj"):
        base = key[: -len("gate_up_proj")]
        gate_EFD, up_EFD = tensor.chunk(2, dim=1)
        return [(f"{base}{e}.{name}.weight", t[e].contiguous())
                for e in range(tensor.shape[0]) for name, t in (("gate_proj", gate_EFD), ("up_proj", up_EFD))]
    if key.endswith("mlp.experts.down_proj"):
        base = key[: -len("down_proj")]
        return [(f"{base}{e}.down_proj.weight", tensor[e].contiguous()) for e in range(tensor.shape[0])]
    return [(key, tensor)]


def load_tensor(key: str, lookup, num_experts: int | None) -> torch.Tensor | None:
    """Internal tensor from the checkpoint: by name, or fused from per-expert tensors."""
    direct = lookup(key)
    if direct is not None or num_experts is None:
        return direct
    if key.endswith("mlp.experts.gate_up_proj"):
        base = key[: -len("gate_up_proj")]
        parts = [(lookup(f"{base}{e}.gate_proj.weight"), lookup(f"{base}{e}.up_proj.weight")) for e in range(num_experts)]
        if any(g is None or u is None for g, u in parts):
            return None
        return torch.stack([torch.cat([g, u], dim=0) for g, u in parts])
    if key.endswith("mlp.experts.down_proj"):
        base = key[: -len("down_proj")]
        parts = [lookup(f"{base}{e}.down_proj.weight") for e in range(num_experts)]
        return None if any(p is None for p in parts) else torch.stack(parts)
    return None
