"""The equivalence that defines the project, the public op, its autograd and custom-op registration."""

import math
import random

import pytest
import torch

from dualkv.core import (
    AttnMeta,
    PackedLayout,
    dualkv_attention,
    flash_attn_dualkv_varlen_func,
    reference_attention,
)
from dualkv.core.reference import reference_attention_backward_meta, reference_attention_meta
from helpers import random_lengths, random_qkv, replicated_attention

SHAPES = [  # (H, Hkv, d)
    (4, 4, 16),
    (4, 1, 8),
    (8, 2, 16),
]


def _grads(out, inputs, seed=0):
    g = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(seed))
    return torch.autograd.grad(out, inputs, g), g


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("window, softcap", [(None, None), (5, None), (None, 3.0), (9, 2.0)])
def test_packed_equals_replicated(seed, window, softcap):
    """Outputs of every token and gradients (prompt dK/dV summed over copies) equal the replicated run."""
    rng = random.Random(seed)
    H, Hkv, d = SHAPES[seed % len(SHAPES)]
    layout = PackedLayout.from_lengths(*random_lengths(rng))
    q, k, v = random_qkv(layout, H, Hkv, d)
    scale = 1 / math.sqrt(d)
    out = reference_attention(q, k, v, layout, window=window, softcap=softcap)
    idx, _ = layout.replicated_index()
    out_rep = replicated_attention(q, k, v, layout, scale, window, softcap)
    # Every replicated token (prompt copies included) equals its packed token.
    torch.testing.assert_close(out_rep, out[idx], rtol=1e-10, atol=1e-10)
    # Gradients: the replicated graph gathers q/k/v with idx, so autograd sums the prompt's copies.
    g = torch.randn_like(out_rep)
    grads_rep = torch.autograd.grad(out_rep, (q, k, v), g)
    g_packed = torch.zeros_like(out).index_add_(0, idx, g)
    grads = torch.autograd.grad(out, (q, k, v), g_packed)
    for a, b in zip(grads, grads_rep):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("window, softcap", [(None, None), (4, 5.0)])
def test_op_matches_reference_and_autograd(seed, window, softcap):
    """The custom op (reference backend, explicit backward) equals autograd through the reference."""
    rng = random.Random(100 + seed)
    H, Hkv, d = SHAPES[seed % len(SHAPES)]
    layout = PackedLayout.from_lengths(*random_lengths(rng, groups=(1, 4)))
    q, k, v = random_qkv(layout, H, Hkv, d)
    out, lse = dualkv_attention(q, k, v, layout, window=window, softcap=softcap, return_lse=True, backend="reference")
    ref, ref_lse = reference_attention_meta(q, k, v, AttnMeta.from_layout(layout), 1 / math.sqrt(d), window, softcap)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(lse, ref_lse)
    assert lse.shape == (H, layout.total_tokens)
    got, g = _grads(out, (q, k, v), seed)
    want = torch.autograd.grad(ref, (q, k, v), g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_small_query_chunks_match():
    """Chunking the queries (bounded memory) does not change the result."""
    layout = PackedLayout.from_lengths([37, 5], [[11, 3], [20]])
    q, k, v = random_qkv(layout, 2, 1, 8, requires_grad=False)
    meta = AttnMeta.from_layout(layout)
    full, lse = reference_attention_meta(q, k, v, meta, 0.3, 7, None)
    chunked, lse_c = reference_attention_meta(q, k, v, meta, 0.3, 7, None, q_chunk=4)
    torch.testing.assert_close(full, chunked, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, lse_c, rtol=1e-12, atol=1e-12)
    dout = torch.randn_like(q)
    a = reference_attention_backward_meta(dout, q, k, v, meta, 0.3, 7)
    b = reference_attention_backward_meta(dout, q, k, v, meta, 0.3, 7, q_chunk=4)
    for x, y in zip(a[:3], b[:3]):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_low_precision_inputs(dtype):
    layout = PackedLayout.from_lengths([9], [[4, 6]])
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in random_qkv(layout, 4, 2, 16))
    out = dualkv_attention(q, k, v, layout)
    assert out.dtype == dtype
    out.float().sum().backward()
    assert q.grad.dtype == dtype and k.grad.dtype == dtype
    ref = reference_attention(*(t.double() for t in (q, k, v)), layout)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


