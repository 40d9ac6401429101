"""What may stand for a sequence-parallel group: None (no SP, one device), a ProcessGroup, or a
1-D DeviceMesh. Every public function of dualkv.parallel accepts any of the three."""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["as_process_group", "group_rank", "group_size"]


def as_process_group(group):
    """None -> None (single device); a 1-D DeviceMesh -> its ProcessGroup; a ProcessGroup as is."""
    if group is None or isinstance(group, dist.ProcessGroup):
        return group
    get_group = getattr(group, "get_group", None)
    if get_group is not None and getattr(group, "ndim", None) == 1:
        return get_group()
    raise ValueError(
        f"sp_group: expected None (no sequence parallelism), a ProcessGroup or a 1-D DeviceMesh, got {type(group).__name__}"
        + (f" with {group.ndim} dims (index it, e.g. mesh['sp'])" if getattr(group, "ndim", None) else "")
    )


def group_size(group) -> int:
    pg = as_process_group(group)
    return 1 if pg is None else dist.get_world_size(pg)


def group_rank(group) -> int:
    pg = as_process_group(group)
    return 0 if pg is None else dist.get_rank(pg)
