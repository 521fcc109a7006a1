"""Every argument of every lightning_sync strategy is checked at construction, so a bad configuration fails there.

One table: (strategy class, keyword arguments, regex). Each bad value must raise a ``ValueError`` whose
message names the argument, quotes the bad value (its ``repr``) and says what is allowed. Construction
only: no process group, no Trainer. ``os.cpu_count`` is pinned to 4 so that Hogwild's CPU check is
deterministic. The per-strategy files (``test_bucketed_ddp_args.py``, ``test_sharded_args.py``, ...) go
deeper on single arguments; this table is the "nothing was forgotten" check, and
:func:`test_the_table_covers_every_argument_of_every_strategy` keeps it complete as arguments are added.
"""

from __future__ import annotations

import inspect
import math
import os
import re
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf

from lightning_sync.strategies import (
    AsyncParameterServerStrategy,
    BucketedDDPStrategy,
    DiLoCoStrategy,
    HogwildStrategy,
    LocalSGDStrategy,
    ShardedStrategy,
)

__all__: list[str] = []

CPUS = 4  # os.cpu_count() as the strategies see it in these tests
STRATEGIES = (
    BucketedDDPStrategy,
    ShardedStrategy,
    LocalSGDStrategy,
    DiLoCoStrategy,
    AsyncParameterServerStrategy,
    HogwildStrategy,
)
KWARGS = "**kwargs"  # the table's name for "an unknown keyword argument"


def got(name: str, allowed: str, value: Any) -> str:
    """Messages of the form ``<name> must be <allowed ...>, got <repr(value)>``."""
    return rf"\b{name}\b.*{allowed}.*got {re.escape(repr(value))}"


def unknown(name: str, value: Any, allowed: str) -> str:
    """Messages of the form ``unknown <name> <repr(value)>; allowed: [...]``."""
    return rf"unknown {name} {re.escape(repr(value))}; allowed: .*{allowed}"


_MIB = "a finite number > 0 \\(MiB\\)"
_BOOL = "True or False"
_TIMEOUT = "finite number of seconds > 0 or a timedelta > 0"
_DTYPES = "one of \\[.*'bf16'.*'fp32'.*\\]"
_WRAP = "allowed forms: None, an int"

# Arguments BucketedDDPStrategy takes (LocalSGDStrategy takes the bucket layout ones and the launch ones).
_BUCKETED: list[tuple[str, Any, str]] = [
    *[
        (arg, v, got(arg, _MIB, v))
        for arg in ("bucket_cap_mb", "first_bucket_mb")
        for v in (0, -1.5, math.inf, math.nan, "25", True, None)
    ],
    *[
        (arg, v, got(arg, _BOOL, v))
        for arg in ("gradient_as_bucket_view", "find_unused_parameters", "broadcast_buffers")
        for v in (1, 0, "false", None)
    ],
    *[
        ("compression", v, unknown("compression", v, "'fp16', 'bf16', 'powersgd'"))
        for v in ("gzip", "FP16", "", 16, True)
    ],
    *[("powersgd_rank", v, got("powersgd_rank", "an int >= 1", v)) for v in (0, -2, 1.5, "2", True)],
    *[("powersgd_warmup_steps", v, got("powersgd_warmup_steps", "an int >= 0", v)) for v in (-1, 2.5, "10", False)],
    *[
        ("comm_algorithm", v, unknown("comm_algorithm", v, "'backend'.*'ring'.*'tree'"))
        for v in ("nccl", "Ring", "", None, ["ring"], 1)
    ],
    *[
        ("process_group_backend", v, got("process_group_backend", "one of \\[None, 'gloo', 'nccl'\\]", v))
        for v in ("mpi", "GLOO", "", 0)
    ],
    *[
        ("start_method", v, got("start_method", "one of \\['popen', 'spawn', 'fork', 'forkserver'\\]", v))
        for v in ("thread", "", None)
    ],
    *[
        ("timeout", v, got("timeout", _TIMEOUT, v))
        for v in (0, -5.0, math.inf, math.nan, "30", True, None, timedelta(0), timedelta(seconds=-1))
    ],
    # live fault tolerance: True needs the agent's ranks (this process was not started by it)
    *[("fault_tolerant", v, got("fault_tolerant", "True, False or None", v)) for v in (1, "true", 0)],
    ("fault_tolerant", True, r"fault_tolerant=True needs the ranks started by the fault-tolerance agent"),
    *[("rebalance", v, got("rebalance", _BOOL, v)) for v in (1, "true", None)],
    *[("rebalance_every", v, got("rebalance_every", "an int >= 1", v)) for v in (0, -1, 2.5, "10", True, None)],
    *[
        ("rebalance_deadline", v, got("rebalance_deadline", "None or a finite number > 1", v))
        for v in (1, 0.5, -2.0, math.inf, math.nan, "2", True)
    ],
    ("rebalance_deadline", 2.0, r"rebalance_deadline=2\.0 needs rebalance=True; allowed without it: None"),
    (KWARGS, {"bucket_cap": 5}, r"unknown arguments \['bucket_cap'\]; besides its own it accepts \['accelerator'"),
]

