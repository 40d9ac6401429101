"""Attention backends: one module each, one contract.

A backend module defines::

    NAME: str
    def is_available() -> bool
    def check_supported(q, k, v, window, softcap) -> None      # raise ValueError naming the argument
    def forward(q, k, v, k_ctx, v_ctx, meta, softmax_scale, window, softcap) -> (out, lse)
    def backward(dout, q, k, v, k_ctx, v_ctx, out, lse, meta, softmax_scale, window, softcap,
                 deterministic) -> (dq, dk, dv, dk_ctx, dv_ctx)

A name may also pair two backends, ``"<forward>+<backward>"`` (e.g. ``"triton+cuda"``): the forward
of one, the backward of the other on that forward's ``out`` and ``lse`` (the contract below is the
same for every backend, so the two meet exactly there).

``meta`` is an ``AttnMeta``; ``window`` an int or None; ``softcap`` a float or None; ``k_ctx`` /
``v_ctx`` None when context keys live in k / v themselves (the packed layout), and then the context
gradients are summed into dk / dv and ``dk_ctx``, ``dv_ctx`` are None. ``out`` is (total_q, H, d)
in q's dtype, ``lse`` is (H, total_q) float32.
"""

from __future__ import annotations

import importlib

import torch

__all__ = ["get_backend", "resolve_backend", "available_backends", "split_backend", "BACKENDS", "BACKEND_CHOICES"]

BACKENDS = {
    "reference": "dualkv.core.backends.reference",
    "triton": "dualkv.core.backends.triton",
    "cuda": "dualkv.core.backends.cuda",
}
# Preference of "auto" on CUDA tensors, fastest first.
AUTO_ORDER_CUDA = ("triton",)
# Where "auto" follows the measured table instead, for fp16 / bf16 when the CUDA extension is already
# built and runs the Hopper wgmma kernels at that head dim: the CUDA backend at d = 256 (1.37x Triton
# forward+backward: benchmarks/results/attention_h200_auto_pair.md) and at d = 128 and 64, where its
# warp-specialised forward is 4-12% ahead of Triton's (d = 128, all six configs) or level to 7% ahead
# (d = 64) and its backward ahead too (benchmarks/results/attention_h200_ws_fwd_rings*.md; until then
# "auto" paired Triton's forward with the CUDA backward there, "triton+cuda"), and at d = 512, where its
# wgmma forward and backward took 0.77 / 0.76x and 0.60 / 0.60x Triton's time at P = 8K / 16K
# (forward+backward 0.63 / 0.62x: benchmarks/results/attention_h200_s24_d512.md; 285.6 / 593.9 ms
# with the dQ kernel's bulk tensor copies in a later run, attention_h200_s24_d512_dq_tma.md, and 240.9 /
# 504.0 with the forward's and dK/dV kernel's too, attention_h200_s25_d512.md, against Triton's 495.4 /
# 1043.9), and at d = 192, where it took 0.44 / 0.45x Triton's forward+backward time at P = 16K / 32K
# (benchmarks/results/attention_h200_s26_d192.md). Other head dims are not measured: Triton. Re-measured at
# d = 64 after Triton's one-loop dK/dV: the CUDA backend still took 0.80-0.84x Triton's forward+backward
# time (benchmarks/results/attention_h200_s29_d64_auto_vs_triton.md).
# At d = 256 since 2026-12-05 the CUDA forward with Triton's backward, whose warp-specialised Gluon
# kernels (split by role) took less time than the CUDA backward: forward+backward 93.0 / 217.9 ms against
# 102.7 / 240.7 (CUDA) and 94.9 / 221.9 (Triton) at P = 16K / 32K, one run
# (benchmarks/results/attention_h200_s33_d256_auto.md); again with every provider checked against the
# reference, 95.3 / 223.1 against 104.0 / 243.6 and 99.0 / 227.7 (attention_h200_s34_d256_auto_validated.md).
# Where Triton's Gluon backward cannot run (its ``tl`` backward is the slower one), the CUDA backend alone.
AUTO_WGMMA_CHOICE = {512: "cuda", 256: "cuda+triton", 192: "cuda", 128: "cuda", 64: "cuda"}
# Where "auto" follows the table by prompt length as well, when the caller says the longest prompt (a host
# int: ``PackedLayout.max_ctx_len``, ``context_seqlen``): {head dim: (from this many keys, choice)}. At
# d = 128 the CUDA forward with Triton's backward from 16K-key prompts: with the CUDA dK/dV items kv head
# major (the default since 2026-12-05), forward+backward 118.0 / 169.5 / 447.0 / 22.2 / 1323.3 ms against the
# CUDA backend's 119.3 / 170.6 / 459.7 / 22.7 / 1361.0 at (28, 16K, 2K), (16, 32K, 2K), (16, 64K, 2K),
# (8, 16K, 512), (16, 128K, 2K) on an H200 (benchmarks/results/attention_h200_s38_new_defaults.md), 113.4 /
# 162.8 / 443.3 / 24.0 / 1309.2 against 115.6 / 164.5 / 452.5 / 24.2 / 1343.1 on an H100
# (attention_h100_s38_cuda_head_major_validated.md); below it the CUDA backend, 34.3 / 68.2 ms against 35.1 /
# 69.8 at (28, 4K, 2K) and (32, 8K, 2K) on the H200, 34.7 / 66.4 against 35.6 / 67.8 on the H100. Without a
# prompt length (under torch.compile, which would otherwise guard on it) the AUTO_WGMMA_CHOICE above; with a
# window, a softcap or a separate context (resolve_backend's plain_packed) the CUDA backend.
AUTO_LONG_PROMPT = {128: (16384, "cuda+triton")}
# Where "auto" pairs Triton's forward with the CUDA backward on an sm_90 GPU when the extension is
# already built but its wgmma kernels do not run (DUALKV_CUDA_WGMMA_BWD=0): d = 512 (Gemma-4's global
# layers), where the mma.sync backward took 0.89 / 0.89x Triton's backward time and Triton's forward
# 0.97x the mma.sync forward's (benchmarks/results/attention_h200_s22_d512.md, H200). Not measured on
# other GPUs: Triton.
AUTO_SM90_PAIR = {512: "triton+cuda"}


