# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""AsyncPipe and AMPnetPipe under PyTorch's collective checker (``TORCH_DISTRIBUTED_DEBUG=DETAIL``).

The checker wraps every process group and compares a fingerprint of each collective, sequence number included,
across the group's ranks before running it. A send or a receive advances that sequence number too, on the two ranks
concerned only, so pipeline messages on the pipeline group made the next collective on it (a user's barrier, an
agreement check of AMPnetPipe's next epoch) fail with "Detected mismatch between collectives" on ranks that all
called it. Our docs send users to this mode to find ranks that diverge: these worlds train each pipeline a couple
of steps under it, compare with a reference (a single-process model, or the same run without the checker), and check
that the groups really are wrapped, and that the messages then travel on a twin of the pipeline group.

Bodies are module-level functions (the suite also runs with ``FAIRSCALE_TEST_START_METHOD=spawn``).
"""

import functools
from typing import Any, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from fairscale.experimental.nn.ampnet_pipe.pipe import AMPnetPipe
from fairscale.fair_dev.testing.engine import init_gloo_world, run_ranks
from fairscale.internal import collectives
from fairscale.nn.pipe import AsyncPipe
from fairscale.nn.pipe.messages import SendRecvTransport

TIMEOUT = 90.0
STEPS, CHUNKS, BATCH, LR = 2, 2, 4, 0.1
Params = Dict[str, Tensor]


def _init(directory: str, rank: int, world_size: int, detail: bool) -> str:
    """A gloo world with the debug level set before the groups exist (the env var is read at ``import torch``, so
    it is set here explicitly either way); returns the class name of the default group's CPU backend."""
    init_gloo_world(directory, rank, world_size, dist.DebugLevel.DETAIL if detail else dist.DebugLevel.OFF)
    return _backend_class(dist.group.WORLD)


def _backend_class(group: Any) -> str:
    return type(group._get_backend(torch.device("cpu"))).__name__


def _wire(pipe: AsyncPipe, group: Any) -> str:
    """What carries the pipeline's messages on this rank: ``"group"`` (the pipeline group itself), ``"none"`` (no
    stage here), or the twin's backend class and ranks, checked to be the cached twin of the group."""
    if pipe.pipeline is None:
        return "none"
    transport = pipe.pipeline.transport
    assert isinstance(transport, SendRecvTransport) and transport.group is group
    if transport.p2p_group is None:
        return "group"
    # Created once: asking again is a cache hit, no collective (only the stages ask here).
    assert collectives.p2p_group(group) is transport.p2p_group
    return f"{_backend_class(transport.p2p_group)}{list(dist.get_process_group_ranks(transport.p2p_group))}"


# ---------------------------------------------------------------------------------------------------- AsyncPipe


def _model() -> nn.Sequential:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


def _input(step: int) -> Tensor:
    return torch.randn(BATCH * CHUNKS, 3, generator=torch.Generator().manual_seed(step))


def _sgd_step(module: nn.Module) -> None:
    # A plain SGD step: constructing torch.optim.SGD imports torch._dynamo, seconds of a rank's time.
    with torch.no_grad():
        for p in module.parameters():
            if p.grad is not None:
                p.add_(p.grad, alpha=-LR)
            p.grad = None


def _reference() -> Params:
    """One process, the whole model: what the stages' layers must equal after the same steps."""
    model = _model()
    for step in range(STEPS):
        model(_input(step)).pow(2).sum().backward()
        _sgd_step(model)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _async_pipe_body(
    directory: str, world_size: int, members: List[int], balance: List[int], rank: int
) -> Tuple[str, str, Params]:
    wrapper = _init(directory, rank, world_size, detail=True)
    group = dist.group.WORLD if len(members) == world_size else dist.new_group(members)
    if rank not in members:
        dist.barrier()
        return wrapper, "not a member", {}
    assert collectives.checked_by_torch(group)
    pipe = AsyncPipe(_model(), balance, group=group, chunks=CHUNKS)
    total = torch.zeros(1)
    for step in range(STEPS):
        x = _input(step).requires_grad_()
        out = pipe(x)
        if pipe.final_stage:
            out.pow(2).sum().backward()
            total += out.detach().pow(2).sum()
        _sgd_step(pipe)
        # Collectives on the pipeline group after its messages: what the checker refused before the fix.
        dist.all_reduce(total, group=group)
        dist.barrier(group=group)
    wire = _wire(pipe, group)
    mine = pipe.partition.named_parameters() if pipe.partition is not None else []
    params = {name: p.detach().clone() for name, p in mine}
    # Another pipe on the same group finds the twin made: no second group, nothing collective (the ranks without a
    # stage ask too), and its messages take the same way.
    again = AsyncPipe(_model(), balance, group=group, chunks=CHUNKS)
    assert _wire(again, group) == wire
    if again.pipeline is not None and pipe.pipeline is not None:
        assert again.pipeline.transport.p2p_group is pipe.pipeline.transport.p2p_group  # type: ignore[attr-defined]
    dist.barrier()
    return wrapper, wire, params


@pytest.mark.parametrize(
    "world_size, members, balance",
    [
        # The world's group, three stages: the middle one sends and receives twice as many messages as the others.
        (3, [0, 1, 2], [1, 2, 2]),
        # A subgroup (global rank 0 outside it) whose last rank holds no stage: it sends and receives nothing, yet
        # joins the group's collectives; the twin then has only the group's members.
        (4, [1, 2, 3], [3, 2]),
    ],
    ids=["world-group-3-stages", "subgroup-with-stageless-member"],
)
def test_async_pipe_trains_under_the_collective_checker(
    tmp_path: Any, world_size: int, members: List[int], balance: List[int]
) -> None:
    body = functools.partial(_async_pipe_body, str(tmp_path), world_size, members, balance)
    results = run_ranks(body, world_size, timeout=TIMEOUT)
    # The checker really wrapped the groups (without it the backend would be ProcessGroupGloo), the twin included:
    # one of the pipeline group's ranks, which a member without a stage helped create but never uses.
    assert [wrapper for wrapper, _, _ in results] == ["_ProcessGroupWrapper"] * world_size
    stages = members[: len(balance)]
    twin = f"_ProcessGroupWrapper{members}"
    expected = [twin if r in stages else "none" if r in members else "not a member" for r in range(world_size)]
    assert [wire for _, wire, _ in results] == expected
    reference = _reference()
    trained: Params = {}
    for _, _, params in results:
        assert not set(trained) & set(params)
        trained.update(params)
    assert sorted(trained) == sorted(reference)
    for name, value in reference.items():
        assert torch.allclose(trained[name], value, rtol=1.3e-6, atol=1e-5), (name, trained[name], value)


# --------------------------------------------------------------------------------------------------- AMPnetPipe


class _PlainSGD:
    """SGD without momentum (``torch.optim.SGD`` would import torch._dynamo: seconds in every rank)."""

    def __init__(self, params: Any) -> None:
        self.params = list(params)

    def step(self) -> None:
        with torch.no_grad():
            for p in self.params:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-LR)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


