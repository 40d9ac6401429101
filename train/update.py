"""One RL policy update on a rollout batch: the three passes of a GRPO / DAPO step.

1. ``old_log_prob`` (no grad): log-probs of every response under the policy that is about to be
   updated (skipped when ``use_rollout_logprobs`` is on and the rollouts carry them, and when the
   update takes one optimizer step per rollout batch: see ``UpdateConfig.recompute_old_logprobs``);
2. ``ref_log_prob`` (no grad): under the frozen reference model, only when the loss has a KL term
   (skipped likewise when the rollouts carry reference log-probs);
3. ``update``: per mini-batch, forward + backward over its micro-batches with gradient accumulation,
   gradient-norm clipping, one optimizer (AdamW) step.

Every pass walks the same micro-batch plan (``batching.plan_micro_batches``): groups never split,
micro-batches formed by a token budget on the length the model runs (P + sum R under ``dualkv``,
sum (P + R) under ``replicated``), groups balanced over data-parallel ranks. Each micro-batch's loss
is normalised by the WHOLE mini-batch's row and token counts, so the accumulated gradient is the
mini-batch gradient whatever the split: both packings, any budget and any dp size give the same
update (to rounding). With several dp ranks the gradients of the replicas must be SUMMED: FSDP's
reduction averages over the ranks it shards over, so the backward loss is multiplied by that number
(``grad_scale``, see ``distributed``); SP ranks' shares add up to their replica's gradient.

The MoE load-balancing loss (``model.aux_loss``, weighted by ``moe.aux_loss_coef``) is a statistic of
one forward, so it is added per micro-batch with weight 1 / (micro-batches in the mini-batch, all
ranks); it matches the replicated baseline when both run the same micro-batches.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from .batching import PACKINGS, MicroBatch, Packing, build_micro_batch, plan_micro_batches
from .losses import LossConfig, LossNorm, policy_loss
from .metrics import PhaseTimer, forward_flops_by_part
from .rollout import RolloutBatch, RolloutGroup

__all__ = ["UpdateConfig", "PolicyUpdater", "policy_logprobs", "split_mini_batches"]

# The phase (PhaseTimer / profiler region) of each no-grad pass, by the field it fills.
PASS_PHASE = {"old_logprobs": "old_log_prob", "ref_logprobs": "ref_log_prob"}


@dataclass(frozen=True)
class UpdateConfig:
    """How a rollout batch becomes optimizer steps.

    packing: "dualkv" (prompt once per group) or "replicated" (prompt in every row: the baseline).
    micro_batch_tokens: token budget of one micro-batch (of the whole SP group, under ``packing``).
    logprob_micro_batch_tokens: the same budget for the no-grad passes (old_log_prob, ref_log_prob);
        None: ``micro_batch_tokens``. A no-grad forward keeps no activations for a backward, so it
        usually fits a larger budget than the update: fewer, larger launches for the same log-probs.
    mini_batches: optimizer steps per rollout batch (its groups split into this many mini-batches).
    epochs: passes over the rollout batch.
    max_grad_norm: clip the global gradient norm to this (None = no clipping).
    temperature: sampling temperature the log-probs are computed at.
    use_rollout_logprobs: take old / reference log-probs from the rollouts when they carry them
        (instead of recomputing them with the training engine).
    entropy: also compute per-token entropy (a metric; needed when the loss has an entropy bonus).
    recompute_old_logprobs: run the old_log_prob pass even when the update takes one optimizer step
        per rollout batch (mini_batches = epochs = 1). There the policy being updated IS the old
        policy, so by default the old log-probs are the update's own log-probs, detached, and that
        pass (a whole forward of the batch) is skipped: the PPO ratio is exactly 1 and its gradient
        the policy gradient, the value the recomputed log-probs give up to their rounding (as TRL
        does for one iteration per batch).
    """

    packing: Packing = "dualkv"
    micro_batch_tokens: int = 8192
    logprob_micro_batch_tokens: int | None = None
    mini_batches: int = 1
    epochs: int = 1
    max_grad_norm: float | None = 1.0
    temperature: float = 1.0
    use_rollout_logprobs: bool = False
    entropy: bool = True
    recompute_old_logprobs: bool = False

    def __post_init__(self) -> None:
        if self.packing not in PACKINGS:
            raise ValueError(f"packing: expected one of {PACKINGS}, got {self.packing!r}")
        for name in ("micro_batch_tokens", "mini_batches", "epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected >= 1, got {getattr(self, name)}")
        if self.logprob_micro_batch_tokens is not None and self.logprob_micro_batch_tokens < 1:
            raise ValueError(f"logprob_micro_batch_tokens: expected >= 1 or None, got {self.logprob_micro_batch_tokens}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm: expected > 0 or None, got {self.max_grad_norm}")
        if not self.temperature > 0:
            raise ValueError(f"temperature: expected > 0, got {self.temperature}")

    @property
    def old_logprobs_from_update(self) -> bool:
        """One optimizer step per rollout batch and no recompute asked: the update's own log-probs,
        detached, are the old ones (no old_log_prob pass)."""
        return self.mini_batches == 1 and self.epochs == 1 and not self.recompute_old_logprobs


def policy_logprobs(model, layout, sp_group=None, temperature: float = 1.0, return_entropy: bool = False):
    """(B, R_max) log-probs [, entropy] of a micro-batch: the model's forward, or Ulysses SP over ``sp_group``."""
    from dualkv.parallel import group_size, sp_response_logprobs

    if group_size(sp_group) > 1:
        return sp_response_logprobs(model, layout, sp_group, temperature, return_entropy)
    return model(layout, temperature, return_entropy)


