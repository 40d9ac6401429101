"""The training entry point: the embedded default, bit-identical resume, torchrun dp=2 x sp=2 == one process."""

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dualkv.models import build_model
from dualkv.train.distributed import ParallelConfig
from dualkv.train.grpo import build_parser, config_from_args
from dualkv.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("one_thread")


def _env(**extra):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **extra}
    env.pop("TRITON_INTERPRET", None)
    return env


def test_embedded_default_runs_to_completion(tmp_path):
    """`python -m dualkv.train.grpo` with no arguments (two steps instead of the default number)."""
    out = subprocess.run([sys.executable, "-m", "dualkv.train.grpo"], cwd=tmp_path, env=_env(DUALKV_GRPO_STEPS="2"),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "tiny-qwen3" in out.stderr and "arithmetic" in out.stderr
    assert "reward=" in out.stderr and "rho=" in out.stderr and "tok/s=" in out.stderr  # the progress bar
    assert "done: 2 steps, mean reward" in out.stderr


def _config(tmp_path, *args):
    return config_from_args(build_parser().parse_args(
        ["--groups", "4", "--responses", "16", "--steps", "3", "--no-progress", "--output-dir", str(tmp_path), *args]))


def _local(x):
    """A plain tensor copy (one-rank runs: the local shard of a DTensor is all of it)."""
    if isinstance(x, dict):
        return {k: _local(v) for k, v in x.items()}
    if isinstance(x, torch.Tensor):
        return (x.to_local() if hasattr(x, "to_local") else x).detach().clone()
    return x


def _train(cfg):
    trainer = Trainer(cfg)
    try:
        history = trainer.run()
        return history, _local(dict(trainer.policy.state_dict())), _local(trainer.optimizer.state_dict())
    finally:
        trainer.close()


@pytest.mark.parametrize("algorithm", [["--algorithm", "grpo", "--kl-beta", "0.04"], ["--algorithm", "dapo"]])
def test_resume_equals_uninterrupted(tmp_path, algorithm):
    full = _config(tmp_path / "full", *algorithm)
    hist_full, params_full, opt_full = _train(full)
    first = replace(_config(tmp_path / "cut", *algorithm), steps=2)  # "interrupted" after step 2
    _train(first)
    resumed = replace(_config(tmp_path / "cut", *algorithm), resume="auto")
    hist_res, params_res, opt_res = _train(resumed)
    assert [h["step"] for h in hist_res] == [2]
    assert all(h["skipped"] == 0 for h in hist_full)  # every step trained (DAPO may skip all-uniform batches)
    for key in ("reward_mean", "loss", "grad_norm", "packed_tokens"):
        assert hist_res[0][key] == hist_full[2][key], key
    assert params_full.keys() == params_res.keys()
    for k in params_full:
        assert torch.equal(params_full[k], params_res[k]), k
    for pid, st in opt_full["state"].items():
        for name, v in st.items():
            assert torch.equal(v, opt_res["state"][pid][name]), (pid, name)


def test_attention_backend_reaches_every_layer_of_policy_and_reference(tmp_path):
    """--attention-backend pins dualkv_attention's backend in every attention module of the policy and
    of the frozen reference; the run trains as with auto (on CPU, auto is the reference backend)."""
    cfg = _config(tmp_path, "--attention-backend", "reference", "--kl-beta", "0.04", "--steps", "1")
    assert cfg.parallel.attention_backend == "reference"
    trainer = Trainer(cfg)
    try:
        models = (trainer.policy, trainer.updater.reference)
        fns = [m.attn_fn for model in models for m in model.modules() if hasattr(m, "attn_fn")]
        assert len(fns) >= 2 * len(trainer.policy.model.layers)
        assert all(getattr(f, "keywords", None) == {"backend": "reference"} for f in fns)
        pinned = trainer.run()
    finally:
        trainer.close()
    auto, _, _ = _train(_config(tmp_path / "auto", "--kl-beta", "0.04", "--steps", "1"))
    assert pinned[0]["loss"] == pytest.approx(auto[0]["loss"], rel=1e-6, abs=1e-9)


def test_deterministic_attention_reaches_every_layer(tmp_path):
    """--deterministic-attention passes deterministic=True to dualkv_attention in every attention module
    of the policy and the reference, with auto's backend choice left alone or a pinned one kept."""
    for extra, keywords in (([], {"deterministic": True}),
                            (["--attention-backend", "reference"], {"backend": "reference", "deterministic": True})):
        cfg = _config(tmp_path / str(len(extra)), "--deterministic-attention", "--kl-beta", "0.04", "--steps", "1", *extra)
        assert cfg.parallel.deterministic_attention
        trainer = Trainer(cfg)
        try:
            fns = [m.attn_fn for model in (trainer.policy, trainer.updater.reference)
                   for m in model.modules() if hasattr(m, "attn_fn")]
            assert fns and all(getattr(f, "keywords", None) == keywords for f in fns)
        finally:
            trainer.close()


def test_logprobs_impl_reaches_policy_and_reference(tmp_path, monkeypatch):
    """--logprobs-impl triton sets the log-prob head of the policy and the reference; the run's
    log-prob phases and update then go through the Triton kernels (interpreter here) and train as
    the PyTorch head does."""
    pytest.importorskip("triton")
    from dualkv.core.backends.triton import logprob_kernel

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    calls = {"forward": 0, "backward_": 0}
    for name in calls:
        real = getattr(logprob_kernel, name)
        monkeypatch.setattr(logprob_kernel, name, lambda *a, _real=real, _name=name: calls.__setitem__(_name, calls[_name] + 1) or _real(*a))
    cfg = _config(tmp_path, "--logprobs-impl", "triton", "--kl-beta", "0.04", "--steps", "1")
    assert cfg.parallel.logprobs_impl == "triton"
    trainer = Trainer(cfg)
    try:
        assert trainer.policy.logprobs_impl == trainer.updater.reference.logprobs_impl == "triton"
        fused = trainer.run()
    finally:
        trainer.close()
    assert calls["forward"] > 0 and calls["backward_"] > 0
    plain, _, _ = _train(_config(tmp_path / "torch", "--kl-beta", "0.04", "--steps", "1"))
    for key in ("loss", "kl", "grad_norm"):
        assert fused[0][key] == pytest.approx(plain[0][key], rel=1e-4, abs=1e-6), key


def _gathered(model) -> bool:
    """Whether the first decoder layer holds its gathered parameters (plain tensors, not FSDP's DTensor shards)."""
    return not any(hasattr(p, "to_local") for p in model.model.layers[0].parameters())


def test_no_reshard_after_forward_trains_the_same(tmp_path):
    """--no-reshard-after-forward keeps each layer's gathered parameters from forward to backward; the
    training is bit-identical to FSDP's default, with two optimizer steps per rollout batch (a gather
    after each step must see the new values). The frozen reference, which runs no backward, reshards
    after every forward either way (kept, its gathered copy would stay for good)."""
    args = ["--kl-beta", "0.04", "--mini-batches", "2"]
    runs = {}
    for keep in (False, True):
        cfg = _config(tmp_path / str(keep), *args, *(["--no-reshard-after-forward"] if keep else []))
        assert cfg.parallel.reshard_after_forward is not keep
        trainer = Trainer(cfg)
        try:
            history = trainer.run()
            # the last step ended in a backward (the policy's shards registered again); the reference
            # runs none, and resharded after its last forward
            runs[keep] = (history, _local(dict(trainer.policy.state_dict())), _gathered(trainer.updater.reference))
            assert not _gathered(trainer.policy)
        finally:
            trainer.close()
    (hist_keep, params_keep, ref_keep), (hist_default, params_default, ref_default) = runs[True], runs[False]
    assert not ref_keep and not ref_default
    assert all(h["skipped"] == 0 for h in hist_keep)
    for h_keep, h_default in zip(hist_keep, hist_default, strict=True):
        for key in ("loss", "kl", "grad_norm"):
            assert h_keep[key] == h_default[key], key
    assert params_keep.keys() == params_default.keys()
    for k in params_keep:
        assert torch.equal(params_keep[k], params_default[k]), k
    with pytest.raises(ValueError, match=r"reshard_after_forward: expected True or False, got 'never'"):
        ParallelConfig(reshard_after_forward="never")


def test_reduce_grads_once_trains_the_same(tmp_path, monkeypatch):
    """--reduce-grads-once: after each micro-batch but a mini-batch's last, the policy still holds its
    gathered parameters with unsharded gradients (FSDP has not reduced them); after the last, sharded
    parameters with reduced (sharded) gradients. The training is the same as reducing after every
    micro-batch (a one-rank run)."""
    from dualkv.train.update import PolicyUpdater

    real, reduced = PolicyUpdater._micro_step, []

    def watched(self, *args, **kwargs):
        real(self, *args, **kwargs)
        grads = [p.grad for p in self.policy.parameters() if p.grad is not None]
        sharded = all(hasattr(g, "to_local") for g in grads) and len(grads) > 0
        reduced.append(sharded and not _gathered(self.policy))

    monkeypatch.setattr(PolicyUpdater, "_micro_step", watched)
    args = ["--algorithm", "grpo", "--kl-beta", "0.04", "--mini-batches", "2", "--micro-batch-tokens", "1", "--groups", "6",
            "--steps", "2"]
    runs = {}
    for once in (False, True):
        reduced.clear()
        cfg = _config(tmp_path / str(once), *args, *(["--reduce-grads-once"] if once else []))
        assert cfg.parallel.reduce_grads_once is once
        history, params, _ = _train(cfg)
        runs[once] = (history, params, list(reduced))
    (hist_once, params_once, reduced_once), (hist_each, params_each, reduced_each) = runs[True], runs[False]
    assert reduced_each == [True] * 12  # 2 steps x 2 mini-batches x 3 micro-batches (one group each)
    assert reduced_once == [False, False, True] * 4
    for h_once, h_each in zip(hist_once, hist_each, strict=True):
        assert h_once["skipped"] == 0
        for key in ("loss", "kl", "grad_norm"):
            assert h_once[key] == pytest.approx(h_each[key], rel=1e-6), key
    assert max(float((params_once[k] - params_each[k]).abs().max()) for k in params_each) <= 1e-6
    with pytest.raises(ValueError, match=r"reduce_grads_once: expected True or False, got 1"):
        ParallelConfig(reduce_grads_once=1)


def test_fused_ops_flag_sets_the_mode(tmp_path):
    """--fused-ops reaches dualkv.models.fused when the trainer builds its models (process-wide)."""
    from dualkv.models import fused

    cfg = _config(tmp_path, "--fused-ops", "off", "--steps", "1")
    assert cfg.parallel.fused_ops == "off"
    trainer = Trainer(cfg)
    try:
        assert fused.get_fused_ops() == "off"
    finally:
        trainer.close()
        fused.set_fused_ops("auto")


def test_optimizer_implementation_choices(tmp_path):
    """--optimizer-impl reaches torch's AdamW flags; auto keeps torch's default off CUDA."""
    from dualkv.train.trainer import OptimConfig, build_optimizer

    params = [torch.nn.Parameter(torch.randn(3, 2))]
    flags = {impl: (opt.defaults["fused"], opt.defaults["foreach"])
             for impl in ("auto", "fused", "foreach", "for-loop")
             for opt in [build_optimizer(params, OptimConfig(implementation=impl))]}
    assert flags == {"auto": (None, None), "fused": (True, None), "foreach": (None, True), "for-loop": (None, False)}
    fused = build_optimizer(params, OptimConfig(lr=0.1, implementation="fused"))
    params[0].grad = torch.ones(3, 2)
    before = params[0].detach().clone()
    fused.step()
    assert not torch.equal(before, params[0])
    assert _config(tmp_path, "--optimizer-impl", "foreach").optim.implementation == "foreach"
    with pytest.raises(ValueError, match=r"implementation: expected one of \['auto', 'fused', 'foreach', 'for-loop'\], got 'adam'"):
        OptimConfig(implementation="adam")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--optimizer-impl", "adam"])


def test_bad_arguments_and_rollout_files_are_rejected(tmp_path):
    parse = build_parser().parse_args
    cfg = config_from_args(parse(["--activation-checkpointing", "--checkpoint-keep-attention"]))
    assert cfg.parallel.activation_checkpointing and cfg.parallel.checkpoint_keep_attention

    with pytest.raises(ValueError, match=r"attention_backend: expected one of \['auto', 'reference', 'triton', 'cuda'\] or a forward\+backward "
                       r"pair of kernel backends \(e.g. 'triton\+cuda'\), got 'fast'"):
        ParallelConfig(attention_backend="fast")
    with pytest.raises(ValueError, match=r"logprobs_impl: expected None or one of \('auto', 'torch', 'triton'\), got 'fused'"):
        ParallelConfig(logprobs_impl="fused")
    with pytest.raises(ValueError, match=r"fused_ops: expected one of \('auto', 'liger', 'off'\), got 'on'"):
        ParallelConfig(fused_ops="on")
    with pytest.raises(SystemExit):
        parse(["--fused-ops", "on"])
    with pytest.raises(ValueError, match="checkpoint_keep_attention: needs activation_checkpointing"):
        config_from_args(parse(["--checkpoint-keep-attention"]))
    with pytest.raises(ValueError, match="mini_batches: expected a divisor of groups=6, got 4"):
        config_from_args(parse(["--groups", "6", "--mini-batches", "4"]))
    with pytest.raises(ValueError, match="output_dir: checkpoints, resume and HF export need an output directory"):
        config_from_args(parse(["--export-hf"]))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"uid": 1, "prompt_ids": [1, 2], "response_ids": [3], "reward": 1}) + "\n"
                   + json.dumps({"uid": 1, "prompt_ids": [1, 5], "response_ids": [4], "reward": 0}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: prompt_ids differ from those of .*bad.jsonl:1 although both have uid 1"):
        Trainer(config_from_args(parse(["--rollouts", str(bad), "--groups", "1"])))
    bad.write_text(json.dumps({"uid": 1, "prompt_ids": [1, 2], "response_ids": [], "reward": 1}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1 response_ids: expected at least 1 token, got an empty list"):
        Trainer(config_from_args(parse(["--rollouts", str(bad), "--groups", "1"])))
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"uid": 1, "prompt_ids": [1, 2], "response_ids": [300], "reward": 1}) + "\n")
    trainer = Trainer(config_from_args(parse(["--rollouts", str(good), "--groups", "1", "--no-progress", "--steps", "1"])))
    try:
        with pytest.raises(ValueError, match=r"response_ids\[0\]: token id 300 is outside the model's vocabulary \(vocab_size=256\)"):
            trainer.run()
    finally:
        trainer.close()


