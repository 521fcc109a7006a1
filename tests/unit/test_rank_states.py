"""Per-rank states packed as a JSON header and one flat tensor buffer, in one process: every kind of value a
strategy's per-rank state holds comes back exactly (same types, same bits), nothing is pickled or saved with
``torch.save``, and anything else is refused by name. The 2-rank gather behind a checkpoint is
``tests/multiprocess/test_lightning_conventions.py`` (its stored RNG states compared bit for bit)."""

from __future__ import annotations

import math
import pickle
import warnings
from collections import OrderedDict
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch

from lightning_sync import comms
from lightning_sync.checkpoint.rank_states import gather_states, pack, unpack
from lightning_sync.resume import rng_state


def _same(a: Any, b: Any, where: str = "state") -> None:
    """``a`` is ``b`` exactly: same types all the way down, floats by their repr (so -0.0, NaN and the last
    bit count), tensors by dtype, shape, device, requires_grad and bytes."""
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, torch.Tensor) and a.layout is torch.sparse_coo:
        assert (a.layout, a.shape, a.is_coalesced(), a.requires_grad) == (
            b.layout,
            b.shape,
            b.is_coalesced(),
            b.requires_grad,
        )
        _same(a._indices(), b._indices(), f"{where} indices")
        _same(a._values(), b._values(), f"{where} values")
    elif isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.device, a.requires_grad) == (b.dtype, b.shape, b.device, b.requires_grad), where
        bits = [t.detach().resolve_conj().contiguous().reshape(-1).view(torch.uint8) for t in (a, b)]
        assert torch.equal(*bits), where
    elif isinstance(a, dict):
        keys = [[(type(k), k) for k in d] for d in (a, b)]  # 1, 1.0 and True are equal keys of other types
        assert keys[0] == keys[1], (where, keys)
        for k in a:
            _same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, float):
        assert repr(a) == repr(b), (where, a, b)
    else:
        assert a == b, (where, a, b)


def _optimizer_states() -> list[dict[str, Any]]:
    """What ``optimizer.state_dict()`` holds after a step: int keys, tuples (betas), None (foreach), bools and
    0-d step tensors."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizers = [
        torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.9, 0.95)),
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
    ]
    for opt in optimizers:
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
    return [opt.state_dict() for opt in optimizers]


def _every_kind() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    return {
        "rng": rng_state(torch.device("cpu")),  # CPU byte tensor, float64 host state, None for CUDA
        "scalars": [None, True, False, 0, 1, -(2**100), 2**63 + 5, 0.1, -0.0, 1e-300, math.inf, -math.inf, "é✓"],
        "nan": math.nan,
        "tuple": (1, (2.5, "x"), []),
        "keys": {1: "int", "1": "str", (2, "a"): "tuple", None: "none", 2.5: "float", False: "bool"},
        "empty": {"list": [], "dict": {}, "tuple": ()},
        "tensors": {
            str(dtype): (torch.randn(2, 3, generator=g) * 10).to(dtype)
            for dtype in (
                torch.float32,
                torch.float64,
                torch.float16,
                torch.bfloat16,
                torch.int64,
                torch.int32,
                torch.int16,
                torch.int8,
                torch.uint8,
                torch.bool,
                torch.complex64,
            )
        },
        "0-d": torch.tensor(3.5),
        "no elements": torch.empty(0, 4, dtype=torch.float64),
        "transposed": torch.arange(12.0).reshape(3, 4).t(),
        "conjugated": torch.tensor([1 + 2j, 3 - 1j]).conj(),
        "requires grad": torch.ones(2, requires_grad=True),
        # a sparse gradient's momentum buffer (Hogwild's embeddings), coalesced or not
        "sparse": torch.sparse_coo_tensor([[0, 2, 0]], torch.tensor([1.0, 2.0, 3.0]), (4,), check_invariants=True),
        "sparse coalesced": torch.sparse_coo_tensor(
            [[0, 1], [1, 0]], torch.ones(2, 3), (2, 2, 3), check_invariants=True
        ).coalesce(),
        "optimizer_states": _optimizer_states(),
        "powersgd": {"q": {0: torch.randn(4, 2, generator=g)}, "error": {0: torch.zeros(4, 4), 3: torch.ones(1)}},
    }


def test_every_kind_of_value_round_trips_exactly_without_pickle_or_torch_save() -> None:
    state = _every_kind()
    refuse = mock.Mock(side_effect=AssertionError("pickled or saved"))
    with (
        mock.patch.object(pickle, "dumps", refuse),
        mock.patch.object(pickle, "loads", refuse),
        mock.patch.object(torch, "save", refuse),
        mock.patch.object(torch, "load", refuse),
    ):
        packed = pack(state)
        back = unpack(packed)
    assert packed.dtype == torch.uint8 and packed.dim() == 1
    # the conjugated view comes back resolved: its values, not its lazy conjugate bit
    state["conjugated"] = state["conjugated"].resolve_conj()
    _same(back, state)


def test_each_tensor_owns_a_compact_copy() -> None:
    """A view into the received buffer would make ``torch.save`` write the whole buffer for each tensor."""
    source = {"a": torch.arange(1000.0), "b": torch.ones(3, dtype=torch.int64)}
    back = unpack(pack(source))
    for key, t in back.items():
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), key
        assert t.untyped_storage().data_ptr() != source[key].untyped_storage().data_ptr(), key


@pytest.mark.parametrize(
    ("value", "where", "kind"),
    [
        ({"lr": np.float64(0.1)}, r"state\['extra'\]\['lr'\]", "numpy.float64"),
        ({"seen": {1, 2}}, r"state\['extra'\]\['seen'\]", "builtins.set"),
        (OrderedDict(a=1), r"state\['extra'\]", "collections.OrderedDict"),
        ([object()], r"state\['extra'\]\[0\]", "builtins.object"),
        ({"w": torch.nn.Parameter(torch.ones(2))}, r"state\['extra'\]\['w'\]", "Parameter"),
    ],
)
def test_anything_else_is_refused_by_where_it_sits_and_its_type(value: Any, where: str, kind: str) -> None:
    with pytest.raises(TypeError, match=f"entry {where} is a .*{kind}"):
        pack({"extra": value})


def test_keys_and_tensors_without_a_plain_form_are_refused() -> None:
    with pytest.raises(TypeError, match=r"entry state\['m'\] has a key of type frozenset"):
        pack({"m": {frozenset({1}): 1}})
    with pytest.raises(TypeError, match=r"entry state\['s'\] is a torch.sparse_csr tensor"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CSR support is beta, torch says
        pack({"s": torch.eye(2).to_sparse_csr()})


def test_a_corrupt_or_foreign_buffer_is_refused() -> None:
    packed = pack({"a": 1})
    with pytest.raises(ValueError, match="header claims"):
        unpack(packed[:10])
    with pytest.raises(ValueError, match="uint8 tensor"):
        unpack(packed.float())
    other = pack({"a": 1})
    other[8 : 8 + len(b'{"format":1')] = torch.frombuffer(bytearray(b'{"format":7'), dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"format 7 is not supported; allowed: \[1\]"):
        unpack(other)


def test_without_a_process_group_the_state_is_this_process_alone_and_a_copy() -> None:
    state = {"t": torch.ones(2), "n": 1}
    states = gather_states(comms.CommContext(), state)
    assert states is not None and len(states) == 1
    _same(states[0], state)
    assert states[0]["t"] is not state["t"]
    with pytest.raises(TypeError, match="numpy"):
        gather_states(comms.CommContext(), {"x": np.int64(1)})
