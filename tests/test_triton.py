"""The Triton backend under the CPU interpreter (TRITON_INTERPRET=1, set by conftest without CUDA):
forward, LSE and every gradient against the pure-PyTorch reference, on tiny shapes.

The interpreter runs each program in Python, so shapes stay small and blocks are 16/32 wide; the
cases still cross block edges, the causal diagonal, window edges, ragged tails, split readers and
both load paths (pointers and tensor descriptors).
"""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
import torch

from dualkv.core import AttnMeta, PackedLayout, dualkv_attention, flash_attn_dualkv_varlen_func, reference_attention
from dualkv.core.backends import triton as triton_backend
from dualkv.core.reference import reference_attention_backward_meta, reference_attention_meta
from helpers import compile_for_hopper, record_triton_launches

pytestmark = pytest.mark.skipif(not triton_backend.is_available(), reason="triton backend not available here")

if triton_backend.is_available():
    from dualkv.core.backends.triton import launcher, schedule
    from dualkv.core.backends.triton.configs import KernelConfig


@pytest.fixture(autouse=True, scope="module")
def _fast_interpreter():
    """The interpreter checks every int32 add/mul for overflow, which halves its speed; shapes here
    are tiny, so nothing can overflow. Restored after the module."""
    if torch.cuda.is_available():
        yield
        return
    import triton.runtime.interpreter as interp

    saved = interp.interpreter_builder.options
    interp.interpreter_builder.options = replace(saved, sanitize_overflow=False)
    yield
    interp.interpreter_builder.options = saved


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = KernelConfig(16, 32, 4, 1)  # block_m != block_n: tiles and key blocks do not line up
WIDE = KernelConfig(32, 16, 4, 1)


def _first_candidate(kind, key, head_dim, elem, on_cuda, run=None, warp_specialize=False, smem_limit=None):
    """``configs.choose`` as a GPU would answer it without tuning: the default config of each kernel."""
    return launcher.configs.candidates(kind, head_dim, elem, warp_specialize)[0]


def _inputs(prompts, responses, H, Hkv, d, dtype=torch.float32, seed=0):
    layout = PackedLayout.from_lengths(prompts, responses, device=DEVICE)
    g = torch.Generator(device="cpu").manual_seed(seed)
    T = layout.total_tokens
    q, k, v, do = (torch.randn(T, h, d, generator=g).to(DEVICE, dtype) for h in (H, Hkv, Hkv, H))
    return layout, AttnMeta.from_layout(layout), q, k, v, do


def _reference(q, k, v, do, meta, scale, window, softcap, k_ctx=None, v_ctx=None):
    """fp64 reference: out, lse, and the gradients."""
    up = [t.double() if t is not None else None for t in (q, k, v, do, k_ctx, v_ctx)]
    out, lse = reference_attention_meta(up[0], up[1], up[2], meta, scale, window, softcap, up[4], up[5])
    grads = reference_attention_backward_meta(up[3], up[0], up[1], up[2], meta, scale, window, softcap, up[4], up[5])
    return out, lse, grads


def _close(name, got, want, tol):
    err = (got.double() - want.double()).abs().max().item()
    scale = max(want.double().abs().max().item(), 1.0)
    assert err <= tol * scale, f"{name}: max error {err:.3e} > {tol:.1e} x {scale:.2f}"


def _check_all(q, k, v, do, meta, window=None, softcap=None, deterministic=False, tma=False, tol=2e-5,
               fwd_cfg=SMALL, bwd_cfg=SMALL, split_rows=4096, atomic_dq=None):
    scale = 1 / math.sqrt(q.shape[2])
    out, lse = launcher.forward(q, k, v, None, None, meta, scale, window, softcap, config=fwd_cfg, tma=tma)
    grads = launcher.backward(do, q, k, v, None, None, out, lse, meta, scale, window, softcap, deterministic,
                              dkdv_config=bwd_cfg, dq_config=fwd_cfg, tma=tma, split_rows=split_rows,
                              atomic_dq=atomic_dq)
    r_out, r_lse, r_grads = _reference(q, k, v, do, meta, scale, window, softcap)
    assert out.dtype == q.dtype and lse.dtype == torch.float32 and lse.shape == (q.shape[1], q.shape[0])
    _close("out", out, r_out, tol)
    _close("lse", lse, r_lse, tol)
    for name, g, r in zip(("dq", "dk", "dv"), grads[:3], r_grads[:3]):
        assert g.dtype == q.dtype and g.shape == r.shape
        _close(name, g, r, tol * 4)
    assert grads[3] is None and grads[4] is None
    return grads


# (prompts, responses per group, H, Hkv, d): odd lengths, several groups, GQA 1:1, 4:1, 8:1.
CASES = [
    ([7, 1], [[1, 97], [113]], 2, 2, 16),
    ([40], [[9, 33, 1]], 4, 1, 16),
    ([5, 37, 2], [[20], [7, 1], [13, 3]], 8, 1, 32),
]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("tma", [False, True])
def test_matches_reference(case, tma):
    """dQ from its own kernel with descriptors, from fp32 atomics in the dK/dV kernel with pointers."""
    prompts, responses, H, Hkv, d = CASES[case]
    _, meta, q, k, v, do = _inputs(prompts, responses, H, Hkv, d, seed=case)
    _check_all(q, k, v, do, meta, tma=tma, fwd_cfg=SMALL if case % 2 else WIDE, bwd_cfg=WIDE if case % 2 else SMALL,
               atomic_dq=not tma)


@pytest.mark.parametrize("window, softcap", [(1, None), (6, None), (45, None), (None, 1.5), (20, 4.0)])
def test_window_and_softcap(window, softcap):
    """Windows from 1 (self only) to ones reaching from a response back into its prompt's tail."""
    _, meta, q, k, v, do = _inputs([41, 6], [[30, 8], [19]], 4, 2, 16, seed=window or 3)
    _check_all(q, k, v, do, meta, window=window, softcap=softcap, tma=window == 6)


WS_CFG = KernelConfig(16, 32, 4, 1, True)  # the warp-specialised forward: one loop, every key block masked


@pytest.mark.parametrize("window, softcap, blocks", [(None, None, (16, 32)), (1, None, (32, 16)),
                                                     (37, 20.0, (16, 32)), (200, None, (32, 16))])
