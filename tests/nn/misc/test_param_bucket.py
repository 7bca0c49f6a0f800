# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""ParamBucket: parameters become views of one flat buffer, keep their values, and follow dtype changes."""

import pytest
import torch

from fairscale.nn.misc import ParamBucket


def _params(*shapes):
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(*s)) for s in shapes]


def test_param_values_conserved():
    bucket = ParamBucket(100, torch.float32, "cpu")
    params = _params((3, 4), (5,), (2, 2, 2))
    before = [p.detach().clone() for p in params]
    for p in params:
        bucket.add_param(p)
    assert bucket._fill == 12 + 5 + 8
    offset = 0
    for p, value in zip(params, before):
        assert torch.equal(p, value)
        # The parameter is a view of its slice: writing the buffer writes the parameter.
        assert p.data_ptr() == bucket.buffer[offset:].data_ptr()
        offset += p.numel()
    bucket.buffer.fill_(3.0)
    assert all(bool((p == 3.0).all()) for p in params)


def test_max_size():
    bucket = ParamBucket(10, torch.float32, "cpu")
    with pytest.raises(AssertionError):
        bucket.add_param(_params((4, 3))[0])


def test_double_check_int():
    bucket = ParamBucket(100, torch.float32, "cpu")
    param = _params((3,))[0]
    bucket.add_param(param)
    with pytest.raises(AssertionError, match="checked in twice"):
        bucket.add_param(param)


def test_dtype_mismatch():
    bucket = ParamBucket(100, torch.float32, "cpu")
    with pytest.raises(AssertionError, match="Different types for the bucket and the param"):
        bucket.add_param(torch.nn.Parameter(torch.ones(3, dtype=torch.float64)))


def test_type_change():
    bucket = ParamBucket(100, torch.float32, "cpu")
    params = _params((3, 4), (5,))
    for p in params:
        bucket.add_param(p)
    values = [p.detach().clone() for p in params]
    bucket.to(dtype=torch.float16, device="cpu", keep_param_alignment=True)
    assert bucket.buffer.dtype == torch.float16
    assert all(p.dtype == torch.float16 for p in params)
    bucket.to(dtype=torch.float32, device="cpu", keep_param_alignment=True)
    for p, v in zip(params, values):
        assert p.dtype == torch.float32
        torch.testing.assert_close(p.detach(), v, atol=1e-2, rtol=1e-2)
    bucket.buffer.zero_()
    assert all(bool((p == 0).all()) for p in params), "params must follow the new buffer"


def test_keep_param_alignment_false_leaves_params_on_old_storage():
    bucket = ParamBucket(10, torch.float32, "cpu")
    param = _params((4,))[0]
    bucket.add_param(param)
    bucket.to(dtype=torch.float16, device="cpu", keep_param_alignment=False)
    bucket.buffer.zero_()
    assert param.dtype == torch.float32 and bool((param != 0).any())
