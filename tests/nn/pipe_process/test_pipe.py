# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""AsyncPipe in real gloo worlds: construction, per-rank sequence protocol, parity with nn.Sequential, failures.

Each world runs its cases as sub-tests (one world start per test). Bodies are module-level functions.
"""

import copy
import functools
import time
import warnings
from collections import OrderedDict
from typing import List

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.internal.agreement import RanksDisagreeError
from fairscale.internal.collectives import count_collectives
from fairscale.nn.pipe import AsyncPipe, LazyModule, is_recomputing
from fairscale.nn.pipe.async_pipe import check_balance
from fairscale.nn.pipe.async_schedule import PipelineAbortedError
from fairscale.nn.pipe.messages import MakeTransport, SendRecvTransport, _sender

TIMEOUT = 60.0


def _world() -> dist.ProcessGroup:
    return dist.group.WORLD


def _finish(pipe: AsyncPipe) -> None:
    # Every queued send was received and every rank is done with this case before the next one starts.
    if pipe.pipeline is not None and isinstance(pipe.pipeline.transport, SendRecvTransport):
        pipe.pipeline.transport.flush()
    dist.barrier()


def _model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


def _grad_fn_names(t: torch.Tensor) -> List[str]:
    seen, names, stack = set(), [], [t.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.append(type(fn).__name__)
        stack.extend(f for f, _ in fn.next_functions)
    return names


# ---------------------------------------------------------------------------------------------- world size 1


def _case_public_attrs() -> None:
    pipe = AsyncPipe(nn.Sequential(nn.Linear(1, 1)), balance=(1,), group=_world(), chunks=42, checkpoint="always")
    assert pipe.balance == [1] and pipe.chunks == 42 and pipe.checkpoint == "always"
    assert pipe.final_stage and isinstance(pipe.partition, nn.Sequential)
    assert AsyncPipe.balance == [] and AsyncPipe.chunks == 1 and AsyncPipe.checkpoint == "except_last"
    # The first partition is registered twice (upstream's state-dict layout).
    assert {"0.0.weight", "partition.0.weight"} <= set(pipe.state_dict())


def _case_errors() -> None:
    model = nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1))
    for balance, message in [
        ([1], "module and sum of balance have different length (module: 2, sum of balance: 1)"),
        ([0, 2], "all balance numbers must be positive integer (balance: [0, 2])"),
    ]:
        with pytest.raises(ValueError) as info:
            AsyncPipe(model, balance, group=_world())
        assert str(info.value) == message
    for chunks in (0, -1):
        with pytest.raises(ValueError, match="number of chunks must be positive integer"):
            AsyncPipe(model, [2], group=_world(), chunks=chunks)
    with pytest.raises(ValueError, match="checkpoint is not one of 'always', 'except_last', or 'never'"):
        AsyncPipe(model, [2], group=_world(), checkpoint="INVALID")
    with pytest.raises(IndexError, match=r"too few ranks to hold given partitions \(ranks: 1, partitions: 2\)"):
        AsyncPipe(model, [1, 1], group=_world())
    conv = nn.Conv2d(3, 3, 1)
    with pytest.raises(ValueError, match="module with duplicate children is not supported"):
        AsyncPipe(nn.Sequential(conv, conv), [2], group=_world())
    with pytest.raises(TypeError, match="layer must be nn.Module or callable"):
        AsyncPipe([42], [1], group=_world())  # type: ignore[list-item]
    with pytest.raises(ValueError, match="'RpcTransport' requires 'worker_map' to be set"):
        MakeTransport(True, None, None)

    class ReturnsList(nn.Module):
        def forward(self, x):
            return [x]

    # A partition's output that is neither a tensor nor a tuple: a TypeError (and, as upstream, an AssertionError).
    with pytest.raises(TypeError, match="Only Tensor or Tuple of Tensor output is supported") as info:
        AsyncPipe(nn.Sequential(ReturnsList()), [1], group=_world())(torch.rand(1))
    assert isinstance(info.value, AssertionError) and "returned a list" in str(info.value)


def _case_checkpoint_modes() -> None:
    def count(mode: str) -> int:
        pipe = AsyncPipe(nn.Sequential(nn.Linear(1, 1)), [1], group=_world(), chunks=2, checkpoint=mode)
        return _grad_fn_names(pipe(torch.rand(2, 1))).count("CheckpointBackward")

    assert (count("always"), count("except_last"), count("never")) == (2, 1, 0)
    pipe = AsyncPipe(nn.Sequential(nn.Linear(1, 1)), [1], group=_world(), chunks=2)
    pipe.eval()
    assert "CheckpointBackward" not in _grad_fn_names(pipe(torch.rand(2, 1)))
    for mode in ("always", "except_last", "never"):
        AsyncPipe(nn.Sequential(nn.Linear(1, 1)), [1], group=_world(), chunks=1, checkpoint=mode)


def _case_checkpoint_gradient_calls() -> None:
    """autograd.grad through checkpointed micro-batches raises (their gradients went missing silently); a retained
    graph's second backward adds up as for the plain Sequential (it failed with an IndexError)."""
    torch.manual_seed(0)
    model = _model()
    reference = copy.deepcopy(model)
    pipe = AsyncPipe(model, [5], group=_world(), chunks=2, checkpoint="except_last")
    x = torch.randn(4, 3)
    with pytest.raises(RuntimeError, match=r"torch.autograd.grad\(\) or backward\(inputs=...\)"):
        torch.autograd.grad(pipe(x).sum(), list(pipe.parameters()))
    out, ref_out = pipe(x).pow(2).sum(), reference(x).pow(2).sum()
    for loss in (out, out, ref_out, ref_out):
        loss.backward(retain_graph=True)
    for p, q in zip(pipe.parameters(), reference.parameters()):
        _assert_close(p.grad, q.grad)