def test_warp_specialised_forward_and_dq_match_reference(window, softcap, blocks):
    """The single-loop forward and dQ (context blocks then own blocks, a per-row limit mask on every
    block, blocks behind a window skipped; dQ reading LSE / delta from segment-aligned rows) against
    the reference: several groups, a 1-token prompt and response, GQA 2:1, ragged tails, and padding
    entries of the tile list (which run as empty tiles in these kernels instead of returning)."""
    cfg = KernelConfig(*blocks, 4, 1, True)
    layout, meta, q, k, v, do = _inputs([70, 1, 33], [[40, 9, 1], [5], [17, 64]], 4, 2, 32)
    _check_all(q, k, v, do, meta, window=window, softcap=softcap, tma=True, fwd_cfg=cfg)


def test_warp_specialised_forward_padded_head_dim_fp16():
    layout, meta, q, k, v, do = _inputs([45], [[30, 3]], 2, 1, 24, dtype=torch.float16)
    _check_all(q, k, v, do, meta, window=20, tma=True, fwd_cfg=WS_CFG, tol=3e-3)


def test_aligned_rows_start_each_segment_on_16_bytes():
    """The dQ kernel's LSE / delta rows: each segment's rows are contiguous from a multiple of 4 (16
    bytes of fp32), in order, inside the width the launcher allocates."""
    meta = AttnMeta.from_layout(PackedLayout.from_lengths([5, 1, 8], [[3, 1], [2], [4, 4, 7]]))
    T = int(meta.cu_seqlens[-1])
    aligned = schedule.aligned_rows(meta, T)
    cu = meta.cu_seqlens.long()
    assert aligned.start.tolist() == [0, 8, 12, 16, 20, 24, 32, 36, 40]
    for s_ in range(cu.numel() - 1):
        got = aligned.rows[cu[s_]:cu[s_ + 1]]
        assert got.tolist() == list(range(int(aligned.start[s_]), int(aligned.start[s_]) + int(cu[s_ + 1] - cu[s_])))
    assert aligned.width % 4 == 0 and aligned.width >= int(aligned.rows.max()) + 1
    assert aligned.width == -(-(T + 3 * (cu.numel() - 1)) // 4) * 4


def test_warp_specialised_forward_is_chosen_where_it_applies(monkeypatch):
    """The packed layout on descriptors takes the warp-specialised forward and dQ (their default
    candidates at head dim 128; at 256 the forward only); DUALKV_TRITON_WS=0, a context in its own
    tensors, pointer loads, or a padded head dim of 256 columns take the multi-loop kernels; a bad
    DUALKV_TRITON_WS value is named."""
    from dualkv.core.backends.triton import configs

    monkeypatch.setattr(configs, "choose", _first_candidate)
    specs = record_triton_launches(monkeypatch, launcher, ("fwd_kernel", "dq_kernel"))

    def ws_of(d=128, tma=None, separate=False):
        specs.clear()
        layout, meta, q, k, v, _ = _inputs([20], [[9, 4]], 2, 1, d, dtype=torch.float16)
        if separate:  # flash_attn_dualkv_varlen_func's form: the 20 prompt rows as their own K / V
            cu = torch.tensor([0, 9, 13], dtype=torch.int32, device=DEVICE)
            flash_attn_dualkv_varlen_func(q[20:], k[:20], v[:20], k[20:], v[20:], cu, cu, 9, 20, 9, backend="triton")
        else:
            out, lse = launcher.forward(q, k, v, None, None, meta, 0.1, None, None, tma=tma)
            launcher.backward(q, q, k, v, None, None, out, lse, meta, 0.1, None, None, True, tma=tma)
        return {s["name"]: s["constexprs"]["WS"] for s in specs.values()}

    assert ws_of() == {"fwd_kernel": True, "dq_kernel": True}
    assert ws_of(separate=True) == {"fwd_kernel": False}
    assert ws_of(tma=False) == {"fwd_kernel": False, "dq_kernel": False}
    assert ws_of(d=192) == {"fwd_kernel": False, "dq_kernel": False}
    assert ws_of(d=256) == {"fwd_kernel": True, "dq_kernel": False}  # dQ's loop gave NaN there
    monkeypatch.setenv("DUALKV_TRITON_WS", "0")
    assert ws_of() == {"fwd_kernel": False, "dq_kernel": False}
    monkeypatch.setenv("DUALKV_TRITON_WS", "yes")
    with pytest.raises(ValueError, match="DUALKV_TRITON_WS: expected 0 or 1, got 'yes'"):
        ws_of()


@pytest.mark.parametrize("softcap, split_rows, atomic_dq", [(None, 4096, False), (None, 1, False), (20.0, 1, False),
                                                           (None, 4096, True), (20.0, 1, True)])
def test_dkdv_row_loop_matches_reference(softcap, split_rows, atomic_dq):
    """The one-loop dK/dV (query row blocks from a multiple of 4, masked by row bounds): own rows of
    prompts and responses, a prompt block's readers (split over programs, partials reduced in order),
    1-token segments, ragged key blocks whose tail rows are other segments' keys (zeroed for the
    atomic dQ, which this loop also computes), GQA 2:1."""
    layout, meta, q, k, v, do = _inputs([70, 1, 33], [[40, 9, 1], [5], [17, 64]], 4, 2, 32, seed=5)
    _check_all(q, k, v, do, meta, softcap=softcap, tma=True, split_rows=split_rows,
               atomic_dq=atomic_dq)


def test_dkdv_row_loop_padded_head_dim_fp16():
    """Head dim 24 on descriptors: the padded columns of K / V (the next head's) are zeroed."""
    layout, meta, q, k, v, do = _inputs([45], [[30, 3]], 2, 1, 24, dtype=torch.float16, seed=2)
    _check_all(q, k, v, do, meta, tma=True, tol=3e-3)


def test_dkdv_row_loop_is_chosen_where_it_applies(monkeypatch):
    """The packed layout on descriptors without a window takes the one-loop dK/dV (with the atomic dQ
    too); a window, pointer loads, or a context in its own tensors take the per-segment kernel."""
    specs = record_triton_launches(monkeypatch, launcher, ("dkdv_kernel", "dkdv_rows_kernel"))

    def kernel(tma=True, window=None, atomic_dq=False, separate=False):
        specs.clear()
        layout, meta, q, k, v, do = _inputs([20], [[9, 4]], 2, 1, 16)
        if separate:
            cu = torch.tensor([0, 9, 13], dtype=torch.int32, device=DEVICE)
            leaves = [t.requires_grad_() for t in (q[20:], k[:20], v[:20], k[20:], v[20:])]
            out = flash_attn_dualkv_varlen_func(*leaves, cu, cu, 9, 20, 9, backend="triton")
            out.square().sum().backward()
        else:
            out, lse = launcher.forward(q, k, v, None, None, meta, 0.1, window, None, tma=tma)
            launcher.backward(do, q, k, v, None, None, out, lse, meta, 0.1, window, None, False, tma=tma,
                              atomic_dq=atomic_dq)
        (name,) = {s["name"] for s in specs.values()}
        return name

    assert kernel() == "dkdv_rows_kernel"
    assert kernel(window=8) == "dkdv_kernel"
    assert kernel(tma=False) == "dkdv_kernel"
    assert kernel(atomic_dq=True) == "dkdv_rows_kernel"
    assert kernel(separate=True) == "dkdv_kernel"


@pytest.mark.parametrize("atomic_dq", [False, True])
def test_split_readers(atomic_dq):
    """Many readers per prompt block: the reader range is split over programs, partials reduced in order."""
    _, meta, q, k, v, do = _inputs([9, 3], [[11, 5, 14, 1, 6, 9], [4, 17]], 2, 1, 16, seed=7)
    items = schedule.key_items(meta, q.shape[0], 0, False, SMALL.block_n, None, split_rows=1)
    assert int(items.table[schedule.NSPLIT].max()) > 1  # the split path is really taken
    _check_all(q, k, v, do, meta, split_rows=1, atomic_dq=atomic_dq)


def test_balanced_split_rows_follows_the_work():
    """``balanced_split_rows`` is the rows walked by all items without splits, times the programs per
    item, over twice the SMs; the harness's low-rho configs then take no splits on 132 SMs, a short
    prompt with many readers still does, and no item walks more than the budget beyond its own rows."""
    for (N, P, R), want in (((28, 4096, 2048), 1), ((32, 8192, 2048), 1), ((64, 512, 2048), 3)):
        layout = PackedLayout.from_lengths([P], [[R] * N])
        meta = AttnMeta.from_layout(layout)
        whole = schedule.key_items(meta, layout.total_tokens, 0, False, 128, None, split_rows=1 << 40).table
        valid = whole[schedule.UNIT] >= 0
        unit, blk = whole[schedule.UNIT][valid].long(), whole[schedule.BLOCK][valid].long()
        lens = (meta.cu_seqlens[1:] - meta.cu_seqlens[:-1]).long()
        walked = (lens[unit] - 128 * blk).sum() + (whole[schedule.R1] - whole[schedule.R0])[valid].long().sum()
        budget = schedule.balanced_split_rows(meta, 128, 8, 132)
        assert int(budget) == int(walked) * 8 // 264
        t = schedule.key_items(meta, layout.total_tokens, 0, False, 128, None, budget).table
        assert int(t[schedule.NSPLIT].max()) == want, (N, P, R)
        reads = (t[schedule.R1] - t[schedule.R0])[t[schedule.UNIT] >= 0]
        assert int(reads.max()) <= max(int(budget), P)


def test_head_major_flag_follows_the_longest_prompt():
    """The Gluon dK/dV's program order: kv head major where the longest prompt reaches ``min_prompt`` keys
    (one group or several), item-major below it, without prompts or with no threshold; True / False fix
    it. ``order_flag`` passes the flag through, makes one from a bool and names a wrong tensor."""
    from dualkv.core.backends.triton import gluon_dkdv

    def flag(prompts, responses, head_major=None, min_prompt=8192):
        meta = AttnMeta.from_layout(PackedLayout.from_lengths(prompts, responses))
        out = schedule.head_major_flag(meta, head_major, min_prompt)
        assert out.shape == (1,) and out.dtype == torch.int32
        return int(out)

    assert flag([4096], [[16] * 3]) == 0
    assert flag([8192], [[16] * 3]) == 1
    assert flag([4096, 8192, 100], [[16], [16], [16]]) == 1
    assert flag([8191, 512], [[16], [16]]) == 0
    assert flag([8192], [[16]], min_prompt=None) == 0
    assert flag([8192], [[16]], head_major=False) == 0
    assert flag([4096], [[16]], head_major=True) == 1
    no_prompt = AttnMeta.from_layout(PackedLayout.from_lengths([4096], [[16]]))._replace(
        ctx_key_len=torch.zeros(0, dtype=torch.int32))
    assert int(schedule.head_major_flag(no_prompt, None, 8192)) == 0
    ready = torch.ones(1, dtype=torch.int32)
    assert gluon_dkdv.order_flag(ready, "cpu") is ready
    assert gluon_dkdv.order_flag(True, "cpu").tolist() == [1]
    with pytest.raises(ValueError, match=r"head_major: expected a bool or a \(1,\) int32 tensor"):
        gluon_dkdv.order_flag(torch.ones(1), "cpu")


def test_key_items_by_segment_order():
    """by_segment=True: the same items; the blocks read as context first, heaviest first; then every
    other block segment by segment, first block first; the padding last."""
    layout = PackedLayout.from_lengths([9, 3], [[11, 5, 14], [4, 17]])
    meta = AttnMeta.from_layout(layout)
    args = (meta, layout.total_tokens, 0, False, 8, None, 1)
    heavy, grouped = schedule.key_items(*args).table, schedule.key_items(*args, by_segment=True).table
    assert sorted(map(tuple, heavy.T.tolist())) == sorted(map(tuple, grouped.T.tolist()))
    unit, blk, reg = (grouped[r].tolist() for r in (schedule.UNIT, schedule.BLOCK, schedule.REGION))
    kind = [2 if u < 0 else 0 if g >= 0 else 1 for u, g in zip(unit, reg)]
    assert kind == sorted(kind) and 0 in kind and 1 in kind
    context = [c for c, k in enumerate(kind) if k == 0]
    heavy_context = (heavy[schedule.UNIT] >= 0) & (heavy[schedule.REGION] >= 0)
    assert grouped[:, context].tolist() == heavy[:, heavy_context].tolist()
    own = [(unit[c], blk[c]) for c, k in enumerate(kind) if k == 1]
    assert own == sorted(own) and len({u for u, _ in own}) == 5


def test_fused_dq_splits_by_balance(monkeypatch):
    """With dQ added in the dK/dV kernel and no split size given, the backward splits a prompt's readers
    by ``balanced_split_rows`` (here many SMs, so several splits) and matches the reference."""
    _, meta, q, k, v, do = _inputs([9, 3], [[11, 5, 14, 1, 6, 9], [4, 17]], 2, 1, 16, seed=7)
    monkeypatch.setattr(launcher, "_sm_count", lambda device: 64)
    seen = []
    real = schedule.key_items
    monkeypatch.setattr(schedule, "key_items", lambda *a, **kw: seen.append((a[-1], kw)) or real(*a, **kw))
    _check_all(q, k, v, do, meta, split_rows=None, atomic_dq=True)
    assert len(seen) == 1 and isinstance(seen[0][0], torch.Tensor) and seen[0][1] == {"by_segment": True}
    items = real(meta, q.shape[0], 0, False, SMALL.block_n, None, seen[0][0])
    assert int(items.table[schedule.NSPLIT].max()) > 1
    seen.clear()
    _check_all(q, k, v, do, meta, split_rows=None, atomic_dq=False)
    assert seen == [(schedule.SPLIT_ROWS, {"by_segment": False})]  # the dQ kernel's path: as before


def test_padded_head_dim_and_fp16():
    """headdim 96 runs padded to 128 (through descriptors too); fp16 against the fp64 reference."""
    _, meta, q, k, v, do = _inputs([13], [[10, 21]], 2, 1, 96, dtype=torch.float16, seed=11)
    _check_all(q, k, v, do, meta, tma=True, tol=4e-3, fwd_cfg=KernelConfig(32, 32, 4, 1),
               bwd_cfg=KernelConfig(32, 32, 4, 1))


def test_deterministic_is_bitwise_repeatable(monkeypatch):
    monkeypatch.setenv("DUALKV_TRITON_ATOMIC_DQ", "1")  # deterministic overrides the atomic default
    _, meta, q, k, v, do = _inputs([21], [[17, 30]], 4, 2, 16, seed=5)
    first = _check_all(q, k, v, do, meta, deterministic=True, split_rows=1)
    again = _check_all(q, k, v, do, meta, deterministic=True, split_rows=1)
    for a, b in zip(first[:3], again[:3]):
        assert torch.equal(a, b)


def test_public_op_autograd_matches_reference():
    """dualkv_attention(backend="triton") through the custom op and autograd, against autograd
    through the reference; prompt dK/dV include every response's contribution."""
    layout, _, q, k, v, do = _inputs([11, 4], [[6, 9], [12]], 4, 2, 32, seed=3)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref_leaves = [t.double().clone().requires_grad_(True) for t in (q, k, v)]
    out, lse = dualkv_attention(*leaves, layout, window=8, return_lse=True, backend="triton")
    ref_out, ref_lse = reference_attention(*ref_leaves, layout, window=8, return_lse=True)
    _close("out", out, ref_out, 2e-5)
    _close("lse", lse, ref_lse, 2e-5)
    grads = torch.autograd.grad(out, leaves, do)
    ref_grads = torch.autograd.grad(ref_out, ref_leaves, do.double())
    for name, g, r in zip("qkv", grads, ref_grads):
        _close(f"d{name}", g, r, 1e-4)


@pytest.mark.parametrize("tma", [False, True])
def test_varlen_function_separate_context(tma, monkeypatch):
    """The seed paper's signature: context K/V in their own tensors, gradients summed over readers."""
    monkeypatch.setenv("DUALKV_TRITON_TMA", "1" if tma else "0")
    g = torch.Generator().manual_seed(9)
    P, lens, H, Hkv, d = 29, [7, 18, 1], 4, 2, 16
    T = sum(lens)
    q = torch.randn(T, H, d, generator=g).to(DEVICE)
    kc, vc = (torch.randn(P, Hkv, d, generator=g).to(DEVICE) for _ in range(2))
    kd, vd = (torch.randn(T, Hkv, d, generator=g).to(DEVICE) for _ in range(2))
    cu = torch.tensor([0, 7, 25, 26], dtype=torch.int32, device=DEVICE)
    grads = {}
    for backend in ("triton", "reference"):
        leaves = [t.clone().requires_grad_(True) for t in (q, kc, vc, kd, vd)]
        out = flash_attn_dualkv_varlen_func(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4], cu, cu, 18, P, 18,
                                            backend=backend)
        grads[backend] = (out, *torch.autograd.grad(out, leaves, torch.ones_like(out)))
    for name, a, b in zip(["out", "dq", "dk_ctx", "dv_ctx", "dk", "dv"], grads["triton"], grads["reference"]):
        _close(name, a, b, 1e-4)


