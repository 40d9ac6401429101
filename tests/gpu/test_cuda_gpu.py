"""GPU tests of the CUDA backend: the grid against the fp32 reference, CUDA vs Triton agreement,
determinism, and compute-sanitizer (memcheck, racecheck) on a small case.

Tolerances follow DESIGN.md: |x - ref| <= 2 |x_torch - ref| + floor for the output (3x for
gradients), where x_torch is the same attention computed by PyTorch in the low-precision dtype and
ref is the fp32 reference on upcast inputs (``dualkv.core.reference``).
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from dualkv.core import AttnMeta, PackedLayout, dualkv_attention, flash_attn_dualkv_varlen_func
from dualkv.core.reference import reference_attention_backward_meta, reference_attention_meta
from helpers import check_sanitizer_log, compute_sanitizer

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cuda_backend():
    from dualkv.core.backends import cuda

    if not cuda.is_available():
        pytest.skip(cuda.unavailable_reason())
    cuda.load_extension()
    return cuda


# ------------------------------------------------------------------------------------------ oracles
def lowp_attention(q, k, v, meta: AttnMeta, scale, window, softcap, k_ctx=None, v_ctx=None):
    """The DualKV rule computed by PyTorch in q's dtype (scores, probabilities and the P V product
    rounded like a plain low-precision implementation). Differentiable; the tolerance baseline."""
    k_ctx = k if k_ctx is None else k_ctx
    v_ctx = v if v_ctx is None else v_ctx
    rep = q.shape[1] // k.shape[1]
    cu, cs, cl = meta.cu_seqlens.tolist(), meta.seg_ctx_start.tolist(), meta.seg_ctx_len.tolist()
    outs = []
    for s in range(len(cu) - 1):
        a, e, c = cu[s], cu[s + 1], cl[s]
        n = e - a
        keys = torch.cat([k_ctx[cs[s]: cs[s] + c], k[a:e]]).repeat_interleave(rep, 1)
        vals = torch.cat([v_ctx[cs[s]: cs[s] + c], v[a:e]]).repeat_interleave(rep, 1)
        scores = torch.einsum("mhd,khd->hmk", q[a:e], keys) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        kpos = torch.arange(c + n, device=q.device)
        qpos = c + torch.arange(n, device=q.device)
        vis = kpos[None] <= qpos[:, None]
        if window is not None:
            vis &= (qpos[:, None] - kpos[None]) < window
        probs = torch.softmax(scores.masked_fill(~vis, float("-inf")), dim=-1).to(q.dtype)
        outs.append(torch.einsum("hmk,khd->mhd", probs, vals))
    return torch.cat(outs)


def fp32_reference(q, k, v, dout, meta, scale, window, softcap, k_ctx=None, v_ctx=None):
    up = [None if t is None else t.float() for t in (q, k, v, k_ctx, v_ctx)]
    out, lse = reference_attention_meta(up[0], up[1], up[2], meta, scale, window, softcap, up[3], up[4])
    grads = reference_attention_backward_meta(dout.float(), up[0], up[1], up[2], meta, scale, window, softcap, up[3], up[4])
    return out, lse, grads


def rounding_floor(ref: torch.Tensor, dtype) -> float:
    """Twice the rounding error of the dtype at the reference's magnitude (FlashAttention's atol)."""
    r = ref.to(dtype)
    return 2 * (r + 0.3 - 0.3 - r).abs().max().item()


def max_err(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


def assert_close(name, got, ref, lowp, dtype, factor):
    bound = factor * max_err(lowp, ref) + rounding_floor(ref, dtype)
    err = max_err(got, ref)
    assert err <= bound, f"{name}: max error {err:.3e} > bound {bound:.3e} (low-precision torch error {max_err(lowp, ref):.3e})"
    return err


# --------------------------------------------------------------------------------------------- grid
GRID = [
    # prompts, responses, H, Hkv, d, window, softcap
    ([97], [[113, 1, 1023]], 8, 2, 128, None, None),  # odd lengths, a 1-token response
    ([1023], [[1, 97]], 4, 4, 64, None, None),  # P >> R
    ([1], [[1023, 113]], 4, 1, 128, None, None),  # P << R (MQA)
    ([37, 500, 3, 129], [[5, 64], [200], [1, 1, 1], [300, 7]], 6, 2, 64, None, None),  # many groups
    ([300], [[200, 150]], 4, 2, 128, 64, None),  # window reaching back into the prompt tail
    ([300], [[200, 150]], 4, 2, 128, None, 20.0),  # softcap
    ([129], [[65, 33]], 4, 2, 96, 50, 30.0),
    ([200], [[100, 77]], 4, 2, 192, None, None),
    ([200], [[100, 77]], 4, 2, 256, 100, None),
    ([130], [[70, 33]], 4, 2, 512, None, None),
    ([300], [[200, 65]], 4, 1, 512, 100, 30.0),
]


def _ids(case):
    p, r, H, Hkv, d, w, cap = case
    return f"P{p}-R{r}-H{H}/{Hkv}-d{d}-w{w}-cap{cap}".replace(" ", "")


def _run_packed(case, dtype, deterministic, backend="cuda", seed=0, key_ramp=None, layout=None):
    """One forward + backward of `case` (on `layout` when given, else a new one); key_ramp=(lo, hi)
    scales the packed keys by a ramp over the tokens (scores that grow along the sequence: the running
    row maximum keeps moving)."""
    prompts, responses, H, Hkv, d, window, softcap = case
    if layout is None:
        layout = PackedLayout.from_lengths(prompts, responses, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(seed)
    T = layout.total_tokens
    q, k, v = (torch.randn(T, h, d, device="cuda", generator=g, dtype=dtype) for h in (H, Hkv, Hkv))
    if key_ramp is not None:
        k = (k.float() * torch.linspace(*key_ramp, T, device="cuda")[:, None, None]).to(dtype)
    dout = torch.randn(T, H, d, device="cuda", generator=g, dtype=dtype)
    scale = 1.0 / math.sqrt(d)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = dualkv_attention(qg, kg, vg, layout, softmax_scale=scale, window=window, softcap=softcap,
                                deterministic=deterministic, return_lse=True, backend=backend)
    out.backward(dout)
    return dict(layout=layout, q=q, k=k, v=v, dout=dout, scale=scale, out=out.detach(), lse=lse,
                dq=qg.grad, dk=kg.grad, dv=vg.grad)


def _check_against_reference(case, dtype, r):
    _, _, _, _, _, window, softcap = case
    meta = AttnMeta.from_layout(r["layout"])
    ref_out, ref_lse, (rdq, rdk, rdv, _, _) = fp32_reference(r["q"], r["k"], r["v"], r["dout"], meta, r["scale"], window, softcap)
    ql, kl, vl = (t.clone().requires_grad_() for t in (r["q"], r["k"], r["v"]))
    lp_out = lowp_attention(ql, kl, vl, meta, r["scale"], window, softcap)
    lp_out.backward(r["dout"])
    assert_close("out", r["out"], ref_out, lp_out.detach(), dtype, 2)
    assert max_err(r["lse"], ref_lse) <= 1e-3 + 1e-4 * ref_lse.abs().max().item(), "lse"
    for name, got, ref, lp in (("dq", r["dq"], rdq, ql.grad), ("dk", r["dk"], rdk, kl.grad), ("dv", r["dv"], rdv, vl.grad)):
        assert_close(name, got, ref, lp, dtype, 3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", GRID, ids=[_ids(c) for c in GRID])
def test_grid_matches_reference(cuda_backend, case, dtype):
    r = _run_packed(case, dtype, deterministic=False)
    _check_against_reference(case, dtype, r)


def _kernels_of(case, dtype, deterministic=False, **run):
    """Run the case (forward and backward; `run`: more arguments of _run_packed) under the CUDA
    profiler: its result and the names of the kernels that ran."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        r = _run_packed(case, dtype, deterministic=deterministic, **run)
        torch.cuda.synchronize()
    return r, {e.name for e in prof.events()}


