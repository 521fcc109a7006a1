r"""The communication cost model: fixed, calibrated link parameters, priced traffic, projection to K ranks.

K ranks, S payload bytes, ``a`` seconds per message, ``b`` seconds per byte of a link, N = K / G nodes of G ranks.
All-reduce: ring and tree as in :mod:`~lightning_sync.bench.formulas` (the backend's in the ring's form, with
gloo's or NCCL's effective a and b); hierarchical, a tree to the node leader and back plus a ring among the N
leaders. Every other op costs :data:`OP_COST`. A step's :class:`Traffic` (calls and payload P per op, measured at
K0; shard payloads scale as K0 / K)::

    T_comm(K) = sum over ops of  calls * messages(K) * a + wire(K) * P(K) * b
    T_step(K) = c(K) T_comp + T_comm(K),   c(K) = max(1, K threads / cores)

No overlap is priced: compute and communication compete for the same cores. :class:`CostParams` holds per
swept op one link fitted to every calibrated K together and one per K alone (time-sharing changes a link with
K); ``bench mode=calibrate`` stores them, a report reads them (else :data:`DEFAULT_PARAMS`) and never refits.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lightning_sync._checks import check_choice, check_int
from lightning_sync.bench.formulas import overlapped_step_time, ring_allreduce_time, tree_allreduce_time, tree_depth
from lightning_sync.bench.rows import median

__all__ = ["CostParams", "DEFAULT_PARAMS", "Fabric", "H100_NDR400", "Link", "SweepPoint", "Traffic"]
__all__ += ["calibrate", "load_params", "project"]

#: All-reduce algorithms the model knows (a projection prices all but the backend's).
ALGORITHMS = ("backend", "ring", "tree", "hierarchical")

#: Per op: ``K -> (messages, wire bytes per payload byte)``; an op not listed costs one message and its payload.
OP_COST: dict[str, Callable[[int], tuple[float, float]]] = {
    "all_reduce": lambda k: (2 * (k - 1), 2 * (k - 1) / k),
    "reduce_scatter": lambda k: (k - 1, (k - 1) / k),
    **dict.fromkeys(("all_gather", "gather", "scatter", "metadata"), lambda k: (k - 1, k - 1)),
    "broadcast": lambda k: (tree_depth(k), tree_depth(k)),
    "send": lambda k: (1, 1),
    "recv": lambda k: (0, 0),
    "barrier": lambda k: (tree_depth(k), 0),
}
#: The backend's own all-gather and reduce-scatter (what FSDP2 calls): the payload and traffic of their twin.
TORCH_TWINS = {"torch_all_gather": "all_gather", "torch_reduce_scatter": "reduce_scatter"}
OP_COST.update({op: OP_COST[twin] for op, twin in TORCH_TWINS.items()})
#: Bytes a rank puts on the wire per recorded payload byte, averaged over ranks (the report's ring wire bytes):
#: the op's cost factor, except that the one-to-many ops spread the root's ``K-1`` parts over K ranks.
WIRE_FACTORS: dict[str, Callable[[int], float]] = {
    **{op: (lambda k, f=f: float(f(k)[1])) for op, f in OP_COST.items()},
    **dict.fromkeys(("broadcast", "gather", "scatter"), lambda k: (k - 1) / k),
}
#: Ops whose payload per rank is a 1/K shard of a fixed whole.
SHARD_OPS = frozenset({"all_gather", "torch_all_gather", "scatter"})
#: What the calibration sweep measures (:mod:`lightning_sync.bench.sweep`), each with its own link.
SWEPT = ("backend", "ring", "tree", "all_gather", "reduce_scatter", "torch_all_gather", "torch_reduce_scatter")


@dataclass(frozen=True)
class Link:
    """One link's latency ``alpha`` (s per message) and inverse bandwidth ``beta`` (s per byte)."""

    alpha: float
    beta: float
    source: str = ""
    """Where the numbers come from (a fit, a data sheet, an assumption)."""

    def __post_init__(self) -> None:
        for name in ("alpha", "beta"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"Link.{name} must be a finite number >= 0, got {v!r}")

    @property
    def bandwidth(self) -> float:
        """Bytes per second (inf for beta 0)."""
        return 1.0 / self.beta if self.beta else math.inf


@dataclass(frozen=True)
class Fabric:
    """Ranks grouped ``ranks_per_node`` to a node: ``intra`` links inside a node, ``inter`` between nodes."""

    name: str
    intra: Link
    inter: Link
    ranks_per_node: int
    op_links: Mapping[str, Link] = field(default_factory=dict)  # one op's own link (gloo's all-gather differs)

    def __post_init__(self) -> None:
        check_int("ranks_per_node", self.ranks_per_node, 1)


