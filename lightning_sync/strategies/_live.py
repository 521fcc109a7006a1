"""``LiveTraining``: a strategy's part in live fault tolerance, inside Lightning's loop.

The strategy owns one when its ranks were started by the fault-tolerance agent
(:mod:`lightning_sync.launch.agent`). It joins the job's :class:`~lightning_sync.comms.membership.Membership`
instead of Lightning's process-group setup, and keeps every failure inside the strategy: Lightning's loop never
sees the exception, because ``_call_and_handle_interrupt`` would tear the run down.

**A window is committed or replayed whole.** A window is an accumulation window (``bucketed_ddp``) or a period of
inner steps ending in a sync (``local_sgd``, ``diloco``). Every micro-batch's share of the global batch comes from
:class:`~lightning_sync.shares.SharedBatches` for the membership current when it trains (a batch the loader
prefetched for an older one is rebuilt from the dataset). The optimizer step that ends the window runs the last
closure (Lightning's) and the members vote (:meth:`Membership.run_committed`): gradient averaging votes before the
optimizer, so only a committed step reaches it; a periodic strategy votes after its sync, and goes back to the
period's start before a replay. A collective that fails anywhere in the window (a buffer broadcast, a synced log,
the gradients' all-reduce) is recorded, the group is left at once, and the rest of the window runs without
collectives; the vote then aborts. After an abort the members enter the next epoch and replay the whole window
there (:class:`~lightning_sync.strategies._live_window.WindowRecord`): each micro-batch rebuilt as this member's
share for the new membership, run through Lightning's own closures, each earlier step with the optimizer settings
it had, so the global batch, and every sample in it, is trained exactly once in the committed window.

**Healing.** A replacement sets itself up first (no group exists yet) and asks to join at the end of its setup;
it joins when the members enter the epoch that admits it, at the start of a window (the admitting step applied,
Lightning's loop between two batches). Every member then takes the state as a Lightning
checkpoint would hold it (weights, optimizers, LR schedulers, loop counters and data position, callbacks,
precision) with the strategy's own and rank 0's RNG streams, and rank 0 sends it to the replacement in one
broadcast. The replacement hands it to Lightning as the checkpoint to restore after setup, and until its first
training step runs no collective (its peers are in their window, waiting for it there).

Imports Lightning's loop internals only through :mod:`lightning_sync._lightning`: ``_build_kwargs`` and
``_make_closure`` (the closures a replay runs) and the checkpoint connector's ``dump_checkpoint`` /
``_loaded_checkpoint`` (:mod:`~lightning_sync.strategies._live_handover`).
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torchmetrics import Metric
from torchmetrics.utilities.distributed import gather_all_tensors

from lightning_sync._lightning import (
    batch_index,
    logged_state,
    replace_sigterm_broadcast,
    trainer_of,
    warm_logging,
)
from lightning_sync.comms.membership import Membership
from lightning_sync.resume import set_rng_state
from lightning_sync.shares import SharedBatches, rebuild, share_of, weight_of
from lightning_sync.strategies._live_env import LiveEnvironment
from lightning_sync.strategies._live_handover import (
    load_training_state,
    take_over_rank_zero,
    take_training_state,
    training_state,
)
from lightning_sync.strategies._live_window import MetricMarks, WindowRecord, WindowReplay, hyperparameters

__all__ = ["FT_FAILURES", "FT_MEMBERS", "FT_REPLAYED", "FT_SECONDS_LOST", "LiveTraining"]

T = TypeVar("T")

FT_FAILURES, FT_MEMBERS, FT_REPLAYED, FT_SECONDS_LOST = (
    "ft/failures",
    "ft/members",
    "ft/replayed_steps",
    "ft/seconds_lost",
)


class WindowFailed(RuntimeError):
    """A collective of this window failed earlier; the window cannot be committed."""


class LiveTraining:
    """One rank's live membership inside Lightning's loop (module docstring).

    Args:
        owner: the strategy; it calls each method from the hook its name says, and provides ``_live_state()``
            / ``_live_load(state)`` (its own state for a replacement) and ``_live_reset()`` (before a replay).
        timeout: seconds a collective of an epoch's group may take, and the longest wait for a new epoch.
    """

    def __init__(self, owner: Any, timeout: float) -> None:
        self._owner = owner
        self.timeout = timeout
        self.environment = LiveEnvironment()
        self.membership: Membership | None = None
        self.batches: SharedBatches | None = None
        self._loader: Any = None  # the training DataLoader
        #: the state a replacement received from a live peer, for Lightning to restore after setup
        self.healed_checkpoint: dict[str, Any] | None = None
        #: a replacement between its heal and its first training step: it runs no collective
        self.quiet = False
        self.failure: str | None = None  # a collective of this window failed: what it said
        self._holds_state = False
        self._snapshot: bytes | None = None  # the state at this window's start, while replacements are admitted
        self.window = WindowRecord()  # what the window in progress trained, to train it again after a loss
        self.replay = WindowReplay(owner, self.window, lambda j: self.batches.entries(j))
        self.weight = 1.0  # on this micro-batch's loss (SharedBatches.weight)
        self._failed_at: float | None = None  # when this window's first collective failed
        self._rank = -1  # this member's rank in the epoch it was in before
        self._admitted_at: float | None = None  # when this member entered an epoch that admitted replacements
        self._rng: dict[str, Any] | None = None  # a replacement's RNG streams from its peer, until its first step
        self._replacing = False  # this process joins a running job
        self._inside = False  # in a guarded call or in the vote's attempt: a failure propagates to it
        self.failures = 0
        self.replayed = 0
        self.seconds_lost = 0.0

    # ------------------------------------------------------------------ joining
    def connect(self) -> None:
        """At ``setup_distributed``: join the membership (a replacement is healed inside, see the docstring). A
        later ``fit``/``validate`` of the same strategy keeps it: the process is a member until it exits."""
        if self.membership is not None:
            self._owner.set_world_ranks()
            return
        owner = self._owner
        backend = owner._get_process_group_backend()
        device = owner.root_device if backend == "nccl" else None  # gloo keeps the heal's bytes on the host
        self.membership = Membership(
            backend=backend, device=device, timeout=self.timeout, heal=self._heal, on_enter=self._entered
        )
        self.environment.membership = self.membership
        if self.membership.waits_to_join():
            # a replacement: it sets itself up (model, optimizers) before it joins at the end of setup, since its
            # peers wait for it from its admission on; until then it runs no collective (no group exists)
            self.membership.start()
            self.environment.replacing = self.quiet = self._replacing = True
            owner.set_world_ranks()
            return
        self._join()

    def _join(self) -> None:
        """Enter the membership (a replacement waits to be admitted there and is healed inside)."""
        assert self.membership is not None
        self.membership.join()
        self.environment.replacing = False
        nominal = self.environment.nominal_world_size
        if self.membership.epoch == 0 and self.membership.world_size != nominal:
            raise ValueError(
                f"{type(self._owner).__name__}: the fault-tolerance agent started {self.membership.world_size} "
                f"ranks, the Trainer expects num_nodes x devices = {nominal}; give the agent --nproc per node to match"
            )
        self.quiet = self.healed_checkpoint is not None

    @property
    def replacement(self) -> bool:
        """Whether this process joins a running job (it restores the state a peer sends, not a checkpoint)."""
        return self._replacing

    def _entered(self) -> None:
        """A new epoch: this member's rank and world size changed; its collectives are whole again."""
        membership = self.membership
        assert membership is not None
        if membership.member in membership.healed:
            self._holds_state = True
        self.failure = None
        self._owner.set_world_ranks()  # Lightning's rank_zero_only follows: a new rank 0 logs
        trainer = trainer_of(self._owner.lightning_module)
        became_zero, self._rank = membership.rank == 0 and self._rank > 0, membership.rank
        if became_zero and trainer is not None:
            take_over_rank_zero(self._owner, trainer)

    def _heal(self, source: int) -> None:
        """The state from rank ``source`` to every member that lacks it: one size and one byte broadcast."""
        membership, comm = self.membership, self._owner.comm
        assert membership is not None
        sending = self._holds_state and membership.rank == source
        blob = self._snapshot if sending else None
        if sending and blob is None:  # only in an epoch entered by an admission, which took the snapshot
            raise RuntimeError("LiveTraining: a heal without the state taken at the window's start")
        device = membership.device or torch.device("cpu")  # NCCL sends device tensors only
        size = torch.tensor([len(blob) if blob is not None else 0], dtype=torch.int64, device=device)
        comm.broadcast(size, src=source)
        data = (
            torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(device)
            if blob is not None
            else torch.empty(int(size), dtype=torch.uint8, device=device)
        )
        comm.broadcast(data, src=source)
        if not self._holds_state:
            self.healed_checkpoint, self._holds_state = load_training_state(data.cpu().numpy().tobytes()), True

    def setup(self, trainer: Any) -> None:
        """At ``setup``: Lightning's own per-batch broadcast of the SIGTERM flag goes through :meth:`guarded` (it
        swallows a failure, which would leave a peer blocked in it for the group's timeout), and a replacement
        takes the state it received."""
        root = self._owner.root_device

        def broadcast_sigterm() -> None:
            flag = torch.tensor([1 if getattr(trainer, "received_sigterm", False) else 0], device=root)
            self.guarded(lambda: self._owner.comm.broadcast(flag, src=0), lambda: None)
            if flag.item() == 1:
                self._owner.barrier()
                raise SIGTERMException()

        replace_sigterm_broadcast(trainer, broadcast_sigterm)
        for metric in self._owner.lightning_module.modules():  # torchmetrics sync with torch directly
            if isinstance(metric, Metric):
                metric.dist_sync_fn = self._metric_sync
        self.join_now()  # a replacement, set up: now it joins, and is healed
        if self.replacement:
            assert self.healed_checkpoint is not None
            self._rng = take_training_state(self._owner, trainer, self.healed_checkpoint)

    def join_now(self) -> None:
        """A replacement that has not joined yet joins here (and is healed): at the end of its setup, or earlier where
        the strategy needs its place in the membership to set up (ZeRO shards over it)."""
        if self.replacement and self.healed_checkpoint is None:
            warm_logging(self._owner.root_device)
            self._join()

    def _metric_sync(self, tensor: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
        """torchmetrics' gather, through :meth:`guarded`: after a loss, this member's values alone."""
        return self.guarded(lambda: gather_all_tensors(tensor, group), lambda: [tensor])

    def flush_logs(self) -> None:
        """At each batch's start, on rank 0: what the loggers hold goes to disk, so that a new rank 0 after a loss
        continues from the last step logged (a SIGKILLed process writes nothing more)."""
        trainer = trainer_of(self._owner.lightning_module)
        if trainer is not None and self._owner.global_rank == 0:
            for logger in trainer.loggers:
                logger.save()

    # ------------------------------------------------------------------ data
    def install(self, loader: Any) -> Any:
        """The training loader's batches become this member's shares (:class:`SharedBatches`)."""
        name = type(self._owner).__name__
        self.batches, self._loader = SharedBatches.install(loader, self._place, name, "live fault tolerance"), loader
        return loader

    def _place(self) -> tuple[int, int]:
        membership = self.membership
        assert membership is not None
        return membership.rank, membership.world_size

    def training_step_args(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """Before ``training_step``: a window's start (admitting replacements), and this member's share of the
        micro-batch for the current membership, rebuilt if the one Lightning passes was made for another."""
        assert self.batches is not None
        if self.replay.current is None:
            j = batch_index(trainer_of(self._owner.lightning_module))
            if not self.window.open:
                self._start_window()
            entries = self.batches.entries(j)
            self.window.add(j, entries)
        else:
            j, entries = self.replay.current
        rank, world = self._place()
        if self.replay.current is not None or self.batches.is_stale(j, rank, world):
            args = (rebuild(self._loader, self._owner, share_of(entries, rank, world)), *args[1:])
        self.weight = weight_of(entries, rank, world)
        return args

    def _start_window(self) -> None:
        membership = self.membership
        assert membership is not None
        if self._rng is not None:  # a replacement's first step: its streams go on from rank 0's at this window
            set_rng_state(self._rng, self._owner.root_device)
            self._rng = None
        self.quiet, self._snapshot = False, None
        trainer = trainer_of(self._owner.lightning_module)
        module = self._owner.lightning_module
        self.window.start(logged=(trainer.current_epoch, logged_state(trainer), MetricMarks(module)))
        self._owner._live_mark()
        if membership.admitting:
            before = membership.members
            self._snapshot = training_state(self._owner, trainer)
            self._admitted_at = time.perf_counter()
            membership.enter_admitted()
            self._owner._live_admitted()
            rank_zero_info(
                f"live: epoch {membership.epoch} admits {[m for m in membership.members if m not in before]}: "
                f"{membership.world_size} members, the state sent in {time.perf_counter() - self._admitted_at:.2f} s"
            )

    # ------------------------------------------------------------------ collectives outside the vote
    def guarded(self, collective: Callable[[], T], alone: Callable[[], T]) -> T:
        """``collective()``, or ``alone()`` (this member's value as if it were the only one) while it may run
        none: a replacement before its first step, or a window whose collective already failed. A failure is
        recorded for the vote and leaves the group, so that peers blocked with this member fail at once too.
        Inside the vote's attempt, or inside another guarded call, a failure propagates instead: the attempt
        aborts, and the outer call does not go on with collectives on a group that is gone."""
        if self.quiet or self.failure is not None:
            return alone()
        if self._inside:
            return collective()
        self._inside = True
        try:
            return collective()
        except RuntimeError as exc:
            self.fail(exc)
            return alone()
        finally:
            self._inside = False

    def save(self, filepath: Any, gather: Callable[[], None]) -> None:
        """A checkpoint's collectives (every rank's state gathered on rank 0): a failure passes the checkpoint
        over, so no partial file is written, and the window's vote then aborts."""
        self.guarded(gather, lambda: None)
        if self.failure is not None:
            rank_zero_warn(f"live: checkpoint {filepath} passed over: {self.failure}")

    def fail(self, exc: BaseException) -> None:
        """A collective failed: record it for the vote and leave the group at once."""
        self.failure = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        self._failed_at = self._failed_at or time.perf_counter()
        traceback.clear_frames(exc.__traceback__)
        assert self.membership is not None
        self.membership.leave()

    # ------------------------------------------------------------------ the committed step
    def optimizer_step(
        self, optimizer: Any, closure: Callable[[], Any], step: Callable[[Callable[[], Any]], Any]
    ) -> Any:
        """The strategy's optimizer step: ``step(closure)`` runs the closure and applies the step (and, for a
        periodic strategy, its sync). An inner step of a window just runs; the one that ends the window is
        committed by the members' vote, either before ``step`` (the strategy has nothing to undo: only a committed
        step reaches the optimizer) or around it (the strategy puts back the window's start before a replay)."""
        owner = self._owner
        if not self.window.open:  # its only micro-batch runs in this step, and a failure already skips it
            self._start_window()
        settings = hyperparameters(optimizer)
        if not owner._live_commits_step():  # inside a period: its samples are recorded, to replay if it aborts
            if owner._live_guards_inner_steps:
                # a failure (or one before) skips the step: the window is trained again whole after its vote aborts.
                # Lightning's closure runs all the same (its training step then skipped), as Lightning requires
                out = self.guarded(lambda: step(closure), closure)
            else:  # no collective in it: it runs (its training step skipped after a failure), the strategy counts it
                out = step(closure)
            self.window.end_step(settings)
            return out
        self.window.now = settings
        if owner._live_step_in_vote:
            return self.run_step(optimizer, closure, step)
        loss = self.run_step(optimizer, closure, None)
        return step(lambda: loss)

    def run_step(
        self, optimizer: Any, closure: Callable[[], Any], step: Callable[[Callable[[], Any]], Any] | None
    ) -> Any:
        """Run the window's last closure (with ``step``: and the step) until the members commit the window,
        replaying the whole window after an abort; returns what the last attempt returned."""
        membership = self.membership
        trainer = trainer_of(self._owner.lightning_module)
        assert membership is not None
        out: list[Any] = []
        # a period's loss may show in an inner step: the steps trained since are lost too
        started, first, replays = min(time.perf_counter(), self._failed_at or float("inf")), [True], []
        self.replay.redone = 0.0

        def attempt() -> None:
            replay, first[0] = not first[0], False
            if self.failure is not None:
                raise WindowFailed(f"a collective of this window failed: {self.failure}")
            with self._voting():
                if not replay:
                    out[:] = [closure() if step is None else step(closure)]
                else:
                    replays.append(time.perf_counter())
                    out[:] = [self.replay.run(optimizer, closure, step)]
                self._owner._live_before_vote()

        before = list(membership.members)
        closes = self._owner._live_closes_window()  # else a step inside the window is committed (ZeRO's first)
        aborted = membership.run_committed(int(trainer.global_step), attempt, self._owner._live_admits)
        self._owner._live_committed()
        if closes:
            self.window.close()
        else:
            self.window.end_step(self.window.now)
        self._failed_at = None
        if self._admitted_at is not None:  # the survivors waited for the replacement's setup in this step
            waited = time.perf_counter() - self._admitted_at
            rank_zero_info(f"live: the first step with the replacement committed {waited:.2f} s after its admission")
            self._admitted_at = None
        if aborted:  # the aborted attempts, the new epoch, and the window's earlier micro-batches trained again
            lost = (replays[-1] if replays else time.perf_counter()) - started + self.replay.redone
            self.failures += aborted
            self.replayed += 1
            self.seconds_lost += lost
            gone = [m for m in before if m not in membership.members]
            rank_zero_info(
                f"live: step {trainer.global_step} replayed after losing {gone or 'a collective'}; epoch "
                f"{membership.epoch} continues with {membership.world_size} members "
                f"({', '.join(membership.members)}); {lost:.2f} s lost"
            )
        return out[0]

    @contextmanager
    def _voting(self) -> Iterator[None]:
        """An attempt's part before the vote: a failure in it propagates (the attempt aborts), and the strategy drops
        what holds the failed group first (the buckets' handles): a peer blocked in a collective with this member
        would otherwise wait out the group's timeout, since the membership tears the group down only then."""
        self._inside = True
        try:
            yield
        except RuntimeError:
            self._owner._live_abort()
            raise
        finally:
            self._inside = False

    def finish_fit(self, optimizer: Any) -> None:
        """At the fit's end inside a window (a period its last steps did not finish): the members vote on the steps
        it trained, and after a loss train them again at the new membership (without the sync the period never
        reached), so that its samples too are trained once."""
        membership, trainer = self.membership, trainer_of(self._owner.lightning_module)
        if membership is None or not self.window.open or not self.window.steps or self.window.micro:
            return
        first, tail = [True], len(self.window.steps)

        def attempt() -> None:
            replay, first[0] = not first[0], False
            if self.failure is not None:
                raise WindowFailed(f"a collective of this window failed: {self.failure}")
            if replay:
                with self._voting():
                    self.replay.run_steps(optimizer)

        aborted = membership.run_committed(int(trainer.global_step), attempt)
        self.window.close()
        if aborted:
            self.failures, self.replayed = self.failures + aborted, self.replayed + 1
            rank_zero_info(
                f"live: the fit's last {tail} steps, a period it ended inside, trained again by "
                f"{membership.world_size} members ({', '.join(membership.members)})"
            )

    def gauges(self) -> dict[str, float]:
        """What the logger shows of it after each step."""
        members = self.membership.world_size if self.membership is not None else 0
        return {
            FT_FAILURES: float(self.failures),
            FT_MEMBERS: float(members),
            FT_REPLAYED: float(self.replayed),
            FT_SECONDS_LOST: self.seconds_lost,
        }