def test_reference_runs_a_4k_prompt_on_cpu():
    """Memory per segment chunk, not T x T: a 4K prompt with responses runs in fp32 on a CPU."""
    layout = PackedLayout.from_lengths([4096], [[64, 32]])
    q, k, v = random_qkv(layout, 2, 1, 16, dtype=torch.float32, requires_grad=False)
    out = reference_attention(q, k, v, layout)
    assert torch.isfinite(out).all()


def test_seed_paper_signature_equals_packed_op():
    """Shared context read from its own tensors gives the packed op's response outputs and grads."""
    rng = random.Random(7)
    P, rs = 13, [5, 1, 9]
    layout = PackedLayout.from_lengths([P], [rs])
    q, k, v = random_qkv(layout, 4, 2, 8)
    out = dualkv_attention(q, k, v, layout)
    q_d, k_d, v_d = (t.detach()[P:].clone().requires_grad_() for t in (q, k, v))
    k_c, v_c = (t.detach()[:P].clone().requires_grad_() for t in (k, v))
    cu = torch.tensor([0, 5, 6, 15], dtype=torch.int32)
    out_c = flash_attn_dualkv_varlen_func(q_d, k_c, v_c, k_d, v_d, cu, cu.clone(), 9, P, 9)
    torch.testing.assert_close(out_c, out[P:], rtol=1e-12, atol=1e-12)
    g = torch.randn_like(out_c)
    g_full = torch.cat([torch.zeros(P, *g.shape[1:], dtype=g.dtype), g])
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), g_full)
    dq_d, dk_c, dv_c, dk_d, dv_d = torch.autograd.grad(out_c, (q_d, k_c, v_c, k_d, v_d), g)
    torch.testing.assert_close(dq_d, dq[P:])
    torch.testing.assert_close(dk_d, dk[P:])
    torch.testing.assert_close(dv_d, dv[P:])
    torch.testing.assert_close(dk_c, dk[:P])  # summed over the three decoded sequences
    torch.testing.assert_close(dv_c, dv[:P])
    del rng


def test_opcheck_custom_op():
    layout = PackedLayout.from_lengths([5, 3], [[2, 3], [4]])
    q, k, v = random_qkv(layout, 4, 2, 8, dtype=torch.float32)
    meta = list(AttnMeta.from_layout(layout))
    torch.library.opcheck(torch.ops.dualkv.attention_fwd.default, (q, k, v, None, None, meta, 0.35, 3, 0.0, False, "reference"))
    out, lse = torch.ops.dualkv.attention_fwd(q, k, v, None, None, meta, 0.35, -1, 0.0, False, "reference")
    args = (torch.randn_like(out), q.detach(), k.detach(), v.detach(), None, None, out.detach(), lse, meta, 0.35, -1, 0.0, False, "reference")
    torch.library.opcheck(torch.ops.dualkv.attention_bwd.default, args)


def test_compile_traces_through_op():
    layout = PackedLayout.from_lengths([6], [[3, 2]])
    q, k, v = random_qkv(layout, 2, 1, 8, dtype=torch.float32)

    def f(q, k, v):
        return dualkv_attention(q, k, v, layout, backend="reference").square().sum()

    eager = torch.autograd.grad(f(q, k, v), (q, k, v))
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    got = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b)


# ---------------------------------------------------------------------------- validation


