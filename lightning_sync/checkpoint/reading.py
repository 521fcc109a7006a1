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
  :func:`dcp_load` unpickles ``.metadata`` itself, allowing only DCP's own metadata classes, torch
  dtypes and sizes (:func:`read_dcp_metadata`), hands DCP that checked object instead of the file, and
  reads non-tensor entries weights-only (:class:`WeightsOnlyLoadPlanner`).

Whatever the trust, a directory is read only from itself: DCP opens each storage entry at
``directory / relative_path``, so an entry of ``../elsewhere`` or ``/abs/path`` (or a symlink leading
out) would read any file the process can. Those, and a directory without ``.metadata`` (DCP would fall
back to a per-rank ``__<rank>.metadata``, unpickled without restrictions; our saves never write one),
raise ``ValueError`` before anything is unpickled or read (:func:`contained_path`).

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
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import (
    CheckpointException,
    DefaultLoadPlanner,
    FileSystemReader,
    Metadata,
)
from torch.distributed.checkpoint.metadata import StorageMeta

__all__ = [
    "UntrustedCheckpointError",
    "WeightsOnlyLoadPlanner",
    "contained_path",
    "dcp_load",
    "guarded_load",
    "load_file",
    "read_dcp_metadata",
    "refuse_directory",
    "resolve_weights_only",
]

T = TypeVar("T")

_OPT_IN = (
    "If you trust this file, opt in to arbitrary unpickling: trainer.fit(..., ckpt_path=..., "
    "weights_only=False) (likewise validate/test/predict), or weights_only=False to the function "
    "that loads it (Strategy.load_checkpoint, consolidate_checkpoint). If the global is a safe class "
    "of yours, torch.serialization.add_safe_globals([...]) allows just it."
)


class UntrustedCheckpointError(pickle.UnpicklingError):
    """A checkpoint needs arbitrary unpickling and the caller did not opt in (``weights_only=False``).

    Attributes:
        path: the file that was refused.
        offending: the global that weights-only unpickling refused (e.g. ``"posix.system"``), or None.
    """

    def __init__(self, path: Any, offending: str | None, detail: str) -> None:
        self.path, self.offending, self.detail = str(path), offending, detail
        what = f"it references {offending}, which" if offending else "it holds something that"
        super().__init__(
            f"refusing to load checkpoint {self.path}: {what} weights-only loading does not allow "
            f"(unpickling it could run arbitrary code). {_OPT_IN}\nUnpickler said: {detail}"
        )

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


def refuse_directory(path: str | os.PathLike[str]) -> None:
    """Raise ``IsADirectoryError`` saying what to do when ``path``, where a checkpoint file is expected, is a
    directory: a sharded checkpoint, which a sharded strategy loads and ``lightning-sync consolidate`` turns
    into one file (``torch.load`` would only name the errno)."""
    if os.path.isdir(path):
        raise IsADirectoryError(
            f"checkpoint {os.fspath(path)} is a directory, a sharded checkpoint (ShardedStrategy, "
            f"state_dict_type='sharded'): resume from it with strategy zero1, zero2 or zero3, at any world "
            f"size and stage, or write one plain Lightning file of its weights, which every strategy, "
            f"Model.load_from_checkpoint and torch.load read: lightning-sync consolidate {os.fspath(path)} model.ckpt"
        )


def load_file(path: str | os.PathLike[str], weights_only: bool | None = None, map_location: Any = "cpu") -> Any:
    """``torch.load(path)``, weights-only unless ``weights_only=False`` (see the module docstring); a directory
    raises :func:`refuse_directory`'s error."""
    refuse_directory(path)
    return guarded_load(lambda wo: torch.load(path, map_location=map_location, weights_only=wo), path, weights_only)


# --------------------------------------------------------------------------- torch.distributed.checkpoint
_DCP_METADATA = ".metadata"
_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
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
            module == "torch" and name.isidentifier() and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"Unsupported global: GLOBAL {module}.{name} is not part of torch.distributed.checkpoint metadata"
        )


