"""``ShardedStrategy``'s part in live fault tolerance: windows of ``snapshot_every`` steps, each starting from a
buddy snapshot of every rank's shards.

Under ZeRO a lost rank takes its shards with it, so the survivors cannot go on from where they are, as
``bucketed_ddp``'s do. They go back to a :class:`~lightning_sync.sync.zero.buddy.BuddySnapshot`, rebuild it sharded
over their new number (a lost rank's slices come from the copy its buddy holds) and train the steps since again, on
the same samples. So a live window is ``snapshot_every`` optimizer steps:

* its last step runs inside the members' commit vote, and takes the snapshot of the state it leaves: each rank's own
  copy at once, in host memory, and the copy for its buddy sent point to point, asynchronously;
* the snapshot travels while the next window's first step trains, and that step's attempt waits for it and is
  committed by a vote too: from then on it is the snapshot a replay goes back to. A loss before that goes back to
  the snapshot before, and replays the window before as well (:meth:`WindowRecord.reopen_previous`);
* its other steps run as they come; the first collective to fail records the loss, and the rest of the window is
  skipped (no training step, no optimizer step) up to its next vote, which aborts;
* after the abort the survivors put the snapshot back at their new membership (:meth:`ShardedLive._live_reset`) and
  train the steps since again (:class:`~lightning_sync.strategies._live_window.WindowReplay`).

Work lost to a failure is at most ``snapshot_every`` steps, or ``snapshot_every + 1`` for a loss in the step that
waits for the snapshot. With ``snapshot_async=False`` the window's last step waits for its snapshot inside its own
vote instead: at most ``snapshot_every`` steps, and the copy's transfer on the critical path. A replacement is
admitted only after a window's last step that waited for its snapshot (its members see a replacement waiting), so a
heal starts from a snapshot every buddy holds. The snapshots cost each
rank host memory for two copies of its shards (its own and its buddy's: parameters and per-element optimizer state,
in the master dtype), and twice that while the next one travels: :meth:`ShardedLive.snapshot_bytes`, logged as
``ft/snapshot_mib``. Every collective the strategy runs outside a vote (evaluation steps, accumulation
micro-batches, checkpoints, gathered callbacks) is guarded: a failure there is recorded for the vote, never raised
into Lightning's loop, and a checkpoint it interrupts is passed over.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, TypeVar

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_sync._lightning import next_restored, unwrap_optimizer
from lightning_sync.comms.membership_keys import place_of
from lightning_sync.strategies._sharded_checkpoint import optimizer_state_of
from lightning_sync.sync.zero.buddy import BuddySnapshot, PendingSnapshot, ShardsLost, relayout, take_snapshot

__all__ = ["FT_SNAPSHOT_MIB", "ShardedLive"]

T = TypeVar("T")

FT_SNAPSHOT_MIB = "ft/snapshot_mib"


class ShardedLive:
    """The live window of a ZeRO strategy (module docstring); a mixin before the strategy's other bases."""

    live: Any
    engine: Any
    snapshot_every: int
    snapshot_async: bool
    comm: Any
    precision_plugin: Any

    _live_capable = True
    _live_step_in_vote = True  # the window's last step, and the snapshot it leaves, are what the members commit
    _live_guards_inner_steps = True  # every step gathers and reduce-scatters

    def _init_live(self) -> None:
        self._buddy: BuddySnapshot | None = None  # the newest snapshot every buddy holds: what a replay goes back to
        self._start_safe = True  # _buddy is the state at this window's start (else the window's before: see above)
        self._pending: PendingSnapshot | None = None  # the snapshot of this window's start, on its way to the buddies
        self._taken: PendingSnapshot | None = None  # taken in this attempt: the next window's start once committed
        self._arrived: BuddySnapshot | None = None  # _pending, arrived in this attempt: safe once committed
        self._settled = False  # _taken arrived in this attempt too: the commit may admit replacements
        self._handover = False  # dumping the checkpoint a replacement heals from

    def _guard(self, collective: Callable[[], T], alone: Callable[[], T]) -> T:
        """``collective()``; live, outside the vote, a failure in it is recorded and ``alone()`` answers instead."""
        return collective() if self.live is None else self.live.guarded(collective, alone)

    def _live_whole(self) -> bool:
        """Whether the engine's shards are whole over the current group (always, unless a loss was left unrecovered:
        a failure recorded, or shards laid out for another number of ranks)."""
        if self.live is None or self.engine is None or not self.engine.flats:
            return True
        laid_out = self.engine.flats[0].layout.world_size
        return self.live.failure is None and torch.distributed.is_initialized() and laid_out == self.comm.world_size

    def snapshot_bytes(self) -> int:
        """Host bytes this rank's buddy snapshots hold now: the one a replay goes back to, and one on its way."""
        held = [self._buddy, self._pending.snapshot if self._pending is not None else None]
        return sum(s.nbytes() for s in held if s is not None)

    # ------------------------------------------------------------------ the window
    @override
    def _live_commits_step(self) -> bool:
        """The window's last step, and its first while the snapshot of its start is on its way: committing that one
        makes the snapshot the one a replay goes back to."""
        return self._live_closes_window() or (self._pending is not None and not self.live.window.steps)

    @override
    def _live_closes_window(self) -> bool:
        return len(self.live.window.steps) + 1 >= self.snapshot_every

    @override
    def _live_mark(self) -> None:
        """A window starts from the snapshot the last one's commit left; the first takes one (every rank, here).
        Before an admission the last step's prefetched gathers land (stage 3): the epoch's group goes next."""
        if self.engine is None:
            return
        if self._buddy is None:
            self._guard(self._first_snapshot, lambda: None)
        if self.live.membership.admitting:
            self._guard(self.engine.reshard, lambda: None)

    def _first_snapshot(self) -> None:
        self._buddy, self._start_safe = self._snapshot().wait(), True
        shards = sum(c.nbytes() for c in self._buddy.own)
        rank_zero_info(
            f"live: a buddy snapshot every {self.snapshot_every} steps: {self._buddy.nbytes() / 2**20:.2f} MiB of "
            f"host memory a rank (its shards, {shards / 2**20:.2f} MiB, and one other rank's)"
        )

    def _snapshot(self) -> PendingSnapshot:
        membership = self.live.membership
        nodes = [str(place_of(m)[0]) for m in membership.members]
        pending = take_snapshot(self.engine, self.comm, membership.members, nodes, membership.host_group)
        pending.snapshot.extra["buffers"] = self._host_buffers()
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is not None:
            pending.snapshot.extra["scaler"] = scaler.state_dict()
        return pending

    @override
    def _live_before_vote(self) -> None:
        """Inside the vote's attempt: the snapshot of this window's start arrives (a peer lost meanwhile aborts the
        step), and the window's last step sends the next one on its way; where replacements wait to be admitted it
        waits for it too, so that a heal after this step starts from a snapshot every buddy holds."""
        if self.engine is None:
            return
        if self._pending is not None:
            self._arrived = self._pending.wait()
        self._taken, self._settled = None, False
        if self._live_closes_window():
            self._taken = self._snapshot()
            if not self.snapshot_async or self.live.membership.replacements_waiting():
                self._taken.wait()
                self._settled = True

    @override
    def _live_admits(self) -> bool:
        return self._settled

    @override
    def _live_committed(self) -> None:
        if self._arrived is not None:
            self._buddy, self._start_safe, self._pending, self._arrived = self._arrived, True, None, None
            self.live.window.forget_previous()
        if self._taken is not None:
            if self._settled:
                self._buddy, self._start_safe = self._taken.snapshot, True
            else:
                self._pending, self._start_safe = self._taken, False
            self._taken, self._settled = None, False

    @override
    def _live_abort(self) -> None:
        self._taken, self._arrived, self._settled = None, None, False
        if self.engine is not None:
            self.engine.abort()

    @override
    def _live_reset(self) -> None:
        """Before a replay, in the new epoch: the window's starting snapshot, sharded over the members now. If that
        snapshot may not have reached every buddy, the one before it, and the window before goes back in the replay."""
        self._live_abort()
        if self.engine is None:
            return
        if not self._start_safe:
            self.live.window.reopen_previous()
            self._pending, self._start_safe = None, True
        if self._buddy is None:
            raise ShardsLost(
                f"{type(self).__name__}: a rank was lost before the first buddy snapshot was complete; this job "
                f"ends here (resume from the newest checkpoint)"
            )
        membership = self.live.membership
        relayout(self.engine, self._buddy, membership.member, membership.members)
        self._put_buffers(self._buddy.extra["buffers"])
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is not None and "scaler" in self._buddy.extra:
            scaler.load_state_dict(self._buddy.extra["scaler"])

    @override
    def on_train_end(self) -> None:
        """A snapshot still on its way when the fit ends arrives before the group goes (no transfer is left open)."""
        super().on_train_end()  # type: ignore[misc]
        pending, self._pending = self._pending, None
        if pending is not None:
            self._guard(pending.wait, lambda: None)

    # ------------------------------------------------------------------ healing a replacement
    def _live_join_first(self) -> bool:
        """A replacement joins (and is healed) before its engine is built: its shards are laid out over the
        membership that admits it. True if this process is one."""
        if self.live is None or not self.live.replacement:
            return False
        self.live.join_now()
        return True

    @override
    def _live_admitted(self) -> None:
        """Every member, the replacements included, takes its shards of the state at the window's start (the
        snapshot's) over the membership that admitted them; a failure here aborts the window, as any other."""
        membership = self.live.membership

        def heal() -> None:
            relayout(self.engine, self._buddy, membership.member, membership.members)

        if self.live.quiet:  # a replacement: its peers wait for it in this collective, which it must run
            try:
                heal()
            except RuntimeError as exc:
                self.live.fail(exc)
        else:
            self._guard(heal, lambda: None)

    @override
    def _live_state(self) -> dict[str, Any]:
        """Where the shards of the window's start are (the snapshot's members and buddy shift), for a replacement to
        take its part in a rollback, and rank 0's module buffers (which no shard holds)."""
        assert self._buddy is not None and self.engine is not None
        return {
            "buddy": {"members": self._buddy.members, "shift": self._buddy.shift},
            "buffers": self._host_buffers(),
            "forward_order": self.engine.forward_order,  # stage 3's groups, which its peers' collectives follow
        }

    @override
    def _live_load(self, state: dict[str, Any]) -> None:
        """A replacement, its engine built without collectives: rank 0's buffers and unit order, and its shards from
        its peers' snapshot, resharded with them (its first collective after the heal, as theirs)."""
        self._put_buffers(state["buffers"])
        if state["forward_order"] is not None:
            self.engine.adopt_forward_order(state["forward_order"])
        self._buddy = BuddySnapshot.empty(state["buddy"]["members"], state["buddy"]["shift"])
        self._buddy.extra["buffers"] = self._host_buffers()
        self._live_admitted()

    def _host_buffers(self) -> dict[str, torch.Tensor]:
        """The module's buffers (each rank's own under ZeRO, in no shard), copied to host memory."""
        return {n: b.detach().to("cpu", copy=True) for n, b in self.engine.module.named_buffers()}

    def _put_buffers(self, saved: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, buffer in self.engine.module.named_buffers():
                buffer.copy_(saved[name])

    @contextmanager
    def _handing_over(self) -> Iterator[None]:
        self._handover = True
        try:
            yield
        finally:
            self._handover = False

    @override
    def _live_handing_over(self) -> AbstractContextManager[None]:
        """The healing checkpoint holds no shards (each member sends them in :meth:`_live_admitted`), only the
        optimizers' hyperparameters."""
        return self._handing_over()

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        if self.live is not None and self.live.replacement:  # what a live peer sent, not the file
            return next_restored(self.lightning_module.trainer)
        return super().load_checkpoint(checkpoint_path, weights_only)  # type: ignore[misc]

    # ------------------------------------------------------------------ collectives outside the vote
    @override
    def backward(self, closure_loss: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        parent = super().backward  # type: ignore[misc]
        return self._guard(lambda: parent(closure_loss, *args, **kwargs), lambda: closure_loss)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self._handover:
            return {}
        parent = super().lightning_module_state_dict  # type: ignore[misc]
        return self._guard(parent, dict)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if self._handover:
            return optimizer_state_of(self.engine, unwrap_optimizer(optimizer), "sharded")
        parent = super().optimizer_state  # type: ignore[misc]
        return self._guard(lambda: parent(optimizer), dict)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        parent = super().save_checkpoint  # type: ignore[misc]
        if self.live is None:
            parent(checkpoint, filepath, storage_options)
        else:  # interrupted, it writes nothing where the checkpoint goes, and the window's vote aborts
            self.live.save(filepath, lambda: parent(checkpoint, filepath, storage_options))

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.live is not None and self.live.failure is not None:
            return  # the checkpoint meant to replace it was passed over: keep it
        super().remove_checkpoint(filepath)  # type: ignore[misc]
