"""A sharded checkpoint directory is read only from itself, and only through its ``.metadata``.

Two ways a crafted directory gets past a check of ``.metadata`` alone:

* **No ``.metadata``**: ``torch.distributed.checkpoint.load`` then falls back to ``__<rank>.metadata``,
  unpickled with plain ``pickle``. Here that file holds a real payload (``os.system("touch MARKER")``).
* **Storage entries that point elsewhere**: a ``.metadata`` made of allowed classes only, whose entries'
  ``relative_path`` is ``../outside/...`` or an absolute path. The outside checkpoint holds other values
  (42), so a loader that read it would return them, and, opted in to arbitrary unpickling, would run a payload.

Every loader must refuse both with a ``ValueError`` naming the directory and what is wrong, before any
unpickling and before any read outside. One process: a ``LoopbackCommunicator`` stands in for the peers.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from lightning_sync import ShardedStrategy
from lightning_sync.checkpoint.reading import dcp_load
from lightning_sync.diagnostics.faults import UnpicklePayload
from lightning_sync.sync import LoopbackCommunicator, ZeroEngine, consolidate_checkpoint
from lightning_sync.sync.zero import full_state_dict, load_sharded, save_sharded
from lightning_sync.sync.zero.format import COMPLETE_MARKER

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.distributed.*:UserWarning")  # DCP without a group


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _engine(fill: float | None = None) -> ZeroEngine:
    torch.manual_seed(0)
    net = _Net()
    if fill is not None:
        with torch.no_grad():
            for p in net.parameters():
                p.fill_(fill)
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    engine = ZeroEngine(net, opt, LoopbackCommunicator(1), stage=3)
    engine.gather_root()
    return engine


def _save(path: Path, fill: float | None = None) -> ZeroEngine:
    """A complete sharded checkpoint, as ShardedStrategy.save_checkpoint leaves one."""
    engine = _engine(fill)
    save_sharded(engine, path)
    torch.save({"global_step": 1, "optimizer_states": [{"param_groups": [{"lr": 0.01}]}]}, path / "lightning.pt")
    (path / COMPLETE_MARKER).write_text('{"world_size": 1}')
    return engine


def _strategy_on(engine: ZeroEngine) -> ShardedStrategy:
    strategy = ShardedStrategy(stage=3)
    strategy.engine = engine
    return strategy


def _loaders(path: Path) -> dict[str, Callable[[bool | None], Any]]:
    """Every way lightning_sync reads a sharded directory, each on a fresh engine."""
    return {
        "consolidate_checkpoint": lambda wo: consolidate_checkpoint(path, weights_only=wo is not False),
        "ZeroEngine.load_sharded": lambda wo: load_sharded(_engine(), path, wo),
        "ShardedStrategy.load_checkpoint": lambda wo: _strategy_on(_engine()).load_checkpoint(path, wo),
    }


LOADERS = ["consolidate_checkpoint", "ZeroEngine.load_sharded", "ShardedStrategy.load_checkpoint"]


def _redirect(relative: str, outside: Path, how: str) -> str:
    return f"../{outside.name}/{relative}" if how == "dotdot" else str(outside / relative)


def _point_entries_at(path: Path, outside: Path, how: str) -> None:
    """Rewrite ``path``'s ``.metadata`` so that its storage entries are ``outside``'s: the same classes, the
    same keys; only ``relative_path`` leaves the directory."""
    with open(outside / ".metadata", "rb") as f:
        theirs = pickle.load(f)  # our own file, just written
    with open(path / ".metadata", "rb") as f:
        meta = pickle.load(f)
    assert meta.state_dict_metadata.keys() == theirs.state_dict_metadata.keys()
    meta.storage_data = {
        index: dataclasses.replace(info, relative_path=_redirect(info.relative_path, outside, how))
        for index, info in theirs.storage_data.items()
    }
    with open(path / ".metadata", "wb") as f:
        pickle.dump(meta, f)
    # nothing of the original shards is left to read: a loader that returns anything read it outside
    for shard in path.glob("*.distcp"):
        shard.unlink()


# ====================================================================== no .metadata
@pytest.mark.parametrize("weights_only", [None, False], ids=["default", "opted_in"])
@pytest.mark.parametrize("loader", LOADERS)
def test_a_directory_without_metadata_is_refused_before_the_rank_file_is_unpickled(
    tmp_path: Path, loader: str, weights_only: bool | None
) -> None:
    path, marker = tmp_path / "sharded.ckpt", tmp_path / "rank_metadata.MARKER"
    _save(path)
    (path / ".metadata").unlink()
    (path / "__0.metadata").write_bytes(pickle.dumps(UnpicklePayload(marker)))
    with pytest.raises(ValueError, match="no .metadata") as error:
        _loaders(path)[loader](weights_only)
    assert str(path) in str(error.value), error.value
    assert not marker.exists(), "DCP's fallback unpickled __0.metadata"


def test_dcp_load_refuses_a_directory_without_metadata(tmp_path: Path) -> None:
    path, marker = tmp_path / "d", tmp_path / "rank_metadata.MARKER"
    dcp.save({"t": torch.ones(2)}, checkpoint_id=str(path), no_dist=True)
    (path / ".metadata").rename(path / "__0.metadata")  # a valid per-rank file: DCP would read it
    with pytest.raises(ValueError, match="no .metadata"):
        dcp_load({"t": torch.zeros(2)}, path, no_dist=True)
    (path / "__0.metadata").write_bytes(pickle.dumps(UnpicklePayload(marker)))
    for weights_only in (None, False):
        with pytest.raises(ValueError, match="no .metadata"):
            dcp_load({"t": torch.zeros(2)}, path, weights_only=weights_only, no_dist=True)
        assert not marker.exists(), "DCP's fallback unpickled __0.metadata"


# ====================================================================== entries outside the directory
@pytest.mark.parametrize("how", ["dotdot", "absolute"])
@pytest.mark.parametrize("loader", LOADERS)
def test_storage_entries_outside_the_directory_are_refused(tmp_path: Path, loader: str, how: str) -> None:
    path, outside = tmp_path / "sharded.ckpt", tmp_path / "outside"
    _save(path)
    _save(outside, fill=42.0)
    _point_entries_at(path, outside, how)
    bad = _redirect("__0_0.distcp", outside, how)
    for weights_only in (None, False):
        with pytest.raises(ValueError, match="outside the checkpoint directory") as error:
            _loaders(path)[loader](weights_only)
        assert str(path) in str(error.value) and repr(bad) in str(error.value), error.value


@pytest.mark.parametrize("how", ["dotdot", "absolute"])
def test_dcp_load_reads_nothing_outside_even_opted_in(tmp_path: Path, how: str) -> None:
    """Opting in to arbitrary unpickling trusts the directory's own files, not whatever its entries name:
    the outside file's payload would run under ``weights_only=False``."""
    path, outside, marker = tmp_path / "d", tmp_path / "outside", tmp_path / "outside.MARKER"
    dcp.save({"t": torch.ones(2), "n": 5}, checkpoint_id=str(path), no_dist=True)
    dcp.save({"t": torch.full((2,), 42.0), "n": UnpicklePayload(marker)}, checkpoint_id=str(outside), no_dist=True)
    _point_entries_at(path, outside, how)
    for weights_only in (None, False):
        want: dict[str, Any] = {"t": torch.zeros(2), "n": 0}
        with pytest.raises(ValueError, match="outside the checkpoint directory") as error:
            dcp_load(want, path, weights_only=weights_only, no_dist=True)
        assert str(path) in str(error.value), error.value
        assert torch.equal(want["t"], torch.zeros(2)) and want["n"] == 0, "something was read"
        assert not marker.exists(), "the outside entry was unpickled"


