"""Process group, (dp, sp) mesh and the parallel wrapping of the policy, applied in one place.

* Processes come from torchrun's standard environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
  ...; multi-node with ``--nnodes/--node-rank/--rdzv-*``). A plain ``python -m`` run gets a one-rank
  group on an in-memory store, so the single-process path runs the very same code.
* The mesh is ``dualkv.parallel.init_sp_mesh``: world ranks fill (dp, sp) row-major, every SP group
  holds consecutive ranks and trains on the same micro-batches.
* ``parallelize_policy``: activation checkpointing (per decoder layer), Ulysses SP on every attention
  module, optional ``torch.compile`` of every decoder layer, then FSDP2 ``fully_shard`` of every
  decoder layer and of the root with ``MixedPrecisionPolicy(param_dtype, reduce_dtype=float32)``.
  ``ParallelConfig.reshard_after_forward=False`` keeps each of the policy's layers' gathered
  parameters from forward to backward (no second gather, more memory); a backward frees them, so the
  next forward gathers the optimizer's new values. The frozen reference runs no backward, so it
  reshards after every forward whatever the flag (kept, its gathered copy would stay for good: the
  whole model's weights once more on every rank). ``ParallelConfig.reduce_grads_once`` reduces the
  gradients once per mini-batch instead of once per micro-batch (FSDP2's gradient accumulation
  without communication).
  Parameters are sharded over all dp x sp ranks (the dp axis flattened with sp, since SP ranks hold
  the same parameters and their gradient shares add up). FSDP's reduction averages over those
  ``fsdp_size`` ranks, while every micro-batch loss is already normalised by the whole mini-batch
  (``update``), so the trainer multiplies the backward loss by ``fsdp_size``: the result is the sum.
  (A divide factor of 1 would say the same, but needs a pre-multiplied sum that gloo lacks.)
  A frozen model (the reference) keeps its parameters in ``param_dtype`` itself: no fp32 master copy
  to update, so half the memory in bf16 and no cast before every forward, with the same values
  (FSDP would round them to ``param_dtype`` for every forward anyway).
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["DistContext", "ParallelConfig", "init_distributed", "parallelize_policy", "full_state_dict",
           "destroy_distributed"]


@dataclass(frozen=True)
class ParallelConfig:
    """sp: Ulysses SP degree (divides the world size); param_dtype: FSDP's compute dtype ("bf16" /
    "fp32"); activation_checkpointing: recompute decoder layers in backward; checkpoint_keep_attention:
    with it, keep each layer's attention output instead of recomputing the attention forward;
    compile: torch.compile every decoder layer; attention_backend: the dualkv_attention backend of
    every layer of the policy and the reference ("auto", one of ``dualkv.core.backends.BACKENDS``, or a
    forward+backward pair of them such as "triton+cuda"); deterministic_attention: bit-identical
    attention gradients run to run (``dualkv_attention(deterministic=True)``; the CUDA backward, which
    ``auto`` takes at head dims 64, 128 and 256 on Hopper, otherwise adds the prompt's gradients with fp32
    atomics); logprobs_impl: how the log-prob head reduces each chunk of logits, ``"auto"``,
    ``"torch"`` or ``"triton"`` (``CausalLM.logprobs_impl``; None leaves the model's, which reads
    ``DUALKV_LOGPROBS_IMPL``, default auto); fused_ops: the eager layers' RMSNorm, RoPE and gated
    activation, Liger-Kernel's fused kernels or PyTorch's ops (``dualkv.models.set_fused_ops``: "auto",
    "liger" or "off"; a process-wide setting); reshard_after_forward: FSDP frees each layer's gathered (``param_dtype``)
    parameters after its forward and gathers them again for the backward (True, FSDP's default: the
    least memory), or keeps them until the backward frees them (False: one gather a micro-batch fewer;
    after a no-grad pass they stay gathered until the next backward, so the policy's old_log_prob pass
    hands them on to the update; a frozen model, ``trainable=False``, reshards whatever the flag);
    reduce_grads_once: FSDP reduces a mini-batch's gradients once, after its last micro-batch, instead
    of after every one (the micro-batches before it add to unsharded fp32 gradients and keep their
    parameters gathered for the next forward: one reduce-scatter and one all-gather a layer fewer per
    micro-batch, for the memory of the whole model's unsharded gradients until the last backward; see
    ``PolicyUpdater``)."""

    sp: int = 1
    param_dtype: str = "bf16"
    activation_checkpointing: bool = False
    compile: bool = False
    checkpoint_keep_attention: bool = False
    attention_backend: str = "auto"
    deterministic_attention: bool = False
    logprobs_impl: str | None = None
    fused_ops: str = "auto"
    reshard_after_forward: bool = True
    reduce_grads_once: bool = False

    def __post_init__(self) -> None:
        from dualkv.core.backends import split_backend
        from dualkv.core.logprobs import LOGPROB_IMPLS
        from dualkv.models.fused import FUSED_MODES

        if self.fused_ops not in FUSED_MODES:
            raise ValueError(f"fused_ops: expected one of {FUSED_MODES}, got {self.fused_ops!r}")

        if self.logprobs_impl is not None and self.logprobs_impl not in LOGPROB_IMPLS:
            raise ValueError(f"logprobs_impl: expected None or one of {LOGPROB_IMPLS}, got {self.logprobs_impl!r}")
        if self.sp < 1:
            raise ValueError(f"sp: expected >= 1, got {self.sp}")
        if self.attention_backend != "auto":
            try:
                split_backend(self.attention_backend)
            except ValueError as err:
                raise ValueError(f"attention_{err}") from None
        if self.checkpoint_keep_attention and not self.activation_checkpointing:
            raise ValueError("checkpoint_keep_attention: needs activation_checkpointing (it selects what a "
                             "checkpointed layer keeps)")
        for name in ("reshard_after_forward", "reduce_grads_once"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected True or False, got {getattr(self, name)!r}")
        if self.param_dtype not in _DTYPES:
            raise ValueError(f"param_dtype: expected one of {sorted(_DTYPES)}, got {self.param_dtype!r}")

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.param_dtype]


COMPILE_VARIANTS = 32  # torch.compile graphs allowed per decoder-layer function (see ``parallelize``)
_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


@dataclass
class DistContext:
    """Who this process is: world / dp / sp coordinates, its device and the mesh (an ``SPMesh``)."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: object
    owns_group: bool

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def sp_size(self) -> int:
        return self.mesh.sp_size

    @property
    def dp_size(self) -> int:
        return self.mesh.dp_size

    @property
    def dp_rank(self) -> int:
        return self.mesh.dp_rank

    @property
    def sp_rank(self) -> int:
        return self.mesh.sp_rank

    @property
    def sp_group(self):
        return self.mesh.sp_group if self.sp_size > 1 else None

    @property
    def dp_group(self):
        return self.mesh.dp_group

    @property
    def fsdp_size(self) -> int:
        """Ranks FSDP shards parameters over (and averages gradients over): all of them."""
        return self.world_size


