# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""ShardedDataParallel features: options matrix, buckets, communication, no_sync/reduce, trainability and mode
changes, attributes, error cases, process sub-groups. Real gloo worlds on CPU."""

import copy
import functools
import gc
import io
import logging
import weakref
from typing import Any, List, Tuple

import pytest
import torch
import torch._dynamo  # noqa: F401  # torch optimizers import it on first use: once here, not once per forked rank
import torch.distributed as dist
from torch import nn

from _models import FailInBackward

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.fair_dev.testing.testing_compare import check_same_models_across_ranks
from fairscale.internal.collectives import count_collectives
from fairscale.nn.data_parallel import ShardedDataParallel
from fairscale.optim import OSS

TIMEOUT = 120.0


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 3), *(nn.Linear(3, 3) for _ in range(5)))


class _WithBuffer(nn.Module):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.net = _mlp()
        self.register_buffer("scale", torch.full((3,), float(rank + 1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) * self.scale


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 2, generator=torch.Generator().manual_seed(100 * step + rank))


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _capture_logs() -> _Records:
    records = _Records()
    logging.getLogger().addHandler(records)
    logging.getLogger().setLevel(logging.INFO)
    return records


# ------------------------------------------------------------------------------------------------------------------
# World size 2


def _step_case(rank: int, broadcast_buffers: bool, accumulate: bool, buffer: int, reduce_fp16: bool) -> None:
    model = _WithBuffer(rank)
    next(model.parameters()).requires_grad_(False)
    oss = OSS(model.parameters(), lr=0.01, momentum=0.99)
    sdp = ShardedDataParallel(
        model, oss, broadcast_buffers=broadcast_buffers, reduce_buffer_size=buffer, reduce_fp16=reduce_fp16
    )
    # Synchronised at start-up, buffers included.
    check_same_models_across_ranks(sdp, None, params_should_be_equal=True, check_broadcast_buffers=True)
    model.scale.fill_(float(rank + 1))  # per-rank again: only the forward's broadcast may equalise it

    def closure() -> torch.Tensor:
        sdp.zero_grad(set_to_none=True)
        ctx = sdp.no_sync() if accumulate else _null()
        with ctx:
            loss = sdp(_batch(0, rank)).abs().sum()
            loss.backward()
        return loss

    for _ in range(3):
        oss.step(closure=closure)
        # Buffers are broadcast at each forward, except inside no_sync().
        synced_buffers = broadcast_buffers and not accumulate
        check_same_models_across_ranks(sdp, None, params_should_be_equal=True, check_broadcast_buffers=synced_buffers)


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _bucket_layout_case(rank: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 3), nn.Linear(3, 4))
    oss = OSS(model.parameters(), lr=0.1)
    sdp = ShardedDataParallel(model, oss, reduce_buffer_size=2**20)
    sdp(torch.rand(2, 2)).sum().backward()
    assert {b.destination: b.buffer.numel() for b in sdp._reducer.buckets} == {0: 21, 1: 16}
    # Gradients are views of their bucket.
    for bucket in sdp._reducer.buckets:
        for p in bucket._params:
            assert bucket.slot(p).data_ptr() == p.grad.data_ptr()


def _communication_case(rank: int, world_size: int, buffer: int) -> None:
    model = _WithBuffer(rank)
    oss = OSS(model.parameters(), lr=0.1)
    sdp = ShardedDataParallel(model, oss, reduce_buffer_size=buffer)
    n_params = len(list(model.parameters()))
    with count_collectives() as counter:
        loss = sdp(_batch(0, rank)).sum()
    assert counter.count() == counter.count("broadcast") == 1, counter.summary()  # the one buffer
    with count_collectives() as counter:
        loss.backward()
    expected = len(sdp._reducer.buckets) if buffer else n_params
    assert counter.count("reduce") == expected, counter.summary()
    # Before the first reduction: the ranks check that they reduce the same parameters (two integers).
    assert counter.count("all_reduce") == 1 and counter.count() == expected + 1, counter.summary()
    if not buffer:
        # Unbucketed gradients only survive on their owner.
        for p in model.parameters():
            assert (p.grad is not None) == (oss._param_to_rank[p] == rank)
    with sdp.no_sync():
        with count_collectives() as counter:
            sdp(_batch(1, rank)).sum().backward()
    assert counter.count() == 0, "no_sync: no buffer broadcast, no reduction"
    with count_collectives() as counter:
        oss.step()
    assert counter.count("broadcast") == world_size


def _manual_reduce_case(rank: int, world_size: int, buffer: int) -> None:
    model = _mlp()
    ref_model = copy.deepcopy(model)
    oss = OSS(model.parameters(), lr=0.1)
    ref_oss = OSS(ref_model.parameters(), lr=0.1)
    sdp = ShardedDataParallel(model, oss, reduce_buffer_size=buffer)
    ref = ShardedDataParallel(ref_model, ref_oss, reduce_buffer_size=buffer)
    for step in range(2):
        sdp.zero_grad()
        ref.zero_grad()
        with sdp.no_sync():
            sdp(_batch(step, rank)).sum().backward()
        sdp.reduce()
        with pytest.raises(AssertionError, match="No grads waiting to be reduced"):
            sdp.reduce()
        ref(_batch(step, rank)).sum().backward()
        oss.step()
        ref_oss.step()
        for a, b in zip(model.parameters(), ref_model.parameters()):
            assert torch.equal(a, b)


def _no_sync_nesting_case(rank: int) -> None:
    model = _mlp()
    sdp = ShardedDataParallel(model, OSS(model.parameters(), lr=0.1))
    with sdp.no_sync():
        with sdp.no_sync():
            pass
        assert sdp._reducer.accumulating, "leaving an inner no_sync keeps the outer one active"
    assert not sdp._reducer.accumulating


def _train_eval_case(rank: int) -> None:
    model = _mlp()
    oss = OSS(model.parameters(), lr=0.1)
    sdp = ShardedDataParallel(model, oss)
    sdp(_batch(0, rank)).sum().backward()
    sdp.zero_grad()
    sdp.eval()
    sdp(_batch(1, rank))
    first = next(model.parameters())
    assert first.grad is None or not first.grad.any()
    assert sdp._reducer.state.name == "NONE", "no hooks in eval mode"
    sdp.train()
    sdp(_batch(2, rank)).sum().backward()
    grads = [torch.zeros(1) for _ in range(2)]
    local = torch.tensor([float(first.grad.abs().sum()) if first.grad is not None else 0.0])
    dist.all_gather(grads, local)
    assert sum(g.item() for g in grads) > 0, "training again reduces gradients"


def _refresh_count_case(rank: int, warn: bool) -> None:
    model = _mlp()
    oss = OSS(model.parameters(), lr=0.1)
    sdp = ShardedDataParallel(model, oss, warn_on_trainable_params_changed=warn)
    calls: List[int] = []
    original = sdp.refresh_trainable

    def counting() -> None:
        calls.append(1)
        original()

    sdp.refresh_trainable = counting  # type: ignore[method-assign]
    records = _capture_logs()
    try:
        sdp(_batch(0, rank)).sum().backward()
        next(model.parameters()).requires_grad_(False)
        for step in range(1, 4):
            sdp(_batch(step, rank)).sum().backward()
    finally:
        logging.getLogger().removeHandler(records)
    # Set-up at the first forward, one refresh for the change; upstream refreshed at every forward without the
    # warning (the reference mask was only updated when warning).
    assert len(calls) == 2, calls
    warnings = [m for m in records.messages if "trainable params changed" in m]
    assert len(warnings) == (1 if warn else 0)


def _dtype_change_case(rank: int) -> None:
    model = _mlp()
    oss = OSS(model.parameters(), lr=0.1)
    sdp = ShardedDataParallel(model, oss)
    sdp(_batch(0, rank)).sum().backward()
    assert sdp.to(None, dtype=torch.float64) is sdp
    sdp.zero_grad()
    sdp(_batch(1, rank).double()).sum().backward()
    oss.step()
    assert all(p.dtype == torch.float64 for p in model.parameters())
    check_same_models_across_ranks(sdp, None, params_should_be_equal=True, check_broadcast_buffers=False)
    assert all(b.buffer.dtype == torch.float64 for per in oss.buckets.values() for b in per.values())


def _torch_cast_case(rank: int, cast: str, on_inner: bool) -> None:
    # nn.Module.double() / .half() / .bfloat16() (past ShardedDataParallel.to) left the gradient buckets in fp32:
    # the next backward failed inside torch ("attempting to assign a gradient with dtype 'float' to a tensor with
    # grad_dtype 'Double'"). The buckets are rebuilt at the next forward; the run equals one without buckets.
    results = []
    for buffer in (0, 2**20):
        model = _mlp()
        oss = OSS(model.parameters(), lr=0.1, momentum=0.9)
        sdp = ShardedDataParallel(model, oss, reduce_buffer_size=buffer)
        sdp(_batch(0, rank)).sum().backward()
        oss.step()
        getattr(model if on_inner else sdp, cast)()
        dtype = next(model.parameters()).dtype
        for step in (1, 2):
            oss.zero_grad()
            sdp(_batch(step, rank).to(dtype)).sum().backward()
            oss.step()
        results.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results)), f"{cast}: buckets change the result"
    assert all(b.buffer is None or b.buffer.dtype == dtype for b in sdp._reducer.buckets)


def _cast_run(rank: int, how: str, setting: str) -> List[torch.Tensor]:
    overwrite = torch.__future__.get_overwrite_module_params_on_conversion()
    swap = torch.__future__.get_swap_module_params_on_conversion()
    model = _mlp()
    oss = OSS(model.parameters(), lr=0.1, momentum=0.9)
    sdp = ShardedDataParallel(model, oss)
    sdp(_batch(0, rank)).sum().backward()
    oss.step()
    before = list(model.parameters())
    try:
        torch.__future__.set_overwrite_module_params_on_conversion(setting == "overwrite")
        torch.__future__.set_swap_module_params_on_conversion(setting == "swap")
        sdp.double() if how == "double" else sdp.to(None, dtype=torch.float64)
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(overwrite)
        torch.__future__.set_swap_module_params_on_conversion(swap)
    # The objects OSS steps and the hooks watch (new ones were trained by nobody: silently wrong, every rank).
    assert [id(p) for p in model.parameters()] == [id(p) for p in before]
    for step in (1, 2):
        oss.zero_grad()
        sdp(_batch(step, rank).double()).sum().backward()
        oss.step()
    return [p.detach().clone() for p in model.parameters()]


def _cast_under_torch_future_setting_case(rank: int, how: str) -> None:
    want = _cast_run(rank, how, "default")
    for setting in ("overwrite", "swap"):
        got = _cast_run(rank, how, setting)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), f"{how} under the {setting} setting"


def _cast_with_kept_gradients_case(rank: int, world_size: int, buffer: int, casts: str, swap: bool = False) -> None:
    # Gradients kept across a step (no zero_grad), then model.double(): the cast gave each bucketed gradient storage
    # of its own, the rebuild forgot that it held the step's reduced value, and the next backward reduced it again
    # with the other ranks' gradients (0.15 off the plain model after one more step; found by a review, session 37).
    # "half,float": two casts with no forward between (torch's own, past the wrapper) leave the buckets in their
    # dtype, so no rebuild comes; the moved gradients were reduced again (1.0 off; session 38).
    # swap: under torch's swap setting, a cast of the inner module raised "Couldn't swap Linear.weight": the hooks and
    # marks held weak references to the parameters and gradients, which torch.utils.swap_tensors refuses (session 39).
    model = _mlp()
    reference = copy.deepcopy(model)
    oss = OSS(model.parameters(), lr=0.1)
    sdp = ShardedDataParallel(model, oss, reduce_buffer_size=buffer)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    dtype = torch.float32

    def backward(step: int) -> None:
        sdp(_batch(step, rank).to(dtype)).sum().backward()
        (sum(reference(_batch(step, r).to(dtype)).sum() for r in range(world_size)) / world_size).backward()

    backward(1)
    oss.step()
    ref_opt.step()
    backward(2)  # onto the step's gradients
    swap_setting = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(swap)
    try:
        for name in casts.split(","):
            dtype = getattr(torch, name)
            if casts == "double" and not swap:
                sdp.double()
            else:
                model.to(dtype)
            reference.to(dtype)
            oss.step()
            ref_opt.step()
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap_setting)
    backward(3)
    oss.step()
    ref_opt.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q)


class _Armed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return FailInBackward.apply(x, True) if self.armed else x


def _failed_backward_case(
    rank: int, zero: str, accumulate: bool, buffer: int = 0, completed_first: bool = False
) -> None:
    # A backward that raised after some gradients went to their (async, unbucketed) reductions left that work
    # pending: gloo wrote the reduced values into the gradients after the user's zero_grad(), and the callbacks ran
    # in the next backward (parameters off a twin that skipped the batch in most runs; found by a fuzz of recovery
    # after exceptions, session 39). Several trials: the race was timing dependent. completed_first: a completed
    # backward of the step before the failing one; its reduced values, parked by the failing backward, came back
    # after an optimizer's zero_grad(), which could not see them (found by a review, session 39).
    for trial in range(3):
        models, optimizers, wrappers = [], [], []
        for _ in range(2):
            torch.manual_seed(0)
            net = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), _Armed(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
            optimizer = OSS(net.parameters(), lr=0.1, momentum=0.9)
            models.append(net)
            optimizers.append(optimizer)
            wrappers.append(ShardedDataParallel(net, optimizer, reduce_buffer_size=buffer))
        generator = torch.Generator().manual_seed(100 + 7 * trial + rank)
        for i in range(4):
            x = torch.randn(4, 8, generator=generator)
            if i == 1:
                if completed_first:
                    wrappers[0](x * 0.5).pow(2).mean().backward()
                models[0][2].armed = True
                with pytest.raises(RuntimeError, match="injected"):
                    wrappers[0](x).pow(2).mean().backward()
                models[0][2].armed = False
                if zero == "model":
                    wrappers[0].zero_grad()
                else:
                    optimizers[0].zero_grad(set_to_none=zero == "optimizer")
                continue
            for sdp, optimizer in zip(wrappers, optimizers):
                if accumulate:
                    with sdp.no_sync():
                        sdp(x * 0.5).pow(2).mean().backward()
                sdp(x).pow(2).mean().backward()
                optimizer.step()
                optimizer.zero_grad()
        for p, q in zip(models[0].parameters(), models[1].parameters()):
            assert torch.equal(p, q), (trial, zero, accumulate)


def _released_gradient_is_freed_case(rank: int) -> None:
    # The marks of reduced unbucketed gradients hold them (a weak reference would make torch refuse to swap them):
    # one released by zero_grad() must still be freed by the next forward, before its activations (session 39).
    model = _mlp()
    oss = OSS(model.parameters(), lr=0.1)
    sdp = ShardedDataParallel(model, oss, reduce_buffer_size=0)
    sdp(_batch(0, rank)).sum().backward()
    oss.step()
    released = [weakref.ref(p.grad) for p in model.parameters() if p.grad is not None]
    assert released  # the owner keeps its reduced gradients
    oss.zero_grad()
    sdp(_batch(1, rank))
    gc.collect()
    assert all(ref() is None for ref in released)


def _unused_parameter_case(rank: int) -> None:
    # Each hook rebuild (the first forward, eval -> train) gave a parameter no rank uses a zero gradient from its
    # bucket slot, even right after optimizer.zero_grad(): weight decay then moved it (0.024 after one step). A plain
    # optimizer, DDP and reduce_buffer_size=0 leave it as it is.
    model = _WithUnused()
    unused = model.unused
    before = unused.weight.detach().clone()
    oss = OSS(model.parameters(), lr=0.1, weight_decay=0.5, momentum=0.9)
    sdp = ShardedDataParallel(model, oss, reduce_buffer_size=2**20)
    for step in range(3):
        if step == 1:
            sdp.eval()
            sdp(_batch(step, rank))
            sdp.train()
        oss.zero_grad()
        sdp(_batch(step, rank)).sum().backward()
        assert unused.weight.grad is None, f"step {step}: a zero gradient appeared"
        oss.step()
    assert torch.equal(unused.weight, before)


class _WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.used = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 3))
        self.unused = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def _rewrap_case(rank: int) -> None:
    """A dropped wrapper is collected and stops reducing: wrapping the model again reduces each gradient once."""
    model = _mlp()
    oss = OSS(model.parameters(), lr=0.1)
    sdp = ShardedDataParallel(model, oss, reduce_buffer_size=0)
    sdp(_batch(0, rank)).sum().backward()
    dead = weakref.ref(sdp._reducer)
    del sdp
    gc.collect()
    assert dead() is None, "the hooks kept the wrapper alive"
    sdp = ShardedDataParallel(model, oss, reduce_buffer_size=0)
    sdp.zero_grad()
    with count_collectives() as counter:
        sdp(_batch(1, rank)).sum().backward()
    assert counter.count("reduce") == len(list(model.parameters())), counter.summary()


def _non_contiguous_buffer_case(rank: int) -> None:
    # ESPnet registers its mel filterbank transposed: collectives refuse non-contiguous memory, torch's DDP syncs it.
    model = nn.Linear(4, 3)
    model.register_buffer("filterbank", torch.full((3, 5), float(rank)).t())
    sdp = ShardedDataParallel(model, OSS(model.parameters(), lr=0.1))
    # The startup sync gave every rank rank 0's values, in the buffer's own (still transposed) storage.
    assert torch.equal(model.filterbank, torch.zeros(5, 3)) and not model.filterbank.is_contiguous()
    with torch.no_grad():
        model.filterbank.fill_(float(rank + 1))  # the ranks drift apart
    sdp(torch.randn(2, 4)).sum().backward()  # the forward broadcasts the buffers again
    assert torch.equal(model.filterbank, torch.ones(5, 3)), model.filterbank
    model.filterbank.fill_(float(rank + 5))
    sdp.sync_buffers()  # not blocking: the staged copy is written back before it returns
    assert torch.equal(model.filterbank, torch.full((5, 3), 5.0)), model.filterbank


def _expanded_buffer_case(rank: int) -> None:
    # A buffer made with expand() has stride 0: its memory is one row, which the write-back fills once.
    model = nn.Linear(4, 3)
    row = torch.full((1, 3), float(rank))
    model.register_buffer("expanded", row.expand(4, 3))
    sdp = ShardedDataParallel(model, OSS(model.parameters(), lr=0.1))
    assert torch.equal(model.expanded, torch.zeros(4, 3)) and model.expanded.stride() == (0, 1)
    row.fill_(float(rank + 1))
    sdp(torch.randn(2, 4)).sum().backward()
    assert torch.equal(model.expanded, torch.ones(4, 3)) and model.expanded.data_ptr() == row.data_ptr()


def _overlapping_buffer_case(rank: int) -> None:
    # Windows over one storage (as_strided, elements shared without a stride of 0) take rank 0's values as well.
    model = nn.Linear(4, 3)
    storage = torch.arange(4.0) + 10 * rank
    model.register_buffer("windows", storage.as_strided((3, 2), (1, 1)))
    ShardedDataParallel(model, OSS(model.parameters(), lr=0.1))
    assert torch.equal(storage, torch.arange(4.0)), storage
    assert torch.equal(model.windows, torch.tensor([[0.0, 1.0], [1.0, 2.0], [2.0, 3.0]])), model.windows


def _world2_body(rank: int, world_size: int) -> None:
    cases: List[Tuple[str, Any]] = []
    for broadcast_buffers in (True, False):
        for accumulate in (False, True):
            for buffer in (0, 2**20):
                for fp16 in (False, True):
                    name = f"step,bb={broadcast_buffers},accum={accumulate},buffer={buffer},fp16={fp16}"
                    args = (rank, broadcast_buffers, accumulate, buffer, fp16)
                    cases.append((name, lambda a=args: _step_case(*a)))
    cases += [
        ("bucket_layout", lambda: _bucket_layout_case(rank)),
        ("communication,buffer=0", lambda: _communication_case(rank, world_size, 0)),
        ("communication,buffer=2**20", lambda: _communication_case(rank, world_size, 2**20)),
        ("manual_reduce,buffer=0", lambda: _manual_reduce_case(rank, world_size, 0)),
        ("manual_reduce,buffer=2**20", lambda: _manual_reduce_case(rank, world_size, 2**20)),
        ("no_sync_nesting", lambda: _no_sync_nesting_case(rank)),
        ("train_eval_change", lambda: _train_eval_case(rank)),
        ("refresh_count,warn", lambda: _refresh_count_case(rank, True)),
        ("refresh_count,no_warn", lambda: _refresh_count_case(rank, False)),
        ("dtype_change", lambda: _dtype_change_case(rank)),
        ("torch_double_on_wrapper", lambda: _torch_cast_case(rank, "double", False)),
        ("torch_double_on_module", lambda: _torch_cast_case(rank, "double", True)),
        ("torch_bfloat16_on_wrapper", lambda: _torch_cast_case(rank, "bfloat16", False)),
        ("double_under_torch_future_settings", lambda: _cast_under_torch_future_setting_case(rank, "double")),
        ("cast_with_kept_gradients_unbucketed", lambda: _cast_with_kept_gradients_case(rank, 2, 0, "double")),
        ("cast_with_kept_gradients_bucketed", lambda: _cast_with_kept_gradients_case(rank, 2, 2**20, "double")),
        ("round_trip_with_kept_gradients", lambda: _cast_with_kept_gradients_case(rank, 2, 2**20, "half,float32")),
        (
            "swapped_cast_with_kept_gradients_unbucketed",
            lambda: _cast_with_kept_gradients_case(rank, 2, 0, "double", True),
        ),
        ("swapped_cast_with_kept_gradients", lambda: _cast_with_kept_gradients_case(rank, 2, 2**20, "double", True)),
        ("swapped_round_trip", lambda: _cast_with_kept_gradients_case(rank, 2, 2**20, "half,float32", True)),
        ("to_under_torch_future_settings", lambda: _cast_under_torch_future_setting_case(rank, "to")),
        ("released_gradient_is_freed", lambda: _released_gradient_is_freed_case(rank)),
        ("failed_backward,model_zero_grad", lambda: _failed_backward_case(rank, "model", False)),
        ("failed_backward,model_zero_grad,no_sync", lambda: _failed_backward_case(rank, "model", True)),
        ("failed_backward,optimizer_zero_grad,no_sync", lambda: _failed_backward_case(rank, "optimizer", True)),
        *[
            (
                f"failed_second_backward,buffer={buffer},{zero}",
                functools.partial(_failed_backward_case, rank, zero, False, buffer, True),
            )
            for buffer in (0, 2**20)
            for zero in ("optimizer", "optimizer,set_to_none=False")
        ],
        ("unused_parameter_after_rebuilds", lambda: _unused_parameter_case(rank)),
        ("rewrap", lambda: _rewrap_case(rank)),
        ("non_contiguous_buffer", lambda: _non_contiguous_buffer_case(rank)),
        ("expanded_buffer", lambda: _expanded_buffer_case(rank)),
        ("overlapping_buffer", lambda: _overlapping_buffer_case(rank)),
    ]
    run_cases(cases)


def test_features_world_of_two() -> None:
    run_distributed(_world2_body, 2, timeout=TIMEOUT)


# ------------------------------------------------------------------------------------------------------------------
# World size 1: attributes and error cases


class _Tripwire(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Linear(2, 3, bias=False)
        self.tripwire = nn.Parameter(torch.LongTensor([3, 5]), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


def _attributes_case() -> None:
    model = _mlp()
    model.banana = "yellow"  # type: ignore[assignment]
    sdp = ShardedDataParallel(model, OSS(model.parameters(), lr=0.1))
    assert sdp.banana == "yellow"
    with pytest.raises(AttributeError):
        sdp.orange
    assert sdp.is_multi_device_module is False and sdp.device_type == "cpu" and sdp.module is model


def _grad_grad_case() -> None:
    model = _mlp()
    sdp = ShardedDataParallel(model, OSS(model.parameters(), lr=0.1))
    first = next(model.parameters())
    first.grad = torch.zeros_like(first, requires_grad=True)
    with pytest.raises(RuntimeError, match="gradients that don't require grad"):
        sdp(torch.rand(2, 2))


def _mixed_types_case() -> None:
    model = _Tripwire()
    sdp = ShardedDataParallel(model, OSS(model.parameters(), lr=0.1))
    sdp(torch.rand(2, 2)).sum().backward()


def _device_types_case() -> None:
    model = _mlp()
    oss = OSS(model.parameters(), lr=0.1)
    model.extra = nn.Linear(1, 1, device="meta")
    with pytest.raises(AssertionError, match="same type of devices"):
        ShardedDataParallel(model, oss)


def _fp16_with_buckets_case() -> None:
    model = _mlp()
    records = _capture_logs()
    try:
        sdp = ShardedDataParallel(model, OSS(model.parameters(), lr=0.1), reduce_fp16=True)
    finally:
        logging.getLogger().removeHandler(records)
    assert sdp._reduce_fp16 is False
    assert any("fp16 gradient reduction is not compatible" in m for m in records.messages)


def _bucket_size_case() -> None:
    model = _mlp()
    for size in (-5, 1.5, "big"):  # -5 was taken for "no buckets" silently
        with pytest.raises(ValueError, match=r"reduce_buffer_size must be a whole number >= 0"):
            ShardedDataParallel(model, OSS(model.parameters(), lr=0.1), reduce_buffer_size=size)
    sdp = ShardedDataParallel(model, OSS(model.parameters(), lr=0.1), reduce_buffer_size=float(2**10))
    assert isinstance(sdp._buffer_max_size, int)


def _copy_case() -> None:
    # "cannot pickle 'ProcessGroup' object" from inside the copy before (AveragedModel deep-copies its module).
    model = nn.Linear(3, 2)
    sdp = ShardedDataParallel(model, OSS(model.parameters(), lr=0.1))
    for attempt in (lambda: copy.deepcopy(sdp), lambda: torch.save(sdp, io.BytesIO())):
        with pytest.raises(TypeError, match=r"ShardedDataParallel cannot be copied or pickled.*copy.deepcopy\(model"):
            attempt()
    averaged = torch.optim.swa_utils.AveragedModel(sdp.module)  # what the message suggests
    assert averaged.module is not model


def _world1_body(rank: int, world_size: int) -> None:
    run_cases(
        [
            ("copies", _copy_case),
            ("bucket_size", _bucket_size_case),
            ("ddp_attributes", _attributes_case),
            ("catch_grad_grad", _grad_grad_case),
            ("mixed_types", _mixed_types_case),
            ("device_types", _device_types_case),
            ("fp16_with_buckets", _fp16_with_buckets_case),
            ("to_a_dtype_given_first", _to_dtype_first_case),
        ]
    )


def _to_dtype_first_case() -> None:
    # sdp.to(torch.float64): nn.Module.to takes a dtype first; the wrapper's signature (upstream's: device first)
    # passed it to torch.device, which refused it confusingly (found by a review, session 38).
    model = nn.Linear(2, 2)
    sdp = ShardedDataParallel(model, OSS(model.parameters(), lr=0.1))
    assert sdp.to(torch.float64) is sdp and model.weight.dtype == torch.float64
    sdp(torch.randn(3, 2, dtype=torch.float64)).sum().backward()
    assert model.weight.grad is not None and model.weight.grad.dtype == torch.float64
    # dtype as a keyword alone (``nn.Module.to(dtype=...)``): upstream's signature required a device (session 39).
    assert sdp.to(dtype=torch.float32) is sdp and model.weight.dtype == torch.float32
    sdp(torch.randn(3, 2)).sum().backward()
    assert model.weight.grad is not None and model.weight.grad.dtype == torch.float32


def test_single_rank_features() -> None:
    run_distributed(_world1_body, 1, timeout=TIMEOUT)


# ------------------------------------------------------------------------------------------------------------------
# A sub-group of a world of four


def _multiple_groups_body(rank: int, world_size: int, buffer: int) -> None:
    sub_ranks = [0, 2]
    sub = dist.new_group(sub_ranks)
    if rank not in sub_ranks:
        return
    model = _WithBuffer(rank)
    ref = copy.deepcopy(model)
    ref.scale.fill_(1.0)  # the buffer of group rank 0 (global rank 0) is broadcast at every forward
    oss = OSS(model.parameters(), lr=0.1, momentum=0.9, group=sub)
    sdp = ShardedDataParallel(model, oss, process_group=sub, reduce_buffer_size=buffer)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        sdp.zero_grad()
        ref_opt.zero_grad()
        sdp(_batch(step, rank)).sum().backward()
        for r in sub_ranks:
            (ref(_batch(step, r)).sum() / len(sub_ranks)).backward()
        oss.step()
        ref_opt.step()
        check_same_models_across_ranks(sdp, sub, params_should_be_equal=True, check_broadcast_buffers=True)
        for a, b in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("buffer", [0, 2**20])
def test_multiple_groups(buffer: int) -> None:
    run_distributed(_multiple_groups_body, 4, buffer, timeout=TIMEOUT)
