"""``lightning-sync consolidate`` on real ZeRO-3 and ZeRO-2 checkpoints written by 2 gloo ranks, and the memory
its streaming needs.

One spawn of 2 ranks fits the tied model of ``_lightning_reference.py`` (embedding tied to the output head, a
frozen layer: sharded, tied and replicated tensors all appear) with AdamW and a per-step LR schedule for 2
steps under each stage, saving a sharded checkpoint at step 2, the last step. After fit every rank's module
holds the full trained parameters again (teardown gathers them from the master shards), so rank 0's
``state_dict`` is the reference: the consolidated file must hold it exactly (``rtol=0, atol=0``: consolidation
only copies the saved fp32 master shards into fp32 parameters, no arithmetic).

The memory check runs in a fresh process (forked from the harness's forkserver), which resets its peak RSS
(``/proc/self/clear_refs``) and reads it back (``VmHWM``) around one consolidation.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from _lightning_reference import ENV, _quiet_rank, _TiedModule, _trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_sync import ShardedStrategy, consolidate_checkpoint
from lightning_sync.cli import main
from lightning_sync.consolidate import RESUME_ONLY_KEYS
from lightning_sync.resume import RANK_STATES
from lightning_sync.sync import LoopbackCommunicator, ZeroEngine
from lightning_sync.sync.zero import save_sharded
from lightning_sync.testing import run_distributed

STEPS = 2
STAGES = {
    "zero3": lambda: ShardedStrategy(stage=3, wrap_policy=["Linear"]),  # several units; the root holds the tie
    # ~1 KiB buckets: several flat parameters; a directory (stage 2 writes one file by default)
    "zero2": lambda: ShardedStrategy(stage=2, bucket_cap_mb=0.001, state_dict_type="sharded"),
}


class _Tied(_TiedModule):
    """The tied model with its constructor arguments saved, so ``load_from_checkpoint`` must rebuild it from
    the consolidated file's ``hyper_parameters`` (``"adamw"`` is not the default)."""

    def __init__(self, optimizer: str = "sgd", scheduler: bool = False) -> None:
        super().__init__(optimizer, scheduler=scheduler)
        self.save_hyperparameters()


def _fit(rank: int, world: int, tmpdir: str) -> dict[str, Any]:
    _quiet_rank()
    out: dict[str, Any] = {}
    for name, make in STAGES.items():
        saver = ModelCheckpoint(dirpath=os.path.join(tmpdir, name), filename="sharded", every_n_train_steps=STEPS)
        trainer = _trainer(world, make(), max_steps=STEPS, callbacks=[saver], enable_checkpointing=True)
        trainer.fit(_Tied("adamw", scheduler=True))
        out[name] = {
            "dir": os.path.join(tmpdir, name, "sharded.ckpt"),
            "state": trainer.strategy.full_state_dict(),  # rank 0: a copy of its module, whole again after fit
        }
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    results = run_distributed(_fit, 2, str(tmp_path_factory.mktemp("consolidate")), timeout=240, env=ENV)
    return results[0]


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert list(got) == list(want), f"{what}: keys and their order"
    for key, value in want.items():
        assert got[key].dtype == value.dtype, f"{what}: {key} dtype"
        torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=f"{what}: {key}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", list(STAGES))
def test_consolidate_writes_a_plain_lightning_checkpoint(trained: dict[str, Any], stage: str, tmp_path: Path) -> None:
    source, want = Path(trained[stage]["dir"]), trained[stage]["state"]
    assert source.is_dir() and (source / "__1_0.distcp").is_file(), "not a 2-rank sharded directory"
    output = tmp_path / "model.ckpt"
    main(["consolidate", str(source), str(output)])
    saved = torch.load(output, weights_only=True)  # plain torch, nothing of ours: tensors and plain data only
    _assert_same(saved["state_dict"], want, f"{stage} file")
    assert saved["state_dict"]["net.head.weight"].data_ptr() == saved["state_dict"]["net.embed.weight"].data_ptr()
    assert saved["global_step"] == STEPS and saved["epoch"] == 0 and "loops" in saved
    assert saved["hyper_parameters"] == {"optimizer": "adamw", "scheduler": True}
    assert isinstance(saved["pytorch-lightning_version"], str)
    left = [k for k in saved if k in RESUME_ONLY_KEYS or k.startswith("lightning_sync/")]
    assert not left and RANK_STATES not in saved, f"training-resume state in a consolidated file: {left}"
    _assert_same(consolidate_checkpoint(source), want, f"{stage} consolidate_checkpoint")

    model = _Tied.load_from_checkpoint(output)  # Lightning's own load of the class, from hyper_parameters
    assert model.optimizer_name == "adamw" and model.scheduler is True
    _assert_same(model.state_dict(), want, f"{stage} load_from_checkpoint")


