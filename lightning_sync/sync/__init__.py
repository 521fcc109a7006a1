"""The synchronization algorithms; they import nothing from Lightning and talk to a Communicator."""

from lightning_sync.sync.bucketing import Bucket, GradBucketer, StepTrace, plan_buckets
from lightning_sync.sync.communicator import (
    Communicator,
    LoopbackCommunicator,
    ProcessGroupCommunicator,
)
from lightning_sync.sync.compression import COMPRESSIONS, CastCompression, PowerSGD, make_compressor
from lightning_sync.sync.sharding import ZERO_STAGES, FlatShard, OwnedSlice, zero_memory_bytes

__all__ = [
    "COMPRESSIONS", "ZERO_STAGES", "Bucket", "CastCompression", "Communicator", "FlatShard", "GradBucketer",
    "LoopbackCommunicator", "OwnedSlice", "PowerSGD", "ProcessGroupCommunicator", "StepTrace", "make_compressor",
    "plan_buckets", "zero_memory_bytes",
]
