"""``lightning-sync sbatch``: the SLURM job of a train config, as a plain sbatch script to read and submit.

The script is rendered from the same composed config as ``lightning-sync train -m launch=slurm``
(``conf/launch/slurm.yaml``): one task per rank (``trainer.devices`` tasks on each of ``launch.nodes``
nodes), ``srun`` starting ``lightning-sync train`` with exactly the overrides given here, so the job
trains what the command line says. Every value that reaches the script is shell-quoted
(:func:`shlex.quote`): a job name or override holding ``$(...)``, backticks, ``;`` or quotes stays a
literal string and never runs.

``train -m launch=slurm`` goes through hydra-submitit-launcher instead, whose script holds the job name,
partition, signal, CPUs and setup lines (submitit shell-quotes each ``#SBATCH`` value; the overrides
travel in a pickle, not in the script). :class:`SlurmLauncherValues`, a Hydra callback of
``conf/launch/slurm.yaml``, refuses what quoting cannot stop before submitit writes it: a value that
spans lines (a newline ends the ``#SBATCH`` comment and bash runs the next line).

Usage::

    lightning-sync sbatch launch.nodes=2 trainer.devices=2 strategy=bucketed_ddp > job.sh
    sbatch job.sh
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Sequence
from typing import Any

from hydra.experimental.callback import Callback

from lightning_sync._config import config_dir
from lightning_sync.launch.signals import resolve_signal

__all__ = ["SlurmLauncherValues", "compose_job", "render_sbatch"]


def compose_job(overrides: Sequence[str]) -> Any:
    """The train config with ``launch=slurm`` and ``overrides`` (a plain ``DictConfig``, resolved later)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose("train", overrides=["launch=slurm", *overrides])
    GlobalHydra.instance().clear()
    return cfg


def _one_line(name: str, value: Any) -> str:
    """A value for an ``#SBATCH`` line: a newline would end the comment and start a line bash runs."""
    text = str(value)
    if "\n" in text or "\r" in text:
        raise ValueError(f"{name} must be one line (it goes into an #SBATCH directive), got {text!r}")
    return text


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def render_sbatch(overrides: Sequence[str], output: str = "slurm-%j.out") -> str:
    """The sbatch script of ``lightning-sync train launch=slurm <overrides>`` (see the module docstring)."""
    cfg = compose_job(overrides)
    launch = cfg.launch
    nodes = _positive_int("launch.nodes", launch.nodes)
    tasks = _positive_int("trainer.devices", cfg.trainer.devices)
    cpus = _positive_int("launch.cpus_per_task", launch.cpus_per_task)
    minutes = _positive_int("launch.time_min", launch.time_min)
    try:
        signal = resolve_signal(launch.signal).name.removeprefix("SIG")
    except ValueError as err:
        raise ValueError(f"launch.{err}") from None
    delay = _positive_int("launch.signal_delay_s", launch.signal_delay_s)
    q = shlex.quote
    directives = [
        f"--job-name={q(_one_line('launch.job_name', launch.job_name))}",
        f"--nodes={nodes}",
        f"--ntasks-per-node={tasks}",
        f"--cpus-per-task={cpus}",
        f"--time={minutes}",
        f"--signal={q(signal)}@{delay}",
        f"--output={q(_one_line('output', output))}",
        "--open-mode=append",
    ]
    if launch.partition:
        directives.append(f"--partition={q(_one_line('launch.partition', launch.partition))}")
    if launch.requeue:
        directives.append("--requeue")
    python = str(launch.python) if launch.python else sys.executable
    args = [python, "-m", "lightning_sync", "train", "launch=slurm", *overrides]
    lines = [
        "#!/bin/bash",
        "# Rendered by `lightning-sync sbatch`; submit with `sbatch <this file>`.",
        *(f"#SBATCH {d}" for d in directives),
        "",
        "# One intra-op thread per CPU of the task (Lightning's own launcher does the same; unset, every rank",
        "# starts a thread per core of the node and they fight over them).",
        f'export OMP_NUM_THREADS="${{OMP_NUM_THREADS:-{cpus}}}"',
        "# One task per rank: Lightning's SLURMEnvironment reads the ranks from srun; the train app sets",
        "# a MASTER_ADDR that resolves and MASTER_PORT from the job id.",
        "srun " + " ".join(q(a) for a in args) + " &",
        "pid=$!",
        f"# --signal sends SIG{signal} to every task; `scancel --signal={signal} --batch` reaches only this shell,",
        "# which passes it on (srun forwards it to the tasks). The tasks save, requeue the job and exit.",
        f"trap 'kill -s {q(signal)} \"$pid\" 2>/dev/null' {q(signal)}",
        'wait "$pid"; status=$?',
        'while kill -0 "$pid" 2>/dev/null; do wait "$pid"; status=$?; done  # a trapped signal ends `wait` early',
        'exit "$status"',
        "",
    ]
    return "\n".join(lines)


