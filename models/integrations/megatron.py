"""DualKV attention in Megatron-core models: a core attention, layer specs, inputs and log-probs.

A Megatron ``GPTModel`` runs a packed P + N*R micro-batch in Megatron's ``thd`` format::

    config = TransformerConfig(..., attention_dropout=0.0)           # dense or MoE
    model = build_gpt_model(config, vocab_size=V, max_sequence_length=4096)
    inputs = megatron_inputs(layout)                                  # ids, positions, packed params
    logits = model(inputs.input_ids, inputs.position_ids, None, packed_seq_params=inputs.packed_seq_params)
    logprobs = logprobs_from_logits(logits, layout)                   # (B, R_max)

Pieces:

- ``DualKVCoreAttention``: the ``core_attention`` of ``SelfAttentionSubmodules`` (Megatron's
  ``DotProductAttention`` constructor and ``forward`` contract, ``thd`` tensors ``(T, heads, d)``,
  K/V un-expanded for GQA). The layout rides in ``DualKVPackedSeqParams.layout``. Under tensor
  parallelism every rank holds whole heads, so each rank runs the op on its own heads; Megatron's
  sequence parallelism gathers the sequence before attention and composes too. Context
  parallelism is refused (it splits sequences across ranks; the layout is not split).
- ``dualkv_layer_spec`` / ``dualkv_moe_layer_spec`` / ``with_dualkv_attention``: layer specs.
- ``DualKVGPTModel``: a ``GPTModel`` whose rotary embedding is taken at every token's LOGICAL
  position (a response continues at P, not at 0). Megatron derives RoPE positions from the
  ``cu_seqlens`` of the packed parameters, restarting at 0 for every sequence, so a plain
  ``GPTModel`` would rotate response tokens wrongly; the core attention therefore refuses to run
  unless its model declared that positions come from the layout (``positions_from_layout``).
- ``megatron_inputs``, ``logprobs_from_logits`` (vocabulary-parallel aware), ``response_logprobs``.

Shape legend: T packed tokens, H query heads (per TP rank), K key/value heads (per rank), d head
dim, V vocabulary (V/tp per rank), n response tokens.
"""

from __future__ import annotations

import copy
import inspect
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention

from dualkv.core import PackedLayout, dualkv_attention

__all__ = [
    "DualKVPackedSeqParams",
    "DualKVCoreAttention",
    "DualKVGPTModel",
    "MegatronInputs",
    "packed_seq_params",
    "megatron_inputs",
    "with_dualkv_attention",
    "dualkv_layer_spec",
    "dualkv_moe_layer_spec",
    "build_gpt_model",
    "logprobs_from_logits",
    "response_logprobs",
]

_CAUSAL_MASK_TYPES = (AttnMaskType.causal, AttnMaskType.padding_causal)


# ---------------------------------------------------------------------------------------- inputs
@dataclass
class DualKVPackedSeqParams(PackedSeqParams):
    """Megatron's packed-sequence parameters plus the DualKV layout (``qkv_format="thd"``).

    ``cu_seqlens_q/kv`` are the layout's segments (prompts and responses) and ``max_seqlen_q/kv``
    the longest LOGICAL sequence (max P + R), the positions RoPE must cover.
    """

    layout: PackedLayout | None = None


def packed_seq_params(layout: PackedLayout) -> DualKVPackedSeqParams:
    """The packed-sequence parameters of ``layout`` for ``GPTModel.forward(packed_seq_params=...)``."""
    if not isinstance(layout, PackedLayout):
        raise ValueError(f"layout: expected a dualkv.core.PackedLayout, got {type(layout).__name__}")
    longest = max(p + r for p, rs in zip(layout.prompt_lens, layout.response_lens) for r in rs)
    return DualKVPackedSeqParams(
        qkv_format="thd", cu_seqlens_q=layout.cu_seqlens, cu_seqlens_kv=layout.cu_seqlens,
        max_seqlen_q=longest, max_seqlen_kv=longest, layout=layout,
    )


