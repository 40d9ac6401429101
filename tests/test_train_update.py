"""One policy update: DualKV packing equals the replicated baseline (loss, gradients, parameter update)."""

import copy
from dataclasses import replace

import pytest
import torch

from dualkv.models import build_model
from dualkv.train.batching import plan_micro_batches
from dualkv.train.losses import LossConfig
from dualkv.train.rollout import RolloutBatch, RolloutGroup
from dualkv.train.sources import SyntheticConfig, SyntheticRolloutSource
from dualkv.train.update import PolicyUpdater, UpdateConfig, split_mini_batches

RTOL = 1e-5


pytestmark = pytest.mark.usefixtures("one_thread")


def _rollouts(seed=0, groups=3, n=4):
    cfg = SyntheticConfig(num_groups=groups, n=n, prompt_len=(5, 12), response_len=(1, 6), vocab_size=256, seed=seed)
    return SyntheticRolloutSource(cfg).rollouts(0)


def _run(model, batch, loss_cfg, packing, budget, *, optim="adamw", lr=1e-3, **update):
    policy = copy.deepcopy(model)
    reference = copy.deepcopy(model).requires_grad_(False) if loss_cfg.needs_reference else None
    if optim == "adamw":
        opt = torch.optim.AdamW(policy.parameters(), lr=lr, weight_decay=0.01)
    else:
        opt = torch.optim.SGD(policy.parameters(), lr=lr, weight_decay=0.01)
    up = PolicyUpdater(policy, opt, loss_cfg, UpdateConfig(packing=packing, micro_batch_tokens=budget, **update),
                       reference=reference)
    before = {k: v.detach().clone() for k, v in policy.named_parameters()}
    metrics = up.step(batch)
    grads = {k: p.grad.detach().clone() for k, p in policy.named_parameters() if p.grad is not None}
    delta = {k: p.detach() - before[k] for k, p in policy.named_parameters()}
    return metrics, grads, delta


def _rel(a: dict, b: dict, mask: dict | None = None) -> float:
    def sel(d, k):
        return d[k].double() if mask is None else d[k].double()[mask[k]]

    num = sum(float((sel(a, k) - sel(b, k)).square().sum()) for k in a)
    den = sum(float(sel(a, k).square().sum()) for k in a)
    return (num / den) ** 0.5


def _assert_same(model, batch, loss_cfg, budget_a, budget_b, packing_b="replicated"):
    """Loss, gradients and parameter update of one policy step: dualkv (budget_a) vs packing_b (budget_b).

    SGD over two epochs (the second one off-policy: ratio != 1, KL != 0): loss, last gradients and the
    total update agree to 1e-5. AdamW (one step): gradients agree to 1e-5 and so does the update of
    every element whose gradient is above fp32 rounding level; Adam divides each gradient by its own
    magnitude, so elements whose gradient IS rounding noise (|g| ~ 1e-9) differ under any change of
    summation order, packed or not.
    """
    sgd_a = _run(model, batch, loss_cfg, "dualkv", budget_a, optim="sgd", lr=0.5, epochs=2)
    sgd_b = _run(model, batch, loss_cfg, packing_b, budget_b, optim="sgd", lr=0.5, epochs=2)
    (ma, ga, da), (mb, gb, db) = sgd_a, sgd_b
    assert ga.keys() == gb.keys() and len(ga) > 0
    assert abs(ma["loss"]) > 1e-4 and ma["loss"] == pytest.approx(mb["loss"], rel=RTOL)
    assert _rel(ga, gb) <= RTOL and _rel(da, db) <= RTOL
    (ma, ga, da), (mb, gb, db) = (_run(model, batch, loss_cfg, "dualkv", budget_a),
                                  _run(model, batch, loss_cfg, packing_b, budget_b))
    assert _rel(ga, gb) <= RTOL
    above_noise = {k: ga[k].abs() > 1e-6 * ga[k].abs().max() for k in ga}
    assert _rel(da, db, above_noise) <= RTOL
    return ma, mb


