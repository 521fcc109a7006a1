"""Deferred initialization: a model built on the meta device gets its storage one unit at a time.

A model that does not fit on one rank cannot be built whole on every rank and then sharded. Built on the
meta device instead (shapes and dtypes, no storage: ``ShardedStrategy(stage=3)`` puts ``configure_model``
and ``trainer.init_module()`` there), it is materialized inside the engine's build, so that a rank never
holds more than its shards, one unit's full parameters and the root unit's:

1. The modules are walked in registration order (``named_modules()``). A module that owns tensors that
   are not yet initialized gets storage for them, each tensor object once (a tied weight is one object)
   and in place (:func:`torch.utils.swap_tensors`, so the optimizer's and every module's references stay
   valid), then its ``reset_parameters()`` runs: torch's convention for initializing a meta-built module,
   the one FSDP2 and Lightning's ``ModelParallelStrategy`` use. The tensors it owns that already hold
   values (a weight tied to a module visited earlier, or one built eagerly) keep them: the reset writes
   those into scratch.
2. A trainable parameter's storage is its view of its unit's padded flat buffer (one per flat parameter,
   allocated when the walk first meets the unit). Once every parameter of a unit is initialized the buffer
   goes to the engine, which keeps this rank's shard as the master and frees the full tensors: the buffer
   *is* the flat parameter, so nothing is copied in full.
3. Frozen parameters and buffers are replicated: materialized whole on every rank and kept.

**The same seed gives the same model at any world size.** Every rank runs the same walk from the same
random state: rank 0's CPU generator (and, on CUDA, its device generator) is sent to every rank first
(:func:`rank0_rng`), so ranks that were not seeded alike still build one model and no parameter is
broadcast. Building on the meta device draws no random numbers, and each layer's ``reset_parameters`` is
what its constructor calls, so for standard layers (Linear, Embedding, LayerNorm, Conv, BatchNorm) the walk
replays an eager construction draw for draw and the model equals the eagerly built one. It does not where a
module's own constructor draws its parameters after building its children (the walk initializes a module
before its children), where a module registers its children in another order than it builds them, or where
a weight is tied to the module registered *later* (the walk gives a tied weight the first module's
initialization). On CUDA the walk draws from the device's generator, so it equals a model built eagerly on
that device, not one built on the CPU.

A module that owns meta tensors and defines no ``reset_parameters`` is refused (``ValueError`` naming it)
before anything is allocated.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING

import torch
from torch import nn

from lightning_sync.sync.flat import FlatShard
from lightning_sync.sync.zero.options import storage_bytes

if TYPE_CHECKING:
    from lightning_sync.sync.communicator import Communicator

__all__ = ["DeferredInit", "check_no_hidden_meta", "has_meta", "meta_hidden", "rank0_rng"]

#: The engine's part of a unit: builds the unit's flat parameters from its flat buffers (None where a flat
#: parameter's tensors were all built eagerly and are flattened as usual) and returns the tensors it keeps.
BuildUnit = Callable[[int, list[torch.Tensor | None]], list[torch.Tensor]]


def has_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device (deferred initialization)."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


@contextmanager
def meta_hidden(module: nn.Module) -> Iterator[None]:
    """Inside the block ``module``'s meta tensors are taken out of it (their slots hold None, which every module
    operation skips), so that a whole-module operation that cannot handle them (``module.to(device)``) passes
    over them; they are put back, in place and order, afterwards."""
    hidden = [
        (store, name, t)
        for mod in module.modules()
        for store in (mod._parameters, mod._buffers)
        for name, t in store.items()
        if t is not None and t.is_meta
    ]
    for store, name, _ in hidden:
        store[name] = None
    try:
        yield
    finally:
        for store, name, t in hidden:
            store[name] = t


def _hidden_meta(value: object) -> bool:
    """Whether ``value`` (a module attribute) is, or holds, a meta tensor."""
    if isinstance(value, torch.Tensor):
        return value.is_meta
    if isinstance(value, dict):
        return any(_hidden_meta(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_hidden_meta(v) for v in value)
    return False


def check_no_hidden_meta(module: nn.Module) -> None:
    """Refuse meta tensors a module keeps outside its parameters and buffers (a torchmetrics ``Metric``'s states
    and their defaults are plain attributes): nothing says what their values should be, so neither the walk nor
    a move to a device can give them storage. ``ValueError`` naming the module and the attributes."""
    for name, mod in module.named_modules():
        hidden = sorted(k for k, v in vars(mod).items() if k not in ("_parameters", "_buffers") and _hidden_meta(v))
        if hidden:
            where = f"module {name!r}" if name else "the root module"
            raise ValueError(
                f"{where} ({type(mod).__name__}) keeps tensors built on the meta device outside its parameters and "
                f"buffers ({', '.join(hidden)}), whose values nothing can restore (a torchmetrics Metric's states "
                f"are such tensors); build it with real storage: create metrics in the LightningModule's "
                f"__init__, outside trainer.init_module() and configure_model"
            )


def _own(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The tensors ``module`` itself registers (not its children's)."""
    return [(n, t) for n, t in (*module._parameters.items(), *module._buffers.items()) if t is not None]


