"""``full_state_dict()``: the trained model, whole, on rank 0, during ``fit`` and after ``fit``, ``validate``
and ``test`` (2 gloo ranks).

ZeRO 1/2/3: every key and shape of the module's own ``state_dict`` (tied names, the frozen layer), its
original dtypes (also with ``param_dtype="bf16"``), and the values the module holds again after teardown,
which are the single-process reference's within ``EQ_TOL``. LocalSGD and DiLoCo: a fit that ends inside a
period leaves every rank its own replica; ``full_state_dict()`` is the synchronized model (the replicas'
average; DiLoCo: the global model of the last outer step), the one a checkpoint's ``state_dict`` holds.
Before the strategy was ever set up the call raises a RuntimeError that says so.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from _lightning_reference import ENV, EQ_TOL, STEPS, _quiet_rank, _reference, _state, _TiedModule, _token_data, _trainer
from torch.nn import functional as F
from torch.utils.data import DataLoader

from lightning_sync import DiLoCoStrategy, LocalSGDStrategy, ShardedStrategy, comms
from lightning_sync.testing import Checks, assert_all_ranks_passed, run_distributed

# The communication context of this process's checks (a strategy owns one the same way).
CTX = comms.CommContext(observer=comms.CommStats())

AVG_TOL = {"rtol": 0.0, "atol": 1e-6}  # the average of 2 fp32 replicas ~1, by all-reduce or here: a few ulps


class _Evaluated(_TiedModule):
    """The tied model (AdamW) with a validation and a test step on the training data."""

    def __init__(self) -> None:
        super().__init__("adamw")

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        ids, y = batch
        self.log("val_loss", F.cross_entropy(self.net(ids, y), y), sync_dist=True)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        ids, y = batch
        self.log("test_loss", F.cross_entropy(self.net(ids, y), y), sync_dist=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(_token_data(16), batch_size=4)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(_token_data(16), batch_size=4)


class _AtTrainEnd(pl.Callback):
    """``full_state_dict()`` during fit, at its last hook before teardown (a collective: every rank)."""

    def __init__(self) -> None:
        self.state: dict[str, torch.Tensor] | None = None

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.state = trainer.strategy.full_state_dict()  # type: ignore[attr-defined]


def _check_full(
    ck: Checks, tag: str, got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], module: torch.nn.Module
) -> None:
    """Rank 0: every key, shape and dtype of ``module.state_dict()``, values bitwise ``want``; else ``{}``."""
    if comms.get_rank() != 0:
        ck.true(f"{tag} other ranks get {{}}", got == {}, list(got))
        return
    own = module.state_dict()
    ck.true(f"{tag} every key of the module, in its order", list(got) == list(own), list(got))
    ck.true(
        f"{tag} every shape and dtype of the module",
        all(k in got and got[k].shape == v.shape and got[k].dtype == v.dtype for k, v in own.items()),
        [(k, tuple(v.shape), v.dtype) for k, v in got.items()],
    )
    for key, value in want.items():
        ck.close(f"{tag} {key}", got.get(key, torch.empty(0)), value)  # tolerance 0


def _sharded(rank: int, world: int) -> tuple[list[str], int]:
    _quiet_rank()
    ck = Checks()
    ds = _token_data()
    ref = _reference(_TiedModule("adamw", ds), ds, world, STEPS)["state"]
    for stage, dtype in ((1, None), (2, None), (3, None), (3, "bf16")):
        tag = f"[zero{stage}{' bf16' if dtype else ''}]"
        module, during = _Evaluated(), _AtTrainEnd()
        strategy = ShardedStrategy(stage=stage, wrap_policy=["Linear"], bucket_cap_mb=0.001, param_dtype=dtype)
        trainer = _trainer(world, strategy, max_steps=STEPS, callbacks=[during])
        trainer.fit(module)
        trained = _state(module)  # teardown unsharded the module: it holds the full trained parameters
        if dtype is None:  # bf16 computes in another precision than the fp32 reference
            for key, value in trained.items():
                ck.close(f"{tag} after fit the module holds the reference's weights: {key}", value, ref[key], **EQ_TOL)
        ck.true(
            f"{tag} the module's parameters are fp32 again", all(v.dtype == torch.float32 for v in trained.values())
        )
        _check_full(ck, f"{tag} during fit:", during.state or {}, trained, module)
        _check_full(ck, f"{tag} after fit:", trainer.strategy.full_state_dict(), trained, module)
        for fn in ("validate", "test"):
            getattr(trainer, fn)(module, verbose=False)
            _check_full(ck, f"{tag} after {fn}:", trainer.strategy.full_state_dict(), trained, module)
    return ck.result()


def _periodic(rank: int, world: int) -> tuple[list[str], int]:
    _quiet_rank()
    ck = Checks()
    for name, strategy in (("local_sgd", LocalSGDStrategy(sync_every=3)), ("diloco", DiLoCoStrategy(sync_every=3))):
        module = _Evaluated()
        trainer = _trainer(world, strategy, max_steps=4)  # syncs after step 3: step 4 drifted
        trainer.fit(module)
        replicas = CTX.all_gather_object(_state(module))
        drift = max((replicas[0][k] - replicas[1][k]).abs().max().item() for k in replicas[0])
        ck.true(f"[{name}] the replicas differ after fit", drift > 1e-6, drift)
        if name == "local_sgd":
            want = {k: sum(r[k] for r in replicas) / world for k in replicas[0]}
            tol = AVG_TOL
        else:  # the global parameters of the outer step after step 3, which the replicas all took then
            outer = trainer.strategy.averager
            global_of = {id(p): g.detach().clone() for p, g in zip(outer.params, outer.global_params)}
            want = {k: global_of.get(id(v), v.detach()) for k, v in module.state_dict(keep_vars=True).items()}
            tol = {"rtol": 0.0, "atol": 0.0}  # copied, not computed
        synchronized = _Evaluated()
        synchronized.load_state_dict(want)
        ids, y = _token_data(16).tensors
        with torch.no_grad():
            loss = F.cross_entropy(synchronized.net(ids, y), y)
        for when in ("fit", "validate", "test"):
            if when != "fit":
                getattr(trainer, when)(module, verbose=False)
                # the evaluation ran on the synchronized model, not on rank 0's replica: per-sample losses in
                # batches of 4 here and of 16 above, means of 4 and 16 values (~1e-7 relative); one replica
                # instead of the average moves the loss by ~1e-3
                metric = trainer.callback_metrics["val_loss" if when == "validate" else "test_loss"]
                ck.close(f"[{name}] {when} evaluates the synchronized model", metric, loss, rtol=1e-5, atol=0.0)
            got = trainer.strategy.full_state_dict()
            if comms.get_rank() != 0:
                ck.true(f"[{name}] after {when}: other ranks get {{}}", got == {}, list(got))
                continue
            ck.true(f"[{name}] after {when}: every key of the module", list(got) == list(module.state_dict()))
            for key, value in want.items():
                ck.close(
                    f"[{name}] after {when}: the synchronized model: {key}", got.get(key, torch.empty(0)), value, **tol
                )
        ck.true(
            f"[{name}] evaluation left this rank's replica as it was",
            all(torch.equal(v, replicas[comms.get_rank()][k]) for k, v in _state(module).items()),
        )
    return ck.result()


@pytest.mark.timeout(300)
def test_sharded_full_state_dict_during_and_after_fit_validate_and_test() -> None:
    assert_all_ranks_passed(run_distributed(_sharded, 2, timeout=240, env=ENV), min_checks=40, same_count=False)


@pytest.mark.timeout(200)
def test_local_sgd_and_diloco_full_state_dict_is_the_synchronized_model() -> None:
    assert_all_ranks_passed(run_distributed(_periodic, 2, timeout=160, env=ENV), min_checks=10, same_count=False)


@pytest.mark.parametrize("strategy", [ShardedStrategy, LocalSGDStrategy, DiLoCoStrategy])
def test_full_state_dict_before_setup_raises_a_clear_error(strategy: Any) -> None:
    with pytest.raises(RuntimeError, match="full_state_dict.*before"):
        strategy().full_state_dict()
