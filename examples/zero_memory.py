"""Measured ZeRO memory per rank against the ZeRO paper's formulas, for K = 1, 2 and 4 ranks.

    python examples/zero_memory.py                 # WideMLP (8.4M parameters), AdamW, fp32 and bf16
    python examples/zero_memory.py --worlds 1 2    # fewer world sizes

For each world size K and stage, K gloo ranks train two steps of ``WideMLP`` with AdamW through
:class:`lightning_sync.sync.zero.ZeroEngine` and report, at the step boundary (after backward,
before ``optimizer.step()``; the optimizer state exists from the first step), the bytes of parameter,
gradient and optimizer-state storage the rank holds (distinct storages summed: exact). "DDP" is the
same model unsharded (parameters, gradients, AdamW state). The formula column is
:func:`~lightning_sync.sync.zero.zero_memory_bytes` with the byte counts of the run (fp32 AdamW:
p=4, g=4, K=8; bf16 compute with fp32 masters: p=2, g=2, K=12); stage 3's bound is DDP/K plus the
largest unit. Rank 0's figures are printed (all ranks hold the same within padding).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from lightning_sync.comms import CommContext
from lightning_sync.models.synthetic import WideMLP
from lightning_sync.sync.zero import ZeroEngine, storage_bytes, zero_memory_bytes
from lightning_sync.testing import run_distributed

_MIB = 2**20


def _ddp_bytes(model: torch.nn.Module) -> int:
    """Unsharded: parameters + gradients + AdamW state after one step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, 1024)).sum().backward()
    opt.step()
    state = [t for s in opt.state.values() for t in s.values() if t.dim() > 0]
    return storage_bytes([*model.parameters(), *(p.grad for p in model.parameters()), *state], set())


def _measure(rank: int, world: int, stage: int, param_dtype: str | None) -> dict[str, Any]:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = WideMLP(in_features=1024)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = ZeroEngine(
        model, opt, CommContext(), stage=stage, wrap_policy=["torch.nn.Linear"], param_dtype=param_dtype
    )
    x = torch.randn(16, 1024)
    held: dict[str, int] = {}
    for _ in range(2):
        opt.zero_grad()
        model(x).float().pow(2).mean().backward()
        held = engine.memory_bytes()
        opt.step()
    unit_bytes = engine.largest_unit_numel * (2 if param_dtype else 4)
    return {"held": held, "unit_bytes": unit_bytes, "numel": sum(f.layout.total for f in engine.flats)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    torch.manual_seed(0)
    ddp = _ddp_bytes(WideMLP(in_features=1024))
    print(f"DDP (unsharded, fp32 AdamW): {ddp / _MIB:.1f} MiB per rank\n")
    print("| precision | K | stage | params MiB | grads MiB | optimizer MiB | total MiB | formula MiB | ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for precision, dtype, (p, g, k) in (("fp32", None, (4, 4, 8)), ("bf16", "bf16", (2, 2, 12))):
        for world in args.worlds:
            for stage in (1, 2, 3):
                out = run_distributed(_measure, world, stage, dtype, timeout=600)[0]
                held, total = out["held"], sum(out["held"].values())
                formula = zero_memory_bytes(out["numel"], world, stage, optimizer_bytes=k, param_bytes=p, grad_bytes=g)
                note = (
                    f" (DDP/K + largest unit: {(ddp / world + out['unit_bytes']) / _MIB:.1f})"
                    if stage == 3 and precision == "fp32"
                    else ""
                )
                print(
                    f"| {precision} | {world} | {stage} | {held['params'] / _MIB:.1f} | {held['grads'] / _MIB:.1f} | "
                    f"{held['optimizer'] / _MIB:.1f} | {total / _MIB:.1f} | {formula / _MIB:.1f}{note} | "
                    f"{total / formula:.3f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