@pytest.mark.parametrize("algorithm", ["grpo", "dapo"])
def test_dualkv_equals_replicated_dense(algorithm):
    model = build_model("tiny-qwen3", seed=1)
    batch = _rollouts(seed=2)
    loss_cfg = getattr(LossConfig, algorithm)()
    # A budget that splits both packings into several (different) micro-batches.
    budget = 2 * max(g.packed_tokens for g in batch.groups)
    assert len(plan_micro_batches(batch, "dualkv", budget)[0]) < len(plan_micro_batches(batch, "replicated", budget)[0])
    packed, _ = _assert_same(model, batch, loss_cfg, budget, budget)
    if algorithm == "grpo":
        assert packed["kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before the step


@pytest.mark.parametrize("algorithm", ["grpo", "dapo"])
def test_dualkv_equals_replicated_moe(algorithm):
    model = build_model("tiny-qwen3-moe", seed=3)
    batch = _rollouts(seed=4)
    loss_cfg = getattr(LossConfig, algorithm)()
    # The load-balancing loss is a statistic of one forward: compare on the same (single) micro-batch.
    packed, replicated = _assert_same(model, batch, loss_cfg, 10_000, 10_000)
    assert packed["aux_loss"] > 0
    assert packed["aux_loss"] == pytest.approx(replicated["aux_loss"], rel=RTOL)


def test_gradient_accumulation_is_independent_of_the_split():
    model = build_model("tiny-qwen3", seed=5)
    batch = _rollouts(seed=6, groups=4)
    loss_cfg = LossConfig.dapo(drop_uniform_groups=False)
    _assert_same(model, batch, loss_cfg, 10_000, 1, packing_b="dualkv")  # one micro-batch vs one per group


def test_on_policy_step_metrics_and_mini_batches():
    model = build_model("tiny-qwen3", seed=7)
    batch = _rollouts(seed=8, groups=4)
    m, _, _ = _run(model, batch, LossConfig.grpo(kl_beta=0.0), "dualkv", 10_000, mini_batches=2)
    assert m["optimizer_steps"] == 2 and m["groups_used"] == 4
    assert m["grad_norm"] > 0 and 0.0 <= m["clip_frac"] <= 1.0
    # The first mini-batch is on-policy: ratio 1, so nothing is clipped there.
    m1, _, _ = _run(model, batch, LossConfig.grpo(kl_beta=0.0), "dualkv", 10_000)
    assert m1["approx_kl"] == pytest.approx(0.0, abs=1e-7) and m1["clip_frac"] == 0.0


@pytest.mark.parametrize("packing", ["dualkv", "replicated"])
def test_one_step_per_batch_takes_old_logprobs_from_the_update(packing):
    """mini_batches = epochs = 1: no old_log_prob pass (its phase and FLOPs absent), and the update is
    the one the recomputed old log-probs give: loss, gradients and the AdamW step agree to fp32
    rounding (as in _assert_same, the step where the gradient is above rounding level)."""
    model = build_model("tiny-qwen3", seed=11)
    batch = _rollouts(seed=12, groups=3)
    loss_cfg = LossConfig.grpo(kl_beta=0.04)
    assert UpdateConfig().old_logprobs_from_update
    assert not UpdateConfig(mini_batches=2).old_logprobs_from_update
    assert not UpdateConfig(epochs=2).old_logprobs_from_update
    assert not UpdateConfig(recompute_old_logprobs=True).old_logprobs_from_update
    mf, gf, df = _run(model, batch, loss_cfg, packing, 40)
    mr, gr, dr = _run(model, batch, loss_cfg, packing, 40, recompute_old_logprobs=True)
    # On-policy, GRPO's group-normalised advantages average to 0: so does the loss, not its gradient.
    assert mf["loss"] == pytest.approx(mr["loss"], abs=1e-6) and any(bool(g.abs().max() > 0) for g in gf.values())
    assert mf["approx_kl"] == 0.0 and mf["clip_frac"] == 0.0
    assert _rel(gf, gr) <= RTOL
    above_noise = {k: gf[k].abs() > 1e-6 * gf[k].abs().max() for k in gf}
    assert _rel(df, dr, above_noise) <= RTOL
    # one forward of the batch less: (ref + 3 x update) against (old + ref + 3 x update) forwards
    assert mf["forward_flops_rank"] * 2 == mr["forward_flops_rank"]
    assert mf["update_flops_rank"] == mr["update_flops_rank"]


def test_old_logprob_phase_runs_only_when_needed():
    from dualkv.train.metrics import PhaseTimer

    model = build_model("tiny-qwen3", seed=13)
    batch = _rollouts(seed=14, groups=2)
    for update, phases in ((dict(), {"update"}), (dict(mini_batches=2), {"old_log_prob", "update"}),
                           (dict(recompute_old_logprobs=True), {"old_log_prob", "update"})):
        timer = PhaseTimer()
        policy = copy.deepcopy(model)
        up = PolicyUpdater(policy, torch.optim.SGD(policy.parameters(), lr=0.0), LossConfig.grpo(kl_beta=0.0),
                           UpdateConfig(micro_batch_tokens=10_000, **update), timer=timer)
        up.step(batch)
        assert set(timer.reset()) == phases, update


def test_flops_by_phase_split_the_step_flops():
    """The updater's FLOPs by phase and part (what a profile turns into speeds) add up to the step's
    FLOP counters, old and ref passes count the same batch, and each step starts them afresh."""
    from dualkv.train.metrics import forward_flops_by_part

    model = build_model("tiny-qwen3", seed=15)
    batch = _rollouts(seed=16, groups=2)
    policy, reference = copy.deepcopy(model), copy.deepcopy(model).requires_grad_(False)
    up = PolicyUpdater(policy, torch.optim.SGD(policy.parameters(), lr=0.0), LossConfig.grpo(kl_beta=0.04),
                       UpdateConfig(micro_batch_tokens=40, recompute_old_logprobs=True), reference=reference)
    for _ in range(2):
        m = up.step(batch)
        flops = {phase: dict(parts) for phase, parts in up.flops_by_phase.items()}
        assert set(flops) == {"old_log_prob", "ref_log_prob", "update"}
        assert flops["old_log_prob"] == flops["ref_log_prob"] == flops["update"]
        assert sum(flops["old_log_prob"].values()) + sum(flops["ref_log_prob"].values()) == m["forward_flops_rank"]
        assert 3 * sum(flops["update"].values()) == m["update_flops_rank"]
        assert all(flops["update"][part] > 0 for part in ("products", "head", "attention"))
    # one group in one micro-batch: its parts by hand
    one = RolloutBatch([batch.groups[0]])
    up.step(one)
    from dualkv.train.batching import build_micro_batch

    plan = plan_micro_batches(one.groups, "dualkv", 40, 1)[0]
    assert len(plan) == 1
    layout = build_micro_batch(list(up.prepare(one).groups), plan[0], "dualkv", "cpu").layout
    assert dict(up.flops_by_phase["update"]) == forward_flops_by_part(model.config, layout)


def test_logprob_passes_take_their_own_budget(monkeypatch):
    """old / ref passes under logprob_micro_batch_tokens: one forward each instead of one per group,
    and the same loss, KL, gradients and update as under the update's budget."""
    import dualkv.train.update as upd

    real, no_grad_rows = upd.policy_logprobs, []

    def spy(model, layout, *args, **kwargs):
        if not torch.is_grad_enabled():
            no_grad_rows.append(layout.num_rows)
        return real(model, layout, *args, **kwargs)

    monkeypatch.setattr(upd, "policy_logprobs", spy)
    model = build_model("tiny-qwen3", seed=5)
    batch = _rollouts(seed=6, groups=3, n=4)
    runs = {}
    for budget in (None, 10_000):
        no_grad_rows.clear()
        # SGD over two epochs, as _assert_same: the second one off-policy, so loss and KL are not 0
        runs[budget] = _run(model, batch, LossConfig.grpo(), "dualkv", 1, optim="sgd", lr=0.5, epochs=2,
                            logprob_micro_batch_tokens=budget)
        runs[budget] += (list(no_grad_rows),)
    (m1, g1, d1, rows1), (m2, g2, d2, rows2) = runs[None], runs[10_000]
    assert rows1 == [4] * 6 and rows2 == [12, 12]  # old and ref: a forward per group, then one per pass
    assert abs(m1["loss"]) > 1e-4 and abs(m1["kl"]) > 0
    for key in ("loss", "kl"):
        assert m2[key] == pytest.approx(m1[key], rel=RTOL), key
    assert _rel(g1, g2) <= RTOL and _rel(d1, d2) <= RTOL
    with pytest.raises(ValueError, match="logprob_micro_batch_tokens: expected >= 1 or None, got 0"):
        UpdateConfig(logprob_micro_batch_tokens=0)


def test_uniform_groups_are_dropped_or_skipped():
    model = build_model("tiny-qwen3", seed=9)
    g = _rollouts(seed=10, groups=2).groups
    uniform = RolloutBatch([RolloutGroup(x.prompt_ids, x.response_ids, torch.ones(x.num_responses), uid=x.uid) for x in g])
    m, grads, _ = _run(model, uniform, LossConfig.dapo(), "dualkv", 10_000)
    assert m["skipped"] == 1.0 and not grads
    mixed = RolloutBatch([uniform.groups[0], g[1]] if bool((g[1].rewards != g[1].rewards[0]).any()) else g)
    m, _, _ = _run(model, mixed, LossConfig.dapo(), "dualkv", 10_000)
    assert m["skipped"] == 0.0 and m["groups_used"] >= 1


def test_bad_update_arguments():
    with pytest.raises(ValueError, match="packing"):
        UpdateConfig(packing="padded")
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        UpdateConfig(micro_batch_tokens=0)
    with pytest.raises(ValueError, match="mini_batches: 3 mini-batches need at least as many groups, got 2"):
        split_mini_batches(2, 3)
    assert split_mini_batches(5, 2) == [[0, 1, 2], [3, 4]]
    model = build_model("tiny-qwen3", seed=0)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="reference: expected a reference model because kl_beta=0.04"):
        PolicyUpdater(model, opt, LossConfig.grpo(), UpdateConfig())
    with pytest.raises(ValueError, match="reduce_grads_once: expected an FSDP2-wrapped policy .fully_shard., got a plain CausalLM"):
        PolicyUpdater(model, opt, LossConfig.grpo(kl_beta=0.0), UpdateConfig(), reduce_grads_once=True)


