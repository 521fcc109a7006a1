"""SLURM environment for a Lightning job: a rendezvous address that resolves, a port from the job id.

Lightning's ``SLURMEnvironment`` decides the ranks (``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NODEID``,
``SLURM_NTASKS``) and honours ``MASTER_ADDR`` / ``MASTER_PORT`` when they are set. Left alone, it takes
the first name of ``SLURM_JOB_NODELIST`` as the address; on a cluster whose node names do not resolve
(here: ``n1``, ``n2``) every rank then retries the lookup forever. :func:`prepare` sets both first:

* **MASTER_ADDR:** the first host of the job's node list (Slurm's compressed host lists such as
  ``n[1-2]``, ``gpu[01-03,07]-ib,cpu5`` are expanded, by ``scontrol show hostnames`` when it exists);
  if that name does not resolve within a few seconds, the node's ``NodeAddr`` from
  ``scontrol show node`` (the address slurmd itself uses), and as a last resort ``127.0.0.1`` for a
  job on one node. The fallback is said in one log line. A multi-node job whose first node has no
  resolvable address fails at once with an error naming it, instead of hanging.
* **MASTER_PORT:** ``15000 + job_id % 10000``, Lightning's own rule, so every rank of the job (and a
  requeued run of it) agrees without talking.

Values the user already exported are kept.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import subprocess
import threading
from collections.abc import MutableMapping
from dataclasses import dataclass

__all__ = ["Rendezvous", "expand_hostlist", "first_host", "master_port", "node_address", "prepare", "resolves"]

log = logging.getLogger("lightning_sync.launch")
_RESOLVE_TIMEOUT_S = 5.0


def expand_hostlist(hostlist: str) -> list[str]:
    """Slurm's compressed host list as names: ``"n[1-3,7],gpu02"`` -> ``["n1", "n2", "n3", "n7", "gpu02"]``.

    Zero padding is kept (``n[08-10]`` -> ``n08 n09 n10``); several bracket groups in one name multiply
    (``r[1-2]n[1-2]``). Raises ``ValueError`` naming a malformed list.
    """
    names: list[str] = []
    for item in _split_top_level(hostlist.strip()):
        names.extend(_expand_one(item, hostlist))
    if not names:
        raise ValueError(f"empty host list {hostlist!r}")
    return names


def _split_top_level(text: str) -> list[str]:
    """Split on commas and spaces outside brackets."""
    parts, depth, current = [], 0, ""
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch in ", " and depth == 0:
            if current:
                parts.append(current)
            current = ""
        else:
            current += ch
    if current:
        parts.append(current)
    return parts


def _expand_one(item: str, whole: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", item)
    if match is None:
        if "[" in item or "]" in item:
            raise ValueError(f"malformed host list {whole!r}: unbalanced brackets in {item!r}")
        return [item]
    head, tail = item[: match.start()], item[match.end() :]
    out = []
    for rng in match.group(1).split(","):
        bounds = rng.split("-")
        if len(bounds) == 1 and bounds[0].isdigit():
            values = [bounds[0]]
        elif len(bounds) == 2 and bounds[0].isdigit() and bounds[1].isdigit() and int(bounds[0]) <= int(bounds[1]):
            width = len(bounds[0])
            values = [str(i).zfill(width) for i in range(int(bounds[0]), int(bounds[1]) + 1)]
        else:
            raise ValueError(f"malformed host list {whole!r}: bad range {rng!r}")
        for v in values:
            out.extend(_expand_one(head + v + tail, whole))
    return out


def first_host(hostlist: str) -> str:
    """The first host of ``hostlist`` (``scontrol show hostnames`` when available, else our parser)."""
    scontrol = shutil.which("scontrol")
    if scontrol is not None:
        try:
            out = subprocess.run(
                [scontrol, "show", "hostnames", hostlist], capture_output=True, text=True, timeout=10, check=True
            ).stdout.split()
            if out:
                return out[0]
        except (subprocess.SubprocessError, OSError):
            pass  # our own parser below understands the same syntax
    return expand_hostlist(hostlist)[0]


def resolves(host: str, timeout: float = _RESOLVE_TIMEOUT_S) -> bool:
    """Whether ``host`` resolves to an address within ``timeout`` seconds (a lookup never blocks longer)."""
    result: list[bool] = []

    def lookup() -> None:
        try:
            result.append(bool(socket.getaddrinfo(host, None)))
        except (OSError, UnicodeError):
            result.append(False)

    worker = threading.Thread(target=lookup, daemon=True)
    worker.start()
    worker.join(timeout)
    return bool(result and result[0])


def node_address(host: str) -> str | None:
    """``NodeAddr`` of ``host`` from ``scontrol show node`` (None when scontrol is missing or silent)."""
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return None
    try:
        out = subprocess.run([scontrol, "show", "node", host], capture_output=True, text=True, timeout=10).stdout
    except (subprocess.SubprocessError, OSError):
        return None
    match = re.search(r"\bNodeAddr=(\S+)", out)
    return match.group(1) if match else None


def master_port(job_id: str | int) -> int:
    """``15000 + job_id % 10000`` (Lightning's rule for SLURM jobs)."""
    digits = re.sub(r"\D", "", str(job_id))
    if not digits:
        raise ValueError(f"SLURM job id must contain digits, got {job_id!r}")
    return 15000 + int(digits) % 10000


@dataclass
class Rendezvous:
    """Where the ranks of a SLURM job meet, and how that was decided."""

    address: str
    """MASTER_ADDR."""
    port: int
    """MASTER_PORT."""
    source: str
    """``"environment"`` (set by the user), ``"nodelist"`` (the first host resolves) or ``"fallback: ..."``."""


def prepare(env: MutableMapping[str, str] | None = None) -> Rendezvous | None:
    """Set MASTER_ADDR and MASTER_PORT for a SLURM job in ``env`` (``os.environ``); None outside SLURM.

    Raises ``RuntimeError`` naming the host when a multi-node job's first host has no resolvable address.
    """
    env = os.environ if env is None else env
    job_id = env.get("SLURM_JOB_ID")
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if job_id is None or nodelist is None:
        return None
    port = int(env["MASTER_PORT"]) if env.get("MASTER_PORT") else master_port(job_id)
    if env.get("MASTER_ADDR"):
        address, source = env["MASTER_ADDR"], "environment"
    else:
        host = first_host(nodelist)
        if resolves(host):
            address, source = host, "nodelist"
        else:
            fallback = node_address(host)
            if fallback is not None and fallback != host and resolves(fallback):
                address, source = fallback, f"fallback: {host!r} does not resolve, using its NodeAddr {fallback}"
            elif int(env.get("SLURM_JOB_NUM_NODES", env.get("SLURM_NNODES", "1"))) == 1:
                address, source = "127.0.0.1", f"fallback: {host!r} does not resolve, one-node job: 127.0.0.1"
            else:
                raise RuntimeError(
                    f"MASTER_ADDR: the job's first node {host!r} does not resolve and Slurm gives no "
                    f"resolvable NodeAddr for it; export MASTER_ADDR to an address of that node"
                )
            if env.get("SLURM_PROCID", "0") == "0":
                log.warning("MASTER_ADDR %s", source)
    env["MASTER_ADDR"], env["MASTER_PORT"] = address, str(port)
    return Rendezvous(address, port, source)
