"""Apply Ulysses sequence parallelism to a ``dualkv.models`` model from outside, in one place.

The model code stays single-device: every attention module calls ``self.attn_fn(q, k, v, layout,
softmax_scale=, window=, softcap=)``. ``parallelize_sequence`` swaps each ``attn_fn`` for a
``UlyssesAttention`` around it; norms, projections, RoPE, MLP/MoE then simply run on the rank's
slice of the packed tokens (see ``sequence.py``), and only attention talks to the other SP ranks.
"""

from __future__ import annotations

import torch

from .deepspeed import DeepSpeedUlyssesAttention
from .groups import as_process_group, group_size
from .ulysses import UlyssesAttention

# attn_fn wrappers that run attention over an SP group; each has .sp_group, .sp_size and .attn_fn
SP_ATTENTION_TYPES = (UlyssesAttention, DeepSpeedUlyssesAttention)

__all__ = ["parallelize_sequence", "unparallelize_sequence", "check_parallelized", "attention_modules"]


def attention_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every module carrying an ``attn_fn`` (the models' attention contract)."""
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    return [(name, m) for name, m in model.named_modules() if callable(getattr(m, "attn_fn", None))]


def parallelize_sequence(model: torch.nn.Module, sp_group, attention_cls=UlyssesAttention) -> torch.nn.Module:
    """Make every attention module of ``model`` run Ulysses SP over ``sp_group``; returns ``model``.

    ``sp_group``: the SP process group or a 1-D DeviceMesh (e.g. ``SPMesh.sp_mesh``).
    ``attention_cls``: ``UlyssesAttention`` (our all-to-all) or ``DeepSpeedUlyssesAttention``
    (DeepSpeed's ``DistributedAttention``). Applying it again re-wraps the original ``attn_fn``.
    Undo with ``unparallelize_sequence``. Head counts that the SP size does not divide raise a
    ValueError at the first forward (``kv_replication_factor``).
    """
    if attention_cls not in SP_ATTENTION_TYPES:
        raise ValueError(f"attention_cls: expected one of {[c.__name__ for c in SP_ATTENTION_TYPES]}, got {attention_cls!r}")
    mods = attention_modules(model)
    if not mods:
        raise ValueError("model: expected attention modules with an `attn_fn` attribute (dualkv.models contract), found none")
    for name, module in mods:
        inner = module.attn_fn
        if isinstance(inner, SP_ATTENTION_TYPES):
            inner = inner.attn_fn
        if isinstance(inner, torch.nn.Module):
            raise ValueError(f"{name}.attn_fn: expected a plain callable, got the module {type(inner).__name__}")
        module.attn_fn = attention_cls(sp_group, inner)
    return model


def unparallelize_sequence(model: torch.nn.Module) -> torch.nn.Module:
    """Restore every attention module's own ``attn_fn``; returns ``model``."""
    for _, module in attention_modules(model):
        if isinstance(module.attn_fn, SP_ATTENTION_TYPES):
            module.attn_fn = module.attn_fn.attn_fn
    return model


def check_parallelized(model: torch.nn.Module, sp_group) -> None:
    """Raise ValueError unless ``model`` is ready to run on SP slices of ``sp_group``."""
    sp = group_size(sp_group)
    mods = attention_modules(model)
    pg = as_process_group(sp_group)
    for name, module in mods:
        fn = module.attn_fn
        wrapped = isinstance(fn, SP_ATTENTION_TYPES)
        if sp > 1 and (not wrapped or as_process_group(fn.sp_group) is not pg):
            raise ValueError(
                f"model: expected its attention modules prepared with parallelize_sequence(model, sp_group) for this "
                f"SP group of {sp} ranks; {name}.attn_fn is {fn!r}"
            )
        if sp == 1 and wrapped and fn.sp_size != 1:
            raise ValueError(f"model: {name}.attn_fn runs SP over {fn.sp_size} ranks but sp_group has 1 rank")