class MegatronInputs(NamedTuple):
    """input_ids, position_ids: (1, T) int64; packed_seq_params: ``DualKVPackedSeqParams``."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    packed_seq_params: DualKVPackedSeqParams


def megatron_inputs(layout: PackedLayout) -> MegatronInputs:
    """Everything ``GPTModel.forward`` needs besides ``attention_mask=None``, from one layout."""
    params = packed_seq_params(layout)
    if layout.input_ids is None:
        raise ValueError("layout: expected a layout carrying input_ids (from_groups / from_rows), got one built from lengths only")
    return MegatronInputs(layout.input_ids[None], layout.position_ids[None], params)


# ------------------------------------------------------------------------------ core attention
def _refuse(cond: bool, msg: str) -> None:
    if cond:
        raise ValueError(msg)


def _check_config(config: TransformerConfig, attention_type: str, attention_dropout, cp_size: int) -> None:
    dropout = config.attention_dropout if attention_dropout is None else attention_dropout
    _refuse(attention_type != "self", f"attention_type: DualKV attention is self-attention, got {attention_type!r}")
    _refuse(cp_size > 1 or config.context_parallel_size > 1,
            f"context_parallel_size: DualKV attention needs whole sequences on each rank (the layout is not split); "
            f"got {max(cp_size, config.context_parallel_size)}. Use tensor parallelism, or dualkv.parallel's Ulysses")
    _refuse(bool(dropout), f"attention_dropout: DualKV attention has no dropout; set attention_dropout=0.0 (got {dropout})")
    _refuse(config.softmax_type != "vanilla", f"softmax_type: DualKV attention supports 'vanilla', got {config.softmax_type!r}")
    _refuse(config.multi_latent_attention, "multi_latent_attention: not supported by DualKV attention")
    _refuse(config.qk_clip or config.log_max_attention_logit,
            "qk_clip / log_max_attention_logit: DualKV attention does not record max attention logits")


def _layer_window(config: TransformerConfig, layer_number: int) -> int | None:
    """Megatron's (left, right) window -> DualKV's window (query i sees keys j with i - j < window)."""
    if not is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
        return None
    left, right = config.window_size
    _refuse(right not in (0, -1), f"window_size: DualKV attention is causal; expected (left, 0), got {tuple(config.window_size)}")
    return None if left < 0 else left + 1


class DualKVCoreAttention(MegatronModule):
    """DualKV attention as Megatron's core attention (``thd`` packed format only).

    Constructor: Megatron's ``DotProductAttention`` arguments, plus ``softcap`` (logit softcap)
    and ``backend`` (``dualkv_attention``'s backend) that a layer spec can set through
    ``ModuleSpec(params=...)``. Scale: ``softmax_scale`` or 1/sqrt(kv_channels); window: the layer's
    ``config.window_size`` (honouring ``window_attn_skip_freq``); ``config.deterministic_mode`` is
    passed on.

    ``positions_from_layout``: True once the owning model gives every token its layout position
    (``DualKVGPTModel`` sets it); forward refuses to run before that.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        softcap: float | None = None,
        backend: str = "auto",
    ):
        super().__init__(config=config)
        cp = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        _check_config(config, attention_type, attention_dropout, cp.size() if cp is not None else 1)
        _refuse(attn_mask_type not in _CAUSAL_MASK_TYPES,
                f"attn_mask_type: DualKV attention is causal (the layout is the mask), got {attn_mask_type}")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.window = _layer_window(config, self.layer_number)
        self.softcap = softcap
        self.backend = backend
        self.positions_from_layout = False

    def _layout(self, packed_seq_params) -> PackedLayout:
        layout = getattr(packed_seq_params, "layout", None)
        _refuse(not isinstance(layout, PackedLayout),
                "packed_seq_params: DualKV attention needs DualKVPackedSeqParams carrying the layout "
                "(dualkv.models.integrations.megatron.packed_seq_params(layout))")
        _refuse(packed_seq_params.qkv_format != "thd", f"packed_seq_params: expected qkv_format 'thd', got {packed_seq_params.qkv_format!r}")
        _refuse(not self.positions_from_layout,
                "DualKVCoreAttention: its model has not declared layout positions; build the model with "
                "build_gpt_model / DualKVGPTModel (a plain GPTModel restarts RoPE positions at 0 for every response)")
        return layout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        """query: (T, H, d); key, value: (T, K, d), K un-expanded. Returns (T, H * d)."""
        layout = self._layout(packed_seq_params)
        _refuse(attention_mask is not None, "attention_mask: the packed layout defines the mask; pass attention_mask=None")
        _refuse(attention_bias is not None, "attention_bias: not supported by DualKV attention")
        _refuse(attn_mask_type is not None and attn_mask_type not in _CAUSAL_MASK_TYPES,
                f"attn_mask_type: DualKV attention is causal, got {attn_mask_type}")
        _refuse(query.dim() != 3, f"query: expected the thd shape (T, heads, headdim), got {tuple(query.shape)}")
        out_THd = dualkv_attention(
            query, key, value, layout, softmax_scale=self.softmax_scale, window=self.window, softcap=self.softcap,
            deterministic=self.config.deterministic_mode, backend=self.backend,
        )
        return out_THd.reshape(out_THd.shape[0], -1)