def test_query_tiles_cover_every_block_once():
    layout = PackedLayout.from_lengths([37, 5], [[20, 7, 1], [33]])
    meta = AttnMeta.from_layout(layout)
    T, bm = layout.total_tokens, 16
    tiles = schedule.query_tiles(meta, T, bm, None)
    assert tiles.shape == (2, meta.cu_seqlens.numel() - 1 + math.ceil(T / bm))
    seg, mb = tiles[0].tolist(), tiles[1].tolist()
    got = sorted((s, m) for s, m in zip(seg, mb) if s >= 0)
    lens = (meta.cu_seqlens[1:] - meta.cu_seqlens[:-1]).tolist()
    assert got == sorted((s, m) for s, n in enumerate(lens) for m in range(math.ceil(n / bm)))
    valid = [s >= 0 for s in seg]
    assert valid == sorted(valid, reverse=True)  # padding at the end, heaviest (response) tiles first
    assert seg[0] != 0 and lens[seg[0]] > 0


def test_key_items_partition_readers():
    """Every key block appears once per split; the splits of a prompt block tile its reader rows."""
    layout = PackedLayout.from_lengths([9, 3], [[11, 5, 14], [4, 17]])
    meta = AttnMeta.from_layout(layout)
    items = schedule.key_items(meta, layout.total_tokens, 0, False, 8, None, split_rows=1)
    t = items.table
    valid = t[schedule.UNIT] >= 0
    rows = {}
    for col in t[:, valid].T.tolist():
        unit, blk, z, nz, reg, r0, r1 = col[:7]
        rows.setdefault((unit, blk), []).append((z, nz, reg, r0, r1))
    lens = (meta.cu_seqlens[1:] - meta.cu_seqlens[:-1]).tolist()
    assert set(rows) == {(s, b) for s, n in enumerate(lens) for b in range(math.ceil(n / 8))}
    for (unit, _), splits in rows.items():
        splits.sort()
        nz, reg = splits[0][1], splits[0][2]
        assert [z for z, *_ in splits] == list(range(nz))
        if reg < 0:  # a response block: no readers
            assert nz == 1
            continue
        start, end = int(meta.ctx_reader_start[reg]), int(meta.ctx_reader_end[reg])
        assert splits[0][3] == start and splits[-1][4] == end
        assert all(a[4] == b[3] for a, b in zip(splits, splits[1:]))
    assert int(t[schedule.NSPLIT].max()) > 1


