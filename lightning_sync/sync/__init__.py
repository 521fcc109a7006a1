"""The synchronization algorithms; they import nothing from Lightning and talk to a Communicator."""

from lightning_sync.checkpoint.reading import UntrustedCheckpointError
from lightning_sync.sync.bucketing import Bucket, GradBucketer, StepTrace, plan_buckets
from lightning_sync.sync.communicator import Communicator, LoopbackCommunicator
from lightning_sync.sync.compression import COMPRESSIONS, CastCompression, PowerSGD, make_compressor
from lightning_sync.sync.flat import FlatShard, OwnedSlice
from lightning_sync.sync.periodic import DiLoCoOuter, PeriodicAverager
from lightning_sync.sync.ps.server import ParameterServer, Reply, check_staleness
from lightning_sync.sync.ps.worker import LocalLink, PSWorker, RpcLink
from lightning_sync.sync.zero.consolidate import consolidate_checkpoint
from lightning_sync.sync.zero.engine import ZeroEngine
from lightning_sync.sync.zero.options import ZERO_STAGES, zero_memory_bytes

__all__ = [
    "COMPRESSIONS",
    "ZERO_STAGES",
    "Bucket",
    "CastCompression",
    "Communicator",
    "DiLoCoOuter",
    "FlatShard",
    "GradBucketer",
    "LocalLink",
    "LoopbackCommunicator",
    "OwnedSlice",
    "PSWorker",
    "ParameterServer",
    "PeriodicAverager",
    "PowerSGD",
    "Reply",
    "RpcLink",
    "StepTrace",
    "UntrustedCheckpointError",
    "ZeroEngine",
    "check_staleness",
    "consolidate_checkpoint",
    "make_compressor",
    "plan_buckets",
    "zero_memory_bytes",
]