def test_logprob_pass_queues_every_micro_batch_before_copying_to_the_host(monkeypatch):
    """old / ref log-probs: every micro-batch's forward is issued before the first result is copied to
    the host (a copy waits for the device), and the values are those of a forward per micro-batch."""
    import dualkv.train.update as upd

    events = []

    class Watched(torch.Tensor):
        def cpu(self, *args, **kwargs):
            events.append("to host")
            return super().cpu(*args, **kwargs)

    real = upd.policy_logprobs

    def spy(*args, **kwargs):
        events.append("forward")
        return real(*args, **kwargs).float().as_subclass(Watched)

    monkeypatch.setattr(upd, "policy_logprobs", spy)
    model = build_model("tiny-qwen3", seed=3)
    batch = _rollouts(seed=4, groups=3)
    up = PolicyUpdater(model, torch.optim.SGD(model.parameters(), lr=0.0), LossConfig.grpo(kl_beta=0.0),
                       UpdateConfig(packing="dualkv", micro_batch_tokens=1))  # one group a micro-batch
    groups = up._logprob_pass(model, list(up.prepare(batch).groups), "old_logprobs")
    assert events == ["forward"] * 3 + ["to host"] * 3
    for g in groups:  # each group alone through the model gives the same values
        monkeypatch.setattr(upd, "policy_logprobs", real)
        alone = up._logprob_pass(model, [replace(g, old_logprobs=None)], "old_logprobs")[0]
        assert all(torch.equal(a, b) for a, b in zip(g.old_logprobs, alone.old_logprobs))
