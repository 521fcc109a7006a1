"""Reading checkpoints without trusting them: ``weights_only=True`` unless the caller opts in.

Unpickling runs whatever code the file names (``torch.load(weights_only=False)``, ``pickle.load``), so
a checkpoint from someone else is a program. Every path by which lightning_sync reads a checkpoint
goes through this module and restricts unpickling to tensors and plain data (dicts, lists, tuples,
numbers, strings) unless the caller passes ``weights_only=False``:

* **Checkpoint files** (Lightning's ``.ckpt``, a sharded directory's ``lightning.pt``):
  ``torch.load(weights_only=True)``. Lightning 2.6 hands ``Strategy.load_checkpoint`` the
  ``weights_only`` given to ``trainer.fit/validate/test/predict`` (default ``None``); our strategies
  read ``None`` as ``True``.
* **Sharded directories** (``torch.distributed.checkpoint``): DCP itself reads the ``.metadata``
  file with plain ``pickle.load`` and non-tensor entries with ``torch.load(weights_only=False)``.
  :func:`dcp_load` first unpickles ``.metadata`` allowing only DCP's own metadata classes, torch
  dtypes and sizes (:func:`check_dcp_metadata`), and reads non-tensor entries weights-only
  (:class:`WeightsOnlyLoadPlanner`).

A refused checkpoint raises :class:`UntrustedCheckpointError` naming the file, the global that
weights-only unpickling refused, and the opt-in: ``trainer.fit(..., ckpt_path=..., weights_only=False)``
(or ``weights_only=False`` to the function that loads). Opt in only for files you trust.
Imports nothing from Lightning.
"""

from __future__ import annotations

import io
import os
import pickle
import re
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, DefaultLoadPlanner

__all__ = ["UntrustedCheckpointError", "WeightsOnlyLoadPlanner", "check_dcp_metadata", "dcp_load", "guarded_load",
           "load_file", "resolve_weights_only"]

T = TypeVar("T")

_OPT_IN = ("If you trust this file, opt in to arbitrary unpickling: trainer.fit(..., ckpt_path=..., "
           "weights_only=False) (likewise validate/test/predict), or weights_only=False to the function "
           "that loads it (Strategy.load_checkpoint, consolidate_checkpoint). If the global is a safe class "
           "of yours, torch.serialization.add_safe_globals([...]) allows just it.")


class UntrustedCheckpointError(pickle.UnpicklingError):
    """A checkpoint needs arbitrary unpickling and the caller did not opt in (``weights_only=False``).

    Attributes:
        path: the file that was refused.
        offending: the global that weights-only unpickling refused (e.g. ``"posix.system"``), or None.
    """

    def __init__(self, path: Any, offending: str | None, detail: str) -> None:
        self.path, self.offending, self.detail = str(path), offending, detail
        what = f"it references {offending}, which" if offending else "it holds something that"
        super().__init__(f"refusing to load checkpoint {self.path}: {what} weights-only loading does not allow "
                         f"(unpickling it could run arbitrary code). {_OPT_IN}\nUnpickler said: {detail}")

    def __reduce__(self) -> tuple[Any, ...]:  # survives being sent between processes
        return type(self), (self.path, self.offending, self.detail)


def resolve_weights_only(weights_only: bool | None) -> bool:
    """``None`` (Lightning's default) means ``True``; anything but a bool raises ``ValueError``."""
    if weights_only is None:
        return True
    if not isinstance(weights_only, bool):
        raise ValueError(f"weights_only must be True, False or None (= True), got {weights_only!r}")
    return weights_only


def _offending(message: str) -> str | None:
    found = re.search(r"GLOBAL (\S+)", message) or re.search(r"whose module (\S+) is blocked", message)
    return found.group(1) if found else None


def _refusal(path: Any, error: pickle.UnpicklingError) -> UntrustedCheckpointError:
    message = str(error)
    lines = [ln.strip() for ln in message.splitlines() if "GLOBAL" in ln or "blocked" in ln]
    detail = lines[0] if lines else message.strip().splitlines()[-1] if message.strip() else type(error).__name__
    return UntrustedCheckpointError(path, _offending(message), detail)