def init_distributed(sp: int = 1, device: str | None = None) -> DistContext:
    """Join (or create) the default process group and build the (dp, sp) mesh.

    Under torchrun the environment names the rank and world; otherwise a one-rank group is created
    on an in-memory store. Backend: nccl on CUDA, gloo on CPU.
    """
    from dualkv.parallel import init_sp_mesh

    device_type = device or ("cuda" if torch.cuda.is_available() else "cpu")
    backend = "nccl" if device_type == "cuda" else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    owns = False
    if not dist.is_initialized():
        if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        owns = True
    world = dist.get_world_size()
    if world % sp:
        raise ValueError(f"sp: expected a divisor of the world size {world}, got {sp}")
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    mesh = init_sp_mesh(sp_size=sp, device_type=device_type)
    return DistContext(dist.get_rank(), world, local_rank, dev, mesh, owns)


def destroy_distributed(ctx: DistContext) -> None:
    """Tear down the process group this context created (one it was given is the caller's). On a normal
    exit the ranks meet first, so that no rank closes its connections while a peer's last collective is
    still in flight (gloo then aborts the peer at exit); while an exception propagates (called from a
    ``finally`` or ``except``) they do not, since a failed peer may never arrive."""
    if ctx.owns_group and dist.is_initialized():
        if dist.get_world_size() > 1 and sys.exc_info()[1] is None:
            dist.barrier()
        dist.destroy_process_group()


