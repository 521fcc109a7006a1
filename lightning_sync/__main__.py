"""``python -m lightning_sync train ...`` is the same as ``lightning-sync train ...``."""

from lightning_sync.cli import main

main()
