"""CPU tests of the benchmark harness: formulas, config parsing, timing, the results writer and plots,
the cascade's LSE merge and backward (with pure-PyTorch pieces), the replicated view, and the
reference provider end to end at a tiny shape."""

import json
import math
import os
import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: ``benchmarks``

from benchmarks import bench_attention, peers, report  # noqa: E402
from benchmarks.harness import (  # noqa: E402
    AttnConfig, Provider, Timer, attended_pairs, attention_bytes, attention_flops, dense_attention, dense_mask,
    fmt_size, parse_size, register, replicated_pairs, run_case, validate_provider,
)
from dualkv.core import PackedLayout, reference_attention  # noqa: E402

CPU = torch.device("cpu")


# ------------------------------------------------------------------------------- sizes and configs
@pytest.mark.parametrize("text, n", [("4K", 4096), ("128k", 131072), ("512", 512), ("1.5K", 1536), (7, 7)])
def test_parse_size(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("bad", ["", "K", "1.3", "-2K", "abc"])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError, match="size"):
        parse_size(bad)


def test_fmt_size_round_trips():
    for n in (512, 2048, 4096, 131072, 777):
        assert parse_size(fmt_size(n)) == n


def test_config_parse_both_forms():
    a = AttnConfig.parse("28,4K,2K", H=32, H_kv=8, d=128)
    assert (a.N, a.P, a.R, a.H, a.H_kv, a.d) == (28, 4096, 2048, 32, 8, 128)
    b = AttnConfig.parse("N=16,P=32K,R=2K,H=16,hkv=8,d=256")
    assert (b.N, b.P, b.R, b.H, b.H_kv, b.d) == (16, 32768, 2048, 16, 8, 256)
    assert b.label == "16, 32K, 2K" and "d256" in b.name
    assert a.tokens == 4096 + 28 * 2048 and a.replicated_tokens == 28 * (4096 + 2048)
    assert a.rho == pytest.approx(a.layout(CPU).rho)


@pytest.mark.parametrize("bad, match", [("1,2", "N,P,R"), ("N=1,P=2", "lacks"), ("N=1,P=2,R=3,Q=4", "unknown key"),
                                         ("N=1,P=2,R=3,H=6,H_kv=4", "H_kv")])
def test_config_parse_rejects(bad, match):
    with pytest.raises(ValueError, match=match):
        AttnConfig.parse(bad)


def test_presets_are_the_issue_table():
    got = [(c.N, c.P, c.R) for c in bench_attention.PRESETS["issue3"]]
    K = 1024
    assert got == [(28, 4 * K, 2 * K), (28, 16 * K, 2 * K), (16, 32 * K, 2 * K), (16, 64 * K, 2 * K), (32, 8 * K, 2 * K),
                   (8, 16 * K, 512), (16, 128 * K, 2 * K)]
    assert all((c.H, c.H_kv, c.d, c.dtype) == (32, 8, 128, "bfloat16") for c in bench_attention.PRESETS["issue3"])
    assert {(c.H, c.H_kv, c.d) for c in bench_attention.PRESETS["d512"]} == {(16, 2, 512)}
    assert {(c.H, c.H_kv, c.d) for c in bench_attention.PRESETS["d192"]} == {(16, 8, 192)}
    assert [c.d for c in bench_attention.PRESETS["all"]] == [128] * 7 + [192] * 2 + [256] * 2 + [512] * 2


