"""``lightning-sync`` console script: Hydra apps over the shipped ``conf/``, and two plain commands.

``lightning-sync --help`` lists the subcommands, the config groups of each app and the common overrides
(:mod:`lightning_sync.cli_help`); each subcommand's ``--help`` its own.

``lightning-sync sbatch [overrides...]`` prints the SLURM job of the same config as an sbatch script
(:mod:`lightning_sync.launch.sbatch`).

``lightning-sync consolidate CHECKPOINT_DIR OUTPUT_FILE`` writes one plain Lightning checkpoint file from a
ZeRO sharded checkpoint directory (:mod:`lightning_sync.consolidate`).

``lightning-sync launch --nproc N [--max-restarts K] -- python train.py`` starts N ranks of any script under the
fault-tolerance agent (:mod:`lightning_sync.launch.agent`); ``lightning-sync train launch.fault_tolerant=true``
does the same for the train app itself.

``lightning-sync train [hydra overrides...]`` composes ``conf/train.yaml`` and builds the strategy,
model, data module and Trainer with :func:`hydra.utils.instantiate`. Every Hydra flag works
(``--cfg job``, ``-m`` multirun, ``--help``).

Hydra and Lightning's process launcher: Lightning starts ranks 1..N-1 by re-running the command
line with ``hydra.run.dir`` set to rank 0's directory. Under ``-m`` that command line would be the
whole sweep, so every rank would run every job and create its own output directories. Before
fitting, :func:`_pin_child_command` therefore rewrites ``sys.argv`` to *this job's* overrides and
pins ``hydra.run.dir`` to this job's output directory, so all ranks share exactly one directory.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_sync._config import config_dir

__all__ = ["SUBCOMMANDS", "config_dir", "main", "run_train"]

log = logging.getLogger("lightning_sync")
SUBCOMMANDS = ("train", "bench", "sbatch", "consolidate", "launch")
_CONFIG_FLAGS = ("--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd")


def _config_flags(argv: Sequence[str]) -> list[str]:
    """The ``--config-*`` flags of ``argv`` (with their values), which children must keep."""
    out: list[str] = []
    it = iter(argv)
    for arg in it:
        if arg in _CONFIG_FLAGS:
            out += [arg, next(it, "")]
        elif arg.split("=", 1)[0] in _CONFIG_FLAGS:
            out.append(arg)
    return out


def _pin_child_command(subcommand: str) -> None:
    """Make Lightning's relaunch of ranks > 0 run exactly this job, in this job's directory."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import read_write

    hc = HydraConfig.get()
    flags = _config_flags(sys.argv[1:])
    sys.argv = [sys.argv[0], subcommand, *flags, *hc.overrides.task]
    run = HydraConfig.instance().cfg.hydra.run  # type: ignore[union-attr]
    with read_write(run):
        run.dir = hc.runtime.output_dir


def _scalar_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    out = {}
    for k, v in metrics.items():
        value = float(v.item() if hasattr(v, "item") else v)
        if math.isfinite(value):
            out[k] = value
    return out


def _warn_oversubscription(cfg: Any) -> str | None:
    """Warn (on rank 0) when a CPU run starts more processes per node than this machine has CPUs.

    ``trainer.devices`` is an int or a digit string for the CPU accelerator (``"auto"`` is one process;
    other forms are Lightning's to reject). ``accelerator: auto`` counts as CPU when CUDA is absent.
    Returns the warning's text, or None when there is nothing to warn about.
    """
    trainer = cfg.get("trainer") or {}
    accelerator = str(trainer.get("accelerator", "auto")).lower()
    if accelerator == "auto":
        import torch

        accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    devices = trainer.get("devices", "auto")
    if isinstance(devices, str) and devices.strip().isdigit():
        devices = int(devices)
    cpus = os.cpu_count() or 1
    if accelerator != "cpu" or isinstance(devices, bool) or not isinstance(devices, int) or devices <= cpus:
        return None
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn

    message = (
        f"trainer.devices={devices} on a CPU run, but this machine has {cpus} CPUs: oversubscription, "
        f"{devices / cpus:.2g} processes per CPU. The processes will time-share the cores, so training is "
        f"slower and its timings are meaningless; use trainer.devices<={cpus} for measurements."
    )
    rank_zero_warn(message, category=UserWarning)
    return message