def test_resume_rejects_incomplete_checkpoint(tmp_path):
    (tmp_path / "checkpoints" / "step_1").mkdir(parents=True)
    cfg = replace(_config(tmp_path), resume=str(tmp_path / "checkpoints" / "step_1"))
    trainer = Trainer(cfg)
    try:
        with pytest.raises(ValueError, match="not a complete checkpoint"):
            trainer.run()
    finally:
        trainer.close()


_DIST_ARGS = ["--rollouts", "synthetic", "--groups", "4", "--responses", "3", "--synthetic-prompt-len", "5:12",
              "--synthetic-response-len", "1:6", "--steps", "1", "--lr", "1e-3", "--param-dtype", "fp32",
              "--no-progress", "--export-hf", "--algorithm", "grpo", "--loss-agg", "token-mean", "--kl-beta", "0.04",
              # Adam divides each gradient by its own magnitude; with eps well above fp32 rounding of the
              # gradients (~1e-9) the update compares the gradients instead of their rounding noise.
              "--adam-eps", "1e-4"]


def _launch(out_dir: Path, nproc: int, *extra):
    if nproc == 1:
        cmd = [sys.executable, "-m", "dualkv.train.grpo"]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "dualkv.train.grpo"]
    out = subprocess.run(cmd + _DIST_ARGS + ["--output-dir", str(out_dir), *extra], cwd=ROOT, env=_env(),
                         capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-4000:]
    metrics = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return metrics, load_file(str(out_dir / "hf" / "model.safetensors"))


