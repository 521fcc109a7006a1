"""The node layout of a job: one process sub-group per node and one of the node leaders.

The hierarchical all-reduce (:func:`~lightning_sync.comms.algorithms.hierarchical_all_reduce`) reduces within
nodes and all-reduces among their leaders. Its sub-groups are state of a job, so a
:class:`~lightning_sync.comms.context.CommContext` builds and caches them
(:meth:`~lightning_sync.comms.context.CommContext.node_groups`) and destroys them when its job ends. The layout
lives here, apart from both, so that the context (which holds it) and the algorithms (which use it) need not
import each other.
"""

from __future__ import annotations

import os

import torch.distributed as dist

from lightning_sync.comms import payload as P

__all__ = ["NodeGroups", "resolve_ranks_per_node"]


class NodeGroups:
    """The sub-groups of a job laid out node by node, ``ranks_per_node`` (L) ranks each: one group per node
    and one of the node leaders (local rank 0). ``torch.distributed.new_group`` is collective, so every
    rank builds every group, in the same order; build it outside backward
    (:meth:`~lightning_sync.comms.context.CommContext.node_groups`)."""

    def __init__(self, ranks_per_node: int) -> None:
        world = P.get_world_size()
        if (
            isinstance(ranks_per_node, bool)
            or not isinstance(ranks_per_node, int)
            or ranks_per_node < 1
            or world % ranks_per_node
        ):
            raise ValueError(
                f"ranks_per_node must be an int >= 1 that divides the world size {world}, got {ranks_per_node!r}"
            )
        self.ranks_per_node = ranks_per_node
        self.nodes = [list(range(n * ranks_per_node, (n + 1) * ranks_per_node)) for n in range(world // ranks_per_node)]
        self.leaders = [ranks[0] for ranks in self.nodes]
        groups = [dist.new_group(ranks) for ranks in self.nodes]
        self.leader_group = dist.new_group(self.leaders)
        me = P.get_rank()
        self.node = me // ranks_per_node
        self.node_group = groups[self.node]
        self.leader = self.leaders[self.node]
        self.world = dist.group.WORLD  # the default group these sub-groups belong to

    def destroy(self) -> None:
        """Destroy this rank's sub-groups (its node's, and the leaders' on a leader); local, not collective."""
        mine = [self.node_group, *([self.leader_group] if P.get_rank() == self.leader else [])]
        for group in mine:
            if dist.is_initialized() and group in dist.distributed_c10d._world.pg_map:
                dist.destroy_process_group(group)


def resolve_ranks_per_node(ranks_per_node: int | None) -> int:
    """``ranks_per_node``, or from the environment: ``LOCAL_WORLD_SIZE`` (torchrun, Lightning) or
    ``SLURM_NTASKS_PER_NODE``."""
    if ranks_per_node is not None:
        return ranks_per_node
    value = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
    if not value:
        raise ValueError(
            "hierarchical all-reduce needs ranks_per_node "
            "(or LOCAL_WORLD_SIZE / SLURM_NTASKS_PER_NODE in the environment)"
        )
    return int(value)