def test_launch_plan_is_kept_per_layout(cuda_backend, monkeypatch):
    """The binding plans a layout's launch once (the query-tile order by a sort, the prefix sums of the
    tiles and of the dK/dV items, the reader chunks: PlanCache in csrc/dkv_api.cpp): a second
    forward+backward on the same layout launches no sort or scan kernel and gives bit-identical results;
    after an in-place change of a layout tensor, or with DUALKV_CUDA_PLAN_CACHE=0, it plans again. The
    results match the reference."""
    monkeypatch.delenv("DUALKV_CUDA_PLAN_CACHE", raising=False)
    case = ([300, 70], [[150, 20], [140]], 4, 2, 128, None, None)
    layout = PackedLayout.from_lengths(case[0], case[1], device="cuda")

    def call():  # the same inputs (seed) on the same layout each time
        r, kernels = _kernels_of(case, torch.bfloat16, deterministic=True, seed=3, layout=layout)
        return r, any("sort" in name.lower() or "scan" in name.lower() for name in kernels)

    def same(a, b):
        return all(torch.equal(a[n], b[n]) for n in ("out", "lse", "dq", "dk", "dv"))

    first, planned = call()
    assert planned  # the first call on a layout plans it
    again, planned = call()
    assert not planned and same(first, again)
    layout.cu_seqlens.add_(0)  # in place: the version counter moves, the values stay
    changed, planned = call()
    assert planned and same(first, changed)
    monkeypatch.setenv("DUALKV_CUDA_PLAN_CACHE", "0")
    off, planned = call()
    assert planned and same(first, off)
    _check_against_reference(case, torch.bfloat16, first)


