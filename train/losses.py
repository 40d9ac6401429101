"""GRPO / DAPO policy losses, KL estimators, aggregations and group-normalised advantages.

Shape vocabulary: B rows (responses), R the padded response length; every per-token tensor is
(B, R) with a bool ``mask`` (B, R) marking real response tokens.

Per-token surrogate with ratio r = exp(logp - old_logp) and advantage A (broadcast over tokens)::

    clipped   = max(-A * r, -A * clip(r, 1 - eps_low, 1 + eps_high))        (PPO / GRPO / DAPO)
    dual-clip = min(clipped, -A * c)   where A < 0, c > 1                    (Ye et al., DAPO recipes)
    per_token = surrogate + beta * KL(pi || pi_ref)                          (GRPO; DAPO uses beta = 0)

KL estimators of KL(pi || pi_ref) per token, with d = ref_logp - logp (Schulman's k1/k2/k3):

    k1         -d                       unbiased, high variance, can be negative
    k2         d^2 / 2                  biased, low variance
    k3         exp(d) - d - 1           unbiased, non-negative
    low_var_kl k3 with d clamped to [-20, 20] and the result to [-10, 10] (bounded gradients)

Aggregations over the mini-batch (the whole set of rows one optimizer step sees):

    token-mean           sum_{b,t} L_bt / sum_b |b|                    (DAPO)
    seq-mean-token-mean  (1/B) sum_b (1/|b|) sum_t L_bt                (GRPO paper)
    seq-mean-token-sum   (1/B) sum_b sum_t L_bt                        (Dr. GRPO style, no length norm)

A mini-batch is split into micro-batches (and data-parallel ranks); every function here takes the
denominators of the WHOLE mini-batch (``LossNorm``), so the micro-batch losses add up to the mini-batch
loss exactly and gradient accumulation is independent of how rows were split.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = [
    "LossConfig",
    "LossNorm",
    "kl_estimate",
    "aggregate",
    "policy_loss",
    "group_advantages",
]

KLEstimator = Literal["k1", "k2", "k3", "low_var_kl"]
Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
_KL = ("k1", "k2", "k3", "low_var_kl")
_AGG = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
_LOG_RATIO_CLAMP = 20.0


@dataclass(frozen=True)
class LossConfig:
    """The policy objective. ``LossConfig.grpo()`` and ``LossConfig.dapo()`` give the published recipes.

    Attributes:
        algorithm: "grpo" or "dapo" (names the recipe; every knob below is explicit).
        eps_low / eps_high: ratio clip range [1 - eps_low, 1 + eps_high] (DAPO's clip-higher: eps_high > eps_low).
        dual_clip_c: lower bound -A * c on the loss of negative-advantage tokens (c > 1), None = off.
        kl_beta: weight of the KL penalty to the reference policy (0 = no reference pass).
        kl_estimator: "k1", "k2", "k3" or "low_var_kl".
        aggregation: "token-mean", "seq-mean-token-mean" or "seq-mean-token-sum".
        entropy_coeff: bonus weight on the policy entropy (0 = none).
        norm_adv_by_std: divide group-centred rewards by the group's std (GRPO); False = Dr. GRPO.
        drop_uniform_groups: drop groups whose rewards are all equal (DAPO dynamic sampling: they
            carry zero advantage and only dilute the token-mean).
    """

    algorithm: Literal["grpo", "dapo"] = "grpo"
    eps_low: float = 0.2
    eps_high: float = 0.2
    dual_clip_c: float | None = None
    kl_beta: float = 0.0
    kl_estimator: KLEstimator = "low_var_kl"
    aggregation: Aggregation = "seq-mean-token-mean"
    entropy_coeff: float = 0.0
    norm_adv_by_std: bool = True
    drop_uniform_groups: bool = False

    def __post_init__(self) -> None:
        if self.algorithm not in ("grpo", "dapo"):
            raise ValueError(f"algorithm: expected 'grpo' or 'dapo', got {self.algorithm!r}")
        for name in ("eps_low", "eps_high"):
            v = getattr(self, name)
            if not (0.0 <= v and math.isfinite(v)):
                raise ValueError(f"{name}: expected a finite clip range >= 0, got {v}")
        if self.eps_low >= 1.0:
            raise ValueError(f"eps_low: expected < 1 (the ratio's lower clip 1 - eps_low must stay positive), got {self.eps_low}")
        if self.dual_clip_c is not None and not self.dual_clip_c > 1.0:
            raise ValueError(f"dual_clip_c: expected a constant > 1 (or None to disable), got {self.dual_clip_c}")
        if self.kl_beta < 0 or not math.isfinite(self.kl_beta):
            raise ValueError(f"kl_beta: expected a finite weight >= 0, got {self.kl_beta}")
        if self.kl_estimator not in _KL:
            raise ValueError(f"kl_estimator: expected one of {_KL}, got {self.kl_estimator!r}")
        if self.aggregation not in _AGG:
            raise ValueError(f"aggregation: expected one of {_AGG}, got {self.aggregation!r}")

    @property
    def needs_reference(self) -> bool:
        return self.kl_beta > 0

    @classmethod
    def grpo(cls, **overrides) -> LossConfig:
        """GRPO (DeepSeekMath): symmetric clip 0.2, k3-type KL with beta 0.04, sequence-mean of token-means."""
        base = dict(algorithm="grpo", eps_low=0.2, eps_high=0.2, kl_beta=0.04, kl_estimator="low_var_kl",
                    aggregation="seq-mean-token-mean")
        return cls(**{**base, **overrides})

    @classmethod
    def dapo(cls, **overrides) -> LossConfig:
        """DAPO: clip-higher (0.2 / 0.28), no KL, token-mean, dual-clip c = 3, uniform groups dropped."""
        base = dict(algorithm="dapo", eps_low=0.2, eps_high=0.28, dual_clip_c=3.0, kl_beta=0.0,
                    aggregation="token-mean", drop_uniform_groups=True)
        return cls(**{**base, **overrides})


@dataclass(frozen=True)
class LossNorm:
    """Denominators of the whole mini-batch: its number of rows and of response tokens."""

    num_rows: int
    num_tokens: int

    def __post_init__(self) -> None:
        if self.num_rows < 1 or self.num_tokens < 1:
            raise ValueError(f"LossNorm: expected >= 1 row and >= 1 token, got rows={self.num_rows}, tokens={self.num_tokens}")

    @classmethod
    def of(cls, mask: torch.Tensor) -> LossNorm:
        """The denominators of ``mask`` (B, R) itself (a mini-batch that is one micro-batch)."""
        return cls(num_rows=int(mask.shape[0]), num_tokens=int(mask.sum()))


def _check_same_shape(mask: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.dtype != torch.bool:
        raise ValueError(f"mask: expected a (B, R) bool tensor, got {getattr(mask, 'dtype', type(mask).__name__)} "
                         f"of shape {tuple(getattr(mask, 'shape', ()))}")
    for name, t in tensors.items():
        if t is not None and tuple(t.shape) != tuple(mask.shape):
            raise ValueError(f"{name}: expected shape {tuple(mask.shape)} like mask, got {tuple(t.shape)}")


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: KLEstimator = "low_var_kl") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from log-probs of the sampled tokens (see module docstring)."""
    d = ref_logp - logp
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d.square()
    if estimator == "k3":
        return torch.expm1(d) - d
    if estimator == "low_var_kl":
        d = d.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        return (torch.expm1(d) - d).clamp(-10.0, 10.0)
    raise ValueError(f"kl_estimator: expected one of {_KL}, got {estimator!r}")


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: Aggregation, norm: LossNorm | None = None) -> torch.Tensor:
    """Reduce per-token ``values`` (B, R) over real tokens; ``norm`` gives the mini-batch denominators.

    With ``norm=None`` the batch is its own mini-batch. Padded tokens never contribute (even if NaN);
    a row without tokens contributes 0 in every mode (it still counts in ``norm.num_rows``). Nothing
    here reads device values on the host: the update queues its micro-batches without a sync.
    """
    _check_same_shape(mask, values=values)
    norm = norm if norm is not None else LossNorm.of(mask)
    masked = torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))
    if mode == "token-mean":
        return masked.sum() / norm.num_tokens
    if mode == "seq-mean-token-sum":
        return masked.sum() / norm.num_rows
    if mode == "seq-mean-token-mean":
        lens = mask.sum(dim=1).clamp(min=1)
        return (masked.sum(dim=1) / lens).sum() / norm.num_rows
    raise ValueError(f"aggregation: expected one of {_AGG}, got {mode!r}")


