r"""The communication cost model: latency and bandwidth fitted to a measured sweep, projected to K ranks.

Notation: K ranks, S payload bytes, :math:`\alpha` seconds per message (latency), :math:`\beta` seconds
per byte (1 / bandwidth) of one link, N = K / G nodes of G ranks each.

**All-reduce of S bytes** (Thakur, Rabenseifner & Gropp 2005; Patarasuk & Yuan 2009)::

    ring           T = 2(K-1) a + 2(K-1)/K S b
    tree           T = 2 ceil(log2 K) (a + S b)          reduce up a binary tree, broadcast down
    hierarchical   T = 2 ceil(log2 G) (a_in + S b_in)    reduce to the node leader, and back down
                     + 2(N-1) a_out + 2(N-1)/N S b_out   ring all-reduce among the N leaders
    backend        fitted with the ring's coefficients (an effective a and b of gloo or NCCL)

The hierarchical formula is the package's own :func:`lightning_sync.comms.algorithms.hierarchical_all_reduce`
(leader based), not NCCL's two-dimensional variant.

**Every other op**, as ``comms`` records its payload P per rank (see :mod:`lightning_sync.comms.stats`),
under the ring model (:data:`OP_COST`: messages, bytes on the wire per payload byte)::

    reduce_scatter   (K-1) a + (K-1)/K P b     P = the full input
    all_gather       (K-1) a + (K-1)   P b     P = this rank's shard
    broadcast        ceil(log2 K) (a + P b)
    gather, scatter  (K-1) a + (K-1) P b       the root's link carries every other rank's part
    metadata         (K-1) a + (K-1) P b
    send             a + P b                   (recv: 0, the sender's entry holds the message)
    barrier          ceil(log2 K) a

**A strategy's step** (:class:`Traffic` holds its per-step calls and payload of every op, measured by
``CommStats`` at some K0; :meth:`Traffic.at` rescales it to K: all_gather and scatter payloads are
shards, ``P(K) = P(K0) K0 / K``, every other payload is the same at every K)::

    T_comm(K) = sum over ops of  calls * messages(K) * a + wire(K) * P(K) * b
    T_step(K) = c(K) T_comp + T_comm(K)                        no overlap
    T_step(K) = max(c(K) T_comp, T_comm(K))                    perfect overlap
    efficiency(K) = T_comp / T_step(K)                         weak scaling, fixed per-rank batch

T_comp is the measured single-process step time at the per-rank batch (for a strategy that does host work
of its own, such as FSDP2's DTensor parameters and per-unit hooks, its one-rank step: the report adds that
difference to the plain model's). ``c(K) = max(1, K * threads / cores)``
is the time-sharing of one machine's cores: on this 2-core machine 4 ranks of one thread each get half
a core each. The projection assumes every node has a core per rank (c = 1).

On this machine (:func:`predict_here`) every payload goes through the backend, so the prediction uses
the ``backend`` fit (and for all_gather and reduce_scatter their own fits: ``comms.all_gather_into`` and
``reduce_scatter_into`` run on gloo as K broadcasts and, for chunks of 2 MiB or more, K reduces (gloo's
reduce-scatter below), so one fit spans both of the reduce-scatter's paths; ``torch_all_gather`` and
``torch_reduce_scatter``, gloo's own ops, which FSDP2 calls, have theirs). The report's validation fits
them to the sweep at the step's own K (:meth:`lightning_sync.bench.cost_report.CostModel.links_at`), so
they ran under the same time-sharing and T_comm takes no further factor; no overlap: compute and
communication compete for the same cores (the report's exposed-communication column measures how
little of the all-reduce hides behind backward). The report's covered column
(``CommStats.covered_seconds``) measures, per step, how long a rank computed with one of its async calls
in flight: ZeRO-3, whose prefetched all-gathers and backward reduce-scatters are in flight during 80-95 %
of its compute here, could hide most. Crediting it does not make a better prediction on this machine: in a
run of K = 2 and 4 (2026-11-24; wide_mlp, deep_mlp and char_gpt; Lightning's DDP, bucketed DDP plain and
fp16, ZeRO-2, ZeRO-3 and LocalSGD: 36 rows), the no-overlap sum put 35 rows within 25 % of the measured
step, subtracting min(covered, T_comm) 28 and min(covered, the calls' latency terms) 31: bucketed DDP and
ZeRO-3 on char_gpt fell below their measured steps (presumably a call in flight takes the time-shared
cores from the compute it would hide behind).

**Projection** (:func:`project`) to K = 8 ... 4096 with a :class:`Fabric`: the fitted link of this machine
(copies of it as nodes of ``G`` = cores ranks, every link the fitted one) or :data:`H100_NDR400`. A flat ring or tree
over more than one node runs at the slowest link (every step of the pipeline waits for the inter-node
hop); within one node at the intra-node link. Sharded ops (reduce_scatter, all_gather) always use the
flat ring.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning_sync._checks import check_choice, check_int
from lightning_sync.bench.formulas import overlapped_step_time, ring_allreduce_time, tree_allreduce_time, tree_depth

__all__ = [
    "ALGORITHMS",
    "H100_NDR400",
    "OP_COST",
    "SWEPT",
    "TORCH_TWINS",
    "Fabric",
    "Fit",
    "Link",
    "Traffic",
    "all_reduce_coefficients",
    "all_reduce_seconds",
    "comm_here",
    "comm_seconds",
    "contention",
    "fit_alpha_beta",
    "predict_here",
    "project",
    "projection_worlds",
    "step_seconds",
    "this_machine",
]

#: All-reduce algorithms the model knows.
ALGORITHMS = ("backend", "ring", "tree", "hierarchical")


#: Per op: ``K -> (messages, wire bytes per payload byte)`` (module docstring). An op not listed
#: (for example an algorithm's own 0-byte entry) costs one message and its payload once.
OP_COST: dict[str, Callable[[int], tuple[float, float]]] = {
    "all_reduce": lambda k: (2 * (k - 1), 2 * (k - 1) / k),
    "reduce_scatter": lambda k: (k - 1, (k - 1) / k),
    "all_gather": lambda k: (k - 1, k - 1),
    "broadcast": lambda k: (tree_depth(k), tree_depth(k)),
    "gather": lambda k: (k - 1, k - 1),
    "scatter": lambda k: (k - 1, k - 1),
    "metadata": lambda k: (k - 1, k - 1),
    "send": lambda k: (1, 1),
    "recv": lambda k: (0, 0),
    "barrier": lambda k: (tree_depth(k), 0),
}

#: The backend's own all-gather and reduce-scatter (what FSDP2 calls), per the ``comms`` op whose payload and
#: traffic they share; only their links differ.
TORCH_TWINS = {"torch_all_gather": "all_gather", "torch_reduce_scatter": "reduce_scatter"}
OP_COST.update({op: OP_COST[twin] for op, twin in TORCH_TWINS.items()})

#: Ops whose payload per rank is a 1/K shard of a fixed whole.
SHARD_OPS = frozenset({"all_gather", "torch_all_gather", "scatter"})


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
    op_links: Mapping[str, Link] = field(default_factory=dict)
    """Links that replace ``intra`` and ``inter`` for one op (this machine's fitted all_gather and
    reduce_scatter, which gloo runs differently from its all-reduce)."""

    def __post_init__(self) -> None:
        check_int("ranks_per_node", self.ranks_per_node, 1)


#: One DGX-H100-like node per 8 GPUs. Bandwidths are the vendor's peak figures per direction:
#: NVLink 4 on H100 SXM5 is 900 GB/s per GPU in both directions together (NVIDIA H100 data sheet),
#: 450 GB/s each way; one ConnectX-7 NDR InfiniBand port of 400 Gb/s per GPU (the DGX H100 reference
#: architecture), 50 GB/s each way. Latencies are assumptions, not measurements: 1 us through NVSwitch
#: and 5 us per InfiniBand hop across a spine. NCCL reaches roughly 70-90 % of the peak bandwidths.
H100_NDR400 = Fabric(
    name="8x H100 NVLink 4 per node, NDR 400 Gb/s InfiniBand per GPU",
    intra=Link(
        alpha=1e-6, beta=1 / 450e9, source="NVLink 4, H100 SXM5 data sheet (900 GB/s bidirectional); latency assumed"
    ),
    inter=Link(alpha=5e-6, beta=1 / 50e9, source="ConnectX-7 NDR 400 Gb/s per GPU; latency assumed"),
    ranks_per_node=8,
)


def this_machine(
    link: Link, cores: int, threads_per_rank: int = 1, op_links: Mapping[str, Link] | None = None
) -> Fabric:
    """This machine as a fabric: ``cores // threads_per_rank`` ranks per "node", every link the fitted one."""
    check_int("cores", cores, 1)
    check_int("threads_per_rank", threads_per_rank, 1)
    return Fabric(
        name="this machine (fitted backend links)",
        intra=link,
        inter=link,
        ranks_per_node=max(1, cores // threads_per_rank),
        op_links=dict(op_links or {}),
    )


def contention(world: int, cores: float, threads_per_rank: int = 1) -> float:
    """``c(K) = max(1, K * threads / cores)``: how many ranks' threads share each core."""
    check_int("world", world, 1)
    return max(1.0, world * threads_per_rank / cores)


#: What the sweep can measure (:mod:`lightning_sync.bench.sweep`): the all-reduce algorithms, the even
#: all-gather and reduce-scatter of ``comms`` (``all_gather_into``, ``reduce_scatter_into``), and the
#: backend's own ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` (``torch_*``: what FSDP2 calls).
SWEPT = ("backend", "ring", "tree", "all_gather", "reduce_scatter", "torch_all_gather", "torch_reduce_scatter")


def all_reduce_coefficients(algorithm: str, world: int) -> tuple[float, float]:
    """``(messages, bytes factor)`` of one swept op on S bytes (the whole tensor): ``T = messages * a + factor * S * b``.

    All-reduce: ``ring`` and ``backend`` use the ring's ``2(K-1)`` and ``2(K-1)/K``, ``tree``
    ``2 ceil(log2 K)`` for both (``hierarchical`` needs two links: :func:`all_reduce_seconds`).
    ``all_gather`` and ``reduce_scatter`` (and their ``torch_*`` forms) of a whole of S bytes: ``K-1``
    and ``(K-1)/K``.
    """
    check_choice("algorithm", algorithm, SWEPT)
    check_int("world", world, 1)
    if algorithm == "tree":
        return 2 * tree_depth(world), 2 * tree_depth(world)
    if algorithm in ("all_gather", "reduce_scatter", "torch_all_gather", "torch_reduce_scatter"):
        return world - 1, (world - 1) / world
    return 2 * (world - 1), 2 * (world - 1) / world


def all_reduce_seconds(nbytes: float, world: int, fabric: Fabric, algorithm: str = "ring", calls: float = 1.0) -> float:
    """Seconds for ``calls`` all-reduces totalling ``nbytes`` over ``world`` ranks of ``fabric``."""
    check_choice("algorithm", algorithm, ALGORITHMS)
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
    g = fabric.ranks_per_node
    # calls all-reduces of nbytes in all: each pays the latency, the bytes are paid once
    if algorithm == "hierarchical" and world > g:
        inside = tree_allreduce_time(nbytes, g, fabric.intra.bandwidth, calls * fabric.intra.alpha)
        return inside + ring_allreduce_time(
            nbytes, math.ceil(world / g), fabric.inter.bandwidth, calls * fabric.inter.alpha
        )
    link = fabric.intra if world <= g else fabric.inter
    time = tree_allreduce_time if algorithm == "tree" else ring_allreduce_time
    return time(nbytes, world, link.bandwidth, calls * link.alpha)


@dataclass
class Traffic:
    """One rank's communication per step: ``ops[op] = (calls, payload bytes)`` measured at ``world`` ranks."""

    ops: dict[str, tuple[float, float]]
    world: int
    source: str = "measured"
    """``measured`` (``CommStats``) or ``analytic`` (a strategy that bypasses ``comms``)."""

    def __post_init__(self) -> None:
        check_int("world", self.world, 1)

    def at(self, world: int) -> dict[str, tuple[float, float]]:
        """The same step at ``world`` ranks: shard payloads (all_gather, scatter) scale by ``self.world / world``."""
        check_int("world", world, 1)
        return {
            op: (calls, payload * self.world / world if op in SHARD_OPS else payload)
            for op, (calls, payload) in self.ops.items()
        }

    @property
    def bytes(self) -> float:
        """Payload bytes per step at the measured world size."""
        return sum(p for _, p in self.ops.values())


def comm_seconds(traffic: Traffic, world: int, fabric: Fabric, algorithm: str = "ring") -> float:
    """``T_comm(K)`` of one step: every op at ``world`` ranks, all-reduces with ``algorithm``, at the
    link its ranks span (the intra-node link up to ``ranks_per_node`` ranks, else the inter-node one)."""
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


@dataclass
class Fit:
    """A fitted link and how well it explains the sweep."""

    algorithm: str
    link: Link
    points: list[dict[str, Any]] = field(default_factory=list)
    """The sweep points with ``predicted`` seconds and ``error`` (predicted / measured - 1)."""

    def median_abs_error(self, world: int | None = None, min_bytes: int = 0) -> float:
        """Median of |error| over the points (of one world size, of at least ``min_bytes``)."""
        errs = sorted(
            abs(p["error"]) for p in self.points if (world is None or p["world"] == world) and p["bytes"] >= min_bytes
        )
        if not errs:
            return math.nan
        mid = len(errs) // 2
        return errs[mid] if len(errs) % 2 else (errs[mid - 1] + errs[mid]) / 2


def _solve_2x2(rows: list[tuple[float, float]], ys: list[float]) -> tuple[float, float]:
    """Least squares of ``y = a x0 + b x1`` through its normal equations; (0, 0) when singular."""
    s00 = sum(x0 * x0 for x0, _ in rows)
    s01 = sum(x0 * x1 for x0, x1 in rows)
    s11 = sum(x1 * x1 for _, x1 in rows)
    t0 = sum(x0 * y for (x0, _), y in zip(rows, ys))
    t1 = sum(x1 * y for (_, x1), y in zip(rows, ys))
    det = s00 * s11 - s01 * s01
    if abs(det) <= 1e-300:
        return 0.0, 0.0
    return (t0 * s11 - t1 * s01) / det, (s00 * t1 - s01 * t0) / det


def fit_alpha_beta(points: Iterable[Mapping[str, Any]], algorithm: str) -> Fit:
    """Fit ``T = messages(K) a + factor(K) S b`` to the sweep points of ``algorithm`` (one of :data:`SWEPT`;
    any world sizes; :func:`all_reduce_coefficients`).

    Minimises the squared *relative* error (each equation divided by its measured time), so the
    latency-bound small sizes and the bandwidth-bound large ones weigh alike. A negative coefficient is
    clamped to 0 and the other refitted alone. Raises ``ValueError`` with fewer than 2 points of world > 1.
    """
    check_choice("algorithm", algorithm, SWEPT)
    pts = [dict(p) for p in points if p["algorithm"] == algorithm and int(p["world"]) > 1 and p["seconds"] > 0]
    if len(pts) < 2:
        raise ValueError(f"fit_alpha_beta needs >= 2 {algorithm} points with world > 1 and seconds > 0, got {len(pts)}")
    rows, ys = [], []
    for p in pts:
        msgs, factor = all_reduce_coefficients(algorithm, int(p["world"]))
        rows.append((msgs / p["seconds"], factor * p["bytes"] / p["seconds"]))
        ys.append(1.0)
    alpha, beta = _solve_2x2(rows, ys)
    if alpha < 0 or beta < 0:  # refit the other coefficient alone
        if alpha < 0:
            alpha, beta = 0.0, sum(r[1] for r in rows) / sum(r[1] ** 2 for r in rows)
        else:
            alpha, beta = sum(r[0] for r in rows) / sum(r[0] ** 2 for r in rows), 0.0
    link = Link(alpha=alpha, beta=beta, source=f"least-squares fit to {len(pts)} measured {algorithm} points")
    for p in pts:
        msgs, factor = all_reduce_coefficients(algorithm, int(p["world"]))
        p["predicted"] = msgs * alpha + factor * p["bytes"] * beta
        p["error"] = p["predicted"] / p["seconds"] - 1
    return Fit(algorithm=algorithm, link=link, points=pts)


def comm_here(traffic: Traffic, world: int, link: Link, op_links: Mapping[str, Link] | None = None) -> float:
    """``T_comm(K)`` of a ``world``-rank job on this machine: every rank on the fitted ``link`` (and
    ``op_links`` for the ops that have their own fit), all-reduces as the backend runs them (ring coefficients).

    The links were fitted to sweeps that ran with the same time-sharing of the cores, so ``T_comm``
    takes no further factor.
    """
    fabric = Fabric(name="here", intra=link, inter=link, ranks_per_node=max(world, 1), op_links=dict(op_links or {}))
    return comm_seconds(traffic, world, fabric, "ring")


def predict_here(
    traffic: Traffic, world: int, compute_s: float, link: Link, op_links: Mapping[str, Link] | None = None
) -> float:
    """Predicted step seconds of a ``world``-rank job on this machine: ``compute_s +`` :func:`comm_here`, no overlap.

    ``compute_s`` is the compute per step under the job's time-sharing of the cores: measured with K
    single-process runs at once, kept in step, or ``contention(K, cores) * T1``.
    """
    return step_seconds(compute_s, comm_here(traffic, world, link, op_links), overlap=False)


def projection_worlds(smallest: int = 8, largest: int = 4096) -> list[int]:
    """Powers of two from ``smallest`` to ``largest``."""
    check_int("smallest", smallest, 1)
    check_int("largest", largest, smallest)
    out, k = [], smallest
    while k <= largest:
        out.append(k)
        k *= 2
    return out


def project(
    traffic: Traffic,
    compute_s: float,
    fabric: Fabric,
    worlds: Iterable[int],
    algorithms: Iterable[str] = ("ring", "tree", "hierarchical"),
) -> list[dict[str, Any]]:
    """Predicted step time and efficiency at every world size, per algorithm, without and with overlap.

    Each row: ``world``, ``algorithm``, ``comm_s``, ``step_s`` / ``efficiency`` (no overlap) and
    ``step_overlap_s`` / ``efficiency_overlap`` (perfect overlap), and ``compute_for_90`` (the compute
    time per step at which the no-overlap efficiency would reach 0.9: ``9 T_comm``).
    """
    if compute_s <= 0:
        raise ValueError(f"compute_s must be > 0, got {compute_s!r}")
    out = []
    for k in worlds:
        for algorithm in algorithms:
            comm = comm_seconds(traffic, k, fabric, algorithm)
            plain, over = step_seconds(compute_s, comm, False), step_seconds(compute_s, comm, True)
            out.append(
                {
                    "world": k,
                    "algorithm": algorithm,
                    "comm_s": comm,
                    "step_s": plain,
                    "efficiency": compute_s / plain,
                    "step_overlap_s": over,
                    "efficiency_overlap": compute_s / over,
                    "compute_for_90": 9 * comm,
                }
            )
    return out