def _strings(resolved: Any, raw: Any, key: str) -> Any:
    """``(key, resolved text, raw text)`` of every string in a resolved config container (raw: unresolved)."""
    if isinstance(resolved, dict):
        for k, v in resolved.items():
            yield from _strings(v, raw.get(k) if isinstance(raw, dict) else None, f"{key}.{k}")
    elif isinstance(resolved, list):
        for i, v in enumerate(resolved):
            yield from _strings(v, raw[i] if isinstance(raw, list) and i < len(raw) else None, f"{key}[{i}]")
    elif isinstance(resolved, str):
        yield key, resolved, raw


class SlurmLauncherValues(Callback):
    """Hydra callback (``conf/launch/slurm.yaml``): before hydra-submitit-launcher writes its sbatch script,
    refuse a launcher value that spans lines, and ``launch.cpus_per_task`` (in the ``setup`` shell line)
    unless it is an int. ``setup`` entries themselves are shell commands by design and are not checked."""

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        from omegaconf import OmegaConf

        if "launch" in config and "cpus_per_task" in config.launch:
            _positive_int("launch.cpus_per_task", config.launch.cpus_per_task)
        launcher = config.hydra.launcher
        try:
            resolved = OmegaConf.to_container(launcher, resolve=True)
        except Exception:  # noqa: BLE001 - the launcher raises the same error, with Hydra's context
            return
        raw = OmegaConf.to_container(launcher, resolve=False)
        for key, text, source in _strings(resolved, raw, "hydra.launcher"):
            if key.startswith("hydra.launcher.setup[") or ("\n" not in text and "\r" not in text):
                continue
            origin = f" (set from {source})" if isinstance(source, str) and "${" in source else ""
            raise ValueError(
                f"{key}{origin} must be one line (it goes into submitit's sbatch script, where a "
                f"newline ends the #SBATCH comment and bash runs the next line), got {text!r}"
            )


_USAGE = """usage: lightning-sync sbatch [group=option ...] [key=value ...]

Prints the SLURM batch script of the train config composed with these overrides (launch=slurm is implied):
  lightning-sync sbatch launch.nodes=2 trainer.devices=4 strategy=zero3 > job.sh && sbatch job.sh
The overrides are those of `lightning-sync train` (see `lightning-sync train --help`). trainer.devices is the
tasks per node; launch.nodes, launch.time_min, launch.partition, launch.cpus_per_task, launch.signal,
launch.signal_delay_s and launch.requeue set the rest (conf/launch/slurm.yaml).
"""


def main(argv: Sequence[str]) -> None:
    """``lightning-sync sbatch [overrides...]``: print the script (a bad override exits with Hydra's message)."""
    from hydra.errors import HydraException

    if any(arg in ("-h", "--help") for arg in argv):
        sys.stdout.write(_USAGE)
        return
    try:
        script = render_sbatch(list(argv))
    except (HydraException, ValueError) as err:
        raise SystemExit(f"lightning-sync sbatch: {err}") from None
    sys.stdout.write(script)
