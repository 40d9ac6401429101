"""Building blocks shared by every family: RMSNorm, RoPE, attention on the packed layout, gated MLP.

Shape legend (suffixes on tensor names):
    T  packed tokens (P + N*R per group; or a contiguous slice of them under sequence parallelism)
    D  hidden size          F  MLP intermediate size
    H  query heads          K  key/value heads        d  head dim
Example: ``x_TD`` is (T, D), ``q_THd`` is (T, H, d), ``cos_Td`` is (T, d).

Every op here is per token except attention, which goes through ``self.attn_fn`` (by default
``dualkv.core.dualkv_attention``; ``dualkv.parallel`` swaps it from outside). RMSNorm, RoPE and the
gated activation take Liger-Kernel's fused Triton kernels on CUDA where it is installed
(``fused.py``); otherwise, and under ``torch.compile``, PyTorch's ops below.
"""

from __future__ import annotations

import math

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from dualkv.core import dualkv_attention

from . import fused
from .config import AttentionConfig, RopeConfig

__all__ = [
    "RMSNorm",
    "ScaledEmbedding",
    "GatedMLP",
    "Attention",
    "activation_fn",
    "rope_inv_freq",
    "rope_tables",
    "apply_rope",
    "apply_rope_qk",
    "gated_activation",
    "BlockInputs",
    "BlockOutput",
]

NORM_STYLES = ("qwen3", "gemma4")


class BlockInputs(NamedTuple):
    """What a decoder block needs besides the hidden states (shared by every layer of one forward).

    rope: {AttentionConfig.rope_key: (cos_Td, sin_Td)}; token_weight_T: replication count of every
    token (for router statistics) or None; shared_kv: the (k_TKd, v_TKd) this layer reuses, if any;
    per_layer_input_TP: Gemma-4 per-layer input of this layer, if any.
    """

    layout: Any
    rope: dict
    token_weight_T: torch.Tensor | None = None
    shared_kv: tuple[torch.Tensor, torch.Tensor] | None = None
    per_layer_input_TP: torch.Tensor | None = None


class BlockOutput(NamedTuple):
    """hidden_TD; kv: this layer's (k_TKd, v_TKd) when later layers share them, else None;
    stats: its router statistics or None."""

    hidden_TD: torch.Tensor
    kv: tuple[torch.Tensor, torch.Tensor] | None
    stats: Any = None


def activation_fn(name: str):
    """``silu`` or ``gelu_tanh`` (GELU with the tanh approximation)."""
    if name == "silu":
        return F.silu
    if name == "gelu_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    raise ValueError(f"activation: expected 'silu' or 'gelu_tanh', got {name!r}")


class RMSNorm(nn.Module):
    """RMS normalisation over the last dim, in fp32.

    style ``qwen3``: normalise in fp32, cast back to the input dtype, then multiply by the weight.
    style ``gemma4``: normalise and multiply by the weight in fp32, then cast back; with
        ``with_scale=False`` there is no weight (Gemma-4's v-norm and router norm).
    """

    def __init__(self, dim: int, eps: float, style: str, with_scale: bool = True):
        super().__init__()
        if style not in NORM_STYLES:
            raise ValueError(f"style: expected one of {NORM_STYLES}, got {style!r}")
        if not with_scale and style != "gemma4":
            raise ValueError("with_scale: only the gemma4 norm style has a scale-free variant")
        self.eps = eps
        self.style = style
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Liger's kernel where the weight's dtype is the input's (a bf16 input with an fp32 weight
        # gives an fp32 product in the qwen3 style, which Liger does not).
        if (self.weight is None or self.weight.dtype == x.dtype) and fused.use_liger(x):
            return fused.liger_rms_norm(x, self.weight, self.eps, self.style)
        # F.rms_norm: one fused kernel (forward and backward) where PyTorch has one, e.g. on CUDA.
        shape = (x.shape[-1],)
        if self.style == "qwen3":
            return self.weight * F.rms_norm(x.float(), shape, eps=self.eps).to(x.dtype)
        weight = None if self.weight is None else self.weight.float()
        return F.rms_norm(x.float(), shape, weight, eps=self.eps).type_as(x)

    def extra_repr(self) -> str:
        dim = None if self.weight is None else self.weight.shape[0]
        return f"dim={dim}, eps={self.eps}, style={self.style}"


