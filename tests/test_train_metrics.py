"""FLOP formula pieces against hand counts and a brute-force mask count; the JSONL logger."""

import json
from types import SimpleNamespace as NS

import pytest
import torch

from dualkv.core import PackedLayout
from dualkv.train.metrics import (MetricsLogger, PhaseTimer, attention_pairs, forward_flops, forward_flops_by_part,
                                  token_flops)


def _brute_pairs(layout, window):
    cu, cs, cl = layout.cu_seqlens.tolist(), layout.seg_ctx_start.tolist(), layout.seg_ctx_len.tolist()
    pairs = 0
    for s in range(len(cu) - 1):
        for i in range(cu[s + 1] - cu[s]):
            qpos = cl[s] + i
            kpos = list(range(cl[s])) + [cl[s] + j for j in range(i + 1)]  # context, then own prefix
            pairs += sum(1 for k in kpos if window is None or qpos - k < window)
    return pairs


@pytest.mark.parametrize("window", [None, 1, 3, 8, 100])
def test_attention_pairs_match_brute_force(window):
    layout = PackedLayout.from_lengths([5, 1, 9], [[3, 1, 7], [2], [1, 1, 12, 4]])
    assert attention_pairs(layout, window) == _brute_pairs(layout, window)


def test_attention_pairs_hand_value():
    # P=3 prompt: 1+2+3; responses of 2 (positions 3,4): 4+5 each
    layout = PackedLayout.from_lengths([3], [[2, 2]])
    assert attention_pairs(layout) == 6 + 9 + 9
    assert attention_pairs(layout, window=2) == 1 + 2 + 2 + 2 * (2 + 2)


def _config(moe=False):
    attn = NS(num_heads=2, num_kv_heads=1, head_dim=2, window=None, kv_source=None, k_eq_v=False)
    mlp = None if moe else NS(intermediate_size=8)
    moe_cfg = NS(num_experts=4, top_k=2, intermediate_size=3) if moe else None
    return NS(hidden_size=4, vocab_size=10, layers=(NS(attention=attn, mlp=mlp, moe=moe_cfg),))


def test_flop_formula_hand_values():
    # q,k,v: 2*4*(2+2)*2 = 64; o: 2*2*2*4 = 32; MLP 6*4*8 = 192
    assert token_flops(_config()) == 64 + 32 + 192
    # MoE: 6*4*3*2 = 144 experts + 2*4*4 = 32 router
    assert token_flops(_config(moe=True)) == 64 + 32 + 144 + 32
    layout = PackedLayout.from_lengths([3], [[2, 2]])
    # T=7 tokens, 4 response logits of 2*4*10, attention 4*2*2 per pair * 24 pairs
    assert forward_flops(_config(), layout) == 7 * 288 + 4 * 80 + 16 * 24
    assert forward_flops_by_part(_config(), layout) == {"products": 7 * 288, "head": 4 * 80, "attention": 16 * 24}


def test_logger_and_timer(tmp_path):
    log = MetricsLogger(tmp_path, tensorboard=False)
    timer = PhaseTimer()
    with timer.phase("update"):
        torch.ones(10).sum()
    times = timer.reset()
    assert set(times) == {"update"} and times["update"] >= 0 and timer.reset() == {}
    log.log(3, {"loss": torch.tensor(0.5), "mfu": float("nan"), "n": 2})
    rec = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert rec == {"step": 3, "loss": 0.5, "mfu": None, "n": 2}


def test_timer_names_the_phase_an_error_left():
    """The innermost phase an exception passes through, kept until reset(); its time still counts."""
    timer = PhaseTimer()
    with timer.phase("update"):
        pass
    assert timer.failed_in is None
    with pytest.raises(torch.OutOfMemoryError):
        with timer.phase("update"):
            with timer.phase("optimizer"):
                raise torch.OutOfMemoryError("out of memory")
    assert timer.failed_in == "optimizer" and set(timer.seconds) == {"update", "optimizer"}
    timer.reset()
    assert timer.failed_in is None


def test_timer_phases_are_profiler_regions():
    """A profiled step shows each phase as a ``phase:<name>`` region around its operators."""
    from torch.profiler import ProfilerActivity, profile

    timer = PhaseTimer()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with timer.phase("ref_log_prob"):
            torch.ones(10).sum()
    regions = [e for e in prof.events() if e.name == "phase:ref_log_prob"]
    assert len(regions) == 1
    inside = [e for e in prof.events() if e.name == "aten::sum"]
    assert inside and regions[0].time_range.start <= inside[0].time_range.start <= regions[0].time_range.end
