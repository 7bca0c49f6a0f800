# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""LayerwiseMemoryTracker reused across models and sessions, and on models it used to break: modules at the address of
freed ones, the all-gather listener after stop(), sparse tensors, outputs that hold no tensor first (or none), and a
root name traced in an earlier session."""

import gc
import warnings
from typing import Any, List, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from fairscale.experimental.tooling.layer_memory_tracker import LayerwiseMemoryTracker, ProcessGroupTracker
from fairscale.fair_dev.testing.engine import run_distributed

Traced = List[Tuple[str, bool]]


def _traced(tracker: LayerwiseMemoryTracker) -> Traced:
    return [(t.module_name, t.is_forward) for t in tracker.memory_traces]


def _step(model: nn.Module, x: torch.Tensor) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model(x).sum().backward()


def test_new_modules_at_freed_modules_addresses_are_hooked() -> None:
    # The tracker kept the id() of every module it hooked until stop(): a new module that CPython put at the address
    # of a freed one was taken for it and got no hooks, so its layer had no trace, silently.
    tracker = LayerwiseMemoryTracker()
    x = torch.randn(1, 2)
    reused_addresses = 0
    try:
        for _ in range(20):  # CPython reuses freed objects' memory for new ones of their size, often not at once
            old = nn.ModuleList(nn.Linear(2, 2) for _ in range(50))
            tracker.monitor(old)
            freed = {id(m) for m in old.modules()}
            del old
            gc.collect()
            new = nn.ModuleList(nn.Linear(2, 2) for _ in range(50))
            reused_addresses += sum(id(m) in freed for m in new.modules())
            tracker.monitor(new)
            tracker.clear_traces()
            for layer in new:
                layer(x)
            assert [t.module_name for t in tracker.forward_traces] == [str(i) for i in range(50)]
            del new
            gc.collect()
            if reused_addresses >= 5:
                break
    finally:
        tracker.stop()
    assert reused_addresses > 0, "no new module took a freed module's address: nothing was checked"


def test_a_fresh_model_every_round_is_fully_traced() -> None:
    tracker = LayerwiseMemoryTracker()
    counts = []
    for _ in range(30):
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        tracker.monitor(model)
        before = len(tracker.forward_traces)
        _step(model, torch.randn(3, 4))
        counts.append(len(tracker.forward_traces) - before)
        del model
        gc.collect()
    tracker.stop()
    assert counts == [3] * 30


def test_a_reused_tracker_traces_as_a_fresh_one() -> None:
    # The names traced in one session outlived stop(): the root "" was a leaf (a Linear) there, and the Sequential
    # monitored next got a backward trace for its root, which is a container.
    seq = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    linear = nn.Linear(4, 4)
    reused = LayerwiseMemoryTracker()
    reused.monitor(linear)
    _step(linear, torch.randn(3, 4))
    reused.stop()
    reused.clear_traces()
    reused.monitor(seq)
    _step(seq, torch.randn(3, 4))
    reused.stop()
    fresh = LayerwiseMemoryTracker()
    fresh.monitor(seq)
    _step(seq, torch.randn(3, 4))
    fresh.stop()
    assert (
        _traced(reused)
        == _traced(fresh)
        == [("0", True), ("1", True), ("2", True), ("2", False), ("1", False), ("0", False)]
    )


def test_a_forward_of_an_earlier_session_records_no_backward() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    tracker = LayerwiseMemoryTracker()
    tracker.monitor(model)
    loss = model(torch.randn(3, 4)).sum()
    tracker.stop()
    tracker.clear_traces()
    tracker.monitor(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss.backward()
    tracker.stop()
    assert _traced(tracker) == []


def test_sparse_embedding_gradients_and_sparse_activations() -> None:
    # The storage comparison read untyped_storage() of every tensor: NotImplementedError on a sparse one, which
    # aborted the backward (no gradient written) or the forward.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    reference = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    reference.load_state_dict(model.state_dict())
    ids = torch.tensor([[1, 2, 3]])
    tracker = LayerwiseMemoryTracker()
    tracker.monitor(model)
    _step(model, ids)
    tracker.stop()
    _step(reference, ids)
    assert model[0].weight.grad.is_sparse
    assert torch.equal(model[0].weight.grad.to_dense(), reference[0].weight.grad.to_dense())
    assert torch.equal(model[1].weight.grad, reference[1].weight.grad)
    assert _traced(tracker) == [("0", True), ("1", True), ("1", False), ("0", False)]

    sparse_model = nn.Sequential(nn.Linear(4, 4), _ToSparse(), _ToDense())
    tracker = LayerwiseMemoryTracker()
    tracker.monitor(sparse_model)
    sparse_model(torch.randn(2, 4))
    tracker.stop()
    by_name = {t.module_name: t for t in tracker.forward_traces}
    nnz = by_name["1"].event.memory_activations // (4 + 2 * 4)  # a fp32 value and two int64 indices per element
    assert by_name["1"].event.memory_activations == nnz * (4 + 2 * 4) and 0 < nnz <= 8
    assert by_name["2"].event.memory_activations == 2 * 4 * 4


class _ToSparse(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to_sparse()


class _ToDense(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to_dense()


class _Counter(nn.Module):
    """A side-effect module that returns nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> None:
        self.calls += 1