def test_configs_pruning_and_tuner():
    """Candidates fit a Hopper block; the tuner keeps the fastest and skips configs that do not build."""
    from dualkv.core.backends.triton import configs

    for kind in ("fwd", "dkdv", "dq"):
        for d in triton_backend.HEAD_DIMS:
            for cfg in configs.candidates(kind, d, 2):
                assert configs.smem_bytes(kind, cfg, configs.padded_head_dim(d), 2) <= configs.SMEM_LIMIT
    assert not configs.keep("fwd", KernelConfig(128, 128, 8, 4), 256, 2)  # ~600 KB of tiles

    class OutOfResources(Exception):
        pass

    cands = [KernelConfig(64, 64, 4, 2), KernelConfig(128, 64, 8, 3), KernelConfig(128, 128, 8, 3)]
    times = {cands[0]: 3.0, cands[1]: 1.0}

    def run(cfg):
        if cfg not in times:
            raise OutOfResources("out of resource: shared memory")
        run.last = cfg

    assert configs._tune(cands, run, bench=lambda fn: (fn(), times[run.last])[1]) == cands[1]
    assert configs.choose("fwd", (), 128, 2, on_cuda=False) == configs.INTERPRET_CONFIG


def test_configs_fit_the_gpu_in_hand(monkeypatch):
    """A GPU with less shared memory than a Hopper block prunes the big candidates; a config the GPU
    still rejects for its resources gives way to the next listed one, which is remembered for the key;
    other errors pass through; none fitting is an error naming the kernel and the limit."""
    from dualkv.core.backends.triton import configs

    class OutOfResources(Exception):
        pass

    monkeypatch.setattr(configs, "_FITTED", {})
    hopper = configs.candidates("fwd", 128, 2)
    ampere = configs.candidates("fwd", 128, 2, smem_limit=163 * 1024)
    assert hopper[0] != ampere[0]
    assert all(configs.smem_bytes("fwd", c, 128, 2) <= 163 * 1024 for c in ampere)

    listed = configs._listed("dkdv_rows", 128, False)
    fits = set(listed[2:])
    ran = []

    def run(cfg):
        if cfg not in fits:
            raise OutOfResources(f"out of resource: shared memory, Required: 240000, Hardware limit: 232448 ({cfg})")
        ran.append(cfg)

    assert configs.launch("dkdv_rows", ("k",), 128, 2, True, run) == listed[2]
    assert ran == [listed[2]]
    assert configs.launch("dkdv_rows", ("k",), 128, 2, True, run) == listed[2]  # remembered: no rejected try first
    assert ran == [listed[2]] * 2
    assert configs.launch("dkdv_rows", ("k",), 128, 2, True, run, config=listed[3]) == listed[3]  # given: run as is
    assert configs.launch("dkdv_rows", ("k",), 128, 2, False, ran.append) == configs.INTERPRET_CONFIG  # interpreter
    assert ran[-1] == configs.INTERPRET_CONFIG

    def broken(cfg):
        raise ValueError("not a resource problem")

    with pytest.raises(ValueError, match="not a resource problem"):
        configs.launch("dq", ("k",), 128, 2, True, broken)
    fits.clear()
    with pytest.raises(RuntimeError, match=r"no dq kernel config at head dim 64 fits this GPU \(99 KB"):
        configs.launch("dq", ("k",), 64, 2, True, run, smem_limit=99 * 1024)


