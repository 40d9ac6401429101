"""dualkv.core: the packed layout, the DualKV attention op and its backends, log-prob extraction.

Exact shared-prompt attention: a micro-batch holds each prompt once and its N responses after it
(P + N*R tokens instead of N*(P+R)); every layer gives the same result as the replicated batch.
"""

from .interface import dualkv_attention, flash_attn_dualkv_varlen_func
from .layout import PackedLayout
from .logprobs import gather_logprobs, linear_logprobs, logprobs_from_logits, response_logprobs_from_logits
from .reference import AttnMeta, reference_attention

__all__ = [
    "PackedLayout",
    "dualkv_attention",
    "flash_attn_dualkv_varlen_func",
    "reference_attention",
    "AttnMeta",
    "gather_logprobs",
    "response_logprobs_from_logits",
    "logprobs_from_logits",
    "linear_logprobs",
]
