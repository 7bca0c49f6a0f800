# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""AMPnetPipe in real gloo worlds: upstream's interleave tests, parity with a one-process replay of the AMPnet
schedule, the optimizer-step rules, bad input and failures. Bodies are module-level functions."""

import contextlib
import functools
import os
from collections import deque
from typing import Any, Deque, Generator, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fairscale.experimental.nn.ampnet_pipe.ampnet import AsyncAMPnetEventLoop
from fairscale.experimental.nn.ampnet_pipe.pipe import AMPnetPipe
from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.internal.agreement import RanksDisagreeError
from fairscale.nn.pipe.async_schedule import PipelineAbortedError
from fairscale.nn.pipe.messages import RpcTransport, SendRecvTransport

TIMEOUT = 60.0
Batch = Tuple[torch.Tensor, torch.Tensor]


class _PlainSGD:
    """SGD without momentum (``torch.optim.SGD`` would import torch._dynamo: seconds in every rank)."""

    def __init__(self, params: Any, lr: float) -> None:
        self.params = list(params)
        self.lr = lr
        self.steps = 0

    def step(self) -> None:
        self.steps += 1
        with torch.no_grad():
            for p in self.params:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-self.lr)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


class _PredictingSGD(_PlainSGD):
    """Records the weight-prediction calls."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, lr)
        self.predictions: List[Tuple[int, int, int, int, bool]] = []

    def update_weight_using_future_predictions(
        self, cur_rank: int, N: int, count: int, chunks: int, forward: bool
    ) -> None:
        self.predictions.append((cur_rank, N, count, chunks, forward))


class _Logger:
    """The transform/logger duck type of upstream's test; records losses and the counts of weight saves."""

    def __init__(self) -> None:
        self.losses: List[float] = []
        self.counts: List[int] = []
        self.saved: List[int] = []

    def transform_input(self, batch: Batch) -> torch.Tensor:
        return batch[0]

    def transform_target(self, batch: Batch) -> torch.Tensor:
        return batch[1]

    def transform_output_before_loss(self, output: torch.Tensor) -> torch.Tensor:
        return output

    def log_loss(self, batch: Batch, loss: torch.Tensor, count: int) -> None:
        self.losses.append(loss.item())
        self.counts.append(count)

    def check_and_save_weights(self, num_gradients: int) -> None:
        self.saved.append(num_gradients)


class _FailingCriterion:
    """MSE that raises on its ``fail_at``-th call."""

    def __init__(self, fail_at: int) -> None:
        self.calls = 0
        self.fail_at = fail_at

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.fail_at:
            raise ArithmeticError("criterion failed on purpose")
        return nn.functional.mse_loss(output, target)


