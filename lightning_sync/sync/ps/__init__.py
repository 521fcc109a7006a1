"""The parameter server (Li et al., OSDI 2014) with bounded staleness: the package, and the names importers use.

* :mod:`~lightning_sync.sync.ps.server` - :class:`ParameterServer`, the one global model and its optimizer;
* :mod:`~lightning_sync.sync.ps.worker` - :class:`PSWorker` and its links to the server (in-process or RPC);
* :mod:`~lightning_sync.sync.ps.wire` - the flat messages between them (:class:`FlatLayout`, :class:`Reply`);
* :mod:`~lightning_sync.sync.ps.step` - how the server applies a step of pushed gradients;
* :mod:`~lightning_sync.sync.ps.state` - what of the server a checkpoint holds, and how it comes back.
"""

from lightning_sync.sync.ps.server import ParameterServer, check_staleness
from lightning_sync.sync.ps.wire import FlatLayout, Reply
from lightning_sync.sync.ps.worker import LocalLink, PSWorker, RpcLink

__all__ = ["FlatLayout", "LocalLink", "PSWorker", "ParameterServer", "Reply", "RpcLink", "check_staleness"]