def _apply_batch(cfg: Any) -> Any:
    """Derive the global batch from ``cfg.batch`` (any two of its keys) and write it into ``cfg`` before builds.

    The world size is ``trainer.devices x trainer.num_nodes`` (``"auto"`` is refused). Sets ``data.batch_size``
    to ``per_device`` and ``trainer.accumulate_grad_batches`` to ``accumulate``; an explicit
    ``trainer.accumulate_grad_batches`` (not 1, or given on the command line) that differs is refused, naming
    both. Logs the arithmetic on rank 0 and warns (once, rank 0) above 32k without LARS/LAMB. Returns the
    :class:`~lightning_sync.batch.BatchPlan`, or None when every ``batch`` key is null (nothing changes).
    ``global_size`` alone takes ``trainer.accumulate_grad_batches`` as the accumulation and derives the per-device
    batch. Every launch derives again, so a run resumed at another world size keeps its global batch.
    """
    keys = {k: v for k, v in (cfg.get("batch") or {}).items() if v is not None}
    if not keys:
        return None
    if set(keys) == {"global_size"}:  # the per-device batch follows the world size at the Trainer's accumulation
        keys["accumulate"] = cfg.trainer.get("accumulate_grad_batches", 1)
    from hydra.core.hydra_config import HydraConfig
    from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn
    from omegaconf import open_dict

    from lightning_sync.batch import derive_batch, large_batch_warning, world_size_of

    devices, nodes = cfg.trainer.get("devices", "auto"), cfg.trainer.get("num_nodes", 1)
    try:
        plan = derive_batch(world_size_of(devices, nodes), **keys)
    except ValueError as err:
        given = " ".join(f"batch.{k}={v}" for k, v in keys.items())
        raise ValueError(f"{given} with trainer.devices={devices!r} x trainer.num_nodes={nodes!r}: {err}") from None
    current = cfg.trainer.get("accumulate_grad_batches", 1)
    overrides = HydraConfig.get().overrides.task if HydraConfig.initialized() else []
    explicit = current != 1 or any(o.lstrip("+~").split("=")[0] == "trainer.accumulate_grad_batches" for o in overrides)
    if explicit and current != plan.accumulate:
        raise ValueError(
            f"trainer.accumulate_grad_batches={current} contradicts the batch config, which derives "
            f"accumulate {plan.accumulate} ({plan.describe()}): drop one, or make them agree"
        )
    with open_dict(cfg):
        cfg.data.batch_size = plan.per_device
        cfg.trainer.accumulate_grad_batches = plan.accumulate
    if rank_zero_only.rank == 0:
        log.info("batch: %s", plan.describe())
    # the optimizer's name: model.optimizer (what optim=lamb / optim=lars set); None for a model without one
    warning = large_batch_warning(plan.global_size, (cfg.get("model") or {}).get("optimizer"))
    if warning is not None:
        rank_zero_warn(warning, category=UserWarning)
    return plan