def _case_inputs() -> None:
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc_a, self.fc_b = nn.Linear(1, 1), nn.Linear(1, 1)

        def forward(self, a_and_b):
            a, b = a_and_b
            return (self.fc_a(a), self.fc_b(b))

    pipe = AsyncPipe(nn.Sequential(Two()), [1], group=_world(), chunks=2)
    a, b = torch.rand(10, 1, requires_grad=True), torch.rand(10, 1, requires_grad=True)
    a_out, b_out = pipe((a, b))
    (a_out.mean() + b_out.mean()).backward()
    assert a.grad is not None and b.grad is not None
    with pytest.raises(TypeError):
        pipe(torch.rand(1), torch.rand(1))
    with pytest.raises(TypeError):
        pipe("hello")
    empty = AsyncPipe(nn.Sequential(), [], group=_world())
    x = torch.tensor(42)
    assert empty(x) is x


def _case_exception() -> None:
    class ExpectedException(Exception):
        pass

    class Raise(nn.Module):
        def forward(self, *_):
            raise ExpectedException()

    with pytest.raises(ExpectedException):
        AsyncPipe(nn.Sequential(Raise()), [1], group=_world())(torch.rand(1))


def _case_no_grad() -> None:
    pipe = AsyncPipe(nn.Sequential(nn.Linear(1, 1)), [1], group=_world(), chunks=2)
    latent = []
    pipe.partition.register_forward_hook(lambda module, input, output: latent.append(output))
    with torch.no_grad():
        pipe(torch.rand(2, 1))
    assert latent and latent[0].grad_fn is None


def _case_deferred_batch_norm() -> None:
    for lazy in (False, True):
        for checkpoint in ("always", "except_last", "never"):
            bn = nn.BatchNorm2d(3)
            pipe_bn = copy.deepcopy(bn)
            module = [LazyModule(lambda: pipe_bn)] if lazy else nn.Sequential(pipe_bn)
            pipe = AsyncPipe(module, [1], group=_world(), chunks=2, checkpoint=checkpoint, deferred_batch_norm=True)
            x = torch.rand(4, 3, 10, 10)
            pipe(x).mean().backward()
            bn(x)
            assert torch.allclose(pipe[0].running_mean, bn.running_mean, atol=1e-4)
            assert torch.allclose(pipe[0].running_var, bn.running_var, atol=1e-4)


