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


def _model_matches(device, name, sp=1):
    from dualkv.core import PackedLayout
    from dualkv.models import build_model, preset_hf_config
    from dualkv.parallel import init_sp_mesh, parallelize_sequence, sp_response_logprobs, unparallelize_sequence

    preset, over = MODELS[name]
    mesh = init_sp_mesh(sp, device_type=device)
    model = build_model({**preset_hf_config(preset), **over}, dtype=torch.bfloat16, device=device, seed=0)
    g = torch.Generator().manual_seed(1)
    groups = [(torch.randint(0, 1024, (p,), generator=g), [torch.randint(0, 1024, (r,), generator=g) for r in rs])
              for p, rs in ((300, (40, 7, 129)), (61, (1, 90)))]
    layout = PackedLayout.from_groups(groups, device=device)
    results = []
    for sp_run in (False, True):
        model.zero_grad(set_to_none=True)
        if sp_run:
            parallelize_sequence(model, mesh.sp_mesh)
            lp = sp_response_logprobs(model, layout, mesh.sp_mesh, temperature=0.9)
            unparallelize_sequence(model)
        else:
            lp = model.response_logprobs(layout, temperature=0.9)
        lp.sum().backward()
        w = model.lm_head.weight
        # each SP rank holds the gradient of its slice of the tokens (none if the slice has no response token)
        grad = torch.zeros_like(w, dtype=torch.float32) if w.grad is None else w.grad.float().clone()
        if sp_run and sp > 1:
            dist.all_reduce(grad)
        results.append((lp.detach(), grad))
    (lp_ref, g_ref), (lp_sp, g_sp) = results
    torch.testing.assert_close(lp_sp, lp_ref, rtol=2e-2, atol=2e-2)
    err = (g_sp - g_ref).norm() / g_ref.norm()
    assert err < 2e-2, f"{name}: lm_head gradient relative error {err:.3e}"


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