def _inputs(T=7, H=4, Hkv=2, d=8, dtype=torch.float32):
    layout = PackedLayout.from_lengths([3], [[2, 2]])
    return layout, torch.randn(T, H, d, dtype=dtype), torch.randn(T, Hkv, d, dtype=dtype), torch.randn(T, Hkv, d, dtype=dtype)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda L, q, k, v: (L, q[:5], k, v), "q: expected 7 tokens"),
        (lambda L, q, k, v: (L, q, k[:6], v), "k: expected 7 tokens like q"),
        (lambda L, q, k, v: (L, q[0], k, v), "q: expected a 3-D tensor"),
        (lambda L, q, k, v: (L, q, torch.randn(7, 3, 8), torch.randn(7, 3, 8)), "nheads_k to divide nheads"),
        (lambda L, q, k, v: (L, q, k.half(), v), "k: expected the same dtype as q"),
        (lambda L, q, k, v: (L, q.int(), k, v), "q: expected dtype float16, bfloat16, float32 or float64"),
        (lambda L, q, k, v: (L, q, k, torch.randn(7, 2, 4)), "headdim 8 like q"),
        (lambda L, q, k, v: (L, q, k, v[:, :1]), r"v: expected the same \(tokens, heads\) as k"),
        (lambda L, q, k, v: (L, q.transpose(1, 2).contiguous().transpose(1, 2), k, v), "last \\(headdim\\) dimension"),
        (lambda L, q, k, v: ("layout", q, k, v), "layout: expected a dualkv.core.PackedLayout"),
    ],
)
def test_attention_input_errors(mutate, match):
    layout, q, k, v = mutate(*_inputs())
    with pytest.raises(ValueError, match=match):
        dualkv_attention(q, k, v, layout)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(window=0), "window: expected None or an int >= 1"),
        (dict(window=2.5), "window: expected None or an int >= 1"),
        (dict(softcap=-1.0), "softcap: expected None or a finite positive number"),
        (dict(softmax_scale=0.0), "softmax_scale: expected a finite positive number"),
        (dict(backend="flash"), "backend: expected one of"),
    ],
)
def test_option_errors(kwargs, match):
    layout, q, k, v = _inputs()
    with pytest.raises(ValueError, match=match):
        dualkv_attention(q, k, v, layout, **kwargs)


def test_seed_signature_errors():
    q, kd, vd = torch.randn(6, 2, 8), torch.randn(6, 1, 8), torch.randn(6, 1, 8)
    kc, vc = torch.randn(4, 1, 8), torch.randn(4, 1, 8)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="causal: expected True"):
        flash_attn_dualkv_varlen_func(q, kc, vc, kd, vd, cu, cu, 4, 4, 4, causal=False)
    with pytest.raises(ValueError, match="context_seqlen: expected k_context.shape"):
        flash_attn_dualkv_varlen_func(q, kc, vc, kd, vd, cu, cu, 4, 5, 4)
    with pytest.raises(ValueError, match="cu_seqlens_k_decoded: expected it to equal cu_seqlens_q"):
        flash_attn_dualkv_varlen_func(q, kc, vc, kd, vd, cu, torch.tensor([0, 3, 6], dtype=torch.int32), 4, 4, 4)
    with pytest.raises(ValueError, match="cu_seqlens_q: expected a \\(N\\+1,\\) int32"):
        flash_attn_dualkv_varlen_func(q, kc, vc, kd, vd, cu.long(), cu, 4, 4, 4)
    with pytest.raises(ValueError, match="cu_seqlens_q: expected to run from 0 to total_q=6"):
        c = torch.tensor([0, 2, 5], dtype=torch.int32)
        flash_attn_dualkv_varlen_func(q, kc, vc, kd, vd, c, c, 4, 4, 4)


def test_cuda_backend_without_gpu_is_clear():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    layout, q, k, v = _inputs()
    with pytest.raises(RuntimeError, match="backend 'cuda' is not available"):
        dualkv_attention(q, k, v, layout, backend="cuda")
