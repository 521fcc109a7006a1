"""The slurm tier: one real Slurm (munged, slurmctld, slurmd n1 and n2) for the whole session.

Skipped, with the reason, only where the Slurm/munge binaries are missing (``.ci/run`` installs them) or
where the daemons cannot run as root. Every test is marked ``slurm`` and has a hard timeout; a failing
job's error carries the daemons' logs.

A Slurm job must equal the same job on local ranks. Those local runs start from the harness's preloaded
forkserver (:mod:`support.cli_ranks`) and run once per session for each world size and set
of overrides (:class:`_local_runs.LocalRuns`), so several tests compare against one run."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from _local_runs import LocalRuns
from support.slurm_cluster import SlurmCluster, missing_binaries


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/slurm/" in item.nodeid.replace("\\", "/"):
            item.add_marker(pytest.mark.slurm)


@pytest.fixture(scope="session")
def slurm() -> Iterator[SlurmCluster]:
    missing = missing_binaries()
    if missing:
        pytest.skip(f"Slurm binaries missing: {missing} (apt-get install slurm-wlm munge; .ci/run does this)")
    if os.geteuid() != 0:
        pytest.skip("the slurm tier starts munged and slurmd, which needs root")
    cluster = SlurmCluster()
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def local_runs(tmp_path_factory: pytest.TempPathFactory) -> LocalRuns:
    return LocalRuns(tmp_path_factory.mktemp("local_runs"))
