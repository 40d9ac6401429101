"""The training run behind ``python -m dualkv.train.grpo``: model, rollouts, passes, logging, checkpoints.

``TrainConfig`` is everything a run needs; ``Trainer(cfg).run()`` performs it on every rank of the
torchrun job (or in one process). Per step: rollouts (sampled on rank 0 and broadcast, or read from a
file / synthesised identically on every rank), the three passes of ``PolicyUpdater``, metrics to
stdout / JSONL / TensorBoard, a checkpoint every ``save_every`` steps; at the end an optional HF export.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from .arithmetic import ArithmeticConfig, ArithmeticTask
from .checkpoint import export_hf, latest_checkpoint, load_checkpoint, save_checkpoint
from .distributed import DistContext, ParallelConfig, destroy_distributed, init_distributed, parallelize_policy
from .losses import LossConfig
from .metrics import MetricsLogger, PhaseTimer, peak_flops, peak_memory_gib
from .rollout import RolloutBatch
from .sources import (
    FileRolloutSource,
    GenerationConfig,
    GenerationRolloutSource,
    SyntheticConfig,
    SyntheticRolloutSource,
)
from .update import PolicyUpdater, UpdateConfig

__all__ = ["OPTIMIZER_IMPLS", "OptimConfig", "TrainConfig", "Trainer", "build_optimizer"]

OPTIMIZER_IMPLS = ("auto", "fused", "foreach", "for-loop")


@dataclass(frozen=True)
class OptimConfig:
    """AdamW.

    implementation: "fused" (torch's one-kernel AdamW), "foreach" (multi-tensor kernels), "for-loop"
    (one parameter at a time), or "auto": fused when every parameter is on a CUDA device (on an H200
    the qwen3-1.7b step took 38 ms with foreach), otherwise torch's own default.
    """

    lr: float = 1e-6
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    implementation: str = "auto"

    def __post_init__(self) -> None:
        if self.implementation not in OPTIMIZER_IMPLS:
            raise ValueError(f"implementation: expected one of {list(OPTIMIZER_IMPLS)}, got {self.implementation!r}")
        if not self.lr > 0:
            raise ValueError(f"lr: expected > 0, got {self.lr}")
        if not self.eps > 0:
            raise ValueError(f"eps: expected > 0, got {self.eps}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay: expected >= 0, got {self.weight_decay}")


def build_optimizer(params, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW over ``params`` with ``cfg``'s settings and implementation."""
    params = list(params)
    impl = cfg.implementation
    if impl == "auto":
        impl = "fused" if params and all(p.device.type == "cuda" for p in params) else None
    flags = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}.get(impl, {})
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, **flags)