def _describe(module: nn.Module) -> str:
    """Name, shape and dtype of every meta tensor, in state order: equal on ranks that built the same model."""
    lines = [
        f"{name}:{tuple(t.shape)}:{t.dtype}"
        for name, t in (*module.named_parameters(), *module.named_buffers())
        if t.is_meta
    ]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


@contextmanager
def rank0_rng(comm: Communicator, module: nn.Module, device: torch.device) -> Iterator[None]:
    """Run the block from rank 0's random state (CPU, and ``device``'s when it is a CUDA device), on every rank.

    A collective (one ``all_gather_object``), which also checks that every rank holds the same meta tensors. A
    rank seeded like rank 0 leaves the block where an eager construction would have left its generator; a rank
    seeded otherwise gets its own state back, untouched, so its later draws (dropout) stay its own."""
    cuda = device.type == "cuda"
    own = (torch.get_rng_state(), torch.cuda.get_rng_state(device) if cuda else None)
    gathered = comm.all_gather_object((_describe(module), *own))
    if any(g[0] != gathered[0][0] for g in gathered):
        raise RuntimeError(
            "ranks hold different meta-device tensors (names, shapes or dtypes differ); every rank must build "
            "the same model in the same way before the engine initializes it"
        )
    cpu0, cuda0 = gathered[0][1], gathered[0][2]
    alike = torch.equal(own[0], cpu0) and (not cuda or torch.equal(own[1], cuda0))
    torch.set_rng_state(cpu0)
    if cuda:
        torch.cuda.set_rng_state(cuda0, device)
    try:
        yield
    finally:
        if not alike:
            torch.set_rng_state(own[0])
            if cuda:
                torch.cuda.set_rng_state(own[1], device)


def _swap_in(t: torch.Tensor, data: torch.Tensor) -> None:
    """Give the meta tensor ``t`` the storage ``data`` in place: the same Python object (which the optimizer,
    tied modules and the engine's plan hold) then has real storage, as ``Module.to_empty`` does under
    ``torch.__future__.set_swap_module_params_on_conversion``."""
    if isinstance(t, nn.Parameter):
        data = nn.Parameter(data, requires_grad=t.requires_grad)
    torch.utils.swap_tensors(t, data)


