"""Exact resume: what a checkpoint must carry beyond Lightning's own state, and putting it back.

Lightning restores the weights, the optimizers, the LR schedulers and the loop counters. Two things it does
not restore, and without them a resumed run trains on other samples, or draws other random numbers, than
the run it continues:

* **The position in the epoch.** For an ordinary ``DataLoader`` Lightning restarts the interrupted epoch
  from its first batch. :meth:`ExactResume.install` swaps the training loader's ``DistributedSampler`` for a
  :class:`~lightning_sync.sampler.GlobalOrderSampler` (same order) and gives the loader ``state_dict`` /
  ``load_state_dict``, so Lightning itself saves its state with the fit loop's and hands it back before the
  loader's iterator exists (``FitLoop.setup_data``): workers, persistent or not, then prefetch from the
  right place. The state is the epoch and the position in its global order, the samples all ranks trained
  on together, taken from the loop's count of trained batches when the checkpoint is written (the loader
  itself has already prefetched further). A checkpoint keeps it beside Lightning's state, under
  :data:`POSITIONS` (:func:`stash_positions`), and a strategy of ours puts it back before Lightning restores
  its loops (:func:`unstash_positions`): Lightning's restore refuses loader states for loaders that keep none,
  so a plain Lightning run (``strategy="ddp"``) could not resume from the checkpoint otherwise; it restarts the
  epoch instead, as it does for any ``DataLoader``.
* **Every rank's RNG streams.** torch's CPU generator, the rank's CUDA generator on a CUDA device (GPU
  dropout), and Python's ``random`` and NumPy's global generator (augmentations and sampling in user code).
  Each rank's differ, so :meth:`ExactResume.gather` collects them on rank 0 into the checkpoint with any
  per-rank state of the strategy (one tensor gather of JSON and tensor bytes,
  :mod:`lightning_sync.checkpoint.rank_states`: no rank pickles, calls ``torch.save`` or unpickles what a peer sent;
  the checkpoint holds the same list of per-rank dicts as ever), :meth:`ExactResume.take` picks this rank's entry
  on load, and :meth:`ExactResume.restore_rng` sets the generators at the start of training, after the
  loaders have drawn their base seeds, so training steps draw exactly what the interrupted run drew next.

A lightning_sync strategy owns one :class:`ExactResume` and calls it from its hooks; ``RequeueOnSignal``
stops a run by saving an ordinary checkpoint, so preemption and step-interval checkpoints resume alike.

**Limits.** A loader whose sampler is not a plain ``DistributedSampler`` (Lightning's, or one of yours; a
subclass may order samples its own way, so it is never replaced), a custom batch sampler or an iterable
dataset keeps Lightning's behaviour: it restarts the epoch, and Lightning warns. A custom sampler resumes
exactly if the loader is itself stateful (e.g. torchdata's ``StatefulDataLoader`` over a sampler with
``state_dict``/``load_state_dict``), which is left alone. Randomness drawn
inside ``DataLoader`` worker processes is seeded per epoch by the loader, not continued: a worker's stream
restarts at a resume. A mid-epoch position needs the checkpoint's dataset and seed, and at another world size
or per-rank batch the checkpoint's global batch (see :meth:`GlobalOrderSampler.resume`).

**Another world size.** The position is in samples of the one global order, so it re-splits: ranks r of the
new run take entries r, r + W', ... from it, Lightning's batch counters are shifted to count the same samples
in the new batches (:class:`TrainingLoop`), and every later global batch holds the samples it would have held
in an uninterrupted run. Rank r continues rank r's RNG streams where the checkpoint has them; a strategy's
own per-rank entry is not carried to another world size (the strategy maps its state itself). A checkpoint
written inside an accumulation window counts only the whole windows before it: the window's gradients are
not saved, so its batches are trained again.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch.utils.data import DataLoader, DistributedSampler

from lightning_sync import comms
from lightning_sync._lightning import Stateful
from lightning_sync.checkpoint.rank_states import gather_states
from lightning_sync.sampler import GlobalOrderSampler

__all__ = [
    "POSITIONS",
    "RANK_STATES",
    "ExactResume",
    "host_rng_state",
    "rng_state",
    "set_host_rng_state",
    "set_rng_state",
    "stash_positions",
    "unstash_positions",
]

log = logging.getLogger("lightning_sync")

RANK_STATES = "lightning_sync/rank_states"
"""The checkpoint key of the per-rank states: a list, one entry per rank, each ``{"rng": ..., ...}``."""

POSITIONS = "lightning_sync/data_positions"
"""The checkpoint key of the training loaders' positions, out of Lightning's fit-loop state (module docstring)."""

_OURS = "global_order"  # in a loader state ExactResume wrote: a position in the one seeded global order


def _fit_loop_state(checkpoint: dict[str, Any]) -> dict[str, Any] | None:
    state = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict")
    return state if isinstance(state, dict) else None


def stash_positions(checkpoint: dict[str, Any]) -> None:
    """Move the training loaders' states from Lightning's fit-loop state to :data:`POSITIONS`, when every one
    of them is a position :class:`ExactResume` wrote (a loader stateful of its own keeps its state where
    Lightning restores it)."""
    loop = _fit_loop_state(checkpoint)
    states = loop.get("combined_loader") if loop is not None else None
    if loop is not None and states and all(isinstance(s, dict) and s.get(_OURS) for s in states):
        checkpoint[POSITIONS] = loop.pop("combined_loader")


def unstash_positions(checkpoint: dict[str, Any]) -> None:
    """Put :data:`POSITIONS` back where Lightning restores the loaders' states from (before it does)."""
    states = checkpoint.pop(POSITIONS, None)
    loop = _fit_loop_state(checkpoint)
    if states is not None and loop is not None:
        loop["combined_loader"] = states


