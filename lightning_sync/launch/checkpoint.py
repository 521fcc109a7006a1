"""``IntervalCheckpoint``: Lightning's ``ModelCheckpoint`` at epoch ends and every N optimizer steps as well.

Lightning's ``ModelCheckpoint`` takes one interval: ``every_n_epochs`` and ``every_n_train_steps`` together
raise ``MisconfigurationException``. Long jobs want both: a checkpoint every N steps bounds what a crash loses
(mid-epoch checkpoints resume exactly with lightning_sync strategies, :mod:`lightning_sync.resume`), and the
epoch ends stay natural points to keep. Two callbacks cannot share one ``last.ckpt`` (the second writes
``last-v1.ckpt``, and both save the final step under one name), so this is one callback whose step trigger is
Lightning's and whose epoch trigger is added to it; a step already saved is never saved twice.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_sync._lightning import set_every_n_epochs

__all__ = ["IntervalCheckpoint"]


class IntervalCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` accepting ``every_n_epochs`` and ``every_n_train_steps`` together (module docstring);
    with one of them, or neither, it is Lightning's ``ModelCheckpoint`` exactly. Every other argument is
    ``ModelCheckpoint``'s."""

    def __init__(
        self, *args: Any, every_n_epochs: int | None = None, every_n_train_steps: int | None = None, **kwargs: Any
    ) -> None:
        both = bool(every_n_epochs) and bool(every_n_train_steps)
        super().__init__(
            *args, every_n_epochs=None if both else every_n_epochs, every_n_train_steps=every_n_train_steps, **kwargs
        )
        if both:
            if not isinstance(every_n_epochs, int) or isinstance(every_n_epochs, bool) or every_n_epochs < 1:
                raise ValueError(f"every_n_epochs must be an int >= 1 or None, got {every_n_epochs!r}")
            # the attribute ModelCheckpoint's epoch-end and validation-end saves read
            set_every_n_epochs(self, every_n_epochs)
