"""``StragglerDetector`` on 3 real gloo ranks with ``SlowRank(rank=1, factor=8)``: every window flags rank 1
and only rank 1, and rank 1's measured time agrees with the sleeps SlowRank itself recorded; without a
straggler nothing is flagged. Training still reaches the single-process reference (the detector only
measures)."""

from __future__ import annotations

import pytest
from _lightning_reference import ENV, _check_against, _quiet_rank, _reference, _state, _TiedModule, _trainer

from lightning_sync import BucketedDDPStrategy
from lightning_sync.diagnostics import SlowRank, StragglerDetector
from lightning_sync.testing import Checks, assert_all_ranks_passed, run_distributed

STEPS, EVERY = 12, 4


def _worker(rank: int, world: int) -> tuple[list[str], int]:
    _quiet_rank()
    ck = Checks()
    module, init = _TiedModule("sgd"), _state(_TiedModule("sgd"))
    ref = _reference(_TiedModule("sgd"), module.ds, world, steps=STEPS)["state"]
    detector, slow = StragglerDetector(every_n_steps=EVERY, threshold=2.0), SlowRank(rank=1, factor=8)
    _trainer(world, BucketedDDPStrategy(), max_steps=STEPS, callbacks=[slow, detector]).fit(module)
    _check_against(ck, "[with the detector]", module, ref, init)
    ck.true("one window per 4 steps", len(detector.windows) == STEPS // EVERY, detector.windows)
    flagged = sorted({r for _, r, _ in detector.flags})
    # SlowRank sleeps 7x rank 1's compute: it takes ~8x the others, far above the threshold 2 even when this
    # machine's contention (3 ranks on 2 cores, beside other tests) makes another rank's window 2x slow
    ck.true(
        "rank 1, and only rank 1, flagged in every window",
        flagged == [1] and len(detector.flags) == STEPS // EVERY,
        (detector.flags, detector.windows),
    )
    ck.true(
        "rank 1's ratio is far above the threshold", all(ratio > 2.5 for _, _, ratio in detector.flags), detector.flags
    )
    if rank == 1:
        # the independent record: SlowRank's own sleeps. Rank 1's measured time per step is that sleep plus
        # its compute, and SlowRank sleeps 7x its compute (waits in collectives taken out, as the detector
        # takes them out), so the measure lies between the sleep and 8/7 of it (+ the optimizer step: 1.6x, 2 ms)
        for w, times in enumerate(detector.windows):
            sleep = sum(slow.delays[w * EVERY : (w + 1) * EVERY]) / EVERY
            ck.true(
                f"window {w}: rank 1's time is its sleep plus its compute",
                sleep <= times[1] <= 1.6 * sleep + 2e-3,
                (times[1], sleep),
            )
    # Without a straggler, one window of 24 steps: a step here takes ~3 ms, so one time slice lost to another
    # process on a busy machine (10-20 ms) would make a 4-step window look 3x slow (seen with the suite's
    # workers sharing 2 cores), but not 24 steps (~1.3x).
    quiet = StragglerDetector(every_n_steps=2 * STEPS, threshold=2.0)
    _trainer(world, BucketedDDPStrategy(), max_steps=2 * STEPS, callbacks=[quiet]).fit(_TiedModule("sgd"))
    ck.true("no straggler, no flag", quiet.flags == [] and len(quiet.windows) == 1, (quiet.flags, quiet.windows))
    return ck.result()


@pytest.mark.timeout(240)
def test_the_slowed_rank_is_flagged_in_every_window_and_no_other() -> None:
    assert_all_ranks_passed(run_distributed(_worker, 3, timeout=180, env=ENV), min_checks=6, same_count=False)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"every_n_steps": 0}, "every_n_steps must be an int >= 1, got 0"),
        ({"every_n_steps": True}, "every_n_steps must be an int >= 1, got True"),
        ({"threshold": 1.0}, "threshold must be a finite number > 1, got 1.0"),
        ({"threshold": float("inf")}, "threshold must be a finite number > 1, got inf"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StragglerDetector(**kwargs)
