# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""DistributedPipeline graphs that used to give silently wrong results or wait for the RPC timeout, in one
two-worker TensorPipe world (rank 0 drives, rank 1 serves):

* a RemoteModule added twice is refused (its second call's consumers were wired to the first call, and its
  parameters were stepped twice); shared weights through a second RemoteModule on the same module give the
  outputs and the single optimizer step of the plain model;
* a layer feeding no other layer, a layer without inputs and output indexes that do not fit ``num_outputs`` are
  refused when the graph or the pipeline is built; a module whose outputs do not match its ``num_outputs`` makes
  the result raise;
* an output that cannot be sent, or cannot be unpickled where it arrives, and an exception that does not survive
  pickling reach the caller as exceptions at once (they waited for the RPC timeout, and ``rpc.shutdown()`` hung);
* ``pipe.eval()`` / ``pipe.train()`` reach the remote modules.

The RPC timeout is short so that a regression fails in seconds instead of waiting a minute per forward.
"""

import copy
import functools
import os
import tempfile
import threading
import time
from typing import Any, Tuple

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.nn as nn
from torch.distributed.nn import RemoteModule
from torch.distributed.optim import DistributedOptimizer

from fairscale.experimental.nn.distributed_pipeline import DistributedPipeline, PipelineModulesGraph
from fairscale.experimental.nn.distributed_pipeline.trace import make_graph
from fairscale.fair_dev.testing.engine import run_cases, run_ranks

RPC_TIMEOUT = 10.0
W0, W1 = "worker0/cpu", "worker1/cpu"


def _copy_of(rref: rpc.RRef) -> nn.Module:
    return copy.deepcopy(rref.local_value())


def _local_copy(remote: RemoteModule) -> nn.Module:
    return rpc.rpc_sync(remote.on, _copy_of, args=(remote.get_module_rref(),))


def _training_flags(rref: rpc.RRef) -> Tuple[bool, ...]:
    return tuple(m.training for m in rref.local_value().modules())


class _Split(nn.Module):
    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        return x[:, :1], x[:, 1:]


class _Concat(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.cat([a, b], dim=1)


class _Twice(nn.Module):
    """Calls ``a`` twice (shared weights): ``c(a(tanh(a(x))))``."""

    def __init__(self, a: RemoteModule, tanh: RemoteModule, c: RemoteModule) -> None:
        super().__init__()
        self.a, self.tanh, self.c = a, tanh, c

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.a(self.tanh(self.a(x))))


class _ReturnsEarlier(nn.Module):
    """Returns ``a``'s output although ``b`` is called last."""

    def __init__(self, a: RemoteModule, b: RemoteModule) -> None:
        super().__init__()
        self.a, self.b = a, b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        self.b(h)
        return h


class _Shared(nn.Module):
    """``lin2(tanh(lin(x)))`` where ``lin2`` is a second RemoteModule on ``lin``'s module."""

    def __init__(self, lin: RemoteModule, tanh: RemoteModule, lin2: RemoteModule) -> None:
        super().__init__()
        self.lin, self.tanh, self.lin2 = lin, tanh, lin2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(self.tanh(self.lin(x)))


