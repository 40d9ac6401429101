"""Configs and presets: shapes equal transformers' for every preset, round trips, clear errors."""

from __future__ import annotations

import pytest
import torch

import dualkv.models as M
from dualkv.core import PackedLayout
from dualkv.models import AttentionConfig, LayerConfig, MLPConfig, ModelConfig, MoEConfig, RopeConfig
from dualkv.models.layers import RMSNorm


@pytest.mark.parametrize("preset", M.list_presets())
def test_preset_parameters_equal_transformers(preset):
    """Every preset (the released shapes included) builds exactly transformers' parameters (meta device)."""
    from transformers import AutoModelForCausalLM

    from dualkv.models.reference import hf_config

    ours = M.build_model(preset, device="meta")
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_config(M.preset_hf_config(preset)))
    shapes = {n: tuple(p.shape) for n, p in ours.named_parameters()}
    assert shapes == {n: tuple(p.shape) for n, p in hf.named_parameters()}
    assert {n for n, _ in ours.named_buffers()} <= {n for n, _ in hf.named_buffers()}


@pytest.mark.parametrize("preset", M.list_presets())
def test_hf_config_round_trip(preset):
    cfg = M.get_preset(preset)
    assert M.from_hf_config(M.to_hf_config(cfg)) == cfg


def test_released_shapes():
    q8, moe, g31 = M.get_preset("qwen3-8b"), M.get_preset("qwen3-30b-a3b"), M.get_preset("gemma4-31b")
    assert (q8.num_layers, q8.hidden_size, q8.layers[0].attention.num_kv_heads, q8.tie_word_embeddings) == (36, 4096, 8, False)
    assert all(l.moe == MoEConfig(128, 8, 768, "silu", "softmax_topk", True, 0.001) for l in moe.layers)
    sliding = [l.attention for l in g31.layers if l.attention.window]
    glob = [l.attention for l in g31.layers if not l.attention.window]
    assert len(sliding) == 50 and len(glob) == 10
    assert {(a.head_dim, a.num_kv_heads, a.window, a.k_eq_v) for a in sliding} == {(256, 16, 1024, False)}
    assert {(a.head_dim, a.num_kv_heads, a.k_eq_v, a.rope.rope_type, a.rope.partial_rotary_factor) for a in glob} == {
        (512, 4, True, "proportional", 0.25)}
    assert g31.final_logit_softcap == 30.0 and g31.embed_scale == 5376 ** 0.5 and g31.per_layer_input is None
    assert all(l.attention.softmax_scale == 1.0 and l.attention.v_norm for l in g31.layers)


@pytest.mark.parametrize("preset, total, non_embedding", [
    ("qwen3-1.7b", 1.72e9, 1.41e9), ("qwen3-4b", 4.02e9, 3.63e9), ("qwen3-8b", 8.19e9, 6.95e9)])
def test_released_parameter_counts(preset, total, non_embedding):
    """The model cards' sizes (1.7B / 4.0B / 8.2B; 1.4B / 3.6B / 6.95B without the embedding and head)."""
    params = dict(M.build_model(preset, device="meta").named_parameters())  # a tied head is listed once
    n = sum(p.numel() for p in params.values())
    vocab = sum(p.numel() for name, p in params.items() if name in ("model.embed_tokens.weight", "lm_head.weight"))
    assert n == pytest.approx(total, rel=0.005) and n - vocab == pytest.approx(non_embedding, rel=0.005)