def test_check_supported_errors(monkeypatch):
    q = torch.zeros(4, 2, 16)
    kv = torch.zeros(4, 1, 16)
    with pytest.raises(ValueError, match="headdim"):
        triton_backend.check_supported(torch.zeros(4, 2, 48), torch.zeros(4, 1, 48), torch.zeros(4, 1, 48), None, None)
    with pytest.raises(ValueError, match="dtype"):
        triton_backend.check_supported(q.double(), kv.double(), kv.double(), None, None)
    with pytest.raises(ValueError, match="last dimension"):
        triton_backend.check_supported(q, torch.zeros(4, 1, 32)[..., ::2], kv, None, None)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="bfloat16"):
            triton_backend.check_supported(q.bfloat16(), kv.bfloat16(), kv.bfloat16(), None, None)
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(ValueError, match="CUDA tensor"):
            triton_backend.check_supported(q, kv, kv, None, None)


def test_public_op_rejects_unsupported_headdim():
    layout = PackedLayout.from_lengths([3], [[2]], device=DEVICE)
    q = torch.zeros(5, 2, 40, device=DEVICE)
    kv = torch.zeros(5, 2, 40, device=DEVICE)
    with pytest.raises(ValueError, match="headdim"):
        dualkv_attention(q, kv, kv, layout, backend="triton")


def test_random_layouts():
    """Fresh random lengths, heads, window and load path on every run; the seed is in the failure."""
    seed = random.SystemRandom().randrange(1 << 30)
    rng = random.Random(seed)
    prompts = [rng.randint(1, 30) for _ in range(rng.randint(1, 3))]
    responses = [[rng.randint(1, 25) for _ in range(rng.randint(1, 3))] for _ in prompts]
    Hkv = rng.choice([1, 2])
    _, meta, q, k, v, do = _inputs(prompts, responses, Hkv * rng.choice([1, 2, 4]), Hkv, 16, seed=seed)
    try:
        _check_all(q, k, v, do, meta, window=rng.choice([None, rng.randint(1, 40)]), tma=rng.random() < 0.5)
    except AssertionError as err:
        raise AssertionError(f"seed {seed} (prompts {prompts}, responses {responses}): {err}") from err


