"""A policy update queues its micro-batches without waiting for the GPU.

One host synchronisation per micro-batch (a blocking copy to the device, ``.item()``, ``.cpu()``,
an op whose output size depends on device data) makes the host wait until every queued kernel has
run; the GPU then idles while the host builds and launches the next micro-batch. Under
``torch.cuda.set_sync_debug_mode("error")`` every such call raises, so building a micro-batch from
host tokens, the model's forward, the GRPO loss and the backward must make none once warmed up.
"""

from __future__ import annotations

import functools
from collections import defaultdict

import pytest
import torch

import dualkv.models as M
from dualkv.core import dualkv_attention
from dualkv.train.batching import build_micro_batch, plan_micro_batches
from dualkv.train.losses import LossConfig, LossNorm
from dualkv.train.sources import SyntheticConfig, SyntheticRolloutSource
from dualkv.train.update import PolicyUpdater, UpdateConfig

pytestmark = pytest.mark.gpu
DEVICE = "cuda"
SMALL = {
    "qwen3": dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=128, num_hidden_layers=2),
    "qwen3_moe": dict(vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=128, num_experts=16,
                      num_experts_per_tok=4, num_hidden_layers=2),
}


def small_config(name):
    cfg = M.preset_hf_config("tiny-qwen3" if name == "qwen3" else "tiny-qwen3-moe")
    cfg.update(SMALL[name])
    return cfg


def _micro_batches(vocab):
    cfg = SyntheticConfig(num_groups=3, n=4, prompt_len=(200, 300), response_len=(20, 90), vocab_size=vocab, seed=0)
    batch = SyntheticRolloutSource(cfg).rollouts(0).with_advantages(LossConfig.grpo(kl_beta=0.0))
    groups = list(batch.groups)
    return groups, plan_micro_batches(groups, "dualkv", 1, 1)[0]  # one group per micro-batch


@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
def test_micro_steps_make_no_host_sync(name, backend):
    from dualkv.core.backends import cuda as cuda_backend

    if backend == "cuda" and not cuda_backend.is_available():
        pytest.skip(cuda_backend.unavailable_reason())
    cfg = small_config(name)
    model = M.build_model(cfg, dtype=torch.bfloat16, device=DEVICE, seed=0)
    model.set_attn_fn(functools.partial(dualkv_attention, backend=backend))
    if name == "qwen3_moe":
        model.set_moe_backend("grouped")
    updater = PolicyUpdater(model, torch.optim.SGD(model.parameters(), lr=0.0), LossConfig.grpo(kl_beta=0.0),
                            UpdateConfig(packing="dualkv"), device=DEVICE)
    groups, plan = _micro_batches(cfg["vocab_size"])
    norm = LossNorm(num_rows=sum(g.num_responses for g in groups), num_tokens=sum(sum(g.response_lens) for g in groups))
    sums = defaultdict(lambda: torch.zeros((), device=DEVICE))

    updater._micro_step(build_micro_batch(groups, plan[0], "dualkv", DEVICE), norm, 1.0, sums)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for mb in plan[1:]:  # new lengths: new layouts, new schedules
            updater._micro_step(build_micro_batch(groups, mb, "dualkv", DEVICE), norm, 1.0, sums)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(sums["loss"]).item()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
