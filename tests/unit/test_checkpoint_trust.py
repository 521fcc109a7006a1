"""Checkpoints load weights-only: a file that needs arbitrary unpickling is refused, by name, before any
of its code runs, unless the caller opts in with ``weights_only=False``.

The hostile payload is real: ``os.system("touch MARKER")`` in a ``__reduce__``. Each refusal is checked
by the marker file being absent afterwards; the opt-in control shows the same file does create it.
One process, no process group (a ``LoopbackCommunicator`` stands in for the peers of the ZeRO engine).
"""

from __future__ import annotations

import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from lightning_sync import (
    AsyncParameterServerStrategy,
    BucketedDDPStrategy,
    DiLoCoStrategy,
    HogwildStrategy,
    LocalSGDStrategy,
    ShardedStrategy,
)
from lightning_sync.checkpoint.reading import UntrustedCheckpointError, dcp_load, load_file
from lightning_sync.diagnostics.faults import UnpicklePayload
from lightning_sync.sync import (
    DiLoCoOuter,
    GradBucketer,
    LoopbackCommunicator,
    ParameterServer,
    PeriodicAverager,
    PowerSGD,
    ZeroEngine,
    consolidate_checkpoint,
)
from lightning_sync.sync.zero import save_sharded
from lightning_sync.sync.zero.format import COMPLETE_MARKER

SYSTEM = f"{os.system.__module__}.system"  # how pickle names os.system ("posix.system" on Linux)


class Custom:
    """A harmless class of ours: weights-only loading still refuses it (it is not an allowed global)."""

    def __init__(self, value: int = 7) -> None:
        self.value = value


def _hostile(tmp_path: Path, name: str = "hostile.ckpt") -> tuple[Path, Path]:
    marker = tmp_path / f"{name}.MARKER"
    path = tmp_path / name
    torch.save({"state_dict": {"w": torch.ones(2)}, "extra": UnpicklePayload(marker)}, path)
    return path, marker


def _strategies() -> list[Any]:
    return [
        BucketedDDPStrategy(),
        LocalSGDStrategy(),
        DiLoCoStrategy(),
        AsyncParameterServerStrategy(),
        HogwildStrategy(num_processes=1),
    ]


def _assert_refused(error: pytest.ExceptionInfo[UntrustedCheckpointError], path: Path, offending: str) -> None:
    message = str(error.value)
    assert str(path) in message, message
    assert offending in message, message
    assert "weights_only=False" in message, message  # says how to opt in
    assert error.value.offending == offending
    assert isinstance(error.value, pickle.UnpicklingError)  # callers that caught torch's error still do
    assert str(pickle.loads(pickle.dumps(error.value))) == message  # it can cross process boundaries


# ====================================================================== single files
def test_load_file_refuses_a_payload_by_name_and_runs_nothing(tmp_path: Path) -> None:
    path, marker = _hostile(tmp_path)
    with pytest.raises(UntrustedCheckpointError) as error:
        load_file(path)
    _assert_refused(error, path, SYSTEM)
    assert not marker.exists(), "the payload ran although the load was refused"
    with pytest.raises(UntrustedCheckpointError):
        load_file(path, weights_only=True)
    assert not marker.exists()
    load_file(path, weights_only=False)  # the explicit opt-in: the payload is live (control)
    assert marker.exists()


@pytest.mark.parametrize("index", range(5), ids=["bucketed_ddp", "local_sgd", "diloco", "async_ps", "hogwild"])
def test_every_strategy_refuses_by_default_and_loads_when_opted_in(tmp_path: Path, index: int) -> None:
    strategy = _strategies()[index]
    path, marker = _hostile(tmp_path)
    for weights_only in (None, True):  # None is what trainer.fit(ckpt_path=...) passes by default
        with pytest.raises(UntrustedCheckpointError) as error:
            strategy.load_checkpoint(path, weights_only=weights_only)
        _assert_refused(error, path, SYSTEM)
        assert not marker.exists(), "the payload ran although the load was refused"
    custom = tmp_path / "custom.ckpt"
    torch.save({"state_dict": {}, "extra": Custom(3)}, custom)
    with pytest.raises(UntrustedCheckpointError) as error:
        strategy.load_checkpoint(custom)
    _assert_refused(error, custom, f"{__name__}.Custom")
    assert strategy.load_checkpoint(custom, weights_only=False)["extra"].value == 3  # opted in: loads


def test_a_bad_weights_only_value_is_named(tmp_path: Path) -> None:
    torch.save({"state_dict": {}}, tmp_path / "ok.ckpt")
    with pytest.raises(ValueError, match="'yes'"):
        load_file(tmp_path / "ok.ckpt", weights_only="yes")  # type: ignore[arg-type]


