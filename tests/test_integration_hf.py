"""The "dualkv" attention in stock transformers models equals the replicated batch.

Every model family (Qwen3 with sliding layers, Qwen3-MoE, Qwen2-MoE with sliding layers, Llama,
Gemma-4 with sliding/global layers, KV sharing and k=v global layers, Gemma-2 with an attention
softcap) runs the packed
P + N*R batch with "dualkv" and the N-replicated right-padded batch with "sdpa" (eager for the
softcap) from the same weights; response log-probs and every parameter gradient must agree to
1e-5 relative in float32. Each option the test relies on (window, softcap) is also shown to matter,
so a dropped option cannot pass.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from dualkv.core import PackedLayout
from dualkv.models.integrations import hf
from dualkv.models.integrations.replicated import replicated_batch, replicated_response_logprobs

transformers = pytest.importorskip("transformers")

V = 101


def _layout(seed: int = 1) -> PackedLayout:
    """Two groups, uneven prompts (P >> R and P << R), a 1-token response."""
    g = torch.Generator().manual_seed(seed)

    def ids(n):
        return torch.randint(1, V, (n,), generator=g)

    groups = [(ids(13), [ids(3), ids(9), ids(1)]), (ids(2), [ids(7), ids(4)])]
    return PackedLayout.from_groups(groups)


def _qwen3(head_dim: int = 16):
    cfg = transformers.Qwen3Config(
        vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=head_dim, use_sliding_window=True, sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    )
    return transformers.Qwen3ForCausalLM(cfg)


def _qwen3_moe():
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=V, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True,
    )
    return transformers.Qwen3MoeForCausalLM(cfg)


def _qwen2_moe():
    """Sliding layers known only by a module attribute, full layers only by config.layer_types."""
    cfg = transformers.Qwen2MoeConfig(
        vocab_size=V, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
        use_sliding_window=True, sliding_window=4, max_window_layers=2,
    )
    assert cfg.layer_types == ["sliding_attention", "full_attention"]
    return transformers.Qwen2MoeForCausalLM(cfg)


def _llama():
    cfg = transformers.LlamaConfig(
        vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, head_dim=16,
    )
    return transformers.LlamaForCausalLM(cfg)


def _gemma4(head_dim: int = 16):
    cfg = transformers.Gemma4TextConfig(
        vocab_size=V, vocab_size_per_layer_input=V, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, global_head_dim=2 * head_dim,
        num_global_key_value_heads=1,
        attention_k_eq_v=True, hidden_size_per_layer_input=8, sliding_window=4, num_kv_shared_layers=2,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        final_logit_softcapping=30.0,
    )
    return transformers.Gemma4ForCausalLM(cfg)


def _gemma2():
    cfg = transformers.Gemma2Config(
        vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
        attn_logit_softcapping=2.0, final_logit_softcapping=30.0,
    )
    model = transformers.Gemma2ForCausalLM(cfg)
    with torch.no_grad():  # scores well past the softcap, so the cap changes the result
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(20)
            layer.self_attn.k_proj.weight.mul_(20)
    return model


MODELS = {
    "qwen3": (_qwen3, "sdpa"),
    "qwen3_moe": (_qwen3_moe, "sdpa"),
    "qwen2_moe_sliding": (_qwen2_moe, "sdpa"),
    "llama": (_llama, "sdpa"),
    "gemma4": (_gemma4, "sdpa"),
    "gemma2_softcap": (_gemma2, "eager"),
}


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _packed_run(model, layout, weights):
    model.zero_grad(set_to_none=True)
    model.set_attn_implementation("dualkv")
    lp = hf.response_logprobs(model, layout)
    (lp * weights).sum().backward()
    return lp.detach(), _grads(model)


def _replicated_run(model, layout, weights, impl):
    model.zero_grad(set_to_none=True)
    model.set_attn_implementation(impl)
    batch = replicated_batch(layout)
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                use_cache=False)
    lp = replicated_response_logprobs(out.logits, batch, layout)
    (lp * weights).sum().backward()
    return lp.detach(), _grads(model)


def _assert_close(actual, expected, what, rtol=1e-5):
    scale = expected.abs().max().clamp_min(1e-6)
    err = (actual - expected).abs().max()
    assert err <= rtol * scale, f"{what}: max error {err:.3e} > {rtol} x {scale:.3e}"


@pytest.mark.parametrize("name", list(MODELS))
def test_packed_equals_replicated(name):
    build, baseline = MODELS[name]
    torch.manual_seed(0)
    model = build().float()
    layout = _layout()
    weights = torch.randn(layout.num_rows, layout.max_response_len) * layout.response_mask()
    lp, grads = _packed_run(model, layout, weights)
    lp_ref, grads_ref = _replicated_run(model, layout, weights, baseline)
    mask = layout.response_mask()
    _assert_close(lp[mask], lp_ref[mask], "log-probs")
    assert torch.all(lp[~mask] == 0)
    assert set(grads) == set(grads_ref) and len(grads) > 0
    for n in grads:
        _assert_close(grads[n], grads_ref[n], f"grad {n}")


def _drop_option(model, attr):
    for m in model.modules():
        if hasattr(m, attr) and hasattr(m, "q_proj"):
            setattr(m, attr, None)


OPTION_CASES = [
    ("qwen3", "sliding_window"),
    ("qwen2_moe_sliding", "sliding_window"),
    ("gemma4", "sliding_window"),
    ("gemma2_softcap", "attn_logit_softcapping"),
]


@pytest.mark.parametrize(("name", "attr"), OPTION_CASES)
def test_dropping_window_or_softcap_changes_logprobs(name, attr):
    """The test models exercise the option: without it the packed result differs from the baseline."""
    build, baseline = MODELS[name]
    torch.manual_seed(0)
    model = build().float()
    layout = _layout()
    model.set_attn_implementation(baseline)
    batch = replicated_batch(layout)
    with torch.no_grad():
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                use_cache=False)
        ref = replicated_response_logprobs(out.logits, batch, layout)
        _drop_option(model, attr)
        model.set_attn_implementation("dualkv")
        lp = hf.response_logprobs(model, layout)
    assert (lp - ref).abs().max() > 1e-3


def test_plain_forward_call_matches_response_logprobs():
    torch.manual_seed(0)
    model = _qwen3().float()
    model.set_attn_implementation("dualkv")
    layout = _layout(seed=3)
    with torch.no_grad():
        out = model(input_ids=layout.input_ids[None], position_ids=layout.position_ids[None], dualkv_layout=layout,
                    use_cache=False)
        assert out.logits.shape == (1, layout.total_tokens, V)
        from dualkv.core import response_logprobs_from_logits

        full = response_logprobs_from_logits(out.logits[0], layout)
        _assert_close(hf.response_logprobs(model, layout), full, "log-probs")


def test_refuses_bad_calls():
    torch.manual_seed(0)
    model = _llama().float()
    layout = _layout()
    ids, pos = layout.input_ids[None], layout.position_ids[None]
    with pytest.raises(ValueError, match="model: expected attention implementation"):
        hf.response_logprobs(model, layout)
    model.set_attn_implementation("dualkv")
    with pytest.raises(ValueError, match="dualkv_layout"):
        model(input_ids=ids, position_ids=pos, use_cache=False)
    with pytest.raises(ValueError, match="batch size 2"):
        model(input_ids=ids.expand(2, -1), position_ids=pos.expand(2, -1), dualkv_layout=layout, use_cache=False)
    with pytest.raises(ValueError, match="input_ids: expected the layout's"):
        model(input_ids=ids[:, :-1], position_ids=pos[:, :-1], dualkv_layout=layout, use_cache=False)
    for mask in (torch.ones_like(ids), torch.ones(1, 1, ids.shape[1], ids.shape[1], dtype=torch.bool)):
        with pytest.raises(ValueError, match="attention_mask"):
            model(input_ids=ids, position_ids=pos, attention_mask=mask, dualkv_layout=layout, use_cache=False)
    with pytest.raises(ValueError, match="dualkv_layout: expected a dualkv.core.PackedLayout"):
        model(input_ids=ids, position_ids=pos, dualkv_layout=object(), use_cache=False)
    with pytest.raises(ValueError, match="logits_to_keep: set by response_logprobs"):
        hf.response_logprobs(model, layout, logits_to_keep=1)
    with pytest.raises(ValueError, match="temperature"):
        hf.response_logprobs(model, layout, temperature=0.0)
    model.config.attention_dropout = 0.1
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    model.train()
    with pytest.raises(ValueError, match="attention_dropout"):
        hf.response_logprobs(model, layout)


def test_refuses_bidirectional_module():
    layout = _layout()
    T = layout.total_tokens
    module = torch.nn.Module()
    module.is_causal = False
    q = torch.randn(1, 4, T, 8)
    k = torch.randn(1, 2, T, 8)
    with pytest.raises(ValueError, match="is_causal"):
        hf.dualkv_attention_forward(module, q, k, k, None, scaling=0.3, dualkv_layout=layout)
    with pytest.raises(ValueError, match="s_aux"):
        hf.dualkv_attention_forward(torch.nn.Module(), q, k, k, None, dualkv_layout=layout, s_aux=torch.zeros(4))


def test_refuses_chunked_attention():
    cfg = transformers.Llama4TextConfig(
        vocab_size=V, hidden_size=64, intermediate_size=96, intermediate_size_mlp=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=2, attention_chunk_size=4,
    )
    model = transformers.Llama4ForCausalLM(cfg)
    model.set_attn_implementation("dualkv")
    layout = _layout()
    with pytest.raises(ValueError, match="attention_chunk_size"):
        hf.response_logprobs(model, layout)


def _replicated_logprobs(model, layout, impl):
    model.set_attn_implementation(impl)
    batch = replicated_batch(layout)
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                use_cache=False)
    return replicated_response_logprobs(out.logits, batch, layout)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3", "gemma4"])
def test_packed_bf16_on_gpu(name):
    """bf16 on the GPU kernels: the packed error against an fp32 baseline stays within twice
    the error of the bf16 replicated sdpa run (plus a floor)."""
    torch.manual_seed(0)
    model = {"qwen3": _qwen3, "gemma4": _gemma4}[name](head_dim=64).float().cuda()
    layout = _layout().to("cuda")
    mask = layout.response_mask()
    with torch.no_grad():
        ref = _replicated_logprobs(model, layout, "sdpa")
        model.to(torch.bfloat16)
        base = _replicated_logprobs(model, layout, "sdpa")
        model.set_attn_implementation("dualkv")
        lp = hf.response_logprobs(model, layout)
    err, base_err = (lp - ref)[mask].abs().max(), (base - ref)[mask].abs().max()
    assert err <= 2 * base_err + 1e-2, f"packed bf16 error {err:.3e} vs replicated bf16 error {base_err:.3e}"


def test_import_is_lazy_and_registers_on_transformers_import():
    code = (
        "import sys\n"
        "import dualkv.models.integrations\n"
        "assert 'transformers.modeling_utils' not in sys.modules\n"
        "assert not any(m == 'megatron' or m.startswith('megatron.') for m in sys.modules)\n"
        "from transformers.modeling_utils import AttentionInterface\n"
        "from transformers.masking_utils import AttentionMaskInterface\n"
        "assert 'dualkv' in AttentionInterface._global_mapping\n"
        "assert 'dualkv' in AttentionMaskInterface._global_mapping\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