def _case_balance_entries() -> None:
    """Each balance entry is a positive int (not a float, not a bool): a clear error names the first bad one."""
    model = nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1), nn.Linear(1, 1), nn.Linear(1, 1))
    for balance, entry in [
        ([1.5, 2.5], "balance entry 0 is 1.5 (float)"),
        ([2, 2.0], "balance entry 1 is 2.0 (float)"),
        ([True, 3], "balance entry 0 is True (bool)"),
        ([3, "1"], "balance entry 1 is '1' (str)"),
    ]:
        for build in (lambda: AsyncPipe(model, balance, group=_world()), lambda: check_balance(model, balance)):
            with pytest.raises(ValueError) as info:
                build()
            assert entry in str(info.value) and "positive int" in str(info.value), str(info.value)
    with pytest.raises(TypeError, match="balance must be an iterable of ints"):
        AsyncPipe(model, 4, group=_world())  # type: ignore[arg-type]


def _single_rank(rank: int, world_size: int) -> None:
    run_cases(
        [
            ("public_attrs", _case_public_attrs),
            ("errors", _case_errors),
            ("balance_entries", _case_balance_entries),
            ("checkpoint_modes", _case_checkpoint_modes),
            ("checkpoint_gradient_calls", _case_checkpoint_gradient_calls),
            ("inputs", _case_inputs),
            ("exception", _case_exception),
            ("no_grad", _case_no_grad),
            ("deferred_batch_norm", _case_deferred_batch_norm),
        ]
    )


def test_single_rank() -> None:
    run_distributed(_single_rank, 1, timeout=TIMEOUT)


# ---------------------------------------------------------------------------------------------- parity


def _assert_close(a: torch.Tensor, b: torch.Tensor) -> None:
    # Not torch.testing.assert_close: its first call imports sympy and DTensor, seconds in every forked rank.
    assert a.shape == b.shape and torch.allclose(a, b, rtol=1.3e-6, atol=1e-5), (a, b)


def _sgd_step(module: nn.Module, lr: float = 0.1) -> None:
    # A plain SGD step: constructing torch.optim.SGD imports torch._dynamo, seconds of a rank's time.
    with torch.no_grad():
        for p in module.parameters():
            p.add_(p.grad, alpha=-lr)
            p.grad = None


def _parity_case(rank: int, balance: List[int], chunks: int, checkpoint: str) -> None:
    """Outputs, gradients and parameters after two SGD steps equal the plain Sequential's."""
    torch.manual_seed(3)
    model = _model()
    reference = copy.deepcopy(model)
    pipe = AsyncPipe(model, balance, group=_world(), chunks=chunks, checkpoint=checkpoint)
    start = sum(balance[:rank]) if rank < len(balance) else len(model)
    stop = start + (balance[rank] if rank < len(balance) else 0)
    ref_layers = list(reference)[start:stop]
    assert len(pipe) == len(ref_layers)
    assert (pipe.pipeline is None) == (rank >= len(balance))
    for step in range(2):
        x = torch.randn(8, 3, generator=torch.Generator().manual_seed(step))
        xp, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
        out = pipe(xp)
        ref_out = reference(xr)
        ref_out.pow(2).sum().backward()
        if pipe.final_stage:
            _assert_close(out, ref_out)
            out.pow(2).sum().backward()
        if rank == 0:
            _assert_close(xp.grad, xr.grad)
        for mine, ref in zip(pipe, ref_layers):
            for p, q in zip(mine.parameters(), ref.parameters()):
                _assert_close(p.grad, q.grad)
        _sgd_step(pipe)
        _sgd_step(reference)
        for mine, ref in zip(pipe, ref_layers):
            for p, q in zip(mine.parameters(), ref.parameters()):
                _assert_close(p, q)
    _finish(pipe)


def _parity(rank: int, world_size: int, configs: List) -> None:
    run_cases(
        (f"{balance}-{chunks}-{checkpoint}", functools.partial(_parity_case, rank, balance, chunks, checkpoint))
        for balance, chunks, checkpoint in configs
    )


def test_parity_world_2() -> None:
    configs = [([2, 3], 4, "except_last"), ([4, 1], 1, "never"), ([1, 4], 3, "always")]
    run_distributed(_parity, 2, configs, timeout=TIMEOUT)


