"""CPU tests of the memory-scaling and policy-step benchmarks at tiny shapes: both scripts end to end
through ``main(argv)``, the memory fit on synthetic numbers, and the rho formula."""

import csv
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: ``benchmarks``

from benchmarks import bench_memory_scaling as ms  # noqa: E402
from benchmarks import bench_policy_step as ps  # noqa: E402


# ------------------------------------------------------------------------------------------- fit
def test_fit_recovers_known_coefficients():
    M0, cP, cR = 3.5, 2e-4, 7e-5
    pts = [(P, mbR, M0 + cP * P + cR * mbR) for P in (8192, 16384, 32768) for mbR in (4000, 9000, 20000)]
    fit = ms.fit_memory(pts)
    assert fit["M0"] == pytest.approx(M0, rel=1e-6)
    assert fit["c_P"] == pytest.approx(cP, rel=1e-6)
    assert fit["c_R"] == pytest.approx(cR, rel=1e-6)
    assert fit["r2"] == pytest.approx(1.0) and fit["n"] == 9
    assert ms.predict(fit, 1000, 2000) == pytest.approx(M0 + cP * 1000 + cR * 2000)


def test_fit_skips_when_underdetermined():
    assert ms.fit_memory([]) is None
    assert ms.fit_memory([(1, 2, None), (2, 3, None), (3, 4, None)]) is None  # CPU: no memory counter
    assert ms.fit_memory([(8, 1, 1.0), (8, 1, 1.1), (8, 1, 0.9)]) is None  # rank 1


def test_response_lengths_seeded_and_in_range():
    a = ms.response_lengths(8192, 16, seed=0)
    assert a == ms.response_lengths(8192, 16, seed=0) and a != ms.response_lengths(8192, 16, seed=1)
    assert len(a) == 16 and all(131 <= r <= 2048 for r in a)


# ----------------------------------------------------------------------------------------- rho
def test_predicted_rho():
    assert ps.predicted_rho(16, 8192, 1024) == pytest.approx(16 * (8192 + 1024) / (8192 + 16 * 1024))
    assert ps.predicted_rho(1, 100, 7) == pytest.approx(1.0)
    assert ps.predicted_rho(8, 0, 50) == pytest.approx(1.0)  # no prompt: nothing to share


# ----------------------------------------------------------------------------------- end to end
def _rows(path: Path) -> list[dict]:
    return json.loads(path.read_text())["rows"]


def test_memory_scaling_end_to_end(tmp_path, one_thread):
    out = ms.main(["--preset", "tiny-qwen3", "--prompts", "64,96", "--mbs", "4,8", "--response-range", "8:16",
                   "--device", "cpu", "--out", str(tmp_path), "--stem", "mem"])
    assert out == tmp_path / "mem.json"
    data = json.loads(out.read_text())
    assert data["meta"]["command"].startswith("python -m benchmarks.bench_memory_scaling")
    assert {"card", "date", "versions"} <= set(data["meta"])
    rows = data["rows"]
    assert {r["packing"] for r in rows} == {"dualkv", "replicated"} and len(rows) == 8
    for r in rows:
        assert r["status"] == "ok" and r["peak_gib"] is None  # CPU: no memory counter
        extra = (r["mb"] - 1) * r["P"] if r["packing"] == "replicated" else 0
        assert r["T"] == r["P"] + r["sum_R"] + extra
    assert data["meta"]["fits"] == {"dualkv": None, "replicated": None}
    with open(tmp_path / "mem.csv") as f:
        assert len(list(csv.DictReader(f))) == 8
    md = (tmp_path / "mem.md").read_text()
    assert "| dualkv | replicated |" in md and "n/a" in md and "not fitted" in md


def test_memory_scaling_tables_and_plot_with_numbers(tmp_path):
    rows = []
    for packing, cP in (("dualkv", 1e-4), ("replicated", 6e-4)):
        for P in (8192, 16384, 32768):
            for mb in (4, 8):
                rows.append(dict(packing=packing, P=P, mb=mb, sum_R=1000 * mb + P // 64, rho=2.0, status="ok",
                                 peak_gib=2.0 + cP * P + 1e-4 * (1000 * mb + P // 64)))
    rows.append(dict(packing="replicated", P=65536, mb=8, sum_R=9000, rho=5.0, status="OOM", peak_gib=None))
    fits = ms.fits_of(rows)
    assert fits["dualkv"]["c_P"] == pytest.approx(1e-4, rel=1e-6)
    assert fits["replicated"]["c_P"] == pytest.approx(6e-4, rel=1e-6)
    text = ms.tables(rows, fits)
    assert "OOM" in text and "R^2" in text
    assert ms.plot(rows, fits, tmp_path / "m.png", "test").exists()


def test_policy_step_end_to_end(tmp_path, one_thread):
    out = ps.main(["--preset", "tiny-qwen3", "--prompt", "64", "--response-range", "8:16", "--mbs", "4,8",
                   "--responses-per-step", "8", "--steps", "1", "--warmup", "1", "--peak-tflops", "1",
                   "--device", "cpu", "--out", str(tmp_path), "--stem", "step"])
    data = json.loads(out.read_text())
    assert data["meta"]["command"].startswith("python -m benchmarks.bench_policy_step")
    rows = data["rows"]
    assert {(r["packing"], r["mb"]) for r in rows} == {(p, m) for p in ("dualkv", "replicated") for m in (4, 8)}
    for r in rows:
        assert r["status"] == "ok" and r["peak_memory_gib"] is None
        assert all(r[f"time_{k}"] > 0 for k in ps.PHASES)
        assert r["tokens_per_s"] > 0 and r["mfu"] > 0 and r["useful_mfu"] > 0
        assert r["groups"] == 8 // r["mb"]
        if r["packing"] == "dualkv":
            assert r["useful_mfu"] == pytest.approx(r["mfu"], rel=1e-9)  # the same FLOPs for the prompt-once layout
        else:
            assert r["useful_mfu"] < r["mfu"]
    for item in data["meta"]["rho_table"]:
        assert item["rho"] > 1 and item["update_speedup"] > 0
        assert item["predicted_rho"] == pytest.approx(ps.predicted_rho(item["mb"], 64, 12.0))
    dual = {r["mb"]: r for r in rows if r["packing"] == "dualkv"}
    rep = {r["mb"]: r for r in rows if r["packing"] == "replicated"}
    for mb in (4, 8):  # the same seeded batches under both packings
        assert dual[mb]["replicated_tokens"] == rep[mb]["replicated_tokens"]
        assert dual[mb]["rho"] == pytest.approx(dual[mb]["replicated_tokens"] / dual[mb]["packed_tokens"])
    for suffix in ("csv", "md", "png"):
        assert (tmp_path / f"step.{suffix}").exists()
    assert "update-phase speedup" in (tmp_path / "step.md").read_text()


def test_policy_step_rejects_bad_mbs():
    with pytest.raises(SystemExit):
        ps.parse_args(["--mbs", "3", "--responses-per-step", "16", "--device", "cpu"])
