"""``lightning-sync consolidate``: one plain Lightning checkpoint file from a ZeRO sharded checkpoint directory.

A sharded checkpoint (:class:`~lightning_sync.strategies.ShardedStrategy`) is a directory that only a
sharded strategy loads. :func:`consolidate_to_file` turns it into the file a plain ``Trainer`` would have
written with ``save_weights_only=True``: the full ``state_dict`` (streamed from the shards by
:func:`~lightning_sync.sync.zero.consolidate.consolidate_checkpoint`: peak memory is the model plus one
chunk, and the optimizer state in the shards is never read) and what Lightning keeps in such a file, taken
from the directory's ``lightning.pt``: ``epoch``, ``global_step``, ``pytorch-lightning_version``, ``loops``,
``hyper_parameters`` (so ``MyModule.load_from_checkpoint(file)`` rebuilds the module) and whatever the
module's ``on_save_checkpoint`` added. It loads with ``torch.load(file, weights_only=True)``.

Left out: the optimizer and LR-scheduler states, the callbacks' state, the precision plugin's, and our
strategies' resume state (every rank's RNG streams and data position). A consolidated file is for
inference, export and fine-tuning (``load_from_checkpoint``, then a fresh ``fit``), not for an exact
resume: ``trainer.fit(ckpt_path=file)`` stops, as for any weights-only file, with Lightning's "contains only
the model". Resume from the sharded directory itself, at any world size and stage.

The directory is read as every sharded load reads it (:mod:`lightning_sync.checkpoint.reading`): weights-only
unless ``weights_only=False`` (``--trust-pickles``), and, whatever the trust, refused when it has no
``.metadata`` or would read a file outside itself. The output is written to a hidden temporary file beside
it and renamed into place (:func:`~lightning_sync.checkpoint.atomic.write_atomically`), so a refused or failed
consolidation leaves no file, and an existing one is replaced whole or not at all.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["RESUME_ONLY_KEYS", "consolidate_to_file", "main"]

RESUME_ONLY_KEYS = ("optimizer_states", "lr_schedulers", "callbacks")
"""Keys of Lightning's checkpoint that only resuming training reads: Lightning leaves them out of a
weights-only file, and so does a consolidated one (with the precision plugin's state and ``lightning_sync/*``)."""

USAGE = """usage: lightning-sync consolidate CHECKPOINT_DIR OUTPUT_FILE [--trust-pickles]

Writes one plain Lightning checkpoint file from a ZeRO sharded checkpoint directory (strategy=zero1|zero2|zero3),
for inference, export or fine-tuning: MyModule.load_from_checkpoint(OUTPUT_FILE) and
torch.load(OUTPUT_FILE, weights_only=True) both read it. It streams the shards (memory: the model plus one
chunk) and leaves out the optimizer state, so it cannot resume training exactly; resume from the directory.
"""


def consolidate_to_file(
    checkpoint_dir: str | os.PathLike[str], output_file: str | os.PathLike[str], weights_only: bool = True
) -> dict[str, Any]:
    """Write the Lightning checkpoint of the sharded ``checkpoint_dir`` to ``output_file`` (see the module
    docstring) and return it. Raises ``ValueError`` (not a sharded checkpoint, an entry outside it, no
    ``.metadata``) or :class:`~lightning_sync.checkpoint.reading.UntrustedCheckpointError` before writing anything."""
    import torch

    from lightning_sync.checkpoint.atomic import write_atomically
    from lightning_sync.checkpoint.reading import contained_path, load_file, read_dcp_metadata
    from lightning_sync.sync.zero.consolidate import consolidate_checkpoint
    from lightning_sync.sync.zero.format import LIGHTNING_STATE, read_meta

    source, output = Path(checkpoint_dir), Path(output_file)
    if not source.is_dir():
        what = "is a file; a full checkpoint file needs no consolidation" if source.is_file() else "does not exist"
        raise ValueError(f"sharded checkpoint directory {os.fspath(source)} {what}")
    if output.is_dir():
        raise ValueError(f"output file {os.fspath(output)} is a directory; name the file to write")
    # the cheap checks first (the layout file, DCP's .metadata and where its entries lead), then Lightning's
    # small state, so a refused directory costs no read of the shards
    read_meta(source)
    read_dcp_metadata(source, weights_only)
    state_file = contained_path(source, LIGHTNING_STATE, "Lightning state file")
    state = load_file(state_file, weights_only) if state_file.is_file() else {}
    checkpoint = {k: v for k, v in state.items() if not _resume_only(k)}
    checkpoint.setdefault("pytorch-lightning_version", _lightning_version())
    model = consolidate_checkpoint(source, weights_only=weights_only)
    if checkpoint.get("state_dict"):
        # a callback's, which Lightning's file carries as its state_dict, as ddp's does: weight averaging's average
        # (the model then goes where it put it, "current_model_state"), or pruning's permanent form of the model
        if checkpoint.get("current_model_state") == {}:
            checkpoint["current_model_state"] = model
    else:
        checkpoint["state_dict"] = model
    write_atomically(output, lambda f: torch.save(checkpoint, f))
    return checkpoint


def _resume_only(key: str) -> bool:
    """A key only resuming training reads (``RESUME_ONLY_KEYS``, our strategies' ``lightning_sync/*`` state,
    or a precision plugin's state, which Lightning stores under the plugin's class name)."""
    if key in RESUME_ONLY_KEYS or key.startswith("lightning_sync/"):
        return True
    if key in _LIGHTNING_KEPT:
        return False
    # a key of the user's (on_save_checkpoint) or a precision plugin's: only then is Lightning imported, so the
    # usual directory consolidates without its import (seconds of start-up)
    from lightning.pytorch.plugins import precision

    return isinstance(getattr(precision, key, None), type)


# what Lightning's own weights-only file keeps besides the user's keys (trainer/connectors/checkpoint_connector.py)
_LIGHTNING_KEPT = frozenset(
    (
        "epoch",
        "global_step",
        "pytorch-lightning_version",
        "state_dict",
        "loops",
        "hparams_name",
        "hyper_parameters",
        "hparams_type",
        "datamodule_hparams_name",
        "datamodule_hyper_parameters",
        "datamodule_hparams_type",
    )
)


def _lightning_version() -> str:
    """For a directory without Lightning's state (an engine's own save): Lightning migrates a checkpoint
    without a version as one of 0.0.0. The installed distribution's version, without importing it."""
    from importlib.metadata import version

    return version("lightning")


def main(argv: Sequence[str]) -> None:
    """``lightning-sync consolidate CHECKPOINT_DIR OUTPUT_FILE [--trust-pickles]``; a refused or unreadable
    directory exits non-zero with the reason, and no output file."""
    parser = argparse.ArgumentParser(prog="lightning-sync consolidate", usage=USAGE.split("\n")[0][len("usage: ") :])
    parser.description = USAGE.split("\n", 2)[2].strip()
    parser.add_argument("checkpoint_dir", help="the sharded checkpoint directory (e.g. checkpoints/last.ckpt)")
    parser.add_argument("output_file", help="the file to write (replaced if it exists)")
    parser.add_argument(
        "--trust-pickles",
        action="store_true",
        help="unpickle without restriction (weights_only=False): only for a checkpoint you trust, since "
        "unpickling can run any code the file names",
    )
    args = parser.parse_args(list(argv))
    from lightning_sync.checkpoint.reading import UntrustedCheckpointError

    try:
        checkpoint = consolidate_to_file(args.checkpoint_dir, args.output_file, weights_only=not args.trust_pickles)
    except UntrustedCheckpointError as err:
        raise SystemExit(
            f"lightning-sync consolidate: {err}\n(On the command line the opt-in is --trust-pickles.)"
        ) from None
    except (ValueError, OSError) as err:
        raise SystemExit(f"lightning-sync consolidate: {err}") from None
    weights = checkpoint["state_dict"]
    size = sum(t.numel() * t.element_size() for t in {id(t): t for t in weights.values()}.values())
    at = "".join(f", {k.replace('_', ' ')} {checkpoint[k]}" for k in ("epoch", "global_step") if k in checkpoint)
    sys.stdout.write(
        f"wrote {args.output_file}: {len(weights)} tensors, {size / 2**20:.1f} MiB of weights{at} "
        f"(optimizer state left out)\n"
    )
