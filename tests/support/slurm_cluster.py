"""A real Slurm on this one machine: munged, slurmctld and two slurmd emulating nodes ``n1`` and ``n2``.

Used by the ``slurm`` test tier (``tests/slurm/conftest.py``). It follows the verified recipe in the
project's shared notes (Slurm 22.05 from Debian, built with multiple-slurmd):

* munged runs as the ``munge`` user with its socket in a directory of mode 755 (700 is refused), and
  every parent directory must be traversable by that user too (``mkdtemp`` makes 700: widened to 755);
* ``slurm.conf`` names that socket (``AuthInfo=socket=...``), free ports for slurmctld and each slurmd,
  ``proctrack/linuxproc`` and ``task/none`` (no cgroups), and both nodes at ``NodeAddr=127.0.0.1``;
* every ``SlurmdSpoolDir/<node>`` exists before its slurmd starts;
* the daemons run in the foreground, so each is stopped by the PID it was started with, never by name.

Node names do not resolve here: that is the case the launch code must handle (``MASTER_ADDR``).
Everything lives under one temporary directory; :meth:`SlurmCluster.logs` returns the daemons' logs for
test failure messages.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

__all__ = ["SlurmCluster", "missing_binaries"]

_BINARIES = (
    "munged",
    "munge",
    "unmunge",
    "slurmctld",
    "slurmd",
    "sbatch",
    "srun",
    "scontrol",
    "sinfo",
    "squeue",
    "scancel",
    "runuser",
)


def missing_binaries() -> list[str]:
    """The Slurm/munge programs this machine lacks (empty: a cluster can start)."""
    found = {b: shutil.which(b) or (f"/usr/sbin/{b}" if os.path.exists(f"/usr/sbin/{b}") else None) for b in _BINARIES}
    return [b for b, path in found.items() if path is None]


def _which(binary: str) -> str:
    path = shutil.which(binary) or f"/usr/sbin/{binary}"
    if not os.path.exists(path):
        raise FileNotFoundError(f"{binary} is not installed (apt-get install slurm-wlm munge)")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlurmCluster:
    """Two emulated nodes ``n1`` and ``n2`` (``cpus`` each) under ``root``; start with :meth:`start`."""

    def __init__(self, root: str | None = None, cpus: int = 2) -> None:
        self.root = Path(root or tempfile.mkdtemp(prefix="ls_slurm_"))
        self.cpus = cpus
        self.conf = self.root / "etc" / "slurm.conf"
        self.socket = self.root / "munge" / "munge.socket.2"
        self._procs: dict[str, subprocess.Popen[bytes]] = {}

    @property
    def env(self) -> dict[str, str]:
        """The environment for every Slurm command and job (``SLURM_CONF`` pointing at this cluster)."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    # ------------------------------------------------------------------ start / stop
    def start(self, timeout: float = 90.0) -> None:
        """Start munged, slurmctld and both slurmd, and wait until both nodes are idle."""
        try:
            self._start_munge()
            self._write_conf()
            log = self.root / "log"
            self._spawn("slurmctld", [_which("slurmctld"), "-D", "-i", "-f", str(self.conf)], log / "slurmctld.out")
            for node in ("n1", "n2"):
                self._spawn(
                    f"slurmd-{node}",
                    [_which("slurmd"), "-D", "-N", node, "-f", str(self.conf)],
                    log / f"slurmd.{node}.out",
                )
            self._wait_idle(timeout)
        except BaseException:
            self.stop()
            raise

    def _start_munge(self) -> None:
        self.root.chmod(0o755)  # munged (as user munge) must traverse every parent of its directories
        munge_dir = self.socket.parent
        munge_dir.mkdir(parents=True)
        shutil.chown(munge_dir, user="munge", group="munge")
        munge_dir.chmod(0o755)  # munged refuses a socket directory others cannot traverse
        self._spawn(
            "munged",
            [
                _which("runuser"),
                "-u",
                "munge",
                "--",
                _which("munged"),
                "--foreground",
                f"--socket={self.socket}",
                f"--log-file={munge_dir / 'log'}",
                f"--pid-file={munge_dir / 'pid'}",
                f"--seed-file={munge_dir / 'seed'}",
            ],
            munge_dir / "out",
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            cred = subprocess.run([_which("munge"), "-n", f"--socket={self.socket}"], capture_output=True)
            if cred.returncode == 0:
                check = subprocess.run(
                    [_which("unmunge"), f"--socket={self.socket}"], input=cred.stdout, capture_output=True
                )
                if check.returncode == 0:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"munged did not answer on {self.socket}:\n{self.logs()}")

    def _write_conf(self) -> None:
        for sub in ("etc", "ctld", "d/n1", "d/n2", "log"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        ports = {"ctld": _free_port(), "n1": _free_port(), "n2": _free_port()}
        r = self.root
        self.conf.write_text(f"""ClusterName=lightningsync
SlurmctldHost=localhost
AuthType=auth/munge
AuthInfo=socket={self.socket}
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ports["ctld"]}
StateSaveLocation={r}/ctld
SlurmdSpoolDir={r}/d/%n
SlurmctldPidFile={r}/ctld/slurmctld.pid
SlurmdPidFile={r}/d/slurmd.%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
ReturnToService=2
SwitchType=switch/none
KillWait=5
NodeName=n1 NodeHostname=localhost NodeAddr=127.0.0.1 Port={ports["n1"]} CPUs={self.cpus} RealMemory=8000 State=UNKNOWN
NodeName=n2 NodeHostname=localhost NodeAddr=127.0.0.1 Port={ports["n2"]} CPUs={self.cpus} RealMemory=8000 State=UNKNOWN
PartitionName=debug Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")

    def _spawn(self, name: str, cmd: list[str], out: Path) -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "wb") as f:
            self._procs[name] = subprocess.Popen(
                cmd, stdout=f, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )

    def _wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            dead = [n for n, p in self._procs.items() if p.poll() is not None]
            if dead:
                raise RuntimeError(f"Slurm daemons exited: {dead}\n{self.logs()}")
            proc = subprocess.run(
                [_which("sinfo"), "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, env=self.env
            )
            state = proc.stdout.strip()
            nodes = dict(line.split() for line in state.splitlines() if len(line.split()) == 2)
            if nodes.get("n1") == "idle" and nodes.get("n2") == "idle":
                return
            time.sleep(0.5)
        raise TimeoutError(f"Slurm nodes not idle after {timeout:.0f}s (sinfo: {state!r})\n{self.logs()}")

    def stop(self) -> None:
        """Stop every daemon by the PID it was started with (slurmd, slurmctld, then munged)."""
        order = [n for n in self._procs if n.startswith("slurmd")] + [
            n for n in ("slurmctld", "munged") if n in self._procs
        ]
        for name in order:
            proc = self._procs[name]
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)  # the daemon's own session: its children too
                except ProcessLookupError:
                    pass
        for name in order:
            proc = self._procs[name]
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)
        self._procs.clear()

    # ------------------------------------------------------------------ use
    def run(self, *args: str, timeout: float = 60.0, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a Slurm command (``sbatch``, ``scontrol``, ...) against this cluster."""
        proc = subprocess.run(
            [_which(args[0]), *args[1:]], capture_output=True, text=True, env=self.env, timeout=timeout
        )
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed ({proc.returncode}): {proc.stderr}\n{self.logs()}")
        return proc

    def submit_two_nodes(self, script: Path, workdir: Path, output: str = "out") -> str:
        """``sbatch`` ``script`` on both nodes, one task each, in ``workdir`` (its output in
        ``workdir/<output>.<job id>``); the job id."""
        args = ["--parsable", "-N2", "--ntasks-per-node=1", f"--output={workdir}/{output}.%j", f"--chdir={workdir}"]
        return self.run("sbatch", *args, str(script)).stdout.strip().split(";")[0]

    def job_state(self, job_id: str) -> str:
        """The job's state from ``scontrol show job`` (``PENDING``, ``RUNNING``, ``COMPLETED``, ...)."""
        out = self.run("scontrol", "show", "job", job_id, check=False).stdout
        for field in out.split():
            if field.startswith("JobState="):
                return field.split("=", 1)[1]
        return "UNKNOWN"

    def wait_job(self, job_id: str, timeout: float, done: tuple[str, ...] = ("COMPLETED",)) -> str:
        """Wait until the job reaches an end state; raise with the daemons' logs if it fails or times out."""
        ends = {
            "COMPLETED",
            "FAILED",
            "CANCELLED",
            "TIMEOUT",
            "NODE_FAIL",
            "OUT_OF_MEMORY",
            "BOOT_FAIL",
            "DEADLINE",
            "PREEMPTED",
        }
        deadline = time.monotonic() + timeout
        state = "UNKNOWN"
        while time.monotonic() < deadline:
            state = self.job_state(job_id)
            if state in ends:
                if state not in done:
                    raise RuntimeError(f"job {job_id} ended {state}\n{self.logs()}")
                return state
            time.sleep(0.5)
        self.run("scancel", job_id, check=False)
        raise TimeoutError(f"job {job_id} still {state} after {timeout:.0f}s (cancelled)\n{self.logs()}")

    def logs(self, tail: int = 60) -> str:
        """The last ``tail`` lines of every daemon log, for failure messages."""
        parts = []
        for path in sorted(self.root.glob("log/*")) + sorted(self.root.glob("munge/log")):
            try:
                lines = path.read_text(errors="replace").splitlines()[-tail:]
            except OSError:
                continue
            parts.append(f"--- {path.relative_to(self.root)} ---\n" + "\n".join(lines))
        return "\n".join(parts)
