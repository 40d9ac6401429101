"""dualkv.models: decoder layers and causal-LM models on the packed layout.

Families: dense Qwen3, Qwen3-MoE (Qwen3-30B-A3B), hybrid sliding/global Gemma-4 (head dims 256/512).
Every model runs on the packed P + N*R tokens of a ``dualkv.core.PackedLayout`` and gives the same
log-probs and gradients as transformers on the N-replicated batch::

    model = dualkv.models.from_pretrained("/ckpt/Qwen3-8B", dtype=torch.bfloat16, device="cuda")
    layout = PackedLayout.from_groups([(prompt_ids, [resp_1, resp_2, ...]), ...], device="cuda")
    logprobs = model.response_logprobs(layout)              # (B, R_max), rows in build order
    (-(advantages * logprobs) * layout.response_mask()).sum().backward()

Importing this package also registers the "dualkv" attention implementation with transformers
(``dualkv.models.integrations.hf``), where that integration is installed.
"""

from __future__ import annotations

import importlib.util
import weakref
from typing import Callable

import torch

from .checkpoint import from_pretrained, read_hf_config, save_pretrained
from .config import (
    AttentionConfig,
    LayerConfig,
    MLPConfig,
    ModelConfig,
    MoEConfig,
    PerLayerInputConfig,
    RopeConfig,
    from_hf_config,
    to_hf_config,
)
from .fused import fused_ops, set_fused_ops
from .model import CausalLM
from .moe import RouterStats, load_balancing_loss
from .presets import PRESETS, get_preset, list_presets, preset_hf_config

__all__ = [
    "CausalLM",
    "fused_ops",
    "set_fused_ops",
    "ModelConfig",
    "LayerConfig",
    "AttentionConfig",
    "MLPConfig",
    "MoEConfig",
    "RopeConfig",
    "PerLayerInputConfig",
    "RouterStats",
    "PRESETS",
    "build_model",
    "from_pretrained",
    "save_pretrained",
    "from_hf_config",
    "to_hf_config",
    "get_preset",
    "list_presets",
    "preset_hf_config",
    "read_hf_config",
    "load_balancing_loss",
    "init_weights",
    "materialize",
]


def _normal_once(std: float, generator: torch.Generator | None):
    """normal_(0, std) in place, once per tensor: a tied LM head keeps the embedding's initialisation.
    (Weak references: when ``materialize`` shards a layer and its full tensors die, a later tensor that
    gets a freed tensor's id must still be initialised.)"""
    done: dict[int, weakref.ref] = {}

    def normal(t):
        seen = done.get(id(t))
        if seen is None or seen() is not t:
            done[id(t)] = weakref.ref(t)
            t.normal_(0.0, std, generator=generator)

    return normal


def _init_module(m: torch.nn.Module, normal) -> None:
    """init_weights' rules for one module's own parameters and buffers."""
    from .layers import RMSNorm
    from .moe import Experts, Gemma4Router, SoftmaxTopKRouter

    if isinstance(m, torch.nn.Embedding):
        normal(m.weight)
        if m.padding_idx is not None:
            m.weight[m.padding_idx].zero_()
    elif isinstance(m, torch.nn.Linear):
        normal(m.weight)
        if m.bias is not None:
            m.bias.zero_()
    elif isinstance(m, RMSNorm) and m.weight is not None:
        m.weight.fill_(1.0)
    elif isinstance(m, Experts):
        normal(m.gate_up_proj)
        normal(m.down_proj)
    elif isinstance(m, SoftmaxTopKRouter):
        normal(m.weight)
    elif isinstance(m, Gemma4Router):
        m.scale.fill_(1.0)
        m.per_expert_scale.fill_(1.0)
    for name, b in m.named_buffers(recurse=False):
        if name == "layer_scalar":
            b.fill_(1.0)


def _check_causal_lm(model) -> None:
    if not isinstance(model, CausalLM):
        raise ValueError(f"model: expected a dualkv.models.CausalLM, got {type(model).__name__}")


def init_weights(model: CausalLM, std: float = 0.02, generator: torch.Generator | None = None) -> CausalLM:
    """transformers' initialisation: normal(0, std) for linear, embedding, expert and router weights;
    zero biases and padding rows; ones for norm weights, router scales and layer scalars. The modules
    are visited in ``model.modules()`` order, so a generator gives the same values on every run."""
    _check_causal_lm(model)
    normal = _normal_once(std, generator)
    with torch.no_grad():
        for m in model.modules():
            _init_module(m, normal)
    model.tie_weights()
    return model


def _on_meta(m: torch.nn.Module) -> bool:
    return any(t.is_meta for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)))


def materialize(model: CausalLM, device, *, seed: int | None = None, std: float = 0.02, units=(),
                on_unit: Callable[[torch.nn.Module], None] | None = None) -> CausalLM:
    """Allocate a model built on the meta device (``build_model(..., device="meta")``) on ``device`` and
    initialise it as ``build_model(..., seed=seed, device=device)`` would, bit for bit, one unit at a time.

    Each module in ``units`` (e.g. the decoder layers) is allocated, initialised and handed to
    ``on_unit`` before the next one is allocated; with FSDP2's ``fully_shard`` as ``on_unit`` a rank
    keeps only its shard of each layer, so neither the host nor the device ever holds the whole
    model (the modules outside the units, embeddings, final norm and LM head, are allocated whole).
    """
    _check_causal_lm(model)
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    normal = _normal_once(std, generator)
    unit_ids = {id(u) for u in units}
    done: set[int] = set()  # modules initialised as part of a unit
    with torch.no_grad():
        for m in model.modules():  # the order of init_weights, so the generator draws the same values
            if id(m) in done:
                continue
            if id(m) in unit_ids:
                m.to_empty(device=device)
                for sub in m.modules():
                    done.add(id(sub))
                    _init_module(sub, normal)
                if on_unit is not None:
                    on_unit(m)
                continue
            if _on_meta(m):
                m.to_empty(device=device, recurse=False)
                model.tie_weights()  # a tied LM head follows the embedding it shares
            _init_module(m, normal)
    return model


def build_model(preset_or_config, *, dtype: torch.dtype = torch.float32, device=None, seed: int | None = None,
                init_std: float = 0.02) -> CausalLM:
    """A randomly initialised model from a preset name, a ModelConfig or a config.json dict.

    ``device="meta"`` builds the structure without allocating (e.g. to count parameters of a preset).
    """
    if isinstance(preset_or_config, str):
        cfg = get_preset(preset_or_config)
    elif isinstance(preset_or_config, dict):
        cfg = from_hf_config(preset_or_config)
    elif isinstance(preset_or_config, ModelConfig):
        cfg = preset_or_config
    else:
        raise ValueError(f"preset_or_config: expected a preset name, a ModelConfig or a config.json dict, "
                         f"got {type(preset_or_config).__name__}")
    device = torch.device(device if device is not None else "cpu")
    with torch.device(device):
        model = CausalLM(cfg).to(dtype)
    if device.type != "meta":
        gen = None
        if seed is not None:
            gen = torch.Generator(device=device).manual_seed(seed)
        init_weights(model, init_std, gen)
    return model


def _register_hf_attention() -> None:
    """Import ``dualkv.models.integrations.hf`` (it registers the "dualkv" attention) if installed."""
    try:
        spec = importlib.util.find_spec("dualkv.models.integrations.hf")
    except ModuleNotFoundError:
        spec = None
    if spec is not None:
        importlib.import_module("dualkv.models.integrations.hf")


_register_hf_attention()
