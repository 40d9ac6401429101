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


def _frozen_reference(meta: bool):
    from torch.distributed.tensor import DTensor

    from dualkv.core import PackedLayout
    from dualkv.models import build_model
    from dualkv.train.distributed import ParallelConfig, init_distributed, parallelize_policy
    from dualkv.train.update import policy_logprobs

    ctx = init_distributed(sp=1, device="cpu")
    cfg = ParallelConfig(param_dtype="bf16")
    build = (lambda: build_model("tiny-qwen3", device="meta")) if meta else (lambda: build_model("tiny-qwen3", seed=5))
    ref = parallelize_policy(build(), ctx, cfg, trainable=False, seed=5)
    policy = parallelize_policy(build(), ctx, cfg, seed=5)
    dtypes = {p.to_local().dtype for p in ref.parameters() if isinstance(p, DTensor)}
    assert dtypes == {torch.bfloat16} and all(not p.requires_grad for p in ref.parameters()), dtypes
    assert {p.to_local().dtype for p in policy.parameters()} == {torch.float32}
    g = torch.Generator().manual_seed(1)
    layout = PackedLayout.from_groups([(torch.randint(0, 100, (9,), generator=g),
                                        [torch.randint(0, 100, (n,), generator=g) for n in (4, 7)])])
    with torch.no_grad():
        return torch.equal(policy_logprobs(ref, layout), policy_logprobs(policy, layout))


@pytest.mark.parametrize("meta", [False, True], ids=["built", "meta"])
def test_frozen_reference_is_stored_in_the_compute_dtype(meta):
    """The frozen reference keeps its parameters in bf16 (no fp32 master copy: half the memory) and
    gives bit-identical log-probs to an fp32-stored copy of the same weights under bf16 FSDP."""
    assert run_local_world(_frozen_reference, 2, meta) == [True, True]