def test_build_ab_times_library_files(cuda_backend, tmp_path):
    """benchmarks.build_ab: each process loads the library file DUALKV_CUDA_LIBRARY names (the prebuilt
    one, copied under two names here), and the processes' times come back per build and layout."""
    import importlib.util

    spec = importlib.util.find_spec("dualkv.core._C")
    if spec is None or not spec.origin:
        pytest.skip("needs the prebuilt extension (this one was built just in time)")
    a, b = tmp_path / "a.so", tmp_path / "b.so"
    shutil.copyfile(spec.origin, a)
    shutil.copyfile(spec.origin, b)
    cmd = [sys.executable, "-m", "benchmarks.build_ab", "--libs", f"a={a},b={b}", "--forward", "--layouts",
           "2,256,128", "--processes", "2", "--rounds", "2", "--calls", "1", "--heads", "4,2", "--out", str(tmp_path),
           "--stem", "ab"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    result = json.loads((tmp_path / "ab.json").read_text())
    (row,) = result["rows"]
    assert row["layout"] == "(2,256,128)" and len(row["a_processes"]) == len(row["b_processes"]) == 2
    assert row["a"] > 0 and row["b"] > 0 and row["a_ratio"] == 1.0
    assert result["meta"]["libs"] == {"a": str(a.resolve()), "b": str(b.resolve())}
    assert (tmp_path / "ab.png").stat().st_size > 0


def test_env_ab_writes_rows_and_plot(cuda_backend, tmp_path):
    """benchmarks.env_ab --out: a row per layout with every value's samples and ratio, and the plot."""
    from benchmarks import env_ab

    env_ab.main(["--var", "DUALKV_CUDA_BWD_CHUNK_ROWS", "--values", "unset,0", "--layouts", "2,256,128;dec:1K,2",
                 "--heads", "4,2", "--rounds", "2", "--calls", "1", "--out", str(tmp_path), "--stem", "ab"])
    import json

    result = json.loads((tmp_path / "ab.json").read_text())
    assert [row["layout"] for row in result["rows"]] == ["(2,256,128)", "dec:1K,2"]
    for row in result["rows"]:
        assert row["unset_ratio"] == 1.0 and row["0"] > 0 and len(row["0_samples"]) == 2
    assert result["var"] == "DUALKV_CUDA_BWD_CHUNK_ROWS" and result["mode"] == "backward"
    assert (tmp_path / "ab.png").stat().st_size > 0


def _choose_hopper_kernels(monkeypatch, variable: str, mode: str | None, what: str) -> None:
    """Skip unless the GPU is sm_90; set the kernel-choice variable (None: unset, the default)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip(f"{what} needs an sm_90 GPU")
    if mode is None:
        monkeypatch.delenv(variable, raising=False)
    else:
        monkeypatch.setenv(variable, mode)


def _fwd_kernel(dtype: str, d: int, ws: bool, tma: bool, wide: bool = False, persistent: bool = False,
                merged: bool = False) -> str:
    """The profiler's name of the sm_90 forward kernel (dkv_fwd_sm90_kernel and its template flags, the
    trailing '>' included, so that a name with other flags never matches)."""
    flags = ", ".join(str(f).lower() for f in (ws, tma, wide, persistent, merged))
    return f"dkv_fwd_sm90_kernel<dkv::{dtype}, {d}, {flags}>"


def _dkdv_ws_kernel(dtype: str, d: int, dq: bool, split: bool, tma: bool, defer: bool = False, late: bool = False) -> str:
    """The profiler's name of the sm_90 warp-specialised dK/dV kernel (dkv_dkdv_sm90_ws_kernel and its
    template flags, the trailing '>' included, so that a name with other flags never matches)."""
    flags = ", ".join(str(f).lower() for f in (dq, split, tma, defer, late))
    return f"dkv_dkdv_sm90_ws_kernel<dkv::{dtype}, {d}, {flags}>"


def _choose_forward(monkeypatch, mode: str | None) -> None:
    """DUALKV_CUDA_WGMMA=mode (None: unset, the default)."""
    _choose_hopper_kernels(monkeypatch, "DUALKV_CUDA_WGMMA", mode, "the wgmma forward")


@pytest.mark.parametrize("mode", [None, "1", "2", "3", "3/128", "3p", "3p/128", "3m"],
                         ids=["default", "in-turn", "warp-specialised", "tma", "tma-128", "persistent", "persistent-128",
                              "merged-walk"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", [c for c in GRID if c[4] in (64, 128, 192, 256, 512)], ids=lambda c: _ids(c))
def test_wgmma_forward_matches_reference(cuda_backend, case, dtype, mode, monkeypatch):
    """The Hopper wgmma forward (csrc/dkv_fwd_sm90.cuh; d = 64 / 128 / 192 / 256 / 512, the default on
    sm_90) in its forms: in-turn with cp.async (DUALKV_CUDA_WGMMA=1; the one form at 512, which =2 runs
    too), warp-specialised with cp.async (=2) and with bulk tensor copies (=3, the default: the
    warp-specialised form at 64 / 128, the in-turn one at 192 / 256 / 512; at d = 128 with 176-key
    tiles, and with 128-key ones under DUALKV_CUDA_FWD_BLOCK_N=128; the other head dims keep theirs;
    "3m": the 176-key tiles walking context and own keys as one range, DUALKV_CUDA_FWD_MERGE=1), on the
    grid: out / lse / gradients (through the default backward) against the fp32 reference, and the
    profiler shows that the form asked for ran."""
    _choose_forward(monkeypatch, mode and mode[0])
    if mode and mode.endswith("/128"):
        monkeypatch.setenv("DUALKV_CUDA_FWD_BLOCK_N", "128")
    else:
        monkeypatch.delenv("DUALKV_CUDA_FWD_BLOCK_N", raising=False)
    if mode == "3m":
        monkeypatch.setenv("DUALKV_CUDA_FWD_MERGE", "1")
    else:
        monkeypatch.delenv("DUALKV_CUDA_FWD_MERGE", raising=False)
    persistent = mode is not None and mode.startswith("3p") and case[4] <= 128
    if persistent:
        monkeypatch.setenv("DUALKV_CUDA_FWD_PERSISTENT", "1")
    else:
        monkeypatch.delenv("DUALKV_CUDA_FWD_PERSISTENT", raising=False)
    r, kernels = _kernels_of(case, dtype)
    _check_against_reference(case, dtype, r)
    tma = mode is None or mode.startswith("3")
    ws = case[4] != 512 and (mode == "2" or (tma and case[4] <= 128))
    wide = mode in (None, "3", "3p", "3m") and case[4] == 128
    merged = mode == "3m" and wide
    form = _fwd_kernel("Bf16" if dtype == torch.bfloat16 else "Fp16", case[4], ws, tma, wide, persistent, merged)
    assert any(form in name for name in kernels), f"{form} did not run: {sorted(kernels)}"


def test_tma_forward_rejects_other_head_dims(cuda_backend, monkeypatch):
    """DUALKV_CUDA_WGMMA=3 (bulk tensor copies) at head dim 96, which has no wgmma forward, is an error
    naming the variable and the head dim (unset, d = 96 takes the mma.sync forward)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the TMA forward needs an sm_90 GPU")
    monkeypatch.setenv("DUALKV_CUDA_WGMMA", "3")
    with pytest.raises(RuntimeError, match="DUALKV_CUDA_WGMMA=3 .*expected headdim 64, 128, 192, 256 or 512, got 96"):
        _run_packed(([20], [[9]], 2, 1, 96, None, None), torch.float16, deterministic=False)


