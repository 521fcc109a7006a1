"""Shared fixtures: process-group teardown, environment-leak check, one intra-op thread, the gpu marker's skip, and
the slurm tier as a command of its own."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

# Variables a distributed run sets; a test must never leave them behind in the pytest process.
_DIST_ENV = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "NODE_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "PL_GLOBAL_SEED",
    "PL_TRAINER_GPUS",
    "TORCHELASTIC_RUN_ID",
)


_SLURM_TIER = "tests/slurm"
_TESTS = str(Path(__file__).resolve().parent)


def pytest_configure(config: pytest.Config) -> None:
    """The test-only helpers (``tests/support``) importable in the processes the tests start, not only in this one:
    the harness's forkserver imports ``support.preload``, and Python 3.11's forkserver ignores the ``sys.path`` it
    is handed (it inherits only the environment). Set for the session and restored at its end."""
    config.stash[_PYTHONPATH] = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_TESTS, config.stash[_PYTHONPATH]) if p)


def pytest_unconfigure(config: pytest.Config) -> None:
    old = config.stash.get(_PYTHONPATH, None)
    if old is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = old


_PYTHONPATH = pytest.StashKey[str | None]()


def _in_slurm_tier(nodeid: str) -> bool:
    return nodeid.startswith(_SLURM_TIER + "/")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: many tests start 2-4 ranks of their own, so one worker per core would oversubscribe a large
    machine; two workers still overlap one test's waiting (timeouts, Slurm scheduling) with another's work."""
    return min(4, max(2, (os.cpu_count() or 1) // 2))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Each test module runs whole on one worker, so its module-scoped fixtures (an uninterrupted reference run,
    a built wheel) are built once and never by two workers at the same time; the slurm tier runs whole on one
    worker too: a worker starts its own Slurm, and two would hand out the same job ids (so the same rendezvous
    ports), and it goes first.

    A scheduler rather than ``xdist_group`` marks, which pytest-xdist 3.8 cannot read under pytest 9."""
    if config.getvalue("dist") not in ("load", "loadgroup", "loadfile"):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByModuleSlurmTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _SLURM_TIER if _in_slurm_tier(nodeid) else nodeid.split("::", 1)[0]

        def _assign_work_unit(self, node: object) -> None:
            # The slurm tier is the longest unit by far (3 to 4 minutes, much of it waiting on Slurm and on
            # fresh interpreters): handed out first, it overlaps every other module instead of running alone,
            # on one worker, at the end.
            if _SLURM_TIER in self.workqueue:
                self.workqueue.move_to_end(_SLURM_TIER, last=False)
            super()._assign_work_unit(node)

    return ByModuleSlurmTogether(config, log)


def _runs_the_slurm_tier(config: pytest.Config) -> bool:
    """The slurm tier starts real Slurm daemons and takes minutes, so it is a command of its own (``pytest
    tests/slurm``, which CI runs after the default one): it runs when the command line names it, by a path
    inside ``tests/slurm`` or by a ``-m`` expression on its marker."""
    if "slurm" in (config.getoption("markexpr", "") or ""):
        return True
    tier = (config.rootpath / _SLURM_TIER).resolve()
    for arg in config.args:
        path = Path(arg.split("::", 1)[0])
        path = (path if path.is_absolute() else config.invocation_params.dir / path).resolve()
        if path == tier or tier in path.parents:
            return True
    return False


def pytest_report_header(config: pytest.Config) -> str | None:
    if _runs_the_slurm_tier(config):
        return None
    return f"slurm tier: not in this run (real Slurm daemons, about 3 minutes): python -m pytest {_SLURM_TIER}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not _runs_the_slurm_tier(config):
        tier = [item for item in items if _in_slurm_tier(item.nodeid)]
        if tier:
            config.hook.pytest_deselected(items=tier)
            items[:] = [item for item in items if not _in_slurm_tier(item.nodeid)]
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (marker 'gpu'); this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def one_thread():
    """One intra-op thread for a test of tiny tensors (``pytestmark = pytest.mark.usefixtures("one_thread")``): on a
    busy 2-core machine intra-op threads make each op wait for a descheduled peer thread (~50x slower); restored
    afterwards for the other tests."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def dist_guard():
    """Tear down any process group a test left, and fail the test if it leaked env vars or children."""
    before = {k: os.environ.get(k) for k in _DIST_ENV}
    yield
    leaked_pg = dist.is_available() and dist.is_initialized()
    if leaked_pg:
        dist.destroy_process_group()
    after = {k: os.environ.get(k) for k in _DIST_ENV}
    changed = {k: (before[k], after[k]) for k in _DIST_ENV if before[k] != after[k]}
    for k, (old, _new) in changed.items():  # restore, so one leak does not cascade into other tests
        if old is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = old
    children = [p for p in multiprocessing.active_children() if p.name.startswith("lightning_sync-")]
    for p in children:
        p.kill()
        p.join(5)
    problems = []
    if leaked_pg:
        problems.append("left a process group initialised")
    if changed:
        problems.append(f"leaked environment variables (before, after): {changed}")
    if children:
        problems.append(f"leaked child processes: {[p.name for p in children]}")
    if problems:
        pytest.fail("test " + "; ".join(problems))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the harness's forkserver (its imports take seconds) while the first tests run, if any test starts
    ranks (``run_distributed``, or ``_cli_ranks.launch``)."""
    for item in session.items:
        module = getattr(item, "module", None)
        if module is not None and any(name in vars(module) for name in ("run_distributed", "launch")):
            from lightning_sync.testing.startup import warm_up

            warm_up(extra=("support.preload",))  # Hydra's override parser tables, built once
            return