def contained_path(directory: str | os.PathLike[str], relative: str | os.PathLike[str], what: str) -> Path:
    """``directory / relative`` with ``..`` and symlinks resolved, when that stays inside ``directory``; else a
    ``ValueError`` naming the directory, ``what`` (e.g. ``"storage entry"``) and ``relative``."""
    root = os.path.realpath(directory)
    target = os.path.realpath(os.path.join(root, relative))
    if os.path.commonpath([root, target]) != root:
        raise ValueError(
            f"refusing to load checkpoint {os.fspath(directory)}: its {what} {os.fspath(relative)!r} "
            f"leads to {target}, outside the checkpoint directory (a checkpoint reads only its own files)"
        )
    return Path(target)


def read_dcp_metadata(path: str | os.PathLike[str], weights_only: bool | None = None) -> Metadata:
    """The ``.metadata`` of the DCP directory ``path``, checked: unpickled allowing only DCP's metadata classes
    (:class:`UntrustedCheckpointError` otherwise) unless ``weights_only=False``, and, whatever the trust, every
    storage entry inside ``path`` and the file itself present (``ValueError`` otherwise; module docstring)."""
    trusted = not resolve_weights_only(weights_only)
    file = contained_path(path, _DCP_METADATA, "metadata file")
    if not file.is_file():
        raise ValueError(
            f"refusing to load checkpoint {os.fspath(path)}: it has no {_DCP_METADATA}, so it is no "
            f"complete torch.distributed.checkpoint directory (DCP would unpickle a per-rank "
            f"__<rank>.metadata instead, unrestricted; our saves never write one)"
        )
    with open(file, "rb") as f:
        try:
            metadata = pickle.load(f) if trusted else _DcpMetadataUnpickler(f).load()
        except pickle.UnpicklingError as error:
            if trusted:
                raise
            raise _refusal(file, error) from None
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(metadata, Metadata) or not isinstance(storage, dict):
        raise ValueError(
            f"refusing to load checkpoint {os.fspath(path)}: {file} holds a {type(metadata).__name__}, "
            f"not torch.distributed.checkpoint Metadata with storage entries"
        )
    checked: set[str] = set()
    for index, info in storage.items():
        relative = getattr(info, "relative_path", None)
        if not isinstance(relative, (str, os.PathLike)):
            raise ValueError(
                f"refusing to load checkpoint {os.fspath(path)}: storage entry {index!r} has "
                f"relative_path {relative!r}, not a path"
            )
        if os.fspath(relative) not in checked:
            contained_path(path, relative, "storage entry")
            checked.add(os.fspath(relative))
    return metadata


class _CheckedReader(FileSystemReader):
    """DCP's file-system reader, handed the metadata :func:`read_dcp_metadata` read and checked: DCP neither
    unpickles the file again (it could have been replaced since the check) nor falls back to a per-rank one."""

    def __init__(self, path: str | os.PathLike[str], metadata: Metadata) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if getattr(self._metadata, "storage_meta", None) is None:  # as FileSystemReader.read_metadata does
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


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


def dcp_load(
    state_dict: dict[str, Any],
    path: str | os.PathLike[str],
    weights_only: bool | None = None,
    *,
    metadata: Metadata | None = None,
    **kwargs: Any,
) -> None:
    """``torch.distributed.checkpoint.load(state_dict, **kwargs)`` of the directory ``path``, weights-only unless
    ``weights_only=False``: DCP gets the ``.metadata`` checked by :func:`read_dcp_metadata` (pass ``metadata``
    when you already read it that way), and non-tensor entries are read by :class:`WeightsOnlyLoadPlanner`.
    A refusal raises :class:`UntrustedCheckpointError`, an entry outside ``path`` ``ValueError``."""
    trusted = not resolve_weights_only(weights_only)
    reader = _CheckedReader(path, metadata if metadata is not None else read_dcp_metadata(path, weights_only))
    if trusted:
        dcp.load(state_dict, storage_reader=reader, **kwargs)
        return
    planner = WeightsOnlyLoadPlanner(checkpoint_id=str(path))
    try:
        dcp.load(state_dict, storage_reader=reader, planner=planner, **kwargs)
    except CheckpointException:  # (a BaseException) wraps every rank's error
        if planner.refused is not None:
            raise planner.refused from None
        raise
