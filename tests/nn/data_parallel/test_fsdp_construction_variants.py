# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""How a model was built before FSDP wraps it (a fuzz of model construction, session 49).

* Parameters viewing overlapping memory (``nn.Parameter(other.data[:, :4])``) trained apart under FSDP, silently: now
  refused, naming both; slices of one storage that do not overlap (a checkpoint loaded with ``mmap=True`` and
  ``assign=True``) and frozen overlapping ones still work.
* A module already sharded by torch's ``fully_shard`` (DTensor parameters) failed with an ``AttributeError`` deep in
  the flattening; a complex parameter was told to call ``model.float()``, which keeps it complex.
* A module overriding ``named_parameters()`` (to hide a parameter from an optimizer) made FSDP miss the parameter
  ("fairscale internal error"): FSDP manages every registered parameter.

Two gloo ranks; trained models are compared with the unwrapped model on the whole batch.
"""

import functools
from typing import Any, Callable, Dict, Iterator, Tuple

import pytest
import torch
from torch import Tensor, nn

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP


class _Views(nn.Module):
    """``lin`` and a parameter made from a slice of its weight's storage (``cols`` columns from ``start``)."""

    def __init__(self, start: int, cols: int, frozen: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        storage = torch.randn(4, 12)
        self.lin = nn.Linear(8, 4)
        self.lin.weight = nn.Parameter(storage[:, :8], requires_grad=not frozen)
        self.side = nn.Parameter(storage[:, start : start + cols], requires_grad=not frozen)
        self.out = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.lin(x) + x[:, : self.side.shape[1]] @ self.side.t())


class _HidesHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[Tuple[str, nn.Parameter]]:
        return ((n, p) for n, p in super().named_parameters(*args, **kwargs) if not n.startswith("head"))

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.body(x))


def _trains_like_the_module(rank: int, build: Callable[[], nn.Module], **kwargs: Any) -> None:
    reference, model = build(), FSDP(build(), **kwargs)
    batch = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    for m, x in ((reference, batch), (model, batch[rank * 2 : rank * 2 + 2])):
        trained = [p for _, p in nn.Module.named_parameters(m) if p.requires_grad]  # not an override's
        optimizer = torch.optim.SGD(trained, lr=0.1) if trained else None
        for _ in range(2):
            m(x).pow(2).mean().backward()
            if optimizer is not None:
                optimizer.step()
                optimizer.zero_grad()
    got: Dict[str, Tensor] = model.state_dict()
    for name, want in nn.Module.state_dict(reference).items():
        torch.testing.assert_close(got[name], want, rtol=1e-5, atol=1e-6, msg=name)


def _case_overlapping_views(rank: int) -> None:
    for flatten in (True, False):
        with pytest.raises(ValueError, match="parameters .* view overlapping memory"):
            FSDP(_Views(start=4, cols=4), flatten_parameters=flatten)
    _trains_like_the_module(rank, functools.partial(_Views, start=8, cols=4))  # apart: fine
    frozen = functools.partial(_Views, start=4, cols=4, frozen=True)
    _trains_like_the_module(rank, frozen, flatten_parameters=False)  # frozen: fine


def _case_already_sharded_by_torch() -> None:
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        return

    module = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    fully_shard(module)
    with pytest.raises(ValueError, match="parameter 0.weight is a DTensor: the module was sharded already"):
        FSDP(module)


def _case_complex_parameter() -> None:
    module = nn.Linear(4, 4)
    module.weight = nn.Parameter(torch.randn(4, 4, dtype=torch.cfloat))
    with pytest.raises(ValueError, match="complex parameters are not supported"):
        FSDP(module.float())


def _case_sparse_parameter() -> None:
    module = nn.Linear(2, 2)
    module.weight = nn.Parameter(torch.eye(2).to_sparse())
    with pytest.raises(ValueError, match="parameter weight is a torch.sparse_coo tensor; FSDP shards dense parameters"):
        FSDP(module)


def _body(rank: int, world_size: int) -> None:
    run_cases(
        [
            ("overlapping views", functools.partial(_case_overlapping_views, rank)),
            ("already sharded by torch", _case_already_sharded_by_torch),
            ("complex parameter", _case_complex_parameter),
            ("sparse parameter", _case_sparse_parameter),
            ("named_parameters overridden", functools.partial(_trains_like_the_module, rank, _HidesHead)),
            (
                "named_parameters overridden, flatten_parameters=False",
                functools.partial(_trains_like_the_module, rank, _HidesHead, flatten_parameters=False),
            ),
        ]
    )


def test_construction_variants() -> None:
    run_distributed(_body, 2, timeout=120.0)