# ------------------------------------------------------------------ compiled variants
def test_kernels_keep_one_compiled_variant_across_layouts(monkeypatch):
    """Micro-batches of other token counts (a multiple of 16 or not) and segment counts leave every
    attention kernel's specialisation unchanged (pointer alignment, integer divisibility, minus the
    kernel's do_not_specialize list), so a training run compiles each kernel once instead of once
    more, mid-step, for the first micro-batch whose size happens to divide by 16."""
    from dualkv.core.backends.triton import configs

    monkeypatch.setattr(configs, "choose", _first_candidate)
    names = ("fwd_kernel", "preprocess_kernel", "dkdv_rows_kernel", "reduce_kernel", "dq_kernel")
    specs = record_triton_launches(monkeypatch, launcher, names)
    g = torch.Generator().manual_seed(0)
    for prompts, responses in (([70], [[40, 9]]), ([64], [[33, 31]]), ([80], [[47, 1]]), ([100], [[5, 7, 4]])):
        layout = PackedLayout.from_lengths(prompts, responses)  # 119, 128, 128, 116 tokens
        q = torch.randn(layout.total_tokens, 4, 64, generator=g).requires_grad_()
        k, v = (torch.randn(layout.total_tokens, 2, 64, generator=g).requires_grad_() for _ in range(2))
        dualkv_attention(q, k, v, layout, backend="triton").square().sum().backward()
    per_kernel = {}
    for spec in specs.values():
        per_kernel.setdefault(spec["name"], []).append(spec["specialization"])
    assert set(per_kernel) == set(names), sorted(per_kernel)
    assert all(len(v) == 1 for v in per_kernel.values()), per_kernel


# ------------------------------------------------------------------ compiled for Hopper, no GPU
def test_kernels_compile_for_hopper_with_gpu_configs(tmp_path, monkeypatch):
    """Every attention kernel a forward + backward launches, with the configs a GPU would take, in
    bf16, lowers to sm_90 machine code on this CPU-only machine: the interpreter never runs Triton's
    compiler, so a kernel it runs can still fail to compile. The launches are recorded from an
    interpreter run (window and softcap on), then compiled in a subprocess outside the interpreter."""
    from dualkv.core.backends.triton import configs

    monkeypatch.setattr(configs, "choose", _first_candidate)
    specs = record_triton_launches(monkeypatch, launcher, ("fwd_kernel", "preprocess_kernel", "dkdv_kernel",
                                                           "dkdv_rows_kernel", "reduce_kernel", "dq_kernel",
                                                           "scale_cast_kernel"))
    layout = PackedLayout.from_lengths([70], [[40, 9]])
    g = torch.Generator().manual_seed(0)
    q = torch.randn(layout.total_tokens, 4, 128, generator=g, dtype=torch.float16).requires_grad_()
    k, v = (torch.randn(layout.total_tokens, 2, 128, generator=g, dtype=torch.float16).requires_grad_() for _ in range(2))
    out = dualkv_attention(q, k, v, layout, window=50, softcap=20.0, backend="triton")
    out.float().square().sum().backward()
    # no window: the one-loop dK/dV
    dualkv_attention(q, k, v, layout, softcap=20.0, backend="triton").float().square().sum().backward()
    monkeypatch.setenv("DUALKV_TRITON_WS", "0")  # and the multi-loop forward and dQ
    dualkv_attention(q, k, v, layout, window=50, softcap=20.0, backend="triton").float().square().sum().backward()
    names = {s["name"] for s in specs.values()}
    assert {"fwd_kernel", "preprocess_kernel", "dkdv_kernel", "dkdv_rows_kernel", "dq_kernel"} <= names, names
    for name in ("fwd_kernel", "dq_kernel"):
        assert {s["constexprs"]["WS"] for s in specs.values() if s["name"] == name} == {False, True}
    compiled = compile_for_hopper(specs, tmp_path)
    # Triton's pass really split the WS forward and dQ (it silently leaves a loop it cannot split), and
    # nothing else
    split = {name + ("-ws" if ce.get("WS") else ""): ws for name, ce, ws in compiled}
    assert split.pop("fwd_kernel-ws") and split.pop("dq_kernel-ws") and not any(split.values()), split


def test_gluon_kernels_compile_for_hopper():
    """The Gluon forward and dK/dV lower to sm_90 machine code with this Triton (they have no
    interpreter path, so this is their CPU check; the GPU tests compare them with the ``tl`` kernels).
    Run in a subprocess without TRITON_INTERPRET."""
    import os
    import subprocess
    import sys

    from dualkv.core.backends.triton import gluon_compat

    if not gluon_compat.AVAILABLE:
        pytest.skip("this Triton has no Gluon Hopper API")
    code = ("from benchmarks.tune_triton import resources\n"
            "from dualkv.core.backends.triton import gluon_dkdv, gluon_fwd\n"
            "def report(kind, d, k):\n"
            "    print(kind, d, k.metadata.shared, len(k.asm['cubin']), resources(k)['spill_bytes'])\n"
            "for d, bn, w in ((128, 128, 8), (64, 64, 4)):\n"
            "    report('dkdv', d, gluon_dkdv.compile_for_sm90(d, block_n=bn, num_warps=w))\n"
            "    for parts in (1, 2):\n"
            "        k = gluon_dkdv.compile_for_sm90(d, block_n=bn, num_warps=w, fuse_dq=True, dq_parts=parts)\n"
            "        assert 'cp.reduce.async.bulk.tensor' in k.asm['ptx']\n"
            "        report('dkdv_dq', d, k)\n"
            "    report('fwd', d, gluon_fwd.compile_for_sm90(d))\n"
            "from dualkv.core.backends.triton import gluon_dkdv_ws, gluon_split256\n"
            "k = gluon_dkdv_ws.compile_for_sm90()\n"
            "assert 'cp.reduce.async.bulk.tensor' in k.asm['ptx']\n"
            "report('ws_dkdv_dq', 128, k)\n"
            "report('split_dkdv', 256, gluon_split256.compile_for_sm90('dkdv'))\n"
            "report('split_dq', 256, gluon_split256.compile_for_sm90('dq'))\n")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [line.split() for line in res.stdout.strip().split("\n")]
    assert [(kind, int(d)) for kind, d, *_ in lines] == [
        ("dkdv", 128), ("dkdv_dq", 128), ("dkdv_dq", 128), ("fwd", 128),
        ("dkdv", 64), ("dkdv_dq", 64), ("dkdv_dq", 64), ("fwd", 64),
        ("ws_dkdv_dq", 128), ("split_dkdv", 256), ("split_dq", 256)]
    for kind, _, smem, cubin, spill in lines:
        assert int(cubin) > 0 and int(smem) <= 227 * 1024
        # no spills: without gluon_compat.hidden_zero the d = 128 dK/dV spilled 16-248 bytes. The
        # warp-specialised one, with its unmasked path for the steps that see all keys, spills 16 bytes
        # under Triton 3.6 (the GPU machine's: one reload a step) and 56 under 3.9.
        assert int(spill) <= (64 if kind == "ws_dkdv_dq" else 0), lines


