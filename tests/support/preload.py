"""What the harness's forkserver does once, at its start, so that no forked rank repeats it.

Imported by the forkserver after :data:`~lightning_sync.testing.startup.PRELOAD` (the test session names it:
``warm_up(extra=...)`` in ``tests/conftest.py``). It composes the ``train`` config once with the kind of
overrides the tests pass: Hydra's override grammar is an ANTLR parser that builds its prediction tables lazily,
on the first strings it parses, and keeps them on the parser class. Built here, every rank forked afterwards
inherits them, and a ``lightning-sync train`` rank composes its config in a
fraction of the time (measured: a 2-rank, 10-step CLI run from 1.9 s to 1.4 s of wall time on 2 cores).

Nothing here may raise (the forkserver survives only an ``ImportError`` of a preloaded module); the
composed config is discarded; Hydra's global state is cleared again on leaving its context, so a forked
rank starts it as a fresh process would.
"""

from __future__ import annotations

from lightning_sync._config import config_dir

#: Overrides of every syntax the tests use: dotted keys, a group choice, a quoted and a nested value, an
#: appended key with a dict, a list and a sweep. The parser's tables are per grammar rule, not per string.
_OVERRIDES = [
    "trainer.devices=1",
    "trainer.num_nodes=2",
    "trainer.enable_progress_bar=false",
    "strategy=zero3",
    "strategy.bucket_cap_mb=0.01",
    "checkpoint.every_n_train_steps=2",
    "final_checkpoint=/tmp/run/final.ckpt",
    "hydra.run.dir=/tmp/run",
    "+diagnostics.fault={_target_: lightning_sync.diagnostics.faults.KillAtStep, rank: 1, step: 7, phase: forward}",
    "+checkpoint.save_top_k=-1",
    "launch.signal=USR1",
    "ckpt_path=last",
    "model=char_gpt",
    "seed='3'",
    "trainer.max_steps=4,6",
    "batch.global_size=[48]",
]


def _compose_once() -> None:
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser

    # every override through the grammar (a sweep cannot be composed), then one real composition, which also
    # loads and caches the config repository's modules
    OverridesParser.create().parse_overrides(_OVERRIDES)
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        compose("train", overrides=["strategy=zero3", "model=char_gpt", "trainer.max_steps=4"])


try:
    _compose_once()
except Exception:  # noqa: BLE001, S110 - only a warm-up: the forkserver skips nothing but an ImportError, and a
    pass  # failure here must not stop it; each rank then parses its own overrides