class TrainingLoop(Protocol):
    """What the data position needs from the training loop that consumes the loader."""

    def trained(self) -> tuple[int, bool]:
        """Batches of the current epoch trained so far on each rank, and whether the epoch is done."""

    def accumulate(self) -> int:
        """Micro-batches per optimizer step."""

    def restart_at(self, batches: int) -> None:
        """Count ``batches`` of the current epoch as trained on each rank: a checkpoint of another world size
        or batch counted the same samples in batches of another size."""


def host_rng_state() -> torch.Tensor:
    """Python's ``random`` and NumPy's global Mersenne Twister states as one float64 tensor (every field is
    an integer below 2**53 or a float64, so the packing is exact), loadable weights-only.

    Layout: Python's version, its 625 words, whether a Gaussian is cached and its value; NumPy's 624 keys,
    position, whether a Gaussian is cached and its value (1255 numbers).
    """
    version, words, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    py = [float(version), *map(float, words), float(gauss is not None), 0.0 if gauss is None else float(gauss)]
    return torch.tensor([*py, *map(float, keys), float(pos), float(has_gauss), float(cached)], dtype=torch.float64)


_HOST_RNG_NUMEL = 1 + 625 + 2 + 624 + 3


def set_host_rng_state(state: torch.Tensor) -> None:
    """Restore what :func:`host_rng_state` returned (raises ``ValueError`` for a tensor of another length)."""
    values = state.reshape(-1).double().tolist()
    if len(values) != _HOST_RNG_NUMEL:
        raise ValueError(f"a host RNG state holds {_HOST_RNG_NUMEL} numbers, got {len(values)}")
    words = tuple(int(v) for v in values[1:626])
    random.setstate((int(values[0]), words, values[627] if values[626] else None))
    keys = np.array([int(v) for v in values[628:1252]], dtype=np.uint32)
    np.random.set_state(("MT19937", keys, int(values[1252]), int(values[1253]), values[1254]))


