"""DualKV core attention in Megatron-core GPTModel equals Megatron's own attention on the replicated batch.

On CPU with gloo. Patched inside the tests, and only there: the CUDA-bound pieces of Megatron
itself (``torch.cuda.current_device`` for its RoPE and scratch buffers, the two mask builders of
its unfused softmax that hard-code device "cuda", the CUDA RNG tracker its attention dropout forks,
and a name its MoE router reads that only exists with Transformer Engine).

- dense (GQA, qk-layernorm, sliding + global layers) and MoE (TopKRouter, experts): the packed
  P + N*R batch through ``build_gpt_model`` gives the response log-probs and every parameter
  gradient of the same weights in a stock ``GPTModel`` (``DotProductAttention``) on the replicated
  right-padded batch, to 1e-5 relative in float32;
- tensor parallel size 2 over 2 gloo processes equals size 1 (dense and MoE);
- RoPE at logical positions matters (a plain GPTModel's packed RoPE gives different log-probs);
- bad settings are refused with a ValueError naming them.
"""

from __future__ import annotations

import contextlib
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

pytest.importorskip("megatron.core")

from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from dualkv.core import PackedLayout  # noqa: E402
from dualkv.models.integrations import megatron as dkm  # noqa: E402
from dualkv.models.integrations.replicated import replicated_batch, replicated_response_logprobs  # noqa: E402

V = 96  # divisible by the TP size


# ------------------------------------------------------------------ CPU stand-ins for CUDA-bound Megatron code
def _causal_mask_cpu(sq):
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _window_mask_cpu(sq, skv, window_size):
    keep = torch.ones(sq, skv, dtype=torch.bool).triu(skv - sq - window_size[0]).tril(skv - sq + window_size[1])
    return ~keep


class _NoRngTracker:
    def fork(self, *args, **kwargs):
        return contextlib.nullcontext()