_SHARDED: list[tuple[str, Any, str]] = [
    *[("stage", v, got("stage", "one of \\[1, 2, 3\\]", v)) for v in (0, 4, -1, "2", True, 2.0, None)],
    *[("wrap_policy", v, rf"wrap_policy.*{re.escape(repr(v))}.*{_WRAP}") for v in (3.5, True, [], [1, 2], {"Linear"})],
    *[("wrap_policy", v, got("wrap_policy min_num_params", "an int >= 1", v)) for v in (0, -3)],
    ("wrap_policy", {"min_num_params": "abc"}, got("wrap_policy min_num_params", "an int >= 1", "abc")),
    ("wrap_policy", {"min_num_params": 5.5}, got("wrap_policy min_num_params", "an int >= 1", 5.5)),
    ("wrap_policy", {"module_classes": 5}, got("wrap_policy module_classes", "a list of module classes", 5)),
    (
        "wrap_policy",
        {"min_params": 5},
        r"wrap_policy mapping .*'min_num_params' or 'module_classes', got keys "
        r"\['min_params'\]",
    ),
    (
        "wrap_policy",
        "torch.nn.NoSuchLayer",
        r"wrap_policy names 'torch\.nn\.NoSuchLayer', which is not an importable class",
    ),
    (
        "wrap_policy",
        "torch.nn.functional.relu",
        r"wrap_policy names 'torch\.nn\.functional\.relu', which is not a class",
    ),
    *[
        (arg, v, got(arg, _BOOL, v))
        for arg in (
            "prefetch",
            "reshard_after_forward",
            "offload",
            "activation_checkpointing",
            "find_unused_parameters",
        )
        for v in (1, "yes", None)
    ],
    *[
        (arg, v, got(arg, "None, a floating torch.dtype or " + _DTYPES, v))
        for arg in ("param_dtype", "reduce_dtype")
        for v in ("fp8", "int8", torch.int32, torch.bool, 16, True)
    ],
    *[("bucket_cap_mb", v, got("bucket_cap_mb", _MIB, v)) for v in (0, -1, math.nan, "25", True)],
    *[
        ("coalesce_mb", v, got("coalesce_mb", "a finite number >= 0 \\(MiB\\)", v))
        for v in (-1, -0.5, math.inf, math.nan, "8", True, None)
    ],
    *[
        ("state_dict_type", v, got("state_dict_type", r"one of \['full', 'sharded', None\]", v))
        for v in ("Full", "dcp", "", 3, True)
    ],
    *[
        ("gathered_callbacks", v, got("gathered_callbacks", "None or a list of Lightning Callback classes", v))
        for v in (torch.nn.Linear, [torch.nn.Linear], ["torch.nn.Linear"], 5, "lightning.pytorch.callbacks.Callback")
    ],
    (
        "gathered_callbacks",
        ["NoSuchCallback"],
        r"gathered_callbacks names 'NoSuchCallback', which is not an importable class",
    ),
    *[("snapshot_every", v, got("snapshot_every", "an int >= 1", v)) for v in (0, -1, 2.5, "10", True, None)],
    *[("snapshot_async", v, got("snapshot_async", _BOOL, v)) for v in (1, "yes", None)],
    *[
        (arg, v, pattern)
        for arg, v, pattern in _BUCKETED
        if arg in ("process_group_backend", "start_method", "timeout", "fault_tolerant", "rebalance", "rebalance_every")
    ],
    (KWARGS, {"stages": 2}, r"unknown arguments \['stages'\]; besides its own it accepts"),
]

