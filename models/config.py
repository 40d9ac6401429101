"""Typed model configs: one dataclass per component, one ``LayerConfig`` per decoder layer.

A model is a family (the block structure: ``qwen3`` pre-norm blocks, ``gemma4`` sandwich-norm blocks)
plus a tuple of per-layer configs. Dense, MoE and hybrid sliding/global models differ only in what
their layers hold, never in flags on the model:

- Qwen3 dense: every layer ``LayerConfig(attention, mlp=MLPConfig(...))``.
- Qwen3-MoE: MoE layers ``LayerConfig(attention, moe=MoEConfig(...))`` (dense-MLP layers keep ``mlp``).
- Gemma-4: sliding layers (window, head dim 256) and global layers (no window, head dim 512,
  K = V, proportional RoPE) side by side; a layer with ``moe`` runs the dense MLP and the experts
  in parallel.

``from_hf_config(config.json dict)`` and ``to_hf_config(ModelConfig)`` convert to and from the
transformers ``config.json`` of each family (``qwen3``, ``qwen3_moe``, ``gemma4_text``, ``gemma4``).
"""

from __future__ import annotations

import math

from dataclasses import astuple, dataclass, field
from typing import Any

__all__ = [
    "RopeConfig",
    "AttentionConfig",
    "MLPConfig",
    "MoEConfig",
    "LayerConfig",
    "PerLayerInputConfig",
    "ModelConfig",
    "from_hf_config",
    "to_hf_config",
    "FAMILIES",
    "ACTIVATIONS",
    "ROPE_TYPES",
    "ROUTERS",
]