# ---------------------------------------------------------------------------------- layer specs
def with_dualkv_attention(layer_spec: ModuleSpec, *, softcap: float | None = None, backend: str = "auto") -> ModuleSpec:
    """A copy of a ``TransformerLayer`` spec (local or Transformer Engine, dense or MoE) whose
    self-attention's ``core_attention`` is ``DualKVCoreAttention``."""
    attn = getattr(getattr(layer_spec, "submodules", None), "self_attention", None)
    sub = getattr(attn, "submodules", None)
    _refuse(sub is None or not hasattr(sub, "core_attention"),
            "layer_spec: expected a TransformerLayer spec whose self_attention has SelfAttentionSubmodules")
    spec = copy.deepcopy(layer_spec)
    spec.submodules.self_attention.submodules.core_attention = ModuleSpec(
        module=DualKVCoreAttention, params={"softcap": softcap, "backend": backend}
    )
    return spec


def dualkv_layer_spec(
    *, qk_layernorm: bool = True, normalization: str = "RMSNorm", softcap: float | None = None, backend: str = "auto"
) -> ModuleSpec:
    """Dense GPT / Qwen3 layer (Megatron-core local modules) with DualKV attention.

    Qwen3: ``qk_layernorm=True``, RMSNorm, and in the config ``gated_linear_unit=True``,
    ``activation_func=F.silu``, ``add_bias_linear=False``.
    """
    return with_dualkv_attention(
        get_gpt_layer_local_spec(qk_layernorm=qk_layernorm, normalization=normalization), softcap=softcap, backend=backend
    )


def dualkv_moe_layer_spec(
    num_experts: int,
    *,
    qk_layernorm: bool = True,
    normalization: str = "RMSNorm",
    moe_grouped_gemm: bool = False,
    softcap: float | None = None,
    backend: str = "auto",
) -> ModuleSpec:
    """MoE layer (Megatron's ``MoELayer``, ``TopKRouter`` and experts) with DualKV attention.

    Qwen3-30B-A3B style: 128 experts, ``moe_router_topk=8``, ``moe_ffn_hidden_size`` set in the config.
    """
    _refuse(not isinstance(num_experts, int) or num_experts < 1, f"num_experts: expected an int >= 1, got {num_experts!r}")
    spec = get_gpt_layer_local_spec(
        num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm, qk_layernorm=qk_layernorm, normalization=normalization
    )
    return with_dualkv_attention(spec, softcap=softcap, backend=backend)