def split_mini_batches(num_groups: int, mini_batches: int) -> list[list[int]]:
    """Contiguous, as-equal-as-possible chunks of group indices (earlier chunks one larger)."""
    if num_groups < mini_batches:
        raise ValueError(f"mini_batches: {mini_batches} mini-batches need at least as many groups, got {num_groups}")
    base, extra = divmod(num_groups, mini_batches)
    out, start = [], 0
    for m in range(mini_batches):
        n = base + (m < extra)
        out.append(list(range(start, start + n)))
        start += n
    return out


def _aux_loss(model, sp_group) -> torch.Tensor | None:
    """The MoE load-balancing loss of the last forward, times ``aux_loss_coef`` (None for dense models).

    Under SP each rank's router statistics cover its slice; they are summed over the SP group first."""
    from dualkv.models import load_balancing_loss
    from dualkv.parallel import group_size, sp_router_stats

    coefs = {layer.moe.aux_loss_coef for layer in model.config.layers if layer.moe is not None}
    if not coefs or max(coefs) == 0 or not getattr(model, "router_stats", None):
        return None
    if group_size(sp_group) > 1:
        aux = load_balancing_loss(sp_router_stats(model.router_stats, sp_group))
    else:
        aux = model.aux_loss
    return aux * max(coefs)