# ====================================================================== our own state is plain data
class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 32), nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def test_the_state_our_strategies_add_to_a_checkpoint_loads_weights_only(tmp_path: Path) -> None:
    """What save_checkpoint adds under "lightning_sync/...": the bucketer's (with PowerSGD's error feedback,
    gathered per rank), local SGD's and DiLoCo's schedule and outer optimizer, the parameter server's clock."""
    torch.manual_seed(0)
    net, comm = _Net(), LoopbackCommunicator(1)
    bucketer = GradBucketer(net.named_parameters(), comm, 25.0, 1.0, True, False, PowerSGD(rank=1, warmup_steps=0))
    for _ in range(2):
        bucketer.prepare_for_backward()
        net(torch.randn(3, 4)).square().sum().backward()
    bucketer.close()
    params = list(net.parameters())
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    outer = DiLoCoOuter(params, comm, 2, 0.7, 0.9, True)
    for _ in range(2):
        outer.step()
    server = ParameterServer([p.detach().clone() for p in params], [], None, num_workers=2, max_staleness=2)
    state = {
        "lightning_sync/bucketed_ddp": [bucketer.state_dict()],
        "lightning_sync/local_sgd": PeriodicAverager(params, comm, 2, 0, opt, True).state_dict(),
        "lightning_sync/diloco": outer.state_dict(),
        "lightning_sync/async_ps": server.state_dict(),
    }
    assert state["lightning_sync/bucketed_ddp"][0]["compressor"]["error"], "PowerSGD kept no error feedback"
    torch.save(state, tmp_path / "state.pt")
    loaded = torch.load(tmp_path / "state.pt", weights_only=True)
    assert repr(loaded) == repr(state)


# ====================================================================== sharded directories
def _sharded_dir(tmp_path: Path) -> tuple[Path, nn.Module, ZeroEngine]:
    torch.manual_seed(0)
    net = _Net()
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    engine = ZeroEngine(net, opt, LoopbackCommunicator(1), stage=3)
    engine.gather_root()
    net(torch.randn(3, 4)).sum().backward()
    opt.step()
    path = tmp_path / "sharded.ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP without a process group says it runs without one
        save_sharded(engine, path)
    torch.save({"global_step": 1, "optimizer_states": [{"param_groups": [{"lr": 0.01}]}]}, path / "lightning.pt")
    (path / COMPLETE_MARKER).write_text('{"world_size": 1}')  # as ShardedStrategy.save_checkpoint finishes one
    return path, net, engine


def test_a_sharded_checkpoint_loads_weights_only_and_refuses_payloads(tmp_path: Path) -> None:
    path, net, engine = _sharded_dir(tmp_path)
    full = consolidate_checkpoint(path)
    strategy = ShardedStrategy(stage=3)
    strategy.engine = engine
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert strategy.load_checkpoint(path)["global_step"] == 1
    assert set(full) == set(net.state_dict())
    # 1. Lightning's state next to the shards
    good = (path / "lightning.pt").read_bytes()
    marker = tmp_path / "lightning.MARKER"
    torch.save({"global_step": 1, "x": UnpicklePayload(marker)}, path / "lightning.pt")
    with pytest.raises(UntrustedCheckpointError) as error:
        strategy.load_checkpoint(path)
    _assert_refused(error, path / "lightning.pt", SYSTEM)
    assert not marker.exists()
    (path / "lightning.pt").write_bytes(good)
    # 2. DCP's .metadata, which DCP itself reads with plain pickle.load: a valid metadata object that
    #    also carries a payload
    meta_file = path / ".metadata"
    with open(meta_file, "rb") as f:
        meta = pickle.load(f)  # our own file, just written
    marker = tmp_path / "metadata.MARKER"
    meta.planner_data = UnpicklePayload(marker)
    with open(meta_file, "wb") as f:
        pickle.dump(meta, f)
    for load in (lambda: consolidate_checkpoint(path), lambda: strategy.load_checkpoint(path)):
        with pytest.raises(UntrustedCheckpointError) as error:
            load()
        _assert_refused(error, meta_file, SYSTEM)
        assert not marker.exists(), "DCP unpickled the metadata although the load was refused"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again = consolidate_checkpoint(path, weights_only=False)  # opted in: loads (and the payload ran)
    assert marker.exists()
    for k, v in full.items():
        torch.testing.assert_close(again[k], v, rtol=0, atol=0)
    # 3. a full (unsharded) checkpoint file handed to the sharded strategy
    file, marker = _hostile(tmp_path, "full.ckpt")
    with pytest.raises(UntrustedCheckpointError) as error:
        strategy.load_checkpoint(file)
    _assert_refused(error, file, SYSTEM)
    assert not marker.exists()


def test_non_tensor_dcp_entries_are_read_weights_only(tmp_path: Path) -> None:
    """DCP's default planner reads non-tensor entries with weights_only=False; dcp_load does not."""
    marker, path = tmp_path / "entry.MARKER", tmp_path / "d"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP without a process group says it runs without one
        dcp.save({"t": torch.ones(2), "n": 5, "evil": UnpicklePayload(marker)}, checkpoint_id=str(path), no_dist=True)
        want: dict[str, Any] = {"t": torch.zeros(2), "n": 0}
        dcp_load(want, path, no_dist=True)
        assert want["n"] == 5 and torch.equal(want["t"], torch.ones(2))  # plain entries load
        with pytest.raises(UntrustedCheckpointError) as error:
            dcp_load({"evil": None}, path, no_dist=True)
        _assert_refused(error, path, SYSTEM)
        assert "'evil'" in str(error.value)  # names the entry
        assert not marker.exists()
        dcp_load({"evil": None}, path, weights_only=False, no_dist=True)  # opted in: DCP's own reading
    assert marker.exists()
