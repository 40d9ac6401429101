"""CPU tests of the memory-scaling and policy-step benchmarks at tiny shapes: both scripts end to end
through ``main(argv)``, the memory fit on synthetic numbers, and the rho formula."""

import csv
import json
import os
import sys
from pathlib import Path

import pytest
import torch

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
    kept = json.loads(ms.main(["--preset", "tiny-qwen3", "--prompts", "64", "--mbs", "4", "--packings", "dualkv",
                               "--response-range", "8:16", "--device", "cpu", "--out", str(tmp_path), "--stem",
                               "kept", "--keep-attention"]).read_text())
    assert kept["meta"]["keep_attention"] and kept["rows"][0]["status"] == "ok"
    assert "(keeping attention outputs)" in (tmp_path / "kept.md").read_text()


def test_memory_scaling_tables_and_plot_with_numbers(tmp_path):
    """The fit regresses on the prompt tokens each packing holds: P (dualkv) or mb * P (replicated)."""
    rows = []
    for packing in ("dualkv", "replicated"):
        for P in (8192, 16384, 32768):
            for mb in (4, 8):
                held = P if packing == "dualkv" else mb * P
                rows.append(dict(packing=packing, P=P, mb=mb, sum_R=1000 * mb + P // 64, rho=2.0, status="ok",
                                 peak_gib=2.0 + 3e-4 * held + 1e-4 * (1000 * mb + P // 64)))
    rows.append(dict(packing="replicated", P=65536, mb=8, sum_R=9000, rho=5.0, status="OOM", peak_gib=None))
    rows += [dict(packing=p, P=131072, mb=8, status="not run: --deadline-s reached") for p in ("dualkv", "replicated")]
    fits = ms.fits_of(rows)
    for packing in ("dualkv", "replicated"):
        assert fits[packing]["c_P"] == pytest.approx(3e-4, rel=1e-6)
        assert fits[packing]["c_R"] == pytest.approx(1e-4, rel=1e-6)
        assert fits[packing]["r2"] == pytest.approx(1.0)
    text = ms.tables(rows, fits)
    assert "OOM" in text and "R^2" in text
    assert "| 128K |" not in text  # a point neither packing measured has no row
    assert ms.plot(rows, fits, tmp_path / "m.png", "test").exists()


def _result_file(path: Path, meta: dict, rows: list[dict]) -> str:
    base = dict(card={"name": "Test card"}, date="2026-01-01T00:00:00+00:00", versions={"torch": "x"},
                git_commit="abc", command=f"python -m bench {path.stem}")
    path.write_text(json.dumps(dict(meta={**base, **meta}, validation=[], rows=rows)))
    return str(path)


def test_memory_scaling_merge(tmp_path):
    meta = dict(preset="tiny", layers=None, dtype="bfloat16", activation_checkpointing=True,
                response_lengths="U(131, 2048)", seed=0)

    def row(packing, P, mb, peak, status="ok"):
        held = P if packing == "dualkv" else mb * P
        return dict(packing=packing, P=P, mb=mb, sum_R=100 * mb, rho=2.0, status=status,
                    peak_gib=None if peak is None else 1.0 + 1e-4 * held + peak)

    first = _result_file(tmp_path / "a.json", meta, [row("dualkv", 1024, 4, 0.0), row("dualkv", 2048, 4, 0.0),
                                                     row("dualkv", 4096, 8, None, "not run: --deadline-s reached")])
    second = _result_file(tmp_path / "b.json", meta, [row("dualkv", 4096, 8, 0.0), row("replicated", 1024, 4, 0.0),
                                                      row("dualkv", 1024, 4, None, "not run: --deadline-s reached")])
    out = ms.main(["--merge", first, second, "--out", str(tmp_path / "m"), "--stem", "merged"])
    data = json.loads(out.read_text())
    rows = {(r["packing"], r["P"], r["mb"]): r for r in data["rows"]}
    assert len(rows) == 4 and all(r["status"] == "ok" for r in rows.values())  # 'not run' never replaces a row
    assert rows["dualkv", 1024, 4]["_command"] == "python -m bench a"
    assert rows["dualkv", 4096, 8]["_command"] == "python -m bench b"
    assert data["meta"]["command"] == "python -m bench a ; python -m bench b"
    assert data["meta"]["fits"]["dualkv"]["n"] == 3
    assert (tmp_path / "m" / "merged.md").exists() and (tmp_path / "m" / "merged.png").exists()
    other = _result_file(tmp_path / "c.json", {**meta, "seed": 1}, [])
    with pytest.raises(SystemExit, match="seed"):
        ms.main(["--merge", first, other, "--out", str(tmp_path / "m")])


def test_policy_step_merge(tmp_path):
    meta = dict(preset="tiny", P=64, response_range=[8, 16], responses_per_step=8, algorithm="grpo", kl_beta=0.04,
                activation_checkpointing=True, warmup=1, steps=1, seed=0)

    def row(packing, mb, t):
        times = dict(time_old_log_prob=t, time_ref_log_prob=t, time_update=3 * t, time_compute=5 * t)
        return dict(packing=packing, P=64, mb=mb, groups=8 // mb, status="ok", rho=2.5, packed_tokens=100,
                    replicated_tokens=250, tokens_per_s=1.0, effective_tokens_per_s=2.5, tflops=1.0, mfu=0.1,
                    useful_mfu=0.1, peak_memory_gib=None, steps=1, **times)

    first = _result_file(tmp_path / "a.json", meta, [row("dualkv", 4, 1.0), row("replicated", 4, 2.0),
                                                     dict(packing="dualkv", P=64, mb=8, status="not run: --deadline-s reached")])
    second = _result_file(tmp_path / "b.json", meta, [row("replicated", 8, 4.0), row("dualkv", 8, 1.0)])
    out = ps.main(["--merge", first, second, "--out", str(tmp_path / "m"), "--stem", "merged"])
    data = json.loads(out.read_text())
    assert [(r["mb"], r["packing"]) for r in data["rows"]] == [(4, "dualkv"), (4, "replicated"), (8, "dualkv"),
                                                               (8, "replicated")]
    speed = {item["mb"]: item["step_speedup"] for item in data["meta"]["rho_table"]}
    assert speed == {4: pytest.approx(2.0), 8: pytest.approx(4.0)}
    assert "| 8 | 2.50 |" in (tmp_path / "m" / "merged.md").read_text()
    other = _result_file(tmp_path / "c.json", {**meta, "P": 128}, [])
    with pytest.raises(SystemExit, match=r"--merge: .*\['P'\]"):
        ps.main(["--merge", first, other, "--out", str(tmp_path / "m")])
    # a switch added after a file was written counts as off there, and a switch that is on differs
    newer = _result_file(tmp_path / "d.json", {**meta, "keep_attention": False, "compile": False}, [])
    ps.main(["--merge", first, newer, "--out", str(tmp_path / "m"), "--stem", "again"])
    keeping = _result_file(tmp_path / "e.json", {**meta, "keep_attention": True}, [])
    with pytest.raises(SystemExit, match=r"--merge: .*\['keep_attention'\]"):
        ps.main(["--merge", first, keeping, "--out", str(tmp_path / "m")])
    one_rank = _result_file(tmp_path / "f.json", {**meta, "world_size": 1, "sp": 1}, [])  # the default of older files
    ps.main(["--merge", first, one_rank, "--out", str(tmp_path / "m"), "--stem", "third"])
    eight = _result_file(tmp_path / "g.json", {**meta, "world_size": 8, "sp": 2}, [])
    with pytest.raises(SystemExit, match=r"--merge: .*\['world_size', 'sp'\]"):
        ps.main(["--merge", first, eight, "--out", str(tmp_path / "m")])
    auto = _result_file(tmp_path / "h.json", {**meta, "attention_backend": "auto"}, [])  # older files ran auto
    ps.main(["--merge", first, auto, "--out", str(tmp_path / "m"), "--stem", "fourth"])
    pinned = _result_file(tmp_path / "i.json", {**meta, "attention_backend": "cuda"}, [])
    with pytest.raises(SystemExit, match=r"--merge: .*\['attention_backend'\]"):
        ps.main(["--merge", first, pinned, "--out", str(tmp_path / "m")])


def test_policy_step_under_torchrun_with_sequence_parallelism(tmp_path):
    """Two CPU ranks (gloo), sp=2: both packings run, rank 0 alone writes the report."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
           "benchmarks.bench_policy_step", "--preset", "tiny-qwen3", "--prompt", "32", "--response-range", "4:12",
           "--mbs", "2", "--responses-per-step", "4", "--sp", "2", "--device", "cpu", "--steps", "1", "--warmup", "0",
           "--out", str(tmp_path), "--stem", "sp2"]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    data = json.loads((tmp_path / "sp2.json").read_text())
    assert data["meta"]["world_size"] == 2 and data["meta"]["sp"] == 2
    assert [(r["packing"], r["status"]) for r in data["rows"]] == [("dualkv", "ok"), ("replicated", "ok")]
    assert "2 ranks: FSDP2 over all, sequence parallelism 2" in (tmp_path / "sp2.md").read_text()


def test_policy_step_with_old_logprobs_from_the_update(tmp_path, one_thread):
    """--old-logprobs from-update: no old_log_prob phase, one forward fewer in the useful FLOPs, and
    the report says so."""
    out = ps.main(["--preset", "tiny-qwen3", "--prompt", "32", "--response-range", "4:8", "--mbs", "4",
                   "--responses-per-step", "4", "--packings", "dualkv", "--steps", "1", "--warmup", "0",
                   "--peak-tflops", "1", "--device", "cpu", "--old-logprobs", "from-update", "--out", str(tmp_path),
                   "--stem", "reuse"])
    row = json.loads(out.read_text())["rows"][0]
    assert row["status"] == "ok" and row["time_old_log_prob"] is None and row["time_update"] > 0
    assert "old log-probs from the update (no old_log_prob pass)" in (tmp_path / "reuse.md").read_text()


def test_policy_step_with_a_logprob_budget_and_one_reduction(tmp_path, one_thread):
    """--logprob-micro-batch-tokens (both groups in one no-grad forward) and --reduce-grads-once reach the
    trainer and the report."""
    flags = ["--logprob-micro-batch-tokens", "1K", "--reduce-grads-once"]
    out = ps.main(["--preset", "tiny-qwen3", "--prompt", "32", "--response-range", "4:8", "--mbs", "2",
                   "--responses-per-step", "4", "--packings", "dualkv", "--steps", "1", "--warmup", "0",
                   "--peak-tflops", "1", "--device", "cpu", *flags, "--out", str(tmp_path), "--stem", "lp"])
    data = json.loads(out.read_text())
    assert data["rows"][0]["status"] == "ok"
    assert data["meta"]["logprob_micro_batch_tokens"] == 1024 and data["meta"]["reduce_grads_once"] is True
    cfg = ps.train_config(ps.parse_args(flags), "dualkv", 2)
    assert cfg.update.logprob_micro_batch_tokens == 1024 and cfg.parallel.reduce_grads_once
    text = (tmp_path / "lp.md").read_text()
    assert "no-grad passes in micro-batches of up to 1024 tokens" in text and "gradients reduced once per mini-batch" in text


def test_policy_step_rejects_an_unknown_old_logprobs_mode(capsys):
    with pytest.raises(SystemExit):
        ps.parse_args(["--old-logprobs", "reuse"])
    err = capsys.readouterr().err
    assert "--old-logprobs" in err and "invalid choice: 'reuse'" in err


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
        assert len(r["time_compute_steps"]) == r["steps"] and r["time_compute_steps"][0] == pytest.approx(r["time_compute"])
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
    assert "3 phases s (steps' range)" in (tmp_path / "step.md").read_text()


def test_gpu_monitor_reports_the_clock_of_a_window():
    """GpuMonitor keeps timestamped (clock, power) samples from its command's output (nvidia-smi's csv
    rows, here a stand-in) and gives their medians over a stretch of the run; a CPU run samples nothing.
    The policy-step table prints them under the phases."""
    import sys
    import time

    from benchmarks.gpu_monitor import GpuMonitor, parse_sample

    assert parse_sample("1980, 120.14") == (1980.0, 120.14)
    assert parse_sample("1650, [N/A]") == (1650.0, None)
    assert parse_sample("clocks.sm [MHz], power.draw [W]") is None and parse_sample("No devices were found") is None
    script = "import time\nfor c in (1980, 1650, 1700, 1710):\n    print(f'{c}, 600.5', flush=True)\n    time.sleep(0.05)\ntime.sleep(30)"
    t0 = time.monotonic()
    with GpuMonitor(0, command=[sys.executable, "-c", script]) as mon:
        deadline = time.monotonic() + 20
        while len(mon.samples) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
    t1 = time.monotonic()
    assert mon.window(t0, t1) == dict(sm_clock_mhz=1705.0, power_w=600.5, samples=4)
    assert mon.window(t1 + 1, t1 + 2) is None
    # a window between two samples (shorter than the interval) takes the nearer one
    (ta, ca, _), (tb, cb, _) = mon.samples[1:3]
    assert mon.window(ta + 0.001, ta + 0.002)["sm_clock_mhz"] == ca
    assert mon.window(tb - 0.002, tb - 0.001) == dict(sm_clock_mhz=cb, power_w=600.5, samples=1)
    assert GpuMonitor(None).command is None
    with GpuMonitor(None) as idle:
        pass
    assert idle.window(0, time.monotonic()) is None
    with pytest.raises(ValueError, match="interval_ms: expected at least 20, got 5"):
        GpuMonitor(0, interval_ms=5)
    meta = dict(P=64, response_range=[8, 16], responses_per_step=8, steps=1, warmup=1)
    row = dict(packing="dualkv", mb=8, status="ok", time_old_log_prob=0.1, time_ref_log_prob=0.1, time_update=0.2,
               time_compute=0.4, tokens_per_s=1.0, effective_tokens_per_s=2.0, mfu=0.5, useful_mfu=0.5,
               peak_memory_gib=None, rho=2.0, packed_tokens=10, replicated_tokens=20)
    assert "SM clock" not in ps.tables([row], meta)  # files from before the monitor, CPU runs
    text = ps.tables([dict(row, sm_clock_mhz=1690.0, power_w=675.2)], meta)
    assert "dualkv mb=8 1690 MHz, 675 W" in text


def test_policy_step_table_shows_the_steps_spread():
    """A median hides steps that differ (a compile mid-step, a host stall): the table prints their range."""
    row = dict(time_compute=2.0, time_compute_steps=[1.9, 2.0, 2.6])
    assert ps._phase_range(row) == "2.000 (1.900-2.600)"
    assert ps._phase_range(dict(time_compute=2.0)) == "2.000"  # files written before the field
    assert ps._phase_range(dict(time_compute=2.0, time_compute_steps=[2.0])) == "2.000"


def test_policy_step_reports_where_it_ran_out_of_memory(tmp_path, one_thread, monkeypatch):
    """An out-of-memory error in the update of the measured step (the second mini-batch, after the
    warm-up's one): the row says OOM, the stage, the phase and the allocation the error names, and the
    markdown shows it."""
    from dualkv.train.update import PolicyUpdater

    calls = []
    real = PolicyUpdater._update_mini_batch

    def failing(self, groups, tokens):
        calls.append(len(groups))
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.50 GiB. GPU 0 has a total capacity of 139.80 GiB")
        return real(self, groups, tokens)

    monkeypatch.setattr(PolicyUpdater, "_update_mini_batch", failing)
    out = ps.main(["--preset", "tiny-qwen3", "--prompt", "32", "--response-range", "4:8", "--mbs", "2",
                   "--packings", "dualkv", "--responses-per-step", "4", "--steps", "1", "--warmup", "1",
                   "--device", "cpu", "--out", str(tmp_path), "--stem", "oom"])
    row = json.loads(out.read_text())["rows"][0]
    assert len(calls) == 2
    assert row["status"] == "OOM" and row["oom_at"] == "measured step 1, update (tried to allocate 2.50 GiB)"
    assert "| dualkv | 2 | OOM in measured step 1, update (tried to allocate 2.50 GiB) |" in (tmp_path / "oom.md").read_text()


def test_oom_place_without_a_phase_or_a_size():
    assert ps.oom_place("building the trainer", None, RuntimeError("CUDA out of memory")) == "building the trainer"
    assert ps.oom_place("measured step 2", "ref_log_prob", RuntimeError("out of memory")) == "measured step 2, ref_log_prob"


def test_policy_step_profile(tmp_path, one_thread):
    out = ps.main(["--preset", "tiny-qwen3", "--prompt", "32", "--response-range", "4:8", "--mbs", "4",
                   "--packings", "dualkv", "--responses-per-step", "4", "--steps", "1", "--warmup", "0",
                   "--device", "cpu", "--out", str(tmp_path), "--stem", "prof", "--profile", "--keep-attention",
                   "--attention-backend", "reference"])
    data = json.loads(out.read_text())
    row = data["rows"][0]
    md = (tmp_path / "prof.md").read_text()
    assert data["meta"]["keep_attention"] and "keeping attention outputs" in md
    assert data["meta"]["attention_backend"] == "reference" and "attention backend reference" in md
    text = (tmp_path / row["profile"]).read_text()
    assert row["profile"] == "prof_dualkv_mb4_profile.txt" and "Self CPU" in text and "aten::" in text
    assert text.startswith("CPU") and "`python -m benchmarks.bench_policy_step" in text.splitlines()[0]
    assert [line for line in text.splitlines() if line.startswith("## ")] == ["## by op", "## by op and input shapes"]
    assert "Input Shapes" in text


def test_policy_step_rejects_bad_mbs():
    with pytest.raises(SystemExit):
        ps.parse_args(["--mbs", "3", "--responses-per-step", "16", "--device", "cpu"])


def test_policy_step_rejects_an_sp_size_that_does_not_divide_the_world(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(SystemExit):
        ps.parse_args(["--sp", "3", "--mbs", "4", "--device", "cpu"])
    assert "--sp: expected a divisor of the world size 4, got 3" in capsys.readouterr().err


def test_response_range_and_first_layers():
    import argparse

    assert ms.parse_range("131:2K") == (131, 2048) and ms.parse_range("64") == (64, 64)
    with pytest.raises(argparse.ArgumentTypeError, match="MIN <= MAX, got '9:4'"):
        ms.parse_range("9:4")
    with pytest.raises(ValueError, match="size: expected a positive whole number of tokens, got '0'"):
        ms.parse_range("0:5")
    from dualkv.models import from_hf_config, preset_hf_config

    hf = preset_hf_config("gemma4-31b")
    cut = ms.first_layers(hf, 4)
    assert hf["num_hidden_layers"] == 60 and len(cut["layer_types"]) == 4  # the preset itself is left alone
    assert [layer.attention.head_dim for layer in from_hf_config(cut).layers] == [256, 256, 256, 512]
    kv = ms.first_layers(preset_hf_config("tiny-gemma4-e"), 2)
    assert kv["num_kv_shared_layers"] == 0 and len(from_hf_config(kv).layers) == 2