def _resume_from(ckpt_path: str | None, requeue: Any, trainer: Any) -> str | None:
    """The checkpoint to resume from: the newest complete one by its recorded step among the preemption
    checkpoints (``launch.signal``) and ``ckpt_path`` (``"last"``: the ModelCheckpoint's last checkpoints).

    A run preempted early, resumed and trained on has a newer ``last.ckpt`` than its preemption checkpoint, and
    a save killed before ``latest.json`` moved leaves a newer preemption checkpoint than the one named: neither
    may win by its kind or by the pointer. When no candidate is readable, ``ckpt_path`` goes to Lightning as
    given, which then says what is wrong with it."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_sync.launch.atomic import recover_dir, recover_path
    from lightning_sync.launch.requeue import latest_checkpoint, newest_checkpoint

    candidates: list[Path] = []
    if requeue is not None and (preempted := latest_checkpoint(requeue.directory)) is not None:
        candidates.append(preempted)
    # a replacement of a sharded checkpoint killed midway left its old copy aside: put it back first
    if ckpt_path == "last":
        for cb in trainer.checkpoint_callbacks:
            if isinstance(cb, ModelCheckpoint) and cb.dirpath is not None and Path(cb.dirpath).is_dir():
                recover_dir(cb.dirpath)
                candidates += sorted(Path(cb.dirpath).glob(f"{cb.CHECKPOINT_NAME_LAST}*{cb.FILE_EXTENSION}"))
    elif ckpt_path is not None:
        recover_path(ckpt_path)
        candidates.append(Path(ckpt_path))
    newest = newest_checkpoint(candidates)
    if newest is None:
        if ckpt_path == "last" and trainer.is_global_zero:
            if not any(isinstance(cb, ModelCheckpoint) for cb in trainer.checkpoint_callbacks):
                # a run directory's checkpoints/last.ckpt goes unseen: easy to miss when the fresh run trains well
                log.warning(
                    "ckpt_path=last looks for last.ckpt where the ModelCheckpoint writes, and this run has none "
                    "(trainer.enable_checkpointing=false)%s: training from scratch",
                    ", nor a preemption checkpoint" if requeue is not None else "",
                )
            else:
                log.info("ckpt_path=last: no complete checkpoint found, training from scratch")
        return None if ckpt_path == "last" else ckpt_path
    if trainer.is_global_zero:
        log.info(
            "resuming from %s (global step %d, the newest complete of %s; SLURM restart count %s)",
            newest[0],
            newest[1],
            [str(c) for c in candidates],
            os.environ.get("SLURM_RESTART_COUNT", "0"),
        )
    return str(newest[0])


def run_train(cfg: Any) -> dict[str, float]:
    """Build everything from ``cfg`` (a composed ``train.yaml``), fit, and return rank 0's final metrics."""
    import lightning.pytorch as pl
    from hydra.utils import instantiate
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    import lightning_sync  # noqa: F401 - registers the strategy names
    from lightning_sync.diagnostics import ConsistencyCheck
    from lightning_sync.launch import NodeBanner, prepare
    from lightning_sync.launch.requeue import Preempted, RequeueOnSignal

    _warn_oversubscription(cfg)
    plan = _apply_batch(cfg)  # batch.*: data.batch_size and trainer.accumulate_grad_batches, before either is built
    rendezvous = prepare()  # under SLURM: a MASTER_ADDR that resolves and a port from the job id
    pl.seed_everything(cfg.seed, workers=True)
    datamodule = instantiate(cfg.data, _convert_="all")
    model = instantiate(cfg.model, _convert_="all")  # plain lists and dicts: weights-only checkpoints load
    strategy = instantiate(cfg.strategy)
    plugins = []
    if SLURMEnvironment.detect():  # ranks from Slurm; requeue is ours (RequeueOnSignal), not Lightning's
        plugins.append(SLURMEnvironment(auto_requeue=False))
    # trainer.callbacks from the command line (+trainer.callbacks=[...]) first, then ours
    callbacks = [instantiate(spec) for spec in cfg.trainer.get("callbacks") or []]
    callbacks.append(ConsistencyCheck())  # ranks with another model or strategy fail at setup, not hang
    optim = cfg.get("optim") or {}
    if optim.get("lr_scaling", "none") != "none" or optim.get("warmup_steps", 0):
        # optim.*: LR scaling to the global batch and gradual warmup (a callback, outside any strategy)
        from lightning_sync.lr_rules import ScaledWarmup

        callbacks.append(
            ScaledWarmup(
                lr_scaling=optim.get("lr_scaling", "none"),
                base_batch_size=optim.get("base_batch_size"),
                global_batch_size=plan.global_size if plan is not None else None,
                warmup_steps=optim.get("warmup_steps", 0),
                warmup_start=optim.get("warmup_start", "base"),
            )
        )
    callbacks += [instantiate(spec) for spec in (cfg.get("diagnostics") or {}).values() if spec is not None]
    if cfg.get("checkpoint") and cfg.trainer.get("enable_checkpointing", True):
        callbacks.append(instantiate(cfg.checkpoint))
    trainer: pl.Trainer = instantiate(
        cfg.trainer, strategy=strategy, callbacks=callbacks, **({"plugins": plugins} if plugins else {})
    )
    if rendezvous is not None:
        trainer.callbacks.append(NodeBanner(rendezvous))
    requeue = None
    if cfg.launch.get("signal"):
        requeue = RequeueOnSignal(cfg.launch.checkpoint_dir, cfg.launch.signal, requeue=bool(cfg.launch.requeue))
        trainer.callbacks.append(requeue)
    resume = _resume_from(cfg.get("ckpt_path"), requeue, trainer)
    trainer.fit(model, datamodule=datamodule, ckpt_path=resume)
    if requeue is not None and requeue.preempted:
        if not requeue.requeue:
            said = "requeue off (launch.requeue=false): rerun the command to resume"
        else:
            said = "job requeued" if requeue.requeued else "job NOT requeued (see above)"
        # only rank 0 (which ran scontrol) has a message; the app logs a non-empty one
        raise Preempted(
            f"preempted at global step {trainer.global_step}: checkpoint {requeue.checkpoint}, {said}"
            if trainer.is_global_zero
            else ""
        )
    if cfg.get("final_checkpoint"):
        trainer.save_checkpoint(cfg.final_checkpoint)
    if cfg.final_validate:
        trainer.validate(model, datamodule=datamodule, verbose=False)
    metrics = _scalar_metrics(trainer.callback_metrics)
    if trainer.is_global_zero:
        summary = "  ".join(f"{k}={v:.4f}" for k, v in sorted(metrics.items()))
        log.info("final metrics (%d ranks, %d steps): %s", trainer.world_size, trainer.global_step, summary)
        if cfg.sample_chars and hasattr(model, "generate"):
            prompt = "The "
            sample = model.generate(prompt, max_new_tokens=int(cfg.sample_chars), seed=int(cfg.seed))
            log.info("sample:\n%s%s", prompt, sample)
    return metrics


