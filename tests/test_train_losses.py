"""GRPO / DAPO losses against hand-derived values, edge cases and partition independence."""

import math

import pytest
import torch

from dualkv.train.losses import LossConfig, LossNorm, aggregate, group_advantages, kl_estimate, policy_loss

LN = math.log


def _one_token(ratio: float, adv: float, cfg: LossConfig):
    logp = torch.tensor([[LN(ratio)]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 1, dtype=torch.float64)
    mask = torch.ones(1, 1, dtype=torch.bool)
    loss, stats = policy_loss(logp, old, torch.tensor([adv], dtype=torch.float64), mask, cfg)
    loss.backward()
    return loss.item(), logp.grad.item(), stats


@pytest.mark.parametrize(
    "ratio, adv, eps_low, eps_high, expected, clipped",
    [
        (1.0, 2.0, 0.2, 0.2, -2.0, False),  # on-policy: -A
        (1.5, 1.0, 0.2, 0.2, -1.2, True),  # positive A, ratio above 1 + eps: clipped to 1.2
        (1.5, -1.0, 0.2, 0.2, 1.5, False),  # negative A, ratio above: pessimistic unclipped term wins
        (0.5, 1.0, 0.2, 0.2, -0.5, False),  # positive A, ratio below: unclipped term is larger
        (0.5, -1.0, 0.2, 0.2, 0.8, True),  # negative A, ratio below 1 - eps: clipped to 0.8
        (1.25, 1.0, 0.2, 0.28, -1.25, False),  # clip-higher lets 1.25 through
        (1.25, 1.0, 0.2, 0.2, -1.2, True),  # ... which the symmetric clip stops
    ],
)
def test_clipped_surrogate_hand_values(ratio, adv, eps_low, eps_high, expected, clipped):
    cfg = LossConfig(eps_low=eps_low, eps_high=eps_high, aggregation="token-mean")
    loss, grad, stats = _one_token(ratio, adv, cfg)
    assert loss == pytest.approx(expected, rel=1e-12)
    assert stats["clip_frac"].item() == float(clipped)
    # d/dlogp of -A*r is -A*r; a clipped token has no gradient.
    assert grad == pytest.approx(0.0 if clipped else -adv * ratio, abs=1e-12)


def test_dual_clip_bounds_negative_advantage_loss():
    cfg = LossConfig(dual_clip_c=3.0, aggregation="token-mean")
    loss, grad, stats = _one_token(5.0, -1.0, cfg)  # unclipped 5.0 > c * |A| = 3
    assert loss == pytest.approx(3.0) and grad == 0.0 and stats["dual_clip_frac"].item() == 1.0
    loss, grad, stats = _one_token(2.0, -1.0, cfg)  # 2.0 < 3: untouched
    assert loss == pytest.approx(2.0) and grad == pytest.approx(2.0) and stats["dual_clip_frac"].item() == 0.0
    loss, _, stats = _one_token(5.0, 1.0, cfg)  # positive advantages are never dual-clipped
    assert loss == pytest.approx(-1.2) and stats["dual_clip_frac"].item() == 0.0


def test_kl_estimators_hand_values():
    logp = torch.tensor([LN(0.5)], dtype=torch.float64)
    ref = torch.tensor([LN(0.25)], dtype=torch.float64)
    l2 = LN(2.0)
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(l2)
    assert kl_estimate(logp, ref, "k2").item() == pytest.approx(0.5 * l2 * l2)
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(0.5 + l2 - 1.0)
    assert kl_estimate(logp, ref, "low_var_kl").item() == pytest.approx(0.5 + l2 - 1.0)
    # k3 is non-negative and zero at equality; low_var_kl is bounded where k3 explodes.
    d = torch.linspace(-30, 30, 61, dtype=torch.float64)
    assert bool((kl_estimate(torch.zeros_like(d), d, "k3") >= 0).all())
    assert kl_estimate(torch.zeros(1), torch.zeros(1), "k3").item() == 0.0
    assert kl_estimate(torch.zeros(1), torch.tensor([30.0]), "low_var_kl").item() == 10.0
    assert kl_estimate(torch.zeros(1), torch.tensor([30.0]), "k3").item() > 1e12
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_estimate(logp, ref, "k4")


def test_aggregations_hand_values():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, float("nan"), 7.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    assert aggregate(values, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert aggregate(values, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert aggregate(values, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    # explicit mini-batch denominators
    assert aggregate(values, mask, "token-mean", LossNorm(num_rows=4, num_tokens=8)).item() == pytest.approx(10 / 8)
    assert aggregate(values, mask, "seq-mean-token-sum", LossNorm(num_rows=4, num_tokens=8)).item() == pytest.approx(10 / 4)
    # a row without tokens (even NaN ones) adds 0 in every mode and still counts as a row
    empty = torch.tensor([[True, True, True], [False, False, False]])
    assert aggregate(values, empty, "seq-mean-token-mean").item() == pytest.approx(2 / 2)
    assert aggregate(values, empty, "seq-mean-token-sum").item() == pytest.approx(6 / 2)
    assert aggregate(values, empty, "token-mean").item() == pytest.approx(6 / 3)


def test_grpo_kl_term_and_gradient():
    cfg = LossConfig.grpo(kl_estimator="k1", kl_beta=0.5)
    logp = torch.tensor([[LN(0.5), LN(0.5)]], requires_grad=True, dtype=torch.float64)
    old = logp.detach().clone()
    ref = torch.tensor([[LN(0.25), LN(0.5)]], dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, stats = policy_loss(logp, old, torch.tensor([1.0], dtype=torch.float64), mask, cfg, ref_logp=ref)
    # surrogate -1 per token; k1 = [ln 2, 0]; seq-mean-token-mean over one row
    assert loss.item() == pytest.approx(-1.0 + 0.5 * LN(2.0) / 2)
    assert stats["kl"].item() == pytest.approx(LN(2.0) / 2)
    loss.backward()
    # d/dlogp_t: (-A r_t + beta * 1) / |row| with r = 1
    assert logp.grad[0].tolist() == pytest.approx([(-1 + 0.5) / 2, (-1 + 0.5) / 2])


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("recipe", ["grpo", "dapo"])
def test_micro_batch_losses_add_up_to_mini_batch_loss(agg, recipe):
    torch.manual_seed(1)
    B, R = 7, 9
    cfg = getattr(LossConfig, recipe)(aggregation=agg, entropy_coeff=0.01)
    lens = torch.tensor([1, 9, 4, 2, 7, 3, 5])
    mask = torch.arange(R)[None] < lens[:, None]
    logp = (-torch.rand(B, R, dtype=torch.float64) * 3).requires_grad_()
    old = logp.detach() + 0.3 * torch.randn(B, R, dtype=torch.float64)
    ref = logp.detach() + 0.3 * torch.randn(B, R, dtype=torch.float64)
    ent = torch.rand(B, R, dtype=torch.float64)
    adv = torch.randn(B, dtype=torch.float64)
    full, _ = policy_loss(logp, old, adv, mask, cfg, ref_logp=ref, entropy=ent)
    (g_full,) = torch.autograd.grad(full, logp)
    norm = LossNorm.of(mask)
    parts = [slice(0, 3), slice(3, 4), slice(4, 7)]
    total = sum(policy_loss(logp[s], old[s], adv[s], mask[s], cfg, ref_logp=ref[s], entropy=ent[s], norm=norm)[0] for s in parts)
    (g_parts,) = torch.autograd.grad(total, logp)
    assert total.item() == pytest.approx(full.item(), rel=1e-12)
    torch.testing.assert_close(g_parts, g_full, rtol=1e-12, atol=1e-15)


def test_group_advantages_hand_values():
    rewards = torch.tensor([1.0, 0.0, 3.0, 3.0, 5.0, 2.0, 0.0, 1.0])
    ids = ["a", "a", "b", "b", "c", "d", "d", "d"]
    adv = group_advantages(rewards, ids, eps=0.0)
    s = 1 / math.sqrt(0.5)  # group a: centred +-0.5, unbiased std sqrt(0.5)
    assert adv[:2].tolist() == pytest.approx([0.5 * s, -0.5 * s])
    assert adv[2:4].tolist() == [0.0, 0.0]  # uniform group
    assert adv[4].item() == 0.0  # singleton: no baseline
    # group d: mean 1, centred [1, -1, 0], unbiased std 1
    assert adv[5:].tolist() == pytest.approx([1.0, -1.0, 0.0])
    plain = group_advantages(rewards, ids, norm_by_std=False)
    assert plain[5:].tolist() == pytest.approx([1.0, -1.0, 0.0]) and plain[:2].tolist() == pytest.approx([0.5, -0.5])


def test_group_advantages_are_order_invariant():
    torch.manual_seed(3)
    rewards = torch.randn(12)
    ids = torch.tensor([0, 1, 2] * 4)
    perm = torch.randperm(12)
    torch.testing.assert_close(group_advantages(rewards, ids)[perm], group_advantages(rewards[perm], ids[perm]))


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="dual_clip_c"):
        LossConfig(dual_clip_c=1.0)
    with pytest.raises(ValueError, match="eps_low"):
        LossConfig(eps_low=1.5)
    with pytest.raises(ValueError, match="aggregation"):
        LossConfig(aggregation="mean")
    with pytest.raises(ValueError, match="algorithm"):
        LossConfig(algorithm="ppo")
    mask = torch.ones(2, 3, dtype=torch.bool)
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(x, x, torch.zeros(2), mask, LossConfig(kl_beta=0.1))
    with pytest.raises(ValueError, match="old_logp"):
        policy_loss(x, torch.zeros(2, 4), torch.zeros(2), mask, LossConfig())
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(x, x, torch.zeros(3), mask, LossConfig())
    with pytest.raises(ValueError, match="mask"):
        policy_loss(x, x, torch.zeros(2), mask.float(), LossConfig())
    with pytest.raises(ValueError, match="rewards"):
        group_advantages(torch.tensor([1.0, float("nan")]), [0, 0])
    with pytest.raises(ValueError, match="group_ids"):
        group_advantages(torch.tensor([1.0, 0.0]), [0])
    with pytest.raises(ValueError, match="LossNorm"):
        LossNorm(num_rows=0, num_tokens=3)
