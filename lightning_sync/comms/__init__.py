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
from lightning_sync.comms.payload import REDUCE_OPS, check_reduce, get_rank, get_world_size, group_ranks
from lightning_sync.comms.stats import CommStats, OpStats
from lightning_sync.comms.work import Observer, Work

__all__ = [
    "REDUCE_OPS",
    "CommContext",
    "CommSettings",
    "CommStats",
    "Observer",
    "OpStats",
    "Work",
    "algorithms",
    "check_reduce",
    "get_rank",
    "get_world_size",
    "group_ranks",
    "rpc",
    "watchdog",
]

# --- transitional: the process-wide context the callers not yet holding a context of their own still use ---
_DEFAULT = CommContext(observer=CommStats())


def get_stats() -> CommStats:
    return _DEFAULT.observer  # type: ignore[return-value]


def reset_stats() -> None:
    _DEFAULT.observer.reset()  # type: ignore[union-attr]


begin_job = _DEFAULT.begin_job
scope = _DEFAULT.scope
barrier = _DEFAULT.barrier
all_reduce = _DEFAULT.all_reduce
reduce = _DEFAULT.reduce
broadcast = _DEFAULT.broadcast
broadcast_object = _DEFAULT.broadcast_object
all_gather = _DEFAULT.all_gather
all_gather_into = _DEFAULT.all_gather_into
reduce_scatter = _DEFAULT.reduce_scatter
reduce_scatter_into = _DEFAULT.reduce_scatter_into
gather = _DEFAULT.gather
gather_object = _DEFAULT.gather_object
scatter = _DEFAULT.scatter
all_gather_object = _DEFAULT.all_gather_object
send = _DEFAULT.send
recv = _DEFAULT.recv