def test_parity_world_4() -> None:
    # Four stages; with balance [2, 1, 2] the fourth rank holds no stage and passes its input through.
    configs = [([1, 2, 1, 1], 4, "except_last"), ([2, 1, 2], 2, "never")]
    run_distributed(_parity, 4, configs, timeout=TIMEOUT)


# ---------------------------------------------------------------------------------------------- world size 2


def _case_sequential_like(rank: int) -> None:
    a, b = nn.Linear(1, 1), nn.Linear(1, 1)
    pipe = AsyncPipe(nn.Sequential(a, b), [1, 1], group=_world())
    mine = a if rank == 0 else b
    assert len(pipe) == 1 and list(pipe) == [mine] and pipe[0] is mine and pipe[-1] is mine
    with pytest.raises(IndexError):
        pipe[1]
    assert isinstance(pipe.partition, nn.Sequential) and pipe.partition[0] is mine
    assert pipe.final_stage == (rank == 1)
    if rank == 1:
        with pytest.raises(ValueError, match="back_helper should only be called on non-final stages"):
            pipe.back_helper([])


def _case_parameters(rank: int) -> None:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        pipe = AsyncPipe(nn.Sequential(nn.Linear(1, 1)), [1], group=_world())
    if rank == 0:
        assert list(pipe.parameters()) != []
    else:
        assert list(pipe.parameters()) == [] and pipe.pipeline is None and pipe.partition is None
        assert any("More ranks than partitions, some ranks unused" in str(w.message) for w in record)
        x = torch.rand(1)
        assert pipe(x) is x


def _case_lazy_construction(rank: int) -> None:
    built = []

    def make(i: int) -> nn.Module:
        built.append(i)
        return nn.Linear(1, 1)

    layers = [LazyModule(functools.partial(make, i)) for i in range(4)]
    pipe = AsyncPipe(layers, [2, 2], group=_world())
    assert built == ([0, 1] if rank == 0 else [2, 3])
    assert {name for name, _ in pipe.partition.named_children()} == ({"0", "1"} if rank == 0 else {"2", "3"})


def _case_named_children(rank: int) -> None:
    model = nn.Sequential(OrderedDict([("a", nn.Linear(1, 1)), ("b", nn.Linear(1, 1))]))
    pipe = AsyncPipe(model, [1, 1], group=_world())
    assert [name for name, _ in pipe.partition.named_children()] == (["a"] if rank == 0 else ["b"])


def _case_messages_counted(rank: int) -> None:
    """The head sends one header and one tensor per micro-batch, and receives as many for the gradients."""
    torch.manual_seed(0)
    pipe = AsyncPipe(_model(), [2, 3], group=_world(), chunks=4, checkpoint="never")
    with count_collectives() as counter:
        out = pipe(torch.randn(8, 3, requires_grad=True))
        if pipe.final_stage:
            out.sum().backward()
        pipe.pipeline.transport.flush()
    assert counter.count("send") == 8 and counter.count("recv") == 8, counter.summary()
    _finish(pipe)


def _case_eval_returns_without_gradients(rank: int) -> None:
    pipe = AsyncPipe(_model(), [2, 3], group=_world(), chunks=2)
    pipe.eval()
    with torch.no_grad():
        out = pipe(torch.randn(4, 3))
    if rank == 0:
        assert isinstance(out, list) and len(out) == 2
    else:
        assert out.shape == (4, 2)
    _finish(pipe)


def _case_non_float_activation(rank: int) -> None:
    class ForkNonFloat(nn.Module):
        def forward(self, x):
            return (x * 2, (x > 0.5).long())

    class JoinNonFloat(nn.Module):
        def forward(self, pair):
            x, mask = pair
            return x * mask

    pipe = AsyncPipe(nn.Sequential(ForkNonFloat(), JoinNonFloat()), [1, 1], group=_world(), checkpoint="always")
    x = torch.rand(4, 1, requires_grad=True)
    out = pipe(x)
    if rank == 1:
        out.sum().backward()
    else:
        assert torch.equal(x.grad, 2 * (x > 0.5).float())
    _finish(pipe)


