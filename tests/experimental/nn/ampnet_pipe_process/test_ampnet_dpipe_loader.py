# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""AMPnetPipe.interleave with a loader whose len() is not what it yields (an IterableDataset's ``__len__`` is an
estimate), in one two-stage gloo world. Every stage runs ``len(loader)`` micro-batches: a loader that runs out
earlier raises ``ValueError`` on its stage and stops the other (the head used to wait for an abort answer from a
tail that had returned, or the tail for a micro-batch the head never sent), and one that yields more trains on its
first ``len()`` items, exactly as a loader of those items, with a warning."""

import functools
import warnings
from typing import Any, Iterator, List, Tuple

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fairscale.experimental.nn.ampnet_pipe.pipe import AMPnetPipe
from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.nn.pipe.async_schedule import PipelineAbortedError
from fairscale.nn.pipe.messages import SendRecvTransport

Batch = Tuple[torch.Tensor, torch.Tensor]


class _SGD:
    """SGD without momentum (``torch.optim.SGD`` would import torch._dynamo: seconds in every rank)."""

    def __init__(self, params: Any, lr: float) -> None:
        self.params = list(params)
        self.lr = lr

    def step(self) -> None:
        with torch.no_grad():
            for p in self.params:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-self.lr)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


class _Logger:
    def __init__(self) -> None:
        self.losses: List[float] = []

    def transform_input(self, batch: Batch) -> torch.Tensor:
        return batch[0]

    def transform_target(self, batch: Batch) -> torch.Tensor:
        return batch[1]

    def transform_output_before_loss(self, output: torch.Tensor) -> torch.Tensor:
        return output

    def log_loss(self, batch: Batch, loss: torch.Tensor, count: int) -> None:
        self.losses.append(loss.item())

    def check_and_save_weights(self, num_gradients: int) -> None:
        pass


class _Loader:
    """Yields ``items`` but claims ``claimed`` as its len()."""

    def __init__(self, items: List[Batch], claimed: int) -> None:
        self.items = items
        self.claimed = claimed

    def __len__(self) -> int:
        return self.claimed

    def __iter__(self) -> Iterator[Batch]:
        return iter(self.items)


def _data(n: int) -> List[Batch]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)) for _ in range(n)]


def _pipe() -> AMPnetPipe:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 6))
    return AMPnetPipe(module=model, balance=[2, 1], group=dist.group.WORLD, chunks=2, checkpoint="never")


def _finish(pipe: AMPnetPipe) -> None:
    # Every queued send was received and both ranks are done before the next case starts.
    if isinstance(pipe.pipeline.transport, SendRecvTransport):
        pipe.pipeline.transport.flush()
    dist.barrier()


def _case_runs_short(rank: int, short_ranks: Tuple[int, ...]) -> None:
    """The loader of each rank in ``short_ranks`` claims 12 items but yields 10; the others yield 12."""
    pipe = _pipe()
    short = rank in short_ranks
    loader = _Loader(_data(10 if short else 12), 12)
    error = ValueError if short else PipelineAbortedError
    match = r"yielded 10 items, but its len\(\) is 12" if short else "stage .* failed"
    with pytest.raises(error, match=match):
        pipe.interleave(loader, nn.MSELoss(), _SGD(pipe.parameters(), 0.01), _Logger())
    _finish(pipe)


def _case_yields_more(rank: int) -> None:
    """len() 8, yields 10: the same training as a loader of the first 8 items, and a warning on both stages."""
    pipe, logger = _pipe(), _Logger()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe.interleave(_Loader(_data(10), 8), nn.MSELoss(), _SGD(pipe.parameters(), 0.01), logger)
    assert any("yields more than its len() of 8" in str(w.message) for w in caught), [str(w.message) for w in caught]
    _finish(pipe)
    reference, reference_logger = _pipe(), _Logger()
    reference.interleave(_data(10)[:8], nn.MSELoss(), _SGD(reference.parameters(), 0.01), reference_logger)
    _finish(reference)
    for p, q in zip(pipe.parameters(), reference.parameters()):
        assert torch.equal(p, q)
    assert logger.losses == reference_logger.losses and len(logger.losses) == (8 if rank == 1 else 0)


def _world(rank: int, world_size: int) -> None:
    run_cases(
        [
            ("both_short", functools.partial(_case_runs_short, rank, (0, 1))),
            ("head_short", functools.partial(_case_runs_short, rank, (0,))),
            ("tail_short", functools.partial(_case_runs_short, rank, (1,))),
            # After the failed epochs: no message of them is left in flight.
            ("yields_more", functools.partial(_case_yields_more, rank)),
        ]
    )


def test_interleave_loader_length_mismatch() -> None:
    run_distributed(_world, 2, timeout=90)
