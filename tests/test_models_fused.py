"""The fused element-wise ops' dispatch (models/fused.py) and Liger's RoPE under the Triton interpreter.

Liger's RMSNorm and SwiGLU kernels do not run under the interpreter; tests/gpu/test_models_gpu.py
checks them, and whole models with them, on a GPU.
"""

from __future__ import annotations

import pytest
import torch

import dualkv.models as M
from dualkv.models import fused
from dualkv.models.layers import RMSNorm, apply_rope, apply_rope_qk, gated_activation, rope_tables
from dualkv.models.config import RopeConfig

needs_liger = pytest.mark.skipif(not fused.liger_available(), reason="Liger-Kernel is not installed")


def test_mode_is_checked():
    with pytest.raises(ValueError, match="mode: expected one of"):
        fused.set_fused_ops("fast")
    assert fused.get_fused_ops() == "auto"


def test_liger_mode_without_liger_says_so(monkeypatch):
    monkeypatch.setattr(fused, "liger_available", lambda: False)
    with pytest.raises(ValueError, match="pip install liger-kernel"):
        fused.set_fused_ops("liger")
    assert fused.get_fused_ops() == "auto"


def test_context_restores_the_previous_mode():
    with fused.fused_ops("off"):
        assert fused.get_fused_ops() == "off"
        with pytest.raises(ValueError):
            with fused.fused_ops("nope"):
                pass
        assert fused.get_fused_ops() == "off"
    assert fused.get_fused_ops() == "auto"


def test_auto_keeps_pytorch_ops_on_cpu_and_under_compile(monkeypatch):
    x = torch.randn(4, 8)
    assert not fused.use_liger(x)
    monkeypatch.setattr(fused, "liger_available", lambda: True)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert fused.use_liger(x)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not fused.use_liger(x)
    with fused.fused_ops("off"):
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
        assert not fused.use_liger(x)


@needs_liger
def test_liger_mode_on_cpu_tensors_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    norm = RMSNorm(8, 1e-6, "qwen3")
    with fused.fused_ops("liger"):
        with pytest.raises(ValueError, match=r"need CUDA tensors, got tensors on \['cpu'\]"):
            norm(torch.randn(3, 8))


def test_pytorch_ops_are_the_definitions():
    """Mode off: the norm, the rotation and the gated activation by their formulas."""
    torch.manual_seed(0)
    x, w = torch.randn(5, 3, 8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    norm = RMSNorm(8, 1e-6, "qwen3").double()
    with torch.no_grad():
        norm.weight.copy_(w)
    want = w * x / (x.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    gate, up = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    with fused.fused_ops("off"):
        torch.testing.assert_close(norm(x), want)
        torch.testing.assert_close(gated_activation(gate, up, "silu"), gate * torch.sigmoid(gate) * up)
        q, k = apply_rope_qk(x, x[:, :1], torch.ones(5, 8, dtype=torch.float64), torch.zeros(5, 8, dtype=torch.float64))
    torch.testing.assert_close(q, x)
    torch.testing.assert_close(k, x[:, :1])


@needs_liger
@pytest.mark.parametrize("T,H,K,d", [(1, 2, 1, 16), (13, 4, 2, 32), (40, 8, 8, 64)])
def test_liger_rope_matches_apply_rope(T, H, K, d):
    """Our (T, H, d) tensors through Liger's (batch, heads, T, d) kernel, forward and backward (fp32,
    under the interpreter), with RoPE tables at packed logical positions."""
    torch.manual_seed(T)
    pos = torch.cat([torch.arange(T // 2), torch.arange(T // 2, T) - T // 4])
    cos, sin = rope_tables(RopeConfig(theta=10000.0), d, pos, torch.float32)
    q0, k0 = torch.randn(T, H, d, requires_grad=True), torch.randn(T, K, d, requires_grad=True)
    want = (apply_rope(q0, cos, sin), apply_rope(k0, cos, sin))
    with fused.fused_ops("liger"):
        assert fused.use_liger(q0)
        got = apply_rope_qk(q0 * 1.0, k0 * 1.0, cos, sin)  # Liger rotates in place: fresh inputs
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.is_contiguous()
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    dq, dk = torch.randn(T, H, d), torch.randn(T, K, d)
    grads = torch.autograd.grad(got, [q0, k0], [dq.clone(), dk.clone()])  # rotated in place, too
    wants = torch.autograd.grad(want, [q0, k0], [dq, dk])
    for g, w in zip(grads, wants):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@needs_liger
def test_rope_keeps_pytorch_ops_when_k_aliases_v():
    """k = v (no norms): an in-place rotation of k would rotate v too."""
    T, d = 6, 16
    cos, sin = rope_tables(RopeConfig(theta=10000.0), d, torch.arange(T), torch.float32)
    kv = torch.randn(T, 1, d)
    before = kv.clone()
    with fused.fused_ops("liger"):
        _, k = apply_rope_qk(torch.randn(T, 2, d), kv, cos, sin, k_aliases_v=True)
    torch.testing.assert_close(kv, before)
    torch.testing.assert_close(k, apply_rope(before, cos, sin))


def test_models_export_the_switch():
    assert M.fused_ops is fused.fused_ops and M.set_fused_ops is fused.set_fused_ops
