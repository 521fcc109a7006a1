"""The asynchronous parameter server's state in Lightning's checkpoint
(:class:`~lightning_sync.strategies.async_ps.AsyncParameterServerStrategy`).

Rank 0 writes the server's state, all of it taken under the server's lock at one version V
(:func:`write_snapshot`; what a snapshot holds is :mod:`lightning_sync.sync.ps.state`): the global model
(parameters and buffers), the optimizer state, the LR schedulers' states, and the counters (V, pushes applied and
discarded, the global clock, the staleness histogram, pushes per worker). A push the server had not applied by
then (on its way, or held by the bound) is in none of it. Resuming restores, exactly:

* the server's version V and global clock, so the budget (``max_steps``) counts on from them;
* its parameters, buffers and optimizer state as they were at V;
* the LR schedule: the schedulers' states, step-interval ones still stepped on the global clock;
* the staleness bookkeeping: every worker computes its first gradient on V (it pulls V first), so
  the bound holds from the first push on, and the histogram continues from the saved one.

No push can come between: the server holds pushes that arrive while Lightning is still restoring
the optimizer and schedulers (the workers can reach the server before that) and applies them to the
restored state. With one worker, or at ``max_staleness=0``, a run resumed at an epoch end equals the
uninterrupted run bit for bit (a step sums its gradients in a fixed order). What cannot be exact, or
is not restored:

* the interleaving: at s > 0 with several workers, which pushes share a step and in which order
  they apply depends on timing, before and after the resume, so a resumed run is one of the runs
  the bound allows, not the uninterrupted one;
* each worker's own step count (``trainer.global_step``) and place in the data: Lightning's loop
  state, which rank 0 alone writes, so every worker resumes with rank 0's. At s = 0 they are every
  worker's own; at s > 0 a worker that was ahead of or behind rank 0 resumes at rank 0's;
* the lookahead compensation restarts as at the start of training: its running staleness estimate
  from 0, its reference model from V. It does nothing with one worker or at s = 0 (never stale).

At another world size (K' ranks from a checkpoint of K; the server may be on another rank: nothing saved
is tied to it) all of the server's state above continues (:func:`read_server_state`). Its pushes count on at
K' per global step (the saved ones rescaled to the same global steps' worth, rounded down); the pushes per
worker, counts of workers that K' does not have one to one, start again from 0 (logged). A checkpoint of an
epoch's last step (``every_n_train_steps``) resumes at the next epoch's first batch however many batches an
epoch has now, so at s = 0 the resumed run is synchronous SGD of K' ranks from the checkpoint.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_sync.sync.ps.state import rescaled_pushes

__all__ = ["CKPT_KEY", "read_server_state", "write_snapshot"]

#: where the server's counters stand in a checkpoint
CKPT_KEY = "lightning_sync/async_ps"


def write_snapshot(checkpoint: dict[str, Any], model: nn.Module, snap: dict[str, Any]) -> None:
    """Put the server's ``snap`` (:meth:`~lightning_sync.sync.ps.server.ParameterServer.snapshot`) into
    Lightning's ``checkpoint`` in place of rank 0's own: its parameters and buffers as ``model``'s state dict,
    its optimizer and schedulers (where it has an optimizer), and its counters under :data:`CKPT_KEY`."""
    live = {id(t): v for t, v in zip([p for p in model.parameters() if p.requires_grad], snap["params"])}
    live.update({id(t): v for t, v in zip(model.buffers(), snap["buffers"])})
    current = model.state_dict(keep_vars=True)
    checkpoint["state_dict"] = {
        k: live[id(v)].to(v.device) if id(v) in live else v.detach() for k, v in current.items()
    }
    if snap["optimizer"] is not None:
        checkpoint["optimizer_states"] = [snap["optimizer"]]
        checkpoint["lr_schedulers"] = snap["schedulers"]
    checkpoint[CKPT_KEY] = snap["state"]


def read_server_state(checkpoint: dict[str, Any], world_size: int, owner: str) -> dict[str, Any] | None:
    """The server's counters in ``checkpoint`` (None: it holds none), for a run of ``world_size`` workers; when
    the checkpoint is of another number, rank 0 logs what carries over (``owner``: the strategy's name)."""
    state = checkpoint.get(CKPT_KEY)
    saved = int(state.get("num_workers", world_size)) if state is not None else world_size
    if state is not None and saved != world_size:
        pushes = rescaled_pushes(int(state["pushes"]), saved, world_size)
        rank_zero_info(
            f"{owner}: the checkpoint is of {saved} workers, this run has {world_size}: the "
            f"server continues from version {state['version']}, global step {state['global_step']} ("
            f"{state['pushes']} pushes of {saved} workers count as {pushes} of {world_size}), its model, "
            f"optimizer, schedulers and staleness histogram; the pushes per worker "
            f"{state.get('pushes_by_worker')} start again from 0"
        )
    return state