def _blocks(model) -> list[torch.nn.Module]:
    return list(model.model.layers)


def parallelize_policy(model: torch.nn.Module, ctx: DistContext, cfg: ParallelConfig, *, trainable: bool = True,
                       seed: int | None = None):
    """Apply activation checkpointing, SP, compile and FSDP2 to ``model`` in place; returns it.

    ``trainable=False`` (the reference model) freezes the parameters and stores them in
    ``cfg.dtype`` (the compute dtype: the values FSDP would cast them to anyway). A model on the meta
    device (``build_model(..., device="meta")``) is allocated and randomly initialised with ``seed``
    one decoder layer at a time, each layer sharded as soon as it exists
    (``dualkv.models.materialize``), so no rank ever holds the whole model; its values equal
    ``build_model(..., seed=seed, device=ctx.device)``'s.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    from dualkv.models import set_fused_ops
    from dualkv.parallel import parallelize_sequence

    if not trainable:
        model.requires_grad_(False)
    options = {"backend": cfg.attention_backend} if cfg.attention_backend != "auto" else {}
    if cfg.deterministic_attention:
        options["deterministic"] = True
    if options:
        from dualkv.core import dualkv_attention

        model.set_attn_fn(functools.partial(dualkv_attention, **options))
    if cfg.logprobs_impl is not None:
        model.logprobs_impl = cfg.logprobs_impl
    set_fused_ops(cfg.fused_ops)
    if cfg.activation_checkpointing and trainable:
        model.set_activation_checkpointing(True, keep_attention=cfg.checkpoint_keep_attention)
    if ctx.sp_size > 1:
        parallelize_sequence(model, ctx.sp_group)
    if cfg.compile:
        # One graph per (policy / frozen reference) x (grad / no-grad pass) x (one / several prompt
        # groups): more variants than dynamo's default limit of 8 before it falls back to eager.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, COMPILE_VARIANTS)
        for block in _blocks(model):
            block.compile(dynamic=True)
    mp = MixedPrecisionPolicy(param_dtype=cfg.dtype, reduce_dtype=torch.float32)
    # A frozen model has no backward to keep its gathered parameters for: it always reshards.
    reshard = cfg.reshard_after_forward or not trainable
    mesh = ctx.mesh.dp_sp_mesh if ctx.world_size > 1 else ctx.mesh.mesh["dp"]

    def shard(module, root: bool = False):  # a decoder layer, then the root (what is left: embeddings, final norm)
        if not trainable:
            _store_in(module, cfg.dtype)
        # The root keeps FSDP's own default (it never reshards after forward: the log-prob head reads
        # its weights after the decoder's forward method returns).
        fully_shard(module, mesh=mesh, mp_policy=mp, **({} if root else {"reshard_after_forward": reshard}))

    if any(p.is_meta for p in model.parameters()):
        from dualkv.models import materialize

        if seed is None:
            raise ValueError("seed: a model on the meta device needs the seed of its random initialisation")
        materialize(model, ctx.device, seed=seed, units=_blocks(model), on_unit=shard)
    else:
        model.to(ctx.device)
        for block in _blocks(model):
            shard(block)
    shard(model, root=True)
    # SP calls the model through these two methods, not forward: give them FSDP's hooks too.
    register_fsdp_forward_method(model, "hidden_states")
    register_fsdp_forward_method(model, "compute_logits")
    return model


def _store_in(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast the floating-point parameters of ``module`` not yet sharded (plain tensors) to ``dtype``, in
    place (tied parameters are one object: cast once); buffers keep their dtype."""
    from torch.distributed.tensor import DTensor

    for p in module.parameters():
        if not isinstance(p, DTensor) and p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded fp32 state dict on CPU, on rank 0 (an empty dict elsewhere); a collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
