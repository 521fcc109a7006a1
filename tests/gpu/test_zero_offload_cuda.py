"""ZeRO's CPU offload and activation checkpointing on CUDA with NCCL (skipped where CUDA is absent).

One rank per visible GPU. Engine-level: the same few steps (accumulation, norm clipping, dropout) with and
without offload at stages 1, 2 and 3 (and bf16 compute), and with and without activation checkpointing; the
masters, their gradients and the optimizer state must be on the host (the buffers the copies use pinned), the
device must hold no optimizer byte, and every run must equal the single-process run on the same GPU. Through
Lightning: a zero3 fit with both, against the one-process reference of the other NCCL tests.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _nccl_reference import RegressionModule, fit, reference
from support.block_net import Block, batches, make_net, sharded_steps
from support.block_net import reference as block_reference
from torch import nn

from lightning_sync import ShardedStrategy, comms
from lightning_sync.sync.zero import ZeroEngine, full_state_dict, load_sharded, save_sharded
from lightning_sync.testing import run_distributed

pytestmark = pytest.mark.gpu

# (name, stage, wrap policy, engine kwargs, optimizer)
CASES = [
    ("s1", 1, None, {}, "adamw"),
    ("s2", 2, None, {"bucket_cap_mb": 0.001}, "adamw"),
    ("s3", 3, [Block], {}, "adamw"),
    ("s3-nested-bf16", 3, [Block, nn.Linear], {"param_dtype": torch.bfloat16}, "sgd"),
]
ACCUM, STEPS, CLIP = 2, 3, 0.5
# fp32: the runs differ from one another and from the one-process run only in where and in which order sums are
# taken (NCCL's reduce-scatter; the optimizer step on the CPU instead of in CUDA kernels: another rounding of
# the same formula, ~1e-7 relative); 3 steps of lr 0.01 keep that ~1e-7 absolute, while a lost, stale or
# doubled gradient or shard copy moves weights by ~1e-2. bf16 compute: see tests/multiprocess/
# test_zero_offload_recompute.py (5e-3 against the fp32 one-process run; offload vs none compared at 1e-5).
TOL = {"rtol": 0.0, "atol": 1e-5}
BF16_TOL = {"rtol": 0.0, "atol": 5e-3}


def _opt(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)


def _placement(engine: ZeroEngine) -> dict[str, Any]:
    masters = [f.master for f in engine.flats]
    state = [v for s in engine.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {
        "masters": sorted({str(m.device) for m in masters}),
        # what the copies read or write: the gradient buffer (the master's .grad) and the staging buffer
        "pinned": all(m.grad is not None and m.grad.is_pinned() for m in masters)
        and all(s.staging.is_pinned() for s in (engine._offload.shards if engine._offload else [])),
        "state": sorted({str(v.device) for v in state}),
        "module": sorted({p.device.type for p in engine.module.parameters()}),
    }


def _train(rank: int, world: int) -> dict[str, Any]:
    torch.cuda.set_device(rank)
    device, ctx, data, out = torch.device("cuda", rank), comms.CommContext(), batches(STEPS * ACCUM), {}
    for name, stage, policy, kw, kind in CASES:
        for extra in ({}, {"offload": True}, {"activation_checkpointing": True}):
            checkpointed = policy or [Block] if extra.get("activation_checkpointing") else policy  # 1/2: the blocks
            model = make_net(0).to(device)
            opt = _opt(model, kind)
            engine = ZeroEngine(model, opt, ctx, stage=stage, wrap_policy=checkpointed, **kw, **extra)
            torch.cuda.reset_peak_memory_stats(device)
            sharded_steps(engine, model, opt, data, rank, world, ACCUM, CLIP, device=device)
            torch.cuda.synchronize(device)
            out[(name, tuple(extra))] = {
                "sd": {k: v.cpu() for k, v in full_state_dict(engine).items()},
                "report": engine.memory_report(),
                "placement": _placement(engine),
                "peak": torch.cuda.max_memory_allocated(device),
                "calls": sum(b.calls for b in model.blocks),
            }
            engine.close()
    return out


def _checkpoint(rank: int, world: int, path: str) -> dict[str, Any]:
    """zero3 with offload: 2 steps, save; the checkpoint loads into an engine with offload and one without (other
    initial weights), and both take the same next 2 steps as the saving engine."""
    torch.cuda.set_device(rank)
    device, ctx, data, out = torch.device("cuda", rank), comms.CommContext(), batches(4, seed=3), {}
    for name, offload, seed in (("saved", True, 0), ("offload", True, 123), ("plain", False, 123)):
        model = make_net(seed, dropout=0.0).to(device)
        opt = _opt(model, "adamw")
        engine = ZeroEngine(model, opt, ctx, stage=3, wrap_policy=[Block], offload=offload)
        if name == "saved":
            sharded_steps(engine, model, opt, data[:2], rank, world, device=device)
            save_sharded(engine, path)
        else:
            load_sharded(engine, path)
        out[name] = {"loaded": {k: v.cpu() for k, v in full_state_dict(engine).items()}}
        sharded_steps(engine, model, opt, data[2:], rank, world, device=device)
        out[name]["resumed"] = {k: v.cpu() for k, v in full_state_dict(engine).items()}
        out[name]["state"] = sorted({str(v.device) for s in opt.state.values() for v in s.values()})
        engine.close()
    return out


@pytest.mark.timeout(400)
def test_offload_checkpoint_loads_with_and_without_offload_on_cuda(tmp_path: Any) -> None:
    world = torch.cuda.device_count()
    results = run_distributed(_checkpoint, world, str(tmp_path / "ckpt"), backend="nccl", timeout=300)
    for res in results:
        for name in ("offload", "plain"):
            for k, v in res[name]["loaded"].items():  # loading is data movement: exact
                torch.testing.assert_close(v, res["saved"]["loaded"][k], rtol=0, atol=0)
            for k, v in res[name]["resumed"].items():  # the optimizer step on the host or the device: TOL
                torch.testing.assert_close(v, res["saved"]["resumed"][k], **TOL)
        assert res["offload"]["state"] == ["cpu"], res["offload"]["state"]  # the loaded state is on the host
        assert res["plain"]["state"] != ["cpu"], res["plain"]["state"]


@pytest.mark.timeout(400)
def test_offload_and_checkpointing_on_cuda() -> None:
    world = torch.cuda.device_count()
    results = run_distributed(_train, world, backend="nccl", timeout=300)
    device = torch.device("cuda", 0)
    for name, _, _, kw, kind in CASES:
        model = make_net(0).to(device)
        block_reference(model, _opt(model, kind), batches(STEPS * ACCUM), world, ACCUM, CLIP, device=device)
        ref = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        for rank, res in enumerate(results):
            plain, offloaded = res[(name, ())], res[(name, ("offload",))]
            ac = res[(name, ("activation_checkpointing",))]
            for what, run in (("plain", plain), ("offload", offloaded), ("checkpointed", ac)):
                for k, v in run["sd"].items():
                    tol = BF16_TOL if "param_dtype" in kw else TOL
                    torch.testing.assert_close(v, ref[k], **tol, msg=lambda m, what=what, k=k: f"{what} {k}: {m}")
            for k, v in offloaded["sd"].items():  # bf16: a one-ulp difference of a master may round the other way
                torch.testing.assert_close(v, plain["sd"][k], **(BF16_TOL if "param_dtype" in kw else TOL))
            placement = offloaded["placement"]
            assert placement["masters"] == ["cpu"] and placement["pinned"], (name, placement)
            assert placement["state"] == ["cpu"] and placement["module"] == ["cuda"], (name, placement)
            assert plain["placement"]["masters"] == [f"cuda:{rank}"], (name, plain["placement"])
            assert offloaded["report"]["device"]["optimizer"] == 0 and offloaded["report"]["host"]["optimizer"] > 0
            assert ac["calls"] == 2 * plain["calls"], (name, ac["calls"], plain["calls"])  # recomputed once each
            print(
                f"{name} rank {rank}: peak CUDA bytes {plain['peak']} plain, {offloaded['peak']} offloaded, "
                f"{ac['peak']} checkpointed"
            )


def _fit(rank: int, world: int) -> list[torch.Tensor]:
    module = RegressionModule(33, momentum=0.9)
    strategy = ShardedStrategy(stage=3, wrap_policy=["Linear"], offload=True, activation_checkpointing=True)
    assert fit(module, strategy, world) == {"cuda"}
    return [p.detach().cpu() for p in module.parameters()]


@pytest.mark.timeout(400)
def test_sharded_strategy_offload_fit_on_cuda() -> None:
    world = torch.cuda.device_count()
    results = run_distributed(_fit, world, backend="nccl", timeout=300)
    want = reference(world, torch.device("cuda", 0), 33, momentum=0.9)
    for params in results:
        for got, expected in zip(params, want, strict=True):
            torch.testing.assert_close(got, expected, **TOL)
