"""The collectives layer: explicit, accounted, async-capable collectives. Imports nothing from Lightning.

Usage::

    from lightning_sync import comms
    comms.all_reduce(t, op="avg")
    work = comms.all_gather(t, async_op=True); parts = work.wait()
    print(comms.get_stats().table())
"""

from lightning_sync.comms import algorithms, rpc, watchdog
from lightning_sync.comms.collectives import (
    REDUCE_OPS,
    Work,
    all_gather,
    all_gather_into,
    all_gather_object,
    all_reduce,
    barrier,
    begin_job,
    broadcast,
    broadcast_object,
    check_reduce,
    gather,
    gather_object,
    get_rank,
    get_stats,
    get_world_size,
    group_ranks,
    recv,
    reduce,
    reduce_scatter,
    reduce_scatter_into,
    reset_stats,
    scatter,
    scope,
    send,
)
from lightning_sync.comms.stats import CommStats, OpStats

__all__ = [
    "REDUCE_OPS",
    "CommStats",
    "OpStats",
    "Work",
    "algorithms",
    "all_gather",
    "all_gather_into",
    "all_gather_object",
    "all_reduce",
    "barrier",
    "begin_job",
    "broadcast",
    "broadcast_object",
    "check_reduce",
    "gather",
    "gather_object",
    "get_rank",
    "get_stats",
    "get_world_size",
    "group_ranks",
    "recv",
    "reduce",
    "reduce_scatter",
    "rpc",
    "reduce_scatter_into",
    "reset_stats",
    "scatter",
    "scope",
    "send",
    "watchdog",
]