_LAUNCH = [row for row in _BUCKETED if row[0] in ("process_group_backend", "start_method", "timeout", "fault_tolerant")]
# What LocalSGD's warm-up bucketer takes
_WARMUP = [
    row
    for row in _BUCKETED
    if row[0] in ("bucket_cap_mb", "first_bucket_mb", "gradient_as_bucket_view", "find_unused_parameters")
]


def refused(owner: type, arg: str, taker: str, first: str) -> str:
    """An argument ``owner`` does not take, valid for ``taker``: named, with who takes it and what ``owner``
    accepts (from its first argument ``first`` on)."""
    return rf"{owner.__name__} does not take \['{arg}'\] \(.*\b{taker}\b.* takes? '{arg}'\); it accepts \['{first}', "


# Valid values of arguments a periodic strategy does not take: each raises, naming it
_BUCKETER_ONLY = {
    "compression": "fp16",
    "powersgd_rank": 2,
    "powersgd_warmup_steps": 10,
    "comm_algorithm": "ring",
    "broadcast_buffers": False,
}
_BUCKET_LAYOUT = {
    "bucket_cap_mb": 25.0,
    "first_bucket_mb": 1.0,
    "gradient_as_bucket_view": True,
    "find_unused_parameters": False,
}
_WARMUP_ONLY = {"warmup_steps": 5, "average_optimizer_state": True}

_LOCAL_SGD_OWN: list[tuple[str, Any, str]] = [
    *[("sync_every", v, got("sync_every", "an int >= 1", v)) for v in (0, -1, 1.5, "8", True)],
    *[("warmup_steps", v, got("warmup_steps", "an int >= 0", v)) for v in (-1, 2.0, "0", False)],
    *[("average_optimizer_state", v, got("average_optimizer_state", _BOOL, v)) for v in (1, "true", None)],
]

_LOCAL_SGD: list[tuple[str, Any, str]] = [
    *_LOCAL_SGD_OWN,
    *_WARMUP,
    *_LAUNCH,
    *[
        (arg, v, refused(LocalSGDStrategy, arg, "BucketedDDPStrategy", "sync_every"))
        for arg, v in _BUCKETER_ONLY.items()
    ],
    (
        KWARGS,
        {"bucket_cap": 5},
        r"LocalSGDStrategy does not take \['bucket_cap'\] \(no lightning_sync strategy takes 'bucket_cap'\); "
        r"it accepts \['sync_every', 'warmup_steps'",
    ),
]

