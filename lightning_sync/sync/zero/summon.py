"""The module's full parameters, for a while, from a :class:`~lightning_sync.sync.zero.engine.ZeroEngine`.

Code written for a plain module - Lightning's weight-averaging, SWA and pruning callbacks, for example -
reads and writes ``module.parameters()`` between steps. Under ZeRO that is not the training state: stage 3
keeps empty tensors there between gathers, and in every stage the fp32 master shards are the source of
truth (stages 1/2 overwrite the module's full parameters at the next step's all-gather, and after fit
the module is rebuilt from the masters). :func:`summon_full_params` (FSDP's
``summon_full_params(writeback=True)``) makes the module a plain one for the duration of a ``with``:

* **Enter.** Every trainable parameter holds its full value in its original dtype, as gathered from the
  master shards (one all-gather per flat parameter, all in flight together). Stages 1/2 whose compute
  dtype is the original one already hold exactly that in their full buffers, so nothing moves. Frozen
  parameters that ``param_dtype`` gave a compute copy show their own data again.
* **Exit.** Each rank compares its own elements of every parameter, as the code left them (even if it
  assigned ``.data`` anew, as torch's pruning does), with the value it was given, and writes into its
  master shard exactly the elements that differ. Code that only reads leaves the masters bit-identical,
  even when the parameters' dtype is narrower than the masters'. Then the stage's state comes back:
  stage 3 frees what it had not gathered (and gathers again, from the updated masters, what it had);
  stages 1/2 hold the written values in their full buffers (all-gathered from the masters when the
  compute dtype differs from the original one).

It is a collective when it gathers: every rank enters it, in the same order, and runs the same code inside
(the written elements of other ranks' shards are written by those ranks). Inside, every rank holds one
full copy of the model in its original dtype, so the model must fit a rank for this to be called: the
peak is that copy on top of what training holds. The module's forward must not run inside it (stage 3's
hooks would gather and free the parameters under it); that is checked at exit.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from lightning_sync.sync.zero.flat_param import FlatParam

if TYPE_CHECKING:
    from lightning_sync.sync.zero.engine import ZeroEngine

__all__ = ["summon_full_params"]


@contextmanager
def summon_full_params(engine: ZeroEngine) -> Iterator[None]:
    """Inside the ``with``, ``engine.module`` holds its full parameters in their original dtypes; changes
    made to them are written back into the master shards on exit. See the module docstring."""
    with torch.inference_mode(False), torch.no_grad():
        for f in engine.flats:
            f.finish_gather()  # a prefetch in flight is a gathered unit from here on
        was_gathered = [f.full is not None for f in engine.flats]
        in_place = [gathered and f.compute_dtype == f.orig_dtype for f, gathered in zip(engine.flats, was_gathered)]
        _gather(engine, [f for f, reuse in zip(engine.flats, in_place) if not reuse])
        frozen = _show_frozen(engine)
    try:
        yield
    finally:
        with torch.inference_mode(False), torch.no_grad():
            _check_whole(engine)
            for f in engine.flats:
                _write_back(f)
            _restore(engine, was_gathered, in_place)
            _hide_frozen(engine, frozen)


def _gather(engine: ZeroEngine, flats: list[FlatParam]) -> None:
    """Point ``flats``' parameters at their full values in the original dtype, all-gathered from the masters."""
    issued = []
    for f in flats:
        buffer = torch.empty(f.layout.padded, dtype=f.master_dtype, device=f.device)
        issued.append((f, buffer, engine.comm.all_gather_into(buffer, f.master.detach(), async_op=True)))
    for f, buffer, work in issued:
        work.wait()
        full = buffer if f.orig_dtype == f.master_dtype else buffer.to(f.orig_dtype)
        for p, view in zip(f.params, f.layout.views(full)):
            p.data = view


def _check_whole(engine: ZeroEngine) -> None:
    for f in engine.flats:
        for name, p, shape in zip(f.names, f.params, f.layout.shapes):
            if p.shape != shape:
                raise RuntimeError(
                    f"summon_full_params: parameter {name!r} has shape {tuple(p.shape)} at exit, "
                    f"{tuple(shape)} expected; code inside must not run the module's forward (stage 3 "
                    f"frees parameters after it) nor reshape parameters"
                )


def _write_back(f: FlatParam) -> None:
    """Write this rank's elements that differ from the masters' (in the original dtype) into the master."""
    master = f.master.detach()
    for s in f.layout.owned_slices():
        new = f.params[s.index].detach().reshape(-1)[s.param_offset : s.param_offset + s.length]
        own = master[s.shard_offset : s.shard_offset + s.length]
        if new.data_ptr() == own.data_ptr():
            continue  # the parameter is a view of the master (stages 1/2, full precision): written in place
        old = own.to(f.orig_dtype)
        changed = (new != old) & ~(new.isnan() & old.isnan())
        if bool(changed.any()):
            own[changed] = new[changed].to(f.master_dtype)


def _restore(engine: ZeroEngine, was_gathered: list[bool], in_place: list[bool]) -> None:
    """Stage 3: free, or gather again what was gathered; stages 1/2: the full buffers hold the new values."""
    refresh: list[tuple[FlatParam, Any]] = []
    for f, gathered, reuse in zip(engine.flats, was_gathered, in_place):
        if reuse:  # the parameters were the full buffer's views (unless code assigned .data: copy it back)
            assert f.full is not None
            _point_at(f, f.full, copy=True)
        elif engine.stage == 3:
            f.free()
            if gathered:
                f.start_gather()
        else:  # the full buffer is in the compute dtype: all-gather it from the updated masters
            refresh.append((f, f.refresh_full()))
    for f in engine.flats:
        if engine.stage == 3 and f._gather_work is not None:
            f.finish_gather()
    for f, work in refresh:
        work.wait()
        f._gather_src = None
        assert f.full is not None
        _point_at(f, f.full, copy=False)


def _point_at(f: FlatParam, full: torch.Tensor, copy: bool) -> None:
    for p, view in zip(f.params, f.layout.views(full)):
        if copy and p.data.data_ptr() != view.data_ptr():
            view.copy_(p.data)
        p.data = view


def _show_frozen(engine: ZeroEngine) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    """Frozen parameters with a ``param_dtype`` compute copy hold their own data inside (as a plain module's)."""
    frozen = []
    for p in engine.module.parameters():
        original = engine.original(p)
        if original is not p:
            frozen.append((p, original))
            p.data = original
    return frozen


def _hide_frozen(engine: ZeroEngine, frozen: list[tuple[torch.nn.Parameter, torch.Tensor]]) -> None:
    for p, original in frozen:
        if p.data.data_ptr() != original.data_ptr():
            original.copy_(p.data)  # code inside assigned .data anew: its values are the parameter's own
        p.data = original.to(engine.param_dtype)
