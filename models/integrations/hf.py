"""DualKV attention for Hugging Face transformers models: ``attn_implementation="dualkv"``.

Stock decoder models (Qwen3, Qwen3-MoE, Llama, Gemma-2/3/4, ...) run a packed P + N*R micro-batch
once their attention is switched::

    import dualkv.models                      # registers "dualkv" with transformers
    model.set_attn_implementation("dualkv")
    out = model(input_ids=layout.input_ids[None], position_ids=layout.position_ids[None],
                dualkv_layout=layout, use_cache=False)
    logprobs = response_logprobs(model, layout)            # (B, R_max), like the replicated batch

The layout travels to every attention call through transformers' attention kwargs. The mask
function registered for ``"dualkv"`` builds nothing (the layout is the mask; no T x T tensor ever
exists) and refuses a padding ``attention_mask``, which a packed batch never needs, and chunked
attention. Per layer, the module's scaling, its
sliding window (``module.sliding_window``, set from ``config.layer_types``) and its logit softcap
(``attn_logit_softcapping``) go to ``dualkv.core.dualkv_attention``; settings it cannot honour
(attention dropout, non-causal attention, attention sinks, attention weights output) are refused.

Importing this module does not import transformers: the registration runs when transformers'
modelling code is imported (or at once if it already is). ``register()`` does it explicitly.

Shape legend: B batch (must be 1), T packed tokens, H query heads, K key/value heads, d head dim,
V vocabulary, n response tokens.
"""

from __future__ import annotations

import torch

from dualkv.core import PackedLayout, dualkv_attention
from dualkv.core.logprobs import gather_logprobs

from ._import_hook import call_when_imported

__all__ = ["ATTN_IMPLEMENTATION", "register", "dualkv_attention_forward", "dualkv_mask", "response_logprobs"]

ATTN_IMPLEMENTATION = "dualkv"
_TRANSFORMERS_MODULE = "transformers.modeling_utils"
_UNSET = object()


def register() -> None:
    """Register ``"dualkv"`` in transformers' attention and mask interfaces (idempotent)."""
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, dualkv_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, dualkv_mask)


def dualkv_mask(*args, attention_mask: torch.Tensor | None = None, config=None, **kwargs) -> None:
    """transformers' mask-function contract: no mask is built, the layout is the mask.

    Refuses a padding mask (a packed batch has no padding) and chunked attention (Llama-4's
    ``attention_chunk_size``), which the layout cannot express.
    """
    if attention_mask is not None:
        raise ValueError(
            "attention_mask: the packed layout defines the mask; pass attention_mask=None with the 'dualkv' attention"
        )
    if getattr(config, "attention_chunk_size", None) is not None:
        raise ValueError("attention_chunk_size: chunked attention is not supported by the 'dualkv' attention")
    return None


def _layer_window(module: torch.nn.Module, passed) -> int | None:
    """This layer's sliding window: as passed by the model, else the module's ``sliding_window``,
    else from ``config.layer_types[module.layer_idx]``, else ``config.sliding_window`` for models
    without layer types. transformers' "no window" values (None, 0) give None."""
    config = getattr(module, "config", None)
    if passed is not _UNSET:
        window = passed
    elif hasattr(module, "sliding_window"):
        window = module.sliding_window
    elif getattr(config, "layer_types", None) is not None and hasattr(module, "layer_idx"):
        sliding = config.layer_types[module.layer_idx] == "sliding_attention"
        window = getattr(config, "sliding_window", None) if sliding else None
    else:
        window = getattr(config, "sliding_window", None)
    return window or None


def _layer_softcap(module: torch.nn.Module, passed) -> float | None:
    """The attention logit softcap: as passed, else ``attn_logit_softcapping`` of the module or its config."""
    if passed is not _UNSET:
        return passed
    if hasattr(module, "attn_logit_softcapping"):
        return module.attn_logit_softcapping
    return getattr(getattr(module, "config", None), "attn_logit_softcapping", None)