_DILOCO_OWN: list[tuple[str, Any, str]] = [
    *[(arg, v, pattern) for arg, v, pattern in _LOCAL_SGD_OWN if arg == "sync_every"],
    *[("outer_lr", v, got("outer_lr", "a finite number > 0", v)) for v in (0, -0.7, math.inf, math.nan, "0.7", True)],
    *[
        ("outer_momentum", v, got("outer_momentum", "a number in \\[0, 1\\)", v))
        for v in (1.0, -0.1, 1.5, math.nan, "0.9", True)
    ],
    *[("nesterov", v, got("nesterov", _BOOL, v)) for v in (1, "yes", None)],
    (
        "nesterov",
        True,
        r"nesterov must be True or False \(True needs outer_momentum > 0\), got True with "
        r"outer_momentum=0",
    ),  # with outer_momentum=0, set below
    *[("fragments", v, got("fragments", "an int >= 1", v)) for v in (0, -1, 1.5, "2", True)],
    ("fragments", 600, r"fragments must be in \[1, sync_every=500\] \(one start step each\), got 600"),
    *[("overlap_steps", v, got("overlap_steps", "an int >= 0", v)) for v in (-1, 1.5, "2", True)],
    ("overlap_steps", 500, r"overlap_steps must be in \[0, sync_every=500\) \(a fragment's outer step lands"),
    *[
        ("outer_dtype", v, r"outer_dtype must be one of \['fp32', 'bf16', 'int8', 'int4'\], got " + re.escape(repr(v)))
        for v in ("fp16", "INT4", 4, None)
    ],
    *[
        ("overlap_alpha", v, got("overlap_alpha", "a number in \\[0, 1\\]", v))
        for v in (-0.1, 1.5, math.nan, "0.5", True)
    ],
    *_LAUNCH,
    *[
        (arg, v, refused(DiLoCoStrategy, arg, "BucketedDDPStrategy", "sync_every"))
        for arg, v in {**_BUCKETER_ONLY, **_BUCKET_LAYOUT}.items()
    ],
    *[(arg, v, refused(DiLoCoStrategy, arg, "LocalSGDStrategy", "sync_every")) for arg, v in _WARMUP_ONLY.items()],
    (KWARGS, {"warmup_steps": 5}, r"DiLoCoStrategy does not take \['warmup_steps'\] \(LocalSGDStrategy takes"),
    (KWARGS, {"bucket_cap": 5}, r"DiLoCoStrategy does not take \['bucket_cap'\] \(no lightning_sync strategy"),
]

_ASYNC_PS: list[tuple[str, Any, str]] = [
    *[
        ("max_staleness", v, got("max_staleness", "an int >= 0 or math.inf", v))
        for v in (-1, 2.5, -math.inf, math.nan, "4", "inf", True, None)
    ],
    *[("server_rank", v, got("server_rank", "an int >= 0", v)) for v in (-1, 0.0, "0", True, None)],
    *[("lr_scaling", v, got("lr_scaling", "one of \\['linear', 'sqrt'\\]", v)) for v in ("Linear", "adam", "", None)],
    *[
        ("compensation", v, got("compensation", "one of \\['lookahead', 'none'\\]", v))
        for v in ("Lookahead", "dc", "", None)
    ],
    *[(arg, v, pattern) for arg, v, pattern in _BUCKETED if arg in ("start_method", "timeout")],
    (KWARGS, {"process_group_backend": "gloo"}, r"unknown arguments \['process_group_backend'\]"),
]

_HOGWILD: list[tuple[str, Any, str]] = [
    *[("num_processes", v, got("num_processes", "None or an int >= 1", v)) for v in (0, -2, 2.0, "2", True)],
    (
        "num_processes",
        CPUS + 1,
        rf"num_processes={CPUS + 1} is more than this machine's {CPUS} CPUs \(allowed: 1 to "
        rf"{CPUS}\).*oversubscribe=True",
    ),
    *[("oversubscribe", v, got("oversubscribe", _BOOL, v)) for v in (1, "yes", None)],
    *[
        ("start_method", v, got("start_method", "one of \\['fork', 'spawn', 'forkserver'\\]", v))
        for v in ("popen", "thread", None)
    ],
    *[(arg, v, pattern) for arg, v, pattern in _BUCKETED if arg == "timeout"],
    (KWARGS, {"process_group_backend": "gloo"}, r"unknown arguments \['process_group_backend'\]"),
]

# Each strategy takes only the arguments it uses: the others raise, naming them (LocalSGD and DiLoCo rows).
TABLE: list[tuple[type, str, Any, str]] = [
    *[(BucketedDDPStrategy, *row) for row in _BUCKETED],
    *[(ShardedStrategy, *row) for row in _SHARDED],
    *[(LocalSGDStrategy, *row) for row in _LOCAL_SGD],
    *[(DiLoCoStrategy, *row) for row in _DILOCO_OWN],
    *[(AsyncParameterServerStrategy, *row) for row in _ASYNC_PS],
    *[(HogwildStrategy, *row) for row in _HOGWILD],
]


def _kwargs(cls: type, arg: str, value: Any) -> dict[str, Any]:
    if arg == KWARGS:
        return dict(value)
    if cls is DiLoCoStrategy and arg == "nesterov" and value is True:
        return {"nesterov": True, "outer_momentum": 0}
    return {arg: value}


