"""ShardedStrategy argument checks, registration, and the wrap-policy warning (one process; nothing is
launched). The engine's own checks are in ``test_zero_engine_unit.py``; these go through the strategy."""

from __future__ import annotations

import math
import re
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

import lightning_sync  # noqa: F401 - importing the package registers the strategy names
from lightning_sync import ShardedStrategy
from lightning_sync.sync.communicator import LoopbackCommunicator

__all__: list[str] = []


def _message(kw: dict[str, Any]) -> str:
    with pytest.raises(ValueError) as info:
        ShardedStrategy(**kw)
    return str(info.value)


@pytest.mark.parametrize("stage", [0, 4, "2", True, False, None, -1, 1.5, 2.0])
def test_stage_outside_1_2_3_lists_the_allowed_stages(stage: Any) -> None:
    msg = _message({"stage": stage})
    assert "[1, 2, 3]" in msg and f"got {stage!r}" in msg


@pytest.mark.parametrize("value", ["Full", "dcp", "", 1, True])
def test_bad_state_dict_type_lists_the_allowed_ones(value: Any) -> None:
    msg = _message({"state_dict_type": value})
    assert "state_dict_type must be one of ['full', 'sharded', None]" in msg and f"got {value!r}" in msg


def test_state_dict_type_defaults_to_one_file_at_stages_1_2_and_a_directory_at_stage_3() -> None:
    assert [ShardedStrategy(stage=s).state_dict_type for s in (1, 2, 3)] == ["full", "full", "sharded"]
    assert ShardedStrategy(stage=3, state_dict_type="full").state_dict_type == "full"
    assert ShardedStrategy(stage=1, state_dict_type="sharded").state_dict_type == "sharded"


@pytest.mark.parametrize(
    ("policy", "named"),
    [
        ("torch.nn.NoSuchLayer", "'torch.nn.NoSuchLayer'"),
        ("torch.nn.functional.relu", "'torch.nn.functional.relu'"),
        (0, "got 0"),
        (-3, "got -3"),
        (3.5, "3.5"),
        (True, "True"),
        ([], "[]"),
        ([1, 2], "[1, 2]"),
        ({"min_params": 5}, "'min_params'"),
        ({"min_num_params": 5, "module_classes": ["Linear"]}, "'module_classes'"),
    ],
)
def test_bad_wrap_policy_names_the_value(policy: Any, named: str) -> None:
    msg = _message({"wrap_policy": policy})
    assert "wrap_policy" in msg and named in msg


@pytest.mark.parametrize(
    "policy",
    [
        None,
        "Linear",
        "torch.nn.Linear",
        nn.Linear,
        [nn.Linear, "Embedding"],
        100,
        {"min_num_params": 100},
        {"module_classes": ["Linear"]},
        lambda m: isinstance(m, nn.Linear),
    ],
)
def test_every_documented_wrap_policy_form_is_accepted(policy: Any) -> None:
    assert ShardedStrategy(wrap_policy=policy).wrap_policy is policy


@pytest.mark.parametrize("arg", ["param_dtype", "reduce_dtype"])
@pytest.mark.parametrize(
    ("value", "named"),
    [
        ("fp8", "'fp8'"),
        ("int8", "'int8'"),
        ("bfloat17", "'bfloat17'"),
        (torch.int32, "torch.int32"),
        (16, "got 16"),
        (torch.bool, "torch.bool"),
    ],
)
def test_bad_dtype_names_the_argument_and_the_value(arg: str, value: Any, named: str) -> None:
    msg = _message({arg: value})
    assert arg in msg and named in msg and "'bf16'" in msg  # lists the allowed names too


@pytest.mark.parametrize("value", [0, 0.0, -1, math.inf, math.nan, "25", True, None])
def test_bucket_cap_mb_must_be_a_finite_positive_number(value: Any) -> None:
    msg = _message({"bucket_cap_mb": value})
    assert "bucket_cap_mb" in msg and f"got {value!r}" in msg


@pytest.mark.parametrize("arg", ["prefetch", "reshard_after_forward"])
@pytest.mark.parametrize("value", ["yes", 1, None])
def test_flags_must_be_bools(arg: str, value: Any) -> None:
    msg = _message({arg: value})
    assert arg in msg and f"got {value!r}" in msg


def test_unknown_keyword_arguments_are_named() -> None:
    msg = _message({"stages": 3, "wrap": ["Linear"]})  # typos of real arguments
    assert "'stages'" in msg and "'wrap'" in msg


@pytest.mark.parametrize(
    ("kw", "shown"),
    [
        ({"process_group_backend": "mpi"}, "'mpi'"),
        ({"start_method": "thread"}, "'thread'"),
        ({"timeout": 0}, "got 0"),
        ({"timeout": -5.0}, "got -5.0"),
    ],
)
def test_launch_arguments_name_the_bad_value(kw: dict[str, Any], shown: str) -> None:
    assert shown in _message(kw)


def test_valid_arguments_are_kept() -> None:
    s = ShardedStrategy(
        stage=2,
        wrap_policy={"min_num_params": 100},
        prefetch=False,
        reshard_after_forward=False,
        param_dtype="bf16",
        reduce_dtype=torch.float32,
        bucket_cap_mb=1,
    )
    assert (s.stage, s.wrap_policy, s.prefetch, s.reshard_after_forward, s.bucket_cap_mb) == (
        2,
        {"min_num_params": 100},
        False,
        False,
        1,
    )
    assert s.param_dtype is torch.bfloat16 and s.reduce_dtype is torch.float32
    assert s.is_distributed is True  # so Lightning adds the DistributedSampler and turns sync_dist on
    assert ShardedStrategy().stage == 3  # the documented default


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_trainer_resolves_the_registered_names(stage: int) -> None:
    trainer = pl.Trainer(
        strategy=f"zero{stage}",
        accelerator="cpu",
        devices=2,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    assert type(trainer.strategy) is ShardedStrategy
    assert trainer.strategy.stage == stage and trainer.strategy.num_processes == 2


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.fc = nn.Linear(4, 3)
        self.out = nn.Linear(3, 10)


def _build_engine(monkeypatch: pytest.MonkeyPatch, wrap_policy: Any) -> Any:
    """The strategy's own engine construction, on a one-rank loopback communicator instead of a process group."""
    strategy = ShardedStrategy(stage=3, wrap_policy=wrap_policy)
    strategy.comm = LoopbackCommunicator(world_size=1)  # the engine's communicator is the strategy's context
    strategy.model = _Net()
    strategy._build_engine(None)
    return strategy.engine


def test_wrap_policy_matching_nothing_warns_and_wraps_the_whole_model(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.warns(UserWarning, match=re.escape("wrap_policy matched no submodule")):
        engine = _build_engine(monkeypatch, ["Conv2d"])
    units = [(u.is_root, u.numel) for u in engine.units if u.numel]
    assert units == [(True, sum(p.numel() for p in _Net().parameters()))], units


def test_wrap_policy_matching_modules_does_not_warn(monkeypatch: pytest.MonkeyPatch) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine = _build_engine(monkeypatch, ["Linear"])
    assert sorted(u.name for u in engine.units if u.numel) == ["", "fc", "out"]


def test_load_checkpoint_before_setup_says_why_instead_of_asserting(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"exists once the strategy is set up .*was not read"):
        ShardedStrategy(stage=3).load_checkpoint(tmp_path / "step=3.ckpt")