class _NoneFirst(nn.Module):
    def forward(self, x: torch.Tensor) -> Tuple[None, torch.Tensor]:
        return None, x * 2


class _Number(nn.Module):
    def forward(self, x: torch.Tensor) -> int:
        return 3


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.count = _Counter()
        self.number = _Number()
        self.lin = nn.Linear(4, 4)
        self.pair = _NoneFirst()

    def forward(self, x: torch.Tensor) -> Any:
        self.count(x)
        self.number(x)
        return self.pair(self.lin(x))[1]


def test_outputs_that_hold_no_tensor_first_do_not_break_the_model() -> None:
    # torch's legacy module backward hook walks output[0][0]... to a tensor: a module returning None, a number or
    # (None, tensor) failed with TypeError deep inside torch once monitored, and ran fine unmonitored.
    torch.manual_seed(0)
    model, reference = _Net(), _Net()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(3, 4)
    tracker = LayerwiseMemoryTracker()
    tracker.monitor(model)
    _step(model, x)
    tracker.stop()
    _step(reference, x)
    assert torch.equal(model.lin.weight.grad, reference.lin.weight.grad)
    assert _traced(tracker) == [
        ("count", True),
        ("number", True),
        ("lin", True),
        ("pair", True),
        ("pair", False),  # the first tensor of (None, tensor)
        ("lin", False),
    ]


def _listener_after_stop_body(rank: int, world_size: int) -> List[List[Tuple[str, bool, int]]]:
    from fairscale.nn import FullyShardedDataParallel as FSDP

    warnings.simplefilter("ignore")
    group = ProcessGroupTracker(dist.new_group())
    torch.manual_seed(0)
    kwargs = dict(process_group=group, flatten_parameters=False, forward_prefetch=False, backward_prefetch=False)
    model = FSDP(nn.Sequential(nn.Linear(10, 10), nn.ReLU(), FSDP(nn.Linear(10, 10), **kwargs)), **kwargs)
    x = torch.randn(4, 10)
    tracker = LayerwiseMemoryTracker()
    runs = []
    for _ in range(2):
        tracker.clear_traces()
        tracker.monitor(model)
        model(x).sum().backward()
        dist.barrier()
        tracker.stop()
        assert group.listener is None  # stop() detached the tracker from the group
        runs.append([(t.module_name, t.is_forward, t.all_gathered) for t in tracker.memory_traces])
        for _ in range(2):  # unmonitored steps: their gathers were counted in the next session's first trace
            model(x).sum().backward()
    return runs


def test_stop_detaches_the_all_gather_listener() -> None:
    for first, second in run_distributed(_listener_after_stop_body, 2, timeout=180):
        assert first == second
        assert [g for _, _, g in first if g] == [440, 440, 440]