@pytest.mark.parametrize("name", ["__0_0.distcp", ".metadata", "lightning_sync_meta.json", "lightning.pt"])
def test_a_symlink_leading_outside_is_refused(tmp_path: Path, name: str) -> None:
    """The same escape through the file system: the name is inside, the file it opens is not."""
    path, outside = tmp_path / "sharded.ckpt", tmp_path / "outside"
    _save(path)
    _save(outside, fill=42.0)
    (path / name).unlink()
    (path / name).symlink_to(outside / name)
    readers = LOADERS[2:] if name == "lightning.pt" else LOADERS  # only the strategy reads Lightning's state
    for loader in readers:
        with pytest.raises(ValueError, match="outside the checkpoint directory") as error:
            _loaders(path)[loader](None)
        assert repr(name) in str(error.value), error.value


def test_a_checked_directory_still_loads(tmp_path: Path) -> None:
    """Control: the checks refuse only what they should (the same loaders, an untouched directory)."""
    path = tmp_path / "sharded.ckpt"
    want = full_state_dict(_save(path, fill=3.0))
    got = consolidate_checkpoint(path)
    assert want.keys() == got.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0)
    engine = _engine()
    assert _strategy_on(engine).load_checkpoint(path)["global_step"] == 1
    for key, value in full_state_dict(engine).items():
        torch.testing.assert_close(value, want[key], rtol=0, atol=0)
    assert os.path.isfile(path / ".metadata")
