"""Rollout batches: prompt groups of N responses with rewards, and their validation.

A ``RolloutBatch`` is what one RL step trains on: G prompt groups, group g holding its prompt once,
N_g responses, one scalar reward per response and, optionally, per-token log-probs of the sampling
(old) policy and of the reference policy, or precomputed advantages. Everything is held per group,
which is exactly the unit the packed layout stores once (``PackedLayout.from_groups``).

Shape vocabulary: P prompt length, R_i response length, N responses in a group.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field, replace

import torch

from .losses import LossConfig, group_advantages

__all__ = ["RolloutGroup", "RolloutBatch"]


def _fail(msg: str) -> None:
    raise ValueError(msg)


def _check_ids(t, name: str) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 1:
        _fail(f"{name}: expected a 1-D tensor of token ids, got {getattr(t, 'shape', type(t).__name__)}")
    if t.dtype != torch.long:
        _fail(f"{name}: expected int64 token ids, got dtype {t.dtype}")
    if t.numel() == 0:
        _fail(f"{name}: expected at least 1 token, got an empty sequence")
    if bool((t < 0).any()):
        _fail(f"{name}: expected token ids >= 0, got {int(t.min())}")


def _check_logprobs(values, lens: Sequence[int], name: str) -> None:
    if values is None:
        return
    if len(values) != len(lens):
        _fail(f"{name}: expected one tensor per response ({len(lens)}), got {len(values)}")
    for i, (v, n) in enumerate(zip(values, lens)):
        if not isinstance(v, torch.Tensor) or v.dim() != 1 or v.numel() != n:
            _fail(f"{name}[{i}]: expected a ({n},) tensor (one log-prob per response token), got "
                  f"{tuple(getattr(v, 'shape', ()))}")
        if not bool(torch.isfinite(v).all()) or bool((v > 1e-4).any()):
            _fail(f"{name}[{i}]: expected finite log-probs <= 0")


@dataclass
class RolloutGroup:
    """One prompt and its N sampled responses.

    Attributes:
        prompt_ids: (P,) int64.
        response_ids: N tensors (R_i,) int64, each with at least one token.
        rewards: (N,) float32, one scalar reward per response.
        uid: the group's id (any hashable; used in messages and kept through batching).
        advantages: (N,) float32 precomputed advantages, or None (computed from rewards per group).
        old_logprobs / ref_logprobs: N tensors (R_i,) float32 of the sampling / reference policy,
            or None (recomputed by the old_log_prob / ref_log_prob passes).
    """

    prompt_ids: torch.Tensor
    response_ids: list[torch.Tensor]
    rewards: torch.Tensor
    uid: Hashable = None
    advantages: torch.Tensor | None = None
    old_logprobs: list[torch.Tensor] | None = None
    ref_logprobs: list[torch.Tensor] | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        where = f"group {self.uid!r}"
        _check_ids(self.prompt_ids, f"{where} prompt_ids")
        if not isinstance(self.response_ids, (list, tuple)) or len(self.response_ids) == 0:
            _fail(f"{where} response_ids: expected a non-empty list of responses, got {self.response_ids!r}")
        for i, r in enumerate(self.response_ids):
            _check_ids(r, f"{where} response_ids[{i}]")
        n = len(self.response_ids)
        for name in ("rewards", "advantages"):
            v = getattr(self, name)
            if v is None and name == "advantages":
                continue
            if not isinstance(v, torch.Tensor) or v.dim() != 1 or v.numel() != n:
                _fail(f"{where} {name}: expected a ({n},) tensor (one per response), got {tuple(getattr(v, 'shape', ()))}")
            if not v.is_floating_point() or not bool(torch.isfinite(v).all()):
                _fail(f"{where} {name}: expected finite floating-point values, got {v.tolist()}")
        lens = self.response_lens
        _check_logprobs(self.old_logprobs, lens, f"{where} old_logprobs")
        _check_logprobs(self.ref_logprobs, lens, f"{where} ref_logprobs")

    @property
    def num_responses(self) -> int:
        return len(self.response_ids)

    @property
    def prompt_len(self) -> int:
        return int(self.prompt_ids.numel())

    @property
    def response_lens(self) -> list[int]:
        return [int(r.numel()) for r in self.response_ids]

    @property
    def packed_tokens(self) -> int:
        """P + sum_i R_i: the group's length in the packed layout."""
        return self.prompt_len + sum(self.response_lens)

    @property
    def replicated_tokens(self) -> int:
        """sum_i (P + R_i): the group's length with the prompt copied into every response."""
        return self.num_responses * self.prompt_len + sum(self.response_lens)