#: A DGX-H100-like node of 8 GPUs, peak bandwidths per direction: NVLink 4 450 GB/s (900 both ways, H100 data
#: sheet); one ConnectX-7 NDR 400 Gb/s port per GPU, 50 GB/s. Latencies assumed: 1 us NVSwitch, 5 us InfiniBand.
H100_NDR400 = Fabric(
    name="8x H100 NVLink 4 per node, NDR 400 Gb/s InfiniBand per GPU",
    intra=Link(1e-6, 1 / 450e9, "NVLink 4, H100 SXM5 data sheet (900 GB/s bidirectional); latency assumed"),
    inter=Link(5e-6, 1 / 50e9, "ConnectX-7 NDR 400 Gb/s per GPU; latency assumed"),
    ranks_per_node=8,
)


def this_machine(
    link: Link, cores: int, threads_per_rank: int = 1, op_links: Mapping[str, Link] | None = None
) -> Fabric:
    """This machine as a fabric: ``cores // threads_per_rank`` ranks per "node", every link the fitted one."""
    check_int("cores", cores, 1)
    check_int("threads_per_rank", threads_per_rank, 1)
    per_node = max(1, cores // threads_per_rank)
    return Fabric("this machine (fitted backend links)", link, link, per_node, dict(op_links or {}))


def contention(world: int, cores: float, threads_per_rank: int = 1) -> float:
    """``c(K) = max(1, K * threads / cores)``: how many ranks' threads share each core."""
    check_int("world", world, 1)
    return max(1.0, world * threads_per_rank / cores)


def all_reduce_coefficients(algorithm: str, world: int) -> tuple[float, float]:
    """``(messages, bytes factor)`` of one swept op on a whole of S bytes: ``T = messages a + factor S b``."""
    check_choice("algorithm", algorithm, SWEPT)
    check_int("world", world, 1)
    if algorithm == "tree":
        return 2 * tree_depth(world), 2 * tree_depth(world)
    if algorithm in ("all_gather", "reduce_scatter", *TORCH_TWINS):
        return world - 1, (world - 1) / world
    return 2 * (world - 1), 2 * (world - 1) / world


def all_reduce_seconds(nbytes: float, world: int, fabric: Fabric, algorithm: str = "ring", calls: float = 1.0) -> float:
    """Seconds for ``calls`` all-reduces totalling ``nbytes`` over ``world`` ranks (latency per call)."""
    check_choice("algorithm", algorithm, ALGORITHMS)
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
    g = fabric.ranks_per_node
    if algorithm == "hierarchical" and world > g:
        inside = tree_allreduce_time(nbytes, g, fabric.intra.bandwidth, calls * fabric.intra.alpha)
        leaders = math.ceil(world / g)
        return inside + ring_allreduce_time(nbytes, leaders, fabric.inter.bandwidth, calls * fabric.inter.alpha)
    link = fabric.intra if world <= g else fabric.inter
    time = tree_allreduce_time if algorithm == "tree" else ring_allreduce_time
    return time(nbytes, world, link.bandwidth, calls * link.alpha)


@dataclass
class Traffic:
    """One rank's communication per step: ``ops[op] = (calls, payload bytes)`` measured at ``world`` ranks."""

    ops: dict[str, tuple[float, float]]
    world: int
    source: str = "measured"  # or ``analytic`` (a strategy that bypasses ``comms``)

    def __post_init__(self) -> None:
        check_int("world", self.world, 1)

    def at(self, world: int) -> dict[str, tuple[float, float]]:
        """The same step at ``world`` ranks: shard payloads scale by ``self.world / world``."""
        check_int("world", world, 1)
        return {op: (c, p * self.world / world if op in SHARD_OPS else p) for op, (c, p) in self.ops.items()}

    @property
    def bytes(self) -> float:
        """Payload bytes per step at the measured world size."""
        return sum(p for _, p in self.ops.values())


def comm_seconds(traffic: Traffic, world: int, fabric: Fabric, algorithm: str = "ring") -> float:
    """``T_comm(K)`` of one step, all-reduces with ``algorithm``, on the link its ranks span (or the op's own)."""
    check_choice("algorithm", algorithm, ALGORITHMS)
    link = fabric.intra if world <= fabric.ranks_per_node else fabric.inter
    total = 0.0
    for op, (calls, payload) in traffic.at(world).items():
        if op == "all_reduce":
            total += all_reduce_seconds(payload, world, fabric, algorithm, calls)
            continue
        msgs, factor = OP_COST.get(op, lambda k: (1, 1))(world)
        own = fabric.op_links.get(op, link)
        total += calls * msgs * own.alpha + factor * payload * own.beta
    return total


def step_seconds(compute_s: float, comm_s: float, overlap: bool) -> float:
    """``c T_comp + T_comm`` (no overlap) or ``max(c T_comp, T_comm)`` (perfect), ``compute_s`` = c T_comp."""
    if compute_s < 0 or comm_s < 0:
        raise ValueError(f"times must be >= 0, got compute {compute_s!r}, comm {comm_s!r}")
    return overlapped_step_time(compute_s, comm_s) if overlap else compute_s + comm_s


def comm_here(traffic: Traffic, world: int, link: Link, op_links: Mapping[str, Link] | None = None) -> float:
    """``T_comm(K)`` on this machine, every rank on ``link`` (or an op's own), calibrated under the same sharing."""
    return comm_seconds(traffic, world, Fabric("here", link, link, max(world, 1), dict(op_links or {})), "ring")


def predict_here(
    traffic: Traffic, world: int, compute_s: float, link: Link, op_links: Mapping[str, Link] | None = None
) -> float:
    """Predicted step seconds here: ``compute_s`` (under the job's time-sharing) plus :func:`comm_here`."""
    return step_seconds(compute_s, comm_here(traffic, world, link, op_links), overlap=False)


def projection_worlds(smallest: int = 8, largest: int = 4096) -> list[int]:
    """Powers of two from ``smallest`` to ``largest``."""
    check_int("smallest", smallest, 1)
    check_int("largest", largest, smallest)
    return [smallest * 2**i for i in range(int(math.log2(largest / smallest)) + 1)]


@dataclass
class Projection:
    """One projected step without and with perfect overlap; ``compute_for_90``: the compute per step that gives
    efficiency 0.9 without overlap (``9 T_comm``)."""

    world: int
    algorithm: str
    comm_s: float
    step_s: float
    efficiency: float
    step_overlap_s: float
    efficiency_overlap: float
    compute_for_90: float
    model: str = ""
    strategy: str = ""
    fabric: str = ""


def project(
    traffic: Traffic, compute_s: float, fabric: Fabric, worlds: list[int], algorithms: Iterable[str] = ALGORITHMS[1:]
) -> list[Projection]:
    """Predicted step time and efficiency (weak scaling: ``T_comp / T_step``) per world size and algorithm."""
    if compute_s <= 0:
        raise ValueError(f"compute_s must be > 0, got {compute_s!r}")
    out = []
    for k in worlds:
        for algorithm in algorithms:
            comm = comm_seconds(traffic, k, fabric, algorithm)
            plain, over = step_seconds(compute_s, comm, False), step_seconds(compute_s, comm, True)
            out.append(Projection(k, algorithm, comm, plain, compute_s / plain, over, compute_s / over, 9 * comm))
    return out


@dataclass
class SweepPoint:
    """One swept op at one size: the mean span over repeats (what a step pays, and what the links are fitted to),
    their median, the slowest rank's own time, and their spread (NaN in a point stored before it was kept)."""

    algorithm: str
    world: int
    bytes: int
    seconds: float
    median_seconds: float = math.nan
    rank_seconds: float = math.nan
    min_seconds: float = math.nan
    max_seconds: float = math.nan


@dataclass
class Fit:
    """A link and how well it explains its sweep points."""

    algorithm: str
    link: Link
    points: list[SweepPoint] = field(default_factory=list)

    def predict(self, p: SweepPoint) -> float:
        msgs, factor = all_reduce_coefficients(self.algorithm, p.world)
        return msgs * self.link.alpha + factor * p.bytes * self.link.beta

    def median_abs_error(self, world: int | None = None, min_bytes: int = 0) -> float:
        """Median |predicted / measured - 1| over the points (of a world size, at least ``min_bytes``), else NaN."""
        pts = [p for p in self.points if world in (None, p.world) and p.bytes >= min_bytes]
        return median([abs(self.predict(p) / p.seconds - 1) for p in pts])


def fit_alpha_beta(points: Iterable[SweepPoint], algorithm: str) -> Fit:
    """Fit ``T = messages(K) a + factor(K) S b`` to the points of ``algorithm`` by least squares of the relative
    error, so small (latency-bound) and large sizes weigh alike; a negative coefficient is clamped to 0."""
    check_choice("algorithm", algorithm, SWEPT)
    pts = [p for p in points if p.algorithm == algorithm and p.world > 1 and p.seconds > 0]
    if len(pts) < 2:
        raise ValueError(f"fit_alpha_beta needs >= 2 {algorithm} points with world > 1 and seconds > 0, got {len(pts)}")
    rows = []
    for p in pts:
        msgs, factor = all_reduce_coefficients(algorithm, p.world)
        rows.append((msgs / p.seconds, factor * p.bytes / p.seconds))
    s00, s11 = sum(x * x for x, _ in rows), sum(y * y for _, y in rows)
    s01, t0, t1 = sum(x * y for x, y in rows), sum(x for x, _ in rows), sum(y for _, y in rows)
    det = s00 * s11 - s01 * s01  # the normal equations of sum (a x + b y - 1)^2
    alpha, beta = ((t0 * s11 - t1 * s01) / det, (s00 * t1 - s01 * t0) / det) if abs(det) > 1e-300 else (0.0, 0.0)
    if alpha < 0:
        alpha, beta = 0.0, t1 / s11
    elif beta < 0:
        alpha, beta = t0 / s00, 0.0
    return Fit(algorithm, Link(alpha, beta, f"least-squares fit to {len(pts)} measured {algorithm} points"), pts)


@dataclass
class CostParams:
    """Per swept op a link pooled over every calibrated K and per K its own; the points they were fitted to. JSON:
    ``{"format": 1, "source", "links": {op: {"alpha_s", "beta_s_per_byte"}}, "links_at": {K: links}, "points"}``."""

    links: dict[str, Link]
    links_at: dict[int, dict[str, Link]] = field(default_factory=dict)
    points: list[SweepPoint] = field(default_factory=list)
    source: str = "defaults"

    def fits(self, world: int | None = None) -> dict[str, Fit]:
        """Per op, its link with the points it explains (every K pooled, or those of ``world`` alone)."""
        links = self.links if world is None else self.links_at.get(world, {})
        return {
            a: Fit(a, link, [p for p in self.points if p.algorithm == a and world in (None, p.world)])
            for a, link in links.items()
        }

    def as_json(self) -> dict[str, Any]:
        def links(d: Mapping[str, Link]) -> dict[str, dict[str, float]]:
            return {op: {"alpha_s": v.alpha, "beta_s_per_byte": v.beta} for op, v in d.items()}

        at = {str(k): links(v) for k, v in self.links_at.items()}
        points = [asdict(p) for p in self.points]
        return {"format": 1, "source": self.source, "links": links(self.links), "links_at": at, "points": points}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any], origin: str = "") -> CostParams:
        if raw.get("format") != 1:
            raise ValueError(f"{origin}: cost-model parameters of format 1 expected, got {raw.get('format')!r}")

        def links(d: Mapping[str, Mapping[str, float]]) -> dict[str, Link]:
            return {op: Link(v["alpha_s"], v["beta_s_per_byte"], str(raw["source"])) for op, v in d.items()}

        at = {int(k): links(v) for k, v in raw.get("links_at", {}).items()}
        return cls(links(raw["links"]), at, [SweepPoint(**p) for p in raw.get("points", [])], str(raw["source"]))

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.as_json(), indent=1))


