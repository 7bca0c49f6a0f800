# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Pipe on CPU devices: construction errors, the sequence protocol, checkpoint modes, exceptions, parity."""

import copy
import threading
import time
import warnings
from collections import OrderedDict

import pytest
import torch
from torch import nn

from fairscale.internal.device import accelerator_available
from fairscale.nn.pipe import Pipe
from fairscale.nn.pipe.pipe import MOVING_DENIED, BalanceError, split_module

CPU2 = ["cpu", "cpu"]


def _grad_fn_names(t):
    """Class names of every node reachable from ``t.grad_fn``."""
    seen, names, stack = set(), [], [t.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.append(fn.__class__.__name__)
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return names


def test_parameters():
    pipe = Pipe(nn.Sequential(nn.Linear(1, 1)), balance=[1], devices=["cpu"], chunks=1)
    assert list(pipe.parameters()) != []


def test_deprecation_warning():
    with pytest.warns(DeprecationWarning, match="fairscale.nn.Pipe has been upstreamed to PyTorch"):
        Pipe(nn.Sequential(nn.Linear(1, 1)), balance=[1], devices=["cpu"])


def test_public_attrs():
    class MyString:
        def __init__(self, value):
            self.value = value

        def __str__(self):
            return self.value

    model = nn.Sequential(nn.Linear(1, 1))
    pipe = Pipe(model, balance=(1,), devices=("cpu",), chunks=42.000, checkpoint=MyString("always"))
    assert pipe.balance == [1]
    assert pipe.devices == [torch.device("cpu")]
    assert pipe.chunks == 42 and isinstance(pipe.chunks, int)
    assert pipe.checkpoint == "always" and isinstance(pipe.checkpoint, str)
    assert Pipe.balance == [] and Pipe.devices == [] and Pipe.chunks == 1 and Pipe.checkpoint == "except_last"


@pytest.mark.parametrize("balance", [[2], [1, 1]])
def test_sequential_like(balance):
    a, b = nn.Linear(1, 1), nn.Linear(1, 1)
    pipe = Pipe(nn.Sequential(a, b), balance, devices=CPU2)
    assert len(pipe) == 2
    assert list(pipe) == [a, b]
    assert pipe[0] is a and pipe[1] is b
    assert pipe[-1] is b and pipe[-2] is a
    with pytest.raises(IndexError):
        pipe[2]
    with pytest.raises(IndexError):
        pipe[-3]


def test_balance_errors():
    model = nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1))
    for balance, message in [
        ([1], "module and sum of balance have different length (module: 2, sum of balance: 1)"),
        ([3], "module and sum of balance have different length (module: 2, sum of balance: 3)"),
        ([0, 2], "all balance numbers must be positive integer (balance: [0, 2])"),
        ([-1, 3], "all balance numbers must be positive integer (balance: [-1, 3])"),
    ]:
        with pytest.raises(ValueError) as info:
            Pipe(model, balance, devices=CPU2)
        assert type(info.value) is ValueError  # BalanceError is converted
        assert str(info.value).startswith(message)
        assert "fairscale.nn.pipe.balance" in str(info.value)
    with pytest.raises(BalanceError):
        split_module(model, [1], [torch.device("cpu")])


def test_balance_entries_are_positive_ints():
    """A float or bool entry is rejected by name. Before, ``balance=[1.5, 2.5]`` built no partition at all (the
    sum matched the number of layers) and ``forward`` returned its input; ``[True, True]`` happened to work."""
    model = nn.Sequential(*[nn.Linear(1, 1) for _ in range(4)])
    for balance, entry in [
        ([1.5, 2.5], "balance entry 0 is 1.5 (float)"),
        ([3, 1.0], "balance entry 1 is 1.0 (float)"),
        ([True, 3], "balance entry 0 is True (bool)"),
    ]:
        with pytest.raises(ValueError) as info:
            Pipe(model, balance, devices=CPU2)
        assert entry in str(info.value) and "positive int" in str(info.value), str(info.value)
        with pytest.raises(BalanceError, match=entry.replace("(", r"\(").replace(")", r"\)")):
            split_module(model, balance, [torch.device("cpu")] * 2)
    with pytest.raises(TypeError, match="balance must be an iterable of ints"):
        Pipe(model, 4, devices=CPU2)
    # Integer types other than int (numpy's, say) are fine: they are stored as ints.
    np = pytest.importorskip("numpy")
    pipe = Pipe(model, [np.int64(3), np.int64(1)], devices=CPU2)
    assert pipe.balance == [3, 1] and all(type(b) is int for b in pipe.balance)


