"""SLURM rendezvous settings in one process: host-list expansion, the port rule, and MASTER_ADDR's
fallback when the first node's name does not resolve (as on this machine, where nodes are n1, n2).

The real-Slurm tier (``tests/slurm/``) runs the same code inside jobs of real daemons."""

from __future__ import annotations

from typing import Any

import pytest

from lightning_sync.launch import slurm_env
from lightning_sync.launch.slurm_env import expand_hostlist, master_port, prepare, resolves


@pytest.mark.parametrize(
    ("hostlist", "names"),
    [
        ("n1", ["n1"]),
        ("n[1-2]", ["n1", "n2"]),
        ("n[08-10]", ["n08", "n09", "n10"]),
        ("n[1-3,7],gpu02", ["n1", "n2", "n3", "n7", "gpu02"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("n[1-2]-ib", ["n1-ib", "n2-ib"]),
        ("host0 host1", ["host0", "host1"]),
        ("n[5]", ["n5"]),
    ],
)
def test_host_lists_expand_like_scontrol(hostlist: str, names: list[str]) -> None:
    assert expand_hostlist(hostlist) == names


@pytest.mark.parametrize("bad", ["n[1-2", "n1-2]", "n[3-1]", "n[a-b]", "", "n[1-2-3]"])
def test_malformed_host_lists_are_named(bad: str) -> None:
    with pytest.raises(ValueError, match="host list"):
        expand_hostlist(bad)


def test_port_follows_lightnings_rule_from_the_job_id() -> None:
    assert master_port("12345") == 15000 + 2345
    assert master_port(7) == 15007
    assert master_port("4_2") == 15042  # array jobs: the digits of the id
    with pytest.raises(ValueError, match="job id must contain digits, got 'abc'"):
        master_port("abc")


def test_resolution_is_bounded_and_honest() -> None:
    assert resolves("localhost")
    assert not resolves("n1.invalid")  # RFC 2606: never resolves


def _job(**kw: str) -> dict[str, str]:
    return {
        "SLURM_JOB_ID": "4321",
        "SLURM_JOB_NODELIST": "n[1-2]",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_PROCID": "0",
        **kw,
    }


def test_outside_slurm_nothing_is_set() -> None:
    env: dict[str, str] = {}
    assert prepare(env) is None and env == {}


def test_user_values_are_kept() -> None:
    env = _job(MASTER_ADDR="10.0.0.5", MASTER_PORT="29500")
    rdv = prepare(env)
    assert rdv is not None and (rdv.address, rdv.port, rdv.source) == ("10.0.0.5", 29500, "environment")


def test_a_resolvable_first_host_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slurm_env, "first_host", lambda nodelist: "localhost")
    env = _job()
    rdv = prepare(env)
    assert rdv is not None and rdv.source == "nodelist"
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("localhost", "19321")


def test_unresolvable_first_host_falls_back_to_its_node_address(monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    monkeypatch.setattr(slurm_env, "node_address", lambda host: "127.0.0.1" if host == "n1" else None)
    monkeypatch.setattr(slurm_env, "first_host", lambda nodelist: "n1")
    monkeypatch.setattr(slurm_env, "resolves", lambda host, timeout=5.0: host == "127.0.0.1")
    env = _job()
    with caplog.at_level("WARNING", logger="lightning_sync.launch"):
        rdv = prepare(env)
    assert rdv is not None and env["MASTER_ADDR"] == "127.0.0.1"
    assert "'n1' does not resolve, using its NodeAddr 127.0.0.1" in rdv.source
    assert [r.getMessage() for r in caplog.records] == [f"MASTER_ADDR {rdv.source}"]  # one line


def test_one_node_job_without_scontrol_uses_loopback_and_multi_node_fails_naming_the_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(slurm_env, "node_address", lambda host: None)
    monkeypatch.setattr(slurm_env, "first_host", lambda nodelist: "n1")
    monkeypatch.setattr(slurm_env, "resolves", lambda host, timeout=5.0: False)
    one = _job(SLURM_JOB_NUM_NODES="1", SLURM_JOB_NODELIST="n1")
    assert prepare(one) is not None and one["MASTER_ADDR"] == "127.0.0.1"
    with pytest.raises(RuntimeError, match="first node 'n1' does not resolve"):
        prepare(_job())
