"""``DiLoCoStrategy``: local inner steps, and every H steps an outer Nesterov step on the averaged
pseudo-gradient (Douillard et al., "DiLoCo", 2023; torchft's ``DiLoCo``).

The Lightning adapter of :class:`lightning_sync.sync.outer.DiLoCoOuter`, on the plumbing it shares with
LocalSGD (:mod:`lightning_sync.strategies._periodic`). Where each piece is:

* the **outer step** (pseudo-gradient average, outer Nesterov SGD, the global parameters copied into the
  replica) is :meth:`DiLoCoOuter.step <lightning_sync.sync.outer.DiLoCoOuter.step>`; the strategy holds
  that object as ``self.averager``, built in :meth:`DiLoCoStrategy._make_syncer` once the optimizers exist;
* the **buffer averaging** that follows an outer step is :meth:`DiLoCoStrategy._after_step`, here;
* the **synchronized model** evaluation and checkpoints see is :meth:`DiLoCoStrategy._synchronize`, here;
* communication context, telemetry, exact data and atomic checkpoint files are the objects
  :class:`~lightning_sync.strategies._base.SyncStrategy` holds. It never averages gradients, so it holds no gradient
bucketer and takes none of ``bucketed_ddp``'s arguments (nor LocalSGD's warm-up). What is synchronized, and
when:

* **Setup:** parameters and buffers are broadcast from rank 0; the global parameters start as them.
* **Inner steps:** the LightningModule's own optimizer steps each rank's replica; no gradient is sent.
* **Every** ``sync_every`` **(H) inner steps:** the pseudo-gradient ``global - local`` is
  all-reduce-averaged (one flat message per dtype), the outer SGD (``outer_lr`` 0.7, momentum 0.9,
  Nesterov by default) steps the global parameters, which are copied into every replica; floating
  buffers are averaged.
* **Streaming** (``fragments``, ``overlap_steps``, ``outer_dtype``; :mod:`lightning_sync.sync.outer`): the model is
  synced in F fragments, fragment f at the steps ``t mod H = f H / F``; a fragment's outer step lands
  ``overlap_steps`` inner steps after its all-reduce was issued, merged into the replica with ``overlap_alpha``;
  the pseudo-gradient travels as fp32, bf16, or int8/int4 codes with error feedback. Floating buffers are
  averaged when the last fragment's outer step lands. With the defaults (1, 0, fp32) it is DiLoCo as above.
* **Validation / test** run on the global parameters of the last outer step (identical on every
  rank) with averaged buffers; each rank's replica is restored afterwards (``trainer.validate``/``test``
  after fit too). ``full_state_dict()`` returns that model on rank 0.
* **Checkpoints** resume exactly, inside a period too. ``state_dict`` is the global model of the
  last outer step (what a user exports); ``lightning_sync/diloco`` holds the global parameters, the
  outer optimizer's momentum and the inner-step counter (the same on every rank); Lightning's
  ``optimizer_states`` are rank 0's inner ones. Per rank, as for ``local_sgd``: the rank's replica
  (its inner progress since the last outer step) and, on ranks other than 0, its inner optimizer
  state, both put back on resume. Size, K ranks, Ψ values per model, an inner Adam: inside a period
  (K + 3)Ψ + 2KΨ (the global model twice, the outer momentum, K replicas), right after an outer step
  3Ψ + 2KΨ. At another world size every replica starts from the mean of the checkpoint's replicas (the
  inner progress since the last outer step is kept, as the next outer step would have averaged it) with
  rank 0's inner optimizer state; the outer state and the counter continue, so the next outer step comes
  on schedule, averaging the new ranks' pseudo-gradients. Streaming adds the syncs in flight (waited for when
  saving, the same on every rank; their outer steps land on schedule after a resume) and, per rank, int8/int4's
  error feedback, regrouped at another world size so that it carries the same total.
* **Failure:** if a rank fails, its peers raise in the next outer step's all-reduce once the process
  group notices (connection closed, or ``timeout``).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
from typing_extensions import override

from lightning_sync.resume import RANK_STATES
from lightning_sync.strategies._periodic import PeriodicStrategy
from lightning_sync.sync.outer import DiLoCoOuter, check_outer, check_streaming
from lightning_sync.sync.periodic import average_tensors, check_int
from lightning_sync.sync.quantize import OuterCodec, check_outer_dtype

__all__ = ["DiLoCoStrategy"]


class DiLoCoStrategy(PeriodicStrategy):
    """DiLoCo (see the module docstring).

    Args:
        sync_every: H, inner steps per outer step (>= 1; the paper uses 500).
        outer_lr: outer SGD learning rate (> 0; 0.7).
        outer_momentum: outer momentum in [0, 1) (0.9).
        nesterov: Nesterov outer momentum (True).
        fragments: F, the fragments the model is synced in, each on its own schedule (1: DiLoCo's whole model;
            in [1, sync_every]).
        overlap_steps: tau, inner steps a fragment's outer all-reduce runs behind before its outer step lands (0:
            DiLoCo's blocking sync; in [0, sync_every)).
        outer_dtype: what the pseudo-gradient travels as: ``"fp32"`` (DiLoCo's), ``"bf16"``, ``"int8"`` or
            ``"int4"`` (the last two with error feedback).
        overlap_alpha: with ``overlap_steps > 0``, the weight the local fragment keeps when its global value
            lands (``alpha local + (1 - alpha) global``; the paper's 0.5), in [0, 1].
        process_group_backend: ``"gloo"``, ``"nccl"`` or None (Lightning picks for the accelerator).
        timeout: collective timeout in seconds (or a ``timedelta``).
        start_method: ``"popen"`` (re-run the script per rank), ``"spawn"``, ``"fork"`` or ``"forkserver"``.
        fault_tolerant: keep training when a rank is lost, a period at a time (the ranks must be started by the
            fault-tolerance agent); None: on exactly when they were.

    Any other argument (``bucketed_ddp``'s ``compression`` or ``bucket_cap_mb``, LocalSGD's ``warmup_steps``)
    raises a ``ValueError`` naming it and listing these.
    """

    strategy_name = "diloco"
    _ckpt_key = "lightning_sync/diloco"

    def __init__(
        self,
        sync_every: int = 500,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        fragments: int = 1,
        overlap_steps: int = 0,
        outer_dtype: str = "fp32",
        overlap_alpha: float = 0.5,
        process_group_backend: str | None = None,
        timeout: float | timedelta = 1800.0,
        start_method: str = "popen",
        fault_tolerant: bool | None = None,
        **kwargs: Any,
    ) -> None:
        check_outer(outer_lr, outer_momentum, nesterov)
        check_streaming(check_int("sync_every", sync_every, 1), fragments, overlap_steps, overlap_alpha)
        check_outer_dtype(outer_dtype)
        self.fragments, self.overlap_steps, self.outer_dtype = fragments, overlap_steps, outer_dtype
        self.overlap_alpha = float(overlap_alpha)
        self._pending_errors: dict[str, Any] | None = None  # this rank's error feedback, from a checkpoint
        super().__init__(sync_every, process_group_backend, timeout, start_method, fault_tolerant, **kwargs)
        self.outer_lr, self.outer_momentum, self.nesterov = float(outer_lr), float(outer_momentum), nesterov

    @override
    def _live_settings(self) -> dict[str, tuple[Any, tuple[Any, ...]]]:
        # a live period is committed or trained again whole: a fragment's sync inside it, a sync in flight across
        # its end, or error feedback a replay would count twice have no place in it
        return {
            "fragments": (self.fragments, (1,)),
            "overlap_steps": (self.overlap_steps, (0,)),
            "outer_dtype": (self.outer_dtype, ("fp32", "bf16")),
        }

    def _trainable(self) -> list[torch.Tensor]:
        assert self.model is not None
        return [p for p in self.model.parameters() if p.requires_grad]

    @override
    def _make_syncer(self) -> DiLoCoOuter:
        outer = DiLoCoOuter(
            self._trainable(),
            self.comm,
            self.sync_every,
            self.outer_lr,
            self.outer_momentum,
            self.nesterov,
            fragments=self.fragments,
            overlap_steps=self.overlap_steps,
            outer_dtype=self.outer_dtype,
            overlap_alpha=self.overlap_alpha,
        )
        if self._pending_errors is not None:
            outer.load_rank_state(self._pending_errors)
            self._pending_errors = None
        return outer

    @override
    def _after_step(self) -> None:
        """Count the inner step; at an outer step, average the floating buffers too."""
        if self.averager.step():
            assert self.model is not None
            average_tensors([b for b in self.model.buffers() if b.is_floating_point()], self.comm)

    @override
    def _drifted(self) -> bool:
        return self.averager is not None and not self.averager.in_sync()

    @override
    def _rank_state(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """Besides the replica: int8 / int4's error feedback, this rank's own."""
        state = super()._rank_state(checkpoint)
        errors = self.averager.rank_state() if self.averager is not None and state else {}
        return {**state, "outer_errors": errors} if errors else state

    @override
    def _restore_rank_state(self, mine: dict[str, Any] | None, checkpoint: dict[str, Any]) -> None:
        super()._restore_rank_state(mine, checkpoint)
        states = checkpoint.get(RANK_STATES) or []
        if mine is not None:
            self._pending_errors = mine.get("outer_errors")
        elif any("outer_errors" in s for s in states):  # another world size: what they carry is kept
            self._pending_errors = OuterCodec.regrouped(
                [s.get("outer_errors", {}) for s in states], self.world_size, self.global_rank
            )
        if self._pending_errors is not None and self.averager is not None:
            self.averager.load_rank_state(self._pending_errors)
            self._pending_errors = None

    @override
    def _synchronize(self, tensors: list[torch.Tensor]) -> None:
        """Trainable parameters take the global ones (no collective); the rest (buffers) is averaged."""
        assert self.averager is not None
        global_of = {id(p): g for p, g in zip(self.averager.params, self.averager.global_params)}
        rest = []
        with torch.no_grad():
            for live, t in zip(self._averaged_tensors(), tensors):
                if id(live) in global_of:
                    t.copy_(global_of[id(live)])
                elif live.is_floating_point() and not isinstance(live, torch.nn.Parameter):
                    rest.append(t)
        average_tensors(rest, self.comm)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            "diloco",
            cls,
            description="DiLoCo: local inner steps, outer Nesterov step on "
            "the averaged pseudo-gradient every sync_every steps (lightning_sync)",
            override=True,
        )
