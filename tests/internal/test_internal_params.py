# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Tests of fairscale.internal.params."""

import math
import threading
import time
from collections import OrderedDict, namedtuple
from typing import Any, Dict

import pytest
import torch
import torch.distributed as dist

from fairscale.fair_dev.testing.engine import run_distributed
from fairscale.internal.params import (
    Workhandle,
    calc_grad_norm,
    conversion_in_place,
    get_global_rank,
    recursive_copy_to_device,
)

Pair = namedtuple("Pair", ["a", "b"])


def test_workhandle() -> None:
    handle = Workhandle("work", None)
    assert handle.handle == "work" and handle.callback is None
    calls = []
    handle = Workhandle(None, lambda: calls.append(1))
    assert handle.callback is not None
    handle.callback()
    assert calls == [1]


def test_recursive_copy_to_device() -> None:
    meta = torch.device("meta")
    value: Dict[str, Any] = {
        "t": torch.ones(2),
        "list": [torch.zeros(1), 3],
        "tuple": (torch.zeros(1), "x"),
        "pair": Pair(torch.zeros(1), 2),
        "od": OrderedDict(z=torch.zeros(1)),
    }
    out = recursive_copy_to_device(value, non_blocking=True, device=meta)
    assert out["t"].device == meta and out["t"].shape == (2,)
    assert isinstance(out["list"], list) and out["list"][0].device == meta and out["list"][1] == 3
    assert isinstance(out["tuple"], tuple) and out["tuple"][0].device == meta and out["tuple"][1] == "x"
    assert type(out["pair"]) is Pair and out["pair"].a.device == meta
    assert type(out["od"]) is OrderedDict and out["od"]["z"].device == meta
    assert value["t"].device.type == "cpu"  # copies, the input is unchanged
    assert recursive_copy_to_device("s", False, meta) == "s"


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, math.inf])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_calc_grad_norm_matches_torch(norm_type: float, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, dtype=dtype)) for shape in [(3, 4), (5,), (2, 2)]]
    for p in params[:2]:  # the last parameter has no grad and must be skipped
        p.grad = torch.randn_like(p)
    norm = calc_grad_norm(params, norm_type)
    grads = [p.grad.float() for p in params[:2]]
    # torch.nn.utils.get_total_norm (torch >= 2.6) is the norm of the per-tensor norms, which is what this computes.
    reference = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(g, norm_type) for g in grads]), norm_type
    )
    assert norm.dtype == dtype and norm.dim() == 0
    torch.testing.assert_close(norm.float(), reference.to(dtype).float())


def test_calc_grad_norm_edge_cases() -> None:
    assert torch.equal(calc_grad_norm([], 2.0), torch.tensor(0.0))
    assert torch.equal(calc_grad_norm([torch.nn.Parameter(torch.ones(2))], 2.0), torch.tensor(0.0))
    p = torch.nn.Parameter(torch.ones(0))
    p.grad = torch.ones(0)
    assert float(calc_grad_norm([p], math.inf)) == 0.0
    big = torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))
    big.grad = torch.full((2,), 30000.0, dtype=torch.float16)  # squares overflow fp16
    assert float(calc_grad_norm([big], 2.0)) == pytest.approx(30000.0 * math.sqrt(2), rel=1e-3)


@pytest.mark.parametrize("norm_type", [1.0, 2.0, math.inf])
def test_calc_grad_norm_of_fp64_and_complex_gradients_matches_torch(norm_type: float) -> None:
    """A fixed fp32 computation refused fp64 gradients (narrowing) and complex ones (OSS.clip_grad_norm failed on
    any fp64 model); fp64 gradients are measured in fp64, complex ones by their magnitudes, as torch's clipping."""
    torch.manual_seed(0)
    for dtypes, expected in (
        ((torch.float64, torch.float64), torch.float64),
        ((torch.complex64, torch.float32), torch.float32),
        ((torch.complex128, torch.float32), torch.float64),
        ((torch.float32, torch.complex128), torch.float32),  # the first parameter's real dtype, as before
    ):
        params = [torch.nn.Parameter(torch.randn(3, 2, dtype=d)) for d in dtypes]
        for p in params:
            p.grad = torch.randn_like(p) * 1e3
        norm = calc_grad_norm(params, norm_type)
        reference = torch.nn.utils.clip_grad_norm_(params, 1e30, norm_type)
        assert norm.dtype == expected and norm.dim() == 0, (dtypes, norm)
        torch.testing.assert_close(norm.double(), reference.double(), rtol=1e-6, atol=0)


def _global_rank_body(rank: int, ws: int) -> None:
    assert get_global_rank(None, 2) == 2
    assert get_global_rank(dist.group.WORLD, 1) == 1
    group = dist.new_group([2, 1])
    if rank in (1, 2):
        assert [get_global_rank(group, r) for r in range(2)] == [1, 2]


def test_get_global_rank() -> None:
    run_distributed(_global_rank_body, 3)


def test_conversions_in_two_threads_keep_the_users_setting() -> None:
    # torch's conversion settings are process-wide: a second thread entering conversion_in_place while the first was
    # inside saved the first's temporary values and, leaving last, restored them for good (session 38).
    inside, first_left = threading.Event(), threading.Event()

    def first() -> None:
        with conversion_in_place():
            inside.set()
            time.sleep(0.2)  # the second thread tries to enter meanwhile
        first_left.set()

    def second() -> None:
        inside.wait(5)
        with conversion_in_place():
            first_left.wait(1)  # leaves after the first (at once where the first already left)

    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        threads = [threading.Thread(target=first), threading.Thread(target=second)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        assert torch.__future__.get_overwrite_module_params_on_conversion() is True
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(False)