def test_legacy_qwen3_config_keys():
    hf = M.preset_hf_config("qwen3-0.6b")
    assert "rope_theta" in hf and "rope_parameters" not in hf
    modern = {k: v for k, v in hf.items() if k not in ("rope_theta", "rope_scaling")}
    modern["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0}
    assert M.from_hf_config(modern) == M.from_hf_config(hf)


def test_proportional_rope_rotates_a_quarter_of_the_frequencies():
    from dualkv.models.layers import rope_inv_freq

    inv = rope_inv_freq(RopeConfig(1e6, "proportional", 0.25), 512)
    assert inv.shape == (256,) and (inv[:64] > 0).all() and (inv[64:] == 0).all()
    assert torch.equal(inv[:64], 1.0 / 1e6 ** (torch.arange(0, 128, 2).float() / 512))


@pytest.mark.parametrize("params", [
    dict(factor=4.0, original_max_position_embeddings=32768, rope_theta=1e6),  # Qwen3's long-context setting
    dict(factor=8.0, original_max_position_embeddings=4096, rope_theta=5e5, truncate=False),
    dict(factor=2.0, original_max_position_embeddings=64, rope_theta=1e4, beta_fast=16, beta_slow=2,
         attention_factor=1.3),
    dict(factor=4.0, original_max_position_embeddings=100000, rope_theta=1e4),  # a ramp over no dims
])
def test_yarn_rope_matches_transformers(params):
    """YaRN's frequencies and cos / sin factor equal transformers' (``_compute_yarn_parameters``) for the
    head dims of Qwen3 (128) and the tiny presets (16)."""
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from dualkv.models.layers import rope_inv_freq
    from dualkv.models.qwen3 import rope_from_hf

    for head_dim in (128, 16):
        hf = Qwen3Config(hidden_size=4 * head_dim, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                         max_position_embeddings=4 * params["original_max_position_embeddings"],
                         rope_parameters={"rope_type": "yarn", **params})
        inv_ref, scale_ref = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
        rope = rope_from_hf(hf.rope_parameters)
        assert rope.rope_type == "yarn" and rope.cos_sin_scale == pytest.approx(scale_ref, rel=1e-12)
        torch.testing.assert_close(rope_inv_freq(rope, head_dim), inv_ref.float(), rtol=1e-6, atol=0)
    if params.get("rope_theta") == 1e6:  # the ramp blends: neither the default spectrum nor the interpolated one
        default = rope_inv_freq(RopeConfig(1e6), 128)
        yarn = rope_inv_freq(rope_from_hf({"rope_type": "yarn", **params}), 128)
        assert torch.equal(yarn[:8], default[:8]) and torch.allclose(yarn[-8:], default[-8:] / 4)


def test_yarn_config_round_trip_and_default_context():
    """A Qwen3 config with YaRN survives to_hf_config -> from_hf_config; without
    ``original_max_position_embeddings`` it takes ``max_position_embeddings`` (as transformers does)."""
    hf = M.preset_hf_config("tiny-qwen3")
    hf["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    cfg = M.from_hf_config(hf)
    rope = cfg.layers[0].attention.rope
    assert rope.rope_type == "yarn" and rope.original_max_position_embeddings == hf["max_position_embeddings"]
    assert M.from_hf_config(M.to_hf_config(cfg)) == cfg


@pytest.mark.parametrize("make, match", [
    (lambda: RopeConfig(1e4, "ntk"), "rope_type"),
    (lambda: RopeConfig(1e4, "yarn", factor=4.0), "original_max_position_embeddings"),
    (lambda: RopeConfig(1e4, "yarn", factor=4.0, original_max_position_embeddings=64, beta_fast=0.5), "beta_fast"),
    (lambda: RopeConfig(1e4, "yarn", factor=4.0, original_max_position_embeddings=64, attention_factor=0.0),
     "attention_factor"),
    (lambda: RopeConfig(1e4, partial_rotary_factor=0.0), "partial_rotary_factor"),
    (lambda: AttentionConfig(6, 4, 16, RopeConfig(1e4)), "num_kv_heads"),
    (lambda: AttentionConfig(4, 2, 15, RopeConfig(1e4)), "head_dim"),
    (lambda: AttentionConfig(4, 2, 16, RopeConfig(1e4), window=0), "window"),
    (lambda: MLPConfig(32, "relu"), "activation"),
    (lambda: MoEConfig(4, 5, 8), "top_k"),
    (lambda: MoEConfig(4, 2, 8, router="sigmoid"), "router"),
    (lambda: LayerConfig(AttentionConfig(4, 2, 16, RopeConfig(1e4))), "neither"),
    (lambda: ModelConfig("llama", 10, 8, (LayerConfig(AttentionConfig(4, 2, 16, RopeConfig(1e4)), MLPConfig(8)),)), "family"),
    (lambda: ModelConfig("qwen3", 10, 8, ()), "layers"),
    (lambda: ModelConfig("qwen3", 10, 8, (LayerConfig(AttentionConfig(4, 2, 16, RopeConfig(1e4), kv_source=0), MLPConfig(8)),)), "kv_source"),
    (lambda: ModelConfig("qwen3", 10, 8, (LayerConfig(AttentionConfig(4, 2, 16, RopeConfig(1e4)), MLPConfig(8)),), pad_token_id=10), "pad_token_id"),
])
def test_config_validation(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize("preset, edit, match", [
    ("tiny-qwen3", {"model_type": "mistral"}, "model_type"),
    ("tiny-qwen3", {"hidden_size": None}, "hidden_size"),
    ("tiny-qwen3", {"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, "rope_type"),
    ("tiny-qwen3", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "mscale": 0.7, "mscale_all_dim": 0.7}},
     "mscale"),
    ("tiny-qwen3", {"layer_types": ["full_attention"]}, "layer_types"),
    ("tiny-qwen3", {"hidden_act": "relu"}, "hidden_act"),
    ("tiny-qwen3-moe", {"num_experts": None}, "num_experts"),
    ("tiny-gemma4", {"use_bidirectional_attention": "all"}, "use_bidirectional_attention"),
    ("tiny-gemma4", {"per_layer_config": {"1": {"sliding_window": 3}}}, "per_layer_config"),
    ("tiny-gemma4", {"enable_moe_block": True}, "enable_moe_block"),
    ("tiny-gemma4", {"num_kv_shared_layers": 4}, "num_kv_shared_layers"),
    ("tiny-gemma4", {"layer_types": ["local"] * 4}, "layer_types"),
])
def test_bad_hf_configs_raise(preset, edit, match):
    hf = M.preset_hf_config(preset)
    for k, v in edit.items():
        if v is None:
            hf.pop(k)
        else:
            hf[k] = v
    with pytest.raises(ValueError, match=match):
        M.from_hf_config(hf)


def test_build_model_inputs():
    a, b = M.build_model("tiny-qwen3", seed=7), M.build_model(M.get_preset("tiny-qwen3"), seed=7)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    c = M.build_model(M.preset_hf_config("tiny-qwen3"), seed=8)
    assert not torch.equal(c.lm_head.weight, a.lm_head.weight)
    assert (a.model.layers[0].input_layernorm.weight == 1).all()
    g = M.build_model("tiny-gemma4", seed=0, dtype=torch.bfloat16)
    assert g.lm_head.weight is g.model.embed_tokens.weight and g.lm_head.weight.dtype == torch.bfloat16
    assert (g.model.embed_tokens.weight[0] == 0).all()  # pad row, as transformers initialises it
    moe = M.build_model("tiny-gemma4-moe", seed=0)
    norms = [m.weight for m in moe.modules() if isinstance(m, RMSNorm) and m.weight is not None]
    assert len(norms) == 4 * 9 + 1 and all((w == 1).all() for w in norms)
    assert all((l.router.per_expert_scale == 1).all() and l.experts.down_proj.std() > 0.01 for l in moe.model.layers)
    with pytest.raises(ValueError, match="preset"):
        M.build_model("qwen9-7b")
    with pytest.raises(ValueError, match="preset_or_config"):
        M.build_model(42)


def test_model_input_errors():
    model = M.build_model("tiny-qwen3", seed=0)
    lay = PackedLayout.from_groups([(torch.tensor([3, 4, 5]), [torch.tensor([6, 7])])])
    ids, pos = lay.input_ids, lay.position_ids
    with pytest.raises(ValueError, match="layout"):
        model.hidden_states(ids, pos, "layout")
    with pytest.raises(ValueError, match="input_ids"):
        model.hidden_states(ids.float(), pos, lay)
    with pytest.raises(ValueError, match="position_ids"):
        model.hidden_states(ids, pos[:3], lay)
    with pytest.raises(ValueError, match="at most"):
        model.hidden_states(torch.cat([ids, ids]), torch.cat([pos, pos]), lay)
    with pytest.raises(ValueError, match="input_ids"):
        model.response_logprobs(PackedLayout.from_lengths([3], [[2]]))
    with pytest.raises(ValueError, match="layers"):
        model.set_activation_checkpointing([0, 7])
    with pytest.raises(ValueError, match="backend"):
        model.set_moe_backend("fast")
    with pytest.raises(ValueError, match="fn"):
        model.set_attn_fn("dualkv")
    with pytest.raises(ValueError, match="cfg"):
        M.CausalLM(M.preset_hf_config("tiny-qwen3"))
    with pytest.raises(ValueError, match="style"):
        RMSNorm(8, 1e-6, "llama")


def test_every_attention_module_has_a_replaceable_attn_fn():
    from dualkv.core import dualkv_attention

    model = M.build_model("tiny-gemma4-e", seed=0)
    fns = [m.attn_fn for m in model.modules() if hasattr(m, "attn_fn")]
    assert len(fns) == model.config.num_layers and all(f is dualkv_attention for f in fns)
    calls = []
    model.set_attn_fn(lambda q, k, v, lay, **kw: (calls.append(kw), dualkv_attention(q, k, v, lay, **kw))[1])
    model.response_logprobs(PackedLayout.from_groups([(torch.tensor([3, 4, 5]), [torch.tensor([6, 7])])]))
    assert [c["window"] for c in calls] == [6, None, 6, 6, None]
    assert all(c["softmax_scale"] == 1.0 and c["softcap"] is None for c in calls)


def test_compiled_layers_trace_whole_and_share_graphs_across_models():
    """torch.compile of every decoder layer: no graph break (fullgraph), and a second model with
    the same config (the frozen reference of GRPO) reuses the first one's graphs: RoPE tables are
    keyed by values, not by config objects, so no identity guard forces a recompile."""
    import torch._dynamo

    torch._dynamo.reset()
    layout = PackedLayout.from_groups([(torch.tensor([3, 4, 5, 6]), [torch.tensor([6, 7]), torch.tensor([8])])])
    models = [M.build_model("tiny-qwen3", seed=s) for s in (0, 1)]
    for model in models:
        for block in model.model.layers:
            block.compile(dynamic=True, fullgraph=True, backend="eager")
    try:
        with torch.no_grad():
            first = models[0].response_logprobs(layout)
            torch._dynamo.config.error_on_recompile = True
            second = models[1].response_logprobs(layout)
    finally:
        torch._dynamo.config.error_on_recompile = False
        torch._dynamo.reset()
    assert first.shape == second.shape and not torch.equal(first, second)
