"""Log-probs of response tokens from packed logits.

The first token of every response is predicted by its group's LAST PROMPT token; the rest by the
previous response token (``PackedLayout.logprob_index``). Results come back as (B, R_max) rows.
"""

from __future__ import annotations

import torch

__all__ = ["gather_logprobs", "response_logprobs_from_logits"]


def gather_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """logits (n, V), targets (n,) -> log p(target) (n,) in float32."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def response_logprobs_from_logits(logits: torch.Tensor, layout, temperature: float = 1.0) -> torch.Tensor:
    """logits (T, V) over the packed layout -> (B, R_max) float32 log-probs, zero-padded."""
    if layout.input_ids is None:
        raise ValueError("layout: expected a layout carrying input_ids (from_groups / from_rows), got one built from lengths only")
    if logits.dim() != 2 or logits.shape[0] != layout.total_tokens:
        raise ValueError(f"logits: expected shape ({layout.total_tokens}, vocab), got {tuple(logits.shape)}")
    src, tgt = layout.logprob_index()
    return layout.unpack_logprobs(gather_logprobs(logits[src], layout.input_ids[tgt], temperature))
