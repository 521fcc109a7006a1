"""``python -m lightning_sync.launch --nproc N -- python train.py``: the fault-tolerance agent
(:mod:`lightning_sync.launch.agent`), the same as ``lightning-sync launch``."""

import sys

from lightning_sync.launch.agent import main

sys.exit(main())
