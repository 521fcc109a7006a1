"""Loading a ZeRO-3 checkpoint at another world size: the time against a same-size load, and the peak memory.

The bench's wide model with AdamW, saved at ``--world`` and ``--from-world`` ranks, is loaded at ``--world`` ranks
from each, alternating so that a noisy machine's drift falls on both. A load's time is its slowest rank's; its
memory the largest rise of a rank's resident set above what it held before (freed heap returned first, the
kernel's peak reset). Each load starts as a resuming process does, with no optimizer state::

    python -m lightning_sync.bench.reshard --world 3 --from-world 2 --rounds 5
"""

from __future__ import annotations

import ctypes
import tempfile
import time
import warnings
from dataclasses import dataclass

import torch

from lightning_sync.bench.rows import counts_cli, spread

__all__ = ["ReshardRow", "measure", "report"]


@dataclass(frozen=True)
class ReshardRow:
    """One kind of load over the rounds: seconds (median, min, max) and the largest peak rise of a rank."""

    load: str
    saved_world: int
    median_s: float
    min_s: float
    max_s: float
    peak_mib: float


def _engine(world: int, in_features: int) -> tuple[torch.optim.Optimizer, object]:
    from lightning_sync import comms
    from lightning_sync.models.synthetic import WideMLP
    from lightning_sync.sync.zero.engine import ZeroEngine

    torch.manual_seed(0)
    net = WideMLP(in_features=in_features).net
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    engine = ZeroEngine(net, opt, comms.CommContext(), stage=3)
    engine.gather_root()
    net(torch.randn(4, in_features)).sum().backward()
    opt.step()  # the moments exist: a checkpoint holds them
    return opt, engine


def _save(rank: int, world: int, path: str, in_features: int) -> None:
    from lightning_sync.sync.zero import save_sharded

    _, engine = _engine(world, in_features)
    save_sharded(engine, path)  # type: ignore[arg-type]


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(ln for ln in f if ln.startswith(f"{field}:")).split()[1]) * 1024


def _load(rank: int, world: int, paths: dict[str, str], rounds: int, in_features: int) -> dict[str, list[float]]:
    from lightning_sync.sync.zero import load_sharded

    torch.set_num_threads(1)
    opt, engine = _engine(world, in_features)
    libc = ctypes.CDLL("libc.so.6")
    load_sharded(engine, paths["same"])  # type: ignore[arg-type]  # DCP's first-call imports, outside
    out: dict[str, list[float]] = {f"{k}/{m}": [] for k in paths for m in ("s", "peak")}
    for _ in range(rounds):
        for kind, path in paths.items():
            opt.state.clear()  # as in a resuming process: the load allocates this rank's optimizer state
            libc.malloc_trim(0)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # the resident-set peak (VmHWM) starts again from now
            before = _status("VmRSS")
            torch.distributed.barrier()
            start = time.perf_counter()
            load_sharded(engine, path)  # type: ignore[arg-type]
            out[f"{kind}/s"].append(time.perf_counter() - start)
            out[f"{kind}/peak"].append(float(_status("VmHWM") - before))
    return out


def measure(world: int = 3, from_world: int = 2, rounds: int = 5, in_features: int = 1024) -> list[ReshardRow]:
    """Save the wide model's ZeRO-3 state at ``world`` and at ``from_world`` ranks, then load each back at
    ``world`` ranks ``rounds`` times, alternating; rows for the two loads."""
    from lightning_sync.testing.harness import run_distributed

    warnings.filterwarnings("ignore")
    with tempfile.TemporaryDirectory() as tmp:
        paths = {"same": f"{tmp}/world{world}", "reshard": f"{tmp}/world{from_world}"}
        for w, path in ((world, paths["same"]), (from_world, paths["reshard"])):
            run_distributed(_save, w, path, in_features, timeout=300)
        per_rank = run_distributed(_load, world, paths, rounds, in_features, timeout=300 + 60 * rounds)
    rows = []
    for kind, saved in (("same", world), ("reshard", from_world)):
        # a load is done when its slowest rank is: the round's time is the maximum over ranks
        times = [max(r[f"{kind}/s"][i] for r in per_rank) for i in range(rounds)]
        peak = max(max(r[f"{kind}/peak"]) for r in per_rank) / 2**20
        rows.append(ReshardRow(kind, saved, *spread(times), peak))
    return rows


def report(rows: list[ReshardRow], world: int, in_features: int) -> str:
    """A Markdown table of the rows, with what the model, its optimizer state and a rank's shard weigh."""
    from lightning_sync.models.synthetic import WideMLP

    with torch.device("meta"):
        values = sum(p.numel() for p in WideMLP(in_features=in_features).parameters())
    model, shard = values * 4 / 2**20, 3 * values * 4 / world / 2**20  # fp32 weights; weights + AdamW moments
    lines = [
        f"wide model: {values / 1e6:.1f}M values, {model:.1f} MiB of fp32 weights; one rank's shard of weights "
        f"and AdamW moments at {world} ranks: {shard:.1f} MiB",
        "",
        "| load | written at | median s | min - max | / same | peak rise MiB |",
        "|---|---|---|---|---|---|",
    ]
    same = next(r.median_s for r in rows if r.load == "same")
    for r in rows:
        lines.append(
            f"| {r.load} | {r.saved_world} ranks | {r.median_s:.3f} | {r.min_s:.3f} - {r.max_s:.3f} | "
            f"{r.median_s / same:.2f} | {r.peak_mib:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    options = {"world": (3, "ranks that load"), "from_world": (2, "ranks that wrote the resharded one")}
    options |= {"rounds": (5, "alternating rounds"), "in_features": (1024, "WideMLP's width, the bench's")}
    same = "--from-world must differ from --world ({}): that load is the 'same' row"
    args = counts_cli(__doc__, argv, lambda a: same.format(a.world) if a.world == a.from_world else None, **options)
    print(report(measure(args.world, args.from_world, args.rounds, args.in_features), args.world, args.in_features))


if __name__ == "__main__":
    main()