def test_recommend_auto_balance():
    with pytest.raises(ValueError, match="fairscale.nn.pipe.balance") as info:
        Pipe(nn.Sequential())
    assert str(info.value).startswith("balance is required")


def test_chunks_less_than_1():
    model = nn.Sequential(nn.Linear(1, 1))
    for chunks in (0, -1):
        with pytest.raises(ValueError, match="number of chunks must be positive integer"):
            Pipe(model, balance=[1], devices=["cpu"], chunks=chunks)


def test_too_few_devices():
    model = nn.Sequential(*[nn.Linear(1, 1) for _ in range(4)])
    with pytest.raises(IndexError, match=r"too few devices to hold given partitions \(devices: 1, partitions: 4\)"):
        Pipe(model, balance=[1, 1, 1, 1], devices=["cpu"])


@pytest.mark.parametrize("balance, devices", [([1, 1], ["cpu", "cpu"]), ([1, 1, 1], ["cpu"])])
def test_failed_constructor_leaves_batch_norms(balance, devices):
    # A balance or device error came after deferred_batch_norm had converted the user's batch norms: the model then
    # updated its running statistics once per `chunks` forwards, with the population variance (session 39).
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), nn.Linear(2, 2))
    with pytest.raises((ValueError, IndexError)):
        Pipe(model, balance=balance, devices=devices, chunks=2, checkpoint="always", deferred_batch_norm=True)
    assert type(model[1]) is nn.BatchNorm1d


def test_error_order():
    # chunks is checked before checkpoint, checkpoint before the module type, the type before the balance.
    with pytest.raises(ValueError, match="number of chunks"):
        Pipe(42, [1], chunks=0, checkpoint="bad")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="checkpoint is not one of"):
        Pipe(42, [1], checkpoint="bad")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="module must be nn.Sequential to be partitioned"):
        Pipe(nn.Linear(1, 1), [5])  # type: ignore[arg-type]


def _no_warning_forward(batch_size):
    model = nn.Sequential(nn.Linear(1, 1))
    pipe = Pipe(model, balance=[1], devices=["cpu"], chunks=4)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        pipe(torch.rand(batch_size, 1))
    return [str(w.message) for w in record]


def test_batch_size_indivisible():
    assert _no_warning_forward(7) == []


def test_batch_size_small():
    assert _no_warning_forward(2) == []


def test_checkpoint_mode():
    def count(mode):
        model = nn.Sequential(nn.Linear(1, 1))
        pipe = Pipe(model, balance=[1], devices=["cpu"], chunks=2, checkpoint=mode)
        return _grad_fn_names(pipe(torch.rand(2, 1))).count("CheckpointBackward")

    assert (count("always"), count("except_last"), count("never")) == (2, 1, 0)


def test_checkpoint_stop_uses_chunks_not_microbatches():
    # Upstream quirk, mirrored: 'except_last' checkpoints every micro-batch when there are fewer than chunks.
    model = nn.Sequential(nn.Linear(1, 1))
    pipe = Pipe(model, balance=[1], devices=["cpu"], chunks=4, checkpoint="except_last")
    assert _grad_fn_names(pipe(torch.rand(2, 1))).count("CheckpointBackward") == 2
    assert _grad_fn_names(pipe(torch.rand(5, 1))).count("CheckpointBackward") == 3


def test_checkpoint_mode_invalid():
    model = nn.Sequential(nn.Linear(1, 1))
    with pytest.raises(ValueError, match="checkpoint is not one of 'always', 'except_last', or 'never'"):
        Pipe(model, balance=[1], devices=["cpu"], chunks=2, checkpoint="INVALID_CHECKPOINT")


