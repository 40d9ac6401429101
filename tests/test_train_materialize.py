"""A preset built on the meta device and materialised layer by layer under FSDP2 (what the trainer
does for random-weight presets) has exactly the values of an ordinary seeded build, and every decoder
layer is sharded as soon as it exists."""

from __future__ import annotations

import pytest
import torch

from dualkv.parallel.testing import run_local_world


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen3-moe", "tiny-gemma4"])
def test_materialize_equals_a_seeded_build(preset):
    from dualkv.models import build_model, materialize

    model = build_model(preset, device="meta")
    units = list(model.model.layers)
    seen = []

    def on_unit(layer):  # when a layer is handed over, it is allocated and the next one is not yet
        seen.append(layer)
        later = units[len(seen):]
        assert not any(p.is_meta for p in layer.parameters()) and all(p.is_meta for u in later for p in u.parameters())

    materialize(model, "cpu", seed=5, units=units, on_unit=on_unit)
    assert seen == units
    want = build_model(preset, seed=5).state_dict()
    got = model.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight


def _sharded_build(preset):
    from torch.distributed.tensor import DTensor

    from dualkv.models import build_model
    from dualkv.train.distributed import ParallelConfig, full_state_dict, init_distributed, parallelize_policy

    ctx = init_distributed(sp=1, device="cpu")
    model = parallelize_policy(build_model(preset, device="meta"), ctx, ParallelConfig(param_dtype="fp32"), seed=5)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    state = full_state_dict(model)
    if ctx.rank != 0:
        return None
    want = build_model(preset, seed=5).state_dict()
    return sorted(k for k in want if not torch.equal(want[k], state[k].to(want[k].dtype)))


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-gemma4"])
def test_fsdp_materialised_model_equals_a_seeded_build(preset):
    assert run_local_world(_sharded_build, 2, preset) == [[], None]


def _meta_model_without_seed():
    from dualkv.models import build_model
    from dualkv.train.distributed import ParallelConfig, init_distributed, parallelize_policy

    ctx = init_distributed(sp=1, device="cpu")
    with pytest.raises(ValueError, match="seed: a model on the meta device needs the seed"):
        parallelize_policy(build_model("tiny-qwen3", device="meta"), ctx, ParallelConfig(param_dtype="fp32"))
    return True


def test_a_meta_model_needs_a_seed():
    assert run_local_world(_meta_model_without_seed, 1) == [True]


def test_materialize_names_a_wrong_model():
    from dualkv.models import materialize

    with pytest.raises(ValueError, match="model: expected a dualkv.models.CausalLM, got Linear"):
        materialize(torch.nn.Linear(2, 2, device="meta"), "cpu", seed=0)