@pytest.mark.parametrize("mode", [None, "1", "2", "3"], ids=["default", "in-turn", "warp-specialised", "tma"])
@pytest.mark.parametrize("case", [([1000], [[300, 200]], 4, 2, 128, None, None), ([600], [[250]], 4, 2, 256, None, None),
                                  ([700], [[300, 41]], 4, 2, 128, None, 30.0), ([600], [[250, 3]], 4, 2, 512, None, None)],
                         ids=lambda c: _ids(c))
def test_wgmma_forward_with_growing_scores(cuda_backend, case, mode, monkeypatch):
    """Keys scaled up along the sequence (0.2x to 6x), so that later key tiles raise the row maximum far
    above the running one: the wgmma forward moves its running maximum only past a lag of 2^8 and must
    then rescale O and l; out / lse / gradients against the fp32 reference (bf16)."""
    _choose_forward(monkeypatch, mode)
    r = _run_packed(case, torch.bfloat16, deterministic=False, key_ramp=(0.2, 6.0))
    _check_against_reference(case, torch.bfloat16, r)


@pytest.mark.parametrize("mode", [None, "1", "2", "3", "4", "5", "6", "8", "6t", "8t", "9t", "6te"],
                         ids=["default", "in-turn", "overlap", "fused-dq", "ws", "ws-both", "ws-fused-dq", "ws-split",
                              "ws-fused-dq-tma", "ws-split-tma", "ws-deferred-dq-tma", "ws-fused-dq-tma-tile-add"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", [c for c in GRID if c[4] in (64, 128)], ids=lambda c: _ids(c))
def test_wgmma_backward_matches_reference(cuda_backend, case, dtype, deterministic, mode, monkeypatch):
    """The Hopper wgmma dQ and dK/dV kernels (csrc/dkv_bwd_sm90.cuh; d = 64 / 128): the default on sm_90
    (=6 at d = 64 and 128), DUALKV_CUDA_WGMMA_BWD=1 (the products of a tile in turn), =4 (the
    dK/dV kernel warp-specialised), =5 (both kernels warp-specialised), =2 (overlapped), =3 and =6 (dQ
    accumulated in the in-turn / warp-specialised dK/dV kernel, no dQ kernel; deterministic=True
    falls back to 5), =8 (5 with S^T and dP^T waited for apart; 5 itself under a softcap), and 6 / 8 with
    DUALKV_CUDA_BWD_TMA=1 (mode "6t" / "8t": the dK/dV kernel's loads as bulk tensor copies, the
    default; "6" / "8" set it to 0, the producer warpgroup's cp.async), =9 with it ("9t": 6 with each
    tile's dQ product deferred a tile; deterministic=True falls back to 5), "6te" (6t with
    DUALKV_CUDA_BWD_LATE_DQ_ADD=0: each tile's dQ reduce-add issued in the tile, not at the next one as by
    default), on the grid against the fp32 reference, in both accumulation modes, and the profiler
    shows which kernels ran."""
    tma = mode is None or "t" in mode
    if mode == "6te":
        monkeypatch.setenv("DUALKV_CUDA_BWD_LATE_DQ_ADD", "0")
    else:
        monkeypatch.delenv("DUALKV_CUDA_BWD_LATE_DQ_ADD", raising=False)
    _choose_hopper_kernels(monkeypatch, "DUALKV_CUDA_WGMMA_BWD", mode and mode[0], "the wgmma backward")
    if mode is None:
        monkeypatch.delenv("DUALKV_CUDA_BWD_TMA", raising=False)
    else:
        monkeypatch.setenv("DUALKV_CUDA_BWD_TMA", "1" if tma else "0")
    r, kernels = _kernels_of(case, dtype, deterministic)
    _check_against_reference(case, dtype, r)
    chosen = mode[0] if mode else "6"  # the default at d = 64 and 128
    fused = chosen in ("3", "6", "9") and not deterministic
    runs = "5" if chosen in ("3", "6", "9") and deterministic else chosen  # the schedule that runs
    dkdv = "dkv_dkdv_sm90_ws_kernel" if runs in ("4", "5", "6", "8", "9") else "dkv_dkdv_sm90_kernel"
    dq = "dkv_dq_sm90_ws_kernel" if runs in ("5", "8") else "dkv_dq_sm90_kernel"
    assert any(dkdv in name for name in kernels), f"the dK/dV kernel did not run: {sorted(kernels)}"
    if runs in ("5", "6", "8", "9"):  # the kernel's template flags: dQ inside (6, 9), split waits (8; 5's kernel
        split = runs == "8" and case[6] is None  # under a softcap), bulk tensor copies (6, 8 and 9 as such, when
        copies = tma and (runs in ("6", "9") or split)  # asked), the deferred dQ (9)
        name = _dkdv_ws_kernel("Bf16" if dtype == torch.bfloat16 else "Fp16", case[4], runs in ("6", "9"), split, copies,
                               runs == "9", copies and runs == "6" and mode != "6te")  # (6t) the late dQ add
        assert any(name in k for k in kernels), (name, sorted(kernels))
    if fused:  # no dQ kernel of any schedule
        assert not any("dkv_dq_" in name for name in kernels), sorted(kernels)
    else:
        assert any(dq in name for name in kernels), sorted(kernels)


@pytest.mark.parametrize("rows", ["0", "300", None], ids=["one-a-response", "300-rows", "default"])
@pytest.mark.parametrize("case", [([129, 7], [[300, 1, 250, 64, 400, 2], [90, 513]], 8, 2, 128, None, None),
                                  ([200], [[150, 260, 33, 128]], 4, 1, 64, 180, None)], ids=lambda c: _ids(c))
def test_reader_chunks_match_reference(cuda_backend, case, rows, monkeypatch):
    """The default backward with every response its own dK/dV item (DUALKV_CUDA_BWD_CHUNK_ROWS=0),
    chunks of about 300 rows (one to three responses, ragged) and the default (8192: a whole group),
    several groups, GQA and a window; reader_chunks gives the chunk ends of that layout."""
    if rows is None:
        monkeypatch.delenv("DUALKV_CUDA_BWD_CHUNK_ROWS", raising=False)
    else:
        monkeypatch.setenv("DUALKV_CUDA_BWD_CHUNK_ROWS", rows)
    r = _run_packed(case, torch.bfloat16, False)
    _check_against_reference(case, torch.bfloat16, r)
    meta = AttnMeta.from_layout(r["layout"])
    ends = torch.ops.dualkv_cuda.reader_chunks(meta.cu_seqlens, meta.seg_ctx_start, meta.seg_ctx_len, -1).tolist()
    S = len(ends)
    leaders = [s for s in range(S) if ends[s] > s]
    covered = sorted(t for s in leaders for t in range(s, ends[s]))
    assert covered == list(range(S)), ends  # the chunks split the segments
    n_leaders = {"0": S, "300": None, None: 2 * len(case[0])}[rows]  # default: each prompt, each group's responses
    assert n_leaders is None or len(leaders) == n_leaders, ends
    assert rows != "300" or S > len(leaders) > 2 * len(case[0]), ends


@pytest.mark.parametrize("variable", ["DUALKV_CUDA_TILE_ORDER", "DUALKV_CUDA_BWD_ITEM_ORDER"])
@pytest.mark.parametrize("head_dim", [64, 128, 256, 96])
def test_launch_order_changes_no_result(cuda_backend, head_dim, variable, monkeypatch):
    """The order of the work moves no result: the query tiles' launch order (DUALKV_CUDA_TILE_ORDER: a
    context's readers first by default, the layout's own order with 0) and the dK/dV items' order
    (DUALKV_CUDA_BWD_ITEM_ORDER: kv head major by default, a key tile's kv heads side by side with 0).
    Each tile and item is computed on its own, so the forward and the deterministic backward are bitwise
    equal in both orders; the default backward (fp32 atomics) matches the reference in both."""
    case = ([700, 129], [[300, 1, 250, 513], [90, 260]], 8, 2, head_dim, None, None)
    runs = {}
    for order in (None, "0"):
        if order is None:
            monkeypatch.delenv(variable, raising=False)
        else:
            monkeypatch.setenv(variable, order)
        runs[order] = _run_packed(case, torch.bfloat16, deterministic=True)
        _check_against_reference(case, torch.bfloat16, _run_packed(case, torch.bfloat16, deterministic=False))
    _check_against_reference(case, torch.bfloat16, runs[None])
    for name in ("out", "lse", "dq", "dk", "dv"):
        assert torch.equal(runs[None][name], runs["0"][name]), name


@pytest.mark.parametrize("tma", [None, "0"], ids=["default", "cp-async"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", [c for c in GRID if c[4] in (192, 256, 512)], ids=lambda c: _ids(c))
def test_wgmma_split_backward_matches_reference(cuda_backend, case, dtype, deterministic, tma, monkeypatch):
    """d = 192 / 256 / 512 on sm_90 by default: the wgmma dQ and dK/dV kernels with the warpgroups' roles
    split (csrc/dkv_bwd_sm90_split.cuh; at 512 16-key dQ tiles and two dK/dV passes over 16-row reader
    tiles), on the grid against the fp32 reference, in both accumulation modes, loading by bulk tensor
    copies (the default) or by cp.async (DUALKV_CUDA_BWD_TMA=0); the
    profiler shows that the form asked for ran and no mma.sync backward kernel did."""
    _choose_hopper_kernels(monkeypatch, "DUALKV_CUDA_WGMMA_BWD", None, "the wgmma backward")
    if tma is None:
        monkeypatch.delenv("DUALKV_CUDA_BWD_TMA", raising=False)
    else:
        monkeypatch.setenv("DUALKV_CUDA_BWD_TMA", tma)
    r, kernels = _kernels_of(case, dtype, deterministic)
    _check_against_reference(case, dtype, r)
    for kernel in ("dkv_dq_sm90_split_kernel", "dkv_dkdv_sm90_split_kernel"):
        form = f"{kernel}<dkv::{'Bf16' if dtype == torch.bfloat16 else 'Fp16'}, {case[4]}, {str(tma is None).lower()}>"
        assert any(form in name for name in kernels), f"{form} did not run: {sorted(kernels)}"
    assert not any(k in name for name in kernels for k in ("dkv_dq_kernel", "dkv_dkdv_kernel")), sorted(kernels)


def test_auto_takes_cuda_where_it_measured_faster(cuda_backend, monkeypatch):
    """backend="auto" on sm_90 with the wgmma kernels: the CUDA backend at head dims 192, 128 and 64, and
    at 256 its forward with Triton's (Gluon) backward where that can run, the packed layout without a
    window or softcap (with a window: the CUDA backend) (bf16; the profiler shows which kernels ran: the
    in-turn forward at 256 / 192 and the warp-specialised one at 128 and 64, all loading by bulk tensor
    copies, as the dK/dV kernels at 128 and 64 do; the result matches the reference); with
    DUALKV_CUDA_WGMMA_BWD=0 (no wgmma backward) Triton."""
    from dualkv.core import backends
    from dualkv.core.backends import resolve_backend

    hopper = torch.cuda.get_device_capability()[0] == 9
    dims = (256, 192, 128, 64)
    pair_at_256 = backends._triton_gluon_backward()
    for d in dims:
        want = "cuda+triton" if d == 256 and pair_at_256 else "cuda"
        assert (resolve_backend("auto", torch.empty(4, 2, d, device="cuda", dtype=torch.bfloat16)) == want) == hopper
    if hopper:
        plain_256 = ([200], [[100, 77]], 4, 2, 256, None, None)
        for case in [next(c for c in GRID if c[4] == d) for d in dims] + [plain_256]:
            d = case[4]
            pair = d == 256 and pair_at_256 and case[5] is None and case[6] is None
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                r = _run_packed(case, torch.bfloat16, deterministic=False, backend="auto")
            kernels = sorted({e.name for e in prof.events() if "kernel" in e.name})
            # warp-specialised at 64 / 128 (176-key tiles at 128), in turn at 192 / 256
            form = _fwd_kernel("Bf16", d, ws=d <= 128, tma=True, wide=d == 128)
            cuda_fwd = any(form in n for n in kernels)
            triton_fwd = any(n.startswith("fwd_kernel") for n in kernels)  # Triton names its kernels bare
            # a kernel only the chosen backward runs: the split dQ kernel above 128, else the ws dK/dV
            # kernel with dQ inside (schedule 6) with bulk tensor copies and the late dQ add
            bwd = ("dkv_dq_sm90_split_kernel" if d > 128
                   else _dkdv_ws_kernel("Bf16", d, dq=True, split=False, tma=True, late=True))
            assert (cuda_fwd, triton_fwd) == (True, False), kernels
            if pair:  # Triton's backward: its kernels carry bare names
                assert any(n.startswith(("dkdv", "dq_")) for n in kernels), kernels
                assert not any(bwd in n for n in kernels), kernels
            else:
                assert any(bwd in n for n in kernels), kernels
            _check_against_reference(case, torch.bfloat16, r)
        monkeypatch.setenv("DUALKV_CUDA_WGMMA_BWD", "0")
        for d in (256, 192, 128):
            assert resolve_backend("auto", torch.empty(4, 2, d, device="cuda", dtype=torch.bfloat16)) == "triton"


def test_auto_at_128_follows_the_prompt_length(cuda_backend):
    """backend="auto" at head dim 128 on sm_90 with Triton's Gluon backward: the CUDA backend below 16K-key
    prompts, its forward with Triton's backward from 16K (``AUTO_LONG_PROMPT``); the profiler shows the
    CUDA warp-specialised forward and Triton's fused dK/dV kernel (bare name) ran, not the CUDA backward,
    and the result matches the reference."""
    from dualkv.core import backends
    from dualkv.core.backends import resolve_backend

    if torch.cuda.get_device_capability()[0] != 9 or not backends._triton_gluon_backward():
        pytest.skip("the pair needs sm_90 and Triton's Gluon backward")
    q = torch.empty(4, 2, 128, device="cuda", dtype=torch.bfloat16)
    assert resolve_backend("auto", q, longest_prompt=16383) == "cuda"
    assert resolve_backend("auto", q, longest_prompt=16384) == "cuda+triton"
    case = ([16384, 300], [[64, 1, 129], [70]], 4, 2, 128, None, None)
    r, kernels = _kernels_of(case, torch.bfloat16, backend="auto")
    assert any(_fwd_kernel("Bf16", 128, ws=True, tma=True, wide=True) in n for n in kernels), sorted(kernels)
    assert any(n.startswith("dkdv_dq_ws_kernel") for n in kernels), sorted(kernels)
    assert not any("dkv_dkdv_sm90" in n for n in kernels), sorted(kernels)
    _check_against_reference(case, torch.bfloat16, r)


def test_auto_at_512(cuda_backend, monkeypatch):
    """backend="auto" at head dim 512 on sm_90: the CUDA backend with its wgmma forward and split
    backward kernels; with DUALKV_CUDA_WGMMA_BWD=0 (the mma.sync backward) Triton's forward with that
    backward. The profiler shows which kernels ran and the results match the reference. Elsewhere:
    Triton alone."""
    from dualkv.core.backends import resolve_backend

    hopper = torch.cuda.get_device_capability() == (9, 0)
    q512 = torch.empty(4, 2, 512, device="cuda", dtype=torch.bfloat16)
    assert resolve_backend("auto", q512) == ("cuda" if hopper else "triton")
    if not hopper:
        return
    case = next(c for c in GRID if c[4] == 512)
    for wgmma_bwd in (True, False):
        if not wgmma_bwd:
            monkeypatch.setenv("DUALKV_CUDA_WGMMA_BWD", "0")
            assert resolve_backend("auto", q512) == "triton+cuda"
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            r = _run_packed(case, torch.bfloat16, deterministic=False, backend="auto")
        kernels = sorted({e.name for e in prof.events() if "kernel" in e.name})
        triton_fwd = any(n.startswith("fwd_kernel") for n in kernels)  # Triton names its kernels bare
        cuda_fwd = any(_fwd_kernel("Bf16", 512, ws=False, tma=True) in n for n in kernels)  # bulk tensor copies
        assert (triton_fwd, cuda_fwd) == (not wgmma_bwd, wgmma_bwd), kernels
        bwd = "dkv_dkdv_sm90_split_kernel<dkv::Bf16, 512, true>" if wgmma_bwd else "dkv::dkv_dkdv_kernel"
        assert any(bwd in n for n in kernels), kernels
        _check_against_reference(case, torch.bfloat16, r)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("case", [GRID[0], GRID[4]], ids=lambda c: _ids(c))
def test_mma_sync_on_request(cuda_backend, case, deterministic, monkeypatch):
    """DUALKV_CUDA_WGMMA=0 and DUALKV_CUDA_WGMMA_BWD=0 select the mma.sync kernels (the sm_80 path) on
    any card, and they match the reference."""
    monkeypatch.setenv("DUALKV_CUDA_WGMMA", "0")
    monkeypatch.setenv("DUALKV_CUDA_WGMMA_BWD", "0")
    r, kernels = _kernels_of(case, torch.bfloat16, deterministic)
    _check_against_reference(case, torch.bfloat16, r)
    assert not any("_sm90_" in name for name in kernels), sorted(kernels)
    for kernel in ("dkv_fwd_kernel", "dkv_dq_kernel", "dkv_dkdv_kernel"):
        assert any(kernel in name for name in kernels), f"{kernel} did not run: {sorted(kernels)}"


@pytest.mark.parametrize("case", [GRID[0], GRID[3], GRID[4], GRID[8]], ids=lambda c: _ids(c))
def test_deterministic_mode_matches_reference_and_is_bitwise_stable(cuda_backend, case):
    r1 = _run_packed(case, torch.bfloat16, deterministic=True)
    _check_against_reference(case, torch.bfloat16, r1)
    r2 = _run_packed(case, torch.bfloat16, deterministic=True)
    for name in ("out", "dq", "dk", "dv"):
        assert torch.equal(r1[name], r2[name]), f"{name} differs between two deterministic runs"


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_seed_paper_signature_separate_context(cuda_backend, dtype, deterministic):
    """Two physically disjoint KV regions: the shared context in its own tensors, never copied."""
    P, lens, H, Hkv, d = 333, [77, 1, 200, 64], 8, 2, 128
    T = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = torch.randn(T, H, d, device="cuda", dtype=dtype, requires_grad=True)
    kd, vd = (torch.randn(T, Hkv, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
    kc, vc = (torch.randn(P, Hkv, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
    dout = torch.randn(T, H, d, device="cuda", dtype=dtype)
    scale = d ** -0.5
    out = flash_attn_dualkv_varlen_func(q, kc, vc, kd, vd, cu, cu, max(lens), P, max(lens), scale,
                                        deterministic=deterministic, backend="cuda")
    out.backward(dout)
    n = len(lens)
    i32 = dict(dtype=torch.int32, device="cuda")
    meta = AttnMeta(cu, torch.zeros(n, **i32), torch.full((n,), P, **i32), torch.zeros(1, **i32),
                    torch.full((1,), P, **i32), torch.zeros(1, **i32), torch.full((1,), T, **i32))
    ref_out, _, rgrads = fp32_reference(q.detach(), kd.detach(), vd.detach(), dout, meta, scale, None, None, kc.detach(), vc.detach())
    leaves = [t.detach().clone().requires_grad_() for t in (q, kd, vd, kc, vc)]
    lp = lowp_attention(leaves[0], leaves[1], leaves[2], meta, scale, None, None, leaves[3], leaves[4])
    lp.backward(dout)
    assert_close("out", out, ref_out, lp.detach(), dtype, 2)
    for name, t, ref, leaf in zip(("dq", "dk", "dv", "dk_ctx", "dv_ctx"), (q, kd, vd, kc, vc), rgrads, leaves):
        assert_close(name, t.grad, ref, leaf.grad, dtype, 3)


def test_cuda_and_triton_agree(cuda_backend):
    from dualkv.core.backends import available_backends

    if "triton" not in available_backends():
        pytest.skip("the triton backend is not available here")
    for case in (GRID[0], GRID[3], GRID[5]):
        rc = _run_packed(case, torch.bfloat16, deterministic=False, backend="cuda", seed=3)
        rt = _run_packed(case, torch.bfloat16, deterministic=False, backend="triton", seed=3)
        _check_against_reference(case, torch.bfloat16, rc)
        _check_against_reference(case, torch.bfloat16, rt)
        for name in ("out", "dq", "dk", "dv"):
            scale = rc[name].float().abs().max().item()
            assert max_err(rc[name], rt[name]) <= 0.05 * max(scale, 1.0), f"{name}: cuda and triton disagree"


def test_unsupported_inputs_raise(cuda_backend):
    layout = PackedLayout.from_lengths([5], [[3]], device="cuda")
    q = torch.randn(layout.total_tokens, 2, 80, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="q: the cuda backend supports headdim"):
        dualkv_attention(q, q[:, :1], q[:, :1], layout, backend="cuda")
    q = torch.randn(layout.total_tokens, 2, 64, device="cuda", dtype=torch.float32)
    with pytest.raises(ValueError, match="q: the cuda backend supports float16 and bfloat16"):
        dualkv_attention(q, q[:, :1], q[:, :1], layout, backend="cuda")


def test_non_contiguous_inputs(cuda_backend):
    """Strided q/k/v views (e.g. slices of a fused qkv projection) give the same result."""
    case = GRID[3]
    prompts, responses, H, Hkv, d, _, _ = case
    layout = PackedLayout.from_lengths(prompts, responses, device="cuda")
    T = layout.total_tokens
    qkv = torch.randn(T, H + 2 * Hkv, d, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv[:, :H], qkv[:, H:H + Hkv], qkv[:, H + Hkv:]
    a = dualkv_attention(q, k, v, layout, backend="cuda")
    b = dualkv_attention(q.contiguous(), k.contiguous(), v.contiguous(), layout, backend="cuda")
    assert torch.equal(a, b)


# ------------------------------------------------------------------------------------ sanitizer
SANITIZER_SCRIPT = textwrap.dedent(
    """
    import torch
    from dualkv.core import PackedLayout, dualkv_attention, flash_attn_dualkv_varlen_func
    torch.manual_seed(0)
    cases = ((64, False, None), (128, True, 40), (128, False, None), (256, False, None), (512, False, None), (512, True, 30))
    for d, det, window in cases:
        layout = PackedLayout.from_lengths([70, 5], [[33, 9], [17]], device="cuda")
        T = layout.total_tokens
        q = torch.randn(T, 4, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(T, 2, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(T, 2, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dualkv_attention(q, k, v, layout, window=window, deterministic=det, backend="cuda").sum().backward()
    cu = torch.tensor([0, 21, 50], dtype=torch.int32, device="cuda")
    q = torch.randn(50, 4, 64, device="cuda", dtype=torch.float16, requires_grad=True)
    kd, vd = (torch.randn(50, 2, 64, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(2))
    kc, vc = (torch.randn(45, 2, 64, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(2))
    flash_attn_dualkv_varlen_func(q, kc, vc, kd, vd, cu, cu, 29, 45, 29, backend="cuda").sum().backward()
    torch.cuda.synchronize()
    print("sanitizer script done")
    """
)


# Kernel paths under the sanitizer: the defaults (on sm_90 the wgmma forward and backward), the opt-in
# Hopper forms (the in-turn forward with the overlapped wgmma backward; the warp-specialised forward at
# every head dim, 256 included, where it is opt-in, with cp.async at 64 / 128 (the bulk tensor copies,
# DUALKV_CUDA_WGMMA=3, are the default forward at every wgmma head dim); the in-turn and the
# warp-specialised dK/dV kernels that also accumulate dQ; the warp-specialised dK/dV kernel with the
# in-turn dQ kernel; both warp-specialised; the default schedules' dK/dV kernels with cp.async, where
# the default has bulk tensor copies; the fused-dQ kernel with dQ deferred a tile, whose consumers
# exchange dS through mbarriers; the persistent TMA forward, whose rings run on across query tiles; the
# forward walking context and own keys as one range (its shared tile loaded as 16-row boxes);
# every backward kernel's cp.async form, the split ones at d = 256
# included) and the mma.sync kernels; all but the first differ from
# the defaults only on an sm_90 GPU.
SANITIZER_PATHS = {"default": {}, "hopper-opt-in": {"DUALKV_CUDA_WGMMA": "1", "DUALKV_CUDA_WGMMA_BWD": "2"},
                   "ws-forward": {"DUALKV_CUDA_WGMMA": "2"}, "forward-128": {"DUALKV_CUDA_FWD_BLOCK_N": "128"},
                   "persistent-forward": {"DUALKV_CUDA_FWD_PERSISTENT": "1"}, "merged-forward": {"DUALKV_CUDA_FWD_MERGE": "1"},
                   "fused-dq": {"DUALKV_CUDA_WGMMA_BWD": "3"}, "ws-dkdv": {"DUALKV_CUDA_WGMMA_BWD": "4"},
                   "ws-both": {"DUALKV_CUDA_WGMMA_BWD": "5"}, "ws-fused-dq": {"DUALKV_CUDA_WGMMA_BWD": "6", "DUALKV_CUDA_BWD_TMA": "0"},
                   "ws-split": {"DUALKV_CUDA_WGMMA_BWD": "8", "DUALKV_CUDA_BWD_TMA": "0"},
                   "ws-deferred-dq": {"DUALKV_CUDA_WGMMA_BWD": "9"}, "cp-async-bwd": {"DUALKV_CUDA_BWD_TMA": "0"},
                   "tile-dq-add": {"DUALKV_CUDA_BWD_LATE_DQ_ADD": "0"},
                   "mma-sync": {"DUALKV_CUDA_WGMMA": "0", "DUALKV_CUDA_WGMMA_BWD": "0"}}


@pytest.mark.parametrize("paths", list(SANITIZER_PATHS))
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_compute_sanitizer_small_case(cuda_backend, tool, paths, tmp_path):
    sanitizer = compute_sanitizer()
    if sanitizer is None:
        pytest.skip("compute-sanitizer is not installed")
    if paths != "default" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("these paths differ from the defaults only on an sm_90 GPU")
    script = tmp_path / "case.py"
    script.write_text(SANITIZER_SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("DUALKV_CUDA_WGMMA", None)
    env.pop("DUALKV_CUDA_WGMMA_BWD", None)
    env.pop("DUALKV_CUDA_FWD_PERSISTENT", None)
    env.pop("DUALKV_CUDA_FWD_MERGE", None)
    env.pop("DUALKV_CUDA_BWD_LATE_DQ_ADD", None)
    env.update(SANITIZER_PATHS[paths])
    base = [sanitizer, "--tool", tool, "--error-exitcode", "3"]
    cmd = [*base, "--kernel-name", "kns=dkv_", sys.executable, str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0 and "kernel-name" in (proc.stdout + proc.stderr) and "ERROR SUMMARY" not in proc.stdout:
        proc = subprocess.run([*base, sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=900)
    check_sanitizer_log(proc, "sanitizer script done")
