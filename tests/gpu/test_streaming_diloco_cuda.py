"""Streaming DiLoCo on CUDA (skipped where CUDA is absent).

The codec encodes and decodes on the parameters' device; a checkpoint carries the syncs in flight and the error
feedback as CPU tensors, which a resume on a GPU must bring to the GPU (a CPU error buffer added to a CUDA vector,
or a CPU average given to a CUDA parameter as its gradient, would raise). A run stopped by a step-interval
``ModelCheckpoint`` while a fragment's int4 sync is in flight, resumed with ``ckpt_path``, ends with the
uninterrupted run's weights; the codec's round trip on the GPU is the CPU's, value for value. Two GPUs: the
all-to-all and all-gather of the int4 average on NCCL give every rank the same average, the plain mean's within
a quantization step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _nccl_reference import fit_on_gpu
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_sync import DiLoCoStrategy, comms
from lightning_sync.sync.quantize import CHUNK, OuterCodec, decode, encode
from lightning_sync.testing import Checks, assert_all_ranks_passed, run_distributed

pytestmark = pytest.mark.gpu
HIDDEN = 32
STEPS, CKPT_STEP = 10, 5  # H = 3, F = 2, tau = 2: fragment 1, sent at step 4, is in flight after step 5


def _fit(tmpdir: str, max_steps: int, callbacks: list[Any], ckpt: Path | None = None) -> dict[str, torch.Tensor]:
    strategy = DiLoCoStrategy(sync_every=3, fragments=2, overlap_steps=2, outer_dtype="int4")
    return fit_on_gpu(strategy, HIDDEN, tmpdir, max_steps, callbacks, ckpt)


def test_int4_round_trip_on_the_gpu_is_the_cpus() -> None:
    x = torch.randn(4 * CHUNK)
    for dtype in ("int8", "int4"):
        cpu_buffer, cpu_decoded = encode(x, dtype)
        gpu_buffer, gpu_decoded = encode(x.cuda(), dtype)
        assert torch.equal(gpu_buffer.cpu(), cpu_buffer) and torch.equal(gpu_decoded.cpu(), cpu_decoded)
        assert torch.equal(decode(gpu_buffer, x.numel(), dtype).cpu(), cpu_decoded)


def _stop_and_resume(rank: int, world: int, tmpdir: str) -> dict[str, Any]:
    root = Path(tmpdir)
    whole = _fit(str(root / "whole"), STEPS, [])
    saver = ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=CKPT_STEP, save_top_k=-1)
    _fit(str(root / "first"), CKPT_STEP, [saver])
    ckpt = root / "ckpt" / f"epoch=0-step={CKPT_STEP}.ckpt"
    saved = torch.load(ckpt, map_location="cpu", weights_only=False)
    due = [e["due"] for e in saved["lightning_sync/diloco"].get("in_flight", [])]
    return {"whole": whole, "resumed": _fit(str(root / "resumed"), STEPS, [], ckpt=ckpt), "due": due}


@pytest.mark.timeout(300)
def test_streaming_diloco_resumes_mid_overlap_on_the_gpu(tmp_path: Path) -> None:
    out = run_distributed(_stop_and_resume, 1, str(tmp_path), backend="nccl", timeout=240)[0]
    assert out["due"] == [CKPT_STEP + 1], out["due"]  # the checkpoint was taken with a sync in flight
    for key, value in out["resumed"].items():
        # one process, the same kernels in the same order: equal; a lost sync or error buffer moves ~1e-2
        assert torch.allclose(value, out["whole"][key], rtol=0, atol=1e-6), key


def _nccl_int4(rank: int, world: int) -> tuple[list[str], int]:
    torch.cuda.set_device(rank)
    ck = Checks()
    ctx = comms.CommContext()
    x = torch.randn(1000, generator=torch.Generator().manual_seed(rank)).cuda()
    handle = OuterCodec("int4").start("k", x, ctx)
    handle.advance()
    average = handle.wait()
    exact = ctx.all_reduce(x.clone(), op="avg")
    # two roundings of at most half a step (absmax / 7) each
    ck.true("within a quantization step of the mean", (average - exact).abs().max().item() <= x.abs().max().item() / 7)
    everyone = ctx.all_gather_object(average.cpu())
    ck.true("every rank gets the same average", all(torch.equal(everyone[0], a) for a in everyone))
    return ck.result()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="two NCCL ranks need two CUDA devices")
def test_int4_average_over_nccl() -> None:
    assert_all_ranks_passed(run_distributed(_nccl_int4, 2, backend="nccl", timeout=120), min_checks=2)
