"""What a live window keeps so that it can be trained again, in one process: the record of its micro-batches and
steps, the optimizer settings each step applied, and the periodic strategies' state at a period's start, which a
replay goes back to however often failed attempts wrote into the live tensors."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from lightning_sync.strategies import DiLoCoStrategy, LocalSGDStrategy
from lightning_sync.strategies._live_window import MetricMarks, WindowRecord, hyperparameters, set_hyperparameters
from lightning_sync.sync.periodic import DiLoCoOuter, PeriodicAverager


def test_a_window_records_its_micro_batches_by_step_and_forgets_them_once_committed() -> None:
    window = WindowRecord()
    assert not window.open
    window.start()
    window.add(28, [5, 1])
    window.add(29, [7, 3])
    window.end_step([{"lr": 0.1}])
    window.add(0, [2, 4])  # the next epoch: the entries, not the index, say which samples
    window.add(1, [6, 0])
    assert window.open and window.steps == [([(28, [5, 1]), (29, [7, 3])], [{"lr": 0.1}])]
    assert window.earlier_micro(1) == [(0, [2, 4])]  # the step in progress, before its last micro-batch
    assert window.earlier_micro(2) == [(0, [2, 4]), (1, [6, 0])]  # its last not trained yet (a failure skipped it)
    window.close()
    assert not window.open and window.steps == [] and window.micro == []


def test_the_window_before_goes_back_in_front_until_this_ones_start_is_safe() -> None:
    """ZeRO's window starts from a snapshot still on its way to the buddies: a loss before it arrives replays the
    window before as well, from what was logged at that one's start; once it arrived, never again."""
    window = WindowRecord()
    window.start(logged="first")
    window.add(0, [0])
    window.add(0, [0])  # Lightning's closure run again after a step failed part way: one micro-batch still
    window.end_step([{"lr": 0.1}])
    window.add(1, [1])
    window.now = [{"lr": 0.2}]
    window.close()
    window.start(logged="second")
    window.add(2, [2])
    window.reopen_previous()
    assert window.logged == "first" and window.micro == [(2, [2])]
    assert window.steps == [([(0, [0])], [{"lr": 0.1}]), ([(1, [1])], [{"lr": 0.2}])]
    with pytest.raises(RuntimeError, match="no committed window to reopen"):
        window.reopen_previous()  # taken: a second loss replays from the same start, once
    window.close()
    window.start(logged="third")
    window.forget_previous()
    with pytest.raises(RuntimeError, match="no committed window to reopen"):
        window.reopen_previous()


def test_the_settings_a_step_applied_are_put_back_as_they_were() -> None:
    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([weight], lr=torch.tensor(0.5), momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.1)
    saved = hyperparameters(optimizer)
    scheduler.step()
    assert float(optimizer.param_groups[0]["lr"]) == pytest.approx(0.05)
    assert float(saved[0]["lr"]) == 0.5  # a copy: the scheduler wrote into the group's own tensor
    set_hyperparameters(optimizer, saved)
    assert float(optimizer.param_groups[0]["lr"]) == 0.5 and optimizer.param_groups[0]["momentum"] == 0.9
    assert optimizer.param_groups[0]["params"] == [weight]


def test_a_period_ends_at_each_syncers_sync() -> None:
    params = [torch.zeros(1)]
    averager = PeriodicAverager(params, None, sync_every=3, warmup_steps=2)  # type: ignore[arg-type]
    ends = []
    for _ in range(8):
        ends.append(averager.period_ends_next())
        averager.steps += 1
    assert ends == [True, True, False, False, True, False, False, True]  # each warm-up step is a period
    outer = DiLoCoOuter(params, None, sync_every=3)  # type: ignore[arg-type]
    assert [(outer.steps + k + 1) % 3 == 0 for k in range(6)] == [False, False, True, False, False, True]
    assert outer.period_ends_next() is False
    outer.steps = 2
    assert outer.period_ends_next() is True


class _Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, 2)
        self.register_buffer("seen", torch.zeros(()))


@pytest.mark.parametrize("build", [LocalSGDStrategy, DiLoCoStrategy], ids=["local_sgd", "diloco"])
def test_a_replay_goes_back_to_the_periods_start_however_often_it_was_written_into(build: type) -> None:
    torch.manual_seed(0)
    strategy, module = build(sync_every=4), _Tiny()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    strategy._lightning_module, strategy.model, strategy.optimizers = module, module, [optimizer]
    strategy.averager = strategy._make_syncer()
    strategy.averager.comm = None  # no sync runs here

    def train(steps: int) -> None:
        for _ in range(steps):
            optimizer.zero_grad()
            module.layer(torch.randn(4, 3)).square().sum().backward()
            optimizer.step()
            module.seen += 1
            strategy.averager.steps += 1

    train(2)
    strategy._live_mark()
    want = (
        {k: v.clone() for k, v in module.state_dict().items()},
        [s.clone() for s in (optimizer.state[p]["momentum_buffer"] for p in module.parameters())],
        strategy.averager.steps,
        [g.clone() for g in getattr(strategy.averager, "global_params", [])],  # DiLoCo's global model
    )
    for _ in range(2):  # two failed attempts, each training on from the start, each followed by a reset
        train(3)
        if isinstance(strategy.averager, DiLoCoOuter):
            strategy.averager.global_params[0].data.add_(1.0)
        strategy._live_reset()
        for key, value in want[0].items():
            torch.testing.assert_close(module.state_dict()[key], value, rtol=0, atol=0, msg=key)
        for p, momentum in zip(module.parameters(), want[1]):
            torch.testing.assert_close(optimizer.state[p]["momentum_buffer"], momentum, rtol=0, atol=0)
        assert strategy.averager.steps == want[2]
        for g, value in zip(getattr(strategy.averager, "global_params", []), want[3]):
            torch.testing.assert_close(g, value, rtol=0, atol=0)


def test_a_modules_torchmetrics_go_back_to_the_windows_start() -> None:
    """A replay updates the module's metrics again with the window's micro-batches: put back at its start, each one
    counts once. Tensor states are copied (updates add in place); list states (``cat``) are cut back to their
    length, not copied, as they grow all epoch."""
    from torchmetrics import CatMetric, MeanMetric

    module = torch.nn.Module()
    module.mean, module.seen = MeanMetric(), CatMetric()
    module.mean.update(torch.tensor([1.0, 3.0]))
    module.seen.update(torch.tensor([1.0, 3.0]))
    marks = MetricMarks(module)
    for _ in range(2):  # a failed attempt and a replay that failed again: each time back to the mark
        module.mean.update(torch.tensor([100.0]))
        module.seen.update(torch.tensor([100.0]))
        assert float(module.mean.compute()) > 2.0
        marks.restore()
        assert float(module.mean.compute()) == 2.0 and module.mean._update_count == 1
        assert module.seen.compute().tolist() == [1.0, 3.0]
