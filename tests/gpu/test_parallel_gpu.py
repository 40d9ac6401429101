"""GPU runs of dualkv.parallel over NCCL: one GPU (world size 1), and every GPU of the machine as
one sequence-parallel group when there are two or more (the 8-GPU run has its own issue).

At world size 1 the SP code short-cuts its collectives, so the collective layers themselves are
driven directly there (NCCL all-to-all of the packed q/k/v buffer, the hidden-state all-reduce and
the log-prob sum, each with its backward). Then a tiny dense and a tiny hybrid model run the whole SP
path in bf16 (Triton attention) against the model's own single-device log-probs and LM-head
gradient; with several GPUs the hybrid model's global layers have fewer KV heads than SP ranks
(the KV-head replication path).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from dualkv.parallel.testing import run_local_world

pytestmark = pytest.mark.gpu


def _collectives(device):
    from dualkv.parallel import logprobs as lp_mod
    from dualkv.parallel import ulysses as ul_mod

    pg = dist.group.WORLD
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(37, 8, 64, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()
    k = torch.randn(37, 2, 64, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()
    q2, k2 = ul_mod._SeqToHeads.apply(pg, 1, q, k)
    q3, k3 = ul_mod._HeadsToSeq.apply(pg, 1, q2, k2)
    (q3.float().sum() + 2 * k3.float().sum()).backward()
    assert torch.equal(q3, q) and torch.equal(k3, k)
    assert torch.equal(q.grad, torch.ones_like(q)) and torch.equal(k.grad, torch.full_like(k, 2))
    x = torch.randn(3, 16, device=device, generator=g).requires_grad_()
    y = lp_mod._AllReduceSum.apply(x, pg)
    z = lp_mod._SumOfReplicatedLoss.apply(x, pg)
    (3 * y.sum() + z.sum()).backward()
    assert torch.equal(y, x) and torch.equal(z, x) and torch.equal(x.grad, torch.full_like(x, 4.0))


# Head dims the Triton kernels take (128; 256 sliding / 512 global for the hybrid), vocab 1024.
MODELS = {
    "dense": ("tiny-qwen3", dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_attention_heads=8,
                                 num_key_value_heads=2, head_dim=128)),
    "hybrid": ("tiny-gemma4", dict(vocab_size=1024, vocab_size_per_layer_input=1024, hidden_size=256,
                                   intermediate_size=512, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
                                   global_head_dim=512, num_global_key_value_heads=1, sliding_window=64)),
}


def _run(model, layout, mesh, use_sp):
    """Log-probs of the micro-batch (through SP when ``use_sp``) and the LM-head gradient of their sum
    (each SP rank holds the gradient of its slice of the tokens, so the group's shares are added)."""
    from dualkv.parallel import parallelize_sequence, sp_response_logprobs, unparallelize_sequence

    model.zero_grad(set_to_none=True)
    if use_sp:
        parallelize_sequence(model, mesh.sp_mesh)
        lp = sp_response_logprobs(model, layout, mesh.sp_mesh, temperature=0.9)
        unparallelize_sequence(model)
    else:
        lp = model.response_logprobs(layout, temperature=0.9)
    lp.sum().backward()
    w = model.lm_head.weight
    grad = torch.zeros_like(w, dtype=torch.float32) if w.grad is None else w.grad.float().clone()
    if use_sp and mesh.sp_size > 1:
        dist.all_reduce(grad, group=mesh.sp_group)
    return lp.detach().float(), grad


def _model_matches(device, name, sp=1):
    """SP in bf16 through our kernels against the fp32 model, within DESIGN.md's rule: at most 2x (log-probs)
    and 3x (gradient) the error of the plain PyTorch path in bf16 (reference attention, no SP), plus a
    floor; and the SP plumbing itself exact in fp32 (reference attention under SP = the fp32 model).

    A random tiny model in bf16 is far from its fp32 self (the hybrid's log-probs move by ~0.5), so two
    bf16 runs that round differently cannot be compared with a fixed bound; the fp32 model is the truth.
    """
    from dualkv.core import PackedLayout, dualkv_attention
    from dualkv.models import build_model, preset_hf_config
    from dualkv.parallel import init_sp_mesh

    preset, over = MODELS[name]
    mesh = init_sp_mesh(sp, device_type=device)
    g = torch.Generator().manual_seed(1)
    groups = [(torch.randint(0, 1024, (p,), generator=g), [torch.randint(0, 1024, (r,), generator=g) for r in rs])
              for p, rs in ((300, (40, 7, 129)), (61, (1, 90)))]
    layout = PackedLayout.from_groups(groups, device=device)

    def model_in(dtype, backend):
        model = build_model({**preset_hf_config(preset), **over}, dtype=torch.float32, device=device, seed=0)
        return model.to(dtype).set_attn_fn(functools.partial(dualkv_attention, backend=backend))

    def errors(res, truth):
        (lp, grad), (lp_t, g_t) = res, truth
        return (lp - lp_t).abs().max().item(), ((grad - g_t).norm() / g_t.norm()).item()

    truth = _run(model_in(torch.float32, "reference"), layout, mesh, use_sp=False)
    lp_err, g_err = errors(_run(model_in(torch.float32, "reference"), layout, mesh, use_sp=True), truth)
    # fp32 bound: a misrouted head or token moves log-probs by ~0.1 or more; the GPU's fp32 GEMMs pick other
    # kernels for the per-rank shapes, and this random hybrid amplifies that rounding (measured on two
    # H200s: 1.9e-4 log-prob, 8.2e-4 gradient; 0 and ~1e-6 on CPUs)
    assert lp_err < 2e-3 and g_err < 1e-2, f"{name}: fp32 SP vs the fp32 model: log-prob {lp_err:.2e}, lm_head grad {g_err:.2e}"
    lp_torch, g_torch = errors(_run(model_in(torch.bfloat16, "reference"), layout, mesh, use_sp=False), truth)
    lp_ours, g_ours = errors(_run(model_in(torch.bfloat16, "auto"), layout, mesh, use_sp=True), truth)
    assert lp_ours <= 2 * lp_torch + 1e-2, f"{name}: bf16 SP log-prob error {lp_ours:.3e} vs PyTorch bf16's {lp_torch:.3e}"
    assert g_ours <= 3 * g_torch + 1e-2, f"{name}: bf16 SP lm_head grad error {g_ours:.3e} vs PyTorch bf16's {g_torch:.3e}"


def _smoke(device, backend):
    if device == "cuda":
        torch.cuda.set_device(0)
    _collectives(device)
    _model_matches(device, "dense")
    _model_matches(device, "hybrid")
    return dist.get_backend()


def test_sp_smoke_one_gpu_nccl():
    assert torch.cuda.is_available()
    assert run_local_world(_smoke, 1, "cuda", "nccl", backend="nccl", threads=4) == ["nccl"]


def _sp_world(device):
    if device == "cuda":
        torch.cuda.set_device(dist.get_rank())
    for name in ("dense", "hybrid"):
        _model_matches(device, name, sp=dist.get_world_size())
    return dist.get_backend()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 or more GPUs")
def test_sp_every_gpu_nccl():
    """SP over every GPU of the machine (one rank per GPU) equals the single-device model."""
    world = torch.cuda.device_count()
    assert run_local_world(_sp_world, world, "cuda", backend="nccl", threads=4) == ["nccl"] * world