def _check_graph_construction() -> None:
    a = RemoteModule(W1, nn.Linear, (3, 3))
    tanh = RemoteModule(W0, nn.Tanh, ())
    c = RemoteModule(W0, nn.Linear, (3, 2))
    graph = PipelineModulesGraph()
    graph.add_layer(a, [0])
    graph.add_layer(tanh, [a])
    with pytest.raises(ValueError, match="already in the graph as layer 0"):
        graph.add_layer(a, [tanh])
    with pytest.raises(ValueError, match="a is called more than once"):
        make_graph(_Twice(a, tanh, c))
    with pytest.raises(ValueError, match="must return the output of its last RemoteModule call"):
        make_graph(_ReturnsEarlier(a, c))
    # A layer without inputs was never fed: the forward waited for the RPC timeout.
    with pytest.raises(ValueError, match="layer 2 .* needs at least one input"):
        graph.add_layer(c, [])
    with pytest.raises(ValueError, match="model input index -1 is negative"):
        graph.add_layer(c, [-1])
    with pytest.raises(TypeError, match="a layer input must be"):
        graph.add_layer(c, ["0"])  # type: ignore[list-item]
    # A local module was taken, and building the pipeline failed on a missing get_module_rref (session 45).
    with pytest.raises(TypeError, match="layer 2 must be a torch.distributed.nn.RemoteModule.*got ReLU"):
        graph.add_layer(nn.ReLU(), [tanh])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_outputs must be None or a positive int"):
        graph.add_layer(c, [tanh], num_outputs=0)
    with pytest.raises(ValueError, match="already in the graph as layer 2"):
        graph.add_sequence([c, RemoteModule(W0, nn.ReLU, ()), c], [tanh])
    assert [n.module for n in graph.nodes] == [a, tanh]  # the refused layers were not added, nor a part of the chain

    split = RemoteModule(W1, _Split, ())
    relu = RemoteModule(W0, nn.ReLU, ())
    outputs = PipelineModulesGraph()
    outputs.add_layer(split, [0], num_outputs=2)
    # An index past num_outputs failed on the producer's worker and the forward waited for the RPC timeout.
    with pytest.raises(ValueError, match=r"output index must be an int in \[0, 2\)"):
        outputs.add_layer(relu, [(split, 2)])
    # A whole-output reference to a multi-output layer silently got output 0.
    with pytest.raises(ValueError, match=r"declares num_outputs=2; refer to one of its outputs as \(module, k\)"):
        outputs.add_layer(relu, [split])
    plain = PipelineModulesGraph()
    plain.add_layer(split, [0])
    # An index into a layer added without num_outputs was ignored: the consumer got the whole output.
    with pytest.raises(ValueError, match="reads output 1, but that layer was added without num_outputs"):
        plain.add_layer(relu, [(split, 1)])
    plain.add_layer(relu, [(split, 0)])  # upstream's spelling of the whole output: accepted, as upstream

    # A layer nobody reads: added last, the pipeline returned its output instead of the model's; added before the
    # output layer, dist_autograd.backward waited for the RPC timeout.
    probe = RemoteModule(W0, nn.Linear, (3, 4))
    for probe_last in (True, False):  # layer 1 (the output layer c, or the probe) is the one nobody reads
        dead_end = PipelineModulesGraph()
        dead_end.add_layer(a, [0])
        if not probe_last:
            dead_end.add_layer(probe, [a])
        dead_end.add_layer(c, [a])
        if probe_last:
            dead_end.add_layer(probe, [a])
        with pytest.raises(ValueError, match="layer 1 .* feeds no other layer"):
            DistributedPipeline(dead_end, chunks=2)


def _check_declared_outputs_checked() -> None:
    """A module whose outputs do not match its num_outputs: the result raises (consumers got rows of a tensor)."""
    ident = RemoteModule(W1, nn.Identity, ())
    concat = RemoteModule(W0, _Concat, ())
    graph = PipelineModulesGraph()
    graph.add_layer(ident, [0], num_outputs=2)
    graph.add_layer(concat, [(ident, 0), (ident, 1)])
    with pytest.raises(TypeError, match="num_outputs=2, but returned Tensor"):
        DistributedPipeline(graph, chunks=2)(torch.arange(8.0).reshape(4, 2)).to_here()
    split = RemoteModule(W1, _Split, ())
    short = PipelineModulesGraph()
    short.add_layer(split, [0], num_outputs=3)
    short.add_layer(RemoteModule(W0, _Concat, ()), [(split, 0), (split, 1)])
    with pytest.raises(ValueError, match="num_outputs=3, but returned 2 outputs"):
        DistributedPipeline(short, chunks=2)(torch.ones(4, 2)).to_here()
    right = PipelineModulesGraph()
    right.add_layer(split, [0], num_outputs=2)
    right.add_layer(RemoteModule(W0, _Concat, ()), [(split, 1), (split, 0)])
    x = torch.arange(8.0).reshape(4, 2)
    torch.testing.assert_close(DistributedPipeline(right, chunks=2)(x).to_here(), x.flip(1))


class _Unsendable(nn.Module):
    def forward(self, x: torch.Tensor) -> Any:
        return (x, threading.Lock())


def _explode() -> None:
    raise RuntimeError("this value cannot be rebuilt here")


class _BadOnArrival:
    def __reduce__(self) -> Any:
        return (_explode, ())


class _ArrivesBroken(nn.Module):
    def forward(self, x: torch.Tensor) -> Any:
        return (x, _BadOnArrival())


class _OddError(Exception):
    """Pickles, but cannot be unpickled (its __init__ takes two arguments)."""

    def __init__(self, what: str, code: int) -> None:
        super().__init__(f"{what} (code {code})")


class _RaisesOdd(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise _OddError("odd failure in a partition", 7)


class _First(nn.Module):
    def forward(self, pair: Any) -> Any:
        return pair[0] if isinstance(pair, tuple) else pair


def _check_send_failures_reach_the_caller() -> None:
    for cls, match in [
        (_Unsendable, "could not send input 0 of micro-batch .*cannot pickle"),
        (_ArrivesBroken, "could not send input 0 of micro-batch .*cannot be rebuilt here"),
        (_RaisesOdd, "_OddError: odd failure in a partition"),
    ]:
        graph = PipelineModulesGraph()
        graph.add_sequence([RemoteModule(W1, cls, ()), RemoteModule(W0, _First, ())], [0])
        pipe = DistributedPipeline(graph, chunks=2)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=match):
            pipe(torch.ones(4, 2)).to_here()
        assert time.monotonic() - start < RPC_TIMEOUT / 2, cls.__name__  # not the RPC timeout
    graph = PipelineModulesGraph()
    graph.add_sequence([RemoteModule(W1, nn.ReLU, ()), RemoteModule(W0, _First, ())], [0])
    x = torch.tensor([[1.0, -1.0], [-2.0, 2.0]])
    torch.testing.assert_close(DistributedPipeline(graph, chunks=2)(x).to_here(), x.relu())