def guarded_load(load: Callable[[bool], T], path: Any, weights_only: bool | None) -> T:
    """``load(weights_only)`` with ``None`` read as ``True``; a weights-only refusal becomes
    :class:`UntrustedCheckpointError` naming ``path``. For loaders we do not own (Lightning's
    ``Strategy.load_checkpoint``, which calls ``torch.load`` with the ``weights_only`` it is given)."""
    resolved = resolve_weights_only(weights_only)
    try:
        return load(resolved)
    except UntrustedCheckpointError:
        raise
    except pickle.UnpicklingError as error:
        if not resolved:
            raise
        raise _refusal(path, error) from None


def load_file(path: str | os.PathLike[str], weights_only: bool | None = None, map_location: Any = "cpu") -> Any:
    """``torch.load(path)``, weights-only unless ``weights_only=False`` (see the module docstring)."""
    return guarded_load(lambda wo: torch.load(path, map_location=map_location, weights_only=wo), path, weights_only)


# --------------------------------------------------------------------------- torch.distributed.checkpoint
_DCP_METADATA = ".metadata"
_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                              "TensorStorageMetadata", "ChunkStorageMetadata",
                                              "BytesStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # a lookup of a layout by name
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _DcpMetadataUnpickler(pickle.Unpickler):
    """Allows DCP's metadata classes, torch dtypes/sizes and paths; refuses every other global."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_CLASSES.get(module, ()) or (
                module == "torch" and name.isidentifier() and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"Unsupported global: GLOBAL {module}.{name} is not part of "
                                     f"torch.distributed.checkpoint metadata")


def check_dcp_metadata(path: str | os.PathLike[str], weights_only: bool | None = None) -> None:
    """Before DCP ``pickle.load``s a sharded checkpoint's ``.metadata``: unpickle it allowing only DCP's
    metadata classes (nothing else is constructed or called); raise :class:`UntrustedCheckpointError`
    otherwise. Does nothing with ``weights_only=False`` or when the file is absent (DCP then says so)."""
    file = os.path.join(os.fspath(path), _DCP_METADATA)
    if not resolve_weights_only(weights_only) or not os.path.isfile(file):
        return
    with open(file, "rb") as f:
        try:
            _DcpMetadataUnpickler(f).load()
        except pickle.UnpicklingError as error:
            raise _refusal(file, error) from None


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but non-tensor entries are unpickled weights-only: DCP reads them
    with ``torch.load(weights_only=False)``, so we load them safely first and hand DCP a re-serialized
    copy of what came out. DCP wraps a refusal in its ``CheckpointException``; :func:`dcp_load`
    re-raises the :class:`UntrustedCheckpointError` itself (kept in ``refused``)."""

    def __init__(self, checkpoint_id: Any = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._checkpoint_id = checkpoint_id
        self.refused: UntrustedCheckpointError | None = None

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        where = f"{self._checkpoint_id} (entry {read_item.dest_index.fqn!r})"
        try:
            obj = guarded_load(lambda wo: torch.load(value, map_location="cpu", weights_only=wo), where, True)
        except UntrustedCheckpointError as error:
            self.refused = error
            raise
        clean = io.BytesIO()
        torch.save(obj, clean)
        clean.seek(0)
        super().load_bytes(read_item, clean)


def dcp_load(state_dict: dict[str, Any], path: str | os.PathLike[str], weights_only: bool | None = None,
             **kwargs: Any) -> None:
    """``torch.distributed.checkpoint.load(state_dict, checkpoint_id=path, **kwargs)``, weights-only unless
    ``weights_only=False``: the ``.metadata`` is checked first (:func:`check_dcp_metadata`) and non-tensor
    entries are read by :class:`WeightsOnlyLoadPlanner`. A refusal raises :class:`UntrustedCheckpointError`."""
    if not resolve_weights_only(weights_only):
        dcp.load(state_dict, checkpoint_id=str(path), **kwargs)
        return
    check_dcp_metadata(path, weights_only)
    planner = WeightsOnlyLoadPlanner(checkpoint_id=str(path))
    try:
        dcp.load(state_dict, checkpoint_id=str(path), planner=planner, **kwargs)
    except CheckpointException:  # (a BaseException) wraps every rank's error
        if planner.refused is not None:
            raise planner.refused from None
        raise
