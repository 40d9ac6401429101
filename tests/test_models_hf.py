"""Our packed models against transformers on the N-replicated batch (fp32, CPU, tiny random configs).

For each family: transformers builds and saves a random model, ``dualkv.models.from_pretrained`` loads
it, and the per-token response log-probs of one packed forward and the parameter gradients of a
GRPO-style loss equal transformers' on the replicated padded rows.
"""

from __future__ import annotations

import random

import pytest
import torch

import dualkv.models as M
from dualkv.core import PackedLayout, dualkv_attention
from dualkv.models.reference import hf_aux_loss, hf_model, hf_response_logprobs
from helpers import count_calls

LP_RTOL = 1e-5  # log-probs, relative
GRAD_RTOL = 1e-4  # gradients, relative to each parameter's largest gradient entry (fp32 rounding)


def perturb(hf, seed=0):
    """Move norm weights, router scales and layer scalars off their initial ones (hide nothing)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or "scale" in name:
                p.add_(0.2 * torch.randn(p.shape, generator=g))
        for name, b in hf.named_buffers():
            if name.endswith("layer_scalar"):
                b.fill_(0.8)
    return hf


def rollout(vocab, shapes, seed=1, first_token=None):
    """A layout from (P, [R, ...]) shapes with random tokens (``first_token`` overrides token 0)."""
    g = torch.Generator().manual_seed(seed)
    groups = [(torch.randint(1, vocab, (p,), generator=g), [torch.randint(1, vocab, (r,), generator=g) for r in rs])
              for p, rs in shapes]
    if first_token is not None:
        groups[0][0][0] = first_token
    return PackedLayout.from_groups(groups)


SHAPES = [(9, [3, 7, 1]), (13, [10, 2]), (1, [4, 5, 6, 2]), (4, [1])]


def load_pair(tmp_path, hf_cfg, seed=0):
    torch.manual_seed(seed)
    hf = perturb(hf_model(hf_cfg), seed)
    hf.save_pretrained(tmp_path)
    return hf, M.from_pretrained(tmp_path)


def assert_close_rel(ours, ref, rtol, what):
    mask = ref != 0
    rel = ((ours - ref).abs() / ref.abs().clamp_min(1e-6))[mask]
    assert rel.max() <= rtol, f"{what}: max relative error {rel.max():.3g} > {rtol}"


def grpo_backward(lp, layout, seed=3):
    adv = torch.randn(layout.num_rows, generator=torch.Generator().manual_seed(seed))
    (adv[:, None] * lp * layout.response_mask()).sum().backward()


def assert_grads_match(ours, hf):
    hf_params = dict(hf.named_parameters())
    ours_params = dict(ours.named_parameters())
    assert set(ours_params) == set(hf_params)
    for name, p in ours_params.items():
        ref = hf_params[name].grad
        assert p.grad is not None and ref is not None, name
        err = (p.grad - ref).abs().max() / ref.abs().max().clamp_min(1e-8)
        assert err <= GRAD_RTOL, f"{name}: gradient error {err:.3g} (relative to max {ref.abs().max():.3g})"


FAMILIES = ["tiny-qwen3", "tiny-qwen3-moe", "tiny-gemma4", "tiny-gemma4-e", "tiny-gemma4-moe"]


@pytest.mark.parametrize("preset", FAMILIES)
def test_logprobs_and_grads_match_transformers(tmp_path, preset):
    cfg = M.preset_hf_config(preset)
    hf, ours = load_pair(tmp_path, cfg)
    # token 0 is Gemma's pad id: its embedding row must get no gradient, as in transformers
    layout = rollout(cfg["vocab_size"], SHAPES, first_token=0)
    lp = ours.response_logprobs(layout)
    ref = hf_response_logprobs(hf, layout)
    assert lp.shape == (layout.num_rows, layout.max_response_len) and lp.dtype == torch.float32
    assert_close_rel(lp, ref, LP_RTOL, preset)
    assert (lp[~layout.response_mask()] == 0).all()
    grpo_backward(lp, layout)
    grpo_backward(ref, layout)
    assert_grads_match(ours, hf)


QWEN3_VARIANTS = {
    "tied_bias_sliding": dict(tie_word_embeddings=True, attention_bias=True, use_sliding_window=True,
                              sliding_window=5, max_window_layers=1),
    "yarn": dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    "moe_sliding_every_other": dict(model_type="qwen3_moe", num_experts=6, num_experts_per_tok=3,
                                    moe_intermediate_size=24, norm_topk_prob=False, decoder_sparse_step=2,
                                    mlp_only_layers=[], use_sliding_window=True, sliding_window=4),
}


@pytest.mark.parametrize("variant", sorted(QWEN3_VARIANTS))
def test_qwen3_variants_match_transformers(tmp_path, variant):
    cfg = {**M.preset_hf_config("tiny-qwen3"), **QWEN3_VARIANTS[variant]}
    cfg["num_hidden_layers"] = 2
    hf, ours = load_pair(tmp_path, cfg, seed=5)
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == bool(cfg.get("tie_word_embeddings"))
    layout = rollout(cfg["vocab_size"], [(11, [6, 1, 8]), (2, [7])], seed=4)
    lp, ref = ours.response_logprobs(layout), hf_response_logprobs(hf, layout)
    assert_close_rel(lp, ref, LP_RTOL, variant)
    grpo_backward(lp, layout)
    grpo_backward(ref, layout)
    assert_grads_match(ours, hf)


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-gemma4"])
def test_temperature_and_entropy_match_transformers(tmp_path, preset):
    cfg = M.preset_hf_config(preset)
    hf, ours = load_pair(tmp_path, cfg, seed=7)
    layout = rollout(cfg["vocab_size"], SHAPES, seed=8)
    lp, ent = ours.response_logprobs(layout, temperature=0.7, return_entropy=True)
    ref_lp, ref_ent = hf_response_logprobs(hf, layout, temperature=0.7, return_entropy=True)
    assert_close_rel(lp, ref_lp, LP_RTOL, "logprobs")
    assert_close_rel(ent, ref_ent, LP_RTOL, "entropy")
    mask = layout.response_mask()
    ((lp + 0.1 * ent) * mask).sum().backward()
    ((ref_lp + 0.1 * ref_ent) * mask).sum().backward()
    assert_grads_match(ours, hf)


@pytest.mark.parametrize("backend", ["loop", "grouped"])
def test_moe_backends_and_aux_loss_match_transformers(tmp_path, backend):
    cfg = M.preset_hf_config("tiny-qwen3-moe")
    hf, ours = load_pair(tmp_path, cfg, seed=11)
    ours.set_moe_backend(backend)
    layout = rollout(cfg["vocab_size"], SHAPES, seed=12)
    lp = ours.response_logprobs(layout)
    assert_close_rel(lp, hf_response_logprobs(hf, layout), LP_RTOL, backend)
    # prompt tokens count N times, as in the replicated batch
    ref_aux = hf_aux_loss(hf, layout)
    assert len(ours.router_stats) == 2
    torch.testing.assert_close(ours.aux_loss, ref_aux, rtol=1e-5, atol=1e-7)
    ours.aux_loss.backward()
    ref_aux.backward()
    for name in ("model.layers.0.mlp.gate.weight", "model.layers.2.mlp.gate.weight"):
        ref = dict(hf.named_parameters())[name].grad
        torch.testing.assert_close(dict(ours.named_parameters())[name].grad, ref, rtol=1e-4, atol=1e-7)


def test_moe_dense_model_has_no_aux_loss(tmp_path):
    ours = M.build_model("tiny-qwen3", seed=0)
    ours.response_logprobs(rollout(256, SHAPES))
    assert ours.aux_loss is None and ours.router_stats == []


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-gemma4-e"])
def test_activation_checkpointing_gives_the_same_gradients(preset):
    model = M.build_model(preset, seed=2)
    layout = rollout(256, SHAPES, seed=2)
    grads = []
    for layers in (False, [0, 2], True):
        model.zero_grad()
        model.set_activation_checkpointing(layers)
        lp = model.response_logprobs(layout)
        grpo_backward(lp, layout)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert model.checkpointed_layers == frozenset(range(model.config.num_layers))
    for other in grads[1:]:
        for name, g in grads[0].items():
            torch.testing.assert_close(other[name], g, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("preset, compile_backend", [("tiny-qwen3", None), ("tiny-gemma4-e", None),
                                                     ("tiny-qwen3", "aot_eager")])
def test_checkpointing_that_keeps_attention(preset, compile_backend, monkeypatch):
    """keep_attention: the same gradients as no checkpointing, and the attention forward runs once per
    layer instead of twice (its outputs are saved, the rest of the layer is recomputed); also with the
    layers compiled. Gemma-4-e has KV-sharing layers (attention reads another layer's K/V)."""
    import dualkv.core.backends.reference as reference_backend

    calls = count_calls(monkeypatch, reference_backend, "forward")
    torch._dynamo.reset()
    model = M.build_model(preset, seed=3)
    if compile_backend:
        for block in model.model.layers:
            block.compile(dynamic=True, backend=compile_backend)
    layout = rollout(256, SHAPES, seed=3)
    L = model.config.num_layers
    grads, counts = [], []
    try:
        for layers, keep in ((False, False), (True, False), (True, True)):
            model.zero_grad()
            model.set_activation_checkpointing(layers, keep_attention=keep)
            calls.clear()
            lp = model.response_logprobs(layout)
            grpo_backward(lp, layout)
            counts.append(len(calls))
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    finally:
        torch._dynamo.reset()
    assert counts == [L, 2 * L, L]
    for other in grads[1:]:
        for name, g in grads[0].items():
            torch.testing.assert_close(other[name], g, rtol=1e-5, atol=1e-7, msg=name)
    with pytest.raises(ValueError, match="keep_attention: expected a bool"):
        model.set_activation_checkpointing(True, keep_attention="yes")


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-gemma4-e", "tiny-gemma4-moe"])
def test_hidden_states_on_slices_equal_the_full_pass(preset):
    """Sequence-parallel contract: on a contiguous slice, everything but attention is per token.

    Attention is replayed from a full pass (what the SP attention wrapper provides), so the slice's
    hidden states and router statistics must equal the full pass's."""
    model = M.build_model(preset, seed=4)
    layout = rollout(256, SHAPES, seed=5)
    ids, pos = layout.input_ids, layout.position_ids
    recorded = []

    def record(q, k, v, lay, **kw):
        out = dualkv_attention(q, k, v, lay, **kw)
        recorded.append(out)
        return out

    with torch.no_grad():
        full = model.set_attn_fn(record).hidden_states(ids, pos, layout)
        full_stats = model.router_stats
        T, cuts = layout.total_tokens, [0, 11, 30, layout.total_tokens]
        parts, stats = [], []
        for a, b in zip(cuts[:-1], cuts[1:]):
            replay = iter(recorded)
            model.set_attn_fn(lambda q, k, v, lay, a=a, b=b, it=replay, **kw: next(it)[a:b])
            parts.append(model.hidden_states(ids[a:b], pos[a:b], layout, token_offset=a))
            stats.append(model.router_stats)
    torch.testing.assert_close(torch.cat(parts), full, rtol=1e-4, atol=1e-5)  # GEMM blocking differs per slice
    if model.config.is_moe:
        for layer, ref in enumerate(full_stats):
            summed = [sum(s[layer][i] for s in stats) for i in range(3)]
            for got, want in zip(summed, ref):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert float(full_stats[0].total) == layout.replicated_tokens
        with pytest.raises(ValueError, match="token_offset"):
            model.hidden_states(ids[:5], pos[:5], layout)


def test_kv_sharing_layers_reuse_their_source():
    model = M.build_model("tiny-gemma4-e", seed=0)
    attn = [layer.self_attn for layer in model.model.layers]
    assert [a.cfg.kv_source for a in attn] == [None, None, None, 2, 1]
    assert not hasattr(attn[3], "k_proj") and not hasattr(attn[4], "v_norm")
    assert model.model.layers[3].mlp.up_proj.out_features == 2 * model.model.layers[0].mlp.up_proj.out_features
    seen = []
    model.set_attn_fn(lambda q, k, v, lay, **kw: (seen.append((k, v)), dualkv_attention(q, k, v, lay, **kw))[1])
    model.response_logprobs(rollout(256, SHAPES))
    assert seen[3][0] is seen[2][0] and seen[4][1] is seen[1][1]


def test_random_batches_match_transformers(tmp_path):
    """Fresh random group structures (many small groups, P >> R and P << R)."""
    cfg = M.preset_hf_config("tiny-gemma4")
    hf, ours = load_pair(tmp_path, cfg, seed=21)
    rng = random.Random(0)
    for trial in range(3):
        shapes = [(rng.choice([1, 2, 17]), [rng.randint(1, 12) for _ in range(rng.randint(1, 4))])
                  for _ in range(rng.randint(1, 5))]
        layout = rollout(cfg["vocab_size"], shapes, seed=trial)
        assert_close_rel(ours.response_logprobs(layout), hf_response_logprobs(hf, layout), LP_RTOL, str(shapes))