class ScaledEmbedding(nn.Embedding):
    """Token embedding, optionally times ``scale`` rounded to the weight dtype (Gemma: sqrt(D)).

    ``padding_idx`` rows receive no gradient, as in ``nn.Embedding``.
    """

    def __init__(self, num_embeddings: int, dim: int, padding_idx: int | None, scale: float | None = None):
        super().__init__(num_embeddings, dim, padding_idx=padding_idx)
        self.scale = scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = super().forward(ids)
        if self.scale is None:
            return x
        # The scale rounded to the weights' dtype (as the reference implementations keep it), applied as
        # a Python number: a tensor made on the host and copied to the device each call would synchronise.
        return x * torch.tensor(self.scale, dtype=self.weight.dtype).item()

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scale={self.scale}"


# --------------------------------------------------------------------------------------- RoPE

_INV_FREQ_CACHE: dict[tuple, torch.Tensor] = {}


def rope_inv_freq(rope: RopeConfig, head_dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(head_dim // 2,) float32 inverse frequencies (computed on the CPU once, then cached per device)."""
    key = (rope, head_dim, str(device))
    if key not in _INV_FREQ_CACHE:
        if rope.rope_type == "proportional":
            n_rot = int(rope.partial_rotary_factor * head_dim // 2)
            exps = torch.arange(0, 2 * n_rot, 2, dtype=torch.int64).float() / head_dim
            inv = torch.cat([1.0 / (rope.theta ** exps), torch.zeros(head_dim // 2 - n_rot)])
        else:
            if rope.partial_rotary_factor != 1.0:
                raise ValueError(
                    f"partial_rotary_factor: the {rope.rope_type!r} RoPE rotates the whole head dim; "
                    f"got {rope.partial_rotary_factor} (use rope_type='proportional')"
                )
            inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        if rope.rope_type == "yarn":
            inv = _yarn_blend(inv, rope, head_dim)
        elif rope.factor != 1.0:
            inv = inv / rope.factor
        _INV_FREQ_CACHE[key] = inv.to(device)
    return _INV_FREQ_CACHE[key]


def _yarn_blend(extrapolated: torch.Tensor, rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """YaRN's frequencies (``RopeConfig``) from the default ones: frequency i interpolated (divided by
    factor) by the share ramp_i, clamp((i - low) / (high - low), 0, 1), where low / high are the
    (fractional) frequency indices that turn beta_fast / beta_slow times over the pretraining context."""

    def index_turning(turns: float) -> float:  # frequency index whose period fits `turns` times in the context
        return head_dim * math.log(rope.original_max_position_embeddings / (turns * 2 * math.pi)) / (
            2 * math.log(rope.theta))

    low, high = index_turning(rope.beta_fast), index_turning(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float) - low) / (high - low), 0, 1)
    return extrapolated / rope.factor * ramp + extrapolated * (1 - ramp)


def rope_tables(rope: RopeConfig, head_dim: int, position_ids_T: torch.Tensor, dtype: torch.dtype):
    """cos_Td, sin_Td for the given logical positions, computed in fp32 and cast to ``dtype``."""
    inv = rope_inv_freq(rope, head_dim, position_ids_T.device)
    freqs_Tf = position_ids_T[:, None].float() * inv[None, :]
    emb_Td = torch.cat([freqs_Tf, freqs_Tf], dim=-1)
    cos_Td, sin_Td = emb_Td.cos(), emb_Td.sin()
    if rope.cos_sin_scale != 1.0:  # YaRN's attention factor
        cos_Td, sin_Td = cos_Td * rope.cos_sin_scale, sin_Td * rope.cos_sin_scale
    return cos_Td.to(dtype), sin_Td.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x_THd: torch.Tensor, cos_Td: torch.Tensor, sin_Td: torch.Tensor) -> torch.Tensor:
    """Rotate dim i with dim i + d/2 by the angle of frequency i (the half-split convention)."""
    return x_THd * cos_Td[:, None, :] + _rotate_half(x_THd) * sin_Td[:, None, :]


def apply_rope_qk(q_THd, k_TKd, cos_Td, sin_Td, k_aliases_v: bool = False):
    """``apply_rope`` of q and of k; one fused kernel where Liger's are used. Liger rotates in place, so
    ``k_aliases_v`` (k shares storage with v, e.g. k = v without norms) keeps PyTorch's ops."""
    if not k_aliases_v and fused.use_liger(q_THd, k_TKd, cos_Td):
        return fused.liger_rope_qk(q_THd, k_TKd, cos_Td, sin_Td)
    return apply_rope(q_THd, cos_Td, sin_Td), apply_rope(k_TKd, cos_Td, sin_Td)


# --------------------------------------------------------------------------------------- MLP

def gated_activation(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up (``silu`` or ``gelu_tanh``); one fused kernel where Liger's are used."""
    if fused.use_liger(gate, up):
        return fused.liger_gated(gate, up, activation)
    return activation_fn(activation)(gate) * up


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU (silu) or GeGLU (gelu_tanh)."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        activation_fn(activation)  # checks the name
        self.activation = activation

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gated_activation(self.gate_proj(x_TD), self.up_proj(x_TD), self.activation))


# --------------------------------------------------------------------------------------- attention

class Attention(nn.Module):
    """Projections, q/k(/v) norms, RoPE, the DualKV attention op, output projection.

    ``attn_fn(q_THd, k_TKd, v_TKd, layout, softmax_scale=..., window=..., softcap=...)`` is an
    attribute: ``dualkv.parallel`` replaces it (e.g. with a Ulysses wrapper) from outside.
    """

    def __init__(self, cfg: AttentionConfig, hidden_size: int, norm_eps: float, norm_style: str):
        super().__init__()
        self.cfg = cfg
        H, K, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(hidden_size, H * d, bias=cfg.bias)
        if cfg.kv_source is None:
            self.k_proj = nn.Linear(hidden_size, K * d, bias=cfg.bias)
            if not cfg.k_eq_v:
                self.v_proj = nn.Linear(hidden_size, K * d, bias=cfg.bias)
        self.o_proj = nn.Linear(H * d, hidden_size, bias=cfg.bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, norm_eps, norm_style)
            if cfg.kv_source is None:
                self.k_norm = RMSNorm(d, norm_eps, norm_style)
        if cfg.v_norm and cfg.kv_source is None:
            self.v_norm = RMSNorm(d, norm_eps, norm_style, with_scale=False)
        self.attn_fn = dualkv_attention

    def project_kv(self, x_TD: torch.Tensor):
        """k_TKd and v_TKd (both normed, neither rotated yet) of this layer's own projections."""
        cfg = self.cfg
        k_TKd = self.k_proj(x_TD).view(x_TD.shape[0], cfg.num_kv_heads, cfg.head_dim)
        v_TKd = k_TKd if cfg.k_eq_v else self.v_proj(x_TD).view_as(k_TKd)
        if cfg.qk_norm:
            k_TKd = self.k_norm(k_TKd)
        if cfg.v_norm:
            v_TKd = self.v_norm(v_TKd)
        return k_TKd, v_TKd

    def forward(self, x_TD, cos_Td, sin_Td, layout, shared_kv=None):
        """Returns (out_TD, (k_TKd, v_TKd)); ``shared_kv`` replaces the own k/v (KV-sharing layers)."""
        cfg = self.cfg
        q_THd = self.q_proj(x_TD).view(x_TD.shape[0], cfg.num_heads, cfg.head_dim)
        if cfg.qk_norm:
            q_THd = self.q_norm(q_THd)
        if cfg.kv_source is None:
            k_TKd, v_TKd = self.project_kv(x_TD)
            aliased = cfg.k_eq_v and not cfg.qk_norm and not cfg.v_norm  # v is then k's own tensor
            q_THd, k_TKd = apply_rope_qk(q_THd, k_TKd, cos_Td, sin_Td, k_aliases_v=aliased)
        elif shared_kv is None:
            raise ValueError(f"shared_kv: this layer reuses layer {cfg.kv_source}'s keys and values; got none")
        else:
            k_TKd, v_TKd = shared_kv  # rotated by the layer that made them
            q_THd = apply_rope(q_THd, cos_Td, sin_Td)
        out_THd = self.attn_fn(
            q_THd.contiguous(), k_TKd.contiguous(), v_TKd.contiguous(), layout,
            softmax_scale=cfg.scale, window=cfg.window, softcap=cfg.softcap,
        )
        return self.o_proj(out_THd.reshape(x_TD.shape[0], -1)), (k_TKd, v_TKd)