def rng_state(device: torch.device) -> dict[str, torch.Tensor | None]:
    """This process's generators: torch's CPU one, Python's and NumPy's, and ``device``'s if it is CUDA."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return {"torch": torch.get_rng_state(), "host": host_rng_state(), "cuda": cuda}


def set_rng_state(state: dict[str, torch.Tensor | None], device: torch.device) -> None:
    """Put back what :func:`rng_state` returned. A CUDA state met by a run on another device is not applied
    (there is no such generator); that is logged."""
    torch.set_rng_state(state["torch"])  # type: ignore[arg-type]
    set_host_rng_state(state["host"])  # type: ignore[arg-type]
    cuda = state.get("cuda")
    if cuda is None:
        return
    if device.type != "cuda":
        log.warning("resume: the checkpoint holds a CUDA RNG state but this run is on %s: not restored", device)
        return
    torch.cuda.set_rng_state(cuda, device)


class ExactResume:
    """The data position and per-rank states of one strategy's checkpoints (see the module docstring)."""

    def __init__(self) -> None:
        self._rng: dict[str, torch.Tensor | None] | None = None  # taken from a checkpoint, set at train start

    # ------------------------------------------------------------------ the data position
    @staticmethod
    def install(loader: Any, loop: TrainingLoop) -> Any:
        """Make a training ``loader`` resumable in place (see the module docstring); returns it. Loaders it
        cannot resume exactly, and loaders that carry state of their own, are returned untouched."""
        batch_sampler = getattr(loader, "batch_sampler", None)
        sampler = getattr(batch_sampler, "sampler", None)
        batch_size = getattr(batch_sampler, "batch_size", None)
        if (
            not isinstance(loader, DataLoader)
            or isinstance(loader, Stateful)
            or not isinstance(batch_size, int)
            or type(sampler) is not DistributedSampler
        ):  # a subclass may order samples its own way
            return loader
        ordered = GlobalOrderSampler(sampler)
        batch_sampler.sampler = ordered

        def state_dict() -> dict[str, Any]:
            batches, epoch_done = loop.trained()
            return {**ordered.state(batches, batch_size, epoch_done, loop.accumulate()), _OURS: True}

        def load_state_dict(state: dict[str, Any]) -> None:
            batches = ordered.resume(state, batch_size, loop.accumulate())
            # inside an epoch (at its start too: a checkpoint written within its first accumulation window)
            # the loop counts what the position says; a finished epoch is the loop's own to close
            if state["position"] or state.get("epoch_done") is False:
                loop.restart_at(batches)
            if not state["position"]:
                return
            if rank_zero_only.rank == 0:
                log.info(
                    "resume: epoch %d continues at sample %d of its global order of %d (%d batches of %d on "
                    "each of %d ranks already trained are skipped)",
                    state["epoch"],
                    state["position"],
                    ordered.total,
                    batches,
                    batch_size,
                    ordered.world_size,
                )

        # instance attributes: the user's DataLoader class stays what it is, and Lightning's ``_Stateful``
        # check (a protocol) sees the two methods
        loader.state_dict = state_dict
        loader.load_state_dict = load_state_dict
        return loader

    # ------------------------------------------------------------------ per-rank states
    @staticmethod
    def gather(
        comm: comms.CommContext,
        extra: dict[str, Any] | None = None,
        device: torch.device | None = None,
    ) -> list[dict[str, Any]] | None:
        """Every rank's RNG states and ``extra`` (its own state of the strategy), collected on rank 0 for the
        checkpoint in one tensor gather through ``comm`` (:func:`~lightning_sync.checkpoint.rank_states.gather_states`);
        None on the other ranks. Every rank must call it. ``extra`` may hold tensors, None, bools, ints,
        floats, strings and lists, tuples and dicts of them; anything else raises ``TypeError``."""
        mine = {"rng": rng_state(device or torch.device("cpu")), **(extra or {})}
        return gather_states(comm, mine, dst=0)

    def take(self, states: Sequence[dict[str, Any]] | None, rank: int, world_size: int) -> dict[str, Any] | None:
        """This rank's entry of the checkpoint's ``states`` (its RNG states are kept for :meth:`restore_rng`);
        None for a checkpoint without them.

        From another world size the entry is None too (what a strategy kept per rank belongs to a rank of
        the other run), but the RNG streams go on where they can: rank r continues rank r's streams for every
        r both runs have, and a rank the checkpoint had no entry for keeps its own seeding (logged once)."""
        self._rng = None
        if states is None:
            return None
        if rank < len(states):
            self._rng = states[rank].get("rng")
        if len(states) == world_size:
            return states[rank]
        if rank == 0:
            log.warning(
                "resume: the checkpoint holds the RNG states of %d ranks, this run has %d: ranks 0-%d continue "
                "their streams, %s",
                len(states),
                world_size,
                min(len(states), world_size) - 1,
                f"ranks {len(states)}-{world_size - 1} keep their seeding"
                if world_size > len(states)
                else "the others' end there",
            )
        return None

    def restore_rng(self, device: torch.device) -> None:
        """Set the generators to the taken RNG states, once (at the start of training)."""
        state, self._rng = self._rng, None
        if state is not None:
            set_rng_state(state, device)