def test_checkpoint_mode_when_chunks_1():
    model = nn.Sequential(nn.Linear(1, 1))
    for mode in ("except_last", "always", "never"):
        Pipe(model, balance=[1], devices=["cpu"], chunks=1, checkpoint=mode)


def test_checkpoint_eval():
    model = nn.Sequential(nn.Linear(1, 1))
    pipe = Pipe(model, balance=[1], devices=["cpu"], chunks=2)
    x = torch.rand(2, 1)
    names = _grad_fn_names(pipe(x))
    assert "CheckpointBackward" in names and "RecomputeBackward" in names
    pipe.eval()
    names = _grad_fn_names(pipe(x))
    assert "CheckpointBackward" not in names and "RecomputeBackward" not in names


def test_checkpoint_non_float_input():
    class ForkNonFloat(nn.Module):
        def forward(self, input):
            return (input * 2, torch.tensor([False]))

    class JoinNonFloat(nn.Module):
        def forward(self, input):
            return input[0] * 2

    model = nn.Sequential(ForkNonFloat(), JoinNonFloat())
    pipe = Pipe(model, balance=[1, 1], devices=CPU2, chunks=1, checkpoint="always")
    x = torch.rand(1, requires_grad=True)
    pipe(x).backward()
    assert torch.equal(x.grad, torch.tensor([4.0]))


def test_no_grad():
    model = nn.Sequential(nn.Linear(1, 1))
    pipe = Pipe(model, balance=[1], devices=["cpu"], chunks=2)
    latent = None

    def hook(module, input, output):
        nonlocal latent
        latent = output

    pipe.partitions[0].register_forward_hook(hook)
    with torch.no_grad():
        pipe(torch.rand(2, 1))
    assert latent.grad_fn is None


def test_exception():
    class ExpectedException(Exception):
        pass

    class Raise(nn.Module):
        def forward(self, *_):
            raise ExpectedException()

    pipe = Pipe(nn.Sequential(Raise()), balance=[1], devices=["cpu"], chunks=1)
    with pytest.raises(ExpectedException):
        pipe(torch.rand(1))


def test_exception_early_stop_asap():
    """Even a failing partition can't stop the cycle it is in, but no later cycle runs."""

    class ExpectedException(Exception):
        pass

    class Pass(nn.Module):
        def forward(self, x):
            return x

    counter = 0

    class Counter(nn.Module):
        def forward(self, x):
            nonlocal counter
            counter += 1
            time.sleep(0.01)
            return x

    class Raise(nn.Module):
        def forward(self, x):
            raise ExpectedException()

    model = nn.Sequential(Pass(), Pass(), Counter(), Raise())
    pipe = Pipe(model, [1, 1, 1, 1], devices=["cpu"] * 4, chunks=3)
    with pytest.raises(ExpectedException):
        pipe(torch.rand(3))
    # If the exception stopped the schedule at once, the counter would be 1; without stopping, 3.
    assert counter == 2


def test_input_pair():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc_a = nn.Linear(1, 1)
            self.fc_b = nn.Linear(1, 1)

        def forward(self, a_and_b):
            a, b = a_and_b
            return (self.fc_a(a), self.fc_b(b))

    pipe = Pipe(nn.Sequential(Two()), balance=[1], devices=["cpu"], chunks=2)
    a = torch.rand(10, 1, requires_grad=True)
    b = torch.rand(10, 1, requires_grad=True)
    a_out, b_out = pipe((a, b))
    (a_out.mean() + b_out.mean()).backward()
    assert a.grad is not None and b.grad is not None