def _check_call(module, query_BHTd, key_BKTd, attention_mask, layout, dropout, is_causal, kwargs) -> None:
    if layout is None:
        raise ValueError(
            "dualkv_layout: the 'dualkv' attention needs the packed layout; call "
            "model(input_ids=layout.input_ids[None], position_ids=layout.position_ids[None], dualkv_layout=layout, use_cache=False)"
        )
    if not isinstance(layout, PackedLayout):
        raise ValueError(f"dualkv_layout: expected a dualkv.core.PackedLayout, got {type(layout).__name__}")
    if query_BHTd.shape[0] != 1:
        raise ValueError(
            f"input_ids: the packed batch is one row of T={layout.total_tokens} tokens (batch size 1), got batch size {query_BHTd.shape[0]}"
        )
    T = layout.total_tokens
    if query_BHTd.shape[2] != T or key_BKTd.shape[2] != T:
        raise ValueError(
            f"input_ids: expected the layout's {T} packed tokens for queries and keys, got {query_BHTd.shape[2]} queries and "
            f"{key_BKTd.shape[2]} keys (use_cache must be False, logits_to_keep 0 or an index tensor)"
        )
    if attention_mask is not None:
        raise ValueError(
            "attention_mask: the packed layout defines the mask; pass attention_mask=None with the 'dualkv' attention"
        )
    if dropout:
        raise ValueError(f"attention_dropout: the 'dualkv' attention has no dropout; set config.attention_dropout=0.0 (got {dropout})")
    if is_causal is False or (is_causal is None and getattr(module, "is_causal", True) is False):
        raise ValueError("is_causal: the 'dualkv' attention is causal; this module runs bidirectional attention")
    for name in ("s_aux", "position_bias"):
        if kwargs.get(name) is not None:
            raise ValueError(f"{name}: not supported by the 'dualkv' attention")
    if kwargs.get("output_attentions"):
        raise ValueError("output_attentions: the 'dualkv' attention never materialises attention weights; pass output_attentions=False")


def dualkv_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window=_UNSET,
    softcap=_UNSET,
    is_causal: bool | None = None,
    dualkv_layout: PackedLayout | None = None,
    dualkv_backend: str = "auto",
    dualkv_deterministic: bool = False,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract over the packed layout.

    Args:
        module: the calling attention module (its ``sliding_window`` or its layer type,
            ``attn_logit_softcapping``, ``is_causal`` and ``scaling`` are used when the call does
            not pass them).
        query: (1, H, T, d); key, value: (1, K, T, d), K un-expanded (GQA/MQA).
        attention_mask: must be None (nothing is registered in the mask interface, so transformers
            passes None unless the caller gave a mask).
        scaling: softmax scale; sliding_window: window on logical positions (a query at position i
            sees keys at j with i - j < window); softcap: logit softcap.
        dualkv_layout: the ``PackedLayout`` of the batch (model kwarg).
        dualkv_backend, dualkv_deterministic: passed to ``dualkv_attention`` (model kwargs).

    Returns (out (1, T, H, d), None).
    """
    _check_call(module, query, key, attention_mask, dualkv_layout, dropout, is_causal, kwargs)
    window = _layer_window(module, sliding_window)
    cap = _layer_softcap(module, softcap)
    if scaling is None:
        scaling = getattr(module, "scaling", None)
    q_THd = query[0].transpose(0, 1)
    k_TKd = key[0].transpose(0, 1)
    v_TKd = value[0].transpose(0, 1)
    out_THd = dualkv_attention(
        q_THd, k_TKd, v_TKd, dualkv_layout, softmax_scale=scaling, window=window, softcap=cap,
        deterministic=dualkv_deterministic, backend=dualkv_backend,
    )
    return out_THd[None], None


def response_logprobs(
    model: torch.nn.Module, layout: PackedLayout, temperature: float = 1.0, **model_kwargs
) -> torch.Tensor:
    """Log-probs (B, R_max) float32 of every response token, from one packed forward of ``model``.

    Only the rows that predict a response token reach the LM head (``logits_to_keep``): the last
    prompt token of each group predicts every response's first token. Rows come in layout order,
    zero-padded; ``layout.response_mask()`` marks the real tokens. Differentiable.
    """
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl != ATTN_IMPLEMENTATION:
        raise ValueError(f"model: expected attention implementation {ATTN_IMPLEMENTATION!r} (model.set_attn_implementation('dualkv')), got {impl!r}")
    if not isinstance(layout, PackedLayout) or layout.input_ids is None:
        raise ValueError("layout: expected a dualkv.core.PackedLayout carrying input_ids (from_groups / from_rows)")
    if not (isinstance(temperature, (int, float)) and temperature > 0):
        raise ValueError(f"temperature: expected a positive number, got {temperature!r}")
    for name in ("input_ids", "position_ids", "dualkv_layout", "logits_to_keep", "use_cache"):
        if name in model_kwargs:
            raise ValueError(f"{name}: set by response_logprobs from the layout; do not pass it")
    src, tgt = layout.logprob_index()
    out = model(
        input_ids=layout.input_ids[None], position_ids=layout.position_ids[None], dualkv_layout=layout,
        use_cache=False, logits_to_keep=src, **model_kwargs,
    )
    logits_nV = out.logits[0]
    return layout.unpack_logprobs(gather_logprobs(logits_nV, layout.input_ids[tgt], temperature))


call_when_imported(_TRANSFORMERS_MODULE, register)