class _Logger:
    """The transform/logger duck type that ``interleave`` calls; records the losses."""

    def __init__(self) -> None:
        self.losses: List[float] = []

    def transform_input(self, batch: Tuple[Tensor, Tensor]) -> Tensor:
        return batch[0]

    def transform_target(self, batch: Tuple[Tensor, Tensor]) -> Tensor:
        return batch[1]

    def transform_output_before_loss(self, output: Tensor) -> Tensor:
        return output

    def log_loss(self, batch: Tuple[Tensor, Tensor], loss: Tensor, count: int) -> None:
        self.losses.append(loss.item())

    def check_and_save_weights(self, num_gradients: int) -> None:
        pass


def _loader() -> List[Tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, 10, generator=g)
    y = x @ torch.randn(10, 10, generator=g) * 0.3
    return [(x[i : i + 4], y[i : i + 4]) for i in range(0, 24, 4)]


def _ampnet_body(directory: str, detail: bool, rank: int) -> Tuple[str, str, Params, List[float]]:
    wrapper = _init(directory, rank, 2, detail)
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 10))
    pipe = AMPnetPipe(module=model, balance=[2, 3], group=dist.group.WORLD, chunks=3, checkpoint="never")
    optimizer = _PlainSGD(pipe.parameters())
    logger = _Logger()
    # Every epoch starts with AMPnetPipe's agreement check, two collectives on the pipeline group: the second
    # epoch's follow the first epoch's messages.
    for _ in range(STEPS):
        pipe.interleave(_loader(), nn.MSELoss(), optimizer, logger)
    dist.barrier()
    params = {name: p.detach().clone() for name, p in pipe.partition.named_parameters()}  # type: ignore[union-attr]
    assert collectives.checked_by_torch(dist.group.WORLD) == detail
    return wrapper, _wire(pipe, dist.group.WORLD), params, logger.losses


def test_ampnet_pipe_trains_under_the_collective_checker(tmp_path: Any) -> None:
    runs = {}
    for detail in (False, True):
        directory = tmp_path / str(detail)
        directory.mkdir()
        runs[detail] = run_ranks(functools.partial(_ampnet_body, str(directory), detail), 2, timeout=TIMEOUT)
    assert [r[:2] for r in runs[False]] == [("ProcessGroupGloo", "group")] * 2  # without the checker: no twin
    assert [r[:2] for r in runs[True]] == [("_ProcessGroupWrapper", "_ProcessGroupWrapper[0, 1]")] * 2
    for rank in range(2):
        plain, checked = runs[False][rank], runs[True][rank]
        assert sorted(plain[2]) == sorted(checked[2]) and plain[2]
        for name, value in plain[2].items():
            assert torch.allclose(checked[2][name], value, rtol=1e-6, atol=1e-7), (rank, name)
        assert checked[3] == pytest.approx(plain[3], rel=1e-6, abs=1e-7)
    assert len(runs[True][1][3]) == STEPS * len(_loader())  # the last stage logged every micro-batch's loss


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__])