# dense: a 40-token budget splits the groups differently in the two runs (2 ranks vs 1); MoE: one group
# per micro-batch in both runs, since the load-balancing loss is a statistic of each micro-batch.
@pytest.mark.parametrize("model, budget", [("tiny-qwen3", "40"), ("tiny-qwen3-moe", "1")])
def test_torchrun_dp2_sp2_equals_single_process(tmp_path, model, budget):
    args = ["--model", model, "--micro-batch-tokens", budget]
    if "moe" not in model:  # the old_log_prob pass runs, in the distributed run under a budget of its own
        args.append("--recompute-old-logprobs")
    (m1,), w1 = _launch(tmp_path / "single", 1, *args)
    # the dense run also checkpoints its layers, keeping attention outputs; the MoE run keeps every layer's
    # gathered parameters from forward to backward and reduces the gradients once per mini-batch (two
    # micro-batches a rank): the same update, SP included
    options = (["--activation-checkpointing", "--checkpoint-keep-attention", "--logprob-micro-batch-tokens", "1000"]
               if "moe" not in model else ["--no-reshard-after-forward", "--reduce-grads-once"])
    (m4,), w4 = _launch(tmp_path / "dist", 4, "--sp", "2", *args, *options)
    assert m1["replicated_tokens"] == m4["replicated_tokens"] and m1["packed_tokens"] == m4["packed_tokens"]
    assert abs(m1["loss"]) > 1e-4
    for key in ("loss", "pg_loss", "kl", "grad_norm") + (("aux_loss",) if "moe" in model else ()):
        assert m4[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-8), key
    initial = build_model(model, seed=0)  # what both runs start from (--seed 0), in checkpoint names
    initial.save_pretrained(tmp_path / "initial")
    w0 = load_file(str(tmp_path / "initial" / "model.safetensors"))
    assert w1.keys() == w4.keys() == w0.keys()
    num = sum(float((w4[k] - w1[k]).double().square().sum()) for k in w1)
    den = sum(float((w1[k] - w0[k]).double().square().sum()) for k in w1)
    assert den > 0 and (num / den) ** 0.5 <= 1e-5  # the parameter updates agree