FAMILIES = ("qwen3", "gemma4")
ACTIVATIONS = ("silu", "gelu_tanh")
ROPE_TYPES = ("default", "linear", "proportional", "yarn")
ROUTERS = ("softmax_topk", "gemma4")


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _positive_int(name: str, value) -> None:
    _check(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
           f"{name}: expected a positive int, got {value!r}")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding of one attention type.

    rope_type:
        ``default``: inv_freq_i = theta^(-2i/d) over the whole head dim.
        ``linear``: default divided by ``factor``.
        ``proportional``: the first ``partial_rotary_factor * d/2`` frequencies of the default
        spectrum (exponent over the whole d); the remaining frequencies are 0 (those dims pass
        through unrotated), so the encoding still spans the whole head dim.
        ``yarn`` (YaRN, Qwen3's long-context extension): per frequency a blend of the default
        (``extrapolated``) and the default divided by ``factor`` (interpolated), the interpolated
        share ramping linearly from 0 to 1 between the dims that turn ``beta_fast`` and ``beta_slow``
        times over ``original_max_position_embeddings`` positions (those dims rounded outwards when
        ``truncate``); cos and sin are multiplied by ``attention_factor`` (by default
        0.1 ln(factor) + 1 for factor > 1).
    """

    theta: float
    rope_type: str = "default"
    partial_rotary_factor: float = 1.0
    factor: float = 1.0
    original_max_position_embeddings: int | None = None  # yarn: the context the model was pretrained on
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self):
        _check(self.rope_type in ROPE_TYPES, f"rope_type: expected one of {ROPE_TYPES}, got {self.rope_type!r}")
        _check(self.theta > 0, f"rope theta: expected > 0, got {self.theta!r}")
        _check(0.0 < self.partial_rotary_factor <= 1.0,
               f"partial_rotary_factor: expected in (0, 1], got {self.partial_rotary_factor!r}")
        _check(self.factor > 0, f"rope factor: expected > 0, got {self.factor!r}")
        if self.rope_type == "yarn":
            _positive_int("original_max_position_embeddings (yarn)", self.original_max_position_embeddings)
            _check(self.beta_fast > self.beta_slow > 0,
                   f"beta_fast, beta_slow (yarn): expected beta_fast > beta_slow > 0, got {self.beta_fast!r}, "
                   f"{self.beta_slow!r}")
            _check(self.attention_factor is None or self.attention_factor > 0,
                   f"attention_factor (yarn): expected > 0 or None, got {self.attention_factor!r}")

    @property
    def cos_sin_scale(self) -> float:
        """What cos and sin are multiplied by: YaRN's attention factor, 1 for the other types."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)
        return 0.1 * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0


@dataclass(frozen=True)
class AttentionConfig:
    """One attention layer.

    window: sliding window on logical positions (query i sees keys j with i - j < window), or None.
    softmax_scale: None means head_dim ** -0.5 (Gemma-4 uses 1.0: its q/k norms set the scale).
    qk_norm: RMSNorm over the head dim on q and k before RoPE (Qwen3, Gemma-4).
    v_norm: scale-free RMSNorm over the head dim on v (Gemma-4).
    k_eq_v: no v projection; values are the raw key projection (Gemma-4 global layers).
    kv_source: reuse the (normed, rotated) keys and values of that earlier layer instead of
        projecting its own (Gemma-4 KV sharing); the layer then has no k/v projections.
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: RopeConfig
    window: int | None = None
    softmax_scale: float | None = None
    softcap: float | None = None
    bias: bool = False
    qk_norm: bool = True
    v_norm: bool = False
    k_eq_v: bool = False
    kv_source: int | None = None

    def __post_init__(self):
        for name in ("num_heads", "num_kv_heads", "head_dim"):
            _positive_int(name, getattr(self, name))
        _check(self.num_heads % self.num_kv_heads == 0,
               f"num_kv_heads: expected a divisor of num_heads={self.num_heads}, got {self.num_kv_heads}")
        _check(self.head_dim % 2 == 0, f"head_dim: expected an even head dim (RoPE pairs dims), got {self.head_dim}")
        if self.window is not None:
            _positive_int("window", self.window)

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5 if self.softmax_scale is None else self.softmax_scale

    @property
    def rope_key(self) -> tuple:
        """Key of this layer's (cos, sin) tables in ``BlockInputs.rope``: plain values, so layers of
        two models with equal RoPE share one table and one torch.compile graph (no identity guard)."""
        return (*astuple(self.rope), self.head_dim)


@dataclass(frozen=True)
class MLPConfig:
    """Gated MLP: down(act(gate(x)) * up(x))."""

    intermediate_size: int
    activation: str = "silu"

    def __post_init__(self):
        _positive_int("intermediate_size", self.intermediate_size)
        _check(self.activation in ACTIVATIONS, f"activation: expected one of {ACTIVATIONS}, got {self.activation!r}")


@dataclass(frozen=True)
class MoEConfig:
    """Top-k routed experts, each a gated MLP of ``intermediate_size``.

    router ``softmax_topk`` (Qwen3-MoE): softmax over a linear gate, top-k, optionally renormalised.
    router ``gemma4``: scale-free RMSNorm, learned scale times hidden**-0.5, linear, softmax, top-k,
        renormalised, times a learned per-expert scale.
    aux_loss_coef: the weight a trainer puts on the load-balancing loss (``model.aux_loss``).
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    activation: str = "silu"
    router: str = "softmax_topk"
    norm_topk_prob: bool = True
    aux_loss_coef: float = 0.001

    def __post_init__(self):
        for name in ("num_experts", "top_k", "intermediate_size"):
            _positive_int(name, getattr(self, name))
        _check(self.top_k <= self.num_experts, f"top_k: expected <= num_experts={self.num_experts}, got {self.top_k}")
        _check(self.activation in ACTIVATIONS, f"activation: expected one of {ACTIVATIONS}, got {self.activation!r}")
        _check(self.router in ROUTERS, f"router: expected one of {ROUTERS}, got {self.router!r}")


@dataclass(frozen=True)
class LayerConfig:
    """One decoder layer: attention plus a dense MLP, an MoE, or (Gemma-4) both in parallel."""

    attention: AttentionConfig
    mlp: MLPConfig | None = None
    moe: MoEConfig | None = None

    def __post_init__(self):
        _check(self.mlp is not None or self.moe is not None, "layer: expected an mlp, an moe or both, got neither")


@dataclass(frozen=True)
class PerLayerInputConfig:
    """Gemma-4 per-layer input embeddings: a (vocab, L * size) table plus a projection of the embeddings."""

    vocab_size: int
    size: int

    def __post_init__(self):
        _positive_int("per_layer_input vocab_size", self.vocab_size)
        _positive_int("per_layer_input size", self.size)


@dataclass(frozen=True)
class ModelConfig:
    """A causal LM: the family's block structure, embeddings, per-layer configs, final norm, head.

    embed_scale: multiply embeddings by this (Gemma: sqrt(hidden), rounded to the weight dtype).
    final_logit_softcap: logits become ``cap * tanh(logits / cap)`` (Gemma).
    pad_token_id: the embedding row that receives no gradient (``nn.Embedding(padding_idx=...)``,
        as transformers builds it), or None.
    extra: config.json entries this library does not interpret (token ids, ...), kept for saving.
    """

    family: str
    vocab_size: int
    hidden_size: int
    layers: tuple[LayerConfig, ...]
    norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    embed_scale: float | None = None
    final_logit_softcap: float | None = None
    per_layer_input: PerLayerInputConfig | None = None
    pad_token_id: int | None = None
    max_position_embeddings: int = 32768
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self):
        _check(self.family in FAMILIES, f"family: expected one of {FAMILIES}, got {self.family!r}")
        _positive_int("vocab_size", self.vocab_size)
        _positive_int("hidden_size", self.hidden_size)
        _check(isinstance(self.layers, tuple) and len(self.layers) >= 1,
               f"layers: expected a non-empty tuple of LayerConfig, got {type(self.layers).__name__}")
        for i, layer in enumerate(self.layers):
            _check(isinstance(layer, LayerConfig), f"layers[{i}]: expected a LayerConfig, got {type(layer).__name__}")
            src = layer.attention.kv_source
            if src is not None:
                _check(0 <= src < i and self.layers[src].attention.kv_source is None,
                       f"layers[{i}].attention.kv_source: expected an earlier layer that projects its own k/v, got {src}")
                a, b = layer.attention, self.layers[src].attention
                _check((a.num_kv_heads, a.head_dim) == (b.num_kv_heads, b.head_dim),
                       f"layers[{i}].attention: reuses layer {src}'s k/v, so expected its (num_kv_heads, head_dim) "
                       f"{(b.num_kv_heads, b.head_dim)}, got {(a.num_kv_heads, a.head_dim)}")
        if self.pad_token_id is not None:
            _check(0 <= self.pad_token_id < self.vocab_size,
                   f"pad_token_id: expected None or a token id in [0, {self.vocab_size}), got {self.pad_token_id!r}")
        _check(self.norm_eps > 0, f"norm_eps: expected > 0, got {self.norm_eps!r}")
        if self.final_logit_softcap is not None:
            _check(self.final_logit_softcap > 0, f"final_logit_softcap: expected None or > 0, got {self.final_logit_softcap!r}")
        _check(self.per_layer_input is None or self.family == "gemma4",
               "per_layer_input: only the gemma4 family has per-layer input embeddings")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def is_moe(self) -> bool:
        return any(layer.moe is not None for layer in self.layers)

    def describe(self) -> str:
        kinds = []
        for layer in self.layers:
            a = layer.attention
            kinds.append(f"{'S' if a.window else 'G'}{a.head_dim}{'+moe' if layer.moe else ''}")
        return f"{self.family}: D={self.hidden_size} V={self.vocab_size} layers=[{' '.join(kinds)}]"


# ---------------------------------------------------------------------------------------------
# HF config.json conversion (family modules register their parser / writer here)

def from_hf_config(hf: dict[str, Any]) -> ModelConfig:
    """ModelConfig from a transformers ``config.json`` dict; the family comes from ``model_type``."""
    _check(isinstance(hf, dict), f"hf_config: expected a config.json dict, got {type(hf).__name__}")
    model_type = hf.get("model_type")
    from . import gemma4, qwen3  # the family modules own their conversions

    parsers = {**qwen3.HF_PARSERS, **gemma4.HF_PARSERS}
    _check(model_type in parsers,
           f"model_type: expected one of {sorted(parsers)} in config.json, got {model_type!r}")
    return parsers[model_type](hf)


def to_hf_config(config: ModelConfig) -> dict[str, Any]:
    """A transformers ``config.json`` dict that loads into the equivalent transformers model."""
    from . import gemma4, qwen3

    writer = {"qwen3": qwen3.to_hf_config, "gemma4": gemma4.to_hf_config}[config.family]
    return writer(config)