def calibrate(points: Iterable[SweepPoint], source: str) -> CostParams:
    """Fit every swept op with at least 2 points, over every K together and at each K alone."""
    pts = [p for p in points if p.world > 1]

    def fits(mine: list[SweepPoint]) -> dict[str, Link]:
        return {a: fit_alpha_beta(mine, a).link for a in SWEPT if sum(p.algorithm == a for p in mine) >= 2}

    at = {k: fits([p for p in pts if p.world == k]) for k in sorted({p.world for p in pts})}
    return CostParams(fits(pts), at, pts, source)


_SOURCE = "defaults: pooled fits of 2026-11-24, 2-core AMD EPYC, K=2-4 (docs/benchmarks)"
#: Used where no calibration file exists: per op (latency in s, bandwidth in bytes/s).
_DEFAULTS = dict(backend=(571e-6, 1.43e9), ring=(1228e-6, 0.715e9), tree=(325e-6, 2.34e9))
_DEFAULTS.update(all_gather=(858e-6, 0.889e9), reduce_scatter=(1428e-6, 0.652e9))
_DEFAULTS.update(torch_all_gather=(875e-6, 0.526e9), torch_reduce_scatter=(1429e-6, 0.445e9))
DEFAULT_PARAMS = CostParams({op: Link(a, 1 / bw, _SOURCE) for op, (a, bw) in _DEFAULTS.items()}, source=_SOURCE)


def load_params(path: str | Path | None) -> CostParams:
    """The parameters stored at ``path`` by ``lightning-sync bench mode=calibrate``, else :data:`DEFAULT_PARAMS`."""
    if not path or not Path(path).is_file():
        return DEFAULT_PARAMS
    return CostParams.from_json(json.loads(Path(path).read_text()), str(path))
