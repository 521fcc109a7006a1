"""What ``lightning-sync --help`` and each subcommand's ``--help`` print: the subcommands, the config groups
each Hydra app composes, and the overrides most runs set.

The groups are read from the shipped config itself (the ``defaults`` list of ``train.yaml`` / ``bench.yaml``,
and the YAML files of each group's directory), so the help cannot list a strategy or model that is not
there. Hydra's own ``--help`` lists every group of the config directory for every app (``suite``, which only
``bench`` composes, under ``train`` too); :func:`use_app_help` gives ``train --help`` and ``bench --help``
a help template that lists the app's own groups instead, and keeps Hydra's composed config below them.
"""

from __future__ import annotations

from pathlib import Path

from lightning_sync._config import config_dir

__all__ = [
    "APPS",
    "COMMON_OVERRIDES",
    "HYDRA_FLAGS",
    "SUBCOMMAND_SUMMARY",
    "config_groups",
    "groups_text",
    "top_level_help",
    "use_app_help",
]

SUBCOMMAND_SUMMARY = {
    "train": "train a model with a lightning_sync strategy on trainer.devices ranks (Hydra app, conf/train.yaml)",
    "bench": "run the strategies side by side on the same models; report and plots (Hydra app, conf/bench.yaml)",
    "sbatch": "print the SLURM batch script of a train config (takes train's groups and overrides)",
    "consolidate": "write one plain Lightning checkpoint file from a ZeRO sharded checkpoint directory",
    "launch": "start N ranks of any training script that keep training when one is lost (bucketed_ddp)",
}

APPS = {"train": "train", "bench": "bench", "sbatch": "train"}
"""Which config each subcommand composes (sbatch renders the train config's job)."""

COMMON_OVERRIDES = (
    ("trainer.devices=2", "ranks per node (CPU processes or GPUs)"),
    ("trainer.num_nodes=1", "nodes (with launch=slurm: launch.nodes)"),
    ("trainer.accelerator=cpu", "cpu, gpu or auto"),
    ("trainer.max_steps=50", "stop after this many optimizer steps (-1: trainer.max_epochs decides)"),
    ("trainer.max_epochs=15", "stop after this many epochs"),
    ("batch.global_size=256", "samples per optimizer step over all ranks; derives data.batch_size and accumulation"),
    ("ckpt_path=last", "resume: last (checkpoint.dirpath's last.ckpt) or a path; null trains from scratch"),
    ("checkpoint.every_n_train_steps=100", "also checkpoint every this many steps (mid-epoch, exact resume)"),
    ("final_checkpoint=model.ckpt", "save the trained model here after fit"),
    ("seed=0", "seeds the model, the data order and every rank's RNG"),
    ("launch.fault_tolerant=true", "keep training when a rank is lost (bucketed_ddp, zero*; the agent starts ranks)"),
    ("launch.max_restarts=3", "with fault_tolerant: lost ranks started again, in all; each heals from a live peer"),
)
"""``key=example value`` and what it does: the train overrides most runs set (``--cfg job`` shows every key)."""

HYDRA_FLAGS = (
    ("-m", "multirun: one job per value of a comma list, e.g. -m strategy=zero2,zero3"),
    ("--cfg job", "print the composed config and exit"),
    ("--help", "this app's groups and its composed config (with any overrides given before it)"),
)


def config_groups(app: str) -> list[tuple[str, list[str], str | None]]:
    """``(group, options, default)`` for each config group in the ``defaults`` list of ``<app>.yaml``, in its
    order; the options are the group directory's YAML files."""
    from omegaconf import OmegaConf

    root = Path(config_dir())
    out = []
    for entry in OmegaConf.to_container(OmegaConf.load(root / f"{app}.yaml")).get("defaults", []):  # type: ignore[union-attr]
        if not isinstance(entry, dict):
            continue  # _self_
        for key, default in entry.items():
            group = key.removeprefix("optional ").split("@")[0]
            options = sorted(p.stem for p in (root / group).glob("*.yaml"))
            out.append((group, options, default))
    return out


def groups_text(app: str, indent: str = "  ") -> str:
    """One line per config group of ``app``: ``group: option, default*, ...`` (``*`` marks the default)."""
    lines = []
    for group, options, default in config_groups(app):
        listed = ", ".join(f"{o}*" if o == default else o for o in options)
        lines.append(f"{indent}{group}: {listed}")
    return "\n".join(lines)


def _pairs(rows: tuple[tuple[str, str], ...], indent: str = "  ") -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{indent}{k.ljust(width)}  {v}" for k, v in rows)


def overrides_text() -> str:
    """The common train overrides and the Hydra flags, as the top-level help and ``sbatch --help`` show them."""
    return (
        f"Common overrides (key=value; `lightning-sync train --cfg job` shows every key):\n{_pairs(COMMON_OVERRIDES)}\n"
        f"\nHydra flags (train, bench):\n{_pairs(HYDRA_FLAGS)}"
    )


def top_level_help() -> str:
    """``lightning-sync --help``: the subcommands, one line each, the groups of each app, the common overrides."""
    subs = "\n".join(f"  {name.ljust(12)} {line}" for name, line in SUBCOMMAND_SUMMARY.items())
    return (
        f"usage: lightning-sync {{{','.join(SUBCOMMAND_SUMMARY)}}} [args...]\n"
        f"       lightning-sync <subcommand> --help   (that subcommand's groups, config and options)\n\n"
        f"Subcommands:\n{subs}\n\n"
        f"Config groups of train and sbatch (group=option; * marks the default):\n{groups_text('train')}\n\n"
        f"Config groups of bench:\n{groups_text('bench')}\n\n"
        f"{overrides_text()}\n"
    )


def use_app_help(app: str) -> str:
    """Register a Hydra help template for ``app`` that lists its own config groups (and, for train, the
    common overrides) above Hydra's composed config; return the override that selects it
    (``hydra/help=...``), for the command line of a ``--help`` run."""
    from hydra.core.config_store import ConfigStore

    sections = (
        "== Configuration groups ==\nCompose your configuration from those groups (group=option; * marks the default)"
        f"\n\n{groups_text(app, indent='')}\n\n"
    )
    if app == "train":
        sections += f"== Common overrides ==\n{_pairs(COMMON_OVERRIDES, indent='')}\n\n"
    name = f"lightning_sync_{app}"
    template = (
        "${hydra.help.header}\n"
        + sections.replace("$", "$$")
        + "== Config ==\nOverride anything in the config (foo.bar=value)\n\n$CONFIG\n\n${hydra.help.footer}"
    )
    ConfigStore.instance().store(
        group="hydra/help",
        name=name,
        node={
            "app_name": f"lightning-sync {app}",
            "header": f"== lightning-sync {app} ==",
            "footer": "Use --hydra-help to view Hydra specific help",
            "template": template,
        },
        provider="lightning_sync",
    )
    return f"hydra/help={name}"