@dataclass
class RolloutBatch:
    """G prompt groups; every group-level field is all-or-none across the batch."""

    groups: list[RolloutGroup]
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.groups, (list, tuple)) or len(self.groups) == 0:
            _fail("groups: expected at least one prompt group, got none")
        for g in self.groups:
            if not isinstance(g, RolloutGroup):
                _fail(f"groups: expected RolloutGroup items, got {type(g).__name__}")
        for name in ("advantages", "old_logprobs", "ref_logprobs"):
            present = [getattr(g, name) is not None for g in self.groups]
            if any(present) and not all(present):
                first_missing = self.groups[present.index(False)].uid
                _fail(f"{name}: given for some groups but missing for group {first_missing!r}; expected all or none")

    # ------------------------------------------------------------------ sizes
    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def num_rows(self) -> int:
        return sum(g.num_responses for g in self.groups)

    @property
    def response_tokens(self) -> int:
        return sum(sum(g.response_lens) for g in self.groups)

    @property
    def packed_tokens(self) -> int:
        return sum(g.packed_tokens for g in self.groups)

    @property
    def replicated_tokens(self) -> int:
        return sum(g.replicated_tokens for g in self.groups)

    @property
    def rho(self) -> float:
        """Replicated over packed tokens: how many times fewer tokens the packed batch runs."""
        return self.replicated_tokens / self.packed_tokens

    @property
    def rewards(self) -> torch.Tensor:
        """(B,) rewards, group by group."""
        return torch.cat([g.rewards.float() for g in self.groups])

    @property
    def has_old_logprobs(self) -> bool:
        return self.groups[0].old_logprobs is not None

    @property
    def has_ref_logprobs(self) -> bool:
        return self.groups[0].ref_logprobs is not None

    def __len__(self) -> int:
        return self.num_groups

    # ------------------------------------------------------------------ transforms
    def check_vocab(self, vocab_size: int) -> None:
        """Every token id must index the model's vocabulary."""
        for g in self.groups:
            for name, t in [("prompt_ids", g.prompt_ids)] + [(f"response_ids[{i}]", r) for i, r in enumerate(g.response_ids)]:
                if int(t.max()) >= vocab_size:
                    _fail(f"group {g.uid!r} {name}: token id {int(t.max())} is outside the model's vocabulary "
                          f"(vocab_size={vocab_size})")

    def select(self, indices: Sequence[int]) -> RolloutBatch:
        return RolloutBatch([self.groups[i] for i in indices], dict(self.meta))

    def with_advantages(self, cfg: LossConfig) -> RolloutBatch:
        """A batch whose every group carries advantages (kept if given, else group-normalised rewards)."""
        if self.groups[0].advantages is not None:
            return self
        ids = [gi for gi, g in enumerate(self.groups) for _ in range(g.num_responses)]
        adv = group_advantages(self.rewards, ids, norm_by_std=cfg.norm_adv_by_std).split(
            [g.num_responses for g in self.groups])
        return RolloutBatch([replace(g, advantages=a) for g, a in zip(self.groups, adv)], dict(self.meta))

    def drop_uniform_groups(self) -> RolloutBatch | None:
        """The groups whose rewards are not all equal (DAPO dynamic sampling), or None if none are left."""
        keep = [i for i, g in enumerate(self.groups) if g.num_responses > 1 and bool((g.rewards != g.rewards[0]).any())]
        return self.select(keep) if keep else None

    def reward_stats(self) -> dict[str, float]:
        r = self.rewards
        return {"reward_mean": float(r.mean()), "reward_std": float(r.std()) if r.numel() > 1 else 0.0,
                "response_len_mean": self.response_tokens / self.num_rows}

    # ------------------------------------------------------------------ from padded rows
    @classmethod
    def from_rows(
        cls,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        response_mask: torch.Tensor,
        uid: Sequence[Hashable],
        rewards: torch.Tensor,
    ) -> RolloutBatch:
        """From padded rows as RL frameworks hold them: (B, L) ``[left-padded prompt | right-padded response]``.

        ``response_mask`` (B, L_resp) covers the last L_resp columns; rows sharing a ``uid`` must have
        identical prompts (checked); ``rewards`` (B,).
        """
        if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
            _fail(f"attention_mask: expected shape {tuple(input_ids.shape)} like input_ids, got {tuple(attention_mask.shape)}")
        B, L = input_ids.shape
        if response_mask.dim() != 2 or response_mask.shape[0] != B or response_mask.shape[1] > L:
            _fail(f"response_mask: expected shape (B={B}, L_resp<={L}), got {tuple(response_mask.shape)}")
        if len(uid) != B or rewards.shape != (B,):
            _fail(f"uid / rewards: expected {B} of each (one per row), got {len(uid)} and {tuple(rewards.shape)}")
        resp = torch.zeros(B, L, dtype=torch.bool, device=input_ids.device)
        resp[:, L - response_mask.shape[1]:] = response_mask.bool()
        prompt = attention_mask.bool() & ~resp
        groups: dict[Hashable, tuple[torch.Tensor, list, list, int]] = {}
        for b in range(B):
            p, r = input_ids[b][prompt[b]].long().cpu(), input_ids[b][resp[b]].long().cpu()
            if r.numel() == 0:
                _fail(f"response_mask: row {b} has no response tokens; expected at least 1")
            if uid[b] not in groups:
                groups[uid[b]] = (p, [], [], b)
            ref_p, rs, rw, first = groups[uid[b]]
            if p.shape != ref_p.shape or not torch.equal(p, ref_p):
                _fail(f"uid: rows {first} and {b} share uid {uid[b]!r} but their prompts differ; expected identical prompts")
            rs.append(r)
            rw.append(float(rewards[b]))
        return cls([RolloutGroup(p, rs, torch.tensor(rw), uid=u) for u, (p, rs, rw, _) in groups.items()])

    def describe(self) -> str:
        n = sorted({g.num_responses for g in self.groups})
        return (f"{self.num_groups} groups, N={n if len(n) > 1 else n[0]}, {self.num_rows} responses, packed "
                f"{self.packed_tokens} tokens vs replicated {self.replicated_tokens} (rho={self.rho:.2f})")


def finite_float(value, name: str) -> float:
    """A JSON number that is a finite float (bools are not numbers here)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        _fail(f"{name}: expected a finite number, got {value!r}")
    return float(value)
