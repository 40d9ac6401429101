"""dualkv.models.integrations: DualKV inside other frameworks' models.

- ``hf``: the ``"dualkv"`` attention for Hugging Face transformers (``model.set_attn_implementation("dualkv")``).
- ``megatron``: a DualKV core attention, layer specs and helpers for Megatron-core ``GPTModel``
  (import ``dualkv.models.integrations.megatron`` explicitly; it needs megatron-core).
- ``replicated``: the N-replicated padded batch a layout stands for (the baseline to compare with).

Importing this package imports neither transformers nor megatron.
"""

from .hf import ATTN_IMPLEMENTATION, dualkv_attention_forward, register, response_logprobs
from .replicated import ReplicatedBatch, replicated_batch, replicated_response_logprobs

__all__ = [
    "ATTN_IMPLEMENTATION",
    "register",
    "dualkv_attention_forward",
    "response_logprobs",
    "ReplicatedBatch",
    "replicated_batch",
    "replicated_response_logprobs",
]