def _train_app(cfg: Any) -> float | None:
    from omegaconf import OmegaConf

    from lightning_sync._extras import require_optimizer

    require_optimizer(OmegaConf.select(cfg, "model.optimizer"))  # before Lightning's import: a missing extra at once
    import torch.distributed as dist

    from lightning_sync.comms.watchdog import CollectiveError
    from lightning_sync.launch.requeue import Preempted

    env = dict(os.environ)
    _pin_child_command("train")
    if cfg.launch.get("fault_tolerant") and not _started_by_agent():
        return _train_under_agent(cfg)
    try:
        metrics = run_train(cfg)
    except CollectiveError as err:
        # The process group holds a request that can never complete, and gloo cannot cancel one: tearing the
        # group down would wait for the strategy's own timeout. Say why, then end the process, as torch's
        # NCCL watchdog does.
        log.error("%s: %s", type(err).__name__, err)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    except Preempted as stop:
        if str(stop):  # rank 0 says it once
            log.warning("%s", stop)
        if "SUBMITIT_EXECUTOR" in env:
            # submitit must not record a result for a job that was requeued (its own preemption path exits too)
            raise SystemExit(0) from None
        return None
    finally:
        # Lightning leaves the process group and MASTER_* behind; the next multirun job must start clean.
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(env)
    return metrics.get("val_loss")


def _started_by_agent() -> bool:
    from lightning_sync.comms.membership_keys import ENV_MEMBER

    return ENV_MEMBER in os.environ


