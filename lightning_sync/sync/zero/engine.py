"""ZeRO stages 1-3 (Rajbhandari et al., SC 2020): the engine that shards a module's training state.

What is synchronized, and when:

* **Build.** Rank 0's parameters and buffers are broadcast; the trainable parameters are split into
  units (:mod:`lightning_sync.sync.zero.units`) and each unit's parameters into flat, padded, evenly
  sharded :class:`~lightning_sync.sync.zero.flat_param.FlatParam` s; the optimizer is rewritten to step the
  fp32 master shards. Tensors built on the meta device are not broadcast: every rank initializes them from
  rank 0's random state, one unit at a time (:mod:`lightning_sync.sync.zero.materialize`).
* **Backward.** The shared backward engine (:class:`~lightning_sync.sync.backward.BackwardEngine`)
  moves each gradient into its unit's flat gradient buffer as it becomes ready and, once a unit is
  complete, launches its averaging reduce-scatter into the master shards (stages 2/3, overlapped with
  backward; stage 1 launches them all when backward ends). Stage 3 frees a unit's full parameters as
  soon as its gradients are in.
* **Step.** The optimizer steps this rank's shards; stages 1/2 then all-gather the full parameters.
  Stage 3 all-gathers a unit just before its forward (and again before its backward when it was
  resharded after forward), prefetching the next unit's while the current one computes; with a single
  optimizer its step issues the next forward's first gathers (the root's, the first group's and its prefetch).
* **Offload** (``offload=True``): the master shards, their gradients and the optimizer state live on the
  host and the optimizer steps there; each gradient shard is copied out after its reduce-scatter and
  each updated shard copied back for its all-gather (:mod:`lightning_sync.sync.zero.offload`).
* **Activation checkpointing** (``activation_checkpointing=True``): the wrap policy's modules keep only their
  inputs and recompute their activations in backward (:mod:`lightning_sync.sync.zero.recompute`).

Every rank must run the same units in the same order (the collectives are matched by order); the first
backward checks it. A trainable parameter that gets no gradient in an accumulation window is reduced as
zeros (so no peer waits in a collective) and then, as under torch's DDP, is an error on every rank: one
all-reduce of a per-parameter count, after the reduce-scatters, makes it a decision all ranks share;
``find_unused_parameters=True`` opts in to training such parameters on zero gradients instead.

A rank that fails mid-step leaves its peers blocked in that unit's collective until the process group
times out or notices the dead peer; nothing here retries. Under live fault tolerance the strategy then calls
:meth:`ZeroEngine.abort` and puts a buddy snapshot back for the survivors (:mod:`lightning_sync.sync.zero.buddy`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lightning_sync._checks import check_bool
from lightning_sync.sync.backward import UNUSED_PARAMETERS, BackwardEngine
from lightning_sync.sync.bucketing import check_mib
from lightning_sync.sync.communicator import Communicator
from lightning_sync.sync.replicas import broadcast_module_states
from lightning_sync.sync.zero.accounting import clip_grad_norm_, memory_report
from lightning_sync.sync.zero.flat_param import FlatParam, gather_full_params, launch_reduces
from lightning_sync.sync.zero.forward import Stage3Forward
from lightning_sync.sync.zero.materialize import DeferredInit, has_meta
from lightning_sync.sync.zero.offload import HostOffload
from lightning_sync.sync.zero.optimizers import as_optimizers, optimizer_groups, rewrite_optimizers
from lightning_sync.sync.zero.options import check_stage, resolve_dtype, resolve_wrap_policy
from lightning_sync.sync.zero.recompute import ActivationCheckpointing, checkpointed_modules
from lightning_sync.sync.zero.units import Unit, bucket_units, trainable_params, wrap_units

__all__ = ["ZeroEngine"]

_MB = 2**20
#: stage 3's default ``coalesce_mb``: units of up to a few MiB go together, larger ones alone (see ZeroEngine)
DEFAULT_COALESCE_MB = 8.0


class ZeroEngine(Stage3Forward, BackwardEngine):
    """ZeRO stages 1-3 over ``module`` and its ``optimizer``, every collective through ``comm``.

    Building the engine broadcasts rank 0's parameters and buffers, flattens and shards the
    trainable parameters, and rewrites ``optimizer.param_groups`` in place to step the fp32 master
    shards (same groups, same hyperparameters, so LR schedulers keep working). After that:

    * forward/backward as usual: hooks reduce-scatter gradients (stage 1 at the end of backward,
      stages 2/3 unit by unit during it) into the masters' ``.grad``; the module's ``.grad`` stay None
      (each unit is a bucket of the shared :class:`~lightning_sync.sync.backward.BackwardEngine`);
    * ``optimizer.step()`` steps this rank's shards; a post-step hook all-gathers the full parameters
      (stages 1/2); stage 3 gathers each unit just before it runs;
    * :meth:`no_sync` for accumulation micro-steps (no collective; full gradients accumulate locally).

    Args:
        module: the model (its parameters are broadcast from rank 0 and sharded).
        optimizer: a torch optimizer over (some of) ``module``'s parameters, not yet stepped, or several over
            disjoint parameters (:mod:`~lightning_sync.sync.zero.optimizers`); an optimizer whose masters do not
            require grad (Lightning's ``toggle_optimizer`` turned it off) drops the gradients its parameters get and
            issues no reduce-scatter for them, the same on every rank.
        comm: the :class:`~lightning_sync.sync.communicator.Communicator`.
        stage: 1, 2 or 3.
        wrap_policy: stage 3 wrap units (see :func:`~lightning_sync.sync.zero.options.resolve_wrap_policy`;
            None: the whole model).
        prefetch: stage 3: issue the next unit's all-gather while the current one computes, and the next
            forward's first ones as soon as the (single) optimizer has stepped.
        coalesce_mb: stage 3: consecutive units (in forward order) whose full parameters add up to at most this
            many MiB are gathered in one call, and their gradients reduce-scattered in one call: a rank waits once
            for the group instead of once per unit, and up to two groups (the one computing and the one
            prefetched) are gathered at a time instead of two units. 0: one call per unit, as FSDP2.
        reshard_after_forward: stage 3: free a unit's full parameters after its forward.
        param_dtype: dtype parameters are gathered and computed in (None: their own).
        reduce_dtype: dtype gradients are reduced in (None: the compute dtype).
        bucket_cap_mb: stages 1/2: gradient bucket size (each bucket is one flat shard).
        broadcast: broadcast rank 0's parameters and buffers first, and initialize the meta-device ones from rank 0's
            random state; False: build without any collective (a replacement joining a running job, whose values
            then come from its peers: :func:`~lightning_sync.sync.zero.buddy.relayout`).
        init_device: where tensors built on the meta device get their storage (None: the CPU); see
            :class:`~lightning_sync.sync.zero.materialize.DeferredInit` (``ValueError`` when a module that owns
            such tensors has no ``reset_parameters``).
        offload: keep the master shards, their gradients and the optimizer state on the host and step there.
        activation_checkpointing: recompute the activations of the wrap policy's modules in backward (stage 3:
            every wrap unit but the root; stages 1/2: the modules the policy selects); needs a wrap policy.
        find_unused_parameters: train parameters that got no gradient on zero gradients (momentum and weight
            decay still move them, unlike DDP's, which skips them); False (default) raises naming them.
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None,
        comm: Communicator,
        stage: int = 3,
        wrap_policy: Any = None,
        prefetch: bool = True,
        coalesce_mb: float = DEFAULT_COALESCE_MB,
        reshard_after_forward: bool = True,
        param_dtype: Any = None,
        reduce_dtype: Any = None,
        bucket_cap_mb: float = 25.0,
        broadcast: bool = True,
        init_device: torch.device | str | None = None,
        offload: bool = False,
        activation_checkpointing: bool = False,
        find_unused_parameters: bool = False,
    ) -> None:
        check_stage(stage)
        self.find_unused_parameters = check_bool("find_unused_parameters", find_unused_parameters)
        check_mib("bucket_cap_mb", bucket_cap_mb)
        self.coalesce_bytes = int(check_mib("coalesce_mb", coalesce_mb, zero=True) * _MB)
        self._groups: list[list[int]] = []
        self._group_of: dict[int, int] = {}
        check_bool("offload", offload)
        self.activation_checkpointing = check_bool("activation_checkpointing", activation_checkpointing)
        #: the optimizers, each rewritten to step the masters of its own parameters' flat parameters
        self.optimizers = as_optimizers(optimizer)
        self.module, self.comm, self.stage = module, comm, stage
        self.prefetch, self.reshard_after_forward = bool(prefetch), bool(reshard_after_forward)
        self.param_dtype = resolve_dtype(param_dtype, "param_dtype")
        self.reduce_dtype = resolve_dtype(reduce_dtype, "reduce_dtype")
        self._policy = resolve_wrap_policy(wrap_policy)
        self._cap = max(1, int(bucket_cap_mb * _MB))
        self._deferred = DeferredInit(module, init_device or "cpu") if has_meta(module) else None
        #: deferred initialization: the most bytes of tensors this rank held at once while the build materialized
        #: the model (unit buffers, scratch, replicated tensors and the shards kept), measured during the walk;
        #: by construction at most the shards, the frozen parameters and buffers, one unit's and the root unit's
        #: full parameters (and a tied weight's scratch). None for a model built eagerly, which existed whole on
        #: every rank before the build.
        self.init_peak_bytes: int | None = None
        self._broadcast = broadcast
        if broadcast and comm.world_size > 1:
            broadcast_module_states(module, comm)  # the meta ones are initialized alike instead
        self._window_open = False
        self._forward_order: list[int] | None = None
        self._recording: list[int] = []
        self._order_checked = False
        self._frozen_orig: dict[int, torch.Tensor] = {}  # frozen parameters' own data (param_dtype set)
        self._reducing: list[int] = []  # units whose reduce-scatter is issued and not yet finished
        self._launched: set[int] = set()  # ids of those units' flats that were reduced (their optimizer is on)
        trainable = [p.device for p in module.parameters() if p.requires_grad]
        device = torch.device(init_device or "cpu") if self._deferred is not None or not trainable else trainable[0]
        self._offload = HostOffload(device) if offload else None
        self._ac: ActivationCheckpointing | None = None
        self._build()

    # ------------------------------------------------------------------ layout
    def _build(self) -> None:
        names, params = trainable_params(self.module)
        self.names = names
        group_of, self._group_owner = optimizer_groups(self.module, self.optimizers, params)
        name_of = {id(p): n for n, p in zip(names, params)}
        if self.stage < 3:
            members_of = bucket_units(params, group_of, self._cap)
        else:
            members_of = wrap_units(self.module, params, self._policy)
        if self.activation_checkpointing:  # chosen (and refused) before anything is built
            modules = checkpointed_modules(self.module, params, members_of, self._policy, self.stage)
            self._ac = ActivationCheckpointing(modules, self._before_recompute if self.stage == 3 else None)
        plans: list[list[tuple[int, list[nn.Parameter]]]] = []  # per unit: (optimizer group, params) per flat
        for _, _, uparams, _ in members_of:
            by_key: dict[tuple[int, torch.dtype], list[nn.Parameter]] = {}
            for p in uparams:
                by_key.setdefault((group_of[id(p)], p.dtype), []).append(p)
            plans.append([(key[0], ps) for key, ps in by_key.items()])
        built: dict[int, list[FlatParam]] = {}

        flat_args = (self.comm, self.param_dtype, self.reduce_dtype, self.stage)

        def build(ui: int, packed: list[torch.Tensor | None]) -> list[torch.Tensor]:
            built[ui] = [
                FlatParam([name_of[id(p)] for p in ps], ps, g, *flat_args, buf, self._offload)
                for (g, ps), buf in zip(plans[ui], packed)
            ]
            return [t for f in built[ui] for t in (f.master, f.full) if t is not None]

        if self._deferred is not None:  # each unit is built as soon as its parameters are initialized
            self._deferred.run(self.comm, [[ps for _, ps in plan] for plan in plans], build, alone=not self._broadcast)
            self.init_peak_bytes, self._deferred = self._deferred.peak_bytes, None
        else:
            for ui, plan in enumerate(plans):
                build(ui, [None] * len(plan))
        self.units = [Unit(ui, m[0], m[1], built[ui], m[3]) for ui, m in enumerate(members_of)]
        self.flats = [f for u in self.units for f in u.flats]
        slot = {
            id(p): (unit.index, flat, i)
            for unit in self.units
            for flat in unit.flats
            for i, p in enumerate(flat.params)
        }
        self._slot = [(flat, i) for _, flat, i in (slot[id(p)] for p in params)]  # param index -> where it lives
        self.user_params = rewrite_optimizers(self.optimizers, self._group_owner, self.flats)
        self._cast_frozen()
        self._overlap = self.stage > 1  # stage 1 reduces once, when backward ends
        self._init_backward(params)
        self._handles: list[Any] = []
        if self.stage == 3:
            self._install_forward_hooks()
        for opt in self.optimizers:
            if self._offload is not None:  # before the stage 1/2 all-gathers read them
                self._handles.append(opt.register_step_post_hook(lambda *_: self._offload.upload()))
            self._handles.append(opt.register_step_post_hook(self._after_step))
        if self.stage < 3 and self.param_dtype is not None:  # stage 3 casts in every unit's pre-forward
            self._handles.append(self.module.register_forward_pre_hook(self._cast_inputs, with_kwargs=True))
        root = [u for u in self.units if u.is_root]
        self.root = root[0] if root else None
        # launch order of reduce-scatters: reverse forward order, root last (stage 3); bucket order (1/2)
        bucket_of = [slot[id(p)][0] for p in params]
        self._set_buckets(bucket_of, len(self.units), self._default_launch_order())

    def _cast_frozen(self) -> None:
        """With ``param_dtype``, frozen floating parameters compute in it too; their own data is kept
        (for checkpoints, :func:`~lightning_sync.sync.zero.checkpoint.full_state_dict` and :meth:`unshard`)."""
        if self.param_dtype is None:
            return
        for p in self.module.parameters():
            if not p.requires_grad and p.is_floating_point():
                original = self._frozen_orig.setdefault(id(p), p.data)
                p.data = original.to(self.param_dtype)

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The engine's one optimizer (None without); with several, :attr:`optimizers` and :meth:`optimizer_of`."""
        if len(self.optimizers) > 1:
            raise AttributeError(
                f"this ZeroEngine has {len(self.optimizers)} optimizers: use engine.optimizers or engine.optimizer_of"
            )
        return self.optimizers[0] if self.optimizers else None

    def optimizer_of(self, flat: FlatParam) -> torch.optim.Optimizer | None:
        """The optimizer that steps ``flat``'s master (None in an engine without optimizers)."""
        return self.optimizers[self._group_owner[flat.group][0]] if flat.group >= 0 else None

    def flats_of(self, optimizer: torch.optim.Optimizer) -> list[FlatParam]:
        """The flat parameters ``optimizer`` steps, in the engine's order."""
        return [f for f in self.flats if self.optimizer_of(f) is optimizer]

    # ------------------------------------------------------------------ the backward engine's steps
    _engage_in_no_sync = True  # gradients must leave the (view / freed) parameters in every backward

    def _store(self, index: int, p: torch.Tensor) -> None:
        if p.grad is not None:
            flat, i = self._slot[index]
            if flat.master.requires_grad:  # else its optimizer is toggled off: dropped, no full gradient is kept
                flat.accumulate(i, p.grad)
            p.grad = None

    def _on_begin_backward(self) -> None:
        if not self._window_open:
            self._window_open = True
            for f in self.flats:
                f.start_window()

    def _on_bucket_complete(self, bucket: int) -> None:
        unit = self.units[bucket]
        if self.stage == 3 and not unit.is_root:
            for f in unit.flats:
                f.free()

    def _launch(self, bucket: int) -> None:
        unit = self.units[bucket]
        group = self._group(unit) if self.stage == 3 else []
        if group and unit is not group[0]:
            return  # units launch in reverse forward order: the group's first unit comes last and issues it all
        units = group or [unit]
        if self.stage > 1:
            # one reduce-scatter in flight, as FSDP2 keeps: the previous unit's (group's) is finished (its full
            # gradients freed) before the next is issued, so a rank holds two units' (groups') full gradients at most
            for b in list(self._reducing):
                self._wait(b)
        flats = [f for u in units for f in u.flats if f.master.requires_grad]  # toggled alike on every rank
        if flats:
            launch_reduces(flats, self.comm)
            self._launched.update(id(f) for f in flats)
        self._reducing.extend(u.index for u in units)

    def _wait(self, bucket: int) -> None:
        if bucket not in self._reducing:  # finished when the next one was issued
            return
        self._reducing.remove(bucket)
        for f in self.units[bucket].flats:
            if id(f) in self._launched:
                self._launched.discard(id(f))
                f.finish_reduce()

    def _after_backward(self, synced: bool) -> None:
        if synced:
            self._window_open = False
            if self._offload is not None:
                self._offload.synchronize()  # the gradients are on the host before anything reads them
        if self.stage == 3:
            self.reshard()
            if not self._order_checked:
                self._check_forward_order()
        if synced and not self.find_unused_parameters and self._used:
            self._raise_if_unused()

    def _raise_if_unused(self) -> None:
        """Every rank raises alike once a parameter got no gradient on any rank. The count is all-reduced after
        every reduce-scatter was issued: a rank missing a gradient issues its last ones later than its peers,
        and the collectives must stay in one order on every rank."""
        device = self.flats[0].device
        on = [flat.master.requires_grad for flat, _ in self._slot]  # a toggled-off optimizer's take no gradient
        counts = torch.tensor([int(o and not u) for o, u in zip(on, self._used)], dtype=torch.int32, device=device)
        self.comm.all_reduce(counts, op="sum")
        missing = [(self.names[i], c) for i, c in enumerate(counts.tolist()) if c]
        if missing:
            world = self.comm.world_size
            named = ", ".join(f"{name!r} (on {c} of {world} ranks)" for name, c in missing)
            raise RuntimeError(
                f"{UNUSED_PARAMETERS} ZeroEngine: parameters {named} received no gradient in this accumulation "
                f"window (they were reduced as zeros, so no peer hung). If parameters are unused on purpose, pass "
                f"find_unused_parameters=True; otherwise check that the loss depends on them."
            )

    # ------------------------------------------------------------------ optimizer step
    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """All-gather the master shards ``optimizer`` updated (every one when None) into the full parameters: at
        stages 1/2 all of them, at stage 3 those of a unit gathered now (the root, kept between the forwards of one
        step function under manual optimization); the others are gathered from the masters before they run."""
        flats = self.flats if optimizer is None else self.flats_of(optimizer)
        if self.stage == 3:
            flats = [f for f in flats if f.full is not None]
        works = [f.refresh_full() for f in flats]
        for work in works:
            work.wait()
        for f in flats:
            f._gather_src = None
        if self.stage == 3 and optimizer is not None:
            self._prefetch_next_step()

    def after_load(self) -> None:
        """Re-derive the full parameters from freshly loaded master shards (stages 1/2; stage 3 drops what it
        gathered, a prefetch included, so that the next forward gathers the loaded values) and the compute copies
        of frozen parameters."""
        self.reshard()
        if self._offload is not None:
            self._offload.upload()
        if self.stage < 3:
            self._after_step(None, None, None)
        self._cast_frozen()

    def abort(self) -> None:
        """Forget a step that failed part way (a peer lost mid-collective, its group gone): nothing in flight is
        waited for, no gradient is kept, and the next backward starts afresh. The masters stay as they are."""
        self.abort_backward()
        self._window_open = False
        self._reducing, self._launched = [], set()
        if self._offload is not None:
            self._offload.forget()
        for f in self.flats:
            f.abort()

    # ------------------------------------------------------------------ inspection
    def memory_bytes(self) -> dict[str, int]:
        """Bytes of parameter, gradient and optimizer-state storage this rank holds now (each storage once),
        device and host together (:meth:`memory_report` keeps them apart)."""
        report = self.memory_report()
        return {part: report["device"][part] + report["host"][part] for part in report["device"]}

    def memory_report(self) -> dict[str, dict[str, int]]:
        """:meth:`memory_bytes` by where the bytes live (:func:`~lightning_sync.sync.zero.accounting.memory_report`)."""
        return memory_report(self)

    @property
    def largest_unit_numel(self) -> int:
        return max((u.numel for u in self.units), default=0)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the masters' gradients by the *global* norm, all ranks' shards together; a collective
        (:func:`~lightning_sync.sync.zero.accounting.clip_grad_norm_`)."""
        return clip_grad_norm_(self, max_norm, norm_type)

    def original(self, t: torch.Tensor) -> torch.Tensor:
        """What a checkpoint stores for the module tensor ``t``: a frozen parameter's own data when
        ``param_dtype`` gave it a compute copy, else ``t`` itself."""
        return self._frozen_orig.get(id(t), t)

    def full_params(self) -> dict[str, torch.Tensor]:
        """Canonical name -> full parameter in its original dtype, gathered from the master shards (full
        precision whatever ``param_dtype`` is); a collective. What :meth:`unshard` puts back into the module
        and what the checkpoints of :mod:`lightning_sync.sync.zero.checkpoint` write."""
        return gather_full_params(self.flats, self.comm)

    def unshard(self) -> None:
        """Leave the module with its full parameters (stage 3 gathers every unit) and remove the hooks:
        after training the module is an ordinary module with the trained weights on every rank."""
        params = self.full_params()
        self.reshard()
        with torch.no_grad():
            for f in self.flats:
                for name, p in zip(f.names, f.params):
                    p.data = params[name]
            for p in self.module.parameters():
                if id(p) in self._frozen_orig:
                    p.data = self._frozen_orig[id(p)]
        self.close()

    def close(self) -> None:
        """Remove the hooks; the module keeps its current (possibly empty, stage 3) parameters."""
        if self._ac is not None:
            self._ac.remove()
            self._ac = None
        self._remove_grad_hooks()
        for h in self._handles:
            h.remove()
        self._handles = []