class DeferredInit:
    """Materializes ``module``'s meta tensors on ``device`` unit by unit (see the module docstring).

    Raises ``ValueError`` at construction when a module that owns meta tensors has no ``reset_parameters``.

    Args:
        module: the model, with some or all of its tensors on the meta device.
        device: where they get their storage.
    """

    def __init__(self, module: nn.Module, device: torch.device | str = "cpu") -> None:
        self.module, self.device = module, torch.device(device)
        self._modules = list(module.named_modules())
        check_no_hidden_meta(module)
        for name, mod in self._modules:
            meta = [n for n, t in _own(mod) if t.is_meta]
            if meta and not callable(getattr(mod, "reset_parameters", None)):
                where = f"module {name!r}" if name else "the root module"
                raise ValueError(
                    f"{where} ({type(mod).__name__}) holds tensors built on the meta device ({', '.join(meta)}) "
                    f"but defines no reset_parameters(); define reset_parameters() to initialize the tensors it "
                    f"owns itself (torch's convention for deferred initialization), or build it with real "
                    f"storage (outside configure_model, or under trainer.init_module(empty_init=False))"
                )
        #: the most bytes of tensors the walk held at once, measured by :meth:`run`: unit buffers, scratch,
        #: replicated tensors and what the engine kept (tensors that were built eagerly are not counted)
        self.peak_bytes = 0
        self._held = 0

    def run(
        self,
        comm: Communicator,
        units: Sequence[Sequence[Sequence[nn.Parameter]]],
        build: BuildUnit,
        alone: bool = False,
    ) -> None:
        """Walk the modules and materialize every meta tensor; ``units[u]`` lists unit ``u``'s flat parameters'
        parameters (in flattening order), and ``build(u, buffers)`` is called once per unit as soon as all of
        its parameters hold their initial values. A collective (:func:`rank0_rng`), unless ``alone``: this rank's
        own random state then, for values its peers replace."""
        self._layouts = [[FlatShard([p.shape for p in ps], comm.world_size, comm.rank) for ps in u] for u in units]
        self._units, self._build = units, build
        self._unit_of = {id(p): u for u, flats in enumerate(units) for ps in flats for p in ps}
        self._buffers: dict[int, list[torch.Tensor]] = {}
        self._pending = [len({id(p) for ps in flats for p in ps if p.is_meta}) for flats in units]
        self._uninitialized = {id(t) for _, mod in self._modules for _, t in _own(mod) if t.is_meta}
        # shapes as built: a stage-3 unit frees its parameters once built, before a module tied to them is visited
        self._shapes = {id(t): t.shape for _, mod in self._modules for _, t in _own(mod)}
        for u, pending in enumerate(self._pending):
            if pending == 0:  # built eagerly: flattened by the engine as usual
                self._complete(u, [None] * len(units[u]))
        with nullcontext() if alone else rank0_rng(comm, self.module, self.device), torch.no_grad():
            for name, mod in self._modules:
                self._visit(name, mod)

    # ------------------------------------------------------------------ the walk
    def _visit(self, name: str, mod: nn.Module) -> None:
        own = _own(mod)
        fresh = [(n, t) for n, t in own if id(t) in self._uninitialized]
        if not fresh:
            return
        for _, t in fresh:
            if t.is_meta:
                self._give_storage(t)
        # tensors that already hold values (tied to an earlier module, or built eagerly) keep them: the reset
        # writes scratch instead, drawing the random numbers an eager construction would have drawn
        kept = [(t, t.data) for _, t in own if id(t) not in self._uninitialized]
        scratch = [torch.empty(self._shapes[id(t)], dtype=t.dtype, device=self.device) for t, _ in kept]
        scratch_bytes = sum(s.numel() * s.element_size() for s in scratch)
        self._note(scratch_bytes)
        for (t, _), s in zip(kept, scratch):
            t.data = s
        where = dict(fresh)
        placed = {n: t.data for n, t in fresh}
        mod.reset_parameters()
        for t, data in kept:
            t.data = data
        del scratch
        self._note(-scratch_bytes)
        self._check_in_place(name, mod, where, placed)
        for _, t in fresh:
            self._uninitialized.discard(id(t))
            u = self._unit_of.get(id(t))
            if u is not None:
                self._pending[u] -= 1
                if self._pending[u] == 0:
                    self._complete(u, self._buffers.pop(u))

    def _give_storage(self, t: torch.Tensor) -> None:
        u = self._unit_of.get(id(t))
        if u is None:  # frozen parameter or buffer: replicated, kept whole on every rank
            data = torch.empty_like(t, device=self.device)
            self._note(data.numel() * data.element_size())
            _swap_in(t, data)
            return
        buffers = []  # the unit's first tensor: every parameter of the unit gets its view of the unit's buffers
        for ps, layout in zip(self._units[u], self._layouts[u]):
            buffer = torch.empty(layout.padded, dtype=ps[0].dtype, device=self.device)
            buffer[layout.total :].zero_()  # the padding is zero, as the engine's own flattening makes it
            self._note(buffer.numel() * buffer.element_size())
            for p, view in zip(ps, layout.views(buffer)):
                if p.is_meta:
                    _swap_in(p, view)
                else:  # built eagerly beside meta ones: moved into the buffer, already initialized
                    view.copy_(p.detach())
                    p.data = view
            buffers.append(buffer)
        self._buffers[u] = buffers

    def _check_in_place(
        self, name: str, mod: nn.Module, where: dict[str, torch.Tensor], placed: dict[str, torch.Tensor]
    ) -> None:
        """``reset_parameters`` must initialize the tensors in place: a parameter object it replaced is not the
        one the optimizer and the engine hold; data it re-pointed is copied back into the storage given."""
        for n, t in where.items():
            now = mod._parameters.get(n) if n in mod._parameters else mod._buffers.get(n)
            if now is not t:
                raise ValueError(
                    f"{type(mod).__name__}.reset_parameters() of module {name!r} replaced {n!r} with a new tensor; "
                    f"deferred initialization needs it to initialize the existing one in place (nn.init.*_ or "
                    f"tensor.copy_)"
                )
            if t.data_ptr() != placed[n].data_ptr():
                placed[n].copy_(t.data)
                t.data = placed[n]

    def _complete(self, u: int, buffers: list[torch.Tensor | None]) -> None:
        kept = self._build(u, buffers)
        seen: set[int] = set()
        storage_bytes(buffers, seen)
        self._note(storage_bytes(kept, seen))  # the shards, made while the full buffers still exist
        still = {t.untyped_storage().data_ptr() for t in kept}
        self._note(
            -storage_bytes([b for b in buffers if b is not None and b.untyped_storage().data_ptr() not in still], set())
        )

    def _note(self, nbytes: int) -> None:
        self._held += nbytes
        self.peak_bytes = max(self.peak_bytes, self._held)