def _check_shared_weights() -> None:
    """A second RemoteModule on the same module: outputs of the plain model, and one optimizer step with the
    summed gradient (its parameters were listed, and stepped, once per partition)."""
    torch.manual_seed(0)
    lin = RemoteModule(W1, nn.Linear, (3, 3))
    tanh = RemoteModule(W0, nn.Tanh, ())
    lin2 = RemoteModule.init_from_module_rref(W1, lin.get_module_rref())
    local = _local_copy(lin)
    x = torch.randn(4, 3)
    ref = local(torch.tanh(local(x)))
    ref.pow(2).sum().backward()
    lr = 0.1
    expected = [(p - lr * p.grad).detach() for p in local.parameters()]

    graph = PipelineModulesGraph()
    graph.add_sequence([lin, tanh, lin2], [0])
    pipe = DistributedPipeline(graph, chunks=2)
    assert len(pipe.partitions) == 3
    rrefs = pipe.parameter_rrefs()
    assert len(rrefs) == 2, len(rrefs)
    optimizer = DistributedOptimizer(torch.optim.SGD, rrefs, lr=lr)
    with dist_autograd.context() as context_id:
        y = pipe(x).to_here()
        torch.testing.assert_close(y, ref.detach())
        dist_autograd.backward(context_id, [y.pow(2).sum()])
        optimizer.step(context_id)
    stepped = _local_copy(lin)
    for p, q in zip(stepped.parameters(), expected):
        torch.testing.assert_close(p, q)
    # make_graph traces such a second RemoteModule (nn.Module.named_modules failed on it).
    traced = DistributedPipeline(make_graph(_Shared(lin, tanh, lin2)), chunks=2)
    with torch.no_grad():
        torch.testing.assert_close(traced(x).to_here(), stepped(torch.tanh(stepped(x))))


def _check_train_and_eval_reach_the_workers() -> None:
    torch.manual_seed(1)
    lin = RemoteModule(W1, nn.Linear, (16, 16))
    drop = RemoteModule(W1, nn.Dropout, (0.5,))  # in one partition with lin
    drop0 = RemoteModule(W0, nn.Dropout, (0.5,))  # a partition of its own
    graph = PipelineModulesGraph()
    graph.add_sequence([lin, drop, drop0], [0])
    pipe = DistributedPipeline(graph, chunks=2)
    assert [len(p.nodes) for p in pipe.partitions] == [2, 1]
    local = _local_copy(lin)
    x = torch.randn(8, 16)
    assert pipe.eval() is pipe and not pipe.training
    for remote in (lin, drop, drop0):
        assert rpc.rpc_sync(remote.on, _training_flags, args=(remote.get_module_rref(),)) == (False,)
    with torch.no_grad():
        torch.testing.assert_close(pipe(x).to_here(), local(x))  # dropout is the identity in eval mode
    pipe.train()
    assert pipe.training
    assert rpc.rpc_sync(W1.split("/")[0], _training_flags, args=(drop.get_module_rref(),)) == (True,)
    with torch.no_grad():
        assert not torch.allclose(pipe(x).to_here(), local(x))
    with pytest.raises(ValueError, match="training mode is expected to be boolean"):
        pipe.train("no")  # type: ignore[arg-type]


def _body(rank: int, world_size: int, init_file: str) -> None:
    options = rpc.TensorPipeRpcBackendOptions(
        init_method=f"file://{init_file}", _transports=["uv"], rpc_timeout=RPC_TIMEOUT
    )
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
    try:
        if rank == 0:
            run_cases(
                [
                    ("graph_construction", _check_graph_construction),
                    ("declared_outputs_checked", _check_declared_outputs_checked),
                    ("send_failures_reach_the_caller", _check_send_failures_reach_the_caller),
                    ("shared_weights", _check_shared_weights),
                    ("train_and_eval", _check_train_and_eval_reach_the_workers),
                ]
            )
    finally:
        rpc.shutdown()  # hung after a send failure that left an RRef fork pending


def test_distributed_pipeline_graph_checks() -> None:
    # Without a process group (run_ranks): only rank 0 runs the cases while rank 1 serves RPCs.
    with tempfile.TemporaryDirectory() as d:
        run_ranks(functools.partial(_body, world_size=2, init_file=os.path.join(d, "rpc_init")), 2, timeout=150)
