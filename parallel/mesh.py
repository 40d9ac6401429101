"""The (dp, sp) device mesh that FSDP2, the trainer and sequence parallelism share.

World ranks fill the mesh row-major: rank = dp_rank * sp + sp_rank, so an SP group is ``sp``
consecutive ranks (one node's GPUs when sp <= GPUs per node: the all-to-all stays on NVLink)::

    world 8, sp 4:   dp 0: ranks 0 1 2 3     dp 1: ranks 4 5 6 7

Every rank of one SP group must get the SAME micro-batch (same layout); data-parallel replicas get
different ones. Parameters are replicated across the SP group; shard them with FSDP2 over the
flattened ``dp_sp`` mesh. The SP ranks' gradients ADD UP to their replica's gradient (see
``dualkv.parallel.logprobs``), so FSDP2's reduction must divide by ``dp`` only, not by dp * sp:
``prepare_fsdp_for_sp(model, mesh)`` after ``fully_shard`` sets that on every FSDP unit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["SPMesh", "init_sp_mesh", "prepare_fsdp_for_sp"]


@dataclass(frozen=True)
class SPMesh:
    """A 2-D DeviceMesh with dims ("dp", "sp") and the groups taken from it."""

    mesh: DeviceMesh

    @property
    def sp_mesh(self) -> DeviceMesh:
        return self.mesh["sp"]

    @property
    def dp_mesh(self) -> DeviceMesh:
        return self.mesh["dp"]

    @property
    def dp_sp_mesh(self) -> DeviceMesh:
        """1-D mesh over all ranks (dp x sp flattened): the mesh to shard parameters over with FSDP2."""
        return self.mesh["dp", "sp"]._flatten("dp_sp")

    @property
    def sp_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("sp")

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("dp")

    @property
    def sp_size(self) -> int:
        return self.mesh.size(1)

    @property
    def dp_size(self) -> int:
        return self.mesh.size(0)

    @property
    def sp_rank(self) -> int:
        return self.mesh.get_local_rank("sp")

    @property
    def dp_rank(self) -> int:
        return self.mesh.get_local_rank("dp")

    @property
    def grad_divide_factor(self) -> float:
        """What FSDP2 over ``dp_sp_mesh`` should divide summed gradients by: the dp size."""
        return float(self.dp_size)


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {value!r}")


def init_sp_mesh(sp_size: int, dp_size: int | None = None, device_type: str | None = None) -> SPMesh:
    """Build the (dp, sp) mesh over the default process group (initialised first, e.g. by torchrun).

    Args:
        sp_size: ranks per sequence-parallel group; must divide the world size.
        dp_size: data-parallel replicas; default world_size // sp_size (must multiply to the world size).
        device_type: "cuda" / "cpu" / ...; default "cuda" when available, else "cpu".
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("torch.distributed: expected an initialised default process group (init_process_group / torchrun)")
    world = dist.get_world_size()
    _check_positive_int("sp_size", sp_size)
    if world % sp_size:
        raise ValueError(f"sp_size: expected a divisor of the world size {world}, got {sp_size}")
    if dp_size is None:
        dp_size = world // sp_size
    _check_positive_int("dp_size", dp_size)
    if dp_size * sp_size != world:
        raise ValueError(f"dp_size: expected dp_size * sp_size == world size {world}, got {dp_size} * {sp_size}")
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return SPMesh(init_device_mesh(device_type, (dp_size, sp_size), mesh_dim_names=("dp", "sp")))


def prepare_fsdp_for_sp(model: torch.nn.Module, mesh: SPMesh, *, force_sum_reduction: bool | None = None) -> int:
    """Make an FSDP2 model (``fully_shard`` over ``mesh.dp_sp_mesh``) reduce gradients right under SP.

    * every FSDP unit divides the reduced gradients by ``dp`` (the SP ranks' gradients are shares of
      one replica's gradient, to be summed, not averaged);
    * ``hidden_states`` runs FSDP's forward hooks (the SP entry calls it instead of ``forward``;
      the root unit keeps its parameters, e.g. the LM head, unsharded until backward);
    * ``force_sum_reduction`` (default: when the backend is gloo, which has no pre-multiplied sum):
      reduce with a plain sum and scale separately.
    Returns the number of FSDP units configured.
    """
    from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not units:
        raise ValueError("model: expected a model sharded with torch.distributed.fsdp.fully_shard, found no FSDP unit")
    if force_sum_reduction is None:
        force_sum_reduction = dist.get_backend(mesh.sp_group) == "gloo"
    for unit in units:
        unit.set_gradient_divide_factor(mesh.grad_divide_factor)
        if force_sum_reduction:
            unit.set_force_sum_reduction_for_comms(True)
    if isinstance(model, FSDPModule) and hasattr(model, "hidden_states"):
        register_fsdp_forward_method(model, "hidden_states")
    return len(units)