def _loader(samples: int = 100, batch_size: int = 4) -> List[Batch]:
    """Upstream's fake data set: samples of 10 features, batched by 4; here the target is a fixed linear map."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 10, generator=g)
    y = x @ torch.randn(10, 10, generator=g) * 0.3
    return [(x[i : i + batch_size], y[i : i + batch_size]) for i in range(0, samples, batch_size)]


def _model() -> nn.Sequential:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 10))


def _finish(pipe: AMPnetPipe) -> None:
    # Every queued send was received and every rank is done with this case before the next one starts.
    if pipe.pipeline is not None and isinstance(pipe.pipeline.transport, SendRecvTransport):
        pipe.pipeline.transport.flush()
    dist.barrier()


class _DataSGD(_PlainSGD):
    """SGD on ``param.data``: the backward of a graph recorded before a step then reads the stepped weights, which
    is what AMPnetPipe gives any optimizer (see ``_ParameterAlias``)."""

    def step(self) -> None:
        self.steps += 1
        for p in self.params:
            if p.grad is not None:
                p.data.add_(p.grad, alpha=-self.lr)


Queue = Deque[Tuple[int, torch.Tensor]]


def _wait(queue: Queue) -> Generator[None, None, Tuple[int, torch.Tensor]]:
    while not queue:
        yield
    return queue.popleft()


def _replay_stage(
    s: int, stage: nn.Module, opt: _PlainSGD, loader: List[Batch], acts: List[Queue], grads: List[Queue], interval: int
) -> Generator[None, None, List[float]]:
    """Stage ``s`` of the AMPnet schedule as a generator that yields while it waits for a message."""
    n, last, losses, kept, done = len(loader), len(acts), [], {}, [0]

    def backward(k: int, grad: torch.Tensor) -> None:
        inp, out = kept.pop(k)
        out.backward(grad, retain_graph=True)
        if s > 0:
            grads[s - 1].append((k, inp.grad))
        done[0] += 1
        if done[0] % interval == 0:
            opt.step()
            opt.zero_grad()

    for i in range(n):
        if s == 0:
            k, inp = i, loader[i][0]
        else:
            k, x = yield from _wait(acts[s - 1])
            inp = x.detach().requires_grad_()
        out = stage(inp)
        if s == last:
            loss = nn.functional.mse_loss(out, loader[k][1])
            losses.append(loss.item())
            kept[k] = (inp, loss)
            backward(k, torch.ones(()))
            continue
        kept[k] = (inp, out)
        if i >= last - s:  # after the warm-up: one backward per forward, before sending it
            backward(*(yield from _wait(grads[s])))
        acts[s].append((k, out.detach()))
    while kept:
        backward(*(yield from _wait(grads[s])))
    return losses


def _replay(
    model: nn.Sequential, balance: List[int], loader: List[Batch], lr: float, epochs: int, interval: int
) -> Tuple[List[nn.Module], List[float]]:
    """The AMPnet schedule of every stage in one process: each stage's order of forwards, backwards and steps is
    fixed by its own loop, so running the loops as coroutines gives the multi-process results exactly."""
    bounds = [sum(balance[:s]) for s in range(len(balance) + 1)]
    stages = [nn.Sequential(*list(model)[bounds[s] : bounds[s + 1]]) for s in range(len(balance))]
    opts = [_DataSGD(stage.parameters(), lr) for stage in stages]
    losses: List[float] = []
    for _ in range(epochs):
        acts: List[Queue] = [deque() for _ in stages[1:]]
        grads: List[Queue] = [deque() for _ in stages[1:]]
        running = {s: _replay_stage(s, st, opts[s], loader, acts, grads, interval) for s, st in enumerate(stages)}
        while running:
            for s, gen in list(running.items()):
                try:
                    next(gen)
                except StopIteration as stop:
                    losses += stop.value
                    del running[s]
    return list(stages), losses


# ---------------------------------------------------------------------------------------------- world size 2


def _train(rank: int, balance: List[int], epochs: int, **options: Any) -> Tuple[AMPnetPipe, _Logger, _PlainSGD]:
    checkpoint = options.pop("checkpoint", "never")
    chunks = options.pop("chunks", 10)
    optimizer_class = options.pop("optimizer_class", _PlainSGD)
    pipe = AMPnetPipe(module=_model(), balance=balance, group=dist.group.WORLD, chunks=chunks, checkpoint=checkpoint)
    optimizer = optimizer_class(pipe.parameters(), lr=0.01)
    logger = _Logger()
    for _ in range(epochs):
        pipe.interleave(_loader(), nn.MSELoss(), optimizer, logger, **options)
    _finish(pipe)
    return pipe, logger, optimizer


def _case_parity(rank: int, interval: int, checkpoint: str) -> None:
    """Losses and parameters equal the one-process replay of the schedule. With checkpointing too, here only: the
    head stage has one weight layer, so its recomputation with stepped weights gives the same weight gradients (see
    the AMPnetPipe docs)."""
    pipe, logger, optimizer = _train(rank, [2, 3], 2, min_update_interval=interval, checkpoint=checkpoint)
    stages, losses = _replay(_model(), [2, 3], _loader(), 0.01, 2, interval)
    for p, q in zip(pipe.parameters(), stages[rank].parameters()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), (p, q)
    assert optimizer.steps == 2 * 25 // interval
    assert logger.saved == [n for n in range(1, 26) if n % interval == 0] * 2
    if rank == 1:
        assert torch.allclose(torch.tensor(logger.losses), torch.tensor(losses), rtol=1e-5, atol=1e-7)
        assert logger.counts == list(range(1, 26)) * 2


def _case_simple(rank: int) -> None:
    """Upstream's test_async_event_loop_interleave_simple (balance [2, 2]), a few epochs: the loss decreases."""
    model = nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 10), nn.ReLU())
    pipe = AMPnetPipe(module=model, balance=[2, 2], group=dist.group.WORLD, chunks=10, checkpoint="never")
    before = [p.detach().clone() for p in pipe.parameters()]
    optimizer = _PlainSGD(pipe.parameters(), lr=0.05)
    logger = _Logger()
    for _ in range(4):
        pipe.interleave(_loader(), nn.MSELoss(), optimizer, logger)
    _finish(pipe)
    assert all(not torch.equal(p, q) for p, q in zip(pipe.parameters(), before))
    if rank == 1:
        first, last = sum(logger.losses[:25]), sum(logger.losses[-25:])
        assert last < 0.9 * first, (first, last)


