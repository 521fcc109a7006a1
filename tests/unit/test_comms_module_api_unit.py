"""The comms module functions in one process: the error without a process group, bad arguments (on a 1-rank gloo
group in this process), laziness at import, and the default context's replacement when the group changes.

The results on real peers are in tests/multiprocess/test_comms_module_api.py.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_sync import comms

__all__: list[str] = []

# One call of each module function, with arguments that would be valid on a 1-rank group.
_CALLS: dict[str, Callable[[], Any]] = {
    "barrier": lambda: comms.barrier(),
    "broadcast": lambda: comms.broadcast(torch.ones(2), src=0),
    "scatter": lambda: comms.scatter([torch.ones(2)], src=0),
    "gather": lambda: comms.gather(torch.ones(2), dst=0),
    "all_gather": lambda: comms.all_gather(torch.ones(2)),
    "all_reduce": lambda: comms.all_reduce(torch.ones(2), op="avg"),
    "reduce_scatter": lambda: comms.reduce_scatter(torch.ones(2), op="sum"),
    "default_context": lambda: comms.default_context(),
}


@pytest.fixture
def one_rank() -> Iterator[None]:
    """A 1-rank gloo default group in this process, destroyed after the test."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize("name", sorted(_CALLS))
def test_without_a_process_group_the_error_names_the_call_and_init_process_group(name: str) -> None:
    assert not dist.is_initialized(), "this test needs a pytest process without a process group"
    with pytest.raises(RuntimeError, match=rf"comms\.{name}\(\).*torch\.distributed\.init_process_group first"):
        _CALLS[name]()


def test_every_function_is_exported() -> None:
    assert set(_CALLS) <= set(comms.__all__)
    assert all(callable(getattr(comms, name)) for name in _CALLS)


def test_importing_comms_makes_no_context_and_touches_no_process_group() -> None:
    code = (
        "import gc, torch.distributed as dist\n"
        "from lightning_sync import comms\n"
        "gc.collect()\n"
        "made = [o for o in gc.get_objects() if type(o) is comms.CommContext]\n"
        "print(len(made), dist.is_initialized())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["0", "False"], out.stdout + out.stderr


@pytest.mark.usefixtures("one_rank")
def test_the_calls_work_on_one_rank() -> None:
    # one rank: every result is the input itself (the sums are of one term, the average divides by 1: exact)
    t = torch.arange(4.0)
    assert comms.all_reduce(t, op="avg") is t and torch.equal(t, torch.arange(4.0))
    assert torch.equal(comms.reduce_scatter(torch.arange(5.0), op="sum"), torch.arange(5.0))
    assert comms.broadcast({"a": 1}, src=0) == {"a": 1}
    assert comms.scatter(["x"], src=0) == "x"
    assert [p.tolist() for p in comms.all_gather(torch.tensor([3]))] == [[3]]
    gl = [torch.zeros(2)]
    assert comms.gather(torch.ones(2), gl, dst=0) is gl and torch.equal(gl[0], torch.ones(2))
    assert comms.barrier() is None


@pytest.mark.usefixtures("one_rank")
@pytest.mark.parametrize(
    ("call", "patterns"),
    [
        pytest.param(
            lambda: comms.all_reduce(torch.ones(2), op="mean"),
            [r"'mean'", r"\['avg', 'max', 'min', 'sum'\]"],
            id="unknown op",
        ),
        pytest.param(
            lambda: comms.all_reduce(torch.ones(2, dtype=torch.int64), op="avg"),
            [r"int64", r"'sum'"],
            id="avg of int64",
        ),
        pytest.param(
            lambda: comms.reduce_scatter(torch.ones(2), op="product"),
            [r"'product'", r"'avg'"],
            id="reduce_scatter unknown op",
        ),
        pytest.param(
            lambda: comms.broadcast(torch.ones(2), src=1),
            [r"src=1", r"allowed: \[0\]"],
            id="broadcast src out of range",
        ),
        pytest.param(
            lambda: comms.broadcast({"a": 1}, src=-1),
            [r"src=-1", r"allowed: \[0\]"],
            id="broadcast object src negative",
        ),
        pytest.param(
            lambda: comms.broadcast(torch.ones(2), src="0"), [r"src='0'", r"allowed: \[0\]"], id="src not an int"
        ),
        pytest.param(lambda: comms.scatter(["x"], src=2), [r"src=2", r"allowed: \[0\]"], id="scatter src out of range"),
        pytest.param(
            lambda: comms.scatter(["x", "y"], src=0), [r"2 chunks", r"world size is 1"], id="scatter chunk count"
        ),
        pytest.param(
            lambda: comms.gather(torch.ones(2), dst=3), [r"dst=3", r"allowed: \[0\]"], id="gather dst out of range"
        ),
        pytest.param(
            lambda: comms.gather(torch.ones(2), [torch.zeros(3)], dst=0),
            [r"gather_list\[0\]", r"\(3,\)", r"\(2,\)"],
            id="gather_list shape",
        ),
    ],
)
def test_bad_arguments_raise_value_error_naming_the_value_and_the_allowed_ones(
    call: Callable[[], Any], patterns: list[str]
) -> None:
    with pytest.raises(ValueError) as err:
        call()
    for pattern in patterns:
        assert re.search(pattern, str(err.value)), (pattern, str(err.value))


@pytest.mark.usefixtures("one_rank")
@pytest.mark.parametrize("name", ["all_reduce", "reduce_scatter", "all_gather", "gather"])
def test_a_tensor_function_refuses_a_non_tensor(name: str) -> None:
    with pytest.raises(TypeError, match=rf"comms\.{name}: tensor must be a torch\.Tensor, got list"):
        getattr(comms, name)([1.0, 2.0])


def test_a_new_default_group_gets_a_new_context_counting_from_one() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        first = comms.default_context()
        comms.barrier()
        assert comms.all_reduce(torch.ones(1), async_op=True).seq == 2
        assert comms.default_context() is first
        dist.destroy_process_group()
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        work = comms.all_reduce(torch.ones(1), async_op=True)
        assert work.seq == 1  # a fresh context, not the old one's counter
        assert comms.default_context() is not first
        # a strategy's context beside it: its own counter, untouched by the module calls
        side = comms.CommContext()
        assert side.barrier(async_op=True).seq == 1
        assert comms.barrier(async_op=True).seq == 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
