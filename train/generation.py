"""Sampling rollouts with transformers' ``generate`` on the policy's current weights (small scale).

The policy (a ``dualkv.models.CausalLM``, possibly FSDP-sharded) is exported once as a transformers
checkpoint and loaded with ``AutoModelForCausalLM``; before every rollout the sampler copies the
policy's current weights into it (parameter names are transformers' own). Only rank 0 samples; the
weight gather is a collective every rank joins (``sync``).

Sampling is plain ancestral sampling at ``temperature`` (no top-k / top-p), so the old-policy
log-probs the trainer recomputes are those of the distribution that produced the tokens. A response
is the generated tokens up to and including the first end-of-sequence token (at least one token).
"""

from __future__ import annotations

import tempfile

import torch
import torch.distributed as dist

from .distributed import full_state_dict

__all__ = ["HFSampler", "split_responses"]


def split_responses(generated: torch.Tensor, eos_id: int) -> list[torch.Tensor]:
    """(B, new) generated ids -> B responses cut after the first ``eos_id`` (kept), each >= 1 token."""
    out = []
    for row in generated:
        hits = (row == eos_id).nonzero()
        end = int(hits[0, 0]) + 1 if hits.numel() else row.numel()
        out.append(row[: max(end, 1)].clone())
    return out


class HFSampler:
    """``Sampler`` (see ``sources``) backed by a transformers copy of the policy on rank 0."""

    def __init__(self, policy, *, eos_id: int, pad_id: int, device: torch.device | str = "cpu") -> None:
        self.policy, self.eos_id, self.pad_id = policy, eos_id, pad_id
        self.device = torch.device(device)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.hf_model = None

    def _build(self, state: dict[str, torch.Tensor]) -> None:
        from transformers import AutoModelForCausalLM

        from dualkv.models.model import CausalLM

        with torch.device("meta"):
            plain = CausalLM(self.policy.config)
        plain = plain.to_empty(device="cpu")
        plain.load_state_dict(state)
        plain.tie_weights()
        from transformers.utils import logging as hf_logging

        bar = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            with tempfile.TemporaryDirectory() as tmp:
                plain.save_pretrained(tmp)
                self.hf_model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).to(self.device).eval()
        finally:
            if bar:
                hf_logging.enable_progress_bar()

    def sync(self) -> None:
        """Copy the policy's current weights into the sampling model (a collective)."""
        state = full_state_dict(self.policy)
        if self.rank != 0:
            return
        if self.hf_model is None:
            self._build(state)
            return
        own = self.hf_model.state_dict()
        missing = sorted(set(own) - set(state))
        if missing or any(own[k].shape != state[k].shape for k in own):
            self._build(state)  # names or layouts differ: go through the checkpoint conversion
            return
        with torch.no_grad():
            for k, t in own.items():
                t.copy_(state[k])

    @torch.no_grad()
    def sample(self, prompts: list[torch.Tensor], n: int, max_new_tokens: int, temperature: float,
               seed: int) -> list[list[torch.Tensor]]:
        """For every prompt (P,) int64, ``n`` sampled responses; deterministic given ``seed`` and the weights."""
        if self.hf_model is None:
            raise ValueError("sampler: call sync() before sample() (the sampling model has no weights yet)")
        width = max(p.numel() for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding
            ids[i, width - p.numel():] = p
            mask[i, width - p.numel():] = 1
        ids = ids.repeat_interleave(n, 0).to(self.device)
        mask = mask.repeat_interleave(n, 0).to(self.device)
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(seed)
            out = self.hf_model.generate(
                input_ids=ids, attention_mask=mask, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                max_new_tokens=max_new_tokens, eos_token_id=self.eos_id, pad_token_id=self.pad_id,
            )
        responses = split_responses(out[:, width:].cpu(), self.eos_id)
        return [responses[i * n:(i + 1) * n] for i in range(len(prompts))]
