"""``lightning-sync consolidate`` refuses what every sharded load refuses, and then writes nothing.

A refused directory (a pickle payload in DCP's ``.metadata`` or in Lightning's ``lightning.pt``, storage entries
or a symlink leading outside, no ``.metadata``) exits non-zero naming the file and the reason, the payload never
runs (its marker file stays absent), and no output file appears, not even a partial or temporary one; an output
file that was already there is left as it was. ``--trust-pickles`` is the opt-in. One process: a
``LoopbackCommunicator`` stands in for the peers of the engine that writes the checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import warnings
from collections.abc import Callable
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_sync import consolidate_checkpoint
from lightning_sync.cli import main
from lightning_sync.diagnostics.faults import UnpicklePayload
from lightning_sync.resume import RANK_STATES
from lightning_sync.sync import LoopbackCommunicator, ZeroEngine
from lightning_sync.sync.zero import full_state_dict, save_sharded
from lightning_sync.sync.zero.format import COMPLETE_MARKER, LIGHTNING_STATE

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.distributed.*:UserWarning")  # DCP without a group

SYSTEM = f"{os.system.__module__}.system"  # how pickle names os.system ("posix.system" on Linux)


class _Module(pl.LightningModule):
    """Sharded weights, a frozen (replicated) bias, and a constructor argument to rebuild from."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.a, self.b = nn.Linear(width, 8), nn.Linear(8, 2)
        self.b.bias.requires_grad_(False)


def _save(path: Path, lightning_state: bool = True, fill: float | None = None) -> dict[str, torch.Tensor]:
    """A sharded checkpoint of ``_Module(width=6)`` after one AdamW step, as ShardedStrategy.save_checkpoint
    leaves one (or, without ``lightning_state``, as the engine alone writes it); its full ``state_dict``."""
    torch.manual_seed(0)
    module = _Module(width=6)
    if fill is not None:
        with torch.no_grad():
            for p in module.parameters():
                p.fill_(fill)
    opt = torch.optim.AdamW(module.parameters(), lr=0.01)
    engine = ZeroEngine(module, opt, LoopbackCommunicator(1), stage=3)
    engine.gather_root()
    module.b(module.a(torch.randn(3, 6))).sum().backward()
    opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_sharded(engine, path)
    if lightning_state:
        state = {
            "epoch": 0,
            "global_step": 1,
            "pytorch-lightning_version": pl.__version__,
            "optimizer_states": [{"param_groups": [{"lr": 0.01}]}],
            "hparams_name": "kwargs",
            "hyper_parameters": {"width": 6},
            RANK_STATES: [{"rng": torch.zeros(3)}],
        }
        torch.save(state, path / LIGHTNING_STATE)
        (path / COMPLETE_MARKER).write_text('{"world_size": 1}')
    return full_state_dict(engine)


def _consolidate(source: Path, output: Path, *flags: str) -> None:
    main(["consolidate", str(source), str(output), *flags])


def _refused(source: Path, output: Path, *flags: str) -> str:
    """Run the CLI on ``source``; it must exit non-zero; return what it said."""
    with pytest.raises(SystemExit) as exit_:
        _consolidate(source, output, *flags)
    assert exit_.value.code not in (0, None), exit_.value.code
    return str(exit_.value.code)


# ====================================================================== what a good directory gives
def test_a_checked_directory_consolidates(tmp_path: Path) -> None:
    """Control: the checks refuse only what they should."""
    source, output = tmp_path / "sharded.ckpt", tmp_path / "out" / "model.ckpt"
    want = _save(source)
    _consolidate(source, output)
    saved = torch.load(output, weights_only=True)
    assert list(saved["state_dict"]) == list(want)
    for key, value in want.items():
        torch.testing.assert_close(saved["state_dict"][key], value, rtol=0, atol=0)  # copies of the shards
    assert saved["hyper_parameters"] == {"width": 6} and saved["global_step"] == 1
    assert "optimizer_states" not in saved and RANK_STATES not in saved
    model = _Module.load_from_checkpoint(output)
    assert model.hparams.width == 6
    for key, value in want.items():
        torch.testing.assert_close(model.state_dict()[key], value, rtol=0, atol=0)
    assert sorted(os.listdir(output.parent)) == ["model.ckpt"], "a temporary file was left"


def test_an_engine_only_directory_gets_lightnings_version(tmp_path: Path) -> None:
    """Without Lightning's state (a ZeroEngine's own save) the file holds the weights and the version that
    keeps Lightning from migrating it as a 0.0.0 checkpoint."""
    source, output = tmp_path / "sharded.ckpt", tmp_path / "model.ckpt"
    want = _save(source, lightning_state=False)
    _consolidate(source, output)
    saved = torch.load(output, weights_only=True)
    assert set(saved) == {"state_dict", "pytorch-lightning_version"}, list(saved)
    assert saved["pytorch-lightning_version"] == pl.__version__
    model = _Module.load_from_checkpoint(output, width=6)
    for key, value in want.items():
        torch.testing.assert_close(model.state_dict()[key], value, rtol=0, atol=0)


# ====================================================================== refused, nothing written
def _metadata_payload(source: Path, marker: Path) -> Path:
    """DCP's ``.metadata``, which DCP itself reads with plain ``pickle.load``: valid, plus a payload."""
    meta_file = source / ".metadata"
    with open(meta_file, "rb") as f:
        meta = pickle.load(f)  # our own file, just written
    meta.planner_data = UnpicklePayload(marker)
    with open(meta_file, "wb") as f:
        pickle.dump(meta, f)
    return meta_file


