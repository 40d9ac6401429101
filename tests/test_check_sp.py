"""benchmarks/check_sp.py (the multi-GPU SP correctness check) on CPU ranks with gloo, tiny presets."""

from __future__ import annotations

import json

import pytest
import torch

from dualkv.parallel.testing import run_local_world


def _run(out_dir: str):
    from benchmarks import check_sp

    path, passed = check_sp.main(["--presets", "tiny-qwen3,tiny-gemma4,tiny-qwen3-moe", "--layers", "3",
                                  "--prompt", "90", "--responses", "3", "--response-range", "5:40",
                                  "--device", "cpu", "--out", out_dir, "--stem", "sp"])
    return None if path is None else str(path), passed


def test_check_sp_two_and_four_ranks(tmp_path):
    results = run_local_world(_run, 4, str(tmp_path), threads=1)
    assert results[0][0] is not None and all(r[0] is None for r in results[1:])  # rank 0 writes
    assert all(passed for _, passed in results)
    data = json.loads((tmp_path / "sp.json").read_text())
    rows = data["rows"]
    assert [(r["preset"], r["sp"]) for r in rows] == [(p, s) for p in ("tiny-qwen3", "tiny-gemma4", "tiny-qwen3-moe")
                                                      for s in (2, 4)]
    for r in rows:
        assert r["status"] == "ok" and r["max_logprob_diff"] <= 5e-2 and 0 < r["grad_rel_err"] <= 5e-2
    assert data["meta"]["world_size"] == 4 and data["meta"]["command"].startswith("python -m benchmarks.check_sp")
    gemma = next(r for r in rows if r["preset"] == "tiny-gemma4")
    assert gemma["layers"] >= 3 and f"| tiny-gemma4 | {gemma['layers']} | 4 |" in (tmp_path / "sp.md").read_text()


def test_sp_sizes_must_divide_the_world():
    from benchmarks.check_sp import sp_sizes

    assert sp_sizes(None, 8) == [2, 4, 8] and sp_sizes("2", 6) == [2]
    with pytest.raises(SystemExit, match="--sp: expected sizes that divide the world size 6"):
        sp_sizes("4", 6)


def test_layers_must_be_positive():
    from benchmarks.check_sp import build_model

    with pytest.raises(SystemExit, match="--layers: expected >= 1, got 0"):
        build_model("tiny-qwen3", 0, "cpu", 0)


def test_a_cut_hybrid_keeps_every_attention_type():
    from benchmarks.check_sp import build_model, layers_to_cover_every_type
    from dualkv.models import preset_hf_config

    assert layers_to_cover_every_type(preset_hf_config("gemma4-31b")) == 6  # five sliding layers, then a global one
    assert layers_to_cover_every_type(preset_hf_config("qwen3-8b")) == 1
    tiny = preset_hf_config("tiny-gemma4")
    need = layers_to_cover_every_type(tiny)
    model = build_model("tiny-gemma4", 1, "cpu", 0)
    assert model.config.num_layers == need > 1
    assert {"sliding_attention", "full_attention"} <= set(tiny["layer_types"][:need])


def test_models_are_built_layer_by_layer_with_the_same_weights():
    """check_sp allocates its cut models one layer at a time (meta device first); the weights equal
    a whole-model build with the same seed, cast to bf16."""
    from benchmarks.check_sp import build_model, first_layers
    from dualkv.models import build_model as build, preset_hf_config

    model = build_model("tiny-qwen3", 2, "cpu", 3)
    want = build(first_layers(preset_hf_config("tiny-qwen3"), 2), seed=3).to(torch.bfloat16).state_dict()
    got = model.state_dict()
    assert got.keys() == want.keys()
    assert all(got[k].dtype == torch.bfloat16 and torch.equal(got[k], want[k]) for k in want)
