"""Hugging Face checkpoints: config.json + safetensors (one file, or shards with an index), by name.

Loading builds the model without allocating random weights (meta device), then copies every tensor
from the checkpoint into it (bit-exact when the requested dtype is the stored one). Names are
transformers' own; the mappings are:

- Gemma-4 multimodal checkpoints (``model_type: gemma4``) keep the text model under
  ``model.language_model.``; vision/audio towers are skipped.
- Qwen3-MoE checkpoints store experts one by one (``mlp.experts.{e}.gate_proj.weight`` ...); they are
  fused into ``mlp.experts.gate_up_proj (E, 2F, D)`` / ``down_proj (E, D, F)`` here, and split again
  on save. A checkpoint that already holds the fused tensors loads as well.
- KV-sharing Gemma-4 layers have no k/v projections; checkpoint entries for them are ignored.

Saving writes a ``gemma4_text`` / ``qwen3`` / ``qwen3_moe`` checkpoint that transformers'
``AutoModelForCausalLM.from_pretrained`` loads.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import ModelConfig, from_hf_config, to_hf_config
from .model import CausalLM
from .qwen3 import load_tensor as qwen3_load_tensor
from .qwen3 import save_tensors as qwen3_save_tensors

__all__ = ["from_pretrained", "save_pretrained", "read_hf_config", "parse_size"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_IGNORED = re.compile(
    r"^(model\.)?(vision_tower|embed_vision|audio_tower|embed_audio|multi_modal_projector|vision_model)\."
    r"|rotary_emb\.inv_freq$"
)
_PREFIXES = ("model.", "model.language_model.", "language_model.model.")


def read_hf_config(path) -> dict:
    """The config.json of a checkpoint directory."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise ValueError(f"path: expected a checkpoint directory with a config.json, got {str(path)!r}")
    with open(file) as f:
        return json.load(f)


def _weight_files(root: Path) -> dict[str, Path]:
    """disk tensor name -> file holding it."""
    if (root / INDEX).is_file():
        with open(root / INDEX) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{root / INDEX}: expected a 'weight_map' object, got {type(weight_map).__name__}")
        missing = sorted({v for v in weight_map.values() if not (root / v).is_file()})
        if missing:
            raise ValueError(f"{root / INDEX}: lists shard files that do not exist: {missing[:5]}")
        return {k: root / v for k, v in weight_map.items()}
    files = [root / SINGLE] if (root / SINGLE).is_file() else sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"path: expected {SINGLE} or {INDEX} in {str(root)!r}, found no safetensors files")
    out = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            out.update({k: file for k in f.keys()})
    return out


class _Reader:
    """Lazy tensor access across shard files; remembers which names were used."""

    def __init__(self, files: dict[str, Path], device: torch.device):
        self.files, self.used, self._open = files, set(), {}
        self.device = "cpu" if device.type == "meta" else str(device)

    def get(self, name: str) -> torch.Tensor | None:
        file = self.files.get(name)
        if file is None:
            return None
        if file not in self._open:
            self._open[file] = safe_open(str(file), framework="pt", device=self.device)
        self.used.add(name)
        return self._open[file].get_tensor(name)

    def first_float_dtype(self) -> torch.dtype:
        for name, file in self.files.items():
            with safe_open(str(file), framework="pt") as f:
                dtype = f.get_slice(name).get_dtype()
            torch_dtype = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}.get(dtype)
            if torch_dtype is not None:
                return torch_dtype
        raise ValueError("checkpoint: found no floating-point tensor to take the dtype from; pass dtype=")


def _candidates(key: str) -> list[str]:
    if key.startswith("model."):
        rest = key[len("model."):]
        return [p + rest for p in _PREFIXES]
    return [key, "language_model." + key]


def _lookup_fn(reader: _Reader):
    def lookup(key: str):
        for name in _candidates(key):
            t = reader.get(name)
            if t is not None:
                return t
        return None

    return lookup


def _ignorable(name: str, cfg: ModelConfig) -> bool:
    """Tensors transformers does not load either: other modalities, tied heads, absent projections."""
    if _IGNORED.search(name):
        return True
    if cfg.tie_word_embeddings and name.endswith("lm_head.weight"):
        return True
    m = re.search(r"layers\.(\d+)\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\.", name)
    if not m or int(m.group(1)) >= cfg.num_layers:
        return False
    attn = cfg.layers[int(m.group(1))].attention
    return attn.kv_source is not None or (attn.k_eq_v and m.group(2) == "v_proj")


def _state_keys(model: CausalLM) -> list[str]:
    keys = list(model.state_dict().keys())
    return [k for k in keys if not (model.config.tie_word_embeddings and k == "lm_head.weight")]


