"""lightning_sync: PyTorch Lightning strategies with every collective written out.

Importing the package registers its strategy names with Lightning's ``StrategyRegistry``.
"""

from lightning_sync import comms

__all__ = ["comms"]
__version__ = "0.1.0"