def _state_payload(source: Path, marker: Path) -> Path:
    torch.save({"global_step": 1, "x": UnpicklePayload(marker)}, source / LIGHTNING_STATE)
    return source / LIGHTNING_STATE


def _entries_outside(source: Path, marker: Path) -> str:
    """``.metadata``'s storage entries rewritten to ``../outside/...``: allowed classes only, the same keys."""
    outside = source.parent / "outside"
    _save(outside, fill=42.0)
    with open(source / ".metadata", "rb") as f:
        meta = pickle.load(f)
    meta.storage_data = {
        index: dataclasses.replace(info, relative_path=f"../outside/{info.relative_path}")
        for index, info in meta.storage_data.items()
    }
    with open(source / ".metadata", "wb") as f:
        pickle.dump(meta, f)
    return "'../outside/__0_0.distcp'"


def _state_symlink_outside(source: Path, marker: Path) -> str:
    outside = source.parent / "outside.pt"
    torch.save({"global_step": 7}, outside)
    (source / LIGHTNING_STATE).unlink()
    (source / LIGHTNING_STATE).symlink_to(outside)
    return repr(LIGHTNING_STATE)


def _no_metadata(source: Path, marker: Path) -> Path:
    """DCP would fall back to the per-rank ``__0.metadata``, unpickled without restriction."""
    (source / ".metadata").unlink()
    (source / "__0.metadata").write_bytes(pickle.dumps(UnpicklePayload(marker)))
    return source


# each case: what makes the directory hostile (returning what the refusal must name besides the directory), and
# the reason the refusal must give
HOSTILE: dict[str, tuple[Callable[[Path, Path], Path | str], str]] = {
    "metadata payload": (_metadata_payload, SYSTEM),
    "lightning.pt payload": (_state_payload, SYSTEM),
    "entries outside": (_entries_outside, "outside the checkpoint directory"),
    "lightning.pt symlink outside": (_state_symlink_outside, "outside the checkpoint directory"),
    "no .metadata": (_no_metadata, "no .metadata"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_directory_is_refused_and_nothing_is_written(tmp_path: Path, case: str) -> None:
    source, marker, out = tmp_path / "sharded.ckpt", tmp_path / "MARKER", tmp_path / "out"
    _save(source)
    make, reason = HOSTILE[case]
    named = make(source, marker)
    out.mkdir()
    said = _refused(source, out / "model.ckpt")
    assert reason in said and str(source) in said and str(named) in said, said
    if reason == SYSTEM:
        assert "--trust-pickles" in said, said  # says how to opt in, on the command line
    assert not marker.exists(), "the payload ran"
    assert os.listdir(out) == [], f"the refused run left {os.listdir(out)}"


def test_a_refused_run_leaves_an_existing_output_as_it_was(tmp_path: Path) -> None:
    source, output, marker = tmp_path / "sharded.ckpt", tmp_path / "model.ckpt", tmp_path / "MARKER"
    _save(source)
    _state_payload(source, marker)
    output.write_bytes(b"the previous file")
    _refused(source, output)
    assert output.read_bytes() == b"the previous file" and sorted(os.listdir(tmp_path)) == [
        "model.ckpt",
        "sharded.ckpt",
    ]


def test_trust_pickles_is_the_opt_in(tmp_path: Path) -> None:
    """The same hostile ``lightning.pt`` loads with ``--trust-pickles``, and its payload runs: the flag really
    turns weights-only loading off, so it is for checkpoints you trust."""
    source, output, marker = tmp_path / "sharded.ckpt", tmp_path / "model.ckpt", tmp_path / "MARKER"
    want = _save(source)
    _state_payload(source, marker)
    _consolidate(source, output, "--trust-pickles")
    assert marker.exists()
    saved = torch.load(output, weights_only=True)  # the payload's result (os.system's 0) is a plain int
    assert saved["global_step"] == 1 and saved["x"] == 0
    for key, value in want.items():
        torch.testing.assert_close(saved["state_dict"][key], value, rtol=0, atol=0)


# ====================================================================== wrong arguments
def test_wrong_paths_say_what_is_wrong(tmp_path: Path) -> None:
    source = tmp_path / "sharded.ckpt"
    _save(source)
    assert "does not exist" in _refused(tmp_path / "missing.ckpt", tmp_path / "a.ckpt")
    (tmp_path / "full.ckpt").write_bytes(b"")
    assert "is a file" in _refused(tmp_path / "full.ckpt", tmp_path / "b.ckpt")
    assert "is a directory" in _refused(source, tmp_path)
    (tmp_path / "plain").mkdir()
    assert "not a lightning_sync sharded checkpoint" in _refused(tmp_path / "plain", tmp_path / "c.ckpt")
    assert not any(p.name.endswith(".ckpt") and p.is_file() and p.name != "full.ckpt" for p in tmp_path.iterdir())


def test_chunks_that_do_not_tile_a_parameter_are_refused(tmp_path: Path) -> None:
    """A layout file whose shapes disagree with the chunks would leave elements of a full tensor unset."""
    source = tmp_path / "sharded.ckpt"
    _save(source)
    layout = json.loads((source / "lightning_sync_meta.json").read_text())
    layout["params"]["a.weight"][0] = [8, 7]  # 56 elements; the chunks hold 48
    (source / "lightning_sync_meta.json").write_text(json.dumps(layout))
    with pytest.raises(ValueError, match=r"model/a\.weight, which do not tile its 56 elements"):
        consolidate_checkpoint(source)
    assert "do not tile" in _refused(source, tmp_path / "model.ckpt")
    assert not (tmp_path / "model.ckpt").exists()
