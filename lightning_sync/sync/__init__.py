"""The synchronization algorithms; they import nothing from Lightning and talk to a Communicator."""

from lightning_sync.sync.bucketing import Bucket, GradBucketer, StepTrace, plan_buckets
from lightning_sync.sync.communicator import (
    Communicator,
    LoopbackCommunicator,
    ProcessGroupCommunicator,
)
from lightning_sync.sync.compression import COMPRESSIONS, CastCompression, PowerSGD, make_compressor

__all__ = [
    "COMPRESSIONS", "Bucket", "CastCompression", "Communicator", "GradBucketer", "LoopbackCommunicator",
    "PowerSGD", "ProcessGroupCommunicator", "StepTrace", "make_compressor", "plan_buckets",
]