def _train_under_agent(cfg: Any) -> None:
    """``launch.fault_tolerant=true``: this process becomes the fault-tolerance agent and starts
    ``trainer.devices`` ranks of this very job (its overrides and directory, pinned), which keep training when one
    is lost; it ends with their status."""
    from lightning_sync.launch.agent import Agent

    target = str(cfg.strategy.get("_target_", ""))
    if not target.endswith((".BucketedDDPStrategy", ".LocalSGDStrategy", ".DiLoCoStrategy", ".ShardedStrategy")):
        raise ValueError(
            f"launch.fault_tolerant=true keeps training through a lost rank with strategy=bucketed_ddp, local_sgd, "
            f"diloco or zero1/zero2/zero3; this job has {target!r}. Use one of those, or launch.fault_tolerant=false "
            f"(a failure then ends the job and a rerun resumes from its newest checkpoint)"
        )
    if cfg.launch.get("name") != "local":
        raise ValueError(
            f"launch.fault_tolerant=true with launch={cfg.launch.get('name')!r}: the train app starts the agent "
            f"only with launch=local; under Slurm run one `lightning-sync launch` a node (docs/reliability.md)"
        )
    devices, nodes = cfg.trainer.get("devices"), cfg.trainer.get("num_nodes", 1)
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1 or nodes != 1:
        raise ValueError(
            f"launch.fault_tolerant=true starts trainer.devices ranks on this node: it needs an int >= 1 and "
            f"trainer.num_nodes=1, got devices={devices!r}, num_nodes={nodes!r} (on more nodes, run one "
            f"`lightning-sync launch --node k --nnodes N` a node: see docs/reliability.md)"
        )
    from hydra.core.hydra_config import HydraConfig

    # this job (its overrides, pinned by _pin_child_command) in this job's directory, as Lightning's own launcher
    # runs ranks > 0; only this process writes the job's config there
    run_dir = HydraConfig.get().runtime.output_dir
    command = [sys.executable, "-m", "lightning_sync", *sys.argv[1:], f'hydra.run.dir="{run_dir}"']
    command.append("hydra.output_subdir=null")
    status = Agent(command, devices, max_restarts=int(cfg.launch.get("max_restarts", 0))).run()
    if status:
        raise SystemExit(status)


def _bench_app(cfg: Any) -> None:
    from hydra.core.hydra_config import HydraConfig

    from lightning_sync.bench.rows import require_plots

    require_plots(cfg)  # before the runners' imports (Lightning), so a missing extra is named at once
    from lightning_sync.bench.app import run_bench

    run_bench(cfg, Path(HydraConfig.get().runtime.output_dir))


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point: ``lightning-sync <subcommand> [args...]``."""
    from lightning_sync import cli_help

    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        sys.stdout.write(cli_help.top_level_help())
        return
    sub = args.pop(0)
    if sub not in SUBCOMMANDS:
        raise SystemExit(f"lightning-sync: unknown subcommand {sub!r}; allowed: {list(SUBCOMMANDS)}")
    wants_help = any(arg in ("-h", "--help") for arg in args)
    if sub == "sbatch":  # renders a script from the composed config; not a Hydra run (no output directory)
        from lightning_sync.launch.sbatch import main as sbatch_main

        sbatch_main(args)
        if wants_help:  # sbatch composes train's config: its groups and overrides are train's
            groups = cli_help.groups_text(cli_help.APPS[sub])
            sys.stdout.write(f"\nConfig groups (group=option; * marks the default):\n{groups}\n\n")
            sys.stdout.write(f"{cli_help.overrides_text()}\n")
        return
    if sub == "launch":  # starts any command's ranks under the fault-tolerance agent; no config
        from lightning_sync.launch.agent import main as agent_main

        raise SystemExit(agent_main(args, prog="lightning-sync launch"))
    if sub == "consolidate":  # reads a checkpoint directory and writes a file; no config
        from lightning_sync.consolidate import main as consolidate_main

        consolidate_main(args)
        return
    if wants_help:  # Hydra's help, listing this app's own config groups (cli_help.use_app_help)
        args.insert(0, cli_help.use_app_help(sub))  # before every override: argparse takes one run of them
    import hydra

    sys.argv = [sys.argv[0], *args]  # Hydra parses sys.argv
    task = {"train": _train_app, "bench": _bench_app}[sub]
    app = hydra.main(config_path=config_dir(), config_name=sub, version_base="1.3")(task)
    app()


if __name__ == "__main__":
    main()