def _id(cls: type, arg: str, value: Any) -> str:
    shown = value.__name__ if isinstance(value, type) else repr(value)
    return f"{cls.__name__}-{arg}={shown}"


@pytest.fixture
def fixed_cpu_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: CPUS)


@pytest.mark.usefixtures("fixed_cpu_count")
@pytest.mark.parametrize(
    ("cls", "arg", "value", "pattern"), TABLE, ids=[_id(cls, arg, value) for cls, arg, value, _ in TABLE]
)
def test_bad_argument_raises_naming_value_and_allowed(cls: type, arg: str, value: Any, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        cls(**_kwargs(cls, arg, value))


def _own_and_inherited_arguments(cls: type) -> set[str]:
    """Named ``__init__`` arguments of ``cls`` and of the lightning_sync classes it forwards ``**kwargs`` to."""
    names: set[str] = set()
    for base in cls.__mro__:
        if base.__module__.startswith("lightning_sync.strategies") and "__init__" in vars(base):
            params = inspect.signature(base.__init__).parameters.values()
            names |= {p.name for p in params if p.name != "self" and p.kind is not p.VAR_KEYWORD}
    return names | {KWARGS}


@pytest.mark.parametrize("cls", STRATEGIES, ids=lambda c: c.__name__)
def test_the_table_covers_every_argument_of_every_strategy(cls: type) -> None:
    covered = {arg for c, arg, _, _ in TABLE if c is cls}
    missing = _own_and_inherited_arguments(cls) - covered
    assert not missing, f"{cls.__name__}: no invalid value in the table for {sorted(missing)}"


def test_the_table_covers_every_key_of_every_strategy_config() -> None:
    conf = Path(__file__).resolve().parents[2] / "conf" / "strategy"
    checked = 0
    for path in sorted(conf.glob("*.yaml")):
        cfg = OmegaConf.to_container(OmegaConf.load(path))
        cls = next((c for c in STRATEGIES if f"{c.__module__}.{c.__name__}" == cfg["_target_"]), None)
        if cls is None:
            assert cfg["_target_"].startswith("lightning.pytorch."), f"{path.name}: unexpected {cfg['_target_']}"
            continue  # Lightning's own DDPStrategy (the baseline): its checks are Lightning's
        covered = {arg for c, arg, _, _ in TABLE if c is cls}
        missing = set(cfg) - {"_target_"} - covered
        assert not missing, f"{path.name}: no invalid value in the table for {sorted(missing)}"
        checked += 1
    assert checked == 8  # bucketed_ddp, zero1/2/3, local_sgd, diloco, async_ps, hogwild


@pytest.mark.usefixtures("fixed_cpu_count")
@pytest.mark.parametrize("cls", STRATEGIES, ids=lambda c: c.__name__)
def test_defaults_construct(cls: type) -> None:
    cls()


@pytest.mark.usefixtures("fixed_cpu_count")
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_every_zero_stage_constructs(stage: int) -> None:
    assert ShardedStrategy(stage=stage).stage == stage


@pytest.mark.usefixtures("fixed_cpu_count")
def test_hogwild_more_processes_than_cpus_constructs_with_oversubscribe() -> None:
    assert HogwildStrategy(num_processes=CPUS + 1, oversubscribe=True).num_processes == CPUS + 1
    assert HogwildStrategy(num_processes=CPUS).num_processes == CPUS


@pytest.mark.parametrize("timeout", [30, 0.5, timedelta(minutes=1)])
def test_valid_timeouts_construct(timeout: Any) -> None:
    expected = timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)
    assert BucketedDDPStrategy(timeout=timeout)._timeout == expected


def test_module_classes_given_as_one_name_is_that_class_not_its_letters() -> None:
    from lightning_sync.sync.zero import resolve_wrap_policy

    policy = resolve_wrap_policy({"module_classes": "Linear"})
    assert policy is not None and policy(torch.nn.Linear(2, 2), 0) and not policy(torch.nn.ReLU(), 0)