def test_input_singleton():
    class One(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(1, 1)

        def forward(self, only_a):
            (a,) = only_a
            return (self.fc(a),)

    pipe = Pipe(nn.Sequential(One()), balance=[1], devices=["cpu"], chunks=2)
    a = torch.rand(10, 1, requires_grad=True)
    (a_out,) = pipe((a,))
    a_out.mean().backward()
    assert all(p.grad is not None for p in pipe.parameters())
    assert a.grad is not None


def test_input_varargs():
    pipe = Pipe(nn.Sequential(nn.Linear(1, 1)), balance=[1], devices=["cpu"])
    with pytest.raises(TypeError):
        pipe(torch.rand(1), torch.rand(1))


def test_non_tensor():
    class NonTensor(nn.Module):
        def forward(self, _):
            return "hello"

    pipe = Pipe(nn.Sequential(NonTensor()), balance=[1], devices=["cpu"])
    with pytest.raises(TypeError):
        pipe(torch.rand(1))
    with pytest.raises(TypeError):
        pipe("hello")


def test_non_tensor_tuple():
    class NonTensorTuple(nn.Module):
        def forward(self, x):
            return (x, "hello")

    pipe = Pipe(nn.Sequential(NonTensorTuple()), balance=[1], devices=["cpu"])
    with pytest.raises(TypeError):
        pipe(torch.rand(1))
    with pytest.raises(TypeError):
        pipe((torch.rand(1), "hello"))


@pytest.mark.parametrize("checkpoint", ["never", "always", "except_last"])
def test_deferred_batch_norm(checkpoint):
    bn = nn.BatchNorm2d(3)
    pipe_bn = copy.deepcopy(bn)
    pipe = Pipe(
        nn.Sequential(pipe_bn), balance=[1], devices=["cpu"], chunks=2, checkpoint=checkpoint, deferred_batch_norm=True
    )
    x = torch.rand(4, 3, 10, 10)
    pipe(x).mean().backward()
    bn(x)
    assert torch.allclose(pipe[0].running_mean, bn.running_mean, atol=1e-4)
    assert torch.allclose(pipe[0].running_var, bn.running_var, atol=1e-4)


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_deferred_batch_norm_params(checkpoint):
    bn = nn.BatchNorm2d(3)
    pipe_bn = copy.deepcopy(bn)
    pipe = Pipe(
        nn.Sequential(pipe_bn), balance=[1], devices=["cpu"], chunks=1, checkpoint=checkpoint, deferred_batch_norm=True
    )
    x = torch.rand(4, 3, 10, 10)
    pipe(x).mean().backward()
    bn(x).mean().backward()
    assert pipe[0].weight.grad is not None and pipe[0].bias.grad is not None
    assert torch.allclose(pipe[0].weight.grad, bn.weight.grad, atol=1e-4)
    assert torch.allclose(pipe[0].bias.grad, bn.bias.grad, atol=1e-4)


def test_devices():
    a, b, c = nn.Linear(1, 1), nn.Linear(1, 1), nn.Linear(1, 1)
    # There are extra two devices.
    pipe = Pipe(nn.Sequential(a, b, c), balance=[1, 1, 1], devices=["cpu", "cpu", "cpu", "cpu", "cpu:0"])
    assert pipe.devices == [torch.device("cpu")] * 3


def test_partitions():
    a, b = nn.Linear(1, 1), nn.Linear(1, 1)
    pipe = Pipe(nn.Sequential(a, b), balance=[1, 1], devices=CPU2)
    assert isinstance(pipe.partitions, nn.ModuleList)
    assert isinstance(pipe.partitions[0], nn.Sequential)
    assert isinstance(pipe.partitions[1], nn.Sequential)
    assert "partitions.0.0.weight" in pipe.state_dict()


def test_deny_moving():
    a, b = nn.Linear(1, 1), nn.Linear(1, 1)
    pipe = Pipe(nn.Sequential(a, b), balance=[1, 1], devices=CPU2)
    message = str(MOVING_DENIED)
    for call in (
        lambda: pipe.cuda(),
        lambda: pipe.cpu(),
        lambda: pipe.to(torch.device("cpu")),
        lambda: pipe.to(0),
        lambda: pipe.to("cpu"),
        lambda: pipe.to(device=torch.device("cpu")),
        lambda: pipe.to(torch.rand(1)),
        lambda: pipe.to(tensor=torch.rand(1)),
    ):
        with pytest.raises(TypeError, match=message):
            call()
    # Casting is allowed.
    pipe.half()
    pipe.to(torch.double)
    pipe.to(dtype=torch.float)


def test_empty_module():
    pipe = Pipe(nn.Sequential(), [])
    x = torch.tensor(42)
    assert pipe(x) is x
    assert pipe((x,))[0] is x
    with pytest.raises(TypeError):
        pipe(42)


def test_named_children():
    a, b = nn.Linear(1, 1), nn.Linear(1, 1)
    pipe = Pipe(nn.Sequential(OrderedDict([("a", a), ("b", b)])), balance=[1, 1], devices=CPU2)
    names = {n for n, _ in pipe.named_modules()}
    assert "partitions.0.a" in names and "partitions.1.b" in names
    # Pipe doesn't support __getattr__ forwarding to the layers.
    with pytest.raises(AttributeError):
        pipe.a


def test_verify_module_non_sequential():
    with pytest.raises(TypeError, match="module must be nn.Sequential to be partitioned"):
        Pipe(nn.Module(), balance=[1], devices=["cpu"])


def test_verify_module_duplicate_children():
    conv = nn.Conv2d(3, 3, 1)
    with pytest.raises(ValueError, match="module with duplicate children is not supported"):
        Pipe(nn.Sequential(conv, conv), balance=[1, 1], devices=CPU2)


@pytest.mark.skipif(not accelerator_available(), reason="cuda required")
def test_verify_module_duplicate_parameters_on_distinct_devices():
    class Surrogate(nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

    conv = nn.Conv2d(3, 3, 1)
    model = nn.Sequential(Surrogate(conv), Surrogate(conv))
    with pytest.raises(ValueError, match="module with duplicate parameters on distinct devices is not supported"):
        Pipe(model, balance=[1, 1], devices=["cpu", "cuda"])


def test_verify_module_duplicate_parameters_on_same_device():
    class Surrogate(nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

    conv = nn.Conv2d(3, 3, 1)
    model = nn.Sequential(Surrogate(conv), Surrogate(conv))
    Pipe(model, balance=[1, 1], devices=CPU2)


def test_forward_lockstep():
    timeline = []

    class DelayedLog(nn.Module):
        def __init__(self, j, seconds):
            super().__init__()
            self.i = 0
            self.j = j
            self.seconds = seconds

        def forward(self, x):
            time.sleep(self.seconds)
            timeline.append((self.i, self.j))
            self.i += 1
            return x

    model = nn.Sequential(DelayedLog(0, seconds=0), DelayedLog(1, seconds=0.05))
    pipe = Pipe(model, balance=[1, 1], devices=CPU2, chunks=3)
    pipe(torch.rand(3, 1))
    # Expected timeline: (Logs are recorded at !)
    #
    # Partition #0: 0! 1!   2!
    # Partition #1:    000! 111! 222!
    assert timeline == [(0, 0), (1, 0), (0, 1), (2, 0), (1, 1), (2, 1)]


def _order_model(log, n, checkpoint_logs=False):
    class Log(nn.Module):
        def __init__(self, j):
            super().__init__()
            self.j = j

        def forward(self, x):
            i = int(x[0, 1].item())
            log.append(("fwd", i, self.j))
            return _LogBackward.apply(x, log, i, self.j)

    return nn.Sequential(*[Log(j) for j in range(n)])


class _LogBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, log, i, j):
        ctx.log, ctx.i, ctx.j = log, i, j
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.log.append(("bwd", ctx.i, ctx.j))
        return grad, None, None, None


def _indexed_input(m):
    # Column 1 carries the micro-batch index, so each layer can log which micro-batch it sees.
    return torch.stack([torch.ones(m), torch.arange(m, dtype=torch.float)], dim=1).requires_grad_()


def test_backward_order_never():
    log = []
    pipe = Pipe(_order_model(log, 3), [1, 1, 1], devices=["cpu"] * 3, chunks=3, checkpoint="never")
    pipe(_indexed_input(3)).sum().backward()
    forward = [(i, j) for kind, i, j in log if kind == "fwd"]
    backward = [(i, j) for kind, i, j in log if kind == "bwd"]
    assert forward == [(0, 0), (1, 0), (0, 1), (2, 0), (1, 1), (0, 2), (2, 1), (1, 2), (2, 2)]
    assert backward == [(2, 2), (1, 2), (2, 1), (0, 2), (1, 1), (2, 0), (0, 1), (1, 0), (0, 0)]


def test_backward_order_always_recomputes_before_backward():
    log = []
    pipe = Pipe(_order_model(log, 2), [1, 1], devices=CPU2, chunks=2, checkpoint="always")
    pipe(_indexed_input(2)).sum().backward()
    fwd_count = [entry for entry in log if entry[0] == "fwd"]
    assert len(fwd_count) == 8  # 4 checkpointed forwards + 4 recomputations
    after_forward = log[4:]
    for i in range(2):
        for j in range(2):
            # (i, j) is recomputed after the gradient reached its output and before its own backward.
            recompute = after_forward.index(("fwd", i, j))
            assert recompute < after_forward.index(("bwd", i, j))
            if j == 0:
                assert after_forward.index(("bwd", i, 1)) < recompute
    # Per partition, backward in reverse micro-batch order.
    for j in range(2):
        assert after_forward.index(("bwd", 1, j)) < after_forward.index(("bwd", 0, j))


CASES = [([4], 1, "never"), ([2, 2], 4, "except_last"), ([1, 2, 1], 3, "always"), ([3, 1], 2, "never")]


@pytest.mark.parametrize("balance,chunks,checkpoint", CASES)
def test_parity_with_sequential(balance, chunks, checkpoint):
    """Outputs, gradients and parameters after SGD steps equal the plain Sequential's."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 2))
    reference = copy.deepcopy(model)
    pipe = Pipe(model, balance, devices=["cpu"] * len(balance), chunks=chunks, checkpoint=checkpoint)
    for step in range(2):
        x = torch.randn(8, 3, generator=torch.Generator().manual_seed(step))
        xp, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
        out, ref_out = pipe(xp), reference(xr)
        torch.testing.assert_close(out, ref_out)
        out.pow(2).sum().backward()
        ref_out.pow(2).sum().backward()
        torch.testing.assert_close(xp.grad, xr.grad)
        for p, q in zip(pipe.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
        for module in (pipe, reference):
            with torch.no_grad():
                for p in module.parameters():
                    p.add_(p.grad, alpha=-0.1)
                    p.grad = None
    for p, q in zip(pipe.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q)


def test_recomputation_count():
    """Each checkpoint mode runs each partition exactly once per micro-batch plus once per checkpointed one."""
    calls = []

    class Count(nn.Module):
        def __init__(self, j):
            super().__init__()
            self.j = j
            self.fc = nn.Linear(2, 2)

        def forward(self, x):
            calls.append(self.j)
            return self.fc(x)

    for mode, expected in (("always", 16), ("except_last", 14), ("never", 8)):
        calls.clear()
        pipe = Pipe(nn.Sequential(Count(0), Count(1)), [1, 1], devices=CPU2, chunks=4, checkpoint=mode)
        pipe(torch.rand(8, 2)).sum().backward()
        assert len(calls) == expected, mode


def test_worker_threads_stop_when_pipe_is_collected():
    # This pipe's own worker threads, not a count: other threads (workers of pipes collected earlier) may end at any
    # moment on a loaded machine.
    before = set(threading.enumerate())
    pipe = Pipe(nn.Sequential(nn.Linear(1, 1)), [1], devices=["cpu"])
    workers = [t for t in threading.enumerate() if t not in before]
    assert len(workers) == 1 and workers[0].is_alive()
    del pipe
    import gc

    gc.collect()
    workers[0].join(timeout=10)
    assert not workers[0].is_alive()


def _collect_inherited_pipe(rank: int, world_size: int) -> str:
    import gc

    gc.collect()  # the forked rank's copy of the parent's pipe is garbage here; its threads did not survive the fork
    return "collected"


def test_forked_child_collects_an_inherited_pipe_without_waiting():
    from fairscale.fair_dev.testing import run_distributed

    pipe = Pipe(nn.Sequential(nn.Linear(1, 1)), [1], devices=["cpu"])
    cycle = [pipe]
    cycle.append(cycle)  # only the cycle collector frees it, wherever it runs next (in the forked child here)
    del pipe, cycle
    assert run_distributed(_collect_inherited_pipe, 1, timeout=60) == ["collected"]