# ---------------------------------------------------------------------------------------- formulas
@pytest.mark.parametrize("prompts, responses", [([5], [[3, 1, 4]]), ([1, 7], [[2], [1, 1, 9]]), ([13], [[1]])])
def test_pairs_match_the_mask(prompts, responses):
    layout = PackedLayout.from_lengths(prompts, responses)
    assert attended_pairs(prompts, responses) == int(dense_mask(layout).sum())
    brute = sum((p + r) * (p + r + 1) // 2 for p, rs in zip(prompts, responses) for r in rs)
    assert replicated_pairs(prompts, responses) == brute


def test_flops_and_bytes_formulas():
    cfg = AttnConfig(N=2, P=4, R=3, H=4, H_kv=2, d=8)
    pairs = 4 * 5 // 2 + 2 * (4 * 3 + 3 * 4 // 2)  # 10 + 2 * 18 = 46
    assert attended_pairs(cfg.prompt_lens, cfg.response_lens) == pairs
    assert attention_flops(cfg, "fwd") == 4 * 8 * 4 * pairs
    assert attention_flops(cfg, "bwd") == 2.5 * attention_flops(cfg, "fwd")
    assert attention_flops(cfg, "fwdbwd") == 3.5 * attention_flops(cfg, "fwd")
    T = 10
    q, kv = T * 4 * 8, T * 2 * 8
    assert attention_bytes(cfg, "fwd") == 2 * (2 * q + 2 * kv) + 4 * 4 * T
    assert attention_bytes(cfg, "bwd") == 2 * (4 * q + 4 * kv) + 4 * 4 * T
    assert attention_bytes(cfg, "fwdbwd") == attention_bytes(cfg, "fwd") + attention_bytes(cfg, "bwd")


def test_issue_table_useful_flops():
    """(28, 4K, 2K), d=128, H=32: the count behind the peer table's TFLOP/s (e.g. 48 ms <-> ~362)."""
    cfg = bench_attention.PRESETS["issue3"][0]
    assert attention_flops(cfg, "fwdbwd") / 48e-3 / 1e12 == pytest.approx(362, rel=0.01)


def test_dense_attention_matches_reference():
    layout = PackedLayout.from_lengths([9, 4], [[3, 1], [5]])
    q = torch.randn(layout.total_tokens, 4, 16)
    k, v = torch.randn(2, layout.total_tokens, 2, 16)
    ref = reference_attention(q, k, v, layout, softmax_scale=0.25)
    torch.testing.assert_close(dense_attention(q, k, v, dense_mask(layout), 0.25), ref, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------ timing
def test_timer_cpu_median_and_budget():
    calls = []
    timer = Timer(CPU, budget_ms=5.0, max_reps=4)
    t = timer.measure(lambda: calls.append(sum(range(20000))))
    assert 1 <= len(calls) - 1 <= 3 and t.reps >= 1 and t.median_ms > 0
    assert t.median_ms == pytest.approx(sorted(t.times_ms)[len(t.times_ms) // 2], rel=1) and len(t.times_ms) == t.reps
    # busy_ms: every call's time, the first (estimating) call's too, counted once where it joins the median
    if len(calls) - 1 < 3:  # the first call's time is among times_ms
        assert t.busy_ms == pytest.approx(sum(t.times_ms))
    else:
        assert t.busy_ms > sum(t.times_ms)


def test_timer_cpu_reports_host_time_and_timing_line():
    from benchmarks.report import timing_lines

    t = Timer(CPU, budget_ms=5.0, max_reps=3).measure(lambda: sum(range(20000)))
    assert t.host_ms > 0 and t.host_exposed == 0
    assert not Timer(CPU, hide_host=True).hide_host  # only a GPU has a device time to separate
    assert timing_lines([{"fwd_ms": 1.0}]) == []  # rows from before host times were recorded
    visible = timing_lines([{"fwd_host_ms": 0.25}, {"fwd_host_ms": 0.5, "bwd_host_ms": 1.0}])[0]
    assert visible.startswith("Timing `host-visible`") and "0.25-1.00 ms" in visible
    device = timing_lines([{"fwd_host_ms": 0.3, "fwd_host_exposed": 0}, {"fwd_host_ms": 0.4, "fwd_host_exposed": 2}])[0]
    assert device.startswith("Timing `device`") and "2 timed calls" in device


# ------------------------------------------------------------------------------- cascade, on CPU
class TorchPiece:
    """A pure-PyTorch stand-in for one FA2/cuDNN piece (same fwd/bwd contract, lse (H, S_q) fp32),
    varlen with bottom-right causal alignment, explicit backward from the out and lse given."""

    def __init__(self, cu_q, cu_k, causal, scale):
        self.cu_q, self.cu_k, self.causal, self.scale = list(cu_q), list(cu_k), causal, scale

    def _mask(self):
        m = torch.zeros(self.cu_q[-1], self.cu_k[-1], dtype=torch.bool)
        for (qa, qe), (ka, ke) in zip(zip(self.cu_q, self.cu_q[1:]), zip(self.cu_k, self.cu_k[1:])):
            block = torch.ones(qe - qa, ke - ka, dtype=torch.bool)
            if self.causal:
                i, j = torch.arange(qe - qa)[:, None], torch.arange(ke - ka)[None, :]
                block = j <= i + (ke - ka) - (qe - qa)
            m[qa:qe, ka:ke] = block
        return m

    def _scores(self, q, k):
        rep = q.shape[1] // k.shape[1]
        s = torch.einsum("qhd,khd->hqk", q.float(), k.float().repeat_interleave(rep, 1)) * self.scale
        return s.masked_fill(~self._mask(), -math.inf), rep

    def fwd(self, q, k, v):
        s, rep = self._scores(q, k)
        lse = torch.logsumexp(s, -1)
        out = torch.einsum("hqk,khd->qhd", torch.exp(s - lse[..., None]), v.float().repeat_interleave(rep, 1))
        return out.to(q.dtype), lse, None

    def bwd(self, dout, q, k, v, out, lse, state):
        s, rep = self._scores(q, k)
        p = torch.exp(s - lse[..., None])
        do = dout.float()
        delta = (do * out.float()).sum(-1).t()  # (H, S_q)
        vv = v.float().repeat_interleave(rep, 1)
        dv = torch.einsum("hqk,qhd->khd", p, do)
        ds = p * (torch.einsum("qhd,khd->hqk", do, vv) - delta[..., None]) * self.scale
        dq = torch.einsum("hqk,khd->qhd", ds, k.float().repeat_interleave(rep, 1))
        dk = torch.einsum("hqk,qhd->khd", ds, q.float())
        fold = lambda x: x.view(x.shape[0], -1, rep, x.shape[2]).sum(2)  # noqa: E731
        return dq.to(q.dtype), fold(dk).to(k.dtype), fold(dv).to(v.dtype)


@pytest.mark.parametrize("expand", [False, True])
def test_cascade_merge_and_backward_exact(expand):
    P, rs, H, Hkv, d = 11, [5, 1, 7], 4, 2, 16
    layout = PackedLayout.from_lengths([P], [rs])
    T, NR, scale = layout.total_tokens, sum(rs), 0.3
    cu_r = [0] + torch.tensor(rs).cumsum(0).tolist()
    plan = peers.CascadePlan(P, H // Hkv, TorchPiece([0, P], [0, P], True, scale), TorchPiece([0, NR], [0, P], False, scale),
                             TorchPiece(cu_r, cu_r, True, scale), expand=expand)
    q = torch.randn(T, H, d, requires_grad=True)
    k, v = (torch.randn(T, Hkv, d, requires_grad=True) for _ in range(2))
    dout = torch.randn(T, H, d)
    out = peers.cascade_attention(q, k, v, plan)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref = reference_attention(q, k, v, layout, softmax_scale=scale)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------- replicated view, on CPU
@register("test-torch-replicated")
class TorchReplicated(peers._Replicated):
    """Plain causal attention per replicated row (tests the gather / to_packed / gradient path)."""

    def forward(self, q, k, v):
        rep = self.cfg.H // self.cfg.H_kv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        out = torch.nn.functional.scaled_dot_product_attention(self._rows(q), self._rows(k), self._rows(v), is_causal=True,
                                                               scale=self.scale)
        return out.transpose(1, 2).reshape(q.shape)


def test_replicated_provider_validates():
    cfg = AttnConfig(N=3, P=37, R=11, H=4, H_kv=2, d=16)
    rep = validate_provider("test-torch-replicated", cfg, CPU)
    assert rep["ok"] is True, rep
    prov = TorchReplicated(cfg, cfg.layout(CPU), CPU)
    assert prov.index.numel() == cfg.replicated_tokens and Provider.computed_pairs.__func__(TorchReplicated, cfg) == \
        replicated_pairs(cfg.prompt_lens, cfg.response_lens)


def test_flex_forward_mask_on_cpu():
    """FlexAttention's shared-prompt block mask (forward only: no CPU backward) against the reference."""
    cfg = AttnConfig(N=3, P=130, R=70, H=4, H_kv=2, d=16, dtype="float32")
    layout = cfg.layout(CPU)
    prov = peers.FlexPacked(cfg, layout, CPU)
    q = torch.randn(cfg.tokens, 4, 16)
    k, v = torch.randn(2, cfg.tokens, 2, 16)
    with torch.no_grad():
        out = prov.forward(q, k, v)
    torch.testing.assert_close(out, reference_attention(q, k, v, layout), atol=2e-5, rtol=2e-5)
    prov.close()


# -------------------------------------------------------------------------------- results, plots
def _fake_rows():
    cfg = bench_attention.PRESETS["quick"][0]
    base = dict(config=cfg.name, label=cfg.label, N=cfg.N, P=cfg.P, R=cfg.R, H=cfg.H, H_kv=cfg.H_kv, d=cfg.d,
                dtype=cfg.dtype, T=cfg.tokens, T_rep=cfg.replicated_tokens, rho=cfg.rho, pairs=1)
    ok = dict(base, provider="dualkv-triton", status="ok", fwd_ms=10.0, bwd_ms=25.0, fwdbwd_ms=35.0, fwd_tflops=400.0,
              bwd_tflops=400.0, fwdbwd_tflops=400.0, fwd_reps=5, bwd_reps=5, fwdbwd_reps=5, peak_extra_gib=1.5)
    oom = dict(base, provider="fa2-replicated", status="OOM")
    skip = dict(base, provider="cudnn-replicated", status="skipped: planned 30 s per fwd+bwd call > --max-est-s 10")
    return [ok, oom, skip]


def test_writer_tables_and_plots(tmp_path, monkeypatch):
    for name in report.run_settings():
        monkeypatch.delenv(name)
    monkeypatch.setenv("DUALKV_CUDA_BWD_ITEM_ORDER", "0")  # a setting the run depends on: recorded and shown
    meta = report.environment(CPU, "benchmarks.bench_attention", ["--preset", "quick"])
    assert meta["command"] == "python -m benchmarks.bench_attention --preset quick"
    assert meta["env"] == {"DUALKV_CUDA_BWD_ITEM_ORDER": "0"}
    assert meta["versions"]["torch"] == torch.__version__ and meta["date"] and meta["card"]["name"]
    writer = report.ResultWriter(tmp_path, "fake", meta)
    for row in _fake_rows():
        writer.add(row)
    paths = writer.finish()
    assert {p.suffix for p in paths} == {".json", ".csv", ".md", ".png"} and all(p.exists() for p in paths)
    data = json.loads((tmp_path / "fake.json").read_text())
    assert data["meta"]["command"] == meta["command"] and len(data["rows"]) == 3
    md = (tmp_path / "fake.md").read_text()
    assert "| 28, 4K, 2K |" in md and "35.0 (400)" in md and "OOM" in md and "skipped" in md
    assert "`DUALKV_CUDA_BWD_ITEM_ORDER=0 python -m benchmarks.bench_attention --preset quick`" in md
    csv_text = (tmp_path / "fake.csv").read_text().splitlines()
    assert csv_text[0].startswith("config,label") and csv_text[0].endswith("card,date,command") and len(csv_text) == 4


def test_writer_shows_only_measured_modes(tmp_path):
    """A forward-only run (--modes fwd) gets a forward table, no forward+backward or backward table."""
    meta = report.environment(CPU, "benchmarks.bench_attention", ["--modes", "fwd"])
    writer = report.ResultWriter(tmp_path, "fwd_only", meta)
    row = dict(_fake_rows()[0], bwd_ms=None, fwdbwd_ms=None, bwd_tflops=None, fwdbwd_tflops=None)
    writer.add(row)
    writer.finish()
    md = (tmp_path / "fwd_only.md").read_text()
    assert "; forward, ms" in md and "forward+backward, ms" not in md and "; backward, ms" not in md
    assert f"{row['fwd_ms']:.1f} ({row['fwd_tflops']:.0f})" in md


def test_merge_prefers_measured_rows(tmp_path):
    rows = _fake_rows()
    first = dict(meta=dict(date="a", command="x"), rows=[rows[0]])
    later = dict(meta=dict(date="b", command="y"), rows=[dict(rows[0], status="not run: --deadline-s reached"), rows[1]])
    merged = {r["provider"]: r for r in report.merged_rows([first, later])}
    assert merged["dualkv-triton"]["status"] == "ok" and merged["dualkv-triton"]["_date"] == "a"
    assert merged["fa2-replicated"]["status"] == "OOM"


# ------------------------------------------------------------------------ end to end, reference
def _provider_env(monkeypatch, cls, names, cfg, layout, qkv) -> tuple:
    """The variables ``names`` after one forward of provider ``cls`` (on the reference, any device),
    each set to a stale value first: what the provider leaves for its kernels to read."""
    for var in names:
        monkeypatch.setenv(var, "stale")
    type("Probe", (cls,), {"backend": "reference"})(cfg, layout, CPU).forward(*qkv)
    return tuple(os.environ.get(var) for var in names)


def test_cuda_kernel_variants_set_their_environment(monkeypatch):
    """The CUDA variants select kernel paths through the binding's environment variables, set before
    each forward (a variable a provider does not set is unset, so none inherits the variant timed
    before it); on a machine without CUDA the CUDA ones answer unsupported."""
    from benchmarks import harness

    cfg = bench_attention.AttnConfig.parse("N=2,P=40,R=9,H=4,H_kv=2,d=32,dtype=float32")
    layout = cfg.layout(CPU)
    expect = {"dualkv-auto": (None, None, None), "dualkv-triton": (None, None, None), "reference": (None, None, None),
              "dualkv-cuda": (None, None, None), "dualkv-cuda-mma": ("0", "0", None), "dualkv-cuda-mma-bwd": (None, "0", None),
              "dualkv-cuda-ws": ("2", None, None), "dualkv-cuda-tma-fwd": ("3", None, None),
              "dualkv-cuda-tma-bwd": (None, None, "1"), "dualkv-cuda-cp-async-bwd": (None, None, "0"),
              "dualkv-cuda-in-turn-fwd": ("1", None, None),
              "dualkv-cuda-wgmma-bwd": (None, "1", None),
              "dualkv-cuda-wgmma-bwd-overlap": (None, "2", None), "dualkv-cuda-fused-dq": (None, "3", None),
              "dualkv-pair-fused-dq": (None, "3", None), "dualkv-cuda-ws-bwd": (None, "4", None), "dualkv-pair-ws-bwd": (None, "4", None),
              "dualkv-pair-in-turn-bwd": (None, "1", None), "dualkv-pair-ws-both-bwd": (None, "5", None),
              "dualkv-cuda-ws-both-bwd": (None, "5", None), "dualkv-cuda-ws-fused-dq": (None, "6", None),
              "dualkv-pair-ws-fused-dq": (None, "6", None), "dualkv-cuda-ws-split-bwd": (None, "8", None),
              "dualkv-pair-ws-split-bwd": (None, "8", None)}
    q, k, v = harness._random_qkv(cfg, CPU, 0)
    for name, (fwd, bwd, tma) in expect.items():
        cls = harness.get_provider(name)
        backend = "triton+cuda" if "pair" in name else name.removeprefix("dualkv-").split("-")[0]
        assert cls.backend == backend and name in report.PROVIDER_ORDER
        if not torch.cuda.is_available() and "cuda" in backend:
            assert "CUDA device" in cls.unsupported(cfg, CPU)
        names = ("DUALKV_CUDA_WGMMA", "DUALKV_CUDA_WGMMA_BWD", "DUALKV_CUDA_BWD_TMA")
        assert _provider_env(monkeypatch, cls, names, cfg, layout, (q, k, v)) == (fwd, bwd, tma), name


def test_triton_kernel_variants_set_their_environment(monkeypatch):
    """The Triton variants select their kernels through environment variables set before each
    forward; a variable a provider does not name is unset, so none inherits the variant before it."""
    from benchmarks import harness

    cfg = bench_attention.AttnConfig.parse("N=2,P=40,R=9,H=4,H_kv=2,d=32,dtype=float32")
    layout = cfg.layout(CPU)
    names = ("DUALKV_TRITON_WS", "DUALKV_TRITON_GLUON_FWD", "DUALKV_TRITON_GLUON_BWD", "DUALKV_TRITON_GLUON_DKDV",
             "DUALKV_TRITON_ATOMIC_DQ")
    expect = {"dualkv-triton": (None,) * 5, "dualkv-triton-no-ws": ("0", None, None, None, None),
              "dualkv-triton-tl-fwd": (None, "0", None, None, None), "dualkv-triton-tl-bwd": (None, None, "0", None, None),
              "dualkv-triton-gluon-dkdv": (None, None, "0", "1", None),
              "dualkv-triton-fused-dq": (None, None, "0", "1", "1")}
    q, k, v = harness._random_qkv(cfg, CPU, 0)
    for name, want in expect.items():
        cls = harness.get_provider(name)
        assert cls.backend == "triton" and name in report.PROVIDER_ORDER
        assert _provider_env(monkeypatch, cls, names, cfg, layout, (q, k, v)) == want, name


def test_reference_provider_end_to_end(tmp_path):
    """The reference and dualkv-auto (the reference on CPU tensors) run and validate; a CUDA-only peer
    is reported unsupported."""
    path = bench_attention.main(["--preset", "tiny", "--device", "cpu", "--providers", "reference,dualkv-auto,fa2-cascade",
                                 "--validate", "--validation-shape", "2,97,33", "--out", str(tmp_path), "--stem", "tiny",
                                 "--budget-ms", "5", "--max-reps", "2"])
    data = json.loads(Path(path).read_text())
    rows = {r["provider"]: r for r in data["rows"]}
    ref = rows["reference"]
    assert ref["status"] == "ok", ref
    for mode in ("fwd", "bwd", "fwdbwd"):
        assert ref[f"{mode}_ms"] > 0 and ref[f"{mode}_tflops"] > 0
    assert rows["dualkv-auto"]["status"] == "ok", rows["dualkv-auto"]
    assert rows["fa2-cascade"]["status"].startswith("unsupported")
    assert [v["ok"] for v in data["validation"]] == [True, True, None]
    assert (tmp_path / "tiny_tflops.png").exists() and (tmp_path / "tiny.md").exists()


def test_run_case_records_the_clock_of_each_timed_mode(tmp_path):
    """With a GPU monitor, each timed mode's row gets the median SM clock and power of the samples taken
    while it ran (here a stand-in monitor whose window reports its bounds); the markdown names the range."""
    from benchmarks.report import write_markdown

    class Monitor:
        def __init__(self):
            self.windows = []

        def window(self, t0, t1):
            self.windows.append((t0, t1))
            return dict(sm_clock_mhz=1600.0 + 100 * len(self.windows), power_w=650.0, samples=3)

    mon = Monitor()
    row = run_case(AttnConfig(N=1, P=3, R=2, H=2, H_kv=1, d=8), "reference", CPU, Timer(CPU, budget_ms=5, max_reps=2),
                   monitor=mon)
    assert row["status"] == "ok" and "spans" not in row
    assert [row[f"{m}_clock_mhz"] for m in ("fwd", "bwd", "fwdbwd")] == [1700.0, 1800.0, 1900.0]
    assert row["fwdbwd_power_w"] == 650.0
    (f0, f1), (b0, b1), (w0, w1) = mon.windows  # one stretch per mode, in the order they were timed
    assert f0 < f1 <= b0 < b1 <= w0 < w1
    # the timed calls' share of each stretch: the backward's untimed forward (its setup) leaves a gap
    assert all(0 < row[f"{m}_busy"] <= 1 for m in ("fwd", "bwd", "fwdbwd"))
    plain = run_case(AttnConfig(N=1, P=3, R=2, H=2, H_kv=1, d=8), "reference", CPU, Timer(CPU, budget_ms=5, max_reps=2))
    assert "fwd_clock_mhz" not in plain
    md = write_markdown(tmp_path / "clocks.md", [dict(meta={}, rows=[row])]).read_text()
    assert "SM clock while forward+backward was timed: 1900-1900 MHz" in md
    assert f"The timed calls filled {row['fwdbwd_busy']:.0%}-{row['fwdbwd_busy']:.0%} of each row's" in md
    assert "SM clock" not in write_markdown(tmp_path / "plain.md", [dict(meta={}, rows=[plain])]).read_text()


def test_rows_record_the_spread_of_their_repeats(tmp_path):
    """Each timed mode's row holds its fastest and slowest repeat; the markdown states the widest spread
    and names the rows whose repeats spread past 1.10x (a kernel in two modes), and only those."""
    from benchmarks.report import spread_lines, write_markdown

    row = run_case(AttnConfig(N=1, P=3, R=2, H=2, H_kv=1, d=8), "reference", CPU, Timer(CPU, budget_ms=5, max_reps=3))
    for m in ("fwd", "bwd", "fwdbwd"):
        assert 0 < row[f"{m}_min_ms"] <= row[f"{m}_ms"] <= row[f"{m}_max_ms"]
    steady = dict(config="a", provider="p", status="ok", fwdbwd_min_ms=100.0, fwdbwd_max_ms=104.0)
    bimodal = dict(config="b", provider="q", status="ok", fwdbwd_min_ms=362.0, fwdbwd_max_ms=597.0)
    failed = dict(config="c", provider="r", status="OOM")
    text = " ".join(spread_lines([steady, bimodal, failed]))
    assert "up to 1.65x its fastest" in text and "b q 362.00-597.00 ms" in text and "a p" not in text
    assert "Wider than" not in " ".join(spread_lines([steady]))
    assert spread_lines([failed]) == []
    two_modes = dict(row, fwdbwd_min_ms=362.0, fwdbwd_max_ms=597.0)
    md = write_markdown(tmp_path / "spread.md", [dict(meta={}, rows=[two_modes])]).read_text()
    assert f"{row['config']} reference 362.00-597.00 ms" in md


def test_host_time_benchmark_smoke(tmp_path, capsys, monkeypatch):
    """bench_host times dualkv_attention's layers per call and writes its table and plot, leaving the
    launch-plan setting as it found it; bad arguments are usage errors naming the flag."""
    from benchmarks import bench_host

    monkeypatch.setenv("DUALKV_CUDA_PLAN_CACHE", "1")
    path = bench_host.main(["--backends", "reference", "--device", "cpu", "--calls", "3", "--layers",
                            "--config", "N=2,P=16,R=8,H=4,H_kv=2,d=16", "--out", str(tmp_path), "--stem", "host"])
    rows = json.loads(Path(path).read_text())["rows"]
    assert [r["what"] for r in rows] == ["forward", "forward (grad)", "forward+backward", "input checks",
                                         "custom op (attention_fwd, reference)", "reference.forward"]
    assert all(r["us_per_call"] > 0 and r["plan_cache"] == "n/a" for r in rows)
    assert (tmp_path / "host.png").exists() and "| reference | n/a | forward |" in (tmp_path / "host.md").read_text()
    assert os.environ["DUALKV_CUDA_PLAN_CACHE"] == "1"
    for argv, match in ((["--calls", "0"], "--calls: expected a positive count, got 0"),
                        (["--backends", "fast"], r"--backends: expected names from .*, got \['fast'\]"),
                        (["--config", "N=0,P=1,R=1"], "--config: size: expected a positive whole number of tokens, got .0.")):
        with pytest.raises(SystemExit):
            bench_host.parse_args(["--device", "cpu", *argv])
        assert re.search(match, capsys.readouterr().err), argv


def test_host_time_benchmark_switches_both_plan_caches(monkeypatch):
    """Every backend that plans launches (CUDA, Triton, their pairs) gets a row with plans kept and one
    with both plan caches off; the reference gets one row; the variables are restored afterwards."""
    from benchmarks import bench_host

    seen = []

    def record(fn, calls, device):
        seen.append(tuple(os.environ.get(v) for v in bench_host.PLAN_CACHES))
        return 1.0

    monkeypatch.setattr(bench_host, "per_call_us", record)
    monkeypatch.setenv("DUALKV_TRITON_PLAN_CACHE", "1")
    monkeypatch.delenv("DUALKV_CUDA_PLAN_CACHE", raising=False)
    cfg = bench_host.AttnConfig.parse("N=2,P=16,R=8,H=2,H_kv=1,d=16,dtype=float16")
    rows = bench_host.run(["triton", "reference"], cfg, torch.device("cpu"), 1, False, None)
    assert [(r["backend"], r["plan_cache"]) for r in rows] == (
        [("triton", "on")] * 3 + [("triton", "off")] * 3 + [("reference", "n/a")] * 3)
    assert seen[:3] == [(None, None)] * 3 and seen[3:6] == [("0", "0")] * 3
    assert os.environ["DUALKV_TRITON_PLAN_CACHE"] == "1" and "DUALKV_CUDA_PLAN_CACHE" not in os.environ
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert [bench_host.plans_launches(b, cpu) for b in ("cuda", "triton", "cuda+triton", "reference", "auto")] == [
        True, True, True, False, False]
    assert bench_host.plans_launches("auto", gpu)


def test_run_case_records_errors():
    @register("test-broken")
    class Broken(Provider):
        def forward(self, q, k, v):
            raise RuntimeError("kernel exploded\nsecond line")

    row = run_case(AttnConfig(N=1, P=3, R=2, H=2, H_kv=1, d=8), "test-broken", CPU, Timer(CPU))
    assert row["status"] == "error: RuntimeError: kernel exploded"


# ---------------------------------------------------------------------- decoder-layer benchmark
from benchmarks import bench_decoder_layer as dl  # noqa: E402


def test_decoder_points_are_seeded_and_in_range():
    a, b = dl.make_point("5K,32", 0), dl.make_point("5K,32", 0)
    assert a.rs == b.rs and a.P == 5120 and a.mb == 32 and all(131 <= r <= 2048 for r in a.rs)
    assert dl.make_point("5K,32", 1).rs != a.rs and dl.make_point("64,3,5-9", 0).rs[0] in range(5, 10)
    assert [(p.P, p.mb) for p in map(lambda s: dl.make_point(s, 0), dl.SWEEP.split(";"))] == [
        (5120, 32), (8192, 16), (16384, 8), (32768, 4), (65536, 4), (131072, 8)]


@pytest.mark.parametrize("which", ["prefix-grouper", "fa2-replicated"])
def test_decoder_attention_variants_match_reference(which):
    """The prefix-grouper and replicated attention paths (CPU fallback of FA2) against the reference."""
    P, rs, H, Hkv, d = 13, [4, 9, 1], 4, 2, 16
    packed = PackedLayout.from_lengths([P], [rs])
    q = torch.randn(packed.total_tokens, H, d, requires_grad=True)
    k, v = (torch.randn(packed.total_tokens, Hkv, d, requires_grad=True) for _ in range(2))
    dout = torch.randn_like(q)
    if which == "prefix-grouper":
        out = dl.PrefixGrouperAttention(packed, 0.25)(q, k, v, packed)
    else:
        rep_layout = PackedLayout.from_lengths([P] * 3, [[r] for r in rs])
        index, _ = packed.replicated_index()
        out_rep = dl.ReplicatedAttention(rep_layout, 0.25)(q[index], k[index], v[index], rep_layout)
        out = torch.zeros_like(q).index_copy(0, index, out_rep)  # every copy of a prompt row is the same
    ref = reference_attention(q, k, v, packed, softmax_scale=0.25)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    if which == "prefix-grouper":
        for g, r in zip(torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(ref, (q, k, v), dout)):
            torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-4)


def test_decoder_tables_and_plot(tmp_path):
    rows = [dict(point="P5120_mb32", P=5120, mb=32, R_mean=1090.0, T=40000, T_rep=200000, rho=5.0, variant=v, status=s,
                 **({"fwdbwd_ms": ms, "peak_extra_gib": 3.0} if s == "ok" else {}))
            for v, s, ms in (("dualkv", "ok", 100.0), ("fa2-replicated", "ok", 400.0), ("prefix-grouper", "OOM", 0))]
    md = dl.tables(rows)
    assert "| 5120 | 32 | 1090 | 5.00 | 100.0 | 400.0 | OOM |" in md and "4.00x" in md
    assert dl.plot(rows, tmp_path / "p.png", "test").exists()


def test_kernel_once_runs_forward_and_backward(capsys):
    from benchmarks import kernel_once

    kernel_once.main(["--config", "N=2,P=40,R=9,H=4,H_kv=2,d=32,dtype=float32", "--backend", "reference",
                      "--backward", "--device", "cpu", "--calls", "2"])
    assert "2 call(s) on reference" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        kernel_once.main(["--calls", "0", "--device", "cpu"])


def test_kernel_once_profile_lists_the_costliest_first(capsys):
    """Every operator (a --top larger than their count) names the op's own entries, costliest first;
    --top cuts the list. (Which operators lead depends on the machine's load, so the op's entries are
    looked for in the whole list.)"""
    from benchmarks import kernel_once

    def table(top):
        kernel_once.main(["--config", "N=2,P=40,R=9,H=4,H_kv=2,d=32,dtype=float32", "--backend", "reference",
                          "--backward", "--device", "cpu", "--calls", "2", "--profile", "--top", str(top)])
        lines = capsys.readouterr().out.splitlines()
        assert lines[1].startswith("ms per call")
        rows = [line.split(None, 1) for line in lines[2:]]
        times = [float(ms) for ms, _ in rows]
        assert rows and times == sorted(times, reverse=True) and times[0] > 0, rows
        return rows

    everything = table(10_000)
    assert any(name.startswith("dualkv::attention") for _, name in everything), everything
    assert len(table(3)) == min(3, len(everything))
    with pytest.raises(SystemExit):
        kernel_once.main(["--top", "0", "--profile", "--device", "cpu"])
    assert "--top: expected a positive count, got 0" in capsys.readouterr().err


# ---------------------------------------------------------------------- log-prob head benchmark
def test_logprob_head_benchmark_smoke(tmp_path, monkeypatch):
    """Both implementations and the matmul floor run on tiny points (the Triton one in the
    interpreter), agree, and the report names every row."""
    pytest.importorskip("triton")
    from benchmarks import bench_logprobs
    from dualkv.core.backends.triton import logprob_kernel

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(logprob_kernel, "BLOCK_V", 64)
    md = bench_logprobs.main(["--points", "n=9,D=8,V=150", "--device", "cpu", "--out", str(tmp_path), "--stem", "lp",
                              "--budget-ms", "1", "--max-reps", "2"])
    rows = json.loads((tmp_path / "lp.json").read_text())["rows"]
    assert [r["impl"] for r in rows] == ["torch", "triton", "matmul-only"]
    assert all(r["status"] == "ok" and r["fwd_ms"] > 0 and r["fwdbwd_ms"] > 0 for r in rows)
    assert rows[1]["max_lp_diff"] < 1e-5 and rows[1]["max_grad_rel_diff"] < 1e-5
    assert "| n=9,D=8,V=150 | triton | ok |" in md.read_text() and (tmp_path / "lp.png").is_file()


@pytest.mark.parametrize("argv,match", [(["--points", "n=4,D=8"], "expected n, D and V"),
                                        (["--points", "n=0,D=8,V=9"], "positive ints"),
                                        (["--impls", "torch,cuda"], "--impls: expected names")])
def test_logprob_head_benchmark_bad_arguments(argv, match, capsys):
    from benchmarks import bench_logprobs

    with pytest.raises(SystemExit):
        bench_logprobs.parse_args(argv)
    assert match in capsys.readouterr().err


def test_env_ab_rows_give_each_rounds_own_ratio():
    """ratio_row keeps the ratio of medians and adds the range of the per-round ratios (each round's
    sample over the baseline's of the same round); format_row prints that range after the baseline."""
    from benchmarks import env_ab

    times = {"0": [10.0, 12.0, 11.0], "1": [11.0, 12.0, 9.9]}  # rounds: 1.1, 1.0, 0.9
    assert env_ab.round_ratios(times, ["0", "1"])["1"] == [1.1, 1.0, 0.9]
    row = env_ab.ratio_row("(2,64,8)", times, ["0", "1"])
    assert row["1"] == 11.0 and row["1_ratio"] == 1.0
    assert row["1_round_ratio_range"] == [0.9, 1.1] and row["0_round_ratio_range"] == [1.0, 1.0]
    line = env_ab.format_row(row, ["0", "1"])
    assert line.startswith("(2,64,8)           | 0:    11.00 (min    10.00) 1.000 | 1:")
    assert line.endswith("1:    11.00 (min     9.90) 1.000 [0.900-1.100]")


def test_env_ab_layouts_and_cpu_refusal(monkeypatch):
    from benchmarks import env_ab

    monkeypatch.setenv("DUALKV_AB_PROBE", "1")
    env_ab.set_value("DUALKV_AB_PROBE", "0")
    assert os.environ["DUALKV_AB_PROBE"] == "0"
    env_ab.set_value("DUALKV_AB_PROBE", "unset")  # the package's default: the variable removed
    assert "DUALKV_AB_PROBE" not in os.environ

    assert env_ab.parse_layout("4,1K,100", 0) == ("(4,1K,100)", 1024, [100] * 4)
    name, P, rs = env_ab.parse_layout("dec:5K,32", 0)
    assert (name, P, len(rs)) == ("dec:5K,32", 5120, 32) and all(131 <= r <= 2048 for r in rs)
    assert env_ab.parse_layout("dec:5K,32", 0)[2] == rs  # seeded
    with pytest.raises(ValueError, match="layout: expected 'N,P,R' or 'dec:P,mb'"):
        env_ab.parse_layout("4,1K", 0)
    with pytest.raises(SystemExit, match="--heads: expected 'H,H_kv' \\(two whole numbers\\), got '32'"):
        env_ab.main(["--var", "X", "--values", "0,1", "--layouts", "2,64,8", "--heads", "32"])
    with pytest.raises(SystemExit, match="--values: expected at least one value"):
        env_ab.main(["--var", "X", "--values", ",", "--layouts", "2,64,8"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA device"):
            env_ab.main(["--var", "X", "--values", "0,1", "--layouts", "2,64,8"])


def test_env_ab_rows_and_library_refusal():
    from benchmarks import env_ab

    row = env_ab.ratio_row("(x)", {"unset": [2.0, 4.0, 3.0], "1": [6.0, 6.0, 9.0]}, ["unset", "1"])
    assert row == {"layout": "(x)", "unset": 3.0, "unset_ratio": 1.0, "unset_samples": [2.0, 4.0, 3.0],
                   "1": 6.0, "1_ratio": 2.0, "1_samples": [6.0, 6.0, 9.0],
                   "unset_round_ratio_range": [1.0, 1.0], "1_round_ratio_range": [1.5, 3.0]}

    with pytest.raises(SystemExit, match="a process loads one library; .*benchmarks.build_ab"):
        env_ab.main(["--var", "DUALKV_CUDA_LIBRARY", "--values", "/a.so,/b.so", "--layouts", "2,64,8"])


def test_build_ab_arguments_order_and_summary(tmp_path):
    """build_ab: --libs checked before anything runs; the processes alternate (reversed every other
    round); a build's time is the median of its processes' medians; the plot is written."""
    from benchmarks import build_ab

    a, b = tmp_path / "a.so", tmp_path / "b.so"
    a.write_bytes(b"x")
    b.write_bytes(b"y")
    assert build_ab.parse_libs(f"base={a}, new={b}") == {"base": str(a.resolve()), "new": str(b.resolve())}
    for text, match in ((f"base={a}", "at least two builds"), (f"base={a},base={b}", "'base' is given twice"),
                        (f"base={a},{b}", "expected 'name=path'"), (f"base={a},new={tmp_path / 'c.so'}", "new=.*c.so: no such file")):
        with pytest.raises(SystemExit, match=match):
            build_ab.parse_libs(text)
    with pytest.raises(SystemExit, match="--backend: .*'cuda' or a pair with it; got 'triton'"):
        build_ab.main(["--libs", f"base={a},new={b}", "--layouts", "2,64,8", "--backend", "triton"])
    with pytest.raises(SystemExit, match="--processes: expected a whole number >= 1, got 0"):
        build_ab.main(["--libs", f"base={a},new={b}", "--layouts", "2,64,8", "--processes", "0"])
    with pytest.raises(SystemExit, match="--layouts: expected at least one layout"):
        build_ab.main(["--libs", f"base={a},new={b}", "--layouts", " ; "])
    with pytest.raises(SystemExit, match="--heads: expected 'H,H_kv' \\(two whole numbers\\), got '32'"):
        build_ab.main(["--libs", f"base={a},new={b}", "--layouts", "2,64,8", "--heads", "32"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA device"):
            build_ab.main(["--libs", f"base={a},new={b}", "--layouts", "2,64,8"])

    assert build_ab.process_order(["a", "b"], 3) == ["a", "b", "b", "a", "a", "b"]
    samples = {"a": {"(x)": [[1.0, 2.0, 3.0], [4.0, 4.0, 4.0], [1.0, 1.0, 9.0]]},
               "b": {"(x)": [[3.0, 3.0, 3.0], [2.0, 2.0, 2.0], [8.0, 8.0, 8.0]]}}
    (row,) = build_ab.summarise(samples, ["a", "b"])
    assert row["a_processes"] == [2.0, 4.0, 1.0] and row["a"] == 2.0 and row["b"] == 3.0
    assert row["a_ratio"] == 1.0 and row["b_ratio"] == 1.5
    assert "1.500" in build_ab.table([row], ["a", "b"])
    from benchmarks.report import plot_ratios

    assert plot_ratios([row], ["a", "b"], tmp_path / "ab.png", "t").stat().st_size > 0


def test_decoder_benchmark_compiled_layer_on_cpu(tmp_path):
    """--compile: every variant's layer under torch.compile; the rows and the report say so."""
    import json

    path = dl.main(["--preset", "tiny-qwen3", "--points", "64,2,5-9", "--variants", "dualkv", "--backend", "reference",
                    "--device", "cpu", "--compile", "--out", str(tmp_path), "--stem", "dec", "--budget-ms", "1",
                    "--max-reps", "1"])
    data = json.loads(path.read_text())
    rows = [r for r in data["rows"] if r.get("variant") == "dualkv"]
    assert rows and rows[0]["status"] == "ok" and rows[0]["fwdbwd_ms"] > 0
    assert data["meta"]["compile"] is True
    assert "torch.compile(dynamic=False) of the whole layer" in (tmp_path / "dec.md").read_text()


def test_profile_decoder_layer_checks_its_arguments(capsys):
    from benchmarks import profile_decoder_layer as pdl

    with pytest.raises(SystemExit, match="--modes: expected some of"):
        pdl.main(["--modes", "eager,jit"])
    with pytest.raises(SystemExit, match="--variants: expected some of"):
        pdl.main(["--variants", "dualkv,magic"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA device"):
            pdl.main(["--points", "64,2"])
    with pytest.raises(SystemExit):
        pdl.main(["--gaps", "-1"])
    assert "--gaps: expected a count >= 0, got -1" in capsys.readouterr().err


def _planted_profile(events):
    from types import SimpleNamespace

    return SimpleNamespace(events=lambda: events)


def _event(name, start, end, device=torch.autograd.DeviceType.CUDA, stream=7, annotation=False):
    from types import SimpleNamespace

    return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end),
                           device_resource_id=stream, is_user_annotation=annotation)


def test_timeline_idle_report_on_a_planted_timeline():
    """idle_report merges overlapping device activity, sums the idle stretches between it and names the
    activity after each stretch; with no CPU operators recorded no host is named."""
    from benchmarks import timeline

    events = [
        _event("gemm", 10, 110),
        _event("copy", 50, 120),       # overlaps the gemm: no idle time between them
        _event("attn_fwd", 420, 500),  # 300 us after the copy ends
        _event("rope", 510, 520),      # 10 us
    ]
    lines = timeline.idle_report(_planted_profile(events), 5)
    assert lines[0] == "   GPU span 0.51 ms, idle 0.31 ms in 2 stretches; longest:"
    assert lines[1] == "      300.0 us  before attn_fwd"
    assert lines[2] == "       10.0 us  before rope"
    assert timeline.idle_report(_planted_profile([]), 3) == ["   no device activity recorded"]


def test_timeline_idle_time_is_not_hidden_by_annotations():
    """A record_function region drawn on the GPU's timeline (a user annotation spanning the kernels
    launched in it) is not work: the idle time inside it still counts."""
    from benchmarks import timeline

    events = [
        _event("phase:update", 0, 1000, annotation=True),
        _event("## Call CompiledFxGraph abc ##", 0, 900, annotation=True),
        _event("gemm", 0, 100),
        _event("attn_fwd", 600, 1000),  # 500 us idle inside both regions
    ]
    lines = timeline.idle_report(_planted_profile(events), 2)
    assert lines[0] == "   GPU span 1.00 ms, idle 0.50 ms in 1 stretches; longest:"
    assert lines[1] == "      500.0 us  before attn_fwd"


def test_timeline_kind_of_names_the_step_kernels():
    """kind_of sorts the kernels of a policy step's profile (names as the H200 profiles print them)."""
    from benchmarks.timeline import OTHER_KIND, kind_of

    assert kind_of("void dkv::dkv_fwd_sm90_kernel<dkv::Bf16, 128, true, true>(dkv::FwdParams)") == "attention forward"
    assert kind_of("fwd_ws_kernel") == "attention forward"
    for name in ("void dkv::dkv_dkdv_sm90_ws_kernel<dkv::Bf16, 128, true, false, true, false>(dkv::BwdParams)",
                 "void dkv::dkv_convert_dq_kernel<dkv::Bf16>(dkv::BwdParams)", "dkdv_rows_gluon_kernel", "dq_kernel",
                 "void dkv::dkv_bwd_prep_kernel<dkv::Bf16>(dkv::BwdParams)"):
        assert kind_of(name) == "attention backward", name
    assert kind_of("_logprob_fwd_kernel") == "log-prob head"  # not the attention forward's fwd_kernel
    assert kind_of("nvjet_sm90_tst_256x152_64x4_1x2_h_bz_coopA_TNT") == "matrix products"
    assert kind_of("triton_tem_fused_mm_0") == "matrix products"
    assert kind_of("triton_poi_fused_mul_silu_silu_backward_0") == "compiled element-wise"
    assert kind_of("Memcpy DtoD (Device -> Device)") == "copies and memsets"
    assert kind_of("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<...>") == "optimizer"
    assert kind_of("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)") == "communication"
    assert kind_of("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>") == OTHER_KIND


def test_timeline_kind_report_sums_by_kind_phase_and_stream():
    """kind_report sums device time by kind, in total and per phase region of the GPU's timeline (a
    kernel in the one its start lies in), skips annotations, and tells the time on the other streams
    and how much of it overlapped the main stream's work."""
    from benchmarks import timeline

    events = [
        _event("phase:ref_log_prob", 0, 1000, annotation=True),
        _event("phase:update", 1000, 3000, annotation=True),
        _event("nvjet_a", 0, 400),
        _event("void dkv::dkv_fwd_sm90_kernel<>", 400, 900),
        _event("nvjet_b", 1000, 1600),
        _event("void dkv::dkv_dkdv_sm90_ws_kernel<>", 1600, 2600),
        _event("triton_poi_fused_add_0", 2600, 2700),
        _event("Memcpy DtoD (Device -> Device)", 2500, 2800, stream=20),  # 100 us beside the main stream
        _event("Memcpy DtoD (Device -> Device)", 3500, 3600, stream=20),  # after every phase, alone
    ]
    lines = timeline.kind_report(_planted_profile(events))
    assert lines[0] == "   every phase: 3.00 ms of device time"
    assert lines[1] == "         1.00 ms   33.3%       2x  matrix products"
    assert lines[2] == "         1.00 ms   33.3%       1x  attention backward"
    assert lines[3] == "         0.50 ms   16.7%       1x  attention forward"
    assert lines[4] == "         0.40 ms   13.3%       2x  copies and memsets"
    assert lines[5] == "         0.10 ms    3.3%       1x  compiled element-wise"
    assert lines[6] == "   phase:ref_log_prob: 0.90 ms of device time"
    assert lines[9] == "   phase:update: 2.00 ms of device time"
    assert lines[12] == "         0.30 ms   15.0%       1x  copies and memsets"
    assert lines[14:16] == ["   (no phase): 0.10 ms of device time", "         0.10 ms  100.0%       1x  copies and memsets"]
    assert lines[16] == "   on streams other than the main one (7): 0.40 ms, 0.20 ms of it while the main stream worked"
    assert lines[17:] == ["         0.40 ms  (0.20 ms overlapped)  copies and memsets"]
    assert timeline.kind_report(_planted_profile([])) == ["   no device activity recorded"]


def test_timeline_speed_report_turns_phase_flops_into_speeds():
    """speed_report divides each phase's model FLOPs by its kernels' device time (every stream): the
    whole phase against the peak, the products (logits included; x3 with gradients), the attention
    forward (x1) and backward (x2.5, as bench_attention counts), and the time of the rest."""
    from benchmarks import timeline

    events = [
        _event("phase:old_log_prob", 0, 1000, annotation=True),
        _event("phase:update", 1000, 4000, annotation=True),
        _event("nvjet_a", 0, 400),
        _event("void dkv::dkv_fwd_sm90_kernel<>", 400, 900),
        _event("triton_poi_fused_add_0", 900, 1000),
        _event("nvjet_b", 1000, 2200),
        _event("void dkv::dkv_fwd_sm90_kernel<>", 2200, 2500),
        _event("void dkv::dkv_dkdv_sm90_ws_kernel<>", 2500, 3500),
        _event("Memcpy DtoD (Device -> Device)", 3500, 3600, stream=20),
    ]
    parts = {"products": 3e11, "head": 1e11, "attention": 2e11}
    flops = {"old_log_prob": parts, "ref_log_prob": parts, "update": parts}
    lines = timeline.speed_report(_planted_profile(events), flops, peak=1e15)
    assert lines == [
        "   old_log_prob: 1.0 ms of device time, 0.6 TFLOP of model FLOPs: 600 TFLOP/s (60.0% of the peak)",
        "          0.4 ms   40.0%        0.4 TFLOP    1000 TFLOP/s  matrix products",
        "          0.5 ms   50.0%        0.2 TFLOP     400 TFLOP/s  attention forward",
        "          0.1 ms   10.0%  every other kind",
        "   ref_log_prob: no phase:ref_log_prob region on the GPU's timeline",
        "   update: 2.6 ms of device time, 1.8 TFLOP of model FLOPs: 692 TFLOP/s (69.2% of the peak)",
        "          1.2 ms   46.2%        1.2 TFLOP    1000 TFLOP/s  matrix products",
        "          0.3 ms   11.5%        0.2 TFLOP     667 TFLOP/s  attention forward",
        "          1.0 ms   38.5%        0.5 TFLOP     500 TFLOP/s  attention backward",
        "          0.1 ms    3.8%  every other kind",
    ]
    # no kernel of a kind: said, not divided by zero; no peak: no share
    lines = timeline.speed_report(_planted_profile(events[:3]), {"old_log_prob": parts})
    assert lines[0] == "   old_log_prob: 0.4 ms of device time, 0.6 TFLOP of model FLOPs: 1500 TFLOP/s"
    assert lines[2].endswith("   (no kernel)  attention forward")


def test_timeline_names_the_host_operator_and_phase_of_each_idle_stretch():
    """Each idle stretch is attributed to the innermost CPU operator running at its middle and the
    phase: region around it, and sums them by each; a stretch inside no operator is counted apart."""
    from benchmarks import timeline

    cpu = torch.autograd.DeviceType.CPU
    events = [
        _event("phase:update", 0, 1000, cpu),
        _event("aten::nonzero", 100, 400, cpu),      # a sync: the GPU drains while it waits
        _event("cudaStreamSynchronize", 150, 390, cpu),
        _event("aten::mm", 30, 60, cpu),             # ended long before: never the answer
        _event("phase:old_log_prob", 1500, 1600, cpu),
        _event("gemm", 0, 200),
        _event("attn", 380, 420),    # 180 us idle, middle 290: inside the sync, inside nonzero
        _event("softmax", 700, 800),  # 280 us idle, middle 560: in the phase, between operators
        _event("lm_head", 1700, 1800),  # 900 us idle, middle 1250: in no phase, no operator
    ]
    prof = _planted_profile(events)
    lines = timeline.idle_report(prof, 3)
    assert lines[0] == "   GPU span 1.80 ms, idle 1.36 ms in 3 stretches; longest:"
    assert lines[1] == "      900.0 us  before lm_head"
    assert lines[2] == "      280.0 us  before softmax  (host: (between operators) in phase:update)"
    assert lines[3] == "      180.0 us  before attn  (host: cudaStreamSynchronize in phase:update)"
    by_host = lines[4:]  # after the header and the three longest stretches
    assert by_host[:3] == ["   idle time by phase:", "        0.90 ms  (no phase)", "        0.46 ms  phase:update"]
    assert by_host[3] == "   idle time by the host operator running then (innermost):"
    assert by_host[4:] == ["        1.18 ms  (between operators)", "        0.18 ms  cudaStreamSynchronize"]


def test_timeline_counts_sync_reports_not_the_prototype_notice():
    """host_syncs counts torch's 'called a synchronizing CUDA operation' reports; the one-time notice
    that sync debug mode is a prototype mentions synchronizing operations too and is not one."""
    from benchmarks.timeline import is_sync_warning

    assert is_sync_warning(UserWarning("called a synchronizing CUDA operation"))
    assert not is_sync_warning(UserWarning(
        "Synchronization debug mode is a prototype feature and does not yet detect all synchronizing operations"))


def test_timeline_host_syncs_names_the_calling_line(monkeypatch):
    """host_syncs counts each sync report once, keyed by the innermost caller outside torch (and the
    tool's own files), restores the debug mode it found, and reports none when there are none."""
    import warnings

    from benchmarks import timeline

    modes = []
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)

    def step():
        for _ in range(2):
            warnings.warn("called a synchronizing CUDA operation")  # what torch reports at a sync
        warnings.warn("an unrelated warning")

    lines = timeline.host_syncs(step)
    assert lines[0] == "   host synchronisations: 2" and len(lines) == 2
    assert "test_benchmarks.py" in lines[1] and "(step)" in lines[1] and lines[1].lstrip().startswith("2x")
    assert modes == ["warn", 0]
    assert timeline.host_syncs(lambda: None) == ["   host synchronisations: none"]


def test_tune_triton_compile_report():
    """``tune_triton.py compile-report`` compiles every d = 64 candidate of every Triton kernel (the
    warp-specialised ones included) and the Gluon kernels for sm_90 without a GPU, and reports their
    registers; no candidate may fail to compile. Run in a subprocess without TRITON_INTERPRET."""
    import subprocess

    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    res = subprocess.run([sys.executable, "benchmarks/tune_triton.py", "compile-report", "--head-dims", "64"],
                         cwd=env["PYTHONPATH"], env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.strip().splitlines()
    assert not [line for line in lines if "FAILED" in line], res.stdout
    kinds = {re.match(r"d=\s*\d+ (\S+)", line).group(1) for line in lines}
    assert {"fwd", "dkdv", "dkdv_rows", "dq"} <= kinds
    assert any("-ws" in line for line in lines)  # the warp-specialised candidates
    if "gluon:" not in res.stdout:  # a Triton with Gluon's Hopper API: its kernels too
        assert sum(" gluon " in line for line in lines) == 4
    assert all(re.search(r"regs=\d+ spill_bytes=\d+", line) for line in lines if "gluon:" not in line)


def test_tile_waste_counts_the_forward_walk(capsys):
    """benchmarks.tile_waste: with one-row, one-key tiles the walk computes exactly the attended pairs;
    wider tiles compute more, the merged walk never more than the split one (the same where the prompt
    fills whole tiles), and a brute-force walk over every query tile agrees; bad sizes are usage errors."""
    from benchmarks import tile_waste
    from benchmarks.harness import attended_pairs

    prompts, responses = [37, 5], [[3, 20, 1], [9]]
    useful = attended_pairs(prompts, responses)
    assert tile_waste.computed_scores(prompts, responses, 1, 1) == useful

    def brute(block_m, block_n, merged):  # every (query tile, key tile) visited, keys in logical positions
        total = 0
        for p, rs in zip(prompts, responses):
            for ctx, rows in ((0, p), *((p, r) for r in rs)):
                for q0 in range(0, rows, block_m):
                    hi = min(rows, q0 + block_m)
                    lead = (16 - ctx % 16) % 16 if ctx else 0  # the merged walk starts so the prompt ends on 16 rows
                    regions = [(-lead, ctx + hi)] if merged else [(0, ctx), (ctx, ctx + hi)]
                    tiles = sum(len(range(lo, end, block_n)) for lo, end in regions)
                    total += tiles * block_m * block_n
        return total

    for m, n in ((16, 16), (128, 176), (64, 48)):
        split = tile_waste.computed_scores(prompts, responses, m, n)
        merged = tile_waste.computed_scores(prompts, responses, m, n, merged=True)
        assert split == brute(m, n, False) and merged == brute(m, n, True)
        assert useful <= merged <= split  # tiles of whole 16-row boxes: the lead never adds a tile
    whole = tile_waste.computed_scores([352], [[100, 7]], 128, 176)  # 352 = 2 x 176
    assert whole == tile_waste.computed_scores([352], [[100, 7]], 128, 176, merged=True)
    assert tile_waste.computed_scores([353], [[100, 7]], 128, 176, merged=True) < tile_waste.computed_scores(
        [353], [[100, 7]], 128, 176)
    out = tile_waste.main(["--configs", "2,300,40;1,64,8", "--block-n", "64,176"])
    assert "| 2, 300, 40 |" in out and "176-key tiles merged" in out and out in capsys.readouterr().out
    for argv, match in ((["--block-n", "0"], "--block-m / --block-n: expected positive tile sizes"),
                        (["--block-n", "x"], "--block-n: expected comma-separated whole numbers"),
                        (["--configs", "0,1,1"], "--configs: ")):
        with pytest.raises(SystemExit):
            tile_waste.parse_args(argv)
        assert match in capsys.readouterr().err, argv
    with pytest.raises(ValueError, match="block_m, block_n: expected positive tile sizes"):
        tile_waste.computed_scores(prompts, responses, 0, 16)


def test_timeline_op_context_on_a_real_cpu_profile():
    """op_context walks a real torch.profiler run's parent links: an operator inside an FSDP-named
    region (through a plain region between them) is named with that region; one outside any is not."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from benchmarks import timeline

    a = torch.randn(8, 8)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("FSDP::all_gather_copy_in"), record_function("inner"):
            torch.mm(a, a)
        torch.mm(a, a)
    mms = sorted((e for e in prof.events() if e.name == "aten::mm"), key=lambda e: e.time_range.start)
    assert [timeline.op_context(e) for e in mms] == ["aten::mm < FSDP::all_gather_copy_in", "aten::mm"]


def test_timeline_minor_kernels_report_lists_the_rest_by_kernel_and_operator():
    """minor_kernels_report leaves out the products and attention, sums the other kinds' kernels by
    (name, launching operator and the FSDP / compiled-graph / autograd region around it), largest first
    within each kind, with their time per phase; a kernel the profiler tied to no operator shows "?"."""
    from types import SimpleNamespace

    from benchmarks import timeline

    cpu = torch.autograd.DeviceType.CPU
    add1, add2 = _event("add_kernel", 1100, 1300), _event("add_kernel", 1400, 1500)
    copy = _event("Memcpy DtoD (Device -> Device)", 1500, 1550)
    op = _event("aten::add_", 1090, 1410, device=cpu)
    op.cpu_parent = SimpleNamespace(name="aten::something", cpu_parent=SimpleNamespace(
        name="FSDP::post_backward_reduce (layers.0)", cpu_parent=None))
    op.kernels = [SimpleNamespace(name="add_kernel", duration=200), SimpleNamespace(name="add_kernel", duration=100)]
    events = [
        _event("phase:ref_log_prob", 0, 1000, annotation=True),
        _event("phase:update", 1000, 3000, annotation=True),
        _event("nvjet_a", 0, 400),                        # a product: left out
        _event("void dkv::dkv_fwd_sm90_kernel<>", 400, 900),
        _event("add_kernel", 900, 950),                   # launched by no recorded operator
        add1, add2, copy, op,
    ]
    lines = timeline.minor_kernels_report(_planted_profile(events), top=5)
    assert lines[0] == "   other (eager element-wise, reductions, ...): 0.35 ms in 2 kernel / operator pairs"
    assert lines[1] == "         0.30 ms      2x  add_kernel  [aten::add_ < FSDP::post_backward_reduce (layers.0); update 0.3]"
    assert lines[2] == "         0.05 ms      1x  add_kernel  [?; ref_log_prob 0.1]"
    assert lines[3] == "   copies and memsets: 0.05 ms in 1 kernel / operator pairs"
    assert lines[4].endswith("1x  Memcpy DtoD (Device -> Device)  [?; update 0.1]")
    assert len(lines) == 5
    assert timeline.minor_kernels_report(_planted_profile([_event("nvjet_a", 0, 1)]))[0].startswith(
        "   no device activity recorded outside")
