"""Reference backend: the pure-PyTorch oracle behind the op contract (any device, any head dim).

Backward recomputes the forward per chunk and applies the softmax gradient explicitly (autograd is
not available inside a custom op); context gradients are summed over every reading query in fp32
(fp64 for fp64 inputs).
"""

from __future__ import annotations

import torch

from ..reference import reference_attention_backward_meta, reference_attention_meta

NAME = "reference"


def is_available() -> bool:
    return True


def unavailable_reason() -> str:
    return ""


def check_supported(q, k, v, window, softcap) -> None:
    return None


def forward(q, k, v, k_ctx, v_ctx, meta, softmax_scale, window, softcap):
    with torch.no_grad():
        return reference_attention_meta(q, k, v, meta, softmax_scale, window, softcap, k_ctx, v_ctx)


def backward(dout, q, k, v, k_ctx, v_ctx, out, lse, meta, softmax_scale, window, softcap, deterministic):
    return reference_attention_backward_meta(dout, q, k, v, meta, softmax_scale, window, softcap, k_ctx, v_ctx)
