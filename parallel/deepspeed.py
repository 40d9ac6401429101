"""DualKV attention as the local attention of DeepSpeed-Ulysses (``deepspeed.sequence.layer.DistributedAttention``).

DeepSpeed's ``DistributedAttention(local_attention, sequence_process_group)`` does the
sequence<->heads all-to-all itself and calls ``local_attention(q, k, v, *args, **kwargs)`` on 4-D
tensors holding the whole (padded) sequence and ``H / sp`` heads, ``(s, b, h, d)`` or ``(b, s, h, d)``.
``DeepSpeedLocalAttention`` is that local attention for the packed layout: pass the layout as a
keyword (``dist_attn(q, k, v, [batch_dim_idx,] layout=layout, window=..., ...)``); the batch must be 1
(the micro-batch is packed), the padding tail beyond T is cut before and restored (zeros) after.

``DeepSpeedUlyssesAttention`` is an ``attn_fn`` for ``dualkv.models`` running on DeepSpeed's
all-to-all instead of ours (``parallelize_sequence(model, group, attention_cls=DeepSpeedUlyssesAttention)``);
it replicates K/V heads in place first when sp does not divide H_kv, as ``dualkv.parallel.ulysses``.
DeepSpeed is optional: this module imports without it, and only building the ``DistributedAttention``
needs it installed.

Shape suffixes: Tp padded packed tokens, T packed tokens, L tokens per rank, H / K query / kv heads,
h / k heads per rank, d head dim.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from dualkv.core import dualkv_attention

from .groups import as_process_group, group_size
from .ulysses import _check_local, kv_replication_factor, replicate_kv_heads

__all__ = ["deepspeed_available", "DeepSpeedLocalAttention", "DeepSpeedUlyssesAttention"]


def deepspeed_available() -> bool:
    try:
        import deepspeed.sequence.layer  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not usable here"
        return False
    return True


def _seq_dim(x, seq_dim):
    if seq_dim is not None:
        return seq_dim
    if x.shape[1] == 1:
        return 0
    if x.shape[0] == 1:
        return 1
    raise ValueError(
        f"q: expected a packed micro-batch (batch size 1) as (s, 1, h, d) or (1, s, h, d), got {tuple(x.shape)}"
    )


class DeepSpeedLocalAttention:
    """``local_attention`` for DeepSpeed's ``DistributedAttention`` over the packed layout.

    Args:
        seq_dim: 0 for (s, b, h, d) tensors (DeepSpeed's default gather_idx=0), 1 for (b, s, h, d);
            None infers it from which dim has size 1.
        attn_fn: the op (``dualkv_attention`` by default).
    Call: ``(q, k, v, *ignored, layout, **kwargs)`` with q (Tp, 1, h, d) or (1, Tp, h, d),
    k/v likewise with k heads; kwargs go to ``attn_fn``. Returns the output in q's 4-D shape.
    """

    def __init__(self, seq_dim: int | None = None, attn_fn=dualkv_attention):
        if seq_dim not in (None, 0, 1):
            raise ValueError(f"seq_dim: expected None, 0 or 1, got {seq_dim!r}")
        self.seq_dim = seq_dim
        self.attn_fn = attn_fn

    def __call__(self, q, k, v, *args, layout=None, **kwargs):
        if layout is None:
            raise ValueError("layout: expected the micro-batch's PackedLayout as a keyword argument, got none")
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                raise ValueError(f"{name}: expected a 4-D tensor (s, b, h, d) or (b, s, h, d), got {tuple(getattr(t, 'shape', ()))}")
        dim = _seq_dim(q, self.seq_dim)
        bdim = 1 - dim
        if q.shape[bdim] != 1 or k.shape[bdim] != 1 or v.shape[bdim] != 1:
            raise ValueError(f"q/k/v: expected batch size 1 (one packed micro-batch) on dim {bdim}, got {tuple(q.shape)}")
        T, Tp = layout.total_tokens, q.shape[dim]
        if Tp < T:
            raise ValueError(f"q: expected at least the layout's T={T} tokens on dim {dim}, got {Tp}")
        q_Thd, k_Tkd, v_Tkd = (t.squeeze(bdim)[:T].contiguous() for t in (q, k, v))
        out_Thd = self.attn_fn(q_Thd, k_Tkd, v_Tkd, layout, **kwargs)
        return F.pad(out_Thd, (0, 0, 0, 0, 0, Tp - T)).unsqueeze(bdim)


class DeepSpeedUlyssesAttention:
    """``attn_fn`` for dualkv.models running DeepSpeed-Ulysses' ``DistributedAttention`` around our op.

    Called like ``dualkv_attention`` on this rank's slice: q (L, H, d), k/v (L, H_kv, d), L = ceil(T/sp).
    Requires deepspeed; its comm layer must be initialised (``deepspeed.init_distributed()``).
    """

    def __init__(self, sp_group, attn_fn=dualkv_attention):
        try:
            from deepspeed.sequence.layer import DistributedAttention
        except Exception as err:  # noqa: BLE001
            raise RuntimeError(f"DeepSpeedUlyssesAttention needs deepspeed (pip install 'dualkv[deepspeed]'): {err}") from err
        self.sp_group, self.attn_fn = sp_group, attn_fn
        self.sp_size = group_size(sp_group)
        local = DeepSpeedLocalAttention(seq_dim=0, attn_fn=attn_fn)
        self.dist_attn = DistributedAttention(local, as_process_group(sp_group), scatter_idx=2, gather_idx=0)
        params = inspect.signature(DistributedAttention.forward).parameters
        self._batch_dim_arg = (1,) if "batch_dim_idx" in params else ()

    def __call__(self, q_LHd, k_LKd, v_LKd, layout, **kwargs):
        sp = self.sp_size
        _check_local(q_LHd, k_LKd, v_LKd, layout, sp)
        f = kv_replication_factor(q_LHd.shape[1], k_LKd.shape[1], sp)
        q, k, v = (t.unsqueeze(1) for t in (q_LHd, replicate_kv_heads(k_LKd, f), replicate_kv_heads(v_LKd, f)))
        out = self.dist_attn(q, k, v, *self._batch_dim_arg, layout=layout, **kwargs)
        return out.reshape(q_LHd.shape)

    def __repr__(self) -> str:
        return f"DeepSpeedUlyssesAttention(sp={self.sp_size})"
