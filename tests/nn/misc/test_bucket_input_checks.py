# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""ParamBucket/GradBucket reject bad input with explicit errors (ValueError, TypeError, RuntimeError, each also an
AssertionError as upstream's bare asserts were) that name the call and say what to do, and still do under
``python -O``, which strips bare asserts."""

import os
import subprocess
import sys
import textwrap
from typing import Callable, Type

import pytest
import torch

from fairscale.nn.misc import GradBucket, ParamBucket

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _param(*shape: int, dtype: torch.dtype = torch.float32) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.ones(*shape, dtype=dtype))


def _param_with_grad(*shape: int) -> torch.nn.Parameter:
    param = _param(*shape)
    param.grad = torch.ones(*shape)
    return param


# ParamBucket -------------------------------------------------------------------------------------------------------


def _param_added_twice() -> None:
    bucket = ParamBucket(10, torch.float32, "cpu")
    param = _param(3)
    bucket.add_param(param)
    bucket.add_param(param)


def _param_of_other_dtype() -> None:
    ParamBucket(10, torch.float32, "cpu").add_param(_param(3, dtype=torch.float64))


def _param_on_other_device() -> None:
    # A "meta" bucket: another device without an accelerator.
    ParamBucket(10, torch.float32, "meta").add_param(_param(3))


def _param_moved_with_its_bucket() -> None:
    bucket = ParamBucket(10, torch.float32, "cpu")
    bucket.add_param(_param(3))
    bucket.to(device="meta", keep_param_alignment=True)


def _param_too_large() -> None:
    ParamBucket(10, torch.float32, "cpu").add_param(_param(4, 3))


def _param_into_full_bucket() -> None:
    bucket = ParamBucket(10, torch.float32, "cpu")
    bucket.add_param(_param(8))
    bucket.add_param(_param(3))


def _param_bucket_without_buffer_add() -> None:
    bucket = ParamBucket(10, torch.float32, "cpu")
    bucket.buffer = None
    bucket.add_param(_param(3))


def _param_bucket_without_buffer_to() -> None:
    bucket = ParamBucket(10, torch.float32, "cpu")
    bucket.buffer = None
    bucket.to(device="cpu", dtype=torch.float16)


PARAM_BUCKET_CASES = [
    pytest.param(_param_added_twice, ValueError, r"ParamBucket.add_param: .*checked in twice", id="added-twice"),
    pytest.param(
        _param_of_other_dtype,
        TypeError,
        r"ParamBucket.add_param: Different types for the bucket and the param: the parameter is torch.float64 but "
        r"the bucket is torch.float32; use a bucket of the parameter's dtype",
        id="dtype",
    ),
    pytest.param(
        _param_on_other_device,
        ValueError,
        r"ParamBucket.add_param: Different devices .* the parameter is on cpu but the bucket is on meta",
        id="device",
    ),
    pytest.param(_param_moved_with_its_bucket, ValueError, r"ParamBucket.to: Different devices", id="to-device"),
    pytest.param(
        _param_too_large,
        ValueError,
        r"ParamBucket.add_param: the parameter does not fit .* 12 elements but only 10 of the bucket's 10 are free",
        id="too-large",
    ),
    pytest.param(_param_into_full_bucket, ValueError, r"only 2 of the bucket's 10 are free", id="full"),
    pytest.param(
        _param_bucket_without_buffer_add,
        RuntimeError,
        r"ParamBucket.add_param: the bucket has no buffer",
        id="add-no-buffer",
    ),
    pytest.param(
        _param_bucket_without_buffer_to, RuntimeError, r"ParamBucket.to: the bucket has no buffer", id="to-no-buffer"
    ),
]


@pytest.mark.parametrize("call, error, match", PARAM_BUCKET_CASES)
def test_param_bucket_rejects(call: Callable[[], None], error: Type[Exception], match: str) -> None:
    with pytest.raises(error, match=match) as info:
        call()
    assert isinstance(info.value, AssertionError), "code written for upstream catches AssertionError"


def test_param_bucket_rejection_leaves_bucket_usable() -> None:
    bucket = ParamBucket(10, torch.float32, "cpu")
    with pytest.raises(TypeError):
        bucket.add_param(_param(3, dtype=torch.float64))
    param = _param(10)
    bucket.add_param(param)  # a failed add took no room
    assert bucket.buffer is not None and bucket._fill == 10 and param.data_ptr() == bucket.buffer.data_ptr()


# GradBucket --------------------------------------------------------------------------------------------------------


def _grad_added_twice() -> None:
    bucket = GradBucket(10, torch.float32, "cpu", destination=0)
    param = _param_with_grad(3)
    bucket.add_grad(param)
    bucket.add_grad(param)


def _grad_of_other_dtype() -> None:
    param = _param(3, dtype=torch.float64)
    GradBucket(10, torch.float32, "cpu", destination=0).add_grad(param)


def _grad_on_other_device() -> None:
    GradBucket(10, torch.float32, "meta", destination=0).add_grad(_param_with_grad(3))


def _grad_cast_with_its_bucket() -> None:
    bucket = GradBucket(10, torch.float32, "cpu", destination=0)
    bucket.add_grad(_param_with_grad(3))
    bucket.to(device="cpu", dtype=torch.float16, keep_param_alignment=True)


def _grad_too_large() -> None:
    GradBucket(5, torch.float32, "cpu", destination=0).add_grad(_param_with_grad(2, 3))


def _grad_into_collapsed_bucket() -> None:
    bucket = GradBucket(10, torch.float32, "cpu", destination=0)
    bucket.add_grad(_param_with_grad(3))
    bucket.collapse()
    bucket.add_grad(_param_with_grad(3))


def _collapse_with_released_grad() -> None:
    bucket = GradBucket(10, torch.float32, "cpu", destination=0)
    param = _param_with_grad(3)
    bucket.add_grad(param)
    param.grad = None
    bucket.collapse()


def _rebuild_without_params() -> None:
    GradBucket(10, torch.float32, "cpu", destination=0).rebuild()


def _shrink_collapsed() -> None:
    bucket = GradBucket(10, torch.float32, "cpu", destination=0)
    bucket.add_grad(_param_with_grad(3))
    bucket.collapse()
    bucket.shrink()


def _shrink_without_buffer() -> None:
    bucket = GradBucket(10, torch.float32, "cpu", destination=0)
    bucket.buffer = None
    bucket.shrink()


def _slot_without_buffer() -> None:
    bucket = GradBucket(10, torch.float32, "cpu", destination=0)
    param = _param_with_grad(3)
    bucket.add_grad(param)
    bucket.buffer = None
    bucket.slot(param)


def _grad_bucket_without_buffer_to() -> None:
    bucket = GradBucket(10, torch.float32, "cpu", destination=0)
    bucket.buffer = None
    bucket.to(device="cpu")


GRAD_BUCKET_CASES = [
    pytest.param(_grad_added_twice, ValueError, r"GradBucket.add_grad: .*checked in twice", id="added-twice"),
    pytest.param(
        _grad_of_other_dtype,
        TypeError,
        r"GradBucket.add_grad: Different types for the bucket and the gradient: the parameter is torch.float64",
        id="dtype",
    ),
    pytest.param(
        _grad_on_other_device,
        ValueError,
        r"GradBucket.add_grad: Different devices .* the parameter is on cpu but the bucket is on meta",
        id="device",
    ),
    pytest.param(_grad_cast_with_its_bucket, TypeError, r"GradBucket.to: Different types", id="to-dtype"),
    pytest.param(
        _grad_too_large,
        ValueError,
        r"GradBucket.add_grad: the gradient does not fit .* 6 elements but only 5 .* can_add_grad_view",
        id="too-large",
    ),
    pytest.param(
        _grad_into_collapsed_bucket,
        RuntimeError,
        r"GradBucket.add_grad: cannot add a gradient to a collapsed bucket .* call rebuild\(\) first",
        id="collapsed-add",
    ),
    pytest.param(
        _collapse_with_released_grad,
        RuntimeError,
        r"GradBucket.collapse: cannot collapse, 1 gradient\(s\) .* already been released",
        id="collapse-released",
    ),
    pytest.param(
        _rebuild_without_params,
        RuntimeError,
        r"GradBucket.rebuild: cannot rebuild a buffer with no parameters",
        id="rebuild-empty",
    ),
    pytest.param(
        _shrink_collapsed, RuntimeError, r"GradBucket.shrink: cannot shrink a collapsed bucket", id="shrink-collapsed"
    ),
    pytest.param(
        _shrink_without_buffer, RuntimeError, r"GradBucket.shrink: the bucket has no buffer", id="shrink-no-buffer"
    ),
    pytest.param(_slot_without_buffer, RuntimeError, r"GradBucket.slot: the bucket has no buffer", id="slot-no-buffer"),
    pytest.param(
        _grad_bucket_without_buffer_to, RuntimeError, r"GradBucket.to: the bucket has no buffer", id="to-no-buffer"
    ),
]


@pytest.mark.parametrize("call, error, match", GRAD_BUCKET_CASES)
def test_grad_bucket_rejects(call: Callable[[], None], error: Type[Exception], match: str) -> None:
    with pytest.raises(error, match=match) as info:
        call()
    assert isinstance(info.value, AssertionError), "code written for upstream catches AssertionError"


def test_collapse_with_released_grad_releases_nothing() -> None:
    bucket = GradBucket(10, torch.float32, "cpu", destination=0)
    kept, released = _param_with_grad(3), _param_with_grad(2)
    bucket.add_grad(kept)
    bucket.add_grad(released)
    released.grad = None
    with pytest.raises(RuntimeError, match="already been released"):
        bucket.collapse()
    assert kept.grad is not None and torch.equal(kept.grad, torch.ones(3))
    assert bucket.buffer is not None and bucket.buffer.numel() == 10
    released.grad = bucket.slot(released).detach()  # what the message advises
    bucket.collapse()
    assert kept.grad is None and released.grad is None


# python -O ---------------------------------------------------------------------------------------------------------

_OPTIMIZED_SCRIPT = textwrap.dedent("""
    import sys

    import torch

    from fairscale.nn.misc import ParamBucket

    if not sys.flags.optimize:
        sys.exit("not running under python -O")
    assert False, "python -O strips bare asserts, so this line does nothing"
    bucket = ParamBucket(10, torch.float32, "cpu")
    try:
        bucket.add_param(torch.nn.Parameter(torch.ones(3, dtype=torch.float64)))
    except TypeError as e:
        print(type(e).__name__, e)
        sys.exit(0)
    sys.exit("a float64 parameter was checked into a float32 bucket")
    """)


@pytest.mark.skip_under_python_O
def test_param_bucket_check_survives_python_O() -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    result = subprocess.run(
        [sys.executable, "-O", "-c", _OPTIMIZED_SCRIPT],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "FairscaleTypeError ParamBucket.add_param: Different types for the bucket and the param" in result.stdout


# Session 37 (randomized sequences of calls) ------------------------------------------------------------------------


@pytest.mark.parametrize("what", ["too_large", "other_dtype"])
def test_a_refused_add_grad_leaves_the_parameter_without_a_gradient(what: str) -> None:
    # The zero gradient was created before the checks: an optimizer then stepped the parameter (weight decay,
    # momentum) where torch skips a parameter whose gradient is None.
    bucket = GradBucket(4, torch.float32, "cpu", destination=0)
    param = _param(10) if what == "too_large" else _param(2, dtype=torch.float64)
    with pytest.raises((ValueError, TypeError)):
        bucket.add_grad(param)
    assert param.grad is None
    bucket.add_grad(_param(2))  # still usable


def test_grad_bucket_cast_while_holding_gradients_says_what_to_do() -> None:
    bucket = GradBucket(10, torch.float32, "cpu", destination=0)
    param = _param(3)
    bucket.add_grad(param)
    grad = param.grad
    with pytest.raises(TypeError, match="convert the parameters first.*keep_param_alignment=False"):
        bucket.to("cpu", torch.float16)
    assert param.grad is grad and bucket.buffer is not None and bucket.buffer.dtype == torch.float32
    bucket.to("cpu", torch.float16, keep_param_alignment=False)  # the buffer alone, as the message says
    assert bucket.buffer is not None and bucket.buffer.dtype == torch.float16


def test_shrink_of_an_empty_grad_bucket_is_refused() -> None:
    # It made a zero-size buffer, which marks a collapsed bucket that rebuild() cannot rebuild without parameters:
    # the bucket could never be used again.
    bucket = GradBucket(10, torch.float32, "cpu", destination=0)
    with pytest.raises(RuntimeError, match="holds no gradient"):
        bucket.shrink()
    bucket.add_grad(_param(2))
    bucket.shrink()
    assert bucket.buffer is not None and bucket.buffer.numel() == 2