# ---------------------------------------------------------------------------------------- model
class DualKVGPTModel(GPTModel):
    """``GPTModel`` on the packed layout: RoPE taken at every token's logical position.

    Same constructor as ``GPTModel``. Refuses settings that would place tokens at the wrong
    positions: ``apply_rope_fusion`` (Transformer Engine's packed RoPE restarts each sequence at
    0), multimodal RoPE, multi-token prediction (it rolls labels across packed sequences).
    """

    def __init__(self, config: TransformerConfig, transformer_layer_spec, *args, **kwargs):
        super().__init__(config, transformer_layer_spec, *args, **kwargs)
        rope = self.position_embedding_type in ("rope", "yarn")
        _refuse(rope and config.apply_rope_fusion,
                "apply_rope_fusion: fused packed RoPE restarts positions at 0 for every sequence; set apply_rope_fusion=False")
        _refuse(self.position_embedding_type == "mrope", "position_embedding_type: 'mrope' is not supported with the packed layout")
        _refuse(bool(config.mtp_num_layers), "mtp_num_layers: multi-token prediction is not supported with the packed layout")
        for module in self.modules():
            if isinstance(module, DualKVCoreAttention):
                module.positions_from_layout = True

    def _preprocess(self, *args, **kwargs):
        out = super()._preprocess(*args, **kwargs)
        bound = inspect.signature(super()._preprocess).bind(*args, **kwargs)
        layout = getattr(bound.arguments.get("packed_seq_params"), "layout", None)
        if out[1] is None or not isinstance(layout, PackedLayout):
            return out
        # out[1]: rotary embedding (positions 0..max P+R-1, 1, 1, rot_dim) -> one row per packed
        # token at its logical position; Megatron's thd RoPE then uses row t for token t.
        return (out[0], out[1][layout.position_ids], *out[2:])


def build_gpt_model(
    config: TransformerConfig,
    vocab_size: int,
    max_sequence_length: int,
    *,
    num_experts: int | None = None,
    layer_spec: ModuleSpec | None = None,
    position_embedding_type: str = "rope",
    **gpt_kwargs,
) -> DualKVGPTModel:
    """A ``DualKVGPTModel`` with DualKV attention in one call.

    Dense by default; MoE when ``num_experts`` (or ``config.num_moe_experts``) is set; or pass any
    ``layer_spec`` (it gets DualKV attention). ``qk_layernorm`` and the norm follow ``config``.
    Other keyword arguments go to ``GPTModel`` (``rotary_base``, ``share_embeddings_and_output_weights``, ...).
    """
    num_experts = num_experts if num_experts is not None else config.num_moe_experts
    if layer_spec is not None:
        spec = with_dualkv_attention(layer_spec)
    elif num_experts:
        _refuse(config.num_moe_experts != num_experts,
                f"num_experts: expected config.num_moe_experts ({config.num_moe_experts}) to match, got {num_experts}")
        spec = dualkv_moe_layer_spec(num_experts, qk_layernorm=config.qk_layernorm, normalization=config.normalization,
                                     moe_grouped_gemm=config.moe_grouped_gemm)
    else:
        spec = dualkv_layer_spec(qk_layernorm=config.qk_layernorm, normalization=config.normalization)
    return DualKVGPTModel(config, spec, vocab_size=vocab_size, max_sequence_length=max_sequence_length,
                          position_embedding_type=position_embedding_type, **gpt_kwargs)


# ------------------------------------------------------------------------------------ log-probs
def _tp_group(model: torch.nn.Module | None, tp_group):
    """The group the vocabulary is split over: given, the model's, Megatron's global one, or None."""
    if tp_group is not None:
        return tp_group
    pgs = getattr(model, "pg_collection", None)
    if pgs is not None and hasattr(pgs, "tp"):
        return pgs.tp
    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_tensor_model_parallel_group()


