"""The collectives layer: explicit, accounted, async-capable collectives. Imports nothing from Lightning.

Every collective is a method of a :class:`CommContext`, the communication state of one job; a strategy owns
one (``strategy.comm``). Usage::

    from lightning_sync import comms
    ctx = comms.CommContext(observer=comms.CommStats())
    ctx.all_reduce(t, op="avg")
    work = ctx.all_gather(t, async_op=True); parts = work.wait()
    print(ctx.observer.table())
"""

from lightning_sync.comms import algorithms, rpc, watchdog
from lightning_sync.comms.context import CommContext, CommSettings
from lightning_sync.comms.default import (
    all_gather,
    all_reduce,
    barrier,
    broadcast,
    default_context,
    gather,
    reduce_scatter,
    scatter,
)
from lightning_sync.comms.hooks import Call, CallHook, CountingHook
from lightning_sync.comms.payload import REDUCE_OPS, check_reduce, get_rank, get_world_size, group_ranks
from lightning_sync.comms.stats import CommStats, OpStats
from lightning_sync.comms.work import Work

__all__ = [
    "REDUCE_OPS",
    "Call",
    "CallHook",
    "CountingHook",
    "CommContext",
    "CommSettings",
    "CommStats",
    "OpStats",
    "Work",
    "algorithms",
    "all_gather",
    "all_reduce",
    "barrier",
    "broadcast",
    "check_reduce",
    "default_context",
    "gather",
    "get_rank",
    "get_world_size",
    "group_ranks",
    "reduce_scatter",
    "rpc",
    "scatter",
    "watchdog",
]