def _surrogate(log_ratio: torch.Tensor, adv: torch.Tensor, cfg: LossConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token clipped (and dual-clipped) surrogate loss, plus the masks of clipped tokens."""
    ratio = torch.exp(log_ratio.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    clipped = torch.maximum(loss1, loss2)
    clip_frac = loss2 > loss1
    if cfg.dual_clip_c is None:
        return clipped, clip_frac, torch.zeros_like(clip_frac)
    loss3 = -adv * cfg.dual_clip_c
    dual = (adv < 0) & (clipped > loss3)
    return torch.where(dual, loss3, clipped), clip_frac, dual


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossConfig,
    *,
    ref_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    norm: LossNorm | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy loss of one micro-batch, scaled so that micro-batch losses SUM to the mini-batch loss.

    Args:
        logp: (B, R) log-probs of the sampled tokens under the current policy (differentiable).
        old_logp: (B, R) under the policy that sampled them (no grad).
        advantages: (B,) per-row advantage or (B, R) per-token.
        mask: (B, R) bool, real response tokens.
        cfg: the objective.
        ref_logp: (B, R) under the reference policy; required when ``cfg.kl_beta > 0``.
        entropy: (B, R) per-token policy entropy; required when ``cfg.entropy_coeff > 0``.
        norm: denominators of the whole mini-batch (default: this micro-batch alone).
    Returns:
        loss: scalar; stats: detached sums over this micro-batch's real tokens, each already divided
        by the same denominator (so they too add up over micro-batches): ``pg_loss``, ``kl``,
        ``entropy``, ``clip_frac``, ``dual_clip_frac``, ``approx_kl`` (old vs current).
    """
    if advantages.dim() == 1:
        if advantages.shape[0] != mask.shape[0]:
            raise ValueError(f"advantages: expected ({mask.shape[0]},) per row or {tuple(mask.shape)} per token, "
                             f"got {tuple(advantages.shape)}")
        advantages = advantages[:, None].expand_as(mask)
    _check_same_shape(mask, logp=logp, old_logp=old_logp, advantages=advantages, ref_logp=ref_logp, entropy=entropy)
    if cfg.kl_beta > 0 and ref_logp is None:
        raise ValueError(f"ref_logp: expected reference log-probs because kl_beta={cfg.kl_beta} > 0, got None")
    if cfg.entropy_coeff != 0 and entropy is None:
        raise ValueError(f"entropy: expected per-token entropy because entropy_coeff={cfg.entropy_coeff} != 0, got None")
    adv = advantages.to(logp.dtype)
    log_ratio = logp - old_logp.to(logp.dtype)
    per_token, clip_frac, dual = _surrogate(log_ratio, adv, cfg)

    def agg(x):
        return aggregate(x, mask, cfg.aggregation, norm)

    stats = {"pg_loss": agg(per_token).detach(), "clip_frac": agg(clip_frac.to(logp.dtype)).detach(),
             "dual_clip_frac": agg(dual.to(logp.dtype)).detach(), "approx_kl": agg(-log_ratio).detach()}
    total = per_token
    if ref_logp is not None:
        kl = kl_estimate(logp, ref_logp.to(logp.dtype), cfg.kl_estimator)
        stats["kl"] = agg(kl).detach()
        if cfg.kl_beta > 0:
            total = total + cfg.kl_beta * kl
    if entropy is not None:
        stats["entropy"] = agg(entropy).detach()
        if cfg.entropy_coeff != 0:
            total = total - cfg.entropy_coeff * entropy
    return agg(total), stats


def group_advantages(
    rewards: torch.Tensor,
    group_ids: Sequence[Hashable] | torch.Tensor,
    *,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO advantages: each reward minus its group's mean, divided by the group's std (+ eps).

    Args:
        rewards: (B,) float, one scalar reward per response.
        group_ids: (B,) the prompt group of each response (responses to one prompt share an id).
        norm_by_std: divide by the unbiased (n - 1) standard deviation of the group's rewards.
    Returns (B,) float32. A group of one response has no baseline: its advantage is 0. A group whose
    rewards are all equal gets 0 everywhere (its std is 0, the centred rewards are 0).
    """
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 1:
        raise ValueError(f"rewards: expected a (B,) tensor, got shape {tuple(getattr(rewards, 'shape', ()))}")
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards: expected finite values, got NaN or inf")
    ids = group_ids.tolist() if isinstance(group_ids, torch.Tensor) else list(group_ids)
    if len(ids) != rewards.shape[0]:
        raise ValueError(f"group_ids: expected {rewards.shape[0]} ids (one per reward), got {len(ids)}")
    index: dict[Hashable, int] = {}
    gid = torch.tensor([index.setdefault(u, len(index)) for u in ids], dtype=torch.long, device=rewards.device)
    r = rewards.float()
    G = len(index)
    count = torch.zeros(G, device=r.device).index_add_(0, gid, torch.ones_like(r))
    mean = torch.zeros(G, device=r.device).index_add_(0, gid, r) / count
    centred = r - mean[gid]
    if norm_by_std:
        sq = torch.zeros(G, device=r.device).index_add_(0, gid, centred.square())
        std = (sq / (count - 1).clamp(min=1)).sqrt()
        std = std[gid]
        centred = torch.where(std > 0, centred / (std + eps), torch.zeros_like(centred))
    return torch.where(count[gid] > 1, centred, torch.zeros_like(centred))
