"""Large-batch benchmark: global batch 64 against 16x (1024) on 2 CPU ranks.

Every run goes through the real CLI (``lightning-sync train``, one subprocess per run, ``trainer.devices=2``)
and the final validation metric is read back from the ``final metrics`` line rank 0 prints (falling back
to the last row of ``logs/version_0/metrics.csv``). Models and metrics:

- ``digits_mlp``: ``val_acc`` (higher is better);
- ``char_gpt``: ``val_loss`` (lower is better).

Settings, each at global 64 and 1024 with the same number of epochs:

1. ``none``: the model's own LR at both batch sizes;
2. ``linear``: ``optim.lr_scaling=linear optim.base_batch_size=64`` (LR x 16 at 1024), no warmup;
3. ``linear_warmup``: as 2 plus ``optim.warmup_steps=N`` (ramp from the unscaled LR);
4. ``lamb``: ``optim=lamb``, no LR scaling, no warmup (LAMB's layer-wise trust ratio is meant to make the
   same LR work at both batch sizes).

At global 64 the scaling factor is k = 1, so settings 2 and 3 are the same run as setting 1 (scaled LR =
LR, warmup from LR/k = LR to LR); they are not run again unless ``--run-noop`` is given, and the table
marks them ``= (1)``.

Writes ``large_batch.md`` (table), ``large_batch.json`` (raw numbers, commands, versions, CPU, date)
and ``large_batch.png`` (grouped bars) into ``--out`` (default ``docs/bench/large_batch``).

    python examples/large_batch.py                       # the whole grid (about 10 minutes on 2 cores)
    python examples/large_batch.py --models digits_mlp   # one model
    python examples/large_batch.py --render-only         # redraw md/png from an existing json
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SETTINGS = ["none", "linear", "linear_warmup", "lamb"]
SETTING_LABELS = {
    "none": "(1) no scaling",
    "linear": "(2) linear scaling",
    "linear_warmup": "(3) linear + warmup",
    "lamb": "(4) LAMB",
}
BASE_BATCH = 64
LARGE_BATCH = 1024  # 16 x 64
WORLD = 2

# Per-model knobs. Identical across every run of a model, whatever the batch size or setting.
MODELS: dict[str, dict] = {
    "digits_mlp": {
        "metric": "val_acc",
        "higher_is_better": True,
        "epochs": 15,  # the model's default epoch budget
        "warmup_steps": 5,  # of ~30 optimizer steps at global 1024 (2 per epoch)
        "lamb_lr": None,  # optim=lamb's own 0.02, tuned for digits_mlp at global 64
        "extra": ["model=digits_mlp"],
    },
    "char_gpt": {
        "metric": "val_loss",
        "higher_is_better": False,
        "epochs": 6,
        "warmup_steps": 8,  # of ~42 optimizer steps at global 1024 (7 per epoch)
        "lamb_lr": 0.01,  # between AdamW's 3e-3 and digits' LAMB 0.02 (not tuned)
        # char_gpt's own config is step-based (max_steps 300, val every 100 steps): switch to epochs.
        "extra": [
            "model=char_gpt",
            "trainer.max_steps=-1",
            "trainer.val_check_interval=1.0",
            "trainer.check_val_every_n_epoch=1",
        ],
    },
}

# per_device x world x accumulate = global.
BATCH_ARGS = {
    BASE_BATCH: ["batch.global_size=64", "batch.per_device=32"],  # accumulate 1
    LARGE_BATCH: [
        "batch.global_size=1024",
        "batch.per_device=256",
    ],  # accumulate 2 (derived)
}

COMMON = [
    f"trainer.devices={WORLD}",
    "trainer.enable_progress_bar=false",
    "trainer.enable_checkpointing=false",
    "sample_chars=0",
    "seed=0",
]

FINAL_RE = re.compile(r"final metrics \((\d+) ranks, (\d+) steps\): (.*)$", re.MULTILINE)


def setting_args(model: str, setting: str) -> list[str]:
    spec = MODELS[model]
    if setting == "none":
        return []
    if setting == "linear":
        return ["optim.lr_scaling=linear", f"optim.base_batch_size={BASE_BATCH}"]
    if setting == "linear_warmup":
        return [
            "optim.lr_scaling=linear",
            f"optim.base_batch_size={BASE_BATCH}",
            f"optim.warmup_steps={spec['warmup_steps']}",
        ]
    if setting == "lamb":
        args = ["optim=lamb"]
        if spec["lamb_lr"] is not None:
            args.append(f"model.lr={spec['lamb_lr']}")
        return args
    raise ValueError(setting)


def find_cli() -> str:
    local = REPO / ".venv" / "bin" / "lightning-sync"
    if local.exists():
        return str(local)
    found = shutil.which("lightning-sync")
    if found is None:
        sys.exit("lightning-sync not found: install the package (pip install -e .[dev])")
    return found


def parse_final(text: str) -> tuple[dict[str, float], int | None]:
    matches = FINAL_RE.findall(text)
    if not matches:
        return {}, None
    _, steps, summary = matches[-1]
    metrics = {}
    for item in summary.split():
        if "=" in item:
            key, value = item.split("=", 1)
            try:
                metrics[key] = float(value)
            except ValueError:
                pass
    return metrics, int(steps)


def parse_csv(run_dir: Path) -> dict[str, float]:
    """The last non-empty value of every column in logs/version_0/metrics.csv."""
    path = run_dir / "logs" / "version_0" / "metrics.csv"
    if not path.exists():
        return {}
    import csv

    last: dict[str, float] = {}
    with path.open() as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if value not in ("", None):
                    try:
                        last[key] = float(value)
                    except ValueError:
                        pass
    return last


def run_one(cli: str, model: str, batch: int, setting: str, root: Path) -> dict:
    spec = MODELS[model]
    run_dir = root / f"{model}_{batch}_{setting}"
    cmd = (
        [cli, "train"]
        + spec["extra"]
        + COMMON
        + [f"trainer.max_epochs={spec['epochs']}"]
        + BATCH_ARGS[batch]
        + setting_args(model, setting)
        + [f"hydra.run.dir={run_dir}"]
    )
    print(
        f"[large_batch] {model} global={batch} {setting}: {' '.join(cmd[1:])}",
        flush=True,
    )
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    out = proc.stdout + proc.stderr
    (run_dir).mkdir(parents=True, exist_ok=True)
    (run_dir / "console.log").write_text(out)
    final, steps = parse_final(out)
    csv_last = parse_csv(run_dir)
    metric = spec["metric"]
    value = final.get(metric, csv_last.get(metric))
    record = {
        "model": model,
        "global_batch": batch,
        "setting": setting,
        "metric": metric,
        "value": value,
        "final_metrics": final,
        "csv_last": csv_last,
        "optimizer_steps": steps,
        "returncode": proc.returncode,
        "wall_s": round(wall, 1),
        "command": "lightning-sync " + " ".join(cmd[1:-1]),  # without the temp hydra.run.dir
    }
    if proc.returncode != 0 or value is None:
        record["error_tail"] = out[-3000:]
        print(
            f"[large_batch]   FAILED (rc={proc.returncode}); tail:\n{out[-1500:]}",
            flush=True,
        )
    else:
        print(
            f"[large_batch]   {metric}={value:.4f} steps={steps} wall={wall:.1f}s",
            flush=True,
        )
    return record


def environment(cli: str) -> dict:
    python = Path(cli).with_name("python")
    versions = {}
    packages = ("torch", "lightning", "pytorch-optimizer", "lightning-sync")
    probe = f"import importlib.metadata as m, json; print(json.dumps({{p: m.version(p) for p in {packages!r}}}))"
    try:
        versions = json.loads(
            subprocess.run([str(python), "-c", probe], capture_output=True, text=True, check=True).stdout
        )
    except Exception as exc:  # noqa: BLE001 - informational only
        versions = {"error": repr(exc)}
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "versions": versions,
        "python": platform.python_version(),
        "cpu_model": cpu,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
    }


def lookup(runs: list[dict], model: str, batch: int, setting: str) -> tuple[float | None, bool]:
    """(value, is_noop_copy): settings 2 and 3 at global 64 fall back to setting 1 when not run."""
    for r in runs:
        if (r["model"], r["global_batch"], r["setting"]) == (model, batch, setting):
            return r["value"], False
    if batch == BASE_BATCH and setting in ("linear", "linear_warmup"):
        for r in runs:
            if (r["model"], r["global_batch"], r["setting"]) == (model, batch, "none"):
                return r["value"], True
    return None, False


def render_md(data: dict, path: Path) -> None:
    runs = data["runs"]
    lines = [
        "# Large-batch benchmark",
        "",
        (
            f"Generated by `{data['reproduce']}` on {data['date_utc']} "
            f"({data['env']['cpu_model']}, {data['env']['cpu_count']} CPUs; "
            f"torch {data['env']['versions'].get('torch')}, lightning {data['env']['versions'].get('lightning')}). "
            f"2 ranks (`trainer.devices=2`, `bucketed_ddp`), seed 0, "
            f"one run per cell. Total wall time {data['total_wall_s'] / 60:.1f} min."
        ),
        "",
    ]
    if data.get("partial"):
        lines += ["**PARTIAL: not every run finished; empty cells were not run.**", ""]
    lines += [
        (
            "Final validation metric (rank 0's final `trainer.validate`). `digits_mlp`: val_acc, higher is better; "
            "`char_gpt`: val_loss, lower is better. `= (1)`: at global 64 the scaling factor is 1, so the run is "
            "identical to setting (1) and was not repeated."
        ),
        "",
        "| model (metric) | setting | global 64 | global 1024 | change |",
        "|---|---|---|---|---|",
    ]
    for model in data["models"]:
        spec = data["model_knobs"][model]
        arrow = "higher better" if spec["higher_is_better"] else "lower better"
        for setting in SETTINGS:
            small, noop = lookup(runs, model, BASE_BATCH, setting)
            large, _ = lookup(runs, model, LARGE_BATCH, setting)
            s = "" if small is None else f"{small:.4f}" + (" = (1)" if noop else "")
            l_ = "" if large is None else f"{large:.4f}"
            d = "" if small is None or large is None else f"{large - small:+.4f}"
            lines.append(f"| {model} ({spec['metric']}, {arrow}) | {SETTING_LABELS[setting]} | {s} | {l_} | {d} |")
    lines += ["", "Knobs (identical across all runs of a model):", ""]
    for model in data["models"]:
        spec = data["model_knobs"][model]
        lamb_lr = spec["lamb_lr"] if spec["lamb_lr"] is not None else "0.02 (optim=lamb's own)"
        lines.append(
            f"- `{model}`: {spec['epochs']} epochs at both batch sizes; warmup (3) {spec['warmup_steps']} optimizer "
            f"steps; LAMB lr {lamb_lr}, unscaled at both batch sizes; overrides `{' '.join(spec['extra'])}`."
        )
    lines += [
        (
            "- global 64: `batch.global_size=64 batch.per_device=32` (accumulate 1); global 1024: "
            "`batch.global_size=1024 batch.per_device=256` (accumulate 2, derived)."
        ),
        (
            "- (2)/(3): `optim.lr_scaling=linear optim.base_batch_size=64` (LR x16 at 1024); (3) adds "
            "`optim.warmup_steps=N` ramping from the unscaled LR."
        ),
        "",
        "Optimizer steps and wall time per run:",
        "",
        "| model | global | setting | steps | wall s |",
        "|---|---|---|---|---|",
    ]
    for r in runs:
        lines.append(
            f"| {r['model']} | {r['global_batch']} | {r['setting']} | {r['optimizer_steps']} | {r['wall_s']} |"
        )
    lines += [
        "",
        "Exact commands are in `large_batch.json` (`runs[].command`, plus `hydra.run.dir=<tmp>`).",
        "",
    ]
    path.write_text("\n".join(lines))


def render_png(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = data["models"]
    fig, axes = plt.subplots(
        1, len(models), figsize=(min(6.5 * len(models), 12.0), 4.6), squeeze=False
    )  # <= 1560 px at 130 dpi
    colors = {BASE_BATCH: "#4c72b0", LARGE_BATCH: "#dd8452"}
    width = 0.38
    for ax, model in zip(axes[0], models):
        spec = data["model_knobs"][model]
        xs = range(len(SETTINGS))
        all_vals = []
        for j, batch in enumerate((BASE_BATCH, LARGE_BATCH)):
            vals, hatches = [], []
            for setting in SETTINGS:
                v, noop = lookup(data["runs"], model, batch, setting)
                vals.append(v)
                hatches.append("//" if noop else "")
            all_vals += [v for v in vals if v is not None]
            for i, (v, h) in enumerate(zip(vals, hatches)):
                if v is None:
                    continue
                x = i + (j - 0.5) * width
                ax.bar(
                    x,
                    v,
                    width,
                    color=colors[batch],
                    hatch=h,
                    edgecolor="white" if not h else "#2a4a80",
                    label=f"global {batch}" if i == 0 else None,
                )
                ax.annotate(
                    f"{v:.3f}",
                    (x, v),
                    ha="center",
                    va="bottom",
                    fontsize=8,
                    xytext=(0, 2),
                    textcoords="offset points",
                )
        ax.set_xticks(list(xs))
        ax.set_xticklabels([SETTING_LABELS[s] for s in SETTINGS], fontsize=9)
        better = "higher is better" if spec["higher_is_better"] else "lower is better"
        ax.set_ylabel(f"final {spec['metric']} ({better})")
        ax.set_title(f"{model}: {spec['epochs']} epochs, 2 ranks")
        if all_vals:
            top = max(all_vals)
            ax.set_ylim(0, top * 1.25)
        handles, labels = ax.get_legend_handles_labels()
        seen = {}
        for h, l_ in zip(handles, labels):
            seen.setdefault(l_, h)
        ax.legend(
            seen.values(),
            seen.keys(),
            loc="upper center",
            ncol=2,
            fontsize=8,
            framealpha=0.9,
        )
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(
        "Final validation metric: global batch 64 vs 1024 (hatched: k=1, same run as no scaling)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def render(data: dict, out: Path) -> None:
    render_md(data, out / "large_batch.md")
    render_png(data, out / "large_batch.png")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "bench" / "large_batch")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument(
        "--run-noop",
        action="store_true",
        help="also run settings 2 and 3 at global 64 (identical to setting 1: k = 1)",
    )
    parser.add_argument(
        "--render-only",
        action="store_true",
        help="redraw md and png from the existing json",
    )
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep the per-run Hydra directories (printed)",
    )
    args = parser.parse_args(argv)

    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / "large_batch.json"
    if args.render_only:
        render(json.loads(json_path.read_text()), args.out)
        return

    cli = find_cli()
    reproduce = (
        "python examples/large_batch.py"
        + ("" if args.models == list(MODELS) else " --models " + " ".join(args.models))
        + (" --run-noop" if args.run_noop else "")
    )
    data = {
        "issue": 9,
        "reproduce": reproduce,
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "env": environment(cli),
        "world": WORLD,
        "models": args.models,
        "model_knobs": {m: MODELS[m] for m in args.models},
        "batch_args": {str(k): v for k, v in BATCH_ARGS.items()},
        "common_args": COMMON,
        "runs": [],
        "partial": True,
        "total_wall_s": 0.0,
    }
    root = Path(tempfile.mkdtemp(prefix="large_batch_"))
    start = time.perf_counter()
    try:
        for model in args.models:
            for batch in (BASE_BATCH, LARGE_BATCH):
                for setting in SETTINGS:
                    if batch == BASE_BATCH and setting in ("linear", "linear_warmup") and not args.run_noop:
                        continue
                    data["runs"].append(run_one(cli, model, batch, setting, root))
                    data["total_wall_s"] = round(time.perf_counter() - start, 1)
                    json_path.write_text(json.dumps(data, indent=2) + "\n")
                    render(data, args.out)
        data["partial"] = any(r["value"] is None for r in data["runs"])
    finally:
        data["total_wall_s"] = round(time.perf_counter() - start, 1)
        json_path.write_text(json.dumps(data, indent=2) + "\n")
        render(data, args.out)
        if args.keep:
            print(f"[large_batch] run directories kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    print(f"[large_batch] wrote {args.out}/large_batch.{{md,json,png}} in {data['total_wall_s'] / 60:.1f} min")


if __name__ == "__main__":
    main()