@pytest.mark.timeout(120)
def test_the_console_script_consolidates(trained: dict[str, Any], tmp_path: Path) -> None:
    """The one run through the installed ``lightning-sync`` entry point: exit 0, the file, what it says."""
    script = Path(sys.executable).with_name("lightning-sync")
    exe = str(script) if script.exists() else shutil.which("lightning-sync")
    assert exe, "the lightning-sync console script is not installed (pip install -e .)"
    output = tmp_path / "model.ckpt"
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    proc = subprocess.run(
        [exe, "consolidate", trained["zero3"]["dir"], str(output)], env=env, capture_output=True, text=True, timeout=90
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"wrote {output}" in proc.stdout and f"global step {STEPS} (optimizer state left out)" in proc.stdout
    _assert_same(torch.load(output, weights_only=True)["state_dict"], trained["zero3"]["state"], "console script")


# ====================================================================== memory
LAYERS, WIDTH = 32, 512  # 32 Linear(512, 512): 8.4M values, 33.6 MB of fp32 weights, 1 MiB per weight


def _save(path: Path, layers: int) -> int:
    """A sharded checkpoint (one rank) of ``layers`` Linear layers after one AdamW step; its weights' bytes."""
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    size = sum(p.numel() * p.element_size() for p in net.parameters())
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    engine = ZeroEngine(net, opt, LoopbackCommunicator(1), stage=3)
    engine.gather_root()
    net(torch.randn(2, WIDTH)).sum().backward()
    opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP without a process group says it runs without one
        save_sharded(engine, path)
    return size


def _status(field: str) -> int:
    """``VmRSS`` / ``VmHWM`` of this process, bytes."""
    with open("/proc/self/status") as f:
        line = next(ln for ln in f if ln.startswith(f"{field}:"))
    return int(line.split()[1]) * 1024


def _peak_growth(rank: int, world: int, warm: str, big: str) -> int:
    """How far this process's RSS rises above where it stood while ``big`` is consolidated."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    consolidate_checkpoint(warm)  # DCP's lazily imported modules and first-call allocations, outside the window
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM, the peak RSS, to the current RSS
    state = consolidate_checkpoint(big)
    growth = _status("VmHWM") - before
    del state
    return growth


@pytest.mark.timeout(120)
def test_consolidation_streams_the_shards(tmp_path: Path) -> None:
    """Peak memory is the full model plus about one chunk, not the chunks beside the model: reading every chunk
    first and then copying it into full tensors peaks at 2x the model (measured 2.0x), streaming at ~1.05x. The
    optimizer state (2x the model more, with AdamW) is never read."""
    model_bytes = _save(tmp_path / "big", LAYERS)
    _save(tmp_path / "warm", 1)
    growth = run_distributed(
        _peak_growth, 1, str(tmp_path / "warm"), str(tmp_path / "big"), process_group=False, timeout=90
    )[0]
    # The full tensors are written, so at least the model must show (a measurement that saw nothing fails
    # here rather than passing the bound below); 1.5x leaves 16 MB for one chunk (1 MiB), DCP's bookkeeping
    # and allocator slack, and still fails the 2x of holding every chunk at once.
    assert 0.9 * model_bytes < growth < 1.5 * model_bytes, f"{growth / 2**20:.1f} MiB for {model_bytes / 2**20:.1f}"