def _case_weight_prediction(rank: int) -> None:
    """With weight prediction the optimizer predicts around each forward/backward and steps every `chunks`."""
    pipe, logger, optimizer = _train(rank, [2, 3], 1, weight_prediction=True, chunks=5, optimizer_class=_PredictingSGD)
    assert optimizer.steps == 5 and logger.saved == [5, 10, 15, 20, 25]
    predictions = optimizer.predictions  # type: ignore[attr-defined]
    forwards = [count for r, n, count, chunks, fwd in predictions if fwd and (r, n, chunks) == (rank, 2, 5)]
    backwards = [count for r, n, count, chunks, fwd in predictions if not fwd and (r, n, chunks) == (rank, 2, 5)]
    assert forwards == list(range(25)) and backwards == list(range(25)) and len(predictions) == 50


def _case_bad_input(rank: int) -> None:
    pipe = AMPnetPipe(module=_model(), balance=[2, 3], group=dist.group.WORLD, chunks=2)
    optimizer = _PlainSGD(pipe.parameters(), lr=0.01)
    with pytest.raises(ValueError, match="min_update_interval"):
        pipe.interleave(_loader(), nn.MSELoss(), optimizer, _Logger(), min_update_interval=0)
    with pytest.raises(ValueError, match="log_loss"):
        pipe.interleave(_loader(), nn.MSELoss(), optimizer, object())
    with pytest.raises(ValueError, match="update_weight_using_future_predictions"):
        pipe.interleave(_loader(), nn.MSELoss(), optimizer, _Logger(), weight_prediction=True)
    with pytest.raises(ValueError, match="len"):
        pipe.interleave(iter(_loader()), nn.MSELoss(), optimizer, _Logger())
    with pytest.raises(ValueError, match="positive"):
        AsyncAMPnetEventLoop(pipe.partitions, dist.group.WORLD, pipe.pipeline.transport, 0, False, 0, None, 1)
    single = AMPnetPipe(module=_model(), balance=[5], group=dist.group.WORLD)
    if rank == 0:
        with pytest.raises(ValueError, match="at least 2 pipeline stages"):
            single.interleave(_loader(), nn.MSELoss(), optimizer, _Logger())
    dist.barrier()


def _case_stages_disagree(rank: int) -> None:
    """Loaders of other lengths, or bad arguments on one stage only: every stage raises at the start of the epoch
    (before, the others waited for messages that never came)."""
    pipe = AMPnetPipe(module=_model(), balance=[2, 3], group=dist.group.WORLD, chunks=2)
    optimizer = _PlainSGD(pipe.parameters(), lr=0.01)
    with pytest.raises(RanksDisagreeError, match="loader length"):
        pipe.interleave(_loader(samples=100 + 4 * rank), nn.MSELoss(), optimizer, _Logger())
    with pytest.raises(ValueError if rank == 1 else RuntimeError, match="min_update_interval|failed on global rank 1"):
        pipe.interleave(_loader(), nn.MSELoss(), optimizer, _Logger(), min_update_interval=1 - rank)


class _FailingInputLogger(_Logger):
    """A logger whose ``transform_input`` raises on its ``fail_at``-th call (a failure on the head)."""

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.calls = 0
        self.fail_at = fail_at

    def transform_input(self, batch: Batch) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.fail_at:
            raise ArithmeticError("transform_input failed on purpose")
        return batch[0]


def _case_failure(rank: int, failing: int) -> None:
    """A stage fails mid-epoch: it raises, the other stops with PipelineAbortedError instead of hanging."""
    pipe = AMPnetPipe(module=_model(), balance=[2, 3], group=dist.group.WORLD, chunks=2, checkpoint="never")
    optimizer = _PlainSGD(pipe.parameters(), lr=0.01)
    criterion = _FailingCriterion(7) if failing == 1 else nn.MSELoss()
    logger = _FailingInputLogger(9) if failing == 0 else _Logger()
    with pytest.raises(ArithmeticError if rank == failing else PipelineAbortedError):
        pipe.interleave(_loader(), criterion, optimizer, logger)
    _finish(pipe)


def _world_2(rank: int, world_size: int) -> None:
    cases = [(f"parity-{i}-{c}", functools.partial(_case_parity, rank, i, c)) for i, c in [(1, "never"), (3, "always")]]
    cases += [
        ("simple", functools.partial(_case_simple, rank)),
        ("weight_prediction", functools.partial(_case_weight_prediction, rank)),
        ("bad_input", functools.partial(_case_bad_input, rank)),
        ("stages_disagree", functools.partial(_case_stages_disagree, rank)),
        ("failure-tail", functools.partial(_case_failure, rank, 1)),
        ("failure-head", functools.partial(_case_failure, rank, 0)),
        # No message of the failed epochs is left in flight: training afterwards gives the same results.
        ("parity-after-failures", functools.partial(_case_parity, rank, 1, "never")),
    ]
    run_cases(cases)


