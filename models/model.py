"""The causal LM on the packed layout: embeddings, decoder blocks, final norm, LM head, log-probs.

Contract (docs/architecture.md):
    hidden_states(input_ids (T,), position_ids (T,), layout) -> (T, D) after the final norm; also on
        a contiguous slice of the packed tokens with the whole micro-batch's layout (sequence
        parallelism: everything is per token except attention, which goes through ``attn_fn``).
    compute_logits(hidden (n, D)) -> (n, V), with the final-logit softcap where the model has one.
    response_logprobs(layout, temperature=1.0, return_entropy=False) -> (B, R_max) rows [, entropy],
        through the memory-lean path (``dualkv.core.logprobs.linear_logprobs``): no (T, V) fp32
        logits at once.

Shape legend: T tokens, D hidden, V vocab, L layers, P per-layer input size, n selected tokens,
B rows, R longest response.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from dualkv.core import PackedLayout
from dualkv.core.layout import to_device
from dualkv.core.logprobs import linear_logprobs

from . import gemma4, qwen3
from .config import ModelConfig
from .layers import BlockInputs, RMSNorm, ScaledEmbedding, rope_tables
from .moe import MOE_BACKENDS, Experts, RouterStats, load_balancing_loss

__all__ = ["CausalLM", "DecoderStack", "replication_weights"]

_BLOCKS = {"qwen3": qwen3.Qwen3Block, "gemma4": gemma4.Gemma4Block}


def replication_weights(layout: PackedLayout, token_offset: int, n: int, device) -> torch.Tensor:
    """(n,) float32: how many replicated rows hold each packed token of [offset, offset + n).

    A prompt token of group g appears in N_g rows, a response token in one, padding past T in none.
    Router statistics weighted this way equal those of the N-replicated batch.
    """
    pieces = []
    for p, rs in zip(layout.prompt_lens, layout.response_lens):
        pieces += [(p, float(len(rs))), (sum(rs), 1.0)]
    counts = torch.tensor([c for c, _ in pieces])
    full_T = torch.repeat_interleave(torch.tensor([w for _, w in pieces]), counts)
    out = torch.zeros(n)
    lo, hi = token_offset, min(token_offset + n, full_T.numel())
    if hi > lo:
        out[: hi - lo] = full_T[lo:hi]
    return to_device(out, device)


class DecoderStack(nn.Module):
    """Embeddings (+ Gemma-4 per-layer inputs), the decoder blocks, the final norm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = ScaledEmbedding(cfg.vocab_size, cfg.hidden_size, cfg.pad_token_id, scale=cfg.embed_scale)
        if cfg.per_layer_input is not None:
            gemma4.add_per_layer_input_modules(self, cfg)
        block = _BLOCKS[cfg.family]
        self.kv_sources = {layer.attention.kv_source for layer in cfg.layers} - {None}
        self.layers = nn.ModuleList([block(layer, cfg, keeps_kv=i in self.kv_sources) for i, layer in enumerate(cfg.layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, cfg.family)

    def _rope(self, position_ids_T: torch.Tensor, dtype: torch.dtype) -> dict:
        attns = {layer.attention.rope_key: layer.attention for layer in self.cfg.layers}
        return {key: rope_tables(a.rope, a.head_dim, position_ids_T, dtype) for key, a in attns.items()}

    def forward(self, input_ids_T, position_ids_T, layout, token_weight_T=None, checkpointed=frozenset(),
                keep_attention=False):
        """Returns (hidden_TD after the final norm, [RouterStats of each MoE layer]).

        checkpointed: layer indices recomputed in backward; keep_attention: those layers keep their
        attention outputs (out, lse) instead of recomputing the attention forward.
        """
        h_TD = self.embed_tokens(input_ids_T)
        ple_TLP = None
        if self.cfg.per_layer_input is not None:
            ple_TLP = gemma4.per_layer_inputs(self, self.cfg, input_ids_T, h_TD)
        rope = self._rope(position_ids_T, h_TD.dtype)
        shared, stats = {}, []
        for i, block in enumerate(self.layers):
            src = self.cfg.layers[i].attention.kv_source
            inputs = BlockInputs(layout, rope, token_weight_T, shared.get(src),
                                 None if ple_TLP is None else ple_TLP[:, i])
            if i in checkpointed and torch.is_grad_enabled():
                context = _KEEP_ATTENTION_CONTEXT if keep_attention else _RECOMPUTE_ALL_CONTEXT
                out = checkpoint(block, h_TD, inputs, use_reentrant=False, context_fn=context)
            else:
                out = block(h_TD, inputs)
            h_TD = out.hidden_TD
            if i in self.kv_sources:
                shared[i] = out.kv
            if out.stats is not None:
                stats.append(out.stats)
        return self.norm(h_TD), stats


def _keep_attention_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective checkpointing: save the attention op's outputs, recompute everything else."""
    if op is torch.ops.dualkv.attention_fwd.default:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


_KEEP_ATTENTION_CONTEXT = functools.partial(create_selective_checkpoint_contexts, _keep_attention_policy)
_RECOMPUTE_ALL_CONTEXT = torch.utils.checkpoint.noop_context_fn


class CausalLM(nn.Module):
    """A Qwen3 / Qwen3-MoE / Gemma-4 causal LM on the packed layout (parameter names as transformers').

    After every forward of a model with MoE layers, ``router_stats`` holds each MoE layer's
    ``RouterStats`` and ``aux_loss`` the load-balancing loss (unscaled; the trainer multiplies by
    ``moe.aux_loss_coef``); tokens are weighted by their replication count so both equal what
    transformers computes on the N-replicated batch. ``None`` for dense models.

    ``logprobs_impl`` (None, ``"auto"``, ``"torch"`` or ``"triton"``) is how the log-prob head reduces
    each chunk of logits (``dualkv.core.logprobs.linear_logprobs``'s ``impl``; None reads
    ``DUALKV_LOGPROBS_IMPL``, default auto: Triton for fp16 / bf16 on CUDA); the trainer sets it from
    ``ParallelConfig.logprobs_impl``.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if not isinstance(cfg, ModelConfig):
            raise ValueError(f"cfg: expected a dualkv.models.ModelConfig, got {type(cfg).__name__}")
        self.config = cfg
        self.model = DecoderStack(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.router_stats: list[RouterStats] = []
        self.aux_loss: torch.Tensor | None = None
        self._checkpointed: frozenset[int] = frozenset()
        self._keep_attention = False
        self.logprobs_impl: str | None = None

    # ------------------------------------------------------------------ set-up
    def tie_weights(self) -> None:
        """Share the LM head with the token embedding where the config ties them."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def set_activation_checkpointing(self, layers: bool | Iterable[int] = True, keep_attention: bool = False
                                     ) -> CausalLM:
        """Recompute the chosen decoder layers in backward: True (all), False (none) or layer indices.

        keep_attention: save each checkpointed layer's attention output and LSE (T x H x d in the
        model dtype plus H x T fp32 per layer, on top of the layer input a checkpoint keeps) so that
        backward recomputes the norms, projections and MLP but not the attention forward (selective
        checkpointing through ``torch.utils.checkpoint``; works under torch.compile).
        """
        if not isinstance(keep_attention, bool):
            raise ValueError(f"keep_attention: expected a bool, got {keep_attention!r}")
        L = self.config.num_layers
        if isinstance(layers, bool):
            chosen = set(range(L)) if layers else set()
        else:
            chosen = set(layers)
            bad = sorted(i for i in chosen if not isinstance(i, int) or not 0 <= i < L)
            if bad:
                raise ValueError(f"layers: expected True, False or layer indices in [0, {L}), got {bad}")
        self._checkpointed = frozenset(chosen)
        self._keep_attention = keep_attention
        return self

    @property
    def checkpointed_layers(self) -> frozenset[int]:
        return self._checkpointed

    def set_moe_backend(self, backend: str) -> CausalLM:
        """Expert compute: ``auto`` (grouped GEMM on CUDA bf16 sm90+, else loop), ``grouped`` or ``loop``."""
        if backend not in MOE_BACKENDS:
            raise ValueError(f"backend: expected one of {MOE_BACKENDS}, got {backend!r}")
        for m in self.modules():
            if isinstance(m, Experts):
                m.backend = backend
        return self

    def set_attn_fn(self, fn) -> CausalLM:
        """Give every attention module the same ``attn_fn`` (e.g. a backend-pinned dualkv_attention)."""
        if not callable(fn):
            raise ValueError(f"fn: expected a callable with dualkv_attention's signature, got {type(fn).__name__}")
        for m in self.modules():
            if hasattr(m, "attn_fn"):
                m.attn_fn = fn
        return self

    # ------------------------------------------------------------------ the contract
    def _check_tokens(self, input_ids, position_ids, layout):
        if not isinstance(layout, PackedLayout):
            raise ValueError(f"layout: expected a dualkv.core.PackedLayout, got {type(layout).__name__}")
        for name, t in (("input_ids", input_ids), ("position_ids", position_ids)):
            if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.is_floating_point():
                raise ValueError(f"{name}: expected a 1-D integer tensor (T,), got {getattr(t, 'shape', type(t).__name__)}")
        if input_ids.shape != position_ids.shape:
            raise ValueError(f"position_ids: expected the shape of input_ids {tuple(input_ids.shape)}, got {tuple(position_ids.shape)}")
        if input_ids.shape[0] > layout.total_tokens:
            raise ValueError(f"input_ids: expected at most the layout's T={layout.total_tokens} tokens, got {input_ids.shape[0]}")

    def _token_weights(self, n: int, layout, token_offset, device):
        if not self.config.is_moe:
            return None
        if token_offset is None:
            if n != layout.total_tokens:
                raise ValueError(
                    f"token_offset: got {n} of the layout's {layout.total_tokens} tokens (a sequence-parallel "
                    "slice?); pass token_offset=<packed position of the slice's first token> so the router "
                    "statistics weight each token by its replication count"
                )
            token_offset = 0
        if not isinstance(token_offset, int) or token_offset < 0:
            raise ValueError(f"token_offset: expected an int >= 0, got {token_offset!r}")
        return replication_weights(layout, token_offset, n, device)

    def hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor, layout: PackedLayout,
                      *, token_offset: int | None = None) -> torch.Tensor:
        """(T, D) final hidden states of the packed tokens (or of a contiguous slice of them).

        Args:
            input_ids, position_ids: (T,) packed tokens and their logical positions (a contiguous
                slice of the layout's tokens under sequence parallelism, padding allowed past T).
            layout: the whole micro-batch's PackedLayout (on the tokens' device).
            token_offset: packed position of the first given token; needed by MoE models when the
                tokens are a slice (router statistics), 0 otherwise.
        """
        self._check_tokens(input_ids, position_ids, layout)
        weights = self._token_weights(input_ids.shape[0], layout, token_offset, input_ids.device)
        hidden_TD, stats = self.model(input_ids, position_ids, layout, weights, self._checkpointed,
                                      self._keep_attention)
        self.router_stats = stats
        self.aux_loss = load_balancing_loss(stats) if stats else None
        return hidden_TD

    def compute_logits(self, hidden_nD: torch.Tensor) -> torch.Tensor:
        """(n, D) -> (n, V) in the model dtype; ``cap * tanh(logits / cap)`` where the model caps logits."""
        logits_nV = self.lm_head(hidden_nD)
        cap = self.config.final_logit_softcap
        if cap is not None:
            logits_nV = torch.tanh(logits_nV / cap) * cap
        return logits_nV

    def response_logprobs(self, layout: PackedLayout, temperature: float = 1.0, return_entropy: bool = False,
                          *, chunk_size: int | None = None):
        """(B, R_max) float32 log-probs of every response token (rows in the layout's build order,
        zero-padded) [, entropies (B, R_max)] from one packed forward.

        The first token of a response is predicted by its group's last prompt token. Logits are
        computed ``chunk_size`` tokens at a time and recomputed in backward.
        """
        if layout.input_ids is None:
            raise ValueError("layout: expected a layout carrying input_ids (from_groups / from_rows), got one built from lengths only")
        hidden_TD = self.hidden_states(layout.input_ids, layout.position_ids, layout)
        src, tgt = layout.logprob_index()
        lp_n, ent_n = linear_logprobs(
            hidden_TD[src], self.lm_head.weight, layout.input_ids[tgt], temperature=temperature,
            softcap=self.config.final_logit_softcap, return_entropy=return_entropy, chunk_size=chunk_size,
            impl=self.logprobs_impl,
        )
        lp_BR = layout.unpack_logprobs(lp_n)
        return (lp_BR, layout.unpack_logprobs(ent_n)) if return_entropy else lp_BR

    def forward(self, layout: PackedLayout, temperature: float = 1.0, return_entropy: bool = False):
        """Same as ``response_logprobs`` (so FSDP's forward hooks wrap the whole computation)."""
        return self.response_logprobs(layout, temperature, return_entropy)

    # ------------------------------------------------------------------ checkpoints
    def save_pretrained(self, path, *, max_shard_size: int | str = "5GB") -> None:
        """Write config.json + safetensors (sharded with an index when larger than ``max_shard_size``)
        that transformers' ``AutoModelForCausalLM.from_pretrained`` loads."""
        from .checkpoint import save_pretrained

        save_pretrained(self, path, max_shard_size=max_shard_size)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())