def _load_into(model: CausalLM, reader: _Reader) -> None:
    cfg, lookup = model.config, _lookup_fn(reader)
    num_experts = next((l.moe.num_experts for l in cfg.layers if l.moe is not None), None)
    state, missing = model.state_dict(), []
    for key in _state_keys(model):
        tensor = qwen3_load_tensor(key, lookup, num_experts) if cfg.family == "qwen3" else lookup(key)
        if tensor is None:
            if key.endswith("layer_scalar"):  # a buffer transformers initialises to one
                state[key].fill_(1.0)
                continue
            missing.append(key)
            continue
        if tuple(tensor.shape) != tuple(state[key].shape):
            raise ValueError(f"checkpoint: {key} has shape {tuple(tensor.shape)}, the config implies {tuple(state[key].shape)}")
        with torch.no_grad():
            state[key].copy_(tensor)
    if missing:
        raise ValueError(f"checkpoint: missing {len(missing)} tensors the config needs, e.g. {missing[:5]}")
    unexpected = sorted(n for n in set(reader.files) - reader.used if not _ignorable(n, cfg))
    if unexpected:
        raise ValueError(f"checkpoint: {len(unexpected)} tensors match nothing in the model, e.g. {unexpected[:5]}")


def from_pretrained(path, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> CausalLM:
    """Load a transformers Qwen3 / Qwen3-MoE / Gemma-4 checkpoint directory into a ``CausalLM``.

    Args:
        path: directory with config.json and model.safetensors (or shards + model.safetensors.index.json).
        dtype: parameter dtype; default: the checkpoint's stored dtype (then the weights are bit-exact).
        device: where to put the model (default CPU); tensors are read straight onto it.
    The family is picked from config.json's ``model_type`` (qwen3, qwen3_moe, gemma4_text, gemma4).
    """
    root = Path(path)
    cfg = from_hf_config(read_hf_config(root))
    device = torch.device(device if device is not None else "cpu")
    reader = _Reader(_weight_files(root), device)
    if dtype is None:
        dtype = reader.first_float_dtype()
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype: expected a floating torch.dtype, got {dtype!r}")
    with torch.device("meta"):
        model = CausalLM(cfg)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.tie_weights()
    _load_into(model, reader)
    return model


# --------------------------------------------------------------------------------------- saving

def parse_size(size: int | str) -> int:
    """Bytes from an int or a string like '5GB' (powers of 1000) or '2GiB' (powers of 1024)."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B\s*", str(size), flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"max_shard_size: expected bytes (int > 0) or a size like '5GB' / '500MiB', got {size!r}")
    base = 1024 if m.group(3) else 1000
    power = "KMGT".find(m.group(2).upper()) + 1 if m.group(2) else 0
    return int(float(m.group(1)) * base ** power)


def _hf_tensors(model: CausalLM) -> list[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor view) pairs; nothing is copied yet."""
    cfg, out = model.config, []
    state = model.state_dict()
    for key in _state_keys(model):
        tensor = state[key].detach()
        out += qwen3_save_tensors(key, tensor) if cfg.family == "qwen3" else [(key, tensor)]
    return out


def _shards(tensors, limit: int) -> list[list[tuple[str, torch.Tensor]]]:
    shards, current, size = [], [], 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > limit:
            shards.append(current)
            current, size = [], 0
        current.append((name, t))
        size += nbytes
    return shards + [current] if current else shards


def _write_shard(shard, file: Path) -> None:
    """Copy one shard's tensors to the CPU (own storage each) and write them."""
    save_file({name: t.to("cpu", copy=True).contiguous() for name, t in shard}, str(file), metadata={"format": "pt"})


def save_pretrained(model: CausalLM, path, *, max_shard_size: int | str = "5GB") -> None:
    """config.json + model.safetensors, or model-0000i-of-0000N.safetensors + index when larger."""
    if not isinstance(model, CausalLM):
        raise ValueError(f"model: expected a dualkv.models.CausalLM, got {type(model).__name__}")
    limit = parse_size(max_shard_size)
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    for old in list(root.glob("model*.safetensors")) + [root / INDEX]:
        old.unlink(missing_ok=True)
    hf = to_hf_config(model.config)
    hf.pop("torch_dtype", None)
    hf["dtype"] = str(model.lm_head.weight.dtype).removeprefix("torch.")
    with open(root / "config.json", "w") as f:
        json.dump(hf, f, indent=2, sort_keys=True)
    shards = _shards(_hf_tensors(model), limit)
    if len(shards) == 1:
        _write_shard(shards[0], root / SINGLE)
        return
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _write_shard(shard, root / name)
        for key, t in shard:
            weight_map[key] = name
            total += t.numel() * t.element_size()
    with open(root / INDEX, "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
