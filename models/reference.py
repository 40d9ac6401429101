"""The oracle for every model test and benchmark: transformers' own model on the N-replicated batch.

``hf_model(cfg)`` builds the transformers model a ``ModelConfig`` describes (via ``to_hf_config``);
``hf_response_logprobs(hf_model, layout)`` runs it on the replicated padded rows the layout stands for
(prompt copied into every row, right-padded, attention mask on padding) and returns the (B, R_max)
response log-probs (and entropies) in the layout's row order. Imports transformers lazily.
"""

from __future__ import annotations

import torch

from dualkv.core import PackedLayout
from dualkv.core.logprobs import logprobs_from_logits

from .config import ModelConfig, to_hf_config
from .integrations.replicated import replicated_batch

__all__ = ["hf_config", "hf_model", "hf_response_logprobs", "hf_aux_loss"]


def hf_config(cfg: ModelConfig | dict):
    """The transformers config object for a ModelConfig (or a config.json dict)."""
    from transformers import AutoConfig

    d = dict(to_hf_config(cfg) if isinstance(cfg, ModelConfig) else cfg)
    d.pop("architectures", None)
    d.pop("dtype", None)
    return AutoConfig.for_model(d.pop("model_type"), **d)


def hf_model(cfg: ModelConfig | dict, dtype: torch.dtype = torch.float32, device=None, attn_implementation: str = "eager"):
    """A randomly initialised transformers causal LM for ``cfg``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(hf_config(cfg), attn_implementation=attn_implementation, dtype=dtype)
    return model.to(device) if device is not None else model


def _run(hf, layout: PackedLayout, pad_token_id: int, **kwargs):
    batch = replicated_batch(layout, pad_token_id=pad_token_id)
    out = hf(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
             use_cache=False, **kwargs)
    return batch, out


def hf_response_logprobs(hf, layout: PackedLayout, temperature: float = 1.0, return_entropy: bool = False,
                         pad_token_id: int = 0):
    """(B, R_max) float32 log-probs [, entropies] of transformers' model on the replicated batch."""
    batch, out = _run(hf, layout, pad_token_id)
    B, L = batch.input_ids.shape
    flat_nV = out.logits.reshape(B * L, -1)[batch.src]
    lp_n, ent_n = logprobs_from_logits(flat_nV, batch.input_ids.reshape(-1)[batch.tgt], temperature)
    lp = layout.unpack_logprobs(lp_n)
    return (lp, layout.unpack_logprobs(ent_n)) if return_entropy else lp


def hf_aux_loss(hf, layout: PackedLayout, pad_token_id: int = 0) -> torch.Tensor:
    """transformers' router load-balancing loss on the replicated batch (padding masked out)."""
    _, out = _run(hf, layout, pad_token_id, output_router_logits=True)
    if out.aux_loss is None:
        raise ValueError("hf: expected a MoE model that reports aux_loss, got none")
    return out.aux_loss