def _patch_megatron_for_cpu(mp: pytest.MonkeyPatch) -> None:
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.transformer.dot_product_attention as dot_product_attention
    import megatron.core.transformer.moe.moe_utils as moe_utils

    mp.setattr(torch.cuda, "current_device", lambda: "cpu")
    mp.setattr(fused_softmax, "get_default_causal_mask", _causal_mask_cpu)
    mp.setattr(fused_softmax, "get_sliding_window_causal_mask", _window_mask_cpu)
    mp.setattr(dot_product_attention.tensor_parallel, "get_cuda_rng_tracker", lambda *a, **k: _NoRngTracker())
    mp.setattr(moe_utils, "te_general_gemm", None, raising=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def single_rank():
    """A one-process gloo world with Megatron's model-parallel state (TP=1), torn down after the module."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    with pytest.MonkeyPatch.context() as mp:
        _patch_megatron_for_cpu(mp)
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()


# ------------------------------------------------------------------ models and batches
def _config(moe: bool = False, **overrides) -> TransformerConfig:
    kw = dict(
        num_layers=3, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16, ffn_hidden_size=96,
        use_cpu_initialization=True, attention_dropout=0.0, hidden_dropout=0.0, normalization="RMSNorm",
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, qk_layernorm=True,
        window_size=(3, 0), window_attn_skip_freq=2,  # layers 1, 3 slide (window 4), layer 2 global
    )
    if moe:
        kw.update(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_aux_loss_coeff=0.0,
                  moe_router_load_balancing_type="none", moe_token_dispatcher_type="allgather")
    kw.update(overrides)
    return TransformerConfig(**kw)


def _layout(seed: int = 1) -> PackedLayout:
    """Two groups: P >> R and P << R, a 1-token response."""
    g = torch.Generator().manual_seed(seed)

    def ids(n):
        return torch.randint(0, V, (n,), generator=g)

    groups = [(ids(11), [ids(3), ids(8), ids(1)]), (ids(3), [ids(6), ids(5)])]
    return PackedLayout.from_groups(groups)


def _stock_model(config: TransformerConfig) -> GPTModel:
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, qk_layernorm=True, normalization="RMSNorm")
    return GPTModel(config, spec, vocab_size=V, max_sequence_length=64, position_embedding_type="rope")


def _weights(layout: PackedLayout) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    return torch.randn(layout.num_rows, layout.max_response_len, generator=gen) * layout.response_mask()


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _packed_run(model, layout, weights):
    model.zero_grad(set_to_none=True)
    lp = dkm.response_logprobs(model, layout)
    (lp * weights).sum().backward()
    return lp.detach(), _grads(model)


def _replicated_run(model, layout, weights):
    model.zero_grad(set_to_none=True)
    batch = replicated_batch(layout)
    L = batch.input_ids.shape[1]
    causal = torch.ones(L, L, dtype=torch.bool).triu(1)[None, None]  # True = masked; right padding needs no more
    logits = model(batch.input_ids, batch.position_ids, causal)
    lp = replicated_response_logprobs(logits, batch, layout)
    (lp * weights).sum().backward()
    return lp.detach(), _grads(model)


def _assert_close(actual, expected, what, rtol=1e-5):
    scale = expected.abs().max().clamp_min(1e-6)
    err = (actual - expected).abs().max()
    assert err <= rtol * scale, f"{what}: max error {err:.3e} > {rtol} x {scale:.3e}"


# ------------------------------------------------------------------ packed == replicated
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_packed_equals_replicated(single_rank, moe):
    torch.manual_seed(0)
    config = _config(moe=moe)
    model = dkm.build_gpt_model(config, vocab_size=V, max_sequence_length=64)
    stock = _stock_model(config)
    stock.load_state_dict(model.state_dict(), strict=True)
    from megatron.core.transformer.moe.moe_layer import MoELayer

    assert all(isinstance(layer.mlp, MoELayer) == moe for layer in model.decoder.layers)
    layout = _layout()
    weights = _weights(layout)
    lp, grads = _packed_run(model, layout, weights)
    lp_ref, grads_ref = _replicated_run(stock, layout, weights)
    mask = layout.response_mask()
    _assert_close(lp[mask], lp_ref[mask], "log-probs")
    assert torch.all(lp[~mask] == 0)
    assert set(grads) == set(grads_ref) and len(grads) > 0
    for n in grads:
        _assert_close(grads[n], grads_ref[n], f"grad {n}")


def test_window_and_logical_rope_matter(single_rank):
    """Dropping the window, or RoPE restarting at 0 per response (a plain GPTModel), changes the result."""
    torch.manual_seed(0)
    config = _config()
    model = dkm.build_gpt_model(config, vocab_size=V, max_sequence_length=64)
    layout = _layout()
    inputs = dkm.megatron_inputs(layout)
    with torch.no_grad():
        lp = dkm.response_logprobs(model, layout)
        plain = GPTModel(config, dkm.dualkv_layer_spec(), vocab_size=V, max_sequence_length=64,
                         position_embedding_type="rope")
        plain.load_state_dict(model.state_dict())
        for m in plain.modules():
            if isinstance(m, dkm.DualKVCoreAttention):
                m.positions_from_layout = True  # pretend, to show what the guard prevents
        logits = plain(inputs.input_ids, inputs.position_ids, None, packed_seq_params=inputs.packed_seq_params)
        assert (dkm.logprobs_from_logits(logits, layout) - lp).abs().max() > 1e-3
        for m in model.modules():
            if isinstance(m, dkm.DualKVCoreAttention):
                m.window = None
        assert (dkm.response_logprobs(model, layout) - lp).abs().max() > 1e-3


def test_megatron_inputs_and_logprobs(single_rank):
    layout = _layout()
    inputs = dkm.megatron_inputs(layout)
    assert inputs.input_ids.shape == inputs.position_ids.shape == (1, layout.total_tokens)
    p = inputs.packed_seq_params
    assert p.qkv_format == "thd" and p.layout is layout
    assert torch.equal(p.cu_seqlens_q, layout.cu_seqlens) and torch.equal(p.cu_seqlens_kv, layout.cu_seqlens)
    assert p.max_seqlen_q == p.max_seqlen_kv == 11 + 8
    logits = torch.randn(1, layout.total_tokens, V)
    from dualkv.core import response_logprobs_from_logits

    for t in (1.0, 0.7):
        expected = response_logprobs_from_logits(logits[0], layout, t)
        _assert_close(dkm.logprobs_from_logits(logits, layout, t), expected, "log-probs")


def test_core_attention_options(single_rank):
    """Scale, per-layer window (Megatron's (left, 0) = keys up to left back) and a spec's softcap reach the op."""
    from dualkv.core import reference_attention

    layout = _layout()
    T = layout.total_tokens
    q, k, v = torch.randn(T, 4, 16), torch.randn(T, 2, 16), torch.randn(T, 2, 16)
    config = _config(softmax_scale=0.3, window_size=(5, 0), window_attn_skip_freq=[1, 0, 1])
    spec = dkm.dualkv_layer_spec(softcap=2.0).submodules.self_attention.submodules.core_attention
    for layer_number, window in ((1, 6), (2, None), (3, 6)):
        attn = spec(config=config, layer_number=layer_number, attn_mask_type=AttnMaskType.causal, attention_type="self",
                    softmax_scale=config.softmax_scale, cp_comm_type=None, pg_collection=None)
        attn.positions_from_layout = True
        assert (attn.softmax_scale, attn.window, attn.softcap) == (0.3, window, 2.0)
        out = attn(q, k, v, None, packed_seq_params=dkm.packed_seq_params(layout))
        ref = reference_attention(q, k, v, layout, softmax_scale=0.3, window=window, softcap=2.0)
        _assert_close(out, ref.reshape(T, 64), f"layer {layer_number}")


def test_refusals(single_rank):
    torch.manual_seed(0)
    layout = _layout()

    def core(config, **kw):
        args = dict(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
        args.update(kw)
        return dkm.DualKVCoreAttention(**args)

    with pytest.raises(ValueError, match="attention_dropout"):
        core(_config(attention_dropout=0.1))
    with pytest.raises(ValueError, match="window_size"):
        core(_config(window_size=(3, 2), window_attn_skip_freq=None))
    with pytest.raises(ValueError, match="attention_type"):
        core(_config(), attention_type="cross")
    with pytest.raises(ValueError, match="attn_mask_type"):
        core(_config(), attn_mask_type=AttnMaskType.no_mask)
    with pytest.raises(ValueError, match="softmax_type"):
        core(_config(softmax_type="off-by-one"))
    config = _config()
    config.context_parallel_size = 2  # as a CP run would set it
    with pytest.raises(ValueError, match="context_parallel_size"):
        core(config)
    with pytest.raises(ValueError, match="apply_rope_fusion"):
        dkm.build_gpt_model(_config(apply_rope_fusion=True), vocab_size=V, max_sequence_length=64)

    attn = core(_config())
    T = layout.total_tokens
    q, k = torch.randn(T, 4, 16), torch.randn(T, 2, 16)
    params = dkm.packed_seq_params(layout)
    with pytest.raises(ValueError, match="positions"):
        attn(q, k, k, None, packed_seq_params=params)
    attn.positions_from_layout = True
    assert attn(q, k, k, None, packed_seq_params=params).shape == (T, 64)
    with pytest.raises(ValueError, match="packed_seq_params"):
        attn(q, k, k, None, packed_seq_params=None)
    with pytest.raises(ValueError, match="attention_mask"):
        attn(q, k, k, torch.ones(1, 1, T, T, dtype=torch.bool), packed_seq_params=params)
    stock = _stock_model(_config())
    with pytest.raises(ValueError, match="model: expected a DualKVGPTModel"):
        dkm.response_logprobs(stock, layout)
    with pytest.raises(ValueError, match="layer_spec"):
        dkm.with_dualkv_attention(dkm.ModuleSpec(module=torch.nn.Identity))
    with pytest.raises(ValueError, match="logits"):
        dkm.logprobs_from_logits(torch.randn(2, T, V), layout)


# ------------------------------------------------------------------ tensor parallel 2 == 1
def _shard(full: torch.Tensor, param, name: str, rank: int, tp: int, gated: bool) -> torch.Tensor:
    """Rank ``rank``'s piece of a TP=1 tensor, as Megatron lays it out."""
    if not getattr(param, "tensor_model_parallel", False):
        return full
    dim = param.partition_dim
    if gated and name.endswith("linear_fc1.weight"):  # [gate; up] -> each rank holds [gate_r; up_r]
        gate, up = full.chunk(2, dim=dim)
        return torch.cat([gate.chunk(tp, dim=dim)[rank], up.chunk(tp, dim=dim)[rank]], dim=dim)
    return full.chunk(tp, dim=dim)[rank]


def _tp_reduced_grads(model, group) -> dict[str, torch.Tensor]:
    """Gradients as Megatron's finalize step leaves them: qk-layernorm gradients (each rank saw
    only its own heads) summed over the TP group."""
    grads = {}
    for n, p in model.named_parameters():
        g = p.grad.clone()
        if "q_layernorm" in n or "k_layernorm" in n:
            dist.all_reduce(g, group=group)
        grads[n] = g
    return grads


def _tp_worker(rank: int, world: int, port: int) -> None:
    with pytest.MonkeyPatch.context() as mp:
        _patch_megatron_for_cpu(mp)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        try:
            for moe in (False, True):
                _tp_compare(rank, world, moe)
        finally:
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()


def _tp_compare(rank: int, tp: int, moe: bool) -> None:
    layout = _layout()
    weights = _weights(layout)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    torch.manual_seed(0)
    ref = dkm.build_gpt_model(_config(moe=moe), vocab_size=V, max_sequence_length=64)
    lp_ref, grads_ref = _packed_run(ref, layout, weights)
    full = {n: p.detach() for n, p in ref.named_parameters()}
    parallel_state.destroy_model_parallel()

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    config = _config(moe=moe, tensor_model_parallel_size=tp)
    model = dkm.build_gpt_model(config, vocab_size=V, max_sequence_length=64)
    if moe:  # Megatron refuses MoE + TP without sequence parallelism in training mode only
        ref.eval(), model.eval()
    params = dict(model.named_parameters())
    assert set(params) == set(full)
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(_shard(full[n], p, n, rank, tp, config.gated_linear_unit))
    heads = [m for m in model.modules() if isinstance(m, dkm.DualKVCoreAttention)]
    assert heads and all(m.positions_from_layout for m in heads)
    lp, _ = _packed_run(model, layout, weights)
    grads = _tp_reduced_grads(model, parallel_state.get_tensor_model_parallel_group())
    _assert_close(lp, lp_ref, f"rank {rank} log-probs")
    for n, p in params.items():
        expected = _shard(grads_ref[n], p, n, rank, tp, config.gated_linear_unit)
        if ".experts." in n:
            # Without sequence parallelism Megatron's all-gather dispatcher hands every expert the
            # tokens of all TP ranks, which are copies: expert gradients come out tp times larger
            # (the reason Megatron refuses MoE + TP without SP in training mode).
            expected = expected * tp
        _assert_close(grads[n], expected, f"rank {rank} grad {n}")
    parallel_state.destroy_model_parallel()


def test_tensor_parallel_2_equals_1():
    """Dense and MoE, TP=2 over two gloo processes vs TP=1 with the same weights.

    Megatron's sequence parallelism is not covered here: its local-spec norms refuse it (it needs
    Transformer Engine or Apex norms)."""
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_tp_worker, args=(2, _free_port()), nprocs=2, join=True)
