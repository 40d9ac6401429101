"""GRPO / DAPO training with DualKV packing: ``python -m dualkv.train.grpo`` (console script ``dualkv-grpo``).

With no arguments it trains a tiny Qwen3 from scratch on the built-in arithmetic task on the CPU in
about a minute, printing reward, loss, packed vs replicated tokens (rho) and tokens/s every step.
The main job (one node, 8 GPUs, 4-way sequence parallelism, a rollout file)::

    torchrun --nproc-per-node 8 -m dualkv.train.grpo --model /ckpt/Qwen3-8B \\
        --rollouts rollouts.parquet --algorithm dapo --groups 64 --micro-batch-tokens 65536 \\
        --sp 4 --steps 100 --lr 1e-6 --output-dir runs/qwen3-8b-dapo

Multi-node: the same command with torchrun's ``--nnodes/--node-rank/--rdzv-backend/--rdzv-endpoint``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from dualkv.core.backends import BACKEND_CHOICES
from dualkv.core.logprobs import LOGPROB_IMPLS
from dualkv.models.fused import FUSED_MODES

from .arithmetic import ArithmeticConfig
from .distributed import ParallelConfig
from .losses import LossConfig
from .trainer import OPTIMIZER_IMPLS, OptimConfig, TrainConfig, Trainer
from .update import UpdateConfig

__all__ = ["build_parser", "config_from_args", "main"]

STEPS_ENV = "DUALKV_GRPO_STEPS"  # overrides the default --steps (e.g. a short CI run of the default job)
_LR_CHECKPOINT, _LR_SCRATCH = 1e-6, 3e-3


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    try:
        return int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX (e.g. 16:64), got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dualkv-grpo", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("model and data")
    g.add_argument("--model", default="tiny-qwen3",
                   help="preset name (random init; with the arithmetic task its vocabulary is the task's) or a "
                        "transformers checkpoint directory")
    g.add_argument("--reference", default=None, help="reference model directory for the KL term (default: the initial policy)")
    g.add_argument("--rollouts", default="arithmetic",
                   help="'arithmetic' (sample from the policy, exact-answer reward), 'synthetic', or a .jsonl/.parquet file")
    g.add_argument("--groups", type=int, default=8, help="prompt groups per step")
    g.add_argument("--responses", type=int, default=16, help="N, responses per prompt (arithmetic / synthetic rollouts)")
    g.add_argument("--max-new-tokens", type=int, default=3, help="response length limit when sampling")
    g.add_argument("--temperature", type=float, default=1.0, help="sampling and log-prob temperature")
    g.add_argument("--max-operand", type=int, default=2, help="arithmetic: operands in [0, max]")
    g.add_argument("--ops", default="+", help="arithmetic: operators to draw from (+-*)")
    g.add_argument("--shots", type=int, default=0, help="arithmetic: solved examples in a preamble shared by every prompt")
    g.add_argument("--synthetic-prompt-len", type=_range, default=(16, 64), help="synthetic: prompt lengths MIN:MAX")
    g.add_argument("--synthetic-response-len", type=_range, default=(4, 32), help="synthetic: response lengths MIN:MAX")

    a = p.add_argument_group("algorithm")
    a.add_argument("--algorithm", choices=("grpo", "dapo"), default="dapo")
    a.add_argument("--kl-beta", type=float, default=None,
                   help="KL weight (recipe default: GRPO 0.04, DAPO 0; 0 for a preset trained from scratch)")
    a.add_argument("--kl-estimator", choices=("k1", "k2", "k3", "low_var_kl"), default=None)
    a.add_argument("--clip-low", type=float, default=None, help="eps_low (default 0.2)")
    a.add_argument("--clip-high", type=float, default=None, help="eps_high (GRPO 0.2, DAPO 0.28)")
    a.add_argument("--dual-clip", type=float, default=None, help="dual-clip constant c > 1 (DAPO default 3)")
    a.add_argument("--loss-agg", choices=("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"), default=None)
    a.add_argument("--entropy-coeff", type=float, default=None)

    u = p.add_argument_group("update")
    u.add_argument("--packing", choices=("dualkv", "replicated"), default="dualkv",
                   help="dualkv: each prompt once (P + N*R tokens); replicated: the N*(P+R) baseline")
    u.add_argument("--micro-batch-tokens", type=int, default=8192,
                   help="token budget of one micro-batch, on the length the packing runs (split over its SP group)")
    u.add_argument("--logprob-micro-batch-tokens", type=int, default=None,
                   help="the same budget for the no-grad old / ref log-prob passes (default: --micro-batch-tokens); "
                        "they keep no activations, so a larger one usually fits")
    u.add_argument("--mini-batches", type=int, default=1, help="optimizer steps per rollout batch")
    u.add_argument("--epochs", type=int, default=1, help="passes over each rollout batch")
    u.add_argument("--steps", type=int, default=int(os.environ.get(STEPS_ENV, 120)))
    u.add_argument("--lr", type=float, default=None,
                   help=f"AdamW learning rate (default {_LR_CHECKPOINT:g} for a checkpoint, {_LR_SCRATCH:g} for a preset "
                        "trained from scratch)")
    u.add_argument("--use-rollout-logprobs", action="store_true",
                   help="take old/ref log-probs from the rollout file when it has them instead of recomputing")
    u.add_argument("--recompute-old-logprobs", action="store_true",
                   help="run the old_log_prob pass even with one optimizer step per rollout batch (by default the "
                        "update's own log-probs, detached, are the old ones there: the same gradient, one forward less)")
    u.add_argument("--weight-decay", type=float, default=0.01)
    u.add_argument("--adam-eps", type=float, default=1e-8, help="AdamW epsilon")
    u.add_argument("--optimizer-impl", choices=OPTIMIZER_IMPLS, default="auto",
                   help="AdamW implementation (auto: torch's fused kernel when the parameters are on CUDA)")
    u.add_argument("--max-grad-norm", type=float, default=1.0)
    u.add_argument("--seed", type=int, default=0)

    d = p.add_argument_group("parallelism")
    d.add_argument("--sp", type=int, default=1, help="Ulysses sequence-parallel degree (divides the world size)")
    d.add_argument("--param-dtype", choices=("auto", "bf16", "fp32"), default="auto",
                   help="FSDP compute dtype (auto: bf16 on CUDA, fp32 on CPU); gradients reduce in fp32")
    d.add_argument("--activation-checkpointing", action="store_true")
    d.add_argument("--checkpoint-keep-attention", action="store_true",
                   help="with --activation-checkpointing: keep attention outputs, recompute the rest of each layer")
    d.add_argument("--compile", action="store_true", help="torch.compile every decoder layer")
    d.add_argument("--no-reshard-after-forward", dest="reshard_after_forward", action="store_false",
                   help="FSDP keeps each layer's gathered parameters from forward to backward (one all-gather a "
                        "micro-batch fewer, more memory) instead of gathering them again for the backward")
    d.add_argument("--reduce-grads-once", action="store_true",
                   help="FSDP reduces a mini-batch's gradients once, after its last micro-batch (earlier ones add "
                        "up unsharded and keep their parameters gathered): less communication, the memory of the "
                        "whole model's unsharded fp32 gradients")
    d.add_argument("--attention-backend", choices=BACKEND_CHOICES, default="auto",
                   help="dualkv_attention backend of every layer (auto: what measured fastest per head dim on CUDA "
                        "tensors; a+b: a's forward, b's backward)")
    d.add_argument("--deterministic-attention", action="store_true",
                   help="bit-identical attention gradients run to run (the CUDA backward, which auto takes at head "
                        "dims 128 / 256 on Hopper, otherwise adds the prompt's gradients with fp32 atomics)")
    d.add_argument("--logprobs-impl", choices=LOGPROB_IMPLS, default=None,
                   help="how the log-prob head reduces each chunk of logits: PyTorch ops on an fp32 copy (torch), one "
                        "Triton kernel per direction (triton), or triton for fp16 / bf16 on CUDA and torch otherwise "
                        "(auto); default: $DUALKV_LOGPROBS_IMPL, else auto")
    d.add_argument("--fused-ops", choices=FUSED_MODES, default="auto",
                   help="the eager layers' RMSNorm, RoPE and SwiGLU: Liger-Kernel's fused Triton kernels (liger; auto: "
                        "on CUDA where it is installed) or PyTorch's ops (off); compiled layers always use PyTorch's")
    d.add_argument("--cpu-threads", type=int, default=None,
                   help="intra-op threads of a CPU run (default: $OMP_NUM_THREADS, else 1: small models run fastest "
                        "on one thread)")

    o = p.add_argument_group("output")
    o.add_argument("--output-dir", default=None, help="metrics.jsonl, TensorBoard, checkpoints, HF export")
    o.add_argument("--save-every", type=int, default=0, help="checkpoint every k steps (0: only at the end)")
    o.add_argument("--resume", default=None, help="'auto' (latest under --output-dir) or a checkpoint directory")
    o.add_argument("--export-hf", action="store_true", help="write the trained policy to <output-dir>/hf")
    o.add_argument("--peak-tflops", type=float, default=None, help="per-device peak for MFU (default: known GPUs)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _loss_config(args) -> LossConfig:
    overrides = {k: v for k, v in dict(kl_beta=args.kl_beta, kl_estimator=args.kl_estimator, eps_low=args.clip_low,
                                       eps_high=args.clip_high, dual_clip_c=args.dual_clip, aggregation=args.loss_agg,
                                       entropy_coeff=args.entropy_coeff).items() if v is not None}
    return getattr(LossConfig, args.algorithm)(**overrides)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    scratch = not Path(args.model).is_dir()
    lr = args.lr if args.lr is not None else (_LR_SCRATCH if scratch else _LR_CHECKPOINT)
    if scratch and args.kl_beta is None and args.reference is None:
        args.kl_beta = 0.0  # a randomly initialised policy has no reference worth staying close to
    dtype = args.param_dtype if args.param_dtype != "auto" else ("bf16" if torch.cuda.is_available() else "fp32")
    return TrainConfig(
        model=args.model, rollouts=args.rollouts, groups=args.groups, n=args.responses, steps=args.steps, seed=args.seed,
        output_dir=args.output_dir, save_every=args.save_every, resume=args.resume, export_hf=args.export_hf,
        reference=args.reference, max_new_tokens=args.max_new_tokens,
        arithmetic=ArithmeticConfig(max_operand=args.max_operand, ops=args.ops, num_shots=args.shots),
        synthetic_prompt_len=args.synthetic_prompt_len, synthetic_response_len=args.synthetic_response_len,
        peak_tflops=args.peak_tflops, progress=not args.no_progress, loss=_loss_config(args),
        update=UpdateConfig(packing=args.packing, micro_batch_tokens=args.micro_batch_tokens,
                            logprob_micro_batch_tokens=args.logprob_micro_batch_tokens,
                            mini_batches=args.mini_batches, epochs=args.epochs, max_grad_norm=args.max_grad_norm,
                            temperature=args.temperature, use_rollout_logprobs=args.use_rollout_logprobs,
                            recompute_old_logprobs=args.recompute_old_logprobs),
        optim=OptimConfig(lr=lr, weight_decay=args.weight_decay, eps=args.adam_eps,
                          implementation=args.optimizer_impl),
        parallel=ParallelConfig(sp=args.sp, param_dtype=dtype, activation_checkpointing=args.activation_checkpointing,
                                compile=args.compile, checkpoint_keep_attention=args.checkpoint_keep_attention,
                                attention_backend=args.attention_backend,
                                deterministic_attention=args.deterministic_attention,
                                logprobs_impl=args.logprobs_impl, fused_ops=args.fused_ops,
                                reshard_after_forward=args.reshard_after_forward,
                                reduce_grads_once=args.reduce_grads_once),
    )


def main(argv: list[str] | None = None) -> list[dict]:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        threads = args.cpu_threads or int(os.environ.get("OMP_NUM_THREADS", 1))
        torch.set_num_threads(max(threads, 1))
    try:
        cfg = config_from_args(args)
        trainer = Trainer(cfg)  # validates the rollout file and the parallel layout first
    except ValueError as e:
        parser.error(str(e))
    try:
        if trainer.ctx.is_main:
            print(f"dualkv-grpo: {cfg.loss.algorithm} on {cfg.rollouts}, model {cfg.model} "
                  f"({trainer.policy.config.describe()}), packing {cfg.update.packing}, world {trainer.ctx.world_size} "
                  f"= dp {trainer.ctx.dp_size} x sp {trainer.ctx.sp_size}", file=sys.stderr)
        history = trainer.run()
        if trainer.ctx.is_main and history:
            k = max(1, min(10, len(history) // 2))
            first, last = (sum(h["reward_mean"] for h in part) / len(part) for part in (history[:k], history[-k:]))
            rho = sum(h["rho"] for h in history) / len(history)
            print(f"done: {len(history)} steps, mean reward {first:.3f} (first {k} steps) -> {last:.3f} (last {k}), "
                  f"rho {rho:.2f}", file=sys.stderr)
        return history
    finally:
        trainer.close()


if __name__ == "__main__":
    main()
