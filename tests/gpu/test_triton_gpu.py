"""Triton backend on a GPU: bf16/fp16 against an fp32 reference, with tolerances relative to
PyTorch's own low-precision error (DESIGN.md): |out - ref| <= 2 * |out_torch - ref| + floor, and 3x
for gradients, where ``out_torch`` is PyTorch attention in the input dtype (SDPA over the
N-replicated layout, bf16/fp16 inputs and matmuls, autograd summing the prompt copies).

The grid covers P in {1, 127, 128, 129, 4096}, R in {1, 63, 2048}, N in {1, 2, 16, 32}, G in {1, 3},
every head dim (64, 96, 128, 192, 256, 512), both dtypes, windows, softcap and GQA 1:1 to 8:1,
plus determinism, the separate-context function, a q of more than 2^31 elements and a check that
forward and backward never synchronise with the host.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dualkv.core import AttnMeta, PackedLayout, dualkv_attention, flash_attn_dualkv_varlen_func
from dualkv.core.reference import reference_attention_backward_meta, reference_attention_meta

pytestmark = pytest.mark.gpu

FLOOR = {torch.bfloat16: 2e-3, torch.float16: 3e-4}


def _layout(P, N, R):
    """P, N, R: per-group lists (R: one length per group, or a list per group)."""
    responses = [r if isinstance(r, list) else [r] * n for n, r in zip(N, R)]
    return PackedLayout.from_lengths(P, responses, device="cuda")


def _qkv(layout, H, Hkv, d, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    T = layout.total_tokens
    return [torch.randn(T, h, d, device="cuda", generator=g, dtype=torch.float32).to(dtype) for h in (H, Hkv, Hkv, H)]


def _torch_lowp(q, k, v, do, layout, scale, window, softcap):
    """PyTorch in the input dtype over the replicated layout: out and grads mapped back to packed rows."""
    idx, cu = layout.replicated_index()
    rep = q.shape[1] // k.shape[1]
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    outs = []
    for b in range(layout.num_rows):
        s, e = int(cu[b]), int(cu[b + 1])
        qs, ks, vs = (t[idx[s:e]].transpose(0, 1) for t in leaves)
        ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
        if window is None and softcap is None:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
        else:
            pos = torch.arange(e - s, device=q.device)
            mask = pos[None, :] <= pos[:, None]
            if window is not None:
                mask &= (pos[:, None] - pos[None, :]) < window
            scores = (qs @ ks.transpose(-1, -2)) * scale
            if softcap is not None:
                scores = softcap * torch.tanh(scores / softcap)
            o = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ vs
        outs.append(o.transpose(0, 1))
    out_rep = torch.cat(outs)
    # Each packed output row carries dO once: give it to the first replicated copy only, so the
    # replicated graph's gradients (prompt copies summed by autograd) equal the packed ones.
    first = torch.full((q.shape[0],), idx.numel(), device=q.device).scatter_reduce(
        0, idx, torch.arange(idx.numel(), device=q.device), "amin")
    g_rep = torch.zeros_like(out_rep)
    g_rep[first] = do
    grads = torch.autograd.grad(out_rep, leaves, g_rep)
    out = torch.empty_like(q)
    out[idx] = out_rep.detach()  # every copy of a prompt token carries the same value
    return out, grads


def _err(a, b):
    return (a.float() - b.float()).abs().max().item()


def _check(layout, H, Hkv, d, dtype, window=None, softcap=None, seed=0, deterministic=False):
    q, k, v, do = _qkv(layout, H, Hkv, d, dtype, seed)
    scale = 1 / math.sqrt(d)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out, lse = dualkv_attention(*leaves, layout, window=window, softcap=softcap, deterministic=deterministic,
                                return_lse=True, backend="triton")
    grads = torch.autograd.grad(out, leaves, do)
    meta = AttnMeta.from_layout(layout)
    f32 = [t.float() for t in (q, k, v, do)]
    ref_out, ref_lse = reference_attention_meta(*f32[:3], meta, scale, window, softcap)
    ref_grads = reference_attention_backward_meta(f32[3], *f32[:3], meta, scale, window, softcap)
    low_out, low_grads = _torch_lowp(q, k, v, do, layout, scale, window, softcap)
    floor = FLOOR[dtype]
    report = {}
    for name, got, ref, low, factor in [("out", out, ref_out, low_out, 2)] + [
        (n, g, r, lw, 3) for n, g, r, lw in zip(("dq", "dk", "dv"), grads, ref_grads, low_grads)
    ]:
        assert torch.isfinite(got).all(), f"{name}: non-finite values"
        err, low_err = _err(got, ref), _err(low, ref)
        report[name] = (err, low_err)
        assert err <= factor * low_err + floor * max(1.0, ref.abs().max().item()), (
            f"{name}: error {err:.3e} vs PyTorch {dtype} error {low_err:.3e} (x{factor} + floor)")
    lse_err = _err(lse, ref_lse)
    assert lse_err <= 1e-2, f"lse: error {lse_err:.3e}"
    print(f"[{d=} {dtype} H={H}/{Hkv} {window=} {softcap=}] " +
          " ".join(f"{n}={e:.2e}(torch {t:.2e})" for n, (e, t) in report.items()) + f" lse={lse_err:.1e}")
    return grads


# (P per group, N per group, R per group, H, Hkv, d, dtype, window, softcap)
GRID = [
    ([4096], [16], [2048], 8, 2, 128, torch.bfloat16, None, None),
    ([127, 128, 129], [2, 1, 32], [63, 2048, 1], 8, 1, 64, torch.float16, None, None),
    ([1, 129, 4096], [32, 2, 1], [63, 2048, 1], 4, 4, 96, torch.bfloat16, 256, None),
    ([129], [16], [63], 4, 4, 192, torch.float16, None, 30.0),
    ([128, 4096, 1], [16, 1, 2], [[2048] * 8 + [63] * 8, 63, 1], 4, 1, 256, torch.bfloat16, 1000, None),
    ([4096], [2], [2048], 4, 2, 512, torch.bfloat16, None, None),
    ([127, 1, 129], [1, 32, 2], [63, 1, 2048], 4, 2, 512, torch.float16, 512, 50.0),
    ([4096, 1, 128], [32, 2, 16], [63, 2048, 1], 8, 2, 128, torch.float16, 100, None),
    ([129], [16], [2048], 16, 2, 64, torch.bfloat16, 300, 20.0),
    ([1], [1], [1], 2, 1, 128, torch.bfloat16, None, None),
]


@pytest.mark.parametrize("case", range(len(GRID)), ids=lambda i: f"P{GRID[i][0]}-N{GRID[i][1]}-d{GRID[i][5]}")
def test_grid(case):
    P, N, R, H, Hkv, d, dtype, window, softcap = GRID[case]
    _check(_layout(P, N, R), H, Hkv, d, dtype, window, softcap, seed=case)


def test_deterministic_bitwise():
    layout = _layout([4096, 129], [16, 2], [2048, 63])
    g1 = _check(layout, 8, 2, 128, torch.bfloat16, deterministic=True, seed=3)
    g2 = _check(layout, 8, 2, 128, torch.bfloat16, deterministic=True, seed=3)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)


def test_atomic_dq_path_matches(monkeypatch):
    """DUALKV_TRITON_ATOMIC_DQ=1: dQ through TMA reduce-add inside the ``tl`` dK/dV kernel."""
    monkeypatch.setenv("DUALKV_TRITON_GLUON_BWD", "0")
    monkeypatch.setenv("DUALKV_TRITON_ATOMIC_DQ", "0")
    layout = _layout([4096, 129], [16, 2], [2048, 63])
    g_kernel = _check(layout, 8, 2, 128, torch.bfloat16, seed=4)
    monkeypatch.setenv("DUALKV_TRITON_ATOMIC_DQ", "1")
    g_atomic = _check(layout, 8, 2, 128, torch.bfloat16, seed=4)
    for a, b in zip(g_kernel, g_atomic):
        assert _err(a, b) <= 2e-2 * max(b.float().abs().max().item(), 1.0)


@pytest.mark.parametrize("d, dtype", [(128, torch.bfloat16), (64, torch.float16)])
def test_gluon_dkdv_matches_row_kernel(d, dtype, monkeypatch):
    """DUALKV_TRITON_GLUON_DKDV=1: the Gluon dK/dV (asynchronous products) gives the row kernel's
    gradients bit for bit (split readers, GQA 4:1, ragged blocks), and it is the kernel that ran."""
    from dualkv.core.backends.triton import gluon_dkdv

    if torch.cuda.get_device_capability()[0] != 9 or not gluon_dkdv.AVAILABLE:
        pytest.skip("the Gluon dK/dV runs on Hopper (sm_90) with Triton's Gluon")
    from dualkv.core.backends.triton import schedule

    monkeypatch.setenv("DUALKV_TRITON_GLUON_BWD", "0")  # the default kernels at d = 128 are gluon_dkdv_ws
    layout = _layout([4096, 129], [16, 2], [2048, 63])
    g_rows = _check(layout, 8, 2, d, dtype, seed=6)
    calls = []
    real_run = gluon_dkdv.run
    monkeypatch.setattr(gluon_dkdv, "run", lambda *a, **kw: calls.append(1) or real_run(*a, **kw))
    monkeypatch.setenv("DUALKV_TRITON_GLUON_DKDV", "1")
    g_gluon = _check(layout, 8, 2, d, dtype, seed=6)
    assert calls, "the Gluon dK/dV did not run"
    for a, b in zip(g_rows, g_gluon):
        assert torch.equal(a, b)


@pytest.mark.parametrize("d, dtype", [(128, torch.bfloat16), (64, torch.float16)])
def test_gluon_fused_dq(d, dtype, monkeypatch):
    """DUALKV_TRITON_GLUON_DKDV=1 with DUALKV_TRITON_ATOMIC_DQ=1: the Gluon dK/dV also adds dQ by TMA
    reduce-add. dK and dV are the row kernel's bit for bit; every gradient passes the reference check
    (``_check``), prompts split over several reader programs, GQA 4:1, ragged blocks."""
    from dualkv.core.backends.triton import gluon_dkdv

    if torch.cuda.get_device_capability()[0] != 9 or not gluon_dkdv.AVAILABLE:
        pytest.skip("the Gluon dK/dV runs on Hopper (sm_90) with Triton's Gluon")
    from dualkv.core.backends.triton import schedule

    monkeypatch.setenv("DUALKV_TRITON_GLUON_BWD", "0")  # the default kernels at d = 128 are gluon_dkdv_ws
    layout = _layout([4096, 129], [16, 2], [2048, 63])
    g_rows = _check(layout, 8, 2, d, dtype, seed=6)
    calls = []
    real_run = gluon_dkdv.run
    monkeypatch.setattr(gluon_dkdv, "run", lambda *a, **kw: calls.append(kw["dq_acc"] is not None)
                        or real_run(*a, **kw))
    monkeypatch.setenv("DUALKV_TRITON_GLUON_DKDV", "1")
    monkeypatch.setenv("DUALKV_TRITON_ATOMIC_DQ", "1")
    # the fused dQ splits a prompt's readers by balance, the dQ kernel's path by 4096 rows: align them
    monkeypatch.setattr(schedule, "balanced_split_rows", lambda *a, **kw: schedule.SPLIT_ROWS)
    g_fused = _check(layout, 8, 2, d, dtype, seed=6)
    assert calls and all(calls), "the Gluon dK/dV with dQ did not run"
    for a, b in zip(g_rows[1:], g_fused[1:]):
        assert torch.equal(a, b)
    assert _err(g_fused[0], g_rows[0]) <= 2e-2 * max(g_rows[0].float().abs().max().item(), 1.0)


@pytest.mark.parametrize("d, dtype, H, Hkv", [(128, torch.bfloat16, 8, 2), (128, torch.float16, 8, 1),
                                              (256, torch.bfloat16, 4, 2), (256, torch.float16, 4, 4)])
def test_warp_specialised_gluon_backward(d, dtype, H, Hkv, monkeypatch):
    """The default backward on Hopper at d = 128 (``gluon_dkdv_ws``: dK/dV with dQ fused) and 256
    (``gluon_split256``: dK/dV and dQ, warpgroups split by role): it is what ran, every gradient passes
    the reference check, dK / dV are bit-identical run to run, and against the ``tl`` kernels
    (``DUALKV_TRITON_GLUON_BWD=0``) the gradients it computes the same way are the same bit for bit (dK
    and dV at 128, where only dQ's adds differ in order; dV and dQ at 256, where dK is formed from P
    rounded to the input dtype; at 128 with the tl kernels' reader splits, since the fused dQ splits by
    balance). Several groups, odd lengths, a 1-token response, split prompt readers."""
    from dualkv.core.backends.triton import gluon_dkdv_ws, gluon_split256, launcher, schedule

    if torch.cuda.get_device_capability()[0] != 9 or not gluon_dkdv_ws.AVAILABLE:
        pytest.skip("the Gluon backward runs on Hopper (sm_90) with Triton's Gluon")
    if d == 128:
        layout = _layout([4096, 129, 1], [16, 3, 2], [[2048] * 15 + [1], 63, 97])
    else:
        layout = _layout([2048, 129, 1], [8, 3, 2], [[1024] * 7 + [1], 63, 97])
    calls = []
    for mod, name in ((gluon_dkdv_ws, "run"), (gluon_split256, "run_dkdv"), (gluon_split256, "run_dq")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
    monkeypatch.delenv("DUALKV_TRITON_ATOMIC_DQ", raising=False)
    g_gluon = _check(layout, H, Hkv, d, dtype, seed=8)
    assert sorted(set(calls)) == (["run"] if d == 128 else ["run_dkdv", "run_dq"]), calls
    again = _check(layout, H, Hkv, d, dtype, seed=8)
    assert torch.equal(g_gluon[1], again[1]) and torch.equal(g_gluon[2], again[2])
    if d == 128:  # the fused dQ splits a prompt's readers by balance, the tl kernels by 4096 rows: align them
        assert int(schedule.balanced_split_rows(AttnMeta.from_layout(layout), 128, Hkv, launcher._sm_count(
            torch.device("cuda")))) > schedule.SPLIT_ROWS
        monkeypatch.setattr(schedule, "balanced_split_rows", lambda *a, **kw: schedule.SPLIT_ROWS)
        g_gluon = _check(layout, H, Hkv, d, dtype, seed=8)
    monkeypatch.setenv("DUALKV_TRITON_GLUON_BWD", "0")
    calls.clear()
    g_tl = _check(layout, H, Hkv, d, dtype, seed=8)
    assert not calls
    same = (1, 2) if d == 128 else (0, 2)
    for i in range(3):
        if i in same:
            assert torch.equal(g_gluon[i], g_tl[i]), ("dq", "dk", "dv")[i]
        else:
            assert _err(g_gluon[i], g_tl[i]) <= 2e-2 * max(g_tl[i].float().abs().max().item(), 1.0)


@pytest.mark.parametrize("d, H, Hkv", [(128, 8, 2), (256, 4, 2)])
def test_gluon_backward_program_order(d, H, Hkv, monkeypatch):
    """``DUALKV_TRITON_BWD_HEAD_MAJOR``: the Gluon dK/dV's programs in either order (kv head major, or an
    item's kv heads side by side) reach the kernel, pass the reference check and give the same dK and dV
    bit for bit (a key tile's sums run in the same order whichever program runs it); dQ as well at
    d = 256 (its own kernel), within rounding at d = 128 (its reduce-adds land in another order). Unset,
    the order follows the longest prompt: item-major below ``HEAD_MAJOR_MIN_PROMPT`` (always at d = 256),
    kv head major from it, and that layout passes the reference too."""
    from dualkv.core.backends.triton import gluon_dkdv_ws, gluon_split256

    if torch.cuda.get_device_capability()[0] != 9 or not gluon_dkdv_ws.AVAILABLE:
        pytest.skip("the Gluon backward runs on Hopper (sm_90) with Triton's Gluon")
    mod, name = (gluon_dkdv_ws, "run") if d == 128 else (gluon_split256, "run_dkdv")
    orders = []
    real = getattr(mod, name)
    monkeypatch.setattr(mod, name, lambda *a, **kw: orders.append(int(kw["head_major"])) or real(*a, **kw))
    layout = _layout([2048, 129], [8, 3], [[1024] * 7 + [1], 63])
    grads = {}
    for value in ("0", "1"):
        monkeypatch.setenv("DUALKV_TRITON_BWD_HEAD_MAJOR", value)
        orders.clear()
        grads[value] = _check(layout, H, Hkv, d, torch.bfloat16, seed=9)
        assert orders == [int(value)], orders
    monkeypatch.delenv("DUALKV_TRITON_BWD_HEAD_MAJOR")
    orders.clear()
    _check(layout, H, Hkv, d, torch.bfloat16, seed=9)
    long_prompt = _layout([8192, 300], [3, 2], [[700, 1, 129], 64])
    _check(long_prompt, H, Hkv, d, torch.bfloat16, seed=10)
    assert orders == [0, int(d == 128)], orders
    (dq0, dk0, dv0), (dq1, dk1, dv1) = grads["0"], grads["1"]
    assert torch.equal(dk0, dk1) and torch.equal(dv0, dv1)
    if d == 256:
        assert torch.equal(dq0, dq1)
    else:
        assert _err(dq0, dq1) <= 2e-2 * max(dq1.float().abs().max().item(), 1.0)


@pytest.mark.parametrize("d, dtype", [(128, torch.bfloat16), (64, torch.float16)])
def test_gluon_forward_matches_tl_forward(d, dtype, monkeypatch):
    """The Gluon forward (the default on Hopper at d = 64 / 128) against the ``tl`` forward: the same
    out and LSE up to rounding, on several groups, odd lengths, a 1-token response and GQA 4:1; and it
    is the kernel that ran (the grid above checks it against the fp32 reference)."""
    from dualkv.core.backends.triton import gluon_fwd

    if torch.cuda.get_device_capability()[0] != 9 or not gluon_fwd.AVAILABLE:
        pytest.skip("the Gluon forward runs on Hopper (sm_90) with Triton's Gluon")
    layout = _layout([4096, 129, 1], [16, 3, 2], [[2048] * 15 + [1], 63, 97])
    q, k, v, _ = _qkv(layout, 8, 2, d, dtype, seed=7)
    calls = []
    real_run = gluon_fwd.run
    monkeypatch.setattr(gluon_fwd, "run", lambda *a, **kw: calls.append(1) or real_run(*a, **kw))
    out, lse = dualkv_attention(q, k, v, layout, return_lse=True, backend="triton")
    assert calls, "the Gluon forward did not run"
    monkeypatch.setenv("DUALKV_TRITON_GLUON_FWD", "0")
    out_tl, lse_tl = dualkv_attention(q, k, v, layout, return_lse=True, backend="triton")
    assert len(calls) == 1
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert _err(out, out_tl) <= 2 * FLOOR[dtype] * max(1.0, out_tl.float().abs().max().item())
    assert _err(lse, lse_tl) <= 1e-4


def test_separate_context_function():
    """flash_attn_dualkv_varlen_func: the context read in place, its gradient summed over readers."""
    g = torch.Generator(device="cuda").manual_seed(5)
    P, lens, H, Hkv, d = 4096, [63] * 16 + [2048], 8, 2, 128
    T = sum(lens)
    make = lambda *s: torch.randn(*s, device="cuda", generator=g).bfloat16()  # noqa: E731
    q, kc, vc, kd, vd = make(T, H, d), make(P, Hkv, d), make(P, Hkv, d), make(T, Hkv, d), make(T, Hkv, d)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device="cuda")
    res = {}
    for backend in ("triton", "reference"):
        leaves = [t.clone().requires_grad_(True) for t in (q, kc, vc, kd, vd)]
        out = flash_attn_dualkv_varlen_func(*leaves, cu, cu, max(lens), P, max(lens), backend=backend)
        res[backend] = (out, *torch.autograd.grad(out, leaves, torch.ones_like(out)))
    for name, a, b in zip(["out", "dq", "dk_ctx", "dv_ctx", "dk", "dv"], res["triton"], res["reference"]):
        rel = _err(a, b) / max(b.float().abs().max().item(), 1e-6)
        assert rel < 2e-2, f"{name}: relative error {rel:.2e}"


def test_no_host_sync():
    layout = _layout([512, 3], [4, 2], [100, 7])
    q, k, v, do = _qkv(layout, 4, 2, 64, torch.bfloat16, 0)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    dualkv_attention(*leaves, layout, backend="triton").backward(do)  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = dualkv_attention(*leaves, layout, backend="triton")
        out.backward(do)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_plans_kept_per_layout_and_stream(monkeypatch):
    """On a GPU the second call on a layout plans nothing; on another stream it plans anew (a plan is
    read only on the stream that computed it), with the same results."""
    from dualkv.core.backends.triton.plan_cache import PLANS

    monkeypatch.delenv("DUALKV_TRITON_PLAN_CACHE", raising=False)
    PLANS.clear()
    layout = _layout([512, 3], [4, 2], [100, 7])
    q, k, v, do = _qkv(layout, 4, 2, 128, torch.bfloat16, 0)

    def step():
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = dualkv_attention(*leaves, layout, backend="triton")
        return (out, *torch.autograd.grad(out, leaves, do))

    first = step()
    computed = PLANS.computed
    again = step()
    assert PLANS.computed == computed
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        other = step()
    torch.cuda.current_stream().wait_stream(side)
    assert PLANS.computed > computed
    assert torch.equal(first[0], again[0]) and torch.equal(first[0], other[0])
    for a, b, c in zip(first[1:], again[1:], other[1:]):  # dQ may be added with atomics: rounding order
        torch.testing.assert_close(b, a)
        torch.testing.assert_close(c, a)


def test_q_over_2_pow_31_elements():
    """q with more than 2^31 elements: the last response's outputs and gradients against the reference
    computed on that response and its prompt alone (64-bit offsets at the far end of the tensors)."""
    P, N, R, H, Hkv, d = 8192, 128, 2048, 64, 1, 128
    layout = _layout([P], [N], [R])
    T = layout.total_tokens
    assert T * H * d > 2**31
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(T, H, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(T, Hkv, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    do = torch.randn(T, H, d, device="cuda", dtype=torch.bfloat16, generator=g)
    leaves = [t.requires_grad_(True) for t in (q, k, v)]
    out = dualkv_attention(*leaves, layout, backend="triton")
    dq, dk, dv = torch.autograd.grad(out, leaves, do)
    rows = torch.cat([torch.arange(P), torch.arange(T - R, T)]).cuda()
    small = _layout([P], [1], [R])
    sub = [t.detach()[rows].float() for t in (q, k, v, do)]
    meta = AttnMeta.from_layout(small)
    ref_out, _ = reference_attention_meta(*sub[:3], meta, 1 / math.sqrt(d))
    ref_dq, ref_dk, ref_dv, _, _ = reference_attention_backward_meta(sub[3], *sub[:3], meta, 1 / math.sqrt(d))
    last = slice(P, P + R)
    for name, got, ref in [("out", out[T - R:], ref_out[last]), ("dq", dq[T - R:], ref_dq[last]),
                           ("dk", dk[T - R:], ref_dk[last]), ("dv", dv[T - R:], ref_dv[last])]:
        rel = _err(got, ref) / max(ref.abs().max().item(), 1e-6)
        assert rel < 2e-2, f"{name}: relative error {rel:.2e}"
