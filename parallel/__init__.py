"""dualkv.parallel: Ulysses sequence parallelism for the packed layout, the last-prompt-token
hidden-state all-reduce, and the (dp, sp) device mesh.

Typical use (every rank of an SP group holds the same micro-batch ``layout``)::

    mesh = init_sp_mesh(sp_size=4)
    parallelize_sequence(model, mesh.sp_group)
    logprobs = sp_response_logprobs(model, layout, mesh.sp_group)   # (B, R_max), same on SP ranks
    loss(logprobs).backward()          # SP ranks' parameter gradients add up to the full gradient

See docs/parallel.md.
"""

from .deepspeed import DeepSpeedLocalAttention, DeepSpeedUlyssesAttention, deepspeed_available
from .groups import as_process_group, group_rank, group_size
from .logprobs import (
    LogprobHead,
    LogprobPlan,
    all_reduce_sum,
    linear_head,
    logits_head,
    logprobs_from_hidden,
    model_head,
    plan_logprobs,
    share_last_prompt_hidden,
    sp_hidden_states,
    sp_response_logprobs,
    sp_router_stats,
)
from .mesh import SPMesh, init_sp_mesh, prepare_fsdp_for_sp
from .parallelize import attention_modules, check_parallelized, parallelize_sequence, unparallelize_sequence
from .sequence import SequenceShard, gather_sequence, pad_to_multiple, shard_sequence
from .ulysses import (
    UlyssesAttention,
    heads_to_seq,
    kv_replication_factor,
    replicate_kv_heads,
    seq_to_heads,
    ulysses_attention,
)

__all__ = [
    "SPMesh",
    "init_sp_mesh",
    "prepare_fsdp_for_sp",
    "SequenceShard",
    "shard_sequence",
    "gather_sequence",
    "pad_to_multiple",
    "UlyssesAttention",
    "ulysses_attention",
    "seq_to_heads",
    "heads_to_seq",
    "kv_replication_factor",
    "replicate_kv_heads",
    "all_reduce_sum",
    "share_last_prompt_hidden",
    "LogprobPlan",
    "plan_logprobs",
    "logprobs_from_hidden",
    "LogprobHead",
    "logits_head",
    "linear_head",
    "model_head",
    "sp_hidden_states",
    "sp_response_logprobs",
    "sp_router_stats",
    "parallelize_sequence",
    "unparallelize_sequence",
    "check_parallelized",
    "attention_modules",
    "DeepSpeedLocalAttention",
    "DeepSpeedUlyssesAttention",
    "deepspeed_available",
    "as_process_group",
    "group_rank",
    "group_size",
]