@pytest.mark.parametrize("d, dtype, env, deterministic, softcap, expect", [
    (128, torch.bfloat16, {}, False, None, ("ws", True)),
    (128, torch.float16, {}, False, None, ("ws", True)),
    (128, torch.bfloat16, {}, True, None, (None, False)),  # deterministic: the dQ kernel
    (128, torch.bfloat16, {"DUALKV_TRITON_ATOMIC_DQ": "0"}, False, None, (None, False)),
    (128, torch.bfloat16, {"DUALKV_TRITON_GLUON_BWD": "0"}, False, None, (None, False)),
    (128, torch.bfloat16, {}, False, 30.0, (None, False)),
    (128, torch.float32, {}, False, None, (None, False)),
    (256, torch.bfloat16, {}, False, None, ("split", False)),
    (256, torch.bfloat16, {"DUALKV_TRITON_GLUON_BWD": "0"}, False, None, (None, False)),
    (256, torch.bfloat16, {"DUALKV_TRITON_ATOMIC_DQ": "1"}, False, None, (None, True)),  # the tl atomic path
    (64, torch.bfloat16, {}, False, None, (None, False)),
])
def test_backward_takes_the_warp_specialised_gluon_kernels_where_they_apply(monkeypatch, d, dtype, env, deterministic,
                                                                            softcap, expect):
    """Which backward kernels a call takes on sm_90 (the GPU made to look present): at d = 128 the
    warp-specialised dK/dV with dQ fused (so dQ by reduce-adds), at d = 256 the split-role dK/dV and
    dQ; never with deterministic=True at d = 128 (its dQ varies run to run), a softcap, fp32, or the
    switches off. The GPU tests run the kernels themselves against the ``tl`` ones."""
    from dualkv.core.backends.triton import gluon_compat

    if not gluon_compat.AVAILABLE:
        pytest.skip("this Triton has no Gluon Hopper API")
    for mod in (launcher.gluon_dkdv_ws, launcher.gluon_split256):
        monkeypatch.setattr(mod, "on_hopper", lambda t: True)
    for name in ("DUALKV_TRITON_ATOMIC_DQ", "DUALKV_TRITON_GLUON_BWD"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    _, meta, q, k, v, do = _inputs([40], [[9, 5]], 4, 2, d, dtype=dtype)
    bwd = launcher.Backward(do, q, k, v, None, None, q, None, meta, 0.1, None, softcap,
                            False if deterministic else None, tma=True)
    kernel = "ws" if bwd.gluon_ws else "split" if bwd.gluon_split else None
    assert (kernel, bwd.atomic) == expect
    assert not (bwd.gluon_ws and bwd.gluon_split)


def test_warp_specialised_gluon_kernels_reject_what_their_layouts_do_not_cover():
    """The kernels are written for fixed tiles and head dims: anything else is a clear error at launch,
    before a descriptor is built (the launcher always passes what they take)."""
    from dualkv.core.backends.triton import gluon_compat, gluon_dkdv_ws, gluon_split256

    if not gluon_compat.AVAILABLE:
        pytest.skip("this Triton has no Gluon Hopper API")
    _, meta, q, k, v, do = _inputs([40], [[9, 5]], 4, 2, 128, dtype=torch.float16)
    rest = [None] * 12
    with pytest.raises(ValueError, match="gluon_dkdv_ws: expected d = 128, 64 x 128 tiles and a dQ accumulator, "
                                         "got d = 128, 64 x 64"):
        gluon_dkdv_ws.run(q, k, v, do, *rest, torch.zeros(q.shape), block_m=64, block_n=64)
    with pytest.raises(ValueError, match="dq_acc=None"):
        gluon_dkdv_ws.run(q, k, v, do, *rest, None)
    with pytest.raises(ValueError, match="gluon_split256: expected d = 256 and 64 x 64 tiles, got d = 128"):
        gluon_split256.run_dkdv(q, k, v, do, *rest)
    with pytest.raises(ValueError, match="gluon_split256: expected d = 256 and a contiguous dq, got d = 128"):
        gluon_split256.run_dq(q, k, v, do, torch.empty_like(q), None, None, meta, 1.0, 1.0)


def test_gluon_switches(monkeypatch):
    """DUALKV_TRITON_GLUON_FWD / _DKDV and _BWD_HEAD_MAJOR take 0 or 1 (named in the error otherwise); the
    Gluon kernels are never taken off the GPU, so with both on a CPU call runs the ``tl`` kernels, correctly."""
    from dualkv.core.backends.triton import configs, gluon_dkdv, gluon_fwd

    for name, enabled in (("DUALKV_TRITON_GLUON_DKDV", configs.gluon_dkdv_enabled),
                          ("DUALKV_TRITON_GLUON_FWD", configs.gluon_fwd_enabled)):
        monkeypatch.setenv(name, "yes")
        with pytest.raises(ValueError, match=name):
            enabled()
        monkeypatch.setenv(name, "1")
        assert enabled()
    monkeypatch.delenv("DUALKV_TRITON_GLUON_FWD")
    assert configs.gluon_fwd_enabled()  # on by default
    # the Gluon dK/dV's program order: left to the layout (None) unless the variable says 0 or 1
    monkeypatch.delenv("DUALKV_TRITON_BWD_HEAD_MAJOR", raising=False)
    assert configs.bwd_head_major() is None
    monkeypatch.setenv("DUALKV_TRITON_BWD_HEAD_MAJOR", "0")
    assert configs.bwd_head_major() is False
    monkeypatch.setenv("DUALKV_TRITON_BWD_HEAD_MAJOR", "1")
    assert configs.bwd_head_major() is True
    monkeypatch.setenv("DUALKV_TRITON_BWD_HEAD_MAJOR", "true")
    with pytest.raises(ValueError, match="DUALKV_TRITON_BWD_HEAD_MAJOR: expected 0 or 1"):
        configs.bwd_head_major()
    monkeypatch.delenv("DUALKV_TRITON_BWD_HEAD_MAJOR")
    q = torch.zeros(8, 4, 128, dtype=torch.float16)
    k = torch.zeros(8, 2, 128, dtype=torch.float16)
    opts = launcher._Opts(q, k, 0.1, None, None, True)
    assert not gluon_dkdv.supported(opts, q)
    assert not gluon_fwd.supported(opts, q, False)
    # and a CPU backward with the switch on still runs the row kernel, correctly
    _, meta, q, k, v, do = _inputs([40], [[9, 5]], 4, 2, 32)
    _check_all(q, k, v, do, meta, tma=True)


# ------------------------------------------------------------------------ plans kept per layout
def test_plans_are_kept_per_layout_and_change_nothing(monkeypatch):
    """The public op's second forward+backward on the same layout computes no schedule (every layer of a
    micro-batch reads the first one's tables), and gives the same bits as planning every call."""
    from dualkv.core.backends.triton.plan_cache import PLANS

    layout, _, q, k, v, do = _inputs([13, 5], [[6, 9], [11]], 4, 2, 16, seed=11)

    def step():
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = dualkv_attention(*leaves, layout, backend="triton")
        return (out, *torch.autograd.grad(out, leaves, do))

    PLANS.clear()
    first = step()
    computed = PLANS.computed
    assert computed > 0 and len(PLANS) > 0
    again = step()
    assert PLANS.computed == computed  # all hits
    monkeypatch.setenv("DUALKV_TRITON_PLAN_CACHE", "0")
    planned_anew = step()
    assert PLANS.computed > computed
    for a, b, c in zip(first, again, planned_anew):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_plan_cache_keys_on_tensor_identity_version_and_arguments():
    from dualkv.core.backends.triton.plan_cache import PLANS

    layout, meta, *_ = _inputs([9], [[4, 7]], 2, 1, 16)
    T = layout.total_tokens
    PLANS.clear()
    tiles = schedule.query_tiles(meta, T, 16, None)
    assert schedule.query_tiles(meta, T, 16, None) is tiles
    assert schedule.query_tiles(meta, T, 32, None) is not tiles  # another argument: another plan
    assert torch.equal(schedule.query_tiles(meta, T, 16, None), schedule.query_tiles.uncached(meta, T, 16, None))
    before = PLANS.computed
    # the same lengths in new tensors: planned anew (the key is the tensors, not their values)
    _, meta2, *_ = _inputs([9], [[4, 7]], 2, 1, 16)
    schedule.query_tiles(meta2, T, 16, None)
    assert PLANS.computed == before + 1
    # an in-place change of a layout tensor: planned anew, from the new values
    meta2.seg_ctx_len.add_(0)
    schedule.query_tiles(meta2, T, 16, None)
    assert PLANS.computed == before + 2
    # tensor arguments key by identity too (split_rows as balanced_split_rows makes it)
    rows = schedule.balanced_split_rows(meta, 16, 1, 4)
    assert schedule.balanced_split_rows(meta, 16, 1, 4) is rows
    items = schedule.key_items(meta, T, 0, False, 16, None, rows, by_segment=True)
    assert schedule.key_items(meta, T, 0, False, 16, None, rows, by_segment=True) is items
    assert schedule.key_items(meta, T, 0, False, 16, None, rows.clone(), by_segment=True) is not items
    assert schedule.key_items(meta, T, 0, False, 16, None, rows, by_segment=False) is not items


def test_plan_cache_skips_inference_tensors_bounds_its_size_and_checks_its_variable(monkeypatch):
    from dualkv.core.backends.triton.plan_cache import ENTRIES, PLANS, PlanCache

    with torch.inference_mode():
        layout, meta, *_ = _inputs([9], [[4, 7]], 2, 1, 16)
    T = layout.total_tokens
    before = PLANS.computed
    assert schedule.query_tiles(meta, T, 16, None) is not schedule.query_tiles(meta, T, 16, None)
    assert PLANS.computed == before + 2
    cache = PlanCache(entries=3)
    keep = [torch.arange(i + 1) for i in range(5)]
    for t in keep:
        cache.get("f", [t], (), lambda: object())
    assert len(cache) == 3 and cache.computed == 5
    cache.get("f", [keep[-1]], (), lambda: object())  # the most recent one is still there
    assert cache.computed == 5
    assert ENTRIES >= 16
    monkeypatch.setenv("DUALKV_TRITON_PLAN_CACHE", "yes")
    with pytest.raises(ValueError, match="DUALKV_TRITON_PLAN_CACHE"):
        schedule.query_tiles(_inputs([9], [[4, 7]], 2, 1, 16)[1], T, 16, None)


def test_plan_cache_drops_freed_layouts_and_plans_nothing_under_inference_mode():
    from dualkv.core.backends.triton.plan_cache import PLANS

    PLANS.clear()
    layout, meta, *_ = _inputs([9], [[4, 7]], 2, 1, 16)
    T = layout.total_tokens
    schedule.query_tiles(meta, T, 16, None)
    assert len(PLANS) == 1
    del layout, meta  # the layout's tensors freed: its entry goes at the next insertion
    _, meta2, *_ = _inputs([9], [[4, 7]], 2, 1, 16)
    schedule.query_tiles(meta2, T, 16, None)
    assert len(PLANS) == 1
    before = PLANS.computed
    with torch.inference_mode():  # normal layout tensors, but a plan made here would be an inference tensor
        kept = schedule.query_tiles(meta2, T, 16, None)  # read: planned before
        made = schedule.query_tiles(meta2, T, 32, None)  # planned, not kept
    assert PLANS.computed == before + 1 and len(PLANS) == 1
    assert not kept.is_inference() and made.is_inference()
    # an argument that cannot be a key (here a list) plans anew every call; 1, True and 1.0 are three keys
    from dualkv.core.backends.triton.plan_cache import planned

    calls = []

    @planned
    def plan(meta, x):
        calls.append(x)
        return torch.zeros(1)

    for x in ([1], [1], 1, 1, True, 1.0, True):
        plan(meta2, x)
    assert calls == [[1], [1], 1, True, 1.0]