def _world_2(rank: int, world_size: int) -> None:
    run_cases(
        [
            ("sequential_like", functools.partial(_case_sequential_like, rank)),
            ("parameters", functools.partial(_case_parameters, rank)),
            ("lazy_construction", functools.partial(_case_lazy_construction, rank)),
            ("named_children", functools.partial(_case_named_children, rank)),
            ("messages_counted", functools.partial(_case_messages_counted, rank)),
            ("eval", functools.partial(_case_eval_returns_without_gradients, rank)),
            ("non_float_activation", functools.partial(_case_non_float_activation, rank)),
        ]
    )


def test_world_2() -> None:
    run_distributed(_world_2, 2, timeout=TIMEOUT)


# ---------------------------------------------------------------------------------------------- failures


class _ExpectedException(Exception):
    pass


class _RaiseOnSecond(nn.Module):
    """Passes the first micro-batch, raises on the second: the failure comes mid-way through the pipeline."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 2:
            raise _ExpectedException()
        return x


def _one_failure(rank: int, failing: int, training: bool) -> str:
    layers = [nn.Linear(2, 2) for _ in range(3)]
    layers[failing] = _RaiseOnSecond()
    pipe = AsyncPipe(nn.Sequential(*layers), [1, 1, 1], group=_world(), chunks=3)
    pipe.train(training)
    outcome = "returned"
    try:
        with torch.set_grad_enabled(training):
            out = pipe(torch.rand(6, 2, requires_grad=training))
            if training and pipe.final_stage:
                out.sum().backward()
    except _ExpectedException:
        outcome = "raised"
    except PipelineAbortedError as exc:
        assert f"pipeline stage {failing} failed" in str(exc)
        outcome = "aborted"
    _finish(pipe)
    return outcome


def _failures(rank: int, world_size: int) -> List[str]:
    return [_one_failure(rank, failing, training) for failing in range(3) for training in (False, True)]


def test_exception_no_hang() -> None:
    """A failing stage ends every stage with an error (or, in eval, lets the earlier ones return), never a hang.

    Every send is received before the stages stop, so the processes also exit cleanly (checked under spawn).
    """
    outcomes = run_distributed(_failures, 3, timeout=TIMEOUT)
    expected = {
        (0, False): ["raised", "aborted", "aborted"],
        (0, True): ["raised", "aborted", "aborted"],
        (1, False): ["returned", "raised", "aborted"],
        (1, True): ["aborted", "raised", "aborted"],
        (2, False): ["returned", "returned", "raised"],
        (2, True): ["aborted", "aborted", "raised"],
    }
    cases = [(failing, training) for failing in range(3) for training in (False, True)]
    for index, case in enumerate(cases):
        assert [outcomes[rank][index] for rank in range(3)] == expected[case], case


class _FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise _ExpectedException("backward failed")


class _RaiseInBackward(nn.Module):
    """Identity whose backward raises."""

    def forward(self, x):
        return _FailingBackward.apply(x)


class _RaiseWhenRecomputing(nn.Module):
    """Identity that raises when checkpointing recomputes it, in the backward pass."""

    def forward(self, x):
        if is_recomputing():
            raise _ExpectedException("recomputation failed")
        return x * 1


# A failure must reach the waiting stages within about a second; the margin is for a loaded CI machine.
_ABORT_WITHIN_S = 10.0


def _one_backward_failure(rank: int, failing: int, layer: str) -> str:
    layers: List[nn.Module] = [nn.Linear(2, 2) for _ in range(3)]
    layers[failing] = nn.Sequential(
        nn.Linear(2, 2), _RaiseInBackward() if layer == "backward" else _RaiseWhenRecomputing()
    )
    pipe = AsyncPipe(nn.Sequential(*layers), [1, 1, 1], group=_world(), chunks=3, checkpoint="always")
    start = time.monotonic()
    outcome = "returned"
    try:
        out = pipe(torch.rand(6, 2, requires_grad=True))
        if pipe.final_stage:
            out.sum().backward()
    except _ExpectedException:
        outcome = "raised"
    except PipelineAbortedError as exc:
        assert f"pipeline stage {failing} failed" in str(exc)
        outcome = "aborted"
    elapsed = time.monotonic() - start
    assert elapsed < _ABORT_WITHIN_S, f"stage {rank} took {elapsed:.1f} s to end with {outcome}"
    _finish(pipe)
    return outcome


def _backward_failures(rank: int, world_size: int) -> List[str]:
    return [_one_backward_failure(rank, failing, layer) for failing in range(3) for layer in ("backward", "recompute")]


def test_backward_failure_no_hang() -> None:
    """A failure in any stage's backward (a layer's backward, or checkpointing's recomputation) stops the stages
    still waiting for that stage with PipelineAbortedError, within seconds; the stages after it have sent all their
    gradients already and return. Before, a failure in the last stage's backward (which runs in the user's
    ``backward`` call, not in the pipeline's event loop) left the other stages waiting until the process-group
    timeout."""
    outcomes = run_distributed(_backward_failures, 3, timeout=TIMEOUT)
    expected = {
        0: ["raised", "returned", "returned"],
        1: ["aborted", "raised", "returned"],
        2: ["aborted", "aborted", "raised"],
    }
    cases = [(failing, layer) for failing in range(3) for layer in ("backward", "recompute")]
    for index, (failing, layer) in enumerate(cases):
        assert [outcomes[rank][index] for rank in range(3)] == expected[failing], (failing, layer)


# ---------------------------------------------------------------------------------------------- ranks that disagree


def _disagreeing_step(rank: int, chunks: List[int], batch: List[int], training: List[bool]) -> str:
    pipe = AsyncPipe(_model(), [2, 3], group=_world(), chunks=chunks[rank])
    pipe.train(training[rank])
    start = time.monotonic()
    with pytest.raises(RanksDisagreeError) as info:
        out = pipe(torch.randn(batch[rank], 3))
        if pipe.final_stage and training[rank]:
            out.sum().backward()
    assert time.monotonic() - start < _ABORT_WITHIN_S
    _finish(pipe)
    return str(info.value)


def _agreeing_steps_check_once(rank: int) -> int:
    pipe = AsyncPipe(_model(), [2, 3], group=_world(), chunks=2)
    with count_collectives() as counter:
        for _ in range(3):
            out = pipe(torch.randn(4, 3))
            if pipe.final_stage:
                out.sum().backward()
    _finish(pipe)
    return counter.count("all_gather_object")


def _disagreements(rank: int, world_size: int) -> List[str]:
    return [
        # 8 rows make 4 micro-batches, 6 rows only 3: the first stage would wait for a 4th gradient forever.
        _disagreeing_step(rank, [4, 4], [8, 6], [True, True]),
        # Same number of micro-batches, different batch sizes.
        _disagreeing_step(rank, [4, 4], [8, 7], [True, True]),
        # Different chunks.
        _disagreeing_step(rank, [4, 2], [8, 8], [True, True]),
        # One stage trains (waits for gradients), the other evaluates.
        _disagreeing_step(rank, [2, 2], [4, 4], [True, False]),
        str(_agreeing_steps_check_once(rank)),
    ]


def test_ranks_disagree() -> None:
    """Ranks whose inputs or modes do not match raise the same RanksDisagreeError at the first step, instead of a
    hang (different micro-batch counts or modes) or a silent mismatch; agreeing ranks check once, at the first step."""
    outcomes = run_distributed(_disagreements, 2, timeout=TIMEOUT)
    assert outcomes[0] == outcomes[1]
    micro_batches, batch_size, chunks, mode, checks = outcomes[0]
    assert "('micro-batches', 4) vs ('micro-batches', 3)" in micro_batches, micro_batches
    assert "('batch size (dim 0 of each input tensor)', [8]) vs" in batch_size, batch_size
    assert "('chunks', 4) vs ('chunks', 2)" in chunks, chunks
    assert "('gradients come back (training mode with autograd on)', True) vs" in mode, mode
    assert checks == "1"


# ---------------------------------------------------------------------------------------------- modes


def _train_mode_no_grad(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = _model()
    reference = copy.deepcopy(model)
    pipe = AsyncPipe(model, [2, 3], group=_world(), chunks=2)
    x = torch.randn(4, 3)
    # In training mode without autograd no gradient will come back: no stage waits for one.
    with torch.no_grad():
        out = pipe(x)
    if pipe.final_stage:
        _assert_close(out, reference(x))
    # In eval mode a backward on the last stage stays on that stage (no gradient message that nobody receives).
    pipe.eval()
    out = pipe(x)
    if pipe.final_stage:
        out.sum().backward()
        assert all(p.grad is not None for p in pipe.parameters())
    else:
        assert all(p.grad is None for p in pipe.parameters())
    pipe.zero_grad(set_to_none=True)
    # ... and the next training step is exact.
    pipe.train()
    xp, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = pipe(xp)
    reference(xr).sum().backward()
    if pipe.final_stage:
        out.sum().backward()
    else:
        _assert_close(xp.grad, xr.grad)
    _finish(pipe)


def test_modes_without_gradients_return() -> None:
    """Training mode under no_grad returns on every stage (before, the first stage waited for gradients forever),
    and a backward in eval mode does not leave a gradient message in flight."""
    run_distributed(_train_mode_no_grad, 2, timeout=30.0)


# ---------------------------------------------------------------------------------------------- missing backward


def _step(pipe: AsyncPipe, x: torch.Tensor) -> None:
    out = pipe(x)
    if pipe.final_stage:
        out.sum().backward()


def _missing_backward(rank: int, world_size: int, how: str) -> str:
    from fairscale.nn.pipe import async_schedule

    torch.manual_seed(0)
    pipe = AsyncPipe(_model(), [2, 3], group=_world(), chunks=2)
    x = torch.randn(4, 3)
    _step(pipe, x)
    start = time.monotonic()
    outcome = "returned"
    try:
        out = pipe(x)
        if pipe.final_stage:
            # No backward (the loss failed, say), then:
            if how == "exit":
                with pytest.warns(UserWarning, match="the earlier stages were stopped with PipelineAbortedError"):
                    async_schedule._abandon_unfinished_tails()  # what the interpreter runs at exit
            else:
                try:
                    pipe(x)  # the next step
                finally:
                    # A late backward of the abandoned output must not send gradients nobody waits for any more.
                    with pytest.raises(RuntimeError, match="whose pipeline step was aborted"):
                        out.sum().backward()
    except PipelineAbortedError:
        outcome = "aborted"
    except RuntimeError as exc:
        assert "before the backward of its previous output" in str(exc), str(exc)
        outcome = "raised"
    assert time.monotonic() - start < _ABORT_WITHIN_S
    # The stages are in step again: the next steps work.
    for _ in range(2):
        _step(pipe, x)
    _finish(pipe)
    return outcome


class _Argmax(nn.Module):
    def forward(self, x):
        return x.argmax(dim=1)


def _output_without_grad(rank: int, world_size: int) -> str:
    pipe = AsyncPipe(nn.Sequential(nn.Linear(3, 3), _Argmax()), [1, 1], group=_world(), chunks=2)
    start = time.monotonic()
    try:
        pipe(torch.randn(4, 3))
        outcome = "returned"
    except PipelineAbortedError:
        outcome = "aborted"
    except RuntimeError as exc:
        assert "output of micro-batch 0 does not require grad" in str(exc), str(exc)
        outcome = "raised"
    assert time.monotonic() - start < _ABORT_WITHIN_S
    _finish(pipe)
    return outcome


def test_missing_backward_stops_the_waiting_stages() -> None:
    """In training, when the last stage's output is not back-propagated, the earlier stages (which wait for its
    gradients) are stopped with PipelineAbortedError as soon as the last stage runs forward again (which raises a
    clear error) or its process ends, instead of waiting forever."""
    assert run_distributed(_missing_backward, 2, "next_forward", timeout=30.0) == ["aborted", "raised"]
    assert run_distributed(_missing_backward, 2, "exit", timeout=30.0) == ["aborted", "returned"]
    # A last stage whose output cannot be back-propagated at all (training mode, no grad): a clear error at once.
    assert run_distributed(_output_without_grad, 2, timeout=30.0) == ["aborted", "raised"]