# Names a command line offers for --attention-backend / --backend.
BACKEND_CHOICES = ("auto", *BACKENDS, "triton+cuda", "cuda+triton")


def split_backend(name: str) -> tuple[str, str]:
    """The (forward, backward) backends of a name: ``"cuda"`` -> both ``"cuda"``; ``"triton+cuda"``."""
    parts = name.split("+") if isinstance(name, str) else [name]
    if len(parts) == 1:
        parts = parts * 2
    if len(parts) != 2 or any(part not in BACKENDS for part in parts):
        raise ValueError(
            f"backend: expected one of {['auto', *BACKENDS]} or a forward+backward pair of kernel backends "
            f"(e.g. 'triton+cuda'), got {name!r}"
        )
    return parts[0], parts[1]


def get_backend(name: str):
    """The module of one backend (for a pair, use ``split_backend`` first)."""
    if name not in BACKENDS:
        split_backend(name)  # a malformed name: the error that lists the accepted forms
        raise ValueError(f"backend: {name!r} is a forward+backward pair; get_backend takes one of {list(BACKENDS)}")
    try:
        return importlib.import_module(BACKENDS[name])
    except ImportError as err:  # the module itself is missing (not built yet)
        raise RuntimeError(f"backend {name!r} is not available in this installation: {err}") from err


def _available(name: str) -> bool:
    try:
        return get_backend(name).is_available()
    except RuntimeError:
        return False


def _cuda_says(question: str, *args) -> bool:
    """The CUDA backend's answer to one of its yes/no questions (``runs_wgmma``, ``built_for_sm90``);
    False where its module cannot be imported."""
    try:
        return getattr(get_backend("cuda"), question)(*args)
    except RuntimeError:
        return False


def _triton_gluon_backward() -> bool:
    """Whether Triton's warp-specialised Gluon backward kernels can run (Gluon's Hopper API imports and
    ``DUALKV_TRITON_GLUON_BWD`` is not 0); the GPU itself is the wgmma check's."""
    try:
        from .triton import configs, gluon_compat
    except ImportError:
        return False
    return gluon_compat.AVAILABLE and configs.gluon_bwd_enabled()


def available_backends() -> list[str]:
    return [name for name in BACKENDS if _available(name)]


def resolve_backend(name: str, where: torch.Tensor | torch.device | str, head_dim: int | None = None,
                    dtype: torch.dtype | None = None, longest_prompt: int | None = None,
                    plain_packed: bool = True) -> str:
    """``auto``: the fastest available kernel backend for CUDA tensors, else the reference.

    ``where`` is a tensor (its device, head dim and dtype count) or a device; ``head_dim`` / ``dtype``
    (taken from a tensor when not given) and ``longest_prompt`` (keys of the layout's longest prompt, if
    known) let ``auto`` follow the measured table per shape class. ``plain_packed``: the call is the packed
    layout without a window or softcap, where Triton's Gluon backward runs; otherwise a choice that pairs
    the CUDA forward with Triton's backward takes the CUDA backend instead (Triton's backward there is
    its slower ``tl`` kernels, which the table did not measure against it).
    """
    is_cuda = where.is_cuda if isinstance(where, torch.Tensor) else torch.device(where).type == "cuda"
    if isinstance(where, torch.Tensor):
        head_dim = where.shape[-1] if head_dim is None else head_dim
        dtype = where.dtype if dtype is None else dtype
    if name != "auto":
        for part in dict.fromkeys(split_backend(name)):
            backend = get_backend(part)
            if not backend.is_available():
                raise RuntimeError(f"backend {part!r} is not available here: {backend.unavailable_reason()}")
        return name
    if is_cuda:
        half = dtype in (torch.float16, torch.bfloat16)
        choice = AUTO_WGMMA_CHOICE.get(head_dim)
        from_keys, long_choice = AUTO_LONG_PROMPT.get(head_dim, (None, None))
        if from_keys is not None and longest_prompt is not None and longest_prompt >= from_keys:
            choice = long_choice
        if choice and split_backend(choice)[1] == "triton" and not (plain_packed and _triton_gluon_backward()):
            choice = "cuda"
        if choice and half and _cuda_says("runs_wgmma", head_dim):
            # that answered for the CUDA backend; the other half of a pair must be available too
            if all(_available(part) for part in split_backend(choice) if part != "cuda"):
                return choice
        pair = AUTO_SM90_PAIR.get(head_dim)
        if pair and half and _cuda_says("built_for_sm90") and _available("triton"):
            return pair
        for candidate in AUTO_ORDER_CUDA:
            if _available(candidate):
                return candidate
    return "reference"
