# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Where upstream asserted on user input, the clear exception is also an ``AssertionError`` (both callers work)."""

from typing import Any, Callable, Type

import pytest
import torch
from torch import nn

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.internal.containers import unpack_kwargs, unpack_non_tensors
from fairscale.internal.reduce_scatter_bucketer import ReduceScatterBucketer
from fairscale.internal.errors import FairscaleRuntimeError, FairscaleTypeError, FairscaleValueError, p_assert
from fairscale.nn.misc import FlattenParamsWrapper
from fairscale.nn.wrap import auto_wrap, enable_wrap, wrap


def _raises_both(clear: Type[Exception], fn: Callable[[], Any], match: str) -> None:
    with pytest.raises(clear, match=match) as info:
        fn()
    assert isinstance(info.value, AssertionError), f"{type(info.value).__name__} is not an AssertionError"


def test_error_types() -> None:
    for cls, base in ((FairscaleValueError, ValueError), (FairscaleTypeError, TypeError)):
        assert issubclass(cls, base) and issubclass(cls, AssertionError)
    assert issubclass(FairscaleRuntimeError, RuntimeError) and issubclass(FairscaleRuntimeError, AssertionError)
    p_assert(True, "unused")
    with pytest.raises(AssertionError, match="the message"):
        p_assert(0, "the message")


def _wrap_without_wrapper_cls() -> None:
    with enable_wrap():
        wrap(nn.Linear(1, 1))


def test_single_process_inputs() -> None:
    _raises_both(ValueError, lambda: unpack_kwargs(("a", "b"), (1,)), "keyword names")
    _raises_both(ValueError, lambda: unpack_non_tensors((), {"is_tensor": [True], "objects": []}), "do not fit")
    _raises_both(ValueError, _wrap_without_wrapper_cls, "needs a wrapper_cls")
    mixed = nn.Linear(2, 2)
    mixed.bias.requires_grad_(False)
    _raises_both(ValueError, lambda: FlattenParamsWrapper(mixed), "mixes requires_grad")
    _raises_both(ValueError, _auto_wrap_wrapped, "already wrapped")
    _raises_both(RuntimeError, _flat_state_dict_unflattened, "needs a flattened wrapper")


class _Wrapper(nn.Module):
    def __init__(self, module: nn.Module, **kwargs: Any) -> None:
        super().__init__()
        self.module = module


def _auto_wrap_wrapped() -> None:
    with enable_wrap(wrapper_cls=_Wrapper):
        auto_wrap(nn.Sequential(_Wrapper(nn.Linear(2, 2)), nn.Linear(2, 2)))


def _flat_state_dict_unflattened() -> None:
    fpw = FlattenParamsWrapper(nn.Linear(2, 2))
    with fpw.unflatten_params():
        fpw.flat_state_dict()


def _nested_calls() -> None:
    from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP

    inner = FSDP(nn.Linear(2, 2))
    outer = FSDP(nn.Sequential(inner, nn.Linear(2, 2)))
    outer(torch.randn(1, 2)).sum().backward()

    def no_sync_inner() -> None:
        with inner.no_sync():
            pass

    _raises_both(RuntimeError, no_sync_inner, "root")
    _raises_both(RuntimeError, lambda: inner.clip_grad_norm_(1.0), "root")
    _raises_both(RuntimeError, lambda: outer.append_shared_param(nn.Parameter(torch.ones(1))), "before the first")
    bucketer = ReduceScatterBucketer(bucket_cap_mb=0)
    _raises_both(ValueError, lambda: bucketer.reduce_scatter_async([torch.ones(2)] * 2, None), "one chunk per rank")


def _fsdp_world(rank: int, world_size: int) -> None:
    run_cases([("nested instance calls", _nested_calls)])


def test_fsdp_upstream_asserts() -> None:
    run_distributed(_fsdp_world, 1, timeout=60)