def test_torchrun_sp_rank_without_response_tokens(tmp_path):
    """sp=2 where the first rank's slice of each micro-batch holds only prompt tokens (P=32, short
    responses): its backward must still reach the LM head, or the FSDP reduce-scatters of the ranks go
    out of step. The update equals the one-process run."""
    args = ["--model", "tiny-qwen3", "--groups", "2", "--responses", "2", "--synthetic-prompt-len", "32:32",
            "--synthetic-response-len", "4:12", "--micro-batch-tokens", "1"]
    (m1,), w1 = _launch(tmp_path / "single", 1, *args)
    (m2,), w2 = _launch(tmp_path / "sp2", 2, "--sp", "2", *args)
    for key in ("loss", "kl", "grad_norm"):
        assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-8), key
    assert max(float((w2[k] - w1[k]).abs().max()) for k in w1) <= 1e-5


def test_torchrun_rank_without_groups_runs_padding(tmp_path):
    """DAPO drops the uniform-reward group, leaving one group for two dp ranks: rank 1 runs a zero-weight
    padding micro-batch so FSDP stays in step, and the update equals the one-process run."""
    from dualkv.train.rollout import RolloutBatch, RolloutGroup
    from dualkv.train.rollout_files import save_rollout_file

    gen = torch.Generator().manual_seed(0)
    groups = [RolloutGroup(torch.randint(0, 256, (9,), generator=gen), [torch.randint(0, 256, (n,), generator=gen)
                                                                        for n in (3, 5, 2)], torch.tensor(rewards), uid=g)
              for g, rewards in enumerate([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]])]
    path = save_rollout_file(RolloutBatch(groups), tmp_path / "rollouts.jsonl")
    args = ["--rollouts", str(path), "--groups", "2", "--steps", "1", "--algorithm", "dapo", "--param-dtype", "fp32",
            "--no-progress", "--lr", "1e-3"]
    runs = []
    for nproc in (1, 2):
        out_dir = tmp_path / f"n{nproc}"
        launcher = [sys.executable, "-m", "dualkv.train.grpo"] if nproc == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "dualkv.train.grpo"]
        out = subprocess.run(launcher + args + ["--output-dir", str(out_dir)], cwd=ROOT, env=_env(),
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-4000:]
        runs.append(json.loads((out_dir / "metrics.jsonl").read_text()))
    one, two = runs
    assert one["groups_used"] == two["groups_used"] == 1
    for key in ("loss", "grad_norm", "entropy"):
        assert two[key] == pytest.approx(one[key], rel=1e-5), key


def test_ranks_meet_before_the_group_is_destroyed_unless_an_error_propagates(monkeypatch):
    """destroy_distributed meets the other ranks (a barrier) before it destroys the group it created, so
    no rank closes its connections under a peer's last collective; while an exception propagates it
    does not wait for peers that may never come; a group it was given is left alone."""
    from dualkv.train import distributed

    calls = []
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(distributed.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(distributed.dist, "barrier", lambda: calls.append("barrier"))
    monkeypatch.setattr(distributed.dist, "destroy_process_group", lambda: calls.append("destroy"))
    ctx = distributed.DistContext(0, 2, 0, torch.device("cpu"), None, True)
    distributed.destroy_distributed(ctx)
    assert calls == ["barrier", "destroy"]
    calls.clear()
    with pytest.raises(RuntimeError):
        try:
            raise RuntimeError("a rank failed")
        finally:
            distributed.destroy_distributed(ctx)
    assert calls == ["destroy"]
    calls.clear()
    distributed.destroy_distributed(distributed.DistContext(0, 2, 0, torch.device("cpu"), None, False))
    assert calls == []