class PolicyUpdater:
    """Runs the three passes on this rank's share of every mini-batch.

    Args:
        policy: the causal LM being trained (possibly FSDP-wrapped); ``policy.config`` is its ModelConfig.
        optimizer: over the policy's parameters.
        loss_cfg / cfg: the objective and the update configuration.
        reference: frozen reference model (required when ``loss_cfg.kl_beta > 0``).
        sp_group: sequence-parallel group of this rank (None = no SP).
        dp_rank / dp_size / dp_group: this rank's data-parallel replica and the dp process group.
        device: where micro-batches are built.
        grad_scale: multiplies the backward loss; the number of ranks FSDP averages gradients over.
        reduce_grads_once: the policy is FSDP2-wrapped and reduces each mini-batch's gradients once,
            after its last micro-batch: before it, FSDP neither reduce-scatters the gradients (they add
            up unsharded, in fp32) nor frees the gathered parameters after a backward, so the next
            forward gathers nothing. Every rank runs the same number of micro-batches, so all reduce
            at the same one.
    """

    def __init__(self, policy, optimizer, loss_cfg: LossConfig, cfg: UpdateConfig, *, reference=None,
                 sp_group=None, dp_rank: int = 0, dp_size: int = 1, dp_group=None,
                 device: torch.device | str = "cpu", timer: PhaseTimer | None = None, grad_scale: float = 1.0,
                 reduce_grads_once: bool = False) -> None:
        if loss_cfg.needs_reference and reference is None:
            raise ValueError(f"reference: expected a reference model because kl_beta={loss_cfg.kl_beta} > 0, got None")
        if loss_cfg.entropy_coeff != 0 and not cfg.entropy:
            raise ValueError("entropy: the loss has an entropy bonus, so UpdateConfig.entropy must be True")
        self.policy, self.optimizer, self.reference = policy, optimizer, reference
        self.loss_cfg, self.cfg = loss_cfg, cfg
        self.sp_group, self.dp_rank, self.dp_size, self.dp_group = sp_group, dp_rank, dp_size, dp_group
        self.device = torch.device(device)
        self.timer = timer or PhaseTimer()
        self.grad_scale = grad_scale
        if reduce_grads_once and not hasattr(policy, "set_requires_gradient_sync"):
            raise ValueError(f"reduce_grads_once: expected an FSDP2-wrapped policy (fully_shard), got a plain "
                             f"{type(policy).__name__}")
        self.reduce_grads_once = reduce_grads_once
        # This rank's forward FLOPs of the last step, per phase and part (metrics.forward_flops_by_part):
        # what a profile needs to turn each kind of kernel's device time into a speed.
        self.flops_by_phase: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))

    # ------------------------------------------------------------------ passes
    def _count_flops(self, phase: str, config, layout) -> None:
        """Add one micro-batch's forward FLOPs to ``flops_by_phase[phase]`` by part."""
        for part, flops in forward_flops_by_part(config, layout).items():
            self.flops_by_phase[phase][part] += flops

    def _my_plan(self, groups: Sequence[RolloutGroup], budget: int | None = None) -> list[MicroBatch]:
        """This rank's micro-batches. Any budget gives each rank the same groups (they are balanced over
        the ranks before they are binned), so a pass under another budget fills every group the update
        plan reads, its padding micro-batches' included."""
        budget = self.cfg.micro_batch_tokens if budget is None else budget
        return plan_micro_batches(groups, self.cfg.packing, budget, self.dp_size)[self.dp_rank]

    @torch.no_grad()
    def _logprob_pass(self, model, groups: list[RolloutGroup], field: str) -> list[RolloutGroup]:
        """Fill ``field`` (old_logprobs / ref_logprobs) of this rank's groups from a no-grad forward.

        Every micro-batch is queued before any result is copied to the host: a copy waits for the
        device, and one after each micro-batch would leave the device idle while the host builds and
        launches the next one."""
        groups = list(groups)
        queued = []
        for mb in self._my_plan(groups, self.cfg.logprob_micro_batch_tokens):
            data = build_micro_batch(groups, mb, self.cfg.packing, self.device)
            queued.append((mb, policy_logprobs(model, data.layout, self.sp_group, self.cfg.temperature)))
            self._count_flops(PASS_PHASE[field], model.config, data.layout)
        for mb, lp in queued:
            lp = lp.float().cpu()
            row = 0  # (a padding micro-batch stores too: its update pass reads them, with weight 0)
            for gi in mb.groups:
                g = groups[gi]
                values = [lp[row + i, :n].clone() for i, n in enumerate(g.response_lens)]
                groups[gi] = replace(g, **{field: values})
                row += g.num_responses
        return groups

    def _micro_step(self, data, norm: LossNorm, aux_scale: float, sums: dict) -> None:
        out = policy_logprobs(self.policy, data.layout, self.sp_group, self.cfg.temperature, self.cfg.entropy)
        logp, entropy = out if self.cfg.entropy else (out, None)
        # No old log-probs: the on-policy step (UpdateConfig.old_logprobs_from_update) takes these.
        old = logp.detach() if data.old_logprobs is None else data.old_logprobs
        loss, stats = policy_loss(logp, old, data.advantages, data.mask, self.loss_cfg,
                                  ref_logp=data.ref_logprobs, entropy=entropy, norm=norm)
        aux = _aux_loss(self.policy, self.sp_group)
        total = loss if aux is None else loss + aux * aux_scale
        (total * (data.weight * self.grad_scale)).backward()
        # Every rank records the same keys (padding micro-batches with weight 0): they are all-reduced.
        sums["loss"] += loss.detach().float() * data.weight
        for k, v in stats.items():
            sums[k] += v.float() * data.weight
        if aux is not None:
            sums["aux_loss"] += aux.detach().float() * (aux_scale * data.weight)

    def _update_mini_batch(self, groups: list[RolloutGroup], tokens: list[int]) -> dict[str, torch.Tensor]:
        plan = self._my_plan(groups)
        norm = LossNorm(num_rows=sum(g.num_responses for g in groups), num_tokens=sum(sum(g.response_lens) for g in groups))
        aux_scale = 1.0 / (len(plan) * self.dp_size)
        sums: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros((), device=self.device))
        self.optimizer.zero_grad(set_to_none=True)
        for i, mb in enumerate(plan):
            if self.reduce_grads_once:  # reduce, and free the gathered parameters, after the last backward only
                last = i == len(plan) - 1
                self.policy.set_requires_gradient_sync(last)
                self.policy.set_reshard_after_backward(last)
            data = build_micro_batch(groups, mb, self.cfg.packing, self.device)
            self._micro_step(data, norm, aux_scale, sums)
            self._count_flops("update", self.policy.config, data.layout)
            tokens.append(data.tokens)
        grad_norm = self._clip()
        self.optimizer.step()
        out = self._reduce(dict(sums))
        out["grad_norm"] = grad_norm
        return out

    def _clip(self) -> torch.Tensor:
        params = [p for p in self.policy.parameters() if p.grad is not None]
        max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm is not None else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return norm.detach().float()

    def _reduce(self, sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Sum the per-rank sums over dp replicas (SP ranks hold identical values)."""
        if self.dp_size == 1 or not sums:
            return sums
        keys = sorted(sums)
        flat = torch.stack([sums[k] for k in keys])
        dist.all_reduce(flat, group=self.dp_group)
        return dict(zip(keys, flat))

    # ------------------------------------------------------------------ the step
    def prepare(self, batch: RolloutBatch) -> RolloutBatch | None:
        """DAPO's uniform-group filter, then advantages; None when no group is left to learn from."""
        if self.loss_cfg.drop_uniform_groups:
            batch = batch.drop_uniform_groups()
            if batch is None:
                return None
        return batch.with_advantages(self.loss_cfg)

    def step(self, batch: RolloutBatch) -> dict[str, float]:
        """Train on ``batch`` (the same on every rank); returns metrics (summed over ranks where additive)."""
        self.flops_by_phase.clear()
        prepared = self.prepare(batch)
        if prepared is None:
            return {"skipped": 1.0, "groups_used": 0.0}
        # DAPO's filter may leave fewer groups than mini-batches: then one group per mini-batch.
        chunks = split_mini_batches(prepared.num_groups, min(self.cfg.mini_batches, prepared.num_groups))
        minis = [[prepared.groups[i] for i in c] for c in chunks]
        self.policy.train()
        reuse = self.cfg.use_rollout_logprobs
        if not (reuse and prepared.has_old_logprobs) and not self.cfg.old_logprobs_from_update:
            with self.timer.phase(PASS_PHASE["old_logprobs"]):
                minis = [self._logprob_pass(self.policy, m, "old_logprobs") for m in minis]
        if self.loss_cfg.needs_reference and not (reuse and prepared.has_ref_logprobs):
            with self.timer.phase(PASS_PHASE["ref_logprobs"]):
                minis = [self._logprob_pass(self.reference, m, "ref_logprobs") for m in minis]
        results: list[dict[str, torch.Tensor]] = []
        tokens: list[int] = []  # each update micro-batch's
        with self.timer.phase("update"):
            for _ in range(self.cfg.epochs):
                for m in minis:
                    results.append(self._update_mini_batch(m, tokens))
        metrics = {k: float(sum(r[k] for r in results) / len(results)) for k in results[0]}
        no_grad = sum(sum(self.flops_by_phase.get(phase, {}).values()) for phase in PASS_PHASE.values())
        metrics.update(skipped=0.0, groups_used=float(prepared.num_groups), optimizer_steps=float(len(results)),
                       forward_flops_rank=float(no_grad),
                       update_flops_rank=float(3 * sum(self.flops_by_phase["update"].values())),
                       tokens_rank=float(sum(tokens)))
        return metrics