def test_async_event_loop_interleave_simple() -> None:
    run_distributed(_world_2, 2, timeout=TIMEOUT)


# ---------------------------------------------------------------------------------------------- world size 4


def _hard_model() -> nn.Sequential:
    torch.manual_seed(2)
    return nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 10), nn.Linear(10, 10))


def _hard(rank: int, world_size: int) -> Optional[List[float]]:
    pipe = AMPnetPipe(module=_hard_model(), balance=[1, 1, 1, 1], group=dist.group.WORLD, chunks=10, checkpoint="never")
    optimizer = _PlainSGD(pipe.parameters(), lr=0.1)
    logger = _Logger()
    for _ in range(3):
        pipe.interleave(_loader(), nn.MSELoss(), optimizer, logger)
    _finish(pipe)
    # Stages 2 and 3 save their weights for backward while earlier stages step: the replay uses param.data steps.
    stages, losses = _replay(_hard_model(), [1, 1, 1, 1], _loader(), 0.1, 3, 1)
    for p, q in zip(pipe.parameters(), stages[rank].parameters()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), (p, q)
    assert optimizer.steps == 75
    if rank == 3:
        assert torch.allclose(torch.tensor(logger.losses), torch.tensor(losses), rtol=1e-5, atol=1e-7)
    _unused_ranks(rank)
    return logger.losses if rank == 3 else None


def _unused_ranks(rank: int) -> None:
    """Two stages in a world of four: ranks 2 and 3 hold none and return at once; the stages train as the replay."""
    with pytest.warns(UserWarning, match="More ranks than partitions") if rank >= 2 else contextlib.nullcontext():
        pipe = AMPnetPipe(module=_model(), balance=[3, 2], group=dist.group.WORLD, chunks=2)
    optimizer = _PlainSGD(pipe.parameters(), lr=0.01)
    pipe.interleave(_loader(), nn.MSELoss(), optimizer, _Logger())
    _finish(pipe)
    if rank < 2:
        stages, _ = _replay(_model(), [3, 2], _loader(), 0.01, 1, 1)
        for p, q in zip(pipe.parameters(), stages[rank].parameters()):
            assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), (p, q)


def test_async_event_loop_interleave_hard() -> None:
    """Upstream's 4-stage test (balance [1, 1, 1, 1]), checked against the replay; the loss goes down."""
    losses = run_distributed(_hard, 4, timeout=TIMEOUT)[3]
    assert losses is not None and len(losses) == 75
    assert sum(losses[-25:]) < 0.9 * sum(losses[:25]), losses


# ---------------------------------------------------------------------------------------------- RPC transport


def _rpc_world(rank: int, world_size: int, path: str) -> None:
    from torch.distributed import rpc

    options = rpc.TensorPipeRpcBackendOptions(init_method=f"file://{path}", _transports=["uv"])
    rpc.init_rpc(f"Test{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
    worker_map = {i: f"Test{i}" for i in range(world_size)}
    try:
        pipe = AMPnetPipe(module=_model(), balance=[2, 3], group=dist.group.WORLD, worker_map=worker_map, chunks=2)
        assert isinstance(pipe.pipeline.transport, RpcTransport)
        optimizer = _PlainSGD(pipe.parameters(), lr=0.01)
        with pytest.raises(ArithmeticError if rank == 1 else PipelineAbortedError):
            pipe.interleave(_loader(), _FailingCriterion(5), optimizer, _Logger())
        dist.barrier()
        # The failed epoch left nothing in the queues: a fresh pipe trains exactly as the replay.
        pipe = AMPnetPipe(module=_model(), balance=[2, 3], group=dist.group.WORLD, worker_map=worker_map, chunks=2)
        optimizer = _PlainSGD(pipe.parameters(), lr=0.01)
        logger = _Logger()
        pipe.interleave(_loader(), nn.MSELoss(), optimizer, logger)
        stages, losses = _replay(_model(), [2, 3], _loader(), 0.01, 1, 1)
        for p, q in zip(pipe.parameters(), stages[rank].parameters()):
            assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), (p, q)
        if rank == 1:
            assert torch.allclose(torch.tensor(logger.losses), torch.tensor(losses), rtol=1e-5, atol=1e-7)
        dist.barrier()
    finally:
        rpc.shutdown()


def test_interleave_over_rpc(tmp_path) -> None:
    """The same schedule over the RPC transport (activations and gradients on their own message queues)."""
    rpc = pytest.importorskip("torch.distributed.rpc")
    if not rpc.is_available():  # pragma: no cover - torch built without RPC
        pytest.skip("torch.distributed.rpc is not available")
    run_distributed(_rpc_world, 2, os.path.join(str(tmp_path), "rpc_init"), timeout=TIMEOUT)
