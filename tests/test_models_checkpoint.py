"""HF checkpoints: our save_pretrained loads in transformers, shards, dtypes, name mappings, bad files."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import dualkv.models as M
from dualkv.core import PackedLayout
from dualkv.models.checkpoint import parse_size
from dualkv.models.reference import hf_model, hf_response_logprobs


def layout(vocab=256):
    g = torch.Generator().manual_seed(0)
    shapes = [(8, [3, 6]), (2, [5, 1, 2])]
    return PackedLayout.from_groups([(torch.randint(1, vocab, (p,), generator=g),
                                      [torch.randint(1, vocab, (r,), generator=g) for r in rs]) for p, rs in shapes])


def params_equal(a, b):
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert set(pa) == set(pb)
    for name in pa:
        assert pa[name].dtype == pb[name].dtype, name
        assert torch.equal(pa[name], pb[name]), name


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen3-moe", "tiny-gemma4-e", "tiny-gemma4-moe"])
def test_saved_checkpoint_loads_in_transformers(tmp_path, preset):
    from transformers import AutoModelForCausalLM

    ours = M.build_model(preset, seed=3)
    with torch.no_grad():
        for name, b in ours.named_buffers():
            b.fill_(0.9)  # layer scalars must be written too
    ours.save_pretrained(tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager")
    params_equal(ours, hf)
    assert all(torch.equal(b, dict(hf.named_buffers())[n]) for n, b in ours.named_buffers())
    lay = layout()
    torch.testing.assert_close(ours.response_logprobs(lay), hf_response_logprobs(hf, lay), rtol=1e-5, atol=1e-5)


def test_sharded_round_trip_is_bit_exact(tmp_path):
    from transformers import AutoModelForCausalLM

    ours = M.build_model("tiny-qwen3-moe", seed=1)
    ours.save_pretrained(tmp_path, max_shard_size="40KB")
    shards = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 3 and not (tmp_path / "model.safetensors").exists()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert "model.layers.0.mlp.experts.7.up_proj.weight" in index["weight_map"]  # transformers' per-expert names
    params_equal(M.from_pretrained(tmp_path), ours)
    params_equal(AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32), ours)
    # saving again into the same directory replaces the old shards
    ours.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == ["model.safetensors"]
    assert not (tmp_path / "model.safetensors.index.json").exists()


def test_bf16_checkpoint_loads_bit_exact_and_converts_on_request(tmp_path):
    hf = hf_model(M.preset_hf_config("tiny-gemma4"), dtype=torch.bfloat16)
    hf.save_pretrained(tmp_path)
    ours = M.from_pretrained(tmp_path)
    assert ours.lm_head.weight.dtype == torch.bfloat16
    params_equal(ours, hf)
    wide = M.from_pretrained(tmp_path, dtype=torch.float32)
    assert torch.equal(wide.model.embed_tokens.weight, hf.model.embed_tokens.weight.float())


def test_fused_expert_tensors_load(tmp_path):
    ours = M.build_model("tiny-qwen3-moe", seed=2)
    ours.save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in ours.state_dict().items()}  # fused names, as held in memory
    (tmp_path / "model.safetensors").unlink()
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    params_equal(M.from_pretrained(tmp_path), ours)


def test_gemma4_multimodal_checkpoint_loads_the_text_model(tmp_path):
    ours = M.build_model("tiny-gemma4", seed=4)
    ours.save_pretrained(tmp_path)
    text_cfg = json.loads((tmp_path / "config.json").read_text())
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        tensors = {k.replace("model.", "model.language_model.", 1): f.get_tensor(k) for k in f.keys()}
    tensors["model.vision_tower.encoder.layers.0.mlp.up_proj.linear.weight"] = torch.zeros(4, 4)
    tensors["model.embed_vision.embedding_projection.weight"] = torch.zeros(4, 4)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"], "text_config": text_cfg,
        "vision_config": {"model_type": "gemma4_vision"},
    }))
    loaded = M.from_pretrained(tmp_path)
    params_equal(loaded, ours)
    assert loaded.config == ours.config


def test_real_style_gemma4_config_equals_the_serialised_one():
    """A released config.json (global_head_dim / num_global_key_value_heads) and the per_layer_config
    form transformers writes describe the same model."""
    from dualkv.models.reference import hf_config

    released = M.preset_hf_config("tiny-gemma4")
    written = json.loads(hf_config(released).to_json_string())
    assert "per_layer_config" in written and "global_head_dim" not in written
    assert M.from_hf_config(written) == M.from_hf_config(released)


def test_load_to_device_and_dtype(tmp_path):
    ours = M.build_model("tiny-qwen3", seed=5)
    ours.save_pretrained(tmp_path)
    wide = M.from_pretrained(tmp_path, dtype=torch.float64, device="cpu")
    assert wide.model.layers[0].self_attn.q_proj.weight.dtype == torch.float64
    assert torch.equal(wide.model.norm.weight, ours.model.norm.weight.double())


def _write(tmp_path, model):
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("edit, match", [
    ("drop", "missing 1 tensors"),
    ("extra", "match nothing"),
    ("shape", "has shape"),
])
def test_bad_checkpoints_raise(tmp_path, edit, match):
    tensors = _write(tmp_path, M.build_model("tiny-qwen3", seed=0))
    if edit == "drop":
        del tensors["model.layers.1.mlp.up_proj.weight"]
    elif edit == "extra":
        tensors["model.layers.1.mlp.extra_proj.weight"] = torch.zeros(2)
    else:
        tensors["model.norm.weight"] = torch.zeros(3)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=match):
        M.from_pretrained(tmp_path)


def test_bad_directories_raise(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        M.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(M.preset_hf_config("tiny-qwen3")))
    with pytest.raises(ValueError, match="no safetensors"):
        M.from_pretrained(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "missing.safetensors"}}))
    with pytest.raises(ValueError, match="do not exist"):
        M.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="model_type"):
        M.from_pretrained(tmp_path)


def test_bad_save_and_load_arguments(tmp_path):
    model = M.build_model("tiny-qwen3", seed=0)
    with pytest.raises(ValueError, match="max_shard_size"):
        model.save_pretrained(tmp_path, max_shard_size="lots")
    with pytest.raises(ValueError, match="model"):
        M.save_pretrained(object(), tmp_path)
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="dtype"):
        M.from_pretrained(tmp_path, dtype=torch.int32)


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("2MiB") == 2 * 2**20
    assert parse_size("1.5KB") == 1500
    assert parse_size(123) == 123
    for bad in ("", "5XB", 0, -3, True):
        with pytest.raises(ValueError, match="max_shard_size"):
            parse_size(bad)