def _vocab_parallel_logprobs(logits_nv: torch.Tensor, targets_n: torch.Tensor, group) -> torch.Tensor:
    """log p(target) (n,) float32 from logits split over the vocabulary (rank r holds [r*v, (r+1)*v))."""
    logits_nv = logits_nv.float()
    v = logits_nv.shape[-1]
    world = group.size() if group is not None else 1
    start = (group.rank() if world > 1 else 0) * v
    logit_max = logits_nv.detach().max(dim=-1).values
    if world > 1:
        torch.distributed.all_reduce(logit_max, op=torch.distributed.ReduceOp.MAX, group=group)
    shifted = logits_nv - logit_max[:, None]
    local = targets_n - start
    mine = (local >= 0) & (local < v)
    target_logit = shifted.gather(-1, local.clamp(0, v - 1)[:, None]).squeeze(-1) * mine
    sum_exp = shifted.exp().sum(dim=-1)
    if world > 1:  # forward all-reduce, backward identity: every rank holds the same loss
        target_logit = reduce_from_tensor_model_parallel_region(target_logit, group=group)
        sum_exp = reduce_from_tensor_model_parallel_region(sum_exp, group=group)
    return target_logit - torch.log(sum_exp)


def logprobs_from_logits(
    logits: torch.Tensor, layout: PackedLayout, temperature: float = 1.0, *, tp_group=None, model=None
) -> torch.Tensor:
    """A Megatron model's packed logits (1, T, V/tp) or (T, V/tp) -> (B, R_max) float32 log-probs.

    Logits may be split over the vocabulary across tensor-parallel ranks (``parallel_output=True``,
    Megatron's default); ``tp_group`` defaults to ``model``'s, else Megatron's global one. Every TP
    rank gets the same result. Differentiable; zero-padded (``layout.response_mask()``).
    """
    _refuse(not isinstance(layout, PackedLayout) or layout.input_ids is None,
            "layout: expected a dualkv.core.PackedLayout carrying input_ids (from_groups / from_rows)")
    _refuse(not (isinstance(temperature, (int, float)) and temperature > 0), f"temperature: expected a positive number, got {temperature!r}")
    if logits.dim() == 3:
        _refuse(logits.shape[0] != 1, f"logits: expected the packed batch (1, T, V), got {tuple(logits.shape)}")
        logits = logits[0]
    _refuse(logits.dim() != 2 or logits.shape[0] != layout.total_tokens,
            f"logits: expected shape (1, {layout.total_tokens}, vocab) or ({layout.total_tokens}, vocab), got {tuple(logits.shape)}")
    src, tgt = layout.logprob_index()
    rows = logits[src]
    if temperature != 1.0:
        rows = rows / temperature
    lp = _vocab_parallel_logprobs(rows, layout.input_ids[tgt], _tp_group(model, tp_group))
    return layout.unpack_logprobs(lp)


def response_logprobs(model: GPTModel, layout: PackedLayout, temperature: float = 1.0) -> torch.Tensor:
    """Run ``model`` (built by ``build_gpt_model``) on ``layout`` and return (B, R_max) log-probs."""
    _refuse(not isinstance(model, DualKVGPTModel), f"model: expected a DualKVGPTModel (build_gpt_model), got {type(model).__name__}")
    tp = model.pg_collection.tp
    _refuse(model.config.sequence_parallel and layout.total_tokens % tp.size() != 0,
            f"layout: sequence_parallel splits the T={layout.total_tokens} packed tokens over {tp.size()} ranks; "
            f"T must be a multiple of the tensor-parallel size")
    inputs = megatron_inputs(layout)
    logits = model(inputs.input_ids, inputs.position_ids, None, packed_seq_params=inputs.packed_seq_params)
    return logprobs_from_logits(logits, layout, temperature, tp_group=tp)