@dataclass(frozen=True)
class TrainConfig:
    """A training run.

    model: a preset name (random initialisation; with the arithmetic task its vocabulary is the task
        tokenizer's) or a transformers checkpoint directory.
    rollouts: "arithmetic" (sample from the policy, exact-answer reward), "synthetic", or a .jsonl /
        .parquet rollout file.
    groups: prompt groups per step; n: responses per prompt (generated / synthetic rollouts).
    """

    model: str = "tiny-qwen3"
    rollouts: str = "arithmetic"
    groups: int = 8
    n: int = 16
    steps: int = 120
    seed: int = 0
    output_dir: str | None = None
    save_every: int = 0
    resume: str | None = None
    export_hf: bool = False
    reference: str | None = None
    max_new_tokens: int = 3
    arithmetic: ArithmeticConfig = field(default_factory=ArithmeticConfig)
    synthetic_prompt_len: tuple[int, int] = (16, 64)
    synthetic_response_len: tuple[int, int] = (4, 32)
    peak_tflops: float | None = None
    progress: bool = True
    loss: LossConfig = field(default_factory=LossConfig.dapo)
    update: UpdateConfig = field(default_factory=UpdateConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        for name in ("groups", "n", "steps", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected >= 1, got {getattr(self, name)}")
        if self.save_every < 0:
            raise ValueError(f"save_every: expected >= 0 (0 = only at the end), got {self.save_every}")
        if self.groups % self.update.mini_batches:
            raise ValueError(f"mini_batches: expected a divisor of groups={self.groups}, got {self.update.mini_batches}")
        if (self.resume or self.save_every or self.export_hf) and not self.output_dir:
            raise ValueError("output_dir: checkpoints, resume and HF export need an output directory, got none")

    @property
    def is_file_source(self) -> bool:
        return self.rollouts not in ("arithmetic", "synthetic")


def _model_config(cfg: TrainConfig, task: ArithmeticTask | None):
    """(config.json dict or None, checkpoint dir or None) of the policy."""
    from dualkv.models import preset_hf_config

    if Path(cfg.model).is_dir():
        if task is not None:
            raise ValueError(f"rollouts: the arithmetic task speaks its own {task.tokenizer.vocab_size}-token vocabulary, "
                             f"so it trains a preset from scratch; for the checkpoint {cfg.model} give a rollout file")
        return None, Path(cfg.model)
    hf = preset_hf_config(cfg.model)
    if task is not None:
        tok = task.tokenizer
        hf.update(vocab_size=tok.vocab_size, pad_token_id=tok.pad_id, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id)
    return hf, None


def _build_model(hf: dict | None, path: Path | None):
    """A checkpoint's model (loaded whole), or a preset's on the meta device: ``parallelize_policy``
    then allocates and initialises it layer by layer, each layer sharded at once."""
    from dualkv.models import build_model, from_pretrained

    if path is not None:
        return from_pretrained(path, dtype=torch.float32)
    return build_model(hf, device="meta")


class Trainer:
    def __init__(self, cfg: TrainConfig, ctx: DistContext | None = None) -> None:
        self.cfg = cfg
        # A rollout file is read (and validated) before anything else is built.
        self.file_source = FileRolloutSource(cfg.rollouts, cfg.groups, seed=cfg.seed) if cfg.is_file_source else None
        self.ctx = ctx or init_distributed(cfg.parallel.sp)
        try:
            self._build()
        except BaseException:
            if ctx is None:
                destroy_distributed(self.ctx)
            raise

    def _build(self) -> None:
        cfg = self.cfg
        self.timer = PhaseTimer()
        self.task = ArithmeticTask(cfg.arithmetic) if cfg.rollouts == "arithmetic" else None
        hf, path = _model_config(cfg, self.task)
        self.policy = parallelize_policy(_build_model(hf, path), self.ctx, cfg.parallel, seed=cfg.seed)
        reference = None
        if cfg.loss.needs_reference:
            ref_hf, ref_path = (hf, path) if cfg.reference is None else (None, Path(cfg.reference))
            reference = parallelize_policy(_build_model(ref_hf, ref_path), self.ctx, cfg.parallel, trainable=False,
                                           seed=cfg.seed)
        self.optimizer = build_optimizer(self.policy.parameters(), cfg.optim)
        self.updater = PolicyUpdater(self.policy, self.optimizer, cfg.loss, cfg.update, reference=reference,
                                     sp_group=self.ctx.sp_group, dp_rank=self.ctx.dp_rank, dp_size=self.ctx.dp_size,
                                     dp_group=self.ctx.dp_group, device=self.ctx.device, timer=self.timer,
                                     grad_scale=float(self.ctx.fsdp_size),
                                     reduce_grads_once=cfg.parallel.reduce_grads_once)
        self.source, self.sampler = self._source()
        self.logger = MetricsLogger(cfg.output_dir, enabled=self.ctx.is_main)
        self.start_step = 0
        self.history: list[dict] = []

    def _source(self):
        cfg = self.cfg
        if cfg.rollouts == "arithmetic":
            from .generation import HFSampler

            tok = self.task.tokenizer
            sampler = HFSampler(self.policy, eos_id=tok.eos_id, pad_id=tok.pad_id, device=self.ctx.device)
            gen = GenerationConfig(num_groups=cfg.groups, n=cfg.n, max_new_tokens=cfg.max_new_tokens,
                                   temperature=cfg.update.temperature, seed=cfg.seed)
            return GenerationRolloutSource(self.task, sampler, gen), sampler
        if cfg.rollouts == "synthetic":
            syn = SyntheticConfig(num_groups=cfg.groups, n=cfg.n, prompt_len=cfg.synthetic_prompt_len,
                                  response_len=cfg.synthetic_response_len, vocab_size=self.policy.config.vocab_size,
                                  seed=cfg.seed)
            return SyntheticRolloutSource(syn), None
        return self.file_source, None

    # ------------------------------------------------------------------ steps
    def rollouts(self, step: int) -> RolloutBatch:
        if self.sampler is None:
            batch = self.source.rollouts(step)
        else:
            self.sampler.sync()
            box = [self.source.rollouts(step) if self.ctx.is_main else None]
            if self.ctx.world_size > 1:
                dist.broadcast_object_list(box, src=0)
            batch = box[0]
        batch.check_vocab(self.policy.config.vocab_size)
        return batch

    def _dp_sum(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.ctx.device)
        if self.ctx.dp_size > 1:
            dist.all_reduce(t, group=self.ctx.dp_group)
        return t.tolist()

    def _step_metrics(self, batch: RolloutBatch, m: dict, times: dict, wall: float) -> dict:
        fwd, upd, tok = self._dp_sum([m.get("forward_flops_rank", 0.0), m.get("update_flops_rank", 0.0),
                                      m.get("tokens_rank", 0.0)])
        compute = sum(times.get(k, 0.0) for k in ("old_log_prob", "ref_log_prob", "update"))
        peak = peak_flops(self.cfg.peak_tflops)
        out = {**batch.reward_stats(), "rho": batch.rho, "packed_tokens": batch.packed_tokens,
               "replicated_tokens": batch.replicated_tokens, **{f"time_{k}": v for k, v in times.items()},
               "time_step": wall, **{k: v for k, v in m.items() if not k.endswith("_rank")}}
        update_time = times.get("update", 0.0)
        out["tokens_per_s"] = tok / update_time if update_time else None
        ratio = batch.replicated_tokens / batch.packed_tokens if self.cfg.update.packing == "dualkv" else 1.0
        out["effective_tokens_per_s"] = tok * ratio / update_time if update_time else None
        out["tflops"] = (fwd + upd) / compute / 1e12 if compute else None
        out["mfu"] = (fwd + upd) / (compute * self.ctx.world_size * peak) if (peak and compute) else None
        out["peak_memory_gib"] = peak_memory_gib()
        return out

    def train_step(self, step: int) -> dict:
        t0 = time.perf_counter()
        with self.timer.phase("rollout"):
            batch = self.rollouts(step)
        metrics = self.updater.step(batch)
        wall = time.perf_counter() - t0
        return {"step": step, **self._step_metrics(batch, metrics, self.timer.reset(), wall)}

    # ------------------------------------------------------------------ run
    def maybe_resume(self) -> None:
        cfg = self.cfg
        if cfg.resume is None:
            return
        path = latest_checkpoint(cfg.output_dir) if cfg.resume == "auto" else Path(cfg.resume)
        if path is None:
            return
        self.start_step = int(load_checkpoint(path, self.policy, self.optimizer)["step"])

    def save(self, step: int) -> None:
        save_checkpoint(self.cfg.output_dir, step, self.policy, self.optimizer,
                        extra={"config": _jsonable(asdict(self.cfg))})

    def run(self) -> list[dict]:
        from tqdm.auto import tqdm

        cfg = self.cfg
        self.maybe_resume()
        bar = tqdm(range(self.start_step, cfg.steps), initial=self.start_step, total=cfg.steps,
                   disable=not (self.ctx.is_main and cfg.progress), desc=f"{cfg.loss.algorithm} {cfg.update.packing}",
                   dynamic_ncols=True)
        for step in bar:
            rec = self.train_step(step)
            self.history.append(rec)
            self.logger.log(step, rec)
            bar.set_postfix(_postfix(rec), refresh=False)
            done = step + 1
            if cfg.output_dir and ((cfg.save_every and done % cfg.save_every == 0) or done == cfg.steps):
                self.save(done)
        bar.close()
        if cfg.export_hf:
            export_hf(self.policy, Path(cfg.output_dir) / "hf")
        self.logger.close()
        return self.history

    def close(self) -> None:
        destroy_distributed(self.ctx)


def _postfix(rec: dict) -> dict:
    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    return {"reward": fmt(rec.get("reward_mean"), ".3f"), "loss": fmt(rec.get("loss"), ".4f"),
            "rho": fmt(rec.get("rho"), ".2f"), "tok/s": fmt(rec.get("tokens_per_s"), ".0f"),
            "eff tok/s": fmt(rec.get("effective_tokens_per_s"), ".0f")}


def _jsonable(x):
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x if isinstance(x, (str, int, float, bool, type(None))) else str(x)

